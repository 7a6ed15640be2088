"""Re-placing resident experts while serving (issue #23; KTransformers' dynamic update): a model that holds some of
each MoE layer's routed experts on the GPU keeps holding the ones its traffic uses most.

The scheduler's decode steps count how often each routed expert is chosen (Engine(tally=True)). The counts decay
by half every `half_life` decode steps, so recent traffic weighs most. Every `interval` steps each MoE layer's
hottest experts in host memory are matched against its coldest resident ones, and a pair is swapped when the
incoming expert's recent activations exceed the outgoing one's by more than a copy costs (COPY_COST_ACTIVATIONS)
and by the factor `margin` (hysteresis: two experts of about the same use are not swapped back and forth). At most
`max_swaps` experts move at a time, the biggest gains first.

The copies are read from the checkpoint and sent to the device on a worker thread while decoding goes on; the
swap itself (each copy written into the slot of the expert it replaces, Model.swap_experts) happens between two
decode steps once they are on the device, so no step waits for a transfer. The number of resident experts per
layer never changes: the compiled decode steps stay the same and no device memory is needed beyond the copies.
"""

import concurrent.futures
import dataclasses
import logging

import jax
import numpy as np

from hybridjit import expert_residency
from hybridjit.expert_residency import Residency, bank_moe_layers
from hybridjit.models.common.moe import MoE

log = logging.getLogger(__name__)

# A swap pays when the activations it moves to the GPU over the recent window exceed this many: each one moved
# saves a read of the expert from host memory, and the copy reads it once and moves it over PCIe, which runs at
# about a third of the host read floor (pinned H2D ~50-55 GB/s against 150-200 GB/s of reads on the lent hosts,
# bench/RESULTS.md), and takes host memory bandwidth from the CPU's experts meanwhile.
COPY_COST_ACTIVATIONS = 4.0


@dataclasses.dataclass(frozen=True)
class Swap:
    layer: int
    incoming: int
    outgoing: int
    gain: float  # the incoming expert's recent activations less the outgoing one's


class OnlinePlacement:
    """Counts `model`'s routed-expert activations in the decode steps it is shown (observe) and re-places its
    resident experts between steps (between_steps), as the module says."""

    def __init__(self, model, *, interval: int = 64, half_life: int = 512, max_swaps: int = 8, margin: float = 1.5):
        for name, value in (("interval", interval), ("half_life", half_life), ("max_swaps", max_swaps)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not margin >= 1.0:
            raise ValueError(f"margin must be >= 1, got {margin!r}")
        self.model, self.interval, self.max_swaps, self.margin = model, interval, max_swaps, margin
        self.decay = 0.5 ** (1.0 / half_life)
        self.layers = sorted(bank_moe_layers(model.weights))  # the MoE layers whose experts can move
        # Rows of Step.routed_experts: every MoE layer, in order.
        self._row = {layer: row for row, layer in enumerate(
            i for i, layer in enumerate(model.weights.layers) if isinstance(layer.mlp, MoE))}
        self.recent = np.zeros((len(self.layers), model.config.n_routed_experts))
        self.steps_since = 0
        self.swapped = 0  # experts swapped so far
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hybridjit-expert-copies")
        self._copying: tuple[Residency, list[Swap], concurrent.futures.Future] | None = None
        # The slot write compiled before the first swap needs it, on the worker, while serving starts.
        self._compiled = self._worker.submit(self._compile_swaps)

    @staticmethod
    def wanted(model) -> bool:
        """Whether re-placing pays for `model`: some of its experts are resident on the device and some are not."""
        held = model.residency.layers
        return any(0 < len(held.get(i, ())) < n for i, n in bank_moe_layers(model.weights).items())

    def observe(self, routed: np.ndarray) -> None:
        """Counts a call's routed experts (Step.routed_experts: [steps, MoE layers, slots, k], -1 for free slots)."""
        steps, e = routed.shape[0], self.recent.shape[1]
        ids = (routed[:, self._row[layer]] for layer in self.layers)
        counts = np.stack([np.bincount(i[i >= 0], minlength=e) for i in ids])
        self.recent = self.recent * self.decay**steps + counts
        self.steps_since += steps

    def plan(self) -> list[Swap]:
        """The swaps worth their copy now, the biggest gains first, at most max_swaps."""
        held = self.model.residency.layers
        swaps = []
        for row, layer in enumerate(self.layers):
            counts, resident = self.recent[row], set(held.get(layer, ()))
            if not resident or len(resident) == len(counts):
                continue
            # Hottest outsiders against coldest residents, ties to the lower id as Residency.most_used ranks.
            outside = sorted(set(range(len(counts))) - resident, key=lambda e: (-counts[e], e))
            inside = sorted(resident, key=lambda e: (counts[e], e))
            for incoming, outgoing in zip(outside, inside, strict=False):  # as many pairs as the shorter side
                gain = counts[incoming] - counts[outgoing]
                if gain <= COPY_COST_ACTIVATIONS or counts[incoming] < self.margin * counts[outgoing]:
                    break
                swaps.append(Swap(layer, incoming, outgoing, float(gain)))
        return sorted(swaps, key=lambda s: -s.gain)[: self.max_swaps]

    def between_steps(self) -> int:
        """Called by the scheduler between decode steps: swaps in copies that have arrived, or every `interval`
        steps starts copying the experts a plan takes in. Returns the number of experts swapped now."""
        if self._copying is not None:
            target, swaps, copies = self._copying
            if not copies.done():
                return 0
            self._copying = None
            try:
                self.model.swap_experts(target, copies.result())
            except Exception:  # the placement stays as it was; serving goes on
                log.exception("re-placing resident experts failed")
                return 0
            self.swapped += len(swaps)
            return len(swaps)
        if self.steps_since < self.interval:
            return 0
        self.steps_since = 0
        if swaps := self.plan():
            held = {layer: set(ids) for layer, ids in self.model.residency.layers.items()}
            for s in swaps:
                held[s.layer] = held[s.layer] - {s.outgoing} | {s.incoming}
            self._copying = (Residency(held), swaps, self._worker.submit(self._copies, swaps))
        return 0

    def _compile_swaps(self) -> None:
        """Compiles each distinct resident-stack shape's slot write (expert_residency.compile_swap)."""
        done = set()
        for layer in self.model.weights.layers:
            res = getattr(layer.mlp, "resident", None)
            if res is None:
                continue
            key = tuple((a.shape, a.dtype, a.sharding) for a in jax.tree.leaves((res.experts, res.scales)))
            if key not in done:
                try:
                    expert_residency.compile_swap(res)
                except Exception:  # the first swap then compiles it; serving is not affected
                    log.exception("compiling the resident-expert slot write ahead failed")
                done.add(key)

    def _copies(self, swaps: list[Swap]) -> dict:
        """A device copy of each incoming expert, by layer, on the device before this returns (worker thread). One
        expert a copy: the swap then writes copies of one shape, by one compiled program, however many move."""
        copies: dict[int, list] = {}
        for s in swaps:
            copies.setdefault(s.layer, []).append(self.model.resident_copies(s.layer, [s.incoming]))
        return jax.block_until_ready(copies)

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)
