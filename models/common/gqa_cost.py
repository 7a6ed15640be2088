"""The cost module of the GQA families (Qwen3-MoE, Mixtral, GLM-4.5, MiniMax-M2, gpt-oss): their figures for the
choice of path (hybridjit.stream_prefill's model of prefill time), for stream-loaded prefill's memory plan and for
the offline policy's model of a decode step (hybridjit.offline_policy)."""


def visible_pairs(length: int, window: int | None) -> int:
    """Query-key pairs a causal prompt of `length` tokens scores, each query seeing its last `window` positions (all
    before it when None)."""
    if window is None or window >= length:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def layer_flops(cfg, batch: int, length: int) -> dict[str, float]:
    """FLOPs (2 per multiply-add) of one layer's prefill by part, as deepseek_v3.cost.layer_flops reports them; the
    attention core is the mean over the layers, whose windows differ (gpt-oss's alternate)."""
    n, d, e = batch * length, cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * e, cfg.num_key_value_heads * e
    f = cfg.moe_intermediate_size
    layers = cfg.num_hidden_layers
    pairs = sum(visible_pairs(length, cfg.window(i)) for i in range(layers)) / layers
    return {
        "projections": 2.0 * n * (d * q + 2 * d * kv + q * d),
        "attention core": 2.0 * batch * cfg.num_attention_heads * pairs * (2 * e),
        "dense mlp": 2.0 * n * 3 * d * cfg.intermediate_size,
        "router+shared": 2.0 * n * (d * cfg.n_routed_experts + 3 * d * f * cfg.n_shared_experts),
        "routed": 2.0 * n * cfg.num_experts_per_tok * 3 * d * f,
    }


def attention_activation_elements(cfg) -> int:
    """Elements per prompt token that one layer's attention holds at its peak in stream-loaded prefill, an upper
    estimate: up to four copies of the queries and of the keys and values (projected, normed, roped; the core's
    output)."""
    return 4 * (cfg.num_attention_heads + cfg.num_key_value_heads) * cfg.head_dim


def kv_elements_per_token(cfg) -> int:
    """Cache elements one token keeps per layer: its key and value heads."""
    return 2 * cfg.num_key_value_heads * cfg.head_dim


def decode_attention_flops(cfg, batch: int, context: int) -> float:
    """FLOPs of one layer's decode attention core over `context` cached positions: scores and weighted values."""
    return 2.0 * batch * cfg.num_attention_heads * context * 2 * cfg.head_dim
