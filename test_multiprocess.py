"""Several JAX processes (jax.distributed) train as one.

In this process: refimpl joins the others with bounded waits (jax.distributed's start and
heartbeat both --peer-timeout) and fails in one line naming the process; --local-processes
hands every process one dataset generated first, and a resume's processes the checkpoint's;
processes.run_local returns the first failing process's status, names it and stops the rest.

With --run-slow (child processes, bounded by conftest.run_children):

* two processes of 4 virtual CPU devices, the strategies by hand: each process's blocks of
  the global batch are shard k's planned samples on mesh position k, bit for bit, in every
  placement, also on a mesh that interleaves the processes' devices; together they read
  every sample once; the plain reduction's step is the one-process step within float32
  rounding (one_step_tolerance, derived); the canonical reduction is the same bits as one
  process of 8 devices and one device adding 8 microbatches, and as its steps in two epochs
  chained on the devices (params handed back as global arrays);
* refimpl.py --local-processes 2 prints one report and trains the bits of one process
  (canonical, --compare-to); a canonical run stopped on 8 devices and resumed in 2
  processes ends on the uninterrupted run's bits; a process whose peer never comes fails
  within --peer-timeout, naming itself;
* a loss_terms that breaks its contract on one process's rows stops both processes at the
  door, each naming that process.

This file is also the worker program of the first slow test.
"""

import os
import sys

import numpy as np
import pytest
from arithmetic import Normalize
from cifar_mnist import read_cifar10, synthetic_cifar10

HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS = (3072, 64, 32, 10)
STEPS, B, LR = 3, 8, 0.05


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
                        want = {"images": Normalize()(images[idx]), "labels": labels[idx], "index": idx,
                                "mask": plan.mask[step, k], "logical_shards": np.array([k])}[field]
                        got = np.asarray(shard.data).reshape(want.shape)
                        assert np.array_equal(got, want), f"{name} mesh, placement {p}: {field} of shard {k}"
        device = by_placement["device"]
        params, losses, _ = strategies.STRATEGIES[name](model.init_model(LAYERS), [device.batch(0, 0)], mesh,
                                                        loss_terms=model.loss_terms, optimizer=strategies.sgd(LR))
        np.savez(os.path.join(out_dir, f"{name}-{process_id}.npz"), *jax.tree.leaves(params), losses=losses)
        if name == "shard_map":  # the canonical reduction across the processes, on the interleaved mesh
            batches = (device.batch(0, s) for s in range(STEPS))
            params, losses, _ = strategies.shard_map(model.init_model(LAYERS), batches, mesh,
                                                     loss_terms=model.loss_terms, optimizer=strategies.sgd(LR),
                                                     reduction="canonical", logical_shards=8)
            np.savez(os.path.join(out_dir, f"canonical-{process_id}.npz"), *jax.tree.leaves(params),
                     losses=losses)
            # The same steps as two epochs chained on the devices (1 step, then 2 from the state handed back).
            canonical = dict(loss_terms=model.loss_terms, optimizer=strategies.sgd(LR), reduction="canonical",
                             logical_shards=8)
            first = strategies.shard_map(strategies.replicate(model.init_model(LAYERS), mesh), [device.batch(0, 0)],
                                         mesh, **canonical)
            rest = strategies.shard_map(first.params, (device.batch(0, s) for s in range(1, STEPS)), mesh,
                                        opt_state=first.opt_state, **canonical)
            assert all(isinstance(x, jax.Array) for x in jax.tree.leaves((rest.params, rest.opt_state)))
            np.savez(os.path.join(out_dir, f"chained-{process_id}.npz"), *jax.tree.leaves(strategies.to_host(
                rest.params)))
    # What this process was delivered over a whole epoch: the sample index of each real row.
    for batch in loader.epoch(0):
        real = {shard.device: np.asarray(shard.data).reshape(-1) for shard in batch["mask"].addressable_shards}
        for shard in batch["index"].addressable_shards:
            read.append(np.asarray(shard.data).reshape(-1)[real[shard.device]])
    np.save(os.path.join(out_dir, f"read-{process_id}.npy"), np.concatenate(read))

    def unmasked_on_1(params, batch):  # breaks the contract on process 1's rows only
        return model.loss_terms(params, dict(batch, mask=batch["mask"] | (jax.process_index() == 1)))
    steps = []
    door = loaders.make_loader(data_dir, meshes["sharded"], B, placement="device")
    try:
        strategies.sharded(model.init_model(LAYERS), (steps.append(s) or door.batch(0, s) for s in range(STEPS)),
                           meshes["sharded"], loss_terms=unmasked_on_1, optimizer=strategies.sgd(LR))
        said = "trained"
    except ValueError as error:
        said = str(error)
    with open(os.path.join(out_dir, f"door-{process_id}.txt"), "w") as f:
        f.write(f"{len(steps)} batches drawn\n{said}")
    jax.distributed.shutdown()


def free_port() -> int:
    import refimpl
    return refimpl.loopback_port("test_multiprocess")


# --------------------------------------------------------------------------
# In this process
# --------------------------------------------------------------------------


def test_a_process_joins_with_bounded_waits_and_a_failure_to_join_names_it(monkeypatch, capsys):
    """refimpl.connect hands jax.distributed.initialize the coordinator, the process count
    and id, and --peer-timeout as both the start's wait and the heartbeat's (a peer that
    stops answering); a loopback coordinator binds that address only (another: None, JAX's
    default); --devices N as the local device ids 0..N-1. It says first, on stderr, which process joins and how long it waits, since JAX
    ends a process itself when a peer is missing. JAX's refusal to join is one
    ConnectionError naming the process, the coordinator, the wait and JAX's first line;
    --auto-distributed without a cluster says what to give instead. JAX's initialize stands
    in, recording; that JAX ends a process after the wait: the slow test below."""
    import jax
    import processes
    import refimpl
    given = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: given.append(kw))
    monkeypatch.delenv(processes.LOCAL_CHILD, raising=False)
    triple = ["--num-processes", "3", "--process-id", "2", "--peer-timeout", "17", "--strategies", "sharded"]
    for coordinator, bind in (("127.0.0.1:7", "127.0.0.1:7"), ("localhost:7", "localhost:7"),
                              ("[::1]:7", "[::1]:7"), ("10.1.2.3:7", None)):
        given.clear()
        refimpl.connect(refimpl.parse_args(["--coordinator", coordinator, *triple]))
        assert given == [dict(coordinator_address=coordinator, num_processes=3, process_id=2, initialization_timeout=17,
                              heartbeat_timeout_seconds=17, coordinator_bind_address=bind,
                              local_device_ids=None)], given
        assert f"process 2 of 3: joining coordinator {coordinator}; if a peer has not joined within 17 s" \
            in capsys.readouterr().err
    # --devices N: this process's GPUs are 0..N-1 (it was ignored on GPUs across processes)
    given.clear()
    refimpl.connect(refimpl.parse_args(["--coordinator", "10.1.2.3:7", "--devices", "2", *triple]))
    assert given[0]["local_device_ids"] == [0, 1], given

    def refuse(words):
        def initialize(**kw):
            raise RuntimeError(words)
        return initialize
    monkeypatch.setattr(jax.distributed, "initialize", refuse("DEADLINE_EXCEEDED: barrier\nmore detail"))
    with pytest.raises(ConnectionError) as info:
        refimpl.connect(refimpl.parse_args(["--coordinator", "10.1.2.3:7", *triple]))
    assert str(info.value) == ("process 2 of 3: could not join the other processes at coordinator 10.1.2.3:7 "
                               "within 17 s: DEADLINE_EXCEEDED: barrier"), str(info.value)
    monkeypatch.setattr(jax.distributed, "initialize", refuse("coordinator_address should be defined."))
    monkeypatch.setattr(refimpl, "loopback_port", lambda flag: 7)  # a socket opens here (without one: the next test)
    with pytest.raises(ConnectionError, match="--auto-distributed: no cluster was detected"):
        refimpl.connect(refimpl.parse_args(["--auto-distributed"]))


def test_without_sockets_several_processes_are_refused_at_once(monkeypatch, tmp_path):
    """A machine that cannot open a TCP socket (a TPU sandbox: "[Errno 97] Address family not
    supported") cannot run jax.distributed: --local-processes ends in one line naming itself,
    and --auto-distributed gives up before JAX looks for a cluster (on a TPU host that lookup
    asks a metadata server and waits 60 s), so jax.distributed.initialize is never called."""
    import socket
    import jax
    import refimpl
    from conftest import run_refimpl

    class NoSocket:
        def __init__(self, *args, **kwargs):
            raise OSError(97, "Address family not supported by protocol")
    monkeypatch.setattr(socket, "socket", NoSocket)
    asked = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: asked.append(kw))
    done = run_refimpl(["--local-processes", "2", "--data-dir", tmp_path, "--platform", "cpu"])
    assert done.status == 2 and done.err.count("\n") == 1, done.err
    assert done.err.startswith("refimpl.py: error: --local-processes 2: this machine cannot open a TCP socket "
                               "([Errno 97] Address family not supported by protocol)"), done.err
    with pytest.raises(ConnectionError, match=r"^--auto-distributed: this machine cannot open a TCP socket"):
        refimpl.connect(refimpl.parse_args(["--auto-distributed"]))
    assert asked == []


@pytest.mark.multiprocess  # its launcher binds a port for the coordinator
def test_local_processes_are_handed_one_dataset_and_a_resumes_processes_the_checkpoints(tmp_path, monkeypatch):
    """--local-processes 2 without --data-dir, processes.run_local standing in: the synthetic
    data of --dataset and --seed is generated once into --cache-dir before any process
    starts, and each is handed it as --data-dir, its share of --devices, the process count,
    one coordinator on 127.0.0.1 and every other option as given; run_local's status is
    main's, and process 0's own FAILED status passes through. A resume's processes are
    handed no --data-dir and nothing is generated: each reads the checkpoint's data."""
    import processes
    import refimpl
    from cifar_mnist import read_mnist, synthetic_mnist
    from conftest import run_refimpl
    calls = []
    monkeypatch.setattr(processes, "run_local", lambda base, count, *, passthrough: calls.append(
        (base, count, passthrough)) or 7)
    cache = tmp_path / "cache"
    argv = ["--local-processes", "2", "--devices", "6", "--dataset", "mnist", "--seed", "5", "--cache-dir", cache,
            "--epochs", "3", "--platform", "cpu"]
    assert run_refimpl(argv).status == 7
    [(base, count, passthrough)] = calls

    def value(option):
        [at] = [i for i, word in enumerate(base) if word == option]
        return base[at + 1]
    assert (count, passthrough) == (2, refimpl.FAILED)
    assert base[:2] == [sys.executable, os.path.abspath(refimpl.__file__)]
    assert "--local-processes" not in base and "--platform" not in base, base
    assert (value("--devices"), value("--num-processes"), value("--epochs"), value("--seed")) == ("3", "2", "3", "5")
    assert value("--coordinator").startswith("127.0.0.1:")
    folder = value("--data-dir")
    assert os.listdir(cache) == [os.path.basename(folder)]
    mine = synthetic_mnist(tmp_path / "mine", seed=5, **refimpl.SYNTHETIC)
    for split in ("train", "test"):
        for a, b in zip(read_mnist(folder, split), read_mnist(mine, split)):
            np.testing.assert_array_equal(a, b)

    checkpoint = tmp_path / "ck"
    (checkpoint / "run").mkdir(parents=True)
    (checkpoint / "run" / "metadata").write_text("{}")  # what parse_args looks for
    calls.clear()
    assert run_refimpl(["--local-processes", "2", "--resume-from", str(checkpoint), "--cache-dir",
                         str(tmp_path / "empty")]).status == 7
    [(base, _, _)] = calls
    assert "--data-dir" not in base and not (tmp_path / "empty").exists(), base


# Each of 3 children prints its id; process ``who`` then exits with status ``how`` (after a
# line on stderr) or is killed by a signal; process 2 sleeps (unless all exit 0), so it ends
# only if stopped.
CHILD = """
import os, signal, sys, time
i, who, how = int(sys.argv[-1]), int(sys.argv[1]), sys.argv[2]
print(f"process {i} ran", flush=True)
if i == who and how == "signal":
    os.kill(os.getpid(), signal.SIGKILL)
if i == who:
    print(f"process {i} says why", file=sys.stderr, flush=True)
    sys.exit(int(how))
if i == 2 and how != "0":
    time.sleep(600)
"""


@pytest.mark.parametrize("who, how, status, said", [
    (9, "0", 0, ""),  # no process 9: all exit 0
    (0, "1", 1, "process 0 says why"),  # process 0 alone, with passthrough: its words, nothing added
    (0, "3", 3, "process 0 says why\nrefimpl.py: error: local process 0 exited with status 3; stopping the others"),
    (1, "3", 3, "process 1 says why\nrefimpl.py: error: local process 1 exited with status 3; stopping the others"),
    (1, "signal", 1, "refimpl.py: error: local process 1 was killed by signal SIGKILL; stopping the others"),
], ids=["all-0", "passthrough", "process-0-exits-3", "process-1-exits-3", "process-1-killed"])
def test_run_local_returns_the_first_failure_names_it_and_stops_the_others(who, how, status, said, capfd):
    """processes.run_local on 3 children: the status refimpl exits with; process 0's output
    passed through; a failing process's last lines and one line naming it; the sleeping
    process stopped (the call returns at once)."""
    import time
    import processes
    started = time.monotonic()
    got = processes.run_local([sys.executable, "-c", CHILD, str(who), how], 3, passthrough=1)
    out, err = capfd.readouterr()
    # process 0's line passed through; where another process fails first, process 0 may be
    # stopped before it printed (as soon as one fails, the rest are stopped)
    ran = ["process 0 ran"] if who in (0, 9) else out.splitlines()[:1]
    assert (got, out.splitlines()[:1], err.strip()) == (status, ran, said), (got, out, err)
    assert ran in (["process 0 ran"], []), out
    assert time.monotonic() - started < 60, "the sleeping process was not stopped"


# --------------------------------------------------------------------------
# --run-slow: child processes
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return synthetic_cifar10(tmp_path_factory.mktemp("mp"), num_train=1000, num_test=100, seed=4)


@pytest.fixture(scope="module")
def two_workers(dataset, tmp_path_factory):
    """The two worker processes, {process id: conftest.Ended}, and the folder they wrote to.
    A process whose peer failed is stopped 10 s later."""
    # Imported here, not at the top: this file is also the worker program, and conftest
    # starts JAX's backends with 8 devices when it is imported.
    from conftest import run_children

    out = tmp_path_factory.mktemp("two-processes")
    coordinator = f"127.0.0.1:{free_port()}"
    results = run_children([[sys.executable, __file__, dataset, str(out), coordinator, str(i)] for i in range(2)],
                           timeout=100, cwd=HERE, grace=10)
    return dict(enumerate(results)), out


def gamma(m: int) -> float:
    u = 2.0**-24
    return m * u / (1 - m * u)


def one_step_tolerance(params0, params1, batch, n: int, lr: float) -> list:
    """Per entry of each leaf, how far another run's params after one SGD step from
    ``params0`` may lie from ``params1`` when only the order in which the n devices'
    gradient sums are added differs.

    Each device's sums s_k are the same program on the same rows in either run. Any order of
    n terms is within gamma_{n-1} * S of their exact sum (S = sum_k |s_k|, gamma_m = m u / (1
    - m u), u = 2**-24; Higham, Accuracy and Stability of Numerical Algorithms, section 4.2),
    so two orders differ by at most 2 gamma_{n-1} S, and by that over the count after the
    division. The step p - lr * (sum / count) then rounds three times (the quotient, the
    product, the new params), each at most one ulp apart between the runs: an ulp of twice
    the value, as the other run's may lie in the next binade. S is recomputed here from each
    device's rows by another program, so it is counted twice."""
    import jax
    import model
    host = {k: np.asarray(batch[k]) for k in ("images", "labels", "mask")}
    rows, count = len(host["mask"]) // n, float(host["mask"].sum())
    gradient = jax.jit(jax.grad(lambda p, b: model.loss_terms(p, b)[0]))
    sums = [jax.tree.leaves(gradient(params0, {k: v[i * rows:(i + 1) * rows] for k, v in host.items()}))
            for i in range(n)]

    def ulp(x):
        return np.spacing(np.float32(2) * np.abs(np.asarray(x, np.float32)))
    out = []
    for leaf, p1 in enumerate(jax.tree.leaves(params1)):
        parts = [np.asarray(s[leaf], np.float64) for s in sums]
        S, g = sum(np.abs(p) for p in parts), sum(parts) / count
        out.append(2 * lr * 2 * gamma(n - 1) * S / count + lr * ulp(g) + ulp(lr * g) + ulp(p1))
    return out


@pytest.mark.bits
@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_train_like_one(two_workers, dataset):
    """Both processes end on the same bits; the plain step (sharded; shard_map on the
    interleaved mesh) is one process's within one_step_tolerance (control: a step 0.1%
    longer is not), its loss within the same rounding; the canonical reduction's 3 steps
    are one process's and one device's bits; the samples delivered to the two processes
    are every sample once."""
    import jax

    import loaders
    import model
    import strategies
    from conftest import assert_same_bits

    ended, tmp_path = two_workers
    for i in range(2):
        code, out, err = ended[i]
        assert code == 0, f"process {i} exited {code}:\n{err[-3000:]}"

    mesh = loaders.data_mesh(jax.devices("cpu"))  # the children's 2 x 4 CPU devices, in one process
    loader = loaders.make_loader(dataset, mesh, B, shuffle=True, seed=5)
    params0 = model.init_model(LAYERS)
    for name in ("sharded", "shard_map"):
        got = [np.load(tmp_path / f"{name}-{i}.npz") for i in range(2)]
        leaves = [[g[f"arr_{j}"] for j in range(len(g.files) - 1)] for g in got]
        for j, (a, b) in enumerate(zip(*leaves)):
            assert_same_bits(a, b, f"{name}: leaf {j} of the two processes")
        one, losses, _ = strategies.STRATEGIES[name](
            params0, [loaders.make_loader(dataset, mesh, B, layout=strategies.LAYOUT[name], shuffle=True,
                                          seed=5).batch(0, 0)], mesh, loss_terms=model.loss_terms,
            optimizer=strategies.sgd(LR))
        one = [np.asarray(x) for x in jax.tree.leaves(one)]
        tolerance = one_step_tolerance(params0, one, loader.batch(0, 0), 8, LR)
        for j, (two, mine, allowed) in enumerate(zip(leaves[0], one, tolerance)):
            off = np.abs(two.astype(np.float64) - mine) > allowed
            assert not off.any(), f"{name}: leaf {j}, {off.sum()} entries past one_step_tolerance"
        longer = [p1 + np.float32(0.001) * (p1 - np.asarray(p0)) for p1, p0 in zip(one, jax.tree.leaves(params0))]
        assert any((np.abs(x.astype(np.float64) - mine) > allowed).any() for x, mine, allowed in
                   zip(longer, one, tolerance)), "control: a step 0.1% longer is within the tolerance"
        # the loss: positive terms, so S is the total itself; the quotient rounds once in each run
        np.testing.assert_allclose(got[0]["losses"], losses, rtol=2 * gamma(7) + 2 * 2.0**-24, atol=0)

    # The canonical reduction: 2 x 4 = 1 x 8 = 1 x 1 with 8 microbatches, bit for bit.
    got = [np.load(tmp_path / f"canonical-{i}.npz") for i in range(2)]
    leaves = [[g[f"arr_{j}"] for j in range(len(g.files) - 1)] + [g["losses"]] for g in got]
    for j, (a, b) in enumerate(zip(leaves[0], leaves[1])):
        assert_same_bits(a, b, f"canonical: leaf {j} of the two processes")
    for i in range(2):  # params chained on the devices across the processes: the same bits
        chained = np.load(tmp_path / f"chained-{i}.npz")
        for j in range(len(chained.files)):
            assert_same_bits(chained[f"arr_{j}"], leaves[0][j], f"canonical, chained on the devices: leaf {j}")
    for where, strategy in (("1 process x 8 devices", "shard_map"), ("1 device x 8 microbatches", "single")):
        one = strategies.STRATEGIES[strategy](
            params0, (loader.batch(0, s) for s in range(STEPS)), mesh, loss_terms=model.loss_terms,
            optimizer=strategies.sgd(LR), reduction="canonical", logical_shards=8)
        for j, (a, b) in enumerate(zip(leaves[0], jax.tree.leaves(one.params) + [one.losses])):
            assert_same_bits(a, b, f"canonical: 2 processes x 4 devices vs {where}, leaf {j}")

    read = [np.load(tmp_path / f"read-{i}.npy") for i in range(2)]
    assert len(np.intersect1d(read[0], read[1])) == 0, "the processes read common samples"
    everything = np.sort(np.concatenate(read))
    assert_same_bits(everything, np.arange(1000, dtype=everything.dtype), "the samples both processes read")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_contract_broken_on_one_processs_rows_stops_every_process_before_any_step(two_workers):
    """The door's verdict is agreed: a loss_terms that ignores the mask on process 1's rows
    only (process 0's rows pass alone) stops both processes at the first batch, before its
    step, each naming process 1 and the break; neither waits in the step's collective."""
    ended, tmp_path = two_workers
    for i in range(2):
        code, out, err = ended[i]
        assert code == 0, f"process {i} exited {code}:\n{err[-3000:]}"
        drawn, said = (tmp_path / f"door-{i}.txt").read_text().split("\n", 1)
        assert drawn == "1 batches drawn", (i, drawn)
        assert said.startswith("process 1 of 2: sharded_step: loss_terms on the first device's rows"), (i, said)
        assert "when every row is padding" in said and "process 0 of 2" not in said, (i, said)


# 1000 samples over 8 logical shards of 64: 2 steps an epoch; the canonical reduction, so that
# 2 processes owe 1 process its bits, whatever their device counts.
JOB = ["--epochs", "1", "--batch-size", "64", "--hidden", "16", "--reduction", "canonical", "--logical-shards", "8",
       "--strategies", "sharded,shard_map"]


@pytest.fixture(scope="module")
def refimpl_runs(dataset, tmp_path_factory):
    """In this process, the job on 8 devices (--params-out) and the same stopped after run
    step 1; then at once, in child processes: the job in 2 local processes, the stopped one
    resumed in 2 processes of 3 devices (n = 6) and in one of 5, neither dividing L = 8, each
    --compare-to the first; process 0 of 2 alone, its peer never coming. {name:
    conftest.Ended} and the first's --params-out."""
    from conftest import run_children, run_refimpl

    out = tmp_path_factory.mktemp("refimpl-runs")
    job = ["--data-dir", dataset, *JOB]
    for extra in (["--params-out", out / "one.npz"], ["--stop-after-step", "1", "--checkpoint-dir", out / "ck"]):
        done = run_refimpl([*job, "--devices", "8", *extra])
        assert done.status == 0, done.out + done.err
    program = [sys.executable, os.path.join(HERE, "refimpl.py")]
    commands = {
        "local processes": [*job, "--local-processes", "2", "--compare-to", out / "one.npz"],
        "resumed in 2 processes": ["--resume-from", out / "ck", "--local-processes", "2", "--devices", "6",
                                   "--compare-to", out / "one.npz"],
        "resumed on 5": ["--resume-from", out / "ck", "--devices", "5", "--compare-to", out / "one.npz"],
        "missing peer": [*job, "--devices", "4", "--num-processes", "2", "--process-id", "0",
                         "--coordinator", f"127.0.0.1:{free_port()}", "--peer-timeout", "3"],
    }
    results = run_children([program + [str(a) for a in c] for c in commands.values()], timeout=100, cwd=HERE)
    return dict(zip(commands, results)), out / "one.npz"


@pytest.mark.bits
@pytest.mark.slow
@pytest.mark.multiprocess
def test_refimpl_in_2_local_processes_prints_one_report_and_trains_one_processs_bits(refimpl_runs):
    ended, one = refimpl_runs
    code, out, err = ended["local processes"]
    assert code == 0, err[-3000:]
    assert out.count("8 cpu device(s) in 2 processes") == 1, out
    for name in ("sharded", "shard_map"):
        assert out.count(f"{name:>9} epoch 0 of 1") == 1, out
        assert f"final params and optimizer state of {name} against {one}: bit-identical" in out, out
    assert "[Gloo]" not in out + err and "peer ranks" not in out + err, err


@pytest.mark.bits
@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_canonical_run_stopped_on_8_devices_and_resumed_on_6_in_2_processes_or_on_5_ends_on_its_bits(refimpl_runs):
    ended, one = refimpl_runs
    for run, devices in (("resumed in 2 processes", "6 cpu device(s) in 2 processes"), ("resumed on 5", "5 cpu")):
        code, out, err = ended[run]
        assert code == 0, (run, out[-3000:], err[-3000:])
        assert devices in out and "resuming " in out, out
        for name in ("sharded", "shard_map"):
            assert f"{name} epoch 0, counted by sample index over the runs that delivered it: every one of the " \
                   f"1000 samples delivered exactly once" in out, (run, out)
            assert f"final params and optimizer state of {name} against {one}: bit-identical" in out, (run, out)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_process_whose_peer_never_comes_fails_within_the_timeout_naming_itself(refimpl_runs):
    code, out, err = done = refimpl_runs[0]["missing peer"]
    # JAX's runtime aborts the process (SIGABRT) rather than raising; refimpl's own line
    # before joining is what names the process and the wait.
    assert code != 0, err[-2000:]
    assert "process 0 of 2: joining coordinator" in err and "within 3 s" in err, err
    assert done.seconds < 60, f"took {done.seconds:.0f} s to give up on a missing peer"


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    worker(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
