"""Shared pieces of the amp_core tests: bit-for-bit comparisons of arrays and pytrees."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


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
