"""Ring caches: a sliding-window layer's keys and values kept for the last `size` positions of each sequence only,
position p at index p % size, so that a layer whose queries see `size` positions holds that many whatever the
context (gpt-oss-120b's sliding layers: 128 positions, not 128K). Which position an index holds follows from the
newest position written; attention masks by those true positions, never by the index."""

import jax
import jax.numpy as jnp
import numpy as np


def is_ring(node) -> bool:
    """Whether a node of a cache pytree is a layer cache kept as a ring (a pytree with `ring` set)."""
    return getattr(node, "ring", False) is True


def held_positions(newest, size: int):
    """[b, size]: the position index j of a ring holds once each sequence's positions up to newest [b] are
    written, the latest p <= newest with p % size == j; negative where no position is written there yet. A jax
    array for a jax array, a numpy one for a numpy one (a host cache's rings, hybridjit/host_kv_cache.py)."""
    newest = newest[:, None]
    return newest - (newest - np.arange(size, dtype=np.int32)) % size


def prompt_positions(length, size: int, prompt_len: int):
    """[b, size]: the prompt position whose entry each index of a ring of `size` takes from prompts of `prompt_len`
    positions whose last ones are at length [b] - 1: the position it holds then (an index that holds none takes
    any: attention masks it out). jax or numpy, as held_positions."""
    return held_positions(length - 1, size).clip(0, prompt_len - 1)


def from_prompt(prompt: jax.Array, length: jax.Array, size: int) -> jax.Array:
    """The ring of `size` positions [b, size, ...] of prompts whose entries prompt [b, t, ...] hold positions
    [0, t) and whose last ones are at length [b] - 1 (prompt_positions)."""
    positions = prompt_positions(length, size, prompt.shape[1])
    return jnp.take_along_axis(prompt, positions.reshape(positions.shape + (1,) * (prompt.ndim - 2)), axis=1)
