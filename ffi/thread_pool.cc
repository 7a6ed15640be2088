#include "thread_pool.h"

#include <dirent.h>
#include <pthread.h>
#include <sched.h>
#include <xmmintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace hybridjit {
namespace {

void PinThread(pthread_t thread, int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(thread, sizeof set, &set);
}

// Round to nearest, no flush-to-zero or denormals-are-zero, all exceptions masked: the kernels'
// float arithmetic must not depend on what the calling thread's runtime (XLA, Eigen) chose.
constexpr unsigned kDefaultMxcsr = 0x1f80;

std::vector<int> AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
    }
  }
  if (cpus.empty()) cpus.push_back(0);
  return cpus;
}

// "0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11}
std::vector<int> ParseCpuList(const std::string& text) {
  std::vector<int> cpus;
  std::stringstream stream(text);
  std::string range;
  while (std::getline(stream, range, ',')) {
    if (range.empty() || range == "\n") continue;
    const size_t dash = range.find('-');
    const int first = std::atoi(range.c_str());
    const int last = dash == std::string::npos ? first : std::atoi(range.c_str() + dash + 1);
    for (int c = first; c <= last; ++c) cpus.push_back(c);
  }
  return cpus;
}

std::vector<std::vector<int>> MachineNodes(const std::vector<int>& allowed) {
  std::vector<std::vector<int>> nodes;
  if (DIR* dir = opendir("/sys/devices/system/node")) {
    std::vector<int> ids;
    while (const dirent* entry = readdir(dir)) {
      int id;
      char rest;
      if (std::sscanf(entry->d_name, "node%d%c", &id, &rest) == 1) ids.push_back(id);
    }
    closedir(dir);
    std::sort(ids.begin(), ids.end());
    for (int id : ids) {
      std::ifstream file("/sys/devices/system/node/node" + std::to_string(id) + "/cpulist");
      std::string text;
      std::getline(file, text);
      std::vector<int> cpus;
      for (int c : ParseCpuList(text)) {
        if (std::find(allowed.begin(), allowed.end(), c) != allowed.end()) cpus.push_back(c);
      }
      if (!cpus.empty()) nodes.push_back(std::move(cpus));
    }
  }
  if (nodes.empty()) nodes.push_back(allowed);
  return nodes;
}

std::vector<std::vector<int>> ForcedNodes(const std::vector<int>& allowed, int count) {
  count = std::min<int>(count, static_cast<int>(allowed.size()));
  std::vector<std::vector<int>> nodes(count);
  for (size_t i = 0; i < allowed.size(); ++i) nodes[i * count / allowed.size()].push_back(allowed[i]);
  return nodes;
}

// The integer in environment variable `name`, in [low, high]; `unset` when it is unset or empty.
int EnvInt(const char* name, int low, int high, int unset) {
  const char* text = std::getenv(name);
  if (!text || !*text) return unset;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  if (*end != '\0' || value < low || value > high) {
    throw std::invalid_argument(std::string(name) + "='" + text + "' is not an integer in [" + std::to_string(low) +
                                ", " + std::to_string(high) + "]");
  }
  return static_cast<int>(value);
}

int EnvCount(const char* name) { return EnvInt(name, 1, 4096, 0); }

// How long an idle worker spins before it sleeps. A decode step submits a job per MoE layer, a few
// hundred microseconds apart (the layer's GPU part and the hand-off): a worker asleep by then pays a
// futex wake-up, and the last of 16 woken one by one starts tens of microseconds late.
constexpr int kDefaultSpinMicroseconds = 200;

struct GlobalPool {
  std::mutex mutex;
  std::shared_ptr<ThreadPool> pool;
};

GlobalPool& Holder() {
  static GlobalPool* holder = new GlobalPool();  // never destroyed: handlers may run during exit
  return *holder;
}

}  // namespace

struct ThreadPool::RunState {
  const Job* job = nullptr;
  std::vector<std::atomic<int64_t>> next;  // [phase * nodes + node]
  std::atomic<int64_t> unfinished{0};
  std::atomic<int> participants{0};
  std::atomic<bool> exhausted{false};
  std::mutex error_mutex;
  std::string error;

  RunState(const Job& j, int nodes) : job(&j), next(j.tasks.size() * nodes) {}
};

ThreadPool::ThreadPool(int threads, int numa_nodes) {
  spin_us_ = EnvInt("HYBRIDJIT_POOL_SPIN_US", 0, 1000000, kDefaultSpinMicroseconds);
  const std::vector<int> allowed = AllowedCpus();
  threads_ = threads > 0 ? threads : static_cast<int>(allowed.size());
  nodes_forced_ = numa_nodes > 0;
  node_cpus_ = nodes_forced_ ? ForcedNodes(allowed, numa_nodes) : MachineNodes(allowed);
  int max_cpu = 0;
  for (const auto& cpus : node_cpus_) {
    for (int c : cpus) max_cpu = std::max(max_cpu, c);
  }
  cpu_node_.assign(max_cpu + 1, -1);
  std::vector<int> order;  // node-major, so consecutive threads fill a node before the next
  for (size_t n = 0; n < node_cpus_.size(); ++n) {
    for (int c : node_cpus_[n]) {
      cpu_node_[c] = static_cast<int>(n);
      order.push_back(c);
    }
  }
  // Slot 0 is the submitting thread's: it belongs to the caller, so the pool does not pin it; the OS
  // moves it to the one CPU the workers leave free (after a while: a thread of our own pins itself).
  if (threads_ <= static_cast<int>(order.size())) submitter_cpu_ = order[0];
  for (int t = 1; t < threads_; ++t) {
    const int cpu = order[t % order.size()];
    workers_.emplace_back(&ThreadPool::Worker, this, cpu_node_[cpu]);
    // Pinned here rather than by the worker itself: the pool is pinned once it exists, however late its threads
    // first run (on a loaded machine they may not have run yet when the constructor returns).
    PinThread(workers_.back().native_handle(), cpu);
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> guard(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& w : workers_) w.join();
}

int ThreadPool::NodeOfCurrentCpu() const {
  const int cpu = sched_getcpu();
  if (cpu < 0 || cpu >= static_cast<int>(cpu_node_.size()) || cpu_node_[cpu] < 0) return 0;
  return cpu_node_[cpu];
}

ThreadPool::RunState* ThreadPool::FindOpen() {
  for (RunState* s : queue_) {
    if (!s->exhausted.load(std::memory_order_acquire)) return s;
  }
  return nullptr;
}

void PinCurrentThread(int cpu) { PinThread(pthread_self(), cpu); }

void ThreadPool::Worker(int node) {
  _mm_setcsr(kDefaultMxcsr);
  for (;;) {
    // Spin a while before sleeping so that back-to-back jobs do not pay a wake-up each.
    const auto spin_end = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
    while (open_jobs_.load(std::memory_order_acquire) == 0 && std::chrono::steady_clock::now() < spin_end) {
      __builtin_ia32_pause();
    }
    RunState* state = nullptr;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      // One lookup: `exhausted` changes outside the lock, so a second FindOpen could find nothing.
      wake_.wait(lock, [&] { return stop_ || (state = FindOpen()) != nullptr; });
      if (stop_) return;
      // A job that became exhausted meanwhile is harmless to join: its lists are empty.
      state->participants.fetch_add(1, std::memory_order_acq_rel);
    }
    Participate(*state, node);
    state->participants.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::Participate(RunState& state, int node) {
  const Job& job = *state.job;
  const int n_nodes = nodes();
  for (size_t phase = 0; phase < job.tasks.size(); ++phase) {
    for (int k = 0; k < n_nodes; ++k) {
      const int n = (node + k) % n_nodes;
      const std::vector<int64_t>& list = job.tasks[phase][n];
      std::atomic<int64_t>& next = state.next[phase * n_nodes + n];
      for (;;) {
        const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
        if (i >= static_cast<int64_t>(list.size())) break;
        try {
          job.run(list[i]);
        } catch (const std::exception& e) {
          std::lock_guard<std::mutex> guard(state.error_mutex);
          if (state.error.empty()) state.error = e.what()[0] ? e.what() : "task failed";
        }
        state.unfinished.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }
  if (!state.exhausted.exchange(true, std::memory_order_acq_rel)) {
    open_jobs_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

std::string ThreadPool::Run(const Job& job) {
  if (job.tasks.empty()) return "";
  for (const auto& phase : job.tasks) {
    if (static_cast<int>(phase.size()) != nodes()) return "internal error: a job phase has the wrong node count";
  }
  RunState state(job, nodes());
  int64_t total = 0;
  for (const auto& phase : job.tasks) {
    for (const auto& list : phase) total += static_cast<int64_t>(list.size());
  }
  if (total == 0) return "";
  state.unfinished.store(total, std::memory_order_relaxed);
  const bool share = !workers_.empty();
  if (share) {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      queue_.push_back(&state);
      open_jobs_.fetch_add(1, std::memory_order_acq_rel);
    }
    wake_.notify_all();
  } else {
    open_jobs_.fetch_add(1, std::memory_order_acq_rel);
  }
  const unsigned caller_mxcsr = _mm_getcsr();
  _mm_setcsr(kDefaultMxcsr);
  Participate(state, NodeOfCurrentCpu());
  SpinUntil([&] { return state.unfinished.load(std::memory_order_acquire) == 0; });
  _mm_setcsr(caller_mxcsr);
  if (share) {
    {
      std::lock_guard<std::mutex> guard(mutex_);
      queue_.erase(std::find(queue_.begin(), queue_.end(), &state));
    }
    // A worker may still be between its last task and leaving the job.
    SpinUntil([&] { return state.participants.load(std::memory_order_acquire) == 0; });
  }
  return state.error;
}

std::shared_ptr<ThreadPool> ThreadPool::Global() {
  GlobalPool& holder = Holder();
  std::lock_guard<std::mutex> guard(holder.mutex);
  if (!holder.pool) {
    holder.pool = std::make_shared<ThreadPool>(EnvCount("HYBRIDJIT_THREADS"), EnvCount("HYBRIDJIT_NUMA_NODES"));
  }
  return holder.pool;
}

void ThreadPool::ConfigureGlobal(int threads, int numa_nodes) {
  auto pool = std::make_shared<ThreadPool>(threads, numa_nodes);
  std::shared_ptr<ThreadPool> old;
  GlobalPool& holder = Holder();
  {
    std::lock_guard<std::mutex> guard(holder.mutex);
    old = std::move(holder.pool);
    holder.pool = std::move(pool);
  }
  // `old` is released here, outside the lock: its workers are joined once its last job finishes.
}

}  // namespace hybridjit
