"""The static model configuration, read from a Hugging Face `config.json`.

One frozen, hashable dataclass serves every DeepSeek-V3-family checkpoint (DeepSeek-V2, V2-Lite, V3, R1,
V3.1, Kimi-K2): the families differ only in values (router scoring, q_lora_rank, rope scaling), so the
model code branches on fields, never on the family name. Being hashable, it is a static argument of jit.
"""

import dataclasses
import json
import math
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "kimi_k2")
ROUTER_METHODS = {
    # topk_method -> scoring function it implies
    "noaux_tc": "sigmoid",  # V3/R1/Kimi-K2: sigmoid, correction bias, group-limited by top-2 sums
    "greedy": "softmax",  # V2-Lite: plain top-k of softmax
    "group_limited_greedy": "softmax",  # V2: groups ranked by their max score
}


class ConfigError(ValueError):
    """A config.json this engine cannot run, with the file and the field named."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float
    dim: int  # qk_rope_head_dim
    interleave: bool
    # YaRN (None when the checkpoint uses plain RoPE)
    yarn_factor: float | None = None
    original_max_position: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    block: tuple[int, int]


@dataclasses.dataclass(frozen=True)
class IntQuantConfig:
    """Routed experts stored as int8 or int4 with a float32 scale per row and group of input columns
    (quantization_config {"quant_method": "hybridjit_int", "bits": 8 | 4, "group_size": G}; the format is
    defined in hybridjit/convert.py)."""

    bits: int
    group_size: int

    def stored_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        """[out, in] as stored: int4 packs two values per byte."""
        return (shape[0], -(-shape[1] // 2)) if self.bits == 4 else shape

    def scale_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        return shape[0], -(-shape[1] // self.group_size)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
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
    rms_norm_eps: float
    max_position_embeddings: int
    attention_bias: bool
    tie_word_embeddings: bool
    rope: RopeConfig
    fp8: Fp8Config | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    int_quant: IntQuantConfig | None = None

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
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no config.json; a checkpoint directory must contain one") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_config(raw, source=str(path))

    @classmethod
    def from_hf_config(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        def need(key):
            if key not in raw or raw[key] is None:
                raise ConfigError(f"{source}: required field '{key}' is missing")
            return raw[key]

        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        topk_method = raw.get("topk_method") or ("noaux_tc" if model_type != "deepseek_v2" else "greedy")
        if topk_method not in ROUTER_METHODS:
            raise ConfigError(
                f"{source}: topk_method {topk_method!r} is not supported ({', '.join(ROUTER_METHODS)})"
            )
        scoring = raw.get("scoring_func") or ROUTER_METHODS[topk_method]
        if scoring != ROUTER_METHODS[topk_method]:
            raise ConfigError(
                f"{source}: scoring_func {scoring!r} with topk_method {topk_method!r} is not supported"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (silu only)")
        if raw.get("moe_layer_freq", 1) != 1:
            raise ConfigError(f"{source}: moe_layer_freq {raw['moe_layer_freq']} is not supported (1 only)")
        if raw.get("mlp_bias"):
            raise ConfigError(f"{source}: mlp_bias=true is not supported")

        n_routed = int(need("n_routed_experts"))
        n_group = int(raw.get("n_group") or 1)
        if n_routed % n_group:
            raise ConfigError(f"{source}: n_routed_experts {n_routed} is not divisible by n_group {n_group}")
        top_k = int(need("num_experts_per_tok"))
        if not 0 < top_k <= n_routed:
            raise ConfigError(f"{source}: num_experts_per_tok {top_k} must be in 1..n_routed_experts")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=int(need("num_attention_heads")),
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=int(need("kv_lora_rank")),
            qk_nope_head_dim=int(need("qk_nope_head_dim")),
            qk_rope_head_dim=int(need("qk_rope_head_dim")),
            v_head_dim=int(need("v_head_dim")),
            n_routed_experts=n_routed,
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            num_experts_per_tok=top_k,
            first_k_dense_replace=int(raw.get("first_k_dense_replace", 0)),
            topk_method=topk_method,
            n_group=n_group,
            topk_group=int(raw.get("topk_group") or n_group),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(need("max_position_embeddings")),
            attention_bias=bool(raw.get("attention_bias", False)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope=_rope_config(raw, source),
            fp8=_fp8_config(raw, source),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            int_quant=_int_config(raw, source),
        )


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_config(raw: dict, source: str) -> RopeConfig:
    # Real DeepSeek configs use the legacy key "rope_scaling" ({"type": "yarn", ...}); newer ones
    # "rope_parameters" ({"rope_type": ..., "rope_theta": ...}).
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta") or raw.get("rope_theta") or 10000.0)
    base = dict(
        theta=theta, dim=int(raw["qk_rope_head_dim"]), interleave=bool(raw.get("rope_interleave", True))
    )
    if rope_type == "default":
        return RopeConfig(**base)
    if rope_type != "yarn":
        raise ConfigError(f"{source}: rope type {rope_type!r} is not supported (default, yarn)")
    if "original_max_position_embeddings" not in params:
        raise ConfigError(f"{source}: yarn rope scaling needs original_max_position_embeddings")
    return RopeConfig(
        **base,
        yarn_factor=float(params["factor"]),
        original_max_position=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def _fp8_config(raw: dict, source: str) -> Fp8Config | None:
    q = raw.get("quantization_config")
    if not q or q.get("quant_method") == INT_QUANT_METHOD:
        return None
    if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(
            f"{source}: quantization_config {q} is not supported (fp8 e4m3 with block scales only)"
        )
    block = q.get("weight_block_size")
    if not block or len(block) != 2:
        raise ConfigError(f"{source}: fp8 quantization_config needs weight_block_size [rows, cols]")
    return Fp8Config(block=(int(block[0]), int(block[1])))


INT_QUANT_METHOD = "hybridjit_int"


def _int_config(raw: dict, source: str) -> IntQuantConfig | None:
    q = raw.get("quantization_config")
    if not q or q.get("quant_method") != INT_QUANT_METHOD:
        return None
    bits, group = q.get("bits"), q.get("group_size")
    if bits not in (4, 8) or not isinstance(group, int) or group <= 0 or group % 128:
        raise ConfigError(
            f"{source}: quantization_config {q} is not supported: bits must be 8 or 4 and group_size a "
            "positive multiple of 128"
        )
    return IntQuantConfig(bits=bits, group_size=group)
