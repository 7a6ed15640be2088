"""The gpt-oss family's checkpoint map, as released: GQA with q/k/v/o biases and per-head sinks, each layer windowed
as its layer_types says; the MoE block under mlp with the router (weight and bias) and the experts fused over all
experts in MXFP4 (gate_up_proj with gate and up rows interleaved, down_proj; `_blocks`, `_scales`, `_bias`)."""

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from hybridjit.models.common.checkpoint_map import (
    FusedMxfp4Experts,
    Layout,
    MoENames,
    TensorSpec,
    build_decoder_weights,
    decoder_layout,
)
from hybridjit.models.common.decoder import Weights
from hybridjit.models.common.gqa import GQA
from hybridjit.models.common.gqa_checkpoint import gqa_layout, gqa_weights
from hybridjit.models.common.moe import MoE
from hybridjit.models.gpt_oss.config import GptOssConfig

MOE_NAMES = MoENames(router="router")
MXFP4_GROUP = 32  # elements per e8m0 scale; a group's 16 bytes are the blocks' last axis


def _attention_layout(cfg: GptOssConfig) -> Callable[[Layout, str], None]:
    gqa = gqa_layout(cfg, qk_norm=None)

    def attention(layout: Layout, a: str):
        gqa(layout, a)
        layout.vector(f"{a}.sinks", cfg.num_attention_heads)

    return attention


def _moe_layout(cfg: GptOssConfig) -> Callable[[Layout, str], None]:
    e, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size

    def moe(layout: Layout, block: str):
        layout.matrix(f"{block}.router.weight", e, d, quantizable=False)
        layout.vector(f"{block}.router.bias", e)
        experts = FusedMxfp4Experts(f"{block}.experts", cfg.activation)
        for projection, out, inp in (("gate_up_proj", 2 * f, d), ("down_proj", d, f)):
            groups = inp // MXFP4_GROUP
            layout.tensor(experts.tensor(projection, "blocks"), (e, out, groups, 16), "U8", routed_expert=True)
            layout.tensor(experts.tensor(projection, "scales"), (e, out, groups), "U8", routed_expert=True)
            layout.tensor(experts.tensor(projection, "bias"), (e, out))

    return moe


def checkpoint_layout(cfg: GptOssConfig) -> dict[str, TensorSpec]:
    """Every tensor the config implies, by its Hugging Face name."""
    return decoder_layout(cfg, _attention_layout(cfg), MOE_NAMES, moe_layout=_moe_layout(cfg))


def build_weights(cfg: GptOssConfig, tensor: Callable[..., Any], routed: Callable) -> Weights:
    """The weights pytree (models/common/checkpoint_map.build_decoder_weights) with GQA attention with sinks, windowed
    per layer, and MoE blocks whose experts `routed` gets as FusedMxfp4Experts."""
    gqa = gqa_weights(cfg, tensor, qk_norm=None)

    def attention(a: str, layer: int) -> GQA:
        w = gqa(a, layer)
        w.sinks = tensor(f"{a}.sinks", jnp.float32)
        return w

    def moe(layer_prefix: str, layer: int) -> MoE:
        block = f"{layer_prefix}.{MOE_NAMES.block}"
        experts, bank_layer = routed(FusedMxfp4Experts(f"{block}.experts", cfg.activation), layer)
        return MoE(
            router=tensor(f"{block}.router.weight", jnp.float32),
            router_bias=tensor(f"{block}.router.bias", jnp.float32),
            correction_bias=None,
            shared=None,
            experts=experts,
            expert_layer=bank_layer,
        )

    return build_decoder_weights(cfg, tensor, routed, attention, MOE_NAMES, moe=moe)
