"""Random GGUF files of geometries (hybridjit/synthetic_gguf.py, bench/decode.py's GGUF formats): the tensors and
metadata tests/gguf_factory.py writes for the same config (its statement of llama.cpp's conventions, which
test_gguf_llama_cpp.py checks against llama.cpp itself) and the config read back, expert blocks of the spread of
real weights, and decode.py's GGUF geometry on the CPU: the same weights as the synthetic checkpoint."""

import argparse
import dataclasses
import math
from pathlib import Path

import gguf
import jax
import numpy as np
import pytest
from checkpoint_factory import family_config, tiny_config
from gguf_factory import write_gguf

from hybridjit.gguf_checkpoint import GGUFCheckpoint
from hybridjit.gguf_file import GGUFFile
from hybridjit.models.registry import GEOMETRIES, config_from_hf, family_of
from hybridjit.placement import Placement
from hybridjit.synthetic import SyntheticCheckpoint
from hybridjit.synthetic_gguf import block_pool, write_synthetic_gguf

Q = gguf.GGMLQuantizationType
ROOT = Path(__file__).resolve().parent.parent
PROMPT = [[3, 5, 7, 11, 13, 2, 9, 4]]


def rel_rms(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


def close(a, b) -> bool:
    """Equal, floats up to their float32 storage in GGUF metadata (rms_norm_eps 1e-6, mscale 0.1 / 0.1)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-6)
    return a == b


# Each family's tiny config with K-quant-sized experts (rows of whole 256-element super-blocks); GLM-4.5 without its
# MTP layer (a truncated geometry has none: the synthetic file writes none), MiniMax-M2 unquantised.
CONFIGS = {
    "deepseek_v3": lambda: tiny_config("v3", hidden_size=256, moe_intermediate_size=256),
    "deepseek_v2_lite": lambda: tiny_config("v2_lite_greedy", hidden_size=256, moe_intermediate_size=256),
    "qwen3_moe": lambda: family_config("qwen3_moe", hidden_size=256, moe_intermediate_size=256),
    "mixtral": lambda: family_config("mixtral", hidden_size=256, intermediate_size=256),
    "glm4_moe": lambda: family_config("glm4_moe", hidden_size=256, moe_intermediate_size=256,
                                      num_nextn_predict_layers=0),
    "minimax_m2": lambda: family_config("minimax_m2", hidden_size=256, intermediate_size=256,
                                        quantization_config=None),
}  # fmt: skip


@pytest.mark.parametrize("family", CONFIGS)
def test_layout_and_metadata_are_those_of_the_factory(tmp_path, family):
    raw = CONFIGS[family]()
    cfg = config_from_hf(raw)
    path = tmp_path / "ours.gguf"
    write_synthetic_gguf(path, cfg, "Q4_K", "Q6_K")
    synthetic = SyntheticCheckpoint(cfg)
    floats = {name: synthetic.get(name).astype(np.float32) for name in family_of(cfg).ckpt.checkpoint_layout(cfg)}
    kv_b = "split" if raw["model_type"].startswith("deepseek") else "kv_b"
    reference = GGUFFile(
        write_gguf(tmp_path / "ref.gguf", raw, floats, expert_types=(Q.Q4_K, Q.Q6_K), other_type=Q.BF16, kv_b=kv_b)
    )
    ours = GGUFFile(path)
    # Every key the factory writes, with its value; ours may say more (e.g. expert_weights_norm where llama.cpp's
    # reader has a default).
    assert {k: ours.metadata.get(k) for k in reference.metadata} == reference.metadata
    assert {n: (t.shape, t.type) for n, t in ours.tensors.items()} == {
        n: (t.shape, t.type) for n, t in reference.tensors.items()
    }
    assert close(dataclasses.asdict(GGUFCheckpoint(path).config), dataclasses.asdict(cfg))


@pytest.mark.parametrize("gguf_type", ["Q4_K", "Q5_K", "Q6_K", "Q8_0"])
def test_expert_blocks_have_the_spread_of_real_weights(gguf_type):
    """Decoded by the gguf package: rms 1/sqrt(fan_in) as the synthetic checkpoints' weights, centred on 0 (Q6_K's
    codes -32..31 lean by half a step: 2.7% of the rms), all finite."""
    fan_in = 7168
    w = gguf.quants.dequantize(block_pool(gguf_type, fan_in, np.random.default_rng(1), n_bytes=1 << 21), Q[gguf_type])
    assert np.isfinite(w).all()
    assert abs(np.sqrt(np.mean(w**2)) * np.sqrt(fan_in) - 1) < 0.03
    assert abs(np.mean(w) * np.sqrt(fan_in)) < 0.04


class DequantisedExperts(SyntheticCheckpoint):
    """The synthetic checkpoint of a config, its routed experts those of a GGUF file dequantised to float32."""

    def __init__(self, cfg, blocks: GGUFCheckpoint):
        super().__init__(cfg)
        self.blocks = blocks
        self.experts = {name for name, spec in family_of(cfg).ckpt.checkpoint_layout(cfg).items() if spec.routed_expert}
        for name in self.experts:
            info = self.tensors[name]
            self.tensors[name] = dataclasses.replace(info, dtype="F32", end=info.begin + 4 * math.prod(info.shape))

    def get(self, name):
        if name in self.experts:
            return gguf.quants.dequantize(self.blocks.get(name), Q[self.blocks.info(name).dtype])
        return super().get(name)


def test_decode_bench_gguf_geometry_holds_the_synthetic_weights(tmp_path, monkeypatch):
    """decode.py --format q4_k_m on a tiny DeepSeek-V3 geometry, on the CPU: the GGUF it writes, loaded by
    hybridjit.load, gives the logits of the synthetic checkpoint of that geometry with the file's experts
    dequantised (by the gguf package), up to the kernels' int8 activations (0.4% per matrix input; measured 6e-3
    over 2 MoE layers); a wrong tensor, transposition or metadata value moves them by order 1. Its
    experts read from the file have the spread of real weights, and the floor counts their blocks' bytes."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import decode
    from bench_model import load_model

    raw = tiny_config("v3", hidden_size=256, moe_intermediate_size=512)
    monkeypatch.setitem(GEOMETRIES, "tiny-v3", raw)
    args = argparse.Namespace(geometry="tiny-v3", checkpoint=None, layers=3, format="q4_k_m",
                              gguf_dir=str(tmp_path), keep_gguf=True)  # fmt: skip
    placement = Placement.default("float32", jax.devices("cpu")[0])
    path = decode.write_gguf_geometry(args)
    model, name, full = decode.load_gguf_geometry(path, args, placement)
    blocks = GGUFCheckpoint(path)
    reference, _, _ = load_model(args, placement, "bf16", synthetic=lambda cfg: DequantisedExperts(cfg, blocks))
    try:
        assert name == "tiny-v3 (q4_k_m GGUF, random weights)" and full.num_hidden_layers == raw["num_hidden_layers"]
        assert rel_rms(model.logits(PROMPT), reference.logits(PROMPT)) < 2e-2
        expert = reference._loader.ckpt
        for proj, fan_in in (("gate_proj", 256), ("down_proj", 512)):
            w = expert.get(f"model.layers.2.mlp.experts.5.{proj}.weight")
            assert abs(np.sqrt(np.mean(w**2)) * np.sqrt(fan_in) - 1) < 0.05
        q4_k, q6_k = gguf.GGML_QUANT_SIZES[Q.Q4_K], gguf.GGML_QUANT_SIZES[Q.Q6_K]
        assert decode.expert_bytes(model) == (2 * 512 * 256 // q4_k[0] * q4_k[1]  # gate and up, Q4_K
                                              + 256 * 512 // q6_k[0] * q6_k[1])  # down, Q6_K  # fmt: skip
    finally:
        model.close()
        reference.close()
