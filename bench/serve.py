"""Serving benchmark: seed 000's Fig. 18 workloads (1P, 1D, 1P+1D, 2D, 1P+2D) through the scheduler, under our
policy and under a KTransformers-like one (one 256-token chunk of prefill per decode step), in one run.

    XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=100 python bench/serve.py --geometry deepseek-v3 --layers 5 \
        [--prefill-tokens 16384] [--chunked-prefill-tokens 1024] [--decode-tokens 0] [--devices 2]

P is one long prompt with a few outputs, D a 10-token prompt decoding `--decode-tokens` tokens (0: as many as
make D alone last as long as P alone, which is how the seed sets its workloads up: "requests that each last
about 20 seconds when running alone"; with a truncated model P and D keep their per-layer costs, so matching
their durations keeps the seed's regime). All requests of a workload are submitted at once, decodes first.
Reported: TTFT of P, TPOT of D (mean time between its tokens, first excluded) and the workload's total latency,
each also normalised to its 1P / 1D baseline (total: to the slower of the two). With --devices N > 1, 1P streams
over all N, and "1P apart" times it on the N - 1 that do not decode, the seed's 1P baseline (its 1P is
disaggregated SLP on the prefill GPU): P's TTFT is also given as a ratio to that ("x apart"). The chunked policy runs a
shorter prompt (`--chunked-prefill-tokens`): its prefill runs the routed experts on the CPU, as
KTransformers' does, and the seed likewise gave KTransformers a shorter prompt (4K against 24K).

The model is a geometry's random FP8 weights (hybridjit.synthetic: normal values block-scaled as released, not
random bytes, whose many subnormal codes the CPU kernels decode far slower; routed experts in one pinned host
copy, shared by the CPU kernels and the stream-loaded prefill), truncated to --layers: both P's streamed
layers and D's decode steps keep their per-layer cost, which is what the ratios compare. With --devices N (N GPUs)
P streams over all N while nothing decodes and, arriving while D decodes, on the N - 1 that do not decode
(prefill-decode disaggregation, seed 000 §3.3.2; D decodes on the first), the first's share of each layer
staged through it where the GPUs' interconnect is faster than a link (stream_prefill.stages_through).

What else a disaggregated P takes from D is the host: its memory bandwidth (`read_while_copying`), its cores (the
CPU kernels' pool beside P's prefill thread: `--threads` runs the workloads under each pool size) and Python's
lock, which P's prefill thread holds while it dispatches each layer's executables and which D's scheduler thread
needs for each step (`--switch-interval-ms`: how long a thread waiting for it lets the holder run, Python's
sys.setswitchinterval; its default is 5 ms). `--workloads` times a subset (1P and 1D always run: the baselines).
Ends with one JSON line.
"""

import argparse
import itertools
import json
import statistics
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench_model import add_model_arguments, load_model
from floors import floors_line, machine, memory_floors
from hybridjit.machine_floors import device_to_device_gbps
from hybridjit.ops.routed_experts import configure_threads
from hybridjit.placement import Placement
from hybridjit.sampling import SamplingParams
from hybridjit.serving.scheduler import Finished, Request, Scheduler, Token
from hybridjit.stream_prefill import stages_through
from prefill import h2d_gbps, read_while_copying

WORKLOADS = ("1P", "1D", "1P+1D", "2D", "1P+2D")


class Timeline:
    """on_event of one request: when it was submitted, when each token came, how it ended."""

    def __init__(self):
        self.submitted, self.times, self.finished, self.done = time.perf_counter(), [], None, threading.Event()

    def __call__(self, event):
        if isinstance(event, Token):
            self.times.append(time.perf_counter())
        elif isinstance(event, Finished):
            self.finished = event
            self.done.set()

    def ttft(self) -> float:
        return self.times[0] - self.submitted

    def tpot(self) -> float:
        return (self.times[-1] - self.times[0]) / max(1, len(self.times) - 1)


def run_workload(scheduler: Scheduler, name: str, prefill: list[int], decode: list[list[int]], decode_tokens: int,
                 prefill_outputs: int) -> dict:
    n_decode = {"1P": 0, "1D": 1, "1P+1D": 1, "2D": 2, "1P+2D": 2}[name]
    # Each D its own prompt, sampled at temperature 1 with its own seed: two identical greedy requests would route
    # every token to the same experts (the CPU reads one request's), and a random model's greedy tokens settle on a
    # few that route alike step after step (decode.py).
    requests = [(Request(decode[i], decode_tokens, SamplingParams(temperature=1.0, seed=i)), "D")
                for i in range(n_decode)]
    if "P" in name:
        requests.append((Request(prefill, prefill_outputs), "P"))
    start = time.perf_counter()
    timelines = []
    for request, kind in requests:
        timeline = Timeline()
        scheduler.submit(request, timeline)
        timelines.append((kind, timeline))
    for _, timeline in timelines:
        if not timeline.done.wait(3600):
            raise TimeoutError(f"{name}: a request never finished")
        if timeline.finished.reason != "length":
            raise RuntimeError(f"{name}: a request ended with {timeline.finished}")
    total = max(t.times[-1] for _, t in timelines) - start
    p = [t.ttft() for kind, t in timelines if kind == "P"]
    d = [t.tpot() for kind, t in timelines if kind == "D"]
    return {"workload": name, "ttft_p_s": round(p[0], 3) if p else None,
            "tpot_d_ms": round(1e3 * statistics.mean(d), 2) if d else None, "total_s": round(total, 3)}


def run_policy(model, policy: str, prefill_tokens: int, decode_tokens: int, args, rng) -> tuple[list[dict], int]:
    """The baselines and the chosen workloads under `policy`, each after a warm-up run of itself (compiles, fills
    the graphs); returns (results with ratios to the baselines, the decode tokens used). With several devices and
    the slo policy, 1P is also timed apart (Scheduler disaggregate="always": on the devices that do not decode),
    the seed's 1P baseline (its prefill is disaggregated SLP on the prefill GPU), as "ttft_ratio_apart"."""
    vocab = model.config.vocab_size
    prefill = rng.integers(2, vocab, prefill_tokens).tolist()
    decode = rng.integers(2, vocab, (2, 10)).tolist()
    context = min(prefill_tokens + max(decode_tokens, 1024) + 16, model.config.max_position_embeddings)

    def timed(names, disaggregate="auto"):
        nonlocal decode_tokens
        scheduler = Scheduler(model, slots=4, cache_len=context, prefix_cache_bytes=0, policy=policy,
                              chunk_tokens=args.chunk, disaggregate=disaggregate)
        scheduler.start()
        try:
            def measured(name, n_decode_tokens):  # the median of --repeats runs, after a warm-up
                run_workload(scheduler, name, prefill, decode, min(n_decode_tokens, 8), args.prefill_outputs)
                runs = [run_workload(scheduler, name, prefill, decode, n_decode_tokens, args.prefill_outputs)
                        for _ in range(args.repeats)]
                return {key: round(statistics.median(r[key] for r in runs), 4) if runs[0][key] is not None else None
                        for key in ("ttft_p_s", "tpot_d_ms", "total_s")} | {"workload": name, "runs": runs}

            rows = [measured("1P", decode_tokens or 16)]
            if not decode_tokens and len(names) > 1:  # D alone lasting as long as P alone
                probe = measured("1D", 64)
                decode_tokens = max(32, round(rows[0]["ttft_p_s"] / (probe["tpot_d_ms"] / 1e3)))
            return rows + [measured(name, decode_tokens) for name in names[1:]]
        finally:
            scheduler.shutdown()

    results = timed(["1P"] + [name for name in WORKLOADS[1:] if name == "1D" or name in args.workloads])
    base_p, base_d = results[0], next(r for r in results if r["workload"] == "1D")
    base_apart = None
    if args.devices > 1 and policy == "slo":
        base_apart = timed(["1P"], disaggregate="always")[0]
        results.append(base_apart | {"workload": "1P apart"})
    for r in results:
        r["policy"] = policy
        r["prefill_tokens"], r["decode_tokens"] = prefill_tokens, decode_tokens
        if r["ttft_p_s"] is not None:
            r["ttft_ratio"] = round(r["ttft_p_s"] / base_p["ttft_p_s"], 3)
            if base_apart is not None:
                r["ttft_ratio_apart"] = round(r["ttft_p_s"] / base_apart["ttft_p_s"], 3)
        if r["tpot_d_ms"] is not None:
            r["tpot_ratio"] = round(r["tpot_d_ms"] / base_d["tpot_d_ms"], 3)
        r["total_ratio"] = round(r["total_s"] / max(base_p["total_s"], base_d["total_s"]), 3)
    return results, decode_tokens


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--prefill-tokens", type=int, default=16384)
    parser.add_argument("--chunked-prefill-tokens", type=int, default=1024)
    parser.add_argument("--decode-tokens", type=int, default=0, help="0: as long as P alone lasts")
    parser.add_argument("--prefill-outputs", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=256, help="the chunked policy's chunk")
    parser.add_argument("--policies", nargs="+", default=["slo", "chunked"], choices=("slo", "chunked"))
    parser.add_argument("--devices", type=int, default=1, help="GPUs to prefill on (Placement.prefill_devices)")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of each workload (their median)")
    parser.add_argument("--threads", type=int, nargs="+", default=[0],
                        help="CPU kernel pool sizes to run under, the calling thread counted (0: one per CPU)")
    parser.add_argument("--switch-interval-ms", type=float, nargs="+", default=[1e3 * sys.getswitchinterval()],
                        help="Python's thread switch intervals to run under")
    args = parser.parse_args(argv)
    if args.devices > len(jax.devices()):
        parser.error(f"--devices {args.devices}, but this machine has {len(jax.devices())}")
    placement = Placement(jax.devices()[0], jnp.dtype("bfloat16"), pinned_experts=True,
                          prefill_devices=tuple(jax.devices()[: args.devices]))
    model, name, full = load_model(args, placement, "fp8")
    h2d = h2d_gbps(model.placement.device) if model.placement.device.platform == "gpu" else None
    memory = memory_floors()
    print(floors_line(memory))
    # What a disaggregated prefill's copies leave the CPU kernels of the decode (the devices that do not decode copy).
    sharing = d2d = None
    if args.devices > 1:
        # One link: a prefill apart's own; all of them: one that stages the decoding GPU's share through it.
        sharing = {links: read_while_copying(model.placement.stream_devices[-links:], memory["read_pattern"])
                   for links in sorted({args.devices - 1, args.devices})}
        for links, rates in sharing.items():
            print(f"host read {rates['read_gbps_alone']} GB/s alone, {rates['read_gbps_while_copying']} while "
                  f"{links} GPU(s) copy pinned memory at {rates['h2d_gbps_each_while_reading']} GB/s each")
        first, second = model.placement.stream_devices[:2]
        d2d = device_to_device_gbps(first, second)
        route = "through it" if stages_through(first, second) else "over the prefill GPU's own link"
        print(f"GPU to GPU {d2d:.1f} GB/s: a prefill apart copies the decoding GPU's share {route} "
              "(stream_prefill._staging)")
    rng = np.random.default_rng(0)
    results = []
    print(f"{'policy':>8} {'threads':>7} {'switch':>6} {'workload':>8} {'P tokens':>8} {'D tokens':>8} "
          f"{'TTFT P s':>9} {'x 1P':>6} {'x apart':>7} {'TPOT D ms':>9} {'x 1D':>6} {'total s':>8} {'x base':>6}")
    for policy in args.policies:
        length = args.prefill_tokens if policy == "slo" else args.chunked_prefill_tokens
        decode_tokens = args.decode_tokens  # set by the first setting's run where 0, then kept: one D for all
        for threads, switch_ms in itertools.product(args.threads, args.switch_interval_ms):
            configure_threads(threads)
            sys.setswitchinterval(switch_ms / 1e3)
            rows, decode_tokens = run_policy(model, policy, length, decode_tokens, args, rng)
            for r in rows:
                r["threads"], r["switch_interval_ms"] = threads, switch_ms
                print(f"{policy:>8} {threads or 'all':>7} {switch_ms:6.2f} {r['workload']:>8} {r['prefill_tokens']:8d} "
                      f"{r['decode_tokens']:8d} {r['ttft_p_s'] or '-':>9} {r.get('ttft_ratio', '-'):>6} "
                      f"{r.get('ttft_ratio_apart', '-'):>7} {r['tpot_d_ms'] or '-':>9} {r.get('tpot_ratio', '-'):>6} "
                      f"{r['total_s']:8.3f} {r['total_ratio']:6.3f}", flush=True)
            results += rows
    print(json.dumps({"bench": "serve", "model": name, "layers": model.config.num_hidden_layers,
                      "devices": args.devices, "full_layers": full.num_hidden_layers, "machine": machine(),
                      "floors": {"h2d_gbps": h2d, "read_gbps": memory["read_gbps"], "read_while_copying": sharing,
                                 "d2d_gbps": d2d},
                      "results": results}))


if __name__ == "__main__":
    main()
