// FP8 E4M3FN -> bfloat16 in AVX-512 registers, by table: exact for every code. The AMX kernels use it to
// dequantize FP8 weights into their bfloat16 strips, where the cost is amortized over many tokens (the
// GEMV kernels use the faster shift expansion of fp8_special.h instead). bfloat16 holds E4M3's
// 3 mantissa bits and its whole exponent range, so FP8 denormals become normal bfloat16 values (which
// vdpbf16ps does not flush) and NaN stays NaN; no code needs a slow path. The 7-bit magnitude of each
// byte indexes two 128-entry byte tables, the high and the low byte of the bfloat16 bits, through
// VBMI's two-register byte permute (one instruction per 64 weights and table); the sign is ORed in.
#pragma once

#include <immintrin.h>

#include <array>
#include <cstdint>

#include "numeric_formats.h"

#define HJ_FP8_BF16 __attribute__((target("avx512f,avx512bw,avx512vbmi")))

namespace hybridjit {

// The high and low bytes of the bfloat16 bits of each non-negative E4M3FN code 0..127.
struct alignas(64) Fp8Bf16Bytes {
  std::array<uint8_t, 128> high, low;
};

inline const Fp8Bf16Bytes& Fp8Bf16ByteTables() {
  static const Fp8Bf16Bytes tables = [] {
    Fp8Bf16Bytes t{};
    for (int code = 0; code < 128; ++code) {
      const uint16_t bits = FloatToBf16Bits(Fp8E4M3FnTable()[code]);  // exact: no rounding happens
      t.high[code] = static_cast<uint8_t>(bits >> 8);
      t.low[code] = static_cast<uint8_t>(bits & 0xff);
    }
    return t;
  }();
  return tables;
}

struct Fp8Tables {
  __m512i high0, high1, low0, low1;
};

HJ_FP8_BF16 inline Fp8Tables LoadFp8Tables() {
  const Fp8Bf16Bytes& t = Fp8Bf16ByteTables();
  return {_mm512_loadu_si512(t.high.data()), _mm512_loadu_si512(t.high.data() + 64),
          _mm512_loadu_si512(t.low.data()), _mm512_loadu_si512(t.low.data() + 64)};
}

// 64 FP8 bytes -> the high and the low byte of each one's bfloat16 bits, byte for byte.
HJ_FP8_BF16 inline void Fp8ToBf16Bytes(__m512i fp8, const Fp8Tables& t, __m512i* high, __m512i* low) {
  const __m512i magnitude_high = _mm512_permutex2var_epi8(t.high0, fp8, t.high1);  // index: the low 7 bits
  *high = _mm512_ternarylogic_epi32(magnitude_high, fp8, _mm512_set1_epi8(static_cast<char>(0x80)), 0xf8);  // a | (b & c)
  *low = _mm512_permutex2var_epi8(t.low0, fp8, t.low1);
}

}  // namespace hybridjit
