"""Spike skipping in the torch door: ``GradScaler(spike_skip=cstorch.amp.SpikeSkip(...))``.

Oracles: a plain-Python window (``framework_oracles.spike_window_decisions``: a deque of the
applied steps' metrics, NumPy's ``mean`` and ``std(ddof=1)`` in float64) for every decision;
the JAX door's own ``amp_core.check_spike`` fed the same metric sequence, whose window must come
out bit for bit the same; the state before a skipped step for the parameters, Adam's state and
the scaler (bit for bit); the uninterrupted run for a resumed one.
"""

from __future__ import annotations

import functools
import io
import pickle
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _ranks import start_ranks, wait_for_ranks
from facade_helpers import INF, TinyNet, assert_tensors_equal, deep_equal, loss_of
from framework_oracles import spike_window_decisions

import amp_core
import torch_facade as cstorch

DLS = {"loss_scale": "dynamic", "init_scale": 2.0**8}


def norm_run(scales, *, spike_skip, finite=None, optimizer_factory=None):
    """A one-weight model whose gradient is ``[x, x]`` for each ``x`` in ``scales`` (its norm
    ``x * sqrt(2)``), lr 0 so that the gradients never depend on earlier steps; returns the
    scaler and, per step, ``(isfinite, global_norm, num_spike_skips)``."""
    model = torch.nn.Linear(2, 1, bias=False)
    optimizer = (optimizer_factory or (lambda p: torch.optim.SGD(p, lr=0.0)))(model.parameters())
    scaler = cstorch.amp.GradScaler(**DLS, spike_skip=spike_skip)
    finite = finite if finite is not None else [True] * len(scales)
    out = []
    for x, ok in zip(scales, finite, strict=True):
        optimizer.zero_grad()
        scaler.scale(model(torch.full((1, 2), x if ok else INF)).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        out.append(
            (
                bool(scaler.get_isfinite()),
                float(scaler.get_global_norm()),
                int(scaler.get_num_spike_skips()),
            )
        )
    return scaler, out


@pytest.mark.parametrize(
    ("window", "warmup", "sigma"), [(8, None, 3.0), (5, 12, 2.0), (16, 3, 6.0)]
)
def test_decisions_follow_the_window_and_the_jax_door(window, warmup, sigma):
    rng = np.random.default_rng(window)
    scales = rng.lognormal(0.0, 0.3, 60).astype(np.float32)
    scales[[20, 21, 40, 41, 55]] *= 40.0  # spikes, some back to back
    finite = [i not in (15, 41, 50) for i in range(60)]  # overflows: never spikes
    config = cstorch.amp.SpikeSkip(window=window, sigma=sigma, warmup=warmup)
    scaler, steps = norm_run(scales.tolist(), spike_skip=config, finite=finite)
    norms = [norm for _, norm, _ in steps]
    spikes = [ok and not applied for (applied, _, _), ok in zip(steps, finite, strict=True)]
    expected = [
        spike
        for spike, _ in spike_window_decisions(
            norms, finite, window=window, sigma=sigma, warmup=config.warmup
        )
    ]
    assert spikes == expected
    assert sum(expected) >= 3
    assert steps[-1][2] == sum(expected)
    # The JAX door, fed the same norms and overflow flags, holds the same window bit for bit.
    state = amp_core.init_spikes(config)
    for norm, ok in zip(norms, finite, strict=True):
        _, state = amp_core.check_spike(config, state, jnp.float32(norm), ok)
    ours = scaler.state_dict()
    assert torch.equal(ours["spike_window"], torch.from_numpy(np.array(state.values)))
    assert int(ours["spike_applied"]) == int(state.applied)
    assert int(ours["num_spike_skips"]) == int(state.num_spike_skips)
    # Overflows are counted as such, spikes apart.
    assert int(scaler.get_num_skipped_steps()) == 3


@pytest.mark.parametrize("fused", [False, True])
def test_a_spike_changes_neither_parameters_nor_optimizer_state_nor_the_scale(fused):
    """A run with a spike at step 6 ends where the same run without that step ends, bit for
    bit (parameters, Adam's state, the scaler's state), but for the spike's counter."""

    def run(steps):
        model = TinyNet()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=fused)
        scaler = cstorch.amp.GradScaler(
            **DLS, steps_per_increase=3, spike_skip=cstorch.amp.SpikeSkip(window=4, sigma=3.0)
        )
        results = []
        for step in steps:
            optimizer.zero_grad()
            factor = 300.0 if step == "bad" else 1.0  # gradients 300 times the usual
            scaler.scale(factor * loss_of(model, 6 if step == "bad" else step)).backward()
            results.append(scaler.step(optimizer))
            scaler.update()
        return model, optimizer, scaler, results

    clean = run([0, 1, 2, 3, 4, 5, 7, 8])
    spiked = run([0, 1, 2, 3, 4, 5, "bad", 7, 8])
    assert spiked[3][6] is None  # the spike's step() returned None: skipped
    assert_tensors_equal(clean[0].parameters(), spiked[0].parameters())
    assert deep_equal(clean[1].state_dict(), spiked[1].state_dict())
    clean_state, spiked_state = clean[2].state_dict(), spiked[2].state_dict()
    assert int(clean_state.pop("num_spike_skips")) == 0
    assert int(spiked_state.pop("num_spike_skips")) == 1
    assert deep_equal(clean_state, spiked_state)
    assert float(spiked[2].get_scale()) == 2.0**10  # grew twice: every 3 + 1 applied steps
    assert int(spiked[2].get_num_skipped_steps()) == 0  # not an overflow


def test_the_spike_step_reads_as_skipped():
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scaler = cstorch.amp.GradScaler(**DLS, spike_skip=cstorch.amp.SpikeSkip(window=4, sigma=3.0))
    for step in range(5):
        optimizer.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad()
    scaler.scale(300.0 * loss_of(model, 5)).backward()
    scaler.unscale_(optimizer)
    assert not bool(scaler.get_isfinite())  # the iteration's decision, before step()
    scaler.step(optimizer)
    scaler.update()
    assert not bool(scaler.get_isfinite())
    metrics = cstorch.amp.scaler_metrics(scaler)
    assert metrics["num_spike_skips"] == 1 and metrics["num_skipped_steps"] == 0
    assert not metrics["isfinite"]
    tensors = cstorch.amp.scaler_metrics(scaler, as_tensors=True)
    assert tensors["num_spike_skips"].dtype == torch.int64


def test_without_spike_skip_nothing_changes():
    scaler = cstorch.amp.GradScaler(**DLS)
    assert "spike_window" not in scaler.state_dict()
    assert "num_spike_skips" not in cstorch.amp.scaler_metrics(scaler)
    assert int(scaler.get_num_spike_skips()) == 0
    assert scaler.config.spike_skip is None
    # A 300-times batch is applied by default.
    _, steps = norm_run([1.0, 1.1, 0.9, 1.0, 1.0, 300.0], spike_skip=None)
    assert all(applied for applied, _, _ in steps)


def test_the_window_resumes_bit_for_bit_from_a_checkpoint():
    def fresh():
        model = TinyNet()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        scaler = cstorch.amp.GradScaler(
            **DLS, spike_skip=cstorch.amp.SpikeSkip(window=4, sigma=2.0)
        )
        return model, optimizer, scaler

    def step(model, optimizer, scaler, i):
        optimizer.zero_grad()
        factor = 50.0 if i % 7 == 6 else 1.0
        scaler.scale(factor * loss_of(model, i)).backward()
        scaler.step(optimizer)
        scaler.update()

    run = fresh()
    for i in range(12):
        step(*run, i)
    buffer = io.BytesIO()
    torch.save(
        {"model": run[0].state_dict(), "opt": run[1].state_dict(), "scaler": run[2].state_dict()},
        buffer,
    )
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    resumed = fresh()
    resumed[0].load_state_dict(checkpoint["model"])
    resumed[1].load_state_dict(checkpoint["opt"])
    resumed[2].load_state_dict(checkpoint["scaler"])
    unpickled = pickle.loads(pickle.dumps(run[2]))
    assert deep_equal(unpickled.state_dict(), run[2].state_dict())
    for i in range(12, 30):
        step(*run, i)
        step(*resumed, i)
        assert deep_equal(run[2].state_dict(), resumed[2].state_dict()), i
    assert_tensors_equal(run[0].parameters(), resumed[0].parameters())
    assert int(run[2].get_num_spike_skips()) >= 2


def test_checkpoints_without_the_window_load_and_bad_windows_are_refused():
    scaler = cstorch.amp.GradScaler(**DLS, spike_skip=cstorch.amp.SpikeSkip(window=4))
    scaler.load_state_dict(cstorch.amp.GradScaler(**DLS).state_dict())  # an older checkpoint
    state = scaler.state_dict()
    assert int(state["spike_applied"]) == 0 and int(state["num_spike_skips"]) == 0
    scaler.load_state_dict({"spike_applied": 3, "num_spike_skips": 2})
    assert int(scaler.get_num_spike_skips()) == 2
    with pytest.raises(ValueError, match=r"spike_window must hold 4 values.*got shape \(5,\)"):
        scaler.load_state_dict({"spike_window": torch.zeros(5)})
    with pytest.raises(ValueError, match="spike_applied must be a whole number"):
        scaler.load_state_dict({"spike_applied": 2.5})
    with pytest.raises(TypeError, match="num_spike_skips must be numeric"):
        scaler.load_state_dict({"num_spike_skips": "2"})
    with pytest.raises(ValueError, match="loss_scale"):
        scaler.load_state_dict({"num_spike_skips": 5, "loss_scale": -1.0})
    assert int(scaler.get_num_spike_skips()) == 2  # a refused load changed nothing
    with pytest.raises(ValueError, match=r"keys \['num_spike_skips', 'spike_applied'"):
        cstorch.amp.GradScaler(**DLS).load_state_dict(scaler.state_dict())  # no spike_skip


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"window": 1}, ValueError, r"window must be an integer from 2"),
        ({"sigma": 0.0}, ValueError, r"sigma must be a finite number > 0; got 0.0"),
        ({"sigma": -1.0}, ValueError, r"sigma must be a finite number > 0"),
        ({"metric": "norm"}, ValueError, r"metric must be one of \['grad_norm', 'loss'\]; got 'norm'"),
    ],
)  # fmt: skip
def test_bad_arguments_name_the_argument(kwargs, error, match):
    assert cstorch.amp.SpikeSkip is amp_core.SpikeSkip
    with pytest.raises(error, match=match):
        cstorch.amp.SpikeSkip(**kwargs)


def test_spike_skip_needs_dynamic_scaling_and_a_spike_skip_object():
    with pytest.raises(ValueError, match='spike_skip needs loss_scale="dynamic"'):
        cstorch.amp.GradScaler(loss_scale=8.0, spike_skip=cstorch.amp.SpikeSkip())
    with pytest.raises(TypeError, match=r"spike_skip must be an amp_core\.SpikeSkip"):
        cstorch.amp.GradScaler(loss_scale="dynamic", spike_skip={"window": 8})


def test_the_loss_metric_watches_the_sum_of_the_iterations_unscaled_losses():
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    config = cstorch.amp.SpikeSkip(metric="loss", window=3, sigma=2.0)
    scaler = cstorch.amp.GradScaler(**DLS, spike_skip=config)
    # Two scale() calls per iteration (accumulation): the metric is their sum, 2 * x here.
    losses = [1.0, 1.1, 0.9, 1.0, 9.0, 1.05, 0.8, 30.0]
    applied = []
    for x in losses:
        optimizer.zero_grad()
        for _ in range(2):
            scaler.scale(model(torch.full((1, 2), x / 2)).sum() / 2).backward()
        scaler.step(optimizer)
        scaler.update()
        applied.append(bool(scaler.get_isfinite()))
    expected = [
        spike
        for spike, _ in spike_window_decisions(
            losses, [True] * len(losses), window=3, sigma=2.0, warmup=3
        )
    ]
    assert [not a for a in applied] == expected == [False] * 4 + [True, False, False, True]
    window = scaler.state_dict()["spike_window"]
    # The window holds the applied steps' losses (ring slot applied % 3): 1.0, 1.05, 0.8.
    assert window.tolist() == pytest.approx([1.0, 1.05, 0.8])
    assert int(scaler.get_num_spike_skips()) == 2


WORKER = Path(__file__).with_name("_spike_worker.py")


@functools.cache
def one_process_run(metric):
    """The oracle of the 2-rank job: ``_spike_worker.run`` on the full batch in this process."""
    from _spike_worker import run

    return run(metric, None, 1)


@pytest.fixture(scope="module")
def rank_runs(tmp_path_factory):
    """Both ranks' results of the 2-process job (``_spike_worker.py``: DDP, then FSDP2)."""
    out = tmp_path_factory.mktemp("spike_ranks")
    procs = start_ranks(WORKER, out, 2)
    wait_for_ranks(procs, out, time.monotonic() + 300)  # a loaded machine: margin
    return [pickle.loads((out / f"rank{rank}.pkl").read_bytes()) for rank in range(2)]


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
@pytest.mark.parametrize("metric", ["grad_norm", "loss"])
def test_the_ranks_take_the_one_process_decisions(rank_runs, wrapper, metric):
    """A bad batch on rank 1 alone is skipped on both ranks, as on the full batch in one
    process (the norm is global: with FSDP2 the sum of both ranks' shards; the loss is averaged
    over the ranks in the collective)."""
    from _spike_worker import BAD_STEP, STEPS

    oracle = one_process_run(metric)
    rank0, rank1 = (runs["runs"][(wrapper, metric)] for runs in rank_runs)
    assert rank0["sharded"] == rank1["sharded"] == [wrapper == "fsdp2"] * 4
    applied = [[ok for ok, _, _ in r["steps"]] for r in (oracle, rank0, rank1)]
    assert applied[0] == applied[1] == applied[2]
    assert applied[0] == [step != BAD_STEP for step in range(STEPS)]
    assert rank0["steps"][-1][2] == rank1["steps"][-1][2] == 1
    assert deep_equal(rank0["state"], rank1["state"])  # the same window, bit for bit
    assert_tensors_equal(rank0["params"], rank1["params"])
    for ours, expected in zip(rank0["params"], oracle["params"], strict=True):
        torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        rank0["state"]["spike_window"], oracle["state"]["spike_window"], rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(
    ("check", "names"),
    [
        ("spike_window", "the spike window (spike_window, spike_applied, num_spike_skips)"),
        ("spike_applied", "the spike window (spike_window, spike_applied, num_spike_skips)"),
        ("absorbed_overflows", "the overflows hysteresis absorbed (absorbed_overflows)"),
    ],
)
def test_ranks_whose_spike_window_or_absorbed_overflows_differ_both_raise(rank_runs, check, names):
    """Rank 1 loaded a window (or a count of absorbed overflows) that rank 0 does not have: the
    fingerprint both ranks gather with their partial sums differs, and both raise, naming it."""
    for runs in rank_runs:
        found = runs["disagreements"]
        assert found["agree"] == "ok"  # the same configuration and state: no false alarm
        assert found[check] == (
            f"RuntimeError: the ranks' GradScalers disagree on {names}, so their decisions were "
            "not taken together: every rank must load the same state_dict and call "
            "scale/unscale_/step/update in the same order"
        )


def test_the_window_digest_tells_apart_windows_that_differ_anywhere_that_counts():
    """The checksum the ranks compare (``_cores._window_digest``): one changed value, two
    values swapped (the ring in another order), every value doubled (a pattern a plain
    weighted sum of the bits cannot see: it was a bug), another ``applied`` or
    ``num_spike_skips`` each change it; the last step's ``spiked`` and ``threshold``, which a
    load resets, do not."""
    from torch_facade.amp._engine import _cores

    values = np.array([1.5, 2.5, 0.5, 3.0], np.float32)
    packed = np.concatenate([values.view(np.int32), np.array([6, 1, 0, 0], np.int32)])

    def digest(changed):
        return [float(x) for x in _cores._window_digest(jnp.asarray(changed))]

    def with_values(new):
        return np.concatenate([np.asarray(new, np.float32).view(np.int32), packed[4:]])

    others = [
        with_values([1.5, 2.5, 0.5, 3.5]),
        with_values(values[[1, 0, 2, 3]]),
        with_values(values * 2),
        np.concatenate([packed[:4], [7, 1, 0, 0]]),
        np.concatenate([packed[:4], [6, 2, 0, 0]]),
    ]
    digests = [digest(packed), *map(digest, others)]
    assert len({tuple(d) for d in digests}) == len(digests)
    assert digest(np.concatenate([packed[:6], [1, 12345]])) == digests[0]
    assert all(0 <= half < 2**16 and half.is_integer() for half in digests[0])


@pytest.mark.parametrize("metric", ["grad_norm", "loss"])
def test_a_compiled_train_step_skips_the_same_spike_as_eager(metric):
    """The whole train step under ``torch.compile`` (``aot_eager``: dynamo and AOTAutograd, no
    generated kernels, so the arithmetic is eager's): the same decisions, the same parameters
    bit for bit, and no recompilation after the first two steps although a spike is skipped."""
    import torch._dynamo
    from test_compile import CountingBackend

    bad_step, steps = 7, 10

    def train(compiled: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = cstorch.amp.GradScaler(
            **DLS,
            optimizers=[opt],
            spike_skip=cstorch.amp.SpikeSkip(metric=metric, window=4, sigma=3.0),
        )

        def step(x, y, factor):
            opt.zero_grad()
            loss = factor * torch.nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss

        backend = CountingBackend("aot_eager")
        if compiled:
            torch._dynamo.reset()
            step = torch.compile(step, backend=backend)
        generator = torch.Generator().manual_seed(3)
        flags, compiles_at_warm_up = [], 0
        for index in range(steps):
            x = torch.randn(4, 8, generator=generator)
            y = torch.randn(4, 4, generator=generator)
            factor = torch.tensor(300.0 if index == bad_step else 1.0)
            if index == 2:
                compiles_at_warm_up = backend.compiles
            with torch._dynamo.config.patch(error_on_recompile=index >= 2):
                step(x, y, factor)
            flags.append(bool(scaler.get_isfinite()))
        params = [p.detach().clone() for p in model.parameters()]
        return flags, params, scaler, (compiles_at_warm_up, backend.compiles)

    eager_flags, eager_params, _, _ = train(compiled=False)
    flags, params, scaler, (at_warm_up, compiles) = train(compiled=True)
    assert flags == eager_flags == [index != bad_step for index in range(steps)]
    assert_tensors_equal(eager_params, params)
    assert int(scaler.get_num_spike_skips()) == 1
    assert compiles == at_warm_up > 0  # compiled graphs, none after the warm-up


def test_a_planted_bad_batch_hurts_the_default_run_and_not_the_spike_skipping_one():
    """A 52-step version of tests/torch_facade/facade_spike_skip_demo.py (docs/pytorch/spike-skip.md)."""
    from facade_spike_skip_demo import train

    default = train(None, steps=52, bad_step=40, factor=300.0)
    skipping = train(cstorch.amp.SpikeSkip(window=16), steps=52, bad_step=40, factor=300.0)
    assert default["before"] == skipping["before"]  # the same run up to the bad step
    assert skipping["after"] == skipping["before"]  # skipped: the parameters did not move
    assert default["after10"] > 2 * skipping["after10"]  # 0.071 and 0.016 on 7 Dec 2026
    assert (default["spike_skips"], skipping["spike_skips"]) == (0, 1)
    assert default["overflow_skips"] == skipping["overflow_skips"] == 0


def test_a_spike_is_not_counted_as_skipped_when_a_known_optimizer_does_not_step():
    """The recount for optimizers that did not step (amp_core.recount_skipped_steps) counts
    overflows only: a spike leaves num_skipped_steps alone there too."""
    first, second = torch.nn.Linear(2, 1, bias=False), torch.nn.Linear(2, 1, bias=False)
    opt1 = torch.optim.SGD(first.parameters(), lr=0.0)
    opt2 = torch.optim.SGD(second.parameters(), lr=0.0)
    scaler = cstorch.amp.GradScaler(
        **DLS, optimizers=[opt1, opt2], spike_skip=cstorch.amp.SpikeSkip(window=4)
    )
    for x in [1.0, 1.1, 0.9, 1.0, 300.0, INF]:
        opt1.zero_grad()
        opt2.zero_grad()
        inputs = torch.full((1, 2), x)
        scaler.scale(first(inputs).sum() + second(torch.ones(1, 2)).sum()).backward()
        scaler.step(opt1)  # opt2 is known but not stepped
        scaler.update()
        if x == 300.0:
            assert not bool(scaler.get_isfinite())
            assert int(scaler.get_num_skipped_steps()) == 0
            assert int(scaler.get_num_spike_skips()) == 1
    assert int(scaler.get_num_skipped_steps()) == 1  # the overflow, stepped by one optimizer


def test_update_if_finite_restores_its_tensor_after_a_spike():
    model = torch.nn.Linear(2, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = cstorch.amp.GradScaler(**DLS, spike_skip=cstorch.amp.SpikeSkip(window=4))
    counter = torch.zeros(())
    for x in [1.0, 1.1, 0.9, 1.0, 300.0, 1.0]:
        optimizer.zero_grad()
        scaler.scale(model(torch.full((1, 2), x)).sum()).backward()
        scaler.step(optimizer)
        cstorch.amp.update_if_finite(optimizer, counter)  # restored if the step is skipped
        counter += 1  # so it counts applied steps only
        scaler.update()
        assert bool(cstorch.amp.isfinite(optimizer)) == (x != 300.0)
    assert float(counter) == 5.0
