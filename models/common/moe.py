"""The MoE block: routing, the routed experts (a layer of the C++ expert bank computed by the custom call
behind the hybrid hand-off, with those resident on the device computed there meanwhile, or JAX-held experts
computed by XLA), the shared experts, and Expert Deferral and Skipping.

Einsum dimension names: b batch, t query tokens, s key/cache positions, d hidden, h heads, e routed experts,
k experts per token, f MLP intermediate. Weight matrices keep the checkpoint's [out, in] orientation.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from hybridjit.models.common.config import ModelConfig
from hybridjit.models.common.experts import Experts, routed_experts_dense
from hybridjit.models.common.layers import MLP, mlp
from hybridjit.models.common.pytree import pytree
from hybridjit.models.common.resident_experts import ResidentExperts, resident_output, split_routes
from hybridjit.models.common.routing import route
from hybridjit.ops.async_experts import submit_routed_experts, wait_routed_experts


@pytree(meta=("expert_layer",))
class MoE:
    """Where the routed experts live is data: a layer of the C++ expert bank in host memory (computed by
    the custom call), some of them also resident on the device (computed there, the rest on the CPU), or JAX
    arrays (computed by XLA, e.g. for training)."""

    router: jax.Array  # [e, d], float32 as the reference routes in float32
    correction_bias: jax.Array | None  # [e], selection only (noaux_tc)
    shared: MLP | None
    experts: Experts | None = None
    expert_layer: int | None = None  # id of this layer's routed experts in the C++ expert bank
    router_bias: jax.Array | None = None  # [e], added to the router's logits (gpt-oss)
    resident: ResidentExperts | None = None  # copies of some of the bank layer's experts on the device


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
    """Routed experts handed to the CPU (or computed by XLA): their result, once `other` exists. `device` is the
    part the device computes meanwhile (its resident experts' pairs, float32), or None."""

    pending: jax.Array
    finish: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]  # (pending, other) -> (result, other)
    device: jax.Array | None = None

    def result(self, other: jax.Array) -> tuple[jax.Array, jax.Array]:
        if self.device is None:
            return self.finish(self.pending, other)
        # The wait takes `other` only once the device part exists: it runs while the CPU works, not after.
        other, device = jax.lax.optimization_barrier((other, self.device))
        out, other = self.finish(self.pending, other)
        return (out + device).astype(out.dtype), other


def _by_weight(ids: jax.Array, weights: jax.Array, sizes: tuple[int, ...]):
    """Splits each token's experts, ranked by routing weight, into consecutive groups of `sizes`."""
    order = jnp.argsort(-weights, axis=-1)
    ids, weights = jnp.take_along_axis(ids, order, -1), jnp.take_along_axis(weights, order, -1)
    bounds = np.cumsum((0, *sizes))
    return [(ids[:, a:b], weights[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _start_routed(w: MoE, tokens, ids, weights, slot: int) -> tuple[Started, jax.Array]:
    """Starts routed experts: (the Started job, tokens passed through, to order what uses them after).

    With resident experts the CPU gets the other experts' pairs, and the device computes its own after the
    hand-off (on the passed-through tokens), so that the two halves run at the same time."""
    if w.experts is not None:
        return Started(routed_experts_dense(w.experts, tokens, ids, weights), lambda p, o: (p, o)), tokens
    res = w.resident
    if res is not None and res.count == res.slot_of.shape[0]:  # every expert resident: no CPU job
        device = resident_output(res, tokens, split_routes(res, ids, weights)[1])
        return Started(device.astype(tokens.dtype), lambda p, o: (p, o)), tokens
    if res is not None:
        weights, pairs = split_routes(res, ids, weights)
    pending, tokens = submit_routed_experts(tokens, ids, weights, layer=w.expert_layer, slot=slot)
    k = ids.shape[1]
    device = None if res is None else resident_output(res, tokens, pairs)
    return Started(pending, lambda p, o: wait_routed_experts(p, o, top_k=k, slot=slot), device), tokens


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


