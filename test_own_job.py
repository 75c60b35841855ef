"""Each module copied ALONE into a user's job, with the user's data and model.

Each test copies a module and what the README's module table says to copy with it into an
empty folder, writes a user's job there and runs it in a child process: a prelude (the user's
data: 10,000 samples of 40 float features in 3 classes, 16x16 one-channel uint8 images in 4
classes), the snippet of docs/own-job.md run exactly as written, then checks of the module's
guarantees through its public names only:

* loaders: the user's names delivered as stored (with "mask", "index", "logical_shards"), every
  sample once a fill epoch, the plan's rows; the iterator's state after 30 steps resumes on 4
  devices of batch 64 with every sample of the epoch once (counted from the rows), through JSON,
  and names its data (other data of the same size is refused); pmap's layout stacks the same
  rows; shard k on devices[k]; int64 labels refused; images normalised by the table;
* strategies: the snippet takes optax (in CI), the loss falls, the callback reports every step
  in order, the user's own loop is sharded's training bit for bit, and every strategy trains
  the user's models, the stepwise verdict within;
* randomness: dropout keyed by (seed, epoch, index) gives the same bits on 8, 2 and 1 devices
  under the canonical reduction and a different mask for every sample; keyed by position it
  repeats in every block (the control); with the epoch as data, three more epochs compile
  nothing, while a loss_terms built per epoch compiles every epoch (the control);
* conformance: the user's strided loader passes the exactly-once mode, is flagged by the
  contiguous one, an overlap planted is found at its step; the reference loader conforms;
* checkpoints (orbax, optax): saved on 8 devices, restored on 2, the canonical run ends with
  the bits of the run that never stopped, Adam's state included; restarting Adam does not.
"""

import os
import re
import shutil
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
DOC = os.path.join(HERE, "docs", "own-job.md")
MARKER = re.compile(r"<!-- own-job: (\w+) -->\s*```python\n(.*?)```", re.S)


def snippets() -> dict:
    """docs/own-job.md's snippets by marker name: the one copy users read and these jobs run."""
    return dict(MARKER.findall(open(DOC).read()))


# What every job starts with: 8 CPU devices, the user's data, nothing of this repository.
PRELUDE = '''\
import os
import jax
jax.config.update("jax_num_cpu_devices", 8)
import numpy as np
try:
    import model  # noqa: F401
    raise SystemExit("the repository is importable from the job's folder")
except ModuleNotFoundError:
    pass
assert sorted(f for f in os.listdir(".") if f.endswith(".py")) == sorted(["job.py", *MODULES]), os.listdir(".")

rng = np.random.default_rng(0)
features = rng.standard_normal((10_000, 40), dtype=np.float32)
labels = np.argmax(features[:, :3] + 0.3 * rng.standard_normal((10_000, 3)), axis=1)  # 3 classes
image_labels = rng.integers(0, 4, 10_000)  # 4 classes: the brightest quadrant
images = rng.integers(0, 160, (10_000, 1, 16, 16)).astype(np.uint8)
for c in range(4):
    y, x = divmod(c, 2)
    images[image_labels == c, :, 8 * y:8 * y + 8, 8 * x:8 * x + 8] += 90
'''

CHECKS = {
    "loaders": '''
N, n = len(labels), len(devices)
plan = loader.plan(0)
real = plan.indices[plan.mask]
assert sorted(real.tolist()) == list(range(N)), "not every sample exactly once"
assert list(loader.batch(0, 0)) == ["x", "y", "mask", "index", "logical_shards"]
batches = list(loader.epoch(0))
for s in (0, 17, len(loader) - 1):
    np.testing.assert_array_equal(np.asarray(batches[s]["x"]), features[plan.indices[s].ravel()])
    np.testing.assert_array_equal(np.asarray(batches[s]["y"]), labels[plan.indices[s].ravel()])
    np.testing.assert_array_equal(np.asarray(batches[s]["mask"]), plan.mask[s].ravel())
    np.testing.assert_array_equal(np.asarray(batches[s]["index"]), plan.indices[s].ravel())
assert batches[0]["x"].dtype == np.float32 and batches[0]["y"].dtype == np.int32
index = {row.tobytes(): i for i, row in enumerate(features)}  # the user's rows tell their samples apart
delivered = lambda batch: [index[row.tobytes()] for row in np.asarray(batch["x"])[np.asarray(batch["mask"])]]
before = [i for s in range(30) for i in delivered(batches[s])]
after = [i for batch in resumed for i in delivered(batch)]
assert sorted(before + after) == list(range(N)), "the resumed epoch: not every sample exactly once"
from plan import LoaderState
assert LoaderState.from_json(saved.to_json()) == saved and saved.dataset
shuffled = {"x": features[::-1].copy(), "y": labels[::-1].astype(np.int32)}  # the same size, other data
try:
    loaders.make_loader(shuffled, devices[:4], batch_size=64, shuffle=True, seed=0).epoch(0, state=saved)
    raise SystemExit("a state of other data was accepted")
except ValueError as error:
    assert "dataset=" in str(error), error
assert saved.step == 30 and saved.segments[-1] == (0, n, 32)  # the state of 30 steps of this plan
stacked = pmap_loader.batch(0, 5)
assert stacked["x"].shape == (n, 32, 40) and stacked["mask"].shape == (n, 32)
np.testing.assert_array_equal(np.asarray(stacked["x"]).reshape(n * 32, 40), np.asarray(batches[5]["x"]))
backwards = loaders.make_loader(data, devices[::-1], batch_size=32, shuffle=True, seed=0, placement="device")
for shard in backwards.batch(0, 7)["x"].addressable_shards:
    k = devices[::-1].index(shard.device)
    np.testing.assert_array_equal(np.asarray(shard.data), features[plan.indices[7, k]])
try:
    loaders.make_loader({"x": features, "y": labels}, devices, batch_size=32)  # int64 labels
    raise SystemExit("int64 labels were accepted")
except ValueError as error:
    assert "astype(np.int32)" in str(error), error
assert all(isinstance(a, np.memmap) for a in on_disk.values()) and placement == "device"
for s in (0, len(loader) - 1):  # the same plan and bits from the files, in either placement
    for files in (disk_loader, loaders.make_loader(on_disk, devices, batch_size=32, shuffle=True, seed=0)):
        np.testing.assert_array_equal(np.asarray(files.batch(0, s)["x"]), np.asarray(batches[s]["x"]))
assert "over the budget" in loaders.device_fit(on_disk, devices, device_budget=1000)
first = np.asarray(image_loader.batch(0, 0)["images"])
assert first.shape == (n * 32, 1, 16, 16) and first.dtype == np.float32
idx = image_loader.plan(0).indices[0].ravel()
assert np.abs(first - (images[idx] - 127.5) / 127.5).max() <= 1e-6
np.testing.assert_array_equal(np.asarray(image_loader.batch(0, 0)["labels"]), image_labels[idx])
print("JOB OK")
''',
    "strategies": '''
import itertools
import equivalence
mlp_params = {"hidden": (0.05 * rng.standard_normal((256, 32))).astype(np.float32),
              "out": (0.05 * rng.standard_normal((32, 4))).astype(np.float32)}

def mlp_terms(params, batch):  # the images' model: a one-hidden-layer MLP over pixels
    x = batch["images"].reshape(len(batch["labels"]), -1) / 255.0
    logits = jnp.tanh(x @ params["hidden"]) @ params["out"]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["labels"][:, None], axis=1)[:, 0]
    mask = batch["mask"].astype(jnp.float32)
    return jnp.sum(mask * nll), jnp.sum(mask)

import importlib.util
if importlib.util.find_spec("optax"):  # a peer, installed in CI: then the snippet must take it
    assert type(optimizer).__module__.startswith("optax"), type(optimizer)
assert losses[-1] < 0.8 * losses[0], losses
reported = [line.split(":")[0] for line in "".join(printed.seen).splitlines() if line.startswith("step ")]
assert reported == [f"step {t}" for t in range(STEPS)], reported  # the callback: every step, in order
zeros = {"w": np.zeros((40, 3), np.float32), "b": np.zeros(3, np.float32)}
again = strategies.sharded(zeros, my_batches(features, labels), mesh, loss_terms=loss_terms, optimizer=optimizer)
continued = strategies.sharded(again.params, my_batches(features, labels), mesh, loss_terms=loss_terms,
                               optimizer=optimizer, opt_state=again.opt_state)
for a, b in zip(jax.tree.leaves(strategies.to_host(state)), jax.tree.leaves((continued.params, continued.opt_state))):
    np.testing.assert_array_equal(a, b)  # your own loop is the strategy, bit for bit, state included
np.testing.assert_array_equal(strategies.stack_losses(values), continued.losses)
n = len(jax.devices())
sgd = strategies.sgd(0.5)
for terms, start, (x, y) in ((loss_terms, zeros, (features, labels)), (mlp_terms, mlp_params, (images, image_labels))):
    done = {}
    names = list(strategies.STRATEGIES) if terms is loss_terms else ["sharded", "single"]
    for name in names:
        train = strategies.STRATEGIES[name]
        pmap = strategies.LAYOUT[name] == "pmap"
        batches = my_batches(x, y, pmap=pmap)
        done[name] = train(start, batches, mesh, loss_terms=terms, optimizer=sgd).params
    first = [{k: np.asarray(v) for k, v in batch.items()} for batch in itertools.islice(my_batches(x, y), 2)]
    for name in done:
        assert np.isfinite(jax.tree.leaves(done[name])[0]).all(), name
        found = equivalence.stepwise_verdict("sharded", name, start, first, mesh, loss_terms=terms, optimizer=sgd)
        assert found.case in ("identical", "within"), (name, found.text)
print("JOB OK")
''',
    "conformance": '''
assert not found, found.report()
contiguous = conformance.describe_epoch(np.array(delivered), N, B, shuffle=False, last_batch="fill",
                                        length=len(delivered), masks=np.array(masks))
assert "outside the shard" in contiguous.kinds
wrong = np.array(delivered)
wrong[5, 3, 0] = wrong[5, 4, 0]  # shard 3 delivers shard 4's sample at step 5
planted = conformance.describe_epoch(wrong, N, B, shuffle=False, last_batch="fill",
                                     length=len(delivered), masks=np.array(masks), partition="any")
assert {"missing", "samples on two shards"} <= set(planted.kinds), planted.report()
[(text, shards, steps, _)] = planted.kinds["samples on two shards"]
assert steps == {5} and shards == {3, 4}, text

import jax
import loaders
from arithmetic import Normalize
encoded = encoding.encoded_images(np.arange(N), (1, 16, 16))  # uint8, one channel
norm = Normalize(mean=(127.5,), std=(127.5,))
loader = loaders.make_loader((encoded, image_labels.astype(np.int32)), jax.devices(), B, shuffle=True, seed=1,
                             normalize=norm)
got, got_masks = [], []
for batch in loader.epoch(0):
    got.append([encoding.decode_indices(b, norm) for b in conformance.shard_blocks(batch["images"], n)])
    got_masks.append(conformance.shard_blocks(batch["mask"], n))
report = conformance.describe_epoch(np.array(got), N, B, shuffle=True, last_batch="fill",
                                    length=len(loader), masks=np.array(got_masks))
assert not report, report.report()
print("JOB OK")
''',
}

CHECKS["checkpoints"] = '''
assert {"loader", "state"} <= set(os.listdir("checkpoints/20")), os.listdir("checkpoints/20")  # orbax's items
assert saved.step == 20 and saved.segments[-1] == (0, 8, 32)  # L = 8 shards of 32, 20 steps done
for leaf in jax.tree.leaves(restored["state"]):  # restored onto the 2 devices, replicated
    assert leaf.sharding.device_set == set(mesh2.devices.flat) and leaf.sharding.is_fully_replicated
assert type(opt_state[0]).__name__ == "ScaleByAdamState" and int(opt_state[0].count) == len(loader8)
zeros = {"w": np.zeros((40, 3), np.float32), "b": np.zeros(3, np.float32)}
never_stopped = strategies.sharded(zeros, loader8.epoch(0), mesh8, loss_terms=loss_terms,
                                   optimizer=optimizer, reduction="canonical")
mine = jax.tree.leaves((params, opt_state))
theirs = jax.tree.leaves((never_stopped.params, never_stopped.opt_state))
assert len(mine) == len(theirs) == 2 + 1 + 2 + 2  # w, b; Adam's count, mu (w, b), nu (w, b)
for a, b in zip(mine, theirs):  # the bits of the run that was never stopped, state included
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype)
    np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))
# Control: the same resume with Adam restarted (its state not restored) ends elsewhere.
restarted = strategies.sharded(restored["state"][0], loader2.epoch(0, state=saved), mesh2,
                               loss_terms=loss_terms, optimizer=optimizer, reduction="canonical")
assert not np.array_equal(restarted.params["w"], never_stopped.params["w"])
print("JOB OK")
'''

CHECKS["randomness"] = '''
for n in (2, 1):  # the same bits on every device count dividing L
    for a, b in zip(jax.tree.leaves(trained[n]), jax.tree.leaves(trained[8])):
        x, y = (np.asarray(v).reshape(-1).view(np.uint8) for v in (a, b))  # bits, so -0.0 is not 0.0
        assert a.dtype == b.dtype and x.shape == y.shape, (n, a.dtype, b.dtype, x.shape, y.shape)
        assert np.array_equal(x, y), (n, "first byte apart", np.flatnonzero(x != y)[0])
batch = next(with_epoch(loader.epoch(0), 0))
keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(jax.random.key(0), 0), i))(batch["index"])
masks = np.asarray(jax.vmap(lambda key: jax.random.bernoulli(key, 0.75, (40,)))(keys))
assert len({row.tobytes() for row in masks}) == len(masks), "two samples drew the same dropout mask"
# The control: keyed by position within a block (a step's key, the row's place), every block repeats it.
by_place = np.asarray(jax.vmap(lambda i: jax.random.bernoulli(jax.random.fold_in(jax.random.key(0), i % 16),
                                                              0.75, (40,)))(np.arange(128)))
assert all(np.array_equal(by_place[16 * l:16 * (l + 1)], by_place[:16]) for l in range(8))
assert not np.array_equal(masks[16:32], masks[:16])
# Three more epochs compile nothing; the control: a loss_terms built per epoch compiles every time.
compiled = []
jax.monitoring.register_event_duration_secs_listener(
    lambda name, *a, **k: compiled.append(name) if name == "/jax/core/compile/backend_compile_duration" else None)
def per_epoch_terms(epoch):
    return lambda p, b: dropout_terms(p, b | {"epoch": jnp.full_like(b["index"], epoch)})
counts = {}
for how in ("as data", "per epoch"):
    for epoch in range(3, 6):
        compiled.clear()
        terms = dropout_terms if how == "as data" else per_epoch_terms(epoch)
        params, _, state = strategies.sharded(params, with_epoch(itertools.islice(loader.epoch(epoch), 4), epoch),
                                              loader.mesh, loss_terms=terms, optimizer=strategies.sgd(0.5),
                                              opt_state=state, reduction="canonical")
        counts[how, epoch] = len(compiled)
assert [counts["as data", e] for e in (3, 4, 5)] == [0, 0, 0], counts
assert all(counts["per epoch", e] > 0 for e in (3, 4, 5)), counts
print("JOB OK")
'''
# The user's own feeding (strategies) and the user's loader under test (conformance).
EXTRA = {
    "loaders": "",
    "strategies": '''
import io
import sys
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("data",))
STEPS = 12


class Tee(io.TextIOBase):
    """stdout, remembered: the checks read what the snippet printed."""
    def __init__(self, out):
        self.out, self.seen = out, []

    def write(self, text):
        self.seen.append(text)
        return self.out.write(text)

    def flush(self):
        self.out.flush()


printed = sys.stdout = Tee(sys.stdout)

def my_batches(x, y, steps=STEPS, per_device=16, pmap=False):
    """The user's own global batches, sharded on 'data' ((n, B, ...) for pmap)."""
    n = len(jax.devices())
    sharding = NamedSharding(mesh, P("data"))
    for s in range(steps):
        rows = slice(s * n * per_device, (s + 1) * n * per_device)
        batch = {"images": x[rows].astype(np.float32), "labels": y[rows].astype(np.int32),
                 "mask": np.arange(n * per_device) % 5 != 4}  # some padding slots
        if pmap:
            batch = {k: v.reshape((n, per_device) + v.shape[1:]) for k, v in batch.items()}
        yield jax.device_put(batch, sharding)
''',
    "randomness": "",
    "checkpoints": '''
import jax.numpy as jnp


def loss_terms(params, batch):  # the user's model, as in the strategies job
    logits = batch["images"] @ params["w"] + params["b"]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["labels"][:, None], axis=1)[:, 0]
    mask = batch["mask"].astype(jnp.float32)
    return jnp.sum(mask * nll), jnp.sum(mask)
''',
    "conformance": '''
def my_loader(samples, n, B):
    """The user's loader under test: shard k reads samples k::n, the last batch padded
    with its last sample and masked; global batches (n*B, ...) as NumPy."""
    N = len(samples)
    steps = -(-(-(-N // n)) // B)
    for s in range(steps):
        rows, mask = [], []
        for k in range(n):
            own = np.arange(k, N, n)
            slots = np.arange(s * B, (s + 1) * B)
            rows.append(samples[own[np.minimum(slots, len(own) - 1)]])
            mask.append(slots < len(own))
        yield {"images": np.concatenate(rows), "mask": np.concatenate(mask)}
''',
}

# What each job copies: the module and what the README's module table says to copy with it
# (the strategies job also judges with equivalence.py; conformance also runs the reference loader).
NEEDS = {"plan.py": [], "arithmetic.py": [], "cifar_mnist.py": [], "summation.py": [],
         "strategies.py": ["summation.py"], "model.py": [],
         "loaders.py": ["plan.py", "arithmetic.py", "cifar_mnist.py"], "processes.py": [],
         "conformance.py": ["plan.py", "arithmetic.py"], "encoding.py": ["arithmetic.py", "cifar_mnist.py"],
         "equivalence.py": ["strategies.py"]}
LOADERS = ["loaders.py", *NEEDS["loaders.py"]]
STRATEGIES = ["strategies.py", *NEEDS["strategies.py"]]
MODULES = {"loaders": LOADERS, "strategies": [*STRATEGIES, "equivalence.py"],
           "randomness": [*LOADERS, *STRATEGIES],
           "conformance": list(dict.fromkeys(["conformance.py", *NEEDS["conformance.py"], "encoding.py",
                                              *NEEDS["encoding.py"], "loaders.py"])),
           "checkpoints": [*LOADERS, *STRATEGIES]}
PEERS = {"checkpoints": ("orbax.checkpoint", "optax")}  # the jobs that need peers


def job_text(name: str, snippet: str) -> str:
    return (f"MODULES = {MODULES[name]!r}\n" + PRELUDE + EXTRA[name] + "\n# --- the snippet ---\n"
            + snippet + "\n# --- the checks ---\n" + CHECKS[name])


def run_jobs(tmp_path, names) -> None:
    from conftest import run_children

    found, commands = snippets(), []
    for name in names:
        folder = tmp_path / name
        folder.mkdir()
        for module in MODULES[name]:
            shutil.copy(os.path.join(HERE, module), folder / module)
        (folder / "job.py").write_text(job_text(name, found[name]))
        commands.append([sys.executable, "-c", "import os, runpy, sys; os.chdir(sys.argv[1]); "
                         "sys.path[0] = sys.argv[1]; runpy.run_path('job.py', run_name='__main__')", str(folder)])
    results = run_children(commands, timeout=100, cwd=str(tmp_path))
    failed = [f"{name} job (exit {code}):\n{out[-2000:]}\n{err[-3000:]}"
              for name, (code, out, err) in zip(names, results) if code != 0 or "JOB OK" not in out]
    assert not failed, "\n\n".join(failed)


def test_the_doc_holds_a_snippet_for_every_job():
    assert set(snippets()) == set(MODULES), sorted(snippets())


@pytest.mark.bits
@pytest.mark.slow
def test_each_module_alone_runs_a_users_job(tmp_path):
    run_jobs(tmp_path, [name for name in MODULES if name not in PEERS])


@pytest.mark.slow
def test_orbax_saves_params_optimizer_state_and_the_loader_state_and_restores_on_2_devices(tmp_path):
    for module in PEERS["checkpoints"]:
        pytest.importorskip(module, reason=f"{module} is a peer (requirements-peers.txt); CI installs it")
    run_jobs(tmp_path, ["checkpoints"])


def test_no_job_uses_a_private_name():
    found = snippets()
    for name in MODULES:
        text = found[name] + EXTRA[name] + CHECKS[name]
        assert not re.search(r"\b(loaders|strategies|conformance|plan|equivalence)\._", text), name


def test_each_module_imports_only_what_it_is_copied_with():
    # The module table's "copy it with" column, held against the code: every import of a
    # module of this repository, at any depth of the file (lazy ones too), is in NEEDS.
    import ast

    ours = {f[:-3] for f in os.listdir(HERE) if f.endswith(".py")}
    for module, needs in NEEDS.items():
        tree = ast.parse(open(os.path.join(HERE, module)).read())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
        project = {f"{name}.py" for name in imported & ours}
        assert project == set(needs), (module, sorted(project ^ set(needs)))
