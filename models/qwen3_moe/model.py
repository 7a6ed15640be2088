"""The Qwen3-MoE family as pure JAX functions: grouped-query attention with per-head QK RMSNorm
(models/common/gqa.py) in the shared decoder (models/common/decoder.py)."""

from hybridjit.models.common import decoder, gqa

ATTENTION = decoder.Attention(prefill=gqa.prefill, write_prompt=gqa.write_prompt, decode=gqa.decode, causal=gqa.causal)
PROGRAMS = decoder.Programs(ATTENTION)
init_cache = gqa.init_cache
forward = PROGRAMS.forward
forward_layer = PROGRAMS.forward_layer
finite_stages = PROGRAMS.finite_stages
prefill = PROGRAMS.prefill
decode_step = PROGRAMS.decode_step
decode_step_dual = PROGRAMS.decode_step_dual
prefill_attention_layer = PROGRAMS.prefill_attention_layer
