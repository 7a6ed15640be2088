"""The embedded default model, loaded through the public API: deterministic, and a real language model
of Python source (held-out perplexity far below the ~600 of a unigram model; a broken model is far above)."""

import math
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

import hybridjit
from hybridjit.models.stdlib_corpus import corpus_files, token_stream
from hybridjit.resolve import default_model_dir

# Measured on 48 windows of 256 held-out tokens: BF16 36.6, FP8 36.6, unigram baseline 605 (bench/quality.py).
PERPLEXITY_BOUND = 60.0
FP8_RELATIVE_DELTA = 0.02


@pytest.fixture(scope="module")
def heldout():
    tokenizer = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    _, files = corpus_files(Path(sysconfig.get_paths()["stdlib"]))
    stream = token_stream(tokenizer, files)
    offsets = np.random.default_rng(0).integers(0, stream.size - 129, 4)
    return np.stack([stream[o : o + 129] for o in offsets])


def perplexity(model, windows):
    logits = model.logits(windows[:, :-1]).astype(np.float64)
    logits -= logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return math.exp(-np.take_along_axis(log_probs, windows[:, 1:, None], -1).mean())


@pytest.mark.parametrize("variant", ["default", "default-fp8"])
def test_heldout_perplexity(heldout, variant):
    model = hybridjit.load(None if variant == "default" else default_model_dir().parent / variant)
    assert model.config.model_type == "deepseek_v3" and model.config.n_routed_experts > 1
    assert perplexity(model, heldout) < PERPLEXITY_BOUND


def test_fp8_variant_close_to_bf16(heldout):
    bf16 = perplexity(hybridjit.load(), heldout)
    fp8 = perplexity(hybridjit.load(default_model_dir().parent / "default-fp8"), heldout)
    assert abs(fp8 - bf16) / bf16 < FP8_RELATIVE_DELTA


def test_greedy_completion_is_deterministic_python():
    model = hybridjit.load()
    first = model.generate("def fibonacci(n):", max_new_tokens=24)
    assert first == model.generate("def fibonacci(n):", max_new_tokens=24)
    assert first.strip() and "\n    " in first  # an indented body
