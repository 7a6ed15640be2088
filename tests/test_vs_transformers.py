"""hybridjit against Hugging Face transformers on tiny random checkpoints in the real HF layout.

The reference outputs (tests/golden/<case>.npz) come from transformers 5.23 in float32 on CPU, made by
tests/golden/make_golden.py in the torch venv; CI has no torch, so each case's checkpoint is rebuilt here
from its seed (checkpoint_factory.GOLDEN_CASES) and must be byte-identical to the one the goldens saw.
The DeepSeek cases cover V3 (bf16 and FP8 with the MTP layer), V2-Lite (greedy softmax routing, no q LoRA) and
V2 (group-limited softmax routing), all with YaRN rope; the other families' cases (checkpoint_factory.FAMILY_CASES)
run here once the registry supports their family.
"""

import json
from pathlib import Path

import numpy as np
import pytest
from checkpoint_factory import (
    FAMILY_CASES,
    GOLDEN_CASES,
    build_case,
    read_tensors,
    tensor_digest,
)
from kernel_choice import EXACT_FLOAT32_FAMILY, kernel_family

import hybridjit
from hybridjit.export import save_checkpoint
from hybridjit.models import registry
from hybridjit.models.common.routing import route

GOLDEN_DIR = Path(__file__).parent / "golden"

# Tolerances, all of them. The goldens' prompts are drawn so that no greedy step is within 0.01 logits of a
# tie and no routing decision within 1e-5 of one, so float32 rounding cannot flip a token or an expert.
# `make_golden.py --sensitivity` shows that every modelled bug (YaRN, softmax scale, rope layout,
# routing, expert order, FP8 blocks, ...) moves the logits by more than 4%.
LOGITS_MAX_REL_RMS = 2e-2  # per prompt: rms(ours - ref) / rms(ref)
ROUTING_MIN_MARGIN = 1e-3  # routing is compared only for tokens at least this far from a tie (score units)
ROUTING_WEIGHTS_RTOL = 1e-5  # top-k weights, once the expert sets agree
NEW_TOKENS = 8


# Every golden case of a family the registry supports: DeepSeek's (GOLDEN_CASES) and the other families'
# (FAMILY_CASES, made in the released layouts; tests/golden/README.md specifies each family's computation).
SUPPORTED_TYPES = {t for family in registry.FAMILIES for t in family.config.MODEL_TYPES}
CASES = [*GOLDEN_CASES, *(name for name, case in FAMILY_CASES.items() if case["preset"] in SUPPORTED_TYPES)]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """(checkpoint path, golden arrays) of one case, the checkpoint proven to be the goldens' one."""
    name = request.param
    golden = dict(np.load(GOLDEN_DIR / f"{name}.npz"))
    path = build_case(name, tmp_path_factory.mktemp(name))
    if tensor_digest(path) != str(golden["digest"]):
        pytest.fail(
            f"{name}: the rebuilt checkpoint differs from the one tests/golden/{name}.npz was made from "
            "(checkpoint_factory or numpy's random streams changed). Regenerate the goldens: "
            "/work/main/.venv-ref/bin/python tests/golden/make_golden.py (see tests/golden/README.md)."
        )
    return path, golden


@pytest.fixture(scope="module")
def model(case):
    # A float32 model against a float32 reference: experts on a kernel that keeps float32 activations (the
    # bfloat16-rounding kernels are held to their own tolerance against float64 in test_cpu_kernels).
    with kernel_family(EXACT_FLOAT32_FAMILY):
        m = hybridjit.load(case[0], dtype="float32")
        yield m
        m.close()


def prompts(golden) -> list[list[int]]:
    count = sum(key.startswith("prompt") and key.endswith("_ids") for key in golden)
    return [golden[f"prompt{i}_ids"].tolist() for i in range(count)]


def relative_rms(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.sqrt(np.mean((ours - reference) ** 2) / np.mean(reference**2)))


def test_logits_match_transformers(case, model):
    _, golden = case
    batch = prompts(golden)
    logits = np.asarray(model.logits(batch))
    vocab = golden["prompt0_logits"].shape[-1]
    assert logits.shape == (len(batch), max(map(len, batch)), vocab) and logits.dtype == np.float32
    for i, prompt in enumerate(batch):
        error = relative_rms(logits[i, : len(prompt)], golden[f"prompt{i}_logits"])
        assert error <= LOGITS_MAX_REL_RMS, f"prompt {i}: logits off by {error:.2%} (relative RMS)"


def test_greedy_generation_matches_transformers(case, model):
    _, golden = case
    batch = prompts(golden)
    generated = model.generate(batch, max_new_tokens=NEW_TOKENS, temperature=0.0)
    expected = [golden[f"prompt{i}_generated"].tolist() for i in range(len(batch))]
    assert [[int(t) for t in seq] for seq in generated] == expected


def _set(tensors: dict, suffix: str, value: float):
    """Every tensor whose name ends in `suffix`, filled with `value`."""
    for name in [n for n in tensors if n.endswith(suffix)]:
        tensors[name] = np.full(tensors[name].shape, value, np.float32)


# gpt-oss's own features, each turned off in a copy of its golden checkpoint (config, tensors): what the golden
# computes with it (tests/golden/README.md), and why the comparison must then fail.
GPT_OSS_FEATURES_OFF = {
    # a learnt logit per head in each softmax's denominator: far below every score, it takes no share
    "sinks": lambda config, tensors: _set(tensors, ".self_attn.sinks", -1e9),
    # sliding layers see the last sliding_window positions only (4 here, the prompts are 7 and 12 long)
    "sliding window": lambda config, tensors: config.update(sliding_window=10**6),
    # gate clamped above and up on both sides at swiglu_limit (2 here): the clamp cuts ~15% / ~30% of them
    "SwiGLU clamp": lambda config, tensors: config.update(swiglu_limit=1e9),
    # the experts' biases, gate/up and down
    "expert biases": lambda config, tensors: _set(tensors, "_proj_bias", 0.0),
    # the router's bias, part of the logits that choose the experts and weigh them
    "router bias": lambda config, tensors: _set(tensors, ".mlp.router.bias", 0.0),
}


@pytest.mark.skipif("gpt_oss" not in SUPPORTED_TYPES, reason="gpt-oss is not registered")
@pytest.mark.parametrize("feature", sorted(GPT_OSS_FEATURES_OFF))
def test_each_gpt_oss_feature_matters(feature, tmp_path):
    """Turning each gpt-oss feature off moves the logits beyond the tolerance: the comparison tests every one."""
    golden = dict(np.load(GOLDEN_DIR / "gpt_oss_mxfp4.npz"))
    path = build_case("gpt_oss_mxfp4", tmp_path / "golden")
    config, tensors = json.loads((path / "config.json").read_text()), read_tensors(path)
    GPT_OSS_FEATURES_OFF[feature](config, tensors)
    batch = prompts(golden)
    with kernel_family(EXACT_FLOAT32_FAMILY):
        m = hybridjit.load(save_checkpoint(tmp_path / "off", config, tensors), dtype="float32")
        try:
            logits = np.asarray(m.logits(batch))
        finally:
            m.close()
    errors = [relative_rms(logits[i, : len(p)], golden[f"prompt{i}_logits"]) for i, p in enumerate(batch)]
    assert max(errors) > 2 * LOGITS_MAX_REL_RMS, f"{feature} off moves the logits by only {max(errors):.2%}"


def test_routing_matches_transformers(case, model):
    """route() on transformers' own router inputs picks the same experts with the same weights."""
    path, golden = case
    tensors = read_tensors(path)
    names = registry.family_of(model.config).ckpt.MOE_NAMES  # mlp or block_sparse_moe, where the biases sit

    def optional(name):
        return None if name not in tensors else tensors[name].astype(np.float32)

    for layer in golden["moe_layers"].tolist():
        router = f"model.layers.{layer}.{names.block}.{names.router}."
        hidden = golden[f"layer{layer}_router_input"]
        ids, weights = route(
            model.config,
            tensors[router + "weight"].astype(np.float32),
            optional(f"model.layers.{layer}.{names.block}.{names.correction_bias}"),
            hidden,
            optional(router + "bias"),  # gpt-oss: a bias of the router's logits
        )
        ids, weights = np.asarray(ids), np.asarray(weights)
        expected_ids = golden[f"layer{layer}_topk_ids"]  # sorted by expert id per token
        assert ids.shape == expected_ids.shape and ids.dtype == np.int32 and weights.dtype == np.float32
        order = np.argsort(ids, axis=-1)
        ids, weights = np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)
        clear = golden[f"layer{layer}_margin"] > ROUTING_MIN_MARGIN
        assert clear.mean() > 0.8, "too few clear routing decisions to test: regenerate the goldens"
        np.testing.assert_array_equal(ids[clear], expected_ids[clear], err_msg=f"layer {layer} expert sets")
        np.testing.assert_allclose(
            weights[clear],
            golden[f"layer{layer}_topk_weights"][clear],
            rtol=ROUTING_WEIGHTS_RTOL,
            err_msg=f"layer {layer} top-k weights",
        )
