"""The KV cache of an offline run in pinned host memory (issue #25; MoE-Gen keeps its KV cache in host memory).

On the device the cache bounds the batch: DeepSeek-V3's 61 layers of MLA latents at 1,024 positions take 0.067 GiB
a slot, so an H200 holds about a thousand slots beside the weights, while the streamed decode step's cost, every
expert's bytes over PCIe, is the same for any batch and is shared by more tokens the more slots there are. Held in
pinned host memory, the cache is bounded by the host instead. A streamed decode step
(stream_prefill.stream_decode_step) then copies each layer's cache to the GPU just before that layer's attention, an
asynchronous DMA over the same link as the experts (the next layer's copy is issued while this layer runs), and
writes back only the entries the step added; the device holds two layers' caches, not all of them.

The buffers are JAX arrays in the device's "pinned_host" memory (page-locked: the GPU pulls them at the link's full
rate), written in place through numpy views of their host addresses, as pinned_experts does for the experts; a
buffer is never written while a copy of it may be in flight (a layer's entries are written after its attention has
read its copy, and its next copy is issued at the next step). A sliding-window layer keeps only its window there, as
the ring it is on the device (models/common/ring_cache.py: position p at index p % window), so the copies carry
gpt-oss's windowed layers' few positions, not its context.

With `attention_on_cpu` nothing of the cache crosses the link: each layer's decode attention runs on the CPU, over
the cache where it is (MoE-Gen's CPU attention), through `attending(layer)`, a layer the model's decode attention
hands its queries and new entries to (models/common/host_attention.py). The program calls back to the host for it
(an io_callback: the step's queries go to the host, the core's output comes back), whose kernels
(hybridjit/ops/cpu_attention.py) write the new entries and attend. The link then carries only the experts, and the
CPU reads the cache at the host's memory rate; a GQA cache, a few FLOPs a byte, is read faster so than over PCIe,
while MLA's 128 heads make its core compute-bound on the CPU. A ring's indices below min(position + 1, window) hold
the window's positions, which is all a softmax needs; gpt-oss's sinks join it in the kernels' merge.
"""

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.sharding import Sharding, SingleDeviceSharding

from hybridjit.models.common.host_attention import HostAttention
from hybridjit.models.common.ring_cache import is_ring, prompt_positions
from hybridjit.ops import cpu_attention
from hybridjit.pinned_experts import HOST_MEMORY_LIMIT_VAR, PINNED_HOST, host_view, pinned_pool_room

# Of the host memory available when a run starts, the share a KV cache there may pin: the rest stays for the
# process's own arrays (prompt caches on their way, outputs) and the system.
HOST_KV_SHARE = 0.8
# Layers of the cache on the device at once during a step: the one its attention reads, the next one coming.
DEVICE_LAYERS = 2


def host_memory_bytes(field: str) -> int | None:
    """A /proc/meminfo figure ("MemAvailable", "MemTotal") in bytes; None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields[field].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def host_kv_budget(model) -> int | None:
    """Bytes of host memory a KV cache of `model` (a hybridjit.engine.Model) may pin now: HOST_KV_SHARE of what the
    host has available, and on a GPU no more than its pinned pool has beyond the routed experts (None: unbounded,
    where neither says)."""
    available = host_memory_bytes("MemAvailable")
    bounds = [] if available is None else [int(HOST_KV_SHARE * available)]
    if model.placement.device.platform == "gpu":
        bounds.append(pinned_pool_room(sum(layer.nbytes for layer in model.expert_layers)))
    return min(bounds, default=None)


class HostKVCache:
    """The decode cache of `slots` sequences of `cache_len` positions of `model` (a hybridjit.engine.Model), every
    layer in pinned host memory: the layout init_cache gives ([slots, cache_len, ...] per leaf), host-resident. With
    `attention_on_cpu`, decode steps attend over it on the CPU (`attending`) instead of copying it to the device."""

    def __init__(self, model, slots: int, cache_len: int, attention_on_cpu: bool = False):
        self.attention_on_cpu = attention_on_cpu
        family, cfg = model.family, model.config
        shapes = jax.eval_shape(partial(family.model.init_cache, cfg, slots, cache_len, model.dtype, ring=True))
        host = SingleDeviceSharding(model.placement.device, memory_kind=PINNED_HOST)

        def pinned(shape: jax.ShapeDtypeStruct) -> jax.Array:
            # One leaf at a time, so that the zeroed source is never more than a layer's leaf.
            try:
                return jax.device_put(np.zeros(shape.shape, shape.dtype), host).block_until_ready()
            except jax.errors.JaxRuntimeError as e:
                total = sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(shapes))
                raise ValueError(
                    f"kv_in_host: pinning the {total / 2**30:.1f} GiB KV cache of {slots} slots failed ({e}); on a GPU "
                    f"the pinned pool's size is {HOST_MEMORY_LIMIT_VAR} (GiB, read when JAX starts): raise it, or use "
                    "fewer slots, or keep the cache on the device"
                ) from None

        self.layers = [jax.tree.map(pinned, layer) for layer in shapes]
        self._views = [jax.tree.map(lambda a: host_view(a, None), layer) for layer in self.layers]
        self._copies: dict[int, object] = {}  # layer -> its device copy, issued and not yet taken
        self._written = False  # since allocated or cleared

    def __len__(self) -> int:
        return len(self.layers)

    def clear(self) -> None:
        """Every position zeroed, as allocated: masked positions are still read, and a failed step may have left
        non-finite entries, which a zero weight does not cancel. Copies issued and not taken are dropped."""
        self._copies.clear()
        if self._written:
            for view in jax.tree.leaves(self._views):
                view.fill(0)
            self._written = False

    def issue(self, layer: int, sharding: Sharding) -> None:
        """Starts the copy of `layer`'s cache to the device(s) of `sharding` (asynchronous), unless it is issued."""
        if layer < len(self.layers) and layer not in self._copies:
            self._copies[layer] = jax.device_put(self.layers[layer], sharding)

    def take(self, layer: int, sharding: Sharding):
        """`layer`'s cache on the device(s) of `sharding` (its copy may still be in flight): the caller's to donate.
        The next layer's copy is issued first, to overlap this layer's work."""
        self.issue(layer, sharding)
        self.issue(layer + 1, sharding)
        return self._copies.pop(layer)

    def attending(self, layer: int) -> "_AttendingLayer":
        """`layer` as a cache that attends on the CPU, for a decode step's program (with attention_on_cpu)."""
        return _AttendingLayer(self, np.int32(layer))

    def _entries_written(self, layer, positions: np.ndarray, **entries: np.ndarray):
        """Layer `layer`'s host views, each named leaf given its rows' new entry ([b, 1, ...]) at positions [b, 1]."""
        if positions.shape[1] != 1:
            raise ValueError(f"attention on the CPU: one new token per sequence and step, got {positions.shape[1]}")
        views, rows = self._views[int(layer)], np.arange(len(positions))
        self._written = True
        for name, new in entries.items():
            view = getattr(views, name)
            view[rows, positions[:, 0] % view.shape[1]] = new[:, 0]
        return views

    # The io_callback hands these its operands as CPU jax.Arrays: taken as numpy views first, their slicing and
    # scattering costs numpy's microseconds, not an eager jax op each (2.4-4.5 -> 0.8-0.9 ms a layer at Qwen3's
    # 1,024 slots on the dev VM).
    def _attend_gqa(self, scale: float, layer, q, k, v, positions, sinks) -> np.ndarray:
        q, k, v, positions = map(np.asarray, (q, k, v, positions))
        views = self._entries_written(layer, positions, k=k, v=v)
        # A ring's first min(position + 1, window) indices hold exactly the window's positions: in another order,
        # which a softmax over them does not see (their keys carry their positions' rotations).
        lengths = np.minimum(positions[:, 0] + 1, views.k.shape[1])
        sinks = None if sinks is None else np.asarray(sinks)
        return cpu_attention.gqa_decode(q[:, 0], views.k, views.v, lengths, scale, sinks)[:, None]

    def _attend_mla(self, scale: float, layer, q_latent, q_rope, latent, k_rope, positions) -> np.ndarray:
        q_latent, q_rope, latent, k_rope, positions = map(np.asarray, (q_latent, q_rope, latent, k_rope, positions))
        views = self._entries_written(layer, positions, latent=latent, k_rope=k_rope)
        out = cpu_attention.mla_decode(q_latent[:, 0], q_rope[:, 0], views.latent, views.k_rope, positions[:, 0] + 1,
                                       scale)  # fmt: skip
        return out[:, None]

    def write_back(self, layer: int, updated, positions: np.ndarray) -> None:
        """Writes the entries the step added to `layer`'s device copy `updated` (each row's at its position in
        positions [b], a ring's at that position modulo its size) to the host buffers, then frees the copy."""
        entries = jax.device_get(_entries_at(updated, jnp.asarray(positions)))
        rows = np.arange(len(positions))
        self._written = True
        for view, new in zip(jax.tree.leaves(self._views[layer]), jax.tree.leaves(entries), strict=True):
            view[rows, positions % view.shape[1]] = new
        for a in jax.tree.leaves(updated):
            a.delete()

    def insert(self, prompt_cache: list, row: int, length: int, slot: int) -> None:
        """Positions [0, length) of row `row` of a prompt cache (every layer [b, t, ...], on the device, without
        rings) into slot `slot`; a ring layer of the slot gets those it keeps (the engine's _insert_program's rule)."""
        assert not self._copies, "a prompt inserted while a step's copies are pending"
        prompt = jax.device_get(_row(prompt_cache, row))
        self._written = True
        for views, layer in zip(self._views, prompt, strict=True):
            for view, new in zip(jax.tree.leaves(views), jax.tree.leaves(layer), strict=True):
                if is_ring(views):
                    view[slot] = new[prompt_positions(np.array([length]), view.shape[1], len(new))[0]]
                else:
                    view[slot, :length] = new[:length]


@jax.tree_util.register_pytree_node_class
class _AttendingLayer(HostAttention):
    """One layer of a HostKVCache that attends on the CPU: a pytree whose leaf is the layer's index (a program
    argument, so that every layer shares one program) and whose static part is the cache."""

    def __init__(self, cache: HostKVCache, layer):
        self.cache, self.layer = cache, layer

    def tree_flatten(self):
        return (self.layer,), self.cache

    @classmethod
    def tree_unflatten(cls, cache, leaves):
        return cls(cache, *leaves)

    def gqa(self, q, k, v, positions, scale, sinks):
        out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
        return io_callback(partial(self.cache._attend_gqa, scale), out, self.layer, q, k, v, positions, sinks)

    def mla(self, q_latent, q_rope, latent, k_rope, positions, scale):
        out = jax.ShapeDtypeStruct(q_latent.shape, jnp.float32)
        return io_callback(partial(self.cache._attend_mla, scale), out, self.layer, q_latent, q_rope, latent, k_rope,
                           positions)  # fmt: skip


@jax.jit
def _entries_at(cache, positions):
    """Each row's entry at its position (a ring's at that position modulo its size; a full layer holds every
    position): every leaf [b, L, ...] -> [b, ...]."""
    return jax.tree.map(lambda a: a[jnp.arange(a.shape[0]), positions % a.shape[1]], cache)


@jax.jit
def _row(cache, row):
    """Row `row` of every leaf [b, t, ...]: [t, ...]. (Not cut to the prompt's length here: a program per length.)"""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, row, 0, keepdims=False), cache)
