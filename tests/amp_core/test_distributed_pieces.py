"""The pieces a distributed job assembles its decision from, each with and without ``jax.jit``.

* ``combine_partials``: oracle, the hand sum of the sharded column plus the hand max of the
  replicated one.
* ``check_sum_of_squares`` / ``check_sum_and_update``: oracle, ``check_grads`` /
  ``check_and_update`` on the same gradients, bit for bit, also when the sum of squares comes
  from shards combined across "ranks" (exactly representable values, so sums are exact).
* ``update(..., optimizer_steps=n)`` and ``recount_skipped_steps``: hand-computed counts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from amp_helpers import assert_bitwise_equal, assert_trees_bitwise_equal

import amp_core

NAN, INF = float("nan"), float("inf")


@functools.cache
def jitted(fn: Callable[..., Any], static: tuple, static_keywords: tuple) -> Callable[..., Any]:
    """One jitted function per (function, static arguments), shared by the whole module."""
    return jax.jit(functools.partial(fn, *static, **dict(static_keywords)))


@pytest.fixture(params=["eager", "jit"])
def compiled(request) -> Callable[..., Any]:
    """``compiled(fn, *static, **static_keywords)``: ``fn`` with its static (configuration)
    arguments bound, jitted or not."""

    def make(fn: Callable[..., Any], *static: Any, **static_keywords: Any) -> Callable[..., Any]:
        if request.param == "jit":
            return jitted(fn, static, tuple(sorted(static_keywords.items())))
        return functools.partial(fn, *static, **static_keywords)

    return make


# ---------------------------------------------------------------------- combine_partials


@pytest.mark.parametrize(
    ("partials", "expected"),
    [
        ([[3.0, 5.0]], 8.0),  # one rank
        ([[1.0, 4.0], [2.0, 4.0]], 7.0),  # identical replicas count once
        ([[1.0, 4.0], [2.0, 9.0], [0.5, 1.0]], 12.5),  # the largest replica wins
        ([[0.0, 0.0], [0.0, 0.0]], 0.0),
    ],
)
def test_combine_partials_sums_shards_and_takes_the_largest_replica(compiled, partials, expected):
    result = compiled(amp_core.combine_partials)(jnp.asarray(partials, jnp.float32))
    assert_bitwise_equal(result, np.float32(expected))


@pytest.mark.parametrize(
    ("partials", "expected"),
    [
        ([[NAN, 1.0], [1.0, 1.0]], NAN),  # a shard's NaN
        ([[1.0, 1.0], [1.0, NAN]], NAN),  # a NaN replica that is not the first row
        ([[1.0, NAN], [1.0, 2.0]], NAN),  # a NaN replica in the first row
        ([[1.0, 1.0], [INF, 1.0]], INF),
        ([[1.0, 1.0], [1.0, INF]], INF),
        ([[INF, 1.0], [1.0, NAN]], NAN),
        ([[3.0e38, 1.0], [3.0e38, 1.0]], INF),  # the sum of finite shards overflows
    ],
    ids=[
        "nan-shard",
        "nan-replica",
        "nan-replica-first",
        "inf-shard",
        "inf-replica",
        "inf-and-nan",
        "overflowing-sum",
    ],
)
def test_combine_partials_propagates_faults_from_any_rank(compiled, partials, expected):
    """A fault on one rank reaches everyone's decision: ``max`` does not drop a NaN."""
    result = compiled(amp_core.combine_partials)(jnp.asarray(partials, jnp.float32))
    assert result.dtype == jnp.float32 and result.shape == ()
    if np.isnan(expected):
        assert np.isnan(result)
    else:
        assert float(result) == expected


@pytest.mark.parametrize("shape", [(), (2,), (2, 3), (2, 1), (0, 2), (2, 2, 1)])
def test_combine_partials_rejects_other_shapes(compiled, shape):
    with pytest.raises(ValueError, match=r"\[ranks, 2\].*" + re_shape(shape)):
        compiled(amp_core.combine_partials)(jnp.ones(shape, jnp.float32))


@pytest.mark.parametrize(
    ("partials", "replicas", "expected"),
    [
        # a 2 x 2 mesh (HSDP): each replica group holds both shards; rows replica-major
        ([[1.0, 0.5], [2.0, 0.5], [1.0, 0.5], [2.0, 0.5]], 2, 3.5),
        ([[1.0, 0.0], [2.0, 0.0], [1.0, 0.0], [2.0, 0.0]], 1, 6.0),  # every row: twice too much
        ([[1.0, 0.0], [2.0, 0.0], [4.0, 0.0], [1.0, 0.0]], 2, 5.0),  # the larger group counts
        ([[1.0, 0.0], [2.0, 0.0], [4.0, 0.0], [1.0, 0.0]], 4, 4.0),  # 4 replicas of one shard
        ([[1.0, 0.0], [2.0, 0.0], [0.5, 0.0], [0.25, 0.0], [8.0, 0.0], [0.0, 3.0]], 2, 11.25),
        ([[1.0, 2.0], [INF, 2.0], [1.0, 2.0], [1.0, 2.0]], 2, INF),  # one copy's fault
        ([[1.0, 2.0], [1.0, 2.0], [NAN, 2.0], [1.0, 2.0]], 2, NAN),
        ([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0], [1.0, NAN]], 2, NAN),
    ],
)
def test_combine_partials_with_replicas_sums_shards_within_each_replica_group(
    compiled, partials, replicas, expected
):
    """Oracle: the hand sum of each group's sharded rows, the larger of those, plus the largest
    replicated value; a fault in any one row reaches the result."""
    result = compiled(amp_core.combine_partials, replicas=replicas)(
        jnp.asarray(partials, jnp.float32)
    )
    assert result.dtype == jnp.float32 and result.shape == ()
    if np.isnan(expected):
        assert np.isnan(result)
    else:
        assert_bitwise_equal(result, np.float32(expected))


def test_combine_partials_with_one_replica_is_the_plain_combination(compiled):
    """``replicas=1`` (the default) takes the path FSDP2 on a 1-D mesh always took, bit for bit."""
    partials = jnp.asarray(np.random.default_rng(0).random((5, 2)), jnp.float32)
    plain = compiled(amp_core.combine_partials)(partials)
    assert_bitwise_equal(compiled(amp_core.combine_partials, replicas=1)(partials), plain)
    expected = np.float32(np.sum(np.asarray(partials[:, 0]), dtype=np.float32)) + np.max(
        np.asarray(partials[:, 1])
    )
    np.testing.assert_allclose(float(plain), float(expected), rtol=1e-6)


@pytest.mark.parametrize(
    ("replicas", "message"),
    [
        (3, r"replicas must divide the number of ranks \(rows of partials, 4\); got replicas=3"),
        (0, r"replicas must be a positive integer; got 0"),
        (-2, r"replicas must be a positive integer; got -2"),
        (2.0, r"replicas must be a positive integer; got 2\.0"),
        (True, r"replicas must be a positive integer; got True"),
    ],
)
def test_combine_partials_rejects_replicas_that_do_not_split_the_ranks(replicas, message):
    with pytest.raises(ValueError, match=message):
        amp_core.combine_partials(jnp.ones((4, 2), jnp.float32), replicas=replicas)


def re_shape(shape: tuple[int, ...]) -> str:
    return str(shape).replace("(", r"\(").replace(")", r"\)")


# ------------------------------------------------ the finishing halves against the wholes

CONFIGS = {
    "dynamic": amp_core.DynamicLossScale(init_scale=8.0, steps_per_increase=2),
    "dynamic-gcc": amp_core.DynamicLossScale(
        init_scale=8.0, steps_per_increase=2, max_gradient_norm=2.0
    ),
    "static": amp_core.StaticLossScale(loss_scale=4.0),
}


def gradients(fault: float | None) -> dict[str, jax.Array]:
    """Scaled gradients whose squares and sums are exact in float32 (small multiples of 8)."""
    grads = {
        "w": jnp.arange(-6.0, 6.0, dtype=jnp.float32).reshape(3, 4) * 8,
        "b": jnp.asarray([16.0, -24.0, 8.0], jnp.float16),
        "s": jnp.asarray(40.0, jnp.float32),
    }
    if fault is not None:
        grads["w"] = grads["w"].at[1, 2].set(fault)
    return grads


# Finite, but its unscaled square overflows float32: the sum takes its second read.
HUGE = 1e20 * 8
FAULTS = {"finite": None, "inf": INF, "nan": NAN, "huge": HUGE}


def cases(*triples: tuple[str, str, bool]) -> list[Any]:
    return [
        pytest.param(
            name, fault, unscaled, id=f"{name}-{fault}" + ("-unscaled" if unscaled else "")
        )
        for name, fault, unscaled in triples
    ]


# Every configuration finite and faulty; the fault kinds where they matter (GCC's clip
# multiplier depends on the flag). Eager calls cost a compilation of lax.cond each: few cases.
CHECK_CASES = cases(
    ("dynamic", "finite", False),
    ("dynamic", "inf", False),
    ("dynamic-gcc", "finite", False),
    ("dynamic-gcc", "nan", False),
    ("dynamic-gcc", "huge", False),
    ("dynamic-gcc", "finite", True),
    ("dynamic-gcc", "inf", True),
    ("static", "finite", False),
    ("static", "inf", False),
)


@pytest.mark.parametrize(("name", "fault", "unscaled"), CHECK_CASES)
def test_check_sum_of_squares_equals_check_grads(compiled, name, fault, unscaled):
    cfg = CONFIGS[name]
    state = amp_core.init(cfg)
    grads = gradients(FAULTS[fault])
    inv = jnp.float32(1.0) if unscaled else amp_core.inverse_scale(state)
    total = compiled(amp_core.sum_of_unscaled_squares)(grads, inv)
    halves = compiled(amp_core.check_sum_of_squares, cfg, unscaled=unscaled)(state, total)
    whole = compiled(amp_core.check_grads, cfg, unscaled=unscaled)(state, grads)
    assert_trees_bitwise_equal(halves, whole)
    assert bool(whole.isfinite) is (fault == "finite" or name == "static")


def shard_partials(state: amp_core.LossScaleState, grads: dict[str, jax.Array]) -> jax.Array:
    """Two "ranks": ``w`` sharded by rows (2 rows and 1 row), ``b`` and ``s`` replicated."""
    inv = amp_core.inverse_scale(state)
    replicated = amp_core.sum_of_unscaled_squares([grads["b"], grads["s"]], inv)
    shards = (grads["w"][:2], grads["w"][2:])
    return jnp.stack(
        [jnp.stack([amp_core.sum_of_unscaled_squares([s], inv), replicated]) for s in shards]
    )


@pytest.mark.parametrize(
    ("name", "fault", "unscaled"),
    cases(
        ("dynamic", "huge", False),  # a finite shard whose square overflows: inf for all
        ("dynamic-gcc", "finite", False),  # the clip multiplier from the combined norm
        ("static", "inf", False),
    ),
)
def test_combined_shards_decide_as_the_whole_gradients(compiled, name, fault, unscaled):
    """``combine_partials`` of per-shard sums then ``check_sum_and_update`` (with two optimizer
    steps) equals ``check_and_update`` on the unsharded gradients, state included.
    """
    cfg = CONFIGS[name]
    state = amp_core.init(cfg)
    grads = gradients(FAULTS[fault])
    total = compiled(amp_core.combine_partials)(compiled(shard_partials)(state, grads))
    halves = compiled(amp_core.check_sum_and_update, cfg)(state, total, optimizer_steps=2)
    whole = compiled(amp_core.check_and_update, cfg)(state, grads, optimizer_steps=2)
    assert_trees_bitwise_equal(halves, whole)
    if name != "static":
        expected_skipped = 0 if fault == "finite" else 2
        assert int(whole.next_state.num_skipped_steps) == expected_skipped


def test_check_sum_and_update_follows_check_and_update_over_a_trace(compiled):
    """Six DLS + GCC steps, chained: the two paths keep bit-identical states and multipliers
    through a growth and three halvings."""
    cfg = CONFIGS["dynamic-gcc"]
    halves_step = compiled(amp_core.check_sum_and_update, cfg)
    whole_step = compiled(amp_core.check_and_update, cfg)
    sum_of_squares = compiled(amp_core.sum_of_unscaled_squares)
    faults = [None, None, None, INF, NAN, HUGE]
    halves_state = whole_state = amp_core.init(cfg)
    scales = set()
    for fault in faults:
        grads = gradients(fault)
        total = sum_of_squares(grads, amp_core.inverse_scale(halves_state))
        halves = halves_step(halves_state, total)
        whole = whole_step(whole_state, grads)
        assert_trees_bitwise_equal(halves, whole)
        halves_state, whole_state = halves.next_state, whole.next_state
        scales.add(float(whole_state.loss_scale))
    assert int(whole_state.num_skipped_steps) == 3
    assert scales == {8.0, 16.0, 4.0, 2.0}  # grew, then halved three times


# ------------------------------------------------- optimizer_steps and recount_skipped_steps

DYNAMIC = amp_core.DynamicLossScale(init_scale=64.0, steps_per_increase=100)


def counters(state: amp_core.LossScaleState) -> tuple[float, int, int, int]:
    return (
        float(state.loss_scale),
        int(state.steps_since_rescale),
        int(state.overflows_since_rescale),
        int(state.num_skipped_steps),
    )


def test_update_counts_every_skipped_optimizer_step(compiled):
    """Hand-computed: an overflow adds ``optimizer_steps`` skips (0 too) and halves once; a
    finite step adds none. The step count is data under jit: one compilation for all.
    """
    step = compiled(amp_core.update, DYNAMIC)
    state = amp_core.init(DYNAMIC)
    trace = []
    for isfinite, steps in [
        (False, 3),
        (True, 3),
        (False, 0),
        (False, 2),
        (True, 1),
        (False, 1),
    ]:
        state = step(state, jnp.asarray(isfinite), optimizer_steps=jnp.asarray(steps, jnp.int32))
        trace.append(counters(state))
    assert trace == [
        (32.0, 0, 0, 3),
        (32.0, 1, 0, 3),
        (16.0, 0, 0, 3),
        (8.0, 0, 0, 5),
        (8.0, 1, 0, 5),
        (4.0, 0, 0, 6),
    ]
    if hasattr(step, "_cache_size"):  # jitted: the count is data, not a static argument
        assert step._cache_size() == 1


def test_update_default_is_one_optimizer_step(compiled):
    state = compiled(amp_core.update, DYNAMIC)(amp_core.init(DYNAMIC), jnp.asarray(False))
    assert counters(state) == (32.0, 0, 0, 1)


def test_static_update_ignores_optimizer_steps(compiled):
    cfg = CONFIGS["static"]
    state = compiled(amp_core.update, cfg)(
        amp_core.init(cfg), jnp.asarray(False), optimizer_steps=5
    )
    assert int(state.num_skipped_steps) == 0 and float(state.loss_scale) == 4.0


@pytest.mark.parametrize("value", [jnp.asarray([1, 2], jnp.int32), jnp.ones((1,), jnp.int32)])
def test_optimizer_steps_must_be_a_scalar(compiled, value):
    state = amp_core.init(DYNAMIC)
    with pytest.raises(ValueError, match="optimizer_steps must be a 0-d"):
        compiled(amp_core.update, DYNAMIC)(state, jnp.asarray(False), optimizer_steps=value)
    after = amp_core.update(DYNAMIC, state, jnp.asarray(False))
    with pytest.raises(ValueError, match="optimizer_steps must be a 0-d"):
        compiled(amp_core.recount_skipped_steps)(state, after, value)


def with_skips(state: amp_core.LossScaleState, skipped: int) -> amp_core.LossScaleState:
    return state._replace(num_skipped_steps=jnp.asarray(skipped, state.num_skipped_steps.dtype))


@pytest.mark.parametrize("isfinite", [False, True], ids=["overflow", "finite"])
@pytest.mark.parametrize("counted", [0, 1, 3])
@pytest.mark.parametrize("recounted", [0, 1, 2, 4])
def test_recount_skipped_steps(compiled, isfinite, counted, recounted):
    """Hand-computed: ``previous + (1 - isfinite) * recounted``, every other field untouched;
    so recounting equals updating with the right count in the first place.
    """
    previous = with_skips(amp_core.init(DYNAMIC), 5)
    flag = jnp.asarray(isfinite)
    after = amp_core.update(DYNAMIC, previous, flag, optimizer_steps=counted)
    recounted_state = compiled(amp_core.recount_skipped_steps)(previous, after, recounted)
    expected_skipped = 5 + (0 if isfinite else recounted)
    assert int(recounted_state.num_skipped_steps) == expected_skipped
    assert_trees_bitwise_equal(recounted_state, with_skips(after, expected_skipped))
    direct = amp_core.update(DYNAMIC, previous, flag, optimizer_steps=recounted)
    assert_trees_bitwise_equal(recounted_state, direct)
