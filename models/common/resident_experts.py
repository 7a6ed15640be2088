"""Routed experts resident on the device: some of a MoE layer's experts held on the GPU, computed there by XLA
while the CPU computes the rest of each token's experts (issue #23).

A layer's expert bank in host memory always keeps every expert, so the device copies are an acceleration the
runtime may use or not, call by call: each token's routed pairs are split into those whose expert is resident
(computed here) and the others (handed to the CPU with the resident pairs' weights set to zero, which the CPU
kernels skip). The two halves run concurrently inside the same compiled step and are summed.

Two ways to compute the resident pairs, chosen by shape (static):
- gathered (few pairs, as in decode): each pair's expert is gathered and multiplied on its token alone, in one
  fused reduction per projection, so a step reads only the experts it uses, once;
- grouped (many pairs): the pairs are grouped per resident expert with a fixed capacity per expert, as
  batched GEMMs over every resident expert; pairs beyond an expert's capacity go to the CPU with the others,
  so the result is exact whatever the routing.

Einsum dimension names: r resident experts or routed pairs, c capacity, d hidden, f intermediate.
"""

import jax
import jax.numpy as jnp

from hybridjit.models.common.experts import Experts, dequantize_blocks, experts_grouped, glu, grouped_pairs
from hybridjit.models.common.pytree import pytree

# Grouped computation gives each resident expert room for this many times its mean share of the pairs; the
# rest of a popular expert's pairs run on the CPU.
CAPACITY_FACTOR = 4


@pytree(meta=("quant_block", "widened"))
class ResidentExperts:
    """Some of a layer's routed experts on the device: `slot_of` [e] int32 gives each expert's index in the
    stacks of `experts` (-1: not resident); `experts` holds them [r, ...] in the compute dtype, or FP8 with
    block `scales` (gate, up, down) [r, out blocks, in blocks] float32, dequantized where they are used.
    `widened`: FP8 copies held dequantized in the compute dtype (ResidentExperts.widen)."""

    slot_of: jax.Array
    experts: Experts
    scales: tuple[jax.Array, jax.Array, jax.Array] | None = None
    quant_block: tuple[int, int] | None = None
    widened: bool = False

    @property
    def count(self) -> int:
        return self.experts.gate.shape[0]

    def dequantized(self, dtype) -> Experts:
        """Every resident expert in `dtype`, FP8 ones scaled by their block scales."""
        e = self.experts
        if self.scales is None:
            weights = (e.gate.astype(dtype), e.up.astype(dtype), e.down.astype(dtype))
        else:
            pairs = zip((e.gate, e.up, e.down), self.scales, strict=True)
            weights = tuple(dequantize_blocks(w, s, self.quant_block, dtype) for w, s in pairs)
        return Experts(*weights, e.gate_bias, e.up_bias, e.down_bias, e.activation)

    def widen(self, dtype) -> "ResidentExperts":
        """These copies held in `dtype`: FP8 ones dequantized once (the grouped path then multiplies them as they
        are, where it would dequantize every copy each call, at twice FP8's device bytes); others as they are."""
        return self if self.scales is None else ResidentExperts(self.slot_of, self.dequantized(dtype), widened=True)


@pytree(meta=("gathered",))
class ResidentPairs:
    """The routed pairs a step computes on the device: per pair (gathered: slots and weights [T, k], weight 0
    where the pair runs on the CPU) or grouped per resident expert (rows and slot weights [r, capacity])."""

    index: jax.Array
    weights: jax.Array
    gathered: bool


def gathered(pairs: int, resident: int) -> bool:
    """Whether a call of `pairs` routed pairs with `resident` experts on the device takes the gathered path (each
    pair's expert on its own token) rather than the grouped one."""
    return pairs <= resident


def grouped_capacity(tokens: int, k: int, n_experts: int) -> int:
    """Slots per resident expert on the grouped path for `tokens` tokens routed to k of `n_experts` each:
    CAPACITY_FACTOR times an expert's mean share of the pairs, at most every token."""
    return min(tokens, -(-CAPACITY_FACTOR * tokens * k // n_experts))


def split_routes(res: ResidentExperts, ids: jax.Array, weights: jax.Array) -> tuple[jax.Array, ResidentPairs]:
    """Splits each token's routed pairs (ids, weights [T, k]) between the device and the CPU: (the CPU's weights
    [T, k]: the routing weights with the pairs the device computes set to zero, those pairs)."""
    t, k = ids.shape
    slots = res.slot_of[ids]
    resident = slots >= 0
    if gathered(t * k, res.count):
        here = resident
        pairs = ResidentPairs(jnp.maximum(slots, 0), jnp.where(here, weights, 0.0), gathered=True)
    else:
        capacity = grouped_capacity(t, k, res.slot_of.shape[0])
        rows, slot_weights, here = grouped_pairs(jnp.where(resident, slots, res.count), weights, res.count, capacity)
        pairs = ResidentPairs(rows, slot_weights, gathered=False)
    return jnp.where(here, 0.0, weights).astype(weights.dtype), pairs


def _plus(y: jax.Array, bias: jax.Array | None) -> jax.Array:
    """y [r, ...] plus each pair's own bias [r, ...] (the gathered experts' biases)."""
    return y if bias is None else y + bias.astype(jnp.float32)


def pair_matvec(w: jax.Array, scale: jax.Array | None, block: tuple[int, int] | None, v: jax.Array) -> jax.Array:
    """Each pair's matrix w [r, o, i] (gathered; FP8 with block `scale` [r, o/bo, i/bi], or unscaled) times its
    vector v [r, i]: float32 [r, o].

    Written as one float32 contraction over the weights as gathered so that XLA fuses the gather, the conversion
    and the block scaling into the reduction: each weight is read once from device memory and never written back
    dequantized. (A matmul takes its operands materialized: an all-resident DeepSeek-V3 FP8 layer took 0.86 ms
    at batch 1 on an H100 that way, 0.39 ms this way; bench/RESULTS.md, decode.py --resident.)"""
    r, o, i = w.shape
    v = v.astype(jnp.float32)
    if scale is not None and (o % block[0] or i % block[1]):  # partial edge blocks: dequantize first
        w, scale = dequantize_blocks(w, scale, block, jnp.float32), None
    if scale is None:
        return jnp.einsum("roi,ri->ro", w.astype(jnp.float32), v, precision=jax.lax.Precision.HIGHEST)
    (bo, bi), (no, ni) = block, scale.shape[1:]
    blocks = w.reshape(r, no, bo, ni, bi).astype(jnp.float32) * scale[:, :, None, :, None]
    y = jnp.einsum("rapcq,rcq->rap", blocks, v.reshape(r, ni, bi), precision=jax.lax.Precision.HIGHEST)
    return y.reshape(r, o)


def resident_output(res: ResidentExperts, x: jax.Array, pairs: ResidentPairs) -> jax.Array:
    """The resident experts on their pairs of x [T, d] (from split_routes): float32 [T, d]."""
    if not pairs.gathered:
        if res.scales is not None:
            # The copies' dequantization depends on nothing of the step: without the barrier XLA schedules every
            # layer's at the start, all live at once (48 layers of 1.1 GiB at Qwen3-30B-A3B's shapes: the 512-slot
            # step wanted 74 GiB). Tied to this layer's input, at most one layer's dequantized copies exist.
            x, res = jax.lax.optimization_barrier((x, res))
        return experts_grouped(res.dequantized(x.dtype), x, pairs.index, pairs.weights, jnp.zeros(x.shape, jnp.float32))
    t, k = pairs.index.shape
    flat = pairs.index.reshape(-1)

    def take(a):
        return None if a is None else jnp.take(a, flat, axis=0)

    e = res.experts
    gate_scale, up_scale, down_scale = (None,) * 3 if res.scales is None else map(take, res.scales)
    # Each pair's expert on its own token: a step reads the k experts of each token, never all the resident ones.
    xs = jnp.repeat(x, k, axis=0)  # [r = t * k, d]
    g = _plus(pair_matvec(take(e.gate), gate_scale, res.quant_block, xs), take(e.gate_bias))
    u = _plus(pair_matvec(take(e.up), up_scale, res.quant_block, xs), take(e.up_bias))
    y = pair_matvec(take(e.down), down_scale, res.quant_block, glu(e.activation, g, u))
    y = _plus(y, take(e.down_bias)) * pairs.weights.reshape(-1, 1)
    return y.reshape(t, k, -1).sum(axis=1)
