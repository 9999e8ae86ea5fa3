"""Trainers on 2 processes with the facade's scaler: Lightning's ``strategy="ddp"``, accelerate
and the Hugging Face ``Trainer`` under torchrun, on the CPU over gloo on 127.0.0.1.

At step 2 rank 1 alone writes an inf into its gradient after DDP's all-reduce, before the
scaler unscales (``_trainer_worker.py``). With ``cstorch.amp.GradScaler`` both ranks skip that
step and end identical: ``torch.equal`` of parameters, optimizer state and scaler state across
ranks. The same run with ``torch.amp.GradScaler`` is the contrast: rank 1 skips and halves its
scale, rank 0 steps, and their parameters differ from then on. The oracles: scales and skips by
hand, and for Lightning and accelerate one process that computes each rank's share of every
step in turn and averages the two gradients as DDP does (exact: halving and one addition of two
float32 values), with torch's scaler; the facade's ranks must equal it bit for bit.

The launches, all started together by one module fixture and each bounded by
:data:`LAUNCH_TIMEOUT_S` (its process group is then killed and every rank's log shown):

* ``python _trainer_worker_lightning.py OUT``: Lightning's ``"ddp"`` (subprocess launcher)
  starts rank 1 by running the script again; ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``;
* ``torchrun --standalone --nproc-per-node 2 _trainer_worker_accelerate.py OUT``: an accelerate
  loop and ``Trainer.train``, each with both scalers;
* ``accelerate launch --cpu --num_processes 2`` and ``accelerate launch --multi_gpu
  --num_processes 2`` of a probe that reports how many processes started.

Each rank's collectives time out after ``_trainer_worker.TIMEOUT``, torchrun's rendezvous after
60 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import _trainer_worker as common
import pytest
import torch
from _ranks import free_port
from facade_helpers import deep_equal

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
LIGHTNING_WORKER = HERE / "_trainer_worker_lightning.py"
ACCELERATE_WORKER = HERE / "_trainer_worker_accelerate.py"
LAUNCH_TIMEOUT_S = 150.0
"""A launch still running after this long (from the common start) is killed and fails."""
RDZV_CONF = "join_timeout=60,read_timeout=60,close_timeout=10"
SCALES = [256.0, 256.0, 128.0, 128.0, 128.0]
"""By hand: ``2**8``, halved at the planted overflow of step 2, no growth within 5 steps."""
CHANGED = [step != common.POISON_STEP for step in range(common.STEPS)]
"""The parameters change at every step but the planted one."""
LAUNCHER_VARIABLES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"}
LAUNCHER_VARIABLES |= {"MASTER_ADDR", "MASTER_PORT", "NODE_RANK"}


def environment(home: Path, **extra: str) -> dict[str, str]:
    """A launch's environment: loopback gloo, one thread, JAX on the CPU, an empty Hugging Face
    home (no user accelerate config, nothing downloads), and no launcher variables inherited."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_VARIABLES and not k.startswith(("TORCHELASTIC_", "ACCELERATE_"))
    }
    env.update(
        JAX_PLATFORMS="cpu",
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        HF_HOME=str(home),
        HF_HUB_OFFLINE="1",
        **extra,
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


class Job:
    """One launch, in its own session, its output in ``out / "launch.log"``."""

    def __init__(self, command: list[str], out: Path, started: float, **env: str) -> None:
        self.out = out
        self.started = started
        with open(out / "launch.log", "wb") as log:
            self.proc = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                env=environment(out / "hf_home", **env),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.finished: float | None = None
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        self.proc.wait()
        self.finished = time.monotonic()

    def output(self) -> str:
        """The launcher's output and every rank's log."""
        logs = sorted(self.out.glob("*.log"))
        return "\n".join(f"--- {log.name} ---\n{log.read_text()[-4000:]}" for log in logs)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the launcher and every rank
            self.proc.wait()

    def wait(self) -> float:
        """Waits for the launch to succeed; its wall seconds from the common start to its exit.

        Raises:
            AssertionError: it ran past :data:`LAUNCH_TIMEOUT_S` or failed, with every log.
        """
        try:
            self.proc.wait(timeout=max(self.started + LAUNCH_TIMEOUT_S - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired as timeout:
            self.kill()
            raise AssertionError(
                f"launch ran past {LAUNCH_TIMEOUT_S} s:\n{self.output()}"
            ) from timeout
        if self.proc.returncode != 0:
            raise AssertionError(f"launch exited with {self.proc.returncode}:\n{self.output()}")
        while self.finished is None:  # the watcher notes the time it saw the exit
            time.sleep(0.01)
        return self.finished - self.started


def accelerate_launch(*options: str) -> list[str]:
    """``accelerate launch OPTIONS`` of the probe, as ``python -m``."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines=1"]
    launch += ["--mixed_precision=no", "--dynamo_backend=no", *options]
    return launch


class Launches(NamedTuple):
    jobs: dict[str, Job]
    """The launches by name: ``lightning``, ``torchrun``, ``cpu`` and ``gpu`` (the probes)."""
    oracles: dict[str, dict[str, Any]]
    """``lightning`` and ``accelerate``: the one-process run (:func:`one_process`)."""


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launches]:
    """Every launch, started together (their start-up overlaps), killed at the end if alive;
    the one-process oracles are computed meanwhile."""
    out = {name: tmp_path_factory.mktemp(name) for name in ("lightning", "torchrun", "cpu", "gpu")}
    started = time.monotonic()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc-per-node=2", "--local-addr=127.0.0.1", f"--rdzv-conf={RDZV_CONF}"]
    port = str(free_port())
    launched = {
        "lightning": Job(
            [sys.executable, str(LIGHTNING_WORKER), str(out["lightning"])],
            out["lightning"],
            started,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        ),
        "torchrun": Job(
            [*torchrun, str(ACCELERATE_WORKER), str(out["torchrun"])], out["torchrun"], started
        ),
        "cpu": Job(
            [
                *accelerate_launch("--cpu", "--num_processes=2"),
                *(str(ACCELERATE_WORKER), "--probe", str(out["cpu"])),
            ],
            out["cpu"],
            started,
        ),
        "gpu": Job(
            [
                *accelerate_launch(
                    "--multi_gpu",
                    "--num_processes=2",
                    "--main_process_ip=127.0.0.1",
                    f"--main_process_port={free_port()}",
                ),
                *(str(ACCELERATE_WORKER), "--probe", str(out["gpu"])),
            ],
            out["gpu"],
            started,
        ),
    }
    try:
        oracles = {
            "lightning": one_process(lightning_shares, clip=None),
            "accelerate": one_process(accelerate_shares, clip=10.0),
        }
        yield Launches(launched, oracles)
    finally:
        for job in launched.values():
            job.kill()


def ranks_of(job: Job) -> list[dict[str, Any]]:
    """Every rank's saved record (our own files)."""
    job.wait()
    return [torch.load(job.out / f"rank{r}.pt", weights_only=False) for r in range(common.WORLD)]


@pytest.fixture(scope="module")
def jobs(launches: Launches) -> dict[str, Job]:
    return launches.jobs


@pytest.fixture(scope="module")
def runs(jobs: dict[str, Job]) -> dict[str, list[dict[str, Any]]]:
    """``trainer.scaler`` -> the record of each rank."""
    lightning, torchrun = ranks_of(jobs["lightning"]), ranks_of(jobs["torchrun"])
    found = {}
    for name in common.SCALERS:
        found[f"lightning.{name}"] = [rank[name] for rank in lightning]
        for trainer in ("accelerate", "trainer"):
            found[f"{trainer}.{name}"] = [rank[f"{trainer}.{name}"] for rank in torchrun]
    for name in ("lightning", "torchrun"):
        print(f"{name} launch: {jobs[name].wait():.1f} s")
    return found


# ----------------------------------------------------------------------------- the oracle


def lightning_shares(step: int) -> list[list[int]]:
    """The rows each rank trains on at ``step``: Lightning replaces a training loader's sampler
    with ``DistributedSampler(shuffle=True, seed=0)`` (it shuffles even a sequential loader)."""
    size, shares = common.ROWS_PER_RANK, []
    for rank in range(common.WORLD):
        sampler = torch.utils.data.DistributedSampler(
            common.dataset(), num_replicas=common.WORLD, rank=rank, shuffle=True, seed=0
        )
        shares.append(list(sampler)[step * size : (step + 1) * size])
    return shares


def accelerate_shares(step: int) -> list[list[int]]:
    """accelerate's prepared loader gives each rank whole batches in turn."""
    first = step * common.WORLD * common.ROWS_PER_RANK
    size = common.ROWS_PER_RANK
    return [list(range(first + r * size, first + (r + 1) * size)) for r in range(common.WORLD)]


def one_process(shares: Any, clip: float | None) -> dict[str, Any]:
    """Both ranks' work in this process, with torch's scaler: per step, each rank's share in
    turn (fp16 autocast, its mean loss scaled and backpropagated), the gradients summed and
    halved as DDP's all-reduce does, the inf planted, then ``unscale_`` (and clipping),
    ``step`` and ``update`` of one scaler."""
    torch.manual_seed(0)
    net = common.make_net()
    optimizer = torch.optim.Adam(net.parameters(), lr=common.LEARNING_RATE)
    scaler = common.make_scaler("torch")
    x, y = common.dataset().tensors
    changed, scales = [], []
    for step in range(common.STEPS):
        before = common.params_of(net)
        optimizer.zero_grad()
        for rows in shares(step):
            with torch.autocast("cpu", dtype=torch.float16):
                out = net(x[rows])
            scaler.scale(torch.nn.functional.mse_loss(out.float(), y[rows])).backward()
        with torch.no_grad():
            for param in net.parameters():
                assert param.grad is not None
                param.grad.div_(common.WORLD)
        if step == common.POISON_STEP:
            common.plant_inf(net)
        scaler.unscale_(optimizer)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
        changed.append(not common.same(before, common.params_of(net)))
        scales.append(float(scaler.get_scale()))
    return {
        "changed": changed,
        "scales": scales,
        "final": common.final_state(net, optimizer, scaler),
    }


# ----------------------------------------------------------------------------- the tests


def test_lightning_ddp_started_rank_1_by_running_the_script_again(
    jobs: dict[str, Job],
) -> None:
    """``strategy="ddp"`` is ``DDPStrategy(start_method="popen")``; rank 0 (the script the test
    started) started rank 1 itself with the same command line, both on 127.0.0.1."""
    first, second = ranks_of(jobs["lightning"])
    assert first["ddp"] == {"strategy": "DDPStrategy", "start_method": "popen"}
    for rank, run in enumerate((first, second)):
        for name in common.SCALERS:
            assert run[name]["strategy"] == "DDPStrategy", name
            assert run[name]["launcher"] == "_SubprocessScriptLauncher", name
            assert (run[name]["rank"], run[name]["world"]) == (rank, common.WORLD), name
        assert run["environment"]["MASTER_ADDR"] == "127.0.0.1"
    assert first["facade"]["children"] == [second["pid"]]  # the first fit started it
    assert first["torch"]["children"] == []  # the second fit reused the processes
    assert second["ppid"] == first["pid"]
    assert Path(second["argv"][0]) == Path(first["argv"][0]).resolve() == LIGHTNING_WORKER
    assert second["argv"][1:] == first["argv"][1:]


@pytest.mark.parametrize("trainer", ["lightning", "accelerate", "trainer"])
def test_with_the_facade_scaler_both_ranks_skip_the_step_and_end_identical(
    runs: dict[str, list[dict[str, Any]]], trainer: str
) -> None:
    """Rank 1 alone held the inf; both ranks skipped step 2, halved the scale, and end with
    bit-identical parameters, optimizer state and scaler state."""
    first, second = runs[f"{trainer}.facade"]
    for rank, run in enumerate((first, second)):
        assert run["changed"] == CHANGED, rank
        assert run["scales"] == SCALES, rank
        assert run["hidden_dtypes"] == [torch.float16] * common.STEPS, rank  # fp16 autocast
        assert int(run["final"]["scaler"]["num_skipped_steps"]) == 1, rank
    if trainer == "accelerate":
        for run in (first, second):
            assert run["skipped"] == [not c for c in CHANGED]
            assert (run["distributed_type"], run["model_type"]) == (
                "DistributedType.MULTI_CPU",
                "DistributedDataParallel",
            )
    for part in ("model", "optimizer", "scaler"):
        assert deep_equal(first["final"][part], second["final"][part]), part


@pytest.mark.parametrize("trainer", ["lightning", "accelerate", "trainer"])
def test_with_torch_s_scaler_the_ranks_diverge(
    runs: dict[str, list[dict[str, Any]]], trainer: str
) -> None:
    """The contrast: rank 1 skipped step 2 and halved its scale, rank 0 stepped with the
    all-reduced gradients and kept its scale; their parameters differ from then on."""
    first, second = runs[f"{trainer}.torch"]
    assert first["changed"] == [True] * common.STEPS
    assert first["scales"] == [common.INIT_SCALE] * common.STEPS
    assert second["changed"] == CHANGED
    assert second["scales"] == SCALES
    if trainer == "accelerate":
        assert first["skipped"] == [False] * common.STEPS
        assert second["skipped"] == [not c for c in CHANGED]
    params = [list(run["final"]["model"].values()) for run in (first, second)]
    assert not any(torch.equal(a, b) for a, b in zip(*params, strict=True))
    assert first["final"]["scaler"]["scale"] != second["final"]["scaler"]["scale"]
    assert not deep_equal(first["final"]["optimizer"], second["final"]["optimizer"])


@pytest.mark.parametrize("trainer", ["lightning", "accelerate"])
def test_the_facade_s_ranks_equal_one_process_bit_for_bit(
    launches: Launches, runs: dict[str, list[dict[str, Any]]], trainer: str
) -> None:
    """Each rank equals one process doing both ranks' work with torch's scaler: the same
    skips and scales, and ``torch.equal`` parameters and Adam state."""
    oracle = launches.oracles[trainer]
    assert oracle["changed"] == CHANGED and oracle["scales"] == SCALES
    shares = {"lightning": lightning_shares, "accelerate": accelerate_shares}[trainer]
    targets = common.dataset().tensors[1]
    for rank, run in enumerate(runs[f"{trainer}.facade"]):
        for step, seen in enumerate(run["targets"]):  # the rows the oracle gives this rank
            assert torch.equal(seen, targets[shares(step)[rank]]), (rank, step)
        assert deep_equal(run["final"]["model"], oracle["final"]["model"]), rank
        assert deep_equal(run["final"]["optimizer"], oracle["final"]["optimizer"]), rank


def test_the_trainer_ran_on_two_processes_with_its_defaults(
    runs: dict[str, list[dict[str, Any]]],
) -> None:
    """``Trainer(use_cpu=True)`` under torchrun: ``MULTI_CPU``, rank and world from torchrun,
    its default fused AdamW, with either scaler."""
    for name in common.SCALERS:
        for rank, run in enumerate(runs[f"trainer.{name}"]):
            assert run["distributed_type"] == "DistributedType.MULTI_CPU"
            assert (run["rank"], run["world"]) == (rank, common.WORLD)
            assert run["optim"] == "OptimizerNames.ADAMW_TORCH_FUSED"


def probes(job: Job) -> list[dict[str, Any]]:
    """What each process the launch started reported."""
    job.wait()
    seen = [json.loads(path.read_text()) for path in sorted(job.out.glob("probe*.json"))]
    return sorted(seen, key=lambda probe: probe["process_index"])


def test_accelerate_launch_cpu_starts_one_process_whatever_num_processes_says(
    jobs: dict[str, Job],
) -> None:
    """``accelerate launch --cpu --num_processes 2`` runs the script once, alone
    (huggingface/accelerate#2741): ``--cpu`` takes its simple launcher."""
    (alone,) = probes(jobs["cpu"])
    assert alone["num_processes"] == 1
    assert alone["distributed_type"] == "DistributedType.NO"
    print(f"accelerate launch --cpu: {jobs['cpu'].wait():.1f} s")


def test_accelerate_launch_multi_gpu_starts_two_processes_on_the_cpu(
    jobs: dict[str, Job],
) -> None:
    """``accelerate launch --multi_gpu --num_processes 2`` runs torchrun underneath, which is
    indifferent to devices: with ``cpu=True`` in the script, two gloo ranks."""
    seen = probes(jobs["gpu"])
    assert [probe["process_index"] for probe in seen] == [0, 1]
    for probe in seen:
        assert probe["num_processes"] == 2
        assert probe["distributed_type"] == "DistributedType.MULTI_CPU"
    print(f"accelerate launch --multi_gpu: {jobs['gpu'].wait():.1f} s")
