"""Every name ``cerebras.pytorch.amp`` exports exists here, with the reference's signature.

The oracle for names and signatures is the reference's own source (``cerebras_pytorch`` 2.9.0
wheel: ``amp/__init__.py``, ``_amp_state.py``, ``amp.py``, ``conditional_update.py``,
``handle.py``, ``_process_optimizer.py``, ``grad_scaler.py``, ``optimizer_step.py``), written
down below as data. The behaviours are checked against hand-computed results: which dtype a
cast gives, which values a skipped step restores.
"""

from __future__ import annotations

import inspect
import types
import warnings
from typing import Any

import pytest
import torch
from facade_helpers import INF, TinyNet, loss_of

import torch_facade as cstorch
from torch_facade.amp import casting

# The reference's exports (amp/__init__.py), with each function's parameters as
# (name, default) in order; inspect.Parameter.empty marks a parameter without a default.
EMPTY = inspect.Parameter.empty
REFERENCE_SIGNATURES: dict[str, list[tuple[str, Any]]] = {
    "enable_mixed_precision": [("enable", True)],
    "get_floating_point_dtype": [("default", torch.float32)],
    "get_floating_point_dtype_str": [("default", "float32")],
    "get_half_dtype": [],
    "get_half_dtype_str": [],
    "is_cbfloat16_tensor": [("tensor", EMPTY)],
    "mixed_precision": [],
    "set_half_dtype": [("value", EMPTY)],
    "setup_optimizer": [("optimizer", EMPTY)],  # the reference's _process_optimizer
    "float_function": [("fn", EMPTY)],
    "half_function": [("fn", EMPTY)],
    "promote_function": [("fn", EMPTY)],
    "init": [
        ("enabled", True),
        ("enable_caching", True),
        ("verbose", False),
        ("allow_banned", False),
    ],
    "register_float_function": [("module", EMPTY), ("name", EMPTY)],
    "register_half_function": [("module", EMPTY), ("name", EMPTY)],
    "register_promote_function": [("module", EMPTY), ("name", EMPTY)],
    "autocast": [("dtype", None)],
    "isfinite": [("optimizer", EMPTY)],
    "update_if_finite": [("optimizer", EMPTY), ("tensor", EMPTY)],
    "disable_casts": [],
    "optimizer_step": [
        ("loss", EMPTY),
        ("optimizer", EMPTY),
        ("grad_scaler", EMPTY),
        ("max_gradient_norm", None),
        ("max_gradient_value", None),
    ],
    "GradScaler": [
        ("loss_scale", None),
        ("init_scale", None),
        ("steps_per_increase", None),
        ("min_loss_scale", None),
        ("max_loss_scale", None),
        ("overflow_tolerance", 0.0),
        ("max_gradient_norm", None),
    ],
}


@pytest.fixture(autouse=True)
def no_apex_handle():
    """Each test starts and ends without ``init()``'s handle and with an empty registry."""
    assert casting._STATE.handle is None
    yield
    if casting._STATE.handle is not None:
        casting._STATE.handle._deactivate()
    casting._STATE.registry.clear()


def initialized() -> casting.AmpHandle:
    with pytest.warns(UserWarning, match="torch's own functions are not patched"):
        return cstorch.amp.init()


@pytest.mark.parametrize("name", sorted(REFERENCE_SIGNATURES))
def test_every_reference_name_exists_with_its_signature(name: str):
    assert name in cstorch.amp.__all__
    obj = getattr(cstorch.amp, name)
    parameters = inspect.signature(obj).parameters.values()
    positional = [p for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in positional] == REFERENCE_SIGNATURES[name]
    # Anything this project adds is keyword-only, so the reference's calls bind the same way.
    extra = [p for p in parameters if p not in positional]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extra), extra
    assert obj.__doc__ and "Example" in (obj.__doc__ + (obj.__init__.__doc__ or ""))


# ------------------------------------------------------------------ the half dtype queries


def test_enable_mixed_precision_returns_the_new_setting():
    assert cstorch.amp.enable_mixed_precision(False) is False
    assert cstorch.amp.mixed_precision() is False
    assert cstorch.amp.enable_mixed_precision() is True
    assert cstorch.amp.enable_mixed_precision(enable=False) is False
    assert cstorch.amp.mixed_precision() is False


def test_enable_mixed_precision_takes_the_reference_keyword_only():
    with pytest.raises(TypeError, match="use"):
        cstorch.amp.enable_mixed_precision(use=True)  # the old name is gone
    with pytest.raises(TypeError, match=r"enable must be a bool; got 1 \(int\)"):
        cstorch.amp.enable_mixed_precision(1)


@pytest.mark.parametrize(
    ("half_dtype", "expected"),
    [("float16", "float16"), ("bfloat16", "bfloat16"), ("cbfloat16", "cbfloat16")],
)
def test_get_floating_point_dtype_str_names_the_half_dtype_when_enabled(half_dtype, expected):
    cstorch.amp.set_half_dtype(half_dtype)
    assert cstorch.amp.get_floating_point_dtype_str() == expected
    assert cstorch.amp.get_floating_point_dtype_str("ignored") == expected
    cstorch.amp.enable_mixed_precision(False)
    assert cstorch.amp.get_floating_point_dtype_str() == "float32"
    assert cstorch.amp.get_floating_point_dtype_str(default="float64") == "float64"


def test_get_floating_point_dtype_str_rejects_a_non_string_default():
    with pytest.raises(TypeError, match=r"default must be a str; got torch.float32"):
        cstorch.amp.get_floating_point_dtype_str(torch.float32)


# ------------------------------------------------------------------ the apex-style casts


def test_decorators_pass_through_until_init():
    seen: list[torch.dtype] = []
    half = cstorch.amp.half_function(lambda x: seen.append(x.dtype) or x)
    half(torch.ones(1))
    assert seen == [torch.float32]
    initialized()
    half(torch.ones(1))
    assert seen == [torch.float32, torch.float16]


@pytest.mark.parametrize(
    ("half_dtype", "expected"),
    [("float16", torch.float16), ("bfloat16", torch.bfloat16), ("cbfloat16", torch.float16)],
)
def test_half_function_casts_floating_arguments_to_the_half_dtype(half_dtype, expected):
    cstorch.amp.set_half_dtype(half_dtype)
    initialized()

    @cstorch.amp.half_function
    def dtypes(a, pair, count, *, b, mixed):
        return a.dtype, [t.dtype for t in pair], count.dtype, b.dtype, [type(m) for m in mixed]

    a, b = torch.ones(2, dtype=torch.float64), torch.ones(2)
    pair = (torch.ones(1), torch.ones(1, dtype=torch.bfloat16))
    result = dtypes(a, pair, torch.ones(1, dtype=torch.int64), b=b, mixed=[torch.ones(1), 3])
    assert result == (expected, [expected, expected], torch.int64, expected, [torch.Tensor, int])


def test_float_function_casts_every_floating_argument_to_float32():
    initialized()
    dtypes = cstorch.amp.float_function(lambda *xs, **kw: [x.dtype for x in (*xs, *kw.values())])
    args = [torch.ones(1, dtype=d) for d in (torch.float16, torch.bfloat16, torch.float64)]
    assert dtypes(*args, k=torch.ones(1, dtype=torch.float16)) == [torch.float32] * 4
    assert dtypes(torch.ones(1, dtype=torch.int32)) == [torch.int32]


@pytest.mark.parametrize(
    ("dtypes", "expected"),
    [
        ((torch.float32, torch.float16), (torch.float32, torch.float32)),
        ((torch.bfloat16, torch.float32), (torch.float32, torch.float32)),
        ((torch.float16, torch.float16), (torch.float16, torch.float16)),
        ((torch.float64, torch.float32), (torch.float64, torch.float32)),  # not amp's mix
        ((torch.float16, torch.bfloat16), (torch.float16, torch.bfloat16)),
    ],
)
def test_promote_function_promotes_a_float32_and_16_bit_mix(dtypes, expected):
    initialized()
    promoted = cstorch.amp.promote_function(lambda a, b: (a.dtype, b.dtype))
    assert promoted(*(torch.ones(1, dtype=d) for d in dtypes)) == expected


def test_registered_functions_are_patched_by_init_and_restored_by_deactivate():
    ops = types.SimpleNamespace(mm=torch.mm, softmax=torch.softmax, add=torch.add)
    cstorch.amp.register_half_function(ops, "mm")
    cstorch.amp.register_float_function(ops, "softmax")
    cstorch.amp.register_promote_function(ops, "add")
    assert ops.mm is torch.mm  # nothing patched before init()
    handle = initialized()
    half = torch.ones(2, 2, dtype=torch.float16)
    assert ops.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype is torch.float16
    assert ops.softmax(half, 0).dtype is torch.float32
    assert ops.add(half, torch.ones(2, 2)).dtype is torch.float32
    handle._deactivate()
    assert (ops.mm, ops.softmax, ops.add) == (torch.mm, torch.softmax, torch.add)


def test_a_function_registered_after_init_is_patched_at_once():
    handle = initialized()
    ops = types.SimpleNamespace(mm=torch.mm)
    cstorch.amp.register_half_function(ops, "mm")
    assert ops.mm(torch.ones(1, 1), torch.ones(1, 1)).dtype is torch.float16
    handle._deactivate()
    assert ops.mm is torch.mm


def test_register_rejects_missing_and_non_callable_names():
    ops = types.SimpleNamespace(value=3)
    with pytest.raises(ValueError, match="No function named mm in module namespace"):
        cstorch.amp.register_half_function(ops, "mm")
    with pytest.raises(TypeError, match=r"value must be callable; got 3"):
        cstorch.amp.register_float_function(ops, "value")
    with pytest.raises(TypeError, match=r"name must be a str; got 7 \(int\)"):
        cstorch.amp.register_promote_function(ops, 7)
    with pytest.raises(TypeError, match=r"fn must be callable; got 'x' \(str\)"):
        cstorch.amp.half_function("x")


def test_init_runs_once_and_enables_mixed_precision():
    cstorch.amp.enable_mixed_precision(False)
    handle = initialized()
    assert cstorch.amp.mixed_precision() is True
    assert handle.is_active() and not handle.has_cache
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning either
        assert cstorch.amp.init(verbose=True) is handle


def test_init_disabled_gives_an_inactive_handle():
    cstorch.amp.enable_mixed_precision(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle = cstorch.amp.init(enabled=False)
    assert not handle.is_active()
    assert cstorch.amp.mixed_precision() is False
    half = cstorch.amp.half_function(lambda x: x.dtype)
    assert half(torch.ones(1)) is torch.float32


def test_init_rejects_non_bool_arguments():
    with pytest.raises(TypeError, match=r"verbose must be a bool; got 'yes' \(str\)"):
        cstorch.amp.init(verbose="yes")


def test_verbose_prints_each_cast(capsys: pytest.CaptureFixture[str]):
    with pytest.warns(UserWarning):
        cstorch.amp.init(verbose=True)

    def attention(q):
        return q

    cstorch.amp.float_function(attention)(torch.ones(1, dtype=torch.float16))
    cstorch.amp.float_function(attention)(torch.ones(1))  # nothing to cast: nothing printed
    assert capsys.readouterr().out.splitlines() == [
        "float16->float32 (test_verbose_prints_each_cast.<locals>.attention)"
    ]


def test_init_warns_when_float16_steps_without_a_scaler():
    cstorch.amp.set_half_dtype("float16")
    initialized()
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_of(model, 0).backward()
    with pytest.warns(UserWarning, match="no grad scaler steps this SGD") as caught:
        optimizer.step()
    assert caught[0].filename == __file__
    cstorch.amp.set_half_dtype("bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()  # bfloat16 needs no scaler


def test_init_does_not_warn_for_an_optimizer_a_scaler_steps():
    cstorch.amp.set_half_dtype("float16")
    initialized()
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=2.0**8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.scale(loss_of(model, 0)).backward()
        scaler.step(optimizer)
        scaler.update()


# ------------------------------------------------------------------------- disable_casts


def test_disable_casts_turns_an_open_autocast_off_and_back_on():
    linear = torch.nn.Linear(2, 2)
    with cstorch.amp.autocast(torch.bfloat16):
        with cstorch.amp.disable_casts():
            assert not torch.is_autocast_enabled("cpu")
            assert linear(torch.ones(1, 2)).dtype is torch.float32
            with cstorch.amp.disable_casts():  # nests
                assert linear(torch.ones(1, 2)).dtype is torch.float32
            assert linear(torch.ones(1, 2)).dtype is torch.float32
        assert torch.is_autocast_enabled("cpu")
        assert linear(torch.ones(1, 2)).dtype is torch.bfloat16


def test_an_autocast_entered_inside_disable_casts_casts_nothing():
    with cstorch.amp.disable_casts():
        with cstorch.amp.autocast(torch.bfloat16):
            assert not torch.is_autocast_enabled("cpu")
            assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype is torch.float32
        with cstorch.amp.autocast(torch.float64):  # nothing is cast, so nothing is rejected
            pass
    with cstorch.amp.autocast(torch.bfloat16):
        assert torch.is_autocast_enabled("cpu")


def test_disable_casts_stops_the_apex_style_casts_and_restores_them_after_an_error():
    handle = initialized()
    half = cstorch.amp.half_function(lambda x: x.dtype)
    with pytest.raises(KeyError), cstorch.amp.disable_casts():
        assert not handle.is_active()
        assert half(torch.ones(1)) is torch.float32
        raise KeyError("inside")
    assert handle.is_active()
    assert half(torch.ones(1)) is torch.float16


def test_disable_casts_turns_a_torch_autocast_off_too():
    with torch.autocast("cpu", dtype=torch.bfloat16), cstorch.amp.disable_casts():
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype is torch.float32


# ------------------------------------------------------------ setup_optimizer, no equivalent


def test_setup_optimizer_says_what_to_use_instead():
    optimizer = torch.optim.SGD(TinyNet().parameters(), lr=0.1)
    with pytest.raises(
        NotImplementedError, match=r"GradScaler\(\.\.\., optimizers=\[optimizer\]\)"
    ):
        cstorch.amp.setup_optimizer(optimizer)


# ------------------------------------------------------------ update_if_finite, isfinite

DLS = {"loss_scale": "dynamic", "init_scale": 2.0**8}


class StepCountingScheduler:
    """A scheduler written as cstorch's are: its step counter is a tensor it marks."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.last_epoch = torch.tensor(0)

    def step(self) -> None:
        cstorch.amp.update_if_finite(self.optimizer, self.last_epoch)
        self.last_epoch += 1


def scaled_iteration(scaler, model, optimizer, step: int, poison: bool) -> None:
    optimizer.zero_grad()
    scaler.scale(loss_of(model, step)).backward()
    if poison:
        model.fc1.weight.grad[0, 0] = INF
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()


def test_a_scheduler_counter_marked_after_update_rolls_back_on_skipped_steps():
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = cstorch.amp.GradScaler(**DLS)
    scheduler = StepCountingScheduler(optimizer)
    skipped = {1, 3, 4}
    counts = []
    for step in range(7):
        scaled_iteration(scaler, model, optimizer, step, poison=step in skipped)
        scheduler.step()  # after update(), as in torch's loop order
        counts.append(int(scheduler.last_epoch))
    # Right after a skipped step's scheduler.step() the counter is advanced; the next
    # iteration's scale() rolls it back before it counts again. Hand-computed:
    assert counts == [1, 2, 2, 3, 3, 3, 4]
    scaler.scale(loss_of(model, 7))  # the start of the next iteration settles the last mark
    assert int(scheduler.last_epoch) == 7 - len(skipped)
    assert int(scaler.get_num_skipped_steps()) == len(skipped)


def test_a_tensor_marked_before_update_is_restored_at_update():
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = cstorch.amp.GradScaler(**DLS)
    buffer = torch.tensor([1.0, 2.0])
    for step, poison in enumerate([False, True]):
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        if poison:
            model.fc2.bias.grad[0] = INF
        cstorch.amp.update_if_finite(optimizer, buffer)
        buffer.mul_(10)
        scaler.step(optimizer)
        assert buffer.tolist() == ([10.0, 20.0] if step == 0 else [100.0, 200.0])
        scaler.update()
        assert buffer.tolist() == [
            10.0,
            20.0,
        ]  # kept after the applied step, restored after the skip


def test_a_tensor_marked_in_a_fused_optimizer_step_hook_is_restored():
    # A fused optimizer runs its step even when it skips (its kernel does nothing), so its
    # step hooks run: cstorch's sparsity code marks its state there.
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    scaler = cstorch.amp.GradScaler(**DLS)
    hook_calls = torch.tensor(0)
    runs: list[int] = []

    def count(opt, args, kwargs):
        runs.append(1)
        cstorch.amp.update_if_finite(opt, hook_calls)
        hook_calls.add_(1)

    optimizer.register_step_post_hook(count)
    for step in range(4):
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        if step >= 2:
            model.fc1.bias.grad[0] = INF
        scaler.step(optimizer)
        scaler.update()
    assert len(runs) == 4  # the fused kernel ran (and skipped) on steps 2 and 3
    assert int(hook_calls) == 2  # the two skipped steps' increments were rolled back


def test_isfinite_reads_the_decision_of_the_scaler_that_steps_the_optimizer():
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    assert cstorch.amp.isfinite(optimizer) is True  # no scaler has met it: the reference's True
    assert cstorch.amp.isfinite(None) is True
    scaler = cstorch.amp.GradScaler(**DLS)
    optimizer.zero_grad()
    scaler.scale(loss_of(model, 0)).backward()
    model.fc1.weight.grad[0, 0] = INF
    scaler.unscale_(optimizer)
    flag = cstorch.amp.isfinite(optimizer)
    assert isinstance(flag, torch.Tensor) and flag.dtype is torch.bool and not bool(flag)
    scaler.step(optimizer)
    scaler.update()
    assert not bool(cstorch.amp.isfinite(optimizer))  # still the last decision
    scaled_iteration(scaler, model, optimizer, 1, poison=False)
    assert bool(cstorch.amp.isfinite(optimizer))


def test_update_if_finite_does_nothing_without_a_dynamic_scaler():
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    counter = torch.tensor(0)
    cstorch.amp.update_if_finite(None, counter)  # the reference's sparsity code passes None
    cstorch.amp.update_if_finite(optimizer, counter)  # no scaler has met it
    counter += 1
    static = cstorch.amp.GradScaler(loss_scale=4.0)
    optimizer.zero_grad()
    static.scale(loss_of(model, 0)).backward()
    model.fc1.weight.grad[0, 0] = INF  # static scaling never checks: the step is applied
    static.step(optimizer)
    cstorch.amp.update_if_finite(optimizer, counter)
    counter += 1
    static.update()
    static.scale(loss_of(model, 1))
    assert int(counter) == 2


def test_update_if_finite_rejects_wrong_types():
    optimizer = torch.optim.SGD(TinyNet().parameters(), lr=0.01)
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer \(or None\)"):
        cstorch.amp.update_if_finite("sgd", torch.tensor(0))
    with pytest.raises(TypeError, match=r"tensor must be a torch.Tensor; got 3 \(int\)"):
        cstorch.amp.update_if_finite(optimizer, 3)
    with pytest.raises(TypeError, match="optimizer must be"):
        cstorch.amp.isfinite(object())
