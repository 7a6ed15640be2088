"""CI checks (no torch) of the tiny Qwen3-MoE, Mixtral, GLM-4.5, MiniMax-M2 and gpt-oss checkpoints and
their goldens (issue #21).

checkpoint_factory.FAMILY_CASES builds each family's checkpoint from a seed in the layout of the released
Hugging Face files; tests/golden/make_golden.py ran transformers 5.23 (float32, CPU, eager) on it and wrote
tests/golden/<case>.npz. Here, without torch: each checkpoint rebuilds byte-identically (the npz's digest),
its config.json has the released keys and its tensors the released names, shapes and dtypes (written out
independently below), its FP8 / MXFP4 tensors decode, by a bit-level decoder written here from the formats'
definitions, to the float32 weights the golden was made from (the npz's weights_f32_digest), and the
goldens are consistent with the checkpoint. tests/golden/README.md specifies each family's computation.
"""

import json
from pathlib import Path

import numpy as np
import pytest
from checkpoint_factory import (
    FAMILY_CASES,
    build_case,
    checkpoint_as_float32,
    float32_digest,
    read_tensors,
    tensor_digest,
)

GOLDEN_DIR = Path(__file__).parent / "golden"
NEW_TOKENS = 8
MIN_ROUTING_MARGIN = 1e-3  # make_golden drew the prompts until every routing decision is this far from a tie

# The keys of the released config.json files (Qwen3-30B-A3B, Mixtral-8x7B-v0.1, GLM-4.5, MiniMax-M2,
# gpt-oss-20b), less metadata (transformers_version, auto_map). The tiny checkpoints carry exactly these.
RELEASED_CONFIG_KEYS = {
    "qwen3_moe": {
        "architectures", "attention_bias", "attention_dropout", "bos_token_id", "decoder_sparse_step",
        "eos_token_id", "head_dim", "hidden_act", "hidden_size", "initializer_range", "intermediate_size",
        "max_position_embeddings", "max_window_layers", "mlp_only_layers", "model_type", "moe_intermediate_size",
        "norm_topk_prob", "num_attention_heads", "num_experts", "num_experts_per_tok", "num_hidden_layers",
        "num_key_value_heads", "output_router_logits", "rms_norm_eps", "rope_scaling", "rope_theta",
        "router_aux_loss_coef", "sliding_window", "tie_word_embeddings", "torch_dtype", "use_cache",
        "use_sliding_window", "vocab_size",
    },
    "mixtral": {
        "architectures", "attention_dropout", "bos_token_id", "eos_token_id", "hidden_act", "hidden_size",
        "initializer_range", "intermediate_size", "max_position_embeddings", "model_type", "num_attention_heads",
        "num_experts_per_tok", "num_hidden_layers", "num_key_value_heads", "num_local_experts",
        "output_router_logits", "rms_norm_eps", "rope_theta", "router_aux_loss_coef", "sliding_window",
        "tie_word_embeddings", "torch_dtype", "use_cache", "vocab_size",
    },
    "glm4_moe": {
        "architectures", "attention_bias", "attention_dropout", "eos_token_id", "first_k_dense_replace",
        "head_dim", "hidden_act", "hidden_size", "initializer_range", "intermediate_size",
        "max_position_embeddings", "model_type", "moe_intermediate_size", "n_group", "n_routed_experts",
        "n_shared_experts", "norm_topk_prob", "num_attention_heads", "num_experts_per_tok", "num_hidden_layers",
        "num_key_value_heads", "num_nextn_predict_layers", "pad_token_id", "partial_rotary_factor",
        "rms_norm_eps", "rope_scaling", "rope_theta", "routed_scaling_factor", "tie_word_embeddings",
        "topk_group", "torch_dtype", "use_cache", "use_qk_norm", "vocab_size",
    },
    "minimax_m2": {
        "architectures", "attention_dropout", "attn_type_list", "bos_token_id", "eos_token_id", "head_dim",
        "hidden_act", "hidden_size", "initializer_range", "intermediate_size", "max_position_embeddings",
        "model_type", "mtp_transformer_layers", "num_attention_heads", "num_experts_per_tok",
        "num_hidden_layers", "num_key_value_heads", "num_local_experts", "num_mtp_modules",
        "output_router_logits", "qk_norm_type", "quantization_config", "rms_norm_eps", "rope_theta",
        "rotary_dim", "router_aux_loss_coef", "router_jitter_noise", "scoring_func", "shared_intermediate_size",
        "sliding_window", "tie_word_embeddings", "torch_dtype", "use_cache", "use_mtp", "use_qk_norm",
        "use_routing_bias", "vocab_size",
    },
    "gpt_oss": {
        "architectures", "attention_bias", "attention_dropout", "eos_token_id", "experts_per_token", "head_dim",
        "hidden_act", "hidden_size", "initial_context_length", "initializer_range", "intermediate_size",
        "layer_types", "max_position_embeddings", "model_type", "num_attention_heads", "num_experts_per_tok",
        "num_hidden_layers", "num_key_value_heads", "num_local_experts", "output_router_logits", "pad_token_id",
        "quantization_config", "rms_norm_eps", "rope_scaling", "rope_theta", "router_aux_loss_coef",
        "sliding_window", "swiglu_limit", "tie_word_embeddings", "use_cache", "vocab_size",
    },
}  # fmt: skip

ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


@pytest.fixture(scope="module", params=sorted(FAMILY_CASES))
def case(request, tmp_path_factory):
    """(name, checkpoint path, config, golden arrays) of one family case."""
    name = request.param
    golden = dict(np.load(GOLDEN_DIR / f"{name}.npz"))
    path = build_case(name, tmp_path_factory.mktemp(name))
    config = json.loads((path / "config.json").read_text())
    return name, path, config, golden


def test_rebuild_is_bit_identical(case):
    name, path, _, golden = case
    assert tensor_digest(path) == str(golden["digest"]), (
        f"{name}: the rebuilt checkpoint differs from the one tests/golden/{name}.npz was made from "
        "(checkpoint_factory or numpy's random streams changed). Regenerate: "
        f"/work/main/.venv-ref/bin/python tests/golden/make_golden.py {name} (see tests/golden/README.md)."
    )


def test_config_has_the_released_keys(case):
    name, _, config, golden = case
    family = config["model_type"]
    assert set(config) == RELEASED_CONFIG_KEYS[family], set(config) ^ RELEASED_CONFIG_KEYS[family]
    assert config["architectures"] == [ARCHITECTURES[family]]
    assert json.loads(str(golden["config_json"])) == config and str(golden["family"]) == family
    layers = config["num_hidden_layers"]
    if family == "gpt_oss":
        assert config["layer_types"] == ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        assert config["quantization_config"]["quant_method"] == "mxfp4"
        assert config["experts_per_token"] == config["num_experts_per_tok"]
        assert config["initial_context_length"] == config["rope_scaling"]["original_max_position_embeddings"]
        assert config["rope_scaling"]["rope_type"] == "yarn" and config["rope_scaling"]["truncate"] is False
        assert config["sliding_window"] < len(golden["prompt1_ids"]), "the window must be shorter than the prompts"
    if family == "minimax_m2":
        quant = config["quantization_config"]
        assert quant["quant_method"] == "fp8" and quant["fmt"] == "float8_e4m3fn"
        assert len(config["attn_type_list"]) == layers and config["shared_intermediate_size"] == 0
        assert config["rotary_dim"] < config["head_dim"] and config["qk_norm_type"] == "per_layer"
        block = quant["weight_block_size"]
        assert config["hidden_size"] % block[1] and config["intermediate_size"] % block[0], "no partial blocks"
    if family == "glm4_moe":
        assert config["partial_rotary_factor"] < 1 and config["use_qk_norm"] and config["attention_bias"]
        assert config["topk_group"] < config["n_group"] and config["num_nextn_predict_layers"] == 1
        assert isinstance(config["eos_token_id"], list)
    if family == "qwen3_moe":
        assert config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]
        assert config["mlp_only_layers"] and config["norm_topk_prob"] and not config["use_sliding_window"]


def _moe_layers(config) -> list[int]:
    layers, family = range(config["num_hidden_layers"]), config["model_type"]
    if family == "qwen3_moe":
        sparse = [i for i in layers if (i + 1) % config["decoder_sparse_step"] == 0]
        return [i for i in sparse if i not in config["mlp_only_layers"]]
    if family == "glm4_moe":
        return list(layers)[config["first_k_dense_replace"] :]
    return list(layers)


def released_layout(config) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of every tensor of a released checkpoint of this family, at this config's sizes
    (the MTP layer of GLM excepted: its tensors are checked for presence only)."""
    family = config["model_type"]
    h, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // heads
    bf16, f32, fp8, u8 = "bfloat16", "float32", "float8_e4m3fn", "uint8"
    block = config.get("quantization_config", {}).get("weight_block_size")
    out = {}

    def linear(name, shape):
        if family == "minimax_m2":
            out[name] = (shape, fp8)
            out[name + "_scale_inv"] = ((-(-shape[0] // block[0]), -(-shape[1] // block[1])), f32)
        else:
            out[name] = (shape, bf16)

    def mlp(prefix, inter, gate="gate_proj", up="up_proj", down="down_proj"):
        linear(f"{prefix}{gate}.weight", (inter, h))
        linear(f"{prefix}{up}.weight", (inter, h))
        linear(f"{prefix}{down}.weight", (h, inter))

    out["model.embed_tokens.weight"] = ((vocab, h), bf16)
    out["model.norm.weight"] = ((h,), bf16)
    out["lm_head.weight"] = ((vocab, h), bf16)
    moe = _moe_layers(config)
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = ((h,), bf16)
        out[p + "post_attention_layernorm.weight"] = ((h,), bf16)
        a = p + "self_attn."
        for proj, rows in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
            linear(f"{a}{proj}.weight", (rows, h))
            if family in ("glm4_moe", "gpt_oss"):
                out[f"{a}{proj}.bias"] = ((rows,), bf16)
        linear(a + "o_proj.weight", (h, heads * hd))
        if family == "gpt_oss":
            out[a + "o_proj.bias"] = ((h,), bf16)
            out[a + "sinks"] = ((heads,), bf16)
        if family in ("qwen3_moe", "glm4_moe"):
            out[a + "q_norm.weight"] = ((hd,), bf16)
            out[a + "k_norm.weight"] = ((hd,), bf16)
        if family == "minimax_m2":
            out[a + "q_norm.weight"] = ((heads * hd,), bf16)
            out[a + "k_norm.weight"] = ((kv * hd,), bf16)
        if layer not in moe:
            mlp(p + "mlp.", config["intermediate_size"])
            continue
        if family == "qwen3_moe":
            experts, inter = config["num_experts"], config["moe_intermediate_size"]
            out[p + "mlp.gate.weight"] = ((experts, h), bf16)
            for e in range(experts):
                mlp(f"{p}mlp.experts.{e}.", inter)
        elif family == "glm4_moe":
            experts, inter = config["n_routed_experts"], config["moe_intermediate_size"]
            out[p + "mlp.gate.weight"] = ((experts, h), bf16)
            out[p + "mlp.gate.e_score_correction_bias"] = ((experts,), f32)
            mlp(p + "mlp.shared_experts.", inter * config["n_shared_experts"])
            for e in range(experts):
                mlp(f"{p}mlp.experts.{e}.", inter)
        elif family in ("mixtral", "minimax_m2"):
            experts, inter = config["num_local_experts"], config["intermediate_size"]
            q = p + "block_sparse_moe."
            out[q + "gate.weight"] = ((experts, h), f32 if family == "minimax_m2" else bf16)
            if family == "minimax_m2":
                out[q + "e_score_correction_bias"] = ((experts,), f32)
            for e in range(experts):
                mlp(f"{q}experts.{e}.", inter, gate="w1", up="w3", down="w2")
        else:  # gpt_oss
            experts, inter = config["num_local_experts"], config["intermediate_size"]
            q = p + "mlp."
            out[q + "router.weight"] = ((experts, h), bf16)
            out[q + "router.bias"] = ((experts,), bf16)
            for proj, rows, cols in (("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)):
                out[f"{q}experts.{proj}_blocks"] = ((experts, rows, cols // 32, 16), u8)
                out[f"{q}experts.{proj}_scales"] = ((experts, rows, cols // 32), u8)
                out[f"{q}experts.{proj}_bias"] = ((experts, rows), bf16)
    return out


def test_tensors_have_the_released_layout(case):
    _, path, config, _ = case
    tensors = read_tensors(path)
    mtp_prefix = f"model.layers.{config['num_hidden_layers']}."
    actual = {n: (tuple(t.shape), t.dtype.name) for n, t in tensors.items() if not n.startswith(mtp_prefix)}
    expected = released_layout(config)
    assert sorted(actual) == sorted(expected), set(actual) ^ set(expected)
    for name, layout in expected.items():
        assert actual[name] == layout, f"{name}: {actual[name]} != {layout}"
    mtp = [n for n in tensors if n.startswith(mtp_prefix)]
    assert bool(mtp) == (config.get("num_nextn_predict_layers", 0) > 0)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(tensors)
    assert all((path / f).exists() for f in set(index["weight_map"].values()))
    if config["model_type"] in ("minimax_m2", "gpt_oss"):  # a scale in another shard than its weight
        split = [
            n
            for n in index["weight_map"]
            if n.endswith(("_scale_inv", "_scales"))
            and index["weight_map"][n]
            != index["weight_map"][n.removesuffix("_scale_inv") if n.endswith("_scale_inv") else n[:-7] + "_blocks"]
        ]
        assert split, "no quantized weight straddles a shard boundary"


# ---------------------------------------------------------------- bit-level decoders, from the formats


def decode_e4m3fn(raw: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bytes -> float64: sign bit 7, exponent bits 6-3 (bias 7), mantissa bits 2-0, subnormals at
    exponent 0, no infinities, NaN only at S.1111.111."""
    bits = raw.view(np.uint8).astype(np.int64)
    sign = np.where(bits >> 7, -1.0, 1.0)
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    normal = np.ldexp(1.0 + mantissa / 8.0, exponent - 7)
    subnormal = np.ldexp(mantissa / 8.0, -6)
    value = sign * np.where(exponent == 0, subnormal, normal)
    return np.where((exponent == 15) & (mantissa == 7), np.nan, value)


def decode_fp8_blocks(weight: np.ndarray, scale_inv: np.ndarray, block) -> np.ndarray:
    """Each [block[0], block[1]] tile (cut short at the right and bottom edges) times its own scale_inv."""
    rows, cols = weight.shape
    assert scale_inv.shape == (-(-rows // block[0]), -(-cols // block[1]))
    scale = np.repeat(np.repeat(scale_inv.astype(np.float64), block[0], 0), block[1], 1)[:rows, :cols]
    return decode_e4m3fn(weight) * scale


def decode_e2m1(nibbles: np.ndarray) -> np.ndarray:
    """e2m1 codes -> float64: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0, subnormal at exponent 0."""
    n = nibbles.astype(np.int64)
    sign = np.where(n >> 3, -1.0, 1.0)
    exponent, mantissa = (n >> 1) & 0x3, n & 0x1
    return sign * np.where(exponent == 0, 0.5 * mantissa, np.ldexp(1.0 + 0.5 * mantissa, exponent - 1))


def decode_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[..., G, 16] bytes + [..., G] e8m0 scales -> [..., G * 32]: in each byte the low nibble is the earlier
    of two consecutive values; each group of 32 values is scaled by 2^(scale - 127)."""
    values = np.empty((*blocks.shape[:-1], 32))
    values[..., 0::2] = decode_e2m1(blocks & 0x0F)
    values[..., 1::2] = decode_e2m1(blocks >> 4)
    values = np.ldexp(values, scales.astype(np.int64)[..., None] - 127)
    return values.reshape(*scales.shape[:-1], -1)


def test_quantized_tensors_decode_to_the_golden_weights(case):
    """The checkpoint decodes (checkpoint_factory) to exactly the float32 weights transformers ran with, and a
    decoder written here from the FP8 / MXFP4 definitions agrees with checkpoint_factory's, bit for bit."""
    _, path, config, golden = case
    decoded = checkpoint_as_float32(path)
    assert float32_digest(decoded) == str(golden["weights_f32_digest"])
    tensors = read_tensors(path)
    quantized = []
    for name, value in tensors.items():
        if name.endswith("_scale_inv"):
            base = name.removesuffix("_scale_inv")
            block = config["quantization_config"]["weight_block_size"]
            ours = decode_fp8_blocks(tensors[base], value, block)
            assert np.all(value > 0) and np.isfinite(ours).all()
            quantized.append(base)
        elif name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            ours = decode_mxfp4(value, tensors[base + "_scales"])
            assert np.all(tensors[base + "_scales"] < 255), "e8m0 255 is NaN"
            quantized.append(base)
        else:
            continue
        assert decoded[base].shape == ours.shape and np.array_equal(decoded[base], ours.astype(np.float32)), base
    if config["model_type"] == "minimax_m2":  # attention and expert projections, nothing else
        projections = [n for n in decoded if n.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight"))]
        assert sorted(quantized) == sorted(projections)
    if config["model_type"] == "gpt_oss":
        assert len(quantized) == 2 * config["num_hidden_layers"]
        # the e8m0 scales vary from group to group, so a wrong group-to-scale mapping would show
        scales = tensors["model.layers.0.mlp.experts.down_proj_scales"]
        assert len(np.unique(scales)) >= 3
    if quantized:
        quantized.sort()
        assert quantized == golden["quantized_names"].tolist()
        sums = [[decoded[n].astype(np.float64).sum(), (decoded[n].astype(np.float64) ** 2).sum()] for n in quantized]
        np.testing.assert_allclose(sums, golden["quantized_sums"], rtol=1e-12, atol=1e-12)
    else:
        assert "quantized_names" not in golden


def test_golden_is_consistent_with_the_checkpoint(case):
    """Shapes, token ranges, MoE layers, router inputs vs router logits and the top-k bookkeeping."""
    _, path, config, golden = case
    family, vocab = config["model_type"], config["vocab_size"]
    weights = checkpoint_as_float32(path)
    prompts = [golden[f"prompt{i}_ids"] for i in range(2)]
    eos = config["eos_token_id"] if isinstance(config["eos_token_id"], list) else [config["eos_token_id"]]
    for i, prompt in enumerate(prompts):
        logits, generated = golden[f"prompt{i}_logits"], golden[f"prompt{i}_generated"]
        assert logits.shape == (len(prompt), vocab) and np.isfinite(logits).all()
        assert generated.shape == (NEW_TOKENS,) and not set(generated.tolist()) & set(eos)
        assert prompt.min() >= 0 and prompt.max() < vocab and generated.max() < vocab
        top2 = np.sort(logits[-1])[-2:]
        assert generated[0] == logits[-1].argmax() and top2[1] - top2[0] >= 1e-2
    assert golden["moe_layers"].tolist() == _moe_layers(config)
    tokens = sum(len(p) for p in prompts)
    k = config["num_experts_per_tok"]
    for layer in golden["moe_layers"].tolist():
        hidden = golden[f"layer{layer}_router_input"].astype(np.float64)
        if family in ("mixtral", "minimax_m2"):
            router = weights[f"model.layers.{layer}.block_sparse_moe.gate.weight"]
        elif family == "gpt_oss":
            router = weights[f"model.layers.{layer}.mlp.router.weight"]
        else:
            router = weights[f"model.layers.{layer}.mlp.gate.weight"]
        expected_logits = hidden @ router.astype(np.float64).T
        if family == "gpt_oss":
            expected_logits += weights[f"model.layers.{layer}.mlp.router.bias"]
        logits = golden[f"layer{layer}_router_logits"]
        assert hidden.shape == (tokens, config["hidden_size"]) and logits.shape == (tokens, router.shape[0])
        np.testing.assert_allclose(logits, expected_logits, rtol=1e-4, atol=1e-4)
        ids, topk = golden[f"layer{layer}_topk_ids"], golden[f"layer{layer}_topk_weights"]
        assert ids.shape == topk.shape == (tokens, k)
        assert np.all(np.diff(ids, axis=-1) > 0) and ids.min() >= 0 and ids.max() < router.shape[0]
        assert np.all(golden[f"layer{layer}_margin"] >= MIN_ROUTING_MARGIN)
        total = config.get("routed_scaling_factor", 1.0) if family == "glm4_moe" else 1.0
        np.testing.assert_allclose(topk.sum(-1), total, rtol=1e-5)
        if family in ("qwen3_moe", "mixtral", "gpt_oss"):  # the k largest logits (biased for gpt-oss)
            chosen = np.zeros(expected_logits.shape, bool)
            np.put_along_axis(chosen, ids.astype(np.int64), True, -1)
            lowest_chosen = np.where(chosen, expected_logits, np.inf).min(-1)
            assert np.all(lowest_chosen > np.where(chosen, -np.inf, expected_logits).max(-1))


# ---------------------------------------------------------------- the README's spec, in numpy


def _rms_norm(x, weight, eps):
    return weight * (x / np.sqrt((x**2).mean(-1, keepdims=True) + eps))


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _rope_inv_freq(config) -> tuple[np.ndarray, float]:
    """(inverse frequency of each rotated pair, cos/sin factor)."""
    hd = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if config["model_type"] == "minimax_m2":
        dim = config["rotary_dim"]
    else:
        dim = int(hd * config.get("partial_rotary_factor", 1.0))
    base = config["rope_theta"]
    inv_freq = base ** (-np.arange(0, dim, 2) / dim)
    yarn = config.get("rope_scaling")
    if not yarn:
        return inv_freq, 1.0
    factor, original = yarn["factor"], yarn["original_max_position_embeddings"]
    low, high = (
        dim * np.log(original / (beta * 2 * np.pi)) / (2 * np.log(base))
        for beta in (yarn["beta_fast"], yarn["beta_slow"])
    )
    if yarn.get("truncate", True):
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)  # 0: keep, 1: interpolate by factor
    return inv_freq * (1 - ramp) + inv_freq / factor * ramp, 0.1 * np.log(factor) + 1.0


def _rope(x, positions, inv_freq, factor):
    """Half-split rotary on the first 2 * len(inv_freq) dims of the last axis: dim i pairs with dim i + r/2."""
    half = len(inv_freq)
    angle = positions[:, None, None] * inv_freq  # [T, 1, r/2]
    cos, sin = np.cos(angle) * factor, np.sin(angle) * factor
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)


def _route(config, w, layer, h):
    """(expert ids [T, k], weights [T, k]) of the family's router (README)."""
    family, k = config["model_type"], config["num_experts_per_tok"]
    p = f"model.layers.{layer}."
    if family in ("qwen3_moe", "glm4_moe"):
        logits = h @ w[p + "mlp.gate.weight"].T
    elif family == "gpt_oss":
        logits = h @ w[p + "mlp.router.weight"].T + w[p + "mlp.router.bias"]
    else:
        logits = h @ w[p + "block_sparse_moe.gate.weight"].T
    if family in ("qwen3_moe", "mixtral"):
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        ids = np.argsort(-probs, -1)[:, :k]
        top = np.take_along_axis(probs, ids, -1)
        if family == "mixtral" or config["norm_topk_prob"]:
            top = top / top.sum(-1, keepdims=True)
        return ids, top
    if family == "gpt_oss":
        ids = np.argsort(-logits, -1)[:, :k]
        top = np.take_along_axis(logits, ids, -1)
        top = np.exp(top - top.max(-1, keepdims=True))
        return ids, top / top.sum(-1, keepdims=True)
    scores = 1 / (1 + np.exp(-logits))
    if family == "glm4_moe":
        choice = scores + w[p + "mlp.gate.e_score_correction_bias"]
        groups, kept = config["n_group"], config["topk_group"]
        grouped = choice.reshape(len(h), groups, -1)
        group_score = np.sort(grouped, -1)[..., -2:].sum(-1)
        dropped = np.argsort(-group_score, -1)[:, kept:]
        np.put_along_axis(grouped, dropped[..., None], -np.inf, 1)
        choice = grouped.reshape(len(h), -1)
    else:
        choice = scores + w[p + "block_sparse_moe.e_score_correction_bias"]
    ids = np.argsort(-choice, -1)[:, :k]
    top = np.take_along_axis(scores, ids, -1)
    if family == "glm4_moe":
        top = top / (top.sum(-1, keepdims=True) + 1e-20) * config["routed_scaling_factor"]
    else:
        top = top / top.sum(-1, keepdims=True)
    return ids, top


def _expert(config, w, layer, e, x):
    family, p = config["model_type"], f"model.layers.{layer}."
    if family in ("qwen3_moe", "glm4_moe"):
        q = f"{p}mlp.experts.{e}."
        return (_silu(x @ w[q + "gate_proj.weight"].T) * (x @ w[q + "up_proj.weight"].T)) @ w[q + "down_proj.weight"].T
    if family in ("mixtral", "minimax_m2"):
        q = f"{p}block_sparse_moe.experts.{e}."
        return (_silu(x @ w[q + "w1.weight"].T) * (x @ w[q + "w3.weight"].T)) @ w[q + "w2.weight"].T
    q, limit, alpha = p + "mlp.experts.", config["swiglu_limit"], 1.702
    gate_up = x @ w[q + "gate_up_proj"][e].T + w[q + "gate_up_proj_bias"][e]  # rows interleaved: gate, up
    gate, up = np.minimum(gate_up[:, 0::2], limit), np.clip(gate_up[:, 1::2], -limit, limit)
    glu = gate / (1 + np.exp(-alpha * gate))
    return ((up + 1) * glu) @ w[q + "down_proj"][e].T + w[q + "down_proj_bias"][e]


def numpy_forward(config, w, prompt) -> np.ndarray:
    """float64 logits [T, vocab] of one prompt, following tests/golden/README.md."""
    family, eps = config["model_type"], config["rms_norm_eps"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or config["hidden_size"] // heads
    inv_freq, rope_factor = _rope_inv_freq(config)
    moe = _moe_layers(config)
    positions = np.arange(len(prompt), dtype=np.float64)
    x = w["model.embed_tokens.weight"][prompt]
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = _rms_norm(x, w[p + "input_layernorm.weight"], eps)
        a = p + "self_attn."
        q, k, v = (h @ w[f"{a}{n}_proj.weight"].T + w.get(f"{a}{n}_proj.bias", 0.0) for n in "qkv")
        if family == "minimax_m2":  # one RMSNorm over all heads
            q, k = _rms_norm(q, w[a + "q_norm.weight"], eps), _rms_norm(k, w[a + "k_norm.weight"], eps)
        q, k, v = q.reshape(len(x), heads, hd), k.reshape(len(x), kv, hd), v.reshape(len(x), kv, hd)
        if family == "qwen3_moe" or (family == "glm4_moe" and config["use_qk_norm"]):  # per head
            q, k = _rms_norm(q, w[a + "q_norm.weight"], eps), _rms_norm(k, w[a + "k_norm.weight"], eps)
        q, k = _rope(q, positions, inv_freq, rope_factor), _rope(k, positions, inv_freq, rope_factor)
        k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)  # head i uses kv head i // g
        scores = np.einsum("qhd,khd->hqk", q, k) * hd**-0.5
        query, key = np.arange(len(x))[:, None], np.arange(len(x))[None, :]
        visible = key <= query
        if family == "gpt_oss" and config["layer_types"][layer] == "sliding_attention":
            visible &= key > query - config["sliding_window"]
        scores = np.where(visible, scores, -np.inf)
        top = scores.max(-1, keepdims=True)
        if family == "gpt_oss":  # the sink: one more logit per head in the softmax's denominator only
            sink = w[a + "sinks"][:, None, None]
            top = np.maximum(top, sink)
            probs = np.exp(scores - top) / (np.exp(scores - top).sum(-1, keepdims=True) + np.exp(sink - top))
        else:
            probs = np.exp(scores - top) / np.exp(scores - top).sum(-1, keepdims=True)
        attended = np.einsum("hqk,khd->qhd", probs, v).reshape(len(x), heads * hd)
        x = x + attended @ w[a + "o_proj.weight"].T + w.get(a + "o_proj.bias", 0.0)
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        if layer not in moe:
            m = p + "mlp."
            out = (_silu(h @ w[m + "gate_proj.weight"].T) * (h @ w[m + "up_proj.weight"].T)) @ w[
                m + "down_proj.weight"
            ].T
        else:
            ids, weights = _route(config, w, layer, h)
            out = np.zeros_like(h)
            for t in range(len(h)):
                for e, g in zip(ids[t], weights[t], strict=True):
                    out[t] += g * _expert(config, w, layer, e, h[t : t + 1])[0]
            if family == "glm4_moe":
                s = p + "mlp.shared_experts."
                out += (_silu(h @ w[s + "gate_proj.weight"].T) * (h @ w[s + "up_proj.weight"].T)) @ w[
                    s + "down_proj.weight"
                ].T
        x = x + out
    return _rms_norm(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].T


def test_readme_spec_reproduces_the_golden_logits(case):
    """A float64 numpy forward written from tests/golden/README.md, on the checkpoint's decoded weights,
    gives transformers' logits: the spec is what the goldens compute."""
    _, path, config, golden = case
    weights = {n: v.astype(np.float64) for n, v in checkpoint_as_float32(path).items()}
    for i in range(2):
        prompt = golden[f"prompt{i}_ids"]
        ours, reference = numpy_forward(config, weights, prompt), golden[f"prompt{i}_logits"]
        error = np.sqrt(((ours - reference) ** 2).mean() / (reference**2).mean())
        assert error < 1e-5, f"prompt {i}: numpy spec forward off by {error:.2e} (relative RMS)"
        continuation = np.concatenate([prompt, golden[f"prompt{i}_generated"]])
        steps = numpy_forward(config, weights, continuation)[len(prompt) - 1 : -1].argmax(-1)
        np.testing.assert_array_equal(steps, golden[f"prompt{i}_generated"])
