"""The decoder every family shares: embeddings, layers of (attention, dense MLP or MoE block) with pre-norms and
residuals, final norm and LM head; whole-sequence prefill, one-token decode steps (with Expert Deferral and
Skipping), the dual-micro-batch decode step, the module-batched decode step (attention in micro-batches, routed
experts coalesced over all of them), and the pieces stream-loaded prefill runs layer by layer.

A family plugs its attention in as an `Attention` (MLA for DeepSeek, GQA for the others) and its weights as
`Layer`s of a `Weights` pytree; its model module wraps these functions with its Attention bound.

Einsum dimension names: b batch, t query tokens, s key/cache positions, d hidden, k experts per token.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from hybridjit.models.common.config import ModelConfig
from hybridjit.models.common.layers import MLP, linear, mlp, rms_norm
from hybridjit.models.common.moe import ExpertSchedule, MoE, MoEInFlight, Started, moe, moe_finish, moe_start
from hybridjit.models.common.pytree import pytree

NO_SCHEDULE = ExpertSchedule()  # neither deferral nor skipping


@dataclasses.dataclass(frozen=True)
class Attention:
    """A family's attention as the decoder calls it. Its members are module-level functions, so an Attention is
    hashable and the decoder's functions stay pure functions of static arguments.

    - prefill(cfg, w, x [b, t, d], attend) -> (out [b, t, d], entries): causal attention over whole prompts from
      position 0 with the attention core `attend`; entries are what the cache keeps of the prompt.
    - write_prompt(layer_cache, entries) -> the layer cache with the prompt's entries at positions [0, t).
    - decode(cfg, w, x [b, t, d], positions [b, t], layer_cache) -> (out, the updated layer cache).
    - causal: the dense causal core that whole-sequence prefill passes as `attend`.
    """

    prefill: Callable
    write_prompt: Callable
    decode: Callable
    causal: Callable


@pytree
class Layer:
    attn_norm: jax.Array
    attn: object  # the family's attention weights
    mlp_norm: jax.Array
    mlp: MLP | MoE


@pytree
class Weights:
    embed: jax.Array  # [vocab, d]
    layers: list[Layer]
    norm: jax.Array
    lm_head: jax.Array  # [vocab, d]


def _feed_forward(cfg: ModelConfig, layer: Layer, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
    if isinstance(layer.mlp, MoE):
        out, expert_ids, _ = moe(cfg, layer.mlp, h)
        return x + out, expert_ids
    return x + mlp(layer.mlp, h), None


def logits(cfg: ModelConfig, w: Weights, x: jax.Array) -> jax.Array:
    return linear(rms_norm(x, w.norm, cfg.rms_norm_eps), w.lm_head).astype(jnp.float32)


def forward(attention: Attention, cfg: ModelConfig, w: Weights, tokens: jax.Array, cache: list | None = None):
    """Whole sequences tokens [b, t] from position 0 -> (float32 logits [b, t, vocab], the filled cache or
    None when cache=None, the experts each MoE layer chose [b*t, k]).

    Sequences are right-padded; causality keeps padding out of every real token's attention.
    """
    x = w.embed[tokens]
    new_cache, expert_ids = [], []
    for i, layer in enumerate(w.layers):
        with jax.named_scope(f"layer{i}"):
            x, layer_cache, ids = forward_layer(attention, cfg, layer, x, None if cache is None else cache[i])
            if ids is not None:
                expert_ids.append(ids)
            new_cache.append(layer_cache)
    return logits(cfg, w, x), (new_cache if cache is not None else None), expert_ids


def forward_layer(attention: Attention, cfg: ModelConfig, layer: Layer, x: jax.Array, cache):
    """One layer of `forward` on x [b, t, d] -> (its output, the layer's cache with the prompt written at
    positions [0, t) or None when cache=None, the experts chosen per token [b*t, k] or None in a dense layer)."""
    h, entries = attention.prefill(cfg, layer.attn, rms_norm(x, layer.attn_norm, cfg.rms_norm_eps), attention.causal)
    x, ids = _feed_forward(cfg, layer, x + h)
    return x, (None if cache is None else attention.write_prompt(cache, entries)), ids


def finite_stages(attention: Attention, cfg: ModelConfig, w: Weights, tokens: jax.Array) -> jax.Array:
    """Whether the hidden states are all finite after each stage of `forward` over tokens [b, t]: bool
    [num_hidden_layers + 2] for the embeddings, each layer's output, then the logits. A diagnostic, run once
    logits were found not finite: the first False names the stage (weights, or config) that made them so."""
    x = w.embed[tokens]
    finite = [jnp.isfinite(x).all()]
    for layer in w.layers:
        x = forward_layer(attention, cfg, layer, x, None)[0]
        finite.append(jnp.isfinite(x).all())
    finite.append(jnp.isfinite(logits(cfg, w, x)).all())
    return jnp.stack(finite)


def prefill(attention: Attention, cfg: ModelConfig, w: Weights, tokens: jax.Array, cache: list | None = None):
    """Prompts tokens [b, t] (right-padded) -> (float32 logits [b, t, vocab], the filled cache)."""
    logits, cache, _ = forward(attention, cfg, w, tokens, cache)
    return logits, cache


def _decode_feed_forward(cfg, layer: Layer, h, moe_layers: list[int], i: int, schedule, carried, live):
    """Layer i's MLP or MoE block on normed h in a decode step: (output, the deferred experts to carry on, the
    experts chosen per token [tokens, k] or None in a dense layer). Deferred experts alternate between two staging
    slots; the last MoE layer defers none."""
    if not isinstance(layer.mlp, MoE):
        return mlp(layer.mlp, h), carried, None
    out, chosen, carried = moe(
        cfg,
        layer.mlp,
        h,
        n_skipped=schedule.n_skipped,
        n_deferred=schedule.n_deferred if i != moe_layers[-1] else 0,
        deferred_slot=1 + moe_layers.index(i) % 2,
        carried=carried,
        live=live,
    )
    return out, carried, chosen


def chosen_experts(chosen: list[jax.Array], live: jax.Array | None) -> jax.Array:
    """The experts each MoE layer chose per token, int32 [len(chosen), tokens, k] from the per-layer choices (each
    [tokens, k]), -1 for the tokens not `live` ([tokens] bool; None: all live). What a decode step with `tally`
    returns for counting the experts' use while serving (serving/online_placement.py); counted on the host, so the
    step gains one small output and no work."""
    ids = jnp.stack(chosen).astype(jnp.int32)
    return ids if live is None else jnp.where(live.reshape(1, -1, 1), ids, -1)


def extend(
    attention: Attention,
    cfg: ModelConfig,
    w: Weights,
    tokens: jax.Array,
    positions: jax.Array,
    cache: list,
    schedule: ExpertSchedule = NO_SCHEDULE,
    live: jax.Array | None = None,
    tally: bool = False,
):
    """New tokens [b, t] at positions [b, t] against the cache, whose entries they add: float32 logits
    [b, t, vocab] and the updated cache, and with `tally` (static) a third result, the experts each MoE layer
    chose for each live token (`chosen_experts`). One token per sequence is a decode step; several continue a prompt
    whose first part is already in the cache (chunked prefill, a prefix-cache hit). Positions past the cache's
    length write nothing, so a chunk may be right-padded.

    `schedule` (static) turns on Expert Skipping or Expert Deferral; deferred experts alternate between
    two staging slots, since one layer's are still in flight when the next layer's start. `live` [b] (bool)
    marks the sequences that count; the others' tokens run no routed experts (their logits are garbage).
    """
    schedule.check(cfg)
    moe_layers = [i for i, layer in enumerate(w.layers) if isinstance(layer.mlp, MoE)]
    x = w.embed[tokens]
    new_cache, carried, chosen = [], None, []
    for i, layer in enumerate(w.layers):
        with jax.named_scope(f"layer{i}"):
            x, c = decode_attention_layer(attention, cfg, layer, x, positions, cache[i])
            new_cache.append(c)
            h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
            live_tokens = None if live is None else jnp.broadcast_to(live[:, None], tokens.shape)
            out, carried, ids = _decode_feed_forward(cfg, layer, h, moe_layers, i, schedule, carried, live_tokens)
            chosen += [] if ids is None else [ids]
            x = x + out
    if tally:
        return logits(cfg, w, x), new_cache, chosen_experts(chosen, live_tokens)
    return logits(cfg, w, x), new_cache


def decode_step(
    attention: Attention,
    cfg: ModelConfig,
    w: Weights,
    tokens: jax.Array,
    positions: jax.Array,
    cache: list,
    schedule: ExpertSchedule = NO_SCHEDULE,
    live: jax.Array | None = None,
    tally: bool = False,
):
    """One new token per sequence, tokens [b] at positions [b]: float32 logits [b, vocab], updated cache (and
    with `tally` the experts chosen). `live` and `tally` as in extend."""
    logits, *rest = extend(attention, cfg, w, tokens[:, None], positions[:, None], cache, schedule, live, tally)
    return logits[:, 0], *rest


def decode_step_dual(
    attention: Attention,
    cfg: ModelConfig,
    w: Weights,
    tokens: tuple[jax.Array, jax.Array],
    positions: tuple[jax.Array, jax.Array],
    caches: tuple[list, list],
    schedule: ExpertSchedule = NO_SCHEDULE,
    live: tuple[jax.Array, jax.Array] | None = None,
    tally: bool = False,
):
    """decode_step for two micro-batches A and B, interleaved so that each side's work hides the other's
    (OSDI '26 §3.3.1): while the CPU computes A's routed experts the GPU computes B's attention and shared
    experts, and the other way round. Same math as decode_step on each micro-batch (`live`: each one's, as
    there).

    The order is data: each micro-batch takes back its routed experts only after the other has handed its
    own to the CPU (the wait's pass-through operand is the other's hand-off output). Returns
    ((logits A, logits B), (cache A, cache B)), and with `tally` the experts chosen for A's tokens then B's
    (extend's).
    """
    schedule.check(cfg)
    moe_layers = [i for i, layer in enumerate(w.layers) if isinstance(layer.mlp, MoE)]
    x = [w.embed[t][:, None] for t in tokens]
    new_caches: tuple[list, list] = ([], [])
    in_flight: list[MoEInFlight | None] = [None, None]
    carried: list[Started | None] = [None, None]
    chosen: tuple[list, list] = ([], [])

    def finish(m: int, other: jax.Array):
        out, _ = moe_finish(in_flight[m], other)
        x[m] = x[m] + out
        in_flight[m] = None

    for i, layer in enumerate(w.layers):
        handed_off = None  # A's tokens after its hand-off in this layer
        for m in (0, 1):
            with jax.named_scope(f"layer{i}/mb{m}"):
                if in_flight[m] is not None:
                    # Its routed experts of the last layer were not taken back by the other micro-batch's MoE
                    # start (this is a dense layer after a MoE layer, as Qwen3's mlp_only_layers make): take
                    # them back before its attention reads x.
                    finish(m, x[1 - m])
                if m == 1 and handed_off is not None:
                    # B's attention waits for A's hand-off even where no data says so (the first MoE layer),
                    # so that it always overlaps A's routed experts on the CPU.
                    x[1], _ = jax.lax.optimization_barrier((x[1], handed_off))
                with jax.named_scope("attention"):
                    h, c = attention.decode(
                        cfg,
                        layer.attn,
                        rms_norm(x[m], layer.attn_norm, cfg.rms_norm_eps),
                        positions[m][:, None],
                        caches[m][i],
                    )
                new_caches[m].append(c)
                x[m] = x[m] + h
                h = rms_norm(x[m], layer.mlp_norm, cfg.rms_norm_eps)
                if not isinstance(layer.mlp, MoE):
                    x[m] = x[m] + mlp(layer.mlp, h)
                    continue
                n = moe_layers.index(i)
                flight, tokens_out, ids, carried[m] = moe_start(
                    cfg,
                    layer.mlp,
                    h,
                    slot=3 * m,
                    n_skipped=schedule.n_skipped,
                    n_deferred=schedule.n_deferred if i != moe_layers[-1] else 0,
                    deferred_slot=3 * m + 1 + n % 2,
                    carried=carried[m],
                    live=None if live is None else live[m],
                )
                chosen[m].append(ids)
                other = 1 - m
                if in_flight[other] is not None:  # its experts ran on the CPU during this attention
                    finish(other, flight.shared if flight.shared is not None else tokens_out)
                in_flight[m] = flight
                if m == 0:
                    handed_off = tokens_out
    for m in (0, 1):
        if in_flight[m] is not None:
            finish(m, x[1 - m])
    out = tuple(logits(cfg, w, xm)[:, 0] for xm in x), new_caches
    if tally:
        ids = [chosen_experts(chosen[m], None if live is None else live[m]) for m in (0, 1)]
        return *out, jnp.concatenate(ids, axis=1)
    return out


def decode_step_grouped(
    attention: Attention,
    cfg: ModelConfig,
    w: Weights,
    tokens: tuple[jax.Array, ...],
    positions: tuple[jax.Array, ...],
    caches: tuple[list, ...],
    schedule: ExpertSchedule = NO_SCHEDULE,
    live: tuple[jax.Array, ...] | None = None,
    tally: bool = False,
):
    """decode_step for micro-batches of their own caches, batched by module (MoE-Gen): each layer's attention runs
    micro-batch by micro-batch over its cache, then the layer's MoE block runs once over the tokens of all of them,
    so each routed expert gets one GEMM per layer per step over every token routed to it (CoX-MoE's coalesced
    execution; dual-batch overlap instead gives each micro-batch its own expert call). The micro-batches bound
    what one attention call holds: the unit a cache kept in host memory would be streamed in. Same math as
    decode_step on the micro-batches concatenated. Returns (logits per micro-batch, caches per micro-batch), and
    with `tally` the experts chosen for all their tokens (extend's).
    """
    sizes = [t.shape[0] for t in tokens]
    bounds = [sum(sizes[:m]) for m in range(len(sizes) + 1)]
    everyone = None if live is None else jnp.concatenate(live)[:, None]
    x = jnp.concatenate([w.embed[t] for t in tokens])[:, None]
    new_caches: tuple[list, ...] = tuple([] for _ in tokens)
    moe_layers = [i for i, layer in enumerate(w.layers) if isinstance(layer.mlp, MoE)]
    schedule.check(cfg)
    carried, chosen = None, []
    for i, layer in enumerate(w.layers):
        with jax.named_scope(f"layer{i}"):
            normed = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
            outs = []
            for m in range(len(tokens)):
                with jax.named_scope(f"mb{m}/attention"):
                    h, c = attention.decode(
                        cfg, layer.attn, normed[bounds[m] : bounds[m + 1]], positions[m][:, None], caches[m][i]
                    )
                outs.append(h)
                new_caches[m].append(c)
            x = x + jnp.concatenate(outs)
            h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
            out, carried, ids = _decode_feed_forward(cfg, layer, h, moe_layers, i, schedule, carried, everyone)
            chosen += [] if ids is None else [ids]
            x = x + out
    out = logits(cfg, w, x)[:, 0]
    result = tuple(out[bounds[m] : bounds[m + 1]] for m in range(len(tokens))), new_caches
    return (*result, chosen_experts(chosen, everyone)) if tally else result


def prefill_attention_layer(
    attention: Attention, cfg: ModelConfig, layer: Layer, x: jax.Array, cache, attend: Callable
):
    """The attention half of one layer of `forward`: (x + attention, the layer's cache with the prompt written
    at positions [0, t))."""
    h, entries = attention.prefill(cfg, layer.attn, rms_norm(x, layer.attn_norm, cfg.rms_norm_eps), attend)
    return x + h, attention.write_prompt(cache, entries)


def decode_attention_layer(attention: Attention, cfg: ModelConfig, layer: Layer, x: jax.Array, positions, cache):
    """The attention half of one layer of `extend`: (x + attention of tokens x [b, t, d] at positions [b, t] against
    the layer's cache, the cache with their entries added)."""
    h, cache = attention.decode(cfg, layer.attn, rms_norm(x, layer.attn_norm, cfg.rms_norm_eps), positions, cache)
    return x + h, cache


def bind(attention: Attention) -> tuple[Callable, ...]:
    """The decoder's functions with one family's attention bound, as its model module exports them: (forward,
    forward_layer, finite_stages, prefill, extend, decode_step, decode_step_dual, decode_step_grouped,
    prefill_attention_layer, decode_attention_layer)."""
    functions = (
        forward,
        forward_layer,
        finite_stages,
        prefill,
        extend,
        decode_step,
        decode_step_dual,
        decode_step_grouped,
        prefill_attention_layer,
        decode_attention_layer,
    )
    return tuple(functools.partial(f, attention) for f in functions)
