"""The demo's torch path: the same float16 overflow episode through the ``cstorch.amp`` facade."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import torch_facade as cstorch
from demo.cli import main, run_paths
from demo.problem import FLOAT16_MAX, RunOptions, make_problem
from demo.records import RunRecord
from demo.registry import PATHS, load_paths
from demo.report import overflow_summary

STEPS = 120

Run = tuple[list[RunRecord], list[Path]]


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One 120-step run of the torch path (fp16 + DLS and the float32 reference)."""
    assert "torch" not in load_paths(), "the torch path must be available"
    out_dir = tmp_path_factory.mktemp("demo_output")
    return run_paths(["torch"], STEPS, 0, out_dir, RunOptions(progress=False, diagnostics=True))


@pytest.fixture(scope="module")
def jax_records() -> list[RunRecord]:
    load_paths()
    problem = make_problem(steps=STEPS, seed=0)
    return PATHS["jax"](problem, RunOptions(progress=False, diagnostics=False))


def test_plot_is_written(torch_run: Run) -> None:
    _, plots = torch_run
    assert [p.name for p in plots] == ["torch_demo.png"]
    data = plots[0].read_bytes()
    assert len(data) > 10_000
    assert data.startswith(b"\x89PNG\r\n\x1a\n")


def test_records(torch_run: Run) -> None:
    records, _ = torch_run
    assert [r.name for r in records] == ["torch fp16 + DLS", "torch float32"]
    assert {r.path for r in records} == {"torch"}
    for record in records:
        assert record.steps == STEPS
        assert np.all(np.isfinite(record.losses))
    assert not records[1].is_scaled and not records[1].overflow.any()


def test_overflow_episode_backs_off_then_grows(torch_run: Run) -> None:
    fp16 = torch_run[0][0]
    assert fp16.num_skipped_steps > 0
    assert fp16.overflow[0], "the initial scale 2**24 must overflow float16"
    scales = fp16.all_scales
    assert scales[0] == fp16.scales[0] == 2.0**24
    changes = np.diff(scales)
    first_decrease = int(np.argmax(changes < 0))
    assert changes[first_decrease] < 0
    assert np.any(changes[first_decrease:] > 0), "the scale must grow again after backing off"
    ratios = scales[1:] / scales[:-1]
    assert set(np.unique(ratios)) <= {0.5, 1.0, 2.0}
    np.testing.assert_array_equal(ratios == 0.5, fp16.overflow)


def test_skipped_steps_consistent(torch_run: Run) -> None:
    fp16 = torch_run[0][0]
    assert fp16.num_skipped_steps == fp16.num_overflows
    np.testing.assert_array_equal(fp16.extras["num_skipped_steps"], np.cumsum(fp16.overflow))


def test_skipped_steps_leave_parameters_and_adam_state_unchanged(torch_run: Run) -> None:
    fp16 = torch_run[0][0]
    unchanged = fp16.extras["params_unchanged"]
    assert unchanged[fp16.overflow].all(), "a skipped step changed parameters or Adam state"
    assert not unchanged[~fp16.overflow].any(), "an applied step left the parameters unchanged"


def test_overflows_are_genuine_float16_backward_overflows(torch_run: Run) -> None:
    fp16 = torch_run[0][0]
    over, extras = fp16.overflow, fp16.extras
    assert extras["forward_finite"].all()
    assert extras["f32_finite"].all()
    assert (extras["f32_peak"][over] > FLOAT16_MAX).all()
    assert (extras["f32_peak"][~over] < FLOAT16_MAX).all()


def test_final_loss_close_to_float32(torch_run: Run) -> None:
    fp16, fp32 = torch_run[0]
    assert fp32.final_loss < fp32.losses[0] / 4, "the float32 reference must learn"
    assert fp32.final_loss / 1.5 < fp16.final_loss < fp32.final_loss * 1.5


def test_loss_scale_trajectory_equals_the_jax_path(
    torch_run: Run, jax_records: list[RunRecord]
) -> None:
    """Both paths train the same model on the same batches from the same weights, so they
    overflow on the same steps unless float16 rounding differences between torch's and XLA's
    CPU kernels (about 1e-3 relative) move a backward peak across 65504. On this problem the
    float32 peaks of skipped steps are >= 6.59e4 and those of applied steps <= 6.34e4, a margin
    of several percent, so the trajectories coincide exactly."""
    torch_fp16, torch_fp32 = torch_run[0]
    jax_fp16, jax_fp32 = jax_records
    np.testing.assert_array_equal(torch_fp16.overflow, jax_fp16.overflow)
    np.testing.assert_array_equal(torch_fp16.all_scales, jax_fp16.all_scales)
    assert torch_fp16.num_skipped_steps == jax_fp16.num_skipped_steps
    # Same Adam, same data: the losses agree to float32 (and float16) rounding.
    np.testing.assert_allclose(torch_fp32.losses, jax_fp32.losses, rtol=1e-4)
    np.testing.assert_allclose(torch_fp16.losses, jax_fp16.losses, rtol=1e-2)
    assert torch_fp16.final_loss == pytest.approx(jax_fp16.final_loss, rel=1e-2)


def entries(report: str) -> dict[str, int]:
    """``{name: count}`` of a report string (``"... non-finite: a (3 elements), ..."``)."""
    found = re.findall(r"([\w.]+) \((\d+) elements?\)", report.partition(": ")[2])
    return {name: int(count) for name, count in found}


def test_first_overflow_names_the_gradients_numpy_finds(torch_run: Run) -> None:
    """Oracle: step 0's scaled float16 backward redone in plain torch (no scaler), its
    gradients unscaled and counted by numpy."""
    from demo.torch_path import DemoMLP, mse  # here: importing registers the path (order)

    fp16 = torch_run[0][0]
    step = int(np.argmax(fp16.overflow))
    assert step == 0 and fp16.scales[step] == 2.0**24
    problem = make_problem(steps=STEPS, seed=0)
    model = DemoMLP(problem.init_params, compute_dtype=torch.float16)
    x, y = (torch.from_numpy(a) for a in problem.batch(step))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the path runs
    try:
        (mse(model(x), y) * torch.tensor(2.0**24)).backward()
    finally:
        torch.set_num_threads(threads)
    expected = {}
    for name, param in model.named_parameters():
        with np.errstate(over="ignore", invalid="ignore"):
            unscaled = param.grad.numpy() * np.float32(2.0**-24)
            total = np.sum(np.square(unscaled.astype(np.float64)))
        if not (np.isfinite(total) and total <= np.finfo(np.float32).max):
            expected[name] = int(np.sum(~np.isfinite(unscaled)))
    assert expected, "step 0 must overflow"
    assert fp16.first_overflow == overflow_summary(expected, 6)
    assert torch_run[0][1].first_overflow is None


def test_first_overflow_is_the_same_on_both_paths(
    torch_run: Run, jax_records: list[RunRecord]
) -> None:
    renamed = {
        name.replace("weight", "w").replace("bias", "b"): count
        for name, count in entries(torch_run[0][0].first_overflow).items()
    }
    assert renamed == entries(jax_records[0].first_overflow)
    assert (
        torch_run[0][0].first_overflow.split(":")[0] == jax_records[0].first_overflow.split(":")[0]
    )


@pytest.mark.parametrize(
    "gradients",
    [{}, {"a": 1}, {"blocks.11.mlp.fc2.weight": 12, "b": 0, "c": 3}],
    ids=["none", "one", "several"],
)
def test_overflow_summary_words_as_the_facade_report(gradients: dict[str, int]) -> None:
    assert overflow_summary(gradients, 148) == str(cstorch.amp.OverflowReport(gradients, 148))


def test_global_state_is_restored() -> None:
    load_paths()
    threads = torch.get_num_threads()
    cstorch.amp.set_half_dtype("cbfloat16")
    try:
        PATHS["torch"](make_problem(steps=2), RunOptions(progress=False, diagnostics=False))
        assert cstorch.amp.get_half_dtype_str() == "cbfloat16" and cstorch.amp.mixed_precision()
    finally:
        cstorch.amp.set_half_dtype("float16")
        cstorch.amp.enable_mixed_precision(False)
    assert torch.get_num_threads() == threads


def test_command_line_torch_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--path", "torch", "--steps", "12", "--out-dir", str(tmp_path), "--no-progress"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "torch fp16 + DLS" in out and "torch float32" in out and "final loss" in out
    assert "Overflow check (torch fp16 + DLS)" in out
    first = [line for line in out.splitlines() if "first overflow:" in line]
    assert len(first) == 1, first
    assert re.fullmatch(
        r"  first overflow: \d of 6 gradients non-finite: layers\.\d\.(weight|bias) .*", first[0]
    )
    assert (tmp_path / "torch_demo.png").stat().st_size > 0
    assert not (tmp_path / "comparison.png").exists()


def test_command_line_all_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--steps", "12", "--out-dir", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "paths: jax, torch" in out and "not available" not in out
    for name in ("jax fp16 + DLS", "jax float32", "torch fp16 + DLS", "torch float32"):
        assert name in out
    first = [line for line in out.splitlines() if line.startswith("  first overflow: ")]
    assert len(first) == 2  # once per float16 run
    for png in ("jax_demo.png", "torch_demo.png", "comparison.png"):
        assert (tmp_path / png).read_bytes().startswith(b"\x89PNG")
