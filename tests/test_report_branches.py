"""Output paths the commands refuse before any work (eval_suite/report.py's check_writable)."""

from __future__ import annotations

from lragent.cli_main import main


def test_a_file_output_that_is_a_directory_is_refused_and_the_directory_kept(tmp_path, capsys):
    out = tmp_path / "result.json"
    out.mkdir()
    (out / "kept.txt").write_text("x")
    assert main(["session", "--adapter_init", "zero", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out} is a directory; give a file path") and err.count("\n") == 1, err
    assert (out / "kept.txt").read_text() == "x"
