"""Four ways to run the same data-parallel training, for any model and update rule.

Every strategy has one signature::

    strategy(params, batches, mesh, *, loss_terms, optimizer=sgd(0.001), opt_state=None)
        -> Trained(params, losses, opt_state)

* ``params``: any pytree of float arrays (a list of (w, b), a dict, ...). In and
  out they are host-side (NumPy), and so is ``opt_state``, so epochs chain by
  passing both back in and no strategy keeps hidden state.
* ``loss_terms(params, batch) -> (total, count)``: the model, as a pure
  function passed in (never looked up in another module): ``total`` the sum of
  the per-sample losses over the batch's real (mask-True) slots, ``count`` the
  number of real slots, both float scalars. Every strategy minimises the
  *global* masked mean, psum(total) / max(psum(count), 1), so a device holding
  only padding changes nothing.
* ``optimizer``: an ``Optimizer`` pair of pure functions, as in optax:
  ``init(params) -> state`` and ``update(grads, state, params) -> (params,
  state)``. The default is the notebooks' plain SGD, ``sgd(0.001)``, whose
  state holds the learning rate (so one compiled step serves every rate).
  ``opt_state`` None means ``optimizer.init(params)``.
* ``batches``: any iterable of batch dicts in the strategy's ``LAYOUT`` with at
  least "labels" and "mask" (whatever else ``loss_terms`` reads, e.g.
  "images"), as ``loaders.make_loader`` yields them.
* ``losses`` (steps,) float32: each step's global masked loss, computed before
  that step's update. The mesh is one axis named 'data' (loaders.data_mesh).

The strategies:

* ``sharded``: the notebooks' automatic parallelisation. Params replicated
  (``NamedSharding(mesh, P())``), the batch sharded on 'data', a plain jit
  step; XLA partitions the computation and adds the sums.
* ``pmap``: params stacked on a leading device axis, batches (n, B, ...).
  pmap is in maintenance mode in current JAX.
* ``shard_map``: pmap's modern replacement, ``jax.shard_map`` with explicit
  collectives.
* ``single``: the whole global batch on one device each step; the oracle the
  others are compared with.

Writing your own loop: build a step ``step(state, batch) -> (state, value)``
(for example ``sharded_step(loss_terms, optimizer.update)``, or your own jitted
function) and drive it with ``train_loop(step, state, batches)``, which keeps at
most two steps in flight (see there: the guard against a deadlock of XLA's CPU
all-reduce); ``stack_losses`` reads the values afterwards.

Guarantees (test_equivalence.py), after the same steps on the same global
batches, masks included, at matmul precision "highest", with SGD: every pair of
strategies ends within ``ulp_bound`` float32 ulps per step of each other (0:
bit-identical), for every model tested (an MLP over images and a linear
softmax over float features). The bounds are stated for SGD, where each step
is p - lr * g; ``ulp_bound`` says how they are derived and what changes with a
stateful or non-linear optimizer (measured, not bounded).

Devices: every strategy runs on exactly the mesh's devices, in mesh order
(pmap is given them explicitly; single uses the mesh's first device), never
on JAX's default device or backend. Each batch is checked before its step: one in
the wrong layout, or on other devices than the mesh's, is refused with a
message naming what the strategy needs.

Needs only NumPy and JAX (0.7 or newer: ``jax.shard_map``); nothing of this
project. model.py's ``loss_terms`` is the notebooks' MLP to pass in.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXIS = "data"  # the mesh axis the batch is sharded on (loaders.DATA_AXIS)
LAYOUT = {"sharded": "sharded", "pmap": "pmap", "shard_map": "sharded", "single": "sharded"}
NOTEBOOK_LEARNING_RATE = 0.001

Params = Any  # any pytree of float arrays
LossTerms = Callable[[Any, dict], tuple]  # (params, batch) -> (total over real slots, count)


# --------------------------------------------------------------------------
# The update rule: a pure pair, passed in
# --------------------------------------------------------------------------


class Optimizer(NamedTuple):
    """An update rule as two pure functions (optax's ``GradientTransformation`` shape,
    with the step applied inside ``update``):

    * ``init(params) -> state``: any pytree of arrays, built on the host;
    * ``update(grads, state, params) -> (new params, new state)``, traced inside
      the strategies' compiled steps, where ``grads`` is the gradient of the
      global masked mean loss, the same on every device.

    Compiled steps are cached on the ``update`` function's identity: keep
    hyperparameters in the state (as ``sgd`` does) rather than in a new
    closure per value, or every new value compiles again."""
    init: Callable[[Params], Any]
    update: Callable[[Params, Any, Params], tuple]


def sgd(learning_rate: float = NOTEBOOK_LEARNING_RATE) -> Optimizer:
    """Plain SGD, the notebooks' rule: ``p - lr * g`` per leaf, in the leaf's dtype.

    The state is ``{"learning_rate": float32 scalar}``: the rate is an input of the
    compiled step, not a constant baked into it."""
    rate = np.float32(learning_rate)
    return Optimizer(lambda params: {"learning_rate": rate}, sgd_update)


def sgd_update(grads: Params, state: dict, params: Params) -> tuple:
    """``sgd``'s update: (params - state["learning_rate"] * grads, state)."""
    rate = state["learning_rate"]
    return jax.tree.map(lambda p, g: p - rate.astype(p.dtype) * g, params, grads), state


class Trained(NamedTuple):
    """What a strategy returns: host params, (steps,) float32 losses, host optimizer state."""
    params: Params
    losses: np.ndarray
    opt_state: Any


# --------------------------------------------------------------------------
# Moving params (and optimizer state) between layouts (current APIs only)
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


def sharded(params: Params, batches: Iterable[dict], mesh: Mesh, *, loss_terms: LossTerms,
            optimizer: Optimizer = sgd(), opt_state=None) -> Trained:
    state = replicate((params, _init(optimizer, params, opt_state)), mesh)
    state, losses = train_loop(sharded_step(loss_terms, optimizer.update), state,
                               checked(batches, "sharded", mesh))
    return Trained(to_host(state[0]), stack_losses(losses), to_host(state[1]))


def pmap(params: Params, batches: Iterable[dict], mesh: Mesh, *, loss_terms: LossTerms,
         optimizer: Optimizer = sgd(), opt_state=None) -> Trained:
    _single_process_only("pmap", "pmap maps over this process's devices only")
    step = pmap_step(loss_terms, optimizer.update, tuple(mesh.devices.flat))
    state = stack_replicas((params, _init(optimizer, params, opt_state)), mesh)
    state, losses = train_loop(step, state, checked(batches, "pmap", mesh))
    return Trained(first_replica(state[0]), stack_losses([v[0] for v in losses]),
                   first_replica(state[1]))


def shard_map(params: Params, batches: Iterable[dict], mesh: Mesh, *, loss_terms: LossTerms,
              optimizer: Optimizer = sgd(), opt_state=None) -> Trained:
    state = replicate((params, _init(optimizer, params, opt_state)), mesh)
    state, losses = train_loop(shard_map_step(loss_terms, optimizer.update, mesh), state,
                               checked(batches, "shard_map", mesh))
    return Trained(to_host(state[0]), stack_losses(losses), to_host(state[1]))


def single(params: Params, batches: Iterable[dict], mesh: Mesh, *, loss_terms: LossTerms,
           optimizer: Optimizer = sgd(), opt_state=None) -> Trained:
    _single_process_only("single", "one device cannot hold another process's rows")
    device = mesh.devices.flat[0]
    jitted = sharded_step(loss_terms, optimizer.update)
    step = lambda state, batch: jitted(state, jax.device_put(batch, device))
    state = on_device((params, _init(optimizer, params, opt_state)), device)
    state, losses = train_loop(step, state, checked(batches, "single", mesh))
    return Trained(to_host(state[0]), stack_losses(losses), to_host(state[1]))


STRATEGIES = {"sharded": sharded, "pmap": pmap, "shard_map": shard_map, "single": single}


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
                f"features (n, B, ...); make_loader(..., layout='pmap')), got labels of shape "
                f"{shape} at step {step}")
        if layout == "sharded" and len(shape) != 1:
            raise ValueError(
                f"strategy {strategy!r} needs batches in layout 'sharded' (labels (n*B,), features "
                f"(n*B, ...); make_loader(..., layout='sharded')), got labels of shape {shape} "
                f"at step {step}")
        if isinstance(labels, jax.Array) and labels.sharding.device_set != devices:
            raise ValueError(
                f"strategy {strategy!r}: the batch at step {step} lives on "
                f"{sorted(str(d) for d in labels.sharding.device_set)}, not on the mesh's devices "
                f"{[str(d) for d in mesh.devices.flat]}")
        yield batch


# --------------------------------------------------------------------------
# The training loop: the way to write your own
# --------------------------------------------------------------------------


def train_loop(step: Callable, state, batches: Iterable) -> tuple[Any, list]:
    """Runs ``state, value = step(state, batch)`` over ``batches``; returns (state, [value, ...]).

    At most two steps are in flight: before step s is dispatched, step s - 2 has
    finished (this waits on the value of step s - 1 only after dispatching s, so
    the devices always have the next step queued). Unbounded asynchronous
    dispatch while a loader's thread transfers batches deadlocked XLA's CPU
    all-reduce (8 virtual devices, per-device batch 128: "only 6 of 8 threads
    arrived" after 40 s); the bound also caps the memory of queued steps. The
    values (any pytree of arrays) are returned unread: read them after the loop
    (``stack_losses``), since reading one inside it waits for its step.

    Use it for your own loop: ``step`` is any function of (state, batch), e.g.
    ``sharded_step(loss_terms, optimizer.update)`` with state = (params,
    opt_state) replicated on the mesh (``replicate``), or your own jitted step."""
    values = []
    for batch in batches:
        state, value = step(state, batch)
        if values:
            jax.block_until_ready(values[-1])
        values.append(value)
    return state, values


def stack_losses(values: list) -> np.ndarray:
    """Scalar step values (replicated or single-device jax.Arrays) as a host (steps,) float32 array.

    Reads ``addressable_data(0)``: in a multi-process run a replicated scalar spans
    other processes' devices, but this process holds a full copy of it."""
    return np.asarray([np.asarray(v.addressable_data(0)) if isinstance(v, jax.Array) else np.asarray(v)
                       for v in values], np.float32).reshape(-1)


# --------------------------------------------------------------------------
# How far apart the strategies may end: the bounds, in one place
# --------------------------------------------------------------------------


def ulp_bound(a: str, b: str, platform: str, num_devices: int) -> int:
    """Float32 ulps per training step that strategies ``a`` and ``b`` may end apart, with SGD.

    The unit is the ulp of each param leaf's largest magnitude (``ulps_apart``):
    a reordered gradient sum is off relative to the size of its terms, not of
    its result, so an entry near zero can differ by more than its own ulp. The
    bounds hold at matmul precision "highest" (what the tests set). At NVIDIA's
    default for float32 matmuls, TF32, each dot rounds its inputs to 10-bit
    mantissas and the strategies drift apart by about 1e-3 relative: far more.

    How they are derived. Each SGD step computes p - lr * g from the same global
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

    Only for SGD. The count above relies on p - lr * g moving each step's
    rounding difference into the params once. Measured on 8 CPU devices (JAX
    0.10.2, ``python test_equivalence.py drift``: 42 random runs of 1-8 steps
    with uneven masks, the MLP and the linear model, rates 1e-3 to 0.1), in
    ulps a step:

    * SGD, for comparison: pmap vs shard_map 0, sharded vs them <= 0.33, any vs
      single <= 1.0.
    * momentum (v = 0.9 v + g, p -= lr v; stateful, linear in g): the same
      figures (0, 0, <= 1.0). The SGD bound does not carry over, though: a step's
      gradient difference stays in the velocity and reaches the params again
      at every later step, with total weight up to 1 / (1 - beta), so the same
      counting gives ``ulp_bound / (1 - beta)`` a step (20 here, against
      single); test_equivalence.py holds momentum to that.
    * Adam (non-linear: each entry divided by its own running magnitude): no
      pair stays bit-identical: pmap vs shard_map up to 74 (the update's
      element-wise arithmetic is compiled into each program separately; not
      investigated further), sharded vs pmap 14, any vs single up to 734 on the
      MLP, where an entry whose gradient is rounding noise moves by about the
      learning rate whichever way the noise falls. In absolute terms they
      stayed within 4.4e-4 * lr a step of each other (test_equivalence.py
      allows 1e-3 * lr on the linear model). No bound is derived for Adam.
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


# --------------------------------------------------------------------------
# The compiled steps, one per (model, update rule, devices)
# --------------------------------------------------------------------------


def _mean_loss(loss_terms: LossTerms) -> Callable:
    def mean(params, batch):
        total, count = loss_terms(params, batch)
        return total / jnp.maximum(count, 1.0)
    return mean


@functools.lru_cache(maxsize=64)
def sharded_step(loss_terms: LossTerms, update: Callable) -> Callable:
    """jit of one step on state (params, opt_state): (state, batch) -> (state, loss).

    On replicated state and a batch sharded on 'data' (``sharded``) XLA adds the
    cross-device sums; on one device (``single``) it is the plain step."""
    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(_mean_loss(loss_terms))(params, batch)
        return update(grads, opt_state, params), value
    return jax.jit(step)


@functools.lru_cache(maxsize=64)
def pmap_step(loss_terms: LossTerms, update: Callable, devices: tuple) -> Callable:
    """The pmap step over exactly ``devices``, in that order (one per mesh position).

    Takes state (params, opt_state) stacked (n, ...) and a batch (n, B, ...);
    returns (new state (n, ...), global masked loss (n,)), every replica equal,
    on the same devices. The denominator is the real-sample count of the whole
    global batch; it does not depend on params, so each device back-propagates
    1/count through its own total and the per-device gradients simply add up
    (psum). The notebooks' ``pmean(grads)`` of per-device means is that gradient
    only when every device holds the same number of real samples. A pmap
    without ``devices=`` would map over the default backend's first n devices,
    whatever devices its inputs live on."""
    return jax.pmap(_parallel_step(loss_terms, update), axis_name=AXIS, devices=list(devices))


def _parallel_step(loss_terms: LossTerms, update: Callable) -> Callable:
    """pmap_step's per-device function (uncompiled): collectives over axis 'data'."""
    def step(state, batch):
        params, opt_state = state
        total, vjp, count = jax.vjp(lambda p: loss_terms(p, batch), params, has_aux=True)
        denominator = jnp.maximum(lax.psum(count, AXIS), 1.0)
        grads = lax.psum(vjp(1.0 / denominator)[0], AXIS)
        return update(grads, opt_state, params), lax.psum(total, AXIS) / denominator
    return step


@functools.lru_cache(maxsize=64)
def shard_map_step(loss_terms: LossTerms, update: Callable, mesh: Mesh) -> Callable:
    """The jit-compiled shard_map step for ``mesh``: (state, batch) -> (state, loss).

    Why this form is correct: with ``check_vma=True`` (the default), the state
    enters replicated (``P()``) and JAX knows it is the same on every device. The
    gradient of a device-varying value with respect to such an input is summed
    over devices automatically (the transpose of the implicit broadcast is a
    psum). So we differentiate the *global* loss, psum(total) / psum(count), and
    the automatic sum adds each device's share exactly once. The trap is porting
    pmap's ``grad(local mean loss)`` then ``pmean(grads)``: the automatic psum
    has already summed n per-device means, pmean of that replicated sum changes
    nothing, and training runs with n times the gradient.
    """
    def step(state, batch):
        params, opt_state = state

        def global_loss(p):
            total, count = loss_terms(p, batch)
            return lax.psum(total, AXIS) / jnp.maximum(lax.psum(count, AXIS), 1.0)
        value, grads = jax.value_and_grad(global_loss)(params)
        return update(grads, opt_state, params), value

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=(P(), P())))


def _init(optimizer: Optimizer, params: Params, opt_state):
    return optimizer.init(params) if opt_state is None else opt_state


def _single_process_only(name: str, why: str) -> None:
    if jax.process_count() > 1:
        raise ValueError(f"strategy {name!r} runs in one process only ({why}); with "
                         f"{jax.process_count()} processes use 'sharded' or 'shard_map'")
