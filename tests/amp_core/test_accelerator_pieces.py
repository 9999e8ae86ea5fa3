"""The two amp_core pieces the torch facade uses on accelerators.

* ``sum_of_unscaled_squares(..., branch_free=True)``: no ``lax.cond`` (XLA:GPU would evaluate the
  predicate on the host), the same bits as the default for power-of-two scales, infs and NaNs
  included. Oracle: the default path, and numpy float64 for non-power-of-two scales.
* ``init_on_host``: the initial state as NumPy arrays, equal to ``init``'s, which
  ``from_state_dict``, ``to_state_dict`` and the update accept without starting a JAX backend
  (checked in a fresh interpreter).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from amp_helpers import assert_bitwise_equal, assert_trees_bitwise_equal

import amp_core

REPO = Path(__file__).resolve().parents[2]
RNG = np.random.default_rng(7)


def gradient_sets() -> dict[str, list[jax.Array]]:
    base = [
        jnp.asarray(RNG.standard_normal((37, 5)) * 300, jnp.float32),
        jnp.asarray(RNG.standard_normal(11) * 3, jnp.float16),
        jnp.asarray(RNG.standard_normal(9) * 2e4, jnp.bfloat16),
        jnp.asarray(RNG.standard_normal(128) * 1e3, jnp.float32),
    ]
    with_inf = [base[0].at[3, 1].set(jnp.inf), *base[1:]]
    with_nan = [*base[:3], base[3].at[0].set(jnp.nan)]
    huge = [base[0].at[0, 0].set(3e19), *base[1:]]  # finite, but its square overflows float32
    return {"finite": base, "inf": with_inf, "nan": with_nan, "square-overflows": huge}


@pytest.mark.parametrize("name", list(gradient_sets()))
@pytest.mark.parametrize("inv_scale", [2.0**-8, 2.0**-31, 1.0, 2.0**3])
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_branch_free_sum_equals_the_default_bit_for_bit_for_power_of_two_scales(
    name, inv_scale, jitted
):
    grads = gradient_sets()[name]
    inv = jnp.float32(inv_scale)

    def total(branch_free):
        fn = lambda g, i: amp_core.sum_of_unscaled_squares(g, i, branch_free=branch_free)  # noqa: E731
        return (jax.jit(fn) if jitted else fn)(grads, inv)

    assert_bitwise_equal(total(True), total(False))


def test_branch_free_sum_for_another_scale_is_the_unscaled_sum_to_rounding():
    grads = gradient_sets()["finite"]
    inv = 1.0 / 3000.0
    expected = sum(
        float(np.sum(np.square(np.asarray(g, np.float32).astype(np.float64) * np.float32(inv))))
        for g in grads[::3]  # the float32 leaves (the half ones are rounded to their dtype)
    )
    half = sum(  # unscaled in float32, rounded to the leaf's dtype, squared in float64
        float(np.sum(np.square(_rounded(np.asarray(g, np.float32) * np.float32(inv), g.dtype))))
        for g in grads[1:3]
    )
    result = float(amp_core.sum_of_unscaled_squares(grads, inv, branch_free=True))
    assert result == pytest.approx(expected + half, rel=1e-5)  # float32 accumulation


def _rounded(values: np.ndarray, dtype) -> np.ndarray:
    return values.astype(dtype).astype(np.float64)


def primitive_names(jaxpr) -> set[str]:
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", None)
            if inner is not None:
                names |= primitive_names(getattr(inner, "jaxpr", inner))
    return names


def test_only_the_default_sum_has_a_cond():
    grads = gradient_sets()["finite"]

    def names(branch_free):
        fn = lambda g: amp_core.sum_of_unscaled_squares(g, 0.5, branch_free=branch_free)  # noqa: E731
        return primitive_names(jax.make_jaxpr(fn)(grads).jaxpr)

    assert "cond" in names(False)
    assert "cond" not in names(True)


@pytest.mark.parametrize(
    "config",
    [
        amp_core.DynamicLossScale(init_scale=2.0**20, max_loss_scale=2.0**18),
        amp_core.DynamicLossScale(half_dtype="cbfloat16"),
        amp_core.StaticLossScale(loss_scale=8.0),
    ],
    ids=["dynamic-clamped", "cbfloat16", "static"],
)
def test_init_on_host_is_init_as_numpy(config):
    host = amp_core.init_on_host(config)
    assert all(isinstance(leaf, np.ndarray) for leaf in host)
    assert_trees_bitwise_equal(jax.device_get(amp_core.init(config)), host)


def test_a_host_state_stays_on_the_host_through_a_checkpoint_and_updates_like_init():
    config = amp_core.DynamicLossScale(init_scale=2.0**10, steps_per_increase=1)
    host = amp_core.from_state_dict(
        config, amp_core.init_on_host(config), {"loss_scale": 64.0, "num_skipped_steps": 3}
    )
    assert all(isinstance(leaf, np.ndarray) for leaf in host)
    assert amp_core.to_state_dict(config, host)["num_skipped_steps"] == 3
    device = amp_core.from_state_dict(
        config, amp_core.init(config), {"loss_scale": 64.0, "num_skipped_steps": 3}
    )
    assert_trees_bitwise_equal(jax.device_get(device), host)
    for isfinite in (True, False, True, True):
        host, device = (amp_core.update(config, s, isfinite) for s in (host, device))
    assert_trees_bitwise_equal(host, device)


def test_nothing_of_the_host_state_starts_a_jax_backend():
    code = (
        "import json\n"
        "import amp_core\n"
        "from jax._src import xla_bridge\n"
        "config = amp_core.DynamicLossScale()\n"
        "state = amp_core.init_on_host(config)\n"
        "state = amp_core.from_state_dict(config, state, {'loss_scale': 2.0, 'num_skipped_steps': 1})\n"
        "saved = amp_core.to_state_dict(config, state)\n"
        "print(json.dumps({'saved': saved, 'started': xla_bridge.backends_are_initialized()}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        timeout=120,
        check=True,
    )
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["started"] is False
    assert out["saved"]["loss_scale"] == 2.0 and out["saved"]["num_skipped_steps"] == 1
