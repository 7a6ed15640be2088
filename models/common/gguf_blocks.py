"""GGUF expert blocks dequantised by XLA: what stream-loaded prefill does on the GPU with the GGUF experts it streams
in as stored. The layouts are llama.cpp's (ggml-common.h: block_q8_0, block_q4_K, block_q5_K, block_q6_K): a matrix
row of `cols` elements is cols / 32 (Q8_0) or cols / 256 (the K-quants) blocks of bytes, one after the other, so a
matrix is uint8 [..., rows, row bytes]. The CPU kernels read the same bytes (ffi/gguf_blocks.h).

  Q8_0  34 bytes per 32:  float16 d, 32 int8 q                        w = d * q
  Q4_K 144 bytes per 256: float16 d, dmin, 12 bytes of 6-bit scales
                          and mins of 8 sub-blocks of 32, 128 bytes
                          of 4-bit q (64 elements per 32 bytes: low
                          nibbles the first 32, high the next)       w = d * sc * q - dmin * m
  Q5_K 176 bytes per 256: as Q4_K, then 32 bytes of fifth bits       w = d * sc * (q + 16 * bit) - dmin * m
                          (bit j of byte l: element 32 j + l) before
                          the 4-bit q
  Q6_K 210 bytes per 256: 128 bytes of low 4 bits, 64 of high 2
                          bits, 16 int8 scales of 16 elements,
                          float16 d                                   w = d * sc * (q - 32)
  Q2_K  84 bytes per 256: 16 bytes of a 4-bit scale and min (low,
                          high nibble) per 16 elements, 64 bytes of
                          2-bit q (bits 2j of byte 32h + l: element
                          128h + 32j + l), float16 d, dmin            w = d * sc * q - dmin * m
  Q3_K 110 bytes per 256: 32 bytes of third bits (bit 4h + j of byte
                          l), 64 bytes of low 2 bits as Q2_K's, 12
                          bytes of 6-bit scales per 16, float16 d     w = d * (sc - 32) * (q - 4)
  IQ4_XS 136 bytes per 256: float16 d, 16 bits of the 6-bit scales'
                          top 2 bits, 4 bytes of their low 4 (per
                          32), 128 bytes of 4-bit indices (byte 16j
                          + l: elements 32j + l, + 16 in the high
                          nibble) into IQ4_NL's table                w = d * (sc - 32) * table[q]
"""

import jax
import jax.numpy as jnp

# Format (the bank's name) -> (elements, bytes) of one block.
BLOCKS = {"q8_0": (32, 34), "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210), "q2_k": (256, 84),
          "q3_k": (256, 110), "iq4_xs": (256, 136)}  # fmt: skip
# IQ4_NL's and IQ4_XS's values of the 16 indices (ggml's kvalues_iq4nl).
IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def dequantize(w: jax.Array, fmt: str, dtype) -> jax.Array:
    """uint8 [..., rows, row bytes] of `fmt` blocks -> dtype [..., rows, cols]."""
    elements, nbytes = BLOCKS[fmt]
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // nbytes, nbytes)
    dequantizers = {"q8_0": _q8_0, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k, "q2_k": _q2_k, "q3_k": _q3_k,
                    "iq4_xs": _iq4_xs}  # fmt: skip
    values = dequantizers[fmt](blocks)
    return values.reshape(*w.shape[:-1], -1).astype(dtype)


def _float16(b: jax.Array, at: int) -> jax.Array:
    """The little-endian float16 at byte `at` of each block, as float32 [..., 1]."""
    bits = b[..., at].astype(jnp.uint16) | (b[..., at + 1].astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)[..., None]


def _q8_0(b):
    return _float16(b, 0) * jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32)


def _k_scales(b):
    """The 8 sub-blocks' 6-bit scales and mins of a Q4_K / Q5_K block (bytes 4-15), each float32 [..., 8, 1]: bytes
    0-3 hold scales 0-3 and bytes 4-7 mins 0-3 in their low 6 bits; bytes 8-11 the low 4 bits of scales 4-7 (low
    nibble) and mins 4-7 (high nibble), whose top 2 bits are the top bits of bytes 0-3 and 4-7."""
    s = b[..., 4:16]
    first, second, third = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = jnp.concatenate([first & 63, (third & 0xF) | ((first >> 6) << 4)], axis=-1)
    mins = jnp.concatenate([second & 63, (third >> 4) | ((second >> 6) << 4)], axis=-1)
    return scales.astype(jnp.float32)[..., None], mins.astype(jnp.float32)[..., None]


def _nibbles(qs):
    """128 bytes of 4-bit q -> [..., 8, 32]: each 32 bytes give a sub-block of low nibbles, then one of high."""
    qs = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return jnp.concatenate([qs & 0xF, qs >> 4], axis=-2).reshape(*qs.shape[:-3], 8, 32)


def _q4_k(b):
    scales, mins = _k_scales(b)
    q = _nibbles(b[..., 16:144]).astype(jnp.float32)
    return _float16(b, 0)[..., None] * scales * q - _float16(b, 2)[..., None] * mins


def _q5_k(b):
    scales, mins = _k_scales(b)
    fifth = (b[..., None, 16:48] >> jnp.arange(8, dtype=jnp.uint8)[:, None]) & 1  # [..., 8, 32]
    q = (_nibbles(b[..., 48:176]) | (fifth << 4)).astype(jnp.float32)
    return _float16(b, 0)[..., None] * scales * q - _float16(b, 2)[..., None] * mins


def _q6_k(b):
    # Two halves of 128 elements; a half's 64 low bytes give elements l and l + 64 (low / high nibble) of byte l
    # < 32, l + 32 and l + 96 of byte l + 32; its 32 high bytes give element 32 k + l bits 4-5 from bits 2k.
    low = b[..., :128].reshape(*b.shape[:-1], 2, 2, 32)
    high = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32)
    low4 = jnp.concatenate([low & 0xF, low >> 4], axis=-2)  # [..., 2, 4, 32]: quarters 0-3 of a half
    high2 = (high >> (2 * jnp.arange(4, dtype=jnp.uint8))[:, None]) & 3
    q = (low4 | (high2 << 4)).astype(jnp.float32) - 32
    scales = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
    scales = scales.reshape(*b.shape[:-1], 2, 4, 2, 1)  # per 16 elements: half, quarter, which 16
    d = _float16(b, 208)[..., None, None, None]
    return (d * scales * q.reshape(*q.shape[:-1], 2, 16)).reshape(*b.shape[:-1], 256)


def _crumbs(qs):
    """64 bytes of 2-bit q -> [..., 16, 16] in element order: element 128h + 32j + l is bits 2j of byte 32h + l."""
    qs = qs.reshape(*qs.shape[:-1], 2, 1, 32)
    q = (qs >> (2 * jnp.arange(4, dtype=jnp.uint8))[:, None]) & 3  # [..., 2, 4, 32]
    return q.reshape(*q.shape[:-3], 16, 16)


def _q2_k(b):
    sc = b[..., :16, None]
    q = _crumbs(b[..., 16:80]).astype(jnp.float32)
    scale, mins = (sc & 0xF).astype(jnp.float32), (sc >> 4).astype(jnp.float32)
    w = _float16(b, 80)[..., None] * scale * q - _float16(b, 82)[..., None] * mins
    return w.reshape(*b.shape[:-1], 256)


def _q3_k(b):
    # Third bits: bit 4h + j of byte l for element 128h + 32j + l; the 6-bit scales as ggml unpacks them: low 4 bits
    # of 0-3 / 4-7 in the low nibbles of bytes 0-3 / 4-7, of 8-11 / 12-15 in their high nibbles, top 2 bits of
    # scale 4k + i in bits 2k of byte 8 + i.
    third = (b[..., None, :32] >> jnp.arange(8, dtype=jnp.uint8)[:, None]) & 1  # [..., 8, 32]: bit 4h + j
    q = _crumbs(b[..., 32:96]) | (third.reshape(*b.shape[:-1], 16, 16) << 2)
    s = b[..., 96:108]
    low = jnp.concatenate([s[..., 0:8] & 0xF, s[..., 0:8] >> 4], axis=-1)  # scales 0-7, then 8-15
    top = (s[..., None, 8:12] >> (2 * jnp.arange(4, dtype=jnp.uint8))[:, None]) & 3  # [..., 4, 4]: scale 4k + i
    scales = (low | (top.reshape(*b.shape[:-1], 16) << 4)).astype(jnp.float32) - 32
    w = _float16(b, 108)[..., None] * scales[..., None] * (q.astype(jnp.float32) - 4)
    return w.reshape(*b.shape[:-1], 256)


def _iq4_xs(b):
    top = b[..., 2].astype(jnp.int32) | (b[..., 3].astype(jnp.int32) << 8)  # bits 2j: scale j's top 2
    low = b[..., 4:8].astype(jnp.int32)
    low = jnp.stack([low & 0xF, low >> 4], axis=-1).reshape(*b.shape[:-1], 8)  # nibble j % 2 of byte j / 2
    scales = (low | (((top[..., None] >> (2 * jnp.arange(8))) & 3) << 4)) - 32
    qs = b[..., 8:136].reshape(*b.shape[:-1], 8, 16)
    q = jnp.concatenate([qs & 0xF, qs >> 4], axis=-1)  # [..., 8, 32]
    dl = _float16(b, 0) * scales.astype(jnp.float32)  # [..., 8], rounded as gguf's d * (sc - 32)
    w = dl[..., None] * jnp.asarray(IQ4NL_VALUES, jnp.float32)[q]
    return w.reshape(*b.shape[:-1], 256)
