// Registry of routed-expert layers whose weights live in host memory owned by someone else.
//
// The bank never copies or frees weights: it records pointers (numpy arrays, np.memmap views into
// safetensors files, pinned buffers) and the Python side keeps their owners alive until the layer is
// removed. A custom call names its layer by the integer id handed out here.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

namespace hybridjit {

// kQ8_0 ... kIq4Xs: GGUF block formats as llama.cpp stores them, scales inside the blocks (gguf_blocks.h).
enum class WeightFormat { kF32, kBf16, kFp8E4M3Fn, kInt8, kInt4, kMxfp4, kQ8_0, kQ4K, kQ5K, kQ6K, kQ2K, kQ3K, kIq4Xs };

// int8/int4 scale groups run along the input dimension and hold a multiple of this many elements, so
// that no SIMD chunk or AMX tile step of any kernel straddles two groups.
inline constexpr int64_t kIntGroupQuantum = 128;

// mxfp4 (OCP microscaling FP4, as gpt-oss releases its experts): one e8m0 scale per this many elements of a row.
inline constexpr int64_t kMxfp4Block = 32;

const char* WeightFormatName(WeightFormat format);

// The three projections of one expert, each a row-major matrix: gate and up [inter, hidden], down
// [hidden, inter]. Element formats: f32, bf16, fp8 (E4M3FN bytes), int8 (signed bytes), int4 (two
// per byte, element 2j in the low nibble of byte j and 2j+1 in the high one, stored as q + 8 for
// q in [-8, 7]; a row of n elements takes ceil(n / 2) bytes). fp8, int8 and int4 matrices have a
// row-major float32 grid of multipliers (w = q * scale), one per (block_rows x block_cols) block:
// [ceil(rows / block_rows), ceil(cols / block_cols)]; the last row and column of blocks may be
// partial. For int8/int4 the blocks are groups of one row: block_rows = 1 and block_cols (the group
// size) a multiple of kIntGroupQuantum. mxfp4: e2m1 values two per byte in int4's nibble order (a nibble: bit 3
// the sign, bits 0-2 index {0, .5, 1, 1.5, 2, 3, 4, 6}), each row's groups of kMxfp4Block elements scaled by one
// e8m0 byte (2^(s - 127); 255 is NaN): the scale grid is [rows, cols / 32] bytes, block (1, 32), both as
// released (`*_blocks`, `*_scales`). Scale pointers are null for f32 and bf16.
//
// With LayerWeights::gate_up_interleaved, `gate` is one [2 * inter, hidden] matrix whose even rows are the gate
// projection and odd rows the up projection (gpt-oss's fused gate_up_proj), and `up` is null.
// Biases (float32, optional for the whole layer): gate [inter] (interleaved: [2 * inter], matching the fused
// rows; up_bias null), up [inter], down [hidden], added to the projections' outputs.
struct ExpertWeights {
  const void* gate = nullptr;
  const void* up = nullptr;
  const void* down = nullptr;
  const void* gate_scale = nullptr;  // float32 grid, or e8m0 bytes for mxfp4
  const void* up_scale = nullptr;
  const void* down_scale = nullptr;
  const float* gate_bias = nullptr;
  const float* up_bias = nullptr;
  const float* down_bias = nullptr;
};

// What joins an expert's gate and up projections (g and u, biases added) before the down projection.
struct GluActivation {
  enum class Kind { kSilu, kClampedSwiglu };
  Kind kind = Kind::kSilu;
  // kClampedSwiglu (gpt-oss): g' = min(g, limit), u' = clamp(u, -limit, limit), (u' + 1) * g' * sigmoid(alpha g').
  float alpha = 1.0f;
  float limit = 0.0f;
};

// The three projections of an expert, in the order of ExpertWeights.
enum class Matrix { kGate, kUp, kDown };

// The special codes (fp8_special.h) of one fp8 expert's projections, indexed by Matrix.
using Fp8Specials = std::array<std::vector<uint32_t>, 3>;

struct LayerWeights {
  WeightFormat format = WeightFormat::kF32;
  int64_t hidden = 0;
  int64_t inter = 0;
  int64_t block_rows = 0;  // scale block along the output dimension of a projection
  int64_t block_cols = 0;  // ... and along its input dimension
  std::vector<ExpertWeights> experts;
  bool gate_up_interleaved = false;  // see ExpertWeights
  bool biased = false;               // every expert has its gate/up/down biases
  GluActivation activation;
  // fp8 layers: per expert, filled by WeightBank::Add (which reads every weight once).
  std::vector<Fp8Specials> fp8_specials;
  // GGUF layers whose down projections have another block format than gate and up (llama.cpp's Q4_K_M
  // keeps ffn_down in Q6_K); unset: every projection is in `format`.
  std::optional<WeightFormat> down_format;

  int64_t n_experts() const { return static_cast<int64_t>(experts.size()); }
  WeightFormat ProjectionFormat(Matrix which) const {
    return which == Matrix::kDown && down_format ? *down_format : format;
  }
  // Whether the layer has separate scale grids (the GGUF formats keep their scales in the blocks).
  bool scaled() const {
    return format == WeightFormat::kFp8E4M3Fn || format == WeightFormat::kInt8 || format == WeightFormat::kInt4 ||
           format == WeightFormat::kMxfp4;
  }
  // Rows of the gate projection as stored: inter, or 2 * inter with the up rows interleaved.
  int64_t gate_rows() const { return gate_up_interleaved ? 2 * inter : inter; }
  // Bytes of one row of `cols` elements (of projection `which`).
  int64_t RowBytes(int64_t cols, Matrix which = Matrix::kGate) const;
};

// Read access to one registered layer. While a lease is alive the layer cannot finish being removed,
// so the Python owner of the weights cannot drop them under a running kernel.
class LayerLease {
 public:
  LayerLease() = default;
  explicit operator bool() const { return entry_ != nullptr; }
  const LayerWeights& weights() const { return entry_->weights; }

 private:
  friend class WeightBank;
  struct Entry {
    LayerWeights weights;
    std::shared_mutex in_use;  // shared by leases, taken exclusively by Remove
  };
  LayerLease(std::shared_ptr<Entry> entry, std::shared_lock<std::shared_mutex> lock)
      : entry_(std::move(entry)), lock_(std::move(lock)) {}

  std::shared_ptr<Entry> entry_;
  std::shared_lock<std::shared_mutex> lock_;
};

// Thread-safe. Ids start at 1 and are never reused, so a graph compiled against a removed layer
// fails with "unknown layer" rather than running on another layer's weights.
class WeightBank {
 public:
  static WeightBank& Global();

  // Validates the description (not the memory behind the pointers) and throws
  // std::invalid_argument when it is inconsistent. For an fp8 layer, lists every expert's special codes
  // on the global thread pool: the weights must be in place and stay unchanged while registered.
  int64_t Add(LayerWeights layer);
  // Returns false if the id is not registered. Blocks until every lease on the layer is released.
  bool Remove(int64_t id);
  // An empty lease if the id is not registered.
  LayerLease Find(int64_t id) const;
  std::vector<int64_t> Ids() const;

 private:
  mutable std::mutex mutex_;
  std::unordered_map<int64_t, std::shared_ptr<LayerLease::Entry>> layers_;
  int64_t next_id_ = 1;
};

}  // namespace hybridjit
