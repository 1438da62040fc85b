"""``lragent session`` without a model (eval_suite/evaluate/session_runner.py): the exact steps of each built-in
schedule, the question a --split and --question pick, the checks made before anything loads, and what a run hands
the session, writes after every step and prints (a recording fake session stands for MultiAgentSession)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import eval_suite.evaluate.session_runner as sr
from eval_suite.evaluate.benchmarks import HOTPOTQA
from lragent.agents.prompts import HOTPOTQA as HOTPOTQA_PROMPT
from lragent.agents.prompts import RESPONSE, initial_text
from lragent.paths import DATA_DIR
from lragent.roles import DEFAULT_ROLES
from lragent.schemes import Scheme


def record(n_paragraphs: int) -> dict:
    """A HotpotQA-shaped record: paragraph i titled Ti, its sentences with the spaces HotpotQA keeps."""
    return {
        "id": "q-1",
        "question": "  Which came first?  ",
        "context": {
            "title": [f"T{i}" for i in range(n_paragraphs)],
            "sentences": [[f" S{i}a.", f" S{i}b. "] for i in range(n_paragraphs)],
        },
    }


HEAD = initial_text(HOTPOTQA_PROMPT, "Which came first?")


def test_the_agent_schedule_is_five_plan_plan_action_cycles_then_two_reflects():
    """17 steps; cycle c > 0 observes paragraph c mod (number of paragraphs), written "title: sentences"."""
    steps = sr.build_schedule("agent", record(3))
    want = []
    for thought in (HEAD, *(f"\nObversation: T{i}: S{i}a. S{i}b.\nThought: {RESPONSE}" for i in (1, 2, 0, 1))):
        want += [("plan", thought), ("plan", f"\nAction: {RESPONSE}"), ("action", f"\nAciton: Retrieve[{RESPONSE}")]
    want += [
        ("reflect", f"]\nObversation: Please reflect your answer.\nThought: {RESPONSE}"),
        ("reflect", f"\nAction: Reflect[{RESPONSE}"),
    ]
    assert len(steps) == 17 and steps == want


def test_the_short_and_roles_schedules():
    assert sr.build_schedule("short", record(2)) == [
        ("plan", HEAD),
        ("action", f"\nAciton: Retrieve[{RESPONSE}"),
        ("reflect", f"]\nThought: {RESPONSE}"),
    ]
    ctx = HEAD + "".join(f"Obversation: T{i}: S{i}a. S{i}b.\n" for i in range(4))  # the first four paragraphs only
    assert sr.build_schedule("roles", record(6)) == [
        ("plan", ctx),
        ("action", f"\nAciton: Retrieve[{RESPONSE}"),
        ("reflect", f"]\nThought: {RESPONSE}"),
        ("plan", f"\nThought: {RESPONSE}"),
        ("action", f"\nAction: {RESPONSE}"),
        ("reflect", f"\nThought: {RESPONSE}"),
    ]
    assert sr.SCHEDULES == ("agent", "short", "roles")


def test_an_unknown_schedule_or_a_record_whose_titles_and_paragraphs_differ_is_refused():
    with pytest.raises(ValueError) as exc:
        sr.build_schedule("long", record(2))
    assert str(exc.value) == "unknown schedule 'long': allowed agent, short, roles"
    bad = record(3)
    bad["context"]["title"].pop()
    with pytest.raises(ValueError):
        sr.build_schedule("short", bad)


@pytest.mark.parametrize("split", ["dev", "test"])
def test_a_question_is_the_index_th_easy_question_of_its_split(split):
    lines = [x for x in HOTPOTQA.level_file("easy", DATA_DIR, split).read_text().splitlines() if x.strip()]
    assert sr._load_question(0, split) == json.loads(lines[0])
    assert sr._load_question(len(lines) - 1, split) == json.loads(lines[-1])
    for index in (-1, len(lines)):
        with pytest.raises(ValueError) as exc:
            sr._load_question(index, split)
        assert str(exc.value) == f"--question {index} out of range: allowed 0..{len(lines) - 1}"
    assert sr._load_question(3) == sr._load_question(3, "dev")  # dev unless told


def test_a_session_runs_one_split():
    with pytest.raises(ValueError) as exc:
        sr._load_question(0, "dev,test")
    assert str(exc.value) == "--split 'dev,test': a session runs one question; allowed one of dev, test"


class Recorded:
    """session_runner's heavy parts replaced: what each was called with, and a fake MultiAgentSession that reads the
    result file at every step (what an interrupted run would have left)."""

    def __init__(self, monkeypatch, out: Path) -> None:
        self.calls: dict[str, object] = {}
        self.on_disk: list[int] = []
        self.steps: list[tuple] = []
        self.texts: list[str] = []
        rec = self

        class Session:
            def __init__(self, lm, scheme, **kwargs) -> None:
                rec.calls["session"] = (lm, scheme, kwargs)
                self.scheme = scheme
                self.peak_cache_bytes = 0
                self.num_tokens = 0

            def append_text(self, text: str) -> None:
                rec.texts.append(text)

            def step(self, role: str, **kwargs):
                rec.on_disk.append(len(json.loads(out.read_text())["steps"]) if out.exists() else -1)
                i = len(rec.steps)
                rec.steps.append((role, kwargs))
                self.peak_cache_bytes = 2**20 * (i + 1) + 2**18
                self.num_tokens = 10 * (i + 1)
                d = {
                    "role": role,
                    "prefill_tokens": 100 + i,
                    "prefill_s": 0.5 + i,
                    "generated_ids": [7] * (i + 2),
                    "decode_s": 0.25,
                    "text": f"out{i}" + "x" * 70,
                }
                return SimpleNamespace(**d, to_dict=lambda: dict(d))

            def cache_bytes(self) -> dict:
                return {"k": len(rec.steps)}

        monkeypatch.setattr(sr, "check_model_args", lambda **kw: rec.calls.update(check_model_args=kw))
        monkeypatch.setattr(sr, "check_session", lambda *a, **kw: rec.calls.update(check_session=(a, kw)))
        monkeypatch.setattr(sr, "load_lora_model", lambda **kw: (rec.calls.update(load=kw), ("LM", "TOK"))[1])
        monkeypatch.setattr(sr, "MultiAgentSession", Session)
        monkeypatch.setattr(sr, "on_interrupt", lambda note: rec.calls.update(interrupt=note))
        real_provenance = sr.provenance
        monkeypatch.setattr(sr, "provenance", lambda **kw: {**real_provenance(**kw), "asked": kw})


def test_a_session_runs_the_schedule_and_rewrites_its_result_after_every_step(monkeypatch, tmp_path, capsys):
    out = tmp_path / "sub" / "r.json"
    rec = Recorded(monkeypatch, out)
    assert (
        sr.session(
            scheme="non_shared",
            schedule="short",
            question=2,
            split="test",
            max_new_tokens=5,
            temperature=0.7,
            seed=9,
            rank=4,
            alpha=8.0,
            dtype="float32",
            device="cpu",
            out=str(out),
            droidspeak_layers=[1],
            use_kernel=False,
        )
        == 0
    )
    question = sr._load_question(2, "test")
    steps = sr.build_schedule("short", question)
    assert rec.calls["check_model_args"] == {
        "model": "default",
        "adapters": None,
        "adapter_init": "random",
        "rank": 4,
        "alpha": 8.0,
        "dtype": "float32",
        "device": "cpu",
        "roles": DEFAULT_ROLES,
        "needs_text": True,
    }
    text_bytes = sum(len(t.encode()) for _, t in steps) + 3 * 6  # each step's text plus its tokens and one more
    assert rec.calls["check_session"] == (
        ("default", Scheme.NON_SHARED, text_bytes),
        {"dtype": "float32", "device": "cpu", "rank": 4, "shared_a": True, "droidspeak_layers": [1]},
    )
    assert rec.calls["load"] == {
        "model": "default",
        "adapters": None,
        "adapter_init": "random",
        "rank": 4,
        "alpha": 8.0,
        "shared_a": True,
        "seed": 9,
        "dtype": "float32",
        "device": "cpu",
    }
    assert rec.calls["session"] == (
        "LM",
        Scheme.NON_SHARED,
        {"tokenizer": "TOK", "seed": 9, "use_kernel": False, "droidspeak_layers": [1], "cuda_graphs": None},
    )
    assert rec.calls["interrupt"] == f"the steps done so far are in {out}"
    assert rec.texts == [t for _, t in steps]
    assert rec.steps == [(role, {"max_new_tokens": 5, "temperature": 0.7, "stop": ["\n"]}) for role, _ in steps]
    assert rec.on_disk == [-1, 1, 2]  # the file holds every step done before the next one starts
    result = json.loads(out.read_text())
    prov = result.pop("provenance")
    assert prov["asked"] == {"dtype": "float32", "device": "cpu"} and prov["dtype"] == "float32"
    assert [s["prefill_tokens"] for s in result.pop("steps")] == [100, 101, 102]
    assert result == {
        "scheme": "non_shared",
        "model": "default",
        "schedule": "short",
        "question": 2,
        "split": "test",
        "adapters": "init:random",
        "seed": 9,
        "question_id": question["id"],
        "cache_bytes": {"k": 3},
        "peak_cache_bytes": 3 * 2**20 + 2**18,
        "num_tokens": 30,
    }
    captured = capsys.readouterr()
    total = (100 + 2) + (101 + 3) + (102 + 4)
    assert captured.out == f"non_shared: 3 steps, {total} processed tokens, peak cache 3.25 MiB -> {out}\n"
    lines = captured.err.splitlines()
    assert lines[0] == "[ 1/3] plan     prefill   100 tok  0.500s decode   2 tok  0.250s | " + repr("out0" + "x" * 56)
    assert lines[2].startswith("[ 3/3] reflect  prefill   102 tok  2.500s decode   4 tok  0.250s | 'out2")
    assert len(lines) == 3


def test_a_quiet_session_with_adapters_prints_only_its_summary(monkeypatch, tmp_path, capsys):
    out = tmp_path / "r.json"
    rec = Recorded(monkeypatch, out)
    assert (
        sr.session(
            scheme="base_shared",
            adapters="ADAPTERS",
            independent_a=True,
            schedule="roles",
            quiet=True,
            cuda_graphs=False,
            device="cpu",
            out=str(out),
        )
        == 0
    )
    assert rec.calls["check_model_args"]["adapter_init"] is None and rec.calls["check_model_args"]["rank"] == 8
    assert rec.calls["check_model_args"]["adapters"] == "ADAPTERS" and rec.calls["load"]["adapters"] == "ADAPTERS"
    assert rec.calls["load"]["adapter_init"] is None
    assert rec.calls["load"]["shared_a"] is False and rec.calls["check_session"][1]["shared_a"] is False
    assert rec.calls["session"][2]["cuda_graphs"] is False and rec.calls["session"][2]["use_kernel"] is True
    assert [k["max_new_tokens"] for _, k in rec.steps] == [24] * 6 and rec.steps[0][1]["temperature"] == 0.0
    result = json.loads(out.read_text())
    assert (result["adapters"], result["seed"], result["question"], result["split"]) == ("ADAPTERS", 0, 0, "dev")
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.startswith("base_shared: 6 steps, ")


def test_the_device_is_resolved_before_the_run(monkeypatch, tmp_path):
    """No --device: the machine's default (resolve_device); a given one is kept."""
    rec = Recorded(monkeypatch, tmp_path / "r.json")
    monkeypatch.setattr(sr, "resolve_device", lambda device: device or "cuda:7")
    assert sr.session(schedule="short", out=str(tmp_path / "r.json"), quiet=True) == 0
    assert rec.calls["load"]["device"] == "cuda:7" and rec.calls["check_model_args"]["device"] is None
    assert sr.session(schedule="short", out=str(tmp_path / "r.json"), quiet=True, device="cpu") == 0
    assert rec.calls["load"]["device"] == "cpu" and rec.calls["check_model_args"]["device"] == "cpu"


def test_the_defaults_write_result_json_here_in_float32(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    rec = Recorded(monkeypatch, tmp_path / "result.json")
    assert sr.session(device="cpu", quiet=True) == 0
    assert rec.calls["check_model_args"]["dtype"] == "float32" and rec.calls["check_model_args"]["alpha"] == 16.0
    assert (rec.calls["load"]["dtype"], rec.calls["load"]["alpha"]) == ("float32", 16.0)
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["scheme"], result["schedule"], len(result["steps"])) == ("base_lr_shared", "agent", 17)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"schedule": "long"}, "unknown schedule 'long': allowed agent, short, roles"),
        ({"max_new_tokens": 0}, "--max_new_tokens must be >= 1, got 0"),
        ({"independent_a": True}, "--scheme base_lr_shared needs shared A: drop --independent_a or use base_shared"),
        ({"question": 10**6}, "--question 1000000 out of range: allowed 0.."),
        ({"split": "dev,test"}, "--split 'dev,test': a session runs one question"),
    ],
)
def test_a_bad_option_is_refused_before_anything_loads_or_is_written(monkeypatch, tmp_path, options, message):
    out = tmp_path / "r.json"
    rec = Recorded(monkeypatch, out)
    with pytest.raises(ValueError) as exc:
        sr.session(**{"device": "cpu", "out": str(out), **options})
    assert str(exc.value).startswith(message)
    assert "load" not in rec.calls and "interrupt" not in rec.calls and list(tmp_path.iterdir()) == []


def test_an_out_that_is_a_directory_is_refused_before_the_run(monkeypatch, tmp_path):
    rec = Recorded(monkeypatch, tmp_path / "r.json")
    with pytest.raises(ValueError, match="is a directory"):
        sr.session(device="cpu", out=str(tmp_path))
    assert "load" not in rec.calls


@pytest.mark.parametrize(
    "options",
    [{"max_new_tokens": 1}, {"independent_a": True, "adapters": "A"}, {"independent_a": True, "scheme": "base_shared"}],
)
def test_the_ends_of_what_is_allowed_run(monkeypatch, tmp_path, options):
    out = tmp_path / "r.json"
    Recorded(monkeypatch, out)
    assert sr.session(**{"device": "cpu", "out": str(out), "schedule": "short", "quiet": True, **options}) == 0
    assert len(json.loads(out.read_text())["steps"]) == 3
