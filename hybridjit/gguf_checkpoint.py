"""A GGUF model file seen as a Hugging Face checkpoint: the tensors of the family's checkpoint map, by their
Hugging Face names, so that `check_checkpoint` and `WeightLoader` load it as they load safetensors.

Routed experts are views into the mapped file: expert e of a stacked `blk.L.ffn_*_exps.weight` is its e-th
slice, in the stored type (F32 and BF16 as numpy arrays, the block formats Q8_0, Q2_K-Q6_K as uint8
[rows, row bytes]); F16 experts are the one exception, converted once to BF16 (the CPU kernels have no F16
path and BF16 costs the same bytes: 3 mantissa bits fewer, well under the compute dtype's rounding).
Every other tensor is dequantised to float32 (gguf.quants.dequantize) when the loader takes it, with
llama.cpp's conversion undone where it changed the tensor: Llama-arch (Mixtral) Q/K rows are permuted
back for rotate-half RoPE, and DeepSeek's kv_b is rebuilt from k_b/v_b where the file splits it.

gpt-oss's experts are the exception to "views": the family's map names the released fused tensors (gate_up_proj
with gate and up rows interleaved, MXFP4 `_blocks` / `_scales` / `_bias`), which llama.cpp's converter split into
ffn_gate_exps and ffn_up_exps and wrote as ggml MXFP4 blocks (scale inside, other nibble order). Reading one
rebuilds it (ops.gguf_experts.mxfp4_from_ggml): a copy the size of the stored blocks, so that the release's own
kernels and loader run it, bit for bit the weights of the file.
"""

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np

from hybridjit.gguf_arch import gguf_name, hf_config
from hybridjit.gguf_file import GGUFError, GGUFFile, GGUFTensor
from hybridjit.models.common.checkpoint_map import TensorSpec
from hybridjit.models.registry import ModelConfig, config_from_hf, family_of
from hybridjit.ops.gguf_experts import GGUF_EXPERT_FORMATS, mxfp4_from_ggml

Q = gguf.GGMLQuantizationType
# Stored type of a routed expert -> the dtype the checkpoint presents (the block formats by their GGUF name).
_EXPERT_DTYPES = {Q.F32: "F32", Q.BF16: "BF16", Q.F16: "BF16", **{Q[name]: name for name in GGUF_EXPERT_FORMATS}}
_NUMPY = {Q.F32: np.dtype(np.float32), Q.F16: np.dtype(np.float16), Q.BF16: np.dtype(ml_dtypes.bfloat16)}
_BLOCK = re.compile(r"^blk\.(\d+)\.")
# gpt-oss's fused experts (models/common/checkpoint_map.FusedMxfp4Experts) by Hugging Face name.
_FUSED_MXFP4 = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)_(blocks|scales|bias)$")


def supported_expert_types() -> str:
    return ", ".join(t.name + (" (converted to BF16)" if t == Q.F16 else "") for t in _EXPERT_DTYPES)


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    """What the loader asks of a tensor (as checkpoint.TensorInfo), and how to read it."""

    name: str
    file: Path
    dtype: str  # the dtype `get` returns: F32/BF16/F16, or a block format for routed experts
    shape: tuple[int, ...]
    nbytes: int  # bytes stored in the file
    stored: str  # the GGUF type(s) stored
    read: Callable[[], np.ndarray]


def _float(t: GGUFTensor) -> np.ndarray:
    """A non-expert tensor as floats: F32/F16/BF16 in place, other types dequantised to float32."""
    if t.type in _NUMPY:
        return t.data.view(_NUMPY[t.type]).reshape(t.shape)
    try:
        return gguf.quants.dequantize(t.data.reshape(*t.shape[:-1], t.row_bytes), t.type)
    except NotImplementedError:
        raise GGUFError(f"{t.file}: tensor {t.name}: type {t.type.name} cannot be dequantised") from None


def _unpermute_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Llama-arch Q/K row permutation (which turns rotate-half pairs into adjacent ones)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    """The tensors of a GGUF model by Hugging Face name (as checkpoint.Checkpoint), with its config."""

    def __init__(self, path: str | Path):
        self.file = GGUFFile(path)
        self.directory = self.file.path  # what error messages name, as for a checkpoint directory
        self.config: ModelConfig = config_from_hf(hf_config(self.file), source=str(self.file.path))
        self.tensors: dict[str, GGUFTensorInfo] = {}
        used: set[str] = set()
        for name, spec in family_of(self.config).ckpt.checkpoint_layout(self.config).items():
            info = self._info(name, spec, used)
            if info is not None:
                self.tensors[name] = info
        for name, t in self.file.tensors.items():
            if name not in used and not self._ignored(name):
                self.tensors[name] = GGUFTensorInfo(name, t.file, "F32", t.shape, t.nbytes, t.type.name, lambda: None)

    def _ignored(self, name: str) -> bool:
        """GGUF tensors the model does not use: the MTP layers after the decoder's, and DeepSeek's k_b/v_b where
        the file also has the kv_b they are split from."""
        m = _BLOCK.match(name)
        if m and int(m[1]) >= self.config.num_hidden_layers:
            return True
        kv_b = re.sub(r"attn_[kv]_b\.weight$", "attn_kv_b.weight", name)
        return kv_b != name and kv_b in self.file.tensors

    def _info(self, name: str, spec: TensorSpec, used: set[str]) -> GGUFTensorInfo | None:
        if m := _FUSED_MXFP4.match(name):
            return self._fused_mxfp4(name, int(m[1]), m[2], m[3], used)
        source = gguf_name(name, self.file.architecture)
        if source is None:
            return None
        gname, expert = source
        if gname not in self.file.tensors:
            if gname.endswith(".attn_kv_b.weight"):
                return self._split_kv_b(name, gname, used)
            return None
        used.add(gname)
        t = self.file.tensors[gname]
        if expert is not None:
            return self._expert(name, t, expert)
        read = lambda: _float(t)  # noqa: E731
        if self.config.model_type == "mixtral" and gname.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = self.config.num_attention_heads if ".attn_q." in gname else self.config.num_key_value_heads
            read = lambda: _unpermute_rope(_float(t), heads)  # noqa: E731
        dtype = t.type.name if t.type in _NUMPY else "F32"
        return GGUFTensorInfo(name, t.file, dtype, t.shape, t.nbytes, t.type.name, read)

    def _split_kv_b(self, name: str, kv_b: str, used: set[str]) -> GGUFTensorInfo | None:
        """kv_b [heads * (nope + v), kv_lora] from llama.cpp's k_b [heads, kv_lora, nope] (transposed per head)
        and v_b [heads, v, kv_lora]."""
        k_name, v_name = kv_b.replace("attn_kv_b", "attn_k_b"), kv_b.replace("attn_kv_b", "attn_v_b")
        if k_name not in self.file.tensors or v_name not in self.file.tensors:
            return None
        used.update((k_name, v_name))
        k_b, v_b = self.file.tensors[k_name], self.file.tensors[v_name]
        heads, rank, nope = k_b.shape
        v = v_b.shape[1]

        def read():
            k = _float(k_b).astype(np.float32).transpose(0, 2, 1)
            return np.concatenate([k, _float(v_b).astype(np.float32)], axis=1).reshape(heads * (nope + v), rank)

        stored = f"{k_b.type.name}+{v_b.type.name}"
        return GGUFTensorInfo(name, k_b.file, "F32", (heads * (nope + v), rank), k_b.nbytes + v_b.nbytes, stored, read)

    def _fused_mxfp4(self, name: str, layer: int, projection: str, part: str, used: set[str]):
        """A released gpt-oss expert tensor rebuilt from the file's: down_proj from ffn_down_exps, gate_up_proj from
        ffn_gate_exps and ffn_up_exps with their rows interleaved (gate even, up odd); `_blocks` and `_scales` from
        the MXFP4 weights, `_bias` from the biases. None where the file lacks one of them."""
        sources = ("down",) if projection == "down_proj" else ("gate", "up")
        suffix = "bias" if part == "bias" else "weight"
        names = [f"blk.{layer}.ffn_{s}_exps.{suffix}" for s in sources]
        if any(n not in self.file.tensors for n in names):
            return None
        used.update(names)
        parts = [self.file.tensors[n] for n in names]
        if part != "bias" and parts[0].type != Q.MXFP4:
            raise GGUFError(
                f"{parts[0].file}: tensor {parts[0].name}: gpt-oss routed experts stored as {parts[0].type.name}; "
                "supported: MXFP4 (as llama.cpp converts the release)"
            )

        def read():
            rows = [t.data.reshape(*t.shape[:-1], t.row_bytes) for t in parts]  # [E, rows, 17-byte blocks]
            if part == "bias":
                arrays = [_float(t).astype(np.float32) for t in parts]
            elif part == "scales":  # each block's first byte
                arrays = [np.ascontiguousarray(r.reshape(*r.shape[:-1], -1, 17)[..., 0]) for r in rows]
            else:
                arrays = [mxfp4_from_ggml(r)[0] for r in rows]
            if len(arrays) == 1:
                return arrays[0]
            out = np.empty((arrays[0].shape[0], 2 * arrays[0].shape[1], *arrays[0].shape[2:]), arrays[0].dtype)
            out[:, 0::2], out[:, 1::2] = arrays
            return out

        # [E, rows (both projections' for gate_up)], and for the weights their 32-element groups (of 16 bytes)
        shape = (parts[0].shape[0], parts[0].shape[1] * len(parts))
        if part != "bias":
            shape += (parts[0].shape[-1] // 32,) + ((16,) if part == "blocks" else ())
        stored = "+".join(dict.fromkeys(t.type.name for t in parts))  # gate_up's two parts: one type
        dtype = "F32" if part == "bias" else "U8"
        return GGUFTensorInfo(name, parts[0].file, dtype, shape, sum(t.nbytes for t in parts), stored, read)

    def _expert(self, name: str, t: GGUFTensor, expert: int) -> GGUFTensorInfo:
        if t.type not in _EXPERT_DTYPES:
            raise GGUFError(
                f"{t.file}: tensor {t.name}: routed experts stored as {t.type.name}, which no CPU kernel runs; "
                f"supported: {supported_expert_types()}"
            )
        n_experts, rows, cols = t.shape
        per_expert = t.nbytes // n_experts
        data = t.data[expert * per_expert : (expert + 1) * per_expert]
        if t.type == Q.F16:
            read = lambda: data.view(np.float16).reshape(rows, cols).astype(ml_dtypes.bfloat16)  # noqa: E731
        elif t.type in _NUMPY:
            read = lambda: data.view(_NUMPY[t.type]).reshape(rows, cols)  # noqa: E731
        else:
            read = lambda: data.reshape(rows, t.row_bytes)  # noqa: E731
        return GGUFTensorInfo(name, t.file, _EXPERT_DTYPES[t.type], (rows, cols), per_expert, t.type.name, read)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> GGUFTensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            source = gguf_name(name, self.file.architecture)
            where = f" (GGUF tensor {source[0]})" if source else ""
            raise GGUFError(f"{self.directory}: tensor {name}{where} is missing") from None

    def get(self, name: str) -> np.ndarray:
        return self.info(name).read()

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())
