// Kernels for routed experts stored in GGUF block formats (gguf_blocks.h): Q8_0, Q4_K, Q5_K, Q6_K.
//
// The fused operator of seed 000 §3.5.2: activations are quantised on the fly to int8 per 32 elements
// (as every int8 kernel does, expert_kernels.h), each weight row is decoded once per call into unsigned
// bytes plus float multipliers (gguf_blocks.h), and the products are integer dot products: in plain C++
// here, with AVX-512 VNNI (vpdpbusd, unsigned weight bytes x signed activation bytes) in the avx512 family.
// A row's decoded form (a few KiB) stays in L1 for all the tokens of the call. With the amx family, experts with
// enough tokens (AmxMinTokens) run on AMX instead: expert_kernel_amx.cc splits the blocks with the same helpers
// (gguf_blocks_avx512.h) into bfloat16 tiles.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "expert_kernels.h"
#include "gguf_blocks.h"
#include "gguf_blocks_avx512.h"
#include "numeric_formats.h"
#include "weight_prefetch.h"

namespace hybridjit {
namespace {

constexpr int64_t kActBlock = 32;  // activation quantisation group

int64_t Round64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

// Packed activations, per token: int8 q[cols] (padded to 64 bytes), float lane_dx[cols / 4] (the scale of
// the 32-group each 4-element lane is in), float sub_sum[cols / 16] (scale * sum of q over 16 elements).
struct TokenLayout {
  int64_t lane_dx, sub_sum, bytes;
  explicit TokenLayout(int64_t cols)
      : lane_dx(Round64(cols)), sub_sum(lane_dx + Round64(cols)), bytes(sub_sum + Round64(cols / 4)) {}
};

size_t GgufPackedBytes(const LayerWeights&, int64_t tokens, int64_t cols) { return tokens * TokenLayout(cols).bytes; }

void GgufPack(const LayerWeights&, const ActivationRows& rows, int64_t cols, void* packed) {
  const TokenLayout layout(cols);
  std::vector<float> x(cols);
  for (int64_t t = 0; t < rows.count; ++t) {
    const void* src = rows.Row(t);
    if (rows.bf16) {
      for (int64_t c = 0; c < cols; ++c) x[c] = Bf16BitsToFloat(static_cast<const uint16_t*>(src)[c]);
    } else {
      std::copy_n(static_cast<const float*>(src), cols, x.data());
    }
    char* token = static_cast<char*>(packed) + t * layout.bytes;
    auto* q = reinterpret_cast<int8_t*>(token);
    auto* lane_dx = reinterpret_cast<float*>(token + layout.lane_dx);
    auto* sub_sum = reinterpret_cast<float*>(token + layout.sub_sum);
    for (int64_t g = 0; g < cols; g += kActBlock) {
      const float scale = QuantizeInt8(x.data() + g, kActBlock, q + g);
      std::fill_n(lane_dx + g / 4, kActBlock / 4, scale);
      for (int64_t s = g; s < g + kActBlock; s += 16) {
        int sum = 0;
        for (int64_t i = s; i < s + 16; ++i) sum += q[i];
        sub_sum[s / 16] = scale * static_cast<float>(sum);
      }
    }
  }
}

// A weight row decoded (gguf_blocks.h), reused by every token of the call; one per thread.
struct DecodedRow {
  std::vector<uint8_t> q;
  std::vector<float> lane_scale, sub_min;
  void Resize(int64_t cols) {
    q.resize(Round64(cols));
    lane_scale.resize(cols / 4);
    sub_min.resize(cols / 16);
  }
};

DecodedRow& RowBuffer(int64_t cols) {
  thread_local DecodedRow row;
  row.Resize(cols);
  return row;
}

const uint8_t* RowData(const LayerWeights& layer, const Projection& p, int64_t row) {
  return static_cast<const uint8_t*>(p.data) + row * layer.RowBytes(p.cols, p.which);
}

void DecodeRowScalar(const LayerWeights& layer, const Projection& p, int64_t row, DecodedRow& out) {
  const WeightFormat format = layer.ProjectionFormat(p.which);
  const int64_t n = GgufBlockElements(format), bytes = GgufBlockBytes(format);
  const uint8_t* data = RowData(layer, p, row);
  for (int64_t b = 0; b < p.cols / n; ++b) {
    DecodeGgufBlock(format, data + b * bytes, out.q.data() + b * n, out.lane_scale.data() + b * n / 4,
                    out.sub_min.data() + b * n / 16);
  }
}

float DotScalar(const DecodedRow& w, const char* token, const TokenLayout& layout, int64_t cols) {
  const auto* xq = reinterpret_cast<const int8_t*>(token);
  const auto* lane_dx = reinterpret_cast<const float*>(token + layout.lane_dx);
  const auto* sub_sum = reinterpret_cast<const float*>(token + layout.sub_sum);
  float sum = 0.0f;
  for (int64_t l = 0; l < cols / 4; ++l) {
    int32_t dot = 0;
    for (int64_t i = 4 * l; i < 4 * l + 4; ++i) dot += int32_t{w.q[i]} * xq[i];
    sum += static_cast<float>(dot) * (w.lane_scale[l] * lane_dx[l]);
  }
  for (int64_t s = 0; s < cols / 16; ++s) sum -= w.sub_min[s] * sub_sum[s];
  return sum;
}

void GgufGemmGeneric(const LayerWeights& layer, const Projection* w, int n_proj, int64_t row0, int64_t rows,
                     const void* packed, int64_t tokens, float* const* out, int64_t out_stride) {
  const int64_t cols = w[0].cols;
  const TokenLayout layout(cols);
  DecodedRow& row = RowBuffer(cols);
  for (int p = 0; p < n_proj; ++p) {
    for (int64_t r = 0; r < rows; ++r) {
      DecodeRowScalar(layer, w[p], row0 + r, row);
      for (int64_t t = 0; t < tokens; ++t) {
        const char* token = static_cast<const char*>(packed) + t * layout.bytes;
        out[p][r * out_stride + t] = DotScalar(row, token, layout, cols);
      }
    }
  }
}

// --- AVX-512 VNNI (with gguf_blocks_avx512.h's helpers) --------------------------------------------------

HJ_AVX512_VNNI void DecodeQ4KBlock(const uint8_t* b, bool five, uint8_t* q, float* lane_scale, float* sub_min) {
  const float d = LoadHalf(b), dmin = LoadHalf(b + 2);
  for (int c = 0; c < 4; ++c) {
    __m256i lo, hi;
    Q4KChunk(b, five, c, &lo, &hi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 64 * c), lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 64 * c + 32), hi);
  }
  uint8_t sm[16];
  KScalesMins(b + 4, sm);
  for (int j = 0; j < 8; ++j) {
    _mm256_storeu_ps(lane_scale + 8 * j, _mm256_set1_ps(d * static_cast<float>(sm[j])));
    sub_min[2 * j] = sub_min[2 * j + 1] = dmin * static_cast<float>(sm[8 + j]);
  }
}

HJ_AVX512_VNNI void DecodeQ6KBlock(const uint8_t* b, uint8_t* q, float* lane_scale, float* sub_min) {
  for (int half = 0; half < 2; ++half) {
    __m256i v[4];
    Q6KHalf(b, half, v);
    for (int s = 0; s < 4; ++s) _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 128 * half + 32 * s), v[s]);
  }
  const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = LoadHalf(b + 208);
  for (int s = 0; s < 16; ++s) {
    const float scale = d * static_cast<float>(scales[s]);
    _mm_storeu_ps(lane_scale + 4 * s, _mm_set1_ps(scale));
    sub_min[s] = 32.0f * scale;
  }
}

HJ_AVX512_VNNI void DecodeQ80Block(const uint8_t* b, uint8_t* q, float* lane_scale, float* sub_min) {
  const float d = LoadHalf(b);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_xor_si256(v, _mm256_set1_epi8(-128)));  // q + 128
  _mm256_storeu_ps(lane_scale, _mm256_set1_ps(d));
  sub_min[0] = sub_min[1] = 128.0f * d;
}

HJ_AVX512_VNNI void DecodeRowAvx512(const LayerWeights& layer, const Projection& p, int64_t row, DecodedRow& out) {
  const WeightFormat format = layer.ProjectionFormat(p.which);
  const int64_t n = GgufBlockElements(format), bytes = GgufBlockBytes(format);
  const uint8_t* data = RowData(layer, p, row);
  const int64_t ahead = WeightPrefetchBytes();
  for (int64_t b = 0; b < p.cols / n; ++b) {
    const uint8_t* block = data + b * bytes;
    if (ahead > 0) {
      for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(block + ahead + line), _MM_HINT_T0);
    }
    uint8_t* q = out.q.data() + b * n;
    float* lane_scale = out.lane_scale.data() + b * n / 4;
    float* sub_min = out.sub_min.data() + b * n / 16;
    switch (format) {
      case WeightFormat::kQ8_0:
        DecodeQ80Block(block, q, lane_scale, sub_min);
        break;
      case WeightFormat::kQ4K:
      case WeightFormat::kQ5K:
        DecodeQ4KBlock(block, format == WeightFormat::kQ5K, q, lane_scale, sub_min);
        break;
      case WeightFormat::kQ6K:
        DecodeQ6KBlock(block, q, lane_scale, sub_min);
        break;
      default:
        break;
    }
  }
}

HJ_AVX512_VNNI float DotAvx512(const DecodedRow& w, const char* token, const TokenLayout& layout, int64_t cols) {
  const auto* xq = reinterpret_cast<const int8_t*>(token);
  const auto* lane_dx = reinterpret_cast<const float*>(token + layout.lane_dx);
  const auto* sub_sum = reinterpret_cast<const float*>(token + layout.sub_sum);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < cols; c += 64) {
    // cols is a multiple of 32: a last half chunk reads zeros past the row (masked loads).
    const __mmask64 bytes = cols - c >= 64 ? ~__mmask64{0} : (__mmask64{1} << (cols - c)) - 1;
    const __mmask16 lanes = cols - c >= 64 ? __mmask16(0xffff) : __mmask16(0x00ff);
    const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_maskz_loadu_epi8(bytes, w.q.data() + c),
                                            _mm512_maskz_loadu_epi8(bytes, xq + c));
    const __m512 scale = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, w.lane_scale.data() + c / 4),
                                       _mm512_maskz_loadu_ps(lanes, lane_dx + c / 4));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
  }
  __m512 mins = _mm512_setzero_ps();
  for (int64_t s = 0; s < cols / 16; s += 16) {
    const __mmask16 m = cols / 16 - s >= 16 ? __mmask16(0xffff) : __mmask16((1u << (cols / 16 - s)) - 1);
    mins = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w.sub_min.data() + s), _mm512_maskz_loadu_ps(m, sub_sum + s), mins);
  }
  return _mm512_reduce_add_ps(acc) - _mm512_reduce_add_ps(mins);
}

// --- Few tokens: blocks decoded in registers ------------------------------------------------------------
// A decoded row pays for itself over many tokens; with a few, writing it out and reading it back costs more than
// the dot products. These split each super-block into natural-order bytes in registers and multiply them with
// every token's activations there (the Q4_K x Q8_K / Q6_K x Q8_K dot products of seed 000 §3.5.2, on our
// activation layout): per 64 elements one vpdpbusd, one convert and one multiply-add per token.

struct TokenView {  // one token's packed activations (TokenLayout)
  const int8_t* q;
  const float* lane_dx;
  const float* sub_sum;
};

// acc[t] += lane sums of 64 elements at `col` (weights wq, their scale per lane ws) times token t's; N tokens.
// A row's last 32 elements alone (Q8_0 rows are multiples of 32) pass `lanes` 0x00ff: the activations past the row
// are not read (their padding is not written).
template <int N>
HJ_AVX512_VNNI inline void Chunk(__m512i wq, __m512 ws, int64_t col, const TokenView* tok, __m512* acc,
                                 __mmask16 lanes = 0xffff) {
  const __mmask64 bytes = lanes == 0xffff ? ~__mmask64{0} : __mmask64{0xffffffff};
  for (int t = 0; t < N; ++t) {
    const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, _mm512_maskz_loadu_epi8(bytes, tok[t].q + col));
    const __m512 scale = _mm512_mul_ps(ws, _mm512_maskz_loadu_ps(lanes, tok[t].lane_dx + col / 4));
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[t]);
  }
}

// mins[t] += a block's 16 min terms (one per 16 elements from `col`) times token t's sums over them.
template <int N>
HJ_AVX512_VNNI inline void BlockMins(__m512 block_mins, int64_t col, const TokenView* tok, __m512* mins) {
  for (int t = 0; t < N; ++t) mins[t] = _mm512_fmadd_ps(block_mins, _mm512_loadu_ps(tok[t].sub_sum + col / 16), mins[t]);
}

template <int N, bool kFive>
HJ_AVX512_VNNI inline void Q4KBlockDot(const uint8_t* b, int64_t col, const TokenView* tok, __m512* acc, __m512* mins) {
  const __m512 scaled = Q4KMultipliers(b);  // lanes 0-7: d * scale j, 8-15: dmin * min j
  for (int c = 0; c < 4; ++c) {
    __m256i lo, hi;
    Q4KChunk(b, kFive, c, &lo, &hi);
    const __m512i wq = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    const __m512i which = _mm512_inserti64x4(_mm512_set1_epi32(2 * c), _mm256_set1_epi32(2 * c + 1), 1);
    Chunk<N>(wq, _mm512_permutexvar_ps(which, scaled), col + 64 * c, tok, acc);
  }
  // min j for the 16-element halves 2j and 2j + 1 of its sub-block
  const __m512i pairs = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  BlockMins<N>(_mm512_permutexvar_ps(pairs, scaled), col, tok, mins);
}

template <int N>
HJ_AVX512_VNNI inline void Q6KBlockDot(const uint8_t* b, int64_t col, const TokenView* tok, __m512* acc, __m512* mins) {
  const __m512 scale = Q6KScales(b);
  const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);  // lane -> its 16
  for (int half = 0; half < 2; ++half) {
    __m256i v[4];
    Q6KHalf(b, half, v);
    for (int pair = 0; pair < 2; ++pair) {
      const int chunk = 2 * half + pair;  // elements 64 chunk.., sub-blocks 4 chunk..
      const __m512i wq = _mm512_inserti64x4(_mm512_castsi256_si512(v[2 * pair]), v[2 * pair + 1], 1);
      const __m512 ws = _mm512_permutexvar_ps(_mm512_add_epi32(quarter, _mm512_set1_epi32(4 * chunk)), scale);
      Chunk<N>(wq, ws, col + 64 * chunk, tok, acc);
    }
  }
  BlockMins<N>(_mm512_mul_ps(scale, _mm512_set1_ps(32.0f)), col, tok, mins);
}

// Q8_0: two 32-element blocks (or the row's last one alone) as one 64-element chunk, q + 128 unsigned; their
// min terms (128 d per 16 elements) go to a 4-lane accumulator.
template <int N>
HJ_AVX512_VNNI inline void Q80PairDot(const uint8_t* b, int64_t col, bool pair, const TokenView* tok, __m512* acc,
                                      __m128* mins) {
  const __m256i flip = _mm256_set1_epi8(-128);
  const __m256i lo = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), flip);
  const __m256i hi = pair ? _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 36)), flip)
                          : _mm256_setzero_si256();
  const float d0 = HalfAt(b), d1 = pair ? HalfAt(b + 34) : 0.0f;
  const __m512i wq = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  Chunk<N>(wq, _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1), col, tok, acc, pair ? 0xffff : 0x00ff);
  const __m128 block_mins = _mm_mul_ps(_mm_setr_ps(d0, d0, d1, d1), _mm_set1_ps(128.0f));
  for (int t = 0; t < N; ++t) {
    mins[t] = _mm_fmadd_ps(block_mins, _mm_maskz_loadu_ps(pair ? 0xf : 0x3, tok[t].sub_sum + col / 16), mins[t]);
  }
}

template <int N>
HJ_AVX512_VNNI void FusedRows(const LayerWeights& layer, const Projection& p, int64_t row0, int64_t rows,
                              const void* packed, const TokenLayout& layout, float* out, int64_t out_stride) {
  const WeightFormat format = layer.ProjectionFormat(p.which);
  const int64_t bytes = GgufBlockBytes(format), ahead = WeightPrefetchBytes();
  TokenView tok[N];
  for (int t = 0; t < N; ++t) {
    const char* token = static_cast<const char*>(packed) + t * layout.bytes;
    tok[t] = {reinterpret_cast<const int8_t*>(token), reinterpret_cast<const float*>(token + layout.lane_dx),
              reinterpret_cast<const float*>(token + layout.sub_sum)};
  }
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* data = RowData(layer, p, row0 + r);
    __m512 acc[N], mins[N];
    __m128 q80_mins[N];
    for (int t = 0; t < N; ++t) {
      acc[t] = mins[t] = _mm512_setzero_ps();
      q80_mins[t] = _mm_setzero_ps();
    }
    // A step covers one K-quant super-block, or two Q8_0 blocks.
    const int64_t step = format == WeightFormat::kQ8_0 ? 64 : 256, step_bytes = step / GgufBlockElements(format) * bytes;
    for (int64_t col = 0; col < p.cols; col += step, data += step_bytes) {
      if (ahead > 0) {
        for (int64_t line = 0; line < step_bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(data + ahead + line), _MM_HINT_T0);
      }
      switch (format) {
        case WeightFormat::kQ8_0:
          Q80PairDot<N>(data, col, col + 64 <= p.cols, tok, acc, q80_mins);
          break;
        case WeightFormat::kQ6K:
          Q6KBlockDot<N>(data, col, tok, acc, mins);
          break;
        case WeightFormat::kQ5K:
          Q4KBlockDot<N, true>(data, col, tok, acc, mins);
          break;
        default:
          Q4KBlockDot<N, false>(data, col, tok, acc, mins);
          break;
      }
    }
    for (int t = 0; t < N; ++t) {
      const __m512 all_mins = _mm512_add_ps(mins[t], _mm512_zextps128_ps512(q80_mins[t]));
      out[r * out_stride + t] = _mm512_reduce_add_ps(acc[t]) - _mm512_reduce_add_ps(all_mins);
    }
  }
}

HJ_AVX512_VNNI void GgufGemmAvx512(const LayerWeights& layer, const Projection* w, int n_proj, int64_t row0,
                                   int64_t rows, const void* packed, int64_t tokens, float* const* out,
                                   int64_t out_stride) {
  const int64_t cols = w[0].cols;
  const TokenLayout layout(cols);
  DecodedRow& row = RowBuffer(cols);
  for (int p = 0; p < n_proj; ++p) {
    if (tokens >= 1 && tokens <= kGgufFusedMaxTokens) {
      constexpr void (*kFused[])(const LayerWeights&, const Projection&, int64_t, int64_t, const void*,
                                 const TokenLayout&, float*, int64_t) = {FusedRows<1>, FusedRows<2>, FusedRows<3>,
                                                                         FusedRows<4>};
      kFused[tokens - 1](layer, w[p], row0, rows, packed, layout, out[p], out_stride);
      continue;
    }
    for (int64_t r = 0; r < rows; ++r) {
      DecodeRowAvx512(layer, w[p], row0 + r, row);
      for (int64_t t = 0; t < tokens; ++t) {
        const char* token = static_cast<const char*>(packed) + t * layout.bytes;
        out[p][r * out_stride + t] = DotAvx512(row, token, layout, cols);
      }
    }
  }
}

constexpr GemmKernel kGgufGeneric{"generic", 1, GgufPackedBytes, GgufPack, GgufGemmGeneric};
constexpr GemmKernel kGgufAvx512{"avx512", 1, GgufPackedBytes, GgufPack, GgufGemmAvx512};

}  // namespace

const GemmKernel* GgufGenericKernel(const LayerWeights& layer) {
  return IsGgufFormat(layer.format) ? &kGgufGeneric : nullptr;
}

const GemmKernel* GgufAvx512Kernel(const LayerWeights& layer) {
  return IsGgufFormat(layer.format) ? &kGgufAvx512 : nullptr;
}

}  // namespace hybridjit
