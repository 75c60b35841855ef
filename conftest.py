"""Test set-up: the suite's device policy, hypothesis profiles, a small dataset.

Device policy, the same for every test, helper and child process:

    accelerators on the host | the tests' devices           | JAX's default device
    -------------------------+------------------------------+---------------------
    none                     | 8 virtual CPU devices        | CPU 0
    1                        | 8 virtual CPU devices        | CPU 0 (pinned here)
    2 or more (odd too)      | every accelerator, in order  | left as it is
    child processes          | CPU devices (JAX_PLATFORMS=cpu), always

* One accelerator cannot show data parallelism, so a 1-GPU host runs the suite
  on 8 virtual CPU devices like a laptop. The default device is pinned to CPU 0
  there as a safety net; the code itself never relies on it: every array goes
  to the mesh it was given, and tests on meshes of other devices (CPU 4..7,
  permuted orders) check that.
* Child processes (refimpl.py runs, the jax.distributed tests) test the program
  and the multi-process protocol, not the accelerator; two processes must not
  fight over one GPU. ``child_env()`` gives their environment, and
  ``run_children`` starts each in its own process group and kills the group
  whatever happens.
* GPU memory preallocation is off for this process (set before any backend
  starts), so it holds only what the tests use.
* Matmul precision is "highest" for the whole suite: on NVIDIA GPUs a float32
  matmul is TF32 by default (10-bit mantissas), which the float64 references
  and the strategies' ulp bounds (strategies.ulp_bound) do not allow. On CPU it
  changes nothing.

``jax_num_cpu_devices`` only takes effect before JAX first touches a device,
which is why all of this runs here, at import, before any test module.

Hypothesis profiles, chosen with HYPOTHESIS_PROFILE (default ``ci``): ``ci``
derandomised with modest example counts, ``dev`` random with more examples,
``thorough`` for a long soak. All use ``deadline=None``: the first example of a
jitted test pays for compilation. A test that sets its own count (an expensive
one) takes it from ``examples(n)``, which scales n like the profile (ci x1,
dev x4, thorough x40), so every property test goes deeper under ``thorough``.
"""

import os
import signal
import subprocess
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import loaders

settings.register_profile("ci", derandomize=True, deadline=None, database=None, max_examples=25,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=100,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", deadline=None, max_examples=1000,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pick_devices() -> list:
    """The policy above: every accelerator when there are at least two, else the CPU devices."""
    accelerators = [d for d in jax.devices() if d.platform != "cpu"]
    if len(accelerators) >= 2:
        return accelerators
    return jax.devices("cpu")


DEVICES = pick_devices()
if DEVICES[0].platform == "cpu":
    jax.config.update("jax_default_device", DEVICES[0])


def child_env(**extra: str) -> dict:
    """The environment of a child JAX process: CPU devices only, output unbuffered."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)  # the child sets its own device count
    env.update(extra)
    return env


def run_children(commands: list[list[str]], timeout: float, cwd: str | None = None):
    """Runs every command at once, each in its own process group with ``child_env()``;
    waits for all (at most ``timeout`` seconds in total) and returns
    ``[(exit status, stdout, stderr)]``. Output goes to files, not pipes, so a
    chatty child cannot block on a full pipe. Whatever happens (timeout, error,
    interrupt) every child's whole process group is killed before returning;
    a child still running at the timeout reports status None."""
    with tempfile.TemporaryDirectory() as folder:
        children = []
        try:
            for i, command in enumerate(commands):
                out = open(os.path.join(folder, f"{i}.out"), "w+")
                err = open(os.path.join(folder, f"{i}.err"), "w+")
                child = subprocess.Popen(command, cwd=cwd, env=child_env(), stdout=out, stderr=err,
                                         text=True, start_new_session=True)
                children.append((child, out, err))
            deadline = time.monotonic() + timeout
            for child, _, _ in children:
                try:
                    child.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    pass
        finally:
            timed_out = [child.poll() is None for child, _, _ in children]
            for child, _, _ in children:
                try:
                    os.killpg(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                child.wait()
        results = []
        for (child, out, err), late in zip(children, timed_out):
            out.seek(0)
            err.seek(0)
            results.append((None if late else child.returncode, out.read(), err.read()))
            out.close()
            err.close()
        return results


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run the tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow (about 20 s): run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a long end-to-end regression run; skipped unless --run-slow")
    config.addinivalue_line("markers", "multiprocess: launches several JAX processes (jax.distributed)")
    config.addinivalue_line("markers", "rocal: needs amd.rocal (rocAL's CPU or GPU backend)")
    config.addinivalue_line("markers", "dali: needs nvidia.dali (runs its CPU pipelines)")


@pytest.fixture(scope="session")
def devices():
    return DEVICES


@pytest.fixture(scope="session")
def mesh(devices):
    return loaders.data_mesh(devices)


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory):
    """A CIFAR-10-format folder: 1000 training and 200 test images, seed 0."""
    return loaders.synthetic_cifar10(tmp_path_factory.mktemp("cifar10"), num_train=1000,
                                     num_test=200, seed=0)




def bits_differ(got, want) -> str | None:
    """Why two arrays are not the same bits, or None when they are: same shape, same
    dtype, and every element's bytes equal (so -0.0 differs from 0.0, and a NaN equals
    itself). The message names how many elements differ, the first differing index and
    both values there.

    Tests compare arrays through this, never with ``assert a.tobytes() == b.tobytes()``:
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
    profile, scaled like the active profile (dev x4, thorough x40), so that
    HYPOTHESIS_PROFILE=thorough deepens every property test, not only the ones
    that leave the count to the profile."""
    return max(1, ci_count * settings.default.max_examples // 25)
