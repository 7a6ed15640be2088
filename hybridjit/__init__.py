"""hybridjit: CPU-GPU hybrid inference of large Mixture-of-Experts models as compiled JAX/XLA programs."""

from hybridjit.engine import Model, load

__version__ = "0.1.0"
__all__ = ["Model", "load", "__version__"]
