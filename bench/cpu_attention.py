"""Decode attention on the CPU over a KV cache in host memory (hybridjit.ops.cpu_attention), against the read floor.

    python bench/cpu_attention.py                                  # GQA and MLA, 64 and 256 slots x 1024 positions
    python bench/cpu_attention.py --kinds mla --slots 1 8 --context 4096 16384
    python bench/cpu_attention.py --quick --slots 4 --context 512  # a small check (seconds on 2 cores)

A decode step's attention reads each row's visible cache once for one query token, so the figure that matters
is the cache read rate against the host's memory read floor: GB/s = bytes of the visible cache (every slot full
to --context, keys and values or latent and rope keys, as stored) / time, and ratio_to_floor = that over the read
floor taken next to the case (one read pass in the best pattern before every timed call, the case's floor being
their median: the lent machines share memory bandwidth with other tenants; the pass also evicts the cache from
the CPU caches, so that no call finds it there). GFLOP/s count the multiply-adds of scores and values (2 FLOP
each): per position and query head, GQA 2 * 2 * head_dim, MLA 2 * (rank + rope_dim) + 2 * rank. MLA does ~240
FLOP per cache byte at DeepSeek-V3's shapes, so it is bound by arithmetic, not memory (its ratio_to_floor says by
how much); GQA at Qwen3-30B-A3B's (8 query heads per KV head) does 8.

Shapes: GQA at Qwen3-30B-A3B (32 query heads, 4 KV heads, head_dim 128), MLA at DeepSeek-V3 (128 heads, rank
512, rope_dim 64), bfloat16 caches unless --dtype says otherwise. Ends with one JSON line.
"""

import argparse
import json
import statistics
import sys
import time

import ml_dtypes
import numpy as np

from floors import ReadFloor, floors_line, machine, memory_floors
from hybridjit.ops.cpu_attention import gqa_decode, mla_decode

DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "f32": np.dtype(np.float32)}


def gqa_case(args, rng, slots, context, dtype):
    """(call, cache bytes read, FLOP) of one GQA decode step over full caches."""
    heads, kv_heads, head_dim = args.gqa_heads, args.kv_heads, args.head_dim
    q = rng.standard_normal((slots, heads, head_dim), np.float32)
    k = rng.standard_normal((slots, context, kv_heads, head_dim), np.float32).astype(dtype)
    v = rng.standard_normal((slots, context, kv_heads, head_dim), np.float32).astype(dtype)
    lengths = np.full(slots, context, np.int32)
    scale = head_dim**-0.5
    positions = slots * context
    return (lambda: gqa_decode(q, k, v, lengths, scale)), k.nbytes + v.nbytes, positions * heads * 4 * head_dim


def mla_case(args, rng, slots, context, dtype):
    """(call, cache bytes read, FLOP) of one MLA decode step over full caches."""
    heads, rank, rope_dim = args.mla_heads, args.rank, args.rope_dim
    q_latent = rng.standard_normal((slots, heads, rank), np.float32)
    q_rope = rng.standard_normal((slots, heads, rope_dim), np.float32)
    latent = rng.standard_normal((slots, context, rank), np.float32).astype(dtype)
    k_rope = rng.standard_normal((slots, context, rope_dim), np.float32).astype(dtype)
    lengths = np.full(slots, context, np.int32)
    scale = (rank + rope_dim) ** -0.5
    flop = slots * context * heads * (2 * (rank + rope_dim) + 2 * rank)
    return (lambda: mla_decode(q_latent, q_rope, latent, k_rope, lengths, scale)), latent.nbytes + k_rope.nbytes, flop


CASES = {"gqa": gqa_case, "mla": mla_case}


def median_ms(run, floor: ReadFloor, repeats: int, warmup: int = 2) -> float:
    """Median ms of run() after `warmup` calls, a read-floor pass before every timed call."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        floor.sample()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def row(r) -> str:
    return (f"{r['kind']:>4} {r['dtype']:>5} {r['slots']:>5} x {r['context']:<6} {r['median_ms']:>10.3f} ms "
            f"{r['gbps']:>8.1f} GB/s {r['ratio_to_floor']:>6.1%} of {r['floor_gbps']:6.1f} "
            f"{r['gflops']:>9.1f} GFLOP/s")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", choices=tuple(CASES), default=list(CASES))
    parser.add_argument("--slots", nargs="+", type=int, default=[64, 256], help="rows of the batch")
    parser.add_argument("--context", nargs="+", type=int, default=[1024], help="cached positions of every row")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="the caches' element type")
    parser.add_argument("--gqa-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--mla-heads", type=int, default=128)
    parser.add_argument("--rank", type=int, default=512)
    parser.add_argument("--rope-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per case")
    parser.add_argument("--quick", action="store_true", help="smaller floor measurement and 3 timed calls a case")
    args = parser.parse_args()
    if args.quick:
        args.repeats = min(args.repeats, 3)
    rng = np.random.default_rng(0)
    floors = memory_floors(bytes_per_array=(1 << 28) if args.quick else (1 << 30), repeats=3 if args.quick else 5)
    print(f"machine: {machine()}")
    print(floors_line(floors))
    floor = ReadFloor(floors, floors["bytes_per_array"] // 2)
    results = []
    for kind in args.kinds:
        for slots in args.slots:
            for context in args.context:
                run, cache_bytes, flop = CASES[kind](args, rng, slots, context, DTYPES[args.dtype])
                ms = median_ms(run, floor, args.repeats)
                gbps = cache_bytes / (ms * 1e6)
                floor_gbps = floor.take()
                result = {"kind": kind, "dtype": args.dtype, "slots": slots, "context": context,
                          "median_ms": round(ms, 3), "cache_bytes": cache_bytes, "gbps": round(gbps, 2),
                          "gflops": round(flop / (ms * 1e6), 1), "floor_gbps": round(floor_gbps, 1),
                          "ratio_to_floor": round(gbps / floor_gbps, 3)}
                print(row(result), flush=True)
                results.append(result)
    shapes = {"gqa": {"heads": args.gqa_heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim},
              "mla": {"heads": args.mla_heads, "rank": args.rank, "rope_dim": args.rope_dim},
              "command": " ".join(sys.argv)}
    print(json.dumps({"bench": "cpu_attention", "machine": {**machine(), **shapes}, "floors": floors,
                      "results": results}))


if __name__ == "__main__":
    main()
