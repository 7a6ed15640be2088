// Decode attention on the CPU over a KV cache held in host memory: one new query token per row, against the
// keys and values that row has cached, for the two attention kinds the models use (grouped-query attention, and
// DeepSeek's multi-head latent attention in its absorbed form).
//
// Everything is float32 arithmetic with float32 accumulation; a bfloat16 cache is widened to float32 exactly.
// The softmax is online (a running max per head, rescaling the sums when it grows), so memory does not grow
// with the cache length. The work runs on ThreadPool::Global(), with the AVX-512 kernels from the avx512
// family (cpu_features.h) up and portable C++ below.
#pragma once

#include <cstdint>
#include <string>

namespace hybridjit {

// How a KV cache stores its elements.
enum class CacheDtype { kF32, kBf16 };

// Grouped-query attention: query head j reads KV head j / (heads / kv_heads). Row i attends to cache
// positions [0, lengths[i]); a row of length 0 gets zeros. Every array is C-contiguous.
struct GqaDecodeCall {
  const float* q = nullptr;  // [batch, heads, head_dim]
  const void* k = nullptr;   // [batch, max_len, kv_heads, head_dim], elements of `cache`
  const void* v = nullptr;   // [batch, max_len, kv_heads, head_dim], elements of `cache`
  CacheDtype cache = CacheDtype::kF32;
  const int32_t* lengths = nullptr;  // [batch]
  int64_t batch = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_len = 0;
  float scale = 1.0f;
  // [heads], or null: a logit per query head that joins each row's softmax and takes its share of the
  // probability with no value (gpt-oss's attention sinks): out = sum_s exp(x_s) v_s / (exp(sink) + sum_s exp(x_s)).
  const float* sinks = nullptr;
  float* out = nullptr;  // [batch, heads, head_dim]: softmax(scale * q.k) . v
};

// Absorbed multi-head latent attention: every head of a row reads the same cached latent rows, as keys (with
// the rope part) and as values. score[j, s] = scale * (q_latent[j] . latent[s] + q_rope[j] . k_rope[s]);
// out[j] = softmax over s < lengths[i] of score[j, s], times latent[s]. A row of length 0 gets zeros.
struct MlaDecodeCall {
  const float* q_latent = nullptr;  // [batch, heads, rank]
  const float* q_rope = nullptr;    // [batch, heads, rope_dim]
  const void* latent = nullptr;     // [batch, max_len, rank], elements of `cache`
  const void* k_rope = nullptr;     // [batch, max_len, rope_dim], elements of `cache`
  CacheDtype cache = CacheDtype::kF32;
  const int32_t* lengths = nullptr;  // [batch]
  int64_t batch = 0;
  int64_t heads = 0;
  int64_t rank = 0;
  int64_t rope_dim = 0;
  int64_t max_len = 0;
  float scale = 1.0f;
  float* out = nullptr;  // [batch, heads, rank]
};

// "" if the call's sizes are consistent and every length lies in [0, max_len], else what is wrong (the
// pointers are not looked at).
std::string CheckGqaDecode(const GqaDecodeCall& call);
std::string CheckMlaDecode(const MlaDecodeCall& call);

// Run the attention; "" or an error (the Check* message, or a failure in a task, e.g. out of memory).
std::string RunGqaDecode(const GqaDecodeCall& call);
std::string RunMlaDecode(const MlaDecodeCall& call);

}  // namespace hybridjit
