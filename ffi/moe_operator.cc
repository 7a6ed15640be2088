#include "moe_operator.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <new>
#include <stdexcept>
#include <vector>

#include "expert_kernels.h"
#include "numeric_formats.h"
#include "thread_pool.h"

namespace hybridjit {

int64_t AmxMinTokens(const LayerWeights& layer) {
  if (const int64_t tokens = AmxMinTokensOverride(); tokens > 0) return tokens;
  // Crossovers measured on a 16-core Emerald Rapids at DeepSeek-V3 expert shapes (bench/moe_cpu.py
  // --crossover): bf16 weights load straight into tiles; fp8 and grouped int8/int4 pay a
  // dequantization of every weight per call, which only enough tokens amortize.
  const GemmKernel* amx = AmxKernel(layer);
  if (!amx) return std::numeric_limits<int64_t>::max();
  const std::string name = amx->name;
  if (name == "amx_int8") return 16;
  // Grouped int8/int4 as int8 tiles (no dequantization either): AMX ahead of AVX-512 VNNI between 8 and 16 tokens
  // per expert on the 2-core dev Xeon (moe_cpu.py --crossover, int8 and int4); to be re-measured on the 16 cores.
  if (name == "amx_int8g") return 16;
  // Block-scaled FP8 as exact bfloat16 tiles: AMX ahead of AVX-512 from ~10 tokens per expert (moe_cpu.py
  // --crossover, AMX / AVX-512 at 8 and 16 tokens: 16 cores 10.5 / 9.1 and 10.8 / 17.6 ms; the 2-core dev Xeon 91 / 69
  // and 95 / 154 ms; the lines cross at 9.4 and 10.2).
  if (name == "amx_fp8g") return 10;
  switch (layer.format) {
    case WeightFormat::kBf16:
      return 8;
    case WeightFormat::kFp8E4M3Fn:
      return 32;
    // GGUF blocks: the VNNI kernel multiplies blocks split in registers four tokens at a time; AMX decodes them to
    // bfloat16 tiles. 16-core Sapphire-class Xeon, moe_cpu.py --crossover (session 36), AVX-512 / AMX ms at 8 and 16
    // tokens per expert: Q4_K 5.8 / 8.1 and 11.2 / 7.8, Q6_K 5.6 / 8.6 and 10.4 / 8.7, Q8_0 6.7 / 8.2 and 12.4 / 8.1;
    // the lines cross at 11.3, 13.4 and 10.5.
    case WeightFormat::kQ8_0:
    case WeightFormat::kQ4K:
    case WeightFormat::kQ5K:
    case WeightFormat::kQ6K:
    case WeightFormat::kQ2K:  // Q2_K 5.1 / 7.3 and 11.0 / 7.9, Q3_K 5.9 / 7.9 and 10.9 / 7.6 (session 36 call 4)
    case WeightFormat::kQ3K:
    case WeightFormat::kIq4Xs:  // 6.7 / 8.2 and 13.5 / 8.2 (session 36 call 7)
      return 12;
    // mxfp4 (gpt-oss shapes, 2880 x 2880): AVX-512's 2 x 4 tiles 6.9 ms at 16 tokens per expert, 13.3 at 32; AMX
    // flat at 7.7 from 8 to 32 (same run): the lines cross at 18.
    case WeightFormat::kMxfp4:
      return 18;
    default:
      return 64;
  }
}

int64_t GgufTileMinTokens() {
  if (const int64_t tokens = GgufTileMinTokensOverride(); tokens > 0) return tokens;
  // 2-core Zen 5 (session 37, moe_cpu.py at DeepSeek-V3 shapes, tiles / few-token kernel TFLOP/s): 32 tokens an
  // expert Q4_K 0.313 / 0.277, Q6_K 0.231 / 0.226, IQ4_XS 0.257 / 0.202 (in another run Q6_K 0.216 / 0.233); 64:
  // 0.361 / 0.254, 0.317 / 0.238, 0.367 / 0.190; 256: 0.389 / 0.278, 0.360 / 0.243, 0.382 / 0.202 (bench/RESULTS.md).
  return 32;
}

const GemmKernel& SelectKernel(CpuKernel family, const LayerWeights& layer, int64_t tokens) {
  // The tile kernel only where AVX-512 is the host's best: with AMX, AMX takes those token counts.
  if (family == CpuKernel::kAvx512 && tokens >= GgufTileMinTokens()) {
    if (const GemmKernel* tiles = GgufTileKernel(layer)) return *tiles;
  }
  if (family == CpuKernel::kAmx && tokens < AmxMinTokens(layer)) family = CpuKernel::kAvx512;
  for (int level = static_cast<int>(family); level > 0; --level) {
    const GemmKernel* kernel = nullptr;
    switch (static_cast<CpuKernel>(level)) {
      case CpuKernel::kAmx:
        kernel = AmxKernel(layer);
        break;
      case CpuKernel::kAvx512:
        kernel = Avx512Kernel(layer);
        break;
      case CpuKernel::kAvx2:
        kernel = Avx2Kernel(layer);
        break;
      case CpuKernel::kGeneric:
        break;
    }
    if (kernel) return *kernel;
  }
  return *GenericKernel(layer);
}

namespace {

// pack + zero, gate/up, the activations' pack where threads share it, down, convert: a task waits only for tasks
// of earlier phases (thread_pool.h).
constexpr int kPhases = 5;
// Threads share an expert's activation pack for the down projection, in parts of at least kSharedPackPart tokens,
// when it has kSharedPackTokens or more and the call has at most one expert per kThreadsPerSharedPack threads.
// Alone, one thread packed a Mixtral expert's 256 x 14,336 activations in 3.6 ms while the other 15 waited: shared,
// the call took 19.0 ms instead of 20.3 (16-core Xeon). With Mixtral's 8 experts of 256 tokens sharing cost 10%:
// threads waited on the last experts' gate/up to pack them, where one thread a finished expert had packed it while
// the others still multiplied.
constexpr int64_t kSharedPackTokens = 128;
constexpr int64_t kSharedPackPart = 32;
constexpr int kThreadsPerSharedPack = 4;
constexpr size_t kAlign = 64;

// SiLU(g) * u with a polynomial exp (relative error ~2e-7), so that the loop vectorises: prefill
// takes tens of millions of these per layer.
float ExpApprox(float v) {
  v = std::min(88.0f, std::max(-87.0f, v));
  const float n = std::nearbyint(v * 1.44269504f);
  const float f = (v - n * 0.693145752f) - n * 1.42860677e-06f;
  float p = 1.98412698e-4f;
  p = p * f + 1.38888889e-3f;
  p = p * f + 8.33333333e-3f;
  p = p * f + 4.16666667e-2f;
  p = p * f + 1.66666667e-1f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void SiluMul(const float* g, const float* u,
                                                                         int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = g[i] / (1.0f + ExpApprox(-g[i])) * u[i];
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void ClampedSwiglu(const float* g, const float* u,
                                                                               int64_t n, float alpha, float limit,
                                                                               float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float gate = std::min(g[i], limit), up = std::min(std::max(u[i], -limit), limit);
    out[i] = (up + 1.0f) * gate / (1.0f + ExpApprox(-alpha * gate));
  }
}

void Activate(const GluActivation& activation, const float* g, const float* u, int64_t n, float* out) {
  switch (activation.kind) {
    case GluActivation::Kind::kSilu:
      SiluMul(g, u, n, out);
      return;
    case GluActivation::Kind::kClampedSwiglu:
      ClampedSwiglu(g, u, n, activation.alpha, activation.limit, out);
      return;
  }
}

// Adds bias[r * bias_step] to row r (of `columns` values, `stride` apart) of rows of out.
void AddRowBias(const float* bias, int64_t bias_step, int64_t rows, int64_t columns, int64_t stride, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t t = 0; t < columns; ++t) out[r * stride + t] += bias[r * bias_step];
  }
}

// Grows, never shrinks: a thread's buffers are reused by its next calls (no page faults per call).
class Buffer {
 public:
  ~Buffer() { std::free(data_); }
  char* Get(size_t bytes) {
    if (bytes > size_) {
      std::free(data_);
      size_ = (bytes + kAlign - 1) / kAlign * kAlign;
      data_ = static_cast<char*>(std::aligned_alloc(kAlign, size_));
      if (!data_) {
        size_ = 0;
        throw std::bad_alloc();
      }
    }
    return data_;
  }

 private:
  char* data_ = nullptr;
  size_t size_ = 0;
};

size_t Aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
int64_t RoundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

struct ExpertPlan {
  int64_t expert = 0;
  int64_t first = 0;  // routes [first, first + count) of the sorted route arrays
  int64_t count = 0;
  const GemmKernel* kernel = nullptr;
  size_t packed_in = 0, act = 0, packed_act = 0;  // arena offsets
  std::atomic<int64_t> gate_up_left{0};
  bool pack_shared = false;  // whether threads share the activations' pack (kPackAct tasks) or one thread packs them
  std::atomic<int64_t> pack_act_left{0};  // with pack_shared: its parts not yet done
  std::atomic<bool> input_ready{false};
  std::atomic<bool> act_ready{false};
};

enum class TaskKind { kPack, kZero, kGateUp, kPackAct, kDown, kConvert };

struct Task {
  TaskKind kind;
  int64_t plan;  // index into plans (pack, gate/up, the activations' pack, down)
  int64_t begin, end;  // rows (gate/up, down), tokens (the activations' pack) or elements (zero, convert)
  int64_t slice;  // down: the row slice, whose turn counter orders the additions
};

// Splits [0, rows) into one part per node and each part into slices of about `size` rows, aligned
// to 32 rows (AMX tiles, and FP8 128-row scale blocks stay whole in the common case).
std::vector<std::vector<std::pair<int64_t, int64_t>>> Slices(int64_t rows, int nodes, int64_t size) {
  std::vector<std::vector<std::pair<int64_t, int64_t>>> out(nodes);
  for (int n = 0; n < nodes; ++n) {
    const int64_t begin = std::min(rows, RoundUp(rows * n / nodes, 32));
    const int64_t end = n + 1 == nodes ? rows : std::min(rows, RoundUp(rows * (n + 1) / nodes, 32));
    for (int64_t r = begin; r < end; r += size) out[n].emplace_back(r, std::min(end, r + size));
  }
  return out;
}

// About three slices per thread: enough to even out the threads, while each slice re-reads all of its expert's
// packed activations, so more slices cost more reads (Qwen3-30B-A3B's shapes, 16 experts x 64 tokens on the
// 16-core Xeon: 1.04x over eight per thread; 1.03x for one Mixtral expert of 256 tokens).
int64_t SliceRows(int64_t rows, int64_t experts, int threads) {
  return std::clamp<int64_t>(rows * experts / (3 * threads) / 32 * 32, 32, 256);
}

class MoeJob {
 public:
  MoeJob(const LayerWeights& layer, const MoeCall& call, const ThreadPool& pool)
      : layer_(layer), call_(call), nodes_(pool.nodes()) {
    Route();
    Plan(pool.threads());
  }

  std::string Run(ThreadPool& pool) {
    Job job;
    job.run = [this](int64_t id) { RunTask(id); };
    job.tasks = std::move(lists_);
    std::string error = pool.Run(job);
    if (error.empty() && failed_.load()) error = "routed experts failed";
    return error;
  }

 private:
  // Routes of weight zero add nothing and are dropped: the free slots of a serving batch route so, and
  // must not cost their experts' reads.
  void Route() {
    const int64_t n_routes = call_.tokens * call_.top_k;
    std::vector<int64_t> first(layer_.n_experts() + 1, 0);
    for (int64_t r = 0; r < n_routes; ++r) {
      if (call_.weights[r] != 0.0f) ++first[call_.ids[r] + 1];
    }
    for (int64_t e = 0; e < layer_.n_experts(); ++e) first[e + 1] += first[e];
    route_token_.resize(first[layer_.n_experts()]);
    route_weight_.resize(first[layer_.n_experts()]);
    std::vector<int64_t> cursor(first.begin(), first.end() - 1);
    for (int64_t r = 0; r < n_routes; ++r) {
      if (call_.weights[r] == 0.0f) continue;
      const int64_t slot = cursor[call_.ids[r]]++;
      route_token_[slot] = r / call_.top_k;
      route_weight_[slot] = call_.weights[r];
    }
    std::vector<int64_t> active;
    for (int64_t e = 0; e < layer_.n_experts(); ++e) {
      if (first[e + 1] > first[e]) active.push_back(e);
    }
    // Largest first: the big experts of a skewed prefill start early instead of forming the tail.
    std::stable_sort(active.begin(), active.end(),
                     [&](int64_t a, int64_t b) { return first[a + 1] - first[a] > first[b + 1] - first[b]; });
    plans_ = std::make_unique<ExpertPlan[]>(active.size());
    n_plans_ = static_cast<int64_t>(active.size());
    for (int64_t i = 0; i < n_plans_; ++i) {
      plans_[i].expert = active[i];
      plans_[i].first = first[active[i]];
      plans_[i].count = first[active[i] + 1] - first[active[i]];
    }
  }

  void Plan(int threads) {
    const int64_t hidden = layer_.hidden, inter = layer_.inter;
    const CpuKernel family = SelectedCpuKernel();
    size_t arena = 0;
    const auto reserve = [&](size_t bytes) {
      const size_t at = arena;
      arena += Aligned(bytes);
      return at;
    };
    for (int64_t i = 0; i < n_plans_; ++i) {
      ExpertPlan& p = plans_[i];
      p.kernel = &SelectKernel(family, layer_, p.count);
      p.packed_in = reserve(p.kernel->packed_bytes(layer_, p.count, hidden));
      p.act = reserve(p.count * inter * sizeof(float));
      p.packed_act = reserve(p.kernel->packed_bytes(layer_, p.count, inter));
    }
    const int64_t y_elements = call_.tokens * hidden;
    y_acc_offset_ = reserve(call_.y_bf16 ? y_elements * sizeof(float) : 0);
    arena_ = ArenaBuffer().Get(arena + kAlign);
    y_acc_ = call_.y_bf16 ? reinterpret_cast<float*>(arena_ + y_acc_offset_) : static_cast<float*>(call_.y);

    lists_.assign(kPhases, std::vector<std::vector<int64_t>>(nodes_));
    const auto add = [&](int phase, int node, Task task) {
      lists_[phase][node].push_back(static_cast<int64_t>(tasks_.size()));
      tasks_.push_back(task);
    };
    for (int64_t i = 0; i < n_plans_; ++i) add(0, i % nodes_, {TaskKind::kPack, i, 0, 0, 0});
    constexpr int64_t kChunk = 1 << 16;  // elements per zeroing / conversion task
    for (int64_t b = 0, c = 0; b < y_elements; b += kChunk, ++c) {
      add(0, c % nodes_, {TaskKind::kZero, 0, b, std::min(y_elements, b + kChunk), 0});
      ++zero_left_;
    }
    for (int64_t i = 0; i < n_plans_ && n_plans_ * kThreadsPerSharedPack <= threads; ++i) {
      ExpertPlan& p = plans_[i];
      if (!p.kernel->packs_in_token_ranges || p.count < kSharedPackTokens) continue;
      const int64_t part = RoundUp(std::max<int64_t>(kSharedPackPart, p.count / threads), p.kernel->pad);
      for (int64_t t = 0, c = 0; t < p.count; t += part, ++c) {
        add(2, (i + c) % nodes_, {TaskKind::kPackAct, i, t, std::min(p.count, t + part), 0});
        ++p.pack_act_left;
      }
      p.pack_shared = true;
    }
    const auto gate_up = Slices(inter, nodes_, SliceRows(inter, n_plans_, threads));
    const auto down = Slices(hidden, nodes_, SliceRows(hidden, n_plans_, threads));
    for (int n = 0; n < nodes_; ++n) {
      for (int64_t i = 0; i < n_plans_; ++i) {
        for (const auto& [begin, end] : gate_up[n]) {
          add(1, n, {TaskKind::kGateUp, i, begin, end, 0});
          ++plans_[i].gate_up_left;
        }
      }
    }
    int64_t n_slices = 0;
    for (int n = 0; n < nodes_; ++n) n_slices += static_cast<int64_t>(down[n].size());
    turns_ = std::make_unique<std::atomic<int64_t>[]>(n_slices);
    for (int64_t l = 0; l < n_slices; ++l) turns_[l].store(0);
    for (int n = 0, slice_base = 0; n < nodes_; slice_base += static_cast<int>(down[n].size()), ++n) {
      for (int64_t i = 0; i < n_plans_; ++i) {
        for (size_t s = 0; s < down[n].size(); ++s) {
          add(3, n, {TaskKind::kDown, i, down[n][s].first, down[n][s].second, slice_base + static_cast<int64_t>(s)});
          ++down_left_;
        }
      }
    }
    if (call_.y_bf16) {
      for (int64_t b = 0, c = 0; b < y_elements; b += kChunk, ++c) {
        add(4, c % nodes_, {TaskKind::kConvert, 0, b, std::min(y_elements, b + kChunk), 0});
      }
    }
  }

  // The caller thread's arena: reused across calls, never shared between two running calls.
  static Buffer& ArenaBuffer() {
    thread_local Buffer buffer;
    return buffer;
  }

  void RunTask(int64_t id) {
    const Task& task = tasks_[id];
    try {
      if (!failed_.load(std::memory_order_relaxed)) Compute(task);
    } catch (...) {
      failed_.store(true);
      Release(task);
      throw;
    }
    Release(task);
  }

  // Bookkeeping that must happen whether or not the task's work succeeded, so no task waits forever.
  void Release(const Task& task) {
    switch (task.kind) {
      case TaskKind::kPack:
        plans_[task.plan].input_ready.store(true, std::memory_order_release);
        break;
      case TaskKind::kZero:
        zero_left_.fetch_sub(1, std::memory_order_acq_rel);
        break;
      case TaskKind::kGateUp: {
        ExpertPlan& p = plans_[task.plan];
        // The last gate/up task of an expert packs its activations, unless threads share the pack.
        if (p.gate_up_left.fetch_sub(1, std::memory_order_acq_rel) == 1 && !p.pack_shared) {
          try {
            if (!failed_.load(std::memory_order_relaxed)) PackAct(p, 0, p.count);
          } catch (...) {
            failed_.store(true);
            p.act_ready.store(true, std::memory_order_release);
            throw;
          }
          p.act_ready.store(true, std::memory_order_release);
        }
        break;
      }
      case TaskKind::kPackAct: {
        ExpertPlan& p = plans_[task.plan];
        if (p.pack_act_left.fetch_sub(1, std::memory_order_acq_rel) == 1) {
          p.act_ready.store(true, std::memory_order_release);
        }
        break;
      }
      case TaskKind::kDown:
        WaitForTurn(task);  // already ours if the work ran; waited for here if it failed or was skipped
        turns_[task.slice].store(task.plan + 1, std::memory_order_release);
        down_left_.fetch_sub(1, std::memory_order_acq_rel);
        break;
      case TaskKind::kConvert:
        break;
    }
  }

  // Packs the expert's activations of tokens [begin, end) for the down projection (begin > 0 only where the
  // kernel packs in token ranges).
  void PackAct(const ExpertPlan& p, int64_t begin, int64_t end) {
    ActivationRows rows;
    rows.base = arena_ + p.act + begin * layer_.inter * sizeof(float);
    rows.stride = layer_.inter;
    rows.count = end - begin;
    p.kernel->pack(layer_, rows, layer_.inter, arena_ + p.packed_act + p.kernel->packed_bytes(layer_, begin, layer_.inter));
  }

  static float* Scratch(size_t floats) {
    thread_local Buffer buffer;
    return reinterpret_cast<float*>(buffer.Get(floats * sizeof(float)));
  }

  void Compute(const Task& task) {
    switch (task.kind) {
      case TaskKind::kPack: {
        const ExpertPlan& p = plans_[task.plan];
        ActivationRows rows;
        rows.base = call_.x;
        rows.bf16 = call_.x_bf16;
        rows.stride = layer_.hidden;
        rows.index = route_token_.data() + p.first;
        rows.count = p.count;
        p.kernel->pack(layer_, rows, layer_.hidden, arena_ + p.packed_in);
        return;
      }
      case TaskKind::kZero:
        std::fill(y_acc_ + task.begin, y_acc_ + task.end, 0.0f);
        return;
      case TaskKind::kGateUp:
        GateUp(task);
        return;
      case TaskKind::kPackAct: {
        const ExpertPlan& p = plans_[task.plan];
        SpinUntil([&] { return p.gate_up_left.load(std::memory_order_acquire) == 0; });
        if (!failed_.load()) PackAct(p, task.begin, task.end);
        return;
      }
      case TaskKind::kDown:
        Down(task);
        return;
      case TaskKind::kConvert: {
        SpinUntil([&] { return down_left_.load(std::memory_order_acquire) == 0; });
        if (failed_.load()) return;
        auto* y = static_cast<uint16_t*>(call_.y);
        for (int64_t i = task.begin; i < task.end; ++i) y[i] = FloatToBf16Bits(y_acc_[i]);
        return;
      }
    }
  }

  void GateUp(const Task& task) {
    ExpertPlan& p = plans_[task.plan];
    SpinUntil([&] { return p.input_ready.load(std::memory_order_acquire); });
    if (failed_.load()) return;
    const int64_t rows = task.end - task.begin;
    const int64_t pad = p.kernel->pad;
    const int64_t stride = RoundUp(p.count, pad);
    const int64_t block = RoundUp(rows, pad) * stride;
    float* scratch = Scratch(5 * block);
    float* gate = scratch;
    float* up = scratch + block;
    float* fused = scratch + 2 * block;
    const ExpertWeights& w = layer_.experts[p.expert];
    const Projection gate_proj = ExpertProjection(layer_, p.expert, Matrix::kGate);
    if (layer_.gate_up_interleaved) {
      // Rows 2r and 2r + 1 of the stored matrix are gate and up row r: one projection of twice the rows,
      // split after.
      float* both = scratch + 3 * block;
      p.kernel->gemm(layer_, &gate_proj, 1, 2 * task.begin, 2 * rows, arena_ + p.packed_in, p.count, &both, stride);
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(gate + r * stride, both + 2 * r * stride, p.count * sizeof(float));
        std::memcpy(up + r * stride, both + (2 * r + 1) * stride, p.count * sizeof(float));
      }
      if (layer_.biased) {
        AddRowBias(w.gate_bias + 2 * task.begin, 2, rows, p.count, stride, gate);
        AddRowBias(w.gate_bias + 2 * task.begin + 1, 2, rows, p.count, stride, up);
      }
    } else {
      float* out[2] = {gate, up};
      const Projection proj[2] = {gate_proj, ExpertProjection(layer_, p.expert, Matrix::kUp)};
      p.kernel->gemm(layer_, proj, 2, task.begin, rows, arena_ + p.packed_in, p.count, out, stride);
      if (layer_.biased) {
        AddRowBias(w.gate_bias + task.begin, 1, rows, p.count, stride, gate);
        AddRowBias(w.up_bias + task.begin, 1, rows, p.count, stride, up);
      }
    }
    Activate(layer_.activation, gate, up, rows * stride, fused);
    // Transposed into the expert's [tokens, inter] activations 16 rows at a time: each token's 16 values are
    // one contiguous store, and the 16 rows read stay in L1 across the tokens.
    auto* act = reinterpret_cast<float*>(arena_ + p.act);
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
      const int64_t r1 = std::min(rows, r0 + 16);
      for (int64_t t = 0; t < p.count; ++t) {
        float* dst = act + t * layer_.inter + task.begin;
        for (int64_t r = r0; r < r1; ++r) dst[r] = fused[r * stride + t];
      }
    }
  }

  void Down(const Task& task) {
    ExpertPlan& p = plans_[task.plan];
    SpinUntil([&] {
      return p.act_ready.load(std::memory_order_acquire) && zero_left_.load(std::memory_order_acquire) == 0;
    });
    if (failed_.load()) return;
    const int64_t rows = task.end - task.begin;
    const int64_t stride = RoundUp(p.count, p.kernel->pad);
    float* out = Scratch(RoundUp(rows, p.kernel->pad) * stride);
    const Projection proj = ExpertProjection(layer_, p.expert, Matrix::kDown);
    p.kernel->gemm(layer_, &proj, 1, task.begin, rows, arena_ + p.packed_act, p.count, &out, stride);
    if (layer_.biased) AddRowBias(layer_.experts[p.expert].down_bias + task.begin, 1, rows, p.count, stride, out);
    // Each row slice sums the experts in plan order, whatever order their tasks finish in: the same
    // inputs always give the same bits (greedy decoding is deterministic). Release passes the turn on.
    WaitForTurn(task);
    for (int64_t t = 0; t < p.count; ++t) {
      const float weight = route_weight_[p.first + t];
      float* y = y_acc_ + route_token_[p.first + t] * layer_.hidden + task.begin;
      for (int64_t r = 0; r < rows; ++r) y[r] += weight * out[r * stride + t];
    }
  }

  void WaitForTurn(const Task& task) {
    SpinUntil([&] { return turns_[task.slice].load(std::memory_order_acquire) == task.plan; });
  }

  const LayerWeights& layer_;
  const MoeCall& call_;
  const int nodes_;
  std::vector<int64_t> route_token_;
  std::vector<float> route_weight_;
  std::unique_ptr<ExpertPlan[]> plans_;
  int64_t n_plans_ = 0;
  std::vector<Task> tasks_;
  std::vector<std::vector<std::vector<int64_t>>> lists_;
  std::unique_ptr<std::atomic<int64_t>[]> turns_;  // per down row slice: the plan whose turn it is to add
  char* arena_ = nullptr;
  size_t y_acc_offset_ = 0;
  float* y_acc_ = nullptr;
  std::atomic<int64_t> zero_left_{0};
  std::atomic<int64_t> down_left_{0};
  std::atomic<bool> failed_{false};
};

}  // namespace

std::string RunRoutedExperts(const LayerWeights& layer, const MoeCall& call) {
  if (call.tokens == 0) return "";
  try {
    std::shared_ptr<ThreadPool> pool = ThreadPool::Global();
    MoeJob job(layer, call, *pool);
    return job.Run(*pool);
  } catch (const std::exception& e) {
    return e.what();
  }
}

}  // namespace hybridjit
