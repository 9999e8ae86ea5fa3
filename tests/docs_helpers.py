"""The pages whose code the test suite runs, and the script each page's python blocks make.

Shared by ``tests/test_docs_pages.py`` (every page's blocks run) and ``tests/test_docs_site.py``
(the site builds and its API reference is complete).
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS_DIR = REPO_ROOT / "docs"
README = REPO_ROOT / "README.md"
MKDOCS_YML = REPO_ROOT / "mkdocs.yml"

# The modules whose ``__all__`` the API reference must cover, name for name.
PUBLIC_MODULES = ("amp_core", "torch_facade.amp", "hardware")


def doc_pages() -> list[Path]:
    """README.md and every Markdown page of the docs site, in a stable order."""
    pages = sorted(p for p in DOCS_DIR.rglob("*.md") if "_griffe" not in p.parts)
    return [README, *pages]


def python_blocks_script(text: str) -> tuple[str, int]:
    """A page's python blocks in place, every other line blank; and how many blocks.

    The blocks of a page build on each other (a later block may use names an earlier one
    defined), so they run as one script; lines outside them become blank lines, so that a
    traceback's line numbers are the page's own. A block fenced inside a list item is indented
    as its fence is: that indentation is Markdown's, not Python's, and is removed. Only fences
    that say ``python`` run: ``sh``, ``pycon``, ``text`` and bare fences are for reading.
    """
    lines: list[str] = []
    inside = False
    blocks = 0
    indent = 0
    for number, line in enumerate(text.splitlines(), start=1):
        fence = line.strip()
        if not inside and fence == "```python":
            inside, blocks = True, blocks + 1
            indent = len(line) - len(line.lstrip())
            lines.append("")
        elif inside and fence == "```":
            inside = False
            lines.append("")
        elif inside:
            if line.strip() and not line.startswith(" " * indent):
                raise ValueError(
                    f"line {number}: a python block's line is outdented past its fence"
                )
            lines.append(line[indent:])
        else:
            lines.append("")
    if inside:
        raise ValueError("a ```python block is not closed")
    return "\n".join(lines) + "\n", blocks


def relative(path: Path) -> str:
    """``path`` relative to the repository root, with forward slashes (test ids, messages)."""
    return path.relative_to(REPO_ROOT).as_posix()
