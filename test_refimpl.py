"""refimpl.py as its users rely on it, run in this process (refimpl.main, JAX already running)
on tiny data: 100 training and 16 test images, the MLP 3072-8-10, one or two epochs.

* Bad input ends with one line on stderr naming the option and the value, exit status 2,
  before anything is trained or written; every option has its documented default and is
  in exactly one of refimpl.IDENTITY, CARRIED and OWN.
* A run trains every strategy and reports each epoch, the stepwise verdict and the final
  distances; what it trains is what the modules train by hand, bit for bit; a wrong
  strategy ends it with exit status 1, a FAILED line last.
* The canonical reduction: pairs said bit-identical, another device count's --params-out
  bit-identical through --compare-to; a flipped bit or a missing leaf fails the run, named.
* Checkpoint and resume: stopped on 8 devices and resumed on 3, every sample of the
  interrupted epoch delivered exactly once (counted by sample index); with drop, the stated
  count skipped; canonical stopped on 4 and resumed on 3 ends on the uninterrupted run's
  bits; a resume contradicting its checkpoint, of other data, stopping at or before its step
  or past its end, or on a loader that cannot resume on other shards, is refused.

With --run-slow: a chain of stops, the refusals only a fresh process can show, and a long
epoch that once deadlocked. Several processes: test_multiprocess.py.
"""

import json
import os
import shutil
import sys
import types

import numpy as np
import pytest

from cifar_mnist import read_cifar10, synthetic_cifar10, write_cifar10
from conftest import NO_SOCKETS, assert_same_bits, own_stderr, run_children, run_refimpl

HERE = os.path.dirname(os.path.abspath(__file__))
RUN = ["--epochs", "1", "--hidden", "8", "--eval-batch-size", "5"]  # 16 test images: the last batch padded
# 100 samples over 8 logical shards of 4 rows: shards of 12 or 13, 4 steps, the last masked.
CANONICAL = [*RUN, "--batch-size", "4", "--logical-shards", "8", "--reduction", "canonical", "--optimizer", "adam",
             "--lr", "0.01", "--strategies", "sharded,single"]


@pytest.fixture(autouse=True)
def matmul_precision_kept():
    """A run sets JAX's matmul precision in this process; the suite's stays "highest"."""
    import jax
    yield
    jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synthetic_cifar10(tmp_path_factory.mktemp("data"), num_train=100, num_test=16, seed=3)


@pytest.fixture(scope="module")
def other_data(tmp_path_factory):
    return synthetic_cifar10(tmp_path_factory.mktemp("other"), num_train=100, num_test=16, seed=4)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A folder of bad inputs: a text file, a .npy array, a truncated CIFAR-10 folder."""
    folder = tmp_path_factory.mktemp("inputs")
    (folder / "notes.txt").write_text("not params\n")
    np.save(folder / "array.npy", np.zeros(3, np.float32))
    truncated = synthetic_cifar10(folder / "truncated", num_train=50, num_test=10, seed=0)
    path = os.path.join(truncated, "data_batch_3.bin")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    return folder


# --------------------------------------------------------------------------
# The runs the tests read, once each
# --------------------------------------------------------------------------


def outputs_read(done, tmp):
    """``done`` with its --metrics-out rows and its --params-out path (m.jsonl, p.npz in ``tmp``)."""
    done.rows = [json.loads(line) for line in (tmp / "m.jsonl").read_text().splitlines()] if done.status == 0 else []
    done.params = tmp / "p.npz"
    return done


@pytest.fixture(scope="module")
def plain(data, tmp_path_factory):
    """Every strategy, 3 devices of 4 rows (shards of 34, 33, 33: 9 steps, the last padded)."""
    from arithmetic import Normalize
    tmp = tmp_path_factory.mktemp("plain")
    done = run_refimpl(["--data-dir", data, *RUN, "--batch-size", "4", "--devices", "3", "--strategies", "all",
                     "--metrics-out", tmp / "m.jsonl", "--params-out", tmp / "p.npz"])
    done.recipe = dict(train=read_cifar10(data), test=read_cifar10(data, "test_batch"), layers=(3072, 8, 10),
                       normalize=Normalize(mean=(127.5,) * 3, std=(127.5,) * 3, arithmetic="rocal"),
                       seed=0, devices=3, batch_size=4, eval_batch_size=5, optimizer=("sgd", 0.001))
    return outputs_read(done, tmp)


@pytest.fixture(scope="module")
def mnist(tmp_path_factory):
    """The DALI notebook's dataset, synthetic (no --data-dir: generated into --cache-dir, 2048
    training and 512 test images), sharded on 2 devices of 128 rows (8 steps), Adam."""
    from arithmetic import Normalize
    from cifar_mnist import read_mnist
    tmp = tmp_path_factory.mktemp("mnist")
    done = run_refimpl(["--dataset", "mnist", "--cache-dir", tmp / "cache", "--epochs", "1", "--hidden", "8",
                     "--seed", "7", "--batch-size", "128", "--devices", "2", "--strategies", "sharded",
                     "--optimizer", "adam", "--lr", "0.01", "--eval-batch-size", "100",
                     "--metrics-out", tmp / "m.jsonl", "--params-out", tmp / "p.npz"])
    done.cache = tmp / "cache"
    [folder] = list(done.cache.iterdir())
    done.recipe = dict(train=read_mnist(folder, "train"), test=read_mnist(folder, "test"), layers=(784, 8, 10),
                       normalize=Normalize(mean=(0.0,), std=(255.0,), arithmetic="dali_cpu"),
                       seed=7, devices=2, batch_size=128, eval_batch_size=100, optimizer=("adam", 0.01))
    return outputs_read(done, tmp)


@pytest.fixture(scope="module")
def stopped(data, tmp_path_factory):
    """Sharded on 8 devices of 4 rows (4 steps an epoch), 2 epochs, stopped after run step 4:
    the checkpoint is at run step 5 = epoch 1, step 1."""
    folder = tmp_path_factory.mktemp("stopped") / "ck"
    done = run_refimpl(["--data-dir", data, *RUN, "--epochs", "2", "--batch-size", "4", "--devices", "8",
                     "--strategies", "sharded", "--stop-after-step", "5", "--checkpoint-dir", folder])
    assert done.status == 0, done.out + done.err
    done.folder = folder
    return done


@pytest.fixture(scope="module")
def canonical(data, tmp_path_factory):
    """The canonical reduction over 8 logical shards on 4 devices, Adam, uninterrupted."""
    path = tmp_path_factory.mktemp("canonical") / "c8.npz"
    done = run_refimpl(["--data-dir", data, *CANONICAL, "--devices", "4", "--params-out", path])
    assert done.status == 0, done.out + done.err
    done.params = path
    return done


@pytest.fixture(scope="module")
def canonical_stopped(data, tmp_path_factory):
    """The same run stopped after run step 2, before its masked last step."""
    folder = tmp_path_factory.mktemp("canonical-stopped") / "ck"
    done = run_refimpl(["--data-dir", data, *CANONICAL, "--devices", "4", "--stop-after-step", "3",
                     "--checkpoint-dir", folder])
    assert done.status == 0, done.out + done.err
    done.folder = folder
    return done


# --------------------------------------------------------------------------
# 1. Bad input
# --------------------------------------------------------------------------

MULTI = ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--strategies", "sharded"]
# A value of each IDENTITY option that the checkpoint of ``stopped`` does not have.
CONTRADICTIONS = {"dataset": "mnist", "hidden": "16", "strategies": "sharded,single", "seed": "1", "optimizer": "adam",
                  "lr": "0.5", "last_batch": "drop", "normalize": "dali_cpu", "matmul_precision": "high",
                  "reduction": "canonical", "logical_shards": "4"}

# (argv, what the line says). {tmp}: an empty folder for the outputs; {inputs}: the fixture's;
# {data}, {other}: the data and other data of its size; {ck}, {cck}: the checkpoints of
# ``stopped`` and ``canonical_stopped``.
REFUSED = {
    "a seed of 2**32": (["--seed", "4294967296"], "--seed must be in [0, 2**32), got 4294967296"),
    "a negative seed": (["--seed", "-1"], "--seed must be in [0, 2**32), got -1"),
    "a rate of 0": (["--lr", "0"], "--lr must be > 0, got 0.0"),
    "a rate that is no number": (["--lr", "nan"], "--lr must be > 0, got nan"),
    "a width of 0": (["--hidden", "8,0"], "--hidden '8,0': give the hidden layers' widths as positive integers"),
    "no widths": (["--hidden", ""], "--hidden '': give the hidden layers' widths"),
    "an unknown strategy": (["--strategies", "sharded,warp"], "--strategies: unknown strategy ['warp']"),
    "no strategy": (["--strategies", " , "], "--strategies: unknown strategy ' , '"),
    **{f"--{flag} 0": ([f"--{flag}", "0"], f"--{flag} must be >= 1, got 0") for flag in (
        "epochs", "batch-size", "eval-batch-size", "devices", "peer-timeout", "logical-shards", "stop-after-step")},
    "a count that is no integer": (["--epochs", "1.5"], "argument --epochs: invalid int value: '1.5'"),
    "an unknown choice": (["--reduction", "fast"], "argument --reduction: invalid choice: 'fast'"),
    "65 virtual CPU devices": (["--platform", "cpu", "--devices", "65"],
                               "--devices 65: at most 64 virtual CPU devices"),
    "local processes of 65 virtual CPU devices each": (["--local-processes", "2", "--devices", "130"],
                                                        "--devices 130: at most 64 virtual CPU devices per process, "
                                                        "not 65"),
    "an output in a missing folder": (["--metrics-out", "{tmp}/no/m.jsonl"],
                                      "--metrics-out {tmp}/no/m.jsonl: its folder {tmp}/no does not exist"),
    "an output that is a folder": (["--params-out", "{inputs}"], "--params-out {inputs}: is a directory"),
    "a missing file to compare to": (["--compare-to", "{tmp}/none.npz"], "--compare-to {tmp}/none.npz: no such file"),
    "a file to compare to that is no .npz": (["--data-dir", "{data}", *RUN, "--batch-size", "4", "--devices", "3",
                                              "--compare-to", "{inputs}/notes.txt"],
                                             "--compare-to {inputs}/notes.txt: not a .npz written by --params-out"),
    "an array to compare to": (["--compare-to", "{inputs}/array.npy"],
                               "--compare-to {inputs}/array.npy: not a .npz written by --params-out (a .npy array)"),
    "a stop without a folder": (["--stop-after-step", "2"], "--stop-after-step and --checkpoint-dir go together"),
    "a folder without a stop": (["--checkpoint-dir", "{tmp}/ck"], "--stop-after-step and --checkpoint-dir go together"),
    "a checkpoint folder that is a file": (["--stop-after-step", "2", "--checkpoint-dir", "{inputs}/notes.txt"],
                                           "--checkpoint-dir {inputs}/notes.txt: is a file, not a folder"),
    "a checkpoint folder in a missing folder": (["--stop-after-step", "2", "--checkpoint-dir", "{tmp}/no/ck"],
                                                "--checkpoint-dir {tmp}/no/ck: {tmp}/no is not a writable folder"),
    "a folder that holds no checkpoint": (["--resume-from", "{inputs}"],
                                          "--resume-from {inputs}: not a checkpoint written by --stop-after-step"),
    "rocAL on MNIST": (["--dataset", "mnist", "--backend", "rocal"], "--backend rocal, which reads CIFAR-10 only"),
    "a vendor backend with a placement": (["--backend", "dali", "--placement", "host"],
                                          "--placement host: only the reference backend has placements"),
    "a vendor backend with another's arithmetic": (["--backend", "dali", "--normalize", "rocal"],
                                                   "--normalize rocal, but --backend dali computes dali_cpu"),
    "fewer logical shards than devices": (["--logical-shards", "3", "--devices", "4"],
                                          "--logical-shards 3, fewer than 4 device(s): a device holds whole logical "
                                          "shards, at least one; use at most 3 devices or another L"),
    "a process id past the count": ([*MULTI, "--process-id", "2"], "--process-id 2 is outside 0..1"),
    "a negative process id": ([*MULTI, "--process-id", "-1"], "--process-id -1 is outside 0..1"),
    "a coordinator alone": (["--coordinator", "127.0.0.1:1"],
                            "--coordinator, --num-processes and --process-id go together"),
    "no local processes": (["--local-processes", "0"], "--local-processes must be >= 1, got 0"),
    "canonical without L": (["--reduction", "canonical"], "--reduction canonical needs --logical-shards L"),
    "local processes in a cluster": (["--local-processes", "2", "--auto-distributed"],
                                     "--local-processes N goes with no other multi-process option"),
    "local processes on a GPU": (["--local-processes", "2", "--platform", "gpu"], "--platform gpu cannot go with it"),
    "local processes that do not divide the devices": (["--local-processes", "3"],
                                                       "--local-processes 3 does not divide --devices 8"),
    "one-process strategies across processes": (["--local-processes", "2", "--strategies", "all"],
                                                "--strategies pmap,single: across processes only sharded"),
    # Refused once JAX runs and the data is read.
    "a missing data folder": (["--data-dir", "{tmp}/none"], "--data-dir {tmp}/none: "),
    "a truncated data file": (["--data-dir", "{inputs}/truncated"],
                              "--data-dir {inputs}/truncated: {inputs}/truncated/data_batch_3.bin: size"),
    "a batch larger than a shard": (["--data-dir", "{data}", "--devices", "8", "--batch-size", "14"],
                                    "batch_size=14 per device is larger than the smallest shard (12 samples"),
    "more devices than exist": (["--data-dir", "{data}", "--devices", "60"], "--devices 60: only 8 cpu device(s) exist"),
    # A resume, against its checkpoint.
    **{f"a resume with --{name.replace('_', '-')} contradicting it": (
        ["--resume-from", "{ck}", f"--{name.replace('_', '-')}", value],
        f"--resume-from {{ck}}: --{name.replace('_', '-')} {value} contradicts the checkpoint's run, which has "
        f"--{name.replace('_', '-')} ") for name, value in CONTRADICTIONS.items()},
    "a resume on other data": (["--resume-from", "{ck}", "--data-dir", "{other}"],
                               "--resume-from {ck}: the checkpoint was taken with train_data_blake2b="),
    "a stop at the checkpoint's run step": (["--resume-from", "{ck}", "--stop-after-step", "5", "--checkpoint-dir",
                                             "{tmp}/ck"], "--stop-after-step 5: the checkpoint has already trained "
                                                          "run steps 0-4; stop after more than 5"),
    "a stop past the run's end": (["--resume-from", "{ck}", "--stop-after-step", "9", "--checkpoint-dir", "{tmp}/ck"],
                                  "--stop-after-step 9: this run has only 8 run steps (epochs 0-1)"),
    "fewer epochs than the checkpoint's": (["--resume-from", "{ck}", "--epochs", "1"],
                                           "--epochs 1: the checkpoint is at epoch 1, step 1; give --epochs 2 or more"),
    "a backend without the checkpoint's arithmetic": (["--resume-from", "{ck}", "--backend", "dali"],
                                                      "--resume-from {ck}: the checkpoint's run has --normalize rocal, "
                                                      "but --backend dali computes dali_cpu or dali_gpu"),
    "a batch size contradicting the checkpoint's logical shards": (
        ["--resume-from", "{cck}", "--batch-size", "2"],
        "--batch-size 2 contradicts the checkpoint's run, which has --batch-size 4"),
}
OUTPUTS = {"--cache-dir": "cache", "--metrics-out": "m.jsonl", "--params-out": "p.npz"}


class Places(dict):
    """The placeholders of REFUSED, each fixture made only when a case names it."""

    def __init__(self, request, **given):
        super().__init__(**given)
        self.request = request

    def __missing__(self, key):
        fixture = {"data": "data", "other": "other_data", "ck": "stopped", "cck": "canonical_stopped"}[key]
        value = self.request.getfixturevalue(fixture)
        self[key] = str(getattr(value, "folder", value))
        return self[key]


@pytest.mark.parametrize("case", REFUSED)
def test_bad_input_is_refused_in_one_line_before_anything_is_trained_or_written(case, inputs, tmp_path, request):
    """Exit status 2 and one line on stderr, "refimpl.py: error: " naming the option and the
    value (after argparse's usage, no traceback); no strategy started; every output of the
    run (--cache-dir, --metrics-out, --params-out, --checkpoint-dir) in a folder left empty."""
    argv, said = REFUSED[case]
    places = Places(request, tmp=str(tmp_path), inputs=str(inputs))
    argv = [a.format_map(places) for a in argv]
    argv += [a for flag, name in OUTPUTS.items() if flag not in argv for a in (flag, tmp_path / name)]
    done = run_refimpl(argv)
    lines = done.err.splitlines()
    assert done.status == 2 and "Traceback" not in done.err, (done.status, done.err)
    assert lines[-1].startswith("refimpl.py: error: ") and said.format_map(places) in lines[-1], lines[-1]
    assert all(line.startswith(("usage: ", " ")) for line in lines[:-1]), lines
    assert "--- " not in done.out, done.out
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


def test_adam_without_optax_is_refused_naming_the_option(monkeypatch):
    """--optimizer adam needs optax: without it, one line naming the option and how to
    install it (exit status 2); sgd, the default, needs nothing. optax's absence is
    importlib's answer, made to say no."""
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "optax" else real(name, *a))
    done = run_refimpl(["--optimizer", "adam"])
    assert done.status == 2 and done.err.splitlines()[-1].startswith("refimpl.py: error: --optimizer adam: needs "
                                                                    "optax"), done.err
    import refimpl
    assert refimpl.parse_args(["--optimizer", "sgd"]).optimizer == "sgd"


def test_a_checkpoint_without_orbax_is_refused_before_anything_is_trained(monkeypatch, data, tmp_path):
    """--stop-after-step and --resume-from need orbax-checkpoint: without it, one line naming
    the option and how to install it, before training (a stop used to train first)."""
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("orbax") else real(name, *a))
    for argv, flag in (([*RUN, "--data-dir", data, "--stop-after-step", "2", "--checkpoint-dir", tmp_path / "ck"],
                        "--stop-after-step"), (["--resume-from", tmp_path / "ck"], "--resume-from")):
        if flag == "--resume-from":
            (tmp_path / "ck" / "run").mkdir(parents=True)
            (tmp_path / "ck" / "run" / "metadata").write_text("{}")
        done = run_refimpl(argv)
        assert done.status == 2 and done.err.splitlines()[-1] == (
            f"refimpl.py: error: {flag}: needs orbax-checkpoint, the checkpointer (python3 -m pip install -r "
            f"requirements.txt)"), done.err
        assert "--- " not in done.out, done.out


@pytest.mark.slow  # a child process: the extended tier
def test_a_checkpoint_whose_arrays_are_gone_is_refused_in_one_line(stopped, tmp_path):
    """A checkpoint whose array files were deleted: one line naming --resume-from and the first
    file missing, exit status 2, and nothing more on stderr (no tensorstore spec, no "Event
    loop is closed" at exit: the resume runs in a child process to see its exit)."""
    import sys
    folder = tmp_path / "ck"
    shutil.copytree(stopped.folder, folder)
    for data_dir in folder.glob("state/**/d"):
        shutil.rmtree(data_dir)
    [(code, out, err)] = run_children([[sys.executable, os.path.join(HERE, "refimpl.py"), "--resume-from", str(folder),
                                        "--platform", "cpu"]], timeout=120, cwd=HERE)
    lines = own_stderr(err).splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"refimpl.py: error: --resume-from {folder}: the checkpoint cannot be read (") \
        and "tensorstore_spec" not in lines[0] and len(lines[0]) < 600, lines[0]


# Every option's value when it is not given, as --help and docs/running.md state it (the
# notebooks' settings: 5 epochs, 16 a device, lr 0.001, the MLP 1024,1024), after parse_args
# resolved it (--hidden as widths, --strategies as the notebooks' pair).
DOCUMENTED_DEFAULTS = {
    "dataset": "cifar10", "hidden": (1024, 1024), "data_dir": None,
    "cache_dir": os.path.join(os.path.expanduser("~"), ".cache", "refimpl"), "epochs": 5, "batch_size": 16,
    "eval_batch_size": 256, "lr": 0.001, "optimizer": "sgd", "seed": 0, "logical_shards": None, "reduction": "plain",
    "strategies": ("sharded", "pmap"), "platform": None, "devices": None, "last_batch": "fill", "backend": "reference",
    "placement": "auto", "normalize": None, "matmul_precision": "highest", "metrics_out": None, "params_out": None,
    "compare_to": None, "coordinator": None, "num_processes": None, "process_id": None, "auto_distributed": False,
    "local_processes": None, "peer_timeout": 60, "stop_after_step": None, "checkpoint_dir": None,
    "resume_from": None}
DOCUMENTED_CHOICES = {
    "--dataset": ("cifar10", "mnist"), "--optimizer": ("sgd", "adam"), "--reduction": ("plain", "canonical"),
    "--last-batch": ("fill", "drop"), "--backend": ("reference", "rocal", "dali", "auto"),
    "--placement": ("auto", "host", "device"), "--normalize": ("rocal", "dali_cpu", "dali_gpu"),
    "--matmul-precision": ("default", "high", "highest"), "--platform": ("cpu", "gpu", "cuda", "rocm", "tpu")}


def test_every_option_left_out_has_its_documented_default_and_each_choice_is_taken():
    """DOCUMENTED_DEFAULTS, values and types; each of DOCUMENTED_CHOICES taken, a near miss
    (another case, another word) refused."""
    import refimpl
    got = vars(refimpl.parse_args([]))
    assert got == DOCUMENTED_DEFAULTS
    assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in DOCUMENTED_DEFAULTS.items()}
    for option, choices in DOCUMENTED_CHOICES.items():
        for choice in choices:
            assert getattr(refimpl.build_parser().parse_args([option, choice]), option[2:].replace("-", "_")) == choice
        for wrong in (choices[0].upper(), "x" + choices[-1]):
            with pytest.raises(SystemExit):
                refimpl.build_parser().parse_args([option, wrong])


def test_every_option_is_in_exactly_one_group_of_what_a_resume_does():
    """IDENTITY (from the checkpoint; a contradicting flag refused), CARRIED (from it unless
    given), OWN (this run's): each option in exactly one, and each IDENTITY option has its
    contradiction in REFUSED. Control: an option added to the parser and placed nowhere is found."""
    import refimpl

    def unplaced(parser):
        placed = [*refimpl.IDENTITY, *refimpl.CARRIED, *refimpl.OWN]
        return sorted(set(vars(parser.parse_args([]))) ^ set(placed)) + sorted({n for n in placed
                                                                                if placed.count(n) > 1})
    assert unplaced(refimpl.build_parser()) == []
    assert set(CONTRADICTIONS) == set(refimpl.IDENTITY)
    parser = refimpl.build_parser()
    parser.add_argument("--warmup-steps", type=int)
    assert unplaced(parser) == ["warmup_steps"]


@pytest.mark.parametrize("argv, want", [
    ([], ("sharded", "pmap")), (["--auto-distributed"], ("sharded", "shard_map")),
    (["--local-processes", "2"], ("sharded", "shard_map")),
    ([*MULTI[:4], "--process-id", "1"], ("sharded", "shard_map")),
    (["--strategies", "all"], ("sharded", "pmap", "shard_map", "single"))])
def test_the_default_strategies_follow_the_process_count(argv, want):
    """The notebooks' pair (sharded, pmap) in one process; with any multi-process option the
    pair that runs across processes (sharded, shard_map); 'all': every strategy, in order."""
    import refimpl
    assert refimpl.parse_args(argv).strategies == want


def test_main_exits_2_for_an_error_and_130_for_an_interrupt(monkeypatch):
    """A ValueError, OSError or ImportError of the run (a missing vendor library, a disk
    error) is one line on stderr and exit status 2; an interrupt, one line and 130."""
    import refimpl
    for error, status, line in ((ValueError("bad"), 2, "refimpl.py: error: bad"),
                                (OSError("no disk"), 2, "refimpl.py: error: no disk"),
                                (ImportError("no rocal"), 2, "refimpl.py: error: no rocal"),
                                (KeyboardInterrupt(), 130, "refimpl.py: interrupted")):
        def run(args, given, error=error):
            raise error
        monkeypatch.setattr(refimpl, "run", run)
        done = run_refimpl([])
        assert (done.status, done.out, done.err) == (status, "", line + "\n")


# --------------------------------------------------------------------------
# 2. A run
# --------------------------------------------------------------------------

METRICS_FIELDS = {"strategy", "epoch", "first_step", "last_step", "loss", "test_accuracy", "test_samples", "seconds",
                  "images_per_second", "steps", "devices", "platform", "backend", "dataset"}


def test_a_run_trains_every_strategy_and_reports_each_epoch_and_verdict(plain):
    """Each strategy's epoch line and --metrics-out row (epochs and steps numbered from 0,
    the test accuracy over each of the 16 test images once, at eval batch 5); the stepwise
    verdict of each strategy against the first, identical or within its bound; each final
    distance; exit status 0."""
    import refimpl
    assert plain.status == 0, plain.out + plain.err
    lines = plain.out.splitlines()
    assert lines[0].startswith("3 cpu device(s); cifar10: 100 training and 16 test images from ")
    assert "; 9 steps of 3 x 4 per epoch (fill); epochs 0-0; " in lines[0]
    assert [r["strategy"] for r in plain.rows] == list(refimpl.STRATEGY_NAMES)
    for row in plain.rows:
        assert set(row) == METRICS_FIELDS
        assert (row["epoch"], row["first_step"], row["last_step"], row["steps"]) == (0, 0, 8, 9), row
        assert (row["test_samples"], row["devices"]) == (16, 1 if row["strategy"] == "single" else 3), row
        assert 0 <= row["test_accuracy"] <= 1 and row["images_per_second"] * row["seconds"] == pytest.approx(100)
        assert f"--- {row['strategy']} ---" in lines
        assert any(line.startswith(f"{row['strategy']:>9} epoch 0 of 1  loss {row['loss']:.4f}  test accuracy "
                                   f"{row['test_accuracy']:.4f}  ") for line in lines), row
    for other in ("pmap", "shard_map", "single"):
        [verdict] = [line for line in lines if line.startswith("stepwise verdict, ") and f"sharded vs {other}," in line]
        assert verdict.startswith("stepwise verdict, identical: ") or ", within the bound of " in verdict, verdict
        assert sum(line.startswith(f"final params, sharded vs {other}: max |difference| ") for line in lines) == 1
    assert "FAILED" not in plain.out


@pytest.mark.slow
def test_a_run_trains_each_epoch_once_and_says_its_images_per_second(data, plain):
    """Every epoch line gives the epoch's images/s, and no epoch is trained twice: the data's
    cost against prebuilt batches is bench.py's feeding section, not an extra epoch of the
    main job (each strategy's epochs are its lines, the losses and metrics rows).
    The extended tier's; the default tier holds its guarantee with
    test_a_run_trains_every_strategy_and_reports_each_epoch_and_verdict."""
    import re
    done = run_refimpl(["--data-dir", data, *RUN, "--epochs", "2", "--batch-size", "4", "--devices", "2",
                        "--strategies", "sharded,single"])
    assert done.status == 0, done.out + done.err
    epochs = [line for line in done.out.splitlines() if re.match(r" *(sharded|single) epoch \d of 2 ", line)]
    assert len(epochs) == 4 and all(re.search(r"  +\d+ images/s", line) for line in epochs), epochs
    assert "prebuilt" not in done.out and "again" not in done.out, done.out


@pytest.mark.parametrize("run", ["plain", pytest.param("mnist", marks=pytest.mark.slow)])
def test_what_a_run_trains_is_what_the_modules_train_by_hand(run, request):
    """A run by hand: make_loader (shuffled by --seed, fill, the notebook's normalisation:
    rocAL's (x - 127.5) / 127.5 for cifar10, DALI's x / 255 for mnist), init_model of the
    widths, each strategy with the optimizer (SGD; optax.adam), the validation on the first
    device: each strategy's params and optimizer state (--params-out) and its epoch's loss and
    test accuracy (--metrics-out), bit for bit."""
    import jax
    import loaders
    import model
    import optax
    import strategies
    done = request.getfixturevalue(run)
    assert done.status == 0, done.out + done.err
    r = types.SimpleNamespace(**done.recipe)
    devices = jax.devices("cpu")[:r.devices]  # the run's own (run_refimpl: --platform cpu)
    mesh = loaders.data_mesh(devices)
    test = loaders.make_loader(r.test, devices[:1], r.eval_batch_size, normalize=r.normalize)
    optimizer = strategies.sgd(r.optimizer[1]) if r.optimizer[0] == "sgd" else optax.adam(r.optimizer[1])
    with np.load(done.params) as f:
        written = dict(f)
    rows = {row["strategy"]: row for row in done.rows}
    for name in rows:
        loader = loaders.make_loader(r.train, mesh, r.batch_size, layout=strategies.LAYOUT[name], shuffle=True,
                                     seed=r.seed, normalize=r.normalize)
        params, losses, state = strategies.STRATEGIES[name](model.init_model(r.layers), loader.epoch(0), mesh,
                                                            loss_terms=model.loss_terms, optimizer=optimizer)
        for prefix, tree in ((f"{name}/", params), (f"{name}/opt_state/", state)):
            leaves = jax.tree.leaves(tree)
            assert len([k for k in written if k.startswith(prefix) and k[len(prefix):].isdigit()]) == len(leaves)
            for i, leaf in enumerate(leaves):
                assert_same_bits(written[f"{prefix}{i}"], np.asarray(leaf), f"{prefix}{i}")
        assert (rows[name]["loss"], rows[name]["test_accuracy"]) == (float(np.mean(losses)),
                                                                     model.accuracy(params, test.epoch(0))), name


def test_synthetic_data_is_generated_once_from_the_seed(mnist, tmp_path, capsys):
    """Without --data-dir the run generates synthetic_mnist's data of --seed (2048 and 512
    images) into --cache-dir, says so, and a later run takes that folder as it is."""
    import refimpl
    from cifar_mnist import read_mnist, synthetic_mnist
    [folder] = list(mnist.cache.iterdir())
    assert f"generated synthetic mnist in {folder}" in mnist.out
    assert "mnist: 2048 training and 512 test images" in mnist.out and "dali_cpu's arithmetic" in mnist.out
    mine = synthetic_mnist(tmp_path, seed=7, **refimpl.SYNTHETIC)
    for split in ("train", "test"):
        for a, b in zip(read_mnist(folder, split), read_mnist(mine, split)):
            assert_same_bits(a, b, split)
    capsys.readouterr()
    assert refimpl.synthetic_dataset(str(mnist.cache), "mnist", 7) == str(folder)
    assert capsys.readouterr().out == "" and list(mnist.cache.iterdir()) == [folder]


def scaled_terms(params, batch):
    """model.loss_terms with the total 1% too large: a gradient 1% too large."""
    import model
    total, count = model.loss_terms(params, batch)
    return total * 1.01, count


def test_a_wrong_strategy_ends_the_run_with_exit_status_1_and_its_verdict_last(data, monkeypatch):
    """single planted with a gradient 1% too large (its training and its stepwise verdict):
    the verdict is OUTSIDE, printed after every other line, then the FAILED line, and the
    run exits 1. The control: the same strategies right, in the run above, end 0."""
    import strategies
    real = strategies.STRATEGIES["single"]

    def wrong(params, batches, mesh, *, loss_terms, **options):
        return real(params, batches, mesh, loss_terms=scaled_terms, **options)
    monkeypatch.setitem(strategies.STRATEGIES, "single", wrong)
    done = run_refimpl(["--data-dir", data, *RUN, "--batch-size", "4", "--devices", "3", "--strategies", "sharded,single"])
    lines = done.out.splitlines()
    assert done.status == 1, done.out + done.err
    assert lines[-2].startswith("stepwise verdict, sharded vs single, ") and ", OUTSIDE the bound of " in lines[-2]
    assert lines[-1] == "refimpl.py: FAILED: 1 verdict(s) above; exit status 1", lines[-1]


def test_backend_auto_and_the_arithmetic_are_chosen_as_documented(monkeypatch):
    """--backend auto: rocal for cifar10 where rocal_loader.usable says so of the run's
    devices, else dali where dali_loader.usable does, else the reference. The arithmetic:
    --normalize when given; else DALI's for these devices, rocAL's "rocal", the reference
    backend the notebook's (cifar10 rocal, mnist dali_cpu). The vendors' answers stand in."""
    import dali_loader
    import refimpl
    import rocal_loader
    devices = object()
    for rocal, dali, dataset, want in ((True, True, "cifar10", "rocal"), (True, True, "mnist", "dali"),
                                       (False, True, "cifar10", "dali"), (False, False, "cifar10", "reference")):
        monkeypatch.setattr(rocal_loader, "usable", lambda d, rocal=rocal: d is devices and rocal)
        monkeypatch.setattr(dali_loader, "usable", lambda d, dali=dali: d is devices and dali)
        assert refimpl.choose_backend("auto", dataset, devices) == want, (rocal, dali, dataset)
        assert refimpl.choose_backend("reference", dataset, devices) == "reference"
    monkeypatch.setattr(dali_loader, "arithmetic_for", lambda d: "dali_gpu" if d is devices else None)
    for backend, normalize, dataset, want in (("dali", None, "mnist", "dali_gpu"), ("rocal", None, "cifar10", "rocal"),
                                              ("reference", None, "cifar10", "rocal"),
                                              ("reference", None, "mnist", "dali_cpu"),
                                              ("dali", "dali_cpu", "mnist", "dali_cpu")):
        assert refimpl.choose_arithmetic(backend, normalize, dataset, devices) == want, (backend, normalize)


def test_each_backend_is_handed_the_runs_loader_for_each_layout(monkeypatch, tmp_path):
    """Each backend's maker gets the run's options for each layout the strategies need: the
    training arrays (rocAL: the data folder), the mesh, --batch-size, shuffled by --seed,
    --last-batch, the run's Normalize, --logical-shards; the reference loader its placement
    (auto: "device" unless loaders.device_fit says why not, then "host"), the vendors
    --cache-dir. The makers stand in."""
    import dali_loader
    import loaders
    import refimpl
    import rocal_loader
    calls = []

    def maker(backend):
        def make(data, mesh, batch_size, **options):
            calls.append((backend, data, mesh, batch_size, options))
            return types.SimpleNamespace(describe=lambda: backend)
        return make
    monkeypatch.setattr(loaders, "make_loader", maker("reference"))
    monkeypatch.setattr(rocal_loader, "make_rocal_loader", maker("rocal"))
    monkeypatch.setattr(dali_loader, "make_dali_loader", maker("dali"))
    args = refimpl.parse_args(["--strategies", "pmap,sharded", "--seed", "9", "--last-batch", "drop", "--batch-size",
                               "16", "--logical-shards", "4", "--cache-dir", str(tmp_path)])
    job = types.SimpleNamespace(train_data=(np.zeros((10, 3, 4, 5), np.uint8), np.zeros(10, np.int32)),
                                mesh=object(), normalize=object(), data_dir="the-folder")
    common = dict(shuffle=True, seed=9, last_batch="drop", normalize=job.normalize, logical_shards=4)
    for backend, placement, fit, want in (("reference", "auto", None, dict(placement="device")),
                                          ("reference", "auto", "too big", dict(placement="host")),
                                          ("reference", "host", None, dict(placement="host")),
                                          ("rocal", "auto", None, dict(cache_dir=str(tmp_path))),
                                          ("dali", "auto", None, dict(cache_dir=str(tmp_path)))):
        monkeypatch.setattr(loaders, "device_fit", lambda data, mesh, fit=fit: fit if (
            data is job.train_data and mesh is job.mesh) else pytest.fail("device_fit asked about other data"))
        calls.clear()
        args.placement, job.backend = placement, backend
        made, how = refimpl.training_loaders(args, job)
        data = "the-folder" if backend == "rocal" else job.train_data
        assert sorted(made) == ["pmap", "sharded"] and how.startswith(backend), (made, how)
        assert sorted(calls, key=lambda c: c[4]["layout"]) == [
            (backend, data, job.mesh, 16, dict(layout=layout, **want, **common)) for layout in ("pmap", "sharded")]


def test_jax_is_configured_before_it_touches_a_device(monkeypatch):
    """start_jax: --platform (when given), --matmul-precision, and as many virtual CPU
    devices as --devices asks (at least 8 in one process, at most 64; exactly --devices in a
    process of several, which then joins the others), all before the first jax.devices().
    JAX's config stands in, recording; this process's JAX has long started."""
    import jax
    import refimpl
    done = []
    monkeypatch.setattr(jax.config, "update", lambda key, value: done.append((key, value)))
    monkeypatch.setattr(jax, "devices", lambda *a: done.append("devices"))
    monkeypatch.setattr(refimpl, "connect", lambda args: done.append("connect"))
    for argv, platform, cpus, joins in ((["--platform", "cpu", "--devices", "12"], "cpu", 12, False),
                                        (["--devices", "2", "--matmul-precision", "high"], None, 8, False),
                                        (["--platform", "gpu", "--devices", "100"], "gpu", 8, False),
                                        (["--devices", "2", "--auto-distributed"], None, 2, True),
                                        (["--auto-distributed"], None, 8, True)):
        done.clear()
        args = refimpl.parse_args(argv)
        refimpl.start_jax(args)
        assert done == [("jax_platforms", platform)] * bool(platform) + [
            ("jax_default_matmul_precision", args.matmul_precision), ("jax_num_cpu_devices", cpus)] + [
            "connect"] * joins + ["devices"], (argv, done)


def test_a_resumed_run_trains_at_its_checkpoints_matmul_precision(data, tmp_path):
    """--matmul-precision is the checkpoint's on a resume (an IDENTITY option), and JAX
    computes at it, though the flag is left out and JAX starts before the checkpoint is read.
    The control: the stopped run set it as given."""
    import jax
    folder = tmp_path / "ck"
    done = run_refimpl(["--data-dir", data, *RUN, "--batch-size", "4", "--devices", "8", "--strategies", "sharded",
                     "--matmul-precision", "high", "--stop-after-step", "1", "--checkpoint-dir", folder])
    assert done.status == 0 and jax.config.jax_default_matmul_precision == "high", done.err
    jax.config.update("jax_default_matmul_precision", "highest")  # as a new process starts
    done = run_refimpl(["--resume-from", folder])
    assert done.status == 0 and "matmul precision high" in done.out, done.out + done.err
    assert jax.config.jax_default_matmul_precision == "high"


# --------------------------------------------------------------------------
# 3. The canonical reduction
# --------------------------------------------------------------------------


@pytest.mark.bits
def test_canonical_runs_are_the_same_bits_pair_by_pair_and_on_another_device_count(canonical, data, tmp_path):
    """On 4 devices sharded and single (one device adding the 8 logical shards as
    microbatches) are said bit-identical; on 2 devices, --compare-to the 4-device run's
    --params-out says each strategy bit-identical, exit 0. The control: that file with one
    bit of sharded's first leaf flipped and single's second leaf missing fails the run, each
    named (the leaf and the entry; the missing name), a FAILED line last, exit status 1."""
    assert "final params and optimizer state, sharded vs single: bit-identical (the canonical reduction over 8 " \
           "logical shards)" in canonical.out.splitlines()
    done = run_refimpl(["--data-dir", data, *CANONICAL, "--devices", "2", "--compare-to", canonical.params])
    assert done.status == 0, done.out + done.err
    for name in ("sharded", "single"):
        assert f"final params and optimizer state of {name} against {canonical.params}: bit-identical" in done.out
    with np.load(canonical.params) as f:
        arrays = dict(f)
    arrays["sharded/0"].reshape(-1).view(np.uint32)[5] ^= 1
    del arrays["single/1"]
    np.savez(tmp_path / "bad.npz", **arrays)
    done = run_refimpl(["--data-dir", data, *CANONICAL, "--devices", "2", "--compare-to", tmp_path / "bad.npz"])
    lines = done.out.splitlines()
    assert done.status == 1, done.out + done.err
    against = f"final params and optimizer state of {{}} against {tmp_path / 'bad.npz'}: NOT bit-identical: "
    assert lines[-3].startswith(against.format("sharded") + "leaf ['sharded/0']: 1 of ") and \
        "the first at flat index 5: " in lines[-3], lines[-3]
    assert lines[-2] == against.format("single") + "it holds no 'single/1'", lines[-2]
    assert lines[-1] == "refimpl.py: FAILED: 2 verdict(s) above; exit status 1", lines[-1]


def test_first_difference_tells_every_bit_apart():
    """The canonical verdicts' test: -0.0 is not 0.0, another dtype or structure differs, a
    NaN equals itself."""
    import refimpl
    a = {"w": np.array([0.0, np.nan], np.float32), "count": np.array(3, np.int32)}
    assert refimpl.first_difference(a, {k: v.copy() for k, v in a.items()}) is None
    assert "1 of 2 entries differ, the first at flat index 0" in refimpl.first_difference(
        a, dict(a, w=np.array([-0.0, np.nan], np.float32)))
    assert "int64" in refimpl.first_difference(a, dict(a, count=np.array(3, np.int64)))
    assert "the trees differ" in refimpl.first_difference(a, {"w": a["w"]})


# --------------------------------------------------------------------------
# 4. Checkpoint and resume
# --------------------------------------------------------------------------


def exactly_once(name: str, epoch: int) -> str:
    return f"{name} epoch {epoch}, counted by sample index over the runs that delivered it: "


def test_stopped_on_8_devices_and_resumed_on_3_every_sample_is_delivered_once(stopped, tmp_path, monkeypatch):
    """The stop writes one orbax checkpoint (its run, its loader's state at run step 5 = epoch
    1, step 1, each strategy's state) and says where the next run starts; --resume-from with
    --devices 3 (the other flags from the checkpoint; its own values may be given again)
    trains the rest of epoch 1 and reports every sample of it delivered exactly once,
    counted by index across both runs; a stop after the run's last step (epoch 1 ends at run
    step 10 on these shards) is taken. The control: a loader that restarts the epoch on the
    new shards instead is reported, exit status 1."""
    import orbax.checkpoint as ocp
    from plan import LoaderState
    assert "stopped after run steps 0-4: the next, run step 5, is epoch 1, step 1; checkpoint " in stopped.out
    items = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
        stopped.folder, args=ocp.args.Composite(run=ocp.args.JsonRestore(), loader=ocp.args.JsonRestore()))
    state = LoaderState.from_json(json.dumps(items["loader"]))
    assert (items["run"]["run_step"], state.epoch, state.step, state.segments) == (5, 1, 1, ((0, 8, 4),))
    resume = ["--resume-from", stopped.folder, "--devices", "3", "--hidden", "8", "--metrics-out", tmp_path / "m.jsonl",
              "--stop-after-step", "11", "--checkpoint-dir", tmp_path / "end"]
    done = run_refimpl(resume)
    assert done.status == 0, done.out + done.err
    assert f"resuming {stopped.folder} at run step 5 = epoch 1, step 1 " in done.out
    assert exactly_once("sharded", 1) + "every one of the 100 samples delivered exactly once" in done.out
    assert "stopped after run steps 0-10: the next, run step 11, is epoch 2, step 0" in done.out
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["first_step"]) for r in rows] == [(1, 1)], rows

    import loaders
    real = loaders.Loader.epoch
    monkeypatch.setattr(loaders.Loader, "epoch", lambda self, epoch, *, state=None: real(self, epoch))
    done = run_refimpl(resume)
    assert done.status == 1 and "more than once" in done.out, done.out
    assert done.out.splitlines()[-1].startswith("refimpl.py: FAILED: "), done.out


def test_with_drop_a_resume_skips_the_stated_count(data, tmp_path):
    """--last-batch drop, 8 devices of 4 stop after step 0 (32 delivered) and 3 resume: the
    68 left, shards of 23, 23 and 22, make 5 steps of 3 x 4 (60 delivered); each sample at
    most once and the 8 skipped said."""
    common = ["--data-dir", data, *RUN, "--batch-size", "4", "--last-batch", "drop", "--strategies", "sharded"]
    assert run_refimpl([*common, "--devices", "8", "--stop-after-step", "1", "--checkpoint-dir", tmp_path]).status == 0
    done = run_refimpl(["--resume-from", tmp_path, "--devices", "3"])
    assert done.status == 0, done.out + done.err
    assert exactly_once("sharded", 0) + "each sample at most once, 8 skipped, as elastic_plan states for drop" \
        in done.out.splitlines(), done.out


def test_drops_verdict_holds_the_delivered_counts_to_the_stated_skips():
    """refimpl.exactly_once for drop: kept only when no sample is delivered twice and exactly
    elastic_plan's stated samples never; one more never delivered, one of them delivered, or
    one delivered twice, each fails, naming the counts. (Counts made by hand from the plan.)"""
    import refimpl
    from plan import LoaderState, remaining_samples
    state = LoaderState(100, seed=0, epoch=0, step=1, shuffle=True, last_batch="drop",
                        segments=((0, 8, 4), (1, 3, 4)))
    skipped = remaining_samples(100, state.segments, state.num_steps, seed=0,
                                shuffle=True, last_batch="drop")
    counts = np.ones(100, np.int32)
    counts[skipped] = 0
    ok, line = refimpl.exactly_once("sharded", 0, counts, state, "drop", 0)
    assert ok and line.endswith(f"each sample at most once, {len(skipped)} skipped, as elastic_plan states for drop")
    delivered = np.flatnonzero(counts)
    for what, changed in (("one more never", {delivered[0]: 0}), ("a stated skip delivered", {skipped[0]: 1}),
                          ("one twice", {delivered[1]: 2})):
        wrong = counts.copy()
        for i, v in changed.items():
            wrong[i] = v
        ok, line = refimpl.exactly_once("sharded", 0, wrong, state, "drop", 0)
        assert not ok and "NOT exactly once" in line, (what, line)


@pytest.mark.bits
def test_canonical_stopped_on_4_devices_and_resumed_on_3_ends_on_the_uninterrupted_bits(canonical, canonical_stopped):
    """The canonical run over 8 logical shards stopped on 4 devices before its masked step
    and resumed on 3, which do not divide 8, with --resume-from alone: every sample once, and
    --compare-to the uninterrupted 4-device run says each strategy bit-identical, params and
    Adam's state."""
    done = run_refimpl(["--resume-from", canonical_stopped.folder, "--devices", "3", "--compare-to", canonical.params])
    assert done.status == 0, done.out + done.err
    for name in ("sharded", "single"):
        assert exactly_once(name, 0) + "every one of the 100 samples delivered exactly once" in done.out
        assert f"final params and optimizer state of {name} against {canonical.params}: bit-identical" in done.out
        # the epoch's reported loss: the checkpoint's steps' losses with the resumed ones, as uninterrupted
        [whole] = [line for line in canonical.out.splitlines() if line.startswith(f"{name:>9} epoch 0 of 1  loss ")]
        [resumed] = [line for line in done.out.splitlines() if line.startswith(f"{name:>9} epoch 0 of 1  loss ")]
        assert resumed.split("  test")[0] == whole.split("  test")[0], (resumed, whole)


def test_a_loader_that_cannot_resume_on_other_shards_is_refused_naming_the_backend(stopped, tmp_path, monkeypatch):
    """A backend whose loader resumes an epoch only on the shards that wrote the state (as
    a vendor's own order does) refuses the resume on 3 devices: one line naming --backend
    and the loader's reason, exit status 2, nothing trained or written."""
    import loaders
    real = loaders.Loader.epoch

    def own_shards_only(self, epoch, *, state=None):
        if state is not None and state.segments[-1][1] != self.num_shards:
            raise ValueError("Loader.epoch: this order resumes only on the shards that wrote the state")
        return real(self, epoch, state=state)
    monkeypatch.setattr(loaders.Loader, "epoch", own_shards_only)
    done = run_refimpl(["--resume-from", stopped.folder, "--devices", "3", "--metrics-out", tmp_path / "m.jsonl"])
    assert done.status == 2, done.out + done.err
    assert done.err.splitlines() == ["refimpl.py: error: --backend reference: Loader.epoch: this order resumes only "
                                     "on the shards that wrote the state"], done.err
    assert "--- " not in done.out and os.listdir(tmp_path) == [], (done.out, os.listdir(tmp_path))


# --------------------------------------------------------------------------
# --run-slow
# --------------------------------------------------------------------------


@pytest.mark.slow
def test_a_chain_of_stops_delivers_every_sample_once_to_the_runs_very_end(stopped, tmp_path):
    """The checkpoint of ``stopped`` (8 devices, at run step 5 = epoch 1, step 1) resumed on 3
    devices for one run step (--stop-after-step 6, the least it takes); that resumed on 8
    to the run's last step (--stop-after-step 8); that resumed with --epochs 3 on 3 devices,
    which trains epoch 2. Epoch 1 is delivered exactly once over the three runs that
    trained it."""
    done = run_refimpl(["--resume-from", stopped.folder, "--devices", "3", "--stop-after-step", "6",
                     "--checkpoint-dir", tmp_path / "a"])
    assert done.status == 0, done.out + done.err
    assert "sharded epoch 1 so far, counted by sample index: " in done.out
    assert "stopped after run steps 0-5: the next, run step 6, is epoch 1, step 2" in done.out
    done = run_refimpl(["--resume-from", tmp_path / "a", "--devices", "8", "--stop-after-step", "8",
                     "--checkpoint-dir", tmp_path / "b"])
    assert done.status == 0, done.out + done.err
    assert exactly_once("sharded", 1) + "every one of the 100 samples delivered exactly once" in done.out
    assert "stopped after run steps 0-7: the next, run step 8, is epoch 2, step 0" in done.out
    done = run_refimpl(["--resume-from", tmp_path / "b", "--devices", "3", "--epochs", "3"])
    assert done.status == 0 and "  sharded epoch 2 of 3  loss " in done.out, done.out + done.err


# Refusals a fresh process shows: JAX's platform chosen before it starts, jax.distributed's
# cluster detection; and argparse's exit as a process sees it.
IN_A_PROCESS = {
    "a platform JAX cannot start": (["--platform", "tpu"], "--platform tpu: JAX cannot start it here"),
    # where no socket opens (a TPU host), the socket refusal comes first: JAX is never asked for a cluster
    "no cluster to detect": (["--auto-distributed"], "--auto-distributed: " + (
        "this machine cannot open a TCP socket" if NO_SOCKETS else "no cluster was detected")),
    "a seed of 2**32": REFUSED["a seed of 2**32"],
}


@pytest.mark.slow
def test_refusals_in_a_process_of_its_own(data, tmp_path):
    """As in this process: exit status 2, the one line last, no traceback, nothing trained or
    written."""
    names = list(IN_A_PROCESS)
    commands = [[sys.executable, os.path.join(HERE, "refimpl.py"), "--data-dir", str(data), *IN_A_PROCESS[n][0],
                 "--cache-dir", str(tmp_path / n)] for n in names]
    for name, (code, out, err) in zip(names, run_children(commands, timeout=100, cwd=HERE)):
        assert code == 2 and "Traceback" not in err, (name, code, err)
        assert err.splitlines()[-1].startswith("refimpl.py: error: " + IN_A_PROCESS[name][1]), (name, err)
        assert "--- " not in out and not (tmp_path / name).exists(), (name, out)


@pytest.mark.slow
def test_a_long_epoch_fed_by_the_prefetching_loader_does_not_deadlock(tmp_path):
    """49 steps of 8 devices x 128 rows from the host (placement host, prefetch) once
    deadlocked XLA's all-reduce rendezvous (unbounded asynchronous dispatch;
    strategies.train_loop now keeps two steps in flight); 24 steps did not show it."""
    images, labels = read_cifar10(synthetic_cifar10(tmp_path / "small", num_train=5000, num_test=64, seed=1))
    (tmp_path / "big").mkdir()
    write_cifar10(tmp_path / "big" / "data_batch_1.bin", np.tile(images, (10, 1, 1, 1)), np.tile(labels, 10))
    write_cifar10(tmp_path / "big" / "test_batch.bin", images[:64], labels[:64])
    [(code, out, err)] = run_children([[sys.executable, os.path.join(HERE, "refimpl.py"), "--data-dir",
                                        str(tmp_path / "big"), "--epochs", "1", "--strategies", "sharded",
                                        "--batch-size", "128", "--devices", "8", "--placement", "host"]],
                                      timeout=100, cwd=HERE)
    assert code == 0, err[-2000:]
    assert "49 steps of 8 x 128" in out and "  sharded epoch 0 of 1  loss " in out, out


@pytest.mark.slow  # a main job and a verdict of their own
def test_only_the_main_job_gives_freed_memory_back(data, monkeypatch, devices):
    """glibc's malloc_trim is the job's choice: a strategy's run and the stepwise verdict never
    call it, while refimpl.py calls it after each epoch and each run of its verdict. The
    calls are counted through ctypes; the same count shows the main job making them. The
    verdict's ``after_run`` hook runs after each strategy's run of each step."""
    import ctypes
    import equivalence
    import loaders
    import model
    import strategies
    trims = []
    real = ctypes.CDLL

    class Counting:
        def __init__(self, name, *args, **kwargs):
            self.lib = real(name, *args, **kwargs)

        def __getattr__(self, attr):
            if attr == "malloc_trim":
                return lambda *a: trims.append(a) or 1
            return getattr(self.lib, attr)
    monkeypatch.setattr(ctypes, "CDLL", Counting)
    mesh = loaders.data_mesh(devices[:2])
    params = model.init_model((3072, 4, 10))
    batches = list(loaders.make_loader(read_cifar10(data), mesh, 4, prefetch=0).epoch(0))[:2]
    hosts = [{k: np.asarray(v) for k, v in b.items()} for b in batches]
    strategies.sharded(params, batches, mesh, loss_terms=model.loss_terms)
    runs = []
    equivalence.stepwise_verdict("sharded", "pmap", params, hosts, mesh, loss_terms=model.loss_terms,
                                 after_run=lambda: runs.append(1))
    assert trims == [] and len(runs) == 2 * len(hosts)  # its hook: after each strategy's run of each step
    done = run_refimpl(["--data-dir", data, *RUN, "--batch-size", "4", "--devices", "2", "--strategies",
                        "sharded,single"])
    assert done.status == 0, done.out + done.err
    assert len(trims) >= 2, trims  # an epoch each, then the verdict's steps


def test_a_coordinators_port_is_drawn_below_the_ephemeral_range_and_binds():
    """refimpl.loopback_port draws the coordinator's port from the 8,192 ports below the kernel's
    ephemeral range, where no bind to port 0 nor outgoing connection can take it between the
    probe and the coordinator's bind; the port binds. The control: a bind to port 0 lands in the
    range."""
    import socket
    import refimpl
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except OSError:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range here (not Linux)")
    ports = {refimpl.loopback_port("test") for _ in range(16)}
    assert all(low - 8192 <= port < low for port in ports) and len(ports) > 1, (low, ports)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", min(ports)))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        assert probe.getsockname()[1] >= low, "control: the kernel's own choice"
