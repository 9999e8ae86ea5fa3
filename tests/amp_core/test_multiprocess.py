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
from pathlib import Path
from typing import Any

import _jax_multiprocess_worker as worker
import numpy as np
import pytest
from jax_processes import Worker, assert_same_bits, run_workers

from workbench.processes import free_port

WORKER = Path(worker.__file__).resolve()
TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Runs the 2-process job and the 1-process, 2-device reference side by side."""
    out = tmp_path_factory.mktemp("jax_multiprocess")
    port = str(free_port())
    workers = [
        Worker("process0", [str(out / "process0.npz"), port, "0", "2"], 1),
        Worker("process1", [str(out / "process1.npz"), port, "1", "2"], 1),
        Worker("single", [str(out / "single.npz")], 2),
    ]
    run_workers(WORKER, workers, out, TIMEOUT_S)
    loaded: dict[str, Any] = {}
    for name in ("process0", "process1", "single"):
        with np.load(out / f"{name}.npz") as data:
            loaded[name] = dict(data)
        loaded[f"{name}.facts"] = json.loads((out / f"{name}.npz.json").read_text())
    return loaded


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
