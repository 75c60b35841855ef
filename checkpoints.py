"""refimpl's checkpoints: stop after a run step, resume on any devices, count every sample.

``--stop-after-step S --checkpoint-dir DIR`` stops every strategy once it has
trained S run steps (0..S-1) and writes one checkpoint; ``--resume-from DIR`` alone
continues it, on any device or process count (and, without logical shards, batch
size). This module is that machinery, apart from the notebooks' program (refimpl.py):

* ``IDENTITY`` / ``CARRIED`` / ``OWN``: refimpl's options by what a resume does with
  them. ``resume_options`` completes a resumed run's options from the checkpoint
  (what it trains, and what it carries over unless given) before any work, and
  refuses a flag that contradicts the checkpoint's run by name; ``run_identity`` /
  ``check_identity`` hold the run to it once its data is read (a digest of the
  training data, the arithmetic actually used).
* ``write_checkpoint`` / ``read_checkpoint``: one JSON document and one .npz of
  arrays, written so that a reader never sees half a checkpoint.
* ``Deliveries``: which samples an epoch delivered, counted from the delivered
  rows themselves (``fingerprint_rows``), summed over processes, so that an epoch
  split across a checkpoint is checked to deliver every sample exactly once.
* ``Elastic``: the training loop's position across the stop and the resume (which
  run steps this run trains, each epoch's batches, what the checkpoint holds).

Imports: plan.py, NumPy and JAX, lazily (the options check needs none). Imported
by refimpl.py only.
"""

from __future__ import annotations

import inspect
import json
import os
import time
from typing import TYPE_CHECKING, Callable
from plan import LoaderState, elastic_num_steps, num_steps, remaining_samples

if TYPE_CHECKING:  # annotations only: the options check imports neither
    import argparse

    import numpy as np

# --------------------------------------------------------------------------
# Checkpoint and resume: --stop-after-step, --checkpoint-dir, --resume-from
# --------------------------------------------------------------------------

CHECKPOINT_FORMAT = "refimpl.checkpoint/2"
CHECKPOINT_FILE = "checkpoint.json"

# refimpl's options in three groups, for a resume; every option is in exactly one
# (test_checkpoints.py holds refimpl's parser to that, so an option added later is placed).
#
# IDENTITY: what the run trains. A resume takes each from the checkpoint; a flag that
# contradicts it is refused by name (``resume_options``). --normalize is held as the
# arithmetic it resolved to, and --batch-size joins them in a run with logical shards
# (there b is part of the plan: L logical shards of b rows); the training data itself
# (its size and digest) is checked once it is read (``check_identity``).
IDENTITY = ("dataset", "hidden", "strategies", "seed", "optimizer", "lr", "last_batch", "normalize",
            "matmul_precision", "reduction", "logical_shards")
# CARRIED: the run's length, where its data is, the loader that reads it and, without
# logical shards, --batch-size (the elastic resize): from the checkpoint unless given,
# and free to change.
CARRIED = ("epochs", "data_dir", "cache_dir", "backend", "eval_batch_size", "batch_size")
# OWN: this run's, never from the checkpoint: its devices and processes, where the loader
# works, what it writes, how it is judged, when it stops.
OWN = ("platform", "devices", "placement", "max_ulps_per_step", "metrics_out", "params_out", "compare_to",
       "coordinator", "num_processes", "process_id", "auto_distributed", "local_processes",
       "peer_timeout", "stop_after_step", "checkpoint_dir", "resume_from")
IDENTITY_WORDS = ("dataset and data, hidden widths, strategies, seed, optimizer, lr, last batch, "
                  "arithmetic, matmul precision, reduction, and with logical shards L and b")


def identity_options(args: argparse.Namespace) -> tuple[str, ...]:
    """The options of IDENTITY, with batch_size in a run with logical shards."""
    return IDENTITY + (("batch_size",) if args.logical_shards is not None else ())


def run_identity(args: argparse.Namespace, train_data, arithmetic: str) -> dict:
    """What a checkpoint shares with every run that resumes it: each option of
    ``identity_options`` (the strategies in the run's order, compared as a set;
    normalize as ``arithmetic``, the one actually used), the loader's shuffle (always on
    here), and the training data: its size and the BLAKE2b-128 digest of its image
    bytes then its int32 label bytes, in order."""
    import hashlib
    import numpy as np

    images, labels = train_data
    digest = hashlib.blake2b(digest_size=16)
    for lo in range(0, len(images), 4096):  # read_cifar10's images are a strided view
        digest.update(np.ascontiguousarray(images[lo:lo + 4096]).tobytes())
    digest.update(np.ascontiguousarray(labels, np.int32).tobytes())
    identity = {name: getattr(args, name) for name in identity_options(args)}
    identity.update(normalize=arithmetic, shuffle=True, num_train=len(labels),
                    train_data_blake2b=digest.hexdigest())
    return json.loads(json.dumps(identity, sort_keys=True))  # as a checkpoint holds it


def carried_options(args: argparse.Namespace) -> dict:
    """The CARRIED options of this run, as a checkpoint holds them: the folders made
    absolute (a resume may start elsewhere), batch_size only without logical shards
    (with them it is identity)."""
    carried = {name: getattr(args, name) for name in CARRIED if name not in identity_options(args)}
    for name in ("data_dir", "cache_dir"):
        if carried[name] is not None:
            carried[name] = os.path.abspath(carried[name])
    return json.loads(json.dumps(carried))


IDENTITY_EXTRAS = ("shuffle", "num_train", "train_data_blake2b")  # not options


def flag_value(value) -> str:
    """An option's value as it is written on the command line (lists comma-joined)."""
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return "(not given)" if value is None else str(value)


def same_value(name: str, saved, mine) -> bool:
    """Whether option ``name`` has the same value in a checkpoint (JSON) and in this run;
    the strategies compare as a set."""
    mine = json.loads(json.dumps(mine))
    if name == "strategies":
        return sorted(saved or []) == sorted(mine or [])
    return saved == mine


def check_identity(folder: str, saved: dict, mine: dict) -> None:
    """ValueError naming the first field (sorted by name) in which a checkpoint's run
    differs from this one: an option as --name (normalize: the arithmetic), else
    shuffle, num_train or train_data_blake2b."""
    for name in sorted(set(saved) | set(mine)):
        theirs = saved.get(name)
        if not same_value(name, theirs, mine.get(name)):
            field = name if name in IDENTITY_EXTRAS else f"--{name.replace('_', '-')}"
            if name in IDENTITY_EXTRAS:
                fix = "train on the checkpoint's data"
            elif name == "normalize":
                fix = (f"the arithmetic this run's backend computes is not the checkpoint's {theirs}: "
                       f"pass --normalize {theirs} or a backend that computes it")
            else:
                fix = f"leave {field} out: a resumed run takes it from its checkpoint"
            raise ValueError(f"--resume-from {folder}: the checkpoint was taken with {field}="
                             f"{theirs!r}, this run has {field}={mine.get(name)!r} ({fix}); a "
                             f"checkpoint resumes only its own run ({IDENTITY_WORDS})")


def read_document(folder: str) -> dict:
    """The JSON document of the checkpoint in ``folder`` (no arrays read). ValueError,
    naming the file, for one that is not JSON or of another format."""
    path = os.path.join(folder, CHECKPOINT_FILE)
    try:
        with open(path) as f:
            doc = json.load(f)
    except json.JSONDecodeError as error:
        raise ValueError(f"--resume-from {folder}: {path} is not JSON ({error})") from None
    if not isinstance(doc, dict) or doc.get("format") != CHECKPOINT_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else None
        older = " (written by an older refimpl.py: rerun it to checkpoint)" if found == "refimpl.checkpoint/1" else ""
        raise ValueError(f"--resume-from {folder}: {path} is not a {CHECKPOINT_FORMAT} checkpoint "
                         f"(format {found!r}){older}")
    return doc


def resume_options(folder: str, args: argparse.Namespace, given: set) -> set[str]:
    """Completes ``args`` (refimpl's options, resolved) for a resume of the checkpoint in
    ``folder``, reading only its checkpoint.json, so before any work: each option of the
    checkpoint's identity (``identity_options`` of its run) and each CARRIED one it holds
    is set from it, unless ``given`` (the options on the command line); returns the names
    set. A given identity option with another value than the checkpoint's raises
    ValueError naming the flag, both values and the fix; a given CARRIED option is this
    run's (it may change)."""
    doc = read_document(folder)
    run, carried = doc["run"], doc.get("carried", {})
    filled = set()
    for name in (n for n in IDENTITY + ("batch_size",) if n in run):
        flag = f"--{name.replace('_', '-')}"
        if name not in given:
            setattr(args, name, tuple(run[name]) if isinstance(run[name], list) else run[name])
            filled.add(name)
        elif not same_value(name, run[name], getattr(args, name)):
            raise ValueError(f"--resume-from {folder}: {flag} {flag_value(getattr(args, name))} contradicts "
                             f"the checkpoint's run, which has {flag} {flag_value(run[name])}; leave "
                             f"{flag} out (a resumed run takes what it trains from its checkpoint: "
                             f"{IDENTITY_WORDS})")
    for name, value in carried.items():
        if name not in given:
            setattr(args, name, value)
            filled.add(name)
    return filled


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

    path = os.path.join(folder, CHECKPOINT_FILE)
    doc = read_document(folder)
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
        doc["loader_state"] = LoaderState.from_json(json.dumps(doc["loader_state"]))
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
    placement and every backend in plan order deliver, arithmetic.Normalize's
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

    Numbering (refimpl's, stated in its docstring): epochs and steps are indices
    from 0, as plan.LoaderState numbers them; run step r is the r-th step of the
    whole run, epoch 0's steps first; "steps a-b" includes both ends. Each strategy
    trains the same run steps. With --stop-after-step S, every strategy trains run
    steps 0..S-1 and stops; run step S, the next, is (epoch e, step s), and one
    checkpoint is written: each strategy's params and optimizer state, the loader
    state at that position (plan.LoaderState: epoch e, step s, its shard segments;
    after an epoch's last step, step 0 of the next), that epoch's losses so far, the
    delivered-sample counts (``Deliveries``) of that epoch so far, summed over the
    processes. With --resume-from, every strategy restarts from its params and
    optimizer state, epoch e runs its remaining steps on this run's shards (every
    backend's ``epoch(e, state=...)``, i.e. plan.elastic_plan's order: the
    reference loader, and DALI and rocAL, which read that order, order="plan"),
    the later epochs are fresh plans, and when epoch e ends the report says,
    from the delivered rows of both runs, whether every sample was delivered
    exactly once across the change (drop: at most once, elastic_plan's count
    skipped). A run can be resumed and stopped again (a chain of changes).

    Shards: the plan's, ``num_shards`` of ``args.batch_size`` rows: the devices
    without logical shards (a resume on other devices or another batch size adds a
    segment: elastic_plan), or L logical shards of b (--logical-shards: the plan is
    the same on every device count that divides L, so a resume adds no segment).
    """

    def __init__(self, args, *, mesh, num_shards: int, train_data, normalize, arithmetic: str,
                 backend: str, loaders_by_layout: dict, where: str, say):
        self.say = say
        self.where = where
        self.folder = args.checkpoint_dir
        self.last_batch = args.last_batch
        self.identity = run_identity(args, train_data, arithmetic)
        self.carried = carried_options(args)
        self.num_samples = len(train_data[1])
        n, B = mesh.devices.size, args.batch_size
        self.shards, self.seed = (num_shards, B), args.seed
        steps = num_steps(self.num_samples, num_shards, B, args.last_batch)
        self.saved, self.arrays = None, {}
        self.first_epoch, done = 0, 0
        first_span = None
        self.resumed = None  # the interrupted epoch's state, resized to this run's shards
        if args.resume_from:
            done = self._resume(args, loaders_by_layout, backend)
            first_span = (self.resumed.step, self.resumed.num_steps)
        self.spans, self.stop = run_spans(args.epochs, args.stop_after_step, done, self.first_epoch,
                                          first_span, steps)
        self.steps_trained = done + sum(hi - lo for lo, hi in self.spans.values())
        self.counted = set()  # epochs whose deliveries are counted: interrupted, resumed
        if self.resumed is not None and self.resumed.step > 0:
            self.counted.add(self.first_epoch)
        if self.stop is not None:
            self.counted.add(self.stop[0])
        self.deliveries = Deliveries(train_data, normalize) if self.counted else None
        self.vectors, self.kept, self.failures, self.runs = {}, {}, [], {}
        self.device_counts = sorted(set(self.saved.get("device_counts", []) if self.saved else []) | {n})

    def _resume(self, args, loaders_by_layout: dict, backend: str) -> int:
        """Reads and checks ``--resume-from``'s checkpoint (its run, the epochs asked for,
        whether the backend can resume on these shards); returns its run step."""
        L, B = self.shards
        self.saved, self.arrays = read_checkpoint(args.resume_from)
        check_identity(args.resume_from, self.saved["run"], self.identity)
        state = self.saved["loader_state"]
        self.first_epoch, done = state.epoch, self.saved["run_step"]
        self.resumed = state.resized(L, B)
        needed = state.epoch + (1 if state.step else 0)
        if args.epochs < needed:
            raise ValueError(f"--epochs {args.epochs}: the checkpoint in {args.resume_from} is at "
                             f"epoch {state.epoch}, step {state.step}; give --epochs {needed} or more "
                             f"(epochs 0-{needed - 1})")
        if len(self.resumed.segments) > 1:
            for loader in loaders_by_layout.values():
                if "state" not in inspect.signature(loader.epoch).parameters:
                    raise ValueError(
                        f"--backend {backend}: its loader cannot yet resume an epoch on another "
                        f"shard count or batch size (its epoch() takes no loader state): resume "
                        f"on the checkpoint's {state.segments[-1].num_shards} shard(s) x "
                        f"{state.segments[-1].batch_size}, or with --backend reference")
        self.say(f"resuming {args.resume_from} at run step {done} = epoch {state.epoch}, step "
                 f"{state.step} (written on {self.saved['where']}); this run: {self.where}: "
                 f"steps {state.step}-{self.resumed.num_steps - 1} of epoch {state.epoch}"
                 + (f" (plan.elastic_plan, segments {[tuple(x) for x in self.resumed.segments]})"
                    if len(self.resumed.segments) > 1 else ""))
        return done

    def epochs(self) -> range:
        return range(self.first_epoch, max(self.spans, default=self.first_epoch - 1) + 1)

    def start(self, name: str, params0, optimizer):
        """(params, optimizer state) this strategy starts from: the checkpoint's
        (``restored``), else (params0, None)."""
        if self.saved is None:
            return params0, None
        return restored(self.arrays, name, params0, optimizer)

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

        lo, hi = self.spans[epoch]
        state = self.epoch_state(epoch)
        note, lines = "", []
        if self.resumed is not None and epoch == self.first_epoch:
            losses = np.concatenate([self.arrays.get(f"losses/{name}", np.zeros(0, np.float32)), losses])
            note = f"  (steps {lo}-{hi - 1} of 0-{state.num_steps - 1}: resumed)"
        if self.stop is not None and epoch == self.stop[0]:
            note += f"  (steps {lo}-{hi - 1} of 0-{state.num_steps - 1}: stopped before step {hi})"
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
            end = elastic_num_steps(self.num_samples, state.segments, self.last_batch)
            skipped = 0 if self.last_batch == "fill" else len(remaining_samples(
                self.num_samples, state.segments, end, epoch=epoch, seed=self.seed, shuffle=True,
                last_batch=self.last_batch))
            ok, said = self.deliveries.verdict(total, self.last_batch, skipped)
            runs = "; ".join(f"steps {run['steps']} on {run['where']}: {run['delivered']}"
                             for run in self.epoch_runs(epoch, name, real))
            lines.append(f"{name} epoch {epoch}: {said}, counted from the delivered rows "
                         f"(real slots by run: {runs})")
        else:
            extra = np.maximum(total[:-1] - self.deliveries.expected, 0)
            ok = not extra.any() and not total[-1]
            lines.append(f"{name} epoch {epoch} so far, counted from the delivered rows: "
                         f"{int(total[:-1].sum())} real slot(s), {int(np.count_nonzero(extra))} "
                         f"sample(s) more than once, {int(total[-1])} row(s) that are no sample")
        if not ok:
            self.failures.append(lines[-1])
        self.runs[name] = self.epoch_runs(epoch, name, real)
        return real, losses, note, lines

    def epoch_state(self, epoch: int):
        """The plan.LoaderState of ``epoch`` at the end of what this run trains."""

        lo, hi = self.spans[epoch]
        if self.resumed is not None and epoch == self.first_epoch:
            return self.resumed.at_step(hi)
        return LoaderState.start(self.num_samples, *self.shards, epoch=epoch, seed=self.seed,
                                         shuffle=True, last_batch=self.last_batch).at_step(hi)

    def state_at_stop(self):
        """The loader state the checkpoint holds: at the stop, or at step 0 of the next
        epoch when the stop is at the end of one (the same position)."""
        state = self.epoch_state(self.stop[0])
        return state.next_epoch() if state.step == state.num_steps else state

    def epoch_runs(self, epoch: int, name: str, delivered: int) -> list[dict]:
        """The runs that delivered ``epoch`` for strategy ``name``, this one last with
        ``delivered`` real slots: [{"steps": "first-last" (the epoch's step indices, both
        included), "where", "delivered"}]."""
        lo, hi = self.spans[epoch]
        runs = []
        if self.resumed is not None and epoch == self.first_epoch:
            runs = list(self.saved.get("epoch_runs", {}).get(name, []))
        return runs + [{"steps": f"{lo}-{hi - 1}", "where": self.where, "delivered": delivered}]

    def bound_over_runs(self, bound: Callable, num_devices: int) -> Callable:
        """``bound`` (ulps a step, equivalence.ulp_bound's signature) as the largest over
        the device counts of this run and of the runs it resumes."""
        counts = sorted(set(self.device_counts) | {num_devices})
        return lambda a, b, platform, _: max(bound(a, b, platform, n) for n in counts)

    def checkpoint(self) -> None:
        """After every strategy, when the run stopped: process 0 writes the checkpoint."""
        import jax

        if self.stop is not None:
            state = self.state_at_stop()
            epoch, _ = self.stop
            if jax.process_index() == 0:
                finishing = state.epoch == epoch  # an epoch to finish: its losses and deliveries so far
                arrays = checkpoint_arrays(self.kept, {name: self.vectors[(name, epoch)] for name in self.kept}
                                           if finishing else None)
                doc = {"format": CHECKPOINT_FORMAT, "run": self.identity, "carried": self.carried,
                       "run_step": self.steps_trained, "where": self.where,
                       "loader_state": json.loads(state.to_json()),
                       "epoch_runs": self.runs if state.epoch == epoch else {},
                       "strategies": sorted(self.kept),
                       "device_counts": self.device_counts}
                path = write_checkpoint(self.folder, doc, arrays)
                self.say(f"stopped after run steps 0-{self.steps_trained - 1}: the next, run step "
                         f"{self.steps_trained}, is epoch {state.epoch}, step {state.step}; checkpoint "
                         f"{path} (params, optimizer state, loader state {state.to_json()}); resume on "
                         f"any device or process count with --resume-from {self.folder}")

    def failed(self) -> list[str]:
        """The report lines of broken exactly-once promises (refimpl prints a FAILED line
        after the bounds' report when there are any: said last)."""
        return list(self.failures)



def restored(arrays: dict, name: str, params0, optimizer) -> tuple:
    """(params, optimizer state) of strategy ``name`` from a checkpoint's ``arrays``
    ('params/<name>/<i>', 'opt_state/<name>/<i>': leaf i in jax.tree.leaves order),
    in params0's and optimizer.init(params0)'s tree structure. ValueError naming the
    key for a leaf that is missing or of another shape or dtype."""
    import numpy as np
    import jax

    out = []
    for kind, template in (("params", params0), ("opt_state", optimizer.init(params0))):
        leaves, tree = jax.tree.flatten(template)
        got = []
        for i, leaf in enumerate(leaves):
            key = f"{kind}/{name}/{i}"
            value = arrays.get(key)
            leaf = np.asarray(leaf)
            if value is None or value.shape != leaf.shape or value.dtype != leaf.dtype:
                raise ValueError(f"--resume-from: the checkpoint's {key} is "
                                 f"{'missing' if value is None else f'{value.dtype} {value.shape}'}; "
                                 f"this run's is {leaf.dtype} {leaf.shape}")
            got.append(value)
        out.append(jax.tree.unflatten(tree, got))
    return tuple(out)


def checkpoint_arrays(kept: dict, delivered: dict | None) -> dict:
    """The arrays ``restored`` reads: for each strategy of ``kept`` ({name: (params,
    opt_state, losses)}) its leaves, and, for an epoch still to finish (``delivered``:
    {name: its Deliveries vector}), that epoch's losses so far ('losses/<name>') and
    deliveries ('delivered/<name>')."""
    import numpy as np
    import jax

    arrays = {}
    for name, (params, opt_state, losses) in kept.items():
        for kind, tree in (("params", params), ("opt_state", opt_state)):
            for i, leaf in enumerate(jax.tree.leaves(tree)):
                arrays[f"{kind}/{name}/{i}"] = np.asarray(leaf)
        if delivered is not None:
            arrays[f"losses/{name}"] = np.asarray(losses, np.float32)
            arrays[f"delivered/{name}"] = delivered[name]
    return arrays


def run_spans(epochs: int, stop_after_step: int | None, done: int, first_epoch: int,
              first_span: tuple[int, int] | None, steps: int) -> tuple[dict, tuple | None]:
    """(the epochs this run trains, each as {epoch: (first, stop)}: its steps first ..
    stop - 1; the stop as (epoch, its step that comes next), or None). The run starts at
    run step ``done`` (that many trained), in ``first_epoch``, whose span is
    ``first_span`` (a resumed epoch's rest) or a whole epoch of ``steps``; every later
    epoch up to ``epochs`` - 1 is whole. With ``stop_after_step`` S (a count), the run
    ends once run steps 0..S-1 are trained. ValueError for an S at or below ``done``, or
    past the run's last step."""
    spans, run_step = {}, done
    for epoch in range(first_epoch, epochs):
        lo, hi = first_span if epoch == first_epoch and first_span else (0, steps)
        spans[epoch] = (lo, hi)
        run_step += hi - lo
    total, stop = run_step, None
    if stop_after_step is not None:
        if stop_after_step <= done:
            raise ValueError(f"--stop-after-step {stop_after_step}: the checkpoint has already "
                             f"trained run steps 0-{done - 1}; stop after more than {done}")
        if stop_after_step > total:
            raise ValueError(f"--stop-after-step {stop_after_step}: this run has only {total} run "
                             f"steps (run steps 0-{total - 1}, epochs 0-{epochs - 1}); raise --epochs "
                             f"or lower it")
        run_step = done
        for epoch, (lo, hi) in spans.items():
            if stop_after_step <= run_step + hi - lo:
                stop = (epoch, lo + stop_after_step - run_step)
                spans = {e: span for e, span in spans.items() if e <= epoch}
                spans[epoch] = (lo, stop[1])
                break
            run_step += hi - lo
    return spans, stop

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
                         f"epoch {epoch} on another shard count or batch size")
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
