// AVX2 + FMA kernels: the fast path of CPUs without AVX-512, and f32 weights everywhere.
//
// f32, bf16 and fp8 weights are widened to float32 in registers and multiplied with float32
// activations. A 16-bit weight becomes a float32 by interleaving it with zero halves (vpunpck*wd),
// which orders a 16-element chunk's lanes as 0-3, 8-11 | 4-7, 12-15: the packed activations of these
// formats are stored in that order. fp8 goes through bfloat16 first, by the shift expansion of
// fp8_special.h (sign-extend the byte, shift E.M into place, OR in a rebias of 112: the FP8 value times
// 2^-8 for normals); the special codes the bank listed are corrected after the tiles. int8 and int4
// weights use int8 activations and vpmaddubsw: int8 as |x| * sign(w, x) (no saturation for weights in
// [-127, 127]), int4 as nibble (q + 8) * x with 8 * sum(x) subtracted per group. mxfp4 nibbles become float32
// through an 8-entry magnitude table (vpermps) and their sign bit, against float32 activations. Weights are prefetched
// as in the AVX-512 kernels (weight_prefetch.h).
//
// Rows are processed R at a time and tokens TC at a time so each weight vector is loaded once for
// R * TC accumulators; scaled formats sum each scale block separately and apply the scale once.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstring>
#include <vector>

#include "expert_kernels.h"
#include "fp8_special.h"
#include "numeric_formats.h"
#include "weight_prefetch.h"

#define HJ_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace hybridjit {
namespace {

int64_t RoundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
int64_t Blocks(int64_t cols, int64_t block) { return (cols + block - 1) / block; }

HJ_AVX2 float HorizontalSum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

HJ_AVX2 __m256 Bf16x8ToFloat(__m128i bits) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)); }

// Loads float32 activations of one token into a padded row (the row's elements beyond `cols` are 0).
HJ_AVX2 void LoadFloatRow(const ActivationRows& rows, int64_t i, int64_t cols, float* out) {
  const void* src = rows.Row(i);
  if (!rows.bf16) {
    std::memcpy(out, src, cols * sizeof(float));
    return;
  }
  const auto* bits = static_cast<const uint16_t*>(src);
  int64_t c = 0;
  for (; c + 8 <= cols; c += 8) {
    _mm256_storeu_ps(out + c, Bf16x8ToFloat(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + c))));
  }
  for (; c < cols; ++c) out[c] = Bf16BitsToFloat(bits[c]);
}

// ---- float formats ---------------------------------------------------------------------------------
// Packed activations: per token float32[RoundUp(cols, 16)], zero beyond cols; for bf16 and fp8 each
// 16-element chunk in the order 0-3, 8-11, 4-7, 12-15 (chunks start at multiples of 16: fp8 blocks
// are multiples of 16 columns here); for mxfp4 its 8 even elements, then its 8 odd ones (the low and high
// nibbles of 8 weight bytes).

constexpr int64_t kFloatChunk = 16;

// Where element e of a 16-element chunk sits in the packed activations of bf16 and fp8 (order 0-3, 8-11,
// 4-7, 12-15: the lanes of vpunpck*wd). The order swaps the middle quarters, so it is its own inverse.
int64_t PackedPosition(int64_t e) { return 4 * ((e / 4 & 1) * 2 + e / 8) + e % 4; }

// Where element e of a 16-element chunk sits in the packed activations of mxfp4.
int64_t Mxfp4PackedPosition(int64_t e) { return e % 2 * 8 + e / 2; }

int64_t FloatTokenFloats(int64_t cols) { return RoundUp(cols, kFloatChunk); }

size_t FloatPackedBytes(const LayerWeights&, int64_t tokens, int64_t cols) {
  return tokens * FloatTokenFloats(cols) * sizeof(float);
}

HJ_AVX2 void FloatPack(const LayerWeights& layer, const ActivationRows& rows, int64_t cols, void* packed) {
  const int64_t stride = FloatTokenFloats(cols);
  thread_local std::vector<float> row;
  row.resize(stride);
  for (int64_t t = 0; t < rows.count; ++t) {
    float* out = static_cast<float*>(packed) + t * stride;
    if (layer.format == WeightFormat::kF32) {
      LoadFloatRow(rows, t, cols, out);
      std::fill(out + cols, out + stride, 0.0f);
      continue;
    }
    LoadFloatRow(rows, t, cols, row.data());
    std::fill(row.begin() + cols, row.end(), 0.0f);
    for (int64_t c = 0; c < stride; c += kFloatChunk) {
      if (layer.format == WeightFormat::kMxfp4) {
        for (int64_t e = 0; e < kFloatChunk; ++e) out[c + Mxfp4PackedPosition(e)] = row[c + e];
      } else {
        for (int q = 0; q < 4; ++q) std::memcpy(out + c + PackedPosition(4 * q), row.data() + c + 4 * q, 16);
      }
    }
  }
}

// Two vectors of 8 weights, widened to float32.
struct W16 {
  __m256 lo, hi;
};

// The 16 elements from c, a whole chunk inside the row.
template <WeightFormat F>
HJ_AVX2 W16 LoadChunk(const unsigned char* row, int64_t c);

// n <= 16 elements from c decoded one by one into a zero-padded chunk (in the activations' order for
// the 16-bit formats). Used at the row's end.
template <WeightFormat F>
__attribute__((target("avx2,fma,f16c"), noinline, cold)) W16 LoadPartial(const unsigned char* row, int64_t c, int64_t n) {
  alignas(32) float v[kFloatChunk] = {};
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (F == WeightFormat::kF32) {
      std::memcpy(v + i, row + (c + i) * 4, 4);
    } else if constexpr (F == WeightFormat::kBf16) {
      uint16_t bits;
      std::memcpy(&bits, row + (c + i) * 2, 2);
      v[i] = Bf16BitsToFloat(bits);
    } else {
      v[i] = Fp8ShiftedValue(row[c + i]);
    }
  }
  if constexpr (F != WeightFormat::kF32) {
    alignas(32) float packed[kFloatChunk];
    for (int64_t i = 0; i < kFloatChunk; ++i) packed[PackedPosition(i)] = v[i];
    std::memcpy(v, packed, sizeof v);
  }
  return {_mm256_load_ps(v), _mm256_load_ps(v + 8)};
}

template <>
HJ_AVX2 W16 LoadChunk<WeightFormat::kF32>(const unsigned char* row, int64_t c) {
  const auto* p = reinterpret_cast<const float*>(row) + c;
  return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}

// 16 bfloat16 as float32: each one the high half of a 32-bit lane.
HJ_AVX2 W16 Widen(__m256i bits) {
  const __m256i zero = _mm256_setzero_si256();
  return {_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, bits)), _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, bits))};
}

template <>
HJ_AVX2 W16 LoadChunk<WeightFormat::kBf16>(const unsigned char* row, int64_t c) {
  return Widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 2)));
}

// The shift expansion of fp8_special.h: the FP8 value * 2^-8 (the factor goes into the block scale) for normals.
template <>
HJ_AVX2 W16 LoadChunk<WeightFormat::kFp8E4M3Fn>(const unsigned char* row, int64_t c) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c));
  // SSSSSSSS S.EEEE.MMM << 4, masked to S at bit 15 and E.M at bits 10..4, exponent field 0111EEEE.
  const __m256i words = _mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 4);
  return Widen(_mm256_or_si256(_mm256_and_si256(words, _mm256_set1_epi16(static_cast<short>(0x87f0))),
                               _mm256_set1_epi16(0x3800)));
}

// Rows [row, row + R) of one scale row-block, tokens [t0, t0 + TC).
template <WeightFormat F, int R, int TC>
HJ_AVX2 void FloatTile(const LayerWeights& layer, const Projection& w, int64_t row, const float* x, int64_t x_stride,
                       int64_t t0, float* out, int64_t out_stride) {
  constexpr bool kScaled = F == WeightFormat::kFp8E4M3Fn;
  constexpr int64_t kBytes = F == WeightFormat::kF32 ? 4 : F == WeightFormat::kBf16 ? 2 : 1;
  const int64_t cols = w.cols;
  const int64_t row_bytes = layer.RowBytes(cols);
  const TilePrefetch prefetch(row_bytes, R);
  const int64_t block = kScaled ? layer.block_cols : cols;
  const int64_t n_blocks = Blocks(cols, block);
  const float* scales = kScaled ? static_cast<const float*>(w.scale) + (row / layer.block_rows) * n_blocks : nullptr;
  const unsigned char* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = static_cast<const unsigned char*>(w.data) + (row + r) * row_bytes;
  __m256 total[R][TC];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < TC; ++t) total[r][t] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t c1 = std::min(cols, (b + 1) * block);
    __m256 acc[R][TC];
    for (int r = 0; r < R; ++r) {
      for (int t = 0; t < TC; ++t) acc[r][t] = _mm256_setzero_ps();
    }
    // One row's weights at a time, used at once: 16 registers leave no room to hold R rows.
    const auto accumulate = [&](int64_t c, int r, const W16& wv) HJ_AVX2 {
      for (int t = 0; t < TC; ++t) {
        const float* xt = x + (t0 + t) * x_stride + c;
        acc[r][t] = _mm256_fmadd_ps(wv.lo, _mm256_loadu_ps(xt), acc[r][t]);
        acc[r][t] = _mm256_fmadd_ps(wv.hi, _mm256_loadu_ps(xt + 8), acc[r][t]);
      }
    };
    // Whole chunks, then the row's partial last chunk.
    const int64_t c0 = b * block, whole_end = c0 + (c1 - c0) / kFloatChunk * kFloatChunk;
    for (int64_t c = c0; c < whole_end; c += kFloatChunk) {
      prefetch.Rows(rows, c * kBytes);
      for (int r = 0; r < R; ++r) accumulate(c, r, LoadChunk<F>(rows[r], c));
    }
    if (whole_end < c1) {
      for (int r = 0; r < R; ++r) accumulate(whole_end, r, LoadPartial<F>(rows[r], whole_end, c1 - whole_end));
    }
    for (int r = 0; r < R; ++r) {
      for (int t = 0; t < TC; ++t) {
        if constexpr (kScaled) {
          float s;
          std::memcpy(&s, scales + b, sizeof s);
          total[r][t] = _mm256_fmadd_ps(acc[r][t], _mm256_set1_ps(s * 256.0f), total[r][t]);
        } else {
          total[r][t] = _mm256_add_ps(total[r][t], acc[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < TC; ++t) out[r * out_stride + t0 + t] = HorizontalSum(total[r][t]);
  }
}

// Walks the rows in tiles that never cross a scale row-block and the tokens in chunks of 4, 2, 1.
template <typename Tile4x1, typename Tile2x2, typename Tile1x4, typename Tile1x2, typename Tile1x1>
void ForTiles(int64_t row0, int64_t rows, int64_t block_rows, int64_t tokens, Tile4x1 t41, Tile2x2 t22,
              Tile1x4 t14, Tile1x2 t12, Tile1x1 t11) {
  for (int64_t r = row0; r < row0 + rows;) {
    const int64_t block_end = std::min(row0 + rows, (r / block_rows + 1) * block_rows);
    for (; r < block_end;) {
      const int64_t left = block_end - r;
      int64_t t = 0;
      if (tokens == 1 && left >= 4) {
        t41(r, t);
        r += 4;
        continue;
      }
      if (tokens == 2 && left >= 2) {
        t22(r, t);
        r += 2;
        continue;
      }
      for (; t + 4 <= tokens; t += 4) t14(r, t);
      for (; t + 2 <= tokens; t += 2) t12(r, t);
      for (; t < tokens; ++t) t11(r, t);
      r += 1;
    }
  }
}

template <WeightFormat F>
HJ_AVX2 void FloatGemm(const LayerWeights& layer, const Projection* w, int n_proj, int64_t row0, int64_t rows,
                       const void* packed, int64_t tokens, float* const* out, int64_t out_stride) {
  const auto* x = static_cast<const float*>(packed);
  const int64_t xs = FloatTokenFloats(w[0].cols);
  const int64_t block_rows = F == WeightFormat::kFp8E4M3Fn ? layer.block_rows : w[0].rows;
  for (int p = 0; p < n_proj; ++p) {
    const auto o = [&](int64_t r) { return out[p] + (r - row0) * out_stride; };
    const Projection& wp = w[p];
    ForTiles(
        row0, rows, block_rows, tokens,
        [&](int64_t r, int64_t t) { FloatTile<F, 4, 1>(layer, wp, r, x, xs, t, o(r), out_stride); },
        [&](int64_t r, int64_t t) { FloatTile<F, 2, 2>(layer, wp, r, x, xs, t, o(r), out_stride); },
        [&](int64_t r, int64_t t) { FloatTile<F, 1, 4>(layer, wp, r, x, xs, t, o(r), out_stride); },
        [&](int64_t r, int64_t t) { FloatTile<F, 1, 2>(layer, wp, r, x, xs, t, o(r), out_stride); },
        [&](int64_t r, int64_t t) { FloatTile<F, 1, 1>(layer, wp, r, x, xs, t, o(r), out_stride); });
    if constexpr (F == WeightFormat::kFp8E4M3Fn) {
      const auto activation = [&](int64_t t, int64_t c) {
        return x[t * xs + c - c % kFloatChunk + PackedPosition(c % kFloatChunk)];
      };
      AddFp8Corrections(layer, wp, row0, rows, tokens, activation, out[p], out_stride);
    }
  }
}

// ---- mxfp4 --------------------------------------------------------------------------------------------
// A chunk is 16 elements (8 bytes) of one scale group: the bytes widen to 32-bit lanes, vpermps looks up the
// magnitude of the low 3 bits of each nibble (it reads the low 3 bits of each index), and the nibble's bit 3,
// shifted to bit 31, is the sign. The low nibbles are the chunk's even elements, the high ones its odd ones.
// Groups sum separately; the e8m0 scale applies once per group.

template <int R, int TC>
HJ_AVX2 void Mxfp4Tile(const LayerWeights& layer, const Projection& w, int64_t row, const float* x, int64_t x_stride,
                       int64_t t0, float* out, int64_t out_stride) {
  const int64_t cols = w.cols, row_bytes = layer.RowBytes(cols), groups = cols / kMxfp4Block;
  const TilePrefetch prefetch(row_bytes, R);
  const std::array<float, 256>& e8m0 = E8m0Table();
  const unsigned char* rows[R];
  const uint8_t* scales[R];
  for (int r = 0; r < R; ++r) {
    rows[r] = static_cast<const unsigned char*>(w.data) + (row + r) * row_bytes;
    scales[r] = static_cast<const uint8_t*>(w.scale) + (row + r) * groups;
  }
  const __m256 magnitudes = _mm256_loadu_ps(kE2m1Magnitudes.data());
  const __m256i sign = _mm256_set1_epi32(INT32_MIN);
  __m256 total[R][TC];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < TC; ++t) total[r][t] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m256 acc[R][TC];
    for (int r = 0; r < R; ++r) {
      for (int t = 0; t < TC; ++t) acc[r][t] = _mm256_setzero_ps();
    }
    for (int64_t c = g * kMxfp4Block; c < (g + 1) * kMxfp4Block; c += kFloatChunk) {
      if (c % 128 == 0) prefetch.Rows(rows, c / 2);  // a cache line per 128 elements
      for (int r = 0; r < R; ++r) {
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows[r] + c / 2)));
        const __m256 even = _mm256_xor_ps(_mm256_permutevar8x32_ps(magnitudes, bytes),
                                          _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(bytes, 28), sign)));
        const __m256 odd = _mm256_xor_ps(_mm256_permutevar8x32_ps(magnitudes, _mm256_srli_epi32(bytes, 4)),
                                         _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(bytes, 24), sign)));
        for (int t = 0; t < TC; ++t) {
          const float* xt = x + (t0 + t) * x_stride + c;
          acc[r][t] = _mm256_fmadd_ps(even, _mm256_loadu_ps(xt), acc[r][t]);
          acc[r][t] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(xt + 8), acc[r][t]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_set1_ps(e8m0[scales[r][g]]);
      for (int t = 0; t < TC; ++t) total[r][t] = _mm256_fmadd_ps(acc[r][t], scale, total[r][t]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < TC; ++t) out[r * out_stride + t0 + t] = HorizontalSum(total[r][t]);
  }
}

HJ_AVX2 void Mxfp4Gemm(const LayerWeights& layer, const Projection* w, int n_proj, int64_t row0, int64_t rows,
                       const void* packed, int64_t tokens, float* const* out, int64_t out_stride) {
  const auto* x = static_cast<const float*>(packed);
  const int64_t xs = FloatTokenFloats(w[0].cols);
  for (int p = 0; p < n_proj; ++p) {
    const auto o = [&](int64_t r) { return out[p] + (r - row0) * out_stride; };
    const Projection& wp = w[p];
    ForTiles(
        row0, rows, wp.rows, tokens,
        [&](int64_t r, int64_t t) { Mxfp4Tile<4, 1>(layer, wp, r, x, xs, t, o(r), out_stride); },
        [&](int64_t r, int64_t t) { Mxfp4Tile<2, 2>(layer, wp, r, x, xs, t, o(r), out_stride); },
        [&](int64_t r, int64_t t) { Mxfp4Tile<1, 4>(layer, wp, r, x, xs, t, o(r), out_stride); },
        [&](int64_t r, int64_t t) { Mxfp4Tile<1, 2>(layer, wp, r, x, xs, t, o(r), out_stride); },
        [&](int64_t r, int64_t t) { Mxfp4Tile<1, 1>(layer, wp, r, x, xs, t, o(r), out_stride); });
  }
}

// ---- int8 / int4 -------------------------------------------------------------------------------------
// Packed activations, per token (64-byte aligned):
//   int8: float scale[groups], then q[kp] and |q|[kp] with kp = RoundUp(cols, 32)
//   int4: float scale[groups], int32 correction[groups] (= -8 * sum of the group's q), then q
//         de-interleaved per 64-element chunk: the 32 even elements, then the 32 odd ones, matching
//         the low and high nibbles of 32 weight bytes.

constexpr int64_t kInt8Chunk = 32;
constexpr int64_t kInt4Chunk = 64;

struct IntLayout {
  int64_t groups, kp, token_bytes;
  size_t scales = 0, corr, q, absq;
};

IntLayout MakeIntLayout(const LayerWeights& layer, int64_t cols) {
  IntLayout l;
  l.groups = Blocks(cols, layer.block_cols);
  const bool int4 = layer.format == WeightFormat::kInt4;
  l.kp = RoundUp(cols, int4 ? kInt4Chunk : kInt8Chunk);
  l.corr = RoundUp(l.groups * 4, 32);
  l.q = l.corr + (int4 ? RoundUp(l.groups * 4, 32) : 0);
  l.absq = l.q + l.kp;
  l.token_bytes = RoundUp(static_cast<int64_t>(int4 ? l.q + l.kp : l.absq + l.kp), 64);
  return l;
}

size_t IntPackedBytes(const LayerWeights& layer, int64_t tokens, int64_t cols) {
  return tokens * MakeIntLayout(layer, cols).token_bytes;
}

// max |x| of n floats as integer max of the bit patterns (see AbsMax in numeric_formats.h).
HJ_AVX2 float AbsMaxAvx2(const float* x, int64_t n) {
  const __m256i mask = _mm256_set1_epi32(0x7fffffff);
  __m256i m = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), mask));
  }
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), m);
  uint32_t amax = 0;
  for (uint32_t v : lanes) amax = std::max(amax, v);
  float value;
  std::memcpy(&value, &amax, sizeof value);
  return std::max(value, AbsMax(x + i, n - i));
}

// Quantizes one group as QuantizeInt8 does (same scale, same rounding), vectorised.
HJ_AVX2 float QuantizeGroup(const float* x, int64_t n, int8_t* q) {
  const float amax = AbsMaxAvx2(x, n);
  if (amax == 0.0f || !std::isfinite(amax)) return QuantizeInt8(x, n, q);
  const __m256 inv = _mm256_set1_ps(127.0f / amax);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(w, w));
  }
  for (; i < n; ++i) q[i] = static_cast<int8_t>(std::nearbyint(x[i] * (127.0f / amax)));
  return Int8Scale(amax);
}

HJ_AVX2 void IntPack(const LayerWeights& layer, const ActivationRows& rows, int64_t cols, void* packed) {
  const IntLayout l = MakeIntLayout(layer, cols);
  const bool int4 = layer.format == WeightFormat::kInt4;
  thread_local std::vector<float> x;
  thread_local std::vector<int8_t> q;
  x.resize(cols);
  q.assign(l.kp, 0);
  for (int64_t t = 0; t < rows.count; ++t) {
    LoadFloatRow(rows, t, cols, x.data());
    char* token = static_cast<char*>(packed) + t * l.token_bytes;
    auto* scales = reinterpret_cast<float*>(token + l.scales);
    for (int64_t g = 0; g < l.groups; ++g) {
      const int64_t begin = g * layer.block_cols;
      const int64_t n = std::min(layer.block_cols, cols - begin);
      scales[g] = QuantizeGroup(x.data() + begin, n, q.data() + begin);
      if (int4) {
        int32_t sum = 0;
        for (int64_t i = begin; i < begin + n; ++i) sum += q[i];
        reinterpret_cast<int32_t*>(token + l.corr)[g] = -8 * sum;
      }
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
      auto* absq = reinterpret_cast<uint8_t*>(token + l.absq);
      for (int64_t c = 0; c < l.kp; ++c) {
        out[c] = q[c];
        absq[c] = static_cast<uint8_t>(q[c] < 0 ? -q[c] : q[c]);
      }
    }
  }
}

HJ_AVX2 __m256i LoadBytes32(const unsigned char* p, int64_t n) {
  if (n >= 32) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  alignas(32) unsigned char v[32] = {};
  std::memcpy(v, p, n);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(v));
}

template <bool kInt4, int R, int TC>
HJ_AVX2 void IntTile(const LayerWeights& layer, const Projection& w, int64_t row, const char* packed,
                     const IntLayout& l, int64_t t0, float* out, int64_t out_stride) {
  const int64_t cols = w.cols;
  const int64_t row_bytes = layer.RowBytes(cols);
  const TilePrefetch prefetch(row_bytes, R);
  const unsigned char* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = static_cast<const unsigned char*>(w.data) + (row + r) * row_bytes;
  const char* tokens[TC];
  for (int t = 0; t < TC; ++t) tokens[t] = packed + (t0 + t) * l.token_bytes;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i low_nibbles = _mm256_set1_epi8(0x0f);
  __m256 total[R][TC];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < TC; ++t) total[r][t] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < l.groups; ++g) {
    const int64_t c0 = g * layer.block_cols, c1 = std::min(cols, c0 + layer.block_cols);
    __m256i acc[R][TC];
    for (int r = 0; r < R; ++r) {
      for (int t = 0; t < TC; ++t) {
        acc[r][t] = kInt4 ? _mm256_zextsi128_si256(_mm_cvtsi32_si128(reinterpret_cast<const int32_t*>(tokens[t] + l.corr)[g]))
                          : _mm256_setzero_si256();
      }
    }
    if constexpr (kInt4) {
      for (int64_t c = c0; c < c1; c += kInt4Chunk) {
        const int64_t n_bytes = (std::min(kInt4Chunk, cols - c) + 1) / 2;
        prefetch.Rows(rows, c / 2);
        __m256i lo[R], hi[R];
        for (int r = 0; r < R; ++r) {
          const __m256i v = LoadBytes32(rows[r] + c / 2, n_bytes);
          lo[r] = _mm256_and_si256(v, low_nibbles);
          hi[r] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low_nibbles);
        }
        for (int t = 0; t < TC; ++t) {
          const auto* xq = reinterpret_cast<const __m256i*>(tokens[t] + l.q + c);
          const __m256i even = _mm256_loadu_si256(xq), odd = _mm256_loadu_si256(xq + 1);
          for (int r = 0; r < R; ++r) {
            // nibble * x <= 15 * 127 per byte pair: two pairs fit int16 without saturation.
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo[r], even), _mm256_maddubs_epi16(hi[r], odd));
            acc[r][t] = _mm256_add_epi32(acc[r][t], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
    } else {
      for (int64_t c = c0; c < c1; c += kInt8Chunk) {
        prefetch.Rows(rows, c);
        __m256i wv[R];
        for (int r = 0; r < R; ++r) wv[r] = LoadBytes32(rows[r] + c, std::min(kInt8Chunk, cols - c));
        for (int t = 0; t < TC; ++t) {
          const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tokens[t] + l.q + c));
          const __m256i xabs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tokens[t] + l.absq + c));
          for (int r = 0; r < R; ++r) {
            const __m256i pairs = _mm256_maddubs_epi16(xabs, _mm256_sign_epi8(wv[r], xq));
            acc[r][t] = _mm256_add_epi32(acc[r][t], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      float ws;
      std::memcpy(&ws, static_cast<const float*>(w.scale) + (row + r) * l.groups + g, sizeof ws);
      for (int t = 0; t < TC; ++t) {
        const float xs = reinterpret_cast<const float*>(tokens[t] + l.scales)[g];
        total[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][t]), _mm256_set1_ps(ws * xs), total[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < TC; ++t) out[r * out_stride + t0 + t] = HorizontalSum(total[r][t]);
  }
}

template <bool kInt4>
HJ_AVX2 void IntGemm(const LayerWeights& layer, const Projection* w, int n_proj, int64_t row0, int64_t rows,
                     const void* packed, int64_t tokens, float* const* out, int64_t out_stride) {
  const IntLayout l = MakeIntLayout(layer, w[0].cols);
  const char* x = static_cast<const char*>(packed);
  for (int p = 0; p < n_proj; ++p) {
    const auto o = [&](int64_t r) { return out[p] + (r - row0) * out_stride; };
    const Projection& wp = w[p];
    ForTiles(
        row0, rows, w[0].rows, tokens,
        [&](int64_t r, int64_t t) { IntTile<kInt4, 4, 1>(layer, wp, r, x, l, t, o(r), out_stride); },
        [&](int64_t r, int64_t t) { IntTile<kInt4, 2, 2>(layer, wp, r, x, l, t, o(r), out_stride); },
        [&](int64_t r, int64_t t) { IntTile<kInt4, 1, 4>(layer, wp, r, x, l, t, o(r), out_stride); },
        [&](int64_t r, int64_t t) { IntTile<kInt4, 1, 2>(layer, wp, r, x, l, t, o(r), out_stride); },
        [&](int64_t r, int64_t t) { IntTile<kInt4, 1, 1>(layer, wp, r, x, l, t, o(r), out_stride); });
  }
}

constexpr GemmKernel kF32{"avx2", 1, FloatPackedBytes, FloatPack, FloatGemm<WeightFormat::kF32>};
constexpr GemmKernel kBf16{"avx2", 1, FloatPackedBytes, FloatPack, FloatGemm<WeightFormat::kBf16>};
constexpr GemmKernel kFp8{"avx2", 1, FloatPackedBytes, FloatPack, FloatGemm<WeightFormat::kFp8E4M3Fn>};
constexpr GemmKernel kInt8{"avx2", 1, IntPackedBytes, IntPack, IntGemm<false>};
constexpr GemmKernel kInt4{"avx2", 1, IntPackedBytes, IntPack, IntGemm<true>};
constexpr GemmKernel kMxfp4{"avx2", 1, FloatPackedBytes, FloatPack, Mxfp4Gemm};

}  // namespace

const GemmKernel* Avx2Kernel(const LayerWeights& layer) {
  switch (layer.format) {
    case WeightFormat::kF32:
      return &kF32;
    case WeightFormat::kBf16:
      return &kBf16;
    case WeightFormat::kFp8E4M3Fn:
      // Chunks must start at multiples of 16 columns (the activations' lane order).
      return layer.block_cols % kFloatChunk == 0 ? &kFp8 : nullptr;
    case WeightFormat::kInt8:
      return &kInt8;
    case WeightFormat::kInt4:
      return &kInt4;
    case WeightFormat::kMxfp4:
      return &kMxfp4;
    default:  // the GGUF block formats: no AVX2 kernel yet, the generic one serves
      return nullptr;
  }
}

}  // namespace hybridjit
