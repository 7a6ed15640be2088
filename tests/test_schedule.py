"""The compiled decode step hands the routed experts to the CPU before the shared experts and takes them
back after: the order that lets the GPU compute shared experts while the CPU computes routed ones.
On a GPU the calls must also sit inside a command buffer (a CUDA graph)."""

import jax
import numpy as np
import pytest
from checkpoint_factory import tiny_config, write_checkpoint
from hlo_schedule import positions, schedule

import hybridjit
from hybridjit.models import deepseek_v3 as dsv3
from hybridjit.ops.async_experts import SUBMIT, WAIT


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("v3"), tiny_config("v3"), seed=3, weight_format="bf16")
    m = hybridjit.load(path)
    yield m
    m.close()


@pytest.fixture(scope="module")
def decode_order(model):
    cache = dsv3.init_cache(model.config, 2, 64, model.dtype)
    step = jax.jit(dsv3.decode_step, static_argnums=0, donate_argnums=4)
    zeros = np.zeros(2, np.int32)
    return schedule(step.lower(model.config, model.weights, zeros, zeros, cache).compile().as_text())


def test_shared_experts_run_between_submit_and_wait(model, decode_order):
    moe_layers = [i for i in range(model.config.num_hidden_layers) if model.config.is_moe_layer(i)]
    submits, waits = positions(decode_order, target=SUBMIT), positions(decode_order, target=WAIT)
    assert len(submits) == len(waits) == len(moe_layers)
    for layer, submit, wait in zip(moe_layers, submits, waits, strict=True):
        shared = positions(decode_order, op_name=f"/layer{layer}/shared_experts/")
        assert shared, f"no shared-expert work found for layer {layer}"
        assert submit < min(shared) and max(shared) < wait, (layer, submit, shared, wait)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="command buffers exist on the GPU backend only")
def test_decode_step_replays_as_a_cuda_graph(model):
    """XLA records the CUDA handlers into a command buffer and replays it: their bodies (which only enqueue,
    two per MoE layer and step without graphs) run less often than the CPU jobs they hand off. At
    DeepSeek-V3 geometry bench/decode.py measures zero body runs per step; this tiny model re-records some."""
    import hybridjit_ffi as _ffi

    cfg = model.config
    cache = dsv3.init_cache(cfg, 1, 64, model.dtype, model.placement.device)
    step = jax.jit(dsv3.decode_step, static_argnums=0, donate_argnums=4)
    tokens = np.zeros(1, np.int32)
    for i in range(3):  # compile, record
        tokens_out, cache = step(cfg, model.weights, tokens, np.full(1, i, np.int32), cache)
    np.asarray(tokens_out)
    _ffi.take_gpu_handoff_stats()
    steps = 8
    for i in range(3, 3 + steps):
        tokens_out, cache = step(cfg, model.weights, tokens, np.full(1, i, np.int32), cache)
    np.asarray(tokens_out)
    jobs, _, handler_runs = _ffi.take_gpu_handoff_stats()
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    assert jobs == steps * moe_layers
    assert handler_runs < 2 * jobs
