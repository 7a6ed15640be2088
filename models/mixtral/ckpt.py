"""The Mixtral family's checkpoint map, as released: GQA without QK norms, and the MoE block named
block_sparse_moe with experts' w1 (gate), w3 (up) and w2 (down), in the shared decoder map."""

from collections.abc import Callable
from typing import Any

from hybridjit.models.common.checkpoint_map import MoENames, TensorSpec, build_decoder_weights, decoder_layout
from hybridjit.models.common.decoder import Weights
from hybridjit.models.common.gqa_checkpoint import gqa_layout, gqa_weights
from hybridjit.models.mixtral.config import MixtralConfig

MOE_NAMES = MoENames(block="block_sparse_moe", projections=("w1", "w3", "w2"))


def checkpoint_layout(cfg: MixtralConfig) -> dict[str, TensorSpec]:
    """Every tensor the config implies, by its Hugging Face name."""
    return decoder_layout(cfg, gqa_layout(cfg, qk_norm=None), MOE_NAMES)


def build_weights(cfg: MixtralConfig, tensor: Callable[..., Any], routed: Callable) -> Weights:
    """The weights pytree (models/common/checkpoint_map.build_decoder_weights) with GQA attention, every layer
    windowed when the config sets a sliding window."""
    attention = gqa_weights(cfg, tensor, qk_norm=None)
    return build_decoder_weights(cfg, tensor, routed, attention, MOE_NAMES)
