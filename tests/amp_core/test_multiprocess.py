"""JAX multi-process data parallelism needs no code path of its own in amp_core.

Two OS processes, one CPU device each, join one ``jax.distributed`` job (gloo collectives) and
train a float16 MLP with dynamic loss scaling, the batch sharded over both, through
``apply_scaled_gradients`` and through ``with_loss_scaling`` + ``optax.apply_updates``. One
independent process with two CPU devices runs the same steps on the full batch. A NaN input in
process 1's rows and a target that overflows float16 in process 0's rows must skip the step in
both processes, and both processes must end with exactly what the one-process run computed.
The workers (``_jax_multiprocess_worker.py``) write their results; this module compares them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _jax_multiprocess_worker as worker
import numpy as np
import pytest

from workbench.processes import free_port

WORKER = Path(worker.__file__).resolve()
REPO_ROOT = WORKER.parents[2]
TIMEOUT_S = 120.0
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def child_env(host_devices: int) -> dict[str, str]:
    """This environment with ``host_devices`` CPU devices (tests/conftest.py asks for 8)."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    env["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_COUNT_FLAG}={host_devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def run_workers(commands: dict[str, tuple[list[str], int]], log_dir: Path) -> None:
    """Starts every worker at once and waits for all; kills them all after ``TIMEOUT_S``.

    Args:
        commands: name -> (worker arguments, host device count).
        log_dir: where each worker's stdout and stderr go (``<name>.log``).

    Raises:
        AssertionError: a worker failed or did not finish in time (with its log's tail).
    """
    procs: dict[str, subprocess.Popen[bytes]] = {}
    killed: list[str] = []
    try:
        for name, (args, host_devices) in commands.items():
            with open(log_dir / f"{name}.log", "wb") as log:
                procs[name] = subprocess.Popen(
                    [sys.executable, str(WORKER), *args],
                    env=child_env(host_devices),
                    cwd=REPO_ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
        deadline = time.monotonic() + TIMEOUT_S
        for proc in procs.values():
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for name, proc in procs.items():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                killed.append(name)
    failed = {name: p.returncode for name, p in procs.items() if p.returncode != 0}
    if failed:
        tails = "\n".join(
            f"--- {name} (exit {code}) ---\n{(log_dir / f'{name}.log').read_text()[-3000:]}"
            for name, code in failed.items()
        )
        raise AssertionError(f"workers failed; killed after {TIMEOUT_S} s: {killed}\n{tails}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Runs the 2-process job and the 1-process, 2-device reference side by side."""
    out = tmp_path_factory.mktemp("jax_multiprocess")
    port = str(free_port())
    commands = {
        "process0": ([str(out / "process0.npz"), port, "0", "2"], 1),
        "process1": ([str(out / "process1.npz"), port, "1", "2"], 1),
        "single": ([str(out / "single.npz")], 2),
    }
    run_workers(commands, out)
    loaded: dict[str, Any] = {}
    for name in commands:
        with np.load(out / f"{name}.npz") as data:
            loaded[name] = dict(data)
        loaded[f"{name}.facts"] = json.loads((out / f"{name}.npz.json").read_text())
    return loaded


def assert_same_bits(actual: np.ndarray, expected: np.ndarray, key: str) -> None:
    """Same dtype, shape and bytes, except that any NaN equals any NaN.

    NaN payloads are not compared: gloo's all-reduce keeps the payload of a NaN that started in
    float16, XLA's in-process all-reduce returns the default NaN.
    """
    assert actual.dtype == expected.dtype, key
    assert actual.shape == expected.shape, key
    if np.issubdtype(actual.dtype, np.floating):
        nan = np.isnan(actual)
        np.testing.assert_array_equal(nan, np.isnan(expected), err_msg=key)
        actual, expected = actual[~nan], expected[~nan]
    assert actual.tobytes() == expected.tobytes(), f"{key}: {actual} != {expected}"


def test_the_job_is_two_processes_each_feeding_half_the_batch(runs: dict[str, Any]) -> None:
    for index in range(2):
        facts = runs[f"process{index}.facts"]
        assert facts["process_index"] == index
        assert (facts["process_count"], facts["device_count"], facts["local_device_count"]) == (
            2,
            2,
            1,
        )
        half = [index * worker.BATCH // 2, (index + 1) * worker.BATCH // 2]
        assert facts["local_rows"] == half
        assert facts["shard_rows"] == [[half]] * worker.STEPS  # its one device holds its rows
    single = runs["single.facts"]
    assert (single["process_count"], single["device_count"], single["local_device_count"]) == (
        1,
        2,
        2,
    )
    assert single["shard_rows"] == [[[0, 8], [8, 16]]] * worker.STEPS


def test_each_fault_sits_in_one_process_only(runs: dict[str, Any]) -> None:
    first, second = runs["process0.facts"], runs["process1.facts"]
    assert first["local_x_finite"][worker.NAN_STEP]
    assert not second["local_x_finite"][worker.NAN_STEP]
    assert first["local_y_max"][worker.BIG_STEP] == worker.BIG_TARGET
    assert second["local_y_max"][worker.BIG_STEP] < 10.0


@pytest.mark.parametrize("variant", worker.VARIANTS)
def test_one_process_reference_follows_the_update_rule(runs: dict[str, Any], variant: str) -> None:
    """The reference itself: skips exactly at the faults, the scale moves both ways."""
    single = runs["single"]
    expected_finite = [
        step not in (worker.NAN_STEP, worker.BIG_STEP) for step in range(worker.STEPS)
    ]
    assert single[f"{variant}/scaler.isfinite"].tolist() == expected_finite
    # init 2**8, steps_per_increase 2: doubles on every 3rd step, halves on each overflow.
    expected_scale = [256, 256, 512, 256, 256, 256, 512, 256, 256, 256]
    assert single[f"{variant}/scaler.loss_scale"].tolist() == expected_scale
    assert (
        single[f"{variant}/scaler.num_skipped_steps"].tolist()
        == np.cumsum(np.logical_not(expected_finite)).tolist()
    )
    assert np.isfinite(single[f"{variant}/loss"][worker.BIG_STEP])  # only float16 overflowed
    for name in worker.initial_params():
        history = single[f"{variant}/params.{name}"]
        for step, finite in enumerate(expected_finite):
            unchanged = history[step + 1].tobytes() == history[step].tobytes()
            assert unchanged != finite, (name, step)


@pytest.mark.parametrize("variant", worker.VARIANTS)
def test_both_processes_take_every_decision_together(runs: dict[str, Any], variant: str) -> None:
    first, second = runs["process0"], runs["process1"]
    keys = sorted(k for k in first if k.startswith(f"{variant}/"))
    assert keys == sorted(k for k in second if k.startswith(f"{variant}/"))
    for key in keys:
        assert first[key].tobytes() == second[key].tobytes(), key


@pytest.mark.parametrize("variant", worker.VARIANTS)
def test_two_processes_match_one_process_with_two_devices_bit_for_bit(
    runs: dict[str, Any], variant: str
) -> None:
    """Scaler state (every field), loss, parameters after every step, final optimizer state."""
    keys = sorted(k for k in runs["single"] if k.startswith(f"{variant}/"))
    assert f"{variant}/scaler.loss_scale" in keys
    assert f"{variant}/scaler.num_skipped_steps" in keys
    for index in range(2):
        multi = runs[f"process{index}"]
        assert keys == sorted(k for k in multi if k.startswith(f"{variant}/"))
        for key in keys:
            assert_same_bits(multi[key], runs["single"][key], key)
