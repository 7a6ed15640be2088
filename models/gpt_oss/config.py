"""The gpt-oss family's configuration (gpt-oss-20b, gpt-oss-120b), read from a Hugging Face `config.json`, its known
names and the geometries of its released sizes.

GQA with q/k/v/o biases and a learnt sink logit per head, half-split YaRN RoPE over the whole head (truncate false
as released), `layer_types` alternating sliding_attention (a window of `sliding_window` positions) and
full_attention; every layer a MoE: router logits with a bias, top-k, softmax over the chosen logits (= softmax
over all, renormalised); experts with biases and the clamped SwiGLU (swiglu_limit; alpha 1.702, transformers'
default, not in the released config), released as MXFP4.
"""

import dataclasses

from hybridjit.config import ConfigError
from hybridjit.models.common.config import AllMoEGQAConfig, decoder_fields, gqa_fields
from hybridjit.models.common.rope import rope_config

MODEL_TYPES = ("gpt_oss",)
ARCHITECTURES = {"GptOssForCausalLM": "gpt_oss"}  # -> the model_type it implies
NAMES = {"gpt-oss-20b": "openai/gpt-oss-20b", "gpt-oss-120b": "openai/gpt-oss-120b"}
SWIGLU_ALPHA = 1.702  # transformers' GptOssConfig default; the releases do not set it


def _released(layers: int, experts: int) -> dict:
    """A released size's config.json (the two differ in depth and expert count only)."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": layers,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": experts,
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "attention_bias": True,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "swiglu_limit": 7.0,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        "initial_context_length": 4096,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        },
        "eos_token_id": 200002,
        "pad_token_id": 199999,
    }


# The geometries of the released sizes, as their config.json files give them (hybridjit.synthetic).
PRESETS = {"gpt-oss-20b": _released(24, 32), "gpt-oss-120b": _released(36, 128)}
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GptOssConfig(AllMoEGQAConfig):
    sliding_window: int
    layer_types: tuple[str, ...]
    swiglu_limit: float
    swiglu_alpha: float = SWIGLU_ALPHA
    attention_bias: bool = True
    # The router (models/common/routing.py): softmax top-k renormalised, its logits biased (router_bias).
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    use_correction_bias: bool = False

    def window(self, layer: int) -> int | None:
        """The sliding window of a layer, None for full attention."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @property
    def activation(self) -> tuple:
        """The experts' activation (hybridjit.ops.routed_experts.ACTIVATIONS)."""
        return ("clamped_swiglu", self.swiglu_alpha, self.swiglu_limit)

    @property
    def attention_summary(self) -> str:
        sliding = sum(t == "sliding_attention" for t in self.layer_types)
        return (
            f"{super().attention_summary}, sinks, q/k/v/o biases; {sliding} of {len(self.layer_types)} layers "
            f"sliding (window {self.sliding_window})"
        )

    @classmethod
    def from_hf_config(cls, raw: dict, source: str = "config.json") -> "GptOssConfig":
        f = cls.fields(raw, source, MODEL_TYPES)
        common, attention = decoder_fields(f, rms_norm_eps=1e-5), gqa_fields(f)
        layers = common["num_hidden_layers"]
        layer_types = raw.get("layer_types")
        if layer_types is None:  # transformers' default: alternating, sliding first
            layer_types = [LAYER_TYPES[i % 2] for i in range(layers)]
        if not isinstance(layer_types, list) or len(layer_types) != layers or set(layer_types) - set(LAYER_TYPES):
            raise ConfigError(
                f"{source}: layer_types must list {layers} entries of {', '.join(LAYER_TYPES)}, got {layer_types!r}"
            )
        if not f.flag("attention_bias", True):
            raise ConfigError(f"{source}: attention_bias false is not supported for gpt_oss (as released only)")
        quant = raw.get("quantization_config")
        if quant is not None and (not isinstance(quant, dict) or quant.get("quant_method") != "mxfp4"):
            raise ConfigError(f"{source}: quantization_config {quant!r} is not supported for gpt_oss (mxfp4 only)")
        return cls(
            model_type="gpt_oss",
            **common,
            **attention,
            **cls.expert_fields(f),
            sliding_window=f.integer("sliding_window", minimum=1),
            layer_types=tuple(layer_types),
            swiglu_limit=f.number("swiglu_limit", 7.0, above=0),
            swiglu_alpha=f.number("swiglu_alpha", SWIGLU_ALPHA),
            rope=rope_config(f, attention["head_dim"], interleave=False),
        )


CONFIG = GptOssConfig
