"""``lragent serve``'s option checks, before any model is loaded (eval_suite/serve/serve_command.py)."""

from __future__ import annotations

import pytest

from lragent.cli_main import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--capacity", "8"], "--capacity must be >= 16 positions, got 8"),
        (["--log_level", "loud"], "--log_level 'loud': allowed critical, error, warning, info, debug"),
    ],
)
def test_serve_options_are_refused_naming_the_value(capsys, argv, message):
    # a model without a tokenizer: were the option let through, the next check stops the command (no server)
    assert main(["serve", "--scheme", "base_lr_shared", "--model", "tiny-llama", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


@pytest.fixture
def switch_interval():
    """Python's switch interval, put back after the test (the tests set it in this process)."""
    import sys

    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_the_switch_interval_is_set_from_the_environment_in_milliseconds(switch_interval):
    """LRAGENT_SWITCH_INTERVAL_MS=0.5 sets Python's switch interval to 0.0005 s; unset or empty leaves it alone."""
    import sys

    from eval_suite.serve.serve_command import apply_switch_interval

    sys.setswitchinterval(0.005)
    assert apply_switch_interval({}) == 0.005
    assert apply_switch_interval({"LRAGENT_SWITCH_INTERVAL_MS": " "}) == 0.005
    assert apply_switch_interval({"LRAGENT_SWITCH_INTERVAL_MS": "0.5"}) == pytest.approx(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0005)


@pytest.mark.parametrize("raw", ["0", "-1", "fast", "inf", "nan"])
def test_a_bad_switch_interval_is_refused_naming_it_and_the_server_not_started(
    capsys, monkeypatch, raw, switch_interval
):
    """A value that is not a number of milliseconds > 0: one line naming it and what is allowed, exit 2, before any
    model is loaded; the interval unchanged."""
    import sys

    monkeypatch.setenv("LRAGENT_SWITCH_INTERVAL_MS", raw)
    before = sys.getswitchinterval()
    assert main(["serve", "--model", "tiny-llama", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: LRAGENT_SWITCH_INTERVAL_MS={raw!r}: allowed a number of milliseconds > 0 (e.g. 0.5)\n"
    assert sys.getswitchinterval() == before


def test_the_startup_heap_is_collected_then_frozen():
    """Garbage left by loading (a reference cycle) is collected first, not frozen for the server's life; what is alive
    is frozen (out of every later collection's walk) and counted."""
    import gc
    import weakref

    from eval_suite.serve.serve_command import freeze_startup_heap

    class Node:
        pass

    alive, cycle = Node(), Node()
    cycle.me = cycle
    dead = weakref.ref(cycle)
    del cycle
    try:
        frozen = freeze_startup_heap()
        assert dead() is None  # collected before the freeze
        assert frozen == gc.get_freeze_count() > 1000
        assert gc.is_tracked(alive) and not any(o is alive for o in gc.get_objects())  # frozen: out of sight
    finally:
        gc.unfreeze()
