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

#define HJ_INT8_QUANTIZE __attribute__((target("avx512f,avx512bw,avx512vl")))

HJ_INT8_QUANTIZE inline __mmask16 QuantizeLanes(int64_t left) {
  return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << std::max<int64_t>(left, 0)) - 1);
}

// max |x| of n values as AbsMax computes it (float bits compared as integers, so a NaN wins).
HJ_INT8_QUANTIZE inline float AbsMaxAvx512(const float* x, int64_t n) {
  __m512i amax_bits = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512i v = _mm512_maskz_loadu_epi32(QuantizeLanes(n - i), x + i);
    amax_bits = _mm512_max_epu32(amax_bits, _mm512_and_si512(v, _mm512_set1_epi32(0x7fffffff)));
  }
  const uint32_t bits = _mm512_reduce_max_epu32(amax_bits);
  float amax;
  std::memcpy(&amax, &bits, sizeof amax);
  return amax;
}

// QuantizeInt8 bit for bit: the same amax, the same float32 product x * (127 / amax), rounded to nearest even by the
// default MXCSR mode. q holds n values; with `sum`, also the sum of q (0 for a group QuantizeInt8 zeroes).
HJ_INT8_QUANTIZE inline float QuantizeInt8Avx512(const float* x, int64_t n, int8_t* q, int32_t* sum = nullptr) {
  const float amax = AbsMaxAvx512(x, n);
  if (amax == 0.0f || !std::isfinite(amax)) {
    std::memset(q, 0, n);
    if (sum) *sum = 0;
    return amax == 0.0f ? 0.0f : amax;
  }
  const __m512 inv = _mm512_set1_ps(127.0f / amax);
  __m512i total = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = QuantizeLanes(n - i);
    const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), inv));
    total = _mm512_add_epi32(total, r);  // masked-off lanes are 0
    _mm_mask_storeu_epi8(q + i, k, _mm512_cvtsepi32_epi8(r));
  }
  if (sum) *sum = _mm512_reduce_add_epi32(total);
  return Int8Scale(amax);
}

#undef HJ_INT8_QUANTIZE

}  // namespace hybridjit
