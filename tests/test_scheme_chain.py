"""``--scheme`` from the command line to the attention call: at most five files, parsed once.

:class:`SchemeTrail` follows one scheme through a real command run with :func:`sys.settrace`. A file of the repository
is on the scheme's chain when a function of it runs with the scheme in hand (the name as a string, the
:class:`~lragent.schemes.Scheme`, or the :class:`~lragent.sharing.SharingScheme` built from it, as an argument or
local variable, inside a list/tuple/dict held there, or as an attribute of ``self``) while it is on its way down:

- on the call stack when the name is parsed (a ``Scheme`` made from a plain string);
- on the call stack when :func:`~lragent.sharing.make_scheme` builds the scheme object that later reaches attention;
- on the call stack at the attention call: a cache view's ``attend``, called by the decoder layer with the view the
  engine built from the scheme's plan (slots, lengths, role ids). The decoder, the cache views and the attention
  functions below the engine never hold the scheme; the engine's call into the decoder is where the plan is consumed.

The stack is read from the command function down (``lragent.cli_main`` / ``lragent.command`` parse every option of
every command alike and are above it); the tests' own frames are not counted. Side branches that only label output or
size memory (row names, records, the memory check's own scheme object) are not on the way to the attention call and
are not counted.

The chains (eval without/with --batch, session, fidelity, bench trace) are pinned below; a planted forwarding layer
in another file, or a second parse, fails them (tests/planted_bugs.yaml: "SessionPolicy carries the scheme again",
"fidelity goes through the session again", "the eval factory hands the session the scheme's name").
"""

from __future__ import annotations

import enum
import sys
from pathlib import Path

import pytest

from lragent.cli_main import main
from lragent.schemes import Scheme
from lragent.sharing import SharingScheme
from tests.conftest import tiny_multi_lora

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
MAX_FILES = 5


class SchemeTrail:
    """Records, while it is active, the repository files the scheme called ``name`` passes through.

    Args:
        entry: the command function; frames above it (the command-line machinery, the test) are not read.
        name: the scheme's name, e.g. ``droidspeak``.
        stop_at_attention: end the run (raise :class:`ReachedAttention`) at the first attention call under the
            scheme: for commands whose runs are long (the rest of the run goes down the same path).

    Attributes:
        parses: the files that turned the plain string ``name`` into a ``Scheme``, one entry per parse.
        chain: the files on the scheme's way from ``entry`` to the attention call.
        attention_calls: attention calls reached with a scheme object of this name.
    """

    def __init__(self, entry, name: str, stop_at_attention: bool = False) -> None:
        self.entry = entry.__code__
        self.stop_at_attention = stop_at_attention
        self.name = name
        self.parses: list[str] = []
        self.chain: set[str] = set()
        self.attention_calls = 0
        self._made: dict[int, tuple[SharingScheme, set[str]]] = {}  # id -> (object, files when it was made)
        self._seen_stacks: set[tuple] = set()
        self._previous = None

    # ---- what "holds the scheme" means ---------------------------------------------------------------------------
    def _is_it(self, x: object) -> bool:
        if isinstance(x, SharingScheme):
            return x.scheme.value == self.name
        return isinstance(x, str) and x == self.name  # the name, or the Scheme (a str enum)

    def _holds(self, frame) -> bool:
        for key, v in frame.f_locals.items():
            if self._is_it(v):
                return True
            if isinstance(v, list | tuple | set | frozenset) and len(v) <= 64 and any(self._is_it(x) for x in v):
                return True
            if isinstance(v, dict) and len(v) <= 256 and any(self._is_it(x) for x in v.values()):
                return True
            if key == "self":
                attrs = getattr(v, "__dict__", None)
                if isinstance(attrs, dict) and any(self._is_it(x) for x in attrs.values()):
                    return True
        return False

    @staticmethod
    def _file(frame) -> str | None:
        path = Path(frame.f_code.co_filename)
        if not path.is_absolute() or ROOT not in path.parents or TESTS in path.parents:
            return None
        return str(path.relative_to(ROOT))

    def _stack(self, frame) -> list | None:
        """The frames from ``frame`` up to the command function, or None when the command is not on the stack."""
        frames = []
        while frame is not None:
            frames.append(frame)
            if frame.f_code is self.entry:
                return frames
            frame = frame.f_back
        return None

    def _files_holding(self, frames) -> set[str]:
        return {f for fr in frames if (f := self._file(fr)) is not None and self._holds(fr)}

    # ---- the events ----------------------------------------------------------------------------------------------
    def _trace(self, frame, event, arg):
        code = frame.f_code
        if code is _ENUM_NEW and frame.f_locals.get("cls") is Scheme:
            value = frame.f_locals.get("value")
            if type(value) is str and value == self.name and (frames := self._stack(frame)) is not None:
                caller = next((f for fr in frames[1:] if (f := self._file(fr)) is not None), "?")
                self.parses.append(caller)
                self.chain |= self._files_holding(frames)
            return None
        if code.co_name == "make_scheme" and code.co_filename.endswith("lragent/sharing.py"):
            frames = self._stack(frame)
            if frames is None:
                return None
            files = self._files_holding(frames)

            def on_return(frame, event, arg):
                if event == "return" and isinstance(arg, SharingScheme):
                    self._made[id(arg)] = (arg, files)
                return on_return

            return on_return
        if code.co_name == "attend" and code.co_filename.endswith("lragent/cache_views.py"):
            frames = self._stack(frame)
            if frames is None:
                return None
            key = tuple(fr.f_code for fr in frames)
            schemes = [
                v
                for fr in frames
                for v in (fr.f_locals.get("sch"), getattr(fr.f_locals.get("self"), "scheme", None))
                if isinstance(v, SharingScheme) and v.scheme.value == self.name
            ]
            if not schemes:
                return None
            self.attention_calls += 1
            if key in self._seen_stacks:
                return None
            self._seen_stacks.add(key)
            self.chain |= self._files_holding(frames)
            for sch in schemes:
                made = self._made.get(id(sch))
                assert made is not None and made[0] is sch, "a scheme object reached attention without make_scheme"
                self.chain |= made[1]
            if self.stop_at_attention:
                raise ReachedAttention
        return None

    def __enter__(self) -> SchemeTrail:
        self._previous = sys.gettrace()
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(self._previous)


class ReachedAttention(Exception):
    """Raised by a :class:`SchemeTrail` with ``stop_at_attention`` at the first attention call under its scheme."""


_ENUM_NEW = enum.Enum.__new__.__code__


class Tok:
    """One id per character in the tiny vocabulary (3..52); no end-of-sequence token."""

    eos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 50 for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + i % 26) for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [chr(97 + i % 26) for i in ids]


class CharTokenizer:
    """Fidelity's role examples: one id per character (mod 250), BOS 251 in front, EOS 252."""

    eos_token_id = 252

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([251] if add_special_tokens else []) + [ord(c) % 250 for c in text]}


def _report(trail: SchemeTrail) -> str:
    return f"chain {sorted(trail.chain)}, parses {trail.parses}"


def _check(trail: SchemeTrail, expected: set[str]) -> None:
    assert trail.attention_calls > 0, "the command never reached an attention call under the scheme"
    assert len(trail.parses) == 1, f"--scheme parsed {len(trail.parses)} times: {_report(trail)}"
    assert len(trail.chain) <= MAX_FILES, f"--scheme passes through {len(trail.chain)} files: {_report(trail)}"
    assert trail.chain == expected, _report(trail)


@pytest.mark.parametrize("batch", [0, 1], ids=["sequential", "batched"])
def test_eval_chain(batch, tmp_path, monkeypatch, capsys):
    """eval: run_eval parses --scheme; one MultiAgentSession per episode (or one Engine per scheme with --batch)."""
    import eval_suite.evaluate.run_eval as run_eval

    model = tiny_multi_lora(seed=3)
    monkeypatch.setattr(run_eval, "load_lora_model", lambda **kw: (model, Tok()))
    argv = ["eval", "--benchmark", "hotpotqa", "--scheme", "droidspeak", "--adapter_init", "random", "--limit", "1",
            "--runs", "1", "--max_steps", "1", "--thought_tokens", "2", "--argument_tokens", "2", "--device", "cpu",
            "--out", str(tmp_path / "e"), "--quiet", "true", "--batch", str(batch), "--capacity", "4096"]  # fmt: skip
    with SchemeTrail(run_eval.evaluate, "droidspeak") as trail:
        assert main(argv) == 0, capsys.readouterr().err
    middle = "lragent/session.py" if batch == 0 else "eval_suite/evaluate/batched_executor.py"
    _check(
        trail,
        {"eval_suite/evaluate/run_eval.py", "lragent/schemes.py", middle, "lragent/engine.py", "lragent/sharing.py"},
    )
    assert trail.parses == ["lragent/schemes.py"]


def test_session_chain(tmp_path, monkeypatch, capsys):
    """session: session_runner parses --scheme and opens the MultiAgentSession."""
    import eval_suite.evaluate.session_runner as sr

    model = tiny_multi_lora(seed=4)
    monkeypatch.setattr(sr, "load_lora_model", lambda **kw: (model, Tok()))
    argv = ["session", "--scheme", "droidspeak", "--adapter_init", "random", "--schedule", "short", "--max_new_tokens",
            "1", "--device", "cpu", "--out", str(tmp_path / "r.json"), "--quiet", "true"]  # fmt: skip
    with SchemeTrail(sr.session, "droidspeak") as trail:
        assert main(argv) == 0, capsys.readouterr().err
    _check(
        trail,
        {"eval_suite/evaluate/session_runner.py", "lragent/schemes.py", "lragent/session.py", "lragent/engine.py",
         "lragent/sharing.py"},
    )  # fmt: skip


def test_fidelity_chain(tmp_path, monkeypatch, capsys):
    """fidelity: the command parses --scheme; the measure (eval_suite.diagnostics.fidelity) runs each scheme on an
    Engine row."""
    import eval_suite.diagnostics.fidelity_command as fc

    model = tiny_multi_lora(seed=5)
    monkeypatch.setattr(fc, "load_lora_model", lambda **kw: (model, CharTokenizer()))
    argv = ["fidelity", "--adapter_init", "random", "--limit", "1", "--max_context_tokens", "40", "--scheme",
            "droidspeak", "--device", "cpu", "--out", str(tmp_path / "f"), "--quiet", "true"]  # fmt: skip
    with SchemeTrail(fc.fidelity, "droidspeak") as trail:
        assert main(argv) == 0, capsys.readouterr().err
    _check(
        trail,
        {"eval_suite/diagnostics/fidelity_command.py", "lragent/schemes.py", "eval_suite/diagnostics/fidelity.py",
         "lragent/engine.py", "lragent/sharing.py"},
    )  # fmt: skip


def test_bench_trace_chain(tmp_path, capsys):
    """bench trace: the bench parses --schemes and builds one Engine per scheme."""
    import eval_suite.bench.trace as bt

    argv = ["bench", "trace", "--model", "tiny-llama", "--contexts", "[4]", "--schemes", "[droidspeak]",
            "--device", "cpu", "--dtype", "float32", "--out", str(tmp_path / "t")]  # fmt: skip
    with SchemeTrail(bt.trace, "droidspeak", stop_at_attention=True) as trail, pytest.raises(ReachedAttention):
        main(argv)
    _check(trail, {"eval_suite/bench/trace.py", "lragent/schemes.py", "lragent/engine.py", "lragent/sharing.py"})


def test_trail_sees_every_file_and_a_second_parse():
    """The trail itself: a session opened with a name parsed twice; every library file on the way is seen."""
    from lragent.session import MultiAgentSession

    model = tiny_multi_lora(seed=6)

    def run(spec: str) -> None:
        scheme = Scheme.parse(spec)
        s = MultiAgentSession(model, Scheme.parse(str(scheme)), eos_token_ids=[])  # a second parse of the name
        s.append([3, 4, 5])
        s.step("plan", max_new_tokens=1)

    with SchemeTrail(run, "full_shared") as trail:
        run("full_shared")
    assert len(trail.parses) == 2 and trail.attention_calls > 0
    assert trail.chain == {"lragent/schemes.py", "lragent/session.py", "lragent/engine.py", "lragent/sharing.py"}
