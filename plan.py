"""The plan: which sample sits in which slot of which shard's batch at each step of an epoch.

The spec every loader follows (loaders.py, DALI and rocAL with ``order="plan"``, and conformance.py's checks). Pure
NumPy, with no other import of the project: copy it alone.

A fresh epoch (``epoch_plan``). Shard k of n over range(N) is [N*k//n, N*(k+1)//n), rocAL's and DALI's partition. With
per-shard batch B, shard k holds at step s, in slot j = s*B + b (0 <= j < S*B):

    S     = ceil(ceil(N/n) / B) for fill, floor(floor(N/n) / B) for drop     (``num_steps``)
    run   = range(N)[N*k//n : N*(k+1)//n]
    order = run[shard_permutation(len(run), seed=, epoch=, shard=k)] if shuffle else run
    real  = min(S*B, len(run))
    slot  = order[j] (mask True) if j < real, else padding (mask False): order[real-1]

Worked (N=7, n=2, B=2, no shuffle; ``*`` padding):

    policy | steps                 | step 0 (shard 0, 1) | step 1 (shard 0, 1)
    -------+-----------------------+---------------------+--------------------
    fill   | ceil(ceil(7/2)/2) = 2 | [0, 1]  [3, 4]      | [2, 2*]  [5, 6]
    drop   | (7//2)//2 = 1         | [0, 1]  [3, 4]      | (none: 2, 5, 6 skipped)

So every shard runs the same steps (SPMD collectives need it). Fill puts each sample in exactly one real slot of the
epoch; drop at most once, n*B*S in all. Shards exchange no samples. Unlike rocAL's and DALI's, the shuffle honours the
seed and changes every epoch.

A resized epoch (``elastic_plan``, ``LoaderState``): a resume on other shards runs the epoch as a chain of segments
(t_i, n_i, B_i), from global step t_i on n_i shards of batch B_i; a fresh epoch is the one segment (0, n, B). Segment i
plans as above over its pool R_i, the samples in no real slot before step t_i, ascending (R_0 = range(N)): with
m = len(R_i), run = R_i[m*k//n : m*(k+1)//n], the shuffle's ``segment=i``, S_i from m (0 once the epoch has ended:
t_i == t_{i-1} + S_{i-1}), and padding R_i[m*k//n] for an empty run. It delivers d_i = t_{i+1} - t_i of its steps
(S_i for the last). Fill still puts each sample in exactly one real slot; drop in at most one, sum_i n_i*B_i*d_i in all.

Inputs: an int parameter takes a Python or NumPy integer (never a bool or a float), used as a Python int; a bool
parameter Python's or NumPy's bool. Anything else raises ValueError naming the function, the parameter and the value.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Callable, NamedTuple, Sequence

import numpy as np

LAST_BATCH_POLICIES = ("fill", "drop")


class Plan(NamedTuple):
    """Steps of an epoch as data: ``indices`` int64 and ``mask`` bool, both (steps, shards, B). ``indices[s, k]`` is
    shard k's batch at step s; ``mask`` is False exactly on padding."""
    indices: np.ndarray
    mask: np.ndarray


class _Segment(NamedTuple):
    """(t_i, n_i, B_i) of the module docstring, as ``LoaderState.segments`` holds them; a plain tuple or list
    [start, n, B] is accepted wherever one is."""
    start: int
    num_shards: int
    batch_size: int


# Shards and the epoch plan ------------------------------------------------------------------------
def shard_bounds(num_samples: int, shard_id: int, num_shards: int) -> tuple[int, int]:
    """Shard ``shard_id`` of ``num_shards`` over range(num_samples): ``(N*k//n, N*(k+1)//n)``. The shards tile range(N)
    in order; their sizes differ by at most one (N=7, n=3 gives [0, 2), [2, 4), [4, 7)). ValueError unless
    1 <= num_shards <= num_samples and 0 <= shard_id < num_shards."""
    num_samples, num_shards = _shards("shard_bounds", num_samples, num_shards)
    k = _check_int("shard_bounds", "shard_id", shard_id)
    if not 0 <= k < num_shards:
        raise ValueError(f"shard_bounds: shard_id={k} is outside [0, {num_shards})")
    return num_samples * k // num_shards, num_samples * (k + 1) // num_shards


def num_steps(num_samples: int, num_shards: int, batch_size: int, last_batch: str) -> int:
    """Steps of a fresh epoch: fill ceil(ceil(N/n) / B), drop floor(floor(N/n) / B). A batch larger than the smallest
    shard is allowed here: fill pads, drop gives 0 steps."""
    check_policy(last_batch, "num_steps")
    num_samples, num_shards = _shards("num_steps", num_samples, num_shards)
    return _steps(num_samples, num_shards, _check_int("num_steps", "batch_size", batch_size, 1), last_batch)


def shard_permutation(size: int, *, seed: int, epoch: int, shard: int, segment: int = 0) -> np.ndarray:
    """The shuffle: a permutation of range(size), int64, fixed by (seed, epoch, shard, segment).

        E    = [seed, epoch, shard] if segment == 0 else [seed, epoch, shard, segment]
        keys = numpy.random.PCG64(numpy.random.SeedSequence(E)).random_raw(size)
        perm = numpy.argsort(keys, kind="stable")   # the sorting permutation, not the ranks

    NumPy specifies SeedSequence and PCG64's raw stream bit for bit; ``Generator.permutation`` may change between
    versions. SeedSequence mixes its words, never adds them: (seed 1, epoch 0) and (seed 0, epoch 1) are unrelated. It
    pads E with zeros, so segment 0 omits the fourth word rather than repeat a stream. Each word is in [0, 2**32)."""
    size = _check_int("shard_permutation", "size", size, 0)
    entropy = [check_seed(name, value, "shard_permutation")
               for name, value in (("seed", seed), ("epoch", epoch), ("shard", shard), ("segment", segment))]
    keys = np.random.PCG64(np.random.SeedSequence(entropy if entropy[3] else entropy[:3])).random_raw(size)
    return np.argsort(keys, kind="stable").astype(np.int64, copy=False)


def epoch_plan(num_samples: int, num_shards: int, batch_size: int, *, epoch: int = 0,
               seed: int = 0, shuffle: bool = False, last_batch: str = "fill") -> Plan:
    """A fresh epoch's Plan, (num_steps(...), num_shards, batch_size): the one segment (0, n, B). Without shuffle, seed
    and epoch change nothing, but they are checked all the same."""
    where = "epoch_plan"
    check_policy(last_batch, where)
    num_samples, num_shards = _shards(where, num_samples, num_shards)
    batch_size = _check_int(where, "batch_size", batch_size, 1)
    epoch, seed = check_seed("epoch", epoch, where), check_seed("seed", seed, where)
    shuffle = _check_bool(where, "shuffle", shuffle)
    steps = _steps(num_samples, num_shards, batch_size, last_batch)
    return _plans(num_samples, [_Segment(0, num_shards, batch_size)], [[steps, steps]], epoch=epoch,
                  seed=seed, shuffle=shuffle)[0]


def elastic_plan(num_samples: int, segments: Sequence, *, epoch: int = 0, seed: int = 0,
                 shuffle: bool = False, last_batch: str = "fill") -> list[Plan]:
    """The Plans of an epoch run by a chain of segments: ``plans[i]`` is what segment i delivers.

    ``segments`` is a list or tuple of (t_i, n_i, B_i), built as the module docstring says. ``plans[i]`` has shape
    (d_i, n_i, B_i); its row r is global step t_i + r. One segment (0, n, B) gives [epoch_plan(N, n, B, ...)]. t_0 = 0,
    and t_i lies in (t_{i-1}, t_{i-1} + S_{i-1}]: a segment that starts at the previous one's end has 0 steps and must
    be last. With fewer samples left than shards, fill gives one step and drop none. Samples move between shards at a
    change, so a change back to an earlier (n, B) need not restore its plan. Worked (N=7, no shuffle; shards left to
    right, ``*`` padding; global steps):

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

    Row 3: drop's epoch ends at step 1, so 2, 5 and 6 stay skipped. Row 5: shard 0's run is empty and pads with 2.
    Row 9: not epoch_plan(7, 2, 1)'s step 2, [2] [5]. Raises ValueError, naming the parameter and the value, for a
    segment that is not three ints with start >= 0 and 1 <= num_shards <= num_samples, or a start outside that range."""
    where = "elastic_plan"
    epoch, seed = check_seed("epoch", epoch, where), check_seed("seed", seed, where)
    shuffle = _check_bool(where, "shuffle", shuffle)
    num_samples, segments, steps = _segments(where, num_samples, segments, last_batch)
    return _plans(num_samples, segments, steps, epoch=epoch, seed=seed, shuffle=shuffle)


def remaining_samples(num_samples: int, segments: Sequence, step: int, *, epoch: int = 0,
                      seed: int = 0, shuffle: bool = False, last_batch: str = "fill") -> np.ndarray:
    """The samples in no real slot of elastic_plan's epoch before global ``step``, ascending int64. At a segment's start
    they are its pool R_i. At the epoch's end they are none (fill) or the skipped samples (drop). ValueError unless
    0 <= step <= the epoch's steps."""
    where = "remaining_samples"
    num_samples, segments, steps = _segments(where, num_samples, segments, last_batch)
    epoch, seed = check_seed("epoch", epoch, where), check_seed("seed", seed, where)
    shuffle = _check_bool(where, "shuffle", shuffle)
    step, end = _check_int(where, "step", step, 0), segments[-1].start + steps[-1][1]
    if step > end:
        raise ValueError(f"{where}: step={step} is outside [0, {end}] (the epoch's steps)")
    taken = np.zeros(num_samples, bool)
    for (start, _, _), plan in zip(segments, _plans(num_samples, segments, steps, epoch=epoch, seed=seed,
                                                    shuffle=shuffle)):
        rows = max(0, step - start)
        taken[plan.indices[:rows][plan.mask[:rows]]] = True
    return np.flatnonzero(~taken).astype(np.int64)


def device_slots(num_shards: int, num_devices: int) -> np.ndarray:
    """Which logical shard each device's slot holds: (n, k) int64, k = ceil(L/n), for L = ``num_shards`` over
    n = ``num_devices``. Device d holds shards ``shard_bounds(L, d, n)``, L*d//n .. L*(d+1)//n - 1, in its first slots;
    a device holding k - 1 of them has a spare last slot, -1. So every device holds at least one shard and at most one
    spare, and where n divides L, device d holds shards d*L/n .. (d+1)*L/n - 1 and no spare. L=8: n=3 gives [[0, 1, -1],
    [2, 3, 4], [5, 6, 7]]; n=5, [[0, -1], [1, 2], [3, -1], [4, 5], [6, 7]]. ValueError unless 1 <= n <= L."""
    num_shards = _check_int("device_slots", "num_shards", num_shards, 1)
    num_devices = _check_int("device_slots", "num_devices", num_devices, 1)
    if num_devices > num_shards:
        raise ValueError(f"device_slots: num_devices={num_devices} is more than num_shards={num_shards}: a device "
                         f"holds whole logical shards, at least one")
    k = -(-num_shards // num_devices)
    out = np.full((num_devices, k), -1, np.int64)
    for d in range(num_devices):
        lo, hi = shard_bounds(num_shards, d, num_devices)
        out[d, :hi - lo] = np.arange(lo, hi)
    return out


def on_devices(plan: Plan, num_devices: int) -> Plan:
    """``plan`` over L logical shards of b rows, as n = ``num_devices`` devices read it, any n from 1 to L.

    Device d reads its ``device_slots(L, n)`` in order, each slot's b rows one after the other: slot j of device d
    holding shard l gives ``out.indices[s, d, j*b + i] = plan.indices[s, l, i]``, and ``mask`` likewise; a spare slot
    (-1) gives b rows of the device's own first row, ``out.indices[s, d, 0]``, with mask False (a sample of the device's
    own shards, so a loader holding them finds it). Where n divides L that is a reshape, no copy, and no spare. So every
    n sees the same L shards of every step, each whole on one device. Worked (N=7, L=4, b=1, fill; a cell is the
    device's rows at step 0, then at step 1; ``*`` padding, ``-`` a spare slot):

        devices | device 0             | device 1     | device 2     | device 3
        --------+----------------------+--------------+--------------+---------
        4       | [0] [0*]             | [1] [2]      | [3] [4]      | [5] [6]
        3       | [0,-] [0*,-]         | [1,-] [2,-]  | [3,5] [4,6]  |
        2       | [0,1] [0*,2]         | [3,5] [4,6]  |              |
        1       | [0,1,3,5] [0*,2,4,6] |              |              |

    Raises ValueError unless ``plan`` is a Plan of two arrays of one 3-d shape and 1 <= n <= L."""
    if not (isinstance(plan, Plan) and all(isinstance(a, np.ndarray) for a in plan)
            and plan.indices.ndim == 3 and plan.mask.shape == plan.indices.shape):
        got = ([(type(a).__name__, getattr(a, "shape", None)) for a in plan] if isinstance(plan, Plan)
               else type(plan).__name__)
        raise ValueError(f"on_devices: plan must be a Plan of two arrays of one (steps, L, b) shape, got {got}")
    steps, L, b = plan.indices.shape
    if not _is_int(num_devices) or not 1 <= num_devices <= L:
        raise ValueError(f"on_devices: num_devices={num_devices!r} is outside [1, {L}], the plan's logical shards "
                         f"(a device reads whole logical shards, at least one)")
    n = int(num_devices)
    if L % n == 0:
        shape = (steps, n, L // n * b)
        return Plan(plan.indices.reshape(shape), plan.mask.reshape(shape))
    slots = device_slots(L, n)
    spare = (slots < 0)[None, :, :, None]
    indices = plan.indices[:, np.maximum(slots, 0)]  # (steps, n, k, b)
    indices = np.where(spare, indices[:, :, :1, :1], indices)
    mask = plan.mask[:, np.maximum(slots, 0)] & ~spare
    return Plan(indices.reshape(steps, n, -1), mask.reshape(steps, n, -1))


# The state a job saves, the data it was taken on, and a loader's schedule -------------------------
DIGEST_ROWS = 64  # rows of each array that dataset_digest reads: a cost that does not grow with the data


def digest_rows(n: int) -> list[int]:
    """The rows ``dataset_digest`` reads of an array of n rows: every row when n <= DIGEST_ROWS, else DIGEST_ROWS spread
    evenly, i * (n - 1) // (DIGEST_ROWS - 1) for i = 0 .. DIGEST_ROWS - 1 (the first and the last among them)."""
    if n <= DIGEST_ROWS:
        return list(range(n))
    return [i * (n - 1) // (DIGEST_ROWS - 1) for i in range(DIGEST_ROWS)]


def dataset_digest(arrays: Mapping) -> str:
    """The identity of a dataset of named arrays: 32 lowercase hex digits, read at a cost that does not grow with the
    data (a checkpoint of a 100 GB memory-mapped dataset reads 64 rows of each array, not 100 GB).

    The BLAKE2b digest of 16 bytes (``hashlib.blake2b(digest_size=16)``, no key) of:

        for name in sorted(arrays):                       # code-point order
            a = numpy.asarray(arrays[name])
            header = json.dumps([name, a.dtype.str, a.dtype.name, list(a.shape)], separators=(",", ":"))
            hash header.encode("utf-8") + b"\\n"           # e.g. ["labels","<i4","int32",[50000]]
            if a.ndim == 0: hash a's bytes
            else: for r in digest_rows(len(a)): hash the bytes of a[r] in C (row-major) order

    dtype.str gives byte order and size; dtype.name tells ml_dtypes apart (float8_e4m3fn and int4 are both "<V1"). So it
    compares every name, dtype and shape, the bytes of every row of an array of at most DIGEST_ROWS rows (the whole
    array, then) and of DIGEST_ROWS rows spread over a longer one: another dataset, or this one reordered, is told
    apart; a change only in rows it does not read is not, nor the mapping's order or the memory layout.

    Raises ValueError unless ``arrays`` maps str names to arrays of dtype kind b, i, u, f or c (bools, integers, floats,
    complex) or of ml_dtypes': an object dtype's bytes are pointers, a structured one's name hides its fields, and
    datetime and timedelta are refused too."""
    if not isinstance(arrays, Mapping):
        raise ValueError(f"dataset_digest: arrays must be a mapping of names to arrays, got {type(arrays).__name__}")
    for name in arrays:
        if not isinstance(name, str):
            raise ValueError(f"dataset_digest: the names of arrays must be strings, got {name!r}")
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(arrays):
        a = arrays[name] if isinstance(arrays[name], np.ndarray) else np.asarray(arrays[name])
        if a.dtype.kind not in "biufc" and a.dtype.type.__module__.split(".")[0] != "ml_dtypes":
            raise ValueError(f"dataset_digest: arrays[{name!r}] is of dtype {a.dtype}, not numbers or bools "
                             f"(dtype kinds b, i, u, f, c) or ml_dtypes'")
        header = json.dumps([name, a.dtype.str, a.dtype.name, list(a.shape)], separators=(",", ":"))
        digest.update(header.encode("utf-8") + b"\n")
        if a.ndim == 0:
            digest.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
            continue
        for r in digest_rows(len(a)):
            digest.update(np.ascontiguousarray(a[r]).reshape(-1).view(np.uint8))
    return digest.hexdigest()


_JSON_KEYS = ("format", "num_samples", "dataset", "seed", "epoch", "step", "shuffle", "last_batch", "segments")


@dataclasses.dataclass(frozen=True)
class LoaderState:
    """Where a loader stands in an epoch: a small plain value to save, resumable on any shards.

    ``step`` is the global step of the next batch. ``segments`` is elastic_plan's argument, a tuple of (start,
    num_shards, batch_size); its last segment is the shards that wrote the state. ``dataset`` is the data's
    ``dataset_digest``, or None for a state made by hand (taken on trust). ``num_steps`` is the epoch's global steps.

    ``to_json`` writes one object with exactly the keys format ("plan.LoaderState/2"), num_samples, dataset (or null),
    seed, epoch, step, shuffle, last_batch and segments (a list of [start, num_shards, batch_size]), in this order, with
    separators "," and ":" and no spaces; ``from_json`` reads it back.

    Raises ValueError, naming the field and the value, for what elastic_plan refuses, a step outside [the last segment's
    start, the epoch's end], or a dataset not None or a digest."""
    num_samples: int
    seed: int
    epoch: int
    step: int
    shuffle: bool
    last_batch: str
    segments: tuple
    dataset: str | None = None

    FORMAT = "plan.LoaderState/2"

    def __post_init__(self):
        where = "LoaderState"
        for name in ("seed", "epoch"):
            object.__setattr__(self, name, check_seed(name, getattr(self, name), where))
        object.__setattr__(self, "shuffle", _check_bool(where, "shuffle", self.shuffle))
        num_samples, segments, steps = _segments(where, self.num_samples, self.segments, self.last_batch)
        object.__setattr__(self, "num_samples", num_samples)
        object.__setattr__(self, "segments", tuple(segments))
        object.__setattr__(self, "num_steps", segments[-1].start + steps[-1][1])
        object.__setattr__(self, "step", self._step(where, self.step))
        object.__setattr__(self, "dataset", _check_digest(where, self.dataset))

    def _step(self, where: str, step) -> int:
        step, first, end = _check_int(where, "step", step, 0), self.segments[-1].start, self.num_steps
        if not first <= step <= end:
            raise ValueError(f"{where}: step={step} is outside [{first}, {end}] (the last segment's "
                             f"start .. the epoch's end)")
        return step

    @classmethod
    def start(cls, num_samples: int, num_shards: int, batch_size: int, *, epoch: int = 0, seed: int = 0,
              shuffle: bool = False, last_batch: str = "fill", dataset: str | None = None) -> "LoaderState":
        """Step 0 of ``epoch``, one segment (0, num_shards, batch_size)."""
        where = "LoaderState.start"
        _shards(where, num_samples, num_shards)
        _check_int(where, "batch_size", batch_size, 1)
        check_seed("epoch", epoch, where)
        check_seed("seed", seed, where)
        return cls(num_samples, seed, epoch, 0, shuffle, last_batch, ((0, num_shards, batch_size),),
                   _check_digest(where, dataset))

    def at_step(self, step: int) -> "LoaderState":
        """The same epoch at ``step``, in [the last segment's start, the epoch's end]."""
        return dataclasses.replace(self, step=self._step("LoaderState.at_step", step))

    def resized(self, num_shards: int, batch_size: int) -> "LoaderState":
        """The state a loader of ``num_shards`` shards of ``batch_size`` resumes from, at this step.

        A last segment that ran no step (step == its start) is dropped first: a resize at step 0 is a fresh epoch. The
        segments are kept if the last one has this (n, B); otherwise (step, n, B) is appended."""
        n = _check_int("LoaderState.resized", "num_shards", num_shards, 1)
        B = _check_int("LoaderState.resized", "batch_size", batch_size, 1)
        kept = self.segments[:-1] if self.step == self.segments[-1].start else self.segments
        return dataclasses.replace(self, segments=kept if kept and kept[-1][1:] == (n, B) else
                                   kept + ((self.step, n, B),))

    def plan(self) -> tuple[Plan, int]:
        """(the last segment's Plan, the row of ``step`` in it): the shards run rows ``row ..``."""
        return elastic_plan(self.num_samples, self.segments, epoch=self.epoch, seed=self.seed, shuffle=self.shuffle,
                            last_batch=self.last_batch)[-1], self.step - self.segments[-1].start

    def next_epoch(self) -> "LoaderState":
        """Step 0 of the next epoch on the last segment's shards, of the same run and data."""
        last = self.segments[-1]
        return LoaderState.start(self.num_samples, last.num_shards, last.batch_size, epoch=self.epoch + 1,
                                 seed=self.seed, shuffle=self.shuffle, last_batch=self.last_batch, dataset=self.dataset)

    def to_json(self) -> str:
        """The class docstring's JSON form."""
        return json.dumps({"format": self.FORMAT, **{k: getattr(self, k) for k in _JSON_KEYS[1:]}},
                          separators=(",", ":"))  # a tuple of tuples is a JSON list of lists

    @classmethod
    def from_json(cls, text: str) -> "LoaderState":
        """The state ``to_json`` wrote."""
        try:
            doc = json.loads(text)
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"LoaderState.from_json: not a JSON document ({e})") from None
        if not isinstance(doc, dict):
            raise ValueError(f"LoaderState.from_json: expected an object with keys {list(_JSON_KEYS)}, "
                             f"got {type(doc).__name__}")
        if doc.get("format") != cls.FORMAT:
            raise ValueError(f"LoaderState.from_json: format={doc.get('format')!r}, expected {cls.FORMAT!r}")
        if set(doc) != set(_JSON_KEYS):
            raise ValueError(f"LoaderState.from_json: expected an object with keys {list(_JSON_KEYS)}, "
                             f"got {sorted(doc)}")
        return cls(**{k: v for k, v in doc.items() if k != "format"})


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One run's epochs on one set of shards, validated once: the part of every loader (loaders.Loader,
    dali_loader.DaliLoader, rocal_loader.RocalLoader) that says which sample goes where, and the one place a saved state
    is checked and resized to resume.

    * ``num_steps``: a fresh epoch's steps, ``num_steps(N, n, B, last_batch)``;
    * ``plan(e)``: ``epoch_plan(N, n, B, epoch=e, ...)``;
    * ``start(e)``: the state at step 0 of a fresh epoch e;
    * ``resume(where, e, state)``: ``state``, checked to be a LoaderState of this run (the same num_samples, dataset
      where both name one, seed, shuffle and last_batch) and of epoch e, then ``LoaderState.resized`` to these shards
      and naming this run's data: the state the resumed epoch starts from (errors name ``where``, the loader's method);
    * ``real_samples(e, resumed=None)``: the real slots of a fresh epoch e, or from a ``resume``'s state on.

    ``dataset`` is a ``dataset_digest``, a function of no arguments returning one (called only when a state is made or
    checked), or None (states name no data). It is not compared. Raises ValueError, naming the field and the value, for
    what ``epoch_plan`` refuses."""
    num_samples: int
    num_shards: int
    batch_size: int
    seed: int = 0
    shuffle: bool = False
    last_batch: str = "fill"
    dataset: str | Callable[[], str] | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        where = "Schedule"
        num_samples, num_shards = _shards(where, self.num_samples, self.num_shards)
        object.__setattr__(self, "num_samples", num_samples)
        object.__setattr__(self, "num_shards", num_shards)
        object.__setattr__(self, "batch_size", _check_int(where, "batch_size", self.batch_size, 1))
        object.__setattr__(self, "seed", check_seed("seed", self.seed, where))
        object.__setattr__(self, "shuffle", _check_bool(where, "shuffle", self.shuffle))
        check_policy(self.last_batch, where)
        if not callable(self.dataset):
            object.__setattr__(self, "dataset", _check_digest(where, self.dataset))
        object.__setattr__(self, "num_steps", _steps(num_samples, num_shards, self.batch_size, self.last_batch))

    def _digest(self) -> str | None:
        return _check_digest("Schedule.dataset", self.dataset() if callable(self.dataset) else self.dataset)

    def plan(self, epoch: int) -> Plan:
        check_seed("epoch", epoch, "Schedule.plan")
        return epoch_plan(self.num_samples, self.num_shards, self.batch_size, epoch=epoch,
                          seed=self.seed, shuffle=self.shuffle, last_batch=self.last_batch)

    def start(self, epoch: int) -> LoaderState:
        check_seed("epoch", epoch, "Schedule.start")
        return LoaderState.start(self.num_samples, self.num_shards, self.batch_size, epoch=epoch, seed=self.seed,
                                 shuffle=self.shuffle, last_batch=self.last_batch, dataset=self._digest())

    def resume(self, where: str, epoch: int, state) -> LoaderState:
        if not isinstance(state, LoaderState):
            raise ValueError(f"{where}: state must be a plan.LoaderState (LoaderState.from_json "
                             f"reads a saved one), got {type(state).__name__}")
        epoch, mine = check_seed("epoch", epoch, where), self._digest()
        for name, value in (("num_samples", self.num_samples), ("dataset", mine), ("seed", self.seed),
                            ("shuffle", self.shuffle), ("last_batch", self.last_batch)):
            theirs = getattr(state, name)
            if theirs != value and not (name == "dataset" and None in (theirs, value)):
                why = (" (plan.dataset_digest of the arrays: another dataset of the same size, or "
                       "this one changed)" if name == "dataset" else "")
                raise ValueError(f"{where}: the loader state was taken with {name}={theirs!r}, this run has "
                                 f"{name}={value!r}{why}; a state resumes only the run it was taken in")
        if epoch != state.epoch:
            raise ValueError(f"{where}: epoch={epoch!r}, but the state is of epoch {state.epoch}; a state "
                             f"resumes its own epoch (the next one is fresh: epoch({state.epoch + 1}))")
        resized = state.resized(self.num_shards, self.batch_size)
        return resized if mine is None else dataclasses.replace(resized, dataset=mine)

    def real_samples(self, epoch: int, resumed: LoaderState | None = None) -> int:
        check_seed("epoch", epoch, "Schedule.real_samples")
        if resumed is None:
            return int(self.plan(epoch).mask.sum())
        plan, row = resumed.plan()
        return int(plan.mask[row:].sum())


# Checks, and the construction ---------------------------------------------------------------------
def check_seed(name: str, value: int, where: str) -> int:
    """``value`` as a Python int in [0, 2**32); else ValueError naming ``where``, ``name`` and it. SeedSequence splits a
    larger int into 32-bit words: (seed 2**32, epoch 0) would read as (0, 1, 0)."""
    if not _is_int(value):
        raise ValueError(f"{where}: {name} must be an int in [0, 2**32), got {value!r}")
    if not 0 <= value < 2**32:
        raise ValueError(f"{where}: {name}={value} is outside [0, 2**32)")
    return int(value)


def check_policy(last_batch: str, where: str | None = None) -> None:
    """Raises ValueError, naming ``where`` when given, unless ``last_batch`` is in LAST_BATCH_POLICIES."""
    if not isinstance(last_batch, str) or last_batch not in LAST_BATCH_POLICIES:
        prefix = f"{where}: " if where else ""
        raise ValueError(f"{prefix}last_batch must be one of {LAST_BATCH_POLICIES}, got {last_batch!r}")


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_int(where: str, name: str, value, minimum: int | None = None) -> int:
    if not _is_int(value):
        raise ValueError(f"{where}: {name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value}")
    return int(value)


def _check_bool(where: str, name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{where}: {name} must be a bool, got {value!r}")
    return bool(value)


def _check_digest(where: str, value) -> str | None:
    if value is None:
        return None
    if not (isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value)):
        raise ValueError(f"{where}: dataset must be None or 32 lowercase hex digits (plan.dataset_digest "
                         f"of the data), got {value!r}")
    return str(value)


def _shards(where: str, num_samples, num_shards) -> tuple[int, int]:
    num_samples = _check_int(where, "num_samples", num_samples)
    num_shards = _check_int(where, "num_shards", num_shards, 1)
    if num_shards > num_samples:
        raise ValueError(f"{where}: num_shards={num_shards} is more than num_samples={num_samples}; "
                         f"some shard would be empty")
    return num_samples, num_shards


def _steps(m: int, n: int, B: int, last_batch: str) -> int:
    return -(-(-(-m // n)) // B) if last_batch == "fill" else (m // n) // B


def _segments(where: str, num_samples, segments, last_batch) -> tuple[int, list[_Segment], list[list[int]]]:
    """(N, the segments, [S_i, d_i] of each) as Python ints, from the counts alone; checked."""
    check_policy(last_batch, where)
    N = _check_int(where, "num_samples", num_samples, 1)
    if not isinstance(segments, (list, tuple)) or not segments:
        raise ValueError(f"{where}: segments must be a non-empty list of (start, num_shards, "
                         f"batch_size), got {segments!r}")
    checked, steps, m = [], [], N
    for i, segment in enumerate(segments):
        if not isinstance(segment, (list, tuple)) or len(segment) != 3:
            raise ValueError(f"{where}: segments[{i}]={segment!r} is not (start, num_shards, batch_size)")
        t, n, B = (_check_int(where, f"segments[{i}].{name}", value, least)
                   for name, value, least in zip(_Segment._fields, segment, (0, 1, 1)))
        if n > N:
            raise ValueError(f"{where}: segments[{i}].num_shards={n} is more than num_samples={N}; a "
                             f"fresh epoch on it would have an empty shard")
        if not i and t:
            raise ValueError(f"{where}: segments[0].start={t}; the first segment starts at step 0")
        ended = False
        if i:
            prev, S = checked[-1], steps[-1][0]
            if t <= prev.start:
                raise ValueError(f"{where}: segments[{i}].start={t} is not after segments[{i - 1}].start={prev.start}; "
                                 f"starts must increase (a resize before a segment's first step replaces it)")
            if t > prev.start + S:
                raise ValueError(f"{where}: segments[{i}].start={t} is after the epoch's end at step "
                                 f"{prev.start + S} (segments[{i - 1}]={tuple(prev)} has {S} steps)")
            d = steps[-1][1] = t - prev.start
            # the pool loses what the previous segment delivered: each run's first d*B samples
            # (d*B never exceeds a run before the epoch's end; after it, nothing more is planned)
            m -= d * prev.batch_size * prev.num_shards
            ended = d == S
        checked.append(_Segment(t, n, B))
        S = 0 if ended else _steps(m, n, B, last_batch)
        steps.append([S, S])
    return N, checked, steps


def _plans(num_samples: int, segments: list[_Segment], steps: list[list[int]], *, epoch: int, seed: int,
           shuffle: bool) -> list[Plan]:
    """The module docstring's construction: each segment's delivered rows, from checked ints."""
    taken = np.zeros(num_samples, bool)
    plans = []
    for i, ((_, n, B), (S, d)) in enumerate(zip(segments, steps)):
        pool = np.flatnonzero(~taken)
        m, slots = len(pool), S * B
        indices = np.empty((n, slots), np.int64)
        mask = np.zeros((n, slots), bool)
        for k in range(n):
            lo, hi = m * k // n, m * (k + 1) // n
            order = pool[lo:hi]
            if shuffle:
                order = order[shard_permutation(hi - lo, seed=seed, epoch=epoch, shard=k, segment=i)]
            real = min(slots, hi - lo)
            indices[k, :real] = order[:real]
            mask[k, :real] = True
            if real < slots:  # then m >= 1 and lo < m: pool[lo] exists
                indices[k, real:] = order[real - 1] if real else pool[lo]
        plan = Plan(*(a.reshape(n, S, B)[:, :d].swapaxes(0, 1).copy() for a in (indices, mask)))
        taken[plan.indices[plan.mask]] = True
        plans.append(plan)
    return plans
