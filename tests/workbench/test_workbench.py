"""The shared package of the application rooms: its tables, JSON, process helpers and doctests.

Oracles: hand-written markdown, ``json.loads`` of the written file, a socket bound to the
returned port, and a child interpreter that imports ``workbench`` from the environment given.
"""

from __future__ import annotations

import argparse
import doctest
import importlib
import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from workbench import jsonsafe, processes, tables

MODULES = (
    "workbench.tables",
    "workbench.jsonsafe",
    "workbench.processes",
    "workbench.timing",
    "workbench.sizes",
    "workbench.whole_loop",
    "workbench.call_timers",
    "workbench.byte_gpt",
    "workbench.byte_gpt_jax",
    "workbench.internals",
)


def test_every_module_is_listed_here():
    folder = Path(tables.__file__).parent
    assert {f"workbench.{p.stem}" for p in folder.glob("*.py") if p.stem != "__init__"} == set(
        MODULES
    )


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name: str) -> None:
    failures, _ = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert failures == 0


def test_markdown_table_writes_the_header_alignment_and_rows():
    lines = tables.markdown_table(["a", "b", "c"], [["1", "2", "3"], ["x", "y", "z"]], "lrl")
    assert lines == ["| a | b | c |", "|---|---:|---|", "| 1 | 2 | 3 |", "| x | y | z |"]
    assert tables.markdown_table(["a", "b"], []) == ["| a | b |", "|---|---|"]


@pytest.mark.parametrize(
    ("rows", "align", "message"),
    [
        ([["1"]], None, r"rows\[0\] must have 2 cells; got 1"),
        ([], ["l"], "align must have one entry per column \\(2\\); got 1"),
        ([], ["l", "c"], r"align entries must be one of \('l', 'r'\); got \['c'\]"),
    ],
)
def test_markdown_table_rejects_bad_shapes(rows, align, message):
    with pytest.raises(ValueError, match=message):
        tables.markdown_table(["a", "b"], rows, align)


def test_number_keeps_three_significant_digits():
    assert [tables.number(v) for v in (0.0, 1e-12, 9.996, 0.5, -2.5, 123456.7)] == [
        "0",
        "0",
        "10.00",
        "0.500",
        "-2.50",
        "123457",
    ]
    assert tables.number(math.inf) == "n/a"


def test_write_json_is_strict_and_writes_null_for_undefined(tmp_path: Path):
    value = {"a": [1.5, math.nan, (math.inf, -math.inf)], "b": {"c": 2}, "d": "x"}
    path = jsonsafe.write_json(tmp_path / "r.json", value)
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text and text.endswith("\n")
    assert json.loads(text) == {"a": [1.5, None, [None, None]], "b": {"c": 2}, "d": "x"}
    jsonsafe.write_json(tmp_path / "s.json", {"p": tmp_path}, default=str)
    assert json.loads((tmp_path / "s.json").read_text()) == {"p": str(tmp_path)}


def test_free_port_can_be_bound():
    port = processes.free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
        assert sock.getsockname()[1] == port


def test_a_child_with_repo_environment_imports_this_repository(tmp_path: Path):
    env = processes.repo_environment(WORKBENCH_TEST="7")
    code = "import os, workbench; print(workbench.__file__); print(os.environ['WORKBENCH_TEST'])"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    path, extra = done.stdout.split()
    assert Path(path).resolve() == processes.REPO_ROOT / "workbench" / "__init__.py"
    assert extra == "7"


def test_comma_names_rejects_unknown_and_empty_lists():
    assert processes.comma_names("b,a,", ("a", "b"), "sizes") == ("b", "a")
    with pytest.raises(
        argparse.ArgumentTypeError, match=r"unknown sizes \['c'\]; choose from a, b"
    ):
        processes.comma_names("a,c", ("a", "b"), "sizes")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown sections ' , '"):
        processes.comma_names(" , ", ("a",), "sections")
