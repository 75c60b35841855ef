"""bench.py stays runnable: --smoke (the smallest run through every section), in a CPU-only
subprocess (conftest.run_children).

No timing is asserted, not even its range: on a loaded machine a loaded epoch
can run faster than a prebuilt one. The run must exit 0 and write a well-formed
report: every section and row, every figure a finite number, the goals and the
list of implausible figures bench flags itself (which may be non-empty).
"""

import argparse
import functools
import json
import math
import os
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import bench
import loaders
import strategies
import summation
from conftest import run_children

HERE = os.path.dirname(os.path.abspath(__file__))


def number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.mark.slow
def test_bench_smoke_runs_and_writes_a_well_formed_report(tmp_path):
    out = tmp_path / "bench.json"
    command = [sys.executable, os.path.join(HERE, "bench.py"), "--smoke", "--no-grain", "--json", str(out)]
    [(code, stdout, stderr)] = run_children([command], timeout=300, cwd=HERE)
    assert code == 0, stderr[-3000:]
    assert "| reference, host |" in stdout and "**Goals**" in stdout
    results = json.loads(out.read_text())
    assert {"machine", "config", "loader", "feeding", "training", "reduction", "goals", "implausible",
            "section_s"} <= set(results)

    for key in ("per_device_16", "per_device_128"):
        section = results["loader"][key]
        assert number(section["copy_limit_gb_per_s"]) and number(section["to_devices_gb_per_s"])
        assert {f"reference, {p}" for p in loaders.PLACEMENTS} | {"naive loop"} <= set(section["loaders"])
        for r in section["loaders"].values():
            assert all(number(r[f]) for f in ("images_per_s", "gb_per_s", "fraction_of_copy",
                                              "reference_speedup")), r
            assert r["images"] > 0

    for row in results["feeding"].values():
        assert row["steps"] >= 1 and row["images"] >= row["steps"]
        for p in loaders.PLACEMENTS:
            assert number(row["sharded"][p]["fed_over_prebuilt"]) and number(row["sharded"][p]["prebuilt_step_ms"])
        assert all(number(row["sharded"]["host"][f]) for f in ("transfer_ms", "first_transfer_ms", "limit")), row
        assert row["sharded"]["host"]["limit"] >= 1.0

    assert set(results["training"]) == {f"global_{b}" for b in results["training_batches"]}
    for row in (v for k, v in results["training"].items() if k.startswith("global_")):
        assert set(row) == {"sharded", "pmap", "shard_map", "single"}
        for r in row.values():
            assert number(r["step_ms"]) and number(r["compile_s"]) and number(r["ratio_to_single"]), r
            assert set(r["compile"]) == {"trace", "lower", "xla", "s"} and r["compile"]["xla"] > 0, r
        assert row["single"]["ratio_to_single"] == 1.0

    reduction = results["reduction"]
    assert {r["model"] for r in reduction["cases"]} == {"mlp", "conv", "attention"}
    assert {r["logical_shards"] // r["devices"] for r in reduction["cases"]} == {1, 4}  # L = n and 4n
    for r in reduction["cases"]:
        assert r["rows"] % r["logical_shards"] == 0, r
        for step in ("plain", "canonical"):
            assert number(r[step]["step_ms"]) and number(r[step]["memory_mb"]), r
        assert number(r["ratio"]["step_time"]) and number(r["ratio"]["memory"]), r
        assert number(r["floor_ms"]) and number(r["ratio"]["floor"]), r
    assert [c["devices"] for c in reduction["compile_s"]] == [1, 2]
    assert [r["devices"] for r in reduction["any_n"]] == [3] and "**Any n**" in stdout  # 3 devices, L = 8
    assert all(number(r[step]) for r in reduction["any_n"] for step in ("plain", "canonical")), reduction["any_n"]
    assert reduction["precision"] == "highest" and "| mlp |" in stdout and "L = 4n" in stdout

    assert results["goals"] and all({"goal", "measured", "target", "met"} <= set(g) for g in results["goals"])
    assert "**Feeding**" in stdout and "| sharded | host |" in stdout
    assert isinstance(results["implausible"], list) and all(isinstance(t, str) for t in results["implausible"])
    assert list(results["section_s"]) == ["loader", "feeding", "training", "reduction"]


@pytest.mark.parametrize("loop", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_floor_runs_the_canonical_steps_own_arithmetic(devices, monkeypatch, loop):
    """bench.block_work runs what the canonical step computes on each device: its block sums,
    summed exactly (summation.exact_sum, whole, on one device) and updated, are the canonical step's
    state, bit for bit, and with ``fold`` each device returns the exact sum of its own blocks
    (the smoke MLP, L = 6 on 2 devices; also with a TPU's loop schedule). The control: a
    float32 left fold of the blocks gives other bits.
    The default tier holds this guarantee with [False] (here [True] is the extended tier's)."""
    monkeypatch.setattr(strategies, "LOOP_PLATFORMS", ("cpu",) if loop else ())
    mesh = loaders.data_mesh(devices[:2])
    start, batch, steps = bench.reduction_case("mlp", 18, 6, mesh, smoke=True)
    want = jax.tree.leaves(steps["canonical"](strategies.replicate(start, mesh), batch))
    outs = bench.block_work("mlp", start, batch, mesh, 6, fold=False)()  # per device: its 3 blocks, stacked or not
    per_device = [[jax.tree.map(lambda x: np.asarray(x)[i], out) for i in range(3)] if loop else
                  [jax.tree.map(lambda x: np.asarray(x)[0], s) for s in out] for out in outs]
    exact = jax.jit(functools.partial(summation.exact_sum, whole=True))
    stacked = lambda blocks: jax.tree.map(lambda *x: np.stack(x), *blocks)
    left_fold = lambda blocks: jax.tree.map(lambda *x: functools.reduce(np.add, x), *blocks)
    update, blocks = strategies.update_program(strategies.sgd_update), sum(per_device, [])
    for sums, same in ((exact(stacked(blocks)), True), (left_fold(blocks), False)):
        got = jax.tree.leaves(update(start, *sums))
        assert all(np.array_equal(a, b) for a, b in zip(got, want)) == same, same
    for out, own in zip(bench.block_work("mlp", start, batch, mesh, 6)(), per_device):
        assert all(np.array_equal(np.asarray(a).reshape(np.shape(b)), b)
                   for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(exact(stacked(own)))))


@pytest.mark.parametrize("shards,loop", [(3, False), pytest.param(3, True, marks=pytest.mark.slow),
                                         pytest.param(4, False, marks=pytest.mark.slow),
                                         pytest.param(4, True, marks=pytest.mark.slow)])
def test_the_memory_figures_analyse_the_programs_the_steps_ran(devices, monkeypatch, shards, loop):
    """bench.step_memory reads XLA's analysis of the programs each step has already compiled:
    after one plain and one canonical step (the smoke MLP, L = 3 and 4 on 2 devices, n dividing L
    or not; also with a TPU's loop schedule), measuring compiles nothing. The control: Compiles
    hears a new program. The default tier holds this guarantee at L = 3 without the loop (the
    rest is the extended tier's). The steps train a loss_terms of this test's own (bench.anew):
    every program and door the steps fetch is made here, whatever ran before in this process."""
    monkeypatch.setattr(strategies, "LOOP_PLATFORMS", ("cpu",) if loop else ())
    mesh = loaders.data_mesh(devices[:2])
    start, batch, _ = bench.reduction_case("mlp", 12, shards, mesh, smoke=True)
    loss_terms = bench.anew(bench.MODELS["mlp"][1])
    compiles = bench.Compiles()
    for name, step in bench.reduction_steps(loss_terms, mesh, shards).items():
        state = strategies.replicate(start, mesh)
        jax.block_until_ready(step(state, batch))
        mark = len(compiles.heard)
        make = lambda: bench.reduction_steps(loss_terms, mesh, shards, uncached=True)[name]
        assert bench.step_memory(make, state, batch) > 0
        assert compiles.heard[mark:] == [], (name, compiles.heard[mark:])
    mark = len(compiles.heard)
    jax.jit(lambda x: x * 3 + 1)(np.ones(5, np.float32))
    assert compiles.since(mark)["xla"] > 0 and {p for p, *_ in compiles.heard[mark:]} == {"trace", "lower", "xla"}


def test_the_memory_figures_follow_what_the_step_holds(devices, monkeypatch):
    """The reduction section measures the step it times, not a model of it: a canonical step that
    holds 16 MiB more on each device while its programs run reads 16 MiB more, and the plain
    step's figure stays (the smoke MLP, L = 4 on 2 devices). The control: the same step without
    the ballast."""
    made = strategies.canonical_step

    def ballasted(mib):
        def canonical_step(loss_terms, update, mesh, logical_shards):
            step = made(loss_terms, update, mesh, logical_shards)

            def held(state, batch):
                ballast = jax.device_put(np.zeros((mesh.devices.size, mib << 18), np.float32),
                                         NamedSharding(mesh, P(loaders.DATA_AXIS)))
                out = step(state, batch)
                del ballast  # alive through every program of the step
                return out
            return held
        return canonical_step
    figures = []
    for mib in (0, 16):
        monkeypatch.setattr(strategies, "canonical_step", ballasted(mib))
        args = argparse.Namespace(reduction_devices=2, reduction_cases=[("mlp", 16, 2)], smoke=True, step_rounds=1,
                                  compile_devices=(), any_devices=(), compiles=bench.Compiles(),
                                  note=lambda *_: None)
        out = {}
        bench.reduction_section(args, out)
        [row] = out["cases"]
        figures.append((row["plain"]["memory_mb"], row["canonical"]["memory_mb"]))
    (plain, canonical), (plain16, canonical16) = figures
    assert plain16 == plain and canonical16 - canonical == 16, figures


@pytest.mark.slow
def test_on_one_device_the_warm_ups_run_side_by_side_and_each_compile_is_its_threads(devices):
    """bench.reduction_section on a one-device mesh warms each (model, global batch) pair up in a
    thread of its own, then times the cases in their order. Each case's compile seconds are its own
    thread's: the plain step compiles in the first case of its pair and never again (L = 4 after
    L = 1), while every canonical step compiles its own. The control: what another thread compiles
    is not this thread's."""
    import threading
    notes = []
    cases = [("mlp", 16, 1), ("mlp", 16, 4), ("attention", 16, 1)]
    args = argparse.Namespace(reduction_devices=1, reduction_cases=cases, smoke=True, step_rounds=1,
                              compile_devices=(), any_devices=(), compiles=bench.Compiles(),
                              note=lambda line, case: notes.append(case))
    out = {}
    bench.reduction_section(args, out)
    assert [(r["model"], r["logical_shards"]) for r in out["cases"]] == [("mlp", 1), ("mlp", 4), ("attention", 1)]
    first, again, other = out["cases"]
    assert first["plain"]["compile"]["xla"] > 0 and again["plain"]["compile"]["s"] == 0, (first, again)
    assert other["plain"]["compile"]["xla"] > 0 and all(r["canonical"]["compile"]["xla"] > 0 for r in out["cases"])
    assert {"reduction, mlp, global 16", "reduction, attention, global 16"} <= set(notes)
    assert len({thread for *_, thread in args.compiles.heard} - {threading.get_ident()}) == 2  # one per pair
    mark = len(args.compiles.heard)
    thread = threading.Thread(target=lambda: jax.jit(lambda x: x * 5 - 2)(np.ones(3, np.float32)))
    thread.start()
    thread.join()
    assert len(args.compiles.heard) > mark and args.compiles.since(mark)["s"] == 0


@pytest.mark.slow
def test_the_training_compile_is_the_first_steps_own_whatever_ran_before(devices):
    """(slow; the default tier's smoke run holds the figure's form) Run twice, as a full bench runs the feeding
    section's programs before it, the training section still reports what each strategy's first step compiles: XLA's
    share is positive in the second run too (before each run made its gradient program anew, it was 0 for every strategy)."""
    args = argparse.Namespace(compiles=bench.Compiles(), training_batches=(16,), layers=bench.SMOKE_LAYERS,
                              train_steps=2, repeats=1, note=lambda *_: None)
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (64, 3, 32, 32), np.uint8), rng.integers(0, 10, 64).astype(np.int32)
    for _ in range(2):
        out = {}
        bench.training_section(images, labels, loaders.data_mesh(devices), args, out)
        assert all(r["compile"]["xla"] > 0 for r in out["global_16"].values()), out
