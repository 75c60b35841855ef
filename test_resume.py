"""Resuming an epoch on other devices: the reference loader's ``epoch(e, state=...)``
and refimpl.py's checkpoint (--stop-after-step, --checkpoint-dir, --resume-from).

Guarantees checked:

* Loader: a job that saves ``loader.state(e, s)`` (through JSON), resumes it on a
  loader of another mesh and batch size, saves again after k steps with
  ``loader.state(e, saved.step + k, state=saved)`` and resumes that on a third
  receives, block for block on the device at each mesh position, exactly
  ``loaders.elastic_plan``'s rows (every name ``f(data[name][indices])``, the
  mask), in every placement and both layouts, for a dict dataset (token ids,
  float features, normalised images with crop and mirror, an index) and the tuple
  form; the sub-meshes are 8 devices, 3 others, then 4 in a permuted order.
  Counted from the delivered index rows, fill delivers every sample exactly once
  across both changes; drop at most once, skipping exactly elastic_plan's count.
  ``batch(e, s, state=)`` is the iterator's step; ``real_samples(e, state=)``
  counts the rest; on the saved shards ``state=`` is ``epoch(e, start_step)``.
* The edges: fewer samples left than new shards (empty runs pad), a batch larger
  than each new shard's run of what is left (fill pads, drop gives 0 steps;
  make_loader's rule against a batch larger than the smallest shard is about a
  fresh epoch and does not apply), a state at the epoch's end (nothing left), and
  the refusals, each naming the parameter: a state of another run (each field),
  of another epoch, not a LoaderState, a start_step with a state, a step outside
  the resumed epoch.
* refimpl's exactly-once count (``Deliveries``) on real deliveries: the right
  resume passes; a restart of the epoch from step 0 on the new shards (samples
  twice), a resume that reads the new size's fresh plan from the step (samples
  missed), and a row that is no sample are each reported, in words.
* refimpl's checkpoint: a reader never sees half of one (a write that dies
  midway leaves the previous checkpoint whole), an arrays file that is not the
  one named is refused, a checkpoint of another run is refused naming the field,
  bad options are refused, and a backend whose loader takes no state refuses a
  resize with its reason.
* End to end (a child refimpl.py, 4 devices stop, 3 resume): the report says
  every sample was delivered exactly once across the change, and the strategies
  agree within their bound. With --run-slow: the issue's two resizes (2
  processes of 4 devices stop at step 7 and 1 process of 8 resumes, within the
  cross-process bound of an uninterrupted run; 8 devices stop and 3 resume), a
  resume on the same devices bit-identical to an uninterrupted run, and host vs
  device placement bit-identical across a resize.
"""

import json
import os
import sys

import numpy as np
import pytest

import loaders
import refimpl
from conftest import assert_same_bits, run_children

HERE = os.path.dirname(os.path.abspath(__file__))
N = 97
SEED, EPOCH = 11, 2
# 8 x 4 for 2 steps (64 delivered), 3 x 5 for 1 step (15), 4 x 3 for the rest (2 steps).
CHAIN = ((8, 4, 2), (3, 5, 1), (4, 3, None))


def meshes(devices):
    """Sub-meshes of the suite's devices: all 8, 3 others, 4 in a permuted order."""
    three = devices[-3:] if len(devices) >= 3 else devices[:1]
    four = [devices[i % len(devices)] for i in (6, 1, 3, 0)] if len(devices) >= 8 else devices[::-1]
    return [loaders.data_mesh(devices), loaders.data_mesh(three), loaders.data_mesh(four)]


def dataset(form: str):
    """(data, normalize, the name whose rows hold their sample's index)."""
    rng = np.random.default_rng(5)
    index = np.arange(N, dtype=np.int32)
    if form == "tuple":
        return (rng.integers(0, 256, (N, 3, 4, 4)).astype(np.uint8), index), "default", "labels"
    data = {"tokens": rng.integers(0, 500, (N, 3)).astype(np.int32),
            "features": rng.standard_normal((N, 2), dtype=np.float32),
            "images": rng.integers(0, 256, (N, 2, 5, 6)).astype(np.uint8),
            "ids": index}
    return data, {"images": loaders.Normalize(mean=(100.0, 30.5), std=(50.0, 3.0), crop=(4, 4),
                                              crop_pos=(0.25, 0.75), mirror=True)}, "ids"


def rows_of(data, normalize, name, idx):
    """What a loader delivers for ``name`` at sample indices ``idx``."""
    arrays = data if isinstance(data, dict) else {"images": data[0], "labels": data[1]}
    norm = loaders.Normalize() if normalize == "default" and name == "images" else (
        normalize.get(name) if isinstance(normalize, dict) else None)
    return arrays[name][idx] if norm is None else norm(arrays[name][idx])


def check_batch(batch, plan, row, mesh, data, normalize, layout, what):
    """Every local block of every name of ``batch`` is ``plan`` row ``row``'s, on the
    device at its mesh position."""
    position = {d: k for k, d in enumerate(mesh.devices.flat)}
    for name, array in batch.items():
        assert array.sharding.device_set == set(mesh.devices.flat), f"{what}: {name} off the mesh"
        for shard in array.addressable_shards:
            k = position[shard.device]
            want = plan.mask[row, k] if name == "mask" else rows_of(data, normalize, name,
                                                                    plan.indices[row, k])
            got = np.asarray(shard.data)
            if layout == "pmap":
                assert got.shape[0] == 1, f"{what}: {name} block of shape {got.shape}"
                got = got[0]
            assert_same_bits(got, want, f"{what}: {name}, row {row}, shard {k}")


def real_ids(batch, id_name):
    return np.asarray(batch[id_name]).reshape(-1)[np.asarray(batch["mask"]).reshape(-1)]


def run_chain(devices, form, placement, layout, last_batch, check=True):
    """A job over CHAIN: save, reload (JSON), resize, twice. Returns (the delivered
    real ids, the segments, the plans) after checking every batch against them."""
    data, normalize, id_name = dataset(form)
    made = [loaders.make_loader(data, mesh, B, layout=layout, shuffle=True, seed=SEED,
                                last_batch=last_batch, normalize=normalize, placement=placement)
            for mesh, (_, B, _) in zip(meshes(devices), CHAIN)]
    segments, start = [], 0
    for loader, (n, B, steps) in zip(made, CHAIN):
        segments.append((start, loader.num_shards, B))
        start += steps or 0
    plans = loaders.elastic_plan(N, segments, epoch=EPOCH, seed=SEED, shuffle=True, last_batch=last_batch)
    delivered, saved = [], None
    for i, (loader, (_, _, steps)) in enumerate(zip(made, CHAIN)):
        batches = loader.epoch(EPOCH) if saved is None else loader.epoch(EPOCH, state=saved)
        first = 0 if saved is None else saved.step
        count = 0
        for batch in batches:
            if check:
                check_batch(batch, plans[i], count, loader.mesh, data, normalize, layout,
                            f"{form} {placement} {layout} {last_batch} segment {i}")
            delivered.append(real_ids(batch, id_name))
            count += 1
            if count == steps:
                break
        if steps is not None:
            batches.close()
        assert count == len(plans[i].indices), f"segment {i}: {count} steps, plan has {len(plans[i].indices)}"
        state = loader.state(EPOCH, first + count, state=saved)
        saved = loaders.LoaderState.from_json(state.to_json())
    assert saved.segments == tuple(segments) and saved.step == start + len(plans[-1].indices)
    return np.concatenate(delivered), segments, plans


@pytest.mark.parametrize("form", ["dict", "tuple"])
@pytest.mark.parametrize("placement", loaders.PLACEMENTS)
def test_resumed_chain_delivers_elastic_plans_rows(devices, form, placement):
    for layout in loaders.LAYOUTS:
        ids, _, _ = run_chain(devices, form, placement, layout, "fill")
        assert_same_bits(np.sort(ids), np.arange(N, dtype=np.int32),
                         f"{form} {placement} {layout}: every sample exactly once across two changes")


@pytest.mark.parametrize("placement", ["host", "device"])
def test_resumed_chain_with_drop_skips_the_stated_count(devices, placement):
    ids, segments, plans = run_chain(devices, "dict", placement, "sharded", "drop")
    assert len(np.unique(ids)) == len(ids), "drop delivered a sample twice"
    end = loaders.elastic_num_steps(N, segments, "drop")
    skipped = loaders.remaining_samples(N, segments, end, epoch=EPOCH, seed=SEED, shuffle=True,
                                        last_batch="drop")
    assert len(ids) == sum(n * B * len(p.indices) for (_, n, B), p in zip(segments, plans))
    assert_same_bits(np.sort(np.concatenate([ids, skipped.astype(np.int32)])),
                     np.arange(N, dtype=np.int32), "delivered + skipped")


def test_negative_control_a_wrong_row_fails_the_check(devices):
    data, normalize, _ = dataset("dict")
    mesh = meshes(devices)[1]
    loader = loaders.make_loader(data, mesh, 5, shuffle=True, seed=SEED, normalize=normalize)
    saved = loaders.LoaderState.start(N, 8, 4, epoch=EPOCH, seed=SEED, shuffle=True).at_step(2)
    batch = next(iter(loader.epoch(EPOCH, state=saved)))
    plans = loaders.elastic_plan(N, [(0, 8, 4), (2, 3, 5)], epoch=EPOCH, seed=SEED, shuffle=True)
    check_batch(batch, plans[1], 0, mesh, data, normalize, "sharded", "right row")
    with pytest.raises(AssertionError, match="differ"):
        check_batch(batch, plans[1], 1, mesh, data, normalize, "sharded", "the next row")
    fresh = loaders.epoch_plan(N, 3, 5, epoch=EPOCH, seed=SEED, shuffle=True)
    with pytest.raises(AssertionError, match="differ"):
        check_batch(batch, fresh, 2, mesh, data, normalize, "sharded", "the fresh plan's step 2")


def test_random_access_real_samples_and_same_shards(devices):
    data, normalize, _ = dataset("dict")
    mesh8, mesh3, _ = meshes(devices)
    for placement in ("host", "device"):
        l8 = loaders.make_loader(data, mesh8, 4, shuffle=True, seed=SEED, normalize=normalize,
                                 placement=placement)
        l3 = loaders.make_loader(data, mesh3, 5, shuffle=True, seed=SEED, normalize=normalize,
                                 placement=placement)
        saved = l8.state(EPOCH, 2)
        assert saved == loaders.LoaderState.start(N, len(devices), 4, epoch=EPOCH, seed=SEED,
                                                  shuffle=True).at_step(2)
        steps = list(l3.epoch(EPOCH, state=saved))
        for s in (saved.step, saved.step + len(steps) - 1):
            one = l3.batch(EPOCH, s, state=saved)
            for name in one:
                assert_same_bits(np.asarray(one[name]), np.asarray(steps[s - saved.step][name]),
                                 f"{placement}: batch({s}, state=) {name}")
        assert l3.real_samples(EPOCH, state=saved) == N - 64 == sum(
            int(np.asarray(b["mask"]).sum()) for b in steps)
        # On the saved shards a state is today's start_step resume, bit for bit.
        for a, b in zip(l8.epoch(EPOCH, state=saved), l8.epoch(EPOCH, start_step=2), strict=True):
            for name in a:
                assert_same_bits(np.asarray(a[name]), np.asarray(b[name]), f"{placement}: {name}")


@pytest.mark.parametrize("last_batch", loaders.LAST_BATCH_POLICIES)
def test_fewer_samples_left_than_shards_and_a_batch_larger_than_the_rest(devices, last_batch):
    ids = np.arange(20, dtype=np.int32)
    data = {"ids": ids, "x": np.arange(40, dtype=np.float32).reshape(20, 2)}
    mesh8, _, mesh4 = meshes(devices)
    first = loaders.make_loader(data, mesh4, 2, shuffle=True, seed=1, last_batch=last_batch)
    for placement in ("host", "device"):
        # fill: 4 x 2 for 2 of 3 steps leaves 4 samples for 8 shards; drop: 1 of 2 steps leaves 12.
        step = 2 if last_batch == "fill" else 1
        saved = first.state(0, step)
        done = [real_ids(b, "ids") for b in first.epoch(0)][:step]
        wide = mesh8 if last_batch == "fill" else loaders.data_mesh(list(mesh8.devices.flat)[:2])
        B = 2 if last_batch == "fill" else 8  # drop: the 12 left make runs of 6 < B = 8
        later = loaders.make_loader(data, wide, B, shuffle=True, seed=1, last_batch=last_batch,
                                    placement=placement)
        rest = list(later.epoch(0, state=saved))
        plans = loaders.elastic_plan(20, later.state(0, saved.step, state=saved).segments, seed=1,
                                     shuffle=True, last_batch=last_batch)
        assert len(rest) == len(plans[-1].indices) == (1 if last_batch == "fill" else 0)
        for r, batch in enumerate(rest):
            check_batch(batch, plans[-1], r, wide, data, None, "sharded", f"{placement} {last_batch}")
        got = np.sort(np.concatenate(done + [real_ids(b, "ids") for b in rest]))
        want = ids if last_batch == "fill" else np.sort(np.concatenate(done))
        assert_same_bits(got, want, f"{placement} {last_batch}: delivered")


def test_a_state_at_the_epochs_end_leaves_nothing(devices):
    data, normalize, _ = dataset("dict")
    mesh8, mesh3, _ = meshes(devices)
    l8 = loaders.make_loader(data, mesh8, 4, shuffle=True, seed=SEED, normalize=normalize)
    l3 = loaders.make_loader(data, mesh3, 5, shuffle=True, seed=SEED, normalize=normalize,
                             placement="device")
    end = l8.state(EPOCH, len(l8))
    assert list(l3.epoch(EPOCH, state=end)) == [] and l3.real_samples(EPOCH, state=end) == 0
    assert l3.state(EPOCH, end.step, state=end).num_steps == end.step


def test_refusals_name_the_parameter(devices):
    data, normalize, _ = dataset("dict")
    mesh8, mesh3, _ = meshes(devices)
    loader = loaders.make_loader(data, mesh3, 5, shuffle=True, seed=SEED, normalize=normalize)
    saved = loaders.LoaderState.start(N, 8, 4, epoch=EPOCH, seed=SEED, shuffle=True).at_step(2)
    others = {"num_samples": loaders.LoaderState.start(N + 1, 8, 4, epoch=EPOCH, seed=SEED, shuffle=True),
              "seed": loaders.LoaderState.start(N, 8, 4, epoch=EPOCH, seed=SEED + 1, shuffle=True),
              "shuffle": loaders.LoaderState.start(N, 8, 4, epoch=EPOCH, seed=SEED),
              "last_batch": loaders.LoaderState.start(N, 8, 4, epoch=EPOCH, seed=SEED, shuffle=True,
                                                      last_batch="drop")}
    for field, other in others.items():
        with pytest.raises(ValueError, match=f"Loader.epoch: the loader state was taken with {field}="):
            loader.epoch(EPOCH, state=other)
    with pytest.raises(ValueError, match=r"Loader.epoch: epoch=3, but the state is of epoch 2"):
        loader.epoch(EPOCH + 1, state=saved)
    with pytest.raises(ValueError, match="Loader.epoch: start_step=1 with a state"):
        loader.epoch(EPOCH, 1, state=saved)
    with pytest.raises(ValueError, match="state must be a loaders.LoaderState.*got str"):
        loader.epoch(EPOCH, state=saved.to_json())
    with pytest.raises(ValueError, match="Loader.state: step=1 is before the state's step 2"):
        loader.state(EPOCH, 1, state=saved)
    with pytest.raises(ValueError, match="Loader.state: step=99"):
        loader.state(EPOCH, 99, state=saved)
    with pytest.raises(ValueError, match="Loader.state: step=99"):
        loader.state(EPOCH, 99)
    with pytest.raises(IndexError, match=r"step=1 is outside \[2, 5\)"):
        loader.batch(EPOCH, 1, state=saved)
    with pytest.raises(ValueError, match="Loader.real_samples: epoch=0"):
        loader.real_samples(0, state=saved)


# --------------------------------------------------------------------------
# refimpl's exactly-once count, on real deliveries (in-process)
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def counting(devices):
    """Two loaders as refimpl builds them (tuple form, Normalize), and Deliveries."""
    rng = np.random.default_rng(9)
    train = (rng.integers(0, 256, (N, 3, 4, 4)).astype(np.uint8), rng.integers(0, 10, N).astype(np.int32))
    norm = loaders.Normalize(mean=(127.5,) * 3, std=(127.5,) * 3)
    mesh8, mesh3, _ = meshes(devices)
    made = [loaders.make_loader(train, mesh, B, shuffle=True, seed=SEED, normalize=norm, placement=p)
            for mesh, B, p in ((mesh8, 4, "device"), (mesh3, 5, "host"))]
    return made, refimpl.Deliveries(train, norm), train


def count(deliveries, *iterators):
    vector = deliveries.zeros()
    for batches in iterators:
        for batch in batches:
            deliveries.count(batch, vector)
    return vector


def test_deliveries_pass_the_right_resume(counting):
    (l8, l3), deliveries, _ = counting
    saved = l8.state(EPOCH, 2)
    vector = count(deliveries, refimpl.taken(l8.epoch(EPOCH), 2), l3.epoch(EPOCH, state=saved))
    ok, said = deliveries.verdict(vector, "fill", 0)
    assert ok and said == f"every one of the {N} samples delivered in exactly one real slot", said


def test_deliveries_report_a_restart_from_step_0(counting):
    (l8, l3), deliveries, _ = counting
    vector = count(deliveries, refimpl.taken(l8.epoch(EPOCH), 2), l3.epoch(EPOCH))
    ok, said = deliveries.verdict(vector, "fill", 0)
    assert not ok and "64 sample(s) delivered more than once" in said, said


def test_deliveries_report_a_fresh_plan_read_from_the_step(counting):
    (l8, l3), deliveries, _ = counting
    vector = count(deliveries, refimpl.taken(l8.epoch(EPOCH), 2), l3.epoch(EPOCH, start_step=2))
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
# refimpl's checkpoint files and options (in-process)
# --------------------------------------------------------------------------


def test_a_checkpoint_write_that_dies_leaves_the_previous_one(tmp_path, monkeypatch):
    state = loaders.LoaderState.start(N, 8, 4, seed=SEED, shuffle=True).at_step(2)
    doc = {"format": refimpl.CHECKPOINT_FORMAT, "run": {}, "run_step": 2,
           "loader_state": json.loads(state.to_json())}
    first = {"params/sharded/0": np.arange(6, dtype=np.float32)}
    refimpl.write_checkpoint(str(tmp_path), dict(doc), first)

    def dies(f, **arrays):
        f.write(b"PK\x03\x04 half an archive")
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(np, "savez", dies)
    with pytest.raises(OSError, match="simulated"):
        refimpl.write_checkpoint(str(tmp_path), dict(doc, run_step=3), {"params/sharded/0": np.zeros(6)})
    monkeypatch.undo()
    got, arrays = refimpl.read_checkpoint(str(tmp_path))
    assert got["run_step"] == 2 and got["loader_state"] == state
    assert_same_bits(arrays["params/sharded/0"], first["params/sharded/0"], "the previous arrays")
    # A later write replaces it and removes the arrays file no longer named.
    refimpl.write_checkpoint(str(tmp_path), dict(doc, run_step=3), {"params/sharded/0": np.ones(6)})
    assert refimpl.read_checkpoint(str(tmp_path))[0]["run_step"] == 3
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".npz")]) == 1

    named = json.loads((tmp_path / refimpl.CHECKPOINT_FILE).read_text())["arrays_file"]
    with open(tmp_path / named, "ab") as f:
        f.write(b"x")
    with pytest.raises(ValueError, match="has SHA-256 .* not this checkpoint's"):
        refimpl.read_checkpoint(str(tmp_path))
    (tmp_path / refimpl.CHECKPOINT_FILE).write_text(json.dumps({"format": "other/1"}))
    with pytest.raises(ValueError, match="is not a refimpl.checkpoint/1 checkpoint"):
        refimpl.read_checkpoint(str(tmp_path))


@pytest.mark.parametrize("change, field", [
    (["--seed", "1"], "--seed=0"), (["--strategies", "sharded"], "--strategies="),
    (["--last-batch", "drop"], "--last-batch="), (["--lr", "0.01"], "--lr="),
    (["--matmul-precision", "high"], "--matmul-precision="), (["--dataset", "mnist"], "--dataset="),
    (["--hidden", "64,64"], "--hidden=")])
def test_a_checkpoint_of_another_run_is_refused_naming_the_field(change, field):
    train = (np.zeros((4, 3, 2, 2), np.uint8), np.arange(4, dtype=np.int32))
    saved = refimpl.run_identity(refimpl.parse_args([]), train, "rocal")
    other = refimpl.run_identity(refimpl.parse_args(change), train, "rocal")
    with pytest.raises(ValueError, match=f"the checkpoint was taken with {field}"):
        refimpl.check_identity("ck", saved, other)
    # What may change: where and how it runs.
    same = refimpl.run_identity(refimpl.parse_args(["--devices", "3", "--batch-size", "5", "--placement",
                                                    "host", "--epochs", "9"]), train, "rocal")
    refimpl.check_identity("ck", saved, same)
    for data, arithmetic, name in (((train[0] + 1, train[1]), "rocal", "train_data_blake2b"),
                                   (train, "dali_cpu", "arithmetic")):
        with pytest.raises(ValueError, match=f"taken with {name}="):
            refimpl.check_identity("ck", saved, refimpl.run_identity(refimpl.parse_args([]), data, arithmetic))


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

    saved = loaders.LoaderState.start(N, 8, 4, shuffle=True).at_step(3)
    assert list(refimpl.resumed_epoch(VendorLike(), 0, saved, 8, 4)) == [3]
    with pytest.raises(ValueError, match="takes no loader state: it cannot resume epoch 1 on another"):
        refimpl.resumed_epoch(VendorLike(), 0, saved, 3, 4)


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
    return loaders.synthetic_cifar10(tmp_path_factory.mktemp("tiny"), num_train=96, num_test=16, seed=3)


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
    import strategies

    a, b = np.load(a), np.load(b)
    out = {}
    for name in sorted({k.split("/")[0] for k in a.files}):
        keys = sorted((k for k in a.files if k.startswith(name + "/")), key=lambda k: int(k.split("/")[1]))
        la, lb = [a[k] for k in keys], [b[k] for k in keys]
        same = all(x.shape == y.shape and np.array_equal(x.view(np.uint32), y.view(np.uint32))
                   for x, y in zip(la, lb))
        out[name] = (same, strategies.ulps_apart(la, lb))
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
