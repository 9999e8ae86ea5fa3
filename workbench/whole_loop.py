"""Whole training iterations of the documented loop, the facade against torch's scaler.

The bench's whole-iteration section (``python -m benchmarks --sections whole``) and the device
check's timings both run these loops; :func:`whole_rows` and :func:`comparison_table` turn a
group into the rows and the markdown table both reports print.

Every timed call is one iteration of the loop users run, on a GPT-2-like model
(:mod:`workbench.sizes`) with a next-token loss on fixed random tokens::

    optimizer.zero_grad(set_to_none=...)  # torch's default: True, fresh gradients every backward
    loss = next_token_loss(model, tokens)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer); clip_grad_norm_(params, CLIP_NORM)  # torch, with clipping only
    scaler.step(optimizer)
    scaler.update()

The bare variant runs ``zero_grad``, ``loss.backward()`` and ``optimizer.step()`` without a scaler;
a scaler's overhead is its iteration time minus the bare one of the same round. The
spike-skipping variant (:data:`SPIKE_SKIP`) is the facade's loop with
``spike_skip=cstorch.amp.SpikeSkip()``, timed in the same rounds as the plain facade
(:func:`spike_skip_row`).

The floor variant (:data:`FLOOR`, single process only) is the least any design that reads the
gradients with XLA must add to the bare loop: import every gradient through DLPack as the facade
does, one jitted sum of squares over them (no decision, no state, no Python bookkeeping), then
what torch must still do to the gradients: a non-fused optimizer's gradients multiplied in place
(as the facade does it, ``gradients.multiply_``), a fused one handed ``grad_scale`` and
``found_inf`` tensors. The
facade's overhead minus the floor's is what its own decision logic costs. Each variant trains
its own copy of one model; the loss scale is about 1 and the learning rate tiny, so every variant
sees the same gradients on every iteration and no step overflows (checked after timing).

The model, tokens and scalers live on the workload's device (``make_workload(..., device=)``):
``torch.amp.GradScaler`` is made for that device type, and on a CUDA device every timed
iteration ends with ``torch.cuda.synchronize()`` so that the clock reads finished work. A
workload may carry another loss (:attr:`Workload.loss_fn`), e.g. the host-cost model of
``benchmarks.host_bench``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch
from torch import nn

import torch_facade as cstorch
from workbench.internals import dlpack, gradients
from workbench.sizes import GPTLike, SizeSpec, model_spec, next_token_loss, random_tokens
from workbench.tables import markdown_table, number, stats_cell, yes
from workbench.timing import (
    CompileCounter,
    FirstStep,
    Plan,
    Timing,
    Variant,
    difference,
    measure_group,
    milliseconds,
    per_round,
    ratio,
    stats_dict,
)

LOSS_SCALE = 1.0 + 2.0**-23
"""The loss scale of every scaler: unscaling multiplies by about 1, so no value drifts."""

NEVER = 2**30
"""``growth_interval`` / ``steps_per_increase``: the scale never changes during a run."""

LEARNING_RATE = 1e-12
"""Small enough that no parameter moves (AdamW's decay ``1 - lr * wd`` rounds to 1)."""

OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "SGD foreach": lambda params: torch.optim.SGD(params, lr=LEARNING_RATE, foreach=True),
    "SGD fused": lambda params: torch.optim.SGD(params, lr=LEARNING_RATE, fused=True),
    "AdamW fused": lambda params: torch.optim.AdamW(params, lr=LEARNING_RATE, fused=True),
}
"""The optimizers compared, by the name used in the tables."""

VARIANTS = ("bare", "torch", "torch+clip", "facade", "facade+clip")
"""Variant names of one optimizer's group, interleaved together."""

FLOOR = "xla floor"
"""The floor variant's name (see the module docstring)."""

WHOLE_VARIANTS = (*VARIANTS, FLOOR)
"""The variants of a single-process group; the DDP section runs :data:`VARIANTS`."""

SPIKE_SKIP = "facade+spike_skip"
"""The facade's loop with ``spike_skip=cstorch.amp.SpikeSkip()`` (the defaults: the gradient
norm, a window of 128, sigma 6), timed beside :data:`VARIANTS`' ``"facade"`` in one group
(:data:`SPIKE_SKIP_GROUP`): what skipping loss spikes adds to a whole iteration."""

SPIKE_SKIP_GROUP = ("AdamW fused", True)
"""The optimizer and ``zero_grad(set_to_none=...)`` of the group that also times
:data:`SPIKE_SKIP` (the loop users run: fused AdamW, torch's default)."""

BATCH = 1
"""Sequences per iteration (one keeps an ``M`` iteration short on a small CPU)."""

TOKENS = 64
"""Tokens per sequence, at most the model's context."""

CLIP_NORM = 1.0
"""``max_gradient_norm`` of the facade and ``max_norm`` of ``clip_grad_norm_`` with clipping."""

SET_TO_NONE = (True, False)
"""The ``zero_grad(set_to_none=...)`` settings measured; ``True`` is torch's default."""


@dataclasses.dataclass
class Workload:
    """One size's model and batch; every variant trains a copy of the model on the same tokens.

    Attributes:
        spec: the spec of the trained model (see :func:`workbench.sizes.model_spec`); ``None``
            for a model that is not GPT-like.
        model: the initial model.
        tokens: token ids of shape ``(batch, tokens + 1)``, on the model's device.
        loss_fn: the loss of one iteration, ``loss_fn(model, tokens)`` (default: the mean
            next-token cross-entropy).
    """

    spec: SizeSpec | None
    model: nn.Module
    tokens: torch.Tensor
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] = next_token_loss

    @property
    def device(self) -> torch.device:
        """The device of the model and the tokens."""
        return self.tokens.device

    @property
    def tensors(self) -> int:
        """Number of parameter tensors."""
        return len(list(self.model.parameters()))

    @property
    def params(self) -> int:
        """Total number of parameters."""
        return sum(p.numel() for p in self.model.parameters())


def make_workload(
    spec: SizeSpec,
    seed: int = 0,
    batch: int = BATCH,
    token_seed: int | None = None,
    device: torch.device | str = "cpu",
    tokens: int = TOKENS,
) -> Workload:
    """Builds the model of ``spec``'s whole iterations and a batch of random tokens.

    Args:
        spec: the size (``tiny`` trains ``M``'s layout at a tiny width).
        seed: seeds the initialisation (and the tokens, unless ``token_seed`` is given).
        batch: sequences per iteration.
        token_seed: seeds the tokens (e.g. one per DDP rank).
        device: where the model and the tokens live (initialised on the CPU, then moved, so
            that every device starts from the same numbers).
        tokens: tokens per sequence (at most the model's context).
    """
    spec = model_spec(spec)
    torch.manual_seed(seed)
    model = GPTLike(spec)
    generator = torch.Generator().manual_seed(seed if token_seed is None else token_seed)
    ids = random_tokens(spec, batch, min(tokens, spec.context), generator)
    return Workload(spec, model.to(device), ids.to(device))


def _facade_scaler(name: str) -> cstorch.amp.GradScaler:
    return cstorch.amp.GradScaler(
        loss_scale="dynamic",
        init_scale=LOSS_SCALE,
        max_loss_scale=LOSS_SCALE,
        steps_per_increase=NEVER,
        max_gradient_norm=CLIP_NORM if name == "facade+clip" else None,
        spike_skip=cstorch.amp.SpikeSkip() if name == SPIKE_SKIP else None,
    )


def _torch_scaler(device_type: str) -> torch.amp.GradScaler:
    return torch.amp.GradScaler(device_type, init_scale=LOSS_SCALE, growth_interval=NEVER)


class TrainLoop:
    """One variant: its own model copy, optimizer and scaler; :meth:`step` runs one iteration.

    Args:
        name: one of :data:`WHOLE_VARIANTS`, or :data:`SPIKE_SKIP`.
        optimizer: one of :data:`OPTIMIZERS`.
        set_to_none: the ``zero_grad`` argument.
        workload: the model to copy and the tokens.
        wrap: applied to the model copy before training (e.g. ``DistributedDataParallel``).

    Raises:
        ValueError: unknown variant name.
    """

    def __init__(
        self,
        name: str,
        optimizer: str,
        set_to_none: bool,
        workload: Workload,
        wrap: Callable[[nn.Module], nn.Module] = lambda module: module,
    ) -> None:
        if name not in (*WHOLE_VARIANTS, SPIKE_SKIP):
            raise ValueError(
                f"unknown variant {name!r}; expected one of {(*WHOLE_VARIANTS, SPIKE_SKIP)}"
            )
        module = copy.deepcopy(workload.model)
        self.params = list(module.parameters())
        self.model = wrap(module)
        self.optimizer = OPTIMIZERS[optimizer](self.params)
        self.tokens = workload.tokens
        self.loss_fn = workload.loss_fn
        self.device = workload.device
        self.set_to_none = set_to_none
        self.torch_scaler = _torch_scaler(self.device.type) if name.startswith("torch") else None
        self.facade = _facade_scaler(name) if name.startswith("facade") else None
        self._one = torch.ones((), device=self.device)  # the floor's grad_scale and multiplier
        self._zero = torch.zeros((), device=self.device)  # the floor's found_inf
        self.torch_clips = name == "torch+clip"
        steps = {"bare": self._bare, FLOOR: self._floor}
        # Host seconds of the last iteration's scaler calls (``scale``, and everything after
        # ``backward``: for the bare loop ``optimizer.step()``), timed in place.
        self.calls_seconds = 0.0
        iteration = steps.get(name, self._scaled)
        self.step: Callable[[], None] = (
            _synchronized(iteration, self.device) if self.device.type == "cuda" else iteration
        )

    @property
    def scaler(self) -> cstorch.amp.GradScaler | torch.amp.GradScaler | None:
        """The variant's scaler (``None`` for the bare loop and the floor)."""
        return self.facade if self.facade is not None else self.torch_scaler

    def loss(self) -> torch.Tensor:
        """``optimizer.zero_grad(set_to_none=...)``, then the forward pass: the iteration's loss."""
        self.optimizer.zero_grad(set_to_none=self.set_to_none)
        return self.loss_fn(self.model, self.tokens)

    def _bare(self) -> None:
        self.loss().backward()
        start = time.perf_counter()
        self.optimizer.step()
        self.calls_seconds = time.perf_counter() - start

    def _scaled(self) -> None:
        """The documented loop with the variant's scaler, its calls timed in place: with
        ``torch+clip``, torch's ``unscale_`` and ``clip_grad_norm_`` before ``step`` (the
        facade clips inside its decision, ``max_gradient_norm``)."""
        scaler = self.scaler
        assert scaler is not None
        loss = self.loss()
        start = time.perf_counter()
        scaled = scaler.scale(loss)
        scaled_at = time.perf_counter()
        scaled.backward()
        resumed = time.perf_counter()
        if self.torch_clips:
            scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.params, CLIP_NORM)
        scaler.step(self.optimizer)
        scaler.update()
        self.calls_seconds = scaled_at - start + time.perf_counter() - resumed

    def _floor(self) -> None:
        self.loss().backward()
        start = time.perf_counter()
        grads = [p.grad for p in self.params if p.grad is not None]
        _sum_of_squares(dlpack.import_tensors(grads)).block_until_ready()
        if getattr(self.optimizer, "_step_supports_amp_scaling", False):
            self.optimizer.grad_scale = self._one  # type: ignore[attr-defined]
            self.optimizer.found_inf = self._zero  # type: ignore[attr-defined]
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.grad_scale  # type: ignore[attr-defined]
                del self.optimizer.found_inf  # type: ignore[attr-defined]
        else:
            gradients.multiply_(grads, self._one)
            self.optimizer.step()
        self.calls_seconds = time.perf_counter() - start

    def skipped_steps(self) -> int:
        """Steps skipped so far, for an overflow or as a spike (0 for the bare loop).

        The facade counts them (``get_num_skipped_steps``, and ``get_num_spike_skips`` with
        ``spike_skip``); torch's scaler never grows here
        (``growth_interval`` is :data:`NEVER`) and halves its scale on
        every skipped step, so its count is ``log2(initial scale / scale)``.
        """
        if self.facade is not None:
            return int(self.facade.get_num_skipped_steps()) + int(self.facade.get_num_spike_skips())
        if self.torch_scaler is not None:
            return round(math.log2(LOSS_SCALE / self.torch_scaler.get_scale()))
        return 0


def _synchronized(iteration: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """``iteration`` followed by a wait for ``device``: a timed call then returns finished work."""

    def step() -> None:
        iteration()
        torch.cuda.synchronize(device)

    return step


@jax.jit
def _sum_of_squares(grads: tuple[jax.Array, ...]) -> jax.Array:
    """The floor's read: one float32 sum of squares over every gradient."""
    return sum((jnp.sum(jnp.square(g)) for g in grads), jnp.zeros((), jnp.float32))


def _subnormals(tensors: list[torch.Tensor]) -> int:
    tiny = torch.finfo(torch.float32).tiny
    return sum(int(((t != 0) & (t.abs() < tiny)).sum()) for t in tensors)


def count_subnormals(workload: Workload) -> dict[str, int]:
    """Subnormal float32 values after two bare fused-AdamW iterations on a copy of the model.

    torch's CPU kernels run many times slower on subnormal operands, while XLA flushes them
    (``../shared/PERFORMANCE.md`` item 9); AdamW's second moment ``(1 - 0.999) * g**2`` is the
    first place tiny gradients would turn subnormal. Both counts should be 0.

    Returns:
        ``{"gradients": ..., "adamw_state": ...}``: counts in the gradients and in the
        optimizer's moment tensors.
    """
    loop = TrainLoop("bare", "AdamW fused", True, workload)
    loop.step()
    loop.step()
    grads = [p.grad for p in loop.params if p.grad is not None]
    moments = [
        tensor
        for state in loop.optimizer.state.values()
        for tensor in state.values()
        if tensor.is_floating_point() and tensor.dim() > 0
    ]
    return {"gradients": _subnormals(grads), "adamw_state": _subnormals(moments)}


@dataclasses.dataclass
class WholeGroup:
    """The measurements of one size, optimizer and ``zero_grad`` setting.

    Attributes:
        optimizer: key of :data:`OPTIMIZERS`.
        set_to_none: the ``zero_grad`` argument.
        first: first iteration of every variant.
        timings: timed rounds of every variant.
        skipped_steps: steps skipped for an overflow or as a spike over all iterations, per
            variant (must be 0).
    """

    optimizer: str
    set_to_none: bool
    first: dict[str, FirstStep]
    timings: dict[str, Timing]
    skipped_steps: dict[str, int]

    @property
    def label(self) -> str:
        """``"<optimizer>, set_to_none=<bool>"``: the group's name in the JSON cases."""
        return f"{self.optimizer}, set_to_none={self.set_to_none}"


def run_group(
    workload: Workload,
    optimizer: str,
    set_to_none: bool,
    plan: Plan,
    counter: CompileCounter,
    on_round: Callable[[], object] = lambda: None,
    wrap: Callable[[nn.Module], nn.Module] = lambda module: module,
    variants: Sequence[str] = WHOLE_VARIANTS,
) -> WholeGroup:
    """Measures the variants of one optimizer and ``zero_grad`` setting, interleaved.

    Args:
        workload: the size's model and tokens.
        optimizer: one of :data:`OPTIMIZERS`.
        set_to_none: the ``zero_grad`` argument.
        plan: rounds, iterations per round and warm-up.
        counter: a listening compile counter.
        on_round: progress callback, once per round.
        wrap: applied to every variant's model copy (e.g. ``DistributedDataParallel``).
        variants: the variant names to measure (of :data:`WHOLE_VARIANTS` and
            :data:`SPIKE_SKIP`).
    """
    loops: dict[str, TrainLoop] = {}

    def make(name: str) -> Variant:
        loops[name] = TrainLoop(name, optimizer, set_to_none, workload, wrap)
        loop = loops[name]
        return Variant(name, loop.step, part=lambda: loop.calls_seconds)

    first, timings = measure_group(variants, make, plan, counter, on_round)
    skipped = {name: loop.skipped_steps() for name, loop in loops.items()}
    return WholeGroup(optimizer, set_to_none, first, timings, skipped)


def scaler_pair(timings: dict[str, Timing], clip: bool) -> dict[str, Any]:
    """The facade against torch's scaler (with or without clipping), each against the bare
    variant of the same round: times in ms, their ratio, the overheads and their ratio."""
    suffix = "+clip" if clip else ""
    torch_r = timings["torch" + suffix].rounds
    facade_r = timings["facade" + suffix].rounds
    bare_r = timings["bare"].rounds
    torch_over = per_round(difference, torch_r, bare_r)
    facade_over = per_round(difference, facade_r, bare_r)
    return {
        "clip": clip,
        "bare_ms": stats_dict(milliseconds(bare_r)),
        "torch_ms": stats_dict(milliseconds(torch_r)),
        "facade_ms": stats_dict(milliseconds(facade_r)),
        "step_ratio": stats_dict(per_round(ratio, facade_r, torch_r)),
        "torch_overhead_ms": stats_dict(milliseconds(torch_over)),
        "facade_overhead_ms": stats_dict(milliseconds(facade_over)),
        "overhead_ratio": stats_dict(per_round(ratio, facade_over, torch_over)),
    }


def whole_rows(size: str, group: WholeGroup) -> list[dict[str, Any]]:
    """Rows of a whole-iteration group; ``step_ratio`` is the ratio of whole iterations."""
    rows = []
    floor = group.timings.get(FLOOR)
    floor_cells = {}
    if floor is not None:
        bare_r = group.timings["bare"].rounds
        floor_cells = {
            "floor_ms": stats_dict(milliseconds(floor.rounds)),
            "floor_overhead_ms": stats_dict(
                milliseconds(per_round(difference, floor.rounds, bare_r))
            ),
        }
    for clip in (False, True):
        pair = scaler_pair(group.timings, clip)
        suffix = "+clip" if clip else ""
        rows.append(
            {
                "size": size,
                "optimizer": group.optimizer,
                "set_to_none": group.set_to_none,
                **pair,
                **floor_cells,
                "torch_skipped_steps": group.skipped_steps["torch" + suffix],
                "facade_skipped_steps": group.skipped_steps["facade" + suffix],
            }
        )
    return rows


def spike_skip_row(size: str, group: WholeGroup) -> dict[str, Any] | None:
    """The row of :data:`SPIKE_SKIP` against the plain facade of the same rounds (``None`` if
    the group did not time it): both in ms, the per-round ratio of whole iterations, and the
    steps the spike-skipping loop skipped (must be 0: a skipped step would be timed)."""
    spike = group.timings.get(SPIKE_SKIP)
    if spike is None:
        return None
    facade_r = group.timings["facade"].rounds
    return {
        "size": size,
        "optimizer": group.optimizer,
        "set_to_none": group.set_to_none,
        "facade_ms": stats_dict(milliseconds(facade_r)),
        "spike_skip_ms": stats_dict(milliseconds(spike.rounds)),
        "step_ratio": stats_dict(per_round(ratio, spike.rounds, facade_r)),
        "skipped_steps": group.skipped_steps[SPIKE_SKIP],
    }


def spike_skip_table(rows: list[dict[str, Any]]) -> list[str]:
    """:func:`spike_skip_row` rows: the ratio first, then the medians in ms."""
    header = [
        "size",
        "optimizer",
        "set_to_none",
        "facade + spike_skip / facade, iteration",
        "facade",
        "facade + spike_skip",
        "steps skipped",
    ]
    body = [
        [
            r["size"],
            r["optimizer"],
            str(r["set_to_none"]),
            stats_cell(r["step_ratio"], "x"),
            number(r["facade_ms"]["median"]),
            number(r["spike_skip_ms"]["median"]),
            str(r["skipped_steps"]),
        ]
        for r in rows
    ]
    return markdown_table(header, body, ["l", "l", "l", "r", "r", "r", "r"])


def comparison_table(rows: list[dict[str, Any]], with_set_to_none: bool) -> list[str]:
    """Whole-iteration rows: both ratios first, then the medians in ms."""
    header = ["size", "optimizer", "clip"] + (["set_to_none"] if with_set_to_none else [])
    header += [
        "facade/torch iteration",
        "facade/torch overhead",
        "bare",
        "torch",
        "facade",
        "torch overhead",
        "facade overhead",
    ]
    with_floor = any("floor_overhead_ms" in r for r in rows)
    header += ["XLA-read floor overhead"] if with_floor else []
    body = []
    for r in rows:
        line = [r["size"], r["optimizer"], yes(r["clip"])]
        line += [str(r["set_to_none"])] if with_set_to_none else []
        line += [stats_cell(r["step_ratio"], "x"), stats_cell(r["overhead_ratio"], "x")]
        line += [
            number(r[key]["median"])
            for key in (
                "bare_ms",
                "torch_ms",
                "facade_ms",
                "torch_overhead_ms",
                "facade_overhead_ms",
            )
        ]
        if with_floor:
            line.append(number(r.get("floor_overhead_ms", {}).get("median")))
        body.append(line)
    n_right = 7 + with_floor
    return markdown_table(header, body, ["l"] * (len(header) - n_right) + ["r"] * n_right)
