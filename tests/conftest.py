"""Shared fixtures. GPU tests carry ``@pytest.mark.gpu`` and are skipped without CUDA; tests that load the embedded
SmolLM2 model carry ``@pytest.mark.model`` (they run by default; ``-m "not model"`` leaves them out)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import HealthCheck, settings

# Property tests draw the same examples on every run (derandomize), so CI cannot turn red on a random draw.
# LRAGENT_HYPOTHESIS_PROFILE=explore draws fresh examples for local bug hunting.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile("explore", deadline=None, max_examples=500)
settings.load_profile(os.environ.get("LRAGENT_HYPOTHESIS_PROFILE", "ci"))

# Under pytest-xdist (the default run: ``-n auto`` in pyproject.toml) each worker gets its share of the cores: torch's
# default of one intra-op thread per core in every worker would oversubscribe them.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


# Under mutmut (its fork server imports this file once, then forks a process per mutant) tqdm's bars lock only their
# own process. By default tqdm makes one multiprocessing lock that every later fork shares: a mutant stopped at its
# time limit while holding it (a mutated loop updating a bar) would leave it held, and every later mutant that makes a
# bar would hang until its own limit, counted as a timeout, that is as caught.
if "mutmut" in sys.modules:
    from tqdm import std as _tqdm_std

    _tqdm_std.TqdmDefaultWriteLock.mp_lock = None  # no cross-process lock: the thread lock only
    _tqdm_std.tqdm.set_lock(_tqdm_std.TqdmDefaultWriteLock())


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    if any("model" in item.keywords for item in items):
        from lragent.models import embedded_model_missing

        missing = embedded_model_missing()  # e.g. a GPU machine without the package: set LRAGENT_EMBEDDED_GGUF
        if missing is not None:
            skip = pytest.mark.skip(reason=f"needs the embedded model: {missing}")
            for item in items:
                if "model" in item.keywords:
                    item.add_marker(skip)
    if any("accuracy_model" in item.keywords for item in items):
        from lragent.accuracy_model import missing as accuracy_missing

        missing = accuracy_missing()  # not installed: `bash scripts/install.sh --accuracy-model`
        if missing is not None:
            skip = pytest.mark.skip(reason=f"needs the accuracy model: {missing}")
            for item in items:
                if "accuracy_model" in item.keywords:
                    item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and do not fight other processes for the cores): a module that asks for
    it (``pytestmark = pytest.mark.usefixtures("one_thread")``) runs on one torch thread, restored after it."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def load_embedded():
    """Returns a loader of fresh copies of the embedded SmolLM2-135M-Instruct (fp32, CPU) and its tokenizer.

    The first call converts the GGUF (~20 s, cached under ~/.cache/lragent); later calls read safetensors."""
    from lragent.models import embedded_model_missing, load_model

    missing = embedded_model_missing()
    if missing is not None:
        pytest.skip(f"needs the embedded model: {missing}")

    def load():
        return load_model("default", dtype=torch.float32, device="cpu")

    return load


class SetClock:
    """A clock that reads what the test sets (``now``, advanced by hand): stands in for ``time.time`` or
    ``time.monotonic`` where a test decides when time passes."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def flock_held(path: Path) -> bool:
    """Whether another open file description holds an exclusive ``flock`` on ``path`` (the file must exist)."""
    import fcntl

    with open(path) as other:
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(other, fcntl.LOCK_UN)
        return False


def tiny_multi_lora(
    arch: str = "tiny-llama",
    rank: int = 4,
    shared_a: bool = True,
    b_std: float = 0.3,
    seed: int = 0,
    roles=("plan", "action", "reflect"),
    targets=("q_proj", "v_proj"),
    overrides=None,
):
    """A tiny random model with random (B != 0) adapters, in eval mode."""
    from lragent.lora_model import MultiLoraModel
    from lragent.models import load_model
    from lragent.multi_lora import MultiLoraConfig

    hf, _ = load_model(arch, seed=seed, overrides=overrides)
    model = MultiLoraModel(hf, MultiLoraConfig(roles=roles, rank=rank, dropout=0.0, shared_a=shared_a, targets=targets))
    model.init_adapters("random", seed=seed + 1, b_std=b_std)
    return model.eval()


def drive_rows(eng, rows: int, launch, launches: int) -> list[list]:
    """Runs a batched engine with continuous refill: ``launch(r, k)`` starts row ``r``'s ``k``-th request (it appends
    the row's new tokens and calls ``eng.start``); every row starts once, then each row that finishes is relaunched
    until it has run ``launches`` requests. Returns each row's results (``GenerationResult``) in order."""
    count = [0] * rows
    out: list[list] = [[] for _ in range(rows)]

    def start(r: int) -> None:
        launch(r, count[r])
        count[r] += 1

    for r in range(rows):
        start(r)
    while eng._pending:
        for res in eng.advance():
            out[res.row].append(res)
            if count[res.row] < launches:
                start(res.row)
    return out


def decode_rows(
    model, scheme: str, *, rows: int = 2, capacity: int = 32, prompt_len: int = 7, max_new_tokens: int = 4, **engine_kw
) -> list:
    """Decodes one request per row on a fused batched engine (row r: prompt ``5 + r ..``, role ``1 + r % 2``, logits
    kept) until every row is done; the results sorted by row. ``engine_kw`` goes to ``Engine`` (``fuse_ops`` and
    ``fuse_lora`` default on: the path the decode kernels and switches take)."""
    from lragent.engine import Engine, GenerationRequest

    engine_kw = {"fuse_ops": True, "fuse_lora": True, **engine_kw}
    eng = Engine(model, scheme, rows=rows, capacity=capacity, eos_token_ids=[], **engine_kw)
    for r in range(rows):
        eng.append(r, list(range(5 + r, 5 + r + prompt_len)))
        eng.start(r, GenerationRequest(role=1 + r % 2, max_new_tokens=max_new_tokens, return_logits=True))
    res = []
    while eng._pending:
        res.extend(eng.advance())
    return sorted(res, key=lambda x: x.row)


TWO_LAYERS = {"num_hidden_layers": 2}
"""The tiny model cut to two layers for the checks run under the Triton interpreter, which runs each kernel program in
Python (two layers still pass a layer's output to the next; four took twice the time for nothing more)."""


def decode_under_switch(env: str, device: str, calls: dict[str, int], prepare=None) -> dict[tuple[str, str], dict]:
    """What every row-count switch of the decode step must keep: two rows of different roles (tiny LLaMA, q/v adapters,
    fp16) decode under ``env`` set to 0, 2 and 1, for both shared schemes; at 2 (two-row steps switched on) the
    tokens of 0 and logits within 2e-3, at 1 (steps of one row only: the two-row steps keep the plain path) 0's logits
    exactly. ``prepare(model)`` may change the model first; ``calls`` are the caller's spies' counters.

    Returns:
        how much each counter of ``calls`` grew, per ``(scheme, value)``.
    """
    saved = os.environ.get(env)
    counted: dict[tuple[str, str], dict] = {}
    try:
        for scheme in ("base_lr_shared", "full_shared"):
            outs = {}
            for flag in ("0", "2", "1"):
                os.environ[env] = flag
                before = dict(calls)
                m = tiny_multi_lora("tiny-llama", b_std=0.3, overrides=TWO_LAYERS)
                if prepare is not None:
                    prepare(m)
                m.to(device)
                m.model.half()
                outs[flag] = decode_rows(m, scheme)
                counted[(scheme, flag)] = {k: calls[k] - before[k] for k in calls}
            for a, b, c in zip(outs["0"], outs["2"], outs["1"], strict=True):
                assert a.generated_ids == b.generated_ids == c.generated_ids, (scheme, a.generated_ids, b.generated_ids)
                assert float((a.logits - b.logits).abs().max()) <= 2e-3, scheme
                assert torch.equal(a.logits, c.logits), scheme  # two rows past the cap of 1: the plain path
    finally:
        if saved is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = saved
    return counted


def run_under_interpreter(code: str, timeout: int = 600) -> str:
    """Runs ``code`` in a fresh Python with ``TRITON_INTERPRET=1`` (the flag is read when Triton is imported) from the
    repository root, ``tests/`` importable; fails the test with the end of its stderr unless it exits 0. Returns its
    stdout."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def load_script(name: str) -> ModuleType:
    """The module of ``scripts/<name>.py`` (scripts are not a package), named ``scripts.<name>`` as its path reads
    (the name mutation testing gives its functions) and registered under both names (dataclasses look their module
    up)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"scripts.{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = sys.modules[f"scripts.{name}"] = module
    spec.loader.exec_module(module)
    return module
