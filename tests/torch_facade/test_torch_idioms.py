"""torch's GradScaler idioms through the facade (issue #12, items 1-4).

Oracles: ``torch.nn.utils.clip_grad_norm_`` for the global norm, ``torch.amp.GradScaler("cpu")``
where its semantics coincide with the reference (one optimizer, tolerance 0), plain torch
without scaling for the applied steps (power-of-two scales are exact), and an uninterrupted run
for a pickled scaler.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from facade_helpers import (
    DLS,
    INF,
    NAN,
    TinyNet,
    assert_tensors_equal,
    batch,
    deep_equal,
    loss_of,
    optimizer_snapshot,
    parameters_of,
    poison_on,
)

import torch_facade as cstorch

GCC = {**DLS, "max_gradient_norm": 0.5}


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def grads_with_values(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def with_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.grad is not None]


# ------------------------------------------------------- 1. the skip signal after unscale_


@pytest.mark.parametrize("kwargs", [DLS, GCC], ids=["dls", "dls-gcc"])
def test_skip_signal_and_norm_read_after_unscale_are_this_iterations(kwargs):
    """Faults at iterations 1 and 2 of four: the flag read between ``unscale_`` and ``step``
    is ``[True, False, False, True]`` (the previous iteration's would be
    ``[True, True, False, False]``), and the norm is ``clip_grad_norm_(params, inf)`` of the
    gradients ``unscale_`` left (not yet clipped, with GCC as in the reference).
    """
    model = TinyNet()
    optimizer = sgd(model)
    scaler = cstorch.amp.GradScaler(**kwargs)
    flags = []
    for step in range(4):
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        if step == 1:
            model.fc1.weight.grad[0, 0] = INF
        if step == 2:
            model.fc2.bias.grad[1] = NAN
        scaler.unscale_(optimizer)
        flags.append(bool(scaler.get_isfinite()))
        norm = scaler.get_global_norm()
        expected = torch.nn.utils.clip_grad_norm_(with_grads(model), INF)
        if step in (0, 3):
            assert float(norm) > 0.0
            torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
        else:
            assert not torch.isfinite(norm)
        scaler.step(optimizer)
        assert bool(scaler.get_isfinite()) == flags[-1]
        scaler.update()
        assert bool(scaler.get_isfinite()) == flags[-1]
    assert flags == [True, False, False, True]
    assert int(scaler.get_num_skipped_steps()) == 2


def test_gcc_unscale_leaves_unclipped_gradients_and_step_clips_them():
    """DLS + GCC: after ``unscale_`` the gradients are unscaled only; the step applies the clip
    coefficient of the norm seen at ``unscale_``. Oracle: plain torch with
    ``clip_grad_norm_(params, 0.5)`` before each step.
    """
    reference, model = TinyNet(), TinyNet()
    reference_opt, optimizer = sgd(reference), sgd(model)
    scaler = cstorch.amp.GradScaler(**GCC)
    for step in range(3):
        reference_opt.zero_grad()
        loss_of(reference, step).backward()
        unclipped = [g.clone() for g in grads_with_values(reference)]
        norm = torch.nn.utils.clip_grad_norm_(with_grads(reference), GCC["max_gradient_norm"])
        assert float(norm) > GCC["max_gradient_norm"]  # the clip does something
        reference_opt.step()
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        scaler.unscale_(optimizer)
        if step == 0:  # the same parameters: the same gradients, bit for bit
            assert_tensors_equal(unclipped, grads_with_values(model))
        else:
            # The clip coefficients of step 0 come from two float32 norms, XLA's (one sum of
            # every square) and torch's (a norm of per-tensor norms), which can differ by an
            # ulp (they do on AMD EPYC CPUs), so the parameters and then the gradients agree to
            # float32 rounding only; a clip (a coefficient below 0.6 here) is far outside that.
            torch.testing.assert_close(grads_with_values(model), unclipped, rtol=1e-6, atol=1e-7)
        scaler.step(optimizer)
        scaler.update()
    torch.testing.assert_close(parameters_of(model), parameters_of(reference), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("value", [INF, NAN], ids=["inf", "nan"])
def test_gradients_changed_after_unscale_do_not_change_the_decision(value):
    """The decision is the one ``unscale_`` took, as with ``torch.amp.GradScaler``.

    Iteration 1 overflows and the user repairs the gradients after ``unscale_``
    (``nan_to_num_``): still skipped. Iteration 3 is finite and the user then writes inf or NaN
    into a gradient: the step is applied with it. Oracle: torch's own scaler on the same loop,
    bit for bit (parameters, scale).
    """
    torch_model, model = TinyNet(), TinyNet()
    torch_opt = torch.optim.SGD(torch_model.parameters(), lr=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=DLS["init_scale"], growth_interval=2001)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(4):
        for s, m, o in ((torch_scaler, torch_model, torch_opt), (scaler, model, optimizer)):
            o.zero_grad()
            s.scale(loss_of(m, step)).backward()
            if step == 1:
                m.fc1.weight.grad[0, 0] = INF
            s.unscale_(o)
            if step == 1:
                for grad in grads_with_values(m):
                    torch.nan_to_num_(grad, nan=0.0, posinf=0.0, neginf=0.0)
            if step == 3:
                m.fc2.bias.grad[0] = value
            s.step(o)
            s.update()
        assert float(scaler.get_scale()) == torch_scaler.get_scale(), f"step {step}"
        assert bool(scaler.get_isfinite()) is (step != 1)
        assert_tensors_equal(parameters_of(torch_model), parameters_of(model))
    assert not torch.isfinite(model.fc2.bias[0])  # the overwritten gradient was applied
    assert int(scaler.get_num_skipped_steps()) == 1


# ---------------------------------------------------------------- 2. pickling, deepcopy


OVERFLOWS = {1, 2, 6}
ITERATIONS = 8


def iteration(scaler: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int):
    """One iteration: overflows on ``OVERFLOWS``; an explicit ``unscale_`` on odd steps."""
    optimizer.zero_grad()
    scaler.scale(loss_of(model, step)).backward()
    if step in OVERFLOWS:
        model.fc2.weight.grad[0, 0] = INF
    if step % 2:
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()


def observe(scaler: Any) -> dict[str, Any]:
    """Everything a user can read from a scaler between iterations."""
    return {
        "state_dict": scaler.state_dict(),
        "scale": scaler.get_scale(),
        "non_clamped": scaler.get_non_clamped_scale(),
        "skipped": scaler.get_num_skipped_steps(),
        "isfinite": scaler.get_isfinite(),
        "global_norm": scaler.get_global_norm(),
    }


def via_torch_save(scaler: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(scaler, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


COPIES: dict[str, Callable[[Any], Any]] = {
    "pickle": lambda scaler: pickle.loads(pickle.dumps(scaler)),
    "deepcopy": copy.deepcopy,
    "torch.save": via_torch_save,
}
# Growth every third finite update, so that the copied counters matter.
CONFIGS = {
    "dls": {**DLS, "steps_per_increase": 2},
    "dls-gcc": {**DLS, "steps_per_increase": 2, "max_gradient_norm": 0.5},
}


def run(config: dict[str, Any], copy_scaler: Callable[[Any], Any] | None) -> tuple[list, list]:
    """Observations and parameters after each iteration; the scaler is replaced by a copy of
    itself before every iteration when ``copy_scaler`` is given."""
    model = TinyNet()
    optimizer = sgd(model)
    scaler = cstorch.amp.GradScaler(**config)
    observations, parameters = [], []
    for step in range(ITERATIONS):
        if copy_scaler is not None:
            copied = copy_scaler(scaler)
            assert copied is not scaler
            assert copied.config == scaler.config
            assert deep_equal(observe(scaler), observe(copied))
            scaler = copied
        iteration(scaler, model, optimizer, step)
        observations.append(observe(scaler))
        parameters.append(parameters_of(model))
    return observations, parameters


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("how", list(COPIES))
def test_copied_scaler_continues_exactly(how, config):
    """Oracle: the same run without copies; every observation and parameter bit for bit."""
    expected_observations, expected_parameters = run(CONFIGS[config], None)
    observations, parameters = run(CONFIGS[config], COPIES[how])
    # Hand-computed: the growth at iteration 5 needs the steps counted before the copies.
    assert [float(o["scale"]) for o in expected_observations] == [
        256.0,
        128.0,
        64.0,
        64.0,
        64.0,
        128.0,
        64.0,
        64.0,
    ]
    assert [int(o["skipped"]) for o in expected_observations] == [0, 1, 2, 2, 2, 2, 3, 3]
    for step in range(ITERATIONS):
        assert deep_equal(expected_observations[step], observations[step]), f"step {step}"
        assert_tensors_equal(expected_parameters[step], parameters[step])


@pytest.mark.parametrize("how", list(COPIES))
def test_copy_is_independent_of_the_original(how):
    """Training the original further leaves a copy where it was."""
    model = TinyNet()
    optimizer = sgd(model)
    scaler = cstorch.amp.GradScaler(**CONFIGS["dls"])
    iteration(scaler, model, optimizer, 0)
    copied = COPIES[how](scaler)
    before = observe(copied)
    for step in (1, 2):  # two overflows: the original's scale and counts move
        iteration(scaler, model, optimizer, step)
    assert not deep_equal(observe(scaler), before)
    assert deep_equal(observe(copied), before)


STAGES = ("scaled", "backward", "unscaled", "stepped")


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("how", list(COPIES))
def test_copy_mid_iteration_raises_and_changes_nothing(how, stage):
    """Between ``scale()`` and ``update()`` a copy would lose the iteration: a RuntimeError
    that says when it is possible. The iteration then finishes as an uninterrupted one.
    """
    expected_observations, expected_parameters = run(CONFIGS["dls"], None)
    model = TinyNet()
    optimizer = sgd(model)
    scaler = cstorch.amp.GradScaler(**CONFIGS["dls"])
    iteration(scaler, model, optimizer, 0)
    step = 1
    optimizer.zero_grad()
    scaled = scaler.scale(loss_of(model, step))
    if stage != "scaled":
        scaled.backward()
        model.fc2.weight.grad[0, 0] = INF  # step 1 overflows, as in iteration()
    if stage in ("unscaled", "stepped"):
        scaler.unscale_(optimizer)
    if stage == "stepped":
        scaler.step(optimizer)
    for _attempt in range(2):  # twice: a failed attempt leaves nothing behind
        with pytest.raises(RuntimeError, match="between iterations"):
            COPIES[how](scaler)
    if stage == "scaled":
        scaled.backward()
        model.fc2.weight.grad[0, 0] = INF
    if stage != "stepped":
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
    scaler.update()
    assert deep_equal(expected_observations[step], observe(scaler))
    assert_tensors_equal(expected_parameters[step], parameters_of(model))
    assert deep_equal(observe(scaler), observe(COPIES[how](scaler)))  # possible again


# --------------------------------------------------- 3. torch's multi-optimizer loop


class TwoModels(torch.nn.Module):
    """The two models of torch's "multiple models, losses and optimizers" AMP example."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.model0 = torch.nn.Linear(4, 3)
        self.model1 = torch.nn.Linear(4, 3)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)

    def losses(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(2000 + step)
        x = torch.randn(5, 4, generator=generator)
        target = torch.randn(5, 3, generator=generator)
        out0, out1 = self.model0(x), self.model1(x)
        loss0 = (2 * out0 + 3 * out1 - target).square().mean()
        loss1 = (3 * out0 - 5 * out1 - target).square().mean()
        return loss0, loss1


def two_optimizers(models: TwoModels) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    return (
        torch.optim.SGD(models.model0.parameters(), lr=0.05, momentum=0.9),
        torch.optim.Adam(models.model1.parameters(), lr=0.01),
    )


@pytest.mark.parametrize("faulty", ["model1.weight", "model0.bias"])
def test_torch_documented_multi_optimizer_loop(faulty):
    """``scale(loss0).backward(retain_graph=True)``, ``scale(loss1).backward()``,
    ``unscale_(opt0)``, ``step(opt0)``, ``step(opt1)``, ``update()``, without registration.

    An inf written by a gradient hook (during backward) at iterations 0 (the first) and 2
    skips both optimizers; ``get_isfinite()`` already says so after ``unscale_(opt0)``, before
    opt1 was ever passed to the scaler. Oracle: plain torch on the applied iterations.
    """
    models = TwoModels()
    opt0, opt1 = two_optimizers(models)
    scaler = cstorch.amp.GradScaler(**DLS)
    reference = TwoModels()
    ref0, ref1 = two_optimizers(reference)
    faults, counter = {0, 2}, [0]
    poison_on(models.get_parameter(faulty), faults, counter)
    for step in range(5):
        counter[0] = step
        if step not in faults:
            ref0.zero_grad()
            ref1.zero_grad()
            loss0, loss1 = reference.losses(step)
            loss0.backward(retain_graph=True)
            loss1.backward()
            ref0.step()
            ref1.step()
        params_before = parameters_of(models)
        states_before = optimizer_snapshot(opt0), optimizer_snapshot(opt1)
        opt0.zero_grad()
        opt1.zero_grad()
        loss0, loss1 = models.losses(step)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        scaler.unscale_(opt0)
        assert bool(scaler.get_isfinite()) is (step not in faults)
        scaler.step(opt0)
        scaler.step(opt1)
        scaler.update()
        if step in faults:
            assert_tensors_equal(params_before, parameters_of(models))
            assert deep_equal(states_before[0], opt0.state_dict())
            assert deep_equal(states_before[1], opt1.state_dict())
    assert int(scaler.get_num_skipped_steps()) == 2 * len(faults)
    assert float(scaler.get_scale()) == DLS["init_scale"] / 2 ** len(faults)
    assert_tensors_equal(parameters_of(reference), parameters_of(models))
    assert deep_equal(ref0.state_dict(), opt0.state_dict())
    assert deep_equal(ref1.state_dict(), opt1.state_dict())


def first_two_decisions(model: TinyNet, optimizer: torch.optim.Optimizer, scaler: Any, leaf: str):
    """Two iterations with an inf only in the gradient of a leaf that no optimizer owns (an
    input with ``requires_grad``, or ``fc1`` left out of the optimizer); the flag and norm read
    after ``unscale_``, and ``clip_grad_norm_(params, inf)`` over the optimizer's parameters."""
    decisions = []
    for step in range(2):
        optimizer.zero_grad()
        model.zero_grad()
        x, y = batch(step)
        x.requires_grad_(leaf == "input")
        scaler.scale((model(x) - y).square().mean()).backward()
        outsider = x if leaf == "input" else model.fc1.weight
        outsider.grad.view(-1)[0] = INF
        scaler.unscale_(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        expected = torch.nn.utils.clip_grad_norm_(params, INF)
        decisions.append(
            (bool(scaler.get_isfinite()), float(scaler.get_global_norm()), float(expected))
        )
        scaler.step(optimizer)
        scaler.update()
    return decisions


@pytest.mark.parametrize("registered", [False, True], ids=["discovered", "registered"])
def test_first_decision_ignores_input_gradients(registered):
    """Oracle: iteration 0 decides as iteration 1 does (and as the reference, whose norm covers
    the optimizers' parameters): finite, with the norm of the optimizer's gradients."""
    model = TinyNet()
    optimizer = sgd(model)
    kwargs = {"optimizers": [optimizer]} if registered else {}
    decisions = first_two_decisions(
        model, optimizer, cstorch.amp.GradScaler(**DLS, **kwargs), "input"
    )
    for isfinite, norm, expected in decisions:
        assert isfinite
        assert norm == pytest.approx(expected, rel=1e-6)


def test_first_decision_with_registered_optimizers_ignores_parameters_of_no_optimizer():
    """``fc1`` requires grad but is in no optimizer, and ``optimizers=`` names them all."""
    model = TinyNet()
    optimizer = torch.optim.SGD([*model.fc2.parameters(), *model.unused.parameters()], lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS, optimizers=[optimizer])
    for isfinite, norm, expected in first_two_decisions(model, optimizer, scaler, "parameter"):
        assert isfinite
        assert norm == pytest.approx(expected, rel=1e-6)


# ------------------------------------------------- 4. step/unscale_ without scale()


def call(method: str, scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    if method == "clip_gradients_and_return_isfinite":
        scaler.clip_gradients_and_return_isfinite([optimizer])
    else:
        getattr(scaler, method)(optimizer)


@pytest.mark.parametrize("method", ["step", "unscale_", "clip_gradients_and_return_isfinite"])
@pytest.mark.parametrize("when", ["first-iteration", "after-update"])
@pytest.mark.parametrize(
    "kwargs", [DLS, GCC, {"loss_scale": 4.0}], ids=["dls", "dls-gcc", "static-4"]
)
def test_without_scale_since_the_last_update_raises(kwargs, when, method):
    """Gradients from an unscaled ``loss.backward()``: unscaling them would divide them by the
    scale. A RuntimeError saying to call ``scale(loss).backward()`` first; nothing changes, and
    a proper iteration afterwards works.
    """
    model = TinyNet()
    optimizer = sgd(model)
    scaler = cstorch.amp.GradScaler(**kwargs)
    if when == "after-update":
        iteration(scaler, model, optimizer, 0)
    optimizer.zero_grad()
    loss_of(model, 1).backward()
    params, grads = parameters_of(model), [g.clone() for g in grads_with_values(model)]
    state = scaler.state_dict()
    with pytest.raises(RuntimeError, match=r"scale\(loss\)\.backward\(\) first"):
        call(method, scaler, optimizer)
    assert_tensors_equal(params, parameters_of(model))
    assert_tensors_equal(grads, grads_with_values(model))
    assert deep_equal(state, scaler.state_dict())
    iteration(scaler, model, optimizer, 3)  # a finite step
    assert bool(scaler.get_isfinite())
    assert not deep_equal(params, parameters_of(model))


@pytest.mark.parametrize("kwargs", [{}, {"loss_scale": 1.0}], ids=["default", "static-1"])
def test_static_scale_of_one_needs_no_scale_call(kwargs):
    """Static 1.0 is exempt: ``loss.backward()``, ``unscale_``, ``step``, ``update`` is plain
    training. Oracle: plain torch, bit for bit."""
    reference, model = TinyNet(), TinyNet()
    reference_opt, optimizer = sgd(reference), sgd(model)
    scaler = cstorch.amp.GradScaler(**kwargs)
    for step in range(3):
        reference_opt.zero_grad()
        loss_of(reference, step).backward()
        reference_opt.step()
        optimizer.zero_grad()
        loss_of(model, step).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
    assert_tensors_equal(parameters_of(reference), parameters_of(model))
