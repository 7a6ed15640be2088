"""Shared test settings: the same suite runs on XLA:CPU (CI) and on the GPU machine."""

import gc

import jax
import pytest

# Tests compare computations of the same math: keep GPU float32 dots in full float32 (not TF32).
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every compiled program and unreachable buffer after each test module. The suite compiles thousands
    of XLA:CPU executables (a family per config, a program per shape) and the jit caches would keep them all;
    each executable's code takes memory mappings, and one process has at most vm.max_map_count (65530) of them:
    the whole suite in one process once ran out of mappings and crashed in the compiler."""
    yield
    jax.clear_caches()
    gc.collect()
