"""The Qwen3-MoE family's configuration (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder), read from a Hugging Face
`config.json`, its known names and the geometries of its released sizes.

GQA with per-head QK RMSNorm, half-split RoPE over the whole head, softmax top-k routing (renormalised when
norm_topk_prob), no shared expert; `mlp_only_layers` and `decoder_sparse_step` make some layers dense.
"""

import dataclasses

from hybridjit.config import ConfigError, ConfigFields, Fp8Config, IntQuantConfig, fp8_config, int_config
from hybridjit.models.common.rope import RopeConfig, rope_config

MODEL_TYPES = ("qwen3_moe",)
ARCHITECTURES = ("Qwen3MoeForCausalLM",)
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


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # of the dense layers (mlp_only_layers, decoder_sparse_step)
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    n_routed_experts: int  # num_experts in config.json
    num_experts_per_tok: int
    norm_topk_prob: bool
    mlp_only_layers: tuple[int, ...]
    decoder_sparse_step: int
    rms_norm_eps: float
    max_position_embeddings: int
    attention_bias: bool
    tie_word_embeddings: bool
    rope: RopeConfig
    fp8: Fp8Config | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    int_quant: IntQuantConfig | None = None
    num_nextn_predict_layers: int = 0
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

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    @classmethod
    def from_hf_config(cls, raw: dict, source: str = "config.json") -> "Qwen3MoeConfig":
        f = ConfigFields(raw, source)
        if f.text("model_type", None) not in MODEL_TYPES:
            raise ConfigError(f"{source}: model_type {raw.get('model_type')!r} is not qwen3_moe")
        if f.text("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (silu only)")
        if f.flag("use_sliding_window", False):
            raise ConfigError(f"{source}: use_sliding_window=true is not supported for qwen3_moe")
        layers = f.integer("num_hidden_layers", minimum=1)
        heads = f.integer("num_attention_heads", minimum=1)
        kv_heads = f.integer("num_key_value_heads", heads, minimum=1, maximum=(heads, "num_attention_heads"))
        if heads % kv_heads:
            raise ConfigError(
                f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        hidden = f.integer("hidden_size", minimum=1)
        head_dim = f.integer("head_dim", hidden // heads, minimum=2)
        if head_dim % 2:
            raise ConfigError(f"{source}: head_dim must be even (rope rotates pairs), got {head_dim}")
        # Released config.json files say num_experts; transformers writes its alias num_local_experts.
        experts = f.integer("num_experts", None, minimum=1) or f.integer("num_local_experts", minimum=1)
        vocab = f.integer("vocab_size", minimum=1)
        only = raw.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(type(i) is int and 0 <= i < layers for i in only):
            raise ConfigError(
                f"{source}: mlp_only_layers must be a list of layer indices in 0..{layers - 1}, got {only!r}"
            )
        return cls(
            model_type="qwen3_moe",
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=f.integer("intermediate_size", minimum=1),
            moe_intermediate_size=f.integer("moe_intermediate_size", minimum=1),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            n_routed_experts=experts,
            num_experts_per_tok=f.integer("num_experts_per_tok", minimum=1, maximum=(experts, "num_experts")),
            norm_topk_prob=f.flag("norm_topk_prob", False),
            mlp_only_layers=tuple(sorted(only)),
            decoder_sparse_step=f.integer("decoder_sparse_step", 1, minimum=1),
            rms_norm_eps=f.number("rms_norm_eps", 1e-6, above=0),
            max_position_embeddings=f.integer("max_position_embeddings", minimum=1),
            attention_bias=f.flag("attention_bias", False),
            tie_word_embeddings=f.flag("tie_word_embeddings", False),
            rope=rope_config(f, head_dim, interleave=False),
            fp8=fp8_config(f),
            bos_token_id=f.token_id("bos_token_id", vocab),
            eos_token_ids=f.token_ids("eos_token_id", vocab),
            int_quant=int_config(f),
        )


CONFIG = Qwen3MoeConfig
