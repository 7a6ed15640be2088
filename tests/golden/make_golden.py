"""Makes the Hugging Face transformers reference outputs that tests/test_vs_transformers.py compares against.

Run in the reference venv (torch 2.13 + transformers 5.23, float32, CPU):
    /work/main/.venv-ref/bin/python tests/golden/make_golden.py [--sensitivity]

For each case of checkpoint_factory.GOLDEN_CASES it builds the checkpoint, loads it with
AutoModelForCausalLM and writes tests/golden/<case>.npz. FP8 cases load a float32 copy dequantized by
checkpoint_factory: transformers' FP8 loader needs accelerate, and its dequantizer (Fp8Dequantize) infers
the block size as rows // scale_rows, which is wrong for partial edge blocks (200 columns, 2 scale
columns -> 100-wide blocks). Before writing it proves that the reference is worth comparing
against: every model weight equals the checkpoint's (no random initialisation, experts in order),
transformers computed YaRN and the correction bias, an independent numpy router agrees with
transformers' routing, activations are healthy, and the prompts are far from ties (greedy steps and
routing decisions), so float32 rounding in another engine cannot flip a token or an expert.

--sensitivity also prints how far the logits move under typical engine bugs (each applied to the
transformers model), to show which bugs the 2% logits tolerance catches.
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
    parser.add_argument("cases", nargs="*", default=list(cf.GOLDEN_CASES), help="default: all")
    parser.add_argument(
        "--sensitivity", action="store_true", help="print how far typical bugs move the logits"
    )
    args = parser.parse_args()
    torch.manual_seed(0)  # nothing should be random; this only makes a hidden dependence reproducible
    for name in args.cases:
        make_case(name, args.sensitivity)


if __name__ == "__main__":
    main()
