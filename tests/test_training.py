"""The training step of the shipped model: gradients flow through our model functions, the loss falls, and
the correction bias is balanced by expert load instead of trained."""

import numpy as np
import optax
from checkpoint_factory import tiny_config

from hybridjit.models import train_tiny
from hybridjit.models.registry import config_from_hf


def test_training_step_learns_and_balances():
    cfg = config_from_hf(tiny_config("v3"))
    weights = train_tiny.init_weights(cfg, seed=0)
    optimizer = optax.adam(3e-3)
    state = optimizer.init(weights)
    step = train_tiny.make_train_step(cfg, optimizer)
    batch = np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 17)).astype(np.int32)
    losses = []
    for _ in range(8):
        weights, state, loss = step(weights, state, batch)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.5  # memorising one batch
    biases = [np.asarray(layer.mlp.correction_bias) for layer in weights.layers if hasattr(layer.mlp, "router")]
    # Each step moves every bias by exactly +-rate (or 0 at perfect balance): 8 steps, at most 8 * rate.
    assert all(np.abs(b).max() <= 8 * train_tiny.BIAS_UPDATE_RATE + 1e-6 for b in biases)
    assert any(np.abs(b).max() > 0 for b in biases)
