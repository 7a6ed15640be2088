"""JAX bindings of the C++ kernels (XLA FFI custom calls) in the compiled extension `hybridjit_ffi`.

The extension is a top-level module of its own, as jaxlib is to jax, so that this pure-Python package
imports from a source checkout too (the repository root on sys.path), using the extension that
`pip install .` built.
"""

import importlib.util

if importlib.util.find_spec("hybridjit_ffi") is None:
    raise ModuleNotFoundError(
        "hybridjit's compiled extension, hybridjit_ffi, is not installed in this Python environment: "
        "build and install it from the repository with `pip install .` (see README.md)",
        name="hybridjit_ffi",
    )
