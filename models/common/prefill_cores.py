"""What the attention cores of long prompts (stream-loaded prefill, hybridjit.stream_prefill) share whatever the
family's attention: queries taken in chunks, so that no [t, t] score matrix exists, and cuDNN's fused causal
attention on a GPU. Each family's attention module builds its ChunkedAttention and CudnnAttention from these.

Einsum dimension names: b batch, t query tokens, s key positions, h query heads, k key/value heads, e head dims.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def over_query_chunks(chunk: int, queries: tuple[jax.Array, ...], attend_chunk: Callable) -> jax.Array:
    """The attention of queries [b, t, ...] (one or more arrays, query i at position i) taken `chunk` queries at a
    time: attend_chunk(start, *chunks [b, chunk, ...]) gives the output [b, chunk, ...] of the queries at positions
    [start, start + chunk). The queries are padded at the end to whole chunks (their outputs dropped); the chunks
    run one after the other (lax.map), so only one chunk's scores are live. Returns [b, t, ...]."""
    b, t = queries[0].shape[:2]
    n = -(-t // chunk)
    padded = [jnp.pad(q, [(0, 0), (0, n * chunk - t)] + [(0, 0)] * (q.ndim - 2)) for q in queries]

    def one(i):
        start = i * chunk
        return attend_chunk(start, *(jax.lax.dynamic_slice_in_dim(q, start, chunk, axis=1) for q in padded))

    out = jax.lax.map(one, jnp.arange(n))  # [n, b, chunk, ...]
    return jnp.moveaxis(out, 0, 1).reshape(b, n * chunk, *out.shape[3:])[:, :t]


def cudnn_version() -> int | None:
    """cuDNN's version as an integer (9.10.0 is 91000), None where there is no cuDNN."""
    from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

    try:
        return check_cudnn_version()
    except RuntimeError:
        return None


def cudnn_causal(q, k, v, scale: float, window: int | None = None, stats: bool = False):
    """cuDNN's fused (flash) causal attention of queries q [b, t, h, e] over keys k [b, t, k, e] and values
    v [b, t, k, ev] (k dividing h), query i and key j at positions i and j, a key visible only within the last
    `window` positions when given: the output [b, t, h, ev], and with `stats` also the float32 log-sum-exp of each
    query's scaled, masked scores [b, h, t].

    jax.nn.dot_product_attention takes neither a query/key head dim other than the value's (MLA's 192 / 128;
    cuDNN >= 9.10 on Hopper) nor returns the statistics in float32 (it rounds them to the output's dtype), hence
    the private entry point."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    return dot_product_attention(
        q, k, v, scale=scale, mask_type=MaskType.CAUSAL, qkv_layout="BTNH", sliding_window_length=window,
        return_residual=stats,
    )


@dataclasses.dataclass(frozen=True)
class HeadsSplit:
    """An attention core (a family's ChunkedAttention or CudnnAttention) run with the heads split over a mesh axis:
    each device scores its share of the heads, and the output [b, t, h, e] stays split by heads (the output
    projection then sums the devices' shares). Heads are independent, so the masks, windows and sinks need nothing
    new, and the shares are equal whatever the causal mask (unlike splitting the queries). `head_axes` gives, per
    positional operand of the core, the axis of an array operand that holds the heads (None: every head reads it
    whole, e.g. MLA's shared rope key); operands that are not arrays (the scale, a window, absent sinks) pass as
    they are. The operands are asked for split by heads, so that each device projects only its heads' queries,
    keys and values (from tokens gathered whole: a latent or a token's hidden state is smaller than its heads).
    Where the heads (or a GQA layer's key/value heads) do not divide over the mesh, the core runs whole on every
    device."""

    core: Callable
    mesh: Mesh
    axis: str
    head_axes: tuple[int | None, ...]

    def __call__(self, *operands):
        size = self.mesh.shape[self.axis]
        split = [i for i, op in enumerate(operands) if isinstance(op, jax.Array)]
        if any(self.head_axes[i] is not None and operands[i].shape[self.head_axes[i]] % size for i in split):
            return self.core(*operands)
        specs = dict(
            (i, P() if self.head_axes[i] is None else P(*[None] * self.head_axes[i], self.axis)) for i in split
        )
        operands = [jax.lax.with_sharding_constraint(op, NamedSharding(self.mesh, specs[i])) if i in specs else op
                    for i, op in enumerate(operands)]  # fmt: skip

        def on_each_device(*local):
            given = dict(zip(split, local, strict=True))
            return self.core(*(given.get(i, op) for i, op in enumerate(operands)))

        heads = P(None, None, self.axis)
        out = jax.shard_map(on_each_device, mesh=self.mesh, in_specs=tuple(specs.values()), out_specs=heads)(
            *(operands[i] for i in split))
        return jax.lax.with_sharding_constraint(out, NamedSharding(self.mesh, heads))
