"""GPT-2 held in float16 or bfloat16, trained with and without ``cstorch.amp.with_master_weights``.

The measurement behind docs/pytorch/master-weights.md (``test_master_weights.py`` runs a short
version of it). The demo's model, data and schedule (``demo.text``, ``demo.torch_door``:
transformers' ``GPT2LMHeadModel``, 2 layers of width 64, bytes of the standard library's
source, AdamW with warm-up and cosine decay), but the model itself is cast to the half dtype,
as ``from_pretrained(torch_dtype=torch.float16)`` loads it: forward, backward and the
parameters are in that dtype (the demo keeps float32 parameters and rounds around them).

Rows: ``float32`` (the oracle: a float32 model, no loss scaling), ``<dtype>+masters`` (the half
model, its AdamW wrapped by ``with_master_weights``) and ``<dtype>`` (the half model, AdamW on
it), float16 rows with ``GradScaler(loss_scale="dynamic")``. Run from the repository root::

    PYTHONPATH=. python tests/torch_facade/master_weights_gpt.py --steps 300 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
import warnings

import numpy as np
import torch

import torch_facade as cstorch
from demo.text import Settings, held_out_windows, load_corpus, training_windows
from demo.torch_door import cross_entropy, held_out_loss, make_model

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Result:
    """One row at one seed: the final held-out loss (of the model as it is held), the last
    training loss, steps skipped for overflow, and the first step after which a parameter held
    inf or NaN (``None``: none did)."""

    row: str
    seed: int
    held_out_loss: float
    last_train_loss: float
    skipped: int
    first_nonfinite_step: int | None


def train(row: str, seed: int, steps: int, batch_size: int = 16, eval_windows: int = 128) -> Result:
    """Trains ``row`` (``"float32"``, ``"float16"``, ``"float16+masters"``, ``"bfloat16"``,
    ``"bfloat16+masters"``) for ``steps`` steps of ``batch_size`` windows from the demo's
    weights of ``seed``; the held-out loss is measured on ``eval_windows`` windows."""
    dtype_name, _, masters = row.partition("+")
    dtype = DTYPES[dtype_name]
    settings = Settings(steps=steps, seed=seed, batch_size=batch_size, eval_windows=eval_windows)
    corpus = load_corpus()
    batches, held_out = training_windows(corpus, settings), held_out_windows(corpus, settings)
    model = make_model(settings.size, seed).to(dtype)  # as from_pretrained(torch_dtype=...)
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay
    )
    if masters:
        optimizer = cstorch.amp.with_master_weights(optimizer)
    scaler = cstorch.amp.GradScaler(loss_scale="dynamic") if dtype is torch.float16 else None
    loss = math.nan
    first_nonfinite: int | None = None
    for step in range(steps):
        lr = float(settings.learning_rate_at(step))
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_tensor = cross_entropy(model, torch.from_numpy(batches[step]))
        if scaler is None:
            loss_tensor.backward()
            optimizer.step()
        else:
            scaler.scale(loss_tensor).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
        loss = float(loss_tensor.detach())
        if first_nonfinite is None and not all(torch.isfinite(p).all() for p in model.parameters()):
            first_nonfinite = step
    skipped = 0 if scaler is None else int(scaler.get_num_skipped_steps())
    return Result(row, seed, held_out_loss(model, held_out), loss, skipped, first_nonfinite)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--rows",
        nargs="+",
        default=["float32", "float16+masters", "float16", "bfloat16+masters", "bfloat16"],
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="GradScaler is unscaling gradients")
    print("| row | seed | held-out loss | last training loss | skipped | first inf/NaN | s |")
    print("|---|---|---|---|---|---|---|")
    results: dict[str, list[float]] = {}
    for row in args.rows:
        for seed in args.seeds:
            start = time.perf_counter()
            r = train(row, seed, args.steps)
            elapsed = time.perf_counter() - start
            results.setdefault(row, []).append(r.held_out_loss)
            print(
                f"| {row} | {seed} | {r.held_out_loss:.4f} | {r.last_train_loss:.4f} | "
                f"{r.skipped} | {r.first_nonfinite_step} | {elapsed:.0f} |",
                flush=True,
            )
    for row, losses in results.items():
        values = np.asarray(losses)
        print(f"{row}: held-out loss {values.min():.4f} .. {values.max():.4f}")


if __name__ == "__main__":
    main()
