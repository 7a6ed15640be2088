// Scalar conversions between the storage formats of weights and activations and float32.
#pragma once

#include <algorithm>
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

// The magnitudes of the e2m1 (FP4) codes 0-7: 1 exponent bit pair (bias 1) and 1 mantissa bit; bit 3 of a
// nibble is the sign.
inline constexpr std::array<float, 8> kE2m1Magnitudes = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

inline float E2m1ToFloat(uint8_t nibble) {
  const float magnitude = kE2m1Magnitudes[nibble & 7];
  return (nibble & 8) ? -magnitude : magnitude;
}

// Exact float32 value of every e8m0 byte (an MX block scale): 2^(s - 127); 0xff is NaN. 2^-127 is a float32
// denormal, kept as such.
inline const std::array<float, 256>& E8m0Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int s = 0; s < 255; ++s) t[s] = std::ldexp(1.0f, s - 127);
    t[255] = std::nanf("");
    return t;
  }();
  return table;
}

// max |x| over n values, as float bits compared as integers: exact, and a NaN anywhere wins (its
// bits exceed those of every finite value and of infinity), so it reaches the group's scale.
inline float AbsMax(const float* x, int64_t n) {
  uint32_t amax = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof bits);
    amax = std::max(amax, bits & 0x7fffffffu);
  }
  float value;
  std::memcpy(&value, &amax, sizeof value);
  return value;
}

// The int8 activation quantization of every kernel (see expert_kernels.h): q = rint(x * (127 / amax))
// under the default rounding mode (nearest-even), scale amax / 127. A group that is all zeros has
// scale 0; one with a NaN or an infinity gets q = 0 and a non-finite scale, so the products that use
// it are NaN rather than silently finite.
inline float Int8Scale(float amax) { return amax / 127.0f; }

inline float QuantizeInt8(const float* x, int64_t n, int8_t* q) {
  const float amax = AbsMax(x, n);
  if (amax == 0.0f || !std::isfinite(amax)) {
    std::fill(q, q + std::max<int64_t>(n, 0), int8_t{0});
    return amax == 0.0f ? 0.0f : amax;
  }
  const float inv = 127.0f / amax;
  for (int64_t i = 0; i < n; ++i) q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
  return Int8Scale(amax);
}

}  // namespace hybridjit
