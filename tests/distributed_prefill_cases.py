"""Distributed stream-loaded prefill (Placement.prefill_devices: each device streams its share of every layer's
routed experts; OSDI '26 §3.2) against the plain prefill and against stream-loaded prefill on one device, on the
same checkpoints as tests/test_stream_prefill.py, whose tolerances apply (float32: 1e-5 relative RMS; the CPU
kernels on the pinned copy: 1e-2).

Needs two or more devices: tests/test_distributed_prefill.py runs this module on XLA:CPU with four forced host
devices (XLA_FLAGS=--xla_force_host_platform_device_count=4, which must be set before JAX starts, hence its own
process); on a machine with several GPUs run it directly: `pytest tests/distributed_prefill_cases.py`.
"""

import gc
import threading
import time

import jax
import numpy as np
import pytest
from hybrid_placement import hybrid
from jax.sharding import Mesh
from test_scheduler import Collector, solo
from test_stream_prefill import (
    BANK_RTOL,
    CHUNK,
    FLOAT32_RTOL,
    LENGTHS,
    _gqa_operands,
    cache_error,
    load_exact,
    new_cache,
    plain_prefill,
    rel_rms,
    write_case_checkpoint,
)

import hybridjit
from hybridjit import stream_prefill as sp
from hybridjit.models import deepseek_v3
from hybridjit.models.common import gqa
from hybridjit.models.common.moe import MoE
from hybridjit.models.common.prefill_cores import HeadsSplit
from hybridjit.pinned_experts import pinned_layer
from hybridjit.serving import scheduler as scheduler_module
from hybridjit.serving.scheduler import Request, Scheduler

DEVICES = jax.devices()
pytestmark = pytest.mark.skipif(len(DEVICES) < 2, reason="needs two or more devices")
# MLA with a shared expert and a dense first layer (16 experts); MXFP4 with biases, sinks and a window (16);
# int4 groups (16); bf16 with a window and 8 experts (2 a device on four).
CASES = ["deepseek_v3-fp8", "gpt_oss-mxfp4", "qwen3_moe-int4", "mixtral-bf16"]


@pytest.fixture(scope="module", params=CASES)
def case(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(case, tmp_path_factory):
    return write_case_checkpoint(case, tmp_path_factory.mktemp(case))


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}-devices")
def shards(request):
    if request.param > len(DEVICES):
        pytest.skip(f"needs {request.param} devices")
    return request.param


def load(checkpoint, devices):
    return hybridjit.load(checkpoint, placement=hybrid("float32", pinned_experts=True, prefill_devices=devices))


@pytest.fixture(scope="module")
def model(checkpoint, shards):
    m = load(checkpoint, tuple(DEVICES[:shards]))
    yield m
    m.close()
    # This module compiles programs for every case and device count in one process: drop each one's, as conftest.py
    # does after each module (a process runs out of memory mappings for compiled code, and XLA crashes, otherwise).
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="module")
def one_device(checkpoint):
    m = load(checkpoint, ())
    yield m
    m.close()


@pytest.fixture(scope="module")
def exact_model(checkpoint, one_device):
    m = load_exact(checkpoint, one_device.config.num_hidden_layers)
    yield m
    m.close()


@pytest.fixture(scope="module")
def tokens(one_device):
    return np.random.default_rng(0).integers(2, one_device.config.vocab_size, (2, 24)).astype(np.int32)


def pinned(model):
    return [pinned_layer(layer.mlp.expert_layer) for layer in model.weights.layers if isinstance(layer.mlp, MoE)]


def streamed(model, tokens, **options):
    stats = sp.StreamStats()
    logits, cache = sp.stream_prefill(model, tokens, LENGTHS, new_cache(model, len(tokens)), stats=stats,
                                      attention_chunk=CHUNK, **options)
    return np.asarray(logits), cache, stats


def test_each_share_is_pinned_through_the_device_that_streams_it(model, shards, exact_model, tokens):
    """Device g's blocks are the g-th equal run of each layer's, in its pinned host memory; the CPU kernels read
    the whole layer across the shares (the hybrid prefill matches the plain one)."""
    for layer in pinned(model):
        per = len(layer.blocks) // shards
        assert per * shards == len(layer.blocks)
        assert [b.home for b in layer.blocks] == [d for d in DEVICES[:shards] for _ in range(per)]
        assert [b.start for b in layer.blocks] == sorted(b.start for b in layer.blocks)
        assert sum(b.size for b in layer.blocks) == model.config.n_routed_experts
    logits, cache = plain_prefill(model, tokens)
    ref_logits, ref_cache = plain_prefill(exact_model, tokens)
    assert rel_rms(logits, ref_logits) < BANK_RTOL
    assert cache_error(cache, ref_cache) < BANK_RTOL


@pytest.mark.parametrize("depth", [None, 1], ids=["whole-layer-ring", "ring-of-1"])
@pytest.mark.parametrize("prompt", ["random", "repeated"])
def test_matches_one_device_and_the_plain_prefill(model, shards, one_device, exact_model, tokens, depth, prompt):
    """Logits and cache equal the plain prefill's and one device's stream, and come back on the placement's
    device; a repeated token (every token routed to the same experts) runs the busy steps in several passes."""
    if prompt == "repeated":
        tokens = np.full_like(tokens, 7)
    ref_logits, ref_cache = plain_prefill(exact_model, tokens)
    logits, cache, stats = streamed(model, tokens, depth=depth)
    one_logits, one_cache, one_stats = streamed(one_device, tokens, depth=depth)
    for got in (logits, one_logits):
        assert rel_rms(got, ref_logits) < FLOAT32_RTOL
    for got in (cache, one_cache):
        assert cache_error(got, ref_cache) < FLOAT32_RTOL
    assert all(leaf.devices() == {DEVICES[0]} for leaf in jax.tree.leaves(cache))
    layers = pinned(model)
    assert stats.plan.depth == (depth or len(layers[0].blocks) // shards)
    assert isinstance(stats.plan.attention, HeadsSplit) and stats.plan.attention.mesh.size == shards
    assert stats.streamed_bytes == sum(p.nbytes for p in layers)
    assert 0 < stats.peak_ring_bytes <= stats.plan.ring_bytes
    assert stats.routed_pairs == one_stats.routed_pairs <= stats.expert_slots
    if prompt == "repeated":
        assert stats.block_passes > sum(len(p.blocks) for p in layers)
        assert stats.largest_pass_slots <= stats.plan.block_slots


@pytest.mark.parametrize("stages, room", [(True, True), (False, True), (True, False)],
                         ids=["staged", "direct", "no-room"])
def test_a_prefill_apart_stages_the_other_devices_share_through_them(model, shards, one_device, tokens, monkeypatch,
                                                                     stages, room):
    """A prefill on the devices that do not decode (disaggregated) copies the blocks pinned through the others (the
    decoding device, and on four devices the one the blocks' split leaves out) through those devices' memory where
    the interconnect pays (stages_through; XLA:CPU's does not, so it is forced here) and they have room for the
    ring's blocks in flight, else straight from the pinned memory; either way it gives one device's logits and
    cache."""
    one_logits, one_cache, _ = streamed(one_device, tokens)
    apart = sp.streaming_devices(model, tuple(DEVICES[1:shards]))  # as the scheduler's
    monkeypatch.setattr(sp, "stages_through", lambda home, device: stages)
    if not room:  # the homes say they have no memory free (XLA:CPU's say nothing: room, as for any size)
        free = sp.free_device_memory
        monkeypatch.setattr(sp, "free_device_memory", lambda d: free(d) if d in apart else 0)
    logits, cache, stats = streamed(model, tokens, devices=apart)
    assert rel_rms(logits, one_logits) < FLOAT32_RTOL
    assert cache_error(cache, one_cache) < FLOAT32_RTOL
    assert all(leaf.devices() == {DEVICES[0]} for leaf in jax.tree.leaves(cache))
    layers = pinned(model)
    home_bytes = sum(b.nbytes for p in layers for b in p.blocks if b.home not in apart)
    assert stats.streamed_bytes == sum(p.nbytes for p in layers)
    assert stats.staged_bytes == (home_bytes if stages and room else 0) and home_bytes > 0


def test_decode_continues_on_the_first_device(model, one_device):
    """Generation through the engine with every prompt streamed gives one device's tokens."""
    prompts = [[5, 17, 42, 99, 3, 250, 7, 8, 9], [11, 12, 13]]
    for m in (model, one_device):
        m.stream_prefill_threshold = 1
    try:
        assert model.generate(prompts, max_new_tokens=6) == one_device.generate(prompts, max_new_tokens=6)
    finally:
        for m in (model, one_device):
            m.stream_prefill_threshold = None


def test_weights_are_copied_once_without_resident_experts(model, shards):
    weights = model.prefill_weights()
    assert model.prefill_weights() is weights
    assert all(leaf.devices() == set(DEVICES[:shards]) for leaf in jax.tree.leaves(weights))
    assert all(layer.mlp.resident is None for layer in weights.layers if isinstance(layer.mlp, MoE))


def test_experts_that_do_not_split_evenly_are_a_clear_error(checkpoint, one_device):
    if len(DEVICES) < 3:
        pytest.skip("needs three devices")
    experts = one_device.config.n_routed_experts
    with pytest.raises(ValueError, match=f"the {experts} routed experts of a layer do not split evenly over the 3"):
        load(checkpoint, tuple(DEVICES[:3]))


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
def test_gqa_core_with_heads_split_equals_the_core(devices, window, with_sinks):
    """6 query heads over 2 key/value heads: split over 2 devices, the output left split by heads for the output
    projection; over 4 (the heads do not divide) run whole."""
    if devices > len(DEVICES):
        pytest.skip(f"needs {devices} devices")
    q, k, v, sinks = _gqa_operands()
    sinks = sinks if with_sinks else None
    core = gqa.ChunkedAttention(8)
    split = HeadsSplit(core, Mesh(np.array(DEVICES[:devices]), ("x",)), "x", gqa.CORE_HEAD_AXES)
    expected = jax.jit(lambda *a: core(*a[:3], 0.3, a[3], window))(q, k, v, sinks)
    got = jax.jit(lambda *a: split(*a[:3], 0.3, a[3], window))(q, k, v, sinks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-6, atol=1e-6)
    assert got.sharding.is_fully_replicated == (devices == 4)


def test_mla_core_with_heads_split_equals_the_core():
    b, t, h, n, p, dv = 2, 19, 4, 8, 4, 6
    rng = np.random.default_rng(3)
    operands = [rng.standard_normal(shape).astype(np.float32)
                for shape in ((b, t, h, n), (b, t, h, p), (b, t, h, n), (b, t, p), (b, t, h, dv))]
    core = deepseek_v3.model.ChunkedAttention(8)
    split = HeadsSplit(core, Mesh(np.array(DEVICES[:2]), ("x",)), "x", deepseek_v3.model.CORE_HEAD_AXES)
    expected = jax.jit(lambda *a: core(*a, 0.25))(*operands)
    got = jax.jit(lambda *a: split(*a, 0.25))(*operands)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("disaggregate, apart_alone, apart_arriving", [("auto", 0, 1), ("always", 1, 1),
                                                                        ("never", 0, 0)])
def test_scheduler_disaggregates_a_long_prompt_as_asked(model, one_device, disaggregate, apart_alone,
                                                        apart_arriving):
    """A prompt long enough to stream, alone and then submitted while another request decodes: by default
    ("auto") it streams over all the devices alone, and on those that do not decode, in the prefill thread, while
    another decodes; "always" streams it apart both times (the seed's disaggregated SLP), "never" over all the
    devices both times. Every request's tokens are what it gets alone on one device."""
    short, long = [5, 17, 42], [int(t) for t in np.random.default_rng(1).integers(2, 200, 24)]
    for m in (model, one_device):
        m.stream_prefill_threshold = 16  # the 24-token prompt streams, the 3-token one does not
    try:
        expected_short, _ = solo(one_device, short, 24)
        expected_long, _ = solo(one_device, long, 6)
        assert len(expected_short) >= 8, "the short request must still decode when the long one arrives"
        scheduler = Scheduler(model, slots=2, cache_len=64, disaggregate=disaggregate)
        scheduler.start()
        try:
            alone = Collector()
            scheduler.submit(Request(long, 6), alone)
            alone.wait()
            assert scheduler.stats()["disaggregated_prefills"] == apart_alone
            decoding, arriving = Collector(), Collector()
            first_token = threading.Event()
            scheduler.submit(Request(short, 24), lambda e: (decoding(e), first_token.set()))
            assert first_token.wait(60)
            scheduler.submit(Request(long, 6), arriving)
            decoding.wait(), arriving.wait()
            assert scheduler.stats()["disaggregated_prefills"] == apart_alone + apart_arriving
        finally:
            scheduler.shutdown()
        assert decoding.tokens == expected_short
        assert alone.tokens == arriving.tokens == expected_long
    finally:
        for m in (model, one_device):
            m.stream_prefill_threshold = None


class HeldDisaggregatedPrefill:
    """The scheduler's stream_prefill, with its first disaggregated call (the prefill thread's) held until the
    scheduler abandons it, then going on to the real one (which then stops at its first executable)."""

    def __init__(self, monkeypatch):
        self.real, self.started, self.abandoned = scheduler_module.stream_prefill, threading.Event(), threading.Event()
        self.thread = None
        monkeypatch.setattr(scheduler_module, "stream_prefill", self)

    def __call__(self, *args, abandon=None, devices=None, **options):
        if devices is not None and not self.started.is_set():
            self.thread = threading.current_thread()
            self.started.set()
            while not abandon():
                time.sleep(0.005)
            self.abandoned.set()
        return self.real(*args, abandon=abandon, devices=devices, **options)


def decoding_then_long(model, scheduler, short, long):
    """Submits `short`, waits for its first token, then submits `long` (disaggregated): their Collectors and
    the long request's ticket."""
    decoding, arriving, first_token = Collector(), Collector(), threading.Event()
    scheduler.submit(Request(short, 24), lambda e: (decoding(e), first_token.set()))
    assert first_token.wait(60)
    return decoding, arriving, scheduler.submit(Request(long, 6), arriving)


def test_a_cancelled_disaggregated_prefill_stops_and_the_prompts_after_it_get_their_own_tokens(model, one_device,
                                                                                                monkeypatch):
    short, long = [5, 17, 42], [int(t) for t in np.random.default_rng(2).integers(2, 200, 24)]
    held = HeldDisaggregatedPrefill(monkeypatch)
    for m in (model, one_device):
        m.stream_prefill_threshold = 16
    try:
        expected_short, _ = solo(one_device, short, 24)
        expected_long, _ = solo(one_device, long, 6)
        scheduler = Scheduler(model, slots=2, cache_len=64)
        scheduler.start()
        try:
            decoding, cancelled, ticket = decoding_then_long(model, scheduler, short, long)
            assert held.started.wait(60)
            ticket.cancel()
            assert cancelled.wait().reason == "cancelled" and cancelled.tokens == []
            assert held.abandoned.wait(60), "the prefill thread went on with a cancelled request"
            again = Collector()
            scheduler.submit(Request(long, 6), again)  # streamed in the thread again or over every device
            decoding.wait(), again.wait()
            assert scheduler.stats()["disaggregated_prefills"] <= 1  # the abandoned one does not count
        finally:
            scheduler.shutdown()
        assert decoding.tokens == expected_short and again.tokens == expected_long
        assert cancelled.after_finished == decoding.after_finished == again.after_finished == 0
    finally:
        for m in (model, one_device):
            m.stream_prefill_threshold = None


def test_shutdown_during_a_disaggregated_prefill_ends_every_request_and_the_prefill_thread(model, monkeypatch):
    long = [int(t) for t in np.random.default_rng(3).integers(2, 200, 24)]
    held = HeldDisaggregatedPrefill(monkeypatch)
    model.stream_prefill_threshold = 16
    try:
        scheduler = Scheduler(model, slots=2, cache_len=64)
        scheduler.start()
        decoding, arriving, _ = decoding_then_long(model, scheduler, [5, 17, 42], long)
        assert held.started.wait(60)
        scheduler.shutdown(timeout=60)
        assert arriving.wait().reason == "cancelled" and decoding.wait().reason == "cancelled"
        assert held.abandoned.is_set() and not held.thread.is_alive()
    finally:
        model.stream_prefill_threshold = None
