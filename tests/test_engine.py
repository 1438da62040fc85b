"""The engine against an independent reference of the five schemes, batched against alone, sampling and stops.

``scheme_reference.ReferenceSession`` re-implements DESIGN.md §2 position by position with literal value expansion
and no code of the engine's own; random multi-role schedules with truncations must give the same greedy tokens
and the same logits (fp32, ≤ 1e-4). This is what catches a catch-up run as the wrong role, DroidSpeak recomputing
a layer too many or too few, catch-up RoPE positions restarting at 0, ``seen`` not clipped by a truncation, and the
low-rank term applied with another role's B.
"""

from __future__ import annotations

import pytest
import torch
from conftest import drive_rows, tiny_multi_lora
from hypothesis import given, settings
from hypothesis import strategies as st
from scheme_reference import ReferenceSession

from datamodules.tiny_tokenizer import BYTE_VOCAB_SIZE, byte_tokenizer
from lragent.engine import CapacityError, Engine, GenerationRequest, StopTokenIndex
from lragent.schemes import SCHEMES
from lragent.session import MultiAgentSession

ROLES = ("plan", "action", "reflect")
_MODELS: dict = {}


def model_for(arch: str = "tiny-llama", shared_a: bool = True, vocab: int | None = None):
    key = (arch, shared_a, vocab)
    if key not in _MODELS:
        overrides = {"vocab_size": vocab} if vocab else None
        _MODELS[key] = tiny_multi_lora(arch, shared_a=shared_a, b_std=0.3, overrides=overrides)
    return _MODELS[key]


# a schedule step: (role, appended ids, max new tokens, truncate-to fraction or None)
steps = st.tuples(
    st.integers(0, 2),
    st.lists(st.integers(3, 250), min_size=1, max_size=7),
    st.integers(0, 3),
    st.one_of(st.none(), st.floats(0.2, 0.95)),
)


def _near_tie(logits: torch.Tensor) -> bool:
    top2 = logits.topk(2).values
    return float(top2[0] - top2[1]) < 1e-4


def compare_with_reference(model, scheme: str, schedule, droidspeak_layers=(1, 2)) -> None:
    ref = ReferenceSession(model, scheme, droidspeak_layers=list(droidspeak_layers))
    ses = MultiAgentSession(model, scheme, eos_token_ids=[], droidspeak_layers=list(droidspeak_layers), capacity=64)
    for role, ids, n, cut in schedule:
        if cut is not None and ref.ids:
            keep = max(1, int(len(ref.ids) * cut))
            ref.truncate(keep)
            ses.truncate(keep)
        ref.append(ids)
        ses.append(ids)
        gen, ref_logits, ref_pos = ref.step(role, n)
        res = ses.step(role, max_new_tokens=n, return_logits=True)
        assert res.logit_positions == ref_pos, (scheme, res.logit_positions, ref_pos)
        for i, (a, b) in enumerate(zip(gen, res.generated_ids, strict=True)):
            if a != b:  # only a true near-tie may flip a greedy token; then the trajectories part
                assert _near_tie(ref_logits[len(ref_logits) - len(gen) + i]), (scheme, gen, res.generated_ids)
                return
        got = res.logits
        want = torch.stack(ref_logits)
        assert (got - want).abs().max() <= 1e-4, (scheme, float((got - want).abs().max()))
        assert ses.ids == ref.ids
        assert {k: v for k, v in ses.seen.items()} == ref.seen, (scheme, ses.seen, ref.seen)


@pytest.mark.parametrize("scheme", SCHEMES)
@settings(max_examples=6, deadline=None)
@given(schedule=st.lists(steps, min_size=2, max_size=5))
def test_engine_matches_independent_reference(scheme, schedule):
    compare_with_reference(model_for("tiny-llama"), scheme, schedule)


@pytest.mark.parametrize("scheme", ["droidspeak", "base_shared", "base_lr_shared"])
def test_engine_matches_reference_fixed_schedule_qwen2(scheme):
    """A fixed multi-role schedule with catch-ups after truncation, on the architecture with q/k/v biases."""
    schedule = [
        (0, list(range(10, 30)), 2, None),
        (1, [40, 41, 42], 2, None),
        (2, [50, 51], 1, 0.6),
        (1, [60, 61, 62, 63], 3, None),
        (0, [70], 0, None),
    ]
    compare_with_reference(model_for("tiny-qwen2"), scheme, schedule, droidspeak_layers=(0, 2, 3))


def test_reference_is_sensitive_to_the_role():
    """Guard against a vacuous comparison: the reference itself distinguishes roles and schemes."""
    model = model_for("tiny-llama")
    out = {}
    for scheme in ("non_shared", "full_shared", "base_lr_shared"):
        ref = ReferenceSession(model, scheme)
        ref.append(list(range(3, 20)))
        ref.step(0, 0)
        ref.append([5, 6])
        out[scheme] = ref.step(1, 0)[1][-1]
    assert (out["non_shared"] - out["full_shared"]).abs().max() > 1e-3
    assert (out["full_shared"] - out["base_lr_shared"]).abs().max() > 1e-3


# ---- batched trajectories -----------------------------------------------------------------------------------------
def _row_schedule(seed: int) -> list[tuple[int, list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(3):
        role = int(torch.randint(0, 3, (1,), generator=g))
        ids = torch.randint(3, 250, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        out.append((role, ids, int(torch.randint(1, 6, (1,), generator=g))))
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_forward_of_an_engine_uses_its_own_split_workspaces(monkeypatch, scheme):
    """Prefill, catch-up (LR prefill, DroidSpeak's recompute) and decode all run inside the engine's
    ``workspace_owner``: two engines on two CUDA streams (``eval --concurrent_schemes``) never launch split kernels
    over one workspace. Probed through the decoder's entry points, which every forward of the engine goes through."""
    from kernels.split_workspace import split_workspace, workspace_owner

    model = model_for("tiny-llama")
    eng = Engine(model, scheme, rows=2, capacity=64, eos_token_ids=[], droidspeak_layers=[1, 2])
    cpu = torch.device("cpu")
    seen: list = []
    for name in ("run_view", "logits"):
        original = getattr(eng.dec, name)

        def probe(*args, _original=original, **kwargs):
            seen.append(split_workspace(("engine-probe",), 1, 1, cpu)[0])
            return _original(*args, **kwargs)

        monkeypatch.setattr(eng.dec, name, probe)
    for role, ids, n in ((0, [5, 6, 7], 3), (1, [8, 9], 2), (2, [10], 2), (0, [11, 12], 1)):
        eng.append(0, ids)
        eng.generate(0, GenerationRequest(role=role, max_new_tokens=n))
    with workspace_owner(eng):
        own = split_workspace(("engine-probe",), 1, 1, cpu)[0]
    assert len(seen) >= 8 and all(t is own for t in seen)
    assert split_workspace(("engine-probe",), 1, 1, cpu)[0] is not own


@pytest.mark.parametrize("scheme", SCHEMES)
def test_batch_of_eight_equals_each_alone(scheme):
    """Eight trajectories with different roles and lengths, advancing together (rows join and leave as their
    requests start and end), give each row exactly what it gives alone: same tokens, logits within 1e-4."""
    model = model_for("tiny-llama")
    rows = 8
    schedules = [_row_schedule(100 + r) for r in range(rows)]
    alone, alone_ids = [], []
    for sched in schedules:
        s = MultiAgentSession(model, scheme, eos_token_ids=[], droidspeak_layers=[1, 2], capacity=64)
        res = []
        for role, ids, n in sched:
            s.append(ids)
            res.append(s.step(role, max_new_tokens=n, return_logits=True))
        alone.append(res)
        alone_ids.append(list(s.ids))
    eng = Engine(model, scheme, rows=rows, capacity=64, eos_token_ids=[], droidspeak_layers=[1, 2])

    def launch(r: int, k: int) -> None:
        role, ids, n = schedules[r][k]
        eng.append(r, ids)
        eng.start(r, GenerationRequest(role=role, max_new_tokens=n, return_logits=True))

    batched = drive_rows(eng, rows, launch, 3)
    for r in range(rows):
        for a, b in zip(alone[r], batched[r], strict=True):
            assert a.generated_ids == b.generated_ids, (scheme, r)
            assert a.logit_positions == b.logit_positions
            assert (a.logits - b.logits).abs().max() <= 1e-4
        assert eng.ids(r) == alone_ids[r]


def test_sampling_reproducible_and_batch_independent():
    model = model_for("tiny-llama")
    req = GenerationRequest(role=1, max_new_tokens=12, temperature=0.9, top_p=0.75, seed=1234)
    outs = []
    for _ in range(2):
        s = MultiAgentSession(model, "full_shared", eos_token_ids=[])
        s.append(list(range(5, 25)))
        outs.append(s.step("action", max_new_tokens=12, temperature=0.9, top_p=0.75, seed=1234).generated_ids)
    assert outs[0] == outs[1]
    s = MultiAgentSession(model, "full_shared", eos_token_ids=[])
    s.append(list(range(5, 25)))
    other = s.step("action", max_new_tokens=12, temperature=0.9, top_p=0.75, seed=99).generated_ids
    assert other != outs[0]
    # the same request on row 3 of a busy batch draws the same tokens
    eng = Engine(model, "full_shared", rows=4, capacity=64, eos_token_ids=[])
    for r in range(4):
        eng.append(r, list(range(5, 25)) if r == 3 else list(range(30 + r, 40 + r)))
        eng.start(r, req if r == 3 else GenerationRequest(role=0, max_new_tokens=5 + r, temperature=1.0, seed=r))
    got = {}
    while eng._pending:
        for res in eng.advance():
            got[res.row] = res.generated_ids
    assert got[3] == outs[0]
    # the engine's own clock (timing.json): advance() time, reading results back a part of it
    assert eng.decode_steps > 0 and 0 < eng.sync_s <= eng.advance_s
    assert 0 < eng.wait_s <= eng.sync_s and eng.replay_s == 0 == eng.capture_s  # eager on the CPU: no graph
    spent = eng.advance_s
    assert eng.advance() == [] and eng.advance_s == spent  # nothing pending: no time counted


def test_top_p_restricts_to_nucleus():
    from lragent.sampling import sample_next

    logits = torch.tensor([[4.0, 3.9, 0.0, -1.0, -2.0]]).repeat(200, 1)
    seeds = torch.arange(200)
    toks = sample_next(logits, torch.full((200,), 1.0), torch.full((200,), 0.8), seeds, torch.zeros(200).long())
    assert set(toks.tolist()) <= {0, 1} and len(set(toks.tolist())) == 2
    greedy = sample_next(logits, torch.zeros(200), torch.ones(200), seeds, torch.zeros(200).long())
    assert set(greedy.tolist()) == {0}


# ---- stops ---------------------------------------------------------------------------------------------------------
def test_stop_strings_on_ids_and_on_text():
    """Single-character stops end on the token id; a stop that spans tokens is found on the text at the next sync,
    and what came after it is dropped, as if generation had stopped there."""
    tok = byte_tokenizer()
    model = model_for("tiny-llama", vocab=BYTE_VOCAB_SIZE)
    index = StopTokenIndex(tok, BYTE_VOCAB_SIZE)
    assert index.mask(["\n"]).nonzero().flatten().tolist() == [10]
    # find what greedy decoding produces, then use a piece of it as a two-token stop string
    s = MultiAgentSession(model, "full_shared", tokenizer=tok, eos_token_ids=[])
    s.append(list(b"hello world"))
    free = s.step("plan", max_new_tokens=10).generated_ids
    text = tok.decode(free)
    assert len(text) >= 6
    stop = text[3:5]
    for graphs_sync in (1, 4):
        s = MultiAgentSession(model, "full_shared", tokenizer=tok, eos_token_ids=[])
        s.engine.sync_every = graphs_sync
        s.append(list(b"hello world"))
        res = s.step("plan", max_new_tokens=10, stop=[stop])
        first = text.find(stop)
        assert res.text == text[:first]
        assert res.stop_reason == "stop"
        assert res.generated_ids == free[: first + len(stop)]
        assert s.ids == list(b"hello world") + free[:first]
    # a token-id stop: the first generated byte as a one-character stop string
    s = MultiAgentSession(model, "full_shared", tokenizer=tok, eos_token_ids=[])
    s.append(list(b"hello world"))
    ch = text[2]
    res = s.step("plan", max_new_tokens=10, stop=[ch])
    assert res.text == text[: text.find(ch)] and res.stop_reason == "stop"


def test_eos_ends_the_turn_and_is_not_kept():
    model = model_for("tiny-llama")
    s = MultiAgentSession(model, "full_shared", eos_token_ids=[])
    s.append(list(range(3, 15)))
    free = s.step("plan", max_new_tokens=6).generated_ids
    i = next(i for i in range(1, 6) if free[i] not in free[:i])  # the first fresh token after the first
    s = MultiAgentSession(model, "full_shared", eos_token_ids=[free[i]])
    s.append(list(range(3, 15)))
    res = s.step("plan", max_new_tokens=6)
    assert res.stop_reason == "eos" and res.generated_ids == free[: i + 1] and res.kept_tokens == i
    assert s.ids == list(range(3, 15)) + free[:i]


# ---- capacity -----------------------------------------------------------------------------------------------------
def test_capacity_batched_refuses_session_grows():
    model = model_for("tiny-llama")
    eng = Engine(model, "base_lr_shared", rows=2, capacity=32, eos_token_ids=[])
    eng.append(0, list(range(3, 30)))
    with pytest.raises(CapacityError, match="needs 38 positions but the cache capacity is 32"):
        eng.start(0, GenerationRequest(role=0, max_new_tokens=10))
    s = MultiAgentSession(model, "base_lr_shared", eos_token_ids=[], capacity=16)
    s.append(list(range(3, 30)))
    before = s.step("plan", max_new_tokens=8).generated_ids
    assert s.engine.pool.capacity >= 36
    s2 = MultiAgentSession(model, "base_lr_shared", eos_token_ids=[], capacity=256)
    s2.append(list(range(3, 30)))
    assert s2.step("plan", max_new_tokens=8).generated_ids == before


def test_bad_requests_are_one_line_errors():
    model = model_for("tiny-llama")
    eng = Engine(model, "full_shared", rows=2, capacity=32, eos_token_ids=[])
    eng.append(0, [5, 6])
    for req, msg in [
        (GenerationRequest(role=5), "role id 5 out of range: allowed 0..2"),
        (GenerationRequest(role=0, max_new_tokens=-1), "max_new_tokens must be >= 0"),
        (GenerationRequest(role=0, temperature=float("nan")), "temperature must be a finite number"),
        (GenerationRequest(role=0, temperature=float("inf")), "temperature must be a finite number"),
        (GenerationRequest(role=0, top_p=0.0), r"top_p must be in \(0, 1\]"),
        (GenerationRequest(role=0, stop=("x",)), "stop strings need a tokenizer"),
    ]:
        with pytest.raises(ValueError, match=msg):
            eng.start(0, req)
    with pytest.raises(ValueError, match="row 7 out of range"):
        eng.append(7, [1])
    with pytest.raises(ValueError, match="the trajectory is empty"):
        eng.start(1, GenerationRequest(role=0))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fused_path_equals_plain_path(scheme):
    """The fused path (one GEMM for q/k/v and for gate/up, fused norm / RoPE-and-store / SiLU, here with their
    PyTorch fallbacks) computes what the module-by-module path computes."""
    from lragent.fused_weights import fuse_base_weights

    plain_model = tiny_multi_lora("tiny-qwen2", b_std=0.3, targets=("q_proj", "v_proj", "up_proj"))
    fused_model = tiny_multi_lora("tiny-qwen2", b_std=0.3, targets=("q_proj", "v_proj", "up_proj"))
    x = torch.randn(2, 5, 64)
    before = fused_model.model.model.layers[0].self_attn.k_proj(x)
    assert fuse_base_weights(fused_model.model) == 4
    attn = fused_model.model.model.layers[0].self_attn
    assert attn.k_proj.weight.data_ptr() == attn.__dict__["_lragent_qkv"][0].data_ptr() + 64 * 64 * 4
    assert torch.equal(attn.k_proj(x), before)  # the module itself still computes the same
    out = {}
    for name, model, fuse in (("plain", plain_model, False), ("fused", fused_model, True)):
        eng = Engine(model, scheme, rows=2, capacity=64, eos_token_ids=[], droidspeak_layers=[1, 2], fuse_ops=fuse)
        res = []
        for r, sched in enumerate((_row_schedule(7), _row_schedule(8))):
            for role, ids, n in sched:
                eng.append(r, ids)
                res.append(eng.generate(r, GenerationRequest(role=role, max_new_tokens=n, return_logits=True)))
        out[name] = res
    for a, b in zip(out["plain"], out["fused"], strict=True):
        assert a.generated_ids == b.generated_ids
        assert (a.logits - b.logits).abs().max() <= 1e-4


# ---- graph-replay semantics on the CPU ------------------------------------------------------------------------------
class _EagerReplay:
    """Stands in for a captured CUDA graph: replays the step exactly as captured (``max_len=None``: attention over the
    whole capacity, per-row lengths mask it), ``sync_every`` times between host checks, as the CUDA path does."""

    def __init__(self, engine: Engine, b: int, sampling: bool, extra: int = 0) -> None:
        self.engine, self.b, self.sampling, self.extra = engine, b, sampling, extra

    def replay(self) -> None:
        self.engine._decode_step(self.b, self.sampling, None, self.extra)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_graph_replay_semantics_equal_eager(scheme):
    """The decode path the CUDA graph captures (several steps per host check, finished rows still stepping, batch
    buckets, no host bound on the length) gives the same tokens as eager decoding, for eight rows with different roles
    and lengths joining and leaving: the CPU half of the GPU graph-vs-eager test (which adds capture itself)."""
    model = model_for("tiny-llama")
    rows = 8
    schedules = [_row_schedule(200 + r) for r in range(rows)]

    def run(graph_semantics: bool) -> list[list[list[int]]]:
        eng = Engine(model, scheme, rows=rows, capacity=64, eos_token_ids=[], droidspeak_layers=[1, 2])
        if graph_semantics:
            eng.cuda_graphs = True
            eng._graph_for = lambda b, sampling, extra=0: _EagerReplay(eng, b, sampling, extra)
        nxt, out = [0] * rows, [[] for _ in range(rows)]

        def launch(r: int) -> None:
            role, ids, n = schedules[r][nxt[r]]
            nxt[r] += 1
            eng.append(r, ids)
            eng.start(r, GenerationRequest(role=role, max_new_tokens=n))

        for r in range(rows):
            launch(r)
        while any(nxt[r] < 3 for r in range(rows)) or eng._pending:
            for res in eng.advance():
                out[res.row].append(res.generated_ids)
                if nxt[res.row] < 3:
                    launch(res.row)
        return out

    graph, eager = run(True), run(False)
    assert graph == eager
    assert sum(len(x) for row in graph for x in row) > 3 * rows  # the rows really generated


# ---- prompt tokens fed through the decode step ----------------------------------------------------------------------
def _fed_steps(eng: Engine, lengths: tuple[int, ...], max_new_tokens: int) -> list[tuple[int, list[int]]]:
    """Row r feeds ``lengths[r]`` tokens, then generates; returns each decode step's extra rows with the rows' fed
    counts after it (``d_forced_count``)."""
    steps: list[tuple[int, list[int]]] = []
    step = eng._decode_step

    def spy(b, sampling, max_len, extra=0):
        step(b, sampling, max_len, extra)
        steps.append((extra, eng.d_forced_count[: len(lengths)].tolist()))

    eng._decode_step = spy
    for row, n in enumerate(lengths):
        eng.append(row, list(range(20, 20 + n)))
        eng.start(row, GenerationRequest(role=row, max_new_tokens=max_new_tokens, seed=3))
    while eng._pending:
        eng.advance()
    return steps


@pytest.mark.parametrize("graph_semantics", [False, True])
def test_extra_rows_are_lent_in_row_order_until_the_budget_is_spent(graph_semantics):
    """``feed_budget`` 5, rows feeding 10 and 6 tokens: step 1 lends all 5 extra rows to row 0 (it feeds 6, row 1
    its own 1); step 2 row 0 takes the 3 it needs, row 1 the 2 left (feeds 3); step 3 row 1 feeds its last 2. Then
    the steps run without extra rows: the host's count of what is left must follow the device's lending exactly, or
    it would stop the extra rows early (slow) or keep them after the feeding (wasted compute)."""
    model = model_for("tiny-llama")
    eng = Engine(model, "base_lr_shared", rows=2, capacity=64, eos_token_ids=[], prefill_in_decode=16, feed_budget=5,
                 feed_widths=1)  # fmt: skip
    if graph_semantics:
        eng.cuda_graphs = True
        eng._graph_for = lambda b, sampling, extra=0: _EagerReplay(eng, b, sampling, extra)
    steps = _fed_steps(eng, (10, 6), max_new_tokens=4)
    assert steps[:3] == [(5, [6, 1]), (5, [10, 4]), (5, [10, 6])]
    assert {extra for extra, _ in steps[3:]} == {0} and len(steps) >= 3 + 4


def test_lent_ranges_start_at_whole_groups_of_feed_group_rows():
    """``feed_budget`` 8 in groups of ``feed_group`` 4, rows feeding 6 and 22 tokens: step 1 lends row 0 the 5 it
    needs in extra rows 0-4 (5-7 padding: its range is two whole groups), so row 1's range starts at 8, past the
    budget (it feeds its own 1); steps 2-4 lend row 1 8, 8 and its last 2 (9, 9, 3 tokens with its own). Without
    groups row 1 takes rows 5-7 in step 1 and is done in step 3. The host's count follows the device's (a host that
    counted ranges without their padding would stop the extra rows one step early), and the steps after run
    without extra rows."""
    model = model_for("tiny-llama")
    for group, counts in ((4, [[6, 1], [6, 10], [6, 19], [6, 22]]), (1, [[6, 4], [6, 13], [6, 22]])):
        eng = Engine(model, "base_lr_shared", rows=2, capacity=64, eos_token_ids=[], prefill_in_decode=32,
                     feed_budget=8, feed_group=group, feed_widths=1)  # fmt: skip
        steps = _fed_steps(eng, (6, 22), max_new_tokens=3)
        assert steps[: len(counts)] == [(8, c) for c in counts], group
        assert {extra for extra, _ in steps[len(counts) :]} == {0}, group


@pytest.mark.parametrize("group", [1, 4, 5])
def test_a_bad_or_oversized_feed_group_is_refused_and_the_default_follows_the_kernel(monkeypatch, group):
    from lragent.engine import _feed_group

    monkeypatch.delenv("LRAGENT_FEED_GROUP", raising=False)
    assert (_feed_group(None, False, 6), _feed_group(None, True, 6)) == (1, 1)  # groups only when asked
    monkeypatch.setenv("LRAGENT_FEED_GROUP", str(group))
    assert _feed_group(None, True, 6) == group and _feed_group(None, False, 6) == 1 and _feed_group(3, False, 6) == 3
    assert _feed_group(None, True, 32) == min(group, 4)  # lowered to the kernel's 128 query heads a group
    assert _feed_group(None, True, 200) == 1 and _feed_group(21, True, 6) == 21  # at least 1; the bound itself fits
    monkeypatch.setenv("LRAGENT_FEED_GROUP", "128")
    assert _feed_group(None, True, 1) == 128 and _feed_group(None, True, 2) == 64
    assert repr(_feed_group(None, True, 6)) == "21"  # whole token rows: 128 // 6
    for bad in ("0", "x", "-2"):
        monkeypatch.setenv("LRAGENT_FEED_GROUP", bad)
        with pytest.raises(ValueError, match=rf"LRAGENT_FEED_GROUP='{bad}': expected an int >= 1"):
            _feed_group(None, True, 6)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match=rf"feed_group must be an int >= 1 \(1: no groups\), got {bad!r}"):
            _feed_group(bad, True, 6)
    with pytest.raises(ValueError, match="feed_group=22 x 6 query heads a KV head is past 128; at most 21$"):
        _feed_group(22, True, 6)
    with pytest.raises(ValueError, match="feed_group=2 x 200 query heads a KV head is past 128; at most 1"):
        _feed_group(2, True, 200)


def test_feed_step_widths_are_the_budget_and_its_halvings_in_whole_groups(monkeypatch):
    from lragent.engine import feed_step_widths

    monkeypatch.delenv("LRAGENT_FEED_WIDTHS", raising=False)
    assert feed_step_widths(2048, 1) == (256, 512, 1024, 2048) and feed_step_widths(0, 1, 4) == ()  # default: 4
    assert feed_step_widths(2048, 1, 4) == (256, 512, 1024, 2048)
    assert feed_step_widths(20, 8, 3) == (8, 16, 20)  # 5 and 10 rounded up to whole groups; the budget stays
    assert feed_step_widths(6, 4, 5) == (4, 6)
    monkeypatch.setenv("LRAGENT_FEED_WIDTHS", "3")
    assert feed_step_widths(64, 1) == (16, 32, 64) and feed_step_widths(64, 1, 2) == (32, 64)
    monkeypatch.setenv("LRAGENT_FEED_WIDTHS", "1")
    assert feed_step_widths(64, 1) == (64,) and feed_step_widths(64, 8, 1) == (64,)
    for bad in ("0", "two"):
        monkeypatch.setenv("LRAGENT_FEED_WIDTHS", bad)
        with pytest.raises(ValueError, match=rf"LRAGENT_FEED_WIDTHS='{bad}': expected an int >= 1"):
            feed_step_widths(64, 1)
    for bad in (0, False, 1.0):
        with pytest.raises(ValueError, match=rf"feed_widths must be an int >= 1 .*got {bad!r}"):
            feed_step_widths(64, 1, bad)


def test_a_bad_feed_variable_is_refused_naming_the_variable_its_value_and_what_it_sets(monkeypatch):
    """The error for a bad ``LRAGENT_FEED_GROUP`` / ``LRAGENT_FEED_WIDTHS`` is one line: the variable, its value (blanks
    stripped) and what the number means."""
    from lragent.engine import _feed_group, feed_step_widths

    monkeypatch.setenv("LRAGENT_FEED_GROUP", " 0 ")
    want = r"^LRAGENT_FEED_GROUP='0': expected an int >= 1 \(token rows a group of fed tokens\)$"
    with pytest.raises(ValueError, match=want):
        _feed_group(None, True, 6)
    monkeypatch.setenv("LRAGENT_FEED_WIDTHS", "two")
    want = r"^LRAGENT_FEED_WIDTHS='two': expected an int >= 1 \(widths a feeding step may take\)$"
    with pytest.raises(ValueError, match=want):
        feed_step_widths(64, 1)


def test_the_feed_budget_defaults_to_none_and_is_dropped_without_prefill_in_decode(monkeypatch):
    """No extra rows unless asked (``feed_budget`` 0 by default, even with ``prefill_in_decode``), and none without
    ``prefill_in_decode`` whatever ``feed_budget`` says (nothing is fed then): no widths, no extra rows a step."""
    monkeypatch.delenv("LRAGENT_FEED_WIDTHS", raising=False)
    model = model_for("tiny-llama")
    for kw, want in [
        ({"prefill_in_decode": 3}, (3, 0, ())),
        ({"feed_budget": 5}, (0, 0, ())),
        ({"prefill_in_decode": 3, "feed_budget": 5}, (3, 5, (1, 2, 5))),  # the budget and its halvings (default 4)
    ]:
        eng = Engine(model, "full_shared", rows=2, capacity=16, eos_token_ids=[], **kw)
        assert (eng.prefill_in_decode, eng.feed_budget, eng.feed_widths) == want, kw
        eng.append(0, [5, 6])
        eng.start(0, GenerationRequest(role=0, max_new_tokens=2))
        # the fed row's two tokens: one beyond its own, which the narrowest width holds (one extra row) when asked
        assert eng._extra() == (1 if want[1] else 0), kw


def test_a_feeding_round_takes_the_narrowest_width_that_holds_what_is_left():
    """``feed_budget`` 8 in widths 4 and 8 (``feed_widths`` 2), rows feeding 10 and 6 tokens: 9 + 5 tokens beyond
    their own are left, more than 8, so step 1 runs 8 extra rows (all lent to row 0); then 0 + 4 are left: step 2
    runs 4 (row 1's); then nothing is left beyond the rows' own tokens and the steps run without extra rows. With
    one width every feeding step runs 8. The host's count follows the device's with the widths changing. The engine
    counts the extra rows computed and the fed tokens they carried: 12 tokens (8 + 4) in 12 rows with the widths, in
    16 rows (8 + 8, 4 of them padding) with one width."""
    model = model_for("tiny-llama")
    for widths, want, rows in ((2, [(8, [9, 1]), (4, [10, 6])], 12), (1, [(8, [9, 1]), (8, [10, 6])], 16)):
        eng = Engine(model, "base_lr_shared", rows=2, capacity=64, eos_token_ids=[], prefill_in_decode=16,
                     feed_budget=8, feed_widths=widths)  # fmt: skip
        steps = _fed_steps(eng, (10, 6), max_new_tokens=3)
        assert steps[:2] == want, widths
        assert {extra for extra, _ in steps[2:]} == {0}, widths
        assert (eng.feed_rows, eng.feed_tokens) == (rows, 12), widths


@pytest.mark.parametrize("graph_semantics", [False, True])
def test_the_hosts_count_of_what_is_left_to_feed_is_the_devices_after_every_round(graph_semantics):
    """Budgets, groups and widths against rows feeding from 1 token to more than the budget (one feeds exactly its
    own token and the budget, one starts past the budget): after every round of steps the host's ``forced_left`` of
    each generating row is what the device has left (``d_forced_len - d_forced_count``); a round's width is the
    narrowest that holds the rows' ranges in whole groups (the budget with one width, 0 when no row has more than its
    own token left); no step runs extra rows once nothing is left to feed; and under graph semantics a feeding round
    ends with the feeding, a plain round runs ``sync_every`` steps."""
    model = model_for("tiny-llama")
    cases = [(5, 1, 1, (6,)), (5, 1, 1, (7, 1, 4)), (8, 4, 1, (6, 22)), (8, 2, 3, (3, 9, 2, 12)), (6, 3, 2, (10, 2, 5)),
             (4, 1, 2, (2, 2, 3)), (4, 1, 2, (2, 1)), (8, 2, 3, (2, 2)), (2, 1, 2, (1, 1))]  # fmt: skip
    for budget, group, widths, lens in cases:
        where = (budget, group, widths, lens)
        rows = len(lens)
        eng = Engine(model, "base_lr_shared", rows=rows, capacity=64, eos_token_ids=[], prefill_in_decode=32,
                     feed_budget=budget, feed_group=group, feed_widths=widths, sync_every=4)  # fmt: skip
        if graph_semantics:
            eng.cuda_graphs = True
            eng._graph_for = lambda b, sampling, extra=0, eng=eng: _EagerReplay(eng, b, sampling, extra)
        rounds: list[list[tuple[int, list[int]]]] = []
        afters: list[list[int]] = []  # what the rows had left after each round
        step, launch = eng._decode_step, eng._launch

        def left(eng=eng, rows=rows) -> list[int]:
            return (eng.d_forced_len[:rows] - eng.d_forced_count[:rows]).clamp(min=0).tolist()

        def spy(b, sampling, max_len, extra=0, step=step, left=left, rounds=rounds):
            rounds[-1].append((extra, left()))  # what the rows had left before the step
            step(b, sampling, max_len, extra)

        def counted(max_steps, eng=eng, launch=launch, left=left, rounds=rounds, afters=afters, where=where):
            rounds.append([])
            n = launch(max_steps)
            assert n == len(rounds[-1]), where
            after = left()
            afters.append(after)
            assert {r: p.forced_left for r, p in eng._pending.items()} == {r: after[r] for r in eng._pending}, where
            return n

        eng._decode_step, eng._launch = spy, counted
        for row, n in enumerate(lens):
            eng.append(row, list(range(20 + row, 20 + row + n)))
            eng.start(row, GenerationRequest(role=row % 3, max_new_tokens=3, seed=row))
        while eng._pending:
            eng.advance()
        for k, steps in enumerate(rounds):
            extra, before = steps[0]
            need = sum(-(-(n - 1) // group) * group for n in before if n)  # the rows' ranges in whole groups
            if not any(before) or (widths > 1 and need == 0):
                want = 0
            else:
                want = budget if widths == 1 else min((w for w in eng.feed_widths if w >= need), default=budget)
            assert extra == want and {e for e, _ in steps} == {extra}, (where, k, rounds)
            if extra:
                assert all(any(b) for _, b in steps), (where, k, rounds)  # no step with extra rows and nothing to feed
            if graph_semantics:  # a plain round runs sync_every steps, a feeding one until the feeding ends
                assert len(steps) == 4 or (extra and not any(afters[k])), (where, k, rounds)
        # extra rows ran exactly when some row had more to feed than its own token
        assert any(e for steps in rounds for e, _ in steps) == (max(lens) > 1), where
        # the counts: every step's width, and every fed token that did not go through its row's own slot (one a step
        # while the row had tokens left)
        assert eng.feed_rows == sum(e for steps in rounds for e, _ in steps), where
        own = sum(1 for steps in rounds for _, before in steps for n in before if n)
        assert eng.feed_tokens == sum(lens) - own, where


def test_a_batch_invariant_engine_runs_every_step_at_all_rows_and_the_whole_budget():
    """``batch_invariant``: every step runs all ``rows`` rows (not the bucket of the busy ones) and, with
    ``feed_budget``, all its extra rows, feeding or not (one width; ``feed_widths`` is not used), in rounds of
    ``sync_every`` steps; the tokens are those of the bucketed engine."""
    model = model_for("tiny-llama")
    got = {}
    for invariant in (False, True):
        eng = Engine(model, "full_shared", rows=4, capacity=64, eos_token_ids=[], prefill_in_decode=16, feed_budget=4,
                     feed_widths=2, sync_every=4, batch_invariant=invariant)  # fmt: skip
        eng.cuda_graphs = True
        eng._graph_for = lambda b, sampling, extra=0, eng=eng: _EagerReplay(eng, b, sampling, extra)
        steps: list[tuple[int, int]] = []
        step = eng._decode_step

        def spy(b, sampling, max_len, extra=0, step=step, steps=steps):
            steps.append((b, extra))
            step(b, sampling, max_len, extra)

        eng._decode_step = spy
        for row, n in ((0, 7), (1, 2)):
            eng.append(row, list(range(30 + row, 30 + row + n)))
            eng.start(row, GenerationRequest(role=row, max_new_tokens=5, seed=row))
        out = {}
        while eng._pending:
            out.update((res.row, res.generated_ids) for res in eng.advance())
        got[invariant] = out
        if invariant:
            assert eng.batch_invariant is True and len(steps) % 4 == 0 and set(steps) == {(4, 4)}
        else:
            assert {b for b, _ in steps} == {2} and (2, 0) in steps and steps[0] == (2, 4)
    assert got[True] == got[False] and sorted(got[True]) == [0, 1]


@pytest.mark.parametrize("n", [4, 5])
def test_a_row_feeding_exactly_prefill_in_decode_tokens_feeds_the_last_one_where_it_belongs(n):
    """``prefill_in_decode`` as large as the row's prompt and ``feed_budget`` 2: a row feeding 4 tokens takes 3 in
    step 1 and its last (the forced buffer's last column) in its own token row in step 2; one feeding 5 takes 3, then
    2 with its last in an extra row. Either way its tokens and the caches it leaves (the logits of a next step asked
    eagerly) are those of an eager prefill: a last token read from the column before would be fed twice and the real
    one never. With one feeding width the second step still runs the extra rows (the feeding step's own read of the
    forced buffer); with several it runs none (the plain decode step's)."""
    model = model_for("tiny-llama")
    for widths in (1, 4):
        got = []
        for fed in (0, n):
            eng = Engine(model, "full_shared", rows=1, capacity=32, eos_token_ids=[], prefill_in_decode=fed,
                         feed_budget=2, feed_widths=widths)  # fmt: skip
            eng.append(0, [40, 41, 42, 43, 44][:n])
            first = eng.generate(0, GenerationRequest(role=1, max_new_tokens=3))
            eng.append(0, [9])
            last = eng.generate(0, GenerationRequest(role=1, max_new_tokens=1, return_logits=True))
            got.append((first.generated_ids, first.prefill_s == 0.0, last.logits))
        (eager_ids, eager_fed, eager_logits), (fed_ids, fed_fed, fed_logits) = got
        assert fed_ids == eager_ids and (eager_fed, fed_fed) == (False, True), widths
        assert (fed_logits - eager_logits).abs().max() <= 1e-5, widths


# ---- the same, against an eager prefill ----------------------------------------------------------------------
@pytest.mark.parametrize("budget", [0, 3, 64, (64, 4, 1), (24, 2, 3)])
@pytest.mark.parametrize("graph_semantics", [False, True])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_prefill_in_decode_equals_eager_prefill(scheme, graph_semantics, budget):
    """Feeding a step's new tokens through the batched decode step (teacher-forced, ``prefill_in_decode``; one per
    row per step, or with ``budget`` extra token rows lent to the feeding rows: ``feed_budget``, 3 too few for the
    eight rows' needs, 64 enough) gives the same sampled tokens as prefilling the row eagerly, for eight rows with
    different roles, lengths and seeds, and leaves the same caches: a last step of every row through the eager path
    (logits asked) gives the same logits. Some fed tokens are end-of-sequence ids. A forced token written to the
    wrong slot or position, sampled from, counted as generated or checked for a stop, an extra row lent to the wrong
    row, or a row's logits taken from another than its last token, would change one of them. ``(64, 4, 1)``: ranges
    in whole groups of 4 extra rows (``feed_group``), with padding rows between them; ``(24, 2, 3)``: steps of 6, 12
    or 24 extra rows in groups of 2 (``feed_widths``), as the rows' needs change."""
    model = model_for("tiny-llama")
    budget, group, widths = budget if isinstance(budget, tuple) else (budget, 1, 1)
    rows = 8
    schedules = [_row_schedule(300 + r) for r in range(rows)]
    # end-of-sequence ids that the fed tokens contain: a forced token must never end a turn
    eos = sorted({ids[0] for sched in schedules for _, ids, _ in sched})[:6]

    def run(fed: int) -> tuple[list, list, int]:
        # budget 3 runs the fused path (the kernels' PyTorch fallbacks here): stores of many token rows in one slot
        eng = Engine(model, scheme, rows=rows, capacity=64, eos_token_ids=eos, droidspeak_layers=[1, 2],
                     prefill_in_decode=fed, feed_budget=budget, fuse_ops=budget == 3, feed_group=group,
                     feed_widths=widths)  # fmt: skip
        if graph_semantics:
            eng.cuda_graphs = True
            eng._graph_for = lambda b, sampling, extra=0: _EagerReplay(eng, b, sampling, extra)
        n_fed = 0
        start_fed = eng._start_fed

        def counting(*args):
            nonlocal n_fed
            n_fed += 1
            return start_fed(*args)

        eng._start_fed = counting
        nxt, out = [0] * rows, [[] for _ in range(rows)]

        def launch(r: int) -> None:
            role, ids, n = schedules[r][nxt[r]]
            nxt[r] += 1
            eng.append(r, ids)
            temp = 0.9 if r % 2 else 0.0
            eng.start(r, GenerationRequest(role=role, max_new_tokens=n, temperature=temp, seed=7 * r + nxt[r]))

        for r in range(rows):
            launch(r)
        while any(nxt[r] < 3 for r in range(rows)) or eng._pending:
            for res in eng.advance():
                out[res.row].append(res.generated_ids)
                if nxt[res.row] < 3:
                    launch(res.row)
        last = []
        for r in range(rows):
            eng.append(r, [9, 10])
            eng.start(r, GenerationRequest(role=(r + 1) % 3, max_new_tokens=1, return_logits=True))
            while eng._pending:
                for res in eng.advance():
                    last.append(res.logits)
        return out, last, n_fed

    eager_out, eager_last, none_fed = run(0)
    fed_out, fed_last, n_fed = run(16)
    assert none_fed == 0 and n_fed >= rows  # the fed path really ran
    assert fed_out == eager_out
    for a, b in zip(eager_last, fed_last, strict=True):
        assert (a - b).abs().max() <= 1e-4, scheme


@pytest.mark.parametrize("budget", [-1, True, 1.5])
def test_a_bad_feed_budget_is_refused_naming_it(budget):
    with pytest.raises(ValueError, match=rf"feed_budget must be an int >= 0 .*got {budget!r}"):
        Engine(model_for("tiny-llama"), "full_shared", rows=1, capacity=32, eos_token_ids=[], feed_budget=budget)


def test_a_decomposed_scheme_needs_a_lora_on_v_proj():
    model = tiny_multi_lora("tiny-llama", targets=("q_proj",))
    with pytest.raises(ValueError, match="scheme base_lr_shared stores V_lr = X·A of v_proj: targets must include"):
        Engine(model, "base_lr_shared", rows=1, capacity=32, eos_token_ids=[])
    Engine(model, "full_shared", rows=1, capacity=32, eos_token_ids=[])  # no V_lr: no v_proj needed


def test_a_generating_row_refuses_append_start_generate_and_score():
    eng = Engine(model_for("tiny-llama"), "full_shared", rows=2, capacity=32, eos_token_ids=[])
    with pytest.raises(ValueError, match="the trajectory is empty: append tokens before scoring"):
        eng.score(0, 0, [[1]])
    eng.append(0, [5, 6, 7])
    with pytest.raises(ValueError, match="an option must have at least one token"):
        eng.score(0, 0, [[8], []])
    assert eng.ids(0) == [5, 6, 7]  # the scored option was cut off again
    eng.start(0, GenerationRequest(role=0, max_new_tokens=3))
    with pytest.raises(ValueError, match="row 0 is generating: append after its result"):
        eng.append(0, [8])
    with pytest.raises(ValueError, match="row 0 is already generating"):
        eng.start(0, GenerationRequest(role=1, max_new_tokens=1))
    with pytest.raises(ValueError, match=r"rows \[0\] are generating: use start\(\)/advance\(\) to batch"):
        eng.generate(1, GenerationRequest(role=0, max_new_tokens=1))
    with pytest.raises(ValueError, match="row 0 is generating$"):
        eng.score(0, 0, [[8]])
    assert eng.ids(0) == [5, 6, 7]


def test_a_session_without_tokenizer_refuses_text_and_stop_strings():
    session = MultiAgentSession(model_for("tiny-llama"), "full_shared", eos_token_ids=[], capacity=64)
    with pytest.raises(ValueError, match="append_text needs a tokenizer: pass tokenizer= to the session"):
        session.append_text("hello")
    session.append([5, 6])
    with pytest.raises(ValueError, match="stop strings need a tokenizer: pass tokenizer= to the session"):
        session.step("plan", max_new_tokens=2, stop=["x"])
    assert session.ids == [5, 6] and not session.steps
