"""Routed experts as JAX arrays and their math on the device: the Experts pytree, the activation joining gate and
up, every expert on every token (dense), the grouping of routed pairs by expert and the batched GEMMs over the
groups (stream-loaded prefill, device-resident experts), and FP8 block dequantization.

Einsum dimension names: t tokens, d hidden, e experts, k experts per token, c capacity (slots per expert), f MLP
intermediate. Weight matrices keep the checkpoint's [out, in] orientation.
"""

import jax
import jax.numpy as jnp

from hybridjit.models.common.pytree import pytree


@pytree(meta=("activation",))
class Experts:
    """Routed experts held as JAX arrays, stacked over experts, with optional biases and the activation joining
    gate and up (hybridjit.ops.routed_experts.ACTIVATIONS: ("silu",) or ("clamped_swiglu", alpha, limit))."""

    gate: jax.Array  # [e, f, d]
    up: jax.Array  # [e, f, d]
    down: jax.Array  # [e, d, f]
    gate_bias: jax.Array | None = None  # [e, f]
    up_bias: jax.Array | None = None  # [e, f]
    down_bias: jax.Array | None = None  # [e, d]
    activation: tuple = ("silu",)


def glu(activation: tuple, g: jax.Array, u: jax.Array) -> jax.Array:
    """What joins an expert's gate and up outputs: silu(g) * u, or gpt-oss's clamped SwiGLU, as the CPU kernels
    (ffi/weight_bank.h, GluActivation)."""
    if activation[0] == "silu":
        return jax.nn.silu(g) * u
    _, alpha, limit = activation
    g, u = jnp.minimum(g, limit), jnp.clip(u, -limit, limit)
    return (u + 1) * g * jax.nn.sigmoid(alpha * g)


def biased(y: jax.Array, bias: jax.Array | None, expert_axis: str) -> jax.Array:
    """y [..., e, ..., f] plus bias [e, f], broadcast along the token axis (t) of the einsum layout `expert_axis`."""
    if bias is None:
        return y
    return y + (bias[None] if expert_axis == "tef" else bias[:, None]).astype(y.dtype)


def routed_experts_dense(w: Experts, x: jax.Array, ids: jax.Array, weights: jax.Array) -> jax.Array:
    """Every expert on every token, combined by the routing weights (zero for unchosen experts).

    Differentiable and exact; its cost grows with the number of experts, so it serves small models
    (training the shipped model) rather than inference at DeepSeek-V3 scale.
    """
    combine = jnp.zeros((x.shape[0], w.gate.shape[0]), jnp.float32)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], ids].add(weights)
    g = biased(jnp.einsum("td,efd->tef", x, w.gate), w.gate_bias, "tef")
    u = biased(jnp.einsum("td,efd->tef", x, w.up), w.up_bias, "tef")
    hidden = glu(w.activation, g, u)
    if w.down_bias is None:
        return jnp.einsum("tef,edf,te->td", hidden, w.down, combine.astype(x.dtype))
    y = biased(jnp.einsum("tef,edf->ted", hidden, w.down), w.down_bias, "tef")
    return jnp.einsum("ted,te->td", y, combine.astype(x.dtype))


def dequantize_blocks(w: jax.Array, scale: jax.Array, block: tuple[int, int], dtype) -> jax.Array:
    """FP8 weights [..., out, in] with block scales [..., ceil(out/bo), ceil(in/bi)] -> dtype, on the device.

    Edge blocks may be partial: each scale is repeated over its block and cut to the weight's shape."""
    scale = jnp.repeat(jnp.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return (w.astype(jnp.float32) * scale[..., : w.shape[-2], : w.shape[-1]]).astype(dtype)


def group_by_expert(ids: jax.Array, weights: jax.Array, n_experts: int, capacity: int, first: int = 0, skip: int = 0):
    """grouped_pairs without the mask of the pairs kept: (rows, slot weights)."""
    return grouped_pairs(ids, weights, n_experts, capacity, first, skip)[:2]


def grouped_pairs(ids: jax.Array, weights: jax.Array, n_experts: int, capacity: int, first: int = 0, skip: int = 0):
    """Token-expert pairs (ids, weights [T, k] from route) of experts [first, first + n_experts) grouped by
    expert, `capacity` slots per expert; pairs of other experts are left out.

    Returns (rows [n_experts, capacity] int32: the token in each slot, T in empty slots; slot weights
    [n_experts, capacity] float32: its routing weight, 0 in empty slots; kept [T, k] bool: the pairs that have
    a slot). Each expert's pairs are taken in token
    order from its `skip`-th on (so calls with skip = 0, capacity, 2 x capacity, ... cover an expert's pairs
    in passes of bounded size); pairs beyond skip + capacity are dropped, never written into another expert's
    slots: dropless when skip = 0 and capacity >= the largest count among these experts. Calls on the same ids
    in one jit share their sort. `first` may be traced: one program then serves every block of n_experts.
    """
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    local = flat[order] - first
    ours = (local >= 0) & (local < n_experts)
    counts = jnp.zeros(n_experts, jnp.int32).at[jnp.where(ours, local, n_experts)].add(1, mode="drop")
    # A pair's rank within its expert: its place in the sorted pairs less those of lower experts (the pairs of
    # experts before `first`, then this block's experts before its own).
    below = jnp.sum(flat < first)
    rank = jnp.arange(t * k) - below - (jnp.cumsum(counts) - counts)[jnp.clip(local, 0, n_experts - 1)] - skip
    keep = ours & (rank >= 0) & (rank < capacity)
    slot = jnp.where(keep, local * capacity + rank, n_experts * capacity)
    rows = jnp.full(n_experts * capacity, t, jnp.int32).at[slot].set(order // k, mode="drop")
    slot_weights = jnp.zeros(n_experts * capacity, jnp.float32).at[slot].set(weights.reshape(-1)[order], mode="drop")
    kept = jnp.zeros(t * k, bool).at[order].set(keep).reshape(t, k)
    return rows.reshape(n_experts, capacity), slot_weights.reshape(n_experts, capacity), kept


def experts_grouped(w: Experts, x: jax.Array, rows: jax.Array, slot_weights: jax.Array, out: jax.Array):
    """out [T, d] float32 plus the experts w (e of them, stacked) on their routed tokens of x [T, d].

    rows, slot_weights [e, c]: this block's slots from group_by_expert. Tokens are gathered per expert and the
    three projections run as batched GEMMs over the experts (never ragged_dot: DESIGN.md §5)."""
    xs = jnp.take(x, rows, axis=0, mode="fill", fill_value=0)  # [e, c, d]
    g = biased(jnp.einsum("ecd,efd->ecf", xs, w.gate), w.gate_bias, "ecf")
    u = biased(jnp.einsum("ecd,efd->ecf", xs, w.up), w.up_bias, "ecf")
    y = jnp.einsum("ecf,edf->ecd", glu(w.activation, g, u), w.down, preferred_element_type=jnp.float32)
    y = biased(y, w.down_bias, "ecf")
    y = y * slot_weights[..., None]
    return out.at[rows.reshape(-1)].add(y.reshape(-1, x.shape[-1]), mode="drop")
