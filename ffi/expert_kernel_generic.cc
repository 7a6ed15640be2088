// Portable reference kernels: plain C++, always compiled. Each weight row is decoded once per call
// and used for every token of the expert; the ISA kernels are tested against the same float64
// references as these.
#include <algorithm>
#include <cstring>
#include <vector>

#include "expert_kernels.h"
#include "numeric_formats.h"

namespace hybridjit {
namespace {

// Writes row `row` of the projection, dequantized, to out[0, cols). Weights are read with memcpy
// because np.memmap views into a checkpoint promise no alignment.
void DecodeRow(const LayerWeights& layer, const Projection& p, int64_t row, float* out) {
  const auto* bytes = static_cast<const unsigned char*>(p.data) + row * layer.RowBytes(p.cols);
  switch (layer.format) {
    case WeightFormat::kF32:
      std::memcpy(out, bytes, p.cols * sizeof(float));
      return;
    case WeightFormat::kBf16:
      for (int64_t c = 0; c < p.cols; ++c) {
        uint16_t bits;
        std::memcpy(&bits, bytes + c * sizeof bits, sizeof bits);
        out[c] = Bf16BitsToFloat(bits);
      }
      return;
    case WeightFormat::kFp8E4M3Fn: {
      const std::array<float, 256>& table = Fp8E4M3FnTable();
      for (int64_t c = 0; c < p.cols; ++c) out[c] = table[bytes[c]];
      break;
    }
    case WeightFormat::kInt8:
      for (int64_t c = 0; c < p.cols; ++c) out[c] = static_cast<float>(static_cast<int8_t>(bytes[c]));
      break;
    case WeightFormat::kInt4:
      for (int64_t c = 0; c < p.cols; ++c) out[c] = static_cast<float>(((bytes[c / 2] >> (4 * (c & 1))) & 0xf) - 8);
      break;
    case WeightFormat::kMxfp4:
      for (int64_t c = 0; c < p.cols; ++c) out[c] = E2m1ToFloat((bytes[c / 2] >> (4 * (c & 1))) & 0xf);
      break;
    default:  // the GGUF formats have their own kernels (GenericKernel)
      return;
  }
  for (int64_t block = 0; block < ScaleCols(layer, p.cols); ++block) {
    const float scale = BlockScale(layer, p, row, block);
    const int64_t end = std::min(p.cols, (block + 1) * layer.block_cols);
    for (int64_t c = block * layer.block_cols; c < end; ++c) out[c] *= scale;
  }
}

void LoadFloatRow(const ActivationRows& rows, int64_t i, int64_t cols, float* out) {
  const void* src = rows.Row(i);
  if (!rows.bf16) {
    std::memcpy(out, src, cols * sizeof(float));
    return;
  }
  const auto* bits = static_cast<const uint16_t*>(src);
  for (int64_t c = 0; c < cols; ++c) out[c] = Bf16BitsToFloat(bits[c]);
}

// Independent partial sums per lane, so the compiler can vectorise without reassociating.
float Dot(const float* a, const float* b, int64_t n) {
  constexpr int64_t kLanes = 16;
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += a[i + l] * b[i + l];
  }
  float sum = 0.0f;
  for (; i < n; ++i) sum += a[i] * b[i];
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

// --- f32 / bf16 / fp8 / mxfp4: float32 activations ------------------------------------------------------

size_t FloatPackedBytes(const LayerWeights&, int64_t tokens, int64_t cols) { return tokens * cols * sizeof(float); }

void FloatPack(const LayerWeights&, const ActivationRows& rows, int64_t cols, void* packed) {
  for (int64_t t = 0; t < rows.count; ++t) LoadFloatRow(rows, t, cols, static_cast<float*>(packed) + t * cols);
}

void FloatGemm(const LayerWeights& layer, const Projection* w, int n_proj, int64_t row0, int64_t rows,
               const void* packed, int64_t tokens, float* const* out, int64_t out_stride) {
  const auto* x = static_cast<const float*>(packed);
  std::vector<float> row(w[0].cols);
  for (int p = 0; p < n_proj; ++p) {
    for (int64_t r = 0; r < rows; ++r) {
      DecodeRow(layer, w[p], row0 + r, row.data());
      for (int64_t t = 0; t < tokens; ++t) out[p][r * out_stride + t] = Dot(row.data(), x + t * w[p].cols, w[p].cols);
    }
  }
}

// --- int8 / int4: int8 activations per group ----------------------------------------------------
// Per token: float scales[groups], then int8 q[cols].

int64_t Groups(const LayerWeights& layer, int64_t cols) { return (cols + layer.block_cols - 1) / layer.block_cols; }

int64_t IntTokenBytes(const LayerWeights& layer, int64_t cols) { return Groups(layer, cols) * 4 + (cols + 3) / 4 * 4; }

size_t IntPackedBytes(const LayerWeights& layer, int64_t tokens, int64_t cols) {
  return tokens * IntTokenBytes(layer, cols);
}

void IntPack(const LayerWeights& layer, const ActivationRows& rows, int64_t cols, void* packed) {
  std::vector<float> x(cols);
  const int64_t groups = Groups(layer, cols);
  for (int64_t t = 0; t < rows.count; ++t) {
    LoadFloatRow(rows, t, cols, x.data());
    char* token = static_cast<char*>(packed) + t * IntTokenBytes(layer, cols);
    auto* scales = reinterpret_cast<float*>(token);
    auto* q = reinterpret_cast<int8_t*>(token + groups * 4);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t begin = g * layer.block_cols;
      const int64_t n = std::min(layer.block_cols, cols - begin);
      scales[g] = QuantizeInt8(x.data() + begin, n, q + begin);
    }
  }
}

void IntGemm(const LayerWeights& layer, const Projection* w, int n_proj, int64_t row0, int64_t rows,
             const void* packed, int64_t tokens, float* const* out, int64_t out_stride) {
  const int64_t cols = w[0].cols;
  const int64_t groups = Groups(layer, cols);
  const int64_t row_bytes = layer.RowBytes(cols);
  const bool int4 = layer.format == WeightFormat::kInt4;
  std::vector<int8_t> wq(cols);
  for (int p = 0; p < n_proj; ++p) {
    for (int64_t r = 0; r < rows; ++r) {
      const auto* bytes = static_cast<const unsigned char*>(w[p].data) + (row0 + r) * row_bytes;
      for (int64_t c = 0; c < cols; ++c) {
        wq[c] = int4 ? static_cast<int8_t>(((bytes[c / 2] >> (4 * (c & 1))) & 0xf) - 8) : static_cast<int8_t>(bytes[c]);
      }
      const auto* wscale = static_cast<const float*>(w[p].scale) + (row0 + r) * groups;
      for (int64_t t = 0; t < tokens; ++t) {
        const char* token = static_cast<const char*>(packed) + t * IntTokenBytes(layer, cols);
        const auto* xscale = reinterpret_cast<const float*>(token);
        const auto* xq = reinterpret_cast<const int8_t*>(token + groups * 4);
        float sum = 0.0f;
        for (int64_t g = 0; g < groups; ++g) {
          int64_t dot = 0;
          const int64_t end = std::min(cols, (g + 1) * layer.block_cols);
          for (int64_t c = g * layer.block_cols; c < end; ++c) dot += int32_t{wq[c]} * xq[c];
          float ws;
          std::memcpy(&ws, wscale + g, sizeof ws);
          sum += static_cast<float>(dot) * (ws * xscale[g]);
        }
        out[p][r * out_stride + t] = sum;
      }
    }
  }
}

constexpr GemmKernel kFloat{"generic", 1, FloatPackedBytes, FloatPack, FloatGemm};
constexpr GemmKernel kInt{"generic", 1, IntPackedBytes, IntPack, IntGemm};

}  // namespace

const GemmKernel* GenericKernel(const LayerWeights& layer) {
  if (const GemmKernel* gguf = GgufGenericKernel(layer)) return gguf;
  return layer.format == WeightFormat::kInt8 || layer.format == WeightFormat::kInt4 ? &kInt : &kFloat;
}

}  // namespace hybridjit
