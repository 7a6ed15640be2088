"""Decode attention over a host KV cache (hybridjit.ops.cpu_attention) against float64 numpy references.

The references are computed from the definitions, in float64, on the cache as the kernels see it: a bfloat16
cache is widened to float64 exactly (every bfloat16 is a float64), so that what remains for both cache dtypes is
the kernels' float32 arithmetic (float32 dot products over up to 576 terms, an exp to ~1 ulp, sums over a few
hundred positions). That stays within

    |out - ref| <= ATOL + RTOL * |ref|,  RTOL = 2e-5, ATOL = 2e-6

with queries, keys and values of unit scale and scale = 1 / sqrt(key dim) (measured: at most ~1.3e-6 absolute,
under 30% of the bound; rounding the queries or probabilities to bfloat16 would cost ~1e-3). Both kernel families
run here where the host has them: generic (portable C++) and avx512 (the amx family runs the same AVX-512
attention kernels).
Shapes cover query heads per KV head 1, 3 (padded to 4), 4, 8 and 20 (a group of 16 and one of 4), head dims
that are not multiples of 16, cache lengths 0, 1, full and ragged, lengths not multiples of any block (32 GQA
positions, 16 MLA), and caches long enough to be split into chunks whose partial softmaxes are merged (a task
takes at least 256 positions, and a call with fewer than 4 tasks per pool thread splits rows beyond that); GQA also
with gpt-oss's attention sinks, which join each head's softmax in that merge.
"""

import ml_dtypes
import numpy as np
import pytest
from kernel_choice import kernel_family

import hybridjit_ffi as _ffi
from hybridjit.ops.cpu_attention import gqa_decode, mla_decode
from hybridjit.ops.routed_experts import kernel_info

RTOL = 2e-5
ATOL = 2e-6
BF16 = np.dtype(ml_dtypes.bfloat16)
FAMILIES = [f for f in ("generic", "avx512") if f in kernel_info()["supported"]]
CACHE_DTYPES = [np.dtype(np.float32), BF16]


def softmax_rows(scores):
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    return weights / weights.sum(axis=-1, keepdims=True)


def gqa_reference(q, k, v, lengths, scale, sinks=None):
    """With sinks [heads]: each head's softmax over its scores and its sink, the sink's share dropped."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, heads, head_dim = q.shape
    per_kv_head = heads // k.shape[2]
    out = np.zeros((batch, heads, head_dim))
    for i, n in enumerate(lengths):
        if n:
            keys = np.repeat(k[i, :n], per_kv_head, axis=1)  # [n, heads, head_dim]: query head j reads j // per_kv_head
            values = np.repeat(v[i, :n], per_kv_head, axis=1)
            scores = scale * np.einsum("he,she->hs", q[i], keys)
            if sinks is not None:
                scores = np.concatenate([scores, np.asarray(sinks, np.float64)[:, None]], axis=1)
            weights = softmax_rows(scores)[:, :n]
            out[i] = np.einsum("hs,she->he", weights, values)
    return out


def mla_reference(q_latent, q_rope, latent, k_rope, lengths, scale):
    q_latent, q_rope, latent, k_rope = (np.asarray(x, np.float64) for x in (q_latent, q_rope, latent, k_rope))
    out = np.zeros(q_latent.shape)
    for i, n in enumerate(lengths):
        if n:
            weights = softmax_rows(scale * (q_latent[i] @ latent[i, :n].T + q_rope[i] @ k_rope[i, :n].T))
            out[i] = weights @ latent[i, :n]
    return out


def random_lengths(rng, spec, max_len):
    """spec: a list of lengths, or "ragged" for 0, 1, max_len and random ones in between."""
    if spec != "ragged":
        return np.array(spec, np.int32)
    return np.array([0, 1, max_len, *rng.integers(2, max_len, 3)], np.int32)


# (heads, kv_heads, head_dim, max_len, lengths)
GQA_CASES = [
    pytest.param(8, 8, 128, 300, [300], id="mha-b1-full"),
    pytest.param(16, 4, 128, 77, "ragged", id="group4-ragged"),
    pytest.param(32, 4, 64, 200, [200, 199, 57], id="group8-ragged"),
    pytest.param(8, 1, 64, 1000, [1000], id="group8-b1-chunked"),  # > 256 positions a task on any pool: chunks
    pytest.param(6, 2, 40, 50, [50, 1, 0], id="group3-dim40"),
    pytest.param(40, 2, 32, 33, [33], id="group20-b1"),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("heads, kv_heads, head_dim, max_len, lengths", GQA_CASES)
def test_gqa_matches_float64_reference(family, cache_dtype, heads, kv_heads, head_dim, max_len, lengths):
    rng = np.random.default_rng(heads * 1000 + max_len)
    lengths = random_lengths(rng, lengths, max_len)
    batch = len(lengths)
    q = rng.standard_normal((batch, heads, head_dim), np.float32)
    k = rng.standard_normal((batch, max_len, kv_heads, head_dim), np.float32).astype(cache_dtype)
    v = rng.standard_normal((batch, max_len, kv_heads, head_dim), np.float32).astype(cache_dtype)
    scale = head_dim**-0.5
    with kernel_family(family):
        out = gqa_decode(q, k, v, lengths, scale)
    assert out.dtype == np.float32 and out.shape == (batch, heads, head_dim)
    np.testing.assert_allclose(out, gqa_reference(q, k, v, lengths, scale), rtol=RTOL, atol=ATOL)
    assert not out[lengths == 0].any(), "rows of length 0 must be zeros"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("heads, kv_heads, head_dim, max_len, lengths", [GQA_CASES[1], GQA_CASES[3], GQA_CASES[5]])
def test_gqa_with_sinks_matches_float64_reference(family, cache_dtype, heads, kv_heads, head_dim, max_len, lengths):
    """gpt-oss's attention sinks: a logit per head that takes its share of each softmax, with no value. Sinks of
    the scores' scale (some above every score, some below), in groups of one chunk and of several merged."""
    rng = np.random.default_rng(heads * 1000 + max_len + 1)
    lengths = random_lengths(rng, lengths, max_len)
    batch = len(lengths)
    q = rng.standard_normal((batch, heads, head_dim), np.float32)
    k = rng.standard_normal((batch, max_len, kv_heads, head_dim), np.float32).astype(cache_dtype)
    v = rng.standard_normal((batch, max_len, kv_heads, head_dim), np.float32).astype(cache_dtype)
    sinks = (3 * rng.standard_normal(heads)).astype(np.float32)
    scale = head_dim**-0.5
    with kernel_family(family):
        out = gqa_decode(q, k, v, lengths, scale, sinks)
    expected = gqa_reference(q, k, v, lengths, scale, sinks)
    np.testing.assert_allclose(out, expected, rtol=RTOL, atol=ATOL)
    assert np.abs(expected - gqa_reference(q, k, v, lengths, scale)).max() > 100 * ATOL  # the sinks weigh
    assert not out[lengths == 0].any(), "rows of length 0 must be zeros"


# (heads, rank, rope_dim, max_len, lengths)
MLA_CASES = [
    pytest.param(16, 64, 16, 100, [100, 0], id="small"),
    pytest.param(16, 64, 16, 67, "ragged", id="small-ragged"),
    pytest.param(20, 72, 8, 333, [333, 300], id="heads20-rank72-chunked"),  # chunks on any pool, as above
    pytest.param(128, 512, 64, 300, [300], id="deepseek-v3-b1"),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("heads, rank, rope_dim, max_len, lengths", MLA_CASES)
def test_mla_matches_float64_reference(family, cache_dtype, heads, rank, rope_dim, max_len, lengths):
    rng = np.random.default_rng(heads * 1000 + max_len)
    lengths = random_lengths(rng, lengths, max_len)
    batch = len(lengths)
    q_latent = rng.standard_normal((batch, heads, rank), np.float32)
    q_rope = rng.standard_normal((batch, heads, rope_dim), np.float32)
    latent = rng.standard_normal((batch, max_len, rank), np.float32).astype(cache_dtype)
    k_rope = rng.standard_normal((batch, max_len, rope_dim), np.float32).astype(cache_dtype)
    scale = (rank + rope_dim) ** -0.5
    with kernel_family(family):
        out = mla_decode(q_latent, q_rope, latent, k_rope, lengths, scale)
    assert out.dtype == np.float32 and out.shape == (batch, heads, rank)
    reference = mla_reference(q_latent, q_rope, latent, k_rope, lengths, scale)
    np.testing.assert_allclose(out, reference, rtol=RTOL, atol=ATOL)
    assert not out[lengths == 0].any(), "rows of length 0 must be zeros"


def test_softmax_is_shift_invariant_at_large_scores():
    """Scores near 1000: exp() of them overflows float32 (beyond ~88), so the kernels must subtract the running
    max. Adding the same large amount to every score of a row must not change the output, up to the rounding of
    the scores themselves (float32 spacing near 1000 is 6e-5, hence the looser tolerance)."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 4, 32), np.float32)
    k = rng.standard_normal((1, 200, 1, 32), np.float32)
    v = rng.standard_normal((1, 200, 1, 32), np.float32)
    q[..., 0] = 1.0
    shifted_k = k.copy()
    shifted_k[..., 0] += 1000.0  # every score of every head + 1000
    for family in FAMILIES:
        with kernel_family(family):
            base = gqa_decode(q, k, v, [200], 1.0)
            shifted = gqa_decode(q, shifted_k, v, [200], 1.0)
        assert np.isfinite(shifted).all()
        np.testing.assert_allclose(shifted, base, rtol=1e-3, atol=1e-4)


def gqa_arrays(batch=2, heads=8, kv_heads=2, head_dim=16, max_len=10, dtype=np.float32):
    q = np.zeros((batch, heads, head_dim), np.float32)
    k = np.zeros((batch, max_len, kv_heads, head_dim), dtype)
    return q, k, k.copy(), np.full(batch, max_len, np.int32)


def mla_arrays(batch=2, heads=4, rank=16, rope_dim=8, max_len=10, dtype=np.float32):
    return (np.zeros((batch, heads, rank), np.float32), np.zeros((batch, heads, rope_dim), np.float32),
            np.zeros((batch, max_len, rank), dtype), np.zeros((batch, max_len, rope_dim), dtype),
            np.full(batch, max_len, np.int32))


@pytest.mark.parametrize("change, error, match", [
    (lambda a: {"q": np.zeros((2, 6, 16), np.float32), "k": np.zeros((2, 10, 4, 16), np.float32),
                "v": np.zeros((2, 10, 4, 16), np.float32)}, ValueError, "multiple of k's kv_heads"),
    (lambda a: {"lengths": [10, 11]}, ValueError, "lengths must lie in"),
    (lambda a: {"lengths": [-1, 3]}, ValueError, "lengths must lie in"),
    (lambda a: {"lengths": [3]}, ValueError, "lengths has shape"),
    (lambda a: {"lengths": [3.0, 2.0]}, TypeError, "lengths must hold integers"),
    (lambda a: {"k": a["k"].astype(np.float16)}, TypeError, "k must be float32 or bfloat16"),
    (lambda a: {"v": a["v"].astype(BF16)}, TypeError, "v has dtype bfloat16 but k has float32"),
    (lambda a: {"k": np.zeros((2, 10, 2, 8), np.float32), "v": np.zeros((2, 10, 2, 8), np.float32)},
     ValueError, "k has shape"),
    (lambda a: {"v": np.zeros((2, 9, 2, 16), np.float32)}, ValueError, "v has shape"),
    (lambda a: {"k": np.zeros((2, 10, 2, 32), np.float32)[..., ::2]}, ValueError, "k must be C-contiguous"),
    (lambda a: {"q": np.zeros((2, 8), np.float32)}, ValueError, "q must have 3 dimensions"),
    (lambda a: {"q": np.zeros((2, 8, 16), np.int32)}, TypeError, "q must hold floats"),
])
def test_gqa_argument_errors(change, error, match):
    q, k, v, lengths = gqa_arrays()
    args = {"q": q, "k": k, "v": v, "lengths": lengths}
    args.update(change(args))
    with pytest.raises(error, match=match):
        gqa_decode(args["q"], args["k"], args["v"], args["lengths"], 1.0)


@pytest.mark.parametrize("change, error, match", [
    (lambda a: {"k_rope": a["k_rope"].astype(BF16)}, TypeError, "k_rope has dtype bfloat16 but latent has float32"),
    (lambda a: {"latent": a["latent"].astype(np.float64)}, TypeError, "latent must be float32 or bfloat16"),
    (lambda a: {"latent": np.zeros((2, 10, 12), np.float32)}, ValueError, "latent has shape"),
    (lambda a: {"k_rope": np.zeros((2, 11, 8), np.float32)}, ValueError, "k_rope has shape"),
    (lambda a: {"q_rope": np.zeros((2, 5, 8), np.float32)}, ValueError, "q_rope has shape"),
    (lambda a: {"lengths": [0, 12]}, ValueError, "lengths must lie in"),
    (lambda a: {"latent": np.zeros((2, 20, 16), np.float32)[:, ::2]}, ValueError, "latent must be C-contiguous"),
])
def test_mla_argument_errors(change, error, match):
    q_latent, q_rope, latent, k_rope, lengths = mla_arrays()
    args = {"q_latent": q_latent, "q_rope": q_rope, "latent": latent, "k_rope": k_rope, "lengths": lengths}
    args.update(change(args))
    with pytest.raises(error, match=match):
        mla_decode(args["q_latent"], args["q_rope"], args["latent"], args["k_rope"], args["lengths"], 1.0)


def test_extension_checks_its_arguments():
    """The extension checks what it indexes by itself, whoever calls it: its errors name the argument."""
    q, k, v, lengths = gqa_arrays()
    out = np.zeros(q.shape, np.float32)
    none = np.empty(0, np.float32)  # no sinks
    _ffi.cpu_attention_gqa(q, k, v, lengths, 1.0, none, out)  # the baseline call is accepted
    with pytest.raises(TypeError, match="out must be float32"):
        _ffi.cpu_attention_gqa(q, k, v, lengths, 1.0, none, out.astype(np.float64))
    with pytest.raises(ValueError, match=r"out has shape \(2, 8, 8\), expected \(2, 8, 16\)"):
        _ffi.cpu_attention_gqa(q, k, v, lengths, 1.0, none, np.zeros((2, 8, 8), np.float32))
    with pytest.raises(ValueError, match="q must be C-contiguous"):
        _ffi.cpu_attention_gqa(np.zeros((2, 8, 32), np.float32)[..., ::2], k, v, lengths, 1.0, none, out)
    with pytest.raises(TypeError, match="v must have k's dtype"):
        _ffi.cpu_attention_gqa(q, k, v.astype(BF16).view(np.uint16), lengths, 1.0, none, out)
    with pytest.raises(TypeError, match="lengths must be int32"):
        _ffi.cpu_attention_gqa(q, k, v, lengths.astype(np.int64), 1.0, none, out)
    with pytest.raises(ValueError, match=r"lengths\[1\] = 11 is outside \[0, 10\]"):
        _ffi.cpu_attention_gqa(q, k, v, np.array([10, 11], np.int32), 1.0, none, out)
    with pytest.raises(ValueError, match=r"sinks has shape \(4,\), expected \(8,\)"):
        _ffi.cpu_attention_gqa(q, k, v, lengths, 1.0, np.zeros(4, np.float32), out)
    with pytest.raises(TypeError, match="sinks must be float32"):
        _ffi.cpu_attention_gqa(q, k, v, lengths, 1.0, np.zeros(8, np.float64), out)
    q_latent, q_rope, latent, k_rope, lengths = mla_arrays()
    out = np.zeros(q_latent.shape, np.float32)
    with pytest.raises(ValueError, match=r"k_rope has shape \(2, 10, 4\), expected \(2, 10, 8\)"):
        _ffi.cpu_attention_mla(q_latent, q_rope, latent, k_rope[..., :4].copy(), lengths, 1.0, out)
    with pytest.raises(ValueError, match=r"lengths\[0\] = -1 is outside"):
        _ffi.cpu_attention_mla(q_latent, q_rope, latent, k_rope, np.array([-1, 0], np.int32), 1.0, out)
