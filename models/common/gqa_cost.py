"""The cost module of the GQA families (Qwen3-MoE, Mixtral): their figures for the choice of path
(hybridjit.stream_prefill's model of prefill time) and for the offline policy's model of a decode step
(hybridjit.offline_policy)."""


def layer_flops(cfg, batch: int, length: int) -> dict[str, float]:
    """FLOPs (2 per multiply-add) of one layer's prefill by part, as deepseek_v3.cost.layer_flops reports them."""
    n, d, e = batch * length, cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * e, cfg.num_key_value_heads * e
    f = cfg.moe_intermediate_size
    return {
        "projections": 2.0 * n * (d * q + 2 * d * kv + q * d),
        "attention core": 2.0 * batch * cfg.num_attention_heads * length * (length + 1) // 2 * (2 * e),
        "dense mlp": 2.0 * n * 3 * d * cfg.intermediate_size,
        "router+shared": 2.0 * n * (d * cfg.n_routed_experts + 3 * d * f * cfg.n_shared_experts),
        "routed": 2.0 * n * cfg.num_experts_per_tok * 3 * d * f,
    }


def kv_elements_per_token(cfg) -> int:
    """Cache elements one token keeps per layer: its key and value heads."""
    return 2 * cfg.num_key_value_heads * cfg.head_dim


def decode_attention_flops(cfg, batch: int, context: int) -> float:
    """FLOPs of one layer's decode attention core over `context` cached positions: scores and weighted values."""
    return 2.0 * batch * cfg.num_attention_heads * context * 2 * cfg.head_dim
