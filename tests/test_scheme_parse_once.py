"""``--scheme`` is parsed once: the name becomes a :class:`~lragent.schemes.Scheme` where the command reads it, and
that object goes down to the session, the engine and the scheme object unparsed."""

from __future__ import annotations

import pytest

from lragent.schemes import Scheme, parse_schemes
from tests.conftest import tiny_multi_lora


@pytest.fixture()
def parses(monkeypatch):
    """Every name (a string that is not yet a Scheme) given to ``Scheme.parse``, in order."""
    seen: list[str] = []
    original = Scheme.parse.__func__

    def counting(cls, name):
        if not isinstance(name, Scheme):
            seen.append(str(name))
        return original(cls, name)

    monkeypatch.setattr(Scheme, "parse", classmethod(counting))
    return seen


@pytest.mark.parametrize("spec", ["droidspeak", "base_shared,base_lr_shared"])
def test_eval_path_parses_each_name_once(parses, spec):
    """eval: parse_schemes -> the command's policy factory opens MultiAgentSession -> Engine -> make_scheme (the
    SessionPolicy is handed the session opener and never sees the scheme; test_scheme_chain.py follows every file)."""
    from eval_suite.evaluate.executors import EpisodeTask
    from eval_suite.evaluate.run_eval import build_policy_factory

    model = tiny_multi_lora(seed=5)
    schemes = parse_schemes(spec)
    assert parses == spec.split(",") and all(isinstance(s, Scheme) for s in schemes)
    factory = build_policy_factory(model, None, temperature=0.0, top_p=1.0, use_kernel=False, droidspeak_layers=None)
    for s in schemes:
        policy = factory(EpisodeTask(key=(str(s), 0, "q"), scheme=s, seed=0, question=None, episode=None))
        assert "scheme" not in vars(policy)
        policy.reset()
        policy.session.append([3, 4, 5, 6])
        policy.session.step("plan", max_new_tokens=2)
        policy.session.step("action", max_new_tokens=2)
        assert policy.session.engine.scheme.scheme is s
    assert parses == spec.split(","), f"a scheme name was parsed again downstream: {parses}"


def test_session_command_parses_once(parses, tmp_path, monkeypatch):
    """session: the command's one Scheme.parse, then run() -> MultiAgentSession -> Engine -> make_scheme."""
    import eval_suite.evaluate.session_runner as sr

    model = tiny_multi_lora(seed=6)
    seen_scheme = []

    class Tok:  # the session runner tokenizes the question text: one id per character, in the tiny vocabulary
        eos_token_id = None

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [3 + ord(c) % 50 for c in text]}

        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(97 + i % 26) for i in ids)

    def fake_load(**kwargs):
        return model, Tok()

    monkeypatch.setattr(sr, "load_lora_model", fake_load)
    real_session = sr.MultiAgentSession

    def spy(*args, **kwargs):
        sess = real_session(*args, **kwargs)
        seen_scheme.append(sess.engine.scheme.scheme)
        return sess

    monkeypatch.setattr(sr, "MultiAgentSession", spy)
    rc = sr.session(scheme="full_shared", adapter_init="random", schedule="short", max_new_tokens=1, device="cpu",
                    out=str(tmp_path / "r.json"), quiet=True)  # fmt: skip
    assert rc in (0, None) and seen_scheme == [Scheme.FULL_SHARED]
    assert parses == ["full_shared"], f"--scheme parsed {len(parses)} times: {parses}"


def test_a_benchmarks_schemes_accept_all_a_comma_list_or_a_list() -> None:
    """bench decode / trace --schemes: unset -> the command's default, `all` -> the five in their order, a comma
    list or a list -> those, in the order given; an unknown name is refused naming the option and what is allowed."""
    from lragent.schemes import SCHEMES, resolve_schemes

    assert resolve_schemes(None, ["full_shared", "base_lr_shared"]) == [Scheme.FULL_SHARED, Scheme.BASE_LR_SHARED]
    assert [s.value for s in resolve_schemes("all", ["non_shared"])] == list(SCHEMES)
    assert resolve_schemes("base_lr_shared, non_shared", []) == [Scheme.BASE_LR_SHARED, Scheme.NON_SHARED]
    assert resolve_schemes(["droidspeak"], []) == [Scheme.DROIDSPEAK]
    with pytest.raises(ValueError, match=r"--schemes 'non_shared,bogus': unknown \['bogus'\]; allowed non_shared"):
        resolve_schemes(["non_shared", "bogus"], [])


def test_a_refused_scheme_names_the_option_the_spec_and_every_allowed_name() -> None:
    """The refusal is the user's only guide: it names the option it came from (``--scheme`` unless told,
    ``--schemes`` for a benchmark's), the spec as given, the unknown names (or ``nothing`` for an empty list) and
    every allowed name, comma-separated, in the order of SCHEMES."""
    from lragent.schemes import resolve_schemes

    allowed = "allowed non_shared, full_shared, droidspeak, base_shared, base_lr_shared"
    cases = [
        (lambda: parse_schemes("droidspeak,bad"), f"--scheme 'droidspeak,bad': unknown ['bad']; {allowed} or all"),
        (lambda: parse_schemes(" , "), f"--scheme ' , ': unknown nothing; {allowed} or all"),
        (lambda: parse_schemes("Non_Shared", "--x"), f"--x 'Non_Shared': unknown ['Non_Shared']; {allowed} or all"),
        (lambda: resolve_schemes("nope", ["non_shared"]), f"--schemes 'nope': unknown ['nope']; {allowed} or all"),
        (lambda: resolve_schemes("", ["non_shared"]), f"--schemes '': unknown nothing; {allowed} or all"),
        (lambda: Scheme.parse("shared"), f"unknown scheme 'shared': {allowed}"),
    ]  # fmt: skip
    for call, message in cases:
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == message


def test_a_scheme_formats_as_its_name_with_any_format_spec() -> None:
    """f-strings and format() give the scheme's name, and a format spec (width, alignment, precision) applies to the
    name as it would to the plain string."""
    for s in Scheme:
        assert f"{s}" == str(s) == format(s, "") == s.value
        assert f"{s:>16}" == f"{s.value:>16}" and f"{s:<16}|" == f"{s.value:<16}|"
    assert f"[{Scheme.DROIDSPEAK:^14}]" == "[  droidspeak  ]" and f"{Scheme.BASE_LR_SHARED:.4}" == "base"
