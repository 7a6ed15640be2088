#include "weight_bank.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

#include "expert_kernels.h"
#include "fp8_special.h"
#include "gguf_blocks.h"
#include "thread_pool.h"

namespace hybridjit {

const char* WeightFormatName(WeightFormat format) {
  switch (format) {
    case WeightFormat::kF32:
      return "f32";
    case WeightFormat::kBf16:
      return "bf16";
    case WeightFormat::kFp8E4M3Fn:
      return "fp8";
    case WeightFormat::kInt8:
      return "int8";
    case WeightFormat::kInt4:
      return "int4";
    case WeightFormat::kMxfp4:
      return "mxfp4";
    case WeightFormat::kQ8_0:
      return "q8_0";
    case WeightFormat::kQ4K:
      return "q4_k";
    case WeightFormat::kQ5K:
      return "q5_k";
    case WeightFormat::kQ6K:
      return "q6_k";
    case WeightFormat::kQ2K:
      return "q2_k";
    case WeightFormat::kQ3K:
      return "q3_k";
    case WeightFormat::kIq4Xs:
      return "iq4_xs";
  }
  return "unknown";
}

namespace {

void CheckLayer(const LayerWeights& layer) {
  if (layer.hidden <= 0 || layer.inter <= 0) {
    throw std::invalid_argument("hidden and inter must be positive");
  }
  if (layer.experts.empty()) throw std::invalid_argument("a layer needs at least one expert");
  const GluActivation& act = layer.activation;
  if (act.kind == GluActivation::Kind::kClampedSwiglu && !(act.limit > 0.0f && std::isfinite(act.alpha))) {
    throw std::invalid_argument("the clamped SwiGLU needs a positive limit and a finite alpha");
  }
  const bool scaled = layer.scaled();
  if (scaled && (layer.block_rows <= 0 || layer.block_cols <= 0)) {
    throw std::invalid_argument("scale blocks must be positive");
  }
  const bool integer = layer.format == WeightFormat::kInt8 || layer.format == WeightFormat::kInt4;
  if (integer && (layer.block_rows != 1 || layer.block_cols % kIntGroupQuantum != 0)) {
    throw std::invalid_argument("int8/int4 scale groups must be one row by a multiple of " +
                                std::to_string(kIntGroupQuantum) + " columns");
  }
  if (layer.down_format && !(IsGgufFormat(layer.format) && IsGgufFormat(*layer.down_format))) {
    throw std::invalid_argument("a separate down-projection format is for GGUF block formats only");
  }
  for (const WeightFormat f : {layer.format, layer.ProjectionFormat(Matrix::kDown)}) {
    if (IsGgufFormat(f) && (layer.hidden % GgufBlockElements(f) || layer.inter % GgufBlockElements(f))) {
      throw std::invalid_argument(std::string(WeightFormatName(f)) + " rows are whole blocks of " +
                                  std::to_string(GgufBlockElements(f)) + " elements: hidden " +
                                  std::to_string(layer.hidden) + " and inter " + std::to_string(layer.inter) +
                                  " must be multiples of it");
    }
  }
  if (layer.format == WeightFormat::kMxfp4 &&
      (layer.block_rows != 1 || layer.block_cols != kMxfp4Block || layer.hidden % kMxfp4Block != 0 ||
       layer.inter % kMxfp4Block != 0)) {
    throw std::invalid_argument("mxfp4 layers need scale blocks of (1, " + std::to_string(kMxfp4Block) +
                                ") and hidden and inter multiples of " + std::to_string(kMxfp4Block));
  }
  if (layer.format == WeightFormat::kFp8E4M3Fn && layer.hidden * layer.gate_rows() > int64_t{UINT32_MAX}) {
    throw std::invalid_argument("fp8 projections of " + std::to_string(layer.gate_rows()) + " x " +
                                std::to_string(layer.hidden) + " elements are too large for the 32-bit special-code index");
  }
  for (size_t e = 0; e < layer.experts.size(); ++e) {
    const ExpertWeights& w = layer.experts[e];
    // An interleaved layer's up rows live in the gate matrix: its up pointers must be null.
    const bool up_ok = layer.gate_up_interleaved ? !w.up && !w.up_scale && !w.up_bias : w.up && (!scaled || w.up_scale);
    const bool has_weights = w.gate && w.down && up_ok;
    const bool has_scales = w.gate_scale && w.down_scale;
    if (!has_weights || (scaled && !has_scales)) {
      throw std::invalid_argument("expert " + std::to_string(e) + ": null weight or scale pointer");
    }
    const bool has_biases = w.gate_bias && w.down_bias && (layer.gate_up_interleaved || w.up_bias);
    if (layer.biased != has_biases) {
      throw std::invalid_argument("expert " + std::to_string(e) + (layer.biased ? ": null" : ": unexpected") +
                                  " bias pointer");
    }
  }
}

// Maps every page of [data, data + bytes) into the process now, so that a layer's first decode steps do
// not take page faults: each first touch of a memory-mapped checkpoint page costs a fault (and a disk
// read when the page is not cached), which made the first steps of a process slower than the rest.
// MADV_POPULATE_READ (Linux 5.14) does it in one call; older kernels get one read per page.
void FaultIn(const void* data, int64_t bytes) {
  constexpr int kPopulateRead = 22;  // MADV_POPULATE_READ, absent from older headers
  const int64_t page = sysconf(_SC_PAGESIZE);
  const auto begin = reinterpret_cast<uintptr_t>(data) / page * page;
  const auto end = reinterpret_cast<uintptr_t>(data) + bytes;
  if (madvise(reinterpret_cast<void*>(begin), end - begin, kPopulateRead) == 0) return;
  const volatile uint8_t* bytes_in = static_cast<const uint8_t*>(data);
  for (int64_t offset = 0; offset < bytes; offset += page) (void)bytes_in[offset];
}

// Each expert projection's preparation at registration, one task per projection over the pool's
// nodes: fp8 lists its special codes (reading every byte, which faults the pages in too); the other
// formats fault their pages in.
void PrepareExperts(LayerWeights& layer) {
  const int64_t n = layer.n_experts();
  const bool fp8 = layer.format == WeightFormat::kFp8E4M3Fn;
  if (fp8) layer.fp8_specials.assign(n, {});
  // Held for the whole scan: a concurrent ConfigureGlobal must not free the pool under it.
  const std::shared_ptr<ThreadPool> pool = ThreadPool::Global();
  Job job;
  job.tasks.assign(1, std::vector<std::vector<int64_t>>(pool->nodes()));
  for (int64_t task = 0; task < 3 * n; ++task) job.tasks[0][task % pool->nodes()].push_back(task);
  job.run = [&](int64_t task) {
    if (layer.gate_up_interleaved && static_cast<Matrix>(task % 3) == Matrix::kUp) return;  // inside the gate
    const Projection p = ExpertProjection(layer, task / 3, static_cast<Matrix>(task % 3));
    if (fp8) {
      layer.fp8_specials[task / 3][task % 3] = FindFp8Specials(static_cast<const uint8_t*>(p.data), p.rows, p.cols);
    } else {
      FaultIn(p.data, p.rows * layer.RowBytes(p.cols, p.which));
    }
  };
  const std::string error = pool->Run(job);
  if (!error.empty()) throw std::runtime_error("preparing the expert weights: " + error);
}

}  // namespace

int64_t LayerWeights::RowBytes(int64_t cols, Matrix which) const {
  const WeightFormat format = ProjectionFormat(which);
  if (IsGgufFormat(format)) return cols / GgufBlockElements(format) * GgufBlockBytes(format);
  switch (format) {
    case WeightFormat::kF32:
      return cols * 4;
    case WeightFormat::kBf16:
      return cols * 2;
    case WeightFormat::kFp8E4M3Fn:
    case WeightFormat::kInt8:
      return cols;
    case WeightFormat::kInt4:
    case WeightFormat::kMxfp4:
      return (cols + 1) / 2;
    default:  // the GGUF block formats, above
      return 0;
  }
}

WeightBank& WeightBank::Global() {
  static WeightBank* bank = new WeightBank();  // never destroyed: handlers may run during exit
  return *bank;
}

int64_t WeightBank::Add(LayerWeights layer) {
  CheckLayer(layer);
  PrepareExperts(layer);
  auto entry = std::make_shared<LayerLease::Entry>();
  entry->weights = std::move(layer);
  std::lock_guard<std::mutex> guard(mutex_);
  const int64_t id = next_id_++;
  layers_.emplace(id, std::move(entry));
  return id;
}

bool WeightBank::Remove(int64_t id) {
  std::shared_ptr<LayerLease::Entry> entry;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    auto it = layers_.find(id);
    if (it == layers_.end()) return false;
    entry = std::move(it->second);
    layers_.erase(it);
  }
  // No new lease can start now; wait for the running ones.
  std::unique_lock<std::shared_mutex> drain(entry->in_use);
  return true;
}

LayerLease WeightBank::Find(int64_t id) const {
  std::lock_guard<std::mutex> guard(mutex_);
  auto it = layers_.find(id);
  if (it == layers_.end()) return {};
  // Taken under mutex_, so Remove (which erases under mutex_ before locking in_use) cannot slip
  // between the lookup and the lock.
  std::shared_lock<std::shared_mutex> lock(it->second->in_use);
  return LayerLease(it->second, std::move(lock));
}

std::vector<int64_t> WeightBank::Ids() const {
  std::lock_guard<std::mutex> guard(mutex_);
  std::vector<int64_t> ids;
  ids.reserve(layers_.size());
  for (const auto& [id, entry] : layers_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

}  // namespace hybridjit
