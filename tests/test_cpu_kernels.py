"""The CPU expert kernels: every family x weight format x shape class against float64 numpy references.

The references are written here, from the formats' definitions (ffi/weight_bank.h), independently of the
C++: weights are dequantized in float64, and the rounding a kernel applies to what it multiplies (bfloat16
activations for vdpbf16ps and AMX, int8 activations for the integer kernels, bfloat16 weights where AMX
dequantizes to tiles) is applied to the float64 activations, so that what remains is float32 accumulation.
Families the host cannot run are skipped here and run on the AVX-512/AMX machine.
"""

import json
import os
import subprocess
import sys
import threading
import zlib
from functools import partial
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from kernel_choice import kernel_family

import hybridjit_ffi as _ffi
from hybridjit.ops.routed_experts import (
    configure_threads,
    kernel_info,
    layer_kernel,
    pool_of,
    register_layer,
    routed_experts,
    routed_experts_host,
    set_cpu_kernel,
    set_prefetch_bytes,
)

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)

# Relative RMS error ||y - y_ref|| / ||y_ref|| against the float64 reference of the kernel's arithmetic (one
# table for every kernel and format), keyed by the activations' precision:
#   f32   float32 activations, exact weights: float32 accumulation over a few hundred terms (~2e-7).
#   bf16  activations rounded to bfloat16, as the reference does too: float32 accumulation (~2e-7), plus the
#         occasional intermediate silu(g) * u that float32 and float64 round to neighbouring bfloat16 values
#         (one costs up to ~5e-4 here). Unemulated, the bfloat16 rounding alone would be ~2e-3.
#   int8  activations quantized to int8 per group, as the reference does too: exact integer dots (~1e-7),
#         plus the occasional intermediate on the other side of a rounding boundary (one costs up to ~5e-4).
#         Unemulated, the quantization alone would be ~2e-2.
#   int15 activations quantized per group to 15-bit integers (|q| <= 127 * 128, two int8 halves: AVX-512 on
#         mxfp4), as the reference does too: exact integer dots (~2e-7), plus intermediates on the other side of
#         a rounding boundary (up to ~1e-5 here). Unemulated, the quantization alone would be ~1e-4.
# A bfloat16 result adds its own rounding, at most 2^-8 relative.
TOLERANCE = {"f32": 1e-5, "bf16": 1e-3, "int8": 2e-3, "int15": 3e-5}
BF16_OUTPUT = 2.0**-8

FAMILIES = ("generic", "avx2", "avx512", "amx")
SUPPORTED = kernel_info()["supported"]
FP8_NAN_BYTES = (0x7F, 0xFF)
FP8_POOLS = {
    "all": np.array([b for b in range(256) if b not in FP8_NAN_BYTES], np.uint8),
    # exponent fields 0 and 1 only: denormals (zeros included) and the smallest normals dominate
    "subnormal": np.array([b for b in range(256) if (b >> 3) & 0xF in (0, 1)], np.uint8),
}


def host_has(family):
    return pytest.mark.skipif(
        family not in SUPPORTED,
        reason=f"this host cannot run the {family} kernels (CPUID/XCR0); they run on the AVX-512/AMX machine",
    )


FAMILY_PARAMS = [pytest.param(f, marks=host_has(f)) for f in FAMILIES]


# --- the formats, from their definitions ------------------------------------------------------------------


def unpack_int4(packed: np.ndarray, cols: int) -> np.ndarray:
    """uint8 [rows, ceil(cols / 2)] -> int q [rows, cols]: element 2j is the low nibble of byte j, stored q + 8."""
    nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(len(packed), -1)[:, :cols]
    return nibbles.astype(np.int64) - 8


# e2m1 (the OCP MX spec's FP4): bit 3 the sign, bits 0-2 index these magnitudes.
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def decode_e2m1(packed: np.ndarray, cols: int) -> np.ndarray:
    """uint8 [rows, cols / 2] -> float64 [rows, cols]: element 2j is the low nibble of byte j."""
    nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(len(packed), -1)[:, :cols]
    return np.where(nibbles & 8, -1.0, 1.0) * E2M1_MAGNITUDES[nibbles & 7]


def dequantize(fmt, stored, scale, block, shape) -> np.ndarray:
    rows, cols = shape
    if fmt == "mxfp4":  # e8m0 scales: 2^(s - 127), one per 32 elements of a row
        return decode_e2m1(stored, cols) * np.repeat(2.0 ** (scale.astype(np.float64) - 127), 32, axis=1)
    if fmt == "int4":
        q = unpack_int4(stored, cols).astype(np.float64)
    else:
        q = stored.astype(np.float64)
    if scale is None:
        return q
    grid = np.kron(scale.astype(np.float64), np.ones(block))
    return q * grid[:rows, :cols]


def random_matrix(rng, fmt, shape, block, pool="all"):
    """(stored array, float32 scales or None, float64 dequantized) with unit-order outputs."""
    rows, cols = shape
    if fmt in ("f32", "bf16"):
        w = (rng.standard_normal(shape) / np.sqrt(cols)).astype(np.float32 if fmt == "f32" else BF16)
        return w, None, w.astype(np.float64)
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if fmt == "fp8":
        stored = rng.choice(FP8_POOLS[pool], size=shape).view(FP8)
        rms = np.sqrt(np.mean(stored.astype(np.float64) ** 2))
    elif fmt == "int8":
        stored = rng.integers(-127, 128, size=shape).astype(np.int8)
        rms = 73.0
    elif fmt == "mxfp4":  # any byte, e8m0 exponents around the unit-output scale
        stored = rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8)
        exponent = 127 + round(np.log2(1 / (2.93 * np.sqrt(cols))))  # 2.93: the RMS of the e2m1 values
        scale = rng.integers(exponent - 1, exponent + 2, size=grid).astype(np.uint8)
        return stored, scale, dequantize(fmt, stored, scale, block, shape)
    else:  # int4
        q = rng.integers(-8, 8, size=(rows, cols + cols % 2))
        q[:, cols:] = 0
        nibbles = (q + 8).astype(np.uint8)
        stored = np.ascontiguousarray(nibbles[:, 0::2] | (nibbles[:, 1::2] << 4))
        rms = 4.6
    scale = (rng.uniform(0.5, 2.0, size=grid) / rms / np.sqrt(cols)).astype(np.float32)
    return stored, scale, dequantize(fmt, stored, scale, block, shape)


def make_layer(rng, fmt, n_experts, hidden, inter, block, pool="all", edit=None):
    """(registered layer, float64 weights, the made matrices); `edit(made)` may change the stored weights
    first (the bank reads them once at registration, so they must not change afterwards)."""
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    made = {p: [random_matrix(rng, fmt, s, block, pool) for _ in range(n_experts)] for p, s in shapes.items()}
    if edit is not None:
        edit(made)
    scales = {f"{p}_scale": [m[1] for m in made[p]] for p in shapes} if made["gate"][0][1] is not None else {}
    layer = register_layer(*([m[0] for m in made[p]] for p in shapes), **scales, block=block)
    dense = {p: [m[2] for m in made[p]] for p in shapes}
    return layer, dense, made


# --- the reference ----------------------------------------------------------------------------------------


def round_bf16(a):
    return np.asarray(a, np.float64).astype(np.float32).astype(BF16).astype(np.float64)


def quantize_int8(a, group, levels=127):
    """The kernels' activation quantization per row and group to integers in [-levels, levels] (int8: 127), in
    their float32 arithmetic, dequantized."""
    a32 = np.asarray(a, np.float64).astype(np.float32)
    out = np.zeros(a32.shape, np.float64)
    for g in range(0, a32.shape[-1], group):
        part = a32[..., g : g + group]
        amax = np.max(np.abs(part), axis=-1, keepdims=True)
        safe = np.where(amax > 0, amax, np.float32(1))
        q = np.rint(part * (np.float32(levels) / safe))
        out[..., g : g + group] = np.where(amax > 0, q * (amax / np.float32(levels)), 0)
    return out


def glu(activation, g, u):
    """What joins gate and up (ffi/weight_bank.h): silu(g) * u, or gpt-oss's clamped SwiGLU."""
    if activation[0] == "silu":
        return g / (1.0 + np.exp(-g)) * u
    _, alpha, limit = activation
    g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    return (u + 1) * g / (1.0 + np.exp(-alpha * g))


def reference(x, ids, weights, dense, activations="f32", group=None, biases=None, activation=("silu",)):
    """float64 routed experts on float64 weights, with the kernel's rounding of its activations; biases: float64
    {"gate", "up", "down"} lists per expert, added to each projection's output."""
    prepare = {
        "f32": lambda a: np.asarray(a, np.float64),
        "bf16": round_bf16,
        "int8": partial(quantize_int8, group=group),
        "int15": partial(quantize_int8, group=group, levels=127 * 128),
    }[activations]
    xin = prepare(np.asarray(x).astype(np.float64))
    y = np.zeros(xin.shape)
    for t in range(len(xin)):
        for e, w in zip(np.asarray(ids)[t], np.asarray(weights, np.float64)[t], strict=True):
            g, u = dense["gate"][e] @ xin[t], dense["up"][e] @ xin[t]
            if biases is not None:
                g, u = g + biases["gate"][e], u + biases["up"][e]
            out = dense["down"][e] @ prepare(glu(activation, g, u)[None])[0]
            y[t] += w * (out if biases is None else out + biases["down"][e])
    return y


def arithmetic(kernel, fmt):
    """(activation precision, whether the weights are rounded to bfloat16) of a kernel on a format."""
    if kernel == "amx_bf16":
        return "bf16", fmt not in ("bf16", "f32")
    if kernel == "amx_fp8g":  # exact weights, scaled per block after the bfloat16 products
        return "bf16", False
    if fmt in ("int8", "int4"):
        return "int8", False
    if (fmt, kernel) == ("mxfp4", "avx512"):
        return "int15", False
    return ("bf16" if kernel == "avx512" else "f32"), False


def relative_rms(y, y_ref):
    return float(np.linalg.norm(np.asarray(y, np.float64) - y_ref) / np.linalg.norm(y_ref))


def routing(rng, tokens, top_k, n_experts):
    """Random routing that leaves the last expert unused and routes token 0 to expert 1 twice."""
    ids = np.stack([rng.permutation(n_experts - 1)[:top_k] for _ in range(tokens)]).astype(np.int32)
    ids[0, :2] = 1
    weights = rng.uniform(0.1, 1.0, size=(tokens, top_k)).astype(np.float32)
    return ids, weights


def check_layer(layer, dense, fmt, block, x, ids, weights, tokens_per_expert, run=routed_experts_host):
    """Runs the layer and checks it against the reference of the kernel that ran it; returns the error."""
    kernel = layer_kernel(layer, tokens_per_expert)
    activations, round_weights = arithmetic(kernel, fmt)
    if round_weights:
        dense = {p: [round_bf16(w) for w in ws] for p, ws in dense.items()}
    y = np.asarray(run(layer, x, ids, weights))
    assert y.dtype == x.dtype and y.shape == x.shape
    error = relative_rms(y, reference(x, ids, weights, dense, activations, block[1] if block else None))
    tolerance = TOLERANCE[activations] + (BF16_OUTPUT if x.dtype == BF16 else 0)
    assert error < tolerance, f"{kernel} on {fmt}: relative RMS error {error:.3g} >= {tolerance:.3g}"
    return error


# --- every family x format x shape class ------------------------------------------------------------------

FORMATS = [
    ("f32", None, "all"),
    ("bf16", None, "all"),
    ("fp8", (128, 128), "all"),
    ("fp8", (32, 32), "all"),
    ("fp8", (16, 48), "all"),  # not square, not a multiple of 32: chunks straddle blocks
    ("fp8", (32, 32), "subnormal"),
    ("int8", (1, 128), "all"),
    ("int8", (1, 1024), "all"),  # one scale per row: AMX keeps int8 tiles
    ("int4", (1, 128), "all"),
    ("int4", (1, 256), "all"),  # partial last groups, and groups of two 128-element chunks
]
# (hidden, inter): neither a multiple of 128 (partial scale blocks, odd int4 rows); multiples; smaller
# than one block.
SHAPES = [(200, 137), (256, 128), (72, 40)]


@pytest.mark.parametrize("tokens", [1, 5, 40])
@pytest.mark.parametrize("hidden, inter", SHAPES)
@pytest.mark.parametrize("fmt, block, pool", FORMATS, ids=lambda v: str(v))
@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_matches_float64_reference(family, fmt, block, pool, hidden, inter, tokens):
    rng = np.random.default_rng(zlib.crc32(repr((fmt, block, pool, hidden, inter, tokens)).encode()))
    n_experts, top_k = 6, 3
    layer, dense, _ = make_layer(rng, fmt, n_experts, hidden, inter, block, pool)
    with layer, kernel_family(family):
        x = rng.standard_normal((tokens, hidden)).astype(np.float32)
        ids, weights = routing(rng, tokens, top_k, n_experts)
        check_layer(layer, dense, fmt, block, x, ids, weights, tokens)


# The group-rescaling AMX kernels (grouped int8/int4 as amx_int8g, block-scaled FP8 as amx_fp8g) at sizes that take
# their blocking apart: several 128-row strips and 512-element k-chunks, a group longer than a chunk (1024), groups
# that do not divide a chunk (384), rows whose last group and last k-step are partial (1100; 300 with FP8's 64-code
# loads), row blocks smaller than a strip (fp8 (32, 256), (64, 384)), and more tokens per expert than two 16-token
# tiles.
@pytest.mark.parametrize(
    "fmt, block, amx_kernel",
    [
        ("int8", (1, 128), "amx_int8g"),
        ("int4", (1, 128), "amx_int8g"),
        ("int8", (1, 384), "amx_int8g"),
        ("int4", (1, 1024), "amx_int8g"),
        ("fp8", (128, 128), "amx_fp8g"),
        ("fp8", (32, 256), "amx_fp8g"),
        ("fp8", (64, 384), "amx_fp8g"),
        ("fp8", (32, 32), "amx_bf16"),  # blocks narrower than 128 keep the per-weight scaling
    ],
)
@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_group_rescaling_kernels_at_blocking_sizes(family, fmt, block, amx_kernel):
    rng = np.random.default_rng(zlib.crc32(repr((fmt, block)).encode()))
    hidden, inter, tokens = 1100, 300, 150
    layer, dense, _ = make_layer(rng, fmt, 4, hidden, inter, block)
    with layer, kernel_family(family):
        x = rng.standard_normal((tokens, hidden)).astype(np.float32)
        ids, weights = routing(rng, tokens, 2, 4)
        if family == "amx":
            assert layer_kernel(layer, tokens) == amx_kernel
        check_layer(layer, dense, fmt, block, x, ids, weights, tokens)


# Every family against the generic kernel on the same call, by relative RMS difference. Where both quantize the
# activations to int8 the same way, only float32 summation order (and the rare intermediate on the other side
# of a rounding boundary) separates them: the int8 tolerance. Where a family rounds to bfloat16 and generic
# does not, the difference is that rounding (~2e-3, see TOLERANCE): 1e-2, still far below what a wrong tile,
# scale or group gives (order 1).
@pytest.mark.parametrize("fmt, block", [("bf16", None), ("fp8", (128, 128)), ("int8", (1, 128)), ("int4", (1, 256))])
@pytest.mark.parametrize("family", [pytest.param(f, marks=host_has(f)) for f in FAMILIES if f != "generic"])
def test_every_family_agrees_with_generic(family, fmt, block):
    rng = np.random.default_rng(zlib.crc32(repr((family, fmt, block)).encode()))
    layer, _, _ = make_layer(rng, fmt, 4, 520, 300, block)
    x = rng.standard_normal((70, 520)).astype(np.float32)
    ids, weights = routing(rng, 70, 2, 4)
    with layer:
        with kernel_family("generic"):
            y_generic = routed_experts_host(layer, x, ids, weights)
        with kernel_family(family):
            kernel = layer_kernel(layer, 70)
            y = routed_experts_host(layer, x, ids, weights)
    same_activations = fmt in ("int8", "int4") and kernel != "amx_bf16"
    tolerance = TOLERANCE["int8"] if same_activations else 1e-2
    error = relative_rms(y, np.asarray(y_generic, np.float64))
    assert error < tolerance, f"{kernel} on {fmt} vs generic: relative RMS {error:.3g} >= {tolerance:.3g}"


@pytest.mark.parametrize("tokens", [1, 40])
@pytest.mark.parametrize("fmt, block", [("fp8", (16, 48)), ("int8", (1, 128)), ("int4", (1, 256))])
@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_scales_are_read_only_within_the_matrix(family, fmt, block, tokens):
    """Each scale grid is followed in memory by NaN: a kernel that reads a scale for the lanes past a row's
    end (the last block of a row may end before its last SIMD step) turns zero weights into NaN."""
    rng = np.random.default_rng(3)

    def nan_after_scales(made):
        for matrices in made.values():
            for i, (stored, scale, dense) in enumerate(matrices):
                padded = np.full((scale.shape[0] + 1, scale.shape[1]), np.nan, np.float32)
                padded[:-1] = scale
                matrices[i] = (stored, padded[:-1], dense)

    layer, dense, _ = make_layer(rng, fmt, 6, 200, 137, block, edit=nan_after_scales)
    with layer, kernel_family(family):
        x = rng.standard_normal((tokens, 200)).astype(np.float32)
        ids, weights = routing(rng, tokens, 3, 6)
        check_layer(layer, dense, fmt, block, x, ids, weights, tokens)


@pytest.mark.parametrize("fmt, block", [("bf16", None), ("fp8", (128, 128)), ("int8", (1, 128)), ("int4", (1, 128))])
@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_bfloat16_activations_through_xla(family, fmt, block):
    """The custom call in a jitted graph takes the same kernels, with bfloat16 in and out."""
    rng = np.random.default_rng(1)
    layer, dense, _ = make_layer(rng, fmt, 5, 200, 136, block)
    with layer, kernel_family(family):
        x = rng.standard_normal((9, 200)).astype(BF16)
        ids, weights = routing(rng, 9, 2, 5)

        def run(layer, x, ids, weights):
            with jax.default_device(jax.devices("cpu")[0]):  # the synchronous custom call is the CPU's
                return jax.jit(partial(routed_experts, layer=layer.id))(x, ids, weights)

        check_layer(layer, dense, fmt, block, x, ids, weights, 9, run=run)


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_fp8_denormals_and_tiny_products_are_kept(family):
    """Weights drawn from FP8 denormals and activations ~1e-12 (products ~1e-30): a kernel that flushed
    bfloat16 or float32 denormals (the unbiased FP8-to-bfloat16 shift under vdpbf16ps) would lose them."""
    rng = np.random.default_rng(2)
    layer, dense, _ = make_layer(rng, "fp8", 4, 256, 128, (128, 128), pool="subnormal")
    with layer, kernel_family(family):
        x = (rng.standard_normal((3, 256)) * 1e-12).astype(np.float32)
        ids, weights = routing(rng, 3, 2, 4)
        check_layer(layer, dense, "fp8", (128, 128), x, ids, weights, 3)


@pytest.mark.parametrize("family", FAMILY_PARAMS)
@pytest.mark.parametrize("tokens", [1, 40])
def test_fp8_nan_reaches_only_the_tokens_of_its_expert(family, tokens):
    rng = np.random.default_rng(3)

    def nan_in_expert_2(made):
        made["gate"][2][0].view(np.uint8)[5, 7] = 0x7F

    layer, _, _ = make_layer(rng, "fp8", 3, 256, 128, (32, 32), edit=nan_in_expert_2)
    with layer, kernel_family(family):
        x = rng.standard_normal((tokens, 256)).astype(np.float32)
        ids = np.tile(np.array([[0, 1], [2, 0], [1, 0], [1, 2]], np.int32), (tokens, 1))[:tokens]
        y = routed_experts_host(layer, x, ids, np.ones(ids.shape, np.float32))
        np.testing.assert_array_equal(np.isnan(y).all(axis=1), (ids == 2).any(axis=1))


# --- selection ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_override_forces_each_family(family):
    expected = {"generic": "generic", "avx2": "avx2", "avx512": "avx512", "amx": "amx_fp8g"}[family]
    layer, _, _ = make_layer(np.random.default_rng(4), "fp8", 2, 128, 128, (128, 128))
    with layer, kernel_family(family):
        assert kernel_info()["kernel"] == family
        assert layer_kernel(layer, 1) == expected
        assert kernel_info()["formats"]["fp8"]["few_tokens"] == expected


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_prefetch_distance_changes_no_bit(family):
    """Software prefetch is only a hint: every distance (and none) gives the same bits, also where prefetches
    run past a row, a matrix or an expert."""
    rng = np.random.default_rng(7)
    for fmt, block in [("bf16", None), ("fp8", (128, 128)), ("int8", (1, 128)), ("int4", (1, 128))]:
        layer, _, _ = make_layer(rng, fmt, 3, 200, 137, block)
        x = rng.standard_normal((2, 200)).astype(np.float32)
        ids, weights = routing(rng, 2, 2, 3)
        with layer, kernel_family(family):
            try:
                results = []
                for distance in (0, 64, 4096, None):
                    set_prefetch_bytes(distance)
                    results.append(routed_experts_host(layer, x, ids, weights))
            finally:
                set_prefetch_bytes(None)
        for y in results[1:]:
            np.testing.assert_array_equal(y, results[0])


def test_kernel_info_reports_the_prefetch_distance_in_effect():
    """The override while set; otherwise the default measured best for the host's vendor (weight_prefetch.h)."""
    with open("/proc/cpuinfo") as f:
        amd = "AuthenticAMD" in f.read()
    try:
        set_prefetch_bytes(512)
        assert kernel_info()["prefetch_bytes"] == 512
        set_prefetch_bytes(0)
        assert kernel_info()["prefetch_bytes"] == 0
    finally:
        set_prefetch_bytes(None)
    assert kernel_info()["prefetch_bytes"] == (1024 if amd else 2048)


def test_f32_weights_use_the_fma_kernel_above_avx2():
    layer, _, _ = make_layer(np.random.default_rng(5), "f32", 2, 64, 32, None)
    with layer:
        kernel = layer_kernel(layer, 100)
        assert kernel == ("generic" if kernel_info()["kernel"] == "generic" else "avx2")


@pytest.mark.skipif("amx" not in SUPPORTED, reason="this host has no AMX; the switch runs on the AMX machine")
def test_amx_takes_over_from_avx512_by_tokens_per_expert():
    rng = np.random.default_rng(6)
    layers = {
        (fmt, block): make_layer(rng, fmt, 2, 256, 128, block)[0]
        for fmt, block in [("bf16", None), ("fp8", (128, 128)), ("int8", (1, 128)), ("int8", (1, 256))]
    }
    layers["mxfp4", (1, 32)] = make_gpt_oss_layer(rng, "mxfp4", 2, 256, 128, False, False, ("silu",))[0]
    try:
        with kernel_family("amx", amx_min_tokens=16):  # one threshold for every layer
            assert [layer_kernel(layers["int8", (1, 128)], t) for t in (1, 15, 16, 512)] == [
                "avx512",
                "avx512",
                "amx_int8g",
                "amx_int8g",
            ]
            assert layer_kernel(layers["int8", (1, 256)], 16) == "amx_int8"
        with kernel_family("amx", amx_min_tokens=0):  # the measured crossover of each kind of layer
            for key, threshold, kernel in [
                (("bf16", None), 8, "amx_bf16"),
                (("fp8", (128, 128)), 10, "amx_fp8g"),
                (("int8", (1, 128)), 16, "amx_int8g"),
                (("int8", (1, 256)), 16, "amx_int8"),
                (("mxfp4", (1, 32)), 18, "amx_bf16"),
            ]:
                assert layer_kernel(layers[key], threshold - 1) == "avx512"
                assert layer_kernel(layers[key], threshold) == kernel
    finally:
        for layer in layers.values():
            layer.close()


def test_a_family_the_host_lacks_is_refused():
    missing = [f for f in FAMILIES if f not in SUPPORTED]
    if not missing:
        pytest.skip("this host runs every family")
    with pytest.raises(ValueError, match=f"CPU kernel '{missing[0]}' is not supported by this host"):
        set_cpu_kernel(missing[0])
    with pytest.raises(ValueError, match="unknown CPU kernel 'avx9'"):
        set_cpu_kernel("avx9")


def test_environment_overrides(tmp_path):
    # Run outside the repository, whose source tree would shadow the installed package (`-c` puts the
    # working directory first on sys.path).
    script = "import json; from hybridjit.ops.routed_experts import kernel_info; print(json.dumps(kernel_info()))"
    env = {**os.environ, "HYBRIDJIT_CPU_KERNEL": "generic", "HYBRIDJIT_THREADS": "3", "HYBRIDJIT_NUMA_NODES": "2"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout.strip().splitlines()[-1])
    assert (info["kernel"], info["threads"], info["numa_forced"]) == ("generic", 3, True)
    assert info["numa_nodes"] == min(2, len(os.sched_getaffinity(0)))
    env["HYBRIDJIT_CPU_KERNEL"] = "avx9"
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode != 0 and "unknown CPU kernel 'avx9'" in done.stderr


# --- the operator and its thread pool -----------------------------------------------------------------------


def test_forced_numa_nodes_slice_every_expert():
    """Two logical nodes on a one-node machine: each expert's rows are split per node, threads steal."""
    info = kernel_info()
    rng = np.random.default_rng(8)
    layer, dense, _ = make_layer(rng, "int8", 5, 256, 192, (1, 128))
    try:
        for threads in (1, 2, 3):
            configure_threads(threads, numa_nodes=2)
            assert kernel_info()["numa_forced"] and kernel_info()["threads"] == threads
            x = rng.standard_normal((6, 256)).astype(np.float32)
            ids, weights = routing(rng, 6, 3, 5)
            check_layer(layer, dense, "int8", (1, 128), x, ids, weights, 6)
    finally:
        configure_threads(info["threads"], info["numa_nodes"] if info["numa_forced"] else 0)
        layer.close()


def _single_cpu_threads() -> dict[int, int]:
    """Thread id -> CPU of each thread of this process pinned to exactly one (from /proc: no timing)."""
    pinned = {}
    for status in Path("/proc/self/task").glob("*/status"):
        allowed = next(
            line.split()[1] for line in status.read_text().splitlines() if line.startswith("Cpus_allowed_list")
        )
        if allowed.isdigit():
            pinned[int(status.parent.name)] = int(allowed)
    return pinned


def test_pool_workers_leave_the_submitter_cpu_free():
    """threads - 1 workers pinned one per CPU, none on submitter_cpu (where the GPU hand-off's worker pins
    itself); a pool with more threads than CPUs has no free CPU. Only the new pool's threads count: an
    older pool that a registered layer still holds keeps its (idle) workers where they were."""
    info = kernel_info()
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2:
        pytest.skip("on one CPU every thread is pinned to it")
    try:
        before = set(_single_cpu_threads())
        configure_threads(cpus, 0)
        free = kernel_info()["submitter_cpu"]
        assert free in os.sched_getaffinity(0)
        workers = [cpu for tid, cpu in _single_cpu_threads().items() if tid not in before]
        assert len(workers) == cpus - 1
        assert free not in workers
        assert set(os.sched_getaffinity(0)) - {free} == set(workers)
        configure_threads(cpus + 1, 0)
        assert kernel_info()["submitter_cpu"] == -1
    finally:
        configure_threads(info["threads"], info["numa_nodes"] if info["numa_forced"] else 0)


def test_skewed_prefill_load():
    """Most tokens on one expert, a few on the others (dynamic scheduling, largest first)."""
    rng = np.random.default_rng(9)
    layer, dense, _ = make_layer(rng, "bf16", 6, 200, 136, None)
    with layer:
        tokens = 70
        ids = np.stack([np.zeros(tokens, np.int32), rng.integers(1, 6, tokens).astype(np.int32)], axis=1)
        ids[:3, 0] = 4
        weights = rng.uniform(0.1, 1.0, size=ids.shape).astype(np.float32)
        x = rng.standard_normal((tokens, 200)).astype(np.float32)
        check_layer(layer, dense, "bf16", None, x, ids, weights, tokens)


@pytest.mark.parametrize("fmt, block", [("bf16", None), ("fp8", (128, 128)), ("int8", (1, 128))])
@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_one_experts_pack_shared_by_threads(family, fmt, block):
    """One expert with hundreds of tokens on a pool of 8: the kernels that pack in token ranges (AVX-512, AMX's
    bfloat16 tiles) share its activations' pack among the threads, part by part (300 tokens: parts that do not
    divide it, a last one shorter)."""
    rng = np.random.default_rng(10)
    layer, dense, _ = make_layer(rng, fmt, 3, 200, 136, block)
    with layer, kernel_family(family), pool_of(8):
        tokens = 300
        ids = np.zeros((tokens, 1), np.int32)
        weights = rng.uniform(0.1, 1.0, size=ids.shape).astype(np.float32)
        x = rng.standard_normal((tokens, 200)).astype(np.float32)
        check_layer(layer, dense, fmt, block, x, ids, weights, tokens)


def test_concurrent_calls_from_many_threads():
    """Callers from several threads at once (as XLA's and a GPU hand-off worker's): each caller works on its
    own job with the shared pool, and none waits on another."""
    rng = np.random.default_rng(10)
    layers = [make_layer(rng, fmt, 4, 128, 96, block) for fmt, block in [("fp8", (128, 128)), ("int4", (1, 128))]]
    x = rng.standard_normal((5, 128)).astype(np.float32)
    ids, weights = routing(rng, 5, 2, 4)
    expected = [routed_experts_host(layer, x, ids, weights) for layer, _, _ in layers]
    failures = []

    def work(i):
        layer = layers[i % 2][0]
        for _ in range(20):
            y = routed_experts_host(layer, x, ids, weights)
            if relative_rms(y, expected[i % 2].astype(np.float64)) > 1e-6:
                failures.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not failures
    for layer, _, _ in layers:
        layer.close()


def test_host_call_checks():
    layer, _, _ = make_layer(np.random.default_rng(11), "bf16", 3, 64, 32, None)
    with layer:
        x = np.zeros((2, 64), np.float32)
        with pytest.raises(RuntimeError, match="expert id 3 out of range"):
            routed_experts_host(layer, x, np.full((2, 1), 3, np.int32), np.ones((2, 1), np.float32))
        with pytest.raises(ValueError, match=r"x must be float32 or bfloat16 \[T, 64\]"):
            routed_experts_host(layer, x[:, :63], np.zeros((2, 1), np.int32), np.ones((2, 1), np.float32))
        assert routed_experts_host(layer, x[:0], np.zeros((0, 1), np.int32), np.ones((0, 1), np.float32)).shape == (
            0,
            64,
        )


def test_int_registration_checks_groups_and_packing():
    rng = np.random.default_rng(12)
    gate = [rng.integers(0, 256, (32, 100)).astype(np.uint8)]
    up = [rng.integers(0, 256, (32, 100)).astype(np.uint8)]
    down = [rng.integers(0, 256, (199, 16)).astype(np.uint8)]
    scales = {"gate_scale": [np.ones((32, 2), np.float32)], "up_scale": [np.ones((32, 2), np.float32)]}
    register_layer(gate, up, down, **scales, down_scale=[np.ones((199, 1), np.float32)]).close()
    with pytest.raises(ValueError, match=r"expert 0 gate_proj: shape \(32, 100\), expected \(32, 98\)"):
        register_layer(gate, up, [d[:196] for d in down], **scales, down_scale=[np.ones((196, 1), np.float32)])
    with pytest.raises(ValueError, match=r"block must be \(1, G\) with G a multiple of 128"):
        register_layer(gate, up, down, **scales, down_scale=[np.ones((199, 1), np.float32)], block=(1, 64))
    as_int8 = [rng.integers(-127, 128, shape).astype(np.int8) for shape in ((32, 100), (32, 100), (100, 32))]
    with pytest.raises(ValueError, match="int8 weights need block scales, gate_scale is missing"):
        register_layer(*([a] for a in as_int8))


def test_memory_bandwidth_is_measured():
    m = _ffi.memory_bandwidth(1 << 22, 2, 2)
    assert m["threads"] == 2 and m["bytes_per_array"] == 1 << 22
    assert m["read_gbps"] > 0.1 and m["triad_gbps"] > 0.1
    # The read floor is its best pattern's, and every pattern ran.
    assert m["read_gbps"] == max(m["read_by_pattern_gbps"].values()) == m["read_by_pattern_gbps"][m["read_pattern"]]
    assert min(m["read_by_pattern_gbps"].values()) > 0.1
    reader = _ffi.MemoryReader(1 << 20, 2)
    assert all(reader.read_gbps(pattern) > 0.1 for pattern in m["read_by_pattern_gbps"])
    with pytest.raises(ValueError, match="unknown read pattern 'fast'"):
        reader.read_gbps("fast")
    with pytest.raises(ValueError, match="bytes must be >= 4096"):
        _ffi.MemoryReader(100, 2)


# --- mxfp4, biases, the clamped SwiGLU, gate/up interleaved (gpt-oss) -----------------------------------------


def make_gpt_oss_layer(rng, fmt, n_experts, hidden, inter, interleaved, biased, activation):
    """(registered layer, float64 weights, float64 biases or None) with gate/up fused by interleaving rows as gpt-oss
    stores them (even rows gate, odd rows up) when `interleaved`. The reference gets the separate matrices."""
    block = (1, 32) if fmt == "mxfp4" else None
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    made = {p: [random_matrix(rng, fmt, s, block) for _ in range(n_experts)] for p, s in shapes.items()}
    dense = {p: [m[2] for m in made[p]] for p in shapes}
    bias = None
    if biased:
        bias = {p: [rng.standard_normal(s[0]).astype(np.float32) for _ in range(n_experts)] for p, s in shapes.items()}

    def interleave(a, b):
        out = np.empty((2 * len(a), *a.shape[1:]), a.dtype)
        out[0::2], out[1::2] = a, b
        return out

    def part(p, i):  # i: 0 the weights, 1 the scales
        return [m[i] for m in made[p]]

    scaled = fmt == "mxfp4"
    if interleaved:
        gate = [interleave(g, u) for g, u in zip(part("gate", 0), part("up", 0), strict=True)]
        scales = (
            dict(
                gate_scale=[interleave(g, u) for g, u in zip(part("gate", 1), part("up", 1), strict=True)],
                down_scale=part("down", 1),
            )
            if scaled
            else {}
        )
        biases = (
            ([interleave(g, u) for g, u in zip(bias["gate"], bias["up"], strict=True)], None, bias["down"])
            if biased
            else None
        )
        layer = register_layer(
            gate,
            None,
            part("down", 0),
            **scales,
            fmt="mxfp4" if scaled else None,
            gate_up_interleaved=True,
            biases=biases,
            activation=activation,
        )
    else:
        scales = {f"{p}_scale": part(p, 1) for p in shapes} if scaled else {}
        biases = (bias["gate"], bias["up"], bias["down"]) if biased else None
        layer = register_layer(
            part("gate", 0),
            part("up", 0),
            part("down", 0),
            **scales,
            fmt="mxfp4" if scaled else None,
            biases=biases,
            activation=activation,
        )
    return layer, dense, None if bias is None else {p: [b.astype(np.float64) for b in bs] for p, bs in bias.items()}


GPT_OSS_ACTIVATION = ("clamped_swiglu", 1.702, 1.5)  # a limit that clamps a good share of unit-order outputs


# (hidden, inter): whole 64-element steps; 160 and 96 end in half a step (one scale group of the last two); 672 and
# 544: a whole 512 elements (the AVX-512 kernel's scale vector of 16 groups), then 5 or 1 groups
@pytest.mark.parametrize("tokens", [1, 5, 40])
@pytest.mark.parametrize("hidden, inter", [(128, 64), (160, 96), (672, 544)])
@pytest.mark.parametrize(
    "interleaved, biased, activation",
    [
        (False, False, ("silu",)),
        (True, True, GPT_OSS_ACTIVATION),
    ],
)
@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_mxfp4_matches_float64_reference(family, hidden, inter, interleaved, biased, activation, tokens):
    rng = np.random.default_rng(zlib.crc32(repr((hidden, inter, interleaved, tokens)).encode()))
    n_experts, top_k = 6, 3
    layer, dense, biases = make_gpt_oss_layer(rng, "mxfp4", n_experts, hidden, inter, interleaved, biased, activation)
    with layer, kernel_family(family):
        x = rng.standard_normal((tokens, hidden)).astype(np.float32)
        ids, weights = routing(rng, tokens, top_k, n_experts)
        kernel = layer_kernel(layer, tokens)
        precision, _ = arithmetic(kernel, "mxfp4")
        y = routed_experts_host(layer, x, ids, weights)
        # AVX-512 quantizes the activations per e8m0 scale group (32 elements)
        y_ref = reference(x, ids, weights, dense, precision, group=32, biases=biases, activation=activation)
        assert relative_rms(y, y_ref) < TOLERANCE[precision], kernel


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_biases_and_clamped_swiglu_serve_any_format(family):
    """Biases, the activation and interleaved gate/up rows are per-layer options of every format, bf16 here."""
    rng = np.random.default_rng(21)
    layer, dense, biases = make_gpt_oss_layer(rng, "bf16", 6, 96, 64, True, True, GPT_OSS_ACTIVATION)
    with layer, kernel_family(family):
        x = rng.standard_normal((40, 96)).astype(np.float32)
        ids, weights = routing(rng, 40, 3, 6)
        precision, _ = arithmetic(layer_kernel(layer, 40), "bf16")
        y = routed_experts_host(layer, x, ids, weights)
        ref = partial(reference, x, ids, weights, dense, precision)
        assert relative_rms(y, ref(biases=biases, activation=GPT_OSS_ACTIVATION)) < TOLERANCE[precision]
        # each option matters: without the biases, or with plain SiLU, the reference is far off
        assert relative_rms(y, ref(activation=GPT_OSS_ACTIVATION)) > 0.05
        assert relative_rms(y, ref(biases=biases)) > 0.05


def test_mxfp4_registration_names_a_misshapen_tensor():
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 256, (128, 48), dtype=np.uint8)]  # [2 * inter, hidden / 2]: hidden 96, inter 64
    scales = [np.full((128, 3), 127, np.uint8)]
    down, down_scales = [rng.integers(0, 256, (96, 32), dtype=np.uint8)], [np.full((96, 2), 127, np.uint8)]
    common = dict(fmt="mxfp4", gate_up_interleaved=True)
    with pytest.raises(ValueError, match="expert 0 gate_up_proj scale: shape \\(128, 2\\), expected \\(128, 3\\)"):
        register_layer(blocks, None, down, gate_scale=[scales[0][:, :2].copy()], down_scale=down_scales, **common)
    with pytest.raises(ValueError, match="expert 0 down_proj: shape \\(96, 16\\), expected \\(96, 32\\)"):
        register_layer(blocks, None, [down[0][:, :16].copy()], gate_scale=scales, down_scale=down_scales, **common)
    with pytest.raises(ValueError, match="gate_up_proj scale: dtype float32, expected uint8"):
        register_layer(blocks, None, down, gate_scale=[scales[0].astype(np.float32)], down_scale=down_scales, **common)
    with pytest.raises(ValueError, match="multiples of 32"):
        register_layer(
            [blocks[0][:, :40].copy()], None, [down[0][:80].copy()], gate_scale=scales, down_scale=down_scales, **common
        )  # hidden 80
    with register_layer(blocks, None, down, gate_scale=scales, down_scale=down_scales, **common) as layer:
        assert layer.format == "mxfp4" and (layer.hidden, layer.inter) == (96, 64)


# --- int8 / int4 checkpoints ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    from checkpoint_factory import tiny_config, write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("bf16"), tiny_config("v3"), seed=7, weight_format="bf16")


# Relative RMS errors of round-to-nearest symmetric quantization of these Gaussian-like weights: the int8 step
# (max / 127) costs ~0.7%, the int4 step (max / 7) ~12%.
@pytest.mark.parametrize("fmt, group, tolerance", [("int8", 128, 0.015), ("int4", 256, 0.15)])
def test_convert_to_int_and_load(bf16_checkpoint, tmp_path, fmt, group, tolerance):
    """The converter's format, read back by the loader: shapes, dtypes, dequantized weights, and the model's
    logits against the bf16 model's (quantization error only)."""
    import hybridjit
    from hybridjit.checkpoint import Checkpoint
    from hybridjit.convert import convert_checkpoint

    dst = convert_checkpoint(bf16_checkpoint, tmp_path / fmt, fmt, group_size=group)
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "hybridjit_int",
        "bits": 8 if fmt == "int8" else 4,
        "group_size": group,
        "modules": "routed_experts",
    }
    src, out = Checkpoint(bf16_checkpoint), Checkpoint(dst)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"  # [200, 136]: odd groups, partial last group
    original = np.asarray(src.get(name)).astype(np.float64)
    stored, scale = np.asarray(out.get(name)), np.asarray(out.get(name + "_scale_inv"))
    assert stored.dtype == (np.int8 if fmt == "int8" else np.uint8)
    assert stored.shape == (200, 136 if fmt == "int8" else 68) and scale.shape == (200, -(-136 // group))
    back = dequantize(fmt, stored, scale, (1, group), original.shape)
    assert relative_rms(back, original) < tolerance
    assert out.info("model.layers.1.self_attn.o_proj.weight").dtype == "BF16"

    # The tiny random model routes near ties: quantization flips some top-k choices, which moves its logits by
    # 10-20% (an fp8 conversion of every projection moves them ~17%); a misread format would move them ~100%.
    model = hybridjit.load(dst)
    assert {layer.format for layer in model.expert_layers} == {fmt}
    tokens = [[0, 17, 42, 99, 5]]
    reference = np.asarray(hybridjit.load(bf16_checkpoint).logits(tokens), np.float64)
    logits = np.asarray(model.logits(tokens), np.float64)
    assert np.isfinite(logits).all() and relative_rms(logits, reference) < 0.5
