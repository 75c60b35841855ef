"""Speed of the reference loader and the four strategies, as ratios measured side by side.

    python bench.py [--quick] [--num-train N] [--json FILE]

Every figure is a median over repeats, and the cases that are compared run in
interleaved rounds (a, b, c, a, b, c, ...) in one process, so load from other
processes on a shared machine slows them alike: read the ratios, not the
absolute times. Sections, on 8 virtual CPU devices and a synthetic CIFAR-10 of
``--num-train`` images:

1. Loader: one shuffled epoch through ``Loader.epoch`` into global sharded arrays,
   per-device batch 16 and 128, against the memory bandwidth measured in the same
   run (``np.copyto`` of as many bytes as the epoch outputs, single thread).
2. Peers, the same work (shuffle, normalise, batch, global arrays) from the same
   in-memory records: Grain (optional, requirements-bench.txt) as its docs show it
   and tuned, and the per-sample Python loop most tutorials write.
3. Training: per-step time of each strategy at global batch 128 and 1024, its
   ratio to ``single``, and its compile time (first call minus a warm call).
4. Overlap: the share of a training epoch (``sharded``, global batch 1024) spent
   waiting for data, prefetch on and off.
5. Memory: peak RSS while reading and over a loader epoch, in a fresh process,
   against the raw dataset and the prefetch queue.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import loaders
import model
import strategies

GLOBAL_BATCHES = (128, 1024)  # training; per device 16 and 128 on 8 devices
LEARNING_RATE = 0.01
MEAN = STD = np.float32(127.5)  # loaders.Normalize()'s default, written out for the peers


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------


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
    samples = nbytes = 0
    last = None
    for batch in batches:
        samples += batch["images"].shape[0]
        nbytes += sum(leaf.nbytes for leaf in jax.tree.leaves(batch))
        last = batch
    jax.block_until_ready(last)
    return samples, nbytes


def copy_case(nbytes: int):
    """A NumPy copy of ``nbytes``, both buffers touched beforehand (page faults excluded)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.zeros_like(src)
    return lambda: np.copyto(dst, src)


# --------------------------------------------------------------------------
# 1-2. The reference loader and its peers
# --------------------------------------------------------------------------


def naive_batches(images, labels, mesh, batch_size: int, seed: int = 0):
    """The tutorial loop: each shard shuffled, then one Python iteration per sample."""
    sharding = NamedSharding(mesh, P(loaders.DATA_AXIS))
    n = mesh.devices.size
    rng = np.random.default_rng(seed)
    orders = [rng.permutation(np.arange(*loaders.shard_bounds(len(labels), k, n))) for k in range(n)]
    for step in range(min(map(len, orders)) // batch_size):
        xs, ys = [], []
        for order in orders:
            for i in order[step * batch_size:(step + 1) * batch_size]:
                xs.append((images[i].astype(np.float32) - MEAN) / STD)
                ys.append(labels[i])
        yield {"images": jax.device_put(np.stack(xs), sharding),
               "labels": jax.device_put(np.asarray(ys), sharding)}


def grain_cases(images, labels, mesh, batch_size: int, cap: int) -> dict:
    """Grain pipelines over the same records, global batch n*B, as global sharded arrays.

    "grain docs": Grain's JAX tutorial recipe: MapDataset.source -> seed -> shuffle
    -> map(per record) -> batch -> to_iter_dataset() -> grain.experimental.device_put
    onto NamedSharding(mesh, P('data')), the process's shard chosen by ShardOptions
    (ShardByJaxProcess; one process here, so the whole dataset). "grain batch-first":
    the same with batch before map, so normalising is one NumPy call per batch, and
    2 reader threads for 2 cores. "grain DataLoader": the DataLoader API with an
    IndexSampler(shard_options=...) and its default ReadOptions, timed on its first
    ``cap`` images only (it is slow; see the README).
    """
    import grain

    class Records(grain.sources.RandomAccessDataSource):
        def __len__(self):
            return len(labels)

        def __getitem__(self, i):
            return {"images": images[i], "labels": labels[i]}

    def normalise(record):  # a record or a batch of them
        return {"images": (record["images"] - MEAN) / STD, "labels": record["labels"]}

    class Normalise(grain.transforms.Map):
        def map(self, record):
            return normalise(record)

    sharding = NamedSharding(mesh, P(loaders.DATA_AXIS))
    shard = grain.sharding.ShardByJaxProcess(drop_remainder=True)
    per_process = mesh.devices.size * batch_size

    def dataset(batch_first: bool, read_options=None):
        ds = grain.MapDataset.source(Records())[shard.shard_index::shard.shard_count]
        ds = ds.seed(0).shuffle()
        if batch_first:
            ds = ds.batch(per_process, drop_remainder=True).map(normalise)
        else:
            ds = ds.map(normalise).batch(per_process, drop_remainder=True)
        ds = ds.to_iter_dataset(read_options)
        return grain.experimental.device_put(ds, sharding, cpu_buffer_size=4, device_buffer_size=2)

    def data_loader():
        sampler = grain.samplers.IndexSampler(len(labels), shard_options=shard, shuffle=True,
                                              num_epochs=1, seed=0)
        ops = [Normalise(), grain.transforms.Batch(per_process, drop_remainder=True)]
        batches = grain.DataLoader(data_source=Records(), sampler=sampler, operations=ops,
                                   worker_count=0)
        steps = max(1, cap // per_process)
        return (jax.device_put(b, sharding) for b in itertools.islice(batches, steps))

    return {"grain docs": lambda: dataset(False),
            "grain batch-first": lambda: dataset(True, grain.ReadOptions(num_threads=2,
                                                                         prefetch_buffer_size=4)),
            "grain DataLoader": data_loader}


def grain_version() -> str | None:
    try:
        from importlib.metadata import version
        return version("grain")
    except Exception:
        return None


def loader_section(images, labels, mesh, args) -> dict:
    """Sections 1 and 2: every loader at each per-device batch, plus the copy limit."""
    out = {}
    for batch_size in (16, 128):
        loader = loaders.make_loader((images, labels), mesh, batch_size, shuffle=True)
        cases = {"reference": lambda l=loader: l.epoch(0)}
        cases["naive loop"] = lambda b=batch_size: naive_batches(images, labels, mesh, b)
        if grain_version() and not args.no_grain:
            cases.update(grain_cases(images, labels, mesh, batch_size, cap=args.dataloader_cap))
        drain(loader.epoch(0))  # warm-up: first-call costs of device_put
        _, epoch_bytes = drain(loader.epoch(0))
        sizes = {}
        timed = {name: (lambda n=name, make=make: sizes.__setitem__(n, drain(make())))
                 for name, make in cases.items()}
        timed["copy"] = copy_case(epoch_bytes)
        seconds = {name: statistics.median(t) for name, t in rounds(timed, args.repeats).items()}
        limit = epoch_bytes / seconds["copy"] / 1e9
        results = {}
        for name, (samples, nbytes) in sizes.items():
            results[name] = {"seconds": seconds[name], "images": samples,
                             "images_per_s": samples / seconds[name],
                             "gb_per_s": nbytes / seconds[name] / 1e9}
            results[name]["fraction_of_copy"] = results[name]["gb_per_s"] / limit
        for r in results.values():
            r["reference_speedup"] = results["reference"]["images_per_s"] / r["images_per_s"]
        out[f"per_device_{batch_size}"] = {"copy_limit_gb_per_s": limit, "loaders": results}
    return out


# --------------------------------------------------------------------------
# 3. Training step times
# --------------------------------------------------------------------------


def training_section(images, labels, mesh, args) -> dict:
    params = model.init_model()
    n = mesh.devices.size
    calls = {}
    for global_batch in GLOBAL_BATCHES:
        for name, strategy in strategies.STRATEGIES.items():
            loader = loaders.make_loader((images, labels), mesh, global_batch // n,
                                         layout=strategies.LAYOUT[name])
            batches = [loader.batch(0, s % len(loader)) for s in range(args.train_steps + 1)]
            calls[name, global_batch] = (strategy, batches)
    compile_s = {}
    for key, (strategy, batches) in calls.items():
        start = time.perf_counter()
        strategy(params, batches[:1], LEARNING_RATE, mesh)
        compile_s[key] = time.perf_counter() - start
    cases = {}
    for key, (strategy, batches) in calls.items():
        cases[key, 1] = lambda s=strategy, b=batches: s(params, b[:1], LEARNING_RATE, mesh)
        cases[key, 0] = lambda s=strategy, b=batches: s(params, b, LEARNING_RATE, mesh)
    times = rounds(cases, args.repeats)
    out = {}
    for key in calls:
        name, global_batch = key
        step_s = paired(times, (key, 0), (key, 1), lambda many, one: (many - one) / args.train_steps)
        out.setdefault(f"global_{global_batch}", {})[name] = {
            "step_ms": 1e3 * step_s,
            "compile_s": compile_s[key] - statistics.median(times[key, 1]),
        }
    for row in out.values():
        for r in row.values():
            r["ratio_to_single"] = r["step_ms"] / row["single"]["step_ms"]
    return out


# --------------------------------------------------------------------------
# 4. Overlap of loading and training
# --------------------------------------------------------------------------


class TimedIter:
    """Wraps an iterator and adds up the time its consumer spends blocked in next()."""

    def __init__(self, batches):
        self.batches = iter(batches)
        self.wait_s = 0.0

    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()
        try:
            return next(self.batches)
        finally:
            self.wait_s += time.perf_counter() - start


def synchronous_epoch(loader, params) -> float:
    """``sharded``'s step, waiting for each step's result before asking for the next
    batch: time in next() is then time the devices sit idle for data. Returns the
    fraction of the epoch's wall time spent there."""
    start = time.perf_counter()
    batches = TimedIter(loader.epoch(0))
    for batch in batches:
        params, value = model.update(params, batch, LEARNING_RATE)
        value.block_until_ready()
    return batches.wait_s / (time.perf_counter() - start)


def overlap_section(images, labels, mesh, args) -> dict:
    """Input stall of a training epoch (``sharded``, global batch 1024), two ways.

    wait: a synchronous step loop (no async dispatch to hide a late batch), the
    fraction of wall time blocked in next(). slowdown: ``strategies.sharded``
    itself, epoch time fed by the loader vs on batches built beforehand; this
    includes CPU contention between the loader thread and the step, but it is a
    difference of two noisy times (a small negative value means none).
    """
    count = min(len(labels), args.overlap_images)
    data = (images[:count], labels[:count])
    batch_size = GLOBAL_BATCHES[-1] // mesh.devices.size
    make = lambda prefetch: loaders.make_loader(data, mesh, batch_size, shuffle=True, prefetch=prefetch)
    params = model.init_model()
    replicated = strategies.replicate(params, mesh)
    prebuilt = list(make(2).epoch(0))
    strategies.sharded(params, prebuilt[:1], LEARNING_RATE, mesh)  # compile
    waits = {2: [], 0: []}
    cases = {"prebuilt": lambda: strategies.sharded(params, prebuilt, LEARNING_RATE, mesh)}
    for prefetch in (2, 0):
        cases[f"prefetch {prefetch}"] = lambda p=prefetch: strategies.sharded(params, make(p).epoch(0),
                                                                              LEARNING_RATE, mesh)
        cases[f"sync {prefetch}"] = lambda p=prefetch: waits[p].append(synchronous_epoch(make(p), replicated))
    times = rounds(cases, args.repeats)
    out = {"images": count, "steps": len(prebuilt), "prebuilt_s": statistics.median(times["prebuilt"])}
    for prefetch in (2, 0):
        name = f"prefetch {prefetch}"
        out[f"prefetch_{prefetch}"] = {
            "wait_fraction": statistics.median(waits[prefetch]),
            "epoch_s": statistics.median(times[name]),
            "slowdown_fraction": paired(times, name, "prebuilt", lambda fed, pre: (fed - pre) / fed),
        }
    return out


# --------------------------------------------------------------------------
# 5. Peak memory, in a fresh process
# --------------------------------------------------------------------------


def rss_mb(field: str = "VmRSS") -> float:
    """VmRSS (now) or VmHWM (peak) of this process, in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def reset_peak() -> None:
    # getrusage's ru_maxrss looks right for a fresh process, but Linux carries the
    # parent's peak across fork+exec into it (here: the parent's 1.7 GB). VmHWM is
    # this process's own, and "5" (Linux 4.0+) restarts it from the current RSS.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # the peaks then include JAX's start-up


def memory_child(root: str, batch_size: int, prefetch: int) -> dict:
    """Runs in its own process: the peak RSS while reading, then over one epoch (MiB)."""
    mesh = loaders.data_mesh(jax.devices())
    jax.block_until_ready(jax.device_put(np.zeros(8), NamedSharding(mesh, P())))
    base = rss_mb()
    reset_peak()
    images, labels = loaders.read_cifar10(root)
    read_peak, after_read = rss_mb("VmHWM"), rss_mb()
    loader = loaders.make_loader((images, labels), mesh, batch_size, shuffle=True, prefetch=prefetch)
    batch_mb = sum(leaf.nbytes for leaf in jax.tree.leaves(loader.batch(0, 0))) / 2**20
    reset_peak()
    drain(loader.epoch(0))
    return {"raw_mb": len(labels) * loaders.RECORD_BYTES / 2**20, "batch_mb": batch_mb,
            "baseline_mb": base, "after_read_mb": after_read - base,
            "read_peak_mb": read_peak - base, "epoch_peak_mb": rss_mb("VmHWM") - base}


def memory_section(root: str, args) -> dict:
    out = {}
    for prefetch in (2, 0):
        command = [sys.executable, os.path.abspath(__file__), "--memory-child", root,
                   str(128), str(prefetch)]
        result = json.loads(subprocess.run(command, check=True, capture_output=True,
                                           text=True).stdout.splitlines()[-1])
        # What the design allows: the dataset, the queue, the batch being built and
        # the one the consumer holds.
        result["budget_mb"] = result["raw_mb"] + (prefetch + 2) * result["batch_mb"]
        out[f"prefetch_{prefetch}"] = result
    return out


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------


def goals(results: dict) -> list[dict]:
    b128 = results["loader"]["per_device_128"]["loaders"]
    grain = {k: v for k, v in b128.items() if k.startswith("grain")}
    rows = [("loader at B=128: share of the copy limit", b128["reference"]["fraction_of_copy"], ">=", 0.40)]
    if grain:
        best = max(grain, key=lambda k: grain[k]["images_per_s"])
        rows.append((f"reference / best Grain ({best}) at B=128",
                     b128["reference"]["images_per_s"] / grain[best]["images_per_s"], ">=", 2.0))
    rows.append(("training epoch waiting for data, prefetch on", results["overlap"]["prefetch_2"]["wait_fraction"],
                 "<", 0.05))
    memory = results["memory"]["prefetch_2"]
    rows.append(("epoch peak RSS / (raw dataset + queue)", memory["epoch_peak_mb"] / memory["budget_mb"],
                 "<=", 1.0))
    rows.append(("read_cifar10 peak RSS / raw dataset", memory["read_peak_mb"] / memory["raw_mb"], "<=", 1.05))
    return [{"goal": g, "measured": m, "target": f"{op} {t}",
             "met": m >= t if op == ">=" else (m < t if op == "<" else m <= t)} for g, m, op, t in rows]


def markdown(results: dict) -> str:
    lines = [f"Machine: {results['machine']}; {results['config']}; read_cifar10 "
             f"{results['read_cifar10_s']:.2f} s", ""]
    for key, section in results["loader"].items():
        lines += [f"**Loaders, {key.replace('_', ' ')}** (copy limit "
                  f"{section['copy_limit_gb_per_s']:.1f} GB/s)", "",
                  "| loader | images/s | output GB/s | share of copy limit | reference / this |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for name, r in section["loaders"].items():
            lines.append(f"| {name} | {r['images_per_s']:,.0f} | {r['gb_per_s']:.2f} | "
                         f"{r['fraction_of_copy']:.0%} | {r['reference_speedup']:.2f} |")
        lines.append("")
    lines += ["**Training** (per step, median; compile = first call - warm call)", "",
              "| global batch | strategy | step ms | / single | compile s |",
              "| ---: | --- | ---: | ---: | ---: |"]
    for key, row in results["training"].items():
        for name, r in row.items():
            lines.append(f"| {key.split('_')[1]} | {name} | {r['step_ms']:.1f} | "
                         f"{r['ratio_to_single']:.2f} | {r['compile_s']:.2f} |")
    o = results["overlap"]
    lines += ["", f"**Overlap** (sharded, global batch 1024, {o['images']:,} images, "
              f"{o['steps']} steps; prebuilt batches {o['prebuilt_s']:.2f} s)", "",
              "| prefetch | waiting for data (sync loop) | strategies.sharded epoch s | slowdown vs prebuilt |",
              "| --- | ---: | ---: | ---: |"]
    for p in (2, 0):
        r = o[f"prefetch_{p}"]
        lines.append(f"| {p} | {r['wait_fraction']:.1%} | {r['epoch_s']:.2f} | {r['slowdown_fraction']:+.1%} |")
    lines += ["", "**Memory** (one epoch, per-device batch 128, fresh process; MiB over the RSS before reading)", "",
              "| prefetch | raw dataset | global batch | peak in read_cifar10 | held after read | peak in epoch | budget |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for p in (2, 0):
        m = results["memory"][f"prefetch_{p}"]
        lines.append(f"| {p} | {m['raw_mb']:.0f} | {m['batch_mb']:.1f} | {m['read_peak_mb']:.0f} | "
                     f"{m['after_read_mb']:.0f} | {m['epoch_peak_mb']:.0f} | {m['budget_mb']:.0f} |")
    lines += ["", "**Goals**", "", "| goal | measured | target | met |", "| --- | ---: | --- | --- |"]
    for g in results["goals"]:
        lines.append(f"| {g['goal']} | {g['measured']:.2f} | {g['target']} | {'yes' if g['met'] else 'no'} |")
    return "\n".join(lines)


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                    platform.machine())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller data, fewer repeats (< 60 s)")
    parser.add_argument("--num-train", type=int, help="synthetic images (default 50,000; quick 4,096)")
    parser.add_argument("--repeats", type=int, help="rounds per median (default 3; quick 2)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures here")
    parser.add_argument("--no-grain", action="store_true", help="skip Grain even if installed")
    parser.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        root, batch_size, prefetch = args.memory_child
        print(json.dumps(memory_child(root, int(batch_size), int(prefetch))))
        return {}
    args.num_train = args.num_train or (4_096 if args.quick else 50_000)
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.train_steps = 2 if args.quick else 4
    args.overlap_images = 4_096 if args.quick else 8_192
    args.dataloader_cap = 1_024 if args.quick else 4_096
    mesh = loaders.data_mesh(jax.devices())
    with tempfile.TemporaryDirectory() as root:
        loaders.synthetic_cifar10(root, num_train=args.num_train, num_test=16)
        start = time.perf_counter()
        images, labels = loaders.read_cifar10(root)
        read_s = time.perf_counter() - start
        results = {
            "machine": f"{cpu_name()}, {os.cpu_count()} CPUs, "
                       f"{mesh.devices.size} {jax.devices()[0].platform} devices",
            "config": f"{args.num_train:,} images, {args.repeats} rounds, JAX {jax.__version__}, "
                      f"NumPy {np.__version__}, Grain {grain_version() or 'not installed'}",
            "read_cifar10_s": read_s,
            "loader": loader_section(images, labels, mesh, args),
            "training": training_section(images, labels, mesh, args),
            "overlap": overlap_section(images, labels, mesh, args),
            "memory": memory_section(root, args),
        }
    results["goals"] = goals(results)
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
