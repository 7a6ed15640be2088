"""Tiny random DeepSeek-V3-family checkpoints in the real Hugging Face layout, for tests (and, in the
section at the end, Qwen3-MoE, Mixtral, GLM-4.5, MiniMax-M2 and gpt-oss ones: FAMILY_CASES).

The same code runs in the reference venv (torch + transformers, to make goldens) and in CI (jax, no
torch), so it imports only numpy, ml_dtypes and safetensors. A checkpoint is a pure function of
(config, seed, weight_format, with_mtp_layer): each tensor draws from its own numpy generator seeded by
(seed, sha256(name)), and `tensor_digest` proves that a rebuilt checkpoint is byte-identical to the one
the goldens were made from.

Everything the real checkpoints do that a loader can get wrong is here on purpose: exact tensor names,
dense and MoE layers, per-expert tensors, float32 e_score_correction_bias next to bf16 weights, several
shards with a `weight_scale_inv` in a different shard than its weight, FP8 128x128 blocks that are
partial at the edges (hidden 200 = 128 + 72), and the multi-token-prediction layer that must be skipped.
"""

import hashlib
import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

FP8_BLOCK = (128, 128)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
WEIGHT_FORMATS = ("bf16", "fp8", "f32")

_COMMON = {
    "vocab_size": 300,
    "hidden_size": 200,  # not a multiple of 128: every FP8 matrix has partial edge blocks
    "intermediate_size": 264,
    "moe_intermediate_size": 136,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "kv_lora_rank": 80,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 24,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    # original_max_position_embeddings is small so that YaRN interpolates rope pairs that rotate
    # noticeably within the ~20 positions the tests use; a wrong YaRN then shows in the logits.
    "max_position_embeddings": 1024,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "use_cache": True,
    "aux_loss_alpha": 0.001,
    "seq_aux": True,
    "torch_dtype": "bfloat16",
}

PRESETS = {
    # DeepSeek-V3 / R1 / Kimi-K2: sigmoid router with correction bias, groups ranked by top-2 sums.
    "v3": {
        **_COMMON,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "q_lora_rank": 144,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "ep_size": 1,
        "num_nextn_predict_layers": 0,
        "rope_interleave": True,
        # The legacy key, as in the real DeepSeek-V3 config.json.
        "rope_scaling": {
            "type": "yarn",
            "factor": 4,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    },
    # DeepSeek-V2-Lite: no q LoRA (plain q_proj), softmax router, plain top-k, one group.
    # norm_topk_prob is false: transformers' V2 router ignores it, the original V2 code honours it.
    # No rope_interleave key, as in the real V2 config.json (V2 rope is always interleaved).
    "v2_lite_greedy": {
        **_COMMON,
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "q_lora_rank": None,
        "n_shared_experts": 2,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "greedy",
        "scoring_func": "softmax",
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    },
    # DeepSeek-V2: softmax router, groups ranked by their best expert. mscale != mscale_all_dim so the
    # YaRN attention factor on cos/sin differs from 1 (it is exactly 1 in every released config).
    "v2_group_limited": {
        **_COMMON,
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "q_lora_rank": 144,
        "n_shared_experts": 2,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "group_limited_greedy",
        "scoring_func": "softmax",
        "norm_topk_prob": False,
        "routed_scaling_factor": 2.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
    },
}

# The checkpoints tests/golden/make_golden.py makes goldens for; the tests rebuild them from this table.
GOLDEN_CASES = {
    "v3_bf16": {"preset": "v3", "seed": 1, "weight_format": "bf16", "with_mtp_layer": False},
    "v3_fp8": {"preset": "v3", "seed": 2, "weight_format": "fp8", "with_mtp_layer": True},
    "v2_lite_greedy_bf16": {
        "preset": "v2_lite_greedy",
        "seed": 3,
        "weight_format": "bf16",
        "with_mtp_layer": False,
    },
    "v2_group_limited_bf16": {
        "preset": "v2_group_limited",
        "seed": 4,
        "weight_format": "bf16",
        "with_mtp_layer": False,
    },
}

# Kinds of tensors. Only LINEAR ones are FP8 in real V3 checkpoints; MATRIX ones (lm_head, the MTP
# layer's eh_proj and head) stay bf16.
LINEAR, EMBED, NORM, ROUTER, BIAS, MATRIX = "linear", "embed", "norm", "router", "bias", "matrix"


def tiny_config(preset: str = "v3", **overrides) -> dict:
    """A full config.json dict at tiny size; `overrides` replace top-level keys."""
    config = json.loads(json.dumps(PRESETS[preset]))  # deep copy
    config.update(overrides)
    return config


def build_case(name: str, dirpath) -> Path:
    """Writes the checkpoint of GOLDEN_CASES[name] (DeepSeek) or FAMILY_CASES[name] (the other families) into
    dirpath."""
    family = name in FAMILY_CASES
    case = FAMILY_CASES[name] if family else GOLDEN_CASES[name]
    write, config = (write_family_checkpoint, family_config) if family else (write_checkpoint, tiny_config)
    return write(
        dirpath,
        config(case["preset"]),
        seed=case["seed"],
        weight_format=case["weight_format"],
        with_mtp_layer=case["with_mtp_layer"],
    )


def write_checkpoint(
    dirpath, config: dict, *, seed: int, weight_format: str, with_mtp_layer: bool = False
) -> Path:
    """Writes config.json, sharded safetensors and model.safetensors.index.json into dirpath.

    bf16: everything bf16 except e_score_correction_bias (float32, as in the real checkpoint).
    fp8: the projections real V3 quantizes become float8_e4m3fn + float32 `<name>_scale_inv` per 128x128
    block; embeddings, norms, router and lm_head stay bf16; config gets the real quantization_config.
    f32: everything float32.
    with_mtp_layer adds a few tensors of layer num_hidden_layers (the MTP module) that loaders must skip;
    num_nextn_predict_layers is then 1 in the written config, as in the real one.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format {weight_format!r} not in {WEIGHT_FORMATS}")
    dirpath = Path(dirpath)
    dirpath.mkdir(parents=True, exist_ok=True)
    config = json.loads(json.dumps(config))
    config.pop("quantization_config", None)
    if with_mtp_layer:
        config["num_nextn_predict_layers"] = 1
    config["torch_dtype"] = "float32" if weight_format == "f32" else "bfloat16"
    if weight_format == "fp8":
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(FP8_BLOCK),
        }

    tensors = {}
    for name, shape, kind in tensor_specs(config, with_mtp_layer):
        tensors.update(_encode(name, _random_tensor(seed, name, shape, kind), kind, weight_format))

    shards = _shard_plan(config, tensors)
    weight_map = {}
    for index, names in enumerate(shards):
        filename = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(dirpath / filename), metadata={"format": "pt"})
        weight_map.update({n: filename for n in names})
    index_json = {
        "metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (dirpath / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    (dirpath / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dirpath


def tensor_specs(config: dict, with_mtp_layer: bool = False) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor of the checkpoint, with the names real checkpoints use."""
    h = config["hidden_size"]
    heads = config["num_attention_heads"]
    qk_head = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    kv_rank = config["kv_lora_rank"]
    specs = [("model.embed_tokens.weight", (config["vocab_size"], h), EMBED)]
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        specs += [
            (p + "input_layernorm.weight", (h,), NORM),
            (p + "post_attention_layernorm.weight", (h,), NORM),
        ]
        specs += _attention_specs(config, p + "self_attn.", h, heads, qk_head, kv_rank)
        if layer < config["first_k_dense_replace"]:
            specs += _mlp_specs(p + "mlp.", h, config["intermediate_size"])
        else:
            specs += _moe_specs(config, p + "mlp.", h)
    specs += [("model.norm.weight", (h,), NORM), ("lm_head.weight", (config["vocab_size"], h), MATRIX)]
    if with_mtp_layer:
        p = f"model.layers.{config['num_hidden_layers']}."
        specs += [
            (p + "embed_tokens.weight", (config["vocab_size"], h), EMBED),
            (p + "enorm.weight", (h,), NORM),
            (p + "hnorm.weight", (h,), NORM),
            (p + "eh_proj.weight", (h, 2 * h), MATRIX),
            (p + "input_layernorm.weight", (h,), NORM),
            (p + "self_attn.kv_a_proj_with_mqa.weight", (kv_rank + config["qk_rope_head_dim"], h), LINEAR),
            (p + "mlp.gate.weight", (config["n_routed_experts"], h), ROUTER),
            (p + "mlp.experts.0.gate_proj.weight", (config["moe_intermediate_size"], h), LINEAR),
            (p + "shared_head.norm.weight", (h,), NORM),
            (p + "shared_head.head.weight", (config["vocab_size"], h), MATRIX),
        ]
    return specs


def _attention_specs(config, p, h, heads, qk_head, kv_rank):
    q_rank = config["q_lora_rank"]
    if q_rank is None:
        specs = [(p + "q_proj.weight", (heads * qk_head, h), LINEAR)]
    else:
        specs = [
            (p + "q_a_proj.weight", (q_rank, h), LINEAR),
            (p + "q_a_layernorm.weight", (q_rank,), NORM),
            (p + "q_b_proj.weight", (heads * qk_head, q_rank), LINEAR),
        ]
    return specs + [
        (p + "kv_a_proj_with_mqa.weight", (kv_rank + config["qk_rope_head_dim"], h), LINEAR),
        (p + "kv_a_layernorm.weight", (kv_rank,), NORM),
        (
            p + "kv_b_proj.weight",
            (heads * (config["qk_nope_head_dim"] + config["v_head_dim"]), kv_rank),
            LINEAR,
        ),
        (p + "o_proj.weight", (h, heads * config["v_head_dim"]), LINEAR),
    ]


def _mlp_specs(p, h, inter):
    return [
        (p + "gate_proj.weight", (inter, h), LINEAR),
        (p + "up_proj.weight", (inter, h), LINEAR),
        (p + "down_proj.weight", (h, inter), LINEAR),
    ]


def _moe_specs(config, p, h):
    experts = config["n_routed_experts"]
    specs = [(p + "gate.weight", (experts, h), ROUTER)]
    if config["topk_method"] == "noaux_tc":
        specs.append((p + "gate.e_score_correction_bias", (experts,), BIAS))
    specs += _mlp_specs(
        p + "shared_experts.", h, config["moe_intermediate_size"] * config["n_shared_experts"]
    )
    for e in range(experts):
        specs += _mlp_specs(f"{p}experts.{e}.", h, config["moe_intermediate_size"])
    return specs


def _random_tensor(seed: int, name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """float32 values scaled so that activations stay O(1) through the network (checked by make_golden)."""
    name_key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    rng = np.random.default_rng([seed, name_key])
    normal = rng.standard_normal(shape)
    if kind == NORM:
        values = 1.0 + 0.2 * normal
    elif kind == EMBED:
        values = normal
    elif kind == BIAS:
        # Big enough to change which experts win for a good share of tokens (sigmoid scores spread ~0.2).
        values = 0.1 * normal
    elif kind == LINEAR:
        # Per-128x128-block gains make the FP8 block scales differ, so a wrong block-to-scale mapping shows.
        block_gain = np.exp(rng.uniform(-0.7, 0.7, _block_grid(shape)))
        values = normal / np.sqrt(shape[1]) * _expand_blocks(block_gain, shape)
    else:  # ROUTER, MATRIX
        values = normal / np.sqrt(shape[1])
    return values.astype(np.float32)


def _encode(name: str, value: np.ndarray, kind: str, weight_format: str) -> dict[str, np.ndarray]:
    if kind == BIAS or weight_format == "f32":
        return {name: value}
    if weight_format == "fp8" and kind == LINEAR:
        weight, scale_inv = quantize_fp8(value)
        return {name: weight, name + "_scale_inv": scale_inv}
    return {name: value.astype(ml_dtypes.bfloat16)}


def _shard_plan(config: dict, tensors: dict) -> list[list[str]]:
    """First half of the layers (+ embeddings) | second half (+ norm, lm_head) | MTP layer if any.

    The scale of the last o_proj of the first half moves to the second shard, as happens in real
    checkpoints where a weight and its scale straddle a shard boundary.
    """
    layers = config["num_hidden_layers"]
    half = layers // 2

    def shard_of(name: str) -> int:
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            return 2 if layer >= layers else int(layer >= half)
        return 0 if name == "model.embed_tokens.weight" else 1

    straddling = f"model.layers.{half - 1}.self_attn.o_proj.weight_scale_inv"
    shards = [[], [], []]
    for name in sorted(tensors):
        shards[1 if name == straddling else shard_of(name)].append(name)
    return [s for s in shards if s]


def _block_grid(shape: tuple[int, int], block: tuple[int, int] = FP8_BLOCK) -> tuple[int, int]:
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def _expand_blocks(per_block: np.ndarray, shape: tuple[int, int], block: tuple[int, int] = FP8_BLOCK) -> np.ndarray:
    rows = np.repeat(per_block, block[0], axis=0)[: shape[0]]
    return np.repeat(rows, block[1], axis=1)[:, : shape[1]]


def quantize_fp8(weight: np.ndarray, block: tuple[int, int] = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """float32 [out, in] -> (float8_e4m3fn [out, in], float32 scale_inv [ceil(out/128), ceil(in/128)]).

    One scale per block, amax / 448, so each block uses the full FP8 range; the stored value times the
    block's scale_inv is the weight. `block` is the config's weight_block_size ([128, 128] in every
    released checkpoint).
    """
    grid = _block_grid(weight.shape, block)
    quantized = np.empty(weight.shape, ml_dtypes.float8_e4m3fn)
    scale_inv = np.empty(grid, np.float32)
    for bi, bj, rows, cols in _blocks(weight.shape, block):
        tile = weight[rows, cols]
        amax = float(np.abs(tile).max())
        scale_inv[bi, bj] = amax / FP8_MAX if amax > 0 else 1.0
        scaled = np.clip(tile / scale_inv[bi, bj], -FP8_MAX, FP8_MAX)
        quantized[rows, cols] = scaled.astype(ml_dtypes.float8_e4m3fn)
    return quantized, scale_inv


def dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = FP8_BLOCK) -> np.ndarray:
    """Inverse of quantize_fp8, block by block (edge blocks are partial)."""
    if scale_inv.shape != _block_grid(weight.shape, block):
        raise ValueError(f"scale_inv {scale_inv.shape} does not fit weight {weight.shape} in {block} blocks")
    out = np.empty(weight.shape, np.float32)
    for bi, bj, rows, cols in _blocks(weight.shape, block):
        out[rows, cols] = weight[rows, cols].astype(np.float32) * scale_inv[bi, bj]
    return out


def _blocks(shape: tuple[int, int], block: tuple[int, int] = FP8_BLOCK):
    grid = _block_grid(shape, block)
    for bi in range(grid[0]):
        for bj in range(grid[1]):
            rows = slice(bi * block[0], min((bi + 1) * block[0], shape[0]))
            cols = slice(bj * block[1], min((bj + 1) * block[1], shape[1]))
            yield bi, bj, rows, cols


_SAFETENSORS_DTYPES = {
    "F32": np.dtype(np.float32),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "U8": np.dtype(np.uint8),  # MXFP4 blocks and scales (gpt-oss)
}


def read_tensors(dirpath) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory (all *.safetensors files), in its stored dtype.

    Parses the files directly: safetensors' numpy reader does not know float8 (safetensors 0.8).
    """
    tensors = {}
    for file in sorted(Path(dirpath).glob("*.safetensors")):
        data = file.read_bytes()
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_len])
        header.pop("__metadata__", None)
        for name, info in header.items():
            start, end = (8 + header_len + offset for offset in info["data_offsets"])
            dtype = _SAFETENSORS_DTYPES[info["dtype"]]
            tensors[name] = np.frombuffer(data, dtype, (end - start) // dtype.itemsize, start).reshape(
                info["shape"]
            )
    return tensors


def as_float32(tensors: dict[str, np.ndarray], fp8_block: tuple[int, int] = FP8_BLOCK) -> dict[str, np.ndarray]:
    """Checkpoint tensors as float32, FP8 weights dequantized and their scales dropped.

    MXFP4 pairs `<name>_blocks` / `<name>_scales` (uint8) become one float32 `<name>` in the stored
    orientation, [experts, out_features, in_features] (see dequantize_mxfp4). `fp8_block` is the
    checkpoint's weight_block_size (checkpoint_as_float32 reads it from config.json).
    """
    out = {}
    for name, value in tensors.items():
        if name.endswith("_scale_inv") or (name.endswith("_scales") and value.dtype == np.uint8):
            continue
        if value.dtype == ml_dtypes.float8_e4m3fn:
            out[name] = dequantize_fp8(value, tensors[name + "_scale_inv"], fp8_block)
        elif name.endswith("_blocks") and value.dtype == np.uint8:
            base = name.removesuffix("_blocks")
            out[base] = dequantize_mxfp4(value, tensors[base + "_scales"])
        else:
            out[name] = value.astype(np.float32)
    return out


def checkpoint_as_float32(dirpath) -> dict[str, np.ndarray]:
    """as_float32 of a checkpoint directory, with the FP8 block size its config.json declares."""
    config = json.loads((Path(dirpath) / "config.json").read_text())
    block = tuple(config.get("quantization_config", {}).get("weight_block_size", FP8_BLOCK))
    return as_float32(read_tensors(dirpath), block)


def dequantized_copy(src_dir, dst_dir) -> Path:
    """A float32 single-file copy that transformers loads on CPU (config without quantization_config)."""
    dst_dir = Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(src_dir) / "config.json").read_text())
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    save_file(
        as_float32(read_tensors(src_dir)), str(dst_dir / "model.safetensors"), metadata={"format": "pt"}
    )
    (dst_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst_dir


def tensor_digest(dirpath) -> str:
    """sha256 over config.json, the shard index and every tensor (sorted names, dtype, shape, raw bytes)."""
    dirpath = Path(dirpath)
    digest = hashlib.sha256()
    for meta in ("config.json", "model.safetensors.index.json"):
        if (dirpath / meta).exists():
            canonical = json.dumps(json.loads((dirpath / meta).read_text()), sort_keys=True)
            digest.update(canonical.encode())
    tensors = read_tensors(dirpath)
    for name in sorted(tensors):
        value = np.ascontiguousarray(tensors[name])
        digest.update(f"{name}|{value.dtype.name}|{value.shape}".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


# ==================================================================== other MoE families (issue #21)
#
# Tiny seeded checkpoints of Qwen3-MoE, Mixtral, GLM-4.5, MiniMax-M2 and gpt-oss in the layout of their
# released Hugging Face files (tensor names, per-expert vs fused tensors, dtypes, config.json keys), made
# the same way as the DeepSeek ones above: every tensor from its own generator seeded by
# (seed, sha256(name)), so tensor_digest proves a rebuild is byte-identical. tests/golden/README.md
# documents each family's layout and the computation the goldens (tests/golden/<case>.npz) come from.
#
# Config values are tiny, but the keys are those of the released config.json (Qwen3-30B-A3B,
# Mixtral-8x7B-v0.1, GLM-4.5, MiniMax-M2, gpt-oss-20b); where a released value would leave a feature
# untested at this size the value differs, and the comment says so.

FAMILY_PRESETS = {
    # Qwen3-30B-A3B: softmax router, norm_topk_prob, per-head q/k RMSNorm, head_dim larger than
    # hidden_size / num_attention_heads. The released configs list no mlp_only_layers; here layer 1 is
    # dense so that the "which layers are MoE" rule (mlp_only_layers, decoder_sparse_step) is exercised.
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "decoder_sparse_step": 1,
        "eos_token_id": 1,
        "head_dim": 40,
        "hidden_act": "silu",
        "hidden_size": 96,
        "initializer_range": 0.02,
        "intermediate_size": 192,
        "max_position_embeddings": 4096,
        "max_window_layers": 3,
        "mlp_only_layers": [1],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 48,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 384,
    },
    # Mixtral-8x7B-v0.1: every layer MoE (block_sparse_moe), top-2 of 8, softmax renormalised over the two.
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 80,
        "initializer_range": 0.02,
        "intermediate_size": 112,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "num_local_experts": 8,
        "output_router_logits": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 384,
    },
    # GLM-4.5 (use_qk_norm true; GLM-4.5-Air has it false): partial rotary (half of head_dim), q/k/v bias
    # (o_proj none), sigmoid router with e_score_correction_bias, a shared expert, first_k_dense_replace
    # dense layers and one MTP layer in the files. The released configs have n_group = topk_group = 1;
    # here 4 groups of which 2 are kept, so that the group-limited selection is exercised.
    "glm4_moe": {
        "architectures": ["Glm4MoeForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": [1, 2],
        "first_k_dense_replace": 1,
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": 96,
        "initializer_range": 0.02,
        "intermediate_size": 160,
        "max_position_embeddings": 131072,
        "model_type": "glm4_moe",
        "moe_intermediate_size": 40,
        "n_group": 4,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "num_nextn_predict_layers": 1,
        "pad_token_id": 1,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "routed_scaling_factor": 2.5,
        "tie_word_embeddings": False,
        "topk_group": 2,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_qk_norm": True,
        "vocab_size": 384,
    },
    # MiniMax-M2: FP8 e4m3 block-quantized attention and experts, float32 router and correction bias,
    # RMSNorm over all heads' q (and all k) at once, partial rotary given as rotary_dim, sigmoid router
    # with correction bias and no shared expert. The config declares 3 MTP modules, but the released files
    # hold no MTP tensors (their weight_map has layers 0-61 only), so neither does this checkpoint.
    # hidden 72 and moe intermediate 40 with 32x32 blocks (weight_block_size; 128x128 in the release) give
    # partial edge blocks in both directions.
    "minimax_m2": {
        "architectures": ["MiniMaxM2ForCausalLM"],
        "attention_dropout": 0.0,
        "attn_type_list": [1, 1, 1],
        "bos_token_id": 0,
        "eos_token_id": 1,
        "head_dim": 24,
        "hidden_act": "silu",
        "hidden_size": 72,
        "initializer_range": 0.02,
        "intermediate_size": 40,
        "max_position_embeddings": 196608,
        "model_type": "minimax_m2",
        "mtp_transformer_layers": 1,
        "num_attention_heads": 4,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "num_local_experts": 16,
        "num_mtp_modules": 3,
        "output_router_logits": False,
        "qk_norm_type": "per_layer",
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "float8_e4m3fn",
            "quant_method": "fp8",
            "weight_block_size": [32, 32],
            "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"],
        },
        "rms_norm_eps": 1e-6,
        "rope_theta": 5000000,
        "rotary_dim": 12,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "scoring_func": "sigmoid",
        "shared_intermediate_size": 0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_mtp": True,
        "use_qk_norm": True,
        "use_routing_bias": True,
        "vocab_size": 384,
    },
    # gpt-oss-20b: MXFP4 experts (everything else bf16), attention sinks, q/k/v/o biases, alternating
    # sliding/full attention, YaRN, expert biases, clamped SwiGLU, softmax over the top-k router logits.
    # The window (4) is shorter than the test prompts; original_max_position_embeddings (= the released
    # initial_context_length) is 512 instead of 4096 so that YaRN's interpolation reaches frequencies that
    # turn noticeably within the test's ~20 positions; swiglu_limit is 2 instead of 7 so that the clamp
    # acts on the O(1) activations of a random model. intermediate_size = hidden_size as in the release.
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 1,
        "experts_per_token": 4,
        "head_dim": 24,
        "hidden_act": "silu",
        "hidden_size": 96,
        "initial_context_length": 512,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "max_position_embeddings": 16384,
        "model_type": "gpt_oss",
        "num_attention_heads": 6,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "num_local_experts": 16,
        "output_router_logits": False,
        "pad_token_id": 2,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-5,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 512,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 4,
        "swiglu_limit": 2.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 384,
    },
}

# The new families' golden cases (tests/golden/<case>.npz, made by make_golden.py). Separate from
# GOLDEN_CASES, whose cases test_vs_transformers.py runs through the DeepSeek engine.
FAMILY_CASES = {
    "qwen3_moe_bf16": {"preset": "qwen3_moe", "seed": 21, "weight_format": "bf16", "with_mtp_layer": False},
    "mixtral_bf16": {"preset": "mixtral", "seed": 22, "weight_format": "bf16", "with_mtp_layer": False},
    "glm4_moe_bf16": {"preset": "glm4_moe", "seed": 23, "weight_format": "bf16", "with_mtp_layer": True},
    "minimax_m2_fp8": {"preset": "minimax_m2", "seed": 24, "weight_format": "fp8", "with_mtp_layer": False},
    "gpt_oss_mxfp4": {"preset": "gpt_oss", "seed": 25, "weight_format": "mxfp4", "with_mtp_layer": False},
}

# Extra kinds of tensors for the families (LINEAR, EMBED, NORM, ROUTER, BIAS, MATRIX as above).
QK_NORM, ATTN_BIAS, OUT_BIAS, SINK, ROUTER_BIAS = "qk_norm", "attn_bias", "out_bias", "sink", "router_bias"
EXPERTS_GATE_UP, EXPERTS_DOWN = "experts_gate_up", "experts_down"  # gpt-oss fused expert matrices
ROUTER_GAIN = 2.0  # router logits ~N(0, 2^2): routing decisions stay clear of ties (prompts are checked)
GPT_OSS_GATE_UP_GAIN = 1.5  # gate/up pre-activations ~N(0, 1.5^2): swiglu_limit 2 clamps a good share

MXFP4_BLOCK = 32  # values per e8m0 scale
# e2m1 code -> value: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa (OCP MX spec, gpt-oss release).
FP4_E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)


def family_config(preset: str, **overrides) -> dict:
    config = json.loads(json.dumps(FAMILY_PRESETS[preset]))
    config.update(overrides)
    return config


def family_moe_layers(config: dict) -> list[int]:
    """Indices of the decoder layers with a routed MoE block, by each family's own rule."""
    layers = range(config["num_hidden_layers"])
    family = config["model_type"]
    if family == "qwen3_moe":
        return [
            i
            for i in layers
            if i not in (config.get("mlp_only_layers") or [])
            and config["num_experts"] > 0
            and (i + 1) % config["decoder_sparse_step"] == 0
        ]
    if family == "glm4_moe":
        return [i for i in layers if i >= config["first_k_dense_replace"]]
    return list(layers)  # mixtral, minimax_m2, gpt_oss: every layer


def family_num_experts(config: dict) -> int:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if key in config:
            return config[key]
    raise KeyError("no expert count in config")


def write_family_checkpoint(
    dirpath, config: dict, *, seed: int, weight_format: str, with_mtp_layer: bool = False
) -> Path:
    """config.json, sharded safetensors and the index of one of the FAMILY_PRESETS families.

    weight_format is the family's released one: "bf16" (Qwen3, Mixtral, GLM), "fp8" (MiniMax-M2: the
    attention and expert projections float8_e4m3fn + float32 weight_scale_inv per weight_block_size block,
    router and correction bias float32, the rest bf16) or "mxfp4" (gpt-oss: expert matrices as uint8
    `_blocks` [E, out, in/32, 16] + `_scales` [E, out, in/32], everything else bf16). with_mtp_layer adds
    tensors of the MTP layer (index num_hidden_layers), which GLM's files carry and engines must skip.
    """
    expected = {"qwen3_moe": "bf16", "mixtral": "bf16", "glm4_moe": "bf16", "minimax_m2": "fp8", "gpt_oss": "mxfp4"}
    if expected[config["model_type"]] != weight_format:
        raise ValueError(f"{config['model_type']} is released as {expected[config['model_type']]}, not {weight_format}")
    dirpath = Path(dirpath)
    dirpath.mkdir(parents=True, exist_ok=True)
    config = json.loads(json.dumps(config))
    if with_mtp_layer != (config.get("num_nextn_predict_layers", 0) > 0):
        raise ValueError("with_mtp_layer must agree with the config's num_nextn_predict_layers")
    block = tuple(config.get("quantization_config", {}).get("weight_block_size", FP8_BLOCK))

    tensors = {}
    for name, shape, kind, storage in family_tensor_specs(config, with_mtp_layer):
        value = _family_random_tensor(seed, name, shape, kind, block if storage == "fp8" else None)
        if storage == "fp8":
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(value, block)
        elif storage == "mxfp4":
            tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(value)
        elif storage == "f32":
            tensors[name] = value
        else:
            tensors[name] = value.astype(ml_dtypes.bfloat16)

    shards = _family_shard_plan(config, tensors)
    weight_map = {}
    for index, names in enumerate(shards):
        filename = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(dirpath / filename), metadata={"format": "pt"})
        weight_map.update({n: filename for n in names})
    index_json = {
        "metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (dirpath / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    (dirpath / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dirpath


def family_tensor_specs(config: dict, with_mtp_layer: bool = False) -> list[tuple[str, tuple[int, ...], str, str]]:
    """(name, shape, kind, storage) of every tensor, named as in the family's released files.

    storage: "bf16", "f32", "fp8" (+ `_scale_inv`) or "mxfp4" (stored as `_blocks` + `_scales`; the
    shape is that of the float32 matrix, [experts, out_features, in_features]).
    """
    family = config["model_type"]
    h, vocab = config["hidden_size"], config["vocab_size"]
    fp8 = family == "minimax_m2"
    linear = "fp8" if fp8 else "bf16"
    specs = [("model.embed_tokens.weight", (vocab, h), EMBED, "bf16")]
    moe = set(family_moe_layers(config))
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        specs += [
            (p + "input_layernorm.weight", (h,), NORM, "bf16"),
            (p + "post_attention_layernorm.weight", (h,), NORM, "bf16"),
        ]
        specs += _family_attention_specs(config, p + "self_attn.", linear)
        if layer not in moe:
            specs += [(n, s, k, linear) for n, s, k in _mlp_specs(p + "mlp.", h, config["intermediate_size"])]
        else:
            specs += _family_moe_specs(config, p, linear)
    specs += [("model.norm.weight", (h,), NORM, "bf16"), ("lm_head.weight", (vocab, h), MATRIX, "bf16")]
    if with_mtp_layer:  # GLM-4.5: a subset of the MTP layer's tensors, enough to prove they are skipped
        p = f"model.layers.{config['num_hidden_layers']}."
        heads_dim = config["num_attention_heads"] * config["head_dim"]
        specs += [
            (p + "enorm.weight", (h,), NORM, "bf16"),
            (p + "hnorm.weight", (h,), NORM, "bf16"),
            (p + "eh_proj.weight", (h, 2 * h), MATRIX, "bf16"),
            (p + "input_layernorm.weight", (h,), NORM, "bf16"),
            (p + "self_attn.q_proj.weight", (heads_dim, h), LINEAR, "bf16"),
            (p + "self_attn.q_proj.bias", (heads_dim,), ATTN_BIAS, "bf16"),
            (p + "mlp.gate.weight", (family_num_experts(config), h), ROUTER, "bf16"),
            (p + "mlp.gate.e_score_correction_bias", (family_num_experts(config),), BIAS, "f32"),
            (p + "mlp.experts.0.gate_proj.weight", (config["moe_intermediate_size"], h), LINEAR, "bf16"),
            (p + "mlp.shared_experts.gate_proj.weight", (config["moe_intermediate_size"], h), LINEAR, "bf16"),
            (p + "shared_head.norm.weight", (h,), NORM, "bf16"),
            (p + "shared_head.head.weight", (vocab, h), MATRIX, "bf16"),
        ]
    return specs


def _family_attention_specs(config: dict, p: str, linear: str):
    family = config["model_type"]
    h = config["hidden_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    specs = [
        (p + "q_proj.weight", (q_dim, h), LINEAR, linear),
        (p + "k_proj.weight", (kv_dim, h), LINEAR, linear),
        (p + "v_proj.weight", (kv_dim, h), LINEAR, linear),
        (p + "o_proj.weight", (h, q_dim), LINEAR, linear),
    ]
    if config.get("attention_bias"):  # GLM: q/k/v only; gpt-oss: o_proj too
        specs += [
            (p + "q_proj.bias", (q_dim,), ATTN_BIAS, "bf16"),
            (p + "k_proj.bias", (kv_dim,), ATTN_BIAS, "bf16"),
            (p + "v_proj.bias", (kv_dim,), ATTN_BIAS, "bf16"),
        ]
        if family == "gpt_oss":
            specs.append((p + "o_proj.bias", (h,), OUT_BIAS, "bf16"))
    if family == "qwen3_moe" or (family == "glm4_moe" and config["use_qk_norm"]):  # per head
        specs += [
            (p + "q_norm.weight", (head_dim,), QK_NORM, "bf16"),
            (p + "k_norm.weight", (head_dim,), QK_NORM, "bf16"),
        ]
    if family == "minimax_m2":  # over all heads of the layer
        specs += [(p + "q_norm.weight", (q_dim,), QK_NORM, "bf16"), (p + "k_norm.weight", (kv_dim,), QK_NORM, "bf16")]
    if family == "gpt_oss":
        specs.append((p + "sinks", (config["num_attention_heads"],), SINK, "bf16"))
    return specs


def _family_moe_specs(config: dict, p: str, linear: str):
    family = config["model_type"]
    h = config["hidden_size"]
    experts = family_num_experts(config)
    if family in ("qwen3_moe", "glm4_moe"):
        inter = config["moe_intermediate_size"]
        specs = [(p + "mlp.gate.weight", (experts, h), ROUTER, "bf16")]
        if family == "glm4_moe":
            specs.append((p + "mlp.gate.e_score_correction_bias", (experts,), BIAS, "f32"))
            shared = _mlp_specs(p + "mlp.shared_experts.", h, inter * config["n_shared_experts"])
            specs += [(n, s, k, linear) for n, s, k in shared]
        for e in range(experts):
            specs += [(n, s, k, linear) for n, s, k in _mlp_specs(f"{p}mlp.experts.{e}.", h, inter)]
        return specs
    if family in ("mixtral", "minimax_m2"):
        inter = config["intermediate_size"]
        q = p + "block_sparse_moe."
        router_storage = "f32" if family == "minimax_m2" else "bf16"
        specs = [(q + "gate.weight", (experts, h), ROUTER, router_storage)]
        if family == "minimax_m2":
            specs.append((q + "e_score_correction_bias", (experts,), BIAS, "f32"))
        for e in range(experts):
            specs += [
                (f"{q}experts.{e}.w1.weight", (inter, h), LINEAR, linear),  # gate
                (f"{q}experts.{e}.w2.weight", (h, inter), LINEAR, linear),  # down
                (f"{q}experts.{e}.w3.weight", (inter, h), LINEAR, linear),  # up
            ]
        return specs
    if family == "gpt_oss":
        inter = config["intermediate_size"]
        q = p + "mlp."
        return [
            (q + "router.weight", (experts, h), ROUTER, "bf16"),
            (q + "router.bias", (experts,), ROUTER_BIAS, "bf16"),
            # rows interleaved: 2j is gate j, 2j+1 is up j
            (q + "experts.gate_up_proj", (experts, 2 * inter, h), EXPERTS_GATE_UP, "mxfp4"),
            (q + "experts.gate_up_proj_bias", (experts, 2 * inter), OUT_BIAS, "bf16"),
            (q + "experts.down_proj", (experts, h, inter), EXPERTS_DOWN, "mxfp4"),
            (q + "experts.down_proj_bias", (experts, h), OUT_BIAS, "bf16"),
        ]
    raise ValueError(f"unknown family {family}")


def _family_random_tensor(seed: int, name: str, shape: tuple[int, ...], kind: str, fp8_block) -> np.ndarray:
    """float32 values, scaled so that activations stay O(1) and every family feature matters."""
    name_key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    rng = np.random.default_rng([seed, name_key])
    normal = rng.standard_normal(shape)
    if kind == EMBED:
        values = normal
    elif kind == NORM:
        values = 1.0 + 0.2 * normal
    elif kind == QK_NORM:
        values = 1.0 + 0.3 * normal
    elif kind == BIAS:  # e_score_correction_bias, in sigmoid-score units
        values = 0.1 * normal
    elif kind == ATTN_BIAS:
        values = 0.5 * normal
    elif kind == OUT_BIAS:
        values = 0.2 * normal
    elif kind == ROUTER_BIAS:
        values = 0.5 * normal
    elif kind == SINK:  # released sinks are logits around +0.5..+2.5
        values = 1.0 + normal
    elif kind == ROUTER:
        values = ROUTER_GAIN * normal / np.sqrt(shape[1])
    elif kind in (EXPERTS_GATE_UP, EXPERTS_DOWN):
        # Per-32-value gains make the e8m0 scales of neighbouring blocks differ.
        gain = GPT_OSS_GATE_UP_GAIN if kind == EXPERTS_GATE_UP else 1.0
        block_gain = np.exp(rng.uniform(-1.0, 1.0, (*shape[:-1], shape[-1] // MXFP4_BLOCK)))
        values = gain * normal / np.sqrt(shape[-1]) * np.repeat(block_gain, MXFP4_BLOCK, axis=-1)
    elif kind == LINEAR and fp8_block is not None:
        block_gain = np.exp(rng.uniform(-0.7, 0.7, _block_grid(shape, fp8_block)))
        values = normal / np.sqrt(shape[1]) * _expand_blocks(block_gain, shape, fp8_block)
    else:  # LINEAR (bf16), MATRIX
        values = normal / np.sqrt(shape[1])
    return values.astype(np.float32)


def _family_shard_plan(config: dict, tensors: dict) -> list[list[str]]:
    """Embeddings + first half of the layers | the rest + norm + lm_head | MTP layer if any. One FP8
    weight_scale_inv (MiniMax) or MXFP4 _scales tensor (gpt-oss) lands in a different shard from its weight.
    """
    layers = config["num_hidden_layers"]
    half = layers // 2

    def shard_of(name: str) -> int:
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            return 2 if layer >= layers else int(layer >= half)
        return 0 if name == "model.embed_tokens.weight" else 1

    straddling = {
        f"model.layers.{half - 1}.self_attn.o_proj.weight_scale_inv",
        f"model.layers.{half - 1}.mlp.experts.down_proj_scales",
    }
    shards = [[], [], []]
    for name in sorted(tensors):
        shards[1 if name in straddling else shard_of(name)].append(name)
    return [s for s in shards if s]


def quantize_mxfp4(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [..., rows, cols] (cols % 32 == 0) -> (blocks uint8 [..., rows, cols/32, 16], scales uint8
    [..., rows, cols/32]) as in gpt-oss's files.

    Each group of 32 consecutive values along the last axis shares one e8m0 scale 2^(s - 127), the
    smallest power of two that brings the group's largest magnitude within e2m1's 6. Each value is the
    nearest e2m1 number (ties to the smaller magnitude); byte j of a group holds value 2j in its low nibble
    and value 2j+1 in its high nibble.
    """
    *prefix, cols = weight.shape
    if cols % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs the last dimension to be a multiple of {MXFP4_BLOCK}, not {cols}")
    groups = weight.astype(np.float64).reshape(*prefix, cols // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = np.abs(groups).max(-1)
    exponent = np.ceil(np.log2(np.maximum(amax, 2.0**-120) / 6.0))
    exponent += amax / np.exp2(exponent) > 6.0  # guard against log2 rounding
    exponent = np.clip(exponent, -127, 127)
    scaled = groups / np.exp2(exponent)[..., None]
    magnitudes = FP4_E2M1_VALUES[:8].astype(np.float64)
    code = np.abs(np.abs(scaled)[..., None] - magnitudes).argmin(-1).astype(np.uint8)
    code |= (scaled < 0).astype(np.uint8) << 3
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exponent + 127).astype(np.uint8)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """uint8 blocks [..., G, 16] + uint8 e8m0 scales [..., G] -> float32 [..., G * 32], from the format's
    definition: low nibble first, e2m1 value table with sign bit 3, scale 2^(s - 127)."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} {blocks.dtype} do not fit scales {scales.shape} {scales.dtype}")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*scales.shape, 2 * blocks.shape[-1])
    values = FP4_E2M1_VALUES[codes] * np.exp2(scales.astype(np.float32) - 127.0)[..., None]
    return values.reshape(*scales.shape[:-1], -1).astype(np.float32)


def float32_digest(tensors: dict[str, np.ndarray]) -> str:
    """sha256 over float32 tensors (sorted names, shape, bytes): what a checkpoint decodes to."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        value = np.ascontiguousarray(tensors[name], np.float32)
        digest.update(f"{name}|{value.shape}".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()
