"""Role examples ``{"input", "output"}`` for multi-LoRA role training, as a LightningDataModule.

One file (or hub dataset split) per role. Every example is tokenised as ``input + output + EOS``; the loss is on the
output tokens and the EOS only. Inputs longer than ``max_length`` lose their *oldest* tokens (the left of the input),
so the whole output and the most recent context are kept. Each batch carries ``context_len``, the number of input
tokens of each example, so that the cache-sharing-aware loss can encode the context separately (with another role)
from the output, and ``prefix_len``, where the input's last prompt piece starts (the text the consumer prefills
itself at inference, after the previous agent's output).

Nothing is dropped silently: a broken record raises ``ValueError`` naming its file and line, an example whose output
alone does not fit ``max_length`` raises too.

Efficiency options (the embedded configs use both): ``pack_prefixes`` trains every example that is a prefix of a
longer example's context inside that longer sequence (:mod:`datamodules.prefix_packing`: exact, about 3x fewer
tokens on the bundled trajectories), and ``max_tokens`` forms batches by a padded-token budget instead of a fixed
example count. Every batch also carries the flat indices of its supervised positions (``loss_index``) so that the
model computes logits only there: the outputs are about 1% of the tokens.
"""

from __future__ import annotations

import gzip
import json
import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, Sampler

from datamodules.cross_role_prefixes import CROSS_ROLE_MIN_SHARE
from datamodules.prefix_packing import pack_prefix_chains
from datamodules.records import RoleRecord, TokenizedExample
from lragent.prompt_pieces import last_piece_start

IGNORE_INDEX = -100
LOCAL_SUFFIXES: tuple[str, ...] = (".json", ".jsonl", ".json.gz", ".jsonl.gz")


# ----------------------------------------------------------------------------------------------------------- reading


def is_local_spec(spec: str) -> bool:
    """Whether ``spec`` names a local file (by its suffix, or because it exists) rather than a hub dataset."""
    return spec.endswith(LOCAL_SUFFIXES) or Path(spec).exists()


def _check_record(obj: Any, source: str) -> RoleRecord:
    if not isinstance(obj, dict):
        raise ValueError(
            f"{source}: a record must be a JSON object with 'input' and 'output', got {type(obj).__name__}"
        )
    for key in ("input", "output"):
        if key not in obj:
            raise ValueError(f"{source}: record has no {key!r} field (fields: {sorted(obj)})")
        if not isinstance(obj[key], str):
            raise ValueError(f"{source}: {key!r} must be a string, got {type(obj[key]).__name__}")
        if not obj[key].strip():
            raise ValueError(f"{source}: {key!r} is empty")
    return RoleRecord(input=obj["input"], output=obj["output"], source=source)


def _read_text(path: Path) -> str:
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return f.read()
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, EOFError) as e:
        kind = "gzip-compressed UTF-8 text" if path.name.endswith(".gz") else "UTF-8 text"
        raise ValueError(f"{path}: cannot be read as {kind}: {e}") from e


def _records_from_json_array(text: str, path: Path) -> list[RoleRecord]:
    """Parses a JSON array element by element so that each record keeps its line number."""
    decoder = json.JSONDecoder()
    records: list[RoleRecord] = []

    def line_of(pos: int) -> int:
        return text.count("\n", 0, pos) + 1

    def skip_ws(pos: int) -> int:
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        return pos

    pos = skip_ws(text.index("[") + 1)
    if pos < len(text) and text[pos] == "]":
        return records
    while True:
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        records.append(_check_record(obj, f"{path}:{line_of(pos)}"))
        pos = skip_ws(end)
        if pos < len(text) and text[pos] == ",":
            pos = skip_ws(pos + 1)
            continue
        if pos < len(text) and text[pos] == "]":
            if skip_ws(pos + 1) != len(text):
                raise ValueError(f"{path}:{line_of(pos + 1)}: unexpected text after the JSON array")
            return records
        raise ValueError(f"{path}:{line_of(pos)}: not valid JSON (expected ',' or ']' in the array)")


def read_local_records(path: str | Path) -> list[RoleRecord]:
    """Reads role examples from a JSON array, JSON lines or gzip-compressed JSON lines file.

    The format is detected from the content: a file whose first non-blank character is ``[`` is a JSON array,
    anything else is JSON lines (blank lines are skipped).

    Raises:
        ValueError: the file does not exist, or a record is broken (names ``file:line``).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data file not found: {path}")
    text = _read_text(path)
    if text.lstrip().startswith("["):
        records = _records_from_json_array(text, path)
    else:
        records = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            records.append(_check_record(obj, f"{path}:{lineno}"))
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def read_hub_records(spec: str) -> list[RoleRecord]:
    """Reads role examples from a dataset through ``datasets.load_dataset``: ``"name"`` or ``"name:split"``.

    The split defaults to ``train``. ``datasets`` is imported only here.
    """
    name, _, split = spec.partition(":")
    split = split or "train"
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - datasets is a declared dependency
        raise ValueError(f"{spec}: reading a hub dataset needs the `datasets` package ({e})") from None
    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # noqa: BLE001 - any failure to load is a bad data spec
        first = (str(e).splitlines() or [""])[0]
        raise ValueError(f"data not found: {spec!r} is no local file and no loadable dataset ({first})") from None
    return [_check_record(row, f"{name}:{split} row {i}") for i, row in enumerate(ds)]


def read_records(spec: str | Path) -> list[RoleRecord]:
    """Reads role examples from a local file (see :func:`read_local_records`) or a hub dataset spec."""
    spec = str(spec)
    return read_local_records(spec) if is_local_spec(spec) else read_hub_records(spec)


# -------------------------------------------------------------------------------------------------------- tokenising


def special_token_layout(tokenizer: Any) -> tuple[int, int]:
    """How many special tokens the tokenizer adds before and after a text (e.g. ``(1, 0)`` for a BOS only)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    for lead in range(len(full) - len(plain) + 1):
        if full[lead : lead + len(plain)] == plain:
            return lead, len(full) - lead - len(plain)
    raise ValueError("cannot tell which special tokens the tokenizer adds around a text")


def tokenize_example(tokenizer: Any, record: RoleRecord, role_id: int, max_length: int) -> TokenizedExample:
    """Tokenises ``input + output + EOS``, cutting the input from the left (after any leading BOS) to fit.

    The input is tokenised with the special tokens the tokenizer puts in front (e.g. a BOS; trailing ones are left
    out since the output follows), the output without; the EOS is appended.

    Raises:
        ValueError: the output, its EOS and one context token do not fit ``max_length`` (names the record).
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; one is needed to end every output")
    keep_lead, trail = special_token_layout(tokenizer)
    piece = last_piece_start(record.input)
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(record.input, add_special_tokens=True, return_offsets_mapping=True)
        ctx = enc["input_ids"][: len(enc["input_ids"]) - trail]
        # Tokens that end before the piece starts (special tokens have empty offsets at 0).
        prefix = 0 if piece == 0 else sum(1 for _, end in enc["offset_mapping"][: len(ctx)] if end <= piece)
    else:
        ctx = tokenizer(record.input, add_special_tokens=True)["input_ids"]
        ctx = ctx[: len(ctx) - trail]
        prefix = 0 if piece == 0 else len(tokenizer(record.input[:piece], add_special_tokens=True)["input_ids"]) - trail
    out = tokenizer(record.output, add_special_tokens=False)["input_ids"] + [eos]
    budget = max_length - len(out)
    if budget < keep_lead + 1:
        raise ValueError(
            f"{record.source}: the output needs {len(out)} tokens (with EOS), which leaves no room for context in "
            f"max_length={max_length}; raise max_length"
        )
    if len(ctx) > budget:
        cut = len(ctx) - budget
        ctx = ctx[:keep_lead] + ctx[keep_lead + cut :]
        prefix = prefix - cut if prefix - cut > keep_lead else 0
    prefix = min(prefix, len(ctx) - 1)
    return TokenizedExample(
        input_ids=ctx + out, context_len=len(ctx), prefix_len=prefix, role_id=role_id, source=record.source
    )


FILLER_SOURCE = "<filler>"
"""``source`` of a filler example (:class:`RoleExampleDataset`): it scores nothing."""


class RoleExampleDataset(Dataset):
    """Tokenised role examples (a list of :class:`TokenizedExample`).

    Index ``len(self) + i`` is a *filler*: example ``i`` with no supervised token (its whole sequence counts as
    context, ``source`` is :data:`FILLER_SOURCE`). :class:`LengthBucketBatchSampler` hands one to a rank that has
    no real validation batch left, so that every rank runs the same number of steps (a forward under FSDP is a
    collective) while the loss sums see every real example exactly once.
    """

    def __init__(self, examples: Sequence[TokenizedExample]) -> None:
        self.examples = list(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> TokenizedExample:
        if i < len(self.examples):
            return self.examples[i]
        e = self.examples[i - len(self.examples)]
        return replace(e, context_len=len(e.input_ids), segments=(), source=FILLER_SOURCE)

    @property
    def lengths(self) -> list[int]:
        """Token count of every example."""
        return [len(e.input_ids) for e in self.examples]


def collate_examples(examples: Sequence[TokenizedExample], pad_id: int) -> dict[str, Any]:
    """Right-pads a list of examples into a batch.

    Returns:
        ``input_ids`` (B, T) long, right-padded with ``pad_id``; ``attention_mask`` (B, T) long, 1 on real tokens;
        ``labels`` (B, T) long, unshifted targets: ``labels[b, t]`` is the token position ``t - 1`` must predict,
        the output + EOS tokens of the example (and of its packed ``segments``) and ``-100`` elsewhere;
        ``loss_index`` (N,) long, the flat positions ``b * T + t - 1`` of the N supervised predictions in row-major
        order, and ``loss_targets`` (N,) long, their targets (so a model can compute logits only there);
        ``role_ids`` (B,) long; ``context_len`` (B,) long, input tokens of each example (output tokens are
        ``context_len <= t < lengths``); ``prefix_len`` (B,) long, leading tokens before the input's last prompt
        piece (what other agents put in the shared cache at inference); ``lengths`` (B,) long, real tokens of each
        example; ``n_tokens`` and ``n_examples`` (Python ints): real tokens and role examples in the batch (a filler
        example counts as none), known on the host without a device sync.
    """
    lengths = torch.tensor([len(e.input_ids) for e in examples], dtype=torch.long)
    b, t = len(examples), int(lengths.max())
    input_ids = torch.full((b, t), pad_id, dtype=torch.long)
    labels = torch.full((b, t), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((b, t), dtype=torch.long)
    for i, e in enumerate(examples):
        ids = torch.tensor(e.input_ids, dtype=torch.long)
        input_ids[i, : len(ids)] = ids
        attention_mask[i, : len(ids)] = 1
        labels[i, e.context_len : len(ids)] = ids[e.context_len :]
        for start, target in e.segments:
            labels[i, start : start + len(target)] = torch.tensor(target, dtype=torch.long)
    shifted = labels[:, 1:]
    sup = (shifted != IGNORE_INDEX).nonzero()  # (N, 2), row-major
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        "loss_index": sup[:, 0] * t + sup[:, 1],
        "loss_targets": shifted[sup[:, 0], sup[:, 1]],
        "role_ids": torch.tensor([e.role_id for e in examples], dtype=torch.long),
        "context_len": torch.tensor([e.context_len for e in examples], dtype=torch.long),
        "prefix_len": torch.tensor([e.prefix_len for e in examples], dtype=torch.long),
        "lengths": lengths,
        "n_tokens": int(lengths.sum()),
        "n_examples": sum(e.n_examples for e in examples if e.source != FILLER_SOURCE),
    }


class _Collator:
    """Picklable collate function (DataLoader workers)."""

    def __init__(self, pad_id: int, prefix_sources: bool = False) -> None:
        self.pad_id = pad_id
        self.prefix_sources = prefix_sources

    def __call__(self, examples: Sequence[TokenizedExample]) -> dict[str, Any]:
        batch = collate_examples(examples, self.pad_id)
        if self.prefix_sources:  # a list (stays on the host): which rows start with another row's whole example
            from datamodules.cross_role_prefixes import prefix_sources

            batch["prefix_sources"] = prefix_sources(examples)
        return batch


# ---------------------------------------------------------------------------------------------------------- batching


class LengthBucketBatchSampler(Sampler[list[int]]):
    """Batches of similar length, by example count or by a padded-token budget.

    **Fixed-size batches** (``max_tokens=None``): shuffle, cut into pools of ``pool_batches`` batches, sort each pool
    by length and cut it into batches of ``batch_size``; then shuffle the batches. A batch's padding is bounded by the
    length spread of neighbours in a sorted pool, so larger pools give less padding and less randomness.

    **Token-budget batches** (``max_tokens``): the examples are sorted by length once (longest first, ties by index)
    and cut greedily into batches whose padded size ``rows x longest`` stays within ``max_tokens`` (an example
    longer than the budget is a batch of its own; ``batch_size`` is not used). The composition is fixed for the run
    and only the order of the batches is drawn anew every epoch: the number of batches per epoch stays constant,
    which Lightning's epoch length and the learning-rate schedule assume, and padding is minimal.

    With ``shuffle`` the order is drawn from ``seed + epoch`` (call :meth:`set_epoch`; the sampler exposes itself as
    ``sampler`` so Lightning's per-epoch ``set_epoch`` reaches it). Without, batches are in descending length order
    (validation). With ``num_replicas > 1`` each rank takes every ``num_replicas``-th batch of the same global order:
    one optimizer step of ``num_replicas`` ranks sees the batches that one process with ``accumulate_grad_batches =
    num_replicas`` sees in one step (the same global batch). The count is equal on every rank (collectives need it):
    the batches left over are dropped, or, with ``fill``, every one of them is kept and the ranks short of a batch get
    a filler (validation: every example is scored once, on some rank).

    Args:
        lengths: token count of every example.
        batch_size: examples per batch (fixed-size mode).
        shuffle: draw a new order every epoch.
        seed: base seed of the order.
        pool_batches: batches per sorting pool (fixed-size mode; larger: less padding, less randomness).
        drop_last: drop a last, smaller batch (fixed-size mode).
        num_replicas: data-parallel world size.
        rank: this process's rank.
        max_tokens: padded-token budget per batch; ``None``: fixed-size batches.
        fill: keep the batches left over by ``num_replicas`` and give the ranks short of one a filler batch: the
            shortest example at index ``len(lengths) + i``, which :class:`RoleExampleDataset` returns unsupervised.
        groups: examples that must share a batch (e.g. :func:`~datamodules.cross_role_prefixes.cross_role_groups`),
            every index in exactly one group. A group is never split. The composition is then fixed for the run, as
            with ``max_tokens``: the groups are shuffled once (``seed``), sorted by length within pools and cut into
            batches of at most ``batch_size`` examples (or by ``max_tokens``); only the batch order changes per epoch.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        val_max_per_role: int | None = None,
        pool_batches: int = 50,
        drop_last: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
        max_tokens: int | None = None,
        fill: bool = False,
        groups: Sequence[Sequence[int]] | None = None,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        if pool_batches <= 0:
            raise ValueError(f"pool_batches must be > 0, got {pool_batches}")
        if max_tokens is not None and max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0 or null, got {max_tokens}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas={num_replicas}), got {rank}")
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.val_max_per_role = val_max_per_role
        self.pool_batches = pool_batches
        self.drop_last = drop_last
        self.num_replicas = num_replicas
        self.rank = rank
        self.max_tokens = max_tokens
        self.fill = fill
        self.epoch = 0
        self.sampler = self
        if groups is not None:
            flat = sorted(i for g in groups for i in g)
            if flat != list(range(len(self.lengths))) or any(not g for g in groups):
                raise ValueError(f"groups must hold every example index 0..{len(self.lengths) - 1} exactly once")
            if max_tokens is None and batch_size < max(len(g) for g in groups):
                raise ValueError(
                    f"batch_size {batch_size} is smaller than a group of {max(len(g) for g in groups)} examples"
                )
            if drop_last:
                raise ValueError("drop_last is not supported with groups (their batches differ in size)")
            self._budget_batches = self._grouped_batches([list(g) for g in groups])
        else:
            singles = [[i] for i in range(len(self.lengths))]
            self._budget_batches = self._token_budget_batches(singles) if max_tokens is not None else None

    def set_epoch(self, epoch: int) -> None:
        """Selects the order of ``epoch``."""
        self.epoch = epoch

    def _token_budget_batches(self, groups: list[list[int]]) -> list[list[int]]:
        """Greedy batches within ``max_tokens`` of groups (single examples: ``[[i] ...]``), longest group first."""
        longest_of = [max(self.lengths[i] for i in g) for g in groups]
        order = sorted(range(len(groups)), key=lambda n: (-longest_of[n], groups[n][0]))
        batches: list[list[int]] = []
        longest = 0
        for n in order:  # sorted longest first: a batch's first group sets its padded length
            if batches and (len(batches[-1]) + len(groups[n])) * longest <= self.max_tokens:
                batches[-1] += groups[n]
            else:
                batches.append(list(groups[n]))
                longest = longest_of[n]
        return batches

    def _grouped_batches(self, groups: list[list[int]]) -> list[list[int]]:
        """A fixed composition that keeps every group in one batch (``groups`` in the class docstring)."""
        if self.max_tokens is not None:
            return self._token_budget_batches(groups)
        size = {id(g): max(self.lengths[i] for i in g) for g in groups}
        g = torch.Generator().manual_seed(self.seed)
        order = [groups[i] for i in torch.randperm(len(groups), generator=g).tolist()]
        pool = self.batch_size * self.pool_batches
        batches, start = [], 0
        while start < len(order):
            chunk, n = [], 0
            while start < len(order) and n < pool:
                chunk.append(order[start])
                n += len(order[start])
                start += 1
            batches.append([])
            for grp in sorted(chunk, key=lambda x: -size[id(x)]):
                if len(batches[-1]) + len(grp) > self.batch_size:
                    batches.append([])
                batches[-1] += grp
        return batches

    def _global_batches(self) -> list[list[int]]:
        n = len(self.lengths)
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        if self._budget_batches is not None:
            batches = [list(b) for b in self._budget_batches]
            if self.shuffle:
                batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
            return batches
        if not self.shuffle:
            order = sorted(range(n), key=lambda i: -self.lengths[i])
            batches = [order[i : i + self.batch_size] for i in range(0, n, self.batch_size)]
        else:
            perm = torch.randperm(n, generator=g).tolist()
            pool = self.batch_size * self.pool_batches
            batches = []
            for start in range(0, n, pool):
                chunk = sorted(perm[start : start + pool], key=lambda i: -self.lengths[i])
                batches += [chunk[i : i + self.batch_size] for i in range(0, len(chunk), self.batch_size)]
            batches = [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
        if self.drop_last:
            batches = [b for b in batches if len(b) == self.batch_size]
        return batches

    def _per_rank(self, total: int) -> int:
        return -(-total // self.num_replicas) if self.fill else total // self.num_replicas

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._global_batches()
        mine = batches[self.rank :: self.num_replicas]
        per_rank = self._per_rank(len(batches))
        if len(mine) < per_rank:  # fill: a filler batch (the shortest example, unsupervised)
            n = len(self.lengths)
            mine.append([n + min(range(n), key=lambda i: (self.lengths[i], i))])
        yield from mine[:per_rank]

    def __len__(self) -> int:
        if self._budget_batches is not None:
            total = len(self._budget_batches)
        else:
            n, bs = len(self.lengths), self.batch_size
            pool = bs * self.pool_batches
            # Pools are sorted and cut independently, so count the batches of every pool.
            sizes = [min(pool, n - s) for s in range(0, n, pool)] if self.shuffle else [n]
            total = sum(m // bs if self.drop_last else math.ceil(m / bs) for m in sizes)
        return self._per_rank(total)

    def padding_fraction(self) -> float:
        """Share of the padded tokens (``sum(rows x longest)``) of one epoch that are padding."""
        padded = real = 0
        for batch in self._global_batches():
            lens = [self.lengths[i] for i in batch]
            padded += len(lens) * max(lens)
            real += sum(lens)
        return 1 - real / padded if padded else 0.0


# ----------------------------------------------------------------------------------------------------- data module


def split_indices(n: int, val_fraction: float, seed: int, role: str) -> tuple[list[int], list[int]]:
    """Seeded train/validation split of ``range(n)`` for one role.

    The validation part has ``round(val_fraction * n)`` examples (at least 1 when ``val_fraction > 0``), and at least
    one example stays for training. The draw depends on ``seed`` and the role name only.

    Returns:
        ``(train_indices, val_indices)``, both sorted.
    """
    if val_fraction <= 0:
        return list(range(n)), []
    n_val = min(max(1, round(val_fraction * n)), n - 1)
    perm = list(range(n))
    random.Random(f"{seed}:{role}").shuffle(perm)
    return sorted(perm[n_val:]), sorted(perm[:n_val])


def resolve_tokenizer(tokenizer: Any) -> Any:
    """Returns ``tokenizer`` itself, or loads the tokenizer named by a string.

    Names: ``byte`` (:func:`~datamodules.tiny_tokenizer.byte_tokenizer`, offline), ``default`` /
    ``smollm2-135m-instruct`` (the embedded model's), any hub name or local directory (``AutoTokenizer``).

    Raises:
        ValueError: the name is a random architecture of :mod:`lragent.models` (it has no tokenizer).
    """
    if not isinstance(tokenizer, str):
        return tokenizer
    if tokenizer == "byte":
        from datamodules.tiny_tokenizer import byte_tokenizer

        return byte_tokenizer()
    from lragent.models import load_tokenizer

    return load_tokenizer(tokenizer)


class RoleExampleDataModule(LightningDataModule):
    """Role examples, one file or hub split per role, tokenised and batched by length.

    Args:
        data_files: role -> data spec: a local ``.json`` (array), ``.jsonl`` or ``.jsonl.gz`` path, or a hub dataset
            ``name`` / ``name:split`` read with ``datasets``. Example:
            ``{"plan": "data/trajectories/hotpotqa/plan.jsonl.gz", ...}``.
        roles: role names in adapter order (role id = position). Every key of ``data_files`` must be one of them
            and every role needs data. ``None``: the keys of ``data_files`` in order.
        tokenizer: name of the tokenizer to load (a model name: ``default`` is the embedded SmolLM2's; ``byte``: the
            offline byte tokenizer) or a tokenizer object. Linked to the model's tokenizer by the CLI.
        max_length: most tokens per example (context + output + EOS); the context is cut from the left.
        batch_size: examples per batch (per device; accumulate gradients in the Trainer for larger batches).
        val_fraction: share of each role's examples held out for validation, in ``[0, 1)``.
        seed: seed of the train/validation split and of the batch order.
        val_max_per_role: validate on at most this many held-out examples of each role (the lowest-numbered ones;
            the others stay held out, unused); ``None``: all of them. For quick runs.
        pool_batches: batches per length-sorting pool of the training order (fixed-size batches).
        num_workers: DataLoader worker processes.
        pack_prefixes: train each example that is a prefix of a longer example's context (same role) inside that
            sequence (:mod:`datamodules.prefix_packing`; exact, far fewer tokens). Training set only, plain loss
            only (``model.lambda_shared`` must be 0); validation examples stay one per sequence.
        max_tokens: form batches by this padded-token budget (``rows x longest <= max_tokens``) instead of
            ``batch_size`` examples, for training and validation; see :class:`LengthBucketBatchSampler`.
        pin_memory: page-locked batches, so that the copy to the GPU does not synchronise the host; ``None``: when
            CUDA is available.
        option_variants: for multiple-choice data (ScienceQA), add to the *training* set, for every trajectory, a
            variant with each of these option counts (e.g. ``[2, 3]``): distractors dropped, gold letters balanced,
            every ``Finish`` letter re-lettered (:mod:`datamodules.option_variants`). Validation stays as read.
            ``None``: the data as read.
        answer_thoughts: for multiple-choice data, every training thought that is followed by ``Finish[X]`` also
            names option X's text (``... So the answer is <text>.``), applied after the option-count variants
            (:mod:`datamodules.answer_thoughts`). Validation stays as read.
        cross_role_batches: keep each training example in one batch with the example of another role whose whole
            text starts its context, in chains of up to ``batch_size`` examples (4 with ``max_tokens``;
            :func:`~datamodules.cross_role_prefixes.cross_role_groups`), and list such rows in every batch
            (``prefix_sources``). With ``model.lambda_shared`` in (0, 1) and ``lambda_mode:
            weight``, the module then scores such an example's plain term inside the shared pass that starts with
            it, when its role is the drawn producer (``model.producer: prefix`` makes it the producer): exact, one
            sequence fewer in the plain pass. The batch composition is fixed for the run.
        cross_role_min_share: with ``cross_role_batches``, link an example to its source only if the chain's shortest
            example has at least this share of its longest's tokens (a chain is padded to its longest, and padding a
            short source to a long consumer can cost more than absorbing it saves); 0 links every pair. The default
            is the share that made a λ 0.5 epoch cheapest against a λ 0 epoch on ordinary batches in the fitted
            step-time model (``scripts/cross_role_cost_model.py`` at commit d89e4ca, ``results/prefix_reuse/``).
    """

    def __init__(
        self,
        data_files: dict[str, str],
        roles: list[str] | None = None,
        tokenizer: Any = "default",
        max_length: int = 1024,
        batch_size: int = 4,
        val_fraction: float = 0.05,
        seed: int = 0,
        val_max_per_role: int | None = None,
        pool_batches: int = 50,
        num_workers: int = 0,
        pack_prefixes: bool = False,
        max_tokens: int | None = None,
        pin_memory: bool | None = None,
        option_variants: list[int] | None = None,
        answer_thoughts: bool = False,
        cross_role_batches: bool = False,
        cross_role_min_share: float = CROSS_ROLE_MIN_SHARE,
    ) -> None:
        super().__init__()
        if not data_files:
            raise ValueError("data_files: give one data file per role, got none")
        roles = list(data_files) if roles is None else list(roles)
        for role in data_files:
            if role not in roles:
                raise ValueError(f"unknown role {role!r} in data_files: roles are {', '.join(roles)}")
        missing = [r for r in roles if r not in data_files]
        if missing:
            raise ValueError(f"no data file for role {missing[0]!r}: data_files has {', '.join(data_files)}")
        for role, spec in data_files.items():
            if not isinstance(spec, str | Path) or not str(spec):
                raise ValueError(f"data_files[{role!r}] must be a path or dataset name, got {spec!r}")
            if str(spec).endswith(LOCAL_SUFFIXES) and not Path(spec).is_file():
                raise ValueError(f"data file not found: {spec}")
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {max_length}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        if val_max_per_role is not None and val_max_per_role <= 0:
            raise ValueError(f"val_max_per_role must be > 0 or null, got {val_max_per_role}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if max_tokens is not None and max_tokens < max_length:
            raise ValueError(f"max_tokens must be >= max_length ({max_length}) or null, got {max_tokens}")
        if option_variants is not None:
            bad = [k for k in option_variants if not isinstance(k, int) or isinstance(k, bool) or not 2 <= k <= 10]
            if bad or not option_variants:
                raise ValueError(
                    f"option_variants must be a non-empty list of option counts in 2..10, got {option_variants}"
                )
        if not 0.0 <= cross_role_min_share <= 1.0:
            raise ValueError(f"cross_role_min_share must be in [0, 1], got {cross_role_min_share}")
        if cross_role_batches and pack_prefixes:
            raise ValueError(
                "cross_role_batches and pack_prefixes cannot be combined: cross-role batches serve the "
                "cache-sharing loss, which needs one example per sequence (set data.pack_prefixes false)"
            )
        self.save_hyperparameters(ignore=[] if isinstance(tokenizer, str) else ["tokenizer"])
        self.cross_role_batches = bool(cross_role_batches)
        self.cross_role_min_share = float(cross_role_min_share)
        self.train_groups: list[list[int]] | None = None
        self.data_files = {r: str(data_files[r]) for r in roles}
        self.roles = roles
        self._tokenizer_spec = tokenizer
        self._tokenizer: Any = None
        self.max_length = max_length
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.val_max_per_role = val_max_per_role
        self.pool_batches = pool_batches
        self.num_workers = num_workers
        self.pack_prefixes = pack_prefixes
        self.max_tokens = max_tokens
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.option_variants = list(option_variants) if option_variants else None
        self.variant_stats: dict[str, int] = {}
        self.answer_thoughts = bool(answer_thoughts)
        self.answer_thought_stats: dict[str, int] = {}
        self.train_set: RoleExampleDataset | None = None
        self.val_set: RoleExampleDataset | None = None

    @property
    def tokenizer(self) -> Any:
        """The tokenizer (loaded on first use)."""
        if self._tokenizer is None:
            self._tokenizer = resolve_tokenizer(self._tokenizer_spec)
        return self._tokenizer

    @property
    def pad_id(self) -> int:
        """Padding id: the tokenizer's pad token, else its EOS."""
        tok = self.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def setup(self, stage: str | None = None) -> None:
        """Reads, checks, splits and tokenises every role's data (once)."""
        if self.train_set is not None:
            return
        train_records: dict[str, list[RoleRecord]] = {}
        val_records: dict[str, list[RoleRecord]] = {}
        for role in self.roles:
            records = read_records(self.data_files[role])
            tr_idx, va_idx = split_indices(len(records), self.val_fraction, self.seed, role)
            train_records[role] = [records[i] for i in tr_idx]
            val_records[role] = [records[i] for i in va_idx[: self.val_max_per_role]]
        if self.option_variants:
            from datamodules.option_variants import option_count_variants

            train_records, self.variant_stats = option_count_variants(train_records, self.option_variants, self.seed)
        if self.answer_thoughts:
            from datamodules.answer_thoughts import add_answer_thoughts

            train_records, self.answer_thought_stats = add_answer_thoughts(train_records)
        train, val = [], []
        for role_id, role in enumerate(self.roles):
            train += [tokenize_example(self.tokenizer, rec, role_id, self.max_length) for rec in train_records[role]]
            val += [tokenize_example(self.tokenizer, rec, role_id, self.max_length) for rec in val_records[role]]
        if self.pack_prefixes:
            train = pack_prefix_chains(train)
        if self.cross_role_batches:
            from datamodules.cross_role_prefixes import cross_role_groups

            # chains up to a batch (a token-budget batch: 4, the longest chains in the bundled data)
            self.train_groups = cross_role_groups(
                train, self.batch_size if self.max_tokens is None else 4, self.cross_role_min_share
            )
        self.train_set, self.val_set = RoleExampleDataset(train), RoleExampleDataset(val)

    def _loader(self, dataset: RoleExampleDataset, shuffle: bool) -> DataLoader:
        trainer = getattr(self, "trainer", None)
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        connector = getattr(trainer, "_accelerator_connector", None)
        if world > 1 and getattr(connector, "use_distributed_sampler", False):
            # Lightning would rebuild our batch sampler around a DistributedSampler (as if it were its `lengths`)
            raise ValueError(
                "trainer.use_distributed_sampler must be false with several processes: the data module shards its "
                "length-bucketed batches by rank itself (add --config configs/ddp.yaml, or "
                "--trainer.use_distributed_sampler false)"
            )
        sampler = LengthBucketBatchSampler(
            dataset.lengths,
            self.batch_size,
            shuffle=shuffle,
            seed=self.seed,
            pool_batches=self.pool_batches,
            num_replicas=world,
            rank=rank,
            max_tokens=self.max_tokens,
            fill=not shuffle,
            groups=self.train_groups if shuffle else None,
        )
        return DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=_Collator(self.pad_id, prefix_sources=shuffle and self.cross_role_batches),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=self.pin_memory,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled, length-bucketed training batches (new order every epoch)."""
        self.setup("fit")
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Held-out batches of every role, longest first (with several processes: every batch on some rank, and
        a filler on the ranks short of one)."""
        self.setup("validate")
        return self._loader(self.val_set, shuffle=False)

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run must match: the roles and the split."""
        return {"roles": list(self.roles), "seed": self.seed, "val_fraction": self.val_fraction}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Refuses to resume with other roles (their ids would change meaning)."""
        if list(state_dict.get("roles", self.roles)) != list(self.roles):
            raise ValueError(f"the checkpoint was trained with roles {state_dict['roles']}, this run has {self.roles}")
