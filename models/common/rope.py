"""Rotary position embeddings: plain, and YaRN-scaled (frequency ramp and mscale), interleaved or half-split."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from hybridjit.config import ConfigError, ConfigFields


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float
    dim: int  # qk_rope_head_dim
    interleave: bool
    # YaRN (None when the checkpoint uses plain RoPE)
    yarn_factor: float | None = None
    original_max_position: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_config(f: ConfigFields, dim: int, interleave: bool = True) -> RopeConfig:
    """RoPE of `dim` dimensions per head from a config.json; `interleave`: the family's pair layout when the config
    does not say (rope_interleave): DeepSeek rotates (x0, x1), ...; Llama-style families (x_i, x_{i+dim/2})."""
    # Real DeepSeek configs use the legacy key "rope_scaling" ({"type": "yarn", ...}); newer ones
    # "rope_parameters" ({"rope_type": ..., "rope_theta": ...}).
    params = f.section("rope_parameters") or f.section("rope_scaling") or ConfigFields({}, f.source)
    rope_type = params.text("rope_type", None) or params.text("type", "default")
    # theta > 1: the frequencies theta^(-2i/dim) must fall with i, and YaRN divides by log(theta).
    theta = params.number("rope_theta", None, above=1) or f.number("rope_theta", 10000.0, above=1)
    base = dict(theta=theta, dim=dim, interleave=f.flag("rope_interleave", interleave))
    if rope_type == "default":
        return RopeConfig(**base)
    if rope_type != "yarn":
        raise ConfigError(f"{f.source}: rope type {rope_type!r} is not supported (default, yarn)")
    if "original_max_position_embeddings" not in params.raw:
        raise ConfigError(f"{f.source}: yarn rope scaling needs original_max_position_embeddings")
    return RopeConfig(
        **base,
        yarn_factor=params.number("factor", at_least=1),
        original_max_position=params.integer("original_max_position_embeddings", minimum=1),
        beta_fast=params.number("beta_fast", 32.0, above=0),
        beta_slow=params.number("beta_slow", 1.0, above=0),
        mscale=params.number("mscale", None),
        mscale_all_dim=params.number("mscale_all_dim", None),
        truncate=params.flag("truncate", True),
    )

def rope_inv_freq(rope: RopeConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies [p/2] and the factor on cos/sin, with YaRN's ramp when configured."""
    dim = rope.dim
    exponents = np.arange(0, dim, 2, dtype=np.float32) / dim
    pos_freqs = rope.theta**exponents
    inv_freq = 1.0 / pos_freqs
    if rope.yarn_factor is None:
        return inv_freq.astype(np.float32), 1.0

    def correction_dim(rotations):
        return (
            dim
            * math.log(rope.original_max_position / (rotations * 2 * math.pi))
            / (2 * math.log(rope.theta))
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by the factor
    inv_freq = (inv_freq / rope.yarn_factor) * (1 - extrapolate) + inv_freq * extrapolate
    if rope.mscale and rope.mscale_all_dim:
        factor = yarn_mscale(rope.yarn_factor, rope.mscale) / yarn_mscale(
            rope.yarn_factor, rope.mscale_all_dim
        )
    else:
        factor = yarn_mscale(rope.yarn_factor, 1.0)
    return inv_freq.astype(np.float32), float(factor)


def rope_cos_sin(rope: RopeConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    inv_freq, factor = rope_inv_freq(rope)
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rope(rope: RopeConfig, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates pairs of x [..., p]: (x0, x1), (x2, x3), ... when interleaved, else (x_i, x_{i+p/2}).

    The result is laid out as [rotated firsts, rotated seconds]; queries and keys get the same layout,
    so their dot products are those of the reference whatever its output order.
    """
    if rope.interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = jnp.split(x, 2, axis=-1)
    x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
