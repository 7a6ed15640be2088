"""The GLM-4.5 family's configuration (GLM-4.5, GLM-4.5-Air), read from a Hugging Face `config.json`, its known
names and the geometries of its released sizes.

GQA with q/k/v biases (o_proj has none), per-head QK RMSNorm where use_qk_norm, half-split RoPE over the first
head_dim * partial_rotary_factor dims; dense first layers (first_k_dense_replace); sigmoid routing with a
correction bias and group limits (as DeepSeek-V3's noaux_tc), routed scaling, one shared expert; the MTP layer
(num_nextn_predict_layers) is stored after the decoder layers and skipped.
"""

import dataclasses

from hybridjit.config import ConfigError
from hybridjit.models.common.config import GQAConfig, decoder_fields, gqa_fields
from hybridjit.models.common.rope import rope_config
from hybridjit.models.common.routing import grouped_routing_fields

MODEL_TYPES = ("glm4_moe",)
ARCHITECTURES = {"Glm4MoeForCausalLM": "glm4_moe"}  # -> the model_type it implies
NAMES = {"glm-4.5": "zai-org/GLM-4.5", "glm-4.5-air": "zai-org/GLM-4.5-Air"}
_GLM_COMMON = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "vocab_size": 151552,
    "head_dim": 128,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "partial_rotary_factor": 0.5,
    "attention_bias": True,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000,
    "max_position_embeddings": 131072,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "eos_token_id": [151329, 151336, 151338],
}
# The geometries of the released sizes (hybridjit.synthetic), from their config.json files.
PRESETS = {
    "glm-4.5": {
        **_GLM_COMMON,
        "hidden_size": 5120,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 92,
        "n_routed_experts": 160,
        "first_k_dense_replace": 3,
        "use_qk_norm": True,
    },
    "glm-4.5-air": {
        **_GLM_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 46,
        "n_routed_experts": 128,
        "first_k_dense_replace": 1,
        "use_qk_norm": False,
    },
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Glm4MoeConfig(GQAConfig):
    intermediate_size: int  # of the dense layers
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    use_qk_norm: bool
    # The router (models/common/routing.py): DeepSeek-V3's noaux_tc.
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    use_correction_bias: bool = True

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @classmethod
    def from_hf_config(cls, raw: dict, source: str = "config.json") -> "Glm4MoeConfig":
        f = cls.fields(raw, source, MODEL_TYPES)
        common, attention = decoder_fields(f, rms_norm_eps=1e-5), gqa_fields(f)
        layers = common["num_hidden_layers"]
        routing = grouped_routing_fields(f, "noaux_tc")
        # transformers reads partial_rotary_factor from rope_parameters too; released files have it at the top.
        factor = f.number("partial_rotary_factor", 0.5, above=0)
        rotated = int(attention["head_dim"] * factor)
        if rotated % 2 or factor > 1:
            raise ConfigError(f"{source}: partial_rotary_factor {factor} must rotate an even part of head_dim")
        return cls(
            model_type="glm4_moe",
            **common,
            **attention,
            **routing,
            intermediate_size=f.integer("intermediate_size", minimum=1),
            moe_intermediate_size=f.integer("moe_intermediate_size", minimum=1),
            first_k_dense_replace=f.integer(
                "first_k_dense_replace", 0, minimum=0, maximum=(layers, "num_hidden_layers")
            ),
            norm_topk_prob=f.flag("norm_topk_prob", True),
            use_qk_norm=f.flag("use_qk_norm", False),
            attention_bias=f.flag("attention_bias", False),
            rope=rope_config(f, rotated, interleave=False),
            num_nextn_predict_layers=f.integer("num_nextn_predict_layers", 0, minimum=0),
        )


CONFIG = Glm4MoeConfig
