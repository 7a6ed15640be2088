"""Placeholder, replaced by the performance model."""

import dataclasses

DUAL = "dual"


@dataclasses.dataclass(frozen=True)
class Policy:
    slots: int
    micro_batches: int | str  # attention micro-batches with coalesced experts, or DUAL
    prefill_batch: int

    def describe(self) -> str:
        return f"policy: {self.slots} slots, {self.micro_batches} attention micro-batches, prefill {self.prefill_batch}"


def choose_policy(model, jobs, cache_len, slots=None, micro_batches=None, prefill_batch=None) -> Policy:
    slots = slots or min(len(jobs), 64)
    return Policy(slots, micro_batches or 1, prefill_batch or min(slots, 8))
