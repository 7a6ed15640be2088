"""Routers: which experts each token goes to and with what weight.

A family's config carries the fields read here: scoring_func ("sigmoid" or "softmax"), topk_method
("noaux_tc": sigmoid with a correction bias and group limits by top-2 sums; "greedy": plain top-k;
"group_limited_greedy": groups ranked by their max score), n_group, topk_group, num_experts_per_tok,
norm_topk_prob and routed_scaling_factor.
"""

import jax
import jax.numpy as jnp

from hybridjit.config import ConfigError, ConfigFields
from hybridjit.models.common.config import ModelConfig


def route(
    cfg: ModelConfig,
    router: jax.Array,
    correction_bias: jax.Array | None,
    x: jax.Array,
    router_bias: jax.Array | None = None,
):
    """Top-k experts of each token x [T, d]: (ids [T, k] int32, weights [T, k] float32).

    Selection may use the correction bias and group limits; the weights are always the unbiased scores. A router
    bias (gpt-oss: a linear layer's bias) is part of the logits, so of the weights too.
    """
    logits = jnp.einsum("td,ed->te", x.astype(jnp.float32), router.astype(jnp.float32))
    if router_bias is not None:
        logits = logits + router_bias.astype(jnp.float32)
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
        keep = jnp.zeros_like(group_scores, dtype=bool).at[jnp.arange(x.shape[0])[:, None], top_groups].set(True)
        choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(x.shape[0], -1)
    _, ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * cfg.routed_scaling_factor


def check_group_limits(source: str, method: str, n_routed: int, n_group: int, topk_group: int, top_k: int):
    """Group-limited routing keeps only the experts of topk_group groups: they must be enough to choose from."""
    if method not in ("noaux_tc", "group_limited_greedy") or n_group == 1:
        return
    per_group = n_routed // n_group
    if method == "noaux_tc" and per_group < 2:
        raise ConfigError(
            f"{source}: noaux_tc ranks each group by its top-2 scores: n_routed_experts / n_group must be >= 2, "
            f"got {n_routed} / {n_group}"
        )
    if top_k > topk_group * per_group:
        raise ConfigError(
            f"{source}: num_experts_per_tok {top_k} exceeds the {topk_group * per_group} experts of the topk_group "
            f"{topk_group} groups of {per_group} that routing keeps"
        )


def grouped_routing_fields(f: ConfigFields, method: str) -> dict:
    """The fields of a DeepSeek-style router (n_routed_experts, n_group, topk_group, num_experts_per_tok,
    n_shared_experts, norm_topk_prob, routed_scaling_factor), checked together for `method`."""
    source = f.source
    n_routed, n_group = f.integer("n_routed_experts", minimum=1), f.integer("n_group", 1, minimum=1)
    if n_routed % n_group:
        raise ConfigError(f"{source}: n_routed_experts {n_routed} is not divisible by n_group {n_group}")
    topk_group = f.integer("topk_group", n_group, minimum=1, maximum=(n_group, "n_group"))
    top_k = f.integer("num_experts_per_tok", minimum=1, maximum=(n_routed, "n_routed_experts"))
    check_group_limits(source, method, n_routed, n_group, topk_group, top_k)
    return dict(
        n_routed_experts=n_routed,
        n_group=n_group,
        topk_group=topk_group,
        num_experts_per_tok=top_k,
        n_shared_experts=f.integer("n_shared_experts", 0, minimum=0),
        routed_scaling_factor=f.number("routed_scaling_factor", 1.0, above=0),
    )
