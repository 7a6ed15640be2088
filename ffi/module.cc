// Python module hybridjit_ffi, the compiled half of hybridjit (a top-level module of its own, as jaxlib is to
// jax, so the pure-Python source tree imports anywhere): the weight bank and the FFI handler capsules.
// Private: it trusts hybridjit.ops.routed_experts to validate shapes and dtypes and to keep the weights alive.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <nanobind/stl/tuple.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "routed_experts_async.h"
#include "cpu_attention.h"
#include "cpu_features.h"
#include "expert_kernels.h"
#include "membench.h"
#include "moe_operator.h"
#include "mxfp4_layout.h"
#include "routed_experts_handler.h"
#include "thread_pool.h"
#include "weight_bank.h"
#include "weight_prefetch.h"
#ifdef HYBRIDJIT_WITH_CUDA
#include "gpu_handoff.h"
#endif

namespace nb = nanobind;

namespace hybridjit {
namespace {

WeightFormat ParseFormat(const std::string& name) {
  if (name == "f32") return WeightFormat::kF32;
  if (name == "bf16") return WeightFormat::kBf16;
  if (name == "fp8") return WeightFormat::kFp8E4M3Fn;
  if (name == "int8") return WeightFormat::kInt8;
  if (name == "int4") return WeightFormat::kInt4;
  if (name == "mxfp4") return WeightFormat::kMxfp4;
  if (name == "q8_0") return WeightFormat::kQ8_0;
  if (name == "q4_k") return WeightFormat::kQ4K;
  if (name == "q5_k") return WeightFormat::kQ5K;
  if (name == "q6_k") return WeightFormat::kQ6K;
  if (name == "q2_k") return WeightFormat::kQ2K;
  if (name == "q3_k") return WeightFormat::kQ3K;
  if (name == "iq4_xs") return WeightFormat::kIq4Xs;
  throw std::invalid_argument("unknown weight format '" + name +
                              "' (expected f32, bf16, fp8, int8, int4, mxfp4, q8_0, q4_k, q5_k, q6_k, q2_k, q3_k or "
                              "iq4_xs)");
}

GluActivation ParseActivation(const std::string& name, float alpha, float limit) {
  if (name == "silu") return {};
  if (name == "clamped_swiglu") return {GluActivation::Kind::kClampedSwiglu, alpha, limit};
  throw std::invalid_argument("unknown activation '" + name + "' (expected silu or clamped_swiglu)");
}

template <typename T>
const T* AsPointer(uintptr_t address) {
  return reinterpret_cast<const T*>(address);
}

// Addresses arrive as integers (numpy's ctypes.data) so that any host memory can be registered,
// whatever its dtype or owner; the scale lists are empty for f32 and bf16, the bias lists for unbiased layers,
// and the up lists for layers whose gate matrices interleave the up rows.
using Addresses = std::vector<uintptr_t>;

int64_t RegisterLayer(const std::string& format, int64_t hidden, int64_t inter, int64_t block_rows,
                      int64_t block_cols, const Addresses& gate, const Addresses& up, const Addresses& down,
                      const Addresses& gate_scale, const Addresses& up_scale, const Addresses& down_scale,
                      const Addresses& gate_bias, const Addresses& up_bias, const Addresses& down_bias,
                      bool gate_up_interleaved, const std::string& activation, float alpha, float limit,
                      const std::string& down_format) {
  LayerWeights layer;
  layer.format = ParseFormat(format);
  if (!down_format.empty() && down_format != format) layer.down_format = ParseFormat(down_format);
  layer.hidden = hidden;
  layer.inter = inter;
  layer.block_rows = block_rows;
  layer.block_cols = block_cols;
  layer.gate_up_interleaved = gate_up_interleaved;
  layer.biased = !gate_bias.empty();
  layer.activation = ParseActivation(activation, alpha, limit);
  const size_t n = gate.size();
  const bool scaled = layer.scaled();
  const size_t n_scales = scaled ? n : 0;
  const size_t n_up = gate_up_interleaved ? 0 : n;
  const size_t n_biases = layer.biased ? n : 0;
  if (up.size() != n_up || down.size() != n || gate_scale.size() != n_scales ||
      up_scale.size() != std::min(n_scales, n_up) || down_scale.size() != n_scales || gate_bias.size() != n_biases ||
      up_bias.size() != std::min(n_biases, n_up) || down_bias.size() != n_biases) {
    throw std::invalid_argument("pointer lists disagree in length");
  }
  layer.experts.resize(n);
  for (size_t e = 0; e < n; ++e) {
    ExpertWeights& w = layer.experts[e];
    w.gate = AsPointer<void>(gate[e]);
    w.down = AsPointer<void>(down[e]);
    if (n_up) w.up = AsPointer<void>(up[e]);
    if (scaled) {
      w.gate_scale = AsPointer<void>(gate_scale[e]);
      w.down_scale = AsPointer<void>(down_scale[e]);
      if (n_up) w.up_scale = AsPointer<void>(up_scale[e]);
    }
    if (layer.biased) {
      w.gate_bias = AsPointer<float>(gate_bias[e]);
      w.down_bias = AsPointer<float>(down_bias[e]);
      if (n_up) w.up_bias = AsPointer<float>(up_bias[e]);
    }
  }
  // An fp8 layer's registration reads every weight once (its special codes): seconds for a large layer.
  nb::gil_scoped_release release;
  return WeightBank::Global().Add(std::move(layer));
}

bool UnregisterLayer(int64_t id) {
  // Waits for running kernels on this layer, which do not need the GIL.
  nb::gil_scoped_release release;
  return WeightBank::Global().Remove(id);
}

nb::dict KernelInfo() {
  const CpuKernel family = SelectedCpuKernel();
  const std::shared_ptr<ThreadPool> pool = ThreadPool::Global();
  nb::dict info;
  info["kernel"] = CpuKernelName(family);
  info["best"] = CpuKernelName(BestCpuKernel());
  nb::list supported;
  for (CpuKernel k : {CpuKernel::kGeneric, CpuKernel::kAvx2, CpuKernel::kAvx512, CpuKernel::kAmx}) {
    if (CpuKernelSupported(k)) supported.append(CpuKernelName(k));
  }
  info["supported"] = supported;
  info["threads"] = pool->threads();
  info["pool_spin_us"] = pool->spin_us();
  info["numa_nodes"] = pool->nodes();
  info["submitter_cpu"] = pool->submitter_cpu();
  info["numa_forced"] = pool->nodes_forced();
  info["amx_min_tokens"] = AmxMinTokensOverride();
  info["gguf_tile_min_tokens"] = GgufTileMinTokensOverride();
  info["prefetch_bytes"] = WeightPrefetchBytes();  // in effect: the override or the measured default
  // Per format (fp8 with 128 x 128 blocks, int8/int4 with 128-column groups), the kernel that runs an expert with
  // one token and one with very many; layer_kernel answers for a registered layer and a token count.
  nb::dict formats;
  for (WeightFormat f : {WeightFormat::kF32, WeightFormat::kBf16, WeightFormat::kFp8E4M3Fn, WeightFormat::kInt8,
                         WeightFormat::kInt4, WeightFormat::kMxfp4, WeightFormat::kQ8_0, WeightFormat::kQ4K,
                         WeightFormat::kQ5K, WeightFormat::kQ6K, WeightFormat::kQ2K, WeightFormat::kQ3K,
                         WeightFormat::kIq4Xs}) {
    LayerWeights layer;
    layer.format = f;
    layer.hidden = layer.inter = 256;  // a multiple of every format's block (kIntGroupQuantum, 32, 256)
    layer.block_rows = f == WeightFormat::kFp8E4M3Fn ? 128 : 1;
    layer.block_cols = f == WeightFormat::kMxfp4 ? kMxfp4Block : 128;
    nb::dict entry;
    entry["few_tokens"] = SelectKernel(family, layer, 1).name;
    entry["many_tokens"] = SelectKernel(family, layer, 1 << 20).name;
    formats[WeightFormatName(f)] = entry;
  }
  info["formats"] = formats;
  return info;
}

void SetCpuKernelByName(const std::string& name) { SetCpuKernel(ParseCpuKernel(name)); }

// The operator on host arrays, without XLA (tests and benchmarks); the Python wrapper checks the arrays.
void RunLayer(int64_t id, uintptr_t x, bool bf16, uintptr_t ids, uintptr_t weights, int64_t tokens, int64_t top_k,
              uintptr_t y) {
  std::string error;
  {
    nb::gil_scoped_release release;
    const LayerLease lease = WeightBank::Global().Find(id);
    if (!lease) {
      error = "unknown layer id " + std::to_string(id);
    } else {
      const auto* id_data = AsPointer<int32_t>(ids);
      for (int64_t i = 0; i < tokens * top_k && error.empty(); ++i) {
        if (id_data[i] < 0 || id_data[i] >= lease.weights().n_experts()) {
          error = "expert id " + std::to_string(id_data[i]) + " out of range";
        }
      }
      if (error.empty()) {
        MoeCall call;
        call.x = AsPointer<void>(x);
        call.x_bf16 = call.y_bf16 = bf16;
        call.ids = id_data;
        call.weights = AsPointer<float>(weights);
        call.tokens = tokens;
        call.top_k = top_k;
        call.y = reinterpret_cast<void*>(y);
        error = RunRoutedExperts(lease.weights(), call);
      }
    }
  }
  if (!error.empty()) throw std::runtime_error(error);
}

std::string LayerKernel(int64_t id, int64_t tokens) {
  const LayerLease lease = WeightBank::Global().Find(id);
  if (!lease) throw std::invalid_argument("unknown layer id " + std::to_string(id));
  return SelectKernel(SelectedCpuKernel(), lease.weights(), tokens).name;
}

void ConfigureThreads(int threads, int numa_nodes) {
  if (threads < 0 || numa_nodes < 0) throw std::invalid_argument("threads and numa_nodes must be >= 0");
  nb::gil_scoped_release release;
  ThreadPool::ConfigureGlobal(threads, numa_nodes);
}

nb::dict MemoryBandwidthDict(int64_t bytes, int repeats, int threads) {
  MemoryBandwidth m;
  {
    nb::gil_scoped_release release;
    m = MeasureMemoryBandwidth(bytes, repeats, threads);
  }
  nb::dict out;
  out["read_gbps"] = m.read_gbps;
  out["read_pattern"] = m.read_pattern;
  nb::dict by_pattern;
  for (size_t i = 0; i < std::size(kReadPatterns); ++i) by_pattern[kReadPatterns[i].name] = m.read_by_pattern_gbps[i];
  out["read_by_pattern_gbps"] = by_pattern;
  out["triad_gbps"] = m.triad_gbps;
  out["threads"] = m.threads;
  out["bytes_per_array"] = m.bytes;
  return out;
}

// ---- decode attention over a host KV cache (cpu_attention.h) ----

// Any host array; checked by the functions below so that a mismatch names the argument (a typed ndarray
// parameter would fail overload resolution with a message that names none).
using HostArray = nb::ndarray<nb::ro>;
using HostOutput = nb::ndarray<>;

// The shape the kernels index by, C-contiguous, in host memory; ValueError or TypeError naming the argument.
template <typename Array>
void CheckLayout(const char* name, const Array& a, const std::vector<int64_t>& shape) {
  if (a.device_type() != nb::device::cpu::value) {
    throw nb::type_error((std::string(name) + " must be in host memory").c_str());
  }
  auto shape_text = [](auto size, auto dim) {
    std::string text = "(";
    for (size_t i = 0; i < size; ++i) text += (i ? ", " : "") + std::to_string(dim(i));
    return text + (size == 1 ? ",)" : ")");
  };
  const std::string actual = shape_text(a.ndim(), [&](size_t i) { return static_cast<int64_t>(a.shape(i)); });
  const std::string expected = shape_text(shape.size(), [&](size_t i) { return shape[i]; });
  if (actual != expected) {
    throw std::invalid_argument(std::string(name) + " has shape " + actual + ", expected " + expected);
  }
  int64_t step = 1;  // elements between consecutive indices of the current dimension when C-contiguous
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) > 1 && a.stride(i) != step) {
      throw std::invalid_argument(std::string(name) + " must be C-contiguous");
    }
    step *= static_cast<int64_t>(a.shape(i));
  }
}

// ---- ggml MXFP4 blocks in the release's layout (mxfp4_layout.h) ----

void Mxfp4FromGgmlArrays(const HostArray& src, HostOutput& blocks, HostOutput& scales) {
  const auto u8 = nb::dtype<uint8_t>();
  if (src.dtype() != u8 || blocks.dtype() != u8 || scales.dtype() != u8) {
    throw nb::type_error("src, blocks and scales must be uint8");
  }
  if (src.ndim() != 2 || src.shape(1) != 17) throw std::invalid_argument("src must be [n, 17] (ggml MXFP4 blocks)");
  const int64_t n = static_cast<int64_t>(src.shape(0));
  CheckLayout("src", src, {n, 17});
  CheckLayout("blocks", blocks, {n, 16});
  CheckLayout("scales", scales, {n});
  Mxfp4FromGgml(static_cast<const uint8_t*>(src.data()), n, static_cast<uint8_t*>(blocks.data()),
                static_cast<uint8_t*>(scales.data()));
}

bool IsFloat32(const nb::dlpack::dtype& t) { return t == nb::dtype<float>(); }

// numpy hands ml_dtypes.bfloat16 arrays to no C extension (DLPack and the buffer protocol lack the type), so
// a bfloat16 cache comes as uint16 bits (hybridjit.ops.cpu_attention views it so); a DLPack producer that
// has the type (JAX, PyTorch) can pass bfloat16 itself.
bool IsBf16(const nb::dlpack::dtype& t) {
  const nb::dlpack::dtype bfloat16{static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
  return t == nb::dtype<uint16_t>() || t == bfloat16;
}

void CheckFloat32(const char* name, const nb::dlpack::dtype& t) {
  if (!IsFloat32(t)) throw nb::type_error((std::string(name) + " must be float32").c_str());
}

// The element type of the cache arrays named in `names`, which must all have the first one's.
CacheDtype CacheDtypeOf(const std::vector<std::pair<const char*, nb::dlpack::dtype>>& arrays) {
  const nb::dlpack::dtype first = arrays[0].second;
  if (!IsFloat32(first) && !IsBf16(first)) {
    throw nb::type_error((std::string(arrays[0].first) + " must be float32, or bfloat16 (as its uint16 bits)").c_str());
  }
  for (const auto& [name, t] : arrays) {
    if (!(IsFloat32(first) ? IsFloat32(t) : IsBf16(t))) {
      throw nb::type_error((std::string(name) + " must have " + arrays[0].first + "'s dtype").c_str());
    }
  }
  return IsFloat32(first) ? CacheDtype::kF32 : CacheDtype::kBf16;
}

void CheckLengthsArray(const HostArray& lengths, int64_t batch) {
  if (lengths.dtype() != nb::dtype<int32_t>()) throw nb::type_error("lengths must be int32");
  CheckLayout("lengths", lengths, {batch});
}

void CpuAttentionGqa(const HostArray& q, const HostArray& k, const HostArray& v, const HostArray& lengths, float scale,
                     const HostArray& sinks, HostOutput& out) {
  if (q.ndim() != 3) throw std::invalid_argument("q must be [batch, heads, head_dim]");
  if (k.ndim() != 4) throw std::invalid_argument("k must be [batch, max_len, kv_heads, head_dim]");
  GqaDecodeCall call;
  call.batch = static_cast<int64_t>(q.shape(0));
  call.heads = static_cast<int64_t>(q.shape(1));
  call.head_dim = static_cast<int64_t>(q.shape(2));
  call.max_len = static_cast<int64_t>(k.shape(1));
  call.kv_heads = static_cast<int64_t>(k.shape(2));
  CheckFloat32("q", q.dtype());
  CheckLayout("q", q, {call.batch, call.heads, call.head_dim});
  call.cache = CacheDtypeOf({{"k", k.dtype()}, {"v", v.dtype()}});
  CheckLayout("k", k, {call.batch, call.max_len, call.kv_heads, call.head_dim});
  CheckLayout("v", v, {call.batch, call.max_len, call.kv_heads, call.head_dim});
  CheckLengthsArray(lengths, call.batch);
  CheckFloat32("out", out.dtype());
  CheckLayout("out", out, {call.batch, call.heads, call.head_dim});
  call.q = static_cast<const float*>(q.data());
  call.k = k.data();
  call.v = v.data();
  call.lengths = static_cast<const int32_t*>(lengths.data());
  call.scale = scale;
  if (sinks.size() != 0) {  // empty: none
    CheckFloat32("sinks", sinks.dtype());
    CheckLayout("sinks", sinks, {call.heads});
    call.sinks = static_cast<const float*>(sinks.data());
  }
  call.out = static_cast<float*>(out.data());
  if (std::string error = CheckGqaDecode(call); !error.empty()) throw std::invalid_argument(error);
  std::string error;
  {
    nb::gil_scoped_release release;
    error = RunGqaDecode(call);
  }
  if (!error.empty()) throw std::runtime_error(error);
}

void CpuAttentionMla(const HostArray& q_latent, const HostArray& q_rope, const HostArray& latent,
                     const HostArray& k_rope, const HostArray& lengths, float scale, HostOutput& out) {
  if (q_latent.ndim() != 3) throw std::invalid_argument("q_latent must be [batch, heads, rank]");
  if (q_rope.ndim() != 3) throw std::invalid_argument("q_rope must be [batch, heads, rope_dim]");
  if (latent.ndim() != 3) throw std::invalid_argument("latent must be [batch, max_len, rank]");
  MlaDecodeCall call;
  call.batch = static_cast<int64_t>(q_latent.shape(0));
  call.heads = static_cast<int64_t>(q_latent.shape(1));
  call.rank = static_cast<int64_t>(q_latent.shape(2));
  call.rope_dim = static_cast<int64_t>(q_rope.shape(2));
  call.max_len = static_cast<int64_t>(latent.shape(1));
  CheckFloat32("q_latent", q_latent.dtype());
  CheckLayout("q_latent", q_latent, {call.batch, call.heads, call.rank});
  CheckFloat32("q_rope", q_rope.dtype());
  CheckLayout("q_rope", q_rope, {call.batch, call.heads, call.rope_dim});
  call.cache = CacheDtypeOf({{"latent", latent.dtype()}, {"k_rope", k_rope.dtype()}});
  CheckLayout("latent", latent, {call.batch, call.max_len, call.rank});
  CheckLayout("k_rope", k_rope, {call.batch, call.max_len, call.rope_dim});
  CheckLengthsArray(lengths, call.batch);
  CheckFloat32("out", out.dtype());
  CheckLayout("out", out, {call.batch, call.heads, call.rank});
  call.q_latent = static_cast<const float*>(q_latent.data());
  call.q_rope = static_cast<const float*>(q_rope.data());
  call.latent = latent.data();
  call.k_rope = k_rope.data();
  call.lengths = static_cast<const int32_t*>(lengths.data());
  call.scale = scale;
  call.out = static_cast<float*>(out.data());
  if (std::string error = CheckMlaDecode(call); !error.empty()) throw std::invalid_argument(error);
  std::string error;
  {
    nb::gil_scoped_release release;
    error = RunMlaDecode(call);
  }
  if (!error.empty()) throw std::runtime_error(error);
}

}  // namespace
}  // namespace hybridjit

NB_MODULE(hybridjit_ffi, m) {
  using namespace hybridjit;
  m.doc() = "hybridjit C++ extension: routed-expert weight bank and XLA FFI handlers (private API).";
  m.def("register_layer", &RegisterLayer, nb::arg("format"), nb::arg("hidden"), nb::arg("inter"),
        nb::arg("block_rows"), nb::arg("block_cols"), nb::arg("gate"), nb::arg("up"), nb::arg("down"),
        nb::arg("gate_scale"), nb::arg("up_scale"), nb::arg("down_scale"), nb::arg("gate_bias"), nb::arg("up_bias"),
        nb::arg("down_bias"), nb::arg("gate_up_interleaved"), nb::arg("activation"), nb::arg("alpha"), nb::arg("limit"),
        nb::arg("down_format") = "",
        "Registers a layer from weight addresses; returns its id (never reused). down_format: GGUF layers whose "
        "down projections are in another block format.");
  m.def("unregister_layer", &UnregisterLayer, nb::arg("id"),
        "Removes a layer once its running calls finish; False if the id is unknown.");
  m.def("registered_layer_ids", [] { return WeightBank::Global().Ids(); });
  m.def("kernel_info", &KernelInfo, "The CPU kernel family in use, the host's, threads, and per format kernel names.");
  m.def("run_layer", &RunLayer, nb::arg("id"), nb::arg("x"), nb::arg("bf16"), nb::arg("ids"), nb::arg("weights"),
        nb::arg("tokens"), nb::arg("top_k"), nb::arg("y"), "The routed-experts operator on host memory addresses.");
  m.def("layer_kernel", &LayerKernel, nb::arg("id"), nb::arg("tokens"),
        "The kernel that runs an expert of a registered layer with `tokens` tokens in a call.");
  m.def("set_cpu_kernel", &SetCpuKernelByName, nb::arg("name"),
        "Selects the kernel family (generic, avx2, avx512, amx); ValueError if the host lacks it.");
  m.def("set_amx_min_tokens", &SetAmxMinTokens, nb::arg("tokens"),
        "With the amx family, experts with at least this many tokens use AMX, the others AVX-512 (0: per-layer defaults).");
  m.def("set_gguf_tile_min_tokens", &SetGgufTileMinTokens, nb::arg("tokens"),
        "With the avx512 family, GGUF experts with at least this many tokens use the tile kernel (0: the default).");
  m.def("set_prefetch_bytes", &SetWeightPrefetchOverride, nb::arg("bytes"),
        "How far ahead along each weight row the AVX2 and AVX-512 kernels prefetch (0: off; -1: the default).");
  m.def("configure_threads", &ConfigureThreads, nb::arg("threads"), nb::arg("numa_nodes"),
        "Replaces the CPU thread pool (0 = the machine's default for either).");
  m.def("memory_bandwidth", &MemoryBandwidthDict, nb::arg("bytes"), nb::arg("repeats"), nb::arg("threads"),
        "Read-sum (best of several read patterns) and STREAM-triad bandwidth (GB/s) over arrays of `bytes`, "
        "best of `repeats`.");
  nb::class_<MemoryReader>(m, "MemoryReader",
                           "A resident array read in one pass per call: the read floor, taken next to each case.")
      .def(nb::init<int64_t, int>(), nb::arg("bytes"), nb::arg("threads"))
      .def("read_gbps", [](MemoryReader& r, const std::string& pattern) {
        nb::gil_scoped_release release;
        return r.ReadGbps(pattern);
      }, nb::arg("pattern"), "One read pass in a pattern of memory_bandwidth's read_by_pattern_gbps; GB/s.");
  m.def("cpu_attention_gqa", &CpuAttentionGqa, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("lengths"),
        nb::arg("scale"), nb::arg("sinks"), nb::arg("out"),
        "Decode GQA over a host KV cache into out [batch, heads, head_dim] (float32): q float32 [batch, heads, "
        "head_dim]; k, v [batch, max_len, kv_heads, head_dim] float32 or bfloat16 (as uint16 bits); lengths int32 "
        "[batch]; sinks float32 [heads] (a logit per head in each softmax), or empty for none. Every array "
        "C-contiguous.");
  m.def("cpu_attention_mla", &CpuAttentionMla, nb::arg("q_latent"), nb::arg("q_rope"), nb::arg("latent"),
        nb::arg("k_rope"), nb::arg("lengths"), nb::arg("scale"), nb::arg("out"),
        "Decode absorbed MLA over a host latent cache into out [batch, heads, rank] (float32): q_latent, q_rope "
        "float32 [batch, heads, rank | rope_dim]; latent, k_rope [batch, max_len, rank | rope_dim] float32 or "
        "bfloat16 (as uint16 bits); lengths int32 [batch]. Every array C-contiguous.");
  m.def("mxfp4_from_ggml", &Mxfp4FromGgmlArrays, nb::arg("src"), nb::arg("blocks"), nb::arg("scales"),
        "ggml's MXFP4 blocks src uint8 [n, 17] into the gpt-oss release's layout: blocks uint8 [n, 16] (element 2j "
        "in the low nibble of byte j) and scales uint8 [n]. Every array C-contiguous.");
  m.def("routed_experts_cpu", [] { return nb::capsule(reinterpret_cast<void*>(&HybridjitRoutedExpertsCpu)); },
        "FFI handler capsule for platform 'cpu'.");
  m.def("routed_experts_submit_cpu",
        [] { return nb::capsule(reinterpret_cast<void*>(&HybridjitRoutedExpertsSubmitCpu)); });
  m.def("routed_experts_wait_cpu", [] { return nb::capsule(reinterpret_cast<void*>(&HybridjitRoutedExpertsWaitCpu)); });
#ifdef HYBRIDJIT_WITH_CUDA
  m.attr("has_cuda") = true;
  m.def("routed_experts_cuda", [] { return nb::capsule(reinterpret_cast<void*>(&HybridjitRoutedExpertsCuda)); });
  m.def("routed_experts_submit_cuda",
        [] { return nb::capsule(reinterpret_cast<void*>(&HybridjitRoutedExpertsSubmitCuda)); });
  m.def("routed_experts_wait_cuda",
        [] { return nb::capsule(reinterpret_cast<void*>(&HybridjitRoutedExpertsWaitCuda)); });
  m.def("take_gpu_error", &TakeGpuHandoffError,
        "The first error of a CPU job run for the GPU since the last call, or ''.");
  m.def("gpu_handoff_mode", [] { return std::string(GpuHandoffMode()); });
  m.def("take_gpu_handoff_stats", [] {
    const GpuHandoffStats stats = TakeGpuHandoffStats();
    return nb::make_tuple(stats.jobs, stats.job_seconds, stats.handler_runs);
  }, "(CPU jobs run for the GPU, seconds in them, CUDA handler body runs) since the last call.");
#else
  m.attr("has_cuda") = false;
#endif
}
