"""The server's counters, gauges and histograms, rendered as Prometheus text (exposition format 0.0.4).

Written by the scheduler's thread, read by the HTTP front end's (``GET /metrics``): every access holds one lock. The
names follow vLLM's where they mean the same thing, under the ``lragent_`` prefix.
"""

from __future__ import annotations

import bisect
import gc
import threading
import time
from collections.abc import Sequence

TTFT_BUCKETS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Seconds from a request's arrival to its first generated token."""
TPOT_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Seconds per generated token after the first."""
WORKER_PHASES: tuple[str, ...] = ("admit", "decode", "capture", "idle", "other")
"""Where the scheduler's thread spends its time (``lragent_worker_seconds_total``)."""
ADMIT_PARTS: tuple[str, ...] = ("match", "tokenize", "rows", "start")
"""Where the placing of requests in the admit phase goes (``lragent_admit_seconds_total``): matching the prompt against
the held trajectories (text and token comparisons), the tokenizer's calls on its new text, readying the row (an
eviction, a fork or a cut, the new tokens appended), and the engine's start of the generation (its first tokens fed or
prefilled)."""
GC_GENERATIONS: tuple[str, ...] = ("0", "1", "2")
"""Python's collector generations (``lragent_gc_seconds_total``): a collection pauses every thread of the process."""


class Histogram:
    """Cumulative buckets, a sum and a count.

    Args:
        buckets: upper bounds, increasing (``+Inf`` is added).
    """

    def __init__(self, buckets: Sequence[float]) -> None:
        if list(buckets) != sorted(buckets) or not buckets:
            raise ValueError(f"histogram buckets must be increasing and non-empty, got {list(buckets)}")
        self.buckets = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, n in zip([*self.buckets, float("inf")], self.counts, strict=True):
            total += n
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            out.append(f'{name}_bucket{{le="{le}"}} {total}')
        return [*out, f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]


class ServeMetrics:
    """What ``/metrics`` reports; see :meth:`render` for the names."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        self.peak_running = 0
        self.peak_waiting = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.requests: dict[str, int] = {}
        self.evictions = 0
        self.forks = 0
        self.trajectories = 0
        self.cache_bytes: dict[str, int] = {}
        self.peak_cache_bytes = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.decode_steps = 0
        self.worker_s = dict.fromkeys(WORKER_PHASES, 0.0)
        self.admit_s = dict.fromkeys(ADMIT_PARTS, 0.0)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.gc_s = dict.fromkeys(GC_GENERATIONS, 0.0)
        self.gc_collections = dict.fromkeys(GC_GENERATIONS, 0)
        self._gc_t0: float | None = None

    def set_queue(self, running: int, waiting: int) -> None:
        with self._lock:
            self.running, self.waiting = running, waiting
            self.peak_running = max(self.peak_running, running)
            self.peak_waiting = max(self.peak_waiting, waiting)

    def set_cache(self, trajectories: int, cache_bytes: dict[str, int]) -> None:
        with self._lock:
            self.trajectories = trajectories
            self.cache_bytes = dict(cache_bytes)
            self.peak_cache_bytes = max(self.peak_cache_bytes, sum(cache_bytes.values()))

    def worker_time(self, phase: str, seconds: float, decode_steps: int = 0) -> None:
        """Adds ``seconds`` of the worker thread to ``phase`` (one of :data:`WORKER_PHASES`) and the decode steps
        it ran."""
        with self._lock:
            self.worker_s[phase] += seconds
            self.decode_steps += decode_steps

    def admit_time(self, part: str, seconds: float) -> None:
        """Adds ``seconds`` of placing requests to ``part`` (one of :data:`ADMIT_PARTS`; they lie inside the worker's
        admit phase)."""
        with self._lock:
            self.admit_s[part] += seconds

    def watch_gc(self) -> None:
        """Counts the seconds of Python's garbage collections in this process from now on, by generation (once,
        however often called)."""
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def unwatch_gc(self) -> None:
        """Stops counting collections."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        # No lock: a collection can start inside any allocation, also one made while this thread holds the lock
        # (it would wait for itself); collections never overlap, and a reader sees each float whole.
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            generation = str(info["generation"])
            self.gc_s[generation] += time.perf_counter() - self._gc_t0
            self.gc_collections[generation] += 1
            self._gc_t0 = None

    def count_event(self, evicted: bool = False, forked: bool = False) -> None:
        with self._lock:
            self.evictions += int(evicted)
            self.forks += int(forked)

    def finished(
        self,
        outcome: str,
        prompt_tokens: int = 0,
        generation_tokens: int = 0,
        cached_tokens: int = 0,
        ttft_s: float | None = None,
        tpot_s: float | None = None,
    ) -> None:
        """Counts one request that ended (``outcome``: ``stop``, ``length``, ``cancelled``, ``error``)."""
        with self._lock:
            self.requests[outcome] = self.requests.get(outcome, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generation_tokens
            self.cached_tokens += cached_tokens
            if ttft_s is not None:
                self.ttft.observe(ttft_s)
            if tpot_s is not None:
                self.tpot.observe(tpot_s)

    def snapshot(self) -> dict:
        """The plain numbers (tests, ``bench serve``)."""
        with self._lock:
            return {
                "running": self.running,
                "waiting": self.waiting,
                "peak_running": self.peak_running,
                "peak_waiting": self.peak_waiting,
                "prompt_tokens": self.prompt_tokens,
                "generation_tokens": self.generation_tokens,
                "cached_tokens": self.cached_tokens,
                "requests": dict(self.requests),
                "evictions": self.evictions,
                "forks": self.forks,
                "trajectories": self.trajectories,
                "cache_bytes": dict(self.cache_bytes),
                "peak_cache_bytes": self.peak_cache_bytes,
                "decode_steps": self.decode_steps,
                "worker_s": dict(self.worker_s),
                "admit_s": dict(self.admit_s),
                "gc_s": dict(self.gc_s),
                "gc_collections": dict(self.gc_collections),
            }

    def render(self) -> str:
        """Prometheus text."""
        with self._lock:
            lines: list[str] = []

            def metric(name: str, kind: str, doc: str, samples: list[str] | int | float) -> None:
                """One metric's HELP and TYPE lines, then its samples (a lone value: the one unlabelled sample)."""
                if not isinstance(samples, list):
                    samples = [f"{name} {samples}"]
                lines.extend([f"# HELP {name} {doc}", f"# TYPE {name} {kind}", *samples])

            metric("lragent_num_requests_running", "gauge", "Requests generating in the engine's rows.",
                   self.running)  # fmt: skip
            metric("lragent_num_requests_waiting", "gauge", "Requests waiting for a row.",
                   self.waiting)  # fmt: skip
            metric("lragent_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                   self.prompt_tokens)  # fmt: skip
            metric("lragent_generation_tokens_total", "counter", "Generated tokens of finished requests.",
                   self.generation_tokens)  # fmt: skip
            metric("lragent_cached_prompt_tokens_total", "counter",
                   "Prompt tokens read from a held trajectory's caches instead of computed.",
                   self.cached_tokens)  # fmt: skip
            metric(
                "lragent_requests_total",
                "counter",
                "Finished requests by outcome.",
                [f'lragent_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(self.requests.items())],
            )
            metric("lragent_trajectories", "gauge", "Trajectories held in the engine's rows.",
                   self.trajectories)  # fmt: skip
            metric("lragent_trajectory_evictions_total", "counter", "Least recently used trajectories evicted.",
                   self.evictions)  # fmt: skip
            metric("lragent_trajectory_forks_total", "counter",
                   "Trajectories started from another's shared prefix (its caches copied).",
                   self.forks)  # fmt: skip
            metric(
                "lragent_cache_bytes",
                "gauge",
                "Bytes the caches hold (valid positions) by component.",
                [f'lragent_cache_bytes{{component="{k}"}} {v}' for k, v in sorted(self.cache_bytes.items())],
            )
            metric("lragent_cache_bytes_peak", "gauge", "Peak of the caches' total bytes.",
                   self.peak_cache_bytes)  # fmt: skip
            metric("lragent_decode_steps_total", "counter",
                   "Batched decode steps the engine ran (generated tokens over them: the mean batch).",
                   self.decode_steps)  # fmt: skip
            metric(
                "lragent_worker_seconds_total",
                "counter",
                "Seconds of the scheduler's thread by phase: admit (matching, prefills), decode (batched steps, "
                "streaming), capture (CUDA graphs for a new decode width), idle (waiting for requests), other.",
                [f'lragent_worker_seconds_total{{phase="{k}"}} {v}' for k, v in self.worker_s.items()],
            )
            metric(
                "lragent_admit_seconds_total",
                "counter",
                "Seconds of placing requests, within the admit phase: match (the prompt against the held "
                "trajectories), tokenize (the tokenizer's calls on its new text), rows (eviction, fork or cut, the new "
                "tokens appended), start (the engine's start of the generation).",
                [f'lragent_admit_seconds_total{{part="{k}"}} {v}' for k, v in self.admit_s.items()],
            )
            metric(
                "lragent_gc_seconds_total",
                "counter",
                "Seconds of Python's garbage collections in the server process by generation (each pauses every "
                "thread, the scheduler's included; counted once the server runs).",
                [f'lragent_gc_seconds_total{{generation="{k}"}} {v}' for k, v in self.gc_s.items()],
            )
            metric(
                "lragent_gc_collections_total",
                "counter",
                "Python's garbage collections in the server process by generation.",
                [f'lragent_gc_collections_total{{generation="{k}"}} {v}' for k, v in self.gc_collections.items()],
            )
            metric("lragent_time_to_first_token_seconds", "histogram",
                   "Seconds from a request's arrival to its first generated token.",
                   self.ttft.lines("lragent_time_to_first_token_seconds"))  # fmt: skip
            metric("lragent_time_per_output_token_seconds", "histogram",
                   "Seconds per generated token after the first, per request.",
                   self.tpot.lines("lragent_time_per_output_token_seconds"))  # fmt: skip
            return "\n".join(lines) + "\n"
