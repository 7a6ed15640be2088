// Decode attention on the CPU over a KV cache in host memory (cpu_attention.h).
//
// Work: the query heads of a row form groups that read the same cache rows (GQA: the query heads of adjacent
// whole KV heads, up to 64 a group, or 16 of one KV head that has more; MLA: blocks of up to 32 heads, all
// reading the row's latent cache), and when there are too few groups to keep the pool busy (decode at small
// batch) each group's positions are cut into chunks. A task runs one chunk of one group and leaves a partial
// per head: the running max of its scores, the sum of exp(score - max), and the exp(score - max)-weighted sum
// of values. The last chunk of a group to finish merges the group's partials into the output.
//
// Kernels: AVX-512 from the avx512 family up, portable C++ below. Both multiply in float32 with float32
// accumulation: the cache is widened to float32 exactly (bfloat16 is float32's upper half) and the queries and
// probabilities keep their float32 values. vdpbf16ps would double the multiply rate, but only by rounding the
// queries and probabilities to bfloat16 (2^-8 relative), which a float32 attention result must not carry.
#include "cpu_attention.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_features.h"
#include "numeric_formats.h"
#include "thread_pool.h"

// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which -W(maybe-)uninitialized reports inside the
// headers (the other AVX-512 sources turn it off in CMakeLists.txt).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// The masked loads need AVX-512BW/VL; every avx512-family host has them.
#define HJ_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

namespace hybridjit {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t RoundUp(int64_t v, int64_t m) { return CeilDiv(v, m) * m; }

constexpr float kMinusInfinity = -std::numeric_limits<float>::infinity();

// ---- work split and merge -----------------------------------------------------------------------------------

// A chunk holds at most 1 / (kTasksPerThread x pool threads) of a call's positions x groups, so that a call at
// small batch still has about kTasksPerThread tasks per thread (enough for the pool to even out tasks of unequal
// lengths), and at least kMinChunk positions (shorter ones would spend more on their partials and merge than on
// attention); at large batch no row is cut.
constexpr int64_t kTasksPerThread = 4;
constexpr int64_t kMinChunk = 256;
// A multiple of both kernels' position blocks, so that only a group's last chunk has a partial block.
constexpr int64_t kChunkQuantum = 64;

// Query heads [first, first + count) of a row, which read the same cache rows.
struct HeadGroup {
  int64_t first;
  int64_t count;
};

// One task: positions [begin, end) of one head group of one row.
struct GroupChunk {
  int64_t row;
  int64_t first_head;
  int64_t heads;
  int64_t begin;
  int64_t end;
};

// A partial: per head of the group, {running max, sum of exp(score - max), dim values of sum of
// exp(score - max) * value}.
int64_t PartialFloats(int64_t heads, int64_t dim) { return heads * (2 + dim); }

// Working memory of one thread, 64-byte aligned, grown as needed and kept for the next task: a task's buffers
// (up to a few hundred KB for MLA) exceed malloc's mmap threshold, so allocating them per task would fault in
// fresh pages every time.
class ScratchBuffer {
 public:
  ScratchBuffer() = default;
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;
  ~ScratchBuffer() { std::free(data_); }

  float* Get(int64_t floats) {
    if (floats > floats_) {
      std::free(data_);
      data_ = static_cast<float*>(std::aligned_alloc(64, RoundUp(floats * sizeof(float), 64)));
      floats_ = data_ ? floats : 0;
      if (!data_) throw std::bad_alloc();
    }
    return data_;
  }

 private:
  float* data_ = nullptr;
  int64_t floats_ = 0;
};

// The kernels' own buffers, and the partial of a group that has a single chunk (normalized into the output
// right away), are separate: the partial is written while the kernel's buffers are still in use.
float* KernelScratch(int64_t floats) {
  thread_local ScratchBuffer buffer;
  return buffer.Get(floats);
}

float* PartialScratch(int64_t floats) {
  thread_local ScratchBuffer buffer;
  return buffer.Get(floats);
}

// Takes `floats` floats from a scratch buffer, keeping the next region 64-byte aligned.
float* Carve(float*& cursor, int64_t floats) {
  float* region = cursor;
  cursor += RoundUp(floats, 16);
  return region;
}

int64_t CarvedFloats(std::initializer_list<int64_t> regions) {
  int64_t total = 0;
  for (int64_t floats : regions) total += RoundUp(floats, 16);
  return total;
}

// For each head j: out[j] = (sum over partials c of exp(max_c - M) * acc_c) / (sum over c of exp(max_c - M) *
// sum_c), M the largest max_c: the softmax-weighted values over all the chunks' positions. With `sinks` (the
// group's, [heads]), head j's sink joins the denominator as exp(sinks[j] - M), M then the sink too if larger.
void MergePartials(const float* parts, int64_t n_parts, int64_t part_floats, int64_t heads, int64_t dim,
                   const float* sinks, float* out) {
  for (int64_t j = 0; j < heads; ++j) {
    const int64_t at = j * (2 + dim);
    float max = sinks != nullptr ? sinks[j] : kMinusInfinity;
    for (int64_t c = 0; c < n_parts; ++c) max = std::max(max, parts[c * part_floats + at]);
    float denominator = sinks != nullptr ? std::exp(sinks[j] - max) : 0.0f;
    for (int64_t c = 0; c < n_parts; ++c) {
      const float* part = parts + c * part_floats + at;
      denominator += std::exp(part[0] - max) * part[1];
    }
    float* o = out + j * dim;
    std::fill(o, o + dim, 0.0f);
    for (int64_t c = 0; c < n_parts; ++c) {
      const float* part = parts + c * part_floats + at;
      const float weight = std::exp(part[0] - max) / denominator;
      for (int64_t x = 0; x < dim; ++x) o[x] += weight * part[2 + x];
    }
  }
}

// Runs chunk_kernel(const GroupChunk&, float* partial) over every group of every row in chunks, on the
// global pool, and merges the partials into out [batch, heads, dim], with the heads' `sinks` where given
// (MergePartials). Rows of length 0 get zeros.
template <typename ChunkKernel>
std::string RunChunks(const int32_t* lengths, int64_t batch, int64_t heads, int64_t dim,
                      const std::vector<HeadGroup>& groups, const float* sinks, float* out,
                      ChunkKernel chunk_kernel) {
  const std::shared_ptr<ThreadPool> pool = ThreadPool::Global();
  const int64_t n_groups = static_cast<int64_t>(groups.size());
  int64_t group_heads = 0;
  for (const HeadGroup& g : groups) group_heads = std::max(group_heads, g.count);
  const int64_t part_floats = PartialFloats(group_heads, dim);

  int64_t positions = 0;
  for (int64_t i = 0; i < batch; ++i) positions += lengths[i];
  const int64_t chunk = std::max(
      kMinChunk, RoundUp(CeilDiv(positions * n_groups, kTasksPerThread * pool->threads()), kChunkQuantum));

  struct Task {
    GroupChunk chunk;
    int64_t unit;  // row * n_groups + group
    int64_t slot;  // its partial among `parts`, or -1 when it is its group's only chunk
  };
  std::vector<Task> tasks;
  std::vector<int64_t> unit_chunks(batch * n_groups, 0);
  std::vector<int64_t> unit_first_slot(batch * n_groups, -1);
  int64_t slots = 0;
  for (int64_t row = 0; row < batch; ++row) {
    const int64_t length = lengths[row];
    if (length == 0) {
      std::fill(out + row * heads * dim, out + (row + 1) * heads * dim, 0.0f);
      continue;
    }
    const int64_t chunks = CeilDiv(length, chunk);
    for (int64_t g = 0; g < n_groups; ++g) {
      const int64_t unit = row * n_groups + g;
      unit_chunks[unit] = chunks;
      if (chunks > 1) {
        unit_first_slot[unit] = slots;
        slots += chunks;
      }
    }
    // A chunk's groups are adjacent in the task order, so that the pool runs them at about the same time and
    // the cache rows they share (MLA's latent rows, GQA's interleaved KV heads) come from memory once.
    for (int64_t c = 0; c < chunks; ++c) {
      for (int64_t g = 0; g < n_groups; ++g) {
        const int64_t unit = row * n_groups + g;
        const GroupChunk piece{row, groups[g].first, groups[g].count, c * chunk, std::min(length, (c + 1) * chunk)};
        tasks.push_back({piece, unit, chunks > 1 ? unit_first_slot[unit] + c : -1});
      }
    }
  }
  if (tasks.empty()) return "";

  std::vector<float> parts(slots * part_floats);
  std::unique_ptr<std::atomic<int64_t>[]> unfinished(new std::atomic<int64_t>[batch * n_groups]);
  for (int64_t u = 0; u < batch * n_groups; ++u) unfinished[u].store(unit_chunks[u], std::memory_order_relaxed);

  Job job;
  job.tasks.assign(1, std::vector<std::vector<int64_t>>(pool->nodes()));
  for (int64_t i = 0; i < static_cast<int64_t>(tasks.size()); ++i) job.tasks[0][i % pool->nodes()].push_back(i);
  job.run = [&](int64_t id) {
    const Task& task = tasks[id];
    float* group_out = out + (task.chunk.row * heads + task.chunk.first_head) * dim;
    const float* group_sinks = sinks != nullptr ? sinks + task.chunk.first_head : nullptr;
    if (task.slot < 0) {
      float* part = PartialScratch(part_floats);
      chunk_kernel(task.chunk, part);
      MergePartials(part, 1, part_floats, task.chunk.heads, dim, group_sinks, group_out);
      return;
    }
    chunk_kernel(task.chunk, parts.data() + task.slot * part_floats);
    // acq_rel: the last chunk to finish sees every other chunk's partial.
    if (unfinished[task.unit].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      MergePartials(parts.data() + unit_first_slot[task.unit] * part_floats, unit_chunks[task.unit], part_floats,
                    task.chunk.heads, dim, group_sinks, group_out);
    }
  };
  return pool->Run(job);
}

std::vector<HeadGroup> GqaHeadGroups(const GqaDecodeCall& call) {
  // A group is the query heads of several whole KV heads (up to kMaxGroupHeads query heads) where a KV head has
  // at most 16 (the AVX-512 kernel keeps 16 dot products of one KV head in flight), else 16 heads of one KV
  // head. Several KV heads a group make a task read whole runs of adjacent cache rows: one KV head's part of a
  // row is only head_dim elements of every kv_heads * head_dim, which the hardware prefetchers follow poorly and
  // which uses a quarter of L1's sets at 4 KV heads (their rows are a multiple of 1 KB apart).
  constexpr int64_t kMaxGroup = 16;
  constexpr int64_t kMaxGroupHeads = 64;
  const int64_t per_kv_head = call.heads / call.kv_heads;
  std::vector<HeadGroup> groups;
  if (per_kv_head <= kMaxGroup) {
    const int64_t kv_per_group = std::max<int64_t>(1, kMaxGroupHeads / per_kv_head);
    for (int64_t kv = 0; kv < call.kv_heads; kv += kv_per_group) {
      groups.push_back({kv * per_kv_head, std::min(kv_per_group, call.kv_heads - kv) * per_kv_head});
    }
    return groups;
  }
  for (int64_t kv = 0; kv < call.kv_heads; ++kv) {
    for (int64_t first = 0; first < per_kv_head; first += kMaxGroup) {
      groups.push_back({kv * per_kv_head + first, std::min(kMaxGroup, per_kv_head - first)});
    }
  }
  return groups;
}

std::vector<HeadGroup> MlaHeadGroups(const MlaDecodeCall& call) {
  // 32 heads (two vectors of lanes) a group where there are more than 16: each widened latent element then
  // feeds two multiply-adds. More heads a group would read the latent rows fewer times but leave fewer tasks.
  const int64_t group = call.heads > 16 ? 32 : 16;
  std::vector<HeadGroup> groups;
  for (int64_t first = 0; first < call.heads; first += group) {
    groups.push_back({first, std::min(group, call.heads - first)});
  }
  return groups;
}

// ---- portable kernels ----------------------------------------------------------------------------------------

void WidenRow(const float* src, int64_t n, float* dst) { std::memcpy(dst, src, n * sizeof(float)); }

void WidenRow(const uint16_t* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = Bf16BitsToFloat(src[i]);
}

// In 8 interleaved partial sums: the compiler can keep them in vector registers (one running sum would be a
// chain it may not reorder), and each sums an eighth of the terms, which also keeps rounding errors smaller.
float Dot(const float* a, const float* b, int64_t n) {
  float partial[8] = {};
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    for (int i = 0; i < 8; ++i) partial[i] += a[c + i] * b[c + i];
  }
  for (; c < n; ++c) partial[0] += a[c] * b[c];
  const float low = (partial[0] + partial[1]) + (partial[2] + partial[3]);
  return low + ((partial[4] + partial[5]) + (partial[6] + partial[7]));
}

// One position at a time: a head's running max is raised (and its sums rescaled) as soon as a larger score
// appears. q: [heads][key_dim], already scaled. load_row(s, key, value) widens position s's key (key_dim
// floats) and value (value_dim floats) and returns the value row to use (`value`, or a prefix of `key`).
template <typename LoadRow>
void OnlineSoftmaxGeneric(const float* q, int64_t heads, int64_t key_dim, int64_t value_dim, int64_t begin,
                          int64_t end, float* key, float* value, LoadRow load_row, float* part) {
  for (int64_t j = 0; j < heads; ++j) {
    float* p = part + j * (2 + value_dim);
    p[0] = kMinusInfinity;
    std::fill(p + 1, p + 2 + value_dim, 0.0f);
  }
  for (int64_t s = begin; s < end; ++s) {
    const float* value_row = load_row(s, key, value);
    for (int64_t j = 0; j < heads; ++j) {
      const float score = Dot(q + j * key_dim, key, key_dim);
      float* p = part + j * (2 + value_dim);
      float* acc = p + 2;
      if (score > p[0]) {
        const float rescale = std::exp(p[0] - score);  // 0 at the first position (max -inf)
        p[1] *= rescale;
        for (int64_t x = 0; x < value_dim; ++x) acc[x] *= rescale;
        p[0] = score;
      }
      const float weight = std::exp(score - p[0]);
      p[1] += weight;
      for (int64_t x = 0; x < value_dim; ++x) acc[x] += weight * value_row[x];
    }
  }
}

template <typename T>
void GqaChunkGeneric(const GqaDecodeCall& call, const GroupChunk& chunk, float* part) {
  const int64_t e = call.head_dim;
  const int64_t per_kv_head = call.heads / call.kv_heads;
  const int64_t stride = call.kv_heads * e;  // elements from one position to the next
  float* cursor = KernelScratch(CarvedFloats({std::min(chunk.heads, per_kv_head) * e, e, e}));
  float* q = Carve(cursor, std::min(chunk.heads, per_kv_head) * e);
  float* key = Carve(cursor, e);
  float* value = Carve(cursor, e);
  // The group's heads by KV head (a group holds whole KV heads, or part of one).
  for (int64_t h0 = 0; h0 < chunk.heads; h0 += per_kv_head) {
    const int64_t first_head = chunk.first_head + h0;
    const int64_t heads = std::min(per_kv_head, chunk.heads - h0);
    const int64_t offset = chunk.row * call.max_len * stride + first_head / per_kv_head * e;
    const T* k = static_cast<const T*>(call.k) + offset;
    const T* v = static_cast<const T*>(call.v) + offset;
    const float* q_in = call.q + (chunk.row * call.heads + first_head) * e;
    for (int64_t i = 0; i < heads * e; ++i) q[i] = call.scale * q_in[i];
    OnlineSoftmaxGeneric(q, heads, e, e, chunk.begin, chunk.end, key, value,
                         [&](int64_t s, float* key_row, float* value_row) {
                           WidenRow(k + s * stride, e, key_row);
                           WidenRow(v + s * stride, e, value_row);
                           return value_row;
                         }, part + h0 * (2 + e));
  }
}

template <typename T>
void MlaChunkGeneric(const MlaDecodeCall& call, const GroupChunk& chunk, float* part) {
  const int64_t r = call.rank, pr = call.rope_dim, d = r + pr;
  const T* latent = static_cast<const T*>(call.latent) + chunk.row * call.max_len * r;
  const T* k_rope = static_cast<const T*>(call.k_rope) + chunk.row * call.max_len * pr;
  float* cursor = KernelScratch(CarvedFloats({chunk.heads * d, d}));
  float* q = Carve(cursor, chunk.heads * d);  // [heads][rank + rope_dim]: the scaled q_latent, then q_rope
  float* key = Carve(cursor, d);
  for (int64_t j = 0; j < chunk.heads; ++j) {
    const int64_t head = chunk.row * call.heads + chunk.first_head + j;
    for (int64_t c = 0; c < r; ++c) q[j * d + c] = call.scale * call.q_latent[head * r + c];
    for (int64_t c = 0; c < pr; ++c) q[j * d + r + c] = call.scale * call.q_rope[head * pr + c];
  }
  // The latent row is the key's first `rank` elements and the whole value.
  OnlineSoftmaxGeneric(q, chunk.heads, d, r, chunk.begin, chunk.end, key, nullptr,
                       [&](int64_t s, float* key_row, float*) {
                         WidenRow(latent + s * r, r, key_row);
                         WidenRow(k_rope + s * pr, pr, key_row + r);
                         return static_cast<const float*>(key_row);
                       }, part);
}

// ---- AVX-512 kernels -------------------------------------------------------------------------------------------

HJ_AVX512 inline __mmask16 FirstLanes(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }

// 16 cache elements widened to float32; n < 16 loads the first n and zeros the rest (the row's end). Callers pass
// a constant 16 on whole steps so that the mask folds away: masked loads stream more slowly.
HJ_AVX512 inline __attribute__((always_inline)) __m512 Load16(const float* p, int64_t n) {
  return n >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(FirstLanes(n), p);
}

HJ_AVX512 inline __attribute__((always_inline)) __m512 Load16(const uint16_t* p, int64_t n) {
  const __m256i bits = n >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                               : _mm256_maskz_loadu_epi16(FirstLanes(n), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Calls step(c, n) for the steps of 16 elements that cover [0, size): the whole ones with n the constant 16,
// then the partial last one, if any.
template <typename Step>
HJ_AVX512 inline __attribute__((always_inline)) void ForSteps16(int64_t size, Step step) {
  const int64_t whole_end = size / 16 * 16;
  for (int64_t c = 0; c < whole_end; c += 16) step(c, 16);
  if (whole_end < size) step(whole_end, size - whole_end);
}

template <typename T>
HJ_AVX512 void WidenRowAvx512(const T* src, int64_t n, float* dst) {
  ForSteps16(n, [&](int64_t c, int64_t width) HJ_AVX512 __attribute__((always_inline)) {
    _mm512_mask_storeu_ps(dst + c, FirstLanes(width), Load16(src + c, width));
  });
}

// exp(x) for x <= 0 (a score minus a running max) to about 1 ulp, Cephes' expf: x = n ln2 + r with |r| <= ln2/2,
// exp(r) by a degree-7 polynomial, times 2^n by vscalefps. Inputs below -87.3 (-inf included: the running max
// before the first position) give exp(-87.3), a negligible 1e-38, and no NaN from -inf - -inf.
HJ_AVX512 inline __m512 ExpNonPositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln 2 in two parts (Cody and Waite): n * 0.693359375 is exact, so r keeps its low bits.
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// GQA. A score vector holds 16 / G positions x G heads (lane = position * G + head): each lane is a dot
// product along head_dim, kept as 16 lanes of partial sums until 16 of them are summed across at once, which
// costs a shuffle network of 46 instructions instead of 16 separate horizontal sums. Lanes with the same head
// (lane mod G) are combined by swapping lanes l and l ^ shift for shift = 8 .. G. The softmax update (block
// max, exp, rescale) then runs once per block of positions, on whole vectors, and each value row is widened once
// and multiplied into the sums of every head of the group.
//
// Cache rows are read in steps of 32 elements, each widened into a pair of float32 vectors. A float32 step is
// its two halves in order. A bfloat16 step is one 64-byte load whose 32-bit lanes each hold two elements
// (2l in the low half, 2l + 1 in the high half): a shift left by 16 makes the even elements float32 and masking
// off the low halves the odd ones, 2 single-uop instructions for 32 elements where widening in order
// (vpmovzxwd + vpslld) takes 4, half of them on the one shuffle port. A dot product and a sum of rows do not
// care about the order of the elements as long as q and the value sums use the same one: q and the value sums
// are kept in pair order (ToPairOrder), and the value sums are put back in order at the end.

struct Pair {
  __m512 lo, hi;
};

HJ_AVX512 inline __mmask32 FirstLanes32(int64_t n) { return n >= 32 ? ~__mmask32(0) : __mmask32((1u << n) - 1); }

// Elements [0, n) of a step widened (n < 32: the rest are zeros, nothing past p + n is read). Callers pass a
// constant 32 on whole steps so that the masks fold away.
HJ_AVX512 inline __attribute__((always_inline)) Pair LoadPair(const float* p, int64_t n) {
  return {Load16(p, n), n > 16 ? Load16(p + 16, n - 16) : _mm512_setzero_ps()};
}

HJ_AVX512 inline __attribute__((always_inline)) Pair LoadPair(const uint16_t* p, int64_t n) {
  const __m512i bits = n >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(FirstLanes32(n), p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(0xffff0000u))))};
}

// dst[0, RoundUp(n, 32)) = scale * src[0, n) in pair order, zeros past n.
template <typename T>
HJ_AVX512 void ToPairOrder(const float* src, int64_t n, float scale, float* dst) {
  const __m512 factor = _mm512_set1_ps(scale);
  for (int64_t c = 0; c < n; c += 32) {
    const __m512 x0 = _mm512_mul_ps(Load16(src + c, n - c), factor);
    const __m512 x1 = n - c > 16 ? _mm512_mul_ps(Load16(src + c + 16, n - c - 16), factor) : _mm512_setzero_ps();
    if constexpr (std::is_same_v<T, uint16_t>) {
      // lo: the even elements of x0:x1, hi: the odd ones.
      const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
      _mm512_store_ps(dst + c, _mm512_permutex2var_ps(x0, even, x1));
      _mm512_store_ps(dst + c + 16, _mm512_permutex2var_ps(x0, odd, x1));
    } else {
      _mm512_store_ps(dst + c, x0);
      _mm512_store_ps(dst + c + 16, x1);
    }
  }
}

// dst[0, n) = src in element order, src in pair order.
template <typename T>
HJ_AVX512 void FromPairOrder(const float* src, int64_t n, float* dst) {
  for (int64_t c = 0; c < n; c += 32) {
    __m512 x0 = _mm512_load_ps(src + c), x1 = _mm512_load_ps(src + c + 16);
    if constexpr (std::is_same_v<T, uint16_t>) {
      // Element 2l is lo's lane l, element 2l + 1 hi's lane l (hi: indices 16 + l).
      const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
      const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
      const __m512 lo = x0, hi = x1;
      x0 = _mm512_permutex2var_ps(lo, first, hi);
      x1 = _mm512_permutex2var_ps(lo, second, hi);
    }
    _mm512_mask_storeu_ps(dst + c, FirstLanes(n - c), x0);
    if (n - c > 16) _mm512_mask_storeu_ps(dst + c + 16, FirstLanes(n - c - 16), x1);
  }
}

// Calls step(c, n) for the steps of 32 elements that cover [0, size): the whole ones with n the constant 32,
// then the partial last one, if any.
template <typename Step>
HJ_AVX512 inline __attribute__((always_inline)) void ForSteps32(int64_t size, Step step) {
  const int64_t whole_end = size / 32 * 32;
  for (int64_t c = 0; c < whole_end; c += 32) step(c, 32);
  if (whole_end < size) step(whole_end, size - whole_end);
}

// Lane i of the result: the sum of the lanes of a[i].
HJ_AVX512 inline __attribute__((always_inline)) __m512 SumEachOf16(const __m512 a[16]) {
  // The network leaves input 4m + k's sum in lane 4k + m; taking the inputs 4 x 4 transposed (input i = a[in(i)])
  // puts a[i]'s sum in lane i.
  constexpr auto in = [](int i) { return (i % 4) * 4 + i / 4; };
  __m512 halves[8];  // halves[i]: 8 partial sums of input 2i in lanes 0-7, of input 2i + 1 in lanes 8-15
  for (int i = 0; i < 8; ++i) {
    const __m512 x = a[in(2 * i)], y = a[in(2 * i + 1)];
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xee));
  }
  __m512 quarters[4];  // quarters[i]: 128-bit block k holds 4 partial sums of input 4i + k
  for (int i = 0; i < 4; ++i) {
    const __m512 x = halves[2 * i], y = halves[2 * i + 1];
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xdd));
  }
  __m512 pairs[2];  // pairs[i]: block k holds 2 partial sums of input 8i + k, then 2 of input 8i + 4 + k
  for (int i = 0; i < 2; ++i) {
    const __m512 x = quarters[2 * i], y = quarters[2 * i + 1];
    pairs[i] = _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xee));
  }
  // Block k: the sums of inputs k, 4 + k, 8 + k, 12 + k.
  return _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88), _mm512_shuffle_ps(pairs[0], pairs[1], 0xdd));
}

template <bool kMax>
HJ_AVX512 inline __m512 MaxOrSum(__m512 a, __m512 b) {
  return kMax ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b);
}

// Every lane l becomes the max (or the sum) over the lanes of its head, those equal to l modulo G.
template <int G, bool kMax>
HJ_AVX512 inline __m512 CombinePerHead(__m512 x) {
  if constexpr (G <= 8) x = MaxOrSum<kMax>(x, _mm512_shuffle_f32x4(x, x, 0x4e));  // lane l ^ 8
  if constexpr (G <= 4) x = MaxOrSum<kMax>(x, _mm512_shuffle_f32x4(x, x, 0xb1));  // l ^ 4
  if constexpr (G <= 2) x = MaxOrSum<kMax>(x, _mm512_permute_ps(x, 0x4e));        // l ^ 2
  if constexpr (G <= 1) x = MaxOrSum<kMax>(x, _mm512_permute_ps(x, 0xb1));        // l ^ 1
  return x;
}

// The scores of positions rows[0 .. 16 / G) against the G query heads of q [G][q_stride] (already scaled, in
// pair order, zero past head_dim).
template <int G, typename T>
HJ_AVX512 inline __m512 GqaScoreVector(const float* q, int64_t q_stride, const T* const* rows, int64_t e) {
  constexpr int kPositions = 16 / G;
  __m512 acc[16];
  for (__m512& a : acc) a = _mm512_setzero_ps();
  ForSteps32(e, [&](int64_t c, int64_t n) HJ_AVX512 __attribute__((always_inline)) {
    for (int p = 0; p < kPositions; ++p) {
      const Pair key = LoadPair(rows[p] + c, n);
      for (int j = 0; j < G; ++j) {
        const float* qj = q + j * q_stride + c;
        acc[p * G + j] = _mm512_fmadd_ps(_mm512_load_ps(qj), key.lo, acc[p * G + j]);
        acc[p * G + j] = _mm512_fmadd_ps(_mm512_load_ps(qj + 16), key.hi, acc[p * G + j]);
      }
    }
  });
  return SumEachOf16(acc);
}

// For the H heads j of o [.][o_stride] (pair order), columns [c, c + 32 * kPairs): o[j] = o[j] * alpha[j] +
// sum over positions s < n of p[s * G + j] * v[s] (width: the columns the rows have from c on, <= 32 * kPairs;
// kPairs == 1 where it is less). 2 * H * kPairs accumulators.
template <int G, int H, int kPairs, typename T>
HJ_AVX512 inline __attribute__((always_inline)) void GqaValueTile(float* o, int64_t o_stride, const float* alpha,
                                                                  const float* p, const T* v, int64_t v_stride,
                                                                  int64_t n, int64_t c, int64_t width) {
  constexpr int kVectors = 2 * kPairs;
  __m512 acc[H][kVectors];
  for (int j = 0; j < H; ++j) {
    const __m512 a = _mm512_set1_ps(alpha[j]);
    for (int t = 0; t < kVectors; ++t) acc[j][t] = _mm512_mul_ps(_mm512_load_ps(o + j * o_stride + c + 16 * t), a);
  }
  for (int64_t s = 0; s < n; ++s) {
    const T* row = v + s * v_stride + c;
    __m512 x[kVectors];
    for (int t = 0; t < kPairs; ++t) {
      const Pair pair = LoadPair(row + 32 * t, width - 32 * t);
      x[2 * t] = pair.lo;
      x[2 * t + 1] = pair.hi;
    }
    for (int j = 0; j < H; ++j) {
      const __m512 w = _mm512_set1_ps(p[s * G + j]);
      for (int t = 0; t < kVectors; ++t) acc[j][t] = _mm512_fmadd_ps(w, x[t], acc[j][t]);
    }
  }
  for (int j = 0; j < H; ++j) {
    for (int t = 0; t < kVectors; ++t) _mm512_store_ps(o + j * o_stride + c + 16 * t, acc[j][t]);
  }
}

// o[j] = o[j] * alpha[j] + sum over s < n of p[s][j] * v[s] for the G heads: in passes of up to 8 heads, each
// over tiles of columns, 16 accumulators.
template <int G, typename T>
HJ_AVX512 void GqaValues(float* o, int64_t o_stride, const float* alpha, const float* p, const T* v,
                         int64_t v_stride, int64_t n, int64_t e) {
  constexpr int H = G < 8 ? G : 8;
  constexpr int kPairs = H <= 2 ? 4 : 8 / H;
  for (int j0 = 0; j0 < G; j0 += H) {
    float* oj = o + j0 * o_stride;
    int64_t c = 0;
    for (; c + 32 * kPairs <= e; c += 32 * kPairs) {
      GqaValueTile<G, H, kPairs>(oj, o_stride, alpha + j0, p + j0, v, v_stride, n, c, 32 * kPairs);
    }
    for (; c < e; c += 32) {
      GqaValueTile<G, H, 1>(oj, o_stride, alpha + j0, p + j0, v, v_stride, n, c, std::min<int64_t>(32, e - c));
    }
  }
}

// Asks for the cache lines of [p, p + bytes) to be brought into L1.
inline void PrefetchSpan(const void* p, int64_t bytes) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t line = begin & ~uintptr_t{63}; line < begin + bytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
  }
}

// Positions a GQA block scores before it rescales and accumulates values.
constexpr int64_t kGqaBlock = 32;

// The online softmax state of one KV head's query heads in a chunk.
struct GqaHeadState {
  __m512 running_max;  // lane l: head l mod G, as in the score vectors
  __m512 sum;          // lane-wise: combined per head at the end
};

// Positions [b0, b0 + n) of one KV head: k, v its part of position 0's row, q and o [G][padded] (pair order),
// p [kGqaBlock * G] scratch. Asks for positions [prefetch_begin, prefetch_end) of the rows at prefetch_k and
// prefetch_v (head_dim elements each, stride apart) to be brought in while it computes.
template <int G, typename T>
HJ_AVX512 inline void GqaBlock(GqaHeadState& state, const float* q, float* o, float* p, int64_t padded, const T* k,
                               const T* v, int64_t stride, int64_t e, int64_t b0, int64_t n, const T* prefetch_k,
                               const T* prefetch_v, int64_t prefetch_begin, int64_t prefetch_end) {
  constexpr int kPositions = 16 / G;  // per score vector
  const int64_t vectors = CeilDiv(n, kPositions);
  __m512 block_max = _mm512_set1_ps(kMinusInfinity);
  for (int64_t i = 0; i < vectors; ++i) {
    // Rows to come, while these compute (GqaChunkAvx512 says which): from DRAM the kernel runs at about half
    // the rate without them, the hardware prefetchers lagging behind runs of head_dim elements kv_heads apart.
    const int64_t first = prefetch_begin + i * kPositions;
    for (int64_t s = first; s < std::min(first + kPositions, prefetch_end); ++s) {
      PrefetchSpan(prefetch_k + s * stride, e * sizeof(T));
      PrefetchSpan(prefetch_v + s * stride, e * sizeof(T));
    }
    const T* rows[kPositions];
    // Positions past the block repeat its last one (memory that exists); their lanes become -inf.
    for (int r = 0; r < kPositions; ++r) rows[r] = k + std::min(b0 + i * kPositions + r, b0 + n - 1) * stride;
    const __mmask16 valid = FirstLanes((n - i * kPositions) * G);
    const __m512 scores =
        _mm512_mask_mov_ps(_mm512_set1_ps(kMinusInfinity), valid, GqaScoreVector<G>(q, padded, rows, e));
    _mm512_storeu_ps(p + i * 16, scores);
    block_max = _mm512_max_ps(block_max, scores);
  }
  const __m512 new_max = _mm512_max_ps(state.running_max, CombinePerHead<G, true>(block_max));
  const __m512 rescale = ExpNonPositive(_mm512_sub_ps(state.running_max, new_max));
  state.running_max = new_max;
  __m512 sum = _mm512_mul_ps(state.sum, rescale);
  for (int64_t i = 0; i < vectors; ++i) {
    const __mmask16 valid = FirstLanes((n - i * kPositions) * G);
    const __m512 weights =
        _mm512_maskz_mov_ps(valid, ExpNonPositive(_mm512_sub_ps(_mm512_loadu_ps(p + i * 16), new_max)));
    _mm512_storeu_ps(p + i * 16, weights);
    sum = _mm512_add_ps(sum, weights);
  }
  state.sum = sum;
  alignas(64) float alpha[16];
  _mm512_store_ps(alpha, rescale);
  GqaValues<G>(o, padded, alpha, p, v + b0 * stride, stride, n, e);
}

// One chunk of a group: its KV heads (kv_count of them, adjacent), each with up to G (a power of two, <= 16)
// query heads. Block by block, each KV head in turn, so that the task reads the cache rows' runs of adjacent
// KV heads together.
template <int G, typename T>
HJ_AVX512 void GqaChunkAvx512(const GqaDecodeCall& call, const GroupChunk& chunk, float* part) {
  const int64_t e = call.head_dim;
  const int64_t padded = RoundUp(e, 32);
  const int64_t per_kv_head = call.heads / call.kv_heads;
  const int64_t heads = std::min(chunk.heads, per_kv_head);  // query heads a KV head in this group
  const int64_t kv_count = chunk.heads / heads;
  const int64_t stride = call.kv_heads * e;  // elements from one position to the next
  const int64_t offset = chunk.row * call.max_len * stride + chunk.first_head / per_kv_head * e;
  const T* k = static_cast<const T*>(call.k) + offset;  // KV head h of the group: + h * e
  const T* v = static_cast<const T*>(call.v) + offset;

  const int64_t head_floats = G * padded;
  float* cursor = KernelScratch(
      CarvedFloats({kv_count * head_floats, kv_count * head_floats, kGqaBlock * G, kv_count * 32}));
  // [kv_count][G][padded]: scale * q in pair order; zero past e and for heads the group lacks
  float* q = Carve(cursor, kv_count * head_floats);
  float* o = Carve(cursor, kv_count * head_floats);  // [kv_count][G][padded]: the exp-weighted sums of values
  float* p = Carve(cursor, kGqaBlock * G);  // [position][G]: a block's scores, then their exp(score - max)
  // [kv_count]: each KV head's online softmax state (in the scratch buffer: 64-byte aligned, allocated once).
  GqaHeadState* states = reinterpret_cast<GqaHeadState*>(Carve(cursor, kv_count * 32));
  for (int64_t h = 0; h < kv_count; ++h) {
    new (states + h) GqaHeadState{_mm512_set1_ps(kMinusInfinity), _mm512_setzero_ps()};
  }
  std::fill(q, q + kv_count * head_floats, 0.0f);
  std::fill(o, o + kv_count * head_floats, 0.0f);
  const float* q_in = call.q + (chunk.row * call.heads + chunk.first_head) * e;
  for (int64_t h = 0; h < kv_count; ++h) {
    for (int64_t j = 0; j < heads; ++j) {
      ToPairOrder<T>(q_in + (h * heads + j) * e, e, call.scale, q + h * head_floats + j * padded);
    }
  }

  for (int64_t b0 = chunk.begin; b0 < chunk.end; b0 += kGqaBlock) {
    const int64_t n = std::min(kGqaBlock, chunk.end - b0);
    for (int64_t h = 0; h < kv_count; ++h) {
      // While KV head h computes, the next KV head's part of the block's rows comes in (while the last one
      // does, the first one's part of the next block's rows): the cache is read in order, and what comes in is
      // used one KV head's block later (~16 KB at head_dim 128 bf16), soon enough to still be in L1. Further
      // ahead measured no better.
      const bool last = h + 1 == kv_count;
      const int64_t next = last ? 0 : h + 1;
      const int64_t prefetch_begin = last ? b0 + kGqaBlock : b0;
      GqaBlock<G>(states[h], q + h * head_floats, o + h * head_floats, p, padded, k + h * e, v + h * e, stride, e,
                  b0, n, k + next * e, v + next * e, prefetch_begin, std::min(prefetch_begin + kGqaBlock, chunk.end));
    }
  }
  for (int64_t h = 0; h < kv_count; ++h) {
    alignas(64) float maxes[16], sums[16];
    _mm512_store_ps(maxes, states[h].running_max);
    _mm512_store_ps(sums, CombinePerHead<G, false>(states[h].sum));
    for (int64_t j = 0; j < heads; ++j) {
      float* out = part + (h * heads + j) * (2 + e);
      out[0] = maxes[j];
      out[1] = sums[j];
      FromPairOrder<T>(o + h * head_floats + j * padded, e, out + 2);
    }
  }
}

template <typename T>
void GqaChunkAvx512ForHeads(const GqaDecodeCall& call, const GroupChunk& chunk, float* part) {
  const int64_t heads = std::min(chunk.heads, call.heads / call.kv_heads);  // a KV head's
  if (heads <= 1) return GqaChunkAvx512<1, T>(call, chunk, part);
  if (heads <= 2) return GqaChunkAvx512<2, T>(call, chunk, part);
  if (heads <= 4) return GqaChunkAvx512<4, T>(call, chunk, part);
  if (heads <= 8) return GqaChunkAvx512<8, T>(call, chunk, part);
  return GqaChunkAvx512<16, T>(call, chunk, part);
}

// MLA. The heads of a group are the lanes (kV vectors of 16): a block of latent rows is widened to float32 once
// per task and every element of it is broadcast against all the group's heads, in the scores (against q) and
// in the values (against the probabilities), so no sum ever runs across lanes. The running max and sums are
// per lane, i.e. per head, as they are.

// Positions an MLA block widens, scores and accumulates at a time.
constexpr int64_t kMlaBlock = 16;

// scores[s][lanes] = keys[s] . qt[.][lanes] for s < 16 / kV (rows past the block are zeros).
template <int kV>
HJ_AVX512 inline void MlaScoreTile(const float* qt, const float* keys, int64_t d, float* scores) {
  constexpr int kPositions = 16 / kV;  // 16 accumulators
  __m512 acc[kPositions][kV];
  for (auto& row : acc) {
    for (__m512& a : row) a = _mm512_setzero_ps();
  }
  for (int64_t c = 0; c < d; ++c) {
    __m512 q[kV];
    for (int t = 0; t < kV; ++t) q[t] = _mm512_load_ps(qt + c * 16 * kV + 16 * t);
    for (int s = 0; s < kPositions; ++s) {
      const __m512 key = _mm512_set1_ps(keys[s * d + c]);
      for (int t = 0; t < kV; ++t) acc[s][t] = _mm512_fmadd_ps(key, q[t], acc[s][t]);
    }
  }
  for (int s = 0; s < kPositions; ++s) {
    for (int t = 0; t < kV; ++t) _mm512_store_ps(scores + (s * kV + t) * 16, acc[s][t]);
  }
}

// ot[c .. c + kColumns)[lanes] = ot[..] * alpha + sum over s < n of latent[s][c ..] * p[s][lanes].
template <int kV, int kColumns>
HJ_AVX512 inline void MlaValueTile(float* ot, const __m512* alpha, const float* p, const float* latent, int64_t d,
                                   int64_t n) {
  __m512 acc[kColumns][kV];
  for (int c = 0; c < kColumns; ++c) {
    for (int t = 0; t < kV; ++t) acc[c][t] = _mm512_mul_ps(_mm512_load_ps(ot + (c * kV + t) * 16), alpha[t]);
  }
  for (int64_t s = 0; s < n; ++s) {
    __m512 w[kV];
    for (int t = 0; t < kV; ++t) w[t] = _mm512_load_ps(p + (s * kV + t) * 16);
    for (int c = 0; c < kColumns; ++c) {
      const __m512 x = _mm512_set1_ps(latent[s * d + c]);
      for (int t = 0; t < kV; ++t) acc[c][t] = _mm512_fmadd_ps(x, w[t], acc[c][t]);
    }
  }
  for (int c = 0; c < kColumns; ++c) {
    for (int t = 0; t < kV; ++t) _mm512_store_ps(ot + (c * kV + t) * 16, acc[c][t]);
  }
}

// One chunk of up to 16 * kV heads.
template <int kV, typename T>
HJ_AVX512 void MlaChunkAvx512(const MlaDecodeCall& call, const GroupChunk& chunk, float* part) {
  constexpr int kLanes = 16 * kV;
  constexpr int kScorePositions = 16 / kV;
  constexpr int kValueColumns = 16 / kV;
  const int64_t r = call.rank, pr = call.rope_dim, d = r + pr;
  const T* latent = static_cast<const T*>(call.latent) + chunk.row * call.max_len * r;
  const T* k_rope = static_cast<const T*>(call.k_rope) + chunk.row * call.max_len * pr;

  float* cursor = KernelScratch(CarvedFloats({d * kLanes, r * kLanes, kMlaBlock * d, kMlaBlock * kLanes}));
  float* qt = Carve(cursor, d * kLanes);  // [rank + rope_dim][lanes]: scale * (q_latent, q_rope), transposed
  float* ot = Carve(cursor, r * kLanes);  // [rank][lanes]: the exp-weighted sums of latent rows
  float* keys = Carve(cursor, kMlaBlock * d);  // [position][rank + rope_dim]: the block's rows, widened
  float* p = Carve(cursor, kMlaBlock * kLanes);  // [position][lanes]: scores, then exp(score - max)
  std::fill(qt, qt + d * kLanes, 0.0f);
  std::fill(ot, ot + r * kLanes, 0.0f);
  for (int64_t j = 0; j < chunk.heads; ++j) {
    const int64_t head = chunk.row * call.heads + chunk.first_head + j;
    for (int64_t c = 0; c < r; ++c) qt[c * kLanes + j] = call.scale * call.q_latent[head * r + c];
    for (int64_t c = 0; c < pr; ++c) qt[(r + c) * kLanes + j] = call.scale * call.q_rope[head * pr + c];
  }

  __m512 running_max[kV], sum[kV];
  for (int t = 0; t < kV; ++t) {
    running_max[t] = _mm512_set1_ps(kMinusInfinity);
    sum[t] = _mm512_setzero_ps();
  }
  for (int64_t b0 = chunk.begin; b0 < chunk.end; b0 += kMlaBlock) {
    const int64_t n = std::min(kMlaBlock, chunk.end - b0);
    for (int64_t s = 0; s < n; ++s) {
      WidenRowAvx512(latent + (b0 + s) * r, r, keys + s * d);
      WidenRowAvx512(k_rope + (b0 + s) * pr, pr, keys + s * d + r);
    }
    // The last score tile may run past n: zero rows, whose scores are never read.
    std::fill(keys + n * d, keys + RoundUp(n, kScorePositions) * d, 0.0f);
    for (int64_t s = 0; s < n; s += kScorePositions) MlaScoreTile<kV>(qt, keys + s * d, d, p + s * kLanes);

    __m512 rescale[kV];
    for (int t = 0; t < kV; ++t) {
      __m512 block_max = _mm512_set1_ps(kMinusInfinity);
      for (int64_t s = 0; s < n; ++s) block_max = _mm512_max_ps(block_max, _mm512_load_ps(p + s * kLanes + 16 * t));
      const __m512 new_max = _mm512_max_ps(running_max[t], block_max);
      rescale[t] = ExpNonPositive(_mm512_sub_ps(running_max[t], new_max));
      running_max[t] = new_max;
      sum[t] = _mm512_mul_ps(sum[t], rescale[t]);
      for (int64_t s = 0; s < n; ++s) {
        float* at = p + s * kLanes + 16 * t;
        const __m512 weights = ExpNonPositive(_mm512_sub_ps(_mm512_load_ps(at), new_max));
        _mm512_store_ps(at, weights);
        sum[t] = _mm512_add_ps(sum[t], weights);
      }
    }
    int64_t c = 0;
    for (; c + kValueColumns <= r; c += kValueColumns) {
      MlaValueTile<kV, kValueColumns>(ot + c * kLanes, rescale, p, keys + c, d, n);
    }
    for (; c < r; ++c) MlaValueTile<kV, 1>(ot + c * kLanes, rescale, p, keys + c, d, n);
  }
  alignas(64) float maxes[kLanes], sums[kLanes];
  for (int t = 0; t < kV; ++t) {
    _mm512_store_ps(maxes + 16 * t, running_max[t]);
    _mm512_store_ps(sums + 16 * t, sum[t]);
  }
  for (int64_t j = 0; j < chunk.heads; ++j) {
    float* out = part + j * (2 + r);
    out[0] = maxes[j];
    out[1] = sums[j];
    for (int64_t c = 0; c < r; ++c) out[2 + c] = ot[c * kLanes + j];
  }
}

template <typename T>
void MlaChunkAvx512ForHeads(const MlaDecodeCall& call, const GroupChunk& chunk, float* part) {
  if (chunk.heads <= 16) return MlaChunkAvx512<1, T>(call, chunk, part);
  return MlaChunkAvx512<2, T>(call, chunk, part);
}

// ---- entry points --------------------------------------------------------------------------------------------

std::string CheckLengths(const int32_t* lengths, int64_t batch, int64_t max_len) {
  for (int64_t i = 0; i < batch; ++i) {
    if (lengths[i] < 0 || lengths[i] > max_len) {
      return "lengths[" + std::to_string(i) + "] = " + std::to_string(lengths[i]) + " is outside [0, " +
             std::to_string(max_len) + "] (the cache's positions)";
    }
  }
  return "";
}

bool UseAvx512() { return SelectedCpuKernel() >= CpuKernel::kAvx512; }

}  // namespace

std::string CheckGqaDecode(const GqaDecodeCall& call) {
  if (call.batch < 0 || call.max_len < 0 || call.heads <= 0 || call.kv_heads <= 0 || call.head_dim <= 0) {
    return "GQA decode: batch and max_len must be >= 0, heads, kv_heads and head_dim > 0";
  }
  if (call.heads % call.kv_heads != 0) {
    return "GQA decode: heads (" + std::to_string(call.heads) + ") is not a multiple of kv_heads (" +
           std::to_string(call.kv_heads) + ")";
  }
  return CheckLengths(call.lengths, call.batch, call.max_len);
}

std::string CheckMlaDecode(const MlaDecodeCall& call) {
  if (call.batch < 0 || call.max_len < 0 || call.heads <= 0 || call.rank <= 0 || call.rope_dim < 0) {
    return "MLA decode: batch, max_len and rope_dim must be >= 0, heads and rank > 0";
  }
  return CheckLengths(call.lengths, call.batch, call.max_len);
}

std::string RunGqaDecode(const GqaDecodeCall& call) {
  try {
    if (std::string error = CheckGqaDecode(call); !error.empty()) return error;
    const bool avx512 = UseAvx512();
    const bool bf16 = call.cache == CacheDtype::kBf16;
    return RunChunks(call.lengths, call.batch, call.heads, call.head_dim, GqaHeadGroups(call), call.sinks, call.out,
                     [&](const GroupChunk& chunk, float* part) {
                       if (avx512) {
                         bf16 ? GqaChunkAvx512ForHeads<uint16_t>(call, chunk, part)
                              : GqaChunkAvx512ForHeads<float>(call, chunk, part);
                       } else {
                         bf16 ? GqaChunkGeneric<uint16_t>(call, chunk, part)
                              : GqaChunkGeneric<float>(call, chunk, part);
                       }
                     });
  } catch (const std::exception& e) {
    return e.what();
  }
}

std::string RunMlaDecode(const MlaDecodeCall& call) {
  try {
    if (std::string error = CheckMlaDecode(call); !error.empty()) return error;
    const bool avx512 = UseAvx512();
    const bool bf16 = call.cache == CacheDtype::kBf16;
    return RunChunks(call.lengths, call.batch, call.heads, call.rank, MlaHeadGroups(call), nullptr, call.out,
                     [&](const GroupChunk& chunk, float* part) {
                       if (avx512) {
                         bf16 ? MlaChunkAvx512ForHeads<uint16_t>(call, chunk, part)
                              : MlaChunkAvx512ForHeads<float>(call, chunk, part);
                       } else {
                         bf16 ? MlaChunkGeneric<uint16_t>(call, chunk, part)
                              : MlaChunkGeneric<float>(call, chunk, part);
                       }
                     });
  } catch (const std::exception& e) {
    return e.what();
  }
}

}  // namespace hybridjit
