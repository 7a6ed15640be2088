// Kernels for routed experts stored in GGUF block formats (gguf_blocks.h): Q8_0, Q4_K, Q5_K, Q6_K, Q2_K, Q3_K,
// IQ4_XS.
//
// The fused operator of seed 000 §3.5.2: activations are quantised on the fly to int8 (per 32 elements in plain C++,
// as every int8 kernel does, expert_kernels.h; per 256 with a K-quant in the layer in the avx512 family, as llama.cpp's
// Q8_K), and the products are integer dot products. The generic kernel decodes each weight row once per call into
// unsigned bytes plus float multipliers (gguf_blocks.h), kept for all the tokens of the call. The avx512 family
// splits each block into bytes in registers and multiplies them with up to four tokens' activations there (AVX-512
// VNNI: vpdpbusd, unsigned weight bytes x signed activation bytes), four tokens at a time. With the amx family,
// experts with enough tokens (AmxMinTokens) run on AMX instead: expert_kernel_amx.cc splits the blocks with the same
// helpers (gguf_blocks_avx512.h) into bfloat16 tiles.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <iterator>
#include <vector>

#include "expert_kernels.h"
#include "gguf_blocks.h"
#include "gguf_blocks_avx512.h"
#include "int8_quantize_avx512.h"
#include "numeric_formats.h"
#include "weight_prefetch.h"

namespace hybridjit {
namespace {

constexpr int64_t kActBlock = 32;  // activation quantisation group
constexpr int64_t kNearPrefetch = 512;  // the few-token kernels' L1 prefetch distance, bytes

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
    GgufTokenFloats(rows, t, cols, x.data());
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

// --- AVX-512 VNNI: blocks split in registers (with gguf_blocks_avx512.h's helpers) -------------------------
// Each super-block is split into bytes in registers and multiplied there with the activations of up to four tokens
// (the Q4_K x Q8_K / Q6_K x Q8_K dot products of seed 000 §3.5.2). Decoding each row once into memory for all the
// tokens of a call and reading it back per token, as the generic kernel does, ran 1.9-2.7x slower at 16-256 tokens an
// expert (2-core Zen 5, session 35): its per-32 float rescale and per-token reduction cost more than splitting the
// blocks again for every four tokens.
//
// With a K-quant in the layer the activations are quantised per 256 elements, one scale per super-block as
// llama.cpp's Q8_K, so that a super-block's sums stay integers to its end: per 64 weight bytes one vpdpbusd (its
// int32 lanes fit int16: 4 x 63 x 127 at most), per two of those one pack to int16 and one vpdpwssd with the
// sub-blocks' integer scales, then per super-block one convert and one float multiply-add with d times the
// activations' scale, and the mins as an integer dot product of the mins with the activations' sums. Per 32 they
// took a float convert, permute and multiply-add per 64 bytes, and the data stream slowed by about what that
// arithmetic cost. Q8_0 blocks have a float scale per 32 elements whatever the activations: they keep that form
// (FusedDots), and activations quantised per 32 where every projection is in Q8_0.
//
// The activations have a layout of their own (FusedLayout), per 256 elements: the int8 q in the order that 64 bytes
// of 4-bit weights split into without shuffles (of each 128 elements, the first and third 32, then the second and
// fourth: a 64-byte load of Q4_K's nibbles holds elements 0-31 and 64-95 of 128 in its low nibbles, 32-63 and
// 96-127 in its high ones), then the scales and sums that the formats' multipliers and mins need.

struct FusedLayout {
  static constexpr int64_t kBlock = 256, kBytes = 256 + 2 * 64;
  // Offsets in a block's record: float x32[16] (scale of each 32-group, then scale * sum of q over it), int16
  // s16[16] (sum of q over each 16 elements), int16 s32[8] (sum over each 32-group), float dx (the scale of
  // activations quantised per 256).
  static constexpr int64_t kX32 = 256, kS16 = kX32 + 64, kS32 = kS16 + 32, kDx = kS32 + 16;
  int64_t blocks, bytes;
  explicit FusedLayout(int64_t cols) : blocks((cols + kBlock - 1) / kBlock), bytes(blocks * kBytes) {}
};

// Where the 32-group g (0-7) of a 256-element block sits among its q: quarters 1 and 2 of each 128 swapped.
constexpr int64_t FusedGroupOffset(int64_t g) { return g / 4 * 128 + (g % 4 == 1 ? 64 : g % 4 == 2 ? 32 : g % 4 * 32); }

HJ_AVX512_VNNI void GgufPackFused(const ActivationRows& rows, int64_t cols, int64_t group, void* packed) {
  const FusedLayout layout(cols);
  std::vector<float> x(cols);
  std::vector<int8_t> q(group);
  std::memset(packed, 0, rows.count * layout.bytes);  // a Q8_0 row's last block: zero past cols
  for (int64_t t = 0; t < rows.count; ++t) {
    GgufTokenFloats(rows, t, cols, x.data());
    char* token = static_cast<char*>(packed) + t * layout.bytes;
    for (int64_t c0 = 0; c0 < cols; c0 += group) {
      const int64_t n = std::min(group, cols - c0);  // cols is a multiple of 32
      const float scale = QuantizeInt8Avx512(x.data() + c0, n, q.data());
      for (int64_t c = c0; c < c0 + n; c += kActBlock) {
        char* block = token + c / FusedLayout::kBlock * FusedLayout::kBytes;
        const int64_t g = c % FusedLayout::kBlock / kActBlock;
        const int8_t* src = q.data() + (c - c0);
        std::memcpy(block + FusedGroupOffset(g), src, kActBlock);
        auto* x32 = reinterpret_cast<float*>(block + FusedLayout::kX32);
        auto* s16 = reinterpret_cast<int16_t*>(block + FusedLayout::kS16);
        auto* s32 = reinterpret_cast<int16_t*>(block + FusedLayout::kS32);
        int sums[2] = {0, 0};
        for (int i = 0; i < kActBlock; ++i) sums[i / 16] += src[i];
        x32[g] = scale;
        x32[8 + g] = scale * static_cast<float>(sums[0] + sums[1]);
        s16[2 * g] = static_cast<int16_t>(sums[0]);
        s16[2 * g + 1] = static_cast<int16_t>(sums[1]);
        s32[g] = static_cast<int16_t>(sums[0] + sums[1]);
        std::memcpy(block + FusedLayout::kDx, &scale, sizeof scale);
      }
    }
  }
}

// Permutes of a format's sub-block scales, made once per call. The 32-groups of each of a block's four 64-byte q
// vectors per int32 lane (Q8_0's float multipliers); and where each int16 of the packs of q vectors 0, 1 and 2, 3
// (FusedSums) finds its sub-block's scale: vector k's 128-bit lane L holds 32-group L / 2 * 2 + k / 2 * 4 + k % 2
// (Q4_K), 16-group {0, 1, 4, 5}[L] + k / 2 * 8 + k % 2 * 2 (Q6_K, Q2_K, Q3_K: sub-blocks of 16), and the pack puts
// vector 2m's four words of lane L before vector 2m + 1's.
struct FusedPicks {
  __m512i lanes[4], scales[2];
};

HJ_AVX512_VNNI inline FusedPicks MakeFusedPicks(WeightFormat format) {
  FusedPicks p;
  for (int k = 0; k < 4; ++k) {
    const int g = k / 2 * 4 + k % 2;
    p.lanes[k] = _mm512_inserti64x4(_mm512_set1_epi32(g), _mm256_set1_epi32(g + 2), 1);
  }
  alignas(64) int16_t words[2][32];  // Q6_K: word indices (vpermw); Q4_K: byte indices in the low byte (vpermb)
  for (int m = 0; m < 2; ++m) {
    for (int i = 0; i < 32; ++i) {
      const int lane = i / 8, k = 2 * m + i % 8 / 4;
      const bool by16 = format == WeightFormat::kQ6K || format == WeightFormat::kQ2K || format == WeightFormat::kQ3K;
      words[m][i] = static_cast<int16_t>(by16
                                             ? (lane % 2 + lane / 2 * 4) + k / 2 * 8 + k % 2 * 2
                                             : lane / 2 * 2 + k / 2 * 4 + k % 2);
    }
    p.scales[m] = _mm512_load_si512(words[m]);
  }
  return p;
}

// Accumulators of one row: per token, kAcc chains of dot products (one would be a chain of multiply-add latencies
// with one or two tokens; the K-quants add once per block to the first), and the min terms.
template <int N>
struct FusedAcc {
  static constexpr int kAcc = N == 1 ? 4 : N <= 3 ? 2 : 1;
  __m512 dots[N][kAcc], mins[N];
};

// Q8_0: the block at `block` (of each token's record) against weights wq[4] (FusedLayout order), lane scales the
// permutes of p[t] by lanes[k].
template <int N>
HJ_AVX512_VNNI inline void FusedDots(const __m512i wq[4], const __m512 p[N], const __m512i lanes[4],
                                     const char* const tok[N], int64_t block, FusedAcc<N>& acc) {
  for (int k = 0; k < 4; ++k) {
    for (int t = 0; t < N; ++t) {
      const __m512i x = _mm512_loadu_si512(tok[t] + block + 64 * k);
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[k], x);
      __m512& d = acc.dots[t][k % FusedAcc<N>::kAcc];
      d = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(lanes[k], p[t]), d);
    }
  }
}

// K-quants: the super-block's weights wq[4] (FusedLayout order) against one token's q at x, each sub-block's sum
// times its integer scale (scales: FusedPicks's permutes of them, as int16), summed over the super-block in int32
// lanes.
HJ_AVX512_VNNI inline __m512i FusedSums(const __m512i wq[4], const __m512i scales[2], const char* x) {
  __m512i dot[4];
  for (int k = 0; k < 4; ++k) {
    dot[k] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[k], _mm512_loadu_si512(x + 64 * k));
  }
  const __m512i sums = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_packs_epi32(dot[0], dot[1]), scales[0]);
  return _mm512_dpwssd_epi32(sums, _mm512_packs_epi32(dot[2], dot[3]), scales[1]);
}

// Multipliers [weight scale of 32-group j, weight min of j] x the token's [scale of j, scale * sum over j]: the
// lanes of the dot products, and the min terms in lanes 8-15.
template <int N>
HJ_AVX512_VNNI inline void FusedScales32(__m512 w, const char* const tok[N], int64_t block, __m512 p[N],
                                         FusedAcc<N>& acc) {
  for (int t = 0; t < N; ++t) {
    p[t] = _mm512_mul_ps(w, _mm512_loadu_ps(tok[t] + block + FusedLayout::kX32));
    acc.mins[t] = _mm512_mask_add_ps(acc.mins[t], 0xff00, acc.mins[t], p[t]);
  }
}

HJ_AVX512_VNNI inline float TokenScale(const char* x) {
  float dx;
  std::memcpy(&dx, x + FusedLayout::kDx, sizeof dx);
  return dx;
}

template <int N, bool kFive>
HJ_AVX512_VNNI inline void Q4KFused(const uint8_t* b, const char* const tok[N], int64_t block, const FusedPicks& picks,
                                    FusedAcc<N>& acc) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  __m512i wq[4];
  for (int h = 0; h < 2; ++h) {
    const __m512i v = _mm512_loadu_si512((kFive ? b + 48 : b + 16) + 64 * h);
    wq[2 * h] = _mm512_and_si512(v, low4);
    wq[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  }
  if constexpr (kFive) {
    // Bit 2c of qh[l] is the fifth bit of element 64c + l, bit 2c + 1 that of 64c + 32 + l: with qh >> 2 in the
    // upper half, bits 4h and 4h + 1 land in the lanes of wq[2h] and wq[2h + 1].
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
    const __m512i both = _mm512_mask_srli_epi16(qh, 0xffff0000, qh, 2);
    const __m512i bit4 = _mm512_set1_epi8(0x10);
    wq[0] = _mm512_ternarylogic_epi32(wq[0], _mm512_slli_epi16(both, 4), bit4, 0xf8);  // a | (b & c)
    wq[1] = _mm512_ternarylogic_epi32(wq[1], _mm512_slli_epi16(both, 3), bit4, 0xf8);
    wq[2] = _mm512_ternarylogic_epi32(wq[2], both, bit4, 0xf8);
    wq[3] = _mm512_ternarylogic_epi32(wq[3], _mm512_srli_epi16(both, 1), bit4, 0xf8);
  }
  // The 6-bit scales as int16 where the packs need them (the odd bytes zero), the mins as int16 j for the
  // activations' sums s32[j].
  const __m128i sm = Q4KScalesMins(b);
  constexpr __mmask64 kLowBytes = 0x5555555555555555;
  const __m512i scales[2] = {_mm512_maskz_permutexvar_epi8(kLowBytes, picks.scales[0], _mm512_zextsi128_si512(sm)),
                             _mm512_maskz_permutexvar_epi8(kLowBytes, picks.scales[1], _mm512_zextsi128_si512(sm))};
  const __m128i mins = _mm_unpackhi_epi8(sm, _mm_setzero_si128());
  uint32_t halves;
  std::memcpy(&halves, b, sizeof halves);
  const __m128 d_dmin = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(halves)));  // exact
  for (int t = 0; t < N; ++t) {
    const char* x = tok[t] + block;
    const __m512i sums = FusedSums(wq, scales, x);
    const __m128i s32 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + FusedLayout::kS32));
    const __m128i min_sums = _mm_madd_epi16(mins, s32);
    const __m128 f = _mm_mul_ps(d_dmin, _mm_set1_ps(TokenScale(x)));  // [d, dmin] x the token's scale
    acc.dots[t][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_broadcastss_ps(f), acc.dots[t][0]);
    acc.mins[t] = _mm512_fmadd_ps(_mm512_zextps128_ps512(_mm_cvtepi32_ps(min_sums)),
                                  _mm512_zextps128_ps512(_mm_shuffle_ps(f, f, 0x55)), acc.mins[t]);
  }
}

template <int N>
HJ_AVX512_VNNI inline void Q6KFused(const uint8_t* b, const char* const tok[N], int64_t block, const FusedPicks& picks,
                                    FusedAcc<N>& acc) {
  const __m512i low4 = _mm512_set1_epi8(0x0f), bits45 = _mm512_set1_epi8(0x30);
  const auto half256 = [](const uint8_t* p) HJ_AVX512_VNNI {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  __m512i wq[4];
  for (int h = 0; h < 2; ++h) {
    // Element 128h + j: low 4 bits in ql[64h + j % 64] (high nibble from j = 64), top 2 at bit 2 (j / 32) of
    // qh[32h + j % 32]. Each 32 bytes go to both halves of a vector, the upper half shifted by 4.
    const __m512i qh = half256(b + 128 + 32 * h);
    const __m512i top = _mm512_mask_srli_epi16(qh, 0xffff0000, qh, 4);  // bits 0-1: j < 32 and 64..95; 2-3: others
    for (int s = 0; s < 2; ++s) {
      const __m512i ql = half256(b + 64 * h + 32 * s);
      const __m512i low = _mm512_and_si512(_mm512_mask_srli_epi16(ql, 0xffff0000, ql, 4), low4);
      wq[2 * h + s] = _mm512_ternarylogic_epi32(low, _mm512_slli_epi16(top, 4 - 2 * s), bits45, 0xf8);
    }
  }
  // The int8 scales as int16; q - 32: the min term 32 * scale s * s16[s], subtracted from the integer sums.
  const __m256i scale16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
  const __m512i scales[2] = {_mm512_permutexvar_epi16(picks.scales[0], _mm512_zextsi256_si512(scale16)),
                             _mm512_permutexvar_epi16(picks.scales[1], _mm512_zextsi256_si512(scale16))};
  const float d = HalfAt(b + 208);
  for (int t = 0; t < N; ++t) {
    const char* x = tok[t] + block;
    const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + FusedLayout::kS16));
    const __m256i mins = _mm256_slli_epi32(_mm256_madd_epi16(scale16, s16), 5);  // 32 x sum of scale s x s16[s]
    const __m512i sums = _mm512_sub_epi32(FusedSums(wq, scales, x), _mm512_zextsi256_si512(mins));
    acc.dots[t][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(d * TokenScale(x)), acc.dots[t][0]);
  }
}

// Q2_K (Q3_K with kThree): vector 2h + s holds elements 128h + 32s + l in its lower 256 bits (bits 2s of q byte
// 32h + l) and 128h + 64 + 32s + l in its upper ones (bits 2s + 4), each 32 bytes of q broadcast to both halves and
// the upper one shifted by 4; Q3_K's third bit of element 128h + 32j + l is bit 4h + j of byte l, added at bit 2.
// Sub-blocks of 16 as Q6_K's: Q2_K's min term dmin x the sum of min m x the token's s16[m], apart as Q4_K's; Q3_K's
// q - 4 as 4 x the sum of scale s x s16[s] subtracted from the integer sums, as Q6_K's q - 32.
template <int N, bool kThree>
HJ_AVX512_VNNI inline void Q2KFused(const uint8_t* b, const char* const tok[N], int64_t block, const FusedPicks& picks,
                                    FusedAcc<N>& acc) {
  const __m512i low2 = _mm512_set1_epi8(3), bit2 = _mm512_set1_epi8(4);
  const auto half256 = [](const uint8_t* p) HJ_AVX512_VNNI {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  const uint8_t* qs = kThree ? b + 32 : b + 16;
  __m512i wq[4];
  for (int h = 0; h < 2; ++h) {
    const __m512i v = half256(qs + 32 * h);
    const __m512i both = _mm512_mask_srli_epi16(v, 0xffff0000, v, 4);
    for (int s = 0; s < 2; ++s) wq[2 * h + s] = _mm512_and_si512(_mm512_srli_epi16(both, 2 * s), low2);
  }
  __m256i sc16;  // the sub-blocks' integer scales (Q3_K: 6-bit - 32)
  __m256i m16;   // Q2_K's mins
  if constexpr (kThree) {
    const __m512i hm = half256(b);
    const __m512i both = _mm512_mask_srli_epi16(hm, 0xffff0000, hm, 2);  // upper: bit j + 2 down to j
    for (int h = 0; h < 2; ++h) {
      for (int s = 0; s < 2; ++s) {
        const __m512i bit = _mm512_slli_epi16(_mm512_srli_epi16(both, 4 * h + s), 2);
        wq[2 * h + s] = _mm512_ternarylogic_epi32(wq[2 * h + s], bit, bit2, 0xf8);  // a | (b & c)
      }
    }
    sc16 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(Q3KScalesVector(b)), _mm256_set1_epi16(32));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
    const __m128i low4 = _mm_set1_epi8(0x0f);
    sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low4));
    m16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low4));
  }
  const __m512i scales[2] = {_mm512_permutexvar_epi16(picks.scales[0], _mm512_zextsi256_si512(sc16)),
                             _mm512_permutexvar_epi16(picks.scales[1], _mm512_zextsi256_si512(sc16))};
  const float d = HalfAt(kThree ? b + 108 : b + 80), dmin = kThree ? 0.0f : HalfAt(b + 82);
  for (int t = 0; t < N; ++t) {
    const char* x = tok[t] + block;
    const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + FusedLayout::kS16));
    __m512i sums = FusedSums(wq, scales, x);
    const float dx = TokenScale(x);
    if constexpr (kThree) {
      sums = _mm512_sub_epi32(sums, _mm512_zextsi256_si512(_mm256_slli_epi32(_mm256_madd_epi16(sc16, s16), 2)));
    } else {
      const __m256 mins = _mm256_cvtepi32_ps(_mm256_madd_epi16(m16, s16));
      acc.mins[t] = _mm512_fmadd_ps(_mm512_zextps256_ps512(mins), _mm512_set1_ps(dmin * dx), acc.mins[t]);
    }
    acc.dots[t][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(d * dx), acc.dots[t][0]);
  }
}

// IQ4_XS: each index looked up as its value + 128 (unsigned, for vpdpbusd; the 128 x the activations' sum is the
// min term, as Q8_0's), then put in FusedLayout order: of 128 elements, a 64-byte load's low nibbles hold elements
// 32j + l and its high ones 32j + 16 + l (byte 16j + l), and vector 2h takes elements 0-31 and 64-95, 2h + 1 32-63
// and 96-127. A scale per 32-group (d * (sc - 32), its lanes' multipliers as Q8_0's d).
template <int N>
HJ_AVX512_VNNI inline void Iq4XsFused(const uint8_t* b, const char* const tok[N], int64_t block,
                                      const FusedPicks& picks, FusedAcc<N>& acc) {
  alignas(64) static const std::array<std::array<uint8_t, 64>, 2> kOrder = [] {
    std::array<std::array<uint8_t, 64>, 2> o{};
    for (int i = 0; i < 64; ++i) {  // operands: the low-nibble values (0-63), then the high ones (64-127)
      const bool high = i / 16 % 2;
      o[0][i] = static_cast<uint8_t>(high ? 64 + i - 16 : i);
      o[1][i] = static_cast<uint8_t>(high ? 64 + i : i + 16);
    }
    return o;
  }();
  const __m512i table = _mm512_broadcast_i32x4(Iq4XsUnsignedValues());
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i order[2] = {_mm512_load_si512(kOrder[0].data()), _mm512_load_si512(kOrder[1].data())};
  __m512i wq[4];
  for (int h = 0; h < 2; ++h) {
    const __m512i v = _mm512_loadu_si512(b + 8 + 64 * h);
    const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low4));
    const __m512i hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
    wq[2 * h] = _mm512_permutex2var_epi8(lo, order[0], hi);
    wq[2 * h + 1] = _mm512_permutex2var_epi8(lo, order[1], hi);
  }
  // The 8 scales: low 4 bits nibble j of the 32-bit word at byte 4, top 2 bits 2j of the 16-bit one at byte 2.
  uint64_t head;
  std::memcpy(&head, b, sizeof head);
  const __m256i low = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(head >> 32)),
                                        _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
  const __m256i top = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>((head >> 16) & 0xffff)),
                                        _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
  const __m256i sc = _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi32(15)),
                                     _mm256_slli_epi32(_mm256_and_si256(top, _mm256_set1_epi32(3)), 4));
  const __m256 s = _mm256_mul_ps(_mm256_set1_ps(HalfAt(b)), _mm256_cvtepi32_ps(_mm256_sub_epi32(sc, _mm256_set1_epi32(32))));
  const __m512 w = _mm512_insertf32x8(_mm512_castps256_ps512(s), _mm256_mul_ps(s, _mm256_set1_ps(128.0f)), 1);
  __m512 p[N];
  FusedScales32<N>(w, tok, block, p, acc);
  FusedDots<N>(wq, p, picks.lanes, tok, block, acc);
}

// Eight Q8_0 blocks (the first `blocks` of them that the row holds), q + 128 unsigned: block j is 32-group j.
template <int N, bool kWhole>
HJ_AVX512_VNNI inline void Q80Fused(const uint8_t* b, int blocks, const char* const tok[N], int64_t block,
                                    const FusedPicks& picks, FusedAcc<N>& acc) {
  const __m256i flip = _mm256_set1_epi8(-128);
  const auto load = [&](int j) HJ_AVX512_VNNI {
    const void* at = b + 34 * j + 2;
    // Past the row: 128, against zero activations.
    return _mm256_xor_si256(kWhole ? _mm256_loadu_si256(static_cast<const __m256i*>(at))
                                   : _mm256_maskz_loadu_epi8(j < blocks ? ~__mmask32{0} : 0, at),
                            flip);
  };
  __m512i wq[4];
  for (int k = 0; k < 4; ++k) {
    const int j = k / 2 * 4 + k % 2;
    wq[k] = _mm512_inserti64x4(_mm512_castsi256_si512(load(j)), load(j + 2), 1);
  }
  // The blocks' d: 4 bytes gathered from each block's start (its d, then 2 bytes of its q).
  const __m256i at = _mm256_setr_epi32(0, 34, 68, 102, 136, 170, 204, 238);
  const __m256i d_bits =
      kWhole ? _mm256_i32gather_epi32(reinterpret_cast<const int*>(b), at, 1)
             : _mm256_mmask_i32gather_epi32(_mm256_setzero_si256(), (1u << blocks) - 1, at, b, 1);  // d = 0 past
  const __m256 d = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(d_bits));
  const __m512 w = _mm512_insertf32x8(_mm512_castps256_ps512(d), _mm256_mul_ps(d, _mm256_set1_ps(128.0f)), 1);
  __m512 p[N];
  FusedScales32<N>(w, tok, block, p, acc);
  FusedDots<N>(wq, p, picks.lanes, tok, block, acc);
}

template <int N>
HJ_AVX512_VNNI void FusedRows(const LayerWeights& layer, const Projection& p, int64_t row0, int64_t rows,
                              const void* packed, float* out, int64_t out_stride) {
  const WeightFormat format = layer.ProjectionFormat(p.which);
  const int64_t bytes = GgufBlockBytes(format), ahead = WeightPrefetchBytes();
  const FusedLayout layout(p.cols);
  const char* tok[N];
  for (int t = 0; t < N; ++t) tok[t] = static_cast<const char*>(packed) + t * layout.bytes;
  const FusedPicks picks = MakeFusedPicks(format);
  // A step covers one K-quant super-block, or eight Q8_0 blocks.
  const int64_t step_bytes = FusedLayout::kBlock / GgufBlockElements(format) * bytes;
  const int64_t whole = p.cols / FusedLayout::kBlock;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* data = RowData(layer, p, row0 + r);
    FusedAcc<N> acc;
    for (int t = 0; t < N; ++t) {
      for (auto& d : acc.dots[t]) d = _mm512_setzero_ps();
      acc.mins[t] = _mm512_setzero_ps();
    }
    for (int64_t s = 0; s < whole; ++s, data += step_bytes) {
      if (ahead > 0) {
        // Each line twice, as the MXFP4 kernel (Mxfp4Prefetch): 4x the usual distance ahead into L2, and 512 bytes
        // ahead into L1 (a projection's rows are consecutive: the stream runs on into the next row). With one
        // prefetch into L1 at the usual distance a thread streamed 15-30% slower from DRAM (dev Xeon, one thread):
        // each such request holds one of the core's few line fill buffers for a whole memory latency.
        const char* at = reinterpret_cast<const char*>(data);
        for (int64_t line = 0; line < step_bytes; line += 64) {
          _mm_prefetch(at + 4 * ahead + line, _MM_HINT_T1);
          _mm_prefetch(at + kNearPrefetch + line, _MM_HINT_T0);
        }
      }
      const int64_t block = s * FusedLayout::kBytes;
      switch (format) {
        case WeightFormat::kQ8_0:
          Q80Fused<N, true>(data, 8, tok, block, picks, acc);
          break;
        case WeightFormat::kQ6K:
          Q6KFused<N>(data, tok, block, picks, acc);
          break;
        case WeightFormat::kQ5K:
          Q4KFused<N, true>(data, tok, block, picks, acc);
          break;
        case WeightFormat::kQ2K:
          Q2KFused<N, false>(data, tok, block, picks, acc);
          break;
        case WeightFormat::kQ3K:
          Q2KFused<N, true>(data, tok, block, picks, acc);
          break;
        case WeightFormat::kIq4Xs:
          Iq4XsFused<N>(data, tok, block, picks, acc);
          break;
        default:
          Q4KFused<N, false>(data, tok, block, picks, acc);
          break;
      }
    }
    if (whole < layout.blocks) {  // Q8_0 rows are multiples of 32 elements only
      Q80Fused<N, false>(data, static_cast<int>(p.cols % FusedLayout::kBlock / 32), tok, whole * FusedLayout::kBytes,
                         picks, acc);
    }
    for (int t = 0; t < N; ++t) {
      __m512 dots = _mm512_sub_ps(acc.dots[t][0], acc.mins[t]);
      for (int a = 1; a < FusedAcc<N>::kAcc; ++a) dots = _mm512_add_ps(dots, acc.dots[t][a]);
      out[r * out_stride + t] = _mm512_reduce_add_ps(dots);
    }
  }
}

size_t GgufPackedBytesAvx512(const LayerWeights&, int64_t tokens, int64_t cols) { return tokens * FusedLayout(cols).bytes; }

void GgufPackAvx512(const LayerWeights& layer, const ActivationRows& rows, int64_t cols, void* packed) {
  GgufPackFused(rows, cols, GgufActivationGroup(layer), packed);
}

// Four tokens at a time over all the rows, then the one to three left: a task's rows (a few hundred KB) come back from
// L2 for each four tokens, where rows outer, four tokens inner ran 1.1-1.4x slower from 64 tokens an expert.
HJ_AVX512_VNNI void GgufGemmAvx512(const LayerWeights& layer, const Projection* w, int n_proj, int64_t row0,
                                   int64_t rows, const void* packed, int64_t tokens, float* const* out,
                                   int64_t out_stride) {
  constexpr void (*kFused[])(const LayerWeights&, const Projection&, int64_t, int64_t, const void*, float*, int64_t) = {
      FusedRows<1>, FusedRows<2>, FusedRows<3>, FusedRows<4>};
  static_assert(std::size(kFused) == kGgufFusedMaxTokens);
  const int64_t token_bytes = FusedLayout(w[0].cols).bytes;
  for (int p = 0; p < n_proj; ++p) {
    for (int64_t t = 0; t < tokens; t += kGgufFusedMaxTokens) {
      const int64_t n = std::min(kGgufFusedMaxTokens, tokens - t);
      kFused[n - 1](layer, w[p], row0, rows, static_cast<const char*>(packed) + t * token_bytes, out[p] + t, out_stride);
    }
  }
}

constexpr GemmKernel kGgufGeneric{"generic", 1, GgufPackedBytes, GgufPack, GgufGemmGeneric};
constexpr GemmKernel kGgufAvx512{"avx512", 1, GgufPackedBytesAvx512, GgufPackAvx512, GgufGemmAvx512};

}  // namespace

void GgufTokenFloats(const ActivationRows& rows, int64_t t, int64_t cols, float* x) {
  const void* src = rows.Row(t);
  if (rows.bf16) {
    for (int64_t c = 0; c < cols; ++c) x[c] = Bf16BitsToFloat(static_cast<const uint16_t*>(src)[c]);
  } else {
    std::copy_n(static_cast<const float*>(src), cols, x);
  }
}

int64_t GgufActivationGroup(const LayerWeights& layer) {
  const bool q8_0 = layer.ProjectionFormat(Matrix::kGate) == WeightFormat::kQ8_0 &&
                    layer.ProjectionFormat(Matrix::kDown) == WeightFormat::kQ8_0;
  return q8_0 ? kActBlock : FusedLayout::kBlock;
}

const GemmKernel* GgufGenericKernel(const LayerWeights& layer) {
  return IsGgufFormat(layer.format) ? &kGgufGeneric : nullptr;
}

const GemmKernel* GgufAvx512Kernel(const LayerWeights& layer) {
  return IsGgufFormat(layer.format) ? &kGgufAvx512 : nullptr;
}

}  // namespace hybridjit
