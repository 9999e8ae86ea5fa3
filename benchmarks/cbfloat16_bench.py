"""The cbfloat16 preview against float32: whole training iterations of a Hugging Face GPT-2.

``GPT2LMHeadModel`` with 4 layers, d=256, 4 heads, a byte vocabulary (256), random init, one
batch of 8x128 random bytes, AdamW; variants interleaved in one process (each its own copy of
the same model), medians. Run alone: ``python -m benchmarks --sections cbfloat16``.

* ``float32``: forward, backward, ``optimizer.step()``, ``zero_grad()``; no scaler;
* ``cbfloat16 preview``: the same inside ``cstorch.amp.cbfloat16_numerics`` (entered once,
  around the loop, as ``docs/pytorch/cbfloat16.md`` shows), with the facade's DLS scaler;
* ``float16 autocast``, with ``torch.amp.GradScaler`` (the reference) and with the facade's.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

ROUNDS = 5
ITERS = 3
WARMUP = 2
INIT_SCALE = 2.0**16  # no overflow at this size: every timed step is applied


def _gpt2(seed: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=256, n_positions=128, n_embd=256, n_layer=4, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    model.config.use_cache = False
    return model


class _Variant:
    """One row: its own model copy, optimizer and scaler; ``step()`` is one iteration."""

    def __init__(self, name: str, model: torch.nn.Module, step: Callable[[], None]) -> None:
        self.name = name
        self.model = model
        self.step = step
        self.samples: list[float] = []


@contextlib.contextmanager
def _variants(seed: int) -> Iterator[list[_Variant]]:
    import torch_facade as cstorch

    base = _gpt2(seed)
    tokens = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(seed + 1))

    def make(name: str, autocast: torch.dtype | None, scaler: Any) -> _Variant:
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step() -> None:
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                loss = model(input_ids=tokens, labels=tokens).loss
            if scaler is None:
                loss.backward()
                optimizer.step()
                return
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

        return _Variant(name, model, step)

    def facade() -> Any:
        return cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=INIT_SCALE)

    rows = [
        make("float32", None, None),
        make("cbfloat16 preview, facade DLS", None, facade()),
        make("float16 autocast, torch.amp.GradScaler", torch.float16,
             torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)),
        make("float16 autocast, facade DLS", torch.float16, facade()),
    ]  # fmt: skip
    with cstorch.amp.cbfloat16_numerics(rows[1].model):
        yield rows


def run(
    rounds: int = ROUNDS,
    iters: int = ITERS,
    warmup: int = WARMUP,
    seed: int = 0,
    tick: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Times every variant ``rounds`` x ``iters`` times, interleaved; returns the rows."""
    ratios: dict[str, list[float]] = {}
    with warnings.catch_warnings(), _variants(seed) as rows:
        warnings.simplefilter("ignore")  # transformers' and autocast's notes
        for variant in rows:
            for _ in range(warmup):
                variant.step()
        for _ in range(rounds):
            for _ in range(iters):
                for variant in rows:
                    started = time.perf_counter()
                    variant.step()
                    variant.samples.append(time.perf_counter() - started)
            tick()
        reference = rows[0].samples
        for variant in rows:
            ratios[variant.name] = [t / r for t, r in zip(variant.samples, reference, strict=True)]
        return {
            "rounds": rounds,
            "iters": iters,
            "rows": [
                {
                    "case": v.name,
                    "median_ms": 1e3 * statistics.median(v.samples),
                    "ratio_to_float32": statistics.median(ratios[v.name]),
                    "samples_s": v.samples,
                }
                for v in rows
            ],
        }


def markdown(result: dict[str, Any], number: int) -> list[str]:
    """The report's cbfloat16 section."""
    out = [
        f"## {number}. The cbfloat16 preview (Hugging Face GPT-2)",
        "",
        "GPT2LMHeadModel, 4 layers, d=256, 8x128 bytes, random init, AdamW; whole training "
        f"iterations interleaved in one process, {result['rounds']} rounds of "
        f"{result['iters']}; ratio: median over iterations of the ratio to the float32 "
        "iteration next to it (`python -m benchmarks --sections cbfloat16`).",
        "",
        "| variant | median ms | ratio to float32 |",
        "|---|---:|---:|",
    ]
    for row in result["rows"]:
        out.append(f"| {row['case']} | {row['median_ms']:.1f} | {row['ratio_to_float32']:.2f} |")
    return [*out, ""]
