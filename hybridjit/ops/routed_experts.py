"""Routed experts as the XLA FFI custom call ``hybridjit_routed_experts``.

Expert weights are not XLA operands. They are registered once in the C++ weight bank of
``hybridjit_ffi`` and the custom call names them by an integer layer id (an ``int64`` attribute),
so a jitted model graph carries only the activations and the routing.

Zero-copy: ``register_layer`` hands the bank the addresses of the given numpy arrays (np.memmap views
into safetensors files included) without copying them, and the returned ``ExpertLayer`` holds
references to the arrays so that the memory stays valid until the layer is unregistered. Unregistering
(``close()``, idempotent, also run on garbage collection) waits for calls already running on the layer
and only then drops the references. A compiled graph that still names a closed layer fails cleanly
with "unknown layer id" (ids are never reused), it never reads freed memory.
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import hybridjit_ffi as _ffi

TARGET = "hybridjit_routed_experts"

_FORMATS = {
    np.dtype(np.float32): "f32",
    np.dtype(ml_dtypes.bfloat16): "bf16",
    np.dtype(ml_dtypes.float8_e4m3fn): "fp8",
    np.dtype(np.int8): "int8",
    np.dtype(np.uint8): "int4",  # two 4-bit values per byte
}
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# int8/int4 scale groups: a multiple of this many input columns (ffi/weight_bank.h, kIntGroupQuantum).
INT_GROUP_QUANTUM = 128
# mxfp4: one e8m0 scale byte per this many elements of a row (ffi/weight_bank.h, kMxfp4Block).
MXFP4_BLOCK = 32
# What joins gate and up (ffi/weight_bank.h, GluActivation): ("silu",) or ("clamped_swiglu", alpha, limit).
ACTIVATIONS = ("silu", "clamped_swiglu")

jax.ffi.register_ffi_target(TARGET, _ffi.routed_experts_cpu(), platform="cpu")


class ExpertLayer:
    """A layer of routed experts registered in the C++ weight bank; pass ``.id`` to `routed_experts`."""

    def __init__(
        self, layer_id: int, n_experts: int, hidden: int, inter: int, fmt: str, arrays: list,
        block: tuple[int, int] | None = None,
    ):
        self.id = layer_id
        self.n_experts = n_experts
        self.hidden = hidden
        self.inter = inter
        self.format = fmt
        self.block = block  # the scales' block (rows, columns) of a scaled format, defaults applied; else None
        self.nbytes = sum(a.nbytes for a in arrays)  # weights, scales and biases as the kernels read them
        # The finalizer, not the instance, owns the arrays: they outlive the unregistration.
        self._finalizer = weakref.finalize(self, _unregister, layer_id, arrays)

    def close(self) -> None:
        """Unregisters the layer (after its running calls finish) and releases the weights."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> ExpertLayer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "registered"
        return (
            f"ExpertLayer(id={self.id}, n_experts={self.n_experts}, hidden={self.hidden}, "
            f"inter={self.inter}, format={self.format!r}, {state})"
        )


def _unregister(layer_id: int, arrays: list) -> None:
    _ffi.unregister_layer(layer_id)
    arrays.clear()


def _check_matrix(a, expert: int, proj: str, shape: tuple[int, int], dtype: np.dtype, what: str = ""):
    where = f"expert {expert} {proj}{what}"
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{where}: expected a numpy array, got {type(a).__name__}")
    if a.dtype != dtype:
        raise ValueError(f"{where}: dtype {a.dtype}, expected {dtype}")
    if a.shape != shape:
        raise ValueError(f"{where}: shape {a.shape}, expected {shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{where}: not C-contiguous (the bank reads the array in place and never copies)")


def _block_grid(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return -(-rows // block[0]), -(-cols // block[1])


def register_layer(
    gate: Sequence[np.ndarray],
    up: Sequence[np.ndarray] | None,
    down: Sequence[np.ndarray],
    gate_scale: Sequence[np.ndarray] | None = None,
    up_scale: Sequence[np.ndarray] | None = None,
    down_scale: Sequence[np.ndarray] | None = None,
    block: tuple[int, int] | None = None,
    *,
    fmt: str | None = None,
    gate_up_interleaved: bool = False,
    biases: tuple[Sequence[np.ndarray], Sequence[np.ndarray] | None, Sequence[np.ndarray]] | None = None,
    activation: tuple = ("silu",),
) -> ExpertLayer:
    """Registers one layer of routed experts, zero-copy, and returns its handle.

    gate, up: one [inter, hidden] matrix per expert; down: one [hidden, inter] matrix per expert; all
    C-contiguous numpy arrays of one dtype, which names the format (`fmt` only for "mxfp4", whose bytes are uint8
    as int4's are):

    - float32, bfloat16: plain weights, no scales.
    - float8_e4m3fn: scales are float32 [ceil(out / block[0]), ceil(in / block[1])] multipliers (the
      checkpoint's ``weight_scale_inv``: w = fp8 * scale); block defaults to (128, 128). Registration reads
      every weight once, to list the codes the SIMD kernels correct separately (denormals, zeros, NaN), so
      fp8 weights must not change while the layer is registered (the other formats may).
    - int8: w = q * scale per group of block[1] input columns of one row: block = (1, G) with G a
      multiple of 128 (default (1, 128)); scales float32 [out, ceil(in / G)]. G >= in is one scale per
      row.
    - uint8, read as int4: two values per byte, element 2j in the low nibble of byte j and 2j + 1 in
      the high one, each stored as q + 8 for q in [-8, 7]; a matrix [out, in] is [out, ceil(in / 2)]
      bytes. Scales as for int8.
    - fmt="mxfp4" (uint8): e2m1 values two per byte in int4's nibble order (bit 3 the sign, bits 0-2 index
      0, .5, 1, 1.5, 2, 3, 4, 6), a matrix [out, in] is [out, in / 2] bytes (gpt-oss's ``*_blocks`` [out, in / 32,
      16] reshaped); scales uint8 e8m0 [out, in / 32] (``*_scales``: 2^(s - 127)); in a multiple of 32.

    gate_up_interleaved: `gate` holds [2 * inter, hidden] matrices whose even rows are the gate projection and odd
    rows the up projection (gpt-oss's fused gate_up_proj), `up` and `up_scale` are None. biases: float32 (gate
    [inter] or, interleaved, [2 * inter]; up [inter] or None when interleaved; down [hidden]) per expert, added to
    the projections' outputs. activation: ("silu",) for silu(g) * u, or ("clamped_swiglu", alpha, limit) for
    gpt-oss's (min(u, l) clipped below at -l, + 1) * g' * sigmoid(alpha g') with g' = min(g, l).

    Raises ValueError naming the expert and projection.
    """
    interleaved = bool(gate_up_interleaved)
    gate, down = list(gate), list(down)
    if interleaved and (up is not None or up_scale is not None):
        raise ValueError("gate_up_interleaved: the up rows are in gate; pass up=None and up_scale=None")
    up = list(up) if up is not None else None
    if not gate:
        raise ValueError("register_layer needs at least one expert")
    if not len(gate) == (len(up) if up is not None else len(gate)) == len(down):
        raise ValueError(f"expert counts differ: gate {len(gate)}, up {len(up)}, down {len(down)}")
    first = gate[0]
    gate_name = "gate_up_proj" if interleaved else "gate_proj"
    if not isinstance(first, np.ndarray) or first.ndim != 2:
        raise ValueError(f"expert 0 {gate_name}: expected a 2-D numpy array")
    dtype = first.dtype
    if fmt is None:
        if dtype not in _FORMATS:
            raise ValueError(
                f"expert 0 {gate_name}: dtype {dtype} is not one of float32, bfloat16, float8_e4m3fn, int8, "
                "uint8 (int4)"
            )
        fmt = _FORMATS[dtype]
    elif fmt != "mxfp4":
        raise ValueError(f"fmt names only mxfp4 (the other formats follow from the dtype), got {fmt!r}")
    elif dtype != np.uint8:
        raise ValueError(f"expert 0 {gate_name}: mxfp4 weights are uint8 (two e2m1 values per byte), got {dtype}")
    packed = fmt in ("int4", "mxfp4")
    gate_rows = 2 if interleaved else 1
    if packed:  # the packed shapes hide odd sizes: take each from the rows of the other matrix
        inter = first.shape[0] // gate_rows
        hidden = down[0].shape[0] if isinstance(down[0], np.ndarray) and down[0].ndim == 2 else -1
    else:
        inter, hidden = first.shape[0] // gate_rows, first.shape[1]
    shapes = {"gate_proj": (gate_rows * inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    names = {"gate_proj": gate_name, "up_proj": "up_proj", "down_proj": "down_proj"}
    if fmt == "mxfp4" and (hidden % MXFP4_BLOCK or inter % MXFP4_BLOCK):
        raise ValueError(f"mxfp4: hidden {hidden} and inter {inter} must be multiples of {MXFP4_BLOCK}")
    stored = {p: (r, -(-c // 2)) if packed else (r, c) for p, (r, c) in shapes.items()}
    weights = {"gate_proj": gate, "up_proj": up or [], "down_proj": down}
    for proj, arrays in weights.items():
        for e, a in enumerate(arrays):
            _check_matrix(a, e, names[proj], stored[proj], dtype)

    scales = {"gate_proj": gate_scale, "up_proj": up_scale, "down_proj": down_scale}
    if fmt in ("fp8", "int8", "int4", "mxfp4"):
        block = _check_block(fmt, block)
        kind = "float8" if fmt == "fp8" else fmt
        scale_dtype = np.dtype(np.uint8 if fmt == "mxfp4" else np.float32)
        for proj, seq in scales.items():
            if seq is None:
                if proj == "up_proj" and interleaved:
                    scales[proj] = []
                    continue
                raise ValueError(
                    f"{names[proj]}: {kind} weights need block scales, {proj[: -len('_proj')]}_scale is missing"
                )
            seq = scales[proj] = list(seq)
            if len(seq) != len(gate):
                raise ValueError(f"{names[proj]}: {len(seq)} scale arrays for {len(gate)} experts")
            grid = _block_grid(*shapes[proj], block)
            for e, s in enumerate(seq):
                _check_matrix(s, e, names[proj], grid, scale_dtype, what=" scale")
    else:
        for proj, seq in scales.items():
            if seq is not None:
                raise ValueError(
                    f"{names[proj]}: scales are only for float8, int8, int4 and mxfp4 weights, these are {dtype}"
                )
        scales = {proj: [] for proj in _PROJECTIONS}
        block = (0, 0)
    bias_lists = _check_biases(biases, shapes, names, len(gate), interleaved)
    name, alpha, limit = _check_activation(activation)

    def addresses(arrays):
        return [a.ctypes.data for a in arrays]

    layer_id = _ffi.register_layer(
        fmt,
        hidden,
        inter,
        block[0],
        block[1],
        *(addresses(weights[p]) for p in _PROJECTIONS),
        *(addresses(scales[p]) for p in _PROJECTIONS),
        *(addresses(b) for b in bias_lists),
        interleaved,
        name,
        alpha,
        limit,
    )
    owned = [
        *gate,
        *(up or []),
        *down,
        *(s for p in _PROJECTIONS for s in scales[p]),
        *(b for bs in bias_lists for b in bs),
    ]
    return ExpertLayer(layer_id, len(gate), hidden, inter, fmt, owned, None if block == (0, 0) else block)


def _check_biases(biases, shapes: dict, names: dict, n_experts: int, interleaved: bool) -> list[list[np.ndarray]]:
    """The bias arrays per projection (empty lists for an unbiased layer), checked: float32 [rows] per expert."""
    if biases is None:
        return [[], [], []]
    lists = []
    for proj, seq in zip(_PROJECTIONS, biases, strict=True):
        if seq is None and proj == "up_proj" and interleaved:
            lists.append([])
            continue
        if seq is None:
            raise ValueError(f"{names[proj]}: bias missing (a biased layer needs gate, up and down biases)")
        seq = list(seq)
        if len(seq) != n_experts:
            raise ValueError(f"{names[proj]}: {len(seq)} bias arrays for {n_experts} experts")
        for e, b in enumerate(seq):
            _check_matrix(b, e, names[proj], (shapes[proj][0],), np.dtype(np.float32), what=" bias")
        lists.append(seq)
    return lists


def _check_activation(activation) -> tuple[str, float, float]:
    name, *params = activation
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not one of {', '.join(ACTIVATIONS)}")
    if name == "silu":
        if params:
            raise ValueError(f"silu takes no parameters, got {params}")
        return name, 1.0, 0.0
    alpha, limit = (float(p) for p in params)
    if not (limit > 0 and np.isfinite(alpha)):
        raise ValueError(f"clamped_swiglu needs a finite alpha and a positive limit, got {alpha}, {limit}")
    return name, alpha, limit


def _check_block(fmt: str, block) -> tuple[int, int]:
    if fmt == "mxfp4":
        if block is not None and tuple(block) != (1, MXFP4_BLOCK):
            raise ValueError(f"mxfp4 scales are one per {MXFP4_BLOCK} elements of a row: block (1, 32), got {block}")
        return (1, MXFP4_BLOCK)
    if block is None:
        return (128, 128) if fmt == "fp8" else (1, INT_GROUP_QUANTUM)
    if len(block) != 2 or min(operator.index(b) for b in block) <= 0:
        raise ValueError(f"block must be two positive sizes (rows, cols), got {block}")
    block = (operator.index(block[0]), operator.index(block[1]))
    if fmt != "fp8" and (block[0] != 1 or block[1] % INT_GROUP_QUANTUM):
        raise ValueError(
            f"{fmt} scales come in groups of one row: block must be (1, G) with G a multiple of "
            f"{INT_GROUP_QUANTUM}, got {block}"
        )
    return block


def check_operands(x, topk_ids, topk_weights, layer):
    """Trace-time checks shared by the routed-expert calls; returns the operands as arrays and the layer id."""
    try:
        layer = operator.index(layer)
    except TypeError:
        raise TypeError(f"layer must be a static Python int (ExpertLayer.id), got {type(layer).__name__}") from None
    x, topk_ids, topk_weights = jnp.asarray(x), jnp.asarray(topk_ids), jnp.asarray(topk_weights)
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"routed_experts: x must be float32 or bfloat16, got {x.dtype}")
    if topk_ids.dtype != jnp.int32:
        raise TypeError(f"routed_experts: topk_ids must be int32, got {topk_ids.dtype}")
    if topk_weights.dtype != jnp.float32:
        raise TypeError(f"routed_experts: topk_weights must be float32, got {topk_weights.dtype}")
    if x.ndim != 2 or topk_ids.ndim != 2 or topk_ids.shape != topk_weights.shape or len(x) != len(topk_ids):
        raise ValueError(
            f"routed_experts: expected x [T, H], topk_ids and topk_weights [T, K]; got x {x.shape}, "
            f"topk_ids {topk_ids.shape}, topk_weights {topk_weights.shape}"
        )
    return x, topk_ids, topk_weights, layer


def routed_experts(x: jax.Array, topk_ids: jax.Array, topk_weights: jax.Array, *, layer: int) -> jax.Array:
    """y[t] = sum_k w[t,k] * down_e(silu(gate_e x[t]) * up_e x[t]), e = topk_ids[t,k], on bank layer `layer` (with
    the layer's biases and activation where it has others, register_layer).

    x: [T, H] float32 or bfloat16; topk_ids: [T, K] int32; topk_weights: [T, K] float32. Returns [T, H]
    in x's dtype, accumulated in float32. Works under jax.jit; the layer id is a compile-time constant.
    Unknown layer ids, an H that differs from the layer's, and expert ids out of range fail when the
    call runs.
    """
    x, topk_ids, topk_weights, layer = check_operands(x, topk_ids, topk_weights, layer)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return call(x, topk_ids, topk_weights, layer=np.int64(layer))


def routed_experts_host(
    layer: ExpertLayer, x: np.ndarray, topk_ids: np.ndarray, topk_weights: np.ndarray
) -> np.ndarray:
    """The same operator as `routed_experts` on numpy arrays, without XLA: for tests and benchmarks.

    x: C-contiguous [T, H] float32 or bfloat16; topk_ids [T, K] int32; topk_weights [T, K] float32."""
    if layer.closed:
        raise ValueError(f"layer {layer.id} is closed")
    x = np.ascontiguousarray(x)
    ids = np.ascontiguousarray(topk_ids, dtype=np.int32)
    weights = np.ascontiguousarray(topk_weights, dtype=np.float32)
    if x.dtype not in (np.float32, ml_dtypes.bfloat16) or x.ndim != 2 or x.shape[1] != layer.hidden:
        raise ValueError(f"x must be float32 or bfloat16 [T, {layer.hidden}], got {x.dtype} {x.shape}")
    if ids.ndim != 2 or ids.shape != weights.shape or len(ids) != len(x):
        raise ValueError(f"topk_ids and topk_weights must both be [{len(x)}, K], got {ids.shape} and {weights.shape}")
    y = np.empty_like(x)
    _ffi.run_layer(
        layer.id,
        x.ctypes.data,
        x.dtype == ml_dtypes.bfloat16,
        ids.ctypes.data,
        weights.ctypes.data,
        *ids.shape,
        y.ctypes.data,
    )
    return y


def layer_kernel(layer: ExpertLayer, tokens: int) -> str:
    """The kernel ("generic", "avx2", "avx512", "amx_bf16", "amx_fp8g", "amx_int8", "amx_int8g") that runs an
    expert of `layer` routed `tokens` tokens in one call, under the current selection."""
    return _ffi.layer_kernel(layer.id, operator.index(tokens))


def kernel_info() -> dict:
    """The CPU kernels that run the routed experts and the thread pool they run on.

    {"kernel": family in use ("generic", "avx2", "avx512" or "amx"), "best": the host's best family,
    "supported": the families the host can run, "threads", "numa_nodes", "numa_forced", "pool_spin_us" (how long
    an idle worker spins before sleeping: HYBRIDJIT_POOL_SPIN_US),
    "amx_min_tokens" and "gguf_tile_min_tokens" (the overrides, 0 if none), "prefetch_bytes" (the distance in
    effect), "formats":
    {format: {"few_tokens": kernel, "many_tokens": kernel}}} for one token and for very many tokens routed to
    an expert in one call.
    """
    return dict(_ffi.kernel_info())


def set_cpu_kernel(name: str) -> None:
    """Selects the kernel family for all later calls (HYBRIDJIT_CPU_KERNEL does so at start-up).

    ValueError if the name is unknown or the host cannot run that family."""
    _ffi.set_cpu_kernel(name)


def set_amx_min_tokens(tokens: int) -> None:
    """With the amx family: experts with at least `tokens` tokens in a call use AMX tiles, the others AVX-512
    (HYBRIDJIT_AMX_MIN_TOKENS). 0 (the default) gives each layer the crossover measured for its kind of AMX
    kernel: 8 tokens for bf16 weights, 16 for int8 with one scale per row, 32 for fp8, 64 for grouped int8/int4."""
    _ffi.set_amx_min_tokens(operator.index(tokens))


def set_gguf_tile_min_tokens(tokens: int) -> None:
    """With the avx512 family (a host without AMX): GGUF experts with at least `tokens` tokens in a call use the
    register-tile kernel (a tile of 4 weight rows x 16 tokens), the others the few-token kernel
    (HYBRIDJIT_GGUF_TILE_MIN_TOKENS). 0 (the default): the crossover measured between the two."""
    _ffi.set_gguf_tile_min_tokens(operator.index(tokens))


def set_prefetch_bytes(bytes_ahead: int | None) -> None:
    """How far ahead along each weight row the AVX2 and AVX-512 kernels prefetch weights, for every format
    (HYBRIDJIT_PREFETCH_BYTES; 0: no software prefetch). None restores the distance measured best
    (bench/moe_cpu.py --prefetch): 2048 bytes on Intel (a 16-core Emerald Rapids), 1024 on AMD (a 2-core Zen 5)."""
    _ffi.set_prefetch_bytes(-1 if bytes_ahead is None else operator.index(bytes_ahead))


def configure_threads(threads: int | None = None, numa_nodes: int | None = None) -> None:
    """Replaces the CPU thread pool: `threads` counting the calling thread (HYBRIDJIT_THREADS; default one
    per CPU of the affinity mask) split into `numa_nodes` logical nodes (HYBRIDJIT_NUMA_NODES; default the
    machine's). Forcing two nodes on a one-node machine exercises the per-node slicing."""
    _ffi.configure_threads(operator.index(threads or 0), operator.index(numa_nodes or 0))


@contextlib.contextmanager
def pool_of(threads: int | None) -> Iterator[None]:
    """The CPU thread pool at `threads` threads (counting the calling thread) inside the block, then as it was
    (None: left as it is); forced NUMA nodes are kept."""
    if threads is None:
        yield
        return
    info = kernel_info()
    nodes = info["numa_nodes"] if info["numa_forced"] else None
    configure_threads(threads, nodes)
    try:
        yield
    finally:
        configure_threads(info["threads"], nodes)
