"""``cstorch.amp.skip_aware``: an LR scheduler that advances only on applied optimizer steps.

An overflow skips the optimizer step, but a scheduler stepped every iteration advances anyway:
the schedule runs one step ahead per skip, and a skip on the first iteration makes torch warn
"Detected call of `lr_scheduler.step()` before `optimizer.step()`" (pytorch/pytorch#55585,
#44511, #67590; Lightning-AI/pytorch-lightning#5558; huggingface/accelerate#4242 for fused
AdamW). :func:`skip_aware` wraps a scheduler so that its ``step()`` reads the scaler's skip
signal (``GradScaler.get_isfinite()``) and advances only when the step was applied.

Two paths, chosen once from the optimizer's learning rates:

* **Host path** (Python-float ``lr``, the usual case; also ``ReduceLROnPlateau`` and schedulers
  that cycle momentum): ``step()`` reads the flag on the host and steps the wrapped scheduler
  only if it is true. The read is free on the CPU and, with non-fused optimizers, repeats a read
  the scaler already made this iteration; with fused optimizers on a GPU it is a host
  synchronisation that a Python-float schedule cannot avoid: the next ``lr`` is a host number.
* **Device path** (every ``param_group["lr"]`` a tensor, as capturable and fused optimizers
  accept): ``step()`` reads nothing on the host. A copy of the scheduler, stepped ahead on a
  stand-in of the optimizer's param groups, fills a table of the learning rates after 0, 1, 2,
  ... more applied steps (tensors, on the learning rates' device, computed by the scheduler's own
  arithmetic); a device counter adds the flag; each ``lr`` tensor is overwritten with its
  table's entry at the counter (``index_select`` + ``copy_``, no host read). The wrapped
  scheduler itself is brought up to date (replayed by the counter's value) only when something
  needs its host state: ``last_epoch``, ``applied_steps``, ``state_dict()``, ``scheduler`` or an
  attribute passed through. ``get_last_lr()`` returns copies of the ``lr`` tensors, no read.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

import amp_core
from torch_facade.amp._host_side import host_side
from torch_facade.amp.grad_scaler import GradScaler

__all__ = ["SkipAwareScheduler", "skip_aware"]

_STATE_KEYS = frozenset({"scheduler", "applied_steps"})


class _ParamGroupsOnly:
    """The optimizer as a scheduler sees it: param groups (without parameters), nothing else.

    The look-ahead copy of the scheduler steps this stand-in, so that the real optimizer's
    learning rates change only through the table. ``step`` carries the marks torch's scheduler
    looks for, so that the copy's first ``step()`` does not warn about the step order.
    """

    def __init__(self, groups: list[dict[str, Any]], last_lrs: list[Any]) -> None:
        self.param_groups = []
        for group, last_lr in zip(groups, last_lrs, strict=True):
            copied = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
            copied["lr"] = last_lr.clone() if isinstance(last_lr, torch.Tensor) else last_lr
            self.param_groups.append(copied)
        self._opt_called = True

    def step(self) -> None:
        """Never called: the stand-in steps no parameters."""

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


class _LookAhead:
    """Learning rates after ``k`` more applied steps, for ``k`` from 0, one tensor per group.

    ``tables[g][k]`` is what ``scheduler`` would set ``param_groups[g]["lr"]`` to after ``k``
    more steps from its state at construction: a copy of the scheduler is stepped on a
    :class:`_ParamGroupsOnly` stand-in, and each new value is written into a preallocated table
    on the device (its capacity doubles when full). Nothing is read on the host.
    """

    def __init__(self, scheduler: LRScheduler) -> None:
        groups = scheduler.optimizer.param_groups
        stand_in = _ParamGroupsOnly(groups, list(scheduler.get_last_lr()))
        self._copy = copy.deepcopy(scheduler, memo={id(scheduler.optimizer): stand_in})
        self._groups = stand_in.param_groups
        lrs = [group["lr"] for group in groups]
        self.tables = [torch.empty(16, dtype=lr.dtype, device=lr.device) for lr in lrs]
        self.filled = 0
        self._record()

    def _record(self) -> None:
        if self.filled == self.tables[0].numel():
            self.tables = [self._grown(table) for table in self.tables]
        for table, group in zip(self.tables, self._groups, strict=True):
            table[self.filled] = group["lr"]  # a tensor (device copy) or a float (fill)
        self.filled += 1

    def _grown(self, table: torch.Tensor) -> torch.Tensor:
        grown = torch.empty(2 * table.numel(), dtype=table.dtype, device=table.device)
        grown[: self.filled].copy_(table[: self.filled])
        return grown

    def cover(self, count: int) -> None:
        """Extends the tables to entries ``0 .. count`` (inclusive)."""
        while self.filled <= count:
            self._copy.step()
            self._record()

    def drop(self, count: int) -> None:
        """Forgets the first ``count`` entries: entry ``count`` becomes entry 0."""
        self.tables = [table[count : self.filled].clone() for table in self.tables]
        self.filled -= count


def _uses_device_path(scheduler: LRScheduler | None) -> bool:
    """Whether ``scheduler``'s learning rates can follow the flag without a host read."""
    if scheduler is None or isinstance(scheduler, ReduceLROnPlateau):
        return False  # a counter has no rates; a plateau decision compares metrics on the host
    if getattr(scheduler, "cycle_momentum", False):
        return False  # it also sets momentum (a host float) on every step
    return all(isinstance(group["lr"], torch.Tensor) for group in scheduler.optimizer.param_groups)


def _check_arguments(scheduler: Any, grad_scaler: Any) -> None:
    if isinstance(scheduler, SkipAwareScheduler):
        raise ValueError(
            "scheduler is skip-aware already (a SkipAwareScheduler); pass the scheduler it wraps"
        )
    if scheduler is not None and not isinstance(scheduler, (LRScheduler, ReduceLROnPlateau)):
        raise TypeError(
            "scheduler must be a torch.optim.lr_scheduler.LRScheduler or None; got "
            f"{type(scheduler).__module__}.{type(scheduler).__qualname__}"
        )
    if not isinstance(grad_scaler, GradScaler):
        hint = (
            " (torch's scaler has no skip signal to follow)"
            if isinstance(grad_scaler, torch.amp.GradScaler)
            else ""
        )
        raise TypeError(
            "grad_scaler must be a torch_facade.amp.GradScaler; got "
            f"{type(grad_scaler).__module__}.{type(grad_scaler).__qualname__}{hint}"
        )


class SkipAwareScheduler(LRScheduler):
    """A learning-rate scheduler (or a step counter) that advances only on applied steps.

    Made by :func:`skip_aware`; see there. It is an ``LRScheduler`` (trainers that check the
    type accept it) whose ``step()`` steps the wrapped scheduler only when the scaler's last
    step was applied, and whose other names are the wrapped scheduler's.

    Example:
        >>> import torch, torch_facade as cstorch
        >>> counter = cstorch.amp.skip_aware(None, cstorch.amp.GradScaler(loss_scale="dynamic"))
        >>> isinstance(counter, torch.optim.lr_scheduler.LRScheduler), counter.last_epoch
        (True, 0)
    """

    def __init__(self, scheduler: LRScheduler | None, grad_scaler: GradScaler) -> None:
        _check_arguments(scheduler, grad_scaler)
        # LRScheduler.__init__ is not called: the wrapped scheduler was initialised already
        # (it set the optimizer's initial learning rates and took its first step).
        self._wrapped = scheduler
        self._grad_scaler = grad_scaler
        self._checks = isinstance(grad_scaler.config, amp_core.DynamicLossScale)
        self._device_path = self._checks and _uses_device_path(scheduler)
        self._resolved = 0  # applied steps the wrapped scheduler has been stepped through
        self._start_pending()

    def _start_pending(self) -> None:
        """Starts counting applied steps on the device from the wrapped scheduler's state."""
        self._calls = 0  # step() calls since then: an upper bound of the pending count
        self._pending: torch.Tensor | None = None  # applied steps since then (device int64)
        self._look_ahead: _LookAhead | None = None
        if self._device_path:
            assert self._wrapped is not None
            self._look_ahead = _LookAhead(self._wrapped)
            device = self._wrapped.optimizer.param_groups[0]["lr"].device
            self._pending = torch.zeros((), dtype=torch.int64, device=device)

    # ------------------------------------------------------------------ stepping

    @host_side
    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advances the schedule if the scaler's last ``step(optimizer)`` was applied.

        Call it where the scheduler's ``step()`` would go, once per optimizer step: after
        ``grad_scaler.step(optimizer)`` (before or after ``update()``) or after
        ``cstorch.amp.optimizer_step``. With a static loss scale every step is applied (the
        scaler checks nothing), and the schedule advances without reading anything.

        Args:
            *args: passed to the wrapped scheduler's ``step`` (``ReduceLROnPlateau``'s
                ``metrics``); only on the host path.
            **kwargs: as ``args``.

        Raises:
            TypeError: arguments on the device path (tensor learning rates), or to a counter.
        """
        if (args or kwargs) and (self._device_path or self._wrapped is None):
            where = "a step counter" if self._wrapped is None else "tensor learning rates"
            raise TypeError(
                f"step() of a skip-aware scheduler with {where} takes no arguments; got "
                f"args={args!r}, kwargs={kwargs!r}"
            )
        if not self._checks:  # static scaling: every step is applied
            self._advance(args, kwargs)
            return
        flag = self._grad_scaler.get_isfinite()
        if self._wrapped is None:
            pending = self._pending
            flag = flag.to(torch.int64)
            self._pending = flag if pending is None else pending + flag.to(pending.device)
        elif self._device_path:
            self._step_on_device(flag)
        elif bool(flag):  # the host path's read
            self._advance(args, kwargs)

    def _advance(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._wrapped is not None:
            self._wrapped.step(*args, **kwargs)
        self._resolved += 1

    def _step_on_device(self, flag: torch.Tensor) -> None:
        look_ahead, pending = self._look_ahead, self._pending
        assert look_ahead is not None and pending is not None and self._wrapped is not None
        self._calls += 1
        look_ahead.cover(self._calls)
        pending = pending + flag.to(device=pending.device, dtype=torch.int64)
        self._pending = pending
        index = pending.view(1)
        groups = self._wrapped.optimizer.param_groups
        for group, table in zip(groups, look_ahead.tables, strict=True):
            group["lr"].copy_(torch.index_select(table, 0, index).view(()))

    def _resolve(self) -> None:
        """Brings the wrapped scheduler (or the count) up to date: one host read, if pending."""
        pending = self._pending
        if pending is None or (self._device_path and self._calls == 0):
            return
        count = int(pending)
        if self._wrapped is None:
            self._resolved += count
            self._pending = None
            return
        look_ahead = self._look_ahead
        assert look_ahead is not None
        if count:
            # Replay from the last resolved rates: chainable schedulers read group["lr"].
            groups = self._wrapped.optimizer.param_groups
            for group, table in zip(groups, look_ahead.tables, strict=True):
                group["lr"].copy_(table[0])
            for _ in range(count):
                self._wrapped.step()
            look_ahead.drop(count)
        self._resolved += count
        self._calls = 0
        self._pending = torch.zeros_like(pending)

    # ------------------------------------------------------------ the interface

    @property
    def scheduler(self) -> LRScheduler | None:
        """The wrapped scheduler, up to date (``None`` for a step counter)."""
        self._resolve()
        return self._wrapped

    @property
    def grad_scaler(self) -> GradScaler:
        """The scaler whose skip signal this scheduler follows."""
        return self._grad_scaler

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:  # type: ignore[override]
        """The wrapped scheduler's optimizer (``None`` for a step counter)."""
        return None if self._wrapped is None else self._wrapped.optimizer

    @property
    def applied_steps(self) -> int:
        """Steps that advanced the schedule since this wrapper was made (or loaded)."""
        self._resolve()
        return self._resolved

    @property
    def last_epoch(self) -> int:  # type: ignore[override]
        """The wrapped scheduler's ``last_epoch``; for a step counter, ``applied_steps``."""
        self._resolve()
        return self._resolved if self._wrapped is None else self._wrapped.last_epoch

    def get_last_lr(self) -> list[float | torch.Tensor]:
        """The learning rates now in force (``[]`` for a step counter).

        On the device path, copies of the ``lr`` tensors (no host read); otherwise the wrapped
        scheduler's ``get_last_lr()``.
        """
        if self._wrapped is None:
            return []
        if self._device_path:
            return [group["lr"].clone() for group in self._wrapped.optimizer.param_groups]
        return self._wrapped.get_last_lr()

    def get_lr(self) -> list[float | torch.Tensor]:
        """The wrapped scheduler's ``get_lr()`` (torch warns outside ``step``; prefer
        :meth:`get_last_lr`)."""
        self._resolve()
        if self._wrapped is None:
            raise AttributeError("a skip-aware step counter (skip_aware(None, ...)) has no get_lr")
        return self._wrapped.get_lr()

    def state_dict(self) -> dict[str, Any]:
        """``{"scheduler": the wrapped scheduler's state_dict() or None, "applied_steps": int}``.

        On the device path this reads the pending count (one host read).
        """
        self._resolve()
        wrapped = None if self._wrapped is None else self._wrapped.state_dict()
        return {"scheduler": wrapped, "applied_steps": self._resolved}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads what :meth:`state_dict` returned: the wrapped state and the applied count.

        Load the optimizer's state first (as for any scheduler); the look-ahead of the device
        path restarts from the loaded scheduler's last learning rates.

        Raises:
            TypeError: ``state_dict`` is not a mapping, or ``applied_steps`` is not an int.
            ValueError: missing or unknown keys, or a wrapped state for a step counter.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping; got {type(state_dict).__name__}")
        if set(state_dict) != _STATE_KEYS:
            raise ValueError(
                f"state_dict must have exactly the keys {sorted(_STATE_KEYS)}; got "
                f"{sorted(state_dict)}"
            )
        applied = state_dict["applied_steps"]
        if isinstance(applied, torch.Tensor) and applied.numel() == 1:
            applied = int(applied)
        if isinstance(applied, bool) or not isinstance(applied, int) or applied < 0:
            raise TypeError(f"state_dict['applied_steps'] must be an int >= 0; got {applied!r}")
        wrapped = state_dict["scheduler"]
        if (wrapped is None) != (self._wrapped is None):
            raise ValueError(
                "state_dict['scheduler'] must be None exactly when this is a step counter; got "
                f"{type(wrapped).__name__} for a {'counter' if self._wrapped is None else 'scheduler'}"
            )
        if self._wrapped is not None:
            self._wrapped.load_state_dict(dict(wrapped))
        self._resolved = applied
        self._start_pending()

    def __getattr__(self, name: str) -> Any:
        """Any other attribute is the wrapped scheduler's, once it is up to date."""
        if name.startswith("__") or "_wrapped" not in self.__dict__:
            raise AttributeError(name)
        wrapped = self.__dict__["_wrapped"]
        if wrapped is None:
            raise AttributeError(
                f"a skip-aware step counter (skip_aware(None, ...)) has no attribute {name!r}"
            )
        self._resolve()
        return getattr(wrapped, name)

    def __repr__(self) -> str:
        inner = "None" if self._wrapped is None else type(self._wrapped).__name__
        return f"SkipAwareScheduler({inner}, path={'device' if self._device_path else 'host'})"


def skip_aware(scheduler: LRScheduler | None, grad_scaler: GradScaler) -> SkipAwareScheduler:
    """Wraps ``scheduler`` so that its ``step()`` advances only on applied optimizer steps.

    Call the result's ``step()`` where the scheduler's would go (after
    ``grad_scaler.step(optimizer)`` or ``cstorch.amp.optimizer_step``); it steps ``scheduler``
    only if the scaler's decision for that step was "finite" (``grad_scaler.get_isfinite()``).
    Everything else is the scheduler's: ``get_last_lr()``, ``last_epoch``, its attributes, and
    ``state_dict()``/``load_state_dict()`` (which also carry the count of applied steps). With
    ``scheduler=None`` it is a step counter: ``applied_steps`` and ``last_epoch`` count the
    applied steps, on the device, without a host read per step.

    Host synchronisation: none added on the CPU. On a GPU, a scheduler over Python-float
    learning rates reads the flag on the host at each ``step()`` (the scaler already does with
    non-fused optimizers; with fused ones it is a new sync, and no float schedule can avoid it).
    With tensor learning rates (``lr=torch.tensor(...)``, with ``capturable=True`` or
    ``fused=True``) the rates follow the flag on the device and nothing is read per step.

    Args:
        scheduler: a ``torch.optim.lr_scheduler.LRScheduler`` (``ReduceLROnPlateau``
            included), or ``None`` for a step counter.
        grad_scaler: the :class:`~torch_facade.amp.GradScaler` that steps the optimizer.

    Returns:
        A :class:`SkipAwareScheduler`.

    Raises:
        TypeError: ``scheduler`` is not a scheduler (nor ``None``), or ``grad_scaler`` is not a
            ``torch_facade.amp.GradScaler``.
        ValueError: ``scheduler`` is skip-aware already.

    Example:
        >>> import torch, torch_facade as cstorch
        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> grad_scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
        >>> scheduler = cstorch.amp.skip_aware(
        ...     torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5), grad_scaler
        ... )
        >>> for x in [float("inf"), 1.0]:  # the first step overflows and is skipped
        ...     optimizer.zero_grad()
        ...     grad_scaler.scale(model(torch.full((1, 2), x)).sum()).backward()
        ...     grad_scaler.step(optimizer)
        ...     grad_scaler.update()
        ...     scheduler.step()
        >>> scheduler.last_epoch, scheduler.get_last_lr()
        (1, [0.05])
    """
    return SkipAwareScheduler(scheduler, grad_scaler)
