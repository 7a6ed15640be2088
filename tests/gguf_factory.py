"""Tiny checkpoints written as GGUF files the way llama.cpp's convert_hf_to_gguf.py writes them, for tests.

Written from its own statement of llama.cpp's conventions (not the loader's tables): tensor names, stacked
routed experts, numpy shapes (ggml's reversed), Llama-arch Q/K rows permuted for RoPE, DeepSeek's kv_b kept or
split into k_b (transposed per head) and v_b (split: MLA's one KV head), GLM's MTP layer (its own tensors as
blk.L.nextn.*, the rest named as any layer's) and its MLP norm (post_attention_norm), the metadata keys of each
architecture, and K-quant blocks from a simple quantiser of its own (checked against gguf.quants.dequantize by the
tests). gpt-oss as the converter's GptOssModel writes it: the released fused gate_up_proj split into gate (even
rows) and up (odd rows), weights and biases; MXFP4 blocks repacked into ggml's block (the e8m0 byte first, then
element j in the low nibble of byte j and element j + 16 in its high one); sinks as attn_sinks.weight, the router
as ffn_gate_inp with its bias, the MLP norm as post_attention_norm; sliding_window in the metadata.
"""

import io
import re
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
ARCH = {"deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2", "qwen3_moe": "qwen3moe", "mixtral": "llama",
        "glm4_moe": "glm4moe", "minimax_m2": "minimax-m2", "gpt_oss": "gpt-oss"}  # fmt: skip
_PER_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.sinks": "attn_sinks.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "block_sparse_moe.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
# Where an architecture's tensor list (gguf-py's MODEL_TENSORS) lacks the usual tensor, the converter's map sends the
# name elsewhere: glm4moe has no FFN_NORM, so GLM-4.5's post_attention_layernorm is ATTN_POST_NORM.
_ARCH_PER_LAYER = {
    "glm4moe": {"post_attention_layernorm.weight": "post_attention_norm.weight"},
    "gpt-oss": {"post_attention_layernorm.weight": "post_attention_norm.weight"},
}
# The MTP layer's own tensors (NEXTN_*); its decoder-layer tensors keep the per-layer names.
_NEXTN = {"eh_proj.weight", "enorm.weight", "hnorm.weight", "embed_tokens.weight", "shared_head.head.weight",
          "shared_head.norm.weight"}  # fmt: skip
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(?:_(blocks|scales|bias))?$")


# --- K-quant and Q8_0 blocks --------------------------------------------------------------------------------


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(*v.shape, 2)


def _with_mins(w: np.ndarray, group: int, q_max: int, sc_max: int):
    """A K-quant with mins, per `group` elements of each 256: w ~ d*sc*q - dmin*m, q in 0..q_max, sc and m in
    0..sc_max. Returns d, dmin (float16 [n]), sc, m (uint8 [n, 256 / group]) and q (uint8 [n, 256 / group, group])."""
    x = w.astype(np.float32).reshape(-1, 256 // group, group)
    lo = np.minimum(x.min(-1), 0)
    scale, mins = (x.max(-1) - lo) / q_max, -lo
    d, dmin = (scale.max(-1) / sc_max).astype(np.float16), (mins.max(-1) / sc_max).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.where(df > 0, np.rint(scale / np.where(df > 0, df, 1)), 0).clip(0, sc_max).astype(np.uint8)
    m = np.where(dminf > 0, np.rint(mins / np.where(dminf > 0, dminf, 1)), 0).clip(0, sc_max).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.where(step > 0, np.rint((x + (dminf * m)[..., None]) / np.where(step > 0, step, 1)), 0).clip(0, q_max)
    return d, dmin, sc, m, q.astype(np.uint8)


def _signed(w: np.ndarray, q_min: int, q_max: int, sc_min: int, sc_max: int):
    """A K-quant without mins, per 16 elements of each 256: w ~ d*sc*q, q in q_min..q_max (a group's largest
    magnitude at q = max(q_max, -q_min - 1), so that it fits with either sign), sc in sc_min..sc_max. Returns d
    (float16 [n]), sc (int [n, 16]) and q (int [n, 16, 16])."""
    x = w.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(x).max(-1) / max(-q_min - 1, q_max)
    d = (scale.max(-1) / sc_max).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    sc = np.where(df > 0, np.rint(scale / np.where(df > 0, df, 1)), 0).clip(sc_min, sc_max).astype(np.int32)
    step = (df * sc)[..., None]
    return d, sc, np.where(step != 0, np.rint(x / np.where(step != 0, step, 1)), 0).clip(q_min, q_max).astype(np.int32)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float [rows, cols % 256 == 0] -> Q4_K bytes [rows, cols / 256 * 144]: per 32, w ~ d*sc*q - dmin*m."""
    d, dmin, sc, m, q = _with_mins(w, 32, 15, 63)
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    high_bits = (sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6))
    scales = np.concatenate([*high_bits, (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=1)
    blocks = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=1)
    return blocks.reshape(w.shape[0], -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float [rows, cols % 256 == 0] -> Q6_K bytes [rows, cols / 256 * 210]: per 16, w ~ d*sc*(q - 32)."""
    d, sc, q = _signed(w, -32, 31, -128, 127)
    q = (q + 32).astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128
    ql = (q[:, :, :64] & 15) | ((q[:, :, 64:] & 15) << 4)  # element j and j + 64 share a byte
    hi = (q >> 4).reshape(-1, 2, 4, 32)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    scales = sc.astype(np.int8).view(np.uint8)
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), scales, _f16_bytes(d)], axis=1)
    return blocks.reshape(w.shape[0], -1)


def _crumbs(q: np.ndarray) -> np.ndarray:
    """2-bit q [n, 256] -> [n, 64] bytes: element 128h + 32j + l at bits 2j of byte 32h + l."""
    q = q.reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def quantize_q2_k(w: np.ndarray) -> np.ndarray:
    """float [rows, cols % 256 == 0] -> Q2_K bytes [rows, cols / 256 * 84]: per 16, w ~ d*sc*q - dmin*m."""
    d, dmin, sc, m, q = _with_mins(w, 16, 3, 15)
    blocks = np.concatenate([sc | (m << 4), _crumbs(q), _f16_bytes(d), _f16_bytes(dmin)], axis=1)
    return blocks.reshape(w.shape[0], -1)


def quantize_q3_k(w: np.ndarray) -> np.ndarray:
    """float [rows, cols % 256 == 0] -> Q3_K bytes [rows, cols / 256 * 110]: per 16, w ~ d*(sc - 32)*(q - 4)."""
    d, sc, q = _signed(w, -4, 3, -32, 31)
    q = (q + 4).astype(np.uint8).reshape(-1, 256)
    hmask = ((q >> 2).reshape(-1, 8, 32) << np.arange(8, dtype=np.uint8)[:, None]).sum(1).astype(np.uint8)
    v = (sc + 32).astype(np.uint8)  # 6 bits: low 4 of scales 0-7 / 8-15 in the low / high nibbles of bytes 0-7,
    top = v >> 4  # the top 2 of scale 4k + i at bits 2k of byte 8 + i
    packed = np.concatenate(
        [
            (v[:, :8] & 15) | ((v[:, 8:] & 15) << 4),
            (top.reshape(-1, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(1),
        ],
        axis=1,
    )
    blocks = np.concatenate([hmask, _crumbs(q & 3), packed.astype(np.uint8), _f16_bytes(d)], axis=1)
    return blocks.reshape(w.shape[0], -1)


def quantize(w: np.ndarray, qtype: Q) -> np.ndarray:
    """A matrix as `qtype` bytes (F32, BF16 and Q8_0 from the gguf package, the K-quants from above)."""
    own = {Q.Q4_K: quantize_q4_k, Q.Q6_K: quantize_q6_k, Q.Q2_K: quantize_q2_k, Q.Q3_K: quantize_q3_k}
    if qtype in own:
        return own[qtype](w)
    return gguf.quants.quantize(w.astype(np.float32), qtype)


# --- writing ------------------------------------------------------------------------------------------------


def _metadata(w: gguf.GGUFWriter, arch: str, cfg: dict, kv_b_split: bool) -> None:
    a = arch
    heads = cfg["num_attention_heads"]
    nextn = cfg.get("num_nextn_predict_layers", 0) if arch == "glm4moe" else 0
    w.add_uint32(f"{a}.block_count", cfg["num_hidden_layers"] + nextn)
    w.add_uint32(f"{a}.context_length", cfg["max_position_embeddings"])
    w.add_uint32(f"{a}.embedding_length", cfg["hidden_size"])
    w.add_uint32(f"{a}.feed_forward_length", cfg["intermediate_size"])
    w.add_uint32(f"{a}.attention.head_count", heads)
    # DeepSeek's MLA as llama.cpp runs it (split kv_b): multi-query attention over the latent cache, one KV head
    mla = arch == "deepseek2" and kv_b_split
    w.add_uint32(f"{a}.attention.head_count_kv", 1 if mla else cfg.get("num_key_value_heads", heads))
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_float32(f"{a}.rope.freq_base", cfg.get("rope_theta", 10000.0))
    experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts")
    w.add_uint32(f"{a}.expert_count", experts)
    w.add_uint32(f"{a}.expert_used_count", cfg["num_experts_per_tok"])
    if arch in ("deepseek2", "glm4moe", "qwen3moe", "minimax-m2"):
        inter = cfg["intermediate_size"] if arch == "minimax-m2" else cfg["moe_intermediate_size"]
        w.add_uint32(f"{a}.expert_feed_forward_length", inter)
    if arch in ("deepseek2", "glm4moe"):
        w.add_uint32(f"{a}.leading_dense_block_count", cfg["first_k_dense_replace"])
        w.add_uint32(f"{a}.expert_shared_count", cfg["n_shared_experts"])
        w.add_float32(f"{a}.expert_weights_scale", cfg["routed_scaling_factor"])
        w.add_bool(f"{a}.expert_weights_norm", cfg["norm_topk_prob"])
        w.add_uint32(f"{a}.expert_group_count", cfg["n_group"])
        w.add_uint32(f"{a}.expert_group_used_count", cfg["topk_group"])
    sigmoid = cfg.get("scoring_func", "sigmoid" if arch == "glm4moe" else "softmax") == "sigmoid"
    if arch in ("deepseek2", "glm4moe", "minimax-m2"):
        w.add_uint32(f"{a}.expert_gating_func", 2 if sigmoid else 1)
    if arch == "deepseek2":
        rope, nope, v, rank = cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
        if cfg.get("q_lora_rank"):
            w.add_uint32(f"{a}.attention.q_lora_rank", cfg["q_lora_rank"])
        w.add_uint32(f"{a}.attention.kv_lora_rank", rank)
        w.add_uint32(f"{a}.rope.dimension_count", rope)
        if kv_b_split:  # recent conversions: MLA's sizes under *_mla, key/value_length those of the latent cache
            w.add_uint32(f"{a}.attention.key_length", rank + rope)
            w.add_uint32(f"{a}.attention.value_length", rank)
            w.add_uint32(f"{a}.attention.key_length_mla", nope + rope)
            w.add_uint32(f"{a}.attention.value_length_mla", v)
        else:
            w.add_uint32(f"{a}.attention.key_length", nope + rope)
            w.add_uint32(f"{a}.attention.value_length", v)
        yarn = cfg.get("rope_scaling") or {}
        if yarn.get("type") == "yarn":
            w.add_string(f"{a}.rope.scaling.type", "yarn")
            w.add_float32(f"{a}.rope.scaling.factor", yarn["factor"])
            w.add_uint32(f"{a}.rope.scaling.original_context_length", yarn["original_max_position_embeddings"])
            w.add_float32(f"{a}.rope.scaling.yarn_log_multiplier", 0.1 * yarn["mscale_all_dim"])
    else:
        head_dim = cfg.get("head_dim", cfg["hidden_size"] // heads)
        w.add_uint32(f"{a}.attention.key_length", head_dim)
        w.add_uint32(f"{a}.attention.value_length", head_dim)
        rotary = {"glm4moe": int(head_dim * cfg.get("partial_rotary_factor", 1)), "minimax-m2": cfg.get("rotary_dim")}
        w.add_uint32(f"{a}.rope.dimension_count", rotary.get(arch) or head_dim)
    if arch == "gpt-oss":
        w.add_uint32(f"{a}.expert_feed_forward_length", cfg["intermediate_size"])
        w.add_uint32(f"{a}.attention.sliding_window", cfg["sliding_window"])
        yarn = cfg["rope_scaling"]
        w.add_string(f"{a}.rope.scaling.type", "yarn")
        w.add_float32(f"{a}.rope.scaling.factor", yarn["factor"])
        w.add_uint32(f"{a}.rope.scaling.original_context_length", yarn["original_max_position_embeddings"])
        if cfg["swiglu_limit"] != 7.0:  # llama.cpp assumes the released 7; another goes in gguf-py's per-layer key
            w.add_array(f"{a}.swiglu_clamp_exp", [float(cfg["swiglu_limit"])] * cfg["num_hidden_layers"])
    if nextn:
        w.add_uint32(f"{a}.nextn_predict_layers", nextn)
    if cfg.get("bos_token_id") is not None:
        w.add_uint32("tokenizer.ggml.bos_token_id", cfg["bos_token_id"])
    eos = cfg.get("eos_token_id")
    if eos is not None:
        w.add_uint32("tokenizer.ggml.eos_token_id", eos[0] if isinstance(eos, list) else eos)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Llama-arch Q/K row order: each head's rotate-half pairs (i, i + d/2) made adjacent."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(cfg: dict, tensors: dict[str, np.ndarray], kv_b: str = "kv_b") -> dict[str, np.ndarray]:
    """float32 HF tensors -> float32 GGUF tensors (numpy order). kv_b: "kv_b", "split" (k_b + v_b) or "both"."""
    out, experts = {}, {}
    per_layer = {**_PER_LAYER, **_ARCH_PER_LAYER.get(ARCH[cfg["model_type"]], {})}
    for name, t in tensors.items():
        if m := _FUSED.match(name):
            out.update(_gpt_oss_experts(int(m[1]), m[2], m[3], t))
            continue
        t = t.astype(np.float32)
        if m := _EXPERT.match(name):
            experts.setdefault((int(m[1]), _PROJ[m[3]]), {})[int(m[2])] = t
            continue
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            out[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name]] = t  # fmt: skip
            continue
        layer, rest = re.match(r"model\.layers\.(\d+)\.(.+)", name).groups()
        if rest in _NEXTN:  # the MTP layer's own: blk.L.nextn.* (the rest of that layer is named as any layer's)
            out[f"blk.{layer}.nextn.{rest.removesuffix('.weight').replace('.', '_')}.weight"] = t
            continue
        if cfg["model_type"] == "mixtral" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            heads = cfg["num_attention_heads"] if "q_proj" in rest else cfg["num_key_value_heads"]
            t = _permute(t, heads)
        if rest == "self_attn.kv_b_proj.weight" and kv_b != "kv_b":
            heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            per_head = t.reshape(heads, nope + v, -1)
            out[f"blk.{layer}.attn_k_b.weight"] = per_head[:, :nope].transpose(0, 2, 1).copy()
            out[f"blk.{layer}.attn_v_b.weight"] = per_head[:, nope:].copy()
            if kv_b == "split":
                continue
        out[f"blk.{layer}.{per_layer[rest]}"] = t
    for (layer, proj), by_expert in experts.items():
        out[f"blk.{layer}.ffn_{proj}_exps.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def _ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Released MXFP4 (`_blocks` [..., groups, 16], element 2j in the low nibble of byte j; `_scales` [..., groups])
    -> ggml's blocks [..., groups * 17]: the scale byte, then qs[j] = element j | element j + 16 << 4."""
    codes = np.empty((*blocks.shape[:-1], 32), np.uint8)
    codes[..., 0::2], codes[..., 1::2] = blocks & 0xF, blocks >> 4
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scales[..., None], qs], axis=-1).reshape(*scales.shape[:-1], -1)


def _gpt_oss_experts(layer: int, projection: str, part: str, t: np.ndarray) -> dict[str, np.ndarray]:
    """One released fused tensor as the converter writes it: gate_up_proj split into its even (gate) and odd (up)
    rows; blocks as MXFP4 (uint8, under the weight's name), scales folded into them, biases float32; a float
    weight [E, out, in] (part None, the converter's path for an unquantised release) float32."""
    names = ["gate", "up"] if projection == "gate_up_proj" else ["down"]
    split = [t[:, 0::2], t[:, 1::2]] if len(names) == 2 else [t]
    if part == "scales":  # folded into the blocks: written with them
        return {}
    if part == "bias":
        return {f"blk.{layer}.ffn_{n}_exps.bias": s.astype(np.float32) for n, s in zip(names, split, strict=True)}
    if part is None:
        split = [s.astype(np.float32) for s in split]
    return {f"blk.{layer}.ffn_{n}_exps.weight": s for n, s in zip(names, split, strict=True)}


def write_gguf(
    path: Path,
    cfg: dict,
    tensors: dict[str, np.ndarray],
    *,
    expert_types: tuple[Q, Q] = (Q.F32, Q.F32),
    other_type: Q = Q.F32,
    kv_b: str = "kv_b",
    split_max_tensors: int = 0,
    tokenizer: dict | None = None,
) -> Path:
    """Writes the checkpoint (HF config and float tensors) as a GGUF file (or split set); returns the path to
    load. expert_types: the routed experts' gate/up type and down type; other_type: every other matrix's (norms,
    biases and routers stay F32, as llama.cpp keeps them)."""
    arch = ARCH[cfg["model_type"]]
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    _metadata(w, arch, cfg, kv_b != "kv_b")
    for key, value in (tokenizer or {}).items():
        w.add_key_value(key, value[0], value[1], sub_type=value[2] if len(value) > 2 else None)
    for name, t in gguf_tensors(cfg, tensors, kv_b).items():
        if t.dtype == np.uint8:  # gpt-oss's MXFP4 blocks, their scales from the released tensor beside them
            m = re.match(r"blk\.(\d+)\.ffn_(gate|up|down)_exps", name)
            fused = "down_proj" if m[2] == "down" else "gate_up_proj"
            scales = tensors[f"model.layers.{m[1]}.mlp.experts.{fused}_scales"]
            if fused == "gate_up_proj":
                scales = scales[:, 0::2] if m[2] == "gate" else scales[:, 1::2]
            w.add_tensor(name, _ggml_mxfp4(t, scales), raw_dtype=Q.MXFP4)
            continue
        if name.endswith("_exps.weight"):
            qtype = expert_types[1] if "ffn_down" in name else expert_types[0]
        else:
            qtype = other_type if t.ndim >= 2 and "ffn_gate_inp" not in name else Q.F32
        data = quantize(t.reshape(-1, t.shape[-1]), qtype)
        w.add_tensor(name, data.reshape(*t.shape[:-1], data.shape[-1]), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        parts = sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))
        return parts[0]
    return path


def sentencepiece_metadata(sp) -> dict:
    """A SentencePiece model's vocabulary as llama.cpp's converter writes a "llama" tokenizer: each piece with its
    score and type (1 normal, 2 unknown, 3 control, 5 unused, 6 byte), the special ids, a BOS before each text."""
    n = sp.get_piece_size()
    kinds = [(sp.is_unknown, 2), (sp.is_control, 3), (sp.is_unused, 5), (sp.is_byte, 6)]
    types = [next((t for test, t in kinds if test(i)), 1) for i in range(n)]
    S, A, U32 = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32
    return {
        "tokenizer.ggml.model": ("llama", S),
        "tokenizer.ggml.tokens": ([sp.id_to_piece(i) for i in range(n)], A, S),
        "tokenizer.ggml.scores": ([sp.get_score(i) for i in range(n)], A, gguf.GGUFValueType.FLOAT32),
        "tokenizer.ggml.token_type": (types, A, gguf.GGUFValueType.INT32),
        "tokenizer.ggml.bos_token_id": (sp.bos_id(), U32),
        "tokenizer.ggml.eos_token_id": (sp.eos_id(), U32),
        "tokenizer.ggml.unknown_token_id": (sp.unk_id(), U32),
        "tokenizer.ggml.add_bos_token": (True, gguf.GGUFValueType.BOOL),
    }


def sentencepiece_model(corpus: str, vocab_size: int = 1000):
    """A SentencePiece BPE model trained on `corpus` as Llama's and Mixtral's were (byte fallback, digits split, a
    dummy prefix, whitespace kept, no normalisation)."""
    import sentencepiece as spm  # test-only

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus.splitlines()), model_writer=proto, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, split_digits=True, add_dummy_prefix=True, allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity", character_coverage=0.9995, minloglevel=2,
    )  # fmt: skip
    return spm.SentencePieceProcessor(model_proto=proto.getvalue())


def write_tokenizer_gguf(path: Path, arch: str, metadata: dict, vocab_size: int) -> Path:
    """A GGUF of `arch` holding a tokenizer (write_gguf's `tokenizer` form) and an embedding of its size only."""
    w = gguf.GGUFWriter(path, arch)
    for key, value in metadata.items():
        w.add_key_value(key, value[0], value[1], sub_type=value[2] if len(value) > 2 else None)
    w.add_tensor("token_embd.weight", np.zeros((vocab_size, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
