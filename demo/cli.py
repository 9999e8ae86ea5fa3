"""Command line of ``python -m demo`` (and ``make demo``)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from demo.problem import RunOptions, make_problem
from demo.records import RunRecord
from demo.registry import KNOWN_PATHS, PATHS, load_paths
from demo.report import comparison_lines, plot_records, provenance_lines, summary_table


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m demo``."""
    parser = argparse.ArgumentParser(
        prog="python -m demo",
        description=(
            "Train a small MLP on synthetic data with float16 compute and dynamic loss scaling "
            "(starting from a scale that overflows float16), next to a float32 run; print a "
            "summary table and save a plot of loss and loss scale per step."
        ),
    )
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--seed", type=int, default=0, help="seed of data and init (default 0)")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path("demo_output"),
        help="folder for the plots (default demo_output)",
    )
    parser.add_argument(
        "--path",
        choices=("all", *KNOWN_PATHS),
        default="all",
        help="which implementation to run; 'all' runs every available one (default all)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    parser.add_argument(
        "--distributed",
        action="store_true",
        help=(
            "train the torch path data-parallel (DDP and FSDP2, gloo): as one rank of a "
            "torchrun job, or starting 2 local ranks (see demo/distributed.py)"
        ),
    )
    return parser


def run_paths(
    names: Sequence[str], steps: int, seed: int, out_dir: Path, options: RunOptions
) -> tuple[list[RunRecord], list[Path]]:
    """Runs the named paths on one shared problem and saves one plot per path.

    Args:
        names: registered path names, in the order to run them.
        steps: training steps.
        seed: seed of the problem.
        out_dir: folder of the plots (``<path>_demo.png``, plus ``comparison.png`` when
            several paths ran).
        options: progress bar and diagnostics switches.

    Returns:
        All records, and the plots written.
    """
    problem = make_problem(steps=steps, seed=seed)
    records: list[RunRecord] = []
    plots: list[Path] = []
    for name in names:
        path_records = PATHS[name](problem, options)
        records.extend(path_records)
        plots.append(
            plot_records(
                path_records,
                out_dir / f"{name}_demo.png",
                title=f"{name}: float16 + dynamic loss scaling vs float32 ({steps} steps)",
            )
        )
    if len(names) > 1:
        plots.append(
            plot_records(records, out_dir / "comparison.png", title=f"All paths ({steps} steps)")
        )
    return records, plots


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parses ``argv``, runs the demo, prints the report.

    Returns:
        The process exit status.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be a positive integer; got {args.steps}")
    if args.distributed:
        from demo.distributed import run

        options = RunOptions(progress=not args.no_progress, diagnostics=False)
        return run(args.steps, args.seed, args.out_dir, options)
    unavailable = load_paths()
    if args.path == "all":
        names = [name for name in KNOWN_PATHS if name in PATHS]  # fixed, not import, order
        for name, reason in unavailable.items():
            print(f"note: the {name} path is not available yet ({reason}); skipping it", flush=True)
    elif args.path in unavailable:
        parser.error(f"the {args.path} path is not available: {unavailable[args.path]}")
    else:
        names = [args.path]
    print(
        f"Training a small MLP for {args.steps} steps (seed {args.seed}); paths: {', '.join(names)}",
        flush=True,
    )
    options = RunOptions(progress=not args.no_progress)
    records, plots = run_paths(names, args.steps, args.seed, args.out_dir, options)
    print()
    print(summary_table(records))
    print()
    for text in [*comparison_lines(records), *provenance_lines(records)]:
        print(text)
    for plot in plots:
        print(f"plot saved to {os.path.relpath(plot) if not plot.is_absolute() else plot}")
    sys.stdout.flush()
    return 0
