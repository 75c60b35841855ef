"""Test set-up: the device policy, bounded child processes, hypothesis profiles, a dataset.

Device policy, the same for every test, helper and child process:

    accelerators on the host | the tests' devices           | JAX's default device
    -------------------------+------------------------------+---------------------
    none                     | 8 virtual CPU devices        | CPU 0
    1                        | 8 virtual CPU devices        | CPU 0 (pinned here)
    2 or more (odd too)      | every accelerator, in order  | left as it is
    child processes          | CPU devices (JAX_PLATFORMS=cpu), always
    in-process refimpl runs  | CPU devices (--platform cpu, ``run_refimpl``), always

* One accelerator cannot show data parallelism, so a 1-GPU host runs the suite
  on 8 virtual CPU devices like a laptop. The default device is pinned to CPU 0
  there as a safety net; the code itself never relies on it: every array goes
  to the mesh it was given, and tests on meshes of other devices (CPU 4..7,
  permuted orders) check that.
* Child processes (refimpl.py runs, the jax.distributed tests) test the program
  and the multi-process protocol, not the accelerator; two processes must not
  fight over one accelerator (a TPU refuses a second). pytest-xdist's workers on
  a host of one accelerator are CPU-only too. ``child_env()`` gives their
  environment, and
  ``run_children`` starts each in its own process group, bounds it, takes the
  stacks of one it has to stop into the failure, and kills them all whatever
  happens.
* GPU memory preallocation is off for this process (set before any backend
  starts), so it holds only what the tests use.
* What a host lacks makes its tests skip, naming it: no TCP socket (a sandbox)
  skips the tests marked multiprocess (``NO_SOCKETS``); no ptrace, the native
  stacks of a hung child (``native_stacks_missing``). A vendor's own lines on
  stderr (``VENDOR_NOISE``) are not the project's.
* Matmul precision is "highest" for the whole suite: on NVIDIA GPUs a float32
  matmul is TF32 by default (10-bit mantissas), which the float64 references
  and the strategies' ulp bounds (equivalence.ulp_bound) do not allow. On CPU it
  changes nothing.

``jax_num_cpu_devices`` only takes effect before JAX first touches a device,
which is why all of this runs here, at import, before any test module.

Every test is bounded by the watchdog in pytest.ini (pytest-timeout, then
faulthandler); ``pytest_runtest_protocol`` below records when it fires, so that
``run_children`` stops its children first, while their stacks can be reported.

Hypothesis profiles, chosen with HYPOTHESIS_PROFILE: ``ci`` derandomised with
modest example counts (the default with --run-slow), ``quick`` the same with 10
examples where ci draws 25 (the default tier's), ``dev`` random with more
examples, ``thorough`` for a long soak. All use ``deadline=None``: the first
example of a jitted test pays for compilation. A test that sets its own count
(an expensive one) takes it from ``examples(n)``, which scales n like the
profile (quick x0.4, ci x1, dev x4, thorough x40), so every property test goes
deeper under ``thorough``. ``mutation`` is ci without shrinking
(tools/mutation.py's).

Helpers that several test files share live here too, at the end, each section
naming the files that use it (``from conftest import ...``, as for
``assert_same_bits``); a helper that one file alone uses stays in that file, and
no test file imports another.
"""

import collections
import contextlib
import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from fractions import Fraction

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# One XLA compilation cache for the whole run, shared by this process, pytest-xdist's workers
# (they inherit this environment) and every child process (child_env): the same program is
# compiled once per run, not once per process that needs it (the refimpl.py children compile
# the same steps; a quarter of the suite's CPU time on 2 cores). It starts empty and is
# removed at the end (pytest_unconfigure), so every run is timed cold; a JAX cache the user
# configured (JAX_COMPILATION_CACHE_DIR) is used as it is instead. A hit returns the
# executable that the same program, options, backend and JAX version compiled to (for a
# single-device program, on another device: below): the bits the tests check are those of a
# fresh compilation.
_OWN_XLA_CACHE = None  # the folder, in the process that made it
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _OWN_XLA_CACHE = tempfile.mkdtemp(prefix="refimpl-tests-xla-cache-")
    os.environ.update(JAX_COMPILATION_CACHE_DIR=_OWN_XLA_CACHE,
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",  # JAX's defaults skip
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",  # the small programs
                      REFIMPL_TESTS_XLA_CACHE=_OWN_XLA_CACHE)  # the workers' word that it is the suite's

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

# In that cache, a single-device program compiles once for every device, not once per device.
# JAX keys an executable by the devices it runs on as well; on GPUs it leaves them out of the key
# (jax/_src/cache_key.py, ``get``: strip_device_assignment) and loads the executable onto the
# devices asked for, on CPUs it does not: the canonical step's programs (a block's, the update:
# strategies.block_program) compiled once per device. XLA compiles a single-device program to the
# same code whatever its device (test_the_canonical_programs_compile_alike_on_every_topology holds
# that, compiling on each device: ``compiled_on_each_device``). So here a single-device program's
# key leaves its device out, as JAX's does on GPUs: the first device compiles, every other loads
# that executable. Those keys are apart from the ones that name a device, which hold that device's
# own compilation. This process and its xdist workers only: a child process, and a cache the user
# configured (above), key as JAX does.
_SHARED_ACROSS_DEVICES = [False]


def _key_without_a_single_device():
    try:
        from jax._src import cache_key
        keyed = cache_key._hash_serialized_compile_options
    except (ImportError, AttributeError):  # another JAX: every device compiles its own
        return

    def hashed(hash_obj, options, strip_device_assignment=False):
        devices = options.device_assignment
        if (_SHARED_ACROSS_DEVICES[0] and devices is not None
                and devices.replica_count() * devices.computation_count() == 1):
            hash_obj.update(b"one executable for every device")  # apart from the keys naming a device
            strip_device_assignment = True
        return keyed(hash_obj, options, strip_device_assignment=strip_device_assignment)
    cache_key._hash_serialized_compile_options = hashed
    _SHARED_ACROSS_DEVICES[0] = True


if os.environ.get("REFIMPL_TESTS_XLA_CACHE") == os.environ["JAX_COMPILATION_CACHE_DIR"]:
    _key_without_a_single_device()

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings, strategies as st

import loaders
import model
import strategies
from arithmetic import Normalize
from cifar_mnist import MNIST_SHAPE, synthetic_cifar10
from plan import LAST_BATCH_POLICIES

settings.register_profile("ci", derandomize=True, deadline=None, database=None, max_examples=25,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("quick", settings.get_profile("ci"), max_examples=10)
settings.register_profile("dev", deadline=None, max_examples=100,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", deadline=None, max_examples=1000,
                          suppress_health_check=[HealthCheck.too_slow])
# mutation.py's: ci's examples, without shrinking. A mutant that fails a property test is
# killed at its first failing example; shrinking it (minutes for a broken LoaderState)
# would only make mutmut call it a timeout.
settings.register_profile("mutation", settings.get_profile("ci"),
                          phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pick_devices() -> list:
    """The policy above: every accelerator when there are at least two, else the CPU devices."""
    accelerators = [d for d in jax.devices() if d.platform != "cpu"]  # the default backend (an accelerator where there is one), on purpose
    if len(accelerators) >= 2:
        return accelerators
    return jax.devices("cpu")


DEVICES = pick_devices()
POLICY_PLATFORM = DEVICES[0].platform
if POLICY_PLATFORM == "cpu":
    jax.config.update("jax_default_device", DEVICES[0])
    # pytest-xdist's workers (started after this import) and every child follow the policy on
    # CPU devices; one accelerator stays with this process (JAX opened it above), the only one
    # that may hold it.
    os.environ["JAX_PLATFORMS"] = "cpu"


def child_env(**extra: str) -> dict:
    """The environment of a child JAX process: CPU devices only, output unbuffered, and
    faulthandler on (PYTHONFAULTHANDLER), so that a crash, or the SIGABRT with which
    ``run_children`` stops a late child, writes every Python thread's stack to its stderr."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    # The child sets its own device count; every other XLA flag (an instruction set played,
    # --xla_cpu_max_isa) goes on to it, so that a pass on another CPU covers the children too.
    flags = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    env.update(extra)
    return env


@contextlib.contextmanager
def compiled_on_each_device():
    """Inside: a single-device program compiles anew on each device, its key naming the device, as
    JAX keys it (the suite's own cache otherwise loads the first device's executable on every
    other). What a test compiles here must be a program new to this process (JAX keeps the
    executables it made in memory too)."""
    shared = _SHARED_ACROSS_DEVICES[0]
    _SHARED_ACROSS_DEVICES[0] = False
    try:
        yield
    finally:
        _SHARED_ACROSS_DEVICES[0] = shared


def run_refimpl(argv) -> "types.SimpleNamespace":
    """``refimpl.main(argv)`` in this process, on CPU devices as the device policy says
    (``--platform cpu`` unless argv names a platform), never on JAX's default platform (an
    accelerator, on a host that has one). Returns its exit status (argparse's too), stdout
    and stderr. Every in-process run goes through here (test_harness.py holds it)."""
    import io
    import types
    import refimpl
    argv = [str(a) for a in argv]
    if "--platform" not in argv:
        argv += ["--platform", "cpu"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = refimpl.main(argv)
        except SystemExit as exit:
            status = exit.code
    return types.SimpleNamespace(status=status, out=out.getvalue(), err=err.getvalue())


def _no_sockets() -> str | None:
    """Why this machine cannot open a TCP socket on 127.0.0.1 (jax.distributed needs one), or None."""
    import socket
    try:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
    except OSError as error:
        return f"no TCP socket on 127.0.0.1 here ({error}): jax.distributed cannot run"
    return None


NO_SOCKETS = _no_sockets()  # tests marked multiprocess skip, saying so

# What vendors print on stderr that is not this project's: libtpu's advice at start-up, on a
# TPU host even in a CPU-only child (jax/_src/cloud_tpu_init.py).
VENDOR_NOISE = ("UserWarning: Transparent hugepages are not enabled.",)


def own_stderr(err: str) -> str:
    """``err`` without the vendors' lines of VENDOR_NOISE (and the ``warnings.warn(`` line
    Python prints after each)."""
    lines, out = err.splitlines(keepends=True), []
    skip = False
    for line in lines:
        if any(noise in line for noise in VENDOR_NOISE):
            skip = True
            continue
        if skip and line.strip() == "warnings.warn(":
            skip = False
            continue
        skip = False
        out.append(line)
    return "".join(out)


# Seconds before the current test's watchdog (pytest.ini) at which run_children stops the
# children it still waits for, to take their stacks while the test can still report them.
STACK_MARGIN = 15.0
_test_deadline: float | None = None  # time.monotonic() at which the current test's watchdog fires


class ChildrenStopped(AssertionError):
    """Raised by ``run_children`` when it had to stop a child; the message holds the report."""


class Ended(collections.namedtuple("Ended", "code out err")):
    """A child that exited by itself: its exit status, stdout and stderr (it unpacks as
    those three) and, in ``seconds``, how long it ran (measured by polling, +-0.05 s)."""
    seconds: float


def run_children(commands: list[list[str]], timeout: float, cwd: str | None = None,
                 grace: float | None = None, jobs: list | None = None) -> list[Ended]:
    """Runs every command at once, each in its own process group with ``child_env()``, and
    returns ``[Ended(exit status, stdout, stderr)]`` once every child has exited by itself.
    Output goes to files, not pipes, so a chatty child cannot block on a full pipe.

    Bounded: a child still running ``timeout`` seconds after the start, or
    ``STACK_MARGIN`` seconds before the current test's watchdog fires (pytest.ini's
    ``timeout``, ``faulthandler_timeout``), whichever comes first, is stopped; so is one
    still running ``grace`` seconds after a child of its job exited with a non-zero status,
    when ``grace`` is given (the processes of one job: the peer of a failed process may wait
    for it forever). ``jobs`` names each command's job (default: all one job). When a child
    had to be stopped, ``ChildrenStopped`` (an AssertionError) is raised, once every child
    has ended, instead of returning.

    Before a child is stopped its stacks are taken, for it and every process it started
    (also those in sessions of their own): ``py-spy dump --native`` (every Python thread,
    with the native frames it is in), or gdb's ``thread apply all bt`` where py-spy is
    missing, each bounded in time; then SIGABRT, on which faulthandler (child_env) writes
    every Python thread's stack into the stderr of each process still running. The message
    names every child (its command, its exit status or why it was stopped and after how
    long), those stacks and the end of its stdout and stderr.

    Whatever happens (a stop, an error, an interrupt, the watchdog) every child's process
    group, and every process a stopped child started, is killed before this returns."""
    jobs = [0] * len(commands) if jobs is None else list(jobs)
    if len(jobs) != len(commands):
        raise ValueError(f"run_children: jobs names {len(jobs)} jobs for {len(commands)} commands")
    with tempfile.TemporaryDirectory() as folder:
        children, ended, reports = [], {}, {}
        start = time.monotonic()
        common = [(start + timeout, f"the timeout of {timeout:g} s")]
        if _test_deadline is not None:
            common.append((max(_test_deadline - STACK_MARGIN, start + 1.0),
                           f"this test's watchdog (pytest.ini), due {STACK_MARGIN:g} s later"))
        limits = [list(common) for _ in commands]
        stacks_until = None  # the time taking stacks may last, from the first stop on
        try:
            for i, command in enumerate(commands):
                out = open(os.path.join(folder, f"{i}.out"), "w+")
                err = open(os.path.join(folder, f"{i}.err"), "w+")
                child = subprocess.Popen(command, cwd=cwd, env=child_env(), stdout=out, stderr=err,
                                         text=True, start_new_session=True)
                children.append((child, out, err))
            while len(ended) + len(reports) < len(children):
                now = time.monotonic()
                for i, (child, _, _) in enumerate(children):
                    if i in ended or i in reports or child.poll() is None:
                        continue
                    ended[i] = now - start
                    if child.returncode and grace is not None:
                        for j in range(len(children)):
                            if jobs[j] == jobs[i]:
                                limits[j].append((now + grace, f"the grace of {grace:g} s after child {i} "
                                                               f"of its job exited {child.returncode}"))
                for i, (child, _, _) in enumerate(children):
                    if i not in ended and i not in reports and now >= min(limits[i])[0]:
                        stacks_until = stacks_until or time.monotonic() + STACK_MARGIN - 5  # for all
                        reports[i] = (f"stopped by {min(limits[i])[1]}; "
                                      + _stop(child, time.monotonic() - start, stacks_until))
                time.sleep(0.05)
        finally:
            for i, (child, _, _) in enumerate(children):
                if child.poll() is None and i not in reports:
                    for pid in _descendants(child.pid):  # an error or interrupt: no time for stacks
                        _kill(pid)
                _kill(child.pid)
                child.wait()
        results = []
        for i, (child, out, err) in enumerate(children):
            out.seek(0)
            err.seek(0)
            results.append(Ended(child.returncode, out.read(), err.read()))
            results[-1].seconds = ended.get(i, time.monotonic() - start)
            out.close()
            err.close()
    if reports:
        lines = [f"run_children stopped {len(reports)} of {len(commands)} children:"]
        for i, (command, (code, out, err)) in enumerate(zip(commands, results)):
            lines.append(f"\n=== child {i}: {' '.join(command)[:300]}")
            lines.append(reports[i] if i in reports else
                         f"exited {code} by itself after {ended[i]:.1f} s")
            lines.append(f"--- child {i} stderr (the end; a stopped child's ends with faulthandler's "
                         f"stacks) ---\n{err[-6000:]}")
            lines.append(f"--- child {i} stdout (the end) ---\n{out[-1500:]}")
        raise ChildrenStopped("\n".join(lines))
    return results


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first, then theirs), from /proc; [] elsewhere."""
    parents = {}
    try:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        stat = f.read()
                except OSError:
                    continue
                parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    except OSError:
        return []
    found, frontier = [], [pid]
    while frontier:
        frontier = [c for p in frontier for c in parents.get(p, [])]
        found += frontier
    return found


def _kill(pid: int) -> None:
    """SIGKILL to ``pid``'s process group (each child leads its own) and to ``pid``."""
    for kill, target in ((os.killpg, pid), (os.kill, pid)):
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def native_stacks(pid: int, timeout: float = 10.0) -> str:
    """Every thread's stack of process ``pid``, native frames included, as text:
    ``py-spy dump --native`` (Python threads, with the native calls they are in), or
    where py-spy is missing ``gdb -batch -p PID -ex 'thread apply all bt'`` (every thread,
    slower: seconds to tens of seconds for a JAX process). At most ``timeout`` seconds;
    says why when neither tool gives an answer (missing, not permitted to attach, ...)."""
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if py_spy:
        command = [py_spy, "dump", "--native", "--pid", str(pid)]
    elif shutil.which("gdb"):
        command = ["gdb", "-nx", "-batch", "-iex", "set debuginfod enabled off", "-p", str(pid),
                   "-ex", "thread apply all bt 40"]
    else:
        return "(no native stacks: neither py-spy nor gdb is installed)"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"({os.path.basename(command[0])} gave no answer within {timeout:g} s)"
    text = (done.stdout + done.stderr).strip()
    return text if done.returncode == 0 else f"({os.path.basename(command[0])} failed: {text[-500:]})"


_NATIVE_PROBE: list = []


def native_stacks_missing() -> str | None:
    """Why ``native_stacks`` cannot read a process on this machine (neither py-spy nor gdb,
    or no ptrace, as in a gVisor sandbox), or None; probed once, on a sleeping child."""
    if not _NATIVE_PROBE:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=child_env(),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.5)
            text = native_stacks(child.pid)
        finally:
            child.kill()
            child.wait()
        _NATIVE_PROBE.append(None if "sleep" in text.lower() else f"no native stacks here: {text[:300]}")
    return _NATIVE_PROBE[0]


def _stop(child: subprocess.Popen, elapsed: float, stacks_until: float) -> str:
    """Takes the stacks of a running child and every process below it (until the time
    ``stacks_until`` at most), then stops them all (SIGABRT, deepest first, so faulthandler
    writes their Python stacks to their stderr, then SIGKILL); returns the report."""
    tree = _descendants(child.pid)
    parts = [f"still running after {elapsed:.1f} s (pid {child.pid})"]
    for pid in [child.pid] + tree:
        left = stacks_until - time.monotonic()
        stacks = native_stacks(pid, timeout=min(10.0, left)) if left > 1 else "(no time left for stacks)"
        parts.append(f"--- stacks of process {pid}{' (started by the child)' if pid != child.pid else ''} "
                     f"---\n{stacks}")
    for group in (tree[::-1], [child.pid]):
        for pid in group:
            try:
                resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))  # a stack, not a core file
            except (OSError, ValueError):
                pass
            try:
                os.kill(pid, signal.SIGABRT)
            except ProcessLookupError:
                pass
        until = time.monotonic() + 3
        while time.monotonic() < until and any(_running(p) for p in group):
            time.sleep(0.05)
    for pid in tree:
        _kill(pid)
    _kill(child.pid)
    child.wait()
    return "\n".join(parts)


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def pytest_xdist_auto_num_workers(config):
    """How many pytest-xdist workers ``-n auto`` (pytest.ini) starts, whole files each
    (``--dist loadfile``): PYTEST_XDIST_AUTO_NUM_WORKERS if set; none (one process, no
    xdist) where the tests run on accelerators, which workers would share, or with one
    core; else one per core, at most 4 (each worker holds JAX's 8 CPU devices and starts
    child processes of its own). On 2 cores the suite's time falls by about a quarter.
    A host of one accelerator runs its tests on CPU devices, so its workers are CPU-only
    (``JAX_PLATFORMS=cpu``) and this process alone holds the accelerator."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    if POLICY_PLATFORM != "cpu":
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 0 if cores < 2 else min(cores, 4)


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run the extended tier (tests marked slow)")


# The default tier's files, longest first. xdist's loadfile hands each worker two units (files, or
# the cases of CASE_UNITS) at the start and then one more whenever it has fewer than two tests
# waiting; so the first n files go one to each of the n workers, the n shortest next (each
# worker's second file, short, so no two long files queue on one worker), then the rest longest
# first (none long left to run alone at the end), then the cases of CASE_UNITS, each to whichever
# worker is free (so the files meet the same predecessors on their workers as without them).
HEAVY_FIRST = ("test_strategies.py", "test_equivalence.py", "test_refimpl.py", "test_loaders.py", "test_dali.py",
               "test_rocal.py", "test_model.py", "test_arithmetic.py", "test_conformance.py", "test_plan.py",
               "test_grain.py", "test_harness.py", "test_cifar_mnist.py", "test_own_job.py", "test_multiprocess.py",
               "test_bench.py", "test_encoding.py")
# Tests whose cases are units of their own, not part of their file's: the extended tier's longest,
# which would otherwise queue on the one worker that holds their file (the canonical matrices:
# minutes of compiling, all in test_strategies.py). Their module fixtures are cheap (a worker
# that runs a case makes them too); the XLA cache (above) is shared by every worker.
CASE_UNITS = ("test_strategies.py::test_canonical_reduction_is_the_same_bits_on_every_topology",
              "test_strategies.py::test_the_loop_schedule_is_the_same_bits_on_every_topology",
              "test_strategies.py::test_the_canonical_programs_compile_alike_on_every_topology",
              "test_equivalence.py::test_no_correct_pair_is_outside_over_drawn_models_rules_and_rates",
              "test_bench.py::test_bench_smoke_runs_and_writes_a_well_formed_report",
              "test_harness.py::test_a_crashed_worker_reruns_a_rocal_test_once_and_fails_any_other")


def xdist_unit(nodeid: str) -> str:
    """What xdist hands a worker whole, for ``nodeid``: the case itself for a test of
    CASE_UNITS, else its file."""
    return nodeid if nodeid.split("[")[0] in CASE_UNITS else nodeid.split("::")[0]


def file_order(names, workers: int) -> list:
    """The order the files go to ``workers`` xdist workers (above); names not in HEAVY_FIRST last."""
    heavy = [n for n in HEAVY_FIRST if n in names] + sorted(set(names) - set(HEAVY_FIRST))
    first, shortest = heavy[:workers], heavy[workers:][::-1][:workers]
    return first + shortest + [n for n in heavy if n not in first + shortest]


def pytest_collection_modifyitems(config, items):
    names = {os.path.basename(str(item.path)) for item in items}
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    order = file_order(names, workers)
    rank = {name: i for i, name in enumerate(order)}
    cases = len(order)  # the cases of CASE_UNITS: after every file
    items.sort(key=lambda item: cases if workers > 1 and xdist_unit(item.nodeid) == item.nodeid
               else rank[os.path.basename(str(item.path))])  # stable
    for item in items:
        if "multiprocess" in item.keywords and NO_SOCKETS:
            item.add_marker(pytest.mark.skip(reason=NO_SOCKETS))
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="the extended tier: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def scale_watchdog(config, scale: float) -> None:
    """Multiplies the watchdog's limits (pytest.ini's ``timeout`` and
    ``faulthandler_timeout``, where set) by ``scale``, before the plugins read them."""
    for name in ("timeout", "faulthandler_timeout"):
        try:
            seconds = float(config.getini(name) or 0)
            if seconds > 0:
                config._inicache[name] = seconds * scale  # pytest has no public setter
        except (ValueError, AttributeError):  # the plugin is off, or pytest changed
            pass


@pytest.hookimpl(tryfirst=True)  # before pytest-timeout reads its limit
def pytest_configure(config):
    # The default tier draws quick's examples, --run-slow ci's (examples() reads the profile
    # when the test modules are imported, after this hook).
    if "HYPOTHESIS_PROFILE" not in os.environ:
        settings.load_profile("ci" if config.getoption("--run-slow") else "quick")
    # The watchdog's limits are the ci profile's; dev and thorough draw 4 and 40 times the
    # examples, so their tests get 4 and 40 times as long.
    if settings.default.max_examples > 25:
        scale_watchdog(config, settings.default.max_examples / 25)
    config.addinivalue_line("markers", "slow: the extended tier (matrices, soaks, sweeps, child and multi-process "
                                       "runs); skipped unless --run-slow")
    config.addinivalue_line("markers", "multiprocess: launches several JAX processes (jax.distributed), or their "
                                       "launcher; skipped where no TCP socket opens")
    config.addinivalue_line("markers", "bits: claims the same bits across device, process or microbatch counts; CI "
                                       "runs the default tier's again at XLA_FLAGS=--xla_cpu_max_isa=AVX")
    config.addinivalue_line("markers", "rocal: needs amd.rocal (rocAL's CPU or GPU backend)")
    config.addinivalue_line("markers", "dali: needs nvidia.dali (runs its CPU pipelines)")


# rocAL 2.3.0's CPU backend, rarely, segfaults in a thread of its own (while a pipeline is built
# or released): a native race, which a loop of thousands of builds does not reproduce. It ends the
# worker; pytest.ini lets xdist replace it (--max-worker-restart), and xdist's loadfile runs the
# crashed test again on the new worker (with _never_one_test_alone's mend). For a test of
# CRASH_RERUN_FILES, the first crash's report is set aside (a passed set-up: not counted) and the
# summary names it, so the test's outcome is that second run's; a second crash of it, or a crash
# anywhere else, fails.
CRASH_RERUN_FILES = ("test_rocal.py",)
CRASH_RERUNS: list[str] = []  # the tests whose first crash was set aside


def _never_one_test_alone(reschedule):
    """pytest-xdist 3.8's loadfile scheduler after a worker died: a worker runs a test only once it
    holds the next one, or has been told there is none, but a replacement worker is given one file
    (with one test left, or none: the dead worker's finished files are put back too), and the run
    waits for ever (pytest-dev/pytest-xdist#1323, #1327). So a worker left with fewer than two tests
    gets another file or, with none left, that word."""
    @functools.wraps(reschedule)
    def ensure_two(self, node):
        reschedule(self, node)
        while not node.shutting_down and self._pending_of(self.assigned_work[node]) < 2:
            if not self.workqueue:
                node.shutdown()
                break
            self._assign_work_unit(node)
    return ensure_two


try:
    from xdist.scheduler.loadfile import LoadFileScheduling
    from xdist.scheduler.loadscope import LoadScopeScheduling
    LoadScopeScheduling._reschedule = _never_one_test_alone(LoadScopeScheduling._reschedule)

    class LoadUnitScheduling(LoadFileScheduling):
        """pytest.ini's --dist loadfile, its units xdist_unit's: files, and the cases of CASE_UNITS."""

        def _split_scope(self, nodeid: str) -> str:
            return xdist_unit(nodeid)

    @pytest.hookimpl(optionalhook=True, tryfirst=True)  # before xdist's own
    def pytest_xdist_make_scheduler(config, log):
        return LoadUnitScheduling(config, log) if config.getvalue("dist") == "loadfile" else None
except ImportError:  # no xdist: one process, nothing to replace
    pass


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    if crashitem.split("::")[0] in CRASH_RERUN_FILES and crashitem not in CRASH_RERUNS:
        CRASH_RERUNS.append(crashitem)
        report.outcome, report.when = "passed", "setup"


def pytest_terminal_summary(terminalreporter):
    for line in CRASH_RERUNS:
        terminalreporter.write_line(f"crash rerun: {line}: its worker crashed; its outcome is its run on a new "
                                    f"worker", yellow=True)


def pytest_unconfigure(config):
    if _OWN_XLA_CACHE and not os.environ.get("PYTEST_XDIST_WORKER"):  # the process that made it
        shutil.rmtree(_OWN_XLA_CACHE, ignore_errors=True)


def watchdog_seconds(item) -> float | None:
    """Seconds after which the watchdog (pytest.ini) stops ``item``: the earlier of
    pytest-timeout's limit (its ``timeout`` marker, option or ini value) and pytest's
    ``faulthandler_timeout``; None when neither is set."""
    limits = []
    if item.config.pluginmanager.hasplugin("timeout"):
        try:
            import pytest_timeout
            limits.append(pytest_timeout._get_item_settings(item).timeout)
        except (ImportError, AttributeError, ValueError):
            limits.append(float(item.config.getini("timeout") or 0))
    try:
        limits.append(float(item.config.getini("faulthandler_timeout") or 0))
    except ValueError:  # -p no:faulthandler
        pass
    limits = [t for t in limits if t and t > 0]
    return min(limits) if limits else None


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item):
    """Records when the current test's watchdog fires, for ``run_children``'s deadline."""
    global _test_deadline
    seconds = watchdog_seconds(item)
    _test_deadline = None if seconds is None else time.monotonic() + seconds
    try:
        return (yield)
    finally:
        _test_deadline = None


@pytest.fixture(scope="session")
def devices():
    return DEVICES


@pytest.fixture(scope="session")
def mesh(devices):
    return loaders.data_mesh(devices)


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory):
    """A CIFAR-10-format folder: 1000 training and 200 test images, seed 0."""
    return synthetic_cifar10(tmp_path_factory.mktemp("cifar10"), num_train=1000,
                                     num_test=200, seed=0)




def bits_differ(got, want) -> str | None:
    """Why two arrays are not the same bits, or None when they are: same shape, same
    dtype, and every element's bytes equal (so -0.0 differs from 0.0, and a NaN equals
    itself). The message names how many elements differ, the first differing index and
    both values there.

    Tests compare arrays through this, never with a bare assert on their bytes or lists:
    when such an assert fails, pytest explains it by diffing the two byte strings, in
    time quadratic in their length (a negative control meant to fail took minutes)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"got {got.dtype} {got.shape}, want {want.dtype} {want.shape}"
    if not got.size:
        return None
    width = got.dtype.itemsize
    a = np.frombuffer(np.ascontiguousarray(got).tobytes(), np.uint8).reshape(got.shape + (width,))
    b = np.frombuffer(np.ascontiguousarray(want).tobytes(), np.uint8).reshape(got.shape + (width,))
    differ = (a != b).any(axis=-1)
    count = int(np.count_nonzero(differ))
    if not count:
        return None
    first = tuple(int(i) for i in np.argwhere(differ)[0])
    return (f"{count} of {got.size} elements differ; the first at index {first}: got "
            f"{got[first]!r}, want {want[first]!r}")


def assert_same_bits(got, want, what: str = "") -> None:
    """Raises AssertionError with ``bits_differ``'s message (prefixed by ``what``) unless
    ``got`` and ``want`` are the same bits."""
    why = bits_differ(got, want)
    if why is not None:
        raise AssertionError(f"{what}: {why}" if what else why)


def examples(ci_count: int) -> int:
    """``max_examples`` for a test that sets its own: ``ci_count`` under the ci
    profile, scaled like the active profile (quick x0.4, dev x4, thorough x40), so that
    HYPOTHESIS_PROFILE=thorough deepens every property test, not only the ones
    that leave the count to the profile."""
    return max(1, ci_count * settings.default.max_examples // 25)


# --------------------------------------------------------------------------
# Shared by several test files, imported by name (``from conftest import ...``); a
# helper one file alone uses stays in that file. Never import one test file from another.
# --------------------------------------------------------------------------


# Checks and drawn inputs: test_plan.py, test_loaders.py, test_arithmetic.py,
# test_cifar_mnist.py.
def assert_raises_naming(error, fn, *fragments):
    """``fn()`` raises ``error`` and its message contains every fragment."""
    with pytest.raises(error) as info:
        fn()
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


SEEDS = st.integers(0, 2**32 - 1)
EPOCHS = st.integers(0, 1000)
POLICIES = st.sampled_from(LAST_BATCH_POLICIES)


def epoch_steps(N: int, segments, last_batch: str = "fill") -> int:
    """The steps of an epoch run by ``segments``, as a LoaderState counts them."""
    from plan import LoaderState
    return LoaderState(N, 0, 0, segments[-1][0], False, last_batch, tuple(segments)).num_steps


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def expected_steps(N: int, n: int, B: int, last_batch: str) -> int:
    return ceil_div(ceil_div(N, n), B) if last_batch == "fill" else (N // n) // B


# What an int parameter must refuse (test_plan.py, test_arithmetic.py,
# test_cifar_mnist.py): a bool (Python's or NumPy's), a whole float (Python's or NumPy's,
# the valid value itself among them), the valid value as a string, None.
def not_ints(valid: int):
    return st.one_of(st.sampled_from([True, False, np.True_, None, float(valid), np.float64(valid),
                                      np.float32(valid), str(valid)]),
                     st.integers(0, 2**40).map(float), st.integers(0, 99).map(np.float64))


def assert_refuses_naming_value(call, where: str, name: str, wrong) -> None:
    """``call(wrong)`` raises ValueError whose message starts with ``where`` (the function)
    and names the parameter ``name`` and the value (its repr)."""
    with pytest.raises(ValueError) as info:
        call(wrong)
    text = str(info.value)
    assert text.startswith(f"{where}: ") and name in text and repr(wrong) in text, (where, name, wrong, text)


@st.composite
def crop_cases(draw):
    n, h, w = draw(st.integers(1, 4)), draw(st.integers(1, 40)), draw(st.integers(1, 40))
    crop = draw(st.integers(1, h)), draw(st.integers(1, w))
    crop_pos = draw(st.tuples(st.floats(0, 1), st.floats(0, 1)))
    mirror = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    mean = draw(st.lists(st.floats(-300, 300), min_size=3, max_size=3))
    std = draw(st.lists(st.floats(0.01, 300) | st.floats(-300, -0.01), min_size=3, max_size=3))
    images = np.random.default_rng(draw(SEEDS)).integers(0, 256, (n, 3, h, w), dtype=np.uint8)
    return images, crop, crop_pos, mirror, mean, std


def random_mnist(seed: int, count: int):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (count,) + MNIST_SHAPE, dtype=np.uint8), rng.integers(0, 10, count).astype(np.int32)


# Values that are not doubles (test_arithmetic.py: through float() first; test_loaders.py:
# the same bits in every placement).
ONE_PLUS = Fraction(1) + Fraction(1, 2**24) + Fraction(1, 2**60)  # float() gives 1 + 2**-24: a float32 tie
BIG = 2**60 + 2**36 + 1  # float() gives 2**60 + 2**36: a float32 tie
NOT_DOUBLES = [((ONE_PLUS,), (127.5,)), ((BIG,), (2**62,)), ((0.0,), (BIG,)), ((np.float32(125.3),), (66.7,))]
if np.finfo(np.longdouble).nmant >= 63:  # an x86 extended long double holds 1 + 2**-24 + 2**-60 exactly
    NOT_DOUBLES.append(((np.longdouble(1) + np.longdouble(2) ** -24 + np.longdouble(2) ** -60,), (127.5,)))


# --------------------------------------------------------------------------
# Resumes on other meshes: test_loaders.py
# --------------------------------------------------------------------------


def meshes(devices):
    """Sub-meshes of the suite's devices: all 8, 3 others, 4 in a permuted order."""
    three = devices[-3:] if len(devices) >= 3 else devices[:1]
    four = [devices[i % len(devices)] for i in (6, 1, 3, 0)] if len(devices) >= 8 else devices[::-1]
    return [loaders.data_mesh(devices), loaders.data_mesh(three), loaders.data_mesh(four)]


# --------------------------------------------------------------------------
# refimpl.py resized through a vendor backend and the reference: test_dali.py, test_rocal.py
# --------------------------------------------------------------------------

# Two resizes: (name, stop options, resume options, the stopped run, the resumed run).
RESIZES_2048 = [
    ("2x4 -> 8", ["--local-processes", "2"], ["--devices", "8"], "8 cpu device(s) in 2 processes, 8 x 16",
     "8 cpu device(s), 8 x 16"),
    ("8 -> 3", ["--devices", "8"], ["--devices", "3"], "8 cpu device(s), 8 x 16", "3 cpu device(s), 3 x 16")]


def refimpl_resized(tmp_path, backends: tuple, common: list, stop: list, resume: list, *, per_backend=None,
                    check=None, timeout: float = 240) -> dict:
    """refimpl.py with each of ``backends`` at once, twice: ``common + stop`` with --checkpoint-dir
    tmp_path/ck-<backend>, then ``common + resume`` resuming it with --params-out
    tmp_path/<backend>.npz (``per_backend(backend)``: more options for one backend). Checks every
    exit status, that no run says Traceback, OUTSIDE or FAILED, and ``check(stdout, stderr)`` of
    each run; returns {backend: the resumed run's stdout}."""
    here = os.path.dirname(os.path.abspath(__file__))
    outputs = {}
    for phase, options in (("stop", stop), ("resume", resume)):
        commands = []
        for backend in backends:
            where = str(tmp_path / f"ck-{backend}")
            more = (["--checkpoint-dir", where] if phase == "stop" else
                    ["--resume-from", where, "--params-out", str(tmp_path / f"{backend}.npz")])
            commands.append([sys.executable, os.path.join(here, "refimpl.py"), "--backend", backend, *common,
                             *(per_backend(backend) if per_backend else []), *options, *more])
        for backend, command, (code, out, err) in zip(backends, commands,
                                                      run_children(commands, timeout=timeout, cwd=here)):
            assert code == 0, f"{' '.join(command[1:])} exited {code}:\n{out[-2000:]}\n{err[-3000:]}"
            assert "Traceback" not in err and "OUTSIDE" not in out and "FAILED" not in out, out + err
            if check:
                check(out, err)
            outputs[backend] = out
    return outputs


def exactly_once(out: str) -> list[str]:
    """refimpl's delivery lines: one per strategy and complete epoch, counted across the runs."""
    return [line for line in out.splitlines() if ", counted by sample index over the runs that delivered it: " in line]


def assert_same_params(tmp_path, backends: tuple, leaves: int) -> None:
    """tmp_path/<backend>.npz of the two backends: the same ``leaves`` arrays, bit for bit."""
    got, want = (np.load(tmp_path / f"{b}.npz") for b in backends)
    assert sorted(got.files) == sorted(want.files) and len(want.files) == leaves, (got.files, want.files)
    for name in want.files:
        assert_same_bits(got[name], want[name], f"{name}: --backend {backends[0]}'s params against "
                                                f"--backend {backends[1]}'s")


# --------------------------------------------------------------------------
# The strategies' test models and batches: test_equivalence.py, test_strategies.py
# --------------------------------------------------------------------------


B = 4  # per device
SMALL_LAYERS = (3072, 32, 16, 10)  # same code path as the notebook MLP, faster to compile


FEATURES, CLASSES = 40, 3  # the linear model's input and output


def linear_loss_terms(params: dict, batch: dict):
    """A linear softmax over float features (B, 40): not an MLP, not images, params a dict."""
    logits_BxC = batch["images"] @ params["w"] + params["b"]
    logp_BxC = logits_BxC - jax.nn.logsumexp(logits_BxC, axis=1, keepdims=True)
    nll_B = -jnp.take_along_axis(logp_BxC, batch["labels"].reshape(-1, 1), axis=1)[:, 0]
    mask_B = batch["mask"].astype(logp_BxC.dtype)
    return jnp.sum(mask_B * nll_B), jnp.sum(mask_B)


def linear_init() -> dict:
    rng = np.random.default_rng(0)
    return {"w": (0.3 * rng.standard_normal((FEATURES, CLASSES))).astype(np.float32),
            "b": np.zeros(CLASSES, np.float32)}


def mlp_features(rng, rows: int) -> np.ndarray:
    return Normalize()(rng.integers(0, 256, size=(rows, 3, 32, 32), dtype=np.uint8))


def linear_features(rng, rows: int) -> np.ndarray:
    return rng.standard_normal((rows, FEATURES), dtype=np.float32)


# Fixed shapes (one compilation each): the model is drawn, not its sizes.
MODELS = {"mlp": (model.loss_terms, lambda: model.init_model(SMALL_LAYERS), mlp_features, 10),
          "linear": (linear_loss_terms, linear_init, linear_features, CLASSES)}


def host_batches(seed: int, steps: int, n: int, real_per_device: list[int], kind: str = "mlp"):
    """Random global batches (n*B rows) for model ``kind``; device k's block has
    real_per_device[k] real rows."""
    _, _, features, classes = MODELS[kind]
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x = features(rng, n * B)
        mask = np.zeros((n, B), bool)
        for k, real in enumerate(real_per_device):
            mask[k, rng.permutation(B)[:real]] = True  # padding anywhere in the block
        out.append({
            "images": x,
            "labels": rng.integers(0, classes, size=n * B).astype(np.int32),
            "mask": mask.reshape(-1),
        })
    return out


def place(host: dict, mesh, layout: str):
    """The same global batch through the loader's own code path (loaders.global_batch)."""
    n = mesh.devices.size
    blocks = {k: {name: rows[k * B:(k + 1) * B] for name, rows in host.items()} for k in range(n)}
    return loaders.global_batch(blocks, mesh, layout)


def train(name, step_fn, params, hosts, learning_rate, mesh, loss_terms=model.loss_terms,
          optimizer=None):
    """(params, losses) of strategy ``step_fn`` on ``hosts``; SGD(learning_rate) unless
    ``optimizer`` is given."""
    layout = strategies.LAYOUT.get(name, "sharded")
    optimizer = strategies.sgd(learning_rate) if optimizer is None else optimizer
    params, losses, _ = step_fn(params, [place(h, mesh, layout) for h in hosts], mesh,
                                loss_terms=loss_terms, optimizer=optimizer)
    return params, losses


@pytest.fixture(scope="module")
def small_params():
    return model.init_model(SMALL_LAYERS)
