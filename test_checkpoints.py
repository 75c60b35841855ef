"""checkpoints.py, refimpl's checkpoint machinery (--stop-after-step,
--checkpoint-dir, --resume-from), and the guarantee it exists for: a refimpl.py run
stopped on some devices and resumed on others trains every sample exactly once.

Guarantees checked:

* The exactly-once count (``checkpoints.Deliveries``, from the delivered rows) on
  real deliveries of the reference loader: the right resume passes; a restart of
  the epoch from step 0 on the new shards (samples twice), a resume that reads
  the new size's fresh plan from the step (samples missed), and a row that is no
  sample are each reported, in words; drop is held to its stated count.
* The checkpoint: a reader never sees half of one (a write that dies midway
  leaves the previous checkpoint whole; ``write_checkpoint``,
  ``read_checkpoint``), an arrays file that is not the one named is refused, a
  checkpoint of another run is refused naming the field (``run_identity``,
  ``check_identity``), refimpl's bad options are refused, and a backend whose
  loader takes no state refuses a resize with its reason (``resumed_epoch``).
* End to end (a child refimpl.py, 4 devices stop, 3 resume): the report says
  every sample was delivered exactly once across the change, and the strategies
  agree within their bound. With --run-slow: the issue's two resizes (2
  processes of 4 devices stop at step 7 and 1 process of 8 resumes, within the
  cross-process bound of an uninterrupted run; 8 devices stop and 3 resume), a
  resume on the same devices bit-identical to an uninterrupted run, and host vs
  device placement bit-identical across a resize.

The loader's own resume (``epoch(e, state=...)``): test_loaders_resume.py.
"""

import json
import os
import sys

import numpy as np
import pytest

import checkpoints
import equivalence
import loaders
import refimpl
from arithmetic import Normalize
from cifar_mnist import synthetic_cifar10
from conftest import assert_same_bits, meshes, run_children
from plan import LoaderState


HERE = os.path.dirname(os.path.abspath(__file__))
N = 97  # the same dataset size, seed and epoch as test_loaders_resume.py's
SEED, EPOCH = 11, 2


# --------------------------------------------------------------------------
# checkpoints.Deliveries, refimpl's exactly-once count, on real deliveries (in-process)
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def counting(devices):
    """Two loaders as refimpl builds them (tuple form, Normalize), and Deliveries."""
    rng = np.random.default_rng(9)
    train = (rng.integers(0, 256, (N, 3, 4, 4)).astype(np.uint8), rng.integers(0, 10, N).astype(np.int32))
    norm = Normalize(mean=(127.5,) * 3, std=(127.5,) * 3)
    mesh8, mesh3, _ = meshes(devices)
    made = [loaders.make_loader(train, mesh, B, shuffle=True, seed=SEED, normalize=norm, placement=p)
            for mesh, B, p in ((mesh8, 4, "device"), (mesh3, 5, "host"))]
    return made, checkpoints.Deliveries(train, norm), train


def count(deliveries, *iterators):
    vector = deliveries.zeros()
    for batches in iterators:
        for batch in batches:
            deliveries.count(batch, vector)
    return vector


def test_deliveries_pass_the_right_resume(counting):
    (l8, l3), deliveries, _ = counting
    saved = l8.state(EPOCH, 2)
    vector = count(deliveries, checkpoints.taken(l8.epoch(EPOCH), 2), l3.epoch(EPOCH, state=saved))
    ok, said = deliveries.verdict(vector, "fill", 0)
    assert ok and said == f"every one of the {N} samples delivered in exactly one real slot", said


def test_deliveries_report_a_restart_from_step_0(counting):
    (l8, l3), deliveries, _ = counting
    vector = count(deliveries, checkpoints.taken(l8.epoch(EPOCH), 2), l3.epoch(EPOCH))
    ok, said = deliveries.verdict(vector, "fill", 0)
    assert not ok and "64 sample(s) delivered more than once" in said, said


def test_deliveries_report_a_fresh_plan_read_from_the_step(counting):
    (l8, l3), deliveries, _ = counting
    vector = count(deliveries, checkpoints.taken(l8.epoch(EPOCH), 2), l3.epoch(EPOCH, start_step=2))
    ok, said = deliveries.verdict(vector, "fill", 0)
    assert not ok and "never delivered" in said and "more than once" in said, said


def test_deliveries_report_a_row_that_is_no_sample(counting):
    (l8, l3), deliveries, _ = counting
    vector = count(deliveries, l8.epoch(EPOCH))
    assert deliveries.verdict(vector, "fill", 0)[0]
    batch = dict(l8.batch(EPOCH, 0))
    batch["images"] = batch["images"] + np.float32(1e-3)  # the same samples, other bits
    count_one = count(deliveries, [batch])
    ok, said = deliveries.verdict(vector + count_one, "fill", 0)
    assert not ok and "row(s) that are no sample of the data" in said, said


def test_deliveries_hold_drop_to_its_stated_count(counting):
    (l8, _), deliveries, train = counting
    drop = loaders.make_loader(train, l8.mesh, 4, shuffle=True, seed=SEED, normalize=l8.normalize,
                               last_batch="drop")
    vector = count(deliveries, drop.epoch(0))
    skipped = N - drop.real_samples(0)
    assert deliveries.verdict(vector, "drop", skipped)[0]
    ok, said = deliveries.verdict(vector, "drop", skipped - 1)
    assert not ok and f"where elastic_plan states {skipped - 1} skipped" in said, said


# --------------------------------------------------------------------------
# The checkpoint files (checkpoints.py) and refimpl's options (in-process)
# --------------------------------------------------------------------------


def test_a_checkpoint_write_that_dies_leaves_the_previous_one(tmp_path, monkeypatch):
    state = LoaderState.start(N, 8, 4, seed=SEED, shuffle=True).at_step(2)
    doc = {"format": checkpoints.CHECKPOINT_FORMAT, "run": {}, "run_step": 2,
           "loader_state": json.loads(state.to_json())}
    first = {"params/sharded/0": np.arange(6, dtype=np.float32)}
    checkpoints.write_checkpoint(str(tmp_path), dict(doc), first)

    def dies(f, **arrays):
        f.write(b"PK\x03\x04 half an archive")
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(np, "savez", dies)
    with pytest.raises(OSError, match="simulated"):
        checkpoints.write_checkpoint(str(tmp_path), dict(doc, run_step=3), {"params/sharded/0": np.zeros(6)})
    monkeypatch.undo()
    got, arrays = checkpoints.read_checkpoint(str(tmp_path))
    assert got["run_step"] == 2 and got["loader_state"] == state
    assert_same_bits(arrays["params/sharded/0"], first["params/sharded/0"], "the previous arrays")
    # A later write replaces it and removes the arrays file no longer named.
    checkpoints.write_checkpoint(str(tmp_path), dict(doc, run_step=3), {"params/sharded/0": np.ones(6)})
    assert checkpoints.read_checkpoint(str(tmp_path))[0]["run_step"] == 3
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".npz")]) == 1

    named = json.loads((tmp_path / checkpoints.CHECKPOINT_FILE).read_text())["arrays_file"]
    with open(tmp_path / named, "ab") as f:
        f.write(b"x")
    with pytest.raises(ValueError, match="has SHA-256 .* not this checkpoint's"):
        checkpoints.read_checkpoint(str(tmp_path))
    (tmp_path / checkpoints.CHECKPOINT_FILE).write_text(json.dumps({"format": "other/1"}))
    with pytest.raises(ValueError, match="is not a refimpl.checkpoint/1 checkpoint"):
        checkpoints.read_checkpoint(str(tmp_path))


@pytest.mark.parametrize("change, field", [
    (["--seed", "1"], "--seed=0"), (["--strategies", "sharded"], "--strategies="),
    (["--last-batch", "drop"], "--last-batch="), (["--lr", "0.01"], "--lr="),
    (["--matmul-precision", "high"], "--matmul-precision="), (["--dataset", "mnist"], "--dataset="),
    (["--hidden", "64,64"], "--hidden=")])
def test_a_checkpoint_of_another_run_is_refused_naming_the_field(change, field):
    train = (np.zeros((4, 3, 2, 2), np.uint8), np.arange(4, dtype=np.int32))
    saved = checkpoints.run_identity(refimpl.parse_args([]), train, "rocal")
    other = checkpoints.run_identity(refimpl.parse_args(change), train, "rocal")
    with pytest.raises(ValueError, match=f"the checkpoint was taken with {field}"):
        checkpoints.check_identity("ck", saved, other)
    # What may change: where and how it runs.
    same = checkpoints.run_identity(refimpl.parse_args(["--devices", "3", "--batch-size", "5", "--placement",
                                                    "host", "--epochs", "9"]), train, "rocal")
    checkpoints.check_identity("ck", saved, same)
    for data, arithmetic, name in (((train[0] + 1, train[1]), "rocal", "train_data_blake2b"),
                                   (train, "dali_cpu", "arithmetic")):
        with pytest.raises(ValueError, match=f"taken with {name}="):
            checkpoints.check_identity("ck", saved, checkpoints.run_identity(refimpl.parse_args([]), data, arithmetic))


def test_checkpoint_options_are_checked(tmp_path, capsys):
    for argv, said in ((["--stop-after-step", "3"], "go together"),
                       (["--checkpoint-dir", str(tmp_path)], "go together"),
                       (["--stop-after-step", "0", "--checkpoint-dir", str(tmp_path)], "must be >= 1"),
                       (["--resume-from", str(tmp_path)], "no checkpoint.json there"),
                       (["--stop-after-step", "1", "--checkpoint-dir", str(tmp_path / "a" / "b")],
                        "is not a writable folder")):
        with pytest.raises(SystemExit):
            refimpl.parse_args(argv)
        assert said in capsys.readouterr().err, argv


def test_a_loader_without_state_refuses_a_resize():
    class VendorLike:  # a vendor loader of today: epoch(e, start_step) only
        def epoch(self, epoch, start_step=0):
            return iter(range(start_step, 4))

    saved = LoaderState.start(N, 8, 4, shuffle=True).at_step(3)
    assert list(checkpoints.resumed_epoch(VendorLike(), 0, saved, 8, 4)) == [3]
    with pytest.raises(ValueError, match="takes no loader state: it cannot resume epoch 1 on another"):
        checkpoints.resumed_epoch(VendorLike(), 0, saved, 3, 4)


# --------------------------------------------------------------------------
# End to end: refimpl.py in child processes
# --------------------------------------------------------------------------


def refimpl_run(*args, timeout=300):
    [(code, out, err)] = run_children([[sys.executable, os.path.join(HERE, "refimpl.py"), *args]],
                                      timeout=timeout, cwd=HERE)
    assert code == 0, f"refimpl.py {' '.join(args)} exited {code}:\n{out[-2000:]}\n{err[-3000:]}"
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return synthetic_cifar10(tmp_path_factory.mktemp("tiny"), num_train=96, num_test=16, seed=3)


def exactly_once_lines(out):
    return [line for line in out.splitlines() if "counted from the delivered rows" in line]


def test_refimpl_stops_on_4_devices_and_resumes_on_3(tiny_dir, tmp_path):
    common = ["--data-dir", tiny_dir, "--epochs", "1", "--batch-size", "4", "--eval-batch-size", "16",
              "--strategies", "sharded,pmap", "--hidden", "64,64"]  # narrow: the same code, less compute
    out = refimpl_run(*common, "--devices", "4", "--stop-after-step", "2", "--checkpoint-dir",
                      str(tmp_path / "ck"))
    assert "stopped after run step 2 (epoch 1, step 2)" in out, out
    doc = json.loads((tmp_path / "ck" / "checkpoint.json").read_text())
    assert doc["loader_state"]["segments"] == [[0, 4, 4]] and doc["loader_state"]["step"] == 2
    out = refimpl_run(*common, "--devices", "3", "--resume-from", str(tmp_path / "ck"))
    assert "segments [(0, 4, 4), (2, 3, 4)]" in out, out
    lines = exactly_once_lines(out)
    assert len(lines) == 2, out
    for name, line in zip(("sharded", "pmap"), lines):
        assert line.startswith(f"{name} epoch 1: every one of the 96 samples delivered in exactly one "
                               f"real slot, counted from the delivered rows"), line
        assert "steps 1-2 on 4 cpu device(s) x 4 (reference loader, placement device): 32; " \
               "steps 3-" in line and ": 64)" in line, line
    assert "final params, sharded vs pmap: max |difference| 0: identical" in out, out


def compare_params(a, b):
    """(bit-identical?, float32 ulps apart) per strategy of two --params-out files."""

    a, b = np.load(a), np.load(b)
    out = {}
    for name in sorted({k.split("/")[0] for k in a.files}):
        keys = sorted((k for k in a.files if k.startswith(name + "/")), key=lambda k: int(k.split("/")[1]))
        la, lb = [a[k] for k in keys], [b[k] for k in keys]
        same = all(x.shape == y.shape and np.array_equal(x.view(np.uint32), y.view(np.uint32))
                   for x, y in zip(la, lb))
        out[name] = (same, equivalence.ulps_apart(la, lb))
    return out


@pytest.mark.slow
def test_the_issues_resizes(tmp_path):
    """2 processes of 4 devices stop at step 7, 1 process of 8 resumes; 8 devices stop
    at step 7, 3 resume; and the same 8 devices resume bit for bit."""
    cache = ["--cache-dir", str(tmp_path / "cache"), "--epochs", "2"]
    both = cache + ["--strategies", "sharded,shard_map"]
    straight = tmp_path / "straight.npz"
    refimpl_run(*both, "--devices", "8", "--params-out", str(straight), timeout=600)

    refimpl_run(*both, "--local-processes", "2", "--stop-after-step", "7", "--checkpoint-dir",
                str(tmp_path / "mp"), timeout=600)
    out = refimpl_run(*both, "--devices", "8", "--resume-from", str(tmp_path / "mp"), "--params-out",
                      str(tmp_path / "mp.npz"), timeout=600)
    for line in exactly_once_lines(out):
        assert "every one of the 2048 samples delivered in exactly one real slot" in line, line
        assert "in 2 processes x 16 (reference loader, placement device): 896" in line, line
    assert len(exactly_once_lines(out)) == 2 and "OUTSIDE" not in out, out
    assert "final params, sharded vs shard_map" in out, out
    # The plan did not change (8 shards of 16): an uninterrupted run's params, within
    # test_multiprocess's cross-process bound of 1 ulp a step (32 steps).
    for name, (same, ulps) in compare_params(tmp_path / "mp.npz", straight).items():
        assert same or ulps <= 32, (name, ulps)

    refimpl_run(*both, "--devices", "8", "--stop-after-step", "7", "--checkpoint-dir",
                str(tmp_path / "same"), timeout=600)
    refimpl_run(*both, "--devices", "8", "--resume-from", str(tmp_path / "same"), "--params-out",
                str(tmp_path / "same.npz"), timeout=600)
    for name, (same, ulps) in compare_params(tmp_path / "same.npz", straight).items():
        assert same, f"{name}: a resume on the same devices is {ulps} ulps from the uninterrupted run"

    every = cache + ["--strategies", "all"]
    refimpl_run(*every, "--devices", "8", "--stop-after-step", "7", "--checkpoint-dir",
                str(tmp_path / "r83"), timeout=600)
    files = {}
    for placement in ("device", "host"):
        files[placement] = tmp_path / f"r83-{placement}.npz"
        out = refimpl_run(*every, "--devices", "3", "--placement", placement, "--resume-from",
                          str(tmp_path / "r83"), "--params-out", str(files[placement]), timeout=600)
        lines = exactly_once_lines(out)
        assert len(lines) == 4, out
        for line in lines:
            assert "every one of the 2048 samples delivered in exactly one real slot" in line, line
            assert ": 896; steps 8-31 on 3 cpu device(s) x 16" in line and ": 1152)" in line, line
        assert "OUTSIDE" not in out and out.count("final params, sharded vs") == 3, out
    for name, (same, ulps) in compare_params(files["device"], files["host"]).items():
        assert same, f"{name}: placements device and host differ by {ulps} ulps after the resize"
