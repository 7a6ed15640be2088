"""Expert Deferral and Expert Skipping in the decode step, against a float64 reference of their formulas.

Reference (KTransformers §4): with the routed experts of a token ranked by routing weight, skipping drops
the lowest n_skipped; deferral adds the next-lowest n_deferred of MoE layer k at layer k+1,
    O_k = I_k + S_k(I_k) + R_k^imm(I_k) + R_{k-1}^def(I_{k-1}),
and the last MoE layer defers nothing. The routed experts of the reference are computed in float64 on the
checkpoint's dequantized weights; attention, norms, router and shared experts are the model's own blocks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_factory import as_float32, read_tensors, tiny_config, write_checkpoint
from hybrid_placement import hybrid

import hybridjit
from hybridjit.models import deepseek_v3 as dsv3
from hybridjit.models.common import decoder
from hybridjit.ops.routed_experts import kernel_info

# float32 model vs float64 routed experts in the reference: rounding only; the AVX-512 and AMX kernels also
# round the experts' activations to bfloat16 (2^-8).
RTOL = 5e-3 if kernel_info()["kernel"] in ("avx512", "amx") else 1e-4
# Below this relative change a schedule would be indistinguishable from the plain model in this test.
MIN_EFFECT = 1e-3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("v3"), tiny_config("v3"), seed=21, weight_format="fp8")
    model = hybridjit.load(path, placement=hybrid("float32"))
    tensors = as_float32(read_tensors(path))
    yield model, tensors
    model.close()


def expert_fp64(tensors, layer, x, ids, weights):
    """sum_k w_k * down_e(silu(gate_e x) * up_e x) in float64; x [b, d], ids/weights [b, k]."""
    out = np.zeros(x.shape, np.float64)
    for b in range(x.shape[0]):
        for e, wt in zip(ids[b], weights[b], strict=True):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            gate, up, down = (tensors[p + f"{n}_proj.weight"].astype(np.float64) for n in ("gate", "up", "down"))
            g = gate @ x[b]
            out[b] += wt * (down @ ((g / (1 + np.exp(-g))) * (up @ x[b])))
    return out


def reference_step(cfg, w, tensors, tokens, positions, cache, n_deferred, n_skipped):
    moe_layers = [i for i, layer in enumerate(w.layers) if isinstance(layer.mlp, dsv3.MoE)]
    x = w.embed[tokens][:, None]
    carried = None
    for i, layer in enumerate(w.layers):
        h, _ = dsv3.attention_absorbed(
            cfg, layer.attn, dsv3.rms_norm(x, layer.attn_norm, cfg.rms_norm_eps), positions[:, None], cache[i]
        )
        x = x + h
        hn = dsv3.rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)[:, 0]
        if not isinstance(layer.mlp, dsv3.MoE):
            x = x + dsv3.mlp(layer.mlp, hn)[:, None]
            continue
        ids, weights = (np.asarray(a) for a in dsv3.route(cfg, layer.mlp.router, layer.mlp.correction_bias, hn))
        order = np.argsort(-weights, axis=-1, kind="stable")
        ids, weights = np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)
        deferred = n_deferred if i != moe_layers[-1] else 0
        k = cfg.num_experts_per_tok - n_skipped - deferred
        h64 = np.asarray(hn, np.float64)
        out = expert_fp64(tensors, i, h64, ids[:, :k], weights[:, :k]) + np.asarray(dsv3.mlp(layer.mlp.shared, hn))
        if carried is not None:
            out += carried
        carried = expert_fp64(tensors, i, h64, ids[:, k : k + deferred], weights[:, k : k + deferred])
        x = x + jnp.asarray(out, jnp.float32)[:, None]
    return np.asarray(decoder.logits(cfg, w, x)[:, 0])


def prefilled_cache(model, batch):
    cfg = model.config
    prompts = np.array([[5, 17, 42, 99, 3, 250], [11, 12, 13, 14, 15, 16]][:batch], np.int32)
    cache = dsv3.init_cache(cfg, batch, 16, np.float32)
    _, cache = dsv3.prefill(cfg, model.weights, prompts, cache)
    return np.array([7, 8][:batch], np.int32), np.full(batch, prompts.shape[1], np.int32), cache


def rel_rms(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


@pytest.mark.parametrize(("n_deferred", "n_skipped"), [(0, 0), (1, 0), (2, 0), (3, 0), (0, 2), (1, 1)])
def test_schedule_matches_float64_reference(setup, n_deferred, n_skipped):
    model, tensors = setup
    cfg, w = model.config, model.weights
    tokens, positions, cache = prefilled_cache(model, batch=2)
    schedule = dsv3.ExpertSchedule(n_deferred=n_deferred, n_skipped=n_skipped)
    step = jax.jit(dsv3.decode_step, static_argnums=(0, 5))
    logits, _ = step(cfg, w, tokens, positions, cache, schedule)
    expected = reference_step(cfg, w, tensors, tokens, positions, cache, n_deferred, n_skipped)
    assert rel_rms(np.asarray(logits), expected) < RTOL
    plain = reference_step(cfg, w, tensors, tokens, positions, cache, 0, 0)
    assert (rel_rms(expected, plain) > MIN_EFFECT) == (n_deferred + n_skipped > 0)


def test_schedule_that_leaves_no_immediate_expert_is_refused(setup):
    model, _ = setup
    tokens, positions, cache = prefilled_cache(model, batch=1)
    with pytest.raises(ValueError, match="leaves no immediate expert of the 4 routed per token"):
        dsv3.decode_step(model.config, model.weights, tokens, positions, cache, dsv3.ExpertSchedule(n_deferred=4))
