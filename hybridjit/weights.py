"""Builds the model's weights pytree from a checkpoint, with every tensor checked against the config.

`checkpoint_layout` says which tensors a config implies (Hugging Face names and shapes); the checkpoint
is checked against it as a whole before anything is loaded, so one error lists what is missing,
misshapen or unexpected. Non-expert weights become JAX arrays in the compute dtype (FP8 ones
dequantized per block). Routed experts are registered, zero-copy, with the C++ expert bank in the
checkpoint's own format (FP8 + block scales, BF16 or F32): their bytes stay where the checkpoint keeps
them (memory-mapped files).
"""

import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes
import numpy as np

from hybridjit.checkpoint import CheckpointError
from hybridjit.models.common.checkpoint_map import FusedMxfp4Experts
from hybridjit.models.common.experts import Experts
from hybridjit.models.common.resident_experts import ResidentExperts
from hybridjit.models.registry import ModelConfig, family_of
from hybridjit.ops.gguf_experts import GGUF_EXPERT_FORMATS, register_gguf_layer
from hybridjit.ops.gguf_experts import dequantize as dequantize_gguf
from hybridjit.ops.routed_experts import ExpertLayer, register_layer
from hybridjit.pinned_experts import register_pinned
from hybridjit.placement import Placement
from hybridjit.quant import dequantize_fp8_blocks, dequantize_int_groups, dequantize_mxfp4, scale_shape

FLOAT_DTYPES = ("F32", "BF16", "F16", "F8_E4M3")
EXPERT_DTYPES = ("F32", "BF16", "F8_E4M3", "I8", "U8")  # I8/U8: int8/int4 checkpoints (cfg.int_quant)
SCALE_SUFFIX = "_scale_inv"
# Real checkpoints also carry the multi-token-prediction layer(s) that config.json declares after the last
# decoder layer (model.layers.61.* in V3) and, in old exports, rotary caches: the model uses neither.
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_ROTARY_CACHE = re.compile(r".*rotary_emb\.inv_freq$")

Progress = Callable[[int, int], None]


def check_checkpoint(cfg: ModelConfig, ckpt) -> None:
    """Raises one CheckpointError listing every missing, misshapen, mistyped or unexpected tensor."""
    layout = family_of(cfg).ckpt.checkpoint_layout(cfg)
    problems = []
    expected_scales = {}
    for name, spec in layout.items():
        if name not in ckpt:
            problems.append(f"missing {name} {list(spec.shape)}")
            continue
        info = ckpt.info(name)
        shape = spec.shape
        if spec.dtype is not None:  # a raw tensor (MXFP4 blocks and scales): its one dtype and shape
            if info.shape != shape:
                problems.append(
                    f"{info.file.name}: {name} has shape {list(info.shape)}, config.json implies {list(shape)}"
                )
            if info.dtype != spec.dtype:
                problems.append(f"{info.file.name}: {name} has dtype {info.dtype}, expected {spec.dtype}")
            continue
        int_expert = cfg.int_quant is not None and spec.routed_expert
        if int_expert:
            shape = cfg.int_quant.stored_shape(spec.shape)
        if info.shape != shape:
            problems.append(f"{info.file.name}: {name} has shape {list(info.shape)}, config.json implies {list(shape)}")
        if int_expert:
            dtype = "I8" if cfg.int_quant.bits == 8 else "U8"
            if info.dtype != dtype:
                problems.append(f"{info.file.name}: {name} has dtype {info.dtype}, expected {dtype} (int quantization)")
            expected_scales[name + SCALE_SUFFIX] = cfg.int_quant.scale_shape(spec.shape)
        elif spec.routed_expert and info.dtype in GGUF_EXPERT_FORMATS:
            pass  # GGUF blocks, their type checked by the GGUF checkpoint
        elif info.dtype not in FLOAT_DTYPES:
            problems.append(f"{info.file.name}: {name} has dtype {info.dtype}, expected a float type")
        elif info.dtype == "F8_E4M3":
            if cfg.fp8 is None:
                problems.append(f"{name} is float8_e4m3 but config.json has no fp8 quantization_config")
            elif not spec.quantizable:
                problems.append(f"{name} is float8_e4m3, which this tensor never is in supported checkpoints")
            else:
                expected_scales[name + SCALE_SUFFIX] = scale_shape(spec.shape, cfg.fp8.block)
    for name, shape in expected_scales.items():
        if name not in ckpt:
            problems.append(f"missing {name} (the block scales of an FP8 weight)")
        elif ckpt.info(name).shape != shape:
            int_scale = cfg.int_quant is not None and layout[name.removesuffix(SCALE_SUFFIX)].routed_expert
            block = [1, cfg.int_quant.group_size] if int_scale else list(cfg.fp8.block)
            problems.append(
                f"{ckpt.info(name).file.name}: {name} has shape {list(ckpt.info(name).shape)}, expected "
                f"{list(shape)} for block {block}"
            )

    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers  # decoder layers, then the MTP ones

    def skipped(name):
        return cfg.num_hidden_layers <= _layer_index(name, -1) < layers or _ROTARY_CACHE.match(name)

    unexpected = [n for n in ckpt.tensors if n not in layout and n not in expected_scales and not skipped(n)]
    problems += [f"unexpected tensor {n}" for n in sorted(unexpected)]
    if problems:
        # The first problem is on the first line, which alone then says what is wrong (a log keeps only it).
        message = f"{ckpt.directory} does not match its config.json: {problems[0]}"
        if len(problems) > 1:
            message += f"; {len(problems) - 1} more:" + "".join(f"\n  {p}" for p in problems[1:12])
        if len(problems) > 12:
            message += f"\n  ... and {len(problems) - 12} more"
        if any(_layer_index(n, -1) >= layers for n in unexpected):
            message += (
                f"\n  (layers past the {layers} that config.json declares: num_hidden_layers "
                f"{cfg.num_hidden_layers} + num_nextn_predict_layers {cfg.num_nextn_predict_layers})"
            )
        raise CheckpointError(message)


def routed_expert_bytes(cfg: ModelConfig, ckpt) -> int:
    """The bytes of the routed experts of the decoder layers (weights and their scales), which loading keeps in
    host memory: from the checkpoint's headers, without reading any data."""
    names = [n for n, spec in family_of(cfg).ckpt.checkpoint_layout(cfg).items() if spec.routed_expert]
    return sum(ckpt.info(n).nbytes for name in names for n in (name, name + SCALE_SUFFIX) if n in ckpt)


def _layer_index(name: str, default: int) -> int:
    """The layer a model.layers.<i>.* tensor belongs to; `default` for other tensors."""
    m = _LAYER.match(name)
    return default if m is None else int(m.group(1))


class WeightLoader:
    """Turns a checked checkpoint into the model's weights pytree, placed as `placement` says, and the
    expert-bank layers of the routed experts that stay in host memory."""

    def __init__(self, cfg: ModelConfig, ckpt, placement: Placement, progress: Progress | None = None):
        self.cfg, self.ckpt, self.placement, self.progress = cfg, ckpt, placement, progress
        self.total = ckpt.total_bytes()
        self.done = 0
        self.expert_names = {}  # MoE layer -> its routed experts' tensor names, of the layers in the expert bank

    def _take(self, name: str) -> np.ndarray:
        self.done += self.ckpt.info(name).nbytes
        if self.progress:
            self.progress(self.done, self.total)
        return self.ckpt.get(name)

    def _scale(self, name: str) -> np.ndarray:
        return self._take(name + SCALE_SUFFIX).astype(np.float32, copy=False)

    def _dequantized(self, name: str) -> np.ndarray:
        return self._decoded(name, self._take(name), self._scale)

    def _decoded(self, name: str, w: np.ndarray, scale: Callable[[str], np.ndarray], shape=None) -> np.ndarray:
        """Tensor `name` (its stored array `w`) in a float dtype: GGUF blocks, FP8 with block scales and int8/int4
        groups (of an expert matrix of `shape`) dequantized, with scale(name) giving the scales."""
        dtype = self.ckpt.info(name).dtype
        if dtype in GGUF_EXPERT_FORMATS:
            return dequantize_gguf(w, dtype)
        if w.dtype == ml_dtypes.float8_e4m3fn:
            return dequantize_fp8_blocks(w, scale(name), self.cfg.fp8.block)
        if self.cfg.int_quant is not None and dtype in ("I8", "U8"):
            return dequantize_int_groups(w, scale(name), self.cfg.int_quant, shape)
        return w

    def tensor(self, name: str, dtype=None) -> jax.Array:
        """A weight on the placement's device in the compute dtype (FP8 dequantized per block)."""
        return self.placement.put(self._dequantized(name), dtype)

    def device_experts(self, names: tuple[list[str], ...] | FusedMxfp4Experts) -> Experts:
        """A layer's routed experts (the names of every expert's gate, up and down matrices, or gpt-oss's fused
        MXFP4 tensors) stacked on the placement's device, dequantized to the compute dtype."""
        if isinstance(names, FusedMxfp4Experts):
            gate_up, down = (
                dequantize_mxfp4(self._take(names.tensor(p, "blocks")), self._take(names.tensor(p, "scales")))
                for p in ("gate_up_proj", "down_proj")
            )
            gate_up_bias, down_bias = (self._take(names.tensor(p, "bias")) for p in ("gate_up_proj", "down_proj"))
            put = self.placement.put
            return Experts(
                gate=put(gate_up[:, 0::2]),
                up=put(gate_up[:, 1::2]),
                down=put(down),
                gate_bias=put(gate_up_bias[:, 0::2]),
                up_bias=put(gate_up_bias[:, 1::2]),
                down_bias=put(down_bias),
                activation=names.activation,
            )
        shapes = self._expert_shapes()
        return Experts(*(
            self.placement.put(np.stack([self._decoded(n, self._take(n), self._scale, shape) for n in ns]))
            for ns, shape in zip(names, shapes, strict=True)
        ))

    def _expert_shapes(self) -> tuple[tuple[int, int], ...]:
        """[out, in] of a routed expert's gate, up and down matrices (int4 stores hide odd column counts)."""
        d, f = self.cfg.hidden_size, self.cfg.moe_intermediate_size
        return (f, d), (f, d), (d, f)

    def _register(self) -> Callable[..., ExpertLayer]:
        """register_layer, or its drop-in that first copies the experts into pinned host memory where the placement
        pins them (for stream-loaded prefill)."""
        if self.placement.pinned_experts:
            return functools.partial(register_pinned, devices=self.placement.stream_devices)
        return register_layer

    def fused_mxfp4_experts(self, names: FusedMxfp4Experts) -> ExpertLayer:
        """Registers gpt-oss's fused MXFP4 experts with the C++ bank, zero-copy (views of the stored tensors, per
        expert) unless the placement pins them; only the biases are converted, to float32."""
        blocks = {p: self._take(names.tensor(p, "blocks")) for p in ("gate_up_proj", "down_proj")}
        scales = {p: self._take(names.tensor(p, "scales")) for p in ("gate_up_proj", "down_proj")}
        biases = {p: self._take(names.tensor(p, "bias")).astype(np.float32) for p in ("gate_up_proj", "down_proj")}

        def per_expert(a, flat=True):  # [E, out, in / 32, 16] -> E views [out, in / 2]
            return [e.reshape(e.shape[0], -1) if flat else e for e in a]

        return self._register()(
            per_expert(blocks["gate_up_proj"]),
            None,
            per_expert(blocks["down_proj"]),
            gate_scale=per_expert(scales["gate_up_proj"], flat=False),
            down_scale=per_expert(scales["down_proj"], flat=False),
            fmt="mxfp4",
            gate_up_interleaved=True,
            biases=(list(biases["gate_up_proj"]), None, list(biases["down_proj"])),
            activation=names.activation,
        )

    def experts(self, names: tuple[list[str], ...] | FusedMxfp4Experts) -> ExpertLayer:
        """Registers a layer's routed experts (the names of every expert's gate, up and down matrices, or gpt-oss's
        fused MXFP4 tensors) with the C++ bank, zero-copy, in their stored format."""
        if isinstance(names, FusedMxfp4Experts):
            return self.fused_mxfp4_experts(names)
        dtypes = {self.ckpt.info(n).dtype for ns in names for n in ns}
        if dtypes & GGUF_EXPERT_FORMATS.keys():
            return self._gguf_experts(names)
        if len(dtypes) > 1 or not dtypes <= set(EXPERT_DTYPES):
            raise CheckpointError(
                f"{names[0][0]}...: routed experts stored as {sorted(dtypes)}; one of {', '.join(EXPERT_DTYPES)} "
                "is needed"
            )
        weights = [[self._take(n) for n in ns] for ns in names]
        register = self._register()
        if dtypes <= {"F32", "BF16"}:
            return register(*weights)
        scales = [[self._scale(n) for n in ns] for ns in names]
        block = self.cfg.fp8.block if dtypes == {"F8_E4M3"} else (1, self.cfg.int_quant.group_size)
        return register(*weights, *scales, block=block)

    def _gguf_experts(self, names: tuple[list[str], ...]) -> ExpertLayer:
        """A layer of GGUF block experts: gate and up of one type, down of one (maybe another: Q4_K_M)."""
        gate_up = {self.ckpt.info(n).dtype for ns in names[:2] for n in ns}
        down = {self.ckpt.info(n).dtype for n in names[2]}
        if len(gate_up) > 1 or len(down) > 1 or not (gate_up | down) <= GGUF_EXPERT_FORMATS.keys():
            raise CheckpointError(
                f"{names[0][0]}...: routed experts stored as gate/up {sorted(gate_up)}, down {sorted(down)}; one "
                f"GGUF block type for gate and up and one for down ({', '.join(GGUF_EXPERT_FORMATS)}) is needed"
            )
        # Where the placement pins (a GPU's default), the blocks are copied into the pinned host copy, which the CPU
        # kernels read and stream-loaded prefill streams (dequantised on the device); else they stay in the file's
        # memory mapping.
        weights = [[self._take(n) for n in ns] for ns in names]
        register = functools.partial(register_gguf_layer, gguf_type=gate_up.pop(), down_type=down.pop(),
                                     hidden=self.cfg.hidden_size, inter=self.cfg.moe_intermediate_size)
        if self.placement.pinned_experts:
            return self._register()(*weights, register=register)
        return register(*weights)

    def resident_experts(self, names: tuple[list[str], ...] | FusedMxfp4Experts, ids) -> ResidentExperts | None:
        """Copies of experts `ids` of a layer (the names of every expert's gate, up and down matrices, or
        gpt-oss's fused MXFP4 tensors) on the placement's device, read from the checkpoint again: FP8 ones as
        stored with their block scales (dequantized where they are used, so they take half the memory of BF16),
        any other format dequantized to the compute dtype. None when `ids` is empty."""
        ids = sorted(int(i) for i in ids)
        if not ids:
            return None
        slot_of = np.full(self.cfg.n_routed_experts, -1, np.int32)
        slot_of[ids] = np.arange(len(ids), dtype=np.int32)
        put, get = self.placement.put, self.ckpt.get
        if isinstance(names, FusedMxfp4Experts):
            fused = {p: dequantize_mxfp4(get(names.tensor(p, "blocks"))[ids], get(names.tensor(p, "scales"))[ids])
                     for p in ("gate_up_proj", "down_proj")}
            bias = {p: get(names.tensor(p, "bias"))[ids] for p in ("gate_up_proj", "down_proj")}
            experts = Experts(
                *(put(a) for a in (fused["gate_up_proj"][:, 0::2], fused["gate_up_proj"][:, 1::2], fused["down_proj"])),
                *(put(a) for a in (bias["gate_up_proj"][:, 0::2], bias["gate_up_proj"][:, 1::2], bias["down_proj"])),
                activation=names.activation,
            )
            return ResidentExperts(put(slot_of, np.int32), experts)
        picked = [[ns[i] for i in ids] for ns in names]
        if {self.ckpt.info(n).dtype for ns in picked for n in ns} == {"F8_E4M3"}:
            weights = (put(np.stack([get(n) for n in ns]), ml_dtypes.float8_e4m3fn) for ns in picked)
            scales = tuple(put(np.stack([get(n + SCALE_SUFFIX) for n in ns]), np.float32) for ns in picked)
            return ResidentExperts(put(slot_of, np.int32), Experts(*weights), scales, tuple(self.cfg.fp8.block))

        def scale(name):
            return get(name + SCALE_SUFFIX).astype(np.float32, copy=False)

        weights = (put(np.stack([self._decoded(n, get(n), scale, shape) for n in ns]))
                   for ns, shape in zip(picked, self._expert_shapes(), strict=True))
        return ResidentExperts(put(slot_of, np.int32), Experts(*weights))

    def load(self) -> tuple[Any, list[ExpertLayer]]:
        check_checkpoint(self.cfg, self.ckpt)
        expert_layers: list[ExpertLayer] = []

        def routed(names, layer):
            if self.placement.experts_on_device(layer):
                return self.device_experts(names), None
            self.expert_names[layer] = names
            expert_layers.append(self.experts(names))
            return None, expert_layers[-1].id

        try:
            return family_of(self.cfg).ckpt.build_weights(self.cfg, self.tensor, routed), expert_layers
        except BaseException:
            for layer in expert_layers:
                layer.close()
            raise
