"""Provenance: the commit a result names when the checkout's ``.git`` cannot be trusted (a copy sent to a GPU)."""

from __future__ import annotations

import pytest

from lragent import provenance as prov


@pytest.mark.parametrize("var", ["LRAGENT_GIT_COMMIT", "LRAGENT_COMMIT"])
def test_commit_handed_over_in_the_environment_wins(monkeypatch, var: str) -> None:
    """The GPU machine's copy carried a stale ``.git`` (it named the session's first commit for code two commits
    later): a commit handed over by the sender, under either name, is the one recorded."""
    monkeypatch.delenv("LRAGENT_GIT_COMMIT", raising=False)
    monkeypatch.delenv("LRAGENT_COMMIT", raising=False)
    monkeypatch.setenv(var, "0123abc")
    monkeypatch.setenv("LRAGENT_GIT_DIRTY", "1")
    prov._git.cache_clear()
    try:
        rec = prov.provenance(device="cpu")
        assert rec["git_commit"] == "0123abc" and rec["git_dirty"] is True
    finally:
        prov._git.cache_clear()


def test_every_record_names_the_hash_of_the_code_that_ran() -> None:
    """A handed-over commit can be wrong (a call carried a stale ``.commit``); the record's ``source_hash`` is the
    ``sha256sum`` listing's hash of the tree's code (computed here with the shell tools, independently), the one
    ``bash scripts/gpu_tests.sh --hash`` prints, so a record can be matched to a commit; the footer shows it."""
    import subprocess

    def run(cmd: list[str]) -> str:
        return subprocess.run(cmd, cwd=prov.ROOT, capture_output=True, text=True, check=True).stdout.strip()

    prov.source_hash.cache_clear()
    rec = prov.provenance(device="cpu")
    reference = run(["bash", "-c", f"find {' '.join(prov.SOURCE_PATHS)} -name '*.py' -o -name '*.sh' | LC_ALL=C sort "
                                   "| xargs sha256sum | sha256sum | cut -c1-16"])  # fmt: skip
    assert rec["source_hash"] == reference and len(reference) == 16
    assert run(["bash", "scripts/gpu_tests.sh", "--hash"]) == reference
    assert f"source {reference}" in prov.provenance_footer(rec)


def test_the_source_hash_changes_with_any_source_file(tmp_path) -> None:
    """One byte more in one file, or one more file, gives another hash; other files do not count."""
    (tmp_path / "lragent").mkdir()
    (tmp_path / "lragent" / "a.py").write_text("x = 1\n")
    (tmp_path / "cli.py").write_text("")
    first = prov.source_hash.__wrapped__(tmp_path)
    (tmp_path / "lragent" / "notes.md").write_text("not code")
    assert prov.source_hash.__wrapped__(tmp_path) == first
    (tmp_path / "lragent" / "a.py").write_text("x = 1 \n")
    second = prov.source_hash.__wrapped__(tmp_path)
    (tmp_path / "lragent" / "b.sh").write_text("")
    assert len({first, second, prov.source_hash.__wrapped__(tmp_path)}) == 3


def test_a_record_names_the_switches_that_were_set(monkeypatch) -> None:
    """Two runs of one command line that differ by a kernel switch (``LRAGENT_PDL=0``) say so in their records and
    footers; unset or empty switches and other variables are left out."""
    from lragent.provenance import SWITCHES, provenance, provenance_footer, switches

    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LRAGENT_PDL", "0")
    monkeypatch.setenv("LRAGENT_DECODE_PLAN", "")
    monkeypatch.setenv("LRAGENT_NOT_A_SWITCH", "1")
    assert switches() == {"LRAGENT_PDL": "0"}
    both = {"LRAGENT_FUSED_GEMV": "2", "OMP_NUM_THREADS": "4"}
    assert switches({**both, "PATH": "/bin"}) == both
    cmd = "cli.py bench decode"
    prov = provenance(device="cpu", command=cmd)
    assert prov["switches"] == {"LRAGENT_PDL": "0"}
    assert f"Command: `LRAGENT_PDL=0 {cmd}`" in provenance_footer(prov)
    monkeypatch.delenv("LRAGENT_PDL")
    assert f"Command: `{cmd}`" in provenance_footer(provenance(device="cpu", command=cmd))


CPUINFO = (
    "processor\t: 0\nvendor_id\t: GenuineIntel\n"
    "model name\t: Intel(R) Xeon(R) CPU: rev:3 @ 2.10GHz\n"
    "processor\t: 1\nmodel name\t: another name\n"
)


def fake_cpuinfo(monkeypatch, path) -> None:
    """``/proc/cpuinfo`` read from ``path`` (a file that may not exist)."""
    from pathlib import Path

    monkeypatch.setattr(prov, "Path", lambda p, *a: path if str(p) == "/proc/cpuinfo" else Path(p, *a))


def fake_cuda(monkeypatch, available: bool) -> None:
    """Two GPUs named after their index, or none."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: f"Fake GPU {i}")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_the_cpu_is_named_by_the_first_model_name_line_of_cpuinfo_colons_and_all(monkeypatch, tmp_path) -> None:
    """The name is everything after the first colon of the first ``model name`` line, stripped."""
    (tmp_path / "cpuinfo").write_text(CPUINFO)
    fake_cpuinfo(monkeypatch, tmp_path / "cpuinfo")
    fake_cuda(monkeypatch, False)
    monkeypatch.setattr(prov.os, "cpu_count", lambda: 6)
    expected = {"type": "cpu", "name": "Intel(R) Xeon(R) CPU: rev:3 @ 2.10GHz", "count": 6}
    assert prov.device_description("cpu") == expected
    assert prov.device_description() == expected  # no GPU: the default is the CPU
    assert prov.device_description("cuda:0") == expected  # asked for CUDA where there is none


def test_without_a_readable_cpuinfo_the_cpu_is_named_by_the_processor_else_the_machine(monkeypatch, tmp_path) -> None:
    fake_cuda(monkeypatch, False)
    monkeypatch.setattr(prov.platform, "machine", lambda: "aarch64")
    (tmp_path / "no_model_name").write_text("processor\t: 0\nBogoMIPS\t: 50.00\n")
    for cpuinfo in (tmp_path / "missing", tmp_path / "no_model_name"):
        fake_cpuinfo(monkeypatch, cpuinfo)
        monkeypatch.setattr(prov.platform, "processor", lambda: "")
        assert prov.device_description("cpu")["name"] == "aarch64"
        monkeypatch.setattr(prov.platform, "processor", lambda: "arm")
        assert prov.device_description("cpu")["name"] == "arm"


def test_the_cpu_count_is_at_least_one_when_the_os_cannot_tell(monkeypatch) -> None:
    monkeypatch.setattr(prov.os, "cpu_count", lambda: None)
    assert prov.device_description("cpu")["count"] == 1


def test_on_cuda_the_record_names_the_first_gpu_and_the_gpu_count_whichever_index_was_asked(monkeypatch) -> None:
    """``cuda``, ``cuda:1`` and the default (CUDA when available) give one record; ``cpu`` stays the CPU."""
    fake_cuda(monkeypatch, True)
    gpu = {"type": "cuda", "name": "Fake GPU 0", "count": 2}
    assert prov.device_description("cuda") == gpu
    assert prov.device_description("cuda:1") == gpu
    assert prov.device_description() == gpu
    assert prov.device_description("cpu")["type"] == "cpu"
    assert prov.provenance(device="cpu", command="x")["device"]["type"] == "cpu"
    assert prov.provenance(device="cuda:1", command="x")["device"] == gpu


def test_a_record_has_the_documented_keys_versions_host_and_dtype_name(monkeypatch) -> None:
    """``dtype`` is recorded without its ``torch.`` prefix (None when not given); ``versions`` holds Python's and
    each tracked package's (None when not installed)."""
    import importlib.metadata
    import platform

    import torch

    def installed(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    rec = prov.provenance(device="cpu", command="x", dtype=torch.bfloat16)
    assert set(rec) == {
        "command", "device", "dtype", "versions", "git_commit", "git_dirty", "source_hash", "switches", "host", "utc"
    }  # fmt: skip
    assert rec["dtype"] == "bfloat16" and rec["device"] == prov.device_description("cpu")
    assert rec["versions"] == {"python": platform.python_version(), **{p: installed(p) for p in prov._PACKAGES}}
    assert rec["versions"]["torch"] == installed("torch") is not None
    assert rec["host"] == platform.node()
    assert prov.provenance(device="cpu", command="x", dtype="float16")["dtype"] == "float16"
    assert prov.provenance(device="cpu", command="x")["dtype"] is None


def test_the_record_time_is_utc_whatever_the_local_time_zone(monkeypatch) -> None:
    """In a zone 5 h 30 min east of UTC the record still says the UTC time, as ``YYYY-MM-DDTHH:MM:SSZ``."""
    import datetime as dt
    import os
    import time

    old = os.environ.get("TZ")
    os.environ["TZ"] = "IST-5:30"
    time.tzset()
    try:
        rec = prov.provenance(device="cpu", command="x")
    finally:
        if old is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = old
        time.tzset()
    stamp = dt.datetime.strptime(rec["utc"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    assert abs((dt.datetime.now(dt.timezone.utc) - stamp).total_seconds()) < 60, rec["utc"]


def test_the_default_command_is_the_running_commands_line(monkeypatch) -> None:
    """Inside :func:`lragent.command.run_command`, a record names the command line it parsed, quoted for a shell."""
    from lragent import command

    monkeypatch.setattr(command, "_COMMAND_LINE", [])
    seen: list[str] = []

    def evaluate(root: str = "runs") -> None:
        """Records its provenance.

        Args:
            root: where.
        """
        seen.append(prov.provenance(device="cpu")["command"])

    assert command.run_command(evaluate, ["--root", "two words"], "lragent eval") == 0
    assert seen == ["lragent eval --root 'two words'"]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["/opt/bin/lragent", "eval", "two words"], "lragent eval 'two words'"),
        (["prog"], "prog"),
        ([""], ""),
        ([], ""),
    ],
)
def test_outside_a_command_the_default_command_is_this_process_argv(monkeypatch, argv, expected) -> None:
    """The program's file name (not its folder) and its arguments, quoted; an empty ``sys.argv`` gives ``""``."""
    from lragent import command

    monkeypatch.setattr(command, "_COMMAND_LINE", [])
    monkeypatch.setattr(prov.sys, "argv", argv)
    assert prov.provenance(device="cpu")["command"] == expected


def test_a_command_given_as_words_is_joined_and_quoted_for_a_shell() -> None:
    assert prov.provenance(device="cpu", command=["cli.py", "eval", "--n", 3, "a b"])["command"] == (
        "cli.py eval --n 3 'a b'"
    )
    assert prov.provenance(device="cpu", command="cli.py eval 'a b'")["command"] == "cli.py eval 'a b'"


def test_the_footer_states_the_whole_record_in_two_lines() -> None:
    record = {
        "command": "cli.py eval --n 3",
        "device": {"type": "cuda", "name": "NVIDIA H100", "count": 1},
        "dtype": "bfloat16",
        "versions": {"python": "3.11.7", "torch": "2.3.0", "triton": None},
        "git_commit": "abc1234",
        "git_dirty": True,
        "source_hash": "0123456789abcdef",
        "switches": {"LRAGENT_PDL": "0", "OMP_NUM_THREADS": "1"},
        "host": "h",
        "utc": "2024-05-01T12:00:00Z",
    }
    assert prov.provenance_footer(record) == (
        "\n---\nProduced on NVIDIA H100 (cuda), dtype bfloat16, commit abc1234 (dirty), source 0123456789abcdef, "
        "2024-05-01T12:00:00Z; python 3.11.7, torch 2.3.0.  \n"
        "Command: `LRAGENT_PDL=0 OMP_NUM_THREADS=1 cli.py eval --n 3`\n"
    )
    clean = {**record, "git_dirty": False, "source_hash": None, "switches": {}}
    assert "commit abc1234, 2024-05-01T12:00:00Z;" in prov.provenance_footer(clean)


def test_a_footer_of_a_partial_record_shows_placeholders_never_none() -> None:
    """An older or partial record (no device, dtype, commit, time or command) still gives the two lines."""
    expected = "\n---\nProduced on ? (?), dtype n/a, commit unknown, ; .  \nCommand: ``\n"
    assert prov.provenance_footer({}) == expected
    nones = dict.fromkeys(("device", "dtype", "versions", "git_commit", "git_dirty", "source_hash", "switches"))
    assert prov.provenance_footer(nones) == expected
