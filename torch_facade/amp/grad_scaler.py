"""``cstorch.amp.GradScaler`` over plain ``torch.optim`` optimizers, driven by amp_core."""

from __future__ import annotations

import dataclasses
import enum
import functools
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import torch

import amp_core
from torch_facade.amp import _bridge
from torch_facade.amp._amp_state import get_half_dtype_str
from torch_facade.amp._arena import GradientArena


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclasses.dataclass
class _Decision:
    """One iteration's overflow decision, taken once over every known optimizer's gradients.

    ``outputs`` are the jitted core's results and ``scalars`` torch's views of the numbers it
    needs every step (both ``None`` for static scaling, which never checks); the flag and the
    norm stay JAX arrays until something asks for them.
    """

    # Multiplier still to be applied to each optimizer's gradients (by id), if any.
    pending: dict[int, torch.Tensor]
    outputs: _bridge.FacadeStep | None = None
    scalars: _bridge.StepScalars | None = None
    scale_updated: bool = False
    _host_isfinite: bool | None = None

    def isfinite(self) -> torch.Tensor:
        """The overflow flag as a new 0-d bool tensor (no host synchronisation).

        A copy: the flag the skip decision reads must not change if the caller's tensor does.
        """
        if self.outputs is None:
            return torch.tensor(True)
        return _bridge.to_torch(self.outputs.isfinite).clone()

    def host_isfinite(self) -> bool:
        """``isfinite`` as a Python bool: a host synchronisation, done at most once."""
        if self._host_isfinite is None:
            self._host_isfinite = self.outputs is None or bool(self.outputs.isfinite)
        return self._host_isfinite


def _check_optimizer(value: Any, argument: str) -> torch.optim.Optimizer:
    if not isinstance(value, torch.optim.Optimizer):
        raise TypeError(f"{argument} must be a torch.optim.Optimizer; got {type(value).__name__}")
    return value


def _optimizer_list(value: Any, argument: str) -> list[torch.optim.Optimizer]:
    if isinstance(value, torch.optim.Optimizer):
        return [value]
    if isinstance(value, (list, tuple)) and value:
        return [_check_optimizer(o, f"{argument}[{i}]") for i, o in enumerate(value)]
    raise TypeError(
        f"{argument} must be a torch.optim.Optimizer or a non-empty list or tuple of them; "
        f"got {value!r}"
    )


def _truthy(value: Any) -> bool:
    try:
        return bool(value)
    except (RuntimeError, ValueError, TypeError):  # e.g. a tensor of several elements
        return True


@functools.lru_cache(maxsize=16)
def _with_clip_norm(config: amp_core.LossScaleConfig, norm: float) -> amp_core.LossScaleConfig:
    """``config`` with DLS + GCC at ``norm``; cached: ``optimizer_step`` asks every iteration."""
    return dataclasses.replace(config, max_gradient_norm=norm)


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


class GradScaler:
    """Facilitates mixed precision training with static or dynamic loss scaling (DLS, DLS + GCC).

    The documented ``cerebras.pytorch.amp.GradScaler``, working with any ``torch.optim``
    optimizer on any device torch and JAX share. Every number (scale, overflow flag, norm, clip
    coefficient, next scale) comes out of ``amp_core``'s jitted functions; gradients reach JAX
    through DLPack without copies, as views of one flat buffer per dtype.

    Per iteration: ``scale(loss).backward()``, optionally ``unscale_(opt)`` (then clip or inspect
    the gradients), ``step(opt)`` for each optimizer, then ``update()`` once. The overflow
    decision is taken once, over the gradients of every optimizer this scaler knows: an inf in any
    of them skips all. An optimizer becomes known when it is passed to any method (or to
    ``optimizers=`` here) and stays known.

    Host synchronisation: the first ``step`` of an iteration waits for the jitted check (it reads
    the gradients, so torch must not write them meanwhile; on the CPU this is just the
    computation, on a GPU a wait for the device). Non-fused optimizers also read ``isfinite`` as
    a Python bool, once per iteration. Optimizers with a fused unscale-and-skip kernel
    (``Adam``/``AdamW``/``SGD`` with ``fused=True``, once their state exists) get the scale and
    the overflow flag as tensors instead. ``state_dict`` synchronises. ``get_isfinite`` and
    ``get_global_norm`` return tensors.

    A backward pass after the iteration's first ``step`` (alternating losses, as in GAN loops)
    raises a ``RuntimeError`` at the next scaler call: its gradients were not part of the
    decision. Use one scaler per optimizer for such loops.

    Args:
        loss_scale: ``"dynamic"`` for DLS; otherwise the static scale (``None`` means ``1.0``).
        init_scale: initial DLS scale (default ``2**31`` for cbfloat16, else ``2**15``).
        steps_per_increase: DLS doubles the scale after this many steps plus one (default 2000).
        min_loss_scale: lower DLS bound, at least ``2**-14`` (the default).
        max_loss_scale: upper DLS bound (default as ``init_scale``).
        overflow_tolerance: fraction of overflowed steps tolerated before halving (default 0).
        max_gradient_norm: with DLS, clip gradients to this global norm in the overflow check's
            pass (DLS + GCC). Ignored for static scaling.
        optimizers: optimizers to register up front (optional).

    Raises:
        ValueError: invalid values (SPEC section 1).
        TypeError: values of the wrong type.

    Example:
        >>> import torch, torch_facade as cstorch
        >>> model = torch.nn.Linear(4, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> grad_scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
        >>> loss = model(torch.ones(2, 4)).pow(2).mean()
        >>> grad_scaler.scale(loss).backward()
        >>> grad_scaler.unscale_(optimizer)
        >>> grad_scaler.step(optimizer)
        >>> grad_scaler.update()
        >>> grad_scaler.get_scale()
        tensor(32768.)
    """

    def __init__(
        self,
        loss_scale: str | float | None = None,
        init_scale: float | None = None,
        steps_per_increase: int | None = None,
        min_loss_scale: float | None = None,
        max_loss_scale: float | None = None,
        overflow_tolerance: float = 0.0,
        max_gradient_norm: float | None = None,
        *,
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    ) -> None:
        self._config = amp_core.make_config(
            loss_scale,
            init_scale=init_scale,
            steps_per_increase=steps_per_increase,
            min_loss_scale=min_loss_scale,
            max_loss_scale=max_loss_scale,
            overflow_tolerance=overflow_tolerance,
            max_gradient_norm=max_gradient_norm,
            half_dtype=get_half_dtype_str(),
        )
        self._dynamic = self._config.is_dynamic
        self._optimizers: list[torch.optim.Optimizer] = []
        self._stages: dict[torch.optim.Optimizer, _Stage] = {}
        self._arena: GradientArena | None = None
        self._jax_flats: tuple[jax.Array, ...] = ()
        self._grad_hooks: list[Any] = []
        self._late_gradients = False  # a backward ran after this iteration's decision
        self._scaled = False  # scale() was called since the last update()
        self._arena_key: tuple[Any, ...] | None = None
        self._decision: _Decision | None = None
        self._warned_dtype = False
        # Committed to a device from the start, so every step sees the same argument kinds.
        self._set_state(jax.device_put(amp_core.init(self._config), jax.devices()[0]))
        if optimizers is not None:
            for optimizer in _optimizer_list(optimizers, "optimizers"):
                self._register(optimizer)

    # ------------------------------------------------------------------ state

    def _set_state(
        self,
        state: amp_core.LossScaleState,
        scalars: _bridge.StepScalars | None = None,
    ) -> None:
        """Adopts ``state``; ``scalars`` (from the core call that produced it) spare two exports."""
        self._state = state
        if scalars is None:
            self._scale_t = _bridge.to_torch(state.loss_scale)
            self._inv_scale_t = _bridge.to_torch(_bridge.inverse_scale(state))
        else:
            self._scale_t, self._inv_scale_t = scalars.loss_scale, scalars.inverse_scale
        # Static scaling by exactly 1 needs no arithmetic at all.
        self._identity = not self._dynamic and float(self._scale_t) == 1.0

    @property
    def config(self) -> amp_core.LossScaleConfig:
        """The resolved ``amp_core`` configuration (every default filled in)."""
        return self._config

    def state_dict(self, destination: dict[str, Any] | None = None) -> dict[str, Any]:
        """Returns the real scaler state for a checkpoint (a host synchronisation).

        DLS: ``loss_scale`` (float32 tensor), ``steps_since_rescale``,
        ``overflows_since_rescale`` and ``num_skipped_steps`` (int64 tensors). Static:
        ``loss_scale``. Unlike the reference off Cerebras hardware, never ``{}``.

        Args:
            destination: a dict to fill and return instead of a new one.

        Example:
            >>> import torch_facade as cstorch
            >>> sorted(cstorch.amp.GradScaler(loss_scale="dynamic").state_dict())
            ['loss_scale', 'num_skipped_steps', 'overflows_since_rescale', 'steps_since_rescale']
        """
        if destination is not None and not isinstance(destination, dict):
            raise TypeError(f"destination must be a dict or None; got {type(destination).__name__}")
        result = {} if destination is None else destination
        for key, value in amp_core.to_state_dict(self._config, self._state).items():
            dtype = torch.float32 if key == "loss_scale" else torch.int64
            result[key] = torch.tensor(value, dtype=dtype)
        return result

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads the keys present in ``state_dict``; absent keys keep their values.

        Values may be tensors or numbers. Must be called between iterations.

        Raises:
            TypeError: not a mapping, or a value that is not a number.
            ValueError: an unknown key or an invalid value.
            RuntimeError: called between ``scale``/``step`` and ``update``.

        Example:
            >>> import torch_facade as cstorch
            >>> scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
            >>> scaler.load_state_dict({"loss_scale": 1024.0})
            >>> scaler.get_scale()
            tensor(1024.)
        """
        busy = self._scaled or any(s is not _Stage.READY for s in self._stages.values())
        if busy or self._decision is not None:
            raise RuntimeError(
                "load_state_dict() must be called between iterations (after update()), not "
                "between scale() and update(): the gradients were scaled with the old scale"
            )
        state = amp_core.from_state_dict(self._config, self._state, state_dict)
        self._set_state(jax.device_put(state, next(iter(self._state.loss_scale.devices()))))

    # --------------------------------------------------------------- accessors

    def get_scale(self) -> torch.Tensor | float:
        """The current loss scale: a float32 tensor for DLS, a float for static scaling."""
        if not self._dynamic:
            return float(self._scale_t)
        return self._scale_t.clone()

    def get_non_clamped_scale(self) -> torch.Tensor | float:
        """The scale of the last update after the max clamp and before the min clamp."""
        value = _bridge.to_torch(self._state.non_clamped_scale)
        return value.clone() if self._dynamic else float(value)

    def get_num_skipped_steps(self) -> torch.Tensor:
        """Steps skipped for overflow so far (int64 tensor; always 0 for static scaling)."""
        return _bridge.to_torch(self._state.num_skipped_steps).to(torch.int64)

    def get_isfinite(self) -> torch.Tensor:
        """The skip signal: whether this iteration's (or else the last) step was finite.

        A new bool tensor (a copy), without a host synchronisation.
        """
        if self._decision is not None:
            return self._decision.isfinite()
        return _bridge.to_torch(self._state.isfinite).clone()

    def get_global_norm(self) -> torch.Tensor:
        """The global L2 norm of this iteration's (or else the last) unscaled gradients.

        A new float32 tensor (a copy), without a host synchronisation; 0 before the first DLS
        step and for static scaling, which does not check gradients.
        """
        if self._decision is not None and self._decision.outputs is not None:
            return _bridge.to_torch(self._decision.outputs.global_norm).clone()
        return _bridge.to_torch(self._state.global_norm).clone()

    # --------------------------------------------------------------- the loop

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Scales the loss before the backward pass: ``loss.float() * scale``.

        Raises:
            TypeError: ``loss`` is not a tensor.
        """
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss must be a torch.Tensor; got {type(loss).__name__}")
        self._scaled = True
        if self._identity:
            return loss.float()
        return loss.float() * self._scale_t.to(loss.device, non_blocking=True)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscales the gradients of ``optimizer``'s parameters in place.

        A no-op if already unscaled this iteration. Once the iteration's overflow decision was
        taken with DLS + GCC, this also clips (the reference clips inside ``step``).

        Raises:
            TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
            RuntimeError: called after ``step(optimizer)`` in the same iteration.
        """
        optimizer = _check_optimizer(optimizer, "optimizer")
        self._register(optimizer)
        stage = self._stages[optimizer]
        if stage is _Stage.UNSCALED:
            return
        if stage is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        if self._decision is None:
            self._apply(optimizer, self._inv_scale_t)
        else:
            self._apply_pending(optimizer)
        self._stages[optimizer] = _Stage.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscales (if needed), checks for overflow once per iteration, and steps if finite.

        On overflow, parameters and every optimizer state tensor stay bit-identical. ``args``
        and ``kwargs`` go to ``optimizer.step``.

        Returns:
            What ``optimizer.step`` returned, or ``None`` when the step was skipped.

        Raises:
            TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
            RuntimeError: ``step`` was already called for ``optimizer`` since the last
                ``update()``, or ``optimizer`` joined after this iteration's decision.
        """
        optimizer = _check_optimizer(optimizer, "optimizer")
        self._register(optimizer)
        if self._stages[optimizer] is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        return self.step_if_finite(optimizer, *args, **kwargs)

    def step_if_finite(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Calls ``optimizer.step(*args, **kwargs)`` only if this iteration's gradients are finite.

        Returns:
            The result of ``optimizer.step``, or ``None`` when skipped.
        """
        optimizer = _check_optimizer(optimizer, "optimizer")
        self._register(optimizer)
        decision = self._decide()
        multiplier = decision.pending.pop(id(optimizer), None)
        if multiplier is not None and self._fused_step_possible(optimizer):
            result = self._fused_step(optimizer, decision, args, kwargs)
        else:
            if multiplier is not None:
                self._apply(optimizer, multiplier)
            result = optimizer.step(*args, **kwargs) if decision.host_isfinite() else None
        self._stages[optimizer] = _Stage.STEPPED
        return result

    def clip_gradients_and_return_isfinite(
        self, optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer]
    ) -> torch.Tensor:
        """Takes the iteration's decision, unscales and (with GCC) clips, returns ``isfinite``.

        Returns:
            A 0-d bool tensor (no host synchronisation).
        """
        optimizers = _optimizer_list(optimizers, "optimizers")
        for optimizer in optimizers:
            self._register(optimizer)
        decision = self._decide()
        for optimizer in optimizers:
            if self._stages[optimizer] is _Stage.READY:
                self._apply_pending(optimizer)
                self._stages[optimizer] = _Stage.UNSCALED
        return decision.isfinite()

    def update_scale(self, optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer]) -> None:
        """Applies the dynamic-loss-scaling update (SPEC section 2) for this iteration, once."""
        for optimizer in _optimizer_list(optimizers, "optimizers"):
            self._register(optimizer)
        if not self._dynamic:
            return
        decision = self._decide()
        if not decision.scale_updated:
            assert decision.outputs is not None
            self._set_state(decision.outputs.next_state, decision.scalars)
            decision.scale_updated = True

    def update(self, new_scale: Any = None) -> None:
        """Updates the scale once all optimizers have been stepped, and starts a new iteration.

        Raises:
            ValueError: ``new_scale`` is given (not supported).
            RuntimeError: DLS, and nothing was unscaled or stepped since the last ``update()``
                (there is no overflow check to update from; torch's scaler raises here too).
        """
        if new_scale is not None and _truthy(new_scale):
            raise ValueError("GradScaler.update() does not support providing a `new_scale`")
        if self._dynamic:
            idle = all(stage is _Stage.READY for stage in self._stages.values())
            if self._decision is None and idle:
                raise RuntimeError(
                    "update() was called without a step() or unscale_() since the last "
                    "update(): there is no overflow check to update the loss scale from"
                )
            self.update_scale(self._optimizers)
        self._decision = None
        self._late_gradients = self._scaled = False
        for optimizer in self._stages:
            self._stages[optimizer] = _Stage.READY

    # --------------------------------------------------------------- internals

    def _register(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer in self._stages:
            return
        if self._decision is not None and self._dynamic:
            raise RuntimeError(
                f"{type(optimizer).__name__} reached this GradScaler after this iteration's "
                "overflow decision was taken without its gradients. Register every optimizer "
                "up front with GradScaler(..., optimizers=[opt1, opt2]), or call unscale_() on "
                "each optimizer before the first step() (as optimizer_step does)."
            )
        if not self._warned_dtype and any(p.dtype != torch.float32 for p in _params(optimizer)):
            warnings.warn(
                "GradScaler is unscaling gradients that are not float32 in their own dtype",
                UserWarning,
                stacklevel=3,
            )
            self._warned_dtype = True
        self._optimizers.append(optimizer)
        self._stages[optimizer] = _Stage.READY
        if self._decision is not None:  # static scaling: join the decision
            self._decision.pending[id(optimizer)] = self._inv_scale_t

    def _prepare_arena(self) -> GradientArena:
        key = tuple((id(o), tuple(map(id, _params(o)))) for o in self._optimizers)
        arena = self._arena
        if arena is None or key != self._arena_key or not arena.sync():
            # New parameters, or parameters that changed dtype, device or shape (module.to()).
            arena = GradientArena([_params(o) for o in self._optimizers])
            devices = {group.device for group in arena.groups}
            if len(devices) > 1:
                raise ValueError(
                    f"GradScaler needs all parameters on one device; got {sorted(map(str, devices))}"
                )
            if devices:
                self._set_state(_bridge.place_state(self._state, devices.pop()))
            self._arena, self._arena_key = arena, key
            self._watch_late_gradients([p for o in self._optimizers for p in _params(o)])
            # On the CPU the flats are imported once per arena: the views alias torch's memory,
            # so every step's core reads the current gradients (and never runs while torch
            # writes them). Elsewhere they are imported each step, so that DLPack orders the
            # read after torch's pending work on the device's stream.
            self._jax_flats = self._import_flats(arena)
        elif arena.groups and arena.groups[0].device.type != "cpu":
            self._jax_flats = self._import_flats(arena)
        return arena

    @staticmethod
    def _import_flats(arena: GradientArena) -> tuple[jax.Array, ...]:
        return tuple(_bridge.to_jax(flat) for flat in arena.flats())

    def _watch_late_gradients(self, params: list[torch.Tensor]) -> None:
        """Hooks every parameter so that a backward after the decision is caught, not ignored."""
        for handle in self._grad_hooks:
            handle.remove()
        scaler = weakref.ref(self)

        def on_gradient(_: torch.Tensor) -> None:
            owner = scaler()
            if owner is not None and owner._decision is not None:
                owner._late_gradients = True

        self._grad_hooks = [
            p.register_post_accumulate_grad_hook(on_gradient)
            for p in params
            if p.requires_grad and p.is_leaf
        ]

    def _apply(self, optimizer: torch.optim.Optimizer, multiplier: torch.Tensor) -> None:
        if self._dynamic:
            # After the decision the arena was validated for this iteration (and a later
            # backward is caught by the gradient hooks), so it is not re-checked per optimizer.
            arena = self._arena if self._decision is not None else None
            arena = arena or self._prepare_arena()
            arena.mul_(self._optimizers.index(optimizer), multiplier)
        elif not self._identity:
            grads = [p.grad for p in _params(optimizer) if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, multiplier.to(grads[0].device))

    def _apply_pending(self, optimizer: torch.optim.Optimizer) -> None:
        assert self._decision is not None
        multiplier = self._decision.pending.pop(id(optimizer), None)
        if multiplier is not None:
            self._apply(optimizer, multiplier)

    def _decide(self, clip_norm: float | None = None) -> _Decision:
        """Takes the iteration's overflow decision once, over every known optimizer.

        ``clip_norm`` (DLS only) clips by that global norm in the same pass, as DLS + GCC does;
        ``optimizer_step(..., max_gradient_norm=...)`` uses it.
        """
        if self._decision is not None:
            if self._late_gradients:
                raise RuntimeError(
                    "a backward pass accumulated gradients after this iteration's overflow "
                    "decision, which was taken over every optimizer's gradients at the first "
                    "step(): those gradients were never checked. Run every backward pass of an "
                    "iteration before the first step() (as one loss over all models), or use one "
                    "GradScaler per optimizer for alternating losses (GAN-style loops)."
                )
            return self._decision
        config = self._config
        if clip_norm is not None:
            config = _with_clip_norm(config, clip_norm)
        participants = tuple(self._optimizers)
        if not self._dynamic:  # static scaling never checks: apply every step
            self._decision = _Decision(
                pending={
                    id(o): self._inv_scale_t
                    for o in participants
                    if self._stages[o] is _Stage.READY
                },
            )
            return self._decision
        arena = self._prepare_arena()
        unscaled = any(self._stages[o] is _Stage.UNSCALED for o in participants)
        if unscaled:  # someone called unscale_: bring every optimizer to the unscaled state
            for index, optimizer in enumerate(participants):
                if self._stages[optimizer] is _Stage.READY:
                    arena.mul_(index, self._inv_scale_t)
                    self._stages[optimizer] = _Stage.UNSCALED
        out = _bridge.step_core(config, unscaled)(self._state, self._jax_flats)
        scalars = _bridge.step_scalars(out)  # waits: torch must not write the grads meanwhile
        multiplier = scalars.multiplier
        if unscaled:
            pending: dict[int, torch.Tensor] = {}
            if config.clips:
                arena.mul_all_(multiplier)
        else:
            pending = {id(o): multiplier for o in participants}
        self._decision = _Decision(
            pending=pending,
            outputs=out,
            scalars=scalars,
        )
        return self._decision

    def _fused_step_possible(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` can unscale and skip in its fused kernel, changing nothing.

        Only once its state exists: a skipped first step would otherwise create zero state.
        """
        if not self._dynamic or not getattr(optimizer, "_step_supports_amp_scaling", False):
            return False
        if hasattr(optimizer, "grad_scale") or hasattr(optimizer, "found_inf"):
            return False
        # By id: hashing a tensor key goes through Python (``Tensor.__hash__``), once per param.
        with_state = {id(param) for param, state in optimizer.state.items() if state}
        for group in optimizer.param_groups:
            if isinstance(optimizer, torch.optim.SGD) and not group.get("momentum"):
                continue  # stateless
            for param in group["params"]:
                if param.grad is not None and id(param) not in with_state:
                    return False
        return True

    def _fused_step(
        self,
        optimizer: torch.optim.Optimizer,
        decision: _Decision,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        assert decision.scalars is not None
        optimizer.grad_scale = decision.scalars.grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = decision.scalars.found_inf  # type: ignore[attr-defined]
        try:
            return optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
            del optimizer.found_inf  # type: ignore[attr-defined]
