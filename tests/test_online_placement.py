"""Re-placing resident experts while serving (issue #23, serving/online_placement.py): decode steps count the
experts their live tokens chose, exactly as a prefill of the same tokens routes them; the plan swaps the hottest
outsiders for the coldest residents only where the gain pays for the copy; and a scheduler that re-places between
its steps gives every request what it gets alone.

Float32 on the CPU with the CPU kernels that multiply float32 exactly (kernel_choice.py): resident experts (XLA)
and host ones (the kernels) then differ by summation order only, so a re-placement changes no greedy token.
"""

import dataclasses

import jax
import numpy as np
import pytest
from jax._src.dispatch import BACKEND_COMPILE_EVENT
from kernel_choice import EXACT_FLOAT32_FAMILY, kernel_family
from test_scheduler import idle, prompts, run_all, solo

import hybridjit
from hybridjit import expert_residency
from hybridjit.expert_residency import Residency, count_activations
from hybridjit.models import registry
from hybridjit.placement import Placement
from hybridjit.resolve import default_model_dir
from hybridjit.sampling import SamplingParams
from hybridjit.serving.engine import Engine
from hybridjit.serving.online_placement import COPY_COST_ACTIVATIONS, OnlinePlacement
from hybridjit.serving.scheduler import Request, Scheduler


def _moe_layers(cfg) -> list[int]:
    return [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]


def _first(cfg, n) -> Residency:
    """Each MoE layer's first n experts: the automatic placement's choice without a probe."""
    return Residency({layer: tuple(range(n)) for layer in _moe_layers(cfg)})


@pytest.fixture(scope="module")
def split():
    """The embedded model with its first 4 experts of each MoE layer resident, the rest on the CPU."""
    residency = _first(registry.config_from_json(default_model_dir() / "config.json"), 4)
    placement = dataclasses.replace(Placement.default("float32", jax.devices("cpu")[0]), resident_experts=residency)
    with kernel_family(EXACT_FLOAT32_FAMILY), hybridjit.load(placement=placement) as m:
        yield m


def test_a_tallying_step_gives_the_experts_its_live_tokens_chose(split):
    """Two of three slots occupied, 3 steps a call: the experts the steps chose are those a prefill of the same tokens
    routes those positions to (the free slot chose none)."""
    rng = np.random.default_rng(1)
    two = prompts(split, 2, rng)
    steps, split.decode_steps = split.decode_steps, 3
    try:
        engine = Engine(split, 3, 256, tally=True)
        params = SamplingParams()
        prefilled = engine.prefill(two, [params] * 2)
        for slot in range(2):
            engine.insert(prefilled, slot, slot, params)
        first = np.asarray(prefilled.tokens)
        step = engine.generate()
        generated, routed = step.tokens(), step.routed_experts()
    finally:
        split.decode_steps = steps
    cfg = split.config
    assert routed.shape == (3, len(_moe_layers(cfg)), 3, cfg.num_experts_per_tok)
    assert (routed[:, :, 2] == -1).all() and (routed[:, :, :2] >= 0).all()  # the free slot chose nothing
    tallied = np.stack([np.bincount(routed[:, n, :2].ravel(), minlength=cfg.n_routed_experts)
                        for n in range(routed.shape[1])])
    # The call's inputs are each sequence's first token and the two it then generated.
    inputs = [[int(first[s]), *generated[:-1, s].tolist()] for s in range(2)]
    whole = count_activations(split, [p + t for p, t in zip(two, inputs, strict=True)])
    prompt_only = count_activations(split, two)
    expected = np.stack([whole[layer] - prompt_only[layer] for layer in _moe_layers(cfg)])
    np.testing.assert_array_equal(tallied, expected)


def test_the_plan_swaps_only_what_pays_for_its_copy(split):
    cfg = split.config
    layers = _moe_layers(cfg)
    online = OnlinePlacement(split, max_swaps=3, margin=1.5)
    try:
        assert online.plan() == []  # nothing counted yet
        recent = np.zeros((len(layers), cfg.n_routed_experts))
        recent[0, [0, 1, 2, 3]] = [50, 1, 20, 30]  # residents 0-3
        recent[0, [6, 7, 8]] = [40, 40, 36]  # outsiders
        recent[1, [0, 1, 2, 3]] = 2
        recent[1, 9] = 2 + COPY_COST_ACTIVATIONS  # 1.5x the residents', but gains no more than a copy costs
        online.recent = recent
        plan = online.plan()
        # Layer 0: 6 for 1 (gain 39), 7 for 2 (gain 20); 8 (36) for 3 (30) gains more than a copy costs, but
        # 36 < 1.5 x 30 (hysteresis): stop. Layer 1: nothing.
        assert [(s.layer, s.incoming, s.outgoing) for s in plan] == [(layers[0], 6, 1), (layers[0], 7, 2)]
        online.max_swaps = 1
        assert [(s.incoming, s.outgoing) for s in online.plan()] == [(6, 1)]
    finally:
        online.close()


@pytest.mark.parametrize(("option", "value"), [("interval", 0), ("half_life", -1), ("max_swaps", 1.5),
                                               ("margin", 0.5)])
def test_bad_settings_are_refused_by_name(split, option, value):
    with pytest.raises(ValueError, match=option):
        OnlinePlacement(split, **{option: value})


def test_a_scheduler_that_re_places_between_steps_gives_what_each_request_gets_alone(split):
    """The first 4 experts resident, re-placed every 2 steps as the requests' routing asks: experts do move, the
    counts match the tokens decoded, and every request gets its solo greedy tokens."""
    cfg = split.config
    rng = np.random.default_rng(2)
    batch = prompts(split, 5, rng)  # more than the slots: slots are refilled between re-placements
    lengths = [int(n) for n in rng.integers(8, 24, len(batch))]
    expected = [solo(split, p, n) for p, n in zip(batch, lengths, strict=True)]
    before = split.residency
    scheduler = Scheduler(split, slots=3, chunk_tokens=16, cache_len=256)
    assert scheduler.online is not None and scheduler.engine.tally  # on by default for a split model
    scheduler.online.interval = 2
    scheduler.start()
    try:
        finished, collectors = run_all(scheduler, [Request(p, n) for p, n in zip(batch, lengths, strict=True)])
        assert idle(scheduler)
    finally:
        scheduler.shutdown()
    for (tokens, reason), done, got in zip(expected, finished, collectors, strict=True):
        assert (got.tokens, done.reason) == (tokens, reason)
    assert scheduler.online.swapped > 0
    after = split.residency
    assert after != before and all(len(after.layers[i]) == 4 for i in _moe_layers(cfg))
    # The plan took in experts the traffic used more than the ones they replaced.
    assert scheduler.online.recent.sum() > 0
    split.swap_experts(before, {layer: [split.resident_copies(layer, sorted(set(before.layers[layer])
                                                                          - set(after.layers[layer])))]
                                for layer in _moe_layers(cfg) if before.layers[layer] != after.layers[layer]})
    assert split.residency == before


def test_a_swap_that_changes_a_layers_count_or_brings_the_wrong_copies_is_refused(split):
    layer = _moe_layers(split.config)[0]
    held = split.residency
    fewer = Residency({**held.layers, layer: held.layers[layer][:2]})
    with pytest.raises(ValueError, match=f"layer {layer}"):
        split.swap_experts(fewer, {})
    moved = Residency({**held.layers, layer: (*held.layers[layer][:3], 10)})
    with pytest.raises(ValueError, match=f"layer {layer}"):
        split.swap_experts(moved, {layer: [split.resident_copies(layer, [11])]})
    assert split.residency == held


def test_a_swap_after_compile_swap_compiles_nothing(split):
    """The slot write is compiled ahead (OnlinePlacement does it as serving starts): the first swap of a layer's
    expert then compiles no program. The same swap back without it does compile (jit's caches cleared), so the
    check can tell the two apart."""
    layer = _moe_layers(split.config)[0]
    held = split.residency.layers
    leaving, incoming = held[layer][0], min(set(range(split.config.n_routed_experts)) - set(held[layer]))
    swapped = Residency({**held, layer: tuple(sorted(set(held[layer]) - {leaving} | {incoming}))})
    compiles = []

    def count(event, _secs, **_):
        if event == BACKEND_COMPILE_EVENT:
            compiles.append(event)

    def compiled_by(swap) -> int:
        jax.clear_caches()
        compiles.clear()
        jax.monitoring.register_event_duration_secs_listener(count)
        try:
            swap()
        finally:
            jax.monitoring.unregister_event_duration_listener(count)
        return len(compiles)

    def ahead_then_swap():
        expert_residency.compile_swap(split.weights.layers[layer].mlp.resident)
        copies = {layer: [split.resident_copies(layer, [incoming])]}
        compiles.clear()
        split.swap_experts(swapped, copies)

    assert compiled_by(ahead_then_swap) == 0
    assert split.residency.layers[layer] == swapped.layers[layer]
    assert compiled_by(lambda: split.swap_experts(Residency(held), {layer: [split.resident_copies(layer, [leaving])]}))
    assert split.residency.layers == held
