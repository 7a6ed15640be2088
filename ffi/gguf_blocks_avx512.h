// GGUF blocks (gguf_blocks.h) split in AVX-512 registers: each block's elements as bytes in natural order, and its
// multipliers as float32 vectors. Shared by the GGUF kernels (expert_kernel_gguf.cc: blocks multiplied in registers
// with four tokens at a time) and the AMX kernels (expert_kernel_amx.cc: blocks dequantised into bfloat16 tiles for
// prefill). DecodeGgufBlock is their scalar reference.
#pragma once

#include <immintrin.h>

#include <array>
#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"

// VBMI (vpermb) as the avx512 family requires it (cpu_features.cc).
#define HJ_AVX512_VNNI \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma,f16c")))

namespace hybridjit {

// Q4_K's (Q5_K's with `five`) elements 64c.. of block b as bytes in natural order: lo the first 32, hi the next.
HJ_AVX512_VNNI inline void Q4KChunk(const uint8_t* b, bool five, int c, __m256i* lo, __m256i* hi) {
  const __m256i low4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>((five ? b + 48 : b + 16) + 32 * c));
  *lo = _mm256_and_si256(v, low4);
  *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  if (five) {  // bit 2c of qh[l] is the fifth bit of element 64c + l, bit 2c + 1 that of 64c + 32 + l
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    *lo = _mm256_or_si256(*lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
    *hi = _mm256_or_si256(*hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
  }
}

// Q6_K's elements 128 half + 32 s.. of block b as bytes in natural order, v[s] for s = 0..3.
HJ_AVX512_VNNI inline void Q6KHalf(const uint8_t* b, int half, __m256i v[4]) {
  const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(3);
  const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half));
  const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half + 32));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
  const __m256i low[4] = {_mm256_and_si256(ql0, low4), _mm256_and_si256(ql1, low4),
                          _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                          _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4)};
  for (int s = 0; s < 4; ++s) {
    v[s] = _mm256_or_si256(low[s], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * s), low2), 4));
  }
}

// Q2_K's (Q3_K's with `three`) elements 128h + 32j.. of block b as bytes in natural order (Q3_K: its 3-bit q).
HJ_AVX512_VNNI inline __m256i Q2KQuarter(const uint8_t* b, bool three, int h, int j) {
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>((three ? b + 32 : b + 16) + 32 * h));
  __m256i v = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), _mm256_set1_epi8(3));
  if (three) {  // bit 4h + j of byte l
    const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
    const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + j), _mm256_set1_epi8(1));
    v = _mm256_or_si256(v, _mm256_slli_epi16(bit, 2));
  }
  return v;
}

// IQ4_XS's 16 values + 128 (unsigned bytes), looked up by index with vpshufb.
HJ_AVX512_VNNI inline __m128i Iq4XsUnsignedValues() {
  alignas(16) static const std::array<uint8_t, 16> kValues = [] {
    std::array<uint8_t, 16> v{};
    for (int i = 0; i < 16; ++i) v[i] = static_cast<uint8_t>(kIq4nlValues[i] + 128);
    return v;
  }();
  return _mm_load_si128(reinterpret_cast<const __m128i*>(kValues.data()));
}

HJ_AVX512_VNNI inline float HalfAt(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);  // exact, as LoadHalf
}

// Q4_K's (and Q5_K's) 6-bit scales and mins of block b as bytes, as KScalesMins writes them: scale j in byte j, min
// j in byte 8 + j. KScalesMins's unpack done on its four output words at once in a vector register: a scalar unpack
// stored to memory and reloaded as a vector stalls on store forwarding once per block.
HJ_AVX512_VNNI inline __m128i Q4KScalesMins(const uint8_t* b) {
  const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));  // w0 w1 w2, then 4 bytes of q
  const __m128i low = _mm_srlv_epi32(_mm_shuffle_epi32(w, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4));
  const __m128i top = _mm_srli_epi32(_mm_shuffle_epi32(w, _MM_SHUFFLE(1, 1, 0, 0)), 2);  // top 2 bits to bits 4-5
  const __m128i low_masks = _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f);
  const __m128i top_masks = _mm_setr_epi32(0, 0x30303030, 0, 0x30303030);
  return _mm_ternarylogic_epi32(_mm_and_si128(low, low_masks), top, top_masks, 0xf8);  // a | (b & c)
}

// Q4_K's (and Q5_K's) multipliers of block b: lanes 0-7 d * scale j, lanes 8-15 dmin * min j (sub-block j's
// elements are d * scale j * q - dmin * min j), each one float32 product as DecodeGgufBlock computes it.
HJ_AVX512_VNNI inline __m512 Q4KMultipliers(const uint8_t* b) {
  const __m128i sm = Q4KScalesMins(b);
  uint32_t halves;
  std::memcpy(&halves, b, sizeof halves);
  const __m512 d_dmin = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(halves))));  // exact
  const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sm)), _mm512_permutexvar_ps(pick, d_dmin));
}

// Q3_K's 6-bit scales of block b as bytes (Q3KScales's unpack in a vector register: a scalar unpack stored and
// reloaded stalls on store forwarding once per block). Loaded from byte 94 so as not to read past the block's 110:
// the 12 scale bytes are bytes 2-13 of the load. Low 4 bits: scales 0-7 the low nibbles of scale bytes 0-7, 8-15
// their high nibbles; top 2 bits of scale 4k + i: bits 2k of scale byte 8 + i, i.e. 32-bit lane k shifted by 2k.
HJ_AVX512_VNNI inline __m128i Q3KScalesVector(const uint8_t* b) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 94));
  const __m128i low4 = _mm_set1_epi8(0x0f);
  const __m128i bytes = _mm_srli_si128(v, 2);  // scale bytes 0-11 first
  const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(bytes, low4), _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
  const __m128i tops = _mm_shuffle_epi8(v, _mm_setr_epi8(10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13));
  const __m128i top = _mm_srlv_epi32(tops, _mm_setr_epi32(0, 2, 4, 6));
  return _mm_or_si128(low, _mm_and_si128(_mm_slli_epi16(top, 4), _mm_set1_epi8(0x30)));
}

// Q2_K's (Q3_K's with `three`) multipliers of block b for its 16 sub-blocks of 16, whose elements are
// scale[s] * q - min[s]: Q2_K d * (sc & 15) and dmin * (sc >> 4); Q3_K d * (sc - 32) and 4 times that.
HJ_AVX512_VNNI inline void Q2KMultipliers(const uint8_t* b, bool three, __m512* scale, __m512* min) {
  if (three) {
    const __m512i s = _mm512_sub_epi32(_mm512_cvtepu8_epi32(Q3KScalesVector(b)), _mm512_set1_epi32(32));
    *scale = _mm512_mul_ps(_mm512_set1_ps(HalfAt(b + 108)), _mm512_cvtepi32_ps(s));
    *min = _mm512_mul_ps(*scale, _mm512_set1_ps(4.0f));
    return;
  }
  const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
  const __m512i low4 = _mm512_set1_epi32(15);
  *scale = _mm512_mul_ps(_mm512_set1_ps(HalfAt(b + 80)), _mm512_cvtepi32_ps(_mm512_and_si512(sc, low4)));
  *min = _mm512_mul_ps(_mm512_set1_ps(HalfAt(b + 82)), _mm512_cvtepi32_ps(_mm512_srli_epi32(sc, 4)));
}

// Q6_K's scales of block b, d * scale s for its 16 sub-blocks of 16 (their elements are d * scale s * (q - 32)).
HJ_AVX512_VNNI inline __m512 Q6KScales(const uint8_t* b) {
  const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));  // int8
  return _mm512_mul_ps(_mm512_set1_ps(HalfAt(b + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(scales)));
}

}  // namespace hybridjit
