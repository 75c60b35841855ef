"""The GPU check: what a person with an NVIDIA GPU host runs, and what it found, in one report.

    python tools/gpu_check.py                      # every section, on the default platform (the GPU)
    python tools/gpu_check.py --sections canonical --platform cpu   # a dry run of one section here

Sections (each in processes of its own, bounded by --timeout; the report is written as it goes):

* suite: the default tier (``python -m pytest -x -q``) on this host. One GPU runs it on 8
  virtual CPU devices (conftest's device policy); two or more GPUs run it on the GPUs.
* refimpl: the main job, one epoch, on the GPU (--platform given here, else JAX's default).
* bench: ``bench.py --quick``.
* canonical: the canonical reduction on one device of the platform, a global batch of 64 rows
  as L = 1, 2, 4 and 8 logical blocks. For each L and each set of XLA flags below, two fresh
  processes (fresh compilations) train 6 steps through sharded, pmap, shard_map and single
  and write every strategy's params and optimizer state. The report says, per L and flags,
  whether the strategies agree bit for bit in a process and whether the two processes agree
  (run-to-run determinism), and whether the bits of different L agree (not promised: the
  order of summation follows L). Flag sets: none; ``--xla_gpu_deterministic_ops=true``;
  ``--xla_gpu_exclude_nondeterministic_ops=true``; ``--xla_gpu_autotune_level=0``. Every run
  sets ``JAX_DEFAULT_MATMUL_PRECISION=highest`` (TF32 otherwise).

The report: JSON at --report (default gpu-check.json), each section's command, exit status,
seconds and last lines, and the canonical table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAG_SETS = {"none": "", "deterministic_ops": "--xla_gpu_deterministic_ops=true",
             "exclude_nondeterministic_ops": "--xla_gpu_exclude_nondeterministic_ops=true",
             "autotune_level_0": "--xla_gpu_autotune_level=0"}
BLOCKS = (1, 2, 4, 8)
ROWS, STEPS = 64, 6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="suite,refimpl,bench,canonical")
    parser.add_argument("--platform", help="JAX platform for refimpl and canonical (default: JAX's)")
    parser.add_argument("--report", default="gpu-check.json")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds a section's process may run")
    parser.add_argument("--flag-sets", default=",".join(FLAG_SETS), help="canonical: the XLA flag sets")
    parser.add_argument("--blocks", default=",".join(map(str, BLOCKS)), help="canonical: the values of L")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - {"suite", "refimpl", "bench", "canonical"}
    if unknown:
        parser.error(f"--sections: unknown {sorted(unknown)}")
    args.flag_sets = {name: FLAG_SETS[name] for name in args.flag_sets.split(",")}
    args.blocks = [int(b) for b in args.blocks.split(",")]
    report = {"platform": args.platform, "sections": {}}
    env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION="highest")
    if args.platform:
        env["JAX_PLATFORMS"] = args.platform
    commands = {"suite": [sys.executable, "-m", "pytest", "-x", "-q"],
                "refimpl": [sys.executable, "refimpl.py", "--epochs", "1"]
                           + (["--platform", args.platform] if args.platform else []),
                "bench": [sys.executable, "bench.py", "--quick"]}
    failed = False
    for section in sections:
        if section == "canonical":
            found = canonical_table(args, env)
            failed |= not found["strategies agree"] or not found["run to run"]
        else:
            found = run(commands[section], env if section != "suite" else dict(os.environ), args.timeout)
            failed |= found["exit status"] != 0
        report["sections"][section] = found
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)
        print(f"{section}: {json.dumps(found)[:400]}", flush=True)
    return 1 if failed else 0


def run(command: list[str], env: dict, timeout: int) -> dict:
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        code, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired:
        code, out = "timeout", ""
    return {"command": " ".join(command), "exit status": code, "seconds": round(time.monotonic() - start, 1),
            "last lines": out.strip().splitlines()[-15:]}


def canonical_table(args, env: dict) -> dict:
    """Two fresh processes per (L, flags), each writing every strategy's bits; compared here."""
    import numpy as np

    runs, table = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for (name, flags), L, attempt in itertools.product(args.flag_sets.items(), args.blocks, (0, 1)):
            out = os.path.join(tmp, f"{name}-{L}-{attempt}.npz")
            child = dict(env, XLA_FLAGS=flags) if flags else env
            done = run([sys.executable, os.path.abspath(__file__), "--child", str(L), out], child, args.timeout)
            if done["exit status"] != 0:
                table.append({"flags": name, "L": L, "error": done["last lines"]})
                continue
            with np.load(out) as npz:
                runs[name, L, attempt] = {k: npz[k] for k in npz.files}
    same = lambda a, b: a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
    agree, repeat = True, True
    for name, L in itertools.product(args.flag_sets, args.blocks):
        first, second = runs.get((name, L, 0)), runs.get((name, L, 1))
        if first is None or second is None:
            agree = repeat = False
            continue
        strategies = by_strategy(first)
        within = all(same(leaves, strategies["single"]) for leaves in strategies.values())
        row = {"flags": name, "L": L, "strategies agree": within, "run to run": same(first, second)}
        agree, repeat = agree and within, repeat and row["run to run"]
        table.append(row)
    across = {name: len({tuple((k, v.tobytes()) for k, v in sorted(by_strategy(runs[name, L, 0])["single"].items()))
                         for L in args.blocks if (name, L, 0) in runs}) == 1 for name in args.flag_sets}
    return {"strategies agree": agree, "run to run": repeat, "different L the same bits (not promised)": across,
            "table": table}


def by_strategy(arrays: dict) -> dict:
    """{strategy: {leaf index: array}} of a child's '<strategy>/<i>' arrays."""
    out = {}
    for key, value in arrays.items():
        name, i = key.split("/", 1)
        out.setdefault(name, {})[i] = value
    return out


def child(L: int, out: str) -> None:
    """One process: STEPS canonical steps of a small MLP with adamw on the platform's first
    device, every strategy, a global batch of ROWS rows as L blocks; writes each strategy's
    params and optimizer state as '<strategy>/<i>'."""
    sys.path.insert(0, ROOT)
    import numpy as np
    import jax
    import optax
    import loaders
    import strategies

    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((ROWS * STEPS, 32)).astype(np.float32),
            "y": rng.integers(0, 10, ROWS * STEPS).astype(np.int32)}
    params = {"w1": (0.2 * rng.standard_normal((32, 64))).astype(np.float32), "b1": np.zeros(64, np.float32),
              "w2": (0.2 * rng.standard_normal((64, 10))).astype(np.float32), "b2": np.zeros(10, np.float32)}

    def loss_terms(p, batch):
        logits = jax.nn.gelu(batch["x"] @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
        nll = -jax.numpy.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], axis=1)[:, 0]
        mask = batch["mask"].astype(np.float32)
        return (mask * nll).sum(), mask.sum()

    mesh = loaders.data_mesh(jax.devices()[:1])
    optimizer = optax.adamw(1e-2)
    arrays = {}
    for name, train in strategies.STRATEGIES.items():
        loader = loaders.make_loader(data, mesh, ROWS // L, logical_shards=L, shuffle=True, seed=1,
                                     layout=strategies.LAYOUT[name])
        trained = train(params, loader.epoch(0), mesh, loss_terms=loss_terms, optimizer=optimizer,
                        reduction="canonical")
        for i, leaf in enumerate(jax.tree.leaves((trained.params, trained.opt_state))):
            arrays[f"{name}/{i}"] = np.asarray(leaf)
    np.savez(out, **arrays)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(int(sys.argv[2]), sys.argv[3])
        sys.exit(0)
    sys.exit(main())
