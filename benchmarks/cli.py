"""Command line of ``python -m benchmarks`` (``make bench``, ``make bench-large``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks import report
from benchmarks.runner import DEFAULT_ROUNDS, BenchOptions, run
from benchmarks.sizes import DEFAULT_SIZES, SIZES
from benchmarks.torch_bench import WARMUP_STEPS


def _sizes(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in names if s not in SIZES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown sizes {unknown or text!r}; choose from {', '.join(SIZES)}"
        )
    return names


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m benchmarks``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=(
            "Measure the loss scalers side by side in one process: the torch facade against "
            "torch.amp.GradScaler, the JAX-native optax path, the bandwidth floor and the "
            "compile counts. Prints a markdown table and writes it with a JSON file of every "
            "raw number."
        ),
    )
    parser.add_argument(
        "--sizes",
        type=_sizes,
        default=DEFAULT_SIZES,
        help=f"comma-separated sizes among {', '.join(SIZES)} (default {','.join(DEFAULT_SIZES)})",
    )
    parser.add_argument("--large", action="store_true", help="also run the L size (~120M params)")
    parser.add_argument(
        "--rounds",
        type=_positive,
        default=DEFAULT_ROUNDS,
        help=f"timed rounds per group (default {DEFAULT_ROUNDS})",
    )
    parser.add_argument(
        "--iters",
        type=_positive,
        default=None,
        help="timed steps per variant and round (default: per size, 20 for S and tiny, 5 for M, 3 for L)",
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
        help="folder for bench.md and bench.json (default bench_output)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the gradients (default 0)")
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
    sizes = tuple(args.sizes)
    if args.large and "L" not in sizes:
        sizes += ("L",)
    options = BenchOptions(
        sizes=sizes,
        rounds=args.rounds,
        iters=args.iters,
        warmup=max(0, args.warmup),
        seed=args.seed,
        progress=not args.no_progress,
    )
    results = run(options, sys.argv[1:] if argv is None else list(argv))
    md_path, json_path = report.write(results, args.out)
    print(report.markdown(results), end="")
    print(f"\nWrote {md_path} and {json_path}")
    return 0
