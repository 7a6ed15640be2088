"""Sliding-window layers keep a ring of their window in the serving engine's slots (models/common/ring_cache.py):
on tiny gpt-oss (window 4 in every other layer, sinks), prompts and generations longer than the window decode what
whole-sequence logits give, across the ring's wrap-around, in every decode program (one step a call, several a
call, dual-batch, module-batched), through the scheduler with chunked prefill and the prefix cache, and after
stream-loaded prefill; a ring's bytes are its window's, whatever the context."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_factory import family_config, write_family_checkpoint
from hybrid_placement import hybrid
from kernel_choice import EXACT_FLOAT32_FAMILY, kernel_family
from test_scheduler import Collector

import hybridjit
from hybridjit.auto_placement import device_budget, kv_cache_bytes
from hybridjit.models.common import gqa
from hybridjit.prefill_path import choose_prefill_path
from hybridjit.sampling import SamplingParams
from hybridjit.serving import engine as serving_engine
from hybridjit.serving.engine import Engine
from hybridjit.serving.scheduler import Request, Scheduler
from hybridjit.synthetic import geometry_config

WINDOW = 4  # the tiny gpt-oss's sliding window
CACHE_LEN = 32
FLOAT32_RTOL = 1e-5  # the same sums in another order: a ring's keys against a full cache's
SAME_MATH_RTOL = 1e-4  # decode against whole-sequence prefill, as test_families.py
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    config = family_config("gpt_oss")
    assert config["sliding_window"] == WINDOW
    path = write_family_checkpoint(tmp_path_factory.mktemp("gpt_oss"), config, seed=7, weight_format="mxfp4")
    with kernel_family(EXACT_FLOAT32_FAMILY):
        m = hybridjit.load(path, placement=hybrid("float32", pinned_experts=True))
        yield m
        m.close()


def prompt_of(model, length: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, model.config.vocab_size, length)]


def whole_sequence_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, each the argmax of the whole sequence's logits (no cache)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(model.logits([seq])[0, -1])))
    return seq[len(prompt) :]


def rel_rms(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


def test_a_ring_layer_holds_its_window_whatever_the_context(model):
    cfg = model.config
    windowed = [cfg.window(i) is not None for i in range(cfg.num_hidden_layers)]
    assert any(windowed) and not all(windowed)
    cache = gqa.init_cache(cfg, 3, 64, np.float32, ring=True)
    for layer, ring in zip(cache, windowed, strict=True):
        shape = (3, WINDOW if ring else 64, cfg.num_key_value_heads, cfg.head_dim)
        assert layer.k.shape == layer.v.shape == shape and layer.ring == ring
    assert sum(a.nbytes for a in jax.tree.leaves(cache)) == kv_cache_bytes(cfg, jnp.float32, 3, 64)
    # Doubling the context adds the full-attention layers' bytes only.
    full = windowed.count(False) * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    assert kv_cache_bytes(cfg, jnp.float32, 3, 128) - kv_cache_bytes(cfg, jnp.float32, 3, 64) == 3 * 64 * full
    # A window no shorter than the context needs no ring.
    assert not any(layer.ring for layer in gqa.init_cache(cfg, 1, WINDOW, np.float32, ring=True))


def test_the_kv_budget_counts_a_sliding_layer_by_its_window():
    """gpt-oss-120b: 18 of its 36 layers slide over 128 positions, so 8 slots of 8K positions need half the bytes
    of every layer holding them all, plus the windows."""
    cfg = geometry_config("gpt-oss-120b")
    every_position = sum(a.size * 2 for a in jax.tree.leaves(jax.eval_shape(
        lambda: gqa.init_cache(cfg, 8, 8192, jnp.bfloat16))))
    assert kv_cache_bytes(cfg, jnp.bfloat16, 8, 8192) == every_position // 2 + every_position // 2 * 128 // 8192
    budget = device_budget(cfg, jax.devices("cpu")[0], jnp.bfloat16, kv_tokens=8 * 8192, kv_slots=8)
    assert budget.kv_cache == kv_cache_bytes(cfg, jnp.bfloat16, 8, 8192)


def test_decode_steps_across_the_ring_give_the_full_caches_logits(model):
    """Prompt 11, 12 new tokens, window 4: the ring wraps around several times; each step's logits equal those of
    decode over a cache of every position, and the whole sequence's."""
    cfg, w, family = model.config, model.weights, model.family.model
    prompt = prompt_of(model, 11, seed=1)
    seq = prompt + whole_sequence_greedy(model, prompt, 12)
    whole = model.logits([seq])[0]
    tokens = np.zeros((1, 16), np.int32)
    tokens[0, : len(prompt)] = prompt
    prefill = jax.jit(family.prefill, static_argnums=0)
    _, prompt_cache = prefill(cfg, w, tokens, family.init_cache(cfg, 1, 16, np.float32))
    length = np.int32(len(prompt))
    caches = [
        serving_engine._insert_program(family.init_cache(cfg, 1, CACHE_LEN, np.float32, ring=ring), prompt_cache,
                                       0, length, 0)
        for ring in (True, False)
    ]
    assert any(layer.ring for layer in caches[0]) and not any(layer.ring for layer in caches[1])
    step = jax.jit(family.decode_step, static_argnums=0)
    for pos in range(len(prompt), len(seq)):
        (ring_logits, caches[0]), (full_logits, caches[1]) = (
            step(cfg, w, np.array(seq[pos : pos + 1], np.int32), np.array([pos], np.int32), c) for c in caches
        )
        assert rel_rms(ring_logits, full_logits) < FLOAT32_RTOL, pos
        assert rel_rms(ring_logits[0], whole[pos]) < SAME_MATH_RTOL, pos


@pytest.mark.parametrize(
    ("program", "micro_batches", "decode_steps", "streamed"),
    [("dual", None, None, False), ("loop", None, 3, False), ("grouped", 2, None, False), ("loop", None, 3, True)],
)
def test_slots_at_different_positions_decode_what_they_decode_alone(model, monkeypatch, program, micro_batches,
                                                                     decode_steps, streamed):
    """Three slots joining at different calls (so at different positions, each past the window), with full layers
    read over a span shorter than the cache; streamed: the prompts' caches come from stream-loaded prefill."""
    monkeypatch.setattr(serving_engine, "MIN_SPAN", 8)
    monkeypatch.setattr(model, "decode_steps", decode_steps)
    monkeypatch.setattr(model, "stream_prefill_threshold", 1 if streamed else model.stream_prefill_threshold)
    engine = Engine(model, slots=3, cache_len=CACHE_LEN, micro_batches=micro_batches)
    assert engine.has_rings and len(engine.groups) == (1 if program == "loop" else 2)
    joins = {0: prompt_of(model, 11, seed=2), 1: prompt_of(model, 5, seed=3), 2: prompt_of(model, 2, seed=4)}
    if streamed:
        assert all(choose_prefill_path(model, 1, len(p), threshold=1) == "stream" for p in joins.values())
    got: dict[int, list[int]] = {}
    for call in range(15 // engine.steps):  # 15 new positions in the first slot: 27 of its 32
        if call in joins:
            slot = len(got)
            prefilled = engine.prefill([joins[call]], [GREEDY])
            engine.insert(prefilled, 0, slot, GREEDY)
            got[slot] = [int(np.asarray(prefilled.tokens)[0])]
        tokens = engine.generate().tokens()
        for slot in got:
            got[slot] += [int(t) for t in tokens[:, slot]]
    for slot, prompt in enumerate(joins.values()):
        assert len(prompt) + len(got[slot]) > 2 * WINDOW
        assert got[slot] == whole_sequence_greedy(model, prompt, len(got[slot])), slot


def test_scheduler_and_prefix_cache_over_rings(model):
    """Concurrent requests (chunked prefill, chunks shorter than the prompts) get the whole-sequence tokens; a
    later prompt that extends an earlier one reuses its prompt's blocks (stored from the prefill's cache, which
    holds every position) and still gets them; a slot with rings keeps no blocks of what it generated."""
    scheduler = Scheduler(model, slots=3, cache_len=64, policy="chunked", chunk_tokens=4, prefix_block_tokens=4)
    scheduler.start()
    try:
        prompts = [prompt_of(model, n, seed=10 + n) for n in (11, 3, 17, 6)]
        done = []
        for prompt in prompts:
            scheduler.submit(Request(prompt, 12), collector := Collector())
            done.append(collector)
        for prompt, collector in zip(prompts, done, strict=True):
            assert collector.wait().completion_tokens == 12
            assert collector.tokens == whole_sequence_greedy(model, prompt, 12)
        longer = prompts[2] + [7, 8, 9]
        scheduler.submit(Request(longer, 12), collector := Collector())
        assert collector.wait().cached_tokens == 16
        assert collector.tokens == whole_sequence_greedy(model, longer, 12)
    finally:
        scheduler.shutdown()


def test_a_ring_refuses_what_it_cannot_hold(model):
    cfg, w = model.config, model.weights
    ring = next(i for i in range(cfg.num_hidden_layers) if cfg.window(i) is not None)
    cache = gqa.init_cache(cfg, 1, CACHE_LEN, np.float32, ring=True)[ring]
    with pytest.raises(ValueError, match="^cache: "):
        gqa.write_prompt(cache, (cache.k, cache.v))
    x = jnp.zeros((1, 2, cfg.hidden_size), jnp.float32)
    with pytest.raises(ValueError, match="^x: .* got 2"):
        gqa.decode(cfg, w.layers[ring].attn, x, jnp.array([[3, 4]]), cache)
    with pytest.raises(ValueError, match="^slot: "):
        Engine(model, slots=1, cache_len=CACHE_LEN).read_span(0, 0, 4)
