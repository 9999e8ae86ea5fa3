"""Fused optimizers: the decision handed to torch's unscale-and-skip kernels as two tensors.

``Adam``/``AdamW``/``SGD`` with ``fused=True`` (``_step_supports_amp_scaling``) read
``optimizer.grad_scale`` and ``optimizer.found_inf`` in their kernel: they divide every gradient by
the one and leave parameters and state untouched where the other is nonzero. Handing them the
decision's scalars replaces the gradient write pass and the host read of ``isfinite``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torch_facade.amp._engine._decision import Decision


class FusedSteps:
    """Steps fused optimizers with the decision's ``grad_scale`` and ``found_inf``.

    Remembers, per optimizer, that every parameter has state (see
    :meth:`has_state_for_gradients`).
    """

    def __init__(self) -> None:
        # Per optimizer id: what was checked, and the participants list it was checked with.
        self._all_stateful: dict[int, tuple[tuple[Any, ...], Any]] = {}

    def possible(self, optimizer: torch.optim.Optimizer, decision: Decision) -> bool:
        """Whether ``optimizer`` can unscale and skip in its fused kernel, changing nothing.

        Only for a dynamic decision (static scaling never skips), and only once its state
        exists: a skipped first step would otherwise create zero state. And only for gradients
        still scaled or fully unscaled (not waiting for a GCC clip).
        """
        if decision.packed is None or not getattr(optimizer, "_step_supports_amp_scaling", False):
            return False
        if decision.pending.get(id(optimizer), decision.full) is not decision.full:
            return False
        if hasattr(optimizer, "grad_scale") or hasattr(optimizer, "found_inf"):
            return False
        return self.has_state_for_gradients(optimizer, decision.params)

    def has_state_for_gradients(
        self, optimizer: torch.optim.Optimizer, participants: Sequence[torch.Tensor]
    ) -> bool:
        """Whether every parameter of ``optimizer`` with a gradient has optimizer state.

        Once every parameter (of the groups that keep state) has state, that is remembered while
        the state dict stays the same object with as many entries and the decision's
        ``participants`` are the same list object (the scaler makes a new one when any parameter
        of any known optimizer changed, by identity): a step that creates state,
        ``load_state_dict``, ``add_param_group``, a replaced ``params`` list holding other
        parameters or a parameter swapped inside one looks again.
        """
        state = optimizer.state
        key = (id(state), len(state))
        cached = self._all_stateful.get(id(optimizer))
        if cached is not None and cached[0] == key and cached[1] is participants:
            return True
        # By id: hashing a tensor key goes through Python (``Tensor.__hash__``), once per param.
        with_state = {id(param) for param, entry in state.items() if entry}
        every = True
        for group in optimizer.param_groups:
            if isinstance(optimizer, torch.optim.SGD) and not group.get("momentum"):
                continue  # stateless
            for param in group["params"]:
                if id(param) not in with_state:
                    every = False
                    if param.grad is not None:
                        return False
        if every:
            self._all_stateful[id(optimizer)] = (key, participants)
        return True

    @staticmethod
    def step(
        optimizer: torch.optim.Optimizer,
        decision: Decision,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """``optimizer.step(*args, **kwargs)`` with the decision's scale and overflow flag."""
        # Gradients still scaled are unscaled (and clipped) by the kernel; gradients already
        # unscaled by unscale_() only need the overflow flag.
        still_scaled = decision.pending.pop(id(optimizer), None) is not None
        if still_scaled:
            decision.to_kernel.add(id(optimizer))
        grad_scale = decision.grad_scale() if still_scaled else None
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = decision.found_inf()  # type: ignore[attr-defined]
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
