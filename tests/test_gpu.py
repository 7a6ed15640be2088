"""The hybrid path on a GPU: attention, dense layers, shared experts, router, LM head and sampling on the
GPU, routed experts on the CPU behind the CUDA hand-off. Skipped without a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_factory import tiny_config, write_checkpoint
from hybrid_placement import hybrid

import hybridjit
from hybridjit.ops.async_experts import GpuExpertJobError
from hybridjit.ops.routed_experts import register_layer, routed_experts, routed_experts_host
from hybridjit.placement import Placement
from hybridjit.serving.engine import SINGLE_SLOT_HYBRID_DECODE_STEPS, Engine

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")

# Relative RMS error of GPU logits against the float32 CPU-only path on the same checkpoint. float32 on
# both sides differs by summation order only. bfloat16 activations alone move the logits by several
# percent (rounding per layer, and a routing choice that flips), so the GPU in bfloat16 must be as close
# to float32 as the CPU in bfloat16 is, within this slack.
FLOAT32_RTOL = 1e-4
BFLOAT16_SLACK = 1e-2
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13]]


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def checkpoint(request, tmp_path_factory):
    config = tiny_config("v3", eos_token_id=None)
    return write_checkpoint(tmp_path_factory.mktemp(request.param), config, seed=11, weight_format=request.param)


@pytest.fixture(scope="module")
def cpu_model(checkpoint):
    m = hybridjit.load(checkpoint, placement=Placement.default("float32", jax.devices("cpu")[0]))
    yield m
    m.close()


def rel_rms(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


def assert_greedy_up_to_ties(reference, prompt: list[int], tokens: list[int]):
    """Each of `tokens` (greedy from `prompt`) is the reference's choice, or within FLOAT32_RTOL of the logits'
    scale from it: float32 on the GPU and on the CPU differ by summation order, which can flip a near-tie (the
    tiny random model has one of 9e-5 after 5 tokens of PROMPTS[0] in FP8); a decode error moves logits by far
    more. Judged on the reference's logits teacher-forced on `tokens`, so one flip does not derail the rest."""
    logits = np.asarray(reference.logits([prompt + tokens]))[0, len(prompt) - 1 : -1]
    for step, (row, token) in enumerate(zip(logits, tokens, strict=True)):
        best = int(np.argmax(row))
        gap = float(row[best] - row[token])
        assert gap <= FLOAT32_RTOL * float(np.abs(row).max()), f"step {step}: {token} where {best}, {gap:.3g} behind"


def test_hybrid_matches_cpu_only_in_float32(checkpoint, cpu_model):
    gpu = hybridjit.load(checkpoint, placement=hybrid("float32"))
    try:
        assert gpu.placement.device.platform == "gpu"
        reference, logits = cpu_model.logits(PROMPTS), gpu.logits(PROMPTS)
        for i, p in enumerate(PROMPTS):
            assert rel_rms(logits[i, : len(p)], reference[i, : len(p)]) < FLOAT32_RTOL
        for prompt, tokens in zip(PROMPTS, gpu.generate(PROMPTS, max_new_tokens=8), strict=True):
            assert_greedy_up_to_ties(cpu_model, prompt, tokens)
        # One sequence alone decodes several steps a call around the hand-off (3 calls, the last cut short).
        assert Engine(gpu, 1, 64).steps == SINGLE_SLOT_HYBRID_DECODE_STEPS > 1
        assert_greedy_up_to_ties(cpu_model, PROMPTS[0], gpu.generate(PROMPTS[0], max_new_tokens=10))
    finally:
        gpu.close()


def test_hybrid_in_bfloat16_is_as_accurate_as_the_cpu_in_bfloat16(checkpoint, cpu_model):
    cpu_bf16 = hybridjit.load(checkpoint, placement=Placement.default("bfloat16", jax.devices("cpu")[0]))
    gpu = hybridjit.load(checkpoint, placement=hybrid("bfloat16"))
    try:
        reference = cpu_model.logits(PROMPTS)
        gpu_logits, cpu_logits = gpu.logits(PROMPTS), cpu_bf16.logits(PROMPTS)
        for i, p in enumerate(PROMPTS):
            cpu_error = rel_rms(cpu_logits[i, : len(p)], reference[i, : len(p)])
            assert rel_rms(gpu_logits[i, : len(p)], reference[i, : len(p)]) < cpu_error + BFLOAT16_SLACK
    finally:
        gpu.close()
        cpu_bf16.close()


def test_failed_cpu_job_releases_the_gpu_and_raises(checkpoint):
    gpu = hybridjit.load(checkpoint, placement=hybrid("float32"))
    gpu.generate(PROMPTS[0], max_new_tokens=4)  # compiled, and recorded as a graph
    gpu.expert_layers[0].close()  # the recorded graph now names a layer that no longer exists
    for _ in range(2):  # fails each time, never hangs
        with pytest.raises((GpuExpertJobError, jax.errors.JaxRuntimeError, ValueError), match="unknown layer id"):
            gpu.generate(PROMPTS[0], max_new_tokens=4)
    gpu.close()


def test_every_handoff_returns_its_own_jobs_result():
    """Many jobs back to back in one program, alternating between two layers, each on other inputs through the
    same staging: every result must be the CPU's result for that job's own inputs. A staging read that sees an
    earlier job's data, or a wait released by an earlier job's done flag, returns another job's result."""
    rng = np.random.default_rng(3)
    hidden, inter, n_experts, k, tokens, jobs = 256, 64, 8, 2, 3, 48

    def random_layer():
        def matrices(rows, cols):
            return [(0.1 * rng.standard_normal((rows, cols))).astype(np.float32) for _ in range(n_experts)]

        return register_layer(matrices(inter, hidden), matrices(inter, hidden), matrices(hidden, inter))

    layers = [random_layer(), random_layer()]
    try:
        x = rng.standard_normal((tokens, hidden)).astype(np.float32)
        ids = np.stack([[rng.choice(n_experts, k, replace=False) for _ in range(tokens)] for _ in range(jobs)])
        ids = ids.astype(np.int32)
        weights = rng.random((jobs, tokens, k)).astype(np.float32)

        @jax.jit
        def chain(x, ids, weights):
            return jnp.stack([routed_experts(x + j, ids[j], weights[j], layer=layers[j % 2].id) for j in range(jobs)])

        for _ in range(3):  # the first run records the command buffer, the others replay it
            results = np.asarray(chain(x, ids, weights))
            for j in range(jobs):
                expected = routed_experts_host(layers[j % 2], x + np.float32(j), ids[j], weights[j])
                np.testing.assert_allclose(results[j], expected, rtol=1e-6, atol=1e-6, err_msg=f"job {j}")
    finally:
        for layer in layers:
            layer.close()
