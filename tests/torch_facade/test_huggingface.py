"""A Hugging Face ``transformers`` model trained with the facade's scaler: the cstorch loop around
it, and the ``Trainer`` with the facade's scaler put in place of accelerate's.

The model is a tiny, randomly initialised GPT-2 (``GPT2Config`` with small sizes): nothing is
downloaded (no ``from_pretrained``; the hub is offline). It trains a few float16 steps from a
high initial scale, so that the first steps overflow. The oracle is the same run with
``torch.amp.GradScaler`` with growth off: with power-of-two scales, scaling and unscaling are
exact and both scalers halve on an overflow, so the runs must skip the same steps, go through the
same scales and end with bit-identical parameters.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: nothing downloads

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import facade_helpers
import huggingface_hub
import pytest
import torch
from accelerate.state import AcceleratorState
from transformers import (
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
)

import torch_facade as cstorch

STEPS = 6
BATCH, LENGTH, VOCAB = 2, 16, 64
INIT_SCALE = 2.0**19  # float16 gradients overflow at 2**19, on one batch at 2**18, then not
EXPECTED_SCALES = [2.0**18, 2.0**18, 2.0**17, 2.0**17, 2.0**17, 2.0**17]


@pytest.fixture(autouse=True)
def offline_and_one_thread(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The hub is offline (also if huggingface_hub was imported before this module set the
    variable), and torch uses one thread: float16's small CPU kernels are many times slower
    with OpenMP barriers on shared cores."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_gpt2() -> GPT2LMHeadModel:
    """A randomly initialised two-layer GPT-2, without dropout (the runs must match bit for
    bit, and dropout would draw from torch's generator differently in the Trainer's runs)."""
    model = facade_helpers.tiny_gpt2(vocab=VOCAB, positions=LENGTH)
    assert isinstance(model, GPT2LMHeadModel)
    return model


def token_batches() -> torch.Tensor:
    return torch.randint(
        0, VOCAB, (STEPS, BATCH, LENGTH), generator=torch.Generator().manual_seed(1)
    )


def facade_scaler() -> cstorch.amp.GradScaler:
    return cstorch.amp.GradScaler(
        loss_scale="dynamic", init_scale=INIT_SCALE, max_loss_scale=INIT_SCALE
    )


def torch_scaler() -> torch.amp.GradScaler:
    """torch's scaler with growth off: it halves on overflow, as the facade's DLS does."""
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=10**6)


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def cstorch_loop(scaler: Any) -> dict[str, Any]:
    """The cstorch loop around the model: float16 autocast, clipping after ``unscale_``."""
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scales, changed = [], []
    for tokens in token_batches():
        before = params_of(model)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(input_ids=tokens, labels=tokens).loss
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        scales.append(float(scaler.get_scale()))
        changed.append(
            any(not torch.equal(a, b) for a, b in zip(before, params_of(model), strict=True))
        )
    return {"scales": scales, "changed": changed, "params": params_of(model)}


def test_cstorch_loop_around_gpt2_matches_torch_scaler():
    ours, oracle = cstorch_loop(facade_scaler()), cstorch_loop(torch_scaler())
    assert ours["scales"] == oracle["scales"] == EXPECTED_SCALES
    assert ours["changed"] == oracle["changed"] == [False, True, False, True, True, True]
    for a, b in zip(ours["params"], oracle["params"], strict=True):
        assert torch.equal(a, b)


class RecordScale(TrainerCallback):
    """Records the scaler's scale after every optimizer step of the Trainer."""

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        self.scales: list[float] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.scales.append(float(self.scaler.get_scale()))


def trainer_run(scaler: Any, output_dir: Path) -> dict[str, Any]:
    """``Trainer.train`` with fp16 on the CPU and ``scaler`` put in accelerate's place.

    The Trainer takes no scaler: its ``Accelerator`` (built in ``Trainer.__init__``) holds one
    (``accelerator.scaler``), which ``train()`` hands to the prepared optimizer. The workaround is
    accelerate's: replace it before ``train()``; on the CPU also set ``native_amp`` (accelerate
    makes no scaler and no fp16 autocast there). The learning rate is constant: with a fused
    optimizer (the Trainer's default ``adamw_torch_fused``) accelerate counts a skipped step
    differently for the two scalers while the optimizer has no state yet (torch's scaler calls
    the fused step, the facade does not), and the Trainer steps its schedule by that count.
    """
    AcceleratorState._reset_state(reset_partial_state=True)
    model = tiny_gpt2()
    args = facade_helpers.quiet_cpu_training_arguments(
        output_dir,
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
    )
    data = [{"input_ids": t, "labels": t} for t in token_batches().reshape(-1, LENGTH)]
    record = RecordScale(scaler)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[record])
    assert trainer.accelerator.scaler is None  # fp16 on the CPU: accelerate made none
    assert args.optim == "adamw_torch_fused"
    trainer.accelerator.scaler = scaler  # the workaround, before train()
    trainer.accelerator.native_amp = True
    trainer.train()
    AcceleratorState._reset_state(reset_partial_state=True)
    return {"scales": record.scales, "params": params_of(model)}


def test_trainer_with_the_facade_scaler_matches_torch_scaler(tmp_path: Path):
    ours = trainer_run(facade_scaler(), tmp_path / "facade")
    oracle = trainer_run(torch_scaler(), tmp_path / "torch")
    assert ours["scales"] == oracle["scales"]
    assert ours["scales"] == [2.0**18] + [2.0**17] * (STEPS - 1)  # the first two overflowed
    for a, b in zip(ours["params"], oracle["params"], strict=True):
        assert torch.equal(a, b)
