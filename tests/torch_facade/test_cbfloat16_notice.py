"""cbfloat16 off Cerebras hardware says what it is: one warning at the first decision.

A ModelZoo config with ``fp16_type: cbfloat16`` and dynamic loss scaling gets cbfloat16's
defaults (``2**31``), while a model in the float16 proxy computes with float16 numerics: the
first steps overflow and are skipped. The warning must come exactly then (once, pointing at
the user's code, naming both remedies), and not where the numerics are fine: real cbfloat16
numerics (``cbfloat16_numerics``), a float16-range ``init_scale``, another half dtype, or a
resumed run whose scale is already in float16's range. The skipped steps it announces are
checked too: the scale halves from ``2**31`` on every one (SPEC section 2).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import pytest
import torch
from facade_helpers import TinyNet, loss_of

import torch_facade as cstorch

# float16 models: the scaler's one-time note that it unscales them in their own dtype is expected.
pytestmark = pytest.mark.filterwarnings("ignore:GradScaler is unscaling gradients")

NOTICE = r"cbfloat16_numerics\(model\).*init_scale=2\*\*15"


@contextlib.contextmanager
def no_warnings() -> Iterator[None]:
    """Every warning is an error, except the scaler's own note on float16 gradients."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message="GradScaler is unscaling gradients")
        yield


def run(model, scaler, steps: int, autocast: bool = False, optimizer=None):
    """``steps`` scaled SGD steps of ``model``; returns the optimizer (to go on with it)."""
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        optimizer.zero_grad()
        if autocast:
            with cstorch.amp.autocast(device_type="cpu"):
                loss = loss_of(model, step).float()
        else:
            loss = loss_of(model, step).float()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return optimizer


def test_cbfloat16_defaults_with_a_float16_proxy_model_warn_once_at_the_first_decision():
    proxy = cstorch.amp.set_half_dtype("cbfloat16")
    model = TinyNet(dtype=proxy)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
    assert float(scaler.get_scale()) == 2.0**31
    with pytest.warns(UserWarning, match=NOTICE) as caught:
        optimizer = run(model, scaler, 3)
    notices = [w for w in caught if "cbfloat16_numerics" in str(w.message)]
    assert len(notices) == 1
    assert notices[0].filename == __file__
    assert "2.14748e+09" in str(notices[0].message)  # the scale it found: 2**31
    # What it announced: the steps overflow in float16 and are skipped, halving the scale.
    assert int(scaler.get_num_skipped_steps()) == 3
    assert float(scaler.get_scale()) == 2.0**28
    with no_warnings():
        run(model, scaler, 1, optimizer=optimizer)  # once per scaler


def test_cbfloat16_proxy_autocast_warns_too():
    cstorch.amp.set_half_dtype("cbfloat16")
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
    with pytest.warns(UserWarning, match=NOTICE):
        run(TinyNet(), scaler, 1, autocast=True)  # float32 weights, float16 compute


@pytest.mark.parametrize("case", ["cbfloat16_numerics", "init_scale", "float16", "resumed"])
def test_no_warning_where_the_numerics_are_fine(case: str):
    half = "float16" if case == "float16" else "cbfloat16"
    proxy = cstorch.amp.set_half_dtype(half)
    kwargs = {"init_scale": 2.0**15} if case == "init_scale" else {}
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", **kwargs)
    if case == "resumed":
        scaler.load_state_dict({"loss_scale": 2.0**10})
    with no_warnings():
        if case == "cbfloat16_numerics":
            model = TinyNet()  # float32: the exact container of cbfloat16 values
            with cstorch.amp.cbfloat16_numerics(model):
                run(model, scaler, 2)
        else:
            run(TinyNet(dtype=proxy), scaler, 2)


def test_a_float32_model_without_autocast_is_not_warned():
    cstorch.amp.set_half_dtype("cbfloat16")
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
    with no_warnings():
        run(TinyNet(), scaler, 2)
    assert int(scaler.get_num_skipped_steps()) == 0
