"""Random checkpoints of real model geometries, generated in memory, for benchmarks.

A SyntheticCheckpoint answers the same questions as `Checkpoint` (names, shapes, dtypes, bytes) for every
tensor `checkpoint_layout` implies, so benchmarks load it through the very loader and expert bank that
real checkpoints use. Weights are random but well-scaled (~1/sqrt(fan_in)). FP8 weights are distributed as
in real block-scaled checkpoints (scale = block amax / 448): normal values spread over the whole E4M3 range,
so denormals and zeros are as rare as there (~1e-4 of the codes) and the kernels take the paths they take on
real weights.
"""

import copy
from pathlib import Path

import ml_dtypes
import numpy as np

from hybridjit.checkpoint import DTYPES, TensorInfo
from hybridjit.models.registry import GEOMETRIES, ModelConfig, config_from_hf, family_of
from hybridjit.quant import scale_shape
from hybridjit.weights import SCALE_SUFFIX

WEIGHT_FORMATS = ("fp8", "bf16")
# The block-scaled FP8 of DeepSeek-V3's release, for geometries asked for in fp8.
FP8_BLOCK_QUANTIZATION = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def geometry_config(name: str, *, layers: int | None = None, weight_format: str | None = None) -> ModelConfig:
    """A named geometry, optionally truncated to `layers` layers and stored as fp8 or bf16."""
    if name not in GEOMETRIES:
        raise ValueError(f"unknown geometry {name!r}; known: {', '.join(GEOMETRIES)}")
    raw = copy.deepcopy(GEOMETRIES[name])
    if layers is not None:
        raw["num_hidden_layers"] = layers
        if "layer_types" in raw:  # one entry per layer (gpt-oss's sliding / full attention)
            raw["layer_types"] = raw["layer_types"][:layers]
    if weight_format == "bf16":
        raw.pop("quantization_config", None)
    elif weight_format == "fp8":
        raw.setdefault("quantization_config", FP8_BLOCK_QUANTIZATION)
    elif weight_format is not None:
        raise ValueError(f"unknown weight format {weight_format!r}; known: {', '.join(WEIGHT_FORMATS)}")
    return config_from_hf(raw, source=f"geometry {name}")


class SyntheticCheckpoint:
    """Random tensors for every name the config implies, made when asked for."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        self.directory = Path(f"<synthetic {cfg.model_type} seed {seed}>")
        self.cfg, self.seed = cfg, seed
        self.tensors: dict[str, TensorInfo] = {}
        for name, spec in family_of(cfg).ckpt.checkpoint_layout(cfg).items():
            if spec.dtype is not None:  # a raw tensor (MXFP4 blocks and scales)
                self._add(name, spec.dtype, spec.shape)
            elif spec.quantizable and cfg.fp8 is not None:
                self._add(name, "F8_E4M3", spec.shape)
                self._add(name + SCALE_SUFFIX, "F32", scale_shape(spec.shape, cfg.fp8.block))
            else:
                self._add(name, "F32" if name.endswith("e_score_correction_bias") else "BF16", spec.shape)

    def _add(self, name, dtype, shape):
        nbytes = int(np.prod(shape)) * DTYPES[dtype].itemsize
        self.tensors[name] = TensorInfo(name, self.directory, dtype, tuple(shape), 0, nbytes)

    def __contains__(self, name):
        return name in self.tensors

    def info(self, name) -> TensorInfo:
        return self.tensors[name]

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def get(self, name) -> np.ndarray:
        """A fresh random tensor: nothing is kept here (the expert bank keeps what it registers), so a
        loader that copies the experts elsewhere (pinned memory) does not hold two copies."""
        return self._make(self.tensors[name])

    def _make(self, info: TensorInfo) -> np.ndarray:
        rng = np.random.default_rng([self.seed, *info.name.encode()])
        if info.name.endswith(SCALE_SUFFIX):  # w = fp8 (rms _FP8_RMS) * scale: ~1/sqrt(fan_in) overall
            fan_in = self.tensors[info.name.removesuffix(SCALE_SUFFIX)].shape[1]
            return np.full(info.shape, 1 / (_FP8_RMS * np.sqrt(fan_in)), np.float32)
        if info.name.endswith(
            "_scales"
        ):  # MXFP4 e8m0 exponents: w = e2m1 (rms _E2M1_RMS) * 2^(s - 127) ~ 1/sqrt(fan_in)
            fan_in = info.shape[-1] * 32
            return np.full(info.shape, 127 + round(np.log2(1 / (_E2M1_RMS * np.sqrt(fan_in)))), np.uint8)
        if len(info.shape) == 1 or info.name.endswith("bias"):  # norms ~1, biases small
            base = 0.0 if info.name.endswith("bias") else 1.0
            return (base + 0.01 * rng.standard_normal(info.shape, np.float32)).astype(DTYPES[info.dtype])
        values = random_values(info.dtype, int(np.prod(info.shape)), rng).reshape(info.shape)
        if info.dtype in ("F8_E4M3", "U8") or "embed_tokens" in info.name:  # scaled by their scales
            return values
        # A Python float keeps the values' dtype (NumPy 2); a NumPy float64 would make a float64 temporary of each.
        return (values * float(1 / np.sqrt(info.shape[1]))).astype(values.dtype)


_POOL_ELEMENTS = 1 << 24
# The RMS of e2m1 values over uniformly random codes (MXFP4 blocks are random bytes).
_E2M1_RMS = float(np.sqrt(np.mean(np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6]) ** 2)))
# A block's largest |w| maps to 448 (E4M3's largest normal); for 16K normal values that is ~4.5 sigma.
_FP8_RMS = 448 / 4.5
_pools: dict[str, np.ndarray] = {}


def random_values(dtype: str, count: int, rng: np.random.Generator) -> np.ndarray:
    """count random values of a safetensors dtype, unit scale. Large tensors (whole layers of experts are
    gigabytes) repeat a 16M-element random pool from a random offset: fresh memory, generated at copy speed."""
    if dtype not in _pools:
        pool_rng = np.random.default_rng(12345)
        if dtype == "U8":  # MXFP4 blocks: every code equally likely
            _pools[dtype] = pool_rng.integers(0, 256, _POOL_ELEMENTS, dtype=np.uint8)
        elif dtype == "F8_E4M3":
            normal = pool_rng.standard_normal(_POOL_ELEMENTS, np.float32) * _FP8_RMS
            _pools[dtype] = np.clip(normal, -448, 448).astype(ml_dtypes.float8_e4m3fn)
        else:
            _pools[dtype] = pool_rng.standard_normal(_POOL_ELEMENTS, np.float32).astype(DTYPES[dtype])
    pool = _pools[dtype]
    start = int(rng.integers(0, _POOL_ELEMENTS))
    repeats = -(-(start + count) // _POOL_ELEMENTS)
    if repeats == 1:
        return pool[start : start + count].copy()
    return np.tile(pool, repeats)[start : start + count]
