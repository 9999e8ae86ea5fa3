"""accelerate's ``Accelerator(cpu=True)`` and the Hugging Face ``Trainer`` (``use_cpu=True``) on
2 processes started by torchrun, for ``test_trainers_multiprocess.py``.

Run as ``python -m torch.distributed.run --standalone --nproc-per-node 2 --local-addr 127.0.0.1
_trainer_worker_accelerate.py OUT_DIR``. accelerate reads torchrun's environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``): with ``cpu=True`` it is ``MULTI_CPU``, a gloo
group that it initializes with the timeout of ``InitProcessGroupKwargs``, and ``prepare`` wraps
the model in ``DistributedDataParallel`` and shards the data loader.

Each rank trains four times, once per scaler of ``_trainer_worker.SCALERS`` in each trainer, the
scaler put in place of accelerate's own before training (``accelerator.scaler = ...``, and
``native_amp = True``, which on the CPU turns on fp16 autocast and ``unscale_``: see
docs/pytorch/trainers.md):

* an accelerate loop: ``accelerator.backward``, the inf planted on rank ``POISON_RANK`` at step
  ``POISON_STEP`` (after the backward, so after DDP's all-reduce), ``clip_grad_norm_`` (the
  scaler's ``unscale_``), ``optimizer.step()``;
* ``Trainer.train`` (its defaults: fused AdamW, ``max_grad_norm=1.0``; a constant learning rate),
  the inf planted by a ``Trainer`` subclass after ``training_step``'s backward.

The accelerate loops run first: their ``Accelerator`` initializes the process group with a
timeout, which the Trainer reuses. (transformers 5.23 passes ``ddp_timeout`` to
``init_process_group`` only off the CPU: with ``use_cpu=True`` a group the Trainer initialized
itself would wait 30 minutes, torch's default.) Each rank saves what it recorded with
``torch.save`` to ``OUT_DIR/rank{RANK}.pt`` and logs to ``OUT_DIR/rank{RANK}.log``.

``_trainer_worker_accelerate.py --probe OUT_DIR``, started by ``accelerate launch``, only reports
how many processes the launch started: each writes ``OUT_DIR/probe{PID}.json`` (accelerate's
``num_processes``, ``process_index`` and ``distributed_type``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import _trainer_worker as common
import torch


def accelerate_run(scaler_name: str) -> dict[str, Any]:
    """The accelerate loop with the scaler ``scaler_name``: this rank's record."""
    from accelerate import Accelerator, InitProcessGroupKwargs

    accelerator = Accelerator(
        mixed_precision="fp16",
        cpu=True,
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=common.TIMEOUT)],
    )
    scaler = common.make_scaler(scaler_name)
    accelerator.scaler = scaler  # before prepare()
    accelerator.native_amp = True
    net = common.make_net()
    hidden_dtypes: list[torch.dtype] = []
    net[0].register_forward_hook(lambda _m, _i, out: hidden_dtypes.append(out.dtype))
    optimizer = torch.optim.Adam(net.parameters(), lr=common.LEARNING_RATE)
    loader = torch.utils.data.DataLoader(common.dataset(), batch_size=common.ROWS_PER_RANK)
    model, optimizer, loader = accelerator.prepare(net, optimizer, loader)
    record: dict[str, list[Any]] = {"changed": [], "scales": [], "skipped": [], "targets": []}
    for step, (x, y) in enumerate(loader):
        before = common.params_of(net)
        record["targets"].append(y.clone())
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        accelerator.backward(loss)  # DDP all-reduces the gradients
        if step == common.POISON_STEP and accelerator.process_index == common.POISON_RANK:
            common.plant_inf(net)
        accelerator.clip_grad_norm_(model.parameters(), 10.0)  # the scaler's unscale_
        optimizer.step()
        optimizer.zero_grad()
        record["changed"].append(not common.same(before, common.params_of(net)))
        record["scales"].append(float(scaler.get_scale()))
        record["skipped"].append(optimizer.step_was_skipped)
    return {
        **record,
        "hidden_dtypes": hidden_dtypes,
        "final": common.final_state(net, optimizer.optimizer, scaler),
        "distributed_type": str(accelerator.distributed_type),
        "model_type": type(model).__name__,
        "rank": accelerator.process_index,
        "world": accelerator.num_processes,
    }


def trainer_run(scaler_name: str, out: Path) -> dict[str, Any]:
    """``Trainer.train`` with the scaler ``scaler_name``: this rank's record."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Regressor(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = common.make_net()
            self.hidden_dtypes: list[torch.dtype] = []
            self.net[0].register_forward_hook(
                lambda _m, _i, out: self.hidden_dtypes.append(out.dtype)
            )

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": torch.nn.functional.mse_loss(self.net(x).float(), labels)}

    class PlantingTrainer(Trainer):
        """Plants the inf on one rank after the backward of ``training_step`` (all-reduced)."""

        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            loss = super().training_step(model, inputs, num_items_in_batch)
            step, rank = self.state.global_step, self.args.process_index
            if step == common.POISON_STEP and rank == common.POISON_RANK:
                common.plant_inf(regressor)
            return loss

    class Record(TrainerCallback):
        def __init__(self) -> None:
            self.before: list[torch.Tensor] = []
            self.changed: list[bool] = []
            self.scales: list[float] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.before = common.params_of(regressor)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.changed.append(not common.same(self.before, common.params_of(regressor)))
            self.scales.append(float(scaler.get_scale()))

    args = TrainingArguments(
        output_dir=str(out / f"trainer-{scaler_name}"),
        per_device_train_batch_size=common.ROWS_PER_RANK,
        max_steps=common.STEPS,
        learning_rate=common.LEARNING_RATE,
        lr_scheduler_type="constant",
        fp16=True,
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    regressor = Regressor()
    scaler = common.make_scaler(scaler_name)
    record = Record()
    data = [{"x": x, "labels": y} for x, y in zip(*common.dataset().tensors, strict=True)]
    trainer = PlantingTrainer(model=regressor, args=args, train_dataset=data, callbacks=[record])
    trainer.accelerator.scaler = scaler  # before train()
    trainer.accelerator.native_amp = True
    trainer.train()
    return {
        "changed": record.changed,
        "scales": record.scales,
        "hidden_dtypes": regressor.hidden_dtypes,
        "final": common.final_state(regressor, trainer.optimizer.optimizer, scaler),
        "optim": str(args.optim),
        "distributed_type": str(trainer.accelerator.distributed_type),
        "rank": args.process_index,
        "world": args.world_size,
    }


def probe(out_dir: str) -> None:
    """Writes what accelerate sees of this launch to ``OUT_DIR/probe{PID}.json``."""
    import torch.distributed as dist
    from accelerate import PartialState

    state = PartialState(cpu=True, timeout=common.TIMEOUT)  # timeout: for init_process_group
    seen = {
        "pid": os.getpid(),
        "num_processes": state.num_processes,
        "process_index": state.process_index,
        "distributed_type": str(state.distributed_type),
    }
    (Path(out_dir) / f"probe{os.getpid()}.json").write_text(json.dumps(seen))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)


def main(out_dir: str) -> None:
    import torch.distributed as dist

    out = Path(out_dir)
    rank = int(os.environ["RANK"])
    common.log_to(out, rank)
    torch.set_num_threads(1)
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing downloads
    result: dict[str, Any] = {
        "environment": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    }
    for name in common.SCALERS:
        result[f"accelerate.{name}"] = accelerate_run(name)
    for name in common.SCALERS:
        result[f"trainer.{name}"] = trainer_run(name, out)
    common.save(result, out, rank)
    dist.barrier()  # every rank has saved
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)
    os._exit(0)  # skip interpreter teardown: the result is written


if __name__ == "__main__":
    if sys.argv[1] == "--probe":
        probe(sys.argv[2])
    else:
        main(*sys.argv[1:])
