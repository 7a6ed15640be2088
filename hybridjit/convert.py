"""Offline conversion of a checkpoint's weight format, written as a new Hugging Face checkpoint.

Formats: "fp8" (E4M3FN with float32 per-block scales, as DeepSeek-V3 ships), "bf16", and for the routed
experts only "int8" / "int4". The int formats, as written (and read by hybridjit.weights):

- each routed expert projection ``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`` [out, in] is
  stored as int8 ``I8`` [out, in], or int4 ``U8`` [out, ceil(in / 2)]: element 2j in the low nibble of
  byte j and element 2j + 1 in the high nibble, each stored as q + 8 for q in [-8, 7] (a padding nibble
  for odd ``in`` holds 8, i.e. 0);
- its ``..._scale_inv`` is float32 [out, ceil(in / G)]: one multiplier per row and group of G input
  columns, w = q * scale_inv (the meaning of ``weight_scale_inv`` in the FP8 checkpoints). Symmetric
  round-to-nearest: scale = max|w| / 127 (int8) or / 7 (int4) over the group;
- every other projection becomes bfloat16 (the CPU kernels only run the routed experts);
- config.json gets ``"quantization_config": {"quant_method": "hybridjit_int", "bits": 8 | 4, "group_size": G,
  "modules": "routed_experts"}`` with G a multiple of 128 (G >= the input size: one scale per row).
"""

import secrets
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np

from hybridjit.checkpoint import Checkpoint
from hybridjit.config import INT_QUANT_METHOD, read_config_json
from hybridjit.export import save_checkpoint
from hybridjit.gguf_file import is_gguf
from hybridjit.models.registry import config_from_hf, family_of
from hybridjit.quant import dequantize_fp8_blocks, dequantize_int_groups, quantize_fp8_blocks
from hybridjit.weights import SCALE_SUFFIX, check_checkpoint

FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
WEIGHT_FORMATS = ("fp8", "bf16", "int8", "int4")


def quantize_int_groups(weight: np.ndarray, bits: int, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """float [out, in] -> (int8 [out, in] or packed int4 uint8 [out, ceil(in / 2)], float32 scales
    [out, ceil(in / group_size)]), symmetric per row and group of input columns."""
    w = np.asarray(weight, dtype=np.float32)
    rows, cols = w.shape
    groups = -(-cols // group_size)
    padded = np.zeros((rows, groups * group_size), np.float32)
    padded[:, :cols] = w
    qmax = 127 if bits == 8 else 7
    amax = np.abs(padded.reshape(rows, groups, group_size)).max(axis=2)
    scale = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
    q = np.rint(padded.reshape(rows, groups, group_size) / scale[:, :, None]).reshape(rows, -1)[:, :cols]
    q = np.clip(q, -qmax if bits == 8 else -8, qmax).astype(np.int8)
    if bits == 8:
        return q, scale
    nibbles = np.full((rows, cols + cols % 2), 8, np.uint8)
    nibbles[:, :cols] = (q + 8).astype(np.uint8)
    return np.ascontiguousarray(nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)), scale


def convert_checkpoint(
    src,
    dst,
    weight_format: str,
    block: tuple[int, int] = (128, 128),
    group_size: int = 128,
    overwrite: bool = False,
) -> Path:
    """Re-stores every projection matrix (those real DeepSeek-V3 checkpoints quantize) as `weight_format`:
    "fp8" (E4M3FN with float32 per-`block` scales) or "bf16"; "int8"/"int4" quantize the routed experts in
    groups of `group_size` input columns and store the other projections as bf16 (format in the module
    docstring). Other tensors are copied unchanged.

    `dst` must not be, be inside, or hold the source; an existing non-empty `dst` is replaced only with
    `overwrite`, and only once the new checkpoint is complete (it is written next to it, then renamed).
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {weight_format!r} is not supported ({', '.join(WEIGHT_FORMATS)})")
    bits = {"int8": 8, "int4": 4}.get(weight_format)
    if bits and (group_size <= 0 or group_size % 128):
        raise ValueError(f"group_size must be a positive multiple of 128, got {group_size}")
    src, dst = Path(src), Path(dst)
    if is_gguf(src):
        raise ValueError(f"{src}: a GGUF file is loaded as it is (hybridjit.load, --model); convert takes a "
                         "safetensors checkpoint directory")
    _check_destination(src, dst, overwrite)
    raw = read_config_json(src / "config.json")
    cfg = config_from_hf(raw, source=str(src / "config.json"))
    layout = family_of(cfg).ckpt.checkpoint_layout(cfg)
    raw_tensors = [name for name, spec in layout.items() if spec.dtype is not None]
    if raw_tensors:
        # MXFP4 (gpt-oss) is already 4.25 bits per weight, read as stored by the CPU kernels: fp8/bf16 would only
        # grow it, and int8/int4 re-quantize what is already quantized.
        raise ValueError(
            f"{cfg.model_type}: its experts are stored in a format of their own ({raw_tensors[0]}, ...), which the "
            "CPU kernels run as released; converting them is not supported"
        )
    ckpt = Checkpoint(src)
    check_checkpoint(cfg, ckpt)
    tensors = {}
    for name, spec in layout.items():
        w = np.asarray(ckpt.get(name))
        if not spec.quantizable:
            tensors[name] = w.copy()
            continue
        if w.dtype == ml_dtypes.float8_e4m3fn:
            w = dequantize_fp8_blocks(w, np.asarray(ckpt.get(name + SCALE_SUFFIX)), cfg.fp8.block)
        elif cfg.int_quant is not None and spec.routed_expert:
            w = dequantize_int_groups(w, np.asarray(ckpt.get(name + SCALE_SUFFIX)), cfg.int_quant, spec.shape)
        if weight_format == "fp8":
            tensors[name], tensors[name + SCALE_SUFFIX] = quantize_fp8_blocks(w, block)
        elif bits and spec.routed_expert:
            tensors[name], tensors[name + SCALE_SUFFIX] = quantize_int_groups(w, bits, group_size)
        else:
            tensors[name] = w.astype(ml_dtypes.bfloat16)
    raw.pop("quantization_config", None)
    if weight_format == "fp8":
        raw["quantization_config"] = {**FP8_QUANTIZATION_CONFIG, "weight_block_size": list(block)}
    elif bits:
        raw["quantization_config"] = {
            "quant_method": INT_QUANT_METHOD,
            "bits": bits,
            "group_size": group_size,
            "modules": "routed_experts",
        }
    _write_in_place_of(dst.resolve(), src, raw, tensors)
    return dst


def _check_destination(src: Path, dst: Path, overwrite: bool):
    """Refuses a destination that is the source, is inside it or holds it (replacing it would delete the
    source), compared by real path; and a non-empty one unless `overwrite`."""
    target = dst.resolve()
    # Hugging Face cache snapshots are directories of links into the repository's blobs/: those are source too.
    for source in [src.resolve(), *(f.resolve() for f in src.iterdir())]:
        if source == target or source in target.parents:
            raise ValueError(f"destination {dst} is the source checkpoint {src} or inside it")
        if target in source.parents:
            raise ValueError(f"destination {dst} contains the source checkpoint ({source}): replacing it deletes it")
    if target.exists() and not target.is_dir():
        raise ValueError(f"destination {dst} exists and is not a directory")
    if target.exists() and any(target.iterdir()) and not overwrite:
        raise ValueError(f"destination {dst} is not empty; replace its contents with --force (overwrite=True)")


def _write_in_place_of(target: Path, src: Path, config: dict, tensors: dict[str, np.ndarray]):
    """Writes the checkpoint (with src's tokenizer files) next to `target`, then renames it to `target`: an
    interrupted or failed conversion leaves `target` as it was, and no partial checkpoint."""
    staging = target.with_name(f".{target.name}.partial-{secrets.token_hex(4)}")
    try:
        save_checkpoint(staging, config, tensors)
        for name in TOKENIZER_FILES:
            if (src / name).exists():
                shutil.copyfile(src / name, staging / name)  # not copy(): the usual new-file mode, not src's
        _move_into_place(staging, target)
    except BaseException:  # Ctrl-C included
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _move_into_place(staging: Path, target: Path):
    """Renames the finished checkpoint to `target`; an existing `target` is moved aside first and deleted last."""
    if not target.exists() or not any(target.iterdir()):
        staging.replace(target)  # an empty directory is replaced as a whole
        return
    old = staging.with_name(staging.name + "-old")
    target.rename(old)
    staging.rename(target)
    shutil.rmtree(old)
