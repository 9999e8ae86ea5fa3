"""The demo: its text, its two models, a tiny run of every row of both front doors, its errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from demo import cli, jax_door, sweep, torch_door
from demo.rows import rows_for
from demo.text import HELD_OUT_EVERY, held_out_windows, load_corpus, stdlib_root, training_windows
from workbench.byte_gpt import ModelSize, Settings

TINY = Settings(
    steps=3,
    batch_size=4,
    eval_windows=8,
    warmup_steps=2,
    size=ModelSize(n_layer=1, n_embd=32, n_head=2, n_positions=16),
)


def test_the_corpus_is_the_standard_library_split_by_file() -> None:
    corpus = load_corpus()
    files = sorted(p.name for p in stdlib_root().glob("*.py"))
    assert corpus.held_out_files == tuple(files[HELD_OUT_EVERY - 1 :: HELD_OUT_EVERY])
    assert sorted(corpus.train_files + corpus.held_out_files) == files
    expected = b"".join((stdlib_root() / name).read_bytes() for name in corpus.held_out_files)
    assert corpus.held_out.tobytes() == expected


def test_windows_come_from_the_seed_and_the_held_out_ones_do_not() -> None:
    corpus = load_corpus()
    first = training_windows(corpus, TINY)
    assert first.shape == (3, 4, 17) and first.dtype == np.int32
    assert np.array_equal(first, training_windows(corpus, TINY))
    other = Settings(**{**TINY.__dict__, "seed": 1})
    assert not np.array_equal(first, training_windows(corpus, other))
    assert np.array_equal(held_out_windows(corpus, TINY), held_out_windows(corpus, other))
    text = corpus.train.tobytes()
    assert all(bytes(w.astype(np.uint8)) in text for w in first[0])


@pytest.mark.parametrize("fmt", ["float32", "float16", "bfloat16", "cbfloat16"])
def test_both_front_doors_compute_the_same_model(fmt: str) -> None:
    """transformers' GPT2LMHeadModel and the NNX GPT, from the same weights, in each format."""
    windows = held_out_windows(load_corpus(), TINY)
    model = torch_door.make_model(TINY.size, seed=0)
    with torch.no_grad(), torch_door.numerics(model, fmt):
        torch_loss = float(torch_door.cross_entropy(model, torch.from_numpy(windows)))
    jax_loss = float(jax_door.cross_entropy(jax_door.GPT(TINY.size, 0, fmt), jnp.asarray(windows)))
    # Same weights and rounding places; float32 arithmetic differs in summation order only.
    tolerance = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2, "cbfloat16": 2e-3}[fmt]
    assert jax_loss == pytest.approx(torch_loss, rel=tolerance)
    assert torch_loss == pytest.approx(np.log(256), rel=0.02)  # a fresh model guesses uniformly


def test_dtype_numerics_rounds_weights_and_outputs_then_removes_itself() -> None:
    model = torch_door.make_model(TINY.size, seed=0)
    keys = list(model.state_dict())
    before = [p.detach().clone() for p in model.parameters()]
    seen = []
    handle = model.transformer.h[0].mlp.c_fc.register_forward_hook(
        lambda m, a, out: seen.append((m.weight.detach().clone(), out))
    )
    with torch_door.dtype_numerics(model, torch.float16):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    handle.remove()
    weight, output = seen[0]
    assert torch.equal(weight, weight.half().float()) and not torch.equal(weight, before[0][:0])
    assert output.dtype == torch.float32
    assert list(model.state_dict()) == keys
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


# Four of the quick sweep's six rows (float16 + DLS draws the gradient plot; cbfloat16 + DLS is
# set_half_dtype("cbfloat16")'s default): each row a door trains costs a few XLA compilations,
# the bulk of this module's time.
TINY_SWEEP_ROWS = ("float32", "float16", "float16+dls", "cbfloat16+dls")
TINY_SWEEP = sweep.SweepPlan(ks=(1, 4), rows=TINY_SWEEP_ROWS, steps=3, accumulate_k=4)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, Path]:
    out_dir = tmp_path_factory.mktemp("demo")
    results = cli.run(
        TINY, ["torch", "jax"], [0, 1], out_dir, "python -m demo --tiny", False, plan=TINY_SWEEP
    )
    return results, out_dir


def test_a_tiny_run_trains_every_row_of_both_front_doors(tiny_run: tuple[list, Path]) -> None:
    results = tiny_run[0]
    assert [d.front_door for d in results] == ["torch", "jax"]
    for door in results:
        assert [r.row for r in door.rows] == list(rows_for(door.front_door))
        for result in door.rows:
            assert len(result.train_losses) == 3 and np.isfinite(result.held_out_loss)
            assert (result.scales is None) == (result.row.scaling == "none")
        assert set(door.float32_seeds) == {0, 1}
    # Same weights, same batches, the same optimizer: the front doors agree in float32.
    assert results[0].reference == pytest.approx(results[1].reference, rel=1e-4)


def test_the_tiny_run_writes_the_table_the_json_and_the_plots(tiny_run: tuple[list, Path]) -> None:
    _, out_dir = tiny_run
    data = json.loads((out_dir / "demo.json").read_text())
    assert data["command"] == "python -m demo --tiny" and data["settings"]["steps"] == 3
    assert len(data["rows"]) == 16
    row = next(r for r in data["rows"] if r["front_door"] == "jax" and r["row"] == "float16+dls")
    columns = (
        "held_out_loss",
        "ratio_to_float32",
        "skipped_steps",
        "loss_scale_min",
        "loss_scale_max",
        "underflow_fraction_at_scale_1",
        "underflow_fraction_at_loss_scale",
        "time_per_step_s",
    )
    assert all(row[c] is not None for c in columns)
    assert row["loss_scale_min"] == row["loss_scale_max"] == 2.0**15
    f32 = [r for r in data["rows"] if r["row"] == "float32"]
    assert [r["ratio_to_float32"] for r in f32] == [1.0, 1.0]
    assert all(r["underflow_fraction_at_scale_1"] is None for r in f32)
    assert set(data["float32_seeds"]) == {"torch", "jax"}
    text = (out_dir / "demo.md").read_text()
    assert "| float16 + torch.amp.GradScaler |" in text and "float32 over 2 seeds" in text
    for door in ("torch", "jax"):
        for plot in ("losses", "loss_scale", "gradients"):
            png = out_dir / f"{door}_{plot}.png"
            assert png.read_bytes().startswith(b"\x89PNG") and f"({png.name})" in text


def test_jax_rows_differing_only_in_seed_or_k_reuse_one_compiled_step(
    tiny_run: tuple[list, Path],
) -> None:
    """The fixture trained float32 at seed 0; seed 2 at k = 4 neither traces nor compiles the
    step again (each row's optimizer holds fresh optax closures in its static graph)."""
    step = jax_door._STEPS["amp_core", "float32"]
    compiled = step._cache_size()
    other = dataclasses.replace(TINY, seed=2, loss_divisor=4)
    corpus = load_corpus()
    windows, held_out = training_windows(corpus, other), held_out_windows(corpus, other)
    result = jax_door.train_row(rows_for("jax")[0], other, windows, held_out, progress=False)
    assert step._cache_size() == compiled
    first = tiny_run[0][1].rows[0]
    assert result.row.key == first.row.key == "float32"
    assert result.train_losses != first.train_losses  # its own seed's weights and batches


@pytest.mark.parametrize("front_door", ["torch", "jax"])
def test_the_library_and_the_peer_take_the_same_skip_decisions(front_door: str) -> None:
    """From a scale that overflows float16 (2**40) both back off on the same steps, to the
    same scales, with bit-identical losses."""
    settings = Settings(**{**TINY.__dict__, "steps": 30, "init_scale": 2.0**40})
    corpus = load_corpus()
    batches, held_out = training_windows(corpus, settings), held_out_windows(corpus, settings)
    door = torch_door if front_door == "torch" else jax_door
    ours, peer = (
        door.train_row(row, settings, batches, held_out, progress=False)
        for row in rows_for(front_door)
        if row.key in ("float16+dls", "peer")
    )
    assert ours.skipped_steps >= 5 and ours.skipped == peer.skipped
    assert ours.scales == peer.scales and ours.scales[0] == 2.0**40
    assert ours.train_losses == peer.train_losses


@pytest.mark.parametrize(
    ("argv", "steps", "seeds", "doors"),
    [
        ([], cli.QUICK_STEPS, [0], ["torch", "jax"]),
        (["--full", "--seed", "4"], cli.FULL_STEPS, [4, 5, 6], ["torch", "jax"]),
        (["--steps", "7", "--front-door", "jax"], 7, [0], ["jax"]),
        (["--full", "--sweep-only"], cli.FULL_STEPS, [0, 1, 2], ["torch", "jax"]),
    ],
)
def test_the_command_line_runs_what_it_says(
    argv: list[str], steps: int, seeds: list[int], doors: list[str], monkeypatch, tmp_path: Path
) -> None:
    calls = []
    monkeypatch.setattr(cli, "run", lambda *args, **kwargs: calls.append((args, kwargs)))
    assert cli.main([*argv, "--out-dir", str(tmp_path), "--no-progress"]) == 0
    (settings, run_doors, run_seeds, out_dir, command), kwargs = calls[0]
    assert (settings.steps, settings.seed, run_seeds, run_doors) == (steps, seeds[0], seeds, doors)
    plan = sweep.FULL if "--full" in argv else sweep.QUICK
    assert kwargs == {
        "progress": False,
        "plan": dataclasses.replace(plan, steps=steps) if "--steps" in argv else plan,
        "table": "--sweep-only" not in argv,
    }
    assert out_dir == tmp_path
    assert command.startswith("python -m demo")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "1"], "argument --steps: must be an integer of at least 2; got 1"),
        (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
        (["--seed", "-1"], "argument --seed: must be a non-negative integer; got -1"),
        (["--front-door", "tf"], "argument --front-door: invalid choice: 'tf'"),
        (["--out-dir", __file__], "exists and is not a folder"),
    ],
)
def test_bad_arguments_get_clear_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


SWEEP_KEYS = {
    "front_door",
    "k",
    "tokens_per_step",
    "row",
    "format",
    "scaling",
    "held_out_loss",
    "ratio_to_float32",
    "skipped_steps",
    "underflow_at_1",
    "underflow_at_scale",
}


def test_the_tiny_run_writes_the_sweep(tiny_run: tuple[list, Path]) -> None:
    results, out_dir = tiny_run
    data = json.loads((out_dir / "demo.json").read_text())
    entries = data["sweep"]
    # Per door: 4 rows at k = 1 and at k = 4, and the same 4 with 4 real micro-batches.
    assert len(entries) == 2 * (3 * 4)
    assert all(SWEEP_KEYS <= set(e) for e in entries)
    for door in results:
        mine = [e for e in entries if e["front_door"] == door.front_door]
        assert [e["k"] for e in mine] == [1] * 4 + [4] * 4 + [4] * 4
        assert [e["micro_batches"] for e in mine] == [1] * 8 + [4] * 4
        assert [e["row"] for e in mine] == list(TINY_SWEEP_ROWS) * 3
        assert all(e["tokens_per_step"] == 4 * 16 * e["k"] for e in mine)
        # k = 1 is the main table's run, not trained again.
        for e in mine[:4]:
            assert e["held_out_loss"] == door.row(e["row"]).held_out_loss
        for start in (0, 4, 8):
            assert mine[start]["row"] == "float32" and mine[start]["ratio_to_float32"] == 1.0
            assert mine[start]["underflow_at_1"] is None
        scaled = [e for e in mine if e["scaling"] != "none"]
        assert all(e["underflow_at_scale"] is not None for e in scaled)
        # The cbfloat16 row a set_half_dtype("cbfloat16") user runs: DLS from 2**31, at every
        # k and with real accumulation too.
        cb = [e for e in mine if e["row"] == "cbfloat16+dls"]
        assert [(e["k"], e["micro_batches"]) for e in cb] == [(1, 1), (4, 1), (4, 4)]
        assert all(e["scaling"] == "dls" and e["loss_scale_max"] == 2.0**31 for e in cb)
        # Dividing every gradient by 4 moves the largest element down two binades: the
        # suggested scale is exactly 4 times larger, and no fewer elements underflow.
        guess = {
            (p["k"], p["fmt"]): p
            for p in data["sweep_predictions"]
            if p["front_door"] == door.front_door
        }
        for fmt in sweep.HALF_FORMATS:
            one, four = guess[1, fmt], guess[4, fmt]
            # ... up to float32's largest power of two, where the wide formats' suggestion stops
            assert four["suggested_loss_scale"] == min(4 * one["suggested_loss_scale"], 2.0**127)
            assert four["underflow_at_1"] >= one["underflow_at_1"]
        assert guess[1, "bfloat16"]["underflow_at_1"] == 0.0
    # The same real accumulation through both front doors: float32 agrees.
    real = [e["held_out_loss"] for e in entries if e["micro_batches"] == 4 and e["k"] == 4]
    assert real[0] == pytest.approx(real[4], rel=1e-4)
    text = (out_dir / "demo.md").read_text()
    assert "## Where loss scaling matters" in text and "k = 4, real accumulation" in text
    for name in ("sweep_losses", "sweep_underflow", "torch_sweep_gradients", "jax_sweep_gradients"):
        png = out_dir / f"{name}.png"
        assert png.read_bytes().startswith(b"\x89PNG") and f"({png.name})" in text


@pytest.mark.parametrize("front_door", ["torch", "jax"])
def test_real_accumulation_of_one_batch_four_times_is_the_step_of_that_batch(
    front_door: str,
) -> None:
    """Four micro-batches, each the same windows, each loss divided by 4: the summed gradients
    are the gradients of one batch (dividing by 4 is exact), so float32 trains exactly as
    without them. (The shapes of the tiny run's real accumulation at k = 4: the JAX door reuses
    its compiled step when the fixture ran first, as it does in this module's order.)"""
    corpus = load_corpus()
    batches, held_out = training_windows(corpus, TINY), held_out_windows(corpus, TINY)
    four = dataclasses.replace(TINY, loss_divisor=4, micro_batches=4)
    door = torch_door if front_door == "torch" else jax_door
    row = rows_for(front_door)[0]
    one = door.train_row(row, TINY, batches, held_out, progress=False)
    same = np.stack([batches] * 4, axis=1)
    real = door.train_row(row, four, same, held_out, False)
    assert real.train_losses == pytest.approx(one.train_losses, rel=1e-6)
    assert real.held_out_loss == pytest.approx(one.held_out_loss, rel=1e-6)


def test_micro_batches_extend_the_batches_of_the_same_seed() -> None:
    corpus = load_corpus()
    real = dataclasses.replace(TINY, loss_divisor=4, micro_batches=4)
    windows = training_windows(corpus, real)
    assert windows.shape == (3, 4, 4, 17)
    assert np.array_equal(windows[:, 0], training_windows(corpus, TINY))
    assert real.tokens_per_step == 4 * 16 * 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss_divisor": 0}, "loss_divisor must be an integer of at least 1; got 0"),
        ({"loss_divisor": 2.0}, "loss_divisor must be an integer of at least 1; got 2.0"),
        ({"micro_batches": -1}, "micro_batches must be an integer of at least 1; got -1"),
    ],
)
def test_settings_name_a_bad_accumulation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Settings(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ks": (0, 4)}, "every k must be an integer of at least 1; got 0"),
        ({"ks": (1, 2.5)}, "every k must be an integer of at least 1; got 2.5"),
        ({"ks": ()}, "ks must name at least one accumulation factor"),
        ({"ks": (16, 1)}, r"ks must be distinct and ascending; got \(16, 1\)"),
        ({"rows": ("float16", "float32")}, "rows must start with 'float32'"),
        ({"rows": ("float32", "float8")}, "rows must start with 'float32' and be among"),
        ({"steps": 1}, "steps must be an integer of at least 2; got 1"),
        ({"accumulate_k": 8}, r"accumulate_k must be one of ks \(1, 4\).* got 8"),
    ],
)
def test_a_bad_sweep_plan_gets_a_clear_error(kwargs: dict, message: str) -> None:
    arguments = {"ks": (1, 4), "rows": sweep.QUICK_ROWS, "steps": 3, **kwargs}
    with pytest.raises(ValueError, match=message):
        sweep.SweepPlan(**arguments)
