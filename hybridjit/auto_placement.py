"""How many routed experts the GPU holds: the device memory left once the rest of the model is loaded, less what
serving and prefill will need there, spent on resident experts, the same number in every MoE layer; a model
whose experts all fit runs entirely on the GPU.

The reserve is sized from the model: the KV cache of `kv_tokens` tokens over `kv_slots` sequences (the serving
slots' cache, whose sliding-window layers keep a window per slot whatever the context), two blocks
of stream-loaded prefill's expert ring (one in use, one arriving) and room for activations. Everything can be
overridden; a residency that does not fit is refused at load with the numbers, never an out-of-memory error in
the middle of a request.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from hybridjit.models.registry import ModelConfig, family_of
from hybridjit.pinned_experts import BLOCKS_PER_LAYER
from hybridjit.prefill_path import expert_bytes

GIB = 2**30
UNBOUNDED = 2**62  # the free memory of a device that reports none
# Default reserve for the KV cache: 8 serving slots of 8K tokens.
KV_SLOTS = 8
KV_TOKENS = KV_SLOTS * 8192
# Activations of decode and of a long prefill chunk, and the allocator's fragmentation: a fixed part and a share of
# the device's memory.
ACTIVATION_RESERVE = 4 * GIB
FRAGMENTATION_SHARE = 0.05


def resident_copies_are_fp8(cfg: ModelConfig) -> bool:
    """Whether the device holds resident copies of the model's experts in FP8 as stored (with their block scales);
    every other format is held in the compute dtype."""
    return cfg.fp8 is not None and cfg.int_quant is None


def resident_expert_bytes(cfg: ModelConfig, dtype) -> int:
    """Device bytes of one resident expert: FP8 as stored with its float32 block scales, any other format in the
    compute dtype."""
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    if resident_copies_are_fp8(cfg):
        bo, bi = cfg.fp8.block
        return 3 * d * f + 4 * (2 * -(-f // bo) * -(-d // bi) + -(-d // bo) * -(-f // bi))
    return 3 * d * f * jnp.dtype(dtype).itemsize


def stored_expert_bytes(cfg: ModelConfig) -> int:
    """Bytes of one routed expert as stored (what stream-loaded prefill copies to the device): the mean over the
    checkpoint's experts (prefill_path.expert_bytes)."""
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return -(-expert_bytes(cfg) // (moe * cfg.n_routed_experts)) if moe else 0


def kv_cache_bytes(cfg: ModelConfig, dtype, slots: int, context: int) -> int:
    """Bytes of a serving KV cache of `slots` sequences of `context` positions, from the family's own cache layout
    as the serving engine makes it: a full-attention layer's bytes grow with the context, a sliding-window layer
    keeps its window (a ring) whatever the context."""
    cache = jax.eval_shape(lambda: family_of(cfg).model.init_cache(cfg, slots, context, dtype, ring=True))
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(cache))


@dataclasses.dataclass(frozen=True)
class DeviceBudget:
    """The device memory the resident experts may use, and how it was found (bytes)."""

    device_total: int
    free_after_weights: int
    kv_cache: int
    prefill_ring: int
    activations: int
    per_expert: int
    moe_layers: int
    experts_per_layer: int  # routed experts in each MoE layer

    @property
    def reserved(self) -> int:
        return self.kv_cache + self.prefill_ring + self.activations

    @property
    def for_experts(self) -> int:
        return max(0, self.free_after_weights - self.reserved)

    @property
    def resident_per_layer(self) -> int:
        """The most experts every MoE layer can hold on the device."""
        if not self.moe_layers:
            return 0
        return min(self.experts_per_layer, self.for_experts // (self.per_expert * self.moe_layers))

    def check(self, resident_experts: int) -> None:
        """Raises ValueError, with the numbers, when `resident_experts` (over all layers) do not fit."""
        needed = resident_experts * self.per_expert
        if needed > self.for_experts:
            raise ValueError(
                f"the resident experts need {needed / GIB:.2f} GiB of device memory ({resident_experts} experts of "
                f"{self.per_expert / 2**20:.1f} MiB); {self.for_experts / GIB:.2f} GiB is available: "
                f"{self.free_after_weights / GIB:.2f} GiB free after the other weights, less "
                f"{self.reserved / GIB:.2f} GiB reserved (KV cache {self.kv_cache / GIB:.2f}, prefill ring "
                f"{self.prefill_ring / GIB:.2f}, activations {self.activations / GIB:.2f})"
            )

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "for_experts": self.for_experts,
                "resident_per_layer": self.resident_per_layer}


def device_budget(cfg: ModelConfig, device: jax.Device, dtype, *, kv_tokens: int = KV_TOKENS,
                  kv_slots: int = KV_SLOTS, free_bytes: int | None = None, moe_layers: int | None = None,
                  weights_to_load: int = 0) -> DeviceBudget:
    """The budget on `device` now (call it once the other weights are there, or say with `weights_to_load` how many
    bytes of them are still to come: device_weight_bytes plans before loading); `free_bytes` overrides the free
    memory the device reports. A device that reports none (the CPU) has no bound. The KV reserve is `kv_slots`
    sequences of kv_tokens / kv_slots positions each."""
    if kv_slots < 1:
        raise ValueError(f"kv_slots must be >= 1, got {kv_slots}")
    stats = device.memory_stats() or {}
    total = int(stats.get("bytes_limit", 0))
    if free_bytes is None:
        free_bytes = total - int(stats.get("bytes_in_use", 0)) - weights_to_load if total else UNBOUNDED
    if moe_layers is None:
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    per_expert = resident_expert_bytes(cfg, dtype)
    return DeviceBudget(
        device_total=total,
        free_after_weights=free_bytes,
        kv_cache=kv_cache_bytes(cfg, dtype, kv_slots, -(-kv_tokens // kv_slots)),
        # Stream-loaded prefill keeps two blocks of a layer's experts, as stored, on the device.
        prefill_ring=2 * -(-cfg.n_routed_experts // BLOCKS_PER_LAYER) * stored_expert_bytes(cfg),
        activations=ACTIVATION_RESERVE + int(FRAGMENTATION_SHARE * total),
        per_expert=per_expert,
        moe_layers=moe_layers,
        experts_per_layer=cfg.n_routed_experts,
    )


def device_weight_bytes(cfg: ModelConfig, dtype) -> int:
    """Device bytes of every weight but the routed experts as loading places them, from the config alone: the
    family's weights pytree built from the checkpoint map's shapes, each tensor in the dtype loading gives it (the
    compute dtype, FP8 ones dequantized; routers float32), a tied embedding counted once."""
    family = family_of(cfg)
    layout = family.ckpt.checkpoint_layout(cfg)

    def tensor(name, tensor_dtype=None):
        return jax.ShapeDtypeStruct(layout[name].shape, tensor_dtype or dtype)

    shapes = family.ckpt.build_weights(cfg, tensor, lambda names, layer: (None, layer))
    unique = {id(leaf): leaf for leaf in jax.tree.leaves(shapes)}.values()
    return sum(int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize for leaf in unique)
