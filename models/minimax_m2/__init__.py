"""The MiniMax-M2 family: grouped-query attention with QK norms over all heads and partial rotary, every layer a
MoE with sigmoid routing and a correction bias, released as block-scaled FP8. The family interface of
models/registry.py: config, model, ckpt, cost; its model and cost are the GQA families' own
(models/common/gqa_decoder.py, gqa_cost.py).
"""

from hybridjit.models.common import gqa_cost as cost
from hybridjit.models.common import gqa_decoder as model
from hybridjit.models.minimax_m2 import ckpt, config

__all__ = ["ckpt", "config", "cost", "model"]
