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
* End to end (a child refimpl.py, 4 devices stop, 3 resume with --resume-from
  and --devices alone): the report says every sample was delivered exactly once
  across the change, and the strategies agree within their bound. With
  --run-slow: the issue's two resizes (2 processes of 4 devices stop after 7 steps
  and 1 process of 8 resumes, within the cross-process bound of an uninterrupted
  run; 8 devices stop and 3 resume), a resume on the same devices bit-identical to
  an uninterrupted run, and host vs device placement bit-identical across a resize.
* A resume takes what it trains from its checkpoint (in process): every option
  of refimpl's parser is in exactly one of checkpoints.IDENTITY, CARRIED and OWN
  (control: an unplaced option is found); --resume-from alone restores the run's
  options; each identity flag that contradicts the checkpoint is refused by name
  (control: the checkpoint's own value passes); with logical shards b is identity
  and a device count that does not divide L is refused, without them the batch
  size may change; the checkpoint's pmap refused across processes; an older
  format refused saying so.
* Elastic, bitwise (logical shards L = 24, the canonical reduction, Adam): 8
  devices stop right before the masked step and 3 resume with --resume-from alone;
  the report says exactly once and --compare-to bit-identical, and the two
  --params-out files are the same bytes (3 child runs). Negative controls: one
  bit flipped in a params file is found by both comparisons; report_bits fails a
  pair one ulp apart in its optimizer state, said last. With --run-slow: three
  drawn stops, 2 processes to 1 process of 6 devices, 8 devices to 1 (24
  microbatches), and the plain reduction across the same resize, which is NOT
  bit-identical.

* Elastic in process (refimpl.main in this process, so that mutation.py maps
  checkpoints.py's mutants to these tests): a chain of four runs on 6, 2, 3 and 6
  devices (stops mid-epoch and at an epoch's end; the canonical reduction, L = 6, Adam)
  ends on the bytes of a run on 3 that never stopped, every epoch's loss and accuracy too,
  and the second checkpoint holds what docs/running.md says; a resize without logical
  shards (4 x 8 rows to 3 x 5) delivers each sample once, and with drop at most once
  with the stated count skipped.

The loader's own resume (``epoch(e, state=...)``): test_loaders_resume.py.
"""

import json
import os
import re
import sys

import jax
import numpy as np
import pytest

import checkpoints
import equivalence
import loaders
import processes
import refimpl
from arithmetic import Normalize
from cifar_mnist import synthetic_cifar10
from conftest import assert_same_bits, bits_differ, meshes, run_children
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


def test_deliveries_count_every_row_that_is_no_sample_across_steps_past_the_last_key(counting):
    """Rows that are no sample add up over the steps counted into one vector (every
    shifted row of two steps: 2 x 32), also a row whose fingerprint sorts after every
    sample's (searchsorted's end, where a lookup could run past the keys); the samples'
    own counts stay as they were (the control: 0 unknown before)."""
    (l8, _), deliveries, _ = counting
    batches = [dict(l8.batch(EPOCH, s)) for s in (0, 1)]
    real = sum(int(np.asarray(b["mask"]).sum()) for b in batches)
    assert count(deliveries, batches)[-1] == 0
    shifted = [dict(b, images=b["images"] + np.float32(1e-3)) for b in batches]
    assert count(deliveries, shifted)[-1] == real
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((4000, 3 * 4 * 4)).astype(np.float32)
    prints = checkpoints.fingerprint_rows(rows, np.zeros(4000, np.int32))
    last = rows[int(np.argmax(prints))]
    assert prints.max() > deliveries.keys.max()  # past every key
    batch = dict(batches[0])
    images = np.array(batch["images"])
    images[:] = last.reshape(images.shape[1:])
    batch["images"] = jax.device_put(images, batch["images"].sharding)
    batch["labels"] = jax.device_put(np.zeros(batch["labels"].shape, np.int32), batch["labels"].sharding)
    vector = count(deliveries, [batch])
    assert vector[-1] == int(np.asarray(batch["mask"]).sum()) and not vector[:-1].any()


def test_a_rows_fingerprint_is_its_docstring():
    """fingerprint_rows: the 8-byte BLAKE2b of the row's float32 bytes (C order) then its
    label's int32 bytes, read little-endian, for rows given in any dtype and shape and
    labels of any integer dtype; the control: read big-endian it is another number."""
    import hashlib
    rows = np.arange(24, dtype=np.float64).reshape(3, 2, 4) / 7  # float64, 2-d samples
    labels = np.array([7, 0, 9], np.int64)
    got = checkpoints.fingerprint_rows(rows, labels)
    assert got.dtype == np.uint64 and got.shape == (3,)
    for row, label, value in zip(rows, labels, got):
        raw = hashlib.blake2b(row.astype(np.float32).tobytes() + np.int32(label).tobytes(), digest_size=8).digest()
        assert int(value) == int.from_bytes(raw, "little") != int.from_bytes(raw, "big")


def test_a_runs_identity_digests_its_data_as_its_docstring_says():
    """run_identity's train_data_blake2b is the BLAKE2b-128 of the image bytes (in sample
    order, C order, also from a strided view as read_cifar10 gives) then the int32 label
    bytes, over more samples than it reads at a time (5,000 > 4,096); with the run's
    size, the arithmetic as normalize, and shuffle on."""
    import hashlib
    rng = np.random.default_rng(1)
    whole = rng.integers(0, 256, (5000, 2, 3, 6)).astype(np.uint8)
    images = whole[..., ::2]  # a strided view, not contiguous
    assert not images.flags.c_contiguous
    labels = rng.integers(0, 10, 5000).astype(np.int64)
    identity = checkpoints.run_identity(refimpl.parse_args(["--hidden", "8"]), (images, labels), "dali_cpu")
    want = hashlib.blake2b(np.ascontiguousarray(images).tobytes() + labels.astype(np.int32).tobytes(),
                           digest_size=16).hexdigest()
    assert identity["train_data_blake2b"] == want
    assert (identity["num_train"], identity["normalize"], identity["shuffle"]) == (5000, "dali_cpu", True)
    assert identity["hidden"] == [8]
    other = checkpoints.run_identity(refimpl.parse_args(["--hidden", "8"]), (images[:4097], labels[:4097]), "rocal")
    assert other["train_data_blake2b"] == hashlib.blake2b(
        np.ascontiguousarray(images[:4097]).tobytes() + labels[:4097].astype(np.int32).tobytes(),
        digest_size=16).hexdigest()


def test_every_partial_file_is_written_in_the_checkpoint_folder(tmp_path, monkeypatch):
    """write_checkpoint renames only within the folder (the arrays' and checkpoint.json's
    partial files sit beside their final names, so each os.replace is one filesystem's
    atomic rename), and the checkpoint.json it writes reads back as the document."""
    replaced = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (replaced.append((src, dst)), real(src, dst))[1])
    folder = tmp_path / "ck"
    path = checkpoints.write_checkpoint(str(folder), {"run_step": 3, "format": "x"}, {"a": np.arange(3)})
    monkeypatch.undo()
    assert len(replaced) == 2
    for src, dst in replaced:
        assert os.path.dirname(os.path.abspath(src)) == os.path.dirname(os.path.abspath(dst)) == str(folder)
    doc = json.loads(open(path).read())
    assert doc["run_step"] == 3 and os.path.isfile(folder / doc["arrays_file"])


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
    with pytest.raises(ValueError, match=f"is not a {checkpoints.CHECKPOINT_FORMAT} checkpoint"):
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
                                   (train, "dali_cpu", "--normalize")):  # the arithmetic used
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
    with pytest.raises(ValueError, match="takes no loader state: it cannot resume epoch 0 on another"):
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
    assert "stopped after run steps 0-1: the next, run step 2, is epoch 0, step 2" in out, out
    doc = json.loads((tmp_path / "ck" / "checkpoint.json").read_text())
    assert doc["loader_state"]["segments"] == [[0, 4, 4]] and doc["loader_state"]["step"] == 2
    # One flag: what the run trains, its data and its epochs come from the checkpoint.
    out = refimpl_run("--devices", "3", "--resume-from", str(tmp_path / "ck"))
    assert "segments [(0, 4, 4), (2, 3, 4)]" in out, out
    assert "3 cpu device(s); cifar10: 96 training" in out and "steps of 3 x 4 per epoch" in out, out
    assert "--- sharded ---" in out and "--- pmap ---" in out, out
    lines = exactly_once_lines(out)
    assert len(lines) == 2, out
    for name, line in zip(("sharded", "pmap"), lines):
        assert line.startswith(f"{name} epoch 0: every one of the 96 samples delivered in exactly one "
                               f"real slot, counted from the delivered rows"), line
        assert "steps 0-1 on 4 cpu device(s) x 4 (reference loader, placement device): 32; " \
               "steps 2-" in line and ": 64)" in line, line
    assert "final params, sharded vs pmap: max |difference| 0: identical" in out, out


def compare_params(a, b, names=None):
    """(bit-identical params and optimizer state?, float32 ulps apart of the params) per
    strategy of two --params-out files ('<strategy>/<i>', '<strategy>/opt_state/<i>'):
    of ``names``, else of every strategy, both files holding the same arrays."""
    a, b = np.load(a), np.load(b)
    if names is None:
        assert sorted(a.files) == sorted(b.files), (a.files, b.files)
        names = {k.split("/")[0] for k in a.files}
    out = {}
    for name in sorted(names):
        assert sorted(k for k in a.files if k.startswith(name + "/")) == \
            sorted(k for k in b.files if k.startswith(name + "/")), name
        params = sorted((k for k in a.files if k.startswith(name + "/") and k.count("/") == 1),
                        key=lambda k: int(k.split("/")[1]))
        same = all(bits_differ(a[k], b[k]) is None for k in a.files if k.startswith(name + "/"))
        out[name] = (same, equivalence.ulps_apart([a[k] for k in params], [b[k] for k in params]))
    return out


# The previous round's two resizes, one test each (all of them in one outlasted the watchdog
# on a busy machine), with a narrow MLP (the same code; as the suite's child runs): --run-slow.
ISSUE_RUNS = ["--epochs", "2", "--hidden", "64,64"]


@pytest.fixture
def straight(tmp_path):
    """An uninterrupted run of sharded and shard_map on 8 devices: (its --params-out, the options)."""
    both = ["--cache-dir", str(tmp_path / "cache"), *ISSUE_RUNS, "--strategies", "sharded,shard_map"]
    out = tmp_path / "straight.npz"
    refimpl_run(*both, "--devices", "8", "--params-out", str(out), timeout=600)
    return out, both


@pytest.mark.slow
def test_two_processes_stop_and_one_process_of_8_resumes(tmp_path, straight):
    """2 processes of 4 devices stop at step 7, 1 process of 8 resumes: exactly once, and
    the uninterrupted run's params within the cross-process bound."""
    straight, both = straight
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


@pytest.mark.slow
def test_8_devices_stop_and_the_same_8_resume_bit_for_bit(tmp_path, straight):
    straight, both = straight
    refimpl_run(*both, "--devices", "8", "--stop-after-step", "7", "--checkpoint-dir",
                str(tmp_path / "same"), timeout=600)
    refimpl_run(*both, "--devices", "8", "--resume-from", str(tmp_path / "same"), "--params-out",
                str(tmp_path / "same.npz"), timeout=600)
    for name, (same, ulps) in compare_params(tmp_path / "same.npz", straight).items():
        assert same, f"{name}: a resume on the same devices is {ulps} ulps from the uninterrupted run"


@pytest.mark.slow
def test_8_devices_stop_and_3_resume_alike_in_two_placements(tmp_path):
    every = ["--cache-dir", str(tmp_path / "cache"), *ISSUE_RUNS, "--strategies", "all"]
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
            assert ": 896; steps 7-30 on 3 cpu device(s) x 16" in line and ": 1152)" in line, line
        assert "OUTSIDE" not in out and out.count("final params, sharded vs") == 3, out
    for name, (same, ulps) in compare_params(files["device"], files["host"]).items():
        assert same, f"{name}: placements device and host differ by {ulps} ulps after the resize"


# --------------------------------------------------------------------------
# A resume takes what it trains from its checkpoint (issue 30, item 6), in process:
# --resume-from alone; a contradicting flag, and a strategy this process count cannot
# run, refused by name before any work
# --------------------------------------------------------------------------

TRAIN4 = (np.zeros((4, 3, 2, 2), np.uint8), np.arange(4, dtype=np.int32))


def checkpoint_of(folder, argv: list, arithmetic: str = "rocal") -> str:
    """``folder`` holding the checkpoint.json a run with options ``argv`` writes (its run's
    identity and carried options, as Elastic.checkpoint writes them; no arrays:
    resume_options reads the document alone)."""
    args = refimpl.parse_args(argv)
    if args.reduction == "canonical" and args.logical_shards is None:
        args.logical_shards = 8  # set_up's resolution on 8 devices
    doc = {"format": checkpoints.CHECKPOINT_FORMAT, "run": checkpoints.run_identity(args, TRAIN4, arithmetic),
           "carried": checkpoints.carried_options(args)}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, checkpoints.CHECKPOINT_FILE), "w") as f:
        json.dump(doc, f)
    return str(folder)


def refused(argv: list, capsys) -> str:
    """The one line refimpl.parse_args prints for ``argv`` before exiting 2."""
    with pytest.raises(SystemExit) as info:
        refimpl.parse_args(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    return err.strip().splitlines()[-1]


def test_every_option_is_identity_carried_or_this_runs_own():
    # A resume decides for each option what to do: an option added later must be placed
    # in exactly one of the three groups, or this fails naming it.
    groups = (checkpoints.IDENTITY, checkpoints.CARRIED, checkpoints.OWN)

    def unplaced(parser):
        options = set(vars(parser.parse_args([])))
        placed = [name for group in groups for name in group]
        return sorted(options ^ set(placed)) + sorted({n for n in placed if placed.count(n) > 1})

    assert unplaced(refimpl.build_parser()) == []
    parser = refimpl.build_parser()  # control: a new option nobody placed is found
    parser.add_argument("--warmup-steps", type=int)
    assert unplaced(parser) == ["warmup_steps"]


ORIGINAL = ["--hidden", "64,32", "--strategies", "shard_map,sharded", "--seed", "7", "--lr", "0.01",
            "--optimizer", "adam", "--last-batch", "drop", "--matmul-precision", "high", "--epochs", "3",
            "--batch-size", "5", "--eval-batch-size", "40", "--data-dir", "/data/somewhere",
            "--cache-dir", "/cache/somewhere", "--dataset", "mnist"]


def test_resume_from_alone_takes_the_run_from_its_checkpoint(tmp_path):
    folder = checkpoint_of(tmp_path / "ck", ORIGINAL, arithmetic="dali_cpu")
    mine = refimpl.parse_args(["--resume-from", folder])
    want = refimpl.parse_args(ORIGINAL)
    for name in checkpoints.IDENTITY + checkpoints.CARRIED:
        if name != "normalize":
            assert getattr(mine, name) == getattr(want, name), name
    relative = checkpoint_of(tmp_path / "relative", ["--data-dir", "data", "--cache-dir", "cache"])
    assert refimpl.parse_args(["--resume-from", relative]).data_dir == os.path.abspath("data")  # from anywhere
    assert mine.normalize == "dali_cpu"  # the arithmetic the run used, not the backend's default
    assert mine.strategies == ("shard_map", "sharded")  # the run's order, not the default sharded,pmap
    assert mine.from_checkpoint == set(checkpoints.IDENTITY) | set(checkpoints.CARRIED)
    # What may change does: carried options given, and this run's own.
    changed = refimpl.parse_args(["--resume-from", folder, "--epochs", "9", "--batch-size", "3",
                                  "--devices", "4", "--data-dir", "/data/copy", "--hidden", "64,32",
                                  "--strategies", "sharded,shard_map"])  # the same set: no contradiction
    assert (changed.epochs, changed.batch_size, changed.devices, changed.data_dir) == (9, 3, 4, "/data/copy")
    assert "epochs" not in changed.from_checkpoint and "hidden" not in changed.from_checkpoint


@pytest.mark.parametrize("flag, value, theirs", [
    ("--hidden", "64,64", "64,32"), ("--strategies", "sharded,pmap", "shard_map,sharded"),
    ("--seed", "8", "7"), ("--lr", "0.001", "0.01"), ("--optimizer", "sgd", "adam"),
    ("--last-batch", "fill", "drop"), ("--normalize", "rocal", "dali_cpu"),
    ("--matmul-precision", "highest", "high"), ("--dataset", "cifar10", "mnist"),
    ("--reduction", "canonical", "plain"), ("--logical-shards", "8", "(not given)")])
def test_a_flag_that_contradicts_the_checkpoint_is_refused_by_name(tmp_path, capsys, flag, value, theirs):
    folder = checkpoint_of(tmp_path / "ck", ORIGINAL, arithmetic="dali_cpu")
    line = refused(["--resume-from", folder, flag, value], capsys)
    assert f"--resume-from {folder}: {flag} {value} contradicts the checkpoint's run, which has " \
           f"{flag} {theirs}; leave {flag} out" in line, line
    # Control: the checkpoint's own value is no contradiction.
    if theirs != "(not given)":
        refimpl.parse_args(["--resume-from", folder, flag, theirs])


def test_logical_shards_make_b_identity_and_refuse_a_device_count_that_does_not_divide(tmp_path, capsys):
    folder = checkpoint_of(tmp_path / "ck", ["--logical-shards", "24", "--batch-size", "2",
                                             "--reduction", "canonical", "--strategies", "sharded"])
    args = refimpl.parse_args(["--resume-from", folder, "--devices", "3"])
    assert (args.logical_shards, args.batch_size, args.reduction) == (24, 2, "canonical")
    line = refused(["--resume-from", folder, "--batch-size", "4"], capsys)
    assert "--batch-size 4 contradicts the checkpoint's run, which has --batch-size 2" in line, line
    line = refused(["--resume-from", folder, "--devices", "5"], capsys)
    assert line.endswith(f"--resume-from {folder}: the checkpoint's run has --logical-shards 24, which 5 "
                         f"device(s) do not divide; resume on a device count that divides 24 (1, 2, 3, 4, "
                         f"6, 8, 12, 24)"), line
    line = refused(["--resume-from", folder, "--local-processes", "2", "--devices", "10"], capsys)
    assert "which 10 device(s) do not divide" in line, line
    # A fresh run: the option itself is named.
    line = refused(["--logical-shards", "8", "--devices", "3"], capsys)
    assert "--logical-shards 8: 3 device(s) do not divide it" in line, line
    # Without logical shards --batch-size is carried: a resume may change it (elastic_plan).
    plain = checkpoint_of(tmp_path / "plain", ["--batch-size", "2"])
    assert refimpl.parse_args(["--resume-from", plain, "--batch-size", "4"]).batch_size == 4
    assert refimpl.parse_args(["--resume-from", plain]).batch_size == 2


def test_strategies_this_process_count_cannot_run_are_refused_by_name(tmp_path, capsys):
    one = checkpoint_of(tmp_path / "one", [])  # one process's default: sharded,pmap
    line = refused(["--resume-from", one, "--local-processes", "2"], capsys)
    assert line.endswith(f"--resume-from {one}: the checkpoint's run trains --strategies sharded,pmap, and "
                         f"across processes only sharded and shard_map run (pmap maps over one process's "
                         f"devices): resume it in one process"), line
    # Controls: the same checkpoint in one process; a 2-process run's default in one process,
    # and in two (no --strategies on either side: its strategies are the checkpoint's).
    assert refimpl.parse_args(["--resume-from", one]).strategies == ("sharded", "pmap")
    two = checkpoint_of(tmp_path / "two", ["--local-processes", "2"])
    assert refimpl.parse_args(["--resume-from", two]).strategies == ("sharded", "shard_map")
    assert refimpl.parse_args(["--resume-from", two, "--local-processes", "2"]).strategies == ("sharded", "shard_map")


def test_a_resume_refuses_a_backend_that_cannot_compute_the_checkpoints_arithmetic(tmp_path, capsys):
    folder = checkpoint_of(tmp_path / "ck", [], arithmetic="rocal")
    line = refused(["--resume-from", folder, "--backend", "dali"], capsys)
    assert "--backend dali: it computes dali_cpu or dali_gpu arithmetic, and the checkpoint's run" in line, line
    assert refimpl.parse_args(["--resume-from", folder]).normalize == "rocal"  # control


def test_a_checkpoint_of_the_older_format_is_refused_saying_so(tmp_path, capsys):
    (tmp_path / checkpoints.CHECKPOINT_FILE).write_text(json.dumps({"format": "refimpl.checkpoint/1"}))
    line = refused(["--resume-from", str(tmp_path)], capsys)
    assert "is not a refimpl.checkpoint/2 checkpoint (format 'refimpl.checkpoint/1') (written by an " \
           "older refimpl.py" in line, line


# --------------------------------------------------------------------------
# Elastic, bitwise (issue 32.4, 32.6): a run with logical shards and the canonical
# reduction, stopped on one topology and resumed on another with --resume-from alone,
# ends with the very bits of the run that was never stopped (--params-out files,
# params and Adam's state, compared bit for bit), every sample delivered once
# --------------------------------------------------------------------------

# 250 samples over L = 24 logical shards (10 or 11 samples) of b = 2: 6 steps an epoch,
# the last one masked (a shard of 10 holds only padding there, one of 11 one real row).
LOGICAL = ["--epochs", "2", "--batch-size", "2", "--logical-shards", "24", "--eval-batch-size", "16",
           "--hidden", "64,64", "--optimizer", "adam", "--strategies", "sharded",
           "--placement", "host_float32"]  # no device-side normalisation to compile in each child
CANONICAL = LOGICAL + ["--reduction", "canonical"]
TAIL_STOP = 5  # run steps 0-4 trained: the resumed run starts with epoch 0's masked step 5


@pytest.fixture(scope="module")
def logical_dir(tmp_path_factory):
    return synthetic_cifar10(tmp_path_factory.mktemp("logical"), num_train=250, num_test=16, seed=3)


def refimpl_phases(*phases: list, timeout=100) -> list:
    """Each phase's refimpl.py commands run at once, the phases in order; every exit status
    checked; the stdout of each command, in order."""
    outputs = []
    for commands in phases:
        results = run_children([[sys.executable, os.path.join(HERE, "refimpl.py"), *c] for c in commands],
                               timeout=timeout, cwd=HERE)
        for command, (code, out, err) in zip(commands, results):
            assert code == 0, f"refimpl.py {' '.join(command)} exited {code}:\n{out[-2000:]}\n{err[-3000:]}"
            outputs.append(out)
    return outputs


@pytest.fixture(scope="module")
def uninterrupted(logical_dir, tmp_path_factory):
    """The run that was never stopped (8 devices, canonical, L = 24; sharded and also
    single, one device adding the 24 shards as microbatches, which must agree bit for bit)
    and, beside it, the same run (sharded) stopped before the masked step (TAIL_STOP) on 8
    devices: (the uninterrupted run's --params-out, the stopped run's checkpoint folder,
    the options of both)."""
    tmp = tmp_path_factory.mktemp("canonical")
    common = ["--data-dir", logical_dir, "--cache-dir", str(tmp / "cache"), *CANONICAL, "--devices", "8"]
    [out, _] = refimpl_phases([common + ["--strategies", "sharded,single", "--params-out", str(tmp / "straight.npz")],
                               common + ["--stop-after-step", str(TAIL_STOP), "--checkpoint-dir", str(tmp / "tail")]])
    assert "final params and optimizer state, sharded vs single: bit-identical (the canonical reduction " \
           "over 24 logical shards)" in out, out
    return tmp / "straight.npz", tmp / "tail", common


def assert_resumed_bitwise(out: str, resumed, straight) -> None:
    """The resumed run's report: exactly once across the change, and --compare-to's line;
    its --params-out the uninterrupted run's, every array bit for bit."""
    [line] = exactly_once_lines(out)
    assert line.startswith("sharded epoch 0: every one of the 250 samples delivered in exactly one real "
                           "slot"), line
    assert f"final params and optimizer state of sharded against {straight}: bit-identical" in out, out
    assert "FAILED" not in out, out
    for name, (same, ulps) in compare_params(resumed, straight, ["sharded"]).items():
        assert same, f"{name}: {ulps} ulps from the run that was never stopped"


def test_canonical_stop_on_8_devices_resume_on_3_is_the_uninterrupted_runs_bits(uninterrupted, tmp_path):
    """8 -> 3 devices with L = 24, stopped right before the masked tail step: the resumed
    run (--resume-from and --devices alone) reports every sample once and --compare-to
    bit-identical, and the two --params-out files (params, Adam's moments and count) are
    the same bits. 3 refimpl runs (the fixture's two at once, then this one)."""
    straight, tail, _ = uninterrupted
    doc = json.loads((tail / checkpoints.CHECKPOINT_FILE).read_text())
    assert doc["loader_state"]["segments"] == [[0, 24, 2]] and doc["loader_state"]["step"] == TAIL_STOP
    assert (doc["run"]["logical_shards"], doc["run"]["batch_size"], doc["run"]["reduction"]) == (24, 2, "canonical")
    [out] = refimpl_phases([["--resume-from", str(tail), "--devices", "3", "--params-out",
                             str(tmp_path / "resumed.npz"), "--compare-to", str(straight)]])
    assert "resuming" in out and "steps 5-5 of epoch 0" in out and "segments" not in out, out
    assert "steps 0-4 on 8 cpu device(s), 24 logical shards of 2" in out, out
    assert "steps 5-5 on 3 cpu device(s), 24 logical shards of 2" in out, out
    assert_resumed_bitwise(out, tmp_path / "resumed.npz", straight)
    assert len([k for k in np.load(straight).files if k.startswith("sharded/")]) == 6 + 13  # Adam: count, mu, nu


def tampered(path, out, key: str):
    """A copy of --params-out ``path`` at ``out`` with one bit of array ``key`` flipped."""
    arrays = dict(np.load(path))
    flat = arrays[key].reshape(-1).copy()
    flat.view(np.uint8)[0] ^= 1
    arrays[key] = flat.reshape(arrays[key].shape)
    np.savez(out, **arrays)
    return out


def test_a_params_file_one_bit_off_is_found_by_the_comparisons(uninterrupted, tmp_path, capsys):
    # Negative controls for the test above, in process: one bit of Adam's second moment
    # flipped in the uninterrupted run's file is found by compare_params and by refimpl's
    # --compare-to (a failure under the canonical reduction, a note under the plain one).
    straight, _, _ = uninterrupted
    bad = tampered(straight, tmp_path / "bad.npz", "sharded/opt_state/12")
    assert compare_params(bad, straight, ["sharded"])["sharded"][0] is False
    assert compare_params(straight, straight)["single"][0] is True  # control
    arrays = dict(np.load(straight))
    final = {"sharded": [arrays[f"sharded/{i}"] for i in range(6)]}
    states = {"sharded": [arrays[f"sharded/opt_state/{i}"] for i in range(13)]}
    same, differ = refimpl.compared_to(str(straight), final, states, "canonical")
    assert len(same) == 1 and not differ  # control: its own file is bit-identical
    same, [line] = refimpl.compared_to(str(bad), final, states, "canonical")
    assert not same and "NOT bit-identical, which the canonical reduction promises" in line, line
    size = arrays["sharded/opt_state/12"].size
    assert f"leaf ['sharded/opt_state/12']: 1 of {size} entries differ, the first at flat index 0" in line, line
    _, [line] = refimpl.compared_to(str(bad), final, states, "plain")
    assert "not bit-identical (the plain reduction promises no bits across device counts)" in line, line


def test_canonical_report_holds_every_pair_to_bit_identical_and_says_a_failure_last(capsys):
    # 32.6 in process: the canonical verdict is bits, params and optimizer state both; a pair
    # one ulp apart in its optimizer state fails, its line last, then FAILED (exit status 1
    # through main), where equivalence.verdict would have called 1 ulp within its bound.
    params = [np.array([1.0, 2.0], np.float32)]
    state = {"mu": np.array([0.5, 0.25], np.float32), "count": np.array(3, np.int32)}
    nudged = {"mu": np.array([0.5, np.nextafter(np.float32(0.25), np.float32(1))], np.float32),
              "count": np.array(3, np.int32)}
    final = {"sharded": params, "pmap": params, "shard_map": params}
    states = {"sharded": state, "pmap": nudged, "shard_map": state}
    same, differ = refimpl.report_bits(final, states, 8)
    assert same == ["final params and optimizer state, sharded vs shard_map: bit-identical (the canonical "
                    "reduction over 8 logical shards)"]
    [line] = differ
    assert line.startswith("final params and optimizer state, sharded vs pmap: NOT bit-identical, which "
                           "the canonical reduction promises: leaf [1]['mu']: 1 of 2 entries differ, the "
                           "first at flat index 1"), line
    assert refimpl.report_bits({"a": params, "b": params}, {"a": state, "b": state}, 8)[1] == []  # control


@pytest.mark.slow
@pytest.mark.parametrize("stop", [int(s) for s in np.random.default_rng(324).choice(
    np.delete(np.arange(1, 12), TAIL_STOP - 1), 3, replace=False)])  # 4, 11 and 3
def test_canonical_8_to_3_at_drawn_stops(uninterrupted, stop, tmp_path):
    """8 -> 3 with L = 24 at three stops drawn once (rng 324) from the run's other stops
    1..11 (TAIL_STOP runs in CI): 3 and 4 mid-epoch 0, 11 right before epoch 1's masked
    step. Each bit-identical to the uninterrupted run. About 30 s each: --run-slow."""
    straight, _, common = uninterrupted
    refimpl_phases([common + ["--stop-after-step", str(stop), "--checkpoint-dir", str(tmp_path / "ck")]])
    [out] = refimpl_phases([["--resume-from", str(tmp_path / "ck"), "--devices", "3", "--params-out",
                             str(tmp_path / "resumed.npz"), "--compare-to", str(straight)]])
    assert f"resuming {tmp_path / 'ck'} at run step {stop} = epoch {stop // 6}, step {stop % 6}" in out, out
    assert f"final params and optimizer state of sharded against {straight}: bit-identical" in out, out
    for name, (same, ulps) in compare_params(tmp_path / "resumed.npz", straight, ["sharded"]).items():
        assert same, f"{name}: {ulps} ulps from the run that was never stopped"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_canonical_2_processes_to_1_process_of_6_devices(uninterrupted, tmp_path):
    """2 processes of 4 devices stop before the masked step, 1 process of 6 devices resumes
    (L = 24): the uninterrupted 8-device run's bits, exactly once across the change."""
    straight, _, common = uninterrupted
    refimpl_phases([processes.strip_options(common, ("--devices",)) + [
        "--local-processes", "2", "--stop-after-step", str(TAIL_STOP), "--checkpoint-dir", str(tmp_path / "ck")]])
    [out] = refimpl_phases([["--resume-from", str(tmp_path / "ck"), "--devices", "6", "--params-out",
                             str(tmp_path / "resumed.npz"), "--compare-to", str(straight)]])
    assert "steps 0-4 on 8 cpu device(s) in 2 processes, 24 logical shards of 2" in out, out
    assert_resumed_bitwise(out, tmp_path / "resumed.npz", straight)


@pytest.mark.slow
def test_canonical_8_devices_to_1_device_adding_24_microbatches(uninterrupted, tmp_path):
    """8 devices stop before the masked step, 1 device resumes, adding the 24 logical shards'
    gradient sums as microbatches: the uninterrupted run's bits."""
    straight, tail, _ = uninterrupted
    [out] = refimpl_phases([["--resume-from", str(tail), "--devices", "1", "--params-out",
                             str(tmp_path / "resumed.npz"), "--compare-to", str(straight)]])
    assert "1 cpu device(s); cifar10: 250 training" in out and "24 a device" in out, out
    assert_resumed_bitwise(out, tmp_path / "resumed.npz", straight)


@pytest.mark.slow
def test_the_plain_reduction_across_the_same_resize_is_not_bit_identical(uninterrupted, tmp_path):
    """The negative control of the tests above: the same logical shards (the same global
    batches at every step) with the plain reduction, 8 -> 3: every sample still once, but
    the resumed run does not end with the uninterrupted plain run's bits (XLA adds 8
    devices' sums in another order than 3), and --compare-to says so without failing."""
    _, _, canonical = uninterrupted
    common = [a for a in canonical if a not in ("--reduction", "canonical")]  # LOGICAL's options
    refimpl_phases([common + ["--params-out", str(tmp_path / "straight.npz")],
                    common + ["--stop-after-step", str(TAIL_STOP), "--checkpoint-dir", str(tmp_path / "ck")]])
    [out] = refimpl_phases([["--resume-from", str(tmp_path / "ck"), "--devices", "3", "--params-out",
                             str(tmp_path / "resumed.npz"), "--compare-to", str(tmp_path / "straight.npz")]])
    [line] = exactly_once_lines(out)
    assert "every one of the 250 samples delivered in exactly one real slot" in line, line
    assert "not bit-identical (the plain reduction promises no bits across device counts)" in out, out
    [(same, ulps)] = compare_params(tmp_path / "resumed.npz", tmp_path / "straight.npz").values()
    assert not same and 0 < ulps, ulps
    print(f"plain reduction, 8 -> 3 with L = 24: {ulps:.1f} ulps from the uninterrupted run")


# --------------------------------------------------------------------------
# Elastic in this process: refimpl.main stopped and resumed in a user's job that runs JAX
# --------------------------------------------------------------------------


def in_process(argv: list, capsys) -> str:
    """refimpl.main(argv) in this process: its exit status 0 and its stdout."""
    code = refimpl.main([str(a) for a in argv])
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    return out


def npz(path) -> dict:
    with np.load(path) as f:
        return dict(f)


def assert_same_files(a, b):
    a, b = npz(a), npz(b)
    assert sorted(a) == sorted(b)
    for key in a:
        assert (a[key].dtype, a[key].shape, a[key].tobytes()) == (b[key].dtype, b[key].shape, b[key].tobytes()), key


def test_a_chain_of_stops_and_resumes_in_process_is_the_uninterrupted_runs_bits(tiny_dir, tmp_path, capsys):
    """Logical shards L = 6 of 4 rows (96 samples: 4 steps an epoch, 3 epochs, run steps
    0..11), the canonical reduction, Adam, four runs: 6 devices stop after run step 2
    (mid-epoch 0); 2 resume and stop after run step 6 (mid-epoch 1); 3 resume and stop
    after run step 7, epoch 1's last (saved as epoch 2, step 0); 6 resume to the end.
    Every strategy's final params and optimizer state are the bytes of a run that never
    stopped (which runs no checkpoint code: the oracle), and so is every epoch's loss and
    test accuracy (--metrics-out: the losses before a stop carried in the checkpoint); each
    interrupted epoch is reported delivered exactly once, and each stop says where the
    next run starts."""
    pytest.importorskip("optax", reason="requirements-peers.txt")
    run = ["--data-dir", tiny_dir, "--epochs", "3", "--batch-size", "4", "--logical-shards", "6",
           "--reduction", "canonical", "--optimizer", "adam", "--lr", "0.01", "--hidden", "8,8",
           "--strategies", "all", "--seed", "3", "--eval-batch-size", "16"]

    def metrics(name):
        return ["--metrics-out", tmp_path / f"{name}.jsonl"]

    in_process(run + ["--devices", "3", "--params-out", tmp_path / "never.npz"] + metrics("never"), capsys)
    first = in_process(run + ["--devices", "6", "--stop-after-step", "3", "--checkpoint-dir", tmp_path / "a"]
                       + metrics("a"), capsys)
    assert "stopped after run steps 0-2: the next, run step 3, is epoch 0, step 3" in first
    second = in_process(["--resume-from", tmp_path / "a", "--devices", "2", "--stop-after-step", "7",
                         "--checkpoint-dir", tmp_path / "b"] + metrics("b"), capsys)
    assert f"resuming {tmp_path / 'a'} at run step 3 = epoch 0, step 3 (written on 6 cpu device(s), 6 logical " \
           f"shards of 4 (reference loader, placement device)); this run: 2 cpu device(s), 6 logical shards of 4 " \
           f"(reference loader, placement device): steps 3-3 of epoch 0\n" in second  # one segment: no plan named
    for name in refimpl.STRATEGY_NAMES:  # each epoch line says which steps this run trained of which
        [resumed] = [line for line in second.splitlines() if line.strip().startswith(f"{name} epoch 0 of 3")]
        [stopped] = [line for line in second.splitlines() if line.strip().startswith(f"{name} epoch 1 of 3")]
        assert resumed.endswith("(includes compilation)  (steps 3-3 of 0-3: resumed)"), resumed
        assert stopped.endswith("  (steps 0-2 of 0-3: stopped before step 3)"), stopped
    assert "stopped after run steps 0-6: the next, run step 7, is epoch 1, step 3" in second
    assert "epoch 1 so far, counted from the delivered rows: 72 real slot(s), 0 sample(s) more than once, " \
           "0 row(s) that are no sample" in second
    third = in_process(["--resume-from", tmp_path / "b", "--devices", "3", "--stop-after-step", "8",
                        "--checkpoint-dir", tmp_path / "c"] + metrics("c"), capsys)
    assert "stopped after run steps 0-7: the next, run step 8, is epoch 2, step 0" in third
    ends = json.loads((tmp_path / "c" / checkpoints.CHECKPOINT_FILE).read_text())["loader_state"]
    assert (ends["epoch"], ends["step"]) == (2, 0)
    last = in_process(["--resume-from", tmp_path / "c", "--devices", "6", "--compare-to", tmp_path / "never.npz",
                       "--params-out", tmp_path / "resumed.npz"] + metrics("d"), capsys)
    for name in refimpl.STRATEGY_NAMES:
        for out, epoch in ((second, 0), (third, 1)):  # where each interrupted epoch ends
            assert f"{name} epoch {epoch}: every one of the 96 samples delivered in " \
                   f"exactly one real slot, counted from the delivered rows" in out, (name, out)
    never = {(r["strategy"], r["epoch"]): (r["loss"], r["test_accuracy"], r["steps"])
             for r in map(json.loads, (tmp_path / "never.jsonl").read_text().splitlines())}
    ended = {}
    for part, epochs in (("b", (0,)), ("c", (1,)), ("d", (2,))):  # each epoch's row from the run that ends it
        rows = [json.loads(line) for line in (tmp_path / f"{part}.jsonl").read_text().splitlines()]
        # a row for each epoch a run trains a step of, and no other
        assert sorted({r["epoch"] for r in rows}) == {"b": [0, 1], "c": [1], "d": [2]}[part], part
        for r in rows:
            if r["epoch"] in epochs:
                ended[(r["strategy"], r["epoch"])] = (r["loss"], r["test_accuracy"], r["steps"])
    assert ended == never
    # --epochs: a resume needs the checkpoint's epoch, and the next when it stopped mid-epoch
    # (b: epoch 1, step 3, so 2 or more); a resume at the run's end (c: epoch 2, step 0,
    # with --epochs 2) trains nothing and ends on the checkpoint's params and state
    assert refimpl.main(["--resume-from", str(tmp_path / "b"), "--devices", "3", "--epochs", "1"]) == 2
    assert f"--epochs 1: the checkpoint in {tmp_path / 'b'} is at epoch 1, step 3; give --epochs 2 or more " \
           f"(epochs 0-1)" in capsys.readouterr().err
    in_process(["--resume-from", tmp_path / "c", "--devices", "3", "--epochs", "2", "--params-out",
                tmp_path / "end.npz"], capsys)
    ck_c = json.loads((tmp_path / "c" / checkpoints.CHECKPOINT_FILE).read_text())
    saved, end = npz(tmp_path / "c" / ck_c["arrays_file"]), npz(tmp_path / "end.npz")
    for name in refimpl.STRATEGY_NAMES:
        for kind, prefix in (("params", f"{name}/"), ("opt_state", f"{name}/opt_state/")):
            keys = sorted((k for k in saved if k.startswith(f"{kind}/{name}/")), key=lambda k: int(k.rsplit("/", 1)[1]))
            assert keys, name
            for k in keys:
                mine = end[prefix + k.rsplit("/", 1)[1]]
                assert mine.dtype == saved[k].dtype and np.array_equal(
                    np.frombuffer(mine.tobytes(), np.uint8), np.frombuffer(saved[k].tobytes(), np.uint8)), k
    assert "not bit-identical" not in last and "FAILED" not in last
    assert_same_files(tmp_path / "resumed.npz", tmp_path / "never.npz")
    # the second stop's checkpoint, as docs/running.md says it holds: the run step next to
    # train, the loader state there, what the interrupted epoch's runs delivered, the
    # run's identity and carried options, and the arrays file it names, by its SHA-256
    import hashlib
    ck = json.loads((tmp_path / "b" / checkpoints.CHECKPOINT_FILE).read_text())
    assert (ck["format"], ck["run_step"]) == ("refimpl.checkpoint/2", 7)
    assert {k: ck["loader_state"][k] for k in ("epoch", "step", "segments", "seed", "num_samples")} == \
        {"epoch": 1, "step": 3, "segments": [[0, 6, 4]], "seed": 3, "num_samples": 96}
    assert {name: [(r["steps"], r["delivered"]) for r in runs] for name, runs in ck["epoch_runs"].items()} == \
        {name: [("0-2", 72)] for name in refimpl.STRATEGY_NAMES}
    assert {k: ck["run"][k] for k in ("hidden", "logical_shards", "batch_size", "lr", "optimizer", "seed",
                                      "reduction", "strategies", "num_train")} == \
        {"hidden": [8, 8], "logical_shards": 6, "batch_size": 4, "lr": 0.01, "optimizer": "adam", "seed": 3,
         "reduction": "canonical", "strategies": list(refimpl.STRATEGY_NAMES), "num_train": 96}
    assert (ck["carried"]["epochs"], ck["carried"]["eval_batch_size"]) == (3, 16)
    assert ck["strategies"] == sorted(refimpl.STRATEGY_NAMES)
    # a stop at an epoch's end (c) leaves no interrupted epoch: no runs to carry
    assert json.loads((tmp_path / "c" / checkpoints.CHECKPOINT_FILE).read_text())["epoch_runs"] == {}
    assert {k: ck["run"][k] for k in ("dataset", "normalize", "matmul_precision", "last_batch", "shuffle")} == \
        {"dataset": "cifar10", "normalize": "rocal", "matmul_precision": "highest", "last_batch": "fill", "shuffle": True}
    assert ck["device_counts"] == [2, 6]  # every device count the run has trained on so far
    assert json.loads((tmp_path / "c" / checkpoints.CHECKPOINT_FILE).read_text())["device_counts"] == [2, 3, 6]
    arrays = (tmp_path / "b" / ck["arrays_file"]).read_bytes()
    assert hashlib.sha256(arrays).hexdigest() == ck["arrays_sha256"]


def test_a_resize_in_process_without_logical_shards_delivers_each_sample_once(tiny_dir, tmp_path, capsys):
    """The plain reduction, no logical shards: 4 devices of 8 rows stop after step 1 of 3
    (96 samples), 3 devices of 5 rows resume (plan.elastic_plan splits the 64 left): every
    sample exactly once, counted from the rows; with --last-batch drop, at most once and
    the count elastic_plan states skipped."""
    # before the stop: 1 step of 4 x 8 = 32 samples; after: 64 on 3 shards of 5 rows, each
    # shard the same number of steps: fill, 5 steps (padded), every one; drop, 4 steps of
    # 3 x 5 = 60, the 4 that do not fill a step skipped
    for policy, said in (("fill", "every one of the 96 samples delivered in exactly one real slot, counted from "
                                  "the delivered rows (real slots by run: steps 0-0 on 4 "),
                         ("drop", "each sample at most once: 92 of 96 delivered, 4 skipped, as elastic_plan "
                                  "states for drop, counted from the delivered rows (real slots by run: "
                                  "steps 0-0 on 4 ")):
        run = ["--data-dir", tiny_dir, "--epochs", "1", "--hidden", "8", "--strategies", "sharded,single",
               "--last-batch", policy, "--eval-batch-size", "16"]
        ck = tmp_path / policy
        in_process(run + ["--devices", "4", "--batch-size", "8", "--stop-after-step", "1", "--checkpoint-dir", ck],
                   capsys)
        out = in_process(["--resume-from", ck, "--devices", "3", "--batch-size", "5"], capsys)
        assert "this run: 3 cpu device(s) x 5 (reference loader, placement device): steps 1-" in out
        assert "of epoch 0 (plan.elastic_plan, segments [(0, 4, 8), (1, 3, 5)])\n" in out
        for name in ("sharded", "single"):
            [line] = [l for l in out.splitlines() if l.startswith(f"{name} epoch 0: ")]
            assert said in line and ": 32; steps 1-" in line and \
                line.endswith(f": {64 if policy == 'fill' else 60})"), line
        assert "FAILED" not in out
    # a resumed epoch stopped again before its end, then resumed on a third device count:
    # the middle run trains run steps 1-2 only, and every sample is delivered once over three
    ck, again = tmp_path / "fill", tmp_path / "again"
    out = in_process(["--resume-from", ck, "--devices", "3", "--batch-size", "5", "--stop-after-step", "3",
                      "--checkpoint-dir", again], capsys)
    assert "stopped after run steps 0-2: the next, run step 3, is epoch 0, step 3" in out
    assert "sharded epoch 0 so far, counted from the delivered rows: 62 real slot(s), 0 sample(s) more than " \
           "once, 0 row(s) that are no sample" in out, out
    out = in_process(["--resume-from", again, "--devices", "2", "--batch-size", "6"], capsys)
    [line] = [l for l in out.splitlines() if l.startswith("sharded epoch 0: ")]
    assert line.startswith("sharded epoch 0: every one of the 96 samples delivered in exactly one real slot") and \
        ": 32; steps 1-2 on 3 cpu device(s) x 5 (reference loader, placement device): 30; steps 3-" in line, line


# --------------------------------------------------------------------------
# The pieces of a resume, one by one (in process)
# --------------------------------------------------------------------------


def test_a_runs_identity_is_compared_field_by_field_each_refusal_saying_what_to_do(tmp_path):
    """check_identity: the first field (by name) in which a checkpoint's run and this one
    differ is named, with the fix its kind needs: the data (shuffle, num_train, the
    digest) "train on the checkpoint's data"; normalize the arithmetic to pass; any other
    option "leave --x out". A field that only one side has differs too; the strategies
    compare as a set (the control: another order passes, as does the same run)."""
    mine = {"hidden": [8], "lr": 0.1, "normalize": "rocal", "num_train": 96, "shuffle": True,
            "strategies": ["sharded", "pmap"], "train_data_blake2b": "ab"}
    checkpoints.check_identity("ck", dict(mine), dict(mine))
    checkpoints.check_identity("ck", dict(mine, strategies=["pmap", "sharded"]), dict(mine))
    cases = [({"train_data_blake2b": "cd"}, "train_data_blake2b='cd', this run has train_data_blake2b='ab' "
                                            "(train on the checkpoint's data)"),
             ({"normalize": "dali_cpu"}, "--normalize='dali_cpu', this run has --normalize='rocal' (the arithmetic "
                                         "this run's backend computes is not the checkpoint's dali_cpu: pass "
                                         "--normalize dali_cpu or a backend that computes it)"),
             ({"lr": 0.2}, "--lr=0.2, this run has --lr=0.1 (leave --lr out: a resumed run takes it from its "
                           "checkpoint)"),
             ({"strategies": ["sharded"]}, "--strategies=['sharded'], this run has --strategies=['sharded', 'pmap']")]
    for change, said in cases:
        with pytest.raises(ValueError, match=re.escape(f"--resume-from ck: the checkpoint was taken with {said}")):
            checkpoints.check_identity("ck", dict(mine, **change), dict(mine))
    only_mine = dict(mine, seed=3)
    with pytest.raises(ValueError, match=re.escape("taken with --seed=None, this run has --seed=3")):
        checkpoints.check_identity("ck", dict(mine), only_mine)
    with pytest.raises(ValueError, match=re.escape("taken with --seed=3, this run has --seed=None")):
        checkpoints.check_identity("ck", only_mine, dict(mine))


def test_an_epochs_deliveries_verdict_names_every_problem_in_one_line(counting):
    """Deliveries.verdict's failure: "NOT exactly once: " then each problem, "; " between
    them (a sample twice, samples never delivered, a row that is no sample), elastic_plan's
    stated count named under drop only."""
    _, deliveries, _ = counting
    vector = deliveries.zeros()
    np.add.at(vector, np.arange(len(deliveries.keys)), deliveries.expected)
    vector[0] += 1  # one sample twice
    vector[1] -= deliveries.expected[1]  # one never
    vector[-1] = 2  # two rows of no sample
    for policy, suffix in (("fill", ""), ("drop", ", where elastic_plan states 0 skipped for drop")):
        ok, said = deliveries.verdict(vector, policy, 0)
        assert not ok and said == ("NOT exactly once: 1 sample(s) delivered more than once (1 extra real slot(s)); "
                                   f"{deliveries.expected[1]} sample(s) never delivered{suffix}; "
                                   "2 real row(s) that are no sample of the data"), said


def test_taken_and_counted_close_what_they_read_even_when_it_had_more(counting):
    """taken(batches, k) yields the first k and closes the iterator it read (a loader's
    prefetch or pipelines stop there), whether it ran out or had more; counted counts
    what it yields and closes what it reads when it is closed itself."""
    closed = []

    def batches(n):
        try:
            yield from range(n)
        finally:
            closed.append(n)

    assert list(checkpoints.taken(batches(5), 2)) == [0, 1] and closed == [5]
    assert list(checkpoints.taken(batches(1), 3)) == [0] and closed == [5, 1]
    (l8, _), deliveries, _ = counting
    vector = deliveries.zeros()
    inner = closing(l8.epoch(EPOCH), closed)  # held here: only counted's close may close it
    epoch = checkpoints.counted(inner, deliveries, vector)
    next(epoch)
    epoch.close()
    assert closed[-1] == "epoch" and vector.sum() == int(np.asarray(l8.batch(EPOCH, 0)["mask"]).sum())


def closing(source, closed):
    """``source``'s items; says "epoch" in ``closed`` when it is closed."""
    try:
        yield from source
    finally:
        closed.append("epoch")


def test_run_spans_are_their_docstring_at_the_edges():
    """run_spans(epochs, stop_after_step, done, first_epoch, first_span, steps): each
    epoch's (first, stop) steps and the stop; a stop after the very last run step is
    allowed (the whole run, stopped at its end: the next epoch, step 0), one at or below
    the steps already trained, or past the last, is refused."""
    assert checkpoints.run_spans(2, None, 0, 0, None, 4) == ({0: (0, 4), 1: (0, 4)}, None)
    assert checkpoints.run_spans(2, 8, 0, 0, None, 4) == ({0: (0, 4), 1: (0, 4)}, (1, 4))
    assert checkpoints.run_spans(2, 4, 0, 0, None, 4) == ({0: (0, 4)}, (0, 4))
    assert checkpoints.run_spans(2, 5, 0, 0, None, 4) == ({0: (0, 4), 1: (0, 1)}, (1, 1))
    # resumed in epoch 1 at step 3 (run step 7 done): its rest, then epoch 2
    assert checkpoints.run_spans(3, None, 7, 1, (3, 4), 4) == ({1: (3, 4), 2: (0, 4)}, None)
    assert checkpoints.run_spans(3, 8, 7, 1, (3, 4), 4) == ({1: (3, 4)}, (1, 4))
    assert checkpoints.run_spans(3, 9, 7, 1, (3, 4), 4) == ({1: (3, 4), 2: (0, 1)}, (2, 1))
    with pytest.raises(ValueError, match="already trained run steps 0-6; stop after more than 7"):
        checkpoints.run_spans(3, 7, 7, 1, (3, 4), 4)
    with pytest.raises(ValueError, match=r"this run has only 12 run steps \(run steps 0-11, epochs 0-2\)"):
        checkpoints.run_spans(3, 13, 7, 1, (3, 4), 4)
    assert checkpoints.run_spans(3, 12, 7, 1, (3, 4), 4)[1] == (2, 4)  # the very last: allowed


def test_a_checkpoint_leaf_of_another_shape_or_dtype_is_refused_naming_it():
    """restored: each leaf must be there with this run's shape and dtype; either one
    wrong is refused naming the key (the control: the right arrays restore)."""
    import strategies
    params0 = {"b": np.zeros(3, np.float32), "w": np.ones((2, 3), np.float32)}
    rule = strategies.sgd(0.1)
    arrays = checkpoints.checkpoint_arrays({"sharded": (params0, rule.init(params0), [1.0])}, None)
    params, state = checkpoints.restored(arrays, "sharded", params0, rule)
    assert all(np.array_equal(params[k], params0[k]) for k in params0)
    for key, bad in (("params/sharded/1", np.ones((3, 2), np.float32)), ("params/sharded/1", np.ones((2, 3))),
                     ("params/sharded/0", np.zeros(3, np.int32))):
        with pytest.raises(ValueError, match=re.escape(f"the checkpoint's {key} is {bad.dtype} {bad.shape}")):
            checkpoints.restored(dict(arrays, **{key: bad}), "sharded", params0, rule)
