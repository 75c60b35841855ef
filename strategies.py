"""Four ways to run the same data-parallel SGD, and the helpers to move params.

Every strategy has one signature::

    strategy(params, batches, learning_rate, mesh) -> (params, losses)

``params`` in and out are host-side (NumPy) ``[(w, b), ...]``, so epochs chain by
passing the result back in and no strategy keeps hidden state. ``batches`` is
any iterable of batch dicts ("images", "labels", "mask") in the strategy's
``LAYOUT``; ``losses`` (steps,) float32 is each step's global masked loss,
computed before that step's update. The mesh is one axis named 'data'
(loaders.data_mesh).

* ``sharded``: the notebooks' automatic parallelisation. Params replicated
  (``NamedSharding(mesh, P())``), the batch sharded on 'data', the plain jit
  ``model.update``; XLA partitions the computation and adds the sums.
* ``pmap``: params stacked on a leading device axis, batches (n, B, ...),
  ``model.update_parallel``. pmap is in maintenance mode in current JAX.
* ``shard_map``: pmap's modern replacement, ``jax.shard_map`` with explicit
  collectives.
* ``single``: the whole global batch on one device each step; the oracle the
  others are compared with.

Guarantees (test_equivalence.py), after the same steps on the same global
batches, masks included:

* pmap and shard_map give bit-identical params on CPU (same per-device program,
  same explicit psum).
* sharded stays within 1 float32 ulp (of each leaf's largest magnitude) per step
  of them on CPU: XLA partitions the jit step itself and picks other local dot
  kernels, so single gradient entries can round the other way. (The notebooks'
  unmasked step was measured bit-identical; with masks it is not always.)
* each matches single within 2 ulps per step: single sums the whole batch in
  one pass, the others per device and then across devices.
* On GPUs the cross-device sum may be reordered: n ulps per step.
"""

from __future__ import annotations

import functools
from typing import Iterable

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from model import AXIS, Params, loss_terms, sgd, update, update_parallel

LAYOUT = {"sharded": "sharded", "pmap": "pmap", "shard_map": "sharded", "single": "sharded"}


# --------------------------------------------------------------------------
# Moving params between layouts (current APIs only)
# --------------------------------------------------------------------------


def replicate(params: Params, mesh: Mesh) -> Params:
    """Every leaf on every device of ``mesh``: ``NamedSharding(mesh, P())``.

    Replaces the removed ``jax.device_put_replicated`` for jit code. Each process
    fills only its own devices, so this also works across processes (every
    process must pass the same values)."""
    sharding = NamedSharding(mesh, P())

    def put(leaf):
        leaf = np.asarray(leaf)
        return jax.make_array_from_callback(leaf.shape, sharding, lambda index: leaf[index])

    return jax.tree.map(put, params)


def stack_replicas(params: Params, mesh: Mesh) -> Params:
    """Every leaf as (n, ...) with one copy per device, sharded on axis 0: pmap's layout.

    Built from per-device copies, so in a multi-process run each process supplies
    only its own devices' copies."""
    sharding = NamedSharding(mesh, P(AXIS))
    devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]

    def stack(leaf):
        leaf = np.asarray(leaf)
        parts = [jax.device_put(leaf[None], d) for d in devices]
        return jax.make_array_from_single_device_arrays((mesh.devices.size,) + leaf.shape, sharding, parts)

    return jax.tree.map(stack, params)


def first_replica(stacked: Params) -> Params:
    """Host copy of one replica of pmap-layout params (this process's first)."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0))[0], stacked)


def to_host(params: Params) -> Params:
    """Host (NumPy) copy of replicated or single-device params."""
    def get(x):
        if isinstance(x, jax.Array):
            if not x.sharding.is_fully_replicated:
                raise ValueError(f"to_host: expected replicated params, got sharding {x.sharding}")
            return np.asarray(x.addressable_data(0))
        return np.asarray(x)
    return jax.tree.map(get, params)


def on_device(params: Params, device: jax.Device) -> Params:
    """Params gathered onto one device (e.g. for single-device validation)."""
    return jax.device_put(params, device)


# --------------------------------------------------------------------------
# The strategies
# --------------------------------------------------------------------------


def sharded(params: Params, batches: Iterable[dict], learning_rate: float, mesh: Mesh):
    params, losses = _run(update, replicate(params, mesh), batches, learning_rate)
    return to_host(params), _stack(losses)


def pmap(params: Params, batches: Iterable[dict], learning_rate: float, mesh: Mesh):
    _single_process_only("pmap", "pmap maps over this process's devices only")
    params, losses = _run(update_parallel, stack_replicas(params, mesh), batches, learning_rate)
    return first_replica(params), _stack([v[0] for v in losses])


def shard_map(params: Params, batches: Iterable[dict], learning_rate: float, mesh: Mesh):
    params, losses = _run(shard_map_step(mesh), replicate(params, mesh), batches, learning_rate)
    return to_host(params), _stack(losses)


def single(params: Params, batches: Iterable[dict], learning_rate: float, mesh: Mesh):
    _single_process_only("single", "one device cannot hold another process's rows")
    device = mesh.devices.flat[0]
    step = lambda p, batch, lr: update(p, jax.device_put(batch, device), lr)
    params, losses = _run(step, on_device(params, device), batches, learning_rate)
    return to_host(params), _stack(losses)


def _run(step, params: Params, batches: Iterable[dict], learning_rate: float):
    losses = []
    for batch in batches:
        params, value = step(params, batch, learning_rate)
        # At most two steps in flight: wait for the previous one, not this one, so
        # the devices always have the next step queued. Unbounded async dispatch
        # while the loader's thread transfers batches deadlocked XLA's CPU
        # all-reduce (8 virtual devices, per-device batch 128: "only 6 of 8
        # threads arrived" after 40 s); it also bounds the memory of queued steps.
        if losses:
            losses[-1].block_until_ready()
        losses.append(value)
    return params, losses


STRATEGIES = {"sharded": sharded, "pmap": pmap, "shard_map": shard_map, "single": single}


@functools.lru_cache(maxsize=None)
def shard_map_step(mesh: Mesh):
    """The jit-compiled shard_map SGD step for ``mesh``: (params, batch, lr) -> (params, loss).

    Why this form is correct: with ``check_vma=True`` (the default), params enter
    replicated (``P()``) and JAX knows they are the same on every device. The
    gradient of a device-varying value with respect to such an input is summed
    over devices automatically (the transpose of the implicit broadcast is a
    psum). So we differentiate the *global* loss, psum(numerator) /
    psum(count), and the automatic sum adds each device's share exactly once.
    The trap is porting pmap's ``grad(local mean loss)`` then ``pmean(grads)``:
    the automatic psum has already summed n per-device means, pmean of that
    replicated sum changes nothing, and training runs with n times the gradient.
    """
    def step(params, batch, learning_rate):
        def global_loss(p):
            total, count = loss_terms(p, batch)
            return lax.psum(total, AXIS) / jnp.maximum(lax.psum(count, AXIS), 1.0)
        value, grads = jax.value_and_grad(global_loss)(params)
        return sgd(params, grads, learning_rate), value

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(AXIS), P()), out_specs=(P(), P())))


def _stack(values: list) -> np.ndarray:
    # addressable_data: in a multi-process run a replicated scalar spans devices
    # of other processes, but this process holds a full copy of it.
    return np.asarray([np.asarray(v.addressable_data(0)) for v in values], np.float32).reshape(-1)


def _single_process_only(name: str, why: str) -> None:
    if jax.process_count() > 1:
        raise ValueError(f"strategy {name!r} runs in one process only ({why}); with "
                         f"{jax.process_count()} processes use 'sharded' or 'shard_map'")
