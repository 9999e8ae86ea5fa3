"""The `Example:` sections of the hardware package's docstrings run and pass."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["hardware.formats", "hardware.policy", "hardware.devices", "hardware.half_dtypes"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0
