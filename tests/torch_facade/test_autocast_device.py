"""``cstorch.amp.autocast()`` follows the model's device, not the machine's.

The rule: with ``device_type`` the one device; without it every device a model could be on
(the CPU, the default device's type, and CUDA when torch sees a GPU), so each op autocasts on
the device it runs on. The case the issue reports, a CPU model on a machine with a GPU, is
reproduced on this CPU-only machine by making ``torch.cuda.is_available`` say True: the
autocast must still be a CPU autocast, and never silently a disabled one. The oracle of the
numbers is ``torch.autocast("cpu")`` itself: the two forward passes agree bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import torch_facade as cstorch
from torch_facade.amp.precision import autocast_device_types


@pytest.fixture
def gpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch says it sees a GPU (this machine has none: CUDA autocast flags still work)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def model_and_input() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return model, torch.randn(3, 8)


@pytest.mark.usefixtures("gpu_machine")
def test_a_cpu_model_on_a_gpu_machine_gets_a_cpu_autocast():
    cstorch.amp.set_half_dtype("float16")
    model, x = model_and_input()
    with cstorch.amp.autocast():
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") is torch.float16
        assert torch.is_autocast_enabled("cuda")  # a CUDA model would be autocast too
        out = model(x)
    assert out.dtype is torch.float16  # not float32: the CPU ops were autocast
    with torch.autocast("cpu", dtype=torch.float16):
        expected = model(x)
    assert torch.equal(out, expected)
    assert not torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled("cuda")


@pytest.mark.usefixtures("gpu_machine")
def test_the_covered_devices_on_a_gpu_machine():
    assert autocast_device_types() == ("cpu", "cuda")
    assert autocast_device_types("cuda:0") == ("cuda",)
    assert autocast_device_types(torch.device("cpu")) == ("cpu",)


def test_the_covered_devices_on_a_cpu_machine(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert autocast_device_types() == ("cpu",)


def test_the_default_device_is_covered(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch, "get_default_device", lambda: torch.device("xpu"))
    assert autocast_device_types() == ("cpu", "xpu")
    monkeypatch.setattr(torch, "get_default_device", lambda: torch.device("meta"))
    assert autocast_device_types() == ("cpu",)  # meta has no autocast


@pytest.mark.usefixtures("gpu_machine")
def test_a_device_type_restricts_the_autocast_to_that_device():
    cstorch.amp.set_half_dtype("bfloat16")
    model, x = model_and_input()
    with cstorch.amp.autocast(device_type="cpu"):
        assert torch.is_autocast_enabled("cpu")
        assert not torch.is_autocast_enabled("cuda")
        assert model(x).dtype is torch.bfloat16


@pytest.mark.usefixtures("gpu_machine")
def test_a_dtype_the_extra_device_rejects_is_an_error_not_a_silent_float32_run():
    # On this CPU-only build, torch's CUDA autocast cannot check bfloat16 support and raises;
    # on a GPU without bfloat16 it raises too. Either way: an error naming the way out.
    cstorch.amp.set_half_dtype("bfloat16")
    with pytest.raises(ValueError, match=r"'cuda'.*pass device_type= to choose one"):
        with cstorch.amp.autocast():
            pytest.fail("the body must not run")
    assert not torch.is_autocast_enabled("cpu")  # the CPU autocast already entered was undone


@pytest.mark.parametrize(
    ("device_type", "error", "match"),
    [
        (3, TypeError, r"device_type must be a str, a torch.device or None; got 3 \(int\)"),
        ("gpu0", ValueError, r"device_type must name a torch device type; got 'gpu0'"),
        ("meta", ValueError, r"device_type 'meta' has no torch.autocast"),
    ],
)
def test_a_bad_device_type_is_rejected(device_type, error, match):
    with pytest.raises(error, match=match):
        with cstorch.amp.autocast(device_type=device_type):
            pass
