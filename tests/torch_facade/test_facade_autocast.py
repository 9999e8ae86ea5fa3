"""``cstorch.amp.autocast`` on the CPU: what torch's CPU autocast accepts works, the rest fails.

torch 2.13 autocasts on the CPU to float16 and bfloat16. The oracle of the training tests is
the same loop under ``torch.autocast`` itself: with the same scaler, the two runs must agree
bit for bit. Rejection is torch's own: for a dtype its CPU autocast does not support it warns
and runs *without* autocast, which the facade turns into a ``ValueError``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import pytest
import torch

import torch_facade as cstorch

STEPS = 4


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes the facade choose the CPU even where torch sees a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def make_model() -> torch.nn.Module:
    """A small float32 MLP with fixed weights."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def train(
    autocast: Callable[[], contextlib.AbstractContextManager],
) -> tuple[torch.nn.Module, list[float], list[torch.dtype]]:
    """A few facade-scaled steps with the forward pass under ``autocast()``.

    Returns the model, the losses and the dtype of the first layer's output at each step.
    """
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=2.0**8)
    generator = torch.Generator().manual_seed(1)
    losses: list[float] = []
    hidden_dtypes: list[torch.dtype] = []
    hook = model[0].register_forward_hook(lambda _m, _i, out: hidden_dtypes.append(out.dtype))
    for _ in range(STEPS):
        x, y = torch.randn(32, 8, generator=generator), torch.randn(32, 1, generator=generator)
        optimizer.zero_grad()
        with autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    hook.remove()
    assert int(scaler.get_num_skipped_steps()) == 0
    return model, losses, hidden_dtypes


@pytest.mark.parametrize(
    ("half_dtype", "compute_dtype"),
    [("float16", torch.float16), ("bfloat16", torch.bfloat16), ("cbfloat16", torch.float16)],
)
def test_cpu_autocast_trains_like_torch_autocast(half_dtype: str, compute_dtype: torch.dtype):
    cstorch.amp.set_half_dtype(half_dtype)
    model, losses, hidden_dtypes = train(cstorch.amp.autocast)
    assert hidden_dtypes == [compute_dtype] * STEPS
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(p.dtype is torch.float32 for p in model.parameters())
    assert not torch.equal(model[0].weight, make_model()[0].weight)  # it trained
    assert not torch.is_autocast_enabled("cpu")

    oracle, oracle_losses, _ = train(lambda: torch.autocast("cpu", dtype=compute_dtype))
    assert losses == oracle_losses
    for param, expected in zip(model.parameters(), oracle.parameters(), strict=True):
        assert torch.equal(param, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, "float16", "cbfloat16"])
def test_explicit_dtype_overrides_the_half_dtype(dtype: torch.dtype | str):
    cstorch.amp.set_half_dtype("bfloat16")
    expected = torch.bfloat16 if dtype in (torch.bfloat16, "bfloat16") else torch.float16
    with cstorch.amp.autocast(dtype):
        assert torch.get_autocast_dtype("cpu") is expected
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype is expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8])
def test_a_dtype_torch_rejects_is_a_clear_error(dtype: torch.dtype):
    # The oracle: torch itself disables its CPU autocast for this dtype.
    with pytest.warns(UserWarning, match="not supported"), torch.autocast("cpu", dtype=dtype):
        assert not torch.is_autocast_enabled("cpu")

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's warning becomes the error, not a warning too
        with pytest.raises(ValueError, match=rf"{dtype}.*'cpu'") as raised:
            with cstorch.amp.autocast(dtype):
                pytest.fail("the body must not run without autocast")
    assert "only supports" in str(raised.value)  # torch's reason, passed on
    assert not torch.is_autocast_enabled("cpu")


def test_a_rejected_dtype_inside_autocast_restores_the_outer_autocast():
    with cstorch.amp.autocast(torch.bfloat16):
        with pytest.raises(ValueError, match="float64"):
            with cstorch.amp.autocast(torch.float64):
                pass
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") is torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")


def test_an_unknown_dtype_name_is_rejected_before_torch():
    with pytest.raises(ValueError, match="cbfloat16"):
        with cstorch.amp.autocast("half"):
            pass
