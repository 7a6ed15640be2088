// AVX-512 kernels (F, BW, VL, DQ, BF16, VNNI, VBMI): the GEMV of decode, memory-bound by design.
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
// mxfp4 weights become doubled e2m1 integers through a nibble table and meet activations quantized to 15 bits (two
// int8 halves) in vpdpbusd, one float multiply-add per step applying each 32-element group's e8m0 scale (below).
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
#include "gguf_blocks.h"
#include "int8_quantize_avx512.h"
#include "numeric_formats.h"
#include "weight_prefetch.h"

#define HJ_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,avx512vbmi,avx2,fma,f16c")))

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

// From kManyTokens tokens an expert's multiply is compute-bound, and a one-row tile loads each token's activations
// once per multiply-add: tiles of R rows x TC tokens (kept inside scale row-blocks) reuse each activation load R times
// and each weight load TC times. One tile of R rows x 1 token takes the last tokens, one row x 1 token the rows left
// in a block. Chosen on the 2-core Zen 5 dev box (bench/RESULTS.md, session 35): bf16 4 x 6, 2.0x the one-row tiles
// at DeepSeek-V3's shapes; fp8, whose block scales keep a second set of accumulators, 2 x 6, 1.4-1.6x; mxfp4 2 x 4.
constexpr int64_t kManyTokens = 16;

template <int R, int TC, typename TileFn>
void ForManyTokenTiles(int64_t row0, int64_t rows, int64_t block_rows, int64_t tokens, TileFn tile) {
  for (int64_t r = row0; r < row0 + rows;) {
    const int64_t block_end = std::min(row0 + rows, (r / block_rows + 1) * block_rows);
    for (; r + R <= block_end; r += R) {
      int64_t t = 0;
      for (; t + TC <= tokens; t += TC) tile(std::integral_constant<int, R>(), std::integral_constant<int, TC>(), r, t);
      for (; t < tokens; ++t) tile(std::integral_constant<int, R>(), std::integral_constant<int, 1>(), r, t);
    }
    for (; r < block_end; ++r) {
      for (int64_t t = 0; t < tokens; ++t) tile(std::integral_constant<int, 1>(), std::integral_constant<int, 1>(), r, t);
    }
  }
}

// ForTiles' decode tiles below kManyTokens tokens, ForManyTokenTiles' R x TC from there.
template <int R, int TC, typename TileFn>
void ForTilesByTokens(int64_t row0, int64_t rows, int64_t block_rows, int64_t tokens, TileFn tile) {
  if (tokens >= kManyTokens) {
    ForManyTokenTiles<R, TC>(row0, rows, block_rows, tokens, tile);
  } else {
    ForTiles(row0, rows, block_rows, tokens, tile);
  }
}

template <WeightFormat F>
HJ_AVX512 void Bf16Gemm(const LayerWeights& layer, const Projection* w, int n_proj, int64_t row0, int64_t rows,
                        const void* packed, int64_t tokens, float* const* out, int64_t out_stride) {
  const auto* x = static_cast<const uint16_t*>(packed);
  const int64_t xs = Bf16TokenElements(layer, w[0].cols);
  const int64_t block_rows = F == WeightFormat::kFp8E4M3Fn ? layer.block_rows : w[0].rows;
  for (int p = 0; p < n_proj; ++p) {
    const auto tile = [&](auto R, auto TC, int64_t r, int64_t t) HJ_AVX512 {
      Bf16Tile<F, decltype(R)::value, decltype(TC)::value>(layer, w[p], r, x, xs, t, out[p] + (r - row0) * out_stride,
                                                           out_stride);
    };
    ForTilesByTokens<F == WeightFormat::kBf16 ? 4 : 2, 6>(row0, rows, block_rows, tokens, tile);
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
      scales[g] = QuantizeInt8Avx512(x.data() + begin, std::min(layer.block_cols, cols - begin), q.data() + begin,
                                     &sum);
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
// int8 VNNI. Every e2m1 value doubled is an integer in [-12, 12]: a byte table gives it plus 12 (unsigned) for
// vpdpbusd. The activations are quantized per 32-element group (the e8m0 scale group) to 15 bits, Q = rint(x *
// 16256 / max|x|) (16256 = 127 * 128), and Q = 128 * big + small is split into two int8 halves, big in
// [-127, 127] and small in [-64, 63]: two vpdpbusd per half, and the first half's sums shifted left by 7 before
// the second's join them. One int8 alone (127 levels per group, as the int8 kernels quantize) made the gpt-oss
// layer ~5x less accurate than bfloat16 activations (1.2e-2 against 2e-3 relative RMS); 15 bits are finer than
// bfloat16 for every element above 1/64 of its group's maximum. 12 * the sum of each group's Q, which the offset
// added, is subtracted in float32 (one multiply-add per 16 groups). The exact bfloat16 route before (nibbles to
// bfloat16 by vpermw, vdpbf16ps) took ~18 cycles per 64-byte step and row with the weights in L2, this one ~10 (the
// 2-core dev Xeon): there vdpbf16ps zmm issues once per two cycles (latency 8), vpdpbusd twice a cycle.
// A step reads 128 elements of a row, 64 bytes: vpermb looks up the low nibbles (element 2i of byte i) from the
// low 6 bits of each byte, the high ones after a 4-bit word shift (the table repeats its 16 entries, so the bits
// above a nibble do not matter). The low nibbles meet the step's even activations, the high ones its odd ones, so
// dword lane j sums elements 8j..8j+7, in group j / 4: one conversion and one multiply-add per step apply every
// lane's scale (the weights' 2^(e - 127) times the activations' max|x| / 16256 / 2, made 16 groups at a time,
// permuted per step). Packed activations, per token: per step, int8 big[64 even elements], big[64 odd ones],
// small[64 even], small[64 odd]; then per group float scale[] (max|x| / 16256 / 2) and float corr[] (-12 * the
// sum of its Q), each RoundUp(groups, 16) long; zero past cols, so that a partial last step's weights, loaded as
// zeros, add nothing.

constexpr int64_t kMxfp4Step = 128;
constexpr int64_t kMxfp4Scales = 16 * kMxfp4Block;  // elements of one scale vector
constexpr int kMxfp4Offset = 12;                    // added to each doubled e2m1 value
constexpr float kMxfp4Levels = 127 * 128;           // Q of a group's largest magnitude

struct Mxfp4Layout {
  int64_t kp, scales, corr, token_bytes;
};

Mxfp4Layout MakeMxfp4Layout(int64_t cols) {
  Mxfp4Layout l;
  l.kp = RoundUp(cols, kMxfp4Step);
  const int64_t groups = RoundUp(l.kp / kMxfp4Block, 16);
  l.scales = 2 * l.kp;
  l.corr = l.scales + groups * 4;
  l.token_bytes = RoundUp(l.corr + groups * 4, 64);
  return l;
}

size_t Mxfp4PackedBytes(const LayerWeights&, int64_t tokens, int64_t cols) {
  return tokens * MakeMxfp4Layout(cols).token_bytes;
}

// Quantizes the 32 values at x to Q (see above), written as its halves big[32] and small[32]; returns max|x| / 16256,
// the unit of Q (0 for a group of zeros; non-finite, with Q = 0, for a group with a NaN or an infinity, so that its
// products are NaN, as QuantizeInt8's), and the sum of Q in *sum.
HJ_AVX512 float Mxfp4QuantizeGroup(const float* x, int8_t* big, int8_t* small, int32_t* sum) {
  const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  const uint32_t bits = _mm512_reduce_max_epu32(_mm512_max_epu32(
      _mm512_and_si512(_mm512_castps_si512(x0), magnitude), _mm512_and_si512(_mm512_castps_si512(x1), magnitude)));
  float amax;
  std::memcpy(&amax, &bits, sizeof amax);
  const bool finite = amax != 0.0f && std::isfinite(amax);
  const __m512 inv = _mm512_set1_ps(kMxfp4Levels / amax);
  const __mmask16 keep = finite ? 0xffff : 0;
  const __m512i q[2] = {_mm512_maskz_cvtps_epi32(keep, _mm512_mul_ps(x0, inv)),
                        _mm512_maskz_cvtps_epi32(keep, _mm512_mul_ps(x1, inv))};
  for (int i = 0; i < 2; ++i) {
    const __m512i high = _mm512_srai_epi32(_mm512_add_epi32(q[i], _mm512_set1_epi32(64)), 7);  // round(Q / 128)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(big + 16 * i), _mm512_cvtepi32_epi8(high));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(small + 16 * i),
                     _mm512_cvtepi32_epi8(_mm512_sub_epi32(q[i], _mm512_slli_epi32(high, 7))));
  }
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q[0], q[1]));
  return finite ? amax / kMxfp4Levels : amax;
}

HJ_AVX512 void Mxfp4Pack(const LayerWeights&, const ActivationRows& rows, int64_t cols, void* packed) {
  const Mxfp4Layout l = MakeMxfp4Layout(cols);
  // Bytes 2i and 2i + 1 of two vectors, i < 64: a step's even elements, and its odd ones.
  alignas(64) static const std::array<uint8_t, 64> even = [] {
    std::array<uint8_t, 64> e{};
    for (int i = 0; i < 64; ++i) e[i] = static_cast<uint8_t>(2 * i);
    return e;
  }();
  const __m512i pick_even = _mm512_load_si512(even.data());
  const __m512i pick_odd = _mm512_add_epi8(pick_even, _mm512_set1_epi8(1));
  thread_local std::vector<float> x;
  thread_local std::vector<int8_t> halves;  // big[kp], then small[kp], in the elements' order
  x.assign(l.kp, 0.0f);
  halves.resize(2 * l.kp);
  for (int64_t t = 0; t < rows.count; ++t) {
    LoadFloatRow(rows, t, cols, x.data());
    char* token = static_cast<char*>(packed) + t * l.token_bytes;
    auto* scales = reinterpret_cast<float*>(token + l.scales);
    auto* corr = reinterpret_cast<float*>(token + l.corr);
    std::fill(scales, reinterpret_cast<float*>(token + l.token_bytes), 0.0f);
    for (int64_t g = 0; g < l.kp / kMxfp4Block; ++g) {
      const int64_t c = g * kMxfp4Block;
      int32_t sum;
      scales[g] = 0.5f * Mxfp4QuantizeGroup(x.data() + c, halves.data() + c, halves.data() + l.kp + c, &sum);
      corr[g] = static_cast<float>(-kMxfp4Offset * sum);
    }
    for (int64_t c = 0; c < l.kp; c += kMxfp4Step) {
      for (int h = 0; h < 2; ++h) {
        const int8_t* q = halves.data() + h * l.kp + c;
        const __m512i first = _mm512_loadu_si512(q), second = _mm512_loadu_si512(q + 64);
        _mm512_storeu_si512(token + 2 * c + 128 * h, _mm512_permutex2var_epi8(first, pick_even, second));
        _mm512_storeu_si512(token + 2 * c + 128 * h + 64, _mm512_permutex2var_epi8(first, pick_odd, second));
      }
    }
  }
}

// 2 * e2m1 + 12 of each nibble (bit 3 the sign), four times (vpermb reads a 64-entry table).
alignas(64) constexpr uint8_t kE2m1Doubled[64] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                                  12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                                  12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                                  12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// The exponents 2^e of 16 e8m0 scale bytes' values, as float32 for vscalefps: e - 127 for bytes 0..254 (0 gives
// -127: scaling by 2^-127 rounds once, as multiplying by E8m0Table's denormal does), NaN for 255. vgetexpps reads
// them from the bytes in the exponent field over a nonzero mantissa: a denormal for 0, and a NaN for 255.
HJ_AVX512 inline __m512 E8m0Exponents(__m128i bytes) {
  const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu8_epi32(bytes), 23);
  return _mm512_getexp_ps(_mm512_castsi512_ps(_mm512_or_si512(bits, _mm512_set1_epi32(0x00400000))));
}

// Each step prefetches the tile's rows twice: far ahead into L2 (4x the one-level distance of the other kernels),
// and 512 bytes ahead into L1. With one prefetch into L1 at the usual distance a thread streamed ~10% slower (the
// 2-core dev Xeon, one thread, weights in DRAM): each request holds one of the core's few line fill buffers for
// its whole memory latency.
struct Mxfp4Prefetch {
  Mxfp4Prefetch(int64_t row_bytes, int rows)
      : far(row_bytes, rows, 4 * WeightPrefetchBytes()), near(row_bytes, rows, WeightPrefetchBytes() ? 512 : 0) {}
  TilePrefetch far, near;
};

template <int R, int TC>
HJ_AVX512 void Mxfp4Tile(const Projection& w, int64_t row_bytes, const Mxfp4Prefetch& prefetch, int64_t row,
                         const char* packed, const Mxfp4Layout& l, int64_t t0, float* out, int64_t out_stride) {
  const int64_t cols = w.cols, groups = cols / kMxfp4Block;
  const unsigned char* rows[R];
  const uint8_t* scales[R];
  for (int r = 0; r < R; ++r) {
    rows[r] = static_cast<const unsigned char*>(w.data) + (row + r) * row_bytes;
    scales[r] = static_cast<const uint8_t*>(w.scale) + (row + r) * groups;
  }
  const char* tokens[TC];
  for (int t = 0; t < TC; ++t) tokens[t] = packed + (t0 + t) * l.token_bytes;
  const __m512i table = _mm512_load_si512(kE2m1Doubled);
  const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  __m512 total[R][TC];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < TC; ++t) total[r][t] = _mm512_setzero_ps();
  }
  // Step `k` of a scale vector's four, n (<= 128) elements from c; a partial one reads zeros past the row.
  const auto step = [&](int64_t c, int64_t n, const __m512 (&scale)[R][TC], int k)
                        HJ_AVX512 __attribute__((always_inline)) {
    if (n == kMxfp4Step) {
      prefetch.far.Rows<R, true>(rows, c / 2);
      prefetch.near.Rows(rows, c / 2);
    }
    const __m512i pick = _mm512_add_epi32(quarter, _mm512_set1_epi32(4 * k));
    __m512i even[R], odd[R];
    for (int r = 0; r < R; ++r) {
      const unsigned char* at = rows[r] + c / 2;
      const __m512i v = n == kMxfp4Step ? _mm512_loadu_si512(at) : _mm512_maskz_loadu_epi8(FirstLanes64(n / 2), at);
      even[r] = _mm512_permutexvar_epi8(v, table);
      odd[r] = _mm512_permutexvar_epi8(_mm512_srli_epi16(v, 4), table);
    }
    for (int t = 0; t < TC; ++t) {
      const char* x = tokens[t] + 2 * c;
      const __m512i big_even = _mm512_loadu_si512(x), big_odd = _mm512_loadu_si512(x + 64);
      const __m512i small_even = _mm512_loadu_si512(x + 128), small_odd = _mm512_loadu_si512(x + 192);
      for (int r = 0; r < R; ++r) {
        const __m512i big = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), even[r], big_even), odd[r],
                                                big_odd);
        const __m512i sums =
            _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(big, 7), even[r], small_even), odd[r], small_odd);
        total[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_permutexvar_ps(pick, scale[r][t]), total[r][t]);
      }
    }
  };
  // The scales of the 16 groups from c, as many as the row has left, and their corrections (lanes past the row
  // have zero activations, whatever their weights' scale).
  const auto make_scales = [&](int64_t c, __m512 (&scale)[R][TC]) HJ_AVX512 __attribute__((always_inline)) {
    const int64_t g = c / kMxfp4Block;
    const __mmask16 left = FirstLanes16(groups - g);
    for (int r = 0; r < R; ++r) {
      const __m512 exponents = E8m0Exponents(_mm_maskz_loadu_epi8(left, scales[r] + g));
      for (int t = 0; t < TC; ++t) {
        const auto* x = reinterpret_cast<const float*>(tokens[t]);
        scale[r][t] = _mm512_scalef_ps(_mm512_loadu_ps(x + l.scales / 4 + g), exponents);
        total[r][t] = _mm512_fmadd_ps(scale[r][t], _mm512_loadu_ps(x + l.corr / 4 + g), total[r][t]);
      }
    }
  };
  __m512 scale[R][TC];
  int64_t c = 0;
  for (; c + kMxfp4Scales <= cols; c += kMxfp4Scales) {
    make_scales(c, scale);
    for (int k = 0; k < 4; ++k) step(c + k * kMxfp4Step, kMxfp4Step, scale, k);
  }
  if (c < cols) {  // the row's last groups
    make_scales(c, scale);
    for (int k = 0; c < cols; ++k, c += kMxfp4Step) step(c, std::min(kMxfp4Step, cols - c), scale, k);
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < TC; ++t) out[r * out_stride + t0 + t] = _mm512_reduce_add_ps(total[r][t]);
  }
}

HJ_AVX512 void Mxfp4Gemm(const LayerWeights& layer, const Projection* w, int n_proj, int64_t row0, int64_t rows,
                         const void* packed, int64_t tokens, float* const* out, int64_t out_stride) {
  const Mxfp4Layout l = MakeMxfp4Layout(w[0].cols);
  const int64_t row_bytes = layer.RowBytes(w[0].cols);
  // The tiles' rows: ForTiles' 4 or 1; from kManyTokens, 2 x 4 tokens (1.58x / 1.24x the one-row tiles at 128 / 16
  // tokens an expert, gpt-oss-120b's shapes on the 2-core Zen 5 dev box, session 35), or 1.
  const Mxfp4Prefetch four(row_bytes, 4), two(row_bytes, 2), one(row_bytes, 1);
  const char* x = static_cast<const char*>(packed);
  for (int p = 0; p < n_proj; ++p) {
    const auto tile = [&](auto R, auto TC, int64_t r, int64_t t) HJ_AVX512 {
      constexpr int kRows = decltype(R)::value;
      Mxfp4Tile<kRows, decltype(TC)::value>(w[p], row_bytes, kRows == 4 ? four : kRows == 2 ? two : one, r, x, l, t,
                                            out[p] + (r - row0) * out_stride, out_stride);
    };
    ForTilesByTokens<2, 4>(row0, rows, w[p].rows, tokens, tile);
  }
}

// Every layout here packs token after token.
constexpr GemmKernel kBf16{"avx512", 1, Bf16PackedBytes, Bf16Pack, Bf16Gemm<WeightFormat::kBf16>, true};
constexpr GemmKernel kFp8{"avx512", 1, Bf16PackedBytes, Bf16Pack, Bf16Gemm<WeightFormat::kFp8E4M3Fn>, true};
constexpr GemmKernel kInt8{"avx512", 1, IntPackedBytes, IntPack, IntGemm<false>, true};
constexpr GemmKernel kInt4{"avx512", 1, IntPackedBytes, IntPack, IntGemm<true>, true};
constexpr GemmKernel kMxfp4{"avx512", 1, Mxfp4PackedBytes, Mxfp4Pack, Mxfp4Gemm, true};

}  // namespace

const GemmKernel* Avx512Kernel(const LayerWeights& layer) {
  if (IsGgufFormat(layer.format)) return GgufAvx512Kernel(layer);
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
    default:  // the GGUF block formats, above
      return nullptr;
  }
}

}  // namespace hybridjit
