"""The DeepSeek-V3 family's cost figures for the choice of path (hybridjit.stream_prefill's model of prefill time),
for stream-loaded prefill's memory plan and for the offline policy's model of a decode step
(hybridjit.offline_policy)."""

from hybridjit.models.deepseek_v3.config import DeepseekV3Config as ModelConfig


def layer_flops(cfg: ModelConfig, batch: int, length: int) -> dict[str, float]:
    """FLOPs (2 per multiply-add) of one layer's prefill by part: "projections" (MLA's), "attention core"
    (causal: counted over its lower triangle), "dense mlp" (of a dense layer), "router+shared" and "routed"
    (of a MoE layer)."""
    n, d, h = batch * length, cfg.hidden_size, cfg.num_attention_heads
    qk, v, r, p, f = cfg.qk_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.moe_intermediate_size
    q_proj = d * cfg.q_lora_rank + cfg.q_lora_rank * h * qk if cfg.q_lora_rank else d * h * qk
    return {
        "projections": 2.0 * n * (q_proj + d * (r + p) + r * h * (cfg.qk_nope_head_dim + v) + h * v * d),
        "attention core": 2.0 * batch * h * length * (length + 1) // 2 * (qk + v),
        "dense mlp": 2.0 * n * 3 * d * cfg.intermediate_size,
        "router+shared": 2.0 * n * (3 * d * f * cfg.n_shared_experts + d * cfg.n_routed_experts),
        "routed": 2.0 * n * cfg.num_experts_per_tok * 3 * d * f,
    }


def attention_activation_elements(cfg: ModelConfig) -> int:
    """Elements per prompt token that one layer's attention holds at its peak in stream-loaded prefill, an upper
    estimate: queries, keys (the fused core also concatenates both), values and output, all per head, and the
    latents."""
    h, qk, v = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
    return h * (4 * qk + 2 * v) + (cfg.q_lora_rank or 0) + 2 * cfg.kv_lora_rank


def kv_elements_per_token(cfg: ModelConfig) -> int:
    """Cache elements one token keeps per layer: MLA's compressed latent and its shared rope key."""
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim


def decode_attention_flops(cfg: ModelConfig, batch: int, context: int) -> float:
    """FLOPs of one layer's decode attention core over `context` cached positions, absorbed as decode runs it:
    per head, scores against the latent and rope key (r + p), then the weighted latent (r)."""
    return 2.0 * batch * cfg.num_attention_heads * context * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
