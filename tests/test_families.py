"""Every registered family through the same runtime: the registry, a random checkpoint of each family's released
layout (its checkpoint map, written to disk and loaded like a real one), and the decode paths against the
family's own whole-sequence logits. Each family's logits against Hugging Face transformers are in
test_vs_transformers.py.
"""

import numpy as np
import pytest
from checkpoint_factory import tiny_config
from kernel_choice import EXACT_FLOAT32_FAMILY, kernel_family

import hybridjit
from hybridjit import cli
from hybridjit.config import ConfigError
from hybridjit.convert import convert_checkpoint
from hybridjit.export import save_checkpoint
from hybridjit.models import registry
from hybridjit.synthetic import SyntheticCheckpoint

SAME_MATH_RTOL = 1e-4  # as test_generation.py: float32 rounding between association orders
TINY = {
    "deepseek_v3": tiny_config("v3"),
    # A dense layer between MoE layers (mlp_only_layers), GQA with 2 query heads per key/value head, head_dim
    # not hidden / heads: the features that differ from DeepSeek's layout.
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 300, "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 24, "num_experts": 8, "num_experts_per_tok": 3,
        "norm_topk_prob": True, "mlp_only_layers": [1], "decoder_sparse_step": 1, "max_position_embeddings": 256,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1,
        "tie_word_embeddings": False,
    },
    # Every layer a MoE block named block_sparse_moe with experts w1/w3/w2; a sliding window shorter than the
    # prompts, so decode's window rule is checked against prefill's.
    "mixtral": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 300, "hidden_size": 64,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 256, "rope_theta": 1e6,
        "rms_norm_eps": 1e-5, "sliding_window": 5, "bos_token_id": 1, "eos_token_id": 2,
        "tie_word_embeddings": False,
    },
    # Partial rotary, q/k/v biases without an o_proj bias, QK norm, sigmoid routing with correction bias and group
    # limits, a shared expert and a dense first layer.
    "glm4_moe": {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 300, "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 24, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 24, "partial_rotary_factor": 0.5, "attention_bias": True,
        "use_qk_norm": True, "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4,
        "topk_group": 2, "first_k_dense_replace": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "eos_token_id": [1, 2],
        "tie_word_embeddings": False,
    },
    # QK norms over all heads, partial rotary, sigmoid routing with the correction bias on block_sparse_moe.
    "minimax_m2": {
        "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "vocab_size": 300, "hidden_size": 64,
        "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 24, "rotary_dim": 12, "num_local_experts": 8, "num_experts_per_tok": 3, "use_qk_norm": True,
        "qk_norm_type": "per_layer", "scoring_func": "sigmoid", "use_routing_bias": True,
        "shared_intermediate_size": 0, "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    },
    # Sinks, q/k/v/o biases, sliding layers (window 4, shorter than the prompts) between full ones, YaRN, a router
    # bias, MXFP4 experts with interleaved gate/up rows, biases and the clamped SwiGLU.
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 300, "hidden_size": 64,
        "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 3, "attention_bias": True,
        "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "swiglu_limit": 2.0, "max_position_embeddings": 256, "rope_theta": 150000, "rms_norm_eps": 1e-5,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 64, "truncate": False},
        "quantization_config": {"quant_method": "mxfp4"}, "eos_token_id": 1, "tie_word_embeddings": False,
    },
}
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


def test_every_family_has_a_tiny_case():
    assert set(TINY) == {t for f in registry.FAMILIES for t in f.config.MODEL_TYPES} - {"deepseek_v2", "kimi_k2"}


def save_tiny(family: str, directory, seed: int):
    """A random checkpoint of TINY[family] written to `directory` (no end-of-sequence token, so that generation
    runs its full length): float tensors as float32, raw ones (MXFP4 blocks and scales) as they are."""
    raw = TINY[family]
    synthetic = SyntheticCheckpoint(registry.config_from_hf(raw), seed=seed)
    tensors = {name: np.asarray(synthetic.get(name)) for name in synthetic.tensors}
    tensors = {n: t if t.dtype == np.uint8 else t.astype(np.float32) for n, t in tensors.items()}
    return save_checkpoint(directory, {**raw, "eos_token_id": None}, tensors)


@pytest.fixture(scope="module", params=sorted(TINY))
def model(request, tmp_path_factory):
    path = save_tiny(request.param, tmp_path_factory.mktemp(request.param), seed=3)
    with kernel_family(EXACT_FLOAT32_FAMILY):
        m = hybridjit.load(path, dtype="float32")
        yield m
        m.close()


def rel_rms(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


def test_the_registry_names_the_family(model):
    assert model.config.model_type in model.family.config.MODEL_TYPES
    assert registry.family_of(model.config) is model.family


def test_info_describes_the_checkpoint(model, capsys):
    assert cli.main(["info", str(model.path)]) == 0
    out = capsys.readouterr().out
    assert f"model type      {model.config.model_type}" in out and "routed experts" in out


def test_greedy_decode_follows_whole_sequence_logits(model):
    prompt = PROMPTS[0]
    new = model.generate(prompt, max_new_tokens=5)
    seq = list(prompt)
    for token in new:
        assert token == int(np.argmax(model.logits([seq])[0, -1]))
        seq.append(token)


def test_decode_step_logits_equal_whole_sequence_logits(model):
    cfg, w, family = model.config, model.weights, model.family
    seq = np.array(PROMPTS[2], np.int32)[None]
    full = np.asarray(family.model.prefill(cfg, w, seq)[0])[0]
    cache = family.model.init_cache(cfg, 1, 32, np.float32)
    _, cache = family.model.prefill(cfg, w, seq[:, :4], cache)
    for pos in range(4, seq.shape[1]):
        logits, cache = family.model.decode_step(cfg, w, seq[:, pos], np.array([pos], np.int32), cache)
        assert rel_rms(np.asarray(logits)[0], full[pos]) < SAME_MATH_RTOL, pos


@pytest.mark.parametrize("dual_batch", [True, False])
def test_batched_generation_equals_one_by_one(model, dual_batch):
    """With dual-batch overlap the two micro-batches interleave: a dense layer after a MoE layer (Qwen3's
    mlp_only_layers) must still take each micro-batch's routed experts back before its attention."""
    model.dual_batch = dual_batch
    try:
        assert model.generate(PROMPTS, max_new_tokens=5) == [model.generate(p, max_new_tokens=5) for p in PROMPTS]
    finally:
        model.dual_batch = True


def test_gpt_oss_mxfp4_experts_refuse_conversion(tmp_path):
    """MXFP4 experts run as released: conversion names the reason instead of writing a checkpoint that cannot load."""
    raw = TINY["gpt_oss"]
    src = save_checkpoint(tmp_path / "src", raw, {})
    with pytest.raises(ValueError, match="gpt_oss: its experts are stored in a format of their own"):
        convert_checkpoint(src, tmp_path / "dst", "int4")


def test_an_unsupported_model_type_names_the_supported_ones():
    with pytest.raises(ConfigError, match="qwen3_moe") as e:
        registry.config_from_hf({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "x/config.json")
    assert "deepseek_v3" in str(e.value) and "x/config.json" in str(e.value)


def test_a_family_is_found_by_its_architecture_too():
    raw = {k: v for k, v in TINY["qwen3_moe"].items() if k != "model_type"}
    assert registry.family_for_hf_config(raw).config.MODEL_TYPES == ("qwen3_moe",)


def test_qwen3_reads_num_experts_under_either_name():
    raw = dict(TINY["qwen3_moe"])
    released = registry.config_from_hf(raw)
    raw["num_local_experts"] = raw.pop("num_experts")  # as transformers writes it
    assert registry.config_from_hf(raw) == released


def test_names_and_geometries_cover_every_family():
    released = {"deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "glm-4.5", "minimax-m2",
                "gpt-oss-20b", "gpt-oss-120b"}
    assert released <= set(registry.NAMES) and released <= set(registry.GEOMETRIES)
    for name, raw in registry.GEOMETRIES.items():
        assert registry.config_from_hf(raw, name).model_type == raw["model_type"]
