"""The multi-agent inference engine: static decomposed caches, batched trajectories, CUDA-graph decoding.

An :class:`Engine` holds ``rows`` independent trajectories (episodes) over one static cache pool laid out by a
sharing scheme (:mod:`lragent.sharing`). Each row is extended by agents (roles) in turn; a role's **step** is

1. the scheme's plan (catch-up over context the role has not seen, then a forward of what its cache lacks), run
   eagerly for that row (:meth:`Engine.prefill`);
2. generation, batched over every row that is generating: each decode step feeds one token per row, with the
   row's own role, slots, position and sampling settings as device tensors. On CUDA the step (model, sampling,
   stop detection, bookkeeping) is captured once per batch bucket as a CUDA graph and replayed; the host looks at
   the rows only every ``sync_every`` steps (a row that finished meanwhile idles harmlessly past its end).

Stopping is decided on the device from token ids: a token whose text contains a stop string (single-token stops,
e.g. ``"\\n"``) or an end-of-sequence token ends the row; stop strings that a tokeniser can split over several
tokens are also matched on the decoded text at each sync (the text fallback). The kept tokens and the text are
cut before the stop string, as the session API always did.

The engine is exact: the equivalences of DESIGN.md §2 hold through it (tests), and graph and eager decoding give
the same tokens.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kernels.split_workspace import workspace_owner
from lragent.cache_views import DecodeView, PrefillView
from lragent.fused_weights import refresh_fused_lora
from lragent.lora_model import MultiLoraModel
from lragent.sampling import check_sampling, sample_next
from lragent.schemes import Scheme
from lragent.sharing import Forward, LRPrefill, PlanOp, Recompute, Trajectory, make_scheme
from lragent.static_cache import StaticCachePool


class CapacityError(ValueError):
    """A trajectory would outgrow the cache capacity and the pool cannot grow now."""


@dataclass
class GenerationRequest:
    """One role's turn to generate on one row.

    Attributes:
        role: role id.
        max_new_tokens: generation bound (0: prefill only).
        stop: stop strings; the kept text and tokens end before the first one.
        temperature: 0 for greedy, > 0 to sample.
        top_p: nucleus mass in (0, 1].
        seed: sampling seed of this request (token i uses noise keyed by (seed, i)).
        return_logits: keep the logits of every position the role ran at full depth (eager decoding).
    """

    role: int
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    return_logits: bool = False


@dataclass
class StepResult:
    """What one agent step did.

    Attributes:
        role: the role that acted.
        prefill_tokens: positions the prefill ran the model over (new tokens, plus recomputed or LR-prefilled
            context for ``droidspeak`` / ``base_shared``, plus everything unseen for ``non_shared``).
        recomputed_tokens: of those, context positions already in a shared cache that were processed again.
        generated_ids: generated tokens (all of them, stop string included).
        text: decoded generated text, cut before the first stop string.
        kept_tokens: generated tokens kept in the trajectory (the stop string's tokens are dropped).
        prefill_s: wall seconds of the prefill.
        decode_s: wall seconds from the first decode step of this request to the sync that saw it end.
        stop_reason: ``stop``, ``eos`` or ``length``.
        logits: with ``return_logits``: ``(n, vocab)`` fp32 CPU logits of the positions in ``logit_positions``.
        logit_positions: trajectory positions whose next-token logits are in ``logits``.
        row: the trajectory.
    """

    role: str
    prefill_tokens: int
    recomputed_tokens: int
    generated_ids: list[int]
    text: str
    kept_tokens: int
    prefill_s: float
    decode_s: float
    stop_reason: str
    logits: torch.Tensor | None = None
    logit_positions: list[int] = field(default_factory=list)
    row: int = 0

    def to_dict(self) -> dict:
        return {
            "role": self.role,
            "prefill_tokens": self.prefill_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "generated_ids": self.generated_ids,
            "text": self.text,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "stop_reason": self.stop_reason,
        }


@dataclass
class _Pending:
    """Host-side state of a row that is generating."""

    request: GenerationRequest
    len0: int
    prefill_tokens: int
    recomputed: int
    prefill_s: float
    t_decode: float
    steps: int = 0
    forced_left: int = 0  # fed tokens not yet through the decode step (the host's count, kept with a feed_budget)
    logits: list[torch.Tensor] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index of the earliest stop string in ``text``, or ``None``."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


class StopTokenIndex:
    """Per stop string, the vocabulary mask of tokens whose text contains it (built once per tokenizer).

    Args:
        tokenizer: a transformers tokenizer.
        vocab_size: the model's vocabulary size (rows beyond the tokenizer's vocabulary never match).
    """

    def __init__(self, tokenizer: object, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._pieces: list[str] | None = None
        self._masks: dict[str, torch.Tensor] = {}

    def _all_pieces(self) -> list[str]:
        if self._pieces is None:
            tok, n = self.tokenizer, self.vocab_size
            ids = [[i] for i in range(n)]
            if hasattr(tok, "batch_decode"):
                pieces = tok.batch_decode(ids, skip_special_tokens=False)
            else:
                pieces = [tok.decode(i, skip_special_tokens=False) for i in ids]
            self._pieces = [p if isinstance(p, str) else "" for p in pieces]
        return self._pieces

    def mask(self, stops: Sequence[str]) -> torch.Tensor:
        """``(vocab,)`` bool: tokens whose text contains any of ``stops``."""
        out = torch.zeros(self.vocab_size, dtype=torch.bool)
        for s in stops:
            if not s:
                continue
            if s not in self._masks:
                self._masks[s] = torch.tensor([s in p for p in self._all_pieces()], dtype=torch.bool)
            out |= self._masks[s]
        return out

    @staticmethod
    def needs_text_check(stops: Sequence[str]) -> bool:
        """True when a stop string can span tokens: longer than one byte (one character of several UTF-8 bytes can
        be split over byte-level tokens, so no single token's text holds it)."""
        return any(len(s.encode("utf-8")) > 1 for s in stops)


_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)

_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream on which an engine's decode steps are warmed up and captured: the current stream where that is a
    side stream (an executor's lane, ``eval --concurrent_schemes``), else the one side stream of this process (per
    device; the default stream cannot be captured).

    Warm-up and capture must run on the same stream: state that CUDA libraries create lazily per stream (cuBLAS and
    cuBLASLt workspaces, keyed by handle and stream, kept for the life of the process) is then created by the eager
    warm-up, in ordinary memory. Created during a capture instead, it would be allocated from the graph's private
    pool and outlive the graph, and the next capture into that pool would hit the allocator's
    ``use_count > 0`` assert. A graph keeps the workspace of the stream it was captured on, so graphs that replay at
    the same time on different streams must be captured on different streams: captured on one shared stream, two
    lanes' GEMMs would share one cuBLAS workspace while they run at once.
    """
    key = torch.device(device.type, device.index if device.index is not None else torch.cuda.current_device())
    current = torch.cuda.current_stream(key)
    if current != torch.cuda.default_stream(key):
        return current
    if key not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[key] = torch.cuda.Stream(key)
    return _CAPTURE_STREAMS[key]


FEED_GROUP_ENV = "LRAGENT_FEED_GROUP"
# token rows a group by default: 1, no groups. Groups of 8 cut the device wait of the throughput job by 10% on an H100
# but their kernels' compilation cost more than that (results/eval_throughput/README.md, "Fed tokens in groups")
_FEED_GROUP_DEFAULT = 1
_MAX_GROUP_QUERIES = 128  # kernels.flash_lora_decode's bound on a group's query heads


def _env_count(env: str, meaning: str) -> int | None:
    """The whole number >= 1 that ``env`` sets, or None when it is unset or empty.

    Raises:
        ValueError: any other value, naming the variable and what it means.
    """
    raw = os.environ.get(env, "").strip()
    if raw and not (raw.isdigit() and int(raw) >= 1):
        raise ValueError(f"{env}={raw!r}: expected an int >= 1 ({meaning})")
    return int(raw) if raw else None


def _feed_group(value: int | None, kernel: bool, heads: int) -> int:
    """The engine's ``feed_group``: ``value``, or where the decode kernel runs ``LRAGENT_FEED_GROUP`` (default 1),
    lowered to fit the kernel's bound on a group's query heads (``heads`` query heads a KV head each); 1 elsewhere
    (the torch path gains nothing).

    Raises:
        ValueError: a value that is not an int >= 1, or a group past the kernel's bound, naming it.
    """
    fits = max(1, _MAX_GROUP_QUERIES // max(heads, 1))
    if value is None:
        if not kernel:
            return 1
        return min(_env_count(FEED_GROUP_ENV, "token rows a group of fed tokens") or _FEED_GROUP_DEFAULT, fits)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"feed_group must be an int >= 1 (1: no groups), got {value!r}")
    if value > fits:
        raise ValueError(
            f"feed_group={value} x {heads} query heads a KV head is past {_MAX_GROUP_QUERIES}; at most {fits}"
        )
    return value


FEED_WIDTHS_ENV = "LRAGENT_FEED_WIDTHS"
_FEED_WIDTHS_DEFAULT = 4  # the budget and 3 halvings: 13% less loop time than one width on the study's job (H200)


def feed_step_widths(budget: int, group: int, count: int | None = None) -> tuple[int, ...]:
    """The extra-row widths a feeding step may take, narrowest first: ``budget`` and its ``count - 1`` halvings, each
    rounded up to a multiple of ``group`` (at most the budget; duplicates dropped); ``()`` without a budget.
    ``count`` None reads ``LRAGENT_FEED_WIDTHS`` (default 4).

    Raises:
        ValueError: a count (or the variable) that is not an int >= 1, naming it.
    """
    if count is None:
        count = _env_count(FEED_WIDTHS_ENV, "widths a feeding step may take") or _FEED_WIDTHS_DEFAULT
    elif isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"feed_widths must be an int >= 1 (1: the budget at every feeding step), got {count!r}")
    if not budget:
        return ()
    return tuple(sorted({min(budget, max(group, -(-(budget >> k) // group) * group)) for k in range(count)}))


def _own_workspaces(method: Callable) -> Callable:
    """Runs an engine method that launches the model's kernels with the engine's own split-K workspaces
    (:func:`kernels.split_workspace.workspace_owner`): engines on different CUDA streams never share partials or
    counters, and a graph captured here keeps the engine's buffers."""

    @functools.wraps(method)
    def wrapper(self: Engine, *args, **kwargs):
        with workspace_owner(self):
            return method(self, *args, **kwargs)

    return wrapper


class Engine:
    """Batched multi-agent inference over one static cache pool (see the module docstring).

    Args:
        model: the multi-LoRA model (its device and dtype are the engine's).
        scheme: the sharing scheme: a :class:`~lragent.schemes.Scheme` (as a command parsed it; taken as it is) or its
            name. The engine builds the scheme object (:func:`~lragent.sharing.make_scheme`) for this model and
            ``rows``, and its plan is what the engine runs through the decoder.
        rows: number of independent trajectories.
        capacity: positions per trajectory slot; the pool is allocated once to it.
        tokenizer: needed for stop strings, text and :meth:`append_text`.
        eos_token_ids: tokens that end generation; default from the model's generation config.
        droidspeak_layers: layers DroidSpeak recomputes (default: a middle third).
        use_kernel: allow the fused Triton kernels on CUDA.
        cuda_graphs: capture decode steps as CUDA graphs (default: on CUDA). False: eager decoding.
        sync_every: decode steps between host checks of which rows finished.
        growable: a one-row engine may reallocate to a larger capacity between steps (the session API); a
            batched engine raises :class:`CapacityError` instead.
        fuse_ops: fused weights (one GEMM for q/k/v and for gate/up) and fused elementwise kernels; default: on
            CUDA in fp16/bf16 with ``use_kernel``. On the CPU the fused path runs with PyTorch fallbacks (tests).
        fuse_lora: with ``fuse_ops``, also append each adapter's shared A to its fused GEMM (one GEMM gives X·W0
            and X·A; V_lr is taken from it) and apply every row's B through a role mask, one GEMM over all roles' B,
            instead of gathering each row's B in every layer (:attr:`DecoderEngine.fuse_lora`). Default: on, unless
            the environment sets ``LRAGENT_FUSE_LORA=0`` (side-by-side timings of the previous path).
        prefill_in_decode: a step whose plan is one forward of at most this many tokens (no catch-up, no logits
            asked) feeds those tokens through the batched decode step, teacher-forced, one per step and all rows
            together, instead of an eager prefill of its row alone. Agent calls append a few dozen tokens each, so
            with many rows the eager prefills, one row at a time, would cost more than the decoding; long prompts
            still prefill eagerly. 0 turns it off.
        feed_budget: with ``prefill_in_decode``, extra token rows per decode step for fed tokens (default 0: one
            token per row per step). A step then runs ``b + feed_budget`` token rows: each busy row's next token in
            its own row, and the extra rows lent, in row order, to the rows that still have tokens to feed (a row
            takes as many as it has left, until the budget is spent). Each fed token sits at its own position in its
            row's slots; all K/V are stored before the step's attention, which reads ``[0, position]`` (causal), and
            a row's logits are its last fed token's. A call's new text then takes one step or a few instead of one
            per token, so an episode ends sooner. Steps in which no row feeds run without the extra rows.
        batch_invariant: every decode step runs all ``rows`` rows (one batch width, the idle rows masked) instead of
            the smallest bucket that holds the busy rows. GPU GEMMs pick their kernel, and so their summation order,
            by the batch width, so a row's logits can change in their last bits with how many other rows are busy
            and a sampled token can flip; at one width a row's numbers depend on its own inputs only. Costs the idle
            rows' compute when few rows are busy. With ``feed_budget`` every step has the extra rows (one width).
        feed_group: with ``feed_budget``, each row's lent range starts at a multiple of this many extra rows, so
            that the decode kernel runs the extra rows in groups of ``feed_group`` token rows of one row each, whose
            queries share every K/V tile (``flash_lora_decode(group_rows=...)``) instead of each fed token reading
            its row's whole cache again; a range's last group may hold padding rows (no token). Default: where the
            decode kernel runs, ``LRAGENT_FEED_GROUP`` or 1 (at most 128 query heads a group), else 1 (no groups).
        feed_widths: with ``feed_budget``, how many widths a feeding step may take: the budget and its halvings
            (each a multiple of ``feed_group``). A round of steps takes the narrowest that holds what the rows have
            left to feed beyond their own token (0 extra rows when that is nothing), so that a step whose rows feed a
            few tokens does not run the whole budget's rows through the model; each width is one more CUDA graph per
            batch bucket. Default ``LRAGENT_FEED_WIDTHS`` or 4 (1: the budget at every feeding step). Batch-invariant
            engines keep the one width.
    """

    def __init__(
        self,
        model: MultiLoraModel,
        scheme: str | Scheme,
        *,
        rows: int = 1,
        capacity: int = 4096,
        tokenizer: object | None = None,
        eos_token_ids: Sequence[int] | None = None,
        droidspeak_layers: Sequence[int] | None = None,
        use_kernel: bool = True,
        cuda_graphs: bool | None = None,
        sync_every: int = 8,
        growable: bool = False,
        fuse_ops: bool | None = None,
        prefill_in_decode: int = 0,
        fuse_lora: bool | None = None,
        batch_invariant: bool = False,
        feed_budget: int = 0,
        feed_group: int | None = None,
        feed_widths: int | None = None,
    ) -> None:
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        if isinstance(prefill_in_decode, bool) or prefill_in_decode < 0:
            raise ValueError(f"prefill_in_decode must be an int >= 0 (0: off), got {prefill_in_decode!r}")
        self.prefill_in_decode = int(prefill_in_decode)
        if isinstance(feed_budget, bool) or not isinstance(feed_budget, int) or feed_budget < 0:
            raise ValueError(
                f"feed_budget must be an int >= 0 (0: one fed token per row per step), got {feed_budget!r}"
            )
        self.feed_budget = feed_budget if self.prefill_in_decode else 0  # nothing is fed without prefill_in_decode
        self.batch_invariant = bool(batch_invariant)
        self.model = model
        self.dec = model.decoder  # the per-layer DecoderEngine of the model (not a batched Engine)
        self.tokenizer = tokenizer
        self.rows = rows
        self.use_kernel = use_kernel
        self.sync_every = sync_every
        self.growable = growable
        param = next(model.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else bool(cuda_graphs)
        gpu_ok = use_kernel and self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16)
        self.fuse_ops = gpu_ok if fuse_ops is None else bool(fuse_ops)
        if fuse_lora is None:
            fuse_lora = os.environ.get("LRAGENT_FUSE_LORA", "1") != "0"
        self.fuse_lora = self.fuse_ops and bool(fuse_lora)
        self.feed_group = _feed_group(
            feed_group, gpu_ok, getattr(self.dec, "n_heads", 1) // getattr(self.dec, "n_kv_heads", 1)
        )
        self.feed_widths = feed_step_widths(self.feed_budget, self.feed_group, feed_widths)
        self.dec.fuse_lora = self.fuse_lora
        if self.fuse_ops:
            from lragent.fused_weights import fuse_base_weights

            fuse_base_weights(model.model, lora=self.fuse_lora)
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs the model on a CUDA device")
        cfg = model.lora_config
        self.scheme = make_scheme(
            scheme,
            len(model.router),
            rows,
            shared_a=cfg.shared_a,
            n_layers=self.dec.n_layers,
            droidspeak_layers=droidspeak_layers,
        )
        if self.scheme.decomposed and "v_proj" not in cfg.targets:
            raise ValueError(
                f"scheme {self.scheme.scheme.value} stores V_lr = X·A of v_proj: targets must include v_proj"
            )
        layout = self.scheme.layout(self.dec.n_kv_heads, self.dec.head_dim, cfg.rank, self.dec.hidden_size)
        self.pool = StaticCachePool(layout, capacity, self.dtype, self.device)
        self.per_position = layout.bytes_per_position(torch.empty((), dtype=self.dtype).element_size())
        self.traj = [Trajectory() for _ in range(rows)]
        if eos_token_ids is None:
            gen_cfg = model.model.generation_config
            eos = gen_cfg.eos_token_id if gen_cfg is not None else None
            eos_token_ids = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_token_ids = {int(t) for t in eos_token_ids}
        self.stop_index = StopTokenIndex(tokenizer, self.dec.vocab_size) if tokenizer is not None else None
        self._stop_masks: dict[tuple[str, ...], torch.Tensor] = {}
        self.peak_cache_bytes = 0
        self.decode_steps = 0  # batched decode steps run (graph replays included): an episode's latency in steps
        # the feeding steps' extra token rows (``feed_budget``): computed (each step's width) and, of those, carrying a
        # fed token; the rest is padding to the step's width, device work that feeds nothing
        self.feed_rows = 0
        self.feed_tokens = 0
        # wall seconds in advance(), and the part of it spent reading results back (waiting for the device, stop
        # checks): where a run's time goes between the device and the host, without a profiler
        self.advance_s = 0.0
        self.sync_s = 0.0
        # finer splits for finding host overhead (several processes on one host): the graph-replay calls, and of
        # sync_s the first read-back (the wait for the device's steps) alone
        self.replay_s = 0.0
        self.wait_s = 0.0
        # of advance_s, the graph captures (their warm-up steps, which compile or load the kernels, included): a
        # process's fixed cost, paid once per graph, not per step
        self.capture_s = 0.0
        self._pending: dict[int, _Pending] = {}
        self._lora_modules = list(model.lora_modules().values())
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._graph_pool = None  # private memory pool shared by self._graphs; lives exactly as long as they do
        self._alloc_decode_state()

    # ---- decode state (device) -----------------------------------------------------------------------------------
    def _alloc_decode_state(self) -> None:
        r, dev, v = self.rows, self.device, self.dec.vocab_size
        long = {"dtype": torch.long, "device": dev}
        pool = self.pool
        self.d_tok = torch.zeros(r, **long)
        self.d_pos = torch.zeros(r, **long)
        self.d_role = torch.zeros(r, **long)
        self.d_kv_slot = torch.full((r,), pool.scratch_kv, **long)
        self.d_lr_slot = torch.full((r,), pool.scratch_lr, **long)
        self.d_hid_slot = torch.full((r,), pool.scratch_hidden, **long)
        self.d_active = torch.zeros(r, dtype=torch.bool, device=dev)
        self.d_remaining = torch.zeros(r, **long)
        self.d_count = torch.zeros(r, **long)
        self.d_temp = torch.zeros(r, dtype=torch.float32, device=dev)
        self.d_top_p = torch.ones(r, dtype=torch.float32, device=dev)
        self.d_seed = torch.zeros(r, **long)
        self.d_gen = torch.zeros(r, pool.capacity, **long)
        # teacher-forced tokens a row feeds before it samples (prefill_in_decode); width 1 when the feature is off
        self.d_forced = torch.zeros(r, max(self.prefill_in_decode, 1), **long)
        self._alloc_forced_host()
        self.d_forced_len = torch.zeros(r, **long)
        self.d_forced_count = torch.zeros(r, **long)
        self.d_stop = torch.zeros(r, v, dtype=torch.bool, device=dev)
        self.d_logits = torch.zeros(r, v, dtype=torch.float32, device=dev)
        eos = torch.zeros(v, dtype=torch.bool)
        eos[[t for t in self.eos_token_ids if 0 <= t < v]] = True
        self.d_eos = eos.to(dev)
        self._drop_graphs()
        self._pool_version = self.pool.version

    def _alloc_forced_host(self) -> None:
        """Each row's fed tokens staged on the host: ``(rows, d_forced width)`` int64, page-locked on CUDA (a
        ``non_blocking`` copy from pageable memory waits for the steps in flight; pinning a fresh tensor at each start
        cost about 0.5 ms of host time), with a NumPy view that takes a list of ids without a torch call."""
        host = torch.zeros(self.rows, self.d_forced.shape[1], dtype=torch.long)
        self._forced_host = host.pin_memory() if self.device.type == "cuda" else host
        self._forced_host_np = self._forced_host.numpy()

    def _drop_graphs(self) -> None:
        """Releases the captured graphs and, with them, their memory pool's handle.

        The allocator frees a private pool once no graph uses it and none of its blocks is allocated; capturing into
        the handle of a pool whose graphs are all gone is refused (``use_count > 0`` assert) whenever a block of it
        is still held. A new handle for the next generation of graphs never meets that state.
        """
        self._graphs.clear()
        self._graph_pool = None

    # ---- trajectories --------------------------------------------------------------------------------------------
    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.rows:
            raise ValueError(f"row {row} out of range: the engine has rows 0..{self.rows - 1}")

    def ids(self, row: int = 0) -> list[int]:
        """The token ids of trajectory ``row`` (the engine's list: do not modify)."""
        return self.traj[row].ids

    def reset(self, row: int) -> None:
        """Empties trajectory ``row`` (a new episode)."""
        self._check_row(row)
        if row in self._pending:
            raise ValueError(f"row {row} is generating: wait for its result before resetting it")
        self.traj[row] = Trajectory()

    def append(self, row: int, token_ids: Sequence[int]) -> None:
        """Appends tokens (prompt pieces, tool outputs) to trajectory ``row``."""
        self._check_row(row)
        vocab = self.dec.vocab_size
        ids = [int(t) for t in token_ids]
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} out of range: allowed 0..{vocab - 1}")
        if row in self._pending:
            raise ValueError(f"row {row} is generating: append after its result")
        self.traj[row].ids.extend(ids)

    def truncate(self, row: int, n_tokens: int) -> None:
        """Cuts trajectory ``row`` (and every cache of it) to its first ``n_tokens`` tokens."""
        self._check_row(row)
        self.scheme.truncate(self.traj[row], n_tokens)

    # ---- memory --------------------------------------------------------------------------------------------------
    def cache_bytes(self, row: int | None = None) -> dict[str, int]:
        """Bytes the caches hold now (valid positions), per component, for one row or all rows."""
        rows = range(self.rows) if row is None else [row]
        total: dict[str, int] = {}
        for r in rows:
            for k, v in self.scheme.component_bytes(self.traj[r], self.per_position).items():
                total[k] = total.get(k, 0) + v
        return total

    def _note_peak(self) -> None:
        self.peak_cache_bytes = max(self.peak_cache_bytes, sum(self.cache_bytes().values()))

    # ---- capacity ------------------------------------------------------------------------------------------------
    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self.pool.capacity:
            return
        if not self.growable or self._pending:
            raise CapacityError(
                f"a trajectory needs {needed} positions but the cache capacity is {self.pool.capacity}; "
                "raise the capacity"
            )
        # Between steps only: reallocate in a large chunk, keep the valid prefix, drop captured graphs.
        new_cap = max(needed, 2 * self.pool.capacity)
        new_cap = -(-new_cap // 256) * 256
        self.pool.grow(new_cap, valid=max((len(t.ids) for t in self.traj), default=0))
        self._alloc_decode_state()

    # ---- prefill -------------------------------------------------------------------------------------------------
    def _sync(self) -> None:
        """Waits for this engine's work: the current stream's (an executor may run each engine on its own)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    @_own_workspaces
    def _run_op(self, row: int, role: int, op: PlanOp, want_logits: bool) -> torch.Tensor | None:
        """Runs one plan operation as ``role`` on ``row``; returns logits ``(T, vocab)`` of a Forward if asked."""
        traj, sch = self.traj[row], self.scheme
        kv_slot, lr_slot = sch.kv_slot(row, role), sch.lr_slot(row, role)
        start, end = op.start, op.end
        ids = torch.tensor([traj.ids[start:end]], device=self.device)
        positions = torch.arange(start, end, device=self.device)
        cos_t, sin_t = self.dec.rope_table(self.pool.capacity, self.dtype, self.device)
        rotary = (cos_t[positions][None], sin_t[positions][None])
        role_t = torch.tensor([role], device=self.device)
        if isinstance(op, Recompute):
            view = PrefillView(self.pool, kv_slot, lr_slot, None, start, end - start, self.use_kernel, self.fuse_ops)
            for a, b in sch.groups:
                h = self.pool.hidden[a][sch.hidden_slot(row), start:end][None]
                self.dec.run_view(h, rotary, role_t, view, layers=range(a, b))
            sch.record(traj, role, op)
            return None
        hidden_slot = sch.hidden_slot(row) if sch.hidden_layers else None
        view = PrefillView(self.pool, kv_slot, lr_slot, hidden_slot, start, end - start, self.use_kernel, self.fuse_ops)
        h = self.dec.embed(ids)
        if isinstance(op, LRPrefill):
            self.dec.run_view(h, rotary, role_t, view, write_kv=False)
            sch.record(traj, role, op)
            return None
        h = self.dec.run_view(h, rotary, role_t, view)
        sch.record(traj, role, op)
        return self.dec.logits(h if want_logits else h[:, -1:], fused=view.fused)[0]

    @_own_workspaces
    def _run_lr_forward(self, row: int, role: int, lr: LRPrefill, fwd: Forward, want_logits: bool) -> torch.Tensor:
        """One pass over ``[lr.start, fwd.end)``: V_lr only for the catch-up part, everything for the new part."""
        traj, sch = self.traj[row], self.scheme
        start, split, end = lr.start, fwd.start, fwd.end
        ids = torch.tensor([traj.ids[start:end]], device=self.device)
        positions = torch.arange(start, end, device=self.device)
        cos_t, sin_t = self.dec.rope_table(self.pool.capacity, self.dtype, self.device)
        rotary = (cos_t[positions][None], sin_t[positions][None])
        view = PrefillView(
            self.pool, sch.kv_slot(row, role), sch.lr_slot(row, role), None, start, end - start, self.use_kernel,
            self.fuse_ops,
        )  # fmt: skip
        h = self.dec.run_view(self.dec.embed(ids), rotary, torch.tensor([role], device=self.device), view,
                              kv_from=split - start)  # fmt: skip
        sch.record(traj, role, lr)
        sch.record(traj, role, fwd)
        h = h[:, split - start :]
        return self.dec.logits(h if want_logits else h[:, -1:], fused=view.fused)[0]

    @torch.no_grad()
    def prefill(
        self, row: int, role: int, return_logits: bool = False, logits_from: int | None = None
    ) -> tuple[torch.Tensor, list[int], int, int]:
        """Runs ``role``'s plan on ``row``: catch-up, then a forward of what its cache lacks.

        Args:
            row: trajectory.
            role: role id.
            return_logits: return the logits of every forwarded position (else the last only).
            logits_from: forward from at most this position (to get logits there even if it is cached).

        Returns:
            ``(logits (T, vocab), positions, prefill_tokens, recomputed_tokens)``.
        """
        traj = self.traj[row]
        ops = self.scheme.plan(traj, role)
        if logits_from is not None and isinstance(ops[-1], Forward) and ops[-1].start > logits_from:
            ops[-1] = Forward(logits_from, ops[-1].end)
        self._ensure_capacity(len(traj.ids))
        logits, recomputed, total = None, 0, 0
        if len(ops) == 2 and isinstance(ops[0], LRPrefill) and isinstance(ops[1], Forward):
            # base_shared: the LR prefill and the forward of the new tokens in one pass over the layers
            lr, fwd = ops
            logits = self._run_lr_forward(row, role, lr, fwd, want_logits=return_logits)
            positions = list(range(fwd.start, fwd.end)) if return_logits else [fwd.end - 1]
            self._note_peak()
            n_lr, n_fwd = lr.end - lr.start, fwd.end - fwd.start
            return logits, positions, n_lr + n_fwd, n_lr
        for op in ops:
            total += op.end - op.start
            if not isinstance(op, Forward):
                recomputed += op.end - op.start
            out = self._run_op(row, role, op, want_logits=return_logits)
            if out is not None:
                logits = out
        last = ops[-1]
        positions = list(range(last.start, last.end)) if return_logits else [last.end - 1]
        self._note_peak()
        return logits, positions, total, recomputed

    # ---- generation ----------------------------------------------------------------------------------------------
    def _validate(self, req: GenerationRequest) -> None:
        if not 0 <= req.role < len(self.model.router):
            raise ValueError(f"role id {req.role} out of range: allowed 0..{len(self.model.router) - 1}")
        if isinstance(req.max_new_tokens, bool) or req.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {req.max_new_tokens}")
        check_sampling(req.temperature, req.top_p)
        if req.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= to the engine")

    @torch.no_grad()
    def start(self, row: int, request: GenerationRequest) -> StepResult | None:
        """Prefills ``request.role`` on ``row`` and enters the row into batched decoding.

        Returns:
            the finished :class:`StepResult` right away when ``max_new_tokens`` is 0, else ``None`` (the result
            comes from :meth:`advance`).
        """
        self._check_row(row)
        self._validate(request)
        if row in self._pending:
            raise ValueError(f"row {row} is already generating")
        traj = self.traj[row]
        if not traj.ids:
            raise ValueError("the trajectory is empty: append tokens before a step")
        self._ensure_capacity(len(traj.ids) + request.max_new_tokens + 1)
        fed = self._fed_forward(row, request)
        if fed is not None:
            return self._start_fed(row, request, fed)
        self._sync()
        t0 = time.perf_counter()
        logits, positions, total, recomputed = self.prefill(row, request.role, request.return_logits)
        self._sync()
        prefill_s = time.perf_counter() - t0
        pend = _Pending(request, len(traj.ids), total, recomputed, prefill_s, time.perf_counter())
        if request.return_logits:
            pend.logits.append(logits.float().cpu())
            pend.positions.extend(positions)
        if request.max_new_tokens == 0:
            return self._finish(row, pend, [])
        # load the row into the decode state
        self.d_logits[row] = logits[-1].float()
        self._load_row(row, request, pos=len(traj.ids))
        self.d_forced_len[row].fill_(0)
        self.d_forced_count[row].fill_(0)
        self.d_active[row].fill_(True)
        self._pending[row] = pend
        return None

    def _fed_forward(self, row: int, request: GenerationRequest) -> Forward | None:
        """The plan's forward when the step can feed it through the decode step (see ``prefill_in_decode``)."""
        if not self.prefill_in_decode or request.return_logits or request.max_new_tokens == 0:
            return None
        ops = self.scheme.plan(self.traj[row], request.role)
        if len(ops) != 1 or not isinstance(ops[0], Forward):
            return None  # a catch-up (base_shared, DroidSpeak) runs eagerly, with the forward in the same pass
        op = ops[0]
        return op if 0 < op.end - op.start <= self.prefill_in_decode else None

    def _start_fed(self, row: int, request: GenerationRequest, op: Forward) -> None:
        """Enters ``row`` into decoding with ``op``'s tokens to feed first (the row samples once they are in)."""
        traj = self.traj[row]
        n = op.end - op.start
        # The row's own staging slot. Rewriting it while an earlier copy from it is still queued (a row abandoned
        # mid-step) is harmless: this copy, queued after that one, writes the row's tokens last.
        self._forced_host_np[row, :n] = traj.ids[op.start : op.end]
        self.d_forced[row, :n].copy_(self._forced_host[row, :n], non_blocking=True)
        self.d_forced_len[row].fill_(n)
        self.d_forced_count[row].fill_(0)
        self._load_row(row, request, pos=op.start)
        # The forward is recorded now: the row's caches hold [start, end) once its first token is sampled, before
        # anything can read them (the row is busy until its result is collected).
        self.scheme.record(traj, request.role, op)
        self.d_active[row].fill_(True)
        self._pending[row] = _Pending(request, len(traj.ids), n, 0, 0.0, time.perf_counter(), forced_left=n)
        self._note_peak()
        return None

    def _load_row(self, row: int, request: GenerationRequest, pos: int) -> None:
        """Loads ``row``'s request into the decode state; its next fed token goes to position ``pos``."""
        # fill_ puts the value in the kernel's arguments: ``t[row] = value`` would copy it from pageable host memory,
        # which waits for every step in flight, so a row could not join while the others decode
        role, sch, pool = request.role, self.scheme, self.pool
        self.d_pos[row].fill_(pos)
        self.d_role[row].fill_(role)
        self.d_kv_slot[row].fill_(sch.kv_slot(row, role))
        self.d_lr_slot[row].fill_(sch.lr_slot(row, role) if pool.layout.decomposed else pool.scratch_lr)
        self.d_hid_slot[row].fill_(sch.hidden_slot(row) if sch.hidden_layers else pool.scratch_hidden)
        self.d_remaining[row].fill_(request.max_new_tokens)
        self.d_count[row].fill_(0)
        self.d_temp[row].fill_(float(request.temperature))
        self.d_top_p[row].fill_(float(request.top_p))
        self.d_seed[row].fill_(int(request.seed))
        if request.stop:
            self.d_stop[row].copy_(self._stop_mask(tuple(request.stop)))
        else:
            self.d_stop[row].fill_(False)

    def _stop_mask(self, stops: tuple[str, ...]) -> torch.Tensor:
        """``(vocab,)`` bool on the engine's device: the tokens whose text holds one of ``stops`` (made and moved once
        per set of stop strings; an agent asks with the same few sets all along)."""
        mask = self._stop_masks.get(stops)
        if mask is None:
            mask = self._stop_masks[stops] = self.stop_index.mask(stops).to(self.device)
        return mask

    def _release(self, row: int) -> None:
        """Points an idle row at the scratch slots so graph steps for other rows cannot touch its caches."""
        self.d_active[row].fill_(False)
        self.d_kv_slot[row].fill_(self.pool.scratch_kv)
        self.d_lr_slot[row].fill_(self.pool.scratch_lr)
        self.d_hid_slot[row].fill_(self.pool.scratch_hidden)
        self.d_pos[row].fill_(0)
        self.d_forced_len[row].fill_(0)

    @_own_workspaces
    def _decode_step(self, b: int, sampling: bool, max_len: int | None, extra: int = 0) -> None:
        """One decode step for batch rows ``[0, b)``: sample from the pending logits (or take the row's next
        teacher-forced token, and with ``extra`` token rows more of them), record, stop, forward."""
        if extra:
            return self._fed_step(b, sampling, max_len, extra)
        act = self.d_active[:b]
        count = self.d_count[:b]
        tok = sample_next(
            self.d_logits[:b], self.d_temp[:b], self.d_top_p[:b], self.d_seed[:b], count, sampling=sampling
        )
        rows = torch.arange(b, device=self.device)
        fcount = self.d_forced_count[:b]
        forcing = act & (fcount < self.d_forced_len[:b])
        forced = self.d_forced[rows, fcount.clamp(max=self.d_forced.shape[1] - 1)]
        tok = torch.where(forcing, forced, tok)
        fcount.add_(forcing.long())
        self._record_sampled(b, act, tok, forcing)
        pos = self.d_pos[:b]
        h, fused = self._forward(tok, pos, self.d_kv_slot[:b], self.d_lr_slot[:b], self.d_hid_slot[:b],
                                 self.d_role[:b], max_len)  # fmt: skip
        self.d_logits[:b] = self.dec.logits(h, fused=fused)[:, 0].float()
        pos.add_(act.long())

    def _forward(
        self,
        tok: torch.Tensor,
        pos: torch.Tensor,
        kv_slot: torch.Tensor,
        lr_slot: torch.Tensor,
        hid_slot: torch.Tensor,
        roles: torch.Tensor,
        max_len: int | None,
        token_groups: tuple[int, int] | None = None,
    ) -> tuple[torch.Tensor, bool]:
        """One token per token row through every layer: token ``tok[i]`` at position ``pos[i]`` of slots
        ``kv_slot[i]`` / ``lr_slot[i]`` / ``hid_slot[i]`` under adapter ``roles[i]`` (all ``(T,)``); its K/V stored,
        then attention over ``[0, pos[i]]``.

        ``token_groups``: :class:`~lragent.cache_views.DecodeView`'s (the fed rows' groups).

        Returns:
            the last hidden states ``(T, 1, H)`` and whether the view ran fused (for the LM head).
        """
        view = DecodeView(
            self.pool, kv_slot, lr_slot, hid_slot, pos, max_len, self.use_kernel, fused=self.fuse_ops,
            token_groups=token_groups,
        )  # fmt: skip
        cos_t, sin_t = self.dec.rope_table(self.pool.capacity, self.dtype, self.device)
        rotary = (cos_t[pos][:, None], sin_t[pos][:, None])
        return self.dec.run_view(self.dec.embed(tok[:, None]), rotary, roles, view), bool(view.fused)

    def _record_sampled(self, b: int, act: torch.Tensor, tok: torch.Tensor, forcing: torch.Tensor) -> None:
        """Records the sampled token of every busy row that is not feeding (``tok`` ``(b,)``): its generated ids,
        count and budget, and ends the row at a stop token, an end-of-sequence id or the budget. ``act`` is the view
        ``d_active[:b]``: after this call it holds the rows still busy."""
        rows = torch.arange(b, device=self.device)
        count = self.d_count[:b]
        gen = act & ~forcing
        slot = count.clamp(max=self.d_gen.shape[1] - 1)
        self.d_gen[rows, slot] = torch.where(gen, tok, self.d_gen[rows, slot])
        step = gen.long()
        count.add_(step)
        self.d_remaining[:b].sub_(step)
        hit = self.d_stop[:b].gather(1, tok[:, None])[:, 0] | self.d_eos[tok]
        done = gen & (hit | (self.d_remaining[:b] <= 0))
        self.d_active[:b] = act & ~done

    def _fed_step(self, b: int, sampling: bool, max_len: int | None, extra: int) -> None:
        """:meth:`_decode_step` with ``extra`` more token rows for fed tokens: rows ``[0, b)`` carry each row's next
        token as before; extra row ``e`` carries token ``j >= 1`` of the row whose lent range holds ``e`` (ranges
        lent in row order, each row asking for all its fed tokens left but one, until ``extra`` is spent)."""
        act = self.d_active[:b]
        count = self.d_count[:b]
        tok = sample_next(
            self.d_logits[:b], self.d_temp[:b], self.d_top_p[:b], self.d_seed[:b], count, sampling=sampling
        )
        rows = torch.arange(b, device=self.device)
        width = self.d_forced.shape[1]
        fcount, flen = self.d_forced_count[:b], self.d_forced_len[:b]
        forcing = act & (fcount < flen)
        want = torch.where(forcing, flen - fcount - 1, 0)  # fed tokens beyond the row's own one this step
        size = self.feed_group
        span = (want + size - 1) // size * size  # a range holds whole groups of the kernel's token rows
        off = torch.cumsum(span, 0) - span  # where each row's lent range would start
        grant = (extra - off).clamp(min=0).minimum(want)
        # the extra rows: their row (the last whose range starts at or before them), token index, validity
        e = torch.arange(extra, device=self.device)
        owner = (torch.searchsorted(off, e, right=True) - 1).clamp(min=0)
        valid = e < off[owner] + grant[owner]
        j = e - off[owner] + 1
        pos = self.d_pos[:b]
        first = torch.where(forcing, self.d_forced[rows, fcount.clamp(max=width - 1)], tok)
        more = self.d_forced[owner, (fcount[owner] + j).clamp(max=width - 1)]
        k = torch.where(forcing, 1 + grant, act.long())  # tokens each row puts through this step (before any stop)
        fcount.add_(torch.where(forcing, k, 0))
        self._record_sampled(b, act, tok, forcing)
        pool = self.pool

        def lent(per_row: torch.Tensor, scratch: int) -> torch.Tensor:
            return torch.cat([per_row[:b], torch.where(valid, per_row[owner], scratch)])

        h, fused = self._forward(
            torch.cat([first, more]),
            torch.cat([pos, torch.where(valid, pos[owner] + j, 0)]),
            lent(self.d_kv_slot, pool.scratch_kv),
            lent(self.d_lr_slot, pool.scratch_lr),
            lent(self.d_hid_slot, pool.scratch_hidden),
            torch.cat([self.d_role[:b], self.d_role[owner]]),
            max_len,
            token_groups=(b, size),
        )  # (b + extra, 1, H)
        last = torch.where(grant > 0, b + off + grant - 1, rows)  # each row's last token this step
        self.d_logits[:b] = self.dec.logits(h[last], fused=fused)[:, 0].float()
        pos.add_(k)

    def _extra(self) -> int:
        """Extra token rows in the next steps: ``feed_budget`` while some row has tokens to feed (always, when
        batch-invariant: one width for every step), else 0. With several ``feed_widths``, the narrowest that holds
        every feeding row's range (0 when no row has more than its own token left)."""
        if not self.feed_budget:
            return 0
        if self.batch_invariant:
            return self.feed_budget
        left = [p.forced_left for p in self._pending.values() if p.forced_left]
        if not left:
            return 0
        if len(self.feed_widths) == 1:
            return self.feed_budget
        need = sum(self._in_groups(n - 1) for n in left)  # the rows' ranges
        if need == 0:
            return 0
        return next((w for w in self.feed_widths if w >= need), self.feed_budget)

    def _in_groups(self, tokens: int) -> int:
        """Extra rows a range of ``tokens`` fed tokens takes: whole groups of ``feed_group``, as ``_fed_step`` lends."""
        return -(-tokens // self.feed_group) * self.feed_group

    def _feed_on_host(self, extra: int, steps: int) -> int:
        """Advances every pending row's ``forced_left`` by ``steps`` steps as the device does (one token per feeding
        row, the extra rows lent in row order) and returns how many of those steps still had a row feeding."""
        feeding = 0
        for _ in range(steps):
            rows = [p for _, p in sorted(self._pending.items()) if p.forced_left]
            if not rows:
                break
            feeding += 1
            off = 0
            for p in rows:
                want = p.forced_left - 1
                grant = min(want, max(0, extra - off))
                off += self._in_groups(want)
                p.forced_left -= 1 + grant
                self.feed_tokens += grant
        return feeding

    def _bucket(self) -> int:
        if self.batch_invariant:
            return self.rows
        top = max(self._pending) + 1
        for b in _BUCKETS:
            if b >= top and b <= self.rows:
                return b
        return self.rows

    def _graph_for(self, b: int, sampling: bool, extra: int = 0) -> torch.cuda.CUDAGraph:
        """The decode step of batch bucket ``b`` captured as a CUDA graph (captured on first use).

        All graphs of the engine share one private memory pool. That is safe in any replay order: a captured step
        keeps no output of its own (every result is copied into the engine's static state tensors), so what one
        graph leaves in the pool is scratch that no other graph reads.
        """
        key = (b, sampling, extra)
        if key in self._graphs:
            return self._graphs[key]
        started = time.perf_counter()
        state = [
            self.d_tok, self.d_pos, self.d_active, self.d_remaining, self.d_count, self.d_gen, self.d_logits,
            self.d_forced_count,
        ]  # fmt: skip
        saved = [t.clone() for t in state]
        stream = capture_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up on the capture stream: kernels compiled/tuned, per-stream workspaces made
                self._decode_step(b, sampling, None, extra)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool, stream=stream):
            self._decode_step(b, sampling, None, extra)
        for t, s in zip(state, saved, strict=True):
            t.copy_(s)
        self._graphs[key] = graph
        self.capture_s += time.perf_counter() - started  # host time: the kernels' compile or load is most of it
        return graph

    @torch.no_grad()
    def advance(self, max_steps: int | None = None) -> list[StepResult]:
        """Runs decode steps for every generating row until at least one finishes (or ``max_steps`` steps).

        Returns:
            the results of the rows that finished, in row order.
        """
        if not self._pending:
            return []
        started = time.perf_counter()
        self._refresh_lora()
        finished: list[StepResult] = []
        steps = 0
        counted = self.advance_s
        while not finished and (max_steps is None or steps < max_steps):
            steps += self._launch(None if max_steps is None else max_steps - steps)
            finished = self.collect()
        self._note_peak()
        self.advance_s = counted + time.perf_counter() - started  # the whole call (collect's share included once)
        return finished

    @torch.no_grad()
    def launch(self) -> int:
        """Queues the next decode steps of the generating rows without waiting for them (CUDA graphs run
        asynchronously); :meth:`collect` then waits and returns what finished. Between the two the host may serve
        other engines, so that one process keeps the device busy with several (:meth:`advance` is launch then
        collect until a row finishes). Returns the steps queued (0 when no row is generating)."""
        if not self._pending:
            return 0
        started = time.perf_counter()
        self._refresh_lora()
        steps = self._launch(None)
        self.advance_s += time.perf_counter() - started
        return steps

    def _refresh_lora(self) -> None:
        if self.pool.version != self._pool_version:
            self._alloc_decode_state()
        for module in self._lora_modules:  # bring the cached stacked B up to date (graphs read it in place)
            module.stacked_b()
            if self.fuse_lora:
                module.cat_b_cached(self.dtype)
        if self.fuse_lora:  # and the A rows of the fused GEMMs
            refresh_fused_lora(self.model.model)

    def _launch(self, max_steps: int | None) -> int:
        """One round of decode steps (``sync_every``, fewer while rows feed or under ``max_steps``); returns how
        many it queued."""
        b = self._bucket()
        sampling = any(p.request.temperature > 0 for p in self._pending.values())
        eager_logits = any(p.request.return_logits for p in self._pending.values())
        graphs = self.cuda_graphs and not eager_logits
        # eager: the host looks after every step (a sync costs little next to eager launches)
        n = 1 if not graphs else self.sync_every if max_steps is None else min(self.sync_every, max_steps)
        extra = self._extra()
        if self.feed_budget:  # the host's count of what is left to feed, as the device runs (read by _extra)
            feeding = self._feed_on_host(extra, n)
            if extra and not self.batch_invariant:
                n = max(1, feeding)  # back to plain steps once the feeding is done (it may end before n)
            self.feed_rows += extra * n
        if graphs:
            graph = self._graph_for(b, sampling, extra)
            launched = time.perf_counter()
            for _ in range(n):
                graph.replay()
            self.replay_s += time.perf_counter() - launched
        else:
            # a bound on every read position, with extra rows or not: a feeding row reads below len0 (its
            # trajectory, fed tokens included), a sampling one at most len0 + steps
            max_len = max(p.len0 + p.steps + 1 for p in self._pending.values())
            for p in self._pending.values():
                p.steps += 1
            self._decode_step(b, sampling, max_len, extra)
            if eager_logits:
                self._collect_logits()
        self.decode_steps += n
        return n

    @torch.no_grad()
    def collect(self) -> list[StepResult]:
        """Waits for the steps :meth:`launch` queued and returns the rows that finished, in row order."""
        synced = time.perf_counter()
        finished = self._collect_finished()
        waited = time.perf_counter() - synced
        self.sync_s += waited
        self.advance_s += waited
        self._note_peak()
        return finished

    def _collect_logits(self) -> None:
        """Eager decoding with ``return_logits``: keeps each active row's logits of the token just fed."""
        active = self.d_active.cpu()
        for row, p in self._pending.items():
            if p.request.return_logits and bool(active[row]):
                p.logits.append(self.d_logits[row : row + 1].float().cpu().clone())
                p.positions.append(int(self.d_pos[row]) - 1)

    def _collect_finished(self) -> list[StepResult]:
        waited = time.perf_counter()
        active = self.d_active.cpu()  # the first read-back waits for the steps in flight
        self.wait_s += time.perf_counter() - waited
        count = self.d_count.cpu()
        # the generated ids the host reads: rows done, rows whose stop strings are looked for in the text
        gen = self.generated_ids(
            count,
            [
                row
                for row, p in self._pending.items()
                if not bool(active[row]) or (p.request.stop and StopTokenIndex.needs_text_check(p.request.stop))
            ],
        )
        out: list[StepResult] = []
        for row in sorted(self._pending):
            p = self._pending[row]
            n = int(count[row])
            done = not bool(active[row])
            if not done and row in gen and n:  # a generating row is read back only to look for its stop strings
                text = self.tokenizer.decode(gen[row], skip_special_tokens=True)
                done = find_stop(text, p.request.stop) is not None
            if done:
                generated = gen[row]
                self._release(row)
                del self._pending[row]
                out.append(self._finish(row, p, generated))
        return out

    def generated_ids(self, count: torch.Tensor, rows: Sequence[int]) -> dict[int, list[int]]:
        """The ids each of ``rows`` has generated so far, given ``count`` (``(rows,)`` on the host, as read from
        ``d_count``), read back in one copy: one copy per row would cost a device round trip each."""
        width = max((int(count[row]) for row in rows), default=0)
        gen = self.d_gen[:, :width].cpu()
        return {row: gen[row, : int(count[row])].tolist() for row in rows}

    def _finish(self, row: int, p: _Pending, generated: list[int]) -> StepResult:
        """Host bookkeeping of a finished request: stop cut, kept tokens, cache lengths, ``seen``."""
        req, traj, tok = p.request, self.traj[row], self.tokenizer
        gen = list(generated)
        reason = "length"
        if req.stop and StopTokenIndex.needs_text_check(req.stop):
            # a stop seen on the text at a sync: drop what came after it, an EOS included (eager decoding stopped
            # at the stop and never drew that EOS)
            gen = self._trim_to_stop(gen, req.stop)
        eos_at = next((i for i, t in enumerate(gen) if t in self.eos_token_ids), None)
        if eos_at is not None:
            gen, reason = gen[: eos_at + 1], "eos"
        kept, text = len(gen), ""
        if tok is not None:
            text = tok.decode(gen, skip_special_tokens=True)
            cut = find_stop(text, req.stop) if req.stop else None
            if cut is not None:
                text = text[:cut]
                kept = self._tokens_before(gen, text)
                reason = "stop" if reason == "length" else reason
            elif reason == "length" and req.stop and len(gen) < req.max_new_tokens:
                # the device matched a stop token id whose text the full decode does not show: drop that token
                reason, kept = "stop", len(gen) - 1
                text = tok.decode(gen[:kept], skip_special_tokens=True)
        if reason == "eos":
            kept = min(kept, len(gen) - 1)  # EOS ends the turn; it is not part of the trajectory
        traj.ids.extend(gen[:kept])
        # Decoding fed gen[i] at position len0 + i as this role; as in a token-by-token session the last generated
        # token counts as not yet processed, so the role's caches hold [len0, len0 + len(gen) - 1) of the new part.
        fed_end = p.len0 + max(len(gen) - 1, 0)
        written_end = min(fed_end, p.len0 + kept)
        if written_end > p.len0:
            self.scheme.record_forward(traj, req.role, p.len0, written_end)
        self.scheme.finish_step(traj, req.role)
        decode_s = time.perf_counter() - p.t_decode if gen else 0.0
        logits, positions = None, []
        if req.return_logits and p.logits:
            keep = [i for i, pos in enumerate(p.positions) if pos < max(p.len0, fed_end)]
            logits = torch.cat(p.logits)[keep]
            positions = [p.positions[i] for i in keep]
        return StepResult(
            role=self.model.router.name(req.role),
            prefill_tokens=p.prefill_tokens,
            recomputed_tokens=p.recomputed,
            generated_ids=gen,
            text=text,
            kept_tokens=kept,
            prefill_s=p.prefill_s,
            decode_s=decode_s,
            stop_reason=reason,
            logits=logits,
            logit_positions=positions,
            row=row,
        )

    def _trim_to_stop(self, generated: list[int], stops: Sequence[str]) -> list[int]:
        """The shortest prefix of ``generated`` whose text contains a stop string (all of it if none does)."""
        if find_stop(self.tokenizer.decode(generated, skip_special_tokens=True), stops) is None:
            return generated  # the common case (the row ended on its budget or an EOS): one decode, not one a token
        for j in range(1, len(generated) + 1):
            if find_stop(self.tokenizer.decode(generated[:j], skip_special_tokens=True), stops) is not None:
                return generated[:j]
        return generated

    def _tokens_before(self, generated: list[int], text: str) -> int:
        """Largest k such that the first k generated tokens decode to a prefix of ``text``."""
        k = 0
        for j in range(1, len(generated) + 1):
            if text.startswith(self.tokenizer.decode(generated[:j], skip_special_tokens=True)):
                k = j
            else:
                break
        return k

    # ---- conveniences --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, row: int, request: GenerationRequest) -> StepResult:
        """Runs one request to completion; no other row may be generating."""
        if self._pending:
            raise ValueError(f"rows {sorted(self._pending)} are generating: use start()/advance() to batch")
        done = self.start(row, request)
        if done is not None:
            return done
        while True:
            for res in self.advance():
                return res

    @torch.no_grad()
    def score(self, row: int, role: int, options: Sequence[Sequence[int]]) -> list[float]:
        """Teacher-forced log-probability of each option as a continuation of trajectory ``row`` by ``role``.

        The trajectory is left as it was (each option is appended, scored and cut off again).

        Returns:
            the sum of the option's token log-probs, per option.
        """
        self._check_row(row)
        traj = self.traj[row]
        if not traj.ids:
            raise ValueError("the trajectory is empty: append tokens before scoring")
        if row in self._pending:
            raise ValueError(f"row {row} is generating")
        n0 = len(traj.ids)
        scores = []
        for opt in options:
            opt = [int(t) for t in opt]
            if not opt:
                raise ValueError("an option must have at least one token")
            self.append(row, opt)
            logits, positions, _, _ = self.prefill(row, role, return_logits=True, logits_from=n0 - 1)
            self.scheme.finish_step(traj, role)  # the role has now processed the context (its catch-up is done)
            logp = torch.log_softmax(logits.float(), dim=-1)
            idx = [positions.index(n0 - 1 + i) for i in range(len(opt))]
            scores.append(float(sum(logp[j, t] for j, t in zip(idx, opt, strict=True))))
            self.truncate(row, n0)
        return scores
