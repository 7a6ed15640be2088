"""Where each part of the model lives and runs, decided by data rather than by edits to model code.

The model functions never name a device: the weights pytree does. A Placement says which device holds the
non-expert weights and the KV cache (and so runs attention, dense layers, shared experts, router, LM head
and sampling), in which dtype, and, per MoE layer, whether the routed experts stay in host memory for the
CPU kernels (the custom call) or are held on that device as JAX arrays and computed by XLA.
"""

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lib import xla_client
from jax.sharding import Mesh

COMPUTE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# The logical axis of the prefill mesh: the devices that share out each layer's routed experts (expert
# parallelism), every other weight and the activations replicated along it.
PREFILL_AXIS = "experts"


def copied(arrays: Sequence[jax.Array], sharding: jax.sharding.Sharding) -> list[jax.Array]:
    """Copies of one-device `arrays` on the one device (and memory kind) of `sharding`, issued in one call to the
    runtime's batched copy, which jax.device_put ends in. device_put's Python around it took ~0.15 ms an array
    (a stream-loaded block's 6 arrays: 0.9 ms to issue, 0.11 ms this way; 1x H200, session 37), on the host loop
    of a streamed decode step, which issues 384 of them (Qwen3-30B-A3B, 8 layers) and then waits for its GPU."""
    if sharding.num_devices != 1 or any(len(a.sharding.device_set) != 1 for a in arrays):
        raise ValueError("copied: one-device arrays to a one-device sharding")
    n, always = len(arrays), xla_client.ArrayCopySemantics.ALWAYS_COPY
    return xla_client.batched_copy_array_to_devices_with_sharding(
        list(arrays), [sharding._internal_device_list] * n, [sharding] * n, [always] * n
    )


def prefill_mesh(devices) -> Mesh:
    """`devices` as a mesh along PREFILL_AXIS: every array of one stream-loaded prefill shares its axis name (XLA on
    a GPU refuses a program whose arguments sit on meshes that differ only by it)."""
    return Mesh(np.array(devices), (PREFILL_AXIS,))


def compute_dtype(dtype) -> jnp.dtype:
    """`dtype` as a compute dtype: "float32" or "bfloat16", or jnp.float32 / jnp.bfloat16; else a ValueError."""
    try:
        resolved = None if isinstance(dtype, bool) else jnp.dtype(dtype)
    except (TypeError, ValueError):
        resolved = None
    if resolved not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be 'float32' or 'bfloat16' (or jnp.float32, jnp.bfloat16), got {dtype!r}")
    return resolved


def even_share(first, devices, experts: int) -> tuple:
    """`first` and as many more of `devices` as split `experts` routed experts evenly: the devices that
    Placement.default streams long prompts over."""
    ordered = [first, *(d for d in devices if d != first)]
    return tuple(ordered[: max(n for n in range(1, len(ordered) + 1) if experts % n == 0)])


@dataclasses.dataclass(frozen=True)
class Placement:
    device: jax.Device
    dtype: jnp.dtype
    # MoE layers whose routed experts are held on `device` and computed by XLA (every expert on every
    # token: for small models, e.g. training); all other layers keep them in host memory for the CPU.
    device_expert_layers: frozenset[int] = frozenset()
    # Routed experts kept in host memory go into one pinned-host copy of `device` (hybridjit.pinned_experts)
    # that both the CPU kernels and stream-loaded prefill read, instead of staying where the checkpoint is.
    pinned_experts: bool = False
    # Routed experts of the host-memory layers also held on `device` and computed there (the rest of each token's
    # experts stay on the CPU): "auto" (as many as the device's memory allows, hybridjit.auto_placement), a
    # hybridjit.expert_residency.Residency, a path to one saved as JSON, or None (none).
    resident_experts: object = None
    # The devices stream-loaded prefill spreads each layer's routed experts over (distributed stream-loaded
    # prefill, OSDI '26 §3.2): each pulls its share over its own PCIe link from the one pinned host copy, whose
    # blocks are pinned through the device that streams them. Empty: `device` alone.
    prefill_devices: tuple[jax.Device, ...] = ()

    @classmethod
    def default(cls, dtype=None, device: jax.Device | None = None, experts: int | None = None) -> "Placement":
        """The first accelerator if there is one, else the CPU; float32 on CPU (exact, and XLA:CPU bf16
        dots are no faster), bfloat16, pinned experts and automatic expert residency on a GPU. Given the routed
        experts a layer has, long prompts stream over as many of the machine's GPUs as split them evenly."""
        device = device or jax.devices()[0]
        on_gpu = device.platform == "gpu"
        if dtype is None:
            dtype = jnp.bfloat16 if on_gpu else jnp.float32
        # On a GPU the routed experts live in one pinned host copy, read by the CPU kernels during decode
        # and streamed to the GPU(s) for long prompts (stream-loaded prefill).
        prefill = ()
        if on_gpu and experts:
            prefill = even_share(device, jax.local_devices(backend=device.platform), experts)
        return cls(device=device, dtype=compute_dtype(dtype), pinned_experts=on_gpu,
                   resident_experts="auto" if on_gpu else None, prefill_devices=prefill)

    def put(self, array: np.ndarray, dtype=None) -> jax.Array:
        """A host array on the device in `dtype` (default: the compute dtype), converted on the host."""
        return jax.device_put(np.asarray(array).astype(jnp.dtype(dtype or self.dtype), copy=False), self.device)

    @property
    def stream_devices(self) -> tuple[jax.Device, ...]:
        """The devices of stream-loaded prefill, `device` first: the one that decodes gets the filled cache."""
        rest = tuple(d for d in self.prefill_devices if d != self.device)
        return (self.device, *rest)

    @property
    def prefill_mesh(self) -> Mesh:
        """stream_devices as a mesh along PREFILL_AXIS."""
        return prefill_mesh(self.stream_devices)

    def experts_on_device(self, layer: int) -> bool:
        return layer in self.device_expert_layers
