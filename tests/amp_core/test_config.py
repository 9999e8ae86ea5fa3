"""Configuration objects: SPEC section 1 defaults, eager validation, hashing and jit round trips."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import amp_core

SPEC_DEFAULT_SCALE = {"float16": 2.0**15, "bfloat16": 2.0**15, "cbfloat16": 2.0**31}


# -- defaults -------------------------------------------------------------------------------------


@pytest.mark.parametrize("half_dtype", ["float16", "bfloat16", "cbfloat16"])
def test_dynamic_defaults_follow_spec_table(half_dtype):
    cfg = amp_core.make_config("dynamic", half_dtype=half_dtype)
    assert isinstance(cfg, amp_core.DynamicLossScale)
    assert cfg.init_scale == SPEC_DEFAULT_SCALE[half_dtype]
    assert cfg.max_loss_scale == SPEC_DEFAULT_SCALE[half_dtype]
    assert cfg.min_loss_scale == 2.0**-14
    assert cfg.steps_per_increase == 2000
    assert cfg.overflow_tolerance == 0.0
    assert cfg.max_gradient_norm is None
    assert cfg.half_dtype == half_dtype


@pytest.mark.parametrize(
    ("torch_dtype", "name"), [(torch.float16, "float16"), (torch.bfloat16, "bfloat16")]
)
def test_torch_half_dtypes_select_their_defaults(torch_dtype, name):
    cfg = amp_core.make_config("dynamic", half_dtype=torch_dtype)
    assert cfg.half_dtype == name
    assert cfg.init_scale == SPEC_DEFAULT_SCALE[name]


def test_half_dtype_defaults_to_float16():
    assert amp_core.DynamicLossScale() == amp_core.make_config("dynamic", half_dtype="float16")


def test_explicit_values_override_defaults():
    cfg = amp_core.make_config(
        "dynamic",
        init_scale=64.0,
        steps_per_increase=7,
        min_loss_scale=0.5,
        max_loss_scale=2.0**20,
        overflow_tolerance=0.25,
        max_gradient_norm=1.5,
        half_dtype="cbfloat16",
    )
    assert (cfg.init_scale, cfg.steps_per_increase, cfg.min_loss_scale) == (64.0, 7, 0.5)
    assert (cfg.max_loss_scale, cfg.overflow_tolerance, cfg.max_gradient_norm) == (
        2.0**20,
        0.25,
        1.5,
    )
    assert cfg.clips


@pytest.mark.parametrize("loss_scale", [None, 1, 1.0])
def test_static_default_is_no_scaling(loss_scale):
    cfg = amp_core.make_config(loss_scale)
    assert cfg == amp_core.StaticLossScale(loss_scale=1.0)
    assert not cfg.is_dynamic


def test_static_config_ignores_dynamic_only_arguments():
    cfg = amp_core.make_config(
        128, init_scale=4.0, steps_per_increase=3, max_gradient_norm=1.0, half_dtype="cbfloat16"
    )
    assert cfg == amp_core.StaticLossScale(loss_scale=128.0)


def test_numeric_arguments_are_stored_as_python_numbers():
    cfg = amp_core.make_config(
        "dynamic",
        init_scale=np.float32(8.0),
        steps_per_increase=np.int64(5),
        min_loss_scale=torch.tensor(0.5),
        max_loss_scale=jnp.float32(64.0),
    )
    assert type(cfg.init_scale) is float and cfg.init_scale == 8.0
    assert type(cfg.steps_per_increase) is int and cfg.steps_per_increase == 5
    assert type(cfg.min_loss_scale) is float and cfg.min_loss_scale == 0.5
    assert type(cfg.max_loss_scale) is float and cfg.max_loss_scale == 64.0


# -- initial state --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("init_scale", "max_loss_scale", "expected"),
    [
        (2.0**20, 2.0**10, 2.0**10),  # init above max: clamped
        (2.0**5, 2.0**10, 2.0**5),
        (2.0**10, 2.0**10, 2.0**10),
        (None, None, 2.0**15),
    ],
)
def test_initial_scale_is_min_of_max_and_init(init_scale, max_loss_scale, expected):
    cfg = amp_core.make_config(
        "dynamic", init_scale=init_scale, max_loss_scale=max_loss_scale, min_loss_scale=2.0**-14
    )
    state = amp_core.init(cfg)
    assert state.loss_scale.dtype == jnp.float32
    assert float(state.loss_scale) == expected
    assert float(state.non_clamped_scale) == expected
    assert int(state.steps_since_rescale) == 0
    assert int(state.overflows_since_rescale) == 0
    assert int(state.num_skipped_steps) == 0


def test_cbfloat16_initial_scale_is_exactly_two_to_the_31():
    state = amp_core.init(amp_core.make_config("dynamic", half_dtype="cbfloat16"))
    assert np.asarray(state.loss_scale) == np.float32(2.0**31)


# -- validation -----------------------------------------------------------------------------------

INVALID_DYNAMIC = [
    # (keyword arguments, exception, pattern that must appear in the message)
    ({"min_loss_scale": 2.0**-15}, ValueError, r"min_loss_scale.*3\.05"),
    ({"min_loss_scale": 1e-30}, ValueError, "min_loss_scale"),
    ({"overflow_tolerance": -0.1}, ValueError, r"overflow_tolerance.*-0\.1"),
    ({"overflow_tolerance": -1e-12}, ValueError, "overflow_tolerance"),
    ({"overflow_tolerance": math.nan}, ValueError, "overflow_tolerance"),
    ({"overflow_tolerance": math.inf}, ValueError, "overflow_tolerance"),
    ({"init_scale": 0.0}, ValueError, r"init_scale.*0\.0"),
    ({"init_scale": -4.0}, ValueError, r"init_scale.*-4\.0"),
    ({"init_scale": math.inf}, ValueError, r"init_scale.*inf"),
    ({"init_scale": math.nan}, ValueError, r"init_scale.*nan"),
    ({"max_loss_scale": 0.0}, ValueError, "max_loss_scale"),
    ({"max_loss_scale": -1.0}, ValueError, "max_loss_scale"),
    ({"max_loss_scale": math.inf}, ValueError, "max_loss_scale"),
    ({"max_loss_scale": math.nan}, ValueError, "max_loss_scale"),
    ({"min_loss_scale": 0.0}, ValueError, "min_loss_scale"),
    ({"min_loss_scale": -1.0}, ValueError, "min_loss_scale"),
    ({"min_loss_scale": math.inf}, ValueError, "min_loss_scale"),
    ({"min_loss_scale": math.nan}, ValueError, "min_loss_scale"),
    ({"min_loss_scale": 16.0, "max_loss_scale": 8.0}, ValueError, r"min_loss_scale.*16\.0.*8\.0"),
    ({"min_loss_scale": 2.0**16}, ValueError, "max_loss_scale"),  # above the default maximum
    ({"steps_per_increase": 0}, ValueError, r"steps_per_increase.*0"),
    ({"steps_per_increase": -3}, ValueError, r"steps_per_increase.*-3"),
    ({"steps_per_increase": 1.5}, ValueError, r"steps_per_increase.*1\.5"),
    ({"steps_per_increase": math.nan}, ValueError, "steps_per_increase"),
    ({"steps_per_increase": True}, TypeError, "steps_per_increase"),
    ({"steps_per_increase": "10"}, TypeError, "steps_per_increase"),
    ({"init_scale": True}, TypeError, "init_scale"),
    ({"init_scale": "1024"}, TypeError, r"init_scale.*'1024'"),
    ({"min_loss_scale": False}, TypeError, "min_loss_scale"),
    ({"max_loss_scale": [1.0]}, TypeError, "max_loss_scale"),
    ({"overflow_tolerance": None}, TypeError, "overflow_tolerance"),
    ({"max_gradient_norm": 0.0}, ValueError, "max_gradient_norm"),
    ({"max_gradient_norm": -1.0}, ValueError, "max_gradient_norm"),
    ({"max_gradient_norm": math.nan}, ValueError, "max_gradient_norm"),
    ({"max_gradient_norm": "1.0"}, TypeError, "max_gradient_norm"),
    ({"half_dtype": "float32"}, ValueError, r"half_dtype.*'float32'"),
    ({"half_dtype": "fp16"}, ValueError, "half_dtype"),
    ({"half_dtype": torch.float32}, ValueError, "half_dtype"),
    ({"half_dtype": None}, ValueError, "half_dtype"),
]


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"), INVALID_DYNAMIC, ids=[str(k) for k, *_ in INVALID_DYNAMIC]
)
def test_invalid_dynamic_argument_is_rejected_naming_it(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        amp_core.make_config("dynamic", **kwargs)
    with pytest.raises(error, match=pattern):
        amp_core.DynamicLossScale(**kwargs)


@pytest.mark.parametrize(
    ("loss_scale", "error", "pattern"),
    [
        ("static", ValueError, r"loss_scale.*'static'"),
        ("Dynamic", ValueError, "loss_scale"),
        ("", ValueError, "loss_scale"),
        (0.0, ValueError, "loss_scale"),
        (-2.0, ValueError, r"loss_scale.*-2\.0"),
        (math.inf, ValueError, "loss_scale"),
        (math.nan, ValueError, "loss_scale"),
        (True, TypeError, "loss_scale"),
        (b"dynamic", TypeError, "loss_scale"),
    ],
)
def test_invalid_loss_scale_is_rejected_naming_it(loss_scale, error, pattern):
    with pytest.raises(error, match=pattern):
        amp_core.make_config(loss_scale)


def test_static_config_still_validates_half_dtype():
    with pytest.raises(ValueError, match="half_dtype"):
        amp_core.make_config(1.0, half_dtype="float64")


def test_smallest_allowed_minimum_is_accepted():
    assert amp_core.make_config("dynamic", min_loss_scale=2.0**-14).min_loss_scale == 2.0**-14


# -- value semantics ------------------------------------------------------------------------------


def test_configs_are_frozen():
    cfg = amp_core.DynamicLossScale()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.init_scale = 2.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        amp_core.StaticLossScale().loss_scale = 2.0  # type: ignore[misc]


def test_configs_are_hashable_and_equal_by_value():
    a = amp_core.make_config("dynamic", steps_per_increase=5, min_loss_scale=4.0)
    b = amp_core.make_config("dynamic", steps_per_increase=5, min_loss_scale=4.0)
    c = amp_core.make_config("dynamic", steps_per_increase=6, min_loss_scale=4.0)
    assert a is not b
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert {a: "x"}[b] == "x"
    assert len({a, b, c}) == 2
    assert amp_core.StaticLossScale(2.0) == amp_core.make_config(2)
    assert hash(amp_core.StaticLossScale(2.0)) == hash(amp_core.make_config(2.0))
    assert amp_core.StaticLossScale(1.0) != amp_core.DynamicLossScale()


def test_defaults_resolved_equal_explicit_values():
    explicit = amp_core.DynamicLossScale(
        init_scale=2.0**15, steps_per_increase=2000, min_loss_scale=2.0**-14, max_loss_scale=2.0**15
    )
    assert explicit == amp_core.DynamicLossScale()
    assert hash(explicit) == hash(amp_core.DynamicLossScale())


def all_fields(cfg) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


FLOOR_CONFIG = amp_core.DynamicLossScale(
    init_scale=16.0,
    steps_per_increase=3,
    min_loss_scale=4.0,
    max_loss_scale=2.0**20,
    overflow_tolerance=0.25,
    max_gradient_norm=2.5,
    half_dtype="cbfloat16",
)


def test_config_survives_jit_as_static_argument_with_every_field():
    """jmp's bug: a hand-written flatten dropped ``min_loss_scale`` under jit."""
    seen = []

    @functools.partial(jax.jit, static_argnums=0)
    def traced(cfg, x):
        seen.append(cfg)
        return x

    traced(FLOOR_CONFIG, jnp.zeros(()))
    assert len(seen) == 1
    assert all_fields(seen[0]) == all_fields(FLOOR_CONFIG)
    assert all_fields(seen[0])["min_loss_scale"] == 4.0


def test_config_survives_pytree_round_trip_with_every_field():
    tree = {"cfg": FLOOR_CONFIG, "x": jnp.zeros(())}
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)["cfg"]
    assert all_fields(rebuilt) == all_fields(FLOOR_CONFIG)
    mapped = jax.tree_util.tree_map(lambda leaf: leaf, tree)["cfg"]
    assert all_fields(mapped) == all_fields(FLOOR_CONFIG)


def test_config_inside_static_tuple_survives_jit():
    seen = []

    @functools.partial(jax.jit, static_argnames="static")
    def traced(x, static):
        seen.append(static)
        return x

    traced(jnp.zeros(()), static=("cfg", FLOOR_CONFIG))
    assert all_fields(seen[0][1]) == all_fields(FLOOR_CONFIG)


@pytest.mark.parametrize(
    "clone", [copy.copy, copy.deepcopy, lambda c: pickle.loads(pickle.dumps(c))]
)
def test_config_survives_copy_and_pickle(clone):
    assert all_fields(clone(FLOOR_CONFIG)) == all_fields(FLOOR_CONFIG)


def test_minimum_scale_is_honoured_under_jit():
    """A floor of 4 must not silently become anything else inside a jitted update."""
    step = jax.jit(functools.partial(amp_core.update, FLOOR_CONFIG))
    state = amp_core.init(FLOOR_CONFIG)
    for _ in range(5):
        state = step(state, jnp.asarray(False))
    assert float(state.loss_scale) == 4.0
    assert float(state.non_clamped_scale) == 2.0


def test_equal_configs_share_one_compilation():
    traces = []

    @functools.partial(jax.jit, static_argnums=0)
    def step(cfg, state):
        traces.append(cfg)
        return amp_core.update(cfg, state, jnp.asarray(True))

    first = amp_core.make_config("dynamic", steps_per_increase=9)
    second = amp_core.make_config("dynamic", steps_per_increase=9)
    state = step(first, amp_core.init(first))
    step(second, state)
    assert len(traces) == 1
    step(amp_core.make_config("dynamic", steps_per_increase=10), state)
    assert len(traces) == 2


def test_amp_core_tests_run_under_strict_dtype_promotion():
    """tests/conftest.py turns implicit dtype promotion into an error for these tests."""
    assert jax.config.jax_numpy_dtype_promotion == "strict"
    with pytest.raises(jax.dtypes.TypePromotionError):
        jnp.ones(2, jnp.float16) + jnp.ones(2, jnp.float32)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"loss_scale": 1e39}, "loss_scale"),
        ({"loss_scale": 1e-46}, "loss_scale"),
        ({"loss_scale": "dynamic", "init_scale": 1e39}, "init_scale"),
        ({"loss_scale": "dynamic", "max_loss_scale": 1e39}, "max_loss_scale"),
        ({"loss_scale": "dynamic", "steps_per_increase": 2**31}, "steps_per_increase"),
    ],
)
def test_values_that_do_not_fit_the_float32_or_int32_state_are_rejected(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        amp_core.make_config(**kwargs)


def test_a_checkpoint_scale_beyond_float32_is_rejected():
    cfg = amp_core.DynamicLossScale()
    with pytest.raises(ValueError, match="loss_scale"):
        amp_core.from_state_dict(cfg, amp_core.init(cfg), {"loss_scale": 1e39})
