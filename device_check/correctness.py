"""The device check's correctness section: the facade against ``torch.amp.GradScaler``, step by step.

Two copies of one GPT-2-like model (about 150 gradient tensors) train side by side under
``torch.autocast(device, dtype=torch.float16)`` with fresh gradients every iteration
(``zero_grad()`` with torch's default): one with ``torch.amp.GradScaler(device)``, one with the
facade. After every backward pass the two sides' scaled gradients are compared bit for bit (if a
nondeterministic kernel made them differ, the facade's side gets copies of torch's, and the step
is counted in ``gradients_from_torch_steps``: so both scalers always see the same inputs); then a fault (inf or NaN in one element of one
gradient) is injected into both on chosen steps, and both sides run their scaler calls. Compared
on every step: the skip decision, the scale after ``update()``, the parameters and the optimizer
state, and in the DLS modes the global norm. Every combination of :data:`MODES` and
:data:`OPTIMIZERS` (foreach SGD with momentum, fused AdamW) is one run.

Modes, and where the two scalers' semantics coincide:

* ``static``: facade ``GradScaler(loss_scale=S)`` against torch's ``GradScaler(init_scale=S,
  growth_interval=2**30)``. torch's factors must be ``> 1`` and ``< 1``, so its "static" scaler
  still skips and halves on an overflow, while the facade's static scaling never checks and
  applies every step (SPEC section 2). The semantics coincide only on finite steps, so no fault
  is injected in this mode; then both keep ``S`` and apply every step. ``S`` is a power of two,
  so unscaling is exact in both: parameters and state must match bit for bit.
* ``dls``: facade ``GradScaler(loss_scale="dynamic", init_scale=S, steps_per_increase=N,
  overflow_tolerance=0, max_loss_scale=2**24)`` against torch's ``GradScaler(init_scale=S,
  growth_factor=2, backoff_factor=0.5, growth_interval=N + 1)``, faults injected. Bit for bit.
  torch calls ``unscale_`` and ``clip_grad_norm_(params, inf)`` (the norm, clipping by 1.0 is
  exact) before ``step``; the facade runs the default loop (its fused path hands the scale to
  fused AdamW) and reports ``get_global_norm()``.
* ``dls_gcc``: as ``dls``, the facade with ``max_gradient_norm=C`` (DLS + GCC) against torch's
  ``unscale_`` + ``clip_grad_norm_(params, C)``, ``C`` half the first step's norm so that the
  clip bites. The two clip coefficients come from float32 norms summed in different orders, so
  parameters are compared within a tolerance (:data:`GCC_PARAM_RTOL`), the rest exactly. The
  parameters then differ slightly, and so do their next gradients: from the second step on the
  facade's side steps with copies of torch's gradients (``gradients_from_torch_steps`` is
  ``steps - 1`` here by design; in the exact modes it counts nondeterministic backward passes).

Derivation of the matched DLS trajectories. cstorch's update (SPEC section 2) with
``overflow_tolerance = 0``: ``steps += 1; overflows += overflowed; halve if 0 < overflows /
steps``; both counters reset after a halving or a doubling. The invariant "``overflows == 0``
before every update" holds initially and is kept: a finite step adds nothing, an overflowed step
makes the ratio positive, which halves and resets. So an overflowed step halves the scale and
sets ``steps = 0`` (the doubling test ``N < 0`` fails); a finite step makes ``steps = s + 1``
and doubles (and resets) exactly when ``s + 1 = N + 1``. That is: halve on every overflow,
double after ``N + 1`` consecutive finite steps since the last rescale. torch's
``_amp_update_scale_``: on ``found_inf`` multiply by ``backoff_factor`` and reset the growth
tracker; else ``tracker += 1`` and at ``tracker == growth_interval`` multiply by
``growth_factor`` and reset. With ``backoff_factor = 0.5``, ``growth_factor = 2`` and
``growth_interval = N + 1`` the two rules are the same function of the skip sequence, for any
placement of faults, provided that (a) no clamp acts: cstorch clamps to ``[min_loss_scale,
max_loss_scale]`` and torch does not, so ``max_loss_scale = 2**24`` is above ``S * 2**(steps /
(N + 1))`` and the few halvings stay far above ``2**-14``; (b) both see the same overflows:
torch's ``found_inf`` is "some element is inf or NaN", cstorch's is "the float32 sum of
squares is not finite", which also fires for finite gradients of magnitude about 1.8e19 or
more: unscaled gradients of this model are many orders below that. Both trajectories are also
checked against this rule computed in Python from the observed skip sequence
(:func:`expected_scales`). Natural float16 overflows, if any, are decided by both alike and
recorded (``natural_overflows``).

Tolerances (justified where they are defined): the global norm against a float64 oracle
(:data:`NORM_RTOL`), parameters with GCC (:data:`GCC_PARAM_RTOL`).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
from typing import Any

import torch
from torch import nn

import torch_facade as cstorch
from workbench.sizes import SIZES, SizeSpec, model_spec, next_token_loss
from workbench.whole_loop import make_workload

MODES = ("static", "dls", "dls_gcc")
"""The comparisons (see the module docstring)."""

OPTIMIZERS = ("SGD foreach", "AdamW fused")
"""The optimizers of the runs."""

INIT_SCALE = 2.0**12
"""``S``: the initial (or static) scale, a power of two: unscaling is exact in both scalers."""

STEPS_PER_INCREASE = 2
"""cstorch's ``steps_per_increase`` ``N``; torch's ``growth_interval`` is ``N + 1``."""

MAX_LOSS_SCALE = 2.0**24
"""cstorch's ``max_loss_scale``: never reached, since torch has no upper clamp."""

NEVER = 2**30
"""torch's ``growth_interval`` in the static mode."""

FAULTS = {3: math.inf, 4: math.nan, 8: math.inf, 13: math.nan}
"""Faults injected by step (into one element of one gradient, on both sides): two in a row,
one just after a doubling, and a NaN; the steps beyond a run's length are not used."""

NORM_RTOL = 1e-4
"""Relative error allowed of a float32 global norm against the float64 one of the same
gradients. Summing ``n`` float32 squares in sequential lanes has a relative error that grows
like ``sqrt(n) * 2**-24`` for random rounding (about 2e-5 for the 6.3M-element embedding of
M on XLA:CPU, whose reduction keeps a few lanes of partial sums), tree reductions (torch, GPUs)
far less; 1e-4 leaves a margin of 5 and still flags a norm off by a missing or doubled tensor
(a relative change of at least ``0.5 * (smallest tensor's share of the sum)``)."""

GCC_PARAM_RTOL = 1e-3
"""With DLS + GCC, ``|p_facade - p_torch| <= GCC_PARAM_RTOL * travel + steps * 2**-22 * |p|``
per element, ``travel`` being the sum of torch's ``|step|`` of that element. The clip
coefficients differ by the two norms' relative difference (at most ``2 * NORM_RTOL``), and a
coefficient's relative error moves SGD's step and AdamW's (scale-invariant but for epsilon)
by about as much; each step may also round the parameter one ulp apart. A clip that is
missing, doubled or off by a factor moves SGD's steps by far more than 0.1%."""

LEARNING_RATES = {"SGD foreach": 1e-2, "AdamW fused": 1e-3}

CPU_FULL_SPEC = dataclasses.replace(SIZES["M"], name="M/64", d_model=64, vocab=1024, context=32)
"""The full check's model on the CPU: M's layout (148 tensors) at width 64, 32 tokens. torch's
float16 kernels on the CPU are slow: an iteration of M itself takes seconds on a small CPU,
this width a small fraction of that (the times: ``docs/performance-notes.md``)."""

BATCH = 2
"""Sequences per iteration."""


def model_for(device: str, quick: bool) -> SizeSpec:
    """The correctness model: M's layout (148 tensors) at width 16 (quick), 64 (CPU) or 384."""
    if quick:
        return model_spec(SIZES["tiny"])
    return SIZES["M"] if device == "cuda" else CPU_FULL_SPEC


def expected_scales(skipped: list[bool], init: float, interval: int) -> list[float]:
    """The scale after each update under the matched rule: halve on a skipped step, double after
    ``interval`` consecutive finite steps since the last rescale.

    Example:
        >>> from device_check.correctness import expected_scales
        >>> expected_scales([False, False, False, True, False], 8.0, 3)
        [8.0, 8.0, 16.0, 8.0, 8.0]
    """
    scale, finite, scales = init, 0, []
    for skip in skipped:
        if skip:
            scale, finite = scale / 2, 0
        else:
            finite += 1
            if finite == interval:
                scale, finite = scale * 2, 0
        scales.append(scale)
    return scales


def _optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "SGD foreach":
        return torch.optim.SGD(params, lr=LEARNING_RATES[name], momentum=0.9, foreach=True)
    if name == "AdamW fused":
        return torch.optim.AdamW(params, lr=LEARNING_RATES[name], fused=True)
    raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}")


def _scalers(mode: str, device_type: str, clip_norm: float) -> tuple[Any, Any]:
    """``(torch's scaler, the facade's)`` of ``mode``."""
    if mode == "static":
        return (
            torch.amp.GradScaler(device_type, init_scale=INIT_SCALE, growth_interval=NEVER),
            cstorch.amp.GradScaler(loss_scale=INIT_SCALE),
        )
    torch_scaler = torch.amp.GradScaler(
        device_type,
        init_scale=INIT_SCALE,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=STEPS_PER_INCREASE + 1,
    )
    facade = cstorch.amp.GradScaler(
        loss_scale="dynamic",
        init_scale=INIT_SCALE,
        steps_per_increase=STEPS_PER_INCREASE,
        max_loss_scale=MAX_LOSS_SCALE,
        overflow_tolerance=0.0,
        max_gradient_norm=clip_norm if mode == "dls_gcc" else None,
    )
    return torch_scaler, facade


@dataclasses.dataclass
class _Side:
    """One side of a run: a model copy, its optimizer and its scaler."""

    model: nn.Module
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    scaler: Any

    def backward(self, tokens: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(tokens.device.type, dtype=torch.float16):
            loss = next_token_loss(self.model, tokens)
        self.scaler.scale(loss).backward()

    def scale(self) -> float:
        return float(self.scaler.get_scale())


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(
        a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)
    )


def _norm64(grads: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(g.detach().double().square().sum()) for g in grads))


def _state_tensors(
    optimizer: torch.optim.Optimizer, params: list[nn.Parameter]
) -> list[torch.Tensor]:
    return [
        value
        for p in params
        for _, value in sorted(optimizer.state.get(p, {}).items())
        if isinstance(value, torch.Tensor)
    ]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


class _Run:
    """One mode and optimizer: both sides, step by step, and what was found."""

    def __init__(
        self,
        mode: str,
        optimizer: str,
        model: nn.Module,
        tokens: torch.Tensor,
        clip_norm: float,
        steps: int,
    ) -> None:
        self.mode, self.optimizer_name, self.tokens, self.steps = mode, optimizer, tokens, steps
        self.clip_norm = clip_norm
        torch_scaler, facade = _scalers(mode, tokens.device.type, clip_norm)
        self.torch = self._side(model, optimizer, torch_scaler)
        self.facade = self._side(model, optimizer, facade)
        self.faults = {k: v for k, v in FAULTS.items() if k < steps and mode != "static"}
        self.fault_index = len(self.torch.params) // 2
        self.mismatches: list[str] = []
        self.records: list[dict[str, Any]] = []
        self.from_torch = 0
        self.max_param_excess = 0.0  # dls_gcc: largest |diff| / tolerance seen
        self.travel = [torch.zeros_like(p) for p in self.torch.params] if mode == "dls_gcc" else []

    @staticmethod
    def _side(model: nn.Module, optimizer: str, scaler: Any) -> _Side:
        copy_ = copy.deepcopy(model)
        params = list(copy_.parameters())
        return _Side(copy_, params, _optimizer(optimizer, params), scaler)

    def _fail(self, step: int, text: str) -> None:
        if len(self.mismatches) < 20:
            self.mismatches.append(f"step {step}: {text}")

    def _match_gradients(self, step: int) -> None:
        for p_t, p_f in zip(self.torch.params, self.facade.params, strict=True):
            if (p_t.grad is None) != (p_f.grad is None):
                self._fail(step, "a gradient is None on one side only")
                return
        same = all(
            p_t.grad is None or _same_bits(p_t.grad, p_f.grad)
            for p_t, p_f in zip(self.torch.params, self.facade.params, strict=True)
        )
        if not same:  # a nondeterministic kernel: give both sides the same inputs
            self.from_torch += 1
            for p_t, p_f in zip(self.torch.params, self.facade.params, strict=True):
                if p_t.grad is not None:
                    p_f.grad = p_t.grad.detach().clone()

    def _inject(self, step: int) -> None:
        value = self.faults.get(step)
        if value is None:
            return
        for side in (self.torch, self.facade):
            grad = side.params[self.fault_index].grad
            grad[(0,) * grad.dim()] = value

    def _torch_step(self) -> tuple[float | None, float | None]:
        side = self.torch
        norm = oracle = None
        if self.mode != "static":
            side.scaler.unscale_(side.optimizer)
            oracle = _norm64([p.grad for p in side.params if p.grad is not None])
            limit = self.clip_norm if self.mode == "dls_gcc" else math.inf
            norm = float(torch.nn.utils.clip_grad_norm_(side.params, limit))
        side.scaler.step(side.optimizer)
        side.scaler.update()
        return norm, oracle

    def step(self, step: int) -> bool:
        """Runs and compares one step; ``False`` once the two sides can no longer be compared."""
        scale_t, scale_f = self.torch.scale(), self.facade.scale()
        if scale_t != scale_f:
            self._fail(step, f"scales differ before the step: torch {scale_t}, facade {scale_f}")
            return False
        self.torch.backward(self.tokens)
        self.facade.backward(self.tokens)
        self._match_gradients(step)
        self._inject(step)
        before = [p.detach().clone() for p in self.facade.params]
        torch_before = [p.detach().clone() for p in self.torch.params] if self.travel else []
        norm_t, oracle = self._torch_step()
        self.facade.scaler.step(self.facade.optimizer)
        self.facade.scaler.update()
        skipped_t = self.torch.scale() < scale_t
        skipped_f = not bool(self.facade.scaler.get_isfinite())
        norm_f = float(self.facade.scaler.get_global_norm()) if self.mode != "static" else None
        record = {
            "step": step,
            "fault": None if step not in self.faults else str(self.faults[step]),
            "torch_skipped": skipped_t,
            "facade_skipped": skipped_f,
            "torch_scale": self.torch.scale(),
            "facade_scale": self.facade.scale(),
            "torch_norm": norm_t,
            "facade_norm": norm_f,
            "float64_norm": oracle,
        }
        self.records.append(record)
        if skipped_t != skipped_f:
            why = (
                " (a natural overflow: static scaling never skips)" if self.mode == "static" else ""
            )
            self._fail(step, f"skip decisions differ: torch {skipped_t}, facade {skipped_f}{why}")
        if record["torch_scale"] != record["facade_scale"]:
            self._fail(
                step,
                f"scales differ: torch {record['torch_scale']}, facade {record['facade_scale']}",
            )
        if skipped_f and not all(
            _same_bits(a, p) for a, p in zip(before, self.facade.params, strict=True)
        ):
            self._fail(step, "the facade skipped the step but a parameter changed")
        self._compare_norms(step, norm_t, norm_f, oracle)
        if self.travel:
            for total, p, old in zip(self.travel, self.torch.params, torch_before, strict=True):
                total.add_((p.detach() - old).abs())
        self._compare_parameters(step)
        return True

    def _compare_norms(
        self, step: int, norm_t: float | None, norm_f: float | None, oracle: float | None
    ) -> None:
        if norm_t is None or norm_f is None or oracle is None:
            return
        if not math.isfinite(oracle):
            if math.isfinite(norm_f):
                self._fail(step, f"the gradients hold inf/NaN but the facade's norm is {norm_f}")
            return
        if not _rel(norm_f, oracle) <= NORM_RTOL:
            self._fail(
                step, f"global norm {norm_f} vs float64 {oracle} (rel {_rel(norm_f, oracle):.2e})"
            )

    def _compare_parameters(self, step: int) -> None:
        pairs = zip(self.torch.params, self.facade.params, strict=True)
        if self.mode != "dls_gcc":
            bad = sum(not _same_bits(p_t, p_f) for p_t, p_f in pairs)
            if bad:
                self._fail(step, f"{bad} parameter tensors differ (bit for bit)")
            state_t = _state_tensors(self.torch.optimizer, self.torch.params)
            state_f = _state_tensors(self.facade.optimizer, self.facade.params)
            if len(state_t) != len(state_f) or not all(map(_same_bits, state_t, state_f)):
                self._fail(step, "optimizer state differs (bit for bit)")
            return
        for (p_t, p_f), travel in zip(pairs, self.travel, strict=True):
            tol = GCC_PARAM_RTOL * travel + (step + 1) * 2.0**-22 * p_t.detach().abs() + 1e-30
            excess = float(((p_f.detach() - p_t.detach()).abs() / tol).max())
            self.max_param_excess = max(self.max_param_excess, excess)
        if self.max_param_excess > 1.0:
            self._fail(
                step, f"parameters differ beyond the GCC tolerance ({self.max_param_excess:.3g}x)"
            )

    def summary(self) -> dict[str, Any]:
        skipped = [r["torch_skipped"] for r in self.records]
        expected = expected_scales(
            skipped, INIT_SCALE, NEVER if self.mode == "static" else STEPS_PER_INCREASE + 1
        )
        if [r["torch_scale"] for r in self.records] != expected:
            self.mismatches.append("torch's scale trajectory is not the derived rule's")
        if [r["facade_scale"] for r in self.records] != expected:
            self.mismatches.append("the facade's scale trajectory is not the derived rule's")
        norms = [
            r
            for r in self.records
            if r["float64_norm"] is not None and math.isfinite(r["float64_norm"])
        ]
        clipped = [
            r for r in norms if self.mode == "dls_gcc" and r["float64_norm"] > self.clip_norm
        ]
        return {
            "mode": self.mode,
            "optimizer": self.optimizer_name,
            "steps": len(self.records),
            "passed": not self.mismatches and len(self.records) == self.steps,
            "mismatches": self.mismatches,
            "faults": {str(k): str(v) for k, v in self.faults.items()},
            "skipped_steps": sum(skipped),
            "natural_overflows": sum(
                r["torch_skipped"] and r["fault"] is None for r in self.records
            ),
            "gradients_from_torch_steps": self.from_torch,
            "scales": [r["facade_scale"] for r in self.records],
            "facade_norm_max_rel_err": max(
                (_rel(r["facade_norm"], r["float64_norm"]) for r in norms), default=None
            ),
            "torch_norm_max_rel_err": max(
                (_rel(r["torch_norm"], r["float64_norm"]) for r in norms), default=None
            ),
            "facade_torch_norm_max_rel_diff": max(
                (_rel(r["facade_norm"], r["torch_norm"]) for r in norms), default=None
            ),
            "clip_norm": self.clip_norm if self.mode == "dls_gcc" else None,
            "clipped_steps": len(clipped),
            "gcc_param_max_excess": self.max_param_excess if self.mode == "dls_gcc" else None,
            "records": self.records,
        }


def _first_norm(model: nn.Module, tokens: torch.Tensor) -> float:
    """The float64 global norm of the first step's unscaled gradients (sets ``C`` of GCC)."""
    probe = copy.deepcopy(model)
    with torch.autocast(tokens.device.type, dtype=torch.float16):
        loss = next_token_loss(probe, tokens)
    (loss.float() * INIT_SCALE).backward()
    return _norm64([p.grad for p in probe.parameters() if p.grad is not None]) / INIT_SCALE


def run(
    device: torch.device, quick: bool, seed: int = 0, steps: int | None = None
) -> dict[str, Any]:
    """Runs every mode with every optimizer on ``device`` and returns the section's result.

    Args:
        device: the torch device.
        quick: the small model and fewer steps (CI).
        seed: seeds the model and the tokens.
        steps: steps per run (default 10 quick, 16 full).

    Returns:
        ``passed``, ``compared_steps``, the model, the settings and one summary per run.
    """
    spec = model_for(device.type, quick)
    steps = steps or (10 if quick else 16)
    workload = make_workload(spec, seed, batch=BATCH, device=device)
    clip_norm = 0.5 * _first_norm(workload.model, workload.tokens)
    runs = []
    for mode in MODES:
        for optimizer in OPTIMIZERS:
            run_ = _Run(mode, optimizer, workload.model, workload.tokens, clip_norm, steps)
            for step in range(steps):
                if not run_.step(step):
                    break
            runs.append(run_.summary())
            del run_
            gc.collect()
    return {
        "passed": all(r["passed"] for r in runs) and bool(runs),
        "compared_steps": sum(r["steps"] for r in runs),
        "model": {
            "layout": spec.name,
            "d_model": spec.d_model,
            "tensors": workload.tensors,
            "params": workload.params,
            "batch": BATCH,
            "tokens": workload.tokens.shape[1] - 1,
            "autocast": "float16",
        },
        "settings": {
            "init_scale": INIT_SCALE,
            "steps_per_increase": STEPS_PER_INCREASE,
            "torch_growth_interval": STEPS_PER_INCREASE + 1,
            "max_loss_scale": MAX_LOSS_SCALE,
            "learning_rates": LEARNING_RATES,
            "norm_rtol": NORM_RTOL,
            "gcc_param_rtol": GCC_PARAM_RTOL,
            "fault_tensor_index": workload.tensors // 2,
        },
        "runs": runs,
    }
