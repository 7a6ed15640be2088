"""The MiniMax-M2 family's configuration, read from a Hugging Face `config.json`, its known names and the
geometry of its released size.

GQA with QK RMSNorm over all heads at once (qk_norm_type per_layer), half-split RoPE over the first rotary_dim
dims of each head, every layer a MoE with sigmoid routing and a correction bias (no groups, no scaling, no
shared expert); released as FP8 with 128x128 block scales, which runs as stored. The MTP modules it declares
(use_mtp) have no tensors in the release.
"""

import dataclasses

from hybridjit.config import ConfigError
from hybridjit.models.common.config import AllMoEGQAConfig, decoder_fields, gqa_fields
from hybridjit.models.common.rope import rope_config

MODEL_TYPES = ("minimax_m2",)
ARCHITECTURES = {"MiniMaxM2ForCausalLM": "minimax_m2"}  # -> the model_type it implies
NAMES = {"minimax-m2": "MiniMaxAI/MiniMax-M2"}
# The geometry of the released size (hybridjit.synthetic), from its config.json.
PRESETS = {
    "minimax-m2": {
        "architectures": ["MiniMaxM2ForCausalLM"],
        "model_type": "minimax_m2",
        "vocab_size": 200064,
        "hidden_size": 3072,
        "intermediate_size": 1536,
        "num_hidden_layers": 62,
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rotary_dim": 64,
        "num_local_experts": 256,
        "num_experts_per_tok": 8,
        "scoring_func": "sigmoid",
        "use_routing_bias": True,
        "use_qk_norm": True,
        "qk_norm_type": "per_layer",
        "shared_intermediate_size": 0,
        "rms_norm_eps": 1e-6,
        "rope_theta": 5000000,
        "max_position_embeddings": 196608,
        "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]},
        "bos_token_id": 200034,
        "eos_token_id": 200020,
    },
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MiniMaxM2Config(AllMoEGQAConfig):
    # The router (models/common/routing.py): sigmoid, correction bias for the choice, weights renormalised.
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    use_correction_bias: bool = True

    @classmethod
    def from_hf_config(cls, raw: dict, source: str = "config.json") -> "MiniMaxM2Config":
        f = cls.fields(raw, source, MODEL_TYPES)
        unsupported = {
            "scoring_func": f.text("scoring_func", "sigmoid") != "sigmoid",
            "use_routing_bias": not f.flag("use_routing_bias", True),
            "use_qk_norm": not f.flag("use_qk_norm", True),
            "qk_norm_type": f.text("qk_norm_type", "per_layer") != "per_layer",
            "shared_intermediate_size": bool(f.integer("shared_intermediate_size", 0, minimum=0)),
            "sliding_window": f.integer("sliding_window", None, minimum=1) is not None,
            "attn_type_list": any(t != 1 for t in raw.get("attn_type_list") or []),
        }
        for field, bad in unsupported.items():
            if bad:
                raise ConfigError(f"{source}: {field} of this value is not supported for minimax_m2 (as released only)")
        common, attention = decoder_fields(f), gqa_fields(f)
        rotary = f.integer("rotary_dim", attention["head_dim"], minimum=2, maximum=(attention["head_dim"], "head_dim"))
        if rotary % 2:
            raise ConfigError(f"{source}: rotary_dim must be even (rope rotates pairs), got {rotary}")
        return cls(
            model_type="minimax_m2",
            **common,
            **attention,
            **cls.expert_fields(f),
            rope=rope_config(f, rotary, interleave=False),
        )


CONFIG = MiniMaxM2Config
