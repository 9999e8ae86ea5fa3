"""The start-up and cbfloat16 benchmark sections run, record what they claim, and render.

Nothing is timed against a threshold here (benchmarks measure, tests check behaviour): one
round each, then the rows, the raw samples and the markdown tables are checked.
"""

from __future__ import annotations

import pytest

from benchmarks import cbfloat16_bench, startup_bench


def test_startup_section_measures_imports_and_both_runs_in_fresh_processes(monkeypatch):
    """The loops run for real, each in a fresh process (the first run compiles the core into an
    empty cache, the second loads it); the imports' statements run for real in one process
    (each row's own process only times it), and the rows' arithmetic is checked on wall
    times given by hand."""
    assert startup_bench._wall("\n".join(startup_bench.IMPORTS.values())) > 0
    walls = dict(zip(startup_bench.IMPORTS.values(), (2.0, 3.0, 1.0), strict=True))
    monkeypatch.setattr(startup_bench, "_wall", walls.__getitem__)
    result = startup_bench.run(rounds=1)
    imports = {row["case"]: row for row in result["imports"]}
    assert set(imports) == set(startup_bench.IMPORTS)
    assert imports["import torch, amp_core"]["ratio_to_torch_amp_core"] == 1.0
    assert imports["import torch, torch_facade"]["ratio_to_torch_amp_core"] == 1.5
    assert imports["import torch_facade"]["ratio_to_torch_amp_core"] == 0.5
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


def test_cbfloat16_section_times_every_variant_interleaved(monkeypatch):
    """Eager and compiled rows, each compiled row's ratio to compiled float32, dynamo's counts
    (no frame compiled after the warm-up), the JAX door's table; on a small GPT-2. Nothing is
    compiled that the checks do not read: the compiled rows use dynamo's ``eager`` backend
    (dynamo's graphs, run as they are), and the eager preview rounds without the loop inductor
    compiles for it (``CSTORCH_CBFLOAT16_FUSED=0``; the same bits). The harness is what is
    tested here; the preview under inductor is in ``tests/torch_facade/test_cbfloat16_compile.py``
    and the fused loop in ``tests/torch_facade/test_cbfloat16_kernel.py``."""
    pytest.importorskip("transformers")
    monkeypatch.setattr(cbfloat16_bench, "BACKEND", "eager")
    monkeypatch.setenv("CSTORCH_CBFLOAT16_FUSED", "0")
    result = cbfloat16_bench.run(rounds=1, iters=1, warmup=0, small=True, jax_iters=1)
    with cbfloat16_bench._variants(0, cbfloat16_bench.SMALL_MODEL, float16_autocast=False) as rows:
        without_autocast = [row.name for row in rows]
    assert len(without_autocast) == 4 and not any("autocast" in n for n in without_autocast)
    names = [row["case"] for row in result["rows"]]
    assert names[0] == "float32" and len(names) == 6
    assert any("cbfloat16 preview" in n for n in names)
    assert any("torch.amp.GradScaler" in n for n in names)
    references = {row["case"]: row["reference"] for row in result["rows"]}
    compiled = [n for n in names if "torch.compile" in n]
    assert len(compiled) == 2 and all(references[n] == "float32, torch.compile" for n in compiled)
    assert all(references[n] == "float32" for n in names if n not in compiled)
    for row in result["rows"]:
        assert len(row["samples_s"]) == 1 and row["median_ms"] > 0
        low, high = row["spread"]
        assert low <= row["ratio_to_float32"] <= high
    assert result["rows"][0]["ratio_to_float32"] == 1.0
    for row in result["rows"]:  # the process's page faults, counted per iteration
        assert 0 <= row["minor_faults_per_iteration"] <= row["minor_faults_max"]
    blocked = result["blocked"]  # the eager preview in blocks, against float32's blocks
    assert blocked["case"] == names[1] and "torch.compile" not in names[1]
    assert len(blocked["samples_s"]) == len(blocked["float32_samples_s"]) == 1
    low, high = blocked["spread"]
    assert low <= blocked["ratio_to_float32"] <= high
    counts = result["compiled"]
    assert counts["graphs"] >= 2 and counts["frames_compiled_after_warmup"] == 0
    assert [row["case"] for row in result["jax"]["rows"]] == [
        "float32", "cbfloat16, no scaling", "cbfloat16 + DLS",
    ]  # fmt: skip
    assert result["jax"]["rows"][0]["ratio_to_float32"] == 1.0
    text = "\n".join(cbfloat16_bench.markdown(result, 3))
    assert text.startswith("## 3. The cbfloat16 preview")
    assert "cbfloat16 preview, torch.compile, facade DLS" in text
    assert "frames compiled after the warm-up: 0" in text
    assert "page faults / iteration" in text and "in blocks of 1 iterations" in text
    assert "| cbfloat16 + DLS |" in text
    assert "GPT2LMHeadModel, 1 layer, d=32, 2x16 bytes" in text
    assert "flax NNX GPT (1 layer, width 32, 4 x 16 bytes)" in text
