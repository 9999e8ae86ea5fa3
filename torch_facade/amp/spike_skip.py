"""``cstorch.amp.SpikeSkip``: skip steps whose gradient norm (or loss) spikes.

The class is :class:`amp_core.SpikeSkip` itself (one class for both doors, validated the same
way): pass it as ``GradScaler(loss_scale="dynamic", spike_skip=cstorch.amp.SpikeSkip(...))``.
The decision is taken in the overflow check's jitted call (``amp_core.check_spike``), with no
host synchronisation; docs/pytorch/spike-skip.md says what the torch door watches.
"""

from __future__ import annotations

from amp_core.spike_skip import SpikeSkip

__all__ = ["SpikeSkip"]
