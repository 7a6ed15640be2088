"""Next-token selection on the device: greedy, or temperature / top-k / top-p sampling.

The sampling parameters are traced scalars, so changing them between requests does not recompile.
"""

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 selects greedy decoding
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def device_args(self):
        return jnp.float32(self.temperature), jnp.int32(self.top_k), jnp.float32(self.top_p)


def sample(logits: jax.Array, key: jax.Array, temperature, top_k, top_p) -> jax.Array:
    """logits [b, vocab] float32 -> token ids [b] int32."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    sorted_logits, sorted_ids = jax.lax.top_k(scaled, logits.shape[-1])
    rank = jnp.arange(logits.shape[-1])
    keep = (top_k <= 0) | (rank < top_k)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p
    choice = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    sampled = jnp.take_along_axis(sorted_ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)
