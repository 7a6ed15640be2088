"""Grouped-query attention (GQA), as the Llama-lineage MoE families compute it: per-head q/k/v projections (with
optional biases), optional QK RMSNorm (per head, or over all heads), RoPE on all or the first part of each head's
dims, an optional sliding window (per layer) and optional attention sinks, and a key/value cache per layer.

A family's config provides: num_attention_heads, num_key_value_heads, head_dim, rope (RopeConfig; rope.dim the
rotated dims of a head), rms_norm_eps and softmax_scale.

Einsum dimension names: b batch, t query tokens, s key/cache positions, d hidden, h heads, k key/value heads,
g query heads per key/value head (h = k * g), e head dims.
"""

import dataclasses

import jax
import jax.numpy as jnp

from hybridjit.models.common import decoder
from hybridjit.models.common.host_attention import HostAttention
from hybridjit.models.common.layers import linear, masked_softmax, rms_norm
from hybridjit.models.common.prefill_cores import cudnn_causal, cudnn_version, over_query_chunks
from hybridjit.models.common.pytree import pytree
from hybridjit.models.common.ring_cache import held_positions
from hybridjit.models.common.rope import apply_rope, rope_cos_sin


@pytree(meta=("window",))
class GQA:
    q: jax.Array  # [h*e, d]
    k: jax.Array  # [k*e, d]
    v: jax.Array  # [k*e, d]
    o: jax.Array  # [d, h*e]
    q_bias: jax.Array | None = None
    k_bias: jax.Array | None = None
    v_bias: jax.Array | None = None
    o_bias: jax.Array | None = None
    q_norm: jax.Array | None = None  # [e] per head, or [h*e] over all heads
    k_norm: jax.Array | None = None  # [e] or [k*e]
    sinks: jax.Array | None = None  # [h]: a per-head logit that takes a share of each softmax and no value
    window: int | None = None  # this layer's sliding window: a query sees the last `window` positions


@pytree(meta=("ring",))
class KVCache:
    k: jax.Array  # [b, s, k, e], roped
    v: jax.Array  # [b, s, k, e]
    ring: bool = False  # the last s positions only, position p at index p % s (models/common/ring_cache.py)


def init_cache(cfg, batch: int, length: int, dtype, device=None, ring: bool = False) -> list[KVCache]:
    """An empty cache of `batch` sequences of `length` positions. With `ring`, a layer whose window is shorter
    than `length` keeps only its window, as a ring that decode steps write one token at a time (a prompt enters
    it whole: serving/engine.py's insert), so its bytes are fixed, not per token; prefill and chunks of a prompt
    write caches without rings."""

    def layer(i: int) -> KVCache:
        window = cfg.window(i)
        size = window if ring and window is not None and window < length else length
        shape = (batch, size, cfg.num_key_value_heads, cfg.head_dim)
        return KVCache(jnp.zeros(shape, dtype, device=device), jnp.zeros(shape, dtype, device=device), size < length)

    return [layer(i) for i in range(cfg.num_hidden_layers)]


def _head_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm of x [b, t, heads, e] per head (weight [e]) or over all its heads (weight [heads*e])."""
    if weight is None:
        return x
    if weight.shape[-1] == x.shape[-1]:
        return rms_norm(x, weight, eps)
    return rms_norm(x.reshape(*x.shape[:2], -1), weight, eps).reshape(x.shape)


def _rope(cfg, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE on the first rope.dim dims of each head of x [b, t, heads, e]; the rest pass unrotated."""
    rotated = apply_rope(cfg.rope, x[..., : cfg.rope.dim], cos[:, :, None], sin[:, :, None])
    return rotated if cfg.rope.dim == x.shape[-1] else jnp.concatenate([rotated, x[..., cfg.rope.dim :]], axis=-1)


def _project(cfg, w: GQA, x: jax.Array, positions: jax.Array):
    """x [b, t, d] at positions [b, t] -> roped queries [b, t, h, e], roped keys and values [b, t, k, e]."""
    b, t = x.shape[:2]
    q = linear(x, w.q, w.q_bias).reshape(b, t, cfg.num_attention_heads, cfg.head_dim)
    k = linear(x, w.k, w.k_bias).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
    v = linear(x, w.v, w.v_bias).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
    q, k = _head_norm(q, w.q_norm, cfg.rms_norm_eps), _head_norm(k, w.k_norm, cfg.rms_norm_eps)
    cos, sin = rope_cos_sin(cfg.rope, positions)
    return _rope(cfg, q, cos, sin), _rope(cfg, k, cos, sin), v


def attend(q, k, v, visible, scale: float, sinks: jax.Array | None) -> jax.Array:
    """Attention of queries q [b, t, h, e] over keys and values [b, s, k, e] where visible [b, t, s] -> [b, t, h, e]."""
    if sinks is None:
        # JAX's own core (scores in float32 from the dot itself, per query group): a decode step's attention at
        # Qwen3-30B-A3B shapes took 12.7 us a layer on an H100 this way, 19.1 us as the einsums below
        # (bench/RESULTS.md).
        return jax.nn.dot_product_attention(q, k, v, mask=visible[:, None], scale=scale, implementation="xla")
    # Attention sinks (which the library core has no place for): one extra logit per head in each row's softmax,
    # whose probability is dropped.
    b, t, h, e = q.shape
    groups = h // k.shape[2]
    scores = jnp.einsum("btkge,bske->bkgts", q.reshape(b, t, -1, groups, e), k, preferred_element_type=jnp.float32)
    scores = scores * scale
    sink = sinks.reshape(-1, groups)[None, :, :, None, None].astype(jnp.float32)
    sink = jnp.broadcast_to(sink, (*scores.shape[:-1], 1))
    mask = jnp.concatenate([jnp.broadcast_to(visible[:, None, None], scores.shape), jnp.ones_like(sink, bool)], -1)
    probs = masked_softmax(jnp.concatenate([scores, sink], axis=-1), mask, v.dtype)[..., :-1]
    return jnp.einsum("bkgts,bske->btkge", probs, v).reshape(b, t, h, e)


def visibility(query_positions: jax.Array, key_positions: jax.Array, window: int | None) -> jax.Array:
    """[b, t, s]: key position s is visible from the query at position t (causal, within the window if any); a
    negative key position is no key (a ring's index not written yet, padding in front of a prompt)."""
    q, k = query_positions[:, :, None], key_positions[:, None, :]
    visible = (k <= q) & (k >= 0)
    return visible if window is None else visible & (k > q - window)


def causal(q, k, v, scale: float, sinks: jax.Array | None, window: int | None) -> jax.Array:
    """The dense causal core over whole prompts (query i and key j at positions i and j)."""
    positions = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
    return attend(q, k, v, visibility(positions, positions, window), scale, sinks)


@dataclasses.dataclass(frozen=True)
class ChunkedAttention:
    """`causal` over queries in chunks of `chunk` tokens (stream-loaded prefill's core where no fused one runs):
    the scores of one chunk ([b, h, chunk, keys] float32) are the largest intermediate, so long prompts fit. With
    a window, a chunk's queries see only the chunk + window - 1 positions ending at its last query, so those are
    the only keys it scores: a windowed layer costs O(t * (chunk + window)), not O(t^2). Hashable: a static jit
    argument."""

    chunk: int

    def __call__(self, q, k, v, scale: float, sinks: jax.Array | None, window: int | None) -> jax.Array:
        b, s = k.shape[:2]
        span = s if window is None else min(s, self.chunk + window - 1)
        # A chunk from `start` reads keys from start - lead; the keys are padded so that every chunk's slice lies
        # within them (in front by lead, behind by the queries' padding to whole chunks).
        lead = window - 1 if span < s else 0
        padding = ((0, 0), (lead, -(-q.shape[1] // self.chunk) * self.chunk - s), (0, 0), (0, 0))
        k, v = (jnp.pad(a, padding) if span < s else a for a in (k, v))

        def one(start, queries):
            first = start - lead if span < s else 0
            keys = first + jnp.arange(span)
            chunk_keys, chunk_values = (jax.lax.dynamic_slice_in_dim(a, first + lead, span, axis=1) for a in (k, v))
            query_positions = jnp.broadcast_to(start + jnp.arange(self.chunk), (b, self.chunk))
            visible = visibility(query_positions, jnp.broadcast_to(keys, (b, span)), window)
            return attend(queries, chunk_keys, chunk_values, visible, scale, sinks)

        return over_query_chunks(self.chunk, (q,), one)


# The heads axis of each operand of the cores above (q, k, v, scale, sinks, window): how prefill_cores.HeadsSplit
# splits them over several devices (contiguous shares of the query heads go with those of the key/value heads).
CORE_HEAD_AXES = (2, 2, 2, None, 0, None)


@dataclasses.dataclass(frozen=True)
class CudnnAttention:
    """`causal` as cuDNN's fused attention (a GPU, 16-bit): windows as cuDNN's sliding window. Sinks, which cuDNN
    has no place for, from its softmax statistics: a sink's logit takes exp(sink) / (Z + exp(sink)) of its row's
    softmax, Z = exp(logsumexp of the row's scores), so the output over the keys alone is scaled by
    sigmoid(logsumexp - sink)."""

    def __call__(self, q, k, v, scale: float, sinks: jax.Array | None, window: int | None) -> jax.Array:
        if sinks is None:
            return cudnn_causal(q, k, v, scale, window)
        out, logsumexp = cudnn_causal(q, k, v, scale, window, stats=True)  # [b, h, t]
        kept = jax.nn.sigmoid(logsumexp - sinks.astype(jnp.float32)[None, :, None])
        return (out * jnp.swapaxes(kept, 1, 2)[..., None]).astype(out.dtype)


def _cudnn_takes(head_dim: int, dtype) -> bool:
    """Whether cuDNN's flash attention takes these heads on any GPU: a 16-bit dtype, a head dim that is a multiple
    of 8 and at most 128, and cuDNN present."""
    return jnp.dtype(dtype).itemsize == 2 and head_dim % 8 == 0 and head_dim <= 128 and cudnn_version() is not None


def fused_attention(cfg, dtype) -> CudnnAttention | None:
    """The fused core stream-loaded prefill runs on a GPU in `dtype`, None where there is none: cuDNN's, where
    it takes the heads (_cudnn_takes)."""
    return CudnnAttention() if _cudnn_takes(cfg.head_dim, dtype) else None


# Decode attention over at least this many query rows (batch x new tokens) runs cuDNN's fused core on a GPU, fewer
# the XLA core of `attend`. At Qwen3-30B-A3B's shapes (32 query and 4 key/value heads of 128, 768 cached positions,
# bfloat16; 1x H200, session 37, calls 4-5) XLA's took 0.051 / 0.099 / 0.19 / 1.32 / 2.61 ms at 32 / 64 / 128 /
# 1,024 / 2,048 rows (at most 1.2 TB/s of cache read: it lays the cache out again per head), cuDNN's 0.084 / 0.099 /
# 0.11 / 0.41 / 0.78 (4.1 TB/s); in a streamed decode step of 2,048 slots XLA's core had been 36 of the 97 ms its
# executables took, the link aside.
FUSED_DECODE_ROWS = 64


def decode_core(q, k, v, visible, scale: float, sinks: jax.Array | None) -> jax.Array:
    """`attend` for decode steps: cuDNN's fused core with the visibility as its mask where it takes the heads, the
    rows are many (FUSED_DECODE_ROWS) and there are no sinks, lowered so on a GPU only (jax.lax.platform_dependent:
    the same program on the CPU runs `attend`); `attend` elsewhere."""
    rows = q.shape[0] * q.shape[1]
    if sinks is not None or rows < FUSED_DECODE_ROWS or k.dtype != q.dtype or not _cudnn_takes(q.shape[-1], q.dtype):
        return attend(q, k, v, visible, scale, sinks)

    def fused(q, k, v, visible):
        return jax.nn.dot_product_attention(q, k, v, mask=visible[:, None], scale=scale, implementation="cudnn")

    def plain(q, k, v, visible):
        return attend(q, k, v, visible, scale, None)

    return jax.lax.platform_dependent(q, k, v, visible, cuda=fused, default=plain)


def prefill(cfg, w: GQA, x: jax.Array, core=causal):
    """Causal attention over whole prompts x [b, t, d] from position 0 -> (out [b, t, d], (keys, values) for the
    cache)."""
    positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    q, k, v = _project(cfg, w, x, positions)
    out = core(q, k, v, cfg.softmax_scale, w.sinks, w.window).reshape(*x.shape[:2], -1)
    return linear(out, w.o, w.o_bias), (k, v)


def write_prompt(cache: KVCache, entries: tuple[jax.Array, jax.Array]) -> KVCache:
    if cache.ring:  # right-padded prompts of several lengths: which positions a ring keeps differs by row
        raise ValueError("cache: a prompt is written to a cache without rings (init_cache with ring=False)")
    k, v = entries
    return KVCache(
        k=jax.lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), (0, 0, 0, 0)),
        v=jax.lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), (0, 0, 0, 0)),
    )


def decode(cfg, w: GQA, x: jax.Array, positions: jax.Array, cache: KVCache | HostAttention):
    """New tokens x [b, t, d] at positions [b, t] against the cache (their keys and values written first). A ring
    cache takes one token per sequence (a decode step): the `window` positions it keeps are all that token sees,
    where several tokens would overwrite positions the first of them still sees. A HostAttention layer writes the
    entries and attends itself."""
    if isinstance(cache, HostAttention):  # its layer keeps a sliding window's positions as a ring, as below
        out = cache.gqa(*_project(cfg, w, x, positions), positions, cfg.softmax_scale, w.sinks).astype(x.dtype)
        return linear(out.reshape(*x.shape[:2], -1), w.o, w.o_bias), cache
    size = cache.k.shape[1]
    if cache.ring and x.shape[1] != 1:
        raise ValueError(f"x: a ring cache takes one token per sequence and call, got {x.shape[1]}")
    q, k, v = _project(cfg, w, x, positions)
    rows = jnp.arange(x.shape[0])[:, None]
    at = positions % size if cache.ring else positions
    cache = KVCache(
        k=cache.k.at[rows, at].set(k.astype(cache.k.dtype)),
        v=cache.v.at[rows, at].set(v.astype(cache.v.dtype)),
        ring=cache.ring,
    )
    keys = held_positions(positions[:, 0], size) if cache.ring else jnp.broadcast_to(jnp.arange(size), (len(x), size))
    out = decode_core(q, cache.k, cache.v, visibility(positions, keys, w.window), cfg.softmax_scale, w.sinks)
    return linear(out.reshape(*x.shape[:2], -1), w.o, w.o_bias), cache


ATTENTION = decoder.Attention(prefill=prefill, write_prompt=write_prompt, decode=decode, causal=causal)
