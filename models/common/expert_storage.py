"""Routed experts as the expert bank stores them (hybridjit.ops.routed_experts.register_layer's formats), made into
Experts on the device: what stream-loaded prefill does with each block of experts it streams in as stored.

Formats: float32 and bfloat16 as they are; FP8 with float32 block scales; int8 and int4 (two values a byte, low
nibble first, stored as q + 8) with a float32 scale per row and group of input columns; MXFP4 (e2m1 codes two a
byte in int4's nibble order, one e8m0 scale byte per 32 elements of a row); GGUF blocks (q8_0, q2_k-q6_k:
scales inside the blocks, models/common/gguf_blocks.py), down maybe in another type than gate and up ("q4_k/q6_k",
llama.cpp's Q4_K_M). Every other scaled format becomes values times per-block scales (dequantize_blocks): an int or
MXFP4 scale group is a (1, G) block. gpt-oss's gate and up
rows may come interleaved in one matrix; biases and the activation joining gate and up travel with the experts.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from hybridjit.models.common import gguf_blocks
from hybridjit.models.common.experts import Experts, dequantize_blocks
from hybridjit.quant import E2M1_MAGNITUDES

# e2m1 code -> value: bit 3 the sign, bits 0-2 the magnitude.
E2M1_VALUES = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES])


@dataclasses.dataclass(frozen=True)
class ExpertStorage:
    """How a layer's routed experts are stored: static and hashable (a jit argument that selects the program)."""

    fmt: str  # "f32", "bf16", "fp8", "int8", "int4", "mxfp4" or GGUF's "q4_k/q6_k" (ExpertLayer.format)
    block: tuple[int, int] | None = None  # the scales' block (rows, columns); None for unscaled formats
    gate_up_interleaved: bool = False  # gate holds [2f, d]: even rows the gate projection, odd rows the up
    activation: tuple = ("silu",)  # hybridjit.ops.routed_experts.ACTIVATIONS

    def matrix(self, w: jax.Array, scale: jax.Array | None, columns: int, dtype, down: bool = False) -> jax.Array:
        """One projection as stored (the down projection's format where `down`), w [..., out, stored columns] with
        its scales, -> dtype [..., out, columns]."""
        fmt = self.fmt.split("/")[-1 if down else 0]
        if fmt in gguf_blocks.BLOCKS:
            return gguf_blocks.dequantize(w, fmt, dtype)
        if fmt in ("int4", "mxfp4"):
            nibbles = jnp.stack([w & 0xF, w >> 4], axis=-1).reshape(*w.shape[:-1], -1)[..., :columns]
            if fmt == "int4":
                w = nibbles.astype(jnp.float32) - 8
            else:
                w = jnp.asarray(E2M1_VALUES)[nibbles]
                scale = jnp.ldexp(jnp.float32(1), scale.astype(jnp.int32) - 127)  # e8m0: 2^(s - 127)
        if scale is None:
            return w.astype(dtype)
        return dequantize_blocks(w, scale, self.block, dtype)

    def experts(self, weights: tuple, scales: tuple | None, biases: tuple | None, dtype) -> Experts:
        """Experts in `dtype` from stored (gate, up, down) stacked over experts [e, ...] (up None when interleaved),
        their scales (gate, up, down; None: unscaled) and float32 biases (gate, up, down; None: unbiased)."""
        gate, up, down = weights
        gate_scale, up_scale, down_scale = scales or (None,) * 3
        gate_bias, up_bias, down_bias = biases or (None,) * 3
        d, f = down.shape[-2], gate.shape[-2] // (2 if self.gate_up_interleaved else 1)
        gate, down = self.matrix(gate, gate_scale, d, dtype), self.matrix(down, down_scale, f, dtype, down=True)
        if self.gate_up_interleaved:
            gate, up = gate[..., 0::2, :], gate[..., 1::2, :]
            if gate_bias is not None:
                gate_bias, up_bias = gate_bias[..., 0::2], gate_bias[..., 1::2]
        else:
            up = self.matrix(up, up_scale, d, dtype)
        return Experts(gate, up, down, gate_bias, up_bias, down_bias, self.activation)
