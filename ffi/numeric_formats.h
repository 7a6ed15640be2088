// Scalar conversions between the storage formats of weights and activations and float32.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace hybridjit {

inline float Bf16BitsToFloat(uint16_t bits) {
  const uint32_t wide = uint32_t{bits} << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

// Round to nearest, ties to even (as XLA and ml_dtypes do); a NaN stays a quiet NaN instead of
// rounding into an infinity.
inline uint16_t FloatToBf16Bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Exact float32 value of every FP8 E4M3FN byte: 1 sign, 4 exponent (bias 7) and 3 mantissa bits.
// Exponent 0 encodes the denormals m/8 * 2^-6; S.1111.111 is NaN; the format has no infinity.
inline const std::array<float, 256>& Fp8E4M3FnTable() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int byte = 0; byte < 256; ++byte) {
      const int exponent = (byte >> 3) & 0xf;
      const int mantissa = byte & 0x7;
      float magnitude;
      if (exponent == 0xf && mantissa == 0x7) {
        magnitude = std::nanf("");
      } else if (exponent == 0) {
        magnitude = std::ldexp(static_cast<float>(mantissa), -9);  // (m / 8) * 2^-6
      } else {
        magnitude = std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
      }
      t[byte] = (byte & 0x80) ? -magnitude : magnitude;
    }
    return t;
  }();
  return table;
}

}  // namespace hybridjit
