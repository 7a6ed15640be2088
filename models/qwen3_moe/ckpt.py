"""The Qwen3-MoE family's checkpoint map, as released (one tensor per expert): its GQA tensors with QK norms in
the shared decoder map (models/common/checkpoint_map)."""

from collections.abc import Callable
from typing import Any

from hybridjit.models.common.checkpoint_map import Layout, TensorSpec, build_decoder_weights, decoder_layout
from hybridjit.models.common.decoder import Weights
from hybridjit.models.common.gqa import GQA
from hybridjit.models.common.moe import Experts
from hybridjit.models.qwen3_moe.config import Qwen3MoeConfig


def checkpoint_layout(cfg: Qwen3MoeConfig) -> dict[str, TensorSpec]:
    """Every tensor the config implies, by its Hugging Face name."""
    d, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim

    def attention(layout: Layout, a: str):
        for name, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            layout.matrix(f"{a}.{name}.weight", out, d)
            if cfg.attention_bias:
                layout.vector(f"{a}.{name}.bias", out)
        layout.matrix(f"{a}.o_proj.weight", d, q)
        if cfg.attention_bias:
            layout.vector(f"{a}.o_proj.bias", d)
        layout.vector(f"{a}.q_norm.weight", cfg.head_dim)
        layout.vector(f"{a}.k_norm.weight", cfg.head_dim)

    return decoder_layout(cfg, attention)


def build_weights(
    cfg: Qwen3MoeConfig,
    tensor: Callable[..., Any],
    routed: Callable[[str, int], tuple[Experts | None, int | None]],
) -> Weights:
    """The weights pytree (models/common/checkpoint_map.build_decoder_weights) with GQA attention."""

    def bias(name):
        return tensor(name) if cfg.attention_bias else None

    def attention(a, _layer):
        return GQA(
            q=tensor(f"{a}.q_proj.weight"),
            k=tensor(f"{a}.k_proj.weight"),
            v=tensor(f"{a}.v_proj.weight"),
            o=tensor(f"{a}.o_proj.weight"),
            q_bias=bias(f"{a}.q_proj.bias"),
            k_bias=bias(f"{a}.k_proj.bias"),
            v_bias=bias(f"{a}.v_proj.bias"),
            o_bias=bias(f"{a}.o_proj.bias"),
            q_norm=tensor(f"{a}.q_norm.weight"),
            k_norm=tensor(f"{a}.k_norm.weight"),
        )

    return build_decoder_weights(cfg, tensor, routed, attention)
