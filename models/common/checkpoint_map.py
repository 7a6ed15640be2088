"""What a family's checkpoint map is made of: each tensor a config implies, by its Hugging Face name."""

import dataclasses

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # an MLP's or expert's matrices, in the pytree's order


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    quantizable: bool  # a projection matrix that FP8 checkpoints store as float8 + block scales
