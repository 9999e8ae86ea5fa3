"""The demo: its text, its two models, a tiny run of every row of both front doors, its errors."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from demo import cli, jax_door, torch_door
from demo.rows import rows_for
from demo.text import (
    HELD_OUT_EVERY,
    ModelSize,
    Settings,
    held_out_windows,
    load_corpus,
    stdlib_root,
    training_windows,
)

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


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, Path]:
    out_dir = tmp_path_factory.mktemp("demo")
    results = cli.run(TINY, ["torch", "jax"], [0, 1], out_dir, "python -m demo --tiny", False)
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
    assert out_dir == tmp_path and kwargs == {"progress": False}
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
