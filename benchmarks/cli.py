"""Command line of ``python -m benchmarks`` (``make bench``, ``make bench-large``).

Examples::

    python -m benchmarks                            # every section, quick: S, 3 rounds
    python -m benchmarks --full                     # the documented numbers: S, M, tiny, 5 rounds

The quick run (``make bench``: 4:37 from a fresh clone with every cache cold on 2 idle cores;
the measured time and where it goes: ``docs/performance-notes.md``) cuts, against ``--full``:
the sizes (S only: the host section's 148 one-element gradients measure what tiny's fixed cost
shows, and XLA compiles the jax section's gated floor over tiny's
148 one-element leaves for minutes); the rounds (3; the start-up section's 2); whole iterations
with torch's default ``zero_grad()`` only; the JAX train step at S without its accumulated loss;
the cbfloat16 section on 1-block models, 4 iterations a round, no float16 autocast rows; the
memory section's variants, iterations and processes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks import host_bench, plots, report
from benchmarks.ddp_bench import ITERS as DDP_ITERS
from benchmarks.runner import (
    FULL_ROUNDS,
    QUICK_CBFLOAT16_ITERS,
    QUICK_ROUNDS,
    QUICK_STARTUP_ROUNDS,
    SECTIONS,
    BenchOptions,
    run,
)
from benchmarks.torch_bench import WARMUP_STEPS
from workbench.processes import comma_names
from workbench.sizes import FULL_SIZES, QUICK_SIZES, SIZES


def _sizes(text: str) -> tuple[str, ...]:
    return comma_names(text, tuple(SIZES), "sizes")


def _size(text: str) -> str:
    if text not in SIZES:
        raise argparse.ArgumentTypeError(f"unknown size {text!r}; choose from {', '.join(SIZES)}")
    return text


def _sections(text: str) -> tuple[str, ...]:
    return comma_names(text, tuple(SECTIONS), "sections")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text}")
    return value


def _counts(text: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers."""
    try:
        counts = tuple(_positive(s.strip()) for s in text.split(",") if s.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected positive integers; got {text!r}") from error
    if not counts:
        raise argparse.ArgumentTypeError(f"expected positive integers; got {text!r}")
    return counts


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m benchmarks``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=(
            "Measure the loss scalers side by side, variants interleaved in one process. "
            "Sections: 'whole' = whole iterations of the documented loop (forward, backward, "
            "scaler, optimizer.step(), zero_grad() with torch's default) with the facade "
            "against torch.amp.GradScaler and a bare loop; 'scaler' = the scaler alone on "
            "gradients refilled in place, with the bandwidth floor; 'ddp' = whole iterations "
            "under DistributedDataParallel, 2 ranks on the CPU (small, noisy); 'step' = the "
            "JAX train step as users write it (forward, backward and optax AdamW in one jit), "
            "amp_core against plain optax, the floor, jmp, flax's DynamicScale and mpx, with "
            "each scaler's skip and growth checked; 'jax' = the jitted optax step on gradients "
            "passed in (a narrower second view); 'host' = the host cost per gradient tensor "
            "(one-element gradients, nothing to compute); 'startup' = import time and the "
            "first iteration of a first and a second run, in fresh processes; 'cbfloat16' = the "
            "cbfloat16 preview against float32 on a Hugging Face GPT-2 (alternating single "
            "iterations and blocks of them, with page faults); 'memory' = peak RSS of whole "
            "iterations, a fresh process per variant (the facade, torch's scaler and plain "
            "float32, the cbfloat16 preview, float16 with master weights). Prints a markdown "
            "report and writes "
            "it with a JSON file of every raw number and PNG plots."
        ),
    )
    parser.add_argument(
        "--sections",
        type=_sections,
        default=SECTIONS,
        help=f"comma-separated sections among {', '.join(SECTIONS)}, always reported in that order "
        f"(default: all)",
    )
    parser.add_argument(
        "--no-ddp",
        action="store_true",
        help="leave the DDP section out (two spawned ranks: about half a minute)",
    )
    parser.add_argument(
        "--ddp-size",
        type=_size,
        default="S",
        help="model size of the DDP section (default S)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help=f"the documented run: sizes {','.join(FULL_SIZES)}, {FULL_ROUNDS} rounds, whole "
        "iterations with both zero_grad() settings, the step section at M with its three losses, "
        "the cbfloat16 section on the 4-layer GPT-2 with float16 autocast rows, every memory "
        "variant in 3 processes (about 25 minutes on 2 cores; default: the quick run, size "
        f"{','.join(QUICK_SIZES)}, {QUICK_ROUNDS} rounds (start-up {QUICK_STARTUP_ROUNDS}), "
        "zero_grad() with torch's default only, the step section at S without its accumulated "
        f"loss, the cbfloat16 section on 1-block models and {QUICK_CBFLOAT16_ITERS} iterations a "
        "round, 4 memory variants in one process each: about 5 minutes from a fresh clone)",
    )
    parser.add_argument(
        "--step-size",
        type=_size,
        default=None,
        help="the parameter layout of the step section (default S: 20 leaves, 1.1M params; "
        "with --full M: 148 leaves, 28.0M params)",
    )
    parser.add_argument(
        "--sizes",
        type=_sizes,
        default=None,
        help=f"comma-separated sizes among {', '.join(SIZES)} for every section but ddp and "
        f"host (default {','.join(QUICK_SIZES)}; with --full {','.join(FULL_SIZES)})",
    )
    parser.add_argument(
        "--host-tensors",
        type=_counts,
        default=host_bench.TENSORS,
        help="comma-separated gradient tensor counts of the host section (default "
        f"{','.join(map(str, host_bench.TENSORS))})",
    )
    parser.add_argument("--large", action="store_true", help="also run the L size (~120M params)")
    parser.add_argument(
        "--rounds",
        type=_positive,
        default=None,
        help=f"timed rounds per group (default {QUICK_ROUNDS}; with --full {FULL_ROUNDS})",
    )
    parser.add_argument(
        "--iters",
        type=_positive,
        default=None,
        help="timed steps per variant and round (default: per size, 20 for S and tiny, 5 for M, "
        f"3 for L, fewer when steps are slow; DDP {DDP_ITERS})",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=WARMUP_STEPS,
        help=f"untimed steps per variant after the first (default {WARMUP_STEPS})",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench_output"),
        help="folder for bench.md, bench.json and the plots (default bench_output)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of models, tokens and gradients (default 0)"
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmarks, prints the markdown report and writes it with the JSON file.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status (0).
    """
    args = build_parser().parse_args(argv)
    sizes = tuple(args.sizes or (FULL_SIZES if args.full else QUICK_SIZES))
    if args.large and "L" not in sizes:
        sizes += ("L",)
    sections = tuple(s for s in args.sections if not (args.no_ddp and s == "ddp"))
    if not sections:
        raise SystemExit("python -m benchmarks: no section left to run")
    options = BenchOptions(
        sizes=sizes,
        sections=sections,
        ddp_size=args.ddp_size,
        step_size=args.step_size or ("M" if args.full else "S"),
        host_tensors=tuple(args.host_tensors),
        rounds=args.rounds or (FULL_ROUNDS if args.full else QUICK_ROUNDS),
        full=args.full,
        iters=args.iters,
        warmup=max(0, args.warmup),
        seed=args.seed,
        progress=not args.no_progress,
    )
    results = run(options, sys.argv[1:] if argv is None else list(argv))
    md_path, json_path = report.write(results, args.out)
    images = plots.write_plots(results, args.out)
    print(report.markdown(results), end="")
    print(f"\nWrote {', '.join(str(p) for p in (md_path, json_path, *images))}")
    return 0
