"""The serving scheduler and its decode engine with slots, on the embedded model, in process: requests that join
and leave a running batch get exactly what they would get alone, whatever shares their steps; the prefix
cache, cancellation, deadlines, admission control and failures, each with what the client sees."""

import threading
import time

import jax
import numpy as np
import pytest
from hybrid_placement import hybrid

import hybridjit
from hybridjit.placement import Placement
from hybridjit.sampling import SamplingParams
from hybridjit.serving import engine as serving_engine
from hybridjit.serving.scheduler import Finished, QueueFull, Request, Scheduler, Token

WAIT_S = 120  # a generous bound on any one request: a hang fails the test instead of stalling the suite


@pytest.fixture(scope="module")
def model():
    """On the CPU in float32 wherever the tests run: what they compare is exact there. (On a GPU, bf16 or TF32
    GEMMs give a row slightly different logits in a batch of 4 than alone, and greedy ties may then break apart;
    the GPU's decode paths have their own tests, test_gpu.py and test_dual_batch.py.)"""
    m = hybridjit.load(placement=Placement.default("float32", jax.devices("cpu")[0]))
    yield m
    m.close()


class Collector:
    """on_event of one request: its tokens, then its Finished."""

    def __init__(self):
        self.tokens, self.finished, self.done = [], None, threading.Event()
        self.after_finished = 0

    def __call__(self, event):
        if self.finished is not None:
            self.after_finished += 1
        elif isinstance(event, Token):
            self.tokens.append(event.id)
        else:
            assert isinstance(event, Finished)
            self.finished = event
            self.done.set()

    def wait(self) -> Finished:
        assert self.done.wait(WAIT_S), "the request never finished"
        return self.finished


def prompts(model, n, rng):
    """n prompts of the corpus's kind, of mixed lengths (1 to ~120 tokens)."""
    text = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n" * 4
    ids = model.tokenizer.encode(text)
    return [ids[: int(rng.integers(1, len(ids)))] for _ in range(n)]


def solo(model, prompt, max_tokens, **sampling):
    """What generate gives the prompt alone, one decode step a call, cut where the scheduler ends it (an
    end-of-sequence token is not sent)."""
    steps, model.decode_steps = model.decode_steps, None
    try:
        out = model.generate(prompt, max_new_tokens=max_tokens, **sampling)
    finally:
        model.decode_steps = steps
    for i, token in enumerate(out):
        if token in model.config.eos_token_ids:
            return out[:i], "stop"
    return out, "length"


def run_all(scheduler, requests):
    collectors = [Collector() for _ in requests]
    for request, collector in zip(requests, collectors, strict=True):
        scheduler.submit(request, collector)
    return [c.wait() for c in collectors], collectors


@pytest.fixture
def scheduler_of(model):
    started = []

    def make(**options):
        s = Scheduler(model, **options)
        s.start()
        started.append(s)
        return s

    yield make
    for s in started:
        s.shutdown()


def idle(scheduler) -> bool:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        stats = scheduler.stats()
        if stats["slots_in_use"] == 0 and stats["queue"] == 0:
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def decode_steps(model, request):
    """Runs a test with the engine's calls of `request.param` decode steps each (None: its own choice, one step a
    call on the CPU), as a whole-GPU model decodes."""
    model.decode_steps = request.param
    yield request.param
    model.decode_steps = None


@pytest.mark.parametrize(
    ("policy", "decode_steps", "min_span"),
    [("slo", None, None), ("chunked", None, None), ("slo", 3, None), ("slo", None, 16), ("slo", 3, 16)],
    indirect=["decode_steps"],
)
def test_concurrent_requests_get_what_they_get_alone(model, scheduler_of, policy, decode_steps, min_span,
                                                     monkeypatch):
    """min_span 16: decode calls attend over 16, 32, ... of the 256 cache positions as the slots fill (a server's
    1024 of a 32K-position cache), the span growing between calls."""
    if min_span:
        monkeypatch.setattr(serving_engine, "MIN_SPAN", min_span)
    rng = np.random.default_rng(0)
    batch = prompts(model, 10, rng)
    lengths = [int(n) for n in rng.integers(1, 24, len(batch))]
    scheduler = scheduler_of(slots=4, policy=policy, chunk_tokens=16, cache_len=256)
    finished, collectors = run_all(scheduler, [Request(p, n) for p, n in zip(batch, lengths, strict=True)])
    for prompt, n, done, got in zip(batch, lengths, finished, collectors, strict=True):
        expected, reason = solo(model, prompt, n)
        assert got.tokens == expected
        assert (done.reason, done.prompt_tokens, done.completion_tokens) == (reason, len(prompt), len(expected))
        assert got.after_finished == 0
    assert idle(scheduler)


@pytest.mark.parametrize("decode_steps", [None, 4], indirect=True)
def test_sampled_requests_are_reproducible_whoever_shares_the_step(model, scheduler_of, decode_steps):
    rng = np.random.default_rng(1)
    batch = prompts(model, 6, rng)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=s) for s in range(len(batch))]
    scheduler = scheduler_of(slots=3, cache_len=256)
    _, collectors = run_all(scheduler, [Request(p, 12, q) for p, q in zip(batch, params, strict=True)])
    for prompt, p, got in zip(batch, params, collectors, strict=True):
        expected, _ = solo(model, prompt, 12, temperature=p.temperature, top_p=p.top_p, seed=p.seed)
        assert got.tokens == expected


@pytest.mark.parametrize("decode_steps", [4], indirect=True)
def test_requests_that_fill_their_slots_to_the_last_position(model, scheduler_of, decode_steps):
    """Calls of several steps run past a request's last token and past the end of its slot's cache: those steps
    are dropped, and the next request in the slot sees nothing of them."""
    rng = np.random.default_rng(4)
    cache_len = 40
    batch = [p[: cache_len - n] for p, n in zip(prompts(model, 6, rng), (9, 10, 11, 3, 17, 1), strict=True)]
    lengths = [cache_len - len(p) for p in batch]
    scheduler = scheduler_of(slots=2, cache_len=cache_len)
    finished, collectors = run_all(scheduler, [Request(p, n) for p, n in zip(batch, lengths, strict=True)])
    for prompt, n, done, got in zip(batch, lengths, finished, collectors, strict=True):
        expected, reason = solo(model, prompt, n)
        assert (got.tokens, done.reason) == (expected, reason)
    assert idle(scheduler)


@pytest.mark.parametrize("decode_steps", [0, -2, 2.5], indirect=True)
def test_a_bad_number_of_decode_steps_is_refused_by_name(model, decode_steps):
    with pytest.raises(ValueError, match="decode_steps must be an integer >= 1"):
        model.generate([5, 6, 7], max_new_tokens=2)


def test_the_engine_refuses_a_prompt_longer_than_its_slots_by_name(model):
    engine = serving_engine.Engine(model, 2, 16)
    with pytest.raises(ValueError, match="seqs: a prompt of 17 tokens does not fit slots of 16 positions"):
        engine.prefill([[5] * 3, [5] * 17], [SamplingParams()] * 2)


@pytest.mark.parametrize("decode_steps", [None, 3], indirect=True)
def test_a_shared_prefix_is_served_from_the_cache(model, scheduler_of, decode_steps):
    scheduler = scheduler_of(slots=2, cache_len=512, prefix_block_tokens=16)
    first = prompts(model, 1, np.random.default_rng(2))[0][:70] or [5]
    (done,), (got,) = run_all(scheduler, [Request(first, 8)])
    assert done.cached_tokens == 0
    # The next turn sends the whole conversation back, plus a new question.
    turn = first + got.tokens + model.tokenizer.encode("\nprint(")
    (done,), (again,) = run_all(scheduler, [Request(turn, 8)])
    in_cache = len(first) + len(got.tokens) - 1  # the last token's KV is never written by its own request
    assert done.cached_tokens == in_cache // 16 * 16 > 0
    assert again.tokens == solo(model, turn, 8)[0]
    assert scheduler.stats()["prefix_cache_hits"] == 1


def test_the_prefix_cache_stays_within_its_budget(model, scheduler_of):
    scheduler = scheduler_of(slots=2, cache_len=256, prefix_block_tokens=8, prefix_cache_bytes=200_000)
    run_all(scheduler, [Request(p, 4) for p in prompts(model, 12, np.random.default_rng(3))])
    assert 0 < scheduler.stats()["prefix_cache_bytes"] <= 200_000


def test_cancel_and_deadline_end_requests_and_free_their_slots(model, scheduler_of):
    scheduler = scheduler_of(slots=2, cache_len=1024)
    prompt = prompts(model, 1, np.random.default_rng(4))[0]
    long = Collector()
    ticket = scheduler.submit(Request(prompt, 900), long)
    while len(long.tokens) < 3 and not long.done.is_set():
        time.sleep(0.005)
    ticket.cancel()
    assert long.wait().reason in ("cancelled", "stop")
    late = Collector()
    scheduler.submit(Request(prompt, 900, deadline=time.monotonic() + 0.2), late)
    assert late.wait().reason in ("deadline", "stop")
    assert idle(scheduler)
    # and the scheduler serves on
    (done,), (got,) = run_all(scheduler, [Request(prompt, 5)])
    assert got.tokens == solo(model, prompt, 5)[0]


def test_a_full_queue_is_refused_with_a_retry_time(model, scheduler_of):
    scheduler = Scheduler(model, slots=1, max_queue=2, cache_len=256)  # not started: nothing leaves the queue
    for _ in range(2):
        scheduler.submit(Request([5, 6], 4), Collector())
    with pytest.raises(QueueFull) as refused:
        scheduler.submit(Request([5, 6], 4), Collector())
    assert refused.value.retry_after > 0
    scheduler.start()
    scheduler.shutdown()


@pytest.mark.parametrize(
    "request_, message",
    [
        (Request([1, 2], 300), r"max_tokens: the prompt's 2 tokens \+ max_tokens 300 = 302 exceed the 256 positions"),
        (Request([1, 2], 0), "max_tokens: must be >= 1"),
        (Request([], 4), "prompt: is empty"),
        (Request([1, 99999], 4), r"prompt: token id 99999 outside the vocabulary \[0, 2048\)"),
    ],
)
def test_requests_the_model_cannot_take_are_refused_naming_the_field(model, request_, message):
    with pytest.raises(ValueError, match=message):
        Scheduler(model, slots=1, cache_len=256).submit(request_, Collector())


def test_disaggregation_without_a_second_device_or_of_an_unknown_kind_is_refused_by_name(model):
    with pytest.raises(ValueError, match="no prefill device besides"):
        Scheduler(model, slots=1, cache_len=16, disaggregate="always")
    with pytest.raises(ValueError, match="disaggregate must be one of"):
        Scheduler(model, slots=1, cache_len=16, disaggregate=True)


def test_a_failed_step_fails_only_its_requests(model, scheduler_of):
    scheduler = scheduler_of(slots=2, cache_len=256)
    engine, real = scheduler.engine, scheduler.engine.generate
    failures = iter([RuntimeError("CPU expert job failed (injected)")])

    def generate_failing_once():
        if (error := next(failures, None)) is not None:
            raise error
        return real()

    engine.generate = generate_failing_once
    rng = np.random.default_rng(5)
    (done,), _ = run_all(scheduler, [Request(prompts(model, 1, rng)[0], 6)])
    assert done.reason == "error" and "injected" in done.error
    assert idle(scheduler)
    batch = prompts(model, 3, rng)
    _, collectors = run_all(scheduler, [Request(p, 6) for p in batch])
    for prompt, got in zip(batch, collectors, strict=True):
        assert got.tokens == solo(model, prompt, 6)[0]


def test_shutdown_cancels_what_waits_and_what_runs(model):
    scheduler = Scheduler(model, slots=1, cache_len=1024)
    scheduler.start()
    collectors = [Collector() for _ in range(3)]
    for c in collectors:
        scheduler.submit(Request([5, 6, 7], 900), c)
    scheduler.shutdown()
    assert all(c.wait().reason in ("cancelled", "stop", "length") for c in collectors)
    with pytest.raises(RuntimeError, match="shutting down"):
        scheduler.submit(Request([5], 1), Collector())


def test_stream_loaded_prefill_among_decodes_gives_what_each_gets_alone():
    placement = hybrid("float32", pinned_experts=True)
    model = hybridjit.load(placement=placement)
    try:
        model.stream_prefill_threshold = 40  # prompts of 40 tokens or more stream their experts
        rng = np.random.default_rng(6)
        batch = [[5, 6, 7], next(p for p in prompts(model, 12, rng) if len(p) >= 40)]
        scheduler = Scheduler(model, slots=2, cache_len=256)
        scheduler.start()
        try:
            _, collectors = run_all(scheduler, [Request(p, 8) for p in batch])
        finally:
            scheduler.shutdown()
        for prompt, got in zip(batch, collectors, strict=True):
            assert got.tokens == solo(model, prompt, 8)[0]
    finally:
        model.close()
