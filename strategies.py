"""Four ways to run the same data-parallel training, for any model and update rule.

Every strategy has one signature::

    strategy(params, batches, mesh, *, loss_terms, optimizer=sgd(0.001), opt_state=None,
             reduction="plain", logical_shards=None) -> Trained(params, losses, opt_state)

* ``params``, ``opt_state``: any pytrees of arrays; epochs chain by passing both back in. They come back where they
  went in: host (NumPy) params in, host params and state out; params whose every leaf is a ``jax.Array`` (a
  strategy's own output), ``jax.Array`` leaves out, replicated on the devices the strategy ran on (``single``: the
  mesh's first), so a chain of epochs never moves them through the host. Arrays passed in are never consumed (copied
  where the steps donate: ``replicate``). ``opt_state`` None means ``optimizer.init``.
* ``loss_terms(params, batch) -> (total, count)``: your model, on the rows one program sees (the batch's fields but
  "logical_shards"). ``total``: the sum of the real (mask-True) rows' losses, a float scalar; ``count``: how many terms
  it sums (real rows, or their tokens), a scalar. Each strategy minimises the global sum(total) / max(sum(count), 1).
* ``optimizer``: optax's ``GradientTransformation`` (any optax optimizer) or ``sgd``.
* ``batches``: dicts with a bool "mask", one entry per row: (n*B,) in layout "sharded", (n, B) in layout "pmap"
  (``LAYOUT[strategy]``), as ``loaders.make_loader`` yields them.
* ``losses`` (steps,): each step's sum(total) / max(sum(count), 1) before its update, in total's dtype (float32 for
  float32 params); 0 for a step of padding only.

The strategies: ``sharded`` (the notebooks' jit on sharded arrays), ``pmap`` (in maintenance mode in JAX), ``shard_map``
(pmap's modern replacement) and ``single`` (the whole global batch on the mesh's first device). Each runs on exactly the
mesh's devices, in mesh order, never on JAX's default device. Each checks the first batch of each shape (``door``), and
so does each step a user's own loop takes (``sharded_step``, ``pmap_step``, ``shard_map_step``, ``canonical_step``).

The reductions, how a step's gradient is summed:

* "plain": each strategy's own sums, in the order its collective picks. The strategies end apart by rounding;
  ``equivalence.stepwise_verdict`` judges them.
* "canonical": the global batch is L = ``logical_shards`` blocks of b rows, on any n devices from 1 to L. Each device
  has k = ceil(L/n) slots of b rows: device d holds blocks L*d//n .. L*(d+1)//n - 1 in its first slots, and a spare
  last slot where it holds k - 1 (``plan.device_slots``; the batch's "logical_shards" entry names each slot's block,
  -1 for a spare). A spare slot adds exactly zero by its place, whatever its rows or mask. Then:

      for each block l = 0..L-1, on the device that holds it:
          g_l, t_l, c_l = the gradient of block l's total, its total, its count
      g = exact_sum(g_0, ..., g_{L-1})             (the same for t and c)
      params, state = update_program(state, g, t, c)   # g / max(c, 1), then optax

  ``summation.exact_sum``: per leaf, every block's entries on one grid (a power of two below the leaf's largest entry),
  added as integers, rounded once: the same bits in any order and grouping (``sum_program``). Each block runs the same
  single-device code on every device, whatever the mesh (one program per block, ``block_program``; on LOOP_PLATFORMS one
  loop program per device, ``loop_program``), and so does the update. So params, optimizer state and losses are the same
  bits on every device count n from 1 to L, in one process or several, through every strategy, on one device adding the
  L blocks as microbatches (``single``), across a stop and a resume on another n, at any learning rate. Not across L,
  jaxlib versions, platforms or device kinds. The XLA options the programs need are set here
  (``CANONICAL_XLA_OPTIONS``). L comes from the batches (a loader's carry a "logical_shards" entry) or from
  ``logical_shards``; given both, they must agree; given neither, the step is refused.

Imports: NumPy and JAX only (JAX 0.10 or newer). optax optimizers are accepted, not imported. Imported by
equivalence.py, refimpl.py and bench.py.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import summation

AXIS = "data"  # the mesh axis the batch is sharded on
LAYOUT = {"sharded": "sharded", "pmap": "pmap", "shard_map": "sharded", "single": "sharded"}
REDUCTIONS = ("plain", "canonical")
NOTEBOOK_LEARNING_RATE = 0.001
SHARDS_KEY = "logical_shards"  # a loader batch's entry: int32 (L,), 0..L-1, sharded like its rows
# The canonical programs' XLA options, set here, not by the user: each device compiles its own copy of a program, so
# on GPUs the kernels must not be chosen by timing (autotuning) nor add with atomics. On CPU they change nothing.
CANONICAL_XLA_OPTIONS = {"xla_gpu_deterministic_ops": True, "xla_gpu_autotune_level": 0}

Params = Any  # any pytree of float arrays
LossTerms = Callable[[Any, dict], tuple]  # (params, batch) -> (total over real rows, count)

LOSS_TERMS_CONTRACT = ("loss_terms(params, batch) must return (total, count): total the sum of the per-sample losses "
                       "over the batch's real (mask-True) rows, a float scalar (not their mean), and count how many "
                       "terms total sums, a scalar (the real rows, or their tokens: at least one per real row); the "
                       "strategies divide the global sum of totals by the global sum of counts")
OPTIMIZER_CONTRACT = ("optimizer.update(grads, state, params) must return (updates, new_state) as optax "
                      "does: updates with the params' tree structure and shapes (the strategies apply "
                      "params + updates), new_state with the state's structure")


# The update rule: optax's contract ----------------------------------------------------------------


class Optimizer(NamedTuple):
    """optax's ``GradientTransformation`` contract: ``init(params) -> state`` and ``update(grads, state, params) ->
    (updates, new state)``. Compiled steps are cached on ``update``: build an optimizer once, not once per step."""
    init: Callable[[Params], Any]
    update: Callable[[Params, Any, Params], tuple]


def sgd(learning_rate: float = NOTEBOOK_LEARNING_RATE) -> Optimizer:
    """The notebooks' plain SGD: updates ``-(lr * g)`` in each leaf's dtype, the rate kept in the state
    ({"learning_rate": float32}) so a new rate compiles nothing new. ``optax.sgd(lr)`` computes the same updates."""
    rate = np.float32(learning_rate)
    return Optimizer(lambda params: {"learning_rate": rate}, sgd_update)


def sgd_update(grads: Params, state: dict, params: Params = None) -> tuple:
    """``sgd``'s update: (-(state["learning_rate"] * g) per leaf, state)."""
    rate = state["learning_rate"]
    return jax.tree.map(lambda g: -(rate.astype(g.dtype) * g), grads), state


def apply_updates(params: Params, updates: Params) -> Params:
    """``p + u`` per leaf, cast to p's dtype: ``optax.apply_updates``' arithmetic."""
    return jax.tree.map(lambda p, u: jnp.asarray(p + u).astype(jnp.asarray(p).dtype), params, updates)


class Trained(NamedTuple):
    """What a strategy returns: params, (steps,) host losses, optimizer state; params and state on the host or the
    devices, as the params went in."""
    params: Params
    losses: np.ndarray
    opt_state: Any


# The strategies -----------------------------------------------------------------------------------


def sharded(params: Params, batches: Iterable[dict], mesh: Mesh, *, loss_terms: LossTerms, optimizer: Optimizer = sgd(),
            opt_state=None, reduction: str = "plain", logical_shards: int | None = None) -> Trained:
    """Params replicated, the batch sharded on 'data', a jit step: XLA adds the sums."""
    return _train("sharded", params, batches, mesh, loss_terms, optimizer, opt_state, reduction, logical_shards)


def pmap(params: Params, batches: Iterable[dict], mesh: Mesh, *, loss_terms: LossTerms, optimizer: Optimizer = sgd(),
         opt_state=None, reduction: str = "plain", logical_shards: int | None = None) -> Trained:
    """Params stacked on a device axis, batches (n, B, ...), ``jax.pmap`` over the mesh's devices; one process only."""
    return _train("pmap", params, batches, mesh, loss_terms, optimizer, opt_state, reduction, logical_shards)


def shard_map(params: Params, batches: Iterable[dict], mesh: Mesh, *, loss_terms: LossTerms,
              optimizer: Optimizer = sgd(), opt_state=None, reduction: str = "plain",
              logical_shards: int | None = None) -> Trained:
    """``jax.shard_map`` with explicit collectives."""
    return _train("shard_map", params, batches, mesh, loss_terms, optimizer, opt_state, reduction, logical_shards)


def single(params: Params, batches: Iterable[dict], mesh: Mesh, *, loss_terms: LossTerms, optimizer: Optimizer = sgd(),
           opt_state=None, reduction: str = "plain", logical_shards: int | None = None) -> Trained:
    """The whole global batch on the mesh's first device each step; one process only."""
    return _train("single", params, batches, mesh, loss_terms, optimizer, opt_state, reduction, logical_shards)


STRATEGIES = {"sharded": sharded, "pmap": pmap, "shard_map": shard_map, "single": single}


def _train(name: str, params, batches, mesh: Mesh, loss_terms, optimizer, opt_state, reduction: str,
           logical_shards) -> Trained:
    if name in ("pmap", "single") and jax.process_count() > 1:
        raise ValueError(f"strategy {name!r} runs in one process only; with {jax.process_count()} "
                         f"processes use 'sharded' or 'shard_map'")
    _check_reduction(name, reduction, logical_shards, mesh)
    state = start_state(name, optimizer, params, opt_state, mesh)
    batches = iter(batches)
    first = next(batches, None)
    batches = checked(itertools.chain([] if first is None else [first], batches), name, mesh)
    run_mesh = Mesh(np.array([mesh.devices.flat[0]]), (AXIS,)) if name == "single" else mesh
    if name == "single":  # a batch already there (a mesh of one device) is taken as it is
        there = {mesh.devices.flat[0]}
        batches = (b if all(getattr(x, "sharding", None) is not None and x.sharding.device_set == there
                            for x in jax.tree.leaves(b)) else jax.device_put(b, mesh.devices.flat[0]) for b in batches)
    stacked = name == "pmap" and reduction == "plain"  # pmap's layout: state (n, ...), values (n,)
    if reduction == "canonical":
        L = logical_shards or (_batch_shards(first) if first is not None else None)
        if L is None and first is not None:
            raise ValueError(f"strategy {name!r}: the first batch does not say its logical shards (a loader's batches "
                             f"carry {SHARDS_KEY!r}): pass logical_shards=L for the canonical reduction")
        if name == "single" and L and L % mesh.devices.size:  # the mesh's spare slots out, on the one device
            batches = map(_real_slots(L, mesh.devices.size), batches)
        step, place = canonical_step(loss_terms, optimizer.update, run_mesh, L) if L else None, replicate
    else:
        step, place = plain_step(name, loss_terms, optimizer.update, mesh)
    donating = reduction == "plain" and donates(run_mesh.devices.flat)  # else the caller's arrays need no copy
    state, values = train_loop(step, place(state, run_mesh, copy=donating), batches)
    if stacked:  # pmap's values (n, ...): the first device's (1, ...), stacked, then its row
        values = [jax.tree.map(lambda x: x.addressable_data(0), v) for v in values]
    losses = stack_losses(values)
    leaves = jax.tree.leaves(params)
    if leaves and all(isinstance(x, jax.Array) for x in leaves):  # on the devices in, on the devices out
        state, host = _unstacked(tuple(mesh.devices.flat), False)(state) if stacked else state, lambda x: x
    else:
        host = first_replica if stacked else to_host
    return Trained(host(state[0]), jax.tree.map(lambda x: x[:, 0], losses) if stacked and values else losses,
                   host(state[1]))


def _check_reduction(name: str, reduction: str, logical_shards, mesh: Mesh) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"strategy {name!r}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if reduction == "plain" and logical_shards is not None:
        raise ValueError(f"strategy {name!r}: logical_shards={logical_shards!r} needs reduction='canonical' "
                         f"(the plain reduction adds whatever each device holds)")
    if logical_shards is None:
        return
    if isinstance(logical_shards, (bool, np.bool_)) or not isinstance(logical_shards, (int, np.integer)):
        raise ValueError(f"strategy {name!r}: logical_shards={logical_shards!r} must be an int")
    if logical_shards < 1:
        raise ValueError(f"strategy {name!r}: logical_shards={logical_shards!r} must be at least 1")
    _check_devices(f"strategy {name!r}", logical_shards, mesh.devices.size)


def _check_devices(where: str, logical_shards: int, n: int) -> None:
    """ValueError unless the mesh's n devices are at most L (each holds at least one whole block)."""
    if logical_shards < n:
        raise ValueError(f"{where}: logical_shards={logical_shards} is fewer than the mesh's {n} device(s) (each "
                         f"device holds whole blocks, at least one): use at most {logical_shards} devices or a "
                         f"larger L")


def _slots(logical_shards: int, n: int) -> np.ndarray:
    """(n, k) int: device d's slots' blocks, -1 for a spare; ``plan.device_slots``, stated in the module docstring."""
    out = np.full((n, -(-logical_shards // n)), -1)
    for d in range(n):
        lo, hi = logical_shards * d // n, logical_shards * (d + 1) // n
        out[d, :hi - lo] = np.arange(lo, hi)
    return out


_count_real = jax.jit(lambda entry: jnp.sum(entry >= 0, dtype=jnp.int32))


@functools.lru_cache(maxsize=64)
def _real_slots(logical_shards: int, n: int) -> Callable:
    """A batch laid out for n devices (n*k slots of b rows, in layout "sharded") -> its L real slots' rows in block
    order and "logical_shards" 0..L-1: the layout of one device, for ``single``."""
    slots = _slots(logical_shards, n).reshape(-1)
    order = np.flatnonzero(slots >= 0)  # the real slots, in block order

    def real(batch):
        out = {key: x.reshape((slots.size, -1) + x.shape[1:])[order].reshape((-1,) + x.shape[1:])
               for key, x in batch.items() if key != SHARDS_KEY}
        return out | {SHARDS_KEY: jnp.arange(logical_shards, dtype=jnp.int32)}
    return jax.jit(real)


def _batch_shards(batch) -> int | None:
    """L of a batch that carries its plan's logical shards (``SHARDS_KEY``: each slot's block, -1 for a spare), else
    None: the slots that are not spare (on a global array, a sum every process computes alike)."""
    if not (isinstance(batch, dict) and SHARDS_KEY in batch):
        return None
    entry = batch[SHARDS_KEY]
    return int(_count_real(entry)) if isinstance(entry, jax.Array) else int(np.sum(np.asarray(entry) >= 0))


def checked(batches: Iterable[dict], strategy: str, mesh: Mesh) -> Iterator[dict]:
    """``batches``, each checked to be in ``strategy``'s layout and on the mesh. Every step: a dict with a "mask";
    jax.Array leaves sharded on 'data' over exactly the mesh's devices; NumPy leaves placed so in one process, refused
    across processes (a host array could be the whole batch or this process's rows). Once per ``_signature`` (in a loop
    of one shape, the first batch): the layout, told from "mask", (n*B,) in "sharded", (n, B) in "pmap", and the host
    leaves' dtypes. ValueError naming the strategy, the step and what is wrong; the step's ``door`` checks the rest."""
    layout, n, seen = LAYOUT[strategy], mesh.devices.size, set()
    want = NamedSharding(mesh, P(AXIS))
    for step, batch in enumerate(batches):
        where = f"strategy {strategy!r}, batch at step {step}"
        if not isinstance(batch, dict) or "mask" not in batch:
            got = f" with keys {sorted(batch)}" if isinstance(batch, dict) else ""
            raise ValueError(f"{where}: no 'mask' (a dict with a bool 'mask', (n*B,) or (n, B), as "
                             f"loaders.make_loader yields); got {type(batch).__name__}{got}")
        signature = _signature(batch)
        if signature not in seen:
            _check_layout(where, tuple(np.shape(batch["mask"])), layout, n)
            check_dtypes({k: v for k, v in batch.items() if not isinstance(v, jax.Array)}, f"{where}: batch")
            seen.add(signature)
        placed = {}
        for key, leaf in batch.items():
            if not isinstance(leaf, jax.Array):
                if jax.process_count() > 1:
                    raise ValueError(f"{where}: batch[{key!r}] is a host array ({type(leaf).__name__}); across "
                                     f"{jax.process_count()} processes it could be the whole batch or this "
                                     f"process's rows: build global arrays (jax.make_array_from_process_local_data)")
                placed[key] = leaf if strategy == "single" else jax.device_put(leaf, want)
                continue
            if leaf.sharding.device_set != set(mesh.devices.flat):
                raise ValueError(f"{where}: batch[{key!r}] lives on {sorted(str(d) for d in leaf.sharding.device_set)}"
                                 f", not on the mesh's devices {[str(d) for d in mesh.devices.flat]}")
            if n > 1 and not leaf.sharding.is_equivalent_to(want, leaf.ndim):
                raise ValueError(f"{where}: batch[{key!r}] has sharding {leaf.sharding}, not NamedSharding(mesh, "
                                 f"P('data')): every device would compute on rows it does not own")
            placed[key] = leaf
        yield placed


def _check_layout(where: str, shape: tuple, layout: str, n: int) -> None:
    """The mask's shape in ``layout``: one entry per row, (n*B,) in "sharded", (n, B) in "pmap"."""
    if layout == "pmap" and (len(shape) != 2 or shape[0] != n):
        raise ValueError(f"{where}: needs layout 'pmap' (mask (n, B) = ({n}, B); "
                         f"make_loader(..., layout='pmap')), got a mask of shape {shape}")
    if layout == "sharded" and len(shape) != 1:
        token = (f"; a mask of one entry per token goes in a field of its own, read by loss_terms (its count "
                 f"then counts tokens)" if len(shape) >= 2 and shape[0] != n else "")
        raise ValueError(f"{where}: needs layout 'sharded' (mask (n*B,), one entry per row; "
                         f"make_loader(..., layout='sharded')), got a mask of shape {shape}{token}")


@functools.lru_cache(maxsize=64)
def door(where: str, loss_terms: LossTerms, layout: str, logical_shards: int | None = None,
         stacked: bool = False, n: int | None = None) -> Callable:
    """The check a step makes of each batch of a shape it has not seen (in a loop of one shape, the first; one door per
    set of arguments, so a step built again, as canonical_step is per epoch, checks nothing twice):
    ``check(params, batch)`` raises ValueError, naming ``where``, the value and the rule, for

    * a batch that is not a dict with a "mask" of dtype bool (a 0/255 uint8 mask would count 255 per row), one entry
      per row in ``layout``, or with a 64-bit host leaf JAX would narrow in silence;
    * ``logical_shards`` L given and the batch carrying another (its SHARDS_KEY entry), or rows that do not split into
      L blocks;
    * a ``loss_terms`` that breaks its contract on the first local device's rows: its total and count must be 0 when
      every row is padding (a total that ignores the mask trains on the padding, a mean over the real rows is NaN
      there), must not change when padding rows are added (a mean over all rows, ``(mean, count)``, trains b times too
      slowly), and the count must be a whole number, at least the real rows (a count of tokens, for a loss weighted by
      token, is one).

    ``params`` are the step's, replicated (or ``stacked``, pmap's: the first copy is checked); ``n``, the step's device
    count (None: the mask's, 1 for a host array), which layout "pmap" needs. Where the state or the batch's total is
    not finite (a training that diverged, NaN data), nothing can be judged, and the contract is not checked.

    Across processes the verdict is agreed (``_agreed``) before any step runs: a break that shows on one process's
    rows stops every process, each naming the process where it showed, so none waits in the step's collective."""
    seen = set()

    def check(params, batch):
        if not isinstance(batch, dict) or "mask" not in batch:
            got = f" with keys {sorted(batch)}" if isinstance(batch, dict) else ""
            raise ValueError(f"{where}: no 'mask' (a dict with a bool 'mask', (n*B,) or (n, B), as "
                             f"loaders.make_loader yields); got {type(batch).__name__}{got}")
        signature = _signature(batch)
        if signature in seen:
            return
        try:
            judge(params, batch)
            verdict = None
        except ValueError as error:
            verdict = error
        _agreed(verdict, batch["mask"])
        seen.add(signature)

    def judge(params, batch):
        mask = batch["mask"]
        if _dtype(mask) != np.bool_:
            raise ValueError(f"{where}: batch['mask'] is {_dtype(mask)}, not bool: a mask must be True on "
                             f"the real rows and False on padding (a 0/255 mask counts 255 per row)")
        check_dtypes({k: v for k, v in batch.items() if not isinstance(v, jax.Array)}, f"{where}: batch")
        devices = n or (len(mask.sharding.device_set) if isinstance(mask, jax.Array) else 1)
        _check_layout(where, tuple(np.shape(mask)), layout, devices)
        rows = np.shape(mask)[0] * (np.shape(mask)[1] if layout == "pmap" else 1)
        if logical_shards is not None:
            carried = _batch_shards(batch)
            if carried is not None and carried != logical_shards:
                raise ValueError(f"{where}: the batch carries logical_shards={carried} (its loader's plan), but "
                                 f"the step was made for logical_shards={logical_shards}: the same bits on every "
                                 f"topology hold only for the plan's own L")
            held = devices * -(-logical_shards // devices)
            if logical_shards < devices or rows % held:
                raise ValueError(f"{where}: the batch's {rows} rows on {devices} device(s) do not split into {held} "
                                 f"slots of one size (logical_shards={logical_shards}: ceil(L/n) slots a device)")
        _check_contract(where, loss_terms, params, batch, layout, stacked)
    return check


VERDICT_BYTES = 2048  # a refusal's message as it crosses between processes (longer is cut)


def _agreed(verdict: ValueError | None, mask) -> None:
    """Raises ``verdict``; across processes (``mask`` a global jax.Array), every process's, gathered over the mask's
    mesh: a ValueError on every process if any refused, naming each process that did and its message."""
    if jax.process_count() == 1 or not isinstance(mask, jax.Array) or not hasattr(mask.sharding, "mesh"):
        if verdict is not None:
            raise verdict
        return
    mesh = mask.sharding.mesh
    text = np.frombuffer(("" if verdict is None else str(verdict)).encode()[:VERDICT_BYTES].ljust(VERDICT_BYTES, b"\0"),
                         np.uint8)
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    words = jax.make_array_from_single_device_arrays((mesh.devices.size, VERDICT_BYTES), NamedSharding(
        mesh, P(mesh.axis_names)), [jax.device_put(text[None], d) for d in local])
    every = np.asarray(_replicated(mesh)(words).addressable_data(0))
    said = {}
    for device, row in zip(mesh.devices.flat, every):
        if row.any():
            said.setdefault(device.process_index, bytes(row).rstrip(b"\0").decode(errors="replace"))
    if said:
        raise ValueError("; ".join(f"process {p} of {jax.process_count()}: {m}" for p, m in sorted(said.items())))


@functools.lru_cache(maxsize=16)
def _replicated(mesh: Mesh) -> Callable:
    return jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))


def _dtype(x) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.result_type(x)


def _signature(batch) -> tuple:
    """The tree, and per leaf the shape, dtype and whether a jax.Array: what ``door`` and ``checked`` judge once."""
    leaves, tree = jax.tree.flatten(batch)  # on every step: a jax.Array's own shape and dtype, read directly
    return tree, tuple((x.shape, x.dtype, True) if isinstance(x, jax.Array) else (np.shape(x), _dtype(x), False)
                       for x in leaves)


def _check_contract(where: str, loss_terms: LossTerms, params, batch: dict, layout: str, stacked: bool) -> None:
    """``door``'s loss_terms check, on the first local device's rows and params."""
    def first(x):
        return x.addressable_shards[0].data if isinstance(x, jax.Array) else np.asarray(x)
    rows = {k: first(v) for k, v in batch.items() if k != SHARDS_KEY}
    if layout == "pmap":
        rows = {k: v[0] for k, v in rows.items()}
    own = jax.tree.map(first, params)
    if stacked:
        own = jax.tree.map(lambda x: x[0], own)
    if not all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(own)):
        return
    if isinstance(leaf := jax.tree.leaves(rows)[0], jax.Array):
        own, rows = jax.device_put((own, rows), next(iter(leaf.devices())))
    found = jax.tree.map(float, _contract_program(loss_terms)(own, rows))
    (total, count), (total0, count0), (total2, count2), real = found
    if not np.isfinite(total):  # the data or the model is not finite: nothing can be judged
        return
    where = f"{where}: loss_terms on the first device's rows of the first batch ({real:g} real)"
    if total0 != 0 or count0 != 0:
        raise ValueError(f"{where} returned total={total0:g}, count={count0:g} when every row is padding, not "
                         f"(0, 0): its total must sum only the real rows (mask them with jnp.where(mask, loss, "
                         f"0), which an infinite loss on a padding row cannot turn into NaN, as mask * loss "
                         f"does); {LOSS_TERMS_CONTRACT}")
    if count2 != count or abs(total2 - total) > 1e-4 * abs(total) + 1e-30:
        raise ValueError(f"{where} returned total={total:g}, count={count:g}, and total={total2:g}, count="
                         f"{count2:g} with as many padding rows added: a total that changes with the padding "
                         f"is a mean over all rows ((mean, count) trains b times too slowly); {LOSS_TERMS_CONTRACT}")
    if count != round(count) or count < real:
        raise ValueError(f"{where} returned count={count:g}, below its {real:g} real rows or not a whole number: "
                         f"the count is what total sums, at least one per real row (rows, or a row's tokens); "
                         f"{LOSS_TERMS_CONTRACT}")


@functools.lru_cache(maxsize=64)
def _contract_program(loss_terms: LossTerms) -> Callable:
    """jit: (params, one device's rows) -> ((total, count) as given, with every row padding, with as many padding rows
    added; the real rows)."""
    def terms(params, rows):
        mask = rows["mask"]
        padding = dict(rows, mask=jnp.zeros_like(mask))
        more = {k: jnp.concatenate([v, v]) for k, v in rows.items()}
        more["mask"] = jnp.concatenate([mask, jnp.zeros_like(mask)])
        real = jnp.sum(jnp.any(mask.reshape(mask.shape[0], -1), axis=1), dtype=jnp.float32)
        return (checked_terms(loss_terms, params, rows), checked_terms(loss_terms, params, padding),
                checked_terms(loss_terms, params, more), real)
    return jax.jit(terms)


def start_state(name: str, optimizer: Optimizer, params: Params, opt_state, mesh: Mesh) -> tuple:
    """(params, opt_state) checked; ``optimizer.init(params)`` on the mesh's first local device for a state of None."""
    if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
        raise TypeError(f"strategy {name!r}: optimizer must have init(params) and update(grads, state, params) "
                        f"(optax's GradientTransformation, or strategies.sgd(...)); got {type(optimizer).__name__}")
    check_dtypes(params, f"strategy {name!r}: params")
    if opt_state is None:
        local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
        with jax.default_device(local[0]):
            opt_state = optimizer.init(params)
    check_dtypes(opt_state, f"strategy {name!r}: opt_state")
    return params, opt_state


# Moving params (and optimizer state) between layouts ----------------------------------------------


def replicate(params: Params, mesh: Mesh, *, copy: bool = True) -> Params:
    """Every leaf copied to every device of ``mesh`` (``NamedSharding(mesh, P())``); each process fills its own devices,
    so every process must pass the same values. The ``jax.Array`` leaves go device to device: ``jax.device_put``
    there, then copied by one program (``device_put(..., may_alias=False)`` onto a subset of a leaf's devices hands
    back the leaf's own buffer). The arrays passed in are copied, never consumed; a 64-bit leaf JAX would narrow is
    refused (``check_dtypes``). ``copy=False``, for steps that never donate (on CPU devices a copy is new memory, page
    by page): the ``jax.Array`` leaves are only put there, and may share the caller's buffers."""
    check_dtypes(params, "strategies.replicate")
    sharding = NamedSharding(mesh, P())
    leaves, tree = jax.tree.flatten(params)
    on = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
    put = jax.device_put([leaves[i] for i in on], sharding) if on else []
    copies = dict(zip(on, _copy_program(sharding)(put) if on and copy else put))

    def place(i, leaf):
        if i in copies:
            return copies[i]
        leaf = np.array(leaf)
        return jax.make_array_from_callback(leaf.shape, sharding, lambda index: leaf[index])
    return jax.tree.unflatten(tree, [place(i, leaf) for i, leaf in enumerate(leaves)])


@functools.lru_cache(maxsize=64)
def _copy_program(sharding: NamedSharding) -> Callable:  # XLA writes new buffers: an output is never a parameter
    return jax.jit(lambda xs: [jnp.copy(x) for x in xs], out_shardings=sharding)


def stack_replicas(params: Params, mesh: Mesh) -> Params:
    """Every leaf as (n, ...), one copy per device, sharded on axis 0: pmap's layout; a ``jax.Array`` leaf goes device
    to device (``replicate(..., copy=False)``, then each device's copy stacked where it lies, into new buffers)."""
    check_dtypes(params, "strategies.stack_replicas")
    sharding = NamedSharding(mesh, P(AXIS))
    devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    leaves, tree = jax.tree.flatten(params)
    on = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]
    put = replicate([leaves[i] for i in on], mesh, copy=False) if on else []
    copies = dict(zip(on, _stacked(tuple(mesh.devices.flat))(put) if on else []))

    def stack(i, leaf):
        if i in copies:
            return copies[i]
        leaf = np.array(leaf)
        parts = [jax.device_put(leaf[None], d) for d in devices]
        return jax.make_array_from_single_device_arrays((mesh.devices.size,) + leaf.shape, sharding, parts)
    return jax.tree.unflatten(tree, [stack(i, leaf) for i, leaf in enumerate(leaves)])


def first_replica(stacked: Params) -> Params:
    """Host copy of this process's first replica of pmap-layout params."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0))[0, ...], stacked)  # 0-d: an array too


def to_host(params: Params) -> Params:
    """Host (NumPy) copy of replicated or single-device params, every leaf's copy started before any is waited for
    (``jax.device_get``); ValueError for a sharded leaf."""
    def one(x):
        if isinstance(x, jax.Array):
            if not x.sharding.is_fully_replicated:
                raise ValueError(f"to_host: expected replicated params, got sharding {x.sharding}")
            return x.addressable_data(0)
        return x
    return jax.tree.map(np.asarray, jax.device_get(jax.tree.map(one, params)))


def check_dtypes(tree, where: str) -> None:
    """ValueError naming the leaf where JAX would silently narrow a 64-bit leaf (float64, int64, complex128, NumPy's
    scalars too) because ``jax_enable_x64`` is off. Python's own bool, int, float and complex (weakly typed) pass."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or type(leaf) in (bool, int, float, complex):
            continue
        narrowed = jax.dtypes.canonicalize_dtype(dtype)
        if narrowed != dtype:
            raise ValueError(f"{where}: leaf {jax.tree_util.keystr(path) or '(root)'} is {np.dtype(dtype).name}, which "
                             f"JAX would silently train as {np.dtype(narrowed).name} because jax_enable_x64 is off; "
                             f"cast it (np.asarray(leaf, np.{np.dtype(narrowed).name})) or turn 64-bit on first "
                             f"(jax.config.update('jax_enable_x64', True)) to train in {np.dtype(dtype).name}")


# The training loop --------------------------------------------------------------------------------


def train_loop(step: Callable, state, batches: Iterable,
               callback: Callable[[int, Any], None] | None = None) -> tuple[Any, list]:
    """Runs ``state, value = step(state, batch)`` over ``batches``; returns (state, values). At most two steps are in
    flight: step s is dispatched, then step s - 1 is waited for (unbounded dispatch beside a loader's transfer thread
    deadlocked XLA's CPU all-reduce). ``callback(t, value)`` gets each step's value once, in step order, after the step
    has finished. ``step`` is any function of (state, batch), e.g. ``sharded_step``'s or ``canonical_step``'s with state
    = ``replicate((params, opt_state), mesh)``; on accelerators the plain steps consume (donate) the state passed in."""
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
    """Step values (each a pytree of replicated or host arrays) stacked on the host, leaf by leaf, (steps, ...); no
    values: (0,) float32. A sharded leaf (pmap's (n,) values) is refused: pass one replica. Every value's copy to the
    host is started before any is waited for (``jax.device_get``): one after another, a TPU v5e waits about 0.4 ms
    for each."""
    if not values:
        return np.zeros((0,), np.float32)

    def one(x):
        if isinstance(x, jax.Array):
            if not x.sharding.is_fully_replicated:
                raise ValueError(f"stack_losses: a value of shape {x.shape} is sharded ({x.sharding}), "
                                 f"not replicated: pass one replica, e.g. [v[0] for v in values]")
            return x.addressable_data(0)
        return x
    fetched = jax.device_get(jax.tree.map(one, values))
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *fetched)


# The plain steps: a gradient program of each strategy's own, then update_program ------------------


def checked_terms(loss_terms: LossTerms, params: Params, batch: dict) -> tuple:
    """``loss_terms(params, batch)`` with its contract checked at trace time: (total, count), count as float32 (exact
    for counts below 2**24)."""
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
    return total, jnp.asarray(count).astype(jnp.float32)


def _total_gradient(loss_terms: LossTerms) -> Callable:
    """(params, batch) -> (gradient of total, total, count)."""
    def gradient(params, batch):
        (total, count), grads = jax.value_and_grad(lambda p: checked_terms(loss_terms, p, batch), has_aux=True)(params)
        return grads, total, count
    return gradient


@functools.lru_cache(maxsize=64)
def update_program(update: Callable, donate: bool = False) -> Callable:
    """The update, one program every strategy and reduction shares: jit of ((params, opt_state), gradient sums, loss
    sum, count float32) -> ((params + updates, new state), loss), ``update``'s contract checked at trace time. grads =
    sums / max(count, 1), one IEEE division per entry (NumPy's float32 division's bits): for float32 and wider leaves
    the count, a whole number, is converted exactly to the leaf's dtype; for narrower ones (bfloat16 holds integers only
    up to 256) the sum is divided in float32 and the quotient cast. loss = total / max(count, 1) likewise. A program of
    its own, so that the optimizer's arithmetic is compiled alike whatever computed the gradient: XLA:CPU contracts a
    multiply and an add that share a fusion into one FMA, in an order that follows the fusion's layouts."""
    def apply(state, sums, total, count):
        params, opt_state = state
        count = jnp.maximum(count, 1.0)
        out = update(jax.tree.map(lambda g: _divided(g, count), sums), opt_state, params)
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
        return (apply_updates(params, updates), new_state), _divided(total, count)
    return jax.jit(apply, donate_argnums=(0,) if donate else (), compiler_options=CANONICAL_XLA_OPTIONS)


def _divided(x, count):
    if jnp.finfo(x.dtype).bits >= 32:
        return x / count.astype(x.dtype)
    return (x.astype(jnp.float32) / count).astype(x.dtype)


def donates(devices) -> bool:
    """Whether the plain steps donate their state: on accelerators, not on CPU devices, where XLA keeps a copy of a
    donated state anyway (a step held as much, and took as long)."""
    return all(d.platform != "cpu" for d in devices)


def plain_step(name: str, loss_terms: LossTerms, update: Callable, mesh: Mesh) -> tuple[Callable, Callable]:
    """Strategy ``name``'s plain step as the strategy runs it, and ``place(state, run_mesh, copy=True)``, which puts
    (params, opt_state) in the step's layout: ``pmap_step`` (stacked on ``mesh``), ``shard_map_step`` or
    ``sharded_step`` (replicated on ``run_mesh``: the mesh, or for ``single`` its first device, where the batches go
    too)."""
    if name == "pmap":
        return (pmap_step(loss_terms, update, tuple(mesh.devices.flat)),
                lambda state, _, copy=True: stack_replicas(state, mesh))  # stacking writes new buffers
    if name == "shard_map":
        return shard_map_step(loss_terms, update, mesh), replicate
    return sharded_step(loss_terms, update), replicate


@functools.lru_cache(maxsize=64)
def sharded_gradient(loss_terms: LossTerms) -> Callable:
    """``sharded_step``'s gradient program: jit of (params, batch) -> (gradient sums, loss sum, count), one per
    ``loss_terms`` for any optimizer (each step below likewise compiles its gradient once, apart from ``update``)."""
    return jax.jit(_total_gradient(loss_terms))


@functools.lru_cache(maxsize=64)
def sharded_step(loss_terms: LossTerms, update: Callable) -> Callable:
    """The plain step for your own loop: (state, batch) -> (state, loss), state = (params, opt_state) replicated
    (``replicate``), the batch sharded on 'data'. The gradient by a jit of its own (XLA adds the cross-device sums),
    then ``update_program``; the state is donated on accelerators."""
    gradient, check = sharded_gradient(loss_terms), door("sharded_step", loss_terms, "sharded")

    def step(state, batch):
        check(state[0], batch)
        leaf = next((x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)), None)
        apply = update_program(update, leaf is not None and donates(leaf.devices()))
        return apply(state, *gradient(state[0], batch))
    return step


@functools.lru_cache(maxsize=64)
def pmap_step(loss_terms: LossTerms, update: Callable, devices: tuple) -> Callable:
    """The pmap step over exactly ``devices``: state stacked (n, ...), batch (n, B, ...) -> (state (n, ...), loss
    (n,)). Each device's gradient of its total, psummed, then ``update_program`` on one replica and stacked again. (The
    notebooks' ``pmean`` of per-device mean gradients is this gradient only when every device holds as many real rows.)
    A pmap without ``devices=`` maps over the default backend's devices."""
    donate = donates(devices)
    gradient, apply = _pmap_gradient(loss_terms, devices), update_program(update, donate)
    first, stacked = _unstacked(devices, donate), _stacked(devices)
    check = door("pmap_step", loss_terms, "pmap", stacked=True, n=len(devices))

    def step(state, batch):
        check(state[0], batch)
        sums = gradient(state[0], batch)
        return stacked(apply(first(state), *first(sums)))
    return step


@functools.lru_cache(maxsize=64)
def _unstacked(devices: tuple, donate: bool) -> Callable:
    """pmap's layout (n, ...) to one replicated copy, each device keeping its own row (the rows are equal)."""
    mesh = Mesh(np.array(devices, dtype=object), (AXIS,))
    return jax.jit(jax.shard_map(lambda x: jax.tree.map(lambda y: y[0], x), mesh=mesh, in_specs=P(AXIS),
                                 out_specs=P(), check_vma=False), donate_argnums=(0,) if donate else ())


@functools.lru_cache(maxsize=64)
def _stacked(devices: tuple) -> Callable:
    """Replicated to pmap's layout (n, ...), each device stacking its own copy."""
    mesh = Mesh(np.array(devices, dtype=object), (AXIS,))
    return jax.jit(jax.shard_map(lambda x: jax.tree.map(lambda y: y[None], x), mesh=mesh, in_specs=P(),
                                 out_specs=P(AXIS), check_vma=False))


@functools.lru_cache(maxsize=64)
def _pmap_gradient(loss_terms: LossTerms, devices: tuple) -> Callable:
    def summed(params, batch):
        grads, total, count = _total_gradient(loss_terms)(params, batch)
        return lax.psum((grads, total, count), AXIS)
    return jax.pmap(summed, axis_name=AXIS, devices=list(devices))


@functools.lru_cache(maxsize=64)
def shard_map_step(loss_terms: LossTerms, update: Callable, mesh: Mesh) -> Callable:
    """The shard_map step for ``mesh``: the gradient of psum(total) by a jit(shard_map), then ``update_program``. The
    trap this form avoids: with ``check_vma=True`` (the default) and params entering replicated (``P()``), JAX already
    sums the gradient over devices (the transpose of the implicit broadcast is a psum). Porting pmap's ``grad`` then
    ``pmean(grads)`` trains with n times the gradient."""
    gradient = _shard_map_gradient(loss_terms, mesh)
    apply, check = update_program(update, donates(mesh.devices.flat)), door("shard_map_step", loss_terms, "sharded")

    def step(state, batch):
        check(state[0], batch)
        return apply(state, *gradient(state[0], batch))
    return step


@functools.lru_cache(maxsize=64)
def _shard_map_gradient(loss_terms: LossTerms, mesh: Mesh) -> Callable:
    def gradient(params, batch):
        def summed(p):
            total, count = checked_terms(loss_terms, p, batch)
            return lax.psum(total, AXIS), lax.psum(count, AXIS)
        (total, count), grads = jax.value_and_grad(summed, has_aux=True)(params)
        return grads, total, count
    return jax.jit(jax.shard_map(gradient, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P()))


# The canonical reduction: the same bits on every topology -----------------------------------------


@functools.lru_cache(maxsize=64)
def block_program(loss_terms: LossTerms) -> Callable:
    """One logical block's sums, a single-device jit: (params, rows of one block) -> (gradient of total, total, count),
    each leaf with a leading axis of 1. Every device runs this same program on its own blocks, whatever the mesh: no
    program's arithmetic depends on the number of devices. (Inside one multi-device program it would: a loop of one
    block is inlined and fused with its neighbours, and XLA compiles partitioned programs through other passes.) XLA
    binds an executable to its device, so the first step compiles it once per local device."""
    gradient = _total_gradient(loss_terms)
    return jax.jit(lambda params, rows: jax.tree.map(lambda x: x[None], gradient(params, rows)),
                   compiler_options=CANONICAL_XLA_OPTIONS)


# Where a device runs all its blocks in one program (``loop_program``), not a program per block: where a dispatch
# costs more than a small block (a TPU's, about 0.5 ms). Not on CPUs, where a conv net's gradient inside a loop compiles
# 20-40x slower (XLA:CPU leaves its convolutions off their fast path). The blocks' sums and their order are the same.
LOOP_PLATFORMS = ("tpu",)
LOOP_SLOTS = 2  # the fewest slots loop_program's loop indexes (its docstring says why)


@functools.lru_cache(maxsize=64)
def loop_program(loss_terms: LossTerms, blocks: int, summed: bool) -> Callable:
    """A device's k = ``blocks`` slots in one single-device jit: (params, its k*b rows in either layout, an int32 array
    holding its blocks, k or k - 1) -> the k slots' sums stacked (k, ...) in slot order, or with ``summed`` their
    ``exact_sum`` (``whole``). Block i is iteration i of a ``while`` loop whose trip count is that array, a value XLA
    cannot see: it can neither remove the loop (at k = 1) nor unroll it, so every block runs the loop body's one
    compiled code, and the body is the same for every k, k's own dimension aside (the HLO test compares them). The sums
    go into a buffer that the sum reads after the loop: no add can join a block's arithmetic. The buffer starts
    uninitialised (``lax.empty``; zeros on CPUs) but for its slot k - 1, zeros: the iterations write every other entry
    (zeroing them would be a pass over k gradients for nothing), and a device with a spare slot runs k - 1 trips and
    leaves that slot zero. The rows and the buffer have ``max(k, LOOP_SLOTS)`` slots; a slot past k is zeros, never
    visited. At one slot, every iteration would read slot 0, a fact XLA sees: it hoists the block's arithmetic out of
    the loop and fuses it with its neighbours, and on AVX2 CPUs a LayerNorm bias's gradient came out one rounding apart
    from k = 8's."""
    gradient = _total_gradient(loss_terms)
    slots = max(blocks, LOOP_SLOTS)

    def run(params, rows, trips):
        if jnp.ndim(rows["mask"]) == 2:  # layout "pmap": (1, k*b, ...)
            rows = jax.tree.map(lambda x: x[0], rows)
        stacked = jax.tree.map(lambda x: x.reshape((blocks, x.shape[0] // blocks) + x.shape[1:]), rows)
        stacked = jax.tree.map(lambda x: jnp.pad(x, [(0, slots - blocks)] + [(0, 0)] * (x.ndim - 1)), stacked)
        shapes = jax.eval_shape(gradient, params, jax.tree.map(lambda x: x[0], stacked))

        def body(i, sums):
            block = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, 0, keepdims=False), stacked)
            return jax.tree.map(lambda buffer, x: lax.dynamic_update_index_in_dim(buffer, x, i, 0), sums,
                                gradient(params, block))
        empty = jax.tree.map(lambda s: lax.dynamic_update_index_in_dim(
            lax.empty((slots,) + s.shape, s.dtype), jnp.zeros(s.shape, s.dtype), blocks - 1, 0), shapes)
        sums = jax.tree.map(lambda x: x[:blocks], lax.fori_loop(0, trips, body, empty))
        return summation.exact_sum(sums, whole=True) if summed else sums
    return jax.jit(run, compiler_options=CANONICAL_XLA_OPTIONS)


@functools.lru_cache(maxsize=64)
def _split_program(blocks: int, pmap_layout: bool) -> Callable:
    """A device's rows ((k*b, ...), or (1, k*b, ...) in layout "pmap") -> k blocks of b rows."""
    def split(rows):
        if pmap_layout:
            rows = jax.tree.map(lambda x: x[0], rows)
        b = jax.tree.leaves(rows)[0].shape[0] // blocks
        return [jax.tree.map(lambda x: x[i * b:(i + 1) * b], rows) for i in range(blocks)]
    return jax.jit(split)


@functools.lru_cache(maxsize=64)
def sum_program(mesh: Mesh, per_device: int) -> Callable:
    """jit(shard_map) on ``mesh``: ``rounds``, pytrees whose leaves are sharded on 'data' -> ``exact_sum`` over the
    L = n*k blocks, k = ``per_device``, replicated. Device d's entries of the rounds are its k blocks (k rounds of one
    block each, or one round of k). What moves: one pmax of per-leaf scalars; then a piece of at most PIECE entries of
    a leaf at a time: at k = 1 the blocks' float32 entries, scaled to the grid (``_scaled``), by an all_to_all (each
    device then converts and adds every block's 1/n of the piece's entries), else K int32 limbs per entry by a
    reduce-scatter (in a step with a NaN or an infinity, another pmax, and two int32 counts per entry by another
    reduce-scatter); then an all_gather of the piece's results. At k = 1 that is a float32 all-reduce's bytes."""
    def run(rounds):  # exact_sum's slices of the concatenation are its rounds: XLA reads each where it lies
        return summation.exact_sum(jax.tree.map(lambda *xs: jnp.concatenate(xs), *rounds), AXIS)
    return jax.jit(jax.shard_map(run, mesh=mesh, in_specs=P(AXIS), out_specs=P(), check_vma=False),
                   compiler_options=CANONICAL_XLA_OPTIONS)


def canonical_step(loss_terms: LossTerms, update: Callable, mesh: Mesh, logical_shards: int) -> Callable:
    """One canonical step: (state, batch) -> (state, loss), state = (params, opt_state) replicated on ``mesh``
    (``replicate``), the batch n*k*b rows sharded on 'data' in either layout, L = ``logical_shards`` from the mesh's n
    devices to MAX_BLOCKS, k = ceil(L/n) slots a device, as the module's docstring lays them out (a spare slot: zeros,
    no gradient run). The state is not donated. On LOOP_PLATFORMS each device runs ``loop_program`` (on one device,
    summing too), else ``block_program`` once per block; then ``sum_program`` and ``update_program``."""
    n = mesh.devices.size
    _check_devices("canonical_step", logical_shards, n)
    if logical_shards > summation.MAX_BLOCKS:
        raise ValueError(f"canonical_step: logical_shards={logical_shards} is over {summation.MAX_BLOCKS} "
                         f"(MAX_BLOCKS): the exact sum's int32 limbs hold that many blocks")
    k = -(-logical_shards // n)
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    held = dict(zip(mesh.devices.flat, (_slots(logical_shards, n) >= 0).sum(axis=1).tolist()))  # blocks a device
    total, apply = sum_program(mesh, k), update_program(update)
    checks = {layout: door("canonical_step", loss_terms, layout, logical_shards, n=n) for layout in ("sharded", "pmap")}

    def check(params, batch):
        pmap_layout = isinstance(batch, dict) and "mask" in batch and np.ndim(batch["mask"]) == 2
        checks["pmap" if pmap_layout else "sharded"](params, batch)

    if mesh.devices.flat[0].platform in LOOP_PLATFORMS:
        loop = loop_program(loss_terms, k, n == 1)
        trips = {d: jax.device_put(np.int32(held[d]), d) for d in local}
        if n == 1:
            def step(state, batch):
                check(state[0], batch)
                return apply(state, *loop(state[0], _rows(batch), trips[local[0]]))
            return step

        def sums_of(params, rows):
            return [_assembled({d: loop(params[d], rows[d], trips[d]) for d in local}, mesh, P(AXIS))]
    else:
        block, zeros = block_program(loss_terms), {}

        def sums_of(params, rows):
            pmap_layout = jnp.ndim(rows[local[0]]["mask"]) == 2
            split = _split_program(k, pmap_layout) if k > 1 or pmap_layout else (lambda r: [r])
            sums = {d: [block(params[d], blk) for blk in split(rows[d])[:held[d]]] for d in local}
            for d in (d for d in local if held[d] < k):  # the spare slot: zeros, made once
                if d not in zeros:
                    zeros[d] = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=d), sums[d][0])
                sums[d].append(zeros[d])
            return [_assembled({d: sums[d][i] for d in local}, mesh, P(AXIS)) for i in range(k)]

    def step(state, batch):
        check(state[0], batch)
        params, rows = _by_device(state[0], local), _by_device(_rows(batch), local)
        held = _by_device((state, *total(sums_of(params, rows))), local)
        return _assembled({d: apply(*held[d]) for d in local}, mesh, P())
    return step


def _rows(batch: dict) -> dict:
    return {key: x for key, x in batch.items() if key != SHARDS_KEY}


def _by_device(tree, devices: list) -> dict:
    """{device: ``tree`` with each leaf replaced by its shard on that device}."""
    leaves, structure = jax.tree.flatten(tree)
    shards = [{s.device: s.data for s in x.addressable_shards} for x in leaves]
    return {d: jax.tree.unflatten(structure, [s[d] for s in shards]) for d in devices}


def _assembled(by_device: dict, mesh: Mesh, spec: P):
    """This process's per-device trees as one global tree: replicated (``P()``) or concatenated on the device axis
    (``P(AXIS)``, every device's leaves of one shape)."""
    devices = [d for d in mesh.devices.flat if d in by_device]
    leaves = [jax.tree.leaves(by_device[d]) for d in devices]
    structure = jax.tree.structure(by_device[devices[0]])
    sharding = NamedSharding(mesh, spec)
    out = []
    for i, x in enumerate(leaves[0]):
        shape = x.shape if spec == P() else (mesh.devices.size * x.shape[0],) + x.shape[1:]
        out.append(jax.make_array_from_single_device_arrays(shape, sharding, [l[i] for l in leaves]))
    return jax.tree.unflatten(structure, out)
