"""``python -m demo --nproc 2``: the GPT on 2 processes per front door against one process.

One short run of both front doors (4 steps, rank 1 alone meets an overflow at step 2), started
as a user starts it; its ``distributed.json`` is checked against the dynamic loss scale's rules
(start ``2**12``, halved after a skipped step) and against its own tolerance rule.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from demo import cli, distributed

STEPS = 4
OVERFLOW_STEP = 2  # half of STEPS: the default below distributed.OVERFLOW_STEP steps
TIMEOUT_S = 240
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def document(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The run's ``distributed.json`` (and its ``distributed.md`` is there)."""
    out_dir = tmp_path_factory.mktemp("distributed_demo")
    command = [
        *(sys.executable, "-m", "demo", "--nproc", "2", "--steps", str(STEPS)),
        *("--out-dir", str(out_dir)),
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    markdown = (out_dir / "distributed.md").read_text(encoding="utf-8")
    assert "| 2 | skip 2^12 | skip 2^12 | skip 2^12 |" in markdown
    return json.loads((out_dir / "distributed.json").read_text(encoding="utf-8"))


def test_both_front_doors_report(document: dict[str, Any]) -> None:
    assert document["processes"] == 2
    assert document["verdict"] is True
    assert document["plan"]["overflow_step"] == OVERFLOW_STEP
    doors = [d["front_door"] for d in document["front_doors"]]
    assert doors == ["torch", "jax"]
    for door in document["front_doors"]:
        assert [r["rank"] for r in door["ranks"]] == [0, 1]
        assert door["ranks_bit_identical"] is True


@pytest.mark.parametrize("index", [0, 1], ids=["torch", "jax"])
def test_every_rank_skips_the_overflow_step_alike(document: dict[str, Any], index: int) -> None:
    door = document["front_doors"][index]
    expected_skips = [step == OVERFLOW_STEP for step in range(STEPS)]
    # 2**12 until the overflow (fewer than STEPS_PER_INCREASE + 1 clean steps), then halved.
    expected_scales = [4096.0, 4096.0, 4096.0, 2048.0]
    for run in [*door["ranks"], door["one_process"]]:
        assert run["skipped"] == expected_skips
        assert run["loss_scale"] == expected_scales
        assert run["final_loss_scale"] == 2048.0
    assert door["same_decisions_on_every_rank_and_one_process"] is True


@pytest.mark.parametrize("index", [0, 1], ids=["torch", "jax"])
def test_parameters_within_the_one_process_tolerance(document: dict[str, Any], index: int) -> None:
    door = document["front_doors"][index]
    own = door["one_process_self_differences"]
    assert set(own) == set(distributed.YARDSTICKS)
    assert door["tolerance"] == pytest.approx(distributed.TOLERANCE_FACTOR * max(own.values()))
    # Not bit-identical (float16 roundings of partial sums), but not far either.
    assert 0.0 < door["difference_to_one_process"] <= door["tolerance"]
    assert door["within_tolerance"] is True
    assert 0.0 < door["relative_difference_to_one_process"] < 1e-3


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc", "0"], "argument --nproc: must be an integer of at least 2; got 0"),
        (["--nproc", "1"], "argument --nproc: must be an integer of at least 2; got 1"),
        (["--nproc", "3"], "argument --nproc: must divide the batch size 32; got 3"),
        (
            ["--nproc", "2", "--steps", "0"],
            "argument --steps: must be an integer of at least 2; got 0",
        ),
        (["--nproc", "2", "--full"], "argument --full: not with --nproc"),
        (["--nproc", "2", "--sweep-only"], "argument --sweep-only: not with --nproc"),
        (["--fsdp2"], "argument --fsdp2: only with --nproc"),
    ],
)
def test_bad_arguments(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_overflow_step(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        distributed.main(["--steps", "4", "--overflow-step", "4"])
    assert "argument --overflow-step: must be -1 or a step below --steps=4; got 4" in (
        capsys.readouterr().err
    )
