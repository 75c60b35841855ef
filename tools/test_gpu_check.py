"""tools/gpu_check.py runs end to end (its canonical section, here on CPU devices, two values of L
and no flags): its report says the strategies agree and two fresh processes agree, while the
same comparison tells one L from another; an unknown section is refused."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = dict(os.environ, JAX_PLATFORMS="cpu")  # the children's platform: never a GPU host's GPUs


def test_the_canonical_section_reports_agreement_on_cpu(tmp_path):
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "tools/gpu_check.py", "--sections", "canonical", "--platform", "cpu",
                           "--flag-sets", "none", "--blocks", "1,8", "--report", str(report), "--timeout", "300"],
                          cwd=ROOT, env=CPU, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    found = json.loads(report.read_text())["sections"]["canonical"]
    assert found["strategies agree"] and found["run to run"], found
    assert [(row["flags"], row["L"]) for row in found["table"]] == [("none", 1), ("none", 8)], found
    # The control: the same comparison tells L = 1 from L = 8 (another order of summation).
    assert found["different L the same bits (not promised)"] == {"none": False}, found
    refused = subprocess.run([sys.executable, "tools/gpu_check.py", "--sections", "nonsense"], cwd=ROOT, env=CPU,
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--sections: unknown ['nonsense']" in refused.stderr
