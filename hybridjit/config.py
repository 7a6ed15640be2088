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
    # Multi-token-prediction layers stored after the decoder layers (model.layers.{num_hidden_layers}.* on):
    # the model does not run them; loading skips their tensors.
    num_nextn_predict_layers: int = 0

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
        f = _Fields(raw, source)
        model_type = f.text("model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
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
        if f.text("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (silu only)")
        if raw.get("moe_layer_freq", 1) != 1:
            raise ConfigError(f"{source}: moe_layer_freq {raw['moe_layer_freq']} is not supported (1 only)")
        if raw.get("mlp_bias"):
            raise ConfigError(f"{source}: mlp_bias=true is not supported")

        layers = f.integer("num_hidden_layers", minimum=1)
        n_routed, n_group = f.integer("n_routed_experts", minimum=1), f.integer("n_group", 1, minimum=1)
        if n_routed % n_group:
            raise ConfigError(f"{source}: n_routed_experts {n_routed} is not divisible by n_group {n_group}")
        topk_group = f.integer("topk_group", n_group, minimum=1, maximum=(n_group, "n_group"))
        top_k = f.integer("num_experts_per_tok", minimum=1, maximum=(n_routed, "n_routed_experts"))
        _check_group_limits(source, topk_method, n_routed, n_group, topk_group, top_k)
        vocab = f.integer("vocab_size", minimum=1)
        rope_dim = f.integer("qk_rope_head_dim", minimum=1)
        if rope_dim % 2:
            raise ConfigError(f"{source}: qk_rope_head_dim must be even (rope rotates pairs), got {rope_dim}")
        return cls(
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=f.integer("hidden_size", minimum=1),
            intermediate_size=f.integer("intermediate_size", minimum=1),
            moe_intermediate_size=f.integer("moe_intermediate_size", minimum=1),
            num_hidden_layers=layers,
            num_attention_heads=f.integer("num_attention_heads", minimum=1),
            q_lora_rank=f.integer("q_lora_rank", None, minimum=1),
            kv_lora_rank=f.integer("kv_lora_rank", minimum=1),
            qk_nope_head_dim=f.integer("qk_nope_head_dim", minimum=1),
            qk_rope_head_dim=rope_dim,
            v_head_dim=f.integer("v_head_dim", minimum=1),
            n_routed_experts=n_routed,
            n_shared_experts=f.integer("n_shared_experts", 0, minimum=0),
            num_experts_per_tok=top_k,
            first_k_dense_replace=f.integer(
                "first_k_dense_replace", 0, minimum=0, maximum=(layers, "num_hidden_layers")
            ),
            topk_method=topk_method,
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=f.flag("norm_topk_prob", False),
            routed_scaling_factor=f.number("routed_scaling_factor", 1.0, above=0),
            rms_norm_eps=f.number("rms_norm_eps", 1e-6, above=0),
            max_position_embeddings=f.integer("max_position_embeddings", minimum=1),
            attention_bias=f.flag("attention_bias", False),
            tie_word_embeddings=f.flag("tie_word_embeddings", False),
            rope=_rope_config(f, rope_dim),
            fp8=_fp8_config(f),
            bos_token_id=f.token_id("bos_token_id", vocab),
            eos_token_ids=f.token_ids("eos_token_id", vocab),
            int_quant=_int_config(f),
            num_nextn_predict_layers=f.integer("num_nextn_predict_layers", 0, minimum=0),
        )


_REQUIRED = object()


class _Fields:
    """Typed reads of a config.json object's fields: each error names the file, the field and what is allowed.

    Values are never coerced (a string "12" is not the integer 12, nor "false" a false flag): a value of the
    wrong type is an error, as is a number out of its range. An absent or null field takes its default.
    """

    def __init__(self, raw, source: str, prefix: str = ""):
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: must hold a JSON object of fields, got {raw!r:.60}")
        self.raw, self.source, self.prefix = raw, source, prefix

    def error(self, key: str, allowed: str, value) -> ConfigError:
        return ConfigError(f"{self.source}: {self.prefix}{key} must be {allowed}, got {value!r}")

    def _value(self, key: str, default, kinds: tuple[type, ...], allowed: str):
        value = self.raw.get(key)
        if value is None:
            if default is _REQUIRED:
                raise ConfigError(f"{self.source}: required field '{self.prefix}{key}' is missing")
            return None
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise self.error(key, allowed, value)
        return value

    def integer(self, key: str, default=_REQUIRED, minimum: int | None = None, maximum: tuple[int, str] | None = None):
        """An integer (not a bool) >= minimum and, with maximum = (bound, its field's name), <= bound."""
        value = self._value(key, default, (int,), "an integer")
        if value is None:
            return default
        if maximum is not None and not minimum <= value <= maximum[0]:
            raise self.error(key, f"an integer in {minimum}..{maximum[0]} ({maximum[1]})", value)
        if minimum is not None and value < minimum:
            raise self.error(key, "a positive integer" if minimum == 1 else f"an integer >= {minimum}", value)
        return value

    def number(self, key: str, default=_REQUIRED, *, above: float | None = None, at_least: float | None = None):
        """A finite number (int or float) > `above` or >= `at_least` when given, as float."""
        value = self._value(key, default, (int, float), "a number")
        if value is None:
            return default
        bound = f" > {above}" if above is not None else f" >= {at_least}" if at_least is not None else ""
        if not math.isfinite(value) or (above is not None and value <= above) or (
            at_least is not None and value < at_least
        ):
            raise self.error(key, f"a finite number{bound}", value)
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._value(key, default, (bool,), "true or false")
        return default if value is None else value

    def text(self, key: str, default: str | None) -> str | None:
        value = self._value(key, default, (str,), "a string")
        return default if value is None else value

    def section(self, key: str) -> "_Fields | None":
        """A nested object's fields, or None when absent."""
        value = self._value(key, None, (dict,), "an object")
        return None if value is None else _Fields(value, self.source, f"{self.prefix}{key}.")

    def token_id(self, key: str, vocab_size: int) -> int | None:
        value = self.integer(key, None)
        if value is not None and not 0 <= value < vocab_size:
            raise self.error(key, f"a token id in 0..{vocab_size - 1} (vocab_size - 1)", value)
        return value

    def token_ids(self, key: str, vocab_size: int) -> tuple[int, ...]:
        """An integer or a list of integers (several end-of-sequence tokens), each a token id."""
        value = self.raw.get(key)
        ids = value if isinstance(value, list) else [] if value is None else [value]
        if any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
            raise self.error(key, "an integer or a list of integers", value)
        for i in ids:
            if not 0 <= i < vocab_size:
                raise self.error(key, f"a token id in 0..{vocab_size - 1} (vocab_size - 1)", i)
        return tuple(ids)


def _check_group_limits(source: str, method: str, n_routed: int, n_group: int, topk_group: int, top_k: int):
    """Group-limited routing keeps only the experts of topk_group groups: they must be enough to choose from."""
    if method not in ("noaux_tc", "group_limited_greedy") or n_group == 1:
        return
    per_group = n_routed // n_group
    if method == "noaux_tc" and per_group < 2:
        raise ConfigError(
            f"{source}: noaux_tc ranks each group by its top-2 scores: n_routed_experts / n_group must be >= 2, "
            f"got {n_routed} / {n_group}"
        )
    if top_k > topk_group * per_group:
        raise ConfigError(
            f"{source}: num_experts_per_tok {top_k} exceeds the {topk_group * per_group} experts of the topk_group "
            f"{topk_group} groups of {per_group} that routing keeps"
        )


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_config(f: _Fields, dim: int) -> RopeConfig:
    # Real DeepSeek configs use the legacy key "rope_scaling" ({"type": "yarn", ...}); newer ones
    # "rope_parameters" ({"rope_type": ..., "rope_theta": ...}).
    params = f.section("rope_parameters") or f.section("rope_scaling") or _Fields({}, f.source)
    rope_type = params.text("rope_type", None) or params.text("type", "default")
    # theta > 1: the frequencies theta^(-2i/dim) must fall with i, and YaRN divides by log(theta).
    theta = params.number("rope_theta", None, above=1) or f.number("rope_theta", 10000.0, above=1)
    base = dict(theta=theta, dim=dim, interleave=f.flag("rope_interleave", True))
    if rope_type == "default":
        return RopeConfig(**base)
    if rope_type != "yarn":
        raise ConfigError(f"{f.source}: rope type {rope_type!r} is not supported (default, yarn)")
    if "original_max_position_embeddings" not in params.raw:
        raise ConfigError(f"{f.source}: yarn rope scaling needs original_max_position_embeddings")
    return RopeConfig(
        **base,
        yarn_factor=params.number("factor", at_least=1),
        original_max_position=params.integer("original_max_position_embeddings", minimum=1),
        beta_fast=params.number("beta_fast", 32.0, above=0),
        beta_slow=params.number("beta_slow", 1.0, above=0),
        mscale=params.number("mscale", None),
        mscale_all_dim=params.number("mscale_all_dim", None),
        truncate=params.flag("truncate", True),
    )


def _fp8_config(f: _Fields) -> Fp8Config | None:
    q = f.section("quantization_config")
    if q is None or q.raw.get("quant_method") == INT_QUANT_METHOD:
        return None
    if q.raw.get("quant_method") != "fp8" or q.raw.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(
            f"{f.source}: quantization_config {q.raw} is not supported (fp8 e4m3 with block scales only)"
        )
    block = q.raw.get("weight_block_size")
    if not isinstance(block, list) or len(block) != 2 or not all(type(b) is int and b > 0 for b in block):
        raise ConfigError(f"{f.source}: fp8 quantization_config needs weight_block_size [rows, cols], got {block!r}")
    return Fp8Config(block=(block[0], block[1]))


INT_QUANT_METHOD = "hybridjit_int"


def _int_config(f: _Fields) -> IntQuantConfig | None:
    q = f.section("quantization_config")
    if q is None or q.raw.get("quant_method") != INT_QUANT_METHOD:
        return None
    bits, group = q.raw.get("bits"), q.raw.get("group_size")
    if bits not in (4, 8) or type(group) is not int or group <= 0 or group % 128:
        raise ConfigError(
            f"{f.source}: quantization_config {q.raw} is not supported: bits must be 8 or 4 and group_size a "
            "positive multiple of 128"
        )
    return IntQuantConfig(bits=bits, group_size=group)
