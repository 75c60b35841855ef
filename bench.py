"""Speed and memory of the loaders and the training steps, as ratios measured side by side.

    python bench.py [--quick | --smoke] [--sections loader,...] [--num-train N] [--json FILE]

Compared cases run in interleaved rounds (a, b, a, b, ...) in one process, each figure a median over the rounds.
Load from other processes slows them alike: read the ratios, not the absolute times. The devices are the default
backend's (8 virtual CPU devices without an accelerator), in this one process; the data is a synthetic CIFAR-10;
float32 matmuls at precision "highest", as the suite's. Sections:

1. loader: one shuffled epoch into sharded global arrays, per loader, against a host memory copy; the
   host-to-device rate of a uint8 batch.
2. feeding: the data cost, an epoch in the loop users run (a strategy over the loader's own epoch, prefetch
   included) over the same epoch from batches already on the devices.
3. training: each strategy's step program, steps queued back to back; its compile time, by phase.
4. reduction: ``canonical_step`` against ``sharded_step`` on an MLP, a conv net and attention, at L = n, 4n and 8n:
   step time, memory, compile time.

Each case prints one line (stderr) as it finishes, and ``--json`` rewrites the figures so far after each, so a run
that is stopped keeps what it measured. No program compiles twice for the same shapes, but in the compile table of
section 4, which compiles anew on purpose; a compile time is what JAX reports spending (``Compiles``), not a
difference of two runs. The report ends with the goals and the figures no sane run gives ("implausible": the machine
was too busy to measure them).
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import inspect
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # GPU memory on demand, not 75% up front

import jax
import jax.numpy as jnp

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import dali_loader
import loaders
import model
import strategies
import summation
from arithmetic import Normalize
from cifar_mnist import read_cifar10, synthetic_cifar10
from plan import device_slots, shard_bounds

GLOBAL_BATCHES = (128, 1024)  # feeding, training and reduction; feeding also reports 8192
REFERENCE = "reference, host"  # the row the others are compared with
LEARNING_RATE = 0.01
MEAN = STD = np.float32(127.5)  # arithmetic.Normalize()'s default, written out for the peers
SMOKE_LAYERS = (3072, 32, 10)  # --smoke's MLP: the code paths, not the figures
VOCAB, SEQUENCE, WIDTH = 256, 32, 64  # the attention model's
CONV_CHANNELS, SMOKE_CHANNELS = (32, 64), (4, 8)


def rounds(cases: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each zero-argument case per round, the cases interleaved in every round."""
    times = {name: [] for name in cases}
    for _ in range(repeats):
        for name, case in cases.items():
            start = time.perf_counter()
            case()
            times[name].append(time.perf_counter() - start)
    return times


def paired(times: dict, a, b, f) -> float:
    """Median over rounds of f(a's time, b's time): neighbours in a round share the load."""
    return statistics.median(f(x, y) for x, y in zip(times[a], times[b]))


def drain(batches) -> tuple[int, int]:
    """Consumes batch dicts until the last is ready; returns (samples, bytes) delivered."""
    last, samples, nbytes = None, 0, 0
    for last in batches:
        samples += last["images"].shape[0]
        nbytes += sum(leaf.nbytes for leaf in jax.tree.leaves(last))
    jax.block_until_ready(last)
    return samples, nbytes


class Compiles:
    """What JAX compiles in this process, heard as it happens (``jax.monitoring``): per program, seconds in each
    phase: "trace" (Python to a jaxpr), "lower" (to StableHLO) and "xla" (XLA's compile, or a read of JAX's
    persistent cache where one is set)."""
    PHASES = {"jaxpr_trace_duration": "trace", "jaxpr_to_mlir_module_duration": "lower",
              "backend_compile_duration": "xla"}

    def __init__(self):
        self.heard = []
        jax.monitoring.register_event_duration_secs_listener(self._duration)

    def _duration(self, event, seconds, **kwargs):
        phase = self.PHASES.get(event.rsplit("/", 1)[-1])
        if phase:
            self.heard.append((phase, kwargs.get("fun_name", "?"), seconds, threading.get_ident()))

    def since(self, mark: int) -> dict:
        """{phase: seconds} of what this thread compiled after ``mark`` (``len(self.heard)`` then), and "s", their
        sum."""
        mine = [(p, t) for p, _, t, thread in self.heard[mark:] if thread == threading.get_ident()]
        phases = {p: sum(t for q, t in mine if q == p) for p in self.PHASES.values()}
        return dict(phases, s=sum(phases.values()))


def loader_section(images, labels, mesh, args, out: dict) -> None:
    """Per per-device batch: the host copy limit and the host-to-device rate (GB/s), and per loader one epoch
    drained: images/s, GB/s, share of the copy limit, and "reference, host"'s speed over it. Medians of rounds."""
    sharding = NamedSharding(mesh, P(loaders.DATA_AXIS))
    try:  # DALI's CPU pipelines (own arithmetic) over the same records, unless no DALI, --no-dali or accelerators
        dali = not args.no_dali and mesh.devices.flat[0].platform == "cpu" and dali_loader.import_dali()
    except ImportError:
        dali = False
    for batch_size in (16, 128):
        by_placement = {p: loaders.make_loader((images, labels), mesh, batch_size, shuffle=True,
                                               placement=p) for p in loaders.PLACEMENTS}
        cases = {f"reference, {p}": lambda l=l: l.epoch(0) for p, l in by_placement.items()}
        if dali:
            loader = dali_loader.make_dali_loader((images, labels), mesh, batch_size, shuffle=True, num_threads=1,
                                                  normalize=Normalize(arithmetic="dali_cpu"), cache_dir=args.cache_dir)
            cases["dali (CPU pipelines)"] = lambda: loader.epoch(0)
        cases["naive loop"] = lambda b=batch_size: naive_batches(images, labels, mesh, b)
        if installed("grain") and not args.no_grain:
            cases.update(grain_cases(images, labels, mesh, batch_size))
        # warm-up (compilation, first-call costs of device_put), which also counts an epoch's bytes
        warm = {name: drain(make()) for name, make in cases.items() if name.startswith(("reference", "dali"))}
        epoch_bytes = warm[REFERENCE][1]
        sizes = {}
        timed = {name: (lambda n=name, make=make: sizes.__setitem__(n, drain(make()))) for name, make in cases.items()}
        src = np.ones(epoch_bytes // 4, np.float32)  # both buffers touched: no page faults timed
        dst = np.zeros_like(src)
        timed["copy"] = lambda: np.copyto(dst, src)
        batch = images[:mesh.devices.size * batch_size]
        timed["to devices"] = lambda: jax.device_put(batch, sharding).block_until_ready()
        seconds = {name: statistics.median(t) for name, t in rounds(timed, args.repeats).items()}
        limit = epoch_bytes / seconds["copy"] / 1e9
        results = {name: {"seconds": seconds[name], "images": samples, "images_per_s": samples / seconds[name],
                          "gb_per_s": nbytes / seconds[name] / 1e9,
                          "fraction_of_copy": nbytes / seconds[name] / 1e9 / limit}
                   for name, (samples, nbytes) in sizes.items()}
        for r in results.values():
            r["reference_speedup"] = results[REFERENCE]["images_per_s"] / r["images_per_s"]
        out[f"per_device_{batch_size}"] = {"copy_limit_gb_per_s": limit, "loaders": results,
                                           "to_devices_gb_per_s": batch.nbytes / seconds["to devices"] / 1e9}
        args.note("; ".join(f"{name} {r['images_per_s']:,.0f} images/s" for name, r in results.items()),
                  f"loader, {batch_size} per device")


def naive_batches(images, labels, mesh, batch_size: int, seed: int = 0):
    """The tutorial loop: each shard shuffled, then one Python iteration per sample."""
    sharding = NamedSharding(mesh, P(loaders.DATA_AXIS))
    n, rng = mesh.devices.size, np.random.default_rng(seed)
    orders = [rng.permutation(np.arange(*shard_bounds(len(labels), k, n))) for k in range(n)]
    for step in range(min(map(len, orders)) // batch_size):
        xs, ys = [], []
        for order in orders:
            for i in order[step * batch_size:(step + 1) * batch_size]:
                xs.append((images[i].astype(np.float32) - MEAN) / STD)
                ys.append(labels[i])
        yield {"images": jax.device_put(np.stack(xs), sharding), "labels": jax.device_put(np.asarray(ys), sharding)}


def grain_cases(images, labels, mesh, batch_size: int) -> dict:
    """Grain on the same records, global batch n*B sharded on 'data', the process's shard by ShardByJaxProcess:
    "grain docs", Grain's JAX recipe; "grain batch-first", batch before map (one NumPy call per batch), 2 readers."""
    import grain

    class Records(grain.sources.RandomAccessDataSource):
        def __len__(self):
            return len(labels)

        def __getitem__(self, i):
            return {"images": images[i], "labels": labels[i]}

    class Normalise(grain.transforms.Map):
        def map(self, record):  # a record or a batch of them
            return {"images": (record["images"] - MEAN) / STD, "labels": record["labels"]}

    sharding = NamedSharding(mesh, P(loaders.DATA_AXIS))
    shard = grain.sharding.ShardByJaxProcess(drop_remainder=True)
    per_process = mesh.devices.size * batch_size

    def dataset(batch_first: bool, read_options=None):
        ds = grain.MapDataset.source(Records())[shard.shard_index::shard.shard_count].seed(0).shuffle()
        ds = (ds.batch(per_process, drop_remainder=True).map(Normalise()) if batch_first
              else ds.map(Normalise()).batch(per_process, drop_remainder=True))
        return grain.experimental.device_put(ds.to_iter_dataset(read_options), sharding,
                                             cpu_buffer_size=4, device_buffer_size=2)

    return {"grain docs": lambda: dataset(False),
            "grain batch-first": lambda: dataset(True, grain.ReadOptions(num_threads=2, prefetch_buffer_size=4))}


def installed(package: str) -> str | None:
    """The installed version of ``package``, or None."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def feeding_section(images, labels, mesh, args, out: dict) -> None:
    """Per global batch, placement and strategy: the data cost, the median over rounds of the fed epoch's time
    (``strategy(params, loader.epoch(0), ...)``, the loader's own prefetch) over the prebuilt one's (the same strategy
    over ``list(loader.epoch(0))``, made before). Epochs of ``args.fed_steps`` steps (32; fewer where the data runs
    out); 8192, sharded only. The limit of placement "host", over the prebuilt epoch: max(step, transfer) a step plus
    the first transfer, nothing else overlapped. Timed in the same rounds: the first transfer, a step's images and
    labels put on the devices and waited for; a step's transfer, the same put 8 times back to back, over 8 (a chip
    moves several in flight faster than one: a TPU v5e 3.1 MB in 0.26 ms each, one alone in 1.8 ms). Params and
    optimizer state start on the devices, as in a chain of epochs (a strategy hands them back where they went in)."""
    n, sharding = mesh.devices.size, NamedSharding(mesh, P(loaders.DATA_AXIS))
    params = strategies.replicate(model.init_model(args.layers), mesh)
    state = strategies.replicate(strategies.sgd(LEARNING_RATE).init(params), mesh)
    for global_batch in args.fed_batches:
        count = min(len(labels), args.fed_steps * global_batch)
        row = out[f"global_{global_batch}"] = {"images": count}
        step_rows = (images[:global_batch], labels[:global_batch].astype(np.int32))
        for name in args.fed_strategies if global_batch in GLOBAL_BATCHES else ("sharded",):
            put = lambda times, r=step_rows: jax.block_until_ready([jax.device_put(r, sharding) for _ in range(times)])
            cases = {"first": functools.partial(put, 1), "transfer": functools.partial(put, 8)}
            for p in loaders.PLACEMENTS:
                loader = loaders.make_loader((images[:count], labels[:count]), mesh, global_batch // n, shuffle=True,
                                             placement=p, layout=strategies.LAYOUT[name])
                prebuilt = list(loader.epoch(0))
                train(strategies.STRATEGIES[name], params, [loader.batch(0, 0)], mesh, state)  # compile: one step
                cases[f"prebuilt {p}"] = lambda b=prebuilt, s=name: train(strategies.STRATEGIES[s], params, b, mesh,
                                                                          state)
                cases[f"fed {p}"] = lambda l=loader, s=name: train(strategies.STRATEGIES[s], params, l.epoch(0), mesh,
                                                                   state)
            times = rounds(cases, args.repeats)
            row["steps"], transfer = len(prebuilt), 1e3 * statistics.median(times["transfer"]) / 8
            first = 1e3 * statistics.median(times["first"])
            row[name] = {p: {"fed_over_prebuilt": paired(times, f"fed {p}", f"prebuilt {p}", lambda a, b: a / b),
                             "prebuilt_step_ms": 1e3 * statistics.median(times[f"prebuilt {p}"]) / len(prebuilt)}
                         for p in loaders.PLACEMENTS}
            step = row[name]["host"]["prebuilt_step_ms"]
            row[name]["host"].update(transfer_ms=transfer, first_transfer_ms=first,
                                     limit=(len(prebuilt) * max(step, transfer) + first) / (len(prebuilt) * step))
            args.note("; ".join(f"{p}: fed / prebuilt {r['fed_over_prebuilt']:.2f}x, prebuilt "
                                f"{r['prebuilt_step_ms']:.2f} ms per step" for p, r in row[name].items()) +
                      f"; a step's transfer {transfer:.2f} ms, host's limit {row[name]['host']['limit']:.2f}x",
                      f"feeding, global {global_batch}, {name}")


def train(strategy, params, batches, mesh, opt_state=None):
    """``strategy`` on ``batches`` with the notebooks' MLP and SGD(LEARNING_RATE), from ``opt_state``."""
    return strategy(params, batches, mesh, loss_terms=model.loss_terms, optimizer=strategies.sgd(LEARNING_RATE),
                    opt_state=opt_state)


def training_section(images, labels, mesh, args, out: dict) -> None:
    """Per global batch and strategy, its plain step program (``strategy_step``) on the notebooks' MLP: the step time,
    ``args.train_steps`` (20; quick and smoke 3) steps queued back to back (``queued``), per step, the median over
    interleaved rounds; its ratio to single's; and what JAX spent compiling during the first step, by phase (its
    gradient program new). What a step's batch costs to move: the feeding section."""
    params = model.init_model(args.layers)
    for global_batch in args.training_batches:
        runs, row = {}, out.setdefault(f"global_{global_batch}", {})
        for name in strategies.STRATEGIES:
            loader = loaders.make_loader((images, labels), mesh, global_batch // mesh.devices.size,
                                         layout=strategies.LAYOUT[name])
            step, state, batches = strategy_step(name, params, [loader.batch(0, s) for s in range(min(4, len(loader)))],
                                                 mesh)
            mark = len(args.compiles.heard)
            runs[name] = [queued(step, state, batches, 1), step, batches]
            row[name] = {"compile": args.compiles.since(mark)}
            row[name]["compile_s"] = row[name]["compile"]["s"]

        def run(name):
            runs[name][0] = queued(runs[name][1], runs[name][0], runs[name][2], args.train_steps)
        times = rounds({name: functools.partial(run, name) for name in runs}, args.repeats)
        for name in runs:
            row[name]["step_ms"] = 1e3 * statistics.median(times[name]) / args.train_steps
        for name, r in row.items():
            r["ratio_to_single"] = r["step_ms"] / row["single"]["step_ms"]
            phases = ", ".join(f"{p} {r['compile'][p]:.2f}" for p in Compiles.PHASES.values())
            args.note(f"step {r['step_ms']:.2f} ms ({r['ratio_to_single']:.2f}x single), compile "
                      f"{r['compile_s']:.2f} s ({phases})", f"training, global {global_batch}, {name}")


def strategy_step(name: str, params, batches: list, mesh) -> tuple:
    """(step, state, batches) as strategy ``name`` runs them with the MLP and SGD(LEARNING_RATE)
    (``strategies.plain_step``): the batches where it takes them (single: on the mesh's first device). Its gradient
    program is its own (``anew``): it compiles at the first call whatever ran before (feeding's steps
    run the same programs); the update program, the same for every strategy, compiles once per process."""
    step, place = strategies.plain_step(name, anew(model.loss_terms), strategies.sgd_update, mesh)
    state, first = (params, strategies.sgd(LEARNING_RATE).init(params)), mesh.devices.flat[0]
    if name == "single":
        return step, place(state, loaders.data_mesh([first])), [jax.device_put(b, first) for b in batches]
    return step, place(state, mesh), batches


def queued(step, state, batches: list, steps: int):
    """``steps`` steps from ``state`` over ``batches`` in turn through ``strategies.train_loop`` (each step dispatched
    before the one before it is waited for: the devices never wait for Python), the last waited for; returns the last
    state. Unbounded queues deadlock XLA's CPU all-reduce (8 virtual devices, 20 steps of the MLP queued)."""
    state, values = strategies.train_loop(step, state, (batches[s % len(batches)] for s in range(steps)))
    jax.block_until_ready((state, values))
    return state


def reduction_section(args, out: dict) -> None:
    """Per case of ``args.reduction_cases`` (model, global batch, L/n) on all n devices: the median time of each step
    and of the canonical step's floor (``block_work``) over interleaved rounds (after two warm-up calls each), and each
    step's device memory (``step_memory``). On a one-device mesh (no collective whose order threads could cross) the
    warm-ups of the (model, global batch) pairs run side by side, one thread each: a chip's conv programs take XLA
    half a minute each, so one after another they would not fit in ten minutes; a pair's compile seconds are then
    its thread's, slowed by the others'. Then, for the MLP at global batch ``args.mlp_batch`` and L = 8: the compile
    time of the canonical and the plain steps on ``args.compile_devices`` devices (those there are), one after another,
    with a new loss_terms, so that its programs compile anew (what JAX spent compiling in the first call); and both
    steps' times on ``args.any_devices`` devices, which do not divide L."""
    n = args.reduction_devices
    mesh = loaders.data_mesh(jax.devices()[:n])
    rows, compiles = out.setdefault("cases", []), out.setdefault("compile_s", [])
    out["precision"] = str(jax.config.jax_default_matmul_precision)
    pairs = {}  # (model, global batch): its cases, in order; the plain step's programs compile in the first
    for name, global_batch, per_device in args.reduction_cases:
        pairs.setdefault((name, global_batch), []).append(per_device * n)

    def warm(pair):  # each case's steps and floor, called twice: what their first calls compile
        cases = []
        for shards in pairs[pair]:
            start, batch, steps = reduction_case(pair[0], pair[1], shards, mesh, args.smoke)
            states = {s: strategies.replicate(start, mesh) for s in steps}  # plain donates on accelerators

            def call(s, steps=steps, states=states, batch=batch):
                states[s], loss = steps[s](states[s], batch)
                jax.block_until_ready((states[s], loss))
            floor, compiled = block_work(pair[0], start, batch, mesh, shards), {}
            for s in [*steps, *steps]:
                mark = len(args.compiles.heard)
                call(s)
                compiled.setdefault(s, args.compiles.since(mark))
                floor()
            cases.append((shards, start, batch, states, call, floor, compiled))
        return cases
    warmed = {}
    with ThreadPoolExecutor(len(pairs) if n == 1 else 1) as threads:
        for pair, cases in zip(pairs, threads.map(warm, pairs)):  # in order, each as its thread ends
            warmed[pair] = cases
            args.note(f"{len(cases)} case(s) warmed up", f"reduction, {pair[0]}, global {pair[1]}")
    for (name, global_batch), cases in warmed.items():
        for shards, start, batch, states, call, floor, compiled in cases:
            times = rounds({**{s: functools.partial(call, s) for s in states}, "floor": floor}, args.step_rounds)
            row = {"model": name, "devices": n, "global_batch": global_batch, "logical_shards": shards,
                   "rows": int(batch["mask"].shape[0]),
                   "gradient_mb": sum(np.asarray(x).nbytes for x in jax.tree.leaves(start[0])) / 2**20}
            for s in states:
                make = lambda s=s: reduction_steps(MODELS[name][1], mesh, shards, uncached=True)[s]
                row[s] = {"step_ms": 1e3 * statistics.median(times[s]), "compile": compiled[s],
                          "memory_mb": step_memory(make, states[s], batch)}
            row["floor_ms"] = 1e3 * statistics.median(times["floor"])
            row["ratio"] = {"step_time": row["canonical"]["step_ms"] / row["plain"]["step_ms"],
                            "floor": row["floor_ms"] / row["plain"]["step_ms"],
                            "memory": row["canonical"]["memory_mb"] / row["plain"]["memory_mb"]}
            row["extra_gradients"] = (row["canonical"]["memory_mb"] - row["plain"]["memory_mb"]) / row["gradient_mb"]
            rows.append(row)
            args.note(f"plain {row['plain']['step_ms']:.2f} ms, canonical {row['canonical']['step_ms']:.2f} ms "
                      f"({row['ratio']['step_time']:.2f}x; floor {row['ratio']['floor']:.2f}x), memory "
                      f"{row['ratio']['memory']:.2f}x; compiled: plain {compiled['plain']['s']:.1f} s, canonical "
                      f"{compiled['canonical']['s']:.1f} s", f"reduction, {name}, global {global_batch}, L = {shards}")
    for devices in (d for d in args.compile_devices if d <= len(jax.devices())):
        on = loaders.data_mesh(jax.devices()[:devices])
        start, batch, steps = reduction_case("mlp", args.mlp_batch, 8, on, args.smoke, fresh=True)
        row = {"devices": devices, "global_batch": args.mlp_batch}
        for s, step in steps.items():
            mark = len(args.compiles.heard)
            jax.block_until_ready(step(strategies.replicate(start, on), batch))
            row[s] = args.compiles.since(mark)["s"]
        compiles.append(row)
        args.note(f"plain {row['plain']:.2f} s, canonical {row['canonical']:.2f} s", f"compile, {devices} devices")
    for devices in (d for d in args.any_devices if d <= len(jax.devices())):  # n that do not divide L = 8
        on = loaders.data_mesh(jax.devices()[:devices])
        start, batch, steps = reduction_case("mlp", args.mlp_batch, 8, on, args.smoke)
        states = {s: strategies.replicate(start, on) for s in steps}

        def call(s, steps=steps, states=states, batch=batch):
            states[s], loss = steps[s](states[s], batch)
            jax.block_until_ready((states[s], loss))
        for s in [*steps, *steps]:  # warm-up
            call(s)
        times = rounds({s: functools.partial(call, s) for s in steps}, args.step_rounds)
        row = {"devices": devices, "global_batch": args.mlp_batch, "rows": int(batch["mask"].shape[0]),
               **{s: 1e3 * statistics.median(times[s]) for s in steps}}
        out.setdefault("any_n", []).append(row)
        args.note(f"plain {row['plain']:.2f} ms, canonical {row['canonical']:.2f} ms", f"any n, {devices} devices")


def block_work(name: str, start, batch, mesh, shards: int, fold: bool = True):
    """A call that runs the canonical step's arithmetic with nothing moved between devices, no update: on each device
    its rows split and its k = L/n block gradients, one program each (on LOOP_PLATFORMS its loop program), then with
    ``fold`` their ``summation.exact_sum``, each device its own, in one program on the mesh that moves nothing (one
    compile, not one per device; strategies' own split, block and sum); it returns the devices' results in device
    order. Any construction that gives each block a gradient of its own and adds them exactly does at least this on
    some device: the floor under the canonical step's time."""
    _, loss_terms, _ = MODELS[name]
    k, devices = shards // mesh.devices.size, list(mesh.devices.flat)
    params = {d: jax.device_put(start[0], d) for d in devices}
    rows = {d: {key: next(s.data for s in x.addressable_shards if s.device == d) for key, x in batch.items()}
            for d in devices}
    if devices[0].platform in strategies.LOOP_PLATFORMS:
        loop, trips = strategies.loop_program(loss_terms, k, fold), {d: jax.device_put(np.int32(k), d) for d in devices}
        return lambda: jax.block_until_ready([loop(params[d], rows[d], trips[d]) for d in devices])
    block = strategies.block_program(loss_terms)
    split = strategies._split_program(k, False) if k > 1 else (lambda r: [r])
    spec = P(loaders.DATA_AXIS)
    folded = jax.jit(jax.shard_map(lambda rounds: jax.tree.map(lambda x: x[None], summation.exact_sum(
        jax.tree.map(lambda *x: jnp.concatenate(x), *rounds))), mesh=mesh, in_specs=spec, out_specs=spec))

    def run():
        sums = {d: [block(params[d], r) for r in split(rows[d])] for d in devices}
        if fold:
            sums = strategies._by_device(folded([strategies._assembled({d: sums[d][i] for d in devices}, mesh, spec)
                                                 for i in range(k)]), devices)
        return jax.block_until_ready([sums[d] for d in devices])
    return run


def step_memory(make: Callable, state, batch) -> float:
    """MiB one device holds at the peak of one step: the step ``make()`` builds, called once on (``state``, ``batch``),
    each program it calls measured at the call. On each of the program's devices: the buffers of the arrays alive
    then (each once; not those alive before the step but its state and batch), plus the program's outputs and
    temporaries less what it aliases (XLA's ``memory_analysis`` of the compiled program the call runs). The figure:
    the largest over the devices and the calls.

    The programs heard are those strategies' program factories (lru-cached, each program made once per key) hand
    out while the step is built and runs: ``make`` must build it anew, past strategies' cache of steps
    (``inspect.unwrap``). The state is donated where the step donates it. Not thread-safe: meanwhile strategies'
    factories are replaced. ValueError if the step called none of their programs."""
    peaks, others = {}, set(_buffers()) - set(_buffers((state, batch)))

    def recorded(program):
        def call(*args, **kwargs):
            memory = program.lower(*args, **kwargs).compile().memory_analysis()
            extra = memory.output_size_in_bytes + memory.temp_size_in_bytes - memory.alias_size_in_bytes
            held = [(d, size) for (d, address), size in _buffers().items() if (d, address) not in others]
            for device in {d for x in jax.tree.leaves((args, kwargs)) if isinstance(x, jax.Array) for d in x.devices()}:
                peaks[device] = max(peaks.get(device, 0), extra + sum(size for d, size in held if d == device))
            return program(*args, **kwargs)
        return call

    def fetching(factory):
        @functools.wraps(factory)  # inspect.unwrap still reaches the factory's own function
        def fetch(*args, **kwargs):
            made = factory(*args, **kwargs)
            return recorded(made) if isinstance(made, jax.stages.Wrapped) else made  # a step or a check as it is
        return fetch
    factories = {name: f for name, f in vars(strategies).items() if hasattr(f, "cache_info")}
    try:
        for name, factory in factories.items():
            setattr(strategies, name, fetching(factory))
        jax.block_until_ready(make()(state, batch))
    finally:
        for name, factory in factories.items():
            setattr(strategies, name, factory)
    if not peaks:
        raise ValueError(f"step_memory: make={make!r} built a step that called none of the programs of strategies' "
                         f"factories {sorted(factories)}")
    return max(peaks.values()) / 2**20


def _buffers(tree=None) -> dict:
    """{(device, buffer address): bytes} of the arrays in ``tree`` (None: every live array), each buffer once (a
    device's shard of a global array and the array made of that shard share theirs)."""
    arrays = jax.live_arrays() if tree is None else [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    return {(s.device, s.data.unsafe_buffer_pointer()): s.data.nbytes
            for x in arrays if not x.is_deleted() for s in x.addressable_shards}


def anew(loss_terms):
    """The same loss_terms as a new object: the strategies' programs, cached per loss_terms, compile anew for it."""
    return lambda params, batch: loss_terms(params, batch)


def reduction_case(name: str, global_batch: int, shards: int, mesh, smoke: bool = False, fresh: bool = False) -> tuple:
    """Model ``name``'s host (params, SGD state), a batch of L blocks of round(G/L) rows laid out for the mesh's n
    devices (``plan.device_slots``: a spare slot, masked, where n does not divide L) sharded on 'data', {"plain":
    sharded_step, "canonical": canonical_step at L}; ``fresh``: a new loss_terms object, so programs compile anew."""
    init, loss_terms, rows = MODELS[name]
    loss_terms = anew(loss_terms) if fresh else loss_terms
    rng = np.random.default_rng(0)
    params = init(rng, smoke)
    b, slots = max(1, round(global_batch / shards)), device_slots(shards, mesh.devices.size).reshape(-1)
    mask = np.repeat(slots >= 0, b)
    batch = jax.device_put(dict(rows(rng, mask.size), mask=mask), NamedSharding(mesh, P(loaders.DATA_AXIS)))
    return (params, strategies.sgd(LEARNING_RATE).init(params)), batch, reduction_steps(loss_terms, mesh, shards)


def reduction_steps(loss_terms, mesh, shards: int, uncached: bool = False) -> dict:
    """{"plain": sharded_step, "canonical": canonical_step at L = ``shards``}, with SGD's update; ``uncached``: each
    built anew, past strategies' cache of steps, so that it fetches its programs again (``step_memory``)."""
    made = inspect.unwrap if uncached else (lambda factory: factory)
    return {"plain": made(strategies.sharded_step)(loss_terms, strategies.sgd_update),
            "canonical": made(strategies.canonical_step)(loss_terms, strategies.sgd_update, mesh, shards)}


def layer_norm(x, p):
    """LayerNorm over the last axis, p = {"scale", "bias"}."""
    centred = x - x.mean(-1, keepdims=True)
    return centred * jax.lax.rsqrt((centred * centred).mean(-1, keepdims=True) + 1e-5) * p["scale"] + p["bias"]


def masked_nll(logits, labels, mask) -> tuple:
    """(sum over real rows of the NLL, averaged over any further axes, number of real rows)."""
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    real = mask.astype(nll.dtype)
    return jnp.sum(real * nll.reshape(nll.shape[0], -1).mean(1)), jnp.sum(real)


def normal(rng, *shape) -> np.ndarray:
    """float32 N(0, 1 / fan-in), fan-in the product of all but the last axis."""
    return (rng.standard_normal(shape) / np.sqrt(np.prod(shape[:-1]))).astype(np.float32)


def norm_params(width: int) -> dict:
    return {"scale": np.ones(width, np.float32), "bias": np.zeros(width, np.float32)}


def conv_init(rng, channels: tuple) -> dict:
    convs = [{"w": normal(rng, 3, 3, c_in, c), "b": np.zeros(c, np.float32), "norm": norm_params(c)}
             for c_in, c in zip((3, *channels), channels)]
    return {"convs": convs, "norm": norm_params(channels[-1]), "w": normal(rng, channels[-1], 10),
            "b": np.zeros(10, np.float32)}


def conv_loss_terms(params, batch) -> tuple:
    """Two 3x3 NHWC convs, each then LayerNorm over channels and GELU; mean pool, LayerNorm, dense head, 10 classes."""
    x = batch["images"]
    for layer in params["convs"]:
        x = jax.lax.conv_general_dilated(x, layer["w"], (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC")) + layer["b"]
        x = jax.nn.gelu(layer_norm(x, layer["norm"]))
    logits = layer_norm(x.mean((1, 2)), params["norm"]) @ params["w"] + params["b"]
    return masked_nll(logits, batch["labels"], batch["mask"])


def attention_loss_terms(params, batch) -> tuple:
    """Next-token NLL: an embedding tied to the output projection, LayerNorm, one causal single-head softmax attention
    layer (residual), LayerNorm."""
    x = params["embed"][batch["tokens"]]
    q, k, v = jnp.split(layer_norm(x, params["norm"]) @ params["qkv"], 3, axis=-1)
    scores = q @ k.swapaxes(1, 2) / np.float32(np.sqrt(WIDTH))
    x = x + jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((x.shape[1],) * 2, bool)), scores, -jnp.inf)) @ v @ params["out"]
    logits = layer_norm(x, params["final"]) @ params["embed"].T
    return masked_nll(logits, batch["targets"], batch["mask"])


def image_rows(rng, rows: int, shape: tuple) -> dict:
    return {"images": rng.standard_normal((rows, *shape), dtype=np.float32),
            "labels": rng.integers(0, 10, rows).astype(np.int32)}


def token_rows(rng, rows: int) -> dict:
    ids = rng.integers(0, VOCAB, (rows, SEQUENCE + 1)).astype(np.int32)
    return {"tokens": ids[:, :-1], "targets": ids[:, 1:]}


# name: (init(rng, smoke) -> params, loss_terms, rows(rng, count) -> {field: host array})
MODELS = {
    "mlp": (lambda rng, smoke: model.init_model(SMOKE_LAYERS if smoke else model.LAYERS), model.loss_terms,
            lambda rng, rows: image_rows(rng, rows, (3, 32, 32))),
    "conv": (lambda rng, smoke: conv_init(rng, SMOKE_CHANNELS if smoke else CONV_CHANNELS), conv_loss_terms,
             lambda rng, rows: image_rows(rng, rows, (32, 32, 3))),
    "attention": (lambda rng, smoke: {"embed": normal(rng, VOCAB, WIDTH), "norm": norm_params(WIDTH),
                                      "qkv": normal(rng, WIDTH, 3 * WIDTH), "out": normal(rng, WIDTH, WIDTH),
                                      "final": norm_params(WIDTH)}, attention_loss_terms, token_rows),
}


def goals(results: dict) -> list[dict]:
    """The goals of the sections in ``results``: {goal, measured, target, met}."""
    rows = []
    for key, section in results.get("loader", {}).items():
        naive = section["loaders"]["naive loop"]["images_per_s"]
        rows += [(f"reference, {p} / naive loop, images/s, {key.replace('_', ' ')}",
                  section["loaders"][f"reference, {p}"]["images_per_s"] / naive, ">=", 1.0) for p in loaders.PLACEMENTS]
    for key, row in results.get("feeding", {}).items():
        if int(key.split("_")[1]) in GLOBAL_BATCHES:
            rows += [(f"fed / prebuilt epoch, {name}, placement {p}, global batch {key.split('_')[1]}",
                      row[name][p]["fed_over_prebuilt"], "<=", 1.05)
                     for name in strategies.STRATEGIES if name in row for p in loaders.PLACEMENTS]
        else:
            rows += [(f"fed / prebuilt epoch over its limit, {name}, placement host, global batch "
                      f"{key.split('_')[1]}", row[name]["host"]["fed_over_prebuilt"] / row[name]["host"]["limit"],
                      "<=", 1.1) for name in strategies.STRATEGIES if name in row]
    training = results.get("training", {})
    for key, row in results.get("feeding", {}).items():  # the strategies' loop over prebuilt batches / its steps
        for name in strategies.STRATEGIES:
            step = training.get(key, {}).get(name, {}).get("step_ms")
            if name in row and step:
                rows.append((f"prebuilt epoch per step / step program queued, {name}, global batch "
                             f"{key.split('_')[1]}", row[name]["device"]["prebuilt_step_ms"] / step, "<=", 1.1))
    for r in results.get("reduction", {}).get("cases", []):
        target = 1.2 if r["global_batch"] >= max(GLOBAL_BATCHES) else 1.5
        rows.append((f"canonical / plain step, {r['model']}, global {r['global_batch']}, L = "
                     f"{r['logical_shards'] // r['devices']}n", r["ratio"]["step_time"], "<=", target))
        if r["logical_shards"] == r["devices"]:
            rows.append((f"canonical / plain step memory, {r['model']}, global {r['global_batch']}, L = n",
                         r["ratio"]["memory"], "<=", 1.5))
    return [{"goal": g, "measured": m, "target": f"{op} {t}",
             "met": m >= t if op == ">=" else (m < t if op == "<" else m <= t)} for g, m, op, t in rows]


def implausible(results: dict) -> list[str]:
    """Figures no sane run gives ("where = value"; the machine was too busy to measure them): a time (*_ms, *_s), rate
    (*_per_s, so *_s) or ratio (fed_over_prebuilt) not positive and finite in sections loader, feeding, training,
    reduction."""
    found = []

    def walk(where: str, figures) -> None:
        for key, value in (dict(enumerate(figures)) if isinstance(figures, list) else figures).items():
            if isinstance(value, (dict, list)):
                walk(f"{where} {key}", value)
            elif str(key).endswith(("_ms", "_s", "fed_over_prebuilt")):
                if not (isinstance(value, (int, float)) and np.isfinite(value) and value > 0):
                    found.append(f"{where} {key} = {value!r}")
    for section in ("loader", "feeding", "training", "reduction"):
        walk(section, results.get(section, {}))
    return found


def table(title: str, header: str, align: str, row: str, items) -> list[str]:
    """Markdown lines: a blank line, ``title``, then a row ``row.format(**item)`` per item."""
    rule = " | ".join("---" if a == "l" else "---:" for a in align)
    return ["", title, "", f"| {header} |", f"| {rule} |", *(f"| {row.format(**i)} |" for i in items)]


def markdown(results: dict) -> str:
    """The report: a table per section in ``results``, then the goals and implausible figures."""
    lines = [f"Machine: {results['machine']}; {results['config']}; read_cifar10 {results['read_cifar10_s']:.2f} s"]
    for key, section in results.get("loader", {}).items():
        lines += table(f"**Loaders, {key.replace('_', ' ')}** (host copy limit {section['copy_limit_gb_per_s']:.1f} "
                       f"GB/s; host to devices, a uint8 batch: {section['to_devices_gb_per_s']:.2f} GB/s)",
                       "loader | images/s | output GB/s | share of copy limit | reference, host / this", "lrrrr",
                       "{name} | {images_per_s:,.0f} | {gb_per_s:.2f} | {fraction_of_copy:.0%} | "
                       "{reference_speedup:.2f}", [dict(r, name=name) for name, r in section["loaders"].items()])
    if "feeding" in results:
        lines += table("**Feeding** (fed epoch / the same epoch prebuilt on the devices, median of rounds; the "
                       "prebuilt epoch's time per step; placement host's limit: a step's transfer, 8 in flight, "
                       "overlapped, and the first's)", "global batch | steps | strategy | placement | fed / prebuilt | "
                       "prebuilt ms per step | transfer ms | first transfer ms | limit", "rrllrrrrr",
                       "{batch} | {steps} | {name} | {p} | {fed_over_prebuilt:.2f}x | {prebuilt_step_ms:.2f} | "
                       "{transfer} | {first} | {limit}",
                       [dict(row[name][p], batch=key.split("_")[1], steps=row["steps"], name=name, p=p,
                             transfer=f"{row[name][p]['transfer_ms']:.2f}" if p == "host" else "",
                             first=f"{row[name][p]['first_transfer_ms']:.2f}" if p == "host" else "",
                             limit=f"{row[name][p]['limit']:.2f}x" if p == "host" else "")
                        for key, row in results["feeding"].items()
                        for name in strategies.STRATEGIES if name in row for p in loaders.PLACEMENTS])
    if "training" in results:
        lines += table("**Training** (the step program, steps queued back to back, per step, median of rounds; "
                       "compile: what JAX spent compiling in the first step, s, by phase)",
                       "global batch | strategy | step ms | / single | compile s | trace | lower | XLA", "rlrrrrrr",
                       "{batch} | {name} | {step_ms:.2f} | {ratio_to_single:.2f} | {compile_s:.2f} | "
                       "{compile[trace]:.2f} | {compile[lower]:.2f} | {compile[xla]:.2f}",
                       [dict(r, batch=key.split("_")[1], name=name) for key, row in results["training"].items()
                        if key.startswith("global_") for name, r in row.items()])
    if "reduction" in results:
        red = results["reduction"]
        lines += table(f"**The canonical reduction** (canonical_step against sharded_step on the same batch of L*b "
                       f"rows, SGD, matmul precision {red['precision']}; step median over interleaved rounds; memory "
                       f"per device at the step's peak, measured on one step: the arrays alive at each program and "
                       f"its outputs and temporaries; extra = the difference in gradients; floor = the block gradients "
                       f"and their exact sum, nothing moved)",
                       "model | devices | global batch | L | plain ms | canonical ms | canonical / plain | "
                       "floor / plain | plain MiB | canonical MiB | canonical / plain | extra", "lrrrrrrrrrrr",
                       "{model} | {devices} | {rows} | {logical_shards} | {plain[step_ms]:.2f} | "
                       "{canonical[step_ms]:.2f} | {ratio[step_time]:.2f} | {ratio[floor]:.2f} | "
                       "{plain[memory_mb]:.0f} | {canonical[memory_mb]:.0f} | {ratio[memory]:.2f} | "
                       "{extra_gradients:.1f}", red["cases"])
        lines += table("**Compile time** (s; the MLP, L = 8; what JAX spent compiling in the first call)",
                       "devices | global batch | plain | canonical", "rrrr",
                       "{devices} | {global_batch} | {plain:.2f} | {canonical:.2f}",
                       red["compile_s"])
        lines += table("**Any n** (the MLP, L = 8 on n devices that do not divide it: ceil(8/n) slots of G/8 rows a "
                       "device, a spare one masked; step medians)", "devices | global batch G | rows | plain ms | "
                       "canonical ms", "rrrrr", "{devices} | {global_batch} | {rows} | {plain:.2f} | {canonical:.2f}",
                       red.get("any_n", []))
    lines += table("**Goals**", "goal | measured | target | met", "lrll", "{goal} | {measured:.2f} | {target} | {met}",
                   [dict(g, met="yes" if g["met"] else "no") for g in results["goals"]])
    if results["implausible"]:
        lines += ["", "**Implausible figures** (the machine was too busy to measure them; rerun):", ""]
        lines += [f"- {text}" for text in results["implausible"]]
    return "\n".join(lines)


def main(argv=None) -> dict:
    """Runs the chosen sections, prints the report and returns the figures (``--json``: also to a file)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller data, fewer cases, steps, repeats and devices")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest run through every code path, for the test suite: its figures are noise")
    parser.add_argument("--num-train", type=int, help="synthetic images (default 50,000; quick 2,048)")
    parser.add_argument("--repeats", type=int, help="rounds per median (default 3; quick 2); a single step's "
                                                    "median takes 3 times as many")
    parser.add_argument("--json", metavar="FILE", help="also write the figures here")
    parser.add_argument("--no-grain", action="store_true", help="skip Grain even if installed")
    parser.add_argument("--no-dali", action="store_true", help="skip DALI even if installed")
    parser.add_argument("--sections", default="loader,feeding,training,reduction",
                        help="comma-separated sections to run, in this order (default: all of them)")
    args = parser.parse_args(argv)
    size = 2 if args.smoke else 1 if args.quick else 0  # (full, quick, smoke)
    args.num_train = args.num_train or (50_000, 2_048, 1_024)[size]  # 1024: 8 devices x B 128
    args.repeats = args.repeats or (3, 2, 1)[size]
    args.step_rounds = 3 * args.repeats
    args.train_steps = (20, 3, 3)[size]
    args.fed_batches = [(*GLOBAL_BATCHES, 8192), GLOBAL_BATCHES[:1], (64,)][size]
    args.fed_strategies = (tuple(strategies.STRATEGIES), ("sharded",), ("sharded",))[size]
    args.fed_steps = (32, 4, 4)[size]
    args.training_batches = GLOBAL_BATCHES if size == 0 else GLOBAL_BATCHES[:1]
    # (model, G, L / n) on n = reduction_devices: L = n, 4n, 8n; --quick: two models at global 128 on 2 devices;
    # --smoke: each model once, on one device (its warm-ups side by side)
    args.reduction_cases = [list(itertools.product(MODELS, GLOBAL_BATCHES, (1, 4, 8))),
                            [("mlp", 128, 1), ("attention", 128, 8)],
                            [("mlp", 16, 4), ("conv", 16, 1), ("attention", 16, 1)]][size]
    args.reduction_devices = min((8, 2, 1)[size], len(jax.devices()))
    args.compile_devices = ((1, 2, 4, 8), (3,), (1, 2))[size]  # quick's 3: any n then finds its sum compiled
    args.any_devices = ((3, 5, 6, 7), (3,), (3,))[size]
    args.mlp_batch = (max(GLOBAL_BATCHES), GLOBAL_BATCHES[0], 16)[size]  # G of the compile and any-n rows
    args.layers = model.LAYERS if size < 2 else SMOKE_LAYERS
    chosen = args.sections.split(",")
    args.compiles = Compiles()
    mesh = loaders.data_mesh(jax.devices())
    with tempfile.TemporaryDirectory() as root:
        args.cache_dir = os.path.join(root, "cache")
        data = os.path.join(root, "cifar10")
        synthetic_cifar10(data, num_train=args.num_train, num_test=16)
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                       platform.machine())
        start = time.perf_counter()
        images, labels = read_cifar10(data)
        results = {"machine": f"{cpu}, {os.cpu_count()} CPUs, {mesh.devices.size} {jax.devices()[0].platform} "
                              f"devices ({jax.devices()[0].device_kind})",
                   "config": f"{args.num_train:,} images, {args.repeats} rounds, JAX {jax.__version__}, "
                             f"NumPy {np.__version__}, Grain {installed('grain') or 'not installed'}, "
                             f"DALI {dali_loader.dali_version()}",
                   "read_cifar10_s": time.perf_counter() - start, "training_batches": list(args.training_batches),
                   "section_s": {}}
        sections = {"loader": loader_section, "feeding": feeding_section, "training": training_section,
                    "reduction": lambda images, labels, mesh, args, out: reduction_section(args, out)}
        if unknown := sorted(set(chosen) - set(sections)):
            parser.error(f"--sections: unknown {unknown}; choose from {list(sections)}")

        def note(line: str, case: str) -> None:  # one line per case; the figures so far to --json
            print(f"bench: {case}: {line}", file=sys.stderr, flush=True)
            results["goals"], results["implausible"] = goals(results), implausible(results)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=2)
        args.note = note
        for name in chosen:  # in the order given
            start = time.perf_counter()
            sections[name](images, labels, mesh, args, results.setdefault(name, {}))
            results["section_s"][name] = time.perf_counter() - start
            note(f"{results['section_s'][name]:.1f} s", f"{name} section")
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
