"""JAX bindings of the C++ kernels in `hybridjit._ffi` (XLA FFI custom calls)."""
