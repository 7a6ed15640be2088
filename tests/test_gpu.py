"""The hybrid path on a GPU: attention, dense layers, shared experts, router, LM head and sampling on the
GPU, routed experts on the CPU behind the CUDA hand-off. Skipped without a GPU."""

import jax
import numpy as np
import pytest
from checkpoint_factory import tiny_config, write_checkpoint

import hybridjit
from hybridjit.ops.async_experts import GpuExpertJobError
from hybridjit.placement import Placement

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")

# Relative RMS error of GPU logits against the CPU-only path on the same checkpoint: float32 on both
# sides differs by summation order only; bfloat16 activations on the GPU by bf16 rounding per layer.
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}
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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hybrid_matches_cpu_only(checkpoint, cpu_model, dtype):
    gpu = hybridjit.load(checkpoint, dtype=dtype)
    try:
        assert gpu.placement.device.platform == "gpu"
        reference = cpu_model.logits(PROMPTS)
        logits = gpu.logits(PROMPTS)
        for i, p in enumerate(PROMPTS):
            assert rel_rms(logits[i, : len(p)], reference[i, : len(p)]) < TOLERANCE[dtype]
        if dtype == "float32":
            assert gpu.generate(PROMPTS, max_new_tokens=8) == cpu_model.generate(PROMPTS, max_new_tokens=8)
    finally:
        gpu.close()


def test_failed_cpu_job_releases_the_gpu_and_raises(checkpoint):
    gpu = hybridjit.load(checkpoint, dtype="float32")
    gpu.generate(PROMPTS[0], max_new_tokens=4)  # compiled, and recorded as a graph
    gpu.expert_layers[0].close()  # the recorded graph now names a layer that no longer exists
    for _ in range(2):  # fails each time, never hangs
        with pytest.raises((GpuExpertJobError, jax.errors.JaxRuntimeError, ValueError), match="unknown layer id"):
            gpu.generate(PROMPTS[0], max_new_tokens=4)
    gpu.close()
