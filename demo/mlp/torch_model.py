"""The torch path: the same problem through the ``cstorch.amp`` facade, as a PyTorch user writes it.

``import torch_facade as cstorch``; ``cstorch.amp.set_half_dtype("float16")`` gives the compute
dtype; a ``torch.nn.Module`` holds float32 master parameters and, in ``forward``, casts them and
its input to float16, so the forward and backward passes run in float16 while the loss is reduced
in float32 (``h @ w + b`` as a matmul and an
addition, ``tanh``, mean squared error). ``torch.optim.Adam`` steps the master parameters under
``cstorch.amp.GradScaler(loss_scale="dynamic", ...)`` with the problem's settings, in the
documented loop::

    optimizer.zero_grad()
    loss = mse(model(x), y)
    grad_scaler.scale(loss).backward()
    grad_scaler.unscale_(optimizer)
    grad_scaler.step(optimizer)
    grad_scaler.update()

On the first skipped step it asks ``grad_scaler.nonfinite_gradients(model)`` which parameters'
gradients overflowed (``RunRecord.first_overflow``); nothing of it runs on other steps.

The path runs torch on one thread (and restores the setting): the model is tiny, and torch's
OpenMP workers only wait on busy cores for it (a 2-core machine with other load ran 10x slower).

Every overflow is a float16 result of the backward pass above 65504. With
``RunOptions.diagnostics`` each step also records diagnostics (``forward_finite``,
``f32_finite``, ``f32_peak``, ``params_unchanged``, ``num_skipped_steps``) that explain the
overflows. Kept for ``python -m demo --distributed`` (:mod:`demo.mlp.distributed`), whose
float32 reference this module's :func:`run_fp32` is.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

import torch_facade as cstorch  # an ImportError here marks the path unavailable
from demo.mlp.problem import Problem, RunOptions
from demo.mlp.records import RunRecord, diagnostic_extras
from demo.mlp.report import format_scale


class DemoMLP(torch.nn.Module):
    """The demo MLP with float32 master parameters, computing in ``compute_dtype``.

    Args:
        init_params: the problem's ``[(w, b), ...]``, ``w`` of shape ``(in, out)`` (a
            ``torch.nn.Linear`` holds ``w.T``).
        compute_dtype: the dtype of the forward (and so backward) pass.
    """

    def __init__(
        self,
        init_params: Sequence[tuple[np.ndarray, np.ndarray]],
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.compute_dtype = compute_dtype
        self.layers = torch.nn.ModuleList()
        for w, b in init_params:
            layer = torch.nn.Linear(w.shape[0], w.shape[1])
            with torch.no_grad():
                layer.weight.copy_(torch.from_numpy(np.ascontiguousarray(w.T)))
                layer.bias.copy_(torch.from_numpy(b))
            self.layers.append(layer)

    def forward(
        self,
        x: torch.Tensor,
        intermediates: list[torch.Tensor] | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The outputs ``(batch, 1)``, computed in ``dtype`` (default ``compute_dtype``); appends
        every pre-activation and hidden activation to ``intermediates`` if given (for the float32
        backward diagnostics)."""
        dtype = self.compute_dtype if dtype is None else dtype
        h = x.to(dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            z = h @ layer.weight.to(dtype).T + layer.bias.to(dtype)
            if intermediates is not None:
                intermediates.append(z)
            if i == last:
                return z
            h = torch.tanh(z)
            if intermediates is not None:
                intermediates.append(h)
        return h


def mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean squared error, reduced in float32 whatever the dtype of ``outputs``."""
    return torch.mean(torch.square(outputs.float() - targets))


def _float32_backward(
    model: DemoMLP, x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor
) -> tuple[bool, float]:
    """The same step's scaled backward pass in float32: (all finite, peak magnitude) over every
    parameter gradient and every activation cotangent."""
    intermediates: list[torch.Tensor] = []
    loss = mse(model(x, intermediates, dtype=torch.float32), y) * scale
    grads = torch.autograd.grad(loss, [*model.parameters(), *intermediates])
    finite = all(bool(torch.isfinite(g).all()) for g in grads)
    peak = max(float(g.abs().max()) for g in grads)
    return finite, peak


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [v.detach().clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def _bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two lists of tensors are bit-for-bit identical (NaN payloads and -0.0 too)."""

    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().reshape(-1).view(torch.uint8)

    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and torch.equal(raw(x), raw(y))
        for x, y in zip(a, b, strict=True)
    )


def _full_loss(model: DemoMLP, problem: Problem) -> float:
    """The float32 loss of the master parameters on the whole data set."""
    with torch.no_grad():
        outputs = model(torch.from_numpy(problem.x), dtype=torch.float32)
        return float(mse(outputs, torch.from_numpy(problem.y)))


def _batch(problem: Problem, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = problem.batch(step)
    return torch.from_numpy(x), torch.from_numpy(y)


def run_fp16_dls(problem: Problem, options: RunOptions) -> RunRecord:
    """Trains with float16 compute and ``cstorch.amp.GradScaler`` dynamic loss scaling.

    The global half dtype state is restored afterwards.

    Args:
        problem: the shared model, data and hyperparameters.
        options: progress bar and diagnostics switches.

    Returns:
        The run's :class:`RunRecord` (named ``"torch fp16 + DLS"``).
    """
    saved = cstorch.amp.get_half_dtype_str(), cstorch.amp.mixed_precision()
    start = time.perf_counter()
    try:
        half = cstorch.amp.set_half_dtype("float16")
        model = DemoMLP(problem.init_params, compute_dtype=half)
        optimizer = torch.optim.Adam(model.parameters(), lr=problem.learning_rate)
        grad_scaler = cstorch.amp.GradScaler(
            loss_scale="dynamic", **dataclasses.asdict(problem.scaler)
        )
        columns: dict[str, list] = {
            "loss": [],
            "scale": [],
            "isfinite": [],
            "num_skipped_steps": [],
            "forward_finite": [],
            "f32_finite": [],
            "f32_peak": [],
            "params_unchanged": [],
        }
        first_overflow = None
        bar = tqdm(
            range(problem.steps),
            desc="torch fp16 + DLS",
            disable=not options.progress,
            unit="step",
        )
        for i in bar:
            x, y = _batch(problem, i)
            scale = grad_scaler.get_scale()
            if options.diagnostics:
                f32_finite, f32_peak = _float32_backward(model, x, y, scale)
                before = _snapshot(model, optimizer)

            optimizer.zero_grad()
            loss = mse(model(x), y)
            grad_scaler.scale(loss).backward()
            grad_scaler.unscale_(optimizer)
            grad_scaler.step(optimizer)
            grad_scaler.update()

            isfinite = bool(grad_scaler.get_isfinite())
            if not isfinite and first_overflow is None:
                # Which parameters overflowed: asked once, on the first skipped step only.
                first_overflow = str(grad_scaler.nonfinite_gradients(model))
            columns["loss"].append(loss.item())
            columns["scale"].append(float(scale))
            columns["isfinite"].append(isfinite)
            columns["num_skipped_steps"].append(int(grad_scaler.get_num_skipped_steps()))
            if options.diagnostics:
                columns["forward_finite"].append(bool(torch.isfinite(loss)))
                columns["f32_finite"].append(f32_finite)
                columns["f32_peak"].append(f32_peak)
                columns["params_unchanged"].append(
                    _bitwise_equal(before, _snapshot(model, optimizer))
                )
            if options.progress and (i % 10 == 0 or not isfinite):
                bar.set_postfix(
                    loss=f"{columns['loss'][-1]:.3g}",
                    scale=format_scale(columns["scale"][-1]),
                    skipped=columns["num_skipped_steps"][-1],
                )
        bar.close()
        final_scale = float(grad_scaler.get_scale())
        num_skipped = int(grad_scaler.get_num_skipped_steps())
    finally:
        cstorch.amp.set_half_dtype(saved[0])
        cstorch.amp.enable_mixed_precision(saved[1])
    extras = diagnostic_extras(columns) if options.diagnostics else {}
    return RunRecord(
        name="torch fp16 + DLS",
        path="torch",
        losses=np.asarray(columns["loss"]),
        overflow=~np.asarray(columns["isfinite"], bool),
        final_loss=_full_loss(model, problem),
        scales=np.asarray(columns["scale"]),
        final_scale=final_scale,
        num_skipped_steps=num_skipped,
        wall_time_s=time.perf_counter() - start,
        extras=extras,
        first_overflow=first_overflow,
    )


def run_fp32(problem: Problem, options: RunOptions) -> RunRecord:
    """Trains the same model on the same batches in float32 with plain ``torch.optim.Adam``.

    Args:
        problem: the shared model, data and hyperparameters.
        options: progress bar switch.

    Returns:
        The run's :class:`RunRecord` (named ``"torch float32"``).
    """
    start = time.perf_counter()
    model = DemoMLP(problem.init_params, compute_dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=problem.learning_rate)
    losses = []
    bar = tqdm(
        range(problem.steps), desc="torch float32", disable=not options.progress, unit="step"
    )
    for i in bar:
        x, y = _batch(problem, i)
        optimizer.zero_grad()
        loss = mse(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if options.progress and i % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3g}")
    bar.close()
    return RunRecord(
        name="torch float32",
        path="torch",
        losses=np.asarray(losses),
        overflow=np.zeros(problem.steps, bool),
        final_loss=_full_loss(model, problem),
        wall_time_s=time.perf_counter() - start,
    )


def run_torch_path(problem: Problem, options: RunOptions) -> list[RunRecord]:
    """The registered ``"torch"`` path: the float16 + DLS run and its float32 reference.

    Args:
        problem: the shared model, data and hyperparameters.
        options: how to run.

    Returns:
        ``[fp16 + DLS record, float32 record]``.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tensors this small gain nothing from threads, and can lose a lot
    try:
        return [run_fp16_dls(problem, options), run_fp32(problem, options)]
    finally:
        torch.set_num_threads(threads)
