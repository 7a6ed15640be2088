"""Floors the benchmarks measure in their own run, so that each figure can be read against this machine.

memory_floors: host memory bandwidth over all cores, measured by a C++ routine of the extension with the
same pinned thread pool the expert kernels use (hybridjit._ffi.memory_bandwidth): a read-only streaming sum
(the floor of memory-bound kernels such as decode GEMV, which only read weights) and a STREAM-style triad
a = b + s * c (STREAM's convention: three arrays' bytes per pass, no write-allocate traffic counted).
"""

import os
import platform

from hybridjit import _ffi


def memory_floors(threads: int | None = None, bytes_per_array: int = 1 << 30, repeats: int = 5) -> dict:
    """{"read_gbps", "triad_gbps", "threads", "bytes_per_array"}: best of `repeats` passes over float32 arrays
    of `bytes_per_array` (far larger than any cache), on `threads` threads (default: the kernels' pool)."""
    return dict(_ffi.memory_bandwidth(bytes_per_array, repeats, threads or 0))


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
    }
