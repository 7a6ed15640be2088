"""The gpt-oss family (gpt-oss-20b, gpt-oss-120b): grouped-query attention with q/k/v/o biases, attention sinks and
alternating sliding-window / full layers, every layer a MoE whose router has a bias and whose experts, released
in MXFP4 with biases and a clamped SwiGLU, run as stored on the CPU kernels. The family interface of
models/registry.py: config, model, ckpt, cost; its model and cost are the GQA families' own
(models/common/gqa_decoder.py, gqa_cost.py): sinks and windows are per-layer data of the attention weights.
"""

from hybridjit.models.common import gqa_cost as cost
from hybridjit.models.common import gqa_decoder as model
from hybridjit.models.gpt_oss import ckpt, config

__all__ = ["ckpt", "config", "cost", "model"]
