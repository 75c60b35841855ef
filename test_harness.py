"""The harness itself: the helpers every test relies on can fail, and fail fast.

* ``bits_differ`` / ``assert_same_bits`` (conftest.py) compare arrays bit for bit
  (-0.0 is not 0.0, a NaN equals itself), name the first differing index, both values
  and the count, and stay fast on large arrays: pytest never diffs two byte strings.
* ``run_children`` (conftest.py) stops a child still running at its bound (its timeout,
  a failed peer's grace, or the test's watchdog less STACK_MARGIN) and raises
  ChildrenStopped, whose message holds every Python thread's stack of the child and of
  the processes it started (faulthandler, and py-spy's native frames where py-spy or gdb
  is installed), names the function each hangs in, and kills them all; children that end
  by themselves come back as they ended.
* The watchdog (pytest.ini): a test waiting in Python fails at ``timeout`` with its stack
  and the run goes on; a test waiting in native code ends its process at
  ``faulthandler_timeout`` with every thread's stack on stderr (an xdist worker is replaced
  and the test fails). Both limits are the ci profile's, scaled like the examples under dev
  (x4) and thorough (x40).
* A crashed worker (conftest.pytest_handlecrashitem): xdist runs the test again on a new
  worker; for a test of CRASH_RERUN_FILES, the first time, that run is its outcome; any
  other crash fails its test.
"""

import configparser
import os
import sys
import time

import numpy as np
import pytest

import conftest
from conftest import STACK_MARGIN, ChildrenStopped, assert_same_bits, bits_differ, native_stacks_missing, run_children

HERE = os.path.dirname(os.path.abspath(__file__))


def test_bits_differ_sees_every_kind_of_difference():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert bits_differ(x, x.copy()) is None
    assert bits_differ(np.array([np.nan]), np.array([np.nan])) is None  # same bits
    assert "index (0,)" in bits_differ(np.array([0.0, 1.0]), np.array([-0.0, 1.0]))  # sign of zero
    assert "float32 (3, 4), want float32 (12,)" in bits_differ(x, x.reshape(-1))
    assert "want float64" in bits_differ(x, x.astype(np.float64))
    y = x.copy()
    y[1, 2] += 1
    y[2, 0] += 1
    assert bits_differ(x, y) == ("2 of 12 elements differ; the first at index (1, 2): got "
                                 "np.float32(6.0), want np.float32(7.0)")
    assert bits_differ(np.array([True, False]), np.array([True, True])).startswith("1 of 2")
    assert bits_differ(np.zeros((0, 3)), np.zeros((0, 3))) is None


def test_a_failing_comparison_of_large_arrays_is_reported_at_once():
    # The regression: a bare assert that two arrays' bytes are equal, failing on 100 MB, made pytest
    # diff the bytes for minutes. The helper's message is built in linear time.
    x = np.zeros(4_000_000, np.float32)  # 16 MB: a quadratic diff would take hours
    y = x.copy()
    y[7:] = 1
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"the params: 3999993 of 4000000 elements differ; the first at index \(7,\)"):
        assert_same_bits(x, y, "the params")
    assert time.monotonic() - start < 10, "the comparison should take well under a second"


# --------------------------------------------------------------------------
# run_children: every child bounded, a stopped one's stacks in the failure message
# --------------------------------------------------------------------------

HUNG = '''
import ctypes, sys, threading, time
def waits_in_python():
    threading.Event().wait()
def waits_in_native():
    ctypes.CDLL(None).pause()  # a native call that never returns
threading.Thread(target=waits_in_python, name="helper").start()
print("started", flush=True)
waits_in_native()
'''


@pytest.mark.slow  # child processes: the extended tier
def test_a_hung_child_fails_within_its_bound_with_its_stacks(tmp_path):
    (tmp_path / "hung.py").write_text(HUNG)
    start = time.monotonic()
    with pytest.raises(ChildrenStopped) as stopped:
        run_children([[sys.executable, "hung.py"], [sys.executable, "-c", "print('done')"]],
                     timeout=1, cwd=str(tmp_path))
    elapsed = time.monotonic() - start
    message = str(stopped.value)
    assert elapsed < 1 + STACK_MARGIN, f"took {elapsed:.1f} s"
    assert message.startswith("run_children stopped 1 of 2 children:")
    assert "=== child 0: " in message and "stopped by the timeout of 1 s; still running after 1." in message
    assert "=== child 1: " in message and "exited 0 by itself after " in message and "done" in message
    # faulthandler's dump (child_env sets PYTHONFAULTHANDLER): every Python thread, in its stderr.
    assert 'hung.py", line 4 in waits_in_python' in message, message
    assert 'hung.py", line 6 in waits_in_native' in message, message
    assert "started" in message  # the end of its stdout
    if native_stacks_missing():
        pytest.skip(f"the native frame it hangs in is not checked: {native_stacks_missing()}")
    assert "pause" in message, message  # the native frame it hangs in


@pytest.mark.slow  # child processes: the extended tier
def test_a_childs_own_children_are_dumped_and_killed(tmp_path):
    # As refimpl --local-processes does: the child starts a process in a session of its own,
    # out of reach of a kill of the child's process group. (Neither imports JAX; both inherit
    # run_children's child_env, JAX_PLATFORMS=cpu.)
    (tmp_path / "hung.py").write_text(HUNG)
    (tmp_path / "parent.py").write_text(
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, 'hung.py'], start_new_session=True)\n"
        "print('grandchild', p.pid, flush=True)\n"
        "def waits_for_its_child():\n"
        "    p.wait()\n"
        "waits_for_its_child()\n")
    with pytest.raises(ChildrenStopped) as stopped:
        run_children([[sys.executable, "parent.py"]], timeout=1, cwd=str(tmp_path))
    message = str(stopped.value)
    grandchild = int(message.split("grandchild ")[1].split()[0])
    assert f"--- stacks of process {grandchild} (started by the child) ---" in message
    assert 'hung.py", line 6 in waits_in_native' in message  # faulthandler: the same stderr file
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{grandchild}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{grandchild}"), "the grandchild outlived run_children"
    if native_stacks_missing():
        pytest.skip(f"the native stacks are not checked: {native_stacks_missing()}")
    assert "waits_for_its_child" in message.split(f"process {grandchild}")[0], message
    assert "waits_in_native" in message.split(f"process {grandchild}")[1], message


@pytest.mark.slow  # child processes: the extended tier
def test_a_failed_peer_stops_the_others_of_its_job_after_the_grace():
    # The processes of one job (grace given): a peer of a failed process may wait forever.
    sleeps = [sys.executable, "-c", "import time; time.sleep(60)"]
    quick = [sys.executable, "-c", "import time; time.sleep(1.5)"]
    start = time.monotonic()
    with pytest.raises(ChildrenStopped) as stopped:
        run_children([sleeps, [sys.executable, "-c", "raise SystemExit(3)"], quick], timeout=60, grace=0.5,
                     jobs=["pair", "pair", "other"])
    assert time.monotonic() - start < 1.5 + STACK_MARGIN
    message = str(stopped.value)
    assert message.startswith("run_children stopped 1 of 3 children:")
    assert "stopped by the grace of 0.5 s after child 1 of its job exited 3; still running after 0." in message
    assert "exited 3 by itself" in message
    assert "exited 0 by itself after " in message  # another job's child: left to finish


def test_children_that_end_by_themselves_are_returned_as_they_ended():
    results = run_children([[sys.executable, "-c", "import sys, time; time.sleep(0.5); print('out'); "
                                                   "print('err', file=sys.stderr)"],
                            [sys.executable, "-c", "raise SystemExit(4)"]], timeout=30)
    assert results[0] == (0, "out\n", "err\n")  # without grace, a failure stops no other child
    assert results[1].code == 4  # a failure alone is the caller's to judge: returned, not raised
    assert 0.5 <= results[0].seconds < 30 and results[1].seconds < results[0].seconds


@pytest.mark.slow  # child processes: the extended tier
def test_the_watchdog_caps_a_childs_deadline(monkeypatch, request):
    # Inside a test, run_children stops its children STACK_MARGIN s before the watchdog
    # fires, whatever timeout the caller gave, so their stacks are still reported.
    seconds = conftest.watchdog_seconds(request.node)
    assert seconds and 0 < conftest._test_deadline - time.monotonic() <= seconds  # it knows this test's
    monkeypatch.setattr(conftest, "_test_deadline", time.monotonic() + STACK_MARGIN + 0.5)
    start = time.monotonic()
    with pytest.raises(ChildrenStopped, match=r"stopped by this test's watchdog \(pytest.ini\), due"):
        run_children([[sys.executable, "-c", "import time; time.sleep(60)"]], timeout=600)
    assert time.monotonic() - start < 1 + STACK_MARGIN


# --------------------------------------------------------------------------
# The watchdog (pytest.ini): a hung test fails with every thread's stack
# --------------------------------------------------------------------------

HUNG_TESTS = '''
import ctypes, threading, time

def test_waits_in_python():
    threading.Event().wait()

def test_waits_in_native():
    ctypes.CDLL(None).pause()
'''


@pytest.mark.slow  # child processes: the extended tier
def test_the_watchdog_fails_a_hung_test_with_its_stack(tmp_path, request):
    # The suite's own configuration, with its limits shortened: a wait pytest-timeout can
    # interrupt fails the test (and the run goes on); a native one, which it cannot, ends
    # the run through faulthandler, with the stacks on stderr.
    config = request.config
    assert 0 < float(config.getini("timeout")) < float(config.getini("faulthandler_timeout"))
    assert config.getini("faulthandler_exit_on_timeout") is True
    (tmp_path / "test_hung.py").write_text(HUNG_TESTS)
    ini = os.path.join(HERE, "pytest.ini")
    # The native wait through xdist as the suite runs (pytest.ini's addopts), with one worker:
    # faulthandler ends the worker, and the test fails as a crash. The Python wait in this process (-n 0): pytest-timeout acts inside the
    # process running the test, an xdist worker or not.
    common = [sys.executable, "-m", "pytest", "-c", ini, "--rootdir", str(tmp_path), "-p", "no:cacheprovider",
              "-q", str(tmp_path / "test_hung.py")]
    start = time.monotonic()
    (python_code, python_out, python_err), (native_code, native_out, native_err) = run_children([
        common + ["-n", "0", "-k", "python", "-o", "timeout=1"],
        common + ["-n", "1", "-k", "native", "-o", "timeout=0", "-o", "faulthandler_timeout=1"]], timeout=60)
    assert time.monotonic() - start < 30
    assert python_code == 1 and "1 failed" in python_out and "Failed: Timeout" in python_out, python_out
    assert "test_waits_in_python" in python_out and "threading.Event().wait()" in python_out, python_out
    assert native_code == 1, (native_code, native_out, native_err)
    native = native_out + native_err
    assert "Timeout (0:00:01)!" in native and "in test_waits_in_native" in native, native
    assert "crashed while running 'test_hung.py::test_waits_in_native'" in native, native


CRASHING_TESTS = '''
import os, signal

def test_runs_first():
    pass

def test_crashes_once():
    mark = os.path.join(os.environ["CRASH_MARKS"], "once")
    if not os.path.exists(mark):
        open(mark, "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)

def test_crashes_always():
    os.kill(os.getpid(), signal.SIGSEGV)
'''


@pytest.mark.slow  # child processes: the extended tier
def test_a_crashed_worker_reruns_a_rocal_test_once_and_fails_any_other(tmp_path, monkeypatch):
    # The suite's pytest.ini and conftest. First 1 and 2 workers over files named as the suite's,
    # the crash at test_rocal.py's last test, with files left to run: without conftest's mend of
    # xdist's loadfile (_never_one_test_alone) the run on 2 hangs (a worker given one test
    # alone). A crash once is run again and passes; a crash twice fails; the same crash in a
    # file not in CRASH_RERUN_FILES fails at once (on 1 worker, test_other.py's: the run's
    # second crash, which pytest.ini's --max-worker-restart=2 still replaces).
    assert conftest.CRASH_RERUN_FILES == ("test_rocal.py",)
    marks, suite = tmp_path / "marks", tmp_path / "suite"
    marks.mkdir()
    suite.mkdir()
    sleepers = lambda count, seconds: "import time\n" + "".join(f"def test_{i}():\n    time.sleep({seconds})\n"
                                                                   for i in range(count))
    for name, count, seconds in (("test_strategies.py", 2, 0.15), ("test_equivalence.py", 2, 0.15),
                                 ("test_refimpl.py", 2, 0.15), ("test_a.py", 6, 0.1), ("test_b.py", 6, 0.1),
                                 ("test_c.py", 6, 0.1), ("test_d.py", 6, 0.1)):
        (suite / name).write_text(sleepers(count, seconds))
    crash_once = CRASHING_TESTS.split("def test_crashes_always")[0].split("def test_runs_first():\n    pass\n")[1]
    (suite / "test_rocal.py").write_text(sleepers(4, 0.1) + "import os, signal\n\n" + crash_once)
    (suite / "test_other.py").write_text("import os, signal\n\n" + crash_once.replace('"once"', '"other"'))
    (tmp_path / "test_rocal.py").write_text(CRASHING_TESTS)
    common = [sys.executable, "-m", "pytest", "-c", os.path.join(HERE, "pytest.ini"), "-p", "conftest",
              "-p", "no:cacheprovider", "-rA"]
    monkeypatch.setenv("CRASH_MARKS", str(marks))
    monkeypatch.setenv("PYTHONPATH", HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for workers, other in (("1", []), ("2", ["--ignore", "test_other.py"])):
        for mark in marks.iterdir():
            mark.unlink()
        ((once_code, once_out, once_err),) = run_children([common + ["--rootdir", str(suite), "-n", workers, *other]],
                                                           timeout=60, cwd=suite)
        counts = once_out.strip().splitlines()[-1].split(" in ")[0].strip("= ")  # xdist reruns test_other's too
        want = (1, "1 failed, 36 passed") if workers == "1" else (0, "35 passed")
        assert (once_code, counts) == want, (workers, once_out, once_err)
        assert "crash rerun: test_rocal.py::test_crashes_once: its worker crashed" in once_out, once_out
        if workers == "1":
            assert "FAILED test_other.py::test_crashes_once" in once_out, once_out
            assert "crash rerun: test_other.py" not in once_out, once_out
            assert "crashed while running 'test_other.py::test_crashes_once'" in once_out + once_err
    ((always_code, always_out, always_err),) = run_children(
        [common + ["--rootdir", str(tmp_path), "-n", "1", "test_rocal.py", "-k", "always"]], timeout=60, cwd=tmp_path)
    summary = always_out.strip().splitlines()[-1]  # xdist runs it again while workers may restart
    assert always_code == 1 and " failed" in summary and "passed" not in summary, (always_out, always_err)
    assert "FAILED test_rocal.py::test_crashes_always" in always_out, always_out


def test_xdist_hands_out_files_whole_but_the_named_tests_case_by_case():
    """conftest.xdist_unit, the unit of pytest.ini's --dist loadfile: a test's file, but a case
    of a test in CASE_UNITS on its own; each test CASE_UNITS names is one of its file's (a
    renamed one would silently go back to its file's worker)."""
    assert conftest.xdist_unit("test_model.py::test_loss[3]") == "test_model.py"
    for name in conftest.CASE_UNITS:
        assert conftest.xdist_unit(f"{name}[a-b]") == f"{name}[a-b]"
        assert conftest.xdist_unit(f"{name}x[a-b]") == name.split("::")[0]
        file, test = name.split("::")
        with open(os.path.join(HERE, file)) as f:
            assert f"\ndef {test}(" in f.read(), name


def test_the_deeper_profiles_scale_the_watchdog(request):
    # dev and thorough draw 4 and 40 times the examples (conftest.examples): their tests
    # get as much longer, through the same ini values the plugins read.
    class Config:  # what scale_watchdog touches of pytest's Config
        def __init__(self):
            self._inicache = {}

        def getini(self, name):
            return self._inicache.get(name, {"timeout": "90", "faulthandler_timeout": "120"}[name])

    config = Config()
    conftest.scale_watchdog(config, 40)
    assert (config.getini("timeout"), config.getini("faulthandler_timeout")) == (3600, 4800)
    # And this session's limits are pytest.ini's, times this profile's scale.
    ini = configparser.ConfigParser(inline_comment_prefixes="#")
    ini.read(os.path.join(HERE, "pytest.ini"))
    scale = max(1, conftest.settings.default.max_examples / 25)
    overridden = {o.split("=")[0] for o in request.config.option.override_ini or []}  # -o NAME=...
    for name in {"timeout", "faulthandler_timeout"} - overridden:
        assert float(request.config.getini(name)) == float(ini["pytest"][name]) * scale, name


def markdown_links(text: str) -> list[str]:
    """The targets of a markdown text's links: [words](target), code blocks left out."""
    import re
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def anchors(text: str) -> set[str]:
    """GitHub's anchor of every heading: lower case, punctuation dropped, spaces to hyphens."""
    import re
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in text.splitlines() if line.startswith("#")}


def test_every_link_in_the_readme_and_the_docs_resolves():
    """Every relative link in README.md and docs/*.md names a file that exists and, with a
    #fragment, a heading of it; the control: a made-up file and heading are caught."""
    pages = [os.path.join(HERE, "README.md")] + [os.path.join(HERE, "docs", f)
                                                 for f in sorted(os.listdir(os.path.join(HERE, "docs")))]
    broken = []

    def check(page: str, target: str) -> None:
        if target.startswith(("http://", "https://", "mailto:")):
            return
        path, _, fragment = target.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(full):
            broken.append(f"{os.path.relpath(page, HERE)}: {target} (no such file)")
        elif fragment and full.endswith(".md") and fragment not in anchors(open(full).read()):
            broken.append(f"{os.path.relpath(page, HERE)}: {target} (no such heading)")
    for page in pages:
        for target in markdown_links(open(page).read()):
            check(page, target)
    assert not broken, broken
    check(pages[0], "docs/nowhere.md")
    check(pages[0], "docs/guarantees.md#no-such-heading")
    assert len(broken) == 2, broken


def test_every_test_the_readme_and_the_docs_name_exists():
    """Every test a page names (a ``test_...`` word not followed by ".py") is a function some
    test file defines, so a removed or renamed test cannot leave its guarantee standing in the
    docs; the control: a made-up name is caught."""
    import glob
    import re
    sources = "".join(open(f).read() for f in glob.glob(os.path.join(HERE, "test_*.py"))
                      + glob.glob(os.path.join(HERE, "tools", "test_*.py")))
    defined = set(re.findall(r"^def (test_\w+)\(", sources, re.M))

    def unknown(text: str) -> list:
        return sorted(set(re.findall(r"\b(test_[a-z0-9_]+)\b(?!\.py)", text)) - defined)
    pages = [os.path.join(HERE, "README.md")] + sorted(glob.glob(os.path.join(HERE, "docs", "*.md")))
    missing = {os.path.relpath(p, HERE): unknown(open(p).read()) for p in pages}
    assert not any(missing.values()), missing
    assert unknown("`test_model.py::test_update_parallel_matches_update`") == ["test_update_parallel_matches_update"]


def test_each_tier_draws_its_profiles_examples(request):
    # The default tier draws quick's 10 examples a property test, --run-slow ci's 25, unless
    # HYPOTHESIS_PROFILE chose; examples(n) scales alike (it is read at the modules' import).
    if "HYPOTHESIS_PROFILE" in os.environ:
        pytest.skip(f"HYPOTHESIS_PROFILE={os.environ['HYPOTHESIS_PROFILE']} chose the profile")
    expected = 25 if request.config.getoption("--run-slow") else 10
    assert conftest.settings.default.max_examples == expected
    assert conftest.examples(40) == 40 * expected // 25 and conftest.examples(1) == 1


# --------------------------------------------------------------------------
# The device policy in the tests' own code (conftest.py's table)
# --------------------------------------------------------------------------

DEFAULT_BACKEND = ("devices", "local_devices", "live_arrays", "default_backend", "device_count", "local_device_count")


def policy_breaches(source: str, name: str) -> list[str]:
    """Where ``source`` (a test file) steps outside the device policy: a call of refimpl.main
    outside conftest.run_refimpl (it would take JAX's default platform), or a jax.<one of
    DEFAULT_BACKEND>() with no argument (JAX's default backend: on a host of one accelerator,
    the accelerator, not the tests' CPU devices). Not breaches: a function that joins
    jax.distributed (it runs in a child process, CPU devices only) and a line that says
    "on purpose". Code inside strings (child programs) is not scanned."""
    import ast
    lines, found = source.splitlines(), []

    def visit(node, function):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if "jax.distributed.initialize" in ast.unparse(node):
                return
            function = node.name
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
            where = f"{name}:{node.lineno} ({function})"
            owner, attr = node.func.value.id, node.func.attr
            if (owner, attr) == ("refimpl", "main") and (name, function) != ("conftest.py", "run_refimpl"):
                found.append(f"{where}: refimpl.main outside conftest.run_refimpl")
            if (owner == "jax" and attr in DEFAULT_BACKEND and not node.args and not node.keywords
                    and "on purpose" not in lines[node.lineno - 1]):
                found.append(f"{where}: jax.{attr}() asks JAX's default backend")
        for child in ast.iter_child_nodes(node):
            visit(child, function)
    visit(ast.parse(source), "(module)")
    return found


def test_only_the_vendors_known_lines_leave_stderr():
    """own_stderr drops libtpu's start-up advice (and the warnings.warn line after it), nothing
    else: the project's own lines stay, and so does a warnings.warn line after one of them."""
    from conftest import own_stderr
    tpu = ("/opt/jax/_src/cloud_tpu_init.py:88: UserWarning: Transparent hugepages are not enabled. TPU runtime "
           "startup and shutdown time should be significantly improved\n  warnings.warn(\n")
    assert own_stderr(tpu + "refimpl.py: error: x\n") == "refimpl.py: error: x\n"
    mine = "bench.py:1: UserWarning: ours\n  warnings.warn(\n"
    assert own_stderr(mine + tpu) == mine


def test_the_tests_follow_the_device_policy():
    """Every in-process refimpl run goes through conftest.run_refimpl (CPU devices on any host),
    and no test asks JAX's default backend where it means the policy's devices (a host of one
    accelerator found both: runs on the TPU, arrays looked for on it). The control: a planted
    source with one of each is caught, and its jax.distributed worker is not."""
    import glob
    files = sorted(glob.glob(os.path.join(HERE, "test_*.py"))) + [os.path.join(HERE, "conftest.py")]
    breaches = [b for f in files for b in policy_breaches(open(f).read(), os.path.basename(f))]
    assert not breaches, breaches
    planted = ("import jax, refimpl\n"
               "def test_a():\n    assert refimpl.main(['--epochs', '1']) == 0\n"
               "def test_b():\n    seen = jax.live_arrays()\n"
               "def worker():\n    jax.distributed.initialize()\n    return jax.devices()\n")
    assert [b.split(": ", 1)[0] for b in policy_breaches(planted, "t.py")] == ["t.py:3 (test_a)", "t.py:5 (test_b)"]
