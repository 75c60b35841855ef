"""tools/accelerator_check.py runs end to end here, on CPU devices (its children CPU-only): the
delivery section finds every block the plan's, and the canonical section finds the strategies
and two fresh processes agreeing, while the same comparison tells one L from another; a
delivery whose bits are off is caught; an unknown section is refused."""

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
    done = subprocess.run([sys.executable, "tools/accelerator_check.py", "--sections", "delivery,canonical",
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
    # The control: the same comparison tells L = 1 from L = 8 (another order of summation).
    assert rows[-1] == {"flags": "none", "different L the same bits (not promised)": False}, rows
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
