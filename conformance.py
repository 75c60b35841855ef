"""How a loader's epochs depart from the reference plan, in words. For any loader.

The recipe, for your own loader as for the vendors' (test_rocal.py,
test_dali.py, test_grain.py): build a dataset whose samples encode their own
index (encoding.py's ``encoded_images``: uint8 images of any shape, or float/int
features), run it through the loader, turn each global batch into per-shard
blocks (``shard_blocks``), decode the indices (``encoding.decode_indices``) and
hand them to the describers below. Each returns ``Findings``: one summary line per kind of
deviation first (how many shards, steps and samples it affects), then a few
examples of each; every finding names its shard(s) and step(s). An empty report
means the checks below found nothing. Every check can fire: test_conformance.py
feeds each one a wrong epoch, two broken loaders (a shuffle that ignores the
epoch, labels shifted by one sample), and two broken resumes on other devices (the
epoch restarted from step 0, the new size's fresh plan read from the step).

What it checks (each describer's docstring has the whole list, and what it
cannot see):

* ``describe_epoch``, one epoch against ``plan.epoch_plan``: the step count, the
  batches, slots that decode to no sample, shards delivering one batch, samples on
  two shards, padding that is no padding; ``partition="contiguous"`` (the default)
  also holds the loader to the reference partition and plan (masks, order when not
  shuffled, only its own samples, exactly once), ``partition="any"`` to what every
  sharded loader owes whatever its partition (equal steps, exactly once).
* ``describe_resized_epoch``, one epoch run on a chain of shard sets (a job resumed
  mid-epoch on other devices: ``plan.elastic_plan``'s segments): the same per
  segment, and over the whole epoch exactly once across the changes.
* ``describe_epochs``, several epochs of one loader: reads of one epoch agree;
  without shuffle every epoch is the same; with shuffle the order changes (when a
  uniform shuffle would repeat it with probability below ``CHANCE``).
* ``describe_values``, any key: every slot holds its own sample's value, bit for
  bit (a shift by a few samples or slots named as such).
* ``describe_content``, normalised images: the pixels are the vendor's
  ``Normalize`` table's bits, and the labels are the file's.

What no describer can see: anything the index encoding does not carry (a crop or
noise on a sample that still decodes, unless describe_content or describe_values
holds the content); without masks, which slots are padding; with shuffle, whether
the order is the plan's (only that it stays in its shard, changes with the epoch
and covers the samples); epochs it is not given; which device a block lives on
(decode each device's block from ``addressable_shards`` for that); speed, or
several processes' agreement unless their blocks are described together.

Imports: plan.py (the plans, elastic ones included), arithmetic.py (the
normalisation tables) and NumPy; no JAX: it reads what a loader delivered, as host
arrays. Imported by the tests only (and by a user's job: copy it with those two, and
encoding.py for the samples).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import numpy as np

from arithmetic import Normalize
from plan import (LAST_BATCH_POLICIES, Segment, elastic_num_steps, elastic_plan, epoch_plan,
                  shard_bounds)

EXAMPLES = 3  # per kind of deviation
LAYOUTS = ("sharded", "pmap")  # a batch's two shapes, (n*B, ...) and (n, B, ...): loaders.LAYOUTS


def shard_blocks(array, num_shards: int, layout: str = "sharded") -> np.ndarray:
    """A global batch array as per-shard blocks (n, B, ...): block k is mesh position k's.

    ``array``: layout "sharded" (n*B, ...) (what ``make_loader`` and jit take) or
    "pmap" (n, B, ...), a NumPy array or a fully addressable jax.Array. Raises
    ValueError when the leading axis does not match ``num_shards``."""
    x = np.asarray(array)
    if layout not in LAYOUTS:
        raise ValueError(f"shard_blocks: layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "pmap":
        if x.ndim < 2 or x.shape[0] != num_shards:
            raise ValueError(f"shard_blocks: a 'pmap' batch must be (n, B, ...) with n = "
                             f"num_shards = {num_shards}, got shape {x.shape}")
        return x
    if x.ndim < 1 or x.shape[0] % num_shards:
        raise ValueError(f"shard_blocks: a 'sharded' batch must be (n*B, ...) with n = num_shards = "
                         f"{num_shards}, got shape {x.shape}")
    return x.reshape((num_shards, -1) + x.shape[1:])


# --------------------------------------------------------------------------
# Deviations: collected by kind, reported summary first
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Findings:
    """Deviations by kind; each with the shards, steps and samples it touches (from
    describe_resized_epoch: shards as (segment, shard) pairs, steps the epoch's global
    steps)."""
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


PARTITIONS = ("contiguous", "any")


def describe_epoch(delivered, num_samples: int, batch_size: int, *, shuffle: bool,
                   last_batch: str, length: int, masks=None, findings: Findings | None = None,
                   partition: str = "contiguous") -> Findings:
    """How one epoch departs from ``epoch_plan(num_samples, n, batch_size)``.

    ``delivered``: the decoded sample indices (-1 where a slot decodes to
    nothing), in either layout: one int array (steps, n, B), the plan's own
    (``Plan.indices``), or a list of n per-shard int arrays (batches that
    arrived, B), which may differ in length. ``masks``: the loader's masks in
    the same layout (None: raw pipelines, no mask; then every delivered slot
    counts as real). ``length``: the step count the loader reports (its
    ``len()``, or its own count of remaining samples / B).

    Checked in both modes: the reported and arrived step counts; slots that
    decode to no sample; shards delivering the same batches at a step; samples
    delivered in real slots of two shards; padding slots (with masks) holding a
    sample that no real slot of the shard delivers. ``partition="contiguous"`` (the reference
    partition): the counts against the plan's; with shuffle off, the plan's
    samples in the plan's order (a constant shift is named as one); with
    shuffle on, only the shard's own samples; masks as the plan's; fill: every
    sample of the shard once in a real slot; drop: none twice.
    ``partition="any"``: every shard the same number of batches, equal to
    ``length``; no sample outside range(N); fill: every sample of range(N) in
    real slots exactly once across all shards; drop: at most once. Without
    masks and with fill, a repeat within one shard may be padding and is not
    flagged (in either mode); a sample on two shards always is.

    One epoch only: the order across epochs is ``describe_epochs``'s, labels and
    any other key ``describe_values``'s. Every finding names the step(s) it
    concerns (in its text and its steps).
    Raises ValueError for input in neither layout, masks that do not match
    ``delivered``, or an unknown partition or last_batch.
    """
    _check_mode("describe_epoch", partition, last_batch)
    delivered, masks = _blocks(delivered, masks, batch_size, "describe_epoch")
    found = findings if findings is not None else Findings()
    n = len(delivered)
    arrived = [len(got) for got in delivered]
    if partition == "contiguous":
        plan = epoch_plan(num_samples, n, batch_size, last_batch=last_batch)
        true_steps = plan.indices.shape[0]
        what = f"the plan has {true_steps} (N={num_samples}, {n} shards, batch {batch_size}, {last_batch})"
        bounds = [shard_bounds(num_samples, k, n) for k in range(n)]
        runs = [(np.arange(start, stop), f"its range [{start}, {stop})") for start, stop in bounds]
        owed = [(run, f"its {len(run)} samples") for run, _ in runs] if last_batch == "fill" else None
    else:
        plan, true_steps, runs, owed = None, max(arrived), None, None
        what = f"the longest shard delivered {true_steps}"
    if length != true_steps:
        found.add("step count", f"the loader reports {length} steps per epoch; {what}; steps "
                  f"{_span(min(length, true_steps), max(length, true_steps))}",
                  shards=range(n), steps=range(min(length, true_steps), max(length, true_steps)))
    reals = _check_shards(delivered, masks, found, plan=plan, steps=true_steps, what=what, runs=runs,
                          owed=owed, shuffle=shuffle, last_batch=last_batch)
    if plan is None:
        _exactly_once(reals, num_samples, last_batch, f"in any of steps {_span(0, max(arrived, default=0))}",
                      found)
    return found


def _check_mode(where: str, partition: str, last_batch: str) -> None:
    if partition not in PARTITIONS:
        raise ValueError(f"{where}: partition must be one of {PARTITIONS}, got {partition!r}")
    if last_batch not in LAST_BATCH_POLICIES:
        raise ValueError(f"{where}: last_batch must be one of {LAST_BATCH_POLICIES}, "
                         f"got {last_batch!r}")


def _blocks(delivered, masks, batch_size: int, where: str, name: str = "delivered") -> tuple[list, list]:
    """describe_epoch's two layouts as per-shard lists (delivered, masks or None), validated;
    ``masks`` cut to the batches that arrived."""
    delivered = _per_shard(delivered, batch_size, name, np.integer, where)
    if masks is None:
        return delivered, None
    masks = _per_shard(masks, batch_size, name.replace("delivered", "masks"), np.bool_, where)
    if len(masks) != len(delivered):
        raise ValueError(f"{where}: masks has {len(masks)} shards, delivered {len(delivered)}")
    for k, (got, mask) in enumerate(zip(delivered, masks)):
        if len(mask) < len(got):
            raise ValueError(f"{where}: masks of shard {k} cover {len(mask)} batches, "
                             f"delivered has {len(got)}")
    return delivered, [mask[:len(got)] for got, mask in zip(delivered, masks)]


def _check_shards(delivered: list, masks, found, *, plan, steps: int, what: str, runs, owed,
                  shuffle: bool, last_batch: str, offset: int = 0, resized: bool = False) -> list:
    """describe_epoch's per-shard checks of one stretch of steps run by one set of shards;
    row r of every shard is step ``offset + r`` in every finding. ``plan``: the stretch's
    Plan (contiguous) or None (any); ``steps``: the batches every shard must deliver
    (``what`` says why, before any " ("); ``runs``: per shard (the samples it may
    deliver, words for them), ``owed``: per shard (the samples it must deliver in real
    slots when all its batches arrived, words) or None; both None for "any".
    ``resized``: describe_resized_epoch's two allowances for a shard with an empty run
    (see there). Returns the real slots per shard (-1 elsewhere)."""
    reals = [got if masks is None else np.where(masks[k], got, -1) for k, got in enumerate(delivered)]
    arrived = [len(got) for got in delivered]
    head = what.split(" (")[0]
    for k, got in enumerate(delivered):
        if len(got) != steps:
            lo, hi = min(len(got), steps), max(len(got), steps)
            found.add("batches arrived", f"shard {k}: {len(got)} batches arrived, {head}; steps "
                      f"{_span(offset + lo, offset + hi)}", shards=[k], steps=range(offset + lo, offset + hi))
        bad = np.argwhere(got < 0)
        if bad.size:
            found.add("undecodable slots", f"shard {k}: {len(bad)} slots hold no encoded sample (first: "
                      f"step {offset + bad[0][0]} slot {bad[0][1]})", shards=[k], steps=bad[:, 0] + offset)
    _same_batches(delivered, found, offset, reals if resized and masks is not None else None)
    _overlap(reals, found, offset)
    every_step = f"in any of steps {_span(offset, offset + max(arrived, default=0))}"
    stretch = np.concatenate([r[r >= 0].ravel() for r in reals]) if reals else np.zeros(0, np.int64)
    for k, got in enumerate(delivered):
        real = reals[k]
        values = real[real >= 0]
        if masks is not None:
            if plan is not None:
                want_mask = plan.mask[:len(got), k]
                wrong = np.argwhere(masks[k][:len(want_mask)] != want_mask)
                if wrong.size:
                    found.add("mask", f"shard {k}: the mask differs from the plan's in {len(wrong)} "
                              f"slots (first: step {offset + wrong[0][0]} slot {wrong[0][1]})", shards=[k],
                              steps=wrong[:, 0] + offset)
            padding = got[~masks[k] & (got >= 0)]
            stray = np.setdiff1d(padding, stretch if resized and not values.size else values)
            if stray.size:
                at = _steps_of(got, stray, ~masks[k]) + offset
                found.add("padding", f"shard {k}: {stray.size} padding slots hold samples that no real "
                          f"slot of the shard delivers (e.g. {stray[:5].tolist()}; first at step "
                          f"{at[0]})", shards=[k], steps=at, samples=stray)
        if plan is None:
            if masks is not None or last_batch == "drop":
                _repeats_within(k, real, found, offset)
            continue
        run, run_words = runs[k]
        if not shuffle:
            _order(k, got, plan.indices[:, k], found, offset)
        outside = np.unique(values[~np.isin(values, run)])
        if outside.size:
            at = _steps_of(real, outside) + offset
            found.add("outside the shard", f"shard {k} delivers {outside.size} samples from outside "
                      f"{run_words} (e.g. {outside[:5].tolist()}; first at step {at[0]})", shards=[k],
                      steps=at, samples=outside)
        if owed is not None and len(got) >= steps:
            want, owed_words = owed[k]
            missing = np.setdiff1d(want, values)
            if missing.size:
                found.add("missing", f"shard {k} never delivers {missing.size} of {owed_words} "
                          f"{every_step} (e.g. {missing[:5].tolist()})", shards=[k],
                          steps=range(offset, offset + len(got)), samples=missing)
        if not outside.size and (masks is not None or last_batch == "drop"):
            _repeats_within(k, real, found, offset)
    return reals


# --------------------------------------------------------------------------
# Across a resize: one epoch delivered by several sets of shards
# --------------------------------------------------------------------------


def describe_resized_epoch(delivered, num_samples: int, segments, *, epoch: int, seed: int,
                           shuffle: bool, last_batch: str, masks=None, length: int | None = None,
                           findings: Findings | None = None,
                           partition: str = "contiguous") -> Findings:
    """How one epoch delivered across resizes departs from ``plan.elastic_plan`` and
    from exactly-once over the whole epoch.

    ``segments``: elastic_plan's ``[(t_0, n_0, B_0), (t_1, n_1, B_1), ...]``, the
    shard sets the job ran the epoch on (segment i from global step t_i, the last
    one to the epoch's end). ``delivered``: one entry per segment, segment i's
    decoded indices in either layout of ``describe_epoch`` with n_i shards of B_i
    (one array (steps, n_i, B_i), or n_i per-shard (steps, B_i) arrays): row r is
    global step t_i + r. ``masks``: None (no masks anywhere) or one entry per
    segment in the same layout. ``length``: the epoch's step count the loader
    reports (None: not checked). ``epoch``, ``seed``, ``shuffle`` and ``last_batch``
    are the run's: after a change, which samples remain depends on what the shuffled
    steps before it delivered (partition="any" uses only ``last_batch``).

    Per segment, describe_epoch's per-shard checks, the same kinds and words (a run
    that is not a range of indices is "its run of L samples (...)", and what a
    cut-short shard owes "the L samples the plan gives it"), every text prefixed
    "segment i: ", every step the epoch's global step, every shard named as the
    pair (segment, shard) in the finding's shards:

    * both modes: each shard's arrived batches against the segment's steps (below);
      slots that decode to no sample; shards delivering the same batch at a step; a
      sample in real slots of two shards; padding slots (with masks) holding a sample
      that no real slot of the shard delivers; a sample in more than one real slot of
      one shard (with masks, or with drop; contiguous: of a shard that delivers no
      sample outside its run, as describe_epoch);
    * ``partition="contiguous"``: against ``plans = elastic_plan(N, segments, epoch=,
      seed=, shuffle=, last_batch=)``. Segment i's steps are len(plans[i].indices)
      (d_i); its masks are the plan's; with shuffle off its slots are the plan's
      (a constant shift named as one); its shards deliver no sample outside their
      run (R_i[m*k//n_i : m*(k+1)//n_i], R_i the samples no real slot of plans[0..i-1]
      holds, ascending, m = len(R_i): elastic_plan's text); and once all its batches
      arrived, a shard delivers every sample that the plan's real slots give it in
      the segment's rows (in any order when shuffled), except in the last segment with drop, where which
      samples are skipped is the shuffle's (as describe_epoch);
    * ``partition="any"``: a segment followed by another must run t_{i+1} - t_i
      steps on every shard, the last segment the same number on every shard (its
      longest shard's).

    Two allowances (in both modes), which the plan needs when a segment has fewer
    samples left than shards (elastic_plan: an empty run holds B padding slots
    repeating a sample real in another shard at that step): with masks, a shard
    with no real slot at a step is left out of "same batch on several shards" there,
    and the padding of a shard with no real slot in the segment may hold any sample
    real in the segment (on any shard).

    Over the whole epoch (both modes), each its own kind:

    * "repeated across segments": a sample in real slots of two segments, one
      finding per (earlier segment a, later segment b), naming the global step and
      shard of b where the repeats start and where a had delivered that sample;
    * fill, "missing from the epoch": a sample of range(N) in no real slot of any
      segment;
    * drop, "drop count": the distinct samples in real slots against elastic_plan's
      stated count sum_i n_i * B_i * d_i (d_i = t_{i+1} - t_i, the last one
      elastic_num_steps(N, segments, "drop") - t_last; it depends on N, the
      segments and last_batch only);
    * "step count": ``length`` against elastic_num_steps (contiguous) or the last
      segment's start plus its longest shard's batches (any);
    * any: "outside the dataset", a sample not in range(N) (contiguous: those are
      "outside the shard").

    It cannot see, besides what describe_epoch cannot: which step a batch belongs to
    other than by its row (a segment's blocks as they arrived from its first step);
    whether ``segments`` are the shard sets the job ran on (taken as given); the order
    within a shuffled shard. Without masks every slot counts as real, so a segment
    with an empty run reads as delivering another shard's sample, on that segment
    only (a repeat across segments is still seen).

    Raises ValueError for ``segments`` that elastic_plan refuses (its reason
    quoted), ``delivered`` or ``masks`` without one entry per segment, a segment's
    blocks in neither layout or with another shard count or batch than its
    segment's, or an unknown partition or last_batch.
    """
    where = "describe_resized_epoch"
    _check_mode(where, partition, last_batch)
    try:
        total = elastic_num_steps(num_samples, segments, last_batch)
        plans = elastic_plan(num_samples, segments, epoch=epoch, seed=seed, shuffle=shuffle,
                                     last_batch=last_batch) if partition == "contiguous" else None
    except ValueError as error:
        raise ValueError(f"{where}: segments={segments!r} is not an epoch elastic_plan accepts: "
                         f"{error}") from None
    segments = [Segment(*(int(v) for v in s)) for s in segments]
    for name, value in (("delivered", delivered), ("masks", masks)):
        if value is None and name == "masks":
            continue
        if not isinstance(value, (list, tuple)) or len(value) != len(segments):
            got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
            raise ValueError(f"{where}: {name} must be a list with one entry per segment "
                             f"({len(segments)}), got {got}")
    found = findings if findings is not None else Findings()
    stops = [s.start for s in segments[1:]] + [None]
    blocks, reals = [], []
    for i, ((start, n, B), stop) in enumerate(zip(segments, stops)):
        got, mask = _blocks(delivered[i], None if masks is None else masks[i], B, where,
                            f"delivered[{i}]")
        if len(got) != n:
            raise ValueError(f"{where}: delivered[{i}] has {len(got)} shards; segments[{i}]="
                             f"{tuple(segments[i])} has {n}")
        blocks.append(got)
        if plans is not None:
            steps = len(plans[i].indices)
            what = (f"the plan has {steps} (segment {i}: N={num_samples}, from step {start}, {n} "
                    f"shards of {B}, {last_batch})")
        elif stop is not None:
            steps = stop - start
            what = f"the segment runs {steps} (steps {_span(start, stop)}, until the next segment)"
        else:
            steps = max(len(x) for x in got)
            what = f"the longest shard delivered {steps}"
        runs = owed = None
        if plans is not None:
            runs, owed = _runs(plans, i, num_samples, last_batch == "fill" or stop is not None)
        reals.append(_check_shards(got, mask, _InSegment(found, i), plan=None if plans is None else plans[i],
                                   steps=steps, what=what, runs=runs, owed=owed, shuffle=shuffle,
                                   last_batch=last_batch, offset=start, resized=True))
    end = max(start + max(len(x) for x in got) for (start, _, _), got in zip(segments, blocks))
    if length is not None:
        want = total if plans is not None else end
        what = (f"the resized plan has {want} (N={num_samples}, segments {[tuple(s) for s in segments]}, "
                f"{last_batch})" if plans is not None else f"the last segment's longest shard ends at "
                f"step {want}")
        if length != want:
            found.add("step count", f"the loader reports {length} steps for the epoch; {what}; steps "
                      f"{_span(min(length, want), max(length, want))}",
                      shards=[(i, k) for i, s in enumerate(segments) for k in range(s.num_shards)],
                      steps=range(min(length, want), max(length, want)))
    _across_segments(reals, segments, num_samples, last_batch, partition, total, end, found)
    return found


class _InSegment:
    """Findings.add for segment i: the text prefixed, shards as (segment, shard)."""

    def __init__(self, found: Findings, segment: int):
        self.found, self.segment = found, segment

    def add(self, kind: str, text: str, *, shards=(), steps=(), samples=()) -> None:
        self.found.add(kind, f"segment {self.segment}: {text}", shards=[(self.segment, k) for k in shards],
                       steps=steps, samples=samples)


def _runs(plans: list, i: int, num_samples: int, owes: bool) -> tuple[list, list | None]:
    """Per shard of segment i: (its run of elastic_plan's pool R_i, words), and (the samples
    of its real slots in plans[i], words) when ``owes``."""
    taken = np.zeros(num_samples, bool)
    for plan in plans[:i]:
        taken[plan.indices[plan.mask]] = True
    pool = np.flatnonzero(~taken)
    m, (_, n, _) = len(pool), plans[i].indices.shape
    runs, owed = [], []
    for k in range(n):
        run = pool[m * k // n:m * (k + 1) // n]
        if not run.size:
            words = f"its run (empty: {m} samples left for {n} shards)"
        elif run[-1] - run[0] == len(run) - 1:
            words = f"its range [{run[0]}, {run[-1] + 1})"  # describe_epoch's words for a shard
        else:
            words = f"its run of {len(run)} samples ({_few(run)})"
        runs.append((run, words))
        plan = plans[i]
        want = np.unique(plan.indices[:, k][plan.mask[:, k]])
        owed.append((want, f"its {len(want)} samples" if np.array_equal(want, run)
                     else f"the {len(want)} samples the plan gives it"))
    return runs, owed if owes else None


def _few(samples: np.ndarray) -> str:
    return ", ".join(map(str, samples[:5].tolist())) + (", ..." if len(samples) > 5 else "")


def _across_segments(reals: list, segments: list, num_samples: int, last_batch: str, partition: str,
                     total: int, end: int, found: Findings) -> None:
    """describe_resized_epoch's checks over the whole epoch, from each segment's real slots."""
    rows = [np.zeros((0, 4), np.int64)]  # (sample, segment, global step, shard) of every real slot
    for i, shards in enumerate(reals):
        for k, real in enumerate(shards):
            s, b = np.nonzero(real >= 0)
            rows.append(np.stack([real[s, b], np.full(len(s), i), s + segments[i].start,
                                  np.full(len(s), k)], axis=1).astype(np.int64))
    table = np.concatenate(rows)
    everyone = [(i, k) for i, s in enumerate(segments) for k in range(s.num_shards)]
    if partition == "any":
        outside = table[table[:, 0] >= num_samples]
        if len(outside):
            x, i, s, k = outside[np.lexsort((outside[:, 3], outside[:, 2]))][0]
            found.add("outside the dataset", f"{np.unique(outside[:, 0]).size} delivered samples are not in "
                      f"range({num_samples}) (e.g. {np.unique(outside[:, 0])[:5].tolist()}; first: sample "
                      f"{x} at step {s} on shard {k} of segment {i})",
                      shards={(int(a), int(c)) for a, c in outside[:, [1, 3]]}, steps=outside[:, 2],
                      samples=outside[:, 0])
    inside = table[table[:, 0] < num_samples]
    first = np.full(num_samples, len(segments))
    np.minimum.at(first, inside[:, 0], inside[:, 1])
    again = inside[inside[:, 1] > first[inside[:, 0]]]
    for a, b in sorted({(int(first[x]), int(i)) for x, i in again[:, :2]}):
        here = again[(first[again[:, 0]] == a) & (again[:, 1] == b)]
        samples = np.unique(here[:, 0])
        x, _, s, k = here[np.lexsort((here[:, 3], here[:, 2]))][0]
        there = inside[(inside[:, 1] == a) & np.isin(inside[:, 0], samples)]
        _, _, s_a, k_a = there[(there[:, 0] == x)][0]
        found.add("repeated across segments", f"segment {b} delivers {samples.size} samples that segment "
                  f"{a} had delivered in real slots (e.g. {samples[:5].tolist()}); the repeats start at "
                  f"step {s} on shard {k} of segment {b} (sample {x}, delivered at step {s_a} on shard "
                  f"{k_a} of segment {a})",
                  shards={(a, int(c)) for c in there[:, 3]} | {(b, int(c)) for c in here[:, 3]},
                  steps=np.union1d(there[:, 2], here[:, 2]), samples=samples)
    delivered = np.unique(inside[:, 0])
    if last_batch == "fill":
        missing = np.setdiff1d(np.arange(num_samples), delivered)
        if missing.size:
            found.add("missing from the epoch", f"{missing.size} of the {num_samples} samples are never "
                      f"delivered in a real slot of any segment, in any of steps {_span(0, end)} (e.g. "
                      f"{missing[:5].tolist()})", shards=everyone, steps=range(end), samples=missing)
        return
    steps = [b.start - a.start for a, b in zip(segments, segments[1:])] + [total - segments[-1].start]
    stated = sum(n * B * d for (_, n, B), d in zip(segments, steps))
    if delivered.size != stated:
        terms = " + ".join(f"{n}*{B}*{d}" for (_, n, B), d in zip(segments, steps))
        found.add("drop count", f"the epoch delivers {delivered.size} distinct samples in real slots; "
                  f"elastic_plan states {stated} ({terms}: n*B*steps of each segment), skipping "
                  f"{num_samples - stated} of the {num_samples}", shards=everyone, steps=range(end))


# --------------------------------------------------------------------------
# Across epochs: does the order follow the epoch?
# --------------------------------------------------------------------------


CHANCE = 1e-6  # describe_epochs flags a repeated shuffled order only when chance makes it rarer


def describe_epochs(epochs, batch_size: int, *, shuffle: bool,
                    findings: Findings | None = None) -> Findings:
    """How several epochs of one loader relate: whether its order follows the epoch.

    ``epochs``: the decoded indices of two or more reads of one loader (same
    arguments), a dict ``{epoch: delivered}`` or a sequence of ``(epoch,
    delivered)`` pairs, where an epoch may come twice (two reads of one epoch);
    each ``delivered`` in either layout of ``describe_epoch``. A shard's read is
    compared with another as a sequence of slots, step by step and slot by slot,
    padding included; slots that one read has and the other lacks count as
    different.

    * Two reads of one epoch must hold the same sample in every slot ("epoch read
      twice"): an epoch is a function of the loader's arguments, not of what was
      read before.
    * shuffle off: every epoch must hold the lowest epoch's samples in every slot
      ("order changes with the epoch").
    * shuffle on: for each pair of different epochs (a, b), the shards whose
      sequences are identical in a and b are one finding ("same order in two
      epochs") when a uniform shuffle would repeat all of them with probability
      below ``CHANCE``, that is when the product over those shards of 1/L_k! is
      below it, L_k the number of distinct samples shard k delivers in epoch a
      (an upper bound of the chance with drop, which keeps a subset). So a
      loader that ignores the epoch is caught when its shards are large enough
      (one shard of 10 samples: 1/10! = 2.8e-7; four of 6: 1/720**4); 8 shards
      of 2 samples repeat by chance with probability 1/256 and are not flagged.

    Every finding names the shard(s), the two epochs and the step(s) where the
    reads differ (or, for a repeat, all its steps). Raises ValueError for fewer
    than two reads, reads with different shard counts, or a read in neither
    layout.
    """
    pairs = list(epochs.items()) if isinstance(epochs, dict) else list(epochs)
    if len(pairs) < 2:
        raise ValueError(f"describe_epochs: needs two or more reads (epoch, delivered), got {len(pairs)}")
    reads = []
    for epoch, delivered in pairs:
        reads.append((int(epoch), _per_shard(delivered, batch_size, f"epochs[{epoch}]", np.integer,
                                             "describe_epochs")))
    n = len(reads[0][1])
    for epoch, shards in reads:
        if len(shards) != n:
            raise ValueError(f"describe_epochs: epoch {epoch} has {len(shards)} shards, epoch "
                             f"{reads[0][0]} has {n}; all reads must come from one loader")
    found = findings if findings is not None else Findings()
    first = {}
    for epoch, shards in reads:
        if epoch not in first:
            first[epoch] = shards
            continue
        for k in range(n):
            differ = _slot_difference(first[epoch][k], shards[k])
            if differ:
                count, total, (s, j), (x, y), steps = differ
                found.add("epoch read twice", f"shard {k}: two reads of epoch {epoch} differ in {count} "
                          f"of {total} slots (first: step {s} slot {j}, sample {x}, then {y}): the epoch "
                          f"depends on what was read before", shards=[k], steps=steps)
    numbers = sorted(first)
    if not shuffle:
        base = numbers[0]
        for epoch in numbers[1:]:
            for k in range(n):
                differ = _slot_difference(first[base][k], first[epoch][k])
                if differ:
                    count, total, (s, j), (x, y), steps = differ
                    found.add("order changes with the epoch", f"shard {k}: epoch {epoch} differs from "
                              f"epoch {base} in {count} of {total} slots (first: step {s} slot {j}, sample "
                              f"{x} in epoch {base}, {y} in epoch {epoch}); without shuffle every epoch is "
                              f"the same", shards=[k], steps=steps)
        return found
    for i, a in enumerate(numbers):
        for b in numbers[i + 1:]:
            same = [k for k in range(n) if not _slot_difference(first[a][k], first[b][k])]
            if not same:
                continue
            log_chance = -sum(math.lgamma(np.unique(first[a][k]).size + 1) for k in same)
            if log_chance >= math.log(CHANCE):
                continue
            steps = max(len(first[a][k]) for k in same)
            who = f"shard {same[0]} delivers" if len(same) == 1 else f"shards {same} deliver"
            found.add("same order in two epochs", f"{who} the same samples in the same slots in epochs "
                      f"{a} and {b} (steps {_span(0, steps)}): the shuffle ignores the epoch (a uniform "
                      f"shuffle repeats this with probability {math.exp(log_chance):.1e})",
                      shards=same, steps=range(steps))
    return found


def _slot_difference(x: np.ndarray, y: np.ndarray):
    """None when two reads (steps, B) of one shard hold the same sample in every slot;
    else (differing slots, slots in the longer read, first (step, slot), its two
    samples (-1 where a read lacks the slot), the differing steps)."""
    B = x.shape[1]
    a, b = x.ravel(), y.ravel()
    total = max(len(a), len(b))
    common = min(len(a), len(b))
    wrong = np.concatenate([np.flatnonzero(a[:common] != b[:common]), np.arange(common, total)])
    if not wrong.size:
        return None
    j = int(wrong[0])
    pick = lambda v: int(v[j]) if j < len(v) else -1
    return wrong.size, total, divmod(j, B), (pick(a), pick(b)), np.unique(wrong // B)


# --------------------------------------------------------------------------
# Values by index: does each slot hold its own sample's labels (any key)?
# --------------------------------------------------------------------------


SHIFTS = 4  # describe_values names a shift of up to this many samples or slots


def describe_values(delivered, values, reference, *, name: str = "labels",
                    findings: Findings | None = None) -> Findings:
    """Whether every delivered slot holds its own sample's value of one key.

    ``delivered``: the decoded indices, in either layout of ``describe_epoch``.
    ``values``: what the loader delivered for the key ``name``, in the same layout
    with the per-sample axes after the slot axes: one array (steps, n, B, ...)
    or n per-shard arrays (steps, B, ...) (``shard_blocks`` of each global batch,
    stacked). ``reference``: the dataset's array of that key, (N, ...).

    Any key, any per-sample shape and dtype: integer labels (N,), per-token
    targets (N, 48), float targets, unnormalised samples; for a dataset that is
    a dict of named arrays, call it once per key. For every slot (s, b)
    of shard k whose index i = delivered[k][s, b] lies in range(N) (padding
    slots included: they repeat a real sample; -1 and other indices outside
    range(N) are ``describe_epoch``'s findings), values[k][s, b] must equal
    reference[i]: the same bits when the dtypes agree (so -0.0 differs from 0.0,
    and a NaN matches its own bits), the same number when they differ (int32
    labels from int64 data; a float32 target from float64 data must be exact).

    Findings, one per shard: "{name} shape" when the per-sample shape is not
    reference's (then nothing else is compared on that shard); "{name}" for slots
    holding another value, naming how many, the first step and slot and, when
    every wrong slot holds the value of the sample d indices away in the dataset
    (reference[(i + d) mod N], 0 < |d| <= SHIFTS) or, each that has one, the
    value of the sample d slots away in the shard's stream of slots (at most |d|
    without one, at the stream's edge), that shift in words. Raises ValueError when
    ``values`` does not match ``delivered`` in shards, steps or B, or
    ``reference`` has no leading N axis.
    """
    reference = np.asarray(reference)
    if reference.ndim < 1 or not len(reference):
        raise ValueError(f"describe_values: reference must be the dataset's {name!r} array (N, ...), "
                         f"got shape {reference.shape}")
    delivered = _per_shard(delivered, _batch_of(delivered), "delivered", np.integer, "describe_values")
    B = delivered[0].shape[1]
    values = _per_shard(values, B, name, None, "describe_values", sample_dims=True)
    if len(values) != len(delivered):
        raise ValueError(f"describe_values: {name} has {len(values)} shards, delivered {len(delivered)}")
    found = findings if findings is not None else Findings()
    N, sample = len(reference), reference.shape[1:]
    for k, (got, value) in enumerate(zip(delivered, values)):
        if value.shape[0] != got.shape[0]:
            raise ValueError(f"describe_values: {name}[{k}] covers {value.shape[0]} batches, delivered "
                             f"has {got.shape[0]}")
        if value.shape[2:] != sample:
            found.add(f"{name} shape", f"shard {k}: {name} arrive as {value.dtype} {value.shape[2:]} per "
                      f"sample; the dataset's are {reference.dtype} {sample}", shards=[k],
                      steps=range(len(got)))
            continue
        flat_i, flat_v = got.ravel(), value.reshape((-1,) + sample)
        known = np.flatnonzero((flat_i >= 0) & (flat_i < N))
        bad = known[~_same_values(flat_v[known], reference[flat_i[known]])]
        if not bad.size:
            continue
        s, j = divmod(int(bad[0]), B)
        first = int(flat_i[bad[0]])
        detail = ""
        if not sample:
            detail = f" with {name} {flat_v[bad[0]].tolist()}, the dataset's is {reference[first].tolist()}"
        found.add(name, f"shard {k}: {bad.size} of {known.size} slots hold {name} that are not their "
                  f"sample's (first: step {s} slot {j} holds sample {first}{detail})"
                  f"{_shift(flat_i, flat_v, bad, reference, name)}", shards=[k],
                  steps=np.unique(bad // B), samples=flat_i[bad])
    return found


def _batch_of(delivered) -> int:
    """B of describe_epoch's layouts, read from the value (for describe_values)."""
    if isinstance(delivered, np.ndarray) and delivered.ndim == 3:
        return delivered.shape[2]
    if isinstance(delivered, (list, tuple)) and delivered:
        first = np.asarray(delivered[0])
        if first.ndim == 2:
            return first.shape[1]
    raise ValueError(f"describe_values: delivered must be an array (steps, n, B) or a non-empty list "
                     f"of per-shard (steps, B) arrays, got {type(delivered).__name__}")


def _same_values(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """(M,) bool: row m of ``got`` equals row m of ``want``: bits when the dtypes agree,
    numbers when they differ."""
    M = len(got)
    if not M:
        return np.zeros(0, bool)
    if got.dtype == want.dtype:
        a = np.ascontiguousarray(got).reshape(M, -1).view(np.uint8)
        b = np.ascontiguousarray(want).reshape(M, -1).view(np.uint8)
        return np.all(a == b, axis=1)
    return np.all(np.equal(got, want).reshape(M, -1), axis=1)


def _shift(flat_i: np.ndarray, flat_v: np.ndarray, bad: np.ndarray, reference: np.ndarray,
           name: str) -> str:
    """The words for a constant shift that explains every wrong slot, or ""."""
    N = len(reference)
    for d in [d for m in range(1, SHIFTS + 1) for d in (m, -m)]:
        if _same_values(flat_v[bad], reference[(flat_i[bad] + d) % N]).all():
            return (f"; every one holds the {name} of sample i{d:+d} (mod {N}), i its own index: "
                    f"{name} shifted by {d:+d} sample(s)")
    for d in [d for m in range(1, SHIFTS + 1) for d in (m, -m)]:
        at = bad + d  # the wrong slots with a neighbour d places away that decodes
        has = (at >= 0) & (at < len(flat_i))
        has[has] = (flat_i[at[has]] >= 0) & (flat_i[at[has]] < N)
        if (~has).sum() <= abs(d) and has.any() \
                and _same_values(flat_v[bad[has]], reference[flat_i[at[has]]]).all():
            where = f"{abs(d)} slot(s) {'later' if d > 0 else 'earlier'}"
            return (f"; every one holds the {name} of the sample {where} in the shard's stream (where "
                    f"there is one): {name} shifted by {d:+d} slot(s)")
    return ""


def _per_shard(value, batch_size: int, name: str, kind, where: str = "describe_epoch",
               sample_dims: bool = False) -> list:
    """``value`` (one array (steps, n, B), or a list of per-shard (steps, B) arrays; with
    ``sample_dims``, (steps, n, B, ...) / (steps, B, ...)) as a list of per-shard arrays;
    ValueError naming ``where``, ``name`` and the layout otherwise. ``kind``: the dtype
    family the values must belong to, or None for any."""
    more = ", ..." if sample_dims else ""
    if isinstance(value, np.ndarray):
        if value.ndim < 3 or (value.ndim != 3 and not sample_dims) or value.shape[2] != batch_size:
            raise ValueError(f"{where}: {name} as one array must be (steps, n, B{more}) like "
                             f"Plan.indices with B = batch_size = {batch_size}, got shape {value.shape}; "
                             f"a list holds one (steps, B{more}) array per shard")
        value = [value[:, k] for k in range(value.shape[1])]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{where}: {name} must be an array (steps, n, B{more}) or a non-empty list "
                         f"of per-shard (steps, B{more}) arrays, got {type(value).__name__}")
    out = []
    for k, x in enumerate(value):
        x = np.asarray(x)
        if x.size == 0 and x.ndim < 2:
            x = x.reshape(0, batch_size)  # a shard that delivered nothing
        if x.ndim < 2 or (x.ndim != 2 and not sample_dims) or x.shape[1] != batch_size:
            raise ValueError(f"{where}: {name}[{k}] must be (steps, B{more}) with B = batch_size = "
                             f"{batch_size}, got shape {x.shape}")
        if kind is not None and not np.issubdtype(x.dtype, kind):
            raise ValueError(f"{where}: {name}[{k}] must hold "
                             f"{np.dtype(kind).name if kind is np.bool_ else 'integer'} values, got dtype "
                             f"{x.dtype}")
        out.append(x)
    return out


def _steps_of(got: np.ndarray, samples, where: np.ndarray | None = None) -> np.ndarray:
    """The steps (ascending) at which ``got`` holds any of ``samples`` (where ``where``)."""
    hit = np.isin(got, np.asarray(list(samples) if isinstance(samples, set) else samples))
    if where is not None:
        hit &= where
    return np.unique(np.argwhere(hit)[:, 0])


def _span(first: int, stop: int) -> str:
    return f"{first}" if stop - first <= 1 else f"{first}-{stop - 1}"


def _exactly_once(reals: list, num_samples: int, last_batch: str, every_step: str, found) -> None:
    """partition="any": no sample outside range(N); fill: every sample of range(N) in a real
    slot of some shard (repeats are _overlap's and _repeats_within's)."""
    values = np.concatenate([r[r >= 0].ravel() for r in reals]) if reals else np.zeros(0, np.int64)
    outside = np.unique(values[values >= num_samples])
    if outside.size:
        shards = [k for k, r in enumerate(reals) if np.isin(r, outside).any()]
        steps = np.unique(np.concatenate([_steps_of(reals[k], outside) for k in shards]))
        found.add("outside the dataset", f"{outside.size} delivered samples are not in range({num_samples}) "
                  f"(e.g. {outside[:5].tolist()}; first at step {steps[0]})", shards=shards, steps=steps,
                  samples=outside)
    counts = np.bincount(values[values < num_samples], minlength=num_samples)
    if last_batch == "fill":
        missing = np.flatnonzero(counts == 0)
        if missing.size:
            found.add("missing", f"{missing.size} of the {num_samples} samples are never delivered in a "
                      f"real slot of any shard, {every_step} (e.g. {missing[:5].tolist()})",
                      shards=range(len(reals)), steps=range(max(len(r) for r in reals)), samples=missing)


def _repeats_within(k: int, real: np.ndarray, found, offset: int = 0) -> None:
    """Samples that shard k's real slots (-1 elsewhere) deliver more than once."""
    values = real[real >= 0]
    if not values.size:
        return
    samples, counts = np.unique(values, return_counts=True)
    twice = samples[counts > 1]
    if twice.size:
        steps = _steps_of(real, twice) + offset
        found.add("repeated", f"shard {k} delivers {twice.size} samples more than once in real "
                  f"slots (e.g. {twice[:5].tolist()}; at steps {steps[:5].tolist()})", shards=[k],
                  steps=steps, samples=twice)


def _same_batches(delivered: list, found, offset: int = 0, reals: list | None = None) -> None:
    """Groups of shards that deliver the same samples at the same step; with ``reals``,
    shards whose batch there has no real slot are left out."""
    n = len(delivered)
    steps = min(len(d) for d in delivered) if delivered else 0
    for s in range(steps):
        groups = defaultdict(list)
        for k in range(n):
            if reals is None or (reals[k][s] >= 0).any():
                groups[tuple(np.sort(delivered[k][s]))].append(k)
        for key, shards in groups.items():
            if len(shards) > 1:
                found.add("same batch on several shards", f"step {offset + s}: shards {shards} deliver "
                          f"the same {len(key)} samples", shards=shards, steps=[offset + s], samples=key)


def _overlap(reals: list, found, offset: int = 0) -> None:
    """Samples that the real slots of two shards both deliver, with the steps where they sit."""
    owner = {}
    shared = defaultdict(set)
    for k, real in enumerate(reals):
        for sample in np.unique(real[real >= 0]).tolist():
            if sample in owner and owner[sample] != k:
                shared[(owner[sample], k)].add(sample)
            owner.setdefault(sample, k)
    for (a, b), samples in shared.items():
        first = min(samples)
        at_a, at_b = _steps_of(reals[a], [first])[0] + offset, _steps_of(reals[b], [first])[0] + offset
        steps = np.union1d(_steps_of(reals[a], samples), _steps_of(reals[b], samples)) + offset
        found.add("samples on two shards", f"shards {a} and {b} both deliver {len(samples)} samples "
                  f"(e.g. {sorted(samples)[:5]}; sample {first} at step {at_a} of shard {a} and step "
                  f"{at_b} of shard {b})", shards=[a, b], steps=steps, samples=list(samples))


def _order(k: int, got: np.ndarray, want: np.ndarray, found, offset: int = 0) -> None:
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
            found.add("order", f"shard {k} is shifted by {shift} slots against the plan from step "
                      f"{offset + wrong[0] // B} (it starts with sample {first}, the plan with "
                      f"{flat_want[0]})", shards=[k], steps=wrong // B + offset, samples=[first])
            return
    s, j = divmod(int(wrong[0]), B)
    found.add("order", f"shard {k} step {offset + s} slot {j}: sample {flat_got[wrong[0]]}, the plan says "
              f"{flat_want[wrong[0]]} ({len(wrong)} of {len(flat_want)} slots differ)",
              shards=[k], steps=wrong // B + offset, samples=flat_got[wrong])


def describe_content(images_BCHW, labels_B, indices_B, ref_images, ref_labels,
                     normalize: Normalize) -> list[str]:
    """Labels and pixels of one delivered batch against the file and the table, in words.

    ``images_BCHW``: one shard's block, normalised float32; ``indices_B`` its decoded
    indices (slots with -1 are skipped). Pixels must equal ``normalize`` (the
    vendor's table) of the file's images bit for bit; a batch that equals the
    mirrored images, or differs by ulps only, is named so. Labels (integers, one
    per sample) must equal the file's by value; for labels of any other shape or
    dtype, or any other key, use ``describe_values``."""
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
