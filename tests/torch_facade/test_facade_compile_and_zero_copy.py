"""The jitted core compiles once per gradient structure; gradients reach JAX without copies."""

from __future__ import annotations

import jax
import pytest
import torch
from facade_helpers import (
    COMPILE_EVENT,
    DLS,
    INF,
    NAN,
    TRACE_EVENT,
    TinyNet,
    jax_compile_events,
    loss_of,
)

import torch_facade as cstorch
from torch_facade.amp._engine import _carry, _cores, _crossing_cpu, _dlpack, _storage

pytestmark = pytest.mark.filterwarnings("ignore:GradScaler is unscaling gradients")


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
    assert _cores.local_core(scaler.config)._cache_size() == 1


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
    assert _cores.local_core(scaler.config)._cache_size() == 2


def record_imports(monkeypatch) -> list[list[jax.Array]]:
    """The gradient arrays the jitted core reads, one list per decision from now on."""
    imported: list[list[jax.Array]] = []
    original = _cores.local_core

    def recording_core(*config):
        core = original(*config)

        def call(state, arrays, count):
            imported.append(list(arrays))
            return core(state, arrays, count)

        return call

    monkeypatch.setattr(_cores, "local_core", recording_core)
    return imported


@pytest.mark.parametrize("set_to_none", [True, False])
def test_jax_reads_the_gradients_where_torch_keeps_them(set_to_none, monkeypatch):
    """No gradient copy: every array the core reads aliases a ``.grad``, fresh or persistent.

    The tensors a user holds stay the parameters' gradients, and see the in-place unscaling.
    (Every gradient here is small; the packed copy of small ones is tested below, and is off
    here so that each gradient's own import is seen.)
    """
    monkeypatch.setattr(_storage, "SMALL_GRADIENT", 0)
    model, half, optimizers, scaler = mixed_setup({"loss_scale": "dynamic", "init_scale": 2.0**8})
    params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    imported = record_imports(monkeypatch)
    for step in range(3):
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)
        loss = loss_of(model, step) + half(torch.ones(1, 2, dtype=torch.bfloat16)).float().sum()
        scaler.scale(loss).backward()
        held = [p.grad for p in params]
        scaled = [None if g is None else g.clone() for g in held]
        imported.clear()
        scaler.unscale_(optimizers[1])
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update()
        (arrays,) = imported
        pointers = sorted(a.unsafe_buffer_pointer() for a in arrays)
        expected = sorted(p.grad.data_ptr() for p in params if p.grad is not None)
        assert pointers == expected
        for param, grad, before in zip(params, held, scaled, strict=True):
            assert param.grad is grad  # never replaced
            if param.dtype == torch.bfloat16:  # SGD's, unscaled in place by unscale_
                torch.testing.assert_close(grad, before / 2.0**8, rtol=0, atol=0)


def run_with_a_big_layer(monkeypatch, small_gradient: int):
    """Four steps of the mixed setup plus a layer with one big weight; per step: the imports'
    sizes, which imports alias a gradient, the flag, the scale and the norm."""
    monkeypatch.setattr(_storage, "SMALL_GRADIENT", small_gradient)
    torch.manual_seed(0)
    big = torch.nn.Linear(80, 64)  # a 5120-element weight, a 64-element bias
    model, half, optimizers, scaler = mixed_setup(DLS)
    optimizers[0].add_param_group({"params": list(big.parameters())})
    imported = record_imports(monkeypatch)
    history = []
    for step in range(4):
        loss = loss_of(model, step) + big(torch.ones(2, 80)).square().mean()
        loss = loss + half(torch.ones(1, 2, dtype=torch.bfloat16)).float().sum()
        for optimizer in optimizers:
            optimizer.zero_grad()
        scaler.scale(loss).backward()
        if step == 2:
            model.fc2.bias.grad[0] = INF  # a small float32 gradient
        grads = [p.grad for o in optimizers for g in o.param_groups for p in g["params"]]
        pointers = {g.data_ptr(): g.numel() for g in grads if g is not None}
        imported.clear()
        scaler.unscale_(optimizers[0])
        (arrays,) = imported
        sizes = sorted(a.size for a in arrays)
        in_place = sorted(pointers.get(a.unsafe_buffer_pointer(), 0) for a in arrays)
        flag, norm = bool(scaler.get_isfinite()), float(scaler.get_global_norm())
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update()
        history.append((sizes, in_place, flag, float(scaler.get_scale()), norm))
    return history


def test_small_gradients_cross_in_one_packed_copy_per_dtype(monkeypatch):
    """Gradients of at most SMALL_GRADIENT elements are read through one flat copy per dtype
    (one import instead of one each); the big weight in place. The decision is the one the
    gradients' own imports give: the same flags and scales, the norm to float32 rounding."""
    packed = run_with_a_big_layer(monkeypatch, _storage.SMALL_GRADIENT)
    apart = run_with_a_big_layer(monkeypatch, 0)
    float32_small = 12 + 3 + 6 + 2 + 64  # TinyNet's fc1, fc2 and the big layer's bias
    bfloat16_small = 6 + 3  # the half layer
    for ours, theirs in zip(packed, apart, strict=True):
        assert ours[0] == sorted([bfloat16_small, float32_small, 5120])
        assert ours[1] == [0, 0, 5120]  # only the big weight is read where torch keeps it
        assert len(theirs[0]) == 8 and theirs[1] == theirs[0]  # each in place
        assert ours[2:4] == theirs[2:4]
        assert ours[4] == pytest.approx(theirs[4], rel=1e-6) or not ours[2]
    assert [flag for _, _, flag, _, _ in packed] == [True, True, False, True]


def test_a_steady_step_crosses_dlpack_once(monkeypatch):
    """After warm-up, a step imports its gradients in one batch and exports one array.

    Here every gradient is small: they are read through one kept buffer per dtype, imported
    once, so a steady step imports nothing at all. The numbers torch needs come out of the core packed into one array, so the per-step cost
    does not grow with the number of outputs.
    """
    model, half, optimizers, scaler = mixed_setup({"loss_scale": "dynamic", "init_scale": 2.0**8})
    for step in range(3):  # warm-up: builds the arena, compiles, creates Adam's state
        mixed_step(model, half, optimizers, scaler, step)
    crossings = {"to_jax": 0, "to_torch": 0, "import_tensors": 0, "exported_carry": 0}
    modules = {"to_jax": _dlpack, "to_torch": _dlpack, "import_tensors": _dlpack}
    for name in crossings:
        module = modules.get(name, _carry)
        original = getattr(module, name)

        def counted(*args, _original=original, _name=name):
            crossings[_name] += 1
            return _original(*args)

        monkeypatch.setattr(module, name, counted)
    steps = 6
    for step in range(3, 3 + steps):
        optimizers[0].zero_grad(set_to_none=False)
        optimizers[1].zero_grad(set_to_none=False)
        loss = loss_of(model, step) + half(torch.ones(1, 2, dtype=torch.bfloat16)).float().sum()
        scaler.scale(loss).backward()
        for optimizer in optimizers:
            scaler.step(optimizer)
        scaler.update()
    assert crossings == {
        "to_jax": 0,
        "to_torch": 0,
        "import_tensors": 0,  # every gradient is small: read through kept packs, imported once
        "exported_carry": steps,
    }


# ------------------------------------------------------------- the DLPack crossings themselves


def test_cpu_import_and_export_share_memory_and_values():
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    (array,) = _dlpack.import_tensors([tensor])
    assert array.unsafe_buffer_pointer() == tensor.data_ptr()
    assert array.shape == (3, 4) and float(array.sum()) == float(tensor.sum())
    exported = _dlpack.to_torch(array * 2)
    assert exported.dtype == torch.float32 and exported.shape == (3, 4)
    assert torch.equal(exported, tensor * 2)
    back = jax.numpy.arange(5, dtype=jax.numpy.int32)
    assert _dlpack.to_torch(back).data_ptr() == back.unsafe_buffer_pointer()


def test_export_under_inference_mode_is_a_normal_tensor():
    with torch.inference_mode():
        exported = _dlpack.to_torch(jax.numpy.ones(3))
    assert not exported.is_inference()
    assert torch.equal(exported, torch.ones(3))


def test_crossings_fall_back_to_the_public_api(monkeypatch):
    """If jaxlib's lower-level DLPack functions fail their self-check, the public API is used."""
    from jax._src.lib import _jax as jaxlib_ext

    def broken(*args, **kwargs):
        raise RuntimeError("changed in this jaxlib")

    cpu = torch.device("cpu")
    with monkeypatch.context() as patched:
        patched.setattr(jaxlib_ext, "dlpack_managed_tensor_to_buffer", broken)
        patched.setattr(jaxlib_ext, "buffer_to_dlpack_managed_tensor", broken)
        assert _crossing_cpu.importer_or_none() is None
        assert _crossing_cpu.exporter_or_none() is None
        assert _crossing_cpu.crossing() is None
        _dlpack._chosen_crossing.cache_clear()
        try:
            chosen = _dlpack.crossing_for(cpu)
        finally:
            _dlpack._chosen_crossing.cache_clear()
    assert chosen.name == "dlpack" and chosen.host_is_device
    monkeypatch.setattr(_dlpack, "crossing_for", lambda device: chosen)
    tensor = torch.arange(16, dtype=torch.float32)
    (array,) = _dlpack.import_tensors([tensor])
    assert array.unsafe_buffer_pointer() == tensor.data_ptr()
    assert torch.equal(_dlpack.to_torch(array + 1), tensor + 1)
    assert _dlpack.crossing_for(cpu) is chosen


def test_the_cpu_crossing_is_the_private_one_here():
    """On this jaxlib both private CPU functions pass their self-check."""
    chosen = _dlpack.crossing_for(torch.device("cpu"))
    assert chosen.name == "cpu" and chosen.host_is_device


# ------------------------------------------------------------------- the carry between decisions


def _extreme_state():
    """Every field at a value a float32 conversion would change, or a flag at False."""
    import numpy as np

    import amp_core

    values = amp_core.LossScaleState(
        loss_scale=np.float32(2.0**-126 / 8),  # subnormal
        non_clamped_scale=np.float32(3.4e38),
        steps_since_rescale=np.int32(2**31 - 1),
        overflows_since_rescale=np.int32(2**24 + 1),  # not a float32 integer
        num_skipped_steps=np.int32(123_456_789),
        isfinite=np.bool_(False),
        global_norm=np.float32(1e-45),  # the smallest subnormal
        overflows_at_min_scale=np.int32(7),
    )
    return amp_core.LossScaleState(*map(np.asarray, values))  # 0-d arrays, as init_on_host


def test_a_packed_state_unpacks_to_the_same_bits():
    """The carry packs every field by its bits (counters past 2**24, subnormals, a False flag),
    so that unpacking gives the state back exactly, dtypes included."""
    import numpy as np

    state = _extreme_state()
    carry = _carry.Carry(state)
    packed = carry.packed_on(torch.device("cpu"))
    assert packed.shape == (_carry.CARRY_SIZE,) and packed.dtype == jax.numpy.int32
    back = _carry.Carry(packed=packed, device=torch.device("cpu")).state
    for name, want in zip(state._fields, state, strict=True):
        got = np.asarray(getattr(back, name))
        assert got.dtype == want.dtype, name
        assert got.tobytes() == np.asarray(want).tobytes(), name


def test_fields_read_from_torch_match_the_unpacked_state():
    """``Carry.field`` reads each field from torch's view of the carry, no JAX call: the same
    values and dtypes as the unpacked state."""
    state = _extreme_state()
    packed = _carry.Carry(state).packed_on(torch.device("cpu"))
    view = _carry.exported_carry(packed, _dlpack.crossing_for(torch.device("cpu")))
    carry = _carry.Carry(packed=packed, device=torch.device("cpu"), view=view)
    for name in state._fields:
        from_torch = carry.field(_carry.state_slot(name))
        from_jax = _dlpack.to_torch(getattr(carry.state, name))
        assert from_torch.dtype == from_jax.dtype, name
        assert (
            from_torch.view(-1).view(torch.uint8).tolist()
            == from_jax.view(-1).view(torch.uint8).tolist()
        ), name


def test_a_carry_needs_a_state():
    with pytest.raises(ValueError, match="needs a state"):
        _carry.Carry()
