"""Two JAX processes (jax.distributed, 4 virtual CPU devices each) train as one.

Guarantees checked:

* each process's blocks of the global batch are shard k's planned samples on
  mesh position k, bit for bit, for every placement ("host", "device",
  "host_float32"), also on a mesh that interleaves the two processes' devices
  (whose rows are not one contiguous slice of the batch);
* both processes end with the same params, for sharded and shard_map (the
  latter on the interleaved mesh), trained on device-placed batches;
* those params equal the single-process 8-device run's, step for step, within
  MULTIPROCESS_ULPS (cross-process sums go through gloo, which may add the
  partial gradients in another order than the in-process all-reduce);
* the samples the two processes read are exactly the dataset's, disjoint: the
  union of their shards covers range(N) once (fill policy);
* a process whose peer never arrives fails within --peer-timeout with a line
  naming the process, instead of hanging;
* the canonical reduction (strategies, reduction="canonical", 8 logical shards) is the
  same bits across the processes as in one: 2 processes x 4 devices (the interleaved
  mesh) = 1 process x 8 devices = 1 device adding 8 microbatches, params and losses;
  the plain reduction across processes is not (the control);
* ``refimpl.py --local-processes 2`` runs, prints one report and trains, under the
  canonical reduction, the bits of one process with as many devices.

The processes are started by two module fixtures, each bounded by
conftest.run_children, which reports the stacks of any it has to stop and kills
them all; the missing peer's run (which mostly waits) runs beside --local-processes. Select these tests with
``-m multiprocess`` or skip them with ``-m "not multiprocess"``. This file is also
the worker program of the first test.
"""

import os
import socket
import sys

import numpy as np
import pytest
from arithmetic import Normalize
from cifar_mnist import read_cifar10, synthetic_cifar10

HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS = (3072, 64, 32, 10)
STEPS, B, LR = 3, 8, 0.05
# Cross-process vs in-process, in float32 ulps of the leaf's largest magnitude
# per step (the same measure as test_equivalence.py). Measured: 0.5 ulp after 3
# steps (max |diff| 2.98e-08 in 1562 of 196608 entries of the first weight), so
# 1 ulp a step, the same bound as sharded vs pmap in one process.
MULTIPROCESS_ULPS = 1

pytestmark = pytest.mark.multiprocess


def worker(data_dir: str, out_dir: str, coordinator: str, process_id: int) -> None:
    import jax

    jax.config.update("jax_num_cpu_devices", 4)
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=2, process_id=process_id,
                               initialization_timeout=60, heartbeat_timeout_seconds=30,
                               coordinator_bind_address=coordinator)  # loopback only
    import loaders
    import model
    import strategies

    devices = jax.devices()
    by_process = [[d for d in devices if d.process_index == p] for p in range(2)]
    # shard_map runs on a mesh that interleaves the processes' devices: the loader
    # must still put shard k on mesh position k, so results stay the same.
    meshes = {"sharded": loaders.data_mesh(devices),
              "shard_map": loaders.data_mesh([d for pair in zip(*by_process) for d in pair])}
    read = []
    images, labels = read_cifar10(data_dir)
    for name, mesh in meshes.items():
        layout = strategies.LAYOUT[name]
        by_placement = {p: loaders.make_loader(data_dir, mesh, B, layout=layout, shuffle=True, seed=5,
                                               placement=p) for p in loaders.PLACEMENTS}
        loader = by_placement["host"]
        plan = loader.plan(0)
        position = {d: k for k, d in enumerate(mesh.devices.flat)}
        for p, each in by_placement.items():  # this process's blocks, every placement, bit for bit
            for step in range(STEPS):
                batch = each.batch(0, step)
                for field, array in batch.items():
                    for shard in array.addressable_shards:
                        k = position[shard.device]
                        idx = plan.indices[step, k]
                        want = {"images": Normalize()(images[idx]), "labels": labels[idx],
                                "mask": plan.mask[step, k]}[field]
                        got = np.asarray(shard.data).reshape(want.shape)
                        assert np.array_equal(got, want), f"{name} mesh, placement {p}: {field} of shard {k}"
        batches = (by_placement["device"].batch(0, s) for s in range(STEPS))
        params, losses, _ = strategies.STRATEGIES[name](model.init_model(LAYERS), batches, mesh,
                                                        loss_terms=model.loss_terms,
                                                        optimizer=strategies.sgd(LR))
        np.savez(os.path.join(out_dir, f"{name}-{process_id}.npz"), *jax.tree.leaves(params), losses=losses)
        if name == "shard_map":  # the canonical reduction across the processes, on the interleaved mesh
            batches = (by_placement["device"].batch(0, s) for s in range(STEPS))
            params, losses, _ = strategies.shard_map(model.init_model(LAYERS), batches, mesh,
                                                     loss_terms=model.loss_terms, optimizer=strategies.sgd(LR),
                                                     reduction="canonical", logical_shards=8)
            np.savez(os.path.join(out_dir, f"canonical-{process_id}.npz"), *jax.tree.leaves(params),
                     losses=losses)
    # What this process read over a whole epoch: the real slots of its own shards.
    for step in range(len(loader)):
        for k in loader.host_blocks(plan, step):
            read.append(plan.indices[step, k][plan.mask[step, k]])
    np.save(os.path.join(out_dir, f"read-{process_id}.npy"), np.concatenate(read))
    jax.distributed.shutdown()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return synthetic_cifar10(tmp_path_factory.mktemp("mp"), num_train=1000, num_test=100, seed=4)


@pytest.fixture(scope="module")
def two_workers(dataset, tmp_path_factory):
    """The two worker processes of the first test, {process id: conftest.Ended}, and the
    folder they wrote to. A process whose peer failed is stopped 10 s later."""
    # Imported here, not at the top: this file is also the worker program, and
    # conftest starts JAX's backends with 8 devices when it is imported.
    from conftest import run_children

    out = tmp_path_factory.mktemp("two-processes")
    coordinator = f"127.0.0.1:{free_port()}"
    results = run_children([[sys.executable, __file__, dataset, str(out), coordinator, str(i)] for i in range(2)],
                           timeout=100, cwd=HERE, grace=10)
    return dict(enumerate(results)), out


@pytest.fixture(scope="module")
def refimpl_runs(dataset, tmp_path_factory):
    """The refimpl.py runs of the last three tests, started together (the missing peer's run
    mostly waits): ({name: conftest.Ended}, the folder their --params-out files are in)."""
    from conftest import run_children

    out = tmp_path_factory.mktemp("refimpl-runs")
    refimpl = [sys.executable, os.path.join(HERE, "refimpl.py"), "--data-dir", dataset, "--epochs", "1"]
    # 1000 samples over 8 devices at batch 64: 2 steps an epoch; the canonical reduction
    # over 8 logical shards, so that 2 processes x 4 devices owe 1 process x 8 its bits.
    same_job = ["--batch-size", "64", "--hidden", "64,64", "--reduction", "canonical", "--logical-shards", "8",
                "--strategies", "sharded,shard_map"]
    coordinator = f"127.0.0.1:{free_port()}"
    commands = {
        # Process 0 of 2 alone: its peer never arrives.
        "missing peer": refimpl + ["--devices", "4", "--num-processes", "2", "--process-id", "0",
                                   "--coordinator", coordinator, "--peer-timeout", "3"],
        "local processes": refimpl + same_job + ["--local-processes", "2",
                                                 "--params-out", str(out / "local-processes.npz")],
        "one process": refimpl + same_job + ["--devices", "8", "--params-out", str(out / "one-process.npz")],
    }
    return dict(zip(commands, run_children(list(commands.values()), timeout=100, cwd=HERE))), out


def test_two_processes_train_like_one(two_workers, dataset):
    import jax

    import loaders
    import model
    import strategies
    from conftest import assert_params_close, assert_same_bits, bits_differ

    ended, tmp_path = two_workers
    for i in range(2):
        code, out, err = ended[i]
        assert code == 0, f"process {i} exited {code}:\n{err[-3000:]}"

    mesh = loaders.data_mesh(jax.devices("cpu"))  # the children's 2 x 4 CPU devices, in one process
    for name in ("sharded", "shard_map"):
        got = [np.load(tmp_path / f"{name}-{i}.npz") for i in range(2)]
        leaves = [[g[f"arr_{j}"] for j in range(len(g.files) - 1)] for g in got]
        for j, (a, b) in enumerate(zip(*leaves)):
            assert_same_bits(a, b, f"{name}: leaf {j} of the two processes")
        assert_same_bits(got[0]["losses"], got[1]["losses"], f"{name}: the two processes' losses")

        loader = loaders.make_loader(dataset, mesh, B, layout=strategies.LAYOUT[name], shuffle=True, seed=5)
        expected, losses, _ = strategies.STRATEGIES[name](
            model.init_model(LAYERS), (loader.batch(0, s) for s in range(STEPS)), mesh,
            loss_terms=model.loss_terms, optimizer=strategies.sgd(LR))
        assert_params_close(leaves[0], jax.tree.leaves(expected), ulps_per_step=MULTIPROCESS_ULPS,
                            steps=STEPS, what=f"{name}: 2 processes vs 1")
        np.testing.assert_allclose(got[0]["losses"], losses, rtol=1e-5)

    # The canonical reduction: 2 x 4 = 1 x 8 = 1 x 1 with 8 microbatches, bit for bit.
    got = [np.load(tmp_path / f"canonical-{i}.npz") for i in range(2)]
    leaves = [[g[f"arr_{j}"] for j in range(len(g.files) - 1)] + [g["losses"]] for g in got]
    loader = loaders.make_loader(dataset, mesh, B, shuffle=True, seed=5)
    for where, strategy in (("1 process x 8 devices", "shard_map"), ("1 device x 8 microbatches", "single")):
        one = strategies.STRATEGIES[strategy](
            model.init_model(LAYERS), (loader.batch(0, s) for s in range(STEPS)), mesh,
            loss_terms=model.loss_terms, optimizer=strategies.sgd(LR), reduction="canonical", logical_shards=8)
        for j, (a, b) in enumerate(zip(leaves[0], jax.tree.leaves(one.params) + [one.losses])):
            assert_same_bits(a, b, f"canonical: 2 processes x 4 devices vs {where}, leaf {j}")
        for j, (a, b) in enumerate(zip(leaves[0], leaves[1])):
            assert_same_bits(a, b, f"canonical: leaf {j} of the two processes")
    plain = [np.load(tmp_path / f"shard_map-{i}.npz")[f"arr_{j}"] for i in (0,) for j in range(len(leaves[0]) - 1)]
    assert any(bits_differ(a, b) for a, b in zip(plain, leaves[0][:-1])), \
        "control: the plain reduction across processes is the canonical one's bits"

    read = [np.load(tmp_path / f"read-{i}.npy") for i in range(2)]
    assert len(np.intersect1d(read[0], read[1])) == 0, "the processes read common samples"
    everything = np.sort(np.concatenate(read))
    assert_same_bits(everything, np.arange(1000, dtype=everything.dtype), "the samples both processes read")


def test_missing_peer_fails_within_the_timeout(refimpl_runs):
    code, out, err = done = refimpl_runs[0]["missing peer"]
    # JAX's runtime aborts the process (SIGABRT) rather than raising; refimpl's own
    # line before joining is what names the process and the wait.
    assert code != 0, err[-2000:]
    assert "process 0 of 2: joining coordinator" in err and "within 3 s" in err
    assert done.seconds < 60, f"took {done.seconds:.0f} s to give up on a missing peer"


def test_refimpl_local_processes_prints_one_report(refimpl_runs):
    code, out, err = refimpl_runs[0]["local processes"]
    assert code == 0, err[-3000:]
    assert "8 cpu device(s) in 2 processes" in out
    for name in ("sharded", "shard_map"):
        assert out.count(f"{name:>9} epoch 0 of 1") == 1, out
    assert "[Gloo]" not in out + err and "peer ranks" not in out + err, err


def test_refimpl_local_processes_train_like_one_process(refimpl_runs):
    """``--local-processes 2`` splits ``--devices`` (8 by default) into 2 processes of 4 that
    train on the ``--data-dir`` given, joined through a coordinator on 127.0.0.1: under the
    canonical reduction its --params-out (every strategy's params and optimizer state) is,
    array for array, the bits of one process with 8 devices on the same data."""
    from conftest import assert_same_bits

    ended, folder = refimpl_runs
    for name in ("local processes", "one process"):
        code, out, err = ended[name]
        assert code == 0, f"{name}: exit {code}\n{err[-3000:]}"
    two, one = (np.load(folder / f"{name}.npz") for name in ("local-processes", "one-process"))
    assert sorted(two.files) == sorted(one.files) and one.files, (two.files, one.files)
    for key in one.files:
        assert_same_bits(two[key], one[key], f"--local-processes 2 vs 1 process x 8 devices: {key}")


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    worker(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
