// CPU matrix kernels of the routed-expert MoE operator, one set per instruction-set family.
//
// A kernel multiplies rows of one expert projection (a row-major [out, in] matrix in the layer's
// format, read in place) by the activations of the expert's tokens. The activations are first packed
// once per expert call into the kernel's own layout and precision:
//   generic  float32 (f32/bf16/fp8/mxfp4 weights) or int8 per scale group (int8/int4 weights)
//   avx2     float32 (f32/bf16/fp8/mxfp4), or int8 per group
//   avx512   bfloat16 (bf16/fp8 weights, for vdpbf16ps), int8 per group (VNNI), or for mxfp4 15-bit integers per
//            32-element group as two int8 halves (VNNI)
//   amx      bfloat16 tiles (bf16; fp8 as its exact bfloat16 values, rescaled per scale block; fp8 with other
//            blocks, mxfp4 and the GGUF block formats dequantized to bfloat16 tile by tile), or int8 tiles (int8
//            with one scale per row; int8/int4 with several scale groups per row, rescaled per group)
// int8 activations are quantized per token and per weight scale group g of the input dimension:
// s = max|x_g| / 127, q = round-to-nearest-even(x * (127 / max|x_g|)), so x ~ q * s. Every kernel
// quantizes the same way and sums the integer products exactly, so the formats' integer kernels agree
// with each other up to float32 summation order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "cpu_features.h"
#include "numeric_formats.h"
#include "weight_bank.h"

namespace hybridjit {

// Rows of float32 or bfloat16 activations: row i starts at element (index ? index[i] : i) * stride.
struct ActivationRows {
  const void* base = nullptr;
  bool bf16 = false;
  int64_t stride = 0;
  const int64_t* index = nullptr;
  int64_t count = 0;

  const void* Row(int64_t i) const {
    const int64_t r = index ? index[i] : i;
    return static_cast<const char*>(base) + r * stride * (bf16 ? 2 : 4);
  }
};

// One projection matrix of one expert.
struct Projection {
  const void* data = nullptr;
  const void* scale = nullptr;  // the layer's block grid (float32; e8m0 bytes for mxfp4), null for f32/bf16
  int64_t rows = 0;
  int64_t cols = 0;
  // fp8: the special codes (fp8_special.h), flat indices in ascending order. The AVX2 and AVX-512 kernels
  // need them (without, their results are wrong wherever a special code sits); generic and AMX ignore them.
  const uint32_t* fp8_specials = nullptr;
  int64_t n_fp8_specials = 0;
  Matrix which = Matrix::kGate;  // which projection: its format is layer.ProjectionFormat(which)
};

// Projection `which` of expert `expert` of a registered layer, with its fp8 special codes once the bank
// has listed them.
inline Projection ExpertProjection(const LayerWeights& layer, int64_t expert, Matrix which) {
  const ExpertWeights& w = layer.experts[expert];
  Projection p;
  switch (which) {
    case Matrix::kGate:
      p = {w.gate, w.gate_scale, layer.gate_rows(), layer.hidden};
      break;
    case Matrix::kUp:
      p = {w.up, w.up_scale, layer.inter, layer.hidden};
      break;
    case Matrix::kDown:
      p = {w.down, w.down_scale, layer.hidden, layer.inter};
      break;
  }
  p.which = which;
  if (!layer.fp8_specials.empty()) {
    const std::vector<uint32_t>& specials = layer.fp8_specials[expert][static_cast<int>(which)];
    p.fp8_specials = specials.data();
    p.n_fp8_specials = static_cast<int64_t>(specials.size());
  }
  return p;
}

// Columns of a projection's scale grid (blocks along its input dimension).
inline int64_t ScaleCols(const LayerWeights& layer, int64_t cols) { return (cols + layer.block_cols - 1) / layer.block_cols; }

// The multiplier of scale block (row / block_rows, block) of a scaled projection, whatever its storage: a float32
// grid (read with memcpy: memory-mapped checkpoints promise no alignment), or e8m0 bytes (mxfp4).
inline float BlockScale(const LayerWeights& layer, const Projection& p, int64_t row, int64_t block) {
  const int64_t index = row / layer.block_rows * ScaleCols(layer, p.cols) + block;
  if (layer.format == WeightFormat::kMxfp4) return E8m0Table()[static_cast<const uint8_t*>(p.scale)[index]];
  float scale;
  std::memcpy(&scale, static_cast<const float*>(p.scale) + index, sizeof scale);
  return scale;
}

struct GemmKernel {
  const char* name;
  // Output buffers hold rows and tokens padded up to a multiple of this (AMX writes whole tiles).
  int64_t pad;
  // Bytes of packed activations for `tokens` rows of `cols` elements.
  size_t (*packed_bytes)(const LayerWeights& layer, int64_t tokens, int64_t cols);
  void (*pack)(const LayerWeights& layer, const ActivationRows& rows, int64_t cols, void* packed);
  // For p < n_proj: out[p][r * out_stride + t] = (row row0 + r of w[p]) . (token t), r < rows,
  // t < tokens. The projections share the packed activations (gate and up of one expert).
  void (*gemm)(const LayerWeights& layer, const Projection* w, int n_proj, int64_t row0, int64_t rows,
               const void* packed, int64_t tokens, float* const* out, int64_t out_stride);
  // Whether a pack splits by tokens: pack() of tokens [t0, t1), t0 a multiple of `pad`, written packed_bytes(t0)
  // bytes in, lays out the bytes a pack of all the tokens would there; so threads can share one expert's pack.
  bool packs_in_token_ranges = false;
};

// The kernels of each family for a layer; null where the family has none for the layer's format (the
// next lower family's kernel serves it).
const GemmKernel* GenericKernel(const LayerWeights& layer);
const GemmKernel* Avx2Kernel(const LayerWeights& layer);
const GemmKernel* Avx512Kernel(const LayerWeights& layer);
const GemmKernel* AmxKernel(const LayerWeights& layer);
// The GGUF block formats' kernels (expert_kernel_gguf.cc); null for the other formats.
const GemmKernel* GgufGenericKernel(const LayerWeights& layer);
const GemmKernel* GgufAvx512Kernel(const LayerWeights& layer);
// The GGUF register-tile kernel for many tokens an expert on AVX-512 hosts without AMX
// (expert_kernel_gguf_tiles.cc); null for other formats and for rows that are not whole 256-element steps.
const GemmKernel* GgufTileKernel(const LayerWeights& layer);
// What both GGUF AVX-512 kernels share: token t's activations as float32 in x[cols], and the group the activations
// are quantised in (256 with a K-quant projection in the layer, one scale per super-block; else 32).
void GgufTokenFloats(const ActivationRows& rows, int64_t t, int64_t cols, float* x);
int64_t GgufActivationGroup(const LayerWeights& layer);
// With the avx512 family (a host without AMX), the tokens per expert from which GGUF experts run on the tile kernel:
// the override if set (cpu_features.h), else the crossover measured against the few-token kernel.
int64_t GgufTileMinTokens();

// With the amx family, the tokens per expert from which a layer's experts run on AMX: the override if
// set (cpu_features.h), else the crossover measured against AVX-512 for the layer's AMX kernel.
int64_t AmxMinTokens(const LayerWeights& layer);

// The kernel that `family` uses for an expert of `layer` with `tokens` tokens in a call: with amx,
// the AMX kernel from AmxMinTokens(layer) tokens on and the AVX-512 one below; with avx512, GGUF experts on the tile
// kernel from GgufTileMinTokens() tokens on.
const GemmKernel& SelectKernel(CpuKernel family, const LayerWeights& layer, int64_t tokens);

}  // namespace hybridjit
