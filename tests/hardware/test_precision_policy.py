"""Precision policies: parsing, casting pytrees, and training under an emulated cbfloat16 policy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hardware import CBFLOAT16, FLOAT8_E4M3FN, Policy, canonical_dtype, cast_tree, get_policy

F32, F16, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)


def on_grid(x: jax.Array, fmt=CBFLOAT16) -> bool:
    x = np.asarray(x)
    return x.dtype == np.float32 and np.array_equal(
        np.asarray(fmt.round(x)).view(np.uint32), x.view(np.uint32)
    )


# ---------------------------------------------------------------------------------------------
# Parsing.


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("params=float32,compute=cbfloat16,output=float32", (F32, CBFLOAT16, F32)),
        ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
        ("param=f32, compute=f16, out=f16", (F32, F16, F16)),
        (" Params = FLOAT32 , Compute = CB16 ", (F32, CBFLOAT16, F32)),
        ("c=float16_e6m9", (F32, CBFLOAT16, F32)),
        ("compute=half", (F32, F16, F32)),
        ("c=float8_e4m3fn", (F32, FLOAT8_E4M3FN, F32)),
        ("bfloat16", (BF16, BF16, BF16)),
        ("cbfloat16", (CBFLOAT16, CBFLOAT16, CBFLOAT16)),
    ],
)
def test_get_policy_parses(spec: str, expected) -> None:
    policy = get_policy(spec)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == expected


def test_policy_string_round_trips_and_policy_passes_through() -> None:
    policy = get_policy("p=f32,c=cb16,o=bf16")
    assert str(policy) == "params=float32,compute=cbfloat16,output=bfloat16"
    assert get_policy(str(policy)) == policy
    assert get_policy(policy) is policy


def test_policy_fields_are_canonicalised_frozen_and_hashable() -> None:
    policy = Policy(param_dtype=jnp.float32, compute_dtype="cb16", output_dtype=np.float16)
    assert policy == Policy("float32", CBFLOAT16, "f16")
    assert hash(policy) == hash(Policy("float32", CBFLOAT16, "f16"))
    assert Policy() == get_policy("float32")
    with pytest.raises(AttributeError):
        policy.compute_dtype = F32  # type: ignore[misc]


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("params=float32,compute=float17", "compute in .* must be a floating dtype .*'float17'"),
        ("p=f32,c=int32", "must be a floating dtype"),
        ("params=float32,weights=float16", "unknown policy key 'weights'.*params, param, p"),
        ("p=f32,p=f16", "given twice"),
        ("p=f32,c", "not of the form key=dtype"),
        ("float17", "spec must be a floating dtype"),
        ("", "spec must be a floating dtype"),
    ],
)
def test_get_policy_errors(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        get_policy(spec)


def test_policy_and_canonical_dtype_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"compute_dtype must be a floating dtype.*cbfloat16"):
        Policy(compute_dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"output_dtype .*got 'float8'"):
        Policy(output_dtype="float8")
    with pytest.raises(ValueError, match="spec must be a policy string"):
        get_policy(3)  # type: ignore[arg-type]
    assert canonical_dtype(jnp.bfloat16) == BF16
    assert canonical_dtype(CBFLOAT16) is CBFLOAT16


# ---------------------------------------------------------------------------------------------
# Casting.


def _mixed_tree() -> dict:
    return {
        "w": jnp.array([1.0 + 2**-12, 3e38, -(2.0**-41)], jnp.float32),
        "h": jnp.array([0.1, 0.2], jnp.float16),
        "n": np.array([0.3], np.float64),
        "step": jnp.array(7, jnp.int32),
        "mask": jnp.array([True, False]),
        "lr": 0.1,
        "none": None,
    }


def test_cast_to_emulated_format_rounds_floating_leaves_only() -> None:
    tree = _mixed_tree()
    out = get_policy("c=cbfloat16").cast_to_compute(tree)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    for key in ("w", "h", "n"):
        assert out[key].dtype == jnp.float32 and on_grid(out[key])
    np.testing.assert_array_equal(out["w"], [1.0, np.inf, -0.0])
    assert np.signbit(out["w"][2])
    assert out["step"] is tree["step"] and out["mask"] is tree["mask"]
    assert out["lr"] == 0.1 and out["none"] is None


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_cast_to_native_dtype(dtype) -> None:
    tree = _mixed_tree()
    policy = Policy(param_dtype=dtype, compute_dtype=dtype, output_dtype=dtype)
    for cast in (policy.cast_to_param, policy.cast_to_compute, policy.cast_to_output):
        out = cast(tree)
        assert {out[k].dtype for k in ("w", "h", "n")} == {dtype}
        assert out["step"].dtype == jnp.int32 and out["mask"].dtype == jnp.bool_


def test_casts_are_identical_under_jit() -> None:
    policy = get_policy("p=f32,c=cb16,o=bf16")
    x = {"a": jax.random.normal(jax.random.key(0), (64,)) * 1e4, "i": jnp.arange(3)}
    for cast in (policy.cast_to_param, policy.cast_to_compute, policy.cast_to_output):
        eager, jitted = cast(x), jax.jit(cast)(x)
        np.testing.assert_array_equal(eager["a"], jitted["a"])
        assert eager["a"].dtype == jitted["a"].dtype
    assert cast_tree(x, "bf16")["a"].dtype == BF16


# ---------------------------------------------------------------------------------------------
# Training a small MLP under a cbfloat16 policy.


def _init_mlp(key: jax.Array, sizes=(8, 32, 32, 1)) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {
            "w": jax.random.normal(k, (n_in, n_out)) / np.sqrt(n_in),
            "b": jnp.zeros(n_out),
        }
        for k, n_in, n_out in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def _forward(policy: Policy, params, x: jax.Array):
    """Rounds every activation it produces through the policy, as the hardware would."""
    params, h = policy.cast_to_compute((params, x))
    activations = [h]
    for i, layer in enumerate(params):
        h = policy.cast_to_compute(h @ layer["w"] + layer["b"])
        activations.append(h)
        if i < len(params) - 1:
            h = policy.cast_to_compute(jnp.tanh(h))
            activations.append(h)
    return policy.cast_to_output(h), activations


def test_training_under_cbfloat16_policy_keeps_activations_on_the_grid() -> None:
    policy = get_policy("params=float32,compute=cbfloat16,output=float32")
    data_key, param_key = jax.random.split(jax.random.key(42))
    x = jax.random.normal(data_key, (64, 8))
    y = jnp.sin(x.sum(axis=1, keepdims=True))
    params = _init_mlp(param_key)

    def loss_fn(params):
        out, activations = _forward(policy, params, x)
        return jnp.mean((out - y) ** 2), activations

    @jax.jit
    def train_step(params):
        (loss, activations), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
        return policy.cast_to_param(params), loss, activations, grads

    losses = []
    for _ in range(10):
        params, loss, activations, grads = train_step(params)
        losses.append(float(loss))
        assert len(activations) == 6
        assert all(on_grid(a) for a in activations)
        assert all(np.isfinite(g).all() for g in jax.tree_util.tree_leaves(grads))
        assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(params))
    assert losses[-1] < losses[0]
    # The parameters themselves stay full float32 (not on the grid): only the casts round.
    assert not all(on_grid(p) for p in jax.tree_util.tree_leaves(params))


def test_bfloat16_policy_computes_in_real_bfloat16() -> None:
    policy = get_policy("p=f32,c=bf16,o=f32")
    params = _init_mlp(jax.random.key(1))
    out, activations = _forward(policy, params, jnp.ones((4, 8)))
    assert all(a.dtype == BF16 for a in activations)
    assert out.dtype == F32


def test_emulated_compute_cast_rounds_gradients_like_a_real_cast() -> None:
    """A cast's transpose is a cast (as for astype to a real dtype): gradients get rounded."""
    upstream = jnp.array([1 + 2**-10, 1e10, 2.0**-40, 3.0])
    policy = get_policy("params=float32,compute=cbfloat16,output=float32")
    _, vjp = jax.vjp(policy.cast_to_compute, jnp.ones(4))
    (grad,) = vjp(upstream)
    # hand-checked: tie to even, overflow to inf, underflow to zero, exact
    assert grad.tolist() == [1.0, float("inf"), 0.0, 3.0]
