"""The Qwen3-MoE family's checkpoint map, as released (one tensor per expert): GQA with per-head QK norms in the
shared decoder map (models/common/checkpoint_map)."""

from collections.abc import Callable
from typing import Any

from hybridjit.models.common.checkpoint_map import MoENames, TensorSpec, build_decoder_weights, decoder_layout
from hybridjit.models.common.decoder import Weights
from hybridjit.models.common.gqa_checkpoint import gqa_layout, gqa_weights
from hybridjit.models.qwen3_moe.config import Qwen3MoeConfig

MOE_NAMES = MoENames()  # mlp.gate, mlp.experts.E.{gate,up,down}_proj


def checkpoint_layout(cfg: Qwen3MoeConfig) -> dict[str, TensorSpec]:
    """Every tensor the config implies, by its Hugging Face name."""
    return decoder_layout(cfg, gqa_layout(cfg, qk_norm="head"), MOE_NAMES)


def build_weights(cfg: Qwen3MoeConfig, tensor: Callable[..., Any], routed: Callable) -> Weights:
    """The weights pytree (models/common/checkpoint_map.build_decoder_weights) with GQA attention."""
    return build_decoder_weights(cfg, tensor, routed, gqa_weights(cfg, tensor, qk_norm="head"), MOE_NAMES)
