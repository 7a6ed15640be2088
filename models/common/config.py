"""What the runtime and the shared model code read of any family's config, and the readers of the config.json
fields that families share."""

import dataclasses
from typing import Protocol

from hybridjit.config import ConfigError, ConfigFields, Fp8Config, IntQuantConfig, fp8_config, int_config
from hybridjit.models.common.rope import RopeConfig


class ModelConfig(Protocol):
    """What the runtime reads of any family's config (a frozen dataclass: a static argument of jit)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    fp8: Fp8Config | None
    int_quant: IntQuantConfig | None
    num_nextn_predict_layers: int

    # The router's (models/common/routing.py).
    scoring_func: str
    topk_method: str
    use_correction_bias: bool
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    # A line describing the attention, for `hybridjit info`.
    attention_summary: str

    def is_moe_layer(self, layer: int) -> bool: ...

    def window(self, layer: int) -> int | None: ...


def attended(cfg: ModelConfig, layer: int, context: int) -> int:
    """The cached positions a decode token of layer `layer` attends over, and its slot holds there (a sliding-window
    layer keeps its window, a ring, whatever the context), at `context` positions."""
    return min(cfg.window(layer) or context, context)


def decoder_fields(f: ConfigFields, *, rms_norm_eps: float = 1e-6) -> dict:
    """The fields every family reads the same way from its config.json, by their ModelConfig names."""
    vocab = f.integer("vocab_size", minimum=1)
    return dict(
        vocab_size=vocab,
        hidden_size=f.integer("hidden_size", minimum=1),
        num_hidden_layers=f.integer("num_hidden_layers", minimum=1),
        rms_norm_eps=f.number("rms_norm_eps", rms_norm_eps, above=0),
        max_position_embeddings=f.integer("max_position_embeddings", minimum=1),
        tie_word_embeddings=f.flag("tie_word_embeddings", False),
        fp8=fp8_config(f),
        int_quant=int_config(f),
        bos_token_id=f.token_id("bos_token_id", vocab),
        eos_token_ids=f.token_ids("eos_token_id", vocab),
    )


def gqa_fields(f: ConfigFields) -> dict:
    """Grouped-query attention's head counts and head size (head_dim defaults to hidden_size / heads)."""
    heads = f.integer("num_attention_heads", minimum=1)
    kv_heads = f.integer("num_key_value_heads", heads, minimum=1, maximum=(heads, "num_attention_heads"))
    if heads % kv_heads:
        raise ConfigError(
            f"{f.source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    head_dim = f.integer("head_dim", f.integer("hidden_size", minimum=1) // heads, minimum=2)
    if head_dim % 2:
        raise ConfigError(f"{f.source}: head_dim must be even (rope rotates pairs), got {head_dim}")
    return dict(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """The fields every family's config has (read by decoder_fields), and the opening checks of its reader. A
    family's config is a frozen, hashable subclass (a static argument of jit) with from_hf_config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    fp8: Fp8Config | None
    int_quant: IntQuantConfig | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Multi-token-prediction layers stored after the decoder layers (model.layers.{num_hidden_layers}.* on):
    # the model does not run them; loading skips their tensors.
    num_nextn_predict_layers: int = 0

    def window(self, layer: int) -> int | None:
        """The sliding window of a layer (a query sees its last `window` positions), None for full attention."""
        return None

    @staticmethod
    def fields(raw, source: str, model_types: tuple[str, ...]) -> ConfigFields:
        """The config.json's fields, once its model_type is one of the family's and its activation SiLU."""
        f = ConfigFields(raw, source)
        model_type = f.text("model_type", None)
        if model_type not in model_types:
            raise ConfigError(f"{source}: model_type {model_type!r} is not one of {', '.join(model_types)}")
        if f.text("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported (silu only)")
        return f


@dataclasses.dataclass(frozen=True, kw_only=True)
class GQAConfig(DecoderConfig):
    """A GQA family's attention fields (read by gqa_fields, with rope and attention_bias)."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope: RopeConfig
    attention_bias: bool = False

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    @property
    def attention_summary(self) -> str:
        """One line for `hybridjit info`."""
        return (
            f"GQA: {self.num_attention_heads} heads, {self.num_key_value_heads} key/value heads, head_dim "
            f"{self.head_dim} (rotated {self.rope.dim})"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class AllMoEGQAConfig(GQAConfig):
    """A GQA family whose every layer is a MoE block without a shared expert, config.json's intermediate_size being
    the experts' (Mixtral, MiniMax-M2), routed with renormalised top-k weights and no groups or scaling; the
    subclass says how it scores (scoring_func, topk_method, use_correction_bias)."""

    moe_intermediate_size: int  # intermediate_size in config.json
    n_routed_experts: int  # num_local_experts in config.json
    num_experts_per_tok: int
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0

    @property
    def intermediate_size(self) -> int:
        return self.moe_intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        return True

    @staticmethod
    def expert_fields(f: ConfigFields) -> dict:
        experts = f.integer("num_local_experts", minimum=1)
        return dict(
            moe_intermediate_size=f.integer("intermediate_size", minimum=1),
            n_routed_experts=experts,
            num_experts_per_tok=f.integer("num_experts_per_tok", minimum=1, maximum=(experts, "num_local_experts")),
        )
