"""A reused engine row serves each request exactly as a fresh engine serving that request alone; stops at the edges.

Row reuse (issue 37): a batched row that finished one request (its stop strings, budget, role, sampling settings,
prompt length) and then serves another must give what a fresh one-row engine gives for the new request: same
tokens, same text, same stop reason, same kept length, same trajectory. The two requests differ in every field at
once (a long prompt then a short one, or the reverse; other stop strings; another budget; another role; greedy then
sampled with its own top-p and seed), so state that outlives its request (a stale stop mask, budget, count, role,
temperature, position) changes the output. Both orders run at once on two rows, with and without an episode reset
in between, and with short prompts fed through the decode step (``prefill_in_decode``).

Stop boundaries: a budget reached on the very token that completes a stop string, a stop string matched by the
first generated token, and a stop string split across two tokens; after each, the row's caches must hold exactly the
kept trajectory (the next turn equals a fresh engine given the same ids).
"""

from __future__ import annotations

import pytest
from conftest import tiny_multi_lora
from hypothesis import given, settings
from hypothesis import strategies as st

from lragent.engine import Engine, GenerationRequest
from lragent.schemes import SCHEMES

_CACHE: dict = {}
CAPACITY = 96
VOCAB = 258


class CharTokenizer:
    """Token i is the one character chr(0x4E00 + i): every token has its own printable text, so a stop string of
    n characters spans exactly n tokens."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(0x4E00 + int(i)) for i in ([ids] if isinstance(ids, int) else ids))


def model():
    if "model" not in _CACHE:
        _CACHE["model"] = tiny_multi_lora("tiny-llama", b_std=0.3, overrides={"vocab_size": VOCAB})
    return _CACHE["model"]


def tok():
    return CharTokenizer()


def engine(scheme: str, rows: int = 1, **kw) -> Engine:
    return Engine(
        model(), scheme, rows=rows, capacity=CAPACITY, tokenizer=tok(), eos_token_ids=[], droidspeak_layers=[1], **kw
    )


def fresh(scheme: str, turns) -> list:
    """Each (prompt ids, request) in turn on one row of a fresh one-row engine (memoised: results, then the ids)."""
    key = (scheme, repr(turns))
    if key not in _CACHE:
        eng = engine(scheme)
        out = []
        for ids, req in turns:
            eng.append(0, ids)
            out.append(eng.generate(0, req))
        _CACHE[key] = out + [list(eng.ids(0))]
    return _CACHE[key]


def same(a, b, where) -> None:
    assert a.generated_ids == b.generated_ids, (*where, a.generated_ids, b.generated_ids)
    assert (a.text, a.stop_reason, a.kept_tokens) == (b.text, b.stop_reason, b.kept_tokens), where
    assert (a.role, a.prefill_tokens, a.recomputed_tokens) == (b.role, b.prefill_tokens, b.recomputed_tokens), where


LONG = list(b"The agents share one cache; the planner speaks first and at length.")[:40]
SHORT = list(b"Tool: 42\n")


def _free_text(scheme, ids, req) -> str:
    """What ``req`` generates with no stop string and a budget of 14 (fresh engine)."""
    free = GenerationRequest(req.role, 14, (), req.temperature, req.top_p, req.seed)
    return fresh(scheme, [(ids, free)])[0].text


def requests(scheme: str, b_stops: bool = False):
    """Two requests that differ in every field. ``a`` has stop strings drawn from what ``b`` generates early on (a
    one-token stop ``b`` meets at its second token), so a stale stop mask would end ``b`` too soon; ``b`` has none
    (or, with ``b_stops``, stop strings of its own drawn from ``a``'s text)."""
    a = GenerationRequest(role=2, max_new_tokens=12, temperature=0.0)
    b = GenerationRequest(role=0, max_new_tokens=6, temperature=0.9, top_p=0.85, seed=7)
    ta, tb = _free_text(scheme, LONG, a), _free_text(scheme, SHORT, b)
    a.stop = (ta[6:8], tb[1])
    if b_stops:
        b.stop = (tb[4:6], ta[1:3])
    return a, b


@pytest.mark.parametrize(
    ("scheme", "reset"), [(s, True) for s in SCHEMES] + [("base_shared", False)], ids=lambda x: str(x)
)
def test_reused_row_serves_a_request_differing_in_every_field_as_a_fresh_engine(scheme, reset):
    a, b = requests(scheme)
    plan = {0: [(LONG, a), (SHORT, b)], 1: [(SHORT, b), (LONG, a)]}  # both orders, side by side
    eng = engine(scheme, rows=2)
    got: dict[int, list] = {0: [], 1: []}

    def launch(r: int) -> None:
        k = len(got[r])
        if k and reset:
            eng.reset(r)
        ids, req = plan[r][k]
        eng.append(r, ids)
        assert eng.start(r, req) is None

    for r in plan:
        launch(r)
    while eng._pending:
        for res in eng.advance():
            got[res.row].append(res)
            if len(got[res.row]) < 2:
                launch(res.row)
    for r, turns in plan.items():
        if reset:
            want = [fresh(scheme, [t])[0] for t in turns]
            want_ids = fresh(scheme, turns[1:])[-1]
        else:
            *want, want_ids = fresh(scheme, turns)
        for k, (w, g) in enumerate(zip(want, got[r], strict=True)):
            same(w, g, (scheme, f"row {r}", f"request {k}"))
        assert eng.ids(r) == want_ids, (scheme, r)
    # the setup is sensitive: the two requests end differently, and at least one of them on a stop string
    assert got[0][0].generated_ids != got[0][1].generated_ids
    assert "stop" in {res.stop_reason for res in got[0]}


@pytest.mark.parametrize("scheme", ["non_shared"])
def test_reused_row_with_prompts_fed_through_decoding_equals_a_fresh_engine(scheme):
    """Short prompts go through the decode step (``prefill_in_decode``); the long one is prefilled eagerly."""
    a, b = requests(scheme, b_stops=True)
    eng = engine(scheme, rows=2, prefill_in_decode=len(SHORT))
    eng.append(0, LONG)
    eng.start(0, a)
    eng.append(1, SHORT)
    eng.start(1, b)
    got = {0: [], 1: []}
    while eng._pending:
        for res in eng.advance():
            got[res.row].append(res)
            if len(got[res.row]) == 1:
                eng.reset(res.row)
                ids, req = (SHORT, b) if res.row == 0 else (LONG, a)
                eng.append(res.row, ids)
                eng.start(res.row, req)
    for r, turns in {0: [(LONG, a), (SHORT, b)], 1: [(SHORT, b), (LONG, a)]}.items():
        for k, (ids, req) in enumerate(turns):
            w = fresh(scheme, [(ids, req)])[0]
            g = got[r][k]
            assert (w.generated_ids, w.text, w.stop_reason, w.kept_tokens) == (
                g.generated_ids,
                g.text,
                g.stop_reason,
                g.kept_tokens,
            ), (scheme, r, k)


ROLE = st.integers(0, 2)
REQ = st.tuples(
    st.integers(0, 2),  # role
    st.integers(1, 7),  # budget
    st.sampled_from([0.0, 0.7, 1.3]),  # temperature
    st.sampled_from([1.0, 0.8]),  # top_p
    st.integers(0, 3),  # seed
    st.integers(0, 6),  # stop: a piece of the request's free text at this offset (6: none)
    st.integers(3, 30),  # prompt length
)


@settings(max_examples=4)
@given(first=REQ, second=REQ)
def test_any_second_request_on_a_reused_row_equals_a_fresh_engine(first, second):
    scheme = "full_shared"
    turns = []
    for i, (role, budget, temp, top_p, seed, stop_at, n) in enumerate((first, second)):
        ids = LONG[i : i + n]
        req = GenerationRequest(role=role, max_new_tokens=budget, temperature=temp, top_p=top_p, seed=seed)
        if stop_at < 6:
            text = _free_text(scheme, ids, req)
            req.stop = (text[stop_at : stop_at + 1 + stop_at % 2],)
        turns.append((ids, req))
    eng = engine(scheme, rows=2)
    eng.append(1, LONG[:5])  # a neighbour row generating all along
    eng.start(1, GenerationRequest(role=1, max_new_tokens=40, temperature=1.0, seed=5))
    eng.append(0, turns[0][0])
    eng.start(0, turns[0][1])
    results = []
    while 0 in eng._pending or len(results) < 2:
        for res in eng.advance():
            if res.row == 0:
                results.append(res)
                if len(results) == 1:
                    eng.reset(0)
                    eng.append(0, turns[1][0])
                    eng.start(0, turns[1][1])
    same(fresh(scheme, [turns[1]])[0], results[1], ("second request",))


# ---- stop boundaries ------------------------------------------------------------------------------------------------
PROMPT = list(b"hello world, say more")


def sampled(budget: int, stop: tuple[str, ...] = ()) -> GenerationRequest:
    """Role 1 sampling with a fixed seed (varied tokens; the same ones in every run)."""
    return GenerationRequest(role=1, max_new_tokens=budget, stop=stop, temperature=1.0, seed=3)


def _free(scheme: str, budget: int = 10):
    res, ids = fresh(scheme, [(PROMPT, sampled(budget))])
    return res, ids


def _then_next_turn_equals_fresh(scheme: str, eng: Engine) -> None:
    """The next turn of the same role on this row equals a fresh engine given the same trajectory ids: the caches
    hold the kept tokens and nothing of the dropped stop string."""
    nxt = GenerationRequest(role=1, max_new_tokens=3)
    eng.append(0, SHORT)
    ids = list(eng.ids(0))
    got = eng.generate(0, nxt)
    want = fresh(scheme, [(ids, nxt)])[0]
    assert (want.generated_ids, want.text, want.stop_reason) == (got.generated_ids, got.text, got.stop_reason)
    assert got.prefill_tokens == len(SHORT) and got.recomputed_tokens == 0  # cached up to the kept tokens


@pytest.mark.parametrize("scheme", ["base_lr_shared"])
def test_budget_reached_on_the_token_that_completes_a_stop_string(scheme):
    free, _ = _free(scheme)
    text = free.text
    assert len(free.generated_ids) == 10 and len(text) == 10
    cases = [(stop, 5) for stop in (text[3:5], text[4]) if text.find(stop) == 5 - len(stop)]
    assert len(cases) == 2, text  # the stop completes at token 5; the budget is 5 as well
    for stop, k in cases:
        for budget in (k, k + 2):
            eng = engine(scheme)
            eng.append(0, PROMPT)
            res = eng.generate(0, sampled(budget, (stop,)))
            assert res.stop_reason == "stop", (stop, budget)
            assert res.generated_ids == free.generated_ids[:k]
            assert res.text == text[: k - len(stop)] and res.kept_tokens == k - len(stop)
            assert eng.ids(0) == PROMPT + free.generated_ids[: k - len(stop)]
            _then_next_turn_equals_fresh(scheme, eng)
        eng = engine(scheme)  # one token short of the stop: the budget ends it and every token is kept
        eng.append(0, PROMPT)
        res = eng.generate(0, sampled(k - 1, (stop,)))
        assert res.stop_reason == "length" and res.kept_tokens == k - 1 and res.text == text[: k - 1]
        assert eng.ids(0) == PROMPT + free.generated_ids[: k - 1]


@pytest.mark.parametrize("scheme", ["droidspeak"])
def test_stop_string_matched_by_the_first_generated_token(scheme):
    free, _ = _free(scheme)
    text = free.text
    for stop in (text[0], text[0:2]):
        eng = engine(scheme)
        eng.append(0, PROMPT)
        res = eng.generate(0, sampled(8, ("zzzz", stop)))
        assert res.stop_reason == "stop" and res.text == "" and res.kept_tokens == 0, stop
        assert res.generated_ids == free.generated_ids[: len(stop)]
        assert eng.ids(0) == PROMPT
        _then_next_turn_equals_fresh(scheme, eng)


@pytest.mark.parametrize(("scheme", "at"), [("non_shared", 1), ("full_shared", 4)])
def test_stop_string_split_across_two_tokens(scheme, at):
    free, _ = _free(scheme)
    text = free.text
    stop = text[at : at + 2]
    assert len(stop) == 2 and text.find(stop[0]) == at  # two tokens, its first character fresh
    first = text.find(stop)
    eng = engine(scheme)
    eng.append(0, PROMPT)
    res = eng.generate(0, sampled(10, (stop,)))
    assert res.stop_reason == "stop"
    assert res.generated_ids == free.generated_ids[: first + 2]
    assert res.text == text[:first] and res.kept_tokens == first
    assert eng.ids(0) == PROMPT + free.generated_ids[:first]
    _then_next_turn_equals_fresh(scheme, eng)
