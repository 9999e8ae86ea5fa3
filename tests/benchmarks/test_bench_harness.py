"""The benchmark harness runs end to end on small settings and emits every field (never a timing).

The end-to-end run uses size S (20 tensors: its compilations are quicker than tiny's 148), every
section (the host-cost section with 3 and 5 one-element gradients, the JAX train step on S's
layout), one timed step per round and one round. The report's rendering of other cases (sections
left out, overflows, subnormals, a failed DDP section) is checked on edited copies of its results.
"""

from __future__ import annotations

import doctest
import json
import math
import multiprocessing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
import torch

from benchmarks import (
    bandwidth,
    cbfloat16_bench,
    cli,
    ddp_bench,
    host_bench,
    host_profile,
    jax_bench,
    memory_bench,
    plots,
    report,
    runner,
    scaler_checks,
    step_bench,
)
from workbench import call_timers, sizes, timing, whole_loop

STATS_KEYS = {"median", "min", "max"}
CASE_KEYS = {
    "section",
    "size",
    "group",
    "variant",
    "unit",
    "iters",
    "rounds",
    "samples",
    "stats",
    "compiles_after_warmup",
    "first_step",
}
ROUNDS = 1
S_TENSORS, S_PARAMS = 20, 1_068_800
HOST_TENSORS = (3, 5)
# The start-up, cbfloat16 and memory sections have tests of their own
# (test_startup_cbfloat16_bench.py, test_memory_bench.py): fresh processes and a GPT-2 would
# double this run.
HARNESS_SECTIONS = tuple(s for s in runner.SECTIONS if s not in ("startup", "cbfloat16", "memory"))


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Nothing is timed here; two OpenMP threads on a loaded 2-core machine (or next to another
    pytest worker) make every tiny step tens of times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, one_torch_thread: None) -> Path:
    """One end-to-end run that every test of the module reads. The facade's core cache is on,
    in a folder of the run's own (the suite turns it off): each decision core is compiled once,
    and the DDP ranks load what this process compiled instead of compiling it again."""
    out = tmp_path_factory.mktemp("bench")
    argv = ["--sizes", "S", "--rounds", str(ROUNDS), "--iters", "1", "--warmup", "1"]
    argv += ["--host-tensors", ",".join(map(str, HOST_TENSORS)), "--step-size", "S"]
    argv += ["--sections", ",".join(HARNESS_SECTIONS), "--full"]  # every group, every loss
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CSTORCH_AMP_CACHE_DIR", str(tmp_path_factory.mktemp("cores")))
        # The step section's 22 train steps (8 variants x 2 losses, 6 accumulating) are XLA
        # compilations, most of this run's time; each loss differs only in the function the
        # variants differentiate, so here every group differentiates the synthetic loss (about
        # half the compile time of the MLP forward). The forward itself:
        # test_the_step_section_s_forward_is_a_next_token_loss.
        synthetic = step_bench.synthetic_loss
        patch.setattr(step_bench, "LOSS_FUNCTIONS", dict.fromkeys(step_bench.LOSSES, synthetic))
        assert cli.main([*argv, "--out", str(out), "--no-progress"]) == 0
    return out


@pytest.fixture(scope="module")
def results(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / report.JSON_NAME).read_text())


@pytest.fixture(scope="module")
def markdown(run_dir: Path) -> str:
    return (run_dir / report.MARKDOWN_NAME).read_text()


def _assert_stats(stats: dict[str, Any]) -> None:
    assert set(stats) == STATS_KEYS
    for value in stats.values():
        assert value is None or isinstance(value, float)


WHOLE_GROUPS = [f"{o}, set_to_none={s}" for o in whole_loop.OPTIMIZERS for s in (True, False)]
SPIKE_GROUP = "AdamW fused, set_to_none=True"  # the one group that also times spike skipping
DDP_GROUP = f"{ddp_bench.OPTIMIZER}, set_to_none=True"


def test_every_case_is_present_with_all_rounds(results: dict[str, Any]) -> None:
    expected = (
        {("bandwidth", "stream", v) for v in bandwidth.VARIANTS}
        | {("torch", o, v) for o in whole_loop.OPTIMIZERS for v in whole_loop.VARIANTS}
        | {("jax", "optax", v) for v in jax_bench.VARIANTS}
        | {("whole", g, v) for g in WHOLE_GROUPS for v in whole_loop.WHOLE_VARIANTS}
        | {("whole", SPIKE_GROUP, "facade+spike_skip")}
        | {("ddp", DDP_GROUP, v) for v in whole_loop.VARIANTS}
        | {("host", o, v) for o in host_bench.OPTIMIZERS for v in host_bench.VARIANTS}
        | {("step", loss, v) for loss in step_bench.LOSSES for v in step_bench.variants_of(loss)}
    )
    cases = results["cases"]
    assert {(c["section"], c["group"], c["variant"]) for c in cases} == expected
    assert len(cases) == len(expected) + (len(HOST_TENSORS) - 1) * len(host_bench.OPTIMIZERS) * len(
        host_bench.VARIANTS
    )
    host_labels = {host_bench.label(n) for n in HOST_TENSORS}
    for case in cases:
        assert set(case) == CASE_KEYS
        assert case["size"] in (host_labels if case["section"] == "host" else {"S"})
        _assert_stats(case["stats"])
        assert len(case["rounds"]) == ROUNDS
        assert case["iters"] == 1
        assert [len(s) for s in case["samples"]] == [1] * ROUNDS
        assert all(isinstance(t, float) and t >= 0 for t in case["rounds"])
        assert case["compiles_after_warmup"] == 0
        if case["section"] == "bandwidth":
            assert case["first_step"] is None
        else:
            assert set(case["first_step"]) == {"seconds", "compiles", "compile_seconds"}


COMPARISON_KEYS = (
    "bare_ms",
    "torch_ms",
    "facade_ms",
    "step_ratio",
    "torch_overhead_ms",
    "facade_overhead_ms",
    "overhead_ratio",
)


def _assert_whole_rows(rows: list[dict[str, Any]], groups: set[tuple[str, bool]]) -> None:
    assert {(r["optimizer"], r["set_to_none"], r["clip"]) for r in rows} == {
        (o, s, c) for o, s in groups for c in (False, True)
    }
    assert len(rows) == 2 * len(groups)
    for row in rows:
        for key in COMPARISON_KEYS:
            _assert_stats(row[key])
        assert row["torch_skipped_steps"] == row["facade_skipped_steps"] == 0


def test_derived_rows_have_every_field(results: dict[str, Any]) -> None:
    assert set(results) == {
        "meta",
        "sizes",
        "cases",
        "whole",
        "spike_skip",
        "torch",
        "ddp",
        "step",
        "jax",
        "bandwidth",
        "floor",
        "host",
        "compile",
        "startup",
        "cbfloat16",
        "memory",
    }
    assert results["startup"] is None and results["cbfloat16"] is None  # not run here
    assert results["memory"] is None
    assert set(results["sizes"]) == {"S"}
    size = results["sizes"]["S"]
    assert set(size) == {
        "tensors",
        "params",
        "max_iters",
        "whole",
        "gradients",
        "other_cpu_cores",
    }
    assert (size["tensors"], size["params"]) == (S_TENSORS, S_PARAMS)
    assert set(size["gradients"]) == {"loss", "flushed_small_grads", "seconds"}
    whole = size["whole"]
    assert (whole["tensors"], whole["params"]) == (S_TENSORS, S_PARAMS)
    assert (whole["batch"], whole["tokens"]) == (whole_loop.BATCH, whole_loop.TOKENS)
    assert whole["subnormals"] == {"gradients": 0, "adamw_state": 0}
    vocab = sizes.SIZES["S"].vocab
    assert math.isclose(whole["initial_loss"], math.log(vocab), rel_tol=0.1)

    _assert_whole_rows(
        results["whole"], {(o, s) for o in whole_loop.OPTIMIZERS for s in (True, False)}
    )
    for row in results["whole"]:  # the single-process rows carry the XLA-read floor
        _assert_stats(row["floor_ms"])
        _assert_stats(row["floor_overhead_ms"])
    assert "XLA-read floor overhead" in report.markdown(results)
    (spike_row,) = results["spike_skip"]  # S only: the run has no other sized model
    assert (spike_row["size"], spike_row["optimizer"], spike_row["set_to_none"]) == (
        "S",
        "AdamW fused",
        True,
    )
    for key in ("facade_ms", "spike_skip_ms", "step_ratio"):
        _assert_stats(spike_row[key])
    assert spike_row["skipped_steps"] == 0
    ddp = results["ddp"]
    assert ddp["error"] is None
    assert (ddp["size"], ddp["world_size"], ddp["tensors"]) == ("S", 2, S_TENSORS)
    assert ddp["seconds"] > 0
    _assert_whole_rows(ddp["rows"], {(ddp_bench.OPTIMIZER, True)})

    torch_rows = results["torch"]
    assert {(r["optimizer"], r["clip"]) for r in torch_rows} == {
        (o, c) for o in whole_loop.OPTIMIZERS for c in (False, True)
    }
    for row in torch_rows:
        for key in COMPARISON_KEYS:
            _assert_stats(row[key])

    (jax_row,) = results["jax"]
    for key in (
        "adamw_ms",
        "dls_ms",
        "dls_gcc_ms",
        "dls_fused_ms",
        "dls_ratio",
        "dls_gcc_ratio",
        "dls_fused_ratio",
        "floor_ms",
        "floor_ratio",
        "dls_over_floor",
        "dls_fused_over_floor",
    ):
        _assert_stats(jax_row[key])

    (bw_row,) = results["bandwidth"]
    assert bw_row["params"] == S_PARAMS
    _assert_stats(bw_row["inplace_gbps"])
    _assert_stats(bw_row["read_gbps"])

    assert len(results["floor"]) == 2 * len(whole_loop.OPTIMIZERS)
    for row in results["floor"]:
        assert row["bytes_per_param"] in (4, 8, 12)
        for key in ("model", "floor_ms", "torch_overhead_ms", "facade_overhead_ms"):
            assert key in row
        assert "torch_fraction" in row and "facade_fraction" in row

    compile_cases = {(r["section"], r["case"]) for r in results["compile"]}
    facades = ("facade", "facade+clip")
    assert compile_cases == (
        {("torch", f"{v}, {o}") for o in whole_loop.OPTIMIZERS for v in facades}
        | {("whole", f"{v}, {g}") for g in WHOLE_GROUPS for v in facades}
        | {("whole", f"facade+spike_skip, {SPIKE_GROUP}")}
        | {("ddp", f"{v}, DDP, {DDP_GROUP}") for v in facades}
        | {("jax", v) for v in jax_bench.VARIANTS}
        | {("host", f"facade, {o}") for o in host_bench.OPTIMIZERS}
        | {
            ("step", f"{v}, {loss}")
            for loss in step_bench.LOSSES
            for v in step_bench.variants_of(loss)
        }
    )
    for row in results["compile"]:
        assert row["compiles_after_warmup"] == 0
        assert row["first_step_compiles"] >= 0

    meta = results["meta"]
    assert meta["compiles_after_warmup_total"] == 0
    assert meta["skipped_steps_total"] == 0
    assert meta["sections"] == list(HARNESS_SECTIONS)
    for key in (
        "date",
        "command",
        "torch",
        "jax",
        "optax",
        "cpu_count",
        "cpu_model",
        "torch_threads",
        "load_average_start",
        "load_average_end",
        "wall_seconds",
        "other_cpu_cores",
    ):
        assert key in meta
    assert meta["rounds"] == ROUNDS
    assert meta["cpu_model"] and meta["cpu_model"] in report.markdown(results)
    assert math.isclose(meta["loss_scale"], 1 + 2**-23)


HEADINGS = (
    "## 1. Whole iteration of the documented loop",
    "## 2. Scaler only, gradients refilled in place",
    "## 3. Whole iteration under DistributedDataParallel, 2 ranks",
    "## 4. The JAX train step as users write it",
    "## 5. Second view, gradients as inputs",
    "## 6. Bandwidth floor",
    "## 7. Host cost per gradient tensor",
    "## 8. Compilation",
)


def test_markdown_has_the_expected_rows(markdown: str) -> None:
    positions = [markdown.index(heading) for heading in HEADINGS]
    assert positions == sorted(positions)
    for optimizer in whole_loop.OPTIMIZERS:
        for clip in ("no", "yes"):
            assert f"| S | {optimizer} | {clip} |" in markdown  # scaler only
            for set_to_none in (True, False):
                assert f"| S | {optimizer} | {clip} | {set_to_none} |" in markdown  # whole
    assert markdown.count("| S | SGD foreach | no | ") == 4  # whole x2, scaler only, floor
    assert markdown.count(f"| S | {ddp_bench.OPTIMIZER} | yes | ") == 5  # and DDP
    assert f"| S | {S_PARAMS:,} |" in markdown  # bandwidth
    for case in ("facade, SGD foreach", "facade+clip, AdamW fused", *jax_bench.VARIANTS):
        assert f"| {case} |" in markdown
    assert "| S | whole | facade, SGD fused, set_to_none=True |" in markdown
    lines = markdown.splitlines()
    (spike_line,) = [line for line in lines if line.startswith("| S | AdamW fused | True | ")]
    assert spike_line.endswith(" | 0 |")  # the spike-skipping row: no step skipped
    assert (
        "spike_skip=SpikeSkip())` (the defaults" in markdown and "No step was skipped" in markdown
    )
    assert "compilations after warm-up, all cases: 0" in markdown
    assert markdown.count("No step overflowed") == 3  # whole, DDP and host
    for n in HOST_TENSORS:
        for optimizer in host_bench.OPTIMIZERS:
            assert f"| {n} | {optimizer} | " in markdown
    assert f"Sizes: S = {S_TENSORS} tensors, {S_PARAMS:,} params." in markdown
    for line in markdown.splitlines():
        if line.startswith("| S |"):
            assert line.endswith("|") and "None" not in line


def test_markdown_renders_the_sections_that_ran(results: dict[str, Any]) -> None:
    whole_only = {
        **results,
        "torch": [],
        "ddp": None,
        "step": None,
        "jax": [],
        "bandwidth": [],
        "floor": [],
        "host": [],
        "compile": [r for r in results["compile"] if r["section"] == "whole"],
    }
    text = report.markdown(whole_only)
    assert "## 1. Whole iteration of the documented loop" in text
    assert "## 2. Compilation" in text
    assert "Scaler only" not in text and "gradients as inputs" not in text
    assert "DistributedData" not in text and "JAX train step" not in text
    zero = {"gradients": 0, "adamw_state": 0}
    whole = {"tensors": 148, "params": 39904, "batch": 1, "tokens": 16, "subnormals": zero}
    tiny = {"tensors": 148, "params": 148, "whole": whole}
    text = report.markdown({**results, "sizes": {"tiny": tiny}})
    assert "tiny = 148 tensors, 148 params (whole-iteration model: 148 tensors, 39,904" in text
    scaler_only = {**results, "whole": [], "ddp": None, "step": None}
    text = report.markdown(scaler_only)
    assert "## 1. Scaler only, gradients refilled in place" in text
    assert "Whole iteration" not in text
    host_only = {**results, "sizes": {}, "whole": [], "torch": [], "ddp": None, "jax": []}
    host_only["step"] = None
    text = report.markdown({**host_only, "bandwidth": [], "floor": [], "compile": []})
    assert "## 1. Host cost per gradient tensor" in text and "Sizes:" not in text


def test_markdown_reports_overflows_and_ddp_failures(results: dict[str, Any]) -> None:
    skipped = [dict(r) for r in results["whole"]]
    skipped[0]["facade_skipped_steps"] = 3
    text = report.markdown({**results, "whole": skipped})
    assert "**Steps were skipped for an overflow**" in text
    assert "S SGD foreach: torch 0, facade 3" in text
    spiked = [{**results["spike_skip"][0], "skipped_steps": 2}]
    text = report.markdown({**results, "spike_skip": spiked})
    assert "**Steps were skipped** (those rows time skipped steps): S: 2." in text
    assert "spike_skip=SpikeSkip())" not in report.markdown({**results, "spike_skip": []})
    assert "Subnormal float32 values after two probe iterations" in text
    assert "(not 0:" not in text
    size = results["sizes"]["S"]
    subnormal = {
        **size,
        "whole": {**size["whole"], "subnormals": {"gradients": 0, "adamw_state": 7}},
    }
    text = report.markdown({**results, "sizes": {"S": subnormal}})
    assert "two probe iterations (gradients / fused AdamW state): S 0 / 7 **(not 0:" in text
    failed = {**results, "ddp": {**results["ddp"], "error": "TimeoutError: took too long"}}
    text = report.markdown(failed)
    assert "**The DDP section failed**: `TimeoutError: took too long`" in text


def test_stdout_is_the_markdown(run_dir: Path, markdown: str) -> None:
    assert (run_dir / report.JSON_NAME).stat().st_size > 0
    assert markdown.startswith("# Benchmarks")


def test_markdown_reports_machine_sharing(results: dict[str, Any]) -> None:
    quiet = {**results, "meta": {**results["meta"], "other_cpu_cores": 0.0}}
    busy = {**results, "meta": {**results["meta"], "other_cpu_cores": 1.5}}
    assert "Other processes kept 0.00 of" in report.markdown(quiet)
    assert "machine was shared" not in report.markdown(quiet)
    assert "machine was shared" in report.markdown(busy)


def test_markdown_states_thread_settings(results: dict[str, Any]) -> None:
    none = {**results, "meta": {**results["meta"], "env": {}}}
    tuned = {**results, "meta": {**results["meta"], "env": {"GOMP_SPINCOUNT": "3000"}}}
    assert "Thread settings: none in the environment" in report.markdown(none)
    assert "Thread settings: `GOMP_SPINCOUNT=3000`." in report.markdown(tuned)


def test_thread_settings_are_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in runner.THREAD_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "3000")
    monkeypatch.setenv("OMP_PROC_BIND", "true")  # not a listed setting
    meta = runner._meta(runner.BenchOptions(sizes=("tiny",)), [])
    assert meta["env"] == {"GOMP_SPINCOUNT": "3000"}


@pytest.fixture(scope="module")
def workload(one_torch_thread: None) -> whole_loop.Workload:
    """Size S: the end-to-end run has compiled the facade for its gradients already."""
    return whole_loop.make_workload(sizes.SIZES["S"])


@pytest.mark.parametrize(
    "name", ["torch", "torch+clip", "facade", "facade+clip", "facade+spike_skip"]
)
def test_train_loop_counts_skipped_steps(workload: whole_loop.Workload, name: str) -> None:
    loop = whole_loop.TrainLoop(name, "SGD foreach", True, workload)
    loop.step()
    assert loop.skipped_steps() == 0
    with torch.no_grad():
        loop.params[0].fill_(math.inf)  # the embedding: the loss and its gradients are not finite
    loop.step()
    loop.step()
    assert loop.skipped_steps() == 2


def test_the_spike_skipping_loop_counts_a_spike_as_skipped(workload: whole_loop.Workload) -> None:
    """A window of 128 tiny norms, armed: the next iteration's norm is a spike."""
    loop = whole_loop.TrainLoop("facade+spike_skip", "AdamW fused", True, workload)
    assert loop.facade is not None
    loop.facade.load_state_dict({"spike_window": torch.full((128,), 1e-6), "spike_applied": 128})
    before = [p.detach().clone() for p in loop.params]
    loop.step()
    assert loop.skipped_steps() == 1
    assert all(torch.equal(a, b) for a, b in zip(before, loop.params, strict=True))


def test_train_loop_trains_a_copy(workload: whole_loop.Workload) -> None:
    loop = whole_loop.TrainLoop("bare", "AdamW fused", False, workload)
    loop.step()
    loop.step()
    assert loop.params[0] is not next(workload.model.parameters())
    assert all(p.grad is not None for p in loop.params)  # set_to_none=False keeps them
    with pytest.raises(ValueError, match="unknown variant"):
        whole_loop.TrainLoop("facade+fast", "SGD foreach", True, workload)


def test_subnormals_are_counted(workload: whole_loop.Workload) -> None:
    values = torch.tensor([1e-39, 0.0, 1.0, -1e-40, 2.0**-126, -math.inf])
    assert whole_loop._subnormals([values, values[:1]]) == 3
    tiny = whole_loop.make_workload(sizes.SIZES["tiny"])
    assert tiny.tensors == len(sizes.shape_list(sizes.SIZES["tiny"]))
    assert whole_loop.count_subnormals(tiny) == {"gradients": 0, "adamw_state": 0}


def test_ddp_section_times_out_and_stops_its_ranks() -> None:
    settings = ddp_bench.DdpSettings(size="tiny", rounds=1, iters=1, warmup=0)
    with pytest.raises(TimeoutError, match="did not finish"):
        ddp_bench.run(settings, timeout_s=0.5)
    assert not multiprocessing.active_children()


def test_cli_selects_sections(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[runner.BenchOptions] = []

    def fake_run(options: runner.BenchOptions, argv: Any = None) -> dict[str, Any]:
        seen.append(options)
        raise SystemExit(0)

    monkeypatch.setattr(cli, "run", fake_run)
    for argv, sections in (
        ([], runner.SECTIONS),
        (["--sections", "whole"], ("whole",)),
        (["--sections", "scaler,jax"], ("scaler", "jax")),
        (
            ["--no-ddp"],
            ("whole", "scaler", "step", "jax", "host", "startup", "cbfloat16", "memory"),
        ),
        (["--sections", "step", "--step-size", "S"], ("step",)),
        (["--sections", "host", "--host-tensors", "7,9"], ("host",)),
    ):
        with pytest.raises(SystemExit):
            cli.main([*argv, "--out", str(tmp_path)])
        assert seen[-1].sections == sections
    assert seen[0].sizes == sizes.QUICK_SIZES and seen[0].ddp_size == "S"
    assert seen[0].step_size == "S" and seen[0].rounds == runner.QUICK_ROUNDS
    assert not seen[0].full
    assert seen[0].host_tensors == host_bench.TENSORS and seen[-1].host_tensors == (7, 9)
    with pytest.raises(SystemExit, match="no section left"):
        cli.main(["--sections", "ddp", "--no-ddp"])


def test_the_quick_run_and_the_full_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``make bench`` is the quick run (every section, fewer sizes and rounds, the step section
    at S, no float16 autocast rows); ``--full`` the documented one; explicit options win."""
    seen: list[runner.BenchOptions] = []

    def fake_run(options: runner.BenchOptions, argv: Any = None) -> dict[str, Any]:
        seen.append(options)
        raise SystemExit(0)

    monkeypatch.setattr(cli, "run", fake_run)
    for argv in ([], ["--full"], ["--full", "--sizes", "S", "--rounds", "2", "--step-size", "S"]):
        with pytest.raises(SystemExit):
            cli.main([*argv, "--out", str(tmp_path)])
    quick, full, chosen = seen
    assert quick.sections == full.sections == runner.SECTIONS
    assert (quick.sizes, quick.rounds, quick.step_size, quick.full) == (
        ("S",),
        3,
        "S",
        False,
    )
    assert (full.sizes, full.rounds, full.step_size, full.full) == (
        ("S", "M", "tiny"),
        5,
        "M",
        True,
    )
    assert (chosen.sizes, chosen.rounds, chosen.step_size, chosen.full) == (("S",), 2, "S", True)
    cli.build_parser().parse_args(["--full", "--large"])  # --large still adds L
    # The quick run's cuts; the full run keeps every group, loss and round.
    assert runner._set_to_none(quick) == (True,) and runner._set_to_none(full) == (True, False)
    assert runner._step_losses(quick) == step_bench.LOSSES[:2]
    assert runner._step_losses(full) == step_bench.LOSSES
    assert (runner._startup_rounds(quick), runner._startup_rounds(full)) == (2, 5)


def test_choose_iters_makes_every_round_at_least_the_minimum() -> None:
    for step_s in (1e-6, 1e-4, 0.003, 0.05, 0.19):
        iters = timing.choose_iters(5, step_s, fixed=False)
        assert iters * step_s >= timing.MIN_ROUND_S or iters == timing.MAX_ITERS
    assert timing.choose_iters(5, 1.5, fixed=False) == 1  # one step is past the minimum
    assert timing.choose_iters(5, 0.01, fixed=True) == 5  # the user's --iters is kept


def test_no_ratio_below_its_floor_is_printed_as_a_result() -> None:
    below = {"median": 0.93, "min": 0.88, "max": 1.02}
    never = {"median": 0.47, "min": 0.33, "max": 0.50}
    assert report._ratio_cell(never, floor=1.0).endswith("the reference is not a floor here)")
    above = {"median": 1.04, "min": 0.97, "max": 1.10}
    cell = report._ratio_cell(below, floor=1.0)
    assert cell == "at its 1.00x floor (measured 0.930x [0.880, 1.02]: noise)"
    assert "noise" not in report._ratio_cell(above, floor=1.0)
    assert "noise" not in report._ratio_cell(below)  # no floor: a result
    assert report.STEP_FLOORS["ratio_plain"][step_bench.WITH_LOSS_SCALING] == 1.0
    assert step_bench.PLAIN not in report.STEP_FLOORS["ratio_plain"]
    assert step_bench.JMP not in report.STEP_FLOORS["ratio_floor"]  # no global norm in jmp


def test_the_report_names_the_cpu_and_its_half_precision_features() -> None:
    note = report._cpu_note(
        {"cpu_model": "AMD EPYC", "cpu_features": {"AMX": False, "AVX-512 FP16": False}}
    )
    assert note == "CPU: AMD EPYC; AMX: no; AVX-512 FP16: no."
    features = runner.cpu_features()
    if features is not None:  # Linux: read from /proc/cpuinfo
        assert set(features) == set(runner.CPU_FEATURES)


@pytest.mark.parametrize(
    "module", [report, host_bench, step_bench, plots, memory_bench, cbfloat16_bench]
)
def test_doctests(module: Any) -> None:
    failures, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert failures == 0


def test_bad_arguments_are_rejected() -> None:
    for argv in (
        ["--sizes", "XL"],
        ["--rounds", "0"],
        ["--sections", "all"],
        ["--ddp-size", "XL"],
        ["--host-tensors", "0"],
        ["--host-tensors", "a,b"],
        ["--step-size", "XL"],
    ):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(argv)
    with pytest.raises(ValueError, match="unknown sizes"):
        runner.run(runner.BenchOptions(sizes=("XL",)))
    with pytest.raises(ValueError, match="unknown sections"):
        runner.run(runner.BenchOptions(sizes=("tiny",), sections=("whole", "floor")))
    with pytest.raises(ValueError, match="unknown step size 'tiny'"):
        runner.run(runner.BenchOptions(sizes=("S",), sections=("step",), step_size="tiny"))


def _assert_positive_stats(stats: dict[str, Any]) -> None:
    _assert_stats(stats)
    assert stats["median"] is not None and math.isfinite(stats["median"]) and stats["median"] > 0


def test_host_rows_have_every_field(results: dict[str, Any]) -> None:
    rows = results["host"]
    assert {(r["tensors"], r["optimizer"]) for r in rows} == {
        (n, o) for n in HOST_TENSORS for o in host_bench.OPTIMIZERS
    }
    for row in rows:
        for key in ("bare_ms", "torch_ms", "facade_ms"):
            _assert_positive_stats(row[key])
        for key in (
            *COMPARISON_KEYS,
            "torch_us_per_tensor",
            "facade_us_per_tensor",
            "torch_calls_overhead_ms",
            "facade_calls_overhead_ms",
            "calls_overhead_ratio",
        ):
            _assert_stats(row[key])
        over = row["facade_calls_overhead_ms"]["median"]  # the scaler's calls, timed in place
        assert math.isclose(row["facade_us_per_tensor"]["median"], over * 1e3 / row["tensors"])
        assert row["torch_skipped_steps"] == row["facade_skipped_steps"] == 0
    assert results["meta"]["host_tensors"] == list(HOST_TENSORS)


def test_host_model_gives_independent_gradients() -> None:
    workload = host_bench.make_workload(6)
    assert workload.tensors == workload.params == 6
    loop = whole_loop.TrainLoop("facade", "AdamW fused", True, workload)
    loop.step()
    loop.step()
    grads = [p.grad for p in loop.params]
    assert all(g is not None and not g._is_view() and float(g) == 1.0 for g in grads)
    assert len({g.untyped_storage().data_ptr() for g in grads}) == len(grads)
    assert loop.skipped_steps() == 0
    with pytest.raises(ValueError, match="tensors must be positive"):
        host_bench.ScalarSum(0)


NOT_RUN = ("multiply", "import")


def test_host_profile_breaks_the_time_down(tmp_path: Path, one_torch_thread: None) -> None:
    assert (
        host_profile.main(
            [
                "--tensors",
                "4",
                "--iters",
                "2",
                "--warmup",
                "1",
                "--top",
                "5",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    result = json.loads((tmp_path / host_profile.JSON_NAME).read_text())
    calls = result["calls"]
    assert set(calls) == set(host_profile.VARIANTS)
    assert set(calls["bare"]) == {"loss", "backward", "step"}
    assert set(calls["facade"]) == {"loss", "scale", "backward", "step", "update", "scaler"}
    for phases in calls.values():
        for cell in phases.values():
            assert cell["us"] >= 0 and math.isclose(cell["us_per_tensor"], cell["us"] / 4)
    stages = result["stages"]
    assert list(stages) == list(host_profile.STAGES)
    # every stage ran and was timed, but the multiply and the import (JSON null):
    assert all(cell["us"] > 0 for stage, cell in stages.items() if stage not in NOT_RUN)
    assert stages["multiply"]["us"] is None  # AdamW fused (the default) unscales in its kernel
    assert stages["import"]["us"] is None  # all small: read through a buffer imported once
    profile = result["profile"]
    assert profile["iterations"] == 2 and profile["total_us_per_iteration"] > 0
    # SGD foreach: the facade multiplies the gradients its decision read, and that is timed
    sgd = tmp_path / "sgd"
    argv = ["--tensors", "4", "--iters", "2", "--warmup", "1", "--top", "5", "--out", str(sgd)]
    assert host_profile.main([*argv, "--optimizer", "SGD foreach"]) == 0
    sgd_stages = json.loads((sgd / host_profile.JSON_NAME).read_text())["stages"]
    assert sgd_stages["multiply"]["us"] > 0
    assert 0 < len(profile["by_self"]) <= 5 and 0 < len(profile["by_cumulative"]) <= 5
    assert any("torch_facade" in e["function"] for e in profile["by_cumulative"])
    shares = [p["share"] for p in profile["by_package"]]
    assert math.isclose(sum(shares), 1.0, rel_tol=1e-6)
    text = (tmp_path / host_profile.MARKDOWN_NAME).read_text()
    assert text.startswith("# Host profile: 4 one-element gradients, AdamW fused")
    assert "| scaler |" in text and "Self time by package (built-ins charged" in text
    assert "| bare jit |" in text and "The floor of a design that decides in XLA" in text


def test_time_calls_with_unscale(one_torch_thread: None) -> None:
    workload = host_bench.make_workload(3)
    loop = whole_loop.TrainLoop("torch", "SGD foreach", True, workload)
    times = call_timers.time_calls(loop, unscale=True)
    assert list(times) == ["loss", "scale", "backward", "unscale_", "step", "update"]
    assert all(t >= 0 for t in times.values())


def test_step_section_has_every_row_check_and_note(results: dict[str, Any], markdown: str) -> None:
    step = results["step"]
    assert (step["size"], step["tensors"], step["params"]) == ("S", S_TENSORS, S_PARAMS)
    assert set(step["versions"]) == set(step_bench.PEER_PACKAGES)
    assert all(v for v in step["versions"].values())  # the bench extra is installed
    rows = step["rows"]
    assert {(r["loss"], r["variant"]) for r in rows} == {
        (loss, v) for loss in step_bench.LOSSES for v in step_bench.variants_of(loss)
    }
    for row in rows:
        for key in ("ms", "ratio_plain", "ratio_floor", "ratio_gated_floor"):
            _assert_stats(row[key])
        assert row["traces"] >= 1
        assert row["skip"] == step_bench.USAGE[row["variant"]].skip
        if row["variant"] == step_bench.PLAIN:
            assert row["ratio_plain"]["median"] == 1.0
        if row["variant"] in (step_bench.WITH_LOSS_SCALING, step_bench.APPLY_SCALED):
            assert row["traces"] == 1 and row["counts_skips"]
    checks = {c["scaler"]: c for c in step["checks"]}
    assert list(checks) == list(step_bench.SCALERS)
    for name in (step_bench.WITH_LOSS_SCALING, step_bench.APPLY_SCALED):
        check = checks[name]
        assert check["error"] is None
        assert check["skip_bit_identical"] and check["scale_halved"] and check["counts_skips"]
        assert check["gradients_exact"] and check["mismatches"] == [] and check["traces"] == 1
        assert check["growth_step"] == 3  # steps_per_increase=2: the third finite step doubles
        assert len(check["scales"]) == len(scaler_checks.FACTORS)
    for finding in step["findings"]:
        assert set(finding) == {"scaler", "title", "reproduction", "observed"}
        assert finding["scaler"] in step_bench.PEER_PACKAGES
        assert f"* **{finding['scaler']}**: {finding['title']}." in markdown
    for name in step_bench.VARIANTS:
        assert f"| {name} | " in markdown
    assert "Skip and growth check of every scaler" in markdown


def test_the_step_section_s_forward_is_a_next_token_loss() -> None:
    """The real forward of the step section (replaced by the synthetic loss in the end-to-end
    run): float32 cross-entropy of the float16 MLP, near log(vocab) from fresh parameters; the
    accumulated group differentiates it too."""
    spec = sizes.SIZES["S"]
    params = step_bench.make_params(spec, 0)
    tokens = step_bench.make_tokens(spec, 0, None)
    loss = jax.jit(step_bench.real_loss)(params, tokens)
    assert loss.dtype == jnp.float32
    assert float(loss) == pytest.approx(math.log(spec.vocab), rel=0.2)
    assert step_bench.LOSS_FUNCTIONS[step_bench.ACCUMULATED] is step_bench.real_loss


def test_plots_are_valid_pngs(results: dict[str, Any], tmp_path: Path) -> None:
    import matplotlib.image

    written = plots.write_plots(results, tmp_path)
    assert [p.name for p in written] == [plots.STEP_PNG, plots.WHOLE_PNG, plots.HOST_PNG]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        height, width, _ = matplotlib.image.imread(path).shape
        assert width > 400 and height > 150
    only_host = {**results, "step": None, "whole": []}
    assert [p.name for p in plots.write_plots(only_host, tmp_path / "host")] == [plots.HOST_PNG]


def test_run_dir_holds_the_plots(run_dir: Path) -> None:
    for name in (plots.STEP_PNG, plots.WHOLE_PNG, plots.HOST_PNG):
        assert (run_dir / name).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("run", [0, 2])
def test_interleaving_order_and_samples(run: int) -> None:
    """Variant by variant, each round runs one variant's calls in a row; in runs, the variants
    take turns run by run, each run after one untimed call of its variant. Either way every
    variant gets its own samples (the timed calls only), and the order rotates from round to
    round."""
    calls: list[str] = []
    variants = [timing.Variant(name, lambda name=name: calls.append(name)) for name in "abc"]
    timings = timing.run_interleaved(
        variants, rounds=2, iters=3, counter=timing.CompileCounter(), run=run
    )
    if run:  # runs of 2 then 1 timed calls, each after an untimed one
        assert calls == list("aaabbbcccaabbcc") + list("bbbcccaaabbccaa")
    else:
        assert calls == list("aaabbbccc") + list("bbbcccaaa")
    for measured in timings.values():
        assert [len(s) for s in measured.samples] == [3, 3]
        assert len(measured.rounds) == 2 and measured.compiles == 0
