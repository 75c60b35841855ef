"""tools/accelerator_check.py runs end to end here, on CPU devices (its children CPU-only): the
delivery section finds every block the plan's, the canonical section finds the strategies and
two fresh processes agreeing, while the same comparison tells one L from another, and the
exact_sum section finds exact_sum its docstring's bits; a delivery whose bits are off, and a
sum that is not exact, are caught; an unknown section is refused."""

import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = dict(os.environ, JAX_PLATFORMS="cpu")  # the children's platform: never a host's accelerator
sys.path.insert(0, os.path.join(ROOT, "tools"))


def test_the_delivery_and_canonical_sections_report_agreement_on_cpu(tmp_path):
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "tools/accelerator_check.py", "--sections", "delivery,canonical,exact_sum",
                           "--platform", "cpu", "--blocks", "1,8", "--report", str(report), "--timeout", "300"],
                          cwd=ROOT, env=CPU, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    found = json.loads(report.read_text())
    assert found["device"] == "cpu (cpu)" and found["platform"] == "cpu", found
    delivery, canonical = found["sections"]["delivery"], found["sections"]["canonical"]
    assert delivery["ok"] and delivery["differ"] == [] and delivery["checked"] > 1000, delivery
    assert set(delivery["routes"]) == {"rocal", "dali_cpu", "dali_gpu"}, delivery
    assert canonical["ok"], canonical
    rows = canonical["table"]
    assert [(r["flags"], r["L"], r["strategies agree"], r["run to run"]) for r in rows[:-1]] == [
        ("none", 1, True, True), ("none", 8, True, True)], rows
    # The control: the same comparison tells L = 1 from L = 8 (other blocks, each its own rows' gradient).
    assert rows[-1] == {"flags": "none", "different L the same bits (not promised)": False}, rows
    exact = found["sections"]["exact_sum"]
    assert exact["ok"] and exact["differ"] == [] and exact["checked"] == 22, exact
    refused = subprocess.run([sys.executable, "tools/accelerator_check.py", "--sections", "nonsense"], cwd=ROOT,
                             env=CPU, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--sections: unknown ['nonsense']" in refused.stderr


def test_the_delivery_check_catches_bits_that_are_off(tmp_path, monkeypatch):
    """The control of the delivery section: a normalisation one ulp off is reported, by step."""
    import accelerator_check
    import jax
    import loaders
    right = loaders.device_normalize
    monkeypatch.setattr(loaders, "device_normalize", lambda *a: jax.numpy.nextafter(right(*a), np.inf))
    loaders._step_program.cache_clear()
    try:
        accelerator_check.delivery_child(str(tmp_path / "out.json"))
    finally:
        loaders._step_program.cache_clear()
    differ = json.loads((tmp_path / "out.json").read_text())["differ"]
    assert differ and all(line.endswith(": images") for line in differ), differ


def test_the_exact_sum_check_catches_a_sum_that_is_not_exact(tmp_path, monkeypatch):
    """The control of the exact_sum section: a float32 sum in place of exact_sum is reported,
    by case, on the cases where rounding order shows (the carries' 300 blocks among them)."""
    import accelerator_check
    import jax
    import summation
    monkeypatch.setattr(summation, "exact_sum", lambda blocks, whole: jax.tree.map(lambda x: x.sum(0), blocks))
    accelerator_check.exact_sum_child(str(tmp_path / "out.json"))
    differ = json.loads((tmp_path / "out.json").read_text())["differ"]
    assert any(line.startswith("carries:") for line in differ), differ
    assert any(line.startswith("carries, whole:") for line in differ), differ
