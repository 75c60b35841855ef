"""The two notebooks as one program: sharded loaders, an MLP, data-parallel training.

    python refimpl.py           # synthetic CIFAR-10, sharded then pmap, 5 epochs
    python refimpl.py --help    # every option (docs/running.md: how to use them)

Each chosen strategy trains the notebooks' MLP from the same initial params on one sharded loader, printing per epoch
the mean loss, the accuracy over every test sample exactly once, the time and images/s. The verdicts: canonical, the
final params and optimizer state the same bits for every strategy and --compare-to; plain, the stepwise verdict over
STEPWISE_STEPS steps; across a checkpoint (IDENTITY, CARRIED, OWN below), every sample of its epoch exactly once (drop:
at most once). Exit status: 0; 1 when a verdict fails; 2 for bad input (one line on stderr, before any training).
A checkpoint (orbax) holds three items: "run" (the identity and the next run step, JSON), "loader" (the LoaderState
of that step, JSON) and "state" (each strategy's params, optimizer state and, mid-epoch, its delivery counts).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import hashlib
import importlib.util
import itertools
import json
import logging
import os
import random
import shutil
import socket
import sys
import tempfile
import time
import types

import numpy as np

from arithmetic import ARITHMETICS, Normalize
from cifar_mnist import TEST_PREFIX, TRAIN_PREFIX, read_cifar10, read_mnist, synthetic_cifar10, synthetic_mnist
from plan import LoaderState, remaining_samples
import processes

DEFAULT_CPU_DEVICES = 8
MAX_CPU_DEVICES = 64  # virtual CPU devices are threads on the same cores
SYNTHETIC = {"num_train": 2048, "num_test": 512}
STRATEGY_NAMES = ("sharded", "pmap", "shard_map", "single")
ONE_PROCESS = {"pmap": "pmap maps over one process's devices", "single": "single is one device"}
# Each notebook's (mean, std, arithmetic): rocAL's CIFAR-10 (x - 127.5) / 127.5, DALI's MNIST x / 255.
NOTEBOOK = {"cifar10": ((127.5,) * 3, (127.5,) * 3, "rocal"), "mnist": ((0.0,), (255.0,), "dali_cpu")}
STEPWISE_STEPS = 4  # the plain reduction's verdict: each strategy's first steps, from the same state
FAILED = 1  # exit status of a failed verdict (2: bad input)

# What a resume does with each option: IDENTITY from the checkpoint, CARRIED from it unless given, OWN never.
IDENTITY = ("dataset", "hidden", "strategies", "seed", "optimizer", "lr", "last_batch", "normalize",
            "matmul_precision", "reduction", "logical_shards")
CARRIED = ("epochs", "data_dir", "cache_dir", "backend", "eval_batch_size", "batch_size")
OWN = ("platform", "devices", "placement", "metrics_out", "params_out", "compare_to", "coordinator", "num_processes",
       "process_id", "auto_distributed", "local_processes", "peer_timeout", "stop_after_step", "checkpoint_dir",
       "resume_from")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    try:
        if args.local_processes:
            return launch_local(args, argv)
        return FAILED if run(args, given_options(argv)) else 0
    except (ValueError, OSError, ImportError) as error:
        print(f"refimpl.py: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("refimpl.py: interrupted", file=sys.stderr)
        return 130


# Options ------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    """The options, checked before JAX starts (argparse's exit status 2, naming the option)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def given_options(argv: list[str]) -> set[str]:
    """The options given on the command line (their dests), defaults aside."""
    parser, unset = build_parser(), object()
    namespace = argparse.Namespace(**{dest: unset for dest in vars(parser.parse_args([]))})
    return {dest for dest, value in vars(parser.parse_args(argv, namespace)).items() if value is not unset}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="refimpl.py", description="Data-parallel training of the rocAL/DALI notebooks' MLP (docs/running.md).",
        epilog=f"With no --data-dir a synthetic dataset is generated once into --cache-dir. With no accelerator JAX "
               f"gets {DEFAULT_CPU_DEVICES} virtual CPU devices sharing the cores: timings show overhead, not speedup.")
    add = parser.add_argument
    add("--dataset", choices=("cifar10", "mnist"), default="cifar10", help="rocAL's or DALI's (default: %(default)s)")
    add("--hidden", default="1024,1024", metavar="W[,W...]", help="the MLP's hidden widths (default: %(default)s)")
    add("--data-dir", metavar="DIR", help="a cifar-10-batches-bin folder, or for mnist the IDX files' folder")
    add("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "refimpl"), metavar="DIR",
        help="where synthetic data and DALI's per-sample files go (default: %(default)s)")
    add("--epochs", type=int, default=5, metavar="N", help="train epochs 0..N-1 (default: %(default)s)")
    add("--batch-size", type=int, default=16, metavar="B", help="per device or logical shard (default: %(default)s)")
    add("--eval-batch-size", type=int, default=256, metavar="B", help="the validation batch (default: %(default)s)")
    add("--lr", type=float, default=0.001, metavar="RATE", help="the learning rate (default: %(default)s)")
    add("--optimizer", choices=("sgd", "adam"), default="sgd", help="sgd or optax.adam (default: %(default)s)")
    add("--seed", type=int, default=0, metavar="N", help="shuffle and synthetic-data seed, 0 <= N < 2**32")
    add("--logical-shards", type=int, metavar="L",
        help="L logical shards of --batch-size rows a step: the same shards on any device count from 1 to L")
    add("--reduction", choices=("plain", "canonical"), default="plain",  # strategies.REDUCTIONS
        help="canonical: the same bits on any device count from 1 to --logical-shards (default: %(default)s)")
    add("--strategies", metavar="LIST",
        help=f"any of {', '.join(STRATEGY_NAMES)}, or all (default: sharded,pmap; sharded,shard_map across processes)")
    add("--platform", choices=("cpu", "gpu", "cuda", "rocm", "tpu"), help="the JAX platform (default: JAX's)")
    add("--devices", type=int, metavar="N", help=f"the first N devices (CPU: N virtual, at most {MAX_CPU_DEVICES})")
    add("--last-batch", choices=("fill", "drop"), default="fill",
        help="fill: pad the last batch and mask the padding; drop: skip the remainder (default: %(default)s)")
    add("--backend", choices=("reference", "rocal", "dali", "auto"), default="reference",
        help="the training loader; auto: rocal on AMD GPUs, dali on NVIDIA GPUs (default: %(default)s)")
    add("--placement", choices=("auto", "host", "device"), default="auto",
        help="the reference loader's rows from the host or the devices; auto: device if it fits (default: %(default)s)")
    add("--normalize", choices=ARITHMETICS, help="whose arithmetic (default: the backend's, else the notebook's)")
    add("--matmul-precision", choices=("default", "high", "highest"), default="highest",
        help="JAX's float32 matmul precision; 'default' is TF32 on recent NVIDIA GPUs (default: %(default)s)")
    add("--metrics-out", metavar="FILE", help="every per-epoch figure as JSON lines")
    add("--params-out", metavar="FILE", help="each strategy's final params and optimizer state as .npz")
    add("--compare-to", metavar="FILE", help="another run's --params-out, bit for bit (a failure if canonical)")
    add = parser.add_argument_group("more than one process (jax.distributed)",
                                    "Only process 0 prints. Strategies: sharded, shard_map.").add_argument
    add("--coordinator", metavar="HOST:PORT", help="process 0's address, reachable by all")
    add("--num-processes", type=int, metavar="N", help="how many processes take part")
    add("--process-id", type=int, metavar="I", help="this process's index, 0..N-1")
    add("--auto-distributed", action="store_true", help="let jax.distributed.initialize() detect the cluster")
    add("--local-processes", type=int, metavar="N", help="launch N processes here on CPU devices, splitting --devices")
    add("--peer-timeout", type=int, default=60, metavar="SECONDS", help="for a silent peer (default: %(default)s)")
    add = parser.add_argument_group("checkpoint and resume", "Resume on any device or process count.").add_argument
    add("--stop-after-step", type=int, metavar="S", help="train run steps 0..S-1, checkpoint and stop")
    add("--checkpoint-dir", metavar="DIR", help="where --stop-after-step writes the checkpoint")
    add("--resume-from", metavar="DIR", help="continue the run checkpointed in DIR")
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse cannot check alone; ``parser.error`` (exit status 2) naming the option."""
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
        parser.error(f"--hidden {text!r}: give the hidden layers' widths as positive integers separated "
                     f"by commas, e.g. 1024,1024")
    for flag in ("epochs", "batch_size", "eval_batch_size", "devices", "peer_timeout", "logical_shards",
                 "stop_after_step", "local_processes"):
        if (value := getattr(args, flag)) is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if not 0 <= args.seed < 2**32:
        parser.error(f"--seed must be in [0, 2**32), got {args.seed}")
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    each = args.devices // args.local_processes if args.devices and args.local_processes else args.devices
    if each and each > MAX_CPU_DEVICES and (args.platform == "cpu" or args.local_processes):
        parser.error(f"--devices {args.devices}: at most {MAX_CPU_DEVICES} virtual CPU devices"
                     + (f" per process, not {each}" if args.local_processes else ""))
    for flag in ("metrics_out", "params_out"):
        if (path := getattr(args, flag)) and (problem := unwritable(path)):
            parser.error(f"--{flag.replace('_', '-')} {path}: {problem}")
    if args.compare_to and not os.path.isfile(args.compare_to):
        parser.error(f"--compare-to {args.compare_to}: no such file (give another run's --params-out)")
    if args.compare_to and (problem := not_npz(args.compare_to)):
        parser.error(f"--compare-to {args.compare_to}: not a .npz written by --params-out ({problem})")
    if args.reduction == "canonical" and args.logical_shards is None and not args.resume_from:
        parser.error("--reduction canonical needs --logical-shards L: its bits are the same on every device "
                     "count from 1 to L (one shard per device would make them follow the device count)")
    if (args.stop_after_step is None) != (args.checkpoint_dir is None):
        parser.error("--stop-after-step and --checkpoint-dir go together")
    if args.checkpoint_dir:
        folder = os.path.abspath(args.checkpoint_dir)
        parent = folder if os.path.isdir(folder) else os.path.dirname(folder)
        if os.path.exists(folder) and not os.path.isdir(folder):
            parser.error(f"--checkpoint-dir {args.checkpoint_dir}: is a file, not a folder")
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            parser.error(f"--checkpoint-dir {args.checkpoint_dir}: {parent} is not a writable folder")
    if args.resume_from and not os.path.isfile(os.path.join(args.resume_from, "run", "metadata")):
        parser.error(f"--resume-from {args.resume_from}: not a checkpoint written by --stop-after-step")
    try:
        check_run(args, several)
    except ValueError as error:
        parser.error(str(error))
    explicit = [args.coordinator, args.num_processes, args.process_id]
    if any(v is not None for v in explicit) and any(v is None for v in explicit):
        parser.error("--coordinator, --num-processes and --process-id go together")
    if args.num_processes is not None and not 0 <= args.process_id < args.num_processes:
        parser.error(f"--process-id {args.process_id} is outside 0..{args.num_processes - 1}")
    if args.local_processes is not None:
        if args.coordinator or args.auto_distributed:
            parser.error("--local-processes N goes with no other multi-process option")
        if args.platform not in (None, "cpu"):
            parser.error(f"--local-processes runs on CPU devices; --platform {args.platform} cannot go with it")
        if (total := args.devices or DEFAULT_CPU_DEVICES) % args.local_processes:
            parser.error(f"--local-processes {args.local_processes} does not divide --devices {total}")


def check_run(args: argparse.Namespace, several, devices: int | None = None) -> None:
    """Checks made again once the checkpoint and the devices are known: ValueError naming the option (or checkpoint)."""
    source = (lambda name: f"--resume-from {args.resume_from}: the checkpoint's run has --{name} "
              if name.replace("-", "_") in getattr(args, "from_checkpoint", ()) else f"--{name} ")
    if args.dataset == "mnist" and args.backend == "rocal":
        raise ValueError(f"{source('backend')}rocal, which reads CIFAR-10 only; use --dataset cifar10 or "
                         f"--backend dali or reference for mnist")
    if args.backend in ("rocal", "dali") and args.placement != "auto":
        raise ValueError(f"--placement {args.placement}: only the reference backend has placements")
    vendor = {"rocal": ("rocal",), "dali": ("dali_cpu", "dali_gpu")}.get(args.backend)
    if vendor and args.normalize and args.normalize not in vendor:
        raise ValueError(f"{source('normalize')}{args.normalize}, but --backend {args.backend} computes "
                         f"{' or '.join(vendor)} arithmetic (by device kind)")
    if args.optimizer == "adam" and importlib.util.find_spec("optax") is None:
        raise ValueError("--optimizer adam: needs optax (python3 -m pip install -r requirements-peers.txt)")
    for flag in ("stop_after_step", "resume_from"):
        if getattr(args, flag) is not None and not _importable("orbax.checkpoint"):
            raise ValueError(f"--{flag.replace('_', '-')}: needs orbax-checkpoint, the checkpointer "
                             f"(python3 -m pip install -r requirements.txt)")
    unsupported = [s for s in args.strategies if s in ONE_PROCESS] if several else []
    if unsupported:
        raise ValueError(f"{source('strategies')}{','.join(unsupported)}: across processes only sharded and "
                         f"shard_map run ({'; '.join(ONE_PROCESS[s] for s in unsupported)})")
    devices = devices or known_device_count(args)
    if args.logical_shards is not None and devices is not None and args.logical_shards < devices:
        raise ValueError(f"{source('logical-shards')}{args.logical_shards}, fewer than {devices} device(s): a "
                         f"device holds whole logical shards, at least one; use at most {args.logical_shards} "
                         f"devices or another L")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def known_device_count(args: argparse.Namespace) -> int | None:
    """The run's device count where the options alone say it, else None (JAX's count)."""
    if args.local_processes:
        return args.devices or DEFAULT_CPU_DEVICES
    if args.devices and not (args.coordinator or args.auto_distributed):
        return args.devices
    if args.devices and args.num_processes and args.platform == "cpu":
        return args.devices * args.num_processes
    return None


def not_npz(path: str) -> str | None:
    """Why ``path`` is not a .npz file, or None."""
    try:
        npz = np.load(path)
    except (OSError, ValueError) as error:
        return str(error)
    if not hasattr(npz, "files"):
        return "a .npy array"
    npz.close()
    return None


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


# Starting JAX, one process or several -------------------------------------------------------------
def start_jax(args: argparse.Namespace) -> None:
    """JAX configured for this run, its processes joined; ValueError naming --platform when JAX cannot start it."""
    import jax

    if args.platform:
        jax.config.update("jax_platforms", args.platform)
    jax.config.update("jax_default_matmul_precision", args.matmul_precision)
    distributed = bool(args.coordinator or args.auto_distributed)
    cpu_devices = args.devices if args.devices and args.devices <= MAX_CPU_DEVICES else DEFAULT_CPU_DEVICES
    # Only before JAX first touches a device; after that (refimpl.main in a running job) the devices stand as they are.
    with contextlib.suppress(RuntimeError):
        jax.config.update("jax_num_cpu_devices", cpu_devices if distributed else max(cpu_devices, DEFAULT_CPU_DEVICES))
    if distributed:
        connect(args)
    try:
        jax.devices()
    except Exception as error:  # RuntimeError; JAX 0.10.2 raises a bare AssertionError
        said = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"--platform {args.platform or '(default)'}: JAX cannot start it here "
                         f"({said}); is its plugin installed (e.g. jax[cuda13], ROCm's jax wheels)?") from error


def connect(args: argparse.Namespace) -> None:
    """jax.distributed.initialize, each wait bounded by --peer-timeout; JAX ends the process on a lost peer (SIGABRT),
    so the line printed first names the process and the wait. --devices N: GPUs 0..N-1 (``local_device_ids``)."""
    import jax

    who = f"process {args.process_id} of {args.num_processes}" if args.num_processes else "this process"
    where = "(auto-detected)" if args.auto_distributed else args.coordinator
    print(f"refimpl.py: {who}: joining coordinator {where}; if a peer has not joined within {args.peer_timeout} s, "
          f"or stops answering for that long, JAX ends this process", file=sys.stderr, flush=True)
    if os.environ.get(processes.LOCAL_CHILD) == "1":
        processes.hide_native_stdout()
    if args.auto_distributed:
        # No socket, no cluster: give up before JAX asks a metadata server (a TPU host's detection waits 60 s).
        loopback_port("--auto-distributed")
    host = (args.coordinator or "").rsplit(":", 1)[0]
    bind = args.coordinator if host in ("127.0.0.1", "localhost", "[::1]") else None
    try:
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id, initialization_timeout=args.peer_timeout,
                                   heartbeat_timeout_seconds=args.peer_timeout, coordinator_bind_address=bind,
                                   local_device_ids=list(range(args.devices)) if args.devices else None)
    except Exception as error:  # JAX raises several types here; one clear line is the point
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if args.auto_distributed and "coordinator_address" in first:
            raise ConnectionError("--auto-distributed: no cluster was detected (jax.distributed looks for Slurm, "
                                  "Open MPI, Kubernetes and cloud TPU environments); give --coordinator, "
                                  "--num-processes and --process-id, or --local-processes N on one machine") from error
        raise ConnectionError(f"{who}: could not join the other processes at coordinator {where} within "
                              f"{args.peer_timeout} s: {first}") from error


def launch_local(args: argparse.Namespace, argv: list[str]) -> int:
    """Runs this program in ``--local-processes`` processes on 127.0.0.1, the synthetic data generated once first."""
    count = args.local_processes
    per_process = (args.devices or DEFAULT_CPU_DEVICES) // count
    data_dir = args.data_dir or (None if args.resume_from else
                                 synthetic_dataset(args.cache_dir, args.dataset, args.seed))
    port = loopback_port(f"--local-processes {count}")
    base = [sys.executable, os.path.abspath(__file__),
            *processes.strip_options(argv, ("--local-processes", "--devices", "--data-dir", "--platform")),
            *(["--data-dir", data_dir] if data_dir else []), "--devices", str(per_process),
            "--num-processes", str(count), "--coordinator", f"127.0.0.1:{port}"]
    return processes.run_local(base, count, passthrough=FAILED)


def loopback_port(flag: str) -> int:
    """A free TCP port on 127.0.0.1 for a coordinator, drawn at random from the 8,192 ports below the kernel's
    ephemeral range (ip_local_port_range; 32768 if unread). A port the kernel hands out itself (a bind to port 0, an
    outgoing connection's own end) could be taken by another socket between this probe and the coordinator's bind, and
    gRPC then fails to listen (JAX ended such a child with a segmentation fault); below that range only an explicit
    bind can take it. ConnectionError naming ``flag`` where no socket opens."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    ports = random.SystemRandom().sample(range(max(1024, low - 8192), low), 64) if low > 2048 else []
    error = None
    for port in [*ports, 0]:  # 0: the kernel's choice, where none of these is free
        try:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port))
                return probe.getsockname()[1]
        except OSError as failed:
            error = failed
    raise ConnectionError(f"{flag}: this machine cannot open a TCP socket ({error}), which several "
                          f"processes (jax.distributed) need; run one process instead") from None


# The run ------------------------------------------------------------------------------------------
class Job(types.SimpleNamespace):
    """What ``set_up`` resolved: devices, num_shards, mesh, say (process 0's print), backend,
    arithmetic, normalize, data_dir, train_data, test_loader, loaders (by layout), steps, where."""


def run(args: argparse.Namespace, given: set) -> list[str]:
    """Trains every chosen strategy and judges them; returns the report's failed lines."""
    import jax
    import model
    import strategies

    start_jax(args)
    saved = resume_options(args, given) if args.resume_from else None
    if saved is not None:  # the checkpoint's precision, which start_jax could not read yet
        jax.config.update("jax_default_matmul_precision", args.matmul_precision)
    job = set_up(args)
    params0 = model.init_model(((model.LAYERS if args.dataset == "cifar10" else model.MNIST_LAYERS)[0],
                                *args.hidden, model.LAYERS[-1]))
    optimizer = importlib.import_module("optax").adam(args.lr) if args.optimizer == "adam" else strategies.sgd(args.lr)
    span = Span(args, job, saved)
    metrics = open(args.metrics_out, "w") if args.metrics_out and jax.process_index() == 0 else None
    final, states, failures = {}, {}, []
    try:
        for name in args.strategies:
            final[name], states[name], lost = train_strategy(args, job, name, params0, optimizer, span, metrics)
            failures += lost
        if span.stop is not None:
            span.save(job, final, states)
        failures += verdicts(args, job, final, states, span, params0, optimizer)
    finally:
        if metrics:
            metrics.close()
        for loader in job.loaders.values():
            getattr(loader, "close", lambda: None)()
    if failures and jax.process_index() == 0:
        print(f"refimpl.py: FAILED: {len(failures)} verdict(s) above; exit status {FAILED}", flush=True)
    return failures


def set_up(args: argparse.Namespace) -> Job:
    """The devices, the data and the loaders of a run, and its first line printed."""
    import jax
    import loaders

    distributed = bool(args.coordinator or args.auto_distributed)
    job = Job(devices=jax.devices() if distributed else pick_devices(args.devices, args.platform))
    n = len(job.devices)
    check_run(args, distributed or jax.process_count() > 1, n)
    job.num_shards = args.logical_shards or n
    job.mesh = loaders.data_mesh(job.devices)
    job.say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    job.backend = choose_backend(args.backend, args.dataset, job.devices)
    if args.backend == "auto":
        job.say(f"--backend auto chose {job.backend}")
    job.arithmetic = choose_arithmetic(job.backend, args.normalize, args.dataset, job.devices)
    job.normalize = Normalize(*NOTEBOOK[args.dataset][:2], arithmetic=job.arithmetic)
    if job.backend == "rocal":
        import rocal_loader
        rocal_loader.import_rocal()  # how to install it, before any data is generated
    if job.backend == "dali":
        import dali_loader
        dali_loader.import_dali()
    job.data_dir = args.data_dir or synthetic_dataset(args.cache_dir, args.dataset, args.seed)
    try:
        if args.dataset == "mnist":
            job.train_data, test_data = read_mnist(job.data_dir, "train"), read_mnist(job.data_dir, "test")
        else:
            job.train_data, test_data = (read_cifar10(job.data_dir, prefix) for prefix in (TRAIN_PREFIX, TEST_PREFIX))
    except (ValueError, OSError) as error:
        if not args.data_dir:
            raise
        raise ValueError(f"--data-dir {args.data_dir}: {error}") from None
    # Validation on one device, the reference loader: fill with a mask counts every test sample once.
    first_local = job.mesh.devices.flat[loaders.local_positions(job.mesh)[0]]
    job.test_loader = loaders.make_loader(test_data, [first_local], min(args.eval_batch_size, len(test_data[1])),
                                          normalize=job.normalize)
    job.loaders, how = training_loaders(args, job)
    job.steps = len(next(iter(job.loaders.values())))
    procs = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    L, B = args.logical_shards, args.batch_size
    rows = f"{L} logical shards of {B}" if L else f"{n} x {B}"
    job.where = f"{n} {job.devices[0].platform} device(s){procs}, {rows} ({job.backend})"
    job.say(f"{n} {job.devices[0].platform} device(s){procs}; {args.dataset}: {len(job.train_data[1])} training "
            f"and {len(test_data[1])} test images from {job.data_dir}; {job.steps} steps of {rows} per epoch "
            f"({args.last_batch}); epochs 0-{args.epochs - 1}; {how}; {job.arithmetic}'s arithmetic; "
            f"matmul precision {args.matmul_precision}; {args.optimizer}; {args.reduction} reduction")
    return job


def pick_devices(requested: int | None, platform: str | None = None) -> list:
    """The first ``requested`` devices of ``platform`` (--platform), else of JAX's default backend."""
    import jax

    devices = jax.devices({"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)) if platform else jax.devices()
    if requested is not None and requested > len(devices):
        raise ValueError(f"--devices {requested}: only {len(devices)} {devices[0].platform} device(s) exist")
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
    return "dali" if dali_loader.usable(devices) else "reference"


def choose_arithmetic(backend: str, normalize: str | None, dataset: str, devices: list) -> str:
    """--normalize when given, else what the backend computes on ``devices``, else the notebook's."""
    if normalize:
        return normalize
    if backend == "dali":
        import dali_loader
        return dali_loader.arithmetic_for(devices)
    return "rocal" if backend == "rocal" else NOTEBOOK[dataset][2]


def synthetic_dataset(cache_dir: str, dataset: str, seed: int) -> str:
    """The synthetic dataset's folder, generated once (atomically) if missing."""
    folder = os.path.join(cache_dir, f"synthetic-{dataset}-{SYNTHETIC['num_train']}-{SYNTHETIC['num_test']}-seed{seed}")
    if os.path.isdir(folder):
        return folder
    os.makedirs(cache_dir, exist_ok=True)
    scratch = tempfile.mkdtemp(dir=cache_dir, prefix=".generating-")
    try:
        (synthetic_cifar10 if dataset == "cifar10" else synthetic_mnist)(scratch, seed=seed, **SYNTHETIC)
        os.rename(scratch, folder)
    except OSError:
        if not os.path.isdir(folder):  # not a concurrent run that finished first
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"generated synthetic {dataset} in {folder}")
    return folder


def training_loaders(args: argparse.Namespace, job: Job) -> tuple[dict, str]:
    """({layout: the training loader}, the loader in words) for the strategies' layouts."""
    import loaders
    import strategies

    extra = {"cache_dir": args.cache_dir}
    if job.backend == "reference":
        placement = args.placement
        if placement == "auto":  # device_fit says why the rows would not fit, or None
            placement = "host" if loaders.device_fit(job.train_data, job.mesh) else "device"
        make, data, extra = loaders.make_loader, job.train_data, {"placement": placement}
    elif job.backend == "rocal":
        import rocal_loader
        make, data = rocal_loader.make_rocal_loader, job.data_dir
    else:
        import dali_loader
        make, data = dali_loader.make_dali_loader, job.train_data
    made = {layout: make(data, job.mesh, args.batch_size, layout=layout, shuffle=True, seed=args.seed,
                         last_batch=args.last_batch, normalize=job.normalize, logical_shards=args.logical_shards,
                         **extra) for layout in {strategies.LAYOUT[name] for name in args.strategies}}
    return made, (f"reference loader, placement {placement}" if job.backend == "reference" else
                  next(iter(made.values())).describe())


def train_strategy(args: argparse.Namespace, job: Job, name: str, params0, optimizer, span, metrics) -> tuple:
    """Strategy ``name`` over the run's epochs, a line (and metrics row) each: (host params, opt state, failures)."""
    import model
    import strategies

    loader = job.loaders[strategies.LAYOUT[name]]
    params, opt_state = span.start(name, params0, optimizer)
    reduction = {} if args.reduction == "plain" else {"reduction": "canonical", "logical_shards": args.logical_shards}
    train = functools.partial(strategies.STRATEGIES[name], mesh=job.mesh, loss_terms=model.loss_terms,
                              optimizer=optimizer, **reduction)
    failures = []
    job.say(f"--- {name} ---")
    for epoch, (lo, hi) in span.spans.items():
        start = time.perf_counter()
        params, losses, opt_state = train(params, span.batches(name, loader, epoch), opt_state=opt_state)
        seconds = time.perf_counter() - start
        release_freed_memory()  # the epoch's device buffers are garbage now
        real, losses, note, lines = span.epoch_done(name, epoch, loader, losses)
        accuracy = model.accuracy(params, job.test_loader.epoch(0))
        row = {"strategy": name, "epoch": epoch, "first_step": lo, "last_step": hi - 1,
               "loss": float(np.mean(losses)) if len(losses) else float("nan"), "test_accuracy": accuracy,
               "test_samples": job.test_loader.real_samples(0), "seconds": seconds, "images_per_second": real / seconds,
               "steps": hi - lo, "devices": 1 if name == "single" else len(job.devices),
               "platform": job.devices[0].platform, "backend": job.backend, "dataset": args.dataset}
        job.say(f"{name:>9} epoch {epoch} of {args.epochs}  loss {row['loss']:.4f}  test accuracy {accuracy:.4f}  "
                f"{seconds:6.2f} s  {row['images_per_second']:8.0f} images/s"
                + ("  (includes compilation)" if epoch == span.first_epoch else "") + note)
        for ok, line in lines:
            job.say(line)
        failures += [line for ok, line in lines if not ok]
        if metrics:
            print(json.dumps(row), file=metrics, flush=True)
    return params, opt_state, failures


# Where a run starts and stops; the checkpoint (orbax-checkpoint) ----------------------------------
def run_identity(args: argparse.Namespace, train_data, arithmetic: str) -> dict:
    """What a checkpoint shares with every run that resumes it: the IDENTITY options (batch_size too with logical
    shards), normalize as the arithmetic used, the training data's size and BLAKE2b-128 digest (images, labels)."""
    images, labels = train_data
    digest = hashlib.blake2b(digest_size=16)
    for lo in range(0, len(images), 4096):  # read_cifar10's images are a strided view
        digest.update(np.ascontiguousarray(images[lo:lo + 4096]).tobytes())
    digest.update(np.ascontiguousarray(labels, np.int32).tobytes())
    names = IDENTITY + (("batch_size",) if args.logical_shards is not None else ())
    identity = {name: getattr(args, name) for name in names}
    identity.update(normalize=arithmetic, num_train=len(labels), train_data_blake2b=digest.hexdigest())
    return json.loads(json.dumps(identity))


def _flag(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _same(name: str, saved, mine) -> bool:
    mine = json.loads(json.dumps(mine))
    return sorted(saved) == sorted(mine) if name == "strategies" else saved == mine


def resume_options(args: argparse.Namespace, given: set) -> dict:
    """Reads ``--resume-from``'s checkpoint (every process) and completes ``args``: IDENTITY, and CARRIED unless
    ``given`` (ValueError: a given identity flag contradicts it). Returns the run item + loader, state, folder."""
    import orbax.checkpoint as ocp

    folder = os.path.abspath(args.resume_from)
    previous = sys.unraisablehook
    # A failed read leaves tensorstore's other reads to print "Event loop is closed" at exit; the error is raised below.
    sys.unraisablehook = lambda hook: None if "Event loop is closed" in str(hook.exc_value) else previous(hook)
    try:
        items = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(folder, args=ocp.args.Composite(
            run=ocp.args.JsonRestore(), loader=ocp.args.JsonRestore(), state=ocp.args.StandardRestore()))
    except Exception as error:  # tensorstore's, orbax's: one line naming the checkpoint
        # Its other reads failed too, in futures nobody awaits: asyncio would log each when collected.
        logging.getLogger("asyncio").addFilter(
            lambda record: not (record.getMessage().startswith("Future exception was never retrieved")
                                and folder in record.getMessage()))
        said = str(error).strip().splitlines()[0].split(" [tensorstore_spec=")[0] if str(error).strip() else ""
        raise ValueError(f"--resume-from {args.resume_from}: the checkpoint cannot be read "
                         f"({type(error).__name__}: {said[:300]})") from None
    saved, args.from_checkpoint = dict(items["run"]), set()
    identity = [(n, saved["identity"][n]) for n in IDENTITY + ("batch_size",) if n in saved["identity"]]
    for name, value in identity + list(saved["carried"].items()):  # CARRIED: never a list, never in identity
        if name not in given:
            setattr(args, name, tuple(value) if isinstance(value, list) else value)
            args.from_checkpoint.add(name)
        elif (name, value) in identity and not _same(name, value, getattr(args, name)):
            flag = f"--{name.replace('_', '-')}"
            raise ValueError(f"--resume-from {args.resume_from}: {flag} {_flag(getattr(args, name))} contradicts "
                             f"the checkpoint's run, which has {flag} {_flag(value)}; leave {flag} out (a resumed "
                             f"run takes what it trains from its checkpoint)")
    saved.update(loader=items["loader"], state=items["state"], folder=folder)
    return saved


def run_spans(epochs: int, stop_after_step: int | None, done: int, first_epoch: int,
              first_span: tuple[int, int] | None, steps: int) -> tuple[dict, tuple | None]:
    """({epoch: (first step, stop step)} this run trains, (epoch, next step) of the stop or None). The run starts
    at run step ``done`` in ``first_epoch`` (its span ``first_span``, else whole); every later epoch, to ``epochs`` - 1,
    is whole. ValueError for a ``stop_after_step`` at or below ``done`` or past the run's last step."""
    spans = {e: first_span if e == first_epoch and first_span else (0, steps) for e in range(first_epoch, epochs)}
    if stop_after_step is None:
        return spans, None
    if stop_after_step <= done:
        raise ValueError(f"--stop-after-step {stop_after_step}: the checkpoint has already trained run steps "
                         f"0-{done - 1}; stop after more than {done}")
    run_step = done
    for epoch, (lo, hi) in spans.items():
        run_step += hi - lo
        if stop_after_step <= run_step:
            stop = (epoch, hi - run_step + stop_after_step)
            return {e: span for e, span in spans.items() if e < epoch} | {epoch: (lo, stop[1])}, stop
    raise ValueError(f"--stop-after-step {stop_after_step}: this run has only {run_step} run steps (epochs "
                     f"0-{epochs - 1}); raise --epochs or lower it")


class Span:
    """Where this run starts and stops: ``spans`` {epoch: (first step, stop step)} it trains, ``stop`` (epoch, next
    step) or None; ``resumed`` {epoch: the checkpoint's loader state} (plan.elastic_plan's order on other shards)."""

    def __init__(self, args, job: Job, saved: dict | None):
        self.args, self.saved, self.where = args, saved, job.where
        self.identity = run_identity(args, job.train_data, job.arithmetic)
        self.first_epoch, done, first, self.resumed = 0, 0, None, {}
        if saved is not None:
            theirs = saved["identity"]
            for name in sorted(set(theirs) | set(self.identity)):
                if not _same(name, theirs.get(name), self.identity.get(name)):
                    raise ValueError(f"--resume-from {args.resume_from}: the checkpoint was taken with {name}="
                                     f"{theirs.get(name)!r}, this run has {name}={self.identity.get(name)!r}; a "
                                     f"checkpoint resumes only its own run (the same data and arithmetic)")
            state = LoaderState.from_json(json.dumps(saved["loader"]))
            resumed = state.resized(job.num_shards, args.batch_size)
            if args.epochs < state.epoch + (1 if state.step else 0):
                raise ValueError(f"--epochs {args.epochs}: the checkpoint is at epoch {state.epoch}, step "
                                 f"{state.step}; give --epochs {state.epoch + 1} or more")
            for loader in job.loaders.values():  # a vendor's own order resumes only on its own shards
                try:
                    loader.epoch(state.epoch, state=state).close()
                except ValueError as error:
                    raise ValueError(f"--backend {args.backend}: {error}") from None
            self.first_epoch, done, first = state.epoch, saved["run_step"], (resumed.step, resumed.num_steps)
            self.resumed = {state.epoch: state}
            job.say(f"resuming {args.resume_from} at run step {done} = epoch {state.epoch}, step {state.step} (written "
                    f"on {saved['where']}); this run: {job.where}: steps {state.step}-{resumed.num_steps - 1} of epoch "
                    f"{state.epoch}" + (f" (plan.elastic_plan, segments {[tuple(x) for x in resumed.segments]})"
                                        if len(resumed.segments) > 1 else ""))
        self.spans, self.stop = run_spans(args.epochs, args.stop_after_step, done, self.first_epoch, first, job.steps)
        self.counted = {e for e, state in self.resumed.items() if state.step} | ({self.stop[0]} if self.stop else set())
        self.losses, self.delivered, self.states = {}, {}, {}

    def start(self, name: str, params0, optimizer) -> tuple:
        """(params, optimizer state) strategy ``name`` starts from: the checkpoint's, in params0's and
        optimizer.init(params0)'s structure; else (params0, None). ValueError naming the leaf that does not fit."""
        import jax

        if self.saved is None:
            return params0, None
        folder, saved = self.saved["folder"], self.saved["state"].get(name)
        if saved is None:
            raise ValueError(f"--resume-from {folder}: the checkpoint holds no state of strategy {name!r}")
        out = []
        for kind, template in (("params", params0), ("opt_state", optimizer.init(params0))):
            leaves, structure = jax.tree.flatten(template)
            got = [np.asarray(x) for x in jax.tree.leaves(saved[kind])]
            for i, (want, have) in enumerate(zip(map(np.asarray, leaves), got)):
                if have.shape != want.shape or have.dtype != want.dtype:
                    raise ValueError(f"--resume-from {folder}: {name}'s {kind} leaf {i} is {have.dtype} {have.shape}; "
                                     f"this run's is {want.dtype} {want.shape}")
            if len(got) != len(leaves):
                raise ValueError(f"--resume-from {folder}: {name}'s {kind} has {len(got)} leaves; this run's "
                                 f"{len(leaves)}")
            out.append(jax.tree.unflatten(structure, got))
        return tuple(out)

    def batches(self, name: str, loader, epoch: int):
        """The batches this run trains of ``epoch``, cut at the stop; across a checkpoint, counted in ``delivered``."""
        lo, hi = self.spans[epoch]
        iterator = loader.epoch(epoch, state=self.resumed.get(epoch))
        kept = []  # each batch's index and mask, counted once the epoch is trained: no sync a step
        try:
            for batch in itertools.islice(iterator, hi - lo):
                if epoch in self.counted:
                    kept.append({key: batch[key] for key in ("index", "mask")})
                yield batch
            if epoch in self.counted:  # one for each real row of this process's blocks, by its "index"
                counts = self.delivered[name, epoch] = np.zeros(self.identity["num_train"], np.int32)
                for fields in kept:
                    index = {shard.device: shard.data for shard in fields["index"].addressable_shards}
                    for shard in fields["mask"].addressable_shards:
                        real = np.asarray(shard.data).reshape(-1)
                        np.add.at(counts, np.asarray(index[shard.device]).reshape(-1)[real], 1)
            self.states[name, epoch] = iterator.get_state()
        finally:
            iterator.close()

    def epoch_done(self, name: str, epoch: int, loader, losses) -> tuple:
        """(real samples delivered, the epoch's losses with the checkpoint's, a note for the epoch
        line, [(ok, line)] verdicts). Every process calls it: the counts are summed across them."""
        import jax

        lo, hi = self.spans[epoch]
        state, resumed = self.states.get((name, epoch)), self.resumed.get(epoch)
        real, note, lines = loader.real_samples(epoch, state=resumed), "", []
        if resumed is not None:
            losses = np.concatenate([np.asarray(self.saved["losses"].get(name, []), np.float32), losses])
            note = f"  (steps {lo}-{hi - 1} of 0-{state.num_steps - 1}: resumed)"
        if self.stop is not None and epoch == self.stop[0]:
            note += f"  (steps {lo}-{hi - 1} of 0-{state.num_steps - 1}: stopped before step {hi})"
            self.losses[name] = [float(x) for x in losses]
        if epoch not in self.counted:
            return real, losses, note, lines
        here = self.delivered[name, epoch]
        if jax.process_count() > 1:  # a collective: every process calls epoch_done
            from jax.experimental import multihost_utils
            here = np.asarray(multihost_utils.process_allgather(here), np.int32).sum(axis=0)
        total = here + (np.asarray(self.saved["state"][name]["delivered"], np.int32) if resumed is not None else 0)
        self.delivered[name, epoch] = total
        if hi == state.num_steps:  # the epoch is complete: the promise can be checked
            lines.append(exactly_once(name, epoch, total, state, self.args.last_batch, self.args.seed))
        else:
            twice = int(np.count_nonzero(total > 1))
            lines.append((twice == 0, f"{name} epoch {epoch} so far, counted by sample index: "
                                      f"{int(total.sum())} real slot(s), {twice} sample(s) more than once"))
        return int(here.sum()), losses, note, lines

    def save(self, job: Job, final: dict, states: dict) -> None:
        """The checkpoint at the stop: every process calls it (orbax's collectives)."""
        import jax
        import orbax.checkpoint as ocp

        epoch, _ = self.stop
        state = self.states[next(iter(final)), epoch]
        finishing = state.step < state.num_steps  # an epoch to finish: its losses and deliveries go too
        state = state if finishing else state.next_epoch()
        args, step = self.args, self.args.stop_after_step  # the run step that comes next
        carried = {k: getattr(args, k) for k in CARRIED if not (k == "batch_size" and args.logical_shards)}
        carried.update({k: os.path.abspath(carried[k]) for k in ("data_dir", "cache_dir") if carried[k]})
        run = {"identity": self.identity, "carried": carried, "run_step": step, "where": self.where,
               "losses": self.losses if finishing else {}}
        tree = {name: {"params": final[name], "opt_state": states[name],
                       **({"delivered": self.delivered[name, epoch]} if finishing else {})} for name in final}
        folder = os.path.abspath(args.checkpoint_dir)
        ocp.Checkpointer(ocp.CompositeCheckpointHandler()).save(folder, force=True, args=ocp.args.Composite(
            run=ocp.args.JsonSave(run), loader=ocp.args.JsonSave(json.loads(state.to_json())),
            state=ocp.args.StandardSave(jax.tree.map(np.asarray, tree))))
        job.say(f"stopped after run steps 0-{step - 1}: the next, run step {step}, is epoch "
                f"{state.epoch}, step {state.step}; checkpoint {folder} (params, optimizer state, loader state "
                f"{state.to_json()}); resume on any device or process count with --resume-from {args.checkpoint_dir}")


def exactly_once(name: str, epoch: int, counts, state, last_batch: str, seed: int) -> tuple[bool, str]:
    """(kept, the line) for a complete epoch's delivery counts: fill, every sample once; drop,
    none twice and exactly plan.elastic_plan's stated count never."""
    skipped = 0 if last_batch == "fill" else len(remaining_samples(
        len(counts), state.segments, state.num_steps, epoch=epoch, seed=seed, shuffle=True, last_batch="drop"))
    twice, never = int(np.count_nonzero(counts > 1)), int(np.count_nonzero(counts == 0))
    where = f"{name} epoch {epoch}, counted by sample index over the runs that delivered it"
    if twice or never != skipped:
        return False, (f"{where}: NOT exactly once: {twice} sample(s) delivered more than once, {never} never"
                       + (f" (elastic_plan states {skipped} skipped for drop)" if last_batch == "drop" else ""))
    if last_batch == "fill":
        return True, f"{where}: every one of the {len(counts)} samples delivered exactly once"
    return True, f"{where}: each sample at most once, {skipped} skipped, as elastic_plan states for drop"


# The verdicts -------------------------------------------------------------------------------------
def verdicts(args, job: Job, final: dict, states: dict, span: Span, params0, optimizer) -> list[str]:
    """Every process calls it: writes --params-out, prints the verdicts (process 0, failed last), returns the failed."""
    import jax
    import equivalence

    names, same, failed = list(final), [], []
    if args.reduction == "plain" and len(names) > 1:
        same, failed = stepwise_verdicts(args, job, span, params0, optimizer)
    for other in names[1:]:
        if args.reduction == "plain":  # the final params' distance, not judged
            diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                       for a, b in zip(jax.tree.leaves(final[names[0]]), jax.tree.leaves(final[other])))
            same.append(f"final params, {names[0]} vs {other}: max |difference| {diff:.3g} "
                        f"({equivalence.ulps_apart(final[names[0]], final[other]):.1f} ulps; the plain reduction "
                        f"promises no bits across strategies)")
            continue
        found = first_difference((final[names[0]], states[names[0]]), (final[other], states[other]))
        what = f"final params and optimizer state, {names[0]} vs {other}"
        if found is None:
            same.append(f"{what}: bit-identical (the canonical reduction over {args.logical_shards} logical shards)")
        else:
            failed.append(f"{what}: NOT bit-identical, which the canonical reduction promises: {found}")
    if jax.process_index() != 0:
        return []
    # --params-out: '<strategy>/<i>' is leaf i of its params, '<strategy>/opt_state/<i>' of its optimizer state
    mine = {f"{prefix}{i}": np.asarray(leaf) for name in names
            for prefix, tree in ((f"{name}/", final[name]), (f"{name}/opt_state/", states[name]))
            for i, leaf in enumerate(jax.tree.leaves(tree))}
    if args.params_out:
        with open(args.params_out, "wb") as f:  # np.savez would add ".npz" to a path
            np.savez(f, **mine)
    if args.compare_to:
        with np.load(args.compare_to) as npz:
            theirs, differ = dict(npz), []
        for name in names:
            keys = sorted(k for k in mine if k.startswith(f"{name}/"))
            missing = [k for k in keys if k not in theirs]
            what = f"final params and optimizer state of {name} against {args.compare_to}"
            found = (f"it holds no {missing[0]!r}" if missing else
                     first_difference({k: mine[k] for k in keys}, {k: theirs[k] for k in keys}))
            if found is None:
                same.append(f"{what}: bit-identical")
            else:
                differ.append(f"{what}: NOT bit-identical: {found}")
        (failed if args.reduction == "canonical" else same).extend(differ)  # where the bits are promised
    for line in same + failed:
        print(line)
    return failed


def stepwise_verdicts(args, job: Job, span: Span, params0, optimizer) -> tuple[list, list]:
    """The plain reduction's verdict, equivalence.stepwise_verdict of each strategy against the first over the
    run's first STEPWISE_STEPS steps from its start state (one process): (the lines within the bound, the others)."""
    import jax
    import equivalence
    import model

    if jax.process_count() > 1:
        return ["the stepwise verdict runs in one process: none across processes (--reduction canonical "
                "gives the same bits as one process instead)"], []
    names = list(args.strategies)
    params, opt_state = span.start(names[0], params0, optimizer)
    # Of two strategies or more, one trains from the sharded layout: its loader's host rows, as stepwise_verdict takes.
    iterator = job.loaders["sharded"].epoch(span.first_epoch, state=span.resumed.get(span.first_epoch))
    hosts = [{k: np.asarray(v) for k, v in batch.items()} for batch in itertools.islice(iterator, STEPWISE_STEPS)]
    iterator.close()
    within, outside = [], []
    for other in names[1:]:
        found = equivalence.stepwise_verdict(names[0], other, params, hosts, job.mesh, loss_terms=model.loss_terms,
                                             optimizer=optimizer, opt_state=opt_state, after_run=release_freed_memory)
        (outside if found.case == "OUTSIDE" else within).append(f"stepwise verdict, {found.text}")
    return within, outside


def release_freed_memory() -> None:
    """Gives the memory freed so far back to the OS (glibc's ``malloc_trim``; a no-op without glibc): XLA:CPU's device
    threads free a run's buffers into glibc's per-thread heaps, which keep them. The job calls it after each epoch and
    each run of the verdict (its ``after_run``); the modules it trains through never do (a user's job decides)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def first_difference(a, b) -> str | None:
    """None if pytrees ``a`` and ``b`` hold the same leaves bit for bit (structure, dtypes,
    shapes, bytes); else where they first differ: the leaf, how many entries, the first one."""
    import jax

    paths_a, tree_a = jax.tree_util.tree_flatten_with_path(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    if tree_a != tree_b:
        return f"the trees differ ({tree_a} vs {tree_b})"
    for (path, x), y in zip(paths_a, leaves_b):
        x, y = np.asarray(x), np.asarray(y)
        where = jax.tree_util.keystr(path)
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"leaf {where}: {x.dtype} {x.shape} vs {y.dtype} {y.shape}"
        wrong = np.flatnonzero(np.ascontiguousarray(x).reshape(-1).view(f"u{x.itemsize}")
                               != np.ascontiguousarray(y).reshape(-1).view(f"u{y.itemsize}"))
        if wrong.size:
            i = int(wrong[0])
            return (f"leaf {where}: {wrong.size} of {x.size} entries differ, the first at flat index {i}: "
                    f"{x.reshape(-1)[i]!r} vs {y.reshape(-1)[i]!r}")
    return None


if __name__ == "__main__":
    sys.exit(main())
