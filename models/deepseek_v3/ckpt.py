"""The DeepSeek-V3 family's checkpoint map: the Hugging Face tensor names a config implies, with their shapes
(`checkpoint_layout`: what loading checks a checkpoint against), and how those tensors make the weights pytree
(`build_weights`: what loading, exporting and training initialisation fill in)."""

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from hybridjit.models.common.checkpoint_map import PROJECTIONS, TensorSpec
from hybridjit.models.common.decoder import Layer, Weights
from hybridjit.models.common.layers import MLP
from hybridjit.models.common.moe import Experts, MoE
from hybridjit.models.deepseek_v3.config import DeepseekV3Config as ModelConfig
from hybridjit.models.deepseek_v3.model import MLA


def checkpoint_layout(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor the config implies, by its Hugging Face name."""
    specs: dict[str, TensorSpec] = {}
    d, h = cfg.hidden_size, cfg.num_attention_heads

    def matrix(name, out, inp, quantizable=True):
        specs[name] = TensorSpec((out, inp), quantizable)

    def vector(name, size):
        specs[name] = TensorSpec((size,), False)

    def mlp(prefix, inter):
        matrix(f"{prefix}.gate_proj.weight", inter, d)
        matrix(f"{prefix}.up_proj.weight", inter, d)
        matrix(f"{prefix}.down_proj.weight", d, inter)

    matrix("model.embed_tokens.weight", cfg.vocab_size, d, quantizable=False)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        vector(f"{p}.input_layernorm.weight", d)
        vector(f"{p}.post_attention_layernorm.weight", d)
        a = f"{p}.self_attn"
        if cfg.q_lora_rank is None:
            matrix(f"{a}.q_proj.weight", h * cfg.qk_head_dim, d)
        else:
            matrix(f"{a}.q_a_proj.weight", cfg.q_lora_rank, d)
            vector(f"{a}.q_a_layernorm.weight", cfg.q_lora_rank)
            matrix(f"{a}.q_b_proj.weight", h * cfg.qk_head_dim, cfg.q_lora_rank)
            if cfg.attention_bias:
                vector(f"{a}.q_a_proj.bias", cfg.q_lora_rank)
        matrix(f"{a}.kv_a_proj_with_mqa.weight", cfg.kv_lora_rank + cfg.qk_rope_head_dim, d)
        vector(f"{a}.kv_a_layernorm.weight", cfg.kv_lora_rank)
        matrix(f"{a}.kv_b_proj.weight", h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        matrix(f"{a}.o_proj.weight", d, h * cfg.v_head_dim)
        if cfg.attention_bias:
            vector(f"{a}.kv_a_proj_with_mqa.bias", cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            vector(f"{a}.o_proj.bias", d)
        if not cfg.is_moe_layer(i):
            mlp(f"{p}.mlp", cfg.intermediate_size)
            continue
        matrix(f"{p}.mlp.gate.weight", cfg.n_routed_experts, d, quantizable=False)
        if cfg.use_correction_bias:
            vector(f"{p}.mlp.gate.e_score_correction_bias", cfg.n_routed_experts)
        if cfg.n_shared_experts:
            mlp(f"{p}.mlp.shared_experts", cfg.moe_intermediate_size * cfg.n_shared_experts)
        for e in range(cfg.n_routed_experts):
            mlp(f"{p}.mlp.experts.{e}", cfg.moe_intermediate_size)
    vector("model.norm.weight", d)
    if not cfg.tie_word_embeddings:
        matrix("lm_head.weight", cfg.vocab_size, d, quantizable=False)
    return specs


def build_weights(
    cfg: ModelConfig,
    tensor: Callable[..., Any],
    routed: Callable[[str, int], tuple[Experts | None, int | None]],
) -> Weights:
    """The weights pytree, with each leaf made by tensor(hf_name[, dtype]) and each MoE layer's routed
    experts by routed(prefix, layer) -> (JAX-held experts or None, expert-bank layer id or None).

    The one place that maps checkpoint names to the pytree: loading passes array readers, exporting
    passes the identity to get the same tree with names as leaves.
    """

    def maybe(name, present):
        return tensor(name) if present else None

    def mla(p):
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

    def mlp(p):
        return MLP(*(tensor(f"{p}.{proj}.weight") for proj in PROJECTIONS))

    def moe(p, layer):
        experts, bank_layer = routed(p, layer)
        return MoE(
            router=tensor(f"{p}.gate.weight", jnp.float32),
            correction_bias=tensor(f"{p}.gate.e_score_correction_bias", jnp.float32)
            if cfg.use_correction_bias
            else None,
            shared=mlp(f"{p}.shared_experts") if cfg.n_shared_experts else None,
            experts=experts,
            expert_layer=bank_layer,
        )

    layers = [
        Layer(
            attn_norm=tensor(f"model.layers.{i}.input_layernorm.weight"),
            attn=mla(f"model.layers.{i}.self_attn"),
            mlp_norm=tensor(f"model.layers.{i}.post_attention_layernorm.weight"),
            mlp=moe(f"model.layers.{i}.mlp", i) if cfg.is_moe_layer(i) else mlp(f"model.layers.{i}.mlp"),
        )
        for i in range(cfg.num_hidden_layers)
    ]
    embed = tensor("model.embed_tokens.weight")
    return Weights(
        embed=embed,
        layers=layers,
        norm=tensor("model.norm.weight"),
        lm_head=embed if cfg.tie_word_embeddings else tensor("lm_head.weight"),
    )
