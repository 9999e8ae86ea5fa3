"""A facade training run that checkpoints every ``EVERY`` steps, for ``test_kill_and_resume.py``.

A small model (float32, AdamW) trains ``STEPS`` steps with the documented loop
(``scaler.scale(loss).backward()``, ``scaler.step(optimizer)``, ``scaler.update()``) under a
dynamic ``cstorch.amp.GradScaler`` with a ratio ``overflow_tolerance``; an inf is written into a
gradient on the steps in ``POISONED``. After every ``EVERY`` steps it saves the model's, the
optimizer's and the scaler's state dicts with ``torch.save`` (written to a temporary name, then
renamed, as a user's checkpoint would be). After each step it appends the step's number and loss
scale to ``progress.txt``; on ``STOP_AT`` it then waits to be killed.

Usage as a script: ``python _facade_resume_worker.py DIR STOP_AT`` (``STOP_AT`` -1: run to the end).
It resumes from ``DIR/ckpt.pt`` when that exists and writes ``DIR/final.pt`` at the end.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from facade_helpers import TinyNet, loss_of

import torch_facade as cstorch

STEPS = 20
EVERY = 5
POISONED = frozenset({3, 7, 8, 13, 16})  # tolerated, halves, halves, tolerated, halves
SCALER = {
    "loss_scale": "dynamic",
    "init_scale": 2.0**8,
    "steps_per_increase": 5,
    "overflow_tolerance": 0.3,
}


def run(directory: Path, stop_at: int) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scaler = cstorch.amp.GradScaler(**SCALER)
    checkpoint = directory / "ckpt.pt"
    start = 0
    if checkpoint.exists():  # a fresh process resumes from the last checkpoint
        saved = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scaler.load_state_dict(saved["scaler"])
        start = saved["step"]
    with open(directory / "progress.txt", "a") as progress:
        for step in range(start, STEPS):
            optimizer.zero_grad()
            scaler.scale(loss_of(model, step)).backward()
            if step in POISONED:
                model.fc1.weight.grad[0, 0] = float("inf")
            scaler.step(optimizer)
            scaler.update()
            if (step + 1) % EVERY == 0:
                state = {
                    "step": step + 1,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(),
                }
                torch.save(state, directory / "ckpt.tmp")
                os.replace(directory / "ckpt.tmp", checkpoint)
            progress.write(f"{step} {float(scaler.get_scale())}\n")
            progress.flush()
            if step == stop_at:
                while True:  # the parent kills this process here
                    time.sleep(1)
    final = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
    }
    torch.save(final, directory / "final.pt")


if __name__ == "__main__":
    run(Path(sys.argv[1]), int(sys.argv[2]))
