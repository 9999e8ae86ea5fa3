"""Every ```python block of README.md and of every docs page runs, page by page.

Each page's blocks, concatenated in order, run as one script from the repository root
(``tests/docs_helpers.py``); a traceback's line numbers are the page's own. Examples that need a
GPU or several processes are shown in ``sh`` or ``text`` fences, or made to run on the CPU in
one process, and the page says so.

Each page runs in a fresh process, forked from a server that has imported the heavy shared
modules and nothing else (``tests/docs_page_server.py``): a page starts from what a fresh
interpreter reaches after those imports, without paying for them once per page. The pages share
a JAX compilation cache (a temporary directory, empty at the start of each session), so the
many small computations they have in common compile once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from docs_helpers import REPO_ROOT, doc_pages, python_blocks_script, relative

TIMEOUT_S = 180
SERVER = Path(__file__).resolve().parent / "docs_page_server.py"
# Imported once by the server: what most pages import, and what is slow to import.
PRELOAD = (
    "numpy",
    "jax",
    "jax.numpy",
    "optax",
    "amp_core",
    "hardware",
    "torch",
    "torch_facade",
    "flax.nnx",
    "flax.linen",
)

PAGES_WITH_CODE = [
    page for page in doc_pages() if python_blocks_script(page.read_text(encoding="utf-8"))[1]
]
# Pages whose blocks import the repository's demo/ package, which is not installed: they say
# "paste it into .venv/bin/python started at the repository root", and run exactly so (below).
PAGES_RUN_AT_THE_ROOT = [REPO_ROOT / "docs" / "does-it-train.md"]


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
        "docs/jax/accumulation.md",
        "docs/jax/checkpoints.md",
        "docs/jax/sharding.md",
        "docs/pytorch/index.md",
        "docs/pytorch/optimizer-step.md",
        "docs/pytorch/half-dtypes.md",
        "docs/pytorch/cbfloat16.md",
        "docs/pytorch/diagnostics.md",
        "docs/pytorch/modelzoo.md",
        "docs/pytorch/trainers.md",
        "docs/pytorch/compile.md",
        "docs/pytorch/huggingface.md",
        "docs/distributed.md",
        "docs/formats.md",
        "docs/does-it-train.md",
    }
    assert expected <= names, f"pages without python blocks: {sorted(expected - names)}"


@pytest.fixture(scope="module")
def run_script(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[Path, Path], int]]:
    """Runs a script in a process forked from the preloaded server; returns its exit status."""
    workdir = tmp_path_factory.mktemp("docs_pages")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["MPLBACKEND"] = "Agg"
    env["JAX_COMPILATION_CACHE_DIR"] = str(workdir / "jax_cache")
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    server_log = workdir / "server.log"
    with server_log.open("w") as log:
        server = subprocess.Popen(
            [sys.executable, str(SERVER), *PRELOAD],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    assert server.stdin is not None and server.stdout is not None
    ready = server.stdout.readline().strip()
    assert ready == "ready", f"the page server did not start:\n{server_log.read_text()[-4000:]}"

    def run(script: Path, output: Path) -> int:
        server.stdin.write(f"{script}\t{output}\t{TIMEOUT_S}\n")
        server.stdin.flush()
        answer = server.stdout.readline().strip()
        assert answer, f"the page server died:\n{server_log.read_text()[-4000:]}"
        return int(answer.split("\t")[0])

    yield run
    server.stdin.close()
    server.wait(timeout=60)


@pytest.mark.parametrize(
    "page", [page for page in PAGES_WITH_CODE if page not in PAGES_RUN_AT_THE_ROOT], ids=relative
)
def test_page_python_blocks_run(
    page: Path, tmp_path: Path, run_script: Callable[[Path, Path], int]
):
    script, _ = python_blocks_script(page.read_text(encoding="utf-8"))
    path = tmp_path / f"{page.stem}_python_blocks.py"
    path.write_text(script, encoding="utf-8")
    output = tmp_path / "output.txt"
    returncode = run_script(path, output)
    assert returncode == 0, (
        f"a python block of {relative(page)} failed with exit status {returncode} (traceback "
        f"line numbers are the page's):\n{output.read_text(encoding='utf-8')[-4000:]}"
    )


@pytest.mark.parametrize("page", PAGES_RUN_AT_THE_ROOT, ids=relative)
def test_root_page_python_blocks_run_pasted_into_python_at_the_repository_root(page: Path):
    """As the page says: the blocks on stdin of this interpreter, started at the repository
    root, with no PYTHONPATH (``import demo`` finds the root through the current directory)."""
    assert page in PAGES_WITH_CODE, f"{relative(page)} has no python block to run"
    assert "started at the repository root" in " ".join(page.read_text(encoding="utf-8").split())
    script, _ = python_blocks_script(page.read_text(encoding="utf-8"))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["MPLBACKEND"] = "Agg"
    result = subprocess.run(
        [sys.executable, "-"],
        input=script,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, (
        f"a python block of {relative(page)} failed at the repository root with exit status "
        f"{result.returncode} (traceback line numbers are the page's):\n{result.stderr[-4000:]}"
    )
