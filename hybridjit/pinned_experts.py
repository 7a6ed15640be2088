"""Routed experts in ONE resident pinned-host copy, shared by the CPU expert kernels and stream-loaded prefill.

Each MoE layer's experts are stacked per projection into blocks of consecutive experts; each block is a JAX
array in the device's "pinned_host" memory (page-locked, so the GPU pulls it over PCIe with an asynchronous
copy at full speed: DESIGN.md §3). The C++ expert bank is registered with numpy views of those same buffers (a
pinned_host array's unsafe_buffer_pointer() is a real host pointer), so the CPU kernels of hybrid decode read
the very bytes that stream-loaded prefill sends to the GPU: no second copy of the experts in host memory
(OSDI '26 §3.3.2). A block is the unit that hybridjit.stream_prefill streams and keeps in its ring. With several
GPUs streaming (distributed stream-loaded prefill), each GPU's share of a layer is pinned through that GPU, so that
its copies are plain host-to-device DMAs over its own link.
"""

import ctypes
import dataclasses
import functools
import math
import os
import weakref
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import xla_bridge
from jax.sharding import SingleDeviceSharding

from hybridjit.models.common.expert_storage import ExpertStorage
from hybridjit.models.common.experts import Experts
from hybridjit.models.common.resident_experts import ResidentExperts
from hybridjit.ops.routed_experts import ExpertLayer, register_layer

PINNED_HOST = "pinned_host"
# A layer's experts are split into this many blocks by default: DeepSeek-V3's 256 FP8 experts make blocks of
# 32 experts, 1.4 GB each, large enough for full-speed copies and small enough that a ring of two fits a GPU
# with less free memory than one layer of experts.
BLOCKS_PER_LAYER = 8


def default_block_experts(n_experts: int) -> int:
    """Experts a block holds by default in a layer of `n_experts`: the layer in BLOCKS_PER_LAYER blocks."""
    return -(-n_experts // BLOCKS_PER_LAYER)


@dataclasses.dataclass(frozen=True, eq=False)
class ExpertBlock:
    """Experts [start, start + size) of a layer in pinned host memory, per projection (gate, up, down) stacked
    [size, ...] as the bank reads them: the weights in the stored format (up None where gate holds gate and up
    rows interleaved), their scales (None: an unscaled format) and float32 biases (None: unbiased)."""

    start: int
    weights: tuple[jax.Array | None, ...]
    scales: tuple[jax.Array | None, ...] | None = None
    biases: tuple[jax.Array | None, ...] | None = None

    @property
    def arrays(self) -> tuple[jax.Array, ...]:
        """Every array of the block, weights then scales then biases: what streaming copies."""
        groups = (self.weights, self.scales or (), self.biases or ())
        return tuple(a for group in groups for a in group if a is not None)

    def parts(self, arrays: tuple) -> tuple[tuple, tuple | None, tuple | None]:
        """(weights, scales, biases) of `arrays` ordered as `self.arrays` (their device copies), laid out as this
        block's: None where it has none."""
        rest = iter(arrays)

        def take(group):
            return None if group is None else tuple(None if a is None else next(rest) for a in group)

        return take(self.weights), take(self.scales), take(self.biases)

    @property
    def size(self) -> int:
        return self.weights[0].shape[0]

    @property
    def home(self) -> jax.Device:
        """The device whose pinned host memory holds the block: streaming it there is one DMA over that device's
        own link."""
        return next(iter(self.weights[0].devices()))

    @functools.cached_property
    def nbytes(self) -> int:
        # Cached: the ring counts each block it copies, and an array's nbytes costs microseconds of Python.
        return sum(a.nbytes for a in self.arrays)


@dataclasses.dataclass(frozen=True, eq=False)
class PinnedExperts:
    """One MoE layer's routed experts, in blocks, and how they are stored."""

    blocks: tuple[ExpertBlock, ...]
    storage: ExpertStorage

    @property
    def n_experts(self) -> int:
        return sum(b.size for b in self.blocks)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    def resident(self, ids: Sequence[int], dtype, device: jax.Device) -> ResidentExperts | None:
        """Device copies of experts `ids`, made from this pinned copy as WeightLoader.resident_experts makes them
        from the checkpoint: FP8 as stored with its block scales, any other format made into `dtype` on the device
        (biases too). Re-placing experts while serving copies from here: the checkpoint's pages may have left the
        page cache once the experts were pinned (a read from disk), and a pinned source needs no conversion on the
        host. None when `ids` is empty."""
        ids = sorted(int(i) for i in ids)
        if not ids:
            return None
        slot_of = np.full(self.n_experts, -1, np.int32)
        slot_of[ids] = np.arange(len(ids), dtype=np.int32)

        def stacked(group_of):
            """Each projection of the group (weights, scales or biases) of experts `ids` on the device, or None."""
            parts = [self._expert(i, group_of) for i in ids]
            if parts[0] is None:
                return None
            return tuple(None if first is None else jax.device_put(np.stack([p[j] for p in parts]), device)
                         for j, first in enumerate(parts[0]))

        weights, scales, biases = (stacked(lambda b: b.weights), stacked(lambda b: b.scales),
                                   stacked(lambda b: b.biases))
        slot_of = jax.device_put(slot_of, device)
        storage = self.storage
        if storage.fmt == "fp8" and not storage.gate_up_interleaved and biases is None:
            return ResidentExperts(slot_of, Experts(*weights, activation=storage.activation), scales, storage.block)
        experts = _stored_experts(storage, weights, scales, biases, jnp.dtype(dtype))
        return ResidentExperts(slot_of, experts)

    def _expert(self, expert: int, group_of) -> tuple[np.ndarray | None, ...] | None:
        """Host views of one expert's arrays of a group (ExpertBlock.weights, .scales or .biases)."""
        block = next(b for b in self.blocks if b.start <= expert < b.start + b.size)
        group = group_of(block)
        if group is None:
            return None
        return tuple(None if a is None else host_view(a, None)[expert - block.start] for a in group)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _stored_experts(storage: ExpertStorage, weights, scales, biases, dtype) -> Experts:
    """Experts in `dtype` from stored ones on the device, biases in `dtype` as the loader puts them."""
    experts = storage.experts(weights, scales, biases, dtype)
    return dataclasses.replace(experts, **{name: None if b is None else b.astype(dtype) for name, b in (
        ("gate_bias", experts.gate_bias), ("up_bias", experts.up_bias), ("down_bias", experts.down_bias))})


# XLA's GPU client takes its pinned host memory pool's size from this variable (GiB, an integer; 64 when unset or
# not an integer), once, when the backend starts: the pinned copy of the routed experts must fit in it.
HOST_MEMORY_LIMIT_VAR = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
XLA_DEFAULT_HOST_MEMORY_LIMIT_GB = 64


def host_memory_limit_gb(expert_bytes: int) -> int:
    """The pool size load() sets for `expert_bytes` of routed experts: 10% + 2 GiB of headroom for the pool's
    fragmentation and the other pinned buffers (staging of host-device copies)."""
    return math.ceil(1.1 * expert_bytes / 2**30) + 2


def host_memory_limit_action(expert_bytes: int, current: str | None, started: bool, platform: str | None) -> int | None:
    """What load() does about HOST_MEMORY_LIMIT_VAR for `expert_bytes` of routed experts in pinned host memory,
    given the variable's value, whether the JAX backend has started and its platform ("gpu", "cpu", ...; None
    when it has not started and JAX_PLATFORMS does not say): the value to set, or None to leave it.

    Nothing on the CPU. Before the backend starts, a value below host_memory_limit_gb is raised to it (also
    when the platform is not known yet: on a machine without a GPU nothing reads the variable). Once a GPU
    backend has started the pool's size is fixed: one that cannot hold the experts is a ValueError giving the
    setting to use; one with less headroom than load() would give is left as it is.
    """
    if platform == "cpu" or not expert_bytes:
        return None
    limit, wanted = _limit_gb(current), host_memory_limit_gb(expert_bytes)
    if limit >= wanted:
        return None
    if not started:
        return wanted
    if platform == "gpu" and limit * 2**30 < expert_bytes:
        now = f"{HOST_MEMORY_LIMIT_VAR}={current}" if current else f"{HOST_MEMORY_LIMIT_VAR} unset"
        raise ValueError(
            f"the routed experts take {expert_bytes / 2**30:.1f} GiB of pinned host memory, but the JAX GPU backend "
            f"started with {now} ({limit} GiB): set {HOST_MEMORY_LIMIT_VAR}={wanted} in the environment before JAX "
            "starts (or load the model before any other use of JAX in the process)"
        )
    return None


def size_host_memory_pool(expert_bytes: int, device: jax.Device | None = None) -> None:
    """Applies host_memory_limit_action to this process for `expert_bytes` of routed experts to be pinned for
    `device` (None: the default device): call it before anything touches a device."""
    started = xla_bridge.backends_are_initialized()  # jax 0.11 has no public way to ask without starting it
    if started:
        platform = (device or jax.devices()[0]).platform
    else:
        platform = "cpu" if jax.config.jax_platforms == "cpu" else None
    value = host_memory_limit_action(expert_bytes, os.environ.get(HOST_MEMORY_LIMIT_VAR), started, platform)
    if value is not None:
        os.environ[HOST_MEMORY_LIMIT_VAR] = str(value)


def pinned_pool_room(pinned_bytes: int) -> int:
    """Bytes a GPU backend's pinned pool has beyond `pinned_bytes` of routed experts and the headroom load() gives
    them (host_memory_limit_gb): what other pinned buffers, a KV cache in host memory, may take."""
    return max(0, _limit_gb(os.environ.get(HOST_MEMORY_LIMIT_VAR)) - host_memory_limit_gb(pinned_bytes)) * 2**30


def open_host_memory_pool(gib: int) -> None:
    """Lets the pinned pool grow to `gib` GiB, if the backend has not started and its limit is lower: the pool takes
    host memory as it is used, not at once, so a larger limit only moves the bound to what the caller checks."""
    if not xla_bridge.backends_are_initialized() and _limit_gb(os.environ.get(HOST_MEMORY_LIMIT_VAR)) < gib:
        os.environ[HOST_MEMORY_LIMIT_VAR] = str(gib)


def _limit_gb(value: str | None) -> int:
    """The pool size XLA takes from the variable's value."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return XLA_DEFAULT_HOST_MEMORY_LIMIT_GB


# Bank layer id -> its pinned experts, for as long as the bank layer holds them (see host_view).
_PINNED: weakref.WeakValueDictionary[int, PinnedExperts] = weakref.WeakValueDictionary()


def pinned_layer(layer_id: int) -> PinnedExperts | None:
    """The pinned experts behind an expert-bank layer id, or None if that layer was not registered pinned."""
    return _PINNED.get(layer_id)


def register_pinned(
    gate: Sequence[np.ndarray],
    up: Sequence[np.ndarray] | None,
    down: Sequence[np.ndarray],
    gate_scale: Sequence[np.ndarray] | None = None,
    up_scale: Sequence[np.ndarray] | None = None,
    down_scale: Sequence[np.ndarray] | None = None,
    block: tuple[int, int] | None = None,
    *,
    devices: Sequence[jax.Device],
    experts_per_block: int | None = None,
    biases: tuple[Sequence[np.ndarray], Sequence[np.ndarray] | None, Sequence[np.ndarray]] | None = None,
    register: Callable[..., ExpertLayer] = register_layer,
    **options,
) -> ExpertLayer:
    """`register`'s drop-in for one layer (register_layer's, or ops.gguf_experts.register_gguf_layer's arguments:
    the scales, block and biases passed on only where given; same options, same checks by the bank), with the
    experts first copied into pinned host memory in blocks of `experts_per_block` (default: the layer in
    BLOCKS_PER_LAYER blocks), biases too. The experts are split evenly over `devices` (the devices of stream-loaded
    prefill, Placement.stream_devices), in order: each share is pinned through the device that streams it and cut
    into blocks alike, so that the devices take same-shaped blocks in step. Still one copy in host memory, which the
    CPU kernels read whole. The source arrays can be dropped afterwards; the pinned copy lives as long as the
    returned bank layer, and `pinned_layer(layer.id)` finds it."""
    n, shares = len(gate), len(devices)
    if n % shares:
        raise ValueError(f"the {n} routed experts of a layer do not split evenly over the {shares} prefill devices")
    share = n // shares
    per = min(share, experts_per_block or default_block_experts(n))
    scales = None if gate_scale is None else (gate_scale, up_scale, down_scale)

    def pin(group, start, sharding):
        if group is None:
            return None
        end = start + min(per, share - start % share)
        return tuple(None if seq is None else _pin(seq[start:end], sharding) for seq in group)

    blocks = tuple(
        ExpertBlock(start, *(pin(group, start, SingleDeviceSharding(device, memory_kind=PINNED_HOST))
                             for group in ((gate, up, down), scales, biases)))
        for g, device in enumerate(devices) for start in range(g * share, (g + 1) * share, per)
    )

    # The bank gets per-expert views of each projection's arrays; each view keeps `owner`, and so the pinned copy
    # (and its _PINNED entry), alive exactly as long as the bank layer holds its arrays. The PinnedExperts joins
    # `owner` once the bank has checked the arrays and said their format.
    owner: list[PinnedExperts] = []

    def views(group_of):
        if group_of(blocks[0]) is None:
            return None
        return tuple(
            None if a is None else [expert for b in blocks for expert in host_view(group_of(b)[j], owner)]
            for j, a in enumerate(group_of(blocks[0]))
        )

    given = {"block": block, "biases": views(lambda b: b.biases)}
    layer = register(*views(lambda b: b.weights), *(views(lambda b: b.scales) or ()),
                     **{k: v for k, v in given.items() if v is not None}, **options)
    storage = ExpertStorage(
        layer.format, layer.block, options.get("gate_up_interleaved", False), options.get("activation", ("silu",))
    )
    pinned = PinnedExperts(blocks, storage)
    owner.append(pinned)
    _PINNED[layer.id] = pinned
    return layer


def _pin(arrays: Sequence[np.ndarray], sharding: SingleDeviceSharding) -> jax.Array:
    stacked = np.stack(arrays)
    pinned = jax.device_put(stacked, sharding)
    pinned.block_until_ready()
    # The views handed to the bank assume a dense row-major host buffer: check that once, on the last expert.
    if not np.array_equal(host_view(pinned, None)[-1].view(np.uint8), stacked[-1].view(np.uint8)):
        raise RuntimeError(f"{sharding.memory_kind} buffer of {pinned.shape} {pinned.dtype} is not row-major")
    return pinned


def host_view(array: jax.Array, owner) -> np.ndarray:
    """A numpy view of a host-memory JAX array's buffer, which keeps `owner` (and the array) alive."""
    buffer = (ctypes.c_byte * array.nbytes).from_address(array.unsafe_buffer_pointer())
    buffer.owners = (array, owner)
    return np.frombuffer(buffer, array.dtype).reshape(array.shape)
