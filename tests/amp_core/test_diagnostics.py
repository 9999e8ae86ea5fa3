"""Overflow diagnostics in amp_core: the per-leaf report, the stall counter and ``is_stalled``.

Oracles: numpy (and ml_dtypes for bfloat16) for which elements are inf or NaN once unscaled
and whether a leaf's squares overflow float32, computed in float64; hand-computed traces of the
stall counter. Every core runs with and without ``jax.jit``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import amp_core

FLOAT32_MAX = float(np.finfo(np.float32).max)
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
# The reference's four checkpoint keys, from before the stall counter existed.
REFERENCE_KEYS = (
    "loss_scale",
    "steps_since_rescale",
    "overflows_since_rescale",
    "num_skipped_steps",
)


def maybe_jit(fn: Callable[..., Any], jit: bool, **jit_kwargs: Any) -> Callable[..., Any]:
    return jax.jit(fn, **jit_kwargs) if jit else fn


def unscaled_numpy(grad: np.ndarray, inv_scale: float) -> np.ndarray:
    """The oracle's unscaled values: multiplied in float32, rounded once to the leaf's dtype."""
    with np.errstate(over="ignore", invalid="ignore"):
        return (grad.astype(np.float32) * np.float32(inv_scale)).astype(grad.dtype)


def expected_report(grads: dict[str, np.ndarray], inv_scale: float) -> dict[str, int]:
    """Names of the leaves that make the float32 sum of squares non-finite, with their counts
    of inf/NaN elements (numpy, squares summed in float64)."""
    found = {}
    for name, grad in grads.items():
        unscaled = unscaled_numpy(grad, inv_scale).astype(np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            total = np.sum(np.square(unscaled))
        if not (np.isfinite(total) and total <= FLOAT32_MAX):
            found[name] = int(np.sum(~np.isfinite(unscaled)))
    return found


def reported(report: dict[str, amp_core.LeafReport]) -> dict[str, int]:
    return {
        name: int(leaf.nonfinite_count) for name, leaf in report.items() if bool(leaf.overflows)
    }


def poisoned_grads(dtype: Any, inv_scale: float) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Scaled gradients of ``dtype`` with every kind of poison, and what the report must say."""
    rng = np.random.default_rng(0)

    def clean(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(dtype)

    grads = {"clean": clean(3, 4), "inf": clean(5), "neg_inf": clean(2, 2), "nan": clean(7)}
    grads["inf"][[1, 3]] = np.inf
    grads["neg_inf"][0, 1] = -np.inf
    grads["nan"][[0, 2, 6]] = np.nan
    grads["mixed"] = clean(6)
    grads["mixed"][[0, 1, 5]] = [np.inf, np.nan, -np.inf]
    expected = {"inf": 2, "neg_inf": 1, "nan": 3, "mixed": 3}
    if dtype != np.float16:
        # Finite, but its square (once unscaled) overflows float32: the step is skipped, and
        # no element is inf or NaN.
        grads["huge"] = clean(4)
        grads["huge"][2] = 2.0e19 / inv_scale
        expected["huge"] = 0
    return grads, expected


# ---------------------------------------------------------------- nonfinite_report


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_report_names_exactly_the_poisoned_leaves(dtype_name: str, jit: bool) -> None:
    dtype = DTYPES[dtype_name]
    inv_scale = 2.0**-8
    grads, expected = poisoned_grads(dtype, inv_scale)
    assert expected_report(grads, inv_scale) == expected  # the oracle agrees with the setup
    report = maybe_jit(amp_core.nonfinite_report, jit)(
        {k: jnp.asarray(v) for k, v in grads.items()}, inv_scale
    )
    assert set(report) == set(grads)
    assert reported(report) == expected
    for leaf in report.values():
        assert leaf.overflows.dtype == jnp.bool_ and leaf.overflows.shape == ()
        assert leaf.nonfinite_count.dtype == jnp.int32 and leaf.nonfinite_count.shape == ()


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_report_matches_numpy_on_random_poison(dtype_name: str, jit: bool) -> None:
    """Random poison at random places under random power-of-two scales: the report equals
    numpy's, and names a leaf exactly when that leaf alone fails the overflow check."""
    dtype = DTYPES[dtype_name]
    report_fn = maybe_jit(amp_core.nonfinite_report, jit)
    sum_of_squares = jax.jit(amp_core.sum_of_unscaled_squares)
    rng = np.random.default_rng(1)
    poisons = np.array([np.inf, -np.inf, np.nan, 3.0e38, 6.0e4], np.float32)
    for trial in range(6):
        inv_scale = float(2.0 ** rng.integers(-16, 5))
        grads = {}
        for i in range(4):
            leaf = (rng.standard_normal(16) * 10).astype(np.float32)
            places = rng.integers(16, size=int(rng.integers(0, 3)))
            leaf[places] = rng.choice(poisons, size=places.size)
            with np.errstate(over="ignore"):
                grads[f"leaf{i}"] = leaf.astype(dtype)
        report = report_fn({k: jnp.asarray(v) for k, v in grads.items()}, inv_scale)
        assert reported(report) == expected_report(grads, inv_scale), f"trial {trial}"
        for name, grad in grads.items():
            alone = sum_of_squares([jnp.asarray(grad)], jnp.float32(inv_scale))
            assert bool(report[name].overflows) == (not bool(jnp.isfinite(alone))), name


def test_float16_values_that_overflow_only_once_unscaled_are_counted() -> None:
    """With a loss scale below 1, unscaling multiplies: a finite float16 value becomes inf."""
    grads = {"w": jnp.array([5000.0, 1.0, -5000.0], jnp.float16)}
    report = amp_core.nonfinite_report(grads, 2.0**4)
    assert reported(report) == {"w": 2}
    assert reported(amp_core.nonfinite_report(grads, 1.0)) == {}


def test_a_leaf_is_named_when_it_alone_overflows() -> None:
    """Leaves whose squares overflow float32 only when added together skip the step, but no
    single leaf is to blame: the report names none (as documented on ``LeafReport``)."""
    grads = [jnp.full(1, 1.4e19, jnp.float32), jnp.full(1, 1.4e19, jnp.float32)]
    config = amp_core.DynamicLossScale(init_scale=1.0)
    assert not bool(amp_core.check_grads(config, amp_core.init(config), grads).isfinite)
    report = amp_core.nonfinite_report(grads)
    assert [bool(leaf.overflows) for leaf in report] == [False, False]


def test_report_keeps_the_tree_and_ignores_non_floating_leaves() -> None:
    grads = {
        "layers": [{"w": jnp.array([jnp.nan]), "b": None}, (jnp.ones(2), jnp.arange(3))],
        "step": jnp.int32(4),
    }
    report = amp_core.nonfinite_report(grads)
    is_report = lambda x: isinstance(x, amp_core.LeafReport)  # noqa: E731
    assert jax.tree_util.tree_structure(report, is_leaf=is_report) == jax.tree_util.tree_structure(
        jax.tree_util.tree_map(lambda _: 0, grads)
    )
    assert reported({"w": report["layers"][0]["w"]}) == {"w": 1}
    assert report["layers"][0]["b"] is None
    for leaf in (report["layers"][1][0], report["layers"][1][1], report["step"]):
        assert not bool(leaf.overflows) and int(leaf.nonfinite_count) == 0


def test_report_compiles_once_per_gradient_structure() -> None:
    traces = []

    def traced(grads: Any, inv_scale: jax.Array) -> Any:
        traces.append(1)
        return amp_core.nonfinite_report(grads, inv_scale)

    report_fn = jax.jit(traced)
    grads = [jnp.ones(3, jnp.float16), jnp.ones((2, 2))]
    for scale in (2.0**15, 2.0**3, 1.0, 2.0**-14):
        jax.block_until_ready(report_fn(grads, jnp.float32(1.0 / scale)))
    assert len(traces) == 1


# ---------------------------------------------------------------- stall counter


def run_trace(
    config: amp_core.DynamicLossScale, flags: Sequence[bool], jit: bool
) -> list[tuple[float, int, bool]]:
    """``(loss_scale, overflows_at_min_scale, is_stalled)`` after each update."""
    update = maybe_jit(amp_core.update, jit, static_argnums=0)
    stalled = maybe_jit(amp_core.is_stalled, jit, static_argnums=0)
    state = amp_core.init(config)
    trace = []
    for flag in flags:
        state = update(config, state, jnp.asarray(flag))
        trace.append(
            (
                float(state.loss_scale),
                int(state.overflows_at_min_scale),
                bool(stalled(config, state)),
            )
        )
    return trace


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_stall_counter_trace_resets_on_a_finite_step(jit: bool) -> None:
    config = amp_core.DynamicLossScale(
        init_scale=4.0, min_loss_scale=1.0, steps_per_increase=100, stall_steps=3
    )
    F, T = False, True
    flags = [F, F, F, F, T, F, F, F, F, T]
    expected = [
        (2.0, 0, False),  # overflow at 4: not at the minimum yet
        (1.0, 0, False),  # overflow at 2
        (1.0, 1, False),  # overflow at 1 = min_loss_scale
        (1.0, 2, False),
        (1.0, 0, False),  # a finite step resets the count
        (1.0, 1, False),
        (1.0, 2, False),
        (1.0, 3, True),  # stall_steps consecutive overflows at the minimum
        (1.0, 4, True),
        (1.0, 0, False),
    ]
    assert run_trace(config, flags, jit) == expected


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_stall_counter_counts_only_steps_taken_at_min_scale(jit: bool) -> None:
    # overflow_tolerance 1 never halves: consecutive overflows above the minimum never count.
    above = amp_core.DynamicLossScale(
        init_scale=4.0, min_loss_scale=1.0, overflow_tolerance=1.0, stall_steps=1
    )
    assert run_trace(above, [False] * 6, jit) == [(4.0, 0, False)] * 6
    # At the minimum, every overflow counts; when the scale grows off the minimum (after
    # steps_per_increase + 1 steps), the next overflow is taken above it and resets the count.
    at_min = amp_core.DynamicLossScale(
        init_scale=1.0,
        min_loss_scale=1.0,
        overflow_tolerance=1.0,
        steps_per_increase=2,
        stall_steps=2,
    )
    assert run_trace(at_min, [False] * 5, jit) == [
        (1.0, 1, False),
        (1.0, 2, True),
        (2.0, 3, True),  # taken at 1, then the scale doubles
        (2.0, 0, False),  # taken at 2
        (2.0, 0, False),
    ]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_is_stalled_threshold(jit: bool) -> None:
    config = amp_core.DynamicLossScale(init_scale=1.0, min_loss_scale=1.0, stall_steps=5)
    stalled = maybe_jit(amp_core.is_stalled, jit, static_argnums=0)
    state = amp_core.init(config)
    for count, expected in [(0, False), (4, False), (5, True), (6, True)]:
        value = stalled(config, state._replace(overflows_at_min_scale=jnp.int32(count)))
        assert value.shape == () and value.dtype == jnp.bool_
        assert bool(value) is expected


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_static_scaling_never_stalls(jit: bool) -> None:
    config = amp_core.StaticLossScale(loss_scale=1.0)
    state = amp_core.init(config)
    for _ in range(3):
        state = amp_core.update(config, state, False)
    stalled = maybe_jit(amp_core.is_stalled, jit, static_argnums=0)
    assert not bool(stalled(config, state))
    assert int(state.overflows_at_min_scale) == 0


def test_stall_steps_defaults_to_steps_per_increase_and_is_validated() -> None:
    assert amp_core.DynamicLossScale().stall_steps == 2000
    assert amp_core.DynamicLossScale(steps_per_increase=7).stall_steps == 7
    assert amp_core.make_config("dynamic", stall_steps=3).stall_steps == 3
    for bad, error in [(0, ValueError), (-1, ValueError), (1.5, ValueError), ("2", TypeError)]:
        with pytest.raises(error, match="stall_steps"):
            amp_core.DynamicLossScale(stall_steps=bad)
    with pytest.raises(TypeError, match="stall_steps"):
        amp_core.DynamicLossScale(stall_steps=True)


def test_stall_counter_under_jit_in_a_training_loop() -> None:
    """The jitted step reads the counter without a host sync, and compiles once."""
    config = amp_core.DynamicLossScale(init_scale=2.0, min_loss_scale=1.0, stall_steps=2)
    traces = []

    @jax.jit
    def step(state: amp_core.LossScaleState, grads: Any) -> tuple[Any, jax.Array]:
        traces.append(1)
        result = amp_core.check_and_update(config, state, grads)
        return result.next_state, amp_core.is_stalled(config, result.next_state)

    state = amp_core.init(config)
    stalls = []
    for value in [jnp.inf, jnp.nan, jnp.inf, 1.0, jnp.inf, jnp.inf]:
        state, stalled = step(state, [jnp.full(3, value, jnp.float32)])
        stalls.append(bool(stalled))
    assert stalls == [False, False, True, False, False, True]
    assert len(traces) == 1


# ---------------------------------------------------------------- checkpoints


def test_new_key_round_trips() -> None:
    config = amp_core.DynamicLossScale(init_scale=1.0, min_loss_scale=1.0)
    state = amp_core.init(config)
    for _ in range(3):
        state = amp_core.update(config, state, False)
    saved = amp_core.to_state_dict(config, state)
    assert saved["overflows_at_min_scale"] == 3 and isinstance(saved["overflows_at_min_scale"], int)
    assert set(saved) == {*REFERENCE_KEYS, "overflows_at_min_scale"}
    restored = amp_core.from_state_dict(config, amp_core.init(config), saved)
    assert amp_core.to_state_dict(config, restored) == saved
    assert restored.overflows_at_min_scale.dtype == jnp.int32


@pytest.mark.parametrize(
    "convert",
    [lambda v: v, np.asarray, jnp.asarray],
    ids=["python", "numpy", "jax"],
)
def test_reference_checkpoint_without_the_counter_loads(convert: Callable[[Any], Any]) -> None:
    config = amp_core.DynamicLossScale(init_scale=1.0, min_loss_scale=1.0, stall_steps=2)
    old = {
        "loss_scale": convert(1.0),
        "steps_since_rescale": convert(3),
        "overflows_since_rescale": convert(1),
        "num_skipped_steps": convert(9),
    }
    state = amp_core.from_state_dict(config, amp_core.init(config), old)
    assert amp_core.to_state_dict(config, state) == {
        "loss_scale": 1.0,
        "steps_since_rescale": 3,
        "overflows_since_rescale": 1,
        "num_skipped_steps": 9,
        "overflows_at_min_scale": 0,
    }
    # Absent keys keep their values: the count goes on from where this state had it.
    stuck = amp_core.init(config)._replace(overflows_at_min_scale=jnp.int32(1))
    assert int(amp_core.from_state_dict(config, stuck, old).overflows_at_min_scale) == 1


def test_resumed_run_keeps_counting_a_stall() -> None:
    config = amp_core.DynamicLossScale(init_scale=2.0, min_loss_scale=1.0, stall_steps=3)
    flags = [False, False, True, False, False, False, False]
    through = [amp_core.init(config)]
    for flag in flags:
        through.append(amp_core.update(config, through[-1], flag))
    for cut in range(len(flags) + 1):
        saved = amp_core.to_state_dict(config, through[cut])
        state = amp_core.from_state_dict(config, amp_core.init(config), saved)
        for flag in flags[cut:]:
            state = amp_core.update(config, state, flag)
        assert amp_core.to_state_dict(config, state) == amp_core.to_state_dict(config, through[-1])
        assert bool(amp_core.is_stalled(config, state))


@pytest.mark.parametrize("bad", [-1, 1.5, float("nan"), 2**31])
def test_invalid_counter_in_a_checkpoint_is_refused(bad: Any) -> None:
    config = amp_core.DynamicLossScale()
    with pytest.raises(ValueError, match="overflows_at_min_scale"):
        amp_core.from_state_dict(config, amp_core.init(config), {"overflows_at_min_scale": bad})


def test_static_checkpoints_have_no_counter() -> None:
    config = amp_core.StaticLossScale(loss_scale=8.0)
    assert amp_core.to_state_dict(config, amp_core.init(config)) == {"loss_scale": 8.0}
    with pytest.raises(ValueError, match="overflows_at_min_scale"):
        amp_core.from_state_dict(config, amp_core.init(config), {"overflows_at_min_scale": 0})


def test_checkpoint_keys_are_the_reference_keys_and_the_counter() -> None:
    keys = amp_core.state_dict_keys(amp_core.DynamicLossScale())
    assert keys == (*REFERENCE_KEYS, "overflows_at_min_scale")
