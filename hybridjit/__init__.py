"""hybridjit: CPU-GPU hybrid inference of large Mixture-of-Experts models as compiled JAX/XLA programs.

    model = hybridjit.load()            # the embedded default model; or a name, repo id or checkpoint path
    model.generate("def fibonacci(n):")
    hybridjit.batch(model, "prompts.jsonl", "completions.jsonl")  # many requests for throughput, resumable

The names below are imported on first use, so that `import hybridjit` (and the command line's --help) does
not start JAX.
"""

import importlib

__version__ = "0.1.0"
__all__ = ["Model", "NonFiniteLogitsError", "batch", "load", "kernel_info", "__version__"]

_LAZY = {
    "Model": "hybridjit.engine",
    "load": "hybridjit.engine",
    "batch": "hybridjit.serving.batch",
    "NonFiniteLogitsError": "hybridjit.engine",
    "kernel_info": "hybridjit.ops.routed_experts",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hybridjit' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
