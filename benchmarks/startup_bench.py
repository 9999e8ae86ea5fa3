"""Start-up costs, in fresh processes: the import, and the first iteration of a first and of a
second run of the README's PyTorch loop.

Every measurement is a new interpreter, the variants alternating round by round (the machine's
other jobs then weigh on each alike); medians are reported. Run alone:
``python -m benchmarks --sections startup``.

* **import**: ``import torch, amp_core`` (the JAX front door beside torch), ``import torch,
  torch_facade`` and ``import torch_facade``, wall time of ``python -c``.
* **first iteration**: the README's loop (AdamW, ``unscale_``, ``clip_grad_norm_``) timed per
  iteration inside the script: the facade with an empty core cache (a first run), the facade
  again with the cache the first run left (a second run), and ``torch.amp.GradScaler``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from workbench.processes import REPO_ROOT, repo_environment
from workbench.tables import markdown_table

ROUNDS = 5

IMPORTS = {
    "import torch, amp_core": "import torch, amp_core",
    "import torch, torch_facade": "import torch, torch_facade",
    "import torch_facade": "import torch_facade",
}

_LOOP = """
import json, time
import torch
{scaler_import}
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
started = time.perf_counter()
grad_scaler = {scaler}
x, y = torch.randn(64, 8), torch.randn(64, 1)
seconds = []
for step in range(3):
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    grad_scaler.scale(loss).backward()
    grad_scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    grad_scaler.step(optimizer)
    grad_scaler.update()
    seconds.append(time.perf_counter() - started)
    started = time.perf_counter()
print(json.dumps(seconds))
"""

FACADE = {
    "scaler_import": "import torch_facade as cstorch",
    "scaler": 'cstorch.amp.GradScaler(loss_scale="dynamic")',
}
TORCH = {"scaler_import": "", "scaler": 'torch.amp.GradScaler("cpu")'}


def _wall(code: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, env=repo_environment())
    return time.perf_counter() - started


def _loop(variant: dict[str, str], cache: str) -> list[float]:
    result = subprocess.run(
        [sys.executable, "-c", _LOOP.format(**variant)],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=repo_environment(CSTORCH_AMP_CACHE_DIR=cache),
    )
    return [float(s) for s in json.loads(result.stdout.strip().splitlines()[-1])]


def run(rounds: int = ROUNDS, tick: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Measures the import and first-iteration rows; returns medians and raw samples (s)."""
    imports: dict[str, list[float]] = {name: [] for name in IMPORTS}
    loops: dict[str, list[list[float]]] = {"first run": [], "second run": [], "torch": []}
    for _ in range(rounds):
        for name, code in IMPORTS.items():
            imports[name].append(_wall(code))
        with tempfile.TemporaryDirectory(prefix="cstorch-amp-cores-") as cache:
            loops["first run"].append(_loop(FACADE, cache))
            loops["second run"].append(_loop(FACADE, cache))
        loops["torch"].append(_loop(TORCH, "off"))
        tick()
    base = statistics.median(imports["import torch, amp_core"])
    import_rows = [
        {
            "case": name,
            "median_s": statistics.median(samples),
            "ratio_to_torch_amp_core": statistics.median(samples) / base,
            "samples_s": samples,
        }
        for name, samples in imports.items()
    ]
    loop_rows = [
        {
            "case": name,
            "first_iteration_ms": 1e3 * statistics.median(s[0] for s in samples),
            "second_iteration_ms": 1e3 * statistics.median(s[1] for s in samples),
            "samples_s": samples,
        }
        for name, samples in loops.items()
    ]
    return {"rounds": rounds, "imports": import_rows, "loops": loop_rows}


_LOOP_NAMES = {
    "first run": "facade, first run (empty core cache)",
    "second run": "facade, second run (the core loaded from the cache)",
    "torch": "torch.amp.GradScaler",
}


def markdown(result: dict[str, Any], number: int) -> list[str]:
    """The report's start-up section."""
    out = [
        f"## {number}. Start-up",
        "",
        f"Fresh processes, variants alternating, medians of {result['rounds']} rounds "
        "(`python -m benchmarks --sections startup`).",
        "",
        *markdown_table(
            ["import", "median s", "ratio to `import torch, amp_core`"],
            [
                [
                    f"`{row['case']}`",
                    f"{row['median_s']:.2f}",
                    f"{row['ratio_to_torch_amp_core']:.2f}",
                ]
                for row in result["imports"]
            ],
            ["l", "r", "r"],
        ),
        "",
        "The README's PyTorch loop (AdamW, `unscale_`, `clip_grad_norm_`), timed inside the "
        "script:",
        "",
        *markdown_table(
            ["run", "first iteration ms", "second iteration ms"],
            [
                [
                    _LOOP_NAMES[row["case"]],
                    f"{row['first_iteration_ms']:.1f}",
                    f"{row['second_iteration_ms']:.1f}",
                ]
                for row in result["loops"]
            ],
            ["l", "r", "r"],
        ),
        "",
    ]
    return out
