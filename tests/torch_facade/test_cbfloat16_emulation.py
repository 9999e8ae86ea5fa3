"""cbfloat16 numerics for torch models: ``round_to_cbfloat16`` and ``cbfloat16_numerics``."""

from __future__ import annotations

import gc
import math
import weakref

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.nn.utils import parametrize

import torch_facade as cstorch
from hardware import get_format

CBF16 = get_format("cbfloat16")
MAX = (2 - 2**-9) * 2.0**31


def bits(t: torch.Tensor) -> np.ndarray:
    """The float32 bit patterns of a float32 tensor."""
    assert t.dtype == torch.float32
    return t.detach().contiguous().numpy().view(np.uint32)


def on_grid(t: torch.Tensor) -> bool:
    """Whether every element of a float32 tensor is a cbfloat16 value (or NaN)."""
    t = t.detach()
    rounded = cstorch.amp.round_to_cbfloat16(t)
    return bool(
        torch.equal(rounded.isnan(), t.isnan()) and torch.equal(rounded[~t.isnan()], t[~t.isnan()])
    )


def positive_grid() -> np.ndarray:
    """Every finite non-negative cbfloat16 value in increasing order, built from the format's
    definition alone (index = magnitude code): subnormals k * 2**-39, then (1 + m/512) * 2**e."""
    values = [math.ldexp(k, -39) for k in range(512)]
    for e in range(-30, 32):
        values += [math.ldexp(1 + m / 512, e) for m in range(512)]
    return np.asarray(values, np.float64)


# ------------------------------------------------------------------ round_to_cbfloat16


def test_bit_identical_to_hardware_rounding() -> None:
    rng = np.random.default_rng(0)
    random_bits = rng.integers(0, 2**32, 20_000, dtype=np.uint64).astype(np.uint32)
    scales = np.exp2(rng.uniform(-45, 40, 20_000)).astype(np.float32)
    specials = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, MAX, -MAX, 2.0**32, 2.0**-39, 2.0**-40,
         3 * 2.0**-41, 2.0**-30, 2.0**-31 * 1.5, 1e-45, -1e-45, 1.17e-38, 3.4e38],
        np.float32,
    )  # fmt: skip
    x = np.concatenate(
        [
            random_bits.view(np.float32),
            scales * rng.standard_normal(20_000).astype(np.float32),
            specials,
        ]
    )
    got = cstorch.amp.round_to_cbfloat16(torch.from_numpy(x.copy()))
    want = np.asarray(CBF16.round(jnp.asarray(x)))
    np.testing.assert_array_equal(bits(got), want.view(np.uint32))
    assert np.isnan(x).sum() > 10 and (np.abs(x[np.isfinite(x)]) < 2.0**-30).sum() > 100


def test_grid_values_are_fixed_points() -> None:
    grid = positive_grid()
    assert grid[-1] == MAX and grid[1] == 2.0**-39
    for sign in (1.0, -1.0):
        x = torch.tensor(sign * grid, dtype=torch.float32)
        np.testing.assert_array_equal(bits(cstorch.amp.round_to_cbfloat16(x)), bits(x))


def test_midpoints_round_to_even_and_neighbours_to_nearest() -> None:
    grid = positive_grid()
    upper = np.append(grid[1:], 2.0**32)  # the next value above MAX would be 2**32
    mid = (grid + upper) / 2  # exact in float32: 10 significant bits at most
    even = np.where(np.arange(grid.size) % 2 == 0, grid, upper)
    even[-1] = np.inf  # the tie above MAX rounds to the even "2**32": overflow to inf
    mid32 = torch.tensor(mid, dtype=torch.float32)
    assert torch.equal(mid32.double(), torch.tensor(mid))
    round = cstorch.amp.round_to_cbfloat16
    np.testing.assert_array_equal(round(mid32).double().numpy(), even)
    below = torch.nextafter(mid32, torch.tensor(0.0))
    above = torch.nextafter(mid32, torch.tensor(math.inf))
    np.testing.assert_array_equal(round(below).double().numpy(), grid)
    want_above = upper.copy()
    want_above[-1] = np.inf
    np.testing.assert_array_equal(round(above).double().numpy(), want_above)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1 + 2**-10, 1.0),  # a tie: to the even mantissa 1.000000000
        (1 + 3 * 2**-10, 1 + 2**-8),  # a tie: to the even mantissa, upwards
        (1 + 2**-10 + 2**-20, 1 + 2**-9),  # above the tie
        (MAX, MAX),  # the largest value stays
        ((2 - 2**-10) * 2.0**31, math.inf),  # the tie above MAX overflows
        (2.0**32, math.inf),
        (-(2.0**32), -math.inf),
        (2.0**-39, 2.0**-39),  # the smallest subnormal stays
        (2.0**-40, 0.0),  # a tie between 0 and 2**-39: to even, 0
        (1.5 * 2.0**-40, 2.0**-39),
        (3 * 2.0**-40, 2 * 2.0**-39),  # a tie between subnormals 1 and 2 (x 2**-39): to 2
        (2.0**-30 * (1 + 2**-10), 2.0**-30),  # min normal, tie to even
        (65504.0, 65536.0),  # float16's max is not a cbfloat16 value
        (-0.0, -0.0),
    ],
)
def test_hand_checked_values(value: float, expected: float) -> None:
    got = cstorch.amp.round_to_cbfloat16(torch.tensor([value], dtype=torch.float32)).item()
    assert got == expected
    assert math.copysign(1, got) == math.copysign(1, expected)


def test_nan_stays_nan() -> None:
    got = cstorch.amp.round_to_cbfloat16(torch.tensor([math.nan, -math.nan, 1.0]))
    assert got[:2].isnan().all() and got[2] == 1.0


@pytest.mark.parametrize(
    ("dtype", "result_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_result_dtype_is_an_exact_container(dtype: torch.dtype, result_dtype: torch.dtype) -> None:
    x = torch.tensor([65504.0, 1.0, -3.0, 2.0**-20], dtype=torch.float32).to(dtype)
    got = cstorch.amp.round_to_cbfloat16(x)
    assert got.dtype == result_dtype and got.shape == x.shape
    want = CBF16.round(jnp.asarray(x.float().numpy()))
    np.testing.assert_array_equal(got.float().numpy(), np.asarray(want))
    if dtype is torch.float16:
        assert got[0].item() == 65536.0  # would be inf in the float16 proxy


def test_shapes_layouts_and_no_aliasing() -> None:
    base = torch.randn(7, 9)
    for x in (base, base.t(), base[1:, 1:], base[0, 3], torch.zeros(0, 3), torch.randn(2, 3, 4)):
        before = x.clone()
        got = cstorch.amp.round_to_cbfloat16(x)
        assert got.shape == x.shape and got.dtype == torch.float32
        want = np.asarray(CBF16.round(jnp.asarray(x.contiguous().numpy())))
        np.testing.assert_array_equal(got.numpy(), want)
        assert torch.equal(x, before)  # the input is not modified
        if got.numel():
            got.add_(1)  # the result is a fresh tensor
            assert torch.equal(x, before)


@pytest.mark.parametrize(
    "value",
    [[1.0, 2.0], 1.0, np.ones(2, np.float32), torch.ones(2, dtype=torch.int32), torch.ones(2) > 0],
)
def test_rejects_non_floating_tensors(value: object) -> None:
    with pytest.raises(TypeError, match="tensor must be"):
        cstorch.amp.round_to_cbfloat16(value)  # type: ignore[arg-type]


def test_rejects_complex_tensors() -> None:
    with pytest.raises(TypeError, match="floating-point tensor"):
        cstorch.amp.round_to_cbfloat16(torch.ones(2, dtype=torch.complex64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_gradient_is_straight_through(dtype: torch.dtype) -> None:
    x = torch.tensor([1 + 2**-10, 3.0, 1e-15, 7e4], dtype=dtype, requires_grad=True)
    weights = torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=torch.promote_types(dtype, torch.float32))
    (cstorch.amp.round_to_cbfloat16(x) * weights).sum().backward()
    assert x.grad is not None and x.grad.dtype == dtype
    np.testing.assert_array_equal(x.grad.double().numpy(), weights.double().numpy())


def test_gradient_passes_overflowed_values() -> None:
    x = torch.tensor([1e10, -1e10], requires_grad=True)
    y = cstorch.amp.round_to_cbfloat16(x)
    assert torch.isinf(y).all()
    y.backward(torch.tensor([2.0, 3.0]))
    assert x.grad.tolist() == [2.0, 3.0]


# ------------------------------------------------------------------ cbfloat16_numerics


def make_mlp(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 1),
    )


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_pristine(
    model: torch.nn.Module, before: dict[str, torch.Tensor], parameters: list[torch.nn.Parameter]
) -> None:
    """No parametrization, hook or class change is left, and the parameters are the same
    objects with bit-identical values."""
    for m in model.modules():
        assert not parametrize.is_parametrized(m)
        assert type(m).__name__ in {"Sequential", "Linear", "Tanh"}
        assert not m._forward_hooks and not m._forward_pre_hooks
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert torch.equal(after[key], value)
        assert np.array_equal(bits(after[key]), bits(value)), key
    assert all(p is q for p, q in zip(model.parameters(), parameters, strict=True))


def test_weights_and_activations_on_grid() -> None:
    model = make_mlp()
    x = torch.randn(16, 8) * 3
    reference = model(x)
    seen: list[torch.Tensor] = []

    def record(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        seen.extend([*args, output])

    modules = list(model.modules())
    with cstorch.amp.cbfloat16_numerics(model) as same:
        assert same is model
        handles = [m.register_forward_hook(record) for m in modules]
        out = model(x)
        for h in handles:
            h.remove()
        effective = [model[i].weight for i in (0, 2, 4)] + [model[i].bias for i in (0, 2, 4)]
    assert len(seen) == 2 * 6  # input and output of the 5 layers and of the Sequential
    for t in [*seen, *effective]:
        assert t.dtype == torch.float32 and on_grid(t)
    assert not on_grid(x) and not on_grid(model[0].weight)  # the test is not vacuous
    assert torch.equal(seen[0], cstorch.amp.round_to_cbfloat16(x))  # the model's input
    assert not torch.equal(out, reference)
    torch.testing.assert_close(out, reference, atol=0.05, rtol=0.05)


def test_effective_weights_are_the_rounded_master_weights() -> None:
    model = make_mlp()
    masters = [p.detach().clone() for p in model.parameters()]
    with cstorch.amp.cbfloat16_numerics(model):
        for module, master in zip(
            [model[i] for i in (0, 0, 2, 2, 4, 4)], masters, strict=True
        ):  # weight, bias per Linear, in parameters() order
            name = "weight" if master.dim() == 2 else "bias"
            effective = getattr(module, name)
            assert torch.equal(effective, cstorch.amp.round_to_cbfloat16(master))
            assert torch.equal(module.parametrizations[name].original, master)


def test_exit_restores_everything() -> None:
    model = make_mlp()
    before, parameters = snapshot(model), list(model.parameters())
    with cstorch.amp.cbfloat16_numerics(model):
        assert parametrize.is_parametrized(model[0])
        model(torch.randn(4, 8)).sum().backward()
    assert_pristine(model, before, parameters)
    assert all(p.grad is not None for p in model.parameters())


def test_exit_restores_after_an_exception() -> None:
    model = make_mlp()
    before, parameters = snapshot(model), list(model.parameters())
    with pytest.raises(RuntimeError, match="boom"), cstorch.amp.cbfloat16_numerics(model):
        model(torch.randn(2, 8))
        raise RuntimeError("boom")
    assert_pristine(model, before, parameters)


def test_cast_rounds_the_gradient_on_the_way_back() -> None:
    x = torch.ones(4, requires_grad=True)
    upstream = torch.tensor([1 + 2**-10, 1e10, 2.0**-40, -(1 + 3 * 2**-10)])
    cstorch.amp.cast_to_cbfloat16(x).backward(upstream)
    # hand-checked: tie to even, overflow to inf, underflow to zero, tie to even upward
    assert x.grad.tolist() == [1.0, float("inf"), 0.0, -(1 + 2**-8)]
    oracle = np.asarray(get_format("cbfloat16").round(jnp.asarray(upstream.numpy())))
    np.testing.assert_array_equal(x.grad.numpy(), oracle)


def test_round_gradient_is_straight_through_but_cast_gradient_is_rounded() -> None:
    x = torch.ones(2, requires_grad=True)
    (cstorch.amp.round_to_cbfloat16(x) * 1e10).sum().backward()
    assert x.grad.tolist() == [1e10, 1e10]
    x.grad = None
    (cstorch.amp.cast_to_cbfloat16(x) * 1e10).sum().backward()
    assert x.grad.tolist() == [float("inf"), float("inf")]


def test_gradients_reach_master_weights_rounded_at_every_cast() -> None:
    model = make_mlp()
    x = torch.randn(5, 8)
    with cstorch.amp.cbfloat16_numerics(model):
        model(x).sum().backward()
        inner = [p.grad.clone() for p in model.parameters()]
    # The same gradient, computed by hand through explicitly rounded weights and activations.
    model.zero_grad()
    round = cstorch.amp.cast_to_cbfloat16
    h = round(x)
    for i in (0, 2, 4):
        layer = model[i]
        h = round(torch.nn.functional.linear(h, round(layer.weight), round(layer.bias)))
        if i < 4:
            h = round(torch.tanh(h))
    round(h).sum().backward()
    for got, want in zip(inner, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_training_with_dynamic_loss_scaling() -> None:
    assert cstorch.amp.set_half_dtype("cbfloat16") is torch.float16
    model = make_mlp(1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    grad_scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
    assert float(grad_scaler.get_scale()) == 2.0**31  # the cbfloat16 default
    torch.manual_seed(2)
    x = torch.randn(64, 8)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    losses = []
    with cstorch.amp.cbfloat16_numerics(model):
        for _ in range(25):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            grad_scaler.scale(loss).backward()
            grad_scaler.unscale_(optimizer)
            grad_scaler.step(optimizer)
            grad_scaler.update()
            assert bool(grad_scaler.get_isfinite())
            assert all(on_grid(model[i].weight) for i in (0, 2, 4))
            losses.append(loss.item())
    assert int(grad_scaler.get_num_skipped_steps()) == 0
    assert losses[-1] < 0.7 * losses[0]
    # The float32 master weights moved off the grid, and are back as plain parameters.
    assert not on_grid(model[0].weight)
    assert all(not parametrize.is_parametrized(m) for m in model.modules())
    assert cstorch.amp.get_half_dtype_str() == "cbfloat16"


def test_skipped_step_inside_the_context_leaves_master_weights() -> None:
    cstorch.amp.set_half_dtype("cbfloat16")
    model = make_mlp(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    grad_scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
    before, parameters = snapshot(model), list(model.parameters())
    with cstorch.amp.cbfloat16_numerics(model):
        optimizer.zero_grad()
        loss = model(torch.full((2, 8), 1e30)).sum()  # 1e30 -> inf on the cbfloat16 grid
        grad_scaler.scale(loss).backward()
        grad_scaler.step(optimizer)
        grad_scaler.update()
    assert not bool(grad_scaler.get_isfinite())
    assert int(grad_scaler.get_num_skipped_steps()) == 1
    assert_pristine(model, before, parameters)


def test_existing_parametrizations_are_kept() -> None:
    class Double(torch.nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return 2 * w

    layer = torch.nn.Linear(4, 3)
    parametrize.register_parametrization(layer, "weight", Double())
    original = layer.parametrizations.weight.original.detach().clone()
    with cstorch.amp.cbfloat16_numerics(layer):
        assert len(layer.parametrizations.weight) == 2
        assert torch.equal(layer.weight, cstorch.amp.round_to_cbfloat16(2 * original))
        assert on_grid(layer.bias)
        assert not layer.parametrizations.weight[0]._forward_hooks  # internals are not hooked
    assert parametrize.is_parametrized(layer, "weight")
    assert not parametrize.is_parametrized(layer, "bias")
    assert len(layer.parametrizations.weight) == 1
    assert isinstance(layer.parametrizations.weight[0], Double)
    assert torch.equal(layer.weight, 2 * original)


def test_shared_parameter() -> None:
    first, second = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    second.weight = first.weight
    model = torch.nn.Sequential(first, torch.nn.Tanh(), second)
    shared = first.weight
    before = shared.detach().clone()
    with cstorch.amp.cbfloat16_numerics(model):
        assert torch.equal(first.weight, second.weight) and on_grid(second.weight)
        model(torch.randn(2, 3)).sum().backward()
    assert first.weight is shared and second.weight is shared
    assert torch.equal(shared, before) and shared.grad is not None


def test_nested_contexts() -> None:
    model = make_mlp()
    before, parameters = snapshot(model), list(model.parameters())
    x = torch.randn(3, 8)
    with cstorch.amp.cbfloat16_numerics(model):
        once = model(x)
        with cstorch.amp.cbfloat16_numerics(model):
            assert torch.equal(model(x), once)  # rounding is idempotent
        assert torch.equal(model(x), once)
    assert_pristine(model, before, parameters)


def test_nested_outputs_are_rounded() -> None:
    class Pair(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, object]:
            return {"a": (x * 1.001, [x / 3]), "n": torch.arange(3), "s": "text"}

    x = torch.randn(5)
    with cstorch.amp.cbfloat16_numerics(Pair()) as model:
        out = model(x)
    assert on_grid(out["a"][0]) and on_grid(out["a"][1][0])
    assert out["n"].dtype == torch.int64 and out["s"] == "text"


def _count_roundings(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    from torch_facade.amp import _cbfloat16_kernel

    calls: list[tuple[int, ...]] = []
    original = _cbfloat16_kernel.round_float32

    def counting(x: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return original(x)

    monkeypatch.setattr(_cbfloat16_kernel, "round_float32", counting)
    return calls


def test_an_output_already_cast_is_not_cast_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Dropout(p=0)`` returns its input and ``Sequential`` its last module's output: both are
    the Linear's cast output already, so neither is rounded again, forward or backward; the
    gradients are those of one cast per tensor, computed by hand."""
    calls = _count_roundings(monkeypatch)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Dropout(0.0))
    x = torch.randn(2, 4)
    with cstorch.amp.cbfloat16_numerics(model):
        calls.clear()  # registering a parametrization evaluates it once
        out = model(x)
        assert len(calls) == 4  # the input, the weight, the bias and the Linear's output
        (out * 1e3).sum().backward()
    # The gradients of the output, the weight and the bias (the input needs no gradient, so
    # the Linear saves no weight to round again).
    assert len(calls) == 4 + 3
    grads = [p.grad for p in model.parameters()]
    model.zero_grad()
    cast = cstorch.amp.cast_to_cbfloat16
    linear = model[0]
    h = cast(torch.nn.functional.linear(cast(x), cast(linear.weight), cast(linear.bias)))
    (h * 1e3).sum().backward()
    for got, want in zip(grads, [p.grad for p in model.parameters()], strict=True):
        assert torch.equal(got, want)


def test_an_output_changed_after_its_cast_is_cast_again(monkeypatch: pytest.MonkeyPatch) -> None:
    class Nudge(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inner(x)  # cast by the Linear's hook
            return h.mul_(1 + 2**-12)  # off the grid again, in place: the same tensor object

    calls = _count_roundings(monkeypatch)
    x = torch.randn(5, 4)
    for grad_enabled in (True, False):
        with cstorch.amp.cbfloat16_numerics(Nudge()) as model, torch.set_grad_enabled(grad_enabled):
            calls.clear()
            out = model(x)
        assert len(calls) == 5  # the input, the weight, the bias, the Linear's and Nudge's outputs
        assert on_grid(out)


def test_numerics_under_inference_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inference tensors have no version counter: their outputs are simply cast again."""
    calls = _count_roundings(monkeypatch)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Dropout(0.0))
    x = torch.randn(2, 4)
    with cstorch.amp.cbfloat16_numerics(model):
        expected = model(x).detach()
        with torch.inference_mode():
            calls.clear()
            out = model(x)
    assert out.is_inference() and torch.equal(out, expected)
    assert len(calls) == 6  # the input, the weight, the bias and all three modules' outputs


def test_rejects_half_precision_models_and_non_modules() -> None:
    model = make_mlp().to(torch.float16)
    with pytest.raises(ValueError, match="float32"), cstorch.amp.cbfloat16_numerics(model):
        pass
    assert all(not parametrize.is_parametrized(m) for m in model.modules())
    assert all(not m._forward_hooks for m in model.modules())
    with (
        pytest.raises(TypeError, match=r"torch\.nn\.Module"),
        cstorch.amp.cbfloat16_numerics(
            lambda x: x  # type: ignore[arg-type]
        ),
    ):
        pass


def _rounded_parameters(monkeypatch: pytest.MonkeyPatch) -> list[weakref.ref]:
    """Weak references to every rounded parameter the parametrizations make from now on."""
    from torch_facade.amp import cbfloat16

    made: list[weakref.ref] = []
    original = cbfloat16._RoundParametrization.forward

    def spy(self: torch.nn.Module, tensor: torch.Tensor) -> torch.Tensor:
        rounded = original(self, tensor)
        made.append(weakref.ref(rounded))
        return rounded

    monkeypatch.setattr(cbfloat16._RoundParametrization, "forward", spy)
    return made


def test_the_forward_pass_holds_no_rounded_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """A linear layer saves its weight for its backward pass: in the model's forward pass the
    rounded weight is kept as its parameter and rounded again when the backward pass needs it
    (no second copy of the model held in between); the same weight saved outside the model's
    forward pass is held as torch holds it. The gradients are those of the hand-built graph
    (``test_gradients_reach_master_weights_rounded_at_every_cast``)."""
    made = _rounded_parameters(monkeypatch)
    model = make_mlp()
    x = torch.randn(5, 8)
    with cstorch.amp.cbfloat16_numerics(model):
        made.clear()
        loss = model(x).sum()
        gc.collect()
        assert len(made) == 6 and all(ref() is None for ref in made)
        # Not in the model's forward pass (x requires grad, so mm saves the weight).
        outside = torch.mm(x.requires_grad_(), model[0].weight.T).sum()
        gc.collect()
        assert made[-1]() is not None
        (loss + outside).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_parameter_changed_before_the_backward_pass_is_an_error() -> None:
    """As torch refuses a backward pass through a weight changed in place since the forward."""
    model = make_mlp()
    with cstorch.amp.cbfloat16_numerics(model):
        loss = model(torch.randn(3, 8)).sum()
        with torch.no_grad():
            model[2].parametrizations.weight.original.add_(1.0)  # its input requires grad
        with pytest.raises(RuntimeError, match=r"shape \(32, 32\) was modified in place"):
            loss.backward()


def test_a_forward_pass_that_raises_leaves_nothing_active(monkeypatch: pytest.MonkeyPatch) -> None:
    class Failing(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.inner(x)
            raise ValueError("boom")

    made = _rounded_parameters(monkeypatch)
    model = Failing()
    x = torch.randn(2, 4)
    with cstorch.amp.cbfloat16_numerics(model):
        with pytest.raises(ValueError, match="boom"):
            model(x)
        made.clear()
        outside = torch.mm(x.requires_grad_(), model.inner.weight.T).sum()
        gc.collect()
        assert made[-1]() is not None  # saved as torch saves it: no hook left behind
        outside.backward()
