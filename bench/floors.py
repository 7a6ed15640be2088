"""Floors the benchmarks measure in their own run, so that each figure can be read against this machine.

memory_floors: host memory bandwidth over all cores, measured by a C++ routine of the extension with the
same pinned thread pool the expert kernels use (hybridjit._ffi.memory_bandwidth): a read-only streaming sum
(the floor of memory-bound kernels such as decode GEMV, which only read weights) and a STREAM-style triad
a = b + s * c (STREAM's convention: three arrays' bytes per pass, no write-allocate traffic counted).
"""

import os
import platform
import statistics

import hybridjit_ffi as _ffi


def memory_floors(threads: int | None = None, bytes_per_array: int = 1 << 30, repeats: int = 5) -> dict:
    """{"read_gbps", "read_pattern", "read_by_pattern_gbps", "triad_gbps", "threads", "bytes_per_array"}: best
    of `repeats` passes over float32 arrays of `bytes_per_array` (far larger than any cache), on `threads`
    threads (default: the kernels' pool). The read floor is the best of several read patterns (plain, software
    prefetch, several streams per thread), so that no kernel beats its floor by reading more cleverly."""
    return dict(_ffi.memory_bandwidth(bytes_per_array, repeats, threads or 0))


class ReadFloor:
    """The read floor taken next to a benchmark's cases, one pass at a time, in the best pattern of `floors`, on
    the kernels' own pool (as it is at each pass).

    These machines share memory bandwidth with other tenants: two processes on one machine measured read floors
    of 154 and 199 GB/s minutes apart (bench/RESULTS.md), so a case is judged against passes taken between and
    around its own timed runs, not against a floor measured once at the start."""

    def __init__(self, floors: dict, bytes_per_pass: int = 1 << 29):
        self.pattern = floors["read_pattern"]
        self._reader = _ffi.MemoryReader(bytes_per_pass, 0)
        self._passes: list[float] = []

    def sample(self) -> None:
        """One read pass, kept for the current case."""
        self._passes.append(self._reader.read_gbps(self.pattern))

    def take(self) -> float:
        """The median GB/s of the passes sampled since the last take."""
        passes, self._passes = self._passes, []
        if not passes:
            raise RuntimeError("ReadFloor.take() before any sample()")
        return statistics.median(passes)


def floors_line(floors: dict) -> str:
    patterns = ", ".join(f"{name} {gbps:.1f}" for name, gbps in floors["read_by_pattern_gbps"].items())
    return (f"floors: memory read {floors['read_gbps']:.1f} GB/s ({patterns}), triad {floors['triad_gbps']:.1f} GB/s "
            f"({floors['threads']} threads)")


def transparent_huge_pages() -> str:
    """The kernel's transparent-huge-page mode (always / madvise / never), or "unknown"."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return next(word[1:-1] for word in f.read().split() if word.startswith("["))
    except (OSError, StopIteration):
        return "unknown"


# Kernel memory-management activity that competes with a benchmark for memory bandwidth and cores: page
# migration and compaction (kcompactd, or direct in a faulting thread), huge pages made or collapsed.
VMSTAT_COUNTERS = ("pgmigrate_success", "compact_stall", "compact_daemon_wake", "thp_fault_alloc",
                   "thp_collapse_alloc", "pgmajfault")


def vmstat() -> dict[str, int]:
    """The VMSTAT_COUNTERS of /proc/vmstat now (empty where there is none): subtract two to see what the kernel
    did in between."""
    try:
        with open("/proc/vmstat") as f:
            pairs = (line.split() for line in f)
            return {name: int(value) for name, value in pairs if name in VMSTAT_COUNTERS}
    except OSError:
        return {}


def machine() -> dict:
    """What the figures were measured on: CPU model, cores the process may use, and the kernels chosen."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    info = _ffi.kernel_info()
    return {
        "cpu": model,
        "cpus": len(os.sched_getaffinity(0)),
        "kernel": info["kernel"],
        "threads": info["threads"],
        "numa_nodes": info["numa_nodes"],
        "transparent_huge_pages": transparent_huge_pages(),
    }
