"""The torch front door: Hugging Face ``GPT2LMHeadModel`` trained through ``cstorch.amp``.

The model is transformers' own GPT-2 (random initialisation from :func:`workbench.byte_gpt.initial_weights`,
a 256-byte vocabulary, nothing downloaded), trained with ``torch.optim.AdamW`` in the loop a
PyTorch user writes::

    optimizer.zero_grad()
    loss = cross_entropy(model(inputs).logits, targets)
    grad_scaler.scale(loss).backward()
    grad_scaler.step(optimizer)
    grad_scaler.update()

**How the half formats are computed.** The float32 master weights stay in float32; while a row
trains, every weight the model reads, every module's output and the gradient flowing back
through each of them is rounded to the row's format (a cast in both directions, as autograd does
for a real dtype), and each operation computes in float32 between those roundings, as a GPU's
tensor cores accumulate in float32 and store half precision. cbfloat16 uses the facade's own
``cstorch.amp.cbfloat16_numerics``; float16 and bfloat16 use :func:`dtype_numerics`, the same
pattern with torch's exact casts (``x.to(torch.float16).float()``). This is not to save effort:
this machine's CPUs have no float16 matrix units, and a float16 ``torch.autocast`` step of this
model runs several times slower than float32 there (``docs/performance-notes.md``), while the
rounding costs little. Every row thus differs
from the others only by its format and its loss scaling.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
import transformers
from torch.nn.utils import parametrize
from tqdm.auto import tqdm

import torch_facade as cstorch
from demo.rows import PEER_GROWTH_INTERVAL, PEER_INIT_SCALE, Row, RowResult
from workbench.byte_gpt import ModelSize, Settings, initial_weights

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def make_model(size: ModelSize, seed: int) -> transformers.GPT2LMHeadModel:
    """``GPT2LMHeadModel`` of ``size`` with the weights of :func:`workbench.byte_gpt.initial_weights`.

    Dropout is off (every row sees the same arithmetic); attention is the eager implementation.
    """
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        vocab_size=size.vocab_size,
        n_positions=size.n_positions,
        n_embd=size.n_embd,
        n_layer=size.n_layer,
        n_head=size.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="eager",
    )
    model = transformers.GPT2LMHeadModel(config)
    weights = {k: torch.from_numpy(v) for k, v in initial_weights(size, seed).items()}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if set(missing) - {"lm_head.weight"} or unexpected:  # lm_head is tied to wte
        raise AssertionError(f"weights do not match GPT-2: missing {missing}, extra {unexpected}")
    if model.lm_head.weight is not model.transformer.wte.weight:
        raise AssertionError("the output layer must be tied to the token embedding")
    return model


class _Round(torch.nn.Module):
    """A parametrization that casts a float32 tensor to ``dtype`` and back (both directions)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.dtype).float()


def _round_tree(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype).float() if value.dtype == torch.float32 else value
    if isinstance(value, dict):  # a ModelOutput too: set in place, keeps its class
        for key in list(value):
            value[key] = _round_tree(value[key], dtype)
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_round_tree(v, dtype) for v in value)
    return value


@contextlib.contextmanager
def dtype_numerics(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[torch.nn.Module]:
    """Runs ``model`` with ``dtype`` weights and activations, float32 arithmetic in between.

    The same places as ``cstorch.amp.cbfloat16_numerics`` rounds for cbfloat16: every parameter
    as ``forward`` reads it, every module's float32 outputs, and the gradients flowing back
    through those casts. Everything added is removed on exit.
    """
    handles = []
    owners = []
    try:
        for module in list(model.modules()):
            for name, param in list(module.named_parameters(recurse=False)):
                if param is not None:
                    parametrize.register_parametrization(module, name, _Round(dtype), unsafe=True)
                    owners.append((module, name))
            handles.append(module.register_forward_hook(lambda m, a, out: _round_tree(out, dtype)))
        yield model
    finally:
        for handle in handles:
            handle.remove()
        for module, name in owners:
            parametrize.remove_parametrizations(module, name, leave_parametrized=False)


def numerics(model: torch.nn.Module, fmt: str) -> contextlib.AbstractContextManager[Any]:
    """The context that makes ``model`` compute in ``fmt`` (nothing for float32)."""
    if fmt == "float32":
        return contextlib.nullcontext(model)
    if fmt == "cbfloat16":
        return cstorch.amp.cbfloat16_numerics(model)
    return dtype_numerics(model, TORCH_DTYPES[fmt])


def cross_entropy(model: torch.nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy of ``model`` on ``windows`` (float32 reduction)."""
    logits = model(input_ids=windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1).long()
    )


def held_out_loss(model: torch.nn.Module, windows: np.ndarray) -> float:
    """The float32 loss of ``model``'s master weights on the held-out ``windows``."""
    with torch.no_grad():
        return float(cross_entropy(model, torch.from_numpy(windows)))


def float32_gradients(model: torch.nn.Module, windows: np.ndarray, loss_divisor: int = 1) -> None:
    """Leaves the float32 gradients of the loss on ``windows`` (divided by ``loss_divisor``, as
    one micro-batch of an accumulation has them) in ``model``'s ``.grad``."""
    model.zero_grad()
    (cross_entropy(model, torch.from_numpy(windows)) / loss_divisor).backward()


class _Scaler:
    """One interface over the row's loss scaling: ``cstorch.amp.GradScaler``, torch's
    ``GradScaler``, or none."""

    def __init__(self, row: Row, settings: Settings) -> None:
        self.kind = row.scaling
        if row.scaling in ("dls", "dls+clip"):
            saved = cstorch.amp.get_half_dtype_str(), cstorch.amp.mixed_precision()
            cstorch.amp.set_half_dtype(row.fmt)  # the dtype's defaults, read at construction
            clip = settings.max_gradient_norm if row.scaling == "dls+clip" else None
            start = settings.init_scale
            self.scaler: Any = cstorch.amp.GradScaler(
                loss_scale="dynamic", init_scale=start, max_loss_scale=start, max_gradient_norm=clip
            )
            cstorch.amp.set_half_dtype(saved[0])
            cstorch.amp.enable_mixed_precision(saved[1])
        elif row.scaling == "peer":
            self.scaler = torch.amp.GradScaler(
                "cpu",
                init_scale=settings.init_scale or PEER_INIT_SCALE,
                growth_interval=PEER_GROWTH_INTERVAL,
            )
        else:
            self.scaler = None

    def scale(self) -> float:
        return 1.0 if self.scaler is None else float(self.scaler.get_scale())

    def backward(self, loss: torch.Tensor) -> None:
        """``backward()`` of the (scaled) loss: once per micro-batch."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step and update after the backward passes; returns whether the step was skipped."""
        if self.scaler is None:
            optimizer.step()
            return False
        if self.kind == "peer":
            self.scaler.step(optimizer)
            before = self.scaler.get_scale()
            self.scaler.update()
            return bool(self.scaler.get_scale() < before)  # torch halves exactly on a skip
        self.scaler.step(optimizer)
        self.scaler.update()
        return not bool(self.scaler.get_isfinite())


def train_row(
    row: Row,
    settings: Settings,
    batches: np.ndarray,
    held_out: np.ndarray,
    progress: bool = True,
    on_gradients: Callable[[torch.nn.Module], None] | None = None,
) -> RowResult:
    """Trains one row and measures it.

    Args:
        row: the row (format and loss scaling).
        settings: model size, optimizer, steps.
        batches: ``(steps, batch, n_positions + 1)`` training windows, or ``(steps,
            micro_batches, batch, n_positions + 1)`` (``settings.micro_batches > 1``: the loop
            accumulates them, each loss divided by ``settings.loss_divisor``).
        held_out: the held-out windows.
        progress: show a tqdm bar.
        on_gradients: called with the model after the final float32 gradients were computed
            (the histogram reads them).

    Returns:
        The :class:`RowResult`.
    """
    model = make_model(settings.size, settings.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay
    )
    scaler = _Scaler(row, settings)
    losses: list[float] = []
    skipped: list[bool] = []
    scales: list[float] = []
    times: list[float] = []
    bar = tqdm(range(settings.steps), desc=f"torch {row.label}", disable=not progress, unit="step")
    with numerics(model, row.fmt):
        for step in bar:
            start = time.perf_counter()
            applied = step - sum(skipped)  # the schedule counts applied steps, as optax's does
            for group in optimizer.param_groups:
                group["lr"] = float(settings.learning_rate_at(applied))
            scales.append(scaler.scale())
            optimizer.zero_grad()
            micro = batches[step] if settings.micro_batches > 1 else batches[step][None]
            loss = 0.0
            for windows in micro:
                micro_loss = cross_entropy(model, torch.from_numpy(windows))
                scaler.backward(micro_loss / settings.loss_divisor)  # as users accumulate
                loss += micro_loss.item() / len(micro)
            skipped.append(scaler.step(optimizer))
            losses.append(loss)
            times.append(time.perf_counter() - start)
            if step % 10 == 0 or skipped[-1]:
                bar.set_postfix(
                    loss=f"{losses[-1]:.3f}", scale=f"{scales[-1]:g}", skipped=sum(skipped)
                )
    bar.close()
    final_scale = scaler.scale()
    last = batches[-1][0] if settings.micro_batches > 1 else batches[-1]
    float32_gradients(model, last, settings.loss_divisor)
    if on_gradients is not None:
        on_gradients(model)
    underflow_at_1 = underflow_at_scale = None
    if row.fmt != "float32":
        underflow_at_1 = cstorch.amp.gradient_range_report(
            model, half_dtype=row.fmt
        ).underflow_fraction
        if row.is_scaled:
            underflow_at_scale = cstorch.amp.gradient_range_report(
                model, half_dtype=row.fmt, loss_scale=final_scale
            ).underflow_fraction
    return RowResult(
        front_door="torch",
        row=row,
        held_out_loss=held_out_loss(model, held_out),
        train_losses=losses,
        skipped=skipped,
        scales=scales if row.is_scaled else None,
        final_scale=final_scale if row.is_scaled else None,
        underflow_at_1=underflow_at_1,
        underflow_at_scale=underflow_at_scale,
        time_per_step_s=float(np.median(times[1:] if len(times) > 1 else times)),
    )


def first_step_ranges(
    settings: Settings, windows: np.ndarray, formats: Sequence[str]
) -> dict[str, tuple[float, float]]:
    """The gradient-range report of the first step, per format: the float32 gradients of the
    initial weights on ``windows``, the loss divided by ``settings.loss_divisor``.

    Returns:
        Per format, the fraction of gradient elements that underflow at scale 1 and the
        report's suggested loss scale.
    """
    model = make_model(settings.size, settings.seed)
    float32_gradients(model, windows, settings.loss_divisor)
    ranges = {}
    for fmt in formats:
        found = cstorch.amp.gradient_range_report(model, half_dtype=fmt)
        ranges[fmt] = (found.underflow_fraction, found.suggested_loss_scale)
    return ranges


def gradient_log2(model: torch.nn.Module) -> np.ndarray:
    """log2 of the magnitudes of the nonzero gradient elements of ``model``."""
    values = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    values = values[values != 0].abs().double()
    return torch.log2(values).numpy()


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread while the demo runs: the model is small, and on a shared 2-core
    machine torch's worker threads mostly wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
