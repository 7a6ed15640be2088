"""The model module of the GQA families (Qwen3-MoE, Mixtral, GLM-4.5, MiniMax-M2, gpt-oss): the shared decoder
(models/common/decoder.py) with grouped-query attention (models/common/gqa.py) bound, its KV cache, and
stream-loaded prefill's attention cores (gqa.ChunkedAttention, gqa.fused_attention)."""

from hybridjit.models.common import decoder, gqa

init_cache = gqa.init_cache
ChunkedAttention, CudnnAttention, fused_attention = gqa.ChunkedAttention, gqa.CudnnAttention, gqa.fused_attention
CORE_HEAD_AXES = gqa.CORE_HEAD_AXES
(
    forward, forward_layer, finite_stages, prefill, extend, decode_step, decode_step_dual, decode_step_grouped,
    prefill_attention_layer, decode_attention_layer,
) = (
    decoder.bind(gqa.ATTENTION)
)
