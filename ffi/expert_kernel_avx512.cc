// AVX-512 kernels (F, BW, VL, DQ, BF16, VNNI): the GEMV of decode, memory-bound by design.
//
// bf16 and fp8 weights meet bfloat16 activations in vdpbf16ps (float32 accumulators). FP8 E4M3FN is
// expanded to bfloat16 in registers (OSDI '26 §3.4) by the shift expansion of fp8_special.h, done on
// 16-bit lanes: 2 word shifts, 1 byte shift and 2 ternary-logic ops per 64 weights (about 1.8x the rate of
// an exact VBMI byte table, bench/RESULTS.md). Every FP8 normal becomes a normal bfloat16, so
// vdpbf16ps's flushing of denormals loses nothing; the special codes (denormals, zeros, NaN) the bank
// listed are corrected after the tiles. Sums run per scale block, and the block scale is applied once
// to the block's float32 sums (post-scaling); row tiles never cross a scale row-block.
// Weights are prefetched ahead along each row (weight_prefetch.h): with 16 cores streaming, the hardware
// prefetchers alone leave 10-35% of the read bandwidth unused (bench/RESULTS.md).
//
// mxfp4 weights become exact bfloat16 through a nibble table and meet bfloat16 activations in vdpbf16ps, the
// e8m0 scale applied per 32-element group (below).
//
// int8 and int4 weights meet int8 activations in vpdpbusd (unsigned x signed bytes): int8 weights with
// their sign bit flipped (q + 128), int4 nibbles as stored (q + 8); the offset times the group's sum
// of activations is subtracted through the accumulator's initial value. Group scales apply once per
// group to the converted sums.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>
#include <vector>

#include "expert_kernels.h"
#include "fp8_shift_expansion.h"
#include "fp8_special.h"
#include "numeric_formats.h"
#include "weight_prefetch.h"

#define HJ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,avx2,fma,f16c")))

namespace hybridjit {
namespace {

int64_t RoundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
int64_t Blocks(int64_t cols, int64_t block) { return (cols + block - 1) / block; }

// The first n (< 64) lanes.
HJ_AVX512 __mmask64 FirstLanes64(int64_t n) { return n >= 64 ? ~__mmask64{0} : (__mmask64{1} << n) - 1; }
HJ_AVX512 __mmask32 FirstLanes32(int64_t n) { return n >= 32 ? ~__mmask32{0} : (__mmask32{1} << n) - 1; }
HJ_AVX512 __mmask16 FirstLanes16(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }

// Calls step(c, n) for the steps of kSize elements that cover [c0, c1): the whole ones in a loop where n is the
// constant kSize, so that a step's masks and branches on n fold away (a masked load on every step streams from
// memory at under half the rate on Zen 5, bench/RESULTS.md), then the row's partial last one, if any.
template <int64_t kSize, typename Step>
HJ_AVX512 inline __attribute__((always_inline)) void ForSteps(int64_t c0, int64_t c1, Step step) {
  const int64_t whole_end = c0 + (c1 - c0) / kSize * kSize;
  for (int64_t c = c0; c < whole_end; c += kSize) step(c, kSize);
  if (whole_end < c1) step(whole_end, c1 - whole_end);
}

// Converts one token's row (float32 or bfloat16) to float32.
HJ_AVX512 void LoadFloatRow(const ActivationRows& rows, int64_t i, int64_t cols, float* out) {
  const void* src = rows.Row(i);
  if (!rows.bf16) {
    std::memcpy(out, src, cols * sizeof(float));
    return;
  }
  const auto* bits = static_cast<const uint16_t*>(src);
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 k = FirstLanes16(cols - c);
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, bits + c));
    _mm512_mask_storeu_ps(out + c, k, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
  }
}

// ---- bf16 / fp8 ----------------------------------------------------------------------------------------
// Weights are read 64 elements a step (64 FP8 bytes, or two vectors of 32 bfloat16) from each scale
// block's start; a row's last step may be partial (masked loads, zeros beyond). Packed activations: per
// token and per block (FP8: block_cols; bf16: the whole row), bfloat16[RoundUp(block, 64)], zero beyond
// the block. The FP8 expansion leaves a step's even elements in its first vector and the odd ones in
// its second (the low and high byte of each 16-bit lane): FP8 activations are packed in that order.

constexpr int64_t kStep = 64;

int64_t BlockCols(const LayerWeights& layer, int64_t cols) {
  return layer.format == WeightFormat::kFp8E4M3Fn ? layer.block_cols : cols;
}

int64_t Bf16TokenElements(const LayerWeights& layer, int64_t cols) {
  const int64_t block = BlockCols(layer, cols);
  return Blocks(cols, block) * RoundUp(block, kStep);
}

size_t Bf16PackedBytes(const LayerWeights& layer, int64_t tokens, int64_t cols) {
  return tokens * Bf16TokenElements(layer, cols) * sizeof(uint16_t);
}

// Where element i (< 64) of a step sits in the FP8 weights' order.
int64_t Fp8StepPosition(int64_t i) { return i % 2 * 32 + i / 2; }

// Where element j of a scale block sits in the block's packed activations.
int64_t Fp8BlockPosition(int64_t j) { return j / kStep * kStep + Fp8StepPosition(j % kStep); }

// Where FP8 activation column c of a token sits in its packed row.
int64_t Fp8PackedPosition(int64_t c, int64_t block, int64_t block_stride) {
  return c / block * block_stride + Fp8BlockPosition(c % block);
}

HJ_AVX512 void Bf16Pack(const LayerWeights& layer, const ActivationRows& rows, int64_t cols, void* packed) {
  const bool fp8 = layer.format == WeightFormat::kFp8E4M3Fn;
  const int64_t block = BlockCols(layer, cols), block_stride = RoundUp(block, kStep);
  const int64_t stride = Bf16TokenElements(layer, cols);
  thread_local std::vector<uint16_t> bits;
  bits.resize(cols);
  for (int64_t t = 0; t < rows.count; ++t) {
    const void* src = rows.Row(t);
    if (rows.bf16) {
      std::memcpy(bits.data(), src, cols * sizeof(uint16_t));
    } else {
      for (int64_t c = 0; c < cols; ++c) bits[c] = FloatToBf16Bits(static_cast<const float*>(src)[c]);
    }
    auto* out = static_cast<uint16_t*>(packed) + t * stride;
    std::fill(out, out + stride, uint16_t{0});
    // Block by block, so the per-element position needs no division by the block size.
    for (int64_t c0 = 0; c0 < cols; c0 += block, out += block_stride) {
      const int64_t n = std::min(block, cols - c0);
      for (int64_t j = 0; j < n; ++j) out[fp8 ? Fp8BlockPosition(j) : j] = bits[c0 + j];
    }
  }
}

// n (<= 64) weights from element c of a row as two vectors of bfloat16, zero past n. The hot loop calls
// it with n = kStep (a constant): the masks and the branch fold away.
template <WeightFormat F>
HJ_AVX512 inline __attribute__((always_inline)) void LoadStep(const unsigned char* row, int64_t c, int64_t n,
                                                              __m512i* first, __m512i* second) {
  if constexpr (F == WeightFormat::kBf16) {
    const auto* p = reinterpret_cast<const uint16_t*>(row) + c;
    if (n == kStep) {
      *first = _mm512_loadu_si512(p);
      *second = _mm512_loadu_si512(p + 32);
    } else {
      *first = _mm512_maskz_loadu_epi16(FirstLanes32(n), p);
      *second = _mm512_maskz_loadu_epi16(FirstLanes32(std::max<int64_t>(0, n - 32)), p + 32);
    }
  } else {
    const __m512i bytes = n == kStep ? _mm512_loadu_si512(row + c) : _mm512_maskz_loadu_epi8(FirstLanes64(n), row + c);
    ExpandFp8ByShifts(bytes, first, second);
  }
}

template <WeightFormat F, int R, int TC>
HJ_AVX512 void Bf16Tile(const LayerWeights& layer, const Projection& w, int64_t row, const uint16_t* x,
                        int64_t x_stride, int64_t t0, float* out, int64_t out_stride) {
  constexpr bool kScaled = F == WeightFormat::kFp8E4M3Fn;
  constexpr int64_t kBytes = kScaled ? 1 : 2;
  const int64_t cols = w.cols;
  const int64_t row_bytes = layer.RowBytes(cols);
  const TilePrefetch prefetch(row_bytes, R);
  const int64_t block = BlockCols(layer, cols), block_stride = RoundUp(block, kStep);
  const int64_t n_blocks = Blocks(cols, block);
  const float* scales = kScaled ? static_cast<const float*>(w.scale) + (row / layer.block_rows) * n_blocks : nullptr;
  const unsigned char* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = static_cast<const unsigned char*>(w.data) + (row + r) * row_bytes;
  __m512 total[R][TC];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < TC; ++t) total[r][t] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t c0 = b * block, c1 = std::min(cols, c0 + block);
    __m512 acc[R][TC];
    for (int r = 0; r < R; ++r) {
      for (int t = 0; t < TC; ++t) acc[r][t] = _mm512_setzero_ps();
    }
    const auto accumulate = [&](int64_t c, const __m512i* first, const __m512i* second) HJ_AVX512 {
      const int64_t xc = b * block_stride + (c - c0);
      for (int t = 0; t < TC; ++t) {
        const uint16_t* xt = x + (t0 + t) * x_stride + xc;
        const __m512i x_first = _mm512_loadu_si512(xt), x_second = _mm512_loadu_si512(xt + 32);
        for (int r = 0; r < R; ++r) {
          acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)first[r], (__m512bh)x_first);
          acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)second[r], (__m512bh)x_second);
        }
      }
    };
    ForSteps<kStep>(c0, c1, [&](int64_t c, int64_t n) HJ_AVX512 __attribute__((always_inline)) {
      if (n == kStep) prefetch.Rows(rows, c * kBytes, kBytes);  // a step reads kBytes lines of each row
      __m512i first[R], second[R];
      for (int r = 0; r < R; ++r) LoadStep<F>(rows[r], c, n, &first[r], &second[r]);
      accumulate(c, first, second);
    });
    if constexpr (kScaled) {
      const __m512 scale = _mm512_set1_ps(scales[b] * 256.0f);  // the 2^8 of the shift expansion
      for (int r = 0; r < R; ++r) {
        for (int t = 0; t < TC; ++t) total[r][t] = _mm512_fmadd_ps(acc[r][t], scale, total[r][t]);
      }
    } else {
      for (int r = 0; r < R; ++r) {
        for (int t = 0; t < TC; ++t) total[r][t] = _mm512_add_ps(total[r][t], acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < TC; ++t) out[r * out_stride + t0 + t] = _mm512_reduce_add_ps(total[r][t]);
  }
}

// Rows in tiles inside scale row-blocks: 4 rows when there are one or two tokens (the weight stream
// dominates), else one row for chunks of 8, 4, 2, 1 tokens (the conversion is shared by the chunk).
template <typename TileFn>
void ForTiles(int64_t row0, int64_t rows, int64_t block_rows, int64_t tokens, TileFn tile) {
  for (int64_t r = row0; r < row0 + rows;) {
    const int64_t block_end = std::min(row0 + rows, (r / block_rows + 1) * block_rows);
    while (r < block_end) {
      if (tokens <= 2 && block_end - r >= 4) {
        if (tokens == 1) {
          tile(std::integral_constant<int, 4>(), std::integral_constant<int, 1>(), r, 0);
        } else {
          tile(std::integral_constant<int, 4>(), std::integral_constant<int, 2>(), r, 0);
        }
        r += 4;
        continue;
      }
      int64_t t = 0;
      for (; t + 8 <= tokens; t += 8) tile(std::integral_constant<int, 1>(), std::integral_constant<int, 8>(), r, t);
      for (; t + 4 <= tokens; t += 4) tile(std::integral_constant<int, 1>(), std::integral_constant<int, 4>(), r, t);
      for (; t + 2 <= tokens; t += 2) tile(std::integral_constant<int, 1>(), std::integral_constant<int, 2>(), r, t);
      for (; t < tokens; ++t) tile(std::integral_constant<int, 1>(), std::integral_constant<int, 1>(), r, t);
      r += 1;
    }
  }
}

template <WeightFormat F>
HJ_AVX512 void Bf16Gemm(const LayerWeights& layer, const Projection* w, int n_proj, int64_t row0, int64_t rows,
                        const void* packed, int64_t tokens, float* const* out, int64_t out_stride) {
  const auto* x = static_cast<const uint16_t*>(packed);
  const int64_t xs = Bf16TokenElements(layer, w[0].cols);
  const int64_t block_rows = F == WeightFormat::kFp8E4M3Fn ? layer.block_rows : w[0].rows;
  for (int p = 0; p < n_proj; ++p) {
    ForTiles(row0, rows, block_rows, tokens, [&](auto R, auto TC, int64_t r, int64_t t) {
      Bf16Tile<F, decltype(R)::value, decltype(TC)::value>(layer, w[p], r, x, xs, t, out[p] + (r - row0) * out_stride,
                                                           out_stride);
    });
    if constexpr (F == WeightFormat::kFp8E4M3Fn) {
      const int64_t block = BlockCols(layer, w[p].cols), block_stride = RoundUp(block, kStep);
      const auto activation = [&](int64_t t, int64_t c) {
        return Bf16BitsToFloat(x[t * xs + Fp8PackedPosition(c, block, block_stride)]);
      };
      AddFp8Corrections(layer, w[p], row0, rows, tokens, activation, out[p], out_stride);
    }
  }
}

// ---- int8 / int4 ----------------------------------------------------------------------------------------
// Packed activations, per token (64-byte aligned): float scale[groups], int32 correction[groups]
// (-offset * sum of the group's q: 128 for int8, 8 for int4), then q[kp]; for int4 de-interleaved per
// 128-element chunk, the 64 even elements then the 64 odd ones (matching the low and high nibbles of
// 64 weight bytes).

constexpr int64_t kInt8Chunk = 64;
constexpr int64_t kInt4Chunk = 128;

struct IntLayout {
  int64_t groups, kp, token_bytes;
  size_t scales = 0, corr, q;
};

IntLayout MakeIntLayout(const LayerWeights& layer, int64_t cols) {
  IntLayout l;
  l.groups = Blocks(cols, layer.block_cols);
  l.kp = RoundUp(cols, layer.format == WeightFormat::kInt4 ? kInt4Chunk : kInt8Chunk);
  l.corr = RoundUp(l.groups * 4, 64);
  l.q = l.corr + RoundUp(l.groups * 4, 64);
  l.token_bytes = static_cast<int64_t>(l.q) + l.kp;
  return l;
}

size_t IntPackedBytes(const LayerWeights& layer, int64_t tokens, int64_t cols) {
  return tokens * MakeIntLayout(layer, cols).token_bytes;
}

HJ_AVX512 float AbsMaxAvx512(const float* x, int64_t n) {
  __m512i m = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512i bits = _mm512_maskz_loadu_epi32(FirstLanes16(n - i), x + i);
    m = _mm512_max_epu32(m, _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)));
  }
  const uint32_t amax = _mm512_reduce_max_epu32(m);
  float value;
  std::memcpy(&value, &amax, sizeof value);
  return value;
}

// As QuantizeInt8 (same scale and rounding); returns the scale, and the sum of q in *sum.
HJ_AVX512 float QuantizeGroup(const float* x, int64_t n, int8_t* q, int32_t* sum) {
  const float amax = AbsMaxAvx512(x, n);
  if (amax == 0.0f || !std::isfinite(amax)) {
    *sum = 0;
    return QuantizeInt8(x, n, q);
  }
  const __m512 inv = _mm512_set1_ps(127.0f / amax);
  __m512i total = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = FirstLanes16(n - i);
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), inv));
    total = _mm512_add_epi32(total, v);
    _mm_mask_storeu_epi8(q + i, k, _mm512_cvtsepi32_epi8(v));
  }
  *sum = _mm512_reduce_add_epi32(total);
  return Int8Scale(amax);
}

HJ_AVX512 void IntPack(const LayerWeights& layer, const ActivationRows& rows, int64_t cols, void* packed) {
  const IntLayout l = MakeIntLayout(layer, cols);
  const bool int4 = layer.format == WeightFormat::kInt4;
  const int32_t offset = int4 ? 8 : 128;
  thread_local std::vector<float> x;
  thread_local std::vector<int8_t> q;
  x.resize(cols);
  q.assign(l.kp, 0);
  for (int64_t t = 0; t < rows.count; ++t) {
    LoadFloatRow(rows, t, cols, x.data());
    char* token = static_cast<char*>(packed) + t * l.token_bytes;
    auto* scales = reinterpret_cast<float*>(token + l.scales);
    auto* corr = reinterpret_cast<int32_t*>(token + l.corr);
    for (int64_t g = 0; g < l.groups; ++g) {
      const int64_t begin = g * layer.block_cols;
      int32_t sum;
      scales[g] = QuantizeGroup(x.data() + begin, std::min(layer.block_cols, cols - begin), q.data() + begin, &sum);
      corr[g] = -offset * sum;
    }
    auto* out = reinterpret_cast<int8_t*>(token + l.q);
    if (int4) {
      for (int64_t c = 0; c < l.kp; c += kInt4Chunk) {
        for (int64_t i = 0; i < kInt4Chunk / 2; ++i) {
          out[c + i] = q[c + 2 * i];
          out[c + kInt4Chunk / 2 + i] = q[c + 2 * i + 1];
        }
      }
    } else {
      std::memcpy(out, q.data(), l.kp);
    }
  }
}

template <bool kInt4, int R, int TC>
HJ_AVX512 void IntTile(const LayerWeights& layer, const Projection& w, int64_t row, const char* packed,
                       const IntLayout& l, int64_t t0, float* out, int64_t out_stride) {
  const int64_t cols = w.cols;
  const int64_t row_bytes = layer.RowBytes(cols);
  const unsigned char* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = static_cast<const unsigned char*>(w.data) + (row + r) * row_bytes;
  const char* tokens[TC];
  for (int t = 0; t < TC; ++t) tokens[t] = packed + (t0 + t) * l.token_bytes;
  const TilePrefetch prefetch(row_bytes, R);
  const __m512i low_nibbles = _mm512_set1_epi8(0x0f);
  const __m512i sign_bit = _mm512_set1_epi8(-128);
  __m512 total[R][TC];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < TC; ++t) total[r][t] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < l.groups; ++g) {
    const int64_t c0 = g * layer.block_cols, c1 = std::min(cols, c0 + layer.block_cols);
    __m512i acc[R][TC];
    for (int t = 0; t < TC; ++t) {
      const int32_t corr = reinterpret_cast<const int32_t*>(tokens[t] + l.corr)[g];
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_maskz_set1_epi32(1, corr);
    }
    if constexpr (kInt4) {
      ForSteps<kInt4Chunk>(c0, c1, [&](int64_t c, int64_t n) HJ_AVX512 __attribute__((always_inline)) {
        if (n == kInt4Chunk) prefetch.Rows(rows, c / 2);
        __m512i lo[R], hi[R];
        for (int r = 0; r < R; ++r) {
          const unsigned char* at = rows[r] + c / 2;
          const __m512i v =
              n == kInt4Chunk ? _mm512_loadu_si512(at) : _mm512_maskz_loadu_epi8(FirstLanes64((n + 1) / 2), at);
          lo[r] = _mm512_and_si512(v, low_nibbles);
          hi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low_nibbles);
        }
        for (int t = 0; t < TC; ++t) {
          const char* xq = tokens[t] + l.q + c;
          const __m512i even = _mm512_loadu_si512(xq), odd = _mm512_loadu_si512(xq + 64);
          for (int r = 0; r < R; ++r) {
            acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], lo[r], even);
            acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], hi[r], odd);
          }
        }
      });
    } else {
      ForSteps<kInt8Chunk>(c0, c1, [&](int64_t c, int64_t n) HJ_AVX512 __attribute__((always_inline)) {
        if (n == kInt8Chunk) prefetch.Rows(rows, c);
        __m512i wv[R];
        // Lanes past the row load as 0 and flip to 128, against activations padded with 0.
        for (int r = 0; r < R; ++r) {
          const unsigned char* at = rows[r] + c;
          const __m512i v = n == kInt8Chunk ? _mm512_loadu_si512(at) : _mm512_maskz_loadu_epi8(FirstLanes64(n), at);
          wv[r] = _mm512_xor_si512(v, sign_bit);
        }
        for (int t = 0; t < TC; ++t) {
          const __m512i xq = _mm512_loadu_si512(tokens[t] + l.q + c);
          for (int r = 0; r < R; ++r) acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], wv[r], xq);
        }
      });
    }
    for (int r = 0; r < R; ++r) {
      float ws;
      std::memcpy(&ws, static_cast<const float*>(w.scale) + (row + r) * l.groups + g, sizeof ws);
      for (int t = 0; t < TC; ++t) {
        const float xs = reinterpret_cast<const float*>(tokens[t] + l.scales)[g];
        total[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][t]), _mm512_set1_ps(ws * xs), total[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < TC; ++t) out[r * out_stride + t0 + t] = _mm512_reduce_add_ps(total[r][t]);
  }
}

template <bool kInt4>
HJ_AVX512 void IntGemm(const LayerWeights& layer, const Projection* w, int n_proj, int64_t row0, int64_t rows,
                       const void* packed, int64_t tokens, float* const* out, int64_t out_stride) {
  const IntLayout l = MakeIntLayout(layer, w[0].cols);
  const char* x = static_cast<const char*>(packed);
  for (int p = 0; p < n_proj; ++p) {
    ForTiles(row0, rows, w[0].rows, tokens, [&](auto R, auto TC, int64_t r, int64_t t) {
      IntTile<kInt4, decltype(R)::value, decltype(TC)::value>(layer, w[p], r, x, l, t, out[p] + (r - row0) * out_stride,
                                                              out_stride);
    });
  }
}

// ---- mxfp4 ----------------------------------------------------------------------------------------------
// A step reads 128 elements of a row: 64 bytes, four scale groups. Each 16-bit lane holds four nibbles (elements
// 4i..4i+3 of the step); shifted by 0, 4, 8 and 12 bits it indexes a bfloat16 table directly (vpermw reads the low
// 5 bits of each index: the table's two halves are the same 16 entries, so the next nibble's low bit does not
// matter). Every e2m1 value is exact in bfloat16, and normal, so vdpbf16ps's denormal flushing loses nothing.
// vdpbf16ps sums lane pairs, so lane j of each of the four products holds elements 8j..8j+7 of the step, in group
// j / 4: the four sum into one vector, multiplied once by its lanes' scales. The scales are made 16 groups at a
// time (their e8m0 bytes shifted into float exponents) and permuted per step. Packed activations: per token
// bfloat16[RoundUp(cols, 128)], each step's elements 4i + s at 32 s + i, zero beyond cols.

constexpr int64_t kMxfp4Step = 128;
constexpr int64_t kMxfp4Scales = 16 * kMxfp4Block;  // elements of one scale vector

int64_t Mxfp4TokenElements(int64_t cols) { return RoundUp(cols, kMxfp4Step); }

size_t Mxfp4PackedBytes(const LayerWeights&, int64_t tokens, int64_t cols) {
  return tokens * Mxfp4TokenElements(cols) * sizeof(uint16_t);
}

HJ_AVX512 void Mxfp4Pack(const LayerWeights&, const ActivationRows& rows, int64_t cols, void* packed) {
  const int64_t stride = Mxfp4TokenElements(cols);
  for (int64_t t = 0; t < rows.count; ++t) {
    const void* src = rows.Row(t);
    auto* out = static_cast<uint16_t*>(packed) + t * stride;
    std::fill(out + cols / kMxfp4Step * kMxfp4Step, out + stride, uint16_t{0});  // a partial last step's gaps
    for (int64_t c = 0; c < cols; ++c) {
      const uint16_t bits = rows.bf16 ? static_cast<const uint16_t*>(src)[c]
                                      : FloatToBf16Bits(static_cast<const float*>(src)[c]);
      const int64_t e = c % kMxfp4Step;
      out[c - e + e % 4 * (kMxfp4Step / 4) + e / 4] = bits;
    }
  }
}

// bfloat16 of each e2m1 nibble, twice (vpermw reads a 32-entry table).
alignas(64) constexpr uint16_t kE2m1Bf16[32] = {0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0,
                                                0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0,
                                                0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0,
                                                0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0};

// 16 e8m0 scale bytes as float32, as E8m0Table: 2^(e - 127) is e in the exponent field for e = 1..254; the table's
// own values for 0 (a denormal) and 255 (NaN).
HJ_AVX512 inline __m512 E8m0Vector(__m128i bytes, const std::array<float, 256>& e8m0) {
  const __m512i e = _mm512_cvtepu8_epi32(bytes);
  __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  scale = _mm512_mask_mov_ps(scale, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()), _mm512_set1_ps(e8m0[0]));
  return _mm512_mask_mov_ps(scale, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)), _mm512_set1_ps(e8m0[255]));
}

template <int R, int TC>
HJ_AVX512 void Mxfp4Tile(const LayerWeights& layer, const Projection& w, int64_t row, const uint16_t* x,
                         int64_t x_stride, int64_t t0, float* out, int64_t out_stride) {
  const int64_t cols = w.cols, row_bytes = layer.RowBytes(cols), groups = cols / kMxfp4Block;
  const TilePrefetch prefetch(row_bytes, R);
  const std::array<float, 256>& e8m0 = E8m0Table();
  const unsigned char* rows[R];
  const uint8_t* scales[R];
  for (int r = 0; r < R; ++r) {
    rows[r] = static_cast<const unsigned char*>(w.data) + (row + r) * row_bytes;
    scales[r] = static_cast<const uint8_t*>(w.scale) + (row + r) * groups;
  }
  const __m512i table = _mm512_load_si512(kE2m1Bf16);
  const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  __m512 total[R][TC];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < TC; ++t) total[r][t] = _mm512_setzero_ps();
  }
  // Step `k` of a scale vector's four, n (<= 128) elements from c; a partial one reads zeros past the row.
  const auto step = [&](int64_t c, int64_t n, const __m512 (&scale)[R], int k)
                        HJ_AVX512 __attribute__((always_inline)) {
    if (n == kMxfp4Step) prefetch.Rows(rows, c / 2);
    const __m512i pick = _mm512_add_epi32(quarter, _mm512_set1_epi32(4 * k));
    for (int r = 0; r < R; ++r) {
      const unsigned char* at = rows[r] + c / 2;
      const __m512i v = n == kMxfp4Step ? _mm512_loadu_si512(at) : _mm512_maskz_loadu_epi8(FirstLanes64(n / 2), at);
      const __m512i w0 = _mm512_permutexvar_epi16(v, table);
      const __m512i w1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
      const __m512i w2 = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), table);
      const __m512i w3 = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), table);
      const __m512 s = _mm512_permutexvar_ps(pick, scale[r]);
      for (int t = 0; t < TC; ++t) {
        const uint16_t* xt = x + (t0 + t) * x_stride + c;
        __m512 sums = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)w0, (__m512bh)_mm512_loadu_si512(xt));
        sums = _mm512_dpbf16_ps(sums, (__m512bh)w1, (__m512bh)_mm512_loadu_si512(xt + 32));
        sums = _mm512_dpbf16_ps(sums, (__m512bh)w2, (__m512bh)_mm512_loadu_si512(xt + 64));
        sums = _mm512_dpbf16_ps(sums, (__m512bh)w3, (__m512bh)_mm512_loadu_si512(xt + 96));
        total[r][t] = _mm512_fmadd_ps(sums, s, total[r][t]);
      }
    }
  };
  __m512 scale[R];
  int64_t c = 0;
  for (; c + kMxfp4Scales <= cols; c += kMxfp4Scales) {
    for (int r = 0; r < R; ++r) {
      scale[r] = E8m0Vector(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales[r] + c / kMxfp4Block)), e8m0);
    }
    for (int k = 0; k < 4; ++k) step(c + k * kMxfp4Step, kMxfp4Step, scale, k);
  }
  if (c < cols) {  // the row's last groups: their scales alone are read
    const __mmask16 left = FirstLanes16((cols - c) / kMxfp4Block);
    for (int r = 0; r < R; ++r) scale[r] = E8m0Vector(_mm_maskz_loadu_epi8(left, scales[r] + c / kMxfp4Block), e8m0);
    for (int k = 0; c < cols; ++k, c += kMxfp4Step) step(c, std::min(kMxfp4Step, cols - c), scale, k);
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < TC; ++t) out[r * out_stride + t0 + t] = _mm512_reduce_add_ps(total[r][t]);
  }
}

HJ_AVX512 void Mxfp4Gemm(const LayerWeights& layer, const Projection* w, int n_proj, int64_t row0, int64_t rows,
                         const void* packed, int64_t tokens, float* const* out, int64_t out_stride) {
  const auto* x = static_cast<const uint16_t*>(packed);
  const int64_t xs = Mxfp4TokenElements(w[0].cols);
  for (int p = 0; p < n_proj; ++p) {
    ForTiles(row0, rows, w[p].rows, tokens, [&](auto R, auto TC, int64_t r, int64_t t) {
      Mxfp4Tile<decltype(R)::value, decltype(TC)::value>(layer, w[p], r, x, xs, t, out[p] + (r - row0) * out_stride,
                                                         out_stride);
    });
  }
}

constexpr GemmKernel kBf16{"avx512", 1, Bf16PackedBytes, Bf16Pack, Bf16Gemm<WeightFormat::kBf16>};
constexpr GemmKernel kFp8{"avx512", 1, Bf16PackedBytes, Bf16Pack, Bf16Gemm<WeightFormat::kFp8E4M3Fn>};
constexpr GemmKernel kInt8{"avx512", 1, IntPackedBytes, IntPack, IntGemm<false>};
constexpr GemmKernel kInt4{"avx512", 1, IntPackedBytes, IntPack, IntGemm<true>};
constexpr GemmKernel kMxfp4{"avx512", 1, Mxfp4PackedBytes, Mxfp4Pack, Mxfp4Gemm};

}  // namespace

const GemmKernel* Avx512Kernel(const LayerWeights& layer) {
  switch (layer.format) {
    case WeightFormat::kF32:
      return nullptr;  // the AVX2 FMA kernel: float32 weights gain nothing from bfloat16 dot products
    case WeightFormat::kBf16:
      return &kBf16;
    case WeightFormat::kFp8E4M3Fn:
      return &kFp8;
    case WeightFormat::kInt8:
      return &kInt8;
    case WeightFormat::kInt4:
      return &kInt4;
    case WeightFormat::kMxfp4:
      return &kMxfp4;
    case WeightFormat::kQ8_0:
    case WeightFormat::kQ4K:
    case WeightFormat::kQ5K:
    case WeightFormat::kQ6K:
      return GgufAvx512Kernel(layer);
  }
  return nullptr;
}

}  // namespace hybridjit
