"""HSDP: GradScaler over FSDP2's ``fully_shard`` on a 2-D device mesh, 4 ranks (gloo, CPU).

One launch of 4 OS processes (``_hsdp_worker.py``) trains every case of
``_hsdp_worker.CASES``: ``fully_shard`` over ``init_device_mesh("cpu", (2, 2),
mesh_dim_names=("replicate", "shard"))`` (SGD with DLS + GCC, float32) and over a mesh whose
replica groups are ranks {0, 2} and {1, 3} (fused Adam, float16 compute), each rank training a
quarter of every batch. The oracle is the same case run here in one process on the full batch
(``_distributed_worker.run_case``), computed while the ranks work, and torch's
``clip_grad_norm_`` of its whole gradients. At one step one rank alone writes an inf or NaN into
its own copy of a shard: every rank must skip that step, although the other replica group's
copy of that shard is finite. The same launch checks the refused layouts (``Partial``, a shard
over the first mesh dimension as tensor parallelism makes it, a 3-D mesh, a process group of
one replica group only).

The squares must add up over the shard dimension only: summed over all 4 ranks, each shard
would count twice and the norm would be ``sqrt(2)`` times too large (the norm tests see that).
"""

from __future__ import annotations

import math
import pickle
import time
from pathlib import Path
from typing import Any

import _distributed_worker as base
import _hsdp_worker as worker
import numpy as np
import pytest
import torch
from _ranks import start_ranks, wait_for_ranks

WORKER = Path(worker.__file__).resolve()
TIMEOUT_S = 300.0  # 4 ranks on 2 shared cores; a failing rank ends the wait at once


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The job's results per rank, and every case run in this process as the oracle."""
    out = tmp_path_factory.mktemp("hsdp")
    started = time.monotonic()
    procs = start_ranks(WORKER, out, worker.WORLD, {"GLOO_SOCKET_IFNAME": "lo"})
    try:
        reference = {name: base.run_case(name, None, cases=worker.CASES) for name in worker.CASES}
    finally:
        wait_for_ranks(procs, out, started + TIMEOUT_S)
    ranks = []
    for rank in range(worker.WORLD):
        with open(out / f"rank{rank}.pkl", "rb") as file:
            ranks.append(pickle.load(file))
    return {"ranks": ranks, "reference": reference, "seconds": time.monotonic() - started}


def case_runs(runs: dict[str, Any], name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    return runs["reference"][name], [r["cases"][name] for r in runs["ranks"]]


def replica_group(case: base.Case, rank: int) -> tuple[int, ...]:
    """The ranks of ``rank``'s replica group (its row of the mesh)."""
    assert case.mesh is not None
    return next(row for row in case.mesh if rank in row)


def torch_total_norm(flat_grads: np.ndarray) -> float:
    """``torch.nn.utils.clip_grad_norm_`` of one process's whole gradients (nothing clipped)."""
    param = torch.zeros(flat_grads.shape, dtype=torch.float32)
    param.grad = torch.from_numpy(flat_grads.astype(np.float32))
    return float(torch.nn.utils.clip_grad_norm_([param], max_norm=math.inf))


@pytest.mark.parametrize("name", list(worker.CASES))
def test_the_one_process_oracle_skips_exactly_the_faulty_steps(
    runs: dict[str, Any], name: str
) -> None:
    reference, _ = case_runs(runs, name)
    base.check_oracle(reference, worker.CASES[name])


@pytest.mark.parametrize("name", list(worker.CASES))
def test_all_four_ranks_take_the_same_decisions_and_end_in_the_same_state(
    runs: dict[str, Any], name: str
) -> None:
    """Flags, norms, scaler state dicts, parameters and optimizer state: the same bits; the
    gradients too, except at the fault step, where one replica group's copy holds the fault."""
    _, ranks = case_runs(runs, name)
    for run in ranks[1:]:
        base.check_same_bits(ranks[0], run, copies_differ=True)


@pytest.mark.parametrize("name", list(worker.CASES))
def test_the_job_matches_one_process_on_the_full_batch(runs: dict[str, Any], name: str) -> None:
    """Same skips, scale and counters; norm and parameters within the compute dtype's rounding.
    A norm summed over both replica groups would be ``sqrt(2)`` times the oracle's."""
    reference, ranks = case_runs(runs, name)
    for run in ranks:
        base.check_matches_oracle(run, reference, worker.CASES[name], finite_norms_only=True)


@pytest.mark.parametrize("name", list(worker.CASES))
def test_the_global_norm_is_clip_grad_norm_of_the_unsharded_gradients(
    runs: dict[str, Any], name: str
) -> None:
    """Against ``clip_grad_norm_`` of the one process's whole gradients (finite steps), and
    against the float64 norm of the faulty replica group's gathered shards (every step)."""
    reference, ranks = case_runs(runs, name)
    case = worker.CASES[name]
    steps = np.flatnonzero(reference["isfinite"])
    expected = [torch_total_norm(reference["grads_unscaled"][step]) for step in steps]
    np.testing.assert_allclose(reference["global_norm"][steps], expected, rtol=1e-6)
    for run in ranks:
        np.testing.assert_allclose(
            run["global_norm"][steps], expected, rtol=base.NORM_RTOL[case.compute_dtype]
        )
        oracle = ranks[case.fault_rank]["torch_norm"]  # the faulty copy decides for everyone
        np.testing.assert_allclose(run["global_norm"], oracle, rtol=1e-6)


@pytest.mark.parametrize("name", list(worker.CASES))
def test_a_fault_in_one_rank_s_copy_skips_the_step_on_all_four_ranks(
    runs: dict[str, Any], name: str
) -> None:
    """Only the faulty rank's replica group sees the fault in its gathered gradients; the other
    group's copy of that shard is finite. All four ranks keep every bit at that step."""
    case = worker.CASES[name]
    _, ranks = case_runs(runs, name)
    step = base.FAULT_STEP
    group = replica_group(case, case.fault_rank)
    for rank, run in enumerate(ranks):
        assert math.isfinite(run["torch_norm"][step]) == (rank not in group), rank
        assert not run["isfinite"][step]
        assert run["unchanged"][step], "parameters or optimizer state changed on a skipped step"
        assert run["state.num_skipped_steps"][step] == 1
        assert math.isnan(case.fault_value) == math.isnan(run["global_norm"][step])


def test_gcc_clips_every_shard_by_the_global_norm(runs: dict[str, Any]) -> None:
    """``clip_coef = min(max_norm / (norm + 1e-6), 1)`` from torch's norm, on every rank."""
    case = worker.CASES["hsdp_sgd_gcc"]
    reference, ranks = case_runs(runs, "hsdp_sgd_gcc")
    assert case.max_gradient_norm is not None
    for run in [reference, *ranks]:
        for step in np.flatnonzero(run["isfinite"]):
            coef = min(case.max_gradient_norm / (run["torch_norm"][step] + 1e-6), 1.0)
            assert coef < 0.1  # the clip does bite
            np.testing.assert_allclose(
                run["grads_final"][step], run["grads_unscaled"][step] * coef, rtol=2e-6, atol=0
            )


@pytest.mark.parametrize("name", list(worker.CASES))
def test_each_decision_gathers_eight_floats_once(
    runs: dict[str, Any], name: str, record_property: Any
) -> None:
    """The gradients never travel: one all-gather of float32[8] per rank and iteration."""
    _, ranks = case_runs(runs, name)
    for run in ranks:
        assert [spies["gathers"] for spies in run["spies"]] == [[(8,)]] * base.STEPS
    record_property("job_seconds", round(runs["seconds"], 1))


def errors(runs: dict[str, Any], key: str) -> list[str]:
    return [run["errors"][key] for run in runs["ranks"]]


def test_a_partial_placement_is_refused_naming_the_mesh_dimension(runs: dict[str, Any]) -> None:
    for message in errors(runs, "partial_1d"):
        assert message.startswith("ValueError: GradScaler got a DTensor gradient with a Partial")
        assert "over mesh dimension 0 ('fsdp'): Partial(sum)" in message
    for message in errors(runs, "partial_2d"):
        assert message.startswith("ValueError") and "Partial placement" in message
        assert "over mesh dimension 1 ('shard'): Partial(sum)" in message


def test_a_shard_over_the_first_mesh_dimension_is_refused_as_tensor_parallelism(
    runs: dict[str, Any],
) -> None:
    """FSDP beside tensor parallelism shards over ``dp`` as well: refused, naming ``dp``."""
    for key in ("tensor_parallel", "tp_replicated"):
        for message in errors(runs, key):
            assert message.startswith("ValueError: GradScaler got a DTensor gradient sharded")
            assert "over mesh dimension 0 ('dp'): Shard(dim=0)" in message
            assert "tensor parallelism" in message and "Replicate() over dimension 0" in message


def test_a_mesh_of_three_dimensions_is_refused_naming_each_placement(
    runs: dict[str, Any],
) -> None:
    for message in errors(runs, "three_dims"):
        assert message.startswith("ValueError") and "got a 3-D mesh" in message
        assert "dimension 0 ('pp'): Replicate()" in message
        assert "dimension 2 ('tp'): Shard(dim=0)" in message


def test_a_process_group_of_one_replica_group_is_refused(runs: dict[str, Any]) -> None:
    """The decision must span every rank of the mesh: one replica group alone could decide
    apart from the other."""
    for rank, message in enumerate(errors(runs, "shard_group")):
        assert message.startswith("ValueError") and "hold different ranks" in message
        own = [0, 1] if rank < 2 else [2, 3]
        assert f"({own} vs [0, 1, 2, 3])" in message
        assert "dist.new_group(mesh.mesh.flatten().tolist())" in message


def test_hsdp_gradients_with_the_default_group_are_decided(runs: dict[str, Any]) -> None:
    assert errors(runs, "hsdp_world") == ["ok"] * worker.WORLD
    expected = str([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]])
    assert errors(runs, "full_tensor") == [expected] * worker.WORLD


# ------------------------------------------- in this process: placements and row order alone


class FakeMesh:
    """What the scaler reads of a device mesh to classify a placement: its dimensions."""

    def __init__(self, names: tuple[str, ...] | None, ndim: int) -> None:
        self.mesh_dim_names, self.ndim = names, ndim


@pytest.mark.parametrize(
    ("placements", "names", "sharded"),
    [
        (("S0",), ("fsdp",), True),  # FSDP2 on a 1-D mesh
        (("R",), ("fsdp",), False),
        (("R", "S0"), ("replicate", "shard"), True),  # HSDP
        (("R", "S1"), None, True),
        (("R", "R"), ("replicate", "shard"), False),  # a replica everywhere
    ],
)
def test_hsdp_placements_are_shards_over_the_last_dimension(
    placements: tuple[str, ...], names: tuple[str, ...] | None, sharded: bool
) -> None:
    from torch_facade.amp._engine import _dtensor

    mesh = FakeMesh(names, len(placements))
    assert _dtensor.is_sharded(tuple(map(placement, placements)), mesh) is sharded


@pytest.mark.parametrize(
    ("placements", "names", "message"),
    [
        (("P",), None, r"Partial placement over mesh dimension 0: Partial\(sum\)"),
        (("R", "P"), ("r", "s"), r"over mesh dimension 1 \('s'\): Partial\(sum\)"),
        (("S0", "S1"), ("dp", "tp"), r"sharded over mesh dimension 0 \('dp'\): Shard\(dim=0\)"),
        (("S0", "R"), None, r"sharded over mesh dimension 0: Shard\(dim=0\) \(placements"),
        (("R", "R", "S0"), None, r"3-D mesh .*dimension 1: Replicate\(\); dimension 2: Shard"),
    ],
)
def test_unsupported_placements_name_the_mesh_dimension_and_the_placement(
    placements: tuple[str, ...], names: tuple[str, ...] | None, message: str
) -> None:
    from torch_facade.amp._engine import _dtensor

    with pytest.raises(ValueError, match=message):
        _dtensor.is_sharded(tuple(map(placement, placements)), FakeMesh(names, len(placements)))


def placement(code: str) -> Any:
    """``"S0"`` -> ``Shard(0)``, ``"R"`` -> ``Replicate()``, ``"P"`` -> ``Partial()``."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if code.startswith("S"):
        return Shard(int(code[1:]))
    return Replicate() if code == "R" else Partial()


def test_the_gathered_rows_are_put_in_the_mesh_s_replica_major_order() -> None:
    """Rows of ranks 0..3 gathered in group order; replica groups {0, 2} and {1, 3}."""
    from torch_facade.amp._engine import _distributed

    gathered = torch.arange(8.0).reshape(4, 2)
    layout = _distributed.MeshLayout(replicas=2, order=(0, 2, 1, 3))
    assert layout.arrange(gathered)[:, 0].tolist() == [0.0, 4.0, 2.0, 6.0]
    assert _distributed.ONE_COPY.arrange(gathered) is gathered
