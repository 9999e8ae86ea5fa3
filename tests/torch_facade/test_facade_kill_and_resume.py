"""A facade run killed with SIGKILL and resumed in a fresh process ends bit-identical.

Each run is a fresh process (``_facade_resume_worker.py``, forked from one that has only imported
its modules): one runs uninterrupted; another is killed with ``SIGKILL`` at a step drawn by a
seeded RNG, then a fresh process resumes from its last checkpoint (model, optimizer and scaler
state dicts). The oracle is the uninterrupted run: the
final parameters, AdamW state and scaler state must be equal bit for bit (``torch.equal``), with
overflows (skipped steps, halvings, growths, and overflows the ``overflow_tolerance`` absorbs)
before and after the kill.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import _facade_resume_worker as worker
import pytest
import torch
from facade_helpers import deep_equal

from tests.resume_helpers import ForkedRuns, progress

WORKER = Path(__file__).with_name("_facade_resume_worker.py")
PRELOAD = ("torch", "jax", "torch_facade", "facade_helpers")
# Kill steps drawn once by a seeded RNG, one per test, with overflows before and after each.
KILL_STEPS = random.Random(40).sample(range(min(worker.POISONED) + 1, max(worker.POISONED)), 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Iterator[ForkedRuns]:
    """Each run in a fresh process, forked from one that has imported the worker's modules."""
    server = ForkedRuns(WORKER, tmp_path_factory.mktemp("forked"), PRELOAD)
    yield server
    server.close()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, runs) -> tuple[dict, list[tuple[int, float]]]:
    directory = tmp_path_factory.mktemp("uninterrupted")
    runs.finish(directory)
    return torch.load(directory / "final.pt", weights_only=False), progress(directory)


def test_the_scenario_has_overflows_that_skip_halve_and_are_tolerated(uninterrupted):
    final, history = uninterrupted
    scales = {step: values[0] for step, values in history}
    assert [s for s, _ in history] == list(range(worker.STEPS))
    previous = [worker.SCALER["init_scale"]] + [scales[s] for s in range(worker.STEPS - 1)]
    halved = [s for s in range(worker.STEPS) if scales[s] < previous[s]]
    grown = [s for s in range(worker.STEPS) if scales[s] > previous[s]]
    tolerated = [s for s in worker.POISONED if scales[s] >= previous[s]]
    assert halved and grown and tolerated, (halved, grown, tolerated)
    assert min(halved) < min(KILL_STEPS) and max(halved) > max(KILL_STEPS)
    assert min(tolerated) < min(KILL_STEPS)
    assert int(final["scaler"]["num_skipped_steps"]) == len(worker.POISONED)


@pytest.mark.parametrize("kill_step", KILL_STEPS)
def test_a_killed_run_resumes_bit_identical(uninterrupted, runs, tmp_path, kill_step):
    expected, expected_history = uninterrupted
    runs.kill_at(tmp_path, kill_step)
    assert not (tmp_path / "final.pt").exists()
    resumed_from = torch.load(tmp_path / "ckpt.pt", weights_only=False)["step"]
    assert resumed_from == (kill_step + 1) // worker.EVERY * worker.EVERY
    runs.finish(tmp_path)
    actual = torch.load(tmp_path / "final.pt", weights_only=False)
    assert deep_equal(expected["model"], actual["model"])
    assert deep_equal(expected["optimizer"], actual["optimizer"])
    assert deep_equal(expected["scaler"], actual["scaler"])
    # The resumed process replays the steps after its checkpoint with the same loss scales.
    history = progress(tmp_path)
    assert history[kill_step + 1 :] == expected_history[resumed_from:]
