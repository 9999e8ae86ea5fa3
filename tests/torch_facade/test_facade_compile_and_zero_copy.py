"""The jitted core compiles once per gradient structure; gradients reach JAX without copies."""

from __future__ import annotations

import contextlib
import itertools

import jax
import pytest
import torch
from facade_helpers import INF, NAN, TinyNet, loss_of

import torch_facade as cstorch
from torch_facade.amp import _bridge

pytestmark = pytest.mark.filterwarnings("ignore:GradScaler is unscaling gradients")

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"


@contextlib.contextmanager
def jax_compile_events():
    """Collects the names of JAX's compile-time events while the block runs."""
    events: list[str] = []

    def listener(event: str, duration: float, **kwargs) -> None:
        events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def mixed_setup(config_kwargs):
    """A float32 model with fused Adam and a bfloat16 layer with SGD: two dtype groups."""
    model = TinyNet()
    half = torch.nn.Linear(2, 3).to(torch.bfloat16)
    first = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    second = torch.optim.SGD(half.parameters(), lr=0.1, momentum=0.9)
    scaler = cstorch.amp.GradScaler(**config_kwargs, optimizers=[first, second])
    return model, half, (first, second), scaler


def mixed_step(model, half, optimizers, scaler, step):
    first, second = optimizers
    loss = loss_of(model, step) + half(model(torch.ones(1, 4)).bfloat16()).float().square().sum()
    if step % 3 == 0:
        first.zero_grad(set_to_none=False)
        second.zero_grad(set_to_none=False)
    else:
        first.zero_grad()
        second.zero_grad()
    scaler.scale(loss).backward()
    if step % 4 == 1:
        model.fc1.weight.grad[0, 0] = INF
    if step % 5 == 2:
        half.weight.grad[0, 0] = NAN
    if step % 2:
        scaler.unscale_(first)
        scaler.unscale_(second)
    scaler.step(first)
    scaler.step(second)
    scaler.update()


@pytest.mark.parametrize("clip", [None, 0.5], ids=["dls", "dls-gcc"])
def test_no_compilation_after_warm_up_over_40_steps_with_overflows(clip):
    # A configuration no other test uses, so the jit caches start empty.
    config = {"loss_scale": "dynamic", "init_scale": 2.0**9, "steps_per_increase": 3}
    if clip is not None:
        config["max_gradient_norm"] = clip
    model, half, optimizers, scaler = mixed_setup(config)
    with jax_compile_events() as warm_up:
        for step in range(2):  # both paths: implicit (step 0) and explicit (step 1) unscale
            mixed_step(model, half, optimizers, scaler, step)
        scaler.load_state_dict(scaler.state_dict())
    assert COMPILE_EVENT in warm_up  # the listener works: the warm-up compiled the cores
    with jax_compile_events() as events:
        for step in range(2, 42):
            mixed_step(model, half, optimizers, scaler, step)
            if step == 20:
                scaler.load_state_dict(scaler.state_dict())
    assert events.count(COMPILE_EVENT) == 0, events
    assert events.count(TRACE_EVENT) == 0, events
    assert 5 < int(scaler.get_num_skipped_steps()) < 40
    cfg = scaler.config
    assert _bridge.step_core(cfg, False)._cache_size() == 1
    assert _bridge.step_core(cfg, True)._cache_size() == 1


def test_a_new_gradient_structure_compiles_once_more():
    """The counter is not blind: a model of another shape compiles a new executable."""
    config = {"loss_scale": "dynamic", "init_scale": 2.0**10, "steps_per_increase": 5}
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(**config)
    scaler.scale(loss_of(model, 0)).backward()
    scaler.step(optimizer)
    scaler.update()
    other = torch.nn.Linear(4, 7)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    other_scaler = cstorch.amp.GradScaler(**config)
    with jax_compile_events() as events:
        other_scaler.scale(other(torch.ones(2, 4)).sum()).backward()
        other_scaler.step(other_opt)
        other_scaler.update()
    assert events.count(COMPILE_EVENT) >= 1
    assert _bridge.step_core(scaler.config, False)._cache_size() == 2


def flat_ranges(scaler) -> list[tuple[int, int, torch.Tensor]]:
    flats = scaler._arena.flats()
    return [(f.data_ptr(), f.data_ptr() + f.numel() * f.element_size(), f) for f in flats]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_are_views_of_aligned_flats_that_jax_imports_without_copies(set_to_none):
    model, half, optimizers, scaler = mixed_setup({"loss_scale": "dynamic", "init_scale": 2.0**8})
    params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    for step in range(3):
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)
        loss = loss_of(model, step) + half(torch.ones(1, 2, dtype=torch.bfloat16)).float().sum()
        scaler.scale(loss).backward()
        held = [p.grad for p in params]
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update()
        ranges = flat_ranges(scaler)
        assert {f.dtype for _, _, f in ranges} == {torch.float32, torch.bfloat16}
        for lo, _, flat in ranges:
            assert lo % 64 == 0
            assert jax.dlpack.from_dlpack(flat).unsafe_buffer_pointer() == flat.data_ptr()
        for param, grad in zip(params, held, strict=True):
            if param.grad is None:
                assert grad is None
                continue
            assert param.grad is grad  # the tensor the user holds is the one in the arena
            start = param.grad.data_ptr()
            end = start + param.grad.numel() * param.grad.element_size()
            assert any(lo <= start and end <= hi for lo, hi, _ in ranges)
            assert param.grad.dtype is param.dtype
    # Gradient storages do not overlap each other.
    spans = sorted(
        (p.grad.data_ptr(), p.grad.data_ptr() + p.grad.numel() * p.grad.element_size())
        for p in params
        if p.grad is not None
    )
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))


def test_a_steady_step_crosses_dlpack_once(monkeypatch):
    """After warm-up, a step imports nothing into JAX and exports one array (the scalars).

    Each crossing costs tens of microseconds, so per-step work must not grow with the number
    of tensors or of outputs: the flats are imported once per arena (on the CPU), and the five
    numbers torch needs come out of the core packed into one array.
    """
    model, half, optimizers, scaler = mixed_setup({"loss_scale": "dynamic", "init_scale": 2.0**8})
    for step in range(3):  # warm-up: builds the arena, compiles, creates Adam's state
        mixed_step(model, half, optimizers, scaler, step)
    crossings = {"to_jax": 0, "to_torch": 0}
    for name in crossings:
        original = getattr(_bridge, name)

        def counted(value, _original=original, _name=name):
            crossings[_name] += 1
            return _original(value)

        monkeypatch.setattr(_bridge, name, counted)
    steps = 6
    for step in range(3, 3 + steps):
        optimizers[0].zero_grad(set_to_none=False)
        optimizers[1].zero_grad(set_to_none=False)
        loss = loss_of(model, step) + half(torch.ones(1, 2, dtype=torch.bfloat16)).float().sum()
        scaler.scale(loss).backward()
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update()
    assert crossings == {"to_jax": 0, "to_torch": steps}
