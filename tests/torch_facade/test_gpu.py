"""The facade on a CUDA GPU (``pytest -m gpu``; skipped without one).

Written before any GPU ran them: each checks one claim of the README's "Sharing a GPU with
torch" against torch itself (its scaler, its sync-debug mode, its memory counters). On a lent
GPU machine with the packages preinstalled, run ``PYTHONPATH=. python -m pytest -m gpu
tests/torch_facade/test_gpu.py -p no:cacheprovider`` (the device check,
``python -m benchmarks.device_check --device cuda``, covers the same ground with numbers).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_facade as cstorch
from torch_facade.amp import _bridge

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DLS = {"loss_scale": "dynamic", "init_scale": 2.0**8, "steps_per_increase": 3}


def model_on(device: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(
        device
    )


def batch(step: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(16, 32, generator=generator), torch.randn(16, 8, generator=generator)
    return x.to(device), y.to(device)


def iteration(model, optimizer, scaler, step, device, fault=None):
    optimizer.zero_grad()
    x, y = batch(step, device)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    if fault is not None:
        model[0].weight.grad[0, 0] = fault
    scaler.step(optimizer)
    scaler.update()


def test_the_state_and_the_decision_live_on_the_gradients_gpu():
    model = model_on("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = cstorch.amp.GradScaler(**DLS)
    iteration(model, optimizer, scaler, 0, "cuda")
    assert scaler._placed_for == torch.device("cuda", torch.cuda.current_device())
    assert {d.platform for d in scaler._state.loss_scale.devices()} == {"gpu"}
    assert scaler.get_scale().device.type == "cuda"
    print("crossing:", _bridge.crossing_for(scaler._placed_for).name)


def test_the_decisions_and_scale_follow_torchs_scaler_with_faults():
    """cstorch DLS with steps_per_increase=3 grows after 4 updates; torch's GradScaler with
    growth_interval=4 after 4 finite ones: equal where no overflow breaks the run of 4."""
    faults = {2: float("inf"), 9: float("nan")}
    ours, theirs = model_on("cuda"), model_on("cuda")
    our_opt = torch.optim.AdamW(ours.parameters(), lr=1e-3, fused=True)
    their_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-3, fused=True)
    scaler = cstorch.amp.GradScaler(**DLS)
    torch_scaler = torch.amp.GradScaler("cuda", init_scale=2.0**8, growth_interval=4)
    for step in range(12):
        iteration(ours, our_opt, scaler, step, "cuda", faults.get(step))
        iteration(theirs, their_opt, torch_scaler, step, "cuda", faults.get(step))
        assert bool(scaler.get_isfinite()) == (step not in faults)
        assert float(scaler.get_scale()) == float(torch_scaler.get_scale()), step
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_a_fused_optimizer_iteration_never_waits_for_the_gpu():
    model = model_on("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(3):  # warm-up: compiles, creates the optimizer state
        iteration(model, optimizer, scaler, step, "cuda")
    x, y = batch(0, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_non_fused_optimizer_reads_the_flag_once_per_iteration():
    model = model_on("cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, foreach=True)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(2):
        iteration(model, optimizer, scaler, step, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                iteration(model, optimizer, scaler, step, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) == 3, [str(w.message) for w in syncs]


def test_jax_takes_only_a_little_gpu_memory():
    free_before, _ = torch.cuda.mem_get_info()
    model = model_on("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(3):
        iteration(model, optimizer, scaler, step, "cuda")
    torch.cuda.synchronize()
    free_after, total = torch.cuda.mem_get_info()
    (device,) = scaler._state.loss_scale.devices()
    stats = device.memory_stats() or {}
    assert stats.get("bytes_in_use", 0) < 64 * 2**20, stats
    # JAX's context, compiled kernels and pool: a few hundred MiB at most, never 75%.
    assert free_before - free_after < 0.1 * total, (free_before, free_after, total)


def test_gradients_at_an_unaligned_offset_are_read():
    model = model_on("cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = cstorch.amp.GradScaler(**DLS)
    params = list(model.parameters())
    flat = torch.zeros(1 + sum(p.numel() for p in params), device="cuda")
    x, y = batch(0, "cuda")
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    offset, expected = 1, []  # 4 bytes in: XLA:GPU would refuse the first view
    for p in params:
        view = flat[offset : offset + p.numel()].view_as(p)
        view.copy_(p.grad)
        expected.append(p.grad / 2.0**8)
        p.grad = view
        offset += p.numel()
    scaler.unscale_(optimizer)
    assert bool(scaler.get_isfinite())
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(p.grad, e)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_model_on_the_second_gpu():
    model = model_on("cuda:1")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = cstorch.amp.GradScaler(**DLS)
    optimizer.zero_grad()
    x, y = batch(0, "cuda:1")
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler._placed_for == torch.device("cuda", 1)
    assert bool(scaler.get_isfinite())
