"""``amp_core.locate_overflow``: which flax module's output or input gradient overflowed.

The oracle is the model evaluated by hand with ``jnp`` (its weights read back), and the
gradients w.r.t. each layer's input taken with ``jax.grad`` of the hand-written rest of the
model: the events are the checks whose magnitude exceeds the threshold, numbered in the order
they run (forward: the order the modules return, the model last; backward: from the last
layer's input back; an input nothing differentiates, such as the data, has no check).
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from amp_helpers import run_script
from flax import nnx

from amp_core.locate_overflow import LocatedOverflow, locate_overflow

FLOAT16_MAX = 65504.0
REPO_ROOT = Path(__file__).resolve().parents[2]
SCALE = 8.0


class MLP(nnx.Module):
    """first, relu, mid (every weight ``planted``), relu, last."""

    def __init__(self, planted: float, first: float = 0.01, dtype: jnp.dtype = jnp.float32):
        def linear(n_in: int, n_out: int, weight: float, seed: int) -> nnx.Linear:
            return nnx.Linear(
                n_in,
                n_out,
                kernel_init=nnx.initializers.constant(weight),
                bias_init=nnx.initializers.normal(0.01),
                dtype=dtype,
                param_dtype=dtype,
                rngs=nnx.Rngs(seed),
            )

        self.first = linear(4, 8, first, 0)
        self.mid = linear(8, 8, planted, 1)
        self.last = linear(8, 2, 0.5, 2)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.last(jax.nn.relu(self.mid(jax.nn.relu(self.first(x)))))


def weights(model: MLP) -> list[tuple[jax.Array, jax.Array]]:
    return [(m.kernel[...], m.bias[...]) for m in (model.first, model.mid, model.last)]


def oracle(
    layers: list[tuple[jax.Array, jax.Array]],
    names: tuple[str, str, str],
    x: jax.Array,
    threshold: float,
    backward: bool,
) -> list[tuple[str, str, float, int]]:
    (w0, b0), (w1, b1), (w2, b2) = layers
    h0 = x @ w0 + b0
    r0 = jax.nn.relu(h0)
    h1 = r0 @ w1 + b1
    r1 = jax.nn.relu(h1)
    h2 = r1 @ w2 + b2
    checks = [
        (names[0], "forward", h0),
        (names[1], "forward", h1),
        (names[2], "forward", h2),
        ("", "forward", h2),
    ]
    if backward:
        into_last = jax.grad(lambda r: SCALE * jnp.sum(r @ w2 + b2))(r1)
        into_mid = jax.grad(lambda r: SCALE * jnp.sum(jax.nn.relu(r @ w1 + b1) @ w2 + b2))(r0)
        checks += [(names[2], "backward", into_last), (names[1], "backward", into_mid)]
    expected = []
    for call, (name, kind, value) in enumerate(checks):
        magnitude = float(jnp.max(jnp.abs(value.astype(jnp.float32))))
        if math.isnan(magnitude) or magnitude > threshold:
            expected.append((name, kind, magnitude, call))
    return expected


def assert_matches(found: LocatedOverflow, expected: list[tuple[str, str, float, int]]) -> None:
    got = [(e.name, e.kind, e.abs_max, e.call) for e in found.events]
    assert [(n, k, c) for n, k, _, c in got] == [(n, k, c) for n, k, _, c in expected]
    for (*_, value, _), (*_, want, _) in zip(got, expected, strict=True):
        assert value == pytest.approx(want, rel=1e-6)


def nnx_loss(model: MLP, x: jax.Array) -> jax.Array:
    return SCALE * jnp.sum(model(x))


NNX_NAMES = ("first", "mid", "last")


def test_nnx_the_planted_layer_is_the_first_forward_event():
    model = MLP(planted=1e4, first=1.0)  # mid outputs about 3.2e5
    x = jnp.ones((3, 4))
    with locate_overflow(model) as found:
        model(x)
    expected = oracle(weights(model), NNX_NAMES, x, FLOAT16_MAX, backward=False)
    assert [name for name, *_ in expected] == ["mid", "last", ""]
    assert_matches(found, expected)
    assert found.first == "mid" and found.calls == 4
    assert found.events[0].module_type == "Linear"


@pytest.mark.parametrize("transform", ["grad", "jit_value_and_grad"])
def test_nnx_a_backward_only_overflow_under_grad_and_jit(transform: str):
    model = MLP(planted=1e4)  # forward in range; mid's backward multiplies by 8e4
    x = jnp.ones((3, 4))
    step = nnx.grad(nnx_loss)
    if transform == "jit_value_and_grad":
        step = nnx.jit(nnx.value_and_grad(nnx_loss))
    with locate_overflow(model) as found:
        step(model, x)
    expected = oracle(weights(model), NNX_NAMES, x, FLOAT16_MAX, backward=True)
    assert [(name, kind) for name, kind, *_ in expected] == [("mid", "backward")]
    assert_matches(found, expected)
    assert found.first == "mid" and found.calls == 6
    if transform == "jit_value_and_grad":  # after exit the function retraces, untapped
        with locate_overflow(model, threshold=math.inf) as quiet:
            pass
        step(model, x)
        assert found.calls == 6 and quiet.calls == 0


def test_nnx_a_healthy_model_records_nothing_and_everything_is_undone():
    model = MLP(planted=0.1)
    original = nnx.Linear.__call__
    x = jnp.ones((3, 4))
    with locate_overflow(model) as found:
        assert nnx.Linear.__call__ is not original
        nnx.grad(nnx_loss)(model, x)
    assert oracle(weights(model), NNX_NAMES, x, FLOAT16_MAX, backward=True) == []
    assert found.events == [] and found.first is None and not found and found.calls == 6
    assert str(found).startswith("no overflow: 0 of 6 module outputs")
    assert nnx.Linear.__call__ is original and MLP.__call__ is MLP.__dict__["__call__"]
    assert not any(hasattr(m, "_amp_core_locate_overflow_tag") for _, m in nnx.iter_modules(model))


def test_nnx_everything_is_undone_when_the_block_raises():
    model = MLP(planted=1e4, first=1.0)
    original = nnx.Linear.__call__
    with pytest.raises(RuntimeError, match="the body failed"):
        with locate_overflow(model) as found:
            model(jnp.ones((3, 4)))
            raise RuntimeError("the body failed")
    assert nnx.Linear.__call__ is original
    assert not any(hasattr(m, "_amp_core_locate_overflow_tag") for _, m in nnx.iter_modules(model))
    assert found.first == "mid"


def test_nnx_a_float16_model_overflows_to_inf():
    model = MLP(planted=1e4, first=1.0, dtype=jnp.float16)
    x = jnp.ones((3, 4), jnp.float16)
    with locate_overflow(model) as found:
        out = model(x)
    assert out.dtype == jnp.float16 and bool(jnp.isinf(out).all())
    assert [(e.name, e.abs_max) for e in found.events] == [
        ("mid", math.inf),
        ("last", math.inf),
        ("", math.inf),
    ]


def test_the_table_names_the_first_and_the_model():
    model = MLP(planted=1e4, first=1.0)
    with locate_overflow(model) as found:
        model(jnp.ones((3, 4)))
    lines = str(found).splitlines()
    assert lines[0] == "first overflow: mid (Linear, forward)"
    assert [line.split()[-2:] for line in lines[2:-1]] == [
        ["mid", "(Linear)"],
        ["last", "(Linear)"],
        ["<model>", "(MLP)"],
    ]
    assert lines[-1] == (
        "3 of 4 module outputs and input gradients checked held inf or NaN or exceeded 65504 "
        "(the float16 maximum)"
    )


class Outputs(nnx.Module):
    def __init__(self) -> None:
        self.inner = nnx.Linear(2, 2, kernel_init=nnx.initializers.ones, rngs=nnx.Rngs(0))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        y = self.inner(x)
        return jnp.argmax(y, axis=-1), {"big": y * 1e6, "small": y}


def test_nnx_tuple_and_dict_outputs_are_read_and_integers_ignored():
    model = Outputs()
    with locate_overflow(model) as found:
        _, parts = model(jnp.ones((1, 2)))
    assert [(e.name, e.call) for e in found.events] == [("", 1)]
    assert found.events[0].abs_max == pytest.approx(float(jnp.max(parts["big"])), rel=1e-6)


class LinenMLP(nn.Module):
    planted: float
    first: float = 0.01

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        def dense(n: int, weight: float) -> nn.Dense:
            return nn.Dense(
                n, kernel_init=nn.initializers.constant(weight), bias_init=nn.initializers.zeros
            )

        x = jax.nn.relu(dense(8, self.first)(x))
        x = jax.nn.relu(dense(8, self.planted)(x))
        return dense(2, 0.5)(x)


def linen_layers(variables: dict) -> list[tuple[jax.Array, jax.Array]]:
    params = variables["params"]
    return [(params[f"Dense_{i}"]["kernel"], params[f"Dense_{i}"]["bias"]) for i in range(3)]


LINEN_NAMES = ("Dense_0", "Dense_1", "Dense_2")


def test_linen_forward_events_by_path():
    model = LinenMLP(planted=1e4, first=1.0)
    x = jnp.ones((3, 4))
    variables = model.init(jax.random.key(0), x)
    with locate_overflow(model) as found:
        model.apply(variables, x)
    expected = oracle(linen_layers(variables), LINEN_NAMES, x, FLOAT16_MAX, backward=False)
    assert_matches(found, expected)
    assert found.first == "Dense_1" and found.events[0].module_type == "Dense"


def test_linen_backward_events_under_grad_and_a_jit_made_inside_the_block():
    model = LinenMLP(planted=1e4)
    x = jnp.ones((3, 4))
    variables = model.init(jax.random.key(0), x)

    def loss(v: dict) -> jax.Array:
        return SCALE * jnp.sum(model.apply(v, x))

    expected = oracle(linen_layers(variables), LINEN_NAMES, x, FLOAT16_MAX, backward=True)
    assert [(name, kind) for name, kind, *_ in expected] == [("Dense_1", "backward")]
    with locate_overflow(model) as found:
        grads = jax.grad(loss)(variables)
    assert_matches(found, expected)
    with locate_overflow(model) as found_jit:
        jit_grads = jax.jit(jax.grad(lambda v: loss(v)))(variables)
    assert_matches(found_jit, expected)
    np.testing.assert_allclose(
        jit_grads["params"]["Dense_0"]["kernel"], grads["params"]["Dense_0"]["kernel"], rtol=1e-6
    )
    reference = jax.grad(loss)(variables)  # the taps change no gradient
    for path in ("Dense_0", "Dense_1", "Dense_2"):
        np.testing.assert_array_equal(
            grads["params"][path]["kernel"], reference["params"][path]["kernel"]
        )


def test_linen_a_jit_traced_before_the_block_shows_nothing_and_says_so():
    model = LinenMLP(planted=1e4, first=1.0)
    x = jnp.ones((3, 4))
    variables = model.init(jax.random.key(0), x)
    apply = jax.jit(model.apply)
    apply(variables, x)
    with locate_overflow(model) as found:
        apply(variables, x)
    assert found.calls == 0
    assert str(found).endswith("(no module call was seen inside the block)")


def test_the_threshold_arguments():
    model = MLP(planted=1e4, first=1.0)  # mid outputs about 3.2e5
    x = jnp.ones((3, 4))
    with locate_overflow(model, dtype=jnp.bfloat16) as found:
        model(x)
    assert found.first is None and found.threshold == float(jnp.finfo(jnp.bfloat16).max)
    with locate_overflow(model, dtype="cbfloat16") as found:
        model(x)
    assert found.threshold == (2 - 2**-9) * 2**31 and found.dtype == "cbfloat16"
    with locate_overflow(model, threshold=3.0) as found:
        model(x)
    assert_matches(found, oracle(weights(model), NNX_NAMES, x, 3.0, backward=False))
    assert found.first == "first" and found.dtype is None
    with locate_overflow(model, threshold=math.inf) as found:
        model(jnp.full((3, 4), jnp.nan))
    assert [e.name for e in found.events] == ["first", "mid", "last", ""]
    assert all(math.isnan(e.abs_max) for e in found.events)


class EqxLinear(eqx.Module):
    weight: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.weight


@pytest.mark.parametrize(
    ("model", "match"),
    [
        (None, r"model must be a flax nnx\.Module or flax\.linen\.Module.*got NoneType"),
        (lambda x: x, r"model must be a flax .*got function"),
        (EqxLinear(jnp.ones((2, 2))), r"equinox modules are not supported.*got EqxLinear"),
    ],
)
def test_a_model_that_is_not_a_flax_module_is_a_type_error(model, match):
    with pytest.raises(TypeError, match=match):
        locate_overflow(model)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dtype": "float32"}, ValueError, r"dtype must be one of .*got 'float32'"),
        ({"dtype": jnp.float32}, ValueError, r"dtype must be one of"),
        ({"threshold": 0.0}, ValueError, r"threshold must be a positive number.*got 0\.0"),
        ({"threshold": "big"}, TypeError, r"threshold must be a positive real.*got str"),
        ({"dtype": "float16", "threshold": 1.0}, ValueError, r"dtype or threshold, not both"),
    ],
)
def test_bad_arguments_change_nothing(kwargs, error, match):
    model = MLP(planted=1.0)
    original = nnx.Linear.__call__
    with pytest.raises(error, match=match):
        locate_overflow(model, **kwargs)
    assert nnx.Linear.__call__ is original
    assert not any(hasattr(m, "_amp_core_locate_overflow_tag") for _, m in nnx.iter_modules(model))


BLOCKED = textwrap.dedent(
    """
    import sys

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {"flax", "equinox"}:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
            return None

    sys.meta_path.insert(0, Blocker())
    from amp_core.locate_overflow import locate_overflow

    try:
        locate_overflow(object())
    except TypeError as err:
        assert "model must be a flax" in str(err), err
    else:
        raise AssertionError("no TypeError")
    assert not [m for m in sys.modules if m.split(".")[0] in {"flax", "equinox"}]
    print("ok")
    """
)


def test_the_module_imports_and_refuses_a_model_without_flax_or_equinox():
    result = run_script(BLOCKED)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
