"""``torchrun --nproc-per-node 2 -m demo --distributed``: the torch path over 2 ranks (gloo)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from demo.mlp.problem import RunOptions, make_problem
from demo.mlp.torch_model import run_fp32

STEPS = 12  # the first 9 steps overflow float16 (2**24 down to 2**15), then training goes on
TIMEOUT_S = 150
REPO_ROOT = Path(__file__).resolve().parents[2]
ROWS = ("torch DDP fp16 + DLS", "torch FSDP2 fp16 + DLS", "torch DDP float32")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The demo's output (rank 0 prints it) and its output folder."""
    out_dir = tmp_path_factory.mktemp("distributed_demo")
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"),
        *("-m", "demo", "--distributed", "--steps", str(STEPS), "--no-progress"),
        *("--out-dir", str(out_dir)),
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        command,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, out_dir


def table_row(output: str, name: str) -> list[str]:
    """The cells of the summary-table row of run ``name``."""
    lines = [line for line in output.splitlines() if line.startswith(f"{name}  ")]
    assert len(lines) == 1, output
    return re.split(r"\s{2,}", lines[0].strip())[1:]


def test_every_rank_took_the_same_decisions(demo_run: tuple[str, Path]) -> None:
    output, out_dir = demo_run
    assert "all 2 ranks took the same decisions (skips, scales, losses): yes" in output
    assert (out_dir / "distributed_demo.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("name", ROWS[:2])
def test_float16_runs_back_off_from_the_overflowing_scale(
    demo_run: tuple[str, Path], name: str
) -> None:
    """Columns: final loss, min/max/final scale, overflows, skipped steps, time."""
    _, low, high, _, overflows, skipped, _ = table_row(demo_run[0], name)
    assert high == "2^24" and low != "2^24"
    assert int(overflows) == int(skipped) >= 1


def test_the_float32_job_ends_where_one_process_ends(demo_run: tuple[str, Path]) -> None:
    """DDP averaging two half batches is one process on the full batch, up to rounding."""
    final_loss = float(table_row(demo_run[0], ROWS[2])[0])
    problem = make_problem(steps=STEPS, seed=0)
    reference = run_fp32(problem, RunOptions(progress=False, diagnostics=False))
    assert final_loss == pytest.approx(reference.final_loss, rel=1e-3)
