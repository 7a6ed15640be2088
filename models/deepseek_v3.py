"""DeepSeek-V3 family (V2, V2-Lite, V3, R1, V3.1, Kimi-K2) as pure JAX functions.

Everything here is a function of (config, weights pytree, inputs); the config is a frozen dataclass and
so a static jit argument. Routed experts are not JAX arrays: each MoE layer names a layer of the C++
expert bank and calls the `hybridjit_routed_experts` custom call, which reads the expert weights in host
memory in the checkpoint's own format.

Einsum dimension names, used throughout:
  b batch   t query tokens   s key/cache positions   d hidden   h heads
  q q_lora_rank   r kv_lora_rank   n qk_nope_head_dim   p qk_rope_head_dim   v v_head_dim
  e routed experts   k experts per token   f MLP intermediate
Weight matrices keep the checkpoint's [out, in] orientation.
"""

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from hybridjit.config import ModelConfig, RopeConfig, yarn_mscale
from hybridjit.ops.async_experts import submit_routed_experts, wait_routed_experts

# The q and kv latent norms use a fixed epsilon in DeepSeek's reference code and in transformers,
# whatever rms_norm_eps says (the released configs happen to agree).
LATENT_NORM_EPS = 1e-6


def _pytree(cls=None, *, meta=()):
    """Registers a dataclass as a pytree whose fields are leaves except the static `meta` ones."""

    def wrap(cls):
        cls = dataclasses.dataclass(cls)
        data = [f.name for f in dataclasses.fields(cls) if f.name not in meta]
        return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=list(meta))

    return wrap if cls is None else wrap(cls)


@_pytree
class MLA:
    q_a: jax.Array | None  # [q, d], None when q_lora_rank is null (then q_b is q_proj [h*(n+p), d])
    q_a_bias: jax.Array | None
    q_a_norm: jax.Array | None
    q_b: jax.Array  # [h*(n+p), q] or [h*(n+p), d]
    kv_a: jax.Array  # [r+p, d] (kv_a_proj_with_mqa)
    kv_a_bias: jax.Array | None
    kv_a_norm: jax.Array  # [r]
    kv_b: jax.Array  # [h*(n+v), r]
    o: jax.Array  # [d, h*v]
    o_bias: jax.Array | None


@_pytree
class MLP:
    gate: jax.Array  # [f, d]
    up: jax.Array  # [f, d]
    down: jax.Array  # [d, f]


@_pytree
class Experts:
    """Routed experts held as JAX arrays, stacked over experts."""

    gate: jax.Array  # [e, f, d]
    up: jax.Array  # [e, f, d]
    down: jax.Array  # [e, d, f]


@_pytree(meta=("expert_layer",))
class MoE:
    """Where the routed experts live is data: a layer of the C++ expert bank in host memory (computed by
    the custom call), or JAX arrays (computed by XLA, e.g. for training)."""

    router: jax.Array  # [e, d], float32 as the reference routes in float32
    correction_bias: jax.Array | None  # [e], selection only (noaux_tc)
    shared: MLP | None
    experts: Experts | None = None
    expert_layer: int | None = None  # id of this layer's routed experts in the C++ expert bank


@_pytree
class Layer:
    attn_norm: jax.Array
    attn: MLA
    mlp_norm: jax.Array
    mlp: MLP | MoE


@_pytree
class Weights:
    embed: jax.Array  # [vocab, d]
    layers: list[Layer]
    norm: jax.Array
    lm_head: jax.Array  # [vocab, d]


@_pytree
class LayerCache:
    """The MLA cache of one layer: the normalised latent and the roped shared key, per position."""

    latent: jax.Array  # [b, s, r]
    k_rope: jax.Array  # [b, s, p]


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype, device=None) -> list[LayerCache]:
    return [
        LayerCache(
            latent=jnp.zeros((batch, length, cfg.kv_lora_rank), dtype, device=device),
            k_rope=jnp.zeros((batch, length, cfg.qk_rope_head_dim), dtype, device=device),
        )
        for _ in range(cfg.num_hidden_layers)
    ]


# ---------------------------------------------------------------------------------------------- RoPE


def rope_inv_freq(rope: RopeConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies [p/2] and the factor on cos/sin, with YaRN's ramp when configured."""
    dim = rope.dim
    exponents = np.arange(0, dim, 2, dtype=np.float32) / dim
    pos_freqs = rope.theta**exponents
    inv_freq = 1.0 / pos_freqs
    if rope.yarn_factor is None:
        return inv_freq.astype(np.float32), 1.0

    def correction_dim(rotations):
        return (
            dim
            * math.log(rope.original_max_position / (rotations * 2 * math.pi))
            / (2 * math.log(rope.theta))
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by the factor
    inv_freq = (inv_freq / rope.yarn_factor) * (1 - extrapolate) + inv_freq * extrapolate
    if rope.mscale and rope.mscale_all_dim:
        factor = yarn_mscale(rope.yarn_factor, rope.mscale) / yarn_mscale(
            rope.yarn_factor, rope.mscale_all_dim
        )
    else:
        factor = yarn_mscale(rope.yarn_factor, 1.0)
    return inv_freq.astype(np.float32), float(factor)


def rope_cos_sin(rope: RopeConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    inv_freq, factor = rope_inv_freq(rope)
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rope(rope: RopeConfig, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates pairs of x [..., p]: (x0, x1), (x2, x3), ... when interleaved, else (x_i, x_{i+p/2}).

    The result is laid out as [rotated firsts, rotated seconds]; queries and keys get the same layout,
    so their dot products are those of the reference whatever its output order.
    """
    if rope.interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = jnp.split(x, 2, axis=-1)
    x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ------------------------------------------------------------------------------------------- blocks


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def linear(x: jax.Array, w: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    y = jnp.einsum("...i,oi->...o", x, w)
    return y if bias is None else y + bias


def mlp(w: MLP, x: jax.Array) -> jax.Array:
    return linear(jax.nn.silu(linear(x, w.gate)) * linear(x, w.up), w.down)


def route(cfg: ModelConfig, router: jax.Array, correction_bias: jax.Array | None, x: jax.Array):
    """Top-k experts of each token x [T, d]: (ids [T, k] int32, weights [T, k] float32).

    Selection may use the correction bias and group limits; the weights are always the unbiased scores.
    """
    logits = jnp.einsum("td,ed->te", x.astype(jnp.float32), router.astype(jnp.float32))
    if cfg.scoring_func == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    choice = scores if correction_bias is None else scores + correction_bias
    if cfg.topk_method in ("noaux_tc", "group_limited_greedy") and cfg.n_group > 1:
        grouped = choice.reshape(x.shape[0], cfg.n_group, -1)
        if cfg.topk_method == "noaux_tc":
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
        else:
            group_scores = grouped.max(-1)
        _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
        keep = (
            jnp.zeros_like(group_scores, dtype=bool).at[jnp.arange(x.shape[0])[:, None], top_groups].set(True)
        )
        choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(x.shape[0], -1)
    _, ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * cfg.routed_scaling_factor


def routed_experts_dense(w: Experts, x: jax.Array, ids: jax.Array, weights: jax.Array) -> jax.Array:
    """Every expert on every token, combined by the routing weights (zero for unchosen experts).

    Differentiable and exact; its cost grows with the number of experts, so it serves small models
    (training the shipped model) rather than inference at DeepSeek-V3 scale.
    """
    combine = jnp.zeros((x.shape[0], w.gate.shape[0]), jnp.float32)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], ids].add(weights)
    hidden = jax.nn.silu(jnp.einsum("td,efd->tef", x, w.gate)) * jnp.einsum("td,efd->tef", x, w.up)
    return jnp.einsum("tef,edf,te->td", hidden, w.down, combine.astype(x.dtype))


@dataclasses.dataclass(frozen=True)
class ExpertSchedule:
    """Decode-time changes to which routed experts run when. Both change the model's function: off by default.

    The routed experts of a token are ranked by routing weight. Expert Skipping drops the lowest
    `n_skipped`; Expert Deferral (KTransformers §4) computes the next-lowest `n_deferred` concurrently with
    the next layer's attention and adds them one layer later, at every MoE layer but the last:
        O_k = I_k + S_k(I_k) + R_k^imm(I_k) + R_{k-1}^def(I_{k-1})
    """

    n_deferred: int = 0
    n_skipped: int = 0

    def check(self, cfg: ModelConfig):
        if self.n_deferred < 0 or self.n_skipped < 0:
            raise ValueError(f"n_deferred and n_skipped must be >= 0, got {self}")
        if self.n_deferred + self.n_skipped >= cfg.num_experts_per_tok:
            raise ValueError(
                f"{self} leaves no immediate expert of the {cfg.num_experts_per_tok} routed per token"
            )


@dataclasses.dataclass
class Started:
    """Routed experts handed to the CPU (or computed by XLA): their result, once `other` exists."""

    pending: jax.Array
    finish: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]  # (pending, other) -> (result, other)

    def result(self, other: jax.Array) -> tuple[jax.Array, jax.Array]:
        return self.finish(self.pending, other)


def _by_weight(ids: jax.Array, weights: jax.Array, sizes: tuple[int, ...]):
    """Splits each token's experts, ranked by routing weight, into consecutive groups of `sizes`."""
    order = jnp.argsort(-weights, axis=-1)
    ids, weights = jnp.take_along_axis(ids, order, -1), jnp.take_along_axis(weights, order, -1)
    bounds = np.cumsum((0, *sizes))
    return [(ids[:, a:b], weights[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _start_routed(w: MoE, tokens, ids, weights, slot: int) -> tuple[Started, jax.Array]:
    """Starts routed experts: (the Started job, tokens passed through, to order what uses them after)."""
    if w.experts is not None:
        return Started(routed_experts_dense(w.experts, tokens, ids, weights), lambda p, o: (p, o)), tokens
    pending, tokens = submit_routed_experts(tokens, ids, weights, layer=w.expert_layer, slot=slot)
    k = ids.shape[1]
    return Started(pending, lambda p, o: wait_routed_experts(p, o, top_k=k, slot=slot)), tokens


@dataclasses.dataclass
class MoEInFlight:
    """A MoE block between moe_start and moe_finish: its routed experts are being computed."""

    immediate: Started
    shared: jax.Array | None
    carried: Started | None  # the previous MoE layer's deferred experts, added here
    shape: tuple[int, ...]


def moe_start(
    cfg: ModelConfig,
    w: MoE,
    x: jax.Array,
    *,
    slot: int = 0,
    n_skipped: int = 0,
    n_deferred: int = 0,
    deferred_slot: int = 1,
    carried: Started | None = None,
):
    """Routes x [..., d], starts its routed experts and computes the shared experts meanwhile.

    Returns (the MoEInFlight, x's tokens passed through the hand-off (use them to order later work after
    it), the chosen experts [tokens, k], this layer's deferred experts as a Started or None). With
    n_deferred, the lowest-weighted experts are started here for the next MoE layer (`carried` there).
    """
    tokens = x.reshape(-1, x.shape[-1])
    chosen, weights = route(cfg, w.router, w.correction_bias, tokens)
    k = cfg.num_experts_per_tok - n_skipped - n_deferred
    if n_skipped or n_deferred:
        groups = _by_weight(chosen, weights, (k, n_deferred, n_skipped))
        (ids, imm_weights), (deferred_ids, deferred_weights) = groups[0], groups[1]
    else:
        ids, imm_weights = chosen, weights
    immediate, tokens = _start_routed(w, tokens, ids, imm_weights, slot)
    deferred = None
    if n_deferred:
        deferred, tokens = _start_routed(w, tokens, deferred_ids, deferred_weights, deferred_slot)
    with jax.named_scope("shared_experts"):
        shared = mlp(w.shared, tokens) if w.shared is not None else None
    return MoEInFlight(immediate, shared, carried, x.shape), tokens, chosen, deferred


def moe_finish(flight: MoEInFlight, other: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The MoE output once `other` exists (what the GPU computes meanwhile): (output, other)."""
    out, other = flight.immediate.result(other)
    if flight.shared is not None:
        out = out + flight.shared
    if flight.carried is not None:
        previous, out = flight.carried.result(out)
        out = out + previous
    return out.reshape(flight.shape), other


def moe(cfg: ModelConfig, w: MoE, x: jax.Array, **options):
    """The MoE block on x [..., d] -> (output, the experts chosen per token, deferred experts or None).

    On a GPU the shared experts run while the CPU computes the routed ones (the wait depends on them).
    `options` are moe_start's.
    """
    flight, tokens, chosen, deferred = moe_start(cfg, w, x, **options)
    out, _ = moe_finish(flight, flight.shared if flight.shared is not None else tokens)
    return out, chosen, deferred


def _queries(cfg: ModelConfig, w: MLA, x: jax.Array, cos, sin):
    """x [b, t, d] -> (q_nope [b, t, h, n], roped q_rope [b, t, h, p])."""
    if w.q_a is None:
        q = linear(x, w.q_b)
    else:
        q = linear(rms_norm(linear(x, w.q_a, w.q_a_bias), w.q_a_norm, LATENT_NORM_EPS), w.q_b)
    q = q.reshape(*x.shape[:2], cfg.num_attention_heads, cfg.qk_head_dim)
    q_nope, q_rope = jnp.split(q, [cfg.qk_nope_head_dim], axis=-1)
    return q_nope, apply_rope(cfg.rope, q_rope, cos[:, :, None], sin[:, :, None])


def _latents(cfg: ModelConfig, w: MLA, x: jax.Array, cos, sin):
    """x [b, t, d] -> what the cache stores: (normalised latent [b, t, r], roped shared key [b, t, p])."""
    kv = linear(x, w.kv_a, w.kv_a_bias)
    latent, k_rope = jnp.split(kv, [cfg.kv_lora_rank], axis=-1)
    return rms_norm(latent, w.kv_a_norm, LATENT_NORM_EPS), apply_rope(cfg.rope, k_rope, cos, sin)


def _kv_b(cfg: ModelConfig, w: MLA):
    """kv_b as per-head key and value up-projections: ([h, n, r], [h, v, r])."""
    kv_b = w.kv_b.reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    return kv_b[:, : cfg.qk_nope_head_dim], kv_b[:, cfg.qk_nope_head_dim :]


def _softmax(scores: jax.Array, mask: jax.Array, dtype) -> jax.Array:
    scores = jnp.where(mask, scores.astype(jnp.float32), -jnp.inf)
    return jax.nn.softmax(scores, axis=-1).astype(dtype)


def causal_attention(q_nope, q_rope, k_nope, k_rope, values, scale):
    """Dense causal attention of t queries over the same t positions, keys and values expanded per head:
    q_nope [b, t, h, n], q_rope [b, t, h, p], k_nope [b, t, h, n], k_rope [b, t, p], values [b, t, h, v]."""
    scores = jnp.einsum("bthn,bshn->bhts", q_nope, k_nope) + jnp.einsum("bthp,bsp->bhts", q_rope, k_rope)
    t = q_nope.shape[1]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    probs = _softmax(scores * scale, causal[None, None], values.dtype)
    return jnp.einsum("bhts,bshv->bthv", probs, values)


def attention_absorbed(cfg: ModelConfig, w: MLA, x: jax.Array, positions: jax.Array, cache: LayerCache):
    """MLA of new tokens x [b, t, d] at `positions` [b, t] against the latent cache (decode).

    kv_b is absorbed into the query and the output, so attention runs in the r-dimensional latent space
    and the cache is never expanded per head. The new tokens' latents are written first, then each
    query attends to the cache positions up to its own.
    """
    cos, sin = rope_cos_sin(cfg.rope, positions)
    q_nope, q_rope = _queries(cfg, w, x, cos, sin)
    latent, k_rope = _latents(cfg, w, x, cos, sin)
    rows = jnp.arange(x.shape[0])[:, None]
    cache = LayerCache(
        latent=cache.latent.at[rows, positions].set(latent.astype(cache.latent.dtype)),
        k_rope=cache.k_rope.at[rows, positions].set(k_rope.astype(cache.k_rope.dtype)),
    )
    wk, wv = _kv_b(cfg, w)
    q_latent = jnp.einsum("bthn,hnr->bthr", q_nope, wk)
    scores = jnp.einsum("bthr,bsr->bhts", q_latent, cache.latent) + jnp.einsum(
        "bthp,bsp->bhts", q_rope, cache.k_rope
    )
    visible = jnp.arange(cache.latent.shape[1])[None, None, None, :] <= positions[:, None, :, None]
    probs = _softmax(scores * cfg.softmax_scale, visible, x.dtype)
    out_latent = jnp.einsum("bhts,bsr->bthr", probs, cache.latent)
    out = jnp.einsum("bthr,hvr->bthv", out_latent, wv).reshape(*x.shape[:2], -1)
    return linear(out, w.o, w.o_bias), cache


def _feed_forward(cfg: ModelConfig, layer: Layer, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
    if isinstance(layer.mlp, MoE):
        out, expert_ids, _ = moe(cfg, layer.mlp, h)
        return x + out, expert_ids
    return x + mlp(layer.mlp, h), None


def _logits(cfg: ModelConfig, w: Weights, x: jax.Array) -> jax.Array:
    return linear(rms_norm(x, w.norm, cfg.rms_norm_eps), w.lm_head).astype(jnp.float32)


# ----------------------------------------------------------------------------------------- programs


def forward(cfg: ModelConfig, w: Weights, tokens: jax.Array, cache: list[LayerCache] | None = None):
    """Whole sequences tokens [b, t] from position 0 -> (float32 logits [b, t, vocab], the filled cache or
    None when cache=None, the experts each MoE layer chose [b*t, k]).

    Sequences are right-padded; causality keeps padding out of every real token's attention.
    """
    x = w.embed[tokens]
    new_cache, expert_ids = [], []
    for i, layer in enumerate(w.layers):
        with jax.named_scope(f"layer{i}"):
            x, layer_cache, ids = forward_layer(cfg, layer, x, None if cache is None else cache[i])
            if ids is not None:
                expert_ids.append(ids)
            new_cache.append(layer_cache)
    return _logits(cfg, w, x), (new_cache if cache is not None else None), expert_ids


def forward_layer(cfg: ModelConfig, layer: Layer, x: jax.Array, cache: LayerCache | None):
    """One layer of `forward` on x [b, t, d] -> (its output, the layer's cache with the prompt written at
    positions [0, t) or None when cache=None, the experts chosen per token [b*t, k] or None in a dense layer)."""
    h, (latent, k_rope) = attention_prefill(
        cfg, layer.attn, rms_norm(x, layer.attn_norm, cfg.rms_norm_eps), causal_attention
    )
    x, ids = _feed_forward(cfg, layer, x + h)
    return x, (None if cache is None else _write_prompt(cache, latent, k_rope)), ids


def _write_prompt(cache: LayerCache, latent: jax.Array, k_rope: jax.Array) -> LayerCache:
    """A layer's cache with a prompt's latents [b, t, r] and roped keys [b, t, p] written at positions [0, t)."""
    return LayerCache(
        latent=jax.lax.dynamic_update_slice(cache.latent, latent.astype(cache.latent.dtype), (0, 0, 0)),
        k_rope=jax.lax.dynamic_update_slice(cache.k_rope, k_rope.astype(cache.k_rope.dtype), (0, 0, 0)),
    )


def finite_stages(cfg: ModelConfig, w: Weights, tokens: jax.Array) -> jax.Array:
    """Whether the hidden states are all finite after each stage of `forward` over tokens [b, t]: bool
    [num_hidden_layers + 2] for the embeddings, each layer's output, then the logits. A diagnostic, run once
    logits were found not finite: the first False names the stage (weights, or config) that made them so."""
    x = w.embed[tokens]
    finite = [jnp.isfinite(x).all()]
    for layer in w.layers:
        x = forward_layer(cfg, layer, x, None)[0]
        finite.append(jnp.isfinite(x).all())
    finite.append(jnp.isfinite(_logits(cfg, w, x)).all())
    return jnp.stack(finite)


def prefill(cfg: ModelConfig, w: Weights, tokens: jax.Array, cache: list[LayerCache] | None = None):
    """Prompts tokens [b, t] (right-padded) -> (float32 logits [b, t, vocab], the filled cache)."""
    logits, cache, _ = forward(cfg, w, tokens, cache)
    return logits, cache


def decode_step(
    cfg: ModelConfig,
    w: Weights,
    tokens: jax.Array,
    positions: jax.Array,
    cache: list[LayerCache],
    schedule: ExpertSchedule = ExpertSchedule(),
):
    """One new token per sequence, tokens [b] at positions [b]: float32 logits [b, vocab], updated cache.

    `schedule` (static) turns on Expert Skipping or Expert Deferral; deferred experts alternate between
    two staging slots, since one layer's are still in flight when the next layer's start.
    """
    schedule.check(cfg)
    moe_layers = [i for i, layer in enumerate(w.layers) if isinstance(layer.mlp, MoE)]
    x = w.embed[tokens][:, None]
    new_cache, carried = [], None
    for i, layer in enumerate(w.layers):
        with jax.named_scope(f"layer{i}"):
            h, c = attention_absorbed(
                cfg, layer.attn, rms_norm(x, layer.attn_norm, cfg.rms_norm_eps), positions[:, None], cache[i]
            )
            new_cache.append(c)
            x = x + h
            h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
            if isinstance(layer.mlp, MoE):
                n = moe_layers.index(i)
                out, _, carried = moe(
                    cfg,
                    layer.mlp,
                    h,
                    n_skipped=schedule.n_skipped,
                    n_deferred=schedule.n_deferred if i != moe_layers[-1] else 0,
                    deferred_slot=1 + n % 2,
                    carried=carried,
                )
            else:
                out = mlp(layer.mlp, h)
            x = x + out
    return _logits(cfg, w, x)[:, 0], new_cache


def decode_step_dual(
    cfg: ModelConfig,
    w: Weights,
    tokens: tuple[jax.Array, jax.Array],
    positions: tuple[jax.Array, jax.Array],
    caches: tuple[list[LayerCache], list[LayerCache]],
    schedule: ExpertSchedule = ExpertSchedule(),
):
    """decode_step for two micro-batches A and B, interleaved so that each side's work hides the other's
    (OSDI '26 §3.3.1): while the CPU computes A's routed experts the GPU computes B's attention and shared
    experts, and the other way round. Same math as decode_step on each micro-batch.

    The order is data: each micro-batch takes back its routed experts only after the other has handed its
    own to the CPU (the wait's pass-through operand is the other's hand-off output). Returns
    ((logits A, logits B), (cache A, cache B)).
    """
    schedule.check(cfg)
    moe_layers = [i for i, layer in enumerate(w.layers) if isinstance(layer.mlp, MoE)]
    x = [w.embed[t][:, None] for t in tokens]
    new_caches: tuple[list, list] = ([], [])
    in_flight: list[MoEInFlight | None] = [None, None]
    carried: list[Started | None] = [None, None]

    def finish(m: int, other: jax.Array):
        out, _ = moe_finish(in_flight[m], other)
        x[m] = x[m] + out
        in_flight[m] = None

    for i, layer in enumerate(w.layers):
        handed_off = None  # A's tokens after its hand-off in this layer
        for m in (0, 1):
            with jax.named_scope(f"layer{i}/mb{m}"):
                if m == 1 and handed_off is not None:
                    # B's attention waits for A's hand-off even where no data says so (the first MoE layer),
                    # so that it always overlaps A's routed experts on the CPU.
                    x[1], _ = jax.lax.optimization_barrier((x[1], handed_off))
                with jax.named_scope("attention"):
                    h, c = attention_absorbed(
                        cfg, layer.attn, rms_norm(x[m], layer.attn_norm, cfg.rms_norm_eps), positions[m][:, None],
                        caches[m][i],
                    )
                new_caches[m].append(c)
                x[m] = x[m] + h
                h = rms_norm(x[m], layer.mlp_norm, cfg.rms_norm_eps)
                if not isinstance(layer.mlp, MoE):
                    x[m] = x[m] + mlp(layer.mlp, h)
                    continue
                n = moe_layers.index(i)
                flight, tokens_out, _, carried[m] = moe_start(
                    cfg,
                    layer.mlp,
                    h,
                    slot=3 * m,
                    n_skipped=schedule.n_skipped,
                    n_deferred=schedule.n_deferred if i != moe_layers[-1] else 0,
                    deferred_slot=3 * m + 1 + n % 2,
                    carried=carried[m],
                )
                other = 1 - m
                if in_flight[other] is not None:  # its experts ran on the CPU during this attention
                    finish(other, flight.shared if flight.shared is not None else tokens_out)
                in_flight[m] = flight
                if m == 0:
                    handed_off = tokens_out
    for m in (0, 1):
        if in_flight[m] is not None:
            finish(m, x[1 - m])
    return tuple(_logits(cfg, w, xm)[:, 0] for xm in x), new_caches


# ------------------------------------------------------------------- stream-loaded prefill, by pieces
# hybridjit.stream_prefill runs prefill layer by layer as separate executables, with the routed experts
# streamed to the device block by block. These are its pieces: the same math as `prefill`, arranged so that
# no piece needs all the experts of a layer, or the [t, s] attention scores of a whole long prompt, at once.


@dataclasses.dataclass(frozen=True)
class ChunkedAttention:
    """Causal attention core over queries in chunks of `chunk` tokens: the scores of one chunk against all keys
    ([b, h, chunk, s] float32) are the largest intermediate, so long prompts fit. Hashable: a static jit argument.

    Called as attend(q_nope [b, t, h, n], q_rope [b, t, h, p], k_nope [b, s, h, n], k_rope [b, s, p],
    values [b, s, h, v], scale) -> [b, t, h, v], with query i at position i and key j at position j.
    """

    chunk: int

    def __call__(self, q_nope, q_rope, k_nope, k_rope, values, scale):
        b, t = q_nope.shape[:2]
        n = -(-t // self.chunk)
        pad = ((0, 0), (0, n * self.chunk - t), (0, 0), (0, 0))
        q_nope, q_rope = jnp.pad(q_nope, pad), jnp.pad(q_rope, pad)
        keys = jnp.arange(k_nope.shape[1])

        def one(i):
            start = i * self.chunk
            qn = jax.lax.dynamic_slice_in_dim(q_nope, start, self.chunk, axis=1)
            qr = jax.lax.dynamic_slice_in_dim(q_rope, start, self.chunk, axis=1)
            scores = jnp.einsum("bthn,bshn->bhts", qn, k_nope) + jnp.einsum("bthp,bsp->bhts", qr, k_rope)
            causal = (start + jnp.arange(self.chunk))[:, None] >= keys[None, :]
            probs = _softmax(scores * scale, causal[None, None], values.dtype)
            return jnp.einsum("bhts,bshv->bthv", probs, values)

        out = jax.lax.map(one, jnp.arange(n))  # [n, b, chunk, h, v]
        return jnp.moveaxis(out, 0, 1).reshape(b, n * self.chunk, *out.shape[3:])[:, :t]


def attention_prefill(cfg: ModelConfig, w: MLA, x: jax.Array, attend: Callable):
    """Causal MLA over whole prompts x [b, t, d] from position 0, keys and values expanded per head (prefill),
    with the attention core `attend` (causal_attention, a ChunkedAttention, or a fused kernel of the same
    signature). Returns the output [b, t, d] and the (latent, k_rope) pair to store in the cache."""
    positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    cos, sin = rope_cos_sin(cfg.rope, positions)
    q_nope, q_rope = _queries(cfg, w, x, cos, sin)
    latent, k_rope = _latents(cfg, w, x, cos, sin)
    wk, wv = _kv_b(cfg, w)
    k_nope = jnp.einsum("bsr,hnr->bshn", latent, wk)
    values = jnp.einsum("bsr,hvr->bshv", latent, wv)
    out = attend(q_nope, q_rope, k_nope, k_rope, values, cfg.softmax_scale).reshape(*x.shape[:2], -1)
    return linear(out, w.o, w.o_bias), (latent, k_rope)


def prefill_attention_layer(cfg: ModelConfig, layer: Layer, x: jax.Array, cache: LayerCache, attend: Callable):
    """The attention half of one layer of `forward`: (x + attention, the layer's cache with the prompt written
    at positions [0, t))."""
    h, (latent, k_rope) = attention_prefill(cfg, layer.attn, rms_norm(x, layer.attn_norm, cfg.rms_norm_eps), attend)
    return x + h, _write_prompt(cache, latent, k_rope)


def dequantize_blocks(w: jax.Array, scale: jax.Array, block: tuple[int, int], dtype) -> jax.Array:
    """FP8 weights [..., out, in] with block scales [..., ceil(out/bo), ceil(in/bi)] -> dtype, on the device.

    Edge blocks may be partial: each scale is repeated over its block and cut to the weight's shape."""
    scale = jnp.repeat(jnp.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return (w.astype(jnp.float32) * scale[..., : w.shape[-2], : w.shape[-1]]).astype(dtype)


def group_by_expert(ids: jax.Array, weights: jax.Array, n_experts: int, capacity: int, first: int = 0, skip: int = 0):
    """Token-expert pairs (ids, weights [T, k] from route) of experts [first, first + n_experts) grouped by
    expert, `capacity` slots per expert; pairs of other experts are left out.

    Returns (rows [n_experts, capacity] int32: the token in each slot, T in empty slots; slot weights
    [n_experts, capacity] float32: its routing weight, 0 in empty slots). Each expert's pairs are taken in token
    order from its `skip`-th on (so calls with skip = 0, capacity, 2 x capacity, ... cover an expert's pairs
    in passes of bounded size); pairs beyond skip + capacity are dropped, never written into another expert's
    slots: dropless when skip = 0 and capacity >= the largest count among these experts. Calls on the same ids
    in one jit share their sort.
    """
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    expert = flat[order]
    counts = jnp.zeros(max(first + n_experts, 1), jnp.int32).at[flat].add(1, mode="drop")
    rank = jnp.arange(t * k) - (jnp.cumsum(counts) - counts)[jnp.clip(expert, 0, counts.shape[0] - 1)] - skip
    local = expert - first
    keep = (local >= 0) & (local < n_experts) & (rank >= 0) & (rank < capacity)
    slot = jnp.where(keep, local * capacity + rank, n_experts * capacity)
    rows = jnp.full(n_experts * capacity, t, jnp.int32).at[slot].set(order // k, mode="drop")
    slot_weights = jnp.zeros(n_experts * capacity, jnp.float32).at[slot].set(weights.reshape(-1)[order], mode="drop")
    return rows.reshape(n_experts, capacity), slot_weights.reshape(n_experts, capacity)


def experts_grouped(w: Experts, x: jax.Array, rows: jax.Array, slot_weights: jax.Array, out: jax.Array):
    """out [T, d] float32 plus the experts w (e of them, stacked) on their routed tokens of x [T, d].

    rows, slot_weights [e, c]: this block's slots from group_by_expert. Tokens are gathered per expert and the
    three projections run as batched GEMMs over the experts (never ragged_dot: DESIGN.md §5)."""
    xs = jnp.take(x, rows, axis=0, mode="fill", fill_value=0)  # [e, c, d]
    hidden = jax.nn.silu(jnp.einsum("ecd,efd->ecf", xs, w.gate)) * jnp.einsum("ecd,efd->ecf", xs, w.up)
    y = jnp.einsum("ecf,edf->ecd", hidden, w.down, preferred_element_type=jnp.float32)
    y = y * slot_weights[..., None]
    return out.at[rows.reshape(-1)].add(y.reshape(-1, x.shape[-1]), mode="drop")
