"""The engine on CUDA with a random SmolLM2-shaped model (no embedded model needed): kernel launches and graph capture.

- The decomposed path really launches the Triton kernels (counted as launches and as kernels the GPU ran).
- CUDA-graph capture works for every scheme and batch bucket, repeatedly, in one process: buckets captured in
  several orders, graphs dropped and recaptured when a session's cache grows, engines created and released; and
  the same in a fresh process, where the first capture of the process used to allocate cuBLAS's per-stream
  workspace from the graph's private pool (``use_count > 0`` assert at the next capture into that pool).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch
from conftest import drive_rows

from lragent.engine import Engine, GenerationRequest
from lragent.schemes import SCHEMES
from lragent.session import MultiAgentSession

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cuda_random_model(n_layers: int = 4):
    """SmolLM2-135M's shapes (head dim 64, 9 query / 3 KV heads) with ``n_layers`` layers, random weights and
    random adapters (B != 0), bf16 on CUDA."""
    from lragent.lora_model import MultiLoraModel
    from lragent.models import load_model
    from lragent.multi_lora import MultiLoraConfig

    hf, _ = load_model("smollm2-135m", dtype=torch.bfloat16, device="cuda", overrides={"num_hidden_layers": n_layers})
    model = MultiLoraModel(hf, MultiLoraConfig(dropout=0.0))
    model.init_adapters("random", seed=0, b_std=0.05)
    return model.eval()


def _counts(counter) -> dict[str, int]:
    """Both kernel classes, zeros included (``Counter.clear`` drops the zero entries ``watch_launches`` starts with)."""
    return {k: counter[k] for k in ("prefill", "decode")}


@pytest.fixture(scope="module")
def model():
    return cuda_random_model()


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 40000, (n,), generator=g).tolist()


def _agree_until_near_tie(graph: list[int], eager: list[int], eager_logits: torch.Tensor, where) -> None:
    """Graph and eager tokens agree, or part at a bf16 near-tie of the eager logits (then the rest may differ)."""
    for j, (a, b) in enumerate(zip(graph, eager, strict=False)):
        if a != b:
            margin = float(eager_logits[j][b] - eager_logits[j][a])
            assert margin <= 0.05, (*where, f"token {j}: graph {a} vs eager {b}, margin {margin:.3f}")
            return
    assert len(graph) == len(eager), where


# ---- kernel launches --------------------------------------------------------------------------------------------
def test_kernel_is_used_on_cuda(model, monkeypatch):
    """The decomposed path really launches the Triton kernels on CUDA, counted two ways (``kernel_launches``): the
    launches the launchers issue and the kernels the GPU runs (profiler). Session, eager: a chunk prefill launches the
    prefill kernel once per layer, each decode step the decode kernel once per layer. Batched engine, CUDA graphs: the
    captured step holds one decode launch per layer and every replay runs them. With ``use_kernel=False`` none."""
    from kernel_launches import gpu_kernel_counts, watch_launches
    from torch.profiler import ProfilerActivity, profile

    import kernels.flash_lora_attention as fla

    monkeypatch.setattr(fla, "_AUTOTUNE", [False])  # autotuning would run the prefill kernel once per config
    n_layers = model.n_layers
    launches = watch_launches(monkeypatch)
    decode_steps = []
    real_step = Engine._decode_step

    def counting_step(self, *args, **kwargs):
        decode_steps.append(1)
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "_decode_step", counting_step)
    for use_kernel in (True, False):
        s = MultiAgentSession(model, "base_lr_shared", eos_token_ids=[], use_kernel=use_kernel, cuda_graphs=False)
        s.append(_prompt(0, 40))
        s.step("plan", max_new_tokens=2)  # a full prefill (cuDNN over expanded values where cuDNN takes it)
        s.append(_prompt(1, 9))
        launches.clear()
        decode_steps.clear()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            s.step("action", max_new_tokens=3)  # a chunk prefill of the new tokens, then eager decode steps
            torch.cuda.synchronize()
        ran = gpu_kernel_counts(prof)
        k = len(decode_steps)
        want = {"prefill": n_layers, "decode": k * n_layers} if use_kernel else {"prefill": 0, "decode": 0}
        assert k >= 2, k
        assert _counts(launches) == want, ("session launches", use_kernel, _counts(launches), want)
        assert _counts(ran) == want, ("session GPU kernels", use_kernel, _counts(ran), want)

    for scheme in ("base_lr_shared", "full_shared"):  # the decode kernel serves decomposed and plain pools
        eng = Engine(model, scheme, rows=2, capacity=512, eos_token_ids=[], cuda_graphs=True)
        for r in range(2):
            eng.append(r, _prompt(10 + r, 20 + 7 * r))
            eng.start(r, GenerationRequest(role=r, max_new_tokens=40))
        launches.clear()
        eng.advance(max_steps=eng.sync_every)  # warm-up (two eager steps) and capture of the batch-2 graph
        assert len(eng._graphs) == 1, list(eng._graphs)
        captured = eng.capture_s  # the capture's time, inside advance() and outside the replays and read-backs
        assert 0 < captured <= eng.advance_s - eng.sync_s - eng.replay_s, scheme
        assert _counts(launches) == {"prefill": 0, "decode": 3 * n_layers}, (scheme, _counts(launches))
        launches.clear()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng.advance(max_steps=eng.sync_every)  # replays only
            torch.cuda.synchronize()
        ran = gpu_kernel_counts(prof)
        assert _counts(launches) == {"prefill": 0, "decode": 0}, (scheme, _counts(launches))  # nothing launched eagerly
        assert _counts(ran) == {"prefill": 0, "decode": eng.sync_every * n_layers}, (scheme, _counts(ran))
        # timing.json's splits: the replays inside advance(), the wait for the device inside the read-back
        assert 0 < eng.replay_s <= eng.advance_s - eng.sync_s and 0 < eng.wait_s <= eng.sync_s, scheme
        assert eng.capture_s == captured, scheme  # a replay captures nothing


# ---- capture, repeatedly -----------------------------------------------------------------------------------------
def _batched(model, scheme: str, graphs: bool, order: list[int]) -> list[list[tuple[list[int], object]]]:
    """One engine of 8 rows; for each bucket size in ``order``, that many rows generate together (greedy)."""
    eng = Engine(model, scheme, rows=8, capacity=256, eos_token_ids=[], cuda_graphs=graphs)
    out = []
    for rnd, b in enumerate(order):
        for r in range(b):
            eng.reset(r)
            eng.append(r, _prompt(100 * rnd + r, 5 + 3 * r + rnd))
            req = GenerationRequest(role=r % 3, max_new_tokens=6 + r, return_logits=not graphs)
            assert eng.start(r, req) is None
        got = {}
        while eng._pending:
            for res in eng.advance():
                got[res.row] = (res.generated_ids, res.logits)
        out.append([got[r] for r in range(b)])
    return out


def _growing_session(model, scheme: str, graphs: bool) -> list[tuple[list[int], object]]:
    """A session whose cache grows 64 -> 128 -> 256 -> 512 between steps: each growth drops the captured graphs."""
    s = MultiAgentSession(model, scheme, eos_token_ids=[], capacity=64, cuda_graphs=graphs)
    out = []
    for i in range(7):
        s.append(_prompt(500 + i, 50))
        res = s.step(i % 3, max_new_tokens=5, return_logits=not graphs)
        n_gen = len(res.generated_ids)
        out.append((res.generated_ids, None if graphs else res.logits[-n_gen:]))
    return out


def capture_workout(model) -> dict[str, int]:
    """Per scheme a growing session (first: in a fresh process its first capture is the process's first, the state of
    the issue's crash), then every batch bucket of an 8-row engine captured in two orders, twice each; graph tokens
    checked against eager decoding. Returns per scheme the batched graphs captured (raises on a mismatch)."""
    captured = {}
    for scheme in SCHEMES:
        graph_s = _growing_session(model, scheme, True)
        eager_s = _growing_session(model, scheme, False)
        for i, ((g, _), (e, e_logits)) in enumerate(zip(graph_s, eager_s, strict=True)):
            _agree_until_near_tie(g, e, e_logits, (scheme, "growing session", i))
        n = 0
        for order in ([1, 2, 4, 8, 1, 8], [8, 4, 2, 1]):
            eager = _batched(model, scheme, False, order)
            for _ in range(2):
                graph = _batched(model, scheme, True, order)
                for rnd, (g_rows, e_rows) in enumerate(zip(graph, eager, strict=True)):
                    for r, ((g, _), (e, e_logits)) in enumerate(zip(g_rows, e_rows, strict=True)):
                        # the eager logits are the positions the step ran over: the generated tokens' are the last
                        _agree_until_near_tie(g, e, e_logits[-len(e) :], (scheme, order, rnd, r))
                n += len(set(order))
                gc.collect()
        captured[scheme] = n
    return captured


def test_capture_every_scheme_and_bucket_repeatedly(model):
    captured = capture_workout(model)
    assert all(n >= 8 for n in captured.values()), captured


_FRESH = """
import sys, torch
sys.path[:0] = [{root!r}, {tests!r}]
from test_engine_gpu import capture_workout, cuda_random_model
print(capture_workout(cuda_random_model()))
"""


def test_capture_in_a_fresh_process():
    """The same workout as the first CUDA work of a process (the state the session command and the issue's crash
    start from: no cuBLAS workspace exists yet for the capture stream)."""
    script = _FRESH.format(root=ROOT, tests=os.path.join(ROOT, "tests"))
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])


# ---- prompt tokens fed through the captured decode step -------------------------------------------------------------
@pytest.mark.parametrize("budget", [0, 16])
@pytest.mark.parametrize("scheme", ["non_shared", "base_lr_shared", "full_shared", "droidspeak"])
def test_prefill_in_decode_in_graphs_equals_eager_prefill(scheme, budget):
    """Batched eval's GPU default: a step's new tokens fed through the captured decode graph (``prefill_in_decode``,
    one per row per step or with ``budget`` extra token rows: ``feed_budget``) give the same tokens as prefilling each
    row eagerly, for
    eight rows joining and leaving with different roles and prompt lengths (some above the fed limit), and leave the
    same caches (a last eager step with logits agrees).
    fp32 (4 layers, SmolLM2 shapes), so that the two orders of summation cannot part at a bf16 near-tie."""
    from lragent.lora_model import MultiLoraModel
    from lragent.models import load_model
    from lragent.multi_lora import MultiLoraConfig

    hf, _ = load_model("smollm2-135m", dtype=torch.float32, device="cuda", overrides={"num_hidden_layers": 4})
    model = MultiLoraModel(hf, MultiLoraConfig(dropout=0.0))
    model.init_adapters("random", seed=0, b_std=0.05)
    model.eval()
    rows = 8

    def run(fed: int) -> tuple[list, list]:
        eng = Engine(model, scheme, rows=rows, capacity=512, eos_token_ids=[], cuda_graphs=True, prefill_in_decode=fed,
                     feed_budget=budget if fed else 0)  # fmt: skip

        def launch(r: int, k: int) -> None:
            n = 6 + 9 * ((r + k) % 4)  # 6..33 new tokens: above the limit of 24 now and then
            eng.append(r, _prompt(1000 * r + k, n))
            eng.start(r, GenerationRequest(role=(r + k) % 3, max_new_tokens=4 + r % 3, temperature=0.9 * (r % 2),
                                           seed=r))  # fmt: skip

        out = [[res.generated_ids for res in row] for row in drive_rows(eng, rows, launch, 4)]
        last = []
        for r in range(rows):
            eng.append(r, [11, 12])
            eng.start(r, GenerationRequest(role=(r + 1) % 3, max_new_tokens=1, return_logits=True))
            while eng._pending:
                last.extend(res.logits for res in eng.advance())
        torch.cuda.synchronize()
        return out, last

    eager_out, eager_last = run(0)
    fed_out, fed_last = run(24)
    assert fed_out == eager_out, scheme
    for a, b in zip(eager_last, fed_last, strict=True):
        assert (a - b).abs().max() <= 1e-3, (scheme, float((a - b).abs().max()))


@pytest.mark.parametrize("group, widths", [(1, 1), (8, 1), (1, 3)])
@pytest.mark.parametrize("scheme", ["non_shared", "base_lr_shared", "full_shared"])
def test_extra_fed_rows_through_the_kernels_match_one_token_feeding(scheme, group, widths):
    """bf16 with the fused kernels and CUDA graphs (the eval's GPU path): feeding through 24 extra token rows per step
    (too few for all eight rows at once: lent in turn) leaves the caches that feeding one token per row per step
    leaves, for eight rows with fed lengths 5 … 40 and different roles. Checked by a last eager step of every row
    (logits asked) on top of each engine's caches, and by the greedy tokens, which may part only at a bf16 near-tie.
    Fed K/V stored at wrong positions or slots, attended past their token (not causal), or a row's logits taken from
    another token, would move the logits by far more. ``group`` 8: the extra rows lent in whole groups of 8, which
    the decode kernel runs as token groups (``feed_group``); ``widths`` 3: rounds of 6, 12 or 24 extra rows, each
    width its own captured graph (``feed_widths``)."""
    from lragent.lora_model import MultiLoraModel
    from lragent.models import load_model
    from lragent.multi_lora import MultiLoraConfig

    hf, _ = load_model("smollm2-135m", dtype=torch.bfloat16, device="cuda", overrides={"num_hidden_layers": 4})
    model = MultiLoraModel(hf, MultiLoraConfig(dropout=0.0))
    model.init_adapters("random", seed=0, b_std=0.05)
    model.eval()
    rows = 8

    def run(budget: int) -> tuple[list, list, list]:
        eng = Engine(model, scheme, rows=rows, capacity=512, eos_token_ids=[], cuda_graphs=True, prefill_in_decode=64,
                     feed_budget=budget, feed_group=group, feed_widths=widths)  # fmt: skip
        assert eng.fuse_ops  # the fused kernels' path

        def launch(r: int, k: int) -> None:
            eng.append(r, _prompt(500 * r + k, 5 + 5 * ((r + 3 * k) % 8)))
            eng.start(r, GenerationRequest(role=(r + k) % 3, max_new_tokens=3, seed=r))

        out = [[res.generated_ids for res in row] for row in drive_rows(eng, rows, launch, 3)]
        last, ends = [], []
        for r in range(rows):
            eng.append(r, [11, 12])
            eng.start(r, GenerationRequest(role=(r + 1) % 3, max_new_tokens=1, return_logits=True))
            while eng._pending:
                last.extend(res.logits for res in eng.advance())
            ends.append(len(eng.ids(r)))
        torch.cuda.synchronize()
        return out, last, ends

    one_out, one_last, one_ends = run(0)
    lent_out, lent_last, lent_ends = run(24)
    assert lent_ends == one_ends
    for a, b in zip(one_last, lent_last, strict=True):
        scale = float(a.abs().max())
        assert float((a - b).abs().max()) <= 0.05 * scale, (scheme, float((a - b).abs().max()), scale)
    same = sum(x == y for ro, rc in zip(one_out, lent_out, strict=True) for x, y in zip(ro, rc, strict=True))
    assert same >= 0.8 * rows * 3, (scheme, same)  # greedy tokens: equal but for bf16 near-ties


# ---- the fused LoRA path (shared A in the fused GEMMs, B through the role mask) ---------------------------------
def _fused_lora_rows(model, scheme: str, fuse_lora: bool, rows: int = 8) -> list[list[list[int]]]:
    """Every row's generated ids, rows joining and leaving with different roles, decoded by CUDA-graph replay."""
    eng = Engine(model, scheme, rows=rows, capacity=512, eos_token_ids=[], cuda_graphs=True, fuse_ops=fuse_lora,
                 fuse_lora=fuse_lora, droidspeak_layers=[1, 2])  # fmt: skip

    def launch(r: int, k: int) -> None:
        eng.append(r, _prompt(77 * r + k, 5 + 7 * ((r + k) % 3)))
        eng.start(r, GenerationRequest(role=(r + k) % 3, max_new_tokens=5 + r % 4))

    return [[res.generated_ids for res in row] for row in drive_rows(eng, rows, launch, 3)]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fused_lora_graphs_equal_plain_path_fp32(scheme):
    """fp32 (no bf16 near-ties), 4 layers of SmolLM2 shapes, eight rows of mixed roles: graph-replayed decoding with
    the fused LoRA path gives the tokens of the plain module-by-module path."""
    from lragent.lora_model import MultiLoraModel
    from lragent.models import load_model
    from lragent.multi_lora import MultiLoraConfig

    hf, _ = load_model("smollm2-135m", dtype=torch.float32, device="cuda", overrides={"num_hidden_layers": 4})
    model = MultiLoraModel(hf, MultiLoraConfig(dropout=0.0)).eval()
    model.init_adapters("random", seed=0, b_std=0.05)
    plain = _fused_lora_rows(model, scheme, fuse_lora=False)
    fused = _fused_lora_rows(model, scheme, fuse_lora=True)
    assert fused == plain


def test_fused_lora_graph_launches_fewer_kernels(model):
    """bf16 decode step (one row, base_lr_shared, q/v adapters): with the fused LoRA path a replayed graph runs no
    LoRA kernel of its own (X·A of q and v come out of the QKV GEMM, q's B is added inside the RoPE-and-store kernel,
    v's inside the attention kernel), where the previous path runs four per layer (two X·A GEMMs, the gather of q's
    B, its multiply-add): at least three per layer fewer, and fewer index kernels."""
    from torch.profiler import ProfilerActivity, profile

    counts = {}
    steps = 8  # one replay burst (sync_every)
    for on in (False, True):
        eng = Engine(model, "base_lr_shared", rows=1, capacity=256, eos_token_ids=[], cuda_graphs=True, fuse_lora=on)
        assert eng.fuse_ops and eng.fuse_lora == on
        eng.append(0, _prompt(5, 20))
        eng.start(0, GenerationRequest(role=1, max_new_tokens=200))
        eng.advance(max_steps=16)  # captured
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng.advance(max_steps=steps)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        counts[on] = (len(names), sum("index" in n for n in names))
        del eng
    n_layers = model.decoder.n_layers
    assert counts[True][0] <= counts[False][0] - 3 * n_layers * steps, counts
    assert counts[True][1] < counts[False][1], counts


def _lane_tokens(model, schemes: tuple[str, ...], together: bool, rows: int = 24, steps: int = 48) -> dict:
    """Each scheme's engine decodes ``rows`` sampled rows (prompt ``3 + r ..``, roles in turn, seeds by row) for
    ``steps`` tokens, on its own CUDA stream; ``together``: launched in turn and collected in turn as ``eval
    --concurrent_schemes``'s lanes do, so that the engines' graphs run at once on the device; else one engine after
    the other. Returns each scheme's generated tokens per row."""
    engines, streams = {}, {}
    for scheme in schemes:
        streams[scheme] = torch.cuda.Stream()
        streams[scheme].wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(streams[scheme]):
            eng = Engine(model, scheme, rows=rows, capacity=256, eos_token_ids=[], fuse_ops=True, fuse_lora=True)
            for r in range(rows):
                eng.append(r, list(range(3 + r, 3 + r + 9 + r % 5)))
                eng.start(r, GenerationRequest(role=r % 3, max_new_tokens=steps, temperature=0.9, top_p=0.9, seed=r))
        engines[scheme] = eng
    out = {s: {} for s in schemes}
    order = [schemes] if together else [(s,) for s in schemes]
    for group in order:
        launched = dict.fromkeys(group, False)
        while any(engines[s]._pending or launched[s] for s in group):
            for s in group:
                with torch.cuda.stream(streams[s]):
                    if launched[s]:
                        for res in engines[s].collect():
                            out[s][res.row] = list(res.generated_ids)
                    launched[s] = bool(engines[s]._pending) and engines[s].launch() > 0
    torch.cuda.synchronize()
    return out


def test_lanes_on_their_own_streams_decode_what_each_engine_decodes_alone(model, monkeypatch):
    """Three engines whose graphs replay at the same time on three streams (``eval --concurrent_schemes``) give the
    tokens each gives alone, and each engine captured its graphs on its own lane's stream: a graph keeps the
    cuBLAS workspace of the stream it was captured on, so lanes captured on one shared stream would run GEMMs on one
    workspace at once."""
    import lragent.engine as engine_mod

    seen = []
    real = engine_mod.capture_stream
    monkeypatch.setattr(engine_mod, "capture_stream", lambda device: seen.append(real(device)) or seen[-1])
    schemes = ("non_shared", "base_lr_shared", "full_shared")
    alone = _lane_tokens(model, schemes, together=False)
    seen.clear()
    together = _lane_tokens(model, schemes, together=True)
    assert together == alone
    assert all(len(v) == 24 and all(len(t) == 48 for t in v.values()) for v in together.values())
    default = torch.cuda.default_stream()
    assert seen and all(s != default for s in seen) and len(set(seen)) == len(schemes)


def test_a_row_joins_and_leaves_the_decode_batch_without_waiting_for_the_steps_in_flight(model):
    """Starting a fed row and releasing a finished one only queue work on the stream: no host-device synchronisation
    (``torch.cuda.set_sync_debug_mode("error")`` raises on any), so the host can admit the next request while the
    device runs the steps already queued (a value written as ``t[row] = x`` is copied from pageable memory, which
    synchronises). The row that joined mid-flight then decodes what it decodes alone."""

    def engine() -> Engine:
        return Engine(model, "base_lr_shared", rows=4, capacity=256, eos_token_ids=[], cuda_graphs=True,
                      prefill_in_decode=64)  # fmt: skip

    req = GenerationRequest(role=1, max_new_tokens=32, temperature=0.0, seed=1)
    alone = engine()
    alone.append(2, _prompt(2, 24))
    assert alone.start(2, req) is None
    want = []
    while not want:
        want = alone.advance()
    eng = engine()
    for row in range(3):
        eng.append(row, _prompt(row, 24))
    for row in (0, 1):
        assert eng.start(row, req) is None
    eng.launch()  # captures the step's graph (synchronising: before the check)
    eng.collect()
    eng.launch()
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert eng.start(2, req) is None  # a fed row: its prompt goes through the decode steps
        eng._release(1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    got = [r for r in eng.collect() if r.row == 2]
    while not got:
        got = [r for r in eng.advance() if r.row == 2]
    assert got[0].generated_ids == want[0].generated_ids
