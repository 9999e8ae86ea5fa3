"""cstorch.amp.gradient_range_report: counts from numpy (float16) and ml_dtypes (bfloat16) on
hand-made gradients, names, the scale taken from a GradScaler, clear errors."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

import torch_facade as cstorch

RNG = np.random.default_rng(3)


def make_model() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 2, bias=False))
    for p in model.parameters():
        values = np.sign(RNG.standard_normal(p.shape)) * 2.0 ** RNG.uniform(-45, 20, p.shape)
        p.grad = torch.from_numpy(values.astype(np.float32))
    return model


def numpy_counts(grad: torch.Tensor, dtype: type, scale: float) -> tuple[int, int, int]:
    """(underflows, subnormals, overflows) of ``grad * scale`` cast with numpy / ml_dtypes."""
    values = grad.numpy()
    with np.errstate(over="ignore"):
        rounded = (values * np.float32(scale)).astype(dtype).astype(np.float64)
    smallest_normal = float(ml_dtypes.finfo(dtype).smallest_normal)
    nonzero = values != 0
    return (
        int(np.sum(nonzero & (rounded == 0))),
        int(np.sum(nonzero & (rounded != 0) & (np.abs(rounded) < smallest_normal))),
        int(np.sum(np.isinf(rounded))),
    )


@pytest.mark.parametrize(
    ("half_dtype", "dtype"),
    [("float16", np.float16), (torch.float16, np.float16), ("bfloat16", ml_dtypes.bfloat16)],
)
@pytest.mark.parametrize("scale", [1.0, 2.0**15, 2.0**-3])
def test_counts_per_parameter_match_numpy(half_dtype: object, dtype: type, scale: float) -> None:
    model = make_model()
    report = cstorch.amp.gradient_range_report(model, half_dtype=half_dtype, loss_scale=scale)
    assert list(report.parameters) == ["0.weight", "0.bias", "1.weight"]
    totals = np.zeros(3, int)
    for name, p in model.named_parameters():
        leaf = report.parameters[name]
        expected = numpy_counts(p.grad, dtype, scale)
        assert (leaf.underflows, leaf.subnormals, leaf.overflows) == expected, name
        assert leaf.size == p.numel() and leaf.zeros == 0 and leaf.nonfinite == 0
        totals += expected
    total = report.total
    assert (total.underflows, total.subnormals, total.overflows) == tuple(totals)
    assert report.underflow_fraction == pytest.approx(
        totals[0] / sum(p.numel() for p in model.parameters())
    )


def test_headroom_and_the_scale_of_a_grad_scaler() -> None:
    model = torch.nn.Linear(2, 1)
    model.weight.grad = torch.tensor([[0.5, 1e-9]])
    model.bias.grad = None  # left out
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=2.0**10)
    report = cstorch.amp.gradient_range_report(model, half_dtype="float16", loss_scale=scaler)
    assert report.loss_scale == 2.0**10 and list(report.parameters) == ["weight"]
    # 0.5 * 2**10 = 2**9: six doublings to 2**15 stay below 65504, a seventh overflows.
    assert report.total.headroom == 6.0
    assert report.total.underflows == 0 and report.total.subnormals == 1  # 1e-9 * 2**10 ~ 1e-6


def test_the_current_half_dtype_is_the_default() -> None:
    model = torch.nn.Linear(1, 1, bias=False)
    model.weight.grad = torch.tensor([[2.0**-35]])  # zero in float16, subnormal in cbfloat16
    saved = cstorch.amp.get_half_dtype_str(), cstorch.amp.mixed_precision()
    try:
        cstorch.amp.set_half_dtype("cbfloat16")
        report = cstorch.amp.gradient_range_report([model.weight])
    finally:
        cstorch.amp.set_half_dtype(saved[0])
        cstorch.amp.enable_mixed_precision(saved[1])
    assert report.half_dtype == "cbfloat16" and list(report.parameters) == ["params[0]"]
    assert (report.total.underflows, report.total.subnormals) == (0, 1)
    assert (
        cstorch.amp.gradient_range_report([model.weight], half_dtype="float16").total.underflows
        == 1
    )
    zero = torch.zeros(2, requires_grad=True)
    zero.grad = torch.zeros(2)
    assert math.isinf(cstorch.amp.gradient_range_report([zero]).total.headroom)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (
            (3,),
            {},
            TypeError,
            "parameters must be a torch.nn.Module or an iterable of tensors; got int",
        ),
        (([1.0],), {}, TypeError, r"params\[0\] is float"),
        ((torch.nn.Linear(1, 1),), {}, ValueError, "no parameter has a gradient"),
        (("grad",), {"half_dtype": "float8"}, ValueError, "half_dtype must be one of"),
        (
            ("grad",),
            {"loss_scale": 0.0},
            ValueError,
            "loss_scale must be positive and finite; got 0.0",
        ),
        (
            ("grad",),
            {"loss_scale": torch.ones(2)},
            ValueError,
            r"loss_scale must be 0-d; got shape \(2,\)",
        ),
        (("grad",), {"loss_scale": "2"}, ValueError, "loss_scale must be a positive number"),
    ],
)
def test_bad_arguments_are_named(args: tuple, kwargs: dict, error: type, match: str) -> None:
    if args == ("grad",):
        model = torch.nn.Linear(1, 1)
        model(torch.ones(1, 1)).sum().backward()
        args = (model,)
    with pytest.raises(error, match=match):
        cstorch.amp.gradient_range_report(*args, **kwargs)


@pytest.mark.parametrize(
    ("half_dtype", "headroom", "expected"),
    # The largest gradient is 3.0 (hand-made below): 3 * 2**14 = 49152 <= 65504 (float16),
    # 3 * 2**30 < (2 - 2**-9) * 2**31 (cbfloat16); 3 * 2**126 < bfloat16's largest.
    [("float16", 0, 2.0**14), ("float16", 2, 2.0**12), ("cbfloat16", 1, 2.0**29)],
)
def test_the_report_suggests_a_loss_scale(half_dtype: str, headroom: int, expected: float) -> None:
    model = torch.nn.Linear(3, 1)
    model.weight.grad = torch.tensor([[1e-9, -3.0, 2e-3]])
    model.bias.grad = torch.tensor([0.25])
    report = cstorch.amp.gradient_range_report(
        model, half_dtype=half_dtype, loss_scale=2.0**5, headroom=headroom
    )
    assert report.suggested_loss_scale == expected and report.headroom == headroom
    assert f"suggested loss scale 2^{int(math.log2(expected))}" in str(report)
    again = cstorch.amp.gradient_range_report(model, half_dtype=half_dtype, loss_scale=expected)
    assert again.total.headroom == headroom


@pytest.mark.parametrize("headroom", [-1, 0.5, True])
def test_a_bad_headroom_is_named(headroom: object) -> None:
    model = torch.nn.Linear(1, 1)
    model(torch.ones(1, 1)).sum().backward()
    with pytest.raises(ValueError, match="headroom must be a non-negative integer"):
        cstorch.amp.gradient_range_report(model, headroom=headroom)  # type: ignore[arg-type]
