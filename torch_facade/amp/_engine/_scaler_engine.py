"""The lid on the engine: everything one ``GradScaler`` does beyond its arguments and stages.

A :class:`ScalerEngine` owns a scaler's state (a :class:`~torch_facade.amp._engine._carry.Carry`)
and the optimizers it knows, and takes one overflow decision per iteration
(:class:`~torch_facade.amp._engine._decision.Decider`), which it then applies optimizer by
optimizer: unscaling in place, or handing the decision to a fused optimizer's kernel
(:mod:`~torch_facade.amp._engine._fused`). At the end of an iteration it adopts the next state,
restores what ``update_if_finite`` marked on a skipped step (:func:`settle`)
and watches for a stalled scale.

The public ``GradScaler`` keeps the per-optimizer stages and checks every argument; each of its
methods ends in one call here. A step (``GradScaler.step``) reads: :meth:`ScalerEngine.step` ->
:meth:`ScalerEngine.decide` -> ``Decider.dynamic`` (reads the gradients, calls the jitted core)
-> the fused kernel or :meth:`Decision.finish` and the optimizer's own ``step``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import torch

import amp_core
from torch_facade.amp import _caller
from torch_facade.amp._engine import _cbfloat16_notice, _cores, _distributed, _dlpack
from torch_facade.amp._engine._carry import Carry, Slot
from torch_facade.amp._engine._decision import Decider, Decision, params_of
from torch_facade.amp._engine._discovery import reached_parameters
from torch_facade.amp._engine._dtensor import local_values
from torch_facade.amp._engine._fused import FusedSteps
from torch_facade.amp._engine._gradients import on_device
from torch_facade.amp._engine._spikes import SpikeWindow
from torch_facade.amp._engine._storage import in_memory_order


@functools.lru_cache(maxsize=16)
def _with_clip_norm(config: amp_core.DynamicLossScale, norm: float) -> amp_core.DynamicLossScale:
    """``config`` with DLS + GCC at ``norm``; cached: ``optimizer_step`` asks every iteration."""
    return dataclasses.replace(config, max_gradient_norm=norm)


class ScalerEngine:
    """One scaler's state, optimizers and decisions.

    Args:
        config: the resolved configuration.
        process_group: the ``torch.distributed`` group whose ranks decide together.
        raise_on_stall: whether a stalled scale raises (see :meth:`end_iteration`).
        state: the initial state's values on the host, in field order (a pickled scaler's);
            the configuration's initial state if ``None``.
        spikes: the packed spike window on the host (a pickled scaler's; see
            :mod:`~torch_facade.amp._engine._spikes`); empty if ``None``. Only with a
            configuration that has ``spike_skip``.

    Raises:
        TypeError: ``process_group`` is not a process group.
    """

    def __init__(
        self,
        config: amp_core.LossScaleConfig,
        process_group: Any = None,
        *,
        raise_on_stall: bool = False,
        state: Sequence[Any] | None = None,
        spikes: Any = None,
    ) -> None:
        _distributed.check_group(process_group)
        self.config = config
        self.dynamic = config.is_dynamic
        self.raise_on_stall = raise_on_stall
        self.decider = Decider(process_group)
        self.warned_dtype = False
        self.optimizers: list[torch.optim.Optimizer] = []
        self.scaled = False  # a loss was scaled since the end of the last iteration
        self.decision: Decision | None = None
        self.last_decision: Decision | None = None
        # In the first iteration, the parameters the scaled losses reach join the decision.
        self.discovering = True
        self.reached: list[torch.Tensor] = []
        self._stall = StallWatch(config) if isinstance(config, amp_core.DynamicLossScale) else None
        self._fused = FusedSteps()
        # With spike_skip: the rolling window (None without: the decision's cores are the plain
        # ones), and for metric="loss" the sum of this iteration's unscaled losses.
        spike_skip = getattr(config, "spike_skip", None)
        self.spikes = None if spike_skip is None else SpikeWindow(spike_skip, spikes)
        self.watch_loss = spike_skip is not None and spike_skip.metric == "loss"
        self.loss_sum: torch.Tensor | None = None
        # The participating parameters, the same list while they stay the same (by identity).
        self._participants_cache: list[torch.Tensor] | None = None
        # On the host until the first decision puts it on the gradients' device: constructing a
        # scaler starts no JAX backend.
        self.set_state(
            amp_core.init_on_host(config) if state is None else _dlpack.host_state(state)
        )

    # ------------------------------------------------------------------ state

    def set_state(
        self, state: amp_core.LossScaleState, placed_for: torch.device | None = None
    ) -> None:
        """Adopts ``state``; ``placed_for``: the torch device whose JAX device it is on
        (``None`` for a state on the host), so that the next decision there need not look."""
        self._adopt(Carry(state, device=placed_for), _dlpack.to_torch(state.loss_scale))

    def _adopt(self, carry: Carry, scale: torch.Tensor) -> None:
        """Adopts the state ``carry`` holds, whose loss scale ``scale`` views."""
        self.carry = carry
        self.scale_tensor = scale
        # Static scaling: the scale as a Python float (get_scale() returns it; compiled code
        # reads it without a host read). By exactly 1 it needs no arithmetic at all.
        self.static_scale = None if self.dynamic else float(scale)
        self.identity = self.static_scale == 1.0

    @property
    def state(self) -> amp_core.LossScaleState:
        """The state (unpacked from the last decision's result when first asked for)."""
        return self.carry.state

    @property
    def placed_for(self) -> torch.device | None:
        """The torch device whose JAX device the state is on (``None``: on the host)."""
        return self.carry.device

    def host_state(self) -> amp_core.LossScaleState:
        """The state as NumPy arrays (a host synchronisation if it is on a device)."""
        return _dlpack.on_host(self.state)

    def load(self, state_dict: Mapping[str, Any]) -> None:
        """Loads a facade-format ``state_dict`` (absent keys keep their values), in place."""
        state = amp_core.from_state_dict(self.config, self.host_state(), state_dict)
        placed_for = self.placed_for
        if placed_for is not None:
            state = _dlpack.place_state(state, placed_for)
        self.set_state(state, placed_for=placed_for)

    def field(self, slot: Slot) -> torch.Tensor:
        """One entry of the current state as a 0-d tensor (see :meth:`Carry.field`)."""
        return self.carry.field(slot)

    @property
    def process_group(self) -> Any:
        """The process group given at construction (``None``: the default one, if any)."""
        return self.decider.process_group

    def busy(self) -> bool:
        """Whether an iteration is under way (a loss scaled, or a decision taken)."""
        return self.scaled or self.decision is not None

    def isfinite(self) -> torch.Tensor:
        """This iteration's skip signal once decided, else the last one's (a new tensor): false
        on an overflow, and with ``spike_skip`` on a spike."""
        if self.decision is not None:
            return self.decision.isfinite()
        finite = self.carry.field(Slot.ISFINITE)
        if self.spikes is not None:  # a spike's gradients were finite, its step not applied
            return torch.logical_and(finite, self.spikes.spiked().logical_not())
        return finite.clone()

    def global_norm(self) -> torch.Tensor:
        """This iteration's global norm once decided, else the last one's (a new tensor)."""
        norm = None if self.decision is None else self.decision.global_norm()
        return norm if norm is not None else self.carry.field(Slot.GLOBAL_NORM).clone()

    # ------------------------------------------------------------- optimizers

    def register(self, optimizer: torch.optim.Optimizer) -> None:
        """Adds an optimizer this engine has not met; its decisions cover it from now on.

        Raises:
            ValueError: FSDP1 parameters.
            RuntimeError: the iteration's decision was taken without its gradients.
        """
        params = params_of(optimizer)
        if any(getattr(p, "_fsdp_flattened", False) for p in params):
            raise ValueError(
                "GradScaler does not support FSDP1 (FullyShardedDataParallel) parameters: their "
                "gradients are flat shards the scaler cannot tell from replicas. Use FSDP2 "
                "(torch.distributed.fsdp.fully_shard), whose DTensor gradients it supports."
            )
        decision = self.decision
        if decision is not None and decision.covered is not None:
            unread = [p for p in params if p.grad is not None and id(p) not in decision.covered]
            if unread:
                raise RuntimeError(
                    f"{type(optimizer).__name__} reached this GradScaler after this iteration's "
                    "overflow decision was taken without its gradients. Register every "
                    "optimizer up front with GradScaler(..., optimizers=[opt1, opt2]), or call "
                    "unscale_() on each optimizer before the first step() (as optimizer_step "
                    "does)."
                )
        masters = getattr(optimizer, "_steps_float32_masters", False)  # with_master_weights
        if not self.warned_dtype and not masters and any(p.dtype != torch.float32 for p in params):
            warnings.warn(
                "GradScaler is unscaling gradients that are not float32 in their own dtype, and "
                "the optimizer steps the parameters in it: in float16 or bfloat16, updates "
                "smaller than half a unit in the last place round away. For a model held in "
                "half precision, pass cstorch.amp.with_master_weights(optimizer) instead, "
                "which steps float32 master copies (docs: pytorch/master-weights.md)",
                UserWarning,
                stacklevel=_caller.stacklevel(),
            )
            self.warned_dtype = True
        self.optimizers.append(optimizer)
        link(optimizer, self)  # for cstorch.amp.isfinite/update_if_finite
        if decision is not None:
            decision.join(optimizer)

    def _participants(self) -> list[torch.Tensor]:
        """Every known optimizer's parameters, then (first iteration) those the losses reach.

        The same list object as last time while every one of them is the same parameter, by
        identity, in the same order (the gradients' remembered structure is kept for that list:
        ``add_param_group``, a replaced ``params`` list or a parameter swapped inside one gives
        a new list). The remembered list keeps its parameters alive, so no other object can
        take one's place at the same address.
        """
        cached = self._participants_cache
        if cached is not None and not self.reached:
            lists = [group["params"] for o in self.optimizers for group in o.param_groups]
            if sum(map(len, lists)) == len(cached) and all(
                map(operator.is_, itertools.chain.from_iterable(lists), cached)
            ):
                return cached
        params = [p for o in self.optimizers for p in params_of(o)]
        seen = {id(p) for p in params}
        if len(seen) != len(params):
            raise ValueError(
                "a parameter appears twice among the optimizers known to this GradScaler; each "
                "parameter must belong to one optimizer and one param group"
            )
        if not self.reached:
            self._participants_cache = params
        for param in self.reached:
            if id(param) not in seen:
                seen.add(id(param))
                params.append(param)
        return params

    # -------------------------------------------------------------- iteration

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Starts (or continues) the iteration and returns ``loss.float()`` times the scale."""
        if not self.scaled:  # a new iteration: restore what was marked after the last one
            settle(self)
        self.scaled = True
        if self.discovering and self.dynamic and loss.grad_fn is not None:
            self.reached.extend(reached_parameters(loss))
        if self.watch_loss:
            self._add_loss(loss)
        if self.identity:
            return loss.float()
        scale = self.scale_tensor
        if scale.device != loss.device and scale.device.type != "cpu":
            scale = on_device(scale, loss.device)  # a CPU 0-d tensor needs no copy
        return loss.float() * scale

    def _add_loss(self, loss: torch.Tensor) -> None:
        """Adds ``loss`` (the sum of its elements, unscaled) to the iteration's loss, the metric
        of ``SpikeSkip(metric="loss")`` (no host synchronisation)."""
        with torch.no_grad():
            value = loss.detach().float().sum()
            self.loss_sum = (
                value if self.loss_sum is None else self.loss_sum + value.to(self.loss_sum.device)
            )

    def num_spike_skips(self) -> torch.Tensor:
        """Steps skipped as spikes so far (0 without ``spike_skip``): a new int64 0-d tensor."""
        if self.spikes is None:
            return torch.zeros((), dtype=torch.int64)
        return self.spikes.num_spike_skips()

    def decide(self, clip_norm: float | None = None) -> Decision:
        """Takes the iteration's overflow decision once, over every participating gradient.

        ``clip_norm`` (DLS only) clips by that global norm in the same pass, as DLS + GCC does;
        ``optimizer_step(..., max_gradient_norm=...)`` uses it.
        """
        if self.decision is not None:
            return self.decision
        params = self._participants()
        config = self.config
        if isinstance(config, amp_core.DynamicLossScale):
            if clip_norm is not None:
                config = _with_clip_norm(config, clip_norm)
            if self.spikes is None:
                decision = self.decider.dynamic(config, self.carry, params, self.optimizers)
            else:
                decision = self.decider.dynamic(
                    config, self.carry, params, self.optimizers, self.spikes, self._loss()
                )
        else:  # static scaling never checks: apply every step
            decision = self.decider.static(self.carry, params, self.optimizers, self.identity)
        self.decision = decision
        if self.dynamic:
            _cbfloat16_notice.check(self, self.config, self._host_scale, params)
        return decision

    def _loss(self) -> torch.Tensor | None:
        """The iteration's loss for ``SpikeSkip(metric="loss")`` (``None`` for the norm)."""
        if not self.watch_loss:
            return None
        if self.loss_sum is None:
            raise RuntimeError(
                'SpikeSkip(metric="loss") watches the loss passed to scale(): call '
                "scale(loss).backward() before this iteration's unscale_() or step()"
            )
        return self.loss_sum

    def _host_scale(self) -> float:
        return float(self.scale_tensor)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Takes the decision if not taken yet and unscales ``optimizer``'s gradients in place
        (with GCC the clip waits for :meth:`step`)."""
        just_read = self.decision is None
        self.decide().unscale_(optimizer, just_read)

    def finish(self, optimizer: torch.optim.Optimizer) -> None:
        """Takes the decision if not taken yet and applies everything ``optimizer``'s gradients
        still need (unscale and clip)."""
        self.decide().finish(optimizer)

    def step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Takes the decision if not taken yet, then ``optimizer.step(*args, **kwargs)`` if it
        is finite: in a fused kernel handed the decision (no host read), or after unscaling and
        reading the decision on the host. Returns what the step returned, or ``None``."""
        just_read = self.decision is None
        decision = self.decide()
        if self._fused.possible(optimizer, decision):
            return self._fused.step(optimizer, decision, args, kwargs)
        decision.finish(optimizer, just_read)
        return optimizer.step(*args, **kwargs) if decision.host_isfinite() else None

    def update_scale(self, stepped: int) -> None:
        """Adopts the decision's next state (once an iteration); ``stepped``: how many known
        optimizers stepped (the core counted on every known one)."""
        if not self.dynamic:
            return
        decision = self.decide()
        if decision.scale_updated:
            return
        carry = decision.next_carry()
        if self.spikes is not None and decision.next_spikes is not None:
            self.spikes.adopt(decision.next_spikes, decision.device)
        if stepped == decision.expected_steps:
            self._adopt(carry, carry.field(Slot.LOSS_SCALE))
        else:  # an optimizer joined late, or one known optimizer did not step
            state = _cores.recount_skipped_steps(decision.state_before, carry.state, stepped)
            self.set_state(state, placed_for=decision.device)
        decision.scale_updated = True

    def end_iteration(self) -> str | None:
        """Ends the iteration: forgets what it read, restores what ``update_if_finite``
        marked if the step was skipped, and checks for a stalled scale.

        Returns:
            The stall message when the caller must raise or warn (see :class:`StallWatch`),
            else ``None``.
        """
        if self.decision is not None:
            self.decision.read = None  # the gradients read must not outlive the iteration
        self.last_decision = self.decision
        self.decision = None
        self.scaled = False
        self.loss_sum = None
        if self.optimizers:
            self.discovering = False
            self.reached = []
        settle(self)
        if self._stall is None or self.last_decision is None:
            return None
        return self._stall.check(self.last_decision, self.raise_on_stall)

    # ------------------------------------------------------------ diagnostics

    def nonfinite_counts(self, module: torch.nn.Module | None = None) -> tuple[dict[str, int], int]:
        """Which gradients held inf or NaN at this iteration's (or the last) decision.

        Returns:
            Per overflowed gradient, by name, how many of its elements are inf or NaN once
            unscaled (0 for finite values whose squares overflow float32), in optimizer order;
            and how many gradients were read. In a distributed job, this rank's (its shards
            under FSDP2). In a scaler's first iteration the decision also read the parameters
            the scaled losses reached that no known optimizer holds; without ``module`` to name
            them they are ``unregistered_params[k]``, in the order the losses reached them.

        Raises:
            RuntimeError: no decision was taken yet.
        """
        decision = self.decision or self.last_decision
        if decision is None:
            raise RuntimeError(
                "nonfinite_gradients() needs a decision: call it after unscale_() or step()"
            )
        names = {id(p): name for name, p in module.named_parameters()} if module is not None else {}
        entries: list[tuple[str, torch.Tensor, float]] = []
        seen: set[int] = set()
        for index, optimizer in enumerate(self.optimizers):
            inv_scale = decision.inverse_scale_of(optimizer)
            for g, group in enumerate(optimizer.param_groups):
                for j, param in enumerate(group["params"]):
                    seen.add(id(param))
                    if param.grad is None:
                        continue
                    name = names.get(id(param), f"optimizer{index}.param_groups[{g}].params[{j}]")
                    entries.append((name, local_gradient(param), inv_scale))
        unregistered = [p for p in dict.fromkeys(self.reached) if id(p) not in seen]
        if unregistered:  # still as scaled: no optimizer has unscaled them
            inv_scale = decision.inverse_scale()
            for k, param in enumerate(unregistered):
                if param.grad is not None:
                    name = names.get(id(param), f"unregistered_params[{k}]")
                    entries.append((name, local_gradient(param), inv_scale))
        found: dict[str, int] = {}
        for inv_scale in sorted({inv for _, _, inv in entries}):
            chosen = [(name, t) for name, t, inv in entries if inv == inv_scale]
            arrays = _dlpack.import_tensors([t for _, t in chosen])
            leaves = jax.device_get(_cores.report_core()(list(arrays), inv_scale))
            for (name, _), leaf in zip(chosen, leaves, strict=True):
                if bool(leaf.overflows):
                    found[name] = int(leaf.nonfinite_count)
        ordered = {name: found[name] for name, _, _ in entries if name in found}
        return ordered, len(entries)


def local_gradient(param: torch.Tensor) -> torch.Tensor:
    """This rank's values of ``param.grad`` (its local shard under FSDP2), in memory order."""
    assert param.grad is not None
    return in_memory_order(local_values(param.grad)[0])


class StallWatch:
    """Says when a run has overflowed at ``min_loss_scale`` for ``stall_steps`` steps.

    Reads one number the decision already exported: free where the host is the device or has
    read the decision already, and skipped otherwise (a fused step on an accelerator: no host
    synchronisation for this; see docs/gpus.md).

    Args:
        config: the dynamic configuration (its ``stall_steps`` and ``min_loss_scale``).
    """

    def __init__(self, config: amp_core.DynamicLossScale) -> None:
        self.config = config
        self.warned = False

    def check(self, decision: Decision, raising: bool) -> str | None:
        """The stall message after ``decision``'s update when the caller must act: every time
        when ``raising``, else once per stall (a finite step starts a new one); else ``None``."""
        if decision.packed is None or not decision.host_values_known():
            return None
        if decision.host_isfinite():
            self.warned = False
            return None
        count = decision.host_stall_count()
        stall_steps: int = self.config.stall_steps  # type: ignore[assignment]  # resolved
        if count < stall_steps:
            self.warned = self.warned and count > 0
            return None
        if not raising:
            if self.warned:
                return None
            self.warned = True
        return (
            f"dynamic loss scaling has stalled: {count} consecutive steps overflowed with the "
            f"loss scale already at min_loss_scale={self.config.min_loss_scale}, so every step "
            "is skipped and lowering the scale cannot help. The gradients are inf or NaN for "
            "another reason (a diverged model, bad data, a learning rate that is too high): "
            "see GradScaler.nonfinite_gradients() for which parameters, and "
            "cstorch.amp.locate_overflow(model) for the layer where the overflow starts."
        )


def read_named_gradients(pairs: Sequence[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """This rank's gradient values of the named parameters that have one, by name."""
    return {name: local_gradient(p) for name, p in pairs if p.grad is not None}


# ------------------------------------------------- update_if_finite and isfinite
# The machinery behind cstorch.amp.update_if_finite and cstorch.amp.isfinite
# (torch_facade/amp/conditional_update.py says what they do for the user).

# The engine that last met each optimizer (the one whose decisions cover it).
_ENGINES: weakref.WeakKeyDictionary[torch.optim.Optimizer, ScalerEngine] = (
    weakref.WeakKeyDictionary()
)
# Per engine, the tensors marked this iteration: id(tensor) -> (weakref to it, its saved value).
_MARKS: weakref.WeakKeyDictionary[Any, dict[int, tuple[weakref.ref, torch.Tensor]]] = (
    weakref.WeakKeyDictionary()
)
# Whether any tensor was ever marked in this process: until then ``settle`` (twice an
# iteration) has nothing to look up.
_EVER_MARKED = [False]


def link(optimizer: torch.optim.Optimizer, engine: ScalerEngine) -> None:
    """Records that ``engine``'s decisions cover ``optimizer`` (at its registration)."""
    _ENGINES[optimizer] = engine


def engine_of(optimizer: torch.optim.Optimizer) -> ScalerEngine | None:
    """The engine whose decisions cover ``optimizer``, or ``None`` if no scaler met it."""
    return _ENGINES.get(optimizer)


def mark(engine: ScalerEngine, tensor: torch.Tensor) -> None:
    """Saves ``tensor``'s value now, to restore if ``engine``'s decision skips the step."""
    with torch.no_grad():
        saved = tensor.detach().clone()
    _MARKS.setdefault(engine, {})[id(tensor)] = (weakref.ref(tensor), saved)
    _EVER_MARKED[0] = True


def settle(engine: ScalerEngine) -> None:
    """Restores the tensors marked for ``engine``'s last decision if it skipped, and forgets
    them: ``torch.where(isfinite, tensor, saved)``, branch-free, with no host synchronisation.

    The engine calls it at the end of an iteration and at the start of the next.
    """
    if not _EVER_MARKED[0]:
        return
    marks = _MARKS.pop(engine, None)
    if not marks:
        return
    flag = engine.isfinite()
    with torch.no_grad():
        for ref, saved in marks.values():
            tensor = ref()
            if tensor is not None:
                keep = on_device(flag, tensor.device)  # waits if it goes to the CPU
                tensor.copy_(torch.where(keep, tensor, saved))
