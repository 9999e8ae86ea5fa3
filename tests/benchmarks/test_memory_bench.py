"""The memory section: a fresh process per variant, its peak, the ratios and the report.

Nothing is compared with a threshold of speed; the checks are of what the section records: a
peak that holds at least the bytes the loop must hold (parameters, gradients and AdamW's two
moments, 16 bytes a float32 parameter), medians and ratios as computed by hand, the markdown.
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import memory_bench
from workbench.sizes import SIZES, parameter_count


def test_every_variant_runs_in_a_fresh_process_and_holds_its_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Real processes, one per variant (the cores' warm-up pass left out: its order is the
    next test's); the preview's process rounds without the loop inductor would compile for it
    (``CSTORCH_CBFLOAT16_FUSED=0``: the same bits, and no compile that nothing here checks)."""
    monkeypatch.setenv("CSTORCH_CBFLOAT16_FUSED", "0")
    variants = ("float32", memory_bench.PREVIEW, memory_bench.MASTER)  # facade loops: 2 of 3
    result = memory_bench.run(["S"], rounds=1, steps=2, variants=variants, warm=False)
    rows = {row["variant"]: row for row in result["rows"]}
    assert list(rows) == list(variants)
    params = parameter_count(SIZES["S"])
    for row in rows.values():
        assert row["params"] == params and row["steps"] == 2 and row["size"] == "S"
        assert row["peak_rss_mb"] >= row["end_rss_mb"] > row["import_rss_mb"] > 0
        assert row["peak_rss_samples_mb"] == [row["peak_rss_mb"]]
        assert row["minor_faults_per_step"] >= 0
    # The loop's own tensors are in the peak: parameters, gradients, AdamW's moments.
    float32 = rows["float32"]
    assert float32["peak_rss_mb"] - float32["import_rss_mb"] >= 16 * params / 2**20
    assert rows[memory_bench.PREVIEW]["reference"] == "float32"
    assert rows[memory_bench.PREVIEW]["ratio"] == pytest.approx(
        rows[memory_bench.PREVIEW]["peak_rss_mb"] / float32["peak_rss_mb"]
    )
    master = rows[memory_bench.MASTER]  # its reference, the float32 facade loop, was not run
    assert master["ratio"] is None and master["reference"] is None
    assert master["ratio_to_facade"] is None
    imports = {row["case"]: row["peak_rss_mb"] for row in result["imports"]}
    assert set(imports) == set(memory_bench.IMPORTS)
    # JAX and its CPU backend are loaded on top of torch.
    assert imports["import torch_facade, JAX's backend started"] > imports["import torch"]
    text = "\n".join(memory_bench.markdown(result, 9))
    assert text.startswith("## 9. Memory") and "| S | float16 + master weights |" in text


def test_medians_and_ratios_are_taken_over_the_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    peaks = {"float32": [100.0, 104.0, 102.0], "torch": [110.0, 111.0, 112.0]}
    peaks["facade"] = [121.0, 122.0, 120.0]
    peaks[memory_bench.PREVIEW] = [130.0, 133.0, 131.0]
    peaks[memory_bench.MASTER] = [90.0, 91.0, 92.0]
    calls: list[tuple[str, int]] = []

    def child(
        variant: str, size: str, steps: int, device: str, seed: int, cache: str
    ) -> dict[str, Any]:
        calls.append((variant, steps))
        if steps == 1:  # a decision core compiled into the run's cache first
            return {"variant": variant, "size": size, "steps": 1, "peak_rss_mb": 0.0}
        peak = peaks[variant][sum(1 for v, n in calls if v == variant and n > 1) - 1]
        return {"variant": variant, "size": size, "steps": steps, "peak_rss_mb": peak,
                "minor_faults_per_step": peak / 10}  # fmt: skip

    monkeypatch.setattr(memory_bench, "_child", child)
    monkeypatch.setattr(memory_bench, "_import_peak", lambda code: 1.0)
    variants = ("float32", "torch", "facade", memory_bench.PREVIEW, memory_bench.MASTER)
    result = memory_bench.run(["M"], rounds=3, steps=4, variants=variants)
    # One process per decision core before the rounds: the preview's serves the facade's too.
    assert calls[:2] == [(memory_bench.PREVIEW, 1), (memory_bench.MASTER, 1)]
    master_steps = memory_bench.MASTER_STEPS  # fewer: seconds an iteration
    timed = [("float32", 4), ("torch", 4), ("facade", 4), (memory_bench.PREVIEW, 4)]
    assert calls[2:] == [*timed, (memory_bench.MASTER, master_steps)] * 3  # alternating
    rows = {row["variant"]: row for row in result["rows"]}
    assert rows[memory_bench.PREVIEW]["ratio"] == pytest.approx(131.0 / 102.0)
    assert rows[memory_bench.PREVIEW]["ratio_to_facade"] == pytest.approx(131.0 / 121.0)
    assert rows[memory_bench.MASTER]["reference"] == "facade"
    assert rows[memory_bench.MASTER]["ratio"] == pytest.approx(91.0 / 121.0)
    assert rows["float32"]["peak_rss_mb"] == 102.0 and rows["float32"]["ratio"] is None
    assert rows["torch"]["ratio"] == pytest.approx(111.0 / 102.0)
    assert rows["facade"]["ratio"] == pytest.approx(121.0 / 111.0)
    assert rows["facade"]["reference"] == "torch"
    assert rows["facade"]["minor_faults_per_step"] == pytest.approx(12.1)
    assert "| M | facade | 121 | 1.090 | torch |" in "\n".join(memory_bench.markdown(result, 1))


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="variants among"):
        memory_bench.run(["S"], variants=("float64",))
    with pytest.raises(ValueError, match="rounds and steps >= 1"):
        memory_bench.run(["S"], rounds=0)
    with pytest.raises(ValueError, match="variant must be one of"):
        memory_bench.measure("float64", "S", 1)
