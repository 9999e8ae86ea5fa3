"""Every public entry point has a Google-style docstring with an ``Example:`` that runs.

Public entry points: every name in ``__all__`` of ``amp_core``, ``torch_facade.amp`` and
``hardware``, and the public methods of the public classes. ``pytest --doctest-modules`` runs
the examples of functions, classes and methods; the docstrings of constants (a string literal
after the assignment) are invisible to it, so this module reads them as griffe (and so the API
reference) does and runs their examples itself.
"""

from __future__ import annotations

import doctest
import functools
import importlib
import inspect
import re
from typing import Any

import griffe
import pytest
from docs_helpers import PUBLIC_MODULES, REPO_ROOT

_EXAMPLE = re.compile(r"^[ \t]*Example:[ \t]*\n(?:[ \t]*\n)*[ \t]+>>> ", re.MULTILINE)


def _public() -> list[tuple[str, str, Any]]:
    found = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        found += [(module_name, name, getattr(module, name)) for name in module.__all__]
    return found


def _is_entry_point(obj: Any) -> bool:
    """Functions (also ``functools.cache``-wrapped ones) and classes; not constants."""
    return inspect.isclass(obj) or callable(obj)


@functools.cache
def _griffe_package(name: str) -> griffe.Object:
    return griffe.load(name, search_paths=[str(REPO_ROOT)], resolve_aliases=True)


def _griffe_docstring(module_name: str, name: str) -> str:
    """The docstring griffe reads for ``module_name.name`` (attribute docstrings included)."""
    package = _griffe_package(module_name.split(".")[0])
    obj = package[module_name.partition(".")[2] + "." + name if "." in module_name else name]
    target = obj.final_target if obj.is_alias else obj
    return "" if target.docstring is None else target.docstring.value


def test_every_public_function_class_and_method_has_an_example():
    missing = []
    for module_name, name, obj in _public():
        if not _is_entry_point(obj):
            continue
        if not _EXAMPLE.search(inspect.getdoc(obj) or ""):
            missing.append(f"{module_name}.{name}")
        if inspect.isclass(obj):
            for method, value in vars(obj).items():
                if method.startswith("_") or not inspect.isfunction(value):
                    continue
                if not _EXAMPLE.search(inspect.getdoc(value) or ""):
                    missing.append(f"{module_name}.{name}.{method}")
    assert not missing, "no `Example:` with a doctest:\n" + "\n".join(missing)


CONSTANTS = [(m, n) for m, n, obj in _public() if not _is_entry_point(obj)]


def test_the_public_constants_are_the_expected_ones():
    """Guards the parametrisation below against an empty or shrunken list."""
    names = {f"{m}.{n}" for m, n in CONSTANTS}
    assert {"amp_core.CLIP_EPSILON", "hardware.CBFLOAT16", "hardware.HALF_DTYPES"} <= names
    assert len(names) >= 10


@pytest.mark.parametrize("module_name,name", CONSTANTS, ids=lambda v: v)
def test_constant_docstring_example_runs(module_name: str, name: str):
    text = _griffe_docstring(module_name, name)
    assert _EXAMPLE.search(text), f"{module_name}.{name} has no `Example:` with a doctest"
    test = doctest.DocTestParser().get_doctest(text, {}, f"{module_name}.{name}", None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    output: list[str] = []
    result = runner.run(test, out=output.append)
    assert result.attempted > 0
    assert result.failed == 0, "".join(output)
