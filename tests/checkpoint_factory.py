"""Tiny random DeepSeek-V3-family checkpoints in the real Hugging Face layout, for tests.

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
    """Writes the checkpoint of GOLDEN_CASES[name] into dirpath."""
    case = GOLDEN_CASES[name]
    return write_checkpoint(
        dirpath,
        tiny_config(case["preset"]),
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


def _block_grid(shape: tuple[int, int]) -> tuple[int, int]:
    return (-(-shape[0] // FP8_BLOCK[0]), -(-shape[1] // FP8_BLOCK[1]))


def _expand_blocks(per_block: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    rows = np.repeat(per_block, FP8_BLOCK[0], axis=0)[: shape[0]]
    return np.repeat(rows, FP8_BLOCK[1], axis=1)[:, : shape[1]]


def quantize_fp8(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 [out, in] -> (float8_e4m3fn [out, in], float32 scale_inv [ceil(out/128), ceil(in/128)]).

    One scale per block, amax / 448, so each block uses the full FP8 range; the stored value times the
    block's scale_inv is the weight.
    """
    grid = _block_grid(weight.shape)
    quantized = np.empty(weight.shape, ml_dtypes.float8_e4m3fn)
    scale_inv = np.empty(grid, np.float32)
    for bi, bj, rows, cols in _blocks(weight.shape):
        block = weight[rows, cols]
        amax = float(np.abs(block).max())
        scale_inv[bi, bj] = amax / FP8_MAX if amax > 0 else 1.0
        scaled = np.clip(block / scale_inv[bi, bj], -FP8_MAX, FP8_MAX)
        quantized[rows, cols] = scaled.astype(ml_dtypes.float8_e4m3fn)
    return quantized, scale_inv


def dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """Inverse of quantize_fp8, block by block (edge blocks are partial)."""
    if scale_inv.shape != _block_grid(weight.shape):
        raise ValueError(
            f"scale_inv {scale_inv.shape} does not fit weight {weight.shape} in {FP8_BLOCK} blocks"
        )
    out = np.empty(weight.shape, np.float32)
    for bi, bj, rows, cols in _blocks(weight.shape):
        out[rows, cols] = weight[rows, cols].astype(np.float32) * scale_inv[bi, bj]
    return out


def _blocks(shape: tuple[int, int]):
    grid = _block_grid(shape)
    for bi in range(grid[0]):
        for bj in range(grid[1]):
            rows = slice(bi * FP8_BLOCK[0], min((bi + 1) * FP8_BLOCK[0], shape[0]))
            cols = slice(bj * FP8_BLOCK[1], min((bj + 1) * FP8_BLOCK[1], shape[1]))
            yield bi, bj, rows, cols


_SAFETENSORS_DTYPES = {
    "F32": np.dtype(np.float32),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
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


def as_float32(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Checkpoint tensors as float32, FP8 weights dequantized and their scales dropped."""
    out = {}
    for name, value in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if value.dtype == ml_dtypes.float8_e4m3fn:
            out[name] = dequantize_fp8(value, tensors[name + "_scale_inv"])
        else:
            out[name] = value.astype(np.float32)
    return out


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
