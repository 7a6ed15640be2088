// A persistent pool of pinned worker threads that runs jobs of small tasks, grouped by NUMA node.
//
// The thread that submits a job takes part in it, so a job finishes even when every worker is busy
// with other jobs (two XLA threads calling at once, a job submitted from a thread of another pool):
// submitting never deadlocks and never needs a free worker. Tasks come in phases, and each phase holds
// one ordered list per node. A thread takes the tasks of its own node first, then those of the other
// nodes, and moves to the next phase only when every task of the current one has been taken. So a
// task may wait for tasks of earlier phases (they are all taken by running threads) but never for
// tasks of its own or a later phase.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace hybridjit {

struct Job {
  // Runs one task by id. May throw: the first message becomes the job's error, and the other tasks
  // still run (they can look at Failed() to skip their work).
  std::function<void(int64_t)> run;
  std::vector<std::vector<std::vector<int64_t>>> tasks;  // [phase][node] -> task ids in order
};

// Pins the calling thread to one CPU.
void PinCurrentThread(int cpu);

// Busy-waits for `done` (a dependency between tasks), yielding the CPU after a short spin so that an
// oversubscribed machine still makes progress.
template <typename Done>
void SpinUntil(Done done) {
  for (int i = 0; !done(); ++i) {
    if (i < 4096) {
      __builtin_ia32_pause();
    } else {
      std::this_thread::yield();
    }
  }
}

class ThreadPool {
 public:
  // `threads` counts the submitting thread: threads - 1 workers are started, pinned one per CPU of
  // this process's affinity mask (wrapping around if there are more threads than CPUs). `numa_nodes`
  // > 0 splits the CPUs into that many logical nodes (to exercise per-node slicing on a one-node
  // machine); 0 uses the machine's nodes from /sys.
  ThreadPool(int threads, int numa_nodes);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return threads_; }
  // Microseconds an idle worker spins before it sleeps (HYBRIDJIT_POOL_SPIN_US, default 200).
  int spin_us() const { return spin_us_; }
  // The CPU the workers leave free for the submitting thread, or -1 when every CPU has a worker. A
  // submitting thread that the process owns (the GPU hand-off's worker) pins itself there.
  int submitter_cpu() const { return submitter_cpu_; }
  int nodes() const { return static_cast<int>(node_cpus_.size()); }
  bool nodes_forced() const { return nodes_forced_; }

  // Runs every task of `job` and returns the first error ("" if none). Callable from any thread, also
  // concurrently; the caller works on the job and returns once every task has finished.
  std::string Run(const Job& job);

  // The pool the routed experts use: HYBRIDJIT_THREADS (default: the CPUs of the affinity mask) and
  // HYBRIDJIT_NUMA_NODES (default: the machine's), created at first use.
  static std::shared_ptr<ThreadPool> Global();
  // Replaces the global pool (0 = the default for that setting). Jobs running on the old pool finish
  // on it.
  static void ConfigureGlobal(int threads, int numa_nodes);

 private:
  struct RunState;

  void Worker(int node);
  void Participate(RunState& state, int node);
  RunState* FindOpen();
  int NodeOfCurrentCpu() const;

  int threads_ = 1;
  int spin_us_ = 0;
  int submitter_cpu_ = -1;
  bool nodes_forced_ = false;
  std::vector<std::vector<int>> node_cpus_;
  std::vector<int> cpu_node_;  // by CPU number; -1 for CPUs outside the mask

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<RunState*> queue_;
  std::atomic<int> open_jobs_{0};
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace hybridjit
