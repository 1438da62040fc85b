"""A reused engine row serves each request exactly as a fresh engine serving that request alone; stops at the edges.

Row reuse: a batched row that finished one request (its stop strings, budget, role, sampling settings,
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

import contextlib
import inspect
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_multi_lora
from hypothesis import given, settings
from hypothesis import strategies as st

from datamodules.tiny_tokenizer import BYTE_VOCAB_SIZE, byte_tokenizer
from lragent.cache_views import DecodeView
from lragent.engine import CapacityError, Engine, GenerationRequest, StopTokenIndex, capture_stream, find_stop
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


# ---- stop strings: the earliest stop, the stop-token index, special tokens ------------------------------------------
@settings(max_examples=60)
@given(text=st.text("ab\n", max_size=12), stops=st.lists(st.text("ab\n", max_size=3), max_size=3))
def test_find_stop_is_where_the_first_stop_string_starts(text, stops):
    """No stop string starts before the cut, and one starts at it (empty stop strings never match)."""
    cut = find_stop(text, stops)
    present = [s for s in stops if s and s in text]
    if cut is None:
        assert not present
        return
    assert any(text.startswith(s, cut) for s in present)
    assert not any(s in text[: cut + len(s) - 1] for s in present)


class DecodeOnly:
    """A tokenizer with ``decode`` only (no ``batch_decode``) over the byte tokenizer's ids; ids it does not know
    decode to ``None``, as some tokenizers answer for them."""

    def __init__(self, tok, size: int) -> None:
        self.tok, self.size = tok, size

    def decode(self, ids, skip_special_tokens: bool = False):
        ids = [ids] if isinstance(ids, int) else list(ids)
        if any(i >= self.size for i in ids):
            return None
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("batch_decode", [True, False], ids=["batch_decode", "decode_only"])
def test_stop_index_marks_the_tokens_whose_own_text_holds_a_stop_string(batch_decode):
    """The byte tokenizer's layout: token i < 256 is byte i, 256 is ``<eos>``, 257 ``<pad>``; the model's vocabulary
    has 4 more rows. A special token's text counts (a stop string ``<eos>`` ends on it), rows past the tokenizer never
    match, empty stop strings are ignored, several stop strings mark the union, and asking never changes an earlier
    answer."""
    hf = byte_tokenizer()
    index = StopTokenIndex(hf if batch_decode else DecodeOnly(hf, BYTE_VOCAB_SIZE), BYTE_VOCAB_SIZE + 4)

    def ids(stops):
        mask = index.mask(stops)
        assert mask.dtype == torch.bool and mask.shape == (BYTE_VOCAB_SIZE + 4,)
        return mask.nonzero().flatten().tolist()

    assert ids(["<eos>"]) == [256]
    assert ids(["<"]) == [ord("<"), 256, 257]
    assert ids(["X"]) == [ord("X")]  # not the rows past the tokenizer's vocabulary
    assert ids(["", "A"]) == ids(["A"]) == [ord("A")]
    assert ids(["A", "", "B"]) == [ord("A"), ord("B")]
    assert ids(["A"]) == [ord("A")] and ids(["B"]) == [ord("B")]  # the union did not leak into the per-string masks
    assert ids(["ab"]) == [] and ids([]) == []


class SpecialCharTokenizer(CharTokenizer):
    """:class:`CharTokenizer` with special tokens: their character is shown unless ``skip_special_tokens``."""

    def __init__(self, special) -> None:
        self.special = {int(t) for t in special}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        return super().decode([i for i in ids if not (skip_special_tokens and int(i) in self.special)])


class _Replay:
    """Stands in for a captured CUDA graph: the decode step as captured (``max_len=None``), ``sync_every`` steps
    between host checks, so a row runs past a stop string until the next sync."""

    def __init__(self, engine: Engine, b: int, sampling: bool, extra: int = 0) -> None:
        self.engine, self.b, self.sampling, self.extra = engine, b, sampling, extra

    def replay(self) -> None:
        self.engine._decode_step(self.b, self.sampling, None, self.extra)


def graph_semantics(eng: Engine, sync_every: int) -> Engine:
    eng.cuda_graphs, eng.sync_every = True, sync_every
    eng._graph_for = lambda b, sampling, extra=0: _Replay(eng, b, sampling, extra)
    return eng


def test_stop_string_seen_at_a_later_sync_cuts_generation_where_it_completes():
    """With several steps between host checks a row generates past a stop string that spans tokens; the result is
    as if it had stopped on the token that completes it, for every stop position and sync period."""
    scheme = "full_shared"
    free, _ = _free(scheme)
    text = free.text
    cases = 0
    for at in range(1, 7):
        stop = text[at : at + 2]
        first = text.find(stop)
        for sync_every in (2, 3, 4):
            eng = graph_semantics(engine(scheme), sync_every)
            eng.append(0, PROMPT)
            res = eng.generate(0, sampled(10, (stop,)))
            assert res.stop_reason == "stop", (at, sync_every)
            assert res.generated_ids == free.generated_ids[: first + 2], (at, sync_every)
            assert res.text == text[:first] and res.kept_tokens == first
            assert eng.ids(0) == PROMPT + free.generated_ids[:first]
            cases += (first + 2) % sync_every != 0  # the row ran past the stop before a host check saw it
    assert cases >= 6


def _special_window(free_ids):
    """An offset i where tokens i, i+1, i+2 differ from each other and from tokens i+3, i+4 (the window's texts
    cannot be confused once token i+1 is special)."""
    for i in range(len(free_ids) - 4):
        w = free_ids[i : i + 5]
        if len(set(w)) == 5 and w[1] not in free_ids[:i]:
            return i
    raise AssertionError(f"no window of five distinct tokens in {free_ids}")


def test_special_tokens_count_as_kept_tokens_but_show_no_text():
    """A special token inside the kept part is kept (its empty text is a prefix of the cut text), and a stop string
    whose characters a special token separates is found on the text without it, also when the row ran past it."""
    scheme = "full_shared"
    free, _ = _free(scheme)
    g = free.generated_ids
    i = _special_window(g)
    tok = SpecialCharTokenizer([g[i + 1]])
    plain = CharTokenizer()

    def run(stop, sync_every=None):
        eng = Engine(model(), scheme, capacity=CAPACITY, tokenizer=tok, eos_token_ids=[], droidspeak_layers=[1])
        if sync_every:
            graph_semantics(eng, sync_every)
        eng.append(0, PROMPT)
        return eng, eng.generate(0, sampled(10, (stop,)))

    # the special token g[i+1] sits before the stop string g[i+3] g[i+4]: it is kept
    stop = plain.decode(g[i + 3 : i + 5])
    skipped = tok.decode(g[: i + 5], skip_special_tokens=True)
    assert stop not in tok.decode(g[: i + 4], skip_special_tokens=True) and skipped.endswith(stop)
    eng, res = run(stop)
    assert res.stop_reason == "stop" and res.generated_ids == g[: i + 5]
    assert res.kept_tokens == i + 3 and res.text == tok.decode(g[: i + 3], skip_special_tokens=True)
    assert eng.ids(0) == PROMPT + g[: i + 3]
    # the stop string g[i] g[i+2], the special token g[i+1] between its characters, seen at a later sync
    stop = plain.decode([g[i], g[i + 2]])
    assert stop not in tok.decode(g[: i + 2], skip_special_tokens=True)
    assert stop not in tok.decode(g, skip_special_tokens=False)  # only the text without specials holds it
    for sync_every in (None, 8):
        eng, res = run(stop, sync_every)
        assert res.stop_reason == "stop" and res.generated_ids == g[: i + 3], sync_every
        assert res.kept_tokens == i and res.text == tok.decode(g[:i], skip_special_tokens=True)
        assert eng.ids(0) == PROMPT + g[:i]


# ---- prefill: logits, devices, dtypes, kernels ----------------------------------------------------------------------
def _two_roles(scheme: str, **kw) -> Engine:
    """A row where role 0 stepped over a prompt, then new tokens for role 1 (a catch-up for base_shared and
    DroidSpeak, a forward of everything for non_shared)."""
    eng = engine(scheme, **kw)
    eng.append(0, LONG[:12])
    eng.generate(0, GenerationRequest(role=0, max_new_tokens=2))
    eng.append(0, SHORT)
    return eng


@pytest.mark.parametrize("scheme", SCHEMES)
def test_prefill_returns_one_logits_row_per_position_it_names(scheme):
    """Without ``return_logits`` the prefill gives the last position's logits only; with it, every forwarded
    position's, ending at the last; the last row is the same either way (to rounding)."""
    out = {}
    for want in (False, True):
        eng = _two_roles(scheme)
        n = len(eng.ids(0))
        logits, positions, total, recomputed = eng.prefill(0, 1, return_logits=want)
        assert logits.shape == (len(positions), VOCAB) and positions[-1] == n - 1, (scheme, want)
        assert positions == (list(range(positions[0], n)) if want else [n - 1])
        assert total >= len(SHORT) and 0 <= recomputed <= total - len(SHORT)
        out[want] = logits[-1]
    assert (out[False] - out[True]).abs().max() <= 1e-5  # one GEMM row or several: rounding only


def _steps_everywhere(eng: Engine, ctx) -> list:
    """Prefills (with a catch-up where the scheme has one), eager decoding with logits, a sampled request and
    scoring, each run inside ``ctx``."""
    out = []
    for role, ids, n, temp in [(0, LONG[:12], 3, 0.0), (1, SHORT[:3], 3, 0.9), (2, SHORT, 2, 0.0), (0, [5, 6], 2, 0.7)]:
        eng.append(0, ids)
        with ctx():
            res = eng.generate(0, GenerationRequest(role, n, temperature=temp, seed=4, return_logits=role != 1))
        out.append((res.generated_ids, res.logits))
    with ctx():
        out.append(eng.score(0, 1, [[3, 4], [7]]))
    return out


def _same_runs(a: list, b: list) -> None:
    for x, y in zip(a[:-1], b[:-1], strict=True):
        assert x[0] == y[0]
        assert (x[1] is None and y[1] is None) or torch.equal(x[1], y[1])
    assert a[-1] == b[-1]


@contextlib.contextmanager
def float64():
    """The process's default dtype set to float64 for the block."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@pytest.mark.parametrize("scheme", ["non_shared", "base_shared", "droidspeak"])
def test_steps_run_on_the_engines_device_and_dtype_not_the_process_defaults(scheme):
    """Every tensor a step makes lives on the engine's device in the engine's dtype: with the process's default
    device set to ``meta`` (a CPU stand-in for a CUDA engine in a process whose default device is the CPU; a tensor
    left on the default device then fails) or its default dtype to float64, the steps give bit for bit what they
    give under the defaults."""
    want = _steps_everywhere(engine(scheme), contextlib.nullcontext)
    _same_runs(_steps_everywhere(engine(scheme), lambda: torch.device("meta")), want)

    _same_runs(_steps_everywhere(engine(scheme), float64), want)


def test_steps_with_lent_rows_run_on_the_engines_device_and_dtype_not_the_process_defaults():
    """The decode steps that lend extra token rows to fed prompts (``prefill_in_decode``, ``feed_budget``) make every
    tensor on the engine's device in its dtype: run under the ``meta`` default device or the float64 default dtype,
    two rows feeding 9 and 3 tokens give bit for bit what they give under the defaults."""

    def run(ctx) -> list:
        eng = engine("full_shared", rows=2, prefill_in_decode=16, feed_budget=3)
        fed = []
        fed_step = eng._fed_step
        eng._fed_step = lambda *a: fed.append(a[-1]) or fed_step(*a)
        for row, ids in enumerate((LONG[:9], SHORT[:3])):
            eng.append(row, ids)
            eng.start(row, GenerationRequest(role=row, max_new_tokens=3, temperature=0.8 * row, seed=5))
        out = []
        while eng._pending:
            with ctx():
                out += [(res.row, res.generated_ids) for res in eng.advance()]
        assert fed and set(fed) == {3}  # the steps with lent rows ran in the context
        return sorted(out)

    want = run(contextlib.nullcontext)
    assert run(lambda: torch.device("meta")) == want and run(float64) == want


def test_a_fed_row_started_under_another_default_device_feeds_its_own_tokens():
    """``start`` of a row whose prompt is fed through decoding puts the fed ids on the host itself, not on the
    process's default device: started under the ``meta`` default device (a tensor left there cannot be copied into
    the engine's state), two fed rows generate what they generate when started under the defaults."""

    def run(ctx) -> list:
        eng = engine("full_shared", rows=2, prefill_in_decode=16, feed_budget=3)
        for row, ids in enumerate((LONG[:9], SHORT[:3])):
            eng.append(row, ids)
            req = GenerationRequest(role=row, max_new_tokens=3, temperature=0.8 * row, seed=5)
            with ctx():
                assert eng.start(row, req) is None
            assert eng._pending[row].forced_left == len(ids)  # fed, not prefilled
        out = []
        while eng._pending:
            out += [(res.row, res.generated_ids) for res in eng.advance()]
        return sorted(out)

    assert run(lambda: torch.device("meta")) == run(contextlib.nullcontext)


def test_fed_ids_are_staged_page_locked_on_the_host_exactly_for_a_cuda_engine(monkeypatch):
    """The fed ids' staging buffer (int64 on the CPU, one slot per row as wide as ``d_forced``) is page-locked when
    the engine is on CUDA, so that the ``non_blocking`` copy into the decode state does not wait for the device; a
    CPU engine leaves it as it is. Its NumPy view writes into it."""
    pinned = []

    def pin(self):
        pinned.append(tuple(self.shape))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    eng = engine("full_shared", rows=2, prefill_in_decode=8)
    for device, want in [("cpu", []), ("cuda", [(eng.rows, 8)]), ("cuda:1", [(eng.rows, 8)])]:
        eng.device = torch.device(device)
        pinned.clear()
        eng._alloc_forced_host()
        host = eng._forced_host
        assert (host.device.type, host.dtype, tuple(host.shape)) == ("cpu", torch.long, (eng.rows, 8))
        assert pinned == want, device
        eng._forced_host_np[1, :3] = [3, 4, 5]
        assert host[1, :4].tolist() == [3, 4, 5, 0]


def test_every_view_of_a_step_with_lent_rows_carries_the_engines_choices_its_groups_and_a_bound(monkeypatch):
    """The decode steps that lend extra token rows to a fed prompt (``prefill_in_decode``, ``feed_budget``) give their
    views the engine's ``use_kernel`` and ``fuse_ops``, the token groups of the extra rows (``(b, feed_group)``) and,
    eagerly, a bound on what they read (the fed row's length and one position a step, not the whole capacity); a
    fused engine runs their final norm fused, never through the module."""
    import lragent.engine as engine_mod

    views = []

    def record(*args, **kw):
        bound = inspect.signature(DecodeView).bind(*args, **kw)
        bound.apply_defaults()
        views.append({k: bound.arguments[k] for k in ("use_kernel", "fused", "max_len", "token_groups")})
        return DecodeView(*args, **kw)

    monkeypatch.setattr(engine_mod, "DecodeView", record)
    for use_kernel, fuse_ops in [(False, True), (True, False)]:
        m = tiny_multi_lora("tiny-llama", b_std=0.3, overrides={"vocab_size": VOCAB})  # fusing changes the model
        norms = []
        m.decoder.inner.norm.register_forward_hook(lambda *a, norms=norms: norms.append(1))
        eng = Engine(m, "full_shared", capacity=CAPACITY, eos_token_ids=[], use_kernel=use_kernel, fuse_ops=fuse_ops,
                     prefill_in_decode=8, feed_budget=4, feed_group=2)  # fmt: skip
        eng.append(0, LONG[:7])
        views.clear()
        eng.generate(0, GenerationRequest(role=0, max_new_tokens=2))
        # 1 + 4 fed, then 1 + 1 (the extra rows a range of whole groups), then two sampled tokens without extra rows
        assert [v["token_groups"] for v in views] == [(1, 2), (1, 2), None, None], views
        assert all((v["use_kernel"], v["fused"]) == (use_kernel, fuse_ops) for v in views), views
        assert all(v["max_len"] is not None and v["max_len"] <= 7 + k for k, v in enumerate(views, 1)), views
        assert (len(norms) == 0) == fuse_ops, (fuse_ops, len(norms))


def test_every_cache_view_carries_the_engines_kernel_and_fusion_choice(monkeypatch):
    """``use_kernel`` and ``fuse_ops`` reach every prefill and decode view (a view left at its default would pick
    its kernels from the device alone), a fused engine runs the final norm fused, never through the module, and
    eager decoding bounds what its views read by the rows' lengths."""
    import lragent.engine as engine_mod

    views, max_lens = [], []
    for name in ("PrefillView", "DecodeView"):
        cls = getattr(engine_mod, name)

        def record(*args, _cls=cls, _name=name, **kw):
            bound = inspect.signature(_cls).bind(*args, **kw)
            bound.apply_defaults()
            views.append((_name, bound.arguments["use_kernel"], bound.arguments["fused"]))
            if _name == "DecodeView":
                max_lens.append(bound.arguments["max_len"])
            return _cls(*args, **kw)

        monkeypatch.setattr(engine_mod, name, record)
    for use_kernel, fuse_ops in [(False, True), (True, False)]:
        for scheme in ("droidspeak", "base_shared"):
            m = tiny_multi_lora("tiny-llama", b_std=0.3, overrides={"vocab_size": VOCAB})  # fusing changes the model
            norms = []
            m.decoder.inner.norm.register_forward_hook(lambda *a, norms=norms: norms.append(1))
            eng = Engine(m, scheme, capacity=CAPACITY, eos_token_ids=[], droidspeak_layers=[1], use_kernel=use_kernel,
                         fuse_ops=fuse_ops)  # fmt: skip
            views.clear()
            eng.append(0, LONG[:12])
            eng.generate(0, GenerationRequest(role=0, max_new_tokens=2))
            eng.append(0, SHORT)
            eng.generate(0, GenerationRequest(role=1, max_new_tokens=2, return_logits=True))
            assert {v[0] for v in views} == {"PrefillView", "DecodeView"}
            assert all(v[1:] == (use_kernel, fuse_ops) for v in views), (scheme, views)
            assert (len(norms) == 0) == fuse_ops, (scheme, fuse_ops, len(norms))
            # eager decoding reads the cache up to the longest row's length, not the whole capacity
            assert max_lens and all(m is not None and m <= len(eng.ids(0)) for m in max_lens), max_lens
            max_lens.clear()


# ---- capacity, memory accounting, bookkeeping -----------------------------------------------------------------------
def test_a_request_that_needs_exactly_the_capacity_fits_and_growth_doubles_in_256_position_chunks():
    """A batched engine takes a request that fills its capacity exactly (prompt, budget and the one position past
    it) and refuses one more. A growable engine grows between steps to at least twice its capacity, in multiples of
    256 positions, no more than a chunk past what is needed, and keeps what it holds: it generates what an engine
    allocated large from the start generates."""
    eng = engine("full_shared", rows=2)
    prompt = [3 + k % 250 for k in range(CAPACITY)]
    eng.append(0, prompt[: CAPACITY - 7])
    assert eng.generate(0, GenerationRequest(role=0, max_new_tokens=6)).stop_reason == "length"
    eng.append(1, prompt[: CAPACITY - 6])
    with pytest.raises(CapacityError):
        eng.start(1, GenerationRequest(role=0, max_new_tokens=6))

    big = Engine(model(), "base_shared", capacity=1024, eos_token_ids=[])
    grow = Engine(model(), "base_shared", capacity=100, eos_token_ids=[], growable=True)
    caps = [100]
    # needs 257 positions (past twice 100: the need rounded up), then 520 (past 512: twice 512), then 533 (fits)
    for role, n_ids, n_new in [(0, 251, 5), (1, 259, 4), (2, 10, 3)]:
        ids = [(7 * k + n_ids) % 250 + 3 for k in range(n_ids)]
        res = []
        for eng in (big, grow):
            eng.append(0, ids)
            needed = len(eng.ids(0)) + n_new + 1
            res.append(eng.generate(0, GenerationRequest(role=role, max_new_tokens=n_new)).generated_ids)
        cap, old = grow.pool.capacity, caps[-1]
        if needed > old:
            assert cap % 256 == 0 and cap >= max(needed, 2 * old) and cap < max(needed, 2 * old) + 256, (needed, old)
        else:
            assert cap == old
        caps.append(cap)
        assert res[0] == res[1]
    assert len(set(caps)) == 3  # two of the three steps grew


def test_cache_bytes_add_up_over_rows_and_the_peak_is_the_largest_total():
    """Per row, the bytes a row's caches hold equal those of a one-row engine with the same history; the total is
    their sum; the peak is the largest total seen after any step, and a truncation lowers the total, not the peak.
    Each role's cache holds at most one position per trajectory position (base_shared: V_lr per role)."""
    for scheme in ("non_shared", "base_shared"):
        eng = engine(scheme, rows=2)
        alone = [engine(scheme), engine(scheme)]
        totals = []
        for row, role, ids, n in [(0, 0, LONG[:20], 3), (1, 1, SHORT, 2), (0, 1, SHORT, 2), (1, 2, LONG[:9], 3)]:
            for e, r in ((eng, row), (alone[row], 0)):
                e.append(r, ids)
                e.generate(r, GenerationRequest(role=role, max_new_tokens=n))
            per_row = [eng.cache_bytes(r) for r in range(2)]
            assert per_row == [alone[0].cache_bytes(), alone[1].cache_bytes()], scheme
            whole = eng.cache_bytes()
            assert whole == {k: per_row[0].get(k, 0) + per_row[1].get(k, 0) for k in {*per_row[0], *per_row[1]}}
            totals.append(sum(whole.values()))
            assert eng.peak_cache_bytes == max(totals), scheme
        assert eng.ids() == eng.ids(0) != eng.ids(1)
        if scheme == "base_shared":  # row 0: roles 0 and 1 acted, each V_lr within the trajectory
            lr = eng.cache_bytes(0)["v_lr"]
            assert 0 < lr <= 2 * len(eng.ids(0)) * eng.per_position["v_lr"]
        eng.truncate(0, 5)
        assert sum(eng.cache_bytes().values()) < totals[-1] and eng.peak_cache_bytes == max(totals)


def test_a_generating_row_cannot_be_reset():
    eng = engine("full_shared")
    eng.append(0, SHORT)
    eng.start(0, GenerationRequest(role=0, max_new_tokens=3))
    with pytest.raises(ValueError, match="row 0 is generating: wait for its result before resetting it"):
        eng.reset(0)
    res = eng.advance()[0]
    assert len(res.generated_ids) == 3 and eng.ids(0) == SHORT + res.generated_ids


def test_step_result_dict_holds_the_result_fields():
    eng = engine("full_shared")
    eng.append(0, SHORT)
    res = eng.generate(0, GenerationRequest(role=1, max_new_tokens=3, stop=("zz",)))
    d = res.to_dict()
    assert set(d) == {"role", "prefill_tokens", "recomputed_tokens", "generated_ids", "text", "prefill_s",
                      "decode_s", "stop_reason"}  # fmt: skip
    assert all(d[k] == getattr(res, k) for k in d) and d["role"] == "action" and len(d["generated_ids"]) == 3


@pytest.mark.parametrize("scheme", ["non_shared", "full_shared"])
def test_a_step_fed_through_decoding_reports_what_an_eager_prefill_reports(scheme):
    """The same steps with their prompts fed through the decode step (up to 16 new tokens, down to the one last
    token) report the same tokens, logits and prefill and recompute counts as with an eager prefill. No eager prefill
    ran for a fed step, so its prefill time is 0 (its time is in the decode); a step that asks for logits, or for no
    new token, is prefilled eagerly (its logits and its immediate result come from there)."""
    steps = [(0, SHORT, 3, False), (1, SHORT[:4], 2, False), (1, [5], 2, False), (1, [], 1, False), (2, [6], 0, False),
             (0, [7, 8], 2, True), (2, [9], 2, False)]  # fmt: skip
    got = {}
    for fed in (0, 16):
        eng = engine(scheme, prefill_in_decode=fed)
        got[fed] = []
        for role, ids, n, logits in steps:
            eng.append(0, ids)
            got[fed].append(eng.generate(0, GenerationRequest(role=role, max_new_tokens=n, return_logits=logits)))
    for (_, _, n, logits), a, b in zip(steps, got[0], got[16], strict=True):
        assert (a.generated_ids, a.prefill_tokens, a.recomputed_tokens, a.logit_positions) == (
            b.generated_ids,
            b.prefill_tokens,
            b.recomputed_tokens,
            b.logit_positions,
        )
        assert len(b.generated_ids) == n and a.prefill_s > 0
        if logits:
            assert b.logits is not None and (a.logits - b.logits).abs().max() <= 1e-5
        assert (b.prefill_s == 0.0) == (n > 0 and not logits) and (b.decode_s > 0) == (n > 0)


def test_prefill_timing_waits_for_the_engines_own_cuda_stream(monkeypatch):
    """Prefill timing waits for the current stream of the engine's device when it is a CUDA device (its own device,
    not the current one; its stream, not the whole device, where other engines of the process run on theirs), and a
    CPU engine never calls into CUDA."""
    calls = []

    class Stream:
        def __init__(self, device):
            self.device = device

        def synchronize(self):
            calls.append(self.device)

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("whole device", device)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(device))
    eng = engine("full_shared")
    eng.append(0, SHORT)
    eng.generate(0, GenerationRequest(role=0, max_new_tokens=2))
    assert calls == []
    eng.device = torch.device("cuda", 1)
    eng._sync()
    assert calls == [torch.device("cuda", 1)]


# ---- CUDA-graph capture, with CPU stand-ins for the CUDA calls ------------------------------------------------------
class FakeCuda:
    """CPU stand-ins for the CUDA calls of graph capture, modelling what makes capture correct on a GPU:

    - streams order work only through ``wait_stream`` (each stream counts the decode steps run on it);
    - libraries set up per-stream state lazily, so a step may be captured only on a stream where the same step
      (same batch bucket, sampling mode and length bound) ran eagerly before;
    - capture records a step without running it; a replay runs what was recorded, on the buffers that existed at
      capture time (growing the pool replaces them);
    - graphs share memory only through the pool handle passed at capture.

    ``torch.cuda.current_stream(None)`` is the current device's stream, which here is not the engine's.
    """

    def __init__(self, monkeypatch, eng: Engine) -> None:
        import lragent.engine as engine_mod

        self.eng, self.side, self.capturing = eng, None, None
        self.current_streams: dict[str, object] = {}
        self.warm: set = set()
        self.captures: list = []  # (graph, pool handle)
        self.handles: list = []
        real_step = eng._decode_step
        fake = self

        class Stream:
            def __init__(self, device=None) -> None:
                self.device, self.waited, self.steps = device, [], 0

            def wait_stream(self, other) -> None:
                self.waited.append((other, getattr(other, "steps", None)))

        class Graph:
            def __init__(self) -> None:
                self.steps, self.stream, self.buffers = [], None, None

            def replay(self) -> None:
                cur = fake.current(eng.device)
                assert any(o is self.stream and n == self.stream.steps for o, n in cur.waited), "capture not joined"
                assert all(a is b for a, b in zip(self.buffers, fake.buffers(), strict=True)), "stale buffers"
                for args in self.steps:
                    real_step(*args)

        @contextlib.contextmanager
        def stream(s):
            prev = fake.side
            fake.side = s if s is not None else prev  # torch.cuda.stream(None) does nothing
            try:
                yield
            finally:
                fake.side = prev

        @contextlib.contextmanager
        def graph(g, pool=None, stream=None):
            prev, g.stream = fake.side, stream if stream is not None else Stream("the graph's own side stream")
            fake.side, fake.capturing, g.buffers = g.stream, g, fake.buffers()
            try:
                yield
            finally:
                fake.side, fake.capturing = prev, None
            fake.captures.append((g, pool))

        def decode_step(b, sampling, max_len, extra=0):
            s = fake.side if fake.side is not None else fake.current(eng.device)
            args = (b, sampling, max_len) + ((extra,) if extra else ())
            if fake.capturing is not None:
                assert (s, *args) in fake.warm, "captured a step that never ran eagerly on its stream"
                fake.capturing.steps.append(args)
                return
            if s is not fake.current(eng.device):  # side-stream work must come after the state the host wrote
                assert any(o is fake.current(eng.device) for o, _ in s.waited), "side stream did not wait"
            fake.warm.add((s, *args))
            s.steps += 1
            real_step(*args)

        def handle():
            fake.handles.append(object())
            return fake.handles[-1]

        self.Stream = Stream
        monkeypatch.setattr(eng, "_decode_step", decode_step)
        for name, value in [("Stream", Stream), ("stream", stream), ("current_stream", self.current),
                            ("default_stream", self.current),  # the engine is driven from the device's own stream
                            ("graph", graph), ("CUDAGraph", Graph), ("graph_pool_handle", handle),
                            ("current_device", lambda: 0)]:  # fmt: skip
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(engine_mod, "_CAPTURE_STREAMS", {})

    def current(self, device=None):
        key = str(device) if device is not None else "the current device"
        if key not in self.current_streams:
            self.current_streams[key] = self.Stream(key)
        return self.current_streams[key]

    def buffers(self) -> list:
        e = self.eng
        return [e.d_tok, e.d_pos, e.d_active, e.d_logits, e.d_gen, *e.pool.k]


def _drive(eng: Engine, plan: dict) -> dict:
    """Runs each row's requests in turn (continuous refill); returns each row's generated ids and its ids."""
    got = {r: [] for r in plan}

    def launch(r: int) -> None:
        ids, req = plan[r][len(got[r])]
        eng.append(r, ids)
        eng.start(r, req)

    for r in plan:
        launch(r)
    while eng._pending:
        for res in eng.advance():
            got[res.row].append(res.generated_ids)
            if len(got[res.row]) < len(plan[res.row]):
                launch(res.row)
    return {r: (got[r], list(eng.ids(r))) for r in plan}


@pytest.mark.parametrize("scheme", ["full_shared", "base_lr_shared"])
def test_captured_decode_graphs_replay_what_eager_decoding_does(monkeypatch, scheme):
    """Four rows, greedy and sampled, joining and leaving, so the batch bucket and the sampling mode change: decoding
    through captured graphs gives the eager tokens; the graph replayed for a step is the one captured for its
    (bucket, sampling), captured once, after an eager warm-up of that very step on the capture stream, which waited
    for the host's writes and was joined back before the first replay; all graphs share one memory pool."""
    plan = {
        r: [
            (LONG[r : r + 6 + 5 * r], GenerationRequest(r % 3, 2 + 2 * (3 - r) + k, temperature=0.8 * (r % 2), seed=k))
            for k in range(2 if r < 3 else 1)
        ]
        for r in range(4)
    }
    want = _drive(engine(scheme, rows=4), plan)
    eng = engine(scheme, rows=4, sync_every=2)
    eng.cuda_graphs = True
    cuda = FakeCuda(monkeypatch, eng)
    asked = []
    graph_for = eng._graph_for

    def checked(b, sampling, extra=0):
        graph = graph_for(b, sampling, extra)
        assert graph.steps == [(b, sampling, None)], (b, sampling, graph.steps)
        asked.append((b, sampling))
        return graph

    monkeypatch.setattr(eng, "_graph_for", checked)
    assert _drive(eng, plan) == want
    assert len(set(asked)) >= 3 and {False, True} <= {s for _, s in asked}  # the setup varies bucket and sampling
    assert sorted(g.steps[0][:2] for g, _ in cuda.captures) == sorted(set(asked))  # each captured once
    assert len(cuda.handles) == 1 and all(p is cuda.handles[0] for _, p in cuda.captures)


def test_graphs_are_captured_again_after_the_pool_grows(monkeypatch):
    """Growing the pool replaces its buffers: the graphs captured before are dropped (replaying one would read the
    old buffers), and the new ones go into a new memory pool."""
    plan = {0: [(LONG[:10], GenerationRequest(role=0, max_new_tokens=4)), (LONG, GenerationRequest(1, 4))]}
    want = _drive(Engine(model(), "full_shared", capacity=16, eos_token_ids=[], growable=True), plan)
    eng = Engine(model(), "full_shared", capacity=16, eos_token_ids=[], growable=True)
    eng.cuda_graphs = True
    cuda = FakeCuda(monkeypatch, eng)
    assert _drive(eng, plan) == want and eng.pool.capacity > 16
    assert len(cuda.captures) == 2 and len(cuda.handles) == 2
    assert [p for _, p in cuda.captures] == cuda.handles


def test_graphs_with_lent_rows_are_warmed_up_and_captured_with_them_and_timed(monkeypatch):
    """With ``feed_budget`` a step's graph carries its extra token rows: warmed up and captured with them (the fake
    refuses to capture a step that never ran eagerly on its stream), the same ids as eager steps. ``capture_s`` adds
    up each capture's host time and ``replay_s`` each replay call's (a clock that ticks once a reading: each capture
    the same positive amount, at most the readings taken while capturing)."""
    import lragent.engine as engine_mod

    plan = {0: [(LONG[:12], GenerationRequest(role=0, max_new_tokens=3)), (LONG[:9], GenerationRequest(1, 3))],
            1: [(LONG[:7], GenerationRequest(role=1, max_new_tokens=4))]}  # fmt: skip
    kw = {"rows": 2, "capacity": 64, "eos_token_ids": [], "prefill_in_decode": 16, "feed_budget": 3}
    want = _drive(Engine(model(), "full_shared", **kw), plan)
    eng = Engine(model(), "full_shared", **kw)
    eng.cuda_graphs = True
    cuda = FakeCuda(monkeypatch, eng)

    class Clock:
        n = 0

        def perf_counter(self) -> float:
            self.n += 1
            return float(self.n)

    clock = Clock()
    monkeypatch.setattr(engine_mod, "time", clock)
    graph_for, added, replays, launches = eng._graph_for, [], [], []

    def timed(b, sampling, extra=0):
        launches.append(b)  # one launch: its replays are timed together
        before, readings, known = eng.capture_s, clock.n, (b, sampling, extra) in eng._graphs
        graph = graph_for(b, sampling, extra)
        if not known:
            added.append((eng.capture_s - before, clock.n - readings))
            replay = graph.replay

            def counted() -> None:
                n = clock.n
                replay()
                replays.append(clock.n - n)  # the readings inside it

            graph.replay = counted
        return graph

    monkeypatch.setattr(eng, "_graph_for", timed)
    assert _drive(eng, plan) == want
    assert any(len(args) == 4 and args[3] == 3 for g, _ in cuda.captures for args in g.steps)  # lent rows captured
    assert len(added) >= 2 and all(0 < got <= readings for got, readings in added)
    assert len({got for got, _ in added}) == 1 and eng.capture_s == sum(got for got, _ in added)
    # replay_s: each launch's replay calls, timed together: the readings inside them and one tick per launch
    assert len(launches) >= 2 and eng.replay_s == sum(replays) + len(launches)


def test_graph_rounds_queue_sync_every_steps_or_max_steps_and_the_counters_add_up(monkeypatch):
    """Through graphs a round queues ``sync_every`` replays (``launch`` returns how many) and ``advance(max_steps)``
    no more than asked; ``decode_steps`` adds up every round's steps and ``wait_s`` every read-back's wait (a clock
    that ticks once a reading: one tick a collect)."""
    import lragent.engine as engine_mod

    class Clock:
        n = 0

        def perf_counter(self) -> float:
            self.n += 1
            return float(self.n)

    eng = engine("full_shared", rows=2, sync_every=4)
    eng.cuda_graphs = True
    replays, collects = [], []

    class Replay:
        def __init__(self, b: int, sampling: bool, extra: int = 0) -> None:
            self.args = (b, sampling, None, extra)

        def replay(self) -> None:
            replays.append(self.args)
            eng._decode_step(*self.args)

    eng._graph_for = Replay
    collect = eng._collect_finished
    eng._collect_finished = lambda: collects.append(1) or collect()
    monkeypatch.setattr(engine_mod, "time", Clock())
    eng.append(0, LONG[:10])
    eng.start(0, GenerationRequest(role=0, max_new_tokens=20))
    assert eng.launch() == 4 and len(replays) == 4 and eng.collect() == []
    assert eng.advance(max_steps=3) == [] and len(replays) == 7 and eng.decode_steps == 7
    eng.append(1, SHORT)
    eng.start(1, GenerationRequest(role=1, max_new_tokens=2))
    results = []
    while eng._pending:
        results += eng.advance()
    assert sorted(len(res.generated_ids) for res in results) == [2, 20]
    assert eng.decode_steps == len(replays) and len(replays) % 4 == 3  # whole rounds after the three steps asked
    assert eng.wait_s == len(collects) >= 4


def test_refreshing_the_adapters_updates_the_stacked_and_fused_b_where_the_graphs_read_them():
    """A fused-LoRA engine's decode reads every adapter's B from cached tensors (the stacked B, the concatenated B in
    the engine's dtype), which a captured graph reads in place: after a B changed (an adapter trained or loaded
    between steps), the refresh before a step's replays brings them up to date without moving them."""
    m = tiny_multi_lora("tiny-llama", b_std=0.3, overrides={"vocab_size": VOCAB})  # fusing changes the model
    eng = Engine(m, "full_shared", capacity=CAPACITY, eos_token_ids=[], fuse_ops=True, fuse_lora=True)
    eng.append(0, LONG[:8])
    eng.generate(0, GenerationRequest(role=1, max_new_tokens=2))
    mods = eng._lora_modules
    cached = [(mod.__dict__["_b_cache"], mod.__dict__["_cb_cache"]) for mod in mods]
    with torch.no_grad():
        for mod in mods:
            mod.lora_B[1].mul_(-3.0)
        eng._refresh_lora()  # as advance() and launch() call it: without autograd
    for mod, (stacked, cat) in zip(mods, cached, strict=True):
        assert mod.__dict__["_b_cache"] is stacked and mod.__dict__["_cb_cache"] is cat
        assert torch.equal(stacked, torch.stack(list(mod.lora_B))) and torch.equal(cat, mod.cat_b())
    assert cat.dtype == eng.dtype


def test_one_capture_stream_per_cuda_device(monkeypatch):
    """The capture stream of a device is made once, on that device; a device without an index is the current one.
    Under a side stream (an executor's lane) that stream itself is the capture stream: lanes never share one."""
    import lragent.engine as engine_mod

    made = []

    class Stream:
        def __init__(self, device=None) -> None:
            self.device = device
            made.append(self)

    default = object()
    current = {"stream": default}
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current["stream"])
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: default)
    monkeypatch.setattr(engine_mod, "_CAPTURE_STREAMS", {})
    lanes = [object(), object()]
    for lane in lanes:
        current["stream"] = lane
        assert capture_stream(torch.device("cuda", 1)) is lane and not made
    current["stream"] = default
    one = capture_stream(torch.device("cuda", 1))
    assert isinstance(one, Stream) and one.device == torch.device("cuda", 1)
    assert capture_stream(torch.device("cuda", 1)) is one and capture_stream(torch.device("cuda")) is one
    zero = capture_stream(torch.device("cuda", 0))
    assert zero is not one and zero.device == torch.device("cuda", 0)
    assert capture_stream(torch.device("cuda", 0)) is zero and len(made) == 2


def test_the_capture_stream_asks_the_engine_s_own_device_not_the_current_one(monkeypatch):
    """An engine on cuda:0 driven while cuda:1 is the current device: its capture stream follows cuda:0's streams
    (cuda:0 on its default stream: the side stream made for cuda:0, whatever lane cuda:1 runs on; cuda:0 on a lane:
    that lane, while cuda:1 sits on its default stream)."""
    import lragent.engine as engine_mod

    class Stream:
        def __init__(self, device=None) -> None:
            self.device = device

    default = {0: Stream(0), 1: Stream(1)}
    current = {0: default[0], 1: Stream(1)}  # cuda:1 runs on a lane
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    index = lambda device: 1 if device is None else torch.device(device).index
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[index(device)])
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: default[index(device)])
    monkeypatch.setattr(engine_mod, "_CAPTURE_STREAMS", {})
    made = capture_stream(torch.device("cuda", 0))
    assert made is not default[0] and made is not current[1] and made.device == torch.device("cuda", 0)
    lane = current[0] = Stream(0)
    current[1] = default[1]
    assert capture_stream(torch.device("cuda", 0)) is lane


# ---- more edges: ranges, no tokenizer, stop tokens a special token hides, logits with a stop, syncs -----------------
def test_rows_and_token_ids_out_of_range_are_refused_and_change_nothing():
    eng = engine("full_shared", rows=2)
    for row in (2, -1):
        with pytest.raises(ValueError, match=rf"row {row} out of range: the engine has rows 0\.\.1$"):
            eng.append(row, [5])
    with pytest.raises(ValueError, match=r"token ids \[258, 300\] out of range: allowed 0\.\.257"):
        eng.append(0, [5, 258, 300])
    with pytest.raises(ValueError, match=r"token ids \[-1\] out of range"):
        eng.append(1, [-1])
    assert eng.ids(0) == [] and eng.ids(1) == []
    eng.append(1, [0, VOCAB - 1])
    assert eng.ids(1) == [0, VOCAB - 1]


def test_without_a_tokenizer_the_text_is_empty_and_timings_are_wall_seconds():
    eng = Engine(model(), "full_shared", capacity=CAPACITY, eos_token_ids=[])
    eng.append(0, SHORT)
    t0 = time.perf_counter()
    res = eng.generate(0, GenerationRequest(role=0, max_new_tokens=4))
    wall = time.perf_counter() - t0
    assert res.text == "" and res.kept_tokens == 4 and res.stop_reason == "length"
    assert 0 < res.prefill_s <= wall and 0 < res.decode_s <= wall


def test_an_engine_builds_a_stop_index_only_with_a_tokenizer_and_its_counters_start_at_zero():
    """Without a tokenizer there is no stop index (stop strings are refused); with one, an index over the model's
    vocabulary. The step and time counters of a new engine are 0, so after one request the seconds spent in
    ``advance`` are at most the wall time of the request and hold the read-back time."""
    assert Engine(model(), "full_shared", capacity=CAPACITY, eos_token_ids=[]).stop_index is None
    eng = engine("full_shared")
    assert isinstance(eng.stop_index, StopTokenIndex) and eng.stop_index.vocab_size == VOCAB
    counters = ("advance_s", "sync_s", "replay_s", "wait_s", "capture_s", "decode_steps", "peak_cache_bytes",
                "feed_rows", "feed_tokens")  # fmt: skip
    assert [getattr(eng, c) for c in counters] == [0] * len(counters)
    eng.append(0, SHORT)
    t0 = time.perf_counter()
    eng.generate(0, GenerationRequest(role=0, max_new_tokens=3))
    wall = time.perf_counter() - t0
    assert 0 < eng.wait_s <= eng.sync_s <= eng.advance_s <= wall and eng.decode_steps == 3


def test_a_stop_token_whose_text_only_shows_with_special_tokens_is_dropped():
    """The device ends a row on a token whose own text (special tokens shown) holds a stop string; when the result's
    text (special tokens hidden) does not show it, that token is dropped: the step ends on ``stop`` and keeps the
    tokens before it, a special token among them kept but not shown."""
    free, _ = _free("full_shared")
    g = free.generated_ids
    i = _special_window(g)
    assert i + 2 < 10
    tok = SpecialCharTokenizer([g[i], g[i + 1]])
    eng = Engine(model(), "full_shared", capacity=CAPACITY, tokenizer=tok, eos_token_ids=[])
    eng.append(0, PROMPT)
    res = eng.generate(0, sampled(10, (CharTokenizer().decode([g[i + 1]]),)))
    assert res.stop_reason == "stop" and res.generated_ids == g[: i + 2]
    assert res.kept_tokens == i + 1 and res.text == tok.decode(g[:i], skip_special_tokens=True)
    assert eng.ids(0) == PROMPT + g[: i + 1]


def test_logits_of_a_step_cut_by_a_stop_string_are_those_of_the_same_tokens_without_it():
    """Decoding with logits: a step that a stop string spanning tokens ends returns the logits of the positions
    whose next token it generated, as the same step bounded to that many tokens without a stop string does (not
    the logits after its last token)."""
    free, _ = _free("full_shared")
    stop = free.text[2:4]
    n = free.text.find(stop) + 2
    out = []
    for stops, budget in (((stop,), 10), ((), n)):
        eng = engine("full_shared")
        eng.append(0, PROMPT)
        req = GenerationRequest(1, budget, stops, temperature=1.0, seed=3, return_logits=True)
        out.append(eng.generate(0, req))
    assert out[0].generated_ids == out[1].generated_ids == free.generated_ids[:n]
    assert out[0].logit_positions == out[1].logit_positions == list(range(len(PROMPT) + n - 1))
    assert (out[0].logits - out[1].logits).abs().max() <= 1e-6


def test_a_stop_string_on_the_text_finishes_the_row_at_the_next_sync():
    """With several steps between host checks, a row whose text (special tokens hidden) shows a stop string is
    finished at the first check after the stop string completes, not left to run to its budget."""
    free, _ = _free("full_shared")
    g = free.generated_ids
    i = _special_window(g)
    assert i + 3 < 10
    tok = SpecialCharTokenizer([g[i + 1]])
    stop = CharTokenizer().decode([g[i], g[i + 2]])  # the special token g[i+1] sits between its characters
    eng = Engine(model(), "full_shared", capacity=CAPACITY, tokenizer=tok, eos_token_ids=[])
    graph_semantics(eng, i + 3)  # the check right after the stop string's last token
    eng.append(0, PROMPT)
    assert eng.start(0, sampled(10, (stop,))) is None
    res = eng.advance(max_steps=i + 3)
    assert [r.generated_ids for r in res] == [g[: i + 3]] and res[0].stop_reason == "stop"


# ---- construction: defaults, checks, and the dispatch choices on a CUDA device (CPU stand-in) -----------------------
def test_engine_defaults_and_argument_checks():
    eng = Engine(model(), "full_shared", eos_token_ids=[])
    assert (eng.rows, eng.pool.capacity, eng.use_kernel, eng.sync_every, eng.prefill_in_decode) == (1, 4096, True, 8, 0)
    assert (eng.cuda_graphs, eng.fuse_ops, eng.fuse_lora) == (False, False, False)  # a CPU fp32 model
    assert eng.peak_cache_bytes == 0 and sum(eng.cache_bytes().values()) == 0
    for kw, msg in [
        ({"rows": 0}, "rows must be >= 1, got 0"),
        ({"sync_every": 0}, "sync_every must be >= 1, got 0"),
        ({"prefill_in_decode": -1}, r"prefill_in_decode must be an int >= 0 \(0: off\), got -1"),
        ({"prefill_in_decode": True}, "prefill_in_decode must be an int >= 0 \\(0: off\\), got True"),
        ({"cuda_graphs": True}, "^cuda_graphs=True needs the model on a CUDA device$"),
    ]:
        with pytest.raises(ValueError, match=msg):
            Engine(model(), "full_shared", capacity=8, eos_token_ids=[], **kw)
    eng = Engine(model(), "full_shared", capacity=8, eos_token_ids=[], sync_every=1, prefill_in_decode=3, cuda_graphs=0)
    assert (eng.sync_every, eng.prefill_in_decode, eng.cuda_graphs) == (1, 3, False)
    with pytest.raises(ValueError, match="base_lr_shared"):  # one A for all roles: needs a shared-A model
        Engine(tiny_multi_lora("tiny-llama", shared_a=False), "base_lr_shared", capacity=8, eos_token_ids=[])
    eng.append(0, [5, 6])
    with pytest.raises(ValueError, match=r"role id 3 out of range: allowed 0\.\.2"):
        eng.start(0, GenerationRequest(role=3))
    with pytest.raises(ValueError, match="^stop strings need a tokenizer: pass tokenizer= to the engine$"):
        eng.start(0, GenerationRequest(role=0, stop=("x",)))


class _Built(Exception):
    """Stops the engine's constructor once its dispatch choices are made (before it allocates on the device)."""


def _dispatch(monkeypatch, device: str, dtype: torch.dtype, **kw) -> tuple:
    """``(cuda_graphs, fuse_ops, fuse_lora, fused with lora, the decoder's fuse_lora)`` that the constructor picks for
    a model on ``device`` in ``dtype``: a CPU stand-in (a model object that reports that device) with the
    constructor stopped when it builds the scheme."""
    import lragent.engine as engine_mod
    import lragent.fused_weights as fused_weights

    fused = []
    monkeypatch.setattr(fused_weights, "fuse_base_weights", lambda model, lora=False: fused.append(lora))

    def built(*args, **kwargs):
        raise _Built(sys._getframe(1).f_locals["self"])

    monkeypatch.setattr(engine_mod, "make_scheme", built)
    param = SimpleNamespace(device=torch.device(device), dtype=dtype)
    fake = SimpleNamespace(decoder=SimpleNamespace(n_layers=2), model=SimpleNamespace(parameters=lambda: iter([param])),
                           lora_config=SimpleNamespace(shared_a=True), router=[0, 1])  # fmt: skip
    with pytest.raises(_Built) as stop:
        Engine(fake, "full_shared", **kw)
    eng = stop.value.args[0]
    return eng.cuda_graphs, eng.fuse_ops, eng.fuse_lora, fused, fake.decoder.fuse_lora


def test_cuda_graphs_and_fused_paths_default_on_for_a_half_precision_cuda_model(monkeypatch):
    """By default a CUDA engine decodes through graphs, and fuses its weights and kernels (with each adapter's A in
    the fused GEMMs) in fp16/bf16 when kernels are allowed; never on the CPU, in fp32 or with ``use_kernel=False``;
    ``LRAGENT_FUSE_LORA=0`` or ``fuse_lora=False`` keeps the adapters out of the fused GEMMs."""
    monkeypatch.delenv("LRAGENT_FUSE_LORA", raising=False)
    on = (True, True, True, [True], True)
    assert _dispatch(monkeypatch, "cuda:0", torch.bfloat16) == on
    assert _dispatch(monkeypatch, "cuda:0", torch.float16) == on
    assert _dispatch(monkeypatch, "cuda:0", torch.float32) == (True, False, False, [], False)
    assert _dispatch(monkeypatch, "cuda:0", torch.bfloat16, use_kernel=False) == (True, False, False, [], False)
    assert _dispatch(monkeypatch, "cpu", torch.bfloat16) == (False, False, False, [], False)
    assert _dispatch(monkeypatch, "cuda:0", torch.bfloat16, cuda_graphs=False)[0] is False
    assert _dispatch(monkeypatch, "cuda:0", torch.float32, cuda_graphs=True, fuse_ops=True) == on
    off = (False, False, [], False)
    assert _dispatch(monkeypatch, "cuda:0", torch.bfloat16, fuse_ops=False, fuse_lora=True)[1:] == off
    assert _dispatch(monkeypatch, "cuda:0", torch.bfloat16, fuse_lora=False) == (True, True, False, [False], False)
    monkeypatch.setenv("LRAGENT_FUSE_LORA", "0")
    assert _dispatch(monkeypatch, "cuda:0", torch.bfloat16) == (True, True, False, [False], False)
    assert _dispatch(monkeypatch, "cuda:0", torch.bfloat16, fuse_lora=True) == on
    monkeypatch.setenv("LRAGENT_FUSE_LORA", "1")
    assert _dispatch(monkeypatch, "cuda:0", torch.bfloat16) == on


def _feed_group_of(monkeypatch, decoder: dict, device: str = "cuda:0", dtype: torch.dtype = torch.bfloat16, **kw):
    """The ``feed_group`` the constructor picks for a model on ``device`` in ``dtype`` whose decoder has the attributes
    ``decoder`` (a CPU stand-in, the constructor stopped when it builds the scheme, as in :func:`_dispatch`)."""
    import lragent.engine as engine_mod
    import lragent.fused_weights as fused_weights

    monkeypatch.setattr(fused_weights, "fuse_base_weights", lambda model, lora=False: None)

    def built(*args, **kwargs):
        raise _Built(sys._getframe(1).f_locals["self"])

    monkeypatch.setattr(engine_mod, "make_scheme", built)
    param = SimpleNamespace(device=torch.device(device), dtype=dtype)
    fake = SimpleNamespace(decoder=SimpleNamespace(n_layers=2, **decoder), lora_config=SimpleNamespace(shared_a=True),
                           model=SimpleNamespace(parameters=lambda: iter([param])), router=[0, 1])  # fmt: skip
    with pytest.raises(_Built) as stop:
        Engine(fake, "full_shared", **kw)
    return stop.value.args[0].feed_group


def test_the_feed_group_variable_is_taken_where_the_kernel_runs_within_its_query_heads_a_kv_head(monkeypatch):
    """A half-precision CUDA engine with kernels takes ``LRAGENT_FEED_GROUP``, lowered to whole token rows within the
    kernel's 128 query heads a group: ``n_heads // n_kv_heads`` query heads a KV head (1 for an attribute the decoder
    lacks), so 7 // 2 = 3 heads give 42 rows, 7 give 18; an int always. Elsewhere no groups."""
    monkeypatch.setenv("LRAGENT_FEED_GROUP", "128")
    gqa = {"n_heads": 7, "n_kv_heads": 2}
    for decoder, want in [(gqa, 42), ({"n_heads": 7}, 18), ({}, 128), ({"n_kv_heads": 2}, 128)]:
        got = _feed_group_of(monkeypatch, decoder)
        assert (type(got), got) == (int, want), decoder
    for kw in [{"device": "cpu"}, {"dtype": torch.float32}, {"use_kernel": False}]:
        assert _feed_group_of(monkeypatch, gqa, **kw) == 1, kw
    monkeypatch.setenv("LRAGENT_FEED_GROUP", "4")
    assert _feed_group_of(monkeypatch, gqa) == 4


def test_caches_take_the_models_dtype():
    """A bf16 model's engine holds bf16 caches, and counts two bytes per cached value where an fp32 one counts four."""
    fp32 = Engine(model(), "base_shared", capacity=8, eos_token_ids=[])
    half = tiny_multi_lora("tiny-llama", b_std=0.3, overrides={"vocab_size": VOCAB}).to(torch.bfloat16)
    bf16 = Engine(half, "base_shared", capacity=8, eos_token_ids=[])
    assert {t.dtype for t in [*bf16.pool.k, *bf16.pool.v, *bf16.pool.v_lr]} == {torch.bfloat16}
    assert {k: 2 * v for k, v in bf16.per_position.items()} == fp32.per_position


def test_the_decode_state_is_made_on_the_engines_device_with_its_own_dtypes_and_start_values():
    """Every decode-state tensor (made at construction and again when the pool grows) has the dtype and shape the
    steps index with and lives on the engine's device whatever the process's defaults: with the engine's device set
    to ``meta`` and the default dtype float64, a tensor left on the default device (the CPU) or in the default
    dtype shows. On the CPU the start values: idle rows at the scratch slots, top-p 1, the vocabulary's EOS ids set."""
    eng = engine("base_lr_shared", rows=3, prefill_in_decode=4)
    eng.eos_token_ids = {0, 7, VOCAB - 1, VOCAB, -2}  # ids past the vocabulary mark nothing
    long, f32, boolean = torch.long, torch.float32, torch.bool
    want = {
        "d_tok": ((3,), long), "d_pos": ((3,), long), "d_role": ((3,), long), "d_kv_slot": ((3,), long),
        "d_lr_slot": ((3,), long), "d_hid_slot": ((3,), long), "d_active": ((3,), boolean),
        "d_remaining": ((3,), long), "d_count": ((3,), long), "d_temp": ((3,), f32), "d_top_p": ((3,), f32),
        "d_seed": ((3,), long), "d_gen": ((3, CAPACITY), long), "d_forced": ((3, 4), long),
        "d_forced_len": ((3,), long), "d_forced_count": ((3,), long), "d_stop": ((3, VOCAB), boolean),
        "d_logits": ((3, VOCAB), f32), "d_eos": ((VOCAB,), boolean),
    }  # fmt: skip
    for device in ("meta", "cpu"):
        eng.device = torch.device(device)
        with float64():
            eng._alloc_decode_state()
        got = {k: (tuple(v.shape), v.dtype) for k, v in vars(eng).items() if k.startswith("d_")}
        assert got == want, device
        assert {k for k, v in vars(eng).items() if k.startswith("d_") and v.device.type != device} == set(), device
    pool = eng.pool
    slots = (pool.scratch_kv, pool.scratch_lr, pool.scratch_hidden)
    assert [eng.d_kv_slot.tolist(), eng.d_lr_slot.tolist(), eng.d_hid_slot.tolist()] == [[s] * 3 for s in slots]
    assert eng.d_top_p.tolist() == [1.0] * 3 and eng.d_eos.nonzero().flatten().tolist() == [0, 7, VOCAB - 1]
    zero = [eng.d_tok, eng.d_pos, eng.d_role, eng.d_active, eng.d_remaining, eng.d_count, eng.d_temp, eng.d_seed,
            eng.d_gen, eng.d_forced, eng.d_forced_len, eng.d_forced_count, eng.d_stop, eng.d_logits]  # fmt: skip
    assert all(not t.any() for t in zero)


def test_eos_ids_default_to_the_models_generation_config_and_end_the_row_on_the_device():
    """Without ``eos_token_ids`` the engine ends turns on the EOS id (or ids) of the model's generation config (none
    without one); ids past the vocabulary are ignored. The device ends the row on the EOS token: the step's result
    comes at the decode step that sampled it."""
    m = tiny_multi_lora("tiny-llama", b_std=0.3, overrides={"vocab_size": VOCAB})
    free, _ = _free("full_shared")
    g = free.generated_ids
    k = next(k for k in range(2, len(g)) if g[k] not in g[:k])
    for eos in (g[k], [VOCAB + 3, g[k]], None):
        m.model.generation_config.eos_token_id = eos
        eng = Engine(m, "full_shared", capacity=CAPACITY)
        assert eng.eos_token_ids == ({g[k]} if eos is not None else set()) | (
            {VOCAB + 3} if isinstance(eos, list) else set()
        )
    saved, m.model.generation_config = m.model.generation_config, None
    assert Engine(m, "full_shared", capacity=CAPACITY).eos_token_ids == set()
    m.model.generation_config = saved
    eng = Engine(model(), "full_shared", capacity=CAPACITY, eos_token_ids=[g[k], VOCAB])
    eng.append(0, PROMPT)
    assert eng.start(0, sampled(10)) is None
    for _ in range(k):
        assert eng.advance(max_steps=1) == []
    res = eng.advance(max_steps=1)
    assert [r.generated_ids for r in res] == [g[: k + 1]] and res[0].stop_reason == "eos"


def test_an_eos_drawn_after_a_stop_string_before_the_next_sync_leaves_the_eager_result():
    """Between host checks a row ran past the stop string and drew an EOS: the result is eager decoding's (the stop
    ends the turn; the EOS was never drawn there), not an EOS ending."""
    scheme = "full_shared"
    free, _ = _free(scheme)
    stop, eos = free.text[1:3], free.generated_ids[3]  # the stop completes on token 2; token 3 becomes an EOS
    assert eos not in free.generated_ids[:3] and free.text.find(stop) == 1

    def run(sync_every: int | None):
        eng = Engine(model(), scheme, rows=1, capacity=CAPACITY, tokenizer=tok(), eos_token_ids=[eos])
        if sync_every:
            graph_semantics(eng, sync_every)
        eng.append(0, PROMPT)
        res = eng.generate(0, sampled(10, (stop,)))
        return res.generated_ids, res.stop_reason, res.text, res.kept_tokens, list(eng.ids(0))

    eager = run(None)
    assert eager[:2] == (free.generated_ids[:3], "stop")
    for sync_every in (4, 8):
        assert run(sync_every) == eager, sync_every


def test_a_one_character_stop_of_several_bytes_is_caught_where_it_completes():
    """A stop string of one character that UTF-8 spells in three bytes spans three byte tokens, so no token's own
    text holds it: the text check must run, and generation ends on the token that completes it."""
    byte_model = tiny_multi_lora("tiny-llama", b_std=0.3, overrides={"vocab_size": BYTE_VOCAB_SIZE})
    btok = byte_tokenizer()

    def run(stop: tuple[str, ...]):
        eng = Engine(byte_model, "full_shared", rows=1, capacity=CAPACITY, tokenizer=btok, eos_token_ids=[])
        eng.append(0, list(b"hello world"))
        return eng.generate(0, GenerationRequest(role=0, max_new_tokens=40, stop=stop, temperature=1.5, seed=2))

    free = run(())
    # a real character (not U+FFFD, which a lone invalid byte also decodes to: that token's own text holds it)
    wide = next((c for c in free.text if len(c.encode("utf-8")) > 1 and c != "\ufffd"), None)
    assert wide is not None, free.text  # the seeded draw holds a multi-byte character
    ends = next(j for j in range(1, 41) if wide in btok.decode(free.generated_ids[:j], skip_special_tokens=True))
    res = run((wide,))
    assert res.stop_reason == "stop" and res.generated_ids == free.generated_ids[:ends]
    assert res.text == free.text[: free.text.index(wide)]


def test_a_token_that_is_an_eos_and_completes_a_stop_string_ends_the_turn_as_eos():
    """One token both an EOS and the end of a stop string: the turn ends there, reported as "eos" (the device ended
    the row on the EOS), with the same kept tokens and text the stop alone gives."""
    scheme = "full_shared"
    free, _ = _free(scheme)
    stop, eos = free.text[2], free.generated_ids[2]
    assert free.text.find(stop) == 2 and eos not in free.generated_ids[:2]
    eng = Engine(model(), scheme, rows=1, capacity=CAPACITY, tokenizer=tok(), eos_token_ids=[eos])
    eng.append(0, PROMPT)
    res = eng.generate(0, sampled(10, (stop,)))
    assert (res.stop_reason, res.generated_ids, res.kept_tokens, res.text) == (
        "eos",
        free.generated_ids[:3],
        2,
        free.text[:2],
    )
