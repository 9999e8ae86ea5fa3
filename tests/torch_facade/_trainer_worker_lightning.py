"""Lightning's ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``, for
``test_trainers_multiprocess.py``.

Run as ``python _trainer_worker_lightning.py OUT_DIR`` with ``MASTER_ADDR=127.0.0.1`` and a free
``MASTER_PORT``: this process is rank 0, and Lightning's ``"ddp"`` strategy (its subprocess
launcher) starts rank 1 by running this same command again with ``LOCAL_RANK=1``. The strategy
is ``DDPStrategy(start_method="popen")``, which is what ``strategy="ddp"`` names, given as an
object for its ``timeout`` and the gloo backend.

Each rank fits the module twice, once per scaler of ``_trainer_worker.SCALERS``, each put in
Lightning's ``MixedPrecision("16-mixed", "cpu", scaler=...)`` plugin (the process group of the
first fit serves the second). At step ``POISON_STEP`` the module's ``on_after_backward``, which
Lightning calls after DDP's backward (its all-reduce done) and before the plugin's ``unscale_``,
plants an inf on rank ``POISON_RANK`` only. Each rank records per step whether its parameters
changed and the scale after it, and its final state dicts; it saves them with ``torch.save`` to
``OUT_DIR/rank{RANK}.pt`` and logs to ``OUT_DIR/rank{RANK}.log``. Rank 0 waits for rank 1 and
exits with its status if it failed.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import _trainer_worker as common


def fit(scaler_name: str) -> tuple[dict[str, Any], list[subprocess.Popen[bytes]]]:
    """One ``Trainer.fit`` on 2 processes with the scaler ``scaler_name``: this rank's record,
    and the processes Lightning started for it (rank 0's first fit only)."""
    import lightning as L
    import torch
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning.pytorch.strategies import DDPStrategy

    class Recorder(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = common.make_net()
            self.changed: list[bool] = []
            self.scales: list[float] = []
            self.hidden_dtypes: list[torch.dtype] = []
            self.targets: list[torch.Tensor] = []
            self.net[0].register_forward_hook(
                lambda _m, _i, out: self.hidden_dtypes.append(out.dtype)
            )
            self._before: list[torch.Tensor] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            self.targets.append(y.detach().clone())
            return torch.nn.functional.mse_loss(self.net(x).float(), y)

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self._before = common.params_of(self.net)

        def on_after_backward(self) -> None:  # DDP has all-reduced the gradients
            if self.global_step == common.POISON_STEP and self.global_rank == common.POISON_RANK:
                common.plant_inf(self.net)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.changed.append(not common.same(self._before, common.params_of(self.net)))
            self.scales.append(float(self.trainer.precision_plugin.scaler.get_scale()))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=common.LEARNING_RATE)

    scaler = common.make_scaler(scaler_name)
    module = Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=common.WORLD,
        strategy=DDPStrategy(
            start_method="popen", process_group_backend="gloo", timeout=common.TIMEOUT
        ),
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        max_steps=common.STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(common.dataset(), batch_size=common.ROWS_PER_RANK)
    trainer.fit(module, loader)
    children = list(getattr(trainer.strategy.launcher, "procs", []))
    return {
        "changed": module.changed,
        "scales": module.scales,
        "hidden_dtypes": module.hidden_dtypes,
        "targets": module.targets,
        "final": common.final_state(module.net, trainer.optimizers[0], scaler),
        "strategy": type(trainer.strategy).__name__,
        "launcher": type(trainer.strategy.launcher).__name__,
        "children": [proc.pid for proc in children],
        "rank": trainer.global_rank,
        "world": trainer.world_size,
    }, children


def main(out_dir: str) -> None:
    out = Path(out_dir)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # set by Lightning for its children
    common.log_to(out, local_rank)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*is deprecated.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    import torch.distributed as dist

    result: dict[str, Any] = {"pid": os.getpid(), "ppid": os.getppid(), "argv": list(sys.argv)}
    children: list[subprocess.Popen[bytes]] = []
    for name in common.SCALERS:
        result[name], started = fit(name)
        children += started
    result["environment"] = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    from lightning.pytorch.strategies import StrategyRegistry

    registered = StrategyRegistry["ddp"]  # what strategy="ddp" makes
    result["ddp"] = {"strategy": registered["strategy"].__name__, **registered["init_params"]}
    rank = result["facade"]["rank"]
    common.save(result, out, rank)
    dist.barrier()  # every rank has saved
    dist.destroy_process_group()
    codes = [child.wait(timeout=common.TIMEOUT.total_seconds()) for child in children]
    print(f"rank {rank}: done; children exited with {codes}", flush=True)
    os._exit(max(codes, default=0))  # skip interpreter teardown: the result is written


if __name__ == "__main__":
    main(*sys.argv[1:])
