"""The engine under ``cstorch.amp``: how one iteration's overflow decision is taken.

Nothing here is public API. The public modules one level up (``grad_scaler``,
``optimizer_step``, ``conditional_update``, ``diagnostics``, ...) use only the names below, and
the engine never imports them (tests/test_import_graph.py holds both rules). A step goes
``GradScaler.step`` -> :class:`ScalerEngine` (the lid, ``_scaler_engine.py``) ->
``Decider``/``Decision`` (``_decision.py``) -> the jitted core (``_cores.py``). The rooms of the
house and the path of one iteration: docs/architecture.md.
"""

from torch_facade.amp._engine._carry import Slot
from torch_facade.amp._engine._decision import params_of
from torch_facade.amp._engine._dlpack import import_tensors
from torch_facade.amp._engine._scaler_engine import ScalerEngine, engine_of, local_gradient, mark
from torch_facade.amp._engine._spikes import STATE_KEYS as SPIKE_STATE_KEYS

__all__ = [
    "SPIKE_STATE_KEYS",
    "ScalerEngine",
    "Slot",
    "engine_of",
    "import_tensors",
    "local_gradient",
    "mark",
    "params_of",
]
