"""A decode cache layer held outside the program, that attends on the host (issue #25: MoE-Gen's attention on the
CPU, reading the KV cache where it lives, in host memory, rather than carrying it to the GPU every step).

A model's decode attention given such a layer as its cache hands it the step's queries and new entries instead of
writing the entries into cache arrays and attending over them: the layer writes the entries where it keeps the
cache and returns the attention core's output, which the model projects as it would its own core's. The layer is a
pytree whose one leaf is its index, so every layer of a model shares one compiled program.
"""

import abc

import jax


class HostAttention(abc.ABC):
    """One layer's cache kept on the host, attending there: each method takes one new token per sequence (t = 1)
    at positions [b, t], writes its entries at those positions and returns the core's output in float32."""

    @abc.abstractmethod
    def gqa(self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, scale: float,
            sinks: jax.Array | None) -> jax.Array:  # fmt: skip
        """Grouped-query attention: q [b, t, h, e], the new keys and values [b, t, kv heads, e] -> [b, t, h, e], each
        query over its sequence's positions up to its own, a sliding-window layer's over those its ring keeps (the
        window's), with `sinks` [h] (or None) joining each head's softmax as logits without values."""

    @abc.abstractmethod
    def mla(self, q_latent: jax.Array, q_rope: jax.Array, latent: jax.Array, k_rope: jax.Array, positions: jax.Array,
            scale: float) -> jax.Array:  # fmt: skip
        """Absorbed multi-head latent attention: queries in the latent space q_latent [b, t, h, r] and their rotary
        part q_rope [b, t, h, p], the new latents [b, t, r] and rotary keys [b, t, p] -> the heads' outputs in the
        latent space [b, t, h, r] (softmax(scale (q_latent . latent + q_rope . k_rope)) . latent)."""
