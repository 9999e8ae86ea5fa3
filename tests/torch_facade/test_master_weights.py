"""``cstorch.amp.with_master_weights``: float32 masters for a model held in float16 or bfloat16.

Oracles: a float32 model stepped through the same calls with the same data (where the gradients
are exact in both dtypes, the masters must be its parameters bit for bit and the half
parameters their rounding); numpy's float16 spacing for "half a unit in the last place"; torch's
own optimizers for the updates; ``torch.equal`` for "a skipped step changes nothing".
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from facade_helpers import INF, TinyNet, loss_of

import torch_facade as cstorch
from torch_facade.amp.master_weights import MasterWeightsOptimizer

HALF = [torch.float16, torch.bfloat16]
INIT_SCALE = 2.0**8  # a power of two: scaling and unscaling are exact


def half_values(dtype: torch.dtype, n: int = 16, seed: int = 0) -> torch.Tensor:
    """``n`` values in [0.5, 2) exact in ``dtype`` (so exact in float32 too)."""
    generator = torch.Generator().manual_seed(seed)
    return (0.5 + 1.5 * torch.rand(n, generator=generator)).to(dtype)


class Exact(torch.nn.Module):
    """``loss = sum(w * c)``: its gradient is ``c`` exactly in any dtype (times the scale)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(half_values(dtype).to(dtype))
        self.register_buffer("c", half_values(dtype, seed=1) - 1.25)

    def forward(self) -> torch.Tensor:
        return (self.w * self.c).sum()


def scaler() -> cstorch.amp.GradScaler:
    return cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=INIT_SCALE)


# Each way to step: (loss, optimizer, scaler or None) -> None; scaler kind it needs.
def via_step(loss, optimizer, grad_scaler):
    grad_scaler.scale(loss).backward()
    grad_scaler.step(optimizer)
    grad_scaler.update()
    optimizer.zero_grad()


def via_unscale_then_step(loss, optimizer, grad_scaler):
    grad_scaler.scale(loss).backward()
    grad_scaler.unscale_(optimizer)  # the half gradients are unscaled by the scaler, in place
    grad_scaler.step(optimizer)
    grad_scaler.update()
    optimizer.zero_grad()


def via_optimizer_step(loss, optimizer, grad_scaler):
    cstorch.amp.optimizer_step(loss, optimizer, grad_scaler)


def via_optimizer_step_clipped(loss, optimizer, grad_scaler):
    cstorch.amp.optimizer_step(loss, optimizer, grad_scaler, max_gradient_norm=1.0)


def via_no_scaler(loss, optimizer, grad_scaler):
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


PATHS: dict[str, tuple[Callable[..., None], str | None]] = {
    "scaler.step": (via_step, "facade"),
    "unscale_+step": (via_unscale_then_step, "facade"),
    "optimizer_step": (via_optimizer_step, "facade"),
    "optimizer_step+clip": (via_optimizer_step_clipped, "facade"),
    "torch.amp.GradScaler": (via_step, "torch"),
    "no scaler": (via_no_scaler, None),
}


def make_scaler(kind: str | None) -> Any:
    if kind == "facade":
        return scaler()
    if kind == "torch":
        return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    return None


def adamw(params, fused: bool = False, lr: float = 1e-4) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=fused)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_masters_are_the_float32_run_and_the_half_params_its_rounding(dtype, path, fused):
    step, kind = PATHS[path]
    # With the clip fused into the overflow check the float32 run multiplies its gradients by
    # clip / scale, the wrapper divides by scale / clip: one rounding apart. Elsewhere: exact.
    same = same_bits if path != "optimizer_step+clip" else one_rounding_apart
    oracle = Exact(torch.float32)
    oracle.w.data.copy_(Exact(dtype).w.float())
    oracle.c.copy_(Exact(dtype).c.float())
    oracle_opt, oracle_scaler = adamw(oracle.parameters(), fused), make_scaler(kind)
    model = Exact(dtype)
    optimizer = cstorch.amp.with_master_weights(adamw(model.parameters(), fused))
    half_scaler = make_scaler(kind)
    for _ in range(12):
        step(oracle(), oracle_opt, oracle_scaler)
        step(model(), optimizer, half_scaler)
        (master,) = optimizer.master_params()
        assert same(master, oracle.w.detach())
        assert same(model.w.detach().float(), oracle.w.detach().to(dtype).float())
    assert not torch.equal(master, Exact(dtype).w.float())  # it moved
    inner_state = optimizer.optimizer.state[master]
    assert inner_state["exp_avg"].dtype == torch.float32
    assert same(inner_state["exp_avg_sq"], oracle_opt.state[oracle.w]["exp_avg_sq"])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b)


def one_rounding_apart(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.allclose(a, b, rtol=2**-20, atol=0)


# AdamW's steps are about lr: below half an ulp of every parameter (in [0.5, 2)) in each dtype.
LR_BELOW_HALF_AN_ULP = {torch.float16: 1e-4, torch.bfloat16: 1e-3}


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_without_masters_updates_below_half_an_ulp_leave_the_parameter_unchanged(dtype):
    lr = LR_BELOW_HALF_AN_ULP[dtype]
    oracle = Exact(torch.float32)
    oracle.w.data.copy_(Exact(dtype).w.float())
    oracle.c.copy_(Exact(dtype).c.float())
    oracle_opt = adamw(oracle.parameters(), lr=lr)
    model = Exact(dtype)
    plain = adamw(model.parameters(), lr=lr)
    start = model.w.detach().clone()
    # Half a unit in the last place of each parameter (ml_dtypes-free: numpy's float16 spacing,
    # and bfloat16's 8-bit significand: 2**(exponent - 7)).
    if dtype is torch.float16:
        half_ulp = np.spacing(start.numpy().astype(np.float16)).astype(np.float64) / 2
    else:
        half_ulp = 2.0 ** (np.floor(np.log2(start.float().numpy())) - 7) / 2
    grad_scaler = scaler()
    with pytest.warns(UserWarning, match="with_master_weights"):
        for _ in range(20):
            before = oracle.w.detach().clone()
            via_no_scaler(oracle(), oracle_opt, None)
            assert (oracle.w.detach() - before).abs().double().numpy().max() < half_ulp.min()
            via_step(model(), plain, grad_scaler)
    assert torch.equal(model.w.detach(), start)  # every update rounded away
    moved = (oracle.w.detach().double() - start.double()).abs().numpy()
    assert (moved > 2 * half_ulp).all()  # while the float32 run moved by more than an ulp


def test_a_half_model_with_masters_tracks_the_float32_model():
    """TinyNet computing in float16 (its gradients differ from float32's by their rounding):
    with masters its parameters stay within 1% of the float32 model's movement. Without them,
    AdamW steps in float16 too: updates below half an ulp round away, and where a gradient is
    small its second moment underflows to 0 while ``eps=1e-8`` is 0 in float16, so the first
    update divides by zero."""
    half = TinyNet(torch.float16)
    oracle = TinyNet(torch.float32)
    with torch.no_grad():
        for reference, p in zip(oracle.parameters(), half.parameters(), strict=True):
            reference.copy_(p.float())
    oracle_opt = adamw(oracle.parameters())
    masters = cstorch.amp.with_master_weights(adamw(half.parameters()))
    plain_model = TinyNet(torch.float16)
    plain = adamw(plain_model.parameters())
    scalers = scaler(), scaler()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="GradScaler is unscaling gradients")
        for step in range(60):
            via_no_scaler(loss_of(oracle, step), oracle_opt, None)
            via_step(loss_of(half, step), masters, scalers[0])
            via_step(loss_of(plain_model, step), plain, scalers[1])
    trained = 0
    start = TinyNet(torch.float16).named_parameters()
    for reference, master, (name, p0) in zip(
        oracle.parameters(), masters.master_params(), start, strict=True
    ):
        if name.startswith("unused"):  # no gradient: untouched everywhere
            assert torch.equal(master, p0.float())
            continue
        trained += 1
        moved = (reference.detach() - p0.float()).abs().max()
        assert moved > 3e-3  # 60 steps of about lr = 1e-4
        assert (master - reference.detach()).abs().max() < 0.01 * moved
    assert trained == 4
    plain_params = torch.cat([p.detach().flatten() for p in plain_model.parameters()])
    assert not torch.isfinite(plain_params).all()
    # The inf came from the first step (its gradients were finite); from then on the loss is
    # inf and the scaler skips every step.
    assert scalers[1].get_num_skipped_steps() == 59


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize(
    "path", ["scaler.step", "unscale_+step", "optimizer_step", "torch.amp.GradScaler"]
)
def test_a_skipped_step_changes_neither_masters_half_params_nor_state(path, fused):
    step, kind = PATHS[path]
    model = TinyNet(torch.float16)
    inner = adamw(model.parameters(), fused)
    optimizer = cstorch.amp.with_master_weights(inner)
    grad_scaler = make_scaler(kind)
    for i in range(3):
        step(loss_of(model, i), optimizer, grad_scaler)
    handed: list[bool] = []
    inner_step = inner.step

    def spy(*args, **kwargs):
        handed.append(getattr(inner, "found_inf", None) is not None)
        return inner_step(*args, **kwargs)

    inner.step = spy  # type: ignore[method-assign]
    params = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for m in optimizer.master_params()]
    state = copy.deepcopy(inner.state_dict())
    scale = float(grad_scaler.get_scale())
    step(loss_of(model, 3) * INF, optimizer, grad_scaler)
    assert float(grad_scaler.get_scale()) == scale / 2  # the overflow was seen: skipped
    assert all(map(torch.equal, params, [p.detach() for p in model.parameters()]))
    assert all(map(torch.equal, masters, optimizer.master_params()))
    assert_same_state(state, inner.state_dict())
    # A fused inner optimizer skips in its kernel (no host read) once it has state, when the
    # scaler hands the flag to the wrapper (every path but torch's own scaler with unscale_).
    assert handed == ([True] if fused else [])
    step(loss_of(model, 4), optimizer, grad_scaler)  # and the next step applies
    assert not all(map(torch.equal, masters, optimizer.master_params()))


def assert_same_state(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_state(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_state(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_state_dict_round_trip_mid_run_resumes_bit_for_bit(fused):
    def new_run(seed: int):
        model = TinyNet(torch.float16, seed=seed)
        optimizer = cstorch.amp.with_master_weights(adamw(model.parameters(), fused))
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return model, optimizer, schedule, scaler()

    def train(run, steps):
        model, optimizer, schedule, grad_scaler = run
        for i in steps:
            via_step(loss_of(model, i) * (INF if i == 4 else 1.0), optimizer, grad_scaler)
            schedule.step()

    first = new_run(0)
    train(first, range(3))
    saved = copy.deepcopy(
        [first[0].state_dict(), first[1].state_dict(), first[2].state_dict(), first[3].state_dict()]
    )
    train(first, range(3, 8))

    second = new_run(seed=7)  # other weights: everything comes from the checkpoint
    second[0].load_state_dict(saved[0])
    second[1].load_state_dict(saved[1])
    second[2].load_state_dict(saved[2])
    second[3].load_state_dict(saved[3])
    train(second, range(3, 8))
    for a, b in zip(first[0].parameters(), second[0].parameters(), strict=True):
        assert torch.equal(a, b)
    assert all(map(torch.equal, first[1].master_params(), second[1].master_params()))
    assert_same_state(first[1].state_dict(), second[1].state_dict())
    assert second[1].param_groups[0]["lr"] == first[1].param_groups[0]["lr"] == 1e-4 * 0.5**4


def test_load_state_dict_writes_the_masters_rounded_into_the_model():
    model = TinyNet(torch.float16)
    optimizer = cstorch.amp.with_master_weights(adamw(model.parameters()))
    grad_scaler = scaler()
    for i in range(3):
        via_step(loss_of(model, i), optimizer, grad_scaler)
    saved = copy.deepcopy(optimizer.state_dict())
    other = TinyNet(torch.float16, seed=3)
    resumed = cstorch.amp.with_master_weights(adamw(other.parameters()))
    resumed.load_state_dict(saved)
    for p, master in zip(other.parameters(), optimizer.master_params(), strict=True):
        assert torch.equal(p.detach(), master.to(torch.float16))
    assert all(map(torch.equal, resumed.master_params(), optimizer.master_params()))


def test_a_plain_optimizers_state_dict_loads_and_a_plain_optimizer_loads_ours():
    model = TinyNet(torch.float16)
    plain = adamw(model.parameters())
    plain.zero_grad()
    loss_of(model, 0).float().backward()
    plain.step()  # its state is float16
    saved = copy.deepcopy(plain.state_dict())
    fresh = TinyNet(torch.float16)
    fresh.load_state_dict(model.state_dict())
    wrapped = cstorch.amp.with_master_weights(adamw(fresh.parameters()))
    wrapped.load_state_dict(saved)  # no masters: they keep the half parameters' values
    state = wrapped.optimizer.state[wrapped.master_params()[0]]
    assert state["exp_avg"].dtype == torch.float32
    assert torch.equal(state["exp_avg"], plain.state[model.fc1.weight]["exp_avg"].float())
    assert torch.equal(wrapped.master_params()[0], model.fc1.weight.detach().float())
    back = adamw(TinyNet(torch.float16).parameters())
    back.load_state_dict(wrapped.state_dict())  # torch ignores master_params, casts to float16
    assert back.state_dict()["state"][0]["exp_avg"].dtype == torch.float16


def test_masters_cost_four_bytes_per_half_parameter_and_no_gradients_between_steps():
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.LayerNorm(16))
    model[0].half()  # the LayerNorm stays float32: stepped as it is, no copy
    optimizer = cstorch.amp.with_master_weights(adamw(model.parameters()))
    half_numel = sum(p.numel() for p in model[0].parameters())
    pairs = zip(model.parameters(), optimizer.master_params(), strict=True)
    copies = [m for p, m in pairs if m is not p]
    assert sum(m.numel() * m.element_size() for m in copies) == 4 * half_numel
    for p in model[1].parameters():
        assert optimizer.state[p]["master_param"] is p
    x = torch.randn(4, 32)
    before = model[1].weight.detach().clone()
    via_no_scaler(model(x.half()).float().square().mean(), optimizer, None)
    assert all(m.grad is None for m in copies)
    assert not torch.equal(before, model[1].weight.detach())  # the float32 layer stepped too


def test_schedulers_set_the_learning_rate_the_inner_optimizer_steps_with():
    model = Exact(torch.float16)
    optimizer = cstorch.amp.with_master_weights(torch.optim.SGD(model.parameters(), lr=0.25))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.0 if epoch else 1.0)
    grad_scaler = scaler()
    via_step(model(), optimizer, grad_scaler)
    schedule.step()  # lr 0 from now on
    after_one = optimizer.master_params()[0].clone()
    expected = Exact(torch.float16).w.float() - 0.25 * Exact(torch.float16).c.float()
    assert torch.equal(after_one, expected)
    via_step(model(), optimizer, grad_scaler)
    assert optimizer.optimizer.param_groups[0]["lr"] == 0.0
    assert torch.equal(optimizer.master_params()[0], after_one)


def test_add_param_group_after_wrapping_gives_the_new_parameters_masters():
    first = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    optimizer = cstorch.amp.with_master_weights(torch.optim.SGD([first], lr=1e-4))
    second = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    optimizer.add_param_group({"params": [second], "lr": 1e-3})
    second.grad = torch.ones(3, dtype=torch.bfloat16)
    optimizer.step()
    assert torch.equal(second.detach(), torch.ones(3, dtype=torch.bfloat16))  # 0.999: rounds to 1
    assert torch.equal(optimizer.master_params()[1], torch.full((3,), 1 - 1e-3))
    with pytest.raises(ValueError, match="more than one parameter group"):
        optimizer.add_param_group({"params": [second]})
    assert len(optimizer.param_groups) == len(optimizer.optimizer.param_groups) == 2


def test_the_scaler_warns_for_half_parameters_and_names_with_master_weights_only_without_it():
    model = TinyNet(torch.float16)
    with pytest.warns(UserWarning, match=r"cstorch\.amp\.with_master_weights\(optimizer\)"):
        via_step(loss_of(model, 0), adamw(model.parameters()), scaler())
    model = TinyNet(torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        via_step(
            loss_of(model, 0), cstorch.amp.with_master_weights(adamw(model.parameters())), scaler()
        )


@pytest.mark.filterwarnings("ignore:GradScaler is unscaling gradients")  # the known optimizer's
def test_bad_optimizers_are_refused_naming_the_argument_and_left_unchanged():
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer; got .*Linear"):
        cstorch.amp.with_master_weights(torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    float32 = adamw(TinyNet(torch.float32).parameters())
    with pytest.raises(
        ValueError, match=r"optimizer holds no float16 or bfloat16 parameter.*float32"
    ):
        cstorch.amp.with_master_weights(float32)
    model = TinyNet(torch.float16)
    stepped = adamw(model.parameters())
    loss_of(model, 0).float().backward()
    stepped.step()
    with pytest.raises(ValueError, match=r"optimizer has state for 4 parameter\(s\) already"):
        cstorch.amp.with_master_weights(stepped)
    assert [p.dtype for g in stepped.param_groups for p in g["params"]] == [torch.float16] * 6
    wrapped = cstorch.amp.with_master_weights(adamw(TinyNet(torch.float16).parameters()))
    with pytest.raises(ValueError, match="optimizer steps float32 master weights already"):
        cstorch.amp.with_master_weights(wrapped)
    model = TinyNet(torch.float16)
    known = adamw(model.parameters())
    cstorch.amp.GradScaler(loss_scale="dynamic", optimizers=known)
    with pytest.raises(ValueError, match="optimizer is known to a GradScaler already"):
        cstorch.amp.with_master_weights(known)
    assert known.param_groups[0]["params"][0] is model.fc1.weight


def test_bad_state_dicts_are_refused_and_change_nothing():
    model = TinyNet(torch.float16)
    optimizer = cstorch.amp.with_master_weights(adamw(model.parameters()))
    via_step(loss_of(model, 0), optimizer, scaler())
    good = copy.deepcopy(optimizer.state_dict())
    masters = [m.clone() for m in optimizer.master_params()]
    state = copy.deepcopy(optimizer.optimizer.state_dict())
    wrong_shape = copy.deepcopy(good)
    wrong_shape["master_params"][0] = torch.zeros(2, 2)
    missing = copy.deepcopy(good)
    del missing["master_params"][5]
    cases: list[tuple[Any, type[Exception], str]] = [
        ([1, 2], TypeError, "state_dict must be a mapping; got list"),
        ({**good, "extra": 1}, ValueError, r"unknown keys \['extra'\]"),
        ({"state": {}}, ValueError, r"missing keys \['param_groups'\]"),
        (
            wrong_shape,
            ValueError,
            r"\['master_params'\]\[0\] must be a torch.float32 tensor of shape \(3, 4\)",
        ),
        (missing, ValueError, r"expected \[0, 1, 2, 3, 4, 5\], got \[0, 1, 2, 3, 4\]"),
        ({**good, "master_params": {0: 1.0}}, ValueError, "expected"),
    ]
    for bad, error, match in cases:
        with pytest.raises(error, match=match):
            optimizer.load_state_dict(bad)
        assert all(map(torch.equal, masters, optimizer.master_params()))
        assert_same_state(state, optimizer.optimizer.state_dict())
    assert isinstance(optimizer, MasterWeightsOptimizer)


def test_a_gpt2_held_in_half_precision_trains_like_float32_only_with_masters():
    """transformers' GPT2LMHeadModel (the demo's: 2 layers of width 64, bytes of the standard
    library) cast to float16 and bfloat16, 20 AdamW steps of 4 windows, held-out loss on 32
    windows (master_weights_gpt.py; the docs page has the long run). With masters each ends
    where the float32 model does; without, float16 AdamW writes inf at its first applied step,
    and bfloat16's falls behind. (This CPU computes float16 in software: 4 windows a step keep
    the five runs to seconds; at 4 x 20 the masters ended within 2e-4 of float32 and bfloat16
    without them 0.025 behind.)"""
    from master_weights_gpt import train

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="GradScaler is unscaling gradients")
        results = {row: train(row, seed=0, steps=20, batch_size=4, eval_windows=32) for row in ROWS}
    reference = results["float32"].held_out_loss
    for dtype in ("float16", "bfloat16"):
        assert abs(results[f"{dtype}+masters"].held_out_loss - reference) < 0.005
        assert results[f"{dtype}+masters"].first_nonfinite_step is None
    assert results["float16"].first_nonfinite_step is not None
    assert np.isnan(results["float16"].held_out_loss)
    assert results["bfloat16"].held_out_loss > reference + 0.01


ROWS = ["float32", "float16+masters", "float16", "bfloat16+masters", "bfloat16"]


def test_skip_aware_schedules_the_wrapper_by_applied_steps():
    model = Exact(torch.float16)
    optimizer = cstorch.amp.with_master_weights(torch.optim.SGD(model.parameters(), lr=0.5))
    grad_scaler = scaler()
    schedule = cstorch.amp.skip_aware(
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5), grad_scaler
    )
    for i in range(4):
        via_step(model() * (INF if i == 1 else 1.0), optimizer, grad_scaler)
        schedule.step()
    assert schedule.last_epoch == 3 and schedule.get_last_lr() == [0.5 * 0.5**3]
    before = optimizer.master_params()[0].clone()
    via_step(model(), optimizer, grad_scaler)  # steps with the scheduled lr, handed on
    assert optimizer.optimizer.param_groups[0]["lr"] == 0.0625
    assert torch.equal(optimizer.master_params()[0], before - 0.0625 * model.c.float())
