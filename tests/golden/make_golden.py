"""Makes the Hugging Face transformers reference outputs that tests/test_vs_transformers.py compares against.

Run in the reference venv (torch + transformers 5.23, float32, CPU):
    /work/main/.venv-ref/bin/python tests/golden/make_golden.py [case ...] [--sensitivity]

For each case of checkpoint_factory.GOLDEN_CASES it builds the checkpoint, loads it with
AutoModelForCausalLM and writes tests/golden/<case>.npz. FP8 cases load a float32 copy dequantized by
checkpoint_factory: transformers' FP8 loader needs accelerate, and its dequantizer (Fp8Dequantize) infers
the block size as rows // scale_rows, which is wrong for partial edge blocks (200 columns, 2 scale
columns -> 100-wide blocks). Before writing it proves that the reference is worth comparing
against: every model weight equals the checkpoint's (no random initialisation, experts in order),
transformers computed YaRN and the correction bias, an independent numpy router agrees with
transformers' routing, activations are healthy, and the prompts are far from ties (greedy steps and
routing decisions), so float32 rounding in another engine cannot flip a token or an expert.

The cases of checkpoint_factory.FAMILY_CASES (Qwen3-MoE, Mixtral, GLM-4.5, MiniMax-M2, gpt-oss; issue
#21) go through make_family_case with the same proofs written per family (see the section "the other
MoE families" below and tests/golden/README.md). gpt-oss's MXFP4 experts load as stored, decoded by
transformers itself (Mxfp4Config(dequantize=True)), and must equal checkpoint_factory's numpy decoding;
MiniMax-M2's FP8 loads as a float32 copy decoded by checkpoint_factory, and transformers' own FP8 block
dequantizer is checked against it on every full block. Their prompts are redrawn until every routing
decision is at least 1e-3 from a tie.

--sensitivity also prints how far the logits move under typical engine bugs (each applied to the
transformers model), to show which bugs the 2% logits tolerance catches; for the families it turns off
each family-specific feature in turn.
"""

import argparse
import json
import math
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import checkpoint_factory as cf  # noqa: E402

GOLDEN_DIR = Path(__file__).resolve().parent
PROMPT_LENGTHS = (12, 7)
NEW_TOKENS = 8
# Prompts are redrawn until every routing decision (prompt and continuation tokens, every MoE layer) has
# at least this margin in selection-score units; float32 rounding moves scores by ~1e-7.
MIN_ROUTING_MARGIN = 1e-5
# ... and every greedy step wins by at least this many logits.
MIN_GREEDY_GAP = 1e-2
MAX_PROMPT_DRAWS = 200


# ---------------------------------------------------------------- independent numpy reference router


def reference_route(config: dict, weight: np.ndarray, bias: np.ndarray | None, hidden: np.ndarray):
    """(ids [T, K] sorted, weights [T, K], margin [T]) in float64, written independently of transformers.

    margin: how far the decision is from a tie, in selection-score units: the smaller of (the k-th chosen
    minus the best unchosen expert among the allowed groups) and (the last chosen minus the best unchosen
    group score). Group scores: sum of the top-2 biased scores (noaux_tc) or the best score
    (group_limited_greedy).
    """
    logits = hidden.astype(np.float64) @ weight.astype(np.float64).T
    method, k = config["topk_method"], config["num_experts_per_tok"]
    if method == "noaux_tc":
        scores = 1.0 / (1.0 + np.exp(-logits))
        choice = scores + (0.0 if bias is None else bias.astype(np.float64))
    else:
        exp = np.exp(logits - logits.max(-1, keepdims=True))
        scores = exp / exp.sum(-1, keepdims=True)
        choice = scores
    tokens, experts = choice.shape
    margin = np.full(tokens, np.inf)
    if method in ("noaux_tc", "group_limited_greedy") and config["topk_group"] < config["n_group"]:
        grouped = np.sort(choice.reshape(tokens, config["n_group"], -1), axis=-1)
        group_score = grouped[..., -2:].sum(-1) if method == "noaux_tc" else grouped[..., -1]
        order = np.argsort(-group_score, axis=-1)
        kept = order[:, : config["topk_group"]]
        ranked = np.take_along_axis(group_score, order, -1)
        margin = ranked[:, config["topk_group"] - 1] - ranked[:, config["topk_group"]]
        allowed = np.zeros((tokens, config["n_group"]), bool)
        np.put_along_axis(allowed, kept, True, -1)
        choice = np.where(np.repeat(allowed, experts // config["n_group"], axis=-1), choice, -np.inf)
    order = np.argsort(-choice, axis=-1)
    ranked = np.take_along_axis(choice, order, -1)
    margin = np.minimum(margin, ranked[:, k - 1] - ranked[:, k])
    ids = np.sort(order[:, :k], axis=-1)
    weights = np.take_along_axis(scores, ids, -1)
    if method == "noaux_tc" and config["norm_topk_prob"]:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids, weights * config["routed_scaling_factor"], margin


def reference_yarn(config: dict) -> tuple[np.ndarray, float, float]:
    """(inv_freq, cos/sin factor, softmax scale) per the YaRN paper and DeepSeek's attention scaling."""
    rope = config["rope_scaling"]
    dim, base, factor = config["qk_rope_head_dim"], config["rope_theta"], rope["factor"]

    def mscale(m):
        return 0.1 * m * math.log(factor) + 1.0

    def correction_dim(rotations):
        return (
            dim
            * math.log(rope["original_max_position_embeddings"] / (rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low = max(math.floor(correction_dim(rope["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(rope["beta_slow"])), dim - 1)
    extrapolation = 1.0 - np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    plain = base ** (-np.arange(0, dim, 2) / dim)
    inv_freq = plain / factor * (1 - extrapolation) + plain * extrapolation
    qk_head_dim = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    softmax_scale = qk_head_dim**-0.5 * mscale(rope["mscale_all_dim"]) ** 2
    return inv_freq, mscale(rope["mscale"]) / mscale(rope["mscale_all_dim"]), softmax_scale


# ---------------------------------------------------------------- loading and proving the reference


def moe_layers(config: dict) -> list[int]:
    return list(range(config["first_k_dense_replace"], config["num_hidden_layers"]))


def expected_state_dict(config: dict, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The state dict transformers should hold: checkpoint tensors, per-expert ones fused as
    gate_up_proj [E, 2*inter, H] (gate rows first) and down_proj [E, H, inter]."""
    expected = {
        n: t for n, t in tensors.items() if not n.startswith(f"model.layers.{config['num_hidden_layers']}.")
    }
    for layer in moe_layers(config):
        p = f"model.layers.{layer}.mlp.experts."
        experts = range(config["n_routed_experts"])
        gate = [expected.pop(f"{p}{e}.gate_proj.weight") for e in experts]
        up = [expected.pop(f"{p}{e}.up_proj.weight") for e in experts]
        down = [expected.pop(f"{p}{e}.down_proj.weight") for e in experts]
        expected[p + "gate_up_proj"] = np.stack([np.concatenate(gu) for gu in zip(gate, up, strict=True)])
        expected[p + "down_proj"] = np.stack(down)
    return expected


def load_reference(checkpoint: Path, workdir: Path):
    """The transformers model of a checkpoint, after proving it holds exactly the checkpoint's weights."""
    config = json.loads((checkpoint / "config.json").read_text())
    source = checkpoint
    if "quantization_config" in config:
        source = cf.dequantized_copy(checkpoint, workdir / "dequantized")
    model, info = AutoModelForCausalLM.from_pretrained(
        source, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    model.eval()
    mtp_prefix = f"model.layers.{config['num_hidden_layers']}."
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["error_msgs"], info
    assert all(k.startswith(mtp_prefix) for k in info["unexpected_keys"]), info["unexpected_keys"]
    assert bool(info["unexpected_keys"]) == (config.get("num_nextn_predict_layers", 0) > 0)

    expected = expected_state_dict(config, cf.as_float32(cf.read_tensors(checkpoint)))
    actual = {k: v.numpy() for k, v in model.state_dict().items()}
    assert sorted(actual) == sorted(expected), set(actual) ^ set(expected)
    for name, value in expected.items():
        assert np.array_equal(actual[name], value), f"transformers holds a different {name}"
    return model, config


def check_rope(model, config: dict):
    inv_freq, cos_sin_factor, softmax_scale = reference_yarn(config)
    rotary = model.model.rotary_emb
    assert rotary.rope_type == "yarn", rotary.rope_type
    np.testing.assert_allclose(rotary.inv_freq.numpy(), inv_freq, rtol=1e-6)
    plain = config["rope_theta"] ** (
        -np.arange(0, config["qk_rope_head_dim"], 2) / config["qk_rope_head_dim"]
    )
    assert not np.allclose(inv_freq, plain), "YaRN must change some frequencies"
    np.testing.assert_allclose(rotary.attention_scaling, cos_sin_factor, rtol=1e-12)
    qk_head_dim = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    assert softmax_scale != qk_head_dim**-0.5
    for layer in model.model.layers:
        np.testing.assert_allclose(layer.self_attn.scaling, softmax_scale, rtol=1e-12)


@contextmanager
def router_capture(model, config: dict):
    """Records, per MoE layer, the router's input rows and transformers' top-k (sorted by expert id)."""
    records = {layer: [] for layer in moe_layers(config)}

    def hook(layer):
        def record(module, args, output):
            _, weights, ids = output
            order = torch.argsort(ids, dim=-1)
            records[layer].append(
                (
                    args[0].reshape(-1, config["hidden_size"]).numpy().copy(),
                    torch.gather(ids, -1, order).numpy(),
                    torch.gather(weights, -1, order).numpy(),
                )
            )

        return record

    handles = [model.model.layers[layer].mlp.gate.register_forward_hook(hook(layer)) for layer in records]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def router_params(model, layer: int):
    gate = model.model.layers[layer].mlp.gate
    bias = getattr(gate, "e_score_correction_bias", None)
    return gate.weight.detach().numpy(), None if bias is None else bias.numpy()


@torch.no_grad()
def run_prompt(model, config: dict, prompt: list[int]):
    """Logits and routing of one prompt, its greedy continuation, and how close to a tie each decision was."""
    ids = torch.tensor([prompt])
    generated = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        use_cache=True,
        pad_token_id=config["eos_token_id"],
    )[0, len(prompt) :].tolist()
    with router_capture(model, config) as routing:
        out = model(ids, output_hidden_states=True, output_attentions=True)
    # One uncached pass over prompt + continuation: every greedy step and its routing.
    with router_capture(model, config) as extended_routing:
        extended = model(torch.tensor([prompt + generated[:-1]])).logits[0].numpy()
    steps = extended[len(prompt) - 1 :]
    assert steps.argmax(-1).tolist() == generated, "cached generation disagrees with the uncached forward"
    top2 = np.sort(steps, axis=-1)[:, -2:]
    margins = []
    for layer, [(hidden, _, _)] in extended_routing.items():
        margins.append(reference_route(config, *router_params(model, layer), hidden)[2].min())
    return {
        "logits": out.logits[0].numpy(),
        "generated": generated,
        "routing": {layer: record[0] for layer, record in routing.items()},
        "hidden_states": [h[0].numpy() for h in out.hidden_states],
        "attentions": [a[0].numpy() for a in out.attentions],
        "greedy_gap": float((top2[:, 1] - top2[:, 0]).min()),
        "routing_margin": float(min(margins)),
    }


def choose_prompts(model, config: dict, seed: int):
    """The first draw of prompts whose every greedy step and routing decision is clear of ties, and whose
    continuations neither stop at EOS (engines may differ in what they return then) nor loop."""
    for draw in range(MAX_PROMPT_DRAWS):
        rng = np.random.default_rng([seed, draw])
        prompts = [
            [config["bos_token_id"]] + rng.integers(2, config["vocab_size"], n - 1).tolist()
            for n in PROMPT_LENGTHS
        ]
        runs = [run_prompt(model, config, p) for p in prompts]
        if all(
            r["greedy_gap"] >= MIN_GREEDY_GAP
            and r["routing_margin"] >= MIN_ROUTING_MARGIN
            and config["eos_token_id"] not in r["generated"]
            and len(set(r["generated"])) > NEW_TOKENS // 2  # a repetition loop would test few decode steps
            for r in runs
        ):
            return prompts, runs, draw
    raise RuntimeError(f"no prompt draw out of {MAX_PROMPT_DRAWS} is clear of ties")


def check_health(runs, config: dict):
    """Random weights that saturate (one-hot softmax, exploding residual) would hide real bugs."""
    for run in runs:
        rms = [float(np.sqrt((h**2).mean())) for h in run["hidden_states"]]
        assert all(0.3 < r < 30 for r in rms), f"hidden RMS per layer {rms}"
        for attention in run["attentions"]:
            peak = attention[:, 3:, :].max(-1).mean()  # rows 0..2 have few keys to spread over
            assert peak < 0.8, f"attention is nearly one-hot (mean peak {peak:.2f})"
        logits = run["logits"]
        assert 0.3 < logits.std() < 10, f"logit std {logits.std()}"
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        assert probs.max(-1).mean() < 0.5, "next-token distribution is nearly one-hot"


def check_routing(model, config: dict, runs) -> dict:
    """transformers' routing equals the numpy reference; the correction bias changes some choices."""
    stats = {"tokens": 0, "bias_changed": 0, "below_1e-3": 0}
    for layer in moe_layers(config):
        weight, bias = router_params(model, layer)
        hidden = np.concatenate([r["routing"][layer][0] for r in runs])
        hf_ids = np.concatenate([r["routing"][layer][1] for r in runs])
        hf_weights = np.concatenate([r["routing"][layer][2] for r in runs])
        ids, weights, margin = reference_route(config, weight, bias, hidden)
        np.testing.assert_array_equal(hf_ids, ids)
        np.testing.assert_allclose(hf_weights, weights, rtol=1e-5)
        stats["tokens"] += len(ids)
        stats["below_1e-3"] += int((margin <= 1e-3).sum())
        if bias is not None:
            assert np.any(bias != 0)
            unbiased_ids = reference_route(config, weight, None, hidden)[0]
            stats["bias_changed"] += int(np.any(unbiased_ids != ids, axis=-1).sum())
    if config["topk_method"] == "noaux_tc":
        assert stats["bias_changed"] > 0, "the correction bias never changes the top-k: it would go untested"
    return stats


def golden_arrays(model, config: dict, digest: str, prompts, runs) -> dict[str, np.ndarray]:
    arrays = {"digest": np.array(digest), "config_json": np.array(json.dumps(config, sort_keys=True))}
    for i, (prompt, run) in enumerate(zip(prompts, runs, strict=True)):
        arrays[f"prompt{i}_ids"] = np.array(prompt, np.int32)
        arrays[f"prompt{i}_logits"] = run["logits"].astype(np.float32)
        arrays[f"prompt{i}_generated"] = np.array(run["generated"], np.int32)
    arrays["moe_layers"] = np.array(moe_layers(config), np.int32)
    for layer in moe_layers(config):
        hidden, ids, weights = (
            np.concatenate(part) for part in zip(*(r["routing"][layer] for r in runs), strict=True)
        )
        arrays[f"layer{layer}_router_input"] = hidden.astype(np.float32)
        arrays[f"layer{layer}_topk_ids"] = ids.astype(np.int32)
        arrays[f"layer{layer}_topk_weights"] = weights.astype(np.float32)
        margin = reference_route(config, *router_params(model, layer), hidden)[2]
        arrays[f"layer{layer}_margin"] = margin.astype(np.float32)
    return arrays


# ---------------------------------------------------------------- sensitivity: typical engine bugs


@contextmanager
def patched(obj, **attributes):
    saved = {name: getattr(obj, name) for name in attributes}
    for name, value in attributes.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(obj, name, value)


@contextmanager
def each(contexts):
    contexts = list(contexts)
    for c in contexts:
        c.__enter__()
    try:
        yield
    finally:
        for c in reversed(contexts):
            c.__exit__(None, None, None)


def _gates(model, config):
    return [model.model.layers[layer].mlp.gate for layer in moe_layers(config)]


def _router_reweighted(gate, weigh):
    """The gate with the same expert choice but weights recomputed by weigh(gate, router_logits, ids)."""
    original = gate.forward

    def forward(hidden):
        logits, _, ids = original(hidden)
        return logits, weigh(gate, logits, ids), ids

    return patched(gate, forward=forward)


def _biased_weights(gate, logits, ids):
    weights = (logits.sigmoid() + gate.e_score_correction_bias).gather(1, ids)
    return weights / (weights.sum(-1, keepdim=True) + 1e-20) * gate.routed_scaling_factor


def _renormalised(gate, logits, ids):
    scores = logits.sigmoid() if hasattr(gate, "e_score_correction_bias") else logits.softmax(-1)
    weights = scores.gather(1, ids)
    return weights / weights.sum(-1, keepdim=True) * gate.routed_scaling_factor


@contextmanager
def _weights_replaced(model, replace):
    """Parameters replaced by replace(state_dict) (a dict of new values), restored afterwards."""
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    new = replace({k: v.clone() for k, v in saved.items()})
    model.load_state_dict({**saved, **new})
    try:
        yield
    finally:
        model.load_state_dict(saved)


def _experts_permuted(state, config, permutation):
    return {
        k: v[permutation]
        for k, v in state.items()
        if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj")
    }


def _fp8_misdequantized(config, checkpoint_tensors, scale_of_block):
    """The state dict with FP8 projections dequantized using scale_of_block(scale_inv, bi, bj)."""
    wrong = {}
    for name, value in checkpoint_tensors.items():
        if name + "_scale_inv" not in checkpoint_tensors:
            continue
        scale_inv = checkpoint_tensors[name + "_scale_inv"]
        fixed = np.array(
            [
                [scale_of_block(scale_inv, bi, bj) for bj in range(scale_inv.shape[1])]
                for bi in range(scale_inv.shape[0])
            ],
            np.float32,
        )
        wrong[name] = cf.dequantize_fp8(value, fixed)
    untouched = {n: v for n, v in cf.as_float32(checkpoint_tensors).items() if n not in wrong}
    return expected_state_dict(config, {**untouched, **wrong})


def mutations(model, config, checkpoint_tensors):
    """(description, context manager factory) of bugs an engine could plausibly have."""
    rotary = model.model.rotary_emb
    attentions = [layer.self_attn for layer in model.model.layers]
    gates = _gates(model, config)
    qk_head_dim = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    rope_dim = config["qk_rope_head_dim"]
    plain_inv_freq = torch.tensor(
        config["rope_theta"] ** (-np.arange(0, rope_dim, 2) / rope_dim), dtype=torch.float32
    )
    experts = config["n_routed_experts"]
    lexicographic = sorted(range(experts), key=str)
    out = [
        ("plain RoPE frequencies (YaRN ignored)", lambda: patched(rotary, inv_freq=plain_inv_freq)),
        (
            "softmax scale without YaRN mscale^2",
            lambda: each(patched(a, scaling=qk_head_dim**-0.5) for a in attentions),
        ),
        (
            "softmax scale from qk_nope_head_dim only",
            lambda: each(
                patched(a, scaling=a.scaling * (qk_head_dim / config["qk_nope_head_dim"]) ** 0.5)
                for a in attentions
            ),
        ),
        (
            "kv_a_layernorm skipped",
            lambda: each(patched(a.kv_a_layernorm, forward=lambda x: x) for a in attentions),
        ),
        (
            "shared experts dropped",
            lambda: each(
                patched(model.model.layers[layer].mlp.shared_experts, forward=torch.zeros_like)
                for layer in moe_layers(config)
            ),
        ),
        (
            "experts in lexicographic order (0,1,10,11,...)",
            lambda: _weights_replaced(model, lambda s: _experts_permuted(s, config, lexicographic)),
        ),
        (
            "gate_proj and up_proj swapped",
            lambda: _weights_replaced(
                model,
                lambda s: {
                    k: torch.cat(v.chunk(2, dim=1)[::-1], dim=1)
                    for k, v in s.items()
                    if k.endswith("gate_up_proj")
                },
            ),
        ),
        (
            "lm_head tied to embed_tokens",
            lambda: _weights_replaced(model, lambda s: {"lm_head.weight": s["model.embed_tokens.weight"]}),
        ),
    ]
    if config["topk_group"] < config["n_group"]:
        out.append(("group limit ignored", lambda: each(patched(g, topk_group=g.num_group) for g in gates)))
    if config["routed_scaling_factor"] != 1.0:
        out.append(
            (
                "routed_scaling_factor ignored",
                lambda: each(patched(g, routed_scaling_factor=1.0) for g in gates),
            )
        )
    if rotary.attention_scaling != 1.0:
        out.append(("YaRN cos/sin factor ignored", lambda: patched(rotary, attention_scaling=1.0)))
    if config["model_type"] == "deepseek_v3":
        out.append(
            (
                "rope rotate-half instead of interleaved pairs",
                lambda: patched(model.config, rope_interleave=False),
            )
        )
    if config["topk_method"] == "noaux_tc":
        zero = torch.zeros(experts)
        out += [
            (
                "correction bias ignored",
                lambda: each(patched(g, e_score_correction_bias=zero) for g in gates),
            ),
            (
                "correction bias also in the weights",
                lambda: each(_router_reweighted(g, _biased_weights) for g in gates),
            ),
            ("top-k weights not normalised", lambda: each(patched(g, norm_topk_prob=False) for g in gates)),
        ]
    else:
        out.append(
            (
                "top-k weights normalised (V2 must not)",
                lambda: each(_router_reweighted(g, _renormalised) for g in gates),
            )
        )
    if "quantization_config" in config:
        tensors = checkpoint_tensors
        out += [
            (
                "FP8: one scale per matrix",
                lambda: _weights_replaced(
                    model,
                    lambda s: _to_torch(_fp8_misdequantized(config, tensors, lambda sc, i, j: sc[0, 0])),
                ),
            ),
            (
                "FP8: partial edge blocks take their neighbour's scale",
                lambda: _weights_replaced(
                    model,
                    lambda s: _to_torch(
                        _fp8_misdequantized(
                            config,
                            tensors,
                            lambda sc, i, j: sc[
                                max(i - (i == sc.shape[0] - 1), 0), max(j - (j == sc.shape[1] - 1), 0)
                            ],
                        )
                    ),
                ),
            ),
        ]
    return out


def _to_torch(arrays):
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}


def relative_rms(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.sqrt(((ours - reference) ** 2).mean() / (reference**2).mean()))


@torch.no_grad()
def sensitivity(model, config, checkpoint_tensors, prompts, runs):
    reference = np.concatenate([r["logits"] for r in runs])
    rows = []
    for description, mutation in mutations(model, config, checkpoint_tensors):
        with mutation():
            logits = np.concatenate([model(torch.tensor([p])).logits[0].numpy() for p in prompts])
        changed = int((logits.argmax(-1) != reference.argmax(-1)).sum())
        rows.append((description, relative_rms(logits, reference), changed))
    after = np.concatenate([model(torch.tensor([p])).logits[0].numpy() for p in prompts])
    assert np.array_equal(after, reference), "a mutation was not undone"
    return rows


# ================================================================ the other MoE families (issue #21)
#
# Qwen3-MoE, Mixtral, GLM-4.5, MiniMax-M2 and gpt-oss (checkpoint_factory.FAMILY_CASES). Same proofs as
# for DeepSeek, written per family: transformers holds exactly the checkpoint's weights (quantized ones
# decoded by checkpoint_factory's numpy reference, and transformers' own MXFP4 decoder agrees), rope as
# the config says, an independent numpy router agrees with transformers', healthy activations, prompts
# far from ties; --sensitivity turns each family-specific feature off in the transformers model.

FAMILY_MIN_ROUTING_MARGIN = 1e-3  # every routing decision of prompt and continuation, every MoE layer
FAMILY_MAX_PROMPT_DRAWS = 500
SPECIAL_TOKENS = 3  # prompts draw from ids >= 3 (the tiny configs' bos/eos/pad live below)


def _modeling_module(model):
    return sys.modules[type(model).__module__]


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _rotary_dim(config: dict) -> int:
    if config["model_type"] == "minimax_m2":
        return config["rotary_dim"]
    return int(_head_dim(config) * config.get("partial_rotary_factor", 1.0))


def _eos_ids(config: dict) -> list[int]:
    eos = config["eos_token_id"]
    return eos if isinstance(eos, list) else [eos]


def family_expected_state_dict(config: dict, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The state dict transformers should hold, from the float32 checkpoint tensors (hub names)."""
    family = config["model_type"]
    layers = config["num_hidden_layers"]
    expected = {n: t for n, t in tensors.items() if not n.startswith(f"model.layers.{layers}.")}
    experts = range(cf.family_num_experts(config))
    for layer in cf.family_moe_layers(config):
        p = f"model.layers.{layer}."
        if family in ("qwen3_moe", "glm4_moe"):
            gate = [expected.pop(f"{p}mlp.experts.{e}.gate_proj.weight") for e in experts]
            up = [expected.pop(f"{p}mlp.experts.{e}.up_proj.weight") for e in experts]
            down = [expected.pop(f"{p}mlp.experts.{e}.down_proj.weight") for e in experts]
        elif family in ("mixtral", "minimax_m2"):
            q = p + "block_sparse_moe."
            gate = [expected.pop(f"{q}experts.{e}.w1.weight") for e in experts]
            up = [expected.pop(f"{q}experts.{e}.w3.weight") for e in experts]
            down = [expected.pop(f"{q}experts.{e}.w2.weight") for e in experts]
            expected[p + "mlp.gate.weight"] = expected.pop(q + "gate.weight")
            if family == "minimax_m2":
                expected[p + "mlp.e_score_correction_bias"] = expected.pop(q + "e_score_correction_bias")
        else:  # gpt_oss: decoded [E, out, in] -> transformers' [E, in, out]
            for proj in ("gate_up_proj", "down_proj"):
                name = f"{p}mlp.experts.{proj}"
                expected[name] = np.ascontiguousarray(expected[name].transpose(0, 2, 1))
            continue
        expected[p + "mlp.experts.gate_up_proj"] = np.stack([np.concatenate(gu) for gu in zip(gate, up, strict=True)])
        expected[p + "mlp.experts.down_proj"] = np.stack(down)
    return expected


def family_load_reference(checkpoint: Path, workdir: Path):
    """transformers' model of a family checkpoint, after proving it holds exactly the checkpoint's weights.

    bf16: loaded as stored. gpt-oss MXFP4: loaded as stored with Mxfp4Config(dequantize=True) (transformers'
    own decoder, float32; its MXFP4 path needs no accelerate then), and the result must equal
    checkpoint_factory's numpy decoding. MiniMax-M2 FP8: transformers' FP8 loader needs accelerate and reads
    partial edge blocks wrongly (see fp8_against_transformers), so it loads a float32 copy decoded by
    checkpoint_factory.
    """
    from transformers import Mxfp4Config

    config = json.loads((checkpoint / "config.json").read_text())
    decoded = cf.checkpoint_as_float32(checkpoint)
    source, extra, how = checkpoint, {}, "as stored"
    if config["model_type"] == "gpt_oss":
        extra["quantization_config"] = Mxfp4Config(dequantize=True)
        how = "as stored, MXFP4 decoded by transformers (Mxfp4Config(dequantize=True)), equal to the numpy decoding"
    elif "quantization_config" in config:
        source = workdir / "dequantized"
        source.mkdir()
        plain = {k: v for k, v in config.items() if k != "quantization_config"}
        plain["torch_dtype"] = "float32"
        save_file(decoded, str(source / "model.safetensors"), metadata={"format": "pt"})
        (source / "config.json").write_text(json.dumps(plain, indent=2) + "\n")
        how = "float32 copy decoded by checkpoint_factory's numpy FP8 reference (per weight_block_size block)"
    model, info = AutoModelForCausalLM.from_pretrained(
        source,
        dtype=torch.float32,
        attn_implementation="eager",
        experts_implementation="eager",
        output_loading_info=True,
        **extra,
    )
    model.eval()
    assert type(model).__name__ == config["architectures"][0], type(model).__name__
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["error_msgs"], info
    mtp_prefix = f"model.layers.{config['num_hidden_layers']}."
    assert all(k.startswith(mtp_prefix) for k in info["unexpected_keys"]), info["unexpected_keys"]
    assert bool(info["unexpected_keys"]) == (config.get("num_nextn_predict_layers", 0) > 0)

    expected = family_expected_state_dict(config, decoded)
    actual = {k: v.numpy() for k, v in model.state_dict().items()}
    assert sorted(actual) == sorted(expected), set(actual) ^ set(expected)
    for name, value in expected.items():
        assert actual[name].dtype == np.float32, name
        assert np.array_equal(actual[name], value), f"transformers holds a different {name}"
    return model, config, how


def fp8_against_transformers(checkpoint: Path) -> dict:
    """transformers' own FP8 block dequantizer (Fp8Dequantize._dequantize_one) against the numpy one.

    On the full blocks of every matrix they must agree exactly. On whole matrices with partial edge blocks
    transformers derives the block size as rows // scale_rows (cols likewise) instead of reading
    weight_block_size, so it misreads them (or raises when that does not divide): counted, not asserted.
    """
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    config = json.loads((checkpoint / "config.json").read_text())
    block = tuple(config["quantization_config"]["weight_block_size"])
    tensors = cf.read_tensors(checkpoint)
    dequantizer = Fp8Dequantize(None)
    stats = {"matrices": 0, "misread_whole": 0, "raised_whole": 0, "max_abs_error_whole": 0.0}
    for name, scale_inv in tensors.items():
        if not name.endswith("_scale_inv"):
            continue
        weight = tensors[name.removesuffix("_scale_inv")]
        ours = cf.dequantize_fp8(weight, scale_inv, block)
        full_r, full_c = weight.shape[0] // block[0], weight.shape[1] // block[1]
        rows, cols = full_r * block[0], full_c * block[1]
        theirs = dequantizer._dequantize_one(
            torch.from_numpy(weight[:rows, :cols].view(np.uint8).copy()).view(torch.float8_e4m3fn),
            torch.from_numpy(scale_inv[:full_r, :full_c].copy()),
            output_dtype=torch.float32,
        ).numpy()
        assert np.array_equal(theirs, ours[:rows, :cols]), f"{name}: transformers' FP8 full blocks differ"
        stats["matrices"] += 1
        try:
            whole = dequantizer._dequantize_one(
                torch.from_numpy(weight.view(np.uint8).copy()).view(torch.float8_e4m3fn),
                torch.from_numpy(scale_inv.copy()),
                output_dtype=torch.float32,
            ).numpy()
        except ValueError:
            stats["raised_whole"] += 1
            continue
        if not np.array_equal(whole, ours):
            stats["misread_whole"] += 1
            stats["max_abs_error_whole"] = max(stats["max_abs_error_whole"], float(np.abs(whole - ours).max()))
    return stats


def transformers_fp8_dequantize(weight: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """What transformers' Fp8Dequantize makes of a whole matrix (block size from the scale grid)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return (
        Fp8Dequantize(None)
        ._dequantize_one(
            torch.from_numpy(weight.view(np.uint8).copy()).view(torch.float8_e4m3fn),
            torch.from_numpy(scale_inv.copy()),
            output_dtype=torch.float32,
        )
        .numpy()
    )


def reference_rope(config: dict) -> tuple[np.ndarray, float]:
    """(inv_freq over the rotated dims, cos/sin factor), from the config, written independently."""
    dim = _rotary_dim(config)
    base = config["rope_theta"]
    plain = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    rope = config.get("rope_scaling")
    if not rope:
        return plain, 1.0
    assert rope["rope_type"] == "yarn"
    factor, original = rope["factor"], rope["original_max_position_embeddings"]

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope["beta_fast"]), correction_dim(rope["beta_slow"])
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    extrapolation = 1.0 - np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    inv_freq = plain / factor * (1 - extrapolation) + plain * extrapolation
    return inv_freq, 0.1 * math.log(factor) + 1.0


def family_check_rope(model, config: dict):
    inv_freq, factor = reference_rope(config)
    rotary = model.model.rotary_emb
    np.testing.assert_allclose(rotary.inv_freq.numpy(), inv_freq, rtol=1e-6)
    assert len(inv_freq) == _rotary_dim(config) // 2
    np.testing.assert_allclose(rotary.attention_scaling, factor, rtol=1e-12)
    for layer in model.model.layers:
        np.testing.assert_allclose(layer.self_attn.scaling, _head_dim(config) ** -0.5, rtol=1e-12)
    if config["model_type"] == "gpt_oss":
        for layer, kind in zip(model.model.layers, config["layer_types"], strict=True):
            window = config["sliding_window"] if kind == "sliding_attention" else None
            assert layer.self_attn.sliding_window == window


def _router_module(model, config: dict, layer: int):
    mlp = model.model.layers[layer].mlp
    return mlp.router if config["model_type"] == "gpt_oss" else mlp.gate


def family_router_params(model, config: dict, layer: int) -> dict[str, np.ndarray]:
    family = config["model_type"]
    router = _router_module(model, config, layer)
    params = {"weight": router.weight.detach().numpy()}
    if family == "glm4_moe":
        params["bias"] = router.e_score_correction_bias.numpy()
    elif family == "minimax_m2":
        params["bias"] = model.model.layers[layer].mlp.e_score_correction_bias.numpy()
    elif family == "gpt_oss":
        params["bias"] = router.bias.detach().numpy()
    return params


def family_route(config: dict, params: dict, hidden: np.ndarray, use_bias: bool = True, use_groups: bool = True):
    """(ids [T, K] sorted, weights [T, K], margin [T]) in float64, written from each family's definition.

    margin: distance from a tie in selection-score units (softmax probability for Qwen3 and Mixtral, the
    biased sigmoid score for GLM and MiniMax, the router logit for gpt-oss): the k-th chosen minus the best
    unchosen candidate, and for GLM's group limit also the last kept minus the best dropped group score.
    """
    family, k = config["model_type"], config["num_experts_per_tok"]
    logits = hidden.astype(np.float64) @ params["weight"].astype(np.float64).T
    bias = params.get("bias")
    bias = np.zeros(logits.shape[-1]) if bias is None or not use_bias else bias.astype(np.float64)
    if family in ("qwen3_moe", "mixtral"):
        exp = np.exp(logits - logits.max(-1, keepdims=True))
        scores = choice = exp / exp.sum(-1, keepdims=True)
    elif family == "gpt_oss":
        scores = choice = logits + bias
    else:  # glm4_moe, minimax_m2
        scores = 1.0 / (1.0 + np.exp(-logits))
        choice = scores + bias
    tokens, experts = choice.shape
    margin = np.full(tokens, np.inf)
    groups, kept_groups = config.get("n_group", 1), config.get("topk_group", 1)
    if family == "glm4_moe" and use_groups and kept_groups < groups:
        grouped = np.sort(choice.reshape(tokens, groups, -1), axis=-1)
        group_score = grouped[..., -2:].sum(-1)
        order = np.argsort(-group_score, axis=-1)
        ranked = np.take_along_axis(group_score, order, -1)
        margin = ranked[:, kept_groups - 1] - ranked[:, kept_groups]
        allowed = np.zeros((tokens, groups), bool)
        np.put_along_axis(allowed, order[:, :kept_groups], True, -1)
        choice = np.where(np.repeat(allowed, experts // groups, axis=-1), choice, -np.inf)
    order = np.argsort(-choice, axis=-1)
    ranked = np.take_along_axis(choice, order, -1)
    margin = np.minimum(margin, ranked[:, k - 1] - ranked[:, k])
    ids = np.sort(order[:, :k], axis=-1)
    chosen = np.take_along_axis(scores, ids, -1)
    if family == "gpt_oss":
        exp = np.exp(chosen - chosen.max(-1, keepdims=True))
        weights = exp / exp.sum(-1, keepdims=True)
    elif family == "qwen3_moe" and not config["norm_topk_prob"]:
        weights = chosen
    elif family == "glm4_moe":
        if config["norm_topk_prob"]:
            chosen = chosen / (chosen.sum(-1, keepdims=True) + 1e-20)
        weights = chosen * config["routed_scaling_factor"]
    else:  # qwen3 (norm_topk_prob), mixtral, minimax_m2
        weights = chosen / chosen.sum(-1, keepdims=True)
    return ids, weights, margin


@contextmanager
def family_router_capture(model, config: dict):
    """Per MoE layer: the router's input rows, logits and transformers' top-k (sorted by expert id)."""
    records = {layer: [] for layer in cf.family_moe_layers(config)}

    def hook(layer):
        def record(module, args, output):
            logits, weights, ids = output
            order = torch.argsort(ids, dim=-1)
            records[layer].append(
                (
                    args[0].reshape(-1, config["hidden_size"]).detach().numpy().copy(),
                    torch.gather(ids, -1, order).numpy(),
                    torch.gather(weights, -1, order).detach().numpy(),
                    logits.detach().float().numpy().copy(),
                )
            )

        return record

    handles = [_router_module(model, config, layer).register_forward_hook(hook(layer)) for layer in records]
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def family_run_prompt(model, config: dict, prompt: list[int]):
    ids = torch.tensor([prompt])
    generated = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        use_cache=True,
        pad_token_id=_eos_ids(config)[0],
        eos_token_id=_eos_ids(config),
        # MiniMax-M2's config.json says use_mtp: true (its files hold no MTP weights); transformers copies
        # that into the generation config and would try MTP-assisted decoding, which fails without them.
        use_mtp=False,
    )[0, len(prompt) :].tolist()
    with family_router_capture(model, config) as routing:
        out = model(ids, output_hidden_states=True, output_attentions=True)
    with family_router_capture(model, config) as extended_routing:
        extended = model(torch.tensor([prompt + generated[:-1]])).logits[0].numpy()
    steps = extended[len(prompt) - 1 :]
    if len(generated) == NEW_TOKENS:
        assert steps.argmax(-1).tolist() == generated, "cached generation disagrees with the uncached forward"
    top2 = np.sort(steps, axis=-1)[:, -2:]
    margins = []
    for layer, [(hidden, _, _, _)] in extended_routing.items():
        margins.append(family_route(config, family_router_params(model, config, layer), hidden)[2].min())
    return {
        "logits": out.logits[0].numpy(),
        "generated": generated,
        "routing": {layer: record[0] for layer, record in routing.items()},
        "hidden_states": [h[0].numpy() for h in out.hidden_states],
        "attentions": [a[0].numpy() for a in out.attentions],
        "greedy_gap": float((top2[:, 1] - top2[:, 0]).min()),
        "routing_margin": float(min(margins)),
    }


def family_prompts(config: dict, rng) -> list[list[int]]:
    prompts = []
    for n in PROMPT_LENGTHS:
        body = rng.integers(SPECIAL_TOKENS, config["vocab_size"], n).tolist()
        prompts.append([config["bos_token_id"]] + body[1:] if "bos_token_id" in config else body)
    return prompts


def family_choose_prompts(model, config: dict, seed: int):
    """The first draw whose greedy steps win by >= 0.01 logits and whose routing decisions (prompt and
    continuation, every MoE layer) are >= 1e-3 from a tie, with continuations that neither hit EOS nor loop."""
    for draw in range(FAMILY_MAX_PROMPT_DRAWS):
        prompts = family_prompts(config, np.random.default_rng([seed, draw]))
        runs = []
        for prompt in prompts:
            run = family_run_prompt(model, config, prompt)
            runs.append(run)
            if not (
                len(run["generated"]) == NEW_TOKENS
                and not set(run["generated"]) & set(_eos_ids(config))
                and run["greedy_gap"] >= MIN_GREEDY_GAP
                and run["routing_margin"] >= FAMILY_MIN_ROUTING_MARGIN
                and len(set(run["generated"])) > NEW_TOKENS // 2
            ):
                break
        else:
            return prompts, runs, draw
    raise RuntimeError(f"no prompt draw out of {FAMILY_MAX_PROMPT_DRAWS} is clear of ties")


def family_check_routing(model, config: dict, runs) -> dict:
    """transformers' routing equals the numpy reference; the correction bias (GLM, MiniMax), the router bias
    (gpt-oss) and the group limit (GLM) each change some expert choices, so they are tested."""
    family = config["model_type"]
    stats = {"tokens": 0, "bias_changed": 0, "groups_changed": 0}
    for layer in cf.family_moe_layers(config):
        params = family_router_params(model, config, layer)
        hidden = np.concatenate([r["routing"][layer][0] for r in runs])
        hf_ids = np.concatenate([r["routing"][layer][1] for r in runs])
        hf_weights = np.concatenate([r["routing"][layer][2] for r in runs])
        ids, weights, margin = family_route(config, params, hidden)
        np.testing.assert_array_equal(hf_ids, ids)
        np.testing.assert_allclose(hf_weights, weights, rtol=1e-5)
        assert margin.min() >= FAMILY_MIN_ROUTING_MARGIN
        stats["tokens"] += len(ids)
        if "bias" in params:
            assert np.any(params["bias"] != 0)
            unbiased = family_route(config, params, hidden, use_bias=False)[0]
            stats["bias_changed"] += int(np.any(unbiased != ids, axis=-1).sum())
        if family == "glm4_moe":
            ungrouped = family_route(config, params, hidden, use_groups=False)[0]
            stats["groups_changed"] += int(np.any(ungrouped != ids, axis=-1).sum())
    if family in ("glm4_moe", "minimax_m2", "gpt_oss"):
        assert stats["bias_changed"] > 0, "the router/correction bias never changes the top-k"
    if family == "glm4_moe":
        assert stats["groups_changed"] > 0, "the group limit never changes the top-k"
    return stats


def family_check_health(runs, config: dict) -> str:
    """check_health, plus for gpt-oss: the sinks take a real share of the attention and the SwiGLU clamp
    acts on a good share of the expert pre-activations (the clamp is applied to every expert here, routed
    or not, as a measure of the activations' scale)."""
    check_health(runs, config)
    if config["model_type"] != "gpt_oss":
        return ""
    shares = []
    for run in runs:
        for attention in run["attentions"]:
            shares.append(1 - attention.sum(-1).mean())  # rows sum to 1 - the sink's share
    assert 0.05 < min(shares) and max(shares) < 0.9, f"sinks take {shares} of the attention"
    return f"sinks take {min(shares):.0%}-{max(shares):.0%} of the attention (mean per layer)"


def family_golden_arrays(model, config, checkpoint: Path, prompts, runs, how: str) -> dict[str, np.ndarray]:
    arrays = {
        "digest": np.array(cf.tensor_digest(checkpoint)),
        "config_json": np.array(json.dumps(config, sort_keys=True)),
        "family": np.array(config["model_type"]),
        "reference_loaded": np.array(how),
    }
    decoded = cf.checkpoint_as_float32(checkpoint)
    arrays["weights_f32_digest"] = np.array(cf.float32_digest(decoded))
    stored = cf.read_tensors(checkpoint)
    quantized = sorted(
        n.removesuffix("_blocks") if n.endswith("_blocks") else n
        for n, v in stored.items()
        if v.dtype == cf.ml_dtypes.float8_e4m3fn or n.endswith("_blocks")
    )
    if quantized:
        arrays["quantized_names"] = np.array(quantized)
        arrays["quantized_sums"] = np.array(
            [[decoded[n].astype(np.float64).sum(), (decoded[n].astype(np.float64) ** 2).sum()] for n in quantized]
        )
    for i, (prompt, run) in enumerate(zip(prompts, runs, strict=True)):
        arrays[f"prompt{i}_ids"] = np.array(prompt, np.int32)
        arrays[f"prompt{i}_logits"] = run["logits"].astype(np.float32)
        arrays[f"prompt{i}_generated"] = np.array(run["generated"], np.int32)
    arrays["moe_layers"] = np.array(cf.family_moe_layers(config), np.int32)
    for layer in cf.family_moe_layers(config):
        hidden, ids, weights, logits = (
            np.concatenate(part) for part in zip(*(r["routing"][layer] for r in runs), strict=True)
        )
        arrays[f"layer{layer}_router_input"] = hidden.astype(np.float32)
        arrays[f"layer{layer}_router_logits"] = logits.astype(np.float32)
        arrays[f"layer{layer}_topk_ids"] = ids.astype(np.int32)
        arrays[f"layer{layer}_topk_weights"] = weights.astype(np.float32)
        margin = family_route(config, family_router_params(model, config, layer), hidden)[2]
        arrays[f"layer{layer}_margin"] = margin.astype(np.float32)
    return arrays


# ---------------------------------------------------------------- families: sensitivity


def _interleaved_rope(q, k, cos, sin, unsqueeze_dim=1):
    """RoPE on interleaved pairs (2i, 2i+1) instead of the half-split pairs (i, i + d/2) transformers uses,
    over the first cos.shape[-1] dims (the rotated part with partial rotary)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rot = cos.shape[-1]
    c = cos[..., : rot // 2].repeat_interleave(2, -1)
    s = sin[..., : rot // 2].repeat_interleave(2, -1)

    def apply(x):
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        turned = torch.stack((-x_rot[..., 1::2], x_rot[..., 0::2]), -1).flatten(-2)
        return torch.cat((x_rot * c + turned * s, x_pass), -1)

    return apply(q), apply(k)


def _interleaved_rope_gpt_oss(q, k, cos, sin, unsqueeze_dim=1):
    """gpt-oss's cos/sin have head_dim / 2 columns (one per pair); pairs (2i, 2i+1) instead of halves."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def apply(x):
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * cos - odd * sin, odd * cos + even * sin), -1).flatten(-2)

    return apply(q), apply(k)


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _qk_norm_regrouped(norm, per_head_dim: int | None):
    """A q/k norm forward that normalises over per_head_dim slices (None: over the whole last two axes)."""

    def forward(x):
        if per_head_dim is None:  # x [..., heads, head_dim]: one RMS over all heads
            flat = x.reshape(*x.shape[:-2], -1)
            return norm.weight * _rms(flat, norm.variance_epsilon).reshape(x.shape)
        heads = x.reshape(*x.shape[:-1], -1, per_head_dim)
        return norm.weight * _rms(heads, norm.variance_epsilon).reshape(x.shape)

    return forward


def _family_replaced(model, config, replace_float32):
    """Model weights from the checkpoint's float32 tensors as changed by replace_float32(dict) -> dict."""

    def replace(state):
        return _to_torch(family_expected_state_dict(config, replace_float32()))

    return _weights_replaced(model, replace)


def _gate_forward(model, config, layer, make):
    """Patches the router of `layer` with make(router) -> forward."""
    router = _router_module(model, config, layer)
    return patched(router, forward=make(router))


def family_mutations(model, config: dict, checkpoint: Path):
    """(description, context manager factory): each family feature turned off, and typical engine bugs."""
    family = config["model_type"]
    module = _modeling_module(model)
    rotary = model.model.rotary_emb
    attentions = [layer.self_attn for layer in model.model.layers]
    moe = cf.family_moe_layers(config)
    mlps = [model.model.layers[layer].mlp for layer in moe]
    experts = cf.family_num_experts(config)
    lexicographic = sorted(range(experts), key=str)
    order_bug = "experts in lexicographic order (0,1,10,11,...)"
    if lexicographic == list(range(experts)):  # fewer than 11 experts: lexicographic is the identity
        lexicographic, order_bug = list(reversed(range(experts))), "experts in reverse order"
    head_dim, rot = _head_dim(config), _rotary_dim(config)
    stored = cf.read_tensors(checkpoint)

    def each_mlp(fn):
        return each(fn(m) for m in mlps)

    def permuted(state):
        return {k: v[lexicographic] for k, v in state.items() if ".mlp.experts." in k}

    def swapped_gate_up(state):
        out = {}
        for k, v in state.items():
            if family == "gpt_oss" and k.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
                w = v.clone()
                w[..., 0::2], w[..., 1::2] = v[..., 1::2], v[..., 0::2]
                out[k] = w
            elif k.endswith("experts.gate_up_proj"):
                out[k] = torch.cat(v.chunk(2, dim=1)[::-1], dim=1)
        return out

    out = [
        (order_bug, lambda: _weights_replaced(model, permuted)),
        ("gate and up projections swapped", lambda: _weights_replaced(model, swapped_gate_up)),
        (
            "lm_head tied to embed_tokens",
            lambda: _weights_replaced(model, lambda s: {"lm_head.weight": s["model.embed_tokens.weight"]}),
        ),
        (
            "RoPE on interleaved pairs instead of half-split",
            lambda: patched(
                module,
                apply_rotary_pos_emb=_interleaved_rope_gpt_oss if family == "gpt_oss" else _interleaved_rope,
            ),
        ),
    ]
    wrong_head_dim = config["hidden_size"] // config["num_attention_heads"]
    if wrong_head_dim != head_dim:
        out.append(
            (
                "softmax scale from hidden_size / num_attention_heads instead of head_dim",
                lambda: each(patched(a, scaling=wrong_head_dim**-0.5) for a in attentions),
            )
        )
    if not config.get("rope_scaling"):
        default_theta = torch.tensor(10000.0 ** (-np.arange(0, rot, 2) / rot), dtype=torch.float32)
        out.append(("rope_theta 10000 instead of the config's", lambda: patched(rotary, inv_freq=default_theta)))
    if rot < head_dim:
        theta = config["rope_theta"]
        all_dims = torch.tensor(theta ** (-np.arange(0, head_dim, 2) / head_dim), dtype=torch.float32)
        over_head = torch.tensor(theta ** (-np.arange(0, rot, 2) / head_dim), dtype=torch.float32)
        out += [
            ("partial rotary ignored (all head dims rotate)", lambda: patched(rotary, inv_freq=all_dims)),
            ("rotary frequencies with head_dim in the exponent", lambda: patched(rotary, inv_freq=over_head)),
        ]
    # q/k norm
    if family in ("qwen3_moe", "glm4_moe", "minimax_m2"):
        out.append(
            (
                "q/k RMSNorm skipped",
                lambda: each(patched(norm, forward=lambda x: x) for a in attentions for norm in (a.q_norm, a.k_norm)),
            )
        )
        if family == "minimax_m2":
            description, per_head = "q/k RMSNorm per head instead of over all heads", head_dim
        else:
            description, per_head = "q/k RMSNorm over all heads instead of per head", None
        out.append(
            (
                description,
                lambda: each(
                    patched(norm, forward=_qk_norm_regrouped(norm, per_head))
                    for a in attentions
                    for norm in (a.q_norm, a.k_norm)
                ),
            )
        )
    # attention biases, sinks, windows
    if config.get("attention_bias"):
        names = ("q_proj", "k_proj", "v_proj") + (("o_proj",) if family == "gpt_oss" else ())
        out.append(
            (
                f"attention biases ignored ({', '.join(names)})",
                lambda: _weights_replaced(
                    model,
                    lambda s: {
                        k: torch.zeros_like(v) for k, v in s.items() if k.endswith(tuple(f"{n}.bias" for n in names))
                    },
                ),
            )
        )
    if family == "gpt_oss":
        yarn_inv_freq, _ = reference_rope(config)
        plain = torch.tensor(config["rope_theta"] ** (-np.arange(0, rot, 2) / rot), dtype=torch.float32)
        truncated = dict(config, rope_scaling=dict(config["rope_scaling"], truncate=True))
        truncated_inv_freq = torch.tensor(reference_rope(truncated)[0], dtype=torch.float32)
        window = config["sliding_window"]
        swapped_types = [
            "full_attention" if t == "sliding_attention" else "sliding_attention" for t in config["layer_types"]
        ]
        out += [
            (
                "attention sinks ignored",
                lambda: _weights_replaced(
                    model, lambda s: {k: torch.full_like(v, -1e9) for k, v in s.items() if k.endswith("sinks")}
                ),
            ),
            ("sliding window ignored (all layers full)", lambda: patched(model.config, sliding_window=1 << 20)),
            ("sliding window one token wider", lambda: patched(model.config, sliding_window=window + 1)),
            ("sliding and full layers swapped", lambda: patched(model.config, layer_types=swapped_types)),
            ("plain RoPE frequencies (YaRN ignored)", lambda: patched(rotary, inv_freq=plain)),
            ("YaRN cos/sin factor ignored", lambda: patched(rotary, attention_scaling=1.0)),
            (
                "YaRN correction range truncated (truncate ignored)",
                lambda: patched(rotary, inv_freq=truncated_inv_freq),
            ),
            ("SwiGLU clamp removed", lambda: each_mlp(lambda m: patched(m.experts, limit=float("inf")))),
            (
                "gate clamped on both sides",
                lambda: each_mlp(lambda m: patched(m.experts, _apply_gate=_gpt_oss_gate(m.experts, gate_min=True))),
            ),
            ("sigmoid gain 1 (plain SiLU) instead of 1.702", lambda: each_mlp(lambda m: patched(m.experts, alpha=1.0))),
            (
                "(up + 1) replaced by up",
                lambda: each_mlp(lambda m: patched(m.experts, _apply_gate=_gpt_oss_gate(m.experts, plus_one=False))),
            ),
            (
                "gate/up read as halves instead of interleaved rows",
                lambda: _weights_replaced(model, _halves_as_interleaved),
            ),
            (
                "expert biases ignored",
                lambda: _weights_replaced(
                    model, lambda s: {k: torch.zeros_like(v) for k, v in s.items() if k.endswith("proj_bias")}
                ),
            ),
            (
                "router bias ignored",
                lambda: _weights_replaced(
                    model, lambda s: {k: torch.zeros_like(v) for k, v in s.items() if k.endswith("router.bias")}
                ),
            ),
            (
                "router: softmax over all experts, top-k not renormalised",
                lambda: each(_gate_forward(model, config, layer, _softmax_all_router) for layer in moe),
            ),
            (
                "MXFP4: high nibble first",
                lambda: _family_replaced(model, config, lambda: _mxfp4_decoded(stored, swap_nibbles=True)),
            ),
            (
                "MXFP4: e8m0 scale bias 128 instead of 127",
                lambda: _family_replaced(model, config, lambda: _mxfp4_decoded(stored, scale_bias=128)),
            ),
            (
                "MXFP4: down_proj used untransposed (square here, as in gpt-oss-20b)",
                lambda: _weights_replaced(
                    model,
                    lambda s: {
                        k: v.transpose(1, 2).contiguous() for k, v in s.items() if k.endswith("experts.down_proj")
                    },
                ),
            ),
        ]
    # routers
    if family == "qwen3_moe":
        out.append(
            (
                "top-k weights not normalised (norm_topk_prob ignored)",
                lambda: each_mlp(lambda m: patched(m.gate, norm_topk_prob=False)),
            )
        )
    if family == "mixtral":
        out.append(
            (
                "top-2 weights not renormalised",
                lambda: each(_gate_forward(model, config, layer, _softmax_all_router) for layer in moe),
            )
        )
    if family in ("glm4_moe", "minimax_m2"):
        zero = torch.zeros(experts)
        if family == "glm4_moe":
            bias_off = lambda: each_mlp(lambda m: patched(m.gate, e_score_correction_bias=zero))  # noqa: E731
        else:
            bias_off = lambda: each_mlp(lambda m: patched(m, e_score_correction_bias=zero))  # noqa: E731
        out += [
            ("correction bias ignored", bias_off),
            (
                "correction bias also in the weights",
                lambda: each(
                    _gate_forward(model, config, layer, _sigmoid_router(config, biased_weights=True)) for layer in moe
                ),
            ),
            (
                "top-k weights not normalised",
                lambda: each(
                    _gate_forward(model, config, layer, _sigmoid_router(config, normalise=False)) for layer in moe
                ),
            ),
            (
                "softmax scores instead of sigmoid",
                lambda: each(
                    _gate_forward(model, config, layer, _sigmoid_router(config, softmax=True)) for layer in moe
                ),
            ),
        ]
    if family == "glm4_moe":
        out += [
            ("group limit ignored", lambda: each_mlp(lambda m: patched(m.gate, topk_group=m.gate.num_group))),
            ("routed_scaling_factor ignored", lambda: each_mlp(lambda m: patched(m.gate, routed_scaling_factor=1.0))),
            ("shared expert dropped", lambda: each_mlp(lambda m: patched(m.shared_experts, forward=torch.zeros_like))),
        ]
    if family == "minimax_m2":
        block = tuple(config["quantization_config"]["weight_block_size"])
        out += [
            (
                "FP8: one scale per matrix",
                lambda: _family_replaced(model, config, lambda: _fp8_decoded(stored, block, lambda sc, i, j: sc[0, 0])),
            ),
            (
                "FP8: partial edge blocks take their neighbour's scale",
                lambda: _family_replaced(
                    model,
                    config,
                    lambda: _fp8_decoded(
                        stored,
                        block,
                        lambda sc, i, j: sc[max(i - (i == sc.shape[0] - 1), 0), max(j - (j == sc.shape[1] - 1), 0)],
                    ),
                ),
            ),
            (
                "FP8: block size from the scale grid (transformers' Fp8Dequantize)",
                lambda: _family_replaced(model, config, lambda: _fp8_decoded_by_transformers(stored)),
            ),
        ]
    return out


def _gpt_oss_gate(experts, gate_min: bool = False, plus_one: bool = True):
    def apply(gate_up):
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=-experts.limit if gate_min else None, max=experts.limit)
        up = up.clamp(min=-experts.limit, max=experts.limit)
        glu = gate * torch.sigmoid(gate * experts.alpha)
        return (up + 1) * glu if plus_one else up * glu

    return apply


def _halves_as_interleaved(state):
    """The reference reading gate from the first half of the 2*I columns and up from the second."""
    out = {}
    for k, v in state.items():
        if k.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):
            half = v.shape[-1] // 2
            w = torch.empty_like(v)
            w[..., 0::2], w[..., 1::2] = v[..., :half], v[..., half:]
            out[k] = w
    return out


def _softmax_all_router(router):
    """Softmax over all experts' logits, top-k of those probabilities, no renormalisation."""

    def forward(hidden, *rest):
        logits = torch.nn.functional.linear(
            hidden.reshape(-1, router.weight.shape[1]), router.weight, getattr(router, "bias", None)
        )
        probs = logits.softmax(-1)
        weights, ids = probs.topk(router.top_k, dim=-1)
        return logits, weights, ids

    return forward


def _sigmoid_router(config, biased_weights=False, normalise=True, softmax=False):
    """GLM's / MiniMax's sigmoid router with one thing changed (groups and scaling as GLM configures)."""

    def make(router):
        def forward(hidden, *rest):
            bias = rest[0] if rest else router.e_score_correction_bias
            logits = torch.nn.functional.linear(
                hidden.reshape(-1, router.weight.shape[1]).float(), router.weight.float()
            )
            scores = logits.softmax(-1) if softmax else logits.sigmoid()
            choice = scores + bias
            groups, kept = getattr(router, "num_group", 1), getattr(router, "topk_group", 1)
            if kept < groups:
                grouped = choice.view(-1, groups, choice.shape[-1] // groups).topk(2, dim=-1)[0].sum(-1)
                mask = torch.zeros_like(grouped).scatter_(1, grouped.topk(kept, dim=-1)[1], 1)
                mask = mask.unsqueeze(-1).expand(-1, groups, choice.shape[-1] // groups).reshape(choice.shape)
                choice = choice.masked_fill(~mask.bool(), float("-inf"))
            ids = choice.topk(router.top_k, dim=-1)[1]
            weights = (scores + bias if biased_weights else scores).gather(1, ids)
            if normalise:
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights * getattr(router, "routed_scaling_factor", 1.0), ids

        return forward

    return make


def _fp8_decoded(stored, block, scale_of_block):
    """The checkpoint's float32 tensors with FP8 matrices dequantized using scale_of_block(scale_inv, bi, bj)."""
    out = cf.as_float32(stored, block)
    for name, scale_inv in stored.items():
        if name.endswith("_scale_inv"):
            fixed = np.array(
                [
                    [scale_of_block(scale_inv, i, j) for j in range(scale_inv.shape[1])]
                    for i in range(scale_inv.shape[0])
                ],
                np.float32,
            )
            out[name.removesuffix("_scale_inv")] = cf.dequantize_fp8(
                stored[name.removesuffix("_scale_inv")], fixed, block
            )
    return out


def _fp8_decoded_by_transformers(stored):
    out = {}
    for name, value in stored.items():
        if name.endswith("_scale_inv"):
            continue
        if name + "_scale_inv" in stored:
            out[name] = transformers_fp8_dequantize(value, stored[name + "_scale_inv"])
        else:
            out[name] = value.astype(np.float32)
    return out


def _mxfp4_decoded(stored, swap_nibbles=False, scale_bias=127):
    out = {}
    for name, value in stored.items():
        if name.endswith("_scales") and value.dtype == np.uint8:
            continue
        if name.endswith("_blocks") and value.dtype == np.uint8:
            base = name.removesuffix("_blocks")
            blocks = ((value >> 4) | (value << 4)).astype(np.uint8) if swap_nibbles else value
            scales = stored[base + "_scales"]
            decoded = cf.dequantize_mxfp4(blocks, scales)
            out[base] = decoded * np.float32(2.0 ** (127 - scale_bias))
        else:
            out[name] = value.astype(np.float32)
    return out


@torch.no_grad()
def family_sensitivity(model, config, checkpoint: Path, prompts, runs):
    reference = np.concatenate([r["logits"] for r in runs])
    rows = []
    for description, mutation in family_mutations(model, config, checkpoint):
        with mutation():
            logits = np.concatenate([model(torch.tensor([p])).logits[0].numpy() for p in prompts])
        changed = int((logits.argmax(-1) != reference.argmax(-1)).sum())
        rows.append((description, relative_rms(logits, reference), changed))
    after = np.concatenate([model(torch.tensor([p])).logits[0].numpy() for p in prompts])
    assert np.array_equal(after, reference), "a mutation was not undone"
    return rows


def make_family_case(name: str, show_sensitivity: bool):
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = cf.build_case(name, Path(tmp) / "checkpoint")
        model, config, how = family_load_reference(checkpoint, Path(tmp))
        fp8 = (
            fp8_against_transformers(checkpoint)
            if "weight_block_size" in config.get("quantization_config", {})
            else None
        )
        family_check_rope(model, config)
        prompts, runs, draw = family_choose_prompts(model, config, cf.FAMILY_CASES[name]["seed"])
        health = family_check_health(runs, config)
        stats = family_check_routing(model, config, runs)
        arrays = family_golden_arrays(model, config, checkpoint, prompts, runs, how)
        path = GOLDEN_DIR / f"{name}.npz"
        np.savez_compressed(path, **arrays)
        gap = min(r["greedy_gap"] for r in runs)
        margin = min(r["routing_margin"] for r in runs)
        size = sum(f.stat().st_size for f in checkpoint.iterdir())
        print(
            f"{name}: checkpoint {size} bytes, prompt draw {draw}, routed tokens {stats['tokens']}"
            f" (bias changed {stats['bias_changed']}, group limit changed {stats['groups_changed']}),"
            f" min greedy gap {gap:.3f}, min routing margin {margin:.1e},"
            f" {path.stat().st_size} bytes, {time.time() - started:.1f}s"
        )
        print(f"    reference: {how}")
        if health:
            print(f"    {health}")
        if fp8 is not None:
            print(
                f"    transformers' Fp8Dequantize: equal on the full blocks of all {fp8['matrices']} matrices;"
                f" whole matrices misread {fp8['misread_whole']}, raised {fp8['raised_whole']}"
                f" (max abs error {fp8['max_abs_error_whole']:.3g})"
            )
        if show_sensitivity:
            for description, error, changed in family_sensitivity(model, config, checkpoint, prompts, runs):
                print(f"    {error:8.3%}  argmax changed at {changed:2d} positions  {description}")


# ---------------------------------------------------------------- main


def make_case(name: str, show_sensitivity: bool):
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = cf.build_case(name, Path(tmp) / "checkpoint")
        digest = cf.tensor_digest(checkpoint)
        model, config = load_reference(checkpoint, Path(tmp))
        check_rope(model, config)
        prompts, runs, draw = choose_prompts(model, config, cf.GOLDEN_CASES[name]["seed"])
        check_health(runs, config)
        stats = check_routing(model, config, runs)
        arrays = golden_arrays(model, config, digest, prompts, runs)
        path = GOLDEN_DIR / f"{name}.npz"
        np.savez_compressed(path, **arrays)
        gap = min(r["greedy_gap"] for r in runs)
        margin = min(r["routing_margin"] for r in runs)
        print(
            f"{name}: prompt draw {draw}, routed tokens {stats['tokens']}"
            f" (bias changed {stats['bias_changed']}, margin <= 1e-3: {stats['below_1e-3']}),"
            f" min greedy gap {gap:.3f}, min routing margin {margin:.1e},"
            f" {path.stat().st_size} bytes, {time.time() - started:.1f}s"
        )
        if show_sensitivity:
            for description, error, changed in sensitivity(
                model, config, cf.read_tensors(checkpoint), prompts, runs
            ):
                print(f"    {error:8.3%}  argmax changed at {changed:2d} positions  {description}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "cases",
        nargs="*",
        default=list(cf.GOLDEN_CASES) + list(cf.FAMILY_CASES),
        help="default: all (GOLDEN_CASES and FAMILY_CASES)",
    )
    parser.add_argument(
        "--sensitivity", action="store_true", help="print how far typical bugs move the logits"
    )
    args = parser.parse_args()
    torch.manual_seed(0)  # nothing should be random; this only makes a hidden dependence reproducible
    torch.set_num_threads(1)  # small models: keeps the shared machine free, and float32 sums in one order
    for name in args.cases:
        if name in cf.FAMILY_CASES:
            make_family_case(name, args.sensitivity)
        else:
            make_case(name, args.sensitivity)


if __name__ == "__main__":
    main()
