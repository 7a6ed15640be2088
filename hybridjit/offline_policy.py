"""The offline batch's performance model: which policy (slots decoded together, attention micro-batches, prompts
prefilled together) gives the most throughput on this machine for this model, and what throughput it predicts.

A roofline per module, as MoE-Lightning's hierarchical roofline (HRM) and MoE-Gen's batch-size search model it,
fed with the machine's measured floors (`Floors`: Floors.of_machine reads hybridjit.machine_floors' cached
measurement; the defaults below are bench/RESULTS.md's figures for the 1x H100 + 16-core Xeon host) and the model's
shapes (the family's cost module):

- routed experts, on the CPU, once per MoE layer over the whole batch (coalesced): the larger of reading the
  distinct experts the batch routes to (host read floor x the kernels' share of it) and their FLOPs at the CPU's
  AMX rate;
- everything else, on the GPU: the larger of reading the non-expert weights and the KV cache (HBM) and their
  FLOPs, plus a fixed cost per layer and attention micro-batch (launches) and the hand-off per expert call.
  The GPU and CPU parts of a coalesced step run one after the other (each layer's experts need its attention,
  and the next layer needs them); dual-batch overlap runs them side by side but reads the experts twice;
- or, where the engine can stream them (experts="stream"), the routed experts streamed to the GPU every step
  from their pinned host copy and run there (stream_prefill.stream_decode_step): the larger of the copies (every
  expert's bytes at the pinned H2D rate) and the GPU's work, the experts' FLOPs included. That wins once a step's
  batch is so large that the CPU, at its rate for that many tokens per expert, takes longer than the link. With
  `cpu_blocks` of a layer's BLOCKS_PER_LAYER blocks left to the CPU (CoX-MoE's co-execution), the link carries
  the rest while the CPU kernels compute those blocks' pairs after each layer's router: the larger of the two
  shares' times, plus a hand-off per layer; the copies take their rate off the host read floor the CPU reads at.
  A streamed step may also hold the KV cache in pinned host memory (`kv_in_host`, host_kv_cache.py): every slot's
  cache then crosses the link too, each step, and the slots are bounded by the host's memory, not the device's;
  or the CPU attends over it there (`attention_on_cpu`, MoE-Gen's CPU attention): the link carries only the
  experts, and each layer's attention takes the larger of reading every slot's cache at what the host read floor
  leaves beside the copies and its FLOPs at the CPU attention kernels' measured rate (`Floors.cpu_attention_gflops`),
  between the layer's projections and its experts on the GPU (which wait for it);
- or, for a model holding every routed expert on the device (Engine.place_experts, auto placement where they fit:
  experts="gpu", RESIDENT), the routed experts on the GPU as models/common/resident_experts computes them: a
  step with no more routed pairs than experts reads the distinct experts it routes to, a larger one runs batched
  GEMMs over every expert at CAPACITY_FACTOR times their mean share of the pairs, its FP8 copies first dequantized
  to the compute dtype in device memory (each weight read as held, written and read again): the larger of the
  bytes at the HBM rate and the FLOPs at the GEMM rate. The FP8 copies may instead be held dequantized for the
  run (`widened`, Model.hold_resident_experts): no dequantization a step, at twice their device bytes, which
  the KV cache's slots then do without;
- prefill, per batch of prompts: the cheaper of the hybrid path (GPU, then CPU experts by the roofline above)
  and, where the engine can stream, the stream-loaded one (prefill_path.prefill_seconds); all on the GPU for a
  model whose experts are all resident.

A run of n requests (mean prompt L, mean budget G) takes n / P prefills and n G / B decode steps at the mean
context L + G / 2; the policy maximizing generated tokens per second of the whole run is chosen from a grid,
within device memory: the KV cache of B slots and one prefill batch's activations must fit what the device has
free once the weights are loaded. Any of the three can be fixed by the user; the rest is searched.
"""

import dataclasses
import math
import os

import jax.numpy as jnp
import numpy as np

from hybridjit import machine_floors
from hybridjit.auto_placement import resident_copies_are_fp8, resident_expert_bytes
from hybridjit.host_kv_cache import DEVICE_LAYERS, host_kv_budget
from hybridjit.models.common.config import attended
from hybridjit.models.common.resident_experts import gathered, grouped_capacity
from hybridjit.models.registry import ModelConfig, family_of
from hybridjit.ops.routed_experts import kernel_info, pool_of
from hybridjit.pinned_experts import BLOCKS_PER_LAYER
from hybridjit.prefill_path import PrefillRates, choose_prefill_path, expert_bytes, prefill_seconds
from hybridjit.serving.engine import bucket
from hybridjit.stream_prefill import decode_scores_bytes, free_device_memory

DUAL = "dual"  # micro_batches: the interactive engine's two overlapped micro-batches, each with its expert calls
EXPERTS = ("cpu", "stream")  # where a decode step's routed experts run: the CPU kernels, or streamed to the GPU
RESIDENT = "gpu"  # Policy.experts of a model holding every routed expert on the device (not a choice: a placement)
# Tokens per call at which of_machine measures the CPU expert rate (each measured once per machine and expert shape,
# then cached): decode steps of tens to thousands of slots, and a prefill's worth.
RATE_TOKENS = (16, 64, 256, 1024, 4096)
# Tokens per call at which of_machine measures the co-executed CPU share's rate (Floors.co_execution_share): a
# decode step's, whose tokens per expert a step's CPU blocks keep (they take whole experts).
CO_EXECUTION_TOKENS = 1024
MAX_SLOTS = 1024
# With the KV cache in host memory the device no longer bounds the slots: MoE-Gen's batches reach thousands.
MAX_HOST_KV_SLOTS = 8192
MICRO_BATCHES = (1, 2, 4, 8)
# Bytes a prompt token takes while prefilled, besides the weights: float32 logits over the vocabulary (the hybrid
# prefill program computes every position's) and a few hidden-size activations.
PREFILL_ACTIVATION_HIDDEN_COPIES = 16
# The decode attention's float32 scores [b, heads, context] (about three live copies) of one micro-batch stay
# under this (stream_prefill's bound for its attention scratch).
ATTENTION_SCRATCH = 1 << 30


@dataclasses.dataclass(frozen=True)
class Floors:
    """The machine's rates. Defaults: bench/RESULTS.md on the 1x H100 80 GB + 16-core Xeon (AMX) host, except where
    said; of_machine measures this machine's."""

    host_read_gbps: float = 155.0  # read floor (bench/floors.py): decode.py's V3 projection ran at 155 GB/s
    cpu_decode_share: float = 0.85  # of the read floor the FP8 decode kernels reach: 73-94% by host (moe_cpu.py)
    cpu_expert_tflops: float = 3.8  # AMX expert GEMMs at many tokens per expert: 3.6-3.8 (DESIGN.md §9)
    pcie_gbps: float = 54.0  # pinned host -> device: 52-55 GB/s (DESIGN.md §3; PrefillRates)
    gpu_tflops: float = 550.0  # what prefill's GPU work reaches (PrefillRates; dense bf16 GEMM 680-790)
    gpu_hbm_gbps: float = 2500.0  # not measured here: H100 HBM3's 3.35 TB/s nominal at ~75%
    handoff_us: float = 22.0  # one routed-expert call's GPU -> CPU -> GPU hand-off: 21-23 us (DESIGN.md §1)
    gpu_layer_us: float = 40.0  # launches and small kernels per layer and attention call (a guess; see offline.py)
    device_free_bytes: int | None = None  # for KV cache and prefill; None: measured when the policy is chosen
    host_free_bytes: int | None = None  # for a KV cache in host memory; None: measured when the policy is chosen
    # The CPU expert kernels' rate on one of the model's MoE layers by tokens per call, routed uniformly:
    # ((tokens, TFLOP/s), ...) ascending. It falls steeply with tokens per expert (fewer tokens to amortize each
    # expert's read and FP8 expansion over; bench/RESULTS.md: FP8 at 64 per expert 0.42x its rate at 512), which
    # the one figure above, measured at 4096 tokens, overstates for decode steps. of_machine measures it at
    # RATE_TOKENS (bench/offline.py at its cases' sizes). Empty: that figure everywhere.
    cpu_expert_tflops_by_tokens: tuple[tuple[int, float], ...] = ()
    # The CPU decode-attention kernels' rate in GFLOP/s (hybridjit/ops/cpu_attention.py) at the model's own shapes
    # over a cache larger than the CPU's caches (machine_floors.cpu_attention_gflops), measured where attention on
    # the CPU is asked for (choose_policy; offline.py always). None: not measured.
    cpu_attention_gflops: float | None = None
    # Of the pool's CPU expert rate, what a co-executed streamed step's CPU share gets: of_machine measures it as
    # the rate of a call at CO_EXECUTION_TOKENS with one block's experts weighted (as the step's call for one CPU
    # block) on co_execution_threads() (the pool less HOST_LOOP_CPUS) while the link copies to the device back to
    # back, over the whole layer's rate at those tokens alone. 1.0: not measured.
    co_execution_share: float = 1.0

    def prefill_rates(self) -> PrefillRates:
        return PrefillRates(self.pcie_gbps, self.gpu_tflops, self.cpu_expert_tflops)

    def cpu_tflops(self, tokens: int) -> float:
        """The CPU expert rate for a call of `tokens` tokens: cpu_expert_tflops_by_tokens interpolated in log-log,
        held at its ends; cpu_expert_tflops without it."""
        if not self.cpu_expert_tflops_by_tokens:
            return self.cpu_expert_tflops
        points, rates = zip(*self.cpu_expert_tflops_by_tokens, strict=True)
        return math.exp(float(np.interp(math.log(max(tokens, 1)), np.log(points), np.log(rates))))

    @classmethod
    def of_machine(cls, model) -> "Floors":
        """The floors of the machine `model` runs on (hybridjit.machine_floors: measured once, then cached) where it
        runs on an accelerator, the figures the policy models; the defaults elsewhere and for what is not measured."""
        if model.placement.device.platform == "cpu":
            return cls()
        floors, rates = machine_floors.FloorCache().floors(model.placement.device), model.prefill_rates()
        measured = cls(host_read_gbps=floors.host_read_gbps, cpu_expert_tflops=rates.cpu_expert_tflops,
                       pcie_gbps=rates.pcie_gbps, gpu_tflops=rates.gpu_tflops, gpu_hbm_gbps=floors.gpu_hbm_gbps)
        if not model.expert_layers:  # every routed expert on the device: no CPU rate to measure
            return measured
        by_tokens = tuple((t, model.cpu_expert_tflops(t)) for t in RATE_TOKENS)
        co_executed = model.cpu_expert_tflops(CO_EXECUTION_TOKENS, co_execution_threads(), co_executed=True)
        return dataclasses.replace(measured, cpu_expert_tflops_by_tokens=by_tokens,
                                   co_execution_share=co_executed / dict(by_tokens)[CO_EXECUTION_TOKENS])


@dataclasses.dataclass(frozen=True)
class Workload:
    requests: int
    prompt_tokens: float  # mean
    new_tokens: float  # mean budget (max_tokens)
    cache_len: int  # positions per slot

    @classmethod
    def of_jobs(cls, jobs, cache_len: int) -> "Workload":
        n = len(jobs)
        return cls(n, sum(len(j.prompt) for j in jobs) / n, sum(j.max_tokens for j in jobs) / n, cache_len)


@dataclasses.dataclass(frozen=True)
class Prediction:
    step_s: float  # one decode step of all slots
    expert_s: float  # of which the routed experts (where they are not overlapped with the rest)
    prefill_s: float  # one prefill batch
    decode_tok_s: float
    prefill_tok_s: float
    total_tok_s: float  # generated tokens per second of the whole run, prefills included


@dataclasses.dataclass(frozen=True)
class Policy:
    slots: int
    micro_batches: int | str  # attention micro-batches with coalesced experts, or DUAL
    prefill_batch: int
    prediction: Prediction | None = None
    experts: str = "cpu"  # one of EXPERTS, or RESIDENT
    cpu_blocks: int = 0  # with experts "stream": blocks of each layer's BLOCKS_PER_LAYER the CPU computes meanwhile
    widened: bool = False  # with RESIDENT FP8 copies: held dequantized in the compute dtype for the run
    kv_in_host: bool = False  # with experts "stream": the KV cache in pinned host memory, copied in a layer at a time
    attention_on_cpu: bool = False  # with kv_in_host: the CPU attends over that cache where it is instead

    def cpu_pool(self):
        """The CPU pool the run's decode steps take (ops.routed_experts.pool_of): co_execution_threads() where the
        CPU computes blocks of a streamed step, else the pool as it is."""
        return pool_of(co_execution_threads() if self.cpu_blocks else None)

    def describe(self) -> str:
        mb = "dual-batch overlap" if self.micro_batches == DUAL else f"{self.micro_batches} attention micro-batch(es)"
        where = {"cpu": "on the CPU", "stream": "streamed to the GPU each step", RESIDENT: "resident on the GPU"}[
            self.experts
        ]
        if self.cpu_blocks:
            where += (f", the CPU computing {self.cpu_blocks} of each layer's {BLOCKS_PER_LAYER} blocks meanwhile on "
                      f"{co_execution_threads()} threads")
        if self.widened:
            where += " (held dequantized for the run)"
        if self.kv_in_host:
            where += ", the KV cache in host memory" + (", attended over on the CPU" if self.attention_on_cpu else "")
        line = (f"policy: {self.slots} slots, {mb}, routed experts {where}, prefill {self.prefill_batch} prompts at "
                "a time")  # fmt: skip
        if p := self.prediction:
            line += (f"; predicted {p.total_tok_s:.1f} generated tok/s (decode {p.decode_tok_s:.1f} tok/s, step "
                     f"{1e3 * p.step_s:.1f} ms of which experts {1e3 * p.expert_s:.1f}; prefill {p.prefill_tok_s:.0f} "
                     "tok/s)")  # fmt: skip
        return line


# ------------------------------------------------------------------------------------------ the model


def _moe_layers(cfg: ModelConfig) -> int:
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def _distinct_experts(cfg: ModelConfig, tokens: int) -> float:
    """The expected number of a layer's routed experts that `tokens` tokens route to, under uniform routing."""
    n = cfg.n_routed_experts
    return n * (1 - (1 - 1 / n) ** (tokens * cfg.num_experts_per_tok))


def _expert_roofline(cfg: ModelConfig, tokens: int, read_gbps: float, tflops: float) -> float:
    """All MoE layers' routed experts for `tokens` tokens in one call each, as stored: the roofline of reading the
    distinct experts they route to (uniform routing) at `read_gbps` and of their FLOPs at `tflops`."""
    n, moe = cfg.n_routed_experts, _moe_layers(cfg)
    if not moe:
        return 0.0
    read = _distinct_experts(cfg, tokens) * expert_bytes(cfg) / (moe * n) / (read_gbps * 1e9)
    flops = family_of(cfg).cost.layer_flops(cfg, tokens, 1)["routed"]
    return moe * max(read, flops / (tflops * 1e12))


def cpu_expert_seconds(cfg: ModelConfig, floors: Floors, tokens: int) -> float:
    """The routed experts of a call of `tokens` tokens on the CPU kernels, at their rate for that many tokens."""
    return _expert_roofline(cfg, tokens, floors.host_read_gbps * floors.cpu_decode_share, floors.cpu_tflops(tokens))


def _expert_bytes_in(cfg: ModelConfig, itemsize: int) -> int:
    """One routed expert's weights (gate, up, down) in a dtype of `itemsize` bytes."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * itemsize


def widened_expert_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """Device bytes the resident copies of every routed expert take beyond FP8's when held dequantized in the
    compute dtype of `itemsize` bytes (0 for a model whose copies are not FP8)."""
    if not resident_copies_are_fp8(cfg):
        return 0
    dequantized = _expert_bytes_in(cfg, itemsize)
    held = resident_expert_bytes(cfg, np.dtype(f"f{itemsize}"))
    return _moe_layers(cfg) * cfg.n_routed_experts * (dequantized - held)


def resident_expert_seconds(cfg: ModelConfig, floors: Floors, tokens: int, itemsize: int,
                            widened: bool = False) -> float:  # fmt: skip
    """The routed experts of a call of `tokens` tokens, every one resident on the device, priced as
    models/common/resident_experts computes them (the module docstring above): the gathered path reads the distinct
    experts a call routes to as held (auto_placement.resident_expert_bytes: FP8 as stored, other formats, and FP8
    copies `widened`, in the compute dtype of `itemsize` bytes); the grouped one reads every expert, FP8 ones also
    written and read again dequantized unless widened, and multiplies grouped_capacity's slots
    (bench/resident_grouped.py times both holdings)."""
    n, k, moe = cfg.n_routed_experts, cfg.num_experts_per_tok, _moe_layers(cfg)
    if not moe:
        return 0.0
    dequantized = _expert_bytes_in(cfg, itemsize)
    fp8 = resident_copies_are_fp8(cfg) and not widened
    held = resident_expert_bytes(cfg, np.dtype(f"f{itemsize}")) if fp8 else dequantized
    flops = family_of(cfg).cost.layer_flops(cfg, tokens, 1)["routed"]
    if gathered(tokens * k, n):
        traffic = _distinct_experts(cfg, tokens) * held
    else:  # every expert, a capacity of slots each
        traffic = n * (held + (2 * dequantized if fp8 else 0))
        flops *= n * grouped_capacity(tokens, k, n) / (tokens * k)
    return moe * max(traffic / (floors.gpu_hbm_gbps * 1e9), flops / (floors.gpu_tflops * 1e12))


def gpu_seconds(cfg: ModelConfig, floors: Floors, batch: int, context: float, calls: int, itemsize: int) -> float:
    """Everything of a decode step but the routed experts, for `batch` tokens over `context` cached positions each,
    attention in `calls` micro-batches: per layer the roofline of its weight and KV reads against its FLOPs."""
    cost = family_of(cfg).cost
    part = cost.layer_flops(cfg, batch, 1)
    seconds = 0.0
    for i in range(cfg.num_hidden_layers):
        dense = part["router+shared"] if cfg.is_moe_layer(i) else part["dense mlp"]
        flops = part["projections"] + dense  # 2 FLOPs per weight per token: the weights' elements are flops / 2b
        weights = flops / (2 * batch) * itemsize
        seen = attended(cfg, i, int(context))
        kv = batch * seen * cost.kv_elements_per_token(cfg) * itemsize
        attention = cost.decode_attention_flops(cfg, batch, seen)
        memory = (weights + kv) / (floors.gpu_hbm_gbps * 1e9)
        seconds += max(memory, (flops + attention) / (floors.gpu_tflops * 1e12)) + calls * floors.gpu_layer_us * 1e-6
    head = 2 * cfg.hidden_size * cfg.vocab_size
    return seconds + max(head * itemsize / 2 / (floors.gpu_hbm_gbps * 1e9), batch * head / (floors.gpu_tflops * 1e12))


def stream_ring_bytes(cfg: ModelConfig, batch: int, cache_len: int) -> int:
    """Device memory a decode step that streams the experts needs beyond the weights and the KV cache: two expert
    blocks (pinned_experts.BLOCKS_PER_LAYER to a layer; fewer would leave the copies unoverlapped) and the decode
    attention's float32 scores over the whole cache (decode_scores_bytes)."""
    moe = _moe_layers(cfg)
    block = expert_bytes(cfg) // max(moe, 1) // BLOCKS_PER_LAYER
    return 2 * block + decode_scores_bytes(cfg, batch, cache_len)


def streamed_expert_seconds(cfg: ModelConfig, floors: Floors, tokens: int) -> tuple[float, float]:
    """(copy seconds, GPU seconds) of all MoE layers' routed experts streamed to the GPU for a step of `tokens`
    tokens: every expert's bytes over the pinned link, and their FLOPs on the GPU."""
    flops = family_of(cfg).cost.layer_flops(cfg, tokens, 1)["routed"] * _moe_layers(cfg)
    return expert_bytes(cfg) / (floors.pcie_gbps * 1e9), flops / (floors.gpu_tflops * 1e12)


def decode_step(cfg: ModelConfig, floors: Floors, batch: int, context: float, micro_batches, itemsize: int,
                experts: str = "cpu", cpu_blocks: int = 0, widened: bool = False,
                host_kv_positions: int = 0, attention_on_cpu: bool = False):  # fmt: skip
    """(step seconds, of which routed experts) of one decode step of `batch` slots, the routed experts on the CPU
    or streamed to the GPU (`experts`, one of EXPERTS), `cpu_blocks` of each layer's BLOCKS_PER_LAYER then on the
    CPU meanwhile, or resident on the GPU (RESIDENT; FP8 copies held dequantized where `widened`). A streamed step
    whose KV cache is in host memory copies `host_kv_positions` positions of every slot over the link as well, or,
    `attention_on_cpu`, attends over `context` of them on the CPU instead."""
    handoffs = _moe_layers(cfg) * floors.handoff_us * 1e-6
    if experts == RESIDENT:  # no hand-off: the experts are one more part of the GPU's step
        on_gpu = resident_expert_seconds(cfg, floors, batch, itemsize, widened)
        return gpu_seconds(cfg, floors, batch, context, micro_batches, itemsize) + on_gpu, on_gpu
    if experts == "stream":  # the copies overlap the GPU's work (the ring loads ahead); one micro-batch
        streamed = 1 - cpu_blocks / BLOCKS_PER_LAYER
        copies, expert_gpu = (streamed * t for t in streamed_expert_seconds(cfg, floors, batch))
        # The CPU's work (its attention, its expert blocks) reads host memory while the copies read it too.
        sharing = dataclasses.replace(floors, host_read_gbps=max(floors.host_read_gbps - floors.pcie_gbps, 1.0))
        if attention_on_cpu:
            attention = cpu_attention_seconds(cfg, sharing, batch, context, itemsize)
        else:
            copies += batch * kv_bytes_per_slot(cfg, host_kv_positions, itemsize) / (floors.pcie_gbps * 1e9)
            attention = 0.0
        # The CPU's blocks, from each layer's router to its combine, on the pool's co_execution_share: its compute
        # rates scaled by it (the read floor is the host's, however few threads read).
        share = floors.co_execution_share
        co = dataclasses.replace(sharing, cpu_expert_tflops=share * floors.cpu_expert_tflops,
                                 cpu_expert_tflops_by_tokens=tuple((t, share * r)
                                                                   for t, r in floors.cpu_expert_tflops_by_tokens))
        cpu = (1 - streamed) * cpu_expert_seconds(cfg, co, batch)
        # (With the attention on the CPU the GPU's share still counts reading the cache from HBM: ~1% of the CPU's.)
        gpu = gpu_seconds(cfg, floors, batch, context, 1, itemsize) + attention
        step = max(copies, gpu + max(expert_gpu, cpu)) + (handoffs if cpu_blocks else 0.0)
        return step, step - gpu
    if micro_batches == DUAL and batch > 1:
        halves = (batch - batch // 2, batch // 2)
        experts = sum(cpu_expert_seconds(cfg, floors, b) for b in halves)
        gpu = sum(gpu_seconds(cfg, floors, b, context, 1, itemsize) for b in halves)
        return max(experts, gpu) + 2 * handoffs, experts  # overlapped: one side's GPU hides the other's CPU
    calls = 1 if micro_batches == DUAL else micro_batches
    experts = cpu_expert_seconds(cfg, floors, batch)
    return gpu_seconds(cfg, floors, batch, context, calls, itemsize) + experts + handoffs, experts


def cpu_attention_seconds(cfg: ModelConfig, floors: Floors, batch: int, context: float, itemsize: int) -> float:
    """Every layer's decode attention of `batch` slots over `context` positions on the CPU, where the cache is: the
    larger of reading it at the host read floor and its FLOPs at the kernels' rate."""
    if floors.cpu_attention_gflops is None:
        raise ValueError("attention on the CPU: its kernels' rate is not measured (Floors.cpu_attention_gflops)")
    reads = batch * kv_bytes_per_slot(cfg, math.ceil(context), itemsize) / (floors.host_read_gbps * 1e9)
    attention = family_of(cfg).cost.decode_attention_flops
    flops = sum(attention(cfg, batch, attended(cfg, i, math.ceil(context))) for i in range(cfg.num_hidden_layers))
    return max(reads, flops / (floors.cpu_attention_gflops * 1e9))


def prefill_batch_seconds(cfg: ModelConfig, floors: Floors, batch: int, length: int, can_stream: bool,
                          resident: bool, itemsize: int, widened: bool = False) -> float:  # fmt: skip
    """One prefill of `batch` prompts padded to `length`: the hybrid path by the roofline, or the stream-loaded one
    where the engine can take it and it is faster; all on the GPU where every expert is `resident` (held in the
    compute dtype of `itemsize` bytes unless FP8 and not `widened`)."""
    hybrid = prefill_seconds(cfg, batch, length, floors.prefill_rates())
    gpu_part = hybrid["hybrid"] - family_of(cfg).cost.layer_flops(cfg, batch, length)["routed"] * _moe_layers(cfg) / (
        floors.cpu_expert_tflops * 1e12
    )
    if resident:
        return gpu_part + resident_expert_seconds(cfg, floors, batch * length, itemsize, widened)
    seconds = gpu_part + cpu_expert_seconds(cfg, floors, batch * length)
    return min(seconds, hybrid["stream"]) if can_stream else seconds


def predict(
    cfg: ModelConfig, floors: Floors, work: Workload, policy: Policy, itemsize: int, can_stream: bool
) -> Prediction:
    step, experts = decode_step(cfg, floors, policy.slots, work.prompt_tokens + work.new_tokens / 2,
                                policy.micro_batches, itemsize, policy.experts, policy.cpu_blocks,
                                policy.widened, work.cache_len if policy.kv_in_host else 0,
                                policy.attention_on_cpu)  # fmt: skip
    length = bucket(math.ceil(work.prompt_tokens))
    prefill = prefill_batch_seconds(cfg, floors, policy.prefill_batch, length, can_stream, policy.experts == RESIDENT,
                                    itemsize, policy.widened)
    generated = work.requests * work.new_tokens
    total = math.ceil(work.requests / policy.prefill_batch) * prefill + generated / policy.slots * step
    prefill_tok_s = policy.prefill_batch * work.prompt_tokens / prefill
    return Prediction(step, experts, prefill, policy.slots / step, prefill_tok_s, generated / total)


# ----------------------------------------------------------------------------------------- the choice


def kv_bytes_per_slot(cfg: ModelConfig, cache_len: int, itemsize: int, rings: bool = True) -> int:
    """Bytes of one slot's KV cache of `cache_len` positions: a sliding-window layer's its window, as the engine
    holds it, unless not `rings` (a prompt's cache, which prefill writes whole)."""
    positions = sum(attended(cfg, i, cache_len) if rings else cache_len for i in range(cfg.num_hidden_layers))
    return positions * family_of(cfg).cost.kv_elements_per_token(cfg) * itemsize


def prefill_bytes(cfg: ModelConfig, batch: int, length: int, itemsize: int) -> int:
    """Device bytes a prefill of `batch` prompts of `length` tokens takes besides the weights: its activations and
    the prompts' own cache (on the device until inserted into the slots, wherever those hold theirs)."""
    activations = 4 * cfg.vocab_size + PREFILL_ACTIVATION_HIDDEN_COPIES * cfg.hidden_size * 4
    return batch * (length * activations + kv_bytes_per_slot(cfg, length, itemsize, rings=False))


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def _slot_grid(limit: int) -> list[int]:
    """Powers of two and the steps halfway between (3 x 2^k), up to `limit`, and `limit` itself: slots are
    bounded by memory, where a power of two would leave up to half of it unused."""
    return sorted({*_powers_of_two(limit), *(3 << i for i in range(limit.bit_length()) if 3 << i <= limit), limit})


def _searched_splits(kv_in_host: bool) -> range:
    """The CPU blocks a search tries for a streamed step. None with the KV cache in host memory: co-executing beside
    it ran at 0.57-0.60 of this model's prediction and slower than streaming every block (DeepSeek-V3 FP8 5 layers,
    1x H200, session 30: 2,048 slots 651 ms a step without CPU blocks, 815 with 3; 4,096 slots 873 / 1,254 ms),
    while each holding alone ran at 0.89-0.99; those ran on every CPU, before HOST_LOOP_CPUS (which made co-execution
    beside a cache on the device faster than none) and are not measured since. Given explicitly, they still run."""
    return range(1) if kv_in_host else range(BLOCKS_PER_LAYER)


# CPUs a co-executed streamed step leaves to the host's loop (its Python thread, XLA's dispatch and copy threads): the
# CPU's share runs on the others. With every CPU in the pool it ran slower than streaming every block; with 4 left
# it ran faster (Qwen3-30B-A3B FP8 8 layers, 1x H200 with 16 cores, session 32, each expert step waited for: 1,024
# slots with 2 CPU blocks 200.3 ms a step on 16 pool threads, 163.1 on 14, 128.7 on 12, against 144.5 streaming
# all; 2,048 slots with 1: 262.0 / 194.4 / 166.9 against 175.6). Since one expert step is left queued, streaming
# all is the faster there again (session 33: 1,024 slots 100.1 ms against 126.1 with 1 CPU block on 12 threads,
# 126.9 on 8; 2,048 slots 153.1 against 163.0 / 196.6).
HOST_LOOP_CPUS = 4


def co_execution_threads() -> int:
    """The CPU pool a co-executed streamed step's CPU share runs on: the pool as configured, but at most this
    process's CPUs less HOST_LOOP_CPUS."""
    return max(1, min(kernel_info()["threads"], len(os.sched_getaffinity(0)) - HOST_LOOP_CPUS))


# Attention on the CPU is tried only where asked for: its steps ran at 0.32 of this model's prediction (0.38 with
# the reads priced beside the copies), no faster than carrying the cache over the link (Qwen3-30B-A3B 8 layers, 1x
# H200 with 16 cores, session 31: 1,024 slots 428 ms against 431 in a profiling run, 2,048 slots 861 against 756),
# ~13 ms a layer of it the io_callback's hand-off from the GPU program, which the model does not price.


def search(
    cfg: ModelConfig, floors: Floors, work: Workload, itemsize: int, can_stream: bool,
    slots: int | None = None, micro_batches: int | str | None = None, prefill_batch: int | None = None,
    experts: str | None = None, cpu_blocks: int | None = None, resident: bool = False, widened: bool | None = None,
    kv_in_host: bool | None = None, attention_on_cpu: bool | None = None,
) -> Policy:  # fmt: skip
    """The policy of the grid (slots by _slot_grid, micro-batches MICRO_BATCHES and DUAL, prefill batches powers of
    two, the routed experts on the CPU or, where `can_stream`, streamed to the GPU with one micro-batch and 0 to
    BLOCKS_PER_LAYER - 1 blocks of each layer on the CPU meanwhile; the fixed ones as given) with the best predicted
    throughput that fits `floors.device_free_bytes` (None: unbounded). A model whose routed experts are all
    `resident` on the device runs them there (RESIDENT), with no dual-batch overlap (it overlaps CPU and GPU), its
    FP8 copies held as stored or dequantized for the run (`widened`, searched unless given). A streamed step's KV
    cache is on the device or in host memory (`kv_in_host`, searched unless given; in host memory up to
    MAX_HOST_KV_SLOTS slots within `floors.host_free_bytes`, two layers' caches on the device), and there the CPU may
    attend over it (`attention_on_cpu`: only where given, the comment above says why)."""
    if attention_on_cpu and kv_in_host is False:
        raise ValueError("attention_on_cpu=True: the CPU attends over a KV cache in host memory; it needs kv_in_host")
    if attention_on_cpu:
        kv_in_host = True
    if resident and (experts is not None or cpu_blocks or micro_batches == DUAL):
        chosen = {"experts": experts, "cpu_blocks": cpu_blocks, "micro_batches": micro_batches}
        asked = ", ".join(f"{name}={value!r}" for name, value in chosen.items() if value)
        raise ValueError(f"{asked}: every routed expert of this model is resident on the device, where its decode "
                         "steps run them; leave where the experts run, and dual-batch overlap, to it")  # fmt: skip
    can_widen = resident and resident_copies_are_fp8(cfg)
    if widened and not can_widen:
        raise ValueError("widened=True holds resident FP8 copies dequantized; this model " + (
            "does not hold every routed expert on the device" if not resident
            else "holds its resident copies in the compute dtype already"))  # fmt: skip
    if experts is not None and experts not in EXPERTS:
        raise ValueError(f"experts must be one of {', '.join(EXPERTS)}, got {experts!r}")
    if cpu_blocks is not None and not 0 <= cpu_blocks < BLOCKS_PER_LAYER:
        raise ValueError(f"cpu_blocks must be in [0, {BLOCKS_PER_LAYER}) (blocks of a layer's {BLOCKS_PER_LAYER} the "
                         f"CPU computes while the rest stream), got {cpu_blocks}")  # fmt: skip
    if cpu_blocks and experts == "cpu":
        raise ValueError(f"cpu_blocks={cpu_blocks} splits a streamed step's experts; it needs experts='stream'")
    if kv_in_host and (resident or experts == "cpu" or micro_batches not in (None, 1)):
        raise ValueError("kv_in_host=True: the KV cache in host memory is read by streamed decode steps of one "
                         "micro-batch; it needs experts='stream'")  # fmt: skip
    if kv_in_host and not can_stream:
        raise ValueError("kv_in_host=True: the KV cache in host memory is read by decode steps that stream the routed "
                         "experts, and this model's are not pinned for streaming (a GPU placement with "
                         "Placement(pinned_experts=True))")  # fmt: skip
    if (cpu_blocks or kv_in_host) and experts is None:
        experts = "stream"
    if experts == "stream" and not can_stream:
        raise ValueError("experts='stream' needs the routed experts pinned for streaming (a GPU placement with "
                         "Placement(pinned_experts=True))")  # fmt: skip
    if experts == "stream" and micro_batches not in (None, 1):
        raise ValueError(f"experts='stream' decodes one micro-batch, got micro_batches={micro_batches!r}")
    memory, host_memory = floors.device_free_bytes, floors.host_free_bytes
    per_slot = kv_bytes_per_slot(cfg, work.cache_len, itemsize)
    length = bucket(math.ceil(work.prompt_tokens))
    streams = experts == "stream" or (experts is None and can_stream and micro_batches in (None, 1))
    # (KV cache in host memory, attention on the CPU) pairs
    host_holdings = [kv_in_host] if kv_in_host is not None else [False, True] if streams else [False]
    on_cpu = [attention_on_cpu] if attention_on_cpu is not None else [False]  # only where asked (above search)
    kv_holdings = list(dict.fromkeys((h, c) for h in host_holdings for c in on_cpu if h or not c))
    most = min(work.requests, MAX_HOST_KV_SLOTS if True in host_holdings else MAX_SLOTS)
    slot_grid = [slots] if slots else _slot_grid(most)
    best = None
    for b in slot_grid:
        mb_grid = [micro_batches] if micro_batches else [*(m for m in MICRO_BATCHES if m <= b), DUAL]
        if resident:
            holdings = [widened] if widened is not None else [False, True] if can_widen else [False]
            placements = [(RESIDENT, mb, w, (False, False)) for mb in mb_grid if mb != DUAL for w in holdings]
        else:
            placements = [("cpu", mb, 0, (False, False)) for mb in mb_grid] if experts != "stream" else []
            if streams:
                placements += [("stream", 1, c, kv) for kv in kv_holdings
                               for c in ([cpu_blocks] if cpu_blocks is not None else _searched_splits(kv[0]))]
        # option: CPU blocks of a streamed step, widened copies if resident; holding: (the KV cache in host memory,
        # attention on the CPU)
        for where, mb, option, (in_host, on_cpu) in placements:
            split, wide = (0, option) if where == RESIDENT else (option, False)
            # On the device, all the slots' caches; in host memory, the layer read and the next one coming, or none
            # where the CPU attends over it.
            kv = 0 if on_cpu else DEVICE_LAYERS * b * per_slot // cfg.num_hidden_layers if in_host else b * per_slot
            fits = (memory is None or kv <= memory) and not (
                in_host and host_memory is not None and b * per_slot > host_memory
            )
            # Fixed slots are taken as asked; but where the cache's holding is searched, never into one that cannot
            # hold them.
            if not fits and (slots is None or len(kv_holdings) > 1):
                continue
            if slots is None and b > MAX_SLOTS and not in_host:
                continue
            calls = 2 if mb == DUAL else mb
            context = work.cache_len
            # More micro-batches keep attention's scratch small; a streamed step's one is counted in its need.
            scores = decode_scores_bytes(cfg, -(-b // calls), context)
            if where != "stream" and scores > ATTENTION_SCRATCH and not micro_batches:
                continue
            for p in [prefill_batch] if prefill_batch else _powers_of_two(b):
                need = kv + max(prefill_bytes(cfg, p, length, itemsize),
                                stream_ring_bytes(cfg, b, work.cache_len) if where == "stream" else 0)  # fmt: skip
                need += widened_expert_bytes(cfg, itemsize) if wide else 0
                # A fixed prefill batch is taken as asked; widened copies the search chose must fit.
                if memory is not None and need > memory and (not prefill_batch or wide and widened is None):
                    continue
                policy = Policy(b, mb, p, experts=where, cpu_blocks=split, widened=wide, kv_in_host=in_host,
                                attention_on_cpu=on_cpu)
                prediction = predict(cfg, floors, work, policy, itemsize, can_stream)
                policy = dataclasses.replace(policy, prediction=prediction)
                if best is None or policy.prediction.total_tok_s > best.prediction.total_tok_s:
                    best = policy
    if best is None:
        free = "an unbounded device" if memory is None else f"the device's {memory / 2**30:.2f} GiB free"
        if True in host_holdings and host_memory is not None:
            free += f" (and a cache in host memory {host_memory / 2**30:.2f} GiB of it)"
        fixed = {"slots": slots, "micro_batches": micro_batches, "experts": experts, "cpu_blocks": cpu_blocks,
                 "widened": widened, "kv_in_host": kv_in_host, "attention_on_cpu": attention_on_cpu}
        asked = ", ".join(f"{name}={value!r}" for name, value in fixed.items() if value)
        raise ValueError(
            f"no policy of the grid{f' with {asked}' if asked else ''} fits {free}: one slot's KV cache of "
            f"{work.cache_len} positions takes {per_slot / 2**30:.3f} GiB, and a micro-batch's attention scores must "
            f"stay under {ATTENTION_SCRATCH / 2**30:.0f} GiB; shorten max_tokens or the prompts, or allow fewer slots "
            "or more micro-batches"
        )
    return best


def choose_policy(
    model, jobs, cache_len: int, slots=None, micro_batches=None, prefill_batch=None, floors: Floors | None = None,
    experts: str | None = None, cpu_blocks: int | None = None, widened: bool | None = None,
    kv_in_host: bool | None = None, attention_on_cpu: bool | None = None,
) -> Policy:
    """The policy for running `jobs` (runner Jobs) on a loaded model, with the user's choices fixed."""
    if model.resident_widened:  # what the device has free counts the copies as stored (as this run ends with them)
        raise ValueError("the resident copies are held dequantized (hold_resident_experts): hold them as stored "
                         "before choosing a policy")  # fmt: skip
    floors = floors or Floors.of_machine(model)
    if floors.device_free_bytes is None and model.placement.device.platform != "cpu":
        floors = dataclasses.replace(floors, device_free_bytes=free_device_memory(model.placement.device))
    if floors.host_free_bytes is None:
        floors = dataclasses.replace(floors, host_free_bytes=host_kv_budget(model))
    if attention_on_cpu and floors.cpu_attention_gflops is None:  # asked for: its rate at this model's shapes
        rate = machine_floors.cpu_attention_gflops(model.config, model.dtype)
        floors = dataclasses.replace(floors, cpu_attention_gflops=rate)
    work = Workload.of_jobs(jobs, cache_len)
    resident = not model.experts_on_host and _moe_layers(model.config) > 0
    # Pinned, streamable experts. Chosen only on a GPU; forced, the same program runs on any device (tests).
    can_stream = not resident and choose_prefill_path(model, 1, 1, threshold=0) == "stream" and (
        model.placement.device.platform == "gpu" or experts == "stream" or bool(cpu_blocks) or bool(kv_in_host)
        or bool(attention_on_cpu)
    )
    itemsize = jnp.dtype(model.dtype).itemsize
    return search(model.config, floors, work, itemsize, can_stream, slots, micro_batches, prefill_batch, experts,
                  cpu_blocks, resident, widened, kv_in_host, attention_on_cpu)
