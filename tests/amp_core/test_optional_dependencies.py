"""``import amp_core`` needs neither flax nor equinox (nor orbax): they are imported on use only.

Each check runs in a fresh interpreter. The first makes flax, equinox and orbax unimportable
with a ``sys.meta_path`` blocker and trains through the optax path, an equinox-like tree with a
function leaf included; the second shows that the flax modules import flax only when used.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from amp_helpers import run_script

REPO_ROOT = Path(__file__).resolve().parents[2]

BLOCKED_RUN = textwrap.dedent(
    """
    import sys

    BLOCKED = {"flax", "equinox", "orbax"}


    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
            return None


    sys.meta_path.insert(0, Blocker())

    import jax.numpy as jnp
    import optax

    import amp_core

    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, loaded

    config = amp_core.DynamicLossScale(init_scale=2.0**10)
    inner = optax.sgd(0.1)
    model = {"w": jnp.ones(3), "activation": jnp.tanh}  # a non-array leaf, as in equinox
    opt_state = amp_core.with_loss_scaling(inner, config).init({"w": model["w"]})
    scaler = amp_core.loss_scale_state(opt_state)


    def loss(m):
        return jnp.sum(m["activation"](m["w"]))


    _, grads, isfinite, _ = amp_core.value_and_grad(loss, config)(scaler, model)
    assert grads["activation"] is None and bool(isfinite)
    scaled = {"w": grads["w"] * 2.0**10, "activation": None}  # gradients of the scaled loss
    model, opt_state = amp_core.apply_scaled_gradients(inner, config, scaled, opt_state, model)
    assert model["activation"] is jnp.tanh
    assert amp_core.scaler_metrics(opt_state)["isfinite"] is True

    for name in ("flax_nnx", "flax_linen"):
        try:
            getattr(amp_core, name)
        except ModuleNotFoundError as err:
            assert err.name == "flax", err
        else:
            raise AssertionError(f"amp_core.{name} imported without flax")
    print("ok")
    """
)

LAZY_IMPORT = textwrap.dedent(
    """
    import sys

    import amp_core

    assert "flax" not in sys.modules and "equinox" not in sys.modules
    assert amp_core.flax_nnx.LossScaledOptimizer.__name__ == "LossScaledOptimizer"
    assert amp_core.flax_linen.LossScaledTrainState.__name__ == "LossScaledTrainState"
    assert "flax" in sys.modules and "equinox" not in sys.modules
    try:
        amp_core.no_such_thing
    except AttributeError as err:
        assert "no_such_thing" in str(err)
    else:
        raise AssertionError("amp_core.no_such_thing did not raise")
    print("ok")
    """
)


def test_amp_core_imports_and_trains_with_flax_equinox_and_orbax_unimportable():
    result = run_script(BLOCKED_RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_the_flax_modules_import_flax_on_first_use_only():
    result = run_script(LAZY_IMPORT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
