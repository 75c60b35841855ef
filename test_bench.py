"""bench.py stays runnable: --smoke (the smallest run through every section), in a CPU-only
subprocess (conftest.run_children).

No timing is asserted, not even its range: on a loaded machine a loaded epoch
can run faster than a prebuilt one. The run must exit 0 and write a well-formed
report: every section and row, every figure a finite number, the goals and the
list of implausible figures bench flags itself (which may be non-empty).
"""

import json
import math
import os
import sys

import pytest

import loaders
from conftest import run_children

HERE = os.path.dirname(os.path.abspath(__file__))


def number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.mark.slow
def test_bench_smoke_runs_and_writes_a_well_formed_report(tmp_path):
    out = tmp_path / "bench.json"
    command = [sys.executable, os.path.join(HERE, "bench.py"), "--smoke", "--no-grain", "--json", str(out)]
    [(code, stdout, stderr)] = run_children([command], timeout=100, cwd=HERE)
    assert code == 0, stderr[-3000:]
    assert "| reference, host |" in stdout and "**Goals**" in stdout
    results = json.loads(out.read_text())
    assert {"machine", "config", "loader", "feeding", "training", "reduction", "goals", "implausible",
            "section_s"} <= set(results)

    for key in ("per_device_16", "per_device_128"):
        section = results["loader"][key]
        assert number(section["copy_limit_gb_per_s"]) and number(section["to_devices_gb_per_s"])
        assert {f"reference, {p}" for p in loaders.PLACEMENTS} | {"naive loop"} <= set(section["loaders"])
        for r in section["loaders"].values():
            assert all(number(r[f]) for f in ("images_per_s", "gb_per_s", "fraction_of_copy",
                                              "reference_speedup")), r
            assert r["images"] > 0

    for row in results["feeding"].values():
        assert row["steps"] >= 1 and row["images"] >= row["steps"]
        for p in loaders.PLACEMENTS:
            assert number(row["sharded"][p]["fed_over_prebuilt"]) and number(row["sharded"][p]["prebuilt_step_ms"])

    assert set(results["training"]) == {f"global_{b}" for b in results["training_batches"]}
    for row in results["training"].values():
        assert set(row) == {"sharded", "pmap", "shard_map", "single"}
        for r in row.values():
            assert number(r["step_ms"]) and number(r["compile_s"]) and number(r["ratio_to_single"]), r
        assert row["single"]["ratio_to_single"] == 1.0

    reduction = results["reduction"]
    assert {r["model"] for r in reduction["cases"]} == {"mlp", "conv", "attention"}
    assert {r["logical_shards"] // r["devices"] for r in reduction["cases"]} == {1, 4}  # L = n and 4n
    for r in reduction["cases"]:
        assert r["rows"] % r["logical_shards"] == 0, r
        for step in ("plain", "canonical"):
            assert number(r[step]["step_ms"]) and number(r[step]["memory_mb"]), r
        assert number(r["ratio"]["step_time"]) and number(r["ratio"]["memory"]), r
    assert [c["devices"] for c in reduction["compile_s"]] == [1, 8]
    assert reduction["precision"] == "highest" and "| mlp |" in stdout and "L = 4n" in stdout

    assert results["goals"] and all({"goal", "measured", "target", "met"} <= set(g) for g in results["goals"])
    assert "**Feeding**" in stdout and "| sharded | host |" in stdout
    assert isinstance(results["implausible"], list) and all(isinstance(t, str) for t in results["implausible"])
    assert list(results["section_s"]) == ["loader", "feeding", "training", "reduction"]
