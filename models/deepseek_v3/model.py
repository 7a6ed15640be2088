"""DeepSeek-V3 family (V2, V2-Lite, V3, R1, V3.1, Kimi-K2) as pure JAX functions: Multi-head Latent Attention
over a compressed latent cache, composed with the shared MoE block (models/common).

Everything here is a function of (config, weights pytree, inputs); the config is a frozen dataclass and
so a static jit argument. Routed experts are not JAX arrays: each MoE layer names a layer of the C++
expert bank and calls the `hybridjit_routed_experts` custom call, which reads the expert weights in host
memory in the checkpoint's own format.

Einsum dimension names, used throughout:
  b batch   t query tokens   s key/cache positions   d hidden   h heads
  q q_lora_rank   r kv_lora_rank   n qk_nope_head_dim   p qk_rope_head_dim   v v_head_dim
  e routed experts   k experts per token   f MLP intermediate
Weight matrices keep the checkpoint's [out, in] orientation.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from hybridjit.models.common import decoder
from hybridjit.models.common.host_attention import HostAttention
from hybridjit.models.common.layers import linear, masked_softmax, rms_norm
from hybridjit.models.common.prefill_cores import cudnn_causal, cudnn_version, over_query_chunks
from hybridjit.models.common.pytree import pytree
from hybridjit.models.common.rope import apply_rope, rope_cos_sin
from hybridjit.models.deepseek_v3.config import DeepseekV3Config as ModelConfig

# The q and kv latent norms use a fixed epsilon in DeepSeek's reference code and in transformers,
# whatever rms_norm_eps says (the released configs happen to agree).
LATENT_NORM_EPS = 1e-6


@pytree
class MLA:
    q_a: jax.Array | None  # [q, d], None when q_lora_rank is null (then q_b is q_proj [h*(n+p), d])
    q_a_bias: jax.Array | None
    q_a_norm: jax.Array | None
    q_b: jax.Array  # [h*(n+p), q] or [h*(n+p), d]
    kv_a: jax.Array  # [r+p, d] (kv_a_proj_with_mqa)
    kv_a_bias: jax.Array | None
    kv_a_norm: jax.Array  # [r]
    kv_b: jax.Array  # [h*(n+v), r]
    o: jax.Array  # [d, h*v]
    o_bias: jax.Array | None


@pytree
class LayerCache:
    """The MLA cache of one layer: the normalised latent and the roped shared key, per position."""

    latent: jax.Array  # [b, s, r]
    k_rope: jax.Array  # [b, s, p]


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype, device=None, ring: bool = False) -> list[LayerCache]:
    """An empty cache of `batch` sequences of `length` positions in every layer: no MLA layer has a window, so
    `ring` (which keeps a windowed layer's window only, models/common/gqa.py) changes nothing."""
    del ring
    return [
        LayerCache(
            latent=jnp.zeros((batch, length, cfg.kv_lora_rank), dtype, device=device),
            k_rope=jnp.zeros((batch, length, cfg.qk_rope_head_dim), dtype, device=device),
        )
        for _ in range(cfg.num_hidden_layers)
    ]


def _queries(cfg: ModelConfig, w: MLA, x: jax.Array, cos, sin):
    """x [b, t, d] -> (q_nope [b, t, h, n], roped q_rope [b, t, h, p])."""
    if w.q_a is None:
        q = linear(x, w.q_b)
    else:
        q = linear(rms_norm(linear(x, w.q_a, w.q_a_bias), w.q_a_norm, LATENT_NORM_EPS), w.q_b)
    q = q.reshape(*x.shape[:2], cfg.num_attention_heads, cfg.qk_head_dim)
    q_nope, q_rope = jnp.split(q, [cfg.qk_nope_head_dim], axis=-1)
    return q_nope, apply_rope(cfg.rope, q_rope, cos[:, :, None], sin[:, :, None])


def _latents(cfg: ModelConfig, w: MLA, x: jax.Array, cos, sin):
    """x [b, t, d] -> what the cache stores: (normalised latent [b, t, r], roped shared key [b, t, p])."""
    kv = linear(x, w.kv_a, w.kv_a_bias)
    latent, k_rope = jnp.split(kv, [cfg.kv_lora_rank], axis=-1)
    return rms_norm(latent, w.kv_a_norm, LATENT_NORM_EPS), apply_rope(cfg.rope, k_rope, cos, sin)


def _kv_b(cfg: ModelConfig, w: MLA):
    """kv_b as per-head key and value up-projections: ([h, n, r], [h, v, r])."""
    kv_b = w.kv_b.reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    return kv_b[:, : cfg.qk_nope_head_dim], kv_b[:, cfg.qk_nope_head_dim :]


def causal_attention(q_nope, q_rope, k_nope, k_rope, values, scale):
    """Dense causal attention of t queries over the same t positions, keys and values expanded per head:
    q_nope [b, t, h, n], q_rope [b, t, h, p], k_nope [b, t, h, n], k_rope [b, t, p], values [b, t, h, v]."""
    scores = jnp.einsum("bthn,bshn->bhts", q_nope, k_nope) + jnp.einsum("bthp,bsp->bhts", q_rope, k_rope)
    t = q_nope.shape[1]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    probs = masked_softmax(scores * scale, causal[None, None], values.dtype)
    return jnp.einsum("bhts,bshv->bthv", probs, values)


def attention_absorbed(cfg: ModelConfig, w: MLA, x: jax.Array, positions: jax.Array,
                       cache: LayerCache | HostAttention):  # fmt: skip
    """MLA of new tokens x [b, t, d] at `positions` [b, t] against the latent cache (decode).

    kv_b is absorbed into the query and the output, so attention runs in the r-dimensional latent space
    and the cache is never expanded per head. The new tokens' latents are written first, then each
    query attends to the cache positions up to its own. A HostAttention layer writes the latents and attends
    itself.
    """
    cos, sin = rope_cos_sin(cfg.rope, positions)
    q_nope, q_rope = _queries(cfg, w, x, cos, sin)
    latent, k_rope = _latents(cfg, w, x, cos, sin)
    wk, wv = _kv_b(cfg, w)
    q_latent = jnp.einsum("bthn,hnr->bthr", q_nope, wk)
    if isinstance(cache, HostAttention):
        out_latent = cache.mla(q_latent, q_rope, latent, k_rope, positions, cfg.softmax_scale).astype(x.dtype)
    else:
        rows = jnp.arange(x.shape[0])[:, None]
        cache = LayerCache(
            latent=cache.latent.at[rows, positions].set(latent.astype(cache.latent.dtype)),
            k_rope=cache.k_rope.at[rows, positions].set(k_rope.astype(cache.k_rope.dtype)),
        )
        scores = (jnp.einsum("bthr,bsr->bhts", q_latent, cache.latent)
                  + jnp.einsum("bthp,bsp->bhts", q_rope, cache.k_rope))  # fmt: skip
        visible = jnp.arange(cache.latent.shape[1])[None, None, None, :] <= positions[:, None, :, None]
        probs = masked_softmax(scores * cfg.softmax_scale, visible, x.dtype)
        out_latent = jnp.einsum("bhts,bsr->bthr", probs, cache.latent)
    out = jnp.einsum("bthr,hvr->bthv", out_latent, wv).reshape(*x.shape[:2], -1)
    return linear(out, w.o, w.o_bias), cache


# ------------------------------------------------------------------- stream-loaded prefill, by pieces
# hybridjit.stream_prefill runs prefill layer by layer as separate executables, with the routed experts
# streamed to the device block by block. These are its pieces: the same math as `prefill`, arranged so that
# no piece needs all the experts of a layer, or the [t, s] attention scores of a whole long prompt, at once.


@dataclasses.dataclass(frozen=True)
class ChunkedAttention:
    """Causal attention core over queries in chunks of `chunk` tokens: the scores of one chunk against all keys
    ([b, h, chunk, s] float32) are the largest intermediate, so long prompts fit. Hashable: a static jit argument.

    Called as attend(q_nope [b, t, h, n], q_rope [b, t, h, p], k_nope [b, s, h, n], k_rope [b, s, p],
    values [b, s, h, v], scale) -> [b, t, h, v], with query i at position i and key j at position j.
    """

    chunk: int

    def __call__(self, q_nope, q_rope, k_nope, k_rope, values, scale):
        keys = jnp.arange(k_nope.shape[1])

        def one(start, qn, qr):
            scores = jnp.einsum("bthn,bshn->bhts", qn, k_nope) + jnp.einsum("bthp,bsp->bhts", qr, k_rope)
            causal = (start + jnp.arange(self.chunk))[:, None] >= keys[None, :]
            probs = masked_softmax(scores * scale, causal[None, None], values.dtype)
            return jnp.einsum("bhts,bshv->bthv", probs, values)

        return over_query_chunks(self.chunk, (q_nope, q_rope), one)


# The heads axis of each operand of the cores above (q_nope, q_rope, k_nope, k_rope, values, scale): how
# prefill_cores.HeadsSplit splits them over several devices.
CORE_HEAD_AXES = (2, 2, 2, None, 2, None)


@dataclasses.dataclass(frozen=True)
class CudnnAttention:
    """The causal core of ChunkedAttention's signature as cuDNN's fused (flash) attention, which takes the
    query/key head dim (n + p = 192) different from the value head dim (v = 128) on Hopper with cuDNN >= 9.10."""

    def __call__(self, q_nope, q_rope, k_nope, k_rope, values, scale):
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        shared_rope = jnp.broadcast_to(k_rope[:, :, None], (*k_nope.shape[:3], k_rope.shape[-1]))
        return cudnn_causal(q, jnp.concatenate([k_nope, shared_rope], axis=-1), values, scale)


def fused_attention(cfg: ModelConfig, dtype) -> CudnnAttention | None:
    """The fused core stream-loaded prefill runs on a GPU in `dtype`, None where there is none: cuDNN's, in a
    16-bit dtype, with cuDNN >= 9.10 (MLA's unequal head dims)."""
    version = cudnn_version()
    return CudnnAttention() if jnp.dtype(dtype).itemsize == 2 and version is not None and version >= 91000 else None


def attention_prefill(cfg: ModelConfig, w: MLA, x: jax.Array, attend: Callable):
    """Causal MLA over whole prompts x [b, t, d] from position 0, keys and values expanded per head (prefill),
    with the attention core `attend` (causal_attention, a ChunkedAttention or a CudnnAttention). Returns the
    output [b, t, d] and the (latent, k_rope) pair to store in the cache."""
    positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    cos, sin = rope_cos_sin(cfg.rope, positions)
    q_nope, q_rope = _queries(cfg, w, x, cos, sin)
    latent, k_rope = _latents(cfg, w, x, cos, sin)
    wk, wv = _kv_b(cfg, w)
    k_nope = jnp.einsum("bsr,hnr->bshn", latent, wk)
    values = jnp.einsum("bsr,hvr->bshv", latent, wv)
    out = attend(q_nope, q_rope, k_nope, k_rope, values, cfg.softmax_scale).reshape(*x.shape[:2], -1)
    return linear(out, w.o, w.o_bias), (latent, k_rope)


def write_prompt(cache: LayerCache, entries: tuple[jax.Array, jax.Array]) -> LayerCache:
    """A layer's cache with a prompt's (latents [b, t, r], roped keys [b, t, p]) written at positions [0, t)."""
    latent, k_rope = entries
    return LayerCache(
        latent=jax.lax.dynamic_update_slice(cache.latent, latent.astype(cache.latent.dtype), (0, 0, 0)),
        k_rope=jax.lax.dynamic_update_slice(cache.k_rope, k_rope.astype(cache.k_rope.dtype), (0, 0, 0)),
    )


ATTENTION = decoder.Attention(
    prefill=attention_prefill, write_prompt=write_prompt, decode=attention_absorbed, causal=causal_attention
)


# The shared decoder (models/common/decoder.py) with MLA bound: see its functions for what each computes.
(
    forward, forward_layer, finite_stages, prefill, extend, decode_step, decode_step_dual, decode_step_grouped,
    prefill_attention_layer, decode_attention_layer,
) = (
    decoder.bind(ATTENTION)
)
