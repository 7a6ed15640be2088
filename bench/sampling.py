"""A decode step's sampling at large batches: what each kind of row costs (hybridjit/sampling.sample).

    python bench/sampling.py [--rows 1 64 256 768] [--vocab 151936]

Every decode step samples each slot's logits [slots, vocab] on the device. Greedy rows take the argmax, rows with a
temperature and neither top_k nor top_p draw over their logits as they are, and only rows that restrict (top_k,
top_p) sort the whole vocabulary; a step sorts only where some row restricts (until 2bb45e0 every step sorted every
row, greedy ones included: the "restricted" column is what every step cost then). Timed at Qwen3's vocabulary by
default, against the time the device takes to read the float32 logits once at its memory's read rate measured in
the same run (`read_share`: that time over the measured one). Ends with one JSON line.
"""

import argparse
import json

import jax
import jax.numpy as jnp

from hybridjit.machine_floors import best_seconds, hbm_read_gbps
from hybridjit.sampling import restricts, sample

KINDS = {  # (temperature, top_k, top_p) of every row
    "greedy": (0.0, 0, 1.0),
    "plain": (1.0, 0, 1.0),
    "restricted": (1.0, 0, 0.9),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256, 768], help="slots sampled in a step")
    parser.add_argument("--vocab", type=int, default=151936, help="Qwen3's; DeepSeek-V3's is 129280")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    read = hbm_read_gbps(device)
    step = jax.jit(sample, static_argnums=5)
    print(f"sampling: {device.device_kind}; vocabulary {args.vocab}; device read {read:.0f} GB/s")
    rows = []
    for b in args.rows:
        logits = jax.random.normal(jax.random.key(0), (b, args.vocab), jnp.float32)
        keys = jax.random.split(jax.random.key(1), b)
        floor = b * args.vocab * 4 / (read * 1e9)
        for kind, (temperature, top_k, top_p) in KINDS.items():
            params = (jnp.full(b, temperature), jnp.full(b, top_k, jnp.int32), jnp.full(b, top_p))
            seconds = best_seconds(step, logits, keys, *params, restricts(temperature, top_k, top_p))
            share = floor / seconds
            rows.append({"rows": b, "kind": kind, "ms": round(1e3 * seconds, 3), "read_share": round(share, 4)})
            print(f"{b:5d} rows  {kind:10s} {1e3 * seconds:9.3f} ms  read share {share:.3f}")
    print(json.dumps({"bench": "sampling", "device": device.device_kind, "vocab": args.vocab,
                      "read_gbps": round(read, 1), "rows": rows}))


if __name__ == "__main__":
    main()
