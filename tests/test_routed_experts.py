"""The routed-experts FFI custom call against float64 numpy on independently dequantized weights."""

import gc
import threading
import time
from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import hybridjit_ffi as _ffi
from hybridjit.ops.async_experts import GpuExpertJobError, raise_gpu_errors
from hybridjit.ops.routed_experts import TARGET, kernel_info, register_layer, routed_experts, set_cpu_kernel

# Relative RMS error ||y - y_ref|| / ||y_ref|| allowed against float64 math on the same weights, by the
# dtype of x (and so of y). float32: float32 accumulation over a few hundred terms (measured ~2e-7).
# bfloat16: one round-to-nearest of the output to bfloat16 on top of that, whose relative error is at
# most the unit roundoff 2^-8 (measured RMS ~1.6e-3); the exact rounding is tested separately.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2.0**-8}

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
FP8_NAN_BYTES = (0x7F, 0xFF)
# Byte pools for FP8 weights: every finite value, or only exponent fields 0 and 1 (the denormals and
# the smallest normals), so that a wrong denormal decode dominates the error instead of hiding in it.
FP8_POOLS = {
    "all": np.array([b for b in range(256) if b not in FP8_NAN_BYTES], np.uint8),
    "subnormal": np.array([b for b in range(256) if (b >> 3) & 0xF in (0, 1)], np.uint8),
}
RUNTIME_ERRORS = (jax.errors.JaxRuntimeError, ValueError, GpuExpertJobError)


def dequantize(w: np.ndarray, scale: np.ndarray | None, block: tuple[int, int]) -> np.ndarray:
    """float64 weights: FP8 times the multiplier of its block (np.kron, edge blocks cut), else exact."""
    w64 = w.astype(np.float64)
    if scale is None:
        return w64
    grid = np.kron(scale.astype(np.float64), np.ones(block))
    return w64 * grid[: w.shape[0], : w.shape[1]]


def reference(x, ids, weights, gate, up, down) -> np.ndarray:
    """float64 routed experts, token by token, on float64 weights."""
    x = np.asarray(x).astype(np.float64)
    y = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(np.asarray(ids)[t], np.asarray(weights, np.float64)[t], strict=True):
            g, u = gate[e] @ x[t], up[e] @ x[t]
            y[t] += w * (down[e] @ (g / (1.0 + np.exp(-g)) * u))
    return y


def relative_rms(y, y_ref) -> float:
    return float(np.linalg.norm(np.asarray(y, np.float64) - y_ref) / np.linalg.norm(y_ref))


def random_weights(rng, fmt, shape, block, pool="all"):
    """(weight, scale or None) in the given format; FP8 blocks each get their own multiplier."""
    if fmt == FP8:
        w = rng.choice(FP8_POOLS[pool], size=shape).view(FP8)
        grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
        # Unit weight RMS whatever the pool, with a distinct random factor per block.
        rms = np.sqrt(np.mean(w.astype(np.float64) ** 2))
        scale = (rng.uniform(0.5, 2.0, size=grid) / rms / np.sqrt(shape[1])).astype(np.float32)
        return w, scale
    return (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(fmt), None


def make_layer(rng, fmt, n_experts, hidden, inter, block=(128, 128), pool="all"):
    """Registers a random layer; returns it with its float64 dequantized weights per projection."""
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    raw = {p: [random_weights(rng, fmt, s, block, pool) for _ in range(n_experts)] for p, s in shapes.items()}
    scales = {f"{p}_scale": [s for _, s in raw[p]] for p in shapes} if fmt == FP8 else {}
    layer = register_layer(*([w for w, _ in raw[p]] for p in shapes), **scales, block=block)
    dense = {p: [dequantize(w, s, block) for w, s in raw[p]] for p in shapes}
    return layer, dense, raw


def routing(rng, tokens, top_k, n_experts):
    """Random routing that leaves the last expert unused and routes token 0 to expert 1 twice."""
    ids = np.stack([rng.permutation(n_experts - 1)[:top_k] for _ in range(tokens)]).astype(np.int32)
    ids[0, :2] = 1
    weights = rng.uniform(0.1, 1.0, size=(tokens, top_k)).astype(np.float32)
    return ids, weights


@pytest.fixture(autouse=True)
def float32_kernels():
    """These tests check the custom call's plumbing against float32 math: they run on the kernels that keep
    float32 activations (the others, bfloat16 and int8, are checked in test_cpu_kernels.py)."""
    previous = kernel_info()["kernel"]
    set_cpu_kernel("avx2" if "avx2" in kernel_info()["supported"] else "generic")
    yield
    set_cpu_kernel(previous)


def run(layer, x, ids, weights):
    out = np.asarray(jax.jit(partial(routed_experts, layer=layer.id))(x, ids, weights))
    raise_gpu_errors()  # on a GPU, a failed CPU job reports here, after the step
    return out


@pytest.mark.parametrize("x_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "fmt, block, pool",
    [
        (F32, (128, 128), "all"),
        (BF16, (128, 128), "all"),
        (FP8, (128, 128), "all"),
        (FP8, (32, 32), "all"),
        (FP8, (16, 48), "all"),  # not square: a swapped row/column block index shows
        (FP8, (32, 32), "subnormal"),
    ],
)
def test_matches_float64_reference(fmt, block, pool, x_dtype):
    rng = np.random.default_rng(0)
    n_experts, hidden, inter, tokens, top_k = 5, 200, 136, 7, 3
    layer, dense, _ = make_layer(rng, fmt, n_experts, hidden, inter, block, pool)
    with layer:
        x = rng.standard_normal((tokens, hidden)).astype(x_dtype)
        ids, weights = routing(rng, tokens, top_k, n_experts)
        y = run(layer, x, ids, weights)
        assert y.dtype == x.dtype and y.shape == x.shape
        y_ref = reference(x, ids, weights, dense["gate"], dense["up"], dense["down"])
        assert relative_rms(y, y_ref) < TOLERANCE[x_dtype]


def test_subnormal_pool_really_holds_denormals():
    """Guards the test above: the 'subnormal' pool must put most of its weight in FP8 denormals."""
    values = FP8_POOLS["subnormal"].view(FP8).astype(np.float64)
    assert np.sum(np.abs(values) < 2.0**-6) == 16  # 8 denormal magnitudes (zero included), two signs


def test_bfloat16_output_is_float32_result_rounded_to_nearest_even():
    rng = np.random.default_rng(1)
    layer, _, _ = make_layer(rng, FP8, 4, 96, 40, block=(32, 32))
    with layer:
        x = rng.standard_normal((9, 96)).astype(BF16)
        ids, weights = routing(rng, 9, 2, 4)
        y_bf16 = run(layer, x, ids, weights)
        y_f32 = run(layer, x.astype(np.float32), ids, weights)
        np.testing.assert_array_equal(y_bf16.view(np.uint16), y_f32.astype(BF16).view(np.uint16))


def test_bfloat16_output_rounds_ties_to_even_and_keeps_nan():
    """x = e0 and a gate so large that silu is the identity in float32 make y exactly the down column."""
    ties = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), np.nan], np.float32)
    hidden = len(ties)
    gate = np.zeros((1, hidden), np.float32)
    gate[0, 0] = 32.0
    up = np.zeros((1, hidden), np.float32)
    up[0, 0] = 1.0
    down = (ties / 32.0).reshape(hidden, 1)
    with register_layer([gate], [up], [down]) as layer:
        x = np.zeros((1, hidden), BF16)
        x[0, 0] = 1.0
        y = run(layer, x, np.zeros((1, 1), np.int32), np.ones((1, 1), np.float32))
    np.testing.assert_array_equal(y[0, :3].astype(np.float32), [1.0, 1 + 2.0**-6, -1.0])
    assert np.isnan(y[0, 3])


def test_graph_contains_the_custom_call_with_the_layer_id():
    rng = np.random.default_rng(2)
    layer, _, _ = make_layer(rng, BF16, 3, 64, 32)
    with layer:
        x = jnp.zeros((4, 64), jnp.bfloat16)
        ids, weights = routing(rng, 4, 2, 3)
        text = jax.jit(partial(routed_experts, layer=layer.id)).lower(x, ids, weights).as_text()
        assert f"custom_call @{TARGET}(" in text
        assert f"layer = {layer.id} : i64" in text


def test_weights_are_read_in_place_not_copied(tmp_path):
    rng = np.random.default_rng(3)
    hidden, inter = 48, 24
    path = tmp_path / "down.bin"
    down = (rng.standard_normal((hidden, inter)) / np.sqrt(inter)).astype(np.float32)
    down.tofile(path)
    gate = [(rng.standard_normal((inter, hidden)) / np.sqrt(hidden)).astype(np.float32)]
    up = [(rng.standard_normal((inter, hidden)) / np.sqrt(hidden)).astype(np.float32)]
    mapped = np.memmap(path, dtype=np.float32, mode="r", shape=(hidden, inter))
    x = rng.standard_normal((3, hidden)).astype(np.float32)
    ids, weights = np.zeros((3, 1), np.int32), np.ones((3, 1), np.float32)
    with register_layer(gate, up, [mapped]) as layer:
        y_ref = reference(x, ids, weights, [gate[0].astype(np.float64)], [up[0].astype(np.float64)], [down])
        assert relative_rms(run(layer, x, ids, weights), y_ref) < TOLERANCE["float32"]
        gate[0] *= 2.0  # the bank sees the change: it holds the array's memory, not a copy
        y_ref = reference(x, ids, weights, [gate[0].astype(np.float64)], [up[0].astype(np.float64)], [down])
        assert relative_rms(run(layer, x, ids, weights), y_ref) < TOLERANCE["float32"]


def test_zero_tokens():
    rng = np.random.default_rng(5)
    layer, _, _ = make_layer(rng, BF16, 2, 32, 16)
    with layer:
        y = run(
            layer, np.zeros((0, 32), np.float32), np.zeros((0, 2), np.int32), np.zeros((0, 2), np.float32)
        )
        assert y.shape == (0, 32)


def test_kernel_info_names_the_kernel():
    info = kernel_info()
    assert info["kernel"] in info["supported"] and "generic" in info["supported"]
    assert info["formats"]["fp8"]["few_tokens"] in ("generic", "avx2", "avx512")


# --- bad inputs ---------------------------------------------------------------------------------------


@pytest.fixture
def small_layer():
    layer, _, _ = make_layer(np.random.default_rng(6), F32, 4, 32, 16)
    yield layer
    layer.close()


def small_inputs(tokens=3, hidden=32, top_k=2):
    x = np.ones((tokens, hidden), np.float32)
    return x, np.zeros((tokens, top_k), np.int32), np.ones((tokens, top_k), np.float32)


def raw_call(layer_id, x, ids, weights):
    """The custom call without the wrapper's trace-time checks, to reach the C++ checks."""
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return np.asarray(jax.ffi.ffi_call(TARGET, out)(x, ids, weights, layer=np.int64(layer_id)))


def test_wrong_activation_dtype(small_layer):
    x, ids, weights = small_inputs()
    with pytest.raises(TypeError, match="x must be float32 or bfloat16, got float16"):
        routed_experts(x.astype(np.float16), ids, weights, layer=small_layer.id)
    with pytest.raises(RUNTIME_ERRORS, match="x must be float32 or bfloat16, got float16"):
        raw_call(small_layer.id, x.astype(np.float16), ids, weights)


def test_wrong_ids_dtype(small_layer):
    x, ids, weights = small_inputs()
    with pytest.raises(TypeError, match="topk_ids must be int32, got uint32"):
        routed_experts(x, ids.astype(np.uint32), weights, layer=small_layer.id)
    with pytest.raises(RUNTIME_ERRORS, match="topk_ids must be int32, got uint32"):
        raw_call(small_layer.id, x, ids.astype(np.uint32), weights)


def test_wrong_weights_dtype_and_mismatched_shapes(small_layer):
    x, ids, weights = small_inputs()
    with pytest.raises(TypeError, match="topk_weights must be float32"):
        routed_experts(x, ids, weights.astype(jnp.bfloat16), layer=small_layer.id)
    with pytest.raises(ValueError, match="expected x \\[T, H\\]"):
        routed_experts(x, ids, weights[:, :1], layer=small_layer.id)
    with pytest.raises(RUNTIME_ERRORS, match="shapes disagree"):
        raw_call(small_layer.id, x, ids[:2], weights[:2])


def test_hidden_size_mismatch(small_layer):
    x, ids, weights = small_inputs(hidden=33)
    with pytest.raises(RUNTIME_ERRORS, match="x has hidden size 33 but the layer has hidden size 32"):
        run(small_layer, x, ids, weights)


@pytest.mark.parametrize("bad_id", [4, -1])
def test_expert_id_out_of_range(small_layer, bad_id):
    x, ids, weights = small_inputs()
    ids[2, 1] = bad_id
    with pytest.raises(RUNTIME_ERRORS, match=f"expert id {bad_id} out of range \\[0, 4\\)"):
        run(small_layer, x, ids, weights)


def test_unknown_layer_id():
    with pytest.raises(RUNTIME_ERRORS, match="unknown layer id 987654321"):
        np.asarray(routed_experts(*small_inputs(), layer=987654321))
    with pytest.raises(TypeError, match="layer must be a static Python int"):
        routed_experts(*small_inputs(), layer=1.5)


def test_compiled_graph_fails_cleanly_once_its_layer_is_closed():
    layer, _, _ = make_layer(np.random.default_rng(7), FP8, 4, 32, 16, block=(8, 8))
    f = jax.jit(partial(routed_experts, layer=layer.id))
    np.asarray(f(*small_inputs()))
    assert layer.id in _ffi.registered_layer_ids()
    layer.close()
    layer.close()  # idempotent
    assert layer.closed and layer.id not in _ffi.registered_layer_ids()
    with pytest.raises(RUNTIME_ERRORS, match=f"unknown layer id {layer.id}"):
        np.asarray(f(*small_inputs()))
    # Ids are never reused: a new layer does not revive the compiled graph.
    with make_layer(np.random.default_rng(8), FP8, 4, 32, 16, block=(8, 8))[0] as newer:
        assert newer.id != layer.id
        with pytest.raises(RUNTIME_ERRORS, match="unknown layer id"):
            np.asarray(f(*small_inputs()))


def test_garbage_collection_unregisters():
    layer, _, _ = make_layer(np.random.default_rng(9), BF16, 2, 16, 8)
    layer_id = layer.id
    assert layer_id in _ffi.registered_layer_ids()
    del layer
    gc.collect()
    assert layer_id not in _ffi.registered_layer_ids()


def test_close_during_a_running_call_is_safe(tmp_path):
    """Closes the layer from another thread while the kernel runs (~25 ms here) and drops the weights,
    a file mapping that is unmapped with its last view: a kernel still reading them would crash."""
    rng = np.random.default_rng(10)
    n_experts, hidden, inter, tokens = 4, 512, 1024, 64
    mapped = np.memmap(tmp_path / "experts.bin", np.float32, "w+", shape=(3, n_experts, inter * hidden))
    mapped[:] = rng.standard_normal(mapped.shape) / np.sqrt(hidden)
    gate, up = ([m.reshape(inter, hidden) for m in mapped[p]] for p in (0, 1))
    down = [m.reshape(hidden, inter) for m in mapped[2]]
    dense = [[w.astype(np.float64) for w in ws] for ws in (gate, up, down)]
    layer = register_layer(gate, up, down)
    del mapped, gate, up, down
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids, weights = routing(rng, tokens, 2, n_experts)
    f = jax.jit(partial(routed_experts, layer=layer.id))
    f.lower(x, ids, weights).compile()
    outcome = {}
    started = threading.Event()

    def call():
        started.set()
        try:
            outcome["y"] = np.asarray(f(x, ids, weights))
        except RUNTIME_ERRORS as error:
            outcome["error"] = str(error)

    worker = threading.Thread(target=call)
    worker.start()
    started.wait()
    time.sleep(0.005)
    layer.close()
    del layer
    gc.collect()
    worker.join()
    if "error" in outcome:  # the call looked the layer up after the close
        assert "unknown layer id" in outcome["error"]
    else:  # the call held the layer, and close waited for it
        assert relative_rms(outcome["y"], reference(x, ids, weights, *dense)) < TOLERANCE["float32"]


# --- registration ---------------------------------------------------------------------------------------


def f32_experts(n=4, hidden=32, inter=16, dtype=F32):
    rng = np.random.default_rng(11)
    gate = [rng.standard_normal((inter, hidden)).astype(dtype) for _ in range(n)]
    up = [rng.standard_normal((inter, hidden)).astype(dtype) for _ in range(n)]
    down = [rng.standard_normal((hidden, inter)).astype(dtype) for _ in range(n)]
    return gate, up, down


def test_registration_names_the_expert_and_projection():
    gate, up, down = f32_experts()
    up[3] = up[3][:, :-1].copy()
    with pytest.raises(ValueError, match=r"expert 3 up_proj: shape \(16, 31\), expected \(16, 32\)"):
        register_layer(gate, up, down)
    gate, up, down = f32_experts()
    down[2] = down[2].astype(BF16)
    with pytest.raises(ValueError, match="expert 2 down_proj: dtype bfloat16, expected float32"):
        register_layer(gate, up, down)
    gate, up, down = f32_experts()
    gate[1] = np.asfortranarray(gate[1])
    with pytest.raises(ValueError, match="expert 1 gate_proj: not C-contiguous"):
        register_layer(gate, up, down)
    gate, up, down = f32_experts()
    with pytest.raises(ValueError, match="expert counts differ"):
        register_layer(gate, up, down[:3])
    with pytest.raises(ValueError, match="float16 is not one of"):
        register_layer(*f32_experts(dtype=np.float16))


def test_fp8_registration_checks_the_scales():
    gate, up, down = ([w.astype(FP8) for w in ws] for ws in f32_experts(n=2, hidden=200, inter=136))
    scales = {
        "gate_scale": [np.ones((2, 2), np.float32)] * 2,
        "up_scale": [np.ones((2, 2), np.float32)] * 2,
        "down_scale": [np.ones((2, 2), np.float32)] * 2,
    }
    register_layer(gate, up, down, **scales).close()
    fine = {
        "gate_scale": [np.ones((5, 7), np.float32)] * 2,
        "up_scale": [np.ones((5, 7), np.float32)] * 2,
        "down_scale": [np.ones((7, 5), np.float32), np.ones((7, 4), np.float32)],
    }
    with pytest.raises(ValueError, match=r"expert 1 down_proj scale: shape \(7, 4\), expected \(7, 5\)"):
        register_layer(gate, up, down, **fine, block=(32, 32))
    with pytest.raises(ValueError, match="up_proj: float8 weights need block scales, up_scale is missing"):
        register_layer(gate, up, down, gate_scale=scales["gate_scale"])
    with pytest.raises(ValueError, match="expert 0 gate_proj scale: dtype float64, expected float32"):
        register_layer(gate, up, down, **{**scales, "gate_scale": [np.ones((2, 2))] * 2})
    with pytest.raises(ValueError, match="scales are only for float8"):
        register_layer(*f32_experts(), gate_scale=[np.ones((1, 1), np.float32)] * 4)


def test_repeated_calls_give_identical_bits():
    """Experts finish in any order across threads; the sum over them must not depend on it."""
    rng = np.random.default_rng(17)
    layer, _ = make_layer(rng, FP8, 16, 256, 384)[:2]
    x = rng.standard_normal((96, 256)).astype(np.float32)
    ids = np.stack([rng.choice(16, 6, replace=False) for _ in range(96)]).astype(np.int32)
    weights = rng.random((96, 6)).astype(np.float32)
    first = run(layer, x, ids, weights)
    for _ in range(6):
        np.testing.assert_array_equal(run(layer, x, ids, weights), first)
    layer.close()


def test_routes_of_weight_zero_are_skipped():
    """The free slots of a serving batch route with weight zero: their experts are not run at all, so a
    token whose every route weighs zero comes out exactly zero even from an input that is not finite."""
    rng = np.random.default_rng(11)
    layer, dense, _ = make_layer(rng, F32, 5, 64, 32)
    with layer:
        x = rng.standard_normal((4, 64)).astype(np.float32)
        ids, weights = routing(rng, 4, 2, 5)
        x[2] = np.nan
        weights[2] = 0.0
        weights[0, 1] = 0.0  # one route of a live token
        y = run(layer, x, ids, weights)
        assert (y[2] == 0).all()
        live = [0, 1, 3]
        y_ref = reference(x[live], ids[live], weights[live], dense["gate"], dense["up"], dense["down"])
        assert relative_rms(y[live], y_ref) < TOLERANCE["float32"]
