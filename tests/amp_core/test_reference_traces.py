"""The dynamic loss scaler against 80 traces recorded from the reference implementation.

``tests/data/dls_reference_traces.json`` holds the state of cerebras-pytorch 2.10.0's GradScaler
(CSX code path) after every ``update()`` of 80 runs, 2,927 steps in all (format:
``../shared/vectors/README.md``). The core must reproduce every number exactly: through
:func:`amp_core.update` under ``jax.jit`` and eagerly, and through the whole gradient path
(:func:`amp_core.check_and_update` on a gradient tree holding an inf on the overflow steps).
"""

from __future__ import annotations

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import amp_core

TRACES_PATH = pathlib.Path(__file__).parent.parent / "data" / "dls_reference_traces.json"
CASES = json.loads(TRACES_PATH.read_text())["cases"]
CASE_IDS = [f"case{i:02d}-{case['half_dtype']}" for i, case in enumerate(CASES)]

# Only some cases run eagerly (op by op, so slow); they cover every half dtype, min and max
# clamping, fractional tolerances and long overflow runs.
EAGER_CASE_INDICES = (1, 9, 15, 22, 36, 44, 46, 75)

STATE_FIELDS = {
    "loss_scale": "loss_scale",
    "non_clamped_loss_scale": "non_clamped_scale",
    "steps_since_rescale": "steps_since_rescale",
    "overflows_since_rescale": "overflows_since_rescale",
    "num_skipped_steps": "num_skipped_steps",
}


def config_of(case: dict) -> amp_core.LossScaleConfig:
    return amp_core.make_config(**case["config"], half_dtype=case["half_dtype"])


def observed(state: amp_core.LossScaleState) -> dict[str, float | int]:
    """The state as the trace records it, as exact Python numbers."""
    values = {}
    for key, field in STATE_FIELDS.items():
        value = np.asarray(getattr(state, field)).item()
        values[key] = float(value) if key.endswith("loss_scale") else int(value)
    return values


def expected(step: dict) -> dict[str, float | int]:
    return {key: step[key] for key in STATE_FIELDS}


def test_trace_file_has_the_documented_shape():
    assert len(CASES) == 80
    assert sum(len(case["steps"]) for case in CASES) == 2927
    assert all(case["config"]["loss_scale"] == "dynamic" for case in CASES)
    assert {case["half_dtype"] for case in CASES} == {"float16", "bfloat16", "cbfloat16"}


def test_eager_subset_covers_clamping_and_overflows():
    """The eager subset is not a trivial one: it clamps at both bounds and skips steps."""
    subset = [CASES[i] for i in EAGER_CASE_INDICES]
    assert {case["half_dtype"] for case in subset} == {"float16", "bfloat16", "cbfloat16"}
    assert any(
        s["non_clamped_loss_scale"] < s["loss_scale"] for case in subset for s in case["steps"]
    )
    assert any(
        s["loss_scale"] == case["config"].get("max_loss_scale")
        for case in subset
        for s in case["steps"]
    )
    assert sum(not s["isfinite"] for case in subset for s in case["steps"]) > 100


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_jitted_update_reproduces_reference_trace(case):
    cfg = config_of(case)
    step_fn = jax.jit(functools.partial(amp_core.update, cfg))
    states = [amp_core.init(cfg)]
    for step in case["steps"]:
        states.append(step_fn(states[-1], jnp.asarray(step["isfinite"])))
    for index, (state, step) in enumerate(
        zip(jax.device_get(states[1:]), case["steps"], strict=True)
    ):
        assert observed(state) == expected(step), f"step {index}"


@pytest.mark.parametrize("index", EAGER_CASE_INDICES, ids=[CASE_IDS[i] for i in EAGER_CASE_INDICES])
def test_eager_update_reproduces_reference_trace(index):
    case = CASES[index]
    cfg = config_of(case)
    state = amp_core.init(cfg)
    with jax.disable_jit():
        for number, step in enumerate(case["steps"]):
            state = amp_core.update(cfg, state, step["isfinite"])
            assert observed(state) == expected(step), f"step {number}"


@functools.cache
def _gradient_tree(variant: int | None) -> dict:
    tree = {
        "dense": {"kernel": jnp.full((4, 3), 0.5, jnp.float32), "bias": jnp.ones(3, jnp.float32)},
        "half": jnp.full((5,), 2.0, jnp.float16),
        "brain": jnp.full((2, 2), 3.0, jnp.bfloat16),
    }
    if variant is None:
        return tree
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    bad = (jnp.inf, -jnp.inf, jnp.nan)[variant % 3]
    position = variant % len(leaves)
    leaf = leaves[position]
    leaves[position] = leaf.reshape(-1).at[-1].set(bad).reshape(leaf.shape)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def gradient_tree(step_index: int, isfinite: bool) -> dict:
    """Gradients of the scaled loss; an inf, -inf or NaN in a rotating leaf when not finite."""
    return _gradient_tree(None if isfinite else step_index % 12)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_check_and_update_on_gradients_reproduces_reference_trace(case):
    cfg = config_of(case)
    step_fn = jax.jit(functools.partial(amp_core.check_and_update, cfg))
    state = amp_core.init(cfg)
    results = []
    for index, step in enumerate(case["steps"]):
        result = step_fn(state, gradient_tree(index, step["isfinite"]))
        results.append((state.loss_scale, result))
        state = result.next_state
    for index, ((scale, result), step) in enumerate(
        zip(jax.device_get(results), case["steps"], strict=True)
    ):
        assert bool(result.isfinite) == step["isfinite"], f"step {index}"
        assert bool(result.next_state.isfinite) == step["isfinite"], f"step {index}"
        assert result.multiplier == np.float32(1) / scale, f"step {index}"
        assert observed(result.next_state) == expected(step), f"step {index}"
