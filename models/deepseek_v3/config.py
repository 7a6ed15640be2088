"""The DeepSeek-V3 family's configuration (DeepSeek-V2, V2-Lite, V3, R1, V3.1, Kimi-K2), read from a Hugging Face
`config.json`, its known names and the geometries of its released sizes.

One frozen, hashable dataclass serves every checkpoint of the family: they differ only in values (router
scoring, q_lora_rank, rope scaling), so the model code branches on fields, never on the model name. Being
hashable, it is a static argument of jit.
"""

import dataclasses

from hybridjit.config import ConfigError
from hybridjit.models.common.config import DecoderConfig, decoder_fields
from hybridjit.models.common.rope import RopeConfig, rope_config, yarn_mscale
from hybridjit.models.common.routing import grouped_routing_fields

MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "kimi_k2")
# Hugging Face architectures -> the model_type they imply where a config.json omits it.
ARCHITECTURES = {"DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV2ForCausalLM": "deepseek_v2"}
# The geometries of the released sizes, as their Hugging Face config.json files give them (benchmarks build
# random checkpoints of them: hybridjit.synthetic).
PRESETS = {
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "n_group": 8,
        "topk_group": 4,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
    },
    "deepseek-v2-lite": {
        "model_type": "deepseek_v2",
        "vocab_size": 102400,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "first_k_dense_replace": 1,
        "topk_method": "greedy",
        "scoring_func": "softmax",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        "bos_token_id": 100000,
        "eos_token_id": 100001,
        "tie_word_embeddings": False,
    },
}
# Names that resolve to a checkpoint on disk (hybridjit.resolve), by Hugging Face repo id.
NAMES = {
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "deepseek-v3-0324": "deepseek-ai/DeepSeek-V3-0324",
    "deepseek-v3.1": "deepseek-ai/DeepSeek-V3.1",
    "deepseek-r1": "deepseek-ai/DeepSeek-R1",
    "deepseek-r1-0528": "deepseek-ai/DeepSeek-R1-0528",
    "deepseek-v2": "deepseek-ai/DeepSeek-V2",
    "deepseek-v2-lite": "deepseek-ai/DeepSeek-V2-Lite",
    "deepseek-v2-lite-chat": "deepseek-ai/DeepSeek-V2-Lite-Chat",
    "kimi-k2": "moonshotai/Kimi-K2-Instruct",
}
ROUTER_METHODS = {
    # topk_method -> scoring function it implies
    "noaux_tc": "sigmoid",  # V3/R1/Kimi-K2: sigmoid, correction bias, group-limited by top-2 sums
    "greedy": "softmax",  # V2-Lite: plain top-k of softmax
    "group_limited_greedy": "softmax",  # V2: groups ranked by their max score
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepseekV3Config(DecoderConfig):
    intermediate_size: int
    moe_intermediate_size: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    topk_method: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    attention_bias: bool
    rope: RopeConfig

    @property
    def attention_summary(self) -> str:
        """One line for `hybridjit info`."""
        return (
            f"MLA: {self.num_attention_heads} heads, q_lora {self.q_lora_rank}, kv_lora {self.kv_lora_rank}, "
            f"nope/rope/v {self.qk_nope_head_dim}/{self.qk_rope_head_dim}/{self.v_head_dim}"
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scoring_func(self) -> str:
        return ROUTER_METHODS[self.topk_method]

    @property
    def use_correction_bias(self) -> bool:
        return self.topk_method == "noaux_tc"

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-1/2, times YaRN's mscale(factor, mscale_all_dim)^2 when rope is scaled."""
        scale = self.qk_head_dim**-0.5
        if self.rope.yarn_factor is not None and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.yarn_factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    @classmethod
    def from_hf_config(cls, raw: dict, source: str = "config.json") -> "DeepseekV3Config":
        f = cls.fields(raw, source, MODEL_TYPES)
        model_type = f.text("model_type", None)
        topk_method = f.text("topk_method", "noaux_tc" if model_type != "deepseek_v2" else "greedy")
        if topk_method not in ROUTER_METHODS:
            raise ConfigError(
                f"{source}: topk_method {topk_method!r} is not supported ({', '.join(ROUTER_METHODS)})"
            )
        scoring = f.text("scoring_func", ROUTER_METHODS[topk_method])
        if scoring != ROUTER_METHODS[topk_method]:
            raise ConfigError(
                f"{source}: scoring_func {scoring!r} with topk_method {topk_method!r} is not supported"
            )
        if raw.get("moe_layer_freq", 1) != 1:
            raise ConfigError(f"{source}: moe_layer_freq {raw['moe_layer_freq']} is not supported (1 only)")
        if raw.get("mlp_bias"):
            raise ConfigError(f"{source}: mlp_bias=true is not supported")

        common = decoder_fields(f)
        layers = common["num_hidden_layers"]
        routing = grouped_routing_fields(f, topk_method)
        rope_dim = f.integer("qk_rope_head_dim", minimum=1)
        if rope_dim % 2:
            raise ConfigError(f"{source}: qk_rope_head_dim must be even (rope rotates pairs), got {rope_dim}")
        return cls(
            model_type=model_type,
            **common,
            **routing,
            intermediate_size=f.integer("intermediate_size", minimum=1),
            moe_intermediate_size=f.integer("moe_intermediate_size", minimum=1),
            num_attention_heads=f.integer("num_attention_heads", minimum=1),
            q_lora_rank=f.integer("q_lora_rank", None, minimum=1),
            kv_lora_rank=f.integer("kv_lora_rank", minimum=1),
            qk_nope_head_dim=f.integer("qk_nope_head_dim", minimum=1),
            qk_rope_head_dim=rope_dim,
            v_head_dim=f.integer("v_head_dim", minimum=1),
            first_k_dense_replace=f.integer(
                "first_k_dense_replace", 0, minimum=0, maximum=(layers, "num_hidden_layers")
            ),
            topk_method=topk_method,
            norm_topk_prob=f.flag("norm_topk_prob", False),
            attention_bias=f.flag("attention_bias", False),
            rope=rope_config(f, rope_dim),
            num_nextn_predict_layers=f.integer("num_nextn_predict_layers", 0, minimum=0),
        )





CONFIG = DeepseekV3Config
