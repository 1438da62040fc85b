"""Properties of the agent loop: step and context budgets at their exact boundaries, the per-role requests.

Pinned here: the request each cycle issues (role, appended text, per-role token budget, stop strings), the last
allowed step runs and the next does not, the context budget is inclusive, a Finish ends tool use and is answered
by reflect (accept / reject / Finish), Reflect/Finish/Thought parsing under case, whitespace and period variants,
the constrained-choice paths (unequal option counts) and how :func:`answer_request` fills a reply's stats.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lragent.agents.loop import (
    ROLES,
    AgentConfig,
    AgentLoop,
    Choose,
    Generate,
    Reply,
    RoleStats,
    ScriptedPolicy,
    StepStats,
    answer_request,
    drive,
    is_accept,
    parse_reflect,
    run_episode,
)
from lragent.agents.prompts import (
    OBS_MAYBE_WRONG,
    OBS_PLEASE_REFLECT,
    OBS_REFLECT_INVALID,
    BenchmarkSpec,
)

SPEC = BenchmarkSpec("toy", "SYS", ("Search", "Lookup"), "Bad action.", "search failed")
TH = "Thought: \n### Response:\n"
ACT = "\nAction: \n### Response:\n"
ARG = "[\n### Response:\n"
START = f"SYS\nQuestion:Q?\n{TH}"
# unequal budgets per role so that a swap shows
CFG = AgentConfig(max_steps=4, thought_tokens=11, action_type_tokens=3, argument_tokens=7, reflect_tokens=5)


def obs(text: str, closing: str = "]") -> str:
    return f"{closing}\nObversation: {text}\n{TH}"


class Tools:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, action: str, arg: str) -> str:
        self.calls.append((action, arg))
        return f"<{action}:{arg}>"


def play(episode, replies: list) -> tuple[list, object]:
    """Drives an episode generator with canned replies (a str: Reply(text), an int: Reply(choice), or a Reply)."""
    requests = []
    try:
        request = next(episode)
        for r in replies:
            requests.append(request)
            reply = r if isinstance(r, Reply) else Reply(choice=r) if isinstance(r, int) else Reply(text=r)
            request = episode.send(reply)
        raise AssertionError(f"episode wants more than {len(replies)} replies: {request!r}")
    except StopIteration as done:
        assert len(requests) == len(replies), f"episode ended after {len(requests)} of {len(replies)} replies"
        return requests, done.value


def loop(config: AgentConfig = CFG) -> AgentLoop:
    return AgentLoop(None, SPEC, config)


# ----------------------------------------------------------------------------- configuration
def test_config_defaults_are_lragents() -> None:
    cfg = AgentConfig()
    assert (
        cfg.max_steps,
        cfg.thought_tokens,
        cfg.action_type_tokens,
        cfg.argument_tokens,
        cfg.reflect_tokens,
        cfg.max_context_tokens,
    ) == (15, 128, 8, 64, 16, None)
    assert AgentLoop(None, SPEC).config == cfg
    assert ROLES == ("plan", "action", "reflect")


@pytest.mark.parametrize(
    "name", ["max_steps", "thought_tokens", "action_type_tokens", "argument_tokens", "reflect_tokens"]
)
def test_config_budgets_must_be_at_least_one(name: str) -> None:
    assert getattr(AgentConfig(**{name: 1}), name) == 1
    with pytest.raises(ValueError, match=rf"^{name} must be >= 1, got 0$"):
        AgentConfig(**{name: 0})


def test_context_budget_must_be_positive_or_none() -> None:
    assert AgentConfig(max_context_tokens=1).max_context_tokens == 1
    with pytest.raises(ValueError, match=r"^max_context_tokens must be >= 1 or None, got 0$"):
        AgentConfig(max_context_tokens=0)


# ----------------------------------------------------------------------------- the requests of one cycle
def test_tool_cycle_requests_carry_role_text_budget_and_stops() -> None:
    tools = Tools()
    reqs, res = play(
        loop().episode("Q?", tools),
        ["think", " Search ", "  Paris  ", "next", "Lookup", "city", "t", "Finish", " Paris ", "r", "Reflect[right]"],
    )
    assert reqs == [
        Generate("plan", START, 11, ("\n",)),
        Generate("plan", ACT, 3, ("[", "\n")),
        Generate("action", ARG, 7, ("]", "\n")),
        Generate("plan", obs("<Search:Paris>"), 11, ("\n",)),
        Generate("plan", ACT, 3, ("[", "\n")),
        Generate("action", ARG, 7, ("]", "\n")),
        Generate("plan", obs("<Lookup:city>"), 11, ("\n",)),
        Generate("plan", ACT, 3, ("[", "\n")),
        Generate("action", ARG, 7, ("]", "\n")),
        Generate("reflect", obs(OBS_PLEASE_REFLECT), 11, ("\n",)),
        Generate("reflect", "\n", 5, ("\n",)),
    ]
    assert tools.calls == [("Search", "Paris"), ("Lookup", "city")]
    assert res.answer == "Paris" and res.candidate == "Paris" and not res.oof
    assert res.stop_reason == "finished" and res.cycles == 4 == len(res.steps)
    assert [(s.kind, s.thought, s.action_type, s.argument, s.observation) for s in res.steps] == [
        ("act", "think", "Search", "Paris", "<Search:Paris>"),
        ("act", "next", "Lookup", "city", "<Lookup:city>"),
        ("act", "t", "Finish", "Paris", OBS_PLEASE_REFLECT),
        ("reflect", "r", "Reflect", "right", None),
    ]
    texts = [
        "think",
        " Search ",
        "  Paris  ",
        "next",
        "Lookup",
        "city",
        "t",
        "Finish",
        " Paris ",
        "r",
        "Reflect[right]",
    ]
    assert res.trajectory == "".join(r.new_text + t for r, t in zip(reqs, texts, strict=True))
    assert [res.role_stats[r].calls for r in ROLES] == [6, 3, 2]
    assert res.constrained_calls == 0 and res.num_tokens == 0 and 0 <= res.wall_s < 5 and res.extra == {}


def test_unknown_action_and_early_reflect_get_their_observations_and_skip_tools() -> None:
    tools = Tools()
    reqs, res = play(
        loop().episode("Q?", tools),
        ["a", "Reflect", "right", "b", "search", "x", "c", "Finish", "z", "r", "Reflect[wrong]"],
    )
    assert tools.calls == []
    assert [s.observation for s in res.steps] == [
        OBS_REFLECT_INVALID,
        "Bad action.",
        OBS_PLEASE_REFLECT,
        OBS_MAYBE_WRONG,
    ]
    assert reqs[3].new_text == obs(OBS_REFLECT_INVALID)
    assert reqs[6].new_text == obs("Bad action.")
    assert res.oof and res.answer is None and res.candidate == "z" and res.stop_reason == "step_limit"
    assert res.cycles == 4


# ----------------------------------------------------------------------------- step budget
@settings(max_examples=8)
@given(max_steps=st.integers(1, 6))
def test_last_allowed_step_runs_and_the_next_does_not(max_steps: int) -> None:
    tools = Tools()
    cfg = dataclasses.replace(CFG, max_steps=max_steps)
    replies = ["t", "Search", "x"] * max_steps
    reqs, res = play(loop(cfg).episode("Q?", tools), replies)  # asks for exactly 3 * max_steps replies
    assert len(reqs) == 3 * max_steps and len(tools.calls) == max_steps
    assert res.cycles == max_steps and res.oof and res.stop_reason == "step_limit"
    assert res.steps[-1].observation == "<Search:x>"


def test_finish_on_the_last_step_is_oof_and_on_the_step_before_is_reflected() -> None:
    cfg = dataclasses.replace(CFG, max_steps=2)
    _, res = play(loop(cfg).episode("Q?", Tools()), ["t", "Search", "x", "t", "Finish", "A"])
    assert res.oof and res.answer is None and res.candidate == "A" and res.stop_reason == "step_limit"
    _, res = play(loop(cfg).episode("Q?", Tools()), ["t", "Finish", "A", "r", "Reflect[right]"])
    assert res.answer == "A" and not res.oof and res.cycles == 2


def test_finish_after_rejection_ends_without_second_reflect() -> None:
    _, res = play(
        loop().episode("Q?", Tools()),
        ["t", "Finish", "A", "r", "Reflect[wrong]", "t2", "Finish", " B "],
    )
    assert res.answer == "B" == res.candidate and res.stop_reason == "finished" and not res.oof
    assert res.steps[-1].kind == "act" and res.steps[-1].observation is None and res.steps[-1].argument == "B"
    assert res.cycles == 3


def test_finish_inside_reflect_replaces_the_candidate() -> None:
    _, res = play(loop().episode("Q?", Tools()), ["t", "Finish", "A", "r", " Finish[ C ]. "])
    assert res.answer == "C" == res.candidate and res.steps[-1].action_type == "Finish"
    assert res.steps[-1] == dataclasses.replace(res.steps[-1], kind="reflect", thought="r", observation=None)


@pytest.mark.parametrize("out", ["Reflect[yes]", "reflect[right]", "Reflect[righteous]", "right", "", "Lookup[x]"])
def test_anything_but_accept_hands_back_to_plan(out: str) -> None:
    cfg = dataclasses.replace(CFG, max_steps=3)
    reqs, res = play(loop(cfg).episode("Q?", Tools()), ["t", "Finish", "A", "r", out, "t", "Search", "x"])
    assert reqs[5] == Generate("plan", obs(OBS_MAYBE_WRONG, closing=""), 11, ("\n",))
    assert res.steps[1].observation == OBS_MAYBE_WRONG and res.oof and res.candidate == "A"


# ----------------------------------------------------------------------------- context budget
@pytest.mark.parametrize(("limit", "cycles"), [(9, 1), (10, 4), (11, 4)])
def test_context_budget_is_checked_at_cycle_start_and_inclusive(limit: int, cycles: int) -> None:
    cfg = dataclasses.replace(CFG, max_context_tokens=limit)
    stats = StepStats(trajectory_tokens=10)
    replies = [Reply("t", stats=stats), Reply("Search"), Reply("x")] * 4
    reqs, res = play(loop(cfg).episode("Q?", Tools()), replies[: 3 * cycles])
    assert res.cycles == cycles and res.num_tokens == 10
    assert res.stop_reason == ("context_limit" if cycles == 1 else "step_limit")


def test_tokens_follow_the_last_reported_count_only() -> None:
    replies = [
        Reply("t", stats=StepStats(prefill_tokens=2, decode_tokens=1, prefill_s=0.5, trajectory_tokens=7)),
        Reply("Finish", stats=StepStats(decode_tokens=4, decode_s=0.25, recomputed_tokens=3)),
        Reply("A"),
        Reply("r", stats=StepStats(trajectory_tokens=12)),
        Reply("Reflect[right]"),
    ]
    _, res = play(loop().episode("Q?", Tools()), replies)
    assert res.num_tokens == 12
    plan = res.role_stats["plan"]
    assert (plan.calls, plan.prefill_tokens, plan.decode_tokens, plan.prefill_s, plan.decode_s) == (2, 2, 5, 0.5, 0.25)
    assert plan.recomputed_tokens == 3
    assert res.role_stats["action"] == RoleStats(calls=1)


def test_role_stats_add_sums_every_field() -> None:
    s = RoleStats()
    s.add(StepStats(1, 2, 0.5, 0.25, 3, 99))
    s.add(None)
    s.add(StepStats(10, 20, 1.0, 2.0, 30))
    assert s == RoleStats(
        calls=3, prefill_tokens=11, decode_tokens=22, prefill_s=1.5, decode_s=2.25, recomputed_tokens=33
    )


# ----------------------------------------------------------------------------- parsing
@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("Reflect[right]", ("Reflect", "right")),
        ("  Reflect [ right ] . ", ("Reflect", "right")),
        ("Reflect[right", ("Reflect", "right")),
        ("Finish[a]b]", ("Finish", "a]b")),
        ("Reflect[]", ("Reflect", "")),
        ("  no brackets here ", ("no brackets here", "")),
        ("", ("", "")),
        ("Reflect[multi\nline]", ("Reflect", "multi\nline")),
    ],
)
def test_parse_reflect(text: str, parsed: tuple[str, str]) -> None:
    assert parse_reflect(text) == parsed


@pytest.mark.parametrize(
    ("arg", "ok"),
    [
        ("right", True),
        ("RIGHT", True),
        (" Right. ", True),
        ("right .", True),
        (". right", True),
        (" right. ", True),
        ("right..", True),
        ("righty", False),
        ("wrong", False),
        ("", False),
        ("r ight", False),
        ("rightX", False),
        ("Xright", False),
    ],
)
def test_is_accept_variants(arg: str, ok: bool) -> None:
    assert is_accept(arg) is ok


# ----------------------------------------------------------------------------- constrained choices
def test_constrained_action_type_and_answer_use_choose() -> None:
    tools = Tools()
    types = ("Search", "Finish", "Lookup")
    answers = ("A", "B")
    episode = loop().episode("Q?", tools, action_types=types, answer_options=answers, answer_score="mean")
    reqs, res = play(episode, ["t", 0, "x", "t2", 1, 1, "r", "Reflect[right]"])
    assert reqs[1] == Choose("plan", ACT, types)
    assert reqs[4] == Choose("plan", ACT, types)
    assert reqs[5] == Choose("action", ARG, answers, score="mean")
    assert tools.calls == [("Search", "x")]
    assert res.answer == "B" and res.constrained_calls == 3
    assert "\n### Response:\nFinish[\n### Response:\nB" in res.trajectory


def test_answer_texts_are_scored_and_the_letter_is_answered() -> None:
    episode = loop().episode("Q?", Tools(), answer_options=("A", "B", "C"), answer_texts=("red", "green", "blue"))
    reqs, res = play(episode, ["t", "Finish", 2, "r", "Reflect[right]"])
    assert reqs[2] == Choose("action", ARG, ("red", "green", "blue"), score="sum", appends=("A", "B", "C"))
    assert res.answer == "C" and res.constrained_calls == 1
    assert res.trajectory.endswith(f"{ARG}C{obs(OBS_PLEASE_REFLECT)}r\nReflect[right]")


def test_unconstrained_finish_and_other_types_still_generate() -> None:
    episode = loop().episode("Q?", Tools(), answer_options=("A", "B"))
    reqs, res = play(episode, ["t", "Search", "x", "t", "Finish", 0, "r", "Reflect[right]"])
    assert isinstance(reqs[2], Generate) and isinstance(reqs[5], Choose)
    assert res.answer == "A"


@pytest.mark.parametrize("choice", [None, -1, 3, 3.0])
def test_invalid_choice_reply_raises(choice: object) -> None:
    episode = loop().episode("Q?", Tools(), action_types=("Search", "Finish", "Lookup"))
    next(episode)
    episode.send(Reply("t"))
    with pytest.raises(ValueError, match=r"^a Choose among 3 options got choice "):
        episode.send(Reply(choice=choice))


def test_last_valid_choice_index_is_accepted() -> None:
    episode = loop().episode("Q?", Tools(), action_types=("Search", "Lookup", "Finish"))
    _, res = play(episode, ["t", 2, "A", "r", "Reflect[right]"])
    assert res.answer == "A"


def test_bad_constraint_lists_raise() -> None:
    with pytest.raises(ValueError, match=r"^action_types must be None or non-empty strings, got \(\)$"):
        next(loop().episode("Q?", Tools(), action_types=()))
    with pytest.raises(ValueError, match=r"^answer_options must be None or non-empty strings, got \['A', ''\]$"):
        next(loop().episode("Q?", Tools(), answer_options=["A", ""]))
    with pytest.raises(ValueError, match=r"^answer_texts must be None or non-empty strings, got \[1\]$"):
        next(loop().episode("Q?", Tools(), answer_options=["A"], answer_texts=[1]))
    with pytest.raises(ValueError, match=r"^answer_texts needs one text per answer option: \('x',\) for \('A', 'B'\)$"):
        next(loop().episode("Q?", Tools(), answer_options=("A", "B"), answer_texts=("x",)))
    with pytest.raises(ValueError, match=r"^answer_texts needs one text per answer option: \('x',\) for None$"):
        next(loop().episode("Q?", Tools(), answer_texts=("x",)))
    with pytest.raises(ValueError, match="choice score 'max'"):
        next(loop().episode("Q?", Tools(), answer_score="max"))


# ----------------------------------------------------------------------------- policies, answer_request, drive
class StatPolicy(ScriptedPolicy):
    def __init__(self, outputs: list[str], tokens: int | None = 5) -> None:
        super().__init__(outputs)
        self.tokens = tokens
        self.seen: list[dict] = []
        self.resets = 0

    def reset(self) -> None:
        super().reset()
        self.resets += 1

    @property
    def num_tokens(self) -> int | None:  # type: ignore[override]
        return self.tokens

    def choose(self, role, new_text, options, **kw):  # noqa: ANN001, ANN003
        self.seen.append(kw)
        return super().choose(role, new_text, options, **kw)


def test_answer_request_generate_copies_stats_and_fills_trajectory_tokens() -> None:
    policy = StatPolicy(["Hello\nworld"], tokens=42)
    reply = answer_request(policy, Generate("plan", "a b c", 4, ("\n",)))
    assert reply.text == "Hello" and reply.choice is None
    assert reply.stats == StepStats(prefill_tokens=3, decode_tokens=1, trajectory_tokens=42)
    assert reply.stats is not policy.last_stats and policy.last_stats.trajectory_tokens is None
    assert policy.calls == [("plan", "a b c", ["\n"], "Hello")]


def test_answer_request_keeps_reported_trajectory_tokens_and_handles_missing_ones() -> None:
    policy = StatPolicy(["x", "y"], tokens=None)
    assert answer_request(policy, Generate("plan", "", 1, ())).stats == StepStats(decode_tokens=1)
    policy.tokens = 9
    policy.last_stats = None
    policy.generate = lambda *a, **k: "z"  # type: ignore[method-assign]
    assert answer_request(policy, Generate("plan", "", 1, ())).stats == StepStats(trajectory_tokens=9)
    policy.tokens = None
    assert answer_request(policy, Generate("plan", "", 1, ())).stats is None

    class Reporting(StatPolicy):
        def generate(self, role, new_text, *, max_new_tokens, stop):  # noqa: ANN001
            self.last_stats = StepStats(trajectory_tokens=3)
            return "w"

    assert answer_request(Reporting([], tokens=50), Generate("plan", "", 1, ())).stats.trajectory_tokens == 3


def test_answer_request_choose_passes_only_non_default_extras() -> None:
    policy = StatPolicy(["B", "B", "B"])
    reply = answer_request(policy, Choose("plan", "", ("A", "B")))
    assert (reply.choice, reply.text) == (1, "B") and policy.seen == [{}]
    answer_request(policy, Choose("plan", "", ("A", "B"), score="mean"))
    answer_request(policy, Choose("plan", "", ("A", "B"), appends=("x", "y")))
    assert policy.seen[1:] == [{"score": "mean"}, {"appends": ("x", "y")}]


@pytest.mark.parametrize("index", [-1, 2, None])
def test_answer_request_out_of_range_choice_gives_empty_text(index: object) -> None:
    class Bad(StatPolicy):
        def choose(self, *a, **k):  # noqa: ANN002, ANN003
            return index

    reply = answer_request(Bad([]), Choose("plan", "", ("A", "B")))
    assert reply.text == "" and reply.choice == index
    with pytest.raises(TypeError, match="unknown request"):
        answer_request(Bad([]), "Generate")  # type: ignore[arg-type]


def test_run_resets_and_drives_the_policy_with_the_config() -> None:
    policy = StatPolicy(["t", "Finish", "A", "r", "Reflect[right]"] * 2)
    res = AgentLoop(policy, SPEC, CFG).run("Q?", Tools())
    assert res.answer == "A" and policy.resets == 1 and res.num_tokens == 5
    assert policy.calls[0][1] == START
    res2 = run_episode(policy, SPEC, "Q?", Tools(), dataclasses.replace(CFG, max_steps=1))
    assert res2.oof and policy.resets == 2 and policy.position == 8
    with pytest.raises(ValueError, match=r"^AgentLoop\.run needs a policy; drive AgentLoop\.episode"):
        AgentLoop(None, SPEC).run("Q?", Tools())


def test_run_passes_constraints_through() -> None:
    policy = StatPolicy(["t", "Finish", "green", "r", "Reflect[right]"])
    res = AgentLoop(policy, SPEC, CFG).run(
        "Q?",
        Tools(),
        action_types=("Search", "Finish"),
        answer_options=("A", "B"),
        answer_texts=("red", "green"),
        answer_score="mean",
    )
    assert res.answer == "B" and res.constrained_calls == 2
    assert policy.seen == [{}, {"score": "mean", "appends": ("A", "B")}]


def test_drive_passes_each_requests_budget_and_stops_to_the_policy() -> None:
    budgets: list[tuple[str, int, list[str]]] = []

    class Budgeted(StatPolicy):
        def generate(self, role, new_text, *, max_new_tokens, stop):  # noqa: ANN001
            budgets.append((role, max_new_tokens, stop))
            return super().generate(role, new_text, max_new_tokens=max_new_tokens, stop=stop)

    res = drive(loop().episode("Q?", Tools()), Budgeted(["t", "Finish", "A", "r", "Reflect[right]"]))
    assert res.answer == "A"
    assert budgets == [
        ("plan", 11, ["\n"]),
        ("plan", 3, ["[", "\n"]),
        ("action", 7, ["]", "\n"]),
        ("reflect", 11, ["\n"]),
        ("reflect", 5, ["\n"]),
    ]


def test_drive_returns_the_episode_result() -> None:
    policy = StatPolicy(["t", "Search", "x"])
    res = drive(loop(dataclasses.replace(CFG, max_steps=1)).episode("Q?", Tools()), policy)
    assert res.cycles == 1 and res.steps[0].observation == "<Search:x>"
