"""GGUF files against llama.cpp itself (issue #24): the tiny checkpoints of tests/gguf_factory.py, written as
llama.cpp's converter writes them, give the same logits in hybridjit and in llama.cpp (llama-cpp-python, CPU):
an independent whole-model reference for each architecture's names, layouts, metadata and maths.

Needs llama-cpp-python, which CI does not build; where it is installed:
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF
    -DLLAMA_BUILD_SERVER=OFF" pip wheel --no-deps llama_cpp_python==0.3.36  (then pip install the wheel)

How llama.cpp is run, and why:
- The files carry no tokenizer: `tokenizer.ggml.model = "none"` with `{arch}.vocab_size` (llama-vocab.cpp: a
  vocabulary of that many dummy tokens), since llama.cpp needs a vocabulary size to load token_embd.
- The KV cache is F32 (llama.cpp's default is F16: 3e-4 rel RMS of difference on its own).
- llama.cpp's extra CPU buffer types (`use_extra_bufts`) are off: on an AMX CPU they put Q8_0 matrices in its AMX
  buffer type (repacked), and with these tiny shapes the decode then crashes (segfault) for 2-D Q8_0 matrices and
  aborts with GGML_ASSERT(*cur_backend_id != -1) (ggml-backend.cpp) for a Q8_0 `attn_k_b`; llama.cpp's plain CPU
  kernels do the same maths.
- One sequence of token ids, all positions' logits (llama_decode with every token's logits flag set).
"""

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from checkpoint_factory import (
    FAMILY_CASES,
    build_case,
    checkpoint_as_float32,
    family_config,
    read_tensors,
    tiny_config,
    write_checkpoint,
    write_family_checkpoint,
)
from gguf_factory import ARCH, sentencepiece_metadata, sentencepiece_model, write_gguf, write_tokenizer_gguf

import hybridjit
from hybridjit.gguf_file import GGUFFile
from hybridjit.gguf_tokenizer import gguf_tokenizer
from hybridjit.ops.routed_experts import kernel_info, set_cpu_kernel
from hybridjit.resolve import default_model_dir

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (CI does not build it)")

Q = gguf.GGMLQuantizationType
PROMPT = [3, 5, 7, 11, 13, 2, 9, 4]  # as tests/test_gguf.py's
F32_BOUND = 1e-5


@pytest.fixture(autouse=True)
def generic_kernel():
    """The generic CPU kernels: float32 experts in float32, and one activation quantisation on every machine."""
    before = kernel_info()["kernel"]
    set_cpu_kernel("generic")
    yield
    set_cpu_kernel(before)


def rel_rms(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


def no_vocabulary(cfg: dict) -> dict:
    """Metadata for write_gguf's `tokenizer`: no tokenizer, a vocabulary of the embedding's rows."""
    arch = ARCH[cfg["model_type"]]
    return {
        "tokenizer.ggml.model": ("none", gguf.GGUFValueType.STRING),
        f"{arch}.vocab_size": (cfg["vocab_size"], gguf.GGUFValueType.UINT32),
    }


def llama_cpp_logits(path, tokens: list[int]) -> np.ndarray:
    """float32 logits [len(tokens), vocab] of one sequence, by llama.cpp on the CPU."""
    llama_cpp.llama_backend_init()
    model_params = llama_cpp.llama_model_default_params()
    model_params.n_gpu_layers = 0
    model_params.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
    assert model, f"llama.cpp could not load {path} (its log, in the captured stderr, says why)"
    ctx = batch = None
    try:
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = 64
        params.n_threads = params.n_threads_batch = 2
        params.type_k = params.type_v = llama_cpp.GGML_TYPE_F32
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        ctx = llama_cpp.llama_init_from_model(model, params)
        assert ctx, "llama.cpp could not make a context"
        batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, True
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(tokens)
        assert llama_cpp.llama_decode(ctx, batch) == 0
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(len(tokens), n_vocab)).copy()
    finally:
        if batch is not None:
            llama_cpp.llama_batch_free(batch)
        if ctx is not None:
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)


def hybridjit_logits(path, tokens: list[int]) -> np.ndarray:
    model = hybridjit.load(str(path), dtype="float32")
    try:
        return model.logits([tokens])[0]
    finally:
        model.close()


def both(path) -> tuple[np.ndarray, np.ndarray]:
    theirs = llama_cpp_logits(path, PROMPT)
    ours = hybridjit_logits(path, PROMPT)
    assert ours.shape == theirs.shape
    return ours, theirs


# --- float32 files: every architecture -----------------------------------------------------------------------
#
# Both run float32 throughout (F32 weights, F32 KV cache) in their own op order, exp and reductions: measured
# 3.9e-7 .. 9.1e-7 rel RMS over the 8 positions (qwen3moe 4.3e-7, llama 4.5e-7, minimax-m2 3.9e-7, glm4moe 4.2e-7
# with the loader fix, deepseek2: V3 9.1e-7, V3 unsplit kv_b 8.7e-7, V2-Lite 6.8e-7, V2 one group 7.6e-7). The
# bound 1e-5 is ten times that; a wrong convention is far above it (llama.cpp's F16 KV cache alone: 3e-4; V2's
# group ranking, below: 6.8e-2).


def family_case(name: str, tmp_path, **overrides) -> tuple[dict, dict]:
    case = FAMILY_CASES[name]
    cfg = family_config(case["preset"], **overrides)
    mtp = cfg.get("num_nextn_predict_layers", 0) > 0
    src = write_family_checkpoint(
        tmp_path / "hf", cfg, seed=case["seed"], weight_format=case["weight_format"], with_mtp_layer=mtp
    )
    return cfg, checkpoint_as_float32(src)


def golden_case(name: str, tmp_path) -> tuple[dict, dict]:
    src = build_case(name, tmp_path / "hf")
    return json.loads((src / "config.json").read_text()), checkpoint_as_float32(src)


def test_qwen3moe(tmp_path):
    """llama.cpp's qwen3moe has routed experts in every layer (qwen3moe.cpp requires each blk.L.ffn_gate_inp), so
    no mlp_only_layers here (the family preset's dense layer 1 would not load there); always renormalised top-k."""
    cfg, tensors = family_case("qwen3_moe_bf16", tmp_path, mlp_only_layers=[])
    ours, theirs = both(write_gguf(tmp_path / "m.gguf", cfg, tensors, tokenizer=no_vocabulary(cfg)))
    assert rel_rms(ours, theirs) <= F32_BOUND


def test_llama_arch_mixtral(tmp_path):
    """`llama` with experts: the converter's Q/K row permutation, undone by our loader, redone by llama.cpp's
    NORM rope (adjacent pairs)."""
    cfg, tensors = golden_case("mixtral_bf16", tmp_path)
    ours, theirs = both(write_gguf(tmp_path / "m.gguf", cfg, tensors, tokenizer=no_vocabulary(cfg)))
    assert rel_rms(ours, theirs) <= F32_BOUND


def test_minimax_m2(tmp_path):
    """MiniMax-M2 (FP8 checkpoint dequantised into an F32 file): q/k RMSNorm over all heads, partial rotary,
    sigmoid router with its correction bias."""
    cfg, tensors = golden_case("minimax_m2_fp8", tmp_path)
    ours, theirs = both(write_gguf(tmp_path / "m.gguf", cfg, tensors, tokenizer=no_vocabulary(cfg)))
    assert rel_rms(ours, theirs) <= F32_BOUND


def test_glm4moe_with_its_mtp_layer(tmp_path):
    """GLM-4.5 with a whole MTP layer after the decoder's (block_count 4, nextn_predict_layers 1): llama.cpp checks
    every tensor of that layer and skips it, as our loader does. The factory's checkpoint has only a few of that
    layer's tensors; the rest is layer 3 of the same preset built 4 layers deep."""
    cfg, tensors = family_case("glm4_moe_bf16", tmp_path)
    _, deeper = family_case("glm4_moe_bf16", tmp_path / "deeper", num_hidden_layers=4, num_nextn_predict_layers=0)
    assert "model.layers.3.eh_proj.weight" in tensors and "model.layers.3.mlp.experts.15.up_proj.weight" in deeper
    ours, theirs = both(write_gguf(tmp_path / "m.gguf", cfg, {**deeper, **tensors}, tokenizer=no_vocabulary(cfg)))
    assert rel_rms(ours, theirs) <= F32_BOUND


# DeepSeek: llama.cpp requires deepseek2.attention.q_lora_rank unless the layer count is that of a known "lite"
# model (27 or 26 layers, or 48 with a 128256 vocabulary: deepseek2.cpp load_arch_hparams), while the converter
# writes no key for V2-Lite's q_lora_rank null; the tiny V2-Lite says 0, which llama.cpp and our loader both read
# as "no q LoRA".
NO_Q_LORA = {"deepseek2.attention.q_lora_rank": (0, gguf.GGUFValueType.UINT32)}


@pytest.mark.parametrize(
    "case, kv_b",
    [
        ("v3_bf16", "split"),  # the converter's layout since MLA: k_b/v_b, one KV head, *_mla sizes
        ("v3_bf16", "kv_b"),  # older files: kv_b whole, multi-head attention
        ("v2_lite_greedy_bf16", "kv_b"),  # no q LoRA, softmax greedy routing, YaRN mscale 0.707
    ],
)
def test_deepseek2(tmp_path, case, kv_b):
    cfg, tensors = golden_case(case, tmp_path)
    metadata = {**no_vocabulary(cfg), **(NO_Q_LORA if not cfg.get("q_lora_rank") else {})}
    ours, theirs = both(write_gguf(tmp_path / "m.gguf", cfg, tensors, kv_b=kv_b, tokenizer=metadata))
    assert rel_rms(ours, theirs) <= F32_BOUND


def test_deepseek2_v2_yarn_mscale_and_group_ranking(tmp_path):
    """DeepSeek-V2's group-limited routing ranks each group by its best expert (transformers' group_limited_greedy,
    ours); llama.cpp ranks groups by their top-2 sum, V3's rule, for every deepseek2 file (llama-graph.cpp
    build_moe_ffn: ggml_argsort_top_k(selection_groups, 2) then ggml_sum_rows). With 4 groups of which 2 are kept
    the two differ (measured 6.8e-2; 1.0e-6 once our groups are ranked by top-2 sums); with one group the
    file agrees (7.6e-7): YaRN with yarn_log_multiplier 0.05 (mscale_all_dim 0.5) and softmax scores."""
    cfg = tiny_config("v2_group_limited")
    one_group = dict(cfg, n_group=1, topk_group=1)
    for config, agrees in ((one_group, True), (cfg, False)):
        src = write_checkpoint(tmp_path / f"hf{agrees}", config, seed=4, weight_format="bf16")
        metadata = no_vocabulary(config)
        path = write_gguf(
            tmp_path / f"m{agrees}.gguf", config, checkpoint_as_float32(src), kv_b="split", tokenizer=metadata
        )
        ours, theirs = both(path)
        assert rel_rms(ours, theirs) <= F32_BOUND if agrees else rel_rms(ours, theirs) > 1e-2


# --- quantised files ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expert_types, other_type, bound",
    [
        ((Q.Q4_K, Q.Q6_K), Q.F32, 3e-2),  # Q4_K_M's experts: measured 8.7e-3
        ((Q.Q2_K, Q.Q3_K), Q.F32, 3e-2),  # Q2_K's experts: measured 1.1e-2 (the quantisation itself: 0.23)
        ((Q.Q8_0, Q.Q8_0), Q.F32, 1.5e-2),  # measured 2.9e-3
        ((Q.Q8_0, Q.Q8_0), Q.Q8_0, 6e-2),  # a Q8_0 file: measured 2.5e-2
    ],
)
def test_quantised(tmp_path, expert_types, other_type, bound):
    """Quantised routed experts (our block-format kernels against llama.cpp's), on the V3 layout at sizes of whole
    K-quant super-blocks; in the last case every other matrix Q8_0 too (we dequantise those, llama.cpp runs them).

    The two quantise activations differently: ours int8 per 32 values with a float32 scale, for the expert
    matrices only; llama.cpp Q8_0 blocks (per 32, f16 scale) for Q8_0 weights and Q8_K (per 256) for K-quants,
    for every quantised matrix. Measured against the float32 logits of the same weights dequantised
    (gguf.quants.dequantize, written as an F32 file), per case: ours 4.8e-3, 4.9e-3, 4.8e-3; llama.cpp 7.9e-3,
    5.0e-3, 2.5e-2 (the last from its quantised activations of the attention, dense and output matrices). Ours
    against llama.cpp: 8.7e-3, 2.9e-3 (the same per-32 grouping: correlated roundings), 2.5e-2; with seeds 7, 10,
    11 instead of 8 up to 2.1e-2, 6.0e-3, 3.5e-2. Bounds: 2.4-5 times the measured values. The quantisation
    itself moves the logits by 4.4e-2, 6.2e-3, 2.8e-2: the Q8_0 cases catch wrong decoding (an O(1) error), not
    subtle ones; the Q4_K/Q6_K case is tighter than its quantisation.

    Every token takes all 16 experts (top-16, one group): with top-4, a near tie turns these ~1e-2 activation
    differences into a different expert for one token (measured 0.14-0.34 rel RMS at one position for 3 of 7
    seeds); routing is what the float32 tests above check."""
    cfg = tiny_config(
        "v3", hidden_size=256, moe_intermediate_size=256, intermediate_size=256, q_lora_rank=128, kv_lora_rank=64,
        n_group=1, topk_group=1, num_experts_per_tok=16,
    )  # fmt: skip
    src = write_checkpoint(tmp_path / "hf", cfg, seed=8, weight_format="f32")
    path = write_gguf(
        tmp_path / "m.gguf", cfg, checkpoint_as_float32(src), expert_types=expert_types, other_type=other_type,
        kv_b="split", tokenizer=no_vocabulary(cfg),
    )  # fmt: skip
    ours, theirs = both(path)
    assert rel_rms(ours, theirs) < bound
    assert rel_rms(hybridjit_logits(src, PROMPT), ours) > 2e-3  # the quantisation is there


def test_gpt_oss_mxfp4(tmp_path):
    """gpt-oss with its MXFP4 experts as stored (the converter's split of gate_up and ggml's block layout), sinks,
    biases, the router's bias and alternating sliding windows (4 of the 8 positions). Ours from the MXFP4 file
    against llama.cpp on an F32 file of the same weights dequantised: float32 on both sides (measured 1.2e-6); and
    llama.cpp on the MXFP4 file against that, which checks the blocks' layout against llama.cpp's own reading
    within its Q8_0 activations (measured 3.1e-2; a wrong nibble order or scale is O(1)). llama.cpp takes the
    swiglu limit as the release's 7 whatever the file says, hence 7 here; every token takes all 16 experts, so that
    llama.cpp's quantised activations cannot turn a near tie in top-4 into another expert.

    YaRN at factor 1 (no scaling): llama.cpp rounds YaRN's correction range to whole dimensions (ggml's
    rope_yarn_corr_dims floors and ceils it) where the release says `truncate: false` and transformers, as we, keeps
    it exact. At this case's factor 32 and original context 512 that alone differs by 5.5e-2 rel RMS (2.5e-4 with
    `truncate: true` in the checkpoint's config, which our GGUF reader does not take: a gpt-oss GGUF is the
    release, truncate false)."""
    case = FAMILY_CASES["gpt_oss_mxfp4"]
    cfg = family_config(case["preset"], swiglu_limit=7.0, num_experts_per_tok=16, experts_per_token=16)
    cfg["rope_scaling"] = dict(cfg["rope_scaling"], factor=1.0)
    src = write_family_checkpoint(tmp_path / "hf", cfg, seed=case["seed"], weight_format="mxfp4")
    stored = {n: t if t.dtype == np.uint8 else t.astype(np.float32) for n, t in read_tensors(src).items()}
    mxfp4 = write_gguf(tmp_path / "m.gguf", cfg, stored, tokenizer=no_vocabulary(cfg))
    f32 = write_gguf(tmp_path / "f.gguf", cfg, checkpoint_as_float32(src), tokenizer=no_vocabulary(cfg))
    theirs_f32 = llama_cpp_logits(f32, PROMPT)
    assert rel_rms(hybridjit_logits(mxfp4, PROMPT), theirs_f32) <= F32_BOUND
    assert rel_rms(llama_cpp_logits(mxfp4, PROMPT), theirs_f32) < 6e-2


# --- tokenizers -------------------------------------------------------------------------------------------------


def llama_cpp_tokens(path, text: str) -> list[int]:
    """llama.cpp's tokens of `text` (no BOS, special tokens as text), from the file's vocabulary alone."""
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    assert model, f"llama.cpp could not load {path}"
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        data = text.encode()
        out = (llama_cpp.llama_token * (len(data) + 8))()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), out, len(out), False, False)
        assert n >= 0
        return list(out[:n])
    finally:
        llama_cpp.llama_model_free(model)


PRE_TOKENIZER_TEXTS = [
    "HelloWorld don't 12345 a/b\n/x HTTPServer's",
    "  leading spaces\n\n\ttabs  and   runs \r\n end",
    "ÀBc café NAÏVE naïve 'S 'LL it'S I'M",
    "中文123和数字4567，日本語カタカナ",
    "emoji 🙂🙃 ok!!! ...?? (x)/[y]",
]


@pytest.mark.parametrize(
    "pre", ["gpt-4o", "minimax-m2", "glm4", "qwen2", "llama-bpe", "deepseek-v3", "kimi-k2", "gpt-2"]
)
def test_pre_tokenizers(tmp_path, pre):
    """A GGUF's byte-level BPE split by tokenizer.ggml.pre (hybridjit/gguf_tokenizer.py): the same tokens as
    llama.cpp's tokenizer on texts that cross each regex's cases (letter case runs, contractions, digits, CJK, spaces
    and newlines, punctuation). The vocabulary and merges are the embedded model's."""
    src = default_model_dir()
    cfg = json.loads((src / "config.json").read_text())
    hf = json.loads((src / "tokenizer.json").read_text())
    vocab = sorted(hf["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in hf["model"]["merges"]]
    S, A, I32 = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32
    tokenizer = {
        "tokenizer.ggml.model": ("gpt2", S),
        "tokenizer.ggml.pre": (pre, S),
        "tokenizer.ggml.tokens": ([t for t, _ in vocab], A, S),
        "tokenizer.ggml.token_type": ([1] * len(vocab), A, I32),
        "tokenizer.ggml.merges": (merges, A, S),
        "tokenizer.ggml.add_bos_token": (False, gguf.GGUFValueType.BOOL),
    }
    path = write_gguf(tmp_path / "t.gguf", cfg, checkpoint_as_float32(src), tokenizer=tokenizer)
    ours = gguf_tokenizer(GGUFFile(path))
    for text in PRE_TOKENIZER_TEXTS:
        assert ours.encode(text) == llama_cpp_tokens(path, text), text


def test_sentencepiece_tokenizer(tmp_path):
    """A "llama" (SentencePiece BPE, Mixtral's) GGUF tokenizer: llama.cpp's tokens, BOS aside, on texts with runs
    of spaces, newlines, digits and byte-fallback characters."""
    pytest.importorskip("sentencepiece")
    sp = sentencepiece_model((Path(__file__).parent.parent / "README.md").read_text())
    path = write_tokenizer_gguf(tmp_path / "t.gguf", "llama", sentencepiece_metadata(sp), sp.get_piece_size())
    ours = gguf_tokenizer(GGUFFile(path))
    for text in [*PRE_TOKENIZER_TEXTS, "Hello world", "  two  spaces\n\nnew\tline ", "ünïcödé 🙂"]:
        assert ours.encode(text)[1:] == llama_cpp_tokens(path, text), text
