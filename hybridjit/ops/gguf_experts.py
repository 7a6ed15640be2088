"""Routed experts in GGUF block formats (Q8_0, Q2_K-Q6_K, IQ4_XS), registered zero-copy with the C++ bank.

The weights are the blocks as llama.cpp stores them (np.memmap slices of a .gguf file): each matrix a
C-contiguous uint8 array [rows, row bytes], a row being cols / block elements blocks (ffi/gguf_blocks.h).
The kernels (ffi/expert_kernel_gguf.cc) quantise the activations to int8 per 32 elements and run integer
dot products on the stored blocks.
"""

from collections.abc import Sequence

import gguf
import numpy as np

import hybridjit_ffi as _ffi
from hybridjit.ops.routed_experts import ExpertLayer, _check_matrix

# GGUF type name -> the bank's format name.
GGUF_EXPERT_FORMATS = {"Q8_0": "q8_0", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k", "Q2_K": "q2_k", "Q3_K": "q3_k",
                       "IQ4_XS": "iq4_xs"}  # fmt: skip


def row_bytes(gguf_type: str, cols: int) -> int:
    """Bytes of a row of `cols` elements; ValueError unless cols is whole blocks."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[gguf_type]]
    if cols % block:
        raise ValueError(f"{gguf_type} rows are whole blocks of {block} elements, got {cols} columns")
    return cols // block * block_bytes


def dequantize(blocks: np.ndarray, gguf_type: str) -> np.ndarray:
    """float32 [rows, cols] of a matrix's blocks (gguf's own decoder): for experts held on the device."""
    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[gguf_type])


def register_gguf_layer(
    gate: Sequence[np.ndarray],
    up: Sequence[np.ndarray],
    down: Sequence[np.ndarray],
    *,
    gguf_type: str,
    hidden: int,
    inter: int,
    down_type: str | None = None,
) -> ExpertLayer:
    """Registers one layer of routed experts stored as GGUF blocks: gate and up [inter, hidden] matrices of
    `gguf_type` and down [hidden, inter] ones of `down_type` (default the same; llama.cpp's Q4_K_M keeps down in
    Q6_K), each uint8 [rows, row_bytes(cols)]. Raises ValueError naming the expert and projection."""
    down_type = down_type or gguf_type
    for t in (gguf_type, down_type):
        if t not in GGUF_EXPERT_FORMATS:
            raise ValueError(f"{t} is not a GGUF expert format ({', '.join(GGUF_EXPERT_FORMATS)})")
    gate, up, down = list(gate), list(up), list(down)
    if not gate or not len(gate) == len(up) == len(down):
        raise ValueError(f"expert counts: gate {len(gate)}, up {len(up)}, down {len(down)} (equal and > 0 needed)")
    stored = {
        "gate_proj": (inter, row_bytes(gguf_type, hidden)),
        "up_proj": (inter, row_bytes(gguf_type, hidden)),
        "down_proj": (hidden, row_bytes(down_type, inter)),
    }
    weights = dict(zip(stored, (gate, up, down), strict=True))
    for proj, arrays in weights.items():
        for e, a in enumerate(arrays):
            _check_matrix(a, e, proj, stored[proj], np.dtype(np.uint8))
    fmt = GGUF_EXPERT_FORMATS[gguf_type]
    addresses = [[a.ctypes.data for a in arrays] for arrays in weights.values()]
    no_scales = no_biases = ([], [], [])
    layer_id = _ffi.register_layer(
        fmt, hidden, inter, 0, 0, *addresses, *no_scales, *no_biases, False, "silu", 0.0, 0.0,
        down_format=GGUF_EXPERT_FORMATS[down_type],
    )
    name = fmt if down_type == gguf_type else f"{fmt}/{GGUF_EXPERT_FORMATS[down_type]}"
    return ExpertLayer(layer_id, len(gate), hidden, inter, name, [*gate, *up, *down])


def mxfp4_from_ggml(stored: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's MXFP4 blocks, uint8 [..., groups * 17] (a block: its e8m0 byte, then 16 bytes whose low nibbles hold
    elements 0-15 and high nibbles 16-31), in the layout of the gpt-oss release that the MXFP4 kernels read:
    (`_blocks` [..., groups, 16], element 2j in the low nibble of byte j; `_scales` [..., groups]). Both mean
    e2m1 * 2^(s - 127). On the routed experts' thread pool (ffi/mxfp4_layout.cc): numpy's passes over 17-byte
    blocks ran at ~0.05 GB/s, minutes for gpt-oss-120b's 61 GB."""
    if stored.shape[-1] % 17:
        raise ValueError(f"MXFP4 rows of {stored.shape[-1]} bytes: not whole 17-byte blocks")
    groups = stored.shape[:-1] + (stored.shape[-1] // 17,)
    blocks, scales = np.empty((*groups, 16), np.uint8), np.empty(groups, np.uint8)
    _ffi.mxfp4_from_ggml(np.ascontiguousarray(stored).reshape(-1, 17), blocks.reshape(-1, 16), scales.reshape(-1))
    return blocks, scales
