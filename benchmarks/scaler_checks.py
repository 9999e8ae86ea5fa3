"""Behaviour checks of every timed loss scaler: an overflow skip and a growth, against an oracle.

Each scaler of :mod:`benchmarks.step_bench` is built by the same code that the timing runs, on a
small model whose gradients are exact in float16 and float32 at power-of-two scales: two leaves
``p`` and the loss ``factor * sum(p16 * c16)``, so that the true gradient is ``c`` whatever the
scale and ``factor = inf`` makes every gradient infinite. The optimizer is SGD with momentum
(``optax.sgd(0.5, momentum=0.5)``: a state to keep, and dyadic arithmetic, so every applied
update is exact). From a scale of ``2**10`` with growth every 2 finite steps, the batches are
``1, 1, 1, inf, 1, 1, 1`` (the overflow at step 4). Per scaler:

* the overflowed step leaves parameters and optimizer state bit-identical, the scale halves,
  and (where the scaler counts them) the skip is counted;
* on every applied step the optimizer received the true gradient ``c`` bit for bit (read from
  its momentum: ``trace_new - 0.5 * trace_old``): a step whose gradients were unscaled by
  another scale than the loss was scaled with shows up here;
* the finite step on which the scale first doubles (the libraries count differently; reported,
  not judged), and how often the step function was traced.

Two more checks reproduce reports about jmp 0.0.4: its README's float16 scale
(``jmp.DynamicLossScale(jmp.half_dtype()(2 ** 15))``) and its ``min_loss_scale`` across ``jit``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.step_bench import JMP, MPX, SCALERS, USAGE, Runner, ScalerSettings, build

FACTORS = (1.0, 1.0, 1.0, float("inf"), 1.0, 1.0, 1.0)
"""The batches: the loss factor of each step (``inf``: every gradient overflows)."""

OVERFLOW_STEP = FACTORS.index(float("inf"))
"""The index of the overflowed step."""

SETTINGS = ScalerSettings(init_scale=2.0**10, period=2, max_scale=2.0**15, min_scale=1.0)
"""Scale ``2**10``, growth every 2 finite steps (in each library's own terms)."""

LEARNING_RATE = 0.5
MOMENTUM = 0.5

_PARAMS = {
    "a": np.array([1.0, -2.0, 0.5, 4.0], np.float32),
    "b": np.array([[0.25, 3.0], [-1.5, 2.0], [8.0, -0.125]], np.float32),
}
_COEFFICIENTS = {
    "a": np.array([1.0, 2.0, -3.0, 0.5], np.float16),
    "b": np.array([[4.0, -1.0], [0.25, 2.0], [-8.0, 1.5]], np.float16),
}


def check_loss(params: dict[str, jax.Array], factor: jax.Array) -> jax.Array:
    """``factor * sum(p16 * c16)`` over both leaves, summed in float32: the gradient is ``c``."""
    total = jnp.zeros((), jnp.float32)
    for name, value in params.items():
        product = value.astype(jnp.float16) * jnp.asarray(_COEFFICIENTS[name])
        total = total + jnp.sum(product.astype(jnp.float32))
    return total * factor


def _true_gradient() -> list[np.ndarray]:
    """The gradient of :func:`check_loss` at factor 1, leaf by leaf in key order."""
    return [_COEFFICIENTS[k].astype(np.float32) for k in sorted(_COEFFICIENTS)]


def _received_gradient(old_state: Any, new_state: Any) -> list[np.ndarray]:
    """What SGD with momentum was given: ``trace_new - momentum * trace_old`` (exact here)."""
    old = [np.asarray(x) for x in jax.tree_util.tree_leaves(old_state)]
    new = [np.asarray(x) for x in jax.tree_util.tree_leaves(new_state)]
    return [n - np.float32(MOMENTUM) * o for n, o in zip(new, old, strict=True)]


def _bits(tree: Any) -> list[bytes]:
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


@dataclasses.dataclass
class ScalerCheck:
    """What the checks found for one scaler.

    Attributes:
        scaler: the scaler's name (:data:`benchmarks.step_bench.SCALERS`).
        skip_bit_identical: the overflowed step left parameters and optimizer state unchanged.
        scale_halved: the overflowed step halved the scale.
        counts_skips: the scaler counts skipped steps (and counted this one).
        growth_step: the finite step (1-based) on which the scale first doubled; ``None``: never.
        gradients_exact: on every applied step the optimizer received the true gradient.
        mismatches: the steps (1-based) where it did not, with what it received.
        traces: how often the step function was traced over the run.
        scales: the scale after each step.
        error: the exception the run raised, if any (then the other fields are ``None``).
    """

    scaler: str
    skip_bit_identical: bool | None = None
    scale_halved: bool | None = None
    counts_skips: bool | None = None
    growth_step: int | None = None
    gradients_exact: bool | None = None
    mismatches: list[str] = dataclasses.field(default_factory=list)
    traces: int | None = None
    scales: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None


def _gradient_ratio(received: list[np.ndarray], true: list[np.ndarray]) -> str:
    """The received gradient over the true one, as one number where they are proportional."""
    got = np.concatenate([np.ravel(x) for x in received])
    want = np.concatenate([np.ravel(x) for x in true])
    ratios = got / want
    if np.allclose(ratios, ratios[0]):
        return f"{ratios[0]:.3g}x the true gradient"
    return "not proportional to the true gradient"


def check_scaler(name: str) -> ScalerCheck:
    """Runs :data:`FACTORS` through scaler ``name`` and compares with the oracle."""
    result = ScalerCheck(name)
    try:
        runner = build(
            name,
            check_loss,
            optax.sgd(LEARNING_RATE, momentum=MOMENTUM),
            _PARAMS,
            SETTINGS,
        )
        _run(runner, result)
    except Exception as error:  # a peer's failure is a finding, not a crash of the benchmark
        result.error = f"{type(error).__name__}: {error}"
    return result


def _run(runner: Runner, result: ScalerCheck) -> None:
    true = _true_gradient()
    scale = runner.scale()
    finite_steps = 0
    for index, factor in enumerate(FACTORS):
        params_bits = _bits(runner.params())
        old_state = jax.tree_util.tree_map(np.asarray, runner.opt_state())
        runner.step(jnp.float32(factor))
        new_scale = runner.scale()
        result.scales.append(new_scale)
        if index == OVERFLOW_STEP:
            result.skip_bit_identical = _bits(runner.params()) == params_bits and _bits(
                runner.opt_state()
            ) == _bits(old_state)
            result.scale_halved = new_scale == scale / 2
        else:
            finite_steps += 1
            if result.growth_step is None and new_scale == 2 * scale:
                result.growth_step = finite_steps
            received = _received_gradient(old_state, runner.opt_state())
            if _bits(received) != _bits(true):
                result.mismatches.append(
                    f"step {index + 1} (scale {scale:g} -> {new_scale:g}): "
                    + _gradient_ratio(received, true)
                )
        scale = new_scale
    result.gradients_exact = not result.mismatches
    skipped = runner.skipped()
    result.counts_skips = skipped == 1 if USAGE[result.scaler].counts_skips else False
    result.traces = runner.traces


@dataclasses.dataclass
class Finding:
    """A misbehaviour of a peer, with the code that shows it and what it gave."""

    scaler: str
    title: str
    reproduction: str
    observed: str


def _jmp_float16_scale() -> Finding | None:
    import jmp

    code = (
        "import jax.numpy as jnp, jmp\n"
        "loss_scale = jmp.DynamicLossScale(jmp.half_dtype()(2 ** 15))  # jmp's README\n"
        "loss_scale.adjust(jnp.array(True))"
    )
    try:
        jmp.DynamicLossScale(jmp.half_dtype()(2**15)).adjust(jnp.array(True))
    except TypeError as error:
        return Finding(
            JMP,
            "the README's float16 scale fails in `adjust` (a float32 minimum against a float16 "
            "scale in `lax.select`); a float32 scale works",
            code,
            f"TypeError: {error}",
        )
    return None


def _jmp_min_scale_across_jit() -> Finding | None:
    import jmp

    loss_scale = jmp.DynamicLossScale(jnp.float32(4.0), min_loss_scale=jnp.float32(2.0))
    overflow = jnp.array(False)
    eager = float(loss_scale.adjust(overflow).adjust(overflow).loss_scale)
    crossed = jax.jit(lambda s: s)(loss_scale)
    jitted = float(crossed.adjust(overflow).adjust(overflow).loss_scale)
    if jitted == eager:
        return None
    code = (
        "import jax, jax.numpy as jnp, jmp\n"
        "s = jmp.DynamicLossScale(jnp.float32(4.0), min_loss_scale=jnp.float32(2.0))\n"
        "s = jax.jit(lambda s: s)(s)  # any jitted step that takes and returns it\n"
        "s.min_loss_scale, s.adjust(jnp.array(False)).adjust(jnp.array(False)).loss_scale"
    )
    return Finding(
        JMP,
        "`min_loss_scale` is not part of the pytree (`tree_flatten` keeps `loss_scale` and "
        "`counter`): after any `jit` it is back to 1 and the scale falls below the minimum",
        code,
        f"min_loss_scale {float(crossed.min_loss_scale)}, scale after two overflows {jitted} "
        f"(without jit: {eager})",
    )


def _findings_from(checks: list[ScalerCheck]) -> list[Finding]:
    """Findings of the generic run: failures, wrong skips, inexact updates, repeated traces."""
    found = []
    for check in checks:
        code = (
            f"python -c 'from benchmarks.scaler_checks import check_scaler; "
            f'print(check_scaler("{check.scaler}"))\''
        )
        if check.error:
            found.append(Finding(check.scaler, "the check run failed", code, check.error))
            continue
        if not (check.skip_bit_identical and check.scale_halved):
            found.append(
                Finding(
                    check.scaler,
                    "the overflowed step was not skipped bit-identically with a halved scale",
                    code,
                    f"bit-identical {check.skip_bit_identical}, halved {check.scale_halved}",
                )
            )
        if not check.gradients_exact:
            title = "an applied step's optimizer did not receive the true gradient"
            if check.scaler == MPX:
                title = (
                    "on the step where the scale grows, the gradients are unscaled by the grown "
                    "scale (`filter_value_and_grad` calls `adjust` before `unscale`): that "
                    "step's update is computed from half the gradient"
                )
            found.append(
                Finding(
                    check.scaler,
                    title,
                    code,
                    f"scales after each step {check.scales}; " + "; ".join(check.mismatches),
                )
            )
        if check.traces is not None and check.traces > 1:
            found.append(
                Finding(
                    check.scaler,
                    "the step is traced (and compiled) again after the first call",
                    code,
                    f"{check.traces} traces in {len(FACTORS)} steps",
                )
            )
    return found


def run_checks(scalers: tuple[str, ...] = SCALERS) -> tuple[list[ScalerCheck], list[Finding]]:
    """Checks every scaler in ``scalers`` and returns the results and the peers' misbehaviours."""
    checks = [check_scaler(name) for name in scalers]
    findings = _findings_from(checks)
    if JMP in scalers:
        for probe in (_jmp_float16_scale, _jmp_min_scale_across_jit):
            finding = probe()
            if finding is not None:
                findings.append(finding)
    return checks, findings
