"""Delivery onto devices: the reference loader, one shard per device, by plan.py's plan.

``make_loader(data, devices, batch_size, ...)`` builds a ``Loader`` over a dataset of named arrays (N first) or the
notebooks' ``(images, labels)``; ``loader.epoch(e)`` yields one dict of global ``jax.Array``s per step, every vendor
loader (dali_loader.py, rocal_loader.py) is held to it. With P = ``plan.on_devices(loader.plan(e), n)`` (device k's
logical shards in order, then a spare slot where it holds one fewer) and k_ = ceil(L/n) slots a device, for every name,
step s and device k at mesh position k:

    block k of name              = f(data[name][P.indices[s, k]])   f: its Normalize, if any
    block k of "mask"            = P.mask[s, k]                      (bool: False on padding and spare slots)
    block k of "index"           = P.indices[s, k]                   (int32: the sample a row holds)
    block k of "logical_shards"  = plan.device_slots(L, n)[k]        (int32: its slots' shards, -1 for a spare)

in layout "sharded" ((n*k_*b, ...) rows, block k rows k*k_*b ..) or "pmap" ((n, k_*b, ...), block k row k), all
``NamedSharding(mesh, P('data'))``, for any n from 1 to L. So batches are a function of (seed, epoch, step) alone, and
the L shards of a step are the same on every n.

Resuming: ``it = loader.epoch(e)``; after k steps ``saved = it.get_state()`` (a ``plan.LoaderState``: JSON with
``to_json``). A loader on any devices and batch size, built from the same data, seed, shuffle and last_batch, resumes
with ``loader.epoch(e, state=saved)``: each sample not yet delivered in a real slot is delivered exactly once (fill;
drop skips ``plan.elastic_plan``'s stated count). A state of other data is refused.

Placements: "host" gathers uint8 rows on the host, a chunk of steps (``chunk_steps``) in one
``jax.make_array_from_process_local_data``, and normalises on the devices; "device" keeps each shard resident on its
device and gathers there (faster: docs/performance.md). Both give the same bits, on the mesh given (never JAX's
default device); shard k is mesh position k, never ``device.id``.

Imports: plan.py, arithmetic.py, cifar_mnist.py, NumPy and JAX.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import os
import queue
import threading
import weakref
from collections.abc import Mapping
from typing import Callable, Iterator, Sequence

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from arithmetic import Normalize, aligned_empty, keyed_table, one_row, table_key, table_operands
from cifar_mnist import TRAIN_PREFIX, read_cifar10
from plan import (LoaderState, Plan, Schedule, check_policy, check_seed, dataset_digest, device_slots, on_devices,
                  shard_bounds)

DATA_AXIS = "data"
LAYOUTS = ("sharded", "pmap")
PLACEMENTS = ("host", "device")
MASK, INDEX, SHARDS = "mask", "index", "logical_shards"
ADDED = (MASK, INDEX, SHARDS)  # what every batch adds; refused as names in the data


def device_normalize(images_u8: jax.Array, how: dict, window: tuple[int, int, int, int], mirror: bool) -> jax.Array:
    """arithmetic.crop_mirror_normalize in JAX, for traced uint8 (..., C, H, W): crop, flip, then the table's values, by
    one of two routes that give its bits (``how``, a dict of arrays on the devices, from ``normalizer``):

    * {"table": (C, 256) or (1, 256)}: a lookup, one row when every channel's is alike;
    * the table's own operands per channel, {"inv", "offset"} for "rocal" and "dali_gpu",
      {"mean", "inv"} for "dali_cpu": its defining arithmetic (``exact_fma_u8``), on ARITHMETIC_PLATFORMS."""
    y0, x0, ch, cw = window
    x = images_u8[..., y0:y0 + ch, x0:x0 + cw]
    if mirror:
        x = jnp.flip(x, axis=-1)
    if "table" not in how:
        column = lambda v: v.reshape(-1, 1, 1)
        if "offset" in how:
            return exact_fma_u8(x, column(how["inv"]), column(how["offset"]))
        return (x.astype(jnp.float32) - column(how["mean"])) * column(how["inv"])
    table, x = how["table"], x.astype(jnp.int32)
    if table.shape[0] == 1:  # one table for every channel: a plain lookup, 1.6x faster on CPU
        return jnp.take(table[0], x, mode="clip")
    rows = (256 * jnp.arange(table.shape[0], dtype=jnp.int32)).reshape(-1, 1, 1)
    return jnp.take(table.reshape(-1), x + rows, mode="clip")


def exact_fma_u8(x_u8: jax.Array, inv: jax.Array, offset: jax.Array) -> jax.Array:
    """fma(x, inv, offset) in float32, rounded once, for x = 0..255, with no FMA instruction:

        hi  = inv with its 8 lowest significand bits cleared;  lo = inv - hi    (exact)
        a, b = x * hi, x * lo                        # exact: 8 x 16 and 8 x 8 significant bits
        z   = a + b + offset rounded once             # Boldo & Melquiond's sum of three:
              (uh, ul) = two_sum(b, offset); (th, tl) = two_sum(a, uh)
              z = th + round_to_odd(tl + ul)
        x = 0: 0 * inv + offset, IEEE's signed zeros as the FMA's

    Every step is a correctly rounded add or an exact product, so no compiler choice (an FMA contracted or not) moves a
    bit; subnormals, which XLA flushes to zero, could, which is why ``normalizer`` checks all 256 values on the devices
    before using it."""
    x = x_u8.astype(jnp.float32)
    hi = lax.bitcast_convert_type(lax.bitcast_convert_type(inv, jnp.uint32) & np.uint32(0xFFFFFF00), jnp.float32)
    lo = inv - hi
    uh, ul = _two_sum(x * lo, offset)
    th, tl = _two_sum(x * hi, uh)
    s, e = _two_sum(tl, ul)
    bits = lax.bitcast_convert_type(s, jnp.int32)
    away = (e != 0) & (s != 0) & ((bits & 1) == 0)  # inexact and even: step to the odd neighbour
    odd = lax.bitcast_convert_type(jnp.where(away, bits + jnp.where((e > 0) == (s > 0), 1, -1), bits), jnp.float32)
    return jnp.where(x == 0, x * inv + offset, th + odd)


def _two_sum(a, b):
    """(a + b rounded, its rounding error exactly): Knuth's six operations."""
    s = a + b
    v = s - a
    return s, (a - (s - v)) + (b - v)


# Devices, meshes and global arrays ----------------------------------------------------------------


def data_mesh(devices: Sequence[jax.Device] | Mesh) -> Mesh:
    """A one-axis mesh named 'data' over ``devices``, in their order: shard k is ``devices[k]``. Built with
    ``jax.sharding.Mesh`` (``jax.make_mesh`` may reorder devices). A Mesh is returned as it is if its 'data' axis holds
    all its devices, else refused; so are no device and a repeated device (ValueError)."""
    if isinstance(devices, Mesh):
        if DATA_AXIS not in devices.axis_names or devices.shape[DATA_AXIS] != devices.devices.size:
            raise ValueError(f"mesh: axis {DATA_AXIS!r} must hold every device, got axes {dict(devices.shape)}")
        return devices
    devices = list(devices)
    if not devices:
        raise ValueError("devices: need at least one device, got none")
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices: a device is listed twice: {devices}")
    array = np.empty(len(devices), object)
    array[:] = devices
    # Auto axes: jit propagates the batch's sharding, as the notebooks rely on.
    return Mesh(array, (DATA_AXIS,), axis_types=(AxisType.Auto,))


def local_positions(mesh: Mesh) -> list[int]:
    """Mesh positions (= shard indices) of this process's devices, ascending."""
    return [k for k, d in enumerate(mesh.devices.flat) if d.process_index == jax.process_index()]


def global_batch(blocks: dict[int, dict], mesh: Mesh, layout: str = "sharded") -> dict[str, jax.Array]:
    """Global arrays from per-shard blocks: ``blocks[k]`` ({name: (B, ...)}: NumPy arrays or a vendor's jax.Arrays) goes
    to mesh position k, in layout "sharded" ((n*B, ...)) or "pmap" ((n, B, ...)). Only this process's shards need to be
    present."""
    _check_layout(layout)
    devices, local = list(mesh.devices.flat), local_positions(mesh)
    missing = [k for k in local if k not in blocks]
    if missing:
        raise ValueError(f"global_batch: no block for the local shards {missing}")
    n, sharding = len(devices), NamedSharding(mesh, P(DATA_AXIS))
    out = {}
    for name, rows in blocks[local[0]].items():
        if isinstance(rows, np.ndarray) and rows.ndim == 1:  # mask, index, labels, logical shards: one
            # placement for all local shards (a device_put each cost more); images one each (no host concatenation)
            out[name] = _from_local_rows(np.concatenate([blocks[k][name] for k in local]), mesh, layout)
            continue
        expand = (lambda x: x) if layout == "sharded" else (lambda x: x[None])
        shape = (n * rows.shape[0],) + rows.shape[1:] if layout == "sharded" else (n,) + rows.shape
        parts = [jax.device_put(expand(blocks[k][name]), devices[k]) for k in local]
        out[name] = jax.make_array_from_single_device_arrays(shape, sharding, parts)
    return out


def _from_local_rows(x: np.ndarray, mesh: Mesh, layout: str) -> jax.Array:
    """This process's rows, local shard after local shard (equal blocks), as one global array in ``layout``."""
    n, n_local = mesh.devices.size, len(local_positions(mesh))
    sharding, b = NamedSharding(mesh, P(DATA_AXIS)), x.shape[0] // n_local
    if layout == "sharded":
        return jax.make_array_from_process_local_data(sharding, x, (n * b,) + x.shape[1:])
    return jax.make_array_from_process_local_data(sharding, x.reshape((n_local, b) + x.shape[1:]), (n, b) + x.shape[1:])


def added_fields(mask, indices, k: int, num_shards: int, num_devices: int) -> dict:
    """What a batch adds to device k's block: its mask, its rows' sample indices (int32) and its slots' logical shards
    (int32, ``device_slots(L, n)[k]``); for vendor loaders' blocks."""
    return {MASK: np.asarray(mask, bool), INDEX: np.asarray(indices, np.int32),
            SHARDS: device_slots(num_shards, num_devices)[k].astype(np.int32)}


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


# The loader ---------------------------------------------------------------------------------------


class Scheduled:
    """A loader's plan, from its ``arrays`` (name -> (N, ...)), ``mesh``, ``batch_size``, ``seed``, ``shuffle``,
    ``last_batch`` and ``logical_shards``; ``Loader``'s and ``rocal_loader.RocalLoader``'s, so a state moves between
    them. ``len()`` is a fresh epoch's steps, equal on every shard."""

    @property
    def num_samples(self) -> int:
        return len(next(iter(self.arrays.values())))

    @property
    def num_shards(self) -> int:
        return self.logical_shards or self.mesh.devices.size

    @property
    def num_devices(self) -> int:
        return self.mesh.devices.size

    @property
    def device_rows(self) -> int:
        """Rows per device per step: ceil(L/n) x batch_size (a spare slot included)."""
        return -(-self.num_shards // self.num_devices) * self.batch_size

    @functools.cached_property
    def dataset(self) -> str:
        """``plan.dataset_digest(arrays)``: what every state names; computed when a state is first made or checked (one
        pass over the data), then kept."""
        return dataset_digest(self.arrays)

    @functools.cached_property
    def schedule(self) -> Schedule:
        return Schedule(self.num_samples, self.num_shards, self.batch_size, self.seed, self.shuffle,
                        self.last_batch, dataset=lambda: self.dataset)

    @property
    def num_steps(self) -> int:
        return self.schedule.num_steps

    def __len__(self) -> int:
        return self.num_steps

    def plan(self, epoch: int) -> Plan:
        return self.schedule.plan(epoch)


@dataclasses.dataclass(frozen=True)
class Loader(Scheduled):
    """A sharded loader over an in-memory (or memory-mapped) dataset of named arrays; build it with ``make_loader``.
    ``arrays``: name -> host array (N, ...). ``logical_shards`` L (None: one per device, L = n): the plan's shards of
    ``batch_size`` b rows; device k of the n reads its ``device_slots(L, n)[k]``, ceil(L/n)*b rows per step
    (``device_rows``). ``normalize``: a dict name -> Normalize (a dict dataset), or what applies to "images" (the tuple
    form)."""
    arrays: dict[str, np.ndarray]
    mesh: Mesh
    batch_size: int
    layout: str = "sharded"
    shuffle: bool = False
    seed: int = 0
    last_batch: str = "fill"
    normalize: Normalize | dict | None = None
    prefetch: int = 2
    placement: str = "host"
    resident: dict | None = dataclasses.field(default=None, repr=False)  # placement="device"
    logical_shards: int | None = None

    @property
    def images(self) -> np.ndarray:
        return self.arrays["images"]

    @property
    def labels(self) -> np.ndarray:
        return self.arrays["labels"]

    @property
    def normalizers(self) -> dict:
        if isinstance(self.normalize, dict):
            return {name: f for name, f in self.normalize.items() if f is not None}
        return {} if self.normalize is None else {"images": self.normalize}

    def real_samples(self, epoch: int, *, state: LoaderState | None = None) -> int:
        """Real (mask-True) slots of ``epoch``, or of ``epoch(epoch, state=state)``'s steps."""
        resumed = None if state is None else self.schedule.resume("Loader.real_samples", epoch, state)
        return self.schedule.real_samples(epoch, resumed)

    def batch(self, epoch: int, step: int, *, state: LoaderState | None = None) -> dict[str, jax.Array]:
        """Step ``step`` of ``epoch`` alone (random access), of a fresh epoch or the one resumed from ``state``.
        IndexError for a step outside [0, num_steps) or [state.step, its end)."""
        start = self._start("Loader.batch", epoch, state)
        plan, row = start.plan()
        if not start.step <= step < start.num_steps:
            raise IndexError(f"step={step} is outside [{start.step}, {start.num_steps})")
        row += step - start.step
        return _steps(self, len(start.segments) == 1, plan, row, row + 1)[0]()()[0]

    def epoch(self, epoch: int, *, state: LoaderState | None = None) -> EpochIterator:
        """The batches of ``epoch``, or its rest from ``state`` (a ``get_state()``; the module's Resuming). Placement
        "host" prepares ``prefetch`` chunks (``chunk_steps``) ahead on a background thread, started at the first
        ``next()``; its errors are raised in the caller (``EpochIterator``: how it ends). ValueError for a state that is
        not a LoaderState or of another run or epoch."""
        start = self._start("Loader.epoch", epoch, state)
        plan, row = start.plan()
        makers = _steps(self, len(start.segments) == 1, plan, row, len(plan.indices))
        batches = (batch for prepare in makers for batch in prepare()()) if self.placement == "device" or \
            not self.prefetch else _Prefetched(lambda prepare: prepare(), makers, self.prefetch)
        return EpochIterator(batches, start if state is not None else lambda: self.schedule.start(epoch))

    def _start(self, where: str, epoch: int, state) -> LoaderState:
        """The state ``epoch`` starts from: ``state`` checked and resized, once; or a fresh step 0 naming no data
        (get_state names it: the digest is computed only when a state is asked for)."""
        if state is None:
            check_seed("epoch", epoch, where)
            return LoaderState.start(self.num_samples, self.num_shards, self.batch_size, epoch=epoch, seed=self.seed,
                                     shuffle=self.shuffle, last_batch=self.last_batch)
        return self.schedule.resume(where, epoch, state)


# A chunk of steps shares one transfer (placement "host") and one program: on an accelerator's host a call costs more
# than its bytes (a TPU v5e's: a transfer 0.2 ms and a program 0.13 ms of Python a call, 3 MB moved in 0.26 ms).
CHUNK_BYTES = 4 << 20  # a chunk's rows, all devices' together, at most this much, but for a chunk of one step
CHUNK_STEPS = 8  # and at most this many steps (a random access, ``Loader.batch``, moves its whole chunk)
# Where one program makes a chunk's batches, not one a step: where a call costs more than a small step's loading (a TPU
# v5e's). Not on CPUs, where XLA compiles each of a chunk's outputs apart (5 steps a call compile 10x as long as one).
CHUNK_PROGRAM_PLATFORMS = ("tpu",)


def chunk_steps(loader: Loader, plan_rows: int) -> int:
    """c, the steps of a chunk, for a plan of ``plan_rows`` steps: the most, up to CHUNK_STEPS and ``plan_rows``, whose
    rows on all devices take at most CHUNK_BYTES; at least 1. A function of the loader's arrays, devices and batch size
    alone, the same in every process."""
    step_bytes = loader.num_devices * loader.device_rows * sum(a[:1].nbytes for a in loader.arrays.values())
    return max(1, min(CHUNK_STEPS, plan_rows, CHUNK_BYTES // max(step_bytes, 1)))


def _steps(loader: Loader, fresh: bool, plan: Plan, first: int, stop: int) -> list[Callable]:
    """One function per chunk of ``chunk_steps`` = c rows of ``plan`` (rows j*c .. j*c + c - 1) that meets rows
    ``first .. stop - 1``: it prepares the chunk's rows and returns a function that makes the chunk's batches of those
    rows, a list (``_counted``). Per epoch, placed once: the plan's mask, sample indices and logical shards, every row
    of the plan, so that a resume at any row runs the programs its epoch compiled; in placement "device" also each
    device's local indices into its resident shard (on GATHER_ONCE_PLATFORMS, for more than one step, the epoch's rows
    gathered by them at once, ``_epoch_rows``; a single step, as ``Loader.batch`` makes, gathers its own rows), or for
    a resized segment (not ``fresh``: its samples may lie in any shard) rows ``first .. stop - 1`` from the host. Per
    chunk: in "host", preparing is one gather and one transfer; making is one ``_step_program`` dispatch (one a step
    off CHUNK_PROGRAM_PLATFORMS), no host sync."""
    if first >= stop:
        return []
    n, names = loader.num_devices, tuple(loader.arrays)
    if loader.placement == "device" and not fresh:  # the segment's rows only: they cross from the host
        plan, first, stop = Plan(plan.indices[first:stop], plan.mask[first:stop]), 0, stop - first
    on = on_devices(plan, n)
    placed = {MASK: _by_position(on.mask.swapaxes(0, 1), loader.mesh),
              INDEX: _by_position(on.indices.astype(np.int32).swapaxes(0, 1), loader.mesh),
              SHARDS: _by_position(device_slots(loader.num_shards, n).astype(np.int32), loader.mesh)}
    hows = {name: normalizer(table_key(f.mean, f.std, f.arithmetic, "Loader"), loader.mesh)
            for name, f in loader.normalizers.items()}
    windows = tuple((name, tuple(int(v) for v in f.window(loader.arrays[name].shape[2:])), f.mirror)
                    for name, f in loader.normalizers.items())
    source = "host" if loader.placement == "host" else "resident" if fresh else "epoch"
    c = chunk_steps(loader, len(on.indices))
    steps = c if loader.mesh.devices.flat[0].platform in CHUNK_PROGRAM_PLATFORMS else 1
    if source == "host":
        rows = functools.partial(_host_rows, loader, on, local_positions(loader.mesh), c)
    elif fresh:
        starts = np.array([start for start, _ in held_samples(loader.num_samples, loader.num_shards, n)])
        placed["local"] = _by_position((on.indices - starts[:, None]).astype(np.int32).swapaxes(0, 1), loader.mesh)
        resident = loader.resident
        if loader.mesh.devices.flat[0].platform in GATHER_ONCE_PLATFORMS and stop - first > 1:
            resident, source = _epoch_rows(loader.mesh, names)(resident, placed["local"]), "epoch"
        rows = lambda j: resident
    else:
        segment = {name: _by_position(on.indices.swapaxes(0, 1).reshape(n, -1), loader.mesh, source_)
                   for name, source_ in loader.arrays.items()}
        rows = lambda j: segment
    program = _step_program(loader.mesh, loader.layout, names, windows, source, steps)
    return _counted(program, loader.mesh, placed, hows, rows, first, stop, c, steps)


def _counted(program, mesh: Mesh, placed: dict, hows: dict, rows: Callable, first: int, stop: int, c: int,
             steps: int) -> list[Callable]:
    """For each chunk j of ``c`` plan rows (j*c .. j*c + c - 1) that meets ``first .. stop - 1``, a function preparing
    ``rows(j)`` and returning the maker of that chunk's batches of those steps: ``program(rows(j), placed, s, hows)``'s
    for s = j*c, j*c + ``steps``, .. (those that make a step asked for). The makers run in chunk order: s is given on
    the devices, as the call before made it (its second output; made from the host for the first call, or a call made
    out of order), never as a host scalar, which a TPU v5e transfers at each call (0.17 ms). Preparing (the transfer)
    and making (the programs) are apart: what is moved ahead stays as stored (uint8 images), and a chunk's normalised
    batches (float32: 4x their bytes) exist only once its first batch is asked for."""
    made = {}

    def make(j: int, prepared) -> list[dict[str, jax.Array]]:
        out = []
        for s in range(j * c, min(stop, (j + 1) * c), steps):
            if s + steps <= first:
                continue
            index = made.pop(s, None)
            if index is None:
                index = jax.make_array_from_callback((), NamedSharding(mesh, P()), lambda _, s=s: np.int32(s))
            batches, made[s + steps] = program(prepared, placed, index, hows)
            out += batches[max(first - s, 0):stop - s]
        return out
    return [lambda j=j: functools.partial(make, j, rows(j)) for j in range(first // c, (stop - 1) // c + 1)]


# Placement "host": rows gathered on the host, normalised on the devices ---------------------------
PARALLEL_GATHER_BYTES = 8 << 20  # a larger gather is split over threads (NumPy's take leaves the GIL)


def _host_rows(loader: Loader, on: Plan, positions: list[int], c: int, j: int) -> dict[str, jax.Array]:
    """Chunk j's rows of every name, one transfer: each local device's rows of plan rows j*c .. j*c + c - 1 in step
    order ((n*c*rows, ...) sharded), a row past the plan's end repeating its last (the chunk keeps its shape)."""
    steps = np.minimum(np.arange(j * c, (j + 1) * c), len(on.indices) - 1)
    idx, n = on.indices[steps][:, positions].swapaxes(0, 1).reshape(-1), loader.num_devices
    local = {name: _gather(source, idx) for name, source in loader.arrays.items()}
    shapes = {name: (n * c * loader.device_rows,) + x.shape[1:] for name, x in local.items()}
    return jax.make_array_from_process_local_data(NamedSharding(loader.mesh, P(DATA_AXIS)), local, shapes)


def _gather(source: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """``source[indices]`` into one 64-byte-aligned buffer; past PARALLEL_GATHER_BYTES in parts on threads."""
    out = aligned_empty((len(indices),) + source.shape[1:], source.dtype)
    parts = min(os.cpu_count() or 1, 8, out.nbytes // PARALLEL_GATHER_BYTES + 1)
    if parts > 1:
        bounds = np.linspace(0, len(indices), parts + 1).astype(int)
        errors: list[BaseException] = []
        workers = [threading.Thread(target=_take, args=(source, indices[a:b], out[a:b], errors), name="loader-gather")
                   for a, b in zip(bounds[:-1], bounds[1:])]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        if errors:
            raise errors[0]
    else:
        _take(source, indices, out)
    return out


def _take(source: np.ndarray, indices: np.ndarray, out: np.ndarray, errors: list | None = None) -> None:
    try:
        if source.flags.c_contiguous:
            # mode="clip": with the default "raise" NumPy buffers the whole gather, 30x slower.
            np.take(source, indices, axis=0, out=out, mode="clip")
        else:
            # read_cifar10's images are a strided view: np.take would copy the whole dataset.
            np.copyto(out, source[indices])
    except BaseException as error:  # on a thread: raised by _gather
        if errors is None:
            raise
        errors.append(error)


# Where the devices normalise by the table's arithmetic, not a lookup: where a lookup is a slow gather (a TPU v5e's).
ARITHMETIC_PLATFORMS = ("tpu",)
# Where placement "device" gathers an epoch's rows once, then slices each step's: where a gather costs about the same
# whatever its rows (a TPU v5e's). On CPUs a gather per step is faster (no second copy of the epoch).
GATHER_ONCE_PLATFORMS = ("tpu",)


@functools.lru_cache(maxsize=64)
def normalizer(key: tuple[bytes, bytes, str], mesh: Mesh) -> dict:
    """``device_normalize``'s ``how`` for table ``key`` on ``mesh``, replicated: the table's operands on
    ARITHMETIC_PLATFORMS when the devices compute all 256 values of every channel to the table's bits, else the table.
    Arrays are arguments of the jitted programs, never constants."""
    table = keyed_table(key)
    put = lambda a: jax.make_array_from_callback(a.shape, NamedSharding(mesh, P()), lambda index: a[index])
    if mesh.devices.flat[0].platform in ARITHMETIC_PLATFORMS:
        how = {name: put(value) for name, value in table_operands(key).items()}
        values = np.arange(256, dtype=np.uint8)[None, None, :].repeat(len(table), 0)  # (C, 1, 256)
        got = jax.jit(device_normalize, static_argnums=(2, 3))(put(values), how, (0, 0, 1, 256), False)
        if np.array_equal(np.asarray(got.addressable_data(0))[:, 0].view(np.uint32), table.view(np.uint32)):
            return how
    return {"table": put(table[:1] if one_row(table) else table)}


@functools.lru_cache(maxsize=None)
def _step_program(mesh: Mesh, layout: str, names: tuple[str, ...], windows: tuple, source: str, steps: int = 1):
    """``steps`` steps' batches on the devices, jit(shard_map): (rows by name, the placed plan, the first step s (int32,
    replicated), the normalisers) -> ([one batch per step s + i: {name: normalised rows, "mask", "index",
    "logical_shards"} in ``layout``], s + steps replicated: the next call's s). Step s + i's rows of a name are, by
    ``source``: "host", rows k*b .. (k+1)*b - 1 of the rows given (just placed: a chunk of c steps, k = (s+i) mod c,
    so ``steps`` divides c); "epoch", rows (s+i)*b ..
    (s+i+1)*b - 1 of the epoch's; "resident", the resident shard's rows at the plan's local indices (placed "local"),
    gathered. A step past the plan's end (a chunk's tail) reads its last row of the plan. The steps' rows are
    normalised together (row by row, so the same bits), then split: the program grows little with ``steps``."""
    how = {name: (window, mirror) for name, window, mirror in windows}

    def step(rows, placed, s, hows):
        b = placed[MASK].shape[-1]
        t = jnp.minimum(s + jnp.arange(steps), placed[MASK].shape[1] - 1)  # the steps' plan rows
        out = {MASK: placed[MASK][0][t], INDEX: placed[INDEX][0][t]}
        for name in names:
            x = rows[name]
            if source == "host":  # a chunk's rows: the call's steps start at its step s mod c
                x = lax.dynamic_slice_in_dim(x, s % (x.shape[0] // b) * b, steps * b)
            elif source == "epoch":
                x = jnp.concatenate([lax.dynamic_slice_in_dim(x[0], t[i] * b, b) for i in range(steps)])
            elif source == "resident":
                x = x.at[placed["local"][0][t].reshape(-1)].get(mode="promise_in_bounds")
            x = device_normalize(x, hows[name], *how[name]) if name in how else x
            out[name] = x.reshape((steps, b) + x.shape[1:])
        batches = [{**{name: x[i] for name, x in out.items()}, SHARDS: placed[SHARDS][0]} for i in range(steps)]
        return batches if layout == "sharded" else jax.tree.map(lambda x: x[None], batches), s + steps

    specs = (P(DATA_AXIS), P(DATA_AXIS), P(), P())
    # out_shardings: on a one-device mesh jit would otherwise return some outputs as P().
    run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=(P(DATA_AXIS), P())),
                  out_shardings=(NamedSharding(mesh, P(DATA_AXIS)), NamedSharding(mesh, P())))
    order = (*names, *ADDED)
    return lambda *args: (lambda out, s: ([{name: b[name] for name in order} for b in out], s))(*run(*args))


# Placement "device": each shard resident on its device, gathered there once per epoch --------------


def _by_position(per_shard: np.ndarray, mesh: Mesh, source: np.ndarray | None = None) -> jax.Array:
    """(n, ...) host array -> global array sharded on axis 0: row k on mesh position k. With ``source``, ``per_shard``
    holds indices into it, and only this process's positions' rows are gathered."""
    sharding = NamedSharding(mesh, P(DATA_AXIS))
    if source is None:
        return jax.make_array_from_callback(per_shard.shape, sharding, lambda i: per_shard[i])
    return jax.make_array_from_callback(per_shard.shape + source.shape[1:], sharding,
                                        lambda i: source[per_shard[i[:per_shard.ndim]]])


@functools.lru_cache(maxsize=None)
def _epoch_rows(mesh: Mesh, names: tuple[str, ...]):
    """jit(shard_map): (resident shards, local indices (n, steps, rows)) -> each name's rows of those steps on each
    device, in step order, (n, steps * rows, ...) sharded: one gather."""
    def gather(resident, local):
        return {name: resident[name].at[local.reshape(-1)].get(mode="promise_in_bounds")[None] for name in names}
    return jax.jit(jax.shard_map(gather, mesh=mesh, in_specs=(P(DATA_AXIS), P(DATA_AXIS)), out_specs=P(DATA_AXIS)))


def device_fit(data, devices: Sequence[jax.Device] | Mesh, device_budget: int | None = None, *,
               logical_shards: int | None = None) -> str | None:
    """Why ``data`` would not fit placement "device" on ``devices`` (a list or a mesh, as make_loader takes them), or
    None: make_loader's own check. ``data`` as make_loader takes it, a dict {name: array} or the tuple (samples,
    labels), labels delivered as int32 (anything with a shape and a dtype: memory maps are not read). Every field
    counts: the most samples a device holds (``held_samples``, with make_loader's ``logical_shards``), each field's
    bytes per sample added, held once (the resident shard), or twice on GATHER_ONCE_PLATFORMS (and an epoch's rows),
    over ``device_budget`` bytes per device: by default half of what the device reports free, or for CPU devices half
    the host's available memory over this process's devices; the other half leaves room for a resized segment's rows,
    which cross from the host. ValueError for another kind of ``data`` (a folder: read it first)."""
    if isinstance(data, tuple) and len(data) == 2:
        fields = [(np.shape(data[0]), np.dtype(data[0].dtype)), (np.shape(data[1]), np.dtype(np.int32))]
    elif isinstance(data, Mapping) and data:
        fields = [(np.shape(a), np.dtype(a.dtype)) for a in data.values()]
    else:
        raise ValueError(f"device_fit: data must be a dict of arrays or a (samples, labels) tuple, as make_loader "
                         f"takes them, got {type(data).__name__}")
    return _fits(fields[0][0][0], sum(int(np.prod(shape[1:])) * dtype.itemsize for shape, dtype in fields),
                 data_mesh(devices), device_budget, logical_shards)


def held_samples(num_samples: int, num_shards: int, num_devices: int) -> list[tuple[int, int]]:
    """Each device's samples of a fresh epoch, (start, stop): its logical shards' together, samples N*lo//L ..
    N*hi//L - 1 for (lo, hi) = ``shard_bounds(L, d, n)``; where n divides L, ``shard_bounds(N, d, n)``. Placement
    "device" keeps them resident."""
    return [(num_samples * lo // num_shards, num_samples * hi // num_shards)
            for lo, hi in (shard_bounds(num_shards, d, num_devices) for d in range(num_devices))]


def _fits(num_samples: int, sample_bytes: int, mesh: Mesh, device_budget: int | None,
          num_shards: int | None = None) -> str | None:
    n = mesh.devices.size
    size = max(stop - start for start, stop in held_samples(num_samples, num_shards or n, n))
    twice = mesh.devices.flat[0].platform in GATHER_ONCE_PLATFORMS
    per_device = (2 if twice else 1) * size * sample_bytes
    local = [mesh.devices.flat[k] for k in local_positions(mesh)]
    limit, where = (device_budget, "device_budget") if device_budget is not None else _default_budget(local)
    if per_device <= limit:
        return None
    held = "twice (its shard and an epoch's rows)" if twice else "once (its shard)"
    return (f"placement='device': each device would hold {size} samples {held} "
            f"= {per_device / 2**20:.1f} MiB ({num_samples} samples / {n} devices), over the budget of "
            f"{limit / 2**20:.1f} MiB per device ({where}); use placement='host' or more devices")


def _default_budget(devices: list) -> tuple[int, str]:
    stats = devices[0].memory_stats() if devices else None
    if stats and "bytes_limit" in stats:
        free = min(d.memory_stats()["bytes_limit"] - d.memory_stats().get("bytes_in_use", 0) for d in devices)
        return free // 2, f"half the free memory of {devices[0].platform} devices"
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available // 2 // max(len(devices), 1), \
        f"half the host's available memory over {len(devices)} {devices[0].platform} devices"


def _place_dataset(arrays: dict[str, np.ndarray], mesh: Mesh, budget: int | None, num_shards: int) -> dict:
    """Device k's ``held_samples`` of every array on mesh position k, padded to the largest."""
    N = len(next(iter(arrays.values())))
    too_big = device_fit(arrays, mesh, budget, logical_shards=num_shards)
    if too_big:
        raise ValueError(too_big)
    n, held = mesh.devices.size, held_samples(N, num_shards, mesh.devices.size)
    size = max(stop - start for start, stop in held)

    def rows(source: np.ndarray):
        def block(index):
            k = index[0].start // size if index[0].start is not None else 0
            start, stop = held[k]
            out = np.zeros((size,) + source.shape[1:], source.dtype)
            out[:stop - start] = source[start:stop]
            return out
        return jax.make_array_from_callback((n * size,) + source.shape[1:], NamedSharding(mesh, P(DATA_AXIS)), block)
    return {name: rows(source) for name, source in arrays.items()}


# make_loader: the checks --------------------------------------------------------------------------


def make_loader(data, devices: Sequence[jax.Device] | Mesh, batch_size: int, *, layout: str = "sharded",
                filename_prefix: str = TRAIN_PREFIX, shuffle: bool = False, seed: int = 0, last_batch: str = "fill",
                normalize: Normalize | dict | str | None = "default", prefetch: int = 2, placement: str = "host",
                device_budget: int | None = None, logical_shards: int | None = None) -> Loader:
    """A ``Loader`` over ``data`` on ``devices`` (shard k on ``devices[k]``, or mesh position k).

    Args:
      data: a dict ``{name: array}`` (any string names but "mask", "index" and "logical_shards", any dtype JAX holds as
        it is, every array N first), delivered as stored unless ``normalize`` names it; or the notebooks' tuple
        ``(samples, labels)``, delivered as {"images", "labels" (int32)}; or a CIFAR-10 folder, read with
        ``filename_prefix`` (the tuple form over its files).
      batch_size: b, rows per logical shard (per device, without ``logical_shards``) per step.
      layout: "sharded" ((n*B, ...) for jit) or "pmap" ((n, B, ...)).
      shuffle, seed, last_batch: the plan's (plan.epoch_plan): shuffle a bool, seed in [0, 2**32), last_batch "fill"
        (pad, masked) or "drop".
      normalize: for a dict dataset, None or ``{name: Normalize}``; for the tuple form, the Normalize of "images"
        ("default": the rocAL notebook's ``Normalize()``), or None. A Normalize needs uint8 (N, C, H, W) images.
      prefetch: chunks of steps made ahead on a thread (placement "host", ``chunk_steps``), an int >= 0.
      placement: "host" or "device" (the module docstring); "device" refuses a dataset whose shard does not fit
        ``device_budget`` bytes per device.
      logical_shards: L, the plan's shards (at least the device count), so that the L shards of b rows of a step are
        the same on every n from 1 to L; None: L = n.

    Raises:
      ValueError, naming the parameter and the value: for any argument outside the above, a batch larger than the
      smallest shard, more shards than samples, an array of a dtype JAX would convert (int64 without ``jax_enable_x64``:
      the message says which dtype keeps its values), arrays of different N, a Normalize that does not fit its
      images."""
    arrays, normalize = _dataset(data, filename_prefix, normalize)
    mesh = data_mesh(devices)
    check_policy(last_batch)
    _check_layout(layout)
    check_seed("seed", seed, "make_loader")
    if placement not in PLACEMENTS:
        raise ValueError(f"make_loader: placement must be one of {PLACEMENTS}, got {placement!r}")
    if not _is_int(batch_size) or batch_size < 1:
        raise ValueError(f"make_loader: batch_size must be an int >= 1 (per device), got {batch_size!r}")
    if not _is_int(prefetch) or prefetch < 0:
        raise ValueError(f"make_loader: prefetch must be an int >= 0, got {prefetch!r}")
    if not isinstance(shuffle, (bool, np.bool_)):
        raise ValueError(f"make_loader: shuffle must be a bool, got {shuffle!r}")
    if device_budget is not None and not _is_int(device_budget):
        raise ValueError(f"make_loader: device_budget must be None or an int (bytes), got {device_budget!r}")
    n = mesh.devices.size
    if logical_shards is not None:
        if not _is_int(logical_shards):
            raise ValueError(f"make_loader: logical_shards={logical_shards!r} must be an int")
        if logical_shards < 1:
            raise ValueError(f"make_loader: logical_shards={logical_shards!r} must be at least 1")
        if logical_shards < n:
            raise ValueError(f"make_loader: logical_shards={logical_shards!r} is fewer than the {n} device(s) "
                             f"(each device reads whole logical shards, at least one)")
    loader = Loader(arrays, mesh, int(batch_size), layout, bool(shuffle), int(seed), last_batch, normalize,
                    int(prefetch), placement, logical_shards=None if logical_shards is None else int(logical_shards))
    L, N = loader.num_shards, loader.num_samples
    shards = f"{L} logical shards" if logical_shards is not None else f"{L} devices"
    if L > N:
        raise ValueError(f"make_loader: {shards} but only {N} samples: some shard would be empty")
    if batch_size > N // L:
        per = "per logical shard" if logical_shards is not None else "per device"
        raise ValueError(f"make_loader: batch_size={batch_size} {per} is larger than the smallest shard "
                         f"({N // L} samples = {N} samples / {shards})")
    if placement == "device":
        loader = dataclasses.replace(loader, resident=_place_dataset(arrays, mesh, device_budget, L))
    return loader


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _dataset(data, filename_prefix: str, normalize):
    """make_loader's checks of the data and of ``normalize``: (arrays by name, normalize resolved: a dict for a dict
    dataset, else the Normalize of "images" or None)."""
    if isinstance(data, (str, os.PathLike)):
        data = read_cifar10(data, filename_prefix)
    elif filename_prefix != TRAIN_PREFIX:
        raise ValueError(f"make_loader: filename_prefix={filename_prefix!r} picks the files of a CIFAR-10 "
                         f"folder, but data is a {type(data).__name__} of arrays; read the files first "
                         f"(read_cifar10(folder, {filename_prefix!r})) or pass the folder")
    if isinstance(data, Mapping):
        return _named_arrays(data, normalize)
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        # Not "samples, labels = data": a (2, N) array would unpack into two rows.
        raise ValueError(f"make_loader: data must be a CIFAR-10 folder, a tuple (samples, labels) or a dict of "
                         f"named arrays, got {type(data).__name__}{f' {data.shape}' if hasattr(data, 'shape') else ''}")
    samples, labels = data
    if isinstance(normalize, str) and normalize == "default":
        normalize = Normalize()
    elif isinstance(normalize, Mapping):
        if set(normalize) - {"images"}:
            raise ValueError(f"make_loader: normalize={dict(normalize)!r} names "
                             f"{sorted(set(normalize) - {'images'})}, but the tuple form (samples, labels) "
                             f"normalises only 'images'; pass a dict dataset to normalise other names")
        normalize = normalize.get("images")
    if normalize is not None and not isinstance(normalize, Normalize):
        raise ValueError(f"make_loader: normalize={normalize!r} is not a Normalize, a dict or None")
    samples, labels = np.asarray(samples), np.asarray(labels)
    if samples.ndim < 1 or labels.shape != samples.shape[:1]:
        raise ValueError(f"make_loader: data must be samples (N, ...) and labels (N,), got samples "
                         f"{samples.dtype} {samples.shape}, labels {labels.shape}")
    _check_dtype("samples", samples)
    if labels.dtype.kind not in "biu":
        raise ValueError(f"make_loader: labels must be integers (N,), got dtype {labels.dtype} (for float or "
                         f"other targets, pass a dict dataset: {{'images': samples, 'targets': targets}})")
    _check_dtype("labels", labels)  # int64 refused as in a dict dataset: one rule
    if labels.size and (labels.min() < np.iinfo(np.int32).min or labels.max() > np.iinfo(np.int32).max):
        raise ValueError(f"make_loader: labels must fit int32, got range [{labels.min()}, {labels.max()}]")
    _check_normalizer("samples", samples, normalize, "pass normalize=None to deliver them as they are")
    return {"images": samples, "labels": labels.astype(np.int32, copy=False)}, normalize


def _named_arrays(data: Mapping, normalize):
    if not data:
        raise ValueError("make_loader: data is an empty dict; a dataset needs at least one named array")
    arrays = {}
    for name, value in data.items():
        if not isinstance(name, str):
            raise ValueError(f"make_loader: data's names must be strings (they name the batch's arrays), got {name!r}")
        if name in ADDED:
            raise ValueError(f"make_loader: data has an array named {name!r}; every batch adds its own "
                             f"{', '.join(map(repr, ADDED))}, so rename yours")
        array = np.asarray(value)
        if array.ndim < 1:
            raise ValueError(f"make_loader: data[{name!r}] must be (N, ...), one row per sample, got a "
                             f"0-d {array.dtype} array")
        arrays[name] = array
        _check_dtype(f"data[{name!r}]", array)
    sizes = {name: len(a) for name, a in arrays.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"make_loader: every array of data must hold the same N samples (axis 0), got {sizes}")
    if normalize is None or (isinstance(normalize, str) and normalize == "default"):
        return arrays, {}
    if not isinstance(normalize, Mapping):
        raise ValueError(f"make_loader: normalize={normalize!r} for a dict dataset: name the arrays to normalise, e.g. "
                         f"normalize={{{next(iter(arrays))!r}: Normalize(...)}} (the data's names: {list(arrays)})")
    unknown = [name for name in normalize if name not in arrays]
    if unknown:
        raise ValueError(f"make_loader: normalize names {unknown}, which the data lacks (its names: {list(arrays)})")
    norms = {name: f for name, f in normalize.items() if f is not None}
    for name, f in norms.items():
        if not isinstance(f, Normalize):
            raise ValueError(f"make_loader: normalize[{name!r}]={f!r} is not a Normalize")
        _check_normalizer(f"data[{name!r}]", arrays[name], f, f"leave {name!r} out of normalize to deliver it as it is")
    return arrays, norms


def _check_dtype(what: str, array: np.ndarray) -> None:
    if not (jnp.issubdtype(array.dtype, jnp.number) or array.dtype == np.bool_):
        raise ValueError(f"make_loader: {what} of dtype {array.dtype} is not numbers JAX can hold; "
                         f"convert it to a numeric array first (token ids: np.int32)")
    held = np.dtype(jax.dtypes.canonicalize_dtype(array.dtype))
    if held == array.dtype:
        return
    fix = f"{what}.astype(np.{held.name})"
    if array.dtype.kind in "iu":
        info = np.iinfo(held)
        low, high = (array.min(), array.max()) if array.size else (0, 0)
        fix += (" (keeps them integers; its values fit)" if info.min <= low and high <= info.max else
                f" keeps them integers but does not hold its values (range [{low}, {high}]), so enable x64")
    else:
        fix += " (rounds each value)"
    raise ValueError(f"make_loader: {what} of dtype {array.dtype} cannot go to the devices as stored: "
                     f"without jax_enable_x64 JAX would convert it to {held} in silence. Pass {fix}, or "
                     f"call jax.config.update('jax_enable_x64', True) first to keep {array.dtype}")


def _check_normalizer(what: str, array: np.ndarray, normalize, fix: str) -> None:
    if not isinstance(normalize, Normalize):
        return
    if array.dtype != np.uint8 or array.ndim != 4:
        hint = {3: " (one-channel (N, H, W) images: pass images[:, None], (N, 1, H, W))",
                2: " (flat rows: reshape them to (N, C, H, W))"}.get(array.ndim, "") if array.dtype == np.uint8 else ""
        raise ValueError(f"make_loader: normalize={normalize} needs uint8 images (N, C, H, W), got "
                         f"{what} {array.dtype} {array.shape}{hint}; {fix}")
    try:
        normalize.output_shape(array.shape[1:])
    except ValueError as error:
        raise ValueError(f"make_loader: {what} {array.shape}: {error}") from None


# An epoch's iterator: its own state, and its end however it comes ---------------------------------


class EpochIterator:
    """An epoch's batches. ``get_state()``: the ``LoaderState`` after the batches yielded so far, to resume from.
    ``close()``: what the iterator holds (a prefetch thread, a vendor's pipelines and files) is released exactly once,
    at the first of: the epoch's end, ``close()``, garbage collection, or the interpreter's exit (a
    ``weakref.finalize``, which runs before modules are torn down, so nothing is printed and nothing is left running).
    No batch references the iterator."""

    def __init__(self, batches: Iterator, state: LoaderState | Callable[[], LoaderState]):
        self._batches = batches  # state: of the first batch, or a function making it when asked
        self._state, self._yielded = state, 0
        self._end = weakref.finalize(self, getattr(batches, "close", lambda: None))

    def __iter__(self) -> "EpochIterator":
        return self

    def __next__(self):
        if not self._end.alive:
            raise StopIteration
        try:
            batch = next(self._batches)
        except BaseException:  # the end (StopIteration) or an error: release now
            self._end()
            raise
        self._yielded += 1
        return batch

    def get_state(self) -> LoaderState:
        if callable(self._state):
            self._state = self._state()
        return self._state.at_step(self._state.step + self._yielded)

    def close(self) -> None:
        self._end()


class _Prefetched:
    """``prepare(s)`` for each s of ``steps`` by a worker thread started at the first ``next()``, ``depth`` ahead; each
    returns a maker of a list of batches, which the consumer calls when it needs them, yielding their batches in order.
    At most ``depth`` prepared and not yet wholly taken (the worker waits for a free slot before it prepares the next;
    a slot frees at its list's last batch's taking). A worker error is raised in the consumer. The worker is stopped and
    joined once, at the first of: the end, an error, ``close()``, collection, or exit. It references the queue, the
    slots, the stop event, ``prepare`` and ``steps``, never this object."""

    def __init__(self, prepare: Callable, steps, depth: int):
        self._out: queue.Queue = queue.Queue()
        self._slots, self._held = threading.Semaphore(depth), []
        stop = threading.Event()
        self._worker = threading.Thread(target=_prefetch_work, args=(prepare, steps, self._out, self._slots, stop),
                                        name="loader-prefetch", daemon=True)
        self._end = weakref.finalize(self, _stop_worker, stop, self._worker)

    def __iter__(self) -> "_Prefetched":
        return self

    def __next__(self):
        if not self._end.alive:
            raise StopIteration
        if not self._held:
            if self._worker.ident is None:
                self._worker.start()
            kind, value = self._out.get()
            if kind != "batches":
                self._end()
                if kind == "error":
                    raise value
                raise StopIteration
            self._held = value()[::-1]
        batch = self._held.pop()
        if not self._held:
            self._slots.release()
        return batch

    def close(self) -> None:
        self._end()


def _prefetch_work(prepare: Callable, steps, out: queue.Queue, slots: threading.Semaphore,
                   stop: threading.Event) -> None:
    try:
        for s in steps:
            while not slots.acquire(timeout=0.05):  # a free slot, or the stop
                if stop.is_set():
                    return
            if stop.is_set():
                return
            out.put(("batches", prepare(s)))
        out.put(("end", None))
    except BaseException as error:  # handed to the consumer, raised there
        out.put(("error", error))


def _stop_worker(stop: threading.Event, worker: threading.Thread) -> None:
    stop.set()
    # Not when the worker collects its own iterator (a cycle the collector breaks there).
    if worker.ident is not None and worker is not threading.current_thread():
        worker.join()
