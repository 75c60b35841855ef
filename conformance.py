"""How a loader's epochs depart from plan.py's plan, or from "every sample exactly once", in words.

Feed a loader samples that encode their index (``encoding.encoded_images``), cut each global batch into per-shard blocks
(``shard_blocks``), decode them (``encoding.decode_indices``) and pass the indices to a describer: ``describe_epoch``
(one epoch against ``plan.epoch_plan``, or exactly once), ``describe_resized_epoch`` (over ``plan.elastic_plan``'s
segments), ``describe_epochs`` (several reads), ``describe_values`` (a key's values, bit for bit) or
``describe_content`` (normalised images and labels). Each returns ``Findings`` (or adds to ``findings``): a summary line
per kind of deviation, then up to ``EXAMPLES`` examples naming shard(s) and step(s); "" if none.

Not seen: content that still decodes (but see describe_values, describe_content); padding, without masks; the order,
with shuffle; epochs or processes not given; which device holds a block (decode each of ``addressable_shards``); speed.

Imports plan.py, arithmetic.py and NumPy, no JAX. Copy it with those two, and encoding.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import numpy as np

from arithmetic import Normalize
from plan import LAST_BATCH_POLICIES, elastic_plan, epoch_plan

EXAMPLES = 3  # examples per kind of deviation in a report
LAYOUTS = ("sharded", "pmap")  # a batch's two shapes, (n*B, ...) and (n, B, ...): loaders.LAYOUTS
PARTITIONS = ("contiguous", "any")
CHANCE = 1e-6  # describe_epochs flags a repeated shuffled order only when it is rarer than this
SHIFTS = 4  # describe_values names a shift of up to this many samples or slots


def shard_blocks(array, num_shards: int, layout: str = "sharded") -> np.ndarray:
    """A global batch as per-shard blocks (n, B, ...): block k is mesh position k's. ``array``: NumPy or a fully
    addressable jax.Array, (n*B, ...) for layout "sharded" (``make_loader``'s, jit's) or (n, B, ...) for "pmap".
    ValueError for a bad ``num_shards`` or ``layout``, or a leading axis that does not fit them."""
    _check_args("shard_blocks", num_shards=(num_shards, 1))
    if layout not in LAYOUTS:
        raise ValueError(f"shard_blocks: layout must be one of {LAYOUTS}, got {layout!r}")
    x = np.asarray(array)
    if layout == "pmap":
        if x.ndim < 2 or x.shape[0] != num_shards:
            raise ValueError(f"shard_blocks: a 'pmap' batch must be (n, B, ...) with n = num_shards = "
                             f"{num_shards}, got shape {x.shape}")
        return x
    if x.ndim < 1 or x.shape[0] % num_shards:
        raise ValueError(f"shard_blocks: a 'sharded' batch must be (n*B, ...) with n = num_shards = "
                         f"{num_shards}, got shape {x.shape}")
    return x.reshape((num_shards, -1) + x.shape[1:])


@dataclasses.dataclass
class Findings:
    """Deviations by kind: ``kinds[kind]`` lists (text, shards, steps, samples), each a set; describe_resized_epoch's
    shards are (segment, shard) pairs, its steps the epoch's."""
    kinds: dict = dataclasses.field(default_factory=lambda: defaultdict(list))

    def add(self, kind: str, text: str, *, shards=(), steps=(), samples=()) -> None:
        self.kinds[kind].append((text, set(shards), set(steps), set(np.asarray(samples).ravel().tolist())))

    def __bool__(self) -> bool:
        return bool(self.kinds)

    def report(self, header: str = "") -> str:
        if not self.kinds:
            return ""
        lines = ([header] if header else []) + [f"{len(self.kinds)} kind(s) of deviation:"]
        for kind, items in self.kinds.items():
            shards, steps, samples = (set().union(*(item[i] for item in items)) for i in (1, 2, 3))
            lines.append(f"- {kind}: {len(items)} finding(s), {len(shards)} shard(s), "
                         f"{len(steps)} step(s), {len(samples)} sample(s)")
        for kind, items in self.kinds.items():
            lines.append(f"{kind}, e.g.:")
            lines += [f"    {text}" for text, *_ in items[:EXAMPLES]]
            if len(items) > EXAMPLES:
                lines.append(f"    ... and {len(items) - EXAMPLES} more")
        return "\n".join(lines)


# One epoch -------------------------------------------------------------------
def describe_epoch(delivered, num_samples: int, batch_size: int, *, shuffle: bool, last_batch: str, length: int,
                   masks=None, findings: Findings | None = None, partition: str = "contiguous") -> Findings:
    """How one epoch departs from ``epoch_plan(num_samples, n, batch_size)`` or from exactly once.

    ``delivered``: decoded indices (-1: decodes to nothing), an int array (steps, n, B) like ``Plan.indices`` or a list
    of n per-shard (steps, B) arrays as they arrived. ``masks``: the loader's, same layout, or None (every slot real).
    ``length``: the loader's step count.

    Both partitions check the step counts (reported, arrived); undecodable slots; one batch on several shards; a sample
    in real slots of two shards; padding (with masks) holding a sample no real slot of its shard delivers. "contiguous"
    (the plan) adds the masks, the order without shuffle (a shift of up to 4 batches is one finding) and the shard's own
    samples; "any" adds range(N). Fill: every owed sample once in real slots; drop: at most once. Without masks, with
    fill, a repeat within a shard may be padding and is not flagged.

    Raises ValueError for input in neither layout, masks that do not match it, a bad num_samples, batch_size or length,
    or an unknown partition or last_batch."""
    _check_args("describe_epoch", partition, last_batch, num_samples=(num_samples, 0),
                batch_size=(batch_size, 1), length=(length, 0))
    delivered, masks = _blocks(delivered, masks, batch_size, "describe_epoch")
    found = findings if findings is not None else Findings()
    n, longest = len(delivered), max(len(got) for got in delivered)
    if partition == "contiguous":
        plan = epoch_plan(num_samples, n, batch_size, last_batch=last_batch)
        steps = plan.indices.shape[0]
        what = f"the plan has {steps} (N={num_samples}, {n} shards, batch {batch_size}, {last_batch})"
        runs, owed = _runs([plan], 0, num_samples, last_batch == "fill")
    else:
        plan, steps, runs, owed = None, longest, None, None
        what = f"the longest shard delivered {steps}"
    if length != steps:
        lo, hi = min(length, steps), max(length, steps)
        found.add("step count", f"the loader reports {length} steps per epoch; {what}; steps {_span(lo, hi)}",
                  shards=range(n), steps=range(lo, hi))
    reals = _check_shards(delivered, masks, found, plan=plan, steps=steps, what=what, runs=runs,
                          owed=owed, shuffle=shuffle, last_batch=last_batch)
    if plan is None:
        _exactly_once(_table([reals], [0]), num_samples, last_batch, longest, range(n), found)
    return found


def _check_args(where: str, partition: str = "any", last_batch: str = "fill", **ints) -> None:
    """partition and last_batch known, and each of ``ints`` (name=(value, minimum)) an int."""
    if partition not in PARTITIONS:
        raise ValueError(f"{where}: partition must be one of {PARTITIONS}, got {partition!r}")
    if last_batch not in LAST_BATCH_POLICIES:
        raise ValueError(f"{where}: last_batch must be one of {LAST_BATCH_POLICIES}, got {last_batch!r}")
    for name, (value, least) in ints.items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) or value < least:
            raise ValueError(f"{where}: {name} must be an int >= {least}, got {value!r}")


def _blocks(delivered, masks, batch_size: int, where: str, name: str = "delivered") -> tuple[list, list]:
    """(delivered, masks or None) as validated per-shard lists, masks cut to the batches that arrived."""
    delivered = _per_shard(delivered, batch_size, name, np.integer, where)
    if masks is None:
        return delivered, None
    masks = _per_shard(masks, batch_size, name.replace("delivered", "masks"), np.bool_, where)
    if len(masks) != len(delivered):
        raise ValueError(f"{where}: masks has {len(masks)} shards, delivered {len(delivered)}")
    for k, (got, mask) in enumerate(zip(delivered, masks)):
        if len(mask) < len(got):
            raise ValueError(f"{where}: masks of shard {k} cover {len(mask)} batches, delivered has {len(got)}")
    return delivered, [mask[:len(got)] for got, mask in zip(delivered, masks)]


def _per_shard(value, batch_size: int | None, name: str, kind, where: str, sample_dims: bool = False) -> list:
    """``value`` (an array (steps, n, B) or a list of (steps, B) arrays; with ``sample_dims``, per-sample axes after
    those) as per-shard arrays of dtype family ``kind`` (None: any). ``batch_size`` None: any B."""
    more = ", ..." if sample_dims else ""
    if batch_size is None:  # B read from the value
        first = value[0] if isinstance(value, (list, tuple)) and value else None
        if not (isinstance(value, np.ndarray) and value.ndim == 3 or np.ndim(first) == 2):
            raise ValueError(f"{where}: {name} must be an array (steps, n, B) or a non-empty list of "
                             f"per-shard (steps, B) arrays, got {type(value).__name__}")
        batch_size = np.shape(value)[2] if first is None else np.shape(first)[1]
    if isinstance(value, np.ndarray):
        if value.ndim < 3 or (value.ndim != 3 and not sample_dims) or value.shape[2] != batch_size:
            raise ValueError(f"{where}: {name} as one array must be (steps, n, B{more}) like Plan.indices with "
                             f"B = batch_size = {batch_size}, got shape {value.shape}; a list holds one "
                             f"(steps, B{more}) array per shard")
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
            raise ValueError(f"{where}: {name}[{k}] must hold {'bool' if kind is np.bool_ else 'integer'} "
                             f"values, got dtype {x.dtype}")
        out.append(x)
    return out


def _check_shards(delivered: list, masks, found, *, plan, steps: int, what: str, runs, owed,
                  shuffle: bool, last_batch: str, offset: int = 0, resized: bool = False) -> list:
    """describe_epoch's per-shard checks; returns the real slots (-1 elsewhere). Row r is step ``offset + r``; ``plan``
    None is "any"; ``what`` says why ``steps``; ``resized`` allows empty runs."""
    reals = [got if masks is None else np.where(masks[k], got, -1) for k, got in enumerate(delivered)]
    head = what.split(" (")[0]
    for k, got in enumerate(delivered):
        if len(got) != steps:
            lo, hi = offset + min(len(got), steps), offset + max(len(got), steps)
            found.add("batches arrived", f"shard {k}: {len(got)} batches arrived, {head}; steps {_span(lo, hi)}",
                      shards=[k], steps=range(lo, hi))
        bad = np.argwhere(got < 0)
        if bad.size:
            found.add("undecodable slots", f"shard {k}: {len(bad)} slots hold no encoded sample (first: "
                      f"step {offset + bad[0][0]} slot {bad[0][1]})", shards=[k], steps=bad[:, 0] + offset)
    _same_batches(delivered, found, offset, reals if resized and masks is not None else None)
    _overlap(reals, found, offset)
    every_step = f"in any of steps {_span(offset, offset + max(len(got) for got in delivered))}"
    stretch = np.concatenate([r[r >= 0].ravel() for r in reals])
    for k, (got, real) in enumerate(zip(delivered, reals)):
        values = real[real >= 0]
        if masks is not None:
            if plan is not None:
                want_mask = plan.mask[:len(got), k]
                wrong = np.argwhere(masks[k][:len(want_mask)] != want_mask)
                if wrong.size:
                    found.add("mask", f"shard {k}: the mask differs from the plan's in {len(wrong)} slots (first: step "
                              f"{offset + wrong[0][0]} slot {wrong[0][1]})", shards=[k], steps=wrong[:, 0] + offset)
            padding = got[~masks[k] & (got >= 0)]
            # resized: an empty run's padding repeats a sample real on another shard
            stray = np.setdiff1d(padding, stretch if resized and not values.size else values)
            if stray.size:
                at = _steps_of(got, stray, ~masks[k]) + offset
                found.add("padding", f"shard {k}: {stray.size} padding slots hold samples that no real slot of "
                          f"the shard delivers (e.g. {stray[:5].tolist()}; first at step {at[0]})", shards=[k],
                          steps=at, samples=stray)
        outside = ()
        if plan is not None:
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
                    found.add("missing", f"shard {k} never delivers {missing.size} of {owed_words} {every_step} "
                              f"(e.g. {missing[:5].tolist()})", shards=[k], steps=range(offset, offset + len(got)),
                              samples=missing)
        # without masks, with fill, a repeat may be padding; a sample from outside is named already
        samples, counts = np.unique(values, return_counts=True)
        twice = samples[counts > 1]
        if twice.size and not len(outside) and (masks is not None or last_batch == "drop"):
            at = _steps_of(real, twice) + offset
            found.add("repeated", f"shard {k} delivers {twice.size} samples more than once in real slots (e.g. "
                      f"{twice[:5].tolist()}; at steps {at[:5].tolist()})", shards=[k], steps=at, samples=twice)
    return reals


def _steps_of(got: np.ndarray, samples, where: np.ndarray | None = None) -> np.ndarray:
    hit = np.isin(got, samples)
    if where is not None:
        hit &= where
    return np.unique(np.argwhere(hit)[:, 0])


def _span(first: int, stop: int) -> str:
    return f"{first}" if stop - first <= 1 else f"{first}-{stop - 1}"


def _same_batches(delivered: list, found, offset: int, reals: list | None) -> None:
    """Shards that deliver the same samples at a step; with ``reals``, batches with no real slot are left out."""
    for s in range(min(len(d) for d in delivered)):
        groups = defaultdict(list)
        for k, got in enumerate(delivered):
            if reals is None or (reals[k][s] >= 0).any():
                groups[tuple(np.sort(got[s]))].append(k)
        for key, shards in groups.items():
            if len(shards) > 1:
                found.add("same batch on several shards", f"step {offset + s}: shards {shards} deliver the same "
                          f"{len(key)} samples", shards=shards, steps=[offset + s], samples=key)


def _overlap(reals: list, found, offset: int) -> None:
    owner, shared = {}, defaultdict(list)
    for k, real in enumerate(reals):
        for sample in np.unique(real[real >= 0]).tolist():
            if sample in owner and owner[sample] != k:
                shared[(owner[sample], k)].append(sample)
            owner.setdefault(sample, k)
    for (a, b), samples in shared.items():
        first = samples[0]
        at_a, at_b = _steps_of(reals[a], [first])[0] + offset, _steps_of(reals[b], [first])[0] + offset
        steps = np.union1d(_steps_of(reals[a], samples), _steps_of(reals[b], samples)) + offset
        found.add("samples on two shards", f"shards {a} and {b} both deliver {len(samples)} samples (e.g. "
                  f"{samples[:5]}; sample {first} at step {at_a} of shard {a} and step {at_b} of shard {b})",
                  shards=[a, b], steps=steps, samples=samples)


def _order(k: int, got: np.ndarray, want: np.ndarray, found, offset: int) -> None:
    """Shuffle off: shard k's slots against the plan's; a constant shift is one finding."""
    steps = min(len(got), len(want))
    flat_got, flat_want = got[:steps].ravel(), want[:steps].ravel()
    wrong = np.flatnonzero(flat_got != flat_want)
    if not wrong.size:
        return
    B = got.shape[1]
    for shift in range(-4 * B, 4 * B + 1):  # a stream that starts up to 4 batches early or late
        if not shift or abs(shift) >= len(flat_got):  # (a shift past the end would wrap the slices)
            continue
        a = flat_got[max(shift, 0):len(flat_got) + min(shift, 0)]
        b = flat_want[max(-shift, 0):len(flat_want) + min(-shift, 0)]
        if len(a) >= B and np.mean(a == b) > 0.9:
            found.add("order", f"shard {k} is shifted by {shift} slots against the plan from step "
                      f"{offset + wrong[0] // B} (it starts with sample {flat_got[0]}, the plan with "
                      f"{flat_want[0]})", shards=[k], steps=wrong // B + offset, samples=[flat_got[0]])
            return
    s, j = divmod(int(wrong[0]), B)
    found.add("order", f"shard {k} step {offset + s} slot {j}: sample {flat_got[wrong[0]]}, the plan says "
              f"{flat_want[wrong[0]]} ({len(wrong)} of {len(flat_want)} slots differ)",
              shards=[k], steps=wrong // B + offset, samples=flat_got[wrong])


def _table(reals: list, starts: list) -> np.ndarray:
    """(sample, segment, global step, shard) of every real slot; ``reals[i][k]``: segment i's shard k."""
    rows = [np.zeros((0, 4), np.int64)]
    for i, (shards, start) in enumerate(zip(reals, starts)):
        for k, real in enumerate(shards):
            s, b = np.nonzero(real >= 0)
            rows.append(np.stack([real[s, b], np.full(len(s), i), s + start, np.full(len(s), k)], axis=1))
    return np.concatenate(rows).astype(np.int64)


def _exactly_once(table: np.ndarray, num_samples: int, last_batch: str, end: int, everyone, found,
                  resized: bool = False, outside: bool = True) -> None:
    """Over a ``_table``: no sample outside range(N) (if ``outside``); fill, every sample in a real slot. ``resized``:
    describe_resized_epoch's words and (segment, shard) pairs, else describe_epoch's."""
    out = table[table[:, 0] >= num_samples]
    if outside and len(out):
        x, i, s, k = out[np.lexsort((out[:, 3], out[:, 2]))][0]
        samples = np.unique(out[:, 0])
        first = f"first: sample {x} at step {s} on shard {k} of segment {i}" if resized else f"first at step {s}"
        found.add("outside the dataset", f"{samples.size} delivered samples are not in range({num_samples}) "
                  f"(e.g. {samples[:5].tolist()}; {first})", steps=out[:, 2], samples=samples,
                  shards={(int(i), int(k)) if resized else int(k) for i, k in out[:, [1, 3]]})
    missing = np.setdiff1d(np.arange(num_samples), table[:, 0])
    if last_batch == "fill" and missing.size:
        found.add("missing from the epoch" if resized else "missing", f"{missing.size} of the {num_samples} samples "
                  f"are never delivered in a real slot of any {'segment' if resized else 'shard'}, in any of steps "
                  f"{_span(0, end)} (e.g. {missing[:5].tolist()})", shards=everyone, steps=range(end), samples=missing)


def real_first(delivered: list, masks: list) -> tuple[list, list]:
    """Each shard's slots reordered real first (stable), each shard (steps, B) as it came. For ``describe_epoch`` on a
    shuffled epoch whose padding may sit anywhere (rocAL's): the spec fixes only how many slots are real, so the mask
    check compares counts, and findings name reordered steps. ``masks`` (bool or 0/1) may cover more batches than
    arrived. Raises ValueError for masks of another shard count, or covering fewer batches."""
    if len(masks) != len(delivered):
        raise ValueError(f"real_first: masks has {len(masks)} shards, delivered {len(delivered)}")
    out_delivered, out_masks = [], []
    for k, (got, mask) in enumerate(zip(delivered, masks)):
        got, mask = np.asarray(got), np.asarray(mask, bool)
        if len(mask) < len(got):
            raise ValueError(f"real_first: masks[{k}] covers {len(mask)} batches, delivered[{k}] has {len(got)}")
        mask = mask[:len(got)]
        order = np.argsort(~mask.ravel(), kind="stable")
        out_delivered.append(got.ravel()[order].reshape(got.shape))
        out_masks.append(mask.ravel()[order].reshape(mask.shape))
    return out_delivered, out_masks


# One epoch across resizes ----------------------------------------------------
def describe_resized_epoch(delivered, num_samples: int, segments, *, epoch: int, seed: int,
                           shuffle: bool, last_batch: str, masks=None, length: int | None = None,
                           findings: Findings | None = None, partition: str = "contiguous") -> Findings:
    """How one epoch run across resizes departs from ``plan.elastic_plan`` and from exactly once.

    ``segments``: elastic_plan's [(t_0, n_0, B_0), ...]; ``delivered`` and ``masks`` (or None) hold one entry per
    segment, in a layout of ``describe_epoch`` (n_i shards of B_i; row r is step t_i + r). ``length``: the loader's step
    count (None: not checked).

    Per segment: describe_epoch's per-shard checks, texts prefixed "segment i: ", shards as (segment, shard).
    "contiguous" holds segment i to plans[i]; "any" holds each shard to t_{i+1} - t_i steps (the last segment: equal
    steps). An empty run (fewer samples left than shards) pads with a sample real elsewhere: with masks its batch is no
    "same batch" and its padding may repeat any sample; without, it reads as another shard's. Over the epoch: "repeated
    across segments"; fill, "missing from the epoch"; drop, "drop count" (distinct samples against the sum of
    n_i * B_i * d_i); "step count"; "any", "outside the dataset".

    Raises ValueError for segments elastic_plan refuses (its reason quoted), ``delivered`` or ``masks`` without one
    entry per segment, blocks in neither layout or of another shard count or batch, a bad num_samples or length, or an
    unknown partition or last_batch."""
    where = "describe_resized_epoch"
    _check_args(where, partition, last_batch, num_samples=(num_samples, 0),
                **({} if length is None else {"length": (length, 0)}))
    try:
        plans = elastic_plan(num_samples, segments, epoch=epoch, seed=seed, shuffle=shuffle, last_batch=last_batch)
    except ValueError as error:
        raise ValueError(f"{where}: segments={segments!r} is not an epoch elastic_plan accepts: {error}") from None
    segments = [tuple(int(v) for v in s) for s in segments]
    total = segments[-1][0] + len(plans[-1].indices)
    plans = plans if partition == "contiguous" else None
    for name, value in (("delivered", delivered), ("masks", masks)):
        if (value is not None or name == "delivered") and (
                not isinstance(value, (list, tuple)) or len(value) != len(segments)):
            got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
            raise ValueError(f"{where}: {name} must be a list with one entry per segment ({len(segments)}), got {got}")
    found = findings if findings is not None else Findings()
    stops = [s[0] for s in segments[1:]] + [None]
    reals, end = [], 0
    for i, ((start, n, B), stop) in enumerate(zip(segments, stops)):
        got, mask = _blocks(delivered[i], None if masks is None else masks[i], B, where, f"delivered[{i}]")
        if len(got) != n:
            raise ValueError(f"{where}: delivered[{i}] has {len(got)} shards; segments[{i}]={segments[i]} has {n}")
        end = max(end, start + max(len(x) for x in got))
        runs = owed = None
        if plans is not None:
            steps = len(plans[i].indices)
            what = (f"the plan has {steps} (segment {i}: N={num_samples}, from step {start}, {n} shards of {B}, "
                    f"{last_batch})")
            runs, owed = _runs(plans, i, num_samples, last_batch == "fill" or stop is not None)
        elif stop is not None:
            steps = stop - start
            what = f"the segment runs {steps} (steps {_span(start, stop)}, until the next segment)"
        else:
            steps = max(len(x) for x in got)
            what = f"the longest shard delivered {steps}"
        own = Findings()
        reals.append(_check_shards(got, mask, own, plan=None if plans is None else plans[i], steps=steps,
                                   what=what, runs=runs, owed=owed, shuffle=shuffle, last_batch=last_batch,
                                   offset=start, resized=True))
        for kind, items in own.kinds.items():
            for text, shards, at, xs in items:
                found.add(kind, f"segment {i}: {text}", shards=[(i, k) for k in shards], steps=at, samples=list(xs))
    everyone = [(i, k) for i, s in enumerate(segments) for k in range(s[1])]
    want = total if plans is not None else end
    if length is not None and length != want:
        what = (f"the resized plan has {want} (N={num_samples}, segments {[tuple(s) for s in segments]}, "
                f"{last_batch})" if plans is not None else f"the last segment's longest shard ends at step {want}")
        lo, hi = min(length, want), max(length, want)
        found.add("step count", f"the loader reports {length} steps for the epoch; {what}; steps {_span(lo, hi)}",
                  shards=everyone, steps=range(lo, hi))
    table = _table(reals, [s[0] for s in segments])
    _exactly_once(table, num_samples, last_batch, end, everyone, found, resized=True, outside=partition == "any")
    _across_segments(table, segments, num_samples, last_batch, total, end, everyone, found)
    return found


def _runs(plans: list, i: int, num_samples: int, owes: bool) -> tuple[list, list | None]:
    """Per shard of segment i: (its run of the samples left, words), and, when ``owes``, (the samples of its real slots
    in plans[i], words)."""
    taken = np.zeros(num_samples, bool)
    for plan in plans[:i]:
        taken[plan.indices[plan.mask]] = True
    pool = np.flatnonzero(~taken)
    plan, m, n = plans[i], len(pool), plans[i].indices.shape[1]
    runs, owed = [], []
    for k in range(n):
        run = pool[m * k // n:m * (k + 1) // n]  # elastic_plan's split of what is left
        if not run.size:
            words = f"its run (empty: {m} samples left for {n} shards)"
        elif run[-1] - run[0] == len(run) - 1:
            words = f"its range [{run[0]}, {run[-1] + 1})"
        else:
            words = f"its run of {len(run)} samples ({', '.join(map(str, run[:5].tolist()))}" \
                    f"{', ...' if len(run) > 5 else ''})"
        runs.append((run, words))
        want = np.unique(plan.indices[:, k][plan.mask[:, k]])
        owed.append((want, f"its {len(want)} samples" if np.array_equal(want, run)
                     else f"the {len(want)} samples the plan gives it"))
    return runs, owed if owes else None


def _across_segments(table: np.ndarray, segments: list, num_samples: int, last_batch: str, total: int,
                     end: int, everyone: list, found: Findings) -> None:
    """describe_resized_epoch's "repeated across segments" and, for drop, "drop count", over a ``_table``."""
    inside = table[table[:, 0] < num_samples]
    first = np.full(num_samples, len(segments))  # the first segment to deliver each sample
    np.minimum.at(first, inside[:, 0], inside[:, 1])
    again = inside[inside[:, 1] > first[inside[:, 0]]]
    for a, b in sorted({(int(first[x]), int(i)) for x, i in again[:, :2]}):
        here = again[(first[again[:, 0]] == a) & (again[:, 1] == b)]
        samples = np.unique(here[:, 0])
        x, _, s, k = here[np.lexsort((here[:, 3], here[:, 2]))][0]
        there = inside[(inside[:, 1] == a) & np.isin(inside[:, 0], samples)]
        _, _, s_a, k_a = there[(there[:, 0] == x)][0]
        found.add("repeated across segments", f"segment {b} delivers {samples.size} samples that segment {a} had "
                  f"delivered in real slots (e.g. {samples[:5].tolist()}); the repeats start at step {s} on shard "
                  f"{k} of segment {b} (sample {x}, delivered at step {s_a} on shard {k_a} of segment {a})",
                  shards={(a, int(c)) for c in there[:, 3]} | {(b, int(c)) for c in here[:, 3]},
                  steps=np.union1d(there[:, 2], here[:, 2]), samples=samples)
    if last_batch == "fill":
        return
    delivered = np.unique(inside[:, 0]).size
    steps = [b[0] - a[0] for a, b in zip(segments, segments[1:])] + [total - segments[-1][0]]
    stated = sum(n * B * d for (_, n, B), d in zip(segments, steps))
    if delivered != stated:
        terms = " + ".join(f"{n}*{B}*{d}" for (_, n, B), d in zip(segments, steps))
        found.add("drop count", f"the epoch delivers {delivered} distinct samples in real slots; elastic_plan "
                  f"states {stated} ({terms}: n*B*steps of each segment), skipping {num_samples - stated} of "
                  f"the {num_samples}", shards=everyone, steps=range(end))


# Several epochs --------------------------------------------------------------
def describe_epochs(epochs, batch_size: int, *, shuffle: bool, findings: Findings | None = None) -> Findings:
    """How several reads of one loader relate: whether its order follows the epoch.

    ``epochs``: ``{epoch: delivered}`` or (epoch, delivered) pairs, an epoch maybe twice, each in a layout of
    ``describe_epoch``. Reads are compared slot by slot, padding included; a slot one read lacks differs
    (-1 in the text). "epoch read twice": two reads of one epoch differ. Shuffle off, "order changes with the epoch": an
    epoch differs from the lowest one. Shuffle on, "same order in two epochs": shards identical in two epochs, if a
    uniform shuffle repeats them all with chance below ``CHANCE``: the product of 1/L_k!, L_k the distinct samples of
    shard k. One shard of 10 is flagged (1/10!); one of 9 is not.

    Raises ValueError for fewer than two reads, reads of other shard counts, or a read in neither layout."""
    pairs = list(epochs.items()) if isinstance(epochs, dict) else list(epochs)
    if len(pairs) < 2:
        raise ValueError(f"describe_epochs: needs two or more reads (epoch, delivered), got {len(pairs)}")
    reads = [(int(epoch), _per_shard(delivered, batch_size, f"epochs[{epoch}]", np.integer, "describe_epochs"))
             for epoch, delivered in pairs]
    n = len(reads[0][1])
    for epoch, shards in reads:
        if len(shards) != n:
            raise ValueError(f"describe_epochs: epoch {epoch} has {len(shards)} shards, epoch {reads[0][0]} has "
                             f"{n}; all reads must come from one loader")
    found = findings if findings is not None else Findings()
    first, compare = {}, []
    for epoch, shards in reads:
        if epoch in first:
            compare.append(("epoch read twice", epoch, first[epoch], shards))
        first.setdefault(epoch, shards)
    numbers, base = sorted(first), min(first)
    if not shuffle:
        compare += [("order changes with the epoch", epoch, first[base], first[epoch]) for epoch in numbers[1:]]
    for kind, epoch, x, y in compare:
        for k in range(n):
            differ = _slot_difference(x[k], y[k])
            if differ:
                head, other, steps = differ
                text = (f"two reads of epoch {epoch} differ in {head}, then {other}): the epoch depends on what was "
                        f"read before" if kind == "epoch read twice" else f"epoch {epoch} differs from epoch {base} in "
                        f"{head} in epoch {base}, {other} in epoch {epoch}); without shuffle every epoch is the same")
                found.add(kind, f"shard {k}: {text}", shards=[k], steps=steps)
    if not shuffle:
        return found
    for i, a in enumerate(numbers):
        for b in numbers[i + 1:]:
            same = [k for k in range(n) if not _slot_difference(first[a][k], first[b][k])]
            log_chance = -sum(math.lgamma(np.unique(first[a][k]).size + 1) for k in same)  # 0 for none
            if log_chance >= math.log(CHANCE):
                continue
            steps = max(len(first[a][k]) for k in same)
            who = f"shard {same[0]} delivers" if len(same) == 1 else f"shards {same} deliver"
            found.add("same order in two epochs", f"{who} the same samples in the same slots in epochs {a} and "
                      f"{b} (steps {_span(0, steps)}): the shuffle ignores the epoch (a uniform shuffle repeats "
                      f"this with probability {math.exp(log_chance):.1e})", shards=same, steps=range(steps))
    return found


def _slot_difference(x: np.ndarray, y: np.ndarray):
    """None when two reads (steps, B) of one shard agree in every slot; else ("N of M slots (first: step s slot j,
    sample x", the other read's sample there (-1: none), the steps)."""
    a, b = x.ravel(), y.ravel()
    total, common = max(len(a), len(b)), min(len(a), len(b))
    wrong = np.concatenate([np.flatnonzero(a[:common] != b[:common]), np.arange(common, total)])
    if not wrong.size:
        return None
    j = int(wrong[0])
    s, slot = divmod(j, x.shape[1])
    pick = lambda v: int(v[j]) if j < len(v) else -1
    return (f"{wrong.size} of {total} slots (first: step {s} slot {slot}, sample {pick(a)}", pick(b),
            np.unique(wrong // x.shape[1]))


# Values by index, and normalised content -------------------------------------
def describe_values(delivered, values, reference, *, name: str = "labels",
                    findings: Findings | None = None) -> Findings:
    """Whether every delivered slot holds its own sample's value of one key.

    ``delivered``: decoded indices, in a layout of ``describe_epoch``; ``values``: the key ``name`` as delivered, same
    layout, per-sample axes last; ``reference``: the dataset's (N, ...) array of it, any sample shape and dtype.

    Every slot whose index i is in range(N), padding included, must hold reference[i]: the same bits when the dtypes
    agree (-0.0 is not 0.0; a NaN matches itself), else the same number. One finding per shard: "{name} shape", or
    "{name}" naming the wrong slots and a shift if every wrong one holds the value of the sample d indices (mod N) or d
    slots away in the shard's stream, 0 < |d| <= ``SHIFTS``.

    Raises ValueError for ``values`` unlike ``delivered`` in shards, steps or B, or a ``reference`` with no N axis."""
    reference = np.asarray(reference)
    if reference.ndim < 1 or not len(reference):
        raise ValueError(f"describe_values: reference must be the dataset's {name!r} array (N, ...), "
                         f"got shape {reference.shape}")
    delivered = _per_shard(delivered, None, "delivered", np.integer, "describe_values")
    B = delivered[0].shape[1]
    values = _per_shard(values, B, name, None, "describe_values", sample_dims=True)
    if len(values) != len(delivered):
        raise ValueError(f"describe_values: {name} has {len(values)} shards, delivered {len(delivered)}")
    found = findings if findings is not None else Findings()
    N, sample = len(reference), reference.shape[1:]
    for k, (got, value) in enumerate(zip(delivered, values)):
        if value.shape[0] != got.shape[0]:
            raise ValueError(f"describe_values: {name}[{k}] covers {value.shape[0]} batches, delivered has "
                             f"{got.shape[0]}")
        if value.shape[2:] != sample:
            found.add(f"{name} shape", f"shard {k}: {name} arrive as {value.dtype} {value.shape[2:]} per sample; "
                      f"the dataset's are {reference.dtype} {sample}", shards=[k], steps=range(len(got)))
            continue
        flat_i, flat_v = got.ravel(), value.reshape((-1,) + sample)
        known = np.flatnonzero((flat_i >= 0) & (flat_i < N))
        bad = known[~_same_values(flat_v[known], reference[flat_i[known]])]
        if not bad.size:
            continue
        s, j = divmod(int(bad[0]), B)
        first = int(flat_i[bad[0]])
        detail = "" if sample else \
            f" with {name} {flat_v[bad[0]].tolist()}, the dataset's is {reference[first].tolist()}"
        found.add(name, f"shard {k}: {bad.size} of {known.size} slots hold {name} that are not their sample's (first: "
                  f"step {s} slot {j} holds sample {first}{detail}){_shift(flat_i, flat_v, bad, reference, name)}",
                  shards=[k], steps=np.unique(bad // B), samples=flat_i[bad])
    return found


def _same_values(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """(M,) bool: row m of ``got`` equals row m of ``want``, in bits when the dtypes agree, else as numbers."""
    M = len(got)
    if not M:
        return np.zeros(0, bool)
    if got.dtype == want.dtype:
        bits = lambda x: np.ascontiguousarray(x).reshape(M, -1).view(np.uint8)
        return np.all(bits(got) == bits(want), axis=1)
    return np.all(np.equal(got, want).reshape(M, -1), axis=1)


def _shift(flat_i: np.ndarray, flat_v: np.ndarray, bad: np.ndarray, reference: np.ndarray, name: str) -> str:
    """The words for a constant shift that explains every wrong slot, or ""."""
    N = len(reference)
    shifts = [d for m in range(1, SHIFTS + 1) for d in (m, -m)]
    for d in shifts:  # by d samples in the dataset
        if _same_values(flat_v[bad], reference[(flat_i[bad] + d) % N]).all():
            return (f"; every one holds the {name} of sample i{d:+d} (mod {N}), i its own index: {name} shifted "
                    f"by {d:+d} sample(s)")
    for d in shifts:  # by d slots in the shard's stream; at most |d| wrong slots lack a neighbour
        at = bad + d
        has = (at >= 0) & (at < len(flat_i))
        has[has] = (flat_i[at[has]] >= 0) & (flat_i[at[has]] < N)
        if (~has).sum() <= abs(d) and has.any() and _same_values(flat_v[bad[has]], reference[flat_i[at[has]]]).all():
            return (f"; every one holds the {name} of the sample {abs(d)} slot(s) {'later' if d > 0 else 'earlier'} "
                    f"in the shard's stream (where there is one): {name} shifted by {d:+d} slot(s)")
    return ""


def describe_content(images_BCHW, labels_B, indices_B, ref_images, ref_labels, normalize: Normalize) -> list[str]:
    """Labels and pixels of one shard's batch against the file and the table, in words. ``images_BCHW``: normalised
    float32 (B, C, H, W); ``labels_B``: integer labels, one per slot; ``indices_B``: decoded indices (-1 skipped).
    Pixels must be ``normalize(ref_images[i])`` bit for bit (mirrored images, or up to 8 ulps away, are named so);
    labels must be ``ref_labels[i]``. Other keys or shapes: ``describe_values``. Raises ValueError for images, labels or
    indices that are not one per slot."""
    images_BCHW, labels_B, indices_B = np.asarray(images_BCHW), np.asarray(labels_B), np.asarray(indices_B)
    if indices_B.ndim != 1 or images_BCHW.ndim != 4 or len(images_BCHW) != len(indices_B) \
            or labels_B.size != len(indices_B):
        raise ValueError(f"describe_content: images_BCHW (B, C, H, W), labels_B and indices_B must hold one "
                         f"entry per slot, got shapes {images_BCHW.shape}, {labels_B.shape} and {indices_B.shape}")
    labels_B = labels_B.reshape(-1)
    ok = indices_B >= 0
    found = []
    wrong = np.flatnonzero(ok & (labels_B != ref_labels[np.where(ok, indices_B, 0)]))
    if wrong.size:
        j = wrong[0]
        found.append(f"{wrong.size} labels differ from the file (slot {j} holds sample {indices_B[j]} with label "
                     f"{labels_B[j]}, the file says {ref_labels[indices_B[j]]})")
    want, got = normalize(ref_images[indices_B[ok]]), images_BCHW[ok]
    bad = ~np.all(got == want, axis=(1, 2, 3)) if got.size else np.zeros(0, bool)
    if bad.any():
        mirrored = np.all(got[bad] == want[bad][..., ::-1], axis=(1, 2, 3))
        # In ulps of the largest magnitude (the table's scale), as the strategies' bounds.
        scale = np.spacing(np.float32(np.abs(want[bad]).max()))
        ulps = int(np.ceil(np.abs(got[bad].astype(np.float64) - want[bad]).max() / scale))
        note = ("; they equal the mirrored images: mirror=0 was not honoured" if mirrored.all()
                else f"; up to {ulps} ulps apart: another arithmetic than the table's" if ulps <= 8 else "")
        found.append(f"{bad.sum()} images differ from the {normalize.arithmetic} table of their sample{note}")
    return found
