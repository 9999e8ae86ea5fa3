"""JAX runs killed with SIGKILL and resumed in a fresh process end bit-identical.

``_jax_resume_worker.py`` trains four stacks in lock-step (optax with orbax, flax NNX with orbax
over the model's and the optimizer's ``nnx.state``, flax linen with ``flax.serialization``,
equinox with ``eqx.tree_serialise_leaves``), each saved as its users save it. One run goes
uninterrupted; another is killed with ``SIGKILL`` at a step drawn by a seeded RNG, and a fresh
process resumes from the last committed checkpoint (each run is forked from one that has only
imported the worker's modules). The oracle is the uninterrupted run: every leaf of every stack's
final state (parameters, optimizer state, scaler) equal bit for bit, with overflows (skipped
steps, halvings, growths, overflows the ``overflow_tolerance`` absorbs) before and after the
kill.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterator
from pathlib import Path

import _jax_resume_worker as worker
import pytest
from jax_processes import shared_compilation_cache

from tests.resume_helpers import ForkedRuns, progress

WORKER = Path(__file__).with_name("_jax_resume_worker.py")
# The worker's imports (no torch): what each forked run starts from.
PRELOAD = ("equinox", "flax.linen", "flax.nnx", "flax.serialization", "jax", "optax")
PRELOAD += ("orbax.checkpoint", "amp_core", "amp_core.flax_linen", "amp_core.flax_nnx")
STACKS = ("optax", "nnx", "linen", "equinox")
# A kill step drawn by a seeded RNG, with overflows before and after it.
KILL_STEP = random.Random(40).randrange(min(worker.POISONED) + 1, max(worker.POISONED))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkedRuns]:
    """Each run in a fresh process, forked from one that has imported the worker's modules; the
    runs share a JAX compilation cache (one program: the later runs load what the first built)."""
    forked = tmp_path_factory.mktemp("forked")
    server = ForkedRuns(WORKER, forked, PRELOAD, **shared_compilation_cache(forked / "jax-cache"))
    yield server
    server.close()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, runs: ForkedRuns) -> tuple[dict, list]:
    directory = tmp_path_factory.mktemp("uninterrupted")
    runs.finish(directory)
    return pickle.loads((directory / "final.pkl").read_bytes()), progress(directory)


def test_the_scenario_has_overflows_that_skip_halve_and_are_tolerated(uninterrupted):
    final, history = uninterrupted
    assert [s for s, _ in history] == list(range(worker.STEPS))
    for index, stack in enumerate(STACKS):
        scales = [worker.CONFIG.init_scale] + [values[index] for _, values in history]
        halved = [s for s in range(worker.STEPS) if scales[s + 1] < scales[s]]
        grown = [s for s in range(worker.STEPS) if scales[s + 1] > scales[s]]
        tolerated = [s for s in worker.POISONED if scales[s + 1] >= scales[s]]
        assert halved and grown and tolerated, (stack, halved, grown, tolerated)
        assert min(halved) < KILL_STEP < max(halved) and min(tolerated) < KILL_STEP
        assert final["scalers"][stack]["num_skipped_steps"] == len(worker.POISONED), stack


def test_a_killed_run_resumes_bit_identical_in_every_stack(uninterrupted, runs, tmp_path):
    expected, expected_history = uninterrupted
    runs.kill_at(tmp_path, KILL_STEP)
    assert not (tmp_path / "final.pkl").exists()
    resumed_from = int((tmp_path / "latest").read_text())
    assert resumed_from == (KILL_STEP + 1) // worker.EVERY * worker.EVERY > 0
    runs.finish(tmp_path)
    actual = pickle.loads((tmp_path / "final.pkl").read_bytes())
    for stack in STACKS:
        assert actual[stack] == expected[stack], stack
        assert actual["scalers"][stack] == expected["scalers"][stack], stack
    assert progress(tmp_path)[KILL_STEP + 1 :] == expected_history[resumed_from:]
