"""The device check: one command that tells whether the facade is right and fast on a device.

Run it on a machine with a CUDA GPU (the packages as they are there, nothing to install)::

    PYTHONPATH=. python -m device_check --device cuda --out device_check_output

or ``make device-check`` (CUDA when torch sees a GPU, else the CPU), or on the CPU for CI::

    python -m device_check --device cpu --quick --out /tmp/device_check

It writes ``DIR/device_check.json`` (every number) and ``DIR/device_check.md`` (the tables),
rewritten after every section, so a run stopped half-way leaves what it had. The exit status is
0 when the correctness and compiled sections passed and no section raised; a section that raises records
``{"error", "traceback", "seconds"}`` and the check goes on with the next.

Sections, in the order they run (``--sections`` picks some):

``memory``
    Runs first, before anything initializes JAX's backends, so that it sees the defaults a user
    gets: the check itself never calls ``jax.devices()`` or makes a JAX array before the
    facade's first decision. Checkpoints: torch alone, after two bare torch iterations, after
    ``GradScaler()``, after the first decision, after six facade iterations; each says whether
    JAX's backends are initialized and, on CUDA, gives ``torch.cuda.mem_get_info`` and torch's
    reserved bytes. ``outside_torch_bytes`` is how much free device memory went to something
    other than torch's allocator once the facade started (JAX's preallocation would show as
    about 75% of the GPU, ``outside_torch_fraction`` ~0.75); ``jax_memory_stats`` is what JAX
    says it holds (``bytes_in_use``, ``peak_bytes_in_use``, ``bytes_limit``, ...; ``null`` with
    a reason on the CPU, which reports none).
``correctness``
    The facade against ``torch.amp.GradScaler(device)`` step by step on a GPT-2-like model with
    148 gradient tensors under float16 autocast, foreach SGD and fused AdamW, static scaling,
    DLS with matched growth and DLS + GCC, faults injected: skip decisions, scale trajectories,
    parameters and optimizer state (bit for bit where the arithmetic is the same), the global
    norm against a float64 oracle and ``clip_grad_norm_``. ``passed`` and ``compared_steps``;
    the derivation of the matched trajectories is in :mod:`device_check.correctness`.
``host_syncs`` (JSON key ``host_syncs_per_iteration``)
    CUDA only (on the CPU ``applicable: false`` with the reason): per optimizer and scaler, the
    synchronising operations torch reports in the scaler calls of steady-state iterations
    (``torch.cuda.set_sync_debug_mode("warn")``; expected 0 with fused optimizers and 1 with
    non-fused ones, for torch's scaler too; ``sites`` says which lines), and the sleep probe:
    with 50 ms of device work queued after backward, ``step`` + ``update`` taking well under
    50 ms on the host (``waited_for_device: false``) did not wait for the device.
``timings``
    Whole iterations of the documented loop, facade against torch's scaler and a bare loop, with
    and without clipping, SGD foreach and AdamW fused, at S, M and L (``--quick``: S), rows as
    ``make bench``'s whole-iteration table (medians over rounds; on CUDA every iteration ends
    with ``torch.cuda.synchronize()``); and ``per_call``: the median host microseconds of
    ``scale``, ``unscale_``, ``step`` and ``update`` on 148 tensors, for both scalers.
``compiled``
    The facade around ``torch.compile``'d code, against the same loop run eagerly: a compiled
    model and a compiled whole train step, each also with ``mode="reduce-overhead"`` (CUDA
    graphs; CUDA only), faults injected: the same skipped steps and scales, parameters
    bit-identical across skipped steps and close to the eager run's, nothing compiled after
    warm-up, graph breaks, CUDA graph skips, and the median iteration time of each
    (:mod:`device_check.compiled`; ``--quick`` on the CPU: a width-16 model).

How to read the report: ``passed`` at the top is the verdict; then ``environment`` (versions,
GPU, driver, the XLA/CUDA environment variables, JAX's backend and devices, read after the memory
section) and each section with its wall time. Ratios are facade / torch: below 1 the facade is
faster. On the CPU the correctness section uses one torch thread (it times nothing, and
float16's many small CPU kernels are many times slower with OpenMP barriers on shared cores), its
model is M's layout at width 64, and ``--quick`` runs everything with one torch thread and the
smallest sizes: its timings only prove that the code runs.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from device_check import compiled as device_compiled
from device_check import correctness as device_correctness
from device_check import probes as device_probes
from device_check import report as device_report
from workbench.jsonsafe import write_json
from workbench.processes import comma_names
from workbench.sizes import SIZES
from workbench.timing import CompileCounter, Plan

SECTIONS = ("memory", "correctness", "host_syncs", "timings", "compiled")
"""The sections, in the order they run (memory first: it must see JAX uninitialized)."""

JSON_KEYS = {
    "memory": "memory",
    "correctness": "correctness",
    "host_syncs": "host_syncs_per_iteration",
    "timings": "timings",
    "compiled": "compiled",
}
"""The JSON key of each section."""

TIMING_SIZES = ("S", "M", "L")
"""The sizes of the whole-iteration timings (``--quick``: S)."""

JSON_NAME = "device_check.json"
MARKDOWN_NAME = "device_check.md"

PACKAGES = (
    "torch",
    "jax",
    "jaxlib",
    "jax-cuda13-plugin",
    "jax-cuda13-pjrt",
    "jax-cuda12-plugin",
    "jax-cuda12-pjrt",
    "optax",
    "numpy",
    "ml_dtypes",
)
"""Installed distributions whose versions are recorded (those present)."""


def _versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def _driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None


def torch_environment(device: torch.device) -> dict[str, Any]:
    """Versions, the machine and the device as torch sees them (JAX is not touched)."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "packages": _versions(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_threads": torch.get_num_threads(),
        "env": device_probes._xla_env(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu_name=props.name,
            gpu_capability=f"{props.major}.{props.minor}",
            gpu_memory_bytes=props.total_memory,
            gpu_multiprocessors=props.multi_processor_count,
            cudnn=torch.backends.cudnn.version(),
            driver=_driver(),
            cuda_device_count=torch.cuda.device_count(),
        )
    return info


def jax_environment() -> dict[str, Any]:
    """JAX's version, backend and devices (initializes JAX: call it after the memory section)."""
    import jax
    import jaxlib

    info: dict[str, Any] = {"jax": jax.__version__, "jaxlib": jaxlib.__version__}
    try:
        info["jax_backend"] = jax.default_backend()
        info["jax_devices"] = [f"{d} ({d.device_kind})" for d in jax.devices()]
    except Exception as error:
        info["jax_backend_error"] = f"{type(error).__name__}: {error}"
    try:  # why a GPU plugin did not load, if one did not (a private table; absent: skipped)
        from jax._src import xla_bridge

        errors = getattr(xla_bridge, "_backend_errors", {})
        info["jax_backend_errors"] = {k: str(v) for k, v in errors.items()}
    except Exception:
        info["jax_backend_errors"] = None
    return info


class DeviceCheck:
    """One run of the check: settings, the results so far, and where they are written.

    Args:
        device: ``"cuda"`` (``cuda:0``) or ``"cpu"``.
        out: the output folder.
        quick: small sizes and few steps (CI).
        sections: which of :data:`SECTIONS` to run.
        seed: seeds every model and batch.
        sizes: the sizes of the whole-iteration timings (default :data:`TIMING_SIZES`, or
            ``("S",)`` when quick).
        argv: the command line, recorded.
    """

    def __init__(
        self,
        device: str,
        out: Path,
        quick: bool = False,
        sections: Sequence[str] = SECTIONS,
        seed: int = 0,
        sizes: Sequence[str] | None = None,
        argv: Sequence[str] = (),
    ) -> None:
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        self.out, self.quick, self.seed = out, quick, seed
        self.sections = [s for s in SECTIONS if s in sections]
        self.sizes = tuple(sizes or (("S",) if quick else TIMING_SIZES))
        self.counter = CompileCounter()
        self.results: dict[str, Any] = {
            "device": self.device.type,
            "quick": quick,
            "passed": None,
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(["python -m device_check", *argv]),
            "sections_run": self.sections,
            "timing_sizes": list(self.sizes),
            "environment": torch_environment(self.device),
            **{JSON_KEYS[s]: None for s in SECTIONS},
            "wall_seconds": None,
        }

    def _plan(self, size: str) -> Plan:
        if self.quick:
            return Plan(rounds=2, max_iters=2, warmup=1, fixed_iters=True)
        if self.device.type == "cuda":
            return Plan(rounds=5, max_iters=SIZES[size].iters, warmup=2)
        # Fewer on the CPU (an L iteration takes about a second); one warm-up step after the
        # first is enough for fused AdamW to take the facade's fused path.
        return Plan(rounds=3, max_iters=SIZES[size].iters, warmup=1)

    def _timings(self) -> dict[str, Any]:
        with self.counter.listening():
            whole = device_probes.whole_iterations(
                self.device, self.sizes, self._plan, self.counter, self.seed, _progress
            )
            _progress("timings: per-call host microseconds")
            calls = device_probes.per_call(self.device, self.quick, self.seed)
        return {"whole": whole, "per_call": calls, "compiles": self.counter.count}

    def _correctness(self) -> dict[str, Any]:
        if self.device.type != "cpu":
            return device_correctness.run(self.device, self.quick, self.seed)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # it times nothing; float16's small CPU kernels hate barriers
        try:
            return device_correctness.run(self.device, self.quick, self.seed)
        finally:
            torch.set_num_threads(threads)

    def _section_function(self, name: str) -> Callable[[], dict[str, Any]]:
        functions: dict[str, Callable[[], dict[str, Any]]] = {
            "memory": lambda: device_probes.memory(self.device, self.seed),
            "correctness": self._correctness,
            "host_syncs": lambda: device_probes.host_syncs(self.device, self.quick, self.seed),
            "timings": self._timings,
            "compiled": lambda: device_compiled.run(self.device, self.quick, self.seed),
        }
        return functions[name]

    def run_section(self, name: str) -> dict[str, Any]:
        """Runs one section; an exception is recorded in its result, never raised."""
        _progress(f"{name}: started")
        start = time.perf_counter()
        try:
            result = self._section_function(name)()
        except Exception as error:
            result = {
                "error": f"{type(error).__name__}: {error}",
                "traceback": traceback.format_exc(),
            }
        result["seconds"] = time.perf_counter() - start
        outcome = result.get("error") or ("passed" if result.get("passed", True) else "FAILED")
        _progress(f"{name}: {outcome} ({result['seconds']:.1f} s)")
        return result

    def verdict(self) -> bool:
        """Correctness and the compiled patterns passed (where they ran), no section raised."""
        ran = [self.results[JSON_KEYS[s]] for s in self.sections]
        if any(r is None or "error" in r for r in ran):
            return False
        checked = [self.results["correctness"], self.results["compiled"]]
        return all(section is None or bool(section.get("passed")) for section in checked)

    def write(self) -> tuple[Path, Path]:
        """Writes the JSON and markdown reports of the results so far."""
        self.out.mkdir(parents=True, exist_ok=True)
        json_path, md_path = self.out / JSON_NAME, self.out / MARKDOWN_NAME
        write_json(json_path, self.results, default=str)
        md_path.write_text(device_report.markdown(self.results))
        return json_path, md_path

    def run(self) -> dict[str, Any]:
        """Runs the sections in order, writing the reports after each; returns the results."""
        started = time.perf_counter()
        if self.quick and self.device.type == "cpu":
            torch.set_num_threads(1)
            self.results["environment"]["torch_threads"] = 1
        for name in self.sections:
            self.results[JSON_KEYS[name]] = self.run_section(name)
            if name == self.sections[0]:  # after the memory section, if it ran
                self.results["environment"].update(jax_environment())
            self.results["passed"] = self.verdict()
            self.results["wall_seconds"] = time.perf_counter() - started
            self.write()
        if not self.sections:
            self.results["environment"].update(jax_environment())
        self.results["environment"]["env_at_end"] = device_probes._xla_env()
        self.results["passed"] = self.verdict()
        self.results["wall_seconds"] = time.perf_counter() - started
        self.write()
        return self.results


def _timing_sizes(text: str) -> list[str]:
    return list(comma_names(text, tuple(SIZES), "sizes"))


def _progress(text: str) -> None:
    """One line of progress on stderr (stdout gets the report)."""
    print(f"[device_check {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _sections(text: str) -> list[str]:
    return list(comma_names(text, SECTIONS, "sections"))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m device_check``."""
    parser = argparse.ArgumentParser(
        prog="python -m device_check",
        description="Check the facade on a device against torch.amp.GradScaler: memory shared "
        "with torch, correctness, host synchronisations and timings. Writes device_check.json "
        "and device_check.md; exits 1 if correctness or a compiled pattern failed or a section "
        "raised.",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to run (default: cuda if torch sees a GPU, else cpu)",
    )
    parser.add_argument("--out", type=Path, required=True, help="the output folder")
    parser.add_argument(
        "--quick", action="store_true", help="small sizes and few steps (CI: well under a minute)"
    )
    parser.add_argument(
        "--sections",
        type=_sections,
        default=list(SECTIONS),
        help=f"comma-separated among {', '.join(SECTIONS)} (default: all, run in that order)",
    )
    parser.add_argument(
        "--sizes",
        type=_timing_sizes,
        default=None,
        help=f"comma-separated sizes of the whole-iteration timings among {', '.join(SIZES)} "
        f"(default {','.join(TIMING_SIZES)}; --quick: S)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds models and batches")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the check and prints the markdown report.

    Returns:
        0 when correctness and the compiled patterns passed and no section raised, else 1.
    """
    args = build_parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device (torch.cuda.is_available())")
    check = DeviceCheck(
        args.device,
        args.out,
        quick=args.quick,
        sections=args.sections,
        seed=args.seed,
        sizes=args.sizes,
        argv=sys.argv[1:] if argv is None else list(argv),
    )
    results = check.run()
    print(device_report.markdown(results), end="")
    print(f"\nWrote {args.out / MARKDOWN_NAME} and {args.out / JSON_NAME}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
