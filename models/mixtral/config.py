"""The Mixtral family's configuration (Mixtral-8x7B, Mixtral-8x22B), read from a Hugging Face `config.json`, its
known names and the geometries of its released sizes.

GQA without QK norms, half-split RoPE over the whole head, every layer a MoE of 8 experts whose top 2 by softmax
are renormalised; no shared expert. `intermediate_size` is the experts' size; `sliding_window`, when set,
windows every layer.
"""

import dataclasses

from hybridjit.models.common.config import AllMoEGQAConfig, decoder_fields, gqa_fields
from hybridjit.models.common.rope import rope_config

MODEL_TYPES = ("mixtral",)
ARCHITECTURES = {"MixtralForCausalLM": "mixtral"}  # -> the model_type it implies
NAMES = {
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1",
    "mixtral-8x7b-instruct": "mistralai/Mixtral-8x7B-Instruct-v0.1",
    "mixtral-8x22b": "mistralai/Mixtral-8x22B-v0.1",
    "mixtral-8x22b-instruct": "mistralai/Mixtral-8x22B-Instruct-v0.1",
}
_MIXTRAL_COMMON = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# The geometries of the released sizes, as their config.json files give them (hybridjit.synthetic).
PRESETS = {
    "mixtral-8x7b": {
        **_MIXTRAL_COMMON,
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "max_position_embeddings": 32768,
    },
    "mixtral-8x22b": {
        **_MIXTRAL_COMMON,
        "vocab_size": 32000,
        "hidden_size": 6144,
        "intermediate_size": 16384,
        "num_hidden_layers": 56,
        "num_attention_heads": 48,
        "max_position_embeddings": 65536,
    },
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtralConfig(AllMoEGQAConfig):
    sliding_window: int | None
    # The router (models/common/routing.py): softmax over all experts, top-k renormalised.
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    use_correction_bias: bool = False

    def window(self, layer: int) -> int | None:
        return self.sliding_window

    @classmethod
    def from_hf_config(cls, raw: dict, source: str = "config.json") -> "MixtralConfig":
        f = cls.fields(raw, source, MODEL_TYPES)
        common, attention = decoder_fields(f, rms_norm_eps=1e-5), gqa_fields(f)
        return cls(
            model_type="mixtral",
            **common,
            **attention,
            **cls.expert_fields(f),
            sliding_window=f.integer("sliding_window", None, minimum=1),
            rope=rope_config(f, attention["head_dim"], interleave=False),
        )


CONFIG = MixtralConfig
