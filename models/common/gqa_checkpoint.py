"""The checkpoint tensors of grouped-query attention as the Llama-lineage releases name them (self_attn.q_proj,
k_proj, v_proj, o_proj, with biases and QK norms where the family has them): what GQA families put into the
shared decoder map."""

from collections.abc import Callable
from typing import Any

from hybridjit.models.common.checkpoint_map import Layout
from hybridjit.models.common.gqa import GQA


def gqa_layout(cfg, *, qk_norm: str | None, o_bias: bool | None = None) -> Callable[[Layout, str], None]:
    """attention_layout for decoder_layout: one layer's GQA tensors. qk_norm: None, "head" (a norm of head_dim per
    head, Qwen3, GLM) or "all" (one over all heads' dims, MiniMax-M2); o_proj's bias as attention_bias unless
    o_bias says otherwise (GLM biases q/k/v only)."""
    o_bias = cfg.attention_bias if o_bias is None else o_bias
    d, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim

    def attention(layout: Layout, a: str):
        for name, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            layout.matrix(f"{a}.{name}.weight", out, d)
            if cfg.attention_bias:
                layout.vector(f"{a}.{name}.bias", out)
        layout.matrix(f"{a}.o_proj.weight", d, q)
        if o_bias:
            layout.vector(f"{a}.o_proj.bias", d)
        if qk_norm:
            layout.vector(f"{a}.q_norm.weight", q if qk_norm == "all" else cfg.head_dim)
            layout.vector(f"{a}.k_norm.weight", kv if qk_norm == "all" else cfg.head_dim)

    return attention


def gqa_weights(
    cfg, tensor: Callable[..., Any], *, qk_norm: str | None, o_bias: bool | None = None
):
    """attention for build_decoder_weights: one layer's GQA weights from its tensors (arguments as gqa_layout's),
    windowed as the config says of the layer (cfg.window)."""
    o_bias = cfg.attention_bias if o_bias is None else o_bias

    def optional(name, present):
        return tensor(name) if present else None

    def attention(a: str, layer: int) -> GQA:
        bias = cfg.attention_bias
        return GQA(
            q=tensor(f"{a}.q_proj.weight"),
            k=tensor(f"{a}.k_proj.weight"),
            v=tensor(f"{a}.v_proj.weight"),
            o=tensor(f"{a}.o_proj.weight"),
            q_bias=optional(f"{a}.q_proj.bias", bias),
            k_bias=optional(f"{a}.k_proj.bias", bias),
            v_bias=optional(f"{a}.v_proj.bias", bias),
            o_bias=optional(f"{a}.o_proj.bias", o_bias),
            q_norm=optional(f"{a}.q_norm.weight", qk_norm is not None),
            k_norm=optional(f"{a}.k_norm.weight", qk_norm is not None),
            window=cfg.window(layer),
        )

    return attention
