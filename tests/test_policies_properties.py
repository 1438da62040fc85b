"""Properties of the policies: stop cutting, option matching, the scripted policy and SessionPolicy.

Pinned here: :func:`cut_at_stop` cuts at the earliest stop (at the very start and the very end included),
:func:`closest_option` prefers an exact match and then the longest common prefix (ties: the first option), the
scripted policy's recorded calls and trajectory across a sequence of calls, :func:`check_sampling` at its exact
boundaries, and SessionPolicy's seeds, stats and teacher-forced option scores against an independent reference on a
fake session (options of unequal token counts, ``sum`` vs ``mean``, ``appends``).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lragent.agents.policies import (
    ScriptedPolicy,
    SessionPolicy,
    check_sampling,
    closest_option,
    cut_at_stop,
)
from lragent.agents.requests import StepStats


# ----------------------------------------------------------------------------- cut_at_stop
@pytest.mark.parametrize(
    ("text", "stop", "cut"),
    [
        ("Search[x]\n", ["\n", "["], "Search"),
        ("Search[x]\n", ["[", "\n"], "Search"),
        ("[x", ["["], ""),
        ("abc\n", ["\n"], "abc"),
        ("abc", ["\n"], "abc"),
        ("abc", [], "abc"),
        ("abc", [""], "abc"),
        ("a]b]", ["]"], "a"),
        ("ab\n\ncd", ["\n\n"], "ab"),
        ("", ["\n"], ""),
    ],
)
def test_cut_at_stop_cuts_at_the_earliest_stop(text: str, stop: list[str], cut: str) -> None:
    assert cut_at_stop(text, stop) == cut


@settings(max_examples=25)
@given(text=st.text("ab[]\n", max_size=12), stop=st.lists(st.sampled_from(["[", "]", "\n", "b]", ""]), max_size=3))
def test_cut_at_stop_is_the_longest_prefix_without_a_stop(text: str, stop: list[str]) -> None:
    cut = cut_at_stop(text, stop)
    assert text.startswith(cut)
    assert not any(s and s in cut for s in stop)
    if cut != text:
        assert any(s and text[len(cut) :].startswith(s) for s in stop)


# ----------------------------------------------------------------------------- closest_option
@pytest.mark.parametrize(
    ("text", "options", "index"),
    [
        (" B ", ("A", "B"), 1),
        ("Be", ("Bee", "Be"), 1),  # exact match beats an equally long common prefix earlier
        ("Bx", ("A", "Bee", "Bx1"), 2),
        ("Cz", ("Ca", "Cb"), 0),  # tie: the first
        ("axc", ("abc", "ax"), 1),  # the common prefix stops at the first difference
        ("abz", ("a", "ab"), 1),
        ("zzz", ("A", "B", "C"), 0),
        ("C", ("A", "B", "C"), 2),  # exact match of the last option
        ("", ("x", ""), 1),
    ],
)
def test_closest_option(text: str, options: tuple[str, ...], index: int) -> None:
    assert closest_option(text, options) == index


# ----------------------------------------------------------------------------- ScriptedPolicy
def test_scripted_policy_records_a_sequence_of_calls() -> None:
    policy = ScriptedPolicy(["Search[x]\nmore", "x] y", "B", "tail"], roles=["plan", "action", "plan", "reflect"])
    assert policy.last_stats is None and policy.trajectory == "" and policy.position == 0
    assert policy.generate("plan", "Q: a b\n", max_new_tokens=3, stop=["[", "\n"]) == "Search"
    assert policy.last_stats == StepStats(prefill_tokens=3, decode_tokens=1)
    assert policy.generate("action", "[", max_new_tokens=5, stop=["]"]) == "x"
    assert policy.choose("plan", " go ", ("A", "B"), appends=("letter a", "letter b c")) == 1
    assert policy.last_stats == StepStats(prefill_tokens=1, decode_tokens=3)
    assert policy.calls == [
        ("plan", "Q: a b\n", ["[", "\n"], "Search"),
        ("action", "[", ["]"], "x"),
        ("plan", " go ", [], "letter b c"),
    ]
    assert policy.choices == [("plan", ("A", "B"), 1)]
    assert policy.contexts == ["Q: a b\n", "Q: a b\nSearch[", "Q: a b\nSearch[x go "]
    assert policy.trajectory == "Q: a b\nSearch[x go letter b c"
    assert policy.num_tokens == 8 and policy.position == 3
    policy.reset()
    assert policy.trajectory == "" and policy.last_stats is None and policy.position == 3
    assert policy.choose("reflect", "", ["tail", "x"], score="mean") == 0
    assert policy.trajectory == "tail" and policy.num_tokens == 1
    with pytest.raises(IndexError, match=r"^script exhausted after 4 outputs \(role 'plan' asked for more\)$"):
        policy.generate("plan", "", max_new_tokens=1, stop=[])


def test_scripted_policy_checks_roles_options_and_score() -> None:
    with pytest.raises(ValueError, match=r"^roles has 1 entries for 2 outputs$"):
        ScriptedPolicy(["a", "b"], roles=["plan"])
    policy = ScriptedPolicy(["a", "b"], roles=["plan", "action"])
    with pytest.raises(AssertionError, match=r"call 0: expected role 'plan', got 'action'"):
        policy.generate("action", "", max_new_tokens=1, stop=[])
    assert policy.position == 0
    with pytest.raises(ValueError, match=r"^choose needs at least one option$"):
        policy.choose("plan", "", [])
    with pytest.raises(ValueError, match="choice score 'max'"):
        policy.choose("plan", "", ["a"], score="max")
    assert policy.position == 0
    outputs = ["x"]
    free = ScriptedPolicy(outputs)
    outputs.append("y")
    assert free.outputs == ["x"] and free.roles is None


# ----------------------------------------------------------------------------- check_sampling
@pytest.mark.parametrize(("temperature", "top_p"), [(0, 1), (0.0, 1.0), (2.5, 1e-9), (1e-12, 0.5)])
def test_check_sampling_accepts_the_boundaries(temperature: float, top_p: float) -> None:
    check_sampling(temperature, top_p)


@pytest.mark.parametrize("temperature", [-1e-12, -1.0, math.inf, math.nan, "0.9", None])
def test_check_sampling_rejects_bad_temperature(temperature: object) -> None:
    with pytest.raises(ValueError, match=r"^temperature must be a finite number >= 0 \(0 = greedy\), got "):
        check_sampling(temperature, 0.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("top_p", [0, 0.0, -0.5, 1.0000001, 2, math.inf, math.nan, "1", None])
def test_check_sampling_rejects_bad_top_p(top_p: object) -> None:
    with pytest.raises(ValueError, match=rf"^top_p must be in \(0, 1\], got {top_p}$"):
        check_sampling(0.5, top_p)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- SessionPolicy on a fake session
VOCAB = "abcdefgh"


class CharTokenizer:
    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        assert add_special_tokens is False
        return {"input_ids": [VOCAB.index(c) for c in text if c in VOCAB]}


class Result:
    def __init__(self, **kw: object) -> None:
        self.__dict__.update(kw)


def table(role: str) -> torch.Tensor:
    """Next-token logits per previous token, different for each role."""
    g = torch.Generator().manual_seed({"plan": 1, "action": 2, "reflect": 3}[role])
    return torch.randn(len(VOCAB), len(VOCAB), generator=g) * 3


class FakeSession:
    """Logits at position p depend on the token at p and the role; a step returns rows only for the positions not
    processed yet (plus the last one), so rows are not indexed by position."""

    def __init__(self, with_recomputed: bool = True) -> None:
        self.tokenizer = CharTokenizer()
        self.ids: list[int] = []
        self.processed = 0
        self.peak_cache_bytes = 777
        self.log: list[tuple] = []
        self.with_recomputed = with_recomputed

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def append_text(self, text: str) -> None:
        self.log.append(("append_text", text))
        self.ids += self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def append(self, ids: list[int]) -> None:
        self.log.append(("append", list(ids)))
        self.ids += list(ids)

    def truncate(self, n: int) -> None:
        self.log.append(("truncate", n))
        self.ids = self.ids[:n]
        self.processed = min(self.processed, n)

    def step(self, role: str, **kw: object) -> Result:
        self.log.append(("step", role, kw))
        start = max(0, min(self.processed, len(self.ids) - 1))
        positions = list(range(start, len(self.ids)))
        self.processed = len(self.ids)
        extra = {"recomputed_tokens": 2} if self.with_recomputed else {}
        if kw.get("return_logits"):
            logits = table(role)[[self.ids[p] for p in positions]].to(torch.float16)
            return Result(
                logits=logits, logit_positions=positions, prefill_tokens=len(positions), prefill_s=0.5, **extra
            )
        return Result(
            text="gen", generated_ids=[1, 2, 3], prefill_tokens=len(positions), prefill_s=0.25, decode_s=0.125, **extra
        )


def reference(role: str, prefix: list[int], option: str) -> float:
    logp = torch.log_softmax(table(role).to(torch.float16).float(), dim=-1)
    ids = [VOCAB.index(c) for c in option]
    prev = prefix[-1]
    total = 0.0
    for t in ids:
        total += float(logp[prev, t])
        prev = t
    return total


def opener(sessions: list[FakeSession], **kw: object):
    def new() -> FakeSession:
        sessions.append(FakeSession(**kw))
        return sessions[-1]

    return new


def test_session_policy_defaults_and_checks() -> None:
    policy = SessionPolicy(FakeSession)
    assert (policy.temperature, policy.top_p, policy.seed) == (0.0, 1.0, None)
    assert policy.session is None and policy.last_stats is None and policy.last_scores == []
    assert policy.num_tokens == 0 and policy.peak_cache_bytes == 0
    with pytest.raises(ValueError, match=r"^new_session must be a callable that opens a session, got str$"):
        SessionPolicy("session")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="top_p"):
        SessionPolicy(FakeSession, top_p=0)


def test_generate_opens_a_session_seeds_each_call_and_reports_stats() -> None:
    sessions: list[FakeSession] = []
    policy = SessionPolicy(opener(sessions), temperature=0.7, top_p=0.8, seed=40)
    assert policy.generate("plan", "abc", max_new_tokens=5, stop=["\n"]) == "gen"  # no reset: opens one itself
    assert len(sessions) == 1
    policy.generate("action", "", max_new_tokens=2, stop=("]",))
    s = sessions[0]
    assert s.log == [
        ("append_text", "abc"),
        ("step", "plan", {"max_new_tokens": 5, "temperature": 0.7, "top_p": 0.8, "seed": 40, "stop": ["\n"]}),
        ("step", "action", {"max_new_tokens": 2, "temperature": 0.7, "top_p": 0.8, "seed": 41, "stop": ["]"]}),
    ]
    assert policy.last_stats == StepStats(
        prefill_tokens=1, decode_tokens=3, prefill_s=0.25, decode_s=0.125, recomputed_tokens=2, trajectory_tokens=3
    )
    assert policy.num_tokens == 3 and policy.peak_cache_bytes == 777
    policy.reset()
    assert len(sessions) == 2 and policy.last_stats is None and policy.num_tokens == 0
    policy.generate("plan", "a", max_new_tokens=1, stop=[])
    assert sessions[1].log[-1][2]["seed"] == 40


def test_generate_without_seed_and_without_recomputed_tokens() -> None:
    sessions: list[FakeSession] = []
    policy = SessionPolicy(opener(sessions, with_recomputed=False))
    policy.reset()
    policy.generate("plan", "ab", max_new_tokens=1, stop=[])
    policy.generate("plan", "c", max_new_tokens=1, stop=[])
    assert [e[2]["seed"] for e in sessions[0].log if e[0] == "step"] == [None, None]
    assert policy.last_stats.recomputed_tokens == 0 and policy.last_stats.trajectory_tokens == 3


@pytest.mark.parametrize("score", ["sum", "mean"])
def test_choose_scores_match_the_teacher_forced_reference(score: str) -> None:
    sessions: list[FakeSession] = []
    policy = SessionPolicy(opener(sessions))
    policy.reset()
    policy.generate("plan", "abc", max_new_tokens=1, stop=[])
    options = ["agd", "dbe", "eb", "a"]  # unequal token counts; sum picks "a", mean picks "eb"
    prefix = list(sessions[0].ids) + [VOCAB.index("e")]
    index = policy.choose("action", "e", options, score=score)
    ref = [reference("action", prefix, o) for o in options]
    expected = [r / len(o) for r, o in zip(ref, options, strict=True)] if score == "mean" else ref
    assert policy.last_scores == pytest.approx(expected, abs=1e-4)
    assert index == expected.index(max(expected)) == {"sum": 3, "mean": 2}[score]
    assert sessions[0].ids == prefix + [VOCAB.index(c) for c in options[index]]
    stats = policy.last_stats
    assert stats.trajectory_tokens == len(prefix) + len(options[index])
    # one step for the first tokens, one per multi-token option; each prefill counted, 2 recomputed per step
    assert stats.prefill_s == pytest.approx(0.5 * 4) and stats.recomputed_tokens == 2 * 4
    assert stats.prefill_tokens == 1 + 3 + 3 + 2 and stats.decode_tokens == 0


def test_choose_appends_replace_the_chosen_text() -> None:
    sessions: list[FakeSession] = []
    policy = SessionPolicy(opener(sessions))
    policy.reset()
    base = "ab"
    policy.choose("plan", base, ["c", "cc"], score="sum")
    prefix = [0, 1]
    ref = [reference("plan", prefix, o) for o in ("c", "cc")]
    assert policy.last_scores == pytest.approx(ref, abs=1e-4)
    policy.reset()
    index = policy.choose("reflect", base, ["hhh", "d"], appends=["gg", "f"])
    ref = [reference("reflect", prefix, o) for o in ("hhh", "d")]
    assert index == ref.index(max(ref))
    assert sessions[1].log[-1] == ("append_text", ["gg", "f"][index])
    assert sessions[1].ids == prefix + [VOCAB.index(c) for c in ["gg", "f"][index]]
    assert [e[0] for e in sessions[1].log].count("truncate") == 1


def test_choose_opens_a_session_and_skips_empty_new_text() -> None:
    sessions: list[FakeSession] = []
    policy = SessionPolicy(opener(sessions, with_recomputed=False))
    policy.generate("plan", "ab", max_new_tokens=1, stop=[])
    policy.choose("plan", "", ["c", "d"])
    assert len(sessions) == 1 and [e for e in sessions[0].log if e[0] == "append_text"] == [("append_text", "ab")]
    assert policy.last_stats.recomputed_tokens == 0
    fresh = SessionPolicy(opener(sessions))
    fresh.choose("plan", "a", ["b"])
    assert len(sessions) == 2 and sessions[1].ids == [0, 1]
    assert sessions[1].log[1] == ("step", "plan", {"max_new_tokens": 0, "return_logits": True})


def test_choose_rejects_bad_arguments_before_touching_the_session() -> None:
    sessions: list[FakeSession] = []
    policy = SessionPolicy(opener(sessions))
    policy.reset()
    with pytest.raises(ValueError, match=r"^choose needs at least one option$"):
        policy.choose("plan", "a", [])
    with pytest.raises(ValueError, match="choice score 'median'"):
        policy.choose("plan", "a", ["b"], score="median")
    with pytest.raises(ValueError, match=r"^appends has 1 entries for 2 options$"):
        policy.choose("plan", "a", ["b", "c"], appends=["x"])
    assert sessions[0].log == []
    with pytest.raises(ValueError, match=r"^options \['zz'\] tokenise to nothing$"):
        policy.choose("plan", "a", ["b", "zz"])


def test_choose_refuses_logits_that_do_not_end_at_the_trajectory_end() -> None:
    class Shifted(FakeSession):
        def step(self, role: str, **kw: object) -> Result:
            res = super().step(role, **kw)
            res.logit_positions = [p + 1 for p in res.logit_positions]
            return res

    policy = SessionPolicy(Shifted)
    policy.reset()
    with pytest.raises(AssertionError):
        policy.choose("plan", "ab", ["c", "d"])
