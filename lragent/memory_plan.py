"""Device memory a batch of episodes needs, computed from the model's config before anything heavy is loaded.

``eval --batch N`` allocates one static cache pool of ``N`` episodes (:mod:`lragent.static_cache`) next to the
model. What that costs is known from shapes alone, so a command can refuse a batch that does not fit with one line
(before minutes of model loading end in an out-of-memory traceback), or pick the largest batch that fits
(``--batch auto``). The need of ``b`` episodes under a scheme is

- **caches**: the pool the engine allocates, exactly (:meth:`~lragent.static_cache.PoolLayout.allocated_bytes`):
  ``capacity x layers x (K and V: (kv slots + 1) x H_kv x D  +  V_lr: (lr slots + 1) x r  +  DroidSpeak's hidden
  states: (b + 1) x hidden per recompute group)`` elements, the ``+ 1`` being each pool's scratch slot; kv slots
  are ``b x roles`` for ``non_shared``, else ``b``; lr slots ``b x roles`` for ``base_shared``, ``b`` for
  ``base_lr_shared``;
- **decode state**: per row the generated-token buffer (capacity int64), the stop mask (vocab bool) and the pending
  logits (vocab fp32);
- **model**: every parameter of the base model and of the adapters (q_proj and v_proj, one A or one per role, one B
  per role) at the compute dtype; fusing q/k/v and gate/up rebinds the same storage (no extra bytes);
- **workspace**, a margin whose terms are written out in :func:`plan_memory`: one decode step's temporaries per row
  (logits in the model dtype and fp32, the sampling buffers: sort, cumulative sum, int64 noise), held twice (the
  eager warm-up's memory and the CUDA graphs' private pool); the prefill of one chunk as long as the capacity
  (``non_shared`` prefills everything a role has not seen); and a fixed 768 MiB plus 3 % for what the shapes do not
  say: cuBLAS/cuBLASLt workspaces (up to 32 MiB per stream on Hopper, three streams), cuDNN attention workspaces,
  the Triton kernels' split-K partials and the caching allocator's rounding and fragmentation.

The figures are an upper bound of the steady state, not a measurement; the GPU check script measures the real peak
next to them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lragent.command import first_line
from lragent.device_share import device_index, meminfo_bytes, memory_budget
from lragent.sharing import make_scheme

if TYPE_CHECKING:
    from transformers import PretrainedConfig

GIB = 1 << 30
FIXED_MARGIN = 768 << 20
MARGIN_FRACTION = 0.03
MAX_AUTO_BATCH = 256  # the largest decode-graph bucket of the engine


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a LLaMA-style decoder that memory depends on (from its config)."""

    n_layers: int
    hidden: int
    intermediate: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    o_bias: bool = False  # LLaMA's attention_bias covers o_proj too; Qwen2's q/k/v biases do not
    mlp_bias: bool = False  # LLaMA's mlp_bias: gate, up and down projections

    @classmethod
    def from_config(cls, config: object) -> ModelShape:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            n_layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            n_heads=heads,
            n_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab=config.vocab_size,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            o_bias=config.model_type != "qwen2" and bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )

    def base_params(self) -> int:
        """Parameters of the base model."""
        h, d = self.hidden, self.head_dim
        q_out, kv_out = self.n_heads * d, self.n_kv_heads * d
        per_layer = h * (q_out + 2 * kv_out) + q_out * h + 3 * h * self.intermediate + 2 * h
        if self.qkv_bias:
            per_layer += q_out + 2 * kv_out
        if self.o_bias:
            per_layer += h
        if self.mlp_bias:
            per_layer += 2 * self.intermediate + h
        return self.vocab * h * (1 if self.tied else 2) + self.n_layers * per_layer + h

    def adapter_params(self, rank: int, n_roles: int, shared_a: bool = True) -> int:
        """Parameters of the multi-LoRA adapters on q_proj and v_proj."""
        n_a = 1 if shared_a else n_roles
        q_out, kv_out = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        per_layer = sum(n_a * rank * self.hidden + n_roles * out * rank for out in (q_out, kv_out))
        return self.n_layers * per_layer


def model_config(name: str) -> PretrainedConfig:
    """The config of model ``name`` as :func:`lragent.models.load_model` would load it, without its weights.

    Raises:
        ValueError: the config cannot be read (as ``load_model`` would say).
    """
    from transformers import AutoConfig

    from lragent import accuracy_model
    from lragent.models import EMBEDDED_NAMES, NAMED_ARCHITECTURES

    key = name.lower()
    if key in EMBEDDED_NAMES:
        key = "smollm2-135m"  # the embedded GGUF is SmolLM2-135M-Instruct: the same architecture
    fields = accuracy_model.ARCHITECTURE if key in accuracy_model.NAMES else NAMED_ARCHITECTURES.get(key)
    if fields is not None:
        fields = dict(fields)  # a copy: model_type is popped
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as exc:
        raise ValueError(f"could not read the config of model {name!r} ({first_line(exc)})") from None


def model_shape(name: str) -> ModelShape:
    """The shape of model ``name`` as :func:`lragent.models.load_model` would load it, from its config only.

    Raises:
        ValueError: the config cannot be read (as ``load_model`` would say).
    """
    return ModelShape.from_config(model_config(name))


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes ``batch`` episodes of ``capacity`` positions need under ``scheme`` (see the module docstring)."""

    scheme: str
    batch: int
    capacity: int
    cache_bytes: int
    state_bytes: int
    model_bytes: int
    workspace_bytes: int

    @property
    def total(self) -> int:
        return self.cache_bytes + self.state_bytes + self.model_bytes + self.workspace_bytes

    def describe(self) -> str:
        return (
            f"{self.scheme}: caches {self.cache_bytes / GIB:.2f} GiB for {self.batch} episode(s) x {self.capacity} "
            f"positions, model {self.model_bytes / GIB:.2f} GiB, decode state and workspace "
            f"{(self.state_bytes + self.workspace_bytes) / GIB:.2f} GiB"
        )


def plan_memory(
    shape: ModelShape,
    scheme: str,
    batch: int,
    capacity: int,
    *,
    element_size: int,
    rank: int = 8,
    n_roles: int = 3,
    shared_a: bool = True,
    droidspeak_layers: Sequence[int] | None = None,
) -> MemoryPlan:
    """The :class:`MemoryPlan` of ``batch`` episodes (rows) of ``capacity`` positions under ``scheme``.

    Args:
        shape: the model's sizes.
        scheme: sharing scheme name.
        batch: rows of the engine.
        capacity: positions per row.
        element_size: bytes per element of the compute dtype (2 for bf16/fp16, 4 for fp32).
        rank: LoRA rank (the width of V_lr).
        n_roles: roles (adapters).
        shared_a: one A for all roles.
        droidspeak_layers: DroidSpeak's recompute layers (default as the engine's).
    """
    if batch < 1 or capacity < 1:
        raise ValueError(f"batch and capacity must be >= 1, got {batch} and {capacity}")
    sch = make_scheme(
        scheme, n_roles, batch, shared_a=shared_a, n_layers=shape.n_layers, droidspeak_layers=droidspeak_layers
    )
    layout = sch.layout(shape.n_kv_heads, shape.head_dim, rank, shape.hidden)
    cache = layout.allocated_bytes(capacity, element_size)
    state = batch * (8 * capacity + shape.vocab * (1 + 4) + 12 * 8) + shape.vocab
    model = (shape.base_params() + shape.adapter_params(rank, n_roles, shared_a)) * element_size
    # one decode step per row: logits (model dtype + fp32), sampling (fp32 probs/sorted/cumsum/scaled/gumbel, int64
    # order and noise temporaries, bool masks) ~ 60 bytes per vocabulary entry; layer activations (hidden and MLP)
    step_row = shape.vocab * (element_size + 60) + (12 * shape.hidden + 3 * shape.intermediate) * element_size
    # prefill of one chunk of `capacity` tokens: hidden states and norms, q/k/v, the MLP's three intermediates. It also
    # covers a decode step with extra rows for fed tokens (the engine's feed_budget: batch + budget token rows' layer
    # activations, at another moment than a prefill) while batch + budget <= capacity
    q_kv = (shape.n_heads + 2 * shape.n_kv_heads) * shape.head_dim
    prefill = capacity * (8 * shape.hidden + q_kv + 3 * shape.intermediate) * element_size
    workspace = 2 * batch * step_row + prefill + FIXED_MARGIN
    workspace += int(MARGIN_FRACTION * (cache + state + model + workspace))
    return MemoryPlan(sch.scheme.value, batch, capacity, cache, state, model, workspace)


def free_memory(device: str | torch.device) -> int | None:
    """Bytes free on ``device`` now (CUDA: the driver's figure; CPU: ``MemAvailable``), or ``None`` if unknown."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.mem_get_info(device_index(dev))[0])
    return meminfo_bytes("MemAvailable")


def choose_batch(
    model: str,
    schemes: Sequence[str],
    batch: int | str,
    capacity: int,
    *,
    dtype: str | torch.dtype,
    device: str | torch.device,
    rank: int = 8,
    n_roles: int = 3,
    shared_a: bool = True,
    droidspeak_layers: Sequence[int] | None = None,
    max_batch: int = MAX_AUTO_BATCH,
    option: str = "--batch",
    auto_ok: bool = True,
    extra_bytes: int = 0,
    memory_fraction: float | None = None,
    model_loaded: bool = False,
    concurrent: bool = False,
) -> int:
    """The batch to run: ``batch`` itself if every scheme's plan fits in the free memory of ``device``, the largest
    batch (at most ``max_batch``) that fits when ``batch`` is ``"auto"``.

    Schemes run one at a time (one engine alive), so the largest plan must fit; with ``concurrent`` every scheme has its
    engine of ``batch`` rows at once (the model once), so their caches and workspaces add up. Where the free memory is
    unknown ``batch`` is returned as given (``auto``: ``max_batch``). ``option`` names the option in the messages
    (``auto_ok``: whether it takes ``auto``); ``extra_bytes`` is memory the command needs next to the model at another
    time than the engine (e.g. a baseline run before it): the need is then the model plus the larger of the two.
    ``memory_fraction`` limits what this process may take to that share of the device's total memory, less what it
    already holds (:func:`lragent.device_share.memory_budget`); ``model_loaded``: the model is already on the device
    (its bytes are in use, not free), so the plan leaves it out: the batch is sized against what is free when the caches
    are allocated.

    Raises:
        ValueError: one line naming the need and what is free, when the batch (or, for ``auto``, one episode) does
            not fit.
    """
    from lragent.models import check_device, parse_dtype

    device = check_device(device)  # one line for a bogus device, before anything else
    if isinstance(batch, str) and batch != "auto":
        raise ValueError(f"{option} {batch!r} invalid: allowed a positive integer or auto")
    if not isinstance(batch, str) and batch < 1:
        raise ValueError(f"{option} must be >= 1 or auto, got {batch}")
    element_size = torch.empty((), dtype=parse_dtype(dtype)).element_size()
    shape = model_shape(model)
    free = memory_budget(free_memory(device), device, memory_fraction)

    def worst(b: int) -> MemoryPlan:
        plans = [
            plan_memory(
                shape, s, b, capacity, element_size=element_size, rank=rank, n_roles=n_roles, shared_a=shared_a,
                droidspeak_layers=droidspeak_layers if s == "droidspeak" else None,
            )
            for s in schemes
        ]  # fmt: skip
        worst = max(plans, key=lambda p: p.total)
        if concurrent and len(plans) > 1:
            worst = dataclasses.replace(
                worst,
                scheme="+".join(p.scheme for p in plans),
                cache_bytes=sum(p.cache_bytes for p in plans),
                state_bytes=sum(p.state_bytes for p in plans),
                workspace_bytes=sum(p.workspace_bytes for p in plans),
            )
        if model_loaded:
            worst = dataclasses.replace(worst, model_bytes=0)
        beside_model = worst.total - worst.model_bytes
        if extra_bytes <= beside_model:
            return worst
        return dataclasses.replace(worst, workspace_bytes=worst.workspace_bytes + extra_bytes - beside_model)

    if free is None:
        return max_batch if batch == "auto" else batch
    where = f"on {torch.device(device)}"
    is_free = (
        "is free" if memory_fraction is None else f"is this process's to take (--memory_fraction {memory_fraction:g})"
    )
    if batch != "auto":
        plan = worst(batch)
        if plan.total > free:
            fit = _largest_fitting(worst, free, batch - 1)
            allowed = f"{option} <= {fit}" + (f" or {option} auto" if auto_ok else "")
            allowed = allowed if fit else f"fewer positions per episode than {capacity}"
            raise ValueError(
                f"{option} {batch} needs {plan.total / GIB:.2f} GiB {where} ({plan.describe()}) but "
                f"{free / GIB:.2f} GiB {is_free}: allowed {allowed}"
            )
        return batch
    fit = _largest_fitting(worst, free, max_batch)
    if fit == 0:
        plan = worst(1)
        raise ValueError(
            f"{option} auto: even one episode needs {plan.total / GIB:.2f} GiB {where} ({plan.describe()}) but "
            f"{free / GIB:.2f} GiB {is_free}: allowed fewer positions per episode than {capacity}, a larger "
            "--memory_fraction or another device"
        )
    return fit


def _largest_fitting(worst, free: int, upper: int) -> int:
    """The largest b in [0, upper] with worst(b).total <= free (0: none); the need grows with b."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if worst(mid).total <= free:
            lo = mid
        else:
            hi = mid - 1
    return lo


def session_capacity(tokens: int, initial: int = 1024) -> int:
    """The largest capacity a growable session can reach while it holds at most ``tokens`` positions.

    :class:`lragent.engine.Engine` grows to ``max(needed, 2 x capacity)`` (rounded up to 256) when a step needs more
    than it has; ``needed <= tokens``, so doubling from ``initial`` until ``tokens`` fit bounds every growth path.
    """
    cap = initial
    while cap < tokens:
        cap = -(-2 * cap // 256) * 256
    return cap


def check_session(
    model: str,
    scheme: str,
    text_bytes: int,
    *,
    dtype: str | torch.dtype,
    device: str | torch.device,
    rank: int = 8,
    shared_a: bool = True,
    droidspeak_layers: Sequence[int] | None = None,
) -> None:
    """Refuses (``ValueError``, one line) a one-trajectory session whose cache, grown to hold ``text_bytes``
    positions (UTF-8 bytes of everything appended plus the generation budget bound the tokens of a byte-level
    tokenizer), does not fit in the free memory of ``device``."""
    choose_batch(
        model, [scheme], 1, session_capacity(text_bytes), dtype=dtype, device=device, rank=rank, shared_a=shared_a,
        droidspeak_layers=droidspeak_layers, option="the session (batch 1)", auto_ok=False,
    )  # fmt: skip


def transformers_baseline_bytes(shape: ModelShape, batch: int, context: int, element_size: int) -> int:
    """Memory of stock transformers' prefill and cache at ``batch`` x ``context`` besides the weights: the
    DynamicCache, the MLP and attention activations of one layer, and the logits of every position."""
    tokens = batch * context
    cache = tokens * shape.n_layers * 2 * shape.n_kv_heads * shape.head_dim
    q_kv = (shape.n_heads + 2 * shape.n_kv_heads) * shape.head_dim
    acts = tokens * (8 * shape.hidden + q_kv + 3 * shape.intermediate)
    return (cache + acts + tokens * shape.vocab) * element_size


__all__ = [
    "MemoryPlan",
    "ModelShape",
    "check_session",
    "choose_batch",
    "free_memory",
    "model_shape",
    "plan_memory",
    "session_capacity",
    "transformers_baseline_bytes",
]
