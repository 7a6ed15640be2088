"""The default placement without resident experts: every routed expert computed by the CPU kernels behind the
hand-off, as the tests of that path need (on a GPU the default holds a small test model's experts on the GPU)."""

import dataclasses

from hybridjit.placement import Placement


def hybrid(dtype=None, device=None, **changes) -> Placement:
    return dataclasses.replace(Placement.default(dtype, device), resident_experts=None, **changes)
