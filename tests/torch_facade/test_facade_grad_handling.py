"""The facade stays correct whatever the user does with ``.grad`` (SPEC section 3, issue 4).

Oracles: the same loop with plain torch and no scaling, and ``torch.amp.GradScaler`` where its
semantics coincide (an explicit ``unscale_`` modifies the gradient tensors in place).
"""

from __future__ import annotations

import pytest
import torch
from facade_helpers import (
    DLS,
    INF,
    TinyNet,
    assert_tensors_equal,
    loss_of,
    parameters_of,
    plain_step,
)

import torch_facade as cstorch

TIGHT = {"rtol": 1e-6, "atol": 1e-7}


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=0.01)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_either_way_matches_plain_training(set_to_none):
    reference, model = TinyNet(), TinyNet()
    reference_opt, optimizer = adam(reference), adam(model)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(4):
        reference_opt.zero_grad(set_to_none=set_to_none)
        loss_of(reference, step).backward()
        reference_opt.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        scaler.scale(loss_of(model, step)).backward()
        scaler.step(optimizer)
        scaler.update()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None)
        if not set_to_none:  # the gradients zeroed in place are the facade's own tensors
            held = model.fc1.weight.grad
    torch.testing.assert_close(parameters_of(model), parameters_of(reference), **TIGHT)
    if not set_to_none:
        assert model.fc1.weight.grad is held


def test_gradient_accumulation_over_two_backward_passes():
    reference, model = TinyNet(), TinyNet()
    reference_opt, optimizer = adam(reference), adam(model)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(0, 6, 2):
        reference_opt.zero_grad()
        for micro in (step, step + 1):
            loss_of(reference, micro).backward()
        reference_opt.step()
        optimizer.zero_grad()
        for micro in (step, step + 1):
            scaler.scale(loss_of(model, micro)).backward()
        scaler.step(optimizer)
        scaler.update()
    torch.testing.assert_close(parameters_of(model), parameters_of(reference), **TIGHT)


def test_accumulation_into_arena_gradients_with_set_to_none_false():
    """Backward accumulates into the arena views in place; a later overflow still skips."""
    reference, model = TinyNet(), TinyNet()
    reference_opt, optimizer = adam(reference), adam(model)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(0, 6, 2):
        if step != 2:
            reference_opt.zero_grad(set_to_none=False)
            loss_of(reference, step).backward()
            loss_of(reference, step + 1).backward()
            reference_opt.step()
        optimizer.zero_grad(set_to_none=False)
        scaler.scale(loss_of(model, step)).backward()
        if step == 2:
            model.fc2.weight.grad[0, 0] = INF  # overflow in the first micro-batch
        scaler.scale(loss_of(model, step + 1)).backward()
        scaler.step(optimizer)
        scaler.update()
    assert int(scaler.get_num_skipped_steps()) == 1
    torch.testing.assert_close(parameters_of(model), parameters_of(reference), **TIGHT)


@pytest.mark.parametrize("scaler_kind", ["torch", "facade"])
def test_references_held_before_unscale_see_the_unscaled_gradients(scaler_kind):
    """A user clips through their own list of gradients after ``unscale_`` (as torch allows)."""
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    if scaler_kind == "torch":
        scaler = torch.amp.GradScaler("cpu", init_scale=DLS["init_scale"])
    else:
        scaler = cstorch.amp.GradScaler(**DLS)
    reference = TinyNet()
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(3):
        reference_opt.zero_grad()
        loss_of(reference, step).backward()
        for p in reference.parameters():
            if p.grad is not None:
                p.grad.clamp_(-0.01, 0.01)
        reference_opt.step()

        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        scaler.unscale_(optimizer)
        unscaled = [p.grad for p in model.parameters() if p.grad is not None]
        assert all(a is b for a, b in zip(grads, unscaled, strict=True))
        for grad in grads:
            grad.clamp_(-0.01, 0.01)
        scaler.step(optimizer)
        scaler.update()
    torch.testing.assert_close(parameters_of(model), parameters_of(reference), **TIGHT)


def test_references_held_across_steps_with_set_to_none_false():
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)
    scaler.scale(loss_of(model, 0)).backward()
    scaler.step(optimizer)
    scaler.update()
    held = {name: p.grad for name, p in model.named_parameters()}
    optimizer.zero_grad(set_to_none=False)
    scaler.scale(loss_of(model, 1)).backward()
    scaler.unscale_(optimizer)
    oracle = TinyNet()
    with torch.no_grad():
        for p, q in zip(oracle.parameters(), model.parameters(), strict=True):
            p.copy_(q)
    loss_of(oracle, 1).backward()
    for name, p in oracle.named_parameters():
        if p.grad is None:
            assert held[name] is None
        else:
            assert model.get_parameter(name).grad is held[name]
            torch.testing.assert_close(held[name], p.grad, rtol=0, atol=0)


def test_user_replacing_grad_tensors_is_respected():
    """``p.grad = new tensor`` between backward and step: the new tensor is what is stepped."""
    reference, model = TinyNet(), TinyNet()
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(3):
        reference_opt.zero_grad()
        loss_of(reference, step).backward()
        reference.fc1.weight.grad = reference.fc1.weight.grad * 2
        reference_opt.step()
        optimizer.zero_grad(set_to_none=False)
        scaler.scale(loss_of(model, step)).backward()
        model.fc1.weight.grad = model.fc1.weight.grad * 2
        scaler.step(optimizer)
        scaler.update()
    torch.testing.assert_close(parameters_of(model), parameters_of(reference), **TIGHT)


def test_parameter_whose_grad_disappears_does_not_leak_an_old_gradient():
    """A layer used on one step and unused on the next: its stale slot must not count."""
    model = TinyNet()
    optimizer = adam(model)
    scaler = cstorch.amp.GradScaler(**DLS)
    scaler.scale(loss_of(model, 0) + model.unused(torch.ones(1, 2)).sum() * 1e3).backward()
    scaler.step(optimizer)
    scaler.update()
    oracle = TinyNet()
    oracle.load_state_dict(model.state_dict())
    loss_of(oracle, 1).backward()
    expected_norm = torch.nn.utils.get_total_norm(
        [p.grad for p in oracle.parameters() if p.grad is not None]
    )
    unused_before = parameters_of(model.unused)

    optimizer.zero_grad()
    scaler.scale(loss_of(model, 1)).backward()
    assert model.unused.weight.grad is None
    scaler.step(optimizer)
    scaler.update()

    # The norm is that of this step's gradients only (not the 1e3-scaled ones of step 0).
    torch.testing.assert_close(scaler.get_global_norm(), expected_norm, rtol=1e-6, atol=0)
    assert model.unused.weight.grad is None
    # Adam has state for the layer, yet plain torch skips a parameter without a gradient.
    assert_tensors_equal(unused_before, model.unused.parameters())


def test_add_param_group_mid_training():
    reference, model = TinyNet(), TinyNet()
    reference_opt = torch.optim.Adam(reference.fc1.parameters(), lr=0.01)
    optimizer = torch.optim.Adam(model.fc1.parameters(), lr=0.01, fused=True)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(6):
        if step == 2:
            reference_opt.add_param_group({"params": reference.fc2.parameters(), "lr": 0.02})
            optimizer.add_param_group({"params": model.fc2.parameters(), "lr": 0.02})
        overflow = step == 4
        if not overflow:
            plain_step(reference, reference_opt, step)
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        if overflow:
            model.fc2.bias.grad[0] = INF  # in the group added mid-training
        scaler.step(optimizer)
        scaler.update()
    assert int(scaler.get_num_skipped_steps()) == 1
    torch.testing.assert_close(parameters_of(model), parameters_of(reference), **TIGHT)


@pytest.mark.filterwarnings("ignore:GradScaler is unscaling gradients")
@pytest.mark.parametrize("set_to_none", [True, False])
def test_module_to_another_dtype_mid_training(set_to_none):
    """``module.to(dtype)`` converts parameters and gradients in place (``.data`` swaps)."""
    reference, model = TinyNet(), TinyNet()
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(5):
        if step == 2:
            reference.to(torch.bfloat16)
            model.to(torch.bfloat16)
        reference_opt.zero_grad(set_to_none=set_to_none)
        loss_of(reference, step).float().backward()
        reference_opt.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        scaler.scale(loss_of(model, step)).backward()
        scaler.step(optimizer)
        scaler.update()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert p.grad is None or p.grad.dtype is p.dtype
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
    assert model.fc1.weight.dtype is torch.bfloat16
    torch.testing.assert_close(parameters_of(model), parameters_of(reference), rtol=0, atol=0)


def test_grad_data_replaced_in_place_is_seen():
    """``p.grad.data = other`` keeps the tensor object but moves its storage out of the arena."""
    reference, model = TinyNet(), TinyNet()
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(3):
        reference_opt.zero_grad(set_to_none=False)
        loss_of(reference, step).backward()
        reference.fc2.bias.grad.data = reference.fc2.bias.grad.data * 3
        reference_opt.step()
        optimizer.zero_grad(set_to_none=False)
        scaler.scale(loss_of(model, step)).backward()
        model.fc2.bias.grad.data = model.fc2.bias.grad.data * 3
        scaler.step(optimizer)
        scaler.update()
    torch.testing.assert_close(parameters_of(model), parameters_of(reference), **TIGHT)


def test_the_in_place_multiply_rounds_once_from_float32_in_every_dtype():
    """The facade's multiply (torch's loss-scaling kernel on the CPU, ``_foreach_mul_`` for other
    dtypes): ``g * m`` computed in float32 (float64 for float64, complex for complex) and rounded
    once to the gradient's dtype, specials kept; a list mixing a dtype the kernel refuses is
    multiplied once, not partly twice. Oracle: the element-wise product in the wider dtype."""
    from torch_facade.amp._engine import _gradients

    generator = torch.Generator().manual_seed(3)
    multiplier = torch.tensor(1 / 3.0)  # not a power of two: rounding shows

    def gradient(dtype):
        values = torch.randn(64, generator=generator) * 1000
        values[:4] = torch.tensor([INF, -INF, float("nan"), -0.0])
        return values.to(dtype)

    def expected(grad):
        wide = torch.float64 if grad.dtype == torch.float64 else torch.float32
        if grad.is_complex():
            return grad * multiplier
        return (grad.to(wide) * multiplier.to(wide)).to(grad.dtype)

    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
    for group in (dtypes, [*dtypes, torch.complex64]):
        grads = [gradient(d) if d != torch.complex64 else torch.ones(5, dtype=d) for d in group]
        oracle = [expected(g) for g in grads]
        _gradients.multiply_(grads, multiplier)
        assert_tensors_equal(oracle, grads)
