"""The agents as HTTP clients of a running server: ``eval --server URL``'s executor, and the client ``bench serve``
drives its sessions with.

Each episode keeps its trajectory as text; every role call appends the loop's new text and sends the whole
trajectory as one ``POST /v1/completions`` (``model`` = the role), as LRAgent's LangChain agents do; the completion is
appended to the text. The server matches the text to the trajectory it holds and keeps that trajectory's own tokens,
so a greedy episode through a server gives the records the in-process eval gives (tested on the CPU), while the
server may reuse another episode's cached prefix (the shared system prompt). Constrained choices need teacher-forced
scores, which the completions API does not return: ``eval --server`` refuses ``--constrain``.

Standard library only (``http.client``, one keep-alive connection per thread).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from urllib.parse import urlsplit

from lragent.agents import EpisodeResult, context_bound
from lragent.agents.requests import Generate, Reply, StepStats


class ServerError(ValueError):
    """A request the server answered with an error, or a server that cannot be reached (one line)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def check_server_url(url: str) -> str:
    """The server's base URL without a trailing ``/v1``; raises ``ValueError`` for anything but http://host:port."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--server {url!r}: allowed a URL like http://127.0.0.1:8000 (or .../v1)")
    path = parts.path.rstrip("/")
    if path not in ("", "/v1"):
        raise ValueError(f"--server {url!r}: allowed a URL like http://127.0.0.1:8000 (or .../v1), no other path")
    return f"{parts.scheme}://{parts.netloc}"


@dataclass
class Completion:
    """One completion's answer.

    Attributes:
        text: the generated text.
        finish_reason: ``stop`` or ``length``.
        usage: the response's ``usage``.
        details: the server's ``lragent`` field (prefill, recomputed and trajectory tokens, seconds), if any.
        ttft_s: seconds from sending to the first streamed text (streamed requests only; else the whole request).
        wall_s: seconds of the whole request.
        request: the request's body.
    """

    text: str
    finish_reason: str | None
    usage: dict
    details: dict
    ttft_s: float
    wall_s: float
    request: dict = dataclasses.field(default_factory=dict)


class ServeClient:
    """Requests to one server over a keep-alive connection (not shared between threads).

    Args:
        url: the server (``http://host:port`` or ``.../v1``).
        api_key: sent as ``Authorization: Bearer KEY`` when given.
        timeout: seconds a request may take.
    """

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.base = check_server_url(url)
        parts = urlsplit(self.base)
        self.https = parts.scheme == "https"
        self.host, self.port = parts.hostname, parts.port or (443 if self.https else 80)
        self.api_key = api_key
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            self._conn = kind(self.host, self.port, timeout=self.timeout)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _send(self, method: str, path: str, body: dict | None) -> http.client.HTTPResponse:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        for attempt in (0, 1):  # a kept-alive connection the server closed meanwhile: one fresh try
            conn = self._connection()
            try:
                conn.request(method, path, body=data, headers=headers)
                return conn.getresponse()
            except (ConnectionError, http.client.RemoteDisconnected, http.client.CannotSendRequest) as exc:
                self.close()
                if attempt:
                    raise ServerError(f"--server {self.base}: cannot reach the server ({exc})") from None
            except OSError as exc:
                self.close()
                raise ServerError(f"--server {self.base}: cannot reach the server ({exc})") from None
        raise AssertionError("unreachable")

    @staticmethod
    def _error(resp: http.client.HTTPResponse) -> ServerError:
        raw = resp.read()
        try:
            message = json.loads(raw)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = raw.decode(errors="replace")[:300]
        return ServerError(f"the server answered {resp.status}: {message}", resp.status)

    def get(self, path: str) -> dict | str:
        resp = self._send("GET", path, None)
        if resp.status != 200:
            raise self._error(resp)
        raw = resp.read().decode()
        return json.loads(raw) if resp.getheader("content-type", "").startswith("application/json") else raw

    def completion(self, body: dict) -> Completion:
        """``POST /v1/completions``; streamed when ``body["stream"]`` (then ``ttft_s`` is measured)."""
        started = time.perf_counter()
        resp = self._send("POST", "/v1/completions", body)
        if resp.status != 200:
            raise self._error(resp)
        if not body.get("stream"):
            out = json.loads(resp.read())
            wall = time.perf_counter() - started
            choice = out["choices"][0]
            return Completion(choice["text"], choice["finish_reason"], out["usage"], out.get("lragent") or {}, wall,
                              wall, body)  # fmt: skip
        text, reason, usage, details, first = [], None, {}, {}, None
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise ServerError(f"the server failed the request: {chunk['error']['message']}", 500)
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    if first is None:
                        first = time.perf_counter() - started
                    text.append(choice["text"])
                reason = choice.get("finish_reason") or reason
            usage = chunk.get("usage") or usage
            details = chunk.get("lragent") or details
        resp.read()  # the rest of the stream: the connection is then ready for the next request
        wall = time.perf_counter() - started
        return Completion("".join(text), reason, usage, details, first if first is not None else wall, wall, body)


class ServerPolicy:
    """A :class:`~lragent.agents.Policy` whose every role call is one completions request carrying the trajectory.

    Args:
        client: the server's client (None: the caller sends :meth:`body` and hands the answer to :meth:`answer`).
        temperature: sampling temperature (0: greedy).
        top_p: nucleus mass.
        seed: generate call ``i`` of an episode samples with ``seed + i`` (as :class:`~lragent.agents.SessionPolicy`).
        stream: stream the completions (``bench serve``: time to first token).
    """

    def __init__(
        self, client: ServeClient | None, *, temperature: float, top_p: float, seed: int = 0, stream: bool = False
    ) -> None:
        self.client = client
        self.temperature, self.top_p, self.seed, self.stream = temperature, top_p, seed, stream
        self.text = ""
        self.calls = 0
        self.last_stats: StepStats | None = None
        self.completions: list[Completion] = []

    def reset(self) -> None:
        self.text, self.calls, self.last_stats, self.completions = "", 0, None, []

    def body(self, role: str, new_text: str, max_new_tokens: int, stop: Sequence[str]) -> dict:
        """Appends ``new_text``; the completions request of ``role``'s call on the trajectory."""
        self.text += new_text
        body = {
            "model": role, "prompt": self.text, "max_tokens": max_new_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "seed": self.seed + self.calls, "stop": list(stop) or None,
        }  # fmt: skip
        if self.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        self.calls += 1
        return body

    def answer(self, done: Completion) -> str:
        """Appends the completion's text to the trajectory and keeps its cost in :attr:`last_stats`."""
        self.completions.append(done)
        self.text += done.text
        u, d = done.usage, done.details
        cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        self.last_stats = StepStats(
            prefill_tokens=int(d.get("prefill_tokens", u.get("prompt_tokens", 0) - cached)),
            decode_tokens=int(u.get("completion_tokens", 0)),
            prefill_s=float(d.get("prefill_s", 0.0)),
            decode_s=float(d.get("decode_s", 0.0)),
            recomputed_tokens=int(d.get("recomputed_tokens", 0)),
            trajectory_tokens=int(
                d.get("trajectory_tokens", u.get("prompt_tokens", 0) + u.get("completion_tokens", 0))
            ),
        )
        return done.text

    def generate(self, role: str, new_text: str, *, max_new_tokens: int, stop: list[str]) -> str:
        """Appends ``new_text``, sends the trajectory as ``role``'s completion request, appends the answer."""
        return self.answer(self.client.completion(self.body(role, new_text, max_new_tokens, stop)))

    def choose(self, role: str, new_text: str, options: Sequence[str], **kwargs) -> int:
        raise ServerError(
            "--server: constrained choices (--constrain) score options by teacher forcing, which the completions API "
            "does not return; run them without --server"
        )


class ServerExecutor:
    """Runs episode tasks as clients of a server, ``concurrency`` episodes at a time (one thread each).

    Args:
        url: the server.
        temperature: sampling temperature (0: greedy).
        top_p: nucleus mass.
        concurrency: episodes in flight.
        api_key: the server's key, if it has one.
        stream: stream the completions (time to first token in each :class:`Completion`).
        timeout: seconds one request may take.

    Attributes:
        completions: every request's answer, episode after episode as they end.
        episode_calls: per task key, its episode's answers in order.
    """

    def __init__(
        self,
        url: str,
        *,
        temperature: float,
        top_p: float,
        concurrency: int = 1,
        api_key: str | None = None,
        stream: bool = False,
        timeout: float = 600.0,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.url = check_server_url(url)
        self.temperature, self.top_p = temperature, top_p
        self.concurrency, self.api_key, self.stream = concurrency, api_key, stream
        self.timeout = timeout
        self.completions: list[Completion] = []
        self.episode_calls: dict[object, list[Completion]] = {}
        self._lock = threading.Lock()

    def reserve(self, scheme: object, tasks: int) -> None:
        """Nothing to allocate here: the server holds the caches (the eval command calls it on every executor)."""

    def check(self) -> None:
        """Raises :class:`ServerError` when the server does not answer ``/health`` (one line)."""
        client = ServeClient(self.url, self.api_key, timeout=10)
        try:
            client.get("/health")
        finally:
            client.close()

    def run(self, tasks: Iterable) -> Iterator[tuple[object, EpisodeResult]]:
        """Runs every task it takes (:meth:`~eval_suite.evaluate.executors.EpisodeTask.take`) and yields it with its
        result as
        its episode ends. The episodes (their tools included) run in this thread; only the HTTP requests run in
        ``concurrency`` worker threads, each with its own connection. A request the server refuses ends the run with
        :class:`ServerError`."""
        pending = iter(tasks)
        local = threading.local()
        clients: list[ServeClient] = []

        def call(body: dict) -> Completion:
            if not hasattr(local, "client"):
                local.client = ServeClient(self.url, self.api_key, self.timeout)
                with self._lock:
                    clients.append(local.client)
            return local.client.completion(body)

        def next_task():
            return next((task for task in pending if task.take()), None)

        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="lragent-client")
        inflight: dict[Future, tuple[object, ServerPolicy, object]] = {}

        def advance(task, policy: ServerPolicy, episode, reply: Reply | None) -> EpisodeResult | None:
            """Sends ``reply`` to the episode; submits its next request, or returns its result when it ends."""
            try:
                request = next(episode) if reply is None else episode.send(reply)
            except StopIteration as stop:
                self.completions.extend(policy.completions)
                self.episode_calls[task.key] = policy.completions
                return stop.value
            if not isinstance(request, Generate):
                policy.choose(request.role, request.new_text, request.options)  # raises: not over the API
            body = policy.body(request.role, request.new_text, request.max_new_tokens, request.stop)
            inflight[pool.submit(call, body)] = (task, policy, episode)
            return None

        try:
            while True:
                while len(inflight) < self.concurrency:
                    task = next_task()
                    if task is None:
                        break
                    policy = ServerPolicy(None, temperature=self.temperature, top_p=self.top_p, seed=task.seed,
                                          stream=self.stream)  # fmt: skip
                    result = advance(task, policy, task.episode, None)
                    if result is not None:
                        yield task, result
                if not inflight:
                    return
                done, _ = wait(list(inflight), return_when=FIRST_COMPLETED)
                for fut in done:
                    task, policy, episode = inflight.pop(fut)
                    done_ = fut.result()  # a refused request raises here
                    scheme = done_.details.get("scheme")
                    if scheme is not None and scheme != str(task.scheme):
                        raise ServerError(f"--server {self.url} serves scheme {scheme}, the episode asked for "
                                          f"{task.scheme}: allowed --scheme {scheme} with this server")  # fmt: skip
                    text = policy.answer(done_)
                    result = advance(
                        task, policy, episode, Reply(text=text, stats=dataclasses.replace(policy.last_stats))
                    )
                    if result is not None:
                        yield task, result
        finally:
            for fut in inflight:
                fut.cancel()
            pool.shutdown(wait=True)
            for client in clients:
                client.close()


def served_context_bound(url: str, api_key: str | None = None) -> int | None:
    """The default ``max_context_tokens`` of episodes a server runs: its context (``max_model_len`` of
    ``GET /v1/models``) + 1 less one cycle's reserve (:func:`lragent.agents.context_bound`, as ``eval --batch`` bounds
    its own trajectories), so an episode ends as out of function instead of sending a prompt the server must refuse.
    None when the server states no context or one too short for a reserve. Raises :class:`ServerError` when the server
    cannot be reached or refuses."""
    client = ServeClient(url, api_key, timeout=10)
    try:
        listing = client.get("/v1/models")
    finally:
        client.close()
    lengths = [c.get("max_model_len") for c in listing.get("data", [])] if isinstance(listing, dict) else []
    lengths = [n for n in lengths if isinstance(n, int) and not isinstance(n, bool) and n > 0]
    return context_bound(min(lengths) + 1) if lengths else None


def check_server_args(args: dict, constraints: Sequence[str]) -> None:
    """``eval --server URL``'s checks, before anything runs: the URL, no constrained choices, a numeric --batch (the
    episodes in flight; the server sizes its own memory)."""
    check_server_url(args["server"])
    if constraints:
        raise ValueError(
            f"--server with --constrain {','.join(constraints)}: constrained choices score options by teacher forcing, "
            "which the completions API does not return; allowed --constrain none with --server"
        )
    if args.get("batch") == "auto":
        raise ValueError("--server with --batch auto: the server sizes its own rows; allowed --batch N (episodes in "
                         "flight, default 0: one at a time)")  # fmt: skip


def server_executor(args: dict, temperature: float, top_p: float, batch: int) -> ServerExecutor:
    """The executor of ``eval --server URL``: ``--batch N`` episodes in flight (0 or 1: one), ``$LRAGENT_API_KEY`` as
    the key; checked against the server's ``/health`` before any episode starts."""
    import os

    ex = ServerExecutor(args["server"], temperature=temperature, top_p=top_p, concurrency=max(1, int(batch or 1)),
                        api_key=os.environ.get("LRAGENT_API_KEY") or None)  # fmt: skip
    ex.check()
    return ex
