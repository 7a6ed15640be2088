"""The model module of the GQA families (Qwen3-MoE, Mixtral): the shared decoder (models/common/decoder.py) with
grouped-query attention (models/common/gqa.py) bound, and its KV cache."""

from hybridjit.models.common import decoder, gqa

init_cache = gqa.init_cache
(
    forward, forward_layer, finite_stages, prefill, extend, decode_step, decode_step_dual, decode_step_grouped,
    prefill_attention_layer,
) = (
    decoder.bind(gqa.ATTENTION)
)
