"""hybridjit: CPU-GPU hybrid inference of large Mixture-of-Experts models as compiled JAX/XLA programs."""

from hybridjit.engine import Model, NonFiniteLogitsError, load

__version__ = "0.1.0"
__all__ = ["Model", "NonFiniteLogitsError", "load", "__version__"]
