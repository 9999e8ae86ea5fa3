"""Every ```python block of README.md and of every docs page runs, page by page.

Each page's blocks, concatenated in order, run as one script in a fresh interpreter from the
repository root (``tests/docs_helpers.py``); a traceback's line numbers are the page's own.
Examples that need a GPU or several processes are shown in ``sh`` or ``text`` fences, or made to
run on the CPU in one process, and the page says so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from docs_helpers import REPO_ROOT, doc_pages, python_blocks_script, relative

TIMEOUT_S = 180

PAGES_WITH_CODE = [
    page for page in doc_pages() if python_blocks_script(page.read_text(encoding="utf-8"))[1]
]


def test_python_blocks_script_keeps_line_numbers_and_only_python_blocks():
    text = "intro\n```python\nx = 1\n```\n```sh\nmake\n```\n```python\nprint(x)\n```\n"
    script, blocks = python_blocks_script(text)
    assert blocks == 2
    assert script.splitlines() == ["", "", "x = 1", "", "", "", "", "", "print(x)", ""]


def test_python_blocks_script_removes_the_indentation_of_blocks_in_list_items():
    text = "* item:\n\n  ```python\n  if x:\n      y = 1\n  ```\n"
    script, blocks = python_blocks_script(text)
    assert blocks == 1
    assert script.splitlines() == ["", "", "", "if x:", "    y = 1", ""]


def test_python_blocks_script_rejects_unclosed_and_outdented_blocks():
    with pytest.raises(ValueError, match="not closed"):
        python_blocks_script("```python\nx = 1\n")
    with pytest.raises(ValueError, match=r"line 3: .* outdented"):
        python_blocks_script("  ```python\n  x = 1\ny = 2\n  ```\n")


def test_the_readme_and_the_guides_have_code_to_run():
    """Guards the parametrisation below: a renamed fence or folder would silently run nothing."""
    names = {relative(page) for page in PAGES_WITH_CODE}
    expected = {
        "README.md",
        "docs/getting-started.md",
        "docs/jax/optax.md",
        "docs/jax/flax-nnx.md",
        "docs/jax/flax-linen.md",
        "docs/jax/equinox.md",
        "docs/jax/checkpoints.md",
        "docs/jax/sharding.md",
        "docs/pytorch/index.md",
        "docs/pytorch/optimizer-step.md",
        "docs/pytorch/cbfloat16.md",
        "docs/pytorch/diagnostics.md",
        "docs/pytorch/modelzoo.md",
        "docs/distributed.md",
        "docs/formats.md",
    }
    assert expected <= names, f"pages without python blocks: {sorted(expected - names)}"


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=relative)
def test_page_python_blocks_run(page: Path, tmp_path: Path):
    script, _ = python_blocks_script(page.read_text(encoding="utf-8"))
    path = tmp_path / f"{page.stem}_python_blocks.py"
    path.write_text(script, encoding="utf-8")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("MPLBACKEND", "Agg")
    result = subprocess.run(
        [sys.executable, str(path)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, (
        f"a python block of {relative(page)} failed (traceback line numbers are the page's):\n"
        f"{result.stderr[-4000:]}"
    )
