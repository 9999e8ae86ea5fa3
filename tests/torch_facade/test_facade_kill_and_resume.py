"""A facade run killed with SIGKILL and resumed in a fresh process ends bit-identical.

Each run is a child process (``_facade_resume_worker.py``): one runs uninterrupted; another is killed
with ``SIGKILL`` at a step drawn by a seeded RNG, then a fresh process resumes from its last
checkpoint (model, optimizer and scaler state dicts). The oracle is the uninterrupted run: the
final parameters, AdamW state and scaler state must be equal bit for bit (``torch.equal``), with
overflows (skipped steps, halvings, growths, and overflows the ``overflow_tolerance`` absorbs)
before and after the kill.
"""

from __future__ import annotations

import random
from pathlib import Path

import _facade_resume_worker as worker
import pytest
import torch
from facade_helpers import deep_equal

from tests.resume_helpers import finish, kill_at, progress, start

WORKER = Path(__file__).with_name("_facade_resume_worker.py")
# Kill steps drawn once by a seeded RNG, one per test, with overflows before and after each.
KILL_STEPS = random.Random(40).sample(range(min(worker.POISONED) + 1, max(worker.POISONED)), 2)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[dict, list[tuple[int, float]]]:
    directory = tmp_path_factory.mktemp("uninterrupted")
    finish(start(WORKER, directory, -1))
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
def test_a_killed_run_resumes_bit_identical(uninterrupted, tmp_path, kill_step):
    expected, expected_history = uninterrupted
    kill_at(WORKER, tmp_path, kill_step)
    assert not (tmp_path / "final.pt").exists()
    resumed_from = torch.load(tmp_path / "ckpt.pt", weights_only=False)["step"]
    assert resumed_from == (kill_step + 1) // worker.EVERY * worker.EVERY
    finish(start(WORKER, tmp_path, -1))
    actual = torch.load(tmp_path / "final.pt", weights_only=False)
    assert deep_equal(expected["model"], actual["model"])
    assert deep_equal(expected["optimizer"], actual["optimizer"])
    assert deep_equal(expected["scaler"], actual["scaler"])
    # The resumed process replays the steps after its checkpoint with the same loss scales.
    history = progress(tmp_path)
    assert history[kill_step + 1 :] == expected_history[resumed_from:]
