"""Section 3: the machine's streaming rate on a buffer of each size's parameter count.

Two yardsticks, interleaved: torch's in-place ``buf.mul_(1.0)`` (reads and writes every element:
8 bytes per float32) and a jitted JAX ``sum`` over the same memory imported through DLPack (reads
every element once: 4 bytes). The in-place rate is the floor used for the minimal-traffic models
(``BYTES_PER_PARAM``), as in ``../shared/PERFORMANCE.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import torch

from workbench.timing import CompileCounter, Plan, Timing, Variant, measure

INPLACE = "torch mul_ in place"
READ = "jax sum read-only"
VARIANTS = (INPLACE, READ)
BYTES_MOVED = {INPLACE: 8, READ: 4}
"""Bytes moved per float32 element by each yardstick."""

_ALIGN_BYTES = 64


def _aligned_ones(numel: int) -> torch.Tensor:
    """A float32 buffer of ones starting on a 64-byte boundary (DLPack then never copies)."""
    pad = _ALIGN_BYTES // 4
    storage = torch.ones(numel + pad, dtype=torch.float32)
    offset = (-storage.data_ptr() % _ALIGN_BYTES) // 4
    return storage[offset : offset + numel]


@dataclasses.dataclass
class BandwidthGroup:
    """Measured streaming rates for one buffer size.

    Attributes:
        numel: float32 elements in the buffer.
        timings: seconds per pass, per yardstick.
    """

    numel: int
    timings: dict[str, Timing]

    def rates(self, name: str) -> list[float]:
        """Bytes per second of every round, for yardstick ``name``."""
        moved = BYTES_MOVED[name] * self.numel
        return [moved / t if t > 0 else float("nan") for t in self.timings[name].rounds]


def run_group(
    numel: int,
    plan: Plan,
    counter: CompileCounter,
    on_round: Callable[[], object] = lambda: None,
) -> BandwidthGroup:
    """Measures both yardsticks on one ``numel``-element buffer, interleaved.

    Args:
        numel: buffer size in float32 elements (the size's parameter count).
        plan: rounds, passes per round and warm-up.
        counter: a listening compile counter.
        on_round: progress callback, once per round.
    """
    buf = _aligned_ones(numel)
    view = jax.dlpack.from_dlpack(buf)
    total = jax.jit(jnp.sum)

    def inplace() -> None:
        buf.mul_(1.0)

    def read() -> None:
        total(view).block_until_ready()

    variants = [Variant(INPLACE, inplace), Variant(READ, read)]
    for variant in variants:  # compile and fault the pages in
        variant.step()
    return BandwidthGroup(numel, measure(variants, plan, counter, on_round))
