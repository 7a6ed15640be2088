"""Stream-loaded prefill of GGUF models: the experts pinned as stored blocks, streamed and dequantised by XLA
(models/common/gguf_blocks.py), against gguf's own dequantiser and against the plain prefill of the same file with
its experts dequantised on the host (float32 XLA: exact math). Tolerances: the blocks bit-exact (the same float32
products); a whole model's logits and cache 1e-5 relative RMS (summation order, as tests/test_stream_prefill.py)."""

import json

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_factory import (
    checkpoint_as_float32,
    family_config,
    tiny_config,
    write_checkpoint,
    write_family_checkpoint,
)
from gguf_factory import write_gguf
from hybrid_placement import hybrid
from test_stream_prefill import (
    CHUNK,
    FLOAT32_RTOL,
    LENGTHS,
    cache_error,
    load_exact,
    new_cache,
    plain_prefill,
    rel_rms,
)

import hybridjit
from hybridjit import prefill_path
from hybridjit import stream_prefill as sp
from hybridjit.models.common.expert_storage import ExpertStorage
from hybridjit.synthetic_gguf import block_pool

Q = gguf.GGMLQuantizationType


def _stored_matrices(fmt: str, experts: int, rows: int, cols: int, seed: int):
    """Random valid blocks uint8 [experts, rows, row bytes] of a GGUF type and gguf's float32 dequantisation."""
    elements, nbytes = gguf.GGML_QUANT_SIZES[Q[fmt.upper()]]
    blocks = experts * rows * cols // elements
    stored = block_pool(fmt.upper(), cols, np.random.default_rng(seed), blocks * nbytes).reshape(experts, rows, -1)
    return stored, gguf.quants.dequantize(stored, Q[fmt.upper()])


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k", "q5_k", "q6_k", "q2_k", "q3_k", "iq4_xs"])
def test_blocks_dequantise_on_the_device_as_gguf_does(fmt):
    stored, expected = _stored_matrices(fmt, 3, 5, 512, seed=1)
    got = jax.jit(ExpertStorage(fmt).matrix, static_argnums=(2, 3))(stored, None, 512, jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), expected)


def test_q4_k_m_experts_take_down_in_its_own_type():
    """llama.cpp's Q4_K_M: gate and up Q4_K, down Q6_K (the bank's format "q4_k/q6_k")."""
    d, f = 256, 512
    (gate, gate_f), (up, up_f) = (_stored_matrices("q4_k", 2, f, d, seed) for seed in (2, 3))
    down, down_f = _stored_matrices("q6_k", 2, d, f, seed=4)
    experts = jax.jit(ExpertStorage("q4_k/q6_k").experts, static_argnums=(1, 2, 3))((gate, up, down), None, None,
                                                                                     jnp.float32)
    for got, expected in ((experts.gate, gate_f), (experts.up, up_f), (experts.down, down_f)):
        np.testing.assert_array_equal(np.asarray(got), expected)


# Family, the checkpoint's config, the experts' (gate/up, down) types: DeepSeek's MLA with Q4_K_M's experts; Qwen3's
# GQA with Q8_0 (rows of whole blocks: the moe intermediate widened to 64).
CASES = {
    "deepseek_v3-q4_k_m": (lambda: tiny_config("v3", hidden_size=256, moe_intermediate_size=256), (Q.Q4_K, Q.Q6_K)),
    "qwen3_moe-q8_0": (lambda: family_config("qwen3_moe", moe_intermediate_size=64), (Q.Q8_0, Q.Q8_0)),
}


@pytest.fixture(scope="module", params=list(CASES))
def gguf_path(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    config, types = CASES[request.param]
    config = config()
    deepseek = request.param.startswith("deepseek")
    write, released = (write_checkpoint, "f32") if deepseek else (write_family_checkpoint, "bf16")
    src = write(directory / "hf", config, seed=9, weight_format=released)
    cfg = json.loads((src / "config.json").read_text())
    kv_b = "split" if deepseek else "kv_b"
    return write_gguf(directory / "m.gguf", cfg, checkpoint_as_float32(src), expert_types=types, kv_b=kv_b)


def test_streamed_prefill_of_a_gguf_matches_the_plain_prefill(gguf_path):
    with hybridjit.load(str(gguf_path), placement=hybrid("float32", pinned_experts=True)) as model:
        with load_exact(gguf_path, model.config.num_hidden_layers) as exact:
            tokens = np.random.default_rng(0).integers(2, model.config.vocab_size, (2, 24)).astype(np.int32)
            ref_logits, ref_cache = plain_prefill(exact, tokens)
            assert prefill_path.choose_prefill_path(model, 2, 24, threshold=1) == "stream"
            stats = sp.StreamStats()
            logits, cache = sp.stream_prefill(model, tokens, LENGTHS, new_cache(model, 2), stats=stats,
                                              attention_chunk=CHUNK)
            assert rel_rms(logits, ref_logits) < FLOAT32_RTOL
            assert cache_error(cache, ref_cache) < FLOAT32_RTOL
            assert stats.streamed_bytes == sum(layer.nbytes for layer in sp.pinned_layers(model.weights).values())
