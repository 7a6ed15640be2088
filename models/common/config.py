"""What the runtime and the shared model code read of any family's config."""

from typing import Protocol

from hybridjit.config import Fp8Config, IntQuantConfig


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

    def is_moe_layer(self, layer: int) -> bool: ...
