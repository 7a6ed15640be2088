"""The MoE block: routing, the routed experts (a layer of the C++ expert bank computed by the custom call
behind the hybrid hand-off, or JAX-held experts computed by XLA), the shared experts, Expert Deferral and
Skipping, and the pieces stream-loaded prefill uses to run a layer's experts block by block on the device.

Einsum dimension names: b batch, t query tokens, s key/cache positions, d hidden, h heads, e routed experts,
k experts per token, f MLP intermediate. Weight matrices keep the checkpoint's [out, in] orientation.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from hybridjit.models.common.config import ModelConfig
from hybridjit.models.common.layers import MLP, mlp
from hybridjit.models.common.pytree import pytree
from hybridjit.models.common.routing import route
from hybridjit.ops.async_experts import submit_routed_experts, wait_routed_experts


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


def _biased(y: jax.Array, bias: jax.Array | None, expert_axis: str) -> jax.Array:
    """y [..., e, ..., f] plus bias [e, f], broadcast along the token axis (t) of the einsum layout `expert_axis`."""
    if bias is None:
        return y
    return y + (bias[None] if expert_axis == "tef" else bias[:, None]).astype(y.dtype)


@pytree(meta=("expert_layer",))
class MoE:
    """Where the routed experts live is data: a layer of the C++ expert bank in host memory (computed by
    the custom call), or JAX arrays (computed by XLA, e.g. for training)."""

    router: jax.Array  # [e, d], float32 as the reference routes in float32
    correction_bias: jax.Array | None  # [e], selection only (noaux_tc)
    shared: MLP | None
    experts: Experts | None = None
    expert_layer: int | None = None  # id of this layer's routed experts in the C++ expert bank
    router_bias: jax.Array | None = None  # [e], added to the router's logits (gpt-oss)


def routed_experts_dense(w: Experts, x: jax.Array, ids: jax.Array, weights: jax.Array) -> jax.Array:
    """Every expert on every token, combined by the routing weights (zero for unchosen experts).

    Differentiable and exact; its cost grows with the number of experts, so it serves small models
    (training the shipped model) rather than inference at DeepSeek-V3 scale.
    """
    combine = jnp.zeros((x.shape[0], w.gate.shape[0]), jnp.float32)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], ids].add(weights)
    g = _biased(jnp.einsum("td,efd->tef", x, w.gate), w.gate_bias, "tef")
    u = _biased(jnp.einsum("td,efd->tef", x, w.up), w.up_bias, "tef")
    hidden = glu(w.activation, g, u)
    if w.down_bias is None:
        return jnp.einsum("tef,edf,te->td", hidden, w.down, combine.astype(x.dtype))
    y = _biased(jnp.einsum("tef,edf->ted", hidden, w.down), w.down_bias, "tef")
    return jnp.einsum("ted,te->td", y, combine.astype(x.dtype))


@dataclasses.dataclass(frozen=True)
class ExpertSchedule:
    """Decode-time changes to which routed experts run when. Both change the model's function: off by default.

    The routed experts of a token are ranked by routing weight. Expert Skipping drops the lowest
    `n_skipped`; Expert Deferral (KTransformers §4) computes the next-lowest `n_deferred` concurrently with
    the next layer's attention and adds them one layer later, at every MoE layer but the last:
        O_k = I_k + S_k(I_k) + R_k^imm(I_k) + R_{k-1}^def(I_{k-1})
    """

    n_deferred: int = 0
    n_skipped: int = 0

    def check(self, cfg: ModelConfig):
        if self.n_deferred < 0 or self.n_skipped < 0:
            raise ValueError(f"n_deferred and n_skipped must be >= 0, got {self}")
        if self.n_deferred + self.n_skipped >= cfg.num_experts_per_tok:
            raise ValueError(f"{self} leaves no immediate expert of the {cfg.num_experts_per_tok} routed per token")


@dataclasses.dataclass
class Started:
    """Routed experts handed to the CPU (or computed by XLA): their result, once `other` exists."""

    pending: jax.Array
    finish: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]  # (pending, other) -> (result, other)

    def result(self, other: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self.finish(self.pending, other)


def _by_weight(ids: jax.Array, weights: jax.Array, sizes: tuple[int, ...]):
    """Splits each token's experts, ranked by routing weight, into consecutive groups of `sizes`."""
    order = jnp.argsort(-weights, axis=-1)
    ids, weights = jnp.take_along_axis(ids, order, -1), jnp.take_along_axis(weights, order, -1)
    bounds = np.cumsum((0, *sizes))
    return [(ids[:, a:b], weights[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _start_routed(w: MoE, tokens, ids, weights, slot: int) -> tuple[Started, jax.Array]:
    """Starts routed experts: (the Started job, tokens passed through, to order what uses them after)."""
    if w.experts is not None:
        return Started(routed_experts_dense(w.experts, tokens, ids, weights), lambda p, o: (p, o)), tokens
    pending, tokens = submit_routed_experts(tokens, ids, weights, layer=w.expert_layer, slot=slot)
    k = ids.shape[1]
    return Started(pending, lambda p, o: wait_routed_experts(p, o, top_k=k, slot=slot)), tokens


@dataclasses.dataclass
class MoEInFlight:
    """A MoE block between moe_start and moe_finish: its routed experts are being computed."""

    immediate: Started
    shared: jax.Array | None
    carried: Started | None  # the previous MoE layer's deferred experts, added here
    shape: tuple[int, ...]


def moe_start(
    cfg: ModelConfig,
    w: MoE,
    x: jax.Array,
    *,
    slot: int = 0,
    n_skipped: int = 0,
    n_deferred: int = 0,
    deferred_slot: int = 1,
    carried: Started | None = None,
    live: jax.Array | None = None,
):
    """Routes x [..., d], starts its routed experts and computes the shared experts meanwhile.

    Returns (the MoEInFlight, x's tokens passed through the hand-off (use them to order later work after
    it), the chosen experts [tokens, k], this layer's deferred experts as a Started or None). With
    n_deferred, the lowest-weighted experts are started here for the next MoE layer (`carried` there).
    `live` (bool, x's shape less its last axis) marks the tokens that count: the others get routing weights of
    zero, which the CPU kernels skip, so the free slots of a serving batch read no experts.
    """
    tokens = x.reshape(-1, x.shape[-1])
    chosen, weights = route(cfg, w.router, w.correction_bias, tokens, w.router_bias)
    if live is not None:
        weights = jnp.where(live.reshape(-1, 1), weights, 0.0).astype(weights.dtype)
    k = cfg.num_experts_per_tok - n_skipped - n_deferred
    if n_skipped or n_deferred:
        groups = _by_weight(chosen, weights, (k, n_deferred, n_skipped))
        (ids, imm_weights), (deferred_ids, deferred_weights) = groups[0], groups[1]
    else:
        ids, imm_weights = chosen, weights
    immediate, tokens = _start_routed(w, tokens, ids, imm_weights, slot)
    deferred = None
    if n_deferred:
        deferred, tokens = _start_routed(w, tokens, deferred_ids, deferred_weights, deferred_slot)
    with jax.named_scope("shared_experts"):
        shared = mlp(w.shared, tokens) if w.shared is not None else None
    return MoEInFlight(immediate, shared, carried, x.shape), tokens, chosen, deferred


def moe_finish(flight: MoEInFlight, other: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The MoE output once `other` exists (what the GPU computes meanwhile): (output, other)."""
    out, other = flight.immediate.result(other)
    if flight.shared is not None:
        out = out + flight.shared
    if flight.carried is not None:
        previous, out = flight.carried.result(out)
        out = out + previous
    return out.reshape(flight.shape), other


def moe(cfg: ModelConfig, w: MoE, x: jax.Array, **options):
    """The MoE block on x [..., d] -> (output, the experts chosen per token, deferred experts or None).

    On a GPU the shared experts run while the CPU computes the routed ones (the wait depends on them).
    `options` are moe_start's.
    """
    flight, tokens, chosen, deferred = moe_start(cfg, w, x, **options)
    out, _ = moe_finish(flight, flight.shared if flight.shared is not None else tokens)
    return out, chosen, deferred


def dequantize_blocks(w: jax.Array, scale: jax.Array, block: tuple[int, int], dtype) -> jax.Array:
    """FP8 weights [..., out, in] with block scales [..., ceil(out/bo), ceil(in/bi)] -> dtype, on the device.

    Edge blocks may be partial: each scale is repeated over its block and cut to the weight's shape."""
    scale = jnp.repeat(jnp.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return (w.astype(jnp.float32) * scale[..., : w.shape[-2], : w.shape[-1]]).astype(dtype)


def group_by_expert(ids: jax.Array, weights: jax.Array, n_experts: int, capacity: int, first: int = 0, skip: int = 0):
    """Token-expert pairs (ids, weights [T, k] from route) of experts [first, first + n_experts) grouped by
    expert, `capacity` slots per expert; pairs of other experts are left out.

    Returns (rows [n_experts, capacity] int32: the token in each slot, T in empty slots; slot weights
    [n_experts, capacity] float32: its routing weight, 0 in empty slots). Each expert's pairs are taken in token
    order from its `skip`-th on (so calls with skip = 0, capacity, 2 x capacity, ... cover an expert's pairs
    in passes of bounded size); pairs beyond skip + capacity are dropped, never written into another expert's
    slots: dropless when skip = 0 and capacity >= the largest count among these experts. Calls on the same ids
    in one jit share their sort.
    """
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    expert = flat[order]
    counts = jnp.zeros(max(first + n_experts, 1), jnp.int32).at[flat].add(1, mode="drop")
    rank = jnp.arange(t * k) - (jnp.cumsum(counts) - counts)[jnp.clip(expert, 0, counts.shape[0] - 1)] - skip
    local = expert - first
    keep = (local >= 0) & (local < n_experts) & (rank >= 0) & (rank < capacity)
    slot = jnp.where(keep, local * capacity + rank, n_experts * capacity)
    rows = jnp.full(n_experts * capacity, t, jnp.int32).at[slot].set(order // k, mode="drop")
    slot_weights = jnp.zeros(n_experts * capacity, jnp.float32).at[slot].set(weights.reshape(-1)[order], mode="drop")
    return rows.reshape(n_experts, capacity), slot_weights.reshape(n_experts, capacity)


def experts_grouped(w: Experts, x: jax.Array, rows: jax.Array, slot_weights: jax.Array, out: jax.Array):
    """out [T, d] float32 plus the experts w (e of them, stacked) on their routed tokens of x [T, d].

    rows, slot_weights [e, c]: this block's slots from group_by_expert. Tokens are gathered per expert and the
    three projections run as batched GEMMs over the experts (never ragged_dot: DESIGN.md §5)."""
    xs = jnp.take(x, rows, axis=0, mode="fill", fill_value=0)  # [e, c, d]
    g = _biased(jnp.einsum("ecd,efd->ecf", xs, w.gate), w.gate_bias, "ecf")
    u = _biased(jnp.einsum("ecd,efd->ecf", xs, w.up), w.up_bias, "ecf")
    y = jnp.einsum("ecf,edf->ecd", glu(w.activation, g, u), w.down, preferred_element_type=jnp.float32)
    y = _biased(y, w.down_bias, "ecf")
    y = y * slot_weights[..., None]
    return out.at[rows.reshape(-1)].add(y.reshape(-1, x.shape[-1]), mode="drop")
