// AMX kernels: the GEMMs of prefill and batched decode, many tokens per expert (KTransformers §3.2).
//
// The product is computed transposed, Y^T = W X^T, so that the weights are the A operand: an A tile is
// 16 weight rows by 64 bytes, which is the checkpoint's own [out, in] layout, while the activations
// (packed once per expert call) take the B operand's pair/quad-interleaved layout. The weights are
// copied tile by tile into an L2-resident strip laid out as whole tiles, zero-padded at the matrix
// edges, so there is no second copy of the weights in memory. bf16 rows are copied as they are; mxfp4, fp8
// whose scale blocks are not whole k-steps, and the GGUF block formats (decoded per row, GgufStrip) are
// dequantized to bfloat16 on that copy (w * scale rounded to nearest even). int8 with one scale per row keeps
// int8 tiles (tdpbssd on int8 activations) and scales once at the end; grouped int8/int4 (int8 tiles) and
// block-scaled fp8 (its exact bfloat16 values) enter the tiles unscaled and are rescaled per scale group
// (AmxGroupGemm), which keeps the copy to a few instructions per 64 weights.
//
// Blocking: per 128 rows and 512 input elements, the strips of every projection (gate and up share
// the activations) are converted once and then swept by 32-token x 32-row blocks of 2x2 C tiles
// accumulated across the 16 (or 8) k-steps; partial sums live in the output buffer between blocks.
#include <immintrin.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tile_multiply.h"
#include "expert_kernels.h"
#include "fp8_bf16.h"
#include "gguf_blocks.h"
#include "gguf_blocks_avx512.h"
#include "int8_quantize_avx512.h"
#include "numeric_formats.h"

#define HJ_AMX                                                                                                   \
  __attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni," \
                        "avx512vbmi,avx2,fma,f16c")))

namespace hybridjit {
namespace {

constexpr int64_t kTileRows = 16;
constexpr int64_t kTileBytes = 1024;       // 16 rows x 64 bytes
constexpr int64_t kRowBlock = 128;         // weight rows per strip
constexpr int64_t kKStepsBf16 = 16;        // k-steps of 32 bf16 per strip: 512 input elements
constexpr int64_t kKStepsInt8 = 8;         // k-steps of 64 int8 per strip: also 512
constexpr int64_t kStripBytes = kKStepsBf16 * kTileBytes;  // one row-tile of a strip

int64_t RoundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
int64_t Blocks(int64_t cols, int64_t block) { return (cols + block - 1) / block; }

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (2 x 2), 4-5: A (weights), 6-7: B (activations); all 16 rows x 64 bytes.
HJ_AMX void ConfigureTiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = kTileRows;
  }
  _tile_loadconfig(&config);
}

HJ_AMX __mmask16 FirstLanes16(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << std::max<int64_t>(n, 0)) - 1); }
HJ_AMX __mmask32 FirstLanes32(int64_t n) {
  return n >= 32 ? ~__mmask32{0} : (__mmask32{1} << std::max<int64_t>(n, 0)) - 1;
}
HJ_AMX __mmask64 FirstLanes64(int64_t n) {
  return n >= 64 ? ~__mmask64{0} : (__mmask64{1} << std::max<int64_t>(n, 0)) - 1;
}

// One token's row as bfloat16 (round to nearest even), zero-padded to `padded` elements.
HJ_AMX void RowToBf16(const ActivationRows& rows, int64_t t, int64_t cols, int64_t padded, uint16_t* out) {
  const void* src = rows.Row(t);
  for (int64_t c = 0; c < padded; c += 16) {
    const __mmask16 k = FirstLanes16(cols - c);
    __m256i bits;
    if (rows.bf16) {
      bits = _mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(src) + c);
    } else {
      bits = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(k, static_cast<const float*>(src) + c));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), bits);
  }
}

HJ_AMX void RowToFloat(const ActivationRows& rows, int64_t t, int64_t cols, float* out) {
  const void* src = rows.Row(t);
  if (!rows.bf16) {
    std::memcpy(out, src, cols * sizeof(float));
    return;
  }
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 k = FirstLanes16(cols - c);
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, static_cast<const uint16_t*>(src) + c));
    _mm512_mask_storeu_ps(out + c, k, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
  }
}

// ---- packed activations ----------------------------------------------------------------------------------
// B tiles for token block tb (16 tokens, padded to an even count) and k-step ks at (tb * ksteps + ks) KiB:
// row r of a tile holds, for each of the 16 tokens, the 4 bytes of input elements [ks * step + 4r / size,
// ...) (bf16: 2 elements, int8: 4). int8 tiles are preceded by one float scale per (padded) token.

int64_t PaddedTokens(int64_t tokens) { return RoundUp(tokens, 32); }

bool IntTiles(const LayerWeights& layer) {
  // int8 tiles only when a row has one scale for both input sizes (gate/up: hidden, down: inter).
  return layer.format == WeightFormat::kInt8 && layer.block_cols >= std::max(layer.hidden, layer.inter);
}

size_t ScaleBytes(int64_t tokens) { return RoundUp(PaddedTokens(tokens) * 4, 64); }

size_t Bf16PackedBytes(const LayerWeights&, int64_t tokens, int64_t cols) {
  return PaddedTokens(tokens) / kTileRows * Blocks(cols, 32) * kTileBytes;
}

size_t Int8PackedBytes(const LayerWeights&, int64_t tokens, int64_t cols) {
  return ScaleBytes(tokens) + PaddedTokens(tokens) / kTileRows * Blocks(cols, 64) * kTileBytes;
}

// The B tiles of one token block from its tokens' rows of 4-byte groups (row i: ksteps * 16 dwords; rows from
// `n` on read as zero): tile ks, row r holds dword ks * 16 + r of tokens 0..15, which is a 16 x 16 dword
// transpose per tile. Transposing in registers stores each tile row as one whole cache line; writing a token's
// dwords into its column instead touched a line per 4 bytes. One Mixtral expert of 256 tokens on the 16-core
// Xeon: its 14,336-wide activations packed in 3.6 ms instead of 8.0 (one thread, while the others wait), the
// call 28.7 ms instead of 35.1.
HJ_AMX void BlockToTiles(const uint32_t* token_rows, int64_t n, int64_t ksteps, char* tiles) {
  const int64_t row_dwords = ksteps * 16;
  for (int64_t ks = 0; ks < ksteps; ++ks) {
    __m512i v[16], t[16];
    for (int64_t i = 0; i < kTileRows; ++i) {
      v[i] = i < n ? _mm512_loadu_si512(token_rows + i * row_dwords + ks * 16) : _mm512_setzero_si512();
    }
    // Within each 128-bit lane: pairs of tokens, then quads; t[4q + j] lane L then holds dword 4L + j of
    // tokens 4q .. 4q + 3.
    for (int i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
      t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int q = 0; q < 16; q += 4) {
      v[q] = _mm512_unpacklo_epi64(t[q], t[q + 2]);
      v[q + 1] = _mm512_unpackhi_epi64(t[q], t[q + 2]);
      v[q + 2] = _mm512_unpacklo_epi64(t[q + 1], t[q + 3]);
      v[q + 3] = _mm512_unpackhi_epi64(t[q + 1], t[q + 3]);
    }
    // A 4 x 4 transpose of 128-bit lanes across the quads: tile row 4L + j gathers lane L of v[j], v[4 + j],
    // v[8 + j], v[12 + j].
    char* tile = tiles + ks * kTileBytes;
    for (int j = 0; j < 4; ++j) {
      const __m512i x0 = _mm512_shuffle_i32x4(v[j], v[4 + j], 0x88), x1 = _mm512_shuffle_i32x4(v[j], v[4 + j], 0xdd);
      const __m512i x2 = _mm512_shuffle_i32x4(v[8 + j], v[12 + j], 0x88);
      const __m512i x3 = _mm512_shuffle_i32x4(v[8 + j], v[12 + j], 0xdd);
      _mm512_storeu_si512(tile + (0 + j) * 64, _mm512_shuffle_i32x4(x0, x2, 0x88));
      _mm512_storeu_si512(tile + (4 + j) * 64, _mm512_shuffle_i32x4(x1, x3, 0x88));
      _mm512_storeu_si512(tile + (8 + j) * 64, _mm512_shuffle_i32x4(x0, x2, 0xdd));
      _mm512_storeu_si512(tile + (12 + j) * 64, _mm512_shuffle_i32x4(x1, x3, 0xdd));
    }
  }
}

// Packs the B tiles of `padded_tokens` tokens, 16 at a time: row(t, dwords) writes token t's ksteps * 16 dwords;
// tokens from `count` on are zero.
template <class Row>
void PackTokenBlocks(int64_t count, int64_t padded_tokens, int64_t ksteps, char* tiles, Row row) {
  thread_local std::vector<uint32_t> block;
  block.resize(kTileRows * ksteps * 16);
  for (int64_t t0 = 0; t0 < padded_tokens; t0 += kTileRows) {
    const int64_t n = std::clamp<int64_t>(count - t0, 0, kTileRows);
    for (int64_t i = 0; i < n; ++i) row(t0 + i, block.data() + i * ksteps * 16);
    BlockToTiles(block.data(), n, ksteps, tiles + t0 / kTileRows * ksteps * kTileBytes);
  }
}

HJ_AMX void Bf16Pack(const LayerWeights&, const ActivationRows& rows, int64_t cols, void* packed) {
  const int64_t ksteps = Blocks(cols, 32);
  PackTokenBlocks(rows.count, PaddedTokens(rows.count), ksteps, static_cast<char*>(packed),
                  [&](int64_t t, uint32_t* dwords) {
                    RowToBf16(rows, t, cols, ksteps * 32, reinterpret_cast<uint16_t*>(dwords));
                  });
}

// One scale per token row (the layer has one group per row): as QuantizeInt8.
HJ_AMX void Int8Pack(const LayerWeights&, const ActivationRows& rows, int64_t cols, void* packed) {
  const int64_t ksteps = Blocks(cols, 64);
  auto* scales = static_cast<float*>(packed);
  std::memset(packed, 0, ScaleBytes(rows.count));
  thread_local std::vector<float> x;
  x.resize(cols);
  PackTokenBlocks(rows.count, PaddedTokens(rows.count), ksteps, static_cast<char*>(packed) + ScaleBytes(rows.count),
                  [&](int64_t t, uint32_t* dwords) {
                    auto* q = reinterpret_cast<int8_t*>(dwords);
                    RowToFloat(rows, t, cols, x.data());
                    scales[t] = QuantizeInt8(x.data(), cols, q);
                    std::memset(q + cols, 0, ksteps * 64 - cols);
                  });
}

// ---- weight strips ---------------------------------------------------------------------------------------
// Rows [r0, r0 + 128) x k-steps [k0, k0 + n) of one projection, as tiles: row-tile rt, k-step ks at
// (rt * n + ks) KiB. Rows past the matrix and elements past the row are zero.

// The scale of each of the n (<= 16) elements from column c of a scale row, zero for the lanes past them:
// one broadcast when they share a block (always, for 128-multiples), else looked up one by one. Lanes
// past the row's end must not read the scale row: its last block may end there, and whatever follows
// (the next row's scales, or the end of the array) times a zero weight can be NaN.
HJ_AMX __m512 ScaleVector(const float* scale_row, int64_t block_cols, int64_t c, int64_t n) {
  if (n <= 0) return _mm512_setzero_ps();
  const int64_t last = c + std::min<int64_t>(n, 16) - 1;
  if (c / block_cols == last / block_cols) {
    float s;
    std::memcpy(&s, scale_row + c / block_cols, sizeof s);
    return _mm512_maskz_mov_ps(FirstLanes16(n), _mm512_set1_ps(s));
  }
  alignas(64) float v[16] = {};
  for (int64_t i = 0; c + i <= last; ++i) std::memcpy(v + i, scale_row + (c + i) / block_cols, sizeof(float));
  return _mm512_load_ps(v);
}

// 32 FP8 bytes -> 32 exact bfloat16 values, in order (fp8_bf16.h).
HJ_AMX __m512i Fp8ToBf16(__m256i raw) {
  __m512i high, low;
  Fp8ToBf16Bytes(_mm512_castsi256_si512(raw), LoadFp8Tables(), &high, &low);
  return _mm512_or_si512(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(low)),
                         _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(high)), 8));
}

HJ_AMX __m512 Bf16HalfToFloat(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }

// 32 signed bytes as float32, in two halves.
HJ_AMX void Int8ToFloats(__m256i q, __m512* lo, __m512* hi) {
  *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
  *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
}

// 32 weights of a row from element c (n valid) as float32 (unscaled), in two halves.
HJ_AMX void LoadRowFloats(const LayerWeights& layer, const unsigned char* row, int64_t c, int64_t n, __m512* lo,
                          __m512* hi) {
  switch (layer.format) {
    case WeightFormat::kFp8E4M3Fn: {
      const __m512i b = Fp8ToBf16(_mm256_maskz_loadu_epi8(FirstLanes32(n), row + c));
      *lo = Bf16HalfToFloat(_mm512_castsi512_si256(b));
      *hi = Bf16HalfToFloat(_mm512_extracti64x4_epi64(b, 1));
      return;
    }
    case WeightFormat::kInt8: {
      Int8ToFloats(_mm256_maskz_loadu_epi8(FirstLanes32(n), row + c), lo, hi);
      return;
    }
    case WeightFormat::kInt4: {
      // 16 bytes hold the 32 elements: low nibbles are the even ones, high nibbles the odd ones.
      const __m128i b = _mm_maskz_loadu_epi8(FirstLanes16((n + 1) / 2), row + c / 2);
      const __m128i mask = _mm_set1_epi8(0x0f);
      const __m128i even = _mm_and_si128(b, mask), odd = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
      const __m128i eight = _mm_set1_epi8(8);
      const __m128i first = _mm_sub_epi8(_mm_unpacklo_epi8(even, odd), eight);
      const __m128i second = _mm_sub_epi8(_mm_unpackhi_epi8(even, odd), eight);
      // Elements past n decode as -8 from zero bytes: zero them.
      *lo = _mm512_maskz_cvtepi32_ps(FirstLanes16(n), _mm512_cvtepi8_epi32(first));
      *hi = _mm512_maskz_cvtepi32_ps(FirstLanes16(n - 16), _mm512_cvtepi8_epi32(second));
      return;
    }
    case WeightFormat::kMxfp4: {
      // 16 bytes, low nibbles the even elements; bit 3 of a nibble is the sign (lanes past n are zero bytes: +0).
      const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(FirstLanes16(n / 2), row + c / 2));
      const __m512 magnitudes = _mm512_castps256_ps512(_mm256_loadu_ps(kE2m1Magnitudes.data()));
      const __m512i sign = _mm512_set1_epi32(INT32_MIN);
      const __m512i even_bits = _mm512_and_si512(b, _mm512_set1_epi32(7));
      const __m512i odd_bits = _mm512_and_si512(_mm512_srli_epi32(b, 4), _mm512_set1_epi32(7));
      const __m512 even = _mm512_castsi512_ps(_mm512_or_si512(
          _mm512_castps_si512(_mm512_permutexvar_ps(even_bits, magnitudes)), _mm512_and_si512(_mm512_slli_epi32(b, 28), sign)));
      const __m512 odd = _mm512_castsi512_ps(_mm512_or_si512(
          _mm512_castps_si512(_mm512_permutexvar_ps(odd_bits, magnitudes)), _mm512_and_si512(_mm512_slli_epi32(b, 24), sign)));
      // Interleaved back into element order: lo holds elements 0-15, hi 16-31.
      const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
      const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
      *lo = _mm512_permutex2var_ps(even, first, odd);
      *hi = _mm512_permutex2var_ps(even, second, odd);
      return;
    }
    case WeightFormat::kF32:
    case WeightFormat::kBf16:
    default:  // GGUF formats decode whole blocks per row instead (GgufStrip)
      break;
  }
  *lo = *hi = _mm512_setzero_ps();
}

// ---- GGUF blocks ---------------------------------------------------------------------------------------------
// A strip's 512 elements of a row are whole blocks (two K-quant super-blocks, or 16 Q8_0 blocks: strips start at
// multiples of 512 and GGUF rows are whole blocks, so every k-step is full). Each block is split in registers
// (gguf_blocks_avx512.h, the helpers of the few-token VNNI kernel) and written out as its k-steps' tile rows:
// w in float32 as gguf_blocks.h defines it, rounded once to bfloat16 (nearest even).

// 32 K-quant elements w = q * s - m (q unsigned, below 32), by table: the 32 values q * s - m (one FMA each: one
// rounding, where gguf's dequantisation rounds q * s first) to bfloat16, looked up per element by its q with one
// word permute. A Q4_K or Q5_K sub-block is one k-step with one s and one m, so a table serves 32 elements.
HJ_AMX __m512i KQuantBf16(__m256i q, __m512 s, __m512 m) {
  const __m512 iota_lo = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 iota_hi = _mm512_add_ps(iota_lo, _mm512_set1_ps(16.0f));
  const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmsub_ps(iota_hi, s, m), _mm512_fmsub_ps(iota_lo, s, m));
  return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), table);
}

// 32 elements w = q * s (q signed bytes; s_lo for the first 16, s_hi for the others) to bfloat16: Q8_0's d * q and
// Q6_K's d * scale * (q - 32), one rounding each as in gguf's dequantisation (Q6_K's 64 values per sub-block of 16
// would take more to tabulate than to multiply).
HJ_AMX __m512i SignedBf16(__m256i q, __m512 s_lo, __m512 s_hi) {
  __m512 lo, hi;
  Int8ToFloats(q, &lo, &hi);
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, s_hi), _mm512_mul_ps(lo, s_lo));
}

// One row's n_ksteps k-steps from its blocks at `b`, k-step ks to dst + ks KiB (its row of that k-step's tile).
template <bool kFive>
HJ_AMX void KQuantRow(const uint8_t* b, int64_t n_ksteps, char* dst) {
  for (int64_t ks = 0; ks < n_ksteps; ks += 8, b += kFive ? 176 : 144) {
    alignas(64) float mult[16];  // d * scale j, then dmin * min j: broadcast from memory, sparing the shuffle port
    _mm512_store_ps(mult, Q4KMultipliers(b));
    for (int c = 0; c < 4; ++c) {  // sub-blocks 2c and 2c + 1
      __m256i lo, hi;
      Q4KChunk(b, kFive, c, &lo, &hi);
      char* out = dst + (ks + 2 * c) * kTileBytes;
      _mm512_storeu_si512(out, KQuantBf16(lo, _mm512_set1_ps(mult[2 * c]), _mm512_set1_ps(mult[8 + 2 * c])));
      _mm512_storeu_si512(out + kTileBytes,
                          KQuantBf16(hi, _mm512_set1_ps(mult[2 * c + 1]), _mm512_set1_ps(mult[9 + 2 * c])));
    }
  }
}

HJ_AMX void Q6KRow(const uint8_t* b, int64_t n_ksteps, char* dst) {
  for (int64_t ks = 0; ks < n_ksteps; ks += 8, b += 210) {
    alignas(64) float scale[16];  // d * scale of each sub-block of 16
    _mm512_store_ps(scale, Q6KScales(b));
    for (int half = 0; half < 2; ++half) {
      __m256i v[4];
      Q6KHalf(b, half, v);
      for (int s = 0; s < 4; ++s) {  // k-step 4 half + s: sub-blocks 8 half + 2 s and the next
        const int sub = 8 * half + 2 * s;
        _mm512_storeu_si512(dst + (ks + 4 * half + s) * kTileBytes,
                            SignedBf16(_mm256_sub_epi8(v[s], _mm256_set1_epi8(32)), _mm512_set1_ps(scale[sub]),
                                       _mm512_set1_ps(scale[sub + 1])));
      }
    }
  }
}

// Q2_K (Q3_K with kThree): k-step 4h + j holds sub-blocks 8h + 2j and the next, q * scale - min each (one FMA: one
// rounding where gguf's dequantisation of Q2_K rounds twice; Q3_K's scale * (q - 4) is exact either way).
template <bool kThree>
HJ_AMX void Q2KRow(const uint8_t* b, int64_t n_ksteps, char* dst) {
  for (int64_t ks = 0; ks < n_ksteps; ks += 8, b += kThree ? 110 : 84) {
    alignas(64) float scale[16], min[16];
    __m512 s, m;
    Q2KMultipliers(b, kThree, &s, &m);
    _mm512_store_ps(scale, s);
    _mm512_store_ps(min, m);
    for (int h = 0; h < 2; ++h) {
      for (int j = 0; j < 4; ++j) {
        const __m256i q = Q2KQuarter(b, kThree, h, j);
        const int sub = 8 * h + 2 * j;
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)));
        const __m512 w_lo = _mm512_fmsub_ps(lo, _mm512_set1_ps(scale[sub]), _mm512_set1_ps(min[sub]));
        const __m512 w_hi = _mm512_fmsub_ps(hi, _mm512_set1_ps(scale[sub + 1]), _mm512_set1_ps(min[sub + 1]));
        _mm512_storeu_si512(dst + (ks + 4 * h + j) * kTileBytes, (__m512i)_mm512_cvtne2ps_pbh(w_hi, w_lo));
      }
    }
  }
}

// IQ4_XS: k-step j is sub-block j, 32 values looked up from their indices, times d * (sc - 32) (one rounding, as gguf's
// dequantisation).
HJ_AMX void Iq4XsRow(const uint8_t* b, int64_t n_ksteps, char* dst) {
  const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4nlValues));
  const __m128i low4 = _mm_set1_epi8(0x0f);
  for (int64_t ks = 0; ks < n_ksteps; ks += 8, b += 136) {
    const float d = HalfAt(b);
    for (int j = 0; j < 8; ++j) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 8 + 16 * j));
      const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(v, low4));  // elements 0-15
      const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(v, 4), low4));  // 16-31
      const __m512 s = _mm512_set1_ps(d * static_cast<float>(Iq4XsScale(b, j) - 32));
      _mm512_storeu_si512(dst + (ks + j) * kTileBytes, SignedBf16(_mm256_set_m128i(hi, lo), s, s));
    }
  }
}

HJ_AMX void Q80Row(const uint8_t* b, int64_t n_ksteps, char* dst) {
  for (int64_t ks = 0; ks < n_ksteps; ++ks, b += 34) {
    const __m512 d = _mm512_set1_ps(HalfAt(b));
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    _mm512_storeu_si512(dst + ks * kTileBytes, SignedBf16(q, d, d));
  }
}

// Rows this far ahead of the one being split are prefetched: a strip's row segment (288 to 544 bytes) sits a
// whole row (KiBs) from the previous one, a stride the hardware prefetchers do not follow, and splitting a row
// takes less time than the memory latency.
constexpr int64_t kGgufRowsAhead = 8;

HJ_AMX void GgufStrip(const LayerWeights& layer, const Projection& w, int64_t r0, int64_t k0, int64_t n_ksteps,
                      char* strip) {
  const WeightFormat format = layer.ProjectionFormat(w.which);
  const int64_t block = GgufBlockElements(format), block_bytes = GgufBlockBytes(format);
  const int64_t row_bytes = layer.RowBytes(w.cols, w.which);
  const int64_t segment = n_ksteps * 32 / block * block_bytes;  // bytes of the strip's blocks in a row
  const auto* first = static_cast<const uint8_t*>(w.data) + k0 * 32 / block * block_bytes;
  for (int64_t rt = 0; rt < kRowBlock / kTileRows; ++rt) {
    for (int64_t m = 0; m < kTileRows; ++m) {
      const int64_t r = r0 + rt * kTileRows + m;
      char* dst = strip + rt * n_ksteps * kTileBytes + m * 64;
      if (r >= w.rows) {
        for (int64_t ks = 0; ks < n_ksteps; ++ks) _mm512_storeu_si512(dst + ks * kTileBytes, _mm512_setzero_si512());
        continue;
      }
      const uint8_t* blocks = first + r * row_bytes;
      if (r + kGgufRowsAhead < std::min(w.rows, r0 + kRowBlock)) {
        const char* ahead = reinterpret_cast<const char*>(blocks + kGgufRowsAhead * row_bytes);
        for (int64_t at = 0; at < segment + 63; at += 64) _mm_prefetch(ahead + std::min(at, segment - 1), _MM_HINT_T0);
      }
      switch (format) {
        case WeightFormat::kQ8_0:
          Q80Row(blocks, n_ksteps, dst);
          break;
        case WeightFormat::kQ4K:
          KQuantRow<false>(blocks, n_ksteps, dst);
          break;
        case WeightFormat::kQ5K:
          KQuantRow<true>(blocks, n_ksteps, dst);
          break;
        case WeightFormat::kQ2K:
          Q2KRow<false>(blocks, n_ksteps, dst);
          break;
        case WeightFormat::kQ3K:
          Q2KRow<true>(blocks, n_ksteps, dst);
          break;
        case WeightFormat::kIq4Xs:
          Iq4XsRow(blocks, n_ksteps, dst);
          break;
        default:  // Q6_K
          Q6KRow(blocks, n_ksteps, dst);
          break;
      }
    }
  }
}

HJ_AMX void Bf16Strip(const LayerWeights& layer, const Projection& w, int64_t r0, int64_t k0, int64_t n_ksteps,
                      char* strip) {
  if (IsGgufFormat(layer.ProjectionFormat(w.which))) {
    GgufStrip(layer, w, r0, k0, n_ksteps, strip);
    return;
  }
  const int64_t cols = w.cols;
  const int64_t row_bytes = layer.RowBytes(cols);
  const int64_t n_scale_cols = layer.scaled() ? Blocks(cols, layer.block_cols) : 0;
  for (int64_t rt = 0; rt < kRowBlock / kTileRows; ++rt) {
    for (int64_t m = 0; m < kTileRows; ++m) {
      const int64_t r = r0 + rt * kTileRows + m;
      for (int64_t ks = 0; ks < n_ksteps; ++ks) {
        char* dst = strip + (rt * n_ksteps + ks) * kTileBytes + m * 64;
        const int64_t c = (k0 + ks) * 32;
        const int64_t n = r < w.rows ? std::min<int64_t>(32, cols - c) : 0;
        if (n <= 0) {
          _mm512_storeu_si512(dst, _mm512_setzero_si512());
          continue;
        }
        const unsigned char* row = static_cast<const unsigned char*>(w.data) + r * row_bytes;
        if (layer.format == WeightFormat::kBf16) {
          _mm512_storeu_si512(dst, _mm512_maskz_loadu_epi16(FirstLanes32(n), row + c * 2));
          continue;
        }
        __m512 lo, hi;
        LoadRowFloats(layer, row, c, n, &lo, &hi);
        if (layer.format == WeightFormat::kMxfp4) {  // a k-step is one scale group
          const __m512 scale = _mm512_set1_ps(BlockScale(layer, w, r, c / kMxfp4Block));
          lo = _mm512_mul_ps(lo, scale);
          hi = _mm512_mul_ps(hi, scale);
        } else {
          const float* scale_row = static_cast<const float*>(w.scale) + (r / layer.block_rows) * n_scale_cols;
          lo = _mm512_mul_ps(lo, ScaleVector(scale_row, layer.block_cols, c, n));
          hi = _mm512_mul_ps(hi, ScaleVector(scale_row, layer.block_cols, c + 16, n - 16));
        }
        _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    }
  }
}

HJ_AMX void Int8Strip(const Projection& w, int64_t r0, int64_t k0, int64_t n_ksteps, char* strip) {
  for (int64_t rt = 0; rt < kRowBlock / kTileRows; ++rt) {
    for (int64_t m = 0; m < kTileRows; ++m) {
      const int64_t r = r0 + rt * kTileRows + m;
      for (int64_t ks = 0; ks < n_ksteps; ++ks) {
        char* dst = strip + (rt * n_ksteps + ks) * kTileBytes + m * 64;
        const int64_t c = (k0 + ks) * 64;
        const int64_t n = r < w.rows ? std::min<int64_t>(64, w.cols - c) : 0;
        __m512i v = _mm512_setzero_si512();
        if (n > 0) v = _mm512_maskz_loadu_epi8(FirstLanes64(n), static_cast<const unsigned char*>(w.data) + r * w.cols + c);
        _mm512_storeu_si512(dst, v);
      }
    }
  }
}

// ---- the tile loop ---------------------------------------------------------------------------------------

// C[rows r0.., tokens t0..] (+)= strip x B over the strip's k-steps, for 2 x 2 tiles at a time. With
// `accumulate`, C starts from `out` (float32, or int32 for int8 tiles) instead of zero.
template <bool kInt8>
HJ_AMX void SweepStrip(const char* strip, int64_t strip_rows, int64_t n_ksteps, const char* b_tiles,
                       int64_t total_ksteps, int64_t k0, int64_t tokens_padded, bool accumulate, float* out,
                       int64_t out_stride) {
  const int64_t stride_bytes = out_stride * 4;
  for (int64_t tb = 0; tb < tokens_padded / kTileRows; tb += 2) {
    const char* b0 = b_tiles + (tb * total_ksteps + k0) * kTileBytes;
    const char* b1 = b0 + total_ksteps * kTileBytes;
    for (int64_t rt = 0; rt < strip_rows / kTileRows; rt += 2) {
      const char* a0 = strip + rt * n_ksteps * kTileBytes;
      const char* a1 = a0 + n_ksteps * kTileBytes;
      float* c = out + rt * kTileRows * out_stride + tb * kTileRows;
      if (accumulate) {
        _tile_loadd(0, c, stride_bytes);
        _tile_loadd(1, c + kTileRows, stride_bytes);
        _tile_loadd(2, c + kTileRows * out_stride, stride_bytes);
        _tile_loadd(3, c + kTileRows * out_stride + kTileRows, stride_bytes);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int64_t ks = 0; ks < n_ksteps; ++ks) {
        _tile_loadd(4, a0 + ks * kTileBytes, 64);
        _tile_loadd(5, a1 + ks * kTileBytes, 64);
        _tile_loadd(6, b0 + ks * kTileBytes, 64);
        _tile_loadd(7, b1 + ks * kTileBytes, 64);
        MultiplyTiles2x2<kInt8>();
      }
      _tile_stored(0, c, stride_bytes);
      _tile_stored(1, c + kTileRows, stride_bytes);
      _tile_stored(2, c + kTileRows * out_stride, stride_bytes);
      _tile_stored(3, c + kTileRows * out_stride + kTileRows, stride_bytes);
    }
  }
}

template <bool kInt8>
HJ_AMX void AmxGemm(const LayerWeights& layer, const Projection* w, int n_proj, int64_t row0, int64_t rows,
                    const void* packed, int64_t tokens, float* const* out, int64_t out_stride) {
  const int64_t cols = w[0].cols;
  const int64_t step = kInt8 ? 64 : 32;
  const int64_t strip_ksteps = kInt8 ? kKStepsInt8 : kKStepsBf16;
  const int64_t total_ksteps = Blocks(cols, step);
  const int64_t tokens_padded = PaddedTokens(tokens);
  const char* b_tiles = static_cast<const char*>(packed) + (kInt8 ? ScaleBytes(tokens) : 0);
  const size_t strip_bytes = kRowBlock / kTileRows * kStripBytes;
  thread_local std::vector<char> strips;
  strips.resize(strip_bytes * n_proj + 64);
  char* strip_base = strips.data() + (64 - reinterpret_cast<uintptr_t>(strips.data()) % 64) % 64;
  ConfigureTiles();
  for (int64_t rs = 0; rs < rows; rs += kRowBlock) {
    const int64_t strip_rows = std::min(kRowBlock, RoundUp(rows - rs, 32));
    for (int64_t k0 = 0; k0 < total_ksteps; k0 += strip_ksteps) {
      const int64_t n_ksteps = std::min(strip_ksteps, total_ksteps - k0);
      for (int p = 0; p < n_proj; ++p) {
        char* strip = strip_base + p * strip_bytes;
        if constexpr (kInt8) {
          Int8Strip(w[p], row0 + rs, k0, n_ksteps, strip);
        } else {
          Bf16Strip(layer, w[p], row0 + rs, k0, n_ksteps, strip);
        }
        SweepStrip<kInt8>(strip, strip_rows, n_ksteps, b_tiles, total_ksteps, k0, tokens_padded, k0 > 0,
                          out[p] + rs * out_stride, out_stride);
      }
    }
  }
  _tile_release();
  if constexpr (kInt8) {
    // The int32 sums times the row's and the token's scale.
    const auto* x_scales = static_cast<const float*>(packed);
    for (int p = 0; p < n_proj; ++p) {
      for (int64_t r = 0; r < rows; ++r) {
        float ws;
        std::memcpy(&ws, static_cast<const float*>(w[p].scale) + (row0 + r), sizeof ws);
        float* o = out[p] + r * out_stride;
        for (int64_t t = 0; t < tokens; t += 16) {
          const __mmask16 k = FirstLanes16(tokens - t);
          const __m512 sums = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(k, o + t));
          const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(ws), _mm512_maskz_loadu_ps(k, x_scales + t));
          _mm512_mask_storeu_ps(o + t, k, _mm512_mul_ps(sums, scale));
        }
      }
    }
  }
}

// ---- block-scaled weights as exact tiles, rescaled per group -----------------------------------------------
// The weights enter the tiles without their scales, exactly: int8 rows as they are, int4 nibbles widened to
// int8 (q - 8), and FP8 E4M3 codes as the bfloat16 values they equal (fp8_bf16.h: 3 mantissa bits and the whole
// exponent range fit). A group's k-steps (block_cols of the row's elements) accumulate its sums in the C tiles;
// after each group the tiles are stored to L1 and added to the float32 output times the weight scale of the row
// and group, and for int8 tiles the activation scale of the token and group as well. int8 tiles multiply int8
// activations quantized per token and per scale group (as QuantizeInt8, so every integer kernel sums the same
// products: tdpbssd's int32 sums are exact); bfloat16 tiles multiply the bfloat16 activations of Bf16Pack. FP8
// thus skips the per-weight scale multiply and the float32 round trip of amx_bf16's copy, which at tens of
// tokens per expert cost more than the tile multiplies, and its weights are no longer rounded (w * scale to
// bfloat16) on the way. Packed activations for int8 tiles: float scale[groups][padded tokens], then the B tiles
// as Int8Pack lays them out; for bfloat16 tiles: Bf16Pack's.

struct GroupLayout {
  int64_t groups, padded_tokens, ksteps;
  size_t scale_bytes;  // the activation scales (int8 tiles only)
  GroupLayout(const LayerWeights& layer, int64_t tokens, int64_t cols, bool int8 = true)
      : groups(Blocks(cols, layer.block_cols)),
        padded_tokens(PaddedTokens(tokens)),
        ksteps(Blocks(cols, int8 ? 64 : 32)),
        scale_bytes(int8 ? RoundUp(groups * padded_tokens * 4, 64) : 0) {}
};

size_t GroupPackedBytes(const LayerWeights& layer, int64_t tokens, int64_t cols) {
  const GroupLayout l(layer, tokens, cols);
  return l.scale_bytes + l.padded_tokens / kTileRows * l.ksteps * kTileBytes;
}

HJ_AMX void GroupPack(const LayerWeights& layer, const ActivationRows& rows, int64_t cols, void* packed) {
  const GroupLayout l(layer, rows.count, cols);
  auto* scales = static_cast<float*>(packed);
  std::memset(packed, 0, l.scale_bytes);
  thread_local std::vector<float> x;
  x.resize(cols);
  PackTokenBlocks(rows.count, l.padded_tokens, l.ksteps, static_cast<char*>(packed) + l.scale_bytes,
                  [&](int64_t t, uint32_t* dwords) {
                    auto* q = reinterpret_cast<int8_t*>(dwords);
                    RowToFloat(rows, t, cols, x.data());
                    for (int64_t g = 0; g < l.groups; ++g) {
                      const int64_t begin = g * layer.block_cols;
                      scales[g * l.padded_tokens + t] =
                          QuantizeInt8Avx512(x.data() + begin, std::min(layer.block_cols, cols - begin), q + begin);
                    }
                    std::memset(q + cols, 0, l.ksteps * 64 - cols);
                  });
}

// Rows [r0, r0 + 128) x k-steps [k0, k0 + n) of an int8 or int4 projection as int8 tiles (as Bf16Strip lays
// them out; rows past the matrix and elements past the row are zero).
HJ_AMX void IntGroupStrip(const LayerWeights& layer, const Projection& w, int64_t r0, int64_t k0, int64_t n_ksteps,
                          char* strip) {
  const int64_t cols = w.cols, row_bytes = layer.RowBytes(cols);
  const bool int4 = layer.format == WeightFormat::kInt4;
  for (int64_t rt = 0; rt < kRowBlock / kTileRows; ++rt) {
    for (int64_t m = 0; m < kTileRows; ++m) {
      const int64_t r = r0 + rt * kTileRows + m;
      const unsigned char* row = static_cast<const unsigned char*>(w.data) + r * row_bytes;
      char* dst = strip + rt * n_ksteps * kTileBytes + m * 64;
      for (int64_t ks = 0; ks < n_ksteps; ++ks, dst += kTileBytes) {
        const int64_t c = (k0 + ks) * 64;
        const int64_t n = r < w.rows ? std::min<int64_t>(64, cols - c) : 0;
        __m512i v = _mm512_setzero_si512();
        if (n == 64 && !int4) {
          v = _mm512_loadu_si512(row + c);
        } else if (n > 0 && !int4) {
          v = _mm512_maskz_loadu_epi8(FirstLanes64(n), row + c);
        } else if (n > 0) {
          // 32 bytes, element 2j the low nibble of byte j: as 16-bit lanes (hi << 8 | lo), i.e. the two
          // elements in order, then q = nibble - 8; elements past n are zeroed.
          const __m256i b = n == 64 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c / 2))
                                    : _mm256_maskz_loadu_epi8(FirstLanes32((n + 1) / 2), row + c / 2);
          const __m512i x = _mm512_cvtepu8_epi16(b);
          const __m512i pairs = _mm512_or_si512(_mm512_and_si512(x, _mm512_set1_epi16(0x000f)),
                                                _mm512_and_si512(_mm512_slli_epi16(x, 4), _mm512_set1_epi16(0x0f00)));
          v = _mm512_maskz_sub_epi8(FirstLanes64(n), pairs, _mm512_set1_epi8(8));
        }
        _mm512_storeu_si512(dst, v);
      }
    }
  }
}

// Rows [r0, r0 + 128) x k-steps [k0, k0 + n) of an FP8 projection as exact, unscaled bfloat16 tiles (as Bf16Strip
// lays them out): 64 codes a load, two k-steps, each the interleave of their bfloat16 bits' low and high bytes.
HJ_AMX void Fp8ExactStrip(const Projection& w, int64_t r0, int64_t k0, int64_t n_ksteps, char* strip) {
  const Fp8Tables tables = LoadFp8Tables();
  alignas(64) uint8_t order[2][64];  // vpermt2b indices: byte 2j is low[j], byte 2j + 1 is high[j] (from 64 on)
  for (int h = 0; h < 2; ++h) {
    for (int j = 0; j < 32; ++j) {
      order[h][2 * j] = static_cast<uint8_t>(32 * h + j);
      order[h][2 * j + 1] = static_cast<uint8_t>(64 + 32 * h + j);
    }
  }
  const __m512i first = _mm512_load_si512(order[0]), second = _mm512_load_si512(order[1]);
  for (int64_t rt = 0; rt < kRowBlock / kTileRows; ++rt) {
    for (int64_t m = 0; m < kTileRows; ++m) {
      const int64_t r = r0 + rt * kTileRows + m;
      const unsigned char* row = static_cast<const unsigned char*>(w.data) + r * w.cols;
      char* dst = strip + rt * n_ksteps * kTileBytes + m * 64;
      for (int64_t ks = 0; ks < n_ksteps; ks += 2, dst += 2 * kTileBytes) {
        const int64_t c = (k0 + ks) * 32;
        const int64_t n = r < w.rows ? std::min<int64_t>(64, w.cols - c) : 0;
        __m512i codes = _mm512_setzero_si512();  // zero bytes are +0.0
        if (n == 64) {
          codes = _mm512_loadu_si512(row + c);
        } else if (n > 0) {
          codes = _mm512_maskz_loadu_epi8(FirstLanes64(n), row + c);
        }
        __m512i high, low;
        Fp8ToBf16Bytes(codes, tables, &high, &low);
        _mm512_storeu_si512(dst, _mm512_permutex2var_epi8(low, first, high));
        if (ks + 1 < n_ksteps) _mm512_storeu_si512(dst + kTileBytes, _mm512_permutex2var_epi8(low, second, high));
      }
    }
  }
}

// One group's sums of the 2 x 2 C tiles of rows [rt * 16, +32) and tokens [tb * 16, +32), stored to `sums`
// (4 KB, 64-byte aligned; int32 or float32), waiting to be added to the float32 output: out (+)= sum * ws[row]
// (* xs[token] for int8 tiles) (ws: the rows' scales of the group, 0 past the matrix; xs: the tokens' activation
// scales of the group).
struct GroupSums {
  void* sums = nullptr;
  const float* ws = nullptr;
  const float* xs = nullptr;
  float* out = nullptr;  // row rt * 16, token tb * 16
  bool first = false;    // the first group of the row: out is written, not added to
};

HJ_AMX void StoreSums(const GroupSums& g) {
  auto* sums = static_cast<char*>(g.sums);
  _tile_stored(0, sums, 64);
  _tile_stored(1, sums + kTileBytes, 64);
  _tile_stored(2, sums + 2 * kTileBytes, 64);
  _tile_stored(3, sums + 3 * kTileBytes, 64);
}

// 16 sums of the C tiles as float32.
template <bool kInt8>
HJ_AMX __m512 LoadSums(const void* at) {
  if constexpr (kInt8) return _mm512_cvtepi32_ps(_mm512_load_si512(at));
  return _mm512_load_ps(static_cast<const float*>(at));
}

template <bool kInt8>
HJ_AMX void AddSums(const GroupSums& g, int64_t out_stride) {
  const auto* sums = static_cast<const char*>(g.sums);
  const float* ws = g.ws;
  float* out = g.out;
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 x[2] = {kInt8 ? _mm512_loadu_ps(g.xs) : one, kInt8 ? _mm512_loadu_ps(g.xs + kTileRows) : one};
  for (int m = 0; m < 2 * kTileRows; ++m, out += out_stride) {
    const __m512 w = _mm512_set1_ps(ws[m]);
    const char* c = sums + (m / kTileRows) * 2 * kTileBytes + (m % kTileRows) * 64;
    const __m512 s0 = _mm512_mul_ps(w, x[0]), s1 = _mm512_mul_ps(w, x[1]);
    if (g.first) {
      _mm512_storeu_ps(out, _mm512_mul_ps(LoadSums<kInt8>(c), s0));
      _mm512_storeu_ps(out + kTileRows, _mm512_mul_ps(LoadSums<kInt8>(c + kTileBytes), s1));
    } else {
      _mm512_storeu_ps(out, _mm512_fmadd_ps(LoadSums<kInt8>(c), s0, _mm512_loadu_ps(out)));
      _mm512_storeu_ps(out + kTileRows, _mm512_fmadd_ps(LoadSums<kInt8>(c + kTileBytes), s1, _mm512_loadu_ps(out + kTileRows)));
    }
  }
}

// Prefetches (into L2) the weights of the strip after the current one, a few lines per call, so that the
// next strip's copy finds them there instead of waiting on memory.
struct StripPrefetch {
  const char* base = nullptr;  // the first byte of the strip's first row
  int64_t row_bytes = 0, bytes = 0, lines = 0, rows = 0, next = 0;

  // Rows [r0, r0 + 128) x elements [c0, c1) of projection w.
  void Start(const LayerWeights& layer, const Projection& w, int64_t r0, int64_t c0, int64_t c1) {
    row_bytes = layer.RowBytes(w.cols, w.which);
    c1 = std::min(w.cols, c1);
    base = static_cast<const char*>(w.data) + r0 * row_bytes + c0 * row_bytes / w.cols;
    bytes = std::max<int64_t>(1, (c1 - c0) * row_bytes / w.cols);
    lines = (bytes + 63) / 64 + 1;
    rows = std::max<int64_t>(0, std::min(kRowBlock, w.rows - r0));
    next = 0;
  }
  // The strip after rows [r0, +128) x elements [c0, c0 + strip_cols) of projection p of w[0..n_proj): the next
  // projection, else the next elements, else the next rows (none after the last).
  void StartNext(const LayerWeights& layer, const Projection* w, int n_proj, int p, int64_t r0, int64_t r_end,
                 int64_t c0, int64_t strip_cols) {
    if (p + 1 < n_proj) {
      Start(layer, w[p + 1], r0, c0, c0 + strip_cols);
    } else if (c0 + strip_cols < w[0].cols) {
      Start(layer, w[0], r0, c0 + strip_cols, c0 + 2 * strip_cols);
    } else if (r0 + kRowBlock < r_end) {
      Start(layer, w[0], r0 + kRowBlock, 0, strip_cols);
    }
  }
  // Spreads the strip's lines over `calls` calls of Issue.
  int64_t Quota(int64_t calls) const { return (rows * lines + calls - 1) / std::max<int64_t>(calls, 1); }
  HJ_AMX void Issue(int64_t n) {
    for (; n > 0 && next < rows * lines; --n, ++next) {
      const int64_t line = next % lines;
      _mm_prefetch(base + next / lines * row_bytes + std::min(line * 64, bytes - 1), _MM_HINT_T1);
    }
  }
};

template <bool kInt8>
HJ_AMX void AmxGroupGemm(const LayerWeights& layer, const Projection* w, int n_proj, int64_t row0, int64_t rows,
                         const void* packed, int64_t tokens, float* const* out, int64_t out_stride) {
  const int64_t cols = w[0].cols;
  const GroupLayout l(layer, tokens, cols, kInt8);
  const int64_t step = kInt8 ? 64 : 32;
  // block_cols is a multiple of 128 (int8: kIntGroupQuantum; fp8: AmxKernel).
  const int64_t group_ksteps = layer.block_cols / step;
  // A strip holds whole groups: the fewest that cover 512 elements.
  const int64_t strip_ksteps = RoundUp(kInt8 ? kKStepsInt8 : kKStepsBf16, group_ksteps);
  const auto* x_scales = static_cast<const float*>(packed);
  const char* b_tiles = static_cast<const char*>(packed) + l.scale_bytes;
  const size_t strip_bytes = kRowBlock / kTileRows * strip_ksteps * kTileBytes;
  const int64_t strip_groups = strip_ksteps / group_ksteps;
  thread_local std::vector<char> strips;
  thread_local std::vector<float> wscales;  // [projection][group of the strip][strip row]
  strips.resize(strip_bytes * n_proj + 64 + 2 * 4096);
  wscales.resize(n_proj * strip_groups * kRowBlock);
  char* strip_base = strips.data() + (64 - reinterpret_cast<uintptr_t>(strips.data()) % 64) % 64;
  // Two buffers of sums: a group's are added to the output while the tiles multiply the next group (the
  // vector work then overlaps the tile multiplies instead of waiting for them).
  void* sums[2] = {strip_base + strip_bytes * n_proj, strip_base + strip_bytes * n_proj + 4096};
  GroupSums pending;
  int64_t n_sums = 0;
  ConfigureTiles();
  for (int64_t rs = 0; rs < rows; rs += kRowBlock) {
    const int64_t strip_rows = std::min(kRowBlock, RoundUp(rows - rs, 32));
    for (int64_t k0 = 0; k0 < l.ksteps; k0 += strip_ksteps) {
      const int64_t n_ksteps = std::min(strip_ksteps, l.ksteps - k0);
      const int64_t g0 = k0 / group_ksteps, n_groups = Blocks(n_ksteps, group_ksteps);
      for (int p = 0; p < n_proj; ++p) {
        if (pending.sums) AddSums<kInt8>(pending, out_stride);  // before its weight scales are overwritten
        pending = {};
        char* strip = strip_base + p * strip_bytes;
        if constexpr (kInt8) {
          IntGroupStrip(layer, w[p], row0 + rs, k0, n_ksteps, strip);
        } else {
          Fp8ExactStrip(w[p], row0 + rs, k0, n_ksteps, strip);
        }
        float* ws = wscales.data() + p * strip_groups * kRowBlock;
        for (int64_t g = 0; g < n_groups; ++g) {
          for (int64_t m = 0; m < strip_rows; ++m) {
            const int64_t r = row0 + rs + m;
            ws[g * kRowBlock + m] = 0.0f;
            if (r < w[p].rows) ws[g * kRowBlock + m] = BlockScale(layer, w[p], r, g0 + g);
          }
        }
        float* o = out[p] + rs * out_stride;
        StripPrefetch prefetch;
        prefetch.StartNext(layer, w, n_proj, p, row0 + rs, row0 + rows, k0 * step, strip_ksteps * step);
        const int64_t quota = prefetch.Quota(l.padded_tokens / 32 * (strip_rows / 32));
        for (int64_t tb = 0; tb < l.padded_tokens / kTileRows; tb += 2) {
          const char* b0 = b_tiles + (tb * l.ksteps + k0) * kTileBytes;
          const char* b1 = b0 + l.ksteps * kTileBytes;
          for (int64_t rt = 0; rt < strip_rows / kTileRows; rt += 2) {
            const char* a0 = strip + rt * n_ksteps * kTileBytes;
            const char* a1 = a0 + n_ksteps * kTileBytes;
            prefetch.Issue(quota);
            for (int64_t g = 0; g < n_groups; ++g) {
              _tile_zero(0);
              _tile_zero(1);
              _tile_zero(2);
              _tile_zero(3);
              const int64_t ks_end = std::min(n_ksteps, (g + 1) * group_ksteps);
              for (int64_t ks = g * group_ksteps; ks < ks_end; ++ks) {
                _tile_loadd(4, a0 + ks * kTileBytes, 64);
                _tile_loadd(5, a1 + ks * kTileBytes, 64);
                _tile_loadd(6, b0 + ks * kTileBytes, 64);
                _tile_loadd(7, b1 + ks * kTileBytes, 64);
                MultiplyTiles2x2<kInt8>();
              }
              if (pending.sums) AddSums<kInt8>(pending, out_stride);
              pending = {sums[n_sums++ % 2], ws + g * kRowBlock + rt * kTileRows,
                         kInt8 ? x_scales + (g0 + g) * l.padded_tokens + tb * kTileRows : nullptr,
                         o + rt * kTileRows * out_stride + tb * kTileRows, k0 == 0 && g == 0};
              StoreSums(pending);
            }
          }
        }
      }
    }
  }
  if (pending.sums) AddSums<kInt8>(pending, out_stride);
  _tile_release();
}

// The bfloat16-tile layouts are token blocks one after the other; the int8 ones lead with every token's scales.
constexpr GemmKernel kBf16Tiles{"amx_bf16", 32, Bf16PackedBytes, Bf16Pack, AmxGemm<false>, true};
constexpr GemmKernel kInt8Tiles{"amx_int8", 32, Int8PackedBytes, Int8Pack, AmxGemm<true>};
constexpr GemmKernel kIntGroupTiles{"amx_int8g", 32, GroupPackedBytes, GroupPack, AmxGroupGemm<true>};
constexpr GemmKernel kFp8GroupTiles{"amx_fp8g", 32, Bf16PackedBytes, Bf16Pack, AmxGroupGemm<false>, true};

}  // namespace

const GemmKernel* AmxKernel(const LayerWeights& layer) {
  if (layer.format == WeightFormat::kF32) return nullptr;  // float32 weights: no lossless AMX type
  if (IntTiles(layer)) return &kInt8Tiles;
  if (layer.format == WeightFormat::kInt8 || layer.format == WeightFormat::kInt4) return &kIntGroupTiles;
  // FP8 whose scale blocks are 4 k-steps or longer and fit a strip (DeepSeek's 128 x 128; the crossover was measured
  // there) rescales per group; narrower blocks, whose rescales would come every k-step or two, are dequantized into
  // bfloat16 tiles with the scale applied per weight.
  if (layer.format == WeightFormat::kFp8E4M3Fn && layer.block_cols % 128 == 0 && layer.block_cols <= kKStepsBf16 * 32) {
    return &kFp8GroupTiles;
  }
  // bf16, fp8, mxfp4, and the GGUF formats (whose blocks of 32 hold one or two multipliers each: too fine for
  // int8 tiles, which rescale per 64-element k-step at best) as bfloat16 tiles.
  return &kBf16Tiles;
}

}  // namespace hybridjit
