"""PROVISIONAL: the scheduler's interface (issue #22), serving requests one at a time on a thread.

A stand-in for the slot engine's scheduler, with its interface, so that the server above it runs end to end:
each request is a `Model.stream` over token ids, and the next waits in a bounded queue until it is done.
"""

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hybridjit.sampling import SamplingParams


@dataclass(frozen=True)
class Request:
    prompt: list[int]  # token ids, non-empty
    max_tokens: int  # >= 1
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: frozenset[int] = frozenset()  # end the request (finish "stop"), besides the model's eos ids
    deadline: float | None = None  # a time.monotonic() value; past it the request ends with reason "deadline"


@dataclass(frozen=True)
class Token:
    """Event: one generated token id (eos and stop tokens are not sent: they end the request)."""

    id: int


@dataclass(frozen=True)
class Finished:
    """Event: always exactly one per request, always the last."""

    reason: str  # "stop" (eos or stop token) | "length" | "cancelled" | "deadline" | "error"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # for reason "error": what failed


class QueueFull(Exception):
    def __init__(self, retry_after: float):
        super().__init__(f"the request queue is full; retry in {retry_after:g} s")
        self.retry_after = retry_after


class Ticket:
    def __init__(self):
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Ends the request with Finished("cancelled") within one step; thread-safe and idempotent."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


EventCallback = Callable[[Token | Finished], None]
RETRY_AFTER_SECONDS = 1.0


class Scheduler:
    """Runs submitted requests in order on one thread. `slots` is accepted for the interface: this one has one."""

    def __init__(self, model, *, slots: int = 8, max_queue: int = 64, prefix_cache_bytes: int | None = None):
        self.model = model
        self._queue: queue.Queue[tuple[Request, EventCallback, Ticket] | None] = queue.Queue(maxsize=max_queue)
        self._running: Ticket | None = None
        self._thread = threading.Thread(target=self._serve, name="hybridjit-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request, on_event: EventCallback) -> Ticket:
        """Queues a request; `on_event` is called from the scheduler thread and must not block."""
        context = self.model.config.max_position_embeddings
        if not request.prompt:
            raise ValueError("prompt is empty")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
        if len(request.prompt) + request.max_tokens > context:
            raise ValueError(
                f"prompt of {len(request.prompt)} tokens + max_tokens {request.max_tokens} exceeds the model's "
                f"context of {context}"
            )
        ticket = Ticket()
        try:
            self._queue.put_nowait((request, on_event, ticket))
        except queue.Full:
            raise QueueFull(RETRY_AFTER_SECONDS) from None
        return ticket

    def stats(self) -> dict:
        return {
            "queue": self._queue.qsize(),
            "slots": 1,
            "slots_in_use": int(self._running is not None),
            "prefix_cache_hits": 0,
            "prefix_cache_hit_tokens": 0,
            "prefix_cache_bytes": 0,
        }

    def shutdown(self, timeout: float = 5.0) -> None:
        """Cancels the running and the queued requests (each gets Finished "cancelled") and joins the thread."""
        if self._running is not None:
            self._running.cancel()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                request, on_event, _ = item
                on_event(Finished("cancelled", len(request.prompt), 0))
        self._queue.put(None)
        self._thread.join(timeout)

    def _serve(self):
        while (item := self._queue.get()) is not None:
            request, on_event, ticket = item
            self._running = ticket
            on_event(self._run(request, on_event, ticket))
            self._running = None

    def _run(self, request: Request, on_event: EventCallback, ticket: Ticket) -> Finished:
        """Streams the request's tokens to on_event; returns its Finished event."""
        produced = 0

        def finished(reason: str, error: str | None = None) -> Finished:
            return Finished(reason, len(request.prompt), produced, error=error)

        def interrupted() -> str | None:
            if ticket.cancelled:
                return "cancelled"
            if request.deadline is not None and time.monotonic() > request.deadline:
                return "deadline"
            return None

        if reason := interrupted():
            return finished(reason)
        params = request.sampling
        try:
            tokens = self.model.stream(
                request.prompt, max_new_tokens=request.max_tokens, temperature=params.temperature,
                top_p=params.top_p, top_k=params.top_k, seed=params.seed,
            )  # fmt: skip
            for token in tokens:
                produced += 1
                if token in request.stop_token_ids:
                    return finished("stop")
                on_event(Token(token))
                if reason := interrupted():
                    return finished(reason)
        except Exception as e:  # the request fails, the scheduler goes on
            return finished("error", f"{type(e).__name__}: {e}")
        # Model.stream ends early only at an end-of-sequence token, which it does not yield.
        return finished("length" if produced == request.max_tokens else "stop")
