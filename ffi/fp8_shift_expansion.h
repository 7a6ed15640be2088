// The AVX-512 form of fp8_special.h's shift expansion: 64 FP8 E4M3FN bytes -> two vectors of bfloat16 bits,
// each the FP8 value times 2^-8 for every normal code. Shared by the GEMV kernel (expert_kernel_avx512.cc)
// and bench/fp8_gemv_amx.cc, which times it outside the operator.
#pragma once

#include <immintrin.h>

namespace hybridjit {

// first: the low byte of each 16-bit lane (elements 0, 2, 4, ...); second: the high byte (1, 3, 5, ...).
// Each 16-bit lane holds two codes S.EEEE.MMM; an arithmetic shift right by 4 puts a code's E.M at bits
// 10..4 under its sign, which the mask keeps at bit 15; the OR writes exponent field 0111EEEE. The low code
// is first moved into the high byte by a byte shift of the 128-bit lane (vpslldq: on Intel it runs on the
// shuffle port, where vpsllw would compete with the two shifts and the dot products for port 0); the byte
// it brings into the low half lands in bits 3..0, which the mask clears.
__attribute__((always_inline, target("avx512f,avx512bw"))) inline void ExpandFp8ByShifts(__m512i bytes, __m512i* first,
                                                                                        __m512i* second) {
  const __m512i mask = _mm512_set1_epi16(static_cast<short>(0x87f0)), rebias = _mm512_set1_epi16(0x3800);
  constexpr int kAndOr = 0xea;  // (a & b) | c
  *first = _mm512_ternarylogic_epi32(_mm512_srai_epi16(_mm512_bslli_epi128(bytes, 1), 4), mask, rebias, kAndOr);
  *second = _mm512_ternarylogic_epi32(_mm512_srai_epi16(bytes, 4), mask, rebias, kAndOr);
}

}  // namespace hybridjit
