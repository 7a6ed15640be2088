"""Norms, projections and the gated MLP (SiLU), as every family computes them.

Einsum dimension names: b batch, t query tokens, s key/cache positions, d hidden, h heads, e routed experts,
k experts per token, f MLP intermediate. Weight matrices keep the checkpoint's [out, in] orientation.
"""

import jax
import jax.numpy as jnp

from hybridjit.models.common.pytree import pytree


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def linear(x: jax.Array, w: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    y = jnp.einsum("...i,oi->...o", x, w)
    return y if bias is None else y + bias


@pytree
class MLP:
    gate: jax.Array  # [f, d]
    up: jax.Array  # [f, d]
    down: jax.Array  # [d, f]


def mlp(w: MLP, x: jax.Array) -> jax.Array:
    return linear(jax.nn.silu(linear(x, w.gate)) * linear(x, w.up), w.down)


def masked_softmax(scores: jax.Array, mask: jax.Array, dtype) -> jax.Array:
    scores = jnp.where(mask, scores.astype(jnp.float32), -jnp.inf)
    return jax.nn.softmax(scores, axis=-1).astype(dtype)
