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


@pytest.fixture(scope="module")
def shipped():
    return hybridjit.load()


PROMPT = "def fibonacci(n):"


def test_stream_stops_before_a_stop_string_and_never_emits_part_of_it(shipped):
    text = shipped.generate(PROMPT, max_new_tokens=24)
    assert len(text) > 12
    for stop in (text[4:9], text[-3:], [text[7:11], "\x00never"]):
        deltas = list(shipped.stream(PROMPT, max_new_tokens=24, stop=stop))
        first = min(text.index(s) for s in ([stop] if isinstance(stop, str) else stop) if s in text)
        # Deltas only ever extend the text: their sum ending before the stop string means no part of it went out.
        assert "".join(deltas) == text[:first] == shipped.generate(PROMPT, max_new_tokens=24, stop=stop)


def test_text_held_back_for_a_stop_string_that_never_comes_is_released(shipped):
    text = shipped.generate(PROMPT, max_new_tokens=24)
    almost = text[-3:] + "\x00"  # each tail of the text may begin it until the end: all is held back, then let go
    assert "".join(shipped.stream(PROMPT, max_new_tokens=24, stop=almost)) == text
    assert "".join(shipped.stream(PROMPT, max_new_tokens=24)) == text


@pytest.mark.parametrize(
    ("stop", "error", "message"),
    [
        (5, TypeError, r"stop must be a str or a list of str, got 5"),
        (["a", 3], TypeError, r"stop must be a str or a list of str, got \['a', 3\]"),
        ("", ValueError, r"stop strings must not be empty"),
        (b"x", TypeError, r"stop must be a str or a list of str"),
    ],
)
def test_bad_stop_strings(shipped, stop, error, message):
    with pytest.raises(error, match=message):
        shipped.generate(PROMPT, max_new_tokens=2, stop=stop)
    with pytest.raises(error, match=message):
        shipped.stream(PROMPT, max_new_tokens=2, stop=stop)


def test_stream_stop_strings_need_a_text_prompt(shipped):
    with pytest.raises(ValueError, match=r"stop strings need a text prompt in stream"):
        shipped.stream([5, 6, 7], max_new_tokens=2, stop="x")


def test_a_prompt_that_is_not_valid_unicode_is_refused_by_name(shipped):
    # A lone surrogate: what json.loads makes of the escape "\ud800"; the tokenizer raised a bare TypeError on it.
    with pytest.raises(ValueError, match=r"^prompt: not valid Unicode: a lone surrogate \\ud800 at character 3$"):
        shipped.generate("def\ud800", max_new_tokens=2)
