"""Which routed experts each MoE layer keeps resident on the GPU, as data: chosen from activation counts (a probe
of sample prompts, as CoX-MoE does, or counts gathered while serving), saved and reloaded as JSON, and applied to
a weights pytree (models/common/resident_experts.py computes with it).

The expert bank in host memory keeps every expert whatever the residency, so a residency can change between
steps: only the device copies change, and a step that has the same number of resident experts per layer runs
the same compiled program.
"""

import dataclasses
import json
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hybridjit.models.common.moe import MoE
from hybridjit.models.common.resident_experts import ResidentExperts
from hybridjit.models.registry import family_of
from hybridjit.serving.engine import bucket

FORMAT = "hybridjit-residency"


class ResidencyError(ValueError):
    """A residency file or object that does not fit the model: names the file and the field."""


@dataclasses.dataclass(frozen=True)
class Residency:
    """MoE layer index -> the ids of its routed experts held on the device (sorted; layers absent hold none)."""

    layers: Mapping[int, tuple[int, ...]]

    def __post_init__(self):
        object.__setattr__(self, "layers", {int(k): tuple(sorted(int(i) for i in v)) for k, v in self.layers.items()})

    @property
    def experts(self) -> int:
        return sum(len(ids) for ids in self.layers.values())

    @classmethod
    def most_used(cls, counts: Mapping[int, np.ndarray], per_layer: int) -> "Residency":
        """The `per_layer` most activated experts of each layer of `counts` (layer -> activations per expert);
        ties go to the lower id, so a layer without counts holds its first experts."""
        return cls({layer: tuple(np.argsort(-np.asarray(c), kind="stable")[:per_layer]) for layer, c in counts.items()})

    def covered_share(self, counts: Mapping[int, np.ndarray]) -> float:
        """The share of the activations in `counts` whose expert this residency holds on the device."""
        total = sum(float(np.sum(c)) for c in counts.values())
        held = sum(float(np.sum(np.asarray(c)[list(self.layers.get(layer, ()))])) for layer, c in counts.items())
        return held / total if total else 0.0

    def check(self, moe_layers: Mapping[int, int], source: str = "residency") -> None:
        """Raises ResidencyError unless every layer is a MoE layer of the model (`moe_layers`: layer -> experts)
        and every id one of its experts."""
        for layer, ids in self.layers.items():
            if layer not in moe_layers:
                raise ResidencyError(f"{source}: layer {layer} is not a MoE layer with its experts in host memory "
                                     f"(those are {sorted(moe_layers)})")
            bad = [i for i in ids if not 0 <= i < moe_layers[layer]]
            if bad or len(set(ids)) != len(ids):
                what = f"expert {bad[0]}" if bad else "a repeated expert"
                last = moe_layers[layer] - 1
                raise ResidencyError(f"{source}: layer {layer} names {what}; its experts are 0..{last}")

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": 1, "layers": {str(k): list(v) for k, v in sorted(self.layers.items())}}

    @classmethod
    def from_json(cls, obj, source: str = "residency") -> "Residency":
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise ResidencyError(f"{source}: not a residency file (a JSON object with \"format\": \"{FORMAT}\")")
        layers = obj.get("layers")
        if not isinstance(layers, dict):
            raise ResidencyError(f"{source}: \"layers\" must be an object of layer index -> list of expert ids")
        parsed = {}
        for key, ids in layers.items():
            if not key.isdigit() or not isinstance(ids, list) or not all(type(i) is int for i in ids):
                raise ResidencyError(f"{source}: layers[{key!r}] must map a layer index to a list of expert ids")
            parsed[int(key)] = ids
        return cls(parsed)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Residency":
        try:
            obj = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ResidencyError(f"{path}: cannot read a residency file: {e}") from None
        return cls.from_json(obj, str(path))


def bank_moe_layers(weights) -> dict[int, int]:
    """Layer index -> number of routed experts, of the MoE layers whose experts are in the host expert bank."""
    return {i: int(layer.mlp.router.shape[0]) for i, layer in enumerate(weights.layers)
            if isinstance(layer.mlp, MoE) and layer.mlp.expert_layer is not None}


def current_ids(res: ResidentExperts | None) -> tuple[int, ...]:
    """The ids of the experts a layer's resident copies hold (none for None)."""
    return () if res is None else tuple(int(i) for i in np.flatnonzero(np.asarray(res.slot_of) >= 0))


def current(weights) -> Residency:
    """The residency a weights pytree holds."""
    return Residency({i: current_ids(layer.mlp.resident) for i, layer in enumerate(weights.layers)
                      if isinstance(layer.mlp, MoE) and layer.mlp.resident is not None})


def apply(weights, residency: Residency,
          build: Callable[[int, tuple[int, ...]], ResidentExperts | list[ResidentExperts] | None]):
    """`weights` with each bank MoE layer's resident experts as `residency` says (layers it leaves out hold
    none); build(layer, ids) makes the device copies of experts `ids` of a layer (for the experts a layer swaps in,
    also a list of copies that together hold them).

    A layer that keeps its number of resident experts has only its changed experts copied, into the slots of
    those leaving, in place: a re-placement between steps copies what changed and needs no room for a second
    set. The pytree passed in must not be used afterwards (its arrays of those layers are donated)."""
    residency.check(bank_moe_layers(weights))
    before = current(weights).layers
    layers = list(weights.layers)
    for i, layer in enumerate(layers):
        if not isinstance(layer.mlp, MoE) or layer.mlp.expert_layer is None:
            continue
        ids, old = residency.layers.get(i, ()), before.get(i, ())
        if ids == old:
            continue
        res = layer.mlp.resident
        if res is not None and ids and len(ids) == len(old):
            incoming = build(i, tuple(sorted(set(ids) - set(old))))
            res = _swapped(res, sorted(set(old) - set(ids)), incoming if isinstance(incoming, list) else [incoming])
        else:
            res = build(i, ids)
        layers[i] = dataclasses.replace(layer, mlp=dataclasses.replace(layer.mlp, resident=res))
    return dataclasses.replace(weights, layers=layers)


def _delete(arrays) -> None:
    """Frees the device buffers of `arrays` now, not when the last reference goes (the caller holds one)."""
    for a in jax.tree.leaves(arrays):
        a.delete()


def resident_layers(weights) -> list[int]:
    """The MoE layers that hold resident copies."""
    return [i for i, layer in enumerate(weights.layers)
            if isinstance(layer.mlp, MoE) and layer.mlp.resident is not None]  # fmt: skip


def rebuilt_layer(weights, layer: int, build: Callable[[int, ResidentExperts], ResidentExperts]):
    """`weights` with the resident copies of `layer` replaced by build(layer, copies). The copies it held are freed
    as soon as the new ones exist (their slot map, which the new copies may share, is kept): rebuilding layer by
    layer needs room for one layer's two sets at a time, and a failure leaves every layer with valid copies. The
    pytree passed in must not be used afterwards."""
    old = weights.layers[layer]
    res = old.mlp.resident
    new = build(layer, res)
    if new is res:
        return weights
    _delete((res.experts.gate, res.experts.up, res.experts.down, res.scales))
    layers = list(weights.layers)
    layers[layer] = dataclasses.replace(old, mlp=dataclasses.replace(old.mlp, resident=new))
    return dataclasses.replace(weights, layers=layers)


_widen_on_device = jax.jit(ResidentExperts.widen, static_argnums=1)


def widened_copies(res: ResidentExperts, dtype) -> ResidentExperts:
    """`res` held dequantized in `dtype` (ResidentExperts.widen), made on the device; `res` itself unless FP8."""
    return res if res.scales is None else _widen_on_device(res, jnp.dtype(dtype))


@partial(jax.jit, donate_argnums=0)
def _put_rows(stacks, slots, rows):
    return jax.tree.map(lambda stack, new: stack.at[slots].set(new), stacks, rows)


def compile_swap(res: ResidentExperts) -> None:
    """Compiles, ahead of time, the program that writes a one-expert copy into a slot of `res`'s stacks, as
    _swapped runs it: the first swap while serving then needs no compile (0.43 s at DeepSeek-V3 shapes on an H100,
    bench/RESULTS.md). The specs carry the stacks' shardings, as the committed arrays of a real call do, so the
    compiled program is the one that call finds in jit's cache."""
    def spec(a, rows=None):
        return jax.ShapeDtypeStruct(a.shape if rows is None else (rows, *a.shape[1:]), a.dtype, sharding=a.sharding)

    stacks = (res.experts, res.scales)
    _put_rows.lower(jax.tree.map(spec, stacks), jax.ShapeDtypeStruct((1,), jnp.int32),
                    jax.tree.map(lambda a: spec(a, 1), stacks)).compile()


def _swapped(res: ResidentExperts, leaving: list[int], incoming: list[ResidentExperts]) -> ResidentExperts:
    """`res` with the experts `leaving` replaced, slot for slot, by the experts the copies `incoming` hold (each
    copy's in id order)."""
    slot_of = np.asarray(res.slot_of).copy()
    free = list(slot_of[leaving])
    slot_of[leaving] = -1
    stacks = (res.experts, res.scales)
    for copy in incoming:
        ids = current_ids(copy)
        slots, free = free[: len(ids)], free[len(ids) :]
        slot_of[list(ids)] = slots
        # As a NumPy array: jnp.asarray of a list would compile a conversion at the first swap.
        stacks = _put_rows(stacks, np.asarray(slots, np.int32), (copy.experts, copy.scales))
    experts, scales = stacks
    return dataclasses.replace(res, slot_of=jax.device_put(slot_of, res.slot_of.device), experts=experts,
                               scales=scales)


@partial(jax.jit, static_argnums=0)
def _routing_program(cfg, weights, tokens, lengths):
    """Activations per expert of each MoE layer over right-padded tokens [b, t] of `lengths`: [moe layers, e]."""
    _, _, expert_ids = family_of(cfg).model.forward(cfg, weights, tokens)
    real = (jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]).reshape(-1)
    counts = [jnp.zeros(cfg.n_routed_experts, jnp.int32).at[ids].add(real[:, None].astype(jnp.int32))
              for ids in expert_ids]
    return jnp.stack(counts)


def count_activations(model, sequences: list[list[int]], batch: int = 8) -> dict[int, np.ndarray]:
    """Layer -> activations per routed expert when the model prefills `sequences` (token-id lists): the probe
    of a workload sample that ranks experts for residency (CoX-MoE, seed 003)."""
    cfg = model.config
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    totals = np.zeros((len(moe), cfg.n_routed_experts), np.int64)
    for start in range(0, len(sequences), batch):
        chunk = sequences[start : start + batch]
        width = bucket(max(len(s) for s in chunk))
        tokens = np.zeros((bucket(len(chunk)), width), np.int32)
        lengths = np.zeros(tokens.shape[0], np.int32)
        for row, seq in enumerate(chunk):
            tokens[row, : len(seq)], lengths[row] = seq, len(seq)
        totals += np.asarray(_routing_program(cfg, model.weights, tokens, lengths))
    return dict(zip(moe, totals, strict=True))
