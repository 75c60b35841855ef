"""The two notebooks as one program: sharded loaders, an MLP, data-parallel SGD.

    python refimpl.py                 # synthetic CIFAR-10, sharded then pmap, 5 epochs
    python refimpl.py --help

What it does, in the notebooks' order: builds one sharded training loader over
the devices and a single-device validation loader, trains the seed MLP with each
chosen strategy from the same initial params, and after every epoch prints the
mean training loss, the accuracy over every test sample exactly once, the epoch
time and images per second. At the end it prints the largest difference between
the strategies' final params.

Bad input (a missing or malformed dataset, a batch larger than a shard, more
devices than exist, an unknown strategy) ends with one line on stderr and exit
status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time

DEFAULT_CPU_DEVICES = 8
MAX_CPU_DEVICES = 64  # virtual CPU devices are threads on the same cores
SYNTHETIC = {"num_train": 2048, "num_test": 512}
STRATEGY_NAMES = ("sharded", "pmap", "shard_map", "single")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="refimpl.py",
        description="Data-parallel training of the rocAL/DALI notebooks' MLP on CIFAR-10, "
                    "one sharded loader per device, with several parallel strategies.",
        epilog=f"With no --data-dir a synthetic CIFAR-10-format dataset "
               f"({SYNTHETIC['num_train']} training and {SYNTHETIC['num_test']} test images) is "
               f"generated once into --cache-dir and reused. Without an accelerator JAX gets "
               f"{DEFAULT_CPU_DEVICES} virtual CPU devices; they share this machine's cores, so "
               f"timings there show overhead, not speed-up. The defaults finish in under a "
               f"minute on a 2-core machine.",
    )
    parser.add_argument("--data-dir", metavar="DIR", help="a cifar-10-batches-bin folder (data_batch_* and test_batch*)")
    parser.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "refimpl"),
                        metavar="DIR", help="where the synthetic dataset is generated (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=5, metavar="N", help="default: %(default)s")
    parser.add_argument("--batch-size", type=int, default=16, metavar="B", help="per device (default: %(default)s)")
    parser.add_argument("--eval-batch-size", type=int, default=256,
                        metavar="B", help="validation batch on one device (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=0.001, metavar="RATE", help="SGD learning rate (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, metavar="N", help="shuffle and synthetic-data seed (default: %(default)s)")
    parser.add_argument("--strategies",
                        metavar="LIST", help=f"comma-separated, any of {', '.join(STRATEGY_NAMES)}, or 'all' "
                             f"(default: sharded,pmap as the notebooks; sharded,shard_map across "
                             f"processes)")
    parser.add_argument("--devices", type=int,
                        metavar="N", help=f"use the first N devices; without an accelerator, N virtual CPU devices "
                             f"(default: all accelerators, or {DEFAULT_CPU_DEVICES} CPU devices)")
    parser.add_argument("--last-batch", choices=("fill", "drop"), default="fill",
                        help="fill: pad the last batch and mask the padding, so every sample counts "
                             "exactly once; drop: skip the remainder, as the notebooks (default: %(default)s)")
    parser.add_argument("--backend", choices=("reference", "rocal", "auto"), default="reference",
                        help="training loader: the NumPy reference, rocAL pipelines, or rocAL when "
                             "available (default: %(default)s)")
    parser.add_argument("--metrics-out", metavar="FILE", help="write every per-epoch figure to this file as JSON lines")
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
                       help="launch N processes on this machine (127.0.0.1) that split --devices "
                            f"(default {DEFAULT_CPU_DEVICES}) between them")
    multi.add_argument("--peer-timeout", type=int, default=60,
                       metavar="SECONDS", help="seconds to wait for a missing or silent peer before failing "
                            "(default: %(default)s)")
    args = parser.parse_args(argv)
    if args.strategies is None:
        several = args.coordinator or args.auto_distributed or args.local_processes
        args.strategies = "sharded,shard_map" if several else "sharded,pmap"
    names = STRATEGY_NAMES if args.strategies == "all" else tuple(
        s.strip() for s in args.strategies.split(",") if s.strip())
    unknown = [s for s in names if s not in STRATEGY_NAMES]
    if unknown or not names:
        parser.error(f"--strategies: unknown strategy {unknown or args.strategies!r}; "
                     f"choose from {', '.join(STRATEGY_NAMES)} or 'all'")
    args.strategies = names
    for flag in ("epochs", "batch_size", "eval_batch_size", "devices"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    explicit = [args.coordinator, args.num_processes, args.process_id]
    if any(v is not None for v in explicit) and any(v is None for v in explicit):
        parser.error("--coordinator, --num-processes and --process-id go together")
    if args.num_processes is not None and not 0 <= args.process_id < args.num_processes:
        parser.error(f"--process-id {args.process_id} is outside 0..{args.num_processes - 1}")
    if args.local_processes is not None:
        if args.local_processes < 1 or args.coordinator or args.auto_distributed:
            parser.error("--local-processes N needs N >= 1 and no other multi-process option")
        total = args.devices or DEFAULT_CPU_DEVICES
        if total % args.local_processes:
            parser.error(f"--local-processes {args.local_processes} does not divide --devices {total}")
    if args.coordinator or args.auto_distributed or args.local_processes:
        unsupported = [s for s in names if s not in ("sharded", "shard_map")]
        if unsupported:
            parser.error(f"--strategies {','.join(unsupported)}: across processes only sharded and "
                         f"shard_map run (pmap maps over one process's devices; single is one device)")
    return args


def synthetic_dataset(cache_dir: str, seed: int) -> str:
    """The synthetic dataset's folder, generating it once (atomically) if missing."""
    import loaders

    folder = os.path.join(cache_dir, f"synthetic-cifar10-{SYNTHETIC['num_train']}-"
                                     f"{SYNTHETIC['num_test']}-seed{seed}")
    if os.path.isdir(folder):
        return folder
    os.makedirs(cache_dir, exist_ok=True)
    scratch = tempfile.mkdtemp(dir=cache_dir, prefix=".generating-")
    try:
        loaders.synthetic_cifar10(scratch, seed=seed, **SYNTHETIC)
        os.rename(scratch, folder)
    except OSError:
        if not os.path.isdir(folder):  # not a concurrent run that finished first
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"generated synthetic CIFAR-10 in {folder}")
    return folder


def pick_devices(requested: int | None) -> list:
    import jax

    devices = jax.devices()
    if requested is None:
        return devices
    if requested > len(devices):
        limit = f" (at most {MAX_CPU_DEVICES} virtual CPU devices)" if devices[0].platform == "cpu" else ""
        raise ValueError(f"--devices {requested}: only {len(devices)} {devices[0].platform} "
                         f"device(s) exist{limit}")
    return devices[:requested]


def with_progress(batches, total: int, label: str):
    """Yields ``batches``; on a terminal, also a live step counter on one line."""
    if not sys.stdout.isatty():
        yield from batches
        return
    for step, batch in enumerate(batches, start=1):
        print(f"\r  {label}: step {step}/{total}", end="", flush=True)
        yield batch
    print("\r" + " " * (len(label) + 30) + "\r", end="", flush=True)


def run(args: argparse.Namespace) -> dict:
    import jax

    # Virtual CPU devices only exist if asked for before JAX first touches a
    # device; on accelerators this setting changes nothing.
    distributed = bool(args.coordinator or args.auto_distributed)
    cpu_devices = args.devices if args.devices and args.devices <= MAX_CPU_DEVICES else DEFAULT_CPU_DEVICES
    jax.config.update("jax_num_cpu_devices", cpu_devices if distributed else max(cpu_devices, DEFAULT_CPU_DEVICES))
    if distributed:
        connect(args)
    import numpy as np
    import loaders
    import model
    import strategies

    data_dir = args.data_dir or synthetic_dataset(args.cache_dir, args.seed)
    train_data = loaders.read_cifar10(data_dir, loaders.TRAIN_PREFIX)
    test_data = loaders.read_cifar10(data_dir, loaders.TEST_PREFIX)
    devices = jax.devices() if distributed else pick_devices(args.devices)
    mesh = loaders.data_mesh(devices)  # shard k = position k, across every process's devices
    say = print if jax.process_index() == 0 else (lambda *a, **k: None)
    eval_batch = min(args.eval_batch_size, len(test_data[1]))
    # Validation always uses the reference loader on one device: fill with a mask
    # counts every test sample exactly once, whatever the training backend.
    test_loader = loaders.make_loader(test_data, jax.local_devices()[:1], eval_batch, last_batch="fill")
    # The reference backend reuses the arrays read above; rocAL reads the folder itself.
    train_source = train_data if args.backend == "reference" else data_dir
    loaders_by_layout = {
        layout: loaders.make_loader(train_source, mesh, args.batch_size, layout=layout, shuffle=True,
                                    seed=args.seed, last_batch=args.last_batch, backend=args.backend)
        for layout in {strategies.LAYOUT[name] for name in args.strategies}
    }
    steps = len(next(iter(loaders_by_layout.values())))
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    say(f"{len(devices)} {devices[0].platform} device(s){processes}; {len(train_data[1])} training and "
          f"{len(test_data[1])} test images from {data_dir}; {steps} steps of "
          f"{len(devices)} x {args.batch_size} per epoch ({args.last_batch})")

    metrics = open(args.metrics_out, "w") if args.metrics_out and jax.process_index() == 0 else None
    params0 = model.init_model()
    final = {}
    try:
        for name in args.strategies:
            train = strategies.STRATEGIES[name]
            loader = loaders_by_layout[strategies.LAYOUT[name]]
            params = params0
            say(f"--- {name} ---")
            for epoch in range(args.epochs):
                real = loader.real_samples(epoch)  # from the host-side plan: no device work
                start = time.perf_counter()
                batches = loader.epoch(epoch)
                if jax.process_index() == 0:
                    batches = with_progress(batches, steps, f"{name} epoch {epoch + 1}")
                params, losses = train(params, batches, args.lr, mesh)
                seconds = time.perf_counter() - start
                accuracy = model.accuracy(params, test_loader.epoch(0))
                row = {"strategy": name, "epoch": epoch + 1, "loss": float(np.mean(losses)),
                       "test_accuracy": accuracy, "seconds": seconds,
                       "images_per_second": real / seconds, "steps": len(losses),
                       "devices": len(devices), "platform": devices[0].platform}
                say(f"{name:>9} epoch {epoch + 1}/{args.epochs}  loss {row['loss']:.4f}  "
                      f"test accuracy {accuracy:.4f}  {seconds:6.2f} s  "
                      f"{row['images_per_second']:8.0f} images/s"
                      + ("  (includes compilation)" if epoch == 0 else ""))
                if metrics:
                    metrics.write(json.dumps(row) + "\n")
                    metrics.flush()
            final[name] = params
    finally:
        if metrics:
            metrics.close()
    if jax.process_index() == 0:
        report_differences(final)
    return final


def connect(args: argparse.Namespace) -> None:
    """jax.distributed.initialize with bounded waits: a missing peer fails the start
    after --peer-timeout seconds, a peer that dies later is detected by heartbeat.

    JAX's runtime ends the process itself in both cases (a C++ abort, SIGABRT,
    not a Python exception), so the line printed first is what names the process
    and the wait in the log."""
    import jax

    who = f"process {args.process_id} of {args.num_processes}" if args.num_processes else "this process"
    print(f"refimpl.py: {who}: joining coordinator {args.coordinator or '(auto-detected)'}; if a peer "
          f"has not joined within {args.peer_timeout} s, or stops answering for that long, JAX ends "
          f"this process", file=sys.stderr, flush=True)
    try:
        jax.distributed.initialize(
            coordinator_address=args.coordinator, num_processes=args.num_processes,
            process_id=args.process_id, initialization_timeout=args.peer_timeout,
            heartbeat_timeout_seconds=args.peer_timeout)
    except Exception as error:  # JAX raises several types here; one clear line is the point
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConnectionError(f"{who}: could not join the other processes at coordinator "
                              f"{args.coordinator or '(auto-detected)'} within {args.peer_timeout} s: "
                              f"{first}") from error


def launch_local(args: argparse.Namespace, argv: list[str]) -> int:
    """Runs this program in ``--local-processes`` processes on 127.0.0.1 and waits.

    Process 0's output is shown; the others' only on error. If any process fails,
    the rest are stopped and its exit status is returned."""
    import socket
    import subprocess

    count = args.local_processes
    per_process = (args.devices or DEFAULT_CPU_DEVICES) // count
    data_dir = args.data_dir or synthetic_dataset(args.cache_dir, args.seed)  # once, not racing
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = [sys.executable, os.path.abspath(__file__), *strip_options(argv, ("--local-processes", "--devices", "--data-dir")),
            "--data-dir", data_dir, "--devices", str(per_process), "--num-processes", str(count),
            "--coordinator", f"127.0.0.1:{port}"]
    children = [subprocess.Popen(base + ["--process-id", str(i)],
                                 stdout=None if i == 0 else subprocess.DEVNULL)
                for i in range(count)]
    try:
        while True:
            codes = [child.poll() for child in children]
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                i = failed[0]
                how = (f"exited with status {codes[i]}" if codes[i] > 0
                       else f"was killed by signal {signal.Signals(-codes[i]).name}")
                print(f"refimpl.py: error: local process {i} {how}; stopping the others",
                      file=sys.stderr)
                return codes[i] if codes[i] > 0 else 1
            if all(code == 0 for code in codes):
                return 0
            time.sleep(0.1)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()


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


def report_differences(final: dict) -> None:
    import numpy as np
    import jax

    names = list(final)
    for other in names[1:]:
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(jax.tree.leaves(final[names[0]]), jax.tree.leaves(final[other])))
        verdict = "identical" if diff == 0 else "not bit-identical (see strategies.py for the bound)"
        print(f"final params, {names[0]} vs {other}: max |difference| {diff:.3g}: {verdict}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    try:
        if args.local_processes:
            return launch_local(args, argv)
        run(args)
    except (ValueError, OSError, ImportError) as error:
        print(f"refimpl.py: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("refimpl.py: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
