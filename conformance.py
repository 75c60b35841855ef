"""How a vendor loader's epoch departs from the reference plan, in words.

The vendor conformance tests (test_rocal.py, test_dali.py) read a dataset whose
images encode their own sample index through the real vendor pipelines, decode
what each shard delivered, and hand it to ``describe_epoch``. It compares
with ``loaders.epoch_plan`` and returns a report written for the vendor's
maintainers: one summary line per kind of deviation first (how many shards,
steps and samples it affects), then a few examples of each. An empty report
means the epoch conforms. Every check here can fire: test_conformance.py feeds
each one a wrong epoch.

Needs loaders.py (the plan and the normalisation tables).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np

import loaders

EXAMPLES = 3  # per kind of deviation


# --------------------------------------------------------------------------
# Images that encode their own index
# --------------------------------------------------------------------------


def encoded_images(indices: np.ndarray) -> np.ndarray:
    """uint8 (N, 3, 32, 32): plane 0 is index % 256, plane 1 is index // 256 (N < 65536),
    plane 2 a ramp that a horizontal flip changes, so a mirrored image is detectable."""
    indices = np.asarray(indices, np.int64)
    images = np.empty((len(indices),) + loaders.IMAGE_SHAPE, np.uint8)
    images[:, 0] = (indices % 256)[:, None, None]
    images[:, 1] = (indices // 256)[:, None, None]
    y, x = np.mgrid[0:32, 0:32]
    images[:, 2] = (4 * x + 2 * y) % 256
    return images


def decode_indices(images_BCHW: np.ndarray, normalize: loaders.Normalize) -> np.ndarray:
    """The sample index each normalised image encodes; -1 where the pixels encode none.

    Each value is mapped back to the nearest entry of the normalisation table
    (so a vendor that is an ulp off still decodes); planes 0 and 1 must be flat."""
    images_BCHW = np.asarray(images_BCHW, np.float32)
    table = normalize.table.astype(np.float64)
    pixels, near = [], []
    for c in (0, 1):
        values = images_BCHW[:, c].astype(np.float64)
        step = np.abs(np.diff(table[c])).min()
        guess = np.rint(np.interp(values, table[c], np.arange(256))) if table[c][1] > table[c][0] \
            else np.rint(np.interp(-values, -table[c], np.arange(256)))
        guess = guess.astype(np.int64).clip(0, 255)
        pixels.append(guess)
        near.append(np.abs(table[c][guess] - values) < step / 4)
    planes = np.stack(pixels, axis=1)
    ok = np.all(np.stack(near, axis=1), axis=(1, 2, 3))
    flat = np.all(planes == planes[:, :, :1, :1], axis=(1, 2, 3))
    index = planes[:, 0, 0, 0] + 256 * planes[:, 1, 0, 0]
    return np.where(ok & flat, index, -1)


# --------------------------------------------------------------------------
# Deviations: collected by kind, reported summary first
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Findings:
    """Deviations by kind; each with the shards, steps and samples it touches."""
    kinds: dict = dataclasses.field(default_factory=lambda: defaultdict(list))

    def add(self, kind: str, text: str, *, shards=(), steps=(), samples=()) -> None:
        self.kinds[kind].append((text, set(shards), set(steps), set(np.asarray(samples).ravel().tolist())))

    def __bool__(self) -> bool:
        return bool(self.kinds)

    def report(self, header: str = "") -> str:
        """Summary lines first, one per kind, then up to EXAMPLES examples of each."""
        if not self.kinds:
            return ""
        lines = [header] if header else []
        lines.append(f"{len(self.kinds)} kind(s) of deviation:")
        for kind, items in self.kinds.items():
            shards = set().union(*(i[1] for i in items))
            steps = set().union(*(i[2] for i in items))
            samples = set().union(*(i[3] for i in items))
            lines.append(f"- {kind}: {len(items)} finding(s), {len(shards)} shard(s), "
                         f"{len(steps)} step(s), {len(samples)} sample(s)")
        for kind, items in self.kinds.items():
            lines.append(f"{kind}, e.g.:")
            lines += [f"    {text}" for text, *_ in items[:EXAMPLES]]
            if len(items) > EXAMPLES:
                lines.append(f"    ... and {len(items) - EXAMPLES} more")
        return "\n".join(lines)


def describe_epoch(delivered: list, num_samples: int, batch_size: int, *, shuffle: bool,
                   last_batch: str, length: int, masks: list | None = None,
                   findings: Findings | None = None) -> Findings:
    """How one epoch departs from ``epoch_plan(num_samples, n, batch_size)``.

    ``delivered[k]``: shard k's decoded sample indices, int (batches that arrived, B),
    -1 where a slot decodes to nothing. ``length``: the step count the loader or
    the vendor reports (its ``len()``, or its own count of remaining samples / B).
    ``masks[k]``: the mask the loader gave shard k (None: raw pipelines, no mask;
    then every delivered slot counts as delivered).

    Checked: the reported and the arrived step counts against the plan's; slots
    that decode to no sample; shards delivering the same batches as another;
    samples delivered by two shards; with shuffle off, the plan's samples in the
    plan's order (a constant shift is named as one); with shuffle on, only the
    shard's own samples; fill: every sample of the shard once in a real slot,
    masks as the plan's, padding slots repeating samples the shard delivers in
    real slots; drop: no sample twice.
    """
    found = findings if findings is not None else Findings()
    n = len(delivered)
    plan = loaders.epoch_plan(num_samples, n, batch_size, last_batch=last_batch)
    true_steps = plan.indices.shape[0]
    if length != true_steps:
        found.add("step count", f"the loader reports {length} steps per epoch; the plan has "
                  f"{true_steps} (N={num_samples}, {n} shards, batch {batch_size}, {last_batch})",
                  shards=range(n))
    for k, got in enumerate(delivered):
        if len(got) != true_steps:
            found.add("batches arrived", f"shard {k}: {len(got)} batches arrived, the plan has "
                      f"{true_steps}", shards=[k], steps=range(min(len(got), true_steps), max(len(got), true_steps)))
        bad = np.argwhere(got < 0)
        if bad.size:
            found.add("undecodable slots", f"shard {k}: {len(bad)} slots hold no encoded sample (first: "
                      f"step {bad[0][0]} slot {bad[0][1]})", shards=[k], steps=bad[:, 0])
    _same_batches(delivered, found)
    _overlap(delivered, masks, found)
    for k, got in enumerate(delivered):
        start, stop = loaders.shard_bounds(num_samples, k, n)
        real = got if masks is None else np.where(masks[k][:len(got)], got, -1)
        if masks is not None:
            want_mask = plan.mask[:len(got), k]
            wrong = np.argwhere(masks[k][:len(want_mask)] != want_mask)
            if wrong.size:
                found.add("mask", f"shard {k}: the mask differs from the plan's in {len(wrong)} slots "
                          f"(first: step {wrong[0][0]} slot {wrong[0][1]})", shards=[k], steps=wrong[:, 0])
            padding = got[~masks[k][:len(got)] & (got >= 0)]
            stray = np.setdiff1d(padding, real[real >= 0])
            if stray.size:
                found.add("padding", f"shard {k}: {stray.size} padding slots hold samples that no real "
                          f"slot of the shard delivers (e.g. {stray[:5].tolist()})", shards=[k],
                          samples=stray)
        if not shuffle:
            _order(k, got, plan.indices[:, k], found)
        values = real[real >= 0]
        outside = np.unique(values[(values < start) | (values >= stop)])
        if outside.size:
            found.add("outside the shard", f"shard {k} delivers {outside.size} samples from outside "
                      f"its range [{start}, {stop}) (e.g. {outside[:5].tolist()})",
                      shards=[k], samples=outside)
        counts = np.bincount(values - start, minlength=stop - start) if values.size and not outside.size \
            else None
        if last_batch == "fill" and len(got) >= true_steps:
            missing = np.setdiff1d(np.arange(start, stop), values)
            if missing.size:
                found.add("missing", f"shard {k} never delivers {missing.size} of its {stop - start} "
                          f"samples (e.g. {missing[:5].tolist()})", shards=[k], samples=missing)
        if counts is not None and (masks is not None or last_batch == "drop"):
            twice = np.flatnonzero(counts > 1) + start
            if twice.size:
                found.add("repeated", f"shard {k} delivers {twice.size} samples more than once in "
                          f"real slots (e.g. {twice[:5].tolist()})", shards=[k], samples=twice)
    return found


def _same_batches(delivered: list, found: Findings) -> None:
    """Groups of shards that deliver the same samples at the same step."""
    n = len(delivered)
    steps = min(len(d) for d in delivered) if delivered else 0
    for s in range(steps):
        groups = defaultdict(list)
        for k in range(n):
            groups[tuple(np.sort(delivered[k][s]))].append(k)
        for key, shards in groups.items():
            if len(shards) > 1:
                found.add("same batch on several shards", f"step {s}: shards {shards} deliver the "
                          f"same {len(key)} samples", shards=shards, steps=[s], samples=key)


def _overlap(delivered: list, masks: list | None, found: Findings) -> None:
    owner = {}
    shared = defaultdict(set)
    for k, got in enumerate(delivered):
        real = got if masks is None else np.where(masks[k][:len(got)], got, -1)
        for sample in np.unique(real[real >= 0]).tolist():
            if sample in owner and owner[sample] != k:
                shared[(owner[sample], k)].add(sample)
            owner.setdefault(sample, k)
    for (a, b), samples in shared.items():
        found.add("samples on two shards", f"shards {a} and {b} both deliver {len(samples)} samples "
                  f"(e.g. {sorted(samples)[:5]})", shards=[a, b], samples=list(samples))


def _order(k: int, got: np.ndarray, want: np.ndarray, found: Findings) -> None:
    """Shuffle off: shard k's slots against the plan's; a constant shift is one finding."""
    steps = min(len(got), len(want))
    flat_got, flat_want = got[:steps].ravel(), want[:steps].ravel()
    wrong = np.flatnonzero(flat_got != flat_want)
    if not wrong.size:
        return
    B = got.shape[1]
    for shift in range(-4 * B, 4 * B + 1):  # a stream that starts early or late
        if not shift or abs(shift) >= len(flat_got):  # (a shift past the end would wrap the slices)
            continue
        a = flat_got[max(shift, 0):len(flat_got) + min(shift, 0)]
        b = flat_want[max(-shift, 0):len(flat_want) + min(-shift, 0)]
        if len(a) >= B and np.mean(a == b) > 0.9:
            first = flat_got[0]
            found.add("order", f"shard {k} is shifted by {shift} slots against the plan (it starts with "
                      f"sample {first}, the plan with {flat_want[0]})", shards=[k],
                      steps=wrong // B, samples=[first])
            return
    s, j = divmod(int(wrong[0]), B)
    found.add("order", f"shard {k} step {s} slot {j}: sample {flat_got[wrong[0]]}, the plan says "
              f"{flat_want[wrong[0]]} ({len(wrong)} of {len(flat_want)} slots differ)",
              shards=[k], steps=wrong // B, samples=flat_got[wrong])


def describe_content(images_BCHW, labels_B, indices_B, ref_images, ref_labels,
                     normalize: loaders.Normalize) -> list[str]:
    """Labels and pixels of one delivered batch against the file and the table, in words.

    Pixels must equal ``normalize`` (the vendor's table) bit for bit; a batch
    that equals the mirrored images, or differs by ulps only, is named so."""
    images_BCHW, labels_B = np.asarray(images_BCHW), np.asarray(labels_B).reshape(-1)
    ok = indices_B >= 0
    found = []
    wrong = np.flatnonzero(ok & (labels_B != ref_labels[np.where(ok, indices_B, 0)]))
    if wrong.size:
        j = wrong[0]
        found.append(f"{wrong.size} labels differ from the file (slot {j} holds sample "
                     f"{indices_B[j]} with label {labels_B[j]}, the file says {ref_labels[indices_B[j]]})")
    want = normalize(ref_images[indices_B[ok]])
    got = images_BCHW[ok]
    bad = ~np.all(got == want, axis=(1, 2, 3)) if got.size else np.zeros(0, bool)
    if bad.any():
        mirrored = np.all(got[bad] == want[bad][..., ::-1], axis=(1, 2, 3))
        # In ulps of the largest magnitude (the table's scale), as the strategies' bounds.
        scale = np.spacing(np.float32(np.abs(want[bad]).max()))
        ulps = int(np.ceil(np.abs(got[bad].astype(np.float64) - want[bad]).max() / scale))
        note = ("; they equal the mirrored images: mirror=0 was not honoured" if mirrored.all()
                else f"; up to {ulps} ulps apart: another arithmetic than the table's" if ulps <= 8
                else "")
        found.append(f"{bad.sum()} images differ from the {normalize.arithmetic} table of their "
                     f"sample{note}")
    return found


def real_first(delivered: list, masks: list) -> tuple[list, list]:
    """Each shard's slots reordered real first (stable), for ``describe_epoch`` on a
    shuffled epoch whose padding may sit anywhere in the shard (rocAL shuffles its
    padding copies in among the real samples).

    With shuffle on, the spec fixes neither the order nor where the padding sits,
    only how many slots are real: after this, describe_epoch's positional mask
    check compares each shard's count of real slots with the plan's. Its other
    checks look at a shard's slots as a whole, except "same batch on several
    shards" and the step numbers in its examples, which then refer to the
    reordered slots. Returns new (delivered, masks), each shard (steps, B)."""
    out_delivered, out_masks = [], []
    for got, mask in zip(delivered, masks):
        mask = np.asarray(mask, bool)[:len(got)]
        order = np.argsort(~mask.ravel(), kind="stable")
        out_delivered.append(np.asarray(got).ravel()[order].reshape(got.shape))
        out_masks.append(mask.ravel()[order].reshape(mask.shape))
    return out_delivered, out_masks
