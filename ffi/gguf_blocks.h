// The GGUF block formats of routed experts (llama.cpp's ggml block layouts), and their decoding into the
// form the GGUF kernels compute on.
//
// A row of a GGUF matrix is whole blocks: Q8_0 blocks of 32 elements (fp16 d, int8 q[32]: w = d * q), and
// the K-quants' super-blocks of 256 (so K-quant rows are multiples of 256 columns):
//   Q4_K  144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes
//         of 4-bit q: w = d * sc * q - dmin * m
//   Q5_K  176 bytes: as Q4_K with a fifth bit per element in 32 bytes qh
//   Q6_K  210 bytes: 128 bytes low 4 bits, 64 bytes high 2 bits, int8 scales for 16 sub-blocks of 16,
//         fp16 d: w = d * sc * (q - 32)
//   Q2_K   84 bytes: 16 bytes of a 4-bit scale (low nibble) and min (high) per sub-block of 16, 64 bytes of
//         2-bit q (element 128h + 32j + l at bits 2j of byte 32h + l), fp16 d, fp16 dmin: w = d * sc * q - dmin * m
//   Q3_K  110 bytes: 32 bytes of third bits (element 128h + 32j + l at bit 4h + j of byte l), 64 bytes of low 2
//         bits (as Q2_K's q), 12 bytes of 6-bit scales for 16 sub-blocks of 16, fp16 d: w = d * (sc - 32) * (q - 4)
//   IQ4_XS 136 bytes: fp16 d, 16 bits of the 6-bit scales' top 2 bits and 4 bytes of their low 4 (sub-blocks of 32),
//         128 bytes of 4-bit indices (sub-block j: byte 16j + l holds element l, its high nibble element 16 + l) into
//         the non-linear table kIq4nlValues: w = d * (sc - 32) * kIq4nlValues[q]
//
// Decoded form (DecodedRow): every format's element as w = lane_scale * q - sub_min, q an unsigned byte in
// natural element order, lane_scale one float per 4 elements (one int32 lane of a u8 x s8 dot product),
// sub_min one float per 16 elements. The integer dot products of q with the int8 activations (quantised per
// 32 elements, expert_kernels.h) then give a row's result with one float multiply per 4 elements.
#pragma once

#include <cstdint>
#include <cstring>

#include "weight_bank.h"

namespace hybridjit {

// The most tokens the avx512 family's GGUF kernel multiplies at once with an expert's blocks split in registers
// (expert_kernel_gguf.cc): more run four at a time, or on AMX (AmxMinTokens).
constexpr int64_t kGgufFusedMaxTokens = 4;

inline bool IsGgufFormat(WeightFormat f) {
  switch (f) {
    case WeightFormat::kQ8_0:
    case WeightFormat::kQ4K:
    case WeightFormat::kQ5K:
    case WeightFormat::kQ6K:
    case WeightFormat::kQ2K:
    case WeightFormat::kQ3K:
    case WeightFormat::kIq4Xs:
      return true;
    default:
      return false;
  }
}

// Elements and bytes of one block.
inline int64_t GgufBlockElements(WeightFormat f) { return f == WeightFormat::kQ8_0 ? 32 : 256; }
inline int64_t GgufBlockBytes(WeightFormat f) {
  switch (f) {
    case WeightFormat::kQ8_0:
      return 34;
    case WeightFormat::kQ4K:
      return 144;
    case WeightFormat::kQ5K:
      return 176;
    case WeightFormat::kQ6K:
      return 210;
    case WeightFormat::kQ2K:
      return 84;
    case WeightFormat::kQ3K:
      return 110;
    case WeightFormat::kIq4Xs:
      return 136;
    default:
      return 0;
  }
}

// IEEE binary16 to float32, exact (denormals included).
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // denormal: normalise
    int e = -1;
    do {
      ++e;
      mantissa <<= 1;
    } while ((mantissa & 0x400u) == 0);
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float LoadHalf(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return HalfToFloat(h);
}

// Q4_K's and Q5_K's 6-bit scales and mins of their 8 sub-blocks from the 12 packed bytes s: out[j] the scale,
// out[8 + j] the min of sub-block j. Sub-blocks 0-3 keep both in the low 6 bits of s[j] and s[4 + j]; 4-7 keep
// their low 4 bits in the nibbles of s[8 + j - 4] and their top 2 in the top bits of s[j - 4] and s[j]: done four
// bytes at a time (a top-2-bits field shifted down by 6 stays within its byte once masked).
inline void KScalesMins(const uint8_t* s, uint8_t out[16]) {
  uint32_t w[3], r[4];
  std::memcpy(w, s, 12);
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  r[0] = w[0] & kLow6;                                         // scales 0-3
  r[1] = (w[2] & kLow4) | (((w[0] >> 6) & kLow2) << 4);        // scales 4-7
  r[2] = w[1] & kLow6;                                         // mins 0-3
  r[3] = ((w[2] >> 4) & kLow4) | (((w[1] >> 6) & kLow2) << 4);  // mins 4-7
  std::memcpy(out, r, 16);
}

// Q3_K's 6-bit scales of its 16 sub-blocks from the 12 packed bytes s (the scale is the value - 32), as ggml's
// dequantize_row_q3_K unpacks them: the low 4 bits of scales 0-3 in the low nibbles of s[0..3], 4-7 in those of
// s[4..7], 8-11 and 12-15 in the high nibbles of s[0..3] and s[4..7]; the top 2 bits of scale 4k + i in bits 2k of
// s[8 + i].
inline void Q3KScales(const uint8_t* s, uint8_t out[16]) {
  uint32_t a[3], r[4];
  std::memcpy(a, s, 12);
  constexpr uint32_t kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  r[0] = (a[0] & kLow4) | ((a[2] & kLow2) << 4);
  r[1] = (a[1] & kLow4) | (((a[2] >> 2) & kLow2) << 4);
  r[2] = ((a[0] >> 4) & kLow4) | (((a[2] >> 4) & kLow2) << 4);
  r[3] = ((a[1] >> 4) & kLow4) | (((a[2] >> 6) & kLow2) << 4);
  std::memcpy(out, r, 16);
}

// IQ4_NL's and IQ4_XS's values of the 16 indices (ggml's kvalues_iq4nl).
inline constexpr int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// IQ4_XS's 6-bit scale of sub-block j (0-7) of block b, as stored (the scale is the value - 32): its low 4 bits in
// nibble j % 2 of byte 4 + j / 2, its top 2 in bits 2j of the 16-bit word at byte 2.
inline int Iq4XsScale(const uint8_t* b, int j) {
  const int high = ((b[2] | (b[3] << 8)) >> (2 * j)) & 3;
  return ((b[4 + j / 2] >> (4 * (j % 2))) & 0xf) | (high << 4);
}

// One block decoded: q[n], lane_scale[n / 4], sub_min[n / 16] for the block's n elements.
inline void DecodeGgufBlock(WeightFormat f, const uint8_t* b, uint8_t* q, float* lane_scale, float* sub_min) {
  switch (f) {
    case WeightFormat::kQ8_0: {
      const float d = LoadHalf(b);
      for (int i = 0; i < 32; ++i) q[i] = static_cast<uint8_t>(static_cast<int8_t>(b[2 + i]) + 128);
      for (int l = 0; l < 8; ++l) lane_scale[l] = d;
      sub_min[0] = sub_min[1] = 128.0f * d;
      return;
    }
    case WeightFormat::kQ4K:
    case WeightFormat::kQ5K: {
      const bool five = f == WeightFormat::kQ5K;
      const float d = LoadHalf(b), dmin = LoadHalf(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* qh = b + 16;
      const uint8_t* qs = five ? b + 48 : b + 16;
      for (int i = 0; i < 256; ++i) {
        const int chunk = i / 64, l = i % 32, high = (i % 64) >= 32;
        int v = (qs[chunk * 32 + l] >> (4 * high)) & 0xf;
        if (five) v |= ((qh[l] >> (i / 32)) & 1) << 4;
        q[i] = static_cast<uint8_t>(v);
      }
      uint8_t sm[16];
      KScalesMins(scales, sm);
      for (int j = 0; j < 8; ++j) {
        for (int l = 0; l < 8; ++l) lane_scale[j * 8 + l] = d * static_cast<float>(sm[j]);
        sub_min[2 * j] = sub_min[2 * j + 1] = dmin * static_cast<float>(sm[8 + j]);
      }
      return;
    }
    case WeightFormat::kQ6K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
      const float d = LoadHalf(b + 208);
      for (int i = 0; i < 256; ++i) {
        const int half = i / 128, j = i % 128;
        const int low = (ql[half * 64 + j % 64] >> (4 * (j / 64))) & 0xf;
        const int high = (qh[half * 32 + j % 32] >> (2 * (j / 32))) & 3;
        q[i] = static_cast<uint8_t>(low | (high << 4));
      }
      for (int s = 0; s < 16; ++s) {
        const float scale = d * static_cast<float>(scales[s]);
        for (int l = 0; l < 4; ++l) lane_scale[s * 4 + l] = scale;
        sub_min[s] = 32.0f * scale;
      }
      return;
    }
    case WeightFormat::kIq4Xs: {  // q = value + 128, unsigned
      const float d = LoadHalf(b);
      for (int j = 0; j < 8; ++j) {
        const float scale = d * static_cast<float>(Iq4XsScale(b, j) - 32);
        for (int l = 0; l < 16; ++l) {
          const uint8_t packed = b[8 + 16 * j + l];
          q[32 * j + l] = static_cast<uint8_t>(kIq4nlValues[packed & 0xf] + 128);
          q[32 * j + 16 + l] = static_cast<uint8_t>(kIq4nlValues[packed >> 4] + 128);
        }
        for (int l = 0; l < 8; ++l) lane_scale[8 * j + l] = scale;
        sub_min[2 * j] = sub_min[2 * j + 1] = 128.0f * scale;
      }
      return;
    }
    case WeightFormat::kQ2K:
    case WeightFormat::kQ3K: {
      const bool three = f == WeightFormat::kQ3K;
      const uint8_t* qs = three ? b + 32 : b + 16;
      for (int i = 0; i < 256; ++i) {  // element 128 h + 32 j + l
        const int h = i / 128, j = i % 128 / 32, l = i % 32;
        int v = (qs[32 * h + l] >> (2 * j)) & 3;
        if (three) v |= ((b[l] >> (4 * h + j)) & 1) << 2;
        q[i] = static_cast<uint8_t>(v);
      }
      if (three) {
        const float d = LoadHalf(b + 108);
        uint8_t sc[16];
        Q3KScales(b + 96, sc);
        for (int s = 0; s < 16; ++s) {
          const float scale = d * static_cast<float>(static_cast<int>(sc[s]) - 32);
          for (int l = 0; l < 4; ++l) lane_scale[s * 4 + l] = scale;
          sub_min[s] = 4.0f * scale;
        }
      } else {
        const float d = LoadHalf(b + 80), dmin = LoadHalf(b + 82);
        for (int s = 0; s < 16; ++s) {
          const float scale = d * static_cast<float>(b[s] & 0xf);
          for (int l = 0; l < 4; ++l) lane_scale[s * 4 + l] = scale;
          sub_min[s] = dmin * static_cast<float>(b[s] >> 4);
        }
      }
      return;
    }
    default:
      return;
  }
}

}  // namespace hybridjit
