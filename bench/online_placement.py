"""Online re-placement of resident experts while serving (issue #23): TPOT through the scheduler as it moves the
experts its traffic uses most onto the GPU, against the same placement fixed and against the probe's choice.

    python bench/online_placement.py --geometry deepseek-v3 --layers 5 --format fp8 --resident 0.125 --zipf 0.05

A geometry's random checkpoint (hybridjit.synthetic, truncated with --layers) gets Zipf-skewed expert popularity
(decode.py's skew_routing: ranks a random permutation per layer) and `--resident` of each MoE layer's experts on
the GPU. Three runs of the same workload (`--slots` requests decoding `--tokens` tokens each, sampled at
temperature 1 from random prompts, all submitted at once) through hybridjit.serving.scheduler:

- fixed: each layer's first experts, as the automatic placement holds them without a probe, never moved;
- tallied: the same, with the decode steps giving the experts they chose and the scheduler counting them, never
  re-placing: what counting costs a step;
- online: the same start, re-placed between steps by serving.online_placement (the default when serving);
- probe: the most activated experts of a probe of random prompts (decode.py's choice), never moved: the bound.

Reported: the share of the probe's activations each residency covers (online: at the end), the experts swapped,
and TPOT (the median gap between a request's tokens, over the requests) for the first and last windows of
`--window` tokens and overall; the longest gap shows what a re-placement's copy costs a step. Ends with one JSON
line.
"""

import argparse
import json
import statistics
import threading
import time

import jax
import numpy as np

from bench_model import add_model_arguments, load_model
from decode import skew_routing
from floors import floors_line, machine, memory_floors
from hybridjit.expert_residency import Residency, bank_moe_layers
from hybridjit.placement import Placement
from hybridjit.sampling import SamplingParams
from hybridjit.serving.scheduler import Finished, Request, Scheduler


class Timeline:
    """on_event of one request: the time each token arrived."""

    def __init__(self):
        self.times, self.done = [], threading.Event()

    def __call__(self, event):
        if isinstance(event, Finished):
            self.done.set()
        else:
            self.times.append(time.perf_counter())


def run(model, online: bool, replace: bool, args, rng) -> dict:
    """The workload through a scheduler: TPOT per window, the longest gap, the experts swapped."""
    scheduler = Scheduler(model, slots=args.slots, cache_len=args.prompt + args.tokens + 64, prefix_cache_bytes=0,
                          online_placement=online)
    if online:
        scheduler.online.interval = args.interval if replace else 1 << 62
        scheduler.online.max_swaps = args.max_swaps
    scheduler.start()
    timelines = [Timeline() for _ in range(args.slots)]
    try:
        for timeline in timelines:
            prompt = rng.integers(2, model.config.vocab_size, args.prompt).tolist()
            sampling = SamplingParams(temperature=1.0, seed=int(rng.integers(1 << 31)))
            scheduler.submit(Request(prompt, args.tokens, sampling), timeline)
        for timeline in timelines:
            timeline.done.wait()
    finally:
        scheduler.shutdown()
    gaps = [np.diff(t.times) * 1e3 for t in timelines]
    skip = 8  # the first tokens: compiles and requests still joining

    def tpot(lo, hi):
        return statistics.median(float(np.median(g[lo:hi])) for g in gaps)

    end = min(len(g) for g in gaps)
    return {
        "online": online,
        "tpot_ms": round(tpot(skip, end), 3),
        "tpot_first_window_ms": round(tpot(skip, skip + args.window), 3),
        "tpot_last_window_ms": round(tpot(end - args.window, end), 3),
        "longest_gap_ms": round(max(float(g[skip:].max()) for g in gaps), 3),
        "swapped": scheduler.online.swapped if online else 0,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--format", default="fp8", choices=("fp8", "bf16"), help="weight format of a geometry")
    parser.add_argument("--dtype", default=None, help="compute dtype (default: float32 on CPU, bfloat16 on GPU)")
    parser.add_argument("--resident", type=float, default=0.125, help="share of each MoE layer's experts on the GPU")
    parser.add_argument("--zipf", type=float, default=0.05, help="expert popularity skew (decode.py --zipf)")
    parser.add_argument("--slots", type=int, default=4, help="requests decoding at once")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens of each request")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens each request decodes")
    parser.add_argument("--window", type=int, default=64, help="tokens of the first and last TPOT windows")
    parser.add_argument("--interval", type=int, default=64, help="decode steps between re-placement plans")
    parser.add_argument("--max-swaps", type=int, default=8, help="most experts moved by one re-placement")
    args = parser.parse_args(argv)

    floors = memory_floors()
    model, name, _ = load_model(args, Placement.default(args.dtype), args.format)
    rng = np.random.default_rng(0)
    counts = skew_routing(model, args.zipf, rng)
    e = model.config.n_routed_experts
    n = max(1, round(args.resident * e))
    layers = sorted(bank_moe_layers(model.weights))
    first = Residency({layer: tuple(range(n)) for layer in layers})
    probe = Residency.most_used(counts, n)
    print(f"online placement: {name}, {model.config.num_hidden_layers} layers, on {model.placement.device}, "
          f"{n} of {e} experts resident per MoE layer, zipf {args.zipf}, {args.slots} requests x {args.tokens} tokens")
    print(floors_line(floors))
    results = []
    cases = (("fixed", first, False, False), ("tallied", first, True, False), ("online", first, True, True),
             ("probe", probe, False, False))
    for label, residency, online, replace in cases:
        model.place_experts(residency)
        r = {"placement": label, "covered_at_start": round(residency.covered_share(counts), 4),
             **run(model, online, replace, args, rng)}
        r["covered_at_end"] = round(model.residency.covered_share(counts), 4)
        results.append(r)
        print(f"{label:>7}: covered {r['covered_at_start']:.3f} -> {r['covered_at_end']:.3f}, swapped "
              f"{r['swapped']:4d}, TPOT {r['tpot_ms']:7.2f} ms (first window {r['tpot_first_window_ms']:7.2f}, last "
              f"{r['tpot_last_window_ms']:7.2f}), longest gap {r['longest_gap_ms']:7.2f} ms")
    where = {**machine(), "device": str(jax.devices()[0])}
    print(json.dumps({"bench": "online_placement", "model": name, "layers": model.config.num_hidden_layers,
                      "resident_per_layer": n, "experts_per_layer": e, "zipf": args.zipf, "slots": args.slots,
                      "tokens": args.tokens, "interval": args.interval, "max_swaps": args.max_swaps,
                      "machine": where, "floors": floors, "results": results}))


if __name__ == "__main__":
    main()
