"""Offline throughput benchmark (issue #25): prefill and decode throughput of `hybridjit batch`'s engine at
MoE-Gen's setting (prompts of 512 tokens, 256 new tokens each), batch sizes swept, against the performance
model's prediction and the interactive engine's batch-1 decode.

    python bench/offline.py [--models deepseek-v3:5 qwen3-30b-a3b] [--slots 64 256 1024] [--prefill 1 8]

Each model is a geometry with random FP8 weights (prefill.py's PooledExperts: fast to load), truncated to
`:LAYERS` where given, its routed experts in one pinned host copy on the CPU. Per model, in one process:
- the interactive decode: batch 1, the dual-batch engine as `generate` runs it;
- decode steps of every --slots size, experts coalesced over the batch (one attention micro-batch), each slot's
  cache holding the mean context of the workload (prompt + half the new tokens): tok/s = slots / step; with the
  routed experts on the CPU, and (--experts, on a GPU) streamed to the GPU each step, and so with the CPU computing
  as many of each layer's blocks meanwhile as the model picks for that batch (co-execution), where it picks any;
  or, with `--experts gpu`, every routed expert placed on the device first (Model.place_experts("auto"), as load
  places a model whose experts fit), so that the interactive decode is the all-GPU one and the batches run there,
  and with `--widen` every case again with the FP8 copies held dequantized (Model.hold_resident_experts; the
  experts column reads "gpu-wide"); with `--kv-in-host`, every streamed case again with the KV cache in pinned host
  memory, copied to the GPU a layer at a time (hybridjit/host_kv_cache.py; the experts column reads "stream-hkv"),
  at up to hybridjit.offline_policy.MAX_HOST_KV_SLOTS slots; with `--attention-on-cpu`, again with the CPU attending
  over that cache where it is ("stream-cpuattn"; hybridjit/ops/cpu_attention.py). Co-executed cases run the CPU's
  share on the pool a batch run gives it (offline_policy.co_execution_threads: HOST_LOOP_CPUS left to the host's
  loop); with `--threads N ...`, they run again with the CPU kernels' pool at each of those sizes; with
  `--queued-expert-steps N ...`, the streamed cases run again with N expert steps left queued on the device
  (stream_prefill.expert_steps_queued; 0 waits for each, as the ring did before session 33; the default is 1);
- prefill of every --prefill batch of 512-token prompts (whichever path the engine chooses), timed over the calls
  that compile nothing (a new routing can need a new block capacity's program, which a long run compiles once);
- the performance model (hybridjit/offline_policy.py) fed with floors measured here (memory read floor, pinned
  H2D, dense GEMM, the device memory's read rate, the CPU expert kernels' rate at each case's tokens per call and,
  as Floors.of_machine measures it, the share of it a co-executed step's CPU blocks get, the device's free memory,
  the CPU attention kernels' rate at the model's shapes): its prediction of each measured
  case, and its pick over the same grid against the best measured. A run's throughput combines them as the model
  does: generated tokens / (n / P prefills + n x 256 / B steps), n = --requests.
A truncated model's figures are also projected to full depth: the prediction for the policy the model picks at
full depth (the pick's expert placement, as many slots as the full model's KV cache lets fit) times the measured /
predicted ratio of the truncated one (labelled "projected"; not with --experts gpu, which is for models whose
experts fit the device at full depth). With --kv-in-host, also the full-depth pick with the KV cache in host memory
(within --host-kv-gib, the full-size host's budget for it) times the measured / predicted of the largest measured
"stream-hkv" case. Ends with one JSON line.
"""

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.dispatch import BACKEND_COMPILE_EVENT

from bench_model import load_model
from floors import floors_line, machine, memory_floors
from hybridjit.host_kv_cache import DEVICE_LAYERS, host_kv_budget
from hybridjit.machine_floors import cpu_attention_gflops, hbm_read_gbps
from hybridjit.offline_policy import (
    CO_EXECUTION_TOKENS,
    EXPERTS,
    RESIDENT,
    Floors,
    Policy,
    Workload,
    co_execution_threads,
    kv_bytes_per_slot,
    predict,
    search,
    widened_expert_bytes,
)
from hybridjit.ops.routed_experts import pool_of
from hybridjit.pinned_experts import default_block_experts
from hybridjit.placement import Placement
from hybridjit.prefill_path import choose_prefill_path
from hybridjit.sampling import SamplingParams
from hybridjit.serving.engine import DEVICE_ONLY_DECODE_STEPS, Engine, Prefilled, bucket
from hybridjit.stream_prefill import expert_steps_queued, free_device_memory
from prefill import PooledExperts, cpu_expert_tflops, gemm_tflops, h2d_gbps

ON_GPU = jax.default_backend() == "gpu"
PROMPT, NEW = 512, 256  # MoE-Gen's setting
STREAMED_WARMUP_STEPS = 12
MAX_WARMUP_CALLS = 40  # warm-up calls after which a case is timed even if its calls still compile


def load(geometry: str, layers: int | None, dtype):
    args = argparse.Namespace(checkpoint=None, geometry=geometry, layers=layers)
    placement = Placement(jax.devices()[0], jnp.dtype(dtype), pinned_experts=ON_GPU)
    return load_model(args, placement, "fp8", synthetic=PooledExperts)


def measured_floors(model, memory: dict, tokens: list[int]) -> Floors:
    """The model's Floors from this run's measurements (the GPU ones only on a GPU; the rest stay defaults): the CPU
    expert rate at each of `tokens` per call (the decode steps' slots, the prefill batches' tokens), at
    CO_EXECUTION_TOKENS and at 4096, the CPU attention kernels' rate at the model's shapes, and, as Floors.of_machine
    measures it, the share of the CPU expert rate a co-executed step's CPU blocks get."""
    device = model.placement.device
    by_tokens = tuple((t, cpu_expert_tflops(model, t)) for t in sorted({*tokens, CO_EXECUTION_TOKENS, 4096}))
    figures = {"host_read_gbps": memory["read_gbps"], "cpu_expert_tflops": dict(by_tokens)[4096],
               "cpu_expert_tflops_by_tokens": by_tokens,
               "cpu_attention_gflops": cpu_attention_gflops(model.config, model.dtype)}  # fmt: skip
    if ON_GPU:
        co_executed = cpu_expert_tflops(model, CO_EXECUTION_TOKENS, threads=co_execution_threads(), copying_to=device,
                                        weighted=default_block_experts(model.config.n_routed_experts))
        figures |= {"pcie_gbps": h2d_gbps(device), "gpu_tflops": gemm_tflops(device),
                    "gpu_hbm_gbps": hbm_read_gbps(device), "device_free_bytes": free_device_memory(device),
                    "host_free_bytes": host_kv_budget(model),
                    "co_execution_share": co_executed / dict(by_tokens)[CO_EXECUTION_TOKENS]}  # fmt: skip
    return dataclasses.replace(Floors(), **figures)


@contextlib.contextmanager
def counting_compiles() -> Iterator[list]:
    """A list that grows by one for each program XLA compiles while the block runs."""
    compiles = []

    def count(event, _secs, **_):
        if event == BACKEND_COMPILE_EVENT:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(count)


def warmed_up(calls_run: int, warmup: int, compiled: int) -> bool:
    """Whether a call is timed: after `warmup` calls, the first that compiled nothing (or any once MAX_WARMUP_CALLS
    ran), and every call after it."""
    return calls_run > warmup and (not compiled or calls_run > MAX_WARMUP_CALLS)


@contextlib.contextmanager
def _queued_on_its_pool(queued: int, case: Policy) -> Iterator[None]:
    """`queued` expert steps queued, on the CPU pool a batch run gives `case`."""
    with expert_steps_queued(queued), case.cpu_pool():
        yield


def decode_step_seconds(model, slots: int, micro_batches: int | None, context: int, steps: int, rng,
                        experts: str = "cpu", cpu_blocks: int = 0, kv_in_host: bool = False,
                        cache_len: int = 0, attention_on_cpu: bool = False) -> tuple[float, int]:  # fmt: skip
    """Median seconds of a decode step of `slots` sequences each at `context` cached positions, run as the runner
    runs them (the next step dispatched before this one's tokens are read), the routed experts on the CPU or
    streamed to the GPU each step (`experts`), `cpu_blocks` of each layer's then on the CPU meanwhile, the KV cache
    in host memory with `kv_in_host`. Each slot has room for `cache_len` positions (a run's: its prompts and new
    tokens, bucketed as the runner does; a streamed step attends over, and with the cache in host memory copies, all
    of them), or for what the timed steps need if that is more. The caches hold zeros: a step's time depends on how
    much cache it reads, not on what is in it; its routing depends on the tokens, which differ. Also returned: the
    programs compiled during the timed calls (0 but where MAX_WARMUP_CALLS ran out)."""
    cfg = model.config
    most = model.decode_steps or DEVICE_ONLY_DECODE_STEPS  # decode steps a call may run
    cache_len = max(cache_len, -(-(context + (steps + 2) * most + 4) // 256) * 256)  # as decode.py
    engine = Engine(model, slots, cache_len, micro_batches, stream_experts=experts == "stream", cpu_blocks=cpu_blocks,
                    kv_in_host=kv_in_host, attention_on_cpu=attention_on_cpu)
    calls = -(-steps // engine.steps)
    one = model.family.model.init_cache(cfg, 1, context, model.dtype, model.placement.device)
    tokens = rng.integers(2, cfg.vocab_size, slots)
    for slot in range(slots):
        # Each slot its own token, sampled at temperature 1 with its own seed (as decode.py): identical greedy slots
        # would route every token to the same experts, and the CPU would read k experts a layer whatever the slots
        # (the session-15 figures, which did so).
        filled = Prefilled(one, jnp.asarray(tokens[slot : slot + 1], jnp.int32), jnp.ones(1, bool),
                           np.array([context], np.int32))
        engine.insert(filled, 0, slot, SamplingParams(temperature=1.0, seed=slot))
    # The first two calls compile and record the graphs. A streamed step compiles its expert-step programs for each
    # new block capacity its routing needs (powers of two: a handful over a run, seconds each on a GPU, where session
    # 24's 4 timed steps after 2, when capacities were eighths, were mostly compiling), so it warms up longer, and
    # then on until a call compiles nothing. Compiles in the timed calls are counted and returned.
    warmup = 2 if experts == "cpu" else STREAMED_WARMUP_STEPS
    times, previous, last, calls_run, timed_compiles = [], None, time.perf_counter(), 0, 0
    with counting_compiles() as compiles:
        while len(times) < calls:
            before = len(compiles)
            step = engine.generate()  # compiles, where it does, as it dispatches
            if previous is not None:
                previous.tokens()
            now = time.perf_counter()
            calls_run += 1
            compiled = len(compiles) - before
            if times or warmed_up(calls_run, warmup, compiled):
                times.append((now - last) / engine.steps)
                timed_compiles += compiled
            previous, last = step, now
        previous.tokens()
    return statistics.median(times), timed_compiles


def decode_cases(cfg, floors: Floors, work: Workload, itemsize: int, args) -> list[Policy]:
    """The decode steps to time, as policies of one attention micro-batch: each --slots with each --experts, and with
    --widen the resident copies held dequantized, with --kv-in-host streamed steps with the KV cache in host memory
    (and with --attention-on-cpu attended over there by the CPU); where the experts stream, also with the CPU blocks
    the model picks for that batch, where it picks any."""
    holdings = [(experts, False, False, False) for experts in args.experts]  # (experts, widened, in host, CPU attends)
    holdings += [(RESIDENT, True, False, False)] if args.widen else []
    holdings += [("stream", False, True, False)] if args.kv_in_host else []
    holdings += [("stream", False, True, True)] if args.attention_on_cpu else []
    cases = []
    for (experts, widened, in_host, on_cpu), slots in [(h, b) for h in holdings for b in args.slots]:
        case = Policy(slots, 1, 1, experts=experts, widened=widened, kv_in_host=in_host, attention_on_cpu=on_cpu)
        cases.append(case)
        if experts == "stream":
            try:
                split = search(cfg, floors, work, itemsize, True, slots=slots, micro_batches=1, experts="stream",
                               kv_in_host=in_host, attention_on_cpu=on_cpu)  # fmt: skip
            except ValueError:  # nothing fits at that many slots: the case is reported as not fitting
                continue
            if split.cpu_blocks:
                cases.append(dataclasses.replace(case, cpu_blocks=split.cpu_blocks))
    return cases


def holding(case: Policy) -> str:
    """A case's experts column: where its experts run, "-wide" where resident copies are held dequantized ("gpu-wide"),
    "-hkv" where the KV cache is in host memory ("stream-hkv"), "-cpuattn" where the CPU attends over it there."""
    in_host = ("-cpuattn" if case.attention_on_cpu else "-hkv") if case.kv_in_host else ""
    return case.experts + ("-wide" if case.widened else "") + in_host


def label(case: Policy) -> str:
    return holding(case) + (f"+{case.cpu_blocks}c" if case.cpu_blocks else "")


def case_fields(case: Policy, prefill: int | None = None) -> dict:
    fields = {"slots": case.slots, "experts": holding(case), "cpu_blocks": case.cpu_blocks}
    return fields if prefill is None else fields | {"prefill": prefill}


def prefill_seconds(model, batch: int, rng, deadline: float, repeats: int = 3, warmup: int = 2
                    ) -> tuple[float, str, int, int]:  # fmt: skip
    """Median seconds of the engine's prefill of `batch` random 512-token prompts over the calls after `warmup` that
    compiled nothing, the path it took, how many calls after `warmup` were left out for compiling, and the programs
    compiled while timed (0 but where MAX_WARMUP_CALLS calls ran or the `deadline` passed first). The stream-loaded path
    has a program per expert-step capacity, and a new prompt's routing may need one the earlier prompts did not: a
    run of thousands of prompts compiles each once, where timing them measured compiles (Qwen3-30B-A3B, 8 layers,
    1x H200: 1.1-2.4 s a call in sessions 31-33 against ~90 ms of copies)."""
    engine = Engine(model, 1, PROMPT + 1)
    params = [SamplingParams()] * batch
    times, calls_run, left_out, timed_compiles = [], 0, 0, 0
    with counting_compiles() as compiles:
        while len(times) < repeats:
            seqs = rng.integers(2, model.config.vocab_size, (batch, PROMPT)).tolist()
            before, start = len(compiles), time.perf_counter()
            prefilled = engine.prefill(seqs, params)
            np.asarray(prefilled.tokens)
            seconds, compiled = time.perf_counter() - start, len(compiles) - before
            del prefilled
            calls_run += 1
            if calls_run <= warmup:
                continue
            if compiled and calls_run <= MAX_WARMUP_CALLS and time.perf_counter() < deadline:
                left_out += 1
                continue
            times.append(seconds)
            timed_compiles += compiled
    path = choose_prefill_path(model, batch, PROMPT, threshold=model.stream_prefill_threshold)
    return statistics.median(times), path, left_out, timed_compiles


def bench_model(spec: str, args, memory: dict, rng, deadline: float) -> dict:
    geometry, _, layers = spec.partition(":")
    model, name, full = load(geometry, int(layers) if layers else None, args.dtype)
    cfg, itemsize = model.config, jnp.dtype(model.dtype).itemsize
    resident = args.experts == [RESIDENT]
    if resident:
        placed = model.place_experts("auto")
        if model.experts_on_host:
            model.close()
            return {"model": name, "error": f"only {placed.experts} routed experts fit the device: not all resident"}
        print(f"placed all {placed.experts} routed experts on the device")
    where = RESIDENT if resident else "cpu"  # where the prefill's predictions put the experts
    floors = measured_floors(model, memory, [*args.slots, *(p * PROMPT for p in args.prefill)])
    work = Workload(args.requests, PROMPT, NEW, bucket(PROMPT + NEW))
    context = PROMPT + NEW // 2
    print(f"\n{name}: {cfg.num_hidden_layers} of {full.num_hidden_layers} layers; floors: read "
          f"{floors.host_read_gbps:.1f} GB/s, H2D {floors.pcie_gbps:.1f} GB/s, GEMM {floors.gpu_tflops:.0f} TFLOP/s, "
          f"HBM {floors.gpu_hbm_gbps:.0f} GB/s, "
          f"CPU experts {', '.join(f'{r:.2f} at {t}' for t, r in floors.cpu_expert_tflops_by_tokens)} TFLOP/s "
          f"(tokens per call; co-executed beside the link's copies at {floors.co_execution_share:.2f} of the rate), "
          f"CPU attention {floors.cpu_attention_gflops:.0f} GFLOP/s, device free "
          + (f"{floors.device_free_bytes / 2**30:.1f} GiB" if floors.device_free_bytes else "unbounded"))  # fmt: skip

    interactive, _ = decode_step_seconds(model, 1, None, context, args.steps, rng)  # as generate runs one prompt
    interactive_tok_s = 1 / interactive
    print(f"interactive batch 1: {1e3 * interactive:.1f} ms/step, {interactive_tok_s:.2f} tok/s")

    decode, prefill = {}, {}  # decode: {case: ...}, prefill: {(prompts, widened): ...}
    print(f"{'slots':>6} {'experts':>9} {'step ms':>9} {'tok/s':>9} {'pred ms':>9} {'pred tok/s':>10} {'meas/pred':>9}")

    def timed(case: Policy) -> tuple[float, int]:
        return decode_step_seconds(model, case.slots, 1, context, args.steps, rng, case.experts, case.cpu_blocks,
                                   case.kv_in_host, work.cache_len, case.attention_on_cpu)

    for case in decode_cases(cfg, floors, work, itemsize, args):
        slots = case.slots
        if time.perf_counter() > deadline:
            print(f"time limit: slots {slots} with experts {label(case)} and on not run")
            break
        kv = slots * kv_bytes_per_slot(cfg, max(work.cache_len, context + args.steps + 4), itemsize)
        # In host memory: two layers' caches on the device, or none where the CPU attends over it.
        on_device = DEVICE_LAYERS * kv // cfg.num_hidden_layers if case.kv_in_host else kv
        on_device = 0 if case.attention_on_cpu else on_device
        held = on_device + case.widened * widened_expert_bytes(cfg, itemsize)
        if floors.device_free_bytes is not None and held > floors.device_free_bytes:
            print(f"{slots:6d} slots: their KV cache ({kv / 2**30:.1f} GiB)"
                  f"{' and the widened copies' if case.widened else ''} do not fit the device")
            continue
        if case.kv_in_host and floors.host_free_bytes is not None and kv > floors.host_free_bytes:
            print(f"{slots:6d} slots: their KV cache ({kv / 2**30:.1f} GiB) does not fit host memory")
            continue
        model.hold_resident_experts(case.widened)
        with case.cpu_pool():  # as a batch run has it
            step, compiled = timed(case)
        predicted = predict(cfg, floors, work, case, itemsize, ON_GPU).step_s
        decode[case] = {"step_s": step, "predicted_step_s": predicted, "timed_compiles": compiled}
        print(f"{slots:6d} {label(case):>9} {1e3 * step:9.1f} {slots / step:9.1f} {1e3 * predicted:9.1f} "
              f"{slots / predicted:10.1f} {predicted / step:9.2f}"
              + (f" ({compiled} compiles while timed)" if compiled else ""))  # fmt: skip

    def timed_again(cases, values, key: str, setting, said) -> list[dict]:
        """Each of `cases` timed again under each of `values` (setting(value, case): a context manager), after the
        grid: rows of the case's fields, `key`: the value and the step; `said(value)` words it."""
        rows = []
        for value, case in [(v, c) for v in values for c in cases]:
            if time.perf_counter() > deadline:
                print(f"time limit: cases {said(value)} and on not run")
                break
            with setting(value, case):
                step, compiled = timed(case)
            rows.append(case_fields(case) | {key: value, "step_ms": round(1e3 * step, 2), "timed_compiles": compiled})
            print(f"{case.slots:6d} {label(case):>9} {1e3 * step:9.1f} ms {said(value)} "
                  f"(in the grid: {1e3 * decode[case]['step_s']:.1f})")
        return rows

    # The co-executed cases with the CPU kernels' pool at each --threads size; the streamed ones with each number of
    # --queued-expert-steps (on the pool a batch run gives them).
    by_threads = timed_again([c for c in decode if c.cpu_blocks], args.threads, "threads",
                             lambda threads, _: pool_of(threads), lambda t: f"with {t or 'all'} pool threads")
    by_queued = timed_again([c for c in decode if c.experts == "stream"], args.queued_expert_steps,
                            "queued_expert_steps", _queued_on_its_pool,
                            lambda q: f"with {q} expert steps queued")
    print(f"{'prompts':>7} {'path':>7} {'ms':>9} {'tok/s':>9} {'pred ms':>9}")
    for wide, batch in [(w, b) for w in [False, *([True] if args.widen else [])] for b in args.prefill]:
        if time.perf_counter() > deadline:
            print(f"time limit: prefill {batch}{' widened' if wide else ''} and up not run")
            break
        free = floors.device_free_bytes
        if wide and free is not None and widened_expert_bytes(cfg, itemsize) > free:
            print(f"prefill {batch}: the widened copies do not fit the device")
            continue
        model.hold_resident_experts(wide)
        seconds, path, left_out, compiled = prefill_seconds(model, batch, rng, deadline)
        policy = Policy(1, 1, batch, experts=where, widened=wide)
        predicted = predict(cfg, floors, work, policy, itemsize, ON_GPU).prefill_s
        prefill[batch, wide] = {"seconds": seconds, "predicted_s": predicted, "path": path,
                                "calls_left_out_compiling": left_out, "timed_compiles": compiled}  # fmt: skip
        path += "-wide" if wide else ""
        print(f"{batch:7d} {path:>7} {1e3 * seconds:9.1f} {batch * PROMPT / seconds:9.1f} {1e3 * predicted:9.1f}"
              + (f" ({left_out} calls that compiled left out)" if left_out else "")
              + (f" ({compiled} compiles while timed)" if compiled else ""))  # fmt: skip

    def run_tok_s(b, p, step, pre):
        generated = work.requests * NEW
        return generated / (-(-work.requests // p) * pre + generated / b * step)

    result = {
        "model": name, "layers": cfg.num_hidden_layers, "full_layers": full.num_hidden_layers,
        "floors": dataclasses.asdict(floors), "interactive_tok_s": round(interactive_tok_s, 2),
        "decode": [case_fields(c) | {"step_ms": round(1e3 * d["step_s"], 2), "tok_s": round(c.slots / d["step_s"], 2),
                                     "predicted_tok_s": round(c.slots / d["predicted_step_s"], 2),
                                     "timed_compiles": d["timed_compiles"]}
                   for c, d in decode.items()],
        "co_executed_by_threads": by_threads,
        "streamed_by_queued_expert_steps": by_queued,
        "prefill": [{"prompts": p, "path": d["path"], "widened": w, "ms": round(1e3 * d["seconds"], 1),
                     "tok_s": round(p * PROMPT / d["seconds"], 1),
                     "predicted_tok_s": round(p * PROMPT / d["predicted_s"], 1),
                     "calls_left_out_compiling": d["calls_left_out_compiling"],
                     "timed_compiles": d["timed_compiles"]} for (p, w), d in prefill.items()],
    }  # fmt: skip
    if decode:
        best_decode = max(c.slots / d["step_s"] for c, d in decode.items())
        result["best_decode_vs_interactive"] = round(best_decode / interactive_tok_s, 1)
    grid = {(c, p): run_tok_s(c.slots, p, d["step_s"], prefill[p, c.widened]["seconds"])
            for c, d in decode.items() for p, w in prefill if p <= c.slots and w == c.widened}  # fmt: skip
    if not grid:  # the decode figures are kept; a run's throughput needs both phases
        print("no slots x prefill case measured: no run throughput, no pick")
        model.close()
        return result | {"error": "no slots x prefill case ran within the time limit"}
    best = max(grid, key=grid.get)
    # The model's pick over the same grid: the policy it predicts fastest among the measured cases.
    def pick(c: Policy, p: int) -> Policy:
        streams = c.experts == "stream"
        return search(cfg, floors, work, itemsize, ON_GPU, slots=c.slots, micro_batches=1, prefill_batch=p,
                      experts=None if resident else c.experts, cpu_blocks=c.cpu_blocks if streams else None,
                      resident=resident, widened=c.widened if resident else None,
                      kv_in_host=c.kv_in_host if streams else None,
                      attention_on_cpu=c.attention_on_cpu if streams else None)  # fmt: skip

    picks = {key: pick(*key) for key in grid}
    pick_key = max(picks, key=lambda key: picks[key].prediction.total_tok_s)
    measured_pick, predicted_pick = grid[pick_key], picks[pick_key].prediction.total_tok_s
    result |= {
        "best_of_grid": case_fields(*best) | {"tok_s": round(grid[best], 2)},
        "policy_pick": case_fields(*pick_key) | {"measured_tok_s": round(measured_pick, 2),
                                                 "predicted_tok_s": round(predicted_pick, 2)},
        "pick_vs_best": round(measured_pick / grid[best], 3),
        "measured_vs_predicted": round(measured_pick / predicted_pick, 3),
    }  # fmt: skip
    # Projected: the full-depth prediction x measured / predicted.
    if cfg.num_hidden_layers < full.num_hidden_layers and not resident:
        scale = result["measured_vs_predicted"]
        # The model's own full-depth pick with the pick's expert placement, not the pick's slots: the full model's
        # KV cache is deeper, and as many slots as the truncated one ran need not fit the device.
        picked = pick_key[0]
        full_pick = search(full, floors, work, itemsize, ON_GPU, experts=picked.experts,
                           kv_in_host=picked.kv_in_host if picked.experts == "stream" else None,
                           attention_on_cpu=picked.attention_on_cpu if picked.experts == "stream" else None)
        interactive_full = predict(full, floors, work, Policy(1, 1, 1), itemsize, ON_GPU).decode_tok_s
        interactive_trunc = predict(cfg, floors, work, Policy(1, 1, 1), itemsize, ON_GPU).decode_tok_s
        projected_interactive = interactive_tok_s * interactive_full / interactive_trunc
        result["projected_full_depth"] = {
            "slots": full_pick.slots, "micro_batches": full_pick.micro_batches, "experts": full_pick.experts,
            "cpu_blocks": full_pick.cpu_blocks, "prefill": full_pick.prefill_batch,
            "tok_s": round(full_pick.prediction.total_tok_s * scale, 2),
            "decode_tok_s": round(full_pick.prediction.decode_tok_s * scale, 2),
            "interactive_tok_s": round(projected_interactive, 2),
            "decode_vs_interactive": round(full_pick.prediction.decode_tok_s * scale / projected_interactive, 1),
        }  # fmt: skip
        in_host = [(c.slots, d) for c, d in decode.items() if c.kv_in_host]
        if in_host:  # the KV cache in host memory at full depth, scaled by its largest measured step
            b, d = max(in_host, key=lambda case: case[0])
            host_scale = d["predicted_step_s"] / d["step_s"]
            full_host = dataclasses.replace(floors, host_free_bytes=int(args.host_kv_gib * 2**30))
            host_pick = search(full, full_host, work, itemsize, ON_GPU, experts="stream", kv_in_host=True)
            decode_tok_s = host_pick.prediction.decode_tok_s * host_scale
            result["projected_full_depth_kv_in_host"] = {
                "host_kv_gib": args.host_kv_gib, "slots": host_pick.slots, "cpu_blocks": host_pick.cpu_blocks,
                "scaled_by_slots": b, "measured_vs_predicted": round(host_scale, 3),
                "decode_tok_s": round(decode_tok_s, 2), "interactive_tok_s": round(projected_interactive, 2),
                "decode_vs_interactive": round(decode_tok_s / projected_interactive, 1),
            }  # fmt: skip
    print(f"best of the grid: {best[0].slots} slots, experts {label(best[0])}, prefill {best[1]}: {grid[best]:.1f} "
          f"tok/s; the model's pick: {pick_key[0].slots} slots, experts {label(pick_key[0])}, prefill {pick_key[1]}: "
          f"{measured_pick:.1f} "
          f"tok/s measured, {predicted_pick:.1f} predicted; best decode / interactive = "
          f"{result['best_decode_vs_interactive']}x")  # fmt: skip
    for key in ("projected_full_depth", "projected_full_depth_kv_in_host"):
        if key in result:
            print(f"{key.replace('_', ' ')}: {result[key]}")
    model.close()
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["deepseek-v3:5", "qwen3-30b-a3b"],
                        help="geometries, each GEOMETRY[:LAYERS]")
    parser.add_argument("--slots", type=int, nargs="+", default=[64, 256, 512, 1024])
    parser.add_argument("--prefill", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--experts", nargs="+", choices=[*EXPERTS, RESIDENT],
                        default=list(EXPERTS) if ON_GPU else ["cpu"],
                        help="where decode steps run the routed experts (stream: to the GPU each step, GPU only; "
                             f"{RESIDENT}: all placed on the device first, alone)")
    parser.add_argument("--widen", action="store_true",
                        help=f"with --experts {RESIDENT}: every case also with the FP8 copies held dequantized")
    parser.add_argument("--kv-in-host", action="store_true",
                        help="with --experts stream: every streamed case also with the KV cache in host memory")
    parser.add_argument("--attention-on-cpu", action="store_true",
                        help="with --experts stream: every streamed case also with the KV cache in host memory and "
                             "the CPU attending over it there")
    parser.add_argument("--host-kv-gib", type=float, default=256.0,
                        help="with --kv-in-host: the host memory a full-size host gives the KV cache, for the "
                             "full-depth projection")
    parser.add_argument("--requests", type=int, default=4096, help="the modelled run's requests")
    parser.add_argument("--steps", type=int, default=6, help="timed decode steps per case")
    parser.add_argument("--dtype", default="bfloat16" if ON_GPU else "float32")
    parser.add_argument("--threads", type=int, nargs="+", default=[],
                        help="time the co-executed cases (CPU blocks beside the streamed ones) again with the CPU "
                             "kernels' pool at each of these sizes (0: one thread per core), after the grid")
    parser.add_argument("--queued-expert-steps", type=int, nargs="+", default=[],
                        help="time the streamed cases again with each number of expert steps left queued on the "
                             "device (0: each waited for; stream_prefill.expert_steps_queued), after the grid")
    parser.add_argument("--time-limit", type=float, default=330.0,
                        help="seconds after which no further case starts (the JSON line still ends the run)")
    args = parser.parse_args(argv)
    if RESIDENT in args.experts and args.experts != [RESIDENT]:
        parser.error(f"--experts {RESIDENT} places every expert on the device for the whole run: give it alone")
    if (args.kv_in_host or args.attention_on_cpu) and "stream" not in args.experts:
        parser.error("--kv-in-host and --attention-on-cpu hold the KV cache of streamed steps in host memory: they "
                     "need --experts stream")
    if args.widen and args.experts != [RESIDENT]:
        parser.error(f"--widen holds the resident experts dequantized: it needs --experts {RESIDENT}")
    start = time.perf_counter()
    memory = memory_floors()
    print(floors_line(memory))
    rng = np.random.default_rng(0)
    results = []
    for i, spec in enumerate(args.models):
        # Each model gets its share of the time left.
        deadline = start + args.time_limit * (i + 1) / len(args.models)
        results.append(bench_model(spec, args, memory, rng, deadline))
    print(json.dumps({"bench": "offline", "machine": machine(), "floors": memory, "results": results}))


if __name__ == "__main__":
    main()
