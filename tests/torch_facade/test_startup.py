"""What a user pays before training starts: the facade imports no ``torch._dynamo``.

``torch.compiler.disable`` imports ``torch._dynamo`` (1.3-1.9 s here). The facade's boundary
(:mod:`torch_facade.amp._host_side`) makes it only once user code has imported dynamo; these
tests run in fresh processes (forked from one that has imported only the facade), where nothing
else has imported it yet.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from facade_helpers import COMPILE_EVENT, TRACE_EVENT, jax_compile_events

import amp_core
from tests.forked_python import ForkedPython
from torch_facade.amp._engine import _carry, _core_cache


@pytest.fixture(scope="module")
def run_python(tmp_path_factory):
    """Runs a script as a fresh interpreter would after ``import torch_facade``: forked from one
    that has imported only the facade (and torch and JAX), nothing compiled, no dynamo."""
    server = ForkedPython(tmp_path_factory.mktemp("forked"))
    yield server.run
    server.close()


_DYNAMO_MODULES = (
    "sorted(m for m in sys.modules if m == 'torch._dynamo' or m.startswith('torch._dynamo.'))"
)


def test_import_and_the_facades_own_calls_import_no_dynamo(run_python):
    """Importing the facade, building a scaler, scaling a loss, the half-dtype calls and the
    cbfloat16 rounding leave ``torch._dynamo`` unimported (``torch.optim``'s optimizers import
    it themselves, in their constructor: that is torch's cost, the same with torch's scaler)."""
    result = run_python(
        "import json, sys\n"
        "import torch_facade as cstorch\n"
        f"after_import = {_DYNAMO_MODULES}\n"
        "import torch\n"
        "scaler = cstorch.amp.GradScaler(loss_scale='dynamic')\n"
        "w = torch.ones(3, requires_grad=True)\n"
        "scaler.scale((w * 2).sum()).backward()\n"
        "cstorch.amp.set_half_dtype('cbfloat16')\n"
        "rounded = cstorch.amp.round_to_cbfloat16(torch.tensor([1 + 2**-10]))\n"
        "print(json.dumps({'after_import': after_import, 'after_calls': "
        f"{_DYNAMO_MODULES}, 'scale': float(scaler.get_scale()), 'grad': w.grad.tolist(), "
        "'rounded': rounded.item()}))"
    )
    assert result["after_import"] == []
    assert result["after_calls"] == []
    assert result["scale"] == 2.0**15 and result["grad"] == [2.0**16] * 3  # the calls ran
    assert result["rounded"] == 1.0  # 1 + 2**-10 is a tie below 1 + 2**-9: to even


def test_compiled_after_an_unimported_dynamo_breaks_at_the_boundary(run_python):
    """The facade imported first, dynamo later by ``torch.compile``: the host-side calls still
    end the graph with the facade's reason, run eagerly, and nothing recompiles."""
    result = run_python(
        "import json, sys\n"
        "import torch\n"
        "import torch_facade as cstorch\n"
        "from torch_facade.amp import _host_side\n"
        f"before = {_DYNAMO_MODULES}\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Linear(4, 2)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "scaler = cstorch.amp.GradScaler(loss_scale='dynamic', init_scale=8.0)\n"
        "def step(x, y):\n"
        "    opt.zero_grad()\n"
        "    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()\n"
        "    scaler.step(opt)\n"
        "    scaler.update()\n"
        "    return cstorch.amp.round_to_cbfloat16(x)\n"
        "import torch._dynamo\n"
        "from torch._dynamo.utils import counters\n"
        "compiled = torch.compile(step, backend='aot_eager')\n"
        "gen = torch.Generator().manual_seed(1)\n"
        "for i in range(4):\n"
        "    with torch._dynamo.config.patch(error_on_recompile=i >= 2):\n"
        "        out = compiled(torch.randn(3, 4, generator=gen), torch.randn(3, 2, generator=gen))\n"
        "reasons = list(counters['graph_break'])\n"
        "print(json.dumps({'before': before, 'facade': sum(_host_side.REASON in r for r in "
        "reasons), 'others': [r for r in reasons if _host_side.REASON not in r],"
        " 'skipped': scaler.get_num_skipped_steps().item(), 'scale': float(scaler.get_scale())}))"
    )
    assert result["before"] == []
    # scale, step, update and round_to_cbfloat16, each once (a break is counted per location)
    assert result["facade"] == 4
    # torch's own breaks, as in tests/torch_facade/test_compile.py: nothing else (such as a
    # trace of the facade's wrapper making its torch.compiler.disable'd function)
    assert len(result["others"]) == 2
    assert all("Tensor.backward()" in r or "Optimizer.zero_grad" in r for r in result["others"])
    assert result["skipped"] == 0 and result["scale"] == 8.0


# ------------------------------------------------------ the first iteration: the disk cache

_LOOP = """
import json, os, sys
{prelude}
import jax
import torch
import torch_facade as cstorch
events = []
jax.monitoring.register_event_duration_secs_listener(lambda name, secs, **kw: events.append(name))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
grad_scaler = cstorch.amp.GradScaler(loss_scale="dynamic")
x, y = torch.randn(64, 8), torch.randn(64, 1)
bad = x.clone()
bad[0, 0] = float("inf")  # the first step overflows: the decision is visible
for step in range(3):
    loss = torch.nn.functional.mse_loss(model(bad if step == 0 else x), y)
    optimizer.zero_grad()
    grad_scaler.scale(loss).backward()
    grad_scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    grad_scaler.step(optimizer)
    grad_scaler.update()
print(json.dumps({{
    "compiles": events.count("/jax/core/compile/backend_compile_duration"),
    "traces": events.count("/jax/core/compile/jaxpr_trace_duration"),
    "params": [p.detach().flatten().tolist() for p in model.parameters()],
    "scale": float(grad_scaler.get_scale()),
    "skipped": int(grad_scaler.get_num_skipped_steps()),
}}))
"""


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_the_second_run_loads_the_compiled_core_from_the_cache(tmp_path, run_python):
    """The documented loop compiles one XLA computation in its first run (the decision core:
    no self-check or packing computations) and stores it; the second run of the same script
    traces and compiles nothing, and computes the same parameters bit for bit."""
    cores = tmp_path / "cores"
    first = run_python(_LOOP.format(prelude=""), CSTORCH_AMP_CACHE_DIR=str(cores))
    stored = _files(cores)
    second = run_python(_LOOP.format(prelude=""), CSTORCH_AMP_CACHE_DIR=str(cores))
    assert (first["compiles"], first["traces"]) == (1, 1)
    assert len(stored) == 1 and stored[0].endswith(".xla")
    assert (second["compiles"], second["traces"]) == (0, 0)
    assert _files(cores) == stored
    assert second["params"] == first["params"]
    assert first["skipped"] == second["skipped"] == 1
    assert first["scale"] == second["scale"] == 2.0**14


def test_off_writes_nothing_and_the_default_is_the_users_cache_folder(tmp_path, run_python):
    """``CSTORCH_AMP_CACHE_DIR=off``: nothing is written (not in the home folder either); with
    nothing set, the core goes to ``~/.cache/cstorch-amp/xla``."""
    home = tmp_path / "home"
    home.mkdir()
    off = run_python(_LOOP.format(prelude=""), CSTORCH_AMP_CACHE_DIR="off", HOME=str(home))
    assert off["compiles"] == 1 and _files(tmp_path) == []
    unset = "os.environ.pop('CSTORCH_AMP_CACHE_DIR'); os.environ.pop('XDG_CACHE_HOME', None)"
    default = run_python(_LOOP.format(prelude=unset), HOME=str(home))
    stored = _files(home)
    assert len(stored) == 1 and stored[0].startswith(".cache/cstorch-amp/xla/")
    assert default["params"] == off["params"]


def test_jax_cache_options_decide_where_the_core_goes(tmp_path, run_python):
    """A user who set JAX's ``jax_compilation_cache_dir`` finds the core in its ``cstorch-amp``
    subfolder (nothing in the home folder); one who turned JAX's cache off gets no file."""
    home = tmp_path / "home"
    home.mkdir()
    jax_dir = tmp_path / "jax-cache"
    unset = "os.environ.pop('CSTORCH_AMP_CACHE_DIR'); os.environ.pop('XDG_CACHE_HOME', None)\n"
    with_dir = (
        unset + f"import jax; jax.config.update('jax_compilation_cache_dir', {str(jax_dir)!r})"
    )
    run_python(_LOOP.format(prelude=with_dir), HOME=str(home))
    assert _files(home) == []
    ours = [name for name in _files(jax_dir) if name.startswith("cstorch-amp/")]
    assert len(ours) == 1 and ours[0].endswith(".xla")
    turned_off = unset + "import jax; jax.config.update('jax_enable_compilation_cache', False)"
    run_python(_LOOP.format(prelude=turned_off), HOME=str(home))
    assert _files(home) == []


def _double_sum(xs):
    return sum(2 * x for x in xs)


def test_a_core_loads_recompiles_a_damaged_entry_and_keeps_one_executable_per_structure(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(_core_cache.ENV_VAR, str(tmp_path))
    jitted = jax.jit(_double_sum)
    one, two = (jnp.ones(3),), (jnp.ones(3), jnp.arange(3.0))
    core = _core_cache.persistent(jitted, "test double_sum")
    assert isinstance(core, _core_cache.PersistentCore)
    for args, expected in [(one, [2.0] * 3), (two, [2.0, 4.0, 6.0]), (one, [2.0] * 3)]:
        assert np.asarray(core(args)).tolist() == expected
    assert len(_files(tmp_path)) == 2  # one per structure
    with jax_compile_events() as events:  # a new process's core: loaded, not compiled
        fresh = _core_cache.persistent(jitted, "test double_sum")
        assert np.asarray(fresh(two)).tolist() == [2.0, 4.0, 6.0]
    assert COMPILE_EVENT not in events and TRACE_EVENT not in events
    sizes = {path: path.stat().st_size for path in tmp_path.iterdir()}
    for path in sizes:
        path.write_bytes(path.read_bytes()[:100])  # truncated: compiled again, rewritten
    again = _core_cache.persistent(jitted, "test double_sum")
    assert np.asarray(again(one)).tolist() == [2.0] * 3
    assert np.asarray(again(two)).tolist() == [2.0, 4.0, 6.0]
    assert {path: path.stat().st_size for path in tmp_path.iterdir()} == sizes
    renamed = _core_cache.persistent(jitted, "test another name")  # another key: a new entry
    assert np.asarray(renamed(one)).tolist() == [2.0] * 3
    assert len(_files(tmp_path)) == 3
    monkeypatch.setenv(_core_cache.ENV_VAR, "off")
    assert _core_cache.persistent(jitted, "test double_sum") is jitted


def test_cache_dir_follows_the_environment_and_jax(tmp_path, monkeypatch):
    monkeypatch.setenv(_core_cache.ENV_VAR, str(tmp_path / "chosen"))
    assert _core_cache.cache_dir() == tmp_path / "chosen"
    for off in ("off", "0", "", "None"):
        monkeypatch.setenv(_core_cache.ENV_VAR, off)
        assert _core_cache.cache_dir() is None
    monkeypatch.delenv(_core_cache.ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _core_cache.cache_dir() == tmp_path / "xdg" / "cstorch-amp" / "xla"
    previous = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
        assert _core_cache.cache_dir() == tmp_path / "jax" / "cstorch-amp"
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)
    with _jax_option_patched("jax_enable_compilation_cache", False):
        assert _core_cache.cache_dir() is None


class _jax_option_patched:
    def __init__(self, name: str, value: object) -> None:
        self.name, self.value = name, value

    def __enter__(self) -> None:
        self.previous = getattr(jax.config, self.name)
        jax.config.update(self.name, self.value)

    def __exit__(self, *exc: object) -> None:
        jax.config.update(self.name, self.previous)


def _state(**changes: object) -> amp_core.LossScaleState:
    state = amp_core.init_on_host(amp_core.DynamicLossScale())
    dtypes = {name: np.asarray(getattr(state, name)).dtype for name in changes}
    return state._replace(**{k: np.asarray(v, dtypes[k]) for k, v in changes.items()})


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"loss_scale": 2.0**-20, "steps_since_rescale": 2**24 + 1},
        {"loss_scale": np.float32(1e-45), "overflows_since_rescale": 7, "num_skipped_steps": 2**30},
        {"isfinite": False, "global_norm": np.inf, "non_clamped_scale": 2.0**-30},
    ],
)
def test_a_new_scalers_state_is_packed_on_the_host_as_the_jitted_pack_does(changes):
    state = _state(**changes)
    host = _carry._pack_on_host(state)
    jitted = np.asarray(_carry._pack_core()(jax.device_put(state)))
    assert host.dtype == jitted.dtype == np.int32
    np.testing.assert_array_equal(host, jitted)
