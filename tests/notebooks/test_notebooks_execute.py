"""The tutorial notebooks: committed clean, and executed top to bottom in a fresh kernel.

Each notebook runs in a new Jupyter kernel started from this interpreter (so it sees this
environment's packages), with the matplotlib inline backend (headless, and it renders every
figure, so a plot that cannot be drawn fails the test). A failing cell fails the test with the
cell's traceback.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import nbclient
import nbformat
import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = REPO / "notebooks"
EXPECTED = (
    "01_jax_native_quickstart.ipynb",
    "02_pytorch_facade.ipynb",
    "03_cbfloat16_numerics.ipynb",
    "04_flax_nnx_float16.ipynb",
)
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
COLAB_URL = "https://colab.research.google.com/github/cstorch-amp/cstorch-amp/blob/main/notebooks/"
# The budget: each notebook under 2 minutes on 2 CPU cores.
TIME_BUDGET_S = 120.0
CELL_TIMEOUT_S = 300
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _ids(path: Path) -> str:
    return path.stem


def test_the_four_notebooks_exist() -> None:
    assert sorted(p.name for p in NOTEBOOKS) == sorted(EXPECTED)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_notebook_is_committed_clean(path: Path) -> None:
    """Valid nbformat 4, python3 kernelspec, no outputs, no execution counts."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        assert cell.get("outputs") == [], f"{path.name}: cell {index} has outputs; clear them"
        assert cell.get("execution_count") is None, (
            f"{path.name}: cell {index} has an execution count; clear it"
        )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_notebook_starts_with_colab_badge_and_install_cell(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    first, second = nb.cells[0], nb.cells[1]
    assert first.cell_type == "markdown"
    assert COLAB_BADGE in first.source
    assert f"({COLAB_URL}{path.name})" in first.source, "the badge must open this notebook"
    # The first code cell installs the package only inside Colab.
    assert second.cell_type == "code"
    assert '"google.colab" in sys.modules' in second.source
    assert "pip" in second.source and "install" in second.source


@pytest.mark.parametrize("name", EXPECTED)
def test_readme_links_notebook(name: str) -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert f"notebooks/{name}" in readme, f"README.md does not link notebooks/{name}"


def _kernel_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Makes the ``python3`` kernel run this interpreter, headless, with a plain CPU."""
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec), encoding="utf-8")
    # JUPYTER_PATH comes first in the kernelspec search, ahead of any other python3 kernel.
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    # tests/conftest.py gives this process 8 host devices for the sharding tests; a notebook
    # should see one CPU device, as on Colab.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if _DEVICE_COUNT_FLAG not in f]
    if flags:
        monkeypatch.setenv("XLA_FLAGS", " ".join(flags))
    else:
        monkeypatch.delenv("XLA_FLAGS", raising=False)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids)
def test_notebook_executes(
    path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, record_property
) -> None:
    """Runs every cell in order in a fresh kernel; any cell error fails the test."""
    _kernel_env(monkeypatch, tmp_path)
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(REPO)}},
    )
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError with the failing cell's traceback
    elapsed = time.perf_counter() - start
    record_property("seconds", round(elapsed, 1))

    errors = [
        output
        for cell in nb.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == "error"
    ]
    assert not errors, f"{path.name}: error outputs {errors}"
    figures = sum(
        "image/png" in output.get("data", {})
        for cell in nb.cells
        if cell.cell_type == "code"
        for output in cell.outputs
    )
    assert figures >= 1, f"{path.name}: no figure was rendered"
    assert elapsed < TIME_BUDGET_S, f"{path.name} took {elapsed:.0f} s (budget {TIME_BUDGET_S} s)"
