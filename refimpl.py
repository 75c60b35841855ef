"""The two notebooks as one program: sharded loaders, an MLP, data-parallel SGD.

    python refimpl.py                    # synthetic CIFAR-10, sharded then pmap, 5 epochs
    python refimpl.py --dataset mnist    # the DALI notebook's MNIST and MLP
    python refimpl.py --backend dali     # the training data read by NVIDIA DALI
    python refimpl.py --help

What it does, in the notebooks' order: builds one sharded training loader over
the devices and a single-device validation loader, trains the notebook's MLP
with each chosen strategy from the same initial params, and after every epoch
prints the mean training loss, the accuracy over every test sample exactly
once, the epoch time and images per second. At the end it prints how far apart
the strategies' final params are, against the bound strategies.ulp_bound gives;
--params-out FILE also writes them (.npz), to compare runs bit for bit (e.g.
--backend dali and --backend reference with the same seed and --normalize).

Bad input (a malformed dataset, an invalid option, a batch larger than a shard,
more devices than exist, a platform JAX lacks) ends with one line on stderr
naming the option or file, and exit status 2, before any data is generated or
any training starts where the option alone shows it.

A broken guarantee is a failure: when two strategies' final params end further
apart than the documented bound, the last line printed says so, naming the pair,
and the exit status is 1. The bound is strategies.verdict's: the count of
roundings a step (strategies.ulp_bound, or ``--max-ulps-per-step``) times the
growth of a difference over this training, which strategies.twin_growth measures
after the training, over the same epochs, when a pair ends further apart than its
count x the steps (closer is within whatever the growth; the twins cost about three
more trainings' arithmetic, on the mesh). Where that
growth is not linear, the pair's line says "outside the domain where a bound is
derived" (no verdict, exit status 0): a rounding difference and a real bug then
end alike. In a run that stops for a checkpoint or resumes one (``Elastic``), the
growth is not measured: the training spans runs on other devices, which twin_growth
cannot replay, so a pair further apart than count x steps is "outside the domain
where a bound is derived", saying why.

Checkpoint and resume (``Elastic``): ``--stop-after-step S --checkpoint-dir DIR``
stops every strategy after run step S and writes a checkpoint atomically;
``--resume-from DIR`` continues it on any device or process count and batch
size, the interrupted epoch's remaining samples following loaders.elastic_plan.
For that epoch the report says, counted from the rows actually delivered in
both runs (``Deliveries``), whether every sample was delivered exactly once
(drop: at most once, the stated count skipped); a broken promise is a failure
too (exit status 1). A checkpoint of another run is refused naming the field.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

DEFAULT_CPU_DEVICES = 8
MAX_CPU_DEVICES = 64  # virtual CPU devices are threads on the same cores
SYNTHETIC = {"num_train": 2048, "num_test": 512}
STRATEGY_NAMES = ("sharded", "pmap", "shard_map", "single")
DATASETS = ("cifar10", "mnist")
BACKENDS = ("reference", "rocal", "dali", "auto")
PLACEMENTS = ("auto", "host", "device", "host_float32")
PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu")
# Each notebook's normalisation: rocAL's CIFAR-10 (x - 127.5) / 127.5, DALI's MNIST x / 255.
NOTEBOOK_NORMALIZE = {"cifar10": ((127.5,) * 3, (127.5,) * 3), "mnist": ((0.0,), (255.0,))}
ARITHMETICS = ("rocal", "dali_cpu", "dali_gpu")  # loaders.ARITHMETICS (not imported: fast errors)
NOTEBOOK_ARITHMETIC = {"cifar10": "rocal", "mnist": "dali_cpu"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="refimpl.py",
        description="Data-parallel training of the rocAL/DALI notebooks' MLP, one sharded loader "
                    "per device, with several parallel strategies.",
        epilog=f"With no --data-dir a synthetic dataset in the chosen format "
               f"({SYNTHETIC['num_train']} training and {SYNTHETIC['num_test']} test images) is "
               f"generated once into --cache-dir and reused. Without an accelerator (or with "
               f"--platform cpu) JAX gets {DEFAULT_CPU_DEVICES} virtual CPU devices; they share this "
               f"machine's cores, so timings there show overhead, not speed-up. The defaults finish "
               f"in under a minute on a 2-core machine.",
    )
    parser.add_argument("--dataset", choices=DATASETS, default="cifar10",
                        help="cifar10 (the rocAL notebook, MLP 3072-1024-1024-10) or mnist (the DALI "
                             "notebook, MLP 784-1024-1024-10) (default: %(default)s)")
    parser.add_argument("--hidden", default="1024,1024", metavar="W[,W...]",
                        help="the MLP's hidden layer widths, comma-separated (default: %(default)s, the "
                             "notebooks'); narrower layers train the same way, faster")
    parser.add_argument("--data-dir", metavar="DIR",
                        help="cifar10: a cifar-10-batches-bin folder (data_batch_* and test_batch*); "
                             "mnist: a folder with the IDX files (train-images-idx3-ubyte[.gz], ...)")
    parser.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "refimpl"),
                        metavar="DIR", help="where synthetic data and DALI's per-sample files go "
                                            "(default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=5, metavar="N", help="default: %(default)s")
    parser.add_argument("--batch-size", type=int, default=16, metavar="B", help="per device (default: %(default)s)")
    parser.add_argument("--eval-batch-size", type=int, default=256,
                        metavar="B", help="validation batch on one device (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=0.001, metavar="RATE",
                        help="SGD learning rate, > 0 (default: %(default)s, the notebook's)")
    parser.add_argument("--seed", type=int, default=0, metavar="N",
                        help="shuffle and synthetic-data seed, 0 <= N < 2**32 (default: %(default)s)")
    parser.add_argument("--strategies",
                        metavar="LIST", help=f"comma-separated, any of {', '.join(STRATEGY_NAMES)}, or 'all' "
                             f"(default: sharded,pmap as the notebooks; sharded,shard_map across "
                             f"processes)")
    parser.add_argument("--platform", choices=PLATFORMS,
                        help="the JAX platform to run on (default: JAX's, the accelerators if any); "
                             f"--platform cpu gives {DEFAULT_CPU_DEVICES} virtual CPU devices on any host")
    parser.add_argument("--devices", type=int,
                        metavar="N", help=f"use the first N devices; on CPU, N virtual devices, at most "
                             f"{MAX_CPU_DEVICES} (default: all accelerators, or {DEFAULT_CPU_DEVICES} CPU devices)")
    parser.add_argument("--last-batch", choices=("fill", "drop"), default="fill",
                        help="fill: pad the last batch and mask the padding, so every sample counts "
                             "exactly once; drop: skip the remainder, as the notebooks (default: %(default)s)")
    parser.add_argument("--backend", choices=BACKENDS, default="reference",
                        help="training loader: the NumPy/JAX reference, AMD rocAL (cifar10 only; each "
                             "device's pipeline reads its shard of the reference plan), NVIDIA "
                             "DALI, or auto: rocal on AMD GPUs and dali on NVIDIA GPUs where installed, "
                             "else reference (default: %(default)s)")
    parser.add_argument("--placement", choices=PLACEMENTS, default="auto",
                        help="reference backend: where the per-step work happens. device: each "
                             "device holds its shard and gathers there; host: uint8 rows from the "
                             "host, normalised on the devices; host_float32: normalised on the host. "
                             "auto: device when the shard fits half of each device's free memory "
                             "(on CPU: of the host's), else host (default: %(default)s)")
    parser.add_argument("--normalize", choices=ARITHMETICS,
                        help="whose crop_mirror_normalize arithmetic (bits) to use (default: the "
                             "backend's: dali_cpu for DALI on CPU devices, dali_gpu on NVIDIA GPUs, "
                             "rocal for rocAL; else the notebook's: rocal for cifar10, dali_cpu for "
                             "mnist)")
    parser.add_argument("--matmul-precision", choices=("default", "high", "highest"), default="highest",
                        help="JAX's float32 matmul precision; 'default' is TF32 on recent NVIDIA GPUs, "
                             "and the strategies' bounds then no longer hold (default: %(default)s)")
    parser.add_argument("--max-ulps-per-step", type=int, metavar="U",
                        help="count U roundings a step instead of strategies.ulp_bound's count; the "
                             "bound is U times the measured growth of a difference (strategies.verdict); "
                             "0 demands bit-identical params. Outside the bound: exit status 1")
    parser.add_argument("--metrics-out", metavar="FILE", help="write every per-epoch figure to this file as JSON lines")
    parser.add_argument("--params-out", metavar="FILE",
                        help="write each strategy's final params to this .npz file (process 0), one "
                             "array per leaf named '<strategy>/<leaf index>' in jax.tree.leaves order; "
                             "compare two runs' files bit for bit with numpy")
    multi = parser.add_argument_group(
        "more than one process (jax.distributed)",
        "One process per host; --devices is then each process's device count, the mesh spans "
        "every process's devices, and only process 0 prints. Strategies: sharded, shard_map.")
    multi.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address, reachable by all")
    multi.add_argument("--num-processes", type=int, metavar="N", help="how many processes take part")
    multi.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0..N-1")
    multi.add_argument("--auto-distributed", action="store_true",
                       help="let jax.distributed.initialize() detect the cluster (Slurm, Open MPI, ...)")
    multi.add_argument("--local-processes", type=int, metavar="N",
                       help="launch N processes on this machine (127.0.0.1), on CPU devices, that split "
                            f"--devices (default {DEFAULT_CPU_DEVICES}) between them")
    multi.add_argument("--peer-timeout", type=int, default=60,
                       metavar="SECONDS", help="seconds to wait for a missing or silent peer before failing "
                            "(default: %(default)s)")
    add_checkpoint_options(parser)
    args = parser.parse_args(argv)
    several = args.coordinator or args.auto_distributed or args.local_processes
    if args.strategies is None:
        args.strategies = "sharded,shard_map" if several else "sharded,pmap"
    names = STRATEGY_NAMES if args.strategies == "all" else tuple(
        s.strip() for s in args.strategies.split(",") if s.strip())
    unknown = [s for s in names if s not in STRATEGY_NAMES]
    if unknown or not names:
        parser.error(f"--strategies: unknown strategy {unknown or args.strategies!r}; "
                     f"choose from {', '.join(STRATEGY_NAMES)} or 'all'")
    args.strategies = names
    text = args.hidden
    try:
        args.hidden = tuple(int(w) for w in text.split(","))
    except ValueError:
        args.hidden = ()
    if not args.hidden or min(args.hidden) < 1:
        parser.error(f"--hidden {text!r}: give the hidden layers' widths as positive "
                     f"integers separated by commas, e.g. 1024,1024")
    for flag in ("epochs", "batch_size", "eval_batch_size", "devices", "peer_timeout"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if not 0 <= args.seed < 2**32:
        parser.error(f"--seed must be in [0, 2**32), got {args.seed} (the shuffle's SeedSequence "
                     f"would alias larger seeds with other epochs)")
    if args.max_ulps_per_step is not None and args.max_ulps_per_step < 0:
        parser.error(f"--max-ulps-per-step must be >= 0, got {args.max_ulps_per_step}")
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    if args.devices and args.devices > MAX_CPU_DEVICES and args.platform == "cpu":
        parser.error(f"--devices {args.devices}: at most {MAX_CPU_DEVICES} virtual CPU devices (they "
                     f"are threads sharing this machine's {os.cpu_count()} cores; more adds only "
                     f"overhead)")
    for flag in ("metrics_out", "params_out"):
        path = getattr(args, flag)
        problem = unwritable(path) if path else None
        if problem:
            parser.error(f"--{flag.replace('_', '-')} {path}: {problem}")
    if args.dataset == "mnist" and args.backend == "rocal":
        parser.error("--backend rocal reads CIFAR-10 only (rocAL's cifar10 reader); use "
                     "--dataset cifar10, or --backend dali or reference for mnist")
    if args.backend in ("rocal", "dali") and args.placement != "auto":
        parser.error(f"--placement {args.placement}: only the reference backend has placements "
                     f"(--backend {args.backend} normalises in its own pipelines)")
    vendor = {"rocal": ("rocal",), "dali": ("dali_cpu", "dali_gpu")}.get(args.backend)
    if vendor and args.normalize and args.normalize not in vendor:
        parser.error(f"--normalize {args.normalize}: --backend {args.backend} computes "
                     f"{' or '.join(vendor)} arithmetic (by device kind); drop --normalize")
    explicit = [args.coordinator, args.num_processes, args.process_id]
    if any(v is not None for v in explicit) and any(v is None for v in explicit):
        parser.error("--coordinator, --num-processes and --process-id go together")
    if args.num_processes is not None and not 0 <= args.process_id < args.num_processes:
        parser.error(f"--process-id {args.process_id} is outside 0..{args.num_processes - 1}")
    if args.local_processes is not None:
        if args.local_processes < 1 or args.coordinator or args.auto_distributed:
            parser.error("--local-processes N needs N >= 1 and no other multi-process option")
        if args.platform not in (None, "cpu"):
            parser.error(f"--local-processes runs on CPU devices; --platform {args.platform} cannot go with it")
        total = args.devices or DEFAULT_CPU_DEVICES
        if total % args.local_processes:
            parser.error(f"--local-processes {args.local_processes} does not divide --devices {total}")
    if several:
        unsupported = [s for s in names if s not in ("sharded", "shard_map")]
        if unsupported:
            parser.error(f"--strategies {','.join(unsupported)}: across processes only sharded and "
                         f"shard_map run (pmap maps over one process's devices; single is one device)")
    check_checkpoint_options(parser, args)
    return args


def add_checkpoint_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "checkpoint and resume",
        "Stop after a run step and write a checkpoint (each strategy's params and optimizer "
        "state, the loader state, what the interrupted epoch delivered); resume it on any device "
        "or process count and batch size: the interrupted epoch's remaining samples are delivered "
        "exactly once on the new shards (loaders.elastic_plan), and the report counts them from "
        "the delivered rows.")
    group.add_argument("--stop-after-step", type=int, metavar="S",
                       help="train every strategy for S steps of the run (counted over the epochs in "
                            "order from epoch 1's first step; a resumed run continues the count), "
                            "write the checkpoint to --checkpoint-dir and stop")
    group.add_argument("--checkpoint-dir", metavar="DIR",
                       help="where --stop-after-step writes the checkpoint (created if missing; "
                            "DIR/checkpoint.json, replaced atomically, names the arrays file)")
    group.add_argument("--resume-from", metavar="DIR",
                       help="continue the run checkpointed in DIR, on this run's devices, processes "
                            "and --batch-size; the dataset, data, seed, --last-batch, arithmetic, "
                            "strategies, optimizer and matmul precision must be the checkpoint's")


def check_checkpoint_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.stop_after_step is not None and args.stop_after_step < 1:
        parser.error(f"--stop-after-step must be >= 1, got {args.stop_after_step}")
    if (args.stop_after_step is None) != (args.checkpoint_dir is None):
        parser.error("--stop-after-step and --checkpoint-dir go together (one says when to stop, the "
                     "other where the checkpoint goes)")
    if args.checkpoint_dir:
        folder = os.path.abspath(args.checkpoint_dir)
        parent = folder if os.path.isdir(folder) else os.path.dirname(folder)
        if os.path.exists(folder) and not os.path.isdir(folder):
            parser.error(f"--checkpoint-dir {args.checkpoint_dir}: is a file, not a folder")
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            parser.error(f"--checkpoint-dir {args.checkpoint_dir}: {parent} is not a writable folder")
    if args.resume_from:
        path = os.path.join(args.resume_from, CHECKPOINT_FILE)
        if not os.path.isfile(path):
            parser.error(f"--resume-from {args.resume_from}: no {CHECKPOINT_FILE} there (not a "
                         f"checkpoint written by --stop-after-step)")


def unwritable(path: str) -> str | None:
    """Why ``path`` cannot be written (without creating it), or None."""
    if os.path.isdir(path):
        return "is a directory"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else "is not writable"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"its folder {folder} does not exist"
    return None if os.access(folder, os.W_OK) else f"its folder {folder} is not writable"


def synthetic_dataset(cache_dir: str, dataset: str, seed: int) -> str:
    """The synthetic dataset's folder, generating it once (atomically) if missing."""
    import loaders

    folder = os.path.join(cache_dir, f"synthetic-{dataset}-{SYNTHETIC['num_train']}-"
                                     f"{SYNTHETIC['num_test']}-seed{seed}")
    if os.path.isdir(folder):
        return folder
    os.makedirs(cache_dir, exist_ok=True)
    scratch = tempfile.mkdtemp(dir=cache_dir, prefix=".generating-")
    try:
        write = loaders.synthetic_cifar10 if dataset == "cifar10" else loaders.synthetic_mnist
        write(scratch, seed=seed, **SYNTHETIC)
        os.rename(scratch, folder)
    except OSError:
        if not os.path.isdir(folder):  # not a concurrent run that finished first
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"generated synthetic {dataset} in {folder}")
    return folder


def read_dataset(dataset: str, folder: str):
    """((train images, labels), (test images, labels)) of ``dataset`` in ``folder``."""
    import loaders

    if dataset == "mnist":
        return loaders.read_mnist(folder, "train"), loaders.read_mnist(folder, "test")
    return loaders.read_cifar10(folder, loaders.TRAIN_PREFIX), loaders.read_cifar10(folder, loaders.TEST_PREFIX)


def pick_devices(requested: int | None) -> list:
    import jax

    devices = jax.devices()
    if requested is None:
        return devices
    if requested > len(devices):
        why = (f" (virtual CPU devices: at most {MAX_CPU_DEVICES}; they share this machine's "
               f"{os.cpu_count()} cores)" if devices[0].platform == "cpu" else "")
        raise ValueError(f"--devices {requested}: only {len(devices)} {devices[0].platform} "
                         f"device(s) exist{why}")
    return devices[:requested]


def choose_backend(requested: str, dataset: str, devices: list) -> str:
    """--backend auto: rocal on AMD GPUs (cifar10), dali on NVIDIA GPUs, where each imports."""
    if requested != "auto":
        return requested
    if dataset == "cifar10":
        import rocal_loader
        if rocal_loader.usable(devices):
            return "rocal"
    import dali_loader
    if dali_loader.usable(devices):
        return "dali"
    return "reference"


def choose_arithmetic(backend: str, normalize: str | None, dataset: str, devices: list) -> str:
    """The Normalize arithmetic of a run: ``normalize`` (--normalize) when given, else the bits
    the backend computes on ``devices``: DALI its device kind's (dali_loader.arithmetic_for:
    "dali_cpu" on CPU devices, "dali_gpu" on NVIDIA GPUs), rocAL "rocal", the reference backend
    the dataset's notebook's (NOTEBOOK_ARITHMETIC). parse_args has already refused a
    --normalize that the vendor backend does not compute."""
    if normalize:
        return normalize
    if backend == "dali":
        import dali_loader
        return dali_loader.arithmetic_for(devices)
    return "rocal" if backend == "rocal" else NOTEBOOK_ARITHMETIC[dataset]


def with_progress(batches, total: int, label: str):
    """Yields ``batches``; on a terminal, also a live step counter on one line."""
    if not sys.stdout.isatty():
        yield from batches
        return
    for step, batch in enumerate(batches, start=1):
        print(f"\r  {label}: step {step}/{total}", end="", flush=True)
        yield batch
    print("\r" + " " * (len(label) + 30) + "\r", end="", flush=True)


def run(args: argparse.Namespace) -> tuple[dict, list[str]]:
    """Trains every chosen strategy; returns (final params by strategy, the pairs
    whose params ended outside the bound, as report lines; empty if none or if
    this is not process 0)."""
    import jax

    if args.platform:
        jax.config.update("jax_platforms", args.platform)
    jax.config.update("jax_default_matmul_precision", args.matmul_precision)
    # Virtual CPU devices only exist if asked for before JAX first touches a
    # device; on accelerators this setting changes nothing.
    distributed = bool(args.coordinator or args.auto_distributed)
    cpu_devices = args.devices if args.devices and args.devices <= MAX_CPU_DEVICES else DEFAULT_CPU_DEVICES
    jax.config.update("jax_num_cpu_devices", cpu_devices if distributed else max(cpu_devices, DEFAULT_CPU_DEVICES))
    if distributed:
        connect(args)
    try:
        jax.devices()
    except Exception as error:  # RuntimeError; JAX 0.10.2 raises a bare AssertionError
        said = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"--platform {args.platform or '(default)'}: JAX cannot start it here "
                         f"({said}); is its plugin installed (e.g. jax[cuda13], ROCm's jax wheels)?") from error
    import numpy as np
    import loaders
    import model
    import strategies

    devices = jax.devices() if distributed else pick_devices(args.devices)
    mesh = loaders.data_mesh(devices)  # shard k = position k, across every process's devices
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    backend = choose_backend(args.backend, args.dataset, devices)
    if args.backend == "auto":
        say(f"--backend auto chose {backend}")
    arithmetic = choose_arithmetic(backend, args.normalize, args.dataset, devices)
    mean, std = NOTEBOOK_NORMALIZE[args.dataset]
    normalize = loaders.Normalize(mean=mean, std=std, arithmetic=arithmetic)
    if backend == "rocal":
        import rocal_loader
        rocal_loader.import_rocal()  # how to install it, before any data is generated
    if backend == "dali":
        import dali_loader
        dali_loader.import_dali()

    data_dir = args.data_dir or synthetic_dataset(args.cache_dir, args.dataset, args.seed)
    train_data, test_data = read_dataset(args.dataset, data_dir)
    eval_batch = min(args.eval_batch_size, len(test_data[1]))
    # Validation always uses the reference loader on one device: fill with a mask
    # counts every test sample exactly once, whatever the training backend.
    first_local = mesh.devices.flat[loaders.local_positions(mesh)[0]]
    test_loader = loaders.make_loader(test_data, [first_local], eval_batch, last_batch="fill",
                                      normalize=normalize)
    layouts = {strategies.LAYOUT[name] for name in args.strategies}
    placement = args.placement
    if backend == "reference" and placement == "auto":
        too_big = loaders.device_fit(len(train_data[1]), train_data[0].shape[1:], mesh)
        placement = "host" if too_big else "device"
    last_batch = args.last_batch
    common = dict(shuffle=True, seed=args.seed, last_batch=last_batch, normalize=normalize)
    if backend == "reference":
        loaders_by_layout = {layout: loaders.make_loader(train_data, mesh, args.batch_size, layout=layout,
                                                         placement=placement, **common)
                             for layout in layouts}
        how = f"reference loader, placement {placement}"
    elif backend == "rocal":
        loaders_by_layout = {layout: rocal_loader.make_rocal_loader(
            data_dir, mesh, args.batch_size, layout=layout, cache_dir=args.cache_dir, **common)
            for layout in layouts}
        how = next(iter(loaders_by_layout.values())).describe()
    else:
        loaders_by_layout = {layout: dali_loader.make_dali_loader(
            train_data, mesh, args.batch_size, layout=layout, cache_dir=args.cache_dir, **common)
            for layout in layouts}
        how = next(iter(loaders_by_layout.values())).describe()
    steps = len(next(iter(loaders_by_layout.values())))
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    say(f"{len(devices)} {devices[0].platform} device(s){processes}; {args.dataset}: {len(train_data[1])} "
        f"training and {len(test_data[1])} test images from {data_dir}; {steps} steps of "
        f"{len(devices)} x {args.batch_size} per epoch ({last_batch}); {how}; "
        f"{arithmetic}'s arithmetic; matmul precision {args.matmul_precision}")

    metrics = open(args.metrics_out, "w") if args.metrics_out and jax.process_index() == 0 else None
    inputs = (model.LAYERS if args.dataset == "cifar10" else model.MNIST_LAYERS)[0]
    params0 = model.init_model((inputs, *args.hidden, model.LAYERS[-1]))
    optimizer = strategies.sgd(args.lr)  # the notebooks' plain SGD
    elastic = None
    if args.stop_after_step or args.resume_from:
        elastic = Elastic(args, mesh=mesh, train_data=train_data, normalize=normalize,
                          arithmetic=arithmetic, backend=backend, loaders_by_layout=loaders_by_layout,
                          where=f"{len(devices)} {devices[0].platform} device(s){processes} x "
                                f"{args.batch_size} ({how if backend == 'reference' else backend})",
                          say=say)
    final = {}
    try:
        for name in args.strategies:
            train = strategies.STRATEGIES[name]
            loader = loaders_by_layout[strategies.LAYOUT[name]]
            params, opt_state = elastic.start(name, params0, optimizer) if elastic else (params0, None)
            say(f"--- {name} ---")
            for epoch in (elastic.epochs() if elastic else range(args.epochs)):
                start = time.perf_counter()
                batches, total = elastic.batches(name, loader, epoch) if elastic else (loader.epoch(epoch), steps)
                if jax.process_index() == 0:
                    batches = with_progress(batches, total, f"{name} epoch {epoch + 1}")
                params, losses, opt_state = train(params, batches, mesh, loss_terms=model.loss_terms,
                                                  optimizer=optimizer, opt_state=opt_state)
                seconds = time.perf_counter() - start
                # After the epoch: a vendor loader may only know then which of its
                # slots were padding (rocAL's shuffled drop). No device work either way.
                real, note, verdicts = loader.real_samples(epoch), "", []
                if elastic:  # a resumed or interrupted epoch: counted from what was delivered
                    real, losses, note, verdicts = elastic.epoch_done(name, epoch, params, opt_state,
                                                                      losses, real)
                accuracy = model.accuracy(params, test_loader.epoch(0))
                row = {"strategy": name, "epoch": epoch + 1, "loss": float(np.mean(losses)),
                       "test_accuracy": accuracy, "test_samples": test_loader.real_samples(0),
                       "seconds": seconds,
                       "images_per_second": real / seconds, "steps": len(losses),
                       "devices": 1 if name == "single" else len(devices),
                       "platform": devices[0].platform, "backend": backend, "dataset": args.dataset}
                say(f"{name:>9} epoch {epoch + 1}/{args.epochs}  loss {row['loss']:.4f}  "
                      f"test accuracy {accuracy:.4f}  {seconds:6.2f} s  "
                      f"{row['images_per_second']:8.0f} images/s"
                      + ("  (includes compilation)" if epoch == (elastic.first_epoch if elastic else 0) else "")
                      + note)
                for line in verdicts:
                    say(line)
                if metrics:
                    metrics.write(json.dumps(row) + "\n")
                    metrics.flush()
            final[name] = params
        bound, bound_name = strategies.ulp_bound, "strategies.ulp_bound"
        if args.max_ulps_per_step is not None:
            bound, bound_name = (lambda a, b, platform, num_devices: args.max_ulps_per_step), "--max-ulps-per-step"
        growth = None
        if not elastic and needs_growth(final, steps * args.epochs, bound, devices[0].platform,
                                        len(devices)):
            # Every process decides alike (the final params are replicated) and takes part.
            say("measuring how a difference grows over this training (strategies.twin_growth: "
                "a reference and two twins over the same epochs)")
            loader = loaders_by_layout["sharded"]  # a pair includes a strategy other than pmap
            growth = strategies.twin_growth(params0, (b for e in range(args.epochs) for b in loader.epoch(e)),
                                            mesh, loss_terms=model.loss_terms, optimizer=optimizer)
    finally:
        if metrics:
            metrics.close()
        for loader in loaders_by_layout.values():
            if hasattr(loader, "close"):
                loader.close()
    outside = []
    if elastic:
        elastic.checkpoint()
    if jax.process_index() == 0:
        if args.params_out:
            write_params(args.params_out, final)
        if elastic:  # the steps before a resume ran on other device counts: the largest bound holds
            bound = elastic.bound_over_runs(bound, len(devices))
        outside = report_differences(final, elastic.steps_trained if elastic else steps * args.epochs,
                                     devices[0].platform, len(devices), bound, bound_name, growth,
                                     no_growth=NO_GROWTH_ACROSS_RUNS if elastic else None)
    if elastic:
        outside = outside + elastic.failed()
    return final, outside


NO_GROWTH_ACROSS_RUNS = ("the training spans a checkpoint (runs on other devices), which twin_growth "
                         "cannot replay, so the growth of a difference was not measured")


def needs_growth(final: dict, steps: int, bound: Callable, platform: str, num_devices: int) -> bool:
    """Whether a pair of ``final`` (each strategy against the first) needs the measured growth
    for its verdict: a count above 0 and a leaf further apart than count x ``steps`` in its
    own ulps (closer is within whatever the growth: strategies.verdict)."""
    import strategies

    names = list(final)
    for other in names[1:]:
        count = bound(names[0], other, platform, num_devices)
        if count and (strategies.leaf_ulps(final[names[0]], final[other]) > count * steps).any():
            return True
    return False


def write_params(path: str, final: dict) -> None:
    """``final`` ({strategy: params}) as one .npz: array '<strategy>/<i>' is leaf i of
    ``jax.tree.leaves(params)``, the values this process holds (params are replicated)."""
    import numpy as np
    import jax

    arrays = {}
    for name, params in final.items():
        for i, leaf in enumerate(jax.tree.leaves(params)):
            if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
                leaf = leaf.addressable_data(0)  # replicated: any local copy is the whole value
            arrays[f"{name}/{i}"] = np.asarray(leaf)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


# --------------------------------------------------------------------------
# Checkpoint and resume: --stop-after-step, --checkpoint-dir, --resume-from
# --------------------------------------------------------------------------

CHECKPOINT_FORMAT = "refimpl.checkpoint/1"
CHECKPOINT_FILE = "checkpoint.json"
# Options a resumed run may change: where and how it runs, not what it trains.
# Every other option (the dataset, seed, --last-batch, --lr, --strategies as a
# set, --matmul-precision, and any option added later) must be the checkpoint's.
# --normalize is compared as the arithmetic it resolved to.
CHANGEABLE = frozenset({
    "data_dir", "cache_dir", "epochs", "batch_size", "eval_batch_size", "platform", "devices",
    "backend", "placement", "normalize", "metrics_out", "params_out", "max_ulps_per_step",
    "coordinator", "num_processes", "process_id", "auto_distributed", "local_processes",
    "peer_timeout", "stop_after_step", "checkpoint_dir", "resume_from"})


def run_identity(args: argparse.Namespace, train_data, arithmetic: str) -> dict:
    """What a checkpoint shares with every run that resumes it: each option outside
    CHANGEABLE (the strategies as a sorted list), the arithmetic actually used, the
    loader's shuffle (always on here), and the training data: its size and the
    BLAKE2b-128 digest of its image bytes then its int32 label bytes, in order."""
    import hashlib
    import numpy as np

    images, labels = train_data
    digest = hashlib.blake2b(digest_size=16)
    for lo in range(0, len(images), 4096):  # read_cifar10's images are a strided view
        digest.update(np.ascontiguousarray(images[lo:lo + 4096]).tobytes())
    digest.update(np.ascontiguousarray(labels, np.int32).tobytes())
    identity = {name: value for name, value in vars(args).items() if name not in CHANGEABLE}
    identity["strategies"] = sorted(args.strategies)
    identity.update(arithmetic=arithmetic, shuffle=True, num_train=len(labels),
                    train_data_blake2b=digest.hexdigest())
    return json.loads(json.dumps(identity, sort_keys=True))  # as a checkpoint holds it


IDENTITY_EXTRAS = ("arithmetic", "shuffle", "num_train", "train_data_blake2b")  # not options


def check_identity(folder: str, saved: dict, mine: dict) -> None:
    """ValueError naming the first field (sorted by name) in which a checkpoint's run
    differs from this one: an option as --name, else arithmetic, shuffle, num_train
    or train_data_blake2b."""
    for name in sorted(set(saved) | set(mine)):
        theirs = saved.get(name)
        if theirs != mine.get(name):
            field = name if name in IDENTITY_EXTRAS else f"--{name.replace('_', '-')}"
            if name == "arithmetic":
                fix = f"pass --normalize {theirs}"
            elif name in ("num_train", "train_data_blake2b", "shuffle"):
                fix = "train on the checkpoint's data"
            elif theirs is None or theirs is False:
                fix = f"leave {field} out"
            elif theirs is True:
                fix = f"pass {field}"
            elif isinstance(theirs, list):
                fix = f"pass {field} {','.join(map(str, theirs))}"
            else:
                fix = f"pass {field} {theirs}"
            raise ValueError(f"--resume-from {folder}: the checkpoint was taken with {field}="
                             f"{theirs!r}, this run has {field}={mine.get(name)!r} ({fix}); a "
                             f"checkpoint resumes only its own run (same dataset and data, seed, "
                             f"--last-batch, arithmetic, strategies, optimizer, matmul precision)")


def write_checkpoint(folder: str, doc: dict, arrays: dict) -> str:
    """Writes ``doc`` (JSON) and ``arrays`` (.npz) into ``folder`` so that a reader
    never sees half a checkpoint: the arrays go to a new file (written, flushed,
    fsynced, then renamed into place), and ``checkpoint.json``, which names that file
    and its SHA-256, is replaced last, atomically (os.replace of a fsynced file,
    then the folder is fsynced). Arrays files no longer named are removed after.
    Returns the path of checkpoint.json."""
    import hashlib
    import numpy as np

    os.makedirs(folder, exist_ok=True)
    name = f"arrays-step{doc['run_step']}-{os.getpid()}-{time.time_ns()}.npz"
    partial = os.path.join(folder, f".{name}.partial")
    with open(partial, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    with open(partial, "rb") as f:
        sha = hashlib.file_digest(f, "sha256").hexdigest()
    os.replace(partial, os.path.join(folder, name))
    doc = dict(doc, arrays_file=name, arrays_sha256=sha)
    path = os.path.join(folder, CHECKPOINT_FILE)
    with open(path + ".partial", "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".partial", path)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    for old in os.listdir(folder):
        if old.startswith("arrays-") and old.endswith(".npz") and old != name:
            os.remove(os.path.join(folder, old))
    return path


def read_checkpoint(folder: str) -> tuple[dict, dict]:
    """(the document, the arrays) of the checkpoint in ``folder``. ValueError, naming
    the file, for a document of another format, an arrays file missing or not the
    one checkpoint.json names (SHA-256), or a loader state loaders refuses."""
    import hashlib
    import numpy as np
    import loaders

    path = os.path.join(folder, CHECKPOINT_FILE)
    try:
        with open(path) as f:
            doc = json.load(f)
    except json.JSONDecodeError as error:
        raise ValueError(f"--resume-from {folder}: {path} is not JSON ({error})") from None
    if not isinstance(doc, dict) or doc.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"--resume-from {folder}: {path} is not a {CHECKPOINT_FORMAT} checkpoint "
                         f"(format {doc.get('format') if isinstance(doc, dict) else None!r})")
    arrays_path = os.path.join(folder, doc["arrays_file"])
    try:
        with open(arrays_path, "rb") as f:
            sha = hashlib.file_digest(f, "sha256").hexdigest()
            if sha != doc["arrays_sha256"]:
                raise ValueError(f"--resume-from {folder}: {arrays_path} has SHA-256 {sha}, but "
                                 f"{CHECKPOINT_FILE} names {doc['arrays_sha256']}: not this checkpoint's")
            f.seek(0)
            with np.load(f) as npz:
                arrays = {key: npz[key] for key in npz.files}
    except FileNotFoundError:
        raise ValueError(f"--resume-from {folder}: {arrays_path}, which {CHECKPOINT_FILE} names, is "
                         f"missing") from None
    try:
        doc["loader_state"] = loaders.LoaderState.from_json(json.dumps(doc["loader_state"]))
    except ValueError as error:
        raise ValueError(f"--resume-from {folder}: {path}: {error}") from None
    return doc, arrays


def fingerprint_rows(rows, labels) -> "np.ndarray":
    """One uint64 per row: the 8-byte BLAKE2b digest (digest_size=8), read as a
    little-endian integer, of the row's float32 bytes (C order) followed by its
    label's int32 bytes. Two different (row, label) pairs collide with
    probability about 2**-64."""
    import hashlib
    import numpy as np

    rows = np.ascontiguousarray(rows, np.float32).reshape(len(rows), -1)
    labels = np.asarray(labels).astype(np.int32).reshape(-1)
    return np.array([int.from_bytes(hashlib.blake2b(row.tobytes() + label.tobytes(), digest_size=8)
                                    .digest(), "little") for row, label in zip(rows, labels)], np.uint64)


class Deliveries:
    """Counts which samples an epoch delivered, from the delivered rows themselves.

    Each sample of the training data is known by ``fingerprint_rows`` of the row the
    loader should deliver for it (``normalize``d on the host: the same bits every
    placement and every backend in plan order deliver, loaders.Normalize's
    guarantee) and its label. ``count(batch)`` adds, for each real (mask True) slot
    of this process's blocks, one to the slot's sample class, or to "unknown" when
    the row is no sample of the data. Identical samples form one class whose
    expected count is their multiplicity. ``vector`` (int64, classes + 1, unknown
    last) is what processes add up (``combined``) and a checkpoint saves."""

    def __init__(self, train_data, normalize, chunk: int = 1024):
        import numpy as np

        images, labels = train_data
        prints = np.concatenate([fingerprint_rows(normalize(images[lo:lo + chunk]), labels[lo:lo + chunk])
                                 for lo in range(0, len(labels), chunk)])
        self.keys, self.expected = np.unique(prints, return_counts=True)

    def zeros(self) -> "np.ndarray":
        import numpy as np
        return np.zeros(len(self.keys) + 1, np.int64)

    def count(self, batch: dict, vector) -> None:
        import numpy as np

        images = {shard.device: shard.data for shard in batch["images"].addressable_shards}
        labels = {shard.device: shard.data for shard in batch["labels"].addressable_shards}
        for shard in batch["mask"].addressable_shards:
            real = np.asarray(shard.data).reshape(-1)
            if not real.any():
                continue
            rows = np.asarray(images[shard.device]).reshape(real.size, -1)[real]
            prints = fingerprint_rows(rows, np.asarray(labels[shard.device]).reshape(real.size)[real])
            where = np.minimum(np.searchsorted(self.keys, prints), len(self.keys) - 1)
            known = self.keys[where] == prints
            np.add.at(vector, where[known], 1)
            vector[-1] += int(np.count_nonzero(~known))

    @staticmethod
    def combined(vector) -> "np.ndarray":
        """``vector`` summed over every process (a collective: every process calls it)."""
        import numpy as np
        import jax

        if jax.process_count() == 1:
            return vector
        from jax.experimental import multihost_utils
        gathered = multihost_utils.process_allgather(np.asarray(vector, np.int32))
        return np.asarray(gathered, np.int64).sum(axis=0)

    def verdict(self, vector, last_batch: str, skipped: int) -> tuple[bool, str]:
        """(whether the epoch's deliveries keep the plan's promise, in words): fill,
        every sample in exactly one real slot; drop, none twice and exactly
        ``skipped`` (elastic_plan's stated count) never; for both, no real row that
        is no sample of the data."""
        import numpy as np

        seen, unknown = vector[:-1], int(vector[-1])
        extra = np.maximum(seen - self.expected, 0)
        missing = int(np.maximum(self.expected - seen, 0).sum())
        total = int(self.expected.sum())
        problems = []
        if extra.any():
            problems.append(f"{int(np.count_nonzero(extra))} sample(s) delivered more than once "
                            f"({int(extra.sum())} extra real slot(s))")
        if missing != skipped:
            problems.append(f"{missing} sample(s) never delivered"
                            + (f", where elastic_plan states {skipped} skipped for drop" if last_batch == "drop" else ""))
        if unknown:
            problems.append(f"{unknown} real row(s) that are no sample of the data")
        if problems:
            return False, "NOT exactly once: " + "; ".join(problems)
        if last_batch == "fill":
            return True, f"every one of the {total} samples delivered in exactly one real slot"
        return True, (f"each sample at most once: {total - skipped} of {total} delivered, {skipped} "
                      f"skipped, as elastic_plan states for drop")


class Elastic:
    """The training loop's position across --stop-after-step and --resume-from.

    Run steps: the steps of every epoch in order, from epoch 1's first; each
    strategy trains the same run steps. With --stop-after-step S, every strategy
    stops after run step S (within epoch e at global step s of that epoch), and
    one checkpoint is written: each strategy's params and optimizer state, the
    loader state (loaders.LoaderState: epoch e, step s, its shard segments; at
    the end of an epoch, step 0 of the next), that epoch's losses so far, and the
    delivered-sample counts (``Deliveries``) of that epoch so far, summed over the
    processes. With --resume-from, every strategy restarts from its params and
    optimizer state, epoch e runs its remaining steps on this run's shards (every
    backend's ``epoch(e, state=...)``, i.e. loaders.elastic_plan's order: the
    reference loader, and DALI and rocAL, which read that order, order="plan"),
    the later epochs are fresh plans, and when epoch e ends the report says,
    from the delivered rows of both runs, whether every sample was delivered
    exactly once across the change (drop: at most once, elastic_plan's count
    skipped). A run can be resumed and stopped again (a chain of changes).
    """

    def __init__(self, args, *, mesh, train_data, normalize, arithmetic: str, backend: str,
                 loaders_by_layout: dict, where: str, say):
        import loaders

        self.say = say
        self.where = where
        self.folder = args.checkpoint_dir
        self.last_batch = args.last_batch
        self.identity = run_identity(args, train_data, arithmetic)
        self.num_samples = len(train_data[1])
        n, B = mesh.devices.size, args.batch_size
        self.shards, self.seed = (n, B), args.seed
        steps = loaders.num_steps(self.num_samples, n, B, args.last_batch)
        self.saved, self.arrays = None, {}
        self.first_epoch, done = 0, 0
        first_span = None
        self.resumed = None  # the interrupted epoch's state, resized to this run's shards
        if args.resume_from:
            self.saved, self.arrays = read_checkpoint(args.resume_from)
            check_identity(args.resume_from, self.saved["run"], self.identity)
            state = self.saved["loader_state"]
            self.first_epoch, done = state.epoch, self.saved["run_step"]
            self.resumed = state.resized(n, B)
            first_span = (self.resumed.step, self.resumed.num_steps)
            needed = state.epoch + (1 if state.step else 0)
            if args.epochs < needed:
                raise ValueError(f"--epochs {args.epochs}: the checkpoint in {args.resume_from} is "
                                 f"in epoch {state.epoch + 1}; give --epochs {needed} or more")
            if len(self.resumed.segments) > 1:
                for loader in loaders_by_layout.values():
                    if "state" not in inspect.signature(loader.epoch).parameters:
                        raise ValueError(
                            f"--backend {backend}: its loader cannot yet resume an epoch on another "
                            f"shard count or batch size (its epoch() takes no loader state): resume "
                            f"on the checkpoint's {state.segments[-1].num_shards} device(s) x "
                            f"{state.segments[-1].batch_size}, or with --backend reference")
            self.say(f"resuming {args.resume_from}: run step {done}, epoch {state.epoch + 1} at step "
                     f"{state.step} (written on {self.saved['where']}); this run: {where}: "
                     f"{first_span[1] - first_span[0]} more step(s) in epoch {state.epoch + 1}"
                     + (f" (loaders.elastic_plan, segments {[tuple(x) for x in self.resumed.segments]})"
                        if len(self.resumed.segments) > 1 else ""))
        # The epochs this run trains, each as (first, stop) global steps of the epoch.
        self.spans = {}
        run_step = done
        for epoch in range(self.first_epoch, args.epochs):
            lo, hi = first_span if epoch == self.first_epoch and first_span else (0, steps)
            self.spans[epoch] = (lo, hi)
            run_step += hi - lo
        total = run_step
        self.stop = None  # (epoch, global step of it)
        if args.stop_after_step is not None:
            if args.stop_after_step <= done:
                raise ValueError(f"--stop-after-step {args.stop_after_step}: the checkpoint is already "
                                 f"at run step {done}")
            if args.stop_after_step > total:
                raise ValueError(f"--stop-after-step {args.stop_after_step}: this run has only {total} "
                                 f"run steps (through epoch {args.epochs}); raise --epochs or lower it")
            run_step = done
            for epoch, (lo, hi) in self.spans.items():
                if args.stop_after_step <= run_step + hi - lo:
                    self.stop = (epoch, lo + args.stop_after_step - run_step)
                    self.spans = {e: span for e, span in self.spans.items() if e <= epoch}
                    self.spans[epoch] = (lo, self.stop[1])
                    break
                run_step += hi - lo
        self.steps_trained = done + sum(hi - lo for lo, hi in self.spans.values())
        self.counted = set()  # epochs whose deliveries are counted: interrupted, resumed
        if self.resumed is not None and self.resumed.step > 0:
            self.counted.add(self.first_epoch)
        if self.stop is not None:
            self.counted.add(self.stop[0])
        self.deliveries = Deliveries(train_data, normalize) if self.counted else None
        self.vectors, self.kept, self.failures, self.runs = {}, {}, [], {}
        self.device_counts = sorted(set(self.saved.get("device_counts", []) if self.saved else []) | {n})

    def epochs(self) -> range:
        return range(self.first_epoch, max(self.spans, default=self.first_epoch - 1) + 1)

    def start(self, name: str, params0, optimizer):
        """(params, optimizer state) this strategy starts from: the checkpoint's, else
        (params0, None). The checkpoint's leaves must have params0's and
        optimizer.init(params0)'s structure, shapes and dtypes."""
        import numpy as np
        import jax

        if self.saved is None:
            return params0, None
        restored = []
        for kind, template in (("params", params0), ("opt_state", optimizer.init(params0))):
            leaves, tree = jax.tree.flatten(template)
            got = []
            for i, leaf in enumerate(leaves):
                key = f"{kind}/{name}/{i}"
                value = self.arrays.get(key)
                leaf = np.asarray(leaf)
                if value is None or value.shape != leaf.shape or value.dtype != leaf.dtype:
                    raise ValueError(f"--resume-from: the checkpoint's {key} is "
                                     f"{'missing' if value is None else f'{value.dtype} {value.shape}'}; "
                                     f"this run's is {leaf.dtype} {leaf.shape}")
                got.append(value)
            restored.append(jax.tree.unflatten(tree, got))
        return tuple(restored)

    def batches(self, name: str, loader, epoch: int):
        """(the batches this run trains in ``epoch``, how many): the resumed epoch's rest
        (``resumed_epoch``) or a fresh epoch, cut at the stop, counted where the epoch
        is interrupted or resumed."""
        lo, hi = self.spans[epoch]
        if self.resumed is not None and epoch == self.first_epoch:
            batches = resumed_epoch(loader, epoch, self.saved["loader_state"], *self.shards)
        else:
            batches = loader.epoch(epoch)
        batches = taken(batches, hi - lo)
        if epoch in self.counted:
            vector = self.vectors.setdefault((name, epoch), self.deliveries.zeros())
            batches = counted(batches, self.deliveries, vector)
        return batches, hi - lo

    def epoch_done(self, name: str, epoch: int, params, opt_state, losses, real: int):
        """(real samples this run delivered in the epoch, the epoch's losses including
        the checkpoint's, a note for the epoch line, report lines). Every process
        calls it: the counts are summed across them."""
        import numpy as np
        import loaders

        lo, hi = self.spans[epoch]
        state = self.epoch_state(epoch)
        note, lines = "", []
        if self.resumed is not None and epoch == self.first_epoch:
            losses = np.concatenate([self.arrays.get(f"losses/{name}", np.zeros(0, np.float32)), losses])
            note = f"  (steps {lo + 1}-{hi} of {state.num_steps}: resumed)"
        if self.stop is not None and epoch == self.stop[0]:
            note += f"  (stopped after step {hi} of {state.num_steps})"
            self.kept[name] = (params, opt_state, losses)
        if epoch not in self.counted:
            return real, losses, note, lines
        here = Deliveries.combined(self.vectors[(name, epoch)])
        total = here.copy()
        if self.resumed is not None and epoch == self.first_epoch:
            total += self.arrays.get(f"delivered/{name}", 0)
        self.vectors[(name, epoch)] = total
        real = int(here[:-1].sum())
        if hi == state.num_steps:  # the epoch is complete: the promise can be checked
            end = loaders.elastic_num_steps(self.num_samples, state.segments, self.last_batch)
            skipped = 0 if self.last_batch == "fill" else len(loaders.remaining_samples(
                self.num_samples, state.segments, end, epoch=epoch, seed=self.seed, shuffle=True,
                last_batch=self.last_batch))
            ok, said = self.deliveries.verdict(total, self.last_batch, skipped)
            runs = "; ".join(f"steps {run['steps']} on {run['where']}: {run['delivered']}"
                             for run in self.epoch_runs(epoch, name, real))
            lines.append(f"{name} epoch {epoch + 1}: {said}, counted from the delivered rows "
                         f"(real slots by run: {runs})")
        else:
            extra = np.maximum(total[:-1] - self.deliveries.expected, 0)
            ok = not extra.any() and not total[-1]
            lines.append(f"{name} epoch {epoch + 1} so far, counted from the delivered rows: "
                         f"{int(total[:-1].sum())} real slot(s), {int(np.count_nonzero(extra))} "
                         f"sample(s) more than once, {int(total[-1])} row(s) that are no sample")
        if not ok:
            self.failures.append(lines[-1])
        self.runs[name] = self.epoch_runs(epoch, name, real)
        return real, losses, note, lines

    def epoch_state(self, epoch: int):
        """The loaders.LoaderState of ``epoch`` at the end of what this run trains."""
        import loaders

        lo, hi = self.spans[epoch]
        if self.resumed is not None and epoch == self.first_epoch:
            return self.resumed.at_step(hi)
        return loaders.LoaderState.start(self.num_samples, *self.shards, epoch=epoch, seed=self.seed,
                                         shuffle=True, last_batch=self.last_batch).at_step(hi)

    def state_at_stop(self):
        """The loader state the checkpoint holds: at the stop, or at step 0 of the next
        epoch when the stop is at the end of one (the same position)."""
        state = self.epoch_state(self.stop[0])
        return state.next_epoch() if state.step == state.num_steps else state

    def epoch_runs(self, epoch: int, name: str, delivered: int) -> list[dict]:
        """The runs that delivered ``epoch`` for strategy ``name``, this one last with
        ``delivered`` real slots: [{"steps": "first-last" (1-based), "where", "delivered"}]."""
        lo, hi = self.spans[epoch]
        runs = []
        if self.resumed is not None and epoch == self.first_epoch:
            runs = list(self.saved.get("epoch_runs", {}).get(name, []))
        return runs + [{"steps": f"{lo + 1}-{hi}", "where": self.where, "delivered": delivered}]

    def bound_over_runs(self, bound: Callable, num_devices: int) -> Callable:
        """``bound`` (ulps a step, strategies.ulp_bound's signature) as the largest over
        the device counts of this run and of the runs it resumes."""
        counts = sorted(set(self.device_counts) | {num_devices})
        return lambda a, b, platform, _: max(bound(a, b, platform, n) for n in counts)

    def checkpoint(self) -> None:
        """After every strategy, when the run stopped: process 0 writes the checkpoint."""
        import numpy as np
        import jax

        if self.stop is not None:
            state = self.state_at_stop()
            epoch, hi = self.stop
            if jax.process_index() == 0:
                arrays = {}
                for name, (params, opt_state, losses) in self.kept.items():
                    for kind, tree in (("params", params), ("opt_state", opt_state)):
                        for i, leaf in enumerate(jax.tree.leaves(tree)):
                            arrays[f"{kind}/{name}/{i}"] = np.asarray(leaf)
                    if state.epoch == epoch:  # an epoch to finish: its losses and deliveries so far
                        arrays[f"losses/{name}"] = np.asarray(losses, np.float32)
                        arrays[f"delivered/{name}"] = self.vectors[(name, epoch)]
                doc = {"format": CHECKPOINT_FORMAT, "run": self.identity,
                       "run_step": self.steps_trained, "where": self.where,
                       "loader_state": json.loads(state.to_json()),
                       "epoch_runs": self.runs if state.epoch == epoch else {},
                       "strategies": sorted(self.kept),
                       "device_counts": self.device_counts}
                path = write_checkpoint(self.folder, doc, arrays)
                self.say(f"stopped after run step {self.steps_trained} (epoch {epoch + 1}, step {hi}); "
                         f"checkpoint {path} (params, optimizer state, loader state {state.to_json()}); "
                         f"resume on any device or process count with --resume-from {self.folder}")

    def failed(self) -> list[str]:
        """The report lines of broken exactly-once promises, after a FAILED line that
        says so (process 0 prints it, after the bounds' report: said last)."""
        if self.failures:
            self.say(f"refimpl.py: FAILED: {len(self.failures)} epoch(s) did not deliver every sample "
                     f"as the plan promises (above); exit status {OUTSIDE_BOUND}")
        return list(self.failures)


def resumed_epoch(loader, epoch: int, state, num_shards: int, batch_size: int):
    """``loader``'s iterator over the rest of ``epoch`` from a saved loader state, on
    ``num_shards`` shards of ``batch_size``: ``epoch(e, state=state)`` where the
    loader takes a state (the reference, DALI, rocAL), else ``epoch(e, start_step=state.step)``
    if the shards are the checkpoint's, else ValueError (the loader cannot)."""
    if "state" in inspect.signature(loader.epoch).parameters:
        return loader.epoch(epoch, state=state)
    resized = state.resized(num_shards, batch_size)
    if len(resized.segments) > 1:
        raise ValueError(f"{type(loader).__name__}.epoch takes no loader state: it cannot resume "
                         f"epoch {epoch + 1} on another shard count or batch size")
    return loader.epoch(epoch, start_step=resized.step)


def taken(batches, count: int):
    """The first ``count`` items of ``batches``; the iterator is closed after them
    (a loader's prefetch thread or pipelines stop there)."""
    iterator = iter(batches)
    try:
        for _ in range(count):
            try:
                item = next(iterator)
            except StopIteration:
                return
            yield item
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


def counted(batches, deliveries: Deliveries, vector):
    """``batches``, each counted into ``vector`` (Deliveries.count) before it is
    yielded; closing this closes ``batches``."""
    iterator = iter(batches)
    try:
        for batch in iterator:
            deliveries.count(batch, vector)
            yield batch
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


def connect(args: argparse.Namespace) -> None:
    """jax.distributed.initialize with bounded waits: a missing peer fails the start
    after --peer-timeout seconds, a peer that dies later is detected by heartbeat.
    A coordinator on a loopback address binds only that address.

    JAX's runtime ends the process itself in both cases (a C++ abort, SIGABRT,
    not a Python exception), so the line printed first is what names the process
    and the wait in the log."""
    import jax

    who = f"process {args.process_id} of {args.num_processes}" if args.num_processes else "this process"
    if args.auto_distributed:
        where = "(auto-detected)"
    else:
        where = args.coordinator
    print(f"refimpl.py: {who}: joining coordinator {where}; if a peer has not joined within "
          f"{args.peer_timeout} s, or stops answering for that long, JAX ends this process",
          file=sys.stderr, flush=True)
    if os.environ.get(LOCAL_CHILD) == "1":
        hide_native_stdout()
    host = (args.coordinator or "").rsplit(":", 1)[0]
    bind = args.coordinator if host in ("127.0.0.1", "localhost", "[::1]") else None
    try:
        jax.distributed.initialize(
            coordinator_address=args.coordinator, num_processes=args.num_processes,
            process_id=args.process_id, initialization_timeout=args.peer_timeout,
            heartbeat_timeout_seconds=args.peer_timeout, coordinator_bind_address=bind)
    except Exception as error:  # JAX raises several types here; one clear line is the point
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if args.auto_distributed and "coordinator_address" in first:
            raise ConnectionError(
                "--auto-distributed: no cluster was detected (jax.distributed looks for Slurm, "
                "Open MPI, Kubernetes and cloud TPU environments); on other machines give "
                "--coordinator, --num-processes and --process-id, or use --local-processes N "
                "on one machine") from error
        raise ConnectionError(f"{who}: could not join the other processes at coordinator "
                              f"{where} within {args.peer_timeout} s: {first}") from error


OUTSIDE_BOUND = 1  # exit status: final params outside the documented bound (2: bad input)
LOCAL_CHILD = "REFIMPL_LOCAL_CHILD"  # set by launch_local in the processes it starts


def hide_native_stdout() -> None:
    """Python's prints keep going to stdout; what native code writes to file
    descriptor 1 (gloo's "[Gloo] Rank N is connected to M peer ranks" notes,
    several threads at once, so interleaved mid-line) goes to /dev/null."""
    sys.stdout.flush()
    python_stdout = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    sys.stdout = os.fdopen(python_stdout, "w", buffering=1)


def launch_local(args: argparse.Namespace, argv: list[str]) -> int:
    """Runs this program in ``--local-processes`` processes on 127.0.0.1 and waits.

    Every child runs on CPU devices (JAX_PLATFORMS=cpu: several processes must
    not share one accelerator) in its own process group, which is killed
    whatever happens. Process 0's output is shown, without the collective
    library's "[Gloo] Rank ... connected" chatter; the others' only on error.
    If any process fails, the rest are stopped and its exit status is returned."""
    import socket

    count = args.local_processes
    per_process = (args.devices or DEFAULT_CPU_DEVICES) // count
    data_dir = args.data_dir or synthetic_dataset(args.cache_dir, args.dataset, args.seed)  # once, not racing
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = [sys.executable, os.path.abspath(__file__),
            *strip_options(argv, ("--local-processes", "--devices", "--data-dir", "--platform")),
            "--data-dir", data_dir, "--devices", str(per_process), "--num-processes", str(count),
            "--coordinator", f"127.0.0.1:{port}"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **{LOCAL_CHILD: "1"})
    children, errors = [], []
    try:
        for i in range(count):
            log = tempfile.TemporaryFile("w+")
            child = subprocess.Popen(base + ["--process-id", str(i)], env=env, start_new_session=True,
                                     stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL,
                                     stderr=subprocess.PIPE if i == 0 else log, text=True)
            children.append(child)
            errors.append(log)
        forwards = [threading.Thread(target=forward, args=(stream, target), daemon=True)
                    for stream, target in ((children[0].stdout, sys.stdout), (children[0].stderr, sys.stderr))]
        for thread in forwards:
            thread.start()
        while True:
            codes = [child.poll() for child in children]
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed == [0] and codes[0] == OUTSIDE_BOUND:
                for thread in forwards:
                    thread.join()  # process 0 has said why, last; nothing to add after it
                return OUTSIDE_BOUND
            if failed:
                i = failed[0]
                how = (f"exited with status {codes[i]}" if codes[i] > 0
                       else f"was killed by signal {signal.Signals(-codes[i]).name}")
                if i:
                    errors[i].seek(0)
                    tail = [l for l in map(without_gloo_chatter, errors[i].read().splitlines())
                            if l.strip()][-5:]
                    print("\n".join(tail), file=sys.stderr)
                print(f"refimpl.py: error: local process {i} {how}; stopping the others",
                      file=sys.stderr)
                return codes[i] if codes[i] > 0 else 1
            if all(code == 0 for code in codes):
                for thread in forwards:
                    thread.join()  # the streams end when process 0 has exited
                return 0
            time.sleep(0.1)
    finally:
        for child in children:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.wait()
        for log in errors:
            log.close()


GLOO_CHATTER = re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
                          r"Expected number of connected peer ranks is : \d+")


def without_gloo_chatter(line: str) -> str:
    """``line`` without the collective library's "[Gloo] Rank N is connected" notes
    (written by C++ to the same stream, so one can land inside another line)."""
    return GLOO_CHATTER.sub("", line)


def forward(stream, target) -> None:
    """Copies a child's output to ours, without the collective library's connection notes."""
    for line in stream:
        line = without_gloo_chatter(line)
        if line.strip():
            target.write(line if line.endswith("\n") else line + "\n")
            target.flush()


def strip_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` without the given options and their values (``--x v`` or ``--x=v``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not any(arg.startswith(name + "=") for name in names):
            out.append(arg)
    return out


def report_differences(final: dict, steps: int, platform: str, num_devices: int,
                       bound: Callable[[str, str, str, int], int],
                       bound_name: str = "strategies.ulp_bound", growth=None,
                       no_growth: str | None = None) -> list[str]:
    """Prints how far each strategy's final params are from the first's and the verdict
    (strategies.verdict: ``bound(a, b, platform, num_devices)`` roundings a step, the
    signature of strategies.ulp_bound, times ``growth``, twin_growth over the same
    ``steps``), and returns the lines of the pairs OUTSIDE their bound.

    Order: identical and within first, then "outside the domain where a bound is
    derived", then OUTSIDE, then one FAILED line if any pair is OUTSIDE, so the last
    thing a user reads is the failure. ``no_growth``: why no growth could be measured
    (a training that spans runs): a pair further apart than count x ``steps`` is then
    "outside the domain" for that reason. Raises ValueError (strategies.verdict) if a
    pair with a count above 0 differs and ``growth`` is None, or if ``growth`` was
    measured over another number of steps."""
    import numpy as np
    import jax
    import strategies

    names = list(final)
    lines = {"identical": [], "within": [], "outside the domain": [], "OUTSIDE": []}
    for other in names[1:]:
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(jax.tree.leaves(final[names[0]]), jax.tree.leaves(final[other])))
        count = bound(names[0], other, platform, num_devices)
        if (no_growth and growth is None and count
                and (strategies.leaf_ulps(final[names[0]], final[other]) > count * steps).any()):
            ulps = float(strategies.leaf_ulps(final[names[0]], final[other]).max())
            found = strategies.Verdict("outside the domain", ulps, None,
                                       f"not bit-identical: {ulps:.1f} ulps after {steps} steps: outside "
                                       f"the domain where a bound is derived: {no_growth}; no verdict")
        else:
            found = strategies.verdict(final[names[0]], final[other], count, growth, steps, bound_name)
        lines[found.case].append(f"final params, {names[0]} vs {other}: max |difference| {diff:.3g}: "
                                 f"{found.text}")
    for line in lines["identical"] + lines["within"] + lines["outside the domain"] + lines["OUTSIDE"]:
        print(line)
    outside = lines["OUTSIDE"]
    if outside:
        print(f"refimpl.py: FAILED: {len(outside)} pair(s) of strategies ended OUTSIDE the documented "
              f"bound (above); exit status {OUTSIDE_BOUND}", flush=True)
    return outside


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    try:
        if args.local_processes:
            return launch_local(args, argv)
        _, outside = run(args)
        if outside:
            return OUTSIDE_BOUND
    except (ValueError, OSError, ImportError) as error:
        print(f"refimpl.py: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("refimpl.py: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
