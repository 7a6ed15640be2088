"""Next-token selection on the device: greedy, or temperature / top-k / top-p sampling.

The sampling parameters are traced scalars, so changing them between requests does not recompile.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

_WORD = 0xFFFFFFFF


def is_integer(value) -> bool:
    """A Python or numpy integer, not a bool (True is not 1 here) nor a float."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def integer(name: str, value) -> int:
    if not is_integer(value):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return int(value)


def real(name: str, value) -> float:
    """`value` as a float: Python or numpy numbers, never a bool nor a string."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Checked sampling settings (numpy scalars are taken as Python numbers): TypeError for a value of the
    wrong type, ValueError for one out of range, each naming the argument and what it allows."""

    temperature: float = 0.0  # 0 selects greedy decoding
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    seed: int = 0  # any non-negative integer (see key)
    # Which of several sequences sampled together with one seed (generate's rows): each its own draws, the first
    # the draws it would have alone.
    row: int = 0

    def __post_init__(self):
        temperature, top_p = real("temperature", self.temperature), real("top_p", self.top_p)
        top_k, seed = integer("top_k", self.top_k), integer("seed", self.seed)
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 keeps every token), got {top_k}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed}")
        for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed)):
            object.__setattr__(self, name, value)

    def device_args(self):
        # A top_k at or above the vocabulary keeps every token, as one past int32 does.
        return jnp.float32(self.temperature), jnp.int32(min(self.top_k, 2**31 - 1)), jnp.float32(self.top_p)

    def key(self) -> jax.Array:
        """The PRNG key of `seed`: jax.random.key keeps only a seed's low 32 bits (seed 2**32 + 1 was seed 1,
        and 2**63 overflowed), so each further 32-bit word is folded in. Distinct seeds give distinct keys,
        and seeds below 2**32 the keys they always had. Rows after the first fold in their index."""
        key, rest = jax.random.key(self.seed & _WORD), self.seed >> 32
        while rest:
            key = jax.random.fold_in(key, rest & _WORD)
            rest >>= 32
        return jax.random.fold_in(key, self.row) if self.row else key


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
