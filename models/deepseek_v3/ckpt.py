"""The DeepSeek-V3 family's checkpoint map: its MLA tensors in the shared decoder map (models/common/checkpoint_map)."""

from collections.abc import Callable
from typing import Any

from hybridjit.models.common.checkpoint_map import Layout, MoENames, TensorSpec, build_decoder_weights, decoder_layout
from hybridjit.models.common.decoder import Weights
from hybridjit.models.common.experts import Experts
from hybridjit.models.deepseek_v3.config import DeepseekV3Config as ModelConfig
from hybridjit.models.deepseek_v3.model import MLA

MOE_NAMES = MoENames()  # mlp.gate (+ e_score_correction_bias), mlp.shared_experts, mlp.experts.E.{gate,up,down}_proj


def checkpoint_layout(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor the config implies, by its Hugging Face name."""
    d, h = cfg.hidden_size, cfg.num_attention_heads

    def attention(layout: Layout, a: str):
        if cfg.q_lora_rank is None:
            layout.matrix(f"{a}.q_proj.weight", h * cfg.qk_head_dim, d)
        else:
            layout.matrix(f"{a}.q_a_proj.weight", cfg.q_lora_rank, d)
            layout.vector(f"{a}.q_a_layernorm.weight", cfg.q_lora_rank)
            layout.matrix(f"{a}.q_b_proj.weight", h * cfg.qk_head_dim, cfg.q_lora_rank)
            if cfg.attention_bias:
                layout.vector(f"{a}.q_a_proj.bias", cfg.q_lora_rank)
        layout.matrix(f"{a}.kv_a_proj_with_mqa.weight", cfg.kv_lora_rank + cfg.qk_rope_head_dim, d)
        layout.vector(f"{a}.kv_a_layernorm.weight", cfg.kv_lora_rank)
        layout.matrix(f"{a}.kv_b_proj.weight", h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        layout.matrix(f"{a}.o_proj.weight", d, h * cfg.v_head_dim)
        if cfg.attention_bias:
            layout.vector(f"{a}.kv_a_proj_with_mqa.bias", cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            layout.vector(f"{a}.o_proj.bias", d)

    return decoder_layout(cfg, attention, MOE_NAMES)


def build_weights(
    cfg: ModelConfig,
    tensor: Callable[..., Any],
    routed: Callable[[str, int], tuple[Experts | None, int | None]],
) -> Weights:
    """The weights pytree (models/common/checkpoint_map.build_decoder_weights) with MLA attention."""

    def maybe(name, present):
        return tensor(name) if present else None

    def mla(p, _layer):
        lora, bias = cfg.q_lora_rank is not None, cfg.attention_bias
        return MLA(
            q_a=maybe(f"{p}.q_a_proj.weight", lora),
            q_a_bias=maybe(f"{p}.q_a_proj.bias", lora and bias),
            q_a_norm=maybe(f"{p}.q_a_layernorm.weight", lora),
            q_b=tensor(f"{p}.q_b_proj.weight" if lora else f"{p}.q_proj.weight"),
            kv_a=tensor(f"{p}.kv_a_proj_with_mqa.weight"),
            kv_a_bias=maybe(f"{p}.kv_a_proj_with_mqa.bias", bias),
            kv_a_norm=tensor(f"{p}.kv_a_layernorm.weight"),
            kv_b=tensor(f"{p}.kv_b_proj.weight"),
            o=tensor(f"{p}.o_proj.weight"),
            o_bias=maybe(f"{p}.o_proj.bias", bias),
        )

    return build_decoder_weights(cfg, tensor, routed, mla, MOE_NAMES)
