"""Which prefill path a prompt takes, by a cost model fed with the machine's measured rates: stream-loaded
(hybridjit.stream_prefill: every routed expert copied to the GPU as stored and computed there, the copies
overlapping the GPU's work) or hybrid (the GPU's layers, then the routed experts on the CPU kernels, alternating
layer by layer). Short prompts stay hybrid, long ones stream (OSDI '26 §3.1; the cost model's crossover on 1x H200:
1,340 tokens for DeepSeek-V3, 545-590 for Qwen3-235B-A22B and gpt-oss-120b, bench/RESULTS.md)."""

import dataclasses
import math
from functools import cache

from hybridjit.checkpoint import DTYPES
from hybridjit.models.registry import ModelConfig, family_of
from hybridjit.quant import scale_shape
from hybridjit.stream_prefill import pinned_layers, streaming_devices


@dataclasses.dataclass(frozen=True)
class PrefillRates:
    """The measured figures the prefill-path choice is fed with. bench/prefill.py measures all three; the
    defaults are its figures on 1x H200 with 16 cores (bench/RESULTS.md)."""

    pcie_gbps: float = 54.0  # pinned host -> device copies
    gpu_tflops: float = 550.0  # what prefill's GPU work achieves (a dense bf16 GEMM: 784; attention is slower)
    # The CPU expert kernels on one layer, 4096 tokens routed uniformly: bench/prefill.py's cpu_expert_tflops on
    # DeepSeek-V3 FP8 experts, 1x H200 with 16 cores, session 1 (6b0c27d, bench/RESULTS.md), i.e. FP8 through the
    # amx_bf16 kernel before issue #27. FP8 now runs amx_fp8g and the integer formats amx_int8g: re-measure
    # per format with bench/prefill.py and bench/moe_cpu.py --prefill-cases before relying on this default.
    cpu_expert_tflops: float = 3.8


def prefill_flops(cfg: ModelConfig, batch: int, length: int) -> dict[str, float]:
    """FLOPs of one prefill: {"routed": routed experts, "other": everything else}, by layer_flops, with the LM
    head on the last tokens only."""
    part = family_of(cfg).cost.layer_flops(cfg, batch, length)
    layers = cfg.num_hidden_layers
    moe = sum(cfg.is_moe_layer(i) for i in range(layers))
    other = (
        layers * (part["projections"] + part["attention core"])
        + (layers - moe) * part["dense mlp"]
        + moe * part["router+shared"]
        + 2.0 * batch * cfg.hidden_size * cfg.vocab_size
    )
    return {"routed": moe * part["routed"], "other": other}


@cache
def expert_bytes(cfg: ModelConfig) -> int:
    """Bytes of all routed experts as stored, what streaming copies (their biases, a fraction of a percent, left
    out), from the family's checkpoint map: raw tensors (MXFP4 blocks and scales) as it declares them, int8/int4
    and FP8 matrices with their float32 scales, any other as BF16."""
    total = 0
    for spec in family_of(cfg).ckpt.checkpoint_layout(cfg).values():
        if not spec.routed_expert:
            continue
        if spec.dtype is not None:
            total += math.prod(spec.shape) * DTYPES[spec.dtype].itemsize
        elif cfg.int_quant is not None:
            stored, scales = cfg.int_quant.stored_shape(spec.shape), cfg.int_quant.scale_shape(spec.shape)
            total += math.prod(stored) + 4 * math.prod(scales)
        elif cfg.fp8 is not None:
            total += math.prod(spec.shape) + 4 * math.prod(scale_shape(spec.shape, cfg.fp8.block))
        else:
            total += 2 * math.prod(spec.shape)
    return total


def prefill_seconds(
    cfg: ModelConfig, batch: int, length: int, rates: PrefillRates, streamed_bytes: int | None = None
) -> dict[str, float]:
    """Modelled prefill time of both paths: stream-loaded (the larger of streaming every expert over PCIe and
    computing everything on the GPU: they overlap) and hybrid (the GPU's part, then the routed experts on the
    CPU: they alternate layer by layer). `streamed_bytes`: the experts' bytes as a loaded model holds them (a GGUF
    file's blocks), default expert_bytes(cfg)."""
    flops = prefill_flops(cfg, batch, length)
    gpu = rates.gpu_tflops * 1e12
    streamed = expert_bytes(cfg) if streamed_bytes is None else streamed_bytes
    return {
        "stream": max(streamed / (rates.pcie_gbps * 1e9), (flops["other"] + flops["routed"]) / gpu),
        "hybrid": flops["other"] / gpu + flops["routed"] / (rates.cpu_expert_tflops * 1e12),
    }


def crossover_length(cfg: ModelConfig, rates: PrefillRates, batch: int = 1) -> int:
    """The shortest prompt length from which the stream-loaded prefill is modelled faster than the hybrid."""
    def stream_wins(length):
        t = prefill_seconds(cfg, batch, length, rates)
        return t["stream"] < t["hybrid"]

    high = 1
    while not stream_wins(high):
        if high >= cfg.max_position_embeddings:
            return cfg.max_position_embeddings + 1  # never within the context
        high *= 2
    low = high // 2  # stream_wins(low) is false, or low == 0
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if stream_wins(mid) else (mid, high)
    return high


def choose_prefill_path(
    model, batch: int, length: int, *, rates: PrefillRates | None = None, threshold: int | None = None
) -> str:
    """"stream" or "hybrid" for a prompt batch [batch, length]. Streaming needs the routed experts pinned; then
    `threshold` (prompt tokens, batch * length) overrides the cost model; without it, streaming is chosen on a GPU
    when prefill_seconds models it faster with `rates` (default: the machine's, model.prefill_rates()), and never
    when every routed expert is resident on the device (the hybrid path then computes them all there: streaming
    would copy over PCIe what the device already holds)."""
    try:
        pinned = pinned_layers(model.weights)
    except ValueError:  # experts not pinned
        return "hybrid"
    if not pinned:
        return "hybrid"
    if threshold is not None:
        return "stream" if batch * length >= threshold else "hybrid"
    if model.placement.device.platform != "gpu" or not model.experts_on_host:
        return "hybrid"
    streamed = sum(layer.nbytes for layer in pinned.values())
    rates = rates or model.prefill_rates()
    # Over several prefill devices each streams its share over its own link (distributed stream-loaded prefill).
    n = len(streaming_devices(model, model.placement.stream_devices))
    rates = dataclasses.replace(rates, pcie_gbps=n * rates.pcie_gbps)
    t = prefill_seconds(model.config, batch, length, rates, streamed)
    return "stream" if t["stream"] < t["hybrid"] else "hybrid"
