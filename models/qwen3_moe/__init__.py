"""The Qwen3-MoE family (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): grouped-query attention with per-head QK
RMSNorm, softmax top-k routing, no shared expert. The same interface as models/deepseek_v3 (see its docstring).
"""

from hybridjit.models.common.decoder import Layer, Weights
from hybridjit.models.common.gqa import GQA, KVCache
from hybridjit.models.qwen3_moe.ckpt import build_weights, checkpoint_layout
from hybridjit.models.qwen3_moe.config import ARCHITECTURES, MODEL_TYPES, NAMES, PRESETS, Qwen3MoeConfig
from hybridjit.models.qwen3_moe.cost import layer_flops
from hybridjit.models.qwen3_moe.model import (
    decode_step,
    decode_step_dual,
    finite_stages,
    forward,
    forward_layer,
    init_cache,
    prefill,
    prefill_attention_layer,
)

CONFIG = Qwen3MoeConfig

__all__ = [
    "ARCHITECTURES", "CONFIG", "GQA", "KVCache", "Layer", "MODEL_TYPES", "NAMES", "PRESETS", "Qwen3MoeConfig",
    "Weights", "build_weights", "checkpoint_layout", "decode_step", "decode_step_dual", "finite_stages", "forward",
    "forward_layer", "init_cache", "layer_flops", "prefill", "prefill_attention_layer",
]
