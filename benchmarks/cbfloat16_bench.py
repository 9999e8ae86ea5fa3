"""The cbfloat16 preview against float32: whole training iterations of a Hugging Face GPT-2,
eagerly and under ``torch.compile``, and the JAX front door's jitted step.

``GPT2LMHeadModel`` with 4 layers, d=256, 4 heads, a byte vocabulary (256), random init, one
batch of 8x128 random bytes, AdamW (:data:`FULL_MODEL`); variants interleaved in one process
(each its own copy of the same model), medians. Run alone:
``python -m benchmarks --full --sections cbfloat16``. The quick run (``make bench``) times
every row on one block of the same width and batch (:data:`QUICK_MODEL`), and the JAX door on
one block of the demo's model (:data:`QUICK_JAX_MODEL`): a cold inductor compile of the 4-layer
model in both formats takes minutes on 2 cores, which a first ``make bench`` paid, and on a
shared machine an eager 4-layer iteration took seconds (torch's threads waiting for each other).

* ``float32``: forward, backward, ``optimizer.step()``, ``zero_grad()``; no scaler;
* ``cbfloat16 preview``: the same inside ``cstorch.amp.cbfloat16_numerics`` (entered once,
  around the loop, as ``docs/pytorch/cbfloat16.md`` shows), with the facade's DLS scaler;
* ``float16 autocast``, with ``torch.amp.GradScaler`` (the reference) and with the facade's;
* ``float32, torch.compile`` and ``cbfloat16 preview, torch.compile``: the model compiled by
  ``torch.compile`` (inductor) inside the loop above; the preview's ratio is to compiled
  float32, and dynamo's counts for it (graphs, breaks, frames compiled after the warm-up) are
  recorded.

The JAX table times the demo's flax NNX GPT (:mod:`workbench.byte_gpt_jax`: 2 layers, width 64,
batch 32 x 64 bytes) in its jitted ``LossScaledOptimizer`` step, float32 against cbfloat16 with and
without loss scaling, all compiled with XLA's default options.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import resource
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from workbench.tables import markdown_table

ROUNDS = 5
ITERS = 6
WARMUP = 5
"""Untimed iterations per variant first: the preview's first iterations also grow the process's
heap (glibc returns memory and faults it back in for several iterations), which a median over
few rounds would otherwise keep."""
INIT_SCALE = 2.0**16  # no overflow at this size: every timed step is applied
COMPILED = "torch.compile"
BACKEND = "inductor"
"""``torch.compile``'s backend for the compiled rows (the harness's test swaps in a cheaper
one; ``tests/torch_facade/test_cbfloat16_compile.py`` compiles the preview with inductor)."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A GPT-2 of the section and its batch of random bytes.

    Attributes:
        layers: transformer blocks.
        width: model width (4 heads).
        batch: sequences per iteration.
        tokens: bytes per sequence (also the model's context).
    """

    layers: int
    width: int
    batch: int
    tokens: int

    def describe(self) -> str:
        """``"4 layers, d=256, 8x128 bytes"``."""
        plural = "s" if self.layers != 1 else ""
        return f"{self.layers} layer{plural}, d={self.width}, {self.batch}x{self.tokens} bytes"


FULL_MODEL = ModelShape(layers=4, width=256, batch=8, tokens=128)
"""The section's model (``--full``)."""

QUICK_MODEL = ModelShape(layers=1, width=256, batch=8, tokens=128)
"""The quick run's model: one block of the same width and batch (inductor compiles one block's
kernels instead of four: its cold compile was most of the section)."""

QUICK_JAX_MODEL = 1
"""Blocks of the JAX door's model in the quick run (the demo's: 2)."""

SMALL_MODEL = ModelShape(layers=1, width=32, batch=2, tokens=16)
"""The harness test's model (``small=True``)."""


def _gpt2(seed: int, shape: ModelShape) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=256, n_positions=shape.tokens, n_embd=shape.width, n_layer=shape.layers,
        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    model.config.use_cache = False
    return model


class _Variant:
    """One row: its own model copy, optimizer and scaler; ``step()`` is one iteration;
    ``reference`` is the row its ratio is taken to."""

    def __init__(
        self, name: str, model: torch.nn.Module, step: Callable[[], None], compiled: bool
    ) -> None:
        self.name = name
        self.model = model
        self.step = step
        self.compiled = compiled
        self.reference = f"float32, {COMPILED}" if compiled else "float32"
        self.samples: list[float] = []  # seconds of each iteration, alternating with the others
        self.faults: list[int] = []  # the process's minor page faults in each of them
        self.blocked: list[float] = []  # seconds, in blocks of this variant's iterations
        self.blocked_faults: list[int] = []


def _timed(step: Callable[[], None], faults: list[int]) -> float:
    """Runs ``step``; appends the process's minor page faults during it to ``faults``; returns
    its seconds."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    started = time.perf_counter()
    step()
    seconds = time.perf_counter() - started
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return seconds


@contextlib.contextmanager
def _variants(seed: int, shape: ModelShape, float16_autocast: bool) -> Iterator[list[_Variant]]:
    """Every row, each with its own copy of the model, inside the previews' numerics."""
    import torch_facade as cstorch

    base = _gpt2(seed, shape)
    generator = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, 256, (shape.batch, shape.tokens), generator=generator)

    def make(
        name: str, autocast: torch.dtype | None, scaler: Any, compiled: bool = False
    ) -> _Variant:
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        call = torch.compile(model, backend=BACKEND) if compiled else model  # at its first call

        def step() -> None:
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                loss = call(input_ids=tokens, labels=tokens).loss
            if scaler is None:
                loss.backward()
                optimizer.step()
                return
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

        return _Variant(name, model, step, compiled)

    def facade() -> Any:
        return cstorch.amp.GradScaler(loss_scale="dynamic", init_scale=INIT_SCALE)

    preview = make("cbfloat16 preview, facade DLS", None, facade())
    compiled_preview = make(
        f"cbfloat16 preview, {COMPILED}, facade DLS", None, facade(), compiled=True
    )
    rows = [make("float32", None, None), preview]
    if float16_autocast:
        rows += [
            make("float16 autocast, torch.amp.GradScaler", torch.float16,
                 torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)),
            make("float16 autocast, facade DLS", torch.float16, facade()),
        ]  # fmt: skip
    rows += [make(f"float32, {COMPILED}", None, None, compiled=True), compiled_preview]
    with (
        cstorch.amp.cbfloat16_numerics(preview.model),
        cstorch.amp.cbfloat16_numerics(compiled_preview.model),
    ):
        yield rows


def _dynamo_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "frames": int(counters["frames"]["total"]),
    }


def run(
    rounds: int = ROUNDS,
    iters: int = ITERS,
    warmup: int = WARMUP,
    seed: int = 0,
    tick: Callable[[], None] = lambda: None,
    small: bool = False,
    jax_iters: int = 10,
    float16_autocast: bool = True,
    quick: bool = False,
) -> dict[str, Any]:
    """Times every variant ``rounds`` x ``iters`` times, interleaved; returns the rows, and the
    JAX door's under ``"jax"`` (``rounds`` x ``jax_iters`` steps; 0: not run).

    ``small``: every model at :data:`SMALL_MODEL` and the JAX door's at its small size (the
    harness test's). ``float16_autocast``: also the two float16 ``torch.autocast`` rows (on a
    CPU without float16 arithmetic, AVX-512 FP16 or AMX, an iteration takes seconds there, many
    times float32's: ``docs/performance-notes.md``). ``quick``: the quick run's models,
    :data:`QUICK_MODEL` and :data:`QUICK_JAX_MODEL`.
    """
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    shape = SMALL_MODEL if small else QUICK_MODEL if quick else FULL_MODEL
    with warnings.catch_warnings(), _variants(seed, shape, float16_autocast) as rows:
        warnings.simplefilter("ignore")  # transformers' and autocast's notes
        compiled_preview = rows[-1]
        after_warmup = _dynamo_counts()
        for variant in rows:
            for _ in range(max(1, warmup) if variant.compiled else warmup):
                variant.step()  # a compiled variant compiles here, before the counts
            if variant is compiled_preview:
                after_warmup = _dynamo_counts()
        preview = rows[1]  # the eager preview (see _variants)
        eager_pair = [rows[0], preview]
        for _ in range(rounds):
            for _ in range(iters):  # alternating single iterations, as users compare
                for variant in rows:
                    variant.samples.append(_timed(variant.step, variant.faults))
            for variant in eager_pair:  # then blocks of iterations of each
                for _ in range(iters):
                    variant.blocked.append(_timed(variant.step, variant.blocked_faults))
            tick()
        at_end = _dynamo_counts()
        by_name = {v.name: v for v in rows}
        ratios = {
            v.name: [t / r for t, r in zip(v.samples, by_name[v.reference].samples, strict=True)]
            for v in rows
        }
        float32 = by_name["float32"]
        blocked = [t / r for t, r in zip(preview.blocked, float32.blocked, strict=True)]
        result = {
            "rounds": rounds,
            "iters": iters,
            "model": dataclasses.asdict(shape),
            "compiled": {
                **at_end,
                "frames_compiled_after_warmup": at_end["frames"] - after_warmup["frames"],
            },
            "rows": [
                {
                    "case": v.name,
                    "reference": v.reference,
                    "median_ms": 1e3 * statistics.median(v.samples),
                    "ratio_to_float32": statistics.median(ratios[v.name]),
                    "spread": [min(ratios[v.name]), max(ratios[v.name])],
                    "samples_s": v.samples,
                    "minor_faults_per_iteration": statistics.median(v.faults),
                    "minor_faults_max": max(v.faults),
                }
                for v in rows
            ],
            "blocked": {
                "case": preview.name,
                "ratio_to_float32": statistics.median(blocked),
                "spread": [min(blocked), max(blocked)],
                "minor_faults_per_iteration": statistics.median(preview.blocked_faults),
                "float32_minor_faults_per_iteration": statistics.median(float32.blocked_faults),
                "samples_s": preview.blocked,
                "float32_samples_s": float32.blocked,
            },
        }
    layers = QUICK_JAX_MODEL if quick else None
    result["jax"] = run_jax(rounds, jax_iters, seed, small, layers) if jax_iters else None
    return result


def run_jax(
    rounds: int = ROUNDS,
    iters: int = 10,
    seed: int = 0,
    small: bool = False,
    layers: int | None = None,
) -> dict[str, Any]:
    """The demo's JAX door's model and jitted flax NNX step (:mod:`workbench.byte_gpt_jax`), float32 against cbfloat16 (with the
    library's dynamic loss scaling and without), interleaved; medians of the ratios.

    ``small``: 1 layer of width 32, 4 x 16 bytes (the harness test's size); ``layers``: the
    demo's model with this many blocks (default: the demo's 2)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import amp_core
    from amp_core.flax_nnx import LossScaledOptimizer
    from workbench.byte_gpt import ModelSize, Settings
    from workbench.byte_gpt_jax import GPT, adamw, loss_scaled_step

    settings = Settings(seed=seed)
    if layers is not None:
        size = dataclasses.replace(settings.size, n_layer=layers)
        settings = dataclasses.replace(settings, size=size)
    if small:
        settings = Settings(
            seed=seed, batch_size=4, size=ModelSize(n_layer=1, n_embd=32, n_positions=16)
        )
    rng = jax.random.key(seed)
    windows = jax.random.randint(rng, (settings.batch_size, settings.size.n_positions + 1), 0, 256)
    divisor = jnp.float32(1.0)
    step_fn = jax.jit(loss_scaled_step, static_argnums=0, donate_argnums=1)
    variants: dict[str, list[Any]] = {}
    for name, fmt, config in (
        ("float32", "float32", amp_core.StaticLossScale()),
        ("cbfloat16, no scaling", "cbfloat16", amp_core.StaticLossScale()),
        ("cbfloat16 + DLS", "cbfloat16", amp_core.DynamicLossScale(half_dtype="cbfloat16")),
    ):
        model = GPT(settings.size, seed, fmt)
        optimizer = LossScaledOptimizer(model, adamw(settings), config, wrt=nnx.Param)
        graphdef, state = nnx.split((model, optimizer))
        variants[name] = [graphdef, state]
    samples: dict[str, list[float]] = {name: [] for name in variants}

    def step(name: str) -> float:
        graphdef, state = variants[name]
        started = time.perf_counter()
        state, loss, _, _ = step_fn(graphdef, state, windows, divisor)
        jax.block_until_ready(loss)
        variants[name][1] = state
        return time.perf_counter() - started

    for name in variants:  # compile and warm up
        step(name)
        step(name)
    for _ in range(rounds):
        for _ in range(iters):
            for name in variants:
                samples[name].append(step(name))
    rows = []
    for name, times in samples.items():
        ratios = [t / r for t, r in zip(times, samples["float32"], strict=True)]
        rows.append(
            {
                "case": name,
                "median_ms": 1e3 * statistics.median(times),
                "ratio_to_float32": statistics.median(ratios),
                "spread": [min(ratios), max(ratios)],
            }
        )
    return {"rounds": rounds, "iters": iters, "size": dataclasses.asdict(settings.size),
            "batch": settings.batch_size, "rows": rows}  # fmt: skip


def _ratio_table(rows: list[dict[str, Any]]) -> list[str]:
    """A variant per row: its median ms, its ratio to float32 and the ratio's spread, and the
    process's minor page faults per iteration (median, max) where they were counted."""
    faults = all("minor_faults_per_iteration" in row for row in rows)
    body = []
    for row in rows:
        low, high = row.get("spread", (row["ratio_to_float32"],) * 2)
        ratio = f"{row['ratio_to_float32']:.2f}"
        cells = [row["case"], f"{row['median_ms']:.1f}", ratio, f"[{low:.2f}, {high:.2f}]"]
        if faults:
            cells.append(f"{row['minor_faults_per_iteration']:.0f} ({row['minor_faults_max']})")
        body.append(cells)
    header = ["variant", "median ms", "ratio to float32", "spread"]
    header += ["page faults / iteration (max)"] if faults else []
    return markdown_table(header, body, ["l", "r", "r", "l"] + (["r"] if faults else []))


def _jax_model(result: dict[str, Any]) -> str:
    """``"2 layers, width 64, 32 x 64 bytes"`` (the demo's size where a result lacks it).

    Example:
        >>> _jax_model({"size": {"n_layer": 1, "n_embd": 64, "n_positions": 64}, "batch": 32})
        '1 layer, width 64, 32 x 64 bytes'
    """
    size = result.get("size") or {"n_layer": 2, "n_embd": 64, "n_positions": 64}
    layers = size["n_layer"]
    return (
        f"{layers} layer{'s' if layers != 1 else ''}, width {size['n_embd']}, "
        f"{result.get('batch', 32)} x {size['n_positions']} bytes"
    )


def markdown(result: dict[str, Any], number: int) -> list[str]:
    """The report's cbfloat16 section."""
    counts = result.get("compiled")
    shape = ModelShape(**result.get("model", dataclasses.asdict(FULL_MODEL)))
    out = [
        f"## {number}. The cbfloat16 preview (Hugging Face GPT-2)",
        "",
        f"GPT2LMHeadModel, {shape.describe()}, random init, AdamW; whole training "
        f"iterations interleaved in one process, {result['rounds']} rounds of "
        f"{result['iters']}; ratio: median over iterations of the ratio to the float32 "
        "iteration next to it, eager to eager and compiled to compiled, with its spread "
        "[min, max] (`python -m benchmarks --sections cbfloat16`).",
        "",
        *_ratio_table(result["rows"]),
    ]
    blocked = result.get("blocked")
    if blocked:
        low, high = blocked["spread"]
        out += [
            "",
            f"The eager preview in blocks of {result['iters']} iterations of each (float32's "
            f"block, then the preview's, every round) instead of alternating single "
            f"iterations: ratio {blocked['ratio_to_float32']:.2f} [{low:.2f}, {high:.2f}], "
            f"{blocked['minor_faults_per_iteration']:.0f} minor page faults an iteration "
            f"(float32 {blocked['float32_minor_faults_per_iteration']:.0f}).",
        ]
    if counts:
        out += [
            "",
            f"Dynamo, both compiled models: {counts['graphs']} graphs, "
            f"{counts['graph_breaks']} graph breaks (transformers' built-in loss logs a note "
            f"through its logger: one break per model); frames compiled after the warm-up: "
            f"{counts['frames_compiled_after_warmup']}.",
        ]
    jax_result = result.get("jax")
    if jax_result:
        out += [
            "",
            f"The JAX front door: the demo's flax NNX GPT ({_jax_model(jax_result)}) in "
            "its jitted `LossScaledOptimizer` step, interleaved, "
            f"{jax_result['rounds']} rounds of {jax_result['iters']}:",
            "",
            *_ratio_table(jax_result["rows"]),
        ]
    return [*out, ""]
