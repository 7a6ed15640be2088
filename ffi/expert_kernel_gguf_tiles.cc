// GGUF experts with many tokens on AVX-512 VNNI hosts without AMX (AMD Zen 4/5, Ice Lake): register tiles of
// kRows weight rows x kTokens tokens.
//
// The few-token kernel (expert_kernel_gguf.cc) splits each block in registers and multiplies it with up to four
// tokens, each token's dot product summed across the lanes of its vectors: every 64 weight bytes cost a vpdpbusd and a
// float rescale per token. That suits decode; with tens to hundreds of tokens an expert it spends most of its time on
// the rescales (IQ4_XS prefill ran at half llama.cpp's speed on the 2-core Zen 5, session 36). Here the lanes are
// tokens instead: each block of kRows rows is decoded once into signed bytes in memory, and every vpdpbusd multiplies
// 4 of one row's weights (broadcast) with those 4 elements of 16 tokens (the activations packed token-interleaved),
// so one int32 lane accumulates one (row, token) pair over a sub-block of 16, and the rescale is one per 16 elements
// for 16 tokens at once. The activations are quantised as the few-token kernel quantises them (FusedGroup), so the two
// kernels differ by float summation order only.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "expert_kernels.h"
#include "gguf_blocks.h"
#include "gguf_blocks_avx512.h"
#include "int8_quantize_avx512.h"
#include "numeric_formats.h"

namespace hybridjit {
namespace {

constexpr int64_t kTokens = 16;  // tokens a tile: one per int32 lane
constexpr int64_t kRows = 4;     // weight rows a tile: each activation vector loaded serves four rows
constexpr int64_t kBlock = 256;  // columns a step: a K-quant super-block, eight Q8_0 blocks
constexpr int64_t kSubs = kBlock / 16;
using Int32Alias [[gnu::may_alias]] = int32_t;  // four codes of a tile read as one int32

// Packed activations, per group of kTokens tokens (the last one padded with zero tokens) and per 256 columns:
// x + 128 as unsigned bytes [64 quads of columns][16 tokens][4] (vpdpbusd's unsigned operand: lane t holds token t's
// four elements of the quad); each token's quantisation scale of each 32 columns [8][16]; scale x the sum of its q
// over each 16 columns [16][16] (float: the sub-blocks' min terms); and 128 x that sum unscaled [16][16] (int32: what
// takes the activations' + 128 back out of the integer dot products).
struct TileLayout {
  static constexpr int64_t kScale = 4096, kSums = kScale + 8 * 64, kOffsets = kSums + kSubs * 64;
  static constexpr int64_t kBytes = kOffsets + kSubs * 64;
  int64_t group_bytes;
  explicit TileLayout(int64_t cols) : group_bytes(cols / kBlock * kBytes) {}
  static int64_t Groups(int64_t tokens) { return (tokens + kTokens - 1) / kTokens; }
};

size_t TilePackedBytes(const LayerWeights&, int64_t tokens, int64_t cols) {
  return TileLayout::Groups(tokens) * TileLayout(cols).group_bytes;
}

HJ_AVX512_VNNI void TilePack(const LayerWeights& layer, const ActivationRows& rows, int64_t cols, void* packed) {
  const TileLayout layout(cols);
  const int64_t group = GgufActivationGroup(layer);
  // Padding tokens stay zero: their scales are 0, so whatever their bytes they add nothing.
  std::memset(packed, 0, TilePackedBytes(layer, rows.count, cols));
  std::vector<float> x(cols), scale(cols / 32);
  std::vector<int8_t> q(cols);
  for (int64_t t = 0; t < rows.count; ++t) {
    char* records = static_cast<char*>(packed) + t / kTokens * layout.group_bytes;
    const int64_t lane = t % kTokens;
    GgufTokenFloats(rows, t, cols, x.data());
    for (int64_t c0 = 0; c0 < cols; c0 += group) {
      const int64_t n = std::min(group, cols - c0);
      std::fill_n(scale.data() + c0 / 32, n / 32, QuantizeInt8Avx512(x.data() + c0, n, q.data() + c0));
    }
    for (int64_t b = 0; b < cols / kBlock; ++b) {
      char* record = records + b * TileLayout::kBytes;
      alignas(64) uint8_t biased[kBlock];  // q + 128
      alignas(64) uint64_t sums8[kBlock / 8];  // sum of q + 128 over each 8
      for (int k = 0; k < 4; ++k) {
        const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(q.data() + b * kBlock + 64 * k), _mm512_set1_epi8(-128));
        _mm512_store_si512(biased + 64 * k, v);
        _mm512_store_si512(sums8 + 8 * k, _mm512_sad_epu8(v, _mm512_setzero_si512()));
      }
      for (int64_t quad = 0; quad < kBlock / 4; ++quad) std::memcpy(record + quad * 64 + lane * 4, biased + 4 * quad, 4);
      auto* scales = reinterpret_cast<float*>(record + TileLayout::kScale);
      auto* sums = reinterpret_cast<float*>(record + TileLayout::kSums);
      auto* offsets = reinterpret_cast<int32_t*>(record + TileLayout::kOffsets);
      for (int64_t g = 0; g < 8; ++g) scales[g * kTokens + lane] = scale[b * 8 + g];
      for (int64_t sub = 0; sub < kSubs; ++sub) {
        const int sum = static_cast<int>(sums8[2 * sub] + sums8[2 * sub + 1]) - 16 * 128;
        sums[sub * kTokens + lane] = scale[b * 8 + sub / 2] * static_cast<float>(sum);
        offsets[sub * kTokens + lane] = 128 * sum;
      }
    }
  }
}

// kRows rows' blocks at one column step, decoded. A row's elements are w = S q - M per sub-block of 16 (q unsigned,
// DecodeGgufBlock's form, as the few-token kernel computes them); with the signed code q - 128 (vpdpbusd's signed
// operand) and x + 128 the packed activations, dot = sum of (x + 128)(q - 128) = sum x q - 128 sum x + 128 sum q -
// 16384 x 16, so sum x q = dot + 128 sum x + corr, corr = 262144 - 128 sum q: exact in int32, and a sub-block gives
// sum w x_real = S xs (sum x q) - M (xs sum x), xs the token's scale of the 32 columns. (Leaving the 128 sum x terms
// to cancel in float32 cost Q4_K's results 5e-5 of their scale, against ~1e-7 this way.)
struct DecodedTile {
  alignas(64) int8_t code[kRows][kBlock];
  alignas(64) float scale[kRows][kSubs];  // S
  alignas(64) float min[kRows][kSubs];  // M
  alignas(64) int32_t corr[kRows][kSubs];
};

// One row's 256 columns from its blocks at b: q as unsigned bytes in natural order into q[256] (four vectors),
// S and M per sub-block of 16.
HJ_AVX512_VNNI void DecodeRowStep(WeightFormat format, const uint8_t* b, __m512i q[4], float s[kSubs],
                                  float m[kSubs]) {
  switch (format) {
    case WeightFormat::kQ4K:
    case WeightFormat::kQ5K: {
      const bool five = format == WeightFormat::kQ5K;
      for (int c = 0; c < 4; ++c) {
        __m256i lo, hi;
        Q4KChunk(b, five, c, &lo, &hi);
        q[c] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      }
      alignas(64) float mult[16];
      _mm512_store_ps(mult, Q4KMultipliers(b));
      for (int j = 0; j < 8; ++j) {
        s[2 * j] = s[2 * j + 1] = mult[j];
        m[2 * j] = m[2 * j + 1] = mult[8 + j];
      }
      return;
    }
    case WeightFormat::kQ6K: {
      for (int half = 0; half < 2; ++half) {
        __m256i v[4];
        Q6KHalf(b, half, v);
        q[2 * half] = _mm512_inserti64x4(_mm512_castsi256_si512(v[0]), v[1], 1);
        q[2 * half + 1] = _mm512_inserti64x4(_mm512_castsi256_si512(v[2]), v[3], 1);
      }
      const __m512 scales = Q6KScales(b);
      _mm512_storeu_ps(s, scales);
      _mm512_storeu_ps(m, _mm512_mul_ps(scales, _mm512_set1_ps(32.0f)));
      return;
    }
    case WeightFormat::kQ2K:
    case WeightFormat::kQ3K: {
      const bool three = format == WeightFormat::kQ3K;
      for (int h = 0; h < 2; ++h) {
        for (int j = 0; j < 4; j += 2) {
          q[2 * h + j / 2] = _mm512_inserti64x4(_mm512_castsi256_si512(Q2KQuarter(b, three, h, j)),
                                                Q2KQuarter(b, three, h, j + 1), 1);
        }
      }
      __m512 scales, mins;
      Q2KMultipliers(b, three, &scales, &mins);
      _mm512_storeu_ps(s, scales);
      _mm512_storeu_ps(m, mins);
      return;
    }
    case WeightFormat::kIq4Xs: {  // q = value + 128
      const __m128i table = Iq4XsUnsignedValues();
      const __m128i low4 = _mm_set1_epi8(0x0f);
      const float d = HalfAt(b);
      alignas(64) uint8_t bytes[kBlock];
      for (int j = 0; j < 8; ++j) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 8 + 16 * j));
        _mm_store_si128(reinterpret_cast<__m128i*>(bytes + 32 * j), _mm_shuffle_epi8(table, _mm_and_si128(v, low4)));
        _mm_store_si128(reinterpret_cast<__m128i*>(bytes + 32 * j + 16),
                        _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(v, 4), low4)));
        s[2 * j] = s[2 * j + 1] = d * static_cast<float>(Iq4XsScale(b, j) - 32);
        m[2 * j] = m[2 * j + 1] = 128.0f * s[2 * j];
      }
      for (int k = 0; k < 4; ++k) q[k] = _mm512_load_si512(bytes + 64 * k);
      return;
    }
    default: {  // Q8_0: eight blocks of 34 bytes, q + 128
      alignas(64) uint8_t bytes[kBlock];
      for (int j = 0; j < 8; ++j) {
        const uint8_t* block = b + 34 * j;
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
        _mm256_store_si256(reinterpret_cast<__m256i*>(bytes + 32 * j), _mm256_xor_si256(raw, _mm256_set1_epi8(-128)));
        s[2 * j] = s[2 * j + 1] = HalfAt(block);
        m[2 * j] = m[2 * j + 1] = 128.0f * s[2 * j];
      }
      for (int k = 0; k < 4; ++k) q[k] = _mm512_load_si512(bytes + 64 * k);
      return;
    }
  }
}

HJ_AVX512_VNNI void DecodeTile(WeightFormat format, const uint8_t* const blocks[kRows], int64_t rows, DecodedTile& tile) {
  for (int64_t r = 0; r < kRows; ++r) {
    if (r >= rows) {  // past the projection's rows: zero weights, whose results are not stored
      std::memset(tile.code[r], 0, kBlock);
      std::fill_n(tile.scale[r], kSubs, 0.0f);
      std::fill_n(tile.min[r], kSubs, 0.0f);
      std::fill_n(tile.corr[r], kSubs, 0);
      continue;
    }
    __m512i q[4];
    DecodeRowStep(format, blocks[r], q, tile.scale[r], tile.min[r]);
    alignas(64) uint64_t sums[4][8];  // sum of q over each 8 bytes
    for (int k = 0; k < 4; ++k) {
      _mm512_store_si512(tile.code[r] + 64 * k, _mm512_xor_si512(q[k], _mm512_set1_epi8(-128)));
      _mm512_store_si512(sums[k], _mm512_sad_epu8(q[k], _mm512_setzero_si512()));
    }
    for (int64_t sub = 0; sub < kSubs; ++sub) {
      const uint64_t* eight = sums[sub / 4] + 2 * (sub % 4);
      tile.corr[r][sub] = 262144 - 128 * static_cast<int32_t>(eight[0] + eight[1]);
    }
  }
}

// acc[16 r ..] (row r's 16 tokens) += row r of the tile . the token group's record at this column step, the integer
// dot products summed over kSpan columns (16, or 32 where the format's S and M hold over 32: Q4_K, Q5_K, IQ4_XS, Q8_0)
// before each rescale.
template <int64_t kSpan>
HJ_AVX512_VNNI inline void MultiplyTile(const DecodedTile& tile, const char* record, float* sums_of_rows) {
  constexpr int64_t kHalves = kSpan / 16, kQuads = kSpan / 4;
  const auto* scales = reinterpret_cast<const float*>(record + TileLayout::kScale);
  const auto* sums = reinterpret_cast<const float*>(record + TileLayout::kSums);
  const auto* offsets = reinterpret_cast<const int32_t*>(record + TileLayout::kOffsets);
  __m512 acc[kRows];
  for (int64_t r = 0; r < kRows; ++r) acc[r] = _mm512_loadu_ps(sums_of_rows + r * kTokens);
  for (int64_t sub = 0; sub < kSubs; sub += kHalves) {
    __m512i x[kQuads];
    for (int k = 0; k < kQuads; ++k) x[k] = _mm512_loadu_si512(record + (4 * sub + k) * 64);
    const __m512 xs = _mm512_loadu_ps(scales + sub / 2 * kTokens);
    __m512 xsum = _mm512_loadu_ps(sums + sub * kTokens);
    __m512i offset = _mm512_loadu_si512(offsets + sub * kTokens);
    if constexpr (kHalves == 2) {
      xsum = _mm512_add_ps(xsum, _mm512_loadu_ps(sums + (sub + 1) * kTokens));
      offset = _mm512_add_epi32(offset, _mm512_loadu_si512(offsets + (sub + 1) * kTokens));
    }
    for (int64_t r = 0; r < kRows; ++r) {
      // Each 4 codes broadcast straight from the tile (a broadcast load): through a general register, each took a
      // load, a shift and a vpbroadcastd more.
      const auto* w = reinterpret_cast<const Int32Alias*>(tile.code[r] + 16 * sub);
      int32_t corr = tile.corr[r][sub];
      if constexpr (kHalves == 2) corr += tile.corr[r][sub + 1];
      __m512i dot = _mm512_add_epi32(offset, _mm512_set1_epi32(corr));
      for (int k = 0; k < kQuads; ++k) dot = _mm512_dpbusd_epi32(dot, x[k], _mm512_set1_epi32(w[k]));
      const __m512 scaled = _mm512_mul_ps(_mm512_set1_ps(tile.scale[r][sub]), xs);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scaled, acc[r]);
      acc[r] = _mm512_fnmadd_ps(_mm512_set1_ps(tile.min[r][sub]), xsum, acc[r]);
    }
  }
  for (int64_t r = 0; r < kRows; ++r) _mm512_storeu_ps(sums_of_rows + r * kTokens, acc[r]);
}

// Whether a format's S and M hold over 32 columns (its sub-blocks, or Q8_0's blocks, are 32 wide).
bool ScalesPer32(WeightFormat format) {
  return format == WeightFormat::kQ4K || format == WeightFormat::kQ5K || format == WeightFormat::kIq4Xs ||
         format == WeightFormat::kQ8_0;
}

HJ_AVX512_VNNI void TileGemm(const LayerWeights& layer, const Projection* w, int n_proj, int64_t row0, int64_t rows,
                             const void* packed, int64_t tokens, float* const* out, int64_t out_stride) {
  const int64_t cols = w[0].cols, steps = cols / kBlock, groups = TileLayout::Groups(tokens);
  const TileLayout layout(cols);
  DecodedTile tile;
  std::vector<float> acc(groups * kRows * kTokens);  // [group][row][token]
  for (int p = 0; p < n_proj; ++p) {
    const WeightFormat format = layer.ProjectionFormat(w[p].which);
    const int64_t step_bytes = GgufBlockBytes(format) * (kBlock / GgufBlockElements(format));
    const int64_t row_bytes = layer.RowBytes(cols, w[p].which);
    const auto multiply = ScalesPer32(format) ? MultiplyTile<32> : MultiplyTile<16>;
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int64_t n = std::min(kRows, rows - r0);
      std::fill(acc.begin(), acc.end(), 0.0f);
      const uint8_t* blocks[kRows];
      for (int64_t r = 0; r < kRows; ++r) {
        blocks[r] = static_cast<const uint8_t*>(w[p].data) + (row0 + r0 + std::min(r, n - 1)) * row_bytes;
      }
      for (int64_t s = 0; s < steps; ++s) {
        DecodeTile(format, blocks, n, tile);
        for (int64_t r = 0; r < kRows; ++r) blocks[r] += step_bytes;
        for (int64_t g = 0; g < groups; ++g) {
          multiply(tile, static_cast<const char*>(packed) + g * layout.group_bytes + s * TileLayout::kBytes,
                       acc.data() + g * kRows * kTokens);
        }
      }
      for (int64_t g = 0; g < groups; ++g) {
        const __mmask16 lanes = static_cast<__mmask16>((1u << std::min(kTokens, tokens - g * kTokens)) - 1);
        for (int64_t r = 0; r < n; ++r) {
          _mm512_mask_storeu_ps(out[p] + (r0 + r) * out_stride + g * kTokens, lanes,
                                _mm512_loadu_ps(acc.data() + (g * kRows + r) * kTokens));
        }
      }
    }
  }
}

constexpr GemmKernel kGgufTiles{"avx512_tiles", 1, TilePackedBytes, TilePack, TileGemm};

}  // namespace

const GemmKernel* GgufTileKernel(const LayerWeights& layer) {
  const bool whole = layer.hidden % kBlock == 0 && layer.inter % kBlock == 0;  // every column step a whole one
  return IsGgufFormat(layer.format) && whole ? &kGgufTiles : nullptr;
}

}  // namespace hybridjit
