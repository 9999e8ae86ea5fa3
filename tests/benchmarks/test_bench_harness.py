"""The benchmark harness runs end to end on the tiny size and emits every field (never a timing)."""

from __future__ import annotations

import doctest
import json
import math
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bandwidth, cli, jax_bench, report, runner, sizes, timing, torch_bench

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
ROUNDS = 2


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    argv = ["--sizes", "tiny", "--rounds", str(ROUNDS), "--iters", "1", "--warmup", "1"]
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


def test_every_case_is_present_with_all_rounds(results: dict[str, Any]) -> None:
    expected = (
        {("bandwidth", "stream", v) for v in bandwidth.VARIANTS}
        | {("torch", o, v) for o in torch_bench.OPTIMIZERS for v in torch_bench.VARIANTS}
        | {("jax", "optax", v) for v in jax_bench.VARIANTS}
    )
    cases = results["cases"]
    assert {(c["section"], c["group"], c["variant"]) for c in cases} == expected
    assert len(cases) == len(expected)
    for case in cases:
        assert set(case) == CASE_KEYS
        assert case["size"] == "tiny"
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


def test_derived_rows_have_every_field(results: dict[str, Any]) -> None:
    assert set(results) == {
        "meta",
        "sizes",
        "cases",
        "torch",
        "jax",
        "bandwidth",
        "floor",
        "compile",
    }
    assert set(results["sizes"]) == {"tiny"}
    assert set(results["sizes"]["tiny"]) == {
        "tensors",
        "params",
        "max_iters",
        "loss",
        "flushed_small_grads",
        "gradient_seconds",
        "other_cpu_cores",
    }
    assert results["sizes"]["tiny"]["tensors"] == results["sizes"]["tiny"]["params"] == 148

    torch_rows = results["torch"]
    assert {(r["optimizer"], r["clip"]) for r in torch_rows} == {
        (o, c) for o in torch_bench.OPTIMIZERS for c in (False, True)
    }
    for row in torch_rows:
        for key in (
            "bare_ms",
            "torch_ms",
            "facade_ms",
            "step_ratio",
            "torch_overhead_ms",
            "facade_overhead_ms",
            "overhead_ratio",
        ):
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
    ):
        _assert_stats(jax_row[key])

    (bw_row,) = results["bandwidth"]
    assert bw_row["params"] == 148
    _assert_stats(bw_row["inplace_gbps"])
    _assert_stats(bw_row["read_gbps"])

    assert len(results["floor"]) == 2 * len(torch_bench.OPTIMIZERS)
    for row in results["floor"]:
        assert row["bytes_per_param"] in (4, 8, 12)
        for key in ("model", "floor_ms", "torch_overhead_ms", "facade_overhead_ms"):
            assert key in row
        assert "torch_fraction" in row and "facade_fraction" in row

    compile_cases = {r["case"] for r in results["compile"]}
    assert compile_cases == {
        f"{v}, {o}" for o in torch_bench.OPTIMIZERS for v in ("facade", "facade+clip")
    } | set(jax_bench.VARIANTS)
    for row in results["compile"]:
        assert row["compiles_after_warmup"] == 0
        assert row["first_step_compiles"] >= 0

    meta = results["meta"]
    assert meta["compiles_after_warmup_total"] == 0
    for key in (
        "date",
        "command",
        "torch",
        "jax",
        "optax",
        "cpu_count",
        "torch_threads",
        "load_average_start",
        "load_average_end",
        "wall_seconds",
        "other_cpu_cores",
    ):
        assert key in meta
    assert meta["rounds"] == ROUNDS
    assert math.isclose(meta["loss_scale"], 1 + 2**-23)


def test_markdown_has_the_expected_rows(markdown: str) -> None:
    for heading in (
        "## 1. torch",
        "## 2. JAX-native",
        "## 3. Bandwidth floor",
        "## 4. Compilation",
    ):
        assert heading in markdown
    for optimizer in torch_bench.OPTIMIZERS:
        for clip in ("no", "yes"):
            assert f"| tiny | {optimizer} | {clip} |" in markdown
    assert markdown.count("| tiny | SGD foreach |") == 4  # torch table and floor table
    assert "| tiny | 148 |" in markdown  # bandwidth
    for case in ("facade, SGD foreach", "facade+clip, AdamW fused", *jax_bench.VARIANTS):
        assert f"| tiny | {case} |" in markdown
    assert "compilations after warm-up, all cases: 0" in markdown
    for line in markdown.splitlines():
        if line.startswith("| tiny |"):
            assert line.endswith("|") and "None" not in line


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


@pytest.mark.parametrize("module", [timing, sizes, report])
def test_doctests(module: Any) -> None:
    failures, _ = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert failures == 0


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--sizes", "XL"])
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--rounds", "0"])
    with pytest.raises(ValueError, match="unknown sizes"):
        runner.run(runner.BenchOptions(sizes=("XL",)))
