"""The process-wide half dtype API (SPEC section 6).

The autouse fixture in ``conftest.py`` restores the state after every test.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import torch_facade as cstorch


@pytest.mark.parametrize(
    ("value", "name", "dtype"),
    [
        ("float16", "float16", torch.float16),
        ("bfloat16", "bfloat16", torch.bfloat16),
        ("cbfloat16", "cbfloat16", torch.float16),  # float16 is the proxy dtype
        (torch.float16, "float16", torch.float16),
        (torch.bfloat16, "bfloat16", torch.bfloat16),
    ],
)
def test_set_half_dtype_returns_the_model_dtype_and_enables_mixed_precision(value, name, dtype):
    cstorch.amp.enable_mixed_precision(False)
    assert cstorch.amp.set_half_dtype(value) is dtype
    assert cstorch.amp.get_half_dtype() is dtype
    assert cstorch.amp.get_half_dtype_str() == name
    assert cstorch.amp.mixed_precision() is True
    assert cstorch.amp.get_floating_point_dtype() is dtype


def test_enable_mixed_precision_switches_the_floating_point_dtype_and_keeps_the_half_dtype():
    cstorch.amp.set_half_dtype("bfloat16")
    cstorch.amp.enable_mixed_precision(False)
    assert cstorch.amp.mixed_precision() is False
    assert cstorch.amp.get_floating_point_dtype() is torch.float32
    assert cstorch.amp.get_floating_point_dtype(torch.float64) is torch.float64
    assert cstorch.amp.get_half_dtype_str() == "bfloat16"
    cstorch.amp.enable_mixed_precision()
    assert cstorch.amp.mixed_precision() is True
    assert cstorch.amp.get_floating_point_dtype(torch.float64) is torch.bfloat16


def test_is_cbfloat16_tensor():
    half = torch.zeros(3, dtype=torch.float16)
    cstorch.amp.set_half_dtype("float16")
    assert cstorch.amp.is_cbfloat16_tensor(half) is False
    cstorch.amp.set_half_dtype("cbfloat16")
    assert cstorch.amp.is_cbfloat16_tensor(half) is True
    assert cstorch.amp.is_cbfloat16_tensor(half.float()) is False
    assert cstorch.amp.is_cbfloat16_tensor(half.bfloat16()) is False
    cstorch.amp.enable_mixed_precision(False)
    assert cstorch.amp.is_cbfloat16_tensor(half) is False


def test_default_state_in_a_fresh_process():
    """Default: mixed precision off, half dtype float16 (checked where no test changed it)."""
    code = textwrap.dedent(
        """
        import torch, torch_facade as cstorch
        assert cstorch.amp.mixed_precision() is False
        assert cstorch.amp.get_half_dtype_str() == "float16"
        assert cstorch.amp.get_half_dtype() is torch.float16
        assert cstorch.amp.get_floating_point_dtype() is torch.float32
        scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
        assert float(scaler.get_scale()) == 2.0**15
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU rule of autocast")
def test_autocast_on_cpu_with_bfloat16():
    layer = torch.nn.Linear(3, 2)
    x = torch.ones(4, 3)
    with cstorch.amp.autocast(torch.bfloat16):
        y = layer(x)
    assert y.dtype is torch.bfloat16
    cstorch.amp.set_half_dtype("bfloat16")
    with cstorch.amp.autocast():
        z = layer(x)
    assert z.dtype is torch.bfloat16
    assert layer(x).dtype is torch.float32  # autocast ended
    with cstorch.amp.autocast("bfloat16"):
        assert layer(x).dtype is torch.bfloat16
