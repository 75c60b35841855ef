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
the strategies' final params are, against the bound equivalence.ulp_bound gives;
--params-out FILE also writes them and their optimizer state (.npz), to compare
runs bit for bit (e.g. --backend dali and --backend reference with the same seed
and --normalize), and --compare-to FILE compares this run's with such a file,
strategy by strategy, saying bit-identical or not. The optimizer is the
notebooks' SGD, or optax.adam with --optimizer adam.

Numbering, one for every printed line, the metrics file and the checkpoint:
epochs and steps are indices from 0, as the loaders and plan.LoaderState number
them (epoch e is ``loader.epoch(e)``, step s of it is ``loader.batch(e, s)``).
Run step r is the r-th step of the whole run, epoch 0's steps first; "steps
a-b" includes both ends. Counts stay counts: --epochs N trains epochs 0..N-1,
and --stop-after-step S trains run steps 0..S-1, so the checkpoint's position
(its loader state's epoch and step) is run step S, the next to train.

Logical shards and the reduction: --logical-shards L plans each step as L
logical shards of --batch-size b rows (the global batch L*b, the same on every
device count n that divides L, device k reading logical shards k*L/n..;
refused naming the option when n does not divide L). --reduction canonical has
every strategy add the L logical shards' gradient sums in one fixed order
(strategies.canonical_step), L being --logical-shards or, without it, the
device count: the final params and optimizer state are then the same bits on
every n that divides L, across processes, and on one device adding L
microbatches (single), within one backend and device kind. In such a run the
report holds every pair of strategies, and --compare-to's file, to bit-identical
params and optimizer state, and one that is not is a failure (exit status 1,
said after the identical ones, then a FAILED line); equivalence.verdict's bound
is for the plain reduction.

Bad input (a malformed dataset, an invalid option, a batch larger than a shard,
more devices than exist, a platform JAX lacks) ends with one line on stderr
naming the option or file, and exit status 2, before any data is generated or
any training starts where the option alone shows it.

A broken guarantee is a failure: when two strategies' final params end further
apart than the documented bound, the last line printed says so, naming the pair,
and the exit status is 1. The bound is equivalence.verdict's: the count of
roundings a step (equivalence.ulp_bound, or ``--max-ulps-per-step``) times the
growth of a difference over this training, which equivalence.twin_growth measures
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
stops every strategy after S run steps and writes a checkpoint atomically;
``--resume-from DIR`` alone continues it: what the run trains (dataset and data,
hidden widths, strategies, seed, optimizer, lr, last batch, arithmetic, matmul
precision, reduction, and with logical shards L and b: checkpoints.IDENTITY) comes from the
checkpoint, and so do, unless given, the epochs, the data and cache folders, the
backend, the eval batch and, without logical shards, the batch size (CARRIED);
a flag that contradicts the checkpoint's run is refused by name (exit status 2,
before any work), and so is a strategy that cannot run in this process count
(pmap, single across processes). Devices and processes may change, and without
logical shards the batch size: the interrupted epoch's remaining samples then
follow plan.elastic_plan (with logical shards the plan itself goes on). For that
epoch the report says, counted from the rows actually delivered in both runs
(``Deliveries``), whether every sample was delivered exactly once (drop: at most
once, the stated count skipped); a broken promise is a failure too (exit status 1).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import types
from typing import Callable

from arithmetic import Normalize
from cifar_mnist import (TEST_PREFIX, TRAIN_PREFIX, read_cifar10, read_mnist, synthetic_cifar10,
                         synthetic_mnist)
import processes
from checkpoints import CHECKPOINT_FILE, Elastic, resume_options

DEFAULT_CPU_DEVICES = 8
MAX_CPU_DEVICES = 64  # virtual CPU devices are threads on the same cores
SYNTHETIC = {"num_train": 2048, "num_test": 512}
STRATEGY_NAMES = ("sharded", "pmap", "shard_map", "single")
ONE_PROCESS = {"pmap": "pmap maps over one process's devices", "single": "single is one device"}
REDUCTIONS = ("plain", "canonical")  # strategies.REDUCTIONS (not imported: fast errors)
OPTIMIZERS = ("sgd", "adam")
DATASETS = ("cifar10", "mnist")
BACKENDS = ("reference", "rocal", "dali", "auto")
PLACEMENTS = ("auto", "host", "device", "host_float32")
PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu")
# Each notebook's normalisation: rocAL's CIFAR-10 (x - 127.5) / 127.5, DALI's MNIST x / 255.
NOTEBOOK_NORMALIZE = {"cifar10": ((127.5,) * 3, (127.5,) * 3), "mnist": ((0.0,), (255.0,))}
ARITHMETICS = ("rocal", "dali_cpu", "dali_gpu")  # arithmetic.ARITHMETICS (not imported: fast errors)
NOTEBOOK_ARITHMETIC = {"cifar10": "rocal", "mnist": "dali_cpu"}


def parse_args(argv=None) -> argparse.Namespace:
    """The options, checked (``check_args``): argparse's exit status 2 and one line naming
    the option for bad input. A resume (--resume-from) is completed from its checkpoint."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args, given_options(sys.argv[1:] if argv is None else list(argv)))
    return args


def given_options(argv: list[str]) -> set[str]:
    """The options given on the command line ``argv`` (their dests), defaults aside."""
    parser, unset = build_parser(), object()
    # argparse sets a default only where the namespace has no value yet.
    namespace = argparse.Namespace(**{dest: unset for dest in vars(parser.parse_args([]))})
    return {dest for dest, value in vars(parser.parse_args(argv, namespace)).items() if value is not unset}


def build_parser() -> argparse.ArgumentParser:
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
    add_training_options(parser)
    add_running_options(parser)
    add_multiprocess_options(parser)
    add_checkpoint_options(parser)
    return parser


def add_training_options(parser: argparse.ArgumentParser) -> None:
    """What is trained: the data, the model, the epochs, the rate, the seed."""
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
    parser.add_argument("--epochs", type=int, default=5, metavar="N",
                        help="train epochs 0..N-1 (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=16, metavar="B",
                        help="per device; with --logical-shards, per logical shard (default: %(default)s)")
    parser.add_argument("--eval-batch-size", type=int, default=256,
                        metavar="B", help="validation batch on one device (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=0.001, metavar="RATE",
                        help="the learning rate, > 0 (default: %(default)s, the notebook's)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd",
                        help="sgd: the notebooks' plain SGD (strategies.sgd, needs only JAX); adam: "
                             "optax.adam(--lr), whose state (moments, a count) a checkpoint and "
                             "--params-out carry too; needs optax (requirements-peers.txt); with the "
                             "plain reduction its pairs get no ulp count (equivalence.ulp_bound, "
                             "adaptive=True): bit-identical or no bound, never OUTSIDE "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, metavar="N",
                        help="shuffle and synthetic-data seed, 0 <= N < 2**32 (default: %(default)s)")
    parser.add_argument("--logical-shards", type=int, metavar="L",
                        help="plan each step as L logical shards of --batch-size rows, the same global "
                             "batch on every device count that divides L (device k reads logical shards "
                             "k*L/n..); default: one a device")
    parser.add_argument("--reduction", choices=REDUCTIONS, default="plain",
                        help="plain: each strategy's own sums (held to equivalence.verdict's bound); "
                             "canonical: the L logical shards' gradient sums added in one fixed order, "
                             "the same bits on every device count dividing L, every pair of strategies "
                             "held to bit-identical (L: --logical-shards, else the device count) "
                             "(default: %(default)s)")


def add_running_options(parser: argparse.ArgumentParser) -> None:
    """How it runs and what it reports: strategies, devices, loader, arithmetic, outputs."""
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
                        help="count U roundings a step instead of equivalence.ulp_bound's count; the "
                             "bound is U times the measured growth of a difference (equivalence.verdict); "
                             "0 demands bit-identical params. Outside the bound: exit status 1")
    parser.add_argument("--metrics-out", metavar="FILE", help="write every per-epoch figure to this file as JSON lines")
    parser.add_argument("--params-out", metavar="FILE",
                        help="write each strategy's final params and optimizer state to this .npz file "
                             "(process 0), one array per leaf in jax.tree.leaves order, named "
                             "'<strategy>/<leaf index>' (params) and '<strategy>/opt_state/<leaf index>'; "
                             "compare two runs' files bit for bit with numpy, or with --compare-to")
    parser.add_argument("--compare-to", metavar="FILE",
                        help="compare each strategy's final params and optimizer state with FILE (another "
                             "run's --params-out), bit for bit, and say so; under --reduction canonical a "
                             "difference is a failure (exit status 1): e.g. a resumed run against the run "
                             "that was never stopped")


def add_multiprocess_options(parser: argparse.ArgumentParser) -> None:
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


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, given: set) -> None:
    """What argparse cannot check alone; ``parser.error`` (exit status 2) naming the option.
    Resolves --strategies (its default depends on the process count) and --hidden; for a
    resume, fills in what the checkpoint's run holds (checkpoints.resume_options: the
    options not in ``given``, the dests given on the command line), recording their names
    in ``args.from_checkpoint``, and refuses a given option that contradicts it."""
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
    for flag in ("epochs", "batch_size", "eval_batch_size", "devices", "peer_timeout", "logical_shards"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if not 0 <= args.seed < 2**32:
        parser.error(f"--seed must be in [0, 2**32), got {args.seed} (the shuffle's SeedSequence "
                     f"would alias larger seeds with other epochs)")
    if args.max_ulps_per_step is not None and args.max_ulps_per_step < 0:
        parser.error(f"--max-ulps-per-step must be >= 0, got {args.max_ulps_per_step}")
    args.from_checkpoint = set()
    if args.resume_from:
        check_resume_from(parser, args, given)
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
    if args.compare_to and not os.path.isfile(args.compare_to):
        parser.error(f"--compare-to {args.compare_to}: no such file (give another run's --params-out)")
    check_backend_args(parser, args)
    check_process_args(parser, args, several)
    devices = known_device_count(args)
    if args.logical_shards is not None and devices is not None:
        problem = logical_shards_problem(args, devices)
        if problem:
            parser.error(problem)
    check_checkpoint_options(parser, args)


def check_backend_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """check_args' part for the backend, its arithmetic, the optimizer and the reduction."""
    if args.dataset == "mnist" and args.backend == "rocal":
        parser.error("--backend rocal reads CIFAR-10 only (rocAL's cifar10 reader); use "
                     "--dataset cifar10, or --backend dali or reference for mnist")
    if args.backend in ("rocal", "dali") and args.placement != "auto":
        parser.error(f"--placement {args.placement}: only the reference backend has placements "
                     f"(--backend {args.backend} normalises in its own pipelines)")
    vendor = {"rocal": ("rocal",), "dali": ("dali_cpu", "dali_gpu")}.get(args.backend)
    if vendor and args.normalize and args.normalize not in vendor:
        if "normalize" in args.from_checkpoint:
            parser.error(f"--backend {args.backend}: it computes {' or '.join(vendor)} arithmetic, and "
                         f"the checkpoint's run in {args.resume_from} used {args.normalize}'s; resume "
                         f"with a backend that computes it (--backend reference computes any)")
        parser.error(f"--normalize {args.normalize}: --backend {args.backend} computes "
                     f"{' or '.join(vendor)} arithmetic (by device kind); drop --normalize")
    if args.optimizer == "adam" and importlib.util.find_spec("optax") is None:
        parser.error("--optimizer adam: needs optax, which is not installed (python3 -m pip install "
                     "-r requirements-peers.txt)")
    if args.reduction == "canonical" and args.max_ulps_per_step is not None:
        parser.error(f"--max-ulps-per-step {args.max_ulps_per_step}: --reduction canonical holds every "
                     f"pair of strategies to bit-identical; drop --max-ulps-per-step")


def check_process_args(parser: argparse.ArgumentParser, args: argparse.Namespace, several) -> None:
    """check_args' part for more than one process: the options that go together, and the
    strategies that run across processes."""
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
        unsupported = [s for s in args.strategies if s in ONE_PROCESS]
        why = "; ".join(ONE_PROCESS[s] for s in unsupported)
        if unsupported and "strategies" in args.from_checkpoint:
            parser.error(f"--resume-from {args.resume_from}: the checkpoint's run trains --strategies "
                         f"{','.join(args.strategies)}, and across processes only sharded and shard_map "
                         f"run ({why}): resume it in one process")
        if unsupported:
            parser.error(f"--strategies {','.join(unsupported)}: across processes only sharded and "
                         f"shard_map run ({why})")


def known_device_count(args: argparse.Namespace) -> int | None:
    """The run's device count where the options alone say it (--local-processes, or
    --devices in one process or with --num-processes on CPU), else None (JAX's count)."""
    if args.local_processes:
        return args.devices or DEFAULT_CPU_DEVICES
    if args.devices and not (args.coordinator or args.auto_distributed):
        return args.devices
    if args.devices and args.num_processes and args.platform == "cpu":
        return args.devices * args.num_processes
    return None


def logical_shards_problem(args: argparse.Namespace, devices: int) -> str | None:
    """Why ``devices`` devices cannot run this run's logical shards (they must divide L),
    in one line naming the option (or the checkpoint the value came from); None if they can."""
    L = args.logical_shards
    if L % devices == 0:
        return None
    fits = ", ".join(str(d) for d in range(1, L + 1) if L % d == 0)
    if "logical_shards" in args.from_checkpoint:
        return (f"--resume-from {args.resume_from}: the checkpoint's run has --logical-shards {L}, which "
                f"{devices} device(s) do not divide; resume on a device count that divides {L} ({fits})")
    return (f"--logical-shards {L}: {devices} device(s) do not divide it (device k reads logical shards "
            f"k*L/n..); use a device count that divides {L} ({fits}) or another L")


def check_resume_from(parser: argparse.ArgumentParser, args: argparse.Namespace, given: set) -> None:
    """--resume-from DIR: a checkpoint there, and this run's options completed from it
    (checkpoints.resume_options), or one line naming the option that contradicts it."""
    path = os.path.join(args.resume_from, CHECKPOINT_FILE)
    if not os.path.isfile(path):
        parser.error(f"--resume-from {args.resume_from}: no {CHECKPOINT_FILE} there (not a "
                     f"checkpoint written by --stop-after-step)")
    try:
        args.from_checkpoint = resume_options(args.resume_from, args, given)
    except ValueError as error:
        parser.error(str(error))


def add_checkpoint_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "checkpoint and resume",
        "Stop after S run steps and write a checkpoint (each strategy's params and optimizer "
        "state, the loader state, what the interrupted epoch delivered); resume it with "
        "--resume-from alone, on any device or process count (and, without logical shards, "
        "batch size): the interrupted epoch's remaining samples are delivered exactly once on "
        "the new shards (plan.elastic_plan), and the report counts them from the delivered "
        "rows. Epochs and steps are numbered from 0.")
    group.add_argument("--stop-after-step", type=int, metavar="S",
                       help="train every strategy for S run steps (run steps 0..S-1, counted over "
                            "the epochs in order from epoch 0's step 0; a resumed run continues the "
                            "count), write the checkpoint to --checkpoint-dir and stop")
    group.add_argument("--checkpoint-dir", metavar="DIR",
                       help="where --stop-after-step writes the checkpoint (created if missing; "
                            "DIR/checkpoint.json, replaced atomically, names the arrays file)")
    group.add_argument("--resume-from", metavar="DIR",
                       help="continue the run checkpointed in DIR on this run's devices and "
                            "processes; what it trains (dataset and data, --hidden, --strategies, "
                            "--seed, --optimizer, --lr, --last-batch, the arithmetic, "
                            "--matmul-precision, --reduction, --logical-shards and then --batch-size) "
                            "comes from the checkpoint, and a flag that contradicts it is refused; "
                            "--epochs, --data-dir, --cache-dir, --backend, --eval-batch-size and "
                            "(without logical shards) --batch-size default to the checkpoint's")


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
    folder = os.path.join(cache_dir, f"synthetic-{dataset}-{SYNTHETIC['num_train']}-"
                                     f"{SYNTHETIC['num_test']}-seed{seed}")
    if os.path.isdir(folder):
        return folder
    os.makedirs(cache_dir, exist_ok=True)
    scratch = tempfile.mkdtemp(dir=cache_dir, prefix=".generating-")
    try:
        write = synthetic_cifar10 if dataset == "cifar10" else synthetic_mnist
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
    if dataset == "mnist":
        return read_mnist(folder, "train"), read_mnist(folder, "test")
    return read_cifar10(folder, TRAIN_PREFIX), read_cifar10(folder, TEST_PREFIX)


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
    for done, batch in enumerate(batches, start=1):
        print(f"\r  {label}: {done}/{total} steps", end="", flush=True)
        yield batch
    print("\r" + " " * (len(label) + 30) + "\r", end="", flush=True)


def run(args: argparse.Namespace) -> tuple[dict, list[str]]:
    """Trains every chosen strategy; returns (final params by strategy, the report
    lines of what failed: pairs outside their bound, or not bit-identical under the
    canonical reduction, and broken exactly-once promises; empty if none or if this
    is not process 0)."""
    import jax
    import model

    start_jax(args)
    job = set_up(args)
    inputs = (model.LAYERS if args.dataset == "cifar10" else model.MNIST_LAYERS)[0]
    params0 = model.init_model((inputs, *args.hidden, model.LAYERS[-1]))
    optimizer = make_optimizer(args)
    elastic = None
    if args.stop_after_step or args.resume_from:
        elastic = Elastic(args, mesh=job.mesh, num_shards=job.num_shards, train_data=job.train_data,
                          normalize=job.normalize, arithmetic=job.arithmetic, backend=job.backend,
                          loaders_by_layout=job.loaders_by_layout, where=job.where, say=job.say)
    metrics = open(args.metrics_out, "w") if args.metrics_out and jax.process_index() == 0 else None
    final, states, growth = {}, {}, None
    try:
        for name in args.strategies:
            final[name], states[name] = train_strategy(args, job, name, params0, optimizer, elastic, metrics)
        bound, bound_name, growth = growth_if_needed(args, job, final, params0, optimizer, elastic)
    finally:
        if metrics:
            metrics.close()
        for loader in job.loaders_by_layout.values():
            if hasattr(loader, "close"):
                loader.close()
    return final, judged(args, job, final, states, bound, bound_name, growth, elastic)


def make_optimizer(args: argparse.Namespace):
    """--optimizer: the notebooks' plain SGD (strategies.sgd) or optax.adam, at --lr."""
    import strategies

    if args.optimizer == "adam":
        import optax
        return optax.adam(args.lr)
    return strategies.sgd(args.lr)


def reduction_options(args: argparse.Namespace) -> dict:
    """The strategies' reduction keywords: none for the plain reduction, else
    reduction="canonical" over the run's logical shards (set_up has resolved L)."""
    if args.reduction == "plain":
        return {}
    return {"reduction": "canonical", "logical_shards": args.logical_shards}


def start_jax(args: argparse.Namespace) -> None:
    """JAX configured for this run (platform, matmul precision, virtual CPU devices, the
    processes joined); ValueError naming --platform when JAX cannot start it."""
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


class Job(types.SimpleNamespace):
    """What ``set_up`` resolved for a run: devices, mesh, say (process 0's print), backend,
    arithmetic, normalize, data_dir, train_data, test_loader, loaders_by_layout (the
    training loader of each layout the strategies need), how (the loader in words),
    steps (a fresh epoch's), where (devices, processes and batch, for reports)."""


def set_up(args: argparse.Namespace) -> Job:
    """The devices, the data and the loaders of a run, and its first line printed."""
    import jax
    import loaders

    distributed = bool(args.coordinator or args.auto_distributed)
    job = Job(devices=jax.devices() if distributed else pick_devices(args.devices))
    n = len(job.devices)
    if args.reduction == "canonical" and args.logical_shards is None:
        args.logical_shards = n  # --reduction canonical alone: one logical shard a device
    if args.logical_shards is not None and logical_shards_problem(args, n):
        raise ValueError(logical_shards_problem(args, n))
    job.num_shards = args.logical_shards or n  # the plan's shards
    job.mesh = loaders.data_mesh(job.devices)  # shard k = position k, across every process's devices
    job.say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    job.backend = choose_backend(args.backend, args.dataset, job.devices)
    if args.backend == "auto":
        job.say(f"--backend auto chose {job.backend}")
    job.arithmetic = choose_arithmetic(job.backend, args.normalize, args.dataset, job.devices)
    mean, std = NOTEBOOK_NORMALIZE[args.dataset]
    job.normalize = Normalize(mean=mean, std=std, arithmetic=job.arithmetic)
    if job.backend == "rocal":
        import rocal_loader
        rocal_loader.import_rocal()  # how to install it, before any data is generated
    if job.backend == "dali":
        import dali_loader
        dali_loader.import_dali()
    job.data_dir = args.data_dir or synthetic_dataset(args.cache_dir, args.dataset, args.seed)
    job.train_data, test_data = read_dataset(args.dataset, job.data_dir)
    eval_batch = min(args.eval_batch_size, len(test_data[1]))
    # Validation always uses the reference loader on one device: fill with a mask
    # counts every test sample exactly once, whatever the training backend.
    first_local = job.mesh.devices.flat[loaders.local_positions(job.mesh)[0]]
    job.test_loader = loaders.make_loader(test_data, [first_local], eval_batch, last_batch="fill",
                                          normalize=job.normalize)
    job.loaders_by_layout, job.how = training_loaders(args, job)
    job.steps = len(next(iter(job.loaders_by_layout.values())))
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    L, B = args.logical_shards, args.batch_size
    rows = f"{L} logical shards of {B}" if L else f"{n} x {B}"
    how = job.how if job.backend == "reference" else job.backend
    job.where = (f"{n} {job.devices[0].platform} device(s){processes}, {rows} ({how})" if L
                 else f"{n} {job.devices[0].platform} device(s){processes} x {B} ({how})")
    per_device = f", {L // n} a device" if L else ""
    job.say(f"{n} {job.devices[0].platform} device(s){processes}; {args.dataset}: "
            f"{len(job.train_data[1])} training and {len(test_data[1])} test images from {job.data_dir}; "
            f"{job.steps} steps of {rows} per epoch{per_device} ({args.last_batch}); epochs 0-{args.epochs - 1}; "
            f"{job.how}; {job.arithmetic}'s arithmetic; matmul precision {args.matmul_precision}; "
            f"{args.optimizer}; {args.reduction} reduction")
    return job


def training_loaders(args: argparse.Namespace, job: Job) -> tuple[dict, str]:
    """({layout: the training loader}, the loader in words) for the strategies' layouts,
    through the chosen backend; placement "auto" resolved for the reference loader."""
    import loaders
    import strategies

    layouts = {strategies.LAYOUT[name] for name in args.strategies}
    common = dict(shuffle=True, seed=args.seed, last_batch=args.last_batch, normalize=job.normalize,
                  logical_shards=args.logical_shards)
    if job.backend == "reference":
        placement = args.placement
        if placement == "auto":
            too_big = loaders.device_fit(len(job.train_data[1]), job.train_data[0].shape[1:], job.mesh)
            placement = "host" if too_big else "device"
        made = {layout: loaders.make_loader(job.train_data, job.mesh, args.batch_size, layout=layout,
                                            placement=placement, **common) for layout in layouts}
        return made, f"reference loader, placement {placement}"
    if job.backend == "rocal":
        import rocal_loader
        made = {layout: rocal_loader.make_rocal_loader(job.data_dir, job.mesh, args.batch_size, layout=layout,
                                                       cache_dir=args.cache_dir, **common) for layout in layouts}
    else:
        import dali_loader
        made = {layout: dali_loader.make_dali_loader(job.train_data, job.mesh, args.batch_size, layout=layout,
                                                     cache_dir=args.cache_dir, **common) for layout in layouts}
    return made, next(iter(made.values())).describe()


def train_strategy(args: argparse.Namespace, job: Job, name: str, params0, optimizer, elastic,
                   metrics) -> tuple:
    """Strategy ``name``'s training over the run's epochs, one line (and a metrics row) an
    epoch; returns its final (params, optimizer state), on the host."""
    import numpy as np
    import jax
    import model
    import strategies

    train = strategies.STRATEGIES[name]
    loader = job.loaders_by_layout[strategies.LAYOUT[name]]
    params, opt_state = elastic.start(name, params0, optimizer) if elastic else (params0, None)
    job.say(f"--- {name} ---")
    for epoch in (elastic.epochs() if elastic else range(args.epochs)):
        start = time.perf_counter()
        batches, total = elastic.batches(name, loader, epoch) if elastic else (loader.epoch(epoch), job.steps)
        first = elastic.spans[epoch][0] if elastic else 0
        if jax.process_index() == 0:
            batches = with_progress(batches, total, f"{name} epoch {epoch}")
        params, losses, opt_state = train(params, batches, job.mesh, loss_terms=model.loss_terms,
                                          optimizer=optimizer, opt_state=opt_state, **reduction_options(args))
        seconds = time.perf_counter() - start
        # After the epoch: a vendor loader may only know then which of its
        # slots were padding (rocAL's shuffled drop). No device work either way.
        real, note, verdicts = loader.real_samples(epoch), "", []
        if elastic:  # a resumed or interrupted epoch: counted from what was delivered
            real, losses, note, verdicts = elastic.epoch_done(name, epoch, params, opt_state, losses, real)
        accuracy = model.accuracy(params, job.test_loader.epoch(0))
        row = {"strategy": name, "epoch": epoch, "first_step": first, "last_step": first + total - 1,
               "loss": float(np.mean(losses)),
               "test_accuracy": accuracy, "test_samples": job.test_loader.real_samples(0),
               "seconds": seconds, "images_per_second": real / seconds, "steps": len(losses),
               "devices": 1 if name == "single" else len(job.devices),
               "platform": job.devices[0].platform, "backend": job.backend, "dataset": args.dataset}
        job.say(f"{name:>9} epoch {epoch} of {args.epochs}  loss {row['loss']:.4f}  "
                f"test accuracy {accuracy:.4f}  {seconds:6.2f} s  {row['images_per_second']:8.0f} images/s"
                + ("  (includes compilation)" if epoch == (elastic.first_epoch if elastic else 0) else "")
                + note)
        for line in verdicts:
            job.say(line)
        if metrics:
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
    if opt_state is None:  # no step trained (a resume at the run's end): the fresh state
        opt_state = jax.tree.map(np.asarray, optimizer.init(params))
    return params, opt_state


def growth_if_needed(args: argparse.Namespace, job: Job, final: dict, params0, optimizer, elastic):
    """(the bound's count function, its name, the measured growth or None): twin_growth
    runs only when a pair ends further apart than count x steps (closer is within
    whatever the growth), and never across a checkpoint (it cannot replay other runs)."""
    import equivalence
    import model

    if args.reduction == "canonical":  # held to bit-identical: no bound, no growth
        return None, None, None
    bound, bound_name = equivalence.ulp_bound, "equivalence.ulp_bound"
    if args.optimizer == "adam":  # an adaptive rule: no count for the params (ulp_bound's docstring)
        bound, bound_name = functools.partial(equivalence.ulp_bound, adaptive=True), \
            "equivalence.ulp_bound(adaptive=True)"
    if args.max_ulps_per_step is not None:
        bound, bound_name = (lambda a, b, platform, num_devices: args.max_ulps_per_step), "--max-ulps-per-step"
    if elastic or not needs_growth(final, job.steps * args.epochs, bound, job.devices[0].platform,
                                   len(job.devices)):
        return bound, bound_name, None
    # Every process decides alike (the final params are replicated) and takes part.
    job.say("measuring how a difference grows over this training (equivalence.twin_growth: "
            "a reference and two twins over the same epochs)")
    loader = job.loaders_by_layout["sharded"]  # a pair includes a strategy other than pmap
    growth = equivalence.twin_growth(params0, (b for e in range(args.epochs) for b in loader.epoch(e)),
                                     job.mesh, loss_terms=model.loss_terms, optimizer=optimizer)
    return bound, bound_name, growth


def judged(args: argparse.Namespace, job: Job, final: dict, states: dict, bound, bound_name: str,
           growth, elastic) -> list[str]:
    """After the training: the checkpoint written (a stop), the params and optimizer
    states written (--params-out), the verdicts printed (process 0): equivalence.verdict's
    for the plain reduction, bit for bit for the canonical (``report_bits``); returns the
    lines of pairs that failed theirs and of broken exactly-once promises."""
    import jax

    outside = []
    if elastic:
        elastic.checkpoint()
    if jax.process_index() == 0:
        if args.params_out:
            write_params(args.params_out, final, states)
        same, differ = report_bits(final, states, args.logical_shards) if args.reduction == "canonical" else ([], [])
        if args.compare_to:
            theirs = compared_to(args.compare_to, final, states, args.reduction)
            same, differ = same + theirs[0], differ + theirs[1]
        for line in same + differ:  # the failures last
            print(line)
        if args.reduction == "canonical":
            outside = differ
            if differ:
                print(f"refimpl.py: FAILED: {len(differ)} comparison(s) did not end bit-identical under "
                      f"--reduction canonical (above); exit status {OUTSIDE_BOUND}", flush=True)
        else:
            if elastic:  # the steps before a resume ran on other device counts: the largest bound holds
                bound = elastic.bound_over_runs(bound, len(job.devices))
            outside = report_differences(final, elastic.steps_trained if elastic else job.steps * args.epochs,
                                         job.devices[0].platform, len(job.devices), bound, bound_name, growth,
                                         no_growth=NO_GROWTH_ACROSS_RUNS if elastic else None)
    if elastic and elastic.failed():
        job.say(f"refimpl.py: FAILED: {len(elastic.failed())} epoch(s) did not deliver every sample as "
                f"the plan promises (above); exit status {OUTSIDE_BOUND}")
        outside = outside + elastic.failed()
    return outside


NO_GROWTH_ACROSS_RUNS = ("the training spans a checkpoint (runs on other devices), which twin_growth "
                         "cannot replay, so the growth of a difference was not measured")


def needs_growth(final: dict, steps: int, bound: Callable, platform: str, num_devices: int) -> bool:
    """Whether a pair of ``final`` (each strategy against the first) needs the measured growth
    for its verdict: a count above 0 and a leaf further apart than count x ``steps`` in its
    own ulps (closer is within whatever the growth: equivalence.verdict)."""
    import equivalence

    names = list(final)
    for other in names[1:]:
        count = bound(names[0], other, platform, num_devices)
        if count and (equivalence.leaf_ulps(final[names[0]], final[other]) > count * steps).any():
            return True
    return False


def write_params(path: str, final: dict, states: dict) -> None:
    """``final`` ({strategy: params}) and ``states`` ({strategy: optimizer state}) as one
    .npz: array '<strategy>/<i>' is leaf i of ``jax.tree.leaves(params)``, and
    '<strategy>/opt_state/<i>' leaf i of the state's, the values this process holds
    (both are replicated)."""
    import numpy as np

    with open(path, "wb") as f:
        np.savez(f, **params_arrays(final, states))


def params_arrays(final: dict, states: dict) -> dict:
    """``write_params``' arrays by name: '<strategy>/<i>' and '<strategy>/opt_state/<i>'."""
    import numpy as np
    import jax

    arrays = {}
    for name in final:
        for prefix, tree in ((f"{name}/", final[name]), (f"{name}/opt_state/", states[name])):
            for i, leaf in enumerate(jax.tree.leaves(tree)):
                if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
                    leaf = leaf.addressable_data(0)  # replicated: any local copy is the whole value
                arrays[f"{prefix}{i}"] = np.asarray(leaf)
    return arrays


def compared_to(path: str, final: dict, states: dict, reduction: str) -> tuple[list[str], list[str]]:
    """--compare-to: each strategy's final params and optimizer state (``params_arrays``)
    against the arrays of the same names in ``path`` (another run's --params-out), bit for
    bit (``first_difference``): (the lines of the strategies that are bit-identical, the
    lines of those that are not). Under the canonical ``reduction`` the second are
    failures (``judged``); under the plain one they are what it promises across device
    counts: nothing. ValueError naming the option for a file that is not a .npz."""
    import numpy as np

    try:
        with np.load(path) as npz:
            theirs = {key: npz[key] for key in npz.files}
    except (OSError, ValueError) as error:
        raise ValueError(f"--compare-to {path}: not a .npz written by --params-out ({error})") from None
    mine = params_arrays(final, states)
    same, differ = [], []
    for name in final:
        keys = sorted(k for k in mine if k.startswith(f"{name}/"))
        missing = [k for k in keys if k not in theirs]
        what = f"final params and optimizer state of {name} against {path}"
        found = (f"it holds no {missing[0]!r}" if missing else
                 first_difference({k: mine[k] for k in keys}, {k: theirs[k] for k in keys}))
        if found is None:
            same.append(f"{what}: bit-identical")
        elif reduction == "canonical":
            differ.append(f"{what}: NOT bit-identical, which the canonical reduction promises: {found}")
        else:
            differ.append(f"{what}: not bit-identical (the plain reduction promises no bits across "
                          f"device counts): {found}")
    return same, differ


def report_bits(final: dict, states: dict, logical_shards: int) -> tuple[list[str], list[str]]:
    """The canonical reduction's verdict: each strategy's final params and optimizer state
    against the first's, bit for bit (``first_difference``): (the lines of the pairs that
    are bit-identical, the lines of those that are not, which the canonical reduction
    promises). ``judged`` prints them in that order, then one FAILED line if any is not,
    so the last thing a user reads is the failure."""
    names = list(final)
    same, differ = [], []
    for other in names[1:]:
        found = first_difference((final[names[0]], states[names[0]]), (final[other], states[other]))
        what = f"final params and optimizer state, {names[0]} vs {other}"
        if found is None:
            same.append(f"{what}: bit-identical (the canonical reduction over {logical_shards} logical "
                        f"shards)")
        else:
            differ.append(f"{what}: NOT bit-identical, which the canonical reduction promises: {found}")
    return same, differ


def first_difference(a, b) -> str | None:
    """None if pytrees ``a`` and ``b`` hold the same leaves bit for bit (same structure,
    dtypes, shapes and bytes); else where they first differ, in words: the leaf (its
    jax.tree path), how many entries differ, the first one's flat index and both values."""
    import numpy as np
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
        bits_x = np.ascontiguousarray(x).reshape(-1).view(f"u{x.itemsize}")
        bits_y = np.ascontiguousarray(y).reshape(-1).view(f"u{y.itemsize}")
        wrong = np.flatnonzero(bits_x != bits_y)
        if wrong.size:
            i = int(wrong[0])
            return (f"leaf {where}: {wrong.size} of {x.size} entries differ, the first at flat index {i}: "
                    f"{x.reshape(-1)[i]!r} vs {y.reshape(-1)[i]!r}")
    return None



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
    if os.environ.get(processes.LOCAL_CHILD) == "1":
        processes.hide_native_stdout()
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


def launch_local(args: argparse.Namespace, argv: list[str]) -> int:
    """Runs this program in ``--local-processes`` processes on 127.0.0.1 and waits
    (processes.run_local), the synthetic data generated once first (not racing)."""
    import socket

    count = args.local_processes
    per_process = (args.devices or DEFAULT_CPU_DEVICES) // count
    data_dir = args.data_dir or synthetic_dataset(args.cache_dir, args.dataset, args.seed)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = [sys.executable, os.path.abspath(__file__),
            *processes.strip_options(argv, ("--local-processes", "--devices", "--data-dir", "--platform")),
            "--data-dir", data_dir, "--devices", str(per_process), "--num-processes", str(count),
            "--coordinator", f"127.0.0.1:{port}"]
    return processes.run_local(base, count, passthrough=OUTSIDE_BOUND)


def report_differences(final: dict, steps: int, platform: str, num_devices: int,
                       bound: Callable[[str, str, str, int], int],
                       bound_name: str = "equivalence.ulp_bound", growth=None,
                       no_growth: str | None = None) -> list[str]:
    """Prints how far each strategy's final params are from the first's and the verdict
    (equivalence.verdict: ``bound(a, b, platform, num_devices)`` roundings a step, the
    signature of equivalence.ulp_bound, times ``growth``, twin_growth over the same
    ``steps``), and returns the lines of the pairs OUTSIDE their bound.

    Order: identical and within first, then "outside the domain where a bound is
    derived", then OUTSIDE, then one FAILED line if any pair is OUTSIDE, so the last
    thing a user reads is the failure. ``no_growth``: why no growth could be measured
    (a training that spans runs): a pair further apart than count x ``steps`` is then
    "outside the domain" for that reason. Raises ValueError (equivalence.verdict) if a
    pair with a count above 0 differs and ``growth`` is None, or if ``growth`` was
    measured over another number of steps."""
    import numpy as np
    import jax
    import equivalence

    names = list(final)
    lines = {"identical": [], "within": [], "outside the domain": [], "OUTSIDE": []}
    for other in names[1:]:
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(jax.tree.leaves(final[names[0]]), jax.tree.leaves(final[other])))
        count = bound(names[0], other, platform, num_devices)
        if (no_growth and growth is None and count
                and (equivalence.leaf_ulps(final[names[0]], final[other]) > count * steps).any()):
            ulps = float(equivalence.leaf_ulps(final[names[0]], final[other]).max())
            found = equivalence.Verdict("outside the domain", ulps, None,
                                       f"not bit-identical: {ulps:.1f} ulps after {steps} steps: outside "
                                       f"the domain where a bound is derived: {no_growth}; no verdict")
        else:
            found = equivalence.verdict(final[names[0]], final[other], count, growth, steps, bound_name)
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
