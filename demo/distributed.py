"""``python -m demo --nproc 2``: the GPT of ``make demo`` trained on several processes.

Each front door trains the demo's GPT-2 (the corpus of :mod:`demo.text`, the weights and
learning-rate schedule of :mod:`workbench.byte_gpt`) in float16 with dynamic loss scaling on ``--nproc`` local processes,
every process taking its contiguous share of each step's batch:

* **torch**: ``DistributedDataParallel`` over gloo (``--fsdp2``: FSDP2's ``fully_shard``
  instead), ``cstorch.amp.GradScaler(loss_scale="dynamic")``, ``torch.optim.AdamW``;
* **JAX**: ``jax.distributed`` (a local coordinator, gloo collectives on the CPU), the flax NNX
  GPT with ``amp_core.flax_nnx.LossScaledOptimizer`` in one jitted step over a ``"data"`` mesh
  of every process's device (parameters replicated, the batch sharded).

The loss scale starts at ``2**12`` with a ceiling of ``2**14`` and grows after
``STEPS_PER_INCREASE + 1`` steps, so it moves during the run. At ``--overflow-step`` one rank
alone (rank 1) meets an overflow:

* torch: rank 1 writes ``inf`` into one element of its gradients *after* DDP's all-reduce
  (FSDP2: into its own shard), so rank 0's gradients are finite; only the scaler's collective
  decision makes rank 0 skip too;
* JAX: one of rank 1's rows carries an infinite loss weight, so its share of the gradient is
  infinite; the gradient's reduction over the processes carries it into every process's
  step, as SPMD does.

Every rank records its decisions (skipped, scale) per step and its final parameters; the
parent process (or rank 0 under ``torchrun``) then trains the same model in one process on the
whole batch (with the same overflow at the same step) and compares:

* the decisions: the same on every rank and in the one process;
* the parameters: bit-identical between ranks; against the one process, within float32
  reduction order. In float16 that cannot be checked bit for bit (each rank sums its half of
  the batch, and a float16 rounding of a partial sum is not the rounding of the whole sum), so
  the one process is also run on the *same* batch with its rows in reverse order, which changes
  nothing but the order of the reductions: its distance to the one process is the yardstick,
  and the ranks must stay within ``TOLERANCE_FACTOR`` times it.

``python -m demo.distributed --help`` lists the options; ``torchrun --nproc-per-node 2 -m
demo.distributed --front-door torch`` runs the torch door under torchrun (rank 0 reports).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pickle
import platform
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from demo.text import load_corpus, training_windows
from workbench.byte_gpt import Settings
from workbench.processes import REPO_ROOT, free_port, repo_environment
from workbench.tables import markdown_table

STEPS = 40
"""Training steps of ``python -m demo --nproc N`` (the default)."""

INIT_SCALE = 2.0**12
"""The loss scale of the first step."""

MAX_LOSS_SCALE = 2.0**14
"""The ceiling of the loss scale: the scale grows twice, then stays, until the overflow."""

STEPS_PER_INCREASE = 4
"""The scale doubles after ``STEPS_PER_INCREASE + 1`` steps without an overflow."""

OVERFLOW_STEP = 25
"""The step at which rank 1 meets an overflow (0-based; the default)."""

OVERFLOW_RANK = 1
"""The rank that meets the overflow."""

TOLERANCE_FACTOR = 3.0
"""The ranks' parameters may differ from the one process by this many times the one process's
own largest difference to its :data:`YARDSTICKS` runs (see the module docstring)."""

DOORS = ("torch", "jax")
TIMEOUT_S = 600
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every process of one front door trains.

    Attributes:
        steps: optimizer steps.
        seed: seed of the weights and of the batches (as ``make demo``).
        overflow_step: the step at which rank :data:`OVERFLOW_RANK` meets an overflow (``-1``:
            none).
        fsdp2: torch only: FSDP2 (``fully_shard``) instead of DDP.
    """

    steps: int = STEPS
    seed: int = 0
    overflow_step: int = OVERFLOW_STEP
    fsdp2: bool = False

    @property
    def settings(self) -> Settings:
        """The demo's settings for this run (model size, batch, learning-rate schedule)."""
        return Settings(steps=self.steps, seed=self.seed)


@dataclasses.dataclass
class Record:
    """What one training process reports.

    Attributes:
        rank: the process's rank (0 for a one-process run).
        world: the number of processes.
        skipped: per step, whether the step was skipped.
        scales: per step, the loss scale the step used.
        final_scale: the loss scale after the last step.
        params: the final float32 parameters by name.
        seconds: wall time of the training loop (after start-up).
    """

    rank: int
    world: int
    skipped: list[bool]
    scales: list[float]
    final_scale: float
    params: dict[str, np.ndarray]
    seconds: float

    def decisions(self) -> list[tuple[bool, float]]:
        """``(skipped, scale)`` per step, then ``(False, final_scale)``."""
        return [*zip(self.skipped, self.scales, strict=True), (False, self.final_scale)]


def rows_of(rank: int, world: int, batch_size: int) -> slice:
    """The contiguous rows of a step's batch that ``rank`` of ``world`` trains on.

    Raises:
        ValueError: ``world`` does not divide ``batch_size``.
    """
    if batch_size % world:
        raise ValueError(f"nproc must divide the batch size {batch_size}; got nproc={world}")
    share = batch_size // world
    return slice(rank * share, (rank + 1) * share)


def overflow_row(world: int, batch_size: int) -> int:
    """The row of the whole batch whose loss weight is infinite at the overflow step (JAX): the
    first of rank :data:`OVERFLOW_RANK`'s rows (any row in one process)."""
    return rows_of(OVERFLOW_RANK, world, batch_size).start if world > 1 else 0


def step_batches(plan: Plan, reverse: bool = False) -> np.ndarray:
    """Every step's whole batch, ``(steps, batch, n_positions + 1)`` (rows reversed if asked)."""
    batches = training_windows(load_corpus(), plan.settings)
    return batches[:, ::-1].copy() if reverse else batches


# ---------------------------------------------------------------------------------------------
# torch


def train_torch(
    plan: Plan, rank: int, world: int, reverse: bool = False, micro_batches: int = 1
) -> Record:
    """Trains the torch door's GPT as ``rank`` of ``world`` (a process group of ``world``
    ranks must be initialised when ``world > 1``).

    Args:
        plan: steps, seed, overflow step, DDP or FSDP2.
        rank: this process's rank.
        world: the number of ranks (1: one process on the whole batch).
        reverse: one process only: the batch's rows in reverse order.
        micro_batches: one process only: the batch in this many equal micro-batches (the ranks'
            shares), their gradients accumulated, one optimizer step.

    Returns:
        This rank's :class:`Record`.
    """
    import torch

    import torch_facade as cstorch
    from demo.torch_door import cross_entropy, make_model, numerics

    torch.set_num_threads(1)
    settings = plan.settings
    batches = step_batches(plan, reverse)
    rows = rows_of(rank, world, settings.batch_size)
    model = make_model(settings.size, settings.seed)
    skipped: list[bool] = []
    scales: list[float] = []
    with numerics(model, "float16"):
        trained: torch.nn.Module = model
        if world > 1 and plan.fsdp2:
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)  # in place: the model's parameters become its shards
        elif world > 1:
            trained = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(
            trained.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay
        )
        scaler = cstorch.amp.GradScaler(
            loss_scale="dynamic",
            init_scale=INIT_SCALE,
            max_loss_scale=MAX_LOSS_SCALE,
            steps_per_increase=STEPS_PER_INCREASE,
        )
        first = next(iter(trained.parameters()))
        start = time.perf_counter()
        for step in range(plan.steps):
            applied = step - sum(skipped)  # the schedule counts applied steps, as the demo's
            for group in optimizer.param_groups:
                group["lr"] = float(settings.learning_rate_at(applied))
            scales.append(float(scaler.get_scale()))
            optimizer.zero_grad()
            for part in np.split(batches[step][rows], micro_batches):
                loss = cross_entropy(trained, torch.from_numpy(part)) / micro_batches
                scaler.scale(loss).backward()
            if step == plan.overflow_step and (rank == OVERFLOW_RANK or world == 1):
                grad = first.grad
                assert grad is not None  # every parameter takes part in the loss
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                local.view(-1)[0] = float("inf")  # after DDP's all-reduce: this rank only
            scaler.step(optimizer)
            scaler.update()
            skipped.append(not bool(scaler.get_isfinite()))
        seconds = time.perf_counter() - start
        params = {}
        for name, param in trained.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            params[name.removeprefix("module.")] = full.detach().numpy().copy()
    return Record(rank, world, skipped, scales, float(scaler.get_scale()), params, seconds)


def torch_rank(plan: Plan, rank: int, world: int, port: int | None) -> Record:
    """One torch rank: joins the gloo group (``port`` None: from torchrun's environment),
    trains, leaves."""
    import torch.distributed as dist

    if port is None:
        dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    else:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=COLLECTIVE_TIMEOUT,
        )
    try:
        return train_torch(plan, rank, world)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# JAX


_JAX_STEPS: dict[tuple[Any, ...], tuple[Any, Any]] = {}
"""One graph definition and jitted step per (settings, micro-batches, world): the one-process
runs on the whole batch and on its rows reversed train the same program, so they share its
compilation (each fresh optimizer holds new optax closures in its graph definition, which a
jitted step takes as a static argument)."""


def train_jax(
    plan: Plan, rank: int, world: int, reverse: bool = False, micro_batches: int = 1
) -> Record:
    """Trains the JAX door's GPT as process ``rank`` of ``world`` (``jax.distributed`` must be
    initialised when ``world > 1``); see :func:`train_torch`."""
    import jax
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import amp_core
    from amp_core.flax_nnx import LossScaledOptimizer
    from workbench.byte_gpt_jax import GPT, adamw

    settings = plan.settings
    batches = step_batches(plan, reverse)
    rows = rows_of(rank, world, settings.batch_size)
    bad_row = overflow_row(world, settings.batch_size)
    devices = jax.devices() if world > 1 else jax.devices()[:1]
    mesh = Mesh(np.array(devices), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    by_row = NamedSharding(mesh, PartitionSpec("data"))

    model = GPT(settings.size, settings.seed, "float16")
    config = amp_core.DynamicLossScale(
        half_dtype="float16",
        init_scale=INIT_SCALE,
        max_loss_scale=MAX_LOSS_SCALE,
        steps_per_increase=STEPS_PER_INCREASE,
    )
    optimizer = LossScaledOptimizer(model, adamw(settings), config, wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    state = jax.tree.map(
        lambda a: jax.make_array_from_process_local_data(replicated, np.asarray(a)), state
    )
    key = (settings, micro_batches, world)
    if key not in _JAX_STEPS:
        _JAX_STEPS[key] = (graphdef, _jax_step(replicated, micro_batches))
    graphdef, step = _JAX_STEPS[key]

    def global_rows(value: np.ndarray) -> jax.Array:
        return jax.make_array_from_process_local_data(by_row, value[rows], value.shape)

    skipped: list[bool] = []
    scales: list[float] = []
    start = time.perf_counter()
    for index in range(plan.steps):
        weights = np.ones(settings.batch_size, np.float32)
        if index == plan.overflow_step:
            weights[bad_row] = np.inf  # one row of rank 1's share
        state, scale, skip = step(
            graphdef, state, global_rows(batches[index]), global_rows(weights)
        )
        scale, skip = (np.asarray(x.addressable_shards[0].data) for x in (scale, skip))
        scales.append(float(scale))
        skipped.append(bool(skip))
    seconds = time.perf_counter() - start
    model, optimizer = nnx.merge(graphdef, state)
    params = {
        jax.tree_util.keystr(path): np.asarray(leaf.addressable_shards[0].data).copy()
        for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    }
    final = np.asarray(optimizer.scaler.loss_scale.addressable_shards[0].data)
    return Record(rank, world, skipped, scales, float(final), params, seconds)


def _jax_step(replicated: Any, micro_batches: int) -> Any:
    """:func:`train_jax`'s jitted step: the scaled loss's gradients (summed over
    ``micro_batches`` shares of the batch), the loss-scaled update, the loss scale it used and
    whether it skipped."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from workbench.byte_gpt_jax import GPT

    def weighted_loss(m: GPT, windows: jax.Array, weights: jax.Array) -> jax.Array:
        logits = m(windows[:, :-1]).astype(jnp.float32)
        tokens = optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:])
        return jnp.mean(tokens.mean(axis=1) * weights)

    def step_fn(graphdef: Any, state: Any, windows: jax.Array, weights: jax.Array) -> Any:
        m, opt = nnx.merge(graphdef, state)
        scale = opt.scaler.loss_scale

        def loss_of(m: GPT, part: slice) -> jax.Array:
            return weighted_loss(m, windows[part], weights[part]) / micro_batches

        share = windows.shape[0] // micro_batches
        grads = nnx.grad(lambda m: opt.scale_loss(loss_of(m, slice(0, share))))(m)
        for index in range(1, micro_batches):  # accumulated, as a one-process user sums them
            part = slice(index * share, (index + 1) * share)
            more = nnx.grad(lambda m, part=part: opt.scale_loss(loss_of(m, part)))(m)
            grads = jax.tree.map(jnp.add, grads, more)
        isfinite = opt.update(m, grads)
        return nnx.state((m, opt)), scale, ~isfinite

    return jax.jit(step_fn, static_argnums=0, out_shardings=replicated, donate_argnums=1)


def jax_rank(plan: Plan, rank: int, world: int, port: int) -> Record:
    """One JAX process: joins the job (this process's CPU device, gloo collectives), trains,
    leaves."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=world,
        process_id=rank,
        initialization_timeout=120,
    )
    try:
        return train_jax(plan, rank, world)
    finally:
        jax.distributed.shutdown()


# ---------------------------------------------------------------------------------------------
# the comparison


YARDSTICKS = ("reversed rows", "accumulated shares")
"""The one process's runs on the same batch that differ from it only in rounding order: its
rows reversed (float32 reduction order), and the ranks' shares as micro-batches whose
gradients are summed (float16 roundings of partial sums, as data parallelism rounds them)."""


@dataclasses.dataclass
class DoorReport:
    """One front door's ranks against one process.

    Attributes:
        door: ``"torch"`` or ``"jax"``.
        wrapper: how the ranks were joined (``"DDP"``, ``"FSDP2"``, ``"jax.distributed"``).
        ranks: every rank's record, by rank.
        one: the one-process run on the whole batch.
        yardsticks: the one-process runs of :data:`YARDSTICKS`, by name.
    """

    door: str
    wrapper: str
    ranks: list[Record]
    one: Record
    yardsticks: dict[str, Record]

    @property
    def ranks_decide_alike(self) -> bool:
        """Every rank took the one process's decisions (skip and scale, every step)."""
        return all(r.decisions() == self.one.decisions() for r in self.ranks)

    @property
    def ranks_bit_identical(self) -> bool:
        """Every rank ends with rank 0's parameters, bit for bit."""
        return all(same_bits(r.params, self.ranks[0].params) for r in self.ranks)

    @property
    def distance(self) -> float:
        """The norm of the difference between rank 0's and the one process's parameters."""
        return difference(self.ranks[0].params, self.one.params)

    @property
    def self_differences(self) -> dict[str, float]:
        """The one process's distance to each of its :attr:`yardsticks` runs."""
        return {k: difference(r.params, self.one.params) for k, r in self.yardsticks.items()}

    @property
    def tolerance(self) -> float:
        """:data:`TOLERANCE_FACTOR` times the largest of :attr:`self_differences`."""
        return TOLERANCE_FACTOR * max(self.self_differences.values())

    @property
    def within_tolerance(self) -> bool:
        """The ranks' distance to the one process is within :attr:`tolerance`."""
        return self.distance <= self.tolerance

    @property
    def equals_accumulated(self) -> bool:
        """Rank 0's parameters are those of one process accumulating the ranks' shares, bit
        for bit (information: not part of the verdict)."""
        return same_bits(self.ranks[0].params, self.yardsticks["accumulated shares"].params)

    @property
    def verdict(self) -> bool:
        """Same decisions everywhere, ranks bit-identical, parameters within tolerance."""
        return self.ranks_decide_alike and self.ranks_bit_identical and self.within_tolerance

    def as_json(self) -> dict[str, Any]:
        """The report as a JSON object (parameters left out)."""

        def run(record: Record) -> dict[str, Any]:
            return {
                "rank": record.rank,
                "world": record.world,
                "skipped": record.skipped,
                "loss_scale": record.scales,
                "final_loss_scale": record.final_scale,
                "train_seconds": record.seconds,
            }

        return {
            "front_door": self.door,
            "wrapper": self.wrapper,
            "ranks": [run(r) for r in self.ranks],
            "one_process": run(self.one),
            "same_decisions_on_every_rank_and_one_process": self.ranks_decide_alike,
            "ranks_bit_identical": self.ranks_bit_identical,
            "difference_to_one_process": self.distance,
            "relative_difference_to_one_process": self.distance / norm(self.one.params),
            "one_process_self_differences": self.self_differences,
            "tolerance": self.tolerance,
            "within_tolerance": self.within_tolerance,
            "bit_identical_to_one_process_accumulating_the_shares": self.equals_accumulated,
            "verdict": self.verdict,
        }


def same_bits(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    """Whether two parameter sets have the same names and the same bits."""
    return a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


def norm(params: dict[str, np.ndarray]) -> float:
    """The Euclidean norm of all parameters as one vector (in float64)."""
    return float(np.sqrt(sum(np.sum(p.astype(np.float64) ** 2) for p in params.values())))


def difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """The Euclidean norm of the difference of two parameter sets with the same names (all
    parameters as one vector, in float64).

    Raises:
        ValueError: the names differ.
    """
    if a.keys() != b.keys():
        raise ValueError(f"parameter names differ: {sorted(a.keys() ^ b.keys())}")
    return float(np.sqrt(sum(np.sum((a[k].astype(np.float64) - b[k]) ** 2) for k in a)))


def _scale(value: float) -> str:
    exponent = np.log2(value)
    return f"2^{exponent:.0f}" if exponent == round(exponent) else f"{value:g}"


def decision_table(report: DoorReport) -> list[str]:
    """Markdown rows: per step, every rank's and the one process's skip and scale."""
    runs = [*report.ranks, report.one]
    names = [f"rank {r.rank}" for r in report.ranks] + ["one process"]
    rows = [
        [str(step), *(("skip " if r.skipped[step] else "") + _scale(r.scales[step]) for r in runs)]
        for step in range(len(report.one.skipped))
    ]
    rows.append(["end", *(_scale(r.final_scale) for r in runs)])
    return markdown_table(["step", *names], rows, ["r"] + ["l"] * len(names))


def summary_lines(report: DoorReport) -> list[str]:
    """The door's verdict lines."""
    world = len(report.ranks)
    skips = [i for i, s in enumerate(report.one.skipped) if s]
    yes = {True: "yes", False: "NO"}
    own = ", ".join(f"{k} {v:.3g}" for k, v in report.self_differences.items())
    return [
        f"{report.door} ({report.wrapper}, {world} ranks): skipped steps {skips}, loss scale "
        f"{_scale(min(report.one.scales))} to {_scale(max(report.one.scales))}",
        f"  same decisions on every rank and as one process: {yes[report.ranks_decide_alike]}",
        f"  ranks' parameters bit-identical: {yes[report.ranks_bit_identical]}",
        f"  parameters' distance to one process on the whole batch: {report.distance:.3g} "
        f"({report.distance / norm(report.one.params):.2e} of their norm) "
        f"(norm of the difference; one process against itself: {own}; within "
        f"{TOLERANCE_FACTOR:g}x: {yes[report.within_tolerance]})",
        "  bit-identical to one process accumulating the ranks' shares: "
        f"{yes[report.equals_accumulated].lower()}",
    ]


def write_outputs(
    reports: Sequence[DoorReport], out_dir: Path, header: list[str], meta: dict[str, Any]
) -> list[Path]:
    """Writes ``distributed.md`` and ``distributed.json`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [*header]
    for report in reports:
        lines += ["", f"## {report.door}: {report.wrapper}", ""]
        lines += [f"* {line.strip()}" for line in summary_lines(report)]
        lines += ["", *decision_table(report)]
    markdown = out_dir / "distributed.md"
    markdown.write_text("\n".join(lines) + "\n", encoding="utf-8")
    document = {**meta, "front_doors": [r.as_json() for r in reports]}
    path = out_dir / "distributed.json"
    path.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    return [markdown, path]


# ---------------------------------------------------------------------------------------------
# processes


def _child_env() -> dict[str, str]:
    env = repo_environment(JAX_PLATFORMS="cpu", OMP_NUM_THREADS="1")
    flags = env.get("XLA_FLAGS", "").split()  # one CPU device per process
    env["XLA_FLAGS"] = " ".join(f for f in flags if "host_platform_device_count" not in f)
    return env


def run_ranks(door: str, plan: Plan, world: int, work: Path) -> list[Record]:
    """Starts ``world`` local processes of ``door`` and returns their records, by rank.

    Raises:
        RuntimeError: a process failed or ran past :data:`TIMEOUT_S` (with its output's tail).
    """
    port = free_port()
    procs = []
    for rank in range(world):
        command = [
            *(sys.executable, "-m", "demo.distributed", "--steps", str(plan.steps)),
            *("--seed", str(plan.seed), "--overflow-step", str(plan.overflow_step)),
            *("--worker", door, "--rank", str(rank), "--world", str(world)),
            *("--port", str(port), "--result", str(work / f"{door}{rank}.pkl")),
            *(["--fsdp2"] if plan.fsdp2 else []),
        ]
        with open(work / f"{door}{rank}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    command, env=_child_env(), cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT
                )
            )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [rank for rank, proc in enumerate(procs) if proc.returncode != 0]
    if failed:
        logs = [(work / f"{door}{rank}.log").read_text(errors="replace")[-3000:] for rank in failed]
        raise RuntimeError(f"{door} rank(s) {failed} failed:\n" + "\n".join(logs))
    records = []
    for rank in range(world):
        with open(work / f"{door}{rank}.pkl", "rb") as f:
            records.append(Record(**pickle.load(f)))
    return records


def one_process(door: str, plan: Plan, world: int) -> tuple[Record, dict[str, Record]]:
    """The one-process runs of ``door``: the whole batch, and its :data:`YARDSTICKS`."""
    train = train_torch if door == "torch" else train_jax
    one = train(plan, 0, 1)
    reversed_rows = train(plan, 0, 1, reverse=True)
    accumulated = train(plan, 0, 1, micro_batches=world)
    return one, dict(zip(YARDSTICKS, (reversed_rows, accumulated), strict=True))


def wrapper_name(door: str, plan: Plan) -> str:
    """How ``door``'s ranks are joined."""
    if door == "jax":
        return "jax.distributed"
    return "FSDP2 (fully_shard)" if plan.fsdp2 else "DDP"


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run(
    plan: Plan,
    world: int,
    doors: Sequence[str],
    out_dir: Path,
    command: str,
) -> list[DoorReport]:
    """Trains every door on ``world`` local processes and in one process, prints the
    comparison and writes ``distributed.md`` and ``distributed.json`` into ``out_dir``.

    Returns:
        One :class:`DoorReport` per door.
    """
    start, cpu = time.perf_counter(), _cpu_seconds()
    reports = []
    with tempfile.TemporaryDirectory(prefix="demo_distributed_") as work:
        for door in doors:
            door_start = time.perf_counter()
            print(f"{door}: {world} processes, {plan.steps} steps ...", flush=True)
            ranks = run_ranks(door, plan, world, Path(work))
            print(f"{door}: one process on the whole batch ...", flush=True)
            one, yardsticks = one_process(door, plan, world)
            reports.append(DoorReport(door, wrapper_name(door, plan), ranks, one, yardsticks))
            print(f"\n{door}: took {time.perf_counter() - door_start:.0f} s")
            print("\n".join(decision_table(reports[-1])))
            print("\n".join(summary_lines(reports[-1])) + "\n", flush=True)
    return finish(reports, plan, world, out_dir, command, start, cpu)


def finish(
    reports: list[DoorReport],
    plan: Plan,
    world: int,
    out_dir: Path,
    command: str,
    start: float,
    cpu: float,
) -> list[DoorReport]:
    """Writes the outputs and prints the closing lines."""
    elapsed, cpu_used = time.perf_counter() - start, _cpu_seconds() - cpu
    size = plan.settings.size
    header = [
        f"# The main job on {world} processes: one decision on every rank",
        "",
        f"`{command}`, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs; took {elapsed:.0f} s "
        f"({cpu_used:.0f} s of CPU, all processes).",
        "",
        f"GPT-2 of `make demo` ({size.n_layer} layers, width {size.n_embd}), float16 with "
        f"dynamic loss scaling (start {_scale(INIT_SCALE)}, ceiling {_scale(MAX_LOSS_SCALE)}, "
        f"doubling after {STEPS_PER_INCREASE + 1} steps), batch {plan.settings.batch_size} "
        f"split between {world} ranks, {plan.steps} steps, seed {plan.seed}; rank "
        f"{OVERFLOW_RANK} alone meets an overflow at step {plan.overflow_step}. The one "
        "process trains the whole batch with the same overflow. Each cell: the loss scale the "
        "step used, `skip` where it was skipped.",
    ]
    meta = {
        "command": command,
        "date": f"{datetime.datetime.now(datetime.UTC):%Y-%m-%dT%H:%M}Z",
        "processes": world,
        "plan": dataclasses.asdict(plan),
        "init_scale": INIT_SCALE,
        "max_loss_scale": MAX_LOSS_SCALE,
        "steps_per_increase": STEPS_PER_INCREASE,
        "tolerance_factor": TOLERANCE_FACTOR,
        "elapsed_s": elapsed,
        "cpu_s": cpu_used,
        "verdict": all(r.verdict for r in reports),
    }
    written = write_outputs(reports, out_dir, header, meta)
    verdict = "yes" if meta["verdict"] else "NO"
    print(
        f"every front door: same decisions, ranks identical, parameters as one process: {verdict}"
    )
    print(f"wrote {', '.join(str(p) for p in written)} in {elapsed:.0f} s ({cpu_used:.0f} s CPU)")
    return reports


# ---------------------------------------------------------------------------------------------
# command line


def build_parser(prog: str = "python -m demo.distributed") -> argparse.ArgumentParser:
    """The argument parser of ``python -m demo.distributed`` (named ``prog`` in messages)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=(
            "Train the GPT of `make demo` in float16 with dynamic loss scaling on several local "
            "processes per front door (torch DDP or FSDP2 over gloo; jax.distributed), one "
            "rank meeting an overflow, and compare every rank's decisions and parameters with "
            "one process on the whole batch."
        ),
    )
    parser.add_argument("--nproc", type=int, default=2, help="processes per front door (2)")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps ({STEPS})")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and batches (0)")
    parser.add_argument(
        "--overflow-step",
        type=int,
        default=None,
        help=f"the step at which rank {OVERFLOW_RANK} meets an overflow (default "
        f"{OVERFLOW_STEP}, or half of --steps when fewer; -1: none)",
    )
    parser.add_argument(
        "--front-door", choices=(*DOORS, "both"), default="both", help="which front door (both)"
    )
    parser.add_argument("--fsdp2", action="store_true", help="torch: FSDP2 instead of DDP")
    parser.add_argument(
        "--out-dir", type=Path, default=Path("demo_output"), help="output folder (demo_output)"
    )
    for name, kind in (("worker", str), ("rank", int), ("world", int), ("port", int)):
        parser.add_argument(f"--{name}", type=kind, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Plan:
    if args.nproc < 2:
        parser.error(f"argument --nproc: must be an integer of at least 2; got {args.nproc}")
    if args.steps < 1:
        parser.error(f"argument --steps: must be a positive integer; got {args.steps}")
    if args.seed < 0:
        parser.error(f"argument --seed: must be a non-negative integer; got {args.seed}")
    if args.overflow_step is None:
        args.overflow_step = OVERFLOW_STEP if args.steps > OVERFLOW_STEP else args.steps // 2
    if not -1 <= args.overflow_step < args.steps:
        parser.error(
            f"argument --overflow-step: must be -1 or a step below --steps={args.steps}; got "
            f"{args.overflow_step}"
        )
    batch = Settings().batch_size
    if batch % args.nproc:
        parser.error(f"argument --nproc: must divide the batch size {batch}; got {args.nproc}")
    if args.out_dir.exists() and not args.out_dir.is_dir():
        parser.error(f"argument --out-dir: {args.out_dir} exists and is not a folder")
    return Plan(args.steps, args.seed, args.overflow_step, args.fsdp2)


def main(argv: Sequence[str] | None = None, prog: str = "python -m demo.distributed") -> int:
    """Entry point of ``python -m demo.distributed`` (and ``python -m demo --nproc N``).

    Args:
        argv: the arguments (default: the command line's).
        prog: the command's name in messages and in the reports' header.

    Returns:
        The process exit status: 0 when every front door passed its comparison, 1 otherwise.

    Example:
        >>> from demo.distributed import build_parser
        >>> build_parser().parse_args(["--nproc", "2", "--front-door", "jax"]).front_door
        'jax'
    """
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    plan = _check(parser, args)
    if args.worker is not None:  # one rank, started by run_ranks
        rank_main = torch_rank if args.worker == "torch" else jax_rank
        record = rank_main(plan, args.rank, args.world, args.port)
        with open(args.result, "wb") as f:
            pickle.dump(dataclasses.asdict(record), f)  # no class: __main__ differs
        return 0
    command = f"{prog} " + " ".join(argv if argv is not None else sys.argv[1:])
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: torch only
        return _under_torchrun(plan, command.strip(), args.out_dir)
    doors = list(DOORS) if args.front_door == "both" else [args.front_door]
    reports = run(plan, args.nproc, doors, args.out_dir, command.strip())
    return 0 if all(r.verdict for r in reports) else 1


def _under_torchrun(plan: Plan, command: str, out_dir: Path) -> int:
    """This process is one rank of a torchrun job: trains; rank 0 gathers, runs the one
    process and reports."""
    import torch.distributed as dist

    start, cpu = time.perf_counter(), _cpu_seconds()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    try:
        batch = plan.settings.batch_size
        if batch % world:  # every rank says why, then all exit together
            # One write, so that the ranks' lines cannot interleave in a shared log.
            sys.stderr.write(f"rank {rank}: WORLD_SIZE={world} must divide the batch {batch}\n")
            sys.stderr.flush()
            dist.barrier()
            return 2
        record = train_torch(plan, rank, world)
        records: list[Any] = [None] * world
        dist.all_gather_object(records, record)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return 0
    one, yardsticks = one_process("torch", plan, world)
    report = DoorReport("torch", wrapper_name("torch", plan), records, one, yardsticks)
    print("\n".join(decision_table(report)))
    print("\n".join(summary_lines(report)) + "\n", flush=True)
    finish([report], plan, world, out_dir, command, start, cpu)
    return 0 if report.verdict else 1


if __name__ == "__main__":
    sys.exit(main())
