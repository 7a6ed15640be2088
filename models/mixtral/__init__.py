"""The Mixtral family (Mixtral-8x7B, Mixtral-8x22B): grouped-query attention, every layer a MoE of 8 experts with
softmax top-2 routing. The family interface of models/registry.py: config, model, ckpt, cost; its model and cost
are the GQA families' own (models/common/gqa_decoder.py, gqa_cost.py).
"""

from hybridjit.models.common import gqa_cost as cost
from hybridjit.models.common import gqa_decoder as model
from hybridjit.models.mixtral import ckpt, config

__all__ = ["ckpt", "config", "cost", "model"]
