"""Random GGUF files of real model geometries, for benchmarks: a config's model as llama.cpp's converter and
quantizer lay it out, with random weights made at copy speed, read back by the same loader as a real file.

The layout is a recent conversion's (convert_hf_to_gguf.py --outtype bf16, then llama-quantize on the experts):
- tensor names from hybridjit.gguf_arch (the loader's map of llama.cpp's names), the routed experts of a layer one
  stacked tensor per projection in a GGUF block format (gate and up one type, down maybe another: Q4_K_M keeps
  down in Q6_K);
- every other matrix BF16; norms, biases and the router F32, as the converter keeps them;
- DeepSeek's kv_b split into k_b (transposed per head) and v_b, with MLA's one latent KV head in the metadata, as
  conversions since llama.cpp's MLA support write it;
- the metadata keys of the architecture (gguf_arch's readers take them back to the config), written by the gguf
  package's named setters, as the converter writes them; no MTP layers (a truncated geometry has none);
- Mixtral's Q/K rows as made: a conversion permutes them for llama.cpp's RoPE (and the loader permutes them back),
  which leaves random rows as random.

Values: every tensor but the routed experts is SyntheticCheckpoint's (the random values of the other formats).
Expert blocks repeat a pool of random blocks from a random offset per tensor: random bytes made valid blocks of
the spread of real weights (rms 1/sqrt(fan_in), mean ~0), since bytes alone would put any fp16 in d, NaN and
infinity included, and a random model's experts ought to look like a trained one's to the kernels (as its FP8
weights do: hybridjit.synthetic). At DeepSeek-V3's hidden size that makes the Q4_K and Q6_K d of gate and up fp16
subnormals (~5e-5 and ~7e-6; llama.cpp's quantiser gives such weights d of that order too), which the kernels
convert exactly like any other fp16.
"""

import math
import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from hybridjit.checkpoint import DTYPES
from hybridjit.gguf_arch import gguf_name
from hybridjit.models.registry import ModelConfig, family_of
from hybridjit.ops.gguf_experts import GGUF_EXPERT_FORMATS, row_bytes
from hybridjit.synthetic import SyntheticCheckpoint

Q = gguf.GGMLQuantizationType
# Hugging Face model_type -> llama.cpp's architecture (the inverse of gguf_arch.ARCHITECTURES).
ARCHITECTURES = {"deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2", "kimi_k2": "deepseek2",
                 "qwen3_moe": "qwen3moe", "mixtral": "llama", "glm4_moe": "glm4moe",
                 "minimax_m2": "minimax-m2"}  # fmt: skip

_POOL_BYTES = 1 << 26  # random blocks per (type, fan-in): a 64 MiB pool, made in well under a second
_RMS_SAMPLE = 4096  # blocks dequantised to measure a pool's rms
# Byte offsets of a block's fp16 d and, in the K-quants with mins, dmin (ggml-common.h's block_q8_0, block_q*_K).
_SCALE_AT = {"Q8_0": (0, None), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, None), "Q2_K": (80, 82),
             "Q3_K": (108, None), "IQ4_XS": (0, None)}  # fmt: skip
# The mean code of Q4_K (0..15), Q5_K (0..31) and Q2_K (0..3): dmin = that * d centres each sub-block's values on 0
# where its scale and min are drawn alike, as a trained matrix's are. (Q3_K's signed scales and q - 4 need none.)
_MEAN_CODE = {"Q4_K": 7.5, "Q5_K": 15.5, "Q2_K": 1.5}


def block_pool(gguf_type: str, fan_in: int, rng: np.random.Generator, n_bytes: int = _POOL_BYTES) -> np.ndarray:
    """Random valid `gguf_type` blocks [n, block bytes] whose values have rms 1/sqrt(fan_in) and mean ~0: random
    codes, the sub-block scales of K-quants in the upper half of their range (llama.cpp's quantiser maps a block's
    largest to the top and most lie near it), d (and dmin) set to give that rms."""
    if gguf_type not in GGUF_EXPERT_FORMATS:
        raise ValueError(f"gguf_type {gguf_type!r} is not a GGUF expert format ({', '.join(GGUF_EXPERT_FORMATS)})")
    size = gguf.GGML_QUANT_SIZES[Q[gguf_type]][1]
    blocks = np.frombuffer(rng.bytes(n_bytes // size * size), np.uint8).reshape(-1, size).copy()
    if gguf_type == "Q2_K":  # each sub-block's 4-bit scale in 8..15 and its min the same (dmin centres it)
        scales = blocks[:, :16] & 0x0F | 0x08
        blocks[:, :16] = scales | (scales << 4)
    elif gguf_type in _MEAN_CODE:
        # The 12 bytes after d and dmin pack 6-bit scales and mins of 8 sub-blocks (ggml's get_scale_min_k4): their
        # first 8 hold bits 0-5 of the first four of each and, in bits 6-7, bits 4-5 of the last four, so 0xA0 sets
        # bit 5 of all sixteen: each in 32..63.
        blocks[:, 4:12] |= 0xA0
    elif gguf_type == "Q6_K":
        blocks[:, 192:208] = blocks[:, 192:208] & 0x3F | 0x40  # the int8 scales of 16 sub-blocks, in 64..127
    elif gguf_type == "Q8_0":  # llama.cpp's quantiser rounds to -127..127
        codes = blocks[:, 2:].view(np.int8)
        codes[codes == -128] = -127
    # Q3_K and IQ4_XS: random 6-bit scales (-32..31) and codes as they come
    unit = rng.uniform(0.75, 1.25, len(blocks))  # d varies from block to block, as the weights' range does
    _set_scales(blocks, gguf_type, unit)
    rms = float(np.sqrt(np.mean(gguf.quants.dequantize(blocks[:_RMS_SAMPLE], Q[gguf_type]) ** 2)))
    _set_scales(blocks, gguf_type, unit / (rms * np.sqrt(fan_in)))
    return blocks


def _set_scales(blocks: np.ndarray, gguf_type: str, d: np.ndarray) -> None:
    at, min_at = _SCALE_AT[gguf_type]
    blocks[:, at : at + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    if min_at is not None:
        blocks[:, min_at : min_at + 2] = (d * _MEAN_CODE[gguf_type]).astype(np.float16).view(np.uint8).reshape(-1, 2)


# --- metadata: the inverse of gguf_arch's readers --------------------------------------------------------------


def _metadata(w: gguf.GGUFWriter, cfg: ModelConfig, arch: str) -> None:
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    if arch in ("deepseek2", "glm4moe", "minimax-m2"):
        sigmoid = cfg.scoring_func == "sigmoid"
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    if arch in ("deepseek2", "glm4moe"):
        w.add_leading_dense_block_count(cfg.first_k_dense_replace)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_expert_weights_scale(cfg.routed_scaling_factor)
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    w.add_rope_dimension_count(cfg.rope.dim)
    if arch == "deepseek2":
        # MLA as llama.cpp runs it from k_b and v_b: multi-query attention over the latent cache (key and value
        # lengths those of its entries), the model's own sizes under *_mla.
        w.add_head_count_kv(1)
        if cfg.q_lora_rank is not None:
            w.add_q_lora_rank(cfg.q_lora_rank)
        w.add_kv_lora_rank(cfg.kv_lora_rank)
        w.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(cfg.qk_head_dim)
        w.add_value_length_mla(cfg.v_head_dim)
    else:
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if cfg.rope.yarn_factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(cfg.rope.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(cfg.rope.original_max_position)
        w.add_rope_scaling_yarn_beta_fast(cfg.rope.beta_fast)
        w.add_rope_scaling_yarn_beta_slow(cfg.rope.beta_slow)
        if arch == "deepseek2":  # llama.cpp keeps one mscale, mscale_all_dim (gguf_arch)
            w.add_rope_scaling_yarn_log_mul(0.1 * (cfg.rope.mscale_all_dim or 0.0))
    if cfg.bos_token_id is not None:
        w.add_bos_token_id(cfg.bos_token_id)
    if cfg.eos_token_ids:  # GGUF holds an end of sequence and an end of turn
        w.add_eos_token_id(cfg.eos_token_ids[0])
        if len(cfg.eos_token_ids) > 1:
            w.add_eot_token_id(cfg.eos_token_ids[1])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


# --- tensors --------------------------------------------------------------------------------------------------


class _Tensor:
    """One tensor of the file: its header's fields, and how to make its data (when it is written)."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype, qtype: Q, make: Callable[[], np.ndarray]):
        self.name, self.shape, self.dtype, self.qtype, self.make = name, shape, np.dtype(dtype), qtype, make
        self.nbytes = math.prod(shape) * self.dtype.itemsize


def _float_tensors(synthetic: SyntheticCheckpoint, hf_name: str, name: str) -> list[_Tensor]:
    """A non-expert tensor: 1-D ones and the router in F32, other matrices as SyntheticCheckpoint makes them (BF16);
    DeepSeek's kv_b [heads * (nope + v), kv_lora] as k_b [heads, kv_lora, nope] and v_b [heads, v, kv_lora]."""
    shape = synthetic.info(hf_name).shape
    if len(shape) == 1 or name.endswith(".ffn_gate_inp.weight"):
        return [_Tensor(name, shape, np.float32, Q.F32, lambda: synthetic.get(hf_name).astype(np.float32))]
    bf16 = DTYPES["BF16"]
    if not name.endswith(".attn_kv_b.weight"):
        return [_Tensor(name, shape, bf16, Q.BF16, lambda: synthetic.get(hf_name))]
    cfg = synthetic.cfg
    heads, nope, v, rank = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank

    def per_head():
        return synthetic.get(hf_name).reshape(heads, nope + v, rank)

    k_b = _Tensor(name.replace("attn_kv_b", "attn_k_b"), (heads, rank, nope), bf16, Q.BF16,
                  lambda: np.ascontiguousarray(per_head()[:, :nope].transpose(0, 2, 1)))  # fmt: skip
    v_b = _Tensor(name.replace("attn_kv_b", "attn_v_b"), (heads, v, rank), bf16, Q.BF16,
                  lambda: np.ascontiguousarray(per_head()[:, nope:]))  # fmt: skip
    return [k_b, v_b]


def _expert_tensor(name: str, shape: tuple[int, int, int], gguf_type: str, pools: dict, seed: int) -> _Tensor:
    """A stacked routed-expert tensor [experts, rows, row bytes] of `gguf_type` blocks: the pool of its type and
    fan-in repeated from a random block (so that layers and projections differ)."""
    n_experts, rows, cols = shape
    size = gguf.GGML_QUANT_SIZES[Q[gguf_type]][1]
    per_row = row_bytes(gguf_type, cols)
    start = int(np.random.default_rng([seed, *name.encode()]).integers(_POOL_BYTES // size))

    def make():
        if (gguf_type, cols) not in pools:  # no larger than the tensor: a tiny model's file is written at once
            rng = np.random.default_rng([seed, cols, Q[gguf_type]])
            pools[gguf_type, cols] = block_pool(gguf_type, cols, rng, min(_POOL_BYTES, math.prod(shape[:2]) * per_row))
        pool = pools[gguf_type, cols]
        blocks = np.resize(np.roll(pool, -(start % len(pool)), axis=0), (n_experts * rows * per_row // size, size))
        return blocks.reshape(n_experts, rows, per_row)

    return _Tensor(name, (n_experts, rows, per_row), np.uint8, Q[gguf_type], make)


def _tensors(cfg: ModelConfig, arch: str, gate_up_type: str, down_type: str, seed: int) -> list[_Tensor]:
    """The file's tensors in the order of the family's checkpoint map, each layer's stacked experts where its first
    expert is."""
    synthetic = SyntheticCheckpoint(cfg, seed)
    pools: dict = {}  # (type, fan-in) -> block_pool, made when a tensor first needs it
    tensors, stacked = [], set()
    for hf_name, spec in family_of(cfg).ckpt.checkpoint_layout(cfg).items():
        name, expert = gguf_name(hf_name, arch)
        if expert is None:
            tensors += _float_tensors(synthetic, hf_name, name)
        elif name not in stacked:
            stacked.add(name)
            down = ".ffn_down_exps." in name
            gguf_type = down_type if down else gate_up_type
            try:
                tensors.append(_expert_tensor(name, (cfg.n_routed_experts, *spec.shape), gguf_type, pools, seed))
            except ValueError as e:
                raise ValueError(f"{'down_type' if down else 'gate_up_type'} {gguf_type} for {name}: {e}") from None
    return tensors


def write_synthetic_gguf(
    path: str | Path, cfg: ModelConfig, gate_up_type: str, down_type: str | None = None, seed: int = 0
) -> int:
    """Writes the model of `cfg` (unquantised: a geometry in bf16) as a GGUF file at `path` with random weights, its
    routed experts as `gate_up_type` blocks, their down projections as `down_type` (default the same), everything
    else as a conversion keeps it (see the module docstring); returns the file's bytes. Raises ValueError naming
    the argument for a config or type it cannot write, or a path whose filesystem has no room for the file (which
    is checked before writing: a 5-layer DeepSeek-V3 in Q4_K takes ~21 GB)."""
    arch = ARCHITECTURES.get(cfg.model_type)
    if arch is None:
        raise ValueError(
            f"cfg: model_type {cfg.model_type!r} has no llama.cpp architecture mapping; GGUF files are written for "
            f"{', '.join(ARCHITECTURES)}"
        )
    if cfg.fp8 is not None or cfg.int_quant is not None:
        raise ValueError("cfg: has a quantization_config; a GGUF's non-expert tensors are BF16: pass it unquantised")
    down_type = down_type or gate_up_type
    for argument, gguf_type in (("gate_up_type", gate_up_type), ("down_type", down_type)):
        if gguf_type not in GGUF_EXPERT_FORMATS:
            raise ValueError(f"{argument} {gguf_type!r} is not a GGUF expert format ({', '.join(GGUF_EXPERT_FORMATS)})")
    tensors = _tensors(cfg, arch, gate_up_type, down_type, seed)
    path = Path(path)
    needed, free = sum(t.nbytes for t in tensors), shutil.disk_usage(path.parent).free
    if needed > free:
        raise ValueError(f"path {path}: the file takes {needed / 1e9:.1f} GB, its filesystem has {free / 1e9:.1f} GB")
    writer = gguf.GGUFWriter(path, arch)
    _metadata(writer, cfg, arch)
    for t in tensors:
        writer.add_tensor_info(t.name, t.shape, t.dtype, t.nbytes, raw_dtype=t.qtype)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:  # one tensor's data at a time: the largest (a layer's stacked experts) is a few GB
            writer.write_tensor_data(t.make())
    except BaseException:
        writer.close()
        path.unlink(missing_ok=True)
        raise
    writer.close()
    return path.stat().st_size
