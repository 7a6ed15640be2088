"""Selecting the CPU expert kernel family for a block of a test."""

from contextlib import contextmanager

from hybridjit.ops.routed_experts import kernel_info, set_amx_min_tokens, set_cpu_kernel, set_gguf_tile_min_tokens

# The fastest family that multiplies float32 activations as float32: AVX-512 and AMX round them to
# bfloat16 first (2^-8 relative, tests/test_cpu_kernels.py), which on a tiny random model is enough to flip
# routing decisions. Whole-model comparisons against float32 references test the model, so they run here.
EXACT_FLOAT32_FAMILY = "avx2" if "avx2" in kernel_info()["supported"] else "generic"


@contextmanager
def kernel_family(family, amx_min_tokens=1, gguf_tile_min_tokens=0):
    """Selects a family for the block; with amx, AMX from `amx_min_tokens` tokens per expert (1: always); with
    avx512, GGUF experts on the tile kernel from `gguf_tile_min_tokens` (0: its measured default)."""
    info = kernel_info()
    set_cpu_kernel(family)
    set_amx_min_tokens(amx_min_tokens)
    set_gguf_tile_min_tokens(gguf_tile_min_tokens)
    try:
        yield
    finally:
        set_cpu_kernel(info["kernel"])
        set_amx_min_tokens(info["amx_min_tokens"])
        set_gguf_tile_min_tokens(info["gguf_tile_min_tokens"])
