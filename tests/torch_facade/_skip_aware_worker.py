"""One rank of the 2-rank DDP job of ``test_skip_aware.py``: a skip-aware StepLR on every rank.

The model is ``TinyNet`` in DDP (gloo, CPU); every rank trains on the same batches, and the
iterations in ``test_skip_aware.FAULTS`` get an inf gradient on rank 0 only. The scaler's
decision is global, so every rank must skip them, and the schedule must be the same everywhere.

Usage as a script: ``python _skip_aware_worker.py OUT_FILE PORT RANK WORLD``.
"""

from __future__ import annotations

import pickle
import sys

import torch
from _ranks import join_gloo
from facade_helpers import DLS, INF, TinyNet, loss_of

import torch_facade as cstorch

ITERATIONS = 8
FAULTS = frozenset({0, 3, 4})  # as test_skip_aware.FAULTS


def main(out_file: str, port: str, rank: str, world: str) -> None:
    join_gloo(port, rank, world)
    model = torch.nn.parallel.DistributedDataParallel(TinyNet(), find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grad_scaler = cstorch.amp.GradScaler(**DLS)
    scheduler = cstorch.amp.skip_aware(
        torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5), grad_scaler
    )
    lrs, changed = [], []
    for iteration in range(ITERATIONS):
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad()
        grad_scaler.scale(loss_of(model, iteration)).backward()
        if iteration in FAULTS and rank == "0":
            model.module.fc1.weight.grad[0, 0] = INF
        grad_scaler.step(optimizer)
        grad_scaler.update()
        scheduler.step()
        lrs.append([float(lr) for lr in scheduler.get_last_lr()])
        after = list(model.parameters())
        changed.append(any(not torch.equal(b, a) for b, a in zip(before, after, strict=True)))
    result = {"lrs": lrs, "changed": changed, "last_epoch": scheduler.last_epoch}
    with open(out_file, "wb") as out:
        pickle.dump(result, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
