"""Decode attention computed on the CPU, reading a KV cache where it lives: numpy arrays in host memory.

A decode step's attention reads the whole visible cache for one query token per row. When the cache is kept
in host memory (it does not fit beside the weights on the GPU), reading it there with the CPU's memory
bandwidth avoids copying it over PCIe every step; only the queries and the outputs cross. The kernels are in
``hybridjit_ffi`` (ffi/cpu_attention.cc): float32 arithmetic and accumulation, an online softmax (no score
matrix), split over the CPU thread pool by row, head group and, for few rows, by spans of positions.

Two attention kinds, as the models use them:

- `gqa_decode`: grouped-query attention over separate K and V caches (Qwen3, Llama, gpt-oss).
- `mla_decode`: DeepSeek's multi-head latent attention in its absorbed form, over the compressed latent cache
  and the rope keys; the caller applies the up-projections (absorbed into the queries and the output).

Caches are float32 or bfloat16 (``ml_dtypes.bfloat16``) and must be C-contiguous: a strided cache would have to be
copied, which reads it all once more than the attention itself.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

import hybridjit_ffi as _ffi

BF16 = np.dtype(ml_dtypes.bfloat16)
_CACHE_DTYPES = (np.dtype(np.float32), BF16)


def gqa_decode(q, k: np.ndarray, v: np.ndarray, lengths, scale: float, sinks=None) -> np.ndarray:
    """Grouped-query decode attention: [batch, heads, head_dim] float32.

    q: [batch, heads, head_dim] (any float dtype; converted to contiguous float32). k, v: [batch, max_len,
    kv_heads, head_dim], float32 or bfloat16, C-contiguous, one dtype. lengths: [batch] integers; row i attends to
    positions [0, lengths[i]) of its cache (0: the row is unused, its output is zeros). Query head j reads KV head
    j // (heads // kv_heads). Output: softmax(scale * q . k) . v per row and head. sinks: None, or [heads] logits
    (gpt-oss's attention sinks), each joining its head's softmax with no value: the weights are then
    exp(x_s) / (exp(sink) + sum exp(x)).

    ValueError or TypeError naming the argument for mismatched shapes, dtypes, or lengths outside [0, max_len].
    """
    q = _queries("q", q, 3)
    _check_cache("k", k, 4)
    _check_cache("v", v, 4)
    if v.dtype != k.dtype:
        raise TypeError(f"v has dtype {v.dtype} but k has {k.dtype}: the two caches must share one dtype")
    batch, heads, head_dim = q.shape
    _, max_len, kv_heads, _ = k.shape
    if k.shape != (batch, max_len, kv_heads, head_dim):
        raise ValueError(f"k has shape {k.shape}, expected (batch={batch}, max_len, kv_heads, head_dim={head_dim}) "
                         f"to match q's {q.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v has shape {v.shape}, expected k's {k.shape}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"q's heads ({heads}) must be a multiple of k's kv_heads ({kv_heads})")
    lengths = _lengths(lengths, batch, max_len)
    if sinks is None:
        sinks = np.empty(0, np.float32)  # none, to the kernel
    else:
        sinks = np.ascontiguousarray(sinks, np.float32)
        if sinks.shape != (heads,):
            raise ValueError(f"sinks has shape {sinks.shape}, expected (heads={heads},) to match q's {q.shape}")
    out = np.empty((batch, heads, head_dim), np.float32)
    _ffi.cpu_attention_gqa(q, _as_ffi_cache(k), _as_ffi_cache(v), lengths, float(scale), sinks, out)
    return out


def mla_decode(q_latent, q_rope, latent: np.ndarray, k_rope: np.ndarray, lengths, scale: float) -> np.ndarray:
    """Absorbed multi-head latent attention at decode: [batch, heads, rank] float32, in the latent space.

    q_latent: [batch, heads, rank] (the query already multiplied by the key up-projection), q_rope: [batch, heads,
    rope_dim]; both converted to contiguous float32. latent: [batch, max_len, rank], k_rope: [batch, max_len,
    rope_dim], float32 or bfloat16, C-contiguous, one dtype. lengths: [batch] integers (0: zeros out).
    score[j, s] = scale * (q_latent[j] . latent[s] + q_rope[j] . k_rope[s]); output row j: the softmax over
    s < lengths[i] of score[j, s], times latent[s] (the caller applies the value up-projection). Every head reads
    the same latent rows, so the kernel reads each once per block of heads, not once per head.

    ValueError or TypeError naming the argument for mismatched shapes, dtypes, or lengths outside [0, max_len].
    """
    q_latent = _queries("q_latent", q_latent, 3)
    q_rope = _queries("q_rope", q_rope, 3)
    _check_cache("latent", latent, 3)
    _check_cache("k_rope", k_rope, 3)
    if k_rope.dtype != latent.dtype:
        raise TypeError(f"k_rope has dtype {k_rope.dtype} but latent has {latent.dtype}: they must share one dtype")
    batch, heads, rank = q_latent.shape
    rope_dim = q_rope.shape[2]
    max_len = latent.shape[1]
    if q_rope.shape[:2] != (batch, heads):
        raise ValueError(f"q_rope has shape {q_rope.shape}, expected (batch={batch}, heads={heads}, rope_dim)")
    if latent.shape != (batch, max_len, rank):
        raise ValueError(f"latent has shape {latent.shape}, expected (batch={batch}, max_len, rank={rank})")
    if k_rope.shape != (batch, max_len, rope_dim):
        raise ValueError(f"k_rope has shape {k_rope.shape}, expected (batch={batch}, max_len={max_len}, "
                         f"rope_dim={rope_dim})")
    lengths = _lengths(lengths, batch, max_len)
    out = np.empty((batch, heads, rank), np.float32)
    _ffi.cpu_attention_mla(q_latent, q_rope, _as_ffi_cache(latent), _as_ffi_cache(k_rope), lengths, float(scale), out)
    return out


def _queries(name: str, x, ndim: int) -> np.ndarray:
    """Queries are small (one token a row): converting them to the kernels' contiguous float32 costs nothing."""
    x = np.asarray(x)
    if not (np.issubdtype(x.dtype, np.floating) or x.dtype == BF16):
        raise TypeError(f"{name} must hold floats, got dtype {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {x.shape}")
    return np.ascontiguousarray(x, dtype=np.float32)


def _check_cache(name: str, x, ndim: int) -> None:
    """Caches are taken as they are, never copied: a copy would read the whole cache once more."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy array (the cache in host memory), got {type(x).__name__}")
    if x.dtype not in _CACHE_DTYPES:
        raise TypeError(f"{name} must be float32 or bfloat16, got dtype {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {x.shape}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (a copy would read the whole cache once more)")


def _as_ffi_cache(x: np.ndarray) -> np.ndarray:
    """bfloat16 as its uint16 bits: numpy hands ml_dtypes.bfloat16 to no C extension (neither DLPack nor the
    buffer protocol knows the type), and the kernels read the bits."""
    return x.view(np.uint16) if x.dtype == BF16 else x


def _lengths(lengths, batch: int, max_len: int) -> np.ndarray:
    lengths = np.asarray(lengths)
    if lengths.dtype.kind not in "iu":
        raise TypeError(f"lengths must hold integers, got dtype {lengths.dtype}")
    if lengths.shape != (batch,):
        raise ValueError(f"lengths has shape {lengths.shape}, expected ({batch},): one per row of the batch")
    if batch and (lengths.min() < 0 or lengths.max() > max_len):
        raise ValueError(f"lengths must lie in [0, max_len={max_len}] (the cache's positions), got min "
                         f"{lengths.min()} and max {lengths.max()}")
    return np.ascontiguousarray(lengths, dtype=np.int32)
