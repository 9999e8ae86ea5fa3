"""Every supported torch optimizer through the facade: finite steps and overflow steps.

Oracles: a plain torch run of the same model without any loss scaling (finite steps), and the
parameters and deep-copied ``optimizer.state_dict()`` from just before the call (overflow
steps, which must leave everything bit-identical).
"""

from __future__ import annotations

import pytest
import torch
from facade_helpers import (
    DLS,
    INF,
    NAN,
    TinyNet,
    assert_tensors_equal,
    deep_equal,
    loss_of,
    one_step,
    optimizer_snapshot,
    parameters_of,
    plain_step,
    state_tensor_count,
)

import torch_facade as cstorch

pytestmark = pytest.mark.filterwarnings("ignore:GradScaler is unscaling gradients")

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "sgd-nesterov": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    "adam": (torch.optim.Adam, {"lr": 0.01}),
    "adam-amsgrad": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
}
IMPLEMENTATIONS = {
    "foreach": {"foreach": True},
    "for-loop": {"foreach": False},
    "fused": {"fused": True},
}
# Steps 0 and 3 overflow: the first before any optimizer state exists, the second after.
STEPS = 6
OVERFLOW_STEPS = (0, 3)


def make_optimizer(
    name: str, implementation: str, model: torch.nn.Module, two_groups: bool = True
) -> torch.optim.Optimizer:
    """The optimizer under test, with two param groups of different learning rates."""
    cls, kwargs = OPTIMIZERS[name]
    kwargs = {**kwargs, **IMPLEMENTATIONS[implementation]}
    if next(model.parameters()).dtype is not torch.float32 and cls is not torch.optim.SGD:
        kwargs["eps"] = 1e-3  # the default underflows to 0 in float16 and divides by zero
    if two_groups:
        params = [
            {"params": model.fc1.parameters()},
            {
                "params": [*model.fc2.parameters(), *model.unused.parameters()],
                "lr": kwargs["lr"] / 2,
            },
        ]
    else:
        params = model.parameters()
    try:
        return cls(params, **kwargs)
    except (TypeError, RuntimeError, ValueError) as err:
        pytest.skip(f"{cls.__name__}({implementation}) is not available here: {err}")


def cases(dtypes: tuple[torch.dtype, ...], implementations: tuple[str, ...]) -> list:
    return [
        pytest.param(name, impl, dtype, id=f"{name}-{impl}-{str(dtype).removeprefix('torch.')}")
        for dtype in dtypes
        for name in OPTIMIZERS
        for impl in implementations
        if not (impl == "fused" and name == "rmsprop")  # torch has no fused RMSprop
    ]


ALL_CASES = cases((torch.float32,), tuple(IMPLEMENTATIONS)) + cases(
    (torch.float16, torch.bfloat16), ("foreach", "fused")
)


class StepSpy:
    """Records how the facade called ``optimizer.step``: ``(grad_scale, found_inf)`` or None."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.calls: list[tuple[float, float] | None] = []
        optimizer.register_step_pre_hook(self._hook)

    def _hook(self, optimizer, args, kwargs):
        grad_scale = getattr(optimizer, "grad_scale", None)
        found_inf = getattr(optimizer, "found_inf", None)
        if grad_scale is None:
            self.calls.append(None)
        else:
            self.calls.append((float(grad_scale), float(found_inf)))


def run_facade_against_plain(name: str, implementation: str, dtype: torch.dtype) -> None:
    reference, model = TinyNet(dtype), TinyNet(dtype)
    reference_opt = make_optimizer(name, implementation, reference)
    optimizer = make_optimizer(name, implementation, model)
    spy = StepSpy(optimizer)
    scaler = cstorch.amp.GradScaler(**DLS)
    initial = parameters_of(model)
    unused = list(model.unused.parameters())

    for step in range(STEPS):
        overflow = step in OVERFLOW_STEPS
        if not overflow:
            plain_step(reference, reference_opt, step)
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        if overflow:
            model.fc2.weight.grad[0, 1] = INF if step == 0 else NAN
        params_before = parameters_of(model)
        state_before = optimizer_snapshot(optimizer)
        scale_before = scaler.get_scale()
        skipped_before = int(scaler.get_num_skipped_steps())

        scaler.step(optimizer)
        scaler.update()

        assert bool(scaler.get_isfinite()) is not overflow
        if overflow:
            assert_tensors_equal(params_before, model.parameters())
            assert deep_equal(state_before, optimizer.state_dict())
            assert int(scaler.get_num_skipped_steps()) == skipped_before + 1
            assert float(scaler.get_scale()) == float(scale_before) / 2
        else:
            assert int(scaler.get_num_skipped_steps()) == skipped_before
            assert float(scaler.get_scale()) == float(scale_before)
        assert all(p.grad is None for p in unused)

    # Finite steps match the run without scaling; the parameters did move and stayed finite.
    assert all(torch.isfinite(p).all() for p in model.parameters())
    torch.testing.assert_close(
        parameters_of(model), parameters_of(reference), **tolerance(dtype), equal_nan=False
    )
    assert any(not torch.equal(a, b) for a, b in zip(initial, model.parameters(), strict=True))
    # The parameter that never got a gradient has no state and never moved, as in plain torch.
    assert all(not optimizer.state.get(p) or name == "adagrad" for p in unused)
    assert_tensors_equal(initial[-len(unused) :], unused)
    assert state_tensor_count(optimizer) == state_tensor_count(reference_opt)

    # Which code path each step took: no call at all is the host-side skip; a fused optimizer
    # gets (grad_scale, found_inf) once its state exists (at once if it needs none).
    fused = implementation == "fused"
    # Plain SGD needs no state; Adagrad creates its state in its constructor. The others get
    # their state in the first applied step (step 1).
    state_from_the_start = name in ("sgd", "adagrad")
    expected = []
    for step in range(STEPS):
        overflow = step in OVERFLOW_STEPS
        scale = DLS["init_scale"] / 2 ** sum(1 for s in OVERFLOW_STEPS if s < step)
        takes_fused_path = fused and (state_from_the_start or step > 1)
        if takes_fused_path:
            expected.append((scale, float(overflow)))
        elif not overflow:
            expected.append(None)
    assert spy.calls == expected


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    if dtype is torch.float32:
        return {"rtol": 1e-6, "atol": 1e-7}
    return {"rtol": 1e-3 if dtype is torch.float16 else 1e-2, "atol": 1e-5}


@pytest.mark.parametrize(("name", "implementation", "dtype"), ALL_CASES)
def test_optimizer_matches_unscaled_training_and_skips_overflow_bit_exactly(
    name, implementation, dtype
):
    run_facade_against_plain(name, implementation, dtype)


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_overflow_from_a_loss_that_overflows_float16(implementation):
    """An inf that comes from the arithmetic itself (not written by hand) skips the step."""
    model = TinyNet(torch.float16)
    optimizer = make_optimizer("adam", implementation, model)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=2.0**12)
    for step in range(3):  # make the optimizer state exist, so fused takes its fused path
        one_step(scaler, model, optimizer, step)
    params_before = parameters_of(model)
    state_before = optimizer_snapshot(optimizer)
    skipped = int(scaler.get_num_skipped_steps())

    optimizer.zero_grad()
    huge = loss_of(model, 3) * 32.0  # finite in float16; 32 * 2**12 is not
    assert torch.isfinite(huge)
    scaler.scale(huge).backward()
    assert not all(torch.isfinite(p.grad).all() for p in model.fc1.parameters())
    scaler.step(optimizer)
    scaler.update()

    assert_tensors_equal(params_before, model.parameters())
    assert deep_equal(state_before, optimizer.state_dict())
    assert int(scaler.get_num_skipped_steps()) == skipped + 1
    assert skipped == 0 and all(torch.isfinite(p).all() for p in model.parameters())


def test_fused_adam_skip_leaves_step_counters_unchanged_through_many_overflows():
    """The fused path increments and decrements step counters; they must end where they began."""
    model = TinyNet()
    optimizer = make_optimizer("adamw", "fused", model)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(2):
        one_step(scaler, model, optimizer, step)
    steps = [float(s["step"]) for s in optimizer.state.values()]
    assert steps == [2.0] * 4
    state_before = optimizer_snapshot(optimizer)
    for step in range(2, 12):
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        model.fc1.bias.grad[0] = -INF
        scaler.step(optimizer)
        scaler.update()
    assert deep_equal(state_before, optimizer.state_dict())
    assert int(scaler.get_num_skipped_steps()) == 10


def test_static_scaling_steps_every_optimizer_as_plain_training():
    """A static power-of-two scale: unscaling is exact, every step is applied."""
    reference, model = TinyNet(), TinyNet()
    reference_opt = make_optimizer("adam", "foreach", reference)
    optimizer = make_optimizer("adam", "foreach", model)
    scaler = cstorch.amp.GradScaler(loss_scale=2.0**6)
    for step in range(3):
        plain_step(reference, reference_opt, step)
        one_step(scaler, model, optimizer, step)
    torch.testing.assert_close(parameters_of(model), parameters_of(reference), rtol=1e-6, atol=1e-7)
    assert scaler.get_scale() == 2.0**6


class StridedNet(torch.nn.Module):
    """Parameters whose memory layout is not contiguous: a transposed matrix, channels-last."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.weight = torch.nn.Parameter(torch.randn(4, 3, generator=generator).t())
        self.conv = torch.nn.Conv2d(2, 4, 3).to(memory_format=torch.channels_last)
        with torch.no_grad():
            for p in self.conv.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))

    def loss(self, step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(1, 2, 5, 5, generator=generator).to(memory_format=torch.channels_last)
        v = torch.randn(4, generator=generator)
        return (self.weight @ v).square().mean() + self.conv(x).square().mean()


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
        lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, fused=True),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=True),
    ],
    ids=["adam-fused", "sgd-fused", "adamw-foreach"],
)
def test_non_contiguous_parameters_keep_their_layout(make):
    """Fused kernels assume a gradient has its parameter's strides; the facade keeps them."""
    reference, model = StridedNet(), StridedNet()
    assert not model.weight.is_contiguous()
    reference_opt, optimizer = make(reference.parameters()), make(model.parameters())
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(5):
        overflow = step == 3
        if not overflow:
            reference_opt.zero_grad()
            reference.loss(step).backward()
            reference_opt.step()
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        scaler.scale(model.loss(step)).backward()
        if overflow:
            model.conv.weight.grad[0, 0, 0, 0] = INF
        scaler.step(optimizer)
        scaler.update()
        for param in model.parameters():
            assert param.grad.stride() == param.stride()
    torch.testing.assert_close(parameters_of(model), parameters_of(reference), rtol=1e-6, atol=1e-7)
