// The kernels' int8 activation quantisation (numeric_formats.h's QuantizeInt8) in AVX-512, for the packs of the
// kernels that run only where AVX-512 does (AMX's grouped int8 tiles, the GGUF VNNI kernels): per element the scalar
// form's nearbyint is a library call in code built for the baseline ISA.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "numeric_formats.h"

namespace hybridjit {

// QuantizeInt8 bit for bit: the same amax (float bits compared as integers, so a NaN wins), the same float32 product
// x * (127 / amax), rounded to nearest even by the default MXCSR mode. q holds n values.
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline float QuantizeInt8Avx512(const float* x, int64_t n,
                                                                                      int8_t* q) {
  const auto lanes = [](int64_t left) {
    return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << std::max<int64_t>(left, 0)) - 1);
  };
  __m512i amax_bits = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512i v = _mm512_maskz_loadu_epi32(lanes(n - i), x + i);
    amax_bits = _mm512_max_epu32(amax_bits, _mm512_and_si512(v, _mm512_set1_epi32(0x7fffffff)));
  }
  const uint32_t bits = _mm512_reduce_max_epu32(amax_bits);
  float amax;
  std::memcpy(&amax, &bits, sizeof amax);
  if (amax == 0.0f || !std::isfinite(amax)) {
    std::memset(q, 0, n);
    return amax == 0.0f ? 0.0f : amax;
  }
  const __m512 inv = _mm512_set1_ps(127.0f / amax);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = lanes(n - i);
    const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), inv));
    _mm_mask_storeu_epi8(q + i, k, _mm512_cvtsepi32_epi8(r));
  }
  return Int8Scale(amax);
}

}  // namespace hybridjit
