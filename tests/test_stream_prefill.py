"""Stream-loaded prefill against the plain prefill, the family's model.prefill, on the same checkpoint, for every
family and every expert format it streams (CASES).

The reference is the family's prefill in float32 with the routed experts held as JAX arrays (exact XLA math on
any machine; quantized experts dequantized on the host). The model under test keeps its routed experts in one
pinned host copy that both the C++ bank (the hybrid path) and the stream read. The same tests run on XLA:CPU
(memory kinds pinned_host -> device) and on the GPU machine. Tolerances, as the relative RMS error of the last
prompt tokens' logits and of every layer's cache (all its arrays) against the reference:

| path, dtype                          | tolerance | why not exact                                        |
|--------------------------------------|-----------|------------------------------------------------------|
| stream, float32 (ChunkedAttention)   | 1e-5      | summation order (measured ~1e-6 on CPU)              |
| hybrid (bank on pinned memory), f32  | 1e-2      | AMX kernels round to bf16 (measured 2e-3 on the GPU  |
|                                      |           | machine's CPU; ~2e-7 with the f32 AVX kernels)       |
| stream, bfloat16 (cuDNN attention)   | hybrid bf16 path's error + 1e-2 | bf16 rounding in different places          |

Tests of what depends on neither the family nor the expert format (ring depths, VRAM budgets, refusals) run on
FULL only; skewed routing and generation through the engine also on gpt-oss (expert biases in the later passes;
windows and sinks through the serving engine).
"""

import collections
import dataclasses
import gc

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from checkpoint_factory import family_config, quantize_mxfp4, tiny_config, write_checkpoint, write_family_checkpoint
from hybrid_placement import hybrid

import hybridjit
from hybridjit import prefill_path
from hybridjit import stream_prefill as sp
from hybridjit.checkpoint import Checkpoint
from hybridjit.config import IntQuantConfig
from hybridjit.convert import convert_checkpoint, quantize_int_groups
from hybridjit.expert_residency import Residency, bank_moe_layers
from hybridjit.host_kv_cache import HostKVCache
from hybridjit.models.common import gqa
from hybridjit.models.common.decoder import NO_SCHEDULE
from hybridjit.models.common.expert_storage import ExpertStorage
from hybridjit.models.common.experts import group_by_expert
from hybridjit.models.common.moe import ExpertSchedule, MoE
from hybridjit.models.common.ring_cache import held_positions
from hybridjit.models.registry import family_of
from hybridjit.ops.routed_experts import register_layer, routed_experts
from hybridjit.pinned_experts import host_view, pinned_layer, register_pinned
from hybridjit.placement import PREFILL_AXIS, Placement, copied, prefill_mesh
from hybridjit.quant import dequantize_fp8_blocks, dequantize_int_groups, dequantize_mxfp4, quantize_fp8_blocks
from hybridjit.sampling import SamplingParams
from hybridjit.serving.engine import Engine
from hybridjit.synthetic import geometry_config
from hybridjit.weights import routed_expert_bytes

FLOAT32_RTOL = 1e-5
BANK_RTOL = 1e-2
BFLOAT16_SLACK = 1e-2
CHUNK = 8  # attention chunk: shorter than the prompts, so several chunks run
LENGTHS = np.array([23, 13], np.int32)  # right-padded to 24 tokens
CACHE_LEN = 32
DECODE_STEPS = 4  # greedy steps after the prefill
on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")

# Family-format (tiny checkpoints of tests/checkpoint_factory.py, DeepSeek's preset "v3" and the other families' own;
# int formats by convert_checkpoint of the released format) -> config overrides: what each case adds.
CASES = {
    "deepseek_v3-fp8": {},  # MLA, dense first layer, shared expert, FP8 with partial edge blocks
    "deepseek_v3-bf16": {},
    # A sliding window (5) shorter than the prompts; head_dim 24 (cuDNN takes multiples of 8).
    "mixtral-bf16": {"sliding_window": 5, "head_dim": 24},
    "glm4_moe-bf16": {},  # partial rotary, q/k/v biases, shared expert, grouped sigmoid routing, MTP layer
    "minimax_m2-fp8": {},  # FP8 in 32x32 blocks, partial at the edges; QK norm over all heads
    # MXFP4 experts with interleaved gate/up rows, biases and the clamped SwiGLU; sinks; window 4; router bias.
    "gpt_oss-mxfp4": {},
    "qwen3_moe-int4": {},  # int4 experts; per-head QK norm, a dense layer between MoE layers
    "mixtral-int8": {"sliding_window": 5, "head_dim": 24},  # int8 experts
}
FULL = "deepseek_v3-fp8"  # the case the family- and format-independent tests run on


def rel_rms(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    return request.param


def only(case, *cases):
    if case not in cases:
        pytest.skip(f"runs on {', '.join(cases)} only (the module docstring says why)")


@pytest.fixture(scope="module")
def checkpoint(case, tmp_path_factory):
    return write_case_checkpoint(case, tmp_path_factory.mktemp(case))


def write_case_checkpoint(case, directory):
    """The tiny checkpoint of a CASES entry, written under `directory`."""
    family, fmt = case.split("-")
    if family == "deepseek_v3":
        return write_checkpoint(directory, tiny_config("v3"), seed=5, weight_format=fmt)
    config = family_config(family, **CASES[case])
    released = "mxfp4" if family == "gpt_oss" else "fp8" if family == "minimax_m2" else "bf16"
    mtp = config.get("num_nextn_predict_layers", 0) > 0
    path = write_family_checkpoint(directory / "released", config, seed=5, weight_format=released, with_mtp_layer=mtp)
    return path if fmt == released else convert_checkpoint(path, directory / fmt, fmt)


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


def new_cache(model, batch):
    return model.family.model.init_cache(model.config, batch, CACHE_LEN, model.dtype, model.placement.device)


def plain_prefill(model, tokens):
    """(logits of the last prompt tokens, cache) of the family's prefill, routed experts wherever `model` has
    them."""
    prefill = jax.jit(model.family.model.prefill, static_argnums=0)
    logits, cache = prefill(model.config, model.weights, tokens, new_cache(model, len(tokens)))
    return np.asarray(logits)[np.arange(len(tokens)), LENGTHS - 1], cache


def streamed(model, tokens, **options):
    stats = sp.StreamStats()
    logits, cache = sp.stream_prefill(model, tokens, LENGTHS, new_cache(model, len(tokens)), stats=stats, **options)
    return np.asarray(logits), cache, stats


def cache_error(cache, reference):
    """The largest relative RMS error over every array of every layer's cache."""
    return max(rel_rms(c, r) for c, r in zip(jax.tree.leaves(cache), jax.tree.leaves(reference), strict=True))


@pytest.fixture(scope="module")
def exact_model(checkpoint, model):
    m = load_exact(checkpoint, model.config.num_hidden_layers)
    yield m
    m.close()


def load_exact(checkpoint, layers: int):
    """The checkpoint with its routed experts held as JAX arrays (routed_experts_dense): float32 XLA throughout."""
    placement = dataclasses.replace(Placement.default("float32"), device_expert_layers=frozenset(range(layers)))
    return hybridjit.load(str(checkpoint), placement=placement)


@pytest.fixture(scope="module")
def reference(exact_model, tokens):
    return plain_prefill(exact_model, tokens)


@on_gpu
def test_device_memory_stays_within_the_budget(case, model, tokens):
    """Device memory in use whenever a block has just been allocated stays within the budget over what was in
    use before the prefill (cache included)."""
    only(case, FULL, "gpt_oss-mxfp4")
    device = model.placement.device
    streamed(model, tokens, attention_chunk=CHUNK)  # compiles
    plan = sp.plan_ring(model.config, _pinned(model), 2, 24, model.dtype, device, attention_chunk=CHUNK, depth=2)
    budget = plan.activation_bytes + plan.ring_bytes
    start = device.memory_stats()["bytes_in_use"]
    _, _, stats = streamed(model, tokens, attention_chunk=CHUNK, vram_budget=budget)
    assert stats.plan.depth == 2
    assert stats.peak_device_bytes - start <= budget


@pytest.mark.parametrize("depth", [1, 3])
def test_steps_left_queued_change_nothing_but_when_blocks_are_freed(case, model, tokens, depth):
    """With expert steps left queued behind the one waited for (sp.expert_steps_queued), the prefill gives what
    it gives waiting for every step, its ring within the plan; a ring of one block waits for each step anyway (the
    next block has no slot until then). Bit for bit on the CPU; on a GPU, two runs of the same prefill differ in
    float32's last bits whatever is queued (1.4e-6 at most on logits of ~1 at depth 1, 1x H200, session 33), so
    there they agree to 1e-5, as the multi-device paths do."""
    only(case, FULL)
    results = {}
    for queued in (0, 1, 2):
        with sp.expert_steps_queued(queued):
            results[queued] = streamed(model, tokens, depth=depth, attention_chunk=CHUNK)
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if jax.default_backend() == "gpu" else {"rtol": 0, "atol": 0}
    for queued, (logits, cache, stats) in results.items():
        np.testing.assert_allclose(logits, results[0][0], err_msg=f"{queued} queued", **tolerance)
        for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(results[0][1]), strict=True):
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tolerance)
        assert 0 < stats.peak_ring_bytes <= stats.plan.ring_bytes
        assert stats.block_passes == results[0][2].block_passes
    with pytest.raises(ValueError, match="queued expert steps must be >= 0"), sp.expert_steps_queued(-1):
        pass


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_matches_plain_prefill_at_every_ring_depth(case, model, tokens, reference, depth):
    if depth != 2:
        only(case, FULL)
    logits, cache, stats = streamed(model, tokens, depth=depth, attention_chunk=CHUNK)
    ref_logits, ref_cache = reference
    assert rel_rms(logits, ref_logits) < FLOAT32_RTOL
    assert cache_error(cache, ref_cache) < FLOAT32_RTOL
    assert stats.plan.depth == depth
    chunked = model.family.model.ChunkedAttention
    assert isinstance(stats.plan.attention, chunked) and stats.plan.attention.chunk == CHUNK
    assert stats.streamed_bytes == sum(p.nbytes for p in _pinned(model))
    assert 0 < stats.peak_ring_bytes <= stats.plan.ring_bytes


def test_stats_account_each_layer_by_phase(model, tokens):
    """Every layer's phases are its executables' wall times: the right phases per layer kind, each positive, and
    together no more than the layer took; the copies' issue is timed apart."""
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
    # Issuing the blocks' copies is host time in no phase: with the phases, within the whole.
    assert 0 < stats.copy_issue_s
    assert sum(map(sum, (p.values() for p in stats.layer_phase_s))) + stats.copy_issue_s <= stats.layer_done_s[-1]
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    assert stats.routed_pairs == moe_layers * tokens.size * cfg.num_experts_per_tok
    assert stats.routed_pairs <= stats.expert_slots


def test_blocks_are_copied_whole_to_the_rings_sharding():
    """placement.copied (the ring's copy of a block from pinned host memory): each array's values, dtype and shape
    on the target's device and memory kind; a target over several devices is refused, not split."""
    device = jax.devices()[0]
    pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    arrays = [jax.device_put(np.arange(24, dtype=np.float32).reshape(2, 3, 4), pinned),
              jax.device_put(np.ones((2, 5), ml_dtypes.float8_e4m3fn), pinned)]  # fmt: skip
    target = jax.sharding.NamedSharding(prefill_mesh((device,)), jax.sharding.PartitionSpec(PREFILL_AXIS))
    for source, copy in zip(arrays, copied(arrays, target), strict=True):
        assert copy.sharding == target and copy.sharding.memory_kind == "device"
        assert copy.dtype == source.dtype and copy.shape == source.shape
        np.testing.assert_array_equal(np.asarray(copy), np.asarray(source))
    twice = jax.sharding.Mesh(np.array([device, device]), ("x",))  # (one CPU device here: its size is what counts)
    wide = jax.sharding.NamedSharding(twice, jax.sharding.PartitionSpec())
    with pytest.raises(ValueError, match="one-device"):
        copied(arrays, wide)


@pytest.mark.parametrize(("capacity", "skip"), [(1, 0), (3, 0), (64, 0), (3, 2), (4, 8)])
def test_grouping_by_block_places_each_pair_once(capacity, skip):
    """group_by_expert over a block of experts: each of the block's pairs from an expert's skip-th on sits in
    its expert's row in token order, up to the capacity (the rest dropped); other experts' pairs and empty
    slots are nowhere."""
    rng = np.random.default_rng(capacity)
    t, k, n, first, size = 40, 4, 16, 4, 8
    ids = np.stack([rng.choice(n, k, replace=False) for _ in range(t)]).astype(np.int32)
    weights = rng.random((t, k)).astype(np.float32)
    rows, slot_weights = map(np.asarray, group_by_expert(ids, weights, size, capacity, first, skip))
    # The block's first expert traced (stream_prefill's grouping programs take it as an argument): the same slots.
    traced = jax.jit(group_by_expert, static_argnums=(2, 3, 5))(ids, weights, size, capacity, np.int32(first), skip)
    np.testing.assert_array_equal(np.asarray(traced[0]), rows)
    np.testing.assert_array_equal(np.asarray(traced[1]), slot_weights)
    assert rows.shape == slot_weights.shape == (size, capacity)
    for e in range(size):
        token, j = np.nonzero(ids == first + e)  # in token order
        token, j = token[skip : skip + capacity], j[skip : skip + capacity]
        np.testing.assert_array_equal(rows[e, : len(token)], token)
        np.testing.assert_array_equal(slot_weights[e, : len(token)], weights[token, j])
        assert (rows[e, len(token) :] == t).all() and (slot_weights[e, len(token) :] == 0).all()


@pytest.mark.parametrize("coarse", [False, True], ids=["eighths", "coarse"])
@pytest.mark.parametrize("skew", [0.0, 1.0, 3.0])
def test_block_passes_cover_every_pair_within_the_slots(skew, coarse):
    """Whatever the routing's skew (expert loads drawn with Zipf-like weights), every pass of a block fits the
    slots the plan allows, and each expert's pairs fit its first pass or the later passes over the busy ones;
    with coarse capacities (few pairs per expert), each a power of two (the busy experts too, but for all of them)."""
    rng = np.random.default_rng(int(10 * skew))
    for _ in range(200):
        size, pairs = int(rng.integers(1, 40)), int(rng.integers(0, 5000))
        load = np.arange(1, size + 1, dtype=np.float64) ** -skew
        counts = rng.multinomial(pairs, rng.permutation(load / load.sum()))
        slots = max(size, int(rng.integers(1, 3 * pairs + 2)))
        plan = sp._block_passes(counts, 0, slots, coarse)
        assert max(plan.pass_slots) <= slots
        if coarse:
            busy = plan.busy if plan.busy < size else 1  # at most all the block's experts
            assert all(c & (c - 1) == 0 for c in (plan.capacity, plan.later_capacity or 1, busy or 1)), plan
        busy = counts > plan.capacity
        assert busy.sum() <= plan.busy
        assert (counts[busy] <= plan.capacity + plan.later * plan.later_capacity).all()


@pytest.mark.parametrize("tokens", [1024, 2048])
def test_decode_steps_of_uniform_routing_keep_to_a_few_block_shapes(tokens):
    """A decode step's layers have few pairs per expert, so their capacities are powers of two, which may double the
    busiest expert's pairs: the plan allows a block that many slots, so that its pass stays one and its shapes few.
    With 1.5 slots a pair, Qwen3-30B-A3B's 16 blocks of 8 experts at 1,024 slots went into later passes over a varying
    number of busy experts: 25 shapes over 300 steps of uniform routing, new ones to step 243, each a compile of
    seconds on the GPU (session 31: the streamed step still compiled after 40 warm-up steps)."""
    cfg = geometry_config("qwen3-30b-a3b", weight_format="fp8")
    experts, k, size = cfg.n_routed_experts, cfg.num_experts_per_tok, 8
    slots = sp.block_slots(cfg, tokens, size)
    rng = np.random.default_rng(0)
    shapes, last_new = set(), 0
    for step in range(300):
        ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :k]
        counts = np.bincount(ids.ravel(), minlength=experts)
        assert counts.mean() <= sp.COARSE_MEAN_PAIRS  # as _moe_layer decides coarse
        for first in range(0, experts, size):
            shape = sp._block_passes(counts[first : first + size], 0, slots, coarse=True)
            assert shape.later == 0  # one pass a block
            if shape not in shapes:
                shapes.add(shape)
                last_new = step
    assert len(shapes) <= 3 and last_new < 50, (shapes, last_new)


def test_skewed_routing_runs_in_passes_within_the_plan(case, model, exact_model):
    """A prompt of one repeated token routes every token to the same experts (identical hidden states: the
    attention averages identical values). The busy blocks then run in several passes, none larger than the
    plan allows, with the plain path's result."""
    only(case, FULL, "gpt_oss-mxfp4")
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


def test_resident_copies_from_the_pinned_copy_equal_the_checkpoints(case, model, checkpoint):
    """Re-placing experts while serving copies them from the pinned host copy (PinnedExperts.resident), not from the
    checkpoint: the same arrays, dtypes and slots as the loader's copies from the checkpoint, for every format (FP8
    kept as stored with its scales, the others made into the compute dtype with their biases: gpt-oss's in
    bfloat16 too)."""
    def check(m):
        loader = m._loader
        layer = next(iter(loader.expert_names))
        ids = [m.config.n_routed_experts - 1, 1]
        assert pinned_layer(m.weights.layers[layer].mlp.expert_layer) is not None
        pinned, stored = m.resident_copies(layer, ids), loader.resident_experts(loader.expert_names[layer], ids)
        leaves, expected = jax.tree.leaves(pinned), jax.tree.leaves(stored)
        assert jax.tree.structure(pinned) == jax.tree.structure(stored) and len(leaves) == len(expected)
        for a, b in zip(leaves, expected, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))

    check(model)
    if case == "gpt_oss-mxfp4":
        with load(checkpoint, "bfloat16") as m:
            check(m)


def test_decode_continues_from_the_streamed_cache(model, exact_model, tokens, reference):
    """The streamed prefill's output is the decode state: greedy decode from its cache gives the tokens and logits
    that greedy decode gives from the plain prefill's (windows and sinks read the cache as prefill wrote it)."""
    logits, cache, _ = streamed(model, tokens, depth=2, attention_chunk=CHUNK)
    ref_logits, ref_cache = reference
    step = jax.jit(exact_model.family.model.decode_step, static_argnums=0)
    nxt, expected = logits.argmax(-1).astype(np.int32), ref_logits.argmax(-1).astype(np.int32)
    positions = LENGTHS.copy()
    for i in range(DECODE_STEPS):
        np.testing.assert_array_equal(nxt, expected, err_msg=f"greedy token {i}")
        logits, cache = step(exact_model.config, exact_model.weights, nxt, positions, cache)
        ref_logits, ref_cache = step(exact_model.config, exact_model.weights, expected, positions, ref_cache)
        assert rel_rms(logits, ref_logits) < FLOAT32_RTOL, i
        nxt, expected = np.asarray(logits).argmax(-1).astype(np.int32), np.asarray(ref_logits).argmax(-1)
        positions = positions + 1


@pytest.mark.parametrize("cpu_blocks", [0, 3])
def test_streamed_decode_steps_match_the_decode_step(case, model, exact_model, tokens, reference, cpu_blocks):
    """Decode steps with the routed experts streamed (stream_decode_step, the offline batch's large-batch decode)
    give the logits and caches of the family's decode step on XLA experts, a row that is not live included (its
    token routes to no expert in both); with the last 3 expert blocks of each layer on the CPU kernels meanwhile
    (co-execution) within the bank's tolerance."""
    ref_logits, ref_cache = reference
    step = jax.jit(exact_model.family.model.decode_step, static_argnums=(0, 5))
    cache = jax.tree.map(jnp.copy, ref_cache)
    nxt, positions, live = ref_logits.argmax(-1).astype(np.int32), LENGTHS.copy(), np.array([True, False])
    tolerance = BANK_RTOL if cpu_blocks else FLOAT32_RTOL
    for i in range(3):
        logits, cache = sp.stream_decode_step(model, nxt, positions, live, cache, cpu_blocks=cpu_blocks)
        expected, ref_cache = step(exact_model.config, exact_model.weights, nxt, positions, ref_cache,
                                   NO_SCHEDULE, live)  # fmt: skip
        assert rel_rms(np.asarray(logits)[live], np.asarray(expected)[live]) < tolerance, i
        assert cache_error(cache, ref_cache) < tolerance, i
        nxt, positions = np.asarray(expected).argmax(-1).astype(np.int32), positions + 1


@pytest.mark.parametrize("on_cpu", [False, True], ids=["gpu_attends", "cpu_attends"])
def test_a_cache_in_host_memory_matches_the_decode_step_on_the_same_cache(case, model, exact_model, reference, on_cpu):
    """Streamed decode steps over a KV cache in host memory (HostKVCache), each layer's copied to the device for its
    attention and the step's entries written back, or attended over on the CPU where it is (attention_on_cpu,
    hybridjit/ops/cpu_attention.py's kernels), give the logits of the family's decode step with XLA attention on the
    same cache, and leave the same entries in it: MLA (DeepSeek) and GQA, rows at different lengths; a sliding-window
    layer keeps its window there as a ring, as on the device (gpt-oss, with its sinks, and the windowed Mixtral
    cases)."""
    ref_logits, ref_cache = reference
    host = HostKVCache(model, 2, CACHE_LEN, attention_on_cpu=on_cpu)
    for row, length in enumerate(LENGTHS):
        host.insert(ref_cache, row, int(length), row)
    step = jax.jit(exact_model.family.model.decode_step, static_argnums=(0, 5))
    nxt, positions, live = ref_logits.argmax(-1).astype(np.int32), LENGTHS.copy(), np.ones(2, bool)
    for i in range(3):
        logits, held = sp.stream_decode_step(model, nxt, positions, live, host)
        expected, ref_cache = step(exact_model.config, exact_model.weights, nxt, positions, ref_cache,
                                   NO_SCHEDULE, live)  # fmt: skip
        assert held is host
        assert rel_rms(logits, expected) < FLOAT32_RTOL, i
        for view, ref in zip(jax.tree.leaves(host._views), jax.tree.leaves(ref_cache), strict=True):
            for row, end in enumerate(positions + 1):
                # The position each index holds: a full layer's index its own, a ring's the latest of its residue.
                index_holds = held_positions(np.array([end - 1]), view.shape[1])[0]
                kept = index_holds >= 0
                got, want = view[row][kept], np.asarray(ref)[row][index_holds[kept]]
                assert rel_rms(got, want) < FLOAT32_RTOL, (i, row)
        nxt, positions = np.asarray(expected).argmax(-1).astype(np.int32), positions + 1
    with pytest.raises(ValueError, match="attention_on_cpu: the CPU attends over a cache in host memory"):
        Engine(model, 2, CACHE_LEN, micro_batches=1, stream_experts=True, attention_on_cpu=True)


def test_an_engine_streaming_its_experts_decodes_as_the_engine_on_xla_experts(case, model, exact_model):
    """Engine(stream_experts=True) generates the greedy tokens of an engine whose experts are XLA arrays, over slots
    joined at different prompt lengths with one left free. (Not against the CPU kernels' engine: the integer
    formats' kernels quantize activations, and greedy tokens part at near-ties.) Also with the KV cache in pinned host
    memory (each layer's copied to the device for its attention, the step's entries written back), and attended over
    on the CPU there. MLA, GQA, and gpt-oss's windowed rings and sinks: the other families' streamed steps are checked
    against the decode step above."""
    only(case, FULL, "gpt_oss-mxfp4", "glm4_moe-bf16")
    prompts = [[5, 9, 2, 7, 11, 3], [4, 8, 15, 16, 23, 42, 7, 1, 9, 12, 30]]
    generated = []
    holdings = [(False, False, False), (True, False, False), (True, True, False), (True, True, True)]
    # (experts streamed, KV cache in host memory, the CPU attending over it)
    for stream, in_host, on_cpu in holdings:
        engine = Engine(model if stream else exact_model, 3, CACHE_LEN, micro_batches=1, stream_experts=stream,
                        kv_in_host=in_host, attention_on_cpu=on_cpu)  # fmt: skip
        prefilled = engine.prefill(prompts, [SamplingParams()] * 2)
        for row, slot in enumerate((0, 2)):
            engine.insert(prefilled, row, slot, SamplingParams())
        steps = [engine.generate() for _ in range(4)]
        generated.append(np.concatenate([s.tokens() for s in steps])[:, [0, 2]])
        assert engine.steps == 1
        if in_host:  # reset zeroes the pinned buffers in place (a failed step may leave non-finite entries there)
            pinned = engine.caches[0]
            engine.reset()
            assert engine.caches[0] is pinned and not any(np.asarray(a).any() for a in jax.tree.leaves(pinned.layers))
    for tokens in generated[1:]:
        np.testing.assert_array_equal(tokens, generated[0])
    with pytest.raises(ValueError, match="kv_in_host: a cache in host memory is read by streamed decode steps"):
        Engine(model, 3, CACHE_LEN, micro_batches=1, kv_in_host=True)


def test_an_engine_streams_its_experts_only_when_they_are_pinned_and_all_run(case, model, exact_model, monkeypatch):
    only(case, FULL)
    with pytest.raises(ValueError, match="stream_experts: .*pinned_experts=True"):
        Engine(exact_model, 2, CACHE_LEN, stream_experts=True)
    with pytest.raises(ValueError, match="cpu_blocks=2: the CPU takes blocks of a streamed step; set stream_experts"):
        Engine(model, 2, CACHE_LEN, cpu_blocks=2)
    with pytest.raises(ValueError, match=r"cpu_blocks must be in \[0, 8\) for layer 1's 8 expert blocks"):
        Engine(model, 2, CACHE_LEN, stream_experts=True, cpu_blocks=8)
    monkeypatch.setattr(model, "expert_schedule", ExpertSchedule(n_skipped=1))
    with pytest.raises(ValueError, match="stream_experts: streams every routed expert; turn Expert Deferral"):
        Engine(model, 2, CACHE_LEN, stream_experts=True)


def test_vram_budget_sets_the_depth_and_bounds_the_ring(case, model, tokens):
    only(case, FULL)
    pinned, device = _pinned(model), model.placement.device
    plan = sp.plan_ring(model.config, pinned, 2, 24, model.dtype, device, attention_chunk=CHUNK, depth=1)
    for blocks, depth in [(2.5, 2), (1000, len(pinned[0].blocks))]:  # a whole layer at most
        budget = plan.activation_bytes + int(blocks * plan.block_bytes)
        _, _, stats = streamed(model, tokens, attention_chunk=CHUNK, vram_budget=budget)
        assert stats.plan.depth == depth
        assert stats.peak_ring_bytes <= budget - stats.plan.activation_bytes


def test_budget_below_one_block_is_a_clear_error(case, model, tokens):
    only(case, FULL)
    plan = sp.plan_ring(model.config, _pinned(model), 2, 24, model.dtype, model.placement.device,
                        attention_chunk=CHUNK, depth=1)
    with pytest.raises(ValueError, match="expert block.*VRAM budget"):
        streamed(model, tokens, attention_chunk=CHUNK, vram_budget=plan.activation_bytes + plan.block_bytes - 1)


def test_abandon_stops_the_prefill_before_its_next_executable(case, model, tokens):
    only(case, FULL)
    asked = []

    def abandon():  # the serving scheduler's: the request ended, or the server stops
        asked.append(len(asked))
        return len(asked) > 3

    with pytest.raises(sp.PrefillAbandoned, match="^abandoned before "):
        streamed(model, tokens, abandon=abandon)
    assert len(asked) == 4  # asked before each executable, none run after it said so
    assert streamed(model, tokens, abandon=lambda: False)[0].shape == (len(tokens), model.config.vocab_size)


def test_new_prompts_reuse_the_grouping_programs(case, model, monkeypatch):
    """The programs that group a layer's routed pairs are keyed by their steps' shapes alone, never by the blocks'
    positions or a whole layer's plans: prompts routed differently share them (one program over a layer's plans
    was compiled again for nearly every new prompt, seconds a layer on the GPU). With few pairs per expert, as
    here, every capacity is a power of two (COARSE_MEAN_PAIRS), so new routings rarely need a new shape."""
    only(case, FULL)
    positions, group_step = collections.defaultdict(set), sp._group_step

    def recording(shapes, ids, weights, counts, firsts):
        positions[shapes].add(tuple(np.asarray(firsts)))
        return group_step(shapes, ids, weights, counts, firsts)

    monkeypatch.setattr(sp, "_group_step", recording)
    rng = np.random.default_rng(7)
    for _ in range(3):
        streamed(model, rng.integers(2, model.config.vocab_size, (2, 24)).astype(np.int32))
    assert all(plan.first == 0 for shapes in positions for plan in shapes)
    assert max(map(len, positions.values())) > 1  # one program for blocks at several positions
    capacities = {c for shapes in positions for plan in shapes for c in (plan.capacity, plan.later_capacity) if c}
    assert capacities and all(c & (c - 1) == 0 for c in capacities), capacities


def test_unpinned_model_is_refused(case, checkpoint, tokens):
    only(case, FULL)
    unpinned = hybrid("float32", pinned_experts=False)
    plain = hybridjit.load(checkpoint, placement=unpinned)
    try:
        with pytest.raises(ValueError, match="pinned_experts=True"):
            streamed(plain, tokens)
        assert prefill_path.choose_prefill_path(plain, 1, 1 << 16, threshold=1) == "hybrid"
    finally:
        plain.close()


def test_bank_reads_the_pinned_copy_and_lives_with_it():
    """Zero copies: zeroing an expert in the pinned buffer changes what the CPU kernels compute; the pinned copy
    is released with its bank layer."""
    rng = np.random.default_rng(1)
    gate = [rng.standard_normal((8, 16), np.float32) for _ in range(4)]
    down = [rng.standard_normal((16, 8), np.float32) for _ in range(4)]
    layer = register_pinned(gate, gate, down, devices=jax.devices()[:1], experts_per_block=2)
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


def test_pinned_mxfp4_layer_computes_as_the_unpinned_one():
    """register_pinned takes register_layer's options (MXFP4, interleaved gate/up, biases, the clamped SwiGLU): the
    CPU kernels compute the same on the pinned copy, whose blocks say how they are stored."""
    rng = np.random.default_rng(2)
    e, d, f = 4, 64, 32
    gate_up, gate_up_scales = quantize_mxfp4(rng.standard_normal((e, 2 * f, d)).astype(np.float32))
    down, down_scales = quantize_mxfp4(rng.standard_normal((e, d, f)).astype(np.float32))
    activation = ("clamped_swiglu", 1.702, 2.0)
    weights = ([m.reshape(2 * f, -1) for m in gate_up], None, [m.reshape(d, -1) for m in down])
    biases = (list(rng.standard_normal((e, 2 * f)).astype(np.float32)), None,
              list(rng.standard_normal((e, d)).astype(np.float32)))
    options = dict(gate_scale=list(gate_up_scales), down_scale=list(down_scales), fmt="mxfp4",
                   gate_up_interleaved=True, biases=biases, activation=activation)
    layer = register_pinned(*weights, **options, devices=jax.devices()[:1], experts_per_block=2)
    cpu = jax.devices("cpu")[0]
    x = jax.device_put(rng.standard_normal((5, d)).astype(np.float32), cpu)
    ids = jax.device_put(np.stack([rng.choice(e, 2, replace=False) for _ in range(5)]).astype(np.int32), cpu)
    routing = jax.device_put(np.full((5, 2), 0.5, np.float32), cpu)
    with register_layer(*weights, **options) as unpinned:
        np.testing.assert_array_equal(
            np.asarray(routed_experts(x, ids, routing, layer=layer.id)),
            np.asarray(routed_experts(x, ids, routing, layer=unpinned.id)),
        )
    pinned = pinned_layer(layer.id)
    assert pinned.storage == ExpertStorage("mxfp4", (1, 32), True, activation)
    assert pinned.blocks[0].weights[1] is None and len(pinned.blocks[0].arrays) == 6  # weights, scales, biases
    layer.close()


@pytest.mark.parametrize("geometry", ["deepseek-v3", "qwen3-235b-a22b", "gpt-oss-120b"])
def test_path_choice_follows_the_cost_model(geometry):
    cfg = geometry_config(geometry, weight_format="fp8")
    rates = prefill_path.PrefillRates(pcie_gbps=50.0, gpu_tflops=500.0, cpu_expert_tflops=4.0)
    cross = prefill_path.crossover_length(cfg, rates)
    for length in (cross - 1, cross):
        t = prefill_path.prefill_seconds(cfg, 1, length, rates)
        assert (t["stream"] < t["hybrid"]) == (length >= cross)
    # Long prompts stream at the PCIe rate until the GPU's compute takes over.
    stream_s = prefill_path.prefill_seconds(cfg, 1, 8192, rates)["stream"]
    assert stream_s == pytest.approx(prefill_path.expert_bytes(cfg) / 50e9)
    assert prefill_path.crossover_length(cfg, dataclasses.replace(rates, cpu_expert_tflops=40.0)) > cross


def test_modelled_bytes_are_the_checkpoints(model, checkpoint):
    """The cost model's bytes of the routed experts, from the config alone, are those the checkpoint stores."""
    assert prefill_path.expert_bytes(model.config) == routed_expert_bytes(model.config, Checkpoint(checkpoint))


def test_windows_shorten_the_modelled_attention():
    """gpt-oss's sliding layers (window 128, every other layer) score at most 128 keys a query: the modelled
    attention core of a layer is the mean of a full layer's and a sliding one's."""
    cfg = geometry_config("gpt-oss-120b")
    length, heads, e = 32768, cfg.num_attention_heads, cfg.head_dim
    assert [cfg.window(i) for i in range(2)] == [128, None]
    full, sliding = length * (length + 1) // 2, 128 * 129 // 2 + (length - 128) * 128
    core = family_of(cfg).cost.layer_flops(cfg, 1, length)["attention core"]
    assert core == pytest.approx(2.0 * heads * 2 * e * (full + sliding) / 2)


def test_path_choice_threshold_override(model):
    assert prefill_path.choose_prefill_path(model, 1, 100, threshold=64) == "stream"
    assert prefill_path.choose_prefill_path(model, 1, 32, threshold=64) == "hybrid"
    expected = "stream" if jax.default_backend() == "gpu" else "hybrid"  # no PCIe to save on a CPU
    slow_cpu = prefill_path.PrefillRates(cpu_expert_tflops=1e-3)
    assert prefill_path.choose_prefill_path(model, 1, 1 << 20, rates=slow_cpu) == expected


def test_a_model_with_every_expert_resident_does_not_stream(case, checkpoint):
    """With every routed expert placed on the device, the cost model never streams (on a GPU the rates below make
    streaming win for a model with its experts on the host, as the test above checks); the threshold still forces."""
    only(case, FULL)
    m = load(checkpoint, "float32")
    try:
        m.place_experts(Residency({layer: tuple(range(n)) for layer, n in bank_moe_layers(m.weights).items()}))
        assert not m.experts_on_host
        slow_cpu = prefill_path.PrefillRates(cpu_expert_tflops=1e-3)
        assert prefill_path.choose_prefill_path(m, 1, 1 << 20, rates=slow_cpu) == "hybrid"
        assert prefill_path.choose_prefill_path(m, 1, 100, threshold=64) == "stream"
    finally:
        m.close()


@on_gpu
def test_bfloat16_with_cudnn_attention_is_as_accurate_as_the_plain_path(checkpoint, model, tokens, reference):
    bf16 = load(checkpoint, "bfloat16")
    try:
        logits, cache, stats = streamed(bf16, tokens)
        plain_logits, plain_cache = plain_prefill(bf16, tokens)  # the hybrid path in bfloat16
        assert isinstance(stats.plan.attention, bf16.family.model.CudnnAttention)
        ref_logits, ref_cache = reference
        assert rel_rms(logits, ref_logits) < rel_rms(plain_logits, ref_logits) + BFLOAT16_SLACK
        assert cache_error(cache, ref_cache) < cache_error(plain_cache, ref_cache) + BFLOAT16_SLACK
    finally:
        bf16.close()


def _pinned(model):
    return [pinned_layer(layer.mlp.expert_layer) for layer in model.weights.layers if isinstance(layer.mlp, MoE)]


def test_generate_takes_the_streamed_path_above_its_threshold(case, model):
    only(case, FULL, "gpt_oss-mxfp4")
    prompts = [[5, 17, 42, 99, 3, 250, 7, 8, 9], [11, 12, 13]]
    model.stream_prefill_threshold = None  # the cost model: hybrid on a CPU
    hybrid = model.generate(prompts, max_new_tokens=6)
    model.stream_prefill_threshold = 1
    try:
        assert model.generate(prompts, max_new_tokens=6) == hybrid
    finally:
        model.stream_prefill_threshold = None


# ------------------------------------------------------------------------------- the GQA attention cores

GQA_SHAPE = (2, 21, 6, 2, 8)  # batch, tokens (not a multiple of the chunks), heads, key/value heads, head dim


def _gqa_operands(dtype=np.float32):
    b, t, h, kv, e = GQA_SHAPE
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((b, t, heads, e)).astype(dtype) for heads in (h, kv, kv))
    return q, k, v, (rng.standard_normal(h) + 1.0).astype(np.float32)


@pytest.mark.parametrize("window", [None, 1, 3, 8, 12, 30])
@pytest.mark.parametrize("chunk", [4, 8, 32])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
def test_chunked_gqa_core_equals_the_plain_core(window, chunk, with_sinks):
    """gqa.ChunkedAttention (windowed chunks read only their keys) equals gqa.causal for windows shorter than a
    chunk, between a chunk and the prompt, and longer than it, with and without sinks."""
    q, k, v, sinks = _gqa_operands()
    sinks = sinks if with_sinks else None
    scale = GQA_SHAPE[-1] ** -0.5
    expected = gqa.causal(q, k, v, scale, sinks, window)
    got = jax.jit(gqa.ChunkedAttention(chunk), static_argnums=(3, 5))(q, k, v, scale, sinks, window)
    assert rel_rms(got, expected) < FLOAT32_RTOL


@on_gpu
@pytest.mark.parametrize("window", [None, 3, 12])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
def test_cudnn_gqa_core_equals_the_plain_core(window, with_sinks):
    """gqa.CudnnAttention in bfloat16 (sinks from cuDNN's log-sum-exp statistics) against gqa.causal in float32 on
    the same bfloat16 inputs."""
    q, k, v, sinks = _gqa_operands(ml_dtypes.bfloat16)
    sinks = sinks if with_sinks else None
    scale = GQA_SHAPE[-1] ** -0.5
    up = [a.astype(np.float32) for a in (q, k, v)]
    expected = gqa.causal(*up, scale, sinks, window)
    got = jax.jit(gqa.CudnnAttention(), static_argnums=(3, 5))(q, k, v, scale, sinks, window)
    assert rel_rms(got, expected) < BFLOAT16_SLACK


@on_gpu
@pytest.mark.parametrize("window", [None, 5])
def test_fused_decode_core_equals_the_plain_core(window):
    """gqa.decode_core over FUSED_DECODE_ROWS rows in bfloat16, which runs cuDNN's fused core on a GPU, against
    gqa.attend in float32 on the same inputs: each row at its own position, some cache positions not written yet
    (negative, as a ring's), a window or none."""
    rows, s, h, kv, e = gqa.FUSED_DECODE_ROWS, 40, 8, 2, 64
    rng = np.random.default_rng(5)
    shapes = ((rows, 1, h, e), (rows, s, kv, e), (rows, s, kv, e))
    q, k, v = (rng.standard_normal(shape).astype(ml_dtypes.bfloat16) for shape in shapes)
    keys = np.where(rng.random((rows, s)) < 0.1, -1, np.arange(s)).astype(np.int32)
    positions = rng.integers(1, s, (rows, 1)).astype(np.int32)
    visible = gqa.visibility(jnp.asarray(positions), jnp.asarray(keys), window)
    scale = e**-0.5
    expected = gqa.attend(*(a.astype(np.float32) for a in (q, k, v)), visible, scale, None)
    fused = jax.jit(gqa.decode_core, static_argnums=4)
    assert "cudnn" in fused.lower(q, k, v, visible, scale, None).compile().as_text()  # the fused core, not attend
    assert rel_rms(fused(q, k, v, visible, scale, None), expected) < BFLOAT16_SLACK


# ------------------------------------------------------------------------------- experts as stored


def _matrices(rng, shape, n=3):
    return rng.standard_normal((n, *shape)).astype(np.float32)


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4", "mxfp4"])
def test_stored_experts_dequantize_on_the_device_as_on_the_host(fmt):
    """ExpertStorage.matrix (what a streamed block goes through) gives what the loader's host dequantization gives:
    FP8 blocks partial at the edges, int groups over an odd column count, MXFP4."""
    rng = np.random.default_rng(7)
    shape = (40, 64) if fmt == "mxfp4" else (40, 71)
    w = _matrices(rng, shape)
    if fmt == "mxfp4":
        blocks, scales = quantize_mxfp4(w)  # [e, out, in / 32, 16], [e, out, in / 32]
        stored, expected = blocks.reshape(len(w), shape[0], -1), dequantize_mxfp4(blocks, scales)
        storage = ExpertStorage("mxfp4", (1, 32))
    else:
        if fmt == "fp8":
            pairs = [quantize_fp8_blocks(m, (32, 32)) for m in w]
            expected = np.stack([dequantize_fp8_blocks(q, s, (32, 32)) for q, s in pairs])
            storage = ExpertStorage("fp8", (32, 32))
        else:
            int_quant = IntQuantConfig(bits=int(fmt[3:]), group_size=128)
            pairs = [quantize_int_groups(m, int_quant.bits, int_quant.group_size) for m in w]
            expected = np.stack([dequantize_int_groups(q, s, int_quant, shape) for q, s in pairs])
            storage = ExpertStorage(fmt, (1, 128))
        stored, scales = (np.stack(a) for a in zip(*pairs, strict=True))
    got = jax.jit(storage.matrix, static_argnums=(2, 3))(stored, scales, shape[1], jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), expected)


def test_interleaved_gate_up_and_biases_come_apart_on_the_device():
    """gpt-oss's gate_up rows (even: gate, odd: up) and their biases become Experts' gate and up."""
    rng = np.random.default_rng(8)
    gate_up, down = _matrices(rng, (8, 6)), _matrices(rng, (6, 4))
    biases = (_matrices(rng, (8,)), None, _matrices(rng, (6,)))
    storage = ExpertStorage("f32", gate_up_interleaved=True, activation=("clamped_swiglu", 1.702, 7.0))
    experts = storage.experts((gate_up, None, down), None, biases, jnp.float32)
    np.testing.assert_array_equal(experts.gate, gate_up[:, 0::2])
    np.testing.assert_array_equal(experts.up, gate_up[:, 1::2])
    np.testing.assert_array_equal(experts.gate_bias, biases[0][:, 0::2])
    np.testing.assert_array_equal(experts.up_bias, biases[0][:, 1::2])
    assert experts.activation == storage.activation
