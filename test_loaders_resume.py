"""Resuming an epoch on other devices through the reference loader: loaders.Loader's
``epoch(e, state=...)``, ``state``, ``batch(e, s, state=)`` and ``real_samples(e, state=)``,
held to plan.elastic_plan.

Guarantees checked:

* Loader: a job that saves ``loader.state(e, s)`` (through JSON), resumes it on a
  loader of another mesh and batch size, saves again after k steps with
  ``loader.state(e, saved.step + k, state=saved)`` and resumes that on a third
  receives, block for block on the device at each mesh position, exactly
  ``plan.elastic_plan``'s rows (every name ``f(data[name][indices])``, the
  mask), in every placement and both layouts, for a dict dataset (token ids,
  float features, normalised images with crop and mirror, an index) and the tuple
  form; the sub-meshes are 8 devices, 3 others, then 4 in a permuted order.
  Counted from the delivered index rows, fill delivers every sample exactly once
  across both changes; drop at most once, skipping exactly elastic_plan's count.
  ``batch(e, s, state=)`` is the iterator's step; ``real_samples(e, state=)``
  counts the rest; on the saved shards ``state=`` is ``epoch(e, start_step)``.
  Negative control: the check fails on the next row and on the new size's fresh
  plan.
* The edges: fewer samples left than new shards (empty runs pad), a batch larger
  than each new shard's run of what is left (fill pads, drop gives 0 steps;
  make_loader's rule against a batch larger than the smallest shard is about a
  fresh epoch and does not apply), a state at the epoch's end (nothing left), and
  the refusals, each naming the parameter: a state of another run (each field),
  of another epoch, not a LoaderState, a start_step with a state, a step outside
  the resumed epoch.

refimpl's checkpoint and its exactly-once count (checkpoints.py): test_checkpoints.py.
"""

import numpy as np
import pytest

import loaders
from arithmetic import Normalize
from conftest import assert_same_bits, meshes
from plan import (LAST_BATCH_POLICIES, LoaderState, dataset_digest, elastic_num_steps, elastic_plan, epoch_plan,
                  remaining_samples)


N = 97
SEED, EPOCH = 11, 2
# 8 x 4 for 2 steps (64 delivered), 3 x 5 for 1 step (15), 4 x 3 for the rest (2 steps).
CHAIN = ((8, 4, 2), (3, 5, 1), (4, 3, None))


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
    return data, {"images": Normalize(mean=(100.0, 30.5), std=(50.0, 3.0), crop=(4, 4),
                                              crop_pos=(0.25, 0.75), mirror=True)}, "ids"


def rows_of(data, normalize, name, idx):
    """What a loader delivers for ``name`` at sample indices ``idx``."""
    arrays = data if isinstance(data, dict) else {"images": data[0], "labels": data[1]}
    norm = Normalize() if normalize == "default" and name == "images" else (
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
            want = {"mask": lambda: plan.mask[row, k], "index": lambda: plan.indices[row, k].astype(np.int32),
                    "logical_shards": lambda: np.array([k], np.int32)}.get(
                name, lambda: rows_of(data, normalize, name, plan.indices[row, k]))()
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
    plans = elastic_plan(N, segments, epoch=EPOCH, seed=SEED, shuffle=True, last_batch=last_batch)
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
        saved = LoaderState.from_json(state.to_json())
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
    end = elastic_num_steps(N, segments, "drop")
    skipped = remaining_samples(N, segments, end, epoch=EPOCH, seed=SEED, shuffle=True,
                                        last_batch="drop")
    assert len(ids) == sum(n * B * len(p.indices) for (_, n, B), p in zip(segments, plans))
    assert_same_bits(np.sort(np.concatenate([ids, skipped.astype(np.int32)])),
                     np.arange(N, dtype=np.int32), "delivered + skipped")


def test_negative_control_a_wrong_row_fails_the_check(devices):
    data, normalize, _ = dataset("dict")
    mesh = meshes(devices)[1]
    loader = loaders.make_loader(data, mesh, 5, shuffle=True, seed=SEED, normalize=normalize)
    saved = LoaderState.start(N, 8, 4, epoch=EPOCH, seed=SEED, shuffle=True).at_step(2)
    batch = next(iter(loader.epoch(EPOCH, state=saved)))
    plans = elastic_plan(N, [(0, 8, 4), (2, 3, 5)], epoch=EPOCH, seed=SEED, shuffle=True)
    check_batch(batch, plans[1], 0, mesh, data, normalize, "sharded", "right row")
    with pytest.raises(AssertionError, match="differ"):
        check_batch(batch, plans[1], 1, mesh, data, normalize, "sharded", "the next row")
    fresh = epoch_plan(N, 3, 5, epoch=EPOCH, seed=SEED, shuffle=True)
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
        assert saved == LoaderState.start(N, len(devices), 4, epoch=EPOCH, seed=SEED, shuffle=True,
                                          dataset=dataset_digest(data)).at_step(2)
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


@pytest.mark.parametrize("last_batch", LAST_BATCH_POLICIES)
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
        plans = elastic_plan(20, later.state(0, saved.step, state=saved).segments, seed=1,
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
    saved = LoaderState.start(N, 8, 4, epoch=EPOCH, seed=SEED, shuffle=True).at_step(2)
    others = {"num_samples": LoaderState.start(N + 1, 8, 4, epoch=EPOCH, seed=SEED, shuffle=True),
              "seed": LoaderState.start(N, 8, 4, epoch=EPOCH, seed=SEED + 1, shuffle=True),
              "shuffle": LoaderState.start(N, 8, 4, epoch=EPOCH, seed=SEED),
              "last_batch": LoaderState.start(N, 8, 4, epoch=EPOCH, seed=SEED, shuffle=True,
                                                      last_batch="drop")}
    for field, other in others.items():
        with pytest.raises(ValueError, match=f"Loader.epoch: the loader state was taken with {field}="):
            loader.epoch(EPOCH, state=other)
    with pytest.raises(ValueError, match=r"Loader.epoch: epoch=3, but the state is of epoch 2"):
        loader.epoch(EPOCH + 1, state=saved)
    with pytest.raises(ValueError, match="Loader.epoch: start_step=1 with a state"):
        loader.epoch(EPOCH, 1, state=saved)
    with pytest.raises(ValueError, match="state must be a plan.LoaderState.*got str"):
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
# Issue 30.3: start_step is the same plan's only; a state names its data
# --------------------------------------------------------------------------

import dataclasses  # noqa: E402


def test_start_step_continues_only_the_same_logical_shards_and_batch(devices):
    # The Loader docstring's example, 5,000 samples, batch 16, shuffled, seed 0: 8 devices
    # stopped at step 17 and 4 resumed with start_step=17 deliver 1,619 samples twice and
    # 531 never (what epoch(e, start_step) yields is plan(e) from that row: test_loaders).
    ids = {"ids": np.arange(5000, dtype=np.int32)}
    make = lambda devs, **kw: loaders.make_loader(ids, devs, 16, shuffle=True, **kw)
    eight, four = make(devices[:8]), make(devices[:4])
    p8, p4 = eight.plan(0), four.plan(0)
    trap = np.bincount(np.concatenate([p8.indices[:17][p8.mask[:17]], p4.indices[17:][p4.mask[17:]]]),
                       minlength=5000)
    assert ((trap >= 2).sum(), (trap == 0).sum()) == (1619, 531)
    # The same logical shards and batch on 4 devices: start_step=17 is the same plan's rest.
    same = make(devices[:4], logical_shards=8).plan(0)
    assert_same_bits(same.indices[17:], p8.indices[17:], "logical_shards=8 on 4 devices")
    # The state, taken on 8 and resumed on 4: each sample exactly once, counted as delivered.
    saved = eight.state(0, 17)
    rest = np.concatenate([real_ids(b, "ids") for b in four.epoch(0, state=saved)])
    got = np.sort(np.concatenate([p8.indices[:17][p8.mask[:17]], rest]))
    assert_same_bits(got, np.arange(5000, dtype=np.int64), "resumed from the state")


def test_a_state_of_other_data_of_the_same_size_is_refused_naming_dataset(devices):
    data, normalize, _ = dataset("dict")
    other = {**data, "features": data["features"][::-1].copy()}  # the same N, other samples
    mesh8, mesh3, _ = meshes(devices)
    saved = loaders.make_loader(data, mesh8, 4, shuffle=True, seed=SEED, normalize=normalize).state(EPOCH, 2)
    assert saved.dataset == dataset_digest(data) and LoaderState.from_json(saved.to_json()) == saved
    loader = loaders.make_loader(other, mesh3, 5, shuffle=True, seed=SEED, normalize=normalize)
    for what, call in [("epoch", lambda: loader.epoch(EPOCH, state=saved)),
                       ("batch", lambda: loader.batch(EPOCH, 2, state=saved)),
                       ("state", lambda: loader.state(EPOCH, 3, state=saved)),
                       ("real_samples", lambda: loader.real_samples(EPOCH, state=saved))]:
        with pytest.raises(ValueError, match=rf"Loader.{what}: the loader state was taken with "
                                             rf"dataset='{saved.dataset}', this run has "
                                             rf"dataset='{dataset_digest(other)}'"):
            call()
    # The controls: the same data on other devices resumes; a state that names no data (made
    # by hand, or read from format 1) is taken on trust, and the loader's next state names it.
    again = loaders.make_loader({k: v.copy() for k, v in data.items()}, mesh3, 5, shuffle=True, seed=SEED,
                                normalize=normalize)
    assert next(iter(again.epoch(EPOCH, state=saved)))["mask"].shape == (15,)
    unnamed = dataclasses.replace(saved, dataset=None)
    assert loader.state(EPOCH, 3, state=unnamed).dataset == dataset_digest(other)


def test_a_loader_computes_its_digest_once_and_only_for_states(devices, monkeypatch):
    calls = []
    monkeypatch.setattr(loaders, "dataset_digest", lambda arrays: calls.append(1) or dataset_digest(arrays))
    data, normalize, _ = dataset("dict")
    mesh8, mesh3, _ = meshes(devices)
    loader = loaders.make_loader(data, mesh8, 4, shuffle=True, seed=SEED, normalize=normalize, prefetch=0)
    len(loader), loader.plan(EPOCH), loader.real_samples(EPOCH), loader.batch(EPOCH, 0)
    next(iter(loader.epoch(EPOCH, start_step=1)))
    assert calls == [], "no state, no digest"
    saved = loader.state(EPOCH, 2)
    loader.state(EPOCH, 3), list(loader.epoch(EPOCH, state=saved)), loader.real_samples(EPOCH, state=saved)
    assert len(calls) == 1, "once per loader"
    loaders.make_loader(data, mesh3, 5, shuffle=True, seed=SEED, normalize=normalize).state(EPOCH, 1)
    assert len(calls) == 2, "the control: another loader computes its own"
