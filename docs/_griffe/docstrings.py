"""A griffe extension for the API reference: the docstrings' Google style, as griffe reads it.

Two spellings of the house style (Napoleon's Google style) that griffe's Google parser reads
differently, adjusted when griffe has loaded an object, before mkdocstrings renders it:

* ``Example:`` heads a doctest. griffe knows only the plural ``Examples:`` and reads the
  singular as an admonition, whose doctest output then renders as Markdown (``[8.0, 1.0]``
  becomes a broken link); renamed, it renders as code.
* Sphinx roles (``:func:`amp_core.init```, ``:class:`~amp_core.LossScaleState```) are not
  Markdown; they become inline code (``~`` keeps the last component, as Sphinx shows it).
* A paragraph ending in reST's literal-block marker ``::`` ends in ``:`` (the indented block
  after it is already a Markdown code block).

The docstrings themselves are untouched: ``pytest --doctest-modules`` runs them as written.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE_HEADING = re.compile(r"^(?P<indent>[ \t]*)Example:[ \t]*$", re.MULTILINE)
_LITERAL_MARKER = re.compile(r"(?<=\S)::[ \t]*$", re.MULTILINE)
_SPHINX_ROLE = re.compile(
    r":(?:func|class|meth|attr|mod|data|obj|exc):`(?P<tilde>~?)(?P<name>[^`]+)`"
)


def _role_as_code(match: re.Match[str]) -> str:
    name = match["name"]
    if match["tilde"]:
        name = name.rsplit(".", 1)[-1]
    return f"`{name}`"


def markdown_docstring(text: str) -> str:
    """``text`` with ``Example:`` headings spelled ``Examples:``, Sphinx roles as code, and
    reST's ``::`` as ``:``."""
    text = _EXAMPLE_HEADING.sub(r"\g<indent>Examples:", text)
    text = _LITERAL_MARKER.sub(":", text)
    return _SPHINX_ROLE.sub(_role_as_code, text)


class GoogleDocstrings(griffe.Extension):
    """Adjusts every loaded docstring with :func:`markdown_docstring`."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Adjusts ``obj``'s docstring once the object tree is complete."""
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
