"""The GLM-4.5 family's checkpoint map, as released: GQA with q/k/v biases (none on o_proj) and QK norms where
the config enables them, in the shared decoder map (DeepSeek's MoE names: mlp.gate with its correction bias,
mlp.shared_experts, mlp.experts.E)."""

from collections.abc import Callable
from typing import Any

from hybridjit.models.common.checkpoint_map import MoENames, TensorSpec, build_decoder_weights, decoder_layout
from hybridjit.models.common.decoder import Weights
from hybridjit.models.common.gqa_checkpoint import gqa_layout, gqa_weights
from hybridjit.models.glm4_moe.config import Glm4MoeConfig

MOE_NAMES = MoENames()


def checkpoint_layout(cfg: Glm4MoeConfig) -> dict[str, TensorSpec]:
    """Every tensor the config implies, by its Hugging Face name."""
    return decoder_layout(cfg, gqa_layout(cfg, qk_norm="head" if cfg.use_qk_norm else None, o_bias=False), MOE_NAMES)


def build_weights(cfg: Glm4MoeConfig, tensor: Callable[..., Any], routed: Callable) -> Weights:
    """The weights pytree (models/common/checkpoint_map.build_decoder_weights) with GQA attention."""
    attention = gqa_weights(cfg, tensor, qk_norm="head" if cfg.use_qk_norm else None, o_bias=False)
    return build_decoder_weights(cfg, tensor, routed, attention, MOE_NAMES)
