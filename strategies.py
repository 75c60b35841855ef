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
batches, masks included, at matmul precision "highest": every pair of
strategies ends within ``ulp_bound`` float32 ulps per step of each other (0:
bit-identical). The bounds, chosen by platform here and nowhere else, and
why (``ulp_bound`` says how they are derived).

Devices: every strategy runs on exactly the mesh's devices, in mesh order
(pmap is given them explicitly; single uses the mesh's first device), never
on JAX's default device or backend. Each batch is checked before its step: one in
the wrong layout, or on other devices than the mesh's, is refused with a
message naming what the strategy needs.

Needs model.py (the MLP and its update steps); nothing else of this project.
"""

from __future__ import annotations

import functools
from typing import Iterable, Iterator

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
    batches = checked(batches, "sharded", mesh)
    params, losses = _run(update, replicate(params, mesh), batches, learning_rate)
    return to_host(params), _stack(losses)


def pmap(params: Params, batches: Iterable[dict], learning_rate: float, mesh: Mesh):
    _single_process_only("pmap", "pmap maps over this process's devices only")
    step = update_parallel(tuple(mesh.devices.flat))
    params, losses = _run(step, stack_replicas(params, mesh), checked(batches, "pmap", mesh),
                          learning_rate)
    return first_replica(params), _stack([v[0] for v in losses])


def shard_map(params: Params, batches: Iterable[dict], learning_rate: float, mesh: Mesh):
    batches = checked(batches, "shard_map", mesh)
    params, losses = _run(shard_map_step(mesh), replicate(params, mesh), batches, learning_rate)
    return to_host(params), _stack(losses)


def single(params: Params, batches: Iterable[dict], learning_rate: float, mesh: Mesh):
    _single_process_only("single", "one device cannot hold another process's rows")
    device = mesh.devices.flat[0]
    step = lambda p, batch, lr: update(p, jax.device_put(batch, device), lr)
    params, losses = _run(step, on_device(params, device), checked(batches, "single", mesh),
                          learning_rate)
    return to_host(params), _stack(losses)


def checked(batches: Iterable[dict], strategy: str, mesh: Mesh) -> Iterator[dict]:
    """``batches``, each checked to be in ``strategy``'s layout and on the mesh's devices.

    Raises ValueError naming the layout the strategy needs: "sharded" labels are
    (n*B,) and "pmap" labels (n, B), n the mesh's device count."""
    layout, n = LAYOUT[strategy], mesh.devices.size
    devices = set(mesh.devices.flat)
    for step, batch in enumerate(batches):
        labels = batch["labels"]
        shape = tuple(labels.shape)
        if layout == "pmap" and (len(shape) != 2 or shape[0] != n):
            raise ValueError(
                f"strategy {strategy!r} needs batches in layout 'pmap' (labels (n, B) = ({n}, B), "
                f"images (n, B, C, H, W); make_loader(..., layout='pmap')), got labels of shape "
                f"{shape} at step {step}")
        if layout == "sharded" and len(shape) != 1:
            raise ValueError(
                f"strategy {strategy!r} needs batches in layout 'sharded' (labels (n*B,), images "
                f"(n*B, C, H, W); make_loader(..., layout='sharded')), got labels of shape {shape} "
                f"at step {step}")
        if isinstance(labels, jax.Array) and labels.sharding.device_set != devices:
            raise ValueError(
                f"strategy {strategy!r}: the batch at step {step} lives on "
                f"{sorted(str(d) for d in labels.sharding.device_set)}, not on the mesh's devices "
                f"{[str(d) for d in mesh.devices.flat]}")
        yield batch


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


# --------------------------------------------------------------------------
# How far apart the strategies may end: the bounds, in one place
# --------------------------------------------------------------------------


def ulp_bound(a: str, b: str, platform: str, num_devices: int) -> int:
    """Float32 ulps per training step that strategies ``a`` and ``b`` may end apart.

    The unit is the ulp of each param leaf's largest magnitude (``ulps_apart``):
    a reordered gradient sum is off relative to the size of its terms, not of
    its result, so an entry near zero can differ by more than its own ulp. The
    bounds hold at matmul precision "highest" (what the tests set). At NVIDIA's
    default for float32 matmuls, TF32, each dot rounds its inputs to 10-bit
    mantissas and the strategies drift apart by about 1e-3 relative: far more.

    How they are derived. Each step computes p - lr * g from the same global
    masked gradient g; two strategies differ only in the order in which some
    stage adds g's terms. The rule used: every stage whose summation order
    differs can move the once-rounded result p - lr * g to a neighbouring float,
    1 ulp per stage and step; an all-reduce whose order the collective library
    chooses (NCCL, RCCL) is n - 1 such stages. This counts roundings: it is a
    model, checked against measurement below, not a worst-case proof (a
    worst-case bound for an m-term sum, (m - 1) ulps of its largest partial sum,
    is tens of ulps here and would hide real bugs). Counting:

    * same program, same kernels (pmap and shard_map: since JAX 0.8 pmap is jit
      of shard_map, with the same explicit psum): no stage differs, 0 on CPU; on
      GPUs the all-reduce order may differ between two programs, n.
    * sharded vs pmap/shard_map: XLA partitions the jit step itself and may pick
      other local dot kernels, so the per-device B-term sums may be added in
      another order: 1 on CPU; n on GPUs (the all-reduce as well).
    * any vs single: single adds the n*B terms in one pass, the others B per
      device, then n partial sums: two stages differ, 2 on CPU; on GPUs the
      all-reduce adds n - 1 more, n + 1.

    Measured on CPU (JAX 0.10.2, 30 random runs of 1-8 steps with uneven masks):
    pmap vs shard_map 0, sharded vs them <= 0.5, any vs single <= 1.0 a step.
    GPU bounds are derived only; they have not been measured.
    """
    pair = frozenset((a, b))
    cpu = platform == "cpu"
    n = num_devices
    if len(pair) == 1:
        return 0
    if "single" in pair:
        return 2 if cpu else n + 1
    if pair == {"pmap", "shard_map"}:
        return 0 if cpu else n
    return 1 if cpu else n


def ulps_apart(a: Params, b: Params) -> float:
    """Largest |a - b| over all leaves, in float32 ulps of each leaf's largest magnitude."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        unit = np.spacing(np.float32(max(np.abs(x).max(), np.abs(y).max())))
        worst = max(worst, float(np.abs(x.astype(np.float64) - y).max() / unit))
    return worst


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
