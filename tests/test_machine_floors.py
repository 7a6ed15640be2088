"""The machine's floors (hybridjit/machine_floors.py): measured once, cached per machine in the cache directory, and
measured again where the cache is for another machine, unreadable or refreshed on request; the CPU expert rate is
measured on a real registered layer and cached per layer format and shapes; `hybridjit floors` shows them."""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hybrid_placement import hybrid

import hybridjit
from hybridjit import cli, machine_floors
from hybridjit.machine_floors import FloorCache, MachineFloors
from hybridjit.ops import cpu_attention
from hybridjit.ops.routed_experts import kernel_info
from hybridjit.pinned_experts import default_block_experts
from hybridjit.synthetic import geometry_config

ROOT = Path(__file__).resolve().parents[1]
CPU = jax.devices("cpu")[0]


@pytest.fixture
def measured(monkeypatch):
    """Counts the real measurements (kept small: the host read floor over 64 MB arrays)."""
    monkeypatch.setattr(machine_floors, "HOST_READ_BYTES", 1 << 26)
    calls = []
    measure = machine_floors.measure

    def counting(device):
        calls.append(device)
        return measure(device)

    monkeypatch.setattr(machine_floors, "measure", counting)
    return calls


def test_floors_are_measured_once_then_read_from_the_cache(tmp_path, measured):
    cache = FloorCache(tmp_path)
    first = cache.floors(CPU)
    assert first.host_read_gbps > 0 and first.pcie_gbps is None and first.gpu_tflops is None  # no accelerator
    assert first.machine == machine_floors.machine_key(CPU)
    assert FloorCache(tmp_path).floors(CPU) == first and len(measured) == 1
    stored = json.loads((tmp_path / machine_floors.CACHE_FILE).read_text())
    assert MachineFloors(**stored[first.machine]["floors"]) == first


def test_another_machine_an_unreadable_file_or_remeasure_measure_again(tmp_path, measured, monkeypatch):
    cache = FloorCache(tmp_path)
    cache.floors(CPU)
    cache.floors(CPU, remeasure=True)
    assert len(measured) == 2
    (tmp_path / machine_floors.CACHE_FILE).write_text("{not json")
    cache.floors(CPU)
    assert len(measured) == 3 and json.loads((tmp_path / machine_floors.CACHE_FILE).read_text())  # rewritten whole
    this_machine = machine_floors.machine_key(CPU)
    monkeypatch.setattr(machine_floors, "machine_key", lambda device: "another machine")
    assert cache.floors(CPU).machine == "another machine" and len(measured) == 4
    assert set(json.loads((tmp_path / machine_floors.CACHE_FILE).read_text())) == {"another machine", this_machine}


def test_the_cpu_expert_rate_is_measured_on_the_layer_and_cached_by_its_key(tmp_path):
    with hybridjit.load() as model:  # the embedded model: its experts in the host bank
        layer, k = model.expert_layers[0], model.config.num_experts_per_tok
        rate = machine_floors.cpu_expert_tflops(layer.id, layer.hidden, layer.inter, layer.n_experts, k, tokens=256,
                                                repeats=1)
    assert rate > 0
    cache, asked = FloorCache(tmp_path), []
    for _ in range(2):
        assert cache.cpu_expert_tflops(CPU, "bf16 64x32", lambda: asked.append(1) or 1.5) == 1.5
    assert cache.cpu_expert_tflops(CPU, "fp8 64x32", lambda: 0.5) == 0.5
    assert len(asked) == 1
    assert cache.cpu_expert_rates(machine_floors.machine_key(CPU)) == {"bf16 64x32": 1.5, "fp8 64x32": 0.5}


def test_the_floors_command_prints_them_as_json(tmp_path):
    env = {**os.environ, "HYBRIDJIT_CACHE": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-m", "hybridjit", "floors"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["host_read_gbps"] > 0 and shown["cache"] == str(tmp_path / machine_floors.CACHE_FILE)
    assert (tmp_path / machine_floors.CACHE_FILE).exists()
    assert shown["cpu_experts_tflops"] == {}  # said why on stderr, not left an unexplained empty dict
    why = "the rate only decides whether a prompt's routed experts are streamed to an accelerator, and this machine"
    assert f"cpu_experts_tflops: none measured: {why} has none" in out.stderr


def test_the_floors_command_on_a_gpu_machine_says_when_a_cpu_expert_rate_is_measured(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HYBRIDJIT_CACHE", str(tmp_path))
    gpu_machine = MachineFloors("a gpu", host_read_gbps=30.0, pcie_gbps=50.0, gpu_tflops=900.0, gpu_hbm_gbps=3e3)
    monkeypatch.setattr(machine_floors, "measure", lambda device: gpu_machine)
    assert cli.main(["floors"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["cpu_experts_tflops"] == {}
    assert "none measured: a model's is measured the first time it chooses a prompt's prefill path" in captured.err


@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="the accelerator's floors need one")
def test_on_a_gpu_the_prefill_path_reads_this_machines_measured_rates(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDJIT_CACHE", str(tmp_path))
    with hybridjit.load(placement=hybrid()) as model:  # every routed expert in pinned host memory
        rates = model.prefill_rates()
    floors = FloorCache(tmp_path).floors(jax.devices()[0])
    assert floors.pcie_gbps > 1 and floors.gpu_tflops > 1 and floors.gpu_hbm_gbps > 10
    assert (rates.pcie_gbps, rates.gpu_tflops) == (floors.pcie_gbps, floors.gpu_tflops)
    assert list(FloorCache(tmp_path).cpu_expert_rates(floors.machine).values()) == [rates.cpu_expert_tflops]


def test_a_models_cpu_expert_rate_is_measured_once_per_call_size(tmp_path, monkeypatch):
    """Model.cpu_expert_tflops(tokens): each call size measured once on this machine, then read from the cache; the
    prefill-path choice's size (CPU_EXPERT_TOKENS) keeps the key it always had."""
    monkeypatch.setenv("HYBRIDJIT_CACHE", str(tmp_path))
    asked = []

    def fake(layer_id, hidden, inter, experts, k, tokens=machine_floors.CPU_EXPERT_TOKENS, repeats=2, **where):
        asked.append(tokens)
        return tokens / 1000

    monkeypatch.setattr(machine_floors, "cpu_expert_tflops", fake)
    with hybridjit.load() as model:
        rates = [model.cpu_expert_tflops(t) for t in (64, 64, 1024, machine_floors.CPU_EXPERT_TOKENS)]
        layer, k = model.expert_layers[0], model.config.num_experts_per_tok
    assert rates == [0.064, 0.064, 1.024, 4.096] and asked == [64, 1024, machine_floors.CPU_EXPERT_TOKENS]
    cached = FloorCache(tmp_path).cpu_expert_rates(machine_floors.machine_key(jax.devices()[0]))
    key = f"{layer.format} experts {layer.hidden}x{layer.inter}, {k} of {layer.n_experts} a token"
    assert cached == {f"{key}, 64 tokens a call": 0.064, f"{key}, 1024 tokens a call": 1.024, key: 4.096}


def test_the_cpu_expert_rate_beside_the_links_copies_is_timed_on_the_pool_asked_for(tmp_path, monkeypatch):
    """machine_floors.cpu_expert_tflops(threads=, copying_to=) times the layer on a pool of that size while pinned
    memory is copied to the device back to back, then leaves the pool as it was; Model.cpu_expert_tflops keeps such
    a rate under a key of its own (the co-executed share's, Floors.of_machine)."""
    with hybridjit.load() as model:
        layer, k = model.expert_layers[0], model.config.num_experts_per_tok
        before, pools, rounds = kernel_info()["threads"], [], []
        real_copying = machine_floors.copying

        @contextlib.contextmanager
        def watched_copying(devices, nbytes=None):
            pools.append(kernel_info()["threads"])  # entered inside the pool
            with real_copying(devices, 1 << 20) as ends:
                yield ends
            rounds.append(len(ends))

        monkeypatch.setattr(machine_floors, "copying", watched_copying)
        rate = machine_floors.cpu_expert_tflops(layer.id, layer.hidden, layer.inter, layer.n_experts, k, tokens=64,
                                                repeats=1, threads=1, copying_to=CPU)
        assert rate > 0 and pools == [1] and rounds[0] >= 1  # timed on one thread while rounds of copies ran
        assert kernel_info()["threads"] == before

        monkeypatch.setenv("HYBRIDJIT_CACHE", str(tmp_path))
        asked = []
        monkeypatch.setattr(machine_floors, "cpu_expert_tflops", lambda *layer, threads, copying_to, weighted: (
            asked.append((layer[-1], threads, copying_to, weighted)) or 0.25))
        assert (model.cpu_expert_tflops(1024, 3, co_executed=True) == model.cpu_expert_tflops(1024, 3, co_executed=True)
                == 0.25)  # fmt: skip
        assert asked == [(1024, 3, model.placement.device, default_block_experts(layer.n_experts))]
    key = f"{layer.format} experts {layer.hidden}x{layer.inter}, {k} of {layer.n_experts} a token"
    cached = FloorCache(tmp_path).cpu_expert_rates(machine_floors.machine_key(model.placement.device))
    assert cached == {f"{key}, 1024 tokens a call, 3 threads, one block's experts, the link copying": 0.25}


def test_a_co_executed_shares_rate_weighs_only_its_experts_pairs(monkeypatch):
    """machine_floors.cpu_expert_tflops(weighted=n): the call has weight only on pairs routed to the last n experts
    (the others weigh zero and point at a valid expert, as a co-executed step's call for its CPU blocks), and the
    rate counts the FLOPs of those pairs alone."""
    calls = []
    monkeypatch.setattr(machine_floors, "best_seconds", lambda call, x, ids, w, **_: calls.append((ids, w)) or 1.0)
    with hybridjit.load() as model:
        layer, k = model.expert_layers[0], model.config.num_experts_per_tok
        n = layer.n_experts // 4
        rate = machine_floors.cpu_expert_tflops(layer.id, layer.hidden, layer.inter, layer.n_experts, k, tokens=256,
                                                weighted=n)
    ids, w = (np.asarray(a) for a in calls[0])
    first = layer.n_experts - n
    assert ids.shape == (256, k) and (ids[w > 0] >= first).all() and (ids[w == 0] == first).all()
    assert rate * 1e12 == pytest.approx(2 * 3 * layer.hidden * layer.inter * np.count_nonzero(w))
    assert 0 < np.count_nonzero(w) < ids.size


@pytest.mark.parametrize("geometry", ["deepseek-v3", "qwen3-30b-a3b"])
def test_the_cpu_attention_rate_is_timed_at_the_models_own_shapes(geometry, monkeypatch):
    """MLA's absorbed kernel over V3's latent and rope key with its 128 heads; GQA's over Qwen3's 4 KV heads with its
    32 query heads: each model its own kernel, shapes and cache dtype, its FLOPs as the cost model counts them."""
    cfg = geometry_config(geometry, weight_format="bf16")
    timed = []

    def recorded(name):
        kernel = getattr(cpu_attention, name)

        def call(*args):
            timed.append((name, [(a.shape, a.dtype) for a in args[:-2]]))
            return kernel(*args)

        monkeypatch.setattr(cpu_attention, name, call)

    recorded("gqa_decode"), recorded("mla_decode")
    gflops = machine_floors.cpu_attention_gflops(cfg, jnp.bfloat16, slots=2, context=32, repeats=1)
    assert 0 < gflops < float("inf")
    q, bf16 = np.dtype(np.float32), np.dtype(jnp.bfloat16)
    if geometry == "deepseek-v3":
        expected = ("mla_decode", [((2, 128, 512), q), ((2, 128, 64), q), ((2, 32, 512), bf16), ((2, 32, 64), bf16)])
    else:
        expected = ("gqa_decode", [((2, 32, 128), q), ((2, 32, 4, 128), bf16), ((2, 32, 4, 128), bf16)])
    assert timed and all(t == expected for t in timed)
