"""Offline conversion of a checkpoint's weight format, written as a new Hugging Face checkpoint."""

import json
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

from hybridjit.checkpoint import Checkpoint
from hybridjit.config import ModelConfig
from hybridjit.export import save_checkpoint
from hybridjit.quant import dequantize_fp8_blocks, quantize_fp8_blocks
from hybridjit.weights import SCALE_SUFFIX, check_checkpoint, checkpoint_layout

FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def convert_checkpoint(src, dst, weight_format: str, block: tuple[int, int] = (128, 128)) -> Path:
    """Re-stores every projection matrix (those real DeepSeek-V3 checkpoints quantize) as `weight_format`:
    "fp8" (E4M3FN with float32 per-block scales) or "bf16". Other tensors are copied unchanged."""
    if weight_format not in ("fp8", "bf16"):
        raise ValueError(f"weight format {weight_format!r} is not supported (fp8, bf16)")
    src, dst = Path(src), Path(dst)
    raw = json.loads((src / "config.json").read_text())
    cfg = ModelConfig.from_hf_config(raw, source=str(src / "config.json"))
    ckpt = Checkpoint(src)
    check_checkpoint(cfg, ckpt)
    tensors = {}
    for name, spec in checkpoint_layout(cfg).items():
        w = np.asarray(ckpt.get(name))
        if not spec.quantizable:
            tensors[name] = w.copy()
            continue
        if w.dtype == ml_dtypes.float8_e4m3fn:
            w = dequantize_fp8_blocks(w, np.asarray(ckpt.get(name + SCALE_SUFFIX)), cfg.fp8.block)
        if weight_format == "fp8":
            tensors[name], tensors[name + SCALE_SUFFIX] = quantize_fp8_blocks(w, block)
        else:
            tensors[name] = w.astype(ml_dtypes.bfloat16)
    raw.pop("quantization_config", None)
    if weight_format == "fp8":
        raw["quantization_config"] = {**FP8_QUANTIZATION_CONFIG, "weight_block_size": list(block)}
    save_checkpoint(dst, raw, tensors)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst
