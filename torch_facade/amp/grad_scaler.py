"""``cstorch.amp.GradScaler``: the per-optimizer stage machine over one decision per iteration.

Each method checks its arguments and the optimizer's stage, then makes one call to the engine
(:class:`~torch_facade.amp._engine._scaler_engine.ScalerEngine`), which owns the state, the
optimizers and the iteration's decision. docs/architecture.md follows one step through it.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

import amp_core
from amp_core import framework_configs as amp_core_framework_configs
from torch_facade.amp import _caller, _torch_checkpoint
from torch_facade.amp._arguments import check_optimizer, optimizer_list
from torch_facade.amp._engine import SPIKE_STATE_KEYS, ScalerEngine, Slot
from torch_facade.amp._host_side import host_side
from torch_facade.amp.diagnostics import LossScaleStalledError, OverflowReport
from torch_facade.amp.precision import get_half_dtype_str

__all__ = ["GradScaler", "LossScaleStalledError"]


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _truthy(value: Any) -> bool:
    try:
        return bool(value)
    except (RuntimeError, ValueError, TypeError):  # e.g. a tensor of several elements
        return True


class GradScaler:
    """Facilitates mixed precision training with static or dynamic loss scaling (DLS, DLS + GCC).

    The documented ``cerebras.pytorch.amp.GradScaler``, working with any ``torch.optim``
    optimizer on any device torch and JAX share, in one process or across the ranks of a
    ``torch.distributed`` job (DDP, FSDP2). Every number (scale, overflow flag, norm, clip
    coefficient, next scale) comes out of ``amp_core``'s jitted functions; gradients reach JAX
    through DLPack without copies, wherever torch keeps them (fresh tensors after ``zero_grad()``,
    DDP's buckets, FSDP2's local shards).

    Per iteration: ``scale(loss).backward()``, optionally ``unscale_(opt)`` (then clip or inspect
    the gradients), ``step(opt)`` for each optimizer, then ``update()`` once. The overflow
    decision is taken once per iteration, at the first ``unscale_`` (else the first ``step``),
    from the gradients as they are then, over the gradients of every optimizer this scaler
    knows: an inf in any of them skips all, and in a distributed job on every rank. An optimizer
    becomes known when it is passed to any method (or to ``optimizers=`` here) and stays known;
    in the first iteration the decision also covers every parameter the scaled losses reach, so
    torch's multi-optimizer loop works without registration.

    Host synchronisation: on a GPU none per iteration with fused optimizers (``Adam``/``AdamW``/
    ``SGD`` with ``fused=True``, once their state exists): the jitted check is ordered after
    torch's work on the device, torch's later kernels after it, and the kernels get the scale and
    the overflow flag as tensors. Non-fused optimizers read ``isfinite`` on the host once per
    iteration, as torch's scaler does. On the CPU the host is the device, so the decision's
    results are complete when the facade sees them. ``state_dict`` synchronises;
    ``get_isfinite`` and ``get_global_norm`` return tensors. JAX's backends are started (with
    GPU memory preallocation off) only at the first decision: see "Sharing a GPU with torch" in
    the docs' GPUs page (docs/gpus.md).

    A backward pass of a scaled loss after the iteration's decision (alternating losses, as in
    GAN loops) raises a ``RuntimeError`` in ``scale()``: its gradients would not be part of the
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
        process_group: the ``torch.distributed`` group whose ranks take one decision together
            (default: the default group, when torch.distributed is initialized).
        stall_steps: DLS warns (once) when this many consecutive steps overflowed with the
            scale already at ``min_loss_scale`` (default ``steps_per_increase``).
        raise_on_stall: raise :class:`LossScaleStalledError` instead of warning.
        hysteresis: DLS halves the scale at the ``hysteresis``-th overflow (DeepSpeed's and
            Megatron's ``hysteresis``); the ones before are skipped with the scale kept, and
            forgiven when the scale grows. ``1`` (the default): every overflow halves.
        consecutive_hysteresis: also forgive them at every finite step (DeepSpeed's option).
        growth_interval: steps from one growth to the next with no overflow between (default
            ``steps_per_increase + 1``; DeepSpeed's rule is ``steps_per_increase``).
        spike_skip: with DLS, a :class:`cstorch.amp.SpikeSkip <amp_core.SpikeSkip>`: also skip a
            finite step whose global gradient norm (or loss) exceeds ``mean + sigma * std`` of
            the last ``window`` applied steps, decided in the overflow check's jitted call with
            no host synchronisation; a spike leaves the loss scale and its counters alone and is
            counted by :meth:`get_num_spike_skips` (docs: pytorch/spike-skip.md). ``None`` (the
            default): no spike skipping.

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

    @host_side
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
        process_group: Any = None,
        stall_steps: int | None = None,
        raise_on_stall: bool = False,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        growth_interval: int | None = None,
        spike_skip: amp_core.SpikeSkip | None = None,
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
            stall_steps=stall_steps,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            growth_interval=growth_interval,
            spike_skip=spike_skip,
        )
        if not isinstance(raise_on_stall, bool):
            raise TypeError(f"raise_on_stall must be a bool; got {raise_on_stall!r}")
        self._engine = ScalerEngine(self._config, process_group, raise_on_stall=raise_on_stall)
        self._stages: dict[torch.optim.Optimizer, _Stage] = {}
        if optimizers is not None:
            for optimizer in optimizer_list(optimizers, "optimizers"):
                self._register(optimizer)
            self._engine.discovering = False  # the user said which optimizers take part

    @property
    def config(self) -> amp_core.LossScaleConfig:
        """The resolved ``amp_core`` configuration (every default filled in)."""
        return self._config

    @classmethod
    def from_deepspeed_config(
        cls,
        config: Any,
        *,
        clip_in_scaler: bool = True,
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        process_group: Any = None,
    ) -> GradScaler:
        """A scaler that takes DeepSpeed's decisions, step for step, from its ``ds_config``.

        Reads ``fp16`` (``enabled``, ``loss_scale``, ``initial_scale_power``,
        ``loss_scale_window``, ``hysteresis``, ``consecutive_hysteresis``, ``min_loss_scale``),
        ``bf16.enabled`` and ``gradient_clipping``, as :func:`amp_core.from_deepspeed_config`
        (the table of keys is there and on the docs page "DeepSpeed and Megatron settings").
        With dynamic fp16 scaling the scaler raises :class:`LossScaleStalledError` in
        ``update()`` when an overflow finds the scale at ``min_loss_scale`` with no
        hysteresis left, where DeepSpeed raises "Current loss scale already at minimum".

        The half dtype in force is left alone: call ``cstorch.amp.set_half_dtype`` for the
        model as the config says (``"float16"`` or ``"bfloat16"``).

        Args:
            config: the whole ``ds_config`` (a dict, or the path of its JSON file), or its
                ``fp16`` section.
            clip_in_scaler: map ``gradient_clipping`` to the scaler's fused clipping
                (``max_gradient_norm``); ``False``: leave it to the loop
                (``optimizer_step(..., max_gradient_norm=...)``).
            optimizers: as in the constructor.
            process_group: as in the constructor.

        Raises:
            TypeError: ``config`` is not a mapping or a path, or an entry has the wrong type.
            ValueError: an unknown key, an ``"auto"`` value, an out-of-range value, fp16 and
                bf16 both enabled, or clipping with a static scale while ``clip_in_scaler``.

        Example:
            >>> import torch_facade as cstorch
            >>> scaler = cstorch.amp.GradScaler.from_deepspeed_config(
            ...     {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
            ...               "hysteresis": 2}, "gradient_clipping": 1.0}
            ... )
            >>> scaler.get_scale(), scaler.config.hysteresis, scaler.config.max_gradient_norm
            (tensor(4096.), 2, 1.0)
        """
        settings = amp_core_framework_configs.deepspeed_settings(
            config, clip_in_scaler=clip_in_scaler
        )
        return cls._from_settings(settings, optimizers, process_group)

    @classmethod
    def from_megatron_args(
        cls,
        args: Any,
        *,
        clip_in_scaler: bool = True,
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        process_group: Any = None,
    ) -> GradScaler:
        """A scaler that takes Megatron's decisions, step for step, from its arguments.

        Reads ``--fp16``, ``--bf16``, ``--loss-scale``, ``--initial-loss-scale``,
        ``--min-loss-scale``, ``--loss-scale-window``, ``--hysteresis`` and ``--clip-grad``
        from Megatron's ``argparse.Namespace``, a mapping or a list of flags, as
        :func:`amp_core.from_megatron_args`. The half dtype in force is left alone.

        Args:
            args: Megatron's arguments (a Namespace, an object or mapping with its names, or a
                list of command-line flags).
            clip_in_scaler: map ``--clip-grad`` to the scaler's fused clipping; ``False``:
                leave it to the loop (needed with ``--bf16``, whose scale is static).
            optimizers: as in the constructor.
            process_group: as in the constructor.

        Raises:
            TypeError: ``args`` of another kind, or a value of the wrong type.
            ValueError: an unknown loss-scaling flag, an out-of-range value or a combination
                Megatron has no meaning for (see :func:`amp_core.from_megatron_args`).

        Example:
            >>> import torch_facade as cstorch
            >>> scaler = cstorch.amp.GradScaler.from_megatron_args(
            ...     ["--fp16", "--initial-loss-scale", "65536", "--hysteresis", "3"]
            ... )
            >>> scaler.get_scale(), scaler.config.hysteresis, scaler.config.steps_per_increase
            (tensor(65536.), 3, 999)
        """
        settings = amp_core_framework_configs.megatron_settings(args, clip_in_scaler=clip_in_scaler)
        return cls._from_settings(settings, optimizers, process_group)

    @classmethod
    def _from_settings(
        cls,
        settings: amp_core_framework_configs.ImportedSettings,
        optimizers: Any,
        process_group: Any,
    ) -> GradScaler:
        config = settings.config
        if not isinstance(config, amp_core.DynamicLossScale):
            return cls(config.loss_scale, optimizers=optimizers, process_group=process_group)
        return cls(
            "dynamic",
            init_scale=config.init_scale,
            steps_per_increase=config.steps_per_increase,
            min_loss_scale=config.min_loss_scale,
            max_loss_scale=config.max_loss_scale,
            overflow_tolerance=config.overflow_tolerance,
            max_gradient_norm=config.max_gradient_norm,
            optimizers=optimizers,
            process_group=process_group,
            stall_steps=config.stall_steps,
            raise_on_stall=settings.raise_on_stall,
            hysteresis=config.hysteresis,
            consecutive_hysteresis=config.consecutive_hysteresis,
            growth_interval=config.growth_interval,
        )

    @host_side
    def state_dict(self, destination: dict[str, Any] | None = None) -> dict[str, Any]:
        """Returns the real scaler state for a checkpoint (a host synchronisation).

        DLS: ``loss_scale`` (float32 tensor), ``steps_since_rescale``,
        ``overflows_since_rescale``, ``num_skipped_steps`` and ``overflows_at_min_scale``
        (int64 tensors), and with ``hysteresis > 1`` ``absorbed_overflows``. Static:
        ``loss_scale``. Unlike the reference off Cerebras hardware, never ``{}``. In a
        distributed job it is the same on every rank. With ``spike_skip``, also the rolling
        window: ``spike_window`` (float32, ``window`` values), ``spike_applied`` and
        ``num_spike_skips`` (int64), so that a resumed run takes the same decisions.

        Args:
            destination: a dict to fill and return instead of a new one.

        Example:
            >>> import torch_facade as cstorch
            >>> sorted(cstorch.amp.GradScaler(loss_scale="dynamic").state_dict())  # doctest: +NORMALIZE_WHITESPACE
            ['loss_scale', 'num_skipped_steps', 'overflows_at_min_scale',
             'overflows_since_rescale', 'steps_since_rescale']
        """
        if destination is not None and not isinstance(destination, dict):
            raise TypeError(f"destination must be a dict or None; got {type(destination).__name__}")
        result = {} if destination is None else destination
        for key, value in amp_core.to_state_dict(self._config, self._engine.state).items():
            dtype = torch.float32 if key == "loss_scale" else torch.int64
            result[key] = torch.tensor(value, dtype=dtype)
        if self._engine.spikes is not None:
            result.update(self._engine.spikes.state_dict())
        return result

    @host_side
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads the keys present in ``state_dict``; absent keys keep their values.

        Values may be tensors or numbers. Must be called between iterations. Checkpoints
        written before ``overflows_at_min_scale`` or ``absorbed_overflows`` existed load too
        (with no stall counted, every strike left), and so do
        ``torch.amp.GradScaler`` checkpoints: their scale is taken over, with a warning naming
        what is not (see :mod:`~torch_facade.amp._torch_checkpoint`).

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
        if self._busy():
            raise RuntimeError(
                "load_state_dict() must be called between iterations (after update()), not "
                "between scale() and update(): the gradients were scaled with the old scale"
            )
        spikes, window = self._engine.spikes, None
        if spikes is not None and isinstance(state_dict, Mapping):
            window = spikes.loaded(state_dict)  # checked first: nothing loaded if it raises
            state_dict = {k: v for k, v in state_dict.items() if k not in SPIKE_STATE_KEYS}
        self._engine.load(_torch_checkpoint.to_facade_format(state_dict, self._config))
        if spikes is not None and window is not None:
            spikes.adopt_host(window)

    def _busy(self) -> bool:
        stepping = any(s is not _Stage.READY for s in self._stages.values())
        return stepping or self._engine.busy()

    def __getstate__(self) -> dict[str, Any]:
        """Pickles between iterations: the configuration and the whole state, on the host.

        Known optimizers are not pickled (as with ``torch.amp.GradScaler``): an unpickled
        scaler meets them again at its next call.
        """
        if self._busy():
            raise RuntimeError(
                "a GradScaler can only be pickled (or deep-copied) between iterations, after "
                "update(): this one is between scale() and update()"
            )
        engine = self._engine
        if engine.process_group is not None:
            raise TypeError("a GradScaler with an explicit process_group cannot be pickled")
        return {
            "config": self._config,
            "state": engine.host_state(),
            "raise_on_stall": engine.raise_on_stall,
            "warned_dtype": engine.warned_dtype,
            "spikes": None if engine.spikes is None else engine.spikes.host(),
        }

    def __setstate__(self, pickled: dict[str, Any]) -> None:
        self._config = pickled["config"]
        # On the host, until the next decision places it (as after construction).
        self._engine = ScalerEngine(
            self._config,
            raise_on_stall=pickled["raise_on_stall"],
            state=pickled["state"],
            spikes=pickled.get("spikes"),  # absent from scalers pickled before spike_skip
        )
        self._engine.warned_dtype = pickled["warned_dtype"]
        self._stages = {}

    # ------------------------------------- torch.amp.GradScaler internals that trainers call

    @property
    def _device(self) -> str:
        """The device type of the scale, as ``torch.amp.GradScaler._device``.

        accelerate reads it when it loads an FSDP2 checkpoint (with
        :meth:`_lazy_init_scale_growth_tracker`).
        """
        return self._engine.scale_tensor.device.type

    def _lazy_init_scale_growth_tracker(self, dev: Any) -> None:
        """A no-op: this scaler's state exists from construction (torch's creates it lazily).

        accelerate calls it after ``load_state_dict`` when it loads an FSDP2 checkpoint.
        """

    # --------------------------------------------------------------- accessors

    def is_enabled(self) -> bool:
        """Whether the scaler does anything: ``False`` only for static scaling by 1.

        As ``torch.amp.GradScaler.is_enabled``, which trainers ask.

        Example:
            >>> import torch_facade as cstorch
            >>> cstorch.amp.GradScaler(loss_scale="dynamic").is_enabled()
            True
            >>> cstorch.amp.GradScaler(loss_scale=1.0).is_enabled()
            False
        """
        return not self._engine.identity

    def get_scale(self) -> torch.Tensor | float:
        """The current loss scale: a float32 tensor for DLS, a float for static scaling.

        Example:
            >>> import torch_facade as cstorch
            >>> cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=1024.0).get_scale()
            tensor(1024.)
            >>> cstorch.amp.GradScaler(loss_scale=8.0).get_scale()
            8.0
        """
        engine = self._engine
        if engine.static_scale is not None:
            return engine.static_scale
        return engine.scale_tensor.clone()

    @host_side
    def get_non_clamped_scale(self) -> torch.Tensor | float:
        """The scale of the last update after the max clamp and before the min clamp.

        Example:
            >>> import torch, torch_facade as cstorch
            >>> model = torch.nn.Linear(2, 1, bias=False)
            >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = cstorch.amp.GradScaler("dynamic", init_scale=4.0, min_loss_scale=4.0)
            >>> scaler.scale(model(torch.full((1, 2), float("inf"))).sum()).backward()
            >>> scaler.step(optimizer)  # overflow: skipped, the scale halves to 2 ...
            >>> scaler.update()
            >>> scaler.get_scale(), scaler.get_non_clamped_scale()  # ... and is clamped to 4
            (tensor(4.), tensor(2.))
        """
        value = self._engine.field(Slot.NON_CLAMPED_SCALE)
        return value.clone() if self._engine.dynamic else float(value)

    @host_side
    def get_num_skipped_steps(self) -> torch.Tensor:
        """Optimizer steps skipped for overflow so far (int64 tensor; 0 for static scaling).

        Each skipped ``step(optimizer)`` counts, as in the reference: an iteration that skips
        two optimizers adds 2.

        Example:
            >>> import torch, torch_facade as cstorch
            >>> model = torch.nn.Linear(2, 1, bias=False)
            >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
            >>> scaler.scale(model(torch.full((1, 2), float("nan"))).sum()).backward()
            >>> scaler.step(optimizer)
            >>> scaler.update()
            >>> scaler.get_num_skipped_steps()
            tensor(1)
        """
        return self._engine.field(Slot.NUM_SKIPPED_STEPS).to(torch.int64)

    @host_side
    def get_num_spike_skips(self) -> torch.Tensor:
        """Steps skipped as spikes so far (int64 tensor; 0 without ``spike_skip``).

        Counted apart from :meth:`get_num_skipped_steps` (overflows): a spike is a finite step
        whose metric was ``sigma`` deviations above the recent mean (see
        :class:`cstorch.amp.SpikeSkip <amp_core.SpikeSkip>`). No host synchronisation.

        Example:
            >>> import torch, torch_facade as cstorch
            >>> model = torch.nn.Linear(2, 1, bias=False)
            >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
            >>> scaler = cstorch.amp.GradScaler(
            ...     loss_scale="dynamic", spike_skip=cstorch.amp.SpikeSkip(window=4))
            >>> for x in [1.0, 1.1, 0.9, 1.0, 300.0]:  # the gradient's norm: x * sqrt(2)
            ...     scaler.scale(model(torch.full((1, 2), x)).sum()).backward()
            ...     scaler.step(optimizer)
            ...     scaler.update()
            ...     optimizer.zero_grad()
            >>> scaler.get_num_spike_skips(), scaler.get_isfinite(), scaler.get_num_skipped_steps()
            (tensor(1), tensor(False), tensor(0))
        """
        return self._engine.num_spike_skips()

    @host_side
    def get_isfinite(self) -> torch.Tensor:
        """The skip signal: whether this iteration's (or else the last) step was finite.

        Once the iteration's decision is taken (at the first ``unscale_`` or ``step``), this is
        the iteration's flag; after ``update()`` it is the last iteration's. A new bool tensor
        (a copy), without a host synchronisation.

        Example:
            >>> import torch, torch_facade as cstorch
            >>> model = torch.nn.Linear(2, 1, bias=False)
            >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
            >>> scaler.scale(model(torch.ones(1, 2)).sum()).backward()
            >>> model.weight.grad[0, 0] = float("inf")  # before the decision: it counts
            >>> scaler.unscale_(optimizer)  # the decision
            >>> scaler.get_isfinite()
            tensor(False)
        """
        return self._engine.isfinite()

    @host_side
    def get_global_norm(self) -> torch.Tensor:
        """The global L2 norm of this iteration's (or else the last) unscaled gradients.

        A new float32 tensor (a copy), without a host synchronisation; 0 before the first DLS
        step and for static scaling, which does not check gradients.

        Example:
            >>> import torch, torch_facade as cstorch
            >>> model = torch.nn.Linear(2, 1, bias=False)
            >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
            >>> scaler.scale(model(torch.tensor([[3.0, 4.0]])).sum()).backward()
            >>> scaler.unscale_(optimizer)  # the unscaled gradient is [3, 4]
            >>> scaler.get_global_norm()
            tensor(5.)
        """
        return self._engine.global_norm()

    # --------------------------------------------------------------- the loop

    @host_side
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Scales the loss before the backward pass: ``loss.float() * scale``.

        It also starts the iteration (checks, restores what ``update_if_finite`` marked, and in
        the first iteration finds the parameters the loss reaches), so in ``torch.compile``'d
        code it runs eagerly, behind a graph break just before the one ``.backward()`` makes.

        Raises:
            TypeError: ``loss`` is not a tensor.
            RuntimeError: DLS, and this iteration's overflow decision was already taken.

        Example:
            >>> import torch, torch_facade as cstorch
            >>> cstorch.amp.GradScaler(loss_scale="dynamic").scale(torch.tensor(2.0))
            tensor(65536.)
        """
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss must be a torch.Tensor; got {type(loss).__name__}")
        if self._engine.decision is not None and self._engine.dynamic:
            raise RuntimeError(
                "scale() was called after this iteration's overflow decision, which was taken "
                "at the first unscale_() or step() over every optimizer's gradients: the "
                "gradients of this loss would never be checked. Run every backward pass of an "
                "iteration before the first unscale_()/step() (as one loss over all models), or "
                "use one GradScaler per optimizer for alternating losses (GAN-style loops)."
            )
        return self._engine.scale(loss)

    @host_side
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscales the gradients of ``optimizer``'s parameters in place.

        The first ``unscale_`` of an iteration takes the iteration's overflow decision, from
        the gradients as they are now: changes made to them afterwards (clipping, overwriting)
        do not change it, and ``get_isfinite()``/``get_global_norm()`` read after it are this
        iteration's. With DLS + GCC ``unscale_`` only unscales, and ``step`` clips with the
        coefficient of this decision (as the reference does). A no-op if already unscaled this
        iteration.

        Raises:
            TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
            RuntimeError: called after ``step(optimizer)`` in the same iteration, or without a
                ``scale(loss).backward()`` since the last ``update()``.

        Example:
            >>> import torch, torch_facade as cstorch
            >>> model = torch.nn.Linear(2, 1, bias=False)
            >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
            >>> scaler.scale(model(torch.tensor([[3.0, 4.0]])).sum()).backward()
            >>> model.weight.grad  # scaled by 2**15
            tensor([[ 98304., 131072.]])
            >>> scaler.unscale_(optimizer)
            >>> model.weight.grad
            tensor([[3., 4.]])
        """
        optimizer = check_optimizer(optimizer, "optimizer")
        self._register(optimizer)
        stage = self._stages[optimizer]
        if stage is _Stage.UNSCALED:
            return
        if stage is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        self._require_scaled("unscale_")
        self._engine.unscale(optimizer)
        self._stages[optimizer] = _Stage.UNSCALED

    @host_side
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscales (if needed), checks for overflow once per iteration, and steps if finite.

        On overflow, parameters and every optimizer state tensor stay bit-identical. ``args``
        and ``kwargs`` go to ``optimizer.step``.

        Returns:
            What ``optimizer.step`` returned, or ``None`` when the step was skipped.

        Raises:
            TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
            RuntimeError: ``step`` was already called for ``optimizer`` since the last
                ``update()``; no ``scale(loss).backward()`` since the last ``update()``; or
                ``optimizer``'s gradients were not part of this iteration's decision.

        Example:
            >>> import torch, torch_facade as cstorch
            >>> model = torch.nn.Linear(2, 1, bias=False)
            >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> _ = torch.nn.init.ones_(model.weight)
            >>> scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
            >>> scaler.scale(model(torch.tensor([[3.0, 4.0]])).sum()).backward()
            >>> scaler.step(optimizer)  # unscales to [3, 4], then SGD with lr 0.1
            >>> scaler.update()
            >>> model.weight.data
            tensor([[0.7000, 0.6000]])
        """
        optimizer = check_optimizer(optimizer, "optimizer")
        self._register(optimizer)
        if self._stages[optimizer] is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        return self._step_if_finite(optimizer, args, kwargs)

    @host_side
    def step_if_finite(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Calls ``optimizer.step(*args, **kwargs)`` only if this iteration's gradients are finite.

        Returns:
            The result of ``optimizer.step``, or ``None`` when skipped.

        Example:
            >>> import torch, torch_facade as cstorch
            >>> model = torch.nn.Linear(2, 1, bias=False)
            >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> before = model.weight.detach().clone()
            >>> scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
            >>> scaler.scale(model(torch.full((1, 2), float("inf"))).sum()).backward()
            >>> print(scaler.step_if_finite(optimizer))  # skipped
            None
            >>> scaler.update()
            >>> torch.equal(model.weight, before)
            True
        """
        optimizer = check_optimizer(optimizer, "optimizer")
        self._register(optimizer)
        return self._step_if_finite(optimizer, args, kwargs)

    def _step_if_finite(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """:meth:`step_if_finite` for an optimizer checked and registered already."""
        self._require_scaled("step")
        result = self._engine.step(optimizer, args, kwargs)
        self._stages[optimizer] = _Stage.STEPPED
        return result

    @host_side
    def clip_gradients_and_return_isfinite(
        self, optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer]
    ) -> torch.Tensor:
        """Takes the iteration's decision, unscales and (with GCC) clips, returns ``isfinite``.

        Returns:
            A 0-d bool tensor (no host synchronisation).

        Example:
            >>> import torch, torch_facade as cstorch
            >>> model = torch.nn.Linear(2, 1, bias=False)
            >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = cstorch.amp.GradScaler(loss_scale="dynamic", max_gradient_norm=1.0)
            >>> scaler.scale(model(torch.tensor([[3.0, 4.0]])).sum()).backward()
            >>> scaler.clip_gradients_and_return_isfinite(optimizer)
            tensor(True)
            >>> model.weight.grad  # the norm 5 clipped to 1 (clip_grad_norm_'s coefficient)
            tensor([[0.6000, 0.8000]])
        """
        optimizers = optimizer_list(optimizers, "optimizers")
        for optimizer in optimizers:
            self._register(optimizer)
        self._require_scaled("clip_gradients_and_return_isfinite")
        for optimizer in optimizers:
            if self._stages[optimizer] is _Stage.READY:
                self._engine.finish(optimizer)
                self._stages[optimizer] = _Stage.UNSCALED
        return self._engine.decide().isfinite()

    @host_side
    def update_scale(self, optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer]) -> None:
        """Applies the dynamic-loss-scaling update (SPEC section 2) for this iteration, once.

        Example:
            >>> import torch, torch_facade as cstorch
            >>> model = torch.nn.Linear(2, 1, bias=False)
            >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
            >>> scaler.scale(model(torch.full((1, 2), float("inf"))).sum()).backward()
            >>> scaler.step(optimizer)
            >>> scaler.update_scale(optimizer)
            >>> scaler.get_scale()
            tensor(16384.)
            >>> scaler.update()  # starts the next iteration; the scale is not updated twice
            >>> scaler.get_scale()
            tensor(16384.)
        """
        for optimizer in optimizer_list(optimizers, "optimizers"):
            self._register(optimizer)
        self._engine.update_scale(self._stepped())

    def _stepped(self) -> int:
        """How many known optimizers stepped this iteration."""
        return list(self._stages.values()).count(_Stage.STEPPED)

    @host_side
    def update(self, new_scale: Any = None) -> None:
        """Updates the scale once all optimizers have been stepped, and starts a new iteration.

        Raises:
            ValueError: ``new_scale`` is given (not supported).
            RuntimeError: DLS, and nothing was unscaled or stepped since the last ``update()``
                (there is no overflow check to update from; torch's scaler raises here too).
            LossScaleStalledError: with ``raise_on_stall=True``, once ``stall_steps``
                consecutive steps overflowed at ``min_loss_scale``.

        Example:
            >>> import torch, torch_facade as cstorch
            >>> model = torch.nn.Linear(2, 1, bias=False)
            >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = cstorch.amp.GradScaler("dynamic", init_scale=4.0, steps_per_increase=1)
            >>> for step in range(2):  # the scale doubles after steps_per_increase + 1 steps
            ...     optimizer.zero_grad()
            ...     scaler.scale(model(torch.ones(1, 2)).sum()).backward()
            ...     scaler.step(optimizer)
            ...     scaler.update()
            >>> scaler.get_scale()
            tensor(8.)
        """
        if new_scale is not None and _truthy(new_scale):
            raise ValueError("GradScaler.update() does not support providing a `new_scale`")
        engine = self._engine
        if engine.dynamic:
            if engine.decision is None and all(s is _Stage.READY for s in self._stages.values()):
                raise RuntimeError(
                    "update() was called without a step() or unscale_() since the last "
                    "update(): there is no overflow check to update the loss scale from"
                )
            engine.update_scale(self._stepped())
        for optimizer in self._stages:
            self._stages[optimizer] = _Stage.READY
        stalled = engine.end_iteration()
        if stalled is not None:
            if engine.raise_on_stall:
                raise LossScaleStalledError(stalled, self.nonfinite_gradients())
            warnings.warn(stalled, RuntimeWarning, stacklevel=_caller.stacklevel())

    # ------------------------------------------------------------ diagnostics

    @host_side
    def nonfinite_gradients(self, module: torch.nn.Module | None = None) -> Any:
        """Which gradients held inf or NaN at this iteration's (or the last) decision.

        Reads the gradients again, so call it only to diagnose a skipped step (after
        ``step()``, before ``zero_grad()``); nothing of it runs on a healthy step.

        Args:
            module: names the parameters (``module.named_parameters()``); without it they are
                named by position, ``"optimizer0.param_groups[1].params[3]"``.

        Returns:
            An :class:`~torch_facade.amp.OverflowReport`.

        Example:
            >>> import torch, torch_facade as cstorch
            >>> model = torch.nn.Linear(2, 1)
            >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
            >>> scaler.scale(model(torch.ones(1, 2)).sum()).backward()
            >>> model.bias.grad.fill_(float("nan"))
            tensor([nan])
            >>> scaler.step(optimizer)
            >>> print(scaler.nonfinite_gradients(model))
            1 of 2 gradients non-finite: bias (1 element)
        """
        return OverflowReport(*self._engine.nonfinite_counts(module))

    # --------------------------------------------------------------- internals

    def _require_scaled(self, method: str) -> None:
        if not self._engine.scaled and not self._engine.identity:
            raise RuntimeError(
                f"{method}() was called without scale(loss).backward() since the last update(): "
                "the gradients were never scaled, so unscaling them would divide them by the "
                "loss scale. Call grad_scaler.scale(loss).backward() first."
            )

    def _register(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer not in self._stages:
            self._engine.register(optimizer)
            self._stages[optimizer] = _Stage.READY


def register_optimizers(
    grad_scaler: GradScaler, optimizers: Sequence[torch.optim.Optimizer]
) -> None:
    """Makes ``optimizers`` known to ``grad_scaler`` (``optimizer_step`` does, before backward)."""
    for optimizer in optimizers:
        grad_scaler._register(optimizer)


def decide_with_fused_clip(
    grad_scaler: GradScaler, optimizers: Sequence[torch.optim.Optimizer], max_norm: float
) -> bool:
    """``optimizer_step``'s fused clip: when ``grad_scaler`` scales dynamically without GCC of
    its own and ``optimizers`` are exactly the ones it knows, takes this iteration's decision
    with the clip by ``max_norm`` fused into the overflow check (one read of the gradients) and
    returns ``True``; else returns ``False`` and the caller unscales and clips."""
    config = grad_scaler.config
    fused = (
        max_norm > 0
        and isinstance(config, amp_core.DynamicLossScale)
        and not config.clips
        and {id(o) for o in grad_scaler._engine.optimizers} == {id(o) for o in optimizers}
    )
    if fused:
        grad_scaler._engine.decide(clip_norm=max_norm)
    return fused
