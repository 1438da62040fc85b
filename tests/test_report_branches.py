"""Output paths the commands refuse before any work (eval_suite/report.py's check_writable), and the report's
``mean ± std`` and signed cells."""

from __future__ import annotations

import re

import pytest

from eval_suite.report import check_writable, fmt_mean_std, fmt_over_runs, fmt_signed
from lragent.cli_main import main


def test_a_file_output_that_is_a_directory_is_refused_and_the_directory_kept(tmp_path, capsys):
    out = tmp_path / "result.json"
    out.mkdir()
    (out / "kept.txt").write_text("x")
    assert main(["session", "--adapter_init", "zero", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out} is a directory; give a file path") and err.count("\n") == 1, err
    assert (out / "kept.txt").read_text() == "x"


def test_check_writable_makes_the_missing_directories_and_leaves_no_probe(tmp_path):
    out = tmp_path / "a" / "b" / "result.json"
    assert check_writable(out, is_dir=False) == out
    assert (tmp_path / "a" / "b").is_dir() and not out.exists()  # the parents made, not the file (nor a dir of it)
    assert list((tmp_path / "a" / "b").iterdir()) == []  # the probe removed
    assert check_writable(out, is_dir=False) == out  # parents that exist already are fine
    outdir = tmp_path / "c" / "d"
    assert check_writable(str(outdir), is_dir=True) == outdir
    assert outdir.is_dir() and list(outdir.iterdir()) == [] and list((tmp_path / "c").iterdir()) == [outdir]
    assert check_writable(outdir, is_dir=True) == outdir  # an existing directory is fine as a directory output


def test_check_writable_refuses_a_file_where_a_directory_goes(tmp_path):
    existing = tmp_path / "taken"
    existing.write_text("x")
    with pytest.raises(ValueError, match=rf"^--out {re.escape(str(existing))} is an existing file; give a directory$"):
        check_writable(existing, is_dir=True)
    with pytest.raises(ValueError) as err:
        check_writable(tmp_path, is_dir=False)
    assert str(err.value) == f"--out {tmp_path} is a directory; give a file path"
    blocked = existing / "result.json"  # its parent is a file: the mkdir fails with the OS's reason, named alone
    with pytest.raises(ValueError) as err:
        check_writable(blocked, is_dir=False)
    assert str(err.value) == f"--out {blocked} cannot be written: File exists"
    assert existing.read_text() == "x"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((0.4532, 0.0121), "45.3 ± 1.2"),
        ((0.4532, None), "45.3"),
        ((0.4532, float("nan")), "45.3"),
        ((None, 0.01), "–"),
        ((float("nan"), 0.01), "–"),
        ((1, 0), "100.0 ± 0.0"),
        ((0.4532, 0.0121, 1.0, 3), "0.453 ± 0.012"),
        ((2.5, 0.5, 10.0, 0), "25 ± 5"),
    ],
)
def test_fmt_mean_std(args, expected):
    assert fmt_mean_std(*args) == expected


@pytest.mark.parametrize(
    ("cell", "kwargs", "expected"),
    [
        ({"mean": 0.5, "std": 0.1, "runs": 3}, {}, "50.0 ± 10.0"),
        ({"mean": 0.5, "std": 0.1, "runs": 2}, {}, "50.0 ± 10.0"),
        ({"mean": 0.5, "std": 0.1, "runs": 1}, {}, "50.0"),  # one run: no spread shown
        ({"mean": 0.5, "std": 0.1, "runs": None}, {}, "50.0"),
        ({"mean": 0.5, "std": 0.1}, {}, "50.0"),
        ({"mean": 0.5, "runs": 3}, {}, "50.0"),
        ({"std": 0.1, "runs": 3}, {}, "–"),
        ({"mean": float("nan"), "std": 0.1, "runs": 3}, {}, "–"),
        ({"mean": 0.5, "std": 0.25, "runs": 4}, {"scale": 1.0, "digits": 3}, "0.500 ± 0.250"),
        ({"mean": 0.5, "std": 0.25, "runs": 1}, {"scale": 2.0, "digits": 0}, "1"),
    ],
)
def test_fmt_over_runs(cell, kwargs, expected):
    assert fmt_over_runs(cell, **kwargs) == expected


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((0.012,), "+1.2"),
        ((0.5,), "+50.0"),
        ((-0.004,), "-0.4"),
        ((0,), "+0.0"),
        ((None,), "–"),
        ((float("nan"),), "–"),
        ((0.5, 1.0, 2), "+0.50"),
        ((-3, 10.0, 0), "-30"),
    ],
)
def test_fmt_signed(args, expected):
    assert fmt_signed(*args) == expected
