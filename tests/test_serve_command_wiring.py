"""``lragent serve`` end to end without a model (eval_suite/serve/serve_command.py): each option's allowed range, its
ends taken and refused in one line; then, with the model load, the engine, the scheduler and the server loop replaced
by recorders, what the command builds from its options (dtype and device defaults, rows sized for the roles plus the
base model, CUDA-only engine features, the API key from the environment) and the lines it prints."""

from __future__ import annotations

import json
import socket
from types import SimpleNamespace

import pytest

import eval_suite.serve.api_server as api_server
import eval_suite.serve.serve_command as serve_command
import lragent.device_share as device_share
import lragent.engine as engine_module
import lragent.loading as loading
import lragent.memory_plan as memory_plan
import lragent.serving.model as serving_model
import lragent.serving.scheduler as scheduler_module
from eval_suite.evaluate.batched_executor import FEED_BUDGET, PREFILL_IN_DECODE
from eval_suite.serve.serve_command import CPU_AUTO_ROWS, GPU_AUTO_ROWS, _size_rows, serve

STORED = SimpleNamespace(roles=("plan", "action", "reflect"), rank=4, shared_a=False)


class Recorder:
    """The command's heavy parts, recorded: what each was called with."""

    def __init__(self, monkeypatch, device: str = "cpu", rows: int = 3) -> None:
        self.calls: dict[str, object] = {}
        rec = self

        def check_model_args(**kwargs):
            rec.calls["check_model_args"] = kwargs
            return STORED

        def choose_batch(*args, **kwargs):
            rec.calls["choose_batch"] = (args, kwargs)
            return rows

        def load_served_model(**kwargs):
            rec.calls["load_served_model"] = kwargs
            return "LM", "TOK"

        class Engine:
            def __init__(self, *args, **kwargs) -> None:
                rec.calls["engine"] = (args, kwargs)
                rec.engine = self

        class Scheduler:
            def __init__(self, engine, tokenizer, launch_ahead, profiler) -> None:
                rec.calls["scheduler"] = (engine, tokenizer, launch_ahead)
                rec.calls["profiler"] = profiler
                self.roles = (*STORED.roles, "Base")
                self.metrics = SimpleNamespace(watch_gc=lambda: rec.calls.__setitem__("watch_gc", True))

        def serve_until_stopped(app, sock, log_level):
            rec.calls["serve_until_stopped"] = (app, sock.getsockname(), log_level)
            rec.calls["frozen_before_serving"] = rec.calls.get("frozen", 0)
            sock.close()

        def freeze_startup_heap():
            rec.calls["frozen"] = rec.calls.get("frozen", 0) + 1
            return 1

        monkeypatch.setattr(loading, "resolve_device", lambda d: device if d is None else d)
        monkeypatch.setattr(loading, "check_model_args", check_model_args)
        monkeypatch.setattr(memory_plan, "choose_batch", choose_batch)
        monkeypatch.setattr(device_share, "apply_memory_fraction", lambda d, f: rec.calls.update(fraction=(d, f)))
        monkeypatch.setattr(serving_model, "load_served_model", load_served_model)
        monkeypatch.setattr(engine_module, "Engine", Engine)
        monkeypatch.setattr(scheduler_module, "Scheduler", Scheduler)
        monkeypatch.setattr(api_server, "serve_until_stopped", serve_until_stopped)
        monkeypatch.setattr(serve_command, "freeze_startup_heap", freeze_startup_heap)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"port": -1}, "--port -1: allowed 0..65535 (0: a free port)"),
        ({"port": 65536}, "--port 65536: allowed 0..65535 (0: a free port)"),
        ({"port": True}, "--port True: allowed 0..65535 (0: a free port)"),
        ({"max_rows": 0}, "--max_rows must be >= 1 or auto, got 0"),
        ({"max_rows": True}, "--max_rows must be >= 1 or auto, got True"),
        ({"capacity": 15}, "--capacity must be >= 16 positions, got 15"),
        ({"log_level": "WARNING"}, "--log_level 'WARNING': allowed critical, error, warning, info, debug"),
        (
            {"memory_fraction": 1.5},
            "--memory_fraction 1.5: allowed a share of the device's memory in (0, 1], e.g. 0.15",
        ),
    ],
)
def test_an_option_out_of_range_is_refused_naming_its_value(monkeypatch, options, message):
    """Refused before anything else is looked at (the model's checks would stop the command otherwise)."""

    def later(**kwargs):
        raise LookupError("past the option checks")

    monkeypatch.setattr(loading, "check_model_args", later)
    with pytest.raises(ValueError) as exc:
        serve(**options)
    assert str(exc.value) == message


@pytest.mark.parametrize(
    "options",
    [
        {"port": 0},
        {"port": 65535},
        {"max_rows": 1},
        {"max_rows": "auto"},
        {"capacity": 16},
        *({"log_level": level} for level in ("critical", "error", "warning", "info", "debug")),
    ],
)
def test_each_end_of_an_allowed_range_is_taken(monkeypatch, options):
    """An option at the end of its range passes its check: the command goes on to the model's checks."""

    def stop(**kwargs):
        raise LookupError("past the option checks")

    monkeypatch.setattr(loading, "check_model_args", stop)
    with pytest.raises(LookupError, match="past the option checks"):
        serve(**{"device": "cpu", **options})


def test_serve_builds_the_server_from_its_options_on_the_cpu(monkeypatch, capsys, tmp_path):
    rec = Recorder(monkeypatch)
    monkeypatch.setenv("LRAGENT_API_KEY", "from-env")
    monkeypatch.delenv("LRAGENT_SERVE_PROFILE", raising=False)
    config = tmp_path / "droidspeak.json"
    config.write_text(json.dumps({"droidspeak_layers": [1, 3]}))
    assert (
        serve(
            model="some/dir/",
            adapters="ADAPTERS",
            scheme="droidspeak",
            port=0,
            max_rows="auto",
            capacity=64,
            droidspeak_config=str(config),
            memory_fraction=0.5,
            log_level="info",
            launch_ahead=False,
        )
        == 0
    )
    assert rec.calls["check_model_args"] == {
        "model": "some/dir/",
        "adapters": "ADAPTERS",
        "dtype": "float32",
        "device": "cpu",
        "needs_text": True,
    }
    args, kwargs = rec.calls["choose_batch"]
    assert args == ("some/dir/", ["droidspeak"], "auto", 64)
    assert kwargs == {
        "dtype": "float32",
        "device": "cpu",
        "rank": 4,
        "n_roles": 4,
        "shared_a": False,
        "droidspeak_layers": [1, 3],
        "max_batch": CPU_AUTO_ROWS,
        "option": "--max_rows",
        "memory_fraction": 0.5,
    }
    assert rec.calls["fraction"] == ("cpu", 0.5)
    assert rec.calls["load_served_model"] == {
        "model": "some/dir/",
        "adapters": "ADAPTERS",
        "dtype": "float32",
        "device": "cpu",
        "base_name": "dir",
    }
    args, kwargs = rec.calls["engine"]
    assert args[0] == "LM" and str(args[1]) == "droidspeak"
    assert kwargs == {
        "rows": 3,
        "capacity": 64,
        "tokenizer": "TOK",
        "droidspeak_layers": [1, 3],
        "cuda_graphs": False,
        "prefill_in_decode": 0,
        "feed_budget": 0,
    }
    assert rec.calls["scheduler"] == (rec.engine, "TOK", False)
    assert rec.calls["profiler"] is None  # LRAGENT_SERVE_PROFILE unset: nothing recorded
    assert rec.calls["watch_gc"] is True  # /metrics counts the collections' pauses
    assert rec.calls["frozen_before_serving"] == rec.calls["frozen"] == 1  # the loaded heap frozen once, then served
    app, (host, port), level = rec.calls["serve_until_stopped"]
    assert (host, level) == ("127.0.0.1", "info") and port > 0
    state = app.state.serve
    assert (state.scheme, state.base_name, state.tokenizer, state.api_key) == ("droidspeak", "dir", "TOK", "from-env")
    assert state.scheduler is not None and state.scheduler.roles == ("plan", "action", "reflect", "Base")
    assert capsys.readouterr().err.splitlines() == [
        f"serve: http://127.0.0.1:{port}/v1 serving plan, action, reflect, Base (scheme droidspeak, 3 rows x 64 "
        "positions, float32 on cpu, API key required); SIGTERM or Ctrl-C stops it once the requests in flight are done",
        "serve: stopped (every request in flight was answered)",
    ]


def test_serve_on_a_gpu_takes_bfloat16_and_the_cuda_engine_features(monkeypatch, capsys):
    rec = Recorder(monkeypatch, device="cuda:0", rows=5)
    monkeypatch.delenv("LRAGENT_API_KEY", raising=False)
    monkeypatch.setenv("LRAGENT_SERVE_PROFILE", "/some/dir:40:7")
    assert serve(port=0, adapters="A", capacity=32, max_rows=5) == 0
    p = rec.calls["profiler"]  # the diagnostic the variable asks for, named as the server's
    assert (p.folder, p.first, p.count, p.name) == ("/some/dir", 40, 7, "serve")
    assert rec.calls["check_model_args"]["dtype"] == "bfloat16"
    assert rec.calls["scheduler"][2] is True  # launch ahead is on by default
    args, kwargs = rec.calls["choose_batch"]
    assert args == ("default", ["base_lr_shared"], 5, 32)
    assert kwargs["max_batch"] == GPU_AUTO_ROWS and kwargs["droidspeak_layers"] is None and kwargs["n_roles"] == 4
    assert rec.calls["fraction"] == ("cuda:0", None)
    assert rec.calls["load_served_model"]["base_name"] == "SmolLM2-135M-Instruct"
    _, kwargs = rec.calls["engine"]
    assert kwargs["cuda_graphs"] is True and kwargs["rows"] == 5 and kwargs["droidspeak_layers"] is None
    assert (kwargs["prefill_in_decode"], kwargs["feed_budget"]) == (PREFILL_IN_DECODE, FEED_BUDGET)
    app, _, level = rec.calls["serve_until_stopped"]
    assert level == "warning" and app.state.serve.api_key is None
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith(
        "(scheme base_lr_shared, 5 rows x 32 positions, bfloat16 on cuda:0); SIGTERM or Ctrl-C "
        "stops it once the requests in flight are done"
    )
    assert len(err) == 2


def test_serve_without_cuda_graphs_and_with_the_default_adapters(monkeypatch):
    rec = Recorder(monkeypatch, device="cuda:0")
    monkeypatch.setenv("LRAGENT_API_KEY", "")  # empty: no key
    assert serve(port=0, cuda_graphs=False, dtype="float16") == 0
    assert rec.calls["check_model_args"]["adapters"] == serving_model.default_serve_adapters("default")
    assert rec.calls["check_model_args"]["dtype"] == "float16"
    assert rec.calls["engine"][1]["cuda_graphs"] is False
    assert rec.calls["serve_until_stopped"][0].state.serve.api_key is None


def test_an_explicit_key_wins_over_the_environment(monkeypatch, capsys):
    rec = Recorder(monkeypatch)
    monkeypatch.setenv("LRAGENT_API_KEY", "from-env")
    assert serve(port=0, adapters="A", api_key="given") == 0
    assert rec.calls["serve_until_stopped"][0].state.serve.api_key == "given"
    assert ", API key required)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "host, key, warned",
    [("0.0.0.0", None, True), ("0.0.0.0", "k", False), ("localhost", None, False), ("::1", None, False)],
)
def test_listening_beyond_this_machine_without_a_key_is_warned_about(monkeypatch, capsys, host, key, warned):
    Recorder(monkeypatch)
    monkeypatch.delenv("LRAGENT_API_KEY", raising=False)
    try:
        assert serve(host=host, port=0, adapters="A", api_key=key) == 0
    except ValueError as exc:  # a machine without IPv6 loopback
        assert host == "::1" and "cannot listen" in str(exc)
        return
    err = capsys.readouterr().err.splitlines()
    warning = f"serve: warning: listening on {host} without --api_key: anyone who can reach it can use it"
    assert (warning in err) == warned and len(err) == 2 + warned
    if host == "::1":
        assert err[0].startswith("serve: http://[::1]:")


def test_a_busy_port_is_refused_before_the_model_loads(monkeypatch):
    rec = Recorder(monkeypatch)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    try:
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
            serve(port=port, adapters="A")
    finally:
        busy.close()
    assert "load_served_model" not in rec.calls and "choose_batch" not in rec.calls


def test_rows_are_sized_for_the_roles_and_the_base_model(monkeypatch):
    rec = Recorder(monkeypatch, rows=7)
    stored = SimpleNamespace(roles=("a", "b"), rank=16, shared_a=True)
    assert _size_rows("m", "non_shared", "auto", 128, "float32", "cuda", stored, [2], 0.25) == 7
    args, kwargs = rec.calls["choose_batch"]
    assert args == ("m", ["non_shared"], "auto", 128)
    assert kwargs == {
        "dtype": "float32",
        "device": "cuda",
        "rank": 16,
        "n_roles": 3,
        "shared_a": True,
        "droidspeak_layers": [2],
        "max_batch": GPU_AUTO_ROWS,
        "option": "--max_rows",
        "memory_fraction": 0.25,
    }
    assert (CPU_AUTO_ROWS, GPU_AUTO_ROWS) == (4, 64)


def test_the_defaults_serve_this_machine_on_port_8000_with_4096_positions(monkeypatch, capsys):
    rec = Recorder(monkeypatch, device="cuda:0")
    bound: list[tuple[str, int]] = []
    real_bind = api_server.bind

    def bind(host: str, port: int) -> socket.socket:
        bound.append((host, port))
        return real_bind(host, 0)  # port 8000 may be taken on a test machine

    monkeypatch.setattr(api_server, "bind", bind)
    monkeypatch.delenv("LRAGENT_API_KEY", raising=False)
    assert serve(adapters="A") == 0
    assert bound == [("127.0.0.1", 8000)]
    args, kwargs = rec.calls["choose_batch"]
    assert args == ("default", ["base_lr_shared"], "auto", 4096)
    assert rec.calls["engine"][1]["capacity"] == 4096 and rec.calls["serve_until_stopped"][2] == "warning"
    assert "4096 positions, bfloat16 on cuda:0);" in capsys.readouterr().err


def test_an_explicit_device_is_the_one_used(monkeypatch):
    rec = Recorder(monkeypatch, device="cuda:0")  # what the machine would default to
    assert serve(port=0, adapters="A", device="cpu") == 0
    assert rec.calls["check_model_args"]["device"] == "cpu" and rec.calls["check_model_args"]["dtype"] == "float32"
    assert rec.calls["engine"][1]["cuda_graphs"] is False
