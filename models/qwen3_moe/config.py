"""The Qwen3-MoE family's configuration (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder), read from a Hugging Face
`config.json`, its known names and the geometries of its released sizes.

GQA with per-head QK RMSNorm, half-split RoPE over the whole head, softmax top-k routing (renormalised when
norm_topk_prob), no shared expert; `mlp_only_layers` and `decoder_sparse_step` make some layers dense.
"""

import dataclasses

from hybridjit.config import ConfigError
from hybridjit.models.common.config import GQAConfig, decoder_fields, gqa_fields
from hybridjit.models.common.rope import rope_config

MODEL_TYPES = ("qwen3_moe",)
ARCHITECTURES = {"Qwen3MoeForCausalLM": "qwen3_moe"}  # -> the model_type it implies
NAMES = {
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "qwen3-30b-a3b-instruct-2507": "Qwen/Qwen3-30B-A3B-Instruct-2507",
    "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B",
    "qwen3-235b-a22b-instruct-2507": "Qwen/Qwen3-235B-A22B-Instruct-2507",
    "qwen3-coder-30b-a3b": "Qwen/Qwen3-Coder-30B-A3B-Instruct",
}
_QWEN3_COMMON = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "head_dim": 128,
    "num_key_value_heads": 4,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
# The geometries of the released sizes, as their config.json files give them (hybridjit.synthetic).
PRESETS = {
    "qwen3-30b-a3b": {
        **_QWEN3_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
    },
    "qwen3-235b-a22b": {
        **_QWEN3_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
        "num_experts": 128,
        "num_experts_per_tok": 8,
    },
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3MoeConfig(GQAConfig):
    intermediate_size: int  # of the dense layers (mlp_only_layers, decoder_sparse_step)
    moe_intermediate_size: int
    n_routed_experts: int  # num_experts in config.json
    num_experts_per_tok: int
    norm_topk_prob: bool
    mlp_only_layers: tuple[int, ...]
    decoder_sparse_step: int
    # The router (models/common/routing.py): softmax over all experts, plain top-k, no groups, no scaling.
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    use_correction_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf_config(cls, raw: dict, source: str = "config.json") -> "Qwen3MoeConfig":
        f = cls.fields(raw, source, MODEL_TYPES)
        if f.flag("use_sliding_window", False):
            raise ConfigError(f"{source}: use_sliding_window=true is not supported for qwen3_moe")
        common, attention = decoder_fields(f), gqa_fields(f)
        layers = common["num_hidden_layers"]
        # Released config.json files say num_experts; transformers writes its alias num_local_experts.
        experts = f.integer("num_experts", None, minimum=1) or f.integer("num_local_experts", minimum=1)
        only = raw.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(type(i) is int and 0 <= i < layers for i in only):
            raise ConfigError(
                f"{source}: mlp_only_layers must be a list of layer indices in 0..{layers - 1}, got {only!r}"
            )
        return cls(
            model_type="qwen3_moe",
            **common,
            **attention,
            intermediate_size=f.integer("intermediate_size", minimum=1),
            moe_intermediate_size=f.integer("moe_intermediate_size", minimum=1),
            n_routed_experts=experts,
            num_experts_per_tok=f.integer("num_experts_per_tok", minimum=1, maximum=(experts, "num_experts")),
            norm_topk_prob=f.flag("norm_topk_prob", False),
            mlp_only_layers=tuple(sorted(only)),
            decoder_sparse_step=f.integer("decoder_sparse_step", 1, minimum=1),
            attention_bias=f.flag("attention_bias", False),
            rope=rope_config(f, attention["head_dim"], interleave=False),
        )


CONFIG = Qwen3MoeConfig
