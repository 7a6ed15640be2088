"""What a family's checkpoint map is made of: each tensor a config implies, by its Hugging Face name, and the
decoder's part of the map (embeddings, norms, dense MLPs, MoE routers, shared and routed experts, LM head), into
which a family puts its attention's tensors.

Loading checks a checkpoint against `decoder_layout` before reading anything and fills the pytree through
`build_decoder_weights`; exporting passes the identity to the same function to get the tree with names as leaves.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from hybridjit.models.common.config import ModelConfig
from hybridjit.models.common.decoder import Layer, Weights
from hybridjit.models.common.experts import Experts
from hybridjit.models.common.layers import MLP
from hybridjit.models.common.moe import MoE

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # an MLP's or expert's matrices, in the pytree's order


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    quantizable: bool  # a projection matrix that FP8 checkpoints store as float8 + block scales
    routed_expert: bool = False  # a routed expert's matrix: kept in host memory for the CPU kernels
    dtype: str | None = None  # the one safetensors dtype a raw tensor must have (MXFP4 "U8"); None: any float


@dataclasses.dataclass(frozen=True)
class FusedMxfp4Experts:
    """A MoE layer's routed experts as gpt-oss releases them: all experts in one tensor per projection under
    `prefix` ("model.layers.L.mlp.experts"), gate_up_proj [E, 2I, H] with gate and up rows interleaved (even rows
    gate) and down_proj [E, H, I], each as MXFP4 `_blocks` [E, out, in / 32, 16] and `_scales` [E, out, in / 32]
    (uint8) plus a `_bias` [E, out]; `activation` joins gate and up (hybridjit.ops.routed_experts.ACTIVATIONS).
    What build_decoder_weights' `routed` gets for such a layer instead of per-expert names."""

    prefix: str
    activation: tuple

    def tensor(self, projection: str, part: str) -> str:
        """The name of a projection's ("gate_up_proj", "down_proj") part ("blocks", "scales", "bias")."""
        return f"{self.prefix}.{projection}_{part}"


@dataclasses.dataclass(frozen=True)
class MoENames:
    """How a family's release names a MoE block's tensors, relative to "model.layers.L": the defaults are
    DeepSeek's and Qwen3's; Mixtral's are block "block_sparse_moe" and projections ("w1", "w3", "w2")."""

    block: str = "mlp"
    projections: tuple[str, str, str] = PROJECTIONS  # the routed experts' gate, up and down matrices
    correction_bias: str = "gate.e_score_correction_bias"
    router: str = "gate"  # the router's linear layer (gpt-oss: "router", with a bias)

    def experts(self, layer_prefix: str, n_experts: int) -> tuple[list[str], list[str], list[str]]:
        """The names of every routed expert's gate, up and down matrices."""
        p = f"{layer_prefix}.{self.block}.experts"
        return tuple([f"{p}.{e}.{proj}.weight" for e in range(n_experts)] for proj in self.projections)


class Layout:
    """Collects TensorSpecs by name: what a family's attention_layout(layout, prefix) adds to."""

    def __init__(self):
        self.specs: dict[str, TensorSpec] = {}

    def matrix(self, name: str, out: int, inp: int, quantizable: bool = True, routed_expert: bool = False):
        self.specs[name] = TensorSpec((out, inp), quantizable, routed_expert)

    def vector(self, name: str, size: int):
        self.specs[name] = TensorSpec((size,), False)

    def tensor(self, name: str, shape: tuple[int, ...], dtype: str | None = None, routed_expert: bool = False):
        """Any other tensor: of one raw dtype (e.g. "U8") or, with dtype None, any float type."""
        self.specs[name] = TensorSpec(tuple(shape), False, routed_expert, dtype)

    def mlp(self, prefix: str, hidden: int, inter: int):
        self.matrix(f"{prefix}.gate_proj.weight", inter, hidden)
        self.matrix(f"{prefix}.up_proj.weight", inter, hidden)
        self.matrix(f"{prefix}.down_proj.weight", hidden, inter)


def decoder_layout(
    cfg: ModelConfig,
    attention_layout: Callable[[Layout, str], None],
    moe_names: MoENames = MoENames(),
    moe_layout: Callable[[Layout, str], None] | None = None,
) -> dict[str, TensorSpec]:
    """Every tensor the config implies, by its Hugging Face name; attention_layout(layout, "model.layers.L.self_attn")
    adds one layer's attention tensors, moe_layout(layout, "model.layers.L.<block>"), where given, a MoE block's
    tensors instead of the router, correction bias, shared and per-expert ones."""
    layout, d = Layout(), cfg.hidden_size
    layout.matrix("model.embed_tokens.weight", cfg.vocab_size, d, quantizable=False)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        layout.vector(f"{p}.input_layernorm.weight", d)
        layout.vector(f"{p}.post_attention_layernorm.weight", d)
        attention_layout(layout, f"{p}.self_attn")
        if not cfg.is_moe_layer(i):
            layout.mlp(f"{p}.mlp", d, cfg.intermediate_size)
            continue
        block, f = f"{p}.{moe_names.block}", cfg.moe_intermediate_size
        if moe_layout is not None:
            moe_layout(layout, block)
            continue
        layout.matrix(f"{block}.gate.weight", cfg.n_routed_experts, d, quantizable=False)
        if cfg.use_correction_bias:
            layout.vector(f"{block}.{moe_names.correction_bias}", cfg.n_routed_experts)
        if cfg.n_shared_experts:
            layout.mlp(f"{block}.shared_experts", d, f * cfg.n_shared_experts)
        for gate, up, down in zip(*moe_names.experts(p, cfg.n_routed_experts), strict=True):
            layout.matrix(gate, f, d, routed_expert=True)
            layout.matrix(up, f, d, routed_expert=True)
            layout.matrix(down, d, f, routed_expert=True)
    layout.vector("model.norm.weight", d)
    if not cfg.tie_word_embeddings:
        layout.matrix("lm_head.weight", cfg.vocab_size, d, quantizable=False)
    return layout.specs


def build_decoder_weights(
    cfg: ModelConfig,
    tensor: Callable[..., Any],
    routed: Callable[[tuple[list[str], list[str], list[str]], int], tuple[Experts | None, int | None]],
    attention: Callable[[str, int], Any],
    moe_names: MoENames = MoENames(),
    moe: Callable[[str, int], MoE] | None = None,
) -> Weights:
    """The weights pytree, with each leaf made by tensor(hf_name[, dtype]), each MoE layer's routed experts by
    routed((gate names, up names, down names), layer) -> (JAX-held experts or None, expert-bank layer id or None),
    and each layer's attention weights by attention("model.layers.L.self_attn", L); moe("model.layers.L", L), where
    given, makes each MoE block instead (calling `routed` as it needs)."""

    def mlp(p):
        return MLP(*(tensor(f"{p}.{proj}.weight") for proj in PROJECTIONS))

    def decoder_moe(layer_prefix, layer):
        p = f"{layer_prefix}.{moe_names.block}"
        experts, bank_layer = routed(moe_names.experts(layer_prefix, cfg.n_routed_experts), layer)
        return MoE(
            router=tensor(f"{p}.gate.weight", jnp.float32),
            correction_bias=tensor(f"{p}.{moe_names.correction_bias}", jnp.float32)
            if cfg.use_correction_bias
            else None,
            shared=mlp(f"{p}.shared_experts") if cfg.n_shared_experts else None,
            experts=experts,
            expert_layer=bank_layer,
        )

    layers = [
        Layer(
            attn_norm=tensor(f"model.layers.{i}.input_layernorm.weight"),
            attn=attention(f"model.layers.{i}.self_attn", i),
            mlp_norm=tensor(f"model.layers.{i}.post_attention_layernorm.weight"),
            mlp=(moe or decoder_moe)(f"model.layers.{i}", i) if cfg.is_moe_layer(i) else mlp(f"model.layers.{i}.mlp"),
        )
        for i in range(cfg.num_hidden_layers)
    ]
    embed = tensor("model.embed_tokens.weight")
    return Weights(
        embed=embed,
        layers=layers,
        norm=tensor("model.norm.weight"),
        lm_head=embed if cfg.tie_word_embeddings else tensor("lm_head.weight"),
    )
