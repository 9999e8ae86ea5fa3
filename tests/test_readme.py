"""Every ```python block of README.md runs, as written, in order, as one script.

The blocks build on each other (a later block may use names an earlier one defined), so they
are concatenated and run in one fresh interpreter from the repository root. Lines outside the
blocks become blank lines, so a traceback's line numbers are README.md's own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / "README.md"
TIMEOUT_S = 180


def readme_script(text: str) -> tuple[str, int]:
    """The README's python blocks in place, every other line blank; and how many blocks.

    A block fenced inside a list item is indented as its fence is: that indentation is
    Markdown's, not Python's, and is removed.
    """
    lines: list[str] = []
    inside = False
    blocks = 0
    indent = 0
    for line in text.splitlines():
        fence = line.strip()
        if not inside and fence == "```python":
            inside, blocks = True, blocks + 1
            indent = len(line) - len(line.lstrip())
            lines.append("")
        elif inside and fence == "```":
            inside = False
            lines.append("")
        else:
            lines.append(line[indent:] if inside else "")
    assert not inside, "README.md has an unclosed ```python block"
    return "\n".join(lines) + "\n", blocks


def test_readme_script_keeps_line_numbers_and_only_python_blocks():
    text = "intro\n```python\nx = 1\n```\n```sh\nmake\n```\n```python\nprint(x)\n```\n"
    script, blocks = readme_script(text)
    assert blocks == 2
    assert script.splitlines() == ["", "", "x = 1", "", "", "", "", "", "print(x)", ""]


def test_readme_script_removes_the_indentation_of_blocks_in_list_items():
    text = "* item:\n\n  ```python\n  if x:\n      y = 1\n  ```\n"
    script, blocks = readme_script(text)
    assert blocks == 1
    assert script.splitlines() == ["", "", "", "if x:", "    y = 1", ""]


def test_readme_python_blocks_run(tmp_path: Path):
    script, blocks = readme_script(README.read_text(encoding="utf-8"))
    assert blocks >= 5, f"found only {blocks} ```python blocks in README.md"
    path = tmp_path / "README_python_blocks.py"
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
        f"a README.md python block failed (traceback line numbers are README.md's):\n"
        f"{result.stderr[-4000:]}"
    )
