"""RequestHandle: the caller's end of one request. The scheduler thread pushes events; callers read them with
`async for` (server) or `events()` (blocking), from any thread or event loop."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from collections.abc import Iterator

from qwen_jax.engine.api import GenerationRequest, TokenEvent, TokenLogprob


@dataclasses.dataclass(frozen=True)
class Completion:
    """A whole reply, from `RequestHandle.result()`."""
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    logprobs: tuple[TokenLogprob, ...] | None = None
    error: str | None = None
    stop_reason: str | int | None = None  # TokenEvent.stop_reason


class RequestHandle:
    def __init__(self, request: GenerationRequest, canceller):
        self.request = request
        self.request_id = request.request_id
        self.prompt_tokens = len(request.prompt_ids)
        self.prompt_key = hash(request.prompt_ids)  # finds requests with the same prompt cheaply (engine._follows)
        self.cached_tokens = 0  # prompt tokens resumed from the prompt cache (set when the request starts)
        self.completion_tokens = 0
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self._canceller = canceller
        self._events: collections.deque[TokenEvent] = collections.deque()
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._ended = False  # the final event has been handed to the reader

    def cancel(self) -> None:
        """Stop the request at the next round (a queued one never starts); its last event says "cancelled".
        Safe to call from any thread, any number of times, also after it finished."""
        if self.finish_reason is None:
            self._canceller(self)

    # -- producer side (scheduler thread)

    def _push(self, event: TokenEvent) -> None:
        with self._cond:
            if self.finish_reason is not None:
                return
            now = time.monotonic()
            if event.token_ids:
                self.completion_tokens += len(event.token_ids)
                if self.first_token_time is None:
                    self.first_token_time = now
            if event.finish_reason is not None:
                self.finish_reason = event.finish_reason
                self.finish_time = now
            self._events.append(event)
            self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        for loop, ev in waiters:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # that loop is closed; its reader is gone
                pass

    # -- consumer side

    def _pop(self) -> TokenEvent | None:
        if self._events:
            ev = self._events.popleft()
            if ev.finish_reason is not None:
                self._ended = True
            return ev
        return None

    def events(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        """Blocking iterator over the events, ending after the one with finish_reason. timeout: seconds to wait
        for each event (TimeoutError when exceeded)."""
        while True:
            with self._cond:
                if self._ended and not self._events:
                    return
                if not self._events and not self._cond.wait_for(lambda: bool(self._events), timeout):
                    raise TimeoutError(f"request {self.request_id!r}: no event within {timeout} s")
                ev = self._pop()
            yield ev
            if ev.finish_reason is not None:
                return

    def __aiter__(self) -> "RequestHandle":
        return self

    async def __anext__(self) -> TokenEvent:
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._ended and not self._events:
                    raise StopAsyncIteration
                ev = self._pop()
                if ev is None:
                    ready = asyncio.Event()
                    self._waiters.append((loop, ready))
            if ev is not None:
                return ev
            await ready.wait()

    def result(self, timeout: float | None = None) -> Completion:
        """Read every remaining event and return the whole reply."""
        ids: list[int] = []
        text: list[str] = []
        lps: list[TokenLogprob] = []
        last = None
        for ev in self.events(timeout):
            ids += ev.token_ids
            text.append(ev.text)
            if ev.logprobs:
                lps += ev.logprobs
            last = ev
        if last is None:
            raise RuntimeError(f"request {self.request_id!r}: its events were already read")
        return Completion(tuple(ids), "".join(text), last.finish_reason, tuple(lps) if lps else None, last.error,
                          last.stop_reason)
