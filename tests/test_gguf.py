"""GGUF files (issue #24): the block-format expert kernels against float64 numpy on gguf's own dequantisation,
every family's tiny checkpoint written as GGUF (llama.cpp's names and layout, tests/gguf_factory.py) against
the same weights from safetensors, a GGUF's tokenizer, and bad files."""

import dataclasses
import json
import re
import shutil
from functools import partial
from pathlib import Path

import gguf
import jax
import ml_dtypes
import numpy as np
import pytest
from checkpoint_factory import build_case, checkpoint_as_float32, read_tensors, tiny_config, write_checkpoint
from gguf_factory import quantize, sentencepiece_metadata, sentencepiece_model, write_gguf, write_tokenizer_gguf
from kernel_choice import kernel_family
from safetensors.numpy import save_file

import hybridjit
from hybridjit.checkpoint import CheckpointError
from hybridjit.gguf_checkpoint import GGUFCheckpoint
from hybridjit.gguf_file import GGUFFile
from hybridjit.gguf_tokenizer import _pre_tokenizer, gguf_tokenizer
from hybridjit.ops.gguf_experts import mxfp4_from_ggml, register_gguf_layer
from hybridjit.ops.routed_experts import kernel_info, layer_kernel, routed_experts_host, set_cpu_kernel
from hybridjit.placement import Placement
from hybridjit.quant import dequantize_mxfp4
from hybridjit.resolve import default_model_dir
from hybridjit.serving.chat import ChatTemplate
from hybridjit.tokenizer import Tokenizer

Q = gguf.GGMLQuantizationType
KERNELS = [k for k in ("generic", "avx2", "avx512", "amx") if k in kernel_info()["supported"]]
# (family, amx_min_tokens) for the kernel tests: every family; with amx, AMX forced at every token count (the GGUF
# blocks dequantised into bfloat16 tiles) and the per-layer crossover (a call's experts on AVX-512 below it, AMX from
# it), which mixes both in one call.
FAMILY_CHOICES = [pytest.param(k, 1, id=k) for k in KERNELS]
if "amx" in KERNELS:
    FAMILY_CHOICES.append(pytest.param("amx", 0, id="amx-crossover"))
FAMILY_CASES = ["v3_bf16", "v2_lite_greedy_bf16", "qwen3_moe_bf16", "mixtral_bf16", "glm4_moe_bf16", "minimax_m2_fp8"]
PROMPT = [[3, 5, 7, 11, 13, 2, 9, 4]]


@pytest.fixture
def kernel():
    before = kernel_info()["kernel"]
    yield set_cpu_kernel
    set_cpu_kernel(before)


def rel_rms(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


# --- kernels ------------------------------------------------------------------------------------------------


def activation_group(types, kernel: str) -> int:
    """The activations' quantisation group of an expert run by `kernel` (GgufActivationGroup): the avx512 family's
    kernels (blocks split in registers, or register tiles) with a K-quant in the layer quantise per 256 (as
    llama.cpp's Q8_K); the others per 32."""
    return 256 if kernel in ("avx512", "avx512_tiles") and set(types) != {Q.Q8_0} else 32


def quantized_activations(x: np.ndarray, group: int = 32) -> np.ndarray:
    """x as the kernels quantise it (expert_kernels.h): int8 per `group`, scale amax / 127, round half to even."""
    g = x.astype(np.float32).reshape(-1, group)
    amax = np.abs(g).max(axis=1, keepdims=True)
    q = np.rint(g * (np.float32(127) / np.where(amax > 0, amax, 1)))
    return (q * (amax / np.float32(127))).astype(np.float64).reshape(x.shape)


def bf16_rounded(x: np.ndarray) -> np.ndarray:
    """x (float32 first) rounded to bfloat16, to nearest even: AMX's activations and dequantised weights."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def random_blocks(qtype: Q, rows: int, cols: int, rng) -> np.ndarray:
    """Blocks of random bytes with finite, small fp16 scales: every code and sign (negative Q6_K and Q3_K scales,
    Q4_K and Q2_K mins) appears; a few blocks get zero scales."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(rows, cols // block, nbytes), dtype=np.uint8)
    scale_at = {Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.Q2_K: [80, 82], Q.Q3_K: [108],
                Q.IQ4_XS: [0]}[qtype]  # fmt: skip
    for at in scale_at:
        d = (rng.random((rows, cols // block)) * (0.0005 if qtype == Q.Q6_K else 0.02)).astype(np.float16)
        d[0, 0] = 0  # a zero scale
        b[..., at : at + 2] = d.view(np.uint8).reshape(rows, cols // block, 2)
    return b.reshape(rows, -1)


def reference_moe(gate, up, down, types, x, ids, weights, bf16_experts=frozenset(), groups=None) -> np.ndarray:
    """float64 on gguf.quants.dequantize'd weights and activations quantised as the kernels do: int8 per
    groups[expert] elements (32 where not given; the AVX-512 and generic kernels), or for the experts in
    `bf16_experts` (run on AMX) weights and activations rounded to bfloat16."""

    def w(blocks, qtype, bf16):
        dense = gguf.quants.dequantize(blocks, qtype)  # float32, as the kernels compute the weights
        return bf16_rounded(dense) if bf16 else dense.astype(np.float64)

    dense = {}
    y = np.zeros(x.shape)
    for t in range(len(x)):
        for e, p in zip(ids[t], weights[t], strict=True):
            bf16 = int(e) in bf16_experts
            if e not in dense:
                dense[e] = (w(gate[e], types[0], bf16), w(up[e], types[0], bf16), w(down[e], types[1], bf16))
            g_w, u_w, d_w = dense[e]
            prepare = bf16_rounded if bf16 else partial(quantized_activations, group=(groups or {}).get(int(e), 32))
            xq = prepare(x[t])
            g, u = g_w @ xq, u_w @ xq
            with np.errstate(over="ignore"):  # exp(-g) is inf for g < -709: silu(g) is then -0, as it should be
                act = (g / (1 + np.exp(-g)) * u).astype(np.float32)
            y[t] += p * (d_w @ prepare(act))
    return y


def check_gguf_layer(types, hidden, inter, tokens, seed, int8_tolerance=2e-5, n_experts=4, top_k=2):
    """Random GGUF experts run on `tokens` tokens under the current kernel selection, against reference_moe with
    each expert's arithmetic: the kernel that ran it by its token count (layer_kernel)."""
    rng = np.random.default_rng(seed)
    gate = [random_blocks(types[0], inter, hidden, rng) for _ in range(n_experts)]
    up = [random_blocks(types[0], inter, hidden, rng) for _ in range(n_experts)]
    down = [random_blocks(types[1], hidden, inter, rng) for _ in range(n_experts)]
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids = rng.integers(0, n_experts, size=(tokens, top_k)).astype(np.int32)
    weights = rng.random((tokens, top_k)).astype(np.float32)
    counts = np.bincount(ids.ravel(), minlength=n_experts)
    with register_gguf_layer(
        gate, up, down, gguf_type=types[0].name, down_type=types[1].name, hidden=hidden, inter=inter
    ) as layer:
        kernels = {e: layer_kernel(layer, int(c)) for e, c in enumerate(counts) if c > 0}
        y = routed_experts_host(layer, x, ids, weights)
    amx = frozenset(e for e, k in kernels.items() if k.startswith("amx"))
    # int8 activations: float32 sums of exact integer dot products, ~1e-6 of the output's scale (measured 1e-7 to
    # 3e-7 here, per 256 or per 32 elements; unemulated, the activations' quantisation alone would be 3e-3 to 3e-2
    # at these sizes). AMX's bfloat16:
    # float32 sums (~1e-7), plus the occasional silu(g) * u that float32 and float64 round to neighbouring bfloat16
    # values (up to ~5e-4 each), as tests/test_cpu_kernels.py's bf16 tolerance. A wrong scale, min or offset is
    # order 1.
    tolerance = 1e-3 if amx else int8_tolerance
    groups = {e: activation_group(types, k) for e, k in kernels.items()}
    error = rel_rms(y, reference_moe(gate, up, down, types, x, ids, weights, amx, groups))
    assert error < tolerance, f"{sorted(set(kernels.values()))}: relative RMS error {error:.3g} >= {tolerance:.3g}"
    return kernels


@pytest.mark.parametrize("cpu_kernel, amx_min_tokens", FAMILY_CHOICES)
@pytest.mark.parametrize(
    "types, hidden, inter",
    [
        ((Q.Q8_0, Q.Q8_0), 96, 160),  # Q8_0 rows need only multiples of 32 (96: a half 64-byte chunk)
        ((Q.Q8_0, Q.Q8_0), 352, 288),  # whole 256-element steps of the few-token kernel, then 3 or 1 blocks
        ((Q.Q4_K, Q.Q4_K), 512, 256),  # K-quant rows are whole 256-element super-blocks
        ((Q.Q5_K, Q.Q5_K), 256, 512),
        ((Q.Q6_K, Q.Q6_K), 512, 256),
        ((Q.Q4_K, Q.Q6_K), 256, 256),  # Q4_K_M's mix: down in Q6_K
        ((Q.Q2_K, Q.Q2_K), 512, 256),
        ((Q.Q3_K, Q.Q3_K), 256, 512),
        ((Q.Q2_K, Q.Q3_K), 256, 256),  # Q2_K's and Q3_K_S's mixes: down a size up
        ((Q.Q3_K, Q.Q4_K), 512, 256),
        ((Q.IQ4_XS, Q.IQ4_XS), 256, 512),
        ((Q.IQ4_XS, Q.Q6_K), 512, 256),
    ],
)
@pytest.mark.parametrize("tokens", [1, 5, 40])  # VNNI: 1-4 tokens an expert in one pass; more, four at a time
def test_kernels_match_float64_on_gguf_dequantisation(cpu_kernel, amx_min_tokens, types, hidden, inter, tokens):
    with kernel_family(cpu_kernel, amx_min_tokens):
        kernels = check_gguf_layer(types, hidden, inter, tokens, hash(types) % 2**32)
    if cpu_kernel == "amx" and amx_min_tokens == 1:
        assert set(kernels.values()) == {"amx_bf16"}


@pytest.mark.skipif("avx512" not in KERNELS, reason="the tile kernel is the avx512 family's")
@pytest.mark.parametrize(
    "types, hidden, inter",
    [
        ((Q.Q8_0, Q.Q8_0), 512, 256),
        ((Q.Q4_K, Q.Q6_K), 256, 512),
        ((Q.Q5_K, Q.Q5_K), 512, 256),
        ((Q.Q2_K, Q.Q3_K), 256, 512),
        ((Q.IQ4_XS, Q.IQ4_XS), 512, 256),
    ],
)
@pytest.mark.parametrize("tokens", [1, 17, 70])  # one token a 16-token tile; tiles with padded lanes; several
def test_the_tile_kernel_at_any_token_count_matches_float64(types, hidden, inter, tokens):
    """The avx512 family's register-tile kernel forced at every token count: padding lanes of a partial 16-token
    tile contribute nothing, every format's codes, scales and mins as the few-token kernel's."""
    with kernel_family("avx512", gguf_tile_min_tokens=1):
        kernels = check_gguf_layer(types, hidden, inter, tokens, hash((types, tokens)) % 2**32, int8_tolerance=5e-5)
    assert set(kernels.values()) == {"avx512_tiles"}


# AMX at sizes that take its blocking apart: rows in several 128-row strips with a partial last one (Q8_0's 352 and
# 1120: multiples of 32 only), rows of several 512-element strips with a partial last one (1120 = 2 x 512 + 96, 352,
# 768 = 512 + one super-block), and more tokens per expert than one 32-token block.
@pytest.mark.parametrize("cpu_kernel, amx_min_tokens", [c for c in FAMILY_CHOICES if c.id in ("avx512", "amx")])
@pytest.mark.parametrize(
    "types, hidden, inter",
    [
        ((Q.Q8_0, Q.Q8_0), 1120, 352),
        ((Q.Q4_K, Q.Q6_K), 768, 512),
        ((Q.Q5_K, Q.Q5_K), 256, 768),
        ((Q.Q2_K, Q.Q3_K), 768, 512),
        ((Q.IQ4_XS, Q.IQ4_XS), 1280, 768),
    ],  # fmt: skip
)
def test_gguf_kernels_at_blocking_sizes(cpu_kernel, amx_min_tokens, types, hidden, inter):
    with kernel_family(cpu_kernel, amx_min_tokens):
        # int8: at these sizes some silu(g) * u lands on the other side of an int8 rounding boundary than in float64
        # (one costs ~3e-5 here), as tests/test_cpu_kernels.py's int8 tolerance allows for
        kernels = check_gguf_layer(types, hidden, inter, 150, hash((types, hidden)) % 2**32, int8_tolerance=2e-4)
    # 150 tokens an expert: on AVX-512 the register-tile kernel where the rows are whole 256-element steps
    tiles = hidden % 256 == 0 and inter % 256 == 0
    assert set(kernels.values()) == {"amx_bf16" if cpu_kernel == "amx" else "avx512_tiles" if tiles else "avx512"}


@pytest.mark.skipif("amx" not in KERNELS, reason="this host has no AMX; the switch runs on the AMX machine")
def test_gguf_experts_move_to_amx_at_the_measured_crossover():
    """With the measured crossover, up to 11 tokens per expert stay on the VNNI kernel that splits blocks in registers
    four tokens at a time, and AMX takes over from 12 (ffi/moe_operator.cc)."""
    rng = np.random.default_rng(3)
    for types in [(Q.Q8_0, Q.Q8_0), (Q.Q4_K, Q.Q6_K), (Q.Q5_K, Q.Q5_K)]:
        blocks = [random_blocks(types[i], 256, 256, rng) for i in (0, 0, 1)]
        with register_gguf_layer(
            *([b] for b in blocks), gguf_type=types[0].name, down_type=types[1].name, hidden=256, inter=256
        ) as layer:
            with kernel_family("amx", amx_min_tokens=0):
                kernels = [layer_kernel(layer, t) for t in (1, 4, 11, 12, 512)]
                assert kernels == ["avx512", "avx512", "avx512", "amx_bf16", "amx_bf16"]


def test_kernel_rejects_rows_that_are_not_whole_blocks():
    rows = np.zeros((32, 144), np.uint8)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        register_gguf_layer([rows], [rows], [rows], gguf_type="Q4_K", hidden=200, inter=32)


def test_own_k_quantiser_agrees_with_gguf_dequantize():
    """The test writer's K-quant blocks decode (by the gguf package) to within their format's step (normal weights:
    Q2_K measured 0.33, Q3_K 0.20)."""
    w = np.random.default_rng(5).standard_normal((8, 512)).astype(np.float32)
    w[0, :32] = 0  # a zero sub-block
    for qtype, bound in ((Q.Q4_K, 0.1), (Q.Q6_K, 0.03), (Q.Q2_K, 0.4), (Q.Q3_K, 0.25)):
        assert rel_rms(gguf.quants.dequantize(quantize(w, qtype), qtype), w) < bound


# --- whole models -------------------------------------------------------------------------------------------


def logits(path, **kwargs):
    model = hybridjit.load(str(path), dtype="float32", **kwargs)
    try:
        return model.logits(PROMPT)
    finally:
        model.close()


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_float_gguf_of_every_family_matches_safetensors(tmp_path, kernel, case):
    """F32 GGUF (llama.cpp's names, stacked experts, Mixtral's permuted Q/K, DeepSeek's split kv_b, GLM's MTP
    layer) gives the safetensors checkpoint's logits; the generic kernels run both in float32."""
    kernel("generic")
    src = build_case(case, tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    path = write_gguf(tmp_path / "m.gguf", cfg, checkpoint_as_float32(src), kv_b="split" if "v3" in case else "kv_b")
    assert rel_rms(logits(path), logits(src)) <= 1e-5


def test_bf16_experts_stay_in_place_and_split_files_load(tmp_path):
    src = build_case("v3_bf16", tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    tensors = checkpoint_as_float32(src)
    path = write_gguf(
        tmp_path / "m.gguf", cfg, tensors, expert_types=(Q.BF16, Q.BF16), kv_b="both", split_max_tensors=40
    )
    assert path.name.startswith("m-00001-of-") and len(GGUFFile(path).parts) > 1
    ckpt = GGUFCheckpoint(path)
    expert = ckpt.get("model.layers.1.mlp.experts.3.down_proj.weight")
    assert isinstance(expert.base, np.memmap) or isinstance(expert.base.base, np.memmap)  # a view, no copy
    np.testing.assert_array_equal(
        expert.astype(np.float32), read_tensors(src)["model.layers.1.mlp.experts.3.down_proj.weight"].astype(np.float32)
    )
    assert rel_rms(logits(path), logits(src)) <= 1e-5  # the same bf16 experts, the same kernels


@pytest.mark.parametrize(
    "arithmetic", ["int8", pytest.param("bf16", marks=pytest.mark.skipif("amx" not in KERNELS, reason="no AMX"))]
)
@pytest.mark.parametrize("types", [(Q.Q4_K, Q.Q6_K), (Q.Q2_K, Q.Q3_K)], ids=["q4_k_m", "q2_k"])
def test_quantised_gguf_within_its_quantisation(tmp_path, arithmetic, types):
    """Q4_K gate/up and Q6_K down (Q4_K_M's experts; or Q2_K's Q2_K and Q3_K), Q8_0 attention: the logits of the same
    weights dequantised (by the gguf package) into safetensors, up to the kernels' rounding of what they multiply:
    int8 activations per 256 elements on the avx512 family, per 32 in plain C++ (compounded over 3 MoE layers:
    1.6-2.4e-2 a token; 1.1e-2 when all were per 32), or on AMX bfloat16 weights and activations (3.9e-3); bound
    3e-2 a token. One token may tip: a routing decision of this tiny random model sits near its edge, and with every
    expert's activations per 256 the last token's logits move by 0.51 (as by 0.45 with the arithmetic mixed, AMX
    from 5 tokens per expert and the VNNI kernel below). One arithmetic for every expert."""
    family, min_tokens = ("amx", 1) if arithmetic == "bf16" else (kernel_info()["kernel"], 2**40)
    with kernel_family(family, amx_min_tokens=min_tokens):
        check_quantised_gguf(tmp_path, types)


def check_quantised_gguf(tmp_path, types):
    cfg = tiny_config("v3", hidden_size=256, moe_intermediate_size=256)
    src = write_checkpoint(tmp_path / "hf", cfg, seed=7, weight_format="f32")
    tensors = checkpoint_as_float32(src)
    path = write_gguf(tmp_path / "m.gguf", cfg, tensors, expert_types=types)
    ckpt = GGUFCheckpoint(path)
    dequantised = {
        name: ckpt.get(name)
        if not ckpt.info(name).dtype.startswith("Q")
        else gguf.quants.dequantize(ckpt.get(name), Q[ckpt.info(name).dtype])
        for name in ckpt.tensors
    }
    ref_dir = tmp_path / "dequantised"
    write_checkpoint(ref_dir, cfg, seed=7, weight_format="f32")
    for f in ref_dir.glob("*.safetensors"):
        f.unlink()
    (ref_dir / "model.safetensors.index.json").unlink()
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in dequantised.items()}, str(ref_dir / "m.safetensors"))
    ours, dequantised_logits = (np.asarray(logits(p), np.float64) for p in (path, ref_dir))
    ours, dequantised_logits = (a.reshape(-1, a.shape[-1]) for a in (ours, dequantised_logits))
    per_token = np.linalg.norm(ours - dequantised_logits, axis=1) / np.linalg.norm(dequantised_logits, axis=1)
    assert np.all(np.isfinite(per_token)) and np.sum(per_token >= 3e-2) <= 1, per_token
    assert rel_rms(logits(path), logits(src)) > 1e-4  # the quantisation is there
    # A placement that pins routed experts (a GPU's default) copies the GGUF blocks into the pinned host copy, which
    # the CPU kernels then read: the same logits. Both on the CPU (on a GPU host the default placement would also
    # make experts resident on the GPU).
    on_cpu = Placement.default("float32", jax.devices("cpu")[0])
    pinning = dataclasses.replace(on_cpu, pinned_experts=True)
    assert np.array_equal(logits(path, placement=pinning), logits(path, placement=on_cpu))


def test_embedded_model_as_gguf_generates_with_its_own_tokenizer(tmp_path):
    """The embedded model and its byte-level BPE tokenizer as one GGUF file: same tokens, same text."""
    src = default_model_dir()
    cfg = json.loads((src / "config.json").read_text())
    hf = json.loads((src / "tokenizer.json").read_text())
    vocab = sorted(hf["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in hf["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in hf["model"]["merges"]]
    S, A, U32 = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32
    tokenizer = {
        "tokenizer.ggml.model": ("gpt2", S),
        "tokenizer.ggml.pre": ("gpt2", S),
        "tokenizer.ggml.tokens": ([t for t, _ in vocab], A, S),
        "tokenizer.ggml.token_type": ([3 if t in special else 1 for t, _ in vocab], A, U32),
        "tokenizer.ggml.merges": (merges, A, S),
        "tokenizer.ggml.add_bos_token": (True, gguf.GGUFValueType.BOOL),  # as the checkpoint's tokenizer_config.json
        "tokenizer.chat_template": (json.loads((src / "tokenizer_config.json").read_text())["chat_template"], S),
    }
    path = write_gguf(tmp_path / "default.gguf", cfg, read_and_float(src), tokenizer=tokenizer)
    ours, reference = gguf_tokenizer(GGUFFile(path)), Tokenizer(src, cfg.get("bos_token_id"))
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)  # ünïcode"
    assert ours.encode(text) == reference.encode(text)
    a, b = hybridjit.load(), hybridjit.load(str(path))
    try:
        assert b.generate("def add(a, b):", max_new_tokens=12) == a.generate("def add(a, b):", max_new_tokens=12)
        # A GGUF alone serves chat: its template renders as the checkpoint directory's does.
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a stack"}]
        assert ChatTemplate.of_model(b).render(messages) == ChatTemplate.of_model(a).render(messages)
    finally:
        a.close()
        b.close()


def read_and_float(directory):
    return {k: np.asarray(v, np.float32) for k, v in read_tensors(directory).items()}


def test_info_describes_a_gguf(tmp_path, capsys):
    from hybridjit.cli import main

    src = build_case("qwen3_moe_bf16", tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    path = write_gguf(tmp_path / "q.gguf", cfg, checkpoint_as_float32(src), expert_types=(Q.BF16, Q.BF16))
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "model type      qwen3_moe" in out and "BF16" in out
    assert "format          GGUF, routed experts as stored: down_proj BF16, gate_proj BF16, up_proj BF16\n" in out


# --- bad files ----------------------------------------------------------------------------------------------


@pytest.fixture
def small_gguf(tmp_path):
    src = build_case("mixtral_bf16", tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    return cfg, checkpoint_as_float32(src)


def test_truncated_file(tmp_path, small_gguf):
    path = write_gguf(tmp_path / "m.gguf", *small_gguf)
    data = path.read_bytes()
    last = gguf.GGUFReader(path).tensors[-1]
    end = int(last.data_offset) + int(last.n_bytes)
    path.write_bytes(data[: end - 1000])
    message = f"{path}: truncated: tensor {last.name} ends at byte {end} but the file has {end - 1000} bytes"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        GGUFCheckpoint(path)
    path.write_bytes(data[:20])
    with pytest.raises(CheckpointError, match=r"m\.gguf: not a readable GGUF file"):
        GGUFCheckpoint(path)


def test_unknown_architecture(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "x.gguf", "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(CheckpointError, match=r"x\.gguf: architecture 'mamba' is not supported; supported .*deepseek2"):
        GGUFCheckpoint(tmp_path / "x.gguf")


def test_expert_type_without_kernel(tmp_path):
    src = build_case("qwen3_moe_bf16", tmp_path / "hf")  # hidden 96: whole Q4_0 blocks of 32
    cfg = json.loads((src / "config.json").read_text())
    path = write_gguf(tmp_path / "m.gguf", cfg, checkpoint_as_float32(src), expert_types=(Q.Q4_0, Q.F32))
    with pytest.raises(
        CheckpointError,
        match=r"tensor blk\.0\.ffn_gate_exps\.weight: routed experts stored as Q4_0, "
        r"which no CPU kernel runs; supported: F32, BF16, F16 \(converted to BF16\), Q8_0, Q4_K",
    ):
        GGUFCheckpoint(path)


def test_split_set_with_a_missing_part(tmp_path, small_gguf):
    first = write_gguf(tmp_path / "m.gguf", *small_gguf, split_max_tensors=10)
    second = first.with_name(first.name.replace("-00001-", "-00002-"))
    shutil.move(second, tmp_path / "elsewhere.gguf")
    with pytest.raises(CheckpointError, match=r"split set of \d files lacks m-00002-of-0000\d\.gguf"):
        GGUFCheckpoint(first)


# --- gpt-oss: MXFP4 experts as llama.cpp's converter writes them ------------------------------------------------


def gpt_oss_gguf(tmp_path, expert_types=(Q.F32, Q.F32)):
    """The gpt-oss case's checkpoint and the same as GGUF: its MXFP4 blocks as stored, the rest float32."""
    src = build_case("gpt_oss_mxfp4", tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    raw = read_tensors(src)
    tensors = {n: t if t.dtype == np.uint8 else t.astype(np.float32) for n, t in raw.items()}
    return src, raw, write_gguf(tmp_path / "m.gguf", cfg, tensors, expert_types=expert_types)


def test_ggml_mxfp4_blocks_in_the_release_layout():
    """ggml's MXFP4 blocks, random nibble bytes and scales, over more blocks than one task of the pool takes: gguf's
    own dequantisation of them is the release layout's."""
    rng = np.random.default_rng(11)
    stored = np.frombuffer(rng.bytes(3 * 50_000 * 17), np.uint8).reshape(3, 50_000 * 17).copy()
    stored.reshape(-1, 17)[:, 0] = rng.integers(0, 251, stored.size // 17)  # from 251, 6 * 2^(s - 127) overflows
    blocks, scales = mxfp4_from_ggml(stored)
    assert blocks.shape == (3, 50_000, 16) and scales.shape == (3, 50_000)
    np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales), gguf.quants.dequantize(stored, Q.MXFP4))


def test_gpt_oss_gguf_rebuilds_the_released_experts_and_matches_safetensors(tmp_path):
    """ggml's MXFP4 blocks (gguf's own dequantisation is the reference of their layout) rebuilt into the release's
    fused gate_up / down tensors, bit for bit; then the whole model's logits equal the safetensors checkpoint's."""
    src, raw, path = gpt_oss_gguf(tmp_path)
    ckpt = GGUFCheckpoint(path)
    assert ckpt.config.model_type == "gpt_oss" and ckpt.config.layer_types == (
        "sliding_attention", "full_attention", "sliding_attention"
    )  # fmt: skip
    assert ckpt.config.sliding_window == 4 and ckpt.config.rope.yarn_factor == 32.0
    for layer in range(ckpt.config.num_hidden_layers):
        for fused, parts in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
            name = f"model.layers.{layer}.mlp.experts.{fused}"
            for part in ("blocks", "scales", "bias"):
                np.testing.assert_array_equal(
                    ckpt.get(f"{name}_{part}"), raw[f"{name}_{part}"].astype(ckpt.get(f"{name}_{part}").dtype)
                )
            stored = [GGUFFile(path).tensors[f"blk.{layer}.ffn_{p}_exps.weight"] for p in parts]
            by_gguf = [gguf.quants.dequantize(t.data.reshape(*t.shape[:-1], t.row_bytes), Q.MXFP4) for t in stored]
            ours = dequantize_mxfp4(ckpt.get(f"{name}_blocks"), ckpt.get(f"{name}_scales"))
            for i, reference in enumerate(by_gguf):
                np.testing.assert_array_equal(ours[:, i :: len(by_gguf)], reference)
    assert rel_rms(logits(path), logits(src)) <= 1e-5


def test_gpt_oss_gguf_experts_other_than_mxfp4(tmp_path):
    src = build_case("gpt_oss_mxfp4", tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    tensors = {n: t.astype(np.float32) for n, t in checkpoint_as_float32(src).items()}
    path = write_gguf(tmp_path / "m.gguf", cfg, tensors)
    with pytest.raises(CheckpointError, match=r"gpt-oss routed experts stored as F32; supported: MXFP4"):
        GGUFCheckpoint(path)


def test_o200k_pre_tokenizer_of_gpt_oss_and_minimax_gguf():
    """llama.cpp's "gpt-4o" / "minimax-m2" split (o200k's): letter runs end where case turns, a contraction stays
    on its word, digits go by three, a "/" that follows punctuation or a newline stays with what follows."""
    for pre in ("gpt-4o", "minimax-m2"):
        split = [p for p, _ in _pre_tokenizer(pre).pre_tokenize_str("HelloWorld don't 12345 a/b")]
        assert split == ["Hello", "World", "Ġdon't", "Ġ", "123", "45", "Ġa", "/b"]


# --- SentencePiece ("llama") tokenizers: Mixtral's -------------------------------------------------------------


SENTENCEPIECE_TEXTS = [
    "Hello world",
    "  two  spaces\n\nnew\tline ",
    "numbers 12345 and 3.14",
    "ünïcödé 中文 🙂 (bytes of pieces it never saw)",
]


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory):
    """A SentencePiece model trained as Llama's and Mixtral's are, and a GGUF holding its vocabulary as llama.cpp's
    converter writes it: (model, file)."""
    pytest.importorskip("sentencepiece")
    sp = sentencepiece_model((Path(__file__).parent.parent / "README.md").read_text())
    path = tmp_path_factory.mktemp("spm") / "t.gguf"
    return sp, write_tokenizer_gguf(path, "llama", sentencepiece_metadata(sp), sp.get_piece_size())


def test_sentencepiece_gguf_tokenizer_matches_sentencepiece(sentencepiece_gguf):
    """A "llama" GGUF tokenizer gives sentencepiece's own tokens (BOS first) and text back, on texts with runs of
    spaces, newlines, tabs, digits and characters only byte fallback covers; and on a 2,000-character passage."""
    sp, path = sentencepiece_gguf
    ours = gguf_tokenizer(GGUFFile(path))
    passage = (Path(__file__).parent.parent / "README.md").read_text()[:2000]
    for text in [*SENTENCEPIECE_TEXTS, passage]:
        ids = ours.encode(text)
        assert ids == [sp.bos_id(), *sp.encode(text)], text
        assert ours.decode(ids) == sp.decode(ids) == text
