"""Stream-loaded prefill against the plain prefill, dsv3.prefill, on the same checkpoint.

The reference is dsv3.prefill in float32 with the routed experts held as JAX arrays (exact XLA math on any
machine). The model under test keeps its routed experts in one pinned host copy that both the C++ bank (the
hybrid path) and the stream read. The same tests run on XLA:CPU (memory kinds pinned_host -> device) and on
the GPU machine. Tolerances, as the relative RMS error of the last prompt tokens' logits and of every layer's
cache (latent and k_rope) against the reference:

| path, dtype                          | tolerance | why not exact                                        |
|--------------------------------------|-----------|------------------------------------------------------|
| stream, float32 (ChunkedAttention)   | 1e-5      | summation order (measured ~1e-6 on CPU)              |
| hybrid (bank on pinned memory), f32  | 1e-2      | AMX kernels round to bf16 (measured 2e-3 on the GPU  |
|                                      |           | machine's CPU; ~2e-7 with the f32 AVX kernels)       |
| stream, bfloat16 (cuDNN attention)   | hybrid bf16 path's error + 1e-2 | bf16 rounding in different places          |
"""

import dataclasses
import gc

import jax
import numpy as np
import pytest
from checkpoint_factory import tiny_config, write_checkpoint
from hybrid_placement import hybrid

import hybridjit
from hybridjit import stream_prefill as sp
from hybridjit.models import deepseek_v3 as dsv3
from hybridjit.ops.routed_experts import register_layer, routed_experts
from hybridjit.pinned_experts import host_view, pinned_layer, register_pinned
from hybridjit.placement import Placement
from hybridjit.synthetic import geometry_config

FLOAT32_RTOL = 1e-5
BANK_RTOL = 1e-2
BFLOAT16_SLACK = 1e-2
CHUNK = 8  # attention chunk: shorter than the prompts, so several chunks run
LENGTHS = np.array([23, 13], np.int32)  # right-padded to 24 tokens
CACHE_LEN = 32
on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


def rel_rms(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


@pytest.fixture(scope="module", params=["fp8", "bf16"])
def fmt(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoint(fmt, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp(fmt), tiny_config("v3"), seed=5, weight_format=fmt)


def load(checkpoint, dtype):
    return hybridjit.load(checkpoint, placement=hybrid(dtype, pinned_experts=True))


@pytest.fixture(scope="module")
def model(checkpoint):
    m = load(checkpoint, "float32")
    yield m
    m.close()


@pytest.fixture(scope="module")
def tokens(model):
    return np.random.default_rng(0).integers(2, model.config.vocab_size, (2, 24)).astype(np.int32)


def plain_prefill(model, tokens):
    """(logits of the last prompt tokens, cache) of dsv3.prefill, routed experts wherever `model` has them."""
    cache = dsv3.init_cache(model.config, len(tokens), CACHE_LEN, model.dtype, model.placement.device)
    logits, cache = jax.jit(dsv3.prefill, static_argnums=0)(model.config, model.weights, tokens, cache)
    return np.asarray(logits)[np.arange(len(tokens)), LENGTHS - 1], cache


def streamed(model, tokens, **options):
    stats = sp.StreamStats()
    cache = dsv3.init_cache(model.config, len(tokens), CACHE_LEN, model.dtype, model.placement.device)
    logits, cache = sp.stream_prefill(model, tokens, LENGTHS, cache, stats=stats, **options)
    return np.asarray(logits), cache, stats


def cache_error(cache, reference):
    return max(
        rel_rms(getattr(c, name), getattr(r, name))
        for c, r in zip(cache, reference, strict=True)
        for name in ("latent", "k_rope")
    )


@pytest.fixture(scope="module")
def exact_model(checkpoint, model):
    """The checkpoint with its routed experts held as JAX arrays (routed_experts_dense): float32 XLA throughout."""
    layers = frozenset(range(model.config.num_hidden_layers))
    m = hybridjit.load(checkpoint, placement=dataclasses.replace(Placement.default("float32"),
                                                                 device_expert_layers=layers))
    yield m
    m.close()


@pytest.fixture(scope="module")
def reference(exact_model, tokens):
    return plain_prefill(exact_model, tokens)


@on_gpu
def test_device_memory_stays_within_the_budget(model, tokens):
    """Device memory in use whenever a block has just been allocated stays within the budget over what was in
    use before the prefill (cache included)."""
    device = model.placement.device
    streamed(model, tokens, attention_chunk=CHUNK)  # compiles
    plan = sp.plan_ring(model.config, _pinned(model), 2, 24, model.dtype, device, attention_chunk=CHUNK, depth=2)
    budget = plan.activation_bytes + plan.ring_bytes
    start = device.memory_stats()["bytes_in_use"]
    _, _, stats = streamed(model, tokens, attention_chunk=CHUNK, vram_budget=budget)
    assert stats.plan.depth == 2
    assert stats.peak_device_bytes - start <= budget


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_matches_plain_prefill_at_every_ring_depth(model, tokens, reference, fmt, depth):
    if fmt == "bf16" and depth != 2:
        pytest.skip("ring depths are format-independent: BF16 experts run at depth 2 only")
    logits, cache, stats = streamed(model, tokens, depth=depth, attention_chunk=CHUNK)
    ref_logits, ref_cache = reference
    assert rel_rms(logits, ref_logits) < FLOAT32_RTOL
    assert cache_error(cache, ref_cache) < FLOAT32_RTOL
    assert stats.plan.depth == depth
    assert isinstance(stats.plan.attention, dsv3.ChunkedAttention) and stats.plan.attention.chunk == CHUNK
    assert stats.streamed_bytes == sum(p.nbytes for p in _pinned(model))
    assert 0 < stats.peak_ring_bytes <= stats.plan.ring_bytes


def test_stats_account_each_layer_by_phase(model, tokens):
    """Every layer's phases are its executables' wall times: the right phases per layer kind, each positive, and
    together no more than the layer took."""
    _, _, stats = streamed(model, tokens, depth=2, attention_chunk=CHUNK)
    cfg = model.config
    assert len(stats.layer_phase_s) == len(stats.layer_done_s) == cfg.num_hidden_layers
    layer_s = np.diff([0.0, *stats.layer_done_s])
    for i, phases in enumerate(stats.layer_phase_s):
        kinds = {"attention+router+shared", "dispatch", "experts", "combine"} if cfg.is_moe_layer(i) else {
            "attention+mlp"}
        assert set(phases) == kinds, i
        assert all(t > 0 for t in phases.values())
        assert sum(phases.values()) <= layer_s[i]
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    assert stats.routed_pairs == moe_layers * tokens.size * cfg.num_experts_per_tok
    assert stats.routed_pairs <= stats.expert_slots


@pytest.mark.parametrize(("capacity", "skip"), [(1, 0), (3, 0), (64, 0), (3, 2), (4, 8)])
def test_grouping_by_block_places_each_pair_once(capacity, skip):
    """group_by_expert over a block of experts: each of the block's pairs from an expert's skip-th on sits in
    its expert's row in token order, up to the capacity (the rest dropped); other experts' pairs and empty
    slots are nowhere."""
    rng = np.random.default_rng(capacity)
    t, k, n, first, size = 40, 4, 16, 4, 8
    ids = np.stack([rng.choice(n, k, replace=False) for _ in range(t)]).astype(np.int32)
    weights = rng.random((t, k)).astype(np.float32)
    rows, slot_weights = map(np.asarray, dsv3.group_by_expert(ids, weights, size, capacity, first, skip))
    assert rows.shape == slot_weights.shape == (size, capacity)
    for e in range(size):
        token, j = np.nonzero(ids == first + e)  # in token order
        token, j = token[skip : skip + capacity], j[skip : skip + capacity]
        np.testing.assert_array_equal(rows[e, : len(token)], token)
        np.testing.assert_array_equal(slot_weights[e, : len(token)], weights[token, j])
        assert (rows[e, len(token) :] == t).all() and (slot_weights[e, len(token) :] == 0).all()


@pytest.mark.parametrize("skew", [0.0, 1.0, 3.0])
def test_block_passes_cover_every_pair_within_the_slots(skew):
    """Whatever the routing's skew (expert loads drawn with Zipf-like weights), every pass of a block fits the
    slots the plan allows, and each expert's pairs fit its first pass or the later passes over the busy ones."""
    rng = np.random.default_rng(int(10 * skew))
    for _ in range(200):
        size, pairs = int(rng.integers(1, 40)), int(rng.integers(0, 5000))
        load = np.arange(1, size + 1, dtype=np.float64) ** -skew
        counts = rng.multinomial(pairs, rng.permutation(load / load.sum()))
        slots = max(size, int(rng.integers(1, 3 * pairs + 2)))
        plan = sp._block_passes(counts, 0, slots)
        assert max(plan.pass_slots) <= slots
        busy = counts > plan.capacity
        assert busy.sum() <= plan.busy
        assert (counts[busy] <= plan.capacity + plan.later * plan.later_capacity).all()


def test_skewed_routing_runs_in_passes_within_the_plan(model, exact_model):
    """A prompt of one repeated token routes every token to the same experts (identical hidden states: the
    attention averages identical values). The busy blocks then run in several passes, none larger than the
    plan allows, with the plain path's result."""
    tokens = np.full((2, 24), 7, np.int32)
    ref_logits, ref_cache = plain_prefill(exact_model, tokens)
    logits, cache, stats = streamed(model, tokens, depth=2, attention_chunk=CHUNK)
    assert rel_rms(logits, ref_logits) < FLOAT32_RTOL
    assert cache_error(cache, ref_cache) < FLOAT32_RTOL
    blocks = sum(len(p.blocks) for p in _pinned(model))
    assert stats.block_passes > blocks
    assert stats.largest_pass_slots <= stats.plan.block_slots
    assert stats.routed_pairs <= stats.expert_slots


def test_hybrid_path_reads_the_same_pinned_experts(model, tokens, reference):
    logits, cache = plain_prefill(model, tokens)
    ref_logits, ref_cache = reference
    assert rel_rms(logits, ref_logits) < BANK_RTOL
    assert cache_error(cache, ref_cache) < BANK_RTOL


def test_decode_continues_from_the_streamed_cache(model, exact_model, tokens, reference, fmt):
    """The streamed prefill's output is the decode state: decode_step reads its cache as is."""
    if fmt != "fp8":
        pytest.skip("the cache layout does not depend on the expert format")
    logits, cache, _ = streamed(model, tokens, depth=2, attention_chunk=CHUNK)
    _, ref_cache = reference
    step = jax.jit(dsv3.decode_step, static_argnums=0)
    nxt, positions = logits.argmax(-1).astype(np.int32), LENGTHS
    decoded, _ = step(exact_model.config, exact_model.weights, nxt, positions, cache)
    expected, _ = step(exact_model.config, exact_model.weights, nxt, positions, ref_cache)
    assert rel_rms(decoded, expected) < FLOAT32_RTOL


def test_vram_budget_sets_the_depth_and_bounds_the_ring(model, tokens):
    pinned, device = _pinned(model), model.placement.device
    plan = sp.plan_ring(model.config, pinned, 2, 24, model.dtype, device, attention_chunk=CHUNK, depth=1)
    for blocks, depth in [(2.5, 2), (1000, len(pinned[0].blocks))]:  # a whole layer at most
        budget = plan.activation_bytes + int(blocks * plan.block_bytes)
        _, _, stats = streamed(model, tokens, attention_chunk=CHUNK, vram_budget=budget)
        assert stats.plan.depth == depth
        assert stats.peak_ring_bytes <= budget - stats.plan.activation_bytes


def test_budget_below_one_block_is_a_clear_error(model, tokens):
    plan = sp.plan_ring(model.config, _pinned(model), 2, 24, model.dtype, model.placement.device,
                        attention_chunk=CHUNK, depth=1)
    with pytest.raises(ValueError, match="expert block.*VRAM budget"):
        streamed(model, tokens, attention_chunk=CHUNK, vram_budget=plan.activation_bytes + plan.block_bytes - 1)


def test_unpinned_model_is_refused(checkpoint, tokens):
    unpinned = hybrid("float32", pinned_experts=False)
    plain = hybridjit.load(checkpoint, placement=unpinned)
    try:
        with pytest.raises(ValueError, match="pinned_experts=True"):
            streamed(plain, tokens)
        assert sp.choose_prefill_path(plain, 1, 1 << 16, threshold=1) == "hybrid"
    finally:
        plain.close()


def test_bank_reads_the_pinned_copy_and_lives_with_it():
    """Zero copies: zeroing an expert in the pinned buffer changes what the CPU kernels compute; the pinned copy
    is released with its bank layer."""
    rng = np.random.default_rng(1)
    gate = [rng.standard_normal((8, 16), np.float32) for _ in range(4)]
    down = [rng.standard_normal((16, 8), np.float32) for _ in range(4)]
    layer = register_pinned(gate, gate, down, device=jax.devices()[0], experts_per_block=2)
    cpu = jax.devices("cpu")[0]
    x = jax.device_put(rng.standard_normal((3, 16)).astype(np.float32), cpu)
    ids, weights = jax.device_put((np.full((3, 1), 3, np.int32), np.ones((3, 1), np.float32)), cpu)

    def cpu_experts(bank_layer):
        return np.asarray(routed_experts(x, ids, weights, layer=bank_layer.id))

    with register_layer(gate, gate, down) as unpinned:
        np.testing.assert_allclose(cpu_experts(layer), cpu_experts(unpinned), rtol=1e-6)
    pinned = pinned_layer(layer.id)
    assert [b.start for b in pinned.blocks] == [0, 2] and pinned.n_experts == 4
    host_view(pinned.blocks[1].weights[2], None)[1] = 0  # expert 3's down projection, in place
    assert not cpu_experts(layer).any()
    layer_id = layer.id
    del pinned
    layer.close()
    gc.collect()
    assert pinned_layer(layer_id) is None


def test_path_choice_follows_the_cost_model():
    v3 = geometry_config("deepseek-v3")
    rates = sp.PrefillRates(pcie_gbps=50.0, gpu_tflops=500.0, cpu_expert_tflops=4.0)
    cross = sp.crossover_length(v3, rates)
    for length in (cross - 1, cross):
        t = sp.prefill_seconds(v3, 1, length, rates)
        assert (t["stream"] < t["hybrid"]) == (length >= cross)
    # Long prompts stream at the PCIe rate until the GPU's compute takes over.
    assert sp.prefill_seconds(v3, 1, 8192, rates)["stream"] == pytest.approx(sp.expert_bytes(v3) / 50e9)
    assert sp.crossover_length(v3, dataclasses.replace(rates, cpu_expert_tflops=40.0)) > cross


def test_path_choice_threshold_override(model):
    assert sp.choose_prefill_path(model, 1, 100, threshold=64) == "stream"
    assert sp.choose_prefill_path(model, 1, 32, threshold=64) == "hybrid"
    expected = "stream" if jax.default_backend() == "gpu" else "hybrid"  # no PCIe to save on a CPU
    assert sp.choose_prefill_path(model, 1, 1 << 20, rates=sp.PrefillRates(cpu_expert_tflops=1e-3)) == expected


@on_gpu
def test_bfloat16_with_cudnn_attention_is_as_accurate_as_the_plain_path(checkpoint, model, tokens, reference):
    bf16 = load(checkpoint, "bfloat16")
    try:
        logits, cache, stats = streamed(bf16, tokens)
        plain_logits, plain_cache = plain_prefill(bf16, tokens)  # the hybrid path in bfloat16
        assert isinstance(stats.plan.attention, sp.CudnnAttention)
        ref_logits, ref_cache = reference
        assert rel_rms(logits, ref_logits) < rel_rms(plain_logits, ref_logits) + BFLOAT16_SLACK
        assert cache_error(cache, ref_cache) < cache_error(plain_cache, ref_cache) + BFLOAT16_SLACK
    finally:
        bf16.close()


def _pinned(model):
    return [pinned_layer(layer.mlp.expert_layer) for layer in model.weights.layers if isinstance(layer.mlp, dsv3.MoE)]


def test_generate_takes_the_streamed_path_above_its_threshold(model):
    prompts = [[5, 17, 42, 99, 3, 250, 7, 8, 9], [11, 12, 13]]
    model.stream_prefill_threshold = None  # the cost model: hybrid on a CPU
    hybrid = model.generate(prompts, max_new_tokens=6)
    model.stream_prefill_threshold = 1
    try:
        assert model.generate(prompts, max_new_tokens=6) == hybrid
    finally:
        model.stream_prefill_threshold = None
