"""The MiniMax-M2 family's checkpoint map, as released: GQA with QK norms over all heads, the MoE block named
block_sparse_moe with its correction bias on the block and experts w1 (gate), w3 (up), w2 (down), in the shared
decoder map."""

from collections.abc import Callable
from typing import Any

from hybridjit.models.common.checkpoint_map import MoENames, TensorSpec, build_decoder_weights, decoder_layout
from hybridjit.models.common.decoder import Weights
from hybridjit.models.common.gqa_checkpoint import gqa_layout, gqa_weights
from hybridjit.models.minimax_m2.config import MiniMaxM2Config

MOE_NAMES = MoENames(
    block="block_sparse_moe", projections=("w1", "w3", "w2"), correction_bias="e_score_correction_bias"
)


def checkpoint_layout(cfg: MiniMaxM2Config) -> dict[str, TensorSpec]:
    """Every tensor the config implies, by its Hugging Face name."""
    return decoder_layout(cfg, gqa_layout(cfg, qk_norm="all"), MOE_NAMES)


def build_weights(cfg: MiniMaxM2Config, tensor: Callable[..., Any], routed: Callable) -> Weights:
    """The weights pytree (models/common/checkpoint_map.build_decoder_weights) with GQA attention."""
    return build_decoder_weights(cfg, tensor, routed, gqa_weights(cfg, tensor, qk_norm="all"), MOE_NAMES)
