"""The facade on a CUDA GPU (``pytest -m gpu``; skipped without one).

Written before any GPU ran them: each checks one claim of "Sharing a GPU with torch" in
docs/gpus.md against torch itself (its scaler, its sync-debug mode, its memory counters). On a lent
GPU machine with the packages preinstalled, run ``PYTHONPATH=. python -m pytest -m gpu
tests/torch_facade/test_gpu.py -p no:cacheprovider`` (the device check,
``python -m device_check --device cuda``, covers the same ground with numbers).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from facade_helpers import run_python

import torch_facade as cstorch
from torch_facade.amp._engine import _dlpack, _storage

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
    assert scaler._engine.placed_for == torch.device("cuda", torch.cuda.current_device())
    assert {d.platform for d in scaler._engine.state.loss_scale.devices()} == {"gpu"}
    assert scaler.get_scale().device.type == "cuda"
    print("crossing:", _dlpack.crossing_for(scaler._engine.placed_for).name)


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

    def one_iteration(sleep_cycles: int = 0) -> None:
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        scaler.step(optimizer)
        scaler.update()

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # torch's own synchronising calls raise
    try:
        for _ in range(3):
            one_iteration()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    # JAX's host waits are invisible to torch's sync-debug mode: with about a second of device
    # work queued after backward, a scaler that waited for the device would find it idle after.
    for _ in range(2):
        torch.cuda.synchronize()
        one_iteration(sleep_cycles=2_000_000_000)
        assert not torch.cuda.current_stream().query(), "the host waited for the device"


def test_a_non_fused_optimizer_reads_the_flag_once_per_iteration():
    model = model_on("cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, foreach=True)
    scaler = cstorch.amp.GradScaler(**DLS)
    for step in range(2):
        iteration(model, optimizer, scaler, step, "cuda")
    batches = [batch(step, "cuda") for step in range(3)]  # their copies to the GPU sync too
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in batches:
                optimizer.zero_grad()
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = torch.nn.functional.mse_loss(model(x).float(), y)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) == 3, [str(w.message) for w in syncs]


def test_jax_takes_only_a_little_gpu_memory():
    """In a fresh process, with the defaults a user gets: JAX must not take 75% of the GPU."""
    out = run_python(  # a GPU process starts slowly
        "import json, torch, torch_facade as cstorch\n"
        "model = torch.nn.Linear(64, 64).cuda()\n"
        "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)\n"
        "scaler = cstorch.amp.GradScaler(loss_scale='dynamic')\n"
        "torch.cuda.synchronize(); before, total = torch.cuda.mem_get_info()\n"
        "for _ in range(3):\n"
        "    optimizer.zero_grad()\n"
        "    scaler.scale(model(torch.ones(8, 64, device='cuda')).square().mean()).backward()\n"
        "    scaler.step(optimizer); scaler.update()\n"
        "torch.cuda.synchronize(); after, _ = torch.cuda.mem_get_info()\n"
        "(device,) = scaler._engine.state.loss_scale.devices()\n"
        "stats = device.memory_stats() or {}\n"
        "print(json.dumps({'drop': before - after, 'total': total,\n"
        "                  'in_use': stats.get('bytes_in_use', 0)}))\n",
        timeout=300,
    )
    assert out["in_use"] < 64 * 2**20, out
    # JAX's context, kernels and pool: a few hundred MiB at most, never 75% of the GPU.
    assert out["drop"] < 0.1 * out["total"], out


def test_gradients_at_an_unaligned_offset_are_read(monkeypatch):
    monkeypatch.setattr(_storage, "SMALL_GRADIENT", 0)  # each view crosses by itself
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
    """In a fresh process: the facade then opens GPU 1 only for JAX (in this process JAX was
    started for another GPU by the tests before)."""
    out = run_python(  # a GPU process starts slowly
        "import json, torch, torch_facade as cstorch\n"
        "model = torch.nn.Linear(16, 4).to('cuda:1')\n"
        "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)\n"
        "scaler = cstorch.amp.GradScaler(loss_scale='dynamic')\n"
        "optimizer.zero_grad()\n"
        "scaler.scale(model(torch.ones(2, 16, device='cuda:1')).sum()).backward()\n"
        "scaler.step(optimizer); scaler.update()\n"
        "print(json.dumps({'placed': str(scaler._engine.placed_for),\n"
        "                  'finite': bool(scaler.get_isfinite())}))\n",
        timeout=300,
    )
    assert out == {"placed": "cuda:1", "finite": True}
