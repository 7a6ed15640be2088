"""The Qwen3-MoE family (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): grouped-query attention with per-head QK
RMSNorm, softmax top-k routing, no shared expert. The family interface of models/registry.py: config, model,
ckpt, cost; its model and cost are the GQA families' own (models/common/gqa_decoder.py, gqa_cost.py).
"""

from hybridjit.models.common import gqa_cost as cost
from hybridjit.models.common import gqa_decoder as model
from hybridjit.models.qwen3_moe import ckpt, config

__all__ = ["ckpt", "config", "cost", "model"]
