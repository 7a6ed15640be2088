"""load() sizes XLA's pinned host memory pool (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB) for the routed experts.

CI has no GPU: the decision is a pure function, tested here case by case; one load() in a fresh process
shows that it acts before the JAX backend starts.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridjit.checkpoint import Checkpoint
from hybridjit.models.registry import config_from_json
from hybridjit.pinned_experts import (
    HOST_MEMORY_LIMIT_VAR,
    host_memory_limit_action,
    host_memory_limit_gb,
    pinned_pool_room,
)
from hybridjit.resolve import default_model_dir
from hybridjit.weights import routed_expert_bytes

GIB = 2**30


@pytest.mark.parametrize(
    ("expert_gib", "current", "started", "platform", "action"),
    [
        (200, None, False, None, host_memory_limit_gb(200 * GIB)),  # unset: XLA's 64 GiB is too small
        (200, "100", False, None, host_memory_limit_gb(200 * GIB)),  # set too small: raised
        (200, "junk", False, "gpu", host_memory_limit_gb(200 * GIB)),  # not an integer: XLA takes 64
        (200, "500", False, None, None),  # large enough already
        (10, None, False, None, None),  # XLA's default 64 GiB holds them
        (200, None, False, "cpu", None),  # CPU only (JAX_PLATFORMS=cpu): the variable means nothing
        (200, "100", True, "cpu", None),
        (0, "1", False, None, None),  # no routed experts in host memory
        (200, "205", True, "gpu", None),  # started: less headroom than load() gives, but it holds them
        (10, None, True, "gpu", None),
    ],
)
def test_host_memory_limit_action(expert_gib, current, started, platform, action):
    assert host_memory_limit_action(expert_gib * GIB, current, started, platform) == action


def test_too_late_on_a_gpu_gives_the_exact_setting():
    wanted = host_memory_limit_gb(200 * GIB)
    assert 200 < wanted < 240  # the experts plus some headroom
    with pytest.raises(ValueError, match=rf"set {HOST_MEMORY_LIMIT_VAR}={wanted} in the environment before JAX"):
        host_memory_limit_action(200 * GIB, "100", True, "gpu")
    with pytest.raises(ValueError, match=rf"started with {HOST_MEMORY_LIMIT_VAR} unset \(64 GiB\)"):
        host_memory_limit_action(200 * GIB, None, True, "gpu")


def test_the_pool_room_beyond_the_experts_bounds_a_kv_cache_in_host_memory(monkeypatch):
    """What a KV cache in host memory may pin on a GPU: the pool less the experts and load()'s headroom for them."""
    monkeypatch.setenv(HOST_MEMORY_LIMIT_VAR, "300")
    assert pinned_pool_room(200 * GIB) == (300 - host_memory_limit_gb(200 * GIB)) * GIB
    monkeypatch.delenv(HOST_MEMORY_LIMIT_VAR)  # XLA's 64 GiB
    assert pinned_pool_room(10 * GIB) == (64 - host_memory_limit_gb(10 * GIB)) * GIB
    assert pinned_pool_room(200 * GIB) == 0


def test_routed_expert_bytes_come_from_the_index():
    ckpt = Checkpoint(default_model_dir())
    expected = sum(info.nbytes for name, info in ckpt.tensors.items() if ".mlp.experts." in name)
    assert _shipped_expert_bytes() == expected > 0


def _load_in_a_fresh_process(env: dict) -> str:
    """The variable's value after hybridjit.load() in a new process that had `env`."""
    script = f"import os, hybridjit; hybridjit.load(); print(os.environ.get({HOST_MEMORY_LIMIT_VAR!r}))"
    root = Path(__file__).parent.parent
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True, timeout=300, check=True
    )
    return result.stdout.strip().splitlines()[-1]


def test_load_sets_the_limit_before_the_backend_starts():
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env[HOST_MEMORY_LIMIT_VAR] = "1"  # below what the shipped model asks for with headroom
    assert _load_in_a_fresh_process(env) == str(host_memory_limit_gb(_shipped_expert_bytes()))
    assert _load_in_a_fresh_process({**env, "JAX_PLATFORMS": "cpu"}) == "1"  # CPU only: left alone


def _shipped_expert_bytes() -> int:
    path = default_model_dir()
    return routed_expert_bytes(config_from_json(path / "config.json"), Checkpoint(path))

