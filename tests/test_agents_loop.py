"""The AutoAct loop on one shared trajectory, driven by a scripted policy.

Besides the control flow (retrieve -> lookup -> finish -> reflect-wrong -> finish, the step limit, invalid
actions) the prompt format is checked against the bundled training data: replaying real role examples
through the loop must reproduce each example's input exactly, up to the one documented difference of a
shared trajectory (``lragent.agents.prompts``, mismatches 1 and 2).
"""

from __future__ import annotations

import ast
import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from lragent.agents import (
    HOTPOTQA,
    SCIENCEQA,
    AgentConfig,
    AgentLoop,
    ScriptedPolicy,
    SessionPolicy,
    Toolbox,
    WikiIndex,
    format_question,
    initial_text,
    run_episode,
)
from lragent.agents.loop import Policy, cut_at_stop, parse_reflect
from lragent.agents.prompts import (
    OBS_MAYBE_WRONG,
    OBS_PLEASE_REFLECT,
    OBS_REFLECT_INVALID,
    RESPONSE,
    THOUGHT_MARKER,
    BenchmarkSpec,
)
from lragent.agents.tools import OBS_NO_IMAGE

DATA = Path(__file__).resolve().parents[1] / "data"
HOTPOT_FILES = sorted((DATA / "benchmarks").glob("hotpotqa_*.dev.jsonl"))
SPECS = {"hotpotqa": HOTPOTQA, "scienceqa": SCIENCEQA}
TH = THOUGHT_MARKER  # "Thought: \n### Response:\n"


@pytest.fixture(scope="module")
def index() -> WikiIndex:
    return WikiIndex.from_benchmarks(HOTPOT_FILES)


def _examples(bench: str, role: str) -> list[dict]:
    with gzip.open(DATA / "trajectories" / bench / f"{role}.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------------------- control flow
def test_retrieve_lookup_finish_reflect_wrong_finish(index: WikiIndex) -> None:
    question = "Which band wrote the music for Hurt Locker The Musical?"
    script = [
        ("plan", "I should look up the musical's composer band."),
        ("plan", "Retrieve[Metallica]"),  # cut at "[" -> "Retrieve"
        ("action", "Metallica] and more"),  # cut at "]" -> "Metallica"
        ("plan", "Who are its members?"),
        ("plan", "Lookup"),
        ("action", "Hetfield"),
        ("plan", "The answer is Lars Ulrich."),
        ("plan", "Finish"),
        ("action", "Lars Ulrich"),
        ("reflect", "Is my answer correct?\nextra line"),  # cut at the newline
        ("reflect", "Reflect[wrong]"),
        ("plan", "The question asks for the band."),
        ("plan", "Finish"),
        ("action", "Metallica"),
    ]
    policy = ScriptedPolicy([s for _, s in script], roles=[r for r, _ in script])
    res = run_episode(policy, HOTPOTQA, format_question(question), Toolbox(index))

    assert policy.position == len(script)
    assert res.answer == "Metallica" and res.candidate == "Metallica"
    assert not res.oof and res.stop_reason == "finished"
    assert res.cycles == 5
    assert [(s.kind, s.action_type, s.argument) for s in res.steps] == [
        ("act", "Retrieve", "Metallica"),
        ("act", "Lookup", "Hetfield"),
        ("act", "Finish", "Lars Ulrich"),
        ("reflect", "Reflect", "wrong"),
        ("act", "Finish", "Metallica"),
    ]
    metallica = index.get("Metallica").text
    hetfield = next(s.strip() for s in index.get("Metallica").sentences if "Hetfield" in s)
    assert [s.observation for s in res.steps] == [
        metallica,
        f"(Result 1/2) {hetfield}",
        OBS_PLEASE_REFLECT,
        OBS_MAYBE_WRONG,
        None,
    ]
    # the one shared trajectory, character for character
    expected = (
        initial_text(HOTPOTQA, question)
        + "I should look up the musical's composer band."
        + f"\nAction: {RESPONSE}Retrieve[{RESPONSE}Metallica]\nObversation: {metallica}\n{TH}"
        + "Who are its members?"
        + f"\nAction: {RESPONSE}Lookup[{RESPONSE}Hetfield]\nObversation: (Result 1/2) {hetfield}\n{TH}"
        + "The answer is Lars Ulrich."
        + f"\nAction: {RESPONSE}Finish[{RESPONSE}Lars Ulrich]\nObversation: {OBS_PLEASE_REFLECT}\n{TH}"
        + "Is my answer correct?\nReflect[wrong]"
        + f"\nObversation: {OBS_MAYBE_WRONG}\n{TH}"
        + "The question asks for the band."
        + f"\nAction: {RESPONSE}Finish[{RESPONSE}Metallica"
    )
    assert res.trajectory == expected == policy.trajectory
    # each call appended only the text since the previous call
    assert "".join(new + out for _, new, _, out in policy.calls) == res.trajectory
    assert [c[1] for c in policy.calls[:3]] == [
        initial_text(HOTPOTQA, question),
        f"\nAction: {RESPONSE}",
        f"[{RESPONSE}",
    ]
    assert policy.calls[10][1] == "\n"  # reflect stage 2 sees "{thought}\n", as in its training data
    # every appended piece ends at a newline
    assert all(new == "" or new.endswith("\n") for _, new, _, _ in policy.calls)
    assert {r: s.calls for r, s in res.role_stats.items()} == {"plan": 8, "action": 4, "reflect": 2}
    assert res.role_stats["plan"].decode_tokens > 0


def test_step_limit_is_oof() -> None:
    outputs = ["search more", "BingSearch", "anything"] * 3
    policy = ScriptedPolicy(outputs)
    seen: list[tuple[str, str]] = []

    def tools(action: str, arg: str) -> str:
        seen.append((action, arg))
        return "nothing useful"

    res = AgentLoop(policy, HOTPOTQA, AgentConfig(max_steps=3)).run("q?", tools)
    assert res.oof and res.answer is None and res.candidate is None
    assert res.stop_reason == "step_limit" and res.cycles == 3
    assert seen == [("BingSearch", "anything")] * 3
    assert policy.position == 9
    # the trajectory is what the policy saw; the last observation was never sent to it
    assert res.trajectory.endswith(f"\nAction: {RESPONSE}BingSearch[{RESPONSE}anything")
    assert res.steps[-1].observation == "nothing useful"


def test_finish_on_last_step_without_reflect_is_oof() -> None:
    policy = ScriptedPolicy(["t", "Finish", "Paris"])
    res = AgentLoop(policy, HOTPOTQA, AgentConfig(max_steps=1)).run("q?", lambda a, b: "x")
    assert res.oof and res.answer is None and res.candidate == "Paris"


def test_context_limit_is_oof() -> None:
    policy = ScriptedPolicy(["word " * 50, "BingSearch", "x"] * 10)
    res = AgentLoop(policy, HOTPOTQA, AgentConfig(max_context_tokens=300)).run("q?", lambda a, b: "obs")
    assert res.oof and res.stop_reason == "context_limit"
    assert 1 <= res.cycles < 10


def test_invalid_actions_and_reflect_variants() -> None:
    script = [
        "t1",
        "Reflect",
        "right",  # Reflect before Finish: invalid
        "t2",
        "Bingsearch",
        "x",  # misspelt type: invalid (as in training)
        "t3",
        "Lookup",
        "y",  # not a ScienceQA tool: invalid
        "t4",
        "Finish",
        "A",
        "r",
        "Finish[B]",  # reflect answering with Finish ends the episode with that answer (LRAgent)
    ]
    res = run_episode(ScriptedPolicy(script), SCIENCEQA, "q", lambda a, b: pytest.fail("no tool is valid here"))
    assert [s.observation for s in res.steps] == [
        OBS_REFLECT_INVALID,
        SCIENCEQA.invalid_action,
        SCIENCEQA.invalid_action,
        OBS_PLEASE_REFLECT,
        None,
    ]
    assert res.answer == "B" and not res.oof
    accepted = run_episode(ScriptedPolicy(["t", "Finish", "Paris", "ok", "Reflect[Right]."]), HOTPOTQA, "q", None)
    assert accepted.answer == "Paris" and accepted.cycles == 2
    rejected = run_episode(
        ScriptedPolicy(["t", "Finish", "Paris", "hmm", "Reflect[yes]", "t", "BingSearch", "x"]),
        HOTPOTQA,
        "q",
        lambda a, b: "o",
        AgentConfig(max_steps=3),
    )
    assert rejected.steps[1].observation == OBS_MAYBE_WRONG and rejected.oof


def test_scienceqa_episode_with_image2text(index: WikiIndex) -> None:
    rows = [json.loads(x) for x in (DATA / "benchmarks" / "scienceqa_grade1_4.dev.jsonl").read_text().splitlines()]
    r = next(x for x in rows if x["pid"] == "19204")  # capital of Hawaii, has an image
    qtext = format_question(r["question"], r["choices"])
    assert qtext == "What is the capital of Hawaii?\nOptions:(A) Santa Fe (B) Honolulu (C) Hilo (D) Phoenix"
    tb = Toolbox(index, caption=r["caption"], ocr=r["ocr"], search_error=SCIENCEQA.search_error)
    script = ["Look at the image.", "Image2Text", "image", "Honolulu.", "Finish", "B", "ok", "Reflect[right]"]
    res = run_episode(ScriptedPolicy(script), SCIENCEQA, qtext, tb)
    assert res.steps[0].observation == f"Image caption: {r['caption']} OCR result:"
    assert res.answer == "B"
    no_img = next(x for x in rows if not x["has_image"])
    tb2 = Toolbox(index, caption=no_img["caption"], ocr=no_img["ocr"])
    res2 = run_episode(ScriptedPolicy(script), SCIENCEQA, "q", tb2)
    assert res2.steps[0].observation == OBS_NO_IMAGE


def test_helpers() -> None:
    assert cut_at_stop("BingSearch[x]\n", ["\n", "["]) == "BingSearch"
    assert cut_at_stop("abc", []) == "abc"
    assert parse_reflect("Reflect[right].") == ("Reflect", "right")
    assert parse_reflect(" Reflect[ wrong ]") == ("Reflect", "wrong")
    assert parse_reflect("I think it is right") == ("I think it is right", "")
    assert isinstance(ScriptedPolicy([]), Policy)
    with pytest.raises(ValueError):
        AgentConfig(max_steps=0)


# ------------------------------------------------------------------------------- format vs training data
@pytest.mark.parametrize("bench", ["hotpotqa", "scienceqa"])
def test_first_plan_prompt_equals_training_inputs(bench: str) -> None:
    spec = SPECS[bench]
    first = [e for e in _examples(bench, "plan") if e["input"].count("### Response:") == 1]
    assert len(first) > 100
    head = spec.system_prompt + "\nQuestion:"
    for e in first:
        question = e["input"][len(head) : -len("\n" + TH)]
        assert initial_text(spec, question) == e["input"]


def test_scienceqa_question_format_matches_training() -> None:
    n = 0
    for e in _examples("scienceqa", "plan")[:200]:
        q = e["input"].split("\nQuestion:", 1)[1].split("\n" + TH, 1)[0]
        stem, options = q.split("\nOptions:", 1)
        choices = re.split(r" ?\([A-E]\) ", " " + options)[1:]
        if all(")" not in c for c in choices):
            assert format_question(stem, choices) == q
            n += 1
    assert n > 150


_ACT_STEP = re.compile(
    r"Thought: \n### Response:\n(?P<t>[^\n]+)\nAciton: (?P<T>\w+)\[\n### Response:\n(?P<k>[^\n\]]*)\]"
    r"\nObversation: (?P<o>[^\n]+)\n"
)
_PLAN_STEP = re.compile(
    r"Thought: \n### Response:\n(?P<t>[^\n]+)\nAction: \n### Response:\n(?P<T>\w+)\[(?P<k>[^\n\]]*)\]"
    r"\nObversation: (?P<o>[^\n]+)\n"
)


@dataclass
class _Replay:
    """A training example re-expressed as a loop script: steps, then what the example's output answers."""

    question: str
    steps: list[dict] = field(default_factory=list)
    tail: str = ""


def _parse(example: dict, spec: BenchmarkSpec, step_re: re.Pattern) -> _Replay | None:
    text = example["input"]
    head = spec.system_prompt + "\nQuestion:"
    start = text.index("\n" + TH, len(head)) + 1
    rep = _Replay(question=text[len(head) : start - 1])
    pos = start
    while m := step_re.match(text, pos):
        rep.steps.append(m.groupdict())
        pos = m.end()
    rep.tail = text[pos:]
    for i, s in enumerate(rep.steps):
        last = i == len(rep.steps) - 1
        ok_finish = s["T"] == "Finish" and last and s["o"] == OBS_PLEASE_REFLECT
        if not (s["T"] in spec.tools or ok_finish) or s["k"].strip() != s["k"] or not s["k"]:
            return None
    return rep


def _replay(rep: _Replay, spec: BenchmarkSpec, tail_outputs: list[str]) -> ScriptedPolicy:
    outputs = [x for s in rep.steps for x in (s["t"], s["T"], s["k"])] + tail_outputs
    observations = iter([s["o"] for s in rep.steps if s["T"] != "Finish"])
    policy = ScriptedPolicy(outputs)
    AgentLoop(policy, spec, AgentConfig(max_steps=len(rep.steps) + 1)).run(
        rep.question, lambda a, b: next(observations, "end")
    )
    return policy


def _shared_form(training_input: str) -> str:
    """Applies the documented difference: an action is written "Action: \\n### Response:\\n{T}[\\n### Response:\\n"."""
    merged = r"\nAction: \n### Response:\n\1[\n### Response:\n"
    text = re.sub(r"\nAciton: (\w+)\[\n### Response:\n", merged, training_input)  # action/reflect inputs
    return re.sub(r"\nAction: \n### Response:\n(\w+)\[(?!\n### Response:\n)", merged, text)  # plan inputs


@pytest.mark.parametrize("bench", ["hotpotqa", "scienceqa"])
@pytest.mark.parametrize("role", ["plan", "action", "reflect"])
def test_replayed_training_examples_match_shared_trajectory(bench: str, role: str) -> None:
    """Every role example made only of tool steps is reproduced by the loop, up to the documented merge."""
    spec = SPECS[bench]
    step_re = _PLAN_STEP if role == "plan" else _ACT_STEP
    checked = 0
    for e in _examples(bench, role):
        rep = _parse(e, spec, step_re)
        if rep is None:
            continue
        n = 3 * len(rep.steps)
        after_finish = bool(rep.steps) and rep.steps[-1]["T"] == "Finish"
        if rep.tail == TH:  # thought example (plan thought, or reflect thought after Finish)
            policy = _replay(rep, spec, ["x", "Reflect[right]"] if after_finish else ["x", "BingSearch", "y"])
            context = policy.contexts[n]
        elif after_finish and role != "reflect":
            continue  # after a Finish the loop hands the step to reflect, whose inputs are checked below
        elif m := re.fullmatch(rf"{re.escape(TH)}([^\n]+)\nAction: {re.escape(RESPONSE)}", rep.tail):
            policy = _replay(rep, spec, [m.group(1), e["output"], "y"])  # plan action-type example
            context = policy.contexts[n + 1]
        elif m := re.fullmatch(rf"{re.escape(TH)}([^\n]+)\nAciton: (\w+)\[{re.escape(RESPONSE)}", rep.tail):
            policy = _replay(rep, spec, [m.group(1), m.group(2), e["output"]])  # action argument example
            context = policy.contexts[n + 2]
        elif (m := re.fullmatch(rf"{re.escape(TH)}([^\n]+)\n", rep.tail)) and after_finish:
            policy = _replay(rep, spec, [m.group(1), e["output"]])  # reflect Reflect[...] example
            context = policy.contexts[n + 1]
        else:
            continue
        assert context == _shared_form(e["input"])
        checked += 1
    print(f"{bench}/{role}: {checked} examples replayed")
    assert checked >= 20, checked


class _FakeSession:
    """Stands in for lragent.session.MultiAgentSession: records calls, returns canned step results."""

    def __init__(self, model: object, *, scheme: str, tokenizer: object) -> None:
        self.scheme, self.appended, self.steps = scheme, [], []
        self.num_tokens, self.peak_cache_bytes = 0, 1234

    def append_text(self, text: str) -> list[int]:
        self.appended.append(text)
        self.num_tokens += len(text)
        return list(range(len(text)))

    def step(self, role: str, **kw: object):
        self.steps.append((role, kw))
        text = {0: "think", 1: "Finish", 2: "Paris", 3: "sure", 4: "Reflect[right]"}[len(self.steps) - 1]
        self.num_tokens += len(text)

        class _Res:
            generated_ids = [1] * len(text)
            prefill_tokens = self.appended and len(self.appended[-1]) or 0
            prefill_s, decode_s = 0.5, 0.25

        _Res.text = text
        return _Res()


def test_session_policy_drives_session_api() -> None:
    sessions: list[_FakeSession] = []

    def new_session() -> _FakeSession:
        sessions.append(_FakeSession(object(), scheme="full_shared", tokenizer=object()))
        return sessions[-1]

    policy = SessionPolicy(new_session, seed=7)
    res = run_episode(policy, HOTPOTQA, "q", lambda a, b: "o")
    s = sessions[-1]
    assert s.scheme == "full_shared" and res.answer == "Paris"
    assert "".join(s.appended) + "" == "".join(p for p in s.appended)
    assert s.appended[0] == initial_text(HOTPOTQA, "q") and s.appended[1:3] == [f"\nAction: {RESPONSE}", f"[{RESPONSE}"]
    assert [r for r, _ in s.steps] == ["plan", "plan", "action", "reflect", "reflect"]
    assert [kw["seed"] for _, kw in s.steps] == [7, 8, 9, 10, 11]
    assert s.steps[1][1]["stop"] == ["[", "\n"] and s.steps[2][1]["stop"] == ["]", "\n"]
    assert res.role_stats["reflect"].decode_tokens == len("sure") + len("Reflect[right]")
    assert res.role_stats["plan"].prefill_s == pytest.approx(1.0) and res.role_stats["action"].decode_s == 0.25
    assert res.num_tokens == s.num_tokens and policy.peak_cache_bytes == 1234
    run_episode(policy, HOTPOTQA, "q2", lambda a, b: "o")
    assert len(sessions) == 2  # a fresh session per episode


def test_agents_package_has_no_heavy_top_level_imports() -> None:
    """lragent.agents must stay light: torch, Lightning and the session are imported only where used."""
    heavy = {"torch", "lightning", "transformers", "lragent.session"}
    for path in (Path(__file__).resolve().parents[1] / "lragent" / "agents").glob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module level only (SessionPolicy imports lazily)
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] in heavy or n in heavy for n in names), (path.name, names)
