"""Speed and memory of the loaders and the training steps, as ratios measured side by side.

    python bench.py [--quick | --smoke] [--sections loader,...] [--num-train N] [--json FILE]

Compared cases run in interleaved rounds (a, b, a, b, ...) in one process, and each figure is
a median over the rounds. Load from other processes slows them alike: read the ratios, not the
absolute times. A peak is the RSS a case adds in a fresh process (with CPU devices, all the
devices' memory). The devices are the default backend's (8 virtual CPU devices without an
accelerator); the data is a synthetic CIFAR-10. Sections:

1. loader: one shuffled epoch into sharded global arrays, per loader, against a memory copy.
2. placements: each placement's loader against the training step it feeds.
3. training: each strategy's step time and compile time.
4. reduction: ``canonical_step`` against ``sharded_step`` on an MLP, a conv net and attention.
5. memory: peak RSS reading and over an epoch; a step's memory, its state donated or kept.

The report ends with the goals and the figures no sane run gives ("implausible": the machine
was too busy to measure them); ``--json`` also writes the figures.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

# GPU memory on demand, not 75% up front: the child processes need some of it too.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import dali_loader
import loaders
import model
import strategies
from arithmetic import Normalize
from cifar_mnist import RECORD_BYTES, read_cifar10, synthetic_cifar10
from plan import shard_bounds

GLOBAL_BATCHES = (128, 1024)  # training and reduction
REFERENCE = "reference, host"  # the row the others are compared with
LEARNING_RATE = 0.01
MEAN = STD = np.float32(127.5)  # arithmetic.Normalize()'s default, written out for the peers
SMOKE_LAYERS = (3072, 32, 10)  # --smoke's MLP: the code paths, not the figures
VOCAB, SEQUENCE, WIDTH = 256, 32, 64  # the attention model's
CONV_CHANNELS, SMOKE_CHANNELS = (32, 64), (4, 8)
PEAK_STEPS = 3  # steps of each reduction case a fresh process's peak RSS covers (the first compiles)
MEMORY_CASES = {"host prefetch 2": ("host", 2), "host prefetch 0": ("host", 0), "device": ("device", 0)}


# Measuring -----------------------------------------------------------------
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


def rss_mb(field: str = "VmRSS") -> float:
    """VmRSS (now) or VmHWM (peak) of this process, in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def reset_peak() -> None:
    """Restarts this process's VmHWM from its current RSS (clear_refs "5", Linux 4.0+); unlike
    getrusage's ru_maxrss, it does not carry the parent's peak across fork+exec."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # the peaks then include JAX's start-up


def children(calls: list[list]) -> list[dict]:
    """Runs each call, ["memory" or "reduction", *arguments], at once in a fresh process of this
    platform (so a peak RSS is each call's own); returns each child function's dict."""
    env = dict(os.environ, JAX_PLATFORMS=jax.devices()[0].platform, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    running = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps(call)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True) for call in calls]
    try:
        outputs = [process.communicate(timeout=600) for process in running]
    finally:
        for process in running:
            process.kill()  # a no-op on a child that has exited
            process.wait()
    for call, process, (_, stderr) in zip(calls, running, outputs):
        if process.returncode:
            raise RuntimeError(f"bench.py --child {json.dumps(call)} exited {process.returncode}:\n{stderr[-3000:]}")
    return [json.loads(stdout.splitlines()[-1]) for stdout, _ in outputs]


# 1. The loaders ------------------------------------------------------------
def loader_section(images, labels, mesh, args) -> dict:
    """Per per-device batch: the copy limit (GB/s) and, per loader, one epoch drained: images/s,
    GB/s, share of the copy limit, and "reference, host"'s speed over it. Medians of rounds."""
    out = {}
    for batch_size in (16, 128):
        by_placement = {p: loaders.make_loader((images, labels), mesh, batch_size, shuffle=True,
                                               placement=p) for p in loaders.PLACEMENTS}
        cases = {f"reference, {p}": lambda l=l: l.epoch(0) for p, l in by_placement.items()}
        dali = dali_loader_or_none(images, labels, mesh, batch_size, args)
        if dali is not None:
            cases["dali (CPU pipelines)"] = lambda: dali.epoch(0)
        cases["naive loop"] = lambda b=batch_size: naive_batches(images, labels, mesh, b)
        if installed("grain") and not args.no_grain:
            cases.update(grain_cases(images, labels, mesh, batch_size, cap=args.dataloader_cap))
        # warm-up (compilation, first-call costs of device_put), which also counts an epoch's bytes
        warm = {name: drain(make()) for name, make in cases.items() if name.startswith(("reference", "dali"))}
        epoch_bytes = warm[REFERENCE][1]
        sizes = {}
        timed = {name: (lambda n=name, make=make: sizes.__setitem__(n, drain(make()))) for name, make in cases.items()}
        src = np.ones(epoch_bytes // 4, np.float32)  # both buffers touched: no page faults timed
        dst = np.zeros_like(src)
        timed["copy"] = lambda: np.copyto(dst, src)
        seconds = {name: statistics.median(t) for name, t in rounds(timed, args.repeats).items()}
        limit = epoch_bytes / seconds["copy"] / 1e9
        results = {name: {"seconds": seconds[name], "images": samples, "images_per_s": samples / seconds[name],
                          "gb_per_s": nbytes / seconds[name] / 1e9,
                          "fraction_of_copy": nbytes / seconds[name] / 1e9 / limit}
                   for name, (samples, nbytes) in sizes.items()}
        for r in results.values():
            r["reference_speedup"] = results[REFERENCE]["images_per_s"] / r["images_per_s"]
        out[f"per_device_{batch_size}"] = {"copy_limit_gb_per_s": limit, "loaders": results}
    return out


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


def grain_cases(images, labels, mesh, batch_size: int, cap: int) -> dict:
    """Grain pipelines over the same records, global batch n*B, as arrays sharded on 'data', the
    process's shard by ShardByJaxProcess: "grain docs", Grain's JAX recipe; "grain batch-first",
    batch before map (one NumPy call per batch), 2 reader threads; "grain DataLoader", default
    ReadOptions, timed on its first ``cap`` images only (it is slow)."""
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

    def data_loader():
        sampler = grain.samplers.IndexSampler(len(labels), shard_options=shard, shuffle=True, num_epochs=1, seed=0)
        ops = [Normalise(), grain.transforms.Batch(per_process, drop_remainder=True)]
        batches = grain.DataLoader(data_source=Records(), sampler=sampler, operations=ops, worker_count=0)
        return (jax.device_put(b, sharding) for b in itertools.islice(batches, max(1, cap // per_process)))

    return {"grain docs": lambda: dataset(False),
            "grain batch-first": lambda: dataset(True, grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)),
            "grain DataLoader": data_loader}


def dali_loader_or_none(images, labels, mesh, batch_size: int, args):
    """DALI's CPU pipelines (its own arithmetic) over the same records; None without DALI,
    with --no-dali or on accelerators."""
    if args.no_dali or mesh.devices.flat[0].platform != "cpu":
        return None
    try:
        dali_loader.import_dali()
    except ImportError:
        return None
    return dali_loader.make_dali_loader((images, labels), mesh, batch_size, shuffle=True,
                                        normalize=Normalize(arithmetic="dali_cpu"),
                                        cache_dir=args.cache_dir, num_threads=1)


def installed(package: str) -> str | None:
    """The installed version of ``package``, or None."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# 2. Placements against the training step -----------------------------------
def placement_section(images, labels, mesh, args) -> dict:
    """Per global batch and placement: loader step (an epoch drained) / training step
    (``strategies.sharded`` on prebuilt batches), waiting (``synchronous_epoch``'s share), slowdown
    (the epoch fed by the loader against prebuilt batches; "device" hands out a dispatched gather,
    so its cost shows here, not in waiting)."""
    n = mesh.devices.size
    params = model.init_model(args.layers)
    out = {}
    for global_batch in args.placement_batches:
        count = min(len(labels), max(args.placement_images, 2 * global_batch))
        make = {p: loaders.make_loader((images[:count], labels[:count]), mesh, global_batch // n,
                                       shuffle=True, placement=p) for p in loaders.PLACEMENTS}
        prebuilt = list(make["host"].epoch(0))
        train(strategies.sharded, params, prebuilt[:1], mesh)  # compile
        waits = {p: [] for p in make}
        cases = {"prebuilt": lambda: train(strategies.sharded, params, prebuilt, mesh)}
        for p, loader in make.items():
            drain(loader.epoch(0))  # compile the placement's device code
            cases[f"loader {p}"] = lambda l=loader: drain(l.epoch(0))
            cases[f"fed {p}"] = lambda l=loader: train(strategies.sharded, params, l.epoch(0), mesh)
            cases[f"sync {p}"] = lambda l=loader, p=p: waits[p].append(synchronous_epoch(l, params))
        times = rounds(cases, args.repeats)
        steps = len(prebuilt)
        train_step = statistics.median(times["prebuilt"]) / steps
        row = {"images": count, "steps": steps, "train_step_ms": 1e3 * train_step}
        for p in make:
            loader_step = statistics.median(times[f"loader {p}"]) / steps
            row[p] = {"loader_step_ms": 1e3 * loader_step, "loader_over_train": loader_step / train_step,
                      "wait_fraction": statistics.median(waits[p]),
                      "slowdown_fraction": paired(times, f"fed {p}", "prebuilt", lambda fed, pre: (fed - pre) / fed)}
        out[f"global_{global_batch}"] = row
    return out


def synchronous_epoch(loader, params) -> float:
    """The share of an epoch's wall time spent in next() when each step (the plain
    ``sharded_step``) finishes before the next batch is asked for: the devices idle."""
    step = strategies.sharded_step(model.loss_terms, strategies.sgd_update)
    state = strategies.replicate((params, strategies.sgd(LEARNING_RATE).init(params)), loader.mesh)
    start, wait = time.perf_counter(), 0.0
    batches = iter(loader.epoch(0))
    while True:
        asked = time.perf_counter()
        batch = next(batches, None)
        wait += time.perf_counter() - asked
        if batch is None:
            return wait / (time.perf_counter() - start)
        state, value = step(state, batch)
        value.block_until_ready()


# 3. Training step times ----------------------------------------------------
def train(strategy, params, batches, mesh):
    """``strategy`` on ``batches`` with the notebooks' MLP and SGD(LEARNING_RATE)."""
    return strategy(params, batches, mesh, loss_terms=model.loss_terms, optimizer=strategies.sgd(LEARNING_RATE))


def training_section(images, labels, mesh, args) -> dict:
    """Per global batch and strategy: the step time (a run of ``train_steps`` + 1 steps minus
    a run of one, per step), its ratio to ``single``'s, and the compile time (the first call
    minus a warm one-step run)."""
    params = model.init_model(args.layers)
    compile_s, cases = {}, {}
    for global_batch in args.training_batches:
        for name, strategy in strategies.STRATEGIES.items():
            loader = loaders.make_loader((images, labels), mesh, global_batch // mesh.devices.size,
                                         layout=strategies.LAYOUT[name])
            batches = [loader.batch(0, s % len(loader)) for s in range(args.train_steps + 1)]
            start = time.perf_counter()
            train(strategy, params, batches[:1], mesh)
            compile_s[name, global_batch] = time.perf_counter() - start
            cases[name, global_batch, 1] = lambda s=strategy, b=batches[:1]: train(s, params, b, mesh)
            cases[name, global_batch, 0] = lambda s=strategy, b=batches: train(s, params, b, mesh)
    times = rounds(cases, args.repeats)
    out = {}
    for name, global_batch in compile_s:
        many, one = (name, global_batch, 0), (name, global_batch, 1)
        out.setdefault(f"global_{global_batch}", {})[name] = {
            "step_ms": 1e3 * paired(times, many, one, lambda t, t1: (t - t1) / args.train_steps),
            "compile_s": compile_s[name, global_batch] - statistics.median(times[one])}
    for row in out.values():
        for r in row.values():
            r["ratio_to_single"] = r["step_ms"] / row["single"]["step_ms"]
    return out


# 4. The canonical reduction on the models users bring ----------------------
def reduction_section(args) -> list[dict]:
    """Per case of ``args.reduction_cases``: each step's median time over interleaved rounds
    (after two warm-up calls each), and the peak RSS of PEAK_STEPS steps in a fresh process."""
    n = args.reduction_devices
    mesh = loaders.data_mesh(jax.devices()[:n])
    out = []
    for name, global_batch, per_device in args.reduction_cases:
        shards = per_device * n
        start, batch, steps = reduction_case(name, global_batch, shards, mesh, args.smoke)
        states = {s: strategies.replicate(start, mesh) for s in steps}  # plain donates on accelerators

        def call(s):
            states[s], loss = steps[s](states[s], batch)
            jax.block_until_ready((states[s], loss))
        for s in [*steps] * 2:  # compile
            call(s)
        times = rounds({s: lambda s=s: call(s) for s in steps}, args.step_rounds)
        peaks = children([["reduction", name, s, global_batch, shards, n, args.smoke] for s in steps])
        row = {"model": name, "devices": n, "global_batch": global_batch, "logical_shards": shards,
               "rows": int(batch["mask"].shape[0])}
        for s, peak in zip(steps, peaks):
            row[s] = {"step_ms": 1e3 * statistics.median(times[s]), "peak_mb": peak["peak_mb"]}
        row["ratio"] = {"step_time": row["canonical"]["step_ms"] / row["plain"]["step_ms"],
                        "peak_rss": row["canonical"]["peak_mb"] / row["plain"]["peak_mb"]}
        out.append(row)
    return out


def reduction_child(name: str, step: str, global_batch: int, shards: int, devices: int, smoke: bool) -> dict:
    """The peak RSS (MiB over the RSS before) of PEAK_STEPS steps of one case, in this process."""
    mesh = loaders.data_mesh(jax.devices()[:devices])
    start, batch, steps = reduction_case(name, global_batch, shards, mesh, smoke)
    state = strategies.replicate(start, mesh)
    jax.block_until_ready((state, batch))
    base = rss_mb()
    reset_peak()
    jax.block_until_ready(strategies.train_loop(steps[step], state, [batch] * PEAK_STEPS))
    return {"peak_mb": rss_mb("VmHWM") - base}


def reduction_case(name: str, global_batch: int, shards: int, mesh, smoke: bool = False) -> tuple:
    """Model ``name``'s host (params, SGD state), a batch of L*round(G/L) rows sharded on 'data',
    and {"plain": sharded_step, "canonical": canonical_step at L}."""
    init, loss_terms, rows = MODELS[name]
    rng = np.random.default_rng(0)
    params = init(rng, smoke)
    count = shards * max(1, round(global_batch / shards))
    batch = jax.device_put(dict(rows(rng, count), mask=np.ones(count, bool)), NamedSharding(mesh, P(loaders.DATA_AXIS)))
    steps = {"plain": strategies.sharded_step(loss_terms, strategies.sgd_update),
             "canonical": strategies.canonical_step(loss_terms, strategies.sgd_update, mesh, shards)}
    return (params, strategies.sgd(LEARNING_RATE).init(params)), batch, steps


def layer_norm(x, p):
    """LayerNorm over the last axis, p = {"scale", "bias"}."""
    centred = x - x.mean(-1, keepdims=True)
    return centred * jax.lax.rsqrt((centred * centred).mean(-1, keepdims=True) + 1e-5) * p["scale"] + p["bias"]


def masked_nll(logits, labels, mask) -> tuple:
    """(sum over real rows of the NLL, averaged over any further axes, number of real rows)."""
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
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
    """Two 3x3 convs over NHWC images, each LayerNorm over channels and GELU; mean pool,
    LayerNorm, a dense head of 10 classes."""
    x = batch["images"]
    for layer in params["convs"]:
        x = jax.lax.conv_general_dilated(x, layer["w"], (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC")) + layer["b"]
        x = jax.nn.gelu(layer_norm(x, layer["norm"]))
    logits = layer_norm(x.mean((1, 2)), params["norm"]) @ params["w"] + params["b"]
    return masked_nll(logits, batch["labels"], batch["mask"])


def attention_init(rng) -> dict:
    return {"embed": normal(rng, VOCAB, WIDTH), "norm": norm_params(WIDTH), "qkv": normal(rng, WIDTH, 3 * WIDTH),
            "out": normal(rng, WIDTH, WIDTH), "final": norm_params(WIDTH)}


def attention_loss_terms(params, batch) -> tuple:
    """Next-token NLL: an embedding tied to the output projection, LayerNorm, one causal
    single-head softmax attention layer (residual), LayerNorm."""
    x = params["embed"][batch["tokens"]]
    q, k, v = jnp.split(layer_norm(x, params["norm"]) @ params["qkv"], 3, axis=-1)
    scores = q @ k.swapaxes(1, 2) / np.float32(np.sqrt(WIDTH))
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    x = x + jax.nn.softmax(jnp.where(causal, scores, -jnp.inf)) @ v @ params["out"]
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
    "attention": (lambda rng, smoke: attention_init(rng), attention_loss_terms, token_rows),
}


# 5. Memory -----------------------------------------------------------------
def memory_section(root: str, args, results: dict) -> dict:
    """The loader cases of ``args.memory_cases`` (returned) and the donation (results["donation"])."""
    results["donation"] = donation_section(loaders.data_mesh(jax.devices()), args)
    out = {}
    for name in args.memory_cases:
        placement, prefetch = MEMORY_CASES[name]
        [result] = children([["memory", root, 128, prefetch, placement]])
        # What the design allows: the dataset, the queue, the batch being built and the one the
        # consumer holds; "device" holds the dataset again as the devices' copy (in host memory on CPU).
        alive = (prefetch + 2) * result["batch_mb"]
        result["budget_mb"] = result["raw_mb"] * (2 if placement == "device" else 1) + alive
        out[name] = result
    return out


def memory_child(root: str, batch_size: int, prefetch: int, placement: str) -> dict:
    """The peak RSS (MiB) while reading, then over one epoch, in this process."""
    mesh = loaders.data_mesh(jax.devices())
    jax.block_until_ready(jax.device_put(np.zeros(8), NamedSharding(mesh, P())))
    base = rss_mb()
    reset_peak()
    images, labels = read_cifar10(root)
    read_peak, after_read = rss_mb("VmHWM"), rss_mb()
    loader = loaders.make_loader((images, labels), mesh, batch_size, shuffle=True, prefetch=prefetch,
                                 placement=placement)
    batch_mb = sum(leaf.nbytes for leaf in jax.tree.leaves(loader.batch(0, 0))) / 2**20
    reset_peak()
    previous = None
    for batch in loader.epoch(0):  # as a training loop consumes: at most two steps in flight
        jax.block_until_ready(previous)
        previous = batch
    jax.block_until_ready(previous)
    return {"raw_mb": len(labels) * RECORD_BYTES / 2**20, "batch_mb": batch_mb,
            "baseline_mb": base, "after_read_mb": after_read - base,
            "read_peak_mb": read_peak - base, "epoch_peak_mb": rss_mb("VmHWM") - base}


def donation_section(mesh, args) -> dict:
    """The plain step's memory and time, its state donated and kept, the MLP at ``args.layers``: a step
    holds the larger of ``sharded_step``'s gradient program and ``update_program``, where the donation
    acts (per device, XLA's memory_analysis)."""
    start, batch, _ = reduction_case("mlp", mesh.devices.size * args.donation_batch, mesh.devices.size,
                                     mesh, args.smoke)
    state = strategies.replicate(start, mesh)
    gradient = strategies.sharded_gradient(model.loss_terms)  # sharded_step's gradient program
    sums = gradient(state[0], batch)

    def held(stats):
        return (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
                + stats.temp_size_in_bytes) / 2**20
    gradient_mb = held(gradient.lower(state[0], batch).compile().memory_analysis())
    out, cases = {"batch": args.donation_batch, "layers": list(args.layers)}, {}
    for name, donate in (("donated", True), ("kept", False)):
        update = strategies.update_program(strategies.sgd_update, donate)
        stats = update.lower(state, *sums).compile().memory_analysis()
        out[name] = {"state_mb": sum(x.nbytes for x in jax.tree.leaves(start[0])) / 2**20,
                     "aliased_mb": stats.alias_size_in_bytes / 2**20, "temp_mb": stats.temp_size_in_bytes / 2**20,
                     "update_mb": held(stats), "gradient_mb": gradient_mb, "step_mb": max(held(stats), gradient_mb)}

        def run(update=update):
            jax.block_until_ready(strategies.train_loop(lambda s, b: update(s, *gradient(s[0], b)),
                                                        strategies.replicate(start, mesh),
                                                        [batch] * args.donation_steps))
        run()
        cases[name] = run
    times = rounds(cases, args.repeats)
    for name in cases:
        out[name]["step_ms"] = 1e3 * statistics.median(times[name]) / args.donation_steps
    out["ratio"] = {"step_memory": out["donated"]["step_mb"] / out["kept"]["step_mb"],
                    "step_time": out["donated"]["step_ms"] / out["kept"]["step_ms"]}
    return out


# Report --------------------------------------------------------------------
def goals(results: dict) -> list[dict]:
    """The goals of the sections in ``results``: {goal, measured, target, met}."""
    rows = []
    if "loader" in results:
        b128 = results["loader"]["per_device_128"]["loaders"]
        rows.append(("loader at B=128, placement host: share of the copy limit",
                     b128[REFERENCE]["fraction_of_copy"], ">=", 0.40))
        grain = {k: v for k, v in b128.items() if k.startswith("grain")}
        if grain:
            best = max(grain, key=lambda k: grain[k]["images_per_s"])
            rows.append((f"reference / best Grain ({best}) at B=128",
                         b128[REFERENCE]["images_per_s"] / grain[best]["images_per_s"], ">=", 2.0))
    if "placements" in results:
        smallest = min(results["placements_batches"])
        device = results["placements"][f"global_{smallest}"]["device"]
        rows.append((f"training epoch waiting for data, placement device, global batch {smallest}",
                     device["wait_fraction"], "<", 0.05))
        rows.append((f"epoch slowdown against prebuilt batches, placement device, global batch {smallest}",
                     device["slowdown_fraction"], "<", 0.05))
    for r in results.get("reduction", []):
        if r["logical_shards"] == r["devices"] and r["global_batch"] == max(
                q["global_batch"] for q in results["reduction"] if q["model"] == r["model"]):
            rows.append((f"canonical / plain step time at L = n, {r['model']}, global batch {r['global_batch']}",
                         r["ratio"]["step_time"], "<=", 1.2))
    if "memory" in results:
        for name, m in results["memory"].items():
            rows.append((f"epoch peak RSS / budget, {name}", m["epoch_peak_mb"] / m["budget_mb"], "<=", 1.0))
        first = next(iter(results["memory"].values()))
        rows.append(("read_cifar10 peak RSS / raw dataset", first["read_peak_mb"] / first["raw_mb"], "<=", 1.05))
        if strategies.donates(jax.devices()):  # CPU devices do not donate: nothing to meet
            rows.append(("a training step's memory, donated / kept", results["donation"]["ratio"]["step_memory"],
                         "<", 1.0))
    return [{"goal": g, "measured": m, "target": f"{op} {t}",
             "met": m >= t if op == ">=" else (m < t if op == "<" else m <= t)} for g, m, op, t in rows]


def implausible(results: dict) -> list[str]:
    """Figures no sane run gives, as "where = value": a time (*_ms) or rate (*_per_s) not positive
    and finite, a waiting share outside [0, 1), an epoch slowdown outside (-1, 1), in the loader,
    placements, training and reduction sections. They mean the machine was too busy to measure."""
    ranges = {"wait_fraction": lambda v: 0 <= v < 1, "slowdown_fraction": lambda v: -1 < v < 1}
    found = []

    def walk(where: str, figures) -> None:
        if isinstance(figures, list):  # the reduction's rows
            figures = {f"{r['model']} G={r['global_batch']} L={r['logical_shards']}": r for r in figures}
        for key, value in figures.items():
            if isinstance(value, (dict, list)):
                walk(f"{where} {key}", value)
            elif key.endswith(("_ms", "_per_s")) or key in ranges:
                if not (isinstance(value, (int, float)) and np.isfinite(value)
                        and ranges.get(key, lambda v: v > 0)(value)):
                    found.append(f"{where} {key} = {value!r}")
    for section in ("loader", "placements", "training", "reduction"):
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
        lines += table(f"**Loaders, {key.replace('_', ' ')}** (copy limit {section['copy_limit_gb_per_s']:.1f} GB/s)",
                       "loader | images/s | output GB/s | share of copy limit | reference, host / this", "lrrrr",
                       "{name} | {images_per_s:,.0f} | {gb_per_s:.2f} | {fraction_of_copy:.0%} | "
                       "{reference_speedup:.2f}", [dict(r, name=name) for name, r in section["loaders"].items()])
    for key, row in results.get("placements", {}).items():
        lines += table(f"**Placements against training**, {key.replace('_', ' ')} ({row['images']:,} images, "
                       f"{row['steps']} steps; train step {row['train_step_ms']:.1f} ms)",
                       "placement | loader step ms | loader / train step | waiting for data (sync loop) "
                       "| epoch slowdown vs prebuilt", "lrrrr",
                       "{name} | {loader_step_ms:.1f} | {loader_over_train:.2f} | {wait_fraction:.1%} | "
                       "{slowdown_fraction:+.1%}", [dict(row[p], name=p) for p in loaders.PLACEMENTS])
    if "training" in results:
        lines += table("**Training** (per step, median; compile = first call - warm call)",
                       "global batch | strategy | step ms | / single | compile s", "rlrrr",
                       "{batch} | {name} | {step_ms:.1f} | {ratio_to_single:.2f} | {compile_s:.2f}",
                       [dict(r, batch=key.split("_")[1], name=name)
                        for key, row in results["training"].items() for name, r in row.items()])
    if "reduction" in results:
        lines += table(f"**The canonical reduction** (canonical_step against sharded_step on the same batch of L*b "
                       f"rows, SGD; step median over interleaved rounds; peak RSS of {PEAK_STEPS} steps, compile "
                       f"included, in a fresh process)",
                       "model | global batch | L | plain ms | canonical ms | canonical / plain | plain peak MiB "
                       "| canonical peak MiB | canonical / plain peak", "lrrrrrrrr",
                       "{model} | {rows} | {logical_shards} | {plain[step_ms]:.1f} | {canonical[step_ms]:.1f} | "
                       "{ratio[step_time]:.2f} | {plain[peak_mb]:.0f} | {canonical[peak_mb]:.0f} | "
                       "{ratio[peak_rss]:.2f}", results["reduction"])
    if "memory" in results:
        lines += table("**Memory** (one epoch, per-device batch 128, fresh process; MiB over the RSS before reading)",
                       "case | raw dataset | global batch | peak in read_cifar10 | held after read | peak in epoch "
                       "| budget", "lrrrrrr",
                       "{name} | {raw_mb:.0f} | {batch_mb:.1f} | {read_peak_mb:.0f} | {after_read_mb:.0f} | "
                       "{epoch_peak_mb:.0f} | {budget_mb:.0f}",
                       [dict(m, name=name) for name, m in results["memory"].items()])
        d = results["donation"]
        lines += table(f"**Donation** (MLP {'-'.join(map(str, d['layers']))}, sharded_step's programs, per-device "
                       f"batch {d['batch']}; per device, XLA's memory_analysis: arguments + outputs - aliased + "
                       f"temporaries, of the update program, where the donation acts, and of the gradient program; "
                       f"a step holds the larger; step time median)",
                       "state | params MiB | aliased MiB | update temporaries MiB | update holds MiB "
                       "| gradient holds MiB | one step holds MiB | step ms", "lrrrrrrr",
                       "{name} | {state_mb:.1f} | {aliased_mb:.1f} | {temp_mb:.1f} | {update_mb:.1f} | "
                       "{gradient_mb:.1f} | {step_mb:.1f} | {step_ms:.1f}",
                       [dict(d[name], name=name) for name in ("donated", "kept")])
        lines.append(f"| donated / kept | | | | | | {d['ratio']['step_memory']:.2f} | {d['ratio']['step_time']:.2f} |")
    lines += table("**Goals**", "goal | measured | target | met", "lrll", "{goal} | {measured:.2f} | {target} | {met}",
                   [dict(g, met="yes" if g["met"] else "no") for g in results["goals"]])
    if results["implausible"]:
        lines += ["", "**Implausible figures** (the machine was too busy to measure them; rerun):", ""]
        lines += [f"- {text}" for text in results["implausible"]]
    return "\n".join(lines)


def main(argv=None) -> dict:
    """Runs the chosen sections, prints the report and returns the figures (``--json``: also to a file)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller data, fewer repeats")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest run through every code path, for the test suite: its figures are noise")
    parser.add_argument("--num-train", type=int, help="synthetic images (default 50,000; quick 4,096)")
    parser.add_argument("--repeats", type=int, help="rounds per median (default 3; quick 2); a single step's "
                                                    "median takes 3 times as many")
    parser.add_argument("--json", metavar="FILE", help="also write the figures here")
    parser.add_argument("--no-grain", action="store_true", help="skip Grain even if installed")
    parser.add_argument("--no-dali", action="store_true", help="skip DALI even if installed")
    parser.add_argument("--sections", default="loader,placements,training,reduction,memory",
                        help="comma-separated sections to run (default: all of them)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # children()'s call, as JSON
    args = parser.parse_args(argv)
    if args.child:
        kind, *call = json.loads(args.child)
        print(json.dumps({"memory": memory_child, "reduction": reduction_child}[kind](*call)))
        return {}
    size = 2 if args.smoke else 1 if args.quick else 0  # (full, quick, smoke)
    args.num_train = args.num_train or (50_000, 4_096, 1_024)[size]  # 1024: 8 devices x B 128
    args.repeats = args.repeats or (3, 2, 1)[size]
    args.step_rounds = 3 * args.repeats
    args.train_steps = (4, 2, 1)[size]
    args.placement_images = (16_384, 1_024, 256)[size]
    args.placement_batches = [(1024, 8192), (128, 512), (64,)][size]
    args.training_batches = GLOBAL_BATCHES if size < 2 else GLOBAL_BATCHES[:1]
    # (model, G, L / n): L = n and 3n; --smoke: each model, step and L once, on 2 devices
    args.reduction_cases = (list(itertools.product(MODELS, GLOBAL_BATCHES, (1, 3))) if size < 2 else
                            [("mlp", 16, 3), ("conv", 16, 1), ("attention", 16, 1)])
    args.reduction_devices = len(jax.devices()) if size < 2 else min(2, len(jax.devices()))
    args.dataloader_cap = (4_096, 1_024, 256)[size]
    args.memory_cases = [tuple(MEMORY_CASES), ("host prefetch 2", "device"), ("device",)][size]
    args.layers = model.LAYERS if size < 2 else SMOKE_LAYERS
    args.donation_batch, args.donation_steps = (128, 16, 2)[size], (5, 3, 2)[size]
    chosen = args.sections.split(",")
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
        results = {"machine": f"{cpu}, {os.cpu_count()} CPUs, {mesh.devices.size} {jax.devices()[0].platform} devices",
                   "config": f"{args.num_train:,} images, {args.repeats} rounds, JAX {jax.__version__}, "
                             f"NumPy {np.__version__}, Grain {installed('grain') or 'not installed'}, "
                             f"DALI {dali_loader.dali_version()}",
                   "read_cifar10_s": time.perf_counter() - start, "placements_batches": list(args.placement_batches),
                   "training_batches": list(args.training_batches), "section_s": {}}
        sections = {"loader": lambda: loader_section(images, labels, mesh, args),
                    "placements": lambda: placement_section(images, labels, mesh, args),
                    "training": lambda: training_section(images, labels, mesh, args),
                    "reduction": lambda: reduction_section(args),
                    "memory": lambda: memory_section(data, args, results)}
        unknown = sorted(set(chosen) - set(sections))
        if unknown:
            parser.error(f"--sections: unknown {unknown}; choose from {list(sections)}")
        for name in (name for name in sections if name in chosen):
            start = time.perf_counter()
            results[name] = sections[name]()
            results["section_s"][name] = time.perf_counter() - start
            print(f"bench: {name} section {results['section_s'][name]:.1f} s", file=sys.stderr, flush=True)
    results["goals"] = goals(results)
    results["implausible"] = implausible(results)
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
