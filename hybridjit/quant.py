"""Block-scaled FP8 (E4M3FN) helpers shared by the loader and the converter, and the MXFP4 decoder.

DeepSeek-V3 stores each quantized [out, in] weight as float8_e4m3fn plus a float32 `weight_scale_inv` of
shape [ceil(out/bo), ceil(in/bi)]; the real value is fp8 * scale of the block the element sits in. Edge
blocks are partial (e.g. kv_a_proj_with_mqa [576, 7168] has scales [5, 56]), so the block size comes from
the config, never from rows / scale rows.
"""

import ml_dtypes
import numpy as np

FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)


def scale_shape(weight_shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return (-(-weight_shape[0] // block[0]), -(-weight_shape[1] // block[1]))


def expand_scales(scale_inv: np.ndarray, weight_shape: tuple[int, int], block: tuple[int, int]) -> np.ndarray:
    """Per-element scale of each weight element: each block's scale repeated over its (partial) block."""
    rows = np.repeat(scale_inv, block[0], axis=0)[: weight_shape[0]]
    return np.repeat(rows, block[1], axis=1)[:, : weight_shape[1]]


def dequantize_fp8_blocks(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float8_e4m3fn [out, in] with per-block scales -> float32 [out, in]."""
    expected = scale_shape(weight.shape, block)
    if scale_inv.shape != expected:
        raise ValueError(
            f"scale_inv shape {scale_inv.shape} does not match weight {weight.shape} with block {block}: "
            f"expected {expected}"
        )
    return weight.astype(np.float32) * expand_scales(scale_inv.astype(np.float32), weight.shape, block)


def quantize_fp8_blocks(weight: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """float [out, in] -> (float8_e4m3fn weight, float32 scale_inv) with one scale per block (amax / 448)."""
    w = np.asarray(weight, dtype=np.float32)
    out, inp = w.shape
    so, si = scale_shape(w.shape, block)
    padded = np.zeros((so * block[0], si * block[1]), np.float32)
    padded[:out, :inp] = w
    amax = np.abs(padded.reshape(so, block[0], si, block[1])).max(axis=(1, 3))
    scale_inv = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    q = (w / expand_scales(scale_inv, w.shape, block)).astype(ml_dtypes.float8_e4m3fn)
    return q, scale_inv


# MXFP4 (gpt-oss's experts): e2m1 nibbles, bit 3 the sign and bits 0-2 indexing these magnitudes.
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 `_blocks` uint8 [..., out, in / 32, 16] (element 2j of a group the low nibble of byte j, 2j + 1 the
    high one) with e8m0 `_scales` uint8 [..., out, in / 32] (2^(s - 127)) -> float32 [..., out, in]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {blocks.shape} and scales {scales.shape}: expected [..., out, in / 32, 16] and "
            "[..., out, in / 32]"
        )
    nibbles = np.stack([blocks & 0xF, blocks >> 4], axis=-1)  # [..., out, groups, 16, 2]
    values = np.where(nibbles & 8, -1.0, 1.0).astype(np.float32) * E2M1_MAGNITUDES[nibbles & 7]
    values = values.reshape(*scales.shape, 32) * np.ldexp(np.float32(1), scales.astype(np.int32) - 127)[..., None]
    return values.reshape(*scales.shape[:-1], -1)


def dequantize_int_groups(stored: np.ndarray, scale: np.ndarray, int_quant, shape) -> np.ndarray:
    """int8 or int4 (two per byte) [out, ceil(in / 2)] with a float32 scale per row and group of `group_size` input
    columns -> float32 `shape` [out, in]: the inverse of hybridjit.convert.quantize_int_groups."""
    rows, cols = shape
    if int_quant.bits == 4:
        nibbles = np.stack([stored & 0xF, stored >> 4], axis=-1).reshape(rows, -1)[:, :cols]
        q = nibbles.astype(np.float32) - 8
    else:
        q = stored.astype(np.float32)
    return q * np.repeat(scale.astype(np.float32), int_quant.group_size, axis=1)[:, :cols]
