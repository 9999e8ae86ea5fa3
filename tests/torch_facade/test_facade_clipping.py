"""Gradient clipping: DLS + GCC in the scaler, and optimizer_step's clipping (SPEC sections 4, 8).

Oracles: torch's own ``clip_grad_norm_`` / ``clip_grad_value_`` on the unscaled gradients of an
unscaled run, and a hand-written manual loop.
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
    poison_on,
)

import torch_facade as cstorch

MAX_NORM = 0.05  # well below the gradient norms of the tiny model: clipping really happens


def oracle_grads(step: int, clip) -> list[torch.Tensor]:
    """The unscaled gradients of ``batch(step)``, clipped by torch."""
    model = TinyNet()
    loss_of(model, step).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    clip(params)
    return [p.grad for p in params]


def test_unclipped_norm_is_larger_than_the_clip():
    model = TinyNet()
    loss_of(model, 0).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), INF)
    assert float(norm) > 4 * MAX_NORM


@pytest.mark.parametrize("explicit_unscale", [False, True])
def test_dls_gcc_clips_like_unscale_then_clip_grad_norm(explicit_unscale):
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS, max_gradient_norm=MAX_NORM)
    scaler.scale(loss_of(model, 0)).backward()
    if explicit_unscale:
        scaler.unscale_(optimizer)
        # As in the reference, gradients read between unscale_ and step are not clipped yet.
        unclipped = oracle_grads(0, lambda params: None)
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        torch.testing.assert_close(grads, unclipped, rtol=0, atol=0)
    params_before = parameters_of(model)
    scaler.step(optimizer)
    scaler.update()

    expected = oracle_grads(0, lambda params: torch.nn.utils.clip_grad_norm_(params, MAX_NORM))
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    torch.testing.assert_close(grads, expected, rtol=1e-6, atol=1e-9)
    total = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    torch.testing.assert_close(float(total), MAX_NORM, rtol=1e-5, atol=0)
    # SGD applied the clipped gradients.
    stepped = [p for p in model.parameters() if p.grad is not None]
    before = [
        b for b, p in zip(params_before, model.parameters(), strict=True) if p.grad is not None
    ]
    torch.testing.assert_close(
        stepped, [b - 0.1 * g for b, g in zip(before, expected, strict=True)], rtol=0, atol=1e-7
    )
    # The reported norm is the one before clipping.
    unclipped_norm = torch.nn.utils.get_total_norm(oracle_grads(0, lambda params: None))
    torch.testing.assert_close(scaler.get_global_norm(), unclipped_norm, rtol=1e-6, atol=0)


def test_dls_gcc_with_a_fused_optimizer_matches_torch_clipping():
    """Fused Adam gets the clip folded into ``grad_scale``; the result matches torch."""
    reference, model = TinyNet(), TinyNet()
    reference_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    scaler = cstorch.amp.GradScaler(**DLS, max_gradient_norm=MAX_NORM)
    for step in range(5):
        if step != 2:
            reference_opt.zero_grad()
            loss_of(reference, step).backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
            reference_opt.step()
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        if step == 2:
            model.fc1.bias.grad[0] = INF
        scaler.step(optimizer)
        scaler.update()
    assert int(scaler.get_num_skipped_steps()) == 1
    torch.testing.assert_close(parameters_of(model), parameters_of(reference), rtol=1e-5, atol=1e-6)


def test_overflow_with_gcc_skips_and_leaves_zero_gradients_finite():
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = cstorch.amp.GradScaler(**DLS, max_gradient_norm=MAX_NORM)
    scaler.scale(loss_of(model, 0)).backward()
    model.fc1.weight.grad[0, 0] = INF
    params = parameters_of(model)
    scaler.step(optimizer)
    scaler.update()
    assert_tensors_equal(params, model.parameters())
    assert optimizer.state_dict()["state"] == {}
    assert not torch.isnan(model.fc2.weight.grad).any()  # no NaN spread by a clip coefficient


def two_optimizers(model):
    return (
        torch.optim.SGD(model.fc1.parameters(), lr=0.1, momentum=0.5),
        torch.optim.Adam([*model.fc2.parameters(), *model.unused.parameters()], lr=0.01),
    )


def manual_loop(scaler_kwargs, clip, steps, poison_step=None):
    """The documented loop by hand, clipping with torch over both optimizers' parameters."""
    model = TinyNet()
    optimizers = two_optimizers(model)
    scaler = cstorch.amp.GradScaler(**scaler_kwargs)
    for step in range(steps):
        scaler.scale(loss_of(model, step)).backward()
        if step == poison_step:
            model.fc2.weight.grad[0, 0] = INF
        for optimizer in optimizers:
            scaler.unscale_(optimizer)
        clip([p for o in optimizers for g in o.param_groups for p in g["params"]])
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update()
        for optimizer in optimizers:
            optimizer.zero_grad()
    return model, scaler


CLIPS = {
    "norm": (
        {"max_gradient_norm": MAX_NORM},
        lambda params: torch.nn.utils.clip_grad_norm_(params, MAX_NORM),
    ),
    "value": (
        {"max_gradient_value": 0.02},
        lambda params: torch.nn.utils.clip_grad_value_(params, 0.02),
    ),
}


@pytest.mark.parametrize("scaler_kwargs", [DLS, {"loss_scale": 2.0**4}], ids=["dynamic", "static"])
@pytest.mark.parametrize("clip", CLIPS, ids=list(CLIPS))
def test_optimizer_step_clips_over_all_optimizers_like_the_manual_loop(scaler_kwargs, clip):
    clip_kwargs, torch_clip = CLIPS[clip]
    poison_step = 2 if scaler_kwargs is DLS else None
    expected, expected_scaler = manual_loop(scaler_kwargs, torch_clip, 5, poison_step)

    model = TinyNet()
    optimizers = two_optimizers(model)
    scaler = cstorch.amp.GradScaler(**scaler_kwargs)
    step_holder = [0]
    poison_on(model.fc2.weight, {poison_step}, step_holder)
    for step in range(5):
        step_holder[0] = step
        cstorch.amp.optimizer_step(loss_of(model, step), list(optimizers), scaler, **clip_kwargs)
    torch.testing.assert_close(parameters_of(model), parameters_of(expected), rtol=1e-5, atol=1e-7)
    assert scaler.state_dict().keys() == expected_scaler.state_dict().keys()
    for key, value in expected_scaler.state_dict().items():
        assert torch.equal(scaler.state_dict()[key], value), key


def test_optimizer_step_clip_differs_from_no_clip():
    """The clip has an effect in these tests (so the comparisons above can fail)."""
    clipped, _ = manual_loop(DLS, CLIPS["norm"][1], 2)
    unclipped, _ = manual_loop(DLS, lambda params: None, 2)
    assert not all(
        torch.allclose(a, b, rtol=1e-3)
        for a, b in zip(parameters_of(clipped), parameters_of(unclipped), strict=True)
    )


def test_optimizer_step_with_scaler_gcc_and_norm_clip_uses_both():
    """Scaler GCC (0.05) and optimizer_step's clip_grad_norm_ (0.02) both apply, as in the
    reference: ``unscale_`` takes the decision and the GCC coefficient from the unclipped norm,
    ``clip_grad_norm_`` clips to 0.02, and ``step`` then applies the GCC coefficient."""
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = cstorch.amp.GradScaler(**DLS, max_gradient_norm=MAX_NORM)
    params_before = parameters_of(model)
    cstorch.amp.optimizer_step(loss_of(model, 0), optimizer, scaler, max_gradient_norm=0.02)
    moved = torch.cat(
        [(a - b).flatten() for a, b in zip(params_before, parameters_of(model), strict=True)]
    )
    unclipped = float(
        torch.linalg.vector_norm(
            torch.cat([g.flatten() for g in oracle_grads(0, lambda params: None)])
        )
    )
    expected = 0.02 * min(MAX_NORM / (unclipped + 1e-6), 1.0)
    torch.testing.assert_close(float(torch.linalg.vector_norm(moved)), expected, rtol=1e-4, atol=0)
