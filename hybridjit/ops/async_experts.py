"""The routed-experts call split into submit and wait, and the CUDA-platform handlers of all routed-expert calls.

Between `submit_routed_experts` and `wait_routed_experts` the GPU is free: XLA schedules there whatever the
data dependencies put there (the shared experts, another micro-batch's attention) while the CPU computes the
routed experts. The order comes from aliased pass-through operands (ffi/routed_experts_async.h):

    pending, x = submit_routed_experts(x, ids, weights, layer=..., slot=0)   # consumers of x run after
    shared = mlp(shared_weights, x)
    routed, shared = wait_routed_experts(pending, shared, top_k=k, slot=0)  # producers of shared run before

On XLA:CPU the submit computes the result and the wait is free, so the same program runs everywhere.
On CUDA the calls enqueue only copies and stream memory operations at fixed addresses and can be recorded
into CUDA graphs. A CPU job that fails still releases the stream; `raise_gpu_errors()` raises its error.
"""

import jax
import numpy as np

import hybridjit_ffi as _ffi
from hybridjit.ops.routed_experts import TARGET, check_operands

SUBMIT = "hybridjit_routed_experts_submit"
WAIT = "hybridjit_routed_experts_wait"

jax.ffi.register_ffi_target(SUBMIT, _ffi.routed_experts_submit_cpu(), platform="cpu")
jax.ffi.register_ffi_target(WAIT, _ffi.routed_experts_wait_cpu(), platform="cpu")
if _ffi.has_cuda:
    jax.ffi.register_ffi_target(TARGET, _ffi.routed_experts_cuda(), platform="CUDA")
    jax.ffi.register_ffi_target(SUBMIT, _ffi.routed_experts_submit_cuda(), platform="CUDA")
    jax.ffi.register_ffi_target(WAIT, _ffi.routed_experts_wait_cuda(), platform="CUDA")


def submit_routed_experts(x, topk_ids, topk_weights, *, layer: int, slot: int = 0):
    """Hands the routed experts of x [T, H] to the CPU: (pending result, x passed through)."""
    x, topk_ids, topk_weights, layer = check_operands(x, topk_ids, topk_weights, layer)
    call = jax.ffi.ffi_call(
        SUBMIT,
        (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(x.shape, x.dtype)),
        input_output_aliases={0: 1},
    )
    return call(x, topk_ids, topk_weights, layer=np.int64(layer), slot=np.int64(slot))


def wait_routed_experts(pending, other, *, top_k: int, slot: int = 0):
    """The result of the matching submit, once `other` (computed meanwhile) exists: (result, other)."""
    call = jax.ffi.ffi_call(
        WAIT,
        (jax.ShapeDtypeStruct(pending.shape, pending.dtype), jax.ShapeDtypeStruct(other.shape, other.dtype)),
        input_output_aliases={0: 0, 1: 1},
    )
    return call(pending, other, slot=np.int64(slot), top_k=np.int64(top_k))


class GpuExpertJobError(RuntimeError):
    """A routed-expert job that failed on the CPU while the GPU waited for it."""


def raise_gpu_errors() -> None:
    """Raises the first failure of a CPU job run for the GPU since the last call, if any."""
    if _ffi.has_cuda and (error := _ffi.take_gpu_error()):
        raise GpuExpertJobError(error)
