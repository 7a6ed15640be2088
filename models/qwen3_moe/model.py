"""The Qwen3-MoE family as pure JAX functions: grouped-query attention with per-head QK RMSNorm
(models/common/gqa.py) in the shared decoder (models/common/decoder.py)."""

from hybridjit.models.common import decoder, gqa

init_cache = gqa.init_cache
forward, forward_layer, finite_stages, prefill, decode_step, decode_step_dual, prefill_attention_layer = decoder.bind(
    gqa.ATTENTION
)
