"""bench.py stays runnable: --quick on a tiny dataset, in a subprocess.

Timings are not asserted (they depend on the machine and its load); the run must
exit 0 and its JSON must hold every section with positive figures.
"""

import json
import math
import os
import sys

from conftest import run_children

HERE = os.path.dirname(os.path.abspath(__file__))


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_quick_runs_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    command = [sys.executable, os.path.join(HERE, "bench.py"), "--quick", "--num-train", "1024",
               "--repeats", "1", "--no-grain", "--json", str(out)]
    [(code, stdout, stderr)] = run_children([command], timeout=240, cwd=HERE)
    assert code == 0, stderr[-3000:]
    assert "| reference, host |" in stdout
    results = json.loads(out.read_text())
    assert {"machine", "config", "loader", "placements", "training", "memory", "goals"} <= set(results)

    for key in ("per_device_16", "per_device_128"):
        section = results["loader"][key]
        assert positive(section["copy_limit_gb_per_s"])
        assert {"reference, host", "reference, device", "reference, host_float32",
                "naive loop"} <= set(section["loaders"])
        for r in section["loaders"].values():
            assert positive(r["images_per_s"]) and positive(r["gb_per_s"]), r
            assert positive(r["fraction_of_copy"]) and positive(r["reference_speedup"]), r

    for row in results["placements"].values():
        assert positive(row["train_step_ms"]) and row["steps"] >= 1
        for p in ("host", "device", "host_float32"):
            assert positive(row[p]["loader_step_ms"]) and positive(row[p]["loader_over_train"])
            assert 0.0 <= row[p]["wait_fraction"] < 1.0
            assert -1.0 < row[p]["slowdown_fraction"] < 1.0

    for key in ("global_128", "global_1024"):
        row = results["training"][key]
        assert set(row) == {"sharded", "pmap", "shard_map", "single"}
        for r in row.values():
            assert math.isfinite(r["step_ms"]) and math.isfinite(r["compile_s"]), r
        assert row["single"]["ratio_to_single"] == 1.0

    for m in results["memory"].values():
        assert positive(m["raw_mb"]) and positive(m["batch_mb"]) and positive(m["budget_mb"])
        assert m["read_peak_mb"] >= 0 and m["epoch_peak_mb"] >= 0

    assert all({"goal", "measured", "target", "met"} <= set(g) for g in results["goals"])
