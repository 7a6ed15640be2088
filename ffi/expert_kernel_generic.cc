// Expert-major generic kernel: the tokens are grouped by expert so that each weight row is decoded
// to float32 once per call and then used for every token routed to that expert.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "expert_kernels.h"
#include "numeric_formats.h"

namespace hybridjit {
namespace {

// One projection of one expert: a row-major [rows, cols] matrix and, for FP8, its block multipliers.
struct Projection {
  const void* data;
  const float* scale;
  int64_t rows;
  int64_t cols;
};

// Writes row `row` of the projection, dequantized, to out[0, cols). Weights are read with memcpy
// because np.memmap views into a checkpoint promise no alignment.
void DecodeRow(const LayerWeights& layer, const Projection& p, int64_t row, float* out) {
  const auto* bytes = static_cast<const unsigned char*>(p.data);
  switch (layer.format) {
    case WeightFormat::kF32:
      std::memcpy(out, bytes + row * p.cols * sizeof(float), p.cols * sizeof(float));
      return;
    case WeightFormat::kBf16: {
      const unsigned char* src = bytes + row * p.cols * sizeof(uint16_t);
      for (int64_t c = 0; c < p.cols; ++c) {
        uint16_t bits;
        std::memcpy(&bits, src + c * sizeof bits, sizeof bits);
        out[c] = Bf16BitsToFloat(bits);
      }
      return;
    }
    case WeightFormat::kFp8E4M3Fn: {
      const std::array<float, 256>& table = Fp8E4M3FnTable();
      const unsigned char* src = bytes + row * p.cols;
      const int64_t scale_cols = (p.cols + layer.block_cols - 1) / layer.block_cols;
      const float* scale_row = p.scale + (row / layer.block_rows) * scale_cols;
      for (int64_t block = 0; block < scale_cols; ++block) {
        float scale;
        std::memcpy(&scale, scale_row + block, sizeof scale);
        const int64_t begin = block * layer.block_cols;
        const int64_t end = std::min(begin + layer.block_cols, p.cols);
        for (int64_t c = begin; c < end; ++c) out[c] = table[src[c]] * scale;
      }
      return;
    }
  }
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

float Silu(float v) { return v / (1.0f + std::exp(-v)); }

}  // namespace

void RoutedExpertsGeneric(const LayerWeights& layer, const RoutedExpertsArgs& args) {
  const int64_t hidden = layer.hidden;
  const int64_t inter = layer.inter;
  const int64_t n_experts = layer.n_experts();
  const int64_t n_routes = args.tokens * args.top_k;

  // Counting sort of the (token, weight) routes by expert. A token routed to one expert twice
  // simply contributes twice.
  std::vector<int64_t> first(n_experts + 1, 0);
  for (int64_t r = 0; r < n_routes; ++r) ++first[args.ids[r] + 1];
  for (int64_t e = 0; e < n_experts; ++e) first[e + 1] += first[e];
  std::vector<int64_t> route_token(n_routes);
  std::vector<float> route_weight(n_routes);
  std::vector<int64_t> cursor(first.begin(), first.end() - 1);
  for (int64_t r = 0; r < n_routes; ++r) {
    const int64_t slot = cursor[args.ids[r]]++;
    route_token[slot] = r / args.top_k;
    route_weight[slot] = args.weights[r];
  }

  std::fill(args.y, args.y + args.tokens * hidden, 0.0f);
  int64_t max_routes = 0;
  for (int64_t e = 0; e < n_experts; ++e) {
    max_routes = std::max(max_routes, first[e + 1] - first[e]);
  }
  std::vector<float> row(std::max(hidden, inter));
  std::vector<float> act(max_routes * inter);  // [routes of this expert, inter]

  for (int64_t e = 0; e < n_experts; ++e) {
    const int64_t n = first[e + 1] - first[e];
    if (n == 0) continue;
    const int64_t* tokens = route_token.data() + first[e];
    const float* weights = route_weight.data() + first[e];
    const ExpertWeights& w = layer.experts[e];
    const Projection gate{w.gate, w.gate_scale, inter, hidden};
    const Projection up{w.up, w.up_scale, inter, hidden};
    const Projection down{w.down, w.down_scale, hidden, inter};

    for (int64_t i = 0; i < inter; ++i) {
      DecodeRow(layer, gate, i, row.data());
      for (int64_t j = 0; j < n; ++j) {
        act[j * inter + i] = Dot(row.data(), args.x + tokens[j] * hidden, hidden);
      }
    }
    for (int64_t i = 0; i < inter; ++i) {
      DecodeRow(layer, up, i, row.data());
      for (int64_t j = 0; j < n; ++j) {
        const float up_value = Dot(row.data(), args.x + tokens[j] * hidden, hidden);
        act[j * inter + i] = Silu(act[j * inter + i]) * up_value;
      }
    }
    for (int64_t h = 0; h < hidden; ++h) {
      DecodeRow(layer, down, h, row.data());
      for (int64_t j = 0; j < n; ++j) {
        args.y[tokens[j] * hidden + h] += weights[j] * Dot(row.data(), act.data() + j * inter, inter);
      }
    }
  }
}

}  // namespace hybridjit
