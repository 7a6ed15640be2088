"""Decode benchmark: tokens/s of the jitted decode step, split into XLA work, CPU expert work and hand-off.

    python bench/decode.py --checkpoint PATH [--batch 1 2] [--context 1024] [--steps 32]
    python bench/decode.py --geometry deepseek-v3 --layers 10 --format fp8 [--batch 1] [--context 1024 16384]
    python bench/decode.py --geometry deepseek-v3 --layers 5 --format q4_k [--gguf-dir DIR] [--keep-gguf]

A geometry builds a random checkpoint of that model's real shapes in memory (hybridjit.synthetic), loaded by
the same loader and expert bank as a real one; with --layers the model is truncated and tokens/s at full
depth is reported as a projection (labelled so): the step time per MoE layer, dense layers and LM head
included, times the full model's MoE layers. The step runs where Placement.default puts it: on a GPU
with the routed experts on the CPU behind the CUDA hand-off, else all on XLA:CPU.

A GGUF format (q2_k, q3_k, q4_k, q5_k, q6_k, q8_0, q4_k_m, q2_k_m: moe_cpu.py's names; a geometry whose family llama.cpp
converts) writes the truncated geometry as a GGUF file laid out as llama.cpp's conversions are
(hybridjit.synthetic_gguf: the routed experts random blocks of that format with the spread of real weights, the other
tensors BF16) into --gguf-dir (default a new temporary directory; a 5-layer DeepSeek-V3 in q4_k takes 21 GB), removed at
exit unless --keep-gguf, and loads it as any GGUF (hybridjit.load): its experts stay in the file's memory mapping, every
page of it mapped before timing, and the floor counts their blocks' bytes. Its base (below) is the geometry's dense
layers in bf16, as the GGUF holds them (a GGUF without MoE layers is no model the loader takes).

Split of a step: `expert_ms` is the CPU time in the routed-expert jobs (counted by the hand-off on a GPU;
measured by running the expert calls alone on the CPU otherwise; `expert_alone_ms` is always the latter),
`handoff_us` the hand-off mechanism per submit/wait pair (its round trip less the CPU job inside it; GPU
only), `xla_ms` the rest; `cpu_busy` is the fraction of the step in which the CPU runs expert jobs
(KTransformers' "CPU utilisation": the expert pool's cores are either all in a job or idle), on a GPU the
jobs' time over the wall time of the same steps (both means over one window; the step time reported is the
median). The floor is the time to read each step's distinct experts once at the memory read bandwidth
measured by the same run, right before and after the case (`floor_gbps`; bench/floors.py's ReadFloor says why
not once per run).

Per MoE layer: the same geometry cut to its dense layers is timed too (`base_step_ms`: embedding, dense layers, LM
head and sampling; a family whose every layer is MoE gets it from the steps of 1 and of --layers layers, every
expert on the CPU: base = (d step(1) - step(d)) / (d - 1)), and `moe_layer_ms` = (step - base) / MoE
layers, everything a MoE layer costs on GPU and CPU; `layer_ratio` = that / (its expert floor + hand-off),
the target's measure; `moe_cpu_busy` = expert_ms / (the window's mean step - base), the CPU utilisation of the
MoE layers alone (a truncated model's dense layers and LM head, which have no expert jobs, would dilute
`cpu_busy`); the base is timed apart, so this one is good to a few percent and may pass 100%.
With --layers, `projected_by_layer_tok_s` = base + the full model's MoE layers at that time each: the closer
projection.
Ends with one JSON line.
"""

import argparse
import atexit
import dataclasses
import itertools
import json
import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from moe_cpu import GGUF_FORMATS

import hybridjit_ffi as _ffi
from bench_model import add_model_arguments, load_model
from floors import ReadFloor, floors_line, machine, memory_floors, vmstat
from hybridjit import engine
from hybridjit.auto_placement import (
    device_budget,
    device_weight_bytes,
    kv_cache_bytes,
    resident_expert_bytes,
)
from hybridjit.expert_residency import Residency
from hybridjit.machine_floors import hbm_read_gbps
from hybridjit.models import deepseek_v3 as dsv3
from hybridjit.models.registry import GEOMETRIES, ModelConfig
from hybridjit.ops.async_experts import submit_routed_experts, wait_routed_experts
from hybridjit.ops.routed_experts import configure_threads, kernel_info, register_layer, routed_experts
from hybridjit.placement import Placement
from hybridjit.sampling import SamplingParams
from hybridjit.serving.engine import DEVICE_ONLY_DECODE_STEPS, Engine, Prefilled
from hybridjit.synthetic import geometry_config
from hybridjit.synthetic_gguf import ARCHITECTURES, write_synthetic_gguf

ON_GPU = jax.default_backend() == "gpu"


def timed(fn, repeats):
    """Median wall time in ms of fn() (which must block until its work is done), after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def write_gguf_geometry(args) -> Path:
    """Writes --geometry, truncated to --layers, as a GGUF file with --format experts (random weights) in --gguf-dir
    (default: a new temporary directory), removed at exit unless --keep-gguf; returns its path."""
    gate_up, down = GGUF_FORMATS[args.format]
    directory = Path(args.gguf_dir or tempfile.mkdtemp(prefix="decode-gguf-"))
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{args.geometry}-{args.layers or 'full'}-{args.format}.gguf"
    if not args.keep_gguf:  # registered first: a write that fails half-way leaves nothing either
        if args.gguf_dir:
            atexit.register(path.unlink, missing_ok=True)
        else:
            atexit.register(shutil.rmtree, directory, ignore_errors=True)
    start = time.perf_counter()
    cfg = geometry_config(args.geometry, layers=args.layers, weight_format="bf16")
    size = write_synthetic_gguf(path, cfg, gate_up, down)
    print(f"wrote {path} ({size / 1e9:.1f} GB{', kept' if args.keep_gguf else ''}) in "
          f"{time.perf_counter() - start:.1f} s")
    return path


def load_gguf_geometry(path: Path, args, placement: Placement) -> tuple[engine.Model, str, ModelConfig]:
    """(the Model, its name, the config at full depth) of write_gguf_geometry's file, loaded as any GGUF with the
    residency --resident then sets (not load's automatic one). Every page of its routed experts is mapped here:
    they stay in the file's mapping, where a page's first read faults, which decode steps would otherwise pay the
    first time they choose an expert."""
    start = time.perf_counter()
    model = engine.load(str(path), placement=dataclasses.replace(placement, resident_experts=None))
    for t in model._loader.ckpt.file.tensors.values():
        if t.name.endswith("_exps.weight"):
            t.data[:: mmap.PAGESIZE].max()
    name = f"{args.geometry} ({args.format} GGUF, random weights)"
    full = geometry_config(args.geometry, weight_format="bf16")
    print(f"loaded {name}, {model.config.num_hidden_layers} of {full.num_hidden_layers} layers, in "
          f"{time.perf_counter() - start:.1f} s")
    return model, name, full


def expert_bytes(model: engine.Model) -> int:
    """Bytes of one routed expert's three projections as stored (weights, scales and biases)."""
    layer = model.expert_layers[0]
    return layer.nbytes // layer.n_experts


def handoff_us(cfg: ModelConfig, batch: int, dtype, pairs: int = 32) -> float:
    """The hand-off mechanism alone: the round trip of one submit/wait pair on the GPU (copies, doorbell, the
    worker noticing it, the stream's wait released, the result copied back) less the CPU job inside it, which
    here is one of experts of width 1."""
    k = cfg.num_experts_per_tok
    rng = np.random.default_rng(1)
    gate = [rng.standard_normal((1, cfg.hidden_size), np.float32) for _ in range(k)]
    down = [rng.standard_normal((cfg.hidden_size, 1), np.float32) for _ in range(k)]
    with register_layer(gate, gate, down) as layer:
        ids = jnp.tile(jnp.arange(k, dtype=jnp.int32), (batch, 1))
        weights = jnp.zeros((batch, k), jnp.float32)

        @jax.jit
        def chain(x):
            for _ in range(pairs):
                pending, x = submit_routed_experts(x, ids, weights, layer=layer.id, slot=7)
                x, _ = wait_routed_experts(pending, x, top_k=k, slot=7)
            return x

        x = jnp.zeros((batch, cfg.hidden_size), dtype)
        chain(x).block_until_ready()
        _ffi.take_gpu_handoff_stats()
        pair_ms = timed(lambda: chain(x).block_until_ready(), 20) / pairs
        jobs, seconds, _ = _ffi.take_gpu_handoff_stats()
        return 1e3 * (pair_ms - 1e3 * seconds / jobs)


def cpu_expert_ms(model: engine.Model, batch: int, rng) -> float:
    """The routed experts of every MoE layer for `batch` tokens, run alone on the CPU (uniform routing)."""
    cfg = model.config
    cpu = jax.devices("cpu")[0]
    moe = [layer.mlp for layer in model.weights.layers if isinstance(layer.mlp, dsv3.MoE)]
    ids = np.stack([rng.choice(cfg.n_routed_experts, cfg.num_experts_per_tok, replace=False) for _ in range(batch)])
    ids = jax.device_put(ids.astype(np.int32), cpu)
    weights = jax.device_put(np.full(ids.shape, 1 / cfg.num_experts_per_tok, np.float32), cpu)
    x = jax.device_put(rng.standard_normal((batch, cfg.hidden_size)).astype(np.float32), cpu)

    @jax.jit
    def experts_only(x):
        for m in moe:
            x = routed_experts(x, ids, weights, layer=m.expert_layer)
        return x

    return timed(lambda: experts_only(x).block_until_ready(), 5)


def random_cache(model: engine.Model, batch: int, length: int, rng) -> list:
    """The family's KV cache of `length` positions filled with unit-scale random values: decode time depends on
    how much cache it reads, not on what is in it, so long contexts need no prefill."""
    empty = model.family.model.init_cache(model.config, batch, length, model.dtype, model.placement.device)
    return jax.tree.map(
        lambda a: jax.device_put(rng.standard_normal(a.shape, np.float32).astype(a.dtype), model.placement.device),
        empty,
    )


def step_times(model: engine.Model, batch: int, context: int, steps: int, rng) -> tuple[list[float], float, Engine]:
    """Times decode steps as the serving engine runs them (the next call dispatched before this call's tokens
    are read back), `batch` slots each over a cache already holding `context` positions: (each call's time per
    step in ms, the seconds from the hand-off's statistics reset to the last call's end: the window whose expert
    jobs take_gpu_handoff_stats then reports, the Engine: its micro-batches and steps per call)."""
    cfg = model.config
    most = model.decode_steps or DEVICE_ONLY_DECODE_STEPS  # decode steps a call may run
    # Room rounded up as serving's cache lengths are (buckets, the model's context): an odd length costs a padded
    # copy of each layer's cache a step on the GPU.
    decoder = Engine(model, batch, -(-(context + (steps + 3) * most + 4) // 256) * 256)
    calls = max(2, -(-steps // decoder.steps))  # at least two for a spread
    tokens = jnp.asarray(rng.integers(2, cfg.vocab_size, batch), jnp.int32)
    filled = Prefilled(random_cache(model, batch, context, rng), tokens, jnp.ones(batch, bool),
                       np.full(batch, context, np.int32))
    for slot in range(batch):
        # Sampled at temperature 1 rather than greedy: a random model's greedy tokens settle on a few that route to
        # the same experts step after step, and routing should stay uniform (the floor and residency assume it).
        decoder.insert(filled, slot, slot, SamplingParams(temperature=1.0, seed=slot))
    step_ms, last, previous = [], time.perf_counter(), None
    for i in range(calls + 3):
        step = decoder.generate()
        if previous is not None:
            previous.tokens()
        now = time.perf_counter()
        if i >= 3:  # the first calls compile and record the graph
            step_ms.append(1e3 * (now - last) / decoder.steps)
        elif i == 2 and ON_GPU:
            _ffi.take_gpu_handoff_stats()
            window_start = now
        last, previous = now, step
    previous.tokens()
    return step_ms, (time.perf_counter() - window_start if ON_GPU else 0.0), decoder


def bench_case(model: engine.Model, batch: int, context: int, steps: int, rng) -> dict:
    cfg, w = model.config, model.weights
    step_ms, window_s, decoder = step_times(model, batch, context, steps, rng)
    groups = len(decoder.groups)
    window_steps = (len(step_ms) + 1) * decoder.steps  # the window holds the last calls + 1 (the first in part)
    step = statistics.median(step_ms)
    deciles = statistics.quantiles(step_ms, n=10)
    moe_layers = sum(isinstance(layer.mlp, dsv3.MoE) for layer in w.layers)
    handler_runs = None
    alone_ms = cpu_expert_ms(model, batch, rng)
    if ON_GPU:
        jobs, seconds, handler_runs = _ffi.take_gpu_handoff_stats()
        expert_ms, window_step_ms = 1e3 * seconds / window_steps, 1e3 * window_s / window_steps
        handoff = handoff_us(cfg, batch, model.dtype)
    else:
        expert_ms, window_step_ms, handoff = alone_ms, step, 0.0
    distinct = distinct_experts(cfg, batch)
    return {
        "batch": batch,
        "context": context,
        "dual_batch": groups == 2,
        "steps_per_call": decoder.steps,
        "n_deferred": model.expert_schedule.n_deferred,
        "median_step_ms": round(step, 3),
        # The spread of the case's own steps: a step slower than its neighbours shows here, a whole case
        # slower than its repeats in the --repeat summary.
        "step_ms_p10": round(deciles[0], 3),
        "step_ms_p90": round(deciles[-1], 3),
        "tok_s": round(batch * 1e3 / step, 2),
        "tpot_ms": round(step, 3),
        "expert_ms": round(expert_ms, 3),
        # The same layers' expert jobs run back to back on the CPU alone (uniform routing): what the step's
        # expert jobs would take without the GPU around them.
        "expert_alone_ms": round(alone_ms, 3),
        "handoff_us_per_layer": round(handoff, 1),
        "cpu_busy": round(expert_ms / window_step_ms, 3),
        "window_step_ms": round(window_step_ms, 3),
        "xla_ms": round(step - expert_ms - handoff * moe_layers * groups / 1e3, 3),
        "moe_layers": moe_layers,
        # CUDA handler bodies run per step: one per call without graphs, ~0 when replayed as a graph.
        "handler_runs_per_step": round(handler_runs / window_steps, 2) if handler_runs is not None else None,
        "expert_bytes_per_step": int(distinct * expert_bytes(model) * moe_layers),
    }


def full_depth_auto(model: engine.Model, full: ModelConfig) -> int:
    """The resident experts per MoE layer that the automatic placement gives the untruncated model on this device:
    its budget with the full model's other weights (those of the truncated one are loaded already) and all its MoE
    layers sharing the memory, so that a truncated run measures the share a full load would hold."""
    still_to_load = device_weight_bytes(full, model.dtype) - device_weight_bytes(model.config, model.dtype)
    return device_budget(full, model.placement.device, model.dtype, weights_to_load=still_to_load).resident_per_layer


def place(model: engine.Model, share: str, counts: dict | None, full: ModelConfig | None = None) -> tuple[int, float]:
    """Holds `share` ("auto", or a share of each MoE layer's experts) of the routed experts on the GPU: the most
    activated in `counts` (layer -> activations per expert), or with uniform routing (None) the first ones; "auto"
    of a truncated model (`full` its untruncated config) holds as many per layer as the full model's would.
    Returns (the number per layer, the share of the activations they cover)."""
    e = model.config.n_routed_experts
    if share == "auto" and (full is None or full.num_hidden_layers == model.config.num_hidden_layers):
        residency = model.place_experts("auto", counts=counts)
    else:
        n = full_depth_auto(model, full) if share == "auto" else round(float(share) * e)
        residency = Residency.most_used(counts or {layer: np.zeros(e) for layer in model._loader.expert_names}, n)
        model.place_experts(residency)
    n = min((len(ids) for ids in residency.layers.values()), default=0)
    return n, residency.covered_share(counts) if counts else n / e


def skew_routing(model: engine.Model, exponent: float, rng) -> dict:
    """Zipf-like expert popularity: each MoE layer gets -exponent * log(rank) (the ranks a random permutation per
    layer) added to its selection bias (noaux_tc's correction bias: the scores it selects by are sigmoids in
    [0, 1]) or, for a router without one (softmax routers: Qwen3, Mixtral, gpt-oss), to its logits (its
    probabilities scaled by rank ** -exponent, the weights too); then the activations per expert of random prompts
    (Model.probe), whose skew the routing actually has."""
    layers = []
    for layer in model.weights.layers:
        if isinstance(layer.mlp, dsv3.MoE):
            moe = layer.mlp
            skew = -exponent * np.log(rng.permutation(model.config.n_routed_experts) + 1)
            if moe.correction_bias is not None:
                moe = dataclasses.replace(moe, correction_bias=moe.correction_bias + skew.astype(np.float32))
            else:
                before = 0.0 if moe.router_bias is None else moe.router_bias
                moe = dataclasses.replace(moe, router_bias=before + model.placement.put(skew, jnp.float32))
            layer = dataclasses.replace(layer, mlp=moe)
        layers.append(layer)
    model.weights = dataclasses.replace(model.weights, layers=layers)
    prompts = rng.integers(2, model.config.vocab_size, (32, 64)).tolist()
    return model.probe(prompts)


def distinct_experts(cfg, batch: int) -> float:
    """The expected distinct experts of one MoE layer that `batch` tokens route to, routing uniform over the
    batch * k choices (one token's k are distinct)."""
    n, picks = cfg.n_routed_experts, batch * cfg.num_experts_per_tok
    return n * (1 - (1 - 1 / n) ** picks) if batch > 1 else cfg.num_experts_per_tok


def resident_read_bytes(model: engine.Model, batch: int, covered: float) -> float:
    """Bytes of resident experts one MoE layer reads in a step: its distinct experts times the share of the pairs
    the resident set covers."""
    return distinct_experts(model.config, batch) * covered * resident_expert_bytes(model.config, model.dtype)


def hbm_bytes_per_step(model: engine.Model, batch: int, context: int, covered: float) -> int:
    """Device-memory bytes a decode step must read: every weight but the embedding table (one row per token) and
    the resident experts, of those the distinct ones the step's `batch` tokens route to (uniform routing) times
    the share held there, and the KV cache of `batch` sequences of `context` positions."""
    resident = [layer.mlp.resident for layer in model.weights.layers if getattr(layer.mlp, "resident", None)]
    held = sum(a.nbytes for r in resident for a in jax.tree.leaves(r))
    w = model.weights
    everything = sum(a.nbytes for a in jax.tree.leaves(w)) - w.embed.nbytes + batch * w.embed.nbytes // w.embed.shape[0]
    kv = kv_cache_bytes(model.config, model.dtype, batch, context)
    return int(everything - held + len(resident) * resident_read_bytes(model, batch, covered) + kv)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--format", default="fp8", choices=("fp8", "bf16", *GGUF_FORMATS),
                        help="weight format of a geometry; a GGUF one (its experts' blocks) writes a GGUF file")
    parser.add_argument("--gguf-dir", help="where a GGUF format's file is written (default: a temporary directory)")
    parser.add_argument("--keep-gguf", action="store_true", help="keep a GGUF format's file (default: removed at exit)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--context", type=int, nargs="+", default=[1024])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--dtype", default=None, help="compute dtype (default: float32 on CPU, bfloat16 on GPU)")
    parser.add_argument("--overlap", default="on", choices=("on", "off", "both"),
                        help="dual-batch attention-MoE overlap for batches of 2 or more")
    parser.add_argument("--deferred", type=int, nargs="+", default=[],
                        help="also run batch 1 with Expert Deferral of these many experts")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the whole list of cases this many times in one process and report the spread of "
                             "identical cases (max/min of their step and per-layer ratios)")
    parser.add_argument("--spin-us", type=int, nargs="+", default=[],
                        help="run the cases once per idle-worker spin time of the CPU expert pool, in microseconds "
                             "(HYBRIDJIT_POOL_SPIN_US; default: as configured)")
    parser.add_argument("--resident", nargs="+", default=["0"],
                        help="routed experts resident on the GPU per MoE layer, as a share of its experts (0 to 1) "
                             "or 'auto' (as many as the device's memory allows: Model.place_experts; with --layers, "
                             "as many as the full model would hold)")
    parser.add_argument("--zipf", type=float, default=0.0,
                        help="skew expert popularity by this exponent (a selection bias, or a softmax router's "
                             "logits; 0.05 makes an eighth of GLM-4.5-Air's experts take a third of the pairs): "
                             "resident experts are then "
                             "the most activated ones over random prompts, and each case reports the share of the "
                             "activations they cover (default 0: uniform routing)")
    parser.add_argument("--decode-steps", type=int, nargs="+", default=[None],
                        help="run the cases once per number of decode steps a program call runs (Model.decode_steps; "
                             "default: the engine's choice, several only when every routed expert is on the GPU)")
    parser.add_argument("--threads", type=int, nargs="+", default=[],
                        help="run the cases once per CPU expert pool size (default: the pool as configured)")
    args = parser.parse_args(argv)
    gguf_format = args.format in GGUF_FORMATS
    if gguf_format and not args.geometry:
        parser.error(f"--format {args.format} writes a GGUF file of a --geometry (a --checkpoint has its own format)")
    if gguf_format and geometry_config(args.geometry).model_type not in ARCHITECTURES:
        mapped = sorted(g for g in GEOMETRIES if geometry_config(g).model_type in ARCHITECTURES)
        parser.error(f"--geometry {args.geometry}: llama.cpp converts no model of its family; GGUF formats take "
                     f"{', '.join(mapped)}")

    floors = memory_floors()
    if gguf_format:
        try:
            path = write_gguf_geometry(args)
        except ValueError as e:  # rows that are not whole blocks of the format, a directory without room
            parser.error(f"--format {args.format}, --geometry {args.geometry}, --gguf-dir {args.gguf_dir}: {e}")
        model, name, full = load_gguf_geometry(path, args, Placement.default(args.dtype))
    else:
        model, name, full = load_model(args, Placement.default(args.dtype), args.format)
    full_layers = full.num_hidden_layers
    full_moe = sum(full.is_moe_layer(i) for i in range(full_layers))
    rng = np.random.default_rng(0)
    depth = model.config.num_hidden_layers
    # The geometry cut to its leading dense layers: everything of a step but the MoE layers (embedding, dense
    # layers, LM head, sampling), so the MoE layers' own time is the difference. Families whose every layer is MoE
    # have no such cut (no config has zero layers): their base is extrapolated from two depths instead.
    dense = next((i for i in range(depth) if model.config.is_moe_layer(i)), depth)
    overlaps = {"on": [True], "off": [False], "both": [False, True]}[args.overlap]
    # Overlap applies to batches of 2 or more; deferral is measured at batch 1 (its use case).
    cases = [(c, b, o, 0) for c in args.context for b in args.batch for o in (overlaps if b > 1 else [False])]
    cases += [(c, 1, False, d) for c in args.context for d in args.deferred if d > 0]
    # Timed first, then freed: the base holds its own embedding, dense layers and LM head.
    base_ms = {}
    if args.geometry and 0 < dense < depth:
        base_format = "bf16" if gguf_format else args.format  # a GGUF's non-expert weights are bf16
        base_args = argparse.Namespace(**{**vars(args), "layers": dense})
        base, _, _ = load_model(base_args, model.placement, base_format)
        for (context, batch, overlap, _), per_call in itertools.product(cases, args.decode_steps):
            base.dual_batch, base.decode_steps = overlap, per_call
            if (batch, context, overlap, per_call) not in base_ms:
                base_steps = step_times(base, batch, context, args.steps, rng)[0]
                base_ms[batch, context, overlap, per_call] = statistics.median(base_steps)
        del base
    elif args.geometry and dense == 0 and depth > 1 and not gguf_format:
        # step(d) = base + d x layer over depths 1 and d, every routed expert on the CPU in both (uniform routing):
        # base = (d step(1) - step(d)) / (d - 1). A layer's own time then includes its attention, as a dense
        # geometry's MoE layer time does.
        one, _, _ = load_model(argparse.Namespace(**{**vars(args), "layers": 1}), model.placement, args.format)
        place(one, "0", None)
        place(model, "0", None)
        for (context, batch, overlap, _), per_call in itertools.product(cases, args.decode_steps):
            if (batch, context, overlap, per_call) not in base_ms:
                steps = []
                for m in (one, model):
                    m.dual_batch, m.decode_steps = overlap, per_call
                    steps.append(statistics.median(step_times(m, batch, context, args.steps, rng)[0]))
                base_ms[batch, context, overlap, per_call] = (depth * steps[0] - steps[1]) / (depth - 1)
        del one
    print(f"decode: {name}, {depth} of {full_layers} layers, on {model.placement.device}, kernel {kernel_info()}"
          + (f", hand-off {_ffi.gpu_handoff_mode()}" if ON_GPU else ""))
    print(floors_line(floors))
    print(f"{'thr':>3} {'batch':>5} {'ctx':>6} {'dual':>5} {'defer':>5} {'step ms':>8} {'tok/s':>8} {'experts':>8} "
          f"{'alone':>8} {'hand-off':>9} {'xla':>8} {'cpu busy':>8} {'floor':>8} {'ratio':>6}"
          + (f" {'layer ms':>8} {'l.ratio':>6} {'l.busy':>6}" if base_ms else ""))
    results = []
    floor = ReadFloor(floors)
    pool_sizes = args.threads or [kernel_info()["threads"]]
    spins = args.spin_us or [kernel_info()["pool_spin_us"]]
    hbm = hbm_read_gbps(model.placement.device, 4 << 30, 10) if ON_GPU else None
    runs = [(t, spin, share, per_call, c) for _ in range(args.repeat) for t in pool_sizes for spin in spins
            for share in args.resident for per_call in args.decode_steps for c in cases]
    counts = skew_routing(model, args.zipf, rng) if args.zipf else None
    for threads, spin, share, per_call, (context, batch, overlap, deferred) in runs:
        resident, covered = place(model, share, counts, full)
        if (threads, spin) != (kernel_info()["threads"], kernel_info()["pool_spin_us"]):
            os.environ["HYBRIDJIT_POOL_SPIN_US"] = str(spin)  # read when the pool is made
            configure_threads(threads)
        model.dual_batch, model.decode_steps = overlap, per_call
        model.expert_schedule = dsv3.ExpertSchedule(n_deferred=deferred)
        # The case's read floor: passes right before and right after it (other tenants move this machine's
        # memory bandwidth from minute to minute; the floors measured at the start only pick the pattern).
        before = vmstat()
        for _ in range(3):
            floor.sample()
        r = bench_case(model, batch, context, args.steps, rng)
        for _ in range(3):
            floor.sample()
        r["floor_gbps"] = round(floor.take(), 1)
        # What the kernel's memory management did during the case (migration and compaction take bandwidth).
        r["vmstat"] = {name: count - before[name] for name, count in vmstat().items()}
        r["threads"] = kernel_info()["threads"]
        r["pool_spin_us"] = kernel_info()["pool_spin_us"]
        # The share of the pairs the GPU takes (uniform routing: the resident share of the experts; skewed: measured
        # by the probe); the host floor is that of the rest.
        r["resident"], r["resident_per_layer"], r["zipf"] = share, resident, args.zipf
        r["covered_share"] = round(covered, 4)
        r["floor_ms"] = round(r["expert_bytes_per_step"] * (1 - r["covered_share"]) / (r["floor_gbps"] * 1e6), 3)
        r["ratio_to_floor"] = round(r["floor_ms"] / r["median_step_ms"], 3) if r["floor_ms"] else None
        if hbm:
            # Everything a step reads from device memory (the weights other than routed experts, the resident
            # experts it uses) against the HBM read rate measured in this run.
            r["hbm_gbps"] = round(hbm, 1)
            r["hbm_bytes_per_step"] = hbm_bytes_per_step(model, batch, context, r["covered_share"])
            r["hbm_floor_ms"] = round(r["hbm_bytes_per_step"] / (hbm * 1e6), 3)
            r["ratio_to_hbm_floor"] = round(r["hbm_floor_ms"] / r["median_step_ms"], 3)
        if base_ms:
            base_step = base_ms[batch, context, overlap, per_call]
            layer_ms = (r["median_step_ms"] - base_step) / r["moe_layers"]
            layer_floor = r["floor_ms"] / r["moe_layers"]
            handoffs_ms = r["handoff_us_per_layer"] * (2 if r["dual_batch"] else 1) / 1e3
            r["base_step_ms"] = round(base_step, 3)
            r["moe_layer_ms"] = round(layer_ms, 3)
            # None where nothing is left on the CPU side (every expert resident, on a CPU without a hand-off).
            bound = layer_floor + handoffs_ms
            r["layer_ratio"] = round(layer_ms / bound, 3) if bound else None
            r["moe_cpu_busy"] = round(r["expert_ms"] / (r["window_step_ms"] - base_step), 3)
            # The issue's model of a split layer: the slower of its CPU share (at the read floor, plus hand-offs)
            # and its GPU share (the resident experts the step uses, at the HBM rate), over the base step.
            gpu_ms = resident_read_bytes(model, batch, r["covered_share"]) / (hbm * 1e6) if hbm else 0.0
            r["predicted_step_ms"] = round(base_step + r["moe_layers"] * max(bound, gpu_ms), 3)
            r["measured_vs_predicted"] = round(r["median_step_ms"] / r["predicted_step_ms"], 3)
        dual = str(r["dual_batch"])
        line = (f"{r['threads']:3d} {batch:5d} {context:6d} {dual:>5} {deferred:5d} {r['median_step_ms']:8.2f} "
                f"{r['tok_s']:8.2f} {r['expert_ms']:8.2f} {r['expert_alone_ms']:8.2f} "
                f"{r['handoff_us_per_layer']:7.1f}us {r['xla_ms']:8.2f} {r['cpu_busy']:8.0%} {r['floor_ms']:8.2f} "
                f"{r['ratio_to_floor'] or 0:6.2f}  resident {resident}/{model.config.n_routed_experts}, "
                f"{r['steps_per_call']} steps a call")
        if hbm:
            line += f" hbm floor {r['hbm_floor_ms']:.3f} ms ({r['ratio_to_hbm_floor']:.2f})"
        if base_ms:
            line += (f" {r['moe_layer_ms']:8.3f} {r['layer_ratio'] or 0:6.2f} {r['moe_cpu_busy']:6.0%}"
                     f"  predicted {r['predicted_step_ms']:.2f} ms (x{r['measured_vs_predicted']:.2f})")
        if depth < full_layers:
            # Projection: the whole measured step (dense layers and LM head included) counted per MoE layer and
            # scaled to the full model's MoE layers, so the estimate errs on the slow side.
            projected_ms = r["median_step_ms"] * full_moe / r["moe_layers"]
            r["projected_full_depth_tok_s"] = round(batch * 1e3 / projected_ms, 3)
            line += f"  projected to {full_layers} layers: {r['projected_full_depth_tok_s']} tok/s"
            if base_ms:
                r["projected_by_layer_tok_s"] = round(batch * 1e3 / (base_step + layer_ms * full_moe), 3)
                line += f" ({r['projected_by_layer_tok_s']} by layer)"
        results.append(r)
        print(line)
    spread = repeat_spread(results) if args.repeat > 1 else []
    where = {**machine(), "device": str(model.placement.device), "xla_flags": os.environ.get("XLA_FLAGS", "")}
    print(json.dumps({"bench": "decode", "model": name, "layers": depth, "machine": where, "floors": floors,
                      "results": results, "spread": spread}))


def max_over_min(values: list[float]) -> float | None:
    return round(max(values) / min(values), 3) if len(values) > 1 else None


def repeat_spread(results: list[dict]) -> list[dict]:
    """Per identical case (threads, batch, context, overlap, deferral) run several times: the max/min of its
    median step and of its per-MoE-layer ratio, over all runs and without the process's first run of it."""
    by_case: dict[tuple, list[dict]] = {}
    for r in results:
        key = (r["threads"], r["pool_spin_us"], r["batch"], r["context"], r["dual_batch"], r["n_deferred"])
        by_case.setdefault(key, []).append(r)
    print(f"\nspread of identical cases ({len(next(iter(by_case.values())))} runs each), max/min:")
    print(f"{'thr':>3} {'spin':>6} {'batch':>5} {'ctx':>6} {'dual':>5} {'defer':>5} {'step':>6} {'w/o 1st':>7} "
          f"{'l.ratio':>7} {'w/o 1st':>7}  steps ms")
    spread = []
    for (threads, spin, batch, context, dual, deferred), runs in by_case.items():
        steps = [r["median_step_ms"] for r in runs]
        ratios = [r.get("layer_ratio", r["ratio_to_floor"]) for r in runs]
        entry = {"threads": threads, "pool_spin_us": spin, "batch": batch, "context": context, "dual_batch": dual,
                 "n_deferred": deferred, "runs": len(runs), "step_ms": steps, "layer_ratios": ratios,
                 "step_max_over_min": max_over_min(steps), "step_max_over_min_after_first": max_over_min(steps[1:]),
                 "ratio_max_over_min": max_over_min(ratios), "ratio_max_over_min_after_first": max_over_min(ratios[1:])}
        spread.append(entry)
        print(f"{threads:3d} {spin:6d} {batch:5d} {context:6d} {str(dual):>5} {deferred:5d} "
              f"{entry['step_max_over_min']:6.3f} {entry['step_max_over_min_after_first'] or 0:7.3f} "
              f"{entry['ratio_max_over_min']:7.3f} {entry['ratio_max_over_min_after_first'] or 0:7.3f}  "
              f"{' '.join(f'{s:.2f}' for s in steps)}")
    return spread


if __name__ == "__main__":
    main()
