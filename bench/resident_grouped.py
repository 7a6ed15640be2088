"""One MoE layer's resident experts on many tokens: the grouped path as built against bfloat16 copies.

    python bench/resident_grouped.py [--capacity 16 64 192] [--experts 128 --hidden 2048 --inter 768]

With every routed expert resident on the device and many pairs a layer (an offline batch, a prefill),
models/common/resident_experts.resident_output groups the pairs per expert and runs batched GEMMs over all the
resident experts. FP8 copies (as load places them, half the bytes of bfloat16) are first dequantized to the compute
dtype, every call, so a weight costs 1 byte read, 2 written and 2 read again; bfloat16 copies cost 2 bytes read.
This times both through the same function, at Qwen3-30B-A3B's shapes by default (128 experts, 128x128 FP8 blocks),
`capacity` tokens an expert, against the device memory's read rate measured in the same run: `fp8_read_share` is
the time reading the FP8 bytes once would take at that rate, over the measured time (the policy's resident
pricing, hybridjit/offline_policy.resident_expert_seconds, assumes 1). Ends with one JSON line.
"""

import argparse
import json

import jax
import jax.numpy as jnp

from hybridjit.machine_floors import best_seconds, hbm_read_gbps
from hybridjit.models.common.experts import Experts
from hybridjit.models.common.resident_experts import ResidentExperts, ResidentPairs, resident_output

BLOCK = (128, 128)  # FP8 block scales, as the released FP8 checkpoints


def resident_layer(experts: int, hidden: int, inter: int, key) -> ResidentExperts:
    """Random FP8 experts [e, out, in] with random block scales, as place_experts holds an FP8 checkpoint's."""
    keys = jax.random.split(key, 6)
    shapes = ((experts, inter, hidden), (experts, inter, hidden), (experts, hidden, inter))
    weights = [(2 * jax.random.normal(k, s)).astype(jnp.float8_e4m3fn) for k, s in zip(keys[:3], shapes, strict=True)]
    scales = tuple(jax.random.uniform(k, (e, -(-o // BLOCK[0]), -(-i // BLOCK[1])), jnp.float32, 1e-3, 1e-2)
                   for k, (e, o, i) in zip(keys[3:], shapes, strict=True))  # fmt: skip
    return ResidentExperts(jnp.arange(experts, dtype=jnp.int32), Experts(*weights), scales, BLOCK)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacity", type=int, nargs="+", default=[16, 64, 192], help="tokens an expert")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    hbm = hbm_read_gbps(device)
    fp8 = resident_layer(args.experts, args.hidden, args.inter, jax.random.key(0))
    bf16 = ResidentExperts(fp8.slot_of, fp8.dequantized(jnp.bfloat16))
    fp8_bytes = 3 * args.experts * args.hidden * args.inter
    layer = jax.jit(resident_output)
    print(f"resident_grouped: {device.device_kind}; {args.experts} experts, hidden {args.hidden}, inter {args.inter}; "
          f"device read {hbm:.0f} GB/s; FP8 bytes {fp8_bytes / 1e6:.0f} MB, read once in "
          f"{fp8_bytes / hbm / 1e6:.3f} ms")
    rows = []
    for capacity in args.capacity:
        tokens = args.experts * capacity  # each token routed once, `capacity` to an expert
        x = jax.random.normal(jax.random.key(1), (tokens, args.hidden), jnp.bfloat16)
        index = jnp.arange(tokens, dtype=jnp.int32).reshape(args.experts, capacity)
        pairs = ResidentPairs(index, jnp.ones(index.shape, jnp.float32), gathered=False)
        for copies, res in (("fp8", fp8), ("bf16", bf16)):
            seconds = best_seconds(layer, res, x, pairs)
            share = fp8_bytes / (hbm * 1e9) / seconds
            rows.append({"capacity": capacity, "copies": copies, "ms": round(1e3 * seconds, 3),
                         "fp8_read_share": round(share, 3)})  # fmt: skip
            print(f"capacity {capacity:4d}  {copies:4s} copies  {1e3 * seconds:8.3f} ms  FP8 read share {share:.2f}")
    print(json.dumps({"bench": "resident_grouped", "device": device.device_kind, "experts": args.experts,
                      "hidden": args.hidden, "inter": args.inter, "hbm_read_gbps": round(hbm, 1), "rows": rows}))


if __name__ == "__main__":
    main()
