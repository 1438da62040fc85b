"""Several processes on one device: a memory share per process (--memory_fraction), out of memory during an eval
shrinks the batch and goes on from the episode log, and out of memory that cannot be shrunk away, in any command,
is one line with exit status 2 (finished episodes kept). A faked small card: no GPU needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import cli
from lragent import device_share, memory_plan
from lragent.memory_plan import GIB, choose_batch, model_shape, plan_memory


def test_the_share_caps_what_auto_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """80 GiB free of a 100 GiB card, 2 GiB already held here: a 0.15 share leaves 13 GiB; auto sizes to that."""
    monkeypatch.setattr(memory_plan, "free_memory", lambda device: 80 * GIB)
    monkeypatch.setattr(device_share, "total_memory", lambda device: 100 * GIB)
    monkeypatch.setattr(device_share, "held_memory", lambda device: 2 * GIB)
    assert device_share.memory_budget(80 * GIB, "cpu", 0.15) == 13 * GIB
    assert device_share.memory_budget(10 * GIB, "cpu", 0.15) == 10 * GIB  # what is free bounds the share too
    assert device_share.memory_budget(80 * GIB, "cpu", None) == 80 * GIB
    args = dict(dtype="bfloat16", device="cpu")
    shape = model_shape("default")
    fits = lambda b, loaded=False: (
        plan_memory(shape, "full_shared", b, 8192, element_size=2).total
        - (  # noqa: E731
            plan_memory(shape, "full_shared", b, 8192, element_size=2).model_bytes if loaded else 0
        )
    )
    b = choose_batch("default", ["full_shared"], "auto", 8192, memory_fraction=0.15, **args)
    assert fits(b) <= 13 * GIB < fits(b + 1)
    loaded = choose_batch("default", ["full_shared"], "auto", 8192, memory_fraction=0.15, model_loaded=True, **args)
    assert fits(loaded, True) <= 13 * GIB < fits(loaded + 1, True) and loaded >= b
    with pytest.raises(ValueError, match=r"--memory_fraction 0.15\)") as err:
        choose_batch("default", ["full_shared"], 4 * b, 8192, memory_fraction=0.15, **args)
    assert "\n" not in str(err.value)
    for bad in (0, 1.5, -0.1, True, "half"):
        with pytest.raises(ValueError, match="memory_fraction"):
            device_share.check_memory_fraction(bad)


def test_eval_refuses_a_bad_share_before_anything(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["eval", "--adapter_init", "zero", "--limit", "1", "--device", "cpu", "--memory_fraction", "1.5"]
    assert cli.main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--memory_fraction 1.5" in err[0] and not (tmp_path / "o").exists()


def test_out_of_memory_in_any_command_is_one_line(capsys: pytest.CaptureFixture) -> None:
    from lragent.command import run_command

    def command(size: int = 1) -> int:
        """A command that runs out of memory.

        Args:
            size: unused.
        """
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total ...")

    assert run_command(command, [], "cli.py oom") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: out of memory") and "allocating 20.00 GiB" in err[0]

    def other(size: int = 1) -> int:
        """A command with another runtime error.

        Args:
            size: unused.
        """
        raise RuntimeError("something else")

    with pytest.raises(RuntimeError, match="something else"):  # not swallowed: only out-of-memory is one line
        run_command(other, [], "cli.py other")


# ------------------------------------------------------------------------------ eval: shrink and go on, or one line
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lragent.models import embedded_model_missing

    if embedded_model_missing():
        pytest.skip(f"needs the embedded tokenizer: {embedded_model_missing()}")
    from tests.test_eval_runner import _tiny_model_with_embedded_tokenizer

    return _tiny_model_with_embedded_tokenizer(tmp_path_factory.mktemp("tiny") / "model")


def _argv(tiny: Path, out: Path, batch: int) -> list[str]:
    return ["eval", "--benchmark", "hotpotqa", "--scheme", "non_shared", "--limit", "3", "--runs", "2",
            "--max_steps", "1", "--thought_tokens", "4", "--argument_tokens", "3", "--model", str(tiny),
            "--adapter_init", "random", "--device", "cpu", "--batch", str(batch), "--capacity", "4096",
            "--quiet", "true", "--out", str(out)]  # fmt: skip


def _episodes(out: Path) -> list[tuple]:
    rows = [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines() if x.strip()]
    return sorted((r["qid"], r["run"], r["seed"], r["actions"], r["prediction"], r["num_tokens"]) for r in rows)


def _flaky(monkeypatch: pytest.MonkeyPatch, above: int, after: int) -> list[int]:
    """Makes the batched executor run out of memory after ``after`` finished episodes at a batch above ``above``;
    returns the batches it was built with."""
    import eval_suite.evaluate.batched_executor as be

    built: list[int] = []
    real_init, real_run = be.BatchedExecutor.__init__, be.BatchedExecutor._run_lanes

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        built.append(self.batch)

    def run_lanes(self, schemes, groups):
        for n, item in enumerate(real_run(self, schemes, groups), start=1):
            yield item
            if self.batch > above and n == after:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.25 GiB. GPU 0 has 1 GiB free")

    monkeypatch.setattr(be.BatchedExecutor, "__init__", init)
    monkeypatch.setattr(be.BatchedExecutor, "_run_lanes", run_lanes)
    return built


@pytest.mark.model
def test_eval_out_of_memory_halves_the_batch_and_keeps_every_episode(
    tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import eval_suite.evaluate.batched_executor as be

    engines: list[int] = []
    real_engine = be.BatchedExecutor._engine

    def counted(self, scheme, rows):
        engines.append(rows)
        return real_engine(self, scheme, rows)

    with monkeypatch.context() as m:
        m.setattr(be.BatchedExecutor, "_engine", counted)
        assert cli.main(_argv(tiny, tmp_path / "ref", 2)) == 0  # the reference: batch 2 from the start
    assert engines == [2]  # the caches allocated under the allocation lock are the ones the run uses
    capsys.readouterr()
    built = _flaky(monkeypatch, above=2, after=2)  # a card too small for 6 rows (and for 3)
    assert cli.main(_argv(tiny, tmp_path / "oom", 6)) == 0
    assert built == [6, 3, 1]  # 6 runs two episodes, 3 two more, then 1 the last two
    err = capsys.readouterr().err
    assert "out of memory on cpu allocating 3.25 GiB; try a smaller --capacity" in err
    assert "going on at --batch 3" in err and "going on at --batch 1" in err
    assert _episodes(tmp_path / "oom") == _episodes(tmp_path / "ref")  # the same six episodes, none lost or doubled
    summary = json.loads((tmp_path / "oom" / "summary.json").read_text())
    assert summary["episodes"]["non_shared"] == {"0": 3, "1": 3}


@pytest.mark.model
def test_eval_out_of_memory_at_batch_one_stops_in_one_line_keeping_finished_episodes(
    tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    _flaky(monkeypatch, above=0, after=1)  # even one row runs out after one episode
    assert cli.main(_argv(tiny, tmp_path / "o", 2)) == 2
    err = [x for x in capsys.readouterr().err.strip().splitlines() if x.startswith("error")]
    assert len(err) == 1 and "out of memory" in err[0] and "finished episodes are kept" in err[0]
    assert len(_episodes(tmp_path / "o")) == 2  # one at batch 2, one at batch 1: both kept
    assert cli.main(_argv(tiny, tmp_path / "o", 2)) == 2  # a rerun resumes: two more, then the same line
    assert len(_episodes(tmp_path / "o")) == 4


def test_bench_trace_refuses_a_context_that_does_not_fit_before_loading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A faked small card: the largest context fits under full_shared but not non_shared (three caches); one line
    naming the scheme, the need, what is free and the contexts that fit, exit 2, and no model loaded."""
    import lragent.models
    from eval_suite.bench.trace import final_length

    shape = model_shape("tiny-llama")
    need = {s: plan_memory(shape, s, 1, final_length(4096) + 64, element_size=4).total
            for s in ("full_shared", "non_shared")}  # fmt: skip
    assert need["full_shared"] < need["non_shared"]
    monkeypatch.setattr(memory_plan, "free_memory", lambda device: (need["full_shared"] + need["non_shared"]) // 2)

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(lragent.models, "load_model", no_load)
    argv = ["bench", "trace", "--model", "tiny-llama", "--device", "cpu", "--dtype", "float32", "--contexts",
            "[256,4096]", "--schemes", "[full_shared,non_shared]", "--out", str(tmp_path / "t")]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "L_ctx 4096" in err[0] and "under non_shared" in err[0], err
    assert "allowed --contexts up to 256, --schemes without non_shared" in err[0]


def test_bench_trace_notes_a_context_past_the_models_positions(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """tiny-llama holds 4096 positions and the trace appends four contexts after 932 tokens of its own: L_ctx 791
    ends at 4096 (no note), 792 past it. The trace still runs (speed needs no meaningful output) and says so once on
    the console, in the report and in the JSON's provenance, naming the largest context that fits."""
    import json

    from eval_suite.bench.trace import final_length, positions_note

    assert final_length(791) == 4096 < final_length(792)
    assert positions_note("tiny-llama", [256, 791]) is None
    argv = ["bench", "trace", "--model", "tiny-llama", "--device", "cpu", "--dtype", "float32", "--contexts",
            "[792]", "--schemes", "[full_shared]", "--out", str(tmp_path / "t")]  # fmt: skip
    assert cli.main(argv) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "L_ctx 792: the trace ends at 4100 tokens" in notes[0], notes
    assert "max_position_embeddings 4096" in notes[0] and "L_ctx <= 791 stays within" in notes[0]
    assert notes[0][len("note: ") :] in (tmp_path / "t" / "bench_trace.md").read_text()
    assert json.loads((tmp_path / "t" / "bench_trace.json").read_text())["provenance"]["note"] == notes[0][6:]


def test_the_allocation_lock_is_a_file_per_card_held_while_sizing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """On a (faked) GPU the lock file, named by the card's UUID, is made in ``$LRAGENT_LOCK_DIR`` (created if
    missing) and held exclusively inside the block, released after it; off CUDA no file is made."""
    from types import SimpleNamespace

    from conftest import flock_held

    lock_dir = tmp_path / "locks" / "deep"
    monkeypatch.setenv("LRAGENT_LOCK_DIR", str(lock_dir))
    with device_share.allocation_lock("cuda:0"):  # no CUDA here: a no-op
        assert not lock_dir.exists()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=f"GPU-ab/{i}"))
    lock = lock_dir / "lragent-gpu-GPU-ab_1.lock"

    with device_share.allocation_lock("cuda:1"):
        assert lock.is_file() and flock_held(lock)
    assert not flock_held(lock)
    assert [p.name for p in lock_dir.iterdir()] == [lock.name]


# ------------------------------------------------------------------------- the share's pieces on two faked cards
@pytest.fixture
def two_cards(monkeypatch: pytest.MonkeyPatch) -> dict:
    """CUDA faked with two cards (the current one is card 1): each answers for its own index only, so a call that
    asks the wrong card fails. Returns the calls to ``set_per_process_memory_fraction``."""
    from types import SimpleNamespace

    cards = {
        0: dict(total=40 * GIB, free=30 * GIB, held=1 * GIB),
        1: dict(total=80 * GIB, free=3 * GIB // 2, held=3 * GIB // 4),
    }
    calls: dict = {"fraction": []}

    def set_fraction(fraction, device=None) -> None:
        calls["fraction"].append((fraction, device))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=cards[i]["total"]))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: cards[i]["held"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (cards[i]["free"], cards[i]["total"]))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    return calls


def test_a_share_of_exactly_the_whole_device_is_allowed_and_a_bad_one_is_named_with_its_option() -> None:
    for whole in (1, 1.0):
        device_share.check_memory_fraction(whole)
    device_share.check_memory_fraction(None)
    with pytest.raises(ValueError, match=r"^--share 1\.01: allowed a share of the device's memory in \(0, 1\]"):
        device_share.check_memory_fraction(1.01, option="--share")


def test_apply_memory_fraction_caps_the_named_card_or_the_current_one(two_cards: dict) -> None:
    device_share.apply_memory_fraction("cuda:0", 1)
    device_share.apply_memory_fraction("cuda", 0.25)  # no index: the current card
    assert two_cards["fraction"] == [(1.0, 0), (0.25, 1)]
    assert all(type(f) is float for f, _ in two_cards["fraction"])


def test_apply_memory_fraction_caps_nothing_without_a_share_or_off_cuda(two_cards: dict) -> None:
    device_share.apply_memory_fraction("cuda:0", None)
    device_share.apply_memory_fraction("cpu", 0.5)  # CUDA is there, but the process runs on the CPU
    assert two_cards["fraction"] == []


def test_apply_memory_fraction_on_a_machine_without_cuda_caps_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda *a, **k: pytest.fail("capped"))
    device_share.apply_memory_fraction("cuda:0", 0.5)


def test_apply_memory_fraction_and_memory_budget_refuse_a_bad_share_naming_it() -> None:
    with pytest.raises(ValueError, match=r"--memory_fraction 1\.5:"):
        device_share.apply_memory_fraction("cpu", 1.5)
    with pytest.raises(ValueError, match=r"--memory_fraction 0:"):
        device_share.memory_budget(GIB, "cpu", 0)


def test_total_and_held_memory_of_a_card_are_its_own(two_cards: dict) -> None:
    assert [device_share.total_memory(d) for d in ("cuda:0", "cuda:1", "cuda")] == [40 * GIB, 80 * GIB, 80 * GIB]
    assert [device_share.held_memory(d) for d in ("cuda:0", "cuda")] == [1 * GIB, 3 * GIB // 4]
    assert device_share.held_memory("cpu") == 0  # a CPU process holds nothing on a card, CUDA or not


def test_total_and_held_memory_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_share.total_memory("cuda:0") is None
    assert device_share.held_memory("cuda:0") == 0 and device_share.held_memory("cpu") == 0


def _fake_meminfo(monkeypatch: pytest.MonkeyPatch, text: str | None) -> None:
    """``/proc/meminfo`` as ``text`` for :mod:`lragent.device_share` (None: no such file); other paths do not exist."""
    import io

    def fake_open(path, *args, **kwargs):
        if path == "/proc/meminfo" and text is not None:
            return io.StringIO(text)
        raise FileNotFoundError(path)

    monkeypatch.setattr(device_share, "open", fake_open, raising=False)


def test_meminfo_fields_are_read_in_bytes_and_the_cpu_total_is_memtotal(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_meminfo(monkeypatch, "MemTotal:       16384 kB\nMemFree:         1024 kB\nMemAvailable:    8192 kB\n")
    assert device_share.meminfo_bytes("MemAvailable") == 8192 * 1024
    assert device_share.meminfo_bytes("MemTotal") == device_share.total_memory("cpu") == 16384 * 1024
    assert device_share.meminfo_bytes("SwapTotal") is None


def test_without_proc_meminfo_the_cpu_total_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_meminfo(monkeypatch, None)
    assert device_share.meminfo_bytes("MemTotal") is None and device_share.total_memory("cpu") is None


def test_memory_budget_on_a_card_is_the_share_of_its_total_less_what_it_holds(two_cards: dict) -> None:
    """Card 0: 40 GiB, 1 GiB held; a 0.25 share leaves 9 GiB (what is free bounds it; unknown free: the share)."""
    assert device_share.memory_budget(None, "cuda:0", 0.25) == 9 * GIB
    assert device_share.memory_budget(20 * GIB, "cuda:0", 0.25) == 9 * GIB
    assert device_share.memory_budget(5 * GIB, "cuda:0", 0.25) == 5 * GIB
    assert device_share.memory_budget(None, "cuda", 0.5) == 40 * GIB - 3 * GIB // 4  # the current card, 80 GiB


def test_memory_budget_is_zero_when_the_process_already_holds_more_than_its_share(two_cards: dict) -> None:
    assert device_share.memory_budget(None, "cuda:0", 0.02) == 0  # 0.8 GiB share, 1 GiB held
    assert device_share.memory_budget(GIB, "cuda:0", 0.02) == 0


def test_memory_budget_with_an_unknown_total_is_what_is_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_share.memory_budget(5 * GIB, "cuda:0", 0.5) == 5 * GIB
    assert device_share.memory_budget(None, "cuda:0", 0.5) is None


def test_is_oom_knows_torch_oom_whatever_its_text_and_runtime_errors_saying_out_of_memory() -> None:
    assert device_share.is_oom(torch.OutOfMemoryError("allocator gave up"))
    assert device_share.is_oom(RuntimeError("CUDA error: Out Of Memory while launching"))
    assert device_share.is_oom(RuntimeError("out of memory"))
    assert not device_share.is_oom(RuntimeError("CUDA error: device-side assert triggered"))
    assert not device_share.is_oom(ValueError("out of memory"))  # not a RuntimeError


def test_oom_line_without_a_size_says_an_allocation_and_names_the_given_device(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = device_share.oom_line(RuntimeError("out of memory"), "cpu", "a smaller --batch")
    assert line == "out of memory on cpu an allocation; try a smaller --batch"
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has ...")
    assert device_share.oom_line(exc, "cuda:1", "x") == "out of memory on cuda:1 allocating 2.00 GiB; try x"
    assert device_share.oom_line(exc, None, "x") == "out of memory on cpu allocating 2.00 GiB; try x"


def test_oom_line_on_a_card_tells_what_is_free_of_its_total_and_held_here(two_cards: dict) -> None:
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.25 GiB. GPU 1 has a total capacity ...")
    line = "out of memory on cuda:1 allocating 3.25 GiB: 1.50 GiB free of 80.00 GiB, 0.75 GiB held here; try x"
    assert device_share.oom_line(exc, "cuda:1", "x") == line
    current = "out of memory on cuda allocating 3.25 GiB: 1.50 GiB free of 80.00 GiB, 0.75 GiB held here; try x"
    assert device_share.oom_line(exc, None, "x") == current  # no device named: CUDA's current card
    assert device_share.oom_line(exc, "cpu", "x") == "out of memory on cpu allocating 3.25 GiB; try x"


def test_the_lock_of_a_card_without_a_uuid_is_named_by_visible_devices_and_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No UUID (older torch): ``CUDA_VISIBLE_DEVICES`` and the index name the lock (unset: the index alone); with no
    ``$LRAGENT_LOCK_DIR`` it lives in the temporary directory."""
    import tempfile
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=GIB))
    monkeypatch.delenv("LRAGENT_LOCK_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with device_share.allocation_lock("cuda:1"):
        pass
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with device_share.allocation_lock("cuda"):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lragent-gpu--1.lock", "lragent-gpu-2_3-1.lock"]
