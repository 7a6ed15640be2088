// The FP8 E4M3FN codes that the SIMD kernels' shift expansion decodes wrongly, found once per matrix.
//
// The AVX2 and AVX-512 GEMVs expand FP8 to bfloat16 by shifts alone: the byte's exponent and mantissa
// bits go into place and a rebias of 112 is ORed into the exponent, which gives the FP8 value times 2^-8
// (the 2^8 goes into the block scale) for every normal code. The codes with exponent field 0 (denormals
// and zeros) and NaN do not follow that rule. They are rare in real weights (~1e-4 of the codes of a
// block-scaled checkpoint: block amax maps to 448, and only |w| < amax / 28672 falls below the smallest
// normal), so the bank lists them per projection when a layer is registered, and after a tile the
// kernels add, for those elements alone, the exact product minus the one the shift form gave. The hot
// loop then holds no compare, mask or branch for special codes (bench/RESULTS.md: on AVX-512 the shift
// form expands ~1.8x faster than the exact byte table).
//
// The weights must not change while registered: the list is taken from them once.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "expert_kernels.h"
#include "numeric_formats.h"

namespace hybridjit {

// Exponent field 0 (magnitude codes 0..7) or NaN (127): (code + 1) & 0x7f <= 8.
inline bool IsFp8Special(uint8_t code) { return ((code + 1) & 0x7f) <= 8; }

// The shift expansion's value of a code, as float: the FP8 value times 2^-8 for normal codes.
inline float Fp8ShiftedValue(uint8_t code) {
  const auto bits = static_cast<uint16_t>(((static_cast<int8_t>(code) * 16) & 0x87f0) | 0x3800);
  return Bf16BitsToFloat(bits);
}

// The flat indices (row * cols + col), ascending, of the special codes of a row-major [rows, cols] FP8
// matrix; rows * cols must fit the 32-bit index (WeightBank::Add checks it for every layer).
std::vector<uint32_t> FindFp8Specials(const uint8_t* weights, int64_t rows, int64_t cols);

// For rows [row0, row0 + rows) of an FP8 projection whose tile outputs (scales applied) are in
// out[(r - row0) * out_stride + t], t < tokens: adds scale * (exact - 256 * shifted) * x(t, col) for each
// special code, x(t, col) being the kernel's own activation of token t at that column (so a NaN weight
// gives NaN, whatever the activation).
template <typename ActivationAt>
void AddFp8Corrections(const LayerWeights& layer, const Projection& w, int64_t row0, int64_t rows, int64_t tokens,
                       ActivationAt x, float* out, int64_t out_stride) {
  const int64_t cols = w.cols, n_block_cols = (cols + layer.block_cols - 1) / layer.block_cols;
  const uint32_t* end = w.fp8_specials + w.n_fp8_specials;
  const uint32_t* first = std::lower_bound(w.fp8_specials, end, static_cast<uint32_t>(row0 * cols));
  const uint32_t* last = std::lower_bound(first, end, static_cast<uint32_t>((row0 + rows) * cols));
  const auto* codes = static_cast<const uint8_t*>(w.data);
  for (const uint32_t* s = first; s != last; ++s) {
    const int64_t r = *s / cols, c = *s % cols;
    const uint8_t code = codes[*s];
    const float scale = static_cast<const float*>(w.scale)[r / layer.block_rows * n_block_cols + c / layer.block_cols];
    const float delta = scale * (Fp8E4M3FnTable()[code] - 256.0f * Fp8ShiftedValue(code));
    float* y = out + (r - row0) * out_stride;
    for (int64_t t = 0; t < tokens; ++t) y[t] += delta * x(t, c);
  }
}

}  // namespace hybridjit
