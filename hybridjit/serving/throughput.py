"""The offline throughput runner: a large set of prompts through one decode Engine, every slot kept busy.

Continuous batching: a slot whose sequence ends takes the next prompt from the queue at once. Prompts are
prefilled in batches (the routed experts of a prefill run over the whole batch's tokens), and each decode step
is the Engine's: with micro_batches, attention runs micro-batch by micro-batch and each layer's routed experts
run as one call over every slot (module-based batching, models/common/decoder.py decode_step_grouped).

The queue is ordered longest prompt first: prompts prefilled together are of similar lengths (little padding),
and no long prompt is left to finish alone at the end. Each sequence samples what it would sample alone (the
Engine's per-slot keys), so the order changes no output.
"""

import collections
import dataclasses
from collections.abc import Callable, Iterator

import numpy as np

from hybridjit.ops.async_experts import raise_gpu_errors
from hybridjit.sampling import SamplingParams
from hybridjit.serving.engine import Engine, Step, bucket
from hybridjit.tokenizer import IncrementalDecoder


@dataclasses.dataclass(frozen=True)
class Job:
    key: object  # the caller's handle, given back with the completion
    prompt: list[int]  # token ids, non-empty
    max_tokens: int  # >= 1
    sampling: SamplingParams = SamplingParams()
    stops: tuple[str, ...] = ()  # stop strings (need the model's tokenizer)


@dataclasses.dataclass(frozen=True)
class Completion:
    job: Job
    token_ids: list[int]  # the generated tokens; an end-of-sequence token is not among them
    text: str | None  # their text, cut before a stop string; None without a tokenizer
    finish_reason: str  # "stop" (end of sequence or a stop string) or "length"


class _Running:
    def __init__(self, job: Job, tokenizer):
        self.job, self.tokens, self.slot, self.finished = job, [], None, False
        self.decoder = IncrementalDecoder(tokenizer, job.stops) if job.stops else None


class NonFiniteLogits(ValueError):
    pass


def cache_len_for(model, jobs: list[Job]) -> int:
    """The KV positions every slot needs: the longest prompt + its max_tokens, bucketed, within the context."""
    longest = max(len(j.prompt) + j.max_tokens for j in jobs)
    return min(bucket(longest), model.config.max_position_embeddings)


class ThroughputRunner:
    """Runs Jobs on `model` with `slots` sequences decoding at once in `micro_batches` attention micro-batches
    (None: the interactive engine's dual-batch overlap instead of coalesced experts), prefilling up to
    `prefill_batch` prompts together, each slot with room for `cache_len` positions; with `stream_experts`, each
    decode step streams the routed experts to the GPU, but `cpu_blocks` of each layer's blocks, which the CPU
    computes meanwhile, the KV cache in host memory with `kv_in_host`, attended over on the CPU with
    `attention_on_cpu` (Engine's stream_experts, cpu_blocks, kv_in_host and attention_on_cpu)."""

    def __init__(self, model, *, slots: int, micro_batches: int | None, prefill_batch: int, cache_len: int,
                 stream_experts: bool = False, cpu_blocks: int = 0, kv_in_host: bool = False,
                 attention_on_cpu: bool = False):  # fmt: skip
        if prefill_batch < 1:
            raise ValueError(f"prefill_batch must be >= 1, got {prefill_batch}")
        self.model, self.prefill_batch = model, prefill_batch
        self.engine = Engine(model, slots, cache_len, micro_batches, stream_experts=stream_experts,
                             cpu_blocks=cpu_blocks, kv_in_host=kv_in_host, attention_on_cpu=attention_on_cpu)

    def run(self, jobs: list[Job], on_tokens: Callable[[int], None] | None = None) -> Iterator[Completion]:
        """Yields each job's Completion as it ends (not in the jobs' order); `on_tokens(n)` hears of the n tokens
        each prefill or step added to the completions (end-of-sequence tokens are not counted)."""
        for job in jobs:
            if len(job.prompt) + job.max_tokens > self.engine.cache_len:
                room = self.engine.cache_len
                raise ValueError(f"{job.key!r}: prompt + max_tokens exceed the slots' {room} positions")
        self.engine.reset()
        self._on_tokens = on_tokens or (lambda n: None)
        self._delivered = 0  # tokens appended to completions since the last report
        queue = collections.deque(_Running(j, self.model.tokenizer) for j in sorted(jobs, key=lambda j: -len(j.prompt)))
        self._active: dict[int, _Running] = {}
        pending: tuple[Step, dict[int, _Running]] | None = None
        while queue or self._active or pending:
            done: list[Completion] = []
            self._admit(queue, done)
            upcoming = (self.engine.generate(), dict(self._active)) if self._active else None
            if pending is not None:  # read the step before only once the next one is dispatched
                self._read(*pending, done)
            pending = upcoming
            yield from done

    def _admit(self, queue: collections.deque, done: list[Completion]):
        """Prefills the next prompts together into free slots: a whole prefill batch once that many slots are
        free, or what is left of the queue."""
        free = self.engine.free_slots()
        count = min(len(free), self.prefill_batch, len(queue))
        if not count or count < min(self.prefill_batch, len(queue)):
            return
        batch = [queue.popleft() for _ in range(count)]
        # Rows padded to a power of two (copies of the last prompt, never inserted): few prefill shapes to compile.
        rows = [r.job for r in batch] + [batch[-1].job] * (bucket(count) - count if count > 1 else 0)
        prefilled = self.engine.prefill([j.prompt for j in rows], [j.sampling for j in rows])
        first, finite = np.asarray(prefilled.tokens), np.asarray(prefilled.finite)
        raise_gpu_errors()
        for row, (running, slot) in enumerate(zip(batch, free, strict=False)):
            self._check_finite(running, bool(finite[row]))
            self._deliver(running, int(first[row]), done)
            if not running.finished:
                self.engine.insert(prefilled, row, slot, running.job.sampling)
                running.slot = slot
                self._active[slot] = running
        self._report_tokens()

    def _read(self, step: Step, jobs: dict[int, _Running], done: list[Completion]):
        tokens, finite = step.tokens(), step.finite()
        raise_gpu_errors()  # a CPU expert job that failed while the GPU waited: its step is garbage
        for slot, running in jobs.items():
            for token, ok in zip(tokens[:, slot], finite[:, slot], strict=True):  # a call's steps, in order
                if running.finished:
                    break
                self._check_finite(running, bool(ok))
                self._deliver(running, int(token), done)
        self._report_tokens()

    def _report_tokens(self):
        self._on_tokens(self._delivered)
        self._delivered = 0

    def _check_finite(self, running: _Running, finite: bool):
        if not finite:
            raise NonFiniteLogits(
                f"{running.job.key!r}: the logits of new token {len(running.tokens) + 1} are not finite (NaN or "
                "infinity): the weights are corrupt, or config.json holds values that break the math"
            )

    def _deliver(self, running: _Running, token: int, done: list[Completion]):
        if token in self.model.config.eos_token_ids:
            return self._finish(running, "stop", done)
        running.tokens.append(token)
        self._delivered += 1
        if running.decoder is not None:
            running.decoder.push(token)
            if running.decoder.stopped:
                return self._finish(running, "stop", done)
        if len(running.tokens) >= running.job.max_tokens:
            self._finish(running, "length", done)

    def _finish(self, running: _Running, reason: str, done: list[Completion]):
        running.finished = True
        if running.slot is not None:
            del self._active[running.slot]
            self.engine.free(running.slot)
        done.append(Completion(running.job, running.tokens, self._text(running), reason))

    def _text(self, running: _Running) -> str | None:
        if running.decoder is not None:  # what it has emitted (up to a stop string) and what it held back
            return running.decoder.text[: running.decoder.emitted] + running.decoder.flush()
        tokenizer = self.model.tokenizer
        return tokenizer.decode(running.tokens) if tokenizer is not None else None
