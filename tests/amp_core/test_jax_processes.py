"""The launch helper of the multi-process tests: a failure ends the launch, ready workers die.

Plain Python children (no JAX), so each test costs a few process starts. Each test runs twice:
every worker a fresh interpreter, and every worker forked from ``tests/fork_launcher.py`` (the
``preload`` path of ``run_workers``).
"""

from __future__ import annotations

import json
import signal
import textwrap
from pathlib import Path

import pytest
from jax_processes import DEVICE_COUNT_FLAG, Worker, run_workers

CHILD = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path

    mode, arg = sys.argv[1], sys.argv[2]
    if mode == "fail":
        print("bad input, exiting")
        sys.exit(3)
    if mode == "env":
        Path(arg).write_text(json.dumps(dict(os.environ)))
        sys.exit(0)
    if mode == "ready":
        Path(arg).write_text("ready")
    if mode == "exit":
        sys.exit(0)
    while True:  # "hang", or "ready": wait to be killed
        time.sleep(0.1)
    """
)
DEADLINE_S = 120.0  # only reached if the helper failed to end the launch early


@pytest.fixture(params=[(), ("json",)], ids=["fresh", "forked"])
def preload(request: pytest.FixtureRequest) -> tuple[str, ...]:
    """Each worker a fresh interpreter, or forked from one that has imported ``json``."""
    return request.param


@pytest.fixture
def child(tmp_path: Path) -> Path:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return script


def test_the_first_failure_ends_the_launch_with_every_log(
    child: Path, tmp_path: Path, preload: tuple[str, ...]
) -> None:
    workers = [
        Worker("hangs", ["hang", "-"], 1),
        Worker("fails", ["fail", "-"], 1),
    ]
    with pytest.raises(AssertionError) as failure:
        run_workers(child, workers, tmp_path, DEADLINE_S, preload)
    message = str(failure.value)
    assert "launch failed: ['fails']" in message  # not "still running after" the deadline
    assert "--- fails (exit 3) ---\nbad input, exiting" in message
    assert f"--- hangs (exit {-signal.SIGKILL}) ---" in message


def test_workers_with_ready_files_are_killed_once_all_are_ready(
    child: Path, tmp_path: Path, preload: tuple[str, ...]
) -> None:
    workers = [
        Worker(
            "first",
            ["ready", str(tmp_path / "first.ready")],
            1,
            ready_file=tmp_path / "first.ready",
        ),
        Worker(
            "second",
            ["ready", str(tmp_path / "second.ready")],
            1,
            ready_file=tmp_path / "second.ready",
        ),
        Worker("other", ["exit", "-"], 1),
    ]
    status = run_workers(child, workers, tmp_path, DEADLINE_S, preload)
    assert status == {"first": -signal.SIGKILL, "second": -signal.SIGKILL, "other": 0}


def test_a_worker_to_be_killed_that_exits_by_itself_fails_the_launch(
    child: Path, tmp_path: Path, preload: tuple[str, ...]
) -> None:
    ready = tmp_path / "never.ready"
    with pytest.raises(AssertionError, match=r"launch failed: \['early'\]"):
        run_workers(
            child,
            [Worker("early", ["exit", "-"], 1, ready_file=ready)],
            tmp_path,
            DEADLINE_S,
            preload,
        )


def test_workers_see_their_devices_and_no_inherited_cluster_variables(
    child: Path, tmp_path: Path, preload: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_PROCID", "7")
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "1.0;tcp://10.0.0.1:1")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("XLA_FLAGS", f"--xla_cpu_use_thunk_runtime=true {DEVICE_COUNT_FLAG}=8")
    dump = tmp_path / "env.json"
    run_workers(
        child,
        [Worker("env", ["env", str(dump)], 3, env={"SLURM_NTASKS": "2"})],
        tmp_path,
        DEADLINE_S,
        preload,
    )
    env = json.loads(dump.read_text())
    assert {k for k in env if k.startswith(("SLURM_", "OMPI_", "JAX_COORDINATOR"))} == {
        "SLURM_NTASKS"
    }
    assert env["XLA_FLAGS"] == f"--xla_cpu_use_thunk_runtime=true {DEVICE_COUNT_FLAG}=3"
    assert env["JAX_PLATFORMS"] == "cpu"
