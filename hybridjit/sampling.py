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


def restricts(temperature, top_k, top_p) -> bool:
    """Whether some row of these host-side parameters [b] (numpy) samples within top_k or top_p: `sample`'s
    `restricted` for them."""
    return bool(((np.asarray(temperature) > 0) & ((np.asarray(top_k) > 0) | (np.asarray(top_p) < 1))).any())


def sample(logits: jax.Array, keys: jax.Array, temperature, top_k, top_p, restricted: bool = True) -> jax.Array:
    """logits [b, vocab] float32, each row with its own key and parameters [b] -> token ids [b] int32: greedy where
    the temperature is 0; else a draw from softmax(logits / temperature), restricted to the top_k tokens (0: all) and
    then to the smallest prefix of them holding top_p of the mass. A row's token depends on its own key and
    parameters only, never on the other rows.

    Only rows that restrict need the logits sorted, and a sort of the whole vocabulary costs far more than the draw
    (768 rows of Qwen3's 151,936 logits: 10.0 ms against 1.1 on an H200, bench/RESULTS.md), so the rows sort only
    with `restricted` (a static argument: pass `restricts(...)` of the host's copy of the parameters; False with a
    row that restricts would draw that row unrestricted). It is the caller's to know rather than a condition on
    the device because XLA on a GPU reads a condition's predicate back to the host: a `lax.cond` here made every
    step of a looped decode wait for the device, and Qwen3-30B-A3B's batch-1 step took 4.9 ms instead of 2.9."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    sampling = temperature > 0
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    if restricted:
        restricting = sampling & ((top_k > 0) | (top_p < 1))
        drawn = jnp.where(restricting, jax.vmap(_restricted)(keys, scaled, top_k, top_p), drawn)
    return jnp.where(sampling, drawn, greedy)


def _restricted(key: jax.Array, scaled: jax.Array, top_k, top_p) -> jax.Array:
    """One row's draw from its scaled logits [vocab] within top_k, then top_p, by their sorted order."""
    sorted_logits, sorted_ids = jax.lax.top_k(scaled, scaled.shape[-1])
    rank = jnp.arange(scaled.shape[-1])
    keep = (top_k <= 0) | (rank < top_k)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf))
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    keep &= (jnp.cumsum(probs) - probs) < top_p
    choice = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf))
    return sorted_ids[choice].astype(jnp.int32)
