"""Shared pieces of the amp_core tests: bit-for-bit and to-rounding comparisons of pytrees, and
the update rule run over a sequence of overflow flags."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import amp_core

F = False
"""An overflowed step, in a sequence of ``isfinite`` flags."""
T = True
"""A finite step, in a sequence of ``isfinite`` flags."""


def update_trace(
    cfg: amp_core.LossScaleConfig, sequence: Any, *, jit: bool
) -> list[amp_core.LossScaleState]:
    """The state after each ``amp_core.update`` of ``cfg`` over the ``isfinite`` flags of
    ``sequence``, from ``amp_core.init(cfg)``; the update jitted (config closed over) or eager."""
    step = functools.partial(amp_core.update, cfg)
    if jit:
        step = jax.jit(step)
    states = [amp_core.init(cfg)]
    for isfinite in sequence:
        states.append(step(states[-1], jnp.asarray(isfinite)))
    return states[1:]


def assert_bitwise_equal(actual: Any, expected: Any) -> None:
    """Same dtype, same shape, same bytes (so NaN equals NaN and -0.0 differs from 0.0)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert actual.tobytes() == expected.tobytes(), f"{actual} != {expected}"


def assert_trees_bitwise_equal(actual: Any, expected: Any) -> None:
    """:func:`assert_bitwise_equal` leaf by leaf, for trees of the same structure."""
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
    for a, e in zip(
        jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected), strict=True
    ):
        assert_bitwise_equal(a, e)


def eps(dtype: Any) -> float:
    """The machine epsilon of a floating dtype (numpy's or ml_dtypes'): the spacing at 1.0.

    float32 2**-23 (1.2e-7), float16 2**-10 (9.8e-4), bfloat16 2**-7 (7.8e-3).
    """
    return float(ml_dtypes.finfo(dtype).eps)


def _is_floating(array: np.ndarray) -> bool:
    return np.issubdtype(array.dtype, np.floating) or array.dtype == ml_dtypes.bfloat16


def assert_trees_close(actual: Any, expected: Any, *, ulps: float) -> None:
    """Leaf-wise closeness to rounding, in units of each leaf's own precision.

    A floating leaf may differ from ``expected`` by ``ulps * eps(dtype)`` relative to each
    element, plus as much relative to the leaf's largest magnitude (small elements of a moment
    estimate suffer cancellation, so a pure relative bound is too tight). The tolerance follows
    the dtype: 8 ulps are 9.5e-7 in float32 but 7.8e-3 in float16. So a half-precision leaf
    that one run rounded at other points (XLA:CPU computes float16 natively on CPUs with
    AVX512-FP16, where a jitted fusion rounds where the eager primitives do not) is held to its
    own resolution, not to float32's. NaN equals NaN; dtypes, and non-floating leaves, must be
    equal.
    """
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
    for ours, theirs in zip(
        jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected), strict=True
    ):
        ours, theirs = np.asarray(ours), np.asarray(theirs)
        assert ours.dtype == theirs.dtype, (ours.dtype, theirs.dtype)
        if not _is_floating(theirs):
            np.testing.assert_array_equal(ours, theirs)
            continue
        tolerance = ulps * eps(theirs.dtype)
        ours, theirs = ours.astype(np.float64), theirs.astype(np.float64)  # exact for every leaf
        atol = tolerance * float(np.nanmax(np.abs(theirs), initial=0.0))  # NaN elements: equal_nan
        np.testing.assert_allclose(ours, theirs, rtol=tolerance, atol=atol)


REPO_ROOT = Path(__file__).resolve().parents[2]


def run_script(source: str) -> subprocess.CompletedProcess[str]:
    """Runs ``source`` in a fresh interpreter at the repository root (importable there, whatever
    the caller's ``PYTHONPATH``), its output captured; fails after two minutes."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", source],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
