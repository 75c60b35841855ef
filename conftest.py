"""Test set-up: devices, hypothesis profiles and a small synthetic dataset.

Devices: with two or more accelerators (a multi-GPU host) the tests use them;
otherwise JAX gets 8 virtual CPU devices. ``jax_num_cpu_devices`` only takes
effect before JAX first touches a device, which is why it is set here, at import,
before any test module runs; it changes nothing on the accelerators.

Hypothesis profiles, chosen with HYPOTHESIS_PROFILE (default ``ci``):
``ci`` derandomised with modest example counts, ``dev`` random with more
examples, ``thorough`` for a long soak. All use ``deadline=None``: the first
example of a jitted test pays for compilation.
"""

import os

import jax

jax.config.update("jax_num_cpu_devices", 8)

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
    """Accelerators when there are at least two, else the 8 virtual CPU devices."""
    devices = jax.devices()
    if len(devices) >= 2 and devices[0].platform != "cpu":
        return devices
    return jax.devices("cpu")


def pytest_configure(config):
    config.addinivalue_line("markers", "multiprocess: launches several JAX processes (jax.distributed)")
    config.addinivalue_line("markers", "rocal: needs amd.rocal and at least 2 AMD GPUs")


@pytest.fixture(scope="session")
def devices():
    return pick_devices()


@pytest.fixture(scope="session")
def mesh(devices):
    return loaders.data_mesh(devices)


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory):
    """A CIFAR-10-format folder: 1000 training and 200 test images, seed 0."""
    return loaders.synthetic_cifar10(tmp_path_factory.mktemp("cifar10"), num_train=1000,
                                     num_test=200, seed=0)
