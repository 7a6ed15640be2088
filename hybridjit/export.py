"""Writes checkpoints in the Hugging Face layout: config.json, safetensors shards and their index."""

import json
import stat
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from hybridjit.checkpoint import INDEX_FILE
from hybridjit.models.common.experts import Experts
from hybridjit.models.registry import ModelConfig, family_of


class ExpertNames:
    """The names of every expert's matrix of one projection: one leaf of the names tree, as the stacked experts
    are one leaf of the weights tree."""

    def __init__(self, names: list[str]):
        self.names = names


def export_tensors(
    cfg: ModelConfig, weights, dtype=ml_dtypes.bfloat16
) -> dict[str, np.ndarray]:
    """Checkpoint tensors of a weights pytree whose routed experts are JAX-held (e.g. a trained model).

    Correction biases stay float32, as in the real checkpoints; everything else is stored as `dtype`.
    """

    def routed(names, layer):
        return Experts(*(ExpertNames(ns) for ns in names)), None

    names = family_of(cfg).ckpt.build_weights(cfg, lambda name, dtype=None: name, routed)
    tensors = {}
    for name, leaf in zip(jax.tree.leaves(names), jax.tree.leaves(weights), strict=True):
        array = np.asarray(leaf)
        target = np.float32 if name.endswith("e_score_correction_bias") else dtype
        if isinstance(name, ExpertNames):  # stacked routed experts: one tensor per expert
            tensors.update({n: array[e].astype(target) for e, n in enumerate(name.names)})
        else:
            tensors[name] = array.astype(target)
    return tensors


def save_checkpoint(
    directory, config: dict, tensors: dict[str, np.ndarray], max_shard_bytes: int = 4 << 30
) -> Path:
    """Writes `tensors` as safetensors shards of at most max_shard_bytes (an index when more than one)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        if shards[-1] and size + tensors[name].nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += tensors[name].nbytes
    if len(shards) == 1:
        _save_shard(directory / "model.safetensors", tensors, shards[0])
    else:
        weight_map = {}
        for i, names in enumerate(shards):
            file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _save_shard(directory / file_name, tensors, names)
            weight_map.update(dict.fromkeys(names, file_name))
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
            "weight_map": weight_map,
        }
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def _save_shard(path: Path, tensors: dict[str, np.ndarray], names: list[str]):
    """One safetensors file, with the mode any new file gets (0666 less the umask).

    safetensors writes a private temporary file (mode 0600) and renames it over `path`: so `path` is first
    created the usual way, and the written file is given that file's mode.
    """
    path.touch()
    mode = stat.S_IMODE(path.stat().st_mode)
    save_file({n: np.ascontiguousarray(tensors[n]) for n in names}, str(path))
    path.chmod(mode)
