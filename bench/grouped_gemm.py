"""One expert block's projection at long-prompt sizes: padded batched GEMM against grouped (ragged) GEMMs.

    python bench/grouped_gemm.py [--pairs 65536] [--skew 0.2]

Stream-loaded prefill multiplies each block of 32 experts by its routed tokens as one batched GEMM over
[experts, capacity, hidden] slots, every expert padded to the busiest one's count (stream_prefill._capacity), so
skewed routing wastes the padded slots (occupancy 0.57-0.68 at 64K tokens, bench/RESULTS.md). A grouped GEMM over
the routed pairs sorted by expert wastes none, if it runs near the dense rate. This times, on one GPU, the gate
projection's shape (K 7168 -> N 2048) for `--pairs` pairs over 32 experts with lognormal(0, --skew) loads:
  padded_einsum     the batched einsum at stream_prefill's capacity (the busiest expert's count rounded up to an
                    eighth of its power of two, stream_prefill._capacity);
  lax_ragged_dot    jax.lax.ragged_dot (DESIGN.md §5: far from the GEMM rate on CUDA);
  mosaic_ragged_dot Pallas Mosaic GPU's Hopper grouped GEMM (jax.experimental.pallas.ops.gpu.ragged_dot_mgpu),
                    at a few tile configurations;
and a dense GEMM of the same useful work. TFLOP/s count the useful work (2 x pairs x K x N) for every variant;
`ratio_to_gemm` divides by that dense GEMM. Each is timed as the best of three rounds of back-to-back calls.
Ends with one JSON line.
"""

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from hybridjit.stream_prefill import _capacity
from prefill import best_seconds

EXPERTS, K, N = 32, 7168, 2048
# (block_m, block_n, block_k, max_concurrent_steps, grid_block_n); others tried on an H100 ran at 96-393 TFLOP/s.
MOSAIC_CONFIGS = [(128, 128, 64, 4, 8), (128, 128, 64, 6, 2), (192, 128, 64, 4, 4), (192, 128, 64, 4, 8),
                  (192, 128, 64, 5, 4)]


def group_sizes(pairs: int, skew: float) -> np.ndarray:
    load = np.random.default_rng(0).lognormal(0.0, skew, EXPERTS)
    sizes = np.floor(load / load.sum() * pairs).astype(np.int32)
    sizes[np.argmax(sizes)] += pairs - sizes.sum()
    return sizes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=65536, help="routed pairs in the block (64K tokens: 65536)")
    parser.add_argument("--skew", type=float, default=0.2, help="sigma of the experts' lognormal loads")
    args = parser.parse_args(argv)
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    sizes = group_sizes(args.pairs, args.skew)
    capacity = _capacity(int(sizes.max()))
    occupancy = args.pairs / (EXPERTS * capacity)
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (args.pairs, K), jnp.bfloat16)  # the pairs' tokens, sorted by expert
    w = jax.random.normal(keys[1], (EXPERTS, N, K), jnp.bfloat16)  # [experts, out, in], as stored
    slots = jax.random.normal(keys[2], (EXPERTS, capacity, K), jnp.bfloat16)
    sizes_device = jnp.asarray(sizes)
    useful = 2.0 * args.pairs * K * N

    gemm_s = best_seconds(jax.jit(lambda x, w: x @ w[0].T), x, w)
    gemm = useful / gemm_s / 1e12
    device = jax.devices()[0].device_kind
    print(f"grouped_gemm: {device}; {args.pairs} pairs over {EXPERTS} experts, busiest {sizes.max()} "
          f"(x{sizes.max() / sizes.mean():.2f} the mean), capacity {capacity}, occupancy {occupancy:.2f}; "
          f"dense GEMM of the same work {gemm_s * 1e3:.2f} ms, {gemm:.0f} TFLOP/s")
    cases = {
        "padded_einsum": (jax.jit(lambda s, w: jnp.einsum("ecd,efd->ecf", s, w)), (slots, w)),
        "lax_ragged_dot": (jax.jit(lambda x, w, g: jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), g)),
                           (x, w, sizes_device)),
    }
    for config in MOSAIC_CONFIGS:
        bm, bn, bk, steps, gbn = config
        fn = functools.partial(ragged_dot_mgpu.ragged_dot, group_sizes=sizes_device, block_m=bm, block_n=bn,
                               block_k=bk, max_concurrent_steps=steps, grid_block_n=gbn, transpose_rhs=True)
        cases["mosaic_ragged_dot " + "/".join(map(str, config))] = (jax.jit(fn), (x, w))
    results = []
    for name, (fn, fn_args) in cases.items():
        case = {"kernel": name}
        try:
            s = best_seconds(fn, *fn_args)
        except Exception as e:  # a configuration that does not fit this GPU is a finding, not a failure
            case["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            print(f"{name:32s} {case['error']}")
        else:
            tflops = useful / s / 1e12
            case.update(ms=round(1e3 * s, 3), tflops=round(tflops, 1), ratio_to_gemm=round(tflops / gemm, 3))
            print(f"{name:32s} {case['ms']:8.3f} ms {tflops:6.0f} TFLOP/s {tflops / gemm:6.1%} of GEMM")
        results.append(case)
    print(json.dumps({"bench": "grouped_gemm", "device": device, "pairs": args.pairs, "experts": EXPERTS, "k": K,
                      "n": N, "skew": args.skew, "busiest_over_mean": round(float(sizes.max() / sizes.mean()), 3),
                      "capacity": capacity, "occupancy": round(occupancy, 3), "gemm_tflops": round(gemm, 1),
                      "results": results}))


if __name__ == "__main__":
    main()
