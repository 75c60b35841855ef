"""The accelerator check: what a person with a GPU or TPU host runs, and what it found, in one report.

    python tools/accelerator_check.py                     # every section, on the default platform
    python tools/accelerator_check.py --platform tpu --sections canonical,delivery
    python tools/accelerator_check.py --sections canonical --platform cpu   # a dry run here

Every section runs in processes of its own, one at a time (an accelerator may serve one
process: a TPU refuses a second), each bounded by --timeout; this process never starts JAX.
The report is written as it goes.

* suite: the default tier (``python -m pytest -x -q``) on this host. One accelerator runs it
  on 8 virtual CPU devices (conftest's device policy); two or more run it on them.
* refimpl: the main job on the accelerator (``--platform`` given here, else JAX's default).
* bench: ``bench.py`` (``--bench-args``, default ``--quick``).
* delivery: the reference loader on the platform's first device, both placements and
  layouts, three vendors' normalisations (a crop and a flip among them), 3 epochs (one
  resumed from a state saved on other shards): every block against the plan and the
  table computed on the host, bit for bit; and which route normalised (a lookup, or the
  table's arithmetic on ARITHMETIC_PLATFORMS).
* canonical: the canonical reduction on the platform's first device, a global batch of 64
  rows as L = 1, 2, 4 and 8 logical blocks, 6 steps of a small MLP with adamw through
  sharded, pmap, shard_map and single. Per set of XLA flags, two fresh processes, each
  running every L: do the strategies agree bit for bit in a process, do the two processes
  agree (run-to-run determinism), and do the bits of different L agree (not promised: each
  block's gradient sums its own rows). Flag sets (all with --platform gpu, else "none"): none;
  ``--xla_gpu_deterministic_ops=true``; ``--xla_gpu_exclude_nondeterministic_ops=true``;
  ``--xla_gpu_autotune_level=0``. Every run sets ``JAX_DEFAULT_MATMUL_PRECISION=highest``.
* exact_sum: ``summation.exact_sum`` (in pieces and ``whole``) on the platform's first
  device against its docstring read with Python fractions on the host (``exact_reference``),
  bit for bit: the grid conversion, the limbs' carries (300 blocks near the largest entry, of either sign, so every limb
  carries), ties of the final rounding, overflow, the least normals, subnormals (counted as
  0), -0.0, NaN and the infinities, in float32, bfloat16 and float16.

The report: JSON at --report (default accelerator-check.json): the platform and device kind
the children ran on, each section's command, exit status, seconds and last lines, and the
delivery and canonical tables.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("suite", "refimpl", "bench", "delivery", "canonical", "exact_sum")
GPU_FLAG_SETS = {"none": "", "deterministic_ops": "--xla_gpu_deterministic_ops=true",
                 "exclude_nondeterministic_ops": "--xla_gpu_exclude_nondeterministic_ops=true",
                 "autotune_level_0": "--xla_gpu_autotune_level=0"}
BLOCKS = (1, 2, 4, 8)
ROWS, STEPS = 64, 6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--platform", help="JAX platform of refimpl, delivery and canonical (default: JAX's)")
    parser.add_argument("--report", default="accelerator-check.json")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds a section's process may run")
    parser.add_argument("--flag-sets", help="canonical: the XLA flag sets (default: every set with --platform "
                                            "gpu, cuda or rocm, else none)")
    parser.add_argument("--blocks", default=",".join(map(str, BLOCKS)), help="canonical: the values of L")
    parser.add_argument("--bench-args", default="--quick", help="bench.py's options")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {unknown}")
    env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION="highest")
    if args.platform:
        env["JAX_PLATFORMS"] = args.platform
    report = {"platform": args.platform or "(JAX's default)", "sections": {}}
    commands = {"suite": [sys.executable, "-m", "pytest", "-x", "-q"],
                "refimpl": [sys.executable, "refimpl.py"] + (["--platform", args.platform] if args.platform else []),
                "bench": [sys.executable, "bench.py", *args.bench_args.split()]}
    failed = False
    for section in sections:
        if section in commands:
            found = run(commands[section], env if section != "suite" else dict(os.environ), args.timeout)
            failed |= found["exit status"] != 0
        else:
            found = {"delivery": delivery_section, "canonical": canonical_section,
                     "exact_sum": exact_sum_section}[section](args, env)
            report["device"] = found.pop("device", report.get("device"))
            failed |= not found["ok"]
        report["sections"][section] = found
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)
        print(f"{section}: {json.dumps(found)[:600]}", flush=True)
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


def child(kind: str, env: dict, timeout: int, *extra: str) -> tuple[dict, dict]:
    """One fresh process running this file's ``--child kind``: (its JSON result or None, run's dict)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        done = run([sys.executable, os.path.abspath(__file__), "--child", kind, out, *extra], env, timeout)
        result = json.load(open(out)) if done["exit status"] == 0 and os.path.exists(out) else None
    return result, done


def delivery_section(args, env: dict) -> dict:
    result, done = child("delivery", env, args.timeout)
    if result is None:
        return {"ok": False, "error": done}
    return {"ok": not result["differ"], "seconds": done["seconds"], **result}


def canonical_section(args, env: dict) -> dict:
    """Per flag set, two fresh processes each training every L; compared here."""
    import numpy as np

    gpu = args.platform in ("gpu", "cuda", "rocm")
    flag_sets = args.flag_sets.split(",") if args.flag_sets else list(GPU_FLAG_SETS) if gpu else ["none"]
    blocks = [int(b) for b in args.blocks.split(",")]
    table, device, ok = [], None, True
    for name in flag_sets:
        flags = GPU_FLAG_SETS[name]
        runs = []
        for attempt in (0, 1):
            result, done = child("canonical", dict(env, XLA_FLAGS=flags) if flags else env, args.timeout,
                                 ",".join(map(str, blocks)))
            if result is None:
                table.append({"flags": name, "attempt": attempt, "error": done["last lines"]})
                ok = False
                break
            device = result.pop("device")
            runs.append({L: {k: np.array(v["values"], dtype=v["dtype"]) for k, v in arrays.items()}
                         for L, arrays in result.items()})
        if len(runs) < 2:
            continue
        same = lambda a, b: a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
        for L in map(str, blocks):
            by = by_strategy(runs[0][L])
            row = {"flags": name, "L": int(L), "strategies agree": all(same(v, by["single"]) for v in by.values()),
                   "run to run": same(runs[0][L], runs[1][L])}
            ok &= row["strategies agree"] and row["run to run"]
            table.append(row)
        table.append({"flags": name, "different L the same bits (not promised)":
                      len({tuple(sorted((k, v.tobytes()) for k, v in by_strategy(runs[0][L])["single"].items()))
                           for L in map(str, blocks)}) == 1})
    return {"ok": ok, "device": device, "table": table}


def exact_sum_section(args, env: dict) -> dict:
    result, done = child("exact_sum", env, args.timeout)
    if result is None:
        return {"ok": False, "error": done}
    return {"ok": not result["differ"], "seconds": done["seconds"], **result}


def exact_reference(blocks):
    """``summation.exact_sum`` of blocks (L, m) read literally, on the host with Python fractions: subnormals as 0,
    the grid q = 2**(E - GRID_BITS), each column's sum of round(x / q), rounded once to the dtype (nearest even);
    a NaN, or +Inf beside -Inf, NaN; one infinity, itself."""
    import math
    from fractions import Fraction
    import numpy as np
    import summation

    dtype = blocks.dtype
    man, bias, ebits = summation.FORMATS[np.dtype(dtype)]
    up = blocks.astype(np.float32)
    up = np.where(np.abs(up) < 2.0**-126, np.float32(0), up)
    finite = np.isfinite(up)
    M = float(np.max(np.abs(up[finite]), initial=0))
    E = max(math.frexp(M)[1], -125)
    q = Fraction(2) ** (E - summation.GRID_BITS)
    out = []
    for column in up.T:
        if np.isnan(column).any() or ((column == np.inf).any() and (column == -np.inf).any()):
            out.append(np.nan)
            continue
        if np.isinf(column).any():
            out.append(float(column[np.isinf(column)][0]))
            continue
        value = sum(round(Fraction(float(x)) / q) for x in column) * q
        a = abs(value)
        if a == 0:
            out.append(0.0)
            continue
        e = math.floor(math.log2(a))
        e += (Fraction(2) ** (e + 1) <= a) - (Fraction(2) ** e > a)
        step = Fraction(2) ** max(e - man, 1 - bias - man)
        near = round(a / step) * step  # half to even
        big = near >= Fraction(2) ** ((1 << ebits) - 1 - bias)
        out.append(math.copysign(math.inf if big else float(near), value))
    return np.array(out, np.float32).astype(dtype)


def exact_sum_child(out: str) -> None:
    """One process: ``exact_sum_section``'s cases on the platform's first device; writes {"device", "checked",
    "differ"}. NaN is compared by its bits too (float32 0x7fc00000, bfloat16 0x7fc0, float16 0x7e00)."""
    import functools
    import numpy as np
    import jax
    import jax.numpy as jnp
    import summation

    device = jax.devices((os.environ.get("JAX_PLATFORMS") or "").split(",")[0] or None)[0]
    rng = np.random.default_rng(7)
    near = rng.uniform(0.5, 1.0, (300, 40)) * rng.choice([-1.0, 1.0], (300, 40))
    near[:150, :20] = np.abs(near[:150, :20])  # some columns' sums large and positive, some of mixed sign
    special = np.ones((4, 6), np.float32)
    special[1, 0], special[2, 1], special[3, 1], special[0, 2], special[1, 3] = np.nan, np.inf, -np.inf, np.inf, -np.inf
    cases = {"normal": rng.standard_normal((8, 256)).astype(np.float32),
             "wide range": (rng.standard_normal((6, 256)) * 10.0 ** rng.integers(-44, 37, (6, 256))).astype(np.float32),
             "carries": near.astype(np.float32),
             "ties": np.array([[2.0**24, 1.0, 1.0, 1.0], [1.0, 2.0**24, 3.0, -1.0], [-0.0, 0.0, 0.0, 2.0**-30]],
                              np.float32),
             "overflow": np.array([[3e38, -3e38, 3e38], [3e38, -3e38, -1.0], [1e38, 0.0, 0.0]], np.float32),
             "least normals": (rng.standard_normal((4, 64)) * 2.0**-124).astype(np.float32),
             "subnormal": (rng.standard_normal((4, 64)) * 1e-40).astype(np.float32),
             "signed zeros": np.full((3, 5), -0.0, np.float32), "specials": special,
             "bfloat16": rng.standard_normal((6, 64)).astype(jnp.bfloat16),
             "float16": (rng.standard_normal((6, 64)) * 1000).astype(np.float16)}
    differ = []
    for whole in (False, True):  # in pieces, and whole (a chip's loop program sums so)
        summed = jax.jit(functools.partial(summation.exact_sum, whole=whole))
        for name, blocks in cases.items():
            got = np.asarray(summed(jax.device_put(blocks, device)))
            want = exact_reference(blocks)
            if got.dtype != want.dtype or got.tobytes() != want.tobytes():
                where = f"{name}, whole" if whole else name
                differ.append(f"{where}: {got.ravel()[:4]} against {want.ravel()[:4]}")
    with open(out, "w") as f:
        json.dump({"device": f"{device.platform} ({device.device_kind})", "checked": 2 * len(cases),
                   "differ": differ}, f)


def by_strategy(arrays: dict) -> dict:
    """{strategy: {leaf index: array}} of a child's '<strategy>/<i>' arrays."""
    out = {}
    for key, value in arrays.items():
        name, i = key.split("/", 1)
        out.setdefault(name, {})[i] = value
    return out


def canonical_child(out: str, blocks: str) -> None:
    """One process: for each L, STEPS canonical steps of a small MLP with adamw on the platform's
    first device through every strategy, a global batch of ROWS rows as L blocks; writes each
    strategy's params and optimizer state as '<strategy>/<i>', per L."""
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
    found = {"device": f"{jax.devices()[0].platform} ({jax.devices()[0].device_kind})"}
    for L in map(int, blocks.split(",")):
        arrays = {}
        for name, train in strategies.STRATEGIES.items():
            loader = loaders.make_loader(data, mesh, ROWS // L, logical_shards=L, shuffle=True, seed=1,
                                         layout=strategies.LAYOUT[name])
            trained = train(params, loader.epoch(0), mesh, loss_terms=loss_terms, optimizer=optimizer,
                            reduction="canonical")
            for i, leaf in enumerate(jax.tree.leaves((trained.params, trained.opt_state))):
                leaf = np.asarray(leaf)
                arrays[f"{name}/{i}"] = {"dtype": leaf.dtype.str, "values": leaf.tolist()}
        found[str(L)] = arrays
    with open(out, "w") as f:
        json.dump(found, f)


def delivery_child(out: str) -> None:
    """One process: the reference loader on the platform's first device against the plan and the
    host's tables (``delivery_section``); writes {"device", "routes", "checked", "differ"}."""
    import numpy as np
    import jax
    import loaders
    from arithmetic import Normalize, table_key
    from plan import on_devices

    rng = np.random.default_rng(3)
    images, labels = rng.integers(0, 256, (203, 3, 32, 32), dtype=np.uint8), rng.integers(0, 10, 203).astype(np.int32)
    device = jax.devices((os.environ.get("JAX_PLATFORMS") or "").split(",")[0] or None)[0]
    mesh = loaders.data_mesh([device])
    norms = [Normalize(), Normalize(mean=(0.0, 0.0, 0.0), std=(255.0, 255.0, 255.0), arithmetic="dali_cpu"),
             Normalize(mean=(120.0, -3.5, 0.0), std=(30.0, 60.0, -90.0), arithmetic="dali_gpu", mirror=True,
                       crop=(24, 28), crop_pos=(0.25, 0.75))]
    checked, differ = 0, []
    for norm, placement, layout in ((f, p, l) for f in norms for p in loaders.PLACEMENTS for l in loaders.LAYOUTS):
        loader = loaders.make_loader((images, labels), mesh, 16, shuffle=True, seed=4, normalize=norm,
                                     placement=placement, layout=layout, logical_shards=2)
        half = loaders.make_loader((images, labels), [device], 5, shuffle=True, seed=4, normalize=norm)
        saved = half.epoch(2)
        for _ in range(3):
            next(saved)
        epochs = [(0, None), (1, None), (2, saved.get_state())]
        for epoch, state in epochs:
            plan, row = (loader.plan(epoch), 0) if state is None else state.resized(2, 16).plan()
            on = on_devices(plan, 1)
            for s, batch in enumerate(loader.epoch(epoch, state=state)):
                idx = on.indices[row + s, 0]
                want = {"images": norm(images[idx]), "labels": labels[idx], "mask": on.mask[row + s, 0],
                        "index": idx.astype(np.int32), "logical_shards": np.arange(2, dtype=np.int32)}
                for name, value in want.items():
                    # contiguous copies: a TPU's arrays come back in strided layouts, which .view refuses
                    got, value = (np.ascontiguousarray(x) for x in (np.asarray(batch[name]).reshape(value.shape), value))
                    checked += 1
                    if got.dtype != value.dtype or not np.array_equal(got.view(np.uint8), value.view(np.uint8)):
                        differ.append(f"{norm.arithmetic} {placement} {layout} epoch {epoch} step {s}: {name}")
    routes = {f.arithmetic: sorted(loaders.normalizer(table_key(f.mean, f.std, f.arithmetic, "check"), mesh))
              for f in norms}
    with open(out, "w") as f:
        json.dump({"device": f"{device.platform} ({device.device_kind})", "routes": routes,
                   "checked": checked, "differ": differ[:20]}, f)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.path.insert(0, ROOT)
        children = {"canonical": canonical_child, "delivery": delivery_child, "exact_sum": exact_sum_child}
        children[sys.argv[2]](*sys.argv[3:])
        sys.exit(0)
    sys.exit(main())
