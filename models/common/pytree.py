"""Registered-dataclass pytrees: the weights and caches of every family."""

import dataclasses

import jax


def pytree(cls=None, *, meta=()):
    """Registers a dataclass as a pytree whose fields are leaves except the static `meta` ones."""

    def wrap(cls):
        cls = dataclasses.dataclass(cls)
        data = [f.name for f in dataclasses.fields(cls) if f.name not in meta]
        return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=list(meta))

    return wrap if cls is None else wrap(cls)
