"""Overflow diagnostics through the facade: the report, the stall warning and error, checkpoints
of the stall counter, ``scaler_metrics`` and logging them with TensorBoard's ``SummaryWriter``.

Oracles: numpy (ml_dtypes for bfloat16) counts of the inf and NaN elements of each gradient once
unscaled, and of whether its squares overflow float32, taken from a copy of the gradients made
before the scaler touched them; hand-computed traces of the stall counter; float64 norms.
"""

from __future__ import annotations

import io
import math
import warnings
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from facade_helpers import DLS, INF, NAN

import torch_facade as cstorch

pytestmark = pytest.mark.filterwarnings("ignore:GradScaler is unscaling gradients")

FLOAT32_MAX = float(np.finfo(np.float32).max)
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
REFERENCE_KEYS = (
    "loss_scale",
    "steps_since_rescale",
    "overflows_since_rescale",
    "num_skipped_steps",
)


class Net(torch.nn.Module):
    """Two layers, a free parameter, and a layer the forward pass never uses (grads None)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Linear(4, 5)
        self.head = torch.nn.Linear(5, 3)
        self.gain = torch.nn.Parameter(torch.ones(3))
        self.unused = torch.nn.Linear(2, 2)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x))) * self.gain


def make_optimizer(net: Net, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW over two param groups (so positional names have a group index)."""
    groups = [
        {"params": list(net.embed.parameters())},
        {"params": [*net.head.parameters(), net.gain, *net.unused.parameters()], "lr": 1e-3},
    ]
    return torch.optim.AdamW(groups, lr=1e-2, fused=fused)


def positional_names(optimizer: torch.optim.Optimizer, index: int = 0) -> dict[int, str]:
    return {
        id(param): f"optimizer{index}.param_groups[{g}].params[{j}]"
        for g, group in enumerate(optimizer.param_groups)
        for j, param in enumerate(group["params"])
    }


def loss_of(net: Net, step: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    dtype = net.gain.dtype
    x = torch.randn(6, 4, generator=generator).to(dtype)
    y = torch.randn(6, 3, generator=generator)
    return (net(x).float() - y).square().mean()


def poison(net: Net) -> None:
    """Writes every kind of poison into the (scaled) gradients."""
    with torch.no_grad():
        net.embed.weight.grad[0, 1] = INF
        net.embed.weight.grad[3, 2] = INF
        net.head.weight.grad[1, 0] = -INF
        net.head.weight.grad[2, 4] = NAN
        net.head.bias.grad.fill_(NAN)
        if net.gain.dtype != torch.float16:
            # Finite, but once unscaled its square overflows float32 (float16 cannot hold one).
            net.gain.grad[1] = 3.0e38


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """Exact numpy copy; bfloat16 through float32, which holds every bfloat16 value."""
    if tensor.dtype == torch.bfloat16:
        return tensor.detach().float().numpy().astype(ml_dtypes.bfloat16)
    return tensor.detach().numpy().copy()


def grads_snapshot(net: Net) -> dict[int, np.ndarray]:
    return {id(p): to_numpy(p.grad) for p in net.parameters() if p.grad is not None}


def oracle(
    snapshot: dict[int, np.ndarray],
    inv_scale: float,
    order: list[torch.Tensor],
    names: dict[int, str],
) -> dict[str, int]:
    """numpy's report: in optimizer order, each gradient whose unscaled squares overflow float32
    (summed in float64), with its count of inf and NaN elements."""
    found = {}
    for param in order:
        if id(param) not in snapshot:
            continue
        grad = snapshot[id(param)]
        with np.errstate(over="ignore", invalid="ignore"):
            unscaled = (grad.astype(np.float32) * np.float32(inv_scale)).astype(grad.dtype)
            wide = unscaled.astype(np.float64)
            total = np.sum(np.square(wide))
        if not (np.isfinite(total) and total <= FLOAT32_MAX):
            found[names[id(param)]] = int(np.sum(~np.isfinite(wide)))
    return found


def params_in_order(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def clean_iteration(scaler: Any, net: Net, optimizer: torch.optim.Optimizer, step: int) -> None:
    optimizer.zero_grad()
    scaler.scale(loss_of(net, step)).backward()
    scaler.step(optimizer)
    scaler.update()


# ------------------------------------------------------------------- the report

# Non-fused and fused AdamW, each with and without unscale_() first; DLS + GCC after unscale_().
PATHS = ["step", "fused_step", "unscale_", "fused_unscale_", "gcc_unscale_"]


@pytest.mark.parametrize("named", [True, False], ids=["module", "positional"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_report_names_exactly_the_poisoned_parameters(
    dtype: torch.dtype, path: str, named: bool
) -> None:
    net = Net(dtype)
    fused = path.startswith("fused")
    optimizer = make_optimizer(net, fused=fused)
    gcc = {"max_gradient_norm": 1.0} if path.startswith("gcc") else {}
    scaler = cstorch.amp.GradScaler(**DLS, **gcc)
    if fused:
        clean_iteration(scaler, net, optimizer, 0)  # the fused kernel needs its state first
    module = net if named else None
    names = (
        {id(p): name for name, p in net.named_parameters()}
        if named
        else positional_names(optimizer)
    )
    inv_scale = 1.0 / float(scaler.get_scale())

    optimizer.zero_grad()
    scaler.scale(loss_of(net, 1)).backward()
    poison(net)
    snapshot = grads_snapshot(net)
    expected = oracle(snapshot, inv_scale, params_in_order(optimizer), names)
    poisoned = {"embed.weight": 2, "head.weight": 2, "head.bias": 3}
    if dtype != torch.float16:
        poisoned["gain"] = 0
    assert len(expected) == len(poisoned)  # the oracle sees the poison that was written

    def check() -> None:
        report = scaler.nonfinite_gradients(module)
        assert isinstance(report, cstorch.amp.OverflowReport)
        assert list(report.gradients.items()) == list(expected.items())
        assert report.total == len(snapshot) == 5  # the unused layer has no gradients
        assert bool(report)
        if named:
            assert report.gradients == poisoned

    if path.endswith("unscale_"):
        scaler.unscale_(optimizer)
        check()
    before = [p.detach().clone() for p in net.parameters()]
    assert scaler.step(optimizer) is None  # skipped
    check()
    if path == "fused_step":  # the kernel skipped without unscaling: gradients as poisoned
        for param in net.parameters():
            if param.grad is not None:
                assert np.array_equal(to_numpy(param.grad), snapshot[id(param)], equal_nan=True)
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
    scaler.update()
    check()  # still this iteration's gradients, until zero_grad()
    assert not bool(scaler.get_isfinite())


def test_report_string_and_a_healthy_step() -> None:
    net = Net()
    optimizer = make_optimizer(net)
    scaler = cstorch.amp.GradScaler(**DLS)
    clean_iteration(scaler, net, optimizer, 0)
    report = scaler.nonfinite_gradients(net)
    assert not report and report.gradients == {} and report.total == 5
    assert str(report) == "0 of 5 gradients non-finite"

    optimizer.zero_grad()
    scaler.scale(loss_of(net, 1)).backward()
    poison(net)
    scaler.step(optimizer)
    assert str(scaler.nonfinite_gradients(net)) == (
        "4 of 5 gradients non-finite: embed.weight (2 elements), head.weight (2 elements), "
        "head.bias (3 elements), gain (finite values too large to square in float32)"
    )
    with torch.no_grad():
        net.head.bias.grad.zero_()
        net.head.weight.grad.zero_()
        net.gain.grad.zero_()
        net.embed.weight.grad[0, 1] = 0.0
    assert str(scaler.nonfinite_gradients(net)) == (
        "1 of 5 gradients non-finite: embed.weight (1 element)"
    )


def test_report_needs_a_decision_and_follows_the_gradients() -> None:
    net = Net()
    optimizer = make_optimizer(net)
    scaler = cstorch.amp.GradScaler(**DLS)
    with pytest.raises(RuntimeError, match="needs a decision"):
        scaler.nonfinite_gradients(net)
    scaler.scale(loss_of(net)).backward()
    with pytest.raises(RuntimeError, match="after unscale_"):
        scaler.nonfinite_gradients(net)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()  # gradients gone: nothing left to read
    assert str(scaler.nonfinite_gradients(net)) == "0 of 0 gradients non-finite"


def test_report_after_an_applied_fused_step_below_scale_one() -> None:
    """A fused kernel that applied a step unscaled the gradients in place: the report must not
    unscale them again (at a scale below 1 that multiplies float16 values past 65504)."""
    param = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    optimizer = torch.optim.AdamW([param], lr=0.1, fused=True)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=2.0**-10)
    for _ in range(2):  # the second step goes through the fused kernel
        optimizer.zero_grad()
        scaler.scale((param.float() * 100.0).sum()).backward()
        scaler.step(optimizer)
        assert bool(scaler.get_isfinite())
        assert torch.equal(param.grad, torch.full((4,), 100.0, dtype=torch.float16))
        report = scaler.nonfinite_gradients()
        assert str(report) == "0 of 1 gradients non-finite"
        scaler.update()


def test_report_covers_first_iteration_gradients_of_optimizers_not_met_yet() -> None:
    """torch's multi-optimizer loop: the first iteration's decision also read the gradients of
    an optimizer the scaler meets only later; a skip they caused is explained at once."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    opt0 = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt1 = torch.optim.SGD(model[1].parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)
    scaler.scale(model(torch.ones(3, 2)).sum()).backward()
    model[1].bias.grad.fill_(NAN)
    assert scaler.step(opt0) is None  # skipped for opt1's gradient
    assert scaler.nonfinite_gradients(model).gradients == {"1.bias": 1}
    # Without a module they are named in the order the loss reached them (autograd's order).
    [(name, count)] = scaler.nonfinite_gradients().gradients.items()
    assert name in ("unregistered_params[0]", "unregistered_params[1]") and count == 1
    assert scaler.nonfinite_gradients().total == 4
    scaler.step(opt1)
    scaler.update()
    report = scaler.nonfinite_gradients()
    assert report.gradients == {"optimizer1.param_groups[0].params[1]": 1}
    assert report.total == 4


# ------------------------------------------------------------ stall: warning and error


def poisoned_iteration(
    scaler: Any, net: Net, optimizer: torch.optim.Optimizer, step: int, bad: bool
) -> None:
    optimizer.zero_grad()
    scaler.scale(loss_of(net, step)).backward()
    if bad:
        with torch.no_grad():
            net.embed.weight.grad[0, 0] = INF
    scaler.step(optimizer)
    scaler.update()


def stalled_scaler(**kwargs: Any) -> Any:
    """Reaches min_loss_scale = 1 after two overflows (4 -> 2 -> 1)."""
    return cstorch.amp.GradScaler(
        loss_scale="dynamic", init_scale=4.0, min_loss_scale=1.0, stall_steps=3, **kwargs
    )


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused_adamw"])
def test_stall_warns_once_after_stall_steps(fused: bool) -> None:
    net = Net()
    optimizer = make_optimizer(net, fused=fused)
    scaler = stalled_scaler()
    clean = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=4.0)
    clean_iteration(clean, net, optimizer, 0)  # fused AdamW's state exists from now on
    counts, warned_at = [], []
    for step in range(10):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            poisoned_iteration(scaler, net, optimizer, step, bad=True)
        stalls = [w for w in caught if issubclass(w.category, RuntimeWarning)]
        for w in stalls:
            warned_at.append(step)
            message = str(w.message)
            assert "stalled" in message and "min_loss_scale=1.0" in message
            assert "nonfinite_gradients" in message
            assert w.filename == __file__  # stacklevel points at the caller of update()
        counts.append(int(scaler.state_dict()["overflows_at_min_scale"]))
    # Overflows at 4 and 2 do not count; from then on every overflow is at the minimum.
    assert counts == [0, 0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert warned_at == [4]  # once, at the third consecutive overflow at min_loss_scale
    assert float(scaler.get_scale()) == 1.0
    assert int(scaler.get_num_skipped_steps()) == 10

    # A finite step ends the stall; a new stall warns again.
    poisoned_iteration(scaler, net, optimizer, 10, bad=False)
    assert int(scaler.state_dict()["overflows_at_min_scale"]) == 0
    with pytest.warns(RuntimeWarning, match="stalled"):
        for step in range(11, 14):
            poisoned_iteration(scaler, net, optimizer, step, bad=True)


def test_stall_warning_through_optimizer_step_points_at_the_caller() -> None:
    net = Net()
    optimizer = make_optimizer(net)
    scaler = cstorch.amp.GradScaler(
        loss_scale="dynamic", init_scale=1.0, min_loss_scale=1.0, stall_steps=2
    )
    with pytest.warns(RuntimeWarning, match="stalled") as caught:
        for _ in range(2):
            loss = loss_of(net) * torch.tensor(INF)
            cstorch.amp.optimizer_step(loss, optimizer, scaler)
    assert [w.filename for w in caught if w.category is RuntimeWarning] == [__file__]


def test_no_stall_warning_on_a_healthy_run_with_occasional_overflows() -> None:
    net = Net()
    optimizer = make_optimizer(net)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # Occasional overflows well above the minimum.
        scaler = cstorch.amp.GradScaler(**DLS, stall_steps=1)
        for step in range(16):
            poisoned_iteration(scaler, net, optimizer, step, bad=step % 5 == 2)
        assert int(scaler.get_num_skipped_steps()) == 3
        # At the minimum, but never two overflows in a row.
        scaler = cstorch.amp.GradScaler(
            loss_scale="dynamic", init_scale=1.0, min_loss_scale=1.0, stall_steps=2
        )
        counts = []
        for step in range(12):
            poisoned_iteration(scaler, net, optimizer, step, bad=step % 2 == 0)
            counts.append(int(scaler.state_dict()["overflows_at_min_scale"]))
        assert counts == [1, 0] * 6


def test_raise_on_stall_raises_with_the_report() -> None:
    net = Net()
    optimizer = make_optimizer(net)
    scaler = stalled_scaler(raise_on_stall=True)
    for step in range(4):
        poisoned_iteration(scaler, net, optimizer, step, bad=True)
    with pytest.raises(cstorch.amp.LossScaleStalledError, match="stalled") as info:
        poisoned_iteration(scaler, net, optimizer, 4, bad=True)
    assert isinstance(info.value, RuntimeError)
    report = info.value.report
    assert isinstance(report, cstorch.amp.OverflowReport)
    assert report.gradients == {"optimizer0.param_groups[0].params[0]": 1}
    assert report.total == 5
    assert int(scaler.state_dict()["overflows_at_min_scale"]) == 3
    # The iteration was finished before the error: the run can go on (and stays stalled).
    with pytest.raises(cstorch.amp.LossScaleStalledError):
        poisoned_iteration(scaler, net, optimizer, 5, bad=True)
    poisoned_iteration(scaler, net, optimizer, 6, bad=False)
    assert int(scaler.state_dict()["overflows_at_min_scale"]) == 0
    assert bool(scaler.get_isfinite())


def test_raise_on_stall_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="raise_on_stall"):
        cstorch.amp.GradScaler(**DLS, raise_on_stall=1)
    with pytest.raises(ValueError, match="stall_steps"):
        cstorch.amp.GradScaler(**DLS, stall_steps=0)


# ------------------------------------------------------------------ checkpoints


def test_state_dict_has_the_counter_and_it_round_trips() -> None:
    net = Net()
    optimizer = make_optimizer(net)
    scaler = stalled_scaler()
    for step in range(4):
        poisoned_iteration(scaler, net, optimizer, step, bad=True)
    saved = scaler.state_dict()
    assert list(saved) == [*REFERENCE_KEYS, "overflows_at_min_scale"]
    assert saved["overflows_at_min_scale"].dtype == torch.int64
    assert int(saved["overflows_at_min_scale"]) == 2
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    resumed = stalled_scaler()
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert {k: int(v) for k, v in resumed.state_dict().items()} == {
        k: int(v) for k, v in saved.items()
    }
    # The resumed run keeps counting: one more overflow at the minimum is the third.
    with pytest.warns(RuntimeWarning, match="stalled"):
        poisoned_iteration(resumed, net, optimizer, 4, bad=True)


@pytest.mark.parametrize("as_tensors", [True, False], ids=["tensors", "numbers"])
def test_reference_state_dict_without_the_counter_loads(as_tensors: bool) -> None:
    old: dict[str, Any] = {
        "loss_scale": 1024.0,
        "steps_since_rescale": 7,
        "overflows_since_rescale": 1,
        "num_skipped_steps": 12,
    }
    if as_tensors:
        old = {
            k: torch.tensor(v, dtype=torch.float32 if k == "loss_scale" else torch.int64)
            for k, v in old.items()
        }
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
    scaler.load_state_dict(old)
    loaded = scaler.state_dict()
    assert {k: float(v) for k, v in loaded.items()} == {
        "loss_scale": 1024.0,
        "steps_since_rescale": 7.0,
        "overflows_since_rescale": 1.0,
        "num_skipped_steps": 12.0,
        "overflows_at_min_scale": 0.0,
    }


def test_invalid_counters_and_static_state_dicts() -> None:
    scaler = cstorch.amp.GradScaler(**DLS)
    with pytest.raises(ValueError, match="overflows_at_min_scale"):
        scaler.load_state_dict({"overflows_at_min_scale": torch.tensor(-1)})
    static = cstorch.amp.GradScaler(loss_scale=8.0)
    assert list(static.state_dict()) == ["loss_scale"]
    with pytest.raises(ValueError, match="overflows_at_min_scale"):
        static.load_state_dict({"loss_scale": 8.0, "overflows_at_min_scale": 0})


# ------------------------------------------------------------------ scaler_metrics


def unscaled_norm(net: Net, inv_scale: float) -> float:
    grads = [p.grad.double() * inv_scale for p in net.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])))


def test_scaler_metrics_numbers_and_tensors() -> None:
    net = Net()
    optimizer = make_optimizer(net)
    scaler = cstorch.amp.GradScaler(**DLS)
    assert cstorch.amp.scaler_metrics(scaler) == {
        "loss_scale": 256.0,
        "num_skipped_steps": 0,
        "global_norm": 0.0,
        "isfinite": True,
    }
    # A healthy step: the norm of the unscaled gradients (float64 oracle, before Adam's step).
    optimizer.zero_grad()
    scaler.scale(loss_of(net)).backward()
    norm = unscaled_norm(net, 1.0 / 256.0)
    scaler.step(optimizer)
    scaler.update()
    metrics = cstorch.amp.scaler_metrics(scaler)
    assert [type(v) for v in metrics.values()] == [float, int, float, bool]
    assert metrics["loss_scale"] == 256.0 and metrics["num_skipped_steps"] == 0
    assert metrics["isfinite"] is True
    assert metrics["global_norm"] == pytest.approx(norm, rel=1e-6)
    # An overflow: skipped, the scale halves, the norm is not finite.
    poisoned_iteration(scaler, net, optimizer, 1, bad=True)
    metrics = cstorch.amp.scaler_metrics(scaler)
    assert metrics["loss_scale"] == 128.0 and metrics["num_skipped_steps"] == 1
    assert metrics["isfinite"] is False and not math.isfinite(metrics["global_norm"])

    tensors = cstorch.amp.scaler_metrics(scaler, as_tensors=True)
    assert list(tensors) == list(metrics)
    expected_dtypes = [torch.float32, torch.int64, torch.float32, torch.bool]
    for (key, value), dtype in zip(tensors.items(), expected_dtypes, strict=True):
        assert isinstance(value, torch.Tensor) and value.shape == () and value.dtype == dtype
        if key == "global_norm":
            assert not bool(torch.isfinite(value))
        else:
            assert value.item() == metrics[key]
    tensors["loss_scale"].fill_(1.0)  # a copy: the scaler's scale is untouched
    assert float(scaler.get_scale()) == 128.0


def test_scaler_metrics_of_static_scaling() -> None:
    net = Net()
    optimizer = make_optimizer(net)
    scaler = cstorch.amp.GradScaler(loss_scale=4.0)
    clean_iteration(scaler, net, optimizer, 0)
    assert cstorch.amp.scaler_metrics(scaler) == {
        "loss_scale": 4.0,
        "num_skipped_steps": 0,
        "global_norm": 0.0,
        "isfinite": True,
    }


def test_scaler_metrics_logged_with_summary_writer(tmp_path: Any) -> None:
    """Logged with a real SummaryWriter and read back from the event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    net = Net()
    optimizer = make_optimizer(net)
    scaler = cstorch.amp.GradScaler(**DLS)
    logged: list[dict[str, Any]] = []
    with SummaryWriter(log_dir=str(tmp_path)) as writer:
        for step in range(6):
            poisoned_iteration(scaler, net, optimizer, step, bad=step in (2, 3))
            metrics = cstorch.amp.scaler_metrics(scaler)
            logged.append(metrics)
            for name, value in metrics.items():
                writer.add_scalar(f"amp/{name}", value, step)
            for name, value in cstorch.amp.scaler_metrics(scaler, as_tensors=True).items():
                writer.add_scalar(f"amp_tensors/{name}", value, step)

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    names = ["loss_scale", "num_skipped_steps", "global_norm", "isfinite"]
    assert sorted(events.Tags()["scalars"]) == sorted(
        f"{prefix}/{name}" for prefix in ("amp", "amp_tensors") for name in names
    )
    for prefix in ("amp", "amp_tensors"):
        for name in names:
            read = events.Scalars(f"{prefix}/{name}")
            assert [e.step for e in read] == list(range(6))
            expected = [float(np.float32(m[name])) for m in logged]
            got = [e.value for e in read]
            if name == "global_norm":
                assert [math.isfinite(v) for v in got] == [True, True, False, False, True, True]
                finite = [(g, e) for g, e in zip(got, expected, strict=True) if math.isfinite(e)]
                assert all(g == pytest.approx(e, rel=1e-6) for g, e in finite)
            else:
                assert got == expected, f"{prefix}/{name}"
    assert [m["loss_scale"] for m in logged] == [256.0, 256.0, 128.0, 64.0, 64.0, 64.0]
    assert [m["num_skipped_steps"] for m in logged] == [0, 0, 1, 2, 2, 2]
    assert [m["isfinite"] for m in logged] == [True, True, False, False, True, True]
