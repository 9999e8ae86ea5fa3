"""``cstorch.amp.skip_aware``: the LR scheduler advances only on the steps the scaler applied.

The oracle is a second scheduler of the same kind, on a fresh optimizer of the same kind,
stepped by hand only on the iterations the fault plan leaves applied; the runs also check that
those are exactly the iterations whose parameters changed. Learning rates are compared exactly
(the wrapped scheduler and the oracle run the same arithmetic on the same types).
"""

from __future__ import annotations

import os
import pickle
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from facade_helpers import DLS, INF, TinyNet, batch, loss_of, quiet_cpu_training_arguments

import torch_facade as cstorch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: nothing downloads
from transformers import Trainer, TrainerCallback

ITERATIONS = 8
FAULTS = frozenset({0, 3, 4})  # iterations whose gradients get an inf: a first-step skip and two
Sched = torch.optim.lr_scheduler.LRScheduler

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=0.1, fused=True),
    # Tensor learning rates: the device path (no host read per step).
    "adamw-fused-tensor-lr": lambda params: torch.optim.AdamW(
        params, lr=torch.tensor(0.1), fused=True
    ),
    "adam-tensor-lr": lambda params: torch.optim.Adam(
        params, lr=torch.tensor(0.1, dtype=torch.float64), foreach=False
    ),
}

SchedulerFactory = Callable[[torch.optim.Optimizer], Sched]
SCHEDULERS: dict[str, SchedulerFactory] = {
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "warmup-lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: min(1.0, (step + 1) / 3)
    ),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10),
    "sequential": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7),
        ],
        milestones=[2],
    ),
}


def new_scaler(**kwargs: Any) -> cstorch.amp.GradScaler:
    return cstorch.amp.GradScaler(**{**DLS, **kwargs})


def as_floats(lrs: list[Any]) -> list[float]:
    return [float(lr) for lr in lrs]


def oracle_lrs(
    make_optimizer: OptimizerFactory, make_scheduler: SchedulerFactory, applied: list[bool]
) -> list[list[float]]:
    """The learning rates after each iteration, the scheduler stepped by hand when applied."""
    optimizer = make_optimizer(TinyNet().parameters())
    scheduler = make_scheduler(optimizer)
    optimizer._opt_called = True  # type: ignore[attr-defined]  # no real step: torch's order check
    lrs = []
    for was_applied in applied:
        if was_applied:
            scheduler.step()
        lrs.append(as_floats(scheduler.get_last_lr()))
    return lrs


def train(
    make_optimizer: OptimizerFactory,
    make_scheduler: SchedulerFactory | None,
    *,
    faults: frozenset[int] = FAULTS,
    iterations: int = ITERATIONS,
    micro_batches: int = 1,
    use_optimizer_step: bool = False,
    compiled: bool = False,
    start: tuple[int, dict[str, Any]] | None = None,
    wrap: bool = True,
) -> dict[str, Any]:
    """The cstorch loop with a skip-aware scheduler; ``faults`` poisons those iterations.

    ``micro_batches``: gradient accumulation (the poison goes into the last micro-batch's
    backward). ``start``: (first iteration, checkpoint) to resume from. Returns the learning
    rates after each iteration, whether the parameters changed, and the objects.
    """
    model = TinyNet()
    forward = torch.compile(model, backend="aot_eager") if compiled else model
    optimizer = make_optimizer(model.parameters())
    inner = None if make_scheduler is None else make_scheduler(optimizer)
    grad_scaler = new_scaler()
    scheduler: Any = cstorch.amp.skip_aware(inner, grad_scaler) if wrap else inner
    first = 0
    if start is not None:
        first, checkpoint = start
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        grad_scaler.load_state_dict(checkpoint["grad_scaler"])
        scheduler.load_state_dict(checkpoint["scheduler"])
    lrs, changed = [], []
    for iteration in range(first, iterations):
        before = [p.detach().clone() for p in model.parameters()]
        x, y = batch(iteration)
        if use_optimizer_step:
            loss = (forward(x) - y).square().mean() * (INF if iteration in faults else 1.0)
            cstorch.amp.optimizer_step(loss, optimizer, grad_scaler, max_gradient_norm=1.0)
        else:
            optimizer.zero_grad()
            for micro in range(micro_batches):
                poison = iteration in faults and micro == micro_batches - 1
                part = (forward(x[micro::micro_batches]) - y[micro::micro_batches]).square()
                loss = part.mean() * (INF if poison else 1.0) / micro_batches
                grad_scaler.scale(loss).backward()
            grad_scaler.step(optimizer)
            grad_scaler.update()
        if scheduler is not None:
            scheduler.step()
            lrs.append(as_floats(scheduler.get_last_lr()))
        after = list(model.parameters())
        changed.append(any(not torch.equal(b, a) for b, a in zip(before, after, strict=True)))
    return {
        "lrs": lrs,
        "changed": changed,
        "scheduler": scheduler,
        "checkpoint": {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "grad_scaler": grad_scaler.state_dict(),
            "scheduler": None if scheduler is None else scheduler.state_dict(),
        },
    }


def applied_plan(faults: frozenset[int] = FAULTS, iterations: int = ITERATIONS) -> list[bool]:
    return [i not in faults for i in range(iterations)]


# ----------------------------------------------------------------------------- the loop


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("schedule", sorted(SCHEDULERS))
def test_the_schedule_advances_only_on_applied_steps(optimizer: str, schedule: str):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" fails
        run = train(OPTIMIZERS[optimizer], SCHEDULERS[schedule])
    plan = applied_plan()
    assert run["changed"] == plan
    assert run["lrs"] == oracle_lrs(OPTIMIZERS[optimizer], SCHEDULERS[schedule], plan)
    scheduler = run["scheduler"]
    assert scheduler.applied_steps == sum(plan)
    assert scheduler.last_epoch == sum(plan)
    assert scheduler.scheduler.last_epoch == sum(plan)


def test_tensor_learning_rates_take_the_device_path_and_float_ones_the_host_path():
    grad_scaler = new_scaler()
    for name, expected in [("adamw-fused-tensor-lr", "device"), ("adamw-fused", "host")]:
        optimizer = OPTIMIZERS[name](TinyNet().parameters())
        wrapped = cstorch.amp.skip_aware(SCHEDULERS["step"](optimizer), grad_scaler)
        assert f"path={expected}" in repr(wrapped)


class _HostRead(AssertionError):
    pass


@pytest.fixture
def count_host_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every Python-level conversion of a tensor to a host value while armed."""
    reads: list[str] = []
    for name in ("__bool__", "__int__", "__float__", "__index__", "item", "tolist"):
        original = getattr(torch.Tensor, name)

        def spy(self: torch.Tensor, *args: Any, __name: str = name, __orig: Any = original) -> Any:
            reads.append(__name)
            return __orig(self, *args)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return reads


@pytest.mark.parametrize(("optimizer", "reads_per_step"), [("sgd", 1), ("adam-tensor-lr", 0)])
def test_step_reads_the_flag_on_the_host_only_for_float_learning_rates(
    optimizer: str, reads_per_step: int, count_host_reads: list[str]
):
    model = TinyNet()
    opt = OPTIMIZERS[optimizer](model.parameters())
    grad_scaler = new_scaler()
    scheduler = cstorch.amp.skip_aware(SCHEDULERS["step"](opt), grad_scaler)
    reads = []
    for iteration in range(4):
        opt.zero_grad()
        grad_scaler.scale(loss_of(model, iteration) * (INF if iteration == 1 else 1.0)).backward()
        grad_scaler.step(opt)
        grad_scaler.update()
        count_host_reads.clear()
        scheduler.step()
        reads.append(len(count_host_reads))
    assert reads == [reads_per_step] * 4
    count_host_reads.clear()
    assert scheduler.last_epoch == 3  # resolving the device count is one read
    assert len(count_host_reads) == (1 if reads_per_step == 0 else 0)


def test_accumulated_steps_skip_when_any_micro_batch_overflows():
    make_optimizer, make_scheduler = OPTIMIZERS["sgd"], SCHEDULERS["step"]
    run = train(make_optimizer, make_scheduler, micro_batches=3)  # the poison: micro-batch 3 of 3
    plan = applied_plan()
    assert run["changed"] == plan
    assert run["lrs"] == oracle_lrs(make_optimizer, make_scheduler, plan)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw-fused-tensor-lr"])
def test_optimizer_step_and_a_compiled_model(optimizer: str):
    make_optimizer, make_scheduler = OPTIMIZERS[optimizer], SCHEDULERS["cosine"]
    plan = applied_plan()
    expected = oracle_lrs(make_optimizer, make_scheduler, plan)
    one_call = train(make_optimizer, make_scheduler, use_optimizer_step=True)
    compiled = train(make_optimizer, make_scheduler, compiled=True)
    for run in (one_call, compiled):
        assert run["changed"] == plan
        assert run["lrs"] == expected


def test_a_compiled_train_step_that_calls_the_scheduler():
    """``step()`` runs eagerly behind a graph break inside a compiled function."""
    model = TinyNet()
    optimizer = OPTIMIZERS["adamw-fused-tensor-lr"](model.parameters())
    grad_scaler = new_scaler()
    scheduler = cstorch.amp.skip_aware(SCHEDULERS["step"](optimizer), grad_scaler)

    @torch.compile(backend="aot_eager")
    def train_step(x: torch.Tensor, y: torch.Tensor, poison: torch.Tensor) -> None:
        loss = (model(x) - y).square().mean() * poison
        cstorch.amp.optimizer_step(loss, optimizer, grad_scaler)
        scheduler.step()

    for iteration in range(ITERATIONS):
        train_step(*batch(iteration), torch.tensor(INF if iteration in FAULTS else 1.0))
    plan = applied_plan()
    expected = oracle_lrs(OPTIMIZERS["adamw-fused-tensor-lr"], SCHEDULERS["step"], plan)
    assert as_floats(scheduler.get_last_lr()) == expected[-1]
    assert scheduler.last_epoch == sum(plan)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw-fused-tensor-lr"])
def test_state_dict_round_trip_mid_run_continues_the_schedule(optimizer: str, tmp_path: Path):
    make_optimizer, make_scheduler = OPTIMIZERS[optimizer], SCHEDULERS["sequential"]
    whole = train(make_optimizer, make_scheduler)
    half = train(make_optimizer, make_scheduler, iterations=4)  # iterations 0-3: 2 applied
    assert half["checkpoint"]["scheduler"]["applied_steps"] == 2
    torch.save(half["checkpoint"], tmp_path / "checkpoint.pt")
    checkpoint = torch.load(tmp_path / "checkpoint.pt")  # weights_only: plain data
    resumed = train(make_optimizer, make_scheduler, start=(4, checkpoint))
    assert half["lrs"] + resumed["lrs"] == whole["lrs"]
    assert resumed["scheduler"].applied_steps == whole["scheduler"].applied_steps == 5
    assert resumed["scheduler"].last_epoch == whole["scheduler"].last_epoch
    ours, theirs = (run["scheduler"].scheduler for run in (resumed, whole))
    assert ours.last_epoch == theirs.last_epoch
    assert as_floats(ours.get_last_lr()) == as_floats(theirs.get_last_lr())


# ----------------------------------------------------------------------------- the counter


def test_without_a_scheduler_it_counts_applied_steps(count_host_reads: list[str]):
    run = train(OPTIMIZERS["sgd"], None)
    assert run["changed"] == applied_plan()

    model = TinyNet()
    optimizer = OPTIMIZERS["sgd"](model.parameters())
    grad_scaler = new_scaler()
    counter = cstorch.amp.skip_aware(None, grad_scaler)
    for iteration in range(ITERATIONS):
        optimizer.zero_grad()
        poison = INF if iteration in FAULTS else 1.0
        grad_scaler.scale(loss_of(model, iteration) * poison).backward()
        grad_scaler.step(optimizer)
        grad_scaler.update()
        count_host_reads.clear()
        counter.step()
        assert count_host_reads == []  # the count stays on the device
    assert counter.applied_steps == counter.last_epoch == ITERATIONS - len(FAULTS)
    assert counter.get_last_lr() == []
    assert counter.optimizer is None
    state = counter.state_dict()
    assert state == {"scheduler": None, "applied_steps": 5}
    fresh = cstorch.amp.skip_aware(None, new_scaler())
    fresh.load_state_dict(pickle.loads(pickle.dumps(state)))
    assert fresh.applied_steps == 5
    with pytest.raises(AttributeError, match="step counter"):
        _ = fresh.base_lrs


def test_with_static_scaling_every_step_is_applied():
    model = TinyNet()
    optimizer = OPTIMIZERS["sgd"](model.parameters())
    grad_scaler = cstorch.amp.GradScaler(loss_scale=8.0)  # static: checks nothing, always steps
    scheduler = cstorch.amp.skip_aware(SCHEDULERS["step"](optimizer), grad_scaler)
    for iteration in range(4):
        optimizer.zero_grad()
        grad_scaler.scale(loss_of(model, iteration)).backward()
        grad_scaler.step(optimizer)
        grad_scaler.update()
        scheduler.step()
    assert scheduler.last_epoch == 4
    assert scheduler.get_last_lr() == [pytest.approx(0.1 * 0.5**2)]


def test_attributes_pass_through_and_plateau_takes_its_metric():
    model = TinyNet()
    optimizer = OPTIMIZERS["sgd"](model.parameters())
    grad_scaler = new_scaler()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
    scheduler = cstorch.amp.skip_aware(plateau, grad_scaler)
    assert scheduler.patience == 0 and scheduler.optimizer is optimizer
    assert scheduler.grad_scaler is grad_scaler
    for iteration, metric in enumerate([1.0, 2.0, 3.0, 4.0]):  # worse every time
        optimizer.zero_grad()
        poison = INF if iteration == 2 else 1.0
        grad_scaler.scale(loss_of(model, iteration) * poison).backward()
        grad_scaler.step(optimizer)
        grad_scaler.update()
        scheduler.step(metric)
    # Three applied steps saw 1, 2 and 4: the plateau halved twice (at 2 and at 4).
    assert scheduler.get_last_lr() == [pytest.approx(0.1 * 0.5**2)]
    assert scheduler.applied_steps == 3


# ----------------------------------------------------------------------------- bad input


def test_bad_arguments_raise_errors_that_name_them():
    optimizer = OPTIMIZERS["sgd"](TinyNet().parameters())
    inner = SCHEDULERS["step"](optimizer)
    grad_scaler = new_scaler()
    with pytest.raises(TypeError, match=r"scheduler must be a torch.optim.*LRScheduler.*SGD"):
        cstorch.amp.skip_aware(optimizer, grad_scaler)
    with pytest.raises(TypeError, match=r"grad_scaler must be a torch_facade.amp.GradScaler.*"):
        cstorch.amp.skip_aware(inner, torch.amp.GradScaler("cpu"))
    with pytest.raises(TypeError, match=r"grad_scaler must be .*got builtins.NoneType"):
        cstorch.amp.skip_aware(inner, None)  # type: ignore[arg-type]
    wrapped = cstorch.amp.skip_aware(inner, grad_scaler)
    with pytest.raises(ValueError, match="skip-aware already"):
        cstorch.amp.skip_aware(wrapped, grad_scaler)
    with pytest.raises(ValueError, match=r"exactly the keys \['applied_steps', 'scheduler'\]"):
        wrapped.load_state_dict(inner.state_dict())
    with pytest.raises(TypeError, match=r"applied_steps'\] must be an int >= 0; got -1"):
        wrapped.load_state_dict({"scheduler": inner.state_dict(), "applied_steps": -1})
    with pytest.raises(ValueError, match="None exactly when"):
        wrapped.load_state_dict({"scheduler": None, "applied_steps": 0})
    device = cstorch.amp.skip_aware(
        SCHEDULERS["step"](OPTIMIZERS["adam-tensor-lr"](TinyNet().parameters())), grad_scaler
    )
    with pytest.raises(TypeError, match="takes no arguments"):
        device.step(1.0)
    assert wrapped.last_epoch == 0  # nothing changed


# ----------------------------------------------------------------------------- DDP


def test_ddp_on_two_ranks_gives_every_rank_the_same_schedule(tmp_path: Path):
    sys.path.insert(0, str(Path(__file__).parent))
    from _ranks import start_ranks, wait_for_ranks

    worker = Path(__file__).parent / "_skip_aware_worker.py"
    procs = start_ranks(worker, tmp_path, world=2)
    wait_for_ranks(procs, tmp_path, deadline=time.monotonic() + 180)
    results = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in range(2)]
    plan = applied_plan()
    expected = oracle_lrs(OPTIMIZERS["sgd"], SCHEDULERS["step"], plan)
    for result in results:  # the poison is on rank 0 only; the decision is global
        assert result["changed"] == plan
        assert result["lrs"] == expected
        assert result["last_epoch"] == sum(plan)


# ----------------------------------------------------------------------------- trainers

TRAINER_STEPS = 5
TRAINER_FAULTS = frozenset({0, 2})  # at 0 the fused AdamW has no state yet; at 2 it has


def lr_in_force(oracle: list[list[float]], initial: float) -> list[float]:
    """The learning rate each iteration steps with: the one set after the iteration before."""
    return [initial] + [lrs[0] for lrs in oracle[:-1]]


class ScheduledModule(L.LightningModule):
    """``TinyNet`` with SGD and a per-step StepLR (wrapped if ``wrap``); ``poison``: batches
    whose loss is multiplied by inf. Records the learning rate each batch trains with."""

    def __init__(self, wrap: bool) -> None:
        super().__init__()
        self.net = TinyNet()
        self.wrap = wrap
        self.lrs: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        x, y = batch
        loss = (self.net(x).float() - y).square().mean()
        return loss * (INF if batch_idx in TRAINER_FAULTS else 1.0)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.lrs.append(float(self.trainer.optimizers[0].param_groups[0]["lr"]))

    def configure_optimizers(self) -> Any:
        optimizer = OPTIMIZERS["sgd"](self.parameters())
        scheduler: Any = SCHEDULERS["step"](optimizer)
        if self.wrap:
            scheduler = cstorch.amp.skip_aware(scheduler, self.trainer.precision_plugin.scaler)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


@pytest.mark.filterwarnings("ignore:.*does not have many workers.*")
@pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated.*")
@pytest.mark.filterwarnings("ignore:.*lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`.*")
def test_lightning_steps_a_wrapped_scheduler_only_on_applied_steps():
    from lightning.pytorch.plugins.precision import MixedPrecision

    data = [batch(i) for i in range(TRAINER_STEPS)]
    xs, ys = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
    runs = {}
    for wrap in (False, True):
        module = ScheduledModule(wrap)
        scaler = new_scaler()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=TRAINER_STEPS,
            plugins=[MixedPrecision(precision="16-mixed", device="cpu", scaler=scaler)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=5)
        trainer.fit(module, loader)
        assert int(scaler.get_num_skipped_steps()) == len(TRAINER_FAULTS)
        runs[wrap] = (module.lrs, trainer.lr_scheduler_configs[0].scheduler.last_epoch)
    plan = applied_plan(TRAINER_FAULTS, TRAINER_STEPS)
    oracle = oracle_lrs(OPTIMIZERS["sgd"], SCHEDULERS["step"], plan)
    assert runs[True] == (lr_in_force(oracle, 0.1), sum(plan))
    # Lightning alone steps the scheduler after every batch, skipped or not (#5558).
    assert runs[False][1] == TRAINER_STEPS


class PoisonedRegressor(torch.nn.Module):
    """``TinyNet`` as a transformers-style model: ``forward(x, labels)`` returns ``{"loss"}``;
    the forward calls (micro-batches) in ``poisoned`` multiply the loss by inf."""

    def __init__(self, poisoned: frozenset[int]) -> None:
        super().__init__()
        self.net = TinyNet()
        self.poisoned = poisoned
        self.calls = 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        poison = INF if self.calls in self.poisoned else 1.0
        self.calls += 1
        return {"loss": (self.net(x).float() - labels).square().mean() * poison}


class RecordLR(TrainerCallback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.lrs.append(float(kwargs["optimizer"].param_groups[0]["lr"]))


@pytest.mark.parametrize("accumulation", [1, 2])
def test_hf_trainer_steps_a_wrapped_scheduler_only_on_applied_steps(
    accumulation: int, tmp_path: Path
):
    from accelerate.state import AcceleratorState

    # The poison goes into the last micro-batch of each faulty step.
    poisoned = frozenset((i + 1) * accumulation - 1 for i in TRAINER_FAULTS)
    rows = [batch(i) for i in range(TRAINER_STEPS * accumulation)]  # 5 examples each
    data = [{"x": x, "labels": y} for xs, ys in rows for x, y in zip(xs, ys, strict=True)]
    runs = {}
    for wrap in (False, True):
        AcceleratorState._reset_state(reset_partial_state=True)
        model = PoisonedRegressor(poisoned)
        optimizer = OPTIMIZERS["adamw-fused"](model.parameters())
        scheduler: Any = SCHEDULERS["step"](optimizer)
        scaler = new_scaler()
        if wrap:
            scheduler = cstorch.amp.skip_aware(scheduler, scaler)
        args = quiet_cpu_training_arguments(
            tmp_path / str(wrap),
            per_device_train_batch_size=4,
            gradient_accumulation_steps=accumulation,
            max_steps=TRAINER_STEPS,
            max_grad_norm=1.0,
        )
        record = RecordLR()
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=data,
            optimizers=(optimizer, scheduler),
            callbacks=[record],
        )
        trainer.accelerator.scaler = scaler  # the workaround of test_huggingface.py
        trainer.accelerator.native_amp = True
        trainer.train()
        AcceleratorState._reset_state(reset_partial_state=True)
        assert int(scaler.get_num_skipped_steps()) == len(TRAINER_FAULTS)
        runs[wrap] = (record.lrs, trainer.lr_scheduler.last_epoch)
    plan = applied_plan(TRAINER_FAULTS, TRAINER_STEPS)
    oracle = oracle_lrs(OPTIMIZERS["adamw-fused"], SCHEDULERS["step"], plan)
    assert runs[True] == (lr_in_force(oracle, 0.1), sum(plan))
    # Alone, the Trainer asks accelerate whether the step was skipped: right while the fused
    # optimizer has no state (the facade does not call its step), wrong after (the facade calls
    # the kernel, which skips inside): the plain scheduler advances on the second skip (#4242).
    assert runs[False][1] == sum(plan) + 1
