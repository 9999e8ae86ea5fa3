"""What the facade does on a GPU, pinned on the CPU: JAX as a guest, the accelerator path, errors.

No GPU has run these paths (see "Sharing a GPU with torch" in docs/gpus.md); what can be checked
here is checked:

* nothing starts JAX's backends at import or in ``GradScaler()``, nor in anything a training
  script calls before its first decision (``state_dict``, ``load_state_dict``, the getters,
  ``scale``, pickling); the first decision does;
* JAX is started with preallocation off and (for a GPU) only that GPU visible, unless the user
  chose; both are restored afterwards (seen at the moment a backend starts, in a subprocess);
* the state follows the gradients' device;
* the jitted core of the accelerator path has no ``cond``; the CPU path keeps its one;
* the accelerator path (branch-free core, no host waits, the public DLPack crossing), forced on
  the CPU, gives the same bits as the CPU path;
* the crossing chooser and the alignment copy; the GPU lookup and the error for a CUDA tensor
  without a JAX GPU backend.
"""

from __future__ import annotations

import functools
import pickle
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
import torch
from facade_helpers import DLS, INF, NAN, TinyNet, loss_of

import amp_core
import torch_facade as cstorch
from hardware import devices as devices_module
from tests.forked_python import ForkedPython
from torch_facade.amp._engine import (
    _carry,
    _cores,
    _crossing,
    _crossing_cuda,
    _crossing_dlpack,
    _dlpack,
    _jax_guest,
    _spikes,
    _storage,
)

# What a backend start saw: recorded by a hook JAX calls on every backend it initializes.
RECORD_BACKEND_STARTS = """
import json, os
import jax
from jax._src import xla_bridge
seen = []
def record(backend):
    seen.append({
        "platform": backend.platform,
        "preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
        "visible": jax.config.read("jax_cuda_visible_devices"),
    })
if hasattr(xla_bridge, "register_backend_initialization_hook"):
    xla_bridge.register_backend_initialization_hook(record)
else:  # jax 0.11 has no such hook: wrap the function that starts each backend
    _start_backend = xla_bridge._init_backend
    def _recording_start(platform):
        backend = _start_backend(platform)
        record(backend)
        return backend
    xla_bridge._init_backend = _recording_start
"""

# A GPU the subprocess tests name: a real one where there is a GPU, else any index.
GPU_INDEX = 0 if torch.cuda.is_available() else 3

NO_CUDA = pytest.mark.skipif(
    torch.cuda.is_available(), reason="assumes JAX has no working GPU backend (a CPU machine)"
)


@pytest.fixture(scope="module")
def run_python(tmp_path_factory):
    """Runs a script as a fresh interpreter would after importing the facade (forked from one
    that has only imported it: JAX's backends not started, as in a new training script)."""
    server = ForkedPython(tmp_path_factory.mktemp("forked"))
    yield server.run
    server.close()


def settings_seen(starts: list[dict]) -> set[tuple]:
    """The (preallocate, visible GPUs) settings every backend start saw (one on any machine)."""
    assert starts and "cpu" in {start["platform"] for start in starts}
    return {(start["preallocate"], start["visible"]) for start in starts}


def test_nothing_starts_jax_before_the_first_decision(run_python):
    code = RECORD_BACKEND_STARTS + (
        "import copy, pickle, torch\n"
        "import torch_facade as cstorch\n"
        "dls = cstorch.amp.GradScaler(loss_scale='dynamic', init_scale=2.0**8)\n"
        "static = cstorch.amp.GradScaler(loss_scale=4.0)\n"
        "model = torch.nn.Linear(3, 1)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "cstorch.amp.GradScaler(loss_scale='dynamic', optimizers=[optimizer])\n"
        "dls.load_state_dict(dls.state_dict())\n"
        "dls.load_state_dict({'loss_scale': 64.0, 'num_skipped_steps': 2})\n"
        "copy.deepcopy(dls); pickle.loads(pickle.dumps(static))\n"
        "getters = [dls.get_scale(), dls.get_non_clamped_scale(), dls.get_isfinite(),\n"
        "           dls.get_global_norm(), dls.get_num_skipped_steps(), static.get_scale()]\n"
        "metrics = cstorch.amp.scaler_metrics(dls)\n"
        "dls.scale(model(torch.ones(2, 3)).sum()).backward()\n"
        "before = xla_bridge.backends_are_initialized()\n"
        "dls.step(optimizer)\n"
        "dls.update()\n"
        "print(json.dumps({'before': before, 'after': xla_bridge.backends_are_initialized(),\n"
        "                  'starts': seen, 'scale': float(dls.get_scale()),\n"
        "                  'skipped': int(dls.get_num_skipped_steps()), 'metrics': metrics}))\n"
    )
    out = run_python(code)
    assert out["before"] is False
    assert out["after"] is True
    assert out["scale"] == 64.0 and out["skipped"] == 2  # the loaded state was used
    assert out["metrics"]["loss_scale"] == 64.0
    assert "cpu" in {start["platform"] for start in out["starts"]}


def test_the_facade_starts_jax_with_preallocation_off_and_restores_the_environment(run_python):
    code = RECORD_BACKEND_STARTS + (
        "import torch\n"
        "from torch_facade.amp._engine import _jax_guest\n"
        "_jax_guest.start(torch.device('cpu'))\n"
        "print(json.dumps({'starts': seen,\n"
        "                  'after': os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'),\n"
        "                  'by_facade': _jax_guest._started_by_facade}))\n"
    )
    out = run_python(code)
    assert settings_seen(out["starts"]) == {("false", "all")}  # torch has used no GPU
    assert out["after"] is None  # not left in the environment for child processes
    assert out["by_facade"] is True


@pytest.mark.parametrize(
    "setting",
    [
        {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"},
        {"XLA_CLIENT_MEM_FRACTION": ".5"},
        {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".3"},
        {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"},
    ],
    ids=lambda setting: next(iter(setting)),
)
def test_the_users_memory_setting_wins(setting, run_python):
    code = RECORD_BACKEND_STARTS + (
        "import torch\n"
        "from torch_facade.amp._engine import _jax_guest\n"
        "_jax_guest.start(torch.device('cpu'))\n"
        "print(json.dumps({'starts': seen, 'chose': _jax_guest.user_chose_memory()}))\n"
    )
    out = run_python(code, **setting)
    expected = setting.get("XLA_PYTHON_CLIENT_PREALLOCATE")  # untouched: the user's or unset
    assert {preallocate for preallocate, _ in settings_seen(out["starts"])} == {expected}
    assert out["chose"] is True


def test_client_options_count_as_the_users_choice(run_python):
    code = RECORD_BACKEND_STARTS + (
        "import torch\n"
        "jax.config.update('jax_pjrt_client_create_options', 'preallocate:true')\n"
        "from torch_facade.amp._engine import _jax_guest\n"
        "_jax_guest.start(torch.device('cpu'))\n"
        "print(json.dumps({'starts': seen}))\n"
    )
    out = run_python(code)
    assert {preallocate for preallocate, _ in settings_seen(out["starts"])} == {None}


def test_a_gpu_decision_lets_jax_open_only_that_gpu_and_restores_the_setting(run_python):
    """The setting is seen at the start (on a CPU-only jaxlib no GPU backend starts with it)."""
    code = RECORD_BACKEND_STARTS + (
        "import torch\n"
        "from torch_facade.amp._engine import _jax_guest\n"
        f"_jax_guest.start(torch.device('cuda', {GPU_INDEX}))\n"
        "print(json.dumps({'starts': seen, 'after': jax.config.read('jax_cuda_visible_devices'),\n"
        "                  'opened': _jax_guest._opened_only}))\n"
    )
    out = run_python(code)
    assert settings_seen(out["starts"]) == {("false", str(GPU_INDEX))}
    assert out["after"] == "all"
    assert out["opened"] == f"cuda:{GPU_INDEX}"


def test_a_cpu_first_start_in_a_process_whose_torch_uses_a_gpu_opens_only_that_gpu(run_python):
    code = RECORD_BACKEND_STARTS + (
        "import torch\n"
        "torch.cuda.is_available = lambda: True  # as if torch had set up GPU 2\n"
        "torch.cuda.is_initialized = lambda: True\n"
        "torch.cuda.current_device = lambda: 2\n"
        "from torch_facade.amp._engine import _jax_guest\n"
        "_jax_guest.start(torch.device('cpu'))  # e.g. a first decision with no gradients\n"
        "print(json.dumps({'starts': seen, 'opened': _jax_guest._opened_only}))\n"
    )
    out = run_python(code)
    assert {visible for _, visible in settings_seen(out["starts"])} == {"2"}
    assert out["opened"] == "cuda:2"


def test_a_users_gpu_restriction_is_kept(run_python):
    code = RECORD_BACKEND_STARTS + (
        "import torch\n"
        "jax.config.update('jax_cuda_visible_devices', '0,1')\n"
        "from torch_facade.amp._engine import _jax_guest\n"
        "_jax_guest.start(torch.device('cuda', 1))\n"
        "print(json.dumps({'starts': seen, 'opened': _jax_guest._opened_only}))\n"
    )
    out = run_python(code)
    assert {visible for _, visible in settings_seen(out["starts"])} == {"0,1"}
    assert out["opened"] is None


def test_jax_started_by_someone_else_with_default_preallocation_warns_once_on_a_gpu(run_python):
    code = (
        "import json, warnings, jax, torch\n"
        "jax.devices()  # the user's own JAX code started the backends first\n"
        "from torch_facade.amp._engine import _jax_guest\n"
        "_jax_guest._gpu_backend_works = lambda: True  # as with a CUDA jaxlib\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    _jax_guest.start(torch.device('cpu'))\n"
        "    _jax_guest.start(torch.device('cuda', 0))\n"
        "    _jax_guest.start(torch.device('cuda', 0))\n"
        "print(json.dumps([str(w.message) for w in caught]))\n"
    )
    messages = run_python(code)
    assert len(messages) == 1
    assert "preallocation" in messages[0] and "XLA_PYTHON_CLIENT_PREALLOCATE=false" in messages[0]
    quiet = run_python(code, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    assert quiet == []


# ----------------------------------------------------------------------- the state's device


def test_the_state_moves_to_the_gradients_device_at_the_first_decision():
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)
    assert all(type(leaf).__name__ == "ndarray" for leaf in scaler._engine.state)
    scaler.scale(loss_of(model, 0)).backward()
    scaler.step(optimizer)
    scaler.update()
    cpu = jax.devices("cpu")[0]
    assert all(leaf.devices() == {cpu} for leaf in scaler._engine.state)
    assert scaler._engine.placed_for == torch.device("cpu")
    scaler.load_state_dict({"loss_scale": 32.0})
    assert scaler._engine.state.loss_scale.devices() == {cpu}
    assert float(scaler.get_scale()) == 32.0
    restored = pickle.loads(pickle.dumps(scaler))
    assert all(type(leaf).__name__ == "ndarray" for leaf in restored._engine.state)
    assert int(restored.get_num_skipped_steps()) == int(scaler.get_num_skipped_steps())


class FakeDeviceTensor:
    """Stands for a 0-d tensor on another device: records how it is copied."""

    def __init__(self, device: str, value: float) -> None:
        self.device = torch.device(device)
        self.value = value
        self.copies: list[tuple[torch.device, bool]] = []

    def to(self, device: torch.device, non_blocking: bool = False) -> torch.Tensor:
        self.copies.append((torch.device(device), non_blocking))
        return torch.tensor(self.value)


def test_copies_to_the_cpu_wait_and_copies_from_it_need_not():
    from torch_facade.amp._engine import _gradients

    on_gpu, on_cpu = FakeDeviceTensor("cuda:0", 2.0), FakeDeviceTensor("cpu", 2.0)
    _gradients.on_device(on_gpu, torch.device("cpu"))
    _gradients.on_device(on_cpu, torch.device("cuda", 0))
    assert on_gpu.copies == [(torch.device("cpu"), False)]  # read on the host: must have landed
    assert on_cpu.copies == [(torch.device("cuda", 0), True)]
    same = torch.tensor(1.0)
    assert _gradients.on_device(same, torch.device("cpu")) is same


def test_scale_copies_a_device_scale_to_a_cpu_loss_with_a_host_wait():
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=4.0)
    scaler._engine.scale_tensor = FakeDeviceTensor("cuda:0", 4.0)  # as if the state lived on a GPU
    assert float(scaler.scale(torch.tensor(2.0))) == 8.0
    assert scaler._engine.scale_tensor.copies == [(torch.device("cpu"), False)]


@pytest.mark.parametrize("small_gradient", [0, _storage.SMALL_GRADIENT], ids=["apart", "packed"])
@pytest.mark.parametrize("accelerator_path", [False, True], ids=["cpu-path", "accelerator-path"])
def test_a_decision_holds_no_gradient_after_it_is_taken(
    small_gradient, accelerator_path, monkeypatch
):
    """Once the decision is taken, nothing of the facade keeps the gradients (or a packed copy)
    alive: ``zero_grad()`` frees them, as without a scaler (no second set through backward)."""
    import gc
    import weakref

    monkeypatch.setattr(_storage, "SMALL_GRADIENT", small_gradient)
    if accelerator_path:
        chosen = accelerator_path_on_cpu()
        monkeypatch.setattr(_dlpack, "crossing_for", lambda device: chosen)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(3):
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        scaler.step(optimizer)
        scaler.update()
    grads = [weakref.ref(p.grad) for p in model.parameters() if p.grad is not None]
    optimizer.zero_grad()
    gc.collect()
    assert grads and all(ref() is None for ref in grads)


# --------------------------------------------------------------- the accelerator's jitted core


def primitives(jaxpr) -> set[str]:
    """Every primitive in a jaxpr, nested jaxprs included."""
    found = set()
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive.name)
        for value in eqn.params.values():
            for inner in value if isinstance(value, (list, tuple)) else [value]:
                if hasattr(inner, "jaxpr"):
                    found |= primitives(getattr(inner.jaxpr, "jaxpr", inner.jaxpr))
                elif hasattr(inner, "eqns"):
                    found |= primitives(inner)
    return found


@pytest.mark.parametrize("clip", [None, 1.0], ids=["dls", "gcc"])
def test_the_accelerator_core_has_no_cond_and_the_cpu_core_keeps_its_one(clip):
    config = amp_core.DynamicLossScale(init_scale=2.0**8, max_gradient_norm=clip)
    grads = (jnp.ones((3, 4)), jnp.ones(5, jnp.float16), jnp.ones(2, jnp.bfloat16))
    state = _carry.Carry(amp_core.init(config)).packed_on(torch.device("cpu"))

    def traced(branch_free):
        step = functools.partial(_cores._local_step, config, branch_free)
        return primitives(jax.make_jaxpr(step)(state, grads, 1).jaxpr)

    assert "cond" not in traced(True)
    assert "cond" in traced(False)
    partials = functools.partial(_cores._partials, True)
    window = jnp.asarray(_spikes.initial(amp_core.SpikeSkip()))
    for spikes in (None, window):  # without and with a spike window to fingerprint
        assert "cond" not in primitives(jax.make_jaxpr(partials)(state, spikes, grads, grads).jaxpr)


def accelerator_path_on_cpu():
    """The crossing an accelerator gets when its private one fails: the public API, no host
    reads of results (so: the branch-free core, no waits, stall counter left unread)."""
    return _crossing_dlpack.crossing(host_is_device=False)


def train(optimizer_kind: str, clip: float | None, monkeypatch=None, steps: int = 8):
    """A float32 model trained with faults; returns every step's observable numbers."""
    model = TinyNet()
    if optimizer_kind == "adamw_fused":
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    scaler = cstorch.amp.GradScaler(**DLS, steps_per_increase=2, max_gradient_norm=clip)
    if monkeypatch is not None:
        chosen = accelerator_path_on_cpu()
        monkeypatch.setattr(_dlpack, "crossing_for", lambda device: chosen)
    history = []
    for step in range(steps):
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        if step in (2, 5):
            model.fc1.weight.grad[0, 0] = INF if step == 2 else NAN
        if step % 2:
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        history.append(
            (
                bool(scaler.get_isfinite()),
                float(scaler.get_scale()),
                int(scaler.get_global_norm().view(torch.int32)),  # bits: NaN equals NaN
                int(scaler.get_num_skipped_steps()),
                [p.detach().clone() for p in model.parameters()],
                {k: v.clone() for s in optimizer.state.values() for k, v in s.items()},
            )
        )
    return history


@pytest.mark.parametrize("clip", [None, 0.5], ids=["dls", "gcc"])
@pytest.mark.parametrize("optimizer_kind", ["sgd_foreach", "adamw_fused"])
def test_the_accelerator_path_forced_on_the_cpu_gives_the_same_bits(
    optimizer_kind, clip, monkeypatch
):
    cpu_run = train(optimizer_kind, clip)
    accelerator_run = train(optimizer_kind, clip, monkeypatch)
    assert [h[0] for h in cpu_run] == [True, True, False, True, True, False, True, True]
    for ours, theirs in zip(accelerator_run, cpu_run, strict=True):
        assert ours[:4] == theirs[:4]
        for a, b in zip(ours[4], theirs[4], strict=True):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        assert ours[5].keys() == theirs[5].keys()
        for key in ours[5]:
            assert torch.equal(ours[5][key], theirs[5][key])


def test_the_forced_accelerator_path_reads_the_host_flag_once_per_non_fused_step(monkeypatch):
    model = TinyNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = cstorch.amp.GradScaler(**DLS)
    chosen = accelerator_path_on_cpu()
    monkeypatch.setattr(_dlpack, "crossing_for", lambda device: chosen)
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.numel()) or real_tolist(t))
    for step in range(3):
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        scaler.step(optimizer)
        scaler.update()
    assert reads == [_carry.CARRY_SIZE] * 3  # the core's packed result, once per iteration


# ------------------------------------------------------------------------ crossings and lookup


def test_the_unaligned_view_fallback_copies_only_what_xla_gpu_would_reject():
    flat = torch.arange(40, dtype=torch.float32)
    aligned_view, odd_view = flat[8:16], flat[1:9]  # 32 bytes in, 4 bytes in
    assert flat.data_ptr() % 64 == 0
    assert _storage.aligned(aligned_view, _storage.XLA_GPU_ALIGNMENT) is aligned_view
    copied = _storage.aligned(odd_view, _storage.XLA_GPU_ALIGNMENT)
    assert copied.data_ptr() % _storage.XLA_GPU_ALIGNMENT == 0
    assert copied.data_ptr() != odd_view.data_ptr() and torch.equal(copied, odd_view)


def test_the_cuda_imports_copy_unaligned_views_then_wait_once_then_convert_each():
    """The CUDA crossing's order of device operations, with recording stand-ins for them."""
    events: list[tuple[str, object]] = []

    class Guard:
        def __enter__(self):
            events.append(("enter guard", None))

        def __exit__(self, *exc):
            events.append(("exit guard", None))

    real_clone = torch.Tensor.clone

    def convert_one(tensor):
        events.append(("convert", tensor.data_ptr()))
        return tensor.data_ptr()

    import_many = _crossing_cuda.ordered_imports(
        Guard, lambda: events.append(("wait", None)), convert_one
    )
    flat = torch.arange(64, dtype=torch.float32)
    aligned_view, odd_view, whole = flat[:16], flat[17:33], torch.ones(8)
    try:
        torch.Tensor.clone = lambda t: events.append(("copy", t.data_ptr())) or real_clone(t)
        pointers = import_many([aligned_view, odd_view, whole])
    finally:
        torch.Tensor.clone = real_clone
    kinds = [kind for kind, _ in events]
    assert kinds == ["enter guard", "copy", "wait", "convert", "convert", "convert", "exit guard"]
    assert events[1][1] == odd_view.data_ptr()  # only the view XLA:GPU would refuse
    assert pointers[0] == aligned_view.data_ptr() and pointers[2] == whole.data_ptr()
    assert pointers[1] != odd_view.data_ptr() and pointers[1] % _storage.XLA_GPU_ALIGNMENT == 0
    assert import_many([]) == ()


@NO_CUDA
def test_the_cuda_crossing_is_not_offered_without_a_working_gpu():
    assert _crossing_cuda.crossing(torch.device("cuda", 0)) is None


def test_the_cuda_self_check_rejects_a_crossing_that_reads_stale_memory(monkeypatch):
    """The self-check itself, on the CPU: a crossing that copies instead of viewing fails."""
    monkeypatch.setattr(torch.cuda, "device", lambda device: _NullContext())
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    copying = _crossing.Crossing(
        "copy", lambda ts: tuple(jnp.asarray(t.numpy()) for t in ts), _dlpack.to_torch, False
    )
    viewing = _crossing.Crossing(
        "view", lambda ts: _dlpack.import_tensors(ts), _dlpack.to_torch, False
    )
    cpu = torch.device("cpu")
    assert not _crossing_cuda.self_check(copying, cpu)
    assert _crossing_cuda.self_check(viewing, cpu)


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def fake_gpus(*hardware_ids):
    return [
        SimpleNamespace(platform="gpu", id=i, local_hardware_id=hardware_id)
        for i, hardware_id in enumerate(hardware_ids)
    ]


@pytest.mark.parametrize(
    ("hardware_ids", "index", "expected"),
    [((0, 1), 1, 1), ((1,), 1, 0), ((3, 2), 2, 1), ((None, None), 1, 1)],
    ids=["all-visible", "only-gpu-1", "reordered", "no-hardware-ids"],
)
def test_a_cuda_index_finds_the_jax_gpu_with_that_hardware_id(
    hardware_ids, index, expected, monkeypatch
):
    gpus = fake_gpus(*hardware_ids)
    monkeypatch.setattr(devices_module.jax, "local_devices", lambda backend=None: gpus)
    devices_module._jax_device.cache_clear()
    try:
        assert devices_module._jax_device("cuda", index) is gpus[expected]
    finally:
        devices_module._jax_device.cache_clear()


def test_a_gpu_jax_does_not_see_is_an_error_not_another_gpu(monkeypatch):
    gpus = fake_gpus(0)  # JAX opened GPU 0 only; torch's tensor is on GPU 1
    monkeypatch.setattr(devices_module.jax, "local_devices", lambda backend=None: gpus)
    devices_module._jax_device.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"cuda:1.*no matching JAX device"):
            devices_module._jax_device("cuda", 1)
    finally:
        devices_module._jax_device.cache_clear()


@NO_CUDA
@pytest.mark.parametrize(
    ("cuda_version", "extra"), [("13.0", "cstorch-amp[cuda13]"), ("12.6", "cstorch-amp[cuda12]")]
)
def test_a_cuda_tensor_without_a_jax_gpu_backend_names_the_extra_for_torchs_cuda(
    cuda_version, extra, monkeypatch
):
    monkeypatch.setattr(torch.version, "cuda", cuda_version)
    monkeypatch.setattr(
        _jax_guest, "_backend_error", lambda: "cuda: cuDNN version mismatch (an example)"
    )
    with pytest.raises(RuntimeError) as info:
        _jax_guest.jax_device_for(torch.device("cuda", 0))
    message = str(info.value)
    assert "cuda:0" in message and extra in message
    assert "cuDNN version mismatch (an example)" in message  # the backend's own words


@NO_CUDA
def test_a_cpu_torch_build_gets_both_extras_named(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(RuntimeError, match=r"cstorch-amp\[cuda13\].*cstorch-amp\[cuda12\]"):
        _jax_guest.jax_device_for(torch.device("cuda", 0))


def test_ranks_that_disagree_are_caught_at_the_first_host_read_on_an_accelerator():
    """On an accelerator the distributed decision is not read at once (no host sync); the
    first host read (a non-fused step, the stall check) still checks that the ranks agreed."""
    from torch_facade.amp._engine import _decision

    values = torch.ones(_carry.CARRY_SIZE)
    values[_carry.Slot.CONSISTENT] = 0.0
    values[_carry.Slot.FOUND_INF] = 0.0
    carry = _carry.Carry(amp_core.init_on_host(amp_core.DynamicLossScale()))
    decision = _decision.Decision(
        full=None,
        unscale=None,
        clip=None,
        pending={},
        covered=None,
        before=carry,
        packed=values,
        host_is_device=False,
    )
    assert not decision.host_values_known()
    with pytest.raises(RuntimeError, match="ranks' GradScalers disagree"):
        decision.host_isfinite()
