"""Shared test settings: the same suite runs on XLA:CPU (CI) and on the GPU machine."""

import jax

# Tests compare computations of the same math: keep GPU float32 dots in full float32 (not TF32).
jax.config.update("jax_default_matmul_precision", "highest")
