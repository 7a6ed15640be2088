"""The cached decode path against whole-sequence logits, batching, sampling and the generate/stream API.

Whole-sequence logits are themselves checked against transformers (test_vs_transformers.py); here the
decode step (absorbed MLA over the latent cache) must reproduce them token by token.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_factory import tiny_config, write_checkpoint
from kernel_choice import EXACT_FLOAT32_FAMILY, kernel_family

import hybridjit
from hybridjit.models import deepseek_v3 as dsv3
from hybridjit.placement import Placement
from hybridjit.sampling import SamplingParams, restricts, sample

# Relative RMS error between two float32 computations of the same logits by different association
# orders (expanded vs absorbed attention): rounding only.
SAME_MATH_RTOL = 1e-4

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_checkpoint(
        tmp_path_factory.mktemp("v3"), tiny_config("v3", eos_token_id=None), seed=7, weight_format="bf16"
    )
    # Same-math comparisons at float32 rounding: experts on a kernel that keeps float32 activations (AVX-512
    # and AMX round them to bfloat16, 2^-8 relative, far above SAME_MATH_RTOL).
    with kernel_family(EXACT_FLOAT32_FAMILY):
        m = hybridjit.load(path, dtype="float32")
        yield m
        m.close()


def rel_rms(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


def test_decode_steps_reproduce_whole_sequence_logits(model):
    cfg, w = model.config, model.weights
    seq = np.array(PROMPTS[2], np.int32)[None]
    full = np.asarray(dsv3.prefill(cfg, w, seq)[0])[0]
    prefix = 4
    cache = dsv3.init_cache(cfg, 1, 32, np.float32)
    logits, cache = dsv3.prefill(cfg, w, seq[:, :prefix], cache)
    np.testing.assert_allclose(np.asarray(logits)[0], full[:prefix], rtol=1e-5, atol=1e-5)
    step = jax.jit(dsv3.decode_step, static_argnums=0)
    for pos in range(prefix, seq.shape[1]):
        logits, cache = step(cfg, w, seq[:, pos], np.array([pos], np.int32), cache)
        assert rel_rms(np.asarray(logits)[0], full[pos]) < SAME_MATH_RTOL, pos


def test_greedy_generation_follows_the_argmax_of_whole_sequence_logits(model):
    prompt = PROMPTS[0]
    new = model.generate(prompt, max_new_tokens=6)
    assert len(new) == 6
    seq = list(prompt)
    for token in new:
        assert token == int(np.argmax(model.logits([seq])[0, -1]))
        seq.append(token)


def test_batched_generation_equals_one_by_one(model):
    batched = model.generate(PROMPTS, max_new_tokens=5)
    assert batched == [model.generate(p, max_new_tokens=5) for p in PROMPTS]


def test_padded_batch_logits_equal_single_sequence_logits(model):
    batch = model.logits(PROMPTS)
    for i, p in enumerate(PROMPTS):
        single = model.logits([p])[0]
        assert rel_rms(batch[i, : len(p)], single) < SAME_MATH_RTOL


def test_greedy_is_deterministic_and_sampling_is_seeded(model):
    prompt = PROMPTS[1]
    assert model.generate(prompt, max_new_tokens=8) == model.generate(prompt, max_new_tokens=8)
    a = model.generate(prompt, max_new_tokens=8, temperature=1.0, seed=1)
    assert a == model.generate(prompt, max_new_tokens=8, temperature=1.0, seed=1)
    others = [model.generate(prompt, max_new_tokens=8, temperature=1.0, seed=s) for s in range(2, 6)]
    assert any(o != a for o in others)
    assert model.generate(prompt, max_new_tokens=8, temperature=1.0, top_k=1, seed=3) == model.generate(
        prompt, max_new_tokens=8
    )
    assert model.generate(prompt, max_new_tokens=8, temperature=1.0, top_p=1e-6, seed=3) == model.generate(
        prompt, max_new_tokens=8
    )


def test_sampled_tokens_respect_top_k(model):
    prompt = PROMPTS[0]
    allowed = set(np.argsort(model.logits([prompt])[0, -1])[-3:].tolist())
    firsts = {
        model.generate(prompt, max_new_tokens=1, temperature=2.0, top_k=3, seed=s)[0] for s in range(12)
    }
    assert firsts <= allowed and len(firsts) > 1


def test_each_row_draws_by_its_own_parameters_whatever_the_others_ask():
    """sample(): a row that neither restricts (top_k 0, top_p 1) draws over its logits as they are, without the sort
    a restricting row needs, and a step sorts only where some row restricts: so a row's token must not depend on
    whether another row of the step restricts. Draws follow softmax(logits / temperature) (a chi-square bound far
    above its 99.9th percentile: the test fails on a wrong distribution, not by chance); top_k and top_p keep to
    their tokens; temperature 0 is the argmax."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((4, 8)).astype(np.float32) * 2)
    keys = jax.random.split(jax.random.key(1), 4)
    temperature = np.array([0.7, 1.0, 0.0, 1.5], np.float32)
    top_k, top_p = np.array([0, 2, 0, 0], np.int32), np.array([1.0, 1.0, 1.0, 0.5], np.float32)
    assert restricts(temperature, top_k, top_p) and not restricts(temperature[[0, 2]], top_k[[0, 2]], top_p[[0, 2]])
    assert not restricts(np.zeros(2), np.array([5, 0]), np.array([1.0, 0.5]))  # greedy rows never sort
    together = np.asarray(sample(logits, keys, temperature, top_k, top_p, restricts(temperature, top_k, top_p)))
    for row in range(4):
        one = slice(row, row + 1)
        alone = sample(logits[one], keys[one], temperature[one], top_k[one], top_p[one],
                       restricts(temperature[one], top_k[one], top_p[one]))  # fmt: skip
        assert int(alone[0]) == together[row], row
    assert together[2] == int(jnp.argmax(logits[2]))

    draws = 4000
    many = jax.random.split(jax.random.key(2), draws)
    row = jnp.broadcast_to(logits[0], (draws, 8))

    def counts(k, p):
        params = jnp.full(draws, 0.7), jnp.full(draws, k, jnp.int32), jnp.full(draws, p)
        tokens = sample(row, many, *params, restricted=k > 0 or p < 1)
        return np.bincount(np.asarray(tokens), minlength=8)

    expected = draws * np.asarray(jax.nn.softmax(logits[0] / 0.7))
    plain = counts(0, 1.0)
    assert np.sum((plain - expected) ** 2 / expected) < 40  # 7 degrees of freedom: 99.9th percentile 24.3
    top2 = set(np.argsort(np.asarray(logits[0]))[-2:].tolist())
    assert set(np.flatnonzero(counts(2, 1.0))) == top2
    assert set(np.flatnonzero(counts(0, 1e-6))) == {int(jnp.argmax(logits[0]))}


def test_sampling_asks_the_device_no_condition():
    """sample() chooses what to compute from its static `restricted`, never from a condition on the device: XLA on a
    GPU copies a condition's predicate to the host, which made each step of a looped decode wait for the device
    (Qwen3-30B-A3B's batch-1 step 2.9 -> 4.9 ms, bench/RESULTS.md)."""
    logits, keys = jnp.zeros((3, 16)), jax.random.split(jax.random.key(0), 3)
    params = (jnp.ones(3), jnp.array([0, 4, 0], jnp.int32), jnp.array([1.0, 1.0, 0.9]))
    for restricted in (False, True):
        program = jax.jit(sample, static_argnums=5).lower(logits, keys, *params, restricted).as_text()
        assert "stablehlo.case" not in program and "stablehlo.if" not in program


def test_stream_yields_what_generate_returns(model):
    prompt = PROMPTS[2]
    assert list(model.stream(prompt, max_new_tokens=6)) == model.generate(prompt, max_new_tokens=6)


def test_generation_stops_at_eos(model):
    prompt = PROMPTS[0]
    free = model.generate(prompt, max_new_tokens=6)
    eos = free[2]
    object.__setattr__(model.config, "eos_token_ids", (eos,))
    try:
        stopped = model.generate(prompt, max_new_tokens=6)
        assert stopped == free[: free.index(eos) + 1]
        assert list(model.stream(prompt, max_new_tokens=6)) == free[: free.index(eos)]
    finally:
        object.__setattr__(model.config, "eos_token_ids", ())


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda m: m.generate([1] * 1000, max_new_tokens=100),
            r"prompt of 1000 tokens \+ max_new_tokens 100 = 1100 exceeds the model's context of 1024 "
            r"\(max_position_embeddings in \S+config\.json\)",
        ),
        (
            lambda m: m.generate([[1] * 10, [1] * 1020], max_new_tokens=5),
            r"longest prompt \(sequence 1\) of 1020 tokens \+ max_new_tokens 5 = 1025 exceeds the model's context",
        ),
        (
            lambda m: m.stream([1] * 1024, max_new_tokens=1),
            r"prompt of 1024 tokens \+ max_new_tokens 1 = 1025 exceeds the model's context of 1024",
        ),
        (
            lambda m: m.logits([[1] * 3, [1] * 1025]),
            r"sequence 1 of 1025 tokens exceeds the model's context of 1024 \(max_position_embeddings in",
        ),
        (
            lambda m: m.generate([[1, 2], [3, 300]]),
            r"sequence 1: token id 300 outside the vocabulary \[0, 300\)",
        ),
        (lambda m: m.generate([[1, 2], []]), "sequence 1 is empty"),
        (lambda m: m.generate([1, 2], temperature=-1.0), "temperature must be a finite number >= 0"),
        (lambda m: m.generate([1, 2], top_p=0.0), r"top_p must be in \(0, 1\]"),
        (lambda m: m.generate("text"), r"has no tokenizer \(tokenizer.json\): pass token ids"),
    ],
)
def test_bad_requests_raise_clear_errors(model, call, message):
    with pytest.raises(ValueError, match=message):
        call(model)


PROMPT_KINDS = "a str, a list of str, a list of token ids or a list of token-id lists"


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        # Prompts that used to fail deep inside (None, []) or were silently misread (bytes as token ids).
        (lambda m: m.generate(None), TypeError, rf"prompt must be {PROMPT_KINDS}, got None"),
        (lambda m: m.generate(5), TypeError, rf"prompt must be {PROMPT_KINDS}, got 5"),
        (lambda m: m.generate([]), ValueError, r"prompt is empty"),
        (lambda m: m.generate(b"def f("), TypeError, r"prompt is bytes: decode it to a str"),
        (lambda m: m.stream(None), TypeError, rf"prompt must be {PROMPT_KINDS}, got None"),
        (lambda m: m.logits(None), TypeError, r"token_ids must be a list of token-id lists, got None"),
        (lambda m: m.logits([]), ValueError, r"token_ids is empty"),
        (lambda m: m.generate([1.0, 2.0]), TypeError, r"sequence 0 must hold token ids \(integers\), got 1\.0"),
        (lambda m: m.generate([True, 2]), TypeError, r"sequence 0 must hold token ids \(integers\), got True"),
        (lambda m: m.generate([[1, 2], [3, 4.5]]), TypeError, r"sequence 1 must hold token ids .*got 4\.5"),
        (lambda m: m.generate([[1, 2], "ab"]), TypeError, r"sequence 1 must be a list of token ids, got 'ab'"),
        (lambda m: m.logits(np.array([[1.0, 2.0]])), TypeError, r"sequence 0 must hold .*array float64\(2,\)"),
        # max_new_tokens: -1 used to return nothing, 1.5 to raise an AttributeError.
        (lambda m: m.generate([1, 2], max_new_tokens=-1), ValueError, r"max_new_tokens must be >= 1, got -1"),
        (lambda m: m.generate([1, 2], max_new_tokens=0), ValueError, r"max_new_tokens must be >= 1, got 0"),
        (lambda m: m.generate([1, 2], max_new_tokens=1.5), TypeError, r"max_new_tokens must be an integer, got 1\.5"),
        (lambda m: m.generate([1, 2], max_new_tokens=True), TypeError, r"max_new_tokens must be an integer"),
        (lambda m: m.stream([1, 2], max_new_tokens=-1), ValueError, r"max_new_tokens must be >= 1"),
        (lambda m: m.stream([1, 2], top_k=0.5), TypeError, r"top_k must be an integer"),
        # Sampling: nan used to mean greedy, top_k=1.5 to mean 1, seed 2**63 to overflow.
        (lambda m: m.generate([1, 2], temperature=float("nan")), ValueError, r"temperature must be a finite .*got nan"),
        (lambda m: m.generate([1, 2], temperature=float("inf")), ValueError, r"temperature must be a finite .*got inf"),
        (lambda m: m.generate([1, 2], temperature="1"), TypeError, r"temperature must be a number, got '1'"),
        (lambda m: m.generate([1, 2], top_k=1.5), TypeError, r"top_k must be an integer, got 1\.5"),
        (lambda m: m.generate([1, 2], top_k=True), TypeError, r"top_k must be an integer, got True"),
        (lambda m: m.generate([1, 2], top_k=-1), ValueError, r"top_k must be >= 0"),
        (lambda m: m.generate([1, 2], top_p=float("nan")), ValueError, r"top_p must be in \(0, 1\], got nan"),
        (lambda m: m.generate([1, 2], top_p=None), TypeError, r"top_p must be a number, got None"),
        (lambda m: m.generate([1, 2], seed=-1), ValueError, r"seed must be a non-negative integer, got -1"),
        (lambda m: m.generate([1, 2], seed=1.0), TypeError, r"seed must be an integer, got 1\.0"),
        (lambda m: m.generate([1, 2], seed=False), TypeError, r"seed must be an integer, got False"),
    ],
)
def test_bad_arguments_name_the_argument(model, call, error, message):
    with pytest.raises(error, match=message):
        call(model)


def test_numpy_scalars_and_arrays_are_arguments_like_python_ones(model):
    prompt = PROMPTS[0]
    expected = model.generate(prompt, max_new_tokens=3, temperature=0.5, top_k=5, top_p=0.9, seed=7)
    assert expected == model.generate(
        np.array(prompt, np.int64), max_new_tokens=np.int64(3), temperature=np.float32(0.5), top_k=np.int32(5),
        top_p=np.float64(0.9), seed=np.uint64(7),
    )
    greedy = model.generate(prompt, max_new_tokens=2)
    assert model.generate(jnp.array(prompt), max_new_tokens=2) == greedy
    assert model.generate(jnp.array([prompt, prompt]), max_new_tokens=2) == [greedy, greedy]


def test_seeds_beyond_32_bits_are_distinct_and_accepted(model):
    prompt, sampled = PROMPTS[1], dict(max_new_tokens=8, temperature=1.0)
    low = model.generate(prompt, seed=1, **sampled)
    assert low == model.generate(prompt, seed=1, **sampled)
    assert model.generate(prompt, seed=2**32 + 1, **sampled) != low  # was the same key as seed 1
    for seed in (2**63, 2**64 - 1, 2**64 + 1):  # 2**63 used to raise OverflowError
        assert model.generate(prompt, seed=seed, **sampled) == model.generate(prompt, seed=seed, **sampled)


def test_seed_keys_are_distinct_beyond_32_bits_and_unchanged_below():
    def words(seed):
        return tuple(np.asarray(jax.random.key_data(SamplingParams(seed=seed).key())).tolist())

    assert words(12345) == tuple(np.asarray(jax.random.key_data(jax.random.key(12345))).tolist())
    seeds = [1, 2**32 + 1, 2**33 + 1, 2**32, 2**64, 2**64 + 2**32, 2**63, 2**64 - 1, 2**96 + 1]
    assert len({words(s) for s in seeds}) == len(seeds)


@pytest.mark.parametrize("dtype", ["float16", "fp32", "bf16", jnp.float16, np.float64, 32, True])
def test_load_rejects_other_dtypes_naming_the_allowed_ones(dtype):
    allowed = r"dtype must be 'float32' or 'bfloat16' \(or jnp\.float32, jnp\.bfloat16\), got"
    with pytest.raises(ValueError, match=allowed):
        hybridjit.load(dtype=dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", jnp.float32, jnp.bfloat16, np.float32])
def test_compute_dtypes(dtype):
    assert Placement.default(dtype).dtype == jnp.dtype(dtype)


def test_load_rejects_a_dtype_that_contradicts_the_placement():
    with pytest.raises(ValueError, match=r"dtype 'bfloat16' contradicts placement\.dtype float32"):
        hybridjit.load(dtype="bfloat16", placement=Placement.default("float32"))


def test_sequences_sampled_together_draw_apart_and_the_first_draws_as_alone(model):
    prompt, sampled = PROMPTS[1], dict(max_new_tokens=8, temperature=1.0, seed=3)
    first, second = model.generate([prompt, prompt], **sampled)
    assert first == model.generate(prompt, **sampled)
    assert second != first  # the same prompt twice is two samples, not one sample twice
