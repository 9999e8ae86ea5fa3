"""The per-decision bookkeeping the facade remembers between iterations (issue #10 speed work).

Which parameters take part, whether a fused optimizer has state for every gradient, and which
device the scaler state is on are remembered between iterations. These tests change what each
depends on after it was remembered (``add_param_group``, ``load_state_dict``, a replaced
``params`` list, a new state on another device) and check the behaviour, not the cache: an inf
in a newly added parameter still skips the step, and a skipped step never creates optimizer
state for a parameter that had none (oracle: snapshots taken before the step).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from facade_helpers import (
    DLS,
    INF,
    TinyNet,
    batch,
    deep_equal,
    loss_of,
    one_step,
    optimizer_snapshot,
)
from test_facade_compile_and_zero_copy import record_imports

import torch_facade as cstorch
from torch_facade.amp._engine import _dlpack, _gradients, _storage

pytestmark = pytest.mark.filterwarnings("ignore:GradScaler is unscaling gradients")


def _fused_adam(model: TinyNet) -> torch.optim.Adam:
    """Fused Adam over the parameters the loss reaches (all of them get state at the first step,
    which is when the facade can remember that they have)."""
    params = [*model.fc1.parameters(), *model.fc2.parameters()]
    return torch.optim.Adam(params, lr=0.01, fused=True)


def _train(
    scaler: cstorch.amp.GradScaler, model: TinyNet, optimizer: torch.optim.Optimizer
) -> None:
    for step in range(3):
        one_step(scaler, model, optimizer, step)
    assert int(scaler.get_num_skipped_steps()) == 0


def _extra_loss(model: TinyNet, extra: torch.nn.Parameter, step: int) -> torch.Tensor:
    return loss_of(model, step) + extra.square().sum()


def test_added_param_group_takes_part_in_the_decision() -> None:
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)
    _train(scaler, model, optimizer)
    extra = torch.nn.Parameter(torch.ones(3))
    optimizer.add_param_group({"params": [extra]})
    before = [p.detach().clone() for p in [*model.parameters(), extra]]

    optimizer.zero_grad()
    scaler.scale(_extra_loss(model, extra, 3)).backward()
    extra.grad[1] = INF  # only the new group overflows
    scaler.step(optimizer)
    scaler.update()

    assert not bool(scaler.get_isfinite())
    assert int(scaler.get_num_skipped_steps()) == 1
    for old, new in zip(before, [*model.parameters(), extra], strict=True):
        assert torch.equal(old, new)


def test_replaced_params_list_takes_part_in_the_decision() -> None:
    model = TinyNet()
    optimizer = torch.optim.SGD([model.fc1.weight], lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)
    _train(scaler, model, optimizer)
    # Same group, a new list of another length: the decision must read fc2.bias too.
    optimizer.param_groups[0]["params"] = [model.fc1.weight, model.fc2.bias]
    optimizer.zero_grad()
    scaler.scale(loss_of(model, 3)).backward()
    model.fc2.bias.grad[0] = INF
    weight = model.fc1.weight.detach().clone()
    scaler.step(optimizer)
    scaler.update()
    assert not bool(scaler.get_isfinite())
    assert torch.equal(weight, model.fc1.weight)


def test_fused_skip_after_add_param_group_creates_no_state() -> None:
    model = TinyNet()
    optimizer = _fused_adam(model)
    scaler = cstorch.amp.GradScaler(**DLS)
    _train(scaler, model, optimizer)  # every parameter now has state
    assert all(optimizer.state[p] for p in model.fc1.parameters())
    extra = torch.nn.Parameter(torch.ones(3))
    optimizer.add_param_group({"params": [extra]})

    optimizer.zero_grad()
    scaler.scale(_extra_loss(model, extra, 3)).backward()
    model.fc1.weight.grad[0, 0] = INF
    snapshot = optimizer_snapshot(optimizer)
    scaler.step(optimizer)
    scaler.update()

    assert int(scaler.get_num_skipped_steps()) == 1
    assert extra not in optimizer.state or not optimizer.state[extra]
    assert deep_equal(snapshot, optimizer_snapshot(optimizer))


def test_fused_skip_after_load_state_dict_creates_no_state() -> None:
    model = TinyNet()
    optimizer = _fused_adam(model)
    scaler = cstorch.amp.GradScaler(**DLS)
    _train(scaler, model, optimizer)
    # A checkpoint in which fc2.bias has no state yet (it was frozen when it was saved).
    other = TinyNet(seed=1)
    donor = _fused_adam(other)
    other.fc2.bias.requires_grad_(False)
    for step in range(2):
        donor.zero_grad()
        loss_of(other, step).backward()
        donor.step()
    optimizer.load_state_dict(donor.state_dict())
    assert not optimizer.state.get(model.fc2.bias)

    optimizer.zero_grad()
    scaler.scale(loss_of(model, 3)).backward()
    model.fc1.bias.grad[0] = INF
    snapshot = optimizer_snapshot(optimizer)
    scaler.step(optimizer)
    scaler.update()

    assert int(scaler.get_num_skipped_steps()) == 1
    assert not optimizer.state.get(model.fc2.bias)
    assert deep_equal(snapshot, optimizer_snapshot(optimizer))


def test_loaded_state_is_used_from_the_next_decision() -> None:
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)
    _train(scaler, model, optimizer)
    checkpoint = {
        "loss_scale": torch.tensor(2.0**4),
        "steps_since_rescale": torch.tensor(0),
        "overflows_since_rescale": torch.tensor(0),
        "num_skipped_steps": torch.tensor(5),
    }
    scaler.load_state_dict(checkpoint)
    one_step(scaler, model, optimizer, 3, poison=True)
    state = scaler.state_dict()
    assert float(state["loss_scale"]) == 2.0**3  # halved from the loaded scale
    assert int(state["num_skipped_steps"]) == 6


def test_fused_skip_after_a_replaced_params_list_creates_no_state() -> None:
    model = TinyNet()
    optimizer = _fused_adam(model)
    scaler = cstorch.amp.GradScaler(**DLS)
    _train(scaler, model, optimizer)
    # As many parameters and state entries as before, but fc1.bias (which keeps its state
    # entry) swapped for a parameter that has no state.
    extra = torch.nn.Parameter(torch.ones(3))
    group = optimizer.param_groups[0]
    group["params"] = [extra if p is model.fc1.bias else p for p in group["params"]]

    optimizer.zero_grad()
    scaler.scale(_extra_loss(model, extra, 3)).backward()
    model.fc1.weight.grad[0, 0] = INF
    snapshot = {id(k): copy.deepcopy(v) for k, v in optimizer.state.items()}
    params = [p.detach().clone() for p in group["params"]]
    scaler.step(optimizer)
    scaler.update()

    assert int(scaler.get_num_skipped_steps()) == 1
    assert not optimizer.state.get(extra)
    assert deep_equal(snapshot, {id(k): v for k, v in optimizer.state.items()})
    for before, param in zip(params, group["params"], strict=True):
        assert torch.equal(before, param)


# ------------------------------------------- the gradients' structure, remembered between reads
#
# After a full read the scaler's decider remembers the structure of the gradients (which
# parameters have one, their types and dtypes, which are read by themselves and which packed
# per dtype) and reads the next iteration's fresh gradients through it, checking only what is
# cheap (_gradients.Structure). Each test below changes one thing that structure depends on
# after it was remembered, and checks the decision against an oracle: a new scaler, which
# remembers nothing and reads every gradient fully, or the known overflow.


def _full_reads(scaler: cstorch.amp.GradScaler) -> int:
    return scaler._engine.decider.reader.full_reads


def _warm(scaler, model, optimizer, steps=3, loss=loss_of):
    for step in range(steps):
        optimizer.zero_grad()
        scaler.scale(loss(model, step)).backward()
        scaler.step(optimizer)
        scaler.update()
    assert int(scaler.get_num_skipped_steps()) == 0


def _decide(scaler, model, optimizer, step, loss=loss_of, poison=None):
    """One iteration with fresh gradients; ``poison(model)`` may write into them before the
    decision. Returns the decision's flag and norm."""
    optimizer.zero_grad()
    scaler.scale(loss(model, step)).backward()
    if poison is not None:
        poison(model)
    scaler.unscale_(optimizer)
    result = bool(scaler.get_isfinite()), float(scaler.get_global_norm())
    scaler.step(optimizer)
    scaler.update()
    return result


def _fresh_norm(model, loss, step, scale=DLS["init_scale"], **config):
    """The norm a new scaler (no remembered structure) decides for the same gradients."""
    twin = copy.deepcopy(model)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=scale, **config)
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.0)
    scaler.scale(loss(twin, step)).backward()
    scaler.unscale_(optimizer)
    return float(scaler.get_global_norm())


@pytest.mark.parametrize("set_to_none", [True, False], ids=["fresh", "persistent"])
def test_a_steady_loop_reads_through_the_remembered_structure(set_to_none):
    """The structure is remembered (the tests below then exercise it) and is used for fresh
    gradients and persistent ones alike; its decisions are a full read's."""
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)
    _warm(scaler, model, optimizer)
    reads = _full_reads(scaler)
    for step in range(3, 8):
        optimizer.zero_grad(set_to_none=set_to_none)
        scaler.scale(loss_of(model, step)).backward()
        expected = _fresh_norm(model, loss_of, step)
        scaler.unscale_(optimizer)
        assert float(scaler.get_global_norm()) == expected
        scaler.step(optimizer)
        scaler.update()
    assert _full_reads(scaler) == reads


def test_small_gradients_cross_through_one_kept_buffer(monkeypatch):
    """On the CPU the packed copy of the small gradients goes into one buffer kept with the
    remembered structure and imported into JAX once: every steady decision reads that same
    array, refilled with the iteration's gradients (the norm is a full read's, an inf skips)."""
    model = TinyNet()  # every gradient small and float32: one pack
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)
    _warm(scaler, model, optimizer)
    reads = record_imports(monkeypatch)
    imports = []
    original = _dlpack.import_tensors
    monkeypatch.setattr(_dlpack, "import_tensors", lambda t: imports.append(t) or original(t))
    kept = []
    for step in range(3, 8):
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        expected = _fresh_norm(model, loss_of, step)
        if step == 5:
            model.fc2.bias.grad[-1] = INF
        reads.clear()
        scaler.unscale_(optimizer)
        assert bool(scaler.get_isfinite()) is (step != 5)
        if step != 5:
            assert float(scaler.get_global_norm()) == expected
        ((array,),) = reads
        kept.append(array)
        scaler.step(optimizer)
        scaler.update()
    assert all(array is kept[0] for array in kept)
    imported_by_the_scaler = [
        t for t in imports if t and t[0].data_ptr() == kept[0].unsafe_buffer_pointer()
    ]
    assert imported_by_the_scaler == []  # imported before (at the first read through it)


def test_packs_not_kept_are_copied_and_imported_at_every_read(monkeypatch):
    """Off the CPU no pack is kept (``_gradients.keeps_packs``): the packed copy of the small
    gradients is made and imported anew at every read through the remembered structure. Forced
    here on the CPU: the decisions are a full read's (the norm of a scaler that remembers
    nothing; an inf skips), and each reads a fresh copy."""
    monkeypatch.setattr(_gradients, "keeps_packs", lambda device: False)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)
    _warm(scaler, model, optimizer)
    full_reads = _full_reads(scaler)
    reads = record_imports(monkeypatch)
    for step in range(3, 7):
        expected = _fresh_norm(model, loss_of, step)

        def poison(m, step=step):
            if step == 5:
                m.fc2.bias.grad[-1] = INF

        finite, norm = _decide(scaler, model, optimizer, step, poison=poison)
        assert finite is (step != 5)
        if finite:
            assert norm == expected
    assert _full_reads(scaler) == full_reads
    arrays = [array for (array,) in reads]
    assert len({a.unsafe_buffer_pointer() for a in arrays}) == len(arrays)  # a copy per read


def test_a_kept_buffer_imported_as_a_copy_is_imported_at_every_read(monkeypatch):
    """Should an import copy the kept buffer instead of viewing it, that copy is not kept (it
    would never see later iterations' gradients): every decision still reads its own."""
    original = _dlpack.import_tensors
    monkeypatch.setattr(_dlpack, "import_tensors", lambda ts: original([t.clone() for t in ts]))
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)
    _warm(scaler, model, optimizer)
    for step in range(3, 6):
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        expected = _fresh_norm(model, loss_of, step)
        if step == 4:
            model.fc1.bias.grad[0] = INF
        scaler.unscale_(optimizer)
        assert bool(scaler.get_isfinite()) is (step != 4)
        if step != 4:
            assert float(scaler.get_global_norm()) == expected
        scaler.step(optimizer)
        scaler.update()


@pytest.mark.parametrize("poisoned", ["swapped_in", "swapped_out"])
def test_parameter_swapped_inside_its_params_list_takes_part(poisoned):
    """The same list object, the same length, one parameter replaced: the participants are
    compared by identity, so the new parameter's gradient is read and the old one's is not."""
    model = TinyNet()
    optimizer = torch.optim.SGD([*model.fc1.parameters(), *model.fc2.parameters()], lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)
    _warm(scaler, model, optimizer)
    extra = torch.nn.Parameter(torch.ones(3))
    group = optimizer.param_groups[0]
    group["params"][1] = extra  # in place of fc1.bias, which the loss still reaches

    def poison(m):
        (extra if poisoned == "swapped_in" else m.fc1.bias).grad[0] = INF

    before = [p.detach().clone() for p in group["params"]]
    finite, _ = _decide(scaler, model, optimizer, 3, lambda m, s: _extra_loss(m, extra, s), poison)
    assert finite is (poisoned == "swapped_out")
    unchanged = [torch.equal(b, p) for b, p in zip(before, group["params"], strict=True)]
    assert all(unchanged) is (poisoned == "swapped_in")


def test_fused_skip_after_a_parameter_swapped_inside_its_params_list_creates_no_state():
    model = TinyNet()
    optimizer = _fused_adam(model)
    scaler = cstorch.amp.GradScaler(**DLS)
    _train(scaler, model, optimizer)  # every parameter has state; remembered
    extra = torch.nn.Parameter(torch.ones(3))
    group = optimizer.param_groups[0]
    group["params"][1] = extra  # same list, same length, same number of state entries

    optimizer.zero_grad()
    scaler.scale(_extra_loss(model, extra, 3)).backward()
    model.fc1.weight.grad[0, 0] = INF
    snapshot = {id(k): copy.deepcopy(v) for k, v in optimizer.state.items()}
    scaler.step(optimizer)
    scaler.update()

    assert int(scaler.get_num_skipped_steps()) == 1
    assert not optimizer.state.get(extra)
    assert deep_equal(snapshot, {id(k): v for k, v in optimizer.state.items()})


def test_a_gradient_in_another_dtype_is_unscaled_in_that_dtype():
    """One layer converted to bfloat16 after the structure was remembered: its gradients are
    unscaled in bfloat16, as a full read does. With a scale that is not a power of two the
    rounding shows in the norm (a float32 read of them would give another norm)."""
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=3.0)
    _warm(scaler, model, optimizer)
    reads = _full_reads(scaler)
    model.fc2.to(torch.bfloat16)  # the same parameter objects, new .data

    def loss(m, step):
        x, y = batch(step)
        return (m.fc2(torch.tanh(m.fc1(x)).bfloat16()).float() - y).square().mean()

    expected = _fresh_norm(model, loss, 3, scale=3.0)
    # By hand: the scaled gradients unscaled in their own dtype, or all in float32.
    twin = copy.deepcopy(model)
    (loss(twin, 3) * 3.0).backward()
    inv = torch.tensor(1 / 3.0)
    grads = [p.grad for p in twin.parameters() if p.grad is not None]
    own = math.sqrt(
        sum(float((g.float() * inv).to(g.dtype).double().square().sum()) for g in grads)
    )
    wide = math.sqrt(sum(float((g.float() * inv).double().square().sum()) for g in grads))
    assert abs(own - wide) > 1e-5 * wide  # the dtype shows in the norm

    finite, norm = _decide(scaler, model, optimizer, 3, loss)
    assert finite and norm == expected
    assert norm == pytest.approx(own, rel=1e-6)
    assert _full_reads(scaler) == reads + 1


@pytest.mark.parametrize("elements", [6, 5000], ids=["still_small", "now_large"])
def test_a_resized_gradient_is_read_whole(elements):
    """A parameter given new data of another size: its whole new gradient is read (an inf in
    its last element skips), packed or by itself, as a full read does."""
    model = TinyNet()
    extra = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)

    def loss(m, step):
        return _extra_loss(m, extra, step)

    _warm(scaler, model, optimizer, loss=loss)
    extra.data = torch.ones(elements)
    extra.grad = None
    expected = _fresh_norm(model, lambda m, s: loss_of(m, s) + extra.square().sum(), 3)
    finite, norm = _decide(scaler, model, optimizer, 3, loss)
    assert finite and norm == pytest.approx(expected, rel=1e-6)

    def poison(m):
        extra.grad[-1] = INF

    assert _decide(scaler, model, optimizer, 4, loss, poison)[0] is False


def test_gradients_that_appear_or_vanish_change_what_is_read():
    """TinyNet's ``unused`` layer has no gradients until a loss reaches it; then an inf there
    skips. A layer frozen afterwards has none again, and nothing of it is read or multiplied."""
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)
    _warm(scaler, model, optimizer)

    def with_unused(m, step):
        return loss_of(m, step) + m.unused(torch.ones(1, 2)).square().sum()

    def poison(m):
        m.unused.bias.grad[0] = INF

    assert _decide(scaler, model, optimizer, 3, with_unused, poison)[0] is False
    expected = _fresh_norm(model, with_unused, 4)
    assert _decide(scaler, model, optimizer, 4, with_unused) == (True, expected)
    model.fc2.requires_grad_(False)
    frozen = [p.detach().clone() for p in model.fc2.parameters()]
    expected = _fresh_norm(model, with_unused, 5)
    assert _decide(scaler, model, optimizer, 5, with_unused) == (True, expected)
    assert all(p.grad is None for p in model.fc2.parameters())
    assert all(torch.equal(a, b) for a, b in zip(frozen, model.fc2.parameters(), strict=True))


def _warm_with_a_large_gradient(lr: float):
    """TinyNet plus a layer whose 5120-element weight gradient is read by itself (the others are
    packed), trained until the scaler remembers their structure.

    Returns ``(model, big, optimizer, scaler, loss)``; ``loss(m, step, b=big)``.
    """
    model = TinyNet()
    big = torch.nn.Linear(80, 64)
    optimizer = torch.optim.SGD([*model.parameters(), *big.parameters()], lr=lr)
    scaler = cstorch.amp.GradScaler(**DLS)

    def loss(m, step, b=big):
        return loss_of(m, step) + b(torch.ones(1, 80)).square().mean()

    _warm(scaler, model, optimizer, loss=loss)
    return model, big, optimizer, scaler, loss


class _Tagged(torch.Tensor):
    """A tensor subclass that torch ops keep (default ``__torch_function__``), as a DTensor is."""


@pytest.mark.parametrize("which", ["small", "large"])
def test_a_gradient_turned_into_a_subclass_is_read_fully(which):
    """A gradient that becomes a tensor subclass after the structure was remembered (checked per
    gradient by type only for those read by themselves; a packed copy shows it by its own type)
    is read by the full read, whose decision it then is: an inf in it skips, and a finite one
    gives the norm of a scaler that remembers nothing."""
    model, big, optimizer, scaler, loss = _warm_with_a_large_gradient(lr=0.0)
    reads = _full_reads(scaler)

    def tag(m, b):
        param = m.fc1.bias if which == "small" else b.weight
        param.grad = param.grad.as_subclass(_Tagged)
        return param

    def tag_and_poison(m):
        tag(m, big).grad.view(-1)[-1] = INF

    assert _decide(scaler, model, optimizer, 3, loss, tag_and_poison)[0] is False
    assert _full_reads(scaler) == reads + 1

    # The oracle: a new scaler (it remembers nothing) over copies, the same gradient tagged.
    twin, twin_big = copy.deepcopy(model), copy.deepcopy(big)
    fresh = cstorch.amp.GradScaler(**DLS)
    fresh_optimizer = torch.optim.SGD([*twin.parameters(), *twin_big.parameters()], lr=0.0)
    fresh.scale(loss(twin, 4, twin_big)).backward()
    tag(twin, twin_big)
    fresh.unscale_(fresh_optimizer)
    expected = float(fresh.get_global_norm())

    finite, norm = _decide(scaler, model, optimizer, 4, loss, lambda m: tag(m, big))
    assert finite and norm == expected
    assert _full_reads(scaler) == reads + 2


@pytest.mark.parametrize("which", ["small", "large"])
def test_a_gradient_turned_sparse_raises_the_clear_error(which):
    model, big, optimizer, scaler, loss = _warm_with_a_large_gradient(lr=0.1)
    optimizer.zero_grad()
    scaler.scale(loss(model, 3)).backward()
    param = model.fc1.bias if which == "small" else big.weight
    param.grad = param.grad.to_sparse()
    with pytest.raises(TypeError, match="does not support sparse gradients"):
        scaler.step(optimizer)


def test_gradients_turned_into_views_of_one_buffer_are_read_correctly(monkeypatch):
    """Gradients made views of one flat buffer (as DDP's ``gradient_as_bucket_view``) after
    the structure was remembered: a large one among them makes the full read look again, and
    it reads the whole buffer through one import, where torch keeps it."""
    imported = record_imports(monkeypatch)
    model = TinyNet()
    big = torch.nn.Linear(80, 64)
    params = [*model.fc1.parameters(), *model.fc2.parameters(), *big.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)

    def loss(m, step):
        return loss_of(m, step) + big(torch.ones(1, 80)).square().mean()

    _warm(scaler, model, optimizer, loss=loss)
    flat = torch.zeros(sum(p.numel() for p in params))
    offset = 0
    for param in params:
        param.grad = flat[offset : offset + param.numel()].view_as(param)
        offset += param.numel()
    expected = _fresh_norm(model, loss, 3)
    for param in params:  # the twin's backward above did not touch these; refill them
        param.grad.zero_()
    imported.clear()
    optimizer.zero_grad(set_to_none=False)
    scaler.scale(loss(model, 3)).backward()
    scaler.unscale_(optimizer)
    assert float(scaler.get_global_norm()) == pytest.approx(expected, rel=1e-6)
    (arrays,) = imported
    assert [a.unsafe_buffer_pointer() for a in arrays] == [flat.data_ptr()]
    scaler.step(optimizer)
    scaler.update()
    assert (
        _decide(scaler, model, optimizer, 4, loss, lambda m: params[1].grad.fill_(INF))[0] is False
    )


def test_a_changed_small_gradient_threshold_is_seen(monkeypatch):
    """``_storage.SMALL_GRADIENT`` (which gradients are packed) is part of what is remembered:
    set to 0 after warm-up, every gradient is then read where torch keeps it."""
    imported = record_imports(monkeypatch)
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)
    _warm(scaler, model, optimizer)
    monkeypatch.setattr(_storage, "SMALL_GRADIENT", 0)
    imported.clear()
    optimizer.zero_grad()
    scaler.scale(loss_of(model, 3)).backward()
    pointers = sorted(p.grad.data_ptr() for p in model.parameters() if p.grad is not None)
    scaler.step(optimizer)
    scaler.update()
    (arrays,) = imported
    assert sorted(a.unsafe_buffer_pointer() for a in arrays) == pointers


def test_a_parameter_swapped_out_is_no_longer_covered_by_the_decision():
    """Which parameters' gradients a decision read (checked when an optimizer first meets the
    scaler after it) follows the swap too: the swapped-out parameter still gets a gradient,
    and an optimizer of it met after the decision is refused."""
    model = TinyNet()
    optimizer = torch.optim.SGD([*model.fc1.parameters(), *model.fc2.parameters()], lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)
    _warm(scaler, model, optimizer)
    extra = torch.nn.Parameter(torch.ones(3))
    optimizer.param_groups[0]["params"][1] = extra  # fc1.bias out
    optimizer.zero_grad()
    scaler.scale(_extra_loss(model, extra, 3)).backward()
    scaler.step(optimizer)
    late = torch.optim.SGD([model.fc1.bias], lr=0.1)
    with pytest.raises(RuntimeError, match="after this iteration's overflow decision"):
        scaler.step(late)


def _counting_local_tensors(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts how often the multiply collects an optimizer's gradients again."""
    from torch_facade.amp._engine import _gradients

    calls: list[int] = []
    collect = _gradients.local_tensors

    def counted(params):
        calls.append(len(params))
        return collect(params)

    monkeypatch.setattr(_gradients, "local_tensors", counted)
    return calls


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_"])
def test_one_optimizer_multiplies_the_gradients_its_decision_read(monkeypatch, unscale_first):
    """With one optimizer holding every participant, the decision's own list of gradients is
    multiplied (no second collection), and the result is the plain loop's, step by step."""
    model, twin = TinyNet(), TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plain = torch.optim.SGD(twin.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=2.0**10)
    calls = _counting_local_tensors(monkeypatch)
    for step in range(4):
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        if unscale_first:
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        plain.zero_grad()
        loss_of(twin, step).backward()
        plain.step()
        assert all(
            torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters(), strict=True)
        )
    assert calls == []


def test_two_optimizers_collect_their_own_gradients(monkeypatch):
    """Two optimizers: each multiplies its own parameters' gradients, collected at its step."""
    model = TinyNet()
    first = torch.optim.SGD(model.fc1.parameters(), lr=0.1)
    second = torch.optim.SGD(model.fc2.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", optimizers=[first, second])
    calls = _counting_local_tensors(monkeypatch)
    first.zero_grad()
    second.zero_grad()
    scaler.scale(loss_of(model, 0)).backward()
    expected = [p.grad / scaler.get_scale() for p in model.parameters() if p.grad is not None]
    scaler.step(first)
    scaler.step(second)
    scaler.update()
    assert calls == [2, 2]
    got = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))


def test_a_gradient_replaced_between_unscale_and_step_gets_the_clip():
    """DLS + GCC, ``unscale_`` then ``step``: the clip multiplies the gradients present at
    ``step`` (collected again there), not the ones the decision read."""
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", max_gradient_norm=1e-3)
    scaler.scale(loss_of(model, 0)).backward()
    scaler.unscale_(optimizer)  # unscaled; the clip waits for step
    norm = float(scaler.get_global_norm())
    assert norm > 1e-3
    old = model.fc1.weight.grad
    new = old.clone()
    model.fc1.weight.grad = new
    scaler.step(optimizer)
    scaler.update()
    coefficient = 1e-3 / (norm + 1e-6)  # clip_grad_norm_'s coefficient
    torch.testing.assert_close(new, old * coefficient)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_the_gradients_read_do_not_outlive_the_iteration(fused):
    """After ``update()`` and ``zero_grad()`` nothing the scaler keeps holds a gradient (a
    second set of gradients would stay alive through the next backward pass)."""
    import gc
    import weakref

    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused, foreach=not fused)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
    for step in range(2):
        one_step(scaler, model, optimizer, step)
    scaler.scale(loss_of(model, 2)).backward()
    refs = [weakref.ref(p.grad) for p in model.parameters() if p.grad is not None]
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
