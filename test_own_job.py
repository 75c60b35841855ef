"""Each module copied ALONE into a user's job, with the user's data and model.

The third use this reference exists for: copy a single module into your own
project. Each test copies one module (loaders.py; strategies.py; conformance.py
with loaders.py, its stated dependency) into an empty temporary folder, writes
a user's job there and runs it in a child process (conftest.run_children:
JAX_PLATFORMS=cpu, 8 virtual CPU devices set by the job itself), whose folder
holds nothing else of this repository: the job asserts that ``import model``
fails. The user's data: 10,000 tabular samples of 40 float features with 3
classes, and 16x16 one-channel uint8 images with 4 classes; their own models
(a linear softmax, and a one-hidden-layer MLP over pixels).

Each job is a prelude (the user's data, batches and loader: what they would
already have), a SNIPPET (the README's "use it in your own job" text, run
exactly as written), and checks of the module's guarantees through its public
functions only (no name starting with "_" is used in any job):

* loaders.py: a dict dataset of the user's names delivers them (then "mask")
  as stored, every sample exactly once a fill epoch (from the plan's masks),
  the batches are the plan's rows, the state saved after step 30 resumes on 4
  devices of batch 64 with every sample of the epoch delivered exactly once
  (counted from the delivered features), through JSON, and names its data (a
  state of other data of the same size is refused, naming ``dataset``),
  start_step=30 on the same loader gives the same steps,
  the pmap layout stacks the same rows, shard k lives on devices[k] (devices
  given reversed), int64 labels are refused with the int32 fix, and
  one-channel images come out normalised by the table;
* strategies.py: the snippet takes optax (a peer in CI), the loss falls, the
  own loop's callback reports every step in order, the user's own loop
  (``train_loop`` + ``sharded_step``) continues ``sharded``'s params and optimizer
  state bit for bit, and with SGD the four strategies train the user's tabular
  model (a dict of params) to within the bound ``equivalence.verdict`` derives
  (sharded and single also the image model: fewer compilations);
* conformance.py: the user's strided loader (shard k = k::n) passes the
  exactly-once mode and is flagged by the contiguous one; a planted overlap is
  found at its step; the reference loader over encoded one-channel images
  conforms in the contiguous mode;
* checkpoints (loaders.py with its three and strategies.py, with the peers
  orbax-checkpoint and optax; skipped without them, run in CI): params, Adam's
  state and the LoaderState saved with orbax on 8 devices, restored onto 2 (the
  arrays replicated there), the epoch finished there with the canonical reduction
  over 8 logical shards: the bits of the run that never stopped, optimizer state
  included; control, Adam restarted on resume ends elsewhere.

The snippets are read from README.md between ``<!-- own-job: NAME -->`` and the
end of the next ```python block when the README has those markers; until then
the copies below (the text proposed for the README) run, and
test_readme_holds_the_snippets is skipped, saying so.
"""

import os
import re
import shutil
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
MARKER = re.compile(r"<!-- own-job: (\w+) -->\s*```python\n(.*?)```", re.S)

SNIPPETS = {
    "loaders": '''\
import jax
import numpy as np
import loaders
from arithmetic import Normalize

devices = jax.devices()  # shard k goes to devices[k]
data = {"x": features, "y": labels.astype(np.int32)}  # your names; int64 is refused (JAX would convert)
loader = loaders.make_loader(data, devices, batch_size=32, shuffle=True, seed=0)  # as stored
for batch in loader.epoch(0):  # global jax.Arrays, sharded over the devices
    x, y, mask = batch["x"], batch["y"], batch["mask"]  # (8*32, 40), (8*32,), (8*32,)
    # ... your step: weight each sample's loss by mask (False marks padding)
saved = loader.state(0, 30)  # after 30 steps of epoch 0; saved.to_json() goes in your checkpoint
elsewhere = loaders.make_loader(data, devices[:4], batch_size=64, shuffle=True, seed=0)  # the same data
resumed = elsewhere.epoch(0, state=saved)  # the rest of epoch 0: each sample not yet delivered, once
again = loader.epoch(0, start_step=30)  # steps 30.. of this plan: only for the same devices and batch
pmap_loader = loaders.make_loader(data, devices, batch_size=32, shuffle=True, seed=0,
                                  layout="pmap")  # (8, 32, ...) for jax.pmap

image_loader = loaders.make_loader({"images": images, "labels": image_labels.astype(np.int32)},
                                   devices, batch_size=32,  # uint8 (N, C, H, W): channels first
                                   normalize={"images": Normalize(mean=(127.5,), std=(127.5,))})
''',
    "strategies": '''\
import jax
import jax.numpy as jnp
import strategies

def loss_terms(params, batch):  # your model: (sum of the real samples' losses, their count)
    logits = batch["images"] @ params["w"] + params["b"]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["labels"][:, None], axis=1)[:, 0]
    mask = batch["mask"].astype(jnp.float32)
    return jnp.sum(mask * nll), jnp.sum(mask)

try:
    import optax
    optimizer = optax.adam(0.05)  # any optax optimizer or chain, as it is
except ImportError:
    optimizer = strategies.sgd(0.5)  # the notebooks' SGD: needs only JAX
params = {"w": np.zeros((40, 3), np.float32), "b": np.zeros(3, np.float32)}  # any pytree
opt_state = optimizer.init(params)  # a fresh start; pass the returned state back to continue
params, losses, opt_state = strategies.sharded(params, my_batches(features, labels), mesh,
                                               loss_terms=loss_terms, optimizer=optimizer,
                                               opt_state=opt_state)

# Your own loop: any step(state, batch) -> (state, value), at most two steps in flight;
# the callback gets each step's value once it has finished (reading it does not wait).
step = strategies.sharded_step(loss_terms, optimizer.update)
state = strategies.replicate((params, opt_state), mesh)
state, values = strategies.train_loop(step, state, my_batches(features, labels),
                                      callback=lambda t, loss: print(f"step {t}: loss {float(loss):.4f}"))
''',
    "conformance": '''\
import numpy as np
import conformance
import encoding

N, n, B = 10_000, 8, 32
samples = encoding.encoded_images(np.arange(N), (40,), np.float32)  # sample i holds i
delivered, masks = [], []
for batch in my_loader(samples, n, B):  # your loader's global batches: (n*B, 40), (n*B,)
    blocks = conformance.shard_blocks(batch["images"], n)  # (n, B, 40)
    delivered.append([encoding.decode_indices(block) for block in blocks])
    masks.append(conformance.shard_blocks(batch["mask"], n))
found = conformance.describe_epoch(np.array(delivered), N, B, shuffle=False, last_batch="fill",
                                   length=len(delivered), masks=np.array(masks), partition="any")
print(found.report() or "every sample exactly once")
''',
}

SNIPPETS["checkpoints"] = '''\
import itertools
import json
import os
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp  # orbax-checkpoint, the JAX ecosystem's checkpointer
import loaders
import strategies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from plan import LoaderState

data = {"images": features, "labels": labels.astype(np.int32)}
same_bits = dict(reduction="canonical", logical_shards=8)  # on any device count dividing 8
mesh8 = Mesh(np.array(jax.devices()), ("data",))
loader8 = loaders.make_loader(data, mesh8, batch_size=32, shuffle=True, seed=0, logical_shards=8)
optimizer = optax.adam(0.05)
params = {"w": np.zeros((40, 3), np.float32), "b": np.zeros(3, np.float32)}
params, _, opt_state = strategies.sharded(params, itertools.islice(loader8.epoch(0), 20), mesh8,
                                          loss_terms=loss_terms, optimizer=optimizer, **same_bits)

# Save params, optimizer state (any pytree) and where the loader stands: 20 steps of epoch 0.
path = os.path.abspath("checkpoints/20")
checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
checkpointer.save(path, args=ocp.args.Composite(
    state=ocp.args.StandardSave((params, opt_state)),
    loader=ocp.args.JsonSave(json.loads(loader8.state(0, 20).to_json()))))

# Restore on 2 devices: the arrays replicated on the new mesh, the loader from its state.
mesh2 = Mesh(np.array(jax.devices()[:2]), ("data",))
like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype,
                                                   sharding=NamedSharding(mesh2, P())), (params, opt_state))
restored = checkpointer.restore(path, args=ocp.args.Composite(
    state=ocp.args.StandardRestore(like), loader=ocp.args.JsonRestore()))
params, opt_state = restored["state"]
saved = LoaderState.from_json(json.dumps(restored["loader"]))
loader2 = loaders.make_loader(data, mesh2, batch_size=32, shuffle=True, seed=0, logical_shards=8)
params, _, opt_state = strategies.sharded(params, loader2.epoch(0, state=saved), mesh2,
                                          loss_terms=loss_terms, optimizer=optimizer,
                                          opt_state=opt_state, **same_bits)  # steps 20.. of epoch 0
'''

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
assert list(loader.batch(0, 0)) == ["x", "y", "mask"]
batches = list(loader.epoch(0))
for s in (0, 17, len(loader) - 1):
    np.testing.assert_array_equal(np.asarray(batches[s]["x"]), features[plan.indices[s].ravel()])
    np.testing.assert_array_equal(np.asarray(batches[s]["y"]), labels[plan.indices[s].ravel()])
    np.testing.assert_array_equal(np.asarray(batches[s]["mask"]), plan.mask[s].ravel())
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
for s, batch in enumerate(again, start=30):
    np.testing.assert_array_equal(np.asarray(batch["x"]), np.asarray(batches[s]["x"]))
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
first = np.asarray(image_loader.batch(0, 0)["images"])
assert first.shape == (n * 32, 1, 16, 16) and first.dtype == np.float32
idx = image_loader.plan(0).indices[0].ravel()
assert np.abs(first - (images[idx] - 127.5) / 127.5).max() <= 1e-6
np.testing.assert_array_equal(np.asarray(image_loader.batch(0, 0)["labels"]), image_labels[idx])
print("JOB OK")
''',
    "strategies": '''
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
    growth = equivalence.twin_growth(start, my_batches(x, y), mesh, loss_terms=terms, optimizer=sgd)
    for name in done:
        found = equivalence.verdict(done[name], done["sharded"], equivalence.ulp_bound("sharded", name, "cpu", n), growth)
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
loader = loaders.make_loader((encoded, image_labels), jax.devices(), B, shuffle=True, seed=1, normalize=norm)
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
assert saved == loader8.state(0, 20) and saved.segments[-1] == (0, 8, 32)  # L = 8 shards of 32
for leaf in jax.tree.leaves(restored["state"]):  # restored onto the 2 devices, replicated
    assert leaf.sharding.device_set == set(mesh2.devices.flat) and leaf.sharding.is_fully_replicated
assert type(opt_state[0]).__name__ == "ScaleByAdamState" and int(opt_state[0].count) == len(loader8)
zeros = {"w": np.zeros((40, 3), np.float32), "b": np.zeros(3, np.float32)}
never_stopped = strategies.sharded(zeros, loader8.epoch(0), mesh8, loss_terms=loss_terms,
                                   optimizer=optimizer, **same_bits)
mine = jax.tree.leaves((params, opt_state))
theirs = jax.tree.leaves((never_stopped.params, never_stopped.opt_state))
assert len(mine) == len(theirs) == 2 + 1 + 2 + 2  # w, b; Adam's count, mu (w, b), nu (w, b)
for a, b in zip(mine, theirs):  # the bits of the run that was never stopped, state included
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype)
    np.testing.assert_array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8))
# Control: the same resume with Adam restarted (its state not restored) ends elsewhere.
restarted = strategies.sharded(restored["state"][0], loader2.epoch(0, state=saved), mesh2,
                               loss_terms=loss_terms, optimizer=optimizer, **same_bits)
assert not np.array_equal(restarted.params["w"], never_stopped.params["w"])
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

# What each job copies: the module and what README's module table says to copy with it
# (the strategies job also judges the strategies with equivalence.py; the conformance
# job also holds the reference loader to conformance, so loaders.py's set comes too).
NEEDS = {"plan.py": [], "arithmetic.py": [], "cifar_mnist.py": [], "strategies.py": [],
         "loaders.py": ["plan.py", "arithmetic.py", "cifar_mnist.py"],
         "conformance.py": ["plan.py", "arithmetic.py"], "encoding.py": ["arithmetic.py", "cifar_mnist.py"],
         "equivalence.py": ["strategies.py"], "model.py": [], "processes.py": [],
         "checkpoints.py": ["plan.py"]}
MODULES = {"loaders": ["loaders.py", *NEEDS["loaders.py"]],
           "strategies": ["strategies.py", "equivalence.py"],
           "conformance": list(dict.fromkeys(["conformance.py", *NEEDS["conformance.py"], "encoding.py",
                                              *NEEDS["encoding.py"], "loaders.py"])),
           "checkpoints": ["loaders.py", *NEEDS["loaders.py"], "strategies.py"]}
PEERS = {"checkpoints": ("orbax.checkpoint", "optax")}  # the jobs that need peers (requirements-peers.txt)


def readme_snippets() -> dict | None:
    """The snippets in README.md by marker, or None when it has none."""
    path = os.path.join(HERE, "README.md")
    if not os.path.exists(path):
        return None
    found = dict(MARKER.findall(open(path).read()))
    return found or None


def job_text(name: str, snippet: str) -> str:
    return (f"MODULES = {MODULES[name]!r}\n" + PRELUDE + EXTRA[name] + "\n# --- the snippet ---\n"
            + snippet + "\n# --- the checks ---\n" + CHECKS[name])


def run_jobs(tmp_path, snippets: dict, names) -> None:
    from conftest import run_children

    commands, folders = [], []
    for name in names:
        folder = tmp_path / name
        folder.mkdir()
        for module in MODULES[name]:
            shutil.copy(os.path.join(HERE, module), folder / module)
        (folder / "job.py").write_text(job_text(name, snippets[name]))
        commands.append([sys.executable, "-c", "import os, runpy, sys; os.chdir(sys.argv[1]); "
                         "sys.path[0] = sys.argv[1]; runpy.run_path('job.py', run_name='__main__')",
                         str(folder)])
        folders.append(folder)
    results = run_children(commands, timeout=100, cwd=str(tmp_path))
    failed = [f"{name} job (exit {code}):\n{out[-2000:]}\n{err[-3000:]}"
              for name, (code, out, err) in zip(names, results) if code != 0 or "JOB OK" not in out]
    assert not failed, "\n\n".join(failed)


def test_each_module_alone_runs_a_users_job(tmp_path):
    snippets = readme_snippets() or SNIPPETS
    missing = set(MODULES) - set(snippets)
    assert not missing, f"README.md has own-job markers but lacks {sorted(missing)}"
    run_jobs(tmp_path, snippets, [name for name in MODULES if name not in PEERS])


# --------------------------------------------------------------------------
# Checkpoints as a JAX user keeps them (issue 30, item 5): orbax-checkpoint
# --------------------------------------------------------------------------


def test_orbax_saves_params_optimizer_state_and_the_loader_state_and_restores_on_2_devices(tmp_path):
    """The checkpoints job: loaders.py (with its three) and strategies.py copied alone,
    with orbax-checkpoint and optax (peers: requirements-peers.txt, installed in CI, so
    this runs there). The snippet trains 20 steps on 8 devices with logical shards and the
    canonical reduction, saves params, Adam's state and the LoaderState with orbax
    (StandardSave and JsonSave in one Composite), restores the arrays replicated onto a
    2-device mesh (StandardRestore with ShapeDtypeStruct shardings) and the loader from its
    state, and trains the rest of the epoch there. The checks: the restored arrays live on
    the 2 devices, the state is the one saved, Adam's count is the epoch's steps, and the
    final params and optimizer state are the bits of the run that never stopped; control,
    the same resume with Adam restarted ends elsewhere."""
    for module in PEERS["checkpoints"]:
        pytest.importorskip(module, reason=f"{module} is a peer (requirements-peers.txt); CI installs it")
    run_jobs(tmp_path, readme_snippets() or SNIPPETS, ["checkpoints"])


def test_readme_holds_the_snippets():
    snippets = readme_snippets()
    if snippets is None:
        pytest.skip("README.md has no '<!-- own-job: NAME -->' markers yet: the proposed snippets in "
                    "test_own_job.SNIPPETS run instead (the lead pastes them)")
    assert set(snippets) == set(SNIPPETS), sorted(snippets)
    for name in SNIPPETS:  # the copy here is the README's, word for word
        assert snippets[name] == SNIPPETS[name], f"README.md's {name} snippet and test_own_job.SNIPPETS differ"


def test_no_job_uses_a_private_name():
    # "Without reading any private function": no module attribute starting with "_".
    for name in MODULES:
        text = SNIPPETS[name] + EXTRA[name] + CHECKS[name]
        assert not re.search(r"\b(loaders|strategies|conformance|plan)\._", text), name


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
