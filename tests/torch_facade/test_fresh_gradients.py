"""Fresh gradients (issue #10): every ``.grad`` is read where torch keeps it, never replaced.

Oracle: the same loop in plain torch without any loss scaling. Every scale here is a power of
two, so scaling and unscaling are exact and a facade run must reproduce the plain run bit for
bit: parameters, optimizer state and the gradients the optimizer read. Skipped steps are checked
against snapshots taken just before the call (bit-identical parameters and optimizer state).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from facade_helpers import (
    COMPILE_EVENT,
    DLS,
    INF,
    NAN,
    TRACE_EVENT,
    TinyNet,
    assert_tensors_equal,
    deep_equal,
    jax_compile_events,
    loss_of,
    optimizer_snapshot,
    parameters_of,
)

import torch_facade as cstorch

pytestmark = [
    pytest.mark.filterwarnings("ignore:GradScaler is unscaling gradients"),
    pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True"),
]

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
}
# torch 2.13 on the CPU has a fused kernel for every one of them but RMSprop (checked by
# test_fused_support_on_this_torch below, so a torch upgrade that adds it is noticed).
FUSED_ON_CPU = ("sgd", "adam", "adamw", "adagrad")

STEPS = 9
LATE_STEP = 4  # the late parameter's first gradient
# step -> (parameter name, value written into its gradient after backward)
FAULTS: dict[int, tuple[str, float]] = {
    0: ("fc2.weight", INF),  # before any optimizer state exists
    3: ("fc1.bias", NAN),
    4: ("late", -INF),  # the late parameter's very first gradient: no state may appear
    7: ("fc1.weight", NAN),  # every parameter has state: fused kernels get found_inf
}


class LateNet(torch.nn.Module):
    """TinyNet plus a parameter that the loss reaches only from ``LATE_STEP`` on."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TinyNet()
        self.late = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 3))

    def loss(self, step: int) -> torch.Tensor:
        loss = loss_of(self.net, step)
        if step >= LATE_STEP:
            loss = loss + 0.25 * (self.late * self.net.fc2(self.late).sum()).square().sum()
        return loss

    def named(self, name: str) -> torch.Tensor:
        return self.late if name == "late" else self.net.get_parameter(name)


def make_optimizer(name: str, fused: bool, model: LateNet) -> torch.optim.Optimizer:
    """Three param groups of different learning rates: the unused layer is in the second, the
    late parameter alone in the third (torch 2.13's fused SGD with momentum fails, in plain
    torch too, on a group where some parameters have a momentum buffer and others not yet).
    """
    cls, kwargs = OPTIMIZERS[name]
    groups = [
        {"params": model.net.fc1.parameters()},
        {
            "params": [*model.net.fc2.parameters(), *model.net.unused.parameters()],
            "lr": kwargs["lr"] / 2,
        },
        {"params": [model.late], "lr": kwargs["lr"] * 2},
    ]
    return cls(groups, **kwargs, **({"fused": True} if fused else {}))


def optimizer_cases() -> list[Any]:
    return [
        pytest.param(name, fused, id=f"{name}-{'fused' if fused else 'foreach'}")
        for name in OPTIMIZERS
        for fused in (False, True)
        if not fused or name in FUSED_ON_CPU
    ]


def grads_of(model: torch.nn.Module) -> list[torch.Tensor | None]:
    return [p.grad for p in model.parameters()]


def assert_grads_equal(expected: list[torch.Tensor | None], actual: list[Any]) -> None:
    assert [g is None for g in actual] == [g is None for g in expected]
    assert_tensors_equal(
        [g for g in expected if g is not None], [g for g in actual if g is not None]
    )


def test_fused_support_on_this_torch():
    """The case list above is what this torch offers: fused on the CPU for all but RMSprop."""
    param = torch.nn.Parameter(torch.ones(2))
    for name, (cls, kwargs) in OPTIMIZERS.items():
        if name in FUSED_ON_CPU:
            cls([param], **kwargs, fused=True)
        else:
            with pytest.raises(TypeError, match="fused"):
                cls([param], **kwargs, fused=True)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
@pytest.mark.parametrize(("name", "fused"), optimizer_cases())
def test_fresh_gradients_match_plain_torch_bit_for_bit(name, fused, set_to_none):
    """Two groups, a parameter without gradients, one whose first gradient comes late, skips.

    Oracle: plain torch, in lockstep, skipping the faulty steps. At every finite step the
    gradients the facade leaves (the very tensors held since backward) equal plain torch's; at
    the end parameters and the whole optimizer state are bit-identical to plain torch's.
    """
    reference, model = LateNet(), LateNet()
    reference_opt = make_optimizer(name, fused, reference)
    optimizer = make_optimizer(name, fused, model)
    scaler = cstorch.amp.GradScaler(**DLS)
    first_held: list[torch.Tensor | None] | None = None

    for step in range(STEPS):
        fault = FAULTS.get(step)
        optimizer.zero_grad(set_to_none=set_to_none)
        scaler.scale(model.loss(step)).backward()
        held = grads_of(model)
        if not set_to_none and step >= LATE_STEP:
            # Zeroed in place: the tensors are the ones of the late parameter's first gradient.
            first_held = first_held or held
            assert all(a is b for a, b in zip(first_held, held, strict=True))
        if fault is not None:
            target, value = fault
            model.named(target).grad.view(-1)[0] = value
        params_before = parameters_of(model)
        state_before = optimizer_snapshot(optimizer)

        if fault is None:
            reference_opt.zero_grad(set_to_none=set_to_none)
            reference.loss(step).backward()
        if step % 2:
            scaler.unscale_(optimizer)
            if fault is None:  # held references already see the unscaled gradients
                assert_grads_equal(grads_of(reference), held)
        scaler.step(optimizer)
        scaler.update()

        # Never replaced: the tensors held since backward are still the parameters' gradients.
        assert all(p.grad is g for p, g in zip(model.parameters(), held, strict=True))
        assert bool(scaler.get_isfinite()) is (fault is None)
        if fault is None:
            assert_grads_equal(grads_of(reference), held)
            reference_opt.step()
        else:
            assert_tensors_equal(params_before, model.parameters())
            assert deep_equal(state_before, optimizer.state_dict())
        assert model.net.unused.weight.grad is None and model.net.unused.bias.grad is None

    assert int(scaler.get_num_skipped_steps()) == len(FAULTS)
    assert float(scaler.get_scale()) == DLS["init_scale"] / 2 ** len(FAULTS)
    assert_tensors_equal(parameters_of(reference), parameters_of(model))
    assert deep_equal(reference_opt.state_dict(), optimizer.state_dict())
    # The late parameter did move, and the unused layer has no state (Adagrad makes its state
    # in the constructor, for every parameter).
    assert not torch.equal(model.late.detach(), torch.linspace(-1.0, 1.0, 3))
    if name != "adagrad":
        assert all(not optimizer.state.get(p) for p in model.net.unused.parameters())


def test_late_parameter_first_gradient_on_a_skipped_step_creates_no_state():
    """Adam's state for a parameter appears at its first *applied* step, as in plain torch."""
    model = LateNet()
    optimizer = make_optimizer("adam", True, model)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(LATE_STEP + 1):
        optimizer.zero_grad()
        scaler.scale(model.loss(step)).backward()
        if step == LATE_STEP:
            model.late.grad[0] = NAN
        scaler.step(optimizer)
        scaler.update()
        assert model.late not in optimizer.state or not optimizer.state[model.late]
    assert optimizer.state[model.net.fc1.weight]["step"] == LATE_STEP


# JAX without x64 reads float64 gradients as float32 (the norm is float32 anyway) and says so.
@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64")
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_module_to_dtype_mid_training(name, dtype, set_to_none):
    """``module.to(dtype)`` after two steps swaps ``.data`` of parameters and gradients.

    Oracle: plain torch doing the same conversion; an overflow after the conversion still skips.
    (Adam is left out: its float32 moments no longer match the parameters, in plain torch too.)
    """
    reference, model = TinyNet(), TinyNet()
    cls, kwargs = OPTIMIZERS[name]
    reference_opt, optimizer = (
        cls(reference.parameters(), **kwargs),
        cls(model.parameters(), **kwargs),
    )
    scaler = cstorch.amp.GradScaler(**DLS)
    overflow_step = 3
    for step in range(6):
        if step == 2:
            reference.to(dtype)
            model.to(dtype)
        if step != overflow_step:
            reference_opt.zero_grad(set_to_none=set_to_none)
            loss_of(reference, step).float().backward()
            reference_opt.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        scaler.scale(loss_of(model, step)).backward()
        if step == overflow_step:
            model.fc2.bias.grad[0] = NAN
        params_before = parameters_of(model)
        scaler.step(optimizer)
        scaler.update()
        if step == overflow_step:
            assert_tensors_equal(params_before, model.parameters())
        for param in model.parameters():
            assert param.grad is None or param.grad.dtype is param.dtype
    assert model.fc1.weight.dtype is dtype
    assert int(scaler.get_num_skipped_steps()) == 1
    assert_tensors_equal(parameters_of(reference), parameters_of(model))
    assert deep_equal(reference_opt.state_dict(), optimizer.state_dict())


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_backward_with_create_graph_matches_plain_torch(fused):
    """``scaler.scale(loss).backward(create_graph=True)`` leaves gradients that require grad.

    Oracle: ``loss.backward(create_graph=True)`` in plain torch; an overflow still skips.
    """
    reference, model = TinyNet(), TinyNet()
    reference_opt = torch.optim.Adam(reference.parameters(), lr=0.01, fused=fused)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(5):
        if step != 2:
            reference_opt.zero_grad()
            loss_of(reference, step).backward(create_graph=True)
            reference_opt.step()
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward(create_graph=True)
        assert model.fc1.weight.grad.requires_grad
        if step == 2:
            with torch.no_grad():
                model.fc1.weight.grad[0, 0] = INF
        params_before = parameters_of(model)
        scaler.step(optimizer)
        scaler.update()
        if step == 2:
            assert_tensors_equal(params_before, model.parameters())
    assert int(scaler.get_num_skipped_steps()) == 1
    assert_tensors_equal(parameters_of(reference), parameters_of(model))


def test_gradient_penalty_recipe_matches_plain_torch():
    """torch's AMP gradient-penalty recipe: ``autograd.grad`` of the scaled loss with
    ``create_graph=True``, unscaled by hand with ``1 / get_scale()``, then a second scaled
    backward. Oracle: the same penalty in plain torch (power-of-two scales are exact).
    """

    def penalised(model: torch.nn.Module, step: int, scaler: Any | None) -> torch.Tensor:
        params = [p for p in model.parameters() if p is not model.unused.weight]
        params = [p for p in params if p is not model.unused.bias]
        loss = loss_of(model, step)
        if scaler is None:
            grads = torch.autograd.grad(loss, params, create_graph=True)
        else:
            scaled = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)
            grads = [g * (1.0 / scaler.get_scale()) for g in scaled]
        return loss + 0.1 * sum(g.square().sum() for g in grads)

    reference, model = TinyNet(), TinyNet()
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(4):
        reference_opt.zero_grad()
        penalised(reference, step, None).backward()
        reference_opt.step()
        optimizer.zero_grad()
        scaler.scale(penalised(model, step, scaler)).backward()
        scaler.unscale_(optimizer)
        assert_grads_equal(grads_of(reference), grads_of(model))
        scaler.step(optimizer)
        scaler.update()
    assert int(scaler.get_num_skipped_steps()) == 0
    assert_tensors_equal(parameters_of(reference), parameters_of(model))


def test_no_compilation_over_40_steps_alternating_set_to_none():
    """After a warm-up, 40 steps that alternate ``zero_grad(set_to_none=...)``, explicit and
    implicit unscaling, fused and non-fused steps and overflows compile and trace nothing.
    """
    # A configuration of its own, so that the warm-up really compiles (the listener works).
    config = {"loss_scale": "dynamic", "init_scale": 2.0**11, "steps_per_increase": 4}
    model = TinyNet()
    fused = torch.optim.Adam(model.fc1.parameters(), lr=0.01, fused=True)
    plain = torch.optim.SGD([*model.fc2.parameters(), *model.unused.parameters()], lr=0.1)
    scaler = cstorch.amp.GradScaler(**config)

    def iteration(step: int) -> None:
        for optimizer in (fused, plain):
            optimizer.zero_grad(set_to_none=step % 2 == 0)
        scaler.scale(loss_of(model, step)).backward()
        if step % 5 == 3:
            model.fc2.weight.grad[0, 0] = INF
        if step % 3 == 1:
            scaler.unscale_(plain)
        scaler.step(fused)
        scaler.step(plain)
        scaler.update()

    with jax_compile_events() as warm_up:
        for step in range(4):  # both zero_grad modes, both unscale paths, an overflow
            iteration(step)
    assert COMPILE_EVENT in warm_up
    with jax_compile_events() as events:
        for step in range(4, 44):
            iteration(step)
    assert events.count(COMPILE_EVENT) == 0, events
    assert events.count(TRACE_EVENT) == 0, events
    assert int(scaler.get_num_skipped_steps()) == 2 * sum(s % 5 == 3 for s in range(44))


@pytest.mark.parametrize("create_graph", [False, True])
def test_gradients_that_require_grad_are_multiplied_outside_autograd(create_graph, monkeypatch):
    """The gradients a decision just read are multiplied in place under ``no_grad`` exactly when
    one of them requires grad (``create_graph=True``): the multiply is then not recorded in
    their graph, and otherwise the ``no_grad`` context is not paid for."""
    from torch_facade.amp._engine import _gradients

    reads = []
    original = _gradients.multiply_read_
    monkeypatch.setattr(
        _gradients, "multiply_read_", lambda read, m: reads.append(read.graph) or original(read, m)
    )
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(4):  # the first two reads are full ones, the last two read a remembered one
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward(create_graph=create_graph)
        grad_fn = model.fc1.weight.grad.grad_fn
        scaler.step(optimizer)
        scaler.update()
        assert model.fc1.weight.grad.grad_fn is grad_fn
    assert reads[2:] == [create_graph] * 2  # (a full read always multiplies under no_grad)


def test_the_multiply_of_a_read_under_no_grad_records_nothing():
    """``torch._foreach_mul_`` (the multiply for dtypes the CPU loss-scaling kernel does not take,
    and on other devices) would record itself in a gradient's graph; under ``no_grad`` it does
    not, and the values are multiplied."""
    from torch_facade.amp._engine import _gradients

    x = torch.ones(3, dtype=torch.complex64, requires_grad=True)
    (grad,) = torch.autograd.grad((x * x).sum().real, x, create_graph=True)
    grad_fn, expected = grad.grad_fn, grad.detach() * 0.5
    read = _gradients.GradientRead(
        (), (), frozenset(), grad.device, (), [grad], frozenset({grad.dtype}), None, True
    )
    _gradients.multiply_read_(read, torch.tensor(0.5))
    assert grad.grad_fn is grad_fn
    assert torch.equal(grad.detach(), expected)
