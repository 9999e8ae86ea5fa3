"""The suite's own layout: rules that pytest would only break at collection, in one session.

The test folders are not packages (``rootdir`` import mode), so two modules with one basename
anywhere under ``tests/`` collide when one pytest session collects both ("import file
mismatch"), and a bare ``import name`` in a test may load the other folder's module. It
happened twice (``test_locate_overflow.py``, ``test_spike_skip.py``); this keeps it from a third.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SHARED_NAMES = {"conftest.py", "__init__.py"}


def basenames_in_more_than_one_place(root: Path) -> dict[str, list[str]]:
    """Module basenames under ``root`` (``conftest.py`` aside) found in two folders or more."""
    places: defaultdict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        if path.name not in SHARED_NAMES and "__pycache__" not in path.parts:
            places[path.name].append(str(path.relative_to(root)))
    return {name: found for name, found in places.items() if len(found) > 1}


def test_no_two_test_modules_share_a_basename():
    assert basenames_in_more_than_one_place(TESTS) == {}


def test_the_check_finds_a_planted_collision(tmp_path: Path):
    for folder in ("amp_core", "torch_facade"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "test_same.py").write_text("")
        (tmp_path / folder / "conftest.py").write_text("")
    assert basenames_in_more_than_one_place(tmp_path) == {
        "test_same.py": ["amp_core/test_same.py", "torch_facade/test_same.py"]
    }


def test_the_longest_files_are_collected_first(request: pytest.FixtureRequest):
    """``conftest.LONGEST_FIRST`` names files that exist, and the session runs them first."""
    (root_conftest,) = [
        plugin
        for plugin in request.config.pluginmanager.get_plugins()
        if getattr(plugin, "__file__", None) == str(TESTS / "conftest.py")
    ]  # not ``import conftest``: several folders have one
    LONGEST_FIRST = root_conftest.LONGEST_FIRST
    root = TESTS.parent
    assert [name for name in LONGEST_FIRST if not (root / name).is_file()] == []
    files: list[str] = []
    for item in request.session.items:
        name = Path(str(item.path)).relative_to(root).as_posix()
        if not files or files[-1] != name:
            files.append(name)
    collected = [name for name in LONGEST_FIRST if name in files]
    assert files[: len(collected)] == collected
