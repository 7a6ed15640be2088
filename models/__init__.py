"""Model families as pure JAX functions; installed as `hybridjit.models`."""
