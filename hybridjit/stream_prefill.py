"""Stream-loading prefill (OSDI '26 §3.1): long prompts computed entirely on the GPU while the routed experts
stream in from the one pinned host copy that the CPU expert kernels also read (hybridjit.pinned_experts).

For long prompts the CPU's compute, not its memory bandwidth, limits the hybrid path: every expert is used by
many tokens, so it pays to bring the experts to the GPU instead. The weights travel as stored (FP8 + block
scales: half the bytes of BF16; int8/int4 with group scales; gpt-oss's MXFP4 with its biases) and are dequantized
on the GPU (models/common/expert_storage.py). Non-expert weights are already resident on the GPU (the hybrid
decode needs them there), so only the routed experts stream. Every family runs it: the attention cores come from
the family's model module (ChunkedAttention, fused_attention), the rest is the shared decoder's.

The pipeline runs over per-layer executables (DESIGN.md §4: separate executables with asynchronous copies
overlap transfers with compute far better than host offload inside one jit). The paper's loader, model and
unloader threads become one ordered host loop here, because of how PJRT allocates on a GPU: device memory is
"compute-synchronized" (xla/pjrt/local_device_state.h), so a copy into a newly allocated buffer waits for all
the compute enqueued before the copy was issued. A loader thread racing a model thread that runs ahead
therefore serializes the copies behind the compute (measured: each MoE layer took its transfer time plus its
compute time, bench/RESULTS.md). The loop instead keeps the compute queue short and issues copies first:

  load     before each executable, copy the next expert blocks into every free ring slot (placement.copied from
           the pinned host copy: an asynchronous DMA that starts at once, the compute queue being empty);
  compute  dispatch one executable (attention with the dense MLP, or with the router and shared experts of a
           MoE layer; then the tokens grouped by expert, one executable per expert block, the combine) and wait
           for it; an executable that reads a block waits on the device for that block's copy;
  unload   once a block's executable has finished, delete its device buffers: its slot is free for the next
           copy, issued before the next executable.

The ring holds at most `depth` blocks on the device. Its depth follows a VRAM budget: a whole layer of
experts ahead when activations are small (short prompts, transfer-bound), down to ping-pong (2) and then 1
(no overlap: slower, not failing) as a long prompt's activations take the memory. Attention runs chunked over
queries (the family's ChunkedAttention) or fused (the family's fused_attention: cuDNN's on a GPU in 16-bit), so no
[t, t] scores exist.

The result is the decode state: the KV cache in the layout decode_step uses, and the logits of each
sequence's last prompt token.
"""

import collections
import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from hybridjit.host_kv_cache import DEVICE_LAYERS, HostKVCache
from hybridjit.machine_floors import device_to_device_gbps, pinned_h2d_gbps
from hybridjit.models.common.config import attended
from hybridjit.models.common.expert_storage import ExpertStorage
from hybridjit.models.common.experts import experts_grouped, group_by_expert
from hybridjit.models.common.layers import linear, mlp, rms_norm
from hybridjit.models.common.moe import MoE
from hybridjit.models.common.prefill_cores import HeadsSplit
from hybridjit.models.common.routing import route
from hybridjit.models.registry import ModelConfig, family_of
from hybridjit.ops.async_experts import submit_routed_experts, wait_routed_experts
from hybridjit.pinned_experts import ExpertBlock, PinnedExperts, pinned_layer
from hybridjit.placement import PREFILL_AXIS, copied, prefill_mesh

# Scores of one query chunk of ChunkedAttention ([b, h, chunk, s] float32, about three live copies) stay
# under this many bytes when the chunk is not given.
ATTENTION_SCRATCH = 1 << 30
# Experts get more tokens than the average under real routing, and capacity rounds up (_capacity): the
# activation estimate plans for this many slots per routed token (twice as many where capacities are powers of
# two: block_slots) in one pass of an expert block. A block whose busiest expert needs more (skewed routing: a
# prompt of one repeated token sends every token to the same experts) runs in several passes of at most that many
# slots (_block_passes), so the estimate is a bound.
SLOTS_PER_PAIR = 1.5
# Executables also hold fixed-size scratch (cuBLAS/cuDNN workspaces), whatever the prompt.
WORKSPACE_BYTES = 64 << 20
# A layer whose experts get at most this many routed pairs each on average plans its blocks with coarse capacities
# (_capacity): powers of two. Its GEMMs are then a small part of a step bound by the link even at 2x padding
# (DeepSeek-V3: a 32-expert block at 1,024 slots each is 2.9 TFLOP, ~10 ms at the ~290 TFLOP/s the grouped GEMMs
# reach, against the block's 26 ms copy), while every new capacity compiles a grouping and an expert-step
# program: seconds each on a GPU, and with eighths, nearly every new prompt's or decode step's routing needs one.
COARSE_MEAN_PAIRS = 512
# The hand-off slot of a streamed decode step's CPU share (co-execution): the step is the only program running, so
# the interactive decode's first slot is free.
CPU_SHARE_SLOT = 0
# Expert steps the ring leaves queued on the devices while it waits for the one before them to free its blocks
# (_Ring.release; expert_steps_queued). With 0 the ring waits for every step as it is dispatched. With 1, each step
# is dispatched before the host waits for the previous one, so the device need not idle while the host frees a slot,
# issues the next copy and dispatches: a streamed decode step of Qwen3-30B-A3B (8 layers, ~152 executables) took
# 180 ms at 2,048 slots with each waited for, 148 ms with 1 queued, 154 ms with 2 (1x H200, session 33,
# bench/offline.py --queued-expert-steps 0 1 2); DeepSeek-V3's stream-loaded prefill ran no slower at 8K and 5%
# faster at 32K with 1. Either way a slot's next copy is issued once its step has run.
_queued_expert_steps = 1


def queued_expert_steps() -> int:
    return _queued_expert_steps


@contextlib.contextmanager
def expert_steps_queued(steps: int) -> Iterator[None]:
    """Rings leave `steps` (0 or more) expert steps queued inside the block, then as many as before; for benchmarks
    comparing the two ways."""
    global _queued_expert_steps
    if steps < 0:
        raise ValueError(f"queued expert steps must be >= 0, got {steps}")
    before, _queued_expert_steps = _queued_expert_steps, steps
    try:
        yield
    finally:
        _queued_expert_steps = before


# ------------------------------------------------------------------------------------------ the plan


@dataclasses.dataclass(frozen=True)
class RingPlan:
    """How one stream-loaded prefill uses device memory beyond the resident weights and the cache."""

    depth: int  # expert blocks resident on the device at once
    block_bytes: int  # bytes of the largest block, as streamed
    activation_bytes: int  # estimated peak of everything else: activations, scores, dequantized weights
    attention: Callable  # the attention core: the family's ChunkedAttention or its fused one; over several
    # devices, that core with its heads split over them (HeadsSplit)
    block_slots: int  # the most token slots one pass of an expert block may take (the estimate's assumption)

    @property
    def ring_bytes(self) -> int:
        return self.depth * self.block_bytes


def block_slots(cfg: ModelConfig, tokens: int, experts_per_block: int) -> int:
    """Token slots one pass of an expert block may take: SLOTS_PER_PAIR per routed pair the block gets on
    average, twice that where its capacities are powers of two (COARSE_MEAN_PAIRS: the rounding alone may double
    the busiest expert's pairs), and at least one per expert. Without the doubling, a decode step's blocks ran in
    a first pass and later ones over a varying number of busy experts, whose every new shape compiled: Qwen3-30B-A3B
    at 1,024 slots (64 pairs an expert on average) still compiled after 40 steps (1x H200, session 31)."""
    per_expert = tokens * cfg.num_experts_per_tok / cfg.n_routed_experts
    rounding = 2 if per_expert <= COARSE_MEAN_PAIRS else 1  # what a power-of-two capacity may pad
    return max(experts_per_block, math.ceil(rounding * SLOTS_PER_PAIR * per_expert * experts_per_block))


def activation_bytes(cfg: ModelConfig, batch: int, length: int, dtype, attention, experts_per_block: int) -> int:
    """An upper estimate of the device memory one layer's prefill needs besides weights, cache and ring: the
    largest of its phases (attention, dense MLP, one pass of an expert block) on top of the residual stream and
    the executables' workspaces."""
    n, item, d, h = batch * length, jnp.dtype(dtype).itemsize, cfg.hidden_size, cfg.num_attention_heads
    family = family_of(cfg)
    residual = n * d * (4 * item + 4)  # x, x after attention, normed tokens, shared experts; float32 sum
    attention_phase = n * family.cost.attention_activation_elements(cfg) * item
    if isinstance(attention, family.model.ChunkedAttention):  # [b, h, chunk, s] float32 scores
        attention_phase += 3 * batch * h * attention.chunk * length * 4
    dense_phase = 3 * n * cfg.intermediate_size * item
    slots = block_slots(cfg, n, experts_per_block)
    f = cfg.moe_intermediate_size
    expert_phase = slots * (d * item + 3 * f * item + d * 4) + 3 * experts_per_block * d * f * (item + 4)
    return WORKSPACE_BYTES + residual + max(attention_phase, dense_phase, expert_phase)


def plan_ring(
    cfg: ModelConfig,
    experts: list[PinnedExperts],
    batch: int,
    length: int,
    dtype,
    device: jax.Device,
    *,
    vram_budget: int | None = None,
    depth: int | None = None,
    attention_chunk: int | None = None,
    mesh: Mesh | None = None,
) -> RingPlan:
    """The ring of each device for a prompt batch: `depth` if given, else a whole layer of blocks (its share of
    them when a layer's blocks are spread over the devices of a prefill `mesh`), fewer when the VRAM budget (bytes
    for ring and activations; default: the device's free memory, unbounded on a CPU) cannot hold them next to this
    prompt's activations. `device` is the one with the least memory to spare. Over a mesh the attention core runs
    with its heads split over the devices (prefill_cores.HeadsSplit). Raises ValueError when not even one block
    fits."""
    shards = 1 if mesh is None else mesh.size
    blocks = [b for layer in experts for b in layer.blocks]
    block_bytes = max(b.nbytes for b in blocks)
    attention = _attention(cfg, batch, length, dtype, device, attention_chunk)
    experts_per_block = max(b.size for b in blocks)
    activations = activation_bytes(cfg, batch, length, dtype, attention, experts_per_block)
    if depth is not None and depth < 1:
        raise ValueError(f"the ring needs a depth of at least 1 block, got {depth}")
    if vram_budget is None:
        vram_budget = free_device_memory(device)
    if depth is None:
        depth = len(experts[0].blocks) // shards
        if vram_budget is not None:
            depth = max(1, min(depth, (vram_budget - activations) // block_bytes))
    if vram_budget is not None and activations + depth * block_bytes > vram_budget:
        gib = 2.0**-30
        raise ValueError(
            f"stream-loaded prefill of {batch} x {length} tokens needs about {activations * gib:.2f} GiB for "
            f"activations plus {depth} expert block(s) of {block_bytes * gib:.2f} GiB; the VRAM budget is "
            f"{vram_budget * gib:.2f} GiB. Use the hybrid prefill, a shorter prompt, or smaller expert blocks"
        )
    if shards > 1:
        attention = HeadsSplit(attention, mesh, PREFILL_AXIS, family_of(cfg).model.CORE_HEAD_AXES)
    return RingPlan(depth, block_bytes, activations, attention, block_slots(cfg, batch * length, experts_per_block))


def _attention(cfg, batch, length, dtype, device, chunk):
    """The family's fused core on a GPU where it has one for `dtype`, else (or when `chunk` is given) its chunked
    core."""
    model = family_of(cfg).model
    if chunk is None and device.platform == "gpu" and (fused := model.fused_attention(cfg, dtype)) is not None:
        return fused
    if chunk is None:  # the largest power of two whose scores fit the scratch
        per_query = 3 * batch * cfg.num_attention_heads * length * 4
        chunk = 1 << max(0, (ATTENTION_SCRATCH // per_query).bit_length() - 1)
    return model.ChunkedAttention(min(chunk, length))


def decode_scores_bytes(cfg: ModelConfig, batch: int, cache_len: int) -> int:
    """Device memory of a decode attention's float32 scores, `batch` tokens over the most positions a layer of a
    `cache_len` cache attends (a sliding-window layer's, its window) each (about three live copies): what a streamed
    decode step needs besides the ring, and what bounds a micro-batch."""
    widest = max(attended(cfg, i, cache_len) for i in range(cfg.num_hidden_layers))
    return 3 * 4 * batch * cfg.num_attention_heads * widest


def free_device_memory(device: jax.Device) -> int | None:
    """Bytes a program may still allocate on `device` (90% of what is free), None where it does not say (a CPU)."""
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return int(0.9 * (stats["bytes_limit"] - stats["bytes_in_use"]))  # headroom for fragmentation


# ------------------------------------------------------------------------------------- executables


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where a streamed layer's arrays live on the prefill mesh. Over several devices the residual stream and all
    that is computed per token (norms, projections, router, shared experts, dense MLPs) are split by token, each
    device taking an equal share (sequence parallelism: replicated, that work was a third of a long prompt's layer
    on every device); the attention core splits by heads (HeadsSplit); the cache, the routing and the tokens the
    expert blocks read are whole on every device. `split`: the residual [b, t, d]'s spec, P() where the tokens do
    not split evenly (one device, or neither the batch nor a single prompt's length divides), so that flattened to
    [b * t, d] each device's share stays contiguous."""

    mesh: Mesh
    split: P

    @classmethod
    def of(cls, mesh: Mesh, batch: int, length: int) -> "_Layout":
        n = mesh.size
        if n > 1 and batch % n == 0:
            return cls(mesh, P(PREFILL_AXIS))
        if n > 1 and batch == 1 and length % n == 0:
            return cls(mesh, P(None, PREFILL_AXIS))
        return cls(mesh, P())

    @property
    def splits(self) -> bool:
        return self.split != P()

    def residual(self, x: jax.Array) -> jax.Array:
        """x [b, t, d] split by token."""
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, self.split))

    def per_token(self, a: jax.Array) -> jax.Array:
        """a [b * t, ...] split by token as the residual is."""
        return jax.lax.with_sharding_constraint(a, NamedSharding(self.mesh, P(PREFILL_AXIS) if self.splits else P()))

    def whole(self, tree):
        return jax.lax.with_sharding_constraint(tree, NamedSharding(self.mesh, P()))


@dataclasses.dataclass(frozen=True)
class _PromptAttention:
    """A layer's attention over whole prompts from position 0 with the plan's core (stream_prefill)."""

    core: Callable

    def __call__(self, cfg, layer, x, cache, positions):
        return family_of(cfg).model.prefill_attention_layer(cfg, layer, x, cache, self.core)


@dataclasses.dataclass(frozen=True)
class _DecodeAttention:
    """A layer's attention of new tokens at their positions against the cache (stream_decode_step)."""

    def __call__(self, cfg, layer, x, cache, positions):
        return family_of(cfg).model.decode_attention_layer(cfg, layer, x, positions, cache)


@partial(jax.jit, static_argnums=0)
def _embed(layout: _Layout, embed, tokens):
    return layout.residual(embed[tokens])


@partial(jax.jit, static_argnums=(0, 1, 2), donate_argnames="cache")
def _dense_layer(cfg, attend, layout: _Layout, layer, x, cache, positions):
    x, cache = attend(cfg, layer, x, cache, positions)
    x = layout.residual(x)
    return layout.residual(x + mlp(layer.mlp, rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps))), layout.whole(cache)


@partial(jax.jit, static_argnums=(0, 1, 2), donate_argnames="cache")
def _moe_front(cfg, attend, layout: _Layout, layer, x, cache, positions, live):
    """Attention, then the router and shared experts: (x, tokens [N, d], ids, weights, shared, counts, cache). The
    tokens not `live` ([N] bool, None: all) route to no expert (an id past the last: grouping drops it). The
    tokens and their routing come out whole on every device (each device's expert blocks take any token), x and
    the shared experts' output split by token as the layout says."""
    x, cache = attend(cfg, layer, x, cache, positions)
    x = layout.residual(x)
    moe = layer.mlp
    tokens = layout.per_token(rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps).reshape(-1, x.shape[-1]))
    ids, weights = route(cfg, moe.router, moe.correction_bias, tokens, moe.router_bias)
    if live is not None:
        ids = jnp.where(live[:, None], ids, cfg.n_routed_experts)
    shared = layout.per_token(mlp(moe.shared, tokens)) if moe.shared is not None else None
    counts = jnp.zeros(cfg.n_routed_experts, jnp.int32).at[ids.reshape(-1)].add(1, mode="drop")
    return x, *layout.whole((tokens, ids, weights)), shared, *layout.whole((counts, cache))


def _dispatch(plans, firsts, mesh, tokens, ids, weights, counts):
    """The routed pairs grouped by expert for each step, per device of the step as its block's _BlockPasses plan
    says, stacked [devices, ...]: (rows, slot weights) of the first pass over all the block's experts, and for the
    later passes (None without) the busy experts' indices in the block and their rows and slot weights [passes,
    busy, capacity]; then each device's zero sum of its routed experts [devices, tokens, d]. Every device groups
    the pairs of every device's blocks (SmallEP's redundant local sorting: cheaper than sending tokens). All
    before the layer's first block, so that no block's executable needs an argument from the host: a
    host-to-device copy would queue behind the block copies on the transfer stream and hold the GPU up.

    One program per step shape, the blocks' first experts an argument (`firsts`: each step's, on the mesh): one
    program over a layer's plans, or with the blocks' positions static, was compiled again for nearly every new
    prompt (seconds a layer), as its routing moves the busiest expert of some step to another capacity."""
    grouped = [_group_step(tuple(dataclasses.replace(p, first=0) for p in step), ids, weights, counts,
                           firsts[tuple(p.first for p in step)]) for step in plans]  # fmt: skip
    return grouped, _zero_sums(mesh, tokens.shape)


@partial(jax.jit, static_argnums=0)
def _group_step(shapes, ids, weights, counts, firsts):
    per_device = [_group_block(shape, first, ids, weights, counts) for shape, first in zip(shapes, firsts, strict=True)]
    return jax.tree.map(lambda *a: jnp.stack(a), *per_device)


@partial(jax.jit, static_argnums=(0, 1))
def _zero_sums(mesh, shape):
    sums = jnp.zeros((mesh.size, *shape), jnp.float32)
    return jax.lax.with_sharding_constraint(sums, NamedSharding(mesh, P(PREFILL_AXIS)))


def _group_block(plan, first, ids, weights, counts):
    empty = ids.shape[0]
    first_pass = group_by_expert(ids, weights, plan.size, plan.capacity, first)
    later = None
    if plan.later:
        left = jax.lax.dynamic_slice(counts, (first,), (plan.size,)) > plan.capacity
        busy = jnp.nonzero(left, size=plan.busy, fill_value=0)[0]
        real = (jnp.arange(plan.busy) < left.sum())[:, None]  # the padding repeats expert 0: keep it empty
        skips = [plan.capacity + p * plan.later_capacity for p in range(plan.later)]
        grouped = [group_by_expert(ids, weights, plan.size, plan.later_capacity, first, skip) for skip in skips]
        rows = jnp.stack([jnp.where(real, r[busy], empty) for r, _ in grouped])
        slot_weights = jnp.stack([jnp.where(real, w[busy], 0) for _, w in grouped])
        later = (busy, rows, slot_weights)
    return first_pass, later


def _step_firsts(steps: dict, replicated: NamedSharding) -> dict[tuple[int, ...], jax.Array]:
    """Each distinct step's first experts (one per device) as an int32 array on the prefill mesh, copied before any
    expert block is: `steps` {layer: [Step]}; the layers of a model mostly share their steps, so a handful of tiny
    copies."""
    starts = sorted({tuple(b.start for b in step) for layer in steps.values() for step in layer})
    return dict(zip(starts, jax.device_put([np.array(s, np.int32) for s in starts], replicated), strict=True))


@partial(jax.jit, static_argnums=(0, 1, 2), donate_argnames="out")
def _expert_step(mesh, storage: ExpertStorage, dtype, tokens, grouped, out, weights, scales, biases):
    """One step of blocks, one per device of the mesh (their arrays stacked along the mesh axis), each on its
    device's tokens as `grouped` ([devices, ...]) says, added into that device's sum in out [devices, tokens, d].
    Also returned: one element of each device's sum, which is ready when the step has run on every device (`out`
    goes on, donated, to the next step; the ring waits for this before it frees the step's blocks)."""

    def on_each_device(tokens, grouped, out, weights, scales, biases):
        first_pass, later = jax.tree.map(lambda a: a[jax.lax.axis_index(PREFILL_AXIS)], grouped)
        out = _expert_block(storage, dtype, tokens, first_pass, later, out[0], weights, scales, biases)[None]
        return out, out[:, :1, :1]

    mine = P(PREFILL_AXIS)
    return jax.shard_map(on_each_device, mesh=mesh, in_specs=(P(), P(), mine, mine, mine, mine),
                         out_specs=(mine, mine))(tokens, grouped, out, weights, scales, biases)


def _expert_block(storage: ExpertStorage, dtype, tokens, first_pass, later, out, weights, scales, biases):
    """One block's experts (as stored: weights, scales, biases) on their tokens, added into out: dequantized once,
    then one pass at a time, so only one pass's gathered tokens and hidden states are live; later passes multiply
    the busy experts only."""
    experts = storage.experts(weights, scales, biases, dtype)
    out = experts_grouped(experts, tokens, *first_pass, out)
    if later is None:
        return out
    busy, rows, slot_weights = later
    busy_experts = jax.tree.map(lambda a: a[busy], experts)  # biases too; the activation is static

    def one_pass(out, slots):
        return experts_grouped(busy_experts, tokens, *slots, out), None

    return jax.lax.scan(one_pass, out, (rows, slot_weights))[0]


@dataclasses.dataclass(frozen=True)
class CpuShare:
    """The experts [first, end) of a MoE layer that a streamed step leaves to the CPU kernels of its bank layer
    (co-execution): the last blocks of the layer, which are then not streamed."""

    bank_layer: int
    first: int
    end: int


@partial(jax.jit, static_argnums=0)
def _submit_cpu_share(share: CpuShare, tokens, ids, weights):
    """The routed pairs of the share's experts handed to the CPU kernels of its bank layer (the other pairs'
    weights set to zero, which the kernels skip, and their ids made valid: a token that routes nowhere has an id
    past the last expert): the pending result, which the layer's combine waits for while the GPU streams and runs
    the other experts meanwhile (co-execution, CoX-MoE)."""
    mine = (ids >= share.first) & (ids < share.end)
    pending, _ = submit_routed_experts(tokens, jnp.where(mine, ids, share.first), jnp.where(mine, weights, 0.0),
                                       layer=share.bank_layer, slot=CPU_SHARE_SLOT)
    return pending


@partial(jax.jit, static_argnums=(0, 1))
def _moe_combine(layout: _Layout, top_k, x, routed, shared, cpu_pending):
    """x plus the shared experts plus the routed ones: each device's sum [devices, tokens, d] added over the mesh
    (SmallEP's exchange of partially reduced tensors: a reduce-scatter where the layout splits the tokens, each
    device taking the sums of its own; else an all-reduce), and the CPU's share where one was submitted
    (`cpu_pending`, its pairs' `top_k`; None: none), waited for only now."""
    if layout.splits:
        add, out_spec = partial(jax.lax.psum_scatter, scatter_dimension=0, tiled=True), P(PREFILL_AXIS)
    else:
        add, out_spec = jax.lax.psum, P()
    routed = jax.shard_map(lambda r: add(r[0], PREFILL_AXIS), mesh=layout.mesh, in_specs=P(PREFILL_AXIS),
                           out_specs=out_spec)(routed)  # fmt: skip
    if cpu_pending is not None:
        cpu, routed = wait_routed_experts(cpu_pending, routed, top_k=top_k, slot=CPU_SHARE_SLOT)
        routed = routed + cpu.astype(routed.dtype)
    out = routed.astype(x.dtype)
    if shared is not None:
        out = out + shared
    return layout.residual(x + out.reshape(x.shape))


@partial(jax.jit, static_argnums=(0, 1))
def _last_logits(cfg, layout: _Layout, norm, lm_head, x, last):
    x = x[jnp.arange(x.shape[0]), last]
    return layout.whole(linear(rms_norm(x, norm, cfg.rms_norm_eps), lm_head).astype(jnp.float32))


def _capacity_step(count: int, coarse: bool) -> int:
    """The granularity of _capacity values around `count`: an eighth of its power of two, or (coarse) the power
    of two itself."""
    return 1 << max(0, count.bit_length() - (1 if coarse else 4))


def _capacity(max_count: int, coarse: bool = False) -> int:
    """Slots per expert of a block for the largest token count among its experts: rounded up to an eighth of
    its power of two, so padding stays under 12.5% where the GEMMs weigh (long prompts); `coarse` rounds up to a
    power of two, for layers with few pairs per expert (COARSE_MEAN_PAIRS)."""
    step = _capacity_step(max_count, coarse)
    return max(1, -(-max_count // step) * step)


def _passes(max_count: int, experts: int, slots: int, coarse: bool = False) -> tuple[int, int]:
    """(capacity per expert, passes) of `experts` experts whose busiest one has max_count tokens, with at most
    `slots` slots a pass: the fewest passes whose _capacity fits, so splitting pads no more than one pass
    would."""
    passes = max(1, -(-max_count // (slots // experts)))  # none fewer can fit; rounding up may need more
    while experts * (capacity := _capacity(-(-max_count // passes), coarse)) > slots and capacity > 1:
        passes += 1
    return capacity, passes


@dataclasses.dataclass(frozen=True)
class _BlockPasses:
    """How one expert block covers its routed pairs within the slots the plan allows a pass (RingPlan.block_slots):
    a first pass over all its experts, `capacity` slots each; then, for experts with more pairs (skewed routing),
    `later` passes over just those `busy` experts (their number rounded up by _capacity, so few shapes),
    `later_capacity` slots each."""

    first: int  # the block's first expert
    size: int
    capacity: int
    busy: int = 0
    later_capacity: int = 0
    later: int = 0

    @property
    def pass_slots(self) -> list[int]:
        return [self.size * self.capacity] + [self.busy * self.later_capacity] * self.later


def _block_passes(counts: np.ndarray, first: int, slots: int, coarse: bool = False) -> _BlockPasses:
    """The passes of the block whose experts have `counts` routed pairs: one when its busiest expert fits,
    else a first pass at the largest _capacity value that fits and later passes for the experts left busy."""
    size = len(counts)
    capacity = _capacity(int(counts.max()), coarse)
    if size * capacity <= slots:
        return _BlockPasses(first, size, capacity)
    fits = slots // size
    step = _capacity_step(fits, coarse)
    capacity = fits // step * step  # the largest _capacity value <= fits
    left = counts - capacity
    busy = min(size, _capacity(int((left > 0).sum()), coarse))
    return _BlockPasses(first, size, capacity, busy, *_passes(int(left.max()), busy, slots, coarse))


# ---------------------------------------------------------------------------------------- the ring


Step = tuple[ExpertBlock, ...]  # one expert block per device of the prefill mesh, in the mesh's order


class PrefillAbandoned(Exception):
    """A stream-loaded prefill stopped between two of its executables because its `abandon` said so."""


class _Ring:
    """Steps of expert blocks copied to the devices in the order the layers read them, each block to its own device
    of the mesh, at most `depth` steps resident: the ring of each device holds at most `depth` blocks."""

    def __init__(self, steps: list[Step], depth: int, mesh: Mesh, while_copying: Callable[[], bool] | None,
                 abandon: Callable[[], bool] | None = None, staging: dict | None = None):
        self.mesh, self._devices = mesh, list(mesh.devices.flat)
        self._abandon = abandon
        self._staging = staging or {}  # home device -> its device memory, for blocks copied on through it
        self._stacked = NamedSharding(mesh, P(PREFILL_AXIS))
        # On one device a block is copied straight onto the mesh: joining single-device copies costs Python time
        # a copy, which a streamed decode step of small blocks (Qwen3's 72 MiB) spends on the host's critical path.
        self._shardings = [self._stacked] if mesh.size == 1 else [SingleDeviceSharding(d, memory_kind="device")
                                                                  for d in self._devices]  # fmt: skip
        self._while_copying = while_copying
        self._waiting = collections.deque(steps)  # not copied yet
        self._copied: collections.deque = collections.deque()  # (step, device arrays), copies maybe in flight
        self._free = depth
        self._releasing: collections.deque = collections.deque()  # (phase, arrays, done): see release
        self._resident: list[tuple[tuple[jax.Array, ...], int]] = []  # (a step's device arrays, their bytes)
        self.peak_bytes = 0  # the most bytes of device buffers one device's ring ever held (its undeleted steps')
        self.peak_in_use = None  # a device's bytes in use right after each step's allocation, at most
        self.streamed_bytes = 0  # over all devices
        self.staged_bytes = 0  # of those, copied over a link of a device outside the mesh (_staging)
        self.phase_seconds: collections.Counter = collections.Counter()  # wall time per phase since last cleared
        self.copy_issue_seconds = 0.0  # host time spent issuing copies (load), outside every phase

    def load(self) -> None:
        """Issues the copies of the next steps into every free slot: each device's block from the pinned host copy
        to that device (an asynchronous DMA over its own link when the block was pinned through it), the copies
        then joined into arrays along the mesh axis without moving (on a one-device mesh, copied straight onto it)."""
        start = time.perf_counter()
        while self._free and self._waiting:
            step = self._waiting.popleft()
            copies = [self._copy(block, s) for block, s in zip(step, self._shardings, strict=True)]
            arrays = copies[0] if len(copies) == 1 else tuple(
                jax.make_array_from_single_device_arrays((len(parts) * parts[0].shape[0], *parts[0].shape[1:]),
                                                         self._stacked, list(parts))
                for parts in zip(*copies, strict=True)
            )  # fmt: skip
            self._free -= 1
            self._copied.append((step, arrays))
            self._measure(arrays, sum(block.nbytes for block in step))
        self.copy_issue_seconds += time.perf_counter() - start

    def _copy(self, block: ExpertBlock, target: jax.sharding.Sharding) -> tuple[jax.Array, ...]:
        """The block's copy on the target's device: from its pinned memory, or through its home device's memory
        where that stages it (the staged copy is freed once the copy on from it has run)."""
        arrays = block.arrays
        if (staging := self._staging.get(block.home)) is not None:
            arrays = copied(arrays, staging)
            self.staged_bytes += block.nbytes
        return tuple(copied(arrays, target))

    def take(self, step: Step) -> tuple[jax.Array, ...]:
        """The device copies of `step`, the next one in order, along the mesh axis (the copies may still be in
        flight, unless while_copying is given: it runs until they land or it has nothing to do). Where its copy
        waits for a slot, the released steps are waited for and unloaded first; so they are before while_copying
        runs, whose work (a server's decode steps) then finds the device idle rather than behind queued steps."""
        if not self._copied:
            self._settle(0)
        self.load()
        copied, arrays = self._copied.popleft()
        assert copied is step, "steps taken out of the order they are copied in"
        if self._while_copying is not None and not all(a.is_ready() for a in arrays):
            self._settle(0)
            while not all(a.is_ready() for a in arrays) and self._while_copying():
                pass
        return arrays

    def unload(self, arrays: tuple[jax.Array, ...]) -> None:
        """Frees the slot of a step whose executables have all finished."""
        for a in arrays:
            a.delete()
        self._free += 1

    def release(self, phase: str, arrays: tuple[jax.Array, ...], done: jax.Array) -> None:
        """Frees the slot of a step dispatched with run(wait=False) once `done` (an output of its last executable) is
        ready: waits now for the steps released before it, all but the last queued_expert_steps() (this one
        among them), frees their slots and issues the copies they make room for; the rest at a later take or run.
        So the device has the last steps queued while the host waits, and a slot's next copy is issued when its
        step has run, as when every step is waited for. The waits are added to phase_seconds[phase]."""
        self._releasing.append((phase, arrays, done))
        self._settle(queued_expert_steps())
        self.load()

    def _settle(self, keep: int) -> None:
        while len(self._releasing) > keep:
            phase, arrays, done = self._releasing.popleft()
            start = time.perf_counter()
            jax.block_until_ready(done)
            self.phase_seconds[phase] += time.perf_counter() - start
            self.unload(arrays)

    def run(self, phase: str, executable, *args, wait: bool = True):
        """Dispatches one executable after issuing every copy there is room for, and waits for it: the next
        copies then find the compute queue empty and start at once. Its wall time, waits for its blocks'
        copies included, is added to phase_seconds[phase]. Raises PrefillAbandoned first where `abandon` says.
        Without `wait`, only the dispatch is timed; its step is then release()d. A waited run first waits for
        the released steps, so that their time is theirs."""
        if self._abandon is not None and self._abandon():
            raise PrefillAbandoned(f"abandoned before {phase}")
        if wait:
            self._settle(0)
        self.load()
        start = time.perf_counter()
        out = executable(*args)
        if wait:
            out = jax.block_until_ready(out)
        self.phase_seconds[phase] += time.perf_counter() - start
        return out

    def _measure(self, arrays, nbytes: int):
        # The live steps' bytes from their blocks' (cached) sizes: an array's nbytes costs Python time, and this
        # runs at every copy. A step counts until its arrays are deleted (unload deletes them all).
        self._resident = [r for r in self._resident if not r[0][0].is_deleted()] + [(arrays, nbytes)]
        live = sum(n for _, n in self._resident)
        self.peak_bytes = max(self.peak_bytes, live // len(self._devices))
        self.streamed_bytes += nbytes
        for device in self._devices:
            if (stats := device.memory_stats()) is not None:  # None on XLA:CPU
                self.peak_in_use = max(self.peak_in_use or 0, stats["bytes_in_use"])


@dataclasses.dataclass
class StreamStats:
    """What one stream-loaded prefill did: its plan, the bytes it streamed, the ring's measured peak, the most
    device memory in use when a block had just been allocated (None where the device does not say), and when
    each layer's output was ready, in seconds from the start, and where each layer's time went: the wall time of
    its executables by phase ("attention+mlp" for a dense layer; "attention+router+shared", "dispatch",
    "experts" (waits for the blocks' copies included) and "combine" for a MoE layer). Each block's capacity
    covers its busiest expert: routed_pairs / expert_slots says how full the expert GEMMs were; a block whose
    busiest expert needs more slots than the plan allows a pass (plan.block_slots) takes several passes."""

    plan: RingPlan | None = None
    streamed_bytes: int = 0
    staged_bytes: int = 0  # of those, copied through a device outside the mesh (_staging)
    peak_ring_bytes: int = 0
    peak_device_bytes: int | None = None
    layer_done_s: list[float] = dataclasses.field(default_factory=list)
    layer_phase_s: list[dict[str, float]] = dataclasses.field(default_factory=list)
    # Host time issuing the blocks' copies, in no phase: with small blocks (Qwen3-30B-A3B's 72 MiB) it is a large part
    # of a streamed step (bench/RESULTS.md, offline, session 34).
    copy_issue_s: float = 0.0
    routed_pairs: int = 0  # token-expert pairs over all MoE layers (padding tokens included)
    expert_slots: int = 0  # the slots the expert GEMMs ran over them: pairs / slots is their occupancy
    block_passes: int = 0  # passes over expert blocks, over all MoE layers (one per block without skew)
    largest_pass_slots: int = 0  # the slots of the largest pass: at most plan.block_slots


# ------------------------------------------------------------------------------------------ prefill


def stream_prefill(
    model,
    tokens,
    lengths,
    cache: list,
    *,
    vram_budget: int | None = None,
    depth: int | None = None,
    attention_chunk: int | None = None,
    stats: StreamStats | None = None,
    while_copying: Callable[[], bool] | None = None,
    abandon: Callable[[], bool] | None = None,
    devices: tuple[jax.Device, ...] | None = None,
):
    """Prefill of right-padded prompts tokens [b, t] with their lengths [b], with the routed experts streamed
    to the device: (float32 logits [b, vocab] of each prompt's last token, the filled cache).

    `while_copying`, when given, is called again and again while the next expert block's copy is in flight,
    until the copy lands or it returns False (nothing to do): the serving scheduler runs decode steps of other
    requests there, on the GPU time a streamed layer leaves idle. They run before the block's GEMMs are queued,
    so they never wait behind work that waits for a copy. `abandon`, when given, is asked before each executable:
    True stops the prefill there with PrefillAbandoned (its request was cancelled, or the server is stopping).

    The contract of the engine's prefill: `cache` (init_cache of at least t positions) is donated and comes
    back in the layout decode_step reads, on the placement's device. The model must have been loaded with
    Placement(pinned_experts=True). `vram_budget`, `depth` and `attention_chunk` override plan_ring's choices (the
    budget and depth are each device's); `stats` receives the plan and the measured figures.

    With several Placement.prefill_devices (distributed stream-loaded prefill, OSDI '26 §3.2), each device streams
    its share of every layer's experts over its own link and runs them on every token routed to them; the rest of
    the layer runs split over the devices, the attention by heads and everything per token (norms, projections,
    router, shared experts) by token (_Layout), and the routed experts' partial sums are added across the devices
    once per layer, each device keeping its tokens' (SmallEP's exchange, as a reduce-scatter over the mesh). The
    non-expert weights are copied to the other devices at the first such prefill and kept (Model.prefill_weights).
    `devices` overrides Placement.stream_devices: prefill-decode disaggregation streams on the devices that do not
    decode while the placement's device decodes (OSDI '26 §3.3.2); the results then come back to that device.
    """
    devices = devices or model.placement.stream_devices
    tokens = np.asarray(tokens, np.int32)
    return _stream_layers(model, devices, tokens, None, None, np.asarray(lengths, np.int32) - 1, cache,
                          vram_budget, depth, attention_chunk, stats, while_copying, abandon)  # fmt: skip


def stream_decode_step(model, tokens, positions, live, cache, *, vram_budget: int | None = None,
                       stats: StreamStats | None = None, cpu_blocks: int = 0):  # fmt: skip
    """One decode step of tokens [b] at positions [b] with the routed experts streamed to the placement's device,
    as stream_prefill streams them: (float32 logits [b, vocab], the updated cache, donated). The offline batch's
    large-batch decode (MoE-Gen, MoE-Lightning): once a step's tokens reach every expert, bringing the experts to
    the GPU costs their bytes over PCIe, while the CPU's rate at a few tens of tokens per expert is far below its
    prefill rate. `live` [b] (bool): the tokens of free slots route to no expert.

    With `cpu_blocks`, the last that many expert blocks of each MoE layer are not streamed: the CPU kernels compute
    their pairs while the GPU streams and computes the others (CoX-MoE's co-execution), handed off after the layer's
    router and taken back in its combine: the step then takes about the larger of the two shares' times.

    `cache` may instead be a HostKVCache (the KV cache in pinned host memory): each layer's cache is then copied to
    the device for its attention and the step's entries written back to host memory, or, with its attention_on_cpu,
    attended over on the CPU where it is; it is returned as is."""
    tokens = np.asarray(tokens, np.int32)[:, None]
    positions = np.asarray(positions, np.int32)[:, None]
    live = np.asarray(live, bool)
    # The ring's plan counts a prompt's activations, not the decode attention's scores over the whole cache.
    if vram_budget is None and (free := free_device_memory(model.placement.device)) is not None:
        vram_budget = free
        # Attention on the device: its scores, and a host cache's layers copied in. On the CPU, neither is there.
        if not (isinstance(cache, HostKVCache) and cache.attention_on_cpu):
            layers = cache.layers if isinstance(cache, HostKVCache) else cache
            cache_len = max(a.shape[1] for a in jax.tree.leaves(layers))
            vram_budget -= decode_scores_bytes(model.config, len(tokens), cache_len)
            if isinstance(cache, HostKVCache):
                vram_budget -= DEVICE_LAYERS * max(sum(a.nbytes for a in jax.tree.leaves(layer)) for layer in layers)
    return _stream_layers(model, (model.placement.device,), tokens, positions, live, np.zeros(len(tokens), np.int32),
                          cache, vram_budget, None, None, stats, None, None, cpu_blocks)  # fmt: skip


def _stream_layers(model, devices, tokens, positions, live, last, cache, vram_budget, depth, attention_chunk, stats,
                   while_copying, abandon, cpu_blocks=0):  # fmt: skip
    """The layer loop of stream_prefill (positions None: whole prompts from position 0) and stream_decode_step (new
    tokens [b, t] at `positions` against the cache): the logits of each row's token `last` [b], and the cache. The
    last `cpu_blocks` blocks of each MoE layer run on the CPU (one device only)."""
    cfg, dtype = model.config, model.dtype
    mesh = prefill_mesh(devices)
    weights = model.prefill_weights(devices)
    pinned = pinned_layers(weights)
    steps = {i: _steps(i, layer, mesh.size) for i, layer in pinned.items()}
    shares = _cpu_shares(weights, steps, cpu_blocks, mesh.size)
    steps = {i: layer_steps[: len(layer_steps) - cpu_blocks] for i, layer_steps in steps.items()}
    replicated = NamedSharding(mesh, P())
    host = cache if isinstance(cache, HostKVCache) else None
    if host is not None and (positions is None or mesh.size > 1):
        raise ValueError("a cache in host memory is read by decode steps on one device, not by prefill")
    host_positions = None if positions is None else positions[:, 0]
    tokens, last = jax.device_put((tokens, last), replicated)
    if positions is not None:
        positions, live = jax.device_put((positions, np.broadcast_to(live[:, None], tokens.shape).reshape(-1)),
                                         replicated)  # fmt: skip
    cache = [None] * len(host) if host is not None else jax.device_put(list(cache), replicated)
    firsts = _step_firsts(steps, replicated)
    plan = plan_ring(
        cfg, list(pinned.values()), *tokens.shape, dtype, _least_free(mesh.devices.flat),
        vram_budget=vram_budget, depth=depth, attention_chunk=attention_chunk, mesh=mesh,
    )
    attend = _PromptAttention(plan.attention) if positions is None else _DecodeAttention()
    stats = stats if stats is not None else StreamStats()
    stats.plan = plan
    start = time.perf_counter()
    staging = _staging(mesh, pinned.values(), plan.depth)
    if staging:  # the blocks of each home in turn, so that the links copy at once whatever the ring's depth
        steps = {i: _alternating_homes(layer_steps) for i, layer_steps in steps.items()}
    ring = _Ring([step for layer in steps.values() for step in layer], plan.depth, mesh, while_copying, abandon,
                 staging)
    layout = _Layout.of(mesh, *tokens.shape)
    x = ring.run("embed", _embed, layout, weights.embed, tokens)
    for i, layer in enumerate(weights.layers):
        ring.phase_seconds.clear()
        if host is not None:
            cache[i] = host.attending(i) if host.attention_on_cpu else host.take(i, replicated)
        if i in pinned:
            x, cache[i], slots = _moe_layer(cfg, plan, attend, layout, layer, pinned[i].storage, steps[i],
                                            shares.get(i), firsts, x, cache[i], positions, live, ring,
                                            dtype)  # fmt: skip
            stats.expert_slots += sum(map(sum, slots))
            stats.block_passes += sum(map(len, slots))
            stats.largest_pass_slots = max(stats.largest_pass_slots, *map(max, slots))
            stats.routed_pairs += tokens.size * cfg.num_experts_per_tok
        else:
            x, cache[i] = ring.run("attention+mlp", _dense_layer, cfg, attend, layout, layer, x, cache[i], positions)
        if host is not None and not host.attention_on_cpu:
            host.write_back(i, cache[i], host_positions)
        stats.layer_done_s.append(time.perf_counter() - start)
        stats.layer_phase_s.append(dict(ring.phase_seconds))
    logits = _last_logits(cfg, layout, weights.norm, weights.lm_head, x, last)
    stats.streamed_bytes, stats.staged_bytes, stats.peak_ring_bytes, stats.peak_device_bytes = (
        ring.streamed_bytes, ring.staged_bytes, ring.peak_bytes, ring.peak_in_use
    )
    stats.copy_issue_s = ring.copy_issue_seconds
    if host is not None:
        return _on(model.placement.device, logits), host
    return jax.tree.map(partial(_on, model.placement.device), (logits, cache))


def _on(device: jax.Device, array: jax.Array) -> jax.Array:
    """`device`'s copy of an array replicated over the prefill mesh (no copy made where the mesh has `device`; else
    the first device's copy, copied there)."""
    assert array.sharding.is_fully_replicated, array.sharding
    shards = {shard.device: shard.data for shard in array.addressable_shards}
    return shards[device] if device in shards else jax.device_put(array.addressable_shards[0].data, device)


def _staging(mesh: Mesh, layers, depth: int) -> dict[jax.Device, SingleDeviceSharding]:
    """The devices outside the prefill mesh that blocks are pinned through (a disaggregated prefill's: the decoding
    device's share) and that stage them: a block is copied over its home device's own link into its memory, then on
    to the mesh's device over the interconnect, instead of over the mesh device's link beside its own share. The
    decoding device's link is otherwise idle (a decode's hand-offs are kilobytes), so the prefill streams over two
    links, which together draw more of the host's memory than one: while the CPU kernels read at their floor, one
    link got ~38 GB/s and two ~33-39 each; a 16K-token prefill apart took 0.38 s against 0.45 (DeepSeek-V3 FP8 5
    layers, 2x H200 with NVLink, session 32; bench/RESULTS.md, serving). A home stages only
    where the interconnect is faster than a link (stages_through) and it has room for `depth` blocks, as many as
    the ring has in flight."""
    inside = set(mesh.devices.flat)
    homes = {b.home for layer in layers for b in layer.blocks} - inside
    largest = max((b.nbytes for layer in layers for b in layer.blocks), default=0)
    return {home: SingleDeviceSharding(home, memory_kind="device") for home in homes
            if ((free := free_device_memory(home)) is None or free >= depth * largest)
            and all(stages_through(home, device) for device in inside)}


def _alternating_homes(steps: list[Step]) -> list[Step]:
    """A layer's steps reordered to take one of each home device's in turn, by the home of each step's first block
    (the order of a layer's steps is free: the blocks' outputs are added)."""
    by_home: dict[jax.Device, collections.deque] = collections.defaultdict(collections.deque)
    for step in steps:
        by_home[step[0].home].append(step)
    order = []
    while by_home:
        for home in list(by_home):
            order.append(by_home[home].popleft())
            if not by_home[home]:
                del by_home[home]
    return order


@cache
def stages_through(home: jax.Device, device: jax.Device) -> bool:
    """Whether copies from `home`'s memory to `device` run at twice or more a pinned host copy to `device` (measured
    once per pair: NVLink does, a PCIe switch or the host does not)."""
    return (home.platform == "gpu"
            and device_to_device_gbps(home, device) >= 2 * pinned_h2d_gbps(device, 1 << 28))


def _least_free(devices) -> jax.Device:
    return min(devices, key=lambda d: free_device_memory(d) or 0)


def _steps(i: int, experts: PinnedExperts, devices: int) -> list[Step]:
    """A layer's blocks as steps over the prefill mesh: device g takes the g-th of `devices` equal runs of blocks,
    which are the blocks pinned through it (pinned_experts.register_pinned splits them so)."""
    steps = _equal_runs(experts, devices)
    if steps is None:
        blocks = experts.blocks
        raise ValueError(
            f"layer {i}: its {len(blocks)} expert blocks of {[b.size for b in blocks]} experts do not split into "
            f"equal runs over {devices} prefill devices; load the model with this Placement's prefill_devices"
        )
    return steps


def check_cpu_blocks(model, cpu_blocks: int) -> None:
    """Raises ValueError unless a streamed decode step of `model` can leave `cpu_blocks` blocks of each MoE layer to
    the CPU (stream_decode_step's cpu_blocks: at least one block of every layer streams)."""
    pinned = pinned_layers(model.weights)
    _cpu_shares(model.weights, {i: _steps(i, layer, 1) for i, layer in pinned.items()}, cpu_blocks, 1)


def _cpu_shares(weights, steps: dict[int, list[Step]], cpu_blocks: int, devices: int) -> dict[int, CpuShare]:
    """Each MoE layer's experts that `cpu_blocks` blocks leave to the CPU: those of its last steps ({}: none)."""
    if not cpu_blocks:
        return {}
    if devices > 1:
        raise ValueError(f"cpu_blocks: co-execution streams to one device, not {devices}")
    shares = {}
    for i, layer_steps in steps.items():
        if not 0 < cpu_blocks < len(layer_steps):
            raise ValueError(f"cpu_blocks must be in [0, {len(layer_steps)}) for layer {i}'s {len(layer_steps)} "
                             f"expert blocks (at least one streams), got {cpu_blocks}")  # fmt: skip
        first, last = layer_steps[-cpu_blocks][0], layer_steps[-1][0]
        shares[i] = CpuShare(weights.layers[i].mlp.expert_layer, first.start, last.start + last.size)
    return shares


def _equal_runs(experts: PinnedExperts, devices: int) -> list[Step] | None:
    blocks, per = experts.blocks, len(experts.blocks) // devices
    if len(blocks) % devices:
        return None
    steps = list(zip(*(blocks[g * per : (g + 1) * per] for g in range(devices)), strict=True))
    return None if any(len({b.size for b in step}) > 1 for step in steps) else steps


def streaming_devices(model, devices: tuple[jax.Device, ...]) -> tuple[jax.Device, ...]:
    """The most of `devices` (in order) that every MoE layer's pinned blocks split over in equal runs: where a
    disaggregated prefill streams, `devices` being those that do not decode. Empty when the experts are not
    pinned."""
    try:
        return _fitting(pinned_layers(model.weights).values(), devices)
    except ValueError:
        return ()


def _fitting(layers, devices: tuple[jax.Device, ...]) -> tuple[jax.Device, ...]:
    fits = [n for n in range(len(devices), 0, -1) if all(_equal_runs(layer, n) for layer in layers)]
    return tuple(devices[: fits[0]]) if fits else ()


def pinned_layers(weights) -> dict[int, PinnedExperts]:
    """Each MoE layer's pinned routed experts, by layer index; a ValueError naming the first layer whose experts are
    not in pinned host memory."""
    pinned = {}
    for i, layer in enumerate(weights.layers):
        if isinstance(layer.mlp, MoE):
            experts = pinned_layer(layer.mlp.expert_layer) if layer.mlp.expert_layer is not None else None
            if experts is None:
                raise ValueError(
                    f"layer {i}: its routed experts are not in pinned host memory; stream-loaded prefill needs the "
                    "model loaded with Placement(..., pinned_experts=True)"
                )
            pinned[i] = experts
    return pinned


def _moe_layer(cfg, plan: RingPlan, attend, layout: _Layout, layer, storage: ExpertStorage, steps: list[Step],
               cpu: CpuShare | None, firsts, x, cache, positions, live, ring: _Ring, dtype):  # fmt: skip
    # The expert-bank layer id is static pytree metadata: drop it so that every MoE layer shares executables.
    layer = dataclasses.replace(layer, mlp=dataclasses.replace(layer.mlp, expert_layer=None))
    x, tokens, ids, weights, shared, counts, cache = ring.run(
        "attention+router+shared", _moe_front, cfg, attend, layout, layer, x, cache, positions, live
    )
    # The CPU's share first: its kernels run while the GPU streams and computes the rest.
    cpu_pending = None if cpu is None else ring.run("cpu share", _submit_cpu_share, cpu, tokens, ids, weights)
    # The routing decides how many slots each block's experts get (dropless), on the host: the one readback of
    # a layer. Per step, so that one busy expert pads only its own step's GEMMs; the blocks of a step share one
    # shape (one program over the mesh), planned for the busiest of their experts at each position.
    host_counts, plans = np.asarray(counts), []
    coarse = host_counts.mean() <= COARSE_MEAN_PAIRS
    for step in steps:
        busiest = np.max([host_counts[b.start : b.start + b.size] for b in step], axis=0)
        shape = _block_passes(busiest, 0, plan.block_slots, coarse)
        plans.append(tuple(dataclasses.replace(shape, first=b.start) for b in step))
    mesh = ring.mesh
    grouped, out = ring.run("dispatch", _dispatch, plans, firsts, mesh, tokens, ids, weights, counts)
    for step, step_grouped in zip(steps, grouped, strict=True):
        arrays = ring.take(step)
        out, done = ring.run(
            "experts", _expert_step, mesh, storage, jnp.dtype(dtype), tokens, step_grouped, out,
            *step[0].parts(arrays), wait=False,
        )
        ring.release("experts", arrays, done)
    slots = [p.pass_slots for step in plans for p in step]
    top_k = None if cpu is None else cfg.num_experts_per_tok
    return ring.run("combine", _moe_combine, layout, top_k, x, out, shared, cpu_pending), cache, slots
