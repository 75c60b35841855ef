"""The plan: which sample sits in which slot of which shard's batch at which step.

This is the spec every backend follows (the reference loader in loaders.py, DALI
and rocAL in ``order="plan"``, and what conformance.py holds any loader to). It
is pure NumPy, imports nothing else, starts no thread and touches no device:
copy it alone into another project.

The contract, in the order the pieces are used:

* ``shard_bounds`` partitions ``range(N)`` into ``n`` contiguous shards: shard k
  is ``[N*k//n, N*(k+1)//n)``, the partition rocAL and DALI use. Shard sizes
  differ by at most one.
* ``num_steps`` is the number of steps of an epoch, the same for every shard.
* ``epoch_plan`` turns (N, n, B, epoch, seed, shuffle, last_batch) into the whole
  epoch as data (a ``Plan``): which sample sits in which slot of which shard's
  batch at which step, and whether that slot is real (mask True) or padding
  (mask False). Batches are therefore a pure function of (seed, epoch, step,
  shard): resuming mid-epoch on the same shards (the same n and B; with logical
  shards, the same L and b on any devices) needs the step number and nothing
  else, and on any other shards a ``LoaderState``. ``shard_permutation`` is its shuffle, specified bit for bit.
* Logical shards: the plan's n shards need not be the devices. A plan over L
  logical shards of b rows (``epoch_plan(N, L, b)``) runs on any n devices that
  divide L: device k reads logical shards k*L/n .. (k+1)*L/n - 1, their blocks one
  after the other (``on_devices``). The global batch of a step is then the same
  L*b rows, in the same order, with the same mask, whatever n: a function of (N, L,
  b, seed, epoch, step) alone. L = n, one logical shard a device, is the default
  and the notebooks' case.
* ``elastic_plan`` is an epoch resumed on another number of shards or batch
  size: a chain of ``Segment``s, the samples not yet delivered split among the
  new shards. ``LoaderState`` is the small plain value a job saves
  (``to_json``) and a loader resumes from, on any shards (``resized``), naming
  the data it was taken on (``dataset_digest``: a digest of every name, dtype,
  shape and byte); ``resume_state`` is the one check every backend makes of it.

Remainder handling, worked (DALI's LastBatchPolicy table, for shards). Data is
samples 0..6 (N=7), two shards (n=2), per-shard batch B=2, no shuffle.
Shard 0 is [0, 3) = {0, 1, 2}; shard 1 is [3, 7) = {3, 4, 5, 6}.
``*`` marks a padding slot (mask False) that repeats the shard's last sample:

    policy | steps                 | step 0 (shard 0, 1) | step 1 (shard 0, 1)
    -------+-----------------------+---------------------+--------------------
    fill   | ceil(ceil(7/2)/2) = 2 | [0, 1]  [3, 4]      | [2, 2*]  [5, 6]
    drop   | (7//2)//2 = 1         | [0, 1]  [3, 4]      | (none: 2, 5, 6 skipped)

Guarantees (each is tested in test_plan.py):

* Every shard runs the same number of steps in an epoch (SPMD collectives need
  it: a device with one step fewer would hang the others).
* fill: over one epoch every sample of range(N) has exactly one mask-True slot.
  Padding slots repeat a real sample of the same shard and are masked False, so a
  masked loss or accuracy counts each sample exactly once (rocAL's and DALI's
  FILL repeat samples but do not say which slots are padding).
* drop: every sample appears at most once and exactly ``n * steps * B`` appear.
* shuffle: each shard's order is a permutation of that shard, a deterministic
  function of (seed, epoch, shard) alone, computed from NumPy's PCG64 raw bit
  stream and SeedSequence (both specified bit for bit, so stable across NumPy
  versions). Seeds are mixed by SeedSequence, never added: (seed 1, epoch 0) and
  (seed 0, epoch 1) give unrelated orders. Shards never exchange samples within
  a segment (rocAL's and DALI's ``stick_to_shard`` behaviour).
* An epoch resumed on other shards (``elastic_plan``) delivers the samples not
  yet delivered exactly once (fill), or at most once with a stated count (drop).

Logical shards, worked (N=7, L=4 logical shards of b=1, fill, no shuffle: logical
shards [0, 1), [1, 3), [3, 5), [5, 7); 2 steps; ``*`` a padding slot). The global
batch is [0, 1, 3, 5] at step 0 and [0*, 2, 4, 6] at step 1 on every device count:

    devices | device 0          | device 1          | device 2 | device 3
    --------+-------------------+-------------------+----------+---------
    4       | [0] [0*]          | [1] [2]           | [3] [4]  | [5] [6]
    2       | [0,1] [0*,2]      | [3,5] [4,6]       |          |
    1       | [0,1,3,5] [0*,2,4,6]                  |          |

(each cell: the device's rows at step 0, then at step 1). 3 devices do not divide
L = 4 and are refused. A device's logical shards together are exactly shard k of n
(N*(k*L/n)//L = N*k//n), so a device holds the same samples whatever L; only the
order and the batching follow L.

Deliberate differences from rocAL and DALI: shuffle honours ``seed`` and changes
every epoch (rocAL seeds its shuffle with the shard index alone; DALI
pre-permutes with a fixed seed).

Inputs, everywhere in this module: an int parameter takes a Python or NumPy integer,
never a bool (True is not 1 here) and never a float, even a whole one (5.0 would
make float bounds); a bool parameter takes Python's or NumPy's bool, nothing else.
A wrong type or value raises ValueError at the call, naming the function, the
parameter and the value.

Imports: NumPy, and hashlib and json of the standard library (where they are used).
Imported by loaders.py, conformance.py, dali_loader.py,
rocal_loader.py, checkpoints.py and refimpl.py. NumPy >= 1.25.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Callable, NamedTuple, Sequence

import numpy as np

LAST_BATCH_POLICIES = ("fill", "drop")


# --------------------------------------------------------------------------
# Sharding and the epoch plan
# --------------------------------------------------------------------------


def shard_bounds(num_samples: int, shard_id: int, num_shards: int) -> tuple[int, int]:
    """Shard ``shard_id`` of ``num_shards`` over ``range(num_samples)``: the half-open
    ``[N*k//n, N*(k+1)//n)`` with N = num_samples, k = shard_id, n = num_shards,
    integer (floor) division on exact integers.

    The shards tile range(N) in order with no gap or overlap; their sizes are
    floor(N/n) or ceil(N/n), and the larger ones are not all at one end (N=7,
    n=3 gives [0, 2), [2, 4), [4, 7)). It is rocAL's and DALI's partition, so a
    vendor reader fed shard k reads the same samples.

    Accepted: three ints (Python or NumPy integers; every int parameter of this
    module takes exactly these: never a bool, nor a float even when it is whole).
    Returns Python ints. Validated here: ValueError, naming the parameter and the
    value, for a parameter that is not an int, num_shards < 1, num_shards >
    num_samples (a shard would be empty), or shard_id outside [0, num_shards).
    """
    return _bounds("shard_bounds", num_samples, shard_id, num_shards)


class Plan(NamedTuple):
    """One epoch as data. ``indices`` int64 and ``mask`` bool, both (steps, num_shards, B).

    ``indices[s, k]`` are the sample indices of shard k's batch at step s; ``mask``
    is False exactly on padding slots.
    """
    indices: np.ndarray
    mask: np.ndarray


def num_steps(num_samples: int, num_shards: int, batch_size: int, last_batch: str) -> int:
    """Steps per epoch, the same for every shard (N = num_samples, n = num_shards,
    B = batch_size, exact integer arithmetic):

        fill: ceil(ceil(N/n) / B)   -- the largest shard's batches, the last one padded
        drop: floor(floor(N/n) / B) -- the smallest shard's whole batches

    A batch larger than the smallest shard is allowed here (fill pads, drop gives
    0 steps); ``make_loader`` refuses it as a policy. Accepted: ints (as
    ``shard_bounds``) and a policy string; returns a Python int. Validated here: ValueError for an
    unknown last_batch, a count that is not an int, batch_size < 1, or
    num_shards outside [1, N].
    """
    check_policy(last_batch, "num_steps")
    _bounds("num_steps", num_samples, 0, num_shards)  # the counts' types, num_shards against N
    _check_int("num_steps", "batch_size", batch_size, 1)
    num_samples, num_shards, batch_size = int(num_samples), int(num_shards), int(batch_size)
    if last_batch == "fill":
        return -(-(-(-num_samples // num_shards)) // batch_size)
    return (num_samples // num_shards) // batch_size


def epoch_plan(num_samples: int, num_shards: int, batch_size: int, *, epoch: int = 0,
               seed: int = 0, shuffle: bool = False, last_batch: str = "fill") -> Plan:
    """The sample in every slot of every batch of one epoch (the module docstring's table).

    With S = num_steps(N, n, B, last_batch) and, for each shard k,
    ``start, stop = shard_bounds(N, k, n)`` and L = stop - start:

        order = [start + p for p in shard_permutation(L, seed=seed, epoch=epoch, shard=k)]
                if shuffle else [start, start + 1, ..., stop - 1]
        real  = min(S * B, L)                        # drop: L >= S * B, so real = S * B
        slot j of shard k, j = s * B + b  (0 <= j < S * B):
            j <  real: indices[s, k, b] = order[j],        mask True
            j >= real: indices[s, k, b] = order[real - 1], mask False   (padding)

    So: the permutation is of local positions 0..L-1 and the shard offset is added
    after it; drop shuffles the whole shard and then keeps its first S*B samples
    (shuffle, then truncate: which samples are skipped changes every epoch);
    padding slots are the shard's last slots of the epoch (its final batch's
    tail) and repeat the last real sample *in epoch order* (with shuffle, not the
    shard's highest index). Without shuffle, ``seed`` and ``epoch`` do not change
    the plan. These choices are arbitrary among equally valid ones; they are the
    ones the vendors' readers produce when fed this order (DALI and rocAL pad by
    repeating the last sample read).

    Accepted: ints for the counts, seed and epoch (as ``shard_bounds``), shuffle
    a bool (Python's or NumPy's), last_batch a policy string. Validated here:
    ValueError, naming the parameter and the value, for an unknown last_batch, a
    parameter of another type, batch_size < 1, num_shards outside [1, N], or a
    seed or epoch outside [0, 2**32) (checked with or without shuffle, so a plan
    that is valid unshuffled stays valid shuffled). A batch larger than the
    smallest shard is allowed (see num_steps).
    """
    where = "epoch_plan"
    check_policy(last_batch, where)
    _bounds(where, num_samples, 0, num_shards)
    _check_int(where, "batch_size", batch_size, 1)
    check_seed("epoch", epoch, where)
    check_seed("seed", seed, where)
    _check_bool(where, "shuffle", shuffle)
    num_samples, num_shards, batch_size = int(num_samples), int(num_shards), int(batch_size)
    steps = num_steps(num_samples, num_shards, batch_size, last_batch)
    slots = steps * batch_size
    indices = np.empty((num_shards, slots), np.int64)
    mask = np.zeros((num_shards, slots), bool)
    for k in range(num_shards):
        start, stop = shard_bounds(num_samples, k, num_shards)
        order = np.arange(start, stop)
        if shuffle:
            order = order[shard_permutation(stop - start, seed=seed, epoch=epoch, shard=k)]
        real = min(slots, len(order))
        indices[k, :real] = order[:real]
        indices[k, real:] = order[real - 1] if real else start
        mask[k, :real] = True
    shape = (num_shards, steps, batch_size)
    return Plan(indices.reshape(shape).swapaxes(0, 1).copy(), mask.reshape(shape).swapaxes(0, 1).copy())


def on_devices(plan: Plan, num_devices: int) -> Plan:
    """``plan`` (steps, L, b) over L logical shards as ``num_devices`` = n devices read it:
    a Plan (steps, n, (L/n)*b) whose row k at step s is device k's block, the blocks
    of logical shards k*L/n .. (k+1)*L/n - 1 at step s one after the other:

        out.indices[s, k, j*b + i] = plan.indices[s, k*L/n + j, i]   (0 <= j < L/n, 0 <= i < b)

    and ``out.mask`` likewise (a reshape of the last two axes: a view, no copy). With
    n = L it is ``plan`` itself in shape. The global batch, the blocks of devices
    0 .. n-1 one after the other, is therefore ``plan.indices[s].reshape(-1)`` for
    every n. ValueError unless ``plan`` is a Plan of two 3-d arrays and n an int in
    [1, L] that divides L."""
    if not isinstance(plan, Plan) or np.ndim(plan.indices) != 3 or np.shape(plan.mask) != np.shape(plan.indices):
        raise ValueError(f"on_devices: plan must be a Plan of (steps, L, b) indices and mask, got "
                         f"{type(plan).__name__}")
    steps, L, b = plan.indices.shape
    if not _is_int(num_devices) or not 1 <= num_devices <= L or L % num_devices:
        raise ValueError(f"on_devices: num_devices={num_devices!r} does not divide the plan's "
                         f"{L} logical shards (a device reads L/n whole logical shards)")
    shape = (steps, num_devices, (L // num_devices) * b)
    return Plan(plan.indices.reshape(shape), plan.mask.reshape(shape))


def shard_permutation(size: int, *, seed: int, epoch: int, shard: int) -> np.ndarray:
    """A permutation of range(size) (int64, shape (size,)) that depends on (seed, epoch, shard) alone:

        ss   = numpy.random.SeedSequence([seed, epoch, shard])  # entropy: this list, this order
        keys = numpy.random.PCG64(ss).random_raw(size)          # the first `size` raw uint64 outputs
        perm = argsort(keys), ascending, stable                  # perm[i] = j of the i-th smallest key

    Equal keys (probability about size**2 / 2**65) keep ascending j, which is what
    a stable sort gives; ``perm`` is the sorting permutation, not the ranks (its
    inverse). Why this construction: SeedSequence's hashing and PCG64's output
    function are specified by NumPy bit for bit (and stable across versions),
    while ``Generator.permutation``'s algorithm may change between versions. The
    three numbers are mixed by SeedSequence, never added, so (seed 1, epoch 0)
    and (seed 0, epoch 1) give unrelated orders. size 0 gives an empty array.

    Accepted: four ints (as ``shard_bounds``). Validated here: ValueError, naming
    the parameter and the value, for one that is not an int, a negative size, or
    a seed, epoch or shard outside [0, 2**32) (check_seed says why).
    """
    size = _check_int("shard_permutation", "size", size, 0)
    check_seed("seed", seed, "shard_permutation")
    check_seed("epoch", epoch, "shard_permutation")
    check_seed("shard", shard, "shard_permutation")
    keys = np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch), int(shard)])).random_raw(size)
    return np.argsort(keys, kind="stable").astype(np.int64, copy=False)


def check_seed(name: str, value: int, where: str) -> None:
    """Raises ValueError, starting with ``where`` and naming ``name`` and the value, unless
    ``value`` is an int (as ``shard_bounds``: never a bool or a float) with 0 <= value < 2**32.

    SeedSequence splits an int >= 2**32 into several 32-bit words, so a larger
    value would alias another triple: (seed 2**32, epoch 0) reads as (0, 1, 0)."""
    if not _is_int(value):
        raise ValueError(f"{where}: {name} must be an int in [0, 2**32), got {value!r}")
    if not 0 <= value < 2**32:
        raise ValueError(f"{where}: {name}={value} is outside [0, 2**32)")


def check_policy(last_batch: str, where: str | None = None) -> None:
    """Raises ValueError, starting with ``where`` when given, unless ``last_batch`` is a
    string, one of LAST_BATCH_POLICIES."""
    if not isinstance(last_batch, str) or last_batch not in LAST_BATCH_POLICIES:
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}last_batch must be one of {LAST_BATCH_POLICIES}, got {last_batch!r}")


# --------------------------------------------------------------------------
# Elastic epochs: an epoch resumed on another number of shards
# --------------------------------------------------------------------------


class Segment(NamedTuple):
    """A stretch of one epoch run by one set of shards: from global step ``start`` of the
    epoch until the next segment's start (or the epoch's end), ``num_shards`` shards of
    ``batch_size`` samples each. Plain tuples and lists ``[start, n, B]`` are accepted
    wherever a Segment is."""
    start: int
    num_shards: int
    batch_size: int


def elastic_plan(num_samples: int, segments: Sequence, *, epoch: int = 0, seed: int = 0,
                 shuffle: bool = False, last_batch: str = "fill") -> list[Plan]:
    """One epoch run by a chain of shard sets: ``plans[i]`` is what segment i delivers.

    ``segments`` is ``[(t_0, n_0, B_0), (t_1, n_1, B_1), ...]``: segment i runs from
    global step t_i of the epoch on n_i shards of per-shard batch B_i, until t_{i+1}
    (the last one until the epoch ends). ``plans[i]`` is a ``Plan`` of shape
    (d_i, n_i, B_i): row r is global step t_i + r. With one segment [(0, n, B)] the
    result is ``[epoch_plan(N, n, B, ...)]``, bit for bit. The next epoch is a fresh
    ``epoch_plan`` on the last segment's (n, B).

    The construction. R_i is the pool of segment i: the samples not delivered in
    a real (mask True) slot before step t_i, in ascending order; R_0 = [0, 1, ..., N-1].
    With m = len(R_i), n = n_i, B = B_i:

        S_i = 0                      if i >= 1 and t_i == t_{i-1} + S_{i-1}  (the epoch had ended)
            = ceil(ceil(m/n) / B)    fill   -- the largest run's batches, the last one padded
            = floor(floor(m/n) / B)  drop   -- the smallest run's whole batches
        d_i = t_{i+1} - t_i if a segment i+1 follows (refused unless 1 <= d_i <= S_i), else S_i
        new shard k (0 <= k < n):
            lo, hi = m*k // n, m*(k+1) // n               # shard_bounds' formula on pool positions
            run    = R_i[lo:hi]                           # empty when m < n and m*k//n == m*(k+1)//n
            order  = [run[p] for p in perm] if shuffle else run
                     perm = argsort(PCG64(SeedSequence(E)).random_raw(len(run))), ascending, stable
                     E = [seed, epoch, k] for i = 0, [seed, epoch, k, i] for i >= 1
            real   = min(S_i * B, len(run))
            slot j = s*B + b, 0 <= j < S_i*B:
                j <  real: indices[s, k, b] = order[j],                                  mask True
                j >= real: indices[s, k, b] = order[real-1] if real else R_i[lo],        mask False
        plans[i] = rows s < d_i of that (S_i, n, B) plan
        R_{i+1}  = R_i without the samples of plans[i]'s mask-True slots, ascending

    So segment 0 is exactly epoch_plan (R_0 = range(N), runs = shard_bounds(N, k, n),
    E = shard_permutation's), and every later segment is the same construction on
    what is left: the samples delivered before a change are exactly those of the old
    segment's plan at its steps before the change, and the new shards split the rest
    into contiguous runs of the ascending pool. Samples move between shards at a
    change (the new runs need not lie in the old shards), so ``stick_to_shard`` holds
    within a segment only. Why E: SeedSequence hashes a missing entropy word as 0
    (it pads to its pool size of 4), so [seed, epoch, k, 0] would be epoch_plan's
    [seed, epoch, k] stream again; a fourth word i >= 1 never is, and segment i of
    epoch e never reuses another (segment, epoch, shard)'s stream. The pool depends
    on the whole chain, so a change back to an earlier (n, B) does not restore the
    earlier plan (the rows below show one).

    Edges, decided: a change at step 0 is not a segment (t_0 = 0 < t_1 < ... is
    required): an epoch that starts on (n', B') is [(0, n', B')], a fresh epoch_plan
    (``LoaderState.resized`` replaces a segment that ran no step). A change at the
    epoch's end (t_{i+1} = t_i + S_i) gives a segment of 0 steps: fill has nothing
    left, and drop's unread samples stay skipped, so a state at the end of epoch e
    means the same as one at the start of e+1. A change after the end is refused
    (those steps ran on no shards), and so is any segment after a 0-step one. When
    fewer samples remain than new shards (m < n, fill), S_i = 1 and the shards whose
    run is empty hold B padding slots repeating R_i[lo], the smallest sample of the
    next non-empty run (real in that shard at that step); drop then has 0 steps. A
    batch larger than a run is allowed (fill pads; drop gives 0 steps). Every shard
    of a segment runs d_i steps. Padding slots are masked False and repeat a sample
    that is real at the same or an earlier step of the same segment.

    Counts: fill delivers every sample of range(N) in exactly one mask-True slot over
    the epoch. drop delivers each sample at most once, and exactly
    sum_i n_i * B_i * d_i of them (drop has no padding); the other
    N - sum_i n_i * B_i * d_i are skipped: the last segment's pool minus what it
    delivers. The epoch has t_last + d_last steps (``elastic_num_steps``); neither
    count depends on seed, epoch or shuffle.

    Worked (N=7, no shuffle; a batch is [..], shards left to right, ``*`` marks a
    padding slot (mask False); steps are the epoch's global steps):

        segments (start, n, B)   | policy | step 0       | step 1            | step 2     | steps
        -------------------------+--------+--------------+-------------------+------------+------
        (0,2,2)                  | fill   | [0,1] [3,4]  | [2,2*] [5,6]      |            | 2
        (0,2,2) (1,3,1)          | fill   | [0,1] [3,4]  | [2] [5] [6]       |            | 2
        (0,2,2) (1,3,1)          | drop   | [0,1] [3,4]  | (none: the end)   |            | 1
        (0,2,2) (1,2,1)          | fill   | [0,1] [3,4]  | [2] [5]           | [2*] [6]   | 3
        (0,2,2) (1,4,1)          | fill   | [0,1] [3,4]  | [2*] [2] [5] [6]  |            | 2
        (0,2,2) (1,1,4)          | fill   | [0,1] [3,4]  | [2,5,6,6*]        |            | 2
        (0,2,2) (2,3,1)          | fill   | [0,1] [3,4]  | [2,2*] [5,6]      | (none left)| 2
        (0,3,1) (1,2,1)          | drop   | [0] [2] [4]  | [1] [5]           | [3] [6]    | 3
        (0,2,1) (1,3,1) (2,2,1)  | fill   | [0] [3]      | [1] [2] [5]       | [4] [6]    | 3

    Row 2: the pool after step 0 is [2, 5, 6]; three runs of one. Row 3: drop's
    epoch on 2 shards has 1 step, so a change at step 1 is at its end: 2, 5 and 6
    stay skipped. Row 4: the same n with another B: runs [2] and [5, 6]. Row 5: 3
    samples on 4 shards; shard 0's run is empty and pads with 2. Row 6: a batch
    larger than the pool. Row 7: a change at the end, nothing left. Row 8:
    unchanged, drop on 3 shards skips 6; after the change nothing is skipped (the
    pool [1, 3, 5, 6] splits evenly). Row 9: back to 2 shards of 1, yet not
    epoch_plan(7, 2, 1)'s steps 2.. ([2] [5]). The epoch after row 2 is
    epoch_plan(7, 3, 1, epoch=1).

    Validated here (ValueError naming the parameter and its value): an unknown
    last_batch; num_samples < 1; seed or epoch outside [0, 2**32) (with or without
    shuffle); shuffle not a bool; an empty ``segments``; a segment that is not
    three integers; a start < 0, num_shards < 1 or > num_samples (a fresh epoch on
    it would have an empty shard), batch_size < 1; t_0 != 0; starts not strictly
    increasing; a start after the previous segment's end.
    """
    where = "elastic_plan"
    check_seed("seed", seed, where)
    check_seed("epoch", epoch, where)
    shuffle = _check_bool(where, "shuffle", shuffle)
    segments, steps = _elastic_steps(where, num_samples, segments, last_batch)
    taken = np.zeros(num_samples, bool)
    plans = []
    for i, ((_, n, B), (S, rows)) in enumerate(zip(segments, steps)):
        full = _segment_plan(np.flatnonzero(~taken), n, B, S, segment=i, epoch=int(epoch), seed=int(seed),
                             shuffle=shuffle)
        plan = Plan(full.indices[:rows].copy(), full.mask[:rows].copy())
        taken[plan.indices[plan.mask]] = True
        plans.append(plan)
    return plans


def elastic_num_steps(num_samples: int, segments: Sequence, last_batch: str = "fill") -> int:
    """Global steps of the epoch ``elastic_plan`` describes: t_last + d_last (the last
    segment's start plus its steps). Equal to ``num_steps(N, n, B, last_batch)`` for one
    segment [(0, n, B)]. Validated as elastic_plan validates its segments."""
    segments, steps = _elastic_steps("elastic_num_steps", num_samples, segments, last_batch)
    return segments[-1].start + steps[-1][1]


def remaining_samples(num_samples: int, segments: Sequence, step: int, *, epoch: int = 0,
                      seed: int = 0, shuffle: bool = False, last_batch: str = "fill") -> np.ndarray:
    """The samples not delivered in a real slot of ``elastic_plan``'s epoch before global
    ``step``, ascending (int64): at a segment's start, its pool R_i. ``step`` must lie in
    [0, elastic_num_steps(...)]; at the end it is the empty array (fill) or the skipped
    samples (drop). Validated as elastic_plan validates its arguments, and step an int."""
    where = "remaining_samples"
    segments, _ = _elastic_steps(where, num_samples, segments, last_batch)
    check_seed("seed", seed, where)
    check_seed("epoch", epoch, where)
    _check_bool(where, "shuffle", shuffle)
    step = _check_int(where, "step", step, 0)
    plans = elastic_plan(num_samples, segments, epoch=epoch, seed=seed, shuffle=shuffle,
                         last_batch=last_batch)
    end = segments[-1].start + len(plans[-1].indices)
    if step > end:
        raise ValueError(f"remaining_samples: step={step} is outside [0, {end}] (the epoch's steps)")
    taken = np.zeros(num_samples, bool)
    for (start, _, _), plan in zip(segments, plans):
        rows = max(0, min(step - start, len(plan.indices)))
        taken[plan.indices[:rows][plan.mask[:rows]]] = True
    return np.flatnonzero(~taken).astype(np.int64)


# --------------------------------------------------------------------------
# The data a state was taken on
# --------------------------------------------------------------------------

DIGEST_BLOCK_BYTES = 16 * 2**20  # dataset_digest reads this much at a time (a memory map is never copied whole)


def dataset_digest(arrays: Mapping) -> str:
    """The identity of a dataset of named arrays, as a ``LoaderState`` names it: 32
    lowercase hex digits, the BLAKE2b digest of 16 bytes (``hashlib.blake2b(
    digest_size=16)``: no key, salt or personalisation) of, in this order,

        for name in sorted(arrays):          # the names in code-point order, each once
            a = numpy.asarray(arrays[name])
            header = json.dumps([name, a.dtype.str, a.dtype.name, list(a.shape)],
                                separators=(",", ":"))    # json's defaults otherwise (ASCII)
            hash header.encode("utf-8") + b"\n"          # e.g. ["labels","<i4","int32",[50000]]
            hash the bytes of a in C (row-major) order, each element as stored

    (dtype.str gives the byte order and size, "<i4" and ">i4" being other bytes;
    dtype.name the kind, which dtype.str alone does not for ml_dtypes: float8_e4m3fn
    and int4 are both "<V1").

    So it covers every name, dtype, shape and element of the data, and nothing else:
    not the order of the names in the mapping, not the memory layout (a strided view
    hashes as its C-order copy would: read_cifar10's memory-mapped images as the same
    images in memory), not how a loader normalises, batches or places them. The bytes
    are read in blocks of rows of at most DIGEST_BLOCK_BYTES (one row when a row is
    larger), so a memory-mapped dataset is read once and never copied whole: one pass,
    about 0.2 s for CIFAR-10's 150 MB on a quiet core. A loader computes it once, the
    first time it makes or checks a state, and keeps it.

    ``arrays`` is a mapping of str names to arrays (anything ``numpy.asarray`` makes a
    NumPy array of) of NumPy's number or bool dtypes or ml_dtypes' (bfloat16, the
    float8s, int4): ValueError naming what is not (an object dtype, whose bytes are
    pointers; a structured or raw void one, whose name does not say its fields)."""
    import hashlib
    import json
    where = "dataset_digest"
    if not isinstance(arrays, Mapping):
        raise ValueError(f"{where}: arrays must be a mapping of names to arrays, got {type(arrays).__name__}")
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(arrays, key=lambda name: _named(where, name)):
        a = np.asarray(arrays[name])
        ml_dtype = a.dtype.type.__module__.split(".")[0] == "ml_dtypes"
        if a.dtype.kind not in "biufc" and not ml_dtype:
            raise ValueError(f"{where}: arrays[{name!r}] is of dtype {a.dtype}, not numbers or bools (an "
                             f"object dtype's bytes are pointers, a structured one's name hides its fields)")
        header = json.dumps([name, a.dtype.str, a.dtype.name, list(a.shape)], separators=(",", ":"))
        digest.update(header.encode("utf-8") + b"\n")
        if a.ndim == 0 or a.size == 0:
            digest.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
            continue
        rows = max(1, DIGEST_BLOCK_BYTES // max(1, a[0].nbytes))
        for start in range(0, len(a), rows):
            block = np.ascontiguousarray(a[start:start + rows])  # a copy only of a strided block
            digest.update(block.reshape(-1).view(np.uint8))
    return digest.hexdigest()


def _named(where: str, name) -> str:
    if not isinstance(name, str):
        raise ValueError(f"{where}: the names of arrays must be strings, got {name!r}")
    return name


def _check_digest(where: str, value) -> str | None:
    """None, or ``dataset_digest``'s form (32 lowercase hex digits) as a plain str."""
    if value is None:
        return None
    if not (isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value)):
        raise ValueError(f"{where}: dataset must be None or 32 lowercase hex digits (plan.dataset_digest "
                         f"of the data), got {value!r}")
    return str(value)


@dataclasses.dataclass(frozen=True)
class LoaderState:
    """Where a loader stands in an epoch, as a small plain value a job saves with its
    checkpoint and a loader on other devices resumes from.

    ``step`` is the epoch's global step of the next batch (the number of steps of
    ``epoch`` already delivered); ``segments`` the epoch's shard sets so far, the last
    one being the shards that wrote the state (``elastic_plan``'s argument). A fresh
    epoch is ``LoaderState.start(...)``: segments ((0, n, B),), step 0. ``dataset`` is
    the data it was taken on, ``dataset_digest(arrays)`` (a plain str of 32 hex
    digits), or None: a state made by hand (``LoaderState.start`` without it) or read
    from format 1, which names no data. Every state a loader gives names its data.

    The JSON form (``to_json``/``from_json``) is one object with exactly the keys
    format ("plan.LoaderState/2"), num_samples, dataset (the digest or null), seed,
    epoch, step, shuffle (a bool), last_batch and segments (a list of [start,
    num_shards, batch_size]): about 190 bytes, plus about 12 a segment (CIFAR-10 on
    8 shards of 32, then 4, then 3, the largest seed, epoch 0: 211). ``from_json``
    also reads format 1 ("loaders.LoaderState/1": the same keys but dataset), as a
    state that names no data. Why accepted, not refused: a format-1 state was written before states named
    their data, so it says no more than a hand-made state does, and refusing it would
    strand a job in the middle of its epoch (and refimpl's checkpoints, which embed
    one and check their training data by their own digest, checkpoints.run_identity);
    it resumes as it did before, and the states saved after it name their data.

    Validated on construction (ValueError naming the field and value): what
    ``elastic_plan`` validates, shuffle a bool, step within [the last segment's
    start, the epoch's end], dataset None or a digest. A state resumes only the run it
    was taken in: ``check_same_run`` refuses another dataset size, dataset (when both
    name one), seed, shuffle or last_batch by name.
    """
    num_samples: int
    seed: int
    epoch: int
    step: int
    shuffle: bool
    last_batch: str
    segments: tuple
    dataset: str | None = None

    FORMAT = "plan.LoaderState/2"
    FORMAT_1 = "loaders.LoaderState/1"  # read, as naming no data; never written

    def __post_init__(self):
        where = "LoaderState"
        for name in ("seed", "epoch"):
            _check_int(where, name, getattr(self, name), 0)
        _check_bool(where, "shuffle", self.shuffle)
        check_seed("seed", self.seed, where)
        check_seed("epoch", self.epoch, where)
        segments, steps = _elastic_steps(where, self.num_samples, self.segments, self.last_batch)
        object.__setattr__(self, "segments", tuple(segments))
        object.__setattr__(self, "shuffle", bool(self.shuffle))
        for name in ("num_samples", "seed", "epoch"):
            object.__setattr__(self, name, int(getattr(self, name)))
        _check_int(where, "step", self.step, 0)
        first, end = segments[-1].start, segments[-1].start + steps[-1][1]
        if not first <= self.step <= end:
            raise ValueError(f"{where}: step={self.step} is outside [{first}, {end}] (the last "
                             f"segment's start .. the epoch's end)")
        object.__setattr__(self, "step", int(self.step))
        object.__setattr__(self, "dataset", _check_digest(where, self.dataset))

    @classmethod
    def start(cls, num_samples: int, num_shards: int, batch_size: int, *, epoch: int = 0,
              seed: int = 0, shuffle: bool = False, last_batch: str = "fill",
              dataset: str | None = None) -> "LoaderState":
        """Step 0 of ``epoch`` on one set of shards: segments ((0, num_shards, batch_size),).
        ValueError, naming the parameter, as the constructor's (the counts ints, 1 <=
        num_shards <= num_samples, batch_size >= 1, dataset None or a digest)."""
        where = "LoaderState.start"
        _bounds(where, num_samples, 0, num_shards)
        _check_int(where, "batch_size", batch_size, 1)
        check_seed("epoch", epoch, where)
        check_seed("seed", seed, where)
        return cls(num_samples, seed, epoch, 0, shuffle, last_batch, ((0, num_shards, batch_size),),
                   _check_digest(where, dataset))

    @property
    def num_steps(self) -> int:
        """The epoch's global steps, ``elastic_num_steps(N, segments, last_batch)``."""
        return elastic_num_steps(self.num_samples, self.segments, self.last_batch)

    def at_step(self, step: int) -> "LoaderState":
        """The same epoch on the same shards at another ``step``, an int within [the last
        segment's start, the epoch's end] (ValueError naming it otherwise)."""
        try:
            return dataclasses.replace(self, step=step)
        except ValueError as error:
            raise ValueError(f"LoaderState.at_step: {str(error).removeprefix('LoaderState: ')}") from None

    def saved_at(self, where: str, step, *, resumed: bool) -> "LoaderState":
        """What a loader's ``state(epoch, step)`` returns from this state: ``at_step(step)``,
        its ValueError prefixed with ``where`` and the step. A state the epoch was
        resumed from (``resumed``) also refuses a step before its own, where the
        resumed epoch starts. Every backend's ``state`` ends here."""
        if resumed and (not _is_int(step) or step < self.step):
            raise ValueError(f"{where}: step={step!r} is before the state's step {self.step}, "
                             f"where the resumed epoch starts")
        try:
            return self.at_step(step)
        except ValueError as error:
            raise ValueError(f"{where}: step={step!r}: {error}") from None

    def resized(self, num_shards: int, batch_size: int) -> "LoaderState":
        """The state a loader of ``num_shards`` shards of ``batch_size`` resumes from, at
        the same step. A last segment that has run no step yet (step == its start) is
        dropped first: it leaves no trace, so a resize at step 0 is a fresh epoch_plan
        on the new shards, and a resize back before a step ran restores the earlier
        plan. Then the segments are kept as they are when their last one has this
        (num_shards, batch_size) (the same shards continue their plan), and
        (step, num_shards, batch_size) is appended otherwise. Both are ints >= 1
        (ValueError naming them; num_shards at most num_samples)."""
        _check_int("LoaderState.resized", "num_shards", num_shards, 1)
        _check_int("LoaderState.resized", "batch_size", batch_size, 1)
        last = self.segments[-1]
        kept = self.segments[:-1] if self.step == last.start else self.segments
        if kept and (kept[-1].num_shards, kept[-1].batch_size) == (num_shards, batch_size):
            return dataclasses.replace(self, segments=kept)
        return dataclasses.replace(self, segments=kept + ((self.step, num_shards, batch_size),))

    def plan(self) -> tuple[Plan, int]:
        """(the last segment's Plan, the row of ``step`` in it): the shards run rows
        ``row ..`` of it, so shard k's remaining samples are ``plan.indices[row:, k]``
        (global step ``step + r`` is row ``row + r``)."""
        plans = elastic_plan(self.num_samples, self.segments, epoch=self.epoch, seed=self.seed,
                             shuffle=self.shuffle, last_batch=self.last_batch)
        return plans[-1], self.step - self.segments[-1].start

    def next_epoch(self) -> "LoaderState":
        """Step 0 of epoch + 1 on the last segment's shards: a fresh epoch_plan there, of
        the same data."""
        last = self.segments[-1]
        return LoaderState.start(self.num_samples, last.num_shards, last.batch_size,
                                 epoch=self.epoch + 1, seed=self.seed, shuffle=self.shuffle,
                                 last_batch=self.last_batch, dataset=self.dataset)

    def check_same_run(self, where: str, *, num_samples: int, seed: int, shuffle: bool,
                       last_batch: str, dataset: str | None = None) -> None:
        """Raises ValueError, naming the first field that differs (in the order
        num_samples, dataset, seed, shuffle, last_batch), unless the state was taken
        with this dataset size, data, seed, shuffle and last_batch (a state of another
        run would deliver another epoch's samples, or the same positions of other
        samples). The data is compared when both the state and ``dataset`` name one
        (``dataset_digest``); a state that names none is taken on trust (see the class
        docstring). Also ValueError, naming it, for a parameter that is not of its type
        (num_samples and seed ints, shuffle a bool, dataset None or a digest)."""
        _check_int(where, "num_samples", num_samples)
        check_seed("seed", seed, where)
        _check_bool(where, "shuffle", shuffle)
        check_policy(last_batch, where)
        dataset = _check_digest(where, dataset)
        for name, mine in (("num_samples", num_samples), ("dataset", dataset), ("seed", seed),
                           ("shuffle", shuffle), ("last_batch", last_batch)):
            theirs = getattr(self, name)
            if name == "dataset" and (theirs is None or mine is None):
                continue
            if theirs != mine:
                why = (" (plan.dataset_digest of the arrays: another dataset of the same size, or "
                       "this one changed)" if name == "dataset" else "")
                raise ValueError(f"{where}: the loader state was taken with {name}={theirs!r}, "
                                 f"this run has {name}={mine!r}{why}; a state resumes only the run "
                                 f"it was taken in")

    def to_json(self) -> str:
        """The class docstring's JSON form, format 2."""
        import json  # local: this section leaves the module's imports as they are
        return json.dumps({"format": self.FORMAT, "num_samples": self.num_samples, "dataset": self.dataset,
                           "seed": self.seed, "epoch": self.epoch, "step": self.step,
                           "shuffle": self.shuffle, "last_batch": self.last_batch,
                           "segments": [list(s) for s in self.segments]}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "LoaderState":
        """The state ``to_json`` wrote (format 2), or a format-1 state, read as naming no
        data (the class docstring says why). ValueError for text that is not JSON,
        another format, a missing or unknown key, or a value the constructor refuses."""
        import json
        try:
            doc = json.loads(text)
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"LoaderState.from_json: not a JSON document ({e})") from None
        fields = ["num_samples", "seed", "epoch", "step", "shuffle", "last_batch"]
        formats = {cls.FORMAT: ["format", "num_samples", "dataset", *fields[1:], "segments"],
                   cls.FORMAT_1: ["format", *fields, "segments"]}
        if not isinstance(doc, dict):
            raise ValueError(f"LoaderState.from_json: expected an object with keys {formats[cls.FORMAT]}, "
                             f"got {type(doc).__name__}")
        if not isinstance(doc.get("format"), str) or doc["format"] not in formats:
            raise ValueError(f"LoaderState.from_json: format={doc.get('format')!r}, expected {cls.FORMAT!r} "
                             f"(or {cls.FORMAT_1!r}, read as naming no data)")
        keys = formats[doc["format"]]
        if set(doc) != set(keys):
            raise ValueError(f"LoaderState.from_json: expected an object with keys {keys}, got {sorted(doc)}")
        if not isinstance(doc["segments"], list):
            raise ValueError(f"LoaderState.from_json: segments={doc['segments']!r} is not a list")
        return cls(**{k: doc[k] for k in fields}, segments=tuple(doc["segments"]),
                   dataset=doc.get("dataset"))


def resume_state(where: str, state, epoch: int, *, num_samples: int, seed: int, shuffle: bool,
                 last_batch: str, num_shards: int, batch_size: int,
                 dataset: str | None = None) -> LoaderState:
    """The state from which a loader of this run (``num_samples``, ``dataset``, ``seed``,
    ``shuffle``, ``last_batch``) over ``num_shards`` shards of ``batch_size`` resumes
    ``epoch``: ``state`` resized to those shards (``LoaderState.resized``), naming
    ``dataset`` (when the state named none, it names this run's data from here on), after
    checking that it is a LoaderState, of this run (``check_same_run``: the data too,
    when both name it) and of this epoch. ValueError naming ``where`` otherwise, also
    for a parameter not of its type (epoch, num_samples, seed, num_shards, batch_size
    ints; shuffle a bool; dataset None or a digest), named. Every backend that resumes
    from a state (Loader, and the vendor loaders built on this module) checks it here,
    through ``Schedule.resumed``."""
    if not isinstance(state, LoaderState):
        raise ValueError(f"{where}: state must be a plan.LoaderState (LoaderState.from_json "
                         f"reads a saved one), got {type(state).__name__}")
    check_seed("epoch", epoch, where)
    _check_int(where, "num_shards", num_shards, 1)
    _check_int(where, "batch_size", batch_size, 1)
    state.check_same_run(where, num_samples=num_samples, seed=seed, shuffle=shuffle, last_batch=last_batch,
                         dataset=dataset)
    if epoch != state.epoch:
        raise ValueError(f"{where}: epoch={epoch!r}, but the state is of epoch {state.epoch}; a state "
                         f"resumes its own epoch (the next one is fresh: epoch({state.epoch + 1}))")
    resized = state.resized(num_shards, batch_size)
    return resized if dataset is None else dataclasses.replace(resized, dataset=dataset)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One run's epochs on one set of shards: every epoch's ``Plan``, every state a loader
    gives or takes. The part of a loader that is pure schedule, the same for every
    backend (loaders.Loader, dali_loader.DaliLoader, rocal_loader.RocalLoader): those
    six numbers decide which sample every slot holds, in every epoch, and ``dataset``
    which data the states name. ``where`` names the caller in every error (e.g.
    "Loader.state").

    * ``steps``: ``num_steps(N, n, B, last_batch)``, every fresh epoch's length;
    * ``plan(e)``: ``epoch_plan(N, n, B, epoch=e, seed=, shuffle=, last_batch=)``;
    * ``resumed(where, e, state)``: ``resume_state``: the state checked against this
      run (its data included) and epoch, resized to these shards, naming this data;
    * ``state(where, e, step, state=None)``: the ``LoaderState`` to save after ``step``
      steps of epoch e. Without ``state``, of a fresh epoch: ``LoaderState.start(N, n,
      B, ..., dataset=).at_step(step)``, step in [0, steps]; with the ``state`` the
      epoch was resumed from, ``resumed(...).at_step(step)``, step in [state.step,
      its num_steps] (``LoaderState.saved_at``). ValueError for an epoch outside [0,
      2**32), a state of another run (another dataset named) or epoch, or a step
      outside that range;
    * ``real_samples(where, e, state=None)``: the mask-True slots of epoch e, or of the
      steps that resuming epoch e from ``state`` delivers.

    ``dataset``: the data's ``dataset_digest``, or a function of no arguments that
    returns it, called only when a state is made or checked (so ``steps`` and
    ``plan`` never read the data; a loader passes its cached digest), or None (the
    states name no data and any is accepted). Not compared: two schedules are equal
    when their plans are.

    Validated on construction (ValueError naming the field and the value): the three
    counts ints (as ``shard_bounds``) with 1 <= num_shards <= num_samples and
    batch_size >= 1, seed an int in [0, 2**32), shuffle a bool, a known last_batch,
    dataset None, a digest or a callable; every epoch and step an int
    (``check_seed``, ``LoaderState``)."""
    num_samples: int
    num_shards: int
    batch_size: int
    seed: int = 0
    shuffle: bool = False
    last_batch: str = "fill"
    dataset: str | Callable[[], str] | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        where = "Schedule"
        _bounds(where, self.num_samples, 0, self.num_shards)
        _check_int(where, "batch_size", self.batch_size, 1)
        check_seed("seed", self.seed, where)
        _check_bool(where, "shuffle", self.shuffle)
        check_policy(self.last_batch, where)
        if not callable(self.dataset):
            object.__setattr__(self, "dataset", _check_digest(where, self.dataset))
        for name in ("num_samples", "num_shards", "batch_size", "seed"):
            object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "shuffle", bool(self.shuffle))

    @property
    def digest(self) -> str | None:
        """``dataset`` itself, or what its function returns (checked: None or a digest)."""
        return _check_digest("Schedule.dataset", self.dataset() if callable(self.dataset) else self.dataset)

    @property
    def steps(self) -> int:
        return num_steps(self.num_samples, self.num_shards, self.batch_size, self.last_batch)

    def plan(self, epoch: int) -> Plan:
        check_seed("epoch", epoch, "Schedule.plan")
        return epoch_plan(self.num_samples, self.num_shards, self.batch_size, epoch=epoch,
                          seed=self.seed, shuffle=self.shuffle, last_batch=self.last_batch)

    def resumed(self, where: str, epoch: int, state) -> LoaderState:
        return resume_state(where, state, epoch, num_samples=self.num_samples, seed=self.seed,
                            shuffle=self.shuffle, last_batch=self.last_batch,
                            num_shards=self.num_shards, batch_size=self.batch_size,
                            dataset=self.digest if isinstance(state, LoaderState) else None)

    def state(self, where: str, epoch: int, step: int = 0, *, state=None) -> LoaderState:
        if state is None:
            check_seed("epoch", epoch, where)
            fresh = LoaderState.start(self.num_samples, self.num_shards, self.batch_size, epoch=epoch,
                                      seed=self.seed, shuffle=self.shuffle, last_batch=self.last_batch,
                                      dataset=self.digest)
        else:
            fresh = self.resumed(where, epoch, state)
        return fresh.saved_at(where, step, resumed=state is not None)

    def real_samples(self, where: str, epoch: int, *, state=None) -> int:
        check_seed("epoch", epoch, where)
        if state is None:
            return int(self.plan(epoch).mask.sum())
        plan, row = self.resumed(where, epoch, state).plan()
        return int(plan.mask[row:].sum())


def _is_int(value) -> bool:
    """The module's one rule for an int: a Python or NumPy integer, never a bool (True is
    not 1 here) and never a float, even a whole one (5.0 would give float bounds)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_int(where: str, name: str, value, minimum: int | None = None) -> int:
    """``value`` as a Python int; ValueError naming ``where``, ``name`` and the value unless
    it is an int (``_is_int``) of at least ``minimum``."""
    if not _is_int(value):
        raise ValueError(f"{where}: {name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value}")
    return int(value)


def _check_bool(where: str, name: str, value) -> bool:
    """``value`` as a Python bool; ValueError unless it is one (Python's or NumPy's)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{where}: {name} must be a bool, got {value!r}")
    return bool(value)


def _bounds(where: str, num_samples, shard_id, num_shards) -> tuple[int, int]:
    """shard_bounds' text, its errors naming ``where``."""
    num_samples = _check_int(where, "num_samples", num_samples)
    shard_id = _check_int(where, "shard_id", shard_id)
    num_shards = _check_int(where, "num_shards", num_shards)
    if num_shards < 1:
        raise ValueError(f"{where}: num_shards must be >= 1, got {num_shards}")
    if num_shards > num_samples:
        raise ValueError(f"{where}: num_shards={num_shards} is more than num_samples={num_samples}; "
                         f"some shard would be empty")
    if not 0 <= shard_id < num_shards:
        raise ValueError(f"{where}: shard_id={shard_id} is outside [0, {num_shards})")
    return num_samples * shard_id // num_shards, num_samples * (shard_id + 1) // num_shards


def _elastic_steps(where: str, num_samples: int, segments,
                   last_batch: str) -> tuple[list[Segment], list[tuple[int, int]]]:
    """(the validated segments, [(S_i, d_i)]) of elastic_plan's text, from counts alone."""
    check_policy(last_batch, where)
    _check_int(where, "num_samples", num_samples, 1)
    if isinstance(segments, (str, bytes)) or not isinstance(segments, Sequence) or not segments:
        raise ValueError(f"{where}: segments must be a non-empty list of (start, num_shards, "
                         f"batch_size), got {segments!r}")
    checked = []
    for i, segment in enumerate(segments):
        if isinstance(segment, (str, bytes)) or not isinstance(segment, Sequence) or len(segment) != 3:
            raise ValueError(f"{where}: segments[{i}]={segment!r} is not (start, num_shards, batch_size)")
        for name, value, minimum in zip(Segment._fields, segment, (0, 1, 1)):
            _check_int(where, f"segments[{i}].{name}", value, minimum)
        if segment[1] > num_samples:
            raise ValueError(f"{where}: segments[{i}].num_shards={segment[1]} is more than "
                             f"num_samples={num_samples}; a fresh epoch on it would have an empty shard")
        checked.append(Segment(*(int(v) for v in segment)))
    if checked[0].start != 0:
        raise ValueError(f"{where}: segments[0].start={checked[0].start}; the first segment starts "
                         f"at step 0")
    steps = []
    m, ended = num_samples, False
    for i, (start, n, B) in enumerate(checked):
        if i:
            prev = checked[i - 1]
            S_prev = steps[-1][0]
            if start <= prev.start:
                raise ValueError(f"{where}: segments[{i}].start={start} is not after segments[{i - 1}]"
                                 f".start={prev.start}; starts must increase (a resize before a "
                                 f"segment's first step replaces it)")
            if start > prev.start + S_prev:
                raise ValueError(f"{where}: segments[{i}].start={start} is after the epoch's end at "
                                 f"step {prev.start + S_prev} (segments[{i - 1}]={tuple(prev)} has "
                                 f"{S_prev} steps)")
            rows = start - prev.start
            steps[-1] = (S_prev, rows)
            m -= sum(min(rows * prev.batch_size, m * (k + 1) // prev.num_shards - m * k // prev.num_shards)
                     for k in range(prev.num_shards))
            ended = rows == S_prev
        if ended:
            S = 0
        elif last_batch == "fill":
            S = -(-(-(-m // n)) // B)
        else:
            S = (m // n) // B
        steps.append((S, S))
    return checked, steps


def _segment_plan(pool: np.ndarray, n: int, B: int, steps: int, *, segment: int, epoch: int,
                  seed: int, shuffle: bool) -> Plan:
    """elastic_plan's text for one segment: the (steps, n, B) plan over ``pool`` (ascending)."""
    m, slots = len(pool), steps * B
    indices = np.empty((n, slots), np.int64)
    mask = np.zeros((n, slots), bool)
    for k in range(n):
        lo, hi = m * k // n, m * (k + 1) // n
        order = pool[lo:hi]
        if shuffle:
            order = order[_segment_permutation(hi - lo, seed=seed, epoch=epoch, shard=k, segment=segment)]
        real = min(slots, len(order))
        indices[k, :real] = order[:real]
        if real < slots:  # slots > 0 implies m >= 1, so pool[lo] exists (lo < m)
            indices[k, real:] = order[real - 1] if real else pool[lo]
        mask[k, :real] = True
    shape = (n, steps, B)
    return Plan(indices.reshape(shape).swapaxes(0, 1).copy(), mask.reshape(shape).swapaxes(0, 1).copy())


def _segment_permutation(size: int, *, seed: int, epoch: int, shard: int, segment: int) -> np.ndarray:
    if segment == 0:
        return shard_permutation(size, seed=seed, epoch=epoch, shard=shard)
    check_seed("segment", segment, "elastic_plan")
    keys = np.random.PCG64(np.random.SeedSequence([seed, epoch, shard, segment])).random_raw(size)
    return np.argsort(keys, kind="stable").astype(np.int64, copy=False)
