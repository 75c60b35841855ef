"""Four ways to run the same data-parallel training, for any model and update rule.

Every strategy has one signature::

    strategy(params, batches, mesh, *, loss_terms, optimizer=sgd(0.001), opt_state=None,
             reduction="plain", logical_shards=None) -> Trained(params, losses, opt_state)

* ``params``: any pytree of float arrays (a list of (w, b), a dict, ...). In and
  out they are host-side (NumPy), and so is ``opt_state``, so epochs chain by
  passing both back in and no strategy keeps hidden state. The arrays passed in
  are copied, never consumed. A leaf whose dtype JAX would change (float64 while
  ``jax_enable_x64`` is off) is refused, naming the leaf and the two fixes; with
  x64 on, float64 params train in float64.
* ``loss_terms(params, batch) -> (total, count)``: the model, as a pure
  function passed in (never looked up in another module): ``total`` the sum of
  the per-sample losses over the batch's real (mask-True) slots, a float
  scalar, and ``count`` the number of real slots, a scalar. Every strategy
  minimises the *global* masked mean, psum(total) / max(psum(count), 1), so a
  device holding only padding changes nothing. Anything else (a mean, one
  array, a (B,) vector) is refused with this contract in the message.
* ``optimizer``: anything with optax's ``GradientTransformation`` contract, an
  optax optimizer itself (``optax.adam(1e-3)``, ``optax.chain(...)``) or this
  module's ``Optimizer``: ``init(params) -> state`` and ``update(grads, state,
  params) -> (updates, new state)``; the strategies then apply ``params +
  updates`` per leaf, cast to the leaf's dtype (``optax.apply_updates``'
  arithmetic). ``grads`` is the gradient of the global masked mean, the same on
  every device. The default is the notebooks' plain SGD, ``sgd(0.001)``, which
  needs nothing but JAX. ``opt_state`` None means ``optimizer.init(params)``
  (run on the mesh's first local device); a state passed in is the one used.
* ``batches``: any iterable of batch dicts in the strategy's ``LAYOUT``, with a
  "mask" (bool: (n*B,) in layout "sharded", (n, B) in "pmap") and whatever
  ``loss_terms`` reads. The layout is told from "mask" alone. Each batch is
  checked before its step (``checked``): jax.Arrays must be sharded on 'data'
  over exactly the mesh's devices (``loaders.make_loader`` yields them so);
  NumPy arrays are placed there in one process (``jax.device_put`` with
  ``NamedSharding(mesh, P('data'))``, the line a caller would write) and
  refused across processes, where a host array could be the whole batch or
  this process's rows.
* ``losses`` (steps,): each step's global masked loss, computed before that
  step's update, in the loss's dtype (float32 for float32 params). The mesh is
  one axis named 'data' (loaders.data_mesh).
* ``reduction``: how a step's gradient is summed. "plain" (the default, the
  notebooks'): each device's gradient, added across devices in the order the
  collective picks; strategies and topologies then end apart by rounding, within
  the bound equivalence.py measures. "canonical": the global batch is
  ``logical_shards`` = L blocks of equal rows (default: one a device), each block's
  gradient sum is computed by one program of one shape, the L sums are added in one
  fixed order and divided by the step's global count of real samples, and the update
  runs in a program of its own (``canonical_step``): the params, the optimizer state
  and the losses are then the same bits on every mesh whose device count divides L,
  in one process or several, through every strategy, and on one device adding the
  L blocks as microbatches (``single``), at any learning rate. Feed it a loader with
  the same logical shards (``loaders.make_loader(..., logical_shards=L)``), whose
  global batch is the same on any such mesh. Cost: bench.py's canonical/plain table.

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
function) and drive it with ``train_loop(step, state, batches, callback)``,
which keeps at most two steps in flight (see there: the guard against a
deadlock of XLA's CPU all-reduce) and hands each finished step's value to the
callback; ``stack_losses`` stacks the values afterwards. On accelerators the
compiled steps donate the state they replace (``donate_argnums``), so params and
optimizer state are not held twice: the state passed to a step is consumed. On
CPU devices they do not: XLA's CPU compiler keeps a copy for a donated state, so
the peak stays the same and the copy costs time (``donates``).

Guarantees (test_strategies.py and test_equivalence.py), after the same steps on
the same global batches, masks included, at matmul precision "highest": with
reduction="canonical", the same bits on every topology, every strategy, every
optimizer and rate tested (ReLU and attention models; SGD, Adam, AdamW with
clipping; chaotic rates), across processes too; with the plain reduction, every
pair of strategies ends within the bound equivalence.py derives
(``equivalence.verdict``), a model checked by measurement, not a proof. Every
strategy's plain step computes its gradient in a program of its own and shares one
update program (``apply_program``).

Devices: every strategy runs on exactly the mesh's devices, in mesh order
(pmap is given them explicitly; single uses the mesh's first device), never
on JAX's default device or backend.

Imports: NumPy and JAX only (0.7 or newer: ``jax.shard_map``); nothing of this
project, and not optax (its optimizers are accepted, never imported). Imported by
equivalence.py, refimpl.py and bench.py.
model.py's ``loss_terms`` is the notebooks' MLP to pass in.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

AXIS = "data"  # the mesh axis the batch is sharded on (loaders.DATA_AXIS)
LAYOUT = {"sharded": "sharded", "pmap": "pmap", "shard_map": "sharded", "single": "sharded"}
NOTEBOOK_LEARNING_RATE = 0.001

Params = Any  # any pytree of float arrays
LossTerms = Callable[[Any, dict], tuple]  # (params, batch) -> (total over real slots, count)

LOSS_TERMS_CONTRACT = ("loss_terms(params, batch) must return (total, count): total the sum of the "
                       "per-sample losses over the batch's real (mask-True) slots, a float scalar, and "
                       "count the number of real slots, a scalar; the strategies divide the global "
                       "psum(total) by psum(count)")
OPTIMIZER_CONTRACT = ("optimizer.update(grads, state, params) must return (updates, new_state) as optax "
                      "does: updates with the params' tree structure and shapes (the strategies apply "
                      "params + updates), new_state with the state's structure")


# --------------------------------------------------------------------------
# The update rule: optax's contract, a pure pair passed in
# --------------------------------------------------------------------------


class Optimizer(NamedTuple):
    """An update rule as two pure functions, with optax's ``GradientTransformation`` contract:

    * ``init(params) -> state``: any pytree of arrays;
    * ``update(grads, state, params) -> (updates, new state)``, traced inside the
      strategies' compiled steps; the strategies then apply ``params + updates``.

    Any optax optimizer has this contract and is accepted as it is. Compiled steps
    are cached on the ``update`` function's identity: keep hyperparameters in the
    state (as ``sgd`` does) rather than in a new closure per value, or every new
    value compiles again (an optax optimizer compiles once per ``optax.adam(...)``
    call, so build it once)."""
    init: Callable[[Params], Any]
    update: Callable[[Params, Any, Params], tuple]


def sgd(learning_rate: float = NOTEBOOK_LEARNING_RATE) -> Optimizer:
    """Plain SGD, the notebooks' rule: updates ``-(lr * g)`` per leaf, in the leaf's dtype.

    Applied as ``p + (-(lr * g))``, which is ``p - lr * g`` bit for bit (IEEE
    subtraction is addition of the negation), the notebooks' step; ``optax.sgd(lr)``
    computes the same updates. The state is ``{"learning_rate": float32 scalar}``:
    the rate is an input of the compiled step, not a constant baked into it."""
    rate = np.float32(learning_rate)
    return Optimizer(lambda params: {"learning_rate": rate}, sgd_update)


def sgd_update(grads: Params, state: dict, params: Params = None) -> tuple:
    """``sgd``'s update: (-(state["learning_rate"] * grads) per leaf, state)."""
    rate = state["learning_rate"]
    return jax.tree.map(lambda g: -(rate.astype(g.dtype) * g), grads), state


def apply_updates(params: Params, updates: Params) -> Params:
    """``p + u`` per leaf, cast back to p's dtype: ``optax.apply_updates``' arithmetic."""
    return jax.tree.map(lambda p, u: jnp.asarray(p + u).astype(jnp.asarray(p).dtype), params, updates)


class Trained(NamedTuple):
    """What a strategy returns: host params, (steps,) losses, host optimizer state."""
    params: Params
    losses: np.ndarray
    opt_state: Any


# --------------------------------------------------------------------------
# Moving params (and optimizer state) between layouts (current APIs only)
# --------------------------------------------------------------------------


def replicate(params: Params, mesh: Mesh) -> Params:
    """Every leaf copied to every device of ``mesh``: ``NamedSharding(mesh, P())``.

    Replaces the removed ``jax.device_put_replicated`` for jit code. Each process
    fills only its own devices, so this also works across processes (every
    process must pass the same values). The arrays passed in are copied (the
    compiled steps may consume the result); a 64-bit leaf JAX would narrow is
    refused (``check_dtypes``)."""
    check_dtypes(params, "strategies.replicate")
    sharding = NamedSharding(mesh, P())

    def put(leaf):
        leaf = np.array(leaf)
        return jax.make_array_from_callback(leaf.shape, sharding, lambda index: leaf[index])

    return jax.tree.map(put, params)


def stack_replicas(params: Params, mesh: Mesh) -> Params:
    """Every leaf as (n, ...) with one copy per device, sharded on axis 0: pmap's layout.

    Built from per-device copies, so in a multi-process run each process supplies
    only its own devices' copies."""
    check_dtypes(params, "strategies.stack_replicas")
    sharding = NamedSharding(mesh, P(AXIS))
    devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]

    def stack(leaf):
        leaf = np.array(leaf)
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
    """Params copied onto one device (e.g. for single-device validation); never an alias
    of the arrays passed in, which the compiled steps may consume."""
    check_dtypes(params, "strategies.on_device")
    return jax.device_put(jax.tree.map(np.array, params), device)


def check_dtypes(tree, where: str) -> None:
    """Raises ValueError naming the leaf if JAX would silently change a leaf's dtype:
    a 64-bit NumPy or JAX array or NumPy scalar (float64, int64, complex128) while
    ``jax_enable_x64`` is off, which JAX narrows to 32 bits. Python's own scalars
    (exactly bool, int, float, complex) are weakly typed (JAX's own rules) and pass;
    ``np.float64(1.0)`` is not one of them, although it is a subclass of float (and
    ``np.complex128`` of complex), and is refused like a float64 array."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or type(leaf) in (bool, int, float, complex):
            continue
        narrowed = jax.dtypes.canonicalize_dtype(dtype)
        if narrowed != dtype:
            raise ValueError(
                f"{where}: leaf {jax.tree_util.keystr(path) or '(root)'} is {np.dtype(dtype).name}, which "
                f"JAX would silently train as {np.dtype(narrowed).name} because jax_enable_x64 is off; "
                f"cast it (np.asarray(leaf, np.{np.dtype(narrowed).name})) or turn 64-bit on first "
                f"(jax.config.update('jax_enable_x64', True)) to train in {np.dtype(dtype).name}")


# --------------------------------------------------------------------------
# The strategies
# --------------------------------------------------------------------------


def sharded(params: Params, batches: Iterable[dict], mesh: Mesh, *, loss_terms: LossTerms,
            optimizer: Optimizer = sgd(), opt_state=None, reduction: str = "plain",
            logical_shards: int | None = None) -> Trained:
    L = _reduction("sharded", reduction, logical_shards, mesh)
    state = replicate(start_state("sharded", optimizer, params, opt_state, mesh), mesh)
    step = (sharded_step(loss_terms, optimizer.update) if reduction == "plain"
            else canonical_step(loss_terms, optimizer.update, mesh, L))
    state, losses = train_loop(step, state, checked(batches, "sharded", mesh, L))
    return Trained(to_host(state[0]), stack_losses(losses), to_host(state[1]))


def pmap(params: Params, batches: Iterable[dict], mesh: Mesh, *, loss_terms: LossTerms,
         optimizer: Optimizer = sgd(), opt_state=None, reduction: str = "plain",
         logical_shards: int | None = None) -> Trained:
    _single_process_only("pmap", "pmap maps over this process's devices only")
    L = _reduction("pmap", reduction, logical_shards, mesh)
    state = start_state("pmap", optimizer, params, opt_state, mesh)
    if reduction == "canonical":  # the canonical step's programs, on batches (n, B, ...)
        state, losses = train_loop(canonical_step(loss_terms, optimizer.update, mesh, L),
                                   replicate(state, mesh), checked(batches, "pmap", mesh, L))
        return Trained(to_host(state[0]), stack_losses(losses), to_host(state[1]))
    step = pmap_step(loss_terms, optimizer.update, tuple(mesh.devices.flat))
    state, losses = train_loop(step, stack_replicas(state, mesh), checked(batches, "pmap", mesh))
    return Trained(first_replica(state[0]), stack_losses([v[0] for v in losses]),
                   first_replica(state[1]))


def shard_map(params: Params, batches: Iterable[dict], mesh: Mesh, *, loss_terms: LossTerms,
              optimizer: Optimizer = sgd(), opt_state=None, reduction: str = "plain",
              logical_shards: int | None = None) -> Trained:
    L = _reduction("shard_map", reduction, logical_shards, mesh)
    state = replicate(start_state("shard_map", optimizer, params, opt_state, mesh), mesh)
    step = (shard_map_step(loss_terms, optimizer.update, mesh) if reduction == "plain"
            else canonical_step(loss_terms, optimizer.update, mesh, L))
    state, losses = train_loop(step, state, checked(batches, "shard_map", mesh, L))
    return Trained(to_host(state[0]), stack_losses(losses), to_host(state[1]))


def single(params: Params, batches: Iterable[dict], mesh: Mesh, *, loss_terms: LossTerms,
           optimizer: Optimizer = sgd(), opt_state=None, reduction: str = "plain",
           logical_shards: int | None = None) -> Trained:
    _single_process_only("single", "one device cannot hold another process's rows")
    L = _reduction("single", reduction, logical_shards, mesh)
    device = mesh.devices.flat[0]
    if reduction == "plain":
        jitted = sharded_step(loss_terms, optimizer.update)
    else:  # one device adds its L logical blocks as microbatches
        # The mesh loaders.data_mesh([device]) builds (Auto axes), so a step compiled for it is reused.
        jitted = canonical_step(loss_terms, optimizer.update,
                                Mesh(np.array([device]), (AXIS,), axis_types=(AxisType.Auto,)), L)
    step = lambda state, batch: jitted(state, jax.device_put(batch, device))
    state = on_device(start_state("single", optimizer, params, opt_state, mesh), device)
    state, losses = train_loop(step, state, checked(batches, "single", mesh, L))
    return Trained(to_host(state[0]), stack_losses(losses), to_host(state[1]))


STRATEGIES = {"sharded": sharded, "pmap": pmap, "shard_map": shard_map, "single": single}
REDUCTIONS = ("plain", "canonical")


def _reduction(name: str, reduction: str, logical_shards, mesh: Mesh) -> int | None:
    """The canonical reduction's L (``logical_shards``, default the mesh's device count),
    checked; None for the plain reduction, which takes no logical shards."""
    n = mesh.devices.size
    if reduction not in REDUCTIONS:
        raise ValueError(f"strategy {name!r}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if reduction == "plain":
        if logical_shards is not None:
            raise ValueError(f"strategy {name!r}: logical_shards={logical_shards!r} needs "
                             f"reduction='canonical' (the plain reduction adds whatever each device "
                             f"holds, in the order its collective picks)")
        return None
    L = n if logical_shards is None else logical_shards
    if isinstance(L, (bool, np.bool_)) or not isinstance(L, (int, np.integer)) or L < 1 or L % n:
        raise ValueError(f"strategy {name!r}: logical_shards={logical_shards!r} must be an int that "
                         f"the mesh's {n} device(s) divide")
    return int(L)


def checked(batches: Iterable[dict], strategy: str, mesh: Mesh,
            logical_shards: int | None = None) -> Iterator[dict]:
    """``batches``, each checked to be in ``strategy``'s layout and on the mesh, host leaves placed.

    The layout is told from "mask": (n*B,) in layout "sharded", (n, B) in "pmap",
    n the mesh's device count. Every jax.Array leaf must be sharded on 'data' over
    exactly the mesh's devices (``NamedSharding(mesh, P('data'))`` or equivalent);
    NumPy leaves are placed so in one process (``single`` moves them to its device
    directly) and refused across processes. With ``logical_shards`` L (the canonical
    reduction) the global batch's rows must split into L equal blocks, each device's
    into L/n. Raises ValueError naming the strategy, the step, the key and what the
    strategy needs."""
    layout, n = LAYOUT[strategy], mesh.devices.size
    devices = set(mesh.devices.flat)
    want = NamedSharding(mesh, P(AXIS))
    for step, batch in enumerate(batches):
        if not isinstance(batch, dict) or "mask" not in batch:
            raise ValueError(f"strategy {strategy!r}: the batch at step {step} has no 'mask' (a dict "
                             f"with a bool 'mask', (n*B,) or (n, B), is what loaders.make_loader "
                             f"yields); got {type(batch).__name__}"
                             + (f" with keys {sorted(batch)}" if isinstance(batch, dict) else ""))
        shape = tuple(np.shape(batch["mask"]))
        if layout == "pmap" and (len(shape) != 2 or shape[0] != n):
            raise ValueError(
                f"strategy {strategy!r} needs batches in layout 'pmap' (mask (n, B) = ({n}, B), "
                f"every other key (n, B, ...); make_loader(..., layout='pmap')), got a mask of shape "
                f"{shape} at step {step}")
        if layout == "sharded" and len(shape) != 1:
            raise ValueError(
                f"strategy {strategy!r} needs batches in layout 'sharded' (mask (n*B,), every other "
                f"key (n*B, ...); make_loader(..., layout='sharded')), got a mask of shape {shape} "
                f"at step {step}")
        rows = shape[0] * (shape[1] if layout == "pmap" else 1)
        if logical_shards is not None and rows % logical_shards:
            raise ValueError(
                f"strategy {strategy!r}: the batch at step {step} has {rows} rows, which do not split "
                f"into logical_shards={logical_shards} blocks of one size (the canonical reduction "
                f"adds one gradient sum per logical block)")
        placed = {}
        for key, leaf in batch.items():
            if not isinstance(leaf, jax.Array):
                if jax.process_count() > 1:
                    raise ValueError(
                        f"strategy {strategy!r}: batch[{key!r}] at step {step} is a host array "
                        f"({type(leaf).__name__}); across {jax.process_count()} processes it could be "
                        f"the whole batch or this process's rows: build global arrays "
                        f"(loaders.global_batch_from_rows or jax.make_array_from_process_local_data)")
                placed[key] = leaf if strategy == "single" else jax.device_put(leaf, want)
                continue
            if leaf.sharding.device_set != devices:
                raise ValueError(
                    f"strategy {strategy!r}: batch[{key!r}] at step {step} lives on "
                    f"{sorted(str(d) for d in leaf.sharding.device_set)}, not on the mesh's devices "
                    f"{[str(d) for d in mesh.devices.flat]}")
            if n > 1 and not leaf.sharding.is_equivalent_to(want, leaf.ndim):
                raise ValueError(
                    f"strategy {strategy!r}: batch[{key!r}] at step {step} has sharding "
                    f"{leaf.sharding}, not NamedSharding(mesh, P('data')): every device would "
                    f"compute on rows it does not own (jax.device_put(x, NamedSharding(mesh, "
                    f"P('data'))) or make_loader places it right)")
            placed[key] = leaf
        yield placed


# --------------------------------------------------------------------------
# The training loop: the way to write your own
# --------------------------------------------------------------------------


def train_loop(step: Callable, state, batches: Iterable,
               callback: Callable[[int, Any], None] | None = None) -> tuple[Any, list]:
    """Runs ``state, value = step(state, batch)`` over ``batches``; returns (state, [value, ...]).

    At most two steps are in flight: before step s is dispatched, step s - 2 has
    finished (this waits on the value of step s - 1 only after dispatching s, so
    the devices always have the next step queued). Unbounded asynchronous
    dispatch while a loader's thread transfers batches deadlocked XLA's CPU
    all-reduce (8 virtual devices, per-device batch 128: "only 6 of 8 threads
    arrived" after 40 s); the bound also caps the memory of queued steps.

    ``callback(t, value)``, if given, is called once per step, in step order, with
    step t's value (any pytree of arrays) after it has finished, so reading it does
    not wait: for every step but the last, right after the loop has waited for
    step t, which is right after step t + 1 was dispatched (step t + 1 stays
    queued while the callback runs; the guard is unchanged); for the last step,
    after the batches are exhausted and the loop has waited for it. The values
    are also returned (``stack_losses`` stacks them).

    Use it for your own loop: ``step`` is any function of (state, batch), e.g.
    ``sharded_step(loss_terms, optimizer.update)`` with state = (params,
    opt_state) replicated on the mesh (``replicate``), or your own jitted step.
    The strategies' compiled steps consume (donate) the state passed in on
    accelerators (``donates``): keep only the state the loop returns."""
    values = []
    for batch in batches:
        state, value = step(state, batch)
        if values:
            jax.block_until_ready(values[-1])
            if callback is not None:
                callback(len(values) - 1, values[-1])
        values.append(value)
    if values and callback is not None:
        jax.block_until_ready(values[-1])
        callback(len(values) - 1, values[-1])
    return state, values


def stack_losses(values: list):
    """Step values stacked on the host: for values that are each a pytree (a scalar
    loss, a dict of metrics, ...) of one structure, that structure with every leaf a
    NumPy array (steps, *leaf shape) of the leaf's dtype; no values: (0,) float32.

    Each leaf is a replicated or single-device jax.Array (or a host array); its
    ``addressable_data(0)`` is read, so in a multi-process run this process's full
    copy of a replicated value is used. A leaf sharded over devices (pmap's (n,)
    values) is refused: pass one replica (``[v[0] for v in values]``)."""
    if not values:
        return np.zeros((0,), np.float32)

    def host(x):
        if isinstance(x, jax.Array):
            if not x.sharding.is_fully_replicated:
                raise ValueError(f"stack_losses: a value of shape {x.shape} is sharded ({x.sharding}), "
                                 f"not replicated: pass one replica, e.g. [v[0] for v in values]")
            return np.asarray(x.addressable_data(0))
        return np.asarray(x)

    return jax.tree.map(lambda *xs: np.stack([host(x) for x in xs]), *values)



# --------------------------------------------------------------------------
# The compiled steps, one per (model, update rule, devices)
# --------------------------------------------------------------------------


def checked_terms(loss_terms: LossTerms, params: Params, batch: dict) -> tuple:
    """``loss_terms(params, batch)``, its contract checked (at trace time)."""
    out = loss_terms(params, batch)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        if hasattr(out, "shape"):
            got = f"one array of shape {tuple(out.shape)}"
            got += " (a mean? return the sum and the count)" if out.shape == () else ""
        else:
            got = f"a {type(out).__name__}" + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else "")
        raise TypeError(f"{LOSS_TERMS_CONTRACT}; got {got}")
    total, count = out
    if jnp.shape(total) != () or jnp.shape(count) != ():
        raise TypeError(f"{LOSS_TERMS_CONTRACT}; got total of shape {jnp.shape(total)} and count of "
                        f"shape {jnp.shape(count)}")
    if not jnp.issubdtype(jnp.result_type(total), jnp.floating):
        raise TypeError(f"{LOSS_TERMS_CONTRACT}; got total of dtype {jnp.result_type(total)}")
    return total, count


def _updated(update: Callable, grads, opt_state, params) -> tuple:
    """(params + updates, new state) from ``update``, its contract checked (at trace time)."""
    out = update(grads, opt_state, params)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(f"{OPTIMIZER_CONTRACT}; got {type(out).__name__}")
    updates, new_state = out
    if jax.tree.structure(updates) != jax.tree.structure(params) or any(
            jnp.shape(u) != jnp.shape(p) for u, p in zip(jax.tree.leaves(updates), jax.tree.leaves(params))):
        raise TypeError(f"{OPTIMIZER_CONTRACT}; got updates {jax.tree.structure(updates)} for params "
                        f"{jax.tree.structure(params)}")
    if jax.tree.structure(new_state) != jax.tree.structure(opt_state):
        raise TypeError(f"{OPTIMIZER_CONTRACT}; got new_state {jax.tree.structure(new_state)} for "
                        f"state {jax.tree.structure(opt_state)}")
    return apply_updates(params, updates), new_state


def _mean_loss(loss_terms: LossTerms) -> Callable:
    def mean(params, batch):
        total, count = checked_terms(loss_terms, params, batch)
        return total / jnp.maximum(count, 1.0)
    return mean


def one_step(loss_terms: LossTerms, update: Callable) -> Callable:
    """The plain step, uncompiled: (state, batch) -> (state, the batch's masked mean loss),
    state = (params, opt_state), the gradient of that mean applied through ``update``,
    in one function (what equivalence.twin_growth vmaps; the strategies' steps compute
    the gradient and the update in programs of their own: ``apply_program``)."""
    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(_mean_loss(loss_terms))(params, batch)
        return _updated(update, grads, opt_state, params), value
    return step


@functools.lru_cache(maxsize=64)
def apply_program(update: Callable, donate: bool = False) -> Callable:
    """The update, its own program, shared by every strategy's plain step: jit of
    ((params, opt_state), grads, loss) -> ((params + updates, new opt_state), loss) on
    replicated (or single-device) values; the state is donated when ``donate``.

    Its own program so that the same optax arithmetic compiles alike whatever computed
    the gradient: fused into a step's program it follows that program's layouts, and
    XLA:CPU contracts a multiply and an add into one FMA in an order that follows its
    operands' layout (Adam's first moment, 0.1 g + 0.9 m, rounded as fma(0.1, g, 0.9 m)
    in pmap's program and fma(0.9, m, 0.1 g) in shard_map's for the 1-d leaves, where
    one got biases as [n] and the other as [1, n]): pmap and shard_map then ended a few
    ulps apart under Adam, and 8.7e6 apart at a chaotic rate. Measured by disabling FMA
    (XLA_FLAGS=--xla_cpu_max_isa=AVX): bit-identical again."""
    def apply(state, grads, loss):
        params, opt_state = state
        return _updated(update, grads, opt_state, params), loss
    return jax.jit(apply, donate_argnums=(0,) if donate else ())


@functools.lru_cache(maxsize=64)
def sharded_step(loss_terms: LossTerms, update: Callable, donate: bool | None = None) -> Callable:
    """One plain step on state (params, opt_state): (state, batch) -> (state, loss): the
    gradient of the batch's global masked mean by a jit of its own (on replicated
    state and a batch sharded on 'data', ``sharded``, XLA adds the cross-device sums;
    on one device, ``single``, it is the plain gradient), then ``apply_program``.
    ``update`` has optax's contract; the step applies ``params + updates``. ``donate``:
    whether the state passed in is donated (consumed, its buffers reused for the new
    state); None (the default) donates where that saves memory, on accelerators, and
    not on CPU devices (``donates``)."""
    if donate is not None:
        gradient = _mean_gradient(loss_terms)
        apply = apply_program(update, donate)

        def fixed(state, batch):
            loss, grads = gradient(state[0], batch)
            return apply(state, grads, loss)
        return fixed
    donating, keeping = sharded_step(loss_terms, update, True), sharded_step(loss_terms, update, False)

    def step(state, batch):
        leaf = next((x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)), None)
        chosen = donating if leaf is not None and donates(leaf.devices()) else keeping
        return chosen(state, batch)
    return step


@functools.lru_cache(maxsize=64)
def _mean_gradient(loss_terms: LossTerms) -> Callable:
    """jit: (params, batch) -> (the batch's masked mean loss, its gradient)."""
    return jax.jit(jax.value_and_grad(_mean_loss(loss_terms)))


def donates(devices) -> bool:
    """Whether the compiled steps donate their state on these devices: on accelerators, not
    on CPU devices. Measured with XLA's own accounting (``compiled.memory_analysis()``, bench.py's
    donation table): on CPU (JAX 0.10.2) a donated step aliases its output to the state but
    keeps a temporary copy of the params for the reads that follow the in-place update
    (temporaries 16.8 -> 33.7 MB a device for the notebook MLP), so its peak is the same
    and the copy costs time; GPUs' donation is what nanodo and the JAX examples rely on
    (not measured here: no GPU)."""
    return all(d.platform != "cpu" for d in devices)


@functools.lru_cache(maxsize=64)
def pmap_step(loss_terms: LossTerms, update: Callable, devices: tuple) -> Callable:
    """The pmap step over exactly ``devices``, in that order (one per mesh position).

    Takes state (params, opt_state) stacked (n, ...), consumed where ``donates``, and a
    batch (n, B, ...); returns (new state (n, ...), global masked loss (n,)), every
    replica equal, on the same devices. The gradient is jax.pmap's (``_parallel_gradient``:
    each device back-propagates 1/count through its own total, count the real samples
    of the whole global batch, and the per-device gradients add up in a psum; the
    notebooks' ``pmean(grads)`` of per-device means is that gradient only when every
    device holds the same number of real samples); the update is ``apply_program`` on
    one replica, replicated, as in every other strategy, and the new state is stacked
    again. A pmap without ``devices=`` would map over the default backend's first n
    devices, whatever devices its inputs live on."""
    mesh = Mesh(np.array(devices, dtype=object), (AXIS,))
    donate = donates(devices)
    gradient = jax.pmap(_parallel_gradient(loss_terms), axis_name=AXIS, devices=list(devices))
    apply = apply_program(update, donate)
    first = jax.jit(jax.shard_map(lambda x: jax.tree.map(lambda y: y[0], x), mesh=mesh, in_specs=P(AXIS),
                                  out_specs=P(), check_vma=False), donate_argnums=(0,) if donate else ())
    stacked = jax.jit(jax.shard_map(lambda x: jax.tree.map(lambda y: y[None], x), mesh=mesh, in_specs=P(),
                                    out_specs=P(AXIS), check_vma=False))

    def step(state, batch):
        loss, grads = gradient(state[0], batch)
        new, loss = apply(first(state), *first((grads, loss)))
        return stacked((new, loss))
    return step


def _parallel_gradient(loss_terms: LossTerms) -> Callable:
    """pmap_step's per-device function (uncompiled): (params, batch) -> (global masked loss,
    its gradient), collectives over axis 'data'."""
    def gradient(params, batch):
        total, vjp, count = jax.vjp(lambda p: checked_terms(loss_terms, p, batch), params, has_aux=True)
        denominator = jnp.maximum(lax.psum(count, AXIS), 1.0)
        grads = lax.psum(vjp((1.0 / denominator).astype(total.dtype))[0], AXIS)
        return lax.psum(total, AXIS) / denominator, grads
    return gradient


@functools.lru_cache(maxsize=64)
def shard_map_step(loss_terms: LossTerms, update: Callable, mesh: Mesh) -> Callable:
    """The shard_map step for ``mesh``: (state, batch) -> (state, loss), the gradient by a
    jit(shard_map) of its own, then ``apply_program`` (the state donated where
    ``donates(mesh.devices.flat)``).

    Why this form is correct: with ``check_vma=True`` (the default), the params enter
    replicated (``P()``) and JAX knows they are the same on every device. The
    gradient of a device-varying value with respect to such an input is summed
    over devices automatically (the transpose of the implicit broadcast is a
    psum). So we differentiate the *global* loss, psum(total) / psum(count), and
    the automatic sum adds each device's share exactly once. The trap is porting
    pmap's ``grad(local mean loss)`` then ``pmean(grads)``: the automatic psum
    has already summed n per-device means, pmean of that replicated sum changes
    nothing, and training runs with n times the gradient.
    """
    def gradient(params, batch):
        def global_loss(p):
            total, count = checked_terms(loss_terms, p, batch)
            return lax.psum(total, AXIS) / jnp.maximum(lax.psum(count, AXIS), 1.0)
        return jax.value_and_grad(global_loss)(params)

    gradient = jax.jit(jax.shard_map(gradient, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=(P(), P())))
    apply = apply_program(update, donates(mesh.devices.flat))

    def step(state, batch):
        loss, grads = gradient(state[0], batch)
        return apply(state, grads, loss)
    return step


# --------------------------------------------------------------------------
# The canonical reduction: the same bits on every topology
# --------------------------------------------------------------------------
#
# Two things make the bits the same on every topology: the order of summation, fixed
# by construction (canonical_sums), and the same compiled arithmetic for each block
# and for the update, whatever the mesh. The second is XLA's, and it needed one
# setting: XLA compiles a program for one device and a program partitioned over
# several through different pass pipelines, and the partitioned one runs a CSE before
# the algebraic simplifier, which then rewrites what CSE left differently (measured on
# CPU, JAX 0.10.2: an attention block's softmax gradient kept a divide by a broadcast
# on 2, 4 and 8 devices that became a multiply by a reciprocal on one device, and
# XLA:CPU contracted that multiply and the following add into one FMA: other bits).
# With XLA's CSE passes off in these programs (CANONICAL_XLA_OPTIONS) the two
# pipelines give the same arithmetic on every model tested (ReLU MLPs, the notebooks'
# MLP, attention; SGD, Adam, AdamW with clipping), and test_equivalence.py holds it
# on every run: an XLA that compiles them apart fails there, not in silence.
CANONICAL_XLA_OPTIONS = {"xla_disable_hlo_passes": "cse"}


def canonical_sums(loss_terms: LossTerms, num_devices: int, logical_shards: int) -> Callable:
    """The per-device half of ``canonical_step``, uncompiled, for a shard_map or pmap over
    axis 'data' of ``num_devices`` = n devices: (params, rows) -> (gradient sums, loss sum,
    count), every output the same bits on every device. ``rows`` is this device's part
    of the global batch: L/n logical blocks of b rows, L = ``logical_shards``.

    1. Each block's (gradient of its loss sum, loss sum, count) by one program of one
       shape (b rows): ``lax.map`` over the device's blocks, in block order.
    2. Leaf by leaf (the loss sums and counts too): ``all_to_all`` gives device c chunk c
       of that leaf of every block of every device (raveled, zero-padded to n chunks),
       in global block order, device 0's blocks first: (L, chunk). A leaf under
       SMALL_LEAF entries is ``all_gather``ed whole instead: (L, ...) on every device.
    3. A left fold over the L blocks with explicit adds, g_0 + g_1, then + g_2, ...,
       + g_{L-1}: the one order of summation, whatever n (a ``jnp.sum`` would let XLA
       pick one). It starts from g_0 itself, never from 0 + g_0 (a sign of zero).
    4. ``all_gather`` of the folded chunks: the whole sums on every device.

    Why n cannot change the bits: every block's sums come from the same program on the
    same b rows (compiled alike on every mesh: CANONICAL_XLA_OPTIONS); the fold adds
    the same L values in the same order (the chunking splits only which device adds
    which entries; each entry's sum is the same sequence of IEEE additions); moving
    values between devices and padding with zeros are exact. So the result is that of
    one device adding its L microbatches' sums in order. It holds within one backend
    and one device kind (measured on CPU: test_equivalence.py); nothing promises CPU
    bits equal GPU bits, or one GPU model another's. Bytes a device sends: (L/n + 1) x
    (n-1)/n gradients, an all-reduce's 2 x (n-1)/n when L = n. Either batch layout:
    rows (L/n*b, ...) or, in layout "pmap", (1, L/n*b, ...)."""
    if logical_shards % num_devices:
        raise ValueError(f"canonical reduction: {num_devices} devices do not divide "
                         f"logical_shards={logical_shards}")
    per_device = logical_shards // num_devices

    def block(params, rows):
        (total, count), grads = jax.value_and_grad(
            lambda p: checked_terms(loss_terms, p, rows), has_aux=True)(params)
        return grads, total, count

    def sums(params, rows):
        if jnp.ndim(rows["mask"]) == 2:  # layout "pmap": this device's (1, L/n*b, ...)
            rows = jax.tree.map(lambda x: x.reshape(x.shape[1:]), rows)
        size = jax.tree.leaves(rows)[0].shape[0]
        if size % per_device:
            raise ValueError(f"canonical reduction: a device's {size} rows do not split into its "
                             f"{per_device} logical blocks (logical_shards={logical_shards} over "
                             f"{num_devices} devices)")
        blocks = jax.tree.map(lambda x: x.reshape((per_device, size // per_device) + x.shape[1:]), rows)
        grads, total, count = lax.map(lambda b: block(params, b), blocks)
        leaves, tree = jax.tree.flatten(grads)
        count = jnp.asarray(count, total.dtype)
        folded = _fold_across(leaves + [total, count], per_device, num_devices)
        return jax.tree.unflatten(tree, folded[:-2]), folded[-2], folded[-1]
    return sums


SMALL_LEAF = 1 << 14  # entries: a leaf this small is gathered whole and folded on every device


def _fold_across(leaves: list, per_device: int, n: int) -> list:
    """_fold_program's body: each leaf (per_device, ...) folded over every device's blocks
    in global block order (device 0's first), the result (...) on every device. A leaf of
    SMALL_LEAF entries or more goes by ``all_to_all`` (device c folds chunk c of every
    block, raveled and zero-padded to n chunks) and an ``all_gather`` of the folded chunks;
    a smaller one is all_gathered whole and folded on every device. Either way each entry
    is the same left fold of the same L values."""
    out = []
    for x in leaves:
        shape = x.shape[1:]
        width = int(np.prod(shape, dtype=np.int64))
        if width < SMALL_LEAF or n == 1:
            out.append(_left_fold(lax.all_gather(x, AXIS, tiled=True)))  # (L, ...)
            continue
        chunk = -(-width // n)
        vector = jnp.pad(x.reshape(per_device, width), ((0, 0), (0, n * chunk - width)))
        blocks = lax.all_to_all(vector, AXIS, 1, 0, tiled=True)  # (L, chunk), global block order
        whole = lax.all_gather(_left_fold(blocks), AXIS, tiled=True)[:width]
        out.append(whole.reshape(shape))
    return out


def _left_fold(blocks):
    """blocks[0] + blocks[1], then + blocks[2], ...: explicit adds in that order (a jnp.sum
    would let XLA pick the order), starting from blocks[0] itself (0 + x is not x for -0.0)."""
    total = blocks[0]
    for l in range(1, blocks.shape[0]):
        total = total + blocks[l]
    return total


@functools.lru_cache(maxsize=64)
def canonical_gradients(loss_terms: LossTerms, mesh: Mesh, logical_shards: int) -> Callable:
    """jit(shard_map(canonical_sums)) on ``mesh``: (params replicated, batch sharded on
    'data') -> (gradient sums, loss sum, count), replicated."""
    sums = canonical_sums(loss_terms, mesh.devices.size, logical_shards)
    return jax.jit(jax.shard_map(sums, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(),
                                 check_vma=False), compiler_options=CANONICAL_XLA_OPTIONS)


@functools.lru_cache(maxsize=64)
def update_program(update: Callable) -> Callable:
    """The update as its own program: jit((params, opt_state), gradient sums, loss sum,
    count) -> ((params, opt_state), loss), dividing the sums by max(count, 1), the
    step's global count of real samples, then ``update`` and ``params + updates``.

    Its own program so that it compiles alike on every topology: inside a step's
    program the same optax arithmetic is fused with whatever surrounds it, and XLA's
    CPU compiler contracts a multiply and an add that land in one fusion into one
    FMA (one rounding instead of two), so pmap and shard_map steps ended apart under
    Adam. On replicated inputs the program each device runs is the same."""
    def apply(state, sums, total, count):
        params, opt_state = state
        denominator = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / denominator.astype(g.dtype), sums)
        return _updated(update, grads, opt_state, params), total / denominator
    return jax.jit(apply, compiler_options=CANONICAL_XLA_OPTIONS)


def canonical_step(loss_terms: LossTerms, update: Callable, mesh: Mesh, logical_shards: int) -> Callable:
    """One training step with the canonical reduction: (state, batch) -> (state, loss).

    ``state`` = (params, opt_state) replicated on ``mesh``; ``batch`` a global batch of
    L*b rows sharded on 'data', in layout "sharded" (L*b, ...) or "pmap" (n, L/n*b,
    ...), L = ``logical_shards`` a multiple of the mesh's n devices: logical block l is
    rows l*b .. (l+1)*b - 1, so device k holds blocks k*L/n .. (k+1)*L/n - 1. The
    gradient is ``canonical_sums``' (the L blocks' gradient sums added in one fixed
    order) divided by the step's global count of real samples (never a per-device or
    per-microbatch mean), then ``update_program``. So the params, the optimizer state
    and the losses are the same bits on every mesh whose device count divides L, in
    one process or several, and on one device adding the L blocks as microbatches (a
    mesh of one device), at any learning rate: the same arithmetic in the same order."""
    gradients, apply = canonical_gradients(loss_terms, mesh, logical_shards), update_program(update)

    def step(state, batch):
        return apply(state, *gradients(state[0], batch))
    return step


def start_state(name: str, optimizer: Optimizer, params: Params, opt_state, mesh: Mesh) -> tuple:
    """(params, opt_state) checked, with ``optimizer.init(params)`` (on the mesh's first
    local device) for a state of None."""
    if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
        raise TypeError(f"strategy {name!r}: optimizer must have init(params) and update(grads, state, "
                        f"params) (optax's GradientTransformation, or strategies.sgd(...)); got "
                        f"{type(optimizer).__name__}")
    check_dtypes(params, f"strategy {name!r}: params")
    if opt_state is None:
        local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
        with jax.default_device(local[0]):
            opt_state = optimizer.init(params)
    check_dtypes(opt_state, f"strategy {name!r}: opt_state")
    return params, opt_state


def _single_process_only(name: str, why: str) -> None:
    if jax.process_count() > 1:
        raise ValueError(f"strategy {name!r} runs in one process only ({why}); with "
                         f"{jax.process_count()} processes use 'sharded' or 'shard_map'")
