"""One iteration's overflow decision: read every gradient once, decide, hand out multipliers.

:class:`Decider` takes the decision (once per iteration, at the first ``unscale_`` or ``step``):
it reads the participating gradients where torch keeps them (:mod:`~torch_facade.amp._engine._gradients`),
puts the scaler state on their device, crosses into JAX through that device's crossing
(:mod:`~torch_facade.amp._engine._crossing`), calls the jitted core (in a distributed job, the local half,
one all-gather, and the finish) and views the numbers torch needs. :class:`Decision` then answers
what each optimizer's gradients are multiplied by, and whether the step may be applied.

Lifetimes on an accelerator, where nothing here waits for the device: the imports (JAX views of
torch's gradients, and the packed copy of the small ones) live until the scalars have been
exported to torch, whose stream then waits for the core's read; after that torch may free or
reuse their memory, since its stream is ordered after JAX's read (they are not kept longer: that
would hold a second set of gradients through the next backward pass). A JAX result that torch
reads (the scalars, the scale, a distributed job's partial sums) is kept by the decision until
the next decision's core has been queued behind torch's work, so that JAX cannot reuse its
memory while a torch kernel may still read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import torch

import amp_core
from torch_facade.amp._engine import (
    _carry,
    _cores,
    _crossing,
    _distributed,
    _dlpack,
    _gradients,
    _spikes,
)
from torch_facade.amp._engine._carry import Carry, Slot

_CPU = torch.device("cpu")


@dataclasses.dataclass(slots=True, kw_only=True)
class Decision:
    """One iteration's overflow decision, taken once over every known optimizer's gradients.

    ``outputs`` is the jitted core's result, the next state packed with the step's scalars (a
    :class:`~torch_facade.amp._engine._carry.Carry`'s array, laid out as
    :class:`~torch_facade.amp._engine._carry.Slot` says), and ``packed`` torch's float32 view of
    it (both ``None`` for static scaling, which never checks); the accessors read it.

    Each optimizer's gradients go from scaled to unscaled (and clipped) in one multiply by
    ``full``; or, when ``unscale_`` comes first with DLS + GCC, in two, as in the reference:
    ``unscale`` there and ``clip`` at ``step``. ``pending`` holds what each optimizer's
    gradients still need.
    """

    # What scaled gradients are multiplied by (None: nothing to do, static scaling by 1).
    full: torch.Tensor | None
    # The inverse scale alone, and the clip coefficient alone (None without DLS + GCC).
    unscale: torch.Tensor | None
    clip: torch.Tensor | None
    # What each optimizer's gradients (by optimizer id) still need to be multiplied by.
    pending: dict[int, torch.Tensor]
    # Parameters (by id) whose gradients were read; None for static scaling, which reads none.
    covered: frozenset[int] | None
    # The state that scaled this iteration's gradients.
    before: Carry
    outputs: jax.Array | None = None
    # The torch view of ``outputs`` as float32 (one host read gives every number).
    packed: torch.Tensor | None = None
    # Optimizer steps the core counted on (the known optimizers at the decision).
    expected_steps: int = 0
    # The torch device of the gradients read (None when there were none).
    device: torch.device | None = None
    # Whether the host may read results without waiting for a device (the CPU).
    host_is_device: bool = True
    # Optimizers (by id) whose gradients the facade unscaled in place.
    unscaled: set[int] = dataclasses.field(default_factory=set)
    # Optimizers (by id) whose still-scaled gradients went to a fused kernel, which unscales
    # them in place when it applies the step and leaves them alone when it skips it.
    to_kernel: set[int] = dataclasses.field(default_factory=set)
    scale_updated: bool = False
    # The participating parameters the decision was taken over (the scaler's list: the same
    # object while they stay the same, which caches keyed on it rely on).
    params: Sequence[torch.Tensor] = ()
    # Kept alive for the lifetimes described in the module docstring.
    keep: tuple[Any, ...] = ()
    # The gradients read, to multiply without collecting them again, while nothing but the
    # scaler's own code ran since the read (see ``finish``); dropped once used, or at
    # ``update()``, so that they never outlive the iteration.
    read: _gradients.GradientRead | None = None
    # The optimizer (by id) whose parameters are exactly the participants, if there is one.
    sole: int | None = None
    # With spike_skip: the core's next packed spike window (see _spikes), adopted at update().
    next_spikes: jax.Array | None = None
    _host_values: list[float] | None = None

    def isfinite(self) -> torch.Tensor:
        """The overflow flag as a new 0-d bool tensor (no host synchronisation).

        A copy: the flag the skip decision reads must not change if the caller's tensor does.
        """
        if self.packed is None:
            return torch.tensor(True)
        return self.packed[Slot.FOUND_INF] == 0.0

    def global_norm(self) -> torch.Tensor | None:
        """The norm of this step's unscaled gradients, a new 0-d float32 tensor (no host
        synchronisation); ``None`` for static scaling."""
        return None if self.packed is None else self.packed[Slot.GLOBAL_NORM].clone()

    def grad_scale(self) -> torch.Tensor:
        """A torch view of what a fused optimizer divides the gradients by (dynamic only)."""
        assert self.packed is not None
        return self.packed[Slot.GRAD_SCALE]

    def found_inf(self) -> torch.Tensor:
        """A torch view of the overflow flag as a fused optimizer reads it (1.0 on overflow)."""
        assert self.packed is not None
        return self.packed[Slot.FOUND_INF]

    def next_carry(self) -> Carry:
        """The next state, as the core returned it (dynamic decisions only)."""
        assert self.outputs is not None
        return Carry(packed=self.outputs, device=self.device, view=self.packed)

    @property
    def state_before(self) -> amp_core.LossScaleState:
        """The state that scaled this iteration's gradients."""
        return self.before.state

    def host_values(self) -> list[float] | None:
        """The packed result as Python floats, by :class:`Slot` (the state's integer entries are
        bits, not numbers): one host read (a wait for the device on an
        accelerator), done at most once. ``None`` for static scaling.

        Raises:
            RuntimeError: the ranks of a distributed job disagreed on the scale, its counters,
                the overflows hysteresis absorbed or the spike window (checked whenever the
                values are read: at once on the CPU, at the first host read on an accelerator).
        """
        if self._host_values is None and self.packed is not None:
            self._host_values = self.packed.tolist()
            consistent = self._host_values[Slot.CONSISTENT]
            if consistent != 1.0:
                raise RuntimeError(
                    f"the ranks' GradScalers disagree on {_cores.disagreement_text(consistent)}, "
                    "so their decisions were not taken together: every rank must load the same "
                    "state_dict and call scale/unscale_/step/update in the same order"
                )
        return self._host_values

    def host_isfinite(self) -> bool:
        """``isfinite`` as a Python bool (see :meth:`host_values`)."""
        values = self.host_values()
        return values is None or values[Slot.FOUND_INF] == 0.0

    def host_stall_count(self) -> int:
        """The next state's count of consecutive overflows at ``min_loss_scale`` (see
        :meth:`host_values`; dynamic decisions only)."""
        values = self.host_values()
        assert values is not None
        return int(values[Slot.STALL_COUNT])

    def host_values_known(self) -> bool:
        """Whether reading :meth:`host_values` now costs no wait for a device."""
        return self.packed is None or self._host_values is not None or self.host_is_device

    def join(self, optimizer: torch.optim.Optimizer) -> None:
        """Adds an optimizer (met after the decision) whose gradients the decision read."""
        if self.full is not None:
            self.pending[id(optimizer)] = self.full

    def unscale_(self, optimizer: torch.optim.Optimizer, just_read: bool = False) -> None:
        """Unscales ``optimizer``'s gradients; with GCC the clip waits for ``step``.

        ``just_read``: see :meth:`finish`.
        """
        if self.pending.get(id(optimizer)) is not self.full:
            return
        if self.clip is None:
            self.finish(optimizer, just_read)
        else:
            assert self.unscale is not None  # set whenever clip is
            self._multiply(optimizer, self.unscale, just_read)
            self.pending[id(optimizer)] = self.clip
            self.unscaled.add(id(optimizer))

    def finish(self, optimizer: torch.optim.Optimizer, just_read: bool = False) -> None:
        """Applies whatever ``optimizer``'s gradients still need.

        ``just_read``: the decision was taken in the same call, with no user code since the
        read, so the gradients it read are still the ones to multiply (when ``optimizer``
        holds every participating parameter, the read's list is reused as it is).
        """
        multiplier = self.pending.pop(id(optimizer), None)
        if multiplier is not None:
            self._multiply(optimizer, multiplier, just_read)
            self.unscaled.add(id(optimizer))

    def _multiply(
        self, optimizer: torch.optim.Optimizer, multiplier: torch.Tensor, just_read: bool
    ) -> None:
        read, self.read = self.read, None
        if (
            just_read
            and read is not None
            and read.tensors is not None
            and self.sole == id(optimizer)
        ):
            _gradients.multiply_read_(read, multiplier)
        else:
            multiply(optimizer, multiplier)

    def inverse_scale_of(self, optimizer: torch.optim.Optimizer) -> float:
        """What ``optimizer``'s gradients must still be multiplied by to read them unscaled."""
        if id(optimizer) in self.unscaled:
            return 1.0
        if id(optimizer) in self.to_kernel and self.host_isfinite():
            return 1.0
        return self.inverse_scale()

    def inverse_scale(self) -> float:
        """``1 / loss_scale`` of the state that scaled this iteration's gradients (amp_core's)."""
        values = self.host_values()
        if values is not None:
            return values[Slot.UNSCALE]
        return float(_cores.inverse_scale(self.state_before))


def multiply(optimizer: torch.optim.Optimizer, multiplier: torch.Tensor) -> None:
    """Multiplies ``optimizer``'s gradients in place by a 0-d float32 tensor."""
    _gradients.multiply_(_gradients.local_tensors(params_of(optimizer)), multiplier)


def _sole(
    optimizers: Sequence[torch.optim.Optimizer], params: Sequence[torch.Tensor]
) -> int | None:
    """``id`` of the one optimizer whose parameters are all of ``params``, or ``None``.

    ``params`` (the participants) list every known optimizer's parameters in order, then any
    others the losses reached, with no parameter twice: one optimizer holding as many
    parameters as ``params`` holds exactly them, in that order.
    """
    if len(optimizers) != 1:
        return None
    (optimizer,) = optimizers
    if sum(len(group["params"]) for group in optimizer.param_groups) != len(params):
        return None
    return id(optimizer)


def _imports(
    units: tuple[torch.Tensor, ...], kept: tuple[_gradients.KeptPack | None, ...] | None
) -> tuple[Any, ...]:
    """JAX views of ``units``; a kept pack's (``kept``: see :class:`_gradients.GradientRead`)
    is made once, then reused (if the import copied the buffer instead, it is made anew at
    every read, as any other unit's)."""
    if kept is None:
        return _dlpack.import_tensors(units)
    fresh_units = [unit for unit, pack in zip(units, kept, strict=True) if pack is None]
    fresh = iter(_dlpack.import_tensors(fresh_units) if fresh_units else ())
    arrays = []
    for pack in kept:
        if pack is None:
            arrays.append(next(fresh))
            continue
        array = pack.imported
        if array is None:
            (array,) = _dlpack.import_tensors([pack.buffer])
            # Kept only if it views the buffer: a copy would never see the next reads' values.
            if _crossing.address(array) == pack.buffer.data_ptr():
                pack.imported = array
        arrays.append(array)
    return tuple(arrays)


def params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter of ``optimizer``, in param-group order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


class Decider:
    """Takes one scaler's decisions.

    Args:
        process_group: the group whose ranks decide together (``None``: the default group, in a
            job of more than one rank).
    """

    def __init__(self, process_group: Any) -> None:
        self.process_group = process_group
        self.reader = _gradients.Reader()  # remembers the gradients' structure between reads
        # The optimizer step count as a JAX array on a device (a Python int would be converted
        # and transferred on every call).
        self._counts: dict[tuple[torch.device, int], Any] = {}
        # Static scaling's multiplier on a device, for the state it was computed from.
        self._static: tuple[amp_core.LossScaleState, torch.device, torch.Tensor] | None = None

    def static(
        self,
        carry: Carry,
        params: Sequence[torch.Tensor],
        optimizers: Sequence[torch.optim.Optimizer],
        identity: bool,
    ) -> Decision:
        """Static scaling never checks: every step is applied, gradients multiplied by 1/scale.

        Only the device of the gradients is looked at (static scaling reads no gradient).
        """
        if identity:
            return Decision(
                full=None, unscale=None, clip=None, pending={}, covered=None, before=carry
            )
        state = carry.state
        device = _gradients.device_of(params) or _CPU
        cached = self._static
        if cached is None or cached[0] is not state or cached[1] != device:
            placed = _dlpack.place_state(state, device)
            cached = (state, device, _dlpack.to_torch(_cores.inverse_scale(placed)))
            self._static = cached
        multiplier = cached[2]
        pending = {id(o): multiplier for o in optimizers}
        return Decision(
            full=multiplier,
            unscale=multiplier,
            clip=None,
            pending=pending,
            covered=None,
            before=carry,
            device=device,
        )

    def dynamic(
        self,
        config: amp_core.DynamicLossScale,
        carry: Carry,
        params: Sequence[torch.Tensor],
        optimizers: Sequence[torch.optim.Optimizer],
        spikes: _spikes.SpikeWindow | None = None,
        loss: torch.Tensor | None = None,
    ) -> Decision:
        """Reads the gradients of ``params`` once and decides (DLS, DLS + GCC).

        Args:
            config: the configuration (with ``max_gradient_norm`` for a fused clip).
            carry: the scaler state (packed and moved onto the gradients' device, once).
            params: every participating parameter.
            optimizers: the known optimizers (each counts one optimizer step).
            spikes: the spike window, when ``config.spike_skip`` is set (else ``None``: the
                cores without spike skipping, unchanged).
            loss: the iteration's unscaled loss (``SpikeSkip(metric="loss")`` only).
        """
        grads = self.reader.read(params)
        layout = _distributed.mesh_layout(grads.meshes, self.process_group)
        device = grads.device or carry.device or _CPU
        before = carry.packed_on(device)
        crossing = _dlpack.crossing_for(device)
        branch_free = not crossing.host_is_device
        steps = len(optimizers)
        count = self._counts.get((device, steps))
        if count is None:
            count = self._counts[(device, steps)] = _dlpack.counter_on(device, steps)
        window = None if spikes is None else spikes.packed_on(device)
        losses: tuple[Any, ...] = ()  # the loss's JAX view, for SpikeSkip(metric="loss")
        if loss is not None:
            loss = loss if loss.device == device else loss.to(device)
            losses = _dlpack.import_tensors([loss])
        next_spikes = None
        collective = _distributed.collective(self.process_group)
        if collective is None:
            arrays = _imports(grads.sharded + grads.replicated, grads.kept)
            if window is None:
                out = _cores.local_core(config, branch_free)(before, arrays, count)
            else:
                out, next_spikes = _cores.local_spike_core(config, branch_free)(
                    before, window, arrays, count, losses[0] if losses else None
                )
            keep: tuple[Any, ...] = (loss,)
        else:
            sharded = _dlpack.import_tensors(grads.sharded)
            replicated = _imports(grads.replicated, grads.kept)
            partials = _dlpack.to_torch(
                _cores.partials_core(branch_free)(before, window, sharded, replicated, *losses)
            )
            gathered = layout.arrange(collective.gather(partials))
            rows = _dlpack.to_jax(gathered)
            if window is None:
                out = _cores.distributed_core(config, layout.replicas)(before, rows, count)
            else:
                out, next_spikes = _cores.distributed_spike_core(config, layout.replicas)(
                    before, window, rows, count
                )
            keep = (partials, gathered, loss)
        packed = _carry.exported_carry(out, crossing)  # the imports may go once this returns
        full = packed[Slot.MULTIPLIER]
        clips = config.clips
        decision = Decision(
            full=full,
            unscale=packed[Slot.UNSCALE] if clips else None,
            clip=packed[Slot.CLIP_MULTIPLIER] if clips else None,
            pending=dict.fromkeys(map(id, optimizers), full),
            covered=grads.covered,
            before=carry,
            outputs=out,
            packed=packed,
            expected_steps=steps,
            device=device,
            host_is_device=crossing.host_is_device,
            params=params,
            keep=keep,
            read=grads,
            sole=_sole(optimizers, params),
            next_spikes=next_spikes,
        )
        if collective is not None and crossing.host_is_device:
            decision.host_values()  # free here; checks that the ranks agreed
        return decision
