"""torchrun as users launch it: DDP with the facade's dynamic loss scaling, on CPU over gloo.

Each launch is ``python -m torch.distributed.run`` (torchrun) running ``_torchrun_worker.py``:

* ``--standalone --nproc-per-node 2``;
* a simulated two-node job: two torchrun agents started together (``--nnodes 2 --node-rank
  0/1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT --local-addr 127.0.0.1``, each
  ``--nproc-per-node 2``): 4 ranks on 2 "nodes";
* an elastic restart: standalone, ``--max-restarts 1``, rank 1 SIGKILLs itself after step 4 of
  the first attempt; torchrun restarts the group, which resumes from the last atomic
  checkpoint (after step 3);
* a world size (3) that does not divide the global batch (8 rows; the demo's 32);
* the demo's main job, ``python -m demo.distributed`` (2 steps), under ``--standalone``.

At steps 2 and 6 one rank alone writes an inf into its gradient after DDP's all-reduce. The
oracles: the same training in this process on the whole batch (``train(None)``, itself checked
bit for bit against ``_distributed_worker.run_case("ddp", None)``, the oracle of
``test_distributed.py``), hand-computed loss scales, and for the restart the uninterrupted
standalone run (``torch.equal`` of model, optimizer and scaler state). Every process binds
127.0.0.1 (``GLOO_SOCKET_IFNAME=lo``); rendezvous and collectives have timeouts, every launch a
deadline after which its process group is killed and the agents' output shown.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _distributed_worker as base
import _torchrun_worker as worker
import numpy as np
import pytest
import torch
from _ranks import free_port
from facade_helpers import deep_equal

WORKER = Path(worker.__file__).resolve()
REPO_ROOT = WORKER.parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
RDZV_CONF = "join_timeout=60,read_timeout=60,close_timeout=10"
"""Seconds within which every agent must join the rendezvous (and store reads answer)."""
LAUNCH_TIMEOUT_S = 180.0
"""A launch still running after this long is killed (agents and ranks) and fails."""
SURVIVOR_BOUND_S = 30.0
"""After the kill, the restarted group starts within this many seconds (the survivor gone)."""
SCALES = [256.0, 256.0, 128.0, 128.0, 128.0, 256.0, 128.0, 128.0]
"""By hand: 2**8, halved at each planted overflow (steps 2, 6), doubled after 3 clean steps."""
EVERY_STEP = list(range(worker.STEPS))


FRESH_STORE_PER_ATTEMPT = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""A fresh rendezvous store per torchrun attempt, hosted by rank 0: torch 2.13 otherwise keeps
the agent's store (the same ``MASTER_PORT``) for every attempt, and restarted gloo groups often
failed to connect (docs/at-scale.md, "Elastic restarts"; pytorch issue 135712's workaround)."""


def environment(**extra: str) -> dict[str, str]:
    """The launches' environment: JAX on the CPU, one thread, gloo on the loopback."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


class Launch:
    """torchrun agents started together, each in its own session, logging to ``out``."""

    def __init__(self, agents: list[list[str]], out: Path, **env: str) -> None:
        self.out = out
        self.logs = [out / f"agent{i}.log" for i in range(len(agents))]
        self.started = time.monotonic()
        self.procs = []
        for arguments, log in zip(agents, self.logs, strict=True):
            with open(log, "wb") as file:
                self.procs.append(
                    subprocess.Popen(
                        [*TORCHRUN, *arguments],
                        cwd=REPO_ROOT,
                        env=environment(**env),
                        stdout=file,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )

    def output(self) -> str:
        """Every agent's output (its ranks' output included)."""
        return "\n".join(f"--- {log.name} ---\n{log.read_text()}" for log in self.logs)

    def wait(self, succeed: bool = True) -> float:
        """Waits for every agent (killing all of them at the deadline); the wall seconds.

        Raises:
            AssertionError: an agent ran past :data:`LAUNCH_TIMEOUT_S`, or ``succeed`` and one
                failed (or not ``succeed`` and one passed), with every agent's output.
        """
        deadline = self.started + LAUNCH_TIMEOUT_S
        try:
            for proc in self.procs:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired as timeout:
            for proc in self.procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)  # the agent and its ranks
                    proc.wait()
            raise AssertionError(
                f"torchrun ran past {LAUNCH_TIMEOUT_S} s:\n{self.output()[-8000:]}"
            ) from timeout
        codes = [proc.returncode for proc in self.procs]
        if any(codes) if succeed else not all(codes):
            raise AssertionError(f"torchrun exited with {codes}:\n{self.output()[-8000:]}")
        return time.monotonic() - self.started


def standalone(nproc: int, out: Path, *extra: str) -> list[str]:
    """torchrun's arguments for one agent with its own rendezvous (``--standalone``)."""
    return [
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--local-addr=127.0.0.1",
        f"--rdzv-conf={RDZV_CONF}",
        *extra,
    ]


def results(out: Path, world: int) -> list[dict[str, Any]]:
    """Every rank's saved result (our own files: numpy arrays inside)."""
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def events(out: Path) -> list[tuple[float, int, int, str]]:
    """``(time, attempt, rank, event)`` lines of the ranks' ``events.txt``."""
    lines = (line.split(" ", 3) for line in (out / "events.txt").read_text().splitlines())
    return [(float(t), int(attempt), int(rank), event) for t, attempt, rank, event in lines]


@pytest.fixture(scope="module")
def oracle_and_standalone(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The standalone job's ranks; the one-process runs are computed while it runs."""
    out = tmp_path_factory.mktemp("standalone")
    launch = Launch([[*standalone(2, out), str(WORKER), str(out)]], out)
    oracle = worker.train(None)
    suite_oracle = base.run_case("ddp", None)
    seconds = launch.wait()
    print(f"standalone launch: {seconds:.1f} s")
    return {"oracle": oracle, "suite_oracle": suite_oracle, "ranks": results(out, 2), "s": seconds}


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two agents on a c10d rendezvous at a fresh 127.0.0.1 port, 2 ranks each."""
    out = tmp_path_factory.mktemp("two_nodes")
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [
        [
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc-per-node=2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            "--rdzv-id=two-nodes",
            "--local-addr=127.0.0.1",
            f"--rdzv-conf={RDZV_CONF},is_host={int(node == 0)}",
            str(WORKER),
            str(out),
        ]
        for node in (0, 1)
    ]
    launch = Launch(agents, out)
    seconds = launch.wait()
    print(f"two-node launch: {seconds:.1f} s")
    return {"ranks": results(out, 4), "s": seconds, "output": launch.output()}


@pytest.fixture(scope="module")
def elastic(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``--max-restarts 1``; rank 1 SIGKILLs itself after step 4 of the first attempt."""
    out = tmp_path_factory.mktemp("elastic")
    launch = Launch(
        [[*standalone(2, out, "--max-restarts=1"), str(WORKER), str(out), "--kill"]],
        out,
        **FRESH_STORE_PER_ATTEMPT,
    )
    seconds = launch.wait()
    print(f"elastic launch: {seconds:.1f} s")
    return {"ranks": results(out, 2), "events": events(out), "s": seconds}


def jobs(request: pytest.FixtureRequest, name: str) -> dict[str, Any]:
    """The fixture of launch ``name`` (the oracle and standalone run together)."""
    fixture = "oracle_and_standalone" if name == "standalone" else name
    return request.getfixturevalue(fixture)


def test_the_one_process_oracle_is_the_suite_s_and_skips_the_planted_steps(
    oracle_and_standalone: dict[str, Any],
) -> None:
    """Bit for bit the DDP case's one-process run over its 6 steps (its fault at step 2 is
    ours; ours adds one at step 6); skips and scales as computed by hand."""
    oracle, suite = oracle_and_standalone["oracle"], oracle_and_standalone["suite_oracle"]
    assert base.FAULT_STEP == 2 and base.STEPS == 6
    assert oracle["params"][: base.STEPS].tobytes() == suite["params"][1:].tobytes()
    assert oracle["steps"].tolist() == EVERY_STEP
    assert oracle["isfinite"].tolist() == [s not in worker.FAULTS for s in EVERY_STEP]
    assert oracle["unchanged"].tolist() == [s in worker.FAULTS for s in EVERY_STEP]
    assert oracle["state.loss_scale"].tolist() == SCALES
    assert oracle["state.num_skipped_steps"].tolist() == [0, 0, 1, 1, 1, 1, 2, 2]


def test_torchrun_set_up_each_world_on_the_loopback(
    oracle_and_standalone: dict[str, Any], two_nodes: dict[str, Any]
) -> None:
    """Ranks 0..W-1, ``MASTER_ADDR`` 127.0.0.1; two nodes of 2 local ranks each."""
    for runs, world, nodes in ((oracle_and_standalone["ranks"], 2, 1), (two_nodes["ranks"], 4, 2)):
        envs = [run["environment"] for run in runs]
        assert [e["RANK"] for e in envs] == [str(r) for r in range(world)]
        assert {e["WORLD_SIZE"] for e in envs} == {str(world)}
        assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
        assert {e["TORCHELASTIC_RESTART_COUNT"] for e in envs} == {"0"}
        node_of = {(e["GROUP_RANK"], e["LOCAL_RANK"]) for e in envs}
        assert node_of == {(str(n), str(i)) for n in range(nodes) for i in range(world // nodes)}


@pytest.mark.parametrize("name", ["standalone", "two_nodes"])
def test_one_rank_alone_saw_each_overflow_and_every_rank_skipped_it(
    request: pytest.FixtureRequest, name: str
) -> None:
    """Only the planted rank's own gradients were non-finite (``torch.isfinite``, after the
    all-reduce); every rank skipped exactly those steps, keeping every bit."""
    runs = jobs(request, name)["ranks"]
    world = len(runs)
    for rank, run in enumerate(runs):
        assert run["steps"].tolist() == EVERY_STEP
        seen = [worker.fault_rank(step, world) != rank for step in EVERY_STEP]
        assert run["local_finite"].tolist() == seen, rank
        assert run["isfinite"].tolist() == [s not in worker.FAULTS for s in EVERY_STEP], rank
        assert run["unchanged"].tolist() == [s in worker.FAULTS for s in EVERY_STEP], rank
        assert run["state.loss_scale"].tolist() == SCALES, rank
    assert {worker.fault_rank(s, world) for s in worker.FAULTS} == {0, world - 1}


@pytest.mark.parametrize("name", ["standalone", "two_nodes"])
def test_every_rank_ends_bit_identical(request: pytest.FixtureRequest, name: str) -> None:
    """``torch.equal`` of parameters, optimizer state and scaler state across ranks; per step
    the same scaler state and parameters."""
    first, *others = jobs(request, name)["ranks"]
    for rank, run in enumerate(others, start=1):
        for part in ("model", "optimizer", "scaler"):
            assert deep_equal(first["final"][part], run["final"][part]), (rank, part)
        for key in first:
            if key.startswith("state.") or key in ("params", "isfinite", "unchanged"):
                assert first[key].tobytes() == run[key].tobytes(), (rank, key)


@pytest.mark.parametrize("name", ["standalone", "two_nodes"])
def test_the_job_equals_one_process_on_the_whole_batch(
    request: pytest.FixtureRequest, name: str, oracle_and_standalone: dict[str, Any]
) -> None:
    """The same skips and scaler state (every counter) bit for bit; parameters and Adam's
    moments within float32 reduction order (the ranks average their halves' gradients)."""
    oracle = oracle_and_standalone["oracle"]
    for run in jobs(request, name)["ranks"]:
        assert run["isfinite"].tolist() == oracle["isfinite"].tolist()
        assert deep_equal(run["final"]["scaler"], oracle["final"]["scaler"])
        for key in (k for k in oracle if k.startswith("state.")):
            np.testing.assert_array_equal(run[key], oracle[key], err_msg=key)
        np.testing.assert_allclose(
            run["params"], oracle["params"], rtol=worker.CASE.rtol, atol=worker.CASE.atol
        )
        for index, state in oracle["final"]["optimizer"]["state"].items():
            for key, value in state.items():
                actual = run["final"]["optimizer"]["state"][index][key]
                atol = 1e-5 * float(value.abs().max())
                torch.testing.assert_close(actual, value, rtol=0.0, atol=atol)


def test_the_restarted_group_resumed_from_the_last_checkpoint(elastic: dict[str, Any]) -> None:
    """Rank 1 died after step 4 of attempt 0; attempt 1 loaded the checkpoint written after
    step 3 and ran steps 4 to 7, with an overflow before the kill and one after it."""
    assert min(worker.FAULTS) < worker.KILL_AFTER < max(worker.FAULTS)
    kills = [(attempt, rank, e) for _, attempt, rank, e in elastic["events"] if "kill" in e]
    assert kills == [(0, worker.KILL_RANK, f"kill {worker.KILL_AFTER}")]
    checkpointed = worker.KILL_AFTER - worker.KILL_AFTER % worker.EVERY  # steps 0..3
    for run in elastic["ranks"]:
        assert run["environment"]["TORCHELASTIC_RESTART_COUNT"] == "1"
        assert run["resumed_from"] == checkpointed
        assert run["steps"].tolist() == list(range(checkpointed, worker.STEPS))
    ports = [
        {
            event.split()[1]
            for _, a, _, event in elastic["events"]
            if a == attempt and "start" in event
        }
        for attempt in (0, 1)
    ]
    assert len(ports[0]) == len(ports[1]) == 1 and ports[0] != ports[1]  # a fresh store
    steps_done = {
        (attempt, rank): event for _, attempt, rank, event in elastic["events"] if "step" in event
    }
    assert steps_done[(0, worker.KILL_RANK)] == f"step {worker.KILL_AFTER}"
    # The survivor went no further (it may be stopped before it logs the step it shares).
    assert steps_done[(0, 0)] in {f"step {worker.KILL_AFTER - 1}", f"step {worker.KILL_AFTER}"}


def test_the_resumed_run_ends_bit_identical_to_the_uninterrupted_one(
    elastic: dict[str, Any], oracle_and_standalone: dict[str, Any]
) -> None:
    """``torch.equal`` of model, optimizer and scaler state; the same steps after the resume."""
    first = elastic["ranks"][0]["steps"][0]
    for resumed, whole in zip(elastic["ranks"], oracle_and_standalone["ranks"], strict=True):
        for part in ("model", "optimizer", "scaler"):
            assert deep_equal(resumed["final"][part], whole["final"][part]), part
        for key in ("isfinite", "unchanged", "params", "state.loss_scale"):
            assert resumed[key].tobytes() == whole[key][first:].tobytes(), key
        assert not resumed["isfinite"][6 - first]  # the overflow after the kill


def test_the_survivor_was_gone_within_a_bound_and_nothing_hung(elastic: dict[str, Any]) -> None:
    """The restarted ranks started within :data:`SURVIVOR_BOUND_S` of the kill (torchrun
    restarts only once the old group is stopped); the whole launch had its deadline."""
    killed = next(t for t, _, _, event in elastic["events"] if event.startswith("kill"))
    restarted = min(t for t, attempt, _, e in elastic["events"] if attempt == 1 and "start" in e)
    assert 0 < restarted - killed < SURVIVOR_BOUND_S


def test_a_world_size_that_does_not_divide_the_batch_fails_on_every_rank_with_one_message(
    tmp_path: Path,
) -> None:
    """3 ranks for a batch of 8 (the worker) and of 32 (the demo): every rank prints one line
    and the job exits with status 2 well before any timeout."""
    runs = {}
    for name, target in (
        ("worker", [str(WORKER), str(tmp_path)]),
        ("demo", ["-m", "demo.distributed"]),
    ):
        out = tmp_path / name
        out.mkdir()
        runs[name] = Launch([[*standalone(3, out), *target]], out)
    expected = {
        "worker": r"rank (\d): WORLD_SIZE=3 does not divide the global batch of 8 rows; start a "
        r"world size that divides it",
        "demo": r"rank (\d): WORLD_SIZE=3 must divide the batch 32",
    }
    for name, launch in runs.items():
        seconds = launch.wait(succeed=False)
        output = launch.output()
        said = sorted(re.findall(rf"^(?:\[rank\d\]:)?{expected[name]}$", output, re.MULTILINE))
        assert said == ["0", "1", "2"], output[-8000:]
        assert re.search(r"exitcode\s*: 2 ", output), output[-8000:]
        assert "Timeout" not in output and "timed out" not in output, output[-8000:]
        print(f"{name} with 3 ranks: failed in {seconds:.1f} s")
        assert seconds < LAUNCH_TIMEOUT_S / 3


def test_the_demo_s_main_job_runs_under_torchrun(tmp_path: Path) -> None:
    """``torchrun --standalone --nproc-per-node 2 -m demo.distributed --front-door torch``
    (2 steps): the demo's own verdict against one process, and its decisions."""
    out = tmp_path / "demo"
    arguments = ["-m", "demo.distributed", "--front-door", "torch", "--steps", "2"]
    launch = Launch([[*standalone(2, tmp_path), *arguments, "--out-dir", str(out)]], tmp_path)
    seconds = launch.wait()
    print(f"demo under torchrun: {seconds:.1f} s")
    report = json.loads((out / "distributed.json").read_text())
    assert report["processes"] == 2 and report["verdict"]
    (door,) = report["front_doors"]
    assert door["ranks_bit_identical"] and door["same_decisions_on_every_rank_and_one_process"]
    assert [r["skipped"] for r in door["ranks"]] == [[False, True]] * 2  # rank 1's overflow
