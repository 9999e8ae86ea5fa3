"""The demo's JAX path: a real float16 overflow episode, skipped steps, plot and table."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from demo.cli import main, run_paths
from demo.problem import FLOAT16_MAX, RunOptions
from demo.records import RunRecord
from demo.registry import PATHS, load_paths

STEPS = 120


@pytest.fixture(scope="module")
def jax_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[RunRecord], list[Path]]:
    """One 120-step run of the JAX path (fp16 + DLS and the float32 reference)."""
    load_paths()
    out_dir = tmp_path_factory.mktemp("demo_output")
    return run_paths(["jax"], STEPS, 0, out_dir, RunOptions(progress=False, diagnostics=True))


def test_plot_is_written(jax_run: tuple[list[RunRecord], list[Path]]) -> None:
    _, plots = jax_run
    assert [p.name for p in plots] == ["jax_demo.png"]
    data = plots[0].read_bytes()
    assert len(data) > 10_000
    assert data.startswith(b"\x89PNG\r\n\x1a\n")


def test_records(jax_run: tuple[list[RunRecord], list[Path]]) -> None:
    records, _ = jax_run
    assert [r.name for r in records] == ["jax fp16 + DLS", "jax float32"]
    for record in records:
        assert record.steps == STEPS
        assert np.all(np.isfinite(record.losses))
    assert not records[1].is_scaled and not records[1].overflow.any()


def test_overflow_episode_backs_off_then_grows(jax_run: tuple[list[RunRecord], list[Path]]) -> None:
    fp16 = jax_run[0][0]
    assert fp16.overflow.sum() >= 1
    assert fp16.overflow[0], "the initial scale 2**24 must overflow float16"
    changes = np.diff(fp16.all_scales)
    first_decrease = int(np.argmax(changes < 0))
    assert changes[first_decrease] < 0
    assert np.any(changes[first_decrease:] > 0), "the scale must grow again after backing off"
    # Each overflow halves the scale (overflow_tolerance 0); growth is a doubling.
    ratios = fp16.all_scales[1:] / fp16.all_scales[:-1]
    assert set(np.unique(ratios)) <= {0.5, 1.0, 2.0}
    np.testing.assert_array_equal(ratios == 0.5, fp16.overflow)


def test_skipped_steps_match_amp_core_counter(jax_run: tuple[list[RunRecord], list[Path]]) -> None:
    fp16 = jax_run[0][0]
    assert fp16.num_skipped_steps == fp16.num_overflows
    np.testing.assert_array_equal(fp16.extras["num_skipped_steps"], np.cumsum(fp16.overflow))


def test_skipped_steps_leave_parameters_unchanged(
    jax_run: tuple[list[RunRecord], list[Path]],
) -> None:
    fp16 = jax_run[0][0]
    unchanged = fp16.extras["params_unchanged"]
    assert unchanged[fp16.overflow].all(), "a skipped step changed parameters or Adam state"
    assert not unchanged[~fp16.overflow].any(), "an applied step left the parameters unchanged"


def test_overflows_are_genuine_float16_backward_overflows(
    jax_run: tuple[list[RunRecord], list[Path]],
) -> None:
    fp16 = jax_run[0][0]
    over = fp16.overflow
    extras = fp16.extras
    # The forward pass never overflows, the same step in float32 is finite, and its backward
    # reaches magnitudes float16 cannot hold exactly on the skipped steps.
    assert extras["forward_finite"].all()
    assert extras["f32_finite"].all()
    assert (extras["f32_peak"][over] > FLOAT16_MAX).all()
    assert (extras["f32_peak"][~over] < FLOAT16_MAX).all()


def test_final_loss_close_to_float32(jax_run: tuple[list[RunRecord], list[Path]]) -> None:
    fp16, fp32 = jax_run[0]
    assert fp32.final_loss < fp32.losses[0] / 4, "the float32 reference must learn"
    assert fp32.final_loss / 1.5 < fp16.final_loss < fp32.final_loss * 1.5


def test_first_overflow_is_reported(jax_run: tuple[list[RunRecord], list[Path]]) -> None:
    """The first skipped step names its gradients (``amp_core.nonfinite_report``); the float32
    reference has none."""
    fp16, fp32 = jax_run[0]
    assert fp32.first_overflow is None
    report = fp16.first_overflow
    match = re.fullmatch(r"(\d) of 6 gradients non-finite: (.*)", report)
    assert match, report
    entries = dict(re.findall(r"(layers\.\d\.[wb]) \((\d+) elements?\)", match[2]))
    assert len(entries) == int(match[1]) >= 1
    sizes = {"layers.0.w": 16 * 128, "layers.1.w": 128 * 128, "layers.2.w": 128}
    sizes |= {"layers.0.b": 128, "layers.1.b": 128, "layers.2.b": 1}
    for name, count in entries.items():
        assert 0 <= int(count) <= sizes[name]


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["--path", "jax", "--steps", "12", "--out-dir", str(tmp_path), "--no-progress"]) == 0
    )
    out = capsys.readouterr().out
    assert "jax fp16 + DLS" in out and "jax float32" in out and "final loss" in out
    assert "plot saved to" in out
    first = [line for line in out.splitlines() if "first overflow:" in line]
    assert len(first) == 1 and first[0].startswith("  first overflow: ")
    assert re.search(r"first overflow: \d of 6 gradients non-finite: layers\.", first[0])
    assert (tmp_path / "jax_demo.png").stat().st_size > 0
    assert "jax" in PATHS
