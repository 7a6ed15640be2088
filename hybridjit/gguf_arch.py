"""llama.cpp's architectures as our families: a GGUF file's metadata as the family's config.json fields, and
each Hugging Face tensor name of a family's checkpoint map as the GGUF tensor llama.cpp's converter
(convert_hf_to_gguf.py, gguf-py's tensor_mapping.py) writes it to.

The config goes through the same `config_from_hf` as a config.json, so every family check applies. Facts of
llama.cpp's conversions that matter here:
- `deepseek2` is DeepSeek V2, V3, R1 and Kimi-K2; `llama` with experts is Mixtral; `qwen3moe`, `glm4moe`,
  `minimax-m2`, `gpt-oss` are the others.
- GLM-4.5's block_count counts its MTP (nextn) layers, which come after the decoder layers; its
  post_attention_layernorm is `blk.L.post_attention_norm` (glm4moe's tensor list has no ffn_norm).
- The routed experts of a layer are one stacked tensor per projection (`blk.L.ffn_gate_exps.weight` ...).
- gpt-oss: the converter splits the released gate_up_proj (gate and up rows interleaved) into ffn_gate_exps and
  ffn_up_exps, weights and biases alike, and writes the MXFP4 blocks in ggml's layout (gguf_checkpoint rebuilds the
  released tensors); its sinks are `blk.L.attn_sinks.weight`, its router `blk.L.ffn_gate_inp` with a bias. The
  file has no swiglu limit (llama.cpp uses 7.0, the released one) and no layer types: llama.cpp's gpt-oss windows
  every even layer (sliding first, as released).
- DeepSeek's YaRN keeps one mscale (`yarn_log_multiplier` = 0.1 * mscale_all_dim): llama.cpp reads
  mscale = mscale_all_dim, which every released DeepSeek config has.
"""

import re
from collections.abc import Callable

from hybridjit.gguf_file import GGUFError, GGUFFile

# Per-layer tensors, by their name after "model.layers.L." (HF) and "blk.L." (GGUF), without .weight/.bias.
_LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# Where an architecture's tensor list in llama.cpp (gguf-py constants.py MODEL_TENSORS) lacks the usual tensor, its
# converter maps the Hugging Face name elsewhere: GLM-4.5's post_attention_layernorm (the norm before its MLP) is
# ATTN_POST_NORM, "blk.L.post_attention_norm", as glm4moe has no FFN_NORM (gpt-oss likewise); gpt-oss's sinks
# (no .weight in the release) are ATTN_SINKS, the converter adding the suffix.
_ARCH_LAYER_TENSORS = {
    "glm4moe": {"post_attention_layernorm": "post_attention_norm"},
    "gpt-oss": {"post_attention_layernorm": "post_attention_norm", "self_attn.sinks": "attn_sinks"},
}
# Inside a MoE block ("mlp" or Mixtral's and MiniMax's "block_sparse_moe").
_MOE_TENSORS = {
    "gate.weight": "ffn_gate_inp.weight",
    "gate.e_score_correction_bias": "exp_probs_b.bias",
    "e_score_correction_bias": "exp_probs_b.bias",  # MiniMax-M2 keeps it on the block
    "shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "router.weight": "ffn_gate_inp.weight",  # gpt-oss
    "router.bias": "ffn_gate_inp.bias",
}
_EXPERT_PROJECTIONS = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}
_GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+?)(?:\.(weight|bias))?$")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_MOE = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(.+)$")


def gguf_name(hf_name: str, architecture: str = "") -> tuple[str, int | None] | None:
    """The GGUF tensor holding `hf_name` in a file of llama.cpp's `architecture`, and the expert's index in it for a
    routed expert's matrix; None for a name llama.cpp has no tensor for."""
    if hf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[hf_name], None
    if m := _EXPERT.match(hf_name):
        projection = _EXPERT_PROJECTIONS.get(m[3])
        return (f"blk.{m[1]}.ffn_{projection}_exps.weight", int(m[2])) if projection else None
    if (m := _MOE.match(hf_name)) and m[2] in _MOE_TENSORS:
        return f"blk.{m[1]}.{_MOE_TENSORS[m[2]]}", None
    if m := _LAYER.match(hf_name):
        base = _ARCH_LAYER_TENSORS.get(architecture, {}).get(m[2], _LAYER_TENSORS.get(m[2]))
        if base is not None:
            return f"blk.{m[1]}.{base}.{m[3] or 'weight'}", None
    return None


# --- metadata -> config.json fields -----------------------------------------------------------------------


def _layer_count(g: GGUFFile) -> int:
    return int(g.key("{arch}.block_count")) - int(g.key("{arch}.nextn_predict_layers", 0))


def _scalar(value):
    """Head counts may be stored per layer: the models we run have one value for every layer."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise GGUFError(f"per-layer values {value[:8]}... differ across layers: not supported")
        return value[0]
    return value


def _moe_layers(g: GGUFFile) -> list[int]:
    return [i for i in range(_layer_count(g)) if f"blk.{i}.ffn_gate_inp.weight" in g.tensors]


def _expert_size(g: GGUFFile) -> int:
    layers = _moe_layers(g)
    if not layers:
        raise GGUFError(f"{g.path}: no layer has routed experts (blk.L.ffn_gate_inp.weight): not a MoE model")
    return g.tensor(f"blk.{layers[0]}.ffn_gate_exps.weight").shape[1]


def _dense_size(g: GGUFFile) -> int:
    dense = [i for i in range(_layer_count(g)) if f"blk.{i}.ffn_gate.weight" in g.tensors]
    return g.tensor(f"blk.{dense[0]}.ffn_gate.weight").shape[0] if dense else int(g.key("{arch}.feed_forward_length"))


def _eos_ids(g: GGUFFile) -> list[int]:
    """The end-of-sequence token, and the end-of-turn one where it differs (chat models stop on either)."""
    ids = [g.key(k, None) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    return list(dict.fromkeys(i for i in ids if i is not None))


def _decoder(g: GGUFFile, model_type: str) -> dict:
    heads = int(_scalar(g.key("{arch}.attention.head_count")))
    return {
        "model_type": model_type,
        "hidden_act": "silu",
        "vocab_size": g.tensor("token_embd.weight").shape[0],
        "hidden_size": int(g.key("{arch}.embedding_length")),
        "num_hidden_layers": _layer_count(g),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(g.key("{arch}.attention.head_count_kv", heads))),
        "rms_norm_eps": float(g.key("{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(g.key("{arch}.context_length")),
        "rope_theta": float(g.key("{arch}.rope.freq_base", 10000.0)),
        "bos_token_id": g.key("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _eos_ids(g),
        "tie_word_embeddings": "output.weight" not in g.tensors,
    }


def _yarn(g: GGUFFile, **extra) -> dict:
    """rope_scaling of a YaRN-scaled model, else {}."""
    if g.key("{arch}.rope.scaling.type", "none") != "yarn":
        return {}
    return {
        "rope_scaling": {
            "type": "yarn",
            "factor": float(g.key("{arch}.rope.scaling.factor")),
            "original_max_position_embeddings": int(g.key("{arch}.rope.scaling.original_context_length")),
            "beta_fast": float(g.key("{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(g.key("{arch}.rope.scaling.yarn_beta_slow", 1.0)),
            **extra,
        }
    }


def _has(g: GGUFFile, suffix: str) -> bool:
    return any(name.endswith(suffix) for name in g.tensors)


def _sigmoid(g: GGUFFile) -> bool:
    return int(g.key("{arch}.expert_gating_func", 1)) == 2  # llama.cpp: 1 softmax, 2 sigmoid


def _grouped_routing(g: GGUFFile) -> dict:
    return {
        "n_routed_experts": int(g.key("{arch}.expert_count")),
        "num_experts_per_tok": int(g.key("{arch}.expert_used_count")),
        "n_shared_experts": int(g.key("{arch}.expert_shared_count", 0)),
        "n_group": int(g.key("{arch}.expert_group_count", 1)),
        "topk_group": int(g.key("{arch}.expert_group_used_count", 1)),
        "routed_scaling_factor": float(g.key("{arch}.expert_weights_scale", 1.0)),
        "moe_intermediate_size": _expert_size(g),
        "intermediate_size": _dense_size(g),
        "first_k_dense_replace": int(g.key("{arch}.leading_dense_block_count", 0)),
    }


def _deepseek2(g: GGUFFile) -> dict:
    routing = _grouped_routing(g)
    if _has(g, ".exp_probs_b.bias"):
        method = "noaux_tc"
    else:
        method = "group_limited_greedy" if routing["n_group"] > 1 else "greedy"
    rope = int(g.key("{arch}.rope.dimension_count"))
    # Recent conversions give the MLA sizes as key/value_length_mla (key/value_length then being the latent
    # cache's); older ones as key/value_length.
    key_length = int(g.key("{arch}.attention.key_length_mla", None) or g.key("{arch}.attention.key_length"))
    value_length = int(g.key("{arch}.attention.value_length_mla", None) or g.key("{arch}.attention.value_length"))
    mscale = float(g.key("{arch}.rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
    return {
        **_decoder(g, "deepseek_v3" if method == "noaux_tc" else "deepseek_v2"),
        **routing,
        "topk_method": method,
        "scoring_func": "sigmoid" if _sigmoid(g) else "softmax",
        "norm_topk_prob": bool(g.key("{arch}.expert_weights_norm", False)),
        "q_lora_rank": int(g.key("{arch}.attention.q_lora_rank", 0)) or None,
        "kv_lora_rank": int(g.key("{arch}.attention.kv_lora_rank")),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": key_length - rope,
        "v_head_dim": value_length,
        "rope_interleave": True,  # llama.cpp rotates DeepSeek's adjacent pairs on unpermuted weights
        **_yarn(g, mscale=mscale, mscale_all_dim=mscale),
    }


def _qwen3moe(g: GGUFFile) -> dict:
    moe = set(_moe_layers(g))
    return {
        **_decoder(g, "qwen3_moe"),
        "num_experts": int(g.key("{arch}.expert_count")),
        "num_experts_per_tok": int(g.key("{arch}.expert_used_count")),
        "moe_intermediate_size": _expert_size(g),
        "intermediate_size": _dense_size(g),
        "head_dim": int(g.key("{arch}.attention.key_length")),
        "norm_topk_prob": bool(g.key("{arch}.expert_weights_norm", True)),  # llama.cpp's qwen3moe always renormalises
        "mlp_only_layers": [i for i in range(_layer_count(g)) if i not in moe],
        "attention_bias": _has(g, ".attn_q.bias"),
        **_yarn(g),
    }


def _llama(g: GGUFFile) -> dict:
    if not int(g.key("{arch}.expert_count", 0)):
        raise GGUFError(f"{g.path}: a dense llama model (no {g.architecture}.expert_count): not a MoE family")
    return {
        **_decoder(g, "mixtral"),
        "num_local_experts": int(g.key("{arch}.expert_count")),
        "num_experts_per_tok": int(g.key("{arch}.expert_used_count")),
        "intermediate_size": _expert_size(g),
        "head_dim": int(g.key("{arch}.rope.dimension_count")),
    }


def _glm4moe(g: GGUFFile) -> dict:
    head_dim = int(g.key("{arch}.attention.key_length"))
    return {
        **_decoder(g, "glm4_moe"),
        **_grouped_routing(g),
        "norm_topk_prob": bool(g.key("{arch}.expert_weights_norm", True)),
        "head_dim": head_dim,
        "partial_rotary_factor": int(g.key("{arch}.rope.dimension_count")) / head_dim,
        "use_qk_norm": _has(g, ".attn_q_norm.weight"),
        "attention_bias": _has(g, ".attn_q.bias"),
        "num_nextn_predict_layers": int(g.key("{arch}.nextn_predict_layers", 0)),
    }


def _minimax_m2(g: GGUFFile) -> dict:
    return {
        **_decoder(g, "minimax_m2"),
        "num_local_experts": int(g.key("{arch}.expert_count")),
        "num_experts_per_tok": int(g.key("{arch}.expert_used_count")),
        "intermediate_size": _expert_size(g),
        "head_dim": int(g.key("{arch}.attention.key_length")),
        "rotary_dim": int(g.key("{arch}.rope.dimension_count")),
        "scoring_func": "sigmoid" if _sigmoid(g) else "softmax",
        "use_qk_norm": _has(g, ".attn_q_norm.weight"),
        "use_routing_bias": _has(g, ".exp_probs_b.bias"),
    }


def _gpt_oss(g: GGUFFile) -> dict:
    layers = _layer_count(g)
    return {
        **_decoder(g, "gpt_oss"),
        "num_local_experts": int(g.key("{arch}.expert_count")),
        "num_experts_per_tok": int(g.key("{arch}.expert_used_count")),
        "intermediate_size": _expert_size(g),
        "head_dim": int(g.key("{arch}.attention.key_length")),
        "sliding_window": int(g.key("{arch}.attention.sliding_window")),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "swiglu_limit": float(_scalar(g.key("{arch}.swiglu_clamp_exp", 7.0))),
        **_yarn(g, truncate=False),
    }


ARCHITECTURES: dict[str, Callable[[GGUFFile], dict]] = {
    "deepseek2": _deepseek2,
    "qwen3moe": _qwen3moe,
    "llama": _llama,
    "glm4moe": _glm4moe,
    "minimax-m2": _minimax_m2,
    "gpt-oss": _gpt_oss,
}


def hf_config(g: GGUFFile) -> dict:
    """The config.json fields equivalent to the GGUF file's metadata."""
    build = ARCHITECTURES.get(g.architecture)
    if build is None:
        raise GGUFError(
            f"{g.path}: architecture {g.architecture!r} is not supported; supported llama.cpp architectures: "
            f"{', '.join(ARCHITECTURES)}"
        )
    return build(g)
