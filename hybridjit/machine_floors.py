"""The machine's floors, measured once and cached (issue #23): the rates the cost models choose with (which prefill
path a prompt takes, the offline policy), measured on this machine rather than taken from another's benchmarks.

- host_read_gbps: host memory read bandwidth on the expert kernels' own thread pool (the extension's
  memory_bandwidth, best of its read patterns): what the CPU experts of decode read at;
- pcie_gbps: pinned host -> device copies (stream-loaded prefill's expert blocks);
- gpu_tflops: a dense bf16 GEMM (prefill's GPU work); gpu_hbm_gbps: device memory read rate (decode's GPU work);
- per expert layer, cpu_expert_tflops: the CPU expert kernels on a prefill's worth of tokens routed uniformly, for
  that layer's format and shapes (AMX, AVX-512 and the formats differ several-fold: bench/RESULTS.md).

They are kept in `floors.json` of the cache directory (resolve.cache_dir()), under a key that names the CPU, its
core count, the kernels' thread count and the accelerator, so that a cache copied to another machine, or a run with
another thread count, measures again. `hybridjit floors` shows them (`--remeasure` to refresh).
"""

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

import hybridjit_ffi as _ffi
from hybridjit.models.registry import family_of
from hybridjit.ops import cpu_attention
from hybridjit.ops.routed_experts import kernel_info, pool_of, routed_experts
from hybridjit.resolve import cache_dir

log = logging.getLogger(__name__)

CACHE_FILE = "floors.json"
# Bytes of each array the host read floor streams over: far larger than the last-level caches of the hosts we run on
# (up to ~300 MB on a whole Emerald Rapids socket), so the floor is memory's, not a cache's.
HOST_READ_BYTES = 1 << 29
# A prefill's worth of tokens for the CPU expert rate: 4096 tokens give DeepSeek-V3's 256 experts 128 each, where
# the AMX kernels run at their many-token rate (bench/prefill.py measures the same).
CPU_EXPERT_TOKENS = 4096


@dataclasses.dataclass(frozen=True)
class MachineFloors:
    """The floors of one machine (None where it has no accelerator)."""

    machine: str
    host_read_gbps: float
    pcie_gbps: float | None
    gpu_tflops: float | None
    gpu_hbm_gbps: float | None


def machine_key(device: jax.Device) -> str:
    """What the floors depend on: the CPU model, its cores, the expert kernels' threads and the accelerator."""
    cpu = "unknown cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    accelerator = f"{device.platform} {device.device_kind}"
    return f"{cpu}; {os.cpu_count()} cores; {kernel_info()['threads']} kernel threads; {accelerator}"


def best_seconds(fn, *args, repeats: int = 10, rounds: int = 3) -> float:
    """Seconds per call of fn(*args): `repeats` calls back to back, best of `rounds`, after one compiling call. Back
    to back, so that a call's dispatch hides behind the one before, as in a running program."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        outs = [fn(*args) for _ in range(repeats)]
        jax.block_until_ready(outs)
        best = min(best, (time.perf_counter() - start) / repeats)
    return best


def pinned_h2d_gbps(device: jax.Device, nbytes: int = 1 << 30, repeats: int = 3, source: jax.Device | None = None
                    ) -> float:
    """Pinned host -> device bandwidth: the best of `repeats` copies of one buffer pinned through `source` (default:
    `device` itself; another device measures a copy from that device's pinned memory)."""
    return concurrent_h2d_gbps([device], nbytes, repeats, [source or device])


def concurrent_h2d_gbps(devices, nbytes: int = 1 << 30, repeats: int = 3, sources=None) -> float:
    """Each link's pinned host -> device bandwidth while every one of `devices` copies a buffer of its own at once
    (pinned through the matching `sources`, default the device itself): nbytes / the time they all took, best of
    `repeats`."""
    sources = sources or devices
    buffers = [jax.device_put(np.zeros(nbytes, np.uint8), SingleDeviceSharding(s, memory_kind="pinned_host"))
               for s in sources]
    targets = [SingleDeviceSharding(d, memory_kind="device") for d in devices]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        copies = [jax.device_put(b, t) for b, t in zip(buffers, targets, strict=True)]
        jax.block_until_ready(copies)
        best = min(best, time.perf_counter() - start)
        for copy in copies:
            copy.delete()
    return nbytes / best / 1e9


@contextlib.contextmanager
def copying(devices, nbytes: int = 1 << 30) -> Iterator[list[float]]:
    """Pinned host -> device copies of `nbytes` to each of `devices`, back to back on a thread while the block runs
    (what the links of stream-loaded prefill or a streamed decode step do beside the CPU's work). Yields the end
    times of the rounds done (a round: one copy to each device), the first ending before the block starts."""
    pinned = [SingleDeviceSharding(d, memory_kind="pinned_host") for d in devices]
    buffers = jax.block_until_ready([jax.device_put(np.zeros(nbytes, np.uint8), p) for p in pinned])
    targets = [SingleDeviceSharding(d, memory_kind="device") for d in devices]

    def copy_round():
        jax.block_until_ready([jax.device_put(b, t) for b, t in zip(buffers, targets, strict=True)])

    copy_round()  # compiles, allocates: the rounds the block sees are copies alone
    stop, ends, started = threading.Event(), [], threading.Event()

    def back_to_back():
        while not stop.is_set():
            copy_round()
            ends.append(time.perf_counter())
            started.set()

    copier = threading.Thread(target=back_to_back, name="copying")
    copier.start()
    started.wait()  # a round done: the copies are under way
    try:
        yield ends
    finally:
        stop.set()
        copier.join()


def device_to_device_gbps(source: jax.Device, target: jax.Device, nbytes: int = 1 << 28, repeats: int = 3) -> float:
    """Device -> device bandwidth (NVLink, or whatever joins them): the best of `repeats` copies of one buffer."""
    buffer = jax.block_until_ready(jax.device_put(np.zeros(nbytes, np.uint8), source))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        copy = jax.block_until_ready(jax.device_put(buffer, target))
        best = min(best, time.perf_counter() - start)
        copy.delete()
    return nbytes / best / 1e9


def gemm_tflops(device: jax.Device, n: int = 8192, repeats: int = 10) -> float:
    """A dense bf16 GEMM n x n x n on `device`: products back to back, best of three rounds."""
    keys = jax.random.split(jax.random.key(0))
    a, b = (jax.device_put(jax.random.normal(k, (n, n), jnp.bfloat16), device) for k in keys)
    return 2 * n**3 / best_seconds(jax.jit(lambda a, b: a @ b), a, b, repeats=repeats) / 1e12


def hbm_read_gbps(device: jax.Device, nbytes: int = 2 << 30, repeats: int = 5) -> float:
    """The device memory's read rate: a float32 sum over `nbytes` of bfloat16, best of `repeats` sums."""
    x = jax.device_put(jnp.ones((nbytes // 2,), jnp.bfloat16), device)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    gbps = nbytes / best_seconds(total, x, repeats=1, rounds=repeats) / 1e9
    x.delete()
    return gbps


def measure(device: jax.Device) -> MachineFloors:
    """Measures every floor now (a few seconds on a GPU machine)."""
    read = float(_ffi.memory_bandwidth(HOST_READ_BYTES, 3, 0)["read_gbps"])
    on_gpu = device.platform == "gpu"
    return MachineFloors(
        machine=machine_key(device),
        host_read_gbps=round(read, 2),
        pcie_gbps=round(pinned_h2d_gbps(device), 2) if on_gpu else None,
        gpu_tflops=round(gemm_tflops(device), 1) if on_gpu else None,
        gpu_hbm_gbps=round(hbm_read_gbps(device), 1) if on_gpu else None,
    )


def cpu_attention_gflops(cfg, dtype, slots: int = 64, context: int = 1024, repeats: int = 3) -> float:
    """The CPU decode-attention kernels' GFLOP/s at the shapes of the model of config `cfg`: a layer of its cache as
    its family's init_cache lays it out (GQA's k and v, or MLA's latent and rope key, in `dtype`) and its query
    heads, `slots` rows of `context` positions, best of `repeats`. Per model, not per machine: the rate follows the
    FLOPs each cache byte takes (MLA ~256, GQA twice its query heads per KV head), several-fold apart
    (bench/RESULTS.md). The default cache, 75-134 MB at V3's and Qwen3's shapes in bfloat16, is larger than the
    CPU's caches, so that the rate is the one a decode step's reads from memory allow too."""
    family = family_of(cfg)
    layer = jax.eval_shape(partial(family.model.init_cache, cfg, slots, context, dtype))[0]
    rng = np.random.default_rng(0)

    def filled(name: str) -> np.ndarray:
        leaf = getattr(layer, name)
        return rng.standard_normal(leaf.shape, np.float32).astype(leaf.dtype)

    def queries(dim: int) -> np.ndarray:
        return rng.standard_normal((slots, cfg.num_attention_heads, dim), np.float32)

    lengths = np.full(slots, context, np.int32)
    if hasattr(layer, "latent"):  # MLA, absorbed: the queries in the latent space and the rope key's
        latent, k_rope = filled("latent"), filled("k_rope")
        args = (cpu_attention.mla_decode, queries(latent.shape[-1]), queries(k_rope.shape[-1]), latent, k_rope)
    else:
        k, v = filled("k"), filled("v")
        args = (cpu_attention.gqa_decode, queries(k.shape[-1]), k, v)
    seconds = best_seconds(*args, lengths, 0.1, repeats=1, rounds=repeats)
    return family.cost.decode_attention_flops(cfg, slots, context) / seconds / 1e9


def cpu_expert_tflops(layer_id: int, hidden: int, inter: int, experts: int, k: int,
                      tokens: int = CPU_EXPERT_TOKENS, repeats: int = 2, threads: int | None = None,
                      copying_to: jax.Device | None = None, weighted: int | None = None) -> float:  # fmt: skip
    """The CPU expert kernels' TFLOP/s on the registered expert layer `layer_id` (ExpertLayer.id), `tokens` tokens
    routed uniformly at random to k of its `experts`, best of `repeats` after one warm-up call: on a pool of
    `threads` (default: the pool as configured), and, with `copying_to`, while pinned host memory is copied to that
    device back to back (a co-executed streamed decode step's CPU share: its link reads the host's memory too).
    With `weighted`, only the pairs of the last that many experts have weight (the rest weigh zero, which the
    kernels skip), as in a co-executed step's call for its CPU blocks; the rate counts those pairs' FLOPs."""
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :k].astype(np.int32)
    weights = np.full(ids.shape, 0.1, np.float32)
    if weighted is not None:
        first = experts - weighted
        mine = ids >= first
        ids, weights = np.where(mine, ids, first).astype(np.int32), np.where(mine, weights, 0.0).astype(np.float32)
    args = jax.device_put((rng.standard_normal((tokens, hidden)).astype(jnp.bfloat16), ids, weights), cpu)
    call = jax.jit(lambda x, ids, w: routed_experts(x, ids, w, layer=layer_id))
    # 256 MiB a copy: back to back all the same (~5 ms each), and little of a loaded model's device memory.
    with pool_of(threads), copying([copying_to], 1 << 28) if copying_to else contextlib.nullcontext():
        seconds = best_seconds(call, *args, repeats=1, rounds=repeats)
    return 2 * 3 * hidden * inter * int(np.count_nonzero(weights)) / seconds / 1e12


class FloorCache:
    """floors.json of a cache directory: machine key -> {"floors": MachineFloors, "cpu_experts": {layer key: TFLOP/s}}.
    A file that cannot be read is measured anew (and rewritten), never an error: it is a cache."""

    def __init__(self, directory: Path | None = None):
        self.path = (directory or cache_dir()) / CACHE_FILE

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("%s: unreadable (%s); measuring again", self.path, e)
            return {}

    def _write(self, data: dict) -> None:
        # Whole or not at all: a reader never sees half a file.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(data, indent=1, sort_keys=True))
        temporary.replace(self.path)

    def floors(self, device: jax.Device, *, remeasure: bool = False) -> MachineFloors:
        """The cached floors of this machine, measured (and cached) when there are none or `remeasure`."""
        key, data = machine_key(device), self._read()
        entry = data.get(key, {})
        if not remeasure:
            try:
                return MachineFloors(**entry["floors"])
            except (KeyError, TypeError):
                pass
        floors = measure(device)
        data[key] = {**entry, "floors": dataclasses.asdict(floors)}
        self._write(data)
        return floors

    def cpu_expert_rates(self, machine: str) -> dict[str, float]:
        """The CPU expert rates cached for `machine` (a machine_key), by layer key."""
        return dict(self._read().get(machine, {}).get("cpu_experts", {}))

    def cpu_expert_tflops(self, device: jax.Device, layer_key: str, measure_layer) -> float:
        """The cached CPU expert rate of layers like `layer_key` on this machine; measure_layer() measures it."""
        key, data = machine_key(device), self._read()
        rates = data.setdefault(key, {}).setdefault("cpu_experts", {})
        if not isinstance(rates.get(layer_key), float):
            rates[layer_key] = float(f"{float(measure_layer()):.4g}")  # significant digits: tiny layers too
            self._write(data)
        return rates[layer_key]
