"""JAX across processes as clusters run it: started from SLURM variables, sharded, checkpointed.

Two launches of ``_jax_sharded_worker.py`` (each process on the CPU, gloo over 127.0.0.1, every
rendezvous and the whole launch under a timeout; each process forked from one that has imported
the worker's modules). Every process trains two stacks on the same
global batches, plain optax and flax NNX (``nnx.with_partitioning``), float16 with dynamic loss
scaling, over a ``("data", "fsdp")`` mesh of 4 devices: parameters and Adam moments sharded over
``"fsdp"``, the batch over both axes, a NaN input in one process's rows at step 3 and a
float16-overflowing target in another process's rows at step 7.

First launch, side by side:

* the oracle: one process with 4 devices, 10 steps uninterrupted;
* a SLURM job: 4 processes of 1 device, started with ``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``,
  ``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID`` and ``JAX_COORDINATOR_PORT`` only;
  ``jax.distributed.initialize`` gets no argument but its timeouts; 10 steps;
* a sharded job: 2 processes of 2 devices ("fsdp" spans the processes: each holds half of every
  sharded parameter and moment), 6 steps, then orbax's ``CheckpointManager`` saves both stacks
  from both processes, and both are killed with SIGKILL.

Second launch, side by side: two fresh processes restore the checkpoint onto their mesh (target
shardings given as abstract arrays) and train steps 6 to 9; one process with 4 devices restores
the same checkpoint, written by two processes, and does the same; and one process with 4
devices trains 10 steps without ``jax.distributed`` (``plain``).

The oracle joins a ``jax.distributed`` job of its own (one process), so that its collectives are
the ones every multi-process job uses (gloo; each device a rank). Against it every process of
every job agrees bit for bit (NaN payloads aside): every leaf of both stacks after every step,
the scaler's fields, the loss. Without ``jax.distributed``, XLA adds the 4 devices' partial sums
in its own order: ``plain`` takes the same decisions (skips, scales, counters) bit for bit, and
its float16-rounded gradients, hence its parameters and moments, differ within ``TOLERANCE``.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import _jax_sharded_worker as worker
import numpy as np
import pytest
from jax_processes import Worker, assert_same_bits, run_workers, shared_compilation_cache

from workbench.processes import free_port

WORKER = Path(worker.__file__).resolve()
shared = worker.shared
TIMEOUT_S = 300.0  # a launch: the first used 62 s of CPU, 109 s of wall on 2 cores loaded 6-fold
SLURM_PROCESSES = 4
# The worker's imports: each process is forked from one that has imported them (no JAX backend
# started), instead of paying them in each of the 11 fresh interpreters.
PRELOAD = ("jax", "jax.numpy", "numpy", "optax", "orbax.checkpoint", "flax.nnx")
PRELOAD += ("jax.experimental.multihost_utils", "amp_core", "amp_core.flax_nnx")
PRELOAD += ("_jax_multiprocess_worker",)
SAVERS = ("save0", "save1")
RESUMERS = ("resume0", "resume1")
# plain against the oracle: |difference| <= TOLERANCE * max |oracle value|, leaf by leaf. The
# models compute in float16, so a partial sum of a gradient added in another order can round to
# a neighbouring float16 value: 2**-10 (9.8e-4) relative. Adam carries that into its moments and
# updates; over 10 steps the largest difference seen was 1.1e-3 of a parameter leaf's largest
# value. 5e-3 is 5 float16 steps: a real error (a missed or extra skip, a wrong scale, a
# dropped shard) moves a leaf by far more.
TOLERANCE = 5e-3
# The scaler's fields that decide (all but the global norm, a float the tolerance covers).
DECIDING_FIELDS = (
    "isfinite",
    "loss_scale",
    "non_clamped_scale",
    "steps_since_rescale",
    "overflows_since_rescale",
    "num_skipped_steps",
    "overflows_at_min_scale",
)


def slurm_environment(port: int, process_id: int) -> dict[str, str]:
    """What ``srun --ntasks 4`` on one node sets for task ``process_id``, and the port."""
    return {
        "SLURM_JOB_ID": "4949",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_NTASKS": str(SLURM_PROCESSES),
        "SLURM_PROCID": str(process_id),
        "SLURM_LOCALID": str(process_id),
        "JAX_COORDINATOR_PORT": str(port),
        # The coordinator listens on the loopback interface only (JAX's default is every one).
        "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{port}",
    }


def load(out: Path, name: str) -> dict[str, Any]:
    with np.load(out / f"{name}.npz") as data:
        results = dict(data)
    return {"results": results, "facts": json.loads((out / f"{name}.npz.json").read_text())}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both launches; name -> its results, its facts, and its exit status."""
    out = tmp_path_factory.mktemp("jax_sharded")
    checkpoints = str(out / "checkpoints")

    def npz(name: str) -> str:
        return str(out / f"{name}.npz")

    # One compilation cache for every process: the second launch's jobs run the first's
    # programs on the same layouts (2 x 2, 1 x 4) and load them instead of compiling them.
    cache = shared_compilation_cache(out / "jax-cache")
    oracle_port, save_port, slurm_port = free_port(), free_port(), free_port()
    first = [
        Worker(
            "oracle",
            ["train", npz("oracle"), checkpoints, "explicit", str(oracle_port), "0", "1"],
            worker.DEVICES,
            env=cache,
        ),
        *(
            Worker(
                name,
                ["save", npz(name), checkpoints, "explicit", str(save_port), str(i), "2"],
                2,
                env=cache,
                ready_file=out / f"{name}.npz.saved",
            )
            for i, name in enumerate(SAVERS)
        ),
        *(
            Worker(
                f"slurm{i}",
                ["train", npz(f"slurm{i}"), checkpoints, "slurm"],
                1,
                env={**cache, **slurm_environment(slurm_port, i)},
            )
            for i in range(SLURM_PROCESSES)
        ),
    ]
    status = run_workers(WORKER, first, out, TIMEOUT_S, PRELOAD)
    resume_port, single_port = str(free_port()), str(free_port())
    second = [
        *(
            Worker(
                name,
                ["resume", npz(name), checkpoints, "explicit", resume_port, str(i), "2"],
                2,
                env=cache,
            )
            for i, name in enumerate(RESUMERS)
        ),
        Worker(
            "resume_single",
            ["resume", npz("resume_single"), checkpoints, "explicit", single_port, "0", "1"],
            worker.DEVICES,
            env=cache,
        ),
        Worker("plain", ["train", npz("plain"), checkpoints], worker.DEVICES, env=cache),
    ]
    status.update(run_workers(WORKER, second, out, TIMEOUT_S, PRELOAD))
    loaded = {w.name: load(out, w.name) for w in [*first, *second]}
    for name, code in status.items():
        loaded[name]["status"] = code
    loaded["ports"] = {"slurm": slurm_port}
    return loaded


def step_of(key: str) -> int:
    """The step a result key names: ``optax/scaler.loss_scale@7`` is after 7 steps."""
    return int(key.rsplit("@", 1)[1])


def assert_equal_to_oracle(
    runs: dict[str, Any], name: str, first_step: int, last_step: int
) -> None:
    """Every leaf, scaler field and loss of steps ``first_step .. last_step``, bit for bit."""
    results, oracle = runs[name]["results"], runs["oracle"]["results"]
    # the state the job starts from (restored, or fresh), then everything of each of its steps
    expected = [
        key
        for key in sorted(oracle)
        if first_step <= step_of(key) <= last_step
        and not (step_of(key) == first_step and "/loss@" in key)
    ]
    keys = sorted(results)
    assert keys == expected, (name, sorted(set(keys) ^ set(expected))[:5])
    for key in keys:
        assert_same_bits(results[key], oracle[key], f"{name}: {key}")


# --- how the jobs were laid out ------------------------------------------------------------------


def test_the_slurm_job_took_its_layout_from_the_slurm_variables_only(runs):
    port = runs["ports"]["slurm"]
    for i in range(SLURM_PROCESSES):
        facts = runs[f"slurm{i}"]["facts"]
        assert facts["slurm"]["SLURM_PROCID"] == str(i)
        assert facts["process_index"] == i
        assert (facts["process_count"], facts["device_count"], facts["local_device_count"]) == (
            SLURM_PROCESSES,
            worker.DEVICES,
            1,
        )
        # SlurmCluster: the first host of SLURM_STEP_NODELIST, at JAX_COORDINATOR_PORT.
        assert facts["coordinator_address"] == f"localhost:{port}"


def assert_split_between_two_processes(facts: dict[str, Any], p: int) -> None:
    """Process ``p`` of a 2 x 2 job holds half of every sharded parameter and moment, and two
    quarters of every batch."""
    half = shared.HIDDEN // 2
    assert facts["process_index"] == p
    assert (facts["process_count"], facts["device_count"], facts["local_device_count"]) == (
        2,
        worker.DEVICES,
        2,
    )
    assert facts["mesh_processes"] == [[0, 1], [0, 1]]  # "data" in a process, "fsdp" across
    for stack in worker.STACKS:
        sharded = {
            path: where
            for path, where in facts["placement"][stack].items()
            if "fsdp" in where["spec"]
        }
        # 3 parameters (two kernels and the hidden bias), each with Adam's mu and nu
        assert len(sharded) == 9, (stack, sorted(sharded))
        assert sum("mu" in path for path in sharded) == 3, (stack, sorted(sharded))
        assert sum("nu" in path for path in sharded) == 3, (stack, sorted(sharded))
        for path, where in sharded.items():
            (held,) = where["held"]  # one slice per process, the same on its two devices
            # the hidden dimension is split, every other dimension is whole
            assert [p * half, (p + 1) * half] in held, (stack, path, held)
            assert all(s[0] == 0 for s in held if s != [p * half, (p + 1) * half]), held
    # The batch over both axes: each process holds two quarters, one on each device.
    quarter = shared.BATCH // 4
    expected_rows = [[p * quarter, (p + 1) * quarter], [(p + 2) * quarter, (p + 3) * quarter]]
    assert facts["rows"] and all(rows == expected_rows for rows in facts["rows"].values())


def test_the_sharded_job_splits_parameters_and_moments_between_its_processes(runs):
    for p, name in enumerate(SAVERS):
        assert_split_between_two_processes(runs[name]["facts"], p)


def test_the_restored_job_is_split_as_its_targets_say(runs):
    for p, name in enumerate(RESUMERS):
        assert_split_between_two_processes(runs[name]["facts"], p)


def test_each_fault_sits_in_one_process_only(runs):
    nan_step, big_step = str(shared.NAN_STEP), str(shared.BIG_STEP)
    assert runs["save0"]["facts"]["local_x_finite"][nan_step]
    assert not runs["save1"]["facts"]["local_x_finite"][nan_step]
    assert runs["resume0"]["facts"]["local_y_max"][big_step] == shared.BIG_TARGET
    assert runs["resume1"]["facts"]["local_y_max"][big_step] < 10.0


# --- the oracle ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stack", worker.STACKS)
def test_the_oracle_skips_exactly_the_faulty_steps_and_moves_the_scale_both_ways(runs, stack):
    oracle = runs["oracle"]["results"]
    steps = range(1, shared.STEPS + 1)  # the state after each step
    finite = [bool(oracle[f"{stack}/scaler.isfinite@{s}"]) for s in steps]
    assert finite == [s - 1 not in (shared.NAN_STEP, shared.BIG_STEP) for s in steps]
    # init 2**8, steps_per_increase 2: doubles on every 3rd step, halves on each overflow.
    scales = [float(oracle[f"{stack}/scaler.loss_scale@{s}"]) for s in steps]
    assert scales == [256, 256, 512, 256, 256, 256, 512, 256, 256, 256]
    skipped = [int(oracle[f"{stack}/scaler.num_skipped_steps@{s}"]) for s in steps]
    assert skipped == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    leaves = sorted(
        {k.split("@")[0] for k in oracle if k.startswith(f"{stack}/state") and "scaler" not in k}
    )
    assert len(leaves) >= 12, leaves  # 4 parameters, their 2 moments each, counters
    moved = [
        any(
            oracle[f"{leaf}@{s}"].tobytes() != oracle[f"{leaf}@{s - 1}"].tobytes()
            for leaf in leaves
        )
        for s in steps
    ]
    assert moved == finite  # a skipped step changes nothing but the scaler's counters


# --- against the oracle --------------------------------------------------------------------------


def test_four_processes_from_slurm_equal_one_process_with_four_devices(runs):
    for i in range(SLURM_PROCESSES):
        assert_equal_to_oracle(runs, f"slurm{i}", 0, shared.STEPS)


def test_two_processes_sharded_equal_one_process_for_the_first_six_steps(runs):
    for name in SAVERS:
        assert_equal_to_oracle(runs, name, 0, worker.SAVE_AT)


def test_both_processes_were_killed_after_the_checkpoint_was_committed(runs):
    for name in SAVERS:
        assert runs[name]["status"] == -signal.SIGKILL
        assert runs[name]["facts"]["checkpoint_steps"] == [worker.SAVE_AT]


def test_two_fresh_processes_restore_and_continue_equal_to_the_uninterrupted_run(runs):
    for name in RESUMERS:
        assert runs[name]["facts"]["checkpoint_steps"] == [worker.SAVE_AT]
        assert runs[name]["facts"]["process_count"] == 2
        assert_equal_to_oracle(runs, name, worker.SAVE_AT, shared.STEPS)


def test_one_process_restores_the_two_process_checkpoint_and_continues_equal(runs):
    facts = runs["resume_single"]["facts"]
    assert (facts["process_count"], facts["local_device_count"]) == (1, worker.DEVICES)
    assert_equal_to_oracle(runs, "resume_single", worker.SAVE_AT, shared.STEPS)


def test_one_process_without_jax_distributed_takes_the_same_decisions(runs):
    """XLA's own collectives: the decisions bit for bit, the floats within ``TOLERANCE``."""
    plain, oracle = runs["plain"]["results"], runs["oracle"]["results"]
    assert sorted(plain) == sorted(oracle)
    deciding = [
        key
        for key in plain
        if not np.issubdtype(plain[key].dtype, np.floating)
        or any(f"scaler.{field}@" in key for field in DECIDING_FIELDS)
    ]
    assert len(deciding) >= len(worker.STACKS) * len(DECIDING_FIELDS) * (shared.STEPS + 1)
    for key in deciding:
        assert_same_bits(plain[key], oracle[key], f"plain: {key}")
    for key in sorted(set(plain) - set(deciding)):
        actual, expected = plain[key].astype(np.float64), oracle[key].astype(np.float64)
        np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected), err_msg=key)
        finite = ~np.isnan(expected)
        if finite.any():
            scale = np.abs(expected[finite]).max()
            difference = np.abs(actual[finite] - expected[finite]).max()
            assert difference <= TOLERANCE * scale, (key, difference, scale)
