"""Prefill benchmark: time to first token of stream-loaded prefill against its floor, and of the CPU-expert
hybrid prefill for the crossover.

    python bench/prefill.py --geometry deepseek-v3 --layers 7 [--tokens 1024 4096 8192 16384 32768 65536]
    python bench/prefill.py --geometry gpt-oss-120b --layers 5 --tokens 8192 32768 --hybrid-tokens
    python bench/prefill.py --checkpoint PATH [--tokens ...]
    python bench/prefill.py --geometry deepseek-v3 --layers 5 --devices 2 --tokens 8192 32768 --hybrid-tokens

With --devices N the prefill is distributed over the first N GPUs (Placement.prefill_devices: each streams its
share of every layer's experts over its own link, the attention split by heads and the rest by token; OSDI '26
§3.2): the H2D floor is
then each link's rate while all N copy at once (measured alone too, and a copy from another GPU's pinned memory),
and the floors divide a layer's bytes over the N links and its FLOPs over the N GPUs. Compare with the same
command at --devices 1 on the same machine.

A geometry builds a random checkpoint of that model's real shapes in memory (--format: FP8 by default; gpt-oss's experts
stay MXFP4 as released; a GGUF format (q2_k, q3_k, q4_k, q5_k, q6_k, q8_0, q4_k_m, q2_k_m) writes the truncated geometry
as a GGUF file, as bench/decode.py does, whose blocks are pinned as stored and dequantised on the GPU), loaded by the
same loader with the routed experts in one pinned host copy (Placement(pinned_experts=True)), which both paths read. Any
family: the attention core and the cache are the family's. With --layers the model is truncated; figures at full depth
are projections, labelled so: the measured TTFT plus the missing layers at the steady per-layer time (the mean time
between consecutive MoE layers' outputs after the first MoE layer: with gpt-oss's alternating sliding and full layers,
give --layers an odd count so that the steady layers hold as many of each).

Floors, measured by the same run: pinned host-to-device bandwidth (one 2 GiB copy, best of 5), a dense bf16
GEMM (8192^3, best of 10 back-to-back), and the CPU expert kernels' rate (one routed-expert layer on a batch of
--cpu-tokens tokens routed uniformly). The floor of a prompt is max(bytes streamed / H2D bandwidth, FLOPs /
GEMM rate) at full depth, FLOPs as prefill_path.prefill_flops counts them (causal attention: lower
triangle). Each stream case also reports where a steady MoE layer's time went (stream_prefill's phases), the
expert GEMMs' slot occupancy, the attention core alone on random inputs shaped as each layer's attention hands
them to it (the mean over the layers), and a second floor that grants the attention core the rate it reaches
alone (everything else at the GEMM rate). The hybrid prefill (the engine's
jitted prefill, routed experts on the CPU) is measured at --hybrid-tokens (it holds [t, t] attention scores,
so only short prompts fit) and projected to full depth by its time per MoE layer; at other lengths it is
modelled (prefill_path.prefill_seconds with the measured rates). `--prompts random repeated` also runs one
token repeated: every token then routes to the same experts, the skew under which an expert
block runs in several passes (StreamStats.block_passes). `--queued-expert-steps 1 0` runs the stream cases once
with each number of expert steps the ring leaves queued on the device. Ends with one JSON line.
"""

import argparse
import json
import os
import platform
import statistics
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from moe_cpu import GGUF_FORMATS

import hybridjit_ffi as _ffi
from bench_model import add_model_arguments, load_model
from decode import load_gguf_geometry, write_gguf_geometry
from hybridjit import engine, machine_floors, prefill_path
from hybridjit import stream_prefill as sp
from hybridjit.machine_floors import best_seconds, concurrent_h2d_gbps, gemm_tflops, pinned_h2d_gbps
from hybridjit.models.common.moe import MoE
from hybridjit.models.common.prefill_cores import HeadsSplit
from hybridjit.models.registry import ModelConfig
from hybridjit.pinned_experts import pinned_layer
from hybridjit.placement import Placement
from hybridjit.sampling import SamplingParams
from hybridjit.serving.engine import Engine
from hybridjit.synthetic import SyntheticCheckpoint, geometry_config, random_values
from hybridjit.weights import SCALE_SUFFIX

GIB = 1 << 30


class PooledExperts(SyntheticCheckpoint):
    """A SyntheticCheckpoint whose FP8 routed-expert weights are views into one random pool at
    per-tensor offsets: nothing is generated or kept per tensor (the loader copies each into pinned memory
    once), so a layer of DeepSeek-V3 experts costs one copy to load and no second host copy."""

    POOL_BYTES = 1 << 26

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__(cfg, seed)
        # Distributed like real block-scaled weights (hybridjit.synthetic): random bytes would make one code in
        # eight denormal or zero, which the CPU's FP8 kernel corrects one by one (15x slower decode; bench/RESULTS.md,
        # offline.py).
        self._pool = random_values("F8_E4M3", self.POOL_BYTES, np.random.default_rng(seed))

    def get(self, name):
        info = self.tensors[name]
        if ".experts." not in name or name.endswith(SCALE_SUFFIX) or info.dtype != "F8_E4M3":
            return super().get(name)
        start = zlib.crc32(name.encode()) % (self.POOL_BYTES - info.nbytes)
        return self._pool[start : start + info.nbytes].reshape(info.shape)


def load(args):
    devices = jax.devices()
    if args.devices > len(devices):
        raise SystemExit(f"prefill: --devices {args.devices}, but this machine has {len(devices)}")
    placement = Placement(devices[0], jnp.dtype(args.dtype), pinned_experts=True,
                          prefill_devices=tuple(devices[: args.devices]))
    if args.format in GGUF_FORMATS:
        return load_gguf_geometry(write_gguf_geometry(args), args, placement)
    return load_model(args, placement, args.format, synthetic=PooledExperts)


# -------------------------------------------------------------------------------------------- floors


# The timing primitive and the GPU floors are the library's (hybridjit.machine_floors, which the cost models read);
# the bench takes them with more bytes and repeats than a load does.


def h2d_gbps(device) -> float:
    """Peak pinned host -> device bandwidth: the best of 5 copies of one 2 GiB pinned buffer."""
    return pinned_h2d_gbps(device, 2 * GIB, 5)


def link_floors(devices) -> dict:
    """With several prefill devices: each link's rate while all copy at once (the DSLP transfer floor), and a copy
    to the second device from the first one's pinned memory (what a prefill on a device other than the one its
    experts are pinned through would get)."""
    return {"h2d_gbps_each_concurrent": round(concurrent_h2d_gbps(devices, 2 * GIB, 5), 2),
            "h2d_gbps_across": round(pinned_h2d_gbps(devices[1], 2 * GIB, 3, source=devices[0]), 2)}


def read_while_copying(devices, read_pattern: str, seconds: float = 0.5) -> dict:
    """The host read floor (one pattern of floors.memory_floors, on the kernels' pool) alone and while `devices`
    copy pinned host memory to themselves back to back, as a disaggregated prefill streams its experts beside a
    decode (OSDI '26 §3.3.2): how much of the host's memory bandwidth the CPU kernels keep, and each link's rate
    meanwhile. The median of 512 MiB read passes over `seconds` each way; the links' rate from the rounds of copies
    that ended while the passes ran (a round: 1 GiB to each device)."""
    reader = _ffi.MemoryReader(1 << 29, 0)

    def median_read() -> tuple[float, float, float]:
        rates, start = [], time.perf_counter()
        while (now := time.perf_counter()) - start < seconds or len(rates) < 3:
            rates.append(reader.read_gbps(read_pattern))
        return statistics.median(rates), start, now

    alone, _, _ = median_read()
    with machine_floors.copying(devices, GIB) as ends:
        under, start, end = median_read()
    during = [t for t in ends if start <= t <= end]
    link = GIB * (len(during) - 1) / (during[-1] - during[0]) / 1e9 if len(during) > 1 else float("nan")
    return {"read_gbps_alone": round(alone, 1), "read_gbps_while_copying": round(under, 1),
            "h2d_gbps_each_while_reading": round(link, 1), "copy_rounds_while_reading": len(during)}


def cpu_expert_tflops(model: engine.Model, tokens: int, repeats=3, **where) -> float:
    """The CPU expert kernels on the first MoE layer, `tokens` tokens routed uniformly at random (best of repeats);
    `where`: machine_floors.cpu_expert_tflops's threads, copying_to and weighted."""
    cfg = model.config
    moe = next(layer.mlp for layer in model.weights.layers if isinstance(layer.mlp, MoE))
    return machine_floors.cpu_expert_tflops(moe.expert_layer, cfg.hidden_size, cfg.moe_intermediate_size,
                                            cfg.n_routed_experts, cfg.num_experts_per_tok, tokens, repeats, **where)


def attention_core_seconds(model: engine.Model, attention, length: int, repeats=3) -> float:
    """The prefill's attention core alone (stream_prefill's choice for this prompt) on random operands of one
    prompt, shaped as each layer's attention hands them to it (traced through the family's
    prefill_attention_layer, so any family's core and its per-layer windows and sinks): the mean over the layers,
    each distinct call the best of `repeats`."""
    cfg, family, device = model.config, model.family.model, model.placement.device
    caches = jax.eval_shape(lambda: family.init_cache(cfg, 1, length, model.dtype))
    x = jax.ShapeDtypeStruct((1, length, cfg.hidden_size), model.dtype)
    seconds, per_layer = {}, []
    for layer, cache in zip(model.weights.layers, caches, strict=True):
        operands = []

        def record(*args, operands=operands):
            operands += [jax.ShapeDtypeStruct(a.shape, a.dtype) if isinstance(a, jax.Array) else a for a in args]
            return attention(*args)

        jax.eval_shape(lambda x, cache, layer=layer, record=record: family.prefill_attention_layer(
            cfg, layer, x, cache, record), x, cache)
        key = tuple(operands)
        if key not in seconds:
            seconds[key] = _core_seconds(attention, operands, device, repeats)
        per_layer.append(seconds[key])
    return statistics.mean(per_layer)


def _core_seconds(attention, operands: list, device, repeats: int) -> float:
    """`attention` on `operands` with random arrays for the ShapeDtypeStructs among them: best of `repeats`."""
    where = [i for i, o in enumerate(operands) if isinstance(o, jax.ShapeDtypeStruct)]
    keys = jax.random.split(jax.random.key(len(operands)), len(where))
    # A core split over the prefill devices takes its operands whole on each of them, as the prefill has them.
    place = NamedSharding(attention.mesh, P()) if isinstance(attention, HeadsSplit) else device
    arrays = [jax.device_put(jax.random.normal(k, operands[i].shape, operands[i].dtype), place)
              for k, i in zip(keys, where, strict=True)]

    def core(*arrays):
        args = list(operands)
        for i, a in zip(where, arrays, strict=True):
            args[i] = a
        return attention(*args)

    return best_seconds(jax.jit(core), *arrays, repeats=1, rounds=repeats)


# --------------------------------------------------------------------------------------------- cases


def prompt(cfg: ModelConfig, length: int, kind: str) -> np.ndarray:
    """[1, length] tokens: random ones, or one token repeated (every token routed to the same experts: the
    skew that makes expert blocks run in several passes)."""
    if kind == "repeated":
        return np.full((1, length), 7, np.int32)
    return np.random.default_rng(length).integers(2, cfg.vocab_size, (1, length)).astype(np.int32)


def stream_case(model: engine.Model, full: ModelConfig, length: int, floors: dict, budget: int | None,
                kind: str) -> dict:
    cfg, device, shards = model.config, model.placement.device, model.placement.prefill_mesh.size
    tokens = prompt(cfg, length, kind)

    def run():
        cache = model.family.model.init_cache(cfg, 1, length, model.dtype, device)
        jax.block_until_ready(cache)
        stats = sp.StreamStats()
        start = time.perf_counter()
        logits, cache = sp.stream_prefill(model, tokens, [length], cache, vram_budget=budget, stats=stats)
        jax.block_until_ready((logits, cache))
        return time.perf_counter() - start, stats

    run()  # compiles
    ttft, stats = run()
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    done = [0.0, *stats.layer_done_s]
    per_layer = [done[i + 1] - done[i] for i in range(cfg.num_hidden_layers)]
    steady_layers = moe[1:] or moe
    steady = statistics.mean(per_layer[i] for i in steady_layers)
    # Where a steady MoE layer's time goes, and the rates of its two big phases (their FLOPs by layer_flops).
    phases = {p: statistics.median(stats.layer_phase_s[i].get(p, 0.0) for i in steady_layers)
              for p in stats.layer_phase_s[moe[0]]}
    part = model.family.cost.layer_flops(cfg, 1, length)
    front_flops = part["projections"] + part["attention core"] + part["router+shared"]
    core_s = attention_core_seconds(model, stats.plan.attention, length)
    layer_bytes = pinned_layer(model.weights.layers[moe[0]].mlp.expert_layer).nbytes
    full_moe = sum(full.is_moe_layer(i) for i in range(full.num_hidden_layers))
    projected = ttft + (full.num_hidden_layers - cfg.num_hidden_layers) * steady
    link_gbps = floors["h2d_gbps_each_concurrent"] if shards > 1 else floors["h2d_gbps"]
    transfer_s = full_moe * layer_bytes / (shards * link_gbps * 1e9)
    gemm = floors["gemm_tflops"] * 1e12
    compute_s = sum(prefill_path.prefill_flops(full, 1, length).values()) / (shards * gemm)  # the machine's GEMM rate
    floor = max(transfer_s, compute_s)
    # The same floor with the attention core at the rate it reaches alone, everything else at the GEMM rate:
    # how far the rest of the step is from its floor once the attention kernel's own speed is granted.
    core_floor_s = part["attention core"] / (shards * gemm)
    kernel_floor = max(transfer_s, compute_s + full.num_hidden_layers * (core_s - core_floor_s))
    h2d = layer_bytes / shards / steady / 1e9  # each link's
    memory = device.memory_stats()
    return {
        "path": "stream", "devices": shards, "tokens": length, "ring_depth": stats.plan.depth,
        "block_gib": round(stats.plan.block_bytes / GIB, 3),
        "attention": type(stats.plan.attention).__name__,
        "ttft_ms": round(1e3 * ttft, 1), "moe_layer_ms": round(1e3 * steady, 1),
        "moe_layer_phases_ms": {p: round(1e3 * t, 1) for p, t in phases.items()},
        "copy_issue_ms": round(1e3 * stats.copy_issue_s, 1),  # the whole prefill's, host time in no phase
        "front_tflops": round(front_flops / phases["attention+router+shared"] / 1e12, 1),
        "experts_tflops": round(part["routed"] / phases["experts"] / 1e12, 1),
        "attention_core_alone_ms": round(1e3 * core_s, 1),
        "attention_core_alone_tflops": round(part["attention core"] / core_s / 1e12, 1),
        "projected_full_depth_ttft_s": round(projected, 3),
        "projected_full_depth_tokens_per_s": round(length / projected, 1),
        "h2d_gbps": round(h2d, 2), "h2d_ratio": round(h2d / link_gbps, 3),
        "overall_h2d_gbps": round(stats.streamed_bytes / ttft / 1e9, 2),
        "tflops": round(sum(prefill_path.prefill_flops(cfg, 1, length).values()) / ttft / 1e12, 1),
        "floor_full_depth_s": round(floor, 3), "ratio_to_floor": round(projected / floor, 3),
        "floor_with_measured_attention_s": round(kernel_floor, 3),
        "ratio_to_floor_with_measured_attention": round(projected / kernel_floor, 3),
        "slot_occupancy": round(stats.routed_pairs / stats.expert_slots, 3),
        "expert_block_passes": stats.block_passes,
        "bound": "transfer" if transfer_s >= compute_s else "compute",
        "peak_ring_gib": round(stats.peak_ring_bytes / GIB, 3),
        "activation_estimate_gib": round(stats.plan.activation_bytes / GIB, 3),
        "peak_device_gib": round(memory["peak_bytes_in_use"] / GIB, 2) if memory else None,
    }


def hybrid_case(model: engine.Model, full: ModelConfig, length: int, kind: str) -> dict:
    """The serving engine's prefill (routed experts on the CPU), measured, projected by its MoE layers."""
    tokens = prompt(model.config, length, kind)[0].tolist()
    threshold, model.stream_prefill_threshold = model.stream_prefill_threshold, 1 << 62  # never stream here
    decoder = Engine(model, 1, length)

    def run():
        start = time.perf_counter()
        out = decoder.prefill([tokens], [SamplingParams()])
        jax.block_until_ready((out.tokens, out.cache))
        return time.perf_counter() - start

    run()  # compiles
    ttft = run()
    model.stream_prefill_threshold = threshold
    cfg = model.config
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    full_moe = sum(full.is_moe_layer(i) for i in range(full.num_hidden_layers))
    return {"path": "hybrid", "tokens": length, "measured": True, "ttft_ms": round(1e3 * ttft, 1),
            # the dense layers' share is counted as MoE: a slight overestimate
            "projected_full_depth_ttft_s": round(ttft * full_moe / moe, 3)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--hybrid-tokens", type=int, nargs="*", default=[1024, 4096])
    parser.add_argument("--cpu-tokens", type=int, default=4096, help="batch of the CPU expert-rate floor")
    parser.add_argument("--vram-budget-gib", type=float, help="stream_prefill's VRAM budget (default: free memory)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--format", default="fp8", choices=("fp8", "bf16", *GGUF_FORMATS),
                        help="a geometry's weights (gpt-oss's experts stay MXFP4, as released)")
    parser.add_argument("--gguf-dir", help="where a GGUF format's file is written (default: a temporary directory)")
    parser.add_argument("--keep-gguf", action="store_true", help="keep a GGUF format's file (default: removed at exit)")
    parser.add_argument("--prompts", nargs="+", default=["random"], choices=("random", "repeated"),
                        help="random tokens, or one token repeated (skewed routing); each runs every length")
    parser.add_argument("--devices", type=int, default=1,
                        help="GPUs the stream-loaded prefill is distributed over (Placement.prefill_devices)")
    parser.add_argument("--queued-expert-steps", type=int, nargs="+", default=[sp.queued_expert_steps()],
                        help="run the stream-loaded cases once per number of expert steps the ring leaves queued on "
                             "the device (stream_prefill.expert_steps_queued; default: the library's)")
    parser.add_argument("--time-limit", type=float, default=float("inf"),
                        help="seconds after which no new case starts (the JSON line still comes)")
    args = parser.parse_args(argv)
    if args.format in GGUF_FORMATS and not args.geometry:
        parser.error(f"--format {args.format} writes a GGUF file of a --geometry (a --checkpoint has its own format)")
    if args.geometry and args.layers:
        cfg = geometry_config(args.geometry, layers=args.layers)
        if not any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
            parser.error(f"--layers {args.layers} leaves {args.geometry} no MoE layer (its first layers are dense)")
    begin = time.perf_counter()

    model, name, full = load(args)
    device = model.placement.device
    floors = {"h2d_gbps": round(h2d_gbps(device), 2), "gemm_tflops": round(gemm_tflops(device), 1),
              "cpu_expert_tflops": round(cpu_expert_tflops(model, args.cpu_tokens), 3)}
    if args.devices > 1:
        floors.update(link_floors(model.placement.stream_devices))
    rates = prefill_path.PrefillRates(floors["h2d_gbps"], floors["gemm_tflops"], floors["cpu_expert_tflops"])
    storage = pinned_layer(next(la.mlp for la in model.weights.layers if isinstance(la.mlp, MoE)).expert_layer).storage
    print(f"prefill: {name}, experts {storage.fmt}, on {device.device_kind}; floors: pinned H2D "
          f"{floors['h2d_gbps']} GB/s, bf16 GEMM {floors['gemm_tflops']} TFLOP/s, CPU experts "
          f"{floors['cpu_expert_tflops']} TFLOP/s"
          + (f"; over {args.devices} GPUs: each link {floors['h2d_gbps_each_concurrent']} GB/s while all copy, "
             f"{floors['h2d_gbps_across']} GB/s from another GPU's pinned memory" if args.devices > 1 else ""))
    budget = int(args.vram_budget_gib * GIB) if args.vram_budget_gib else None
    results, skipped = [], []
    print(f"{'path':>6} {'tokens':>6} {'depth':>5} {'TTFT ms':>9} {'layer ms':>8} {'full s(proj)':>12} "
          f"{'H2D GB/s':>8} {'of peak':>7} {'TFLOP/s':>7} {'floor s':>8} {'ratio':>6}")
    cases = [("stream", n, kind, q) for q in args.queued_expert_steps for kind in args.prompts for n in args.tokens]
    cases += [("hybrid", n, kind, None) for kind in args.prompts for n in args.hybrid_tokens]
    for path, length, kind, queued in cases:
        if time.perf_counter() - begin > args.time_limit:
            skipped.append(f"{path} {length} {kind}" + (f" {queued} queued" if queued is not None else ""))
            continue
        if path == "stream":
            with sp.expert_steps_queued(queued):
                r = stream_case(model, full, length, floors, budget, kind) | {"queued_expert_steps": queued}
            print(f"{path:>6} {length:6d} {r['ring_depth']:5d} {r['ttft_ms']:9.1f} {r['moe_layer_ms']:8.1f} "
                  f"{r['projected_full_depth_ttft_s']:12.2f} {r['h2d_gbps']:8.1f} {r['h2d_ratio']:7.2f} "
                  f"{r['tflops']:7.1f} {r['floor_full_depth_s']:8.2f} {r['ratio_to_floor']:6.2f}", flush=True)
            print(f"{'':>13} MoE layer phases ms {r['moe_layer_phases_ms']}; front {r['front_tflops']} TFLOP/s, "
                  f"experts {r['experts_tflops']} TFLOP/s at slot occupancy {r['slot_occupancy']}; attention core "
                  f"alone {r['attention_core_alone_ms']} ms = {r['attention_core_alone_tflops']} TFLOP/s; floor "
                  f"with that attention {r['floor_with_measured_attention_s']} s, ratio "
                  f"{r['ratio_to_floor_with_measured_attention']}; {r['expert_block_passes']} expert block passes "
                  f"({kind} prompt, {queued} expert steps queued)", flush=True)
        else:
            r = hybrid_case(model, full, length, kind)
            print(f"{path:>6} {length:6d} {'-':>5} {r['ttft_ms']:9.1f} {'-':>8} "
                  f"{r['projected_full_depth_ttft_s']:12.2f}  ({kind} prompt)", flush=True)
        results.append({"prompt": kind, **r})
    measured = {r["tokens"] for r in results if r["path"] == "hybrid"}
    for length in args.tokens:
        if length not in measured:
            t = prefill_path.prefill_seconds(full, 1, length, rates)["hybrid"]
            results.append({"path": "hybrid", "tokens": length, "measured": False,
                            "modelled_full_depth_ttft_s": round(t, 3)})
            print(f"{'hybrid':>6} {length:6d} (modelled from the measured rates) {t:10.2f} s")
    crossover = prefill_path.crossover_length(full, rates)
    print(f"crossover (modelled, measured rates): stream-loaded prefill from {crossover} tokens"
          + (f"; skipped for time: {', '.join(skipped)}" if skipped else ""))
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "device": device.device_kind,
               "jax": jax.__version__}
    print(json.dumps({"bench": "prefill", "model": name, "experts": storage.fmt,
                      "layers": model.config.num_hidden_layers,
                      "full_layers": full.num_hidden_layers, "machine": machine,
                      "floors": floors, "crossover_tokens": crossover, "skipped": skipped, "results": results}))


if __name__ == "__main__":
    main()
