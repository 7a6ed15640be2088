"""The GLM-4.5 family (GLM-4.5, GLM-4.5-Air): grouped-query attention with partial rotary and q/k/v biases,
DeepSeek-V3's sigmoid routing with correction bias and group limits, a shared expert, dense first layers. The
family interface of models/registry.py: config, model, ckpt, cost; its model and cost are the GQA families' own
(models/common/gqa_decoder.py, gqa_cost.py).
"""

from hybridjit.models.common import gqa_cost as cost
from hybridjit.models.common import gqa_decoder as model
from hybridjit.models.glm4_moe import ckpt, config

__all__ = ["ckpt", "config", "cost", "model"]
