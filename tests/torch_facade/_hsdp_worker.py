"""One rank of the 4-process HSDP job driven by ``test_hsdp.py``.

Run as a script::

    python _hsdp_worker.py OUT_FILE PORT RANK 4

Each rank joins a gloo job on ``127.0.0.1:PORT`` and trains every case of :data:`CASES`:
FSDP2's ``fully_shard`` over a 2-D device mesh (HSDP: 2 replica groups of 2 shards), with the
training loop, model, batches and one-process oracle of ``_distributed_worker`` (each rank
trains a quarter of every batch). Then the placements the scaler refuses (:func:`run_errors`),
each raising on every rank before any collective. It pickles what it recorded to ``OUT_FILE``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import _distributed_worker as base
import torch
from _ranks import join_gloo

WORLD = 4
CASES: dict[str, base.Case] = {
    # init_device_mesh("cpu", (2, 2)): replica groups {0, 1} and {2, 3}. The fault is in rank
    # 3's copy of the second shard; rank 1 holds the same shard, finite.
    "hsdp_sgd_gcc": base.Case(
        "fsdp2", "sgd", max_gradient_norm=0.05, fault_rank=3, mesh=((0, 1), (2, 3))
    ),
    # A mesh whose replica groups are {0, 2} and {1, 3}: the gathered rows must be reordered.
    # float16 compute: at step 4 rank 0's rows overflow its backward pass; at step 2 rank 2
    # (replica 0, second shard) writes a NaN.
    "hsdp_fp16_fused": base.Case(
        "fsdp2",
        "adam_fused",
        compute_dtype=torch.float16,
        big_target_step=4,
        atol=2e-4,
        unscale_first=False,
        fault_rank=2,
        fault_value=math.nan,
        mesh=((0, 2), (1, 3)),
    ),
}


def run_errors() -> dict[str, str]:
    """The refused layouts, each with its error (the same on every rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import torch_facade as cstorch

    def decide(mesh: Any, placements: list[Any], process_group: Any = None) -> Callable[[], None]:
        def check() -> None:
            local = torch.ones(2, 2)
            param = torch.nn.Parameter(DTensor.from_local(local, mesh, placements))
            param.grad = DTensor.from_local(torch.full_like(local, 0.5), mesh, placements)
            optimizer = torch.optim.SGD([param], lr=0.1)
            scaler = cstorch.amp.GradScaler(loss_scale="dynamic", process_group=process_group)
            scaler.scale(torch.ones(()))
            scaler.unscale_(optimizer)

        return check

    found = {}
    flat = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    found["partial_1d"] = base.caught(decide(flat, [Partial()]))
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    found["partial_2d"] = base.caught(decide(hsdp, [Replicate(), Partial()]))
    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    found["tensor_parallel"] = base.caught(decide(tp, [Shard(0), Shard(1)]))
    found["tp_replicated"] = base.caught(decide(tp, [Shard(0), Replicate()]))
    cube = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    found["three_dims"] = base.caught(decide(cube, [Replicate(), Replicate(), Shard(0)]))
    shard_group = hsdp.get_group("shard")
    found["shard_group"] = base.caught(decide(hsdp, [Replicate(), Shard(0)], shard_group))
    found["hsdp_world"] = base.caught(decide(hsdp, [Replicate(), Shard(0)]))
    full = distribute_tensor(torch.arange(8.0).reshape(4, 2), hsdp, [Replicate(), Shard(0)])
    found["full_tensor"] = str(full.full_tensor().tolist())  # the mesh works as HSDP
    return found


def main(out_file: str, port: str, rank: str, world: str) -> None:
    """Runs every case and the error checks as one rank; pickles the results."""
    assert int(world) == WORLD, f"the HSDP job needs {WORLD} ranks; got {world}"
    join_gloo(port, rank, world)
    results = base.run_cases(CASES, int(rank), WORLD)
    results["errors"] = run_errors()
    base.finish(results, out_file)


if __name__ == "__main__":
    main(*sys.argv[1:])
