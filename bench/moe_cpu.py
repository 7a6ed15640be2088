"""MoE operator benchmark on the CPU: one routed-experts layer at DeepSeek-V3 expert shapes.

    python bench/moe_cpu.py                      # every format, decode 1 2 4 8 and prefill 128 512 2048 tokens
    python bench/moe_cpu.py --quick              # decode only, top-k + 4 experts per layer (< 1 min on 2 cores)
    python bench/moe_cpu.py --formats fp8 int4 --decode 1 --prefill 2048 --crossover
    python bench/moe_cpu.py --prefill --decode 1 --prefetch 0 256 512 1024 2048   # tune the prefetch distance
    python bench/moe_cpu.py --cache-resident --hidden 2048 --inter 512   # the kernels' rate from cache
    python bench/moe_cpu.py --formats mxfp4 bf16 --hidden 2880 --inter 2880 --top-k 4   # gpt-oss-120b's experts

Each case runs the operator (hybridjit_ffi through routed_experts_host: the same C++ entry as the XLA custom
call, without XLA's dispatch) on `tokens` tokens routed top-k uniformly at random, fresh routing per call,
and reports the median latency, TFLOP/s (2 * 3 * hidden * inter multiply-adds per routed token), and the
effective GB/s of weight bytes read (the distinct experts a call touches, weights and scales as stored).
Decode layers hold enough experts (a few GB) that a call's experts are not in cache from the previous call;
prefill holds 32 (the issue's setting: 2048 tokens x top-8 / 32 = 512 tokens per expert). The floors are
measured in the same process: memory read (a streaming sum, best of several read patterns) and triad
bandwidth over all cores. Each decode figure is also given as a fraction of the read bandwidth
(ratio_to_floor) taken next to it: one read pass in the best pattern before every timed call, the case's
floor being their median (the lent machines share memory bandwidth with other tenants, so a floor taken
once per process can be 25% off the one a case saw).

Formats: fp8 (E4M3FN, 128x128 block scales), bf16, int8 and int4 (one float32 scale per 128 input columns of
a row), int8_row (one scale per row: AMX keeps int8 tiles), mxfp4 (as gpt-oss releases its experts: e2m1 with
an e8m0 scale per 32, gate and up interleaved in one matrix, expert biases and the clamped SwiGLU); named only,
the GGUF block formats q8_0, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_xs, q4_k_m (Q4_K gate/up, Q6_K down) and q2_k_m
(Q2_K's mix: Q2_K gate/up, Q3_K down), e.g. `--formats q4_k_m q6_k
q8_0 --hidden 4096 --inter 1536` for Qwen3-235B's experts; --ggml-peer runs llama.cpp's own MoE layer (MUL_MAT_ID,
bench/ggml_moe_peer.c built against ggml's sources on this host) on the same blocks beside them. Baselines in
the same process: NumPy (float32 weights, matmul per expert) and PyTorch CPU (bfloat16 weights, if torch is
installed). --crossover times AVX-512 against AMX by tokens per expert (the basis of
HYBRIDJIT_AMX_MIN_TOKENS). Ends with one JSON line.

Prefill cases of issue #27 (tokens over a number of experts, each format, kt-kernel alongside):

    g++ -O2 -march=native bench/amx_tiles.cc -o /tmp/amx_tiles && /tmp/amx_tiles | tail -1 > /tmp/amx_tiles.json
    python bench/moe_cpu.py --formats bf16 fp8 int8 int4 --decode --prefill-cases 2048:32 2048:256 256:256 8192:256 \
        --no-baselines --amx-ceilings /tmp/amx_tiles.json --time-limit 540

(--time-limit: a run cut short still ends with the JSON line of the cases it measured; kt-kernel's FP8 takes ~3 s a
call at these sizes.)

kt-kernel (the peer, `pip install kt-kernel`, or bench/slim_peer_wheel.py's wheel) runs on the same shapes in this
process when it is installed and the host has AMX (else a printed line says why not): its AMX MoE classes
(`kt_kernel_ext.moe`: AMXBF16_MOE; AMXFP8_MOE on our fp8 weights and 128x128 scales; AMXInt8_MOE and AMXInt4_MOE,
which quantize bf16 weights per output channel at load: coarser than our int8 / int4 with a scale per 128
inputs), driven from NumPy through the extension module itself (no torch needed), with the same thread count,
routing and timing as ours. --amx-ceilings adds, beside each prefill figure, the instruction peak and the L2-bound
sweep ceiling of its tile type (bf16 or int8) measured by bench/amx_tiles.cc on this host.
"""

import argparse
import glob
import importlib.util
import json
import mmap
import signal
import statistics
import sys
import time

import gguf
import ml_dtypes
import numpy as np

from floors import ReadFloor, floors_line, machine, memory_floors
from hybridjit.ops.gguf_experts import register_gguf_layer, row_bytes
from hybridjit.ops.routed_experts import (
    kernel_info,
    layer_kernel,
    register_layer,
    routed_experts_host,
    set_amx_min_tokens,
    set_cpu_kernel,
    set_prefetch_bytes,
)

FORMATS = ("fp8", "bf16", "int8", "int4", "int8_row", "mxfp4")
# GGUF block formats (issue #24), benched when named: gate/up and down types; q4_k_m is Q4_K_M's experts.
GGUF_FORMATS = {"q8_0": ("Q8_0", "Q8_0"), "q4_k": ("Q4_K", "Q4_K"), "q5_k": ("Q5_K", "Q5_K"),
                "q6_k": ("Q6_K", "Q6_K"), "q4_k_m": ("Q4_K", "Q6_K"), "q2_k": ("Q2_K", "Q2_K"),
                "q3_k": ("Q3_K", "Q3_K"), "q2_k_m": ("Q2_K", "Q3_K"), "iq4_xs": ("IQ4_XS", "IQ4_XS")}  # fmt: skip
GROUP = 128


def make_gguf_projection(rng, gguf_type: str, n: int, rows: int, cols: int) -> list[np.ndarray]:
    """n experts' [rows, cols] matrices as random GGUF blocks with small finite fp16 scales (the codes are any)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[gguf_type]]
    blocks = random_bytes(rng, n * rows * (cols // block) * nbytes).reshape(n, rows, cols // block, nbytes)
    for at in {"Q8_0": [0], "Q6_K": [208], "Q2_K": [80, 82], "Q3_K": [108], "IQ4_XS": [0]}.get(gguf_type, [0, 2]):
        d = rng.uniform(1e-4, 1e-3, blocks.shape[:3]).astype(np.float16)
        blocks[..., at : at + 2] = d.view(np.uint8).reshape(*blocks.shape[:3], 2)
    return list(blocks.reshape(n, rows, -1))


RANDOM_BLOCK = (1 << 28) + 4099  # bytes; not a multiple of any row, so that repeats fall at other columns


def random_bytes(rng, n: int) -> np.ndarray:
    """n random bytes; past 256 MiB, one random block repeated (the generator makes ~0.2-1 GB/s, too slow for the
    tens of GB of 256 DeepSeek-V3 experts; repeats far apart in memory change no timing)."""
    if n <= RANDOM_BLOCK:
        return np.frombuffer(rng.bytes(n), np.uint8).copy()
    return np.resize(np.frombuffer(rng.bytes(RANDOM_BLOCK), np.uint8), n)


def make_projection(rng, fmt: str, n: int, rows: int, cols: int):
    """n experts' [rows, cols] matrices (views into one buffer) and their scales, random but well-formed."""
    if fmt == "fp8":
        raw = random_bytes(rng, n * rows * cols)
        # As in real checkpoints (block scale = amax / 448, values ~N(0, (amax / 4.5)^2)): no NaN, denormals
        # ~1.2e-4 of the codes and zeros ~1e-5 (the kernels correct both after their shift expansion).
        raw[(raw & 0x78) == 0] |= 0x08
        raw[(raw & 0x7F) == 0x7F] -= 1
        raw[::8191] &= 0x87  # exponent field 0: a denormal, or a zero where the mantissa is 0 too
        raw[::99991] = 0
        weights = raw.view(ml_dtypes.float8_e4m3fn).reshape(n, rows, cols)
        grid = (-(-rows // 128), -(-cols // 128))
    elif fmt == "bf16":
        bits = random_bytes(rng, 2 * n * rows * cols).view(np.uint16)
        bits &= 0x80FF  # in place: 256 experts are 22 GB
        bits |= 0x3C00
        weights = bits.view(ml_dtypes.bfloat16).reshape(n, rows, cols)  # +-[2^-7, 2^-5)
        grid = None
    elif fmt in ("int8", "int8_row"):
        raw = random_bytes(rng, n * rows * cols).view(np.int8)
        raw[raw == -128] = -127
        weights = raw.reshape(n, rows, cols)
        grid = (rows, 1 if fmt == "int8_row" else -(-cols // GROUP))
    elif fmt == "mxfp4":  # every e2m1 code, e8m0 scales near 2^-7 (unit-order outputs at gpt-oss sizes)
        weights = random_bytes(rng, n * rows * (cols // 2)).reshape(n, rows, cols // 2)
        scales = rng.integers(119, 122, (n, rows, cols // 32), dtype=np.uint8)
        return list(weights), list(scales)
    else:  # int4
        weights = random_bytes(rng, n * rows * (cols // 2)).reshape(n, rows, cols // 2)
        grid = (rows, -(-cols // GROUP))
    scales = None if grid is None else (rng.uniform(0.5, 1.5, (n, *grid)) * 1e-3).astype(np.float32)
    return list(weights), None if scales is None else list(scales)


def on_huge_pages(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """The arrays copied into one anonymous mapping advised into transparent huge pages."""
    stacked = np.stack(arrays)
    buffer = mmap.mmap(-1, max(1, stacked.nbytes))
    buffer.madvise(mmap.MADV_HUGEPAGE)
    out = np.frombuffer(buffer, stacked.dtype, stacked.size).reshape(stacked.shape)
    out[...] = stacked
    return list(out)


def make_layer(rng, fmt, n_experts, hidden, inter, memory="numpy"):
    """A registered layer of random experts, held in `memory`: numpy (the allocator's pages), huge (advised
    into huge pages) or pinned (hybridjit.pinned_experts: pinned host memory of the first JAX device, as
    hybrid decode holds experts)."""
    if fmt in GGUF_FORMATS:
        if memory == "pinned":
            raise ValueError("GGUF experts are not pinned (hybridjit/weights.py): use --memory numpy or huge")
        gate_up, down_type = GGUF_FORMATS[fmt]
        gate, up = (make_gguf_projection(rng, gate_up, n_experts, inter, hidden) for _ in range(2))
        down = make_gguf_projection(rng, down_type, n_experts, hidden, inter)
        if memory == "huge":
            gate, up, down = on_huge_pages(gate), on_huge_pages(up), on_huge_pages(down)
        return register_gguf_layer(gate, up, down, gguf_type=gate_up, down_type=down_type, hidden=hidden, inter=inter)
    if fmt == "mxfp4":
        return make_gpt_oss_layer(rng, n_experts, hidden, inter, memory)
    gate, gate_s = make_projection(rng, fmt, n_experts, inter, hidden)
    up, up_s = make_projection(rng, fmt, n_experts, inter, hidden)
    down, down_s = make_projection(rng, fmt, n_experts, hidden, inter)
    scales = {} if fmt == "bf16" else {
        "gate_scale": gate_s, "up_scale": up_s, "down_scale": down_s,
        "block": {"fp8": (128, 128), "int8_row": (1, 128 * -(-max(hidden, inter) // 128))}.get(fmt, (1, GROUP)),
    }
    if memory == "huge":
        gate, up, down = on_huge_pages(gate), on_huge_pages(up), on_huge_pages(down)
    return register(memory, gate, up, down, **scales)


def make_gpt_oss_layer(rng, n_experts, hidden, inter, memory):
    """A layer as gpt-oss holds it: MXFP4 gate_up [2 * inter, hidden] with gate and up rows interleaved, down,
    float32 expert biases and the clamped SwiGLU (gpt-oss's alpha and limit)."""
    gate_up, gate_up_s = make_projection(rng, "mxfp4", n_experts, 2 * inter, hidden)
    down, down_s = make_projection(rng, "mxfp4", n_experts, hidden, inter)
    if memory == "huge":
        gate_up, down = on_huge_pages(gate_up), on_huge_pages(down)
    biases = ([rng.standard_normal(2 * inter).astype(np.float32) for _ in range(n_experts)], None,
              [rng.standard_normal(hidden).astype(np.float32) for _ in range(n_experts)])
    return register(memory, gate_up, None, down, gate_scale=gate_up_s, down_scale=down_s, fmt="mxfp4",
                    gate_up_interleaved=True, biases=biases, activation=("clamped_swiglu", 1.702, 7.0))


def register(memory, gate, up, down, **options):
    """register_layer, or with memory "pinned" its drop-in that holds the experts in pinned host memory of the first
    JAX device (hybridjit.pinned_experts.register_pinned, as hybrid decode holds them)."""
    if memory != "pinned":
        return register_layer(gate, up, down, **options)
    import jax  # only here: a pinned layer needs a JAX device, the other layers none

    from hybridjit.pinned_experts import register_pinned

    return register_pinned(gate, up, down, devices=jax.devices()[:1], **options)


def expert_bytes(fmt, hidden, inter) -> int:
    if fmt in GGUF_FORMATS:
        gate_up, down_type = GGUF_FORMATS[fmt]
        return 2 * inter * row_bytes(gate_up, hidden) + hidden * row_bytes(down_type, inter)
    if fmt == "mxfp4":  # nibbles, an e8m0 byte per 32, float32 biases
        return int(3 * hidden * inter * (0.5 + 1 / 32) + 4 * (2 * inter + hidden))
    weights = 3 * hidden * inter * {"fp8": 1, "bf16": 2, "int8": 1, "int8_row": 1, "int4": 0.5}[fmt]
    if fmt == "fp8":
        scales = 3 * (-(-hidden // 128)) * (-(-inter // 128))
    elif fmt == "int8_row":
        scales = 2 * inter + hidden
    elif fmt == "bf16":
        scales = 0
    else:
        scales = 2 * inter * (-(-hidden // GROUP)) + hidden * (-(-inter // GROUP))
    return int(weights + 4 * scales)


def routings(rng, calls, tokens, top_k, n_experts):
    """Uniformly random top-k (distinct experts per token) routing for each call."""
    out = []
    for _ in range(calls):
        ids = np.argsort(rng.random((tokens, n_experts)), axis=1)[:, :top_k].astype(np.int32)
        weights = rng.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32)
        out.append((ids, weights))
    return out


def operator_call(layer, x, jobs=1):
    """run(ids, weights) for median_ms: the operator on `x` with that routing, each token's top-k split into `jobs`
    calls run one after the other (as Expert Deferral splits a layer into its immediate and deferred experts)."""

    def run(ids, weights):
        parts = zip(np.array_split(ids, jobs, axis=1), np.array_split(weights, jobs, axis=1), strict=True)
        for part_ids, part_weights in parts:
            routed_experts_host(layer, x, np.ascontiguousarray(part_ids), np.ascontiguousarray(part_weights))

    return run


def median_ms(run, routes, floor: ReadFloor | None, warmup=2):
    """Median ms of run() over the routes after `warmup` calls, with a read-floor pass before every timed call
    (the case's floor, taken at the same moment; and no call finds the previous call's experts in cache). With
    no floor, the calls run back to back."""
    for ids, weights in routes[:warmup]:
        run(ids, weights)
    times = []
    for ids, weights in routes[warmup:]:
        if floor is not None:
            floor.sample()
        start = time.perf_counter()
        run(ids, weights)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def figures(case, ms, routes, bytes_per_expert, hidden, inter, floor: ReadFloor | None):
    tokens, top_k = routes[0][0].shape
    touched = statistics.mean(len(np.unique(ids)) for ids, _ in routes)
    gbps = touched * bytes_per_expert / (ms * 1e6)
    case.update(
        median_ms=round(ms, 3),
        gbps=round(gbps, 2),
        tflops=round(2 * 3 * hidden * inter * tokens * top_k / (ms * 1e9), 3),
        experts_touched=round(touched, 1),
    )
    if floor is None:
        return case
    floor_gbps = floor.take()
    if case["phase"] == "decode":
        case["floor_gbps"] = round(floor_gbps, 1)
        case["ratio_to_floor"] = round(gbps / floor_gbps, 3)
    return case


def bench_cache_resident(args, rng, floors, results):
    """The decode kernels' rate with the weights in cache: one token through the same top-k experts, called back
    to back with no read pass between calls, so that with a small enough --hidden x --inter the weights stay in
    cache. Its ratio to the read floor says whether the arithmetic can keep up with memory at all, where a call's
    weights take well over its fixed cost (pool and Python call: 30-90 us, bench/RESULTS.md) to read; tiny
    experts measure that fixed cost instead."""
    hidden, inter, top_k = args.hidden, args.inter, args.top_k
    ids = np.arange(top_k, dtype=np.int32)[None]
    routes = [(ids, np.full(ids.shape, 1 / top_k, np.float32))] * (args.repeats + 2)
    x = rng.standard_normal((1, hidden)).astype(ml_dtypes.bfloat16)
    for fmt in args.formats:
        with make_layer(rng, fmt, top_k, hidden, inter) as layer:
            ms = median_ms(operator_call(layer, x), routes, None)
            case = {"impl": "hybridjit", "format": fmt, "phase": "cache-resident", "tokens": 1, "top_k": top_k,
                    "experts": top_k, "kernel": layer_kernel(layer, 1)}
            figures(case, ms, routes, expert_bytes(fmt, hidden, inter), hidden, inter, None)
            case["floor_gbps"] = round(floors["read_gbps"], 1)
            case["ratio_to_floor"] = round(case["gbps"] / floors["read_gbps"], 3)
            results.append(case)
            print(row(case), flush=True)


def decode_experts(bytes_per_expert, quick, top_k):
    """Enough experts that a call's top-k were not read by the previous call: ~4 GB (DeepSeek-V3 has 256)."""
    if quick:
        return top_k + 4
    return int(min(256, max(4 * top_k, 4e9 // bytes_per_expert)))


def prefill_groups(args) -> list[tuple[int, list[int]]]:
    """[(experts, [tokens, ...])] of the prefill cases, grouped by the experts of the layer that serves them."""
    groups: dict[int, list[int]] = {}
    for tokens, experts in args.prefill_cases:
        groups.setdefault(experts, []).append(tokens)
    return list(groups.items())


def phase_runs(args, bytes_per_expert) -> list[tuple[str, int, list[int]]]:
    """[(phase, experts in the layer, [tokens, ...])]: the decode cases, then the prefill cases by expert count."""
    runs = [("decode", decode_experts(bytes_per_expert, args.quick, args.top_k), args.decode)] if args.decode else []
    return runs + [("prefill", experts, tokens_list) for experts, tokens_list in prefill_groups(args)]


def bench_hybridjit(args, rng, floor, results):
    hidden, inter, top_k = args.hidden, args.inter, args.top_k
    for fmt in args.formats:
        per_expert = expert_bytes(fmt, hidden, inter)
        for phase, n_experts, tokens_list in phase_runs(args, per_expert):
            for memory in args.memory:
                with make_layer(rng, fmt, n_experts, hidden, inter, memory) as layer:
                    distances = args.prefetch if phase == "decode" and args.prefetch else [None]
                    splits = args.jobs if phase == "decode" else [1]
                    for tokens, distance, jobs in ((t, d, j) for t in tokens_list for d in distances for j in splits):
                        if distance is not None:
                            set_prefetch_bytes(distance)
                        calls = args.repeats if phase == "decode" else max(3, args.repeats // 6)
                        routes = routings(rng, calls + 2, tokens, top_k, n_experts)
                        x = rng.standard_normal((tokens, hidden)).astype(ml_dtypes.bfloat16)
                        ms = median_ms(operator_call(layer, x, jobs), routes, floor)
                        per_call = tokens * top_k / n_experts
                        case = {"impl": "hybridjit", "format": fmt, "phase": phase, "tokens": tokens, "top_k": top_k,
                                "experts": n_experts, "kernel": layer_kernel(layer, max(1, round(per_call))),
                                "prefetch_bytes": kernel_info()["prefetch_bytes"] if phase == "decode" else None,
                                "memory": memory, "jobs": jobs}
                        results.append(with_ceilings(args, figures(case, ms, routes, per_expert, hidden, inter, floor)))
                        print(row(results[-1]), flush=True)
        if args.prefetch:  # back to the default; without --prefetch, HYBRIDJIT_PREFETCH_BYTES stays in force
            set_prefetch_bytes(None)


def random_f32(rng, n, rows, cols):
    bits = random_bytes(rng, 4 * n * rows * cols).view(np.uint32)
    return list(((bits & 0x807FFFFF) | 0x3C000000).view(np.float32).reshape(n, rows, cols))  # +-[2^-7, 2^-6)


def moe_reference_impl(matmul, silu, zeros, gate, up, down, x, ids, weights):
    """The MoE layer as a user would write it over per-expert weight matrices [out, in]."""
    y = zeros(x.shape)
    for e in np.unique(ids):
        tok, slot = np.nonzero(ids == e)
        xe = x[tok]
        h = silu(matmul(xe, gate[e])) * matmul(xe, up[e])
        y[tok] += matmul(h, down[e]) * weights[tok, slot][:, None]
    return y


def bench_numpy(args, rng, floor, results):
    hidden, inter, top_k = args.hidden, args.inter, args.top_k
    per_expert = 3 * hidden * inter * 4
    for phase, tokens_list in (("decode", args.decode), ("prefill", args.prefill)):
        if not tokens_list:
            continue
        n = decode_experts(per_expert, args.quick, top_k) if phase == "decode" else args.prefill_experts
        gate, up = random_f32(rng, n, hidden, inter), random_f32(rng, n, hidden, inter)  # stored [in, out]
        down = random_f32(rng, n, inter, hidden)
        for tokens in tokens_list:
            routes = routings(rng, (args.repeats if phase == "decode" else 3) + 2, tokens, top_k, n)
            x = rng.standard_normal((tokens, hidden)).astype(np.float32)

            def run(ids, w, x=x, gate=gate, up=up, down=down):
                moe_reference_impl(np.matmul, lambda v: v / (1 + np.exp(-v)), np.zeros, gate, up, down, x, ids, w)

            case = {"impl": "numpy", "format": "f32", "phase": phase, "tokens": tokens, "top_k": top_k, "experts": n}
            results.append(figures(case, median_ms(run, routes, floor), routes, per_expert, hidden, inter, floor))
            print(row(results[-1]), flush=True)
        del gate, up, down


def bench_torch(args, rng, floor, results):
    try:
        import torch
    except ImportError:
        print("torch is not installed: no PyTorch baseline")
        return
    torch.set_num_threads(kernel_info()["threads"])
    hidden, inter, top_k = args.hidden, args.inter, args.top_k
    per_expert = 3 * hidden * inter * 2
    for phase, tokens_list in (("decode", args.decode), ("prefill", args.prefill)):
        if not tokens_list:
            continue
        n = decode_experts(per_expert, args.quick, top_k) if phase == "decode" else args.prefill_experts

        def weights(rows, cols, n=n):
            matrices, _ = make_projection(rng, "bf16", n, rows, cols)
            return [torch.from_numpy(m.view(np.uint16)).view(torch.bfloat16) for m in matrices]

        gate, up, down = weights(inter, hidden), weights(inter, hidden), weights(hidden, inter)
        for tokens in tokens_list:
            routes = routings(rng, (args.repeats if phase == "decode" else 3) + 2, tokens, top_k, n)
            x = torch.randn(tokens, hidden, dtype=torch.bfloat16)

            def run(ids, w, x=x, gate=gate, up=up, down=down, linear=torch.nn.functional.linear):
                # linear: x @ w.T on [out, in] weights, as nn.Linear
                with torch.inference_mode():
                    y = torch.zeros_like(x)
                    wt = torch.from_numpy(w).to(torch.bfloat16)
                    for e in np.unique(ids):
                        tok, slot = np.nonzero(ids == e)
                        tok_t, slot_t = torch.from_numpy(tok), torch.from_numpy(slot)
                        xe = x[tok_t]
                        h = torch.nn.functional.silu(linear(xe, gate[e])) * linear(xe, up[e])
                        y.index_add_(0, tok_t, linear(h, down[e]) * wt[tok_t, slot_t][:, None])
                    return y

            case = {"impl": "torch", "format": "bf16", "phase": phase, "tokens": tokens, "top_k": top_k, "experts": n}
            results.append(figures(case, median_ms(run, routes, floor), routes, per_expert, hidden, inter, floor))
            print(row(results[-1]), flush=True)
        del gate, up, down


def bench_crossover(args, rng, floor, results):
    """Tokens per expert where AMX overtakes AVX-512: 8 experts, every token routed to all of them."""
    if "amx" not in kernel_info()["supported"]:
        print("no AMX on this host: no crossover")
        return
    info = kernel_info()
    hidden, inter = args.hidden, args.inter
    for fmt in args.formats:
        with make_layer(rng, fmt, 8, hidden, inter) as layer:
            for tokens in (2, 4, 8, 16, 32, 64):
                ids = np.tile(np.arange(8, dtype=np.int32), (tokens, 1))
                routes = [(ids, np.full(ids.shape, 0.125, np.float32))] * 7
                x = rng.standard_normal((tokens, hidden)).astype(ml_dtypes.bfloat16)
                for family in ("avx512", "amx"):
                    set_cpu_kernel(family)
                    set_amx_min_tokens(1)
                    ms = median_ms(operator_call(layer, x), routes, floor)
                    case = {"impl": "hybridjit", "format": fmt, "phase": "crossover", "tokens": tokens, "top_k": 8,
                            "experts": 8, "kernel": layer_kernel(layer, tokens)}
                    results.append(figures(case, ms, routes, expert_bytes(fmt, hidden, inter), hidden, inter, floor))
                    print(row(results[-1]), flush=True)
    set_cpu_kernel(info["kernel"])
    set_amx_min_tokens(info["amx_min_tokens"])


AMX_TILES = {"amx_bf16": "bf16", "amx_fp8g": "bf16", "amx_int8": "int8", "amx_int8g": "int8"}


def with_ceilings(args, case):
    """The case with the AMX ceilings of its tile type (bench/amx_tiles.cc's JSON line, --amx-ceilings) beside its
    figure: the instruction peak and the L2-bound sweep, and the figure's fraction of each."""
    tiles = case.get("tiles") or AMX_TILES.get(case.get("kernel", ""))
    if case["phase"] != "prefill" or not args.amx_ceilings or tiles is None:
        return case
    peak, sweep = args.amx_ceilings[f"{tiles}_peak"], args.amx_ceilings[f"{tiles}_sweep"]
    case.update(tiles=tiles, peak_tflops=round(peak, 2), sweep_tflops=round(sweep, 2),
                of_peak=round(case["tflops"] / peak, 3), of_sweep=round(case["tflops"] / sweep, 3))
    return case


# kt-kernel 0.7.2's AMX MoE classes per format, and their tile type.
KT_CLASSES = {"bf16": ("AMXBF16_MOE", "bf16"), "fp8": ("AMXFP8_MOE", "bf16"), "int8": ("AMXInt8_MOE", "int8"),
              "int4": ("AMXInt4_MOE", "int8")}  # fmt: skip


def load_kt_kernel():
    """(kt-kernel's AMX extension module, version) or (None, why not). The module is loaded from its file: the
    package's __init__ imports torch for its wrappers, which the MoE classes themselves do not need."""
    spec = importlib.util.find_spec("kt_kernel")
    if spec is None or not spec.submodule_search_locations:
        return None, "kt-kernel is not installed (pip install kt-kernel, or bench/slim_peer_wheel.py's wheel)"
    if "amx" not in kernel_info()["supported"]:
        return None, "this host has no AMX (kt-kernel's AMX MoE classes need it)"
    found = glob.glob(f"{spec.submodule_search_locations[0]}/_kt_kernel_ext_amx.*.so")
    if not found:
        return None, "kt-kernel has no AMX extension in this install"
    ext_spec = importlib.util.spec_from_file_location("kt_kernel_ext", found[0])
    module = importlib.util.module_from_spec(ext_spec)
    try:
        ext_spec.loader.exec_module(module)
    except ImportError as e:
        return None, f"kt-kernel's AMX extension does not load: {e}"
    from importlib.metadata import version

    return module, version("kt-kernel")


def contiguous_pointer(views: list[np.ndarray]) -> int:
    """The address of n equal matrices that lie one after the other in memory ([n, rows, cols], as kt-kernel takes
    them), checked."""
    base = views[0].ctypes.data
    assert all(v.ctypes.data == base + i * v.nbytes and v.flags.c_contiguous for i, v in enumerate(views))
    return base


def flush_c_stdout():
    """kt-kernel prints from C++ (its pool's greetings); flushed so that nothing of it follows the JSON line."""
    import ctypes

    ctypes.CDLL(None).fflush(None)


def bench_kt_kernel(args, rng, floor, results):
    """kt-kernel's AMX MoE on the prefill cases, same shapes, threads, routing and timing as ours."""
    formats = [f for f in args.formats if f in KT_CLASSES]
    if not formats or not args.prefill_cases:
        return
    kt, version = load_kt_kernel()
    if kt is None:
        print(f"kt-kernel peer skipped: {version}")
        return
    hidden, inter, top_k, threads = args.hidden, args.inter, args.top_k, kernel_info()["threads"]
    cpu = kt.CPUInfer(threads)
    flush_c_stdout()
    print(f"kt-kernel {version} ({getattr(kt, '__int8_kernel__', '?')}), {threads} threads", flush=True)
    for n_experts, tokens_list in prefill_groups(args):
        # bf16 weights serve bf16 and, quantized by kt-kernel at load, int8 and int4; fp8 has its own.
        sources = {}
        for fmt in formats:
            source = "fp8" if fmt == "fp8" else "bf16"
            if source not in sources:
                sources.clear()  # one set of weights at a time (DeepSeek-V3 shapes: up to 22 GB)
                sources[source] = [make_projection(rng, source, n_experts, r, c) for r, c in
                                   ((inter, hidden), (inter, hidden), (hidden, inter))]
            (gate, gate_s), (up, up_s), (down, down_s) = sources[source]
            config = kt.moe.MOEConfig(n_experts, top_k, hidden, inter, 0)
            config.max_len = max(tokens_list)
            config.gate_proj, config.up_proj, config.down_proj = (contiguous_pointer(m) for m in (gate, up, down))
            if fmt == "fp8":
                config.gate_scale, config.up_scale, config.down_scale = (
                    contiguous_pointer(m) for m in (gate_s, up_s, down_s))
                quant = kt.QuantConfig()
                quant.bits, quant.group_size, quant.zero_point, quant.per_channel = 8, 128, False, False
                quant.quant_method = "fp8"
                config.quant_config = quant
            config.pool = cpu.backend_
            class_name, tiles = KT_CLASSES[fmt]
            moe = getattr(kt.moe, class_name)(config)
            cpu.submit(moe.load_weights_task())
            cpu.sync()
            for tokens in tokens_list:
                calls = max(3, args.repeats // 6)
                routes = [(ids.astype(np.int64), w) for ids, w in routings(rng, calls + 2, tokens, top_k, n_experts)]
                x = rng.standard_normal((tokens, hidden)).astype(ml_dtypes.bfloat16)
                y = np.zeros_like(x)
                size = np.array([tokens], np.int64)

                def run(ids, weights, cpu=cpu, moe=moe, x=x, y=y, size=size):
                    cpu.submit(moe.forward_task(size.ctypes.data, top_k, ids.ctypes.data, weights.ctypes.data,
                                                x.ctypes.data, y.ctypes.data, False))
                    cpu.sync()

                ms = median_ms(run, routes, floor)
                case = {"impl": f"kt-kernel {version}", "format": fmt, "phase": "prefill", "tokens": tokens,
                        "top_k": top_k, "experts": n_experts, "kernel": class_name, "tiles": tiles,
                        "quantization": "per output channel" if fmt in ("int8", "int4") else "as ours"}
                per_expert = expert_bytes(fmt, hidden, inter)
                results.append(with_ceilings(args, figures(case, ms, routes, per_expert, hidden, inter, floor)))
                flush_c_stdout()
                print(row(results[-1]), flush=True)
            del moe
        sources.clear()
    del cpu
    flush_c_stdout()


def load_ggml_peer(path: str):
    """bench/ggml_moe_peer.c built against ggml (its header says how), through ctypes."""
    import ctypes

    lib = ctypes.CDLL(path)
    lib.peer_layer_new.restype = ctypes.c_void_p
    lib.peer_layer_new.argtypes = [ctypes.c_int] * 7 + [ctypes.c_void_p] * 3
    lib.peer_layer_run.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 4
    lib.peer_layer_free.argtypes = [ctypes.c_void_p]
    return lib


def bench_ggml_peer(args, rng, floor, results):
    """llama.cpp's MoE layer (MUL_MAT_ID; bench/ggml_moe_peer.c) on the GGUF cases, over the same blocks as ours,
    with the same threads, routing and timing. Each layer's first call is checked against ours on the same
    input (both quantize the activations: to Q8_K / Q8_0 there, int8 per 32 here), so that the two compute the
    same layer."""
    formats = [f for f in args.formats if f in GGUF_FORMATS]
    if not formats:
        return
    lib = load_ggml_peer(args.ggml_peer)
    hidden, inter, top_k, threads = args.hidden, args.inter, args.top_k, kernel_info()["threads"]
    print(f"llama.cpp (ggml) MoE layer, {threads} threads", flush=True)
    for fmt in formats:
        gate_up, down_type = GGUF_FORMATS[fmt]
        per_expert = expert_bytes(fmt, hidden, inter)
        for phase, n_experts, tokens_list in phase_runs(args, per_expert):
            gate, up = (make_gguf_projection(rng, gate_up, n_experts, inter, hidden) for _ in range(2))
            down = make_gguf_projection(rng, down_type, n_experts, hidden, inter)
            types = (int(gguf.GGMLQuantizationType[gate_up]), int(gguf.GGMLQuantizationType[down_type]))
            peer = lib.peer_layer_new(*types, hidden, inter, n_experts, top_k, threads,
                                      *(contiguous_pointer(m) for m in (gate, up, down)))
            if not peer:
                raise SystemExit(f"ggml peer: {fmt} at hidden {hidden}, inter {inter} is not a shape ggml multiplies")
            ours = register_gguf_layer(gate, up, down, gguf_type=gate_up, down_type=down_type, hidden=hidden,
                                       inter=inter)
            try:
                for tokens in tokens_list:
                    calls = args.repeats if phase == "decode" else max(3, args.repeats // 6)
                    routes = routings(rng, calls + 2, tokens, top_k, n_experts)
                    x = rng.standard_normal((tokens, hidden)).astype(ml_dtypes.bfloat16)
                    x32, out = x.astype(np.float32), np.empty((tokens, hidden), np.float32)

                    def run(ids, weights, peer=peer, x32=x32, out=out):
                        if lib.peer_layer_run(peer, x32.shape[0], x32.ctypes.data, ids.ctypes.data,
                                              weights.ctypes.data, out.ctypes.data):
                            raise SystemExit("ggml peer: graph compute failed")

                    ids, weights = routes[0]
                    run(ids, weights)
                    mine = np.asarray(routed_experts_host(ours, x, ids, weights), np.float32)
                    agreement = float(np.sqrt(np.mean((out - mine) ** 2) / np.mean(mine**2)))
                    ms = median_ms(run, routes, floor)
                    case = {"impl": "llama.cpp", "format": fmt, "phase": phase, "tokens": tokens, "top_k": top_k,
                            "experts": n_experts, "kernel": "MUL_MAT_ID", "rel_rms_vs_ours": round(agreement, 5)}
                    results.append(figures(case, ms, routes, per_expert, hidden, inter, floor))
                    print(row(results[-1]) + f"  (rel RMS to ours {agreement:.1e})", flush=True)
            finally:
                lib.peer_layer_free(peer)
                ours.close()


def row(r) -> str:
    ratio = f"{r['ratio_to_floor']:>6.1%} of {r['floor_gbps']:5.1f}" if "ratio_to_floor" in r else " " * 15
    ceilings = (f"  ({r['of_peak']:.0%} of {r['tiles']} peak {r['peak_tflops']:.1f}, "
                f"{r['of_sweep']:.0%} of sweep {r['sweep_tflops']:.1f})") if "of_peak" in r else ""
    experts = f"/{r['experts']:<3}" if r["phase"] == "prefill" else "    "
    return (
        f"{r['impl']:>9} {r['format']:>8} {r.get('memory', ''):>6} {r['phase']:>9} {r['tokens']:>5}{experts} tok  "
        f"{'' if r.get('jobs', 1) == 1 else str(r['jobs']) + ' jobs':>6} "
        f"{r.get('kernel', ''):>9} "
        f"{r['median_ms']:>10.3f} ms {r['gbps']:>8.1f} GB/s {ratio} {r['tflops']:>8.3f} TFLOP/s{ceilings}"
    )


class OutOfTime(Exception):
    """--time-limit passed: the case running then is dropped, and the run ends with the cases measured."""


def on_alarm(signum, frame):
    raise OutOfTime


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", choices=[*FORMATS, *GGUF_FORMATS], default=list(FORMATS))
    parser.add_argument("--decode", nargs="*", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--prefill", nargs="*", type=int, default=[128, 512, 2048])
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--inter", type=int, default=2048)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--prefill-experts", type=int, default=32)
    parser.add_argument("--prefill-cases", nargs="+", default=None, metavar="TOKENS:EXPERTS",
                        help="prefill cases as tokens:experts (e.g. 2048:32 2048:256); replaces --prefill and "
                             "--prefill-experts")
    parser.add_argument("--no-peer", dest="peer", action="store_false",
                        help="skip kt-kernel on the prefill cases even where it is installed")
    parser.add_argument("--ggml-peer", default=None, metavar="SO",
                        help="llama.cpp's MoE layer as a peer on the GGUF formats: bench/ggml_moe_peer.c built as a "
                             "shared library against ggml (its header says how)")
    parser.add_argument("--amx-ceilings", type=str, default=None, metavar="JSON",
                        help="bench/amx_tiles.cc's JSON line (a file): its ceilings beside each AMX prefill figure")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per decode case (prefill: a sixth)")
    parser.add_argument("--no-baselines", dest="baselines", action="store_false")
    parser.add_argument("--crossover", action="store_true")
    parser.add_argument("--prefetch", nargs="+", type=int, default=[],
                        help="run the decode cases once per software-prefetch distance (bytes; 0: off)")
    parser.add_argument("--memory", nargs="+", choices=("numpy", "huge", "pinned"), default=["numpy"],
                        help="where the experts are held: numpy arrays, numpy arrays advised into huge pages, or "
                             "pinned host memory of the first JAX device (as hybrid decode holds them); one run each")
    parser.add_argument("--quick", action="store_true", help="decode only, top-k + 4 experts per layer, few repeats")
    parser.add_argument("--jobs", nargs="+", type=int, default=[1],
                        help="run the decode cases once per number of jobs each token's top-k is split into, one "
                             "after the other (2: Expert Deferral's immediate and deferred experts)")
    parser.add_argument("--cache-resident", action="store_true",
                        help="instead of the cases above: the decode kernels' rate with the weights in cache (pick a "
                             "small --hidden x --inter), against the read floor")
    parser.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                        help="end the run after this long with the JSON line of the cases measured so far (marked "
                             "cut; the case running then is dropped), instead of losing them all to an outer timeout")
    args = parser.parse_args()
    if args.quick:
        args.prefill, args.repeats = [], min(args.repeats, 6)
    if args.prefill_cases is None:
        args.prefill_cases = [(t, args.prefill_experts) for t in args.prefill]
    else:
        args.prefill_cases = [tuple(int(v) for v in case.split(":")) for case in args.prefill_cases]
        # The NumPy / PyTorch baselines run the cases of the first expert count.
        args.prefill_experts, args.prefill = prefill_groups(args)[0]
    if args.amx_ceilings:
        with open(args.amx_ceilings) as f:
            args.amx_ceilings = json.loads(f.read().strip().splitlines()[-1])["tflops"]
    rng = np.random.default_rng(0)
    floors = memory_floors(bytes_per_array=(1 << 28) if args.quick else (1 << 30), repeats=3 if args.quick else 5)
    print(f"machine: {machine()}")
    print(floors_line(floors))
    results = []
    floor = ReadFloor(floors, floors["bytes_per_array"] // 2)
    if args.time_limit:
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, args.time_limit)
    cut = False
    try:
        run_benches(args, rng, floors, floor, results)
    except OutOfTime:
        cut = True
        print(f"time limit ({args.time_limit:g} s) reached: the JSON line holds the {len(results)} cases measured")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    shape = {"hidden": args.hidden, "inter": args.inter, "top_k": args.top_k, "command": " ".join(sys.argv)}
    print(json.dumps({"bench": "moe_cpu", "machine": {**machine(), **shape}, "floors": floors, "results": results,
                      **({"cut": True} if cut else {})}))


def run_benches(args, rng, floors, floor: ReadFloor, results: list) -> None:
    """Every bench the arguments ask for, in order, each appending its cases to `results`."""
    if args.cache_resident:
        bench_cache_resident(args, rng, floors, results)
        return
    bench_hybridjit(args, rng, floor, results)
    if args.peer:
        bench_kt_kernel(args, rng, floor, results)
    if args.ggml_peer:
        bench_ggml_peer(args, rng, floor, results)
    if args.baselines:
        bench_numpy(args, rng, floor, results)
        bench_torch(args, rng, floor, results)
    if args.crossover:
        bench_crossover(args, rng, floor, results)


if __name__ == "__main__":
    main()
