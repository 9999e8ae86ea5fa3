"""The device check runs end to end on the CPU (quick mode) and writes every field; on a CUDA
machine the ``gpu``-marked test runs the full check (skipped elsewhere).

The end-to-end runs are subprocesses, as a user runs the check: a fresh process is what the
memory section needs (JAX's backends not yet initialized). Nothing here asserts a timing.
"""

from __future__ import annotations

import doctest
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from device_check import check as device_check
from device_check import compiled as device_compiled
from device_check import correctness as device_correctness
from device_check import report as device_report

REPO = Path(__file__).resolve().parents[2]
SECTION_KEYS = ("memory", "correctness", "host_syncs_per_iteration", "timings", "compiled")
CPU_QUICK_TIMEOUT_S = 480  # about 45 s on an idle 2-core machine (inductor compiles C++)
GPU_TIMEOUT_S = 10 * 60  # the compiled section adds four inductor compilations


def _run_check(out: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "device_check", "--out", str(out), *args]
    return subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _load(out: Path) -> tuple[dict[str, Any], str]:
    results = json.loads((out / device_check.JSON_NAME).read_text())
    return results, (out / device_check.MARKDOWN_NAME).read_text()


@pytest.fixture(scope="module")
def cpu_quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("device_check")
    done = _run_check(out, "--device", "cpu", "--quick", timeout=CPU_QUICK_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.startswith("# Device check: cpu, quick")
    return _load(out)


def _assert_common(results: dict[str, Any], device: str) -> None:
    assert results["device"] == device
    assert results["passed"] is True
    for key in SECTION_KEYS:
        section = results[key]
        assert "error" not in section, section.get("traceback")
        assert section["seconds"] >= 0
    env = results["environment"]
    for key in (
        "python",
        "torch",
        "jax",
        "jaxlib",
        "jax_backend",
        "jax_devices",
        "packages",
        "env",
    ):
        assert key in env
    assert set(device_check.device_probes.XLA_ENV) <= set(env["env"])
    assert results["wall_seconds"] > 0

    correctness = results["correctness"]
    assert correctness["passed"] is True
    runs = correctness["runs"]
    assert {(r["mode"], r["optimizer"]) for r in runs} == {
        (m, o) for m in device_correctness.MODES for o in device_correctness.OPTIMIZERS
    }
    assert correctness["compared_steps"] == sum(r["steps"] for r in runs) > 0
    assert correctness["model"]["tensors"] == 148
    for run in runs:
        assert run["mismatches"] == []
        assert len(run["scales"]) == run["steps"] == len(run["records"])
        if run["mode"] == "static":
            assert run["skipped_steps"] == 0 and set(run["scales"]) == {
                device_correctness.INIT_SCALE
            }
        else:  # every injected fault skipped its step, and both grew the scale
            assert run["skipped_steps"] >= len(run["faults"]) > 0
            assert max(run["scales"]) > device_correctness.INIT_SCALE
            assert run["facade_norm_max_rel_err"] <= device_correctness.NORM_RTOL
        if run["mode"] == "dls_gcc":
            assert run["clipped_steps"] > 0 and run["gcc_param_max_excess"] <= 1.0

    memory = results["memory"]
    checkpoints = memory["checkpoints"]
    assert len(checkpoints) == 5
    # The check itself must not initialize JAX before the facade does.
    assert checkpoints[0]["jax_backends_initialized"] in (False, None)
    assert checkpoints[1]["jax_backends_initialized"] in (False, None)
    assert checkpoints[-1]["jax_backends_initialized"] in (True, None)

    timings = results["timings"]
    rows = timings["whole"]["rows"]
    assert {(r["optimizer"], r["clip"]) for r in rows} == {
        (o, c) for o in device_check.device_probes.TIMING_OPTIMIZERS for c in (False, True)
    }
    for row in rows:
        for key in ("bare_ms", "torch_ms", "facade_ms"):
            median = row[key]["median"]
            assert median is not None and math.isfinite(median) and median > 0
        assert row["torch_skipped_steps"] == row["facade_skipped_steps"] == 0
    compiled = results["compiled"]
    assert compiled["passed"] is True
    assert [r["pattern"] for r in compiled["rows"]] == list(device_compiled.PATTERNS)
    assert compiled["eager"]["flags"] == [
        step not in device_compiled.FAULT_STEPS for step in range(compiled["settings"]["steps"])
    ]
    for row in compiled["rows"]:
        if not row["applicable"]:
            assert device != "cuda" and row["pattern"] in device_compiled.CUDA_ONLY
            continue
        assert row["passed"] and row["same_skips"] and row["same_scales"]
        assert row["unchanged_on_skips"] == [True] * len(device_compiled.FAULT_STEPS)
        assert row["compiles_after_warmup"] == 0 and row["graphs"] > 0
        assert row["max_param_diff"] <= device_compiled.PARAM_ATOL
        assert row["median_ms"] > 0
        if row["pattern"].startswith("train step"):  # scale, unscale_, step, update
            assert row["facade_graph_breaks"] == 4
        else:
            assert row["facade_graph_breaks"] == 0

    calls = timings["per_call"]
    assert calls["tensors"] == 148
    assert len(calls["rows"]) == 2 * 2 * 2  # optimizers x loops x scalers
    for row in calls["rows"]:
        expected = {"loss", "scale", "backward", "step", "update", "scaler"} | (
            {"unscale_"} if row["loop"] == "unscale_" else set()
        )
        assert set(row["us"]) == expected and all(v > 0 for v in row["us"].values())


def test_cpu_quick_check_writes_every_field(cpu_quick: tuple[dict[str, Any], str]) -> None:
    results, markdown = cpu_quick
    _assert_common(results, "cpu")
    assert results["quick"] is True and results["environment"]["torch_threads"] == 1
    assert results["sections_run"] == list(device_check.SECTIONS)
    memory = results["memory"]
    assert memory["outside_torch_bytes"] is None and memory["reason"]
    assert memory["jax_memory_stats"] is None and memory["jax_memory_stats_reason"]
    assert memory["scale_device"] == "cpu"
    syncs = results["host_syncs_per_iteration"]
    assert syncs["applicable"] is False and syncs["rows"] is None and syncs["reason"]
    assert set(results["timings"]["whole"]["sizes"]) == {"S"}
    for heading in (
        "## Environment",
        "## 1. Memory",
        "## 2. Correctness against torch.amp.GradScaler",
        "## 3. Host synchronisations per iteration",
        "## 4. Timings",
        "## 5. The facade around torch.compile",
    ):
        assert heading in markdown
    assert "**PASSED**" in markdown and "Verdict: passed" in markdown
    assert "| dls | AdamW fused | yes |" in markdown
    assert "| model, reduce-overhead | n/a: CUDA graphs need a GPU |" in markdown
    assert "| train step | yes | yes | yes |" in markdown


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_full_check(tmp_path: Path) -> None:
    done = _run_check(tmp_path, "--device", "cuda", timeout=GPU_TIMEOUT_S)
    results, markdown = _load(tmp_path)
    assert done.returncode == 0, markdown
    _assert_common(results, "cuda")
    assert results["environment"]["gpu_name"]
    memory = results["memory"]
    assert memory["free_drop_bytes"] is not None and memory["outside_torch_bytes"] is not None
    syncs = results["host_syncs_per_iteration"]
    assert syncs["applicable"] is True and len(syncs["rows"]) == 4
    assert set(results["timings"]["whole"]["sizes"]) == {"S", "M", "L"}
    assert all(row["applicable"] for row in results["compiled"]["rows"])


def test_a_raising_section_is_recorded_and_fails_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(device: torch.device, quick: bool, seed: int = 0) -> dict[str, Any]:
        raise RuntimeError("the probe broke")

    monkeypatch.setattr(device_check.device_probes, "host_syncs", broken)
    check = device_check.DeviceCheck("cpu", tmp_path, quick=True, sections=["host_syncs"])
    results = check.run()
    section = results["host_syncs_per_iteration"]
    assert section["error"] == "RuntimeError: the probe broke"
    assert "the probe broke" in section["traceback"] and section["seconds"] >= 0
    assert results["passed"] is False
    assert results["memory"] is None and results["correctness"] is None
    written, markdown = _load(tmp_path)
    assert written["passed"] is False
    assert "**The section raised**: `RuntimeError: the probe broke`" in markdown
    assert "Verdict: **FAILED**" in markdown


def test_a_failed_comparison_fails_the_verdict(tmp_path: Path) -> None:
    check = device_check.DeviceCheck("cpu", tmp_path, sections=["correctness"])
    check.results["correctness"] = {"passed": False, "seconds": 1.0}
    assert check.verdict() is False
    check.results["correctness"] = {"passed": True, "seconds": 1.0}
    assert check.verdict() is True
    check = device_check.DeviceCheck("cpu", tmp_path, sections=["compiled"])
    check.results["compiled"] = {"passed": False, "seconds": 1.0}
    assert check.verdict() is False


def test_command_line_is_validated(tmp_path: Path) -> None:
    parser = device_check.build_parser()
    for argv in (["--sections", "memory,speed"], ["--device", "tpu"], []):
        with pytest.raises(SystemExit):
            parser.parse_args([*argv, "--out", str(tmp_path)] if argv else argv)
    args = parser.parse_args(["--out", str(tmp_path), "--sections", "timings,memory"])
    assert args.sections == ["timings", "memory"]
    check = device_check.DeviceCheck("cpu", tmp_path, sections=args.sections)
    assert check.sections == ["memory", "timings"]  # memory always first
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="torch sees no CUDA device"):
            device_check.main(["--device", "cuda", "--out", str(tmp_path)])


def test_scale_trajectories_render_compactly() -> None:
    assert device_report._trajectory([4.0, 4.0, 8.0, 4.0, 4.0, 4.0]) == "4.00 x2, 8.00, 4.00 x3"
    assert device_report._trajectory([]) == ""


def test_expected_scales_is_the_derived_rule() -> None:
    failures, _ = doctest.testmod(device_correctness)
    assert failures == 0
    skips = [False] * 3 + [True, True] + [False] * 4
    assert device_correctness.expected_scales(skips, 16.0, 3) == [
        16.0, 16.0, 32.0, 16.0, 8.0, 8.0, 8.0, 16.0, 16.0,
    ]  # fmt: skip
