"""The scheduler: one thread that owns a decode Engine and runs many requests through it (seed 000 §3.3.2).

Each turn of its loop: requests past their deadline or cancelled end; the head of the queue (FCFS) starts
prefilling when a slot is free; the prefilling request advances; one decode step of the occupied slots is
dispatched, and the step before it is read back and its tokens delivered. Reading a step only after the next
one is dispatched keeps the device busy while the host delivers tokens.

How a prompt is prefilled (policy "slo", the seed's):
- the longest prefix the prefix cache holds is copied in, not computed;
- a prompt the cost model streams (prefill_path.choose_prefill_path: long prompts on a GPU) runs
  stream-loaded, with decode steps of the running requests while its expert blocks' copies are in flight: the
  GPU idles for most of each streamed layer below ~32K tokens, so decodes go on while the experts stream in;
- with several prefill devices (Placement.stream_devices), a streamed prompt that arrives while requests decode
  runs on the devices that do not decode, in a thread of its own, while the decode steps go on undisturbed on the
  placement's device (intra-node prefill-decode disaggregation, §3.3.2: both read the one pinned copy of the
  experts); with no decodes running it streams over all of them (distributed stream-loaded prefill, §3.2),
  or, with disaggregate="always", on the same devices apart (the decoding device never prefills, so a request
  that arrives during a long prefill starts decoding at once; the seed's disaggregated SLP);
- otherwise, while requests are decoding, the prompt runs in chunks of `chunk_tokens`, one chunk per decode
  step, so that neither stalls the other for long; with no decodes running it runs whole.
Policy "chunked" is KTransformers' (one chunk of `chunk_tokens` per decode step, whatever the length), kept
for comparison in bench/serve.py.

Events reach each request's `on_event` callback from the scheduler thread: Token per generated token (end of
sequence and stop tokens end the request and are not sent), then exactly one Finished. A failure fails only
the requests it touched: a prefill's its request, a decode step's the requests in that step, whose slots are
then reset; the loop goes on serving.
"""

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from hybridjit.ops.async_experts import raise_gpu_errors
from hybridjit.prefill_path import choose_prefill_path
from hybridjit.sampling import SamplingParams
from hybridjit.serving.engine import Engine, Prefilled, Step, bucket
from hybridjit.serving.online_placement import OnlinePlacement
from hybridjit.serving.prefix_cache import PrefixCache
from hybridjit.stream_prefill import stream_prefill, streaming_devices

log = logging.getLogger(__name__)

POLICIES = ("slo", "chunked")
DISAGGREGATE = ("auto", "always", "never")
# The largest chunk extend runs at once when nothing else waits (its attention scores grow with it).
MAX_CHUNK = 2048


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: list[int]  # token ids, non-empty
    max_tokens: int  # >= 1
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: frozenset[int] = frozenset()  # end the request ("stop") besides the model's end-of-sequence ids
    deadline: float | None = None  # a time.monotonic() value; past it the request ends with reason "deadline"


@dataclasses.dataclass(frozen=True)
class Token:
    id: int


@dataclasses.dataclass(frozen=True)
class Finished:
    reason: str  # "stop" | "length" | "cancelled" | "deadline" | "error"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served by the prefix cache
    error: str | None = None  # what failed, for reason "error"


Event = Token | Finished


class QueueFull(Exception):
    def __init__(self, size: int, retry_after: float):
        super().__init__(f"the request queue is full ({size} waiting); retry after {retry_after:.0f} s")
        self.retry_after = retry_after


class Ticket:
    """A submitted request's handle: cancel() ends it (Finished "cancelled") within one step."""

    def __init__(self, scheduler: "Scheduler"):
        self._scheduler, self.cancelled = scheduler, False

    def cancel(self):
        self.cancelled = True
        self._scheduler._wake()


@dataclasses.dataclass(eq=False)
class _Job:
    request: Request
    on_event: Callable[[Event], None]
    ticket: Ticket
    tokens: list[int]  # the prompt, then every token sampled
    slot: int | None = None
    cache: list | None = None  # the prompt's own cache while it is prefilled
    apart: concurrent.futures.Future | None = None  # its disaggregated stream-loaded prefill, while in flight
    done: int = 0  # prompt tokens in that cache
    cached_tokens: int = 0
    generated: int = 0
    finished: bool = False


class Scheduler:
    """Serves requests on `model` (hybridjit.engine.Model) with `slots` sequences decoding at once, each with
    room for `cache_len` positions (default: the model's context, at most 32768), and at most `max_queue`
    requests waiting. `prefix_cache_bytes` bounds the prefix cache (0 turns it off). `online_placement` re-places
    the model's resident experts by the traffic's use of them (serving.online_placement; default: when some of its
    experts are resident on the device and some are not; `self.online`). `disaggregate` is where long prompts
    stream when the placement has prefill devices besides the one that decodes: "auto" on those devices while
    others decode and over all of them otherwise, "always" on those devices, "never" over all of them."""

    def __init__(
        self,
        model,
        *,
        slots: int = 8,
        max_queue: int = 64,
        cache_len: int | None = None,
        prefix_cache_bytes: int | None = None,
        prefix_block_tokens: int = 64,
        chunk_tokens: int = 256,
        policy: str = "slo",
        online_placement: bool | None = None,
        disaggregate: str = "auto",
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if disaggregate not in DISAGGREGATE:
            raise ValueError(f"disaggregate must be one of {DISAGGREGATE}, got {disaggregate!r}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.model, self.max_queue, self.policy = model, max_queue, policy
        self.chunk_tokens = bucket(chunk_tokens)
        if online_placement is None:
            online_placement = OnlinePlacement.wanted(model)
        self.online = OnlinePlacement(model) if online_placement else None
        self.engine = Engine(model, slots, cache_len or min(model.config.max_position_embeddings, 32768),
                             tally=self.online is not None)
        budget = (1 << 30) if prefix_cache_bytes is None else prefix_cache_bytes
        self.prefix_cache = PrefixCache(prefix_block_tokens, budget) if budget > 0 else None
        self._queue: collections.deque[_Job] = collections.deque()
        self._prefilling: _Job | None = None
        self._active: dict[int, _Job] = {}  # slot -> job
        self._pending: tuple[Step, dict[int, _Job]] | None = None  # a dispatched step not yet read
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps = 0
        others = streaming_devices(model, model.placement.stream_devices[1:])
        if disaggregate == "always" and not others:
            raise ValueError("disaggregate='always': the placement has no prefill device besides the one that decodes")
        self._apart = others if disaggregate != "never" else ()
        self._always_apart = disaggregate == "always"
        self._prefiller = concurrent.futures.ThreadPoolExecutor(1, "hybridjit-prefill") if self._apart else None
        # The prefill thread's last job: one whose request ended while it ran stops at its next executable
        # (stream_prefill's abandon), and a prefill on every device waits for that first (no two on one GPU).
        self._last_apart: concurrent.futures.Future | None = None
        self._abandoning = False  # set as the loop ends: the prefill thread's work stops
        self.disaggregated_prefills = 0  # completed ones

    # --------------------------------------------------------------------------- the public side

    def start(self):
        self._thread = threading.Thread(target=self._loop, name="hybridjit-scheduler", daemon=True)
        self._thread.start()

    def submit(self, request: Request, on_event: Callable[[Event], None]) -> Ticket:
        """Queues a request; raises QueueFull, or ValueError naming the field the model cannot take."""
        self._check(request)
        ticket = Ticket(self)
        with self._cond:
            if self._stopping:
                raise RuntimeError("the scheduler is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(len(self._queue), retry_after=1.0 + len(self._queue) / max(1, self.engine.slots))
            self._queue.append(_Job(request, on_event, ticket, list(request.prompt)))
            self._cond.notify()
        return ticket

    def stats(self) -> dict:
        cache = self.prefix_cache
        return {
            "queue": len(self._queue),
            "slots": self.engine.slots,
            "slots_in_use": int(self.engine.occupied.sum()) + int(self._prefilling is not None),
            "prefix_cache_hits": cache.hits if cache else 0,
            "prefix_cache_hit_tokens": cache.hit_tokens if cache else 0,
            "prefix_cache_bytes": cache.bytes if cache else 0,
            "steps": self.steps,
            "disaggregated_prefills": self.disaggregated_prefills,
        }

    def shutdown(self, timeout: float = 5.0):
        """Cancels what waits and what runs (each gets Finished "cancelled") and stops the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _wake(self):
        with self._cond:
            self._cond.notify()

    def _check(self, request: Request):
        if not request.prompt:
            raise ValueError("prompt: is empty")
        vocab = self.model.config.vocab_size
        if bad := [t for t in request.prompt if not 0 <= t < vocab]:
            raise ValueError(f"prompt: token id {bad[0]} outside the vocabulary [0, {vocab})")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {request.max_tokens}")
        total, room = len(request.prompt) + request.max_tokens, self.engine.cache_len
        if total > room:
            raise ValueError(
                f"max_tokens: the prompt's {len(request.prompt)} tokens + max_tokens {request.max_tokens} = {total} "
                f"exceed the {room} positions a sequence may hold"
            )

    # ----------------------------------------------------------------------------------- the loop

    def _loop(self):
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._queue or self._prefilling or self._active or self._pending):
                        self._cond.wait()
                    if self._stopping:
                        break
                self._end_cancelled_and_late()
                self._admit()
                if self._prefilling is not None:
                    self._advance_prefill()
                self._decode_tick()
        except Exception as e:  # a bug of the loop itself: fail everything rather than hang the clients
            log.exception("the scheduler loop failed")
            self._fail_everything(f"the scheduler failed: {e}")
            raise
        finally:
            self._cancel_everything()
            if self.online is not None:
                self.online.close()
            if self._prefiller is not None:
                self._abandoning = True
                self._prefiller.shutdown(wait=True, cancel_futures=True)

    def _end_cancelled_and_late(self):
        now = time.monotonic()

        def reason(job: _Job) -> str | None:
            if job.ticket.cancelled:
                return "cancelled"
            if job.request.deadline is not None and now > job.request.deadline:
                return "deadline"
            return None

        with self._cond:
            waiting = list(self._queue)
        for job in waiting:
            if why := reason(job):
                with self._cond:
                    self._queue.remove(job)
                self._finish(job, why)
        if self._prefilling is not None and (why := reason(self._prefilling)):
            if self._prefilling.apart is not None:
                self._prefilling.apart.cancel()  # not started yet: never runs; else it abandons (job.finished)
            self._finish(self._prefilling, why)
            self._prefilling = None
        for job in list(self._active.values()):
            if why := reason(job):
                self._finish(job, why)

    def _admit(self):
        """The head of the queue starts prefilling, into the slot it will decode in, when one is free."""
        if self._prefilling is not None or not self.engine.free_slots() or not self._queue:
            return
        with self._cond:
            job = self._queue.popleft()
        job.slot = self.engine.free_slots()[0]  # free until the job is inserted: no other job prefills meanwhile
        self._prefilling = job
        if self.prefix_cache is not None and (blocks := self.prefix_cache.lookup(job.tokens)):
            job.cache = self.engine.new_prompt_cache(len(job.tokens))
            for j, block in enumerate(blocks):
                job.cache = self.engine.write_span(job.cache, block, j * self.prefix_cache.block_tokens)
            job.done = job.cached_tokens = len(blocks) * self.prefix_cache.block_tokens

    def _advance_prefill(self):
        """Runs the prefilling job one chunk further (or whole, or stream-loaded); inserts it when done."""
        job, engine, prompt = self._prefilling, self.engine, self._prefilling.tokens
        params = job.request.sampling
        try:
            decoding = bool(self._active)
            if job.apart is not None:
                if not job.apart.done():
                    if not decoding:  # nothing else to do meanwhile
                        concurrent.futures.wait([job.apart], timeout=0.05)
                    return
                prefilled = job.apart.result()
                self.disaggregated_prefills += 1
            elif job.done == 0 and self.policy == "slo" and self._streams(len(prompt)):
                if self._apart and (decoding or self._always_apart):
                    job.apart = self._last_apart = self._prefiller.submit(self._stream_prefill, job, self._apart)
                    return
                if self._last_apart is not None:
                    concurrent.futures.wait([self._last_apart])  # an abandoned one, ending at its next executable
                prefilled = self._stream_prefill(job)
            elif job.done == 0 and self.policy == "slo" and not decoding and len(prompt) <= MAX_CHUNK:
                prefilled = engine.prefill([prompt], [params])
            else:
                chunk = self.chunk_tokens if decoding or self.policy == "chunked" else MAX_CHUNK
                if job.cache is None:
                    job.cache = engine.new_prompt_cache(len(prompt))
                piece = prompt[job.done : job.done + chunk]
                prefilled = engine.extend(job.cache, piece, job.done, params, min(chunk, bucket(len(piece))))
                job.cache, job.done = prefilled.cache, job.done + len(piece)
                if job.done < len(prompt):
                    return
            first, finite = int(np.asarray(prefilled.tokens)[0]), bool(np.asarray(prefilled.finite)[0])
            if job.apart is None:  # else no CPU kernel ran for it: a flagged error is a decode step's, read there
                raise_gpu_errors()
        except Exception as e:
            log.exception("prefill failed")
            self._finish(job, "error", f"prefill failed: {e}")
            self._prefilling = None
            return
        self._prefilling = None
        job.cache = None
        if job.finished:  # cancelled or late while a stream-loaded prefill ran decode steps
            return
        if not finite:
            self._finish(job, "error", "the logits of the prompt's last token are not finite (NaN or infinity)")
            return
        if self.prefix_cache is not None:
            size = self.prefix_cache.block_tokens
            self.prefix_cache.store(prompt, lambda j: engine.prompt_span(prefilled.cache, j * size, size))
        engine.insert(prefilled, 0, job.slot, params)
        self._active[job.slot] = job
        self._deliver(job, first)

    def _streams(self, length: int) -> bool:
        m = self.model
        return choose_prefill_path(m, 1, length, threshold=m.stream_prefill_threshold) == "stream"

    def _stream_prefill(self, job: _Job, devices: tuple | None = None) -> Prefilled:
        """Stream-loaded prefill of the job's whole prompt: on `devices` (the disaggregated prefill's, in the
        prefill thread), or on the placement's prefill devices with decode steps of the running requests while its
        expert blocks' copies are in flight."""
        engine, prompt = self.engine, job.tokens
        # A disaggregated prefill's empty cache on a device it streams on: the decoding one gets only the result.
        cache = engine.new_prompt_cache(len(prompt), devices[0] if devices else None)
        tokens = np.zeros((1, jax.tree.leaves(cache)[0].shape[1]), np.int32)
        tokens[0, : len(prompt)] = prompt
        lengths = np.array([len(prompt)], np.int32)
        decodes = None if devices else self._decode_between_copies
        abandon = (lambda: job.finished or self._abandoning) if devices else None
        logits, cache = stream_prefill(self.model, tokens, lengths, cache, while_copying=decodes, abandon=abandon,
                                       devices=devices)
        first, finite = engine.sample(logits, job.request.sampling)
        return Prefilled(cache, first, finite, lengths)

    def _decode_between_copies(self) -> bool:
        """One whole decode step (dispatched, run and delivered) while a stream-loaded prefill's expert copy is in
        flight; False when no request decodes."""
        self._decode_tick()
        if self._pending is not None:
            self._read(*self._pending)
            self._pending = None
        return bool(self._active)

    def _decode_tick(self):
        """Dispatches a decode step of the occupied slots (if any), then reads and delivers the previous one."""
        self._end_cancelled_and_late()
        upcoming = None
        if self._active:
            try:
                if self.online is not None:
                    self.online.between_steps()
                upcoming = (self.engine.generate(), dict(self._active))
                self.steps += self.engine.steps
            except Exception as e:
                self._fail_step(dict(self._active), e)
                return
        pending, self._pending = self._pending, upcoming
        if pending is not None:
            self._read(*pending)

    def _read(self, step: Step, jobs: dict[int, _Job]):
        try:
            tokens, finite = step.tokens(), step.finite()
            raise_gpu_errors()
        except Exception as e:
            self._fail_step(jobs, e)
            return
        if self.online is not None:
            self.online.observe(step.routed_experts())
        for slot, job in jobs.items():
            for token, ok in zip(tokens[:, slot], finite[:, slot], strict=True):  # a call's steps, in order
                if job.finished:
                    break
                if not ok:
                    self._finish(job, "error", f"the logits of new token {job.generated + 1} are not finite")
                    break
                self._deliver(job, int(token))

    def _deliver(self, job: _Job, token: int):
        job.tokens.append(token)
        if token in self.model.config.eos_token_ids or token in job.request.stop_token_ids:
            self._finish(job, "stop")
            return
        job.generated += 1
        self._emit(job, Token(token))
        if job.generated >= job.request.max_tokens:
            self._finish(job, "length")

    def _finish(self, job: _Job, reason: str, error: str | None = None):
        if job.finished:
            return
        job.finished = True
        if job.slot is not None and self._active.get(job.slot) is job:
            del self._active[job.slot]
            # A slot whose sliding-window layers keep only their windows (rings) no longer holds the KV of its
            # whole sequence: its blocks are not kept (the prompt's were, from its prefill's cache).
            if self.prefix_cache is not None and reason != "error" and not self.engine.has_rings:
                self._remember(job)
            self.engine.free(job.slot)
        self._emit(job, Finished(reason, len(job.request.prompt), job.generated, job.cached_tokens, error))

    def _emit(self, job: _Job, event: Event):
        try:
            job.on_event(event)
        except Exception:  # the receiver's fault: it loses its events, the others keep theirs
            log.exception("on_event of a request failed")

    def _remember(self, job: _Job):
        """Keeps the KV of what the job's slot holds (its prompt and all its tokens but the last, whose KV no
        step has written yet) in the prefix cache, for a later turn that sends it all back."""
        in_cache = job.tokens[:-1]
        size = self.prefix_cache.block_tokens
        self.prefix_cache.store(in_cache, lambda j: self.engine.read_span(job.slot, j * size, size))

    def _fail_step(self, jobs: dict[int, _Job], error: Exception):
        """A decode step failed: its requests fail, and the decode state (whose donated cache is gone) starts
        afresh; a prompt being prefilled keeps its own cache and slot."""
        log.error("decode step failed: %s", error)
        self._pending = None
        for job in jobs.values():
            self._finish(job, "error", f"decode step failed: {error}")
        for job in list(self._active.values()):
            self._finish(job, "error", f"decode step failed: {error}")
        self.engine.reset()

    def _fail_everything(self, message: str):
        for job in [*self._queue, *([self._prefilling] if self._prefilling else []), *self._active.values()]:
            try:
                self._finish(job, "error", message)
            except Exception:
                log.exception("delivering a failure")

    def _cancel_everything(self):
        with self._cond:
            jobs = [*self._queue, *([self._prefilling] if self._prefilling else []), *self._active.values()]
            self._queue.clear()
        self._prefilling = None
        for job in jobs:
            self._finish(job, "cancelled")
