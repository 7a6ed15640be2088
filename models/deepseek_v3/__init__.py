"""The DeepSeek-V3 family (DeepSeek-V2, V2-Lite, V3, R1, V3.1, Kimi-K2): Multi-head Latent Attention over a
compressed latent cache, dense first layers, sigmoid or softmax routing with group limits, shared experts.

A family package holds what the runtime asks of a family (models/registry.py lists it), in four modules:
- config: CONFIG, the config class built from a Hugging Face config.json; MODEL_TYPES, ARCHITECTURES, the known
  NAMES and the PRESETS of the released sizes;
- model: the model as pure functions: init_cache and the shared decoder's functions with the family's attention
  bound (forward, forward_layer, finite_stages, prefill, decode_step, decode_step_dual, decode_step_grouped,
  prefill_attention_layer, decode_attention_layer), and stream-loaded prefill's attention cores:
  ChunkedAttention(chunk) and fused_attention(cfg, dtype), the fused core a GPU runs in that dtype or None;
- ckpt: the checkpoint map (checkpoint_layout, build_weights);
- cost: the figures of the path choice and of stream-loaded prefill's plan (layer_flops,
  attention_activation_elements).
This package also re-exports its model's functions and the shared pieces it composes, for researchers.
"""

# The shared pieces this family composes, here too for whoever composes its functions.
from hybridjit.models.common.decoder import Layer, Weights
from hybridjit.models.common.experts import Experts, dequantize_blocks, experts_grouped, group_by_expert
from hybridjit.models.common.layers import MLP, linear, mlp, rms_norm
from hybridjit.models.common.moe import ExpertSchedule, MoE
from hybridjit.models.common.routing import route
from hybridjit.models.deepseek_v3 import ckpt, config, cost, model
from hybridjit.models.deepseek_v3.ckpt import build_weights, checkpoint_layout
from hybridjit.models.deepseek_v3.config import (
    ARCHITECTURES,
    MODEL_TYPES,
    NAMES,
    PRESETS,
    DeepseekV3Config,
)
from hybridjit.models.deepseek_v3.cost import layer_flops
from hybridjit.models.deepseek_v3.model import (
    MLA,
    ChunkedAttention,
    CudnnAttention,
    LayerCache,
    attention_absorbed,
    attention_prefill,
    causal_attention,
    decode_attention_layer,
    decode_step,
    decode_step_dual,
    decode_step_grouped,
    finite_stages,
    forward,
    forward_layer,
    fused_attention,
    init_cache,
    prefill,
    prefill_attention_layer,
)

__all__ = [
    "MLP", "Experts", "MoE", "dequantize_blocks", "experts_grouped", "group_by_expert", "linear", "mlp", "rms_norm",
    "route", "ARCHITECTURES", "ckpt", "config", "cost", "model", "MLA", "MODEL_TYPES", "NAMES", "PRESETS",
    "ChunkedAttention", "CudnnAttention", "DeepseekV3Config", "ExpertSchedule", "Layer", "LayerCache", "Weights",
    "attention_absorbed", "attention_prefill", "build_weights", "causal_attention", "checkpoint_layout", "decode_step",
    "decode_step_dual", "decode_step_grouped", "finite_stages", "forward", "forward_layer", "fused_attention",
    "init_cache", "layer_flops", "prefill", "prefill_attention_layer", "decode_attention_layer",
]
