"""The start-up and cbfloat16 benchmark sections run, record what they claim, and render.

Nothing is timed against a threshold here (benchmarks measure, tests check behaviour): one
round each, then the rows, the raw samples and the markdown tables are checked.
"""

from __future__ import annotations

import pytest

from benchmarks import cbfloat16_bench, startup_bench


def test_startup_section_measures_imports_and_both_runs_in_fresh_processes():
    result = startup_bench.run(rounds=1)
    imports = {row["case"]: row for row in result["imports"]}
    assert set(imports) == set(startup_bench.IMPORTS)
    assert imports["import torch, amp_core"]["ratio_to_torch_amp_core"] == 1.0
    for row in result["imports"]:
        assert len(row["samples_s"]) == 1 and row["median_s"] > 0
    loops = {row["case"]: row for row in result["loops"]}
    assert set(loops) == {"first run", "second run", "torch"}
    for row in result["loops"]:
        assert len(row["samples_s"]) == 1 and len(row["samples_s"][0]) == 3  # 3 iterations
        assert row["first_iteration_ms"] > 0 and row["second_iteration_ms"] > 0
    text = "\n".join(startup_bench.markdown(result, 7))
    assert text.startswith("## 7. Start-up")
    assert "| `import torch_facade` |" in text and "second run" in text


def test_cbfloat16_section_times_every_variant_interleaved():
    pytest.importorskip("transformers")
    result = cbfloat16_bench.run(rounds=1, iters=1, warmup=0)
    names = [row["case"] for row in result["rows"]]
    assert names[0] == "float32" and len(names) == 4
    assert any("cbfloat16 preview" in n for n in names)
    assert any("torch.amp.GradScaler" in n for n in names)
    for row in result["rows"]:
        assert len(row["samples_s"]) == 1 and row["median_ms"] > 0
    assert result["rows"][0]["ratio_to_float32"] == 1.0
    text = "\n".join(cbfloat16_bench.markdown(result, 3))
    assert text.startswith("## 3. The cbfloat16 preview")
