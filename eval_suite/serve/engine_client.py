"""The HTTP handlers' side of the scheduler: a request's events, from the worker thread into the event loop.

:meth:`EngineClient.open` submits a :class:`~lragent.serving.scheduler.ServeRequest` whose sink puts each event on an
``asyncio.Queue`` of the handler's loop (thread-safe, never blocking the worker). :class:`RequestEvents` hands them
out one by one; while it waits it checks, every :data:`POLL_S` seconds, whether the client is still there, and a
client that left cancels its request (it leaves the queue, or its row stops generating). Closing the events of a
request that has not finished (a streaming response whose client went away) cancels it too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from eval_suite.serve.protocol import ProtocolError
from lragent.serving.scheduler import Event, Failed, Finished, RequestError, Scheduler, ServeRequest

POLL_S = 0.5
"""Seconds between checks that a waiting client is still connected."""


class ClientGone(Exception):
    """The client disconnected while its request was served (it was cancelled)."""


class RequestEvents:
    """The events of one submitted request."""

    def __init__(
        self, req: ServeRequest, queue: asyncio.Queue, disconnected: Callable[[], Awaitable[bool]] | None
    ) -> None:
        self.req = req
        self.queue = queue
        self.disconnected = disconnected
        self.ended = False

    async def next(self) -> Event:
        """The next event; raises :class:`ClientGone` (the request cancelled) when the client has left."""
        while True:
            try:
                event = await asyncio.wait_for(self.queue.get(), POLL_S)
            except TimeoutError:
                if self.disconnected is not None and await self.disconnected():
                    self.close()
                    raise ClientGone from None
                continue
            if isinstance(event, Finished | Failed):
                self.ended = True
            return event

    async def result(self) -> Finished | Failed:
        """Waits for the end of the request (skipping streamed text)."""
        while True:
            event = await self.next()
            if isinstance(event, Finished | Failed):
                return event

    def close(self) -> None:
        """Cancels the request unless it has ended."""
        if not self.ended:
            self.req.cancel()
            self.ended = True


class EngineClient:
    """Submits requests to the scheduler from the event loop.

    Args:
        scheduler: the running scheduler.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def open(self, disconnected: Callable[[], Awaitable[bool]] | None = None, **fields) -> RequestEvents:
        """Submits a request with ``fields`` (those of :class:`~lragent.serving.scheduler.ServeRequest` but the
        sink). Raises :class:`~eval_suite.serve.protocol.ProtocolError` when the scheduler refuses it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def sink(event: Event) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        req = ServeRequest(sink=sink, **fields)
        try:
            self.scheduler.submit(req)
        except RequestError as exc:
            raise ProtocolError(str(exc), exc.param, exc.code, exc.status) from None
        return RequestEvents(req, queue, disconnected)
