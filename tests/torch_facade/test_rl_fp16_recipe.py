"""The fp16 RL fine-tuning recipe (docs/pytorch/rl-fp16.md) runs: its script on 2 ranks.

``docs/examples/rl_fp16.py`` is started as torchrun starts it (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``; gloo on the loopback; both ranks forked at
once from one process that has imported the script's modules, ``tests/fork_launcher.py``) for
a few steps. The
gradient-range report must have chosen the scaling: the initial scale is the smallest probe
suggestion of both ranks, each suggestion the largest power of two that keeps 2 doublings
between the probe step's largest gradient element and float16's largest value (numpy float16 is
the oracle), and the ceiling and growth window follow from it. Then both ranks must take the
same decisions, the scaler's global norm must be torch's own norm of the sharded gradients, and
the scale must follow the update rule's hand-computed trace: no step skipped, a doubling every
``steps_per_increase + 1`` steps up to the ceiling.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _ranks import wait_for_ranks

from tests.forked_python import ForkedWorker, ForkLauncher
from workbench.processes import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "docs" / "examples" / "rl_fp16.py"
WORLD, STEPS, PROBE_STEPS, HEADROOM = 2, 8, 3, 2
TIMEOUT_S = 180.0
PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch_facade")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each rank of the recipe's run wrote."""
    out = tmp_path_factory.mktemp("rl_fp16")
    port = str(free_port())
    args = ["--steps", str(STEPS), "--probe-steps", str(PROBE_STEPS)]
    args += ["--headroom", str(HEADROOM), "--out", str(out)]
    started = time.monotonic()
    common = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    )
    workers = [
        {
            "name": f"rank{rank}",
            "args": args,
            "env": dict(
                common,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(WORLD),
            ),
            "log": str(out / f"rank{rank}.log"),
        }
        for rank in range(WORLD)
    ]
    # Both ranks forked at once from one process that has imported the script's modules.
    launcher = ForkLauncher(SCRIPT, workers, PRELOAD, common)
    try:
        ranks = [ForkedWorker(launcher, f"rank{rank}") for rank in range(WORLD)]
        wait_for_ranks(ranks, out, started + TIMEOUT_S)  # type: ignore[arg-type]
    finally:
        launcher.close()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_the_report_chose_the_initial_scale_ceiling_and_growth_window(
    ranks: list[dict[str, Any]],
) -> None:
    suggestions = [s for run in ranks for s in run["scaling"]["probe_suggestions"]]
    assert len(suggestions) == WORLD * PROBE_STEPS
    for run in ranks:
        scaling = run["scaling"]
        assert scaling["init_scale"] == min(suggestions)
        assert scaling["max_loss_scale"] == min(suggestions) * 2.0**HEADROOM
        assert scaling["steps_per_increase"] == math.ceil(STEPS / HEADROOM) - 1 == 3


def test_each_suggestion_keeps_two_doublings_below_float16_overflow(
    ranks: list[dict[str, Any]],
) -> None:
    """numpy float16: the largest element times the suggestion times 2**2 is finite, times
    2**3 it overflows, and the suggestion is a power of two."""
    for run in ranks:
        scaling = run["scaling"]
        pairs = zip(scaling["probe_suggestions"], scaling["probe_largest"], strict=True)
        for suggestion, largest in pairs:
            assert math.log2(suggestion).is_integer()
            with np.errstate(over="ignore"):
                assert np.isfinite(np.float16(largest * suggestion * 2.0**HEADROOM))
                assert not np.isfinite(np.float16(largest * suggestion * 2.0 ** (HEADROOM + 1)))


def test_both_ranks_take_the_same_decisions(ranks: list[dict[str, Any]]) -> None:
    first, second = (run["steps"] for run in ranks)
    assert len(first) == STEPS
    assert first == second  # scale, skips, norms (torch's too) and rewards, to the last bit


def test_the_global_norm_is_torch_s_norm_of_the_sharded_gradients(
    ranks: list[dict[str, Any]],
) -> None:
    for run in ranks:
        rows = run["steps"]
        np.testing.assert_allclose(
            [row["global_norm"] for row in rows], [row["torch_norm"] for row in rows], rtol=1e-5
        )


def test_no_step_is_skipped_and_the_scale_grows_to_its_ceiling_on_schedule(
    ranks: list[dict[str, Any]],
) -> None:
    """The update rule's trace by hand: with no overflow the scale doubles after every
    ``steps_per_increase + 1`` steps (after steps 3 and 7), never past the ceiling."""
    for run in ranks:
        init, ceiling = run["scaling"]["init_scale"], run["scaling"]["max_loss_scale"]
        window = run["scaling"]["steps_per_increase"] + 1
        expected = [min(init * 2.0 ** ((step + 1) // window), ceiling) for step in range(STEPS)]
        assert [row["loss_scale"] for row in run["steps"]] == expected
        assert expected[-1] == ceiling
        assert all(row["isfinite"] for row in run["steps"])
        assert run["steps"][-1]["num_skipped_steps"] == 0
