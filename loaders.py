"""Delivery onto devices: the reference loader, one shard per device.

This module puts the plan (plan.py: which sample sits in which slot of which
shard's batch at which step) onto devices, as global ``jax.Array``s, and is the
loader every vendor loader (rocal_loader.py, dali_loader.py) is held to. The
samples come from any dataset of named arrays, or from the notebooks' files
(cifar_mnist.py); images are normalised with the vendors' arithmetic as exact
tables (arithmetic.py).

The contract, in the order the pieces are used:

* ``data_mesh`` is a one-axis mesh named 'data' over the devices given, in their
  order: shard k is the device at mesh position k. ``global_batch`` and
  ``global_batch_from_rows`` build the global arrays from per-shard blocks (one
  process or several).
* ``make_loader`` puts it together: one loader for a set of devices over a
  dataset of named arrays, N first: a dict ``{name: array}`` (token ids and
  per-token targets, float features and float targets, images and labels: any
  names but "mask", any shapes, any dtype JAX holds as it is), or the
  notebooks' tuple ``(images, labels)`` and a CIFAR-10 folder, which give
  "images" and "labels". Its epoch iterator yields every name plus "mask" as
  global ``jax.Array``s, row block k on the device at position k of the mesh,
  each name delivered bit for bit as stored unless ``normalize`` names it
  (``normalize={"images": Normalize()}``; for the tuple form ``Normalize()`` is
  the default). Batches are a pure function of (seed, epoch, step): resume at
  any step, or on other devices from a ``LoaderState`` (plan.py).
* ``placement`` says where the work happens: "host" gathers rows on the host and
  normalises on the devices; "device" keeps each shard resident on its device
  and gathers there; "host_float32" normalises on the host. All three give the
  same bits.

Guarantees (each is tested in test_loaders.py, test_loaders_any_data.py and
test_loaders_resume.py):

* block k of every name at step s is that name's rows of ``plan.indices[s, k]``
  (normalised where asked), and block k of "mask" is ``plan.mask[s, k]``, for
  the loader's plan: every guarantee of the plan (equal steps, exactly once,
  the shuffle) holds for what the devices receive.
* Every name of a dataset follows the same plan, mask, layout and resume.
* The three placements give bit-identical global arrays, in both layouts.
* An epoch's iterator ends what it started (a prefetch thread; a vendor's
  pipelines and files, through ``EpochIterator``) however it ends: exhausted,
  closed, collected, or left unfinished at the interpreter's exit, where it ends
  before modules are torn down and prints nothing.

Devices: nothing here uses JAX's default device or backend. Every array goes to
the devices of the mesh it was given, so a mesh of CPU devices on a GPU host
stays on the CPU. The shard of a device is its position in the mesh, never
``device.id`` (device ids need not be 0..n-1; see JAX issue 16024).

Imports: plan.py, arithmetic.py, cifar_mnist.py, NumPy and JAX. Imported by the
vendor modules, strategies' tests, refimpl.py and bench.py. Supported: JAX 0.10
or newer (tested on 0.10.2; the module itself needs only ``jax.shard_map`` at top
level and ``jax.sharding.Mesh`` with ``axis_types``, so 0.7+); NumPy >= 1.25.
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
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from arithmetic import Normalize, aligned_empty, keyed_table, one_row, table_key
from cifar_mnist import TRAIN_PREFIX, read_cifar10
from plan import (LoaderState, Plan, Schedule, check_policy, check_seed, dataset_digest, on_devices,
                  shard_bounds)

DATA_AXIS = "data"
LAYOUTS = ("sharded", "pmap")
PLACEMENTS = ("host", "device", "host_float32")


def device_normalize(images_u8: jax.Array, table: jax.Array, window: tuple[int, int, int, int],
                     mirror: bool) -> jax.Array:
    """The same arithmetic in JAX, for traced uint8 (..., C, H, W): crop, flip, then a
    gather from ``table`` (C, 256), or (1, 256) when every channel has the same
    table, so the bits are the table's on every device."""
    y0, x0, ch, cw = window
    x = images_u8[..., y0:y0 + ch, x0:x0 + cw].astype(jnp.int32)
    if mirror:
        x = jnp.flip(x, axis=-1)
    channels = table.shape[0]
    if channels == 1:  # one table for every channel: a plain lookup, 1.6x faster on CPU
        return jnp.take(table[0], x, mode="clip")
    rows = (256 * jnp.arange(channels, dtype=jnp.int32)).reshape(channels, 1, 1)
    return jnp.take(table.reshape(-1), x + rows, mode="clip")


# --------------------------------------------------------------------------
# Devices, meshes and global arrays
# --------------------------------------------------------------------------


def data_mesh(devices: Sequence[jax.Device] | Mesh) -> Mesh:
    """A one-axis mesh named 'data' over ``devices``, keeping their order exactly.

    Built with ``jax.sharding.Mesh`` (``jax.make_mesh`` may reorder devices on
    accelerators), so mesh position k, and with it shard k, is ``devices[k]``.
    A Mesh is returned as it is after checking that it has a 'data' axis holding
    all its devices. Raises ValueError for no device, a repeated device, or a mesh
    whose 'data' axis does not span its devices.
    """
    if isinstance(devices, Mesh):
        mesh = devices
        if DATA_AXIS not in mesh.axis_names or mesh.shape[DATA_AXIS] != mesh.devices.size:
            raise ValueError(
                f"mesh: axis {DATA_AXIS!r} must hold every device, got axes {dict(mesh.shape)}"
            )
        return mesh
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


def split_rows(rows: dict[str, np.ndarray], positions: list[int]) -> dict[int, dict[str, np.ndarray]]:
    """Rows (len(positions) * B, ...) holding the blocks of ``positions`` one after the
    other, as {position: block} (views): block j of the rows belongs to positions[j]."""
    size = len(rows["mask"]) // len(positions)
    return {k: {name: x[j * size:(j + 1) * size] for name, x in rows.items()}
            for j, k in enumerate(positions)}


def global_batch(blocks: dict[int, dict[str, np.ndarray]], mesh: Mesh, layout: str = "sharded"):
    """Global ``jax.Array``s from per-shard blocks: block k goes to mesh position k.

    ``blocks[k]`` maps each name ("images", "labels", "mask") to shard k's rows
    (B, ...): NumPy arrays, or jax.Arrays (a vendor's output), copied to device k
    if they are elsewhere. Only the shards whose device belongs to this process
    need to be present, so the same call builds the same global batch in every
    process of a multi-process run. Layouts, both ``NamedSharding(mesh, P('data'))``:

    * "sharded": (n*B, ...), what jit on sharded arrays takes;
    * "pmap": (n, B, ...), what pmap and DALI's devices= give.
    """
    _check_layout(layout)
    devices = list(mesh.devices.flat)
    local = local_positions(mesh)
    missing = [k for k in local if k not in blocks]
    if missing:
        raise ValueError(f"global_batch: no block for the local shards {missing}")
    n = len(devices)
    sharding = NamedSharding(mesh, P(DATA_AXIS))
    out = {}
    for name in blocks[local[0]]:
        rows = blocks[local[0]][name]
        if layout == "sharded":
            shape = (n * rows.shape[0],) + rows.shape[1:]
            parts = [jax.device_put(blocks[k][name], devices[k]) for k in local]
        else:
            shape = (n,) + rows.shape
            parts = [jax.device_put(blocks[k][name][None], devices[k]) for k in local]
        out[name] = jax.make_array_from_single_device_arrays(shape, sharding, parts)
    return out


def global_batch_from_rows(rows: dict[str, np.ndarray], mesh: Mesh, layout: str = "sharded"):
    """``global_batch`` for rows already laid out as this process's part of the batch.

    ``rows[name]`` is (n_local * B, ...): the blocks of this process's shards, in
    mesh order, one after the other. One ``jax.make_array_from_process_local_data``
    per name replaces n ``device_put``s (each ~0.1 ms of fixed cost on CPU), and
    a 64-byte-aligned buffer is used in place, not copied.
    """
    _check_layout(layout)
    n = mesh.devices.size
    local = local_positions(mesh)
    n_local = len(local)
    if local != list(range(local[0], local[0] + n_local)):
        # This process's rows are not one contiguous slice of the global batch
        # (a hand-made mesh that interleaves processes): place block by block.
        return global_batch(split_rows(rows, local), mesh, layout)
    sharding = NamedSharding(mesh, P(DATA_AXIS))
    out = {}
    for name, x in rows.items():
        block = x.reshape((n_local, -1) + x.shape[1:])
        if layout == "sharded":
            out[name] = jax.make_array_from_process_local_data(sharding, x, (n * block.shape[1],) + x.shape[1:])
        else:
            out[name] = jax.make_array_from_process_local_data(sharding, block, (n,) + block.shape[1:])
    return out


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


# --------------------------------------------------------------------------
# The loader
# --------------------------------------------------------------------------

MASK = "mask"  # bool per row: False on padding
INDEX = "index"  # int32 per row: the sample (row of the dataset) the row holds
SHARDS = "logical_shards"  # int32, one entry a logical shard: 0..L-1, sharded like the rows
ADDED = (MASK, INDEX, SHARDS)  # what every batch adds; refused as names in the data


def added_fields(mask, indices, k: int, num_shards: int, num_devices: int) -> dict:
    """What a batch adds to device k's block (global position k of ``num_devices``): its
    mask, its rows' sample indices (int32) and its logical shards (int32, (L/n,))."""
    per = num_shards // num_devices
    return {MASK: np.asarray(mask, bool), INDEX: np.asarray(indices, np.int32),
            SHARDS: np.arange(k * per, (k + 1) * per, dtype=np.int32)}


@dataclasses.dataclass(frozen=True)
class Loader:
    """A sharded epoch iterator over an in-memory (or memory-mapped) dataset of named arrays.

    Build it with ``make_loader``. ``arrays`` is the dataset: name -> host array
    (N, ...), row i of every array being sample i ("images" and "labels" (int32)
    for ``make_loader``'s tuple form and a CIFAR-10 folder). ``len(loader)`` is
    the number of steps in every epoch, equal on every shard.
    ``loader.epoch(e)`` yields one dict per step, ``loader.batch(e, s)`` is step
    s alone (random access), ``loader.plan(e)`` is the epoch's ``Plan``.

    Logical shards: the plan has L = ``num_shards`` shards of B = ``batch_size``
    rows (``logical_shards``; L = n, the mesh's device count, unless set), and
    device k of the n reads logical shards k*L/n .. (k+1)*L/n - 1, so each device
    holds (L/n)*B rows a step (``device_rows``). A batch holds every name of
    ``arrays``, in its order, then "mask" (bool): global ``jax.Array``s in
    ``layout``, "sharded" (L*B, ...) or "pmap" (n, (L/n)*B, ...), both
    ``NamedSharding(mesh, P('data'))``, block k (rows k*(L/n)*B .. (k+1)*(L/n)*B - 1,
    or row k for "pmap") on the device at mesh position k. With P =
    ``plan.on_devices(plan(e), n)`` (device k's row: its logical shards' blocks in
    order), for every name, step s and device k:

        block k of name   = f(arrays[name][P.indices[s, k]])
        block k of "mask" = P.mask[s, k]

    so the global batch of a step (which samples, in which rows, which are masked)
    is the same for every n that divides L.

    where f is ``normalizers[name]`` when there is one (a ``Normalize``: its
    ``crop_mirror_normalize``, float32 (B, C, ch, cw) looked up in
    ``normalize_table``; a callable: what it returns) and otherwise the
    identity: the rows bit for bit as stored, dtype and shape kept. So every name follows the same plan, mask, resume and device order,
    and batches are fully determined by (seed, epoch, step): two loaders with
    the same arguments yield equal batches, whatever their placement.

    ``normalize`` is what ``make_loader`` resolved: a dict name -> Normalize or
    callable for a dict dataset; for the tuple form and a folder, what applies
    to "images" (a Normalize, a callable or None). ``normalizers`` gives either
    as one dict, name -> Normalize or callable.

    Placements (where the per-step work happens):

    * "host": the host gathers each step's rows into one buffer per name and
      moves them as stored (uint8 images: a quarter of the float32 bytes); each
      device crops, flips and looks the table up on its own block of every
      normalised name (jit + shard_map).
    * "device": shard k's samples of every name live on device k for the
      loader's life (about N/n samples per device, padded to the largest
      shard), the epoch's plan goes to the devices once per epoch, and each step
      is one dispatch that gathers and normalises on every device: no host work
      per step.
    * "host_float32": the host normalises (into float32 for a Normalize) and
      moves that; the only placement that accepts any callable in
      ``normalize``.

    The three give the same bits, in both layouts.

    Resuming, on these devices or any others (``elastic_plan``, ``LoaderState``). A
    job saves ``saved = loader.state(e, s)`` (after s steps of epoch e: a small
    plain value, ``to_json``, naming this loader's data by ``dataset``); a loader
    on any mesh or batch size, built by ``make_loader`` from the same data, seed,
    shuffle and last_batch, resumes with ``loader.epoch(e, state=saved)``, and a
    state of other data (another ``dataset``, as ``plan.dataset_digest`` tells
    them apart: another dataset of the same size, or this one changed) is refused
    naming ``dataset``. With ``st = saved.resized(L, B)``
    (this loader's shard count and batch: with the same logical shards and batch
    on any devices that divide L, the saved plan itself, no new segment) and
    ``plan, row = st.plan()``, that
    iterator yields global steps ``st.step .. st.num_steps - 1`` of the epoch,
    ``st.num_steps - st.step`` of them, where step ``st.step + r`` is
    ``Plan`` row ``row + r`` by the rule above: so the epoch's samples not yet
    delivered in a real slot before the change are delivered exactly once
    (fill; at most once with elastic_plan's stated count for drop), on every
    name, in every placement and layout, with the same bits. Its state after
    k more steps is ``loader.state(e, st.step + k, state=saved)``. ``len(loader)``
    keeps meaning a fresh epoch, and epoch e + 1 is fresh on this loader's
    shards (``loader.epoch(e + 1)``). In placement "device" a resumed segment on
    other shards first places, once, what its devices still need: on device k
    the distinct samples of its rows of ``plan.on_devices(plan, n).indices[row:]``,
    beside the resident shard.

    ``epoch(e, start_step=s)`` is steps s.. of this loader's own fresh plan over
    (L, B): it continues what another loader delivered only when that loader had
    the same logical shards L and batch_size B (and data, seed, shuffle,
    last_batch), on any devices that divide L; it knows nothing of what was
    delivered, so after any other (L, B) it repeats some samples and misses others
    without a word (8 devices stopped at step 17, resumed on 4 with start_step=17
    over 5,000 samples: 1,637 twice, 549 never). To resume, use the state
    (``epoch(e, state=saved)``), which says whose plan it was and which data.
    """
    arrays: dict[str, np.ndarray]
    mesh: Mesh
    batch_size: int
    layout: str = "sharded"
    shuffle: bool = False
    seed: int = 0
    last_batch: str = "fill"
    normalize: Normalize | Callable | dict | None = None
    prefetch: int = 2
    placement: str = "host"
    resident: dict | None = dataclasses.field(default=None, repr=False)  # placement="device"
    logical_shards: int | None = None  # None: one a device

    @property
    def images(self) -> np.ndarray:
        """``arrays["images"]`` (the tuple form's samples)."""
        return self._array("images")

    @property
    def labels(self) -> np.ndarray:
        """``arrays["labels"]`` (the tuple form's int32 labels)."""
        return self._array("labels")

    def _array(self, name: str) -> np.ndarray:
        if name not in self.arrays:
            raise AttributeError(f"Loader: this dataset has no {name!r}; its names are {list(self.arrays)}")
        return self.arrays[name]

    @property
    def normalizers(self) -> dict:
        """name -> Normalize or callable, for the names that are normalised."""
        if isinstance(self.normalize, dict):
            return {name: f for name, f in self.normalize.items() if f is not None}
        return {} if self.normalize is None else {"images": self.normalize}

    @property
    def num_samples(self) -> int:
        return len(next(iter(self.arrays.values())))

    @property
    def num_shards(self) -> int:
        """The plan's shards: ``logical_shards``, or the device count when it is None."""
        return self.logical_shards or self.mesh.devices.size

    @property
    def num_devices(self) -> int:
        return self.mesh.devices.size

    @property
    def device_rows(self) -> int:
        """Rows a device holds a step: (L/n) x batch_size."""
        return self.num_shards // self.num_devices * self.batch_size

    @functools.cached_property
    def dataset(self) -> str:
        """The identity of this loader's data, ``plan.dataset_digest(arrays)`` (every name,
        dtype, shape and byte, as stored): what every state it gives names, and what it
        checks in every state it is given. Computed the first time a state is made or
        checked (one pass over the data), then kept; ``len``, ``plan`` and the epochs
        never compute it."""
        return dataset_digest(self.arrays)

    @property
    def schedule(self) -> Schedule:
        """This loader's epochs as pure schedule (plan.Schedule): N, its shards, B, seed,
        shuffle, last_batch, and its data's identity (``dataset``, read when a state is
        made or checked)."""
        return Schedule(self.num_samples, self.num_shards, self.batch_size, self.seed, self.shuffle,
                        self.last_batch, dataset=self._dataset)

    def _dataset(self) -> str:
        return self.dataset

    def __len__(self) -> int:
        return self.schedule.steps

    def plan(self, epoch: int) -> Plan:
        return self.schedule.plan(epoch)

    def real_samples(self, epoch: int, *, state: LoaderState | None = None) -> int:
        """How many mask-True slots ``epoch`` has in the whole global batch; with a
        ``state``, how many the steps ``epoch(epoch, state=state)`` yields have."""
        return self.schedule.real_samples("Loader.real_samples", epoch, state=state)

    def state(self, epoch: int, step: int = 0, *, state: LoaderState | None = None) -> LoaderState:
        """Where this loader stands at global ``step`` of ``epoch``: the ``LoaderState``
        to save after ``step`` steps of the epoch have been delivered (its next batch
        is step ``step``), naming this loader's data (``dataset``). Without ``state``:
        of a fresh epoch, ``LoaderState.start(N, L, B, epoch=..., seed=, shuffle=,
        last_batch=, dataset=self.dataset).at_step(step)``, step in [0, len]. With the
        ``state`` the epoch was resumed from: ``state.resized(L, B).at_step(step)``,
        naming this data, step in [state.step, that state's num_steps]; so after k
        steps of ``epoch(e, start_step=s)`` it is ``state(e, s + k)``, and after k
        steps of ``epoch(e, state=saved)`` it is ``state(e, saved.step + k,
        state=saved)``. ValueError for a state of another run (another dataset
        named) or epoch (as ``epoch``) or a step outside that range."""
        return self.schedule.state("Loader.state", epoch, step, state=state)

    def _resumed(self, where: str, epoch: int, state) -> LoaderState:
        """``state`` checked against this loader's run and ``epoch``, resized to its shards."""
        return self.schedule.resumed(where, epoch, state)

    def host_rows(self, plan: Plan, step: int) -> dict[str, np.ndarray]:
        """This process's rows at ``step`` of ``plan`` (this loader's L shards): (n_local *
        (L/n)*B, ...) per name, its devices' blocks in mesh order, each name in one
        aligned buffer: as stored (placements "host" and "device", and names without a
        normaliser), or normalised for "host_float32"; then "mask"."""
        local = local_positions(self.mesh)
        plan = on_devices(plan, self.num_devices)
        idx = plan.indices[step, local]  # (n_local, (L/n)*B)
        B = self.device_rows
        norms = self.normalizers if self.placement == "host_float32" else {}
        rows = {}
        for name, source in self.arrays.items():
            norm = norms.get(name)
            if norm is None:
                rows[name] = _gather(source, idx.reshape(-1))
            elif isinstance(norm, Normalize):
                out = aligned_empty((idx.size,) + norm.output_shape(source.shape[1:]), np.float32)
                for j in range(len(local)):
                    norm(source[idx[j]], out=out[j * B:(j + 1) * B])
                rows[name] = out
            else:  # any other callable: its blocks, checked, copied into one array
                rows[name] = _called(norm, name, [source[i] for i in idx], B)
        per = self.num_shards // self.num_devices
        rows[MASK] = plan.mask[step, local].reshape(-1)
        rows[INDEX] = idx.reshape(-1).astype(np.int32)
        rows[SHARDS] = (np.asarray(local, np.int32)[:, None] * per + np.arange(per, dtype=np.int32)).reshape(-1)
        return rows

    def host_blocks(self, plan: Plan, step: int) -> dict[int, dict[str, np.ndarray]]:
        """Host-side blocks for this process's shards at ``step`` of ``plan``."""
        return split_rows(self.host_rows(plan, step), local_positions(self.mesh))

    def batch(self, epoch: int, step: int, *, state: LoaderState | None = None) -> dict[str, jax.Array]:
        """Global step ``step`` of ``epoch`` alone (random access), of a fresh epoch or,
        with ``state``, of the epoch resumed from it (``epoch``'s text): IndexError
        for a step outside [0, len) (fresh) or [state.step, num_steps) (resumed)."""
        if state is not None:
            st = self._resumed("Loader.batch", epoch, state)
            if not st.step <= step < st.num_steps:
                raise IndexError(f"step={step} is outside [{st.step}, {st.num_steps}) (the resumed "
                                 f"epoch's steps)")
            plan, row = st.plan()
            return _segment_steps(self, st, plan, row + step - st.step, row + step - st.step + 1)[0]()
        if not 0 <= step < len(self):
            raise IndexError(f"step={step} is outside [0, {len(self)})")
        if self.placement == "device":
            return _device_step(self, _device_work(self), _place_plan(self, self.plan(epoch)), step)
        return _host_step(self, _device_work(self), self.plan(epoch), step)

    def epoch(self, epoch: int, start_step: int = 0, *,
              state: LoaderState | None = None) -> Iterator[dict[str, jax.Array]]:
        """With ``state`` (a saved ``LoaderState`` of this run: the same data, seed,
        shuffle and last_batch, any devices and batch size), the rest of the epoch it
        was taken in, from its step (the class docstring's "Resuming"), and
        ``start_step`` must stay 0 (the state says where to start: pass
        ``state.at_step(s)`` for a later step of the saved shards). Without it, steps
        ``start_step .. len-1`` of this loader's own fresh plan of ``epoch``: the steps
        another loader would have delivered there only if it had the same logical
        shards and batch_size (the class docstring's last paragraph); after any other,
        resume from its state. Host placements
        prepare steps ``prefetch`` ahead on a background thread, started at the
        first ``next()``: a worker error is raised here in the caller, and an
        iterator left unfinished (``close()``, ``break``, garbage collection, or the
        interpreter's exit, before modules are torn down) stops and joins the thread,
        printing nothing. "device" needs no thread: each step is one asynchronous
        dispatch.

        Raises IndexError for a start_step outside [0, len]; ValueError for a
        state that is not a LoaderState, of another run (num_samples, dataset, seed,
        shuffle, last_batch: named) or another epoch, or a start_step with a state."""
        if state is not None:
            st = self._resumed("Loader.epoch", epoch, state)
            if start_step != 0:
                raise ValueError(f"Loader.epoch: start_step={start_step!r} with a state; the state "
                                 f"says where the epoch resumes (step {state.step})")
            plan, row = st.plan()
            makers = _segment_steps(self, st, plan, row, len(plan.indices))
            if self.placement == "device":
                return (make() for make in makers)
            return _prefetched(lambda make: make(), makers, self.prefetch)
        if not 0 <= start_step <= len(self):
            # range(-1, len) would yield the last step and then the whole epoch.
            raise IndexError(f"start_step={start_step} is outside [0, {len(self)}]")
        plan = self.plan(epoch)
        steps = range(start_step, len(self))
        work = _device_work(self)  # resolved once an epoch, not every step
        if self.placement == "device":
            placed = _place_plan(self, plan)
            return (_device_step(self, work, placed, s) for s in steps)
        return _prefetched(functools.partial(_host_step, self, work, plan), steps, self.prefetch)


# --------------------------------------------------------------------------
# The placements: what each step does on the host and on the devices
# --------------------------------------------------------------------------


def _segment_steps(loader: Loader, st: LoaderState, plan: Plan, first: int, stop: int) -> list[Callable]:
    """One function per row ``first .. stop-1`` of a resumed state's last segment
    plan, each making that step's batch. On this loader's own fresh plan (the
    only segment is (0, n, B)) every placement runs as for ``epoch(e, s)``;
    after a change, "device" places what rows ``first..`` need first."""
    work = _device_work(loader)
    rows = range(first, stop)
    if loader.placement != "device":
        return [functools.partial(_host_step, loader, work, plan, r) for r in rows]
    if not rows:
        return []
    if len(st.segments) == 1:  # segment 0 is epoch_plan: the resident shards hold it
        placed, resident = _place_plan(loader, plan), loader.resident
    else:
        placed, resident = _place_segment(loader, plan, first)
        rows = range(0, stop - first)
    return [functools.partial(_device_step, loader, work, placed, r, resident) for r in rows]


def _device_work(loader: Loader):
    """What the devices do each step. "device": (the jitted step, the tables by
    name); "host": [(name, the jitted normaliser, its table)] for each name with
    a Normalize; "host_float32": nothing."""
    if loader.placement == "host_float32":
        return ()
    norms = {name: f for name, f in loader.normalizers.items() if isinstance(f, Normalize)}
    windows = tuple((name, tuple(int(v) for v in f.window(loader.arrays[name].shape[2:])), f.mirror)
                    for name, f in norms.items())
    tables = {name: _replicated_table(table_key(f.mean, f.std, f.arithmetic, "Loader"), loader.mesh)
              for name, f in norms.items()}
    if loader.placement == "device":
        return _device_step_fn(loader.mesh, loader.layout, tuple(loader.arrays), windows), tables
    return [(name, _normalize_fn(loader.mesh, window, mirror), tables[name])
            for name, window, mirror in windows]


def _host_step(loader: Loader, work, plan: Plan, step: int) -> dict[str, jax.Array]:
    batch = global_batch_from_rows(loader.host_rows(plan, step), loader.mesh, loader.layout)
    for name, fn, table in work:  # placement "host": normalise on the devices
        batch[name] = fn(batch[name], table)
    return batch


def _place_plan(loader: Loader, plan: Plan) -> dict[str, jax.Array]:
    """The epoch's plan on the devices: per device (1, steps, (L/n)*B) local indices and
    mask. Device k's logical shards together are shard k of n (plan.on_devices), the
    samples it holds resident."""
    n = loader.num_devices
    plan = on_devices(plan, n)
    starts = np.array([shard_bounds(loader.num_samples, k, n)[0] for k in range(n)])
    local = (plan.indices - starts[None, :, None]).astype(np.int32).swapaxes(0, 1)
    mask = plan.mask.swapaxes(0, 1)
    return {"indices": _by_position(local, loader.mesh), "mask": _by_position(mask, loader.mesh),
            **_placed_fields(loader, plan.indices)}


def _placed_fields(loader: Loader, indices: np.ndarray) -> dict:
    """The placed plan's sample indices (n, steps, rows) and logical shards (n, L/n)."""
    n, per = loader.num_devices, loader.num_shards // loader.num_devices
    shards = np.arange(n * per, dtype=np.int32).reshape(n, per)
    return {INDEX: _by_position(indices.astype(np.int32).swapaxes(0, 1), loader.mesh),
            SHARDS: _by_position(shards, loader.mesh)}


def _place_segment(loader: Loader, plan: Plan, row: int) -> tuple[dict, dict]:
    """(placed plan, resident samples) for rows ``row..`` of a resumed segment:
    device k holds the distinct samples of ``plan.indices[row:, k]``, ascending,
    zero-padded to the largest count, and the placed indices are positions in
    them (searchsorted); row 0 of the placed plan is ``plan`` row ``row`` (device k's
    rows: plan.on_devices)."""
    n = loader.num_devices
    plan = on_devices(plan, n)
    rest, mask = plan.indices[row:], plan.mask[row:]
    needed = [np.unique(rest[:, k]) for k in range(n)]
    size = max(len(u) for u in needed)
    local = np.stack([np.searchsorted(needed[k], rest[:, k]) for k in range(n)]).astype(np.int32)
    sharding = NamedSharding(loader.mesh, P(DATA_AXIS))

    def rows(source: np.ndarray):
        def block(index):
            k = index[0].start // size if index[0].start is not None else 0
            out = np.zeros((size,) + source.shape[1:], source.dtype)
            out[:len(needed[k])] = source[needed[k]]
            return out
        return jax.make_array_from_callback((n * size,) + source.shape[1:], sharding, block)

    placed = {"indices": _by_position(local, loader.mesh),
              "mask": _by_position(mask.swapaxes(0, 1), loader.mesh), **_placed_fields(loader, rest)}
    return placed, {name: rows(source) for name, source in loader.arrays.items()}


def _device_step(loader: Loader, work, placed: dict, step: int, resident: dict | None = None) -> dict[str, jax.Array]:
    fn, tables = work
    out = fn(loader.resident if resident is None else resident, placed, np.int32(step), tables)
    return {name: out[name] for name in (*loader.arrays, *ADDED)}  # jit returns a dict's keys sorted


def make_loader(data, devices: Sequence[jax.Device] | Mesh, batch_size: int, *,
                layout: str = "sharded", filename_prefix: str = TRAIN_PREFIX,
                shuffle: bool = False, seed: int = 0, last_batch: str = "fill",
                normalize: Normalize | Callable | dict | str | None = "default", prefetch: int = 2,
                placement: str = "host", device_budget: int | None = None,
                logical_shards: int | None = None) -> Loader:
    """A ``Loader`` over ``data``, in one of three forms:

    * a dict of named arrays ``{name: array}``: any string names but "mask",
      any shapes and dtypes JAX holds as they are, every array N first (row i
      is sample i): token ids int32 (N, 48) with per-token targets int32 (N,
      48), float features (N, 40) with float targets (N,), uint8 images (N, C,
      H, W) with labels of any shape. Batches hold every name, delivered bit for
      bit as stored unless ``normalize`` names it, plus "mask";
    * a tuple ``(samples, labels_N)`` (or a two-item list), the notebooks' form: ``samples`` any array
      (N, ...) whose dtype JAX holds as it is, ``labels_N`` integers (N,) within
      int32, delivered as int32; batches are {"images": the samples (normalised
      by default), "labels", "mask"};
    * a CIFAR-10 folder, read with ``filename_prefix`` (``read_cifar10``): the
      tuple form over its images and labels.

    ``batch_size`` is per device; shard k goes to ``devices[k]`` (or mesh
    position k). The partition, the plan, the mask, resuming at a step and the
    device order are the same for every name and whatever the arrays are: they
    depend on (N, n, B, seed, epoch, shuffle, last_batch) only (``Loader``
    states what each block holds).

    ``logical_shards``: L, the plan's shards, when they are not the devices: the
    plan is then over L logical shards of ``batch_size`` rows each, and device k of
    the n reads logical shards k*L/n .. (k+1)*L/n - 1 ((L/n)*B rows a step), so the
    global batch of a step is the same L*B rows for every n that divides L: the
    same steps on 8 devices, on 2, or on 1 (``plan.on_devices``). None (the
    default) is L = n: one logical shard a device, batch_size per device.

    ``normalize``: for a dict dataset, None or a dict ``{name: Normalize or
    callable}`` naming the arrays to normalise (the others are delivered as
    stored; the default, "default", normalises nothing). For the tuple form and a
    folder, what applies to "images": a ``Normalize``, any callable, None, or
    ``{"images": ...}``; the default, "default", is ``Normalize()``, the rocAL
    notebook's. A ``Normalize`` needs uint8 images (N, C, H, W), channels first,
    C = len(mean), and works in every placement; any other callable (it gets a
    block of B samples and must return B rows of a dtype JAX holds as it is)
    needs placement "host_float32".

    ``placement`` is "host", "device" or "host_float32" (see ``Loader``).
    "device" keeps about N/n samples of every array on every device and refuses
    a dataset whose shard does not fit ``device_budget`` bytes per device
    (default: half of what the device reports free; for CPU devices, half of the
    host's available memory shared among this process's devices).

    Raises ValueError, naming the parameter, the value and the fix, for:
    batch_size not an int >= 1, logical_shards not an int that the device count
    divides, a batch larger than the smallest shard (every
    step of a fresh epoch would be mostly padding, or with drop there would be
    no step; an epoch resumed from a state may leave runs smaller than the
    batch, which elastic_plan allows: fill pads, drop gives 0 steps), more
    devices than samples, a repeated device, a mesh without a 'data' axis
    spanning its devices, an unknown layout, last_batch policy or placement, a
    seed outside [0, 2**32), shuffle not a bool, prefetch not an int >= 0; data
    in none of the three forms (an array is not a tuple, even a (2, N) one), an
    empty dict, a name that is not a string or is
    "mask", arrays without a leading N axis or of different N; an array of a
    dtype JAX would convert (int64, uint64, float64, complex128 without
    ``jax_enable_x64``: the message says which dtype keeps its kind, e.g.
    int32 for int64 token ids; or not numbers at all); tuple-form labels that
    are not (N,) integers within int32; a Normalize on an array that is not
    uint8 (N, C, H, W) (for channels-last images it says "NCHW expected" and how
    to transpose), or whose mean/std or crop do not fit the images; a bare
    Normalize or callable for a dict dataset, or a name in ``normalize`` that
    the data lacks; a callable with a placement other than "host_float32"; a
    ``filename_prefix`` other than the default with arrays (it picks a folder's
    files); or a dataset over the device budget. A callable that returns blocks of another
    length or a dtype JAX would convert is refused when its batch is made. A
    folder that cannot be read raises what ``read_cifar10`` raises.
    """
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
    if shuffle not in (True, False):
        raise ValueError(f"make_loader: shuffle must be a bool, got {shuffle!r}")
    if device_budget is not None and not _is_int(device_budget):
        raise ValueError(f"make_loader: device_budget must be None or an int (bytes), got {device_budget!r}")
    n = mesh.devices.size
    if logical_shards is not None:
        if not _is_int(logical_shards):
            raise ValueError(f"make_loader: logical_shards={logical_shards!r} must be an int")
        if logical_shards < 1:
            raise ValueError(f"make_loader: logical_shards={logical_shards!r} must be at least 1")
        if logical_shards % n:
            raise ValueError(f"make_loader: logical_shards={logical_shards!r} must be a multiple of the {n} "
                             f"device(s) (each device reads L/n whole logical shards)")
    loader = Loader(arrays, mesh, int(batch_size), layout, bool(shuffle), seed, last_batch, normalize,
                    int(prefetch), placement,
                    logical_shards=None if logical_shards is None else int(logical_shards))
    for name, f in loader.normalizers.items():
        if not isinstance(f, Normalize) and placement != "host_float32":
            raise ValueError(f"make_loader: placement={placement!r} needs a Normalize for {name!r} (its "
                             f"table runs on the devices); the callable {f!r} needs placement='host_float32'")
    L, N = loader.num_shards, loader.num_samples
    shards = f"{L} logical shards" if logical_shards is not None else f"{L} devices"
    if L > N:
        raise ValueError(f"make_loader: {shards} but only {N} samples: some shard would be empty")
    if batch_size > N // L:
        per = "per logical shard" if logical_shards is not None else "per device"
        raise ValueError(
            f"make_loader: batch_size={batch_size} {per} is larger than the smallest shard "
            f"({N // L} samples = {N} samples / {shards})"
        )
    if placement == "device":
        loader = dataclasses.replace(loader, resident=_place_dataset(arrays, mesh, device_budget))
    return loader


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _dataset(data, filename_prefix: str, normalize):
    """make_loader's checks of the data and of ``normalize``; returns (arrays by
    name, normalize resolved: a dict for a dict dataset, else what applies to "images")."""
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
        raise ValueError(f"make_loader: data must be a CIFAR-10 folder, a tuple (samples, labels) or a "
                         f"dict of named arrays, got {type(data).__name__}"
                         f"{f' {data.shape}' if hasattr(data, 'shape') else ''}")
    samples, labels = data
    if isinstance(normalize, str) and normalize == "default":
        normalize = Normalize()
    elif isinstance(normalize, Mapping):
        if set(normalize) - {"images"}:
            raise ValueError(f"make_loader: normalize={dict(normalize)!r} names "
                             f"{sorted(set(normalize) - {'images'})}, but the tuple form (samples, labels) "
                             f"normalises only 'images'; pass a dict dataset to normalise other names")
        normalize = normalize.get("images")
    if normalize is not None and not callable(normalize):
        raise ValueError(f"make_loader: normalize={normalize!r} is not a Normalize, a callable, a dict "
                         f"or None")
    samples, labels = np.asarray(samples), np.asarray(labels)
    if samples.ndim < 1 or labels.shape != samples.shape[:1]:
        raise ValueError(f"make_loader: data must be samples (N, ...) and labels (N,), got samples "
                         f"{samples.dtype} {samples.shape}, labels {labels.shape}")
    _check_dtype("samples", samples)
    if labels.dtype.kind not in "biu":
        raise ValueError(f"make_loader: labels must be integers (N,), got dtype {labels.dtype} "
                         f"(for float or other targets, pass a dict dataset: {{'images': samples, "
                         f"'targets': targets}})")
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
            raise ValueError(f"make_loader: data's names must be strings (they name the batch's arrays), "
                             f"got {name!r}")
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
        raise ValueError(f"make_loader: every array of data must hold the same N samples (axis 0), got "
                         f"{sizes}")
    if normalize is None or (isinstance(normalize, str) and normalize == "default"):
        return arrays, {}
    if not isinstance(normalize, Mapping):
        raise ValueError(f"make_loader: normalize={normalize!r} for a dict dataset: name the arrays to "
                         f"normalise, e.g. normalize={{{next(iter(arrays))!r}: Normalize(...)}} "
                         f"(the data's names: {list(arrays)})")
    unknown = [name for name in normalize if name not in arrays]
    if unknown:
        raise ValueError(f"make_loader: normalize names {unknown}, which the data lacks (its names: "
                         f"{list(arrays)})")
    norms = {name: f for name, f in normalize.items() if f is not None}
    for name, f in norms.items():
        if not callable(f):
            raise ValueError(f"make_loader: normalize[{name!r}]={f!r} is not a Normalize or a callable")
        _check_normalizer(f"data[{name!r}]", arrays[name], f,
                          f"leave {name!r} out of normalize to deliver it as it is")
    return arrays, norms


def _check_dtype(what: str, array: np.ndarray) -> None:
    """Refuses a dtype JAX would not hold as it is, advising the dtype that keeps its kind."""
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
    """A Normalize's images: uint8 (N, C, H, W) that its mean/std and crop fit."""
    if not isinstance(normalize, Normalize):
        return
    if array.dtype != np.uint8 or array.ndim != 4:
        hint = ""
        if array.dtype == np.uint8 and array.ndim == 3:
            hint = " (one-channel (N, H, W) images: pass images[:, None], (N, 1, H, W))"
        elif array.dtype == np.uint8 and array.ndim == 2:
            hint = " (flat rows: reshape them to (N, C, H, W))"
        raise ValueError(f"make_loader: normalize={normalize} needs uint8 images (N, C, H, W), got "
                         f"{what} {array.dtype} {array.shape}{hint}; {fix}")
    try:
        normalize.output_shape(array.shape[1:])
    except ValueError as error:
        raise ValueError(f"make_loader: {what} {array.shape}: {error}") from None


def _gather(source: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """``source[indices]`` into one 64-byte-aligned buffer."""
    out = aligned_empty((len(indices),) + source.shape[1:], source.dtype)
    if source.flags.c_contiguous:
        # mode="clip" (the plan's indices are in range): with the default "raise"
        # NumPy buffers the whole gather when out is a view, 30x slower here.
        np.take(source, indices, axis=0, out=out, mode="clip")
    else:
        # read_cifar10's images are a strided view (3073-byte records): np.take
        # would first copy the WHOLE dataset to make it contiguous, every step.
        np.copyto(out, source[indices])
    return out


def _called(f: Callable, name: str, blocks: list[np.ndarray], B: int) -> np.ndarray:
    """A callable normaliser's output for each block, checked and concatenated."""
    outs = [np.asarray(f(block)) for block in blocks]
    for out in outs:
        held = ((jnp.issubdtype(out.dtype, jnp.number) or out.dtype == np.bool_)
                and jax.dtypes.canonicalize_dtype(out.dtype) == out.dtype)
        if out.ndim < 1 or len(out) != B or not held or out.shape != outs[0].shape:
            raise ValueError(f"Loader: normalize for {name!r} ({f!r}) returned {out.dtype} {out.shape} for "
                             f"a block of B={B} samples; it must return B rows, every block alike, of a "
                             f"dtype JAX holds as it is (e.g. float32, not float64)")
    return np.concatenate(outs)


# --------------------------------------------------------------------------
# Device-side work (placements "host" and "device")
# --------------------------------------------------------------------------
#
# Caches: each is keyed by everything that determines its result, exactly.
# keyed_table and _replicated_table by table_key (mean's and std's float32 bit
# patterns: -0.0 is not 0.0) and the mesh; the jitted functions by the mesh, the
# layout, the names and each normalised name's crop window (ints) and mirror (a
# bool), while jit's own cache adds the arguments' shapes and dtypes. A table is
# an argument of the jitted functions, never a constant inside them.


def _by_position(per_shard: np.ndarray, mesh: Mesh) -> jax.Array:
    """(n, ...) host array -> global array sharded on axis 0: row k on mesh position k.
    Each process fills only its own devices' rows."""
    sharding = NamedSharding(mesh, P(DATA_AXIS))
    return jax.make_array_from_callback(per_shard.shape, sharding, lambda index: per_shard[index])


def device_fit(num_samples: int, sample_shape: tuple[int, ...], mesh: Mesh,
               device_budget: int | None = None, itemsize: int = 1) -> str | None:
    """Why a dataset would not fit placement "device" on ``mesh``, or None if it fits.

    Each device holds the largest shard, ceil(N/n) samples of ``sample_shape``
    with ``itemsize`` bytes an element (1: uint8 images) plus their int32
    labels; the budget is ``device_budget`` bytes per device, by default half of
    what the device reports free (for CPU devices, which report nothing, half the
    host's available memory shared among this process's devices)."""
    return _fits(num_samples, int(np.prod(sample_shape)) * itemsize + 4, mesh, device_budget)


def _fits(num_samples: int, sample_bytes: int, mesh: Mesh, device_budget: int | None) -> str | None:
    """device_fit for samples of ``sample_bytes`` bytes each (every array's row together)."""
    n = mesh.devices.size
    size = -(-num_samples // n)
    per_device = size * sample_bytes
    local = [mesh.devices.flat[k] for k in local_positions(mesh)]
    limit, where = (device_budget, "device_budget") if device_budget is not None else _default_budget(local)
    if per_device <= limit:
        return None
    return (f"placement='device': each device would hold {size} samples = {per_device / 2**20:.1f} MiB "
            f"({num_samples} samples / {n} devices), over the budget of {limit / 2**20:.1f} MiB per "
            f"device ({where}); use placement='host' or more devices")


def _place_dataset(arrays: dict[str, np.ndarray], mesh: Mesh, budget: int | None) -> dict:
    """Shard k's samples of every array on mesh position k, padded to the largest
    shard: (n * S, ...) in their dtype, sharded on 'data'."""
    N = len(next(iter(arrays.values())))
    sample_bytes = sum(int(np.prod(a.shape[1:])) * a.dtype.itemsize for a in arrays.values())
    too_big = _fits(N, sample_bytes, mesh, budget)
    if too_big:
        raise ValueError(too_big)
    n = mesh.devices.size
    size = -(-N // n)  # the largest shard
    sharding = NamedSharding(mesh, P(DATA_AXIS))

    def rows(source: np.ndarray):
        def block(index):
            k = index[0].start // size if index[0].start is not None else 0
            start, stop = shard_bounds(N, k, n)
            out = np.zeros((size,) + source.shape[1:], source.dtype)
            out[:stop - start] = source[start:stop]
            return out
        return jax.make_array_from_callback((n * size,) + source.shape[1:], sharding, block)

    return {name: rows(source) for name, source in arrays.items()}


def _default_budget(devices: list) -> tuple[int, str]:
    stats = devices[0].memory_stats() if devices else None
    if stats and "bytes_limit" in stats:
        free = min(d.memory_stats()["bytes_limit"] - d.memory_stats().get("bytes_in_use", 0)
                   for d in devices)
        return free // 2, f"half the free memory of {devices[0].platform} devices"
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available // 2 // max(len(devices), 1), \
        f"half the host's available memory over {len(devices)} {devices[0].platform} devices"


@functools.lru_cache(maxsize=None)
def _normalize_fn(mesh: Mesh, window: tuple[int, int, int, int], mirror: bool):
    """jit(shard_map) of device_normalize: each device normalises its own rows (no
    collective), output sharded like the input."""
    fn = functools.partial(device_normalize, window=window, mirror=mirror)
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(DATA_AXIS), P()), out_specs=P(DATA_AXIS)))


@functools.lru_cache(maxsize=None)
def _device_step_fn(mesh: Mesh, layout: str, names: tuple[str, ...], windows: tuple):
    """One step of placement "device": every device gathers its batch of every name
    from its own resident shard by the plan's local indices, then normalises each
    name of ``windows`` ((name, window, mirror), ...) with its table, from the
    ``tables`` argument (name -> table)."""
    how = {name: (window, mirror) for name, window, mirror in windows}

    def step(resident, placed, s, tables):
        idx = placed["indices"][0, s]  # (B,), into this device's shard
        out = {}
        for name in names:
            rows = resident[name][idx]
            if name in how:
                rows = device_normalize(rows, tables[name], *how[name])
            out[name] = rows
        out[MASK] = placed["mask"][0, s]
        out[INDEX] = placed[INDEX][0, s]
        out[SHARDS] = placed[SHARDS][0]
        return out if layout == "sharded" else jax.tree.map(lambda x: x[None], out)

    specs = (P(DATA_AXIS), P(DATA_AXIS), P(), P())  # each a prefix of its argument's pytree
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=P(DATA_AXIS)))


@functools.lru_cache(maxsize=64)
def _replicated_table(key: tuple[bytes, bytes, str], mesh: Mesh) -> jax.Array:
    """The table of ``key`` (``table_key``) on every device of ``mesh``, placed once
    per (key, mesh); one row when every channel's row is the same bits."""
    table = keyed_table(key)
    if one_row(table):
        table = table[:1]  # one row serves every channel (device_normalize)
    return jax.make_array_from_callback(table.shape, NamedSharding(mesh, P()), lambda index: table[index])


# --------------------------------------------------------------------------
# Prefetching, and an epoch's end however it comes
# --------------------------------------------------------------------------


def _prefetched(make, steps, depth: int):
    if depth == 0:
        return (make(s) for s in steps)
    return _Prefetched(make, steps, depth)


class EpochIterator:
    """An epoch's batches, from a generator that holds something to release (a vendor's
    pipelines, an epoch's files). An iterator (``next``, ``iter``) with ``close()``; the
    generator is closed, so its ``finally`` releases what it holds, exactly once and at
    the first of: the epoch's end, ``close()``, this object's garbage collection, or the
    interpreter's exit with the epoch unfinished. That last one runs as a
    ``weakref.finalize`` at exit, before modules are torn down, so nothing is printed
    and nothing is left running (a generator left to the interpreter's teardown is
    closed after its modules are gone, and its ``finally`` fails there: "Exception
    ignored in: <generator ...>"). The generator never references this object."""

    def __init__(self, generator: Iterator):
        self._generator = generator
        self._end = weakref.finalize(self, generator.close)

    def __iter__(self) -> "EpochIterator":
        return self

    def __next__(self):
        if not self._end.alive:
            raise StopIteration
        try:
            return next(self._generator)
        except BaseException:  # the end (StopIteration) or an error: release now
            self._end()
            raise

    def close(self) -> None:
        self._end()


class _Prefetched:
    """``make(s)`` for each s of ``steps``, made ``depth`` ahead by a worker thread started
    at the first ``next()``; a worker error is raised in the consumer. The worker is
    stopped and joined, exactly once, at the first of: the epoch's end, an error,
    ``close()``, garbage collection, or the interpreter's exit (``weakref.finalize``,
    before modules are torn down: a daemon thread still inside JAX at teardown aborts the
    process). The worker references the queue, the stop event, ``make`` and ``steps``,
    never this object, so an iterator that is dropped is collected at once."""

    def __init__(self, make: Callable, steps, depth: int):
        self._out: queue.Queue = queue.Queue(maxsize=depth)
        stop = threading.Event()
        self._worker = threading.Thread(target=_prefetch_work, args=(make, steps, self._out, stop),
                                        name="loader-prefetch", daemon=True)
        self._end = weakref.finalize(self, _stop_worker, stop, self._worker)

    def __iter__(self) -> "_Prefetched":
        return self

    def __next__(self):
        if not self._end.alive:
            raise StopIteration
        if self._worker.ident is None:
            self._worker.start()
        kind, value = self._out.get()
        if kind == "batch":
            return value
        self._end()
        if kind == "error":
            raise value
        raise StopIteration

    def close(self) -> None:
        self._end()


def _prefetch_work(make: Callable, steps, out: queue.Queue, stop: threading.Event) -> None:
    def put(item) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    try:
        for s in steps:
            if not put(("batch", make(s))):
                return
        put(("end", None))
    except BaseException as error:  # handed to the consumer, raised there
        put(("error", error))


def _stop_worker(stop: threading.Event, worker: threading.Thread) -> None:
    stop.set()
    # Not when the worker collects its own iterator (a cycle the collector breaks there).
    if worker.ident is not None and worker is not threading.current_thread():
        worker.join()
