"""Command line of ``python -m demo`` (and ``make demo``).

``python -m demo`` trains the quick run (both front doors, every row, then the loss-scaling
sweep at k = 1 and 256, :mod:`demo.sweep`) and writes ``demo_output/demo.md``, ``demo.json`` and
the PNGs; ``--full`` runs the documented numbers (more steps, float32 over three seeds for its
spread, and the whole sweep); ``--sweep-only`` runs the sweep alone.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from demo import report, sweep
from demo.rows import DoorResult, RowResult, rows_for
from demo.text import held_out_windows, load_corpus, training_windows
from workbench.byte_gpt import Settings

QUICK_STEPS = 80
"""Steps of ``make demo``: a few minutes for both front doors on a small CPU (the time it took:
``docs/performance-notes.md``)."""

FULL_STEPS = 600
"""Steps of ``python -m demo --full``."""

FRONT_DOORS = ("torch", "jax")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m demo``."""
    parser = argparse.ArgumentParser(
        prog="python -m demo",
        description=(
            "Train a GPT-2-style byte-level language model on the Python standard library's "
            "own source in float32, float16, bfloat16 and cbfloat16, with and without loss "
            "scaling, through the torch and the JAX front doors; print the table and write "
            "demo.md, demo.json and plots."
        ),
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help=f"the documented run: {FULL_STEPS} steps, float32 over 3 seeds (default: the "
        f"quick run, {QUICK_STEPS} steps)",
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps of every row")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of weights and batches (default 0)"
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path("demo_output"),
        help="output folder (default demo_output)",
    )
    parser.add_argument(
        "--front-door",
        choices=(*FRONT_DOORS, "both"),
        default="both",
        help="which front door to run (default both)",
    )
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    parser.add_argument(
        "--sweep-only",
        action="store_true",
        help="only the loss-scaling sweep over tokens per step (k = "
        f"{', '.join(map(str, sweep.QUICK.ks))}; with --full k = "
        f"{', '.join(map(str, sweep.FULL.ks))}, {sweep.FULL.steps} steps, and k = "
        f"{sweep.FULL.accumulate_k} with real accumulation), not the main table",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="train the GPT on this many local processes per front door instead (torch DDP "
        "over gloo, jax.distributed), one rank meeting an overflow, against one process on the "
        "whole batch; writes distributed.md and distributed.json (demo/distributed.py)",
    )
    parser.add_argument(
        "--fsdp2", action="store_true", help="with --nproc: torch's FSDP2 instead of DDP"
    )
    return parser


def run_door(
    front_door: str,
    settings: Settings,
    seeds: Sequence[int],
    progress: bool,
) -> DoorResult:
    """Trains every row of ``front_door`` (and float32 for the extra ``seeds``)."""
    if front_door == "torch":
        from demo import torch_door as door
    else:
        from demo import jax_door as door  # type: ignore[no-redef]
    corpus = load_corpus()
    held_out = held_out_windows(corpus, settings)
    batches = training_windows(corpus, settings)
    gradients: list[np.ndarray] = []
    results: list[RowResult] = []
    context = door.one_thread() if front_door == "torch" else contextlib.nullcontext()
    with context:
        for row in rows_for(front_door):
            keep = (
                (lambda g: gradients.append(door.gradient_log2(g)))
                if row.key == "float32"
                else None
            )
            results.append(door.train_row(row, settings, batches, held_out, progress, keep))
        float32_seeds = {settings.seed: results[0].held_out_loss}
        for seed in seeds:
            if seed == settings.seed:
                continue
            other = dataclasses.replace(settings, seed=seed)
            result = door.train_row(
                rows_for(front_door)[0], other, training_windows(corpus, other), held_out, progress
            )
            float32_seeds[seed] = result.held_out_loss
    return DoorResult(front_door, results, gradients[0], float32_seeds)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parses ``argv``, runs the demo, prints the tables, writes the outputs.

    Returns:
        The process exit status.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 2:
        parser.error(f"argument --steps: must be an integer of at least 2; got {args.steps}")
    if args.seed < 0:
        parser.error(f"argument --seed: must be a non-negative integer; got {args.seed}")
    if args.out_dir.exists() and not args.out_dir.is_dir():
        parser.error(f"argument --out-dir: {args.out_dir} exists and is not a folder")
    if args.nproc is not None:
        return run_distributed(parser, args)
    if args.fsdp2:
        parser.error("argument --fsdp2: only with --nproc")
    steps = args.steps or (FULL_STEPS if args.full else QUICK_STEPS)
    settings = Settings(steps=steps, seed=args.seed)
    seeds = [args.seed, args.seed + 1, args.seed + 2] if args.full else [args.seed]
    doors = list(FRONT_DOORS) if args.front_door == "both" else [args.front_door]
    command = "python -m demo " + " ".join(argv if argv is not None else sys.argv[1:])
    plan = sweep.FULL if args.full else sweep.QUICK
    if args.steps is not None:
        plan = dataclasses.replace(plan, steps=args.steps)
    run(
        settings,
        doors,
        seeds,
        args.out_dir,
        command.strip(),
        progress=not args.no_progress,
        plan=plan,
        table=not args.sweep_only,
    )
    return 0


def run_distributed(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``python -m demo --nproc N``: hands the arguments to :func:`demo.distributed.main`."""
    from demo import distributed

    for flag in ("full", "sweep_only"):
        if getattr(args, flag):
            parser.error(f"argument --{flag.replace('_', '-')}: not with --nproc")
    argv = ["--nproc", str(args.nproc), "--seed", str(args.seed), "--out-dir", str(args.out_dir)]
    argv += ["--front-door", args.front_door, *(["--fsdp2"] if args.fsdp2 else [])]
    argv += [] if args.steps is None else ["--steps", str(args.steps)]
    return distributed.main(argv, prog="python -m demo")


def run(
    settings: Settings,
    doors: Sequence[str],
    seeds: Sequence[int],
    out_dir: Path,
    command: str,
    progress: bool = True,
    plan: sweep.SweepPlan | None = None,
    table: bool = True,
) -> list[DoorResult]:
    """Trains every row of ``doors``, then the sweep, prints the tables, writes ``demo.md``,
    ``demo.json`` and the plots into ``out_dir``.

    Args:
        settings: model size, optimizer, steps, seed.
        doors: ``"torch"`` and/or ``"jax"``.
        seeds: the seeds of the float32 row (``settings.seed`` first); more than one reports
            float32's spread.
        out_dir: the output folder (created).
        command: the command line, for the header.
        progress: show progress bars.
        plan: the loss-scaling sweep (:mod:`demo.sweep`), or ``None`` for none.
        table: train the main table (``False``: the sweep alone).

    Returns:
        One :class:`~demo.rows.DoorResult` per front door.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    size = settings.size
    header = [
        "# Does it train? GPT-2 on the Python standard library, every format",
        "",
        f"`{command}`, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, "
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs.",
        "",
        f"GPT-2 ({size.n_layer} layers, width {size.n_embd}, {size.n_head} heads, context "
        f"{size.n_positions} bytes), byte vocabulary; AdamW lr {settings.learning_rate:g} "
        f"(warm-up {settings.warmup_steps} steps, cosine decay to a tenth), batch "
        f"{settings.batch_size}, {settings.steps} steps, seed {settings.seed}. Held-out loss: "
        f"nats per byte of the final float32 weights on {settings.eval_windows} windows of "
        "held-out files.",
    ]
    print(header[-1], flush=True)
    start = time.perf_counter()
    results = []
    sweeps = []
    for name in doors:
        if table:
            results.append(run_door(name, settings, seeds, progress))
            print(f"\n{name} front door ({time.perf_counter() - start:.0f} s so far)")
            print(report.text_table(results[-1]))
            for line in report.verdict_lines(results[-1]):
                print(line)
        if plan is not None:
            same = table and plan.steps == settings.steps
            reuse = {r.row.key: r for r in results[-1].rows} if same else None
            sweeps.append(sweep.run_sweep(name, settings, plan, progress, reuse))
            print(f"\n{name} sweep ({time.perf_counter() - start:.0f} s so far)")
            print(sweep.text_table(sweeps[-1]))
            for line in sweep.verdict_lines(sweeps[-1]):
                print(line)
        sys.stdout.flush()
    plots = [p for door in results for p in report.plot_door(door, out_dir)]
    sweep_plots = sweep.plot_all(sweeps, out_dir) if sweeps else []
    elapsed = time.perf_counter() - start
    header[2] += f" Took {elapsed:.0f} s."
    meta = {
        "command": command,
        "date": f"{datetime.datetime.now(datetime.UTC):%Y-%m-%dT%H:%M}Z",
        "settings": dataclasses.asdict(settings),
        "elapsed_s": elapsed,
        "sweep_plan": None if plan is None else dataclasses.asdict(plan),
        **sweep.as_json(sweeps),
    }
    markdown = report.write_markdown(results, out_dir / "demo.md", header, plots)
    if sweeps:
        with markdown.open("a", encoding="utf-8") as file:
            file.write("\n" + "\n".join(sweep.markdown(sweeps, sweep_plots)) + "\n")
    written = [
        markdown,
        report.write_json(results, out_dir / "demo.json", meta),
        *plots,
        *sweep_plots,
    ]
    print(f"\nwrote {', '.join(str(p) for p in written)} in {elapsed:.0f} s")
    return results
