"""One decision for the whole job: GradScaler across 2 ranks (gloo, CPU) against one process.

Two OS processes join one ``torch.distributed`` job and run every case of
``_distributed_worker.CASES``: DDP with ``gradient_as_bucket_view`` off and on, accumulation
without gradient sync (DDP's ``no_sync()``, FSDP2's ``set_requires_gradient_sync(False)``), a
job that averages gradients with ``dist.all_reduce`` itself, and FSDP2 (``fully_shard``) in
float32, bfloat16 and float16 compute with SGD, Adam (foreach and fused) and AdamW (fused), with
and without DLS + GCC, and with the scaler rebuilt from a saved ``state_dict`` halfway. The
oracle is the same case run here in one process on the full batch. At one step one rank alone
writes an inf or NaN into its gradient; the job must skip that step on both ranks, as the one
process does. The same job also checks the bad inputs (FSDP1, a rank outside the scaler's
group, a mesh over other ranks, ranks that disagree on the scale) and times the collective.

FSDP2 on gloo averages the ranks' gradients in torch 2.13 (pytorch issue 162338: some versions
summed them), so each rank's loss is the mean over its rows and the job's gradients are the
full-batch mean: the comparison with one process needs no rescaling
(``test_fsdp2_on_gloo_averages_the_ranks_gradients``).
"""

from __future__ import annotations

import math
import pickle
import time
from pathlib import Path
from typing import Any

import _distributed_worker as worker
import numpy as np
import pytest
import torch
from _ranks import start_ranks, wait_for_ranks

import torch_facade as cstorch

WORKER = Path(worker.__file__).resolve()
WORLD = 2
TIMEOUT_S = 120.0
REPLICATED = {name for name, case in worker.CASES.items() if case.wrapper != "fsdp2"}
BUCKET_VIEWS = [name for name, case in worker.CASES.items() if case.bucket_view]
FUSED = [name for name, case in worker.CASES.items() if "fused" in case.optimizer]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The job's results per rank, and every case run in this process as the oracle.

    The one-process runs happen while the ranks work.
    """
    out = tmp_path_factory.mktemp("torch_distributed")
    deadline = time.monotonic() + TIMEOUT_S
    procs = start_ranks(WORKER, out, WORLD)
    try:
        reference = {name: worker.run_case(name, None) for name in worker.CASES}
    finally:
        wait_for_ranks(procs, out, deadline)
    ranks = []
    for rank in range(WORLD):
        with open(out / f"rank{rank}.pkl", "rb") as file:
            ranks.append(pickle.load(file))
    return {"ranks": ranks, "reference": reference}


def case_runs(runs: dict[str, Any], name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The one-process run of case ``name`` and each rank's run."""
    return runs["reference"][name], [r["cases"][name] for r in runs["ranks"]]


@pytest.mark.parametrize("name", list(worker.CASES))
def test_one_process_oracle_skips_exactly_the_faulty_steps(runs: dict[str, Any], name: str) -> None:
    """The oracle itself: the fault (and the float16 overflow) skip, and nothing else does."""
    reference, _ = case_runs(runs, name)
    worker.check_oracle(reference, worker.CASES[name])


@pytest.mark.parametrize("name", list(worker.CASES))
def test_every_rank_takes_the_same_decisions_and_ends_in_the_same_state(
    runs: dict[str, Any], name: str
) -> None:
    """Flags, norms, scaler state dicts, parameters and optimizer state: the same bits; the
    gradients too, except at the fault step of a job whose ranks hold replicated copies (the
    fault sits in one rank's copy only: the scaler's outputs must not differ)."""
    first, second = (r["cases"][name] for r in runs["ranks"])
    worker.check_same_bits(first, second, copies_differ=name in REPLICATED)


@pytest.mark.parametrize("name", list(worker.CASES))
def test_the_job_matches_one_process_on_the_full_batch(runs: dict[str, Any], name: str) -> None:
    """Same skips, scale and counters; norm and parameters within the compute dtype's rounding.

    For FSDP2 a factor 2 in the norm would mean the job summed the ranks' gradients instead of
    averaging them (pytorch issue 162338).
    """
    reference, ranks = case_runs(runs, name)
    for run in ranks:
        worker.check_matches_oracle(run, reference, worker.CASES[name])


@pytest.mark.parametrize(
    "name",
    [
        n
        for n, c in worker.CASES.items()
        if c.wrapper == "fsdp2" and c.compute_dtype == torch.float32
    ],
)
def test_fsdp2_on_gloo_averages_the_ranks_gradients(runs: dict[str, Any], name: str) -> None:
    """The first step's unscaled gradients are the full-batch mean's, not twice them."""
    reference, ranks = case_runs(runs, name)
    expected = reference["grads_unscaled"][0]
    for run in ranks:
        np.testing.assert_allclose(run["grads_unscaled"][0], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(worker.CASES))
def test_a_fault_on_one_rank_skips_the_step_on_every_rank(runs: dict[str, Any], name: str) -> None:
    """Only the faulty rank saw a non-finite gradient; both kept every bit at that step."""
    case = worker.CASES[name]
    _, ranks = case_runs(runs, name)
    step = worker.FAULT_STEP
    faulty = ranks[case.fault_rank]
    assert not math.isfinite(faulty["torch_norm"][step])
    if name in REPLICATED:  # the other rank's copy is finite: the decision came from the gather
        assert math.isfinite(ranks[1 - case.fault_rank]["torch_norm"][step])
    for run in ranks:
        assert not run["isfinite"][step]
        assert run["unchanged"][step], "parameters or optimizer state changed on a skipped step"
        assert run["state.num_skipped_steps"][step] == 1
        assert math.isnan(case.fault_value) == math.isnan(run["global_norm"][step])


@pytest.mark.parametrize("name", list(worker.CASES))
def test_the_global_norm_is_the_norm_of_every_rank_s_gradients(
    runs: dict[str, Any], name: str
) -> None:
    """Against torch's float64 norm of the whole gradients (FSDP2: the gathered shards)."""
    case = worker.CASES[name]
    _, ranks = case_runs(runs, name)
    oracle = ranks[case.fault_rank]["torch_norm"]  # the faulty copy decides for everyone
    for run in ranks:
        np.testing.assert_allclose(run["global_norm"], oracle, rtol=1e-6)


@pytest.mark.parametrize("name", [n for n, c in worker.CASES.items() if c.max_gradient_norm])
def test_gcc_clips_every_rank_s_gradients_by_the_global_norm(
    runs: dict[str, Any], name: str
) -> None:
    """``clip_coef = min(max_norm / (norm + 1e-6), 1)`` from torch's norm, on every shard."""
    case = worker.CASES[name]
    reference, ranks = case_runs(runs, name)
    for run in [reference, *ranks]:
        for step in np.flatnonzero(run["isfinite"]):
            coef = min(case.max_gradient_norm / (run["torch_norm"][step] + 1e-6), 1.0)
            assert coef < 0.1  # the clip does bite
            np.testing.assert_allclose(
                run["grads_final"][step], run["grads_unscaled"][step] * coef, rtol=2e-6, atol=0
            )


@pytest.mark.parametrize("name", BUCKET_VIEWS)
def test_ddp_buckets_are_read_once_each_without_copies(runs: dict[str, Any], name: str) -> None:
    """With bucket views, JAX imports exactly DDP's bucket buffers, zero-copy, each once."""
    _, ranks = case_runs(runs, name)
    for run in ranks:
        assert run["bucket_grads"].all(), "a gradient left its bucket (a copy was made)"
        counts = []
        for spies in run["spies"]:
            buckets = {(ptr, numel) for ptr, numel in spies["buckets"]}
            assert len(buckets) == len(spies["buckets"]), "a bucket was all-reduced twice"
            imported = [(ptr, numel) for ptr, numel, _ in spies["imports"]]
            assert sorted(imported) == sorted(buckets)
            assert all(ptr == jax_ptr for ptr, _, jax_ptr in spies["imports"]), "copied"
            counts.append(len(buckets))
        assert max(counts) >= 2, "the test wants several buckets"


def test_ddp_without_bucket_views_reads_each_gradient_in_place(runs: dict[str, Any]) -> None:
    _, ranks = case_runs(runs, "ddp")
    for run in ranks:
        assert not run["bucket_grads"].any()
        for spies in run["spies"]:
            assert len(spies["imports"]) == len(list(worker.MLP().parameters()))
            assert all(ptr == jax_ptr for ptr, _, jax_ptr in spies["imports"])


@pytest.mark.parametrize("name", [n for n, c in worker.CASES.items() if c.wrapper == "fsdp2"])
def test_fsdp2_shards_are_read_zero_copy_through_their_reduce_scatter_buffers(
    runs: dict[str, Any], name: str
) -> None:
    """Each ``fully_shard`` group's shards tile one buffer, imported once, except the last
    layer on rank 1 (3 rows over 2 ranks: its buffer holds a padding row, so its two shards are
    imported apart). Every element of this rank's shards is read once, in place."""
    _, ranks = case_runs(runs, name)
    for run, imports_expected in zip(ranks, (3, 4), strict=True):
        for spies, numel in zip(run["spies"], run["local_numel"], strict=True):
            assert len(spies["imports"]) == imports_expected
            assert sum(n for _, n, _ in spies["imports"]) == numel
            assert all(ptr == jax_ptr for ptr, _, jax_ptr in spies["imports"])


@pytest.mark.parametrize("name", [n for n in worker.CASES])
def test_each_decision_gathers_eight_floats_once(
    runs: dict[str, Any], name: str, record_property: Any
) -> None:
    """The gradients never travel: one all-gather of float32[8] per rank and iteration (two
    partial sums, then the fingerprint: the loss scale, its two counters, the absorbed
    overflows and the spike window's digest in two halves)."""
    _, ranks = case_runs(runs, name)
    for run in ranks:
        assert [spies["gathers"] for spies in run["spies"]] == [[(8,)]] * worker.STEPS
    for key, seconds in runs["ranks"][0]["timing"].items():
        record_property(f"{key}_us", round(seconds * 1e6))


@pytest.mark.parametrize("name", FUSED)
def test_fused_optimizers_skip_and_unscale_in_their_kernel_on_dtensors(
    runs: dict[str, Any], name: str
) -> None:
    """From the second step on (once their state exists) with ``grad_scale``/``found_inf``."""
    reference, ranks = case_runs(runs, name)
    expected = [False] + [True] * (worker.STEPS - 1)
    assert reference["fused"].tolist() == expected
    for run in ranks:
        assert run["fused"].tolist() == expected


def test_fused_sgd_fails_on_dtensors_in_torch_itself(runs: dict[str, Any]) -> None:
    """torch 2.13 has no DTensor rule for ``_fused_sgd_``: the same error without the scaler."""
    model = worker.MLP()
    optimizer = worker.OPTIMIZERS["sgd_fused"](model.parameters())
    scaler = worker.new_scaler(worker.CASES["ddp"])
    x, y = worker.global_batch(0, worker.CASES["ddp"])
    scaler.scale(worker.mse(model(x), y)).backward()
    scaler.step(optimizer)  # one process: plain tensors, fine
    assert bool(scaler.get_isfinite())
    for run in runs["ranks"]:
        errors = run["fused_sgd"]
        assert errors["scaler"] == errors["torch"]
        assert errors["torch"].startswith("NotImplementedError")
        assert "_fused_sgd_" in errors["torch"]


def test_a_scaler_rebuilt_from_its_state_dict_resumes_bit_for_bit(runs: dict[str, Any]) -> None:
    """Saved with torch.save after step 3 on every rank and loaded into fresh scalers."""
    assert worker.CASES["fsdp2_resume"].resume_at == 4
    for run in runs["ranks"]:
        resumed, uninterrupted = run["cases"]["fsdp2_resume"], run["cases"]["fsdp2_adam_fused"]
        assert resumed["state.steps_since_rescale"][3] == 1  # the state carried something
        for key in uninterrupted:
            if key in ("spies", "optimizer_state"):
                continue
            a, b = np.asarray(resumed[key]), np.asarray(uninterrupted[key])
            assert a.tobytes() == b.tobytes(), key
        for key, value in uninterrupted["optimizer_state"].items():
            assert resumed["optimizer_state"][key].tobytes() == value.tobytes(), key


def test_fsdp1_parameters_get_an_error_naming_fsdp2(runs: dict[str, Any]) -> None:
    for run in runs["ranks"]:
        message = run["errors"]["fsdp1"]
        assert message.startswith("ValueError") and "FSDP1" in message
        assert "fully_shard" in message


def test_a_rank_outside_the_process_group_is_refused(runs: dict[str, Any]) -> None:
    first, second = (run["errors"]["outside_group"] for run in runs["ranks"])
    assert first == "ok"  # rank 0 is the group; it trains alone through it
    assert second.startswith("ValueError") and "not a member of process_group" in second


def test_a_mesh_over_other_ranks_than_the_process_group_is_refused(runs: dict[str, Any]) -> None:
    for rank, run in enumerate(runs["ranks"]):
        message = run["errors"]["mesh_group"]
        assert message.startswith("ValueError")
        assert f"([{rank}] vs [0, 1])" in message and "process_group=mesh.get_group()" in message


def test_ranks_that_disagree_on_the_loss_scale_both_raise(runs: dict[str, Any]) -> None:
    for run in runs["ranks"]:
        message = run["errors"]["disagree"]
        assert message.startswith("RuntimeError") and "disagree on the loss scale" in message


def test_the_collective_raises_no_deprecation_warning(runs: dict[str, Any]) -> None:
    """torch 2.13 deprecates ``all_gather_into_tensor``; the scaler must not call it there."""
    for run in runs["ranks"]:
        assert not [w for w in run["warnings"] if "all_gather_into_tensor" in w]


def test_a_scaler_without_a_job_refuses_a_process_group() -> None:
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialized"):
        cstorch.amp.GradScaler(loss_scale="dynamic", process_group=object())
