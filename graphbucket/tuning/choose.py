"""Ladder tuning, the choosing step: bucket bounds and hints from measured decode times.

Pure host arithmetic (no torch at import). The measuring step that fills the timing table
on a GPU is ``graphbucket.tuning.measure.measure_split_times``; ``scripts/tune_ladder.py``
runs both.

Input: ``times[(context, batch, variant)] -> us`` over measured contexts c_1 < ... < c_n
and the capture batch sizes, and ``splits_for(batch, hint)``: the variant of the graph
captured with ``hint``. Hints matter only through it. A variant is either a split count
(``plan_splits``; reports before 2026-12) or the plan itself, named by
``LaunchPlan.describe()`` (``plan_variants``): one split count can be several plans (at
batch 64 a hint of 4K plans 4 splits merged in stage 1, WIDE_FUSED, where 128K with its
split count forced to 4 runs the merge kernel), so the tuner times the plan each hint
captures, at every context.

- ``oracle(c, b)`` = min over the split counts measured at (c, b).
- ``cost(c, b, h)`` = ``times[(c, b, splits_for(b, h))]``. Every split count a considered
  hint plans must have been measured: a missing one raises ``ValueError`` (no nearest-
  neighbour guess; ``splits_to_measure`` lists what to measure, and the measuring step
  measures exactly that).
- A ladder is a partition of c_1..c_n into at most ``max_buckets`` contiguous groups. Group
  c_i..c_j becomes ``Bucket(max_len=c_j, ...)``; the last group's bucket ends at
  ``max_model_len``. Bounds are shared by every batch size; hints are chosen per measured
  batch size (the bucket's ``hint`` for the smallest, ``batch_hints`` where a larger one
  differs), because one hint buys different split counts at different batch sizes
  (H200, 16 heads: at 65-128 tokens batch 1 runs 20 % faster on 2+ splits and batch 8
  9 % faster on one). ``per_batch_hints=False`` asks one hint to serve all.
- Objective: the sum over contexts and batches of cost / oracle (relative time, so a 128K
  context weighs as much as a 64-token one). A dynamic program over (groups used, prefix
  of contexts) finds the exact optimum. Ties, in order: the smaller worst cost / oracle,
  fewer buckets (a graph that buys nothing still costs capture time and memory), smaller
  hints (lexicographic), earlier bounds. Within one group, equal cost goes to the smaller
  hint. Sums compare after rounding to 1e-9, so ties do not hang on float summation order.

Any hint plans a correct graph for any length, so a group may take any candidate hint,
inside its bucket or not (more splits than its top asks for sometimes pays at short
contexts, fewer than its bottom asks for at batch 8). Candidates: the given hints
(default: powers of two up to ``max_model_len``, and ``max_model_len``), the measured
contexts and each context + 1, one per distinct split tuple; for ``plan_mla_decode``,
constant between consecutive powers of two, the powers of two already reach every
split count. The ladder is optimal at the measured contexts only; lengths between them
take their bucket's hint untested, so measure densely where the oracle's split count
changes. A bound at c leaves c + 1 to the next bucket, whose hint was chosen for lengths
further up: ``edge_contexts`` lists each c + 1 to measure as well, and ``bounds_at`` keeps
bounds at contexts whose c + 1 was measured, so each bucket is scored at both its ends.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from graphbucket.ladder import Bucket, BucketLadder, default_ladder
from graphbucket.plan import (
    H200_NUM_SMS,
    MAX_KV_SPLITS,
    LaunchPlan,
    plan_mla_decode,
    pow2_ceil,
)

Variant = int | str  # a split count, or a plan's describe()
TimeKey = tuple[int, int, Variant]  # (context, batch, variant)
TimeTable = Mapping[TimeKey, float]
SplitsFn = Callable[[int, int], Variant]  # (batch, hint) -> variant
PlanFn = Callable[[int, int], LaunchPlan]  # (batch, hint) -> the plan captured

_NDIGITS = 9  # rounding before comparing sums of cost/oracle ratios
_SPLITS_RE = re.compile(r"splits=(\d+) ")


def candidate_hints(max_model_len: int) -> list[int]:
    """Powers of two 1, 2, 4, ... up to ``max_model_len``, and ``max_model_len``."""
    _check_positive("max_model_len", max_model_len)
    return sorted({1 << k for k in range(max_model_len.bit_length())} | {max_model_len})


def plan_splits(num_heads: int, *, num_sms: int = H200_NUM_SMS,
                max_splits: int = MAX_KV_SPLITS) -> SplitsFn:
    """``splits_for(batch, hint)`` of ``plan_mla_decode`` on a GPU with ``num_sms`` SMs."""
    @functools.cache
    def splits_for(batch: int, hint: int) -> int:
        return plan_mla_decode(batch, num_heads, hint, num_sms=num_sms,
                               max_splits=max_splits).num_kv_splits
    return splits_for


def hint_plans(num_heads: int, *, num_sms: int = H200_NUM_SMS, q_len: int = 1,
               max_splits: int = MAX_KV_SPLITS) -> PlanFn:
    """``plan_for(batch, hint)``: the plan a graph of ``batch`` rows captures at ``hint``,
    as the runner plans it (``graphs.plan_for_key``: q_len x heads rows, same hint)."""
    _check_positive("q_len", q_len)

    @functools.cache
    def plan_for(batch: int, hint: int) -> LaunchPlan:
        return plan_mla_decode(batch, num_heads * q_len, hint, num_sms=num_sms,
                               max_splits=max_splits)
    return plan_for


def plan_variants(plan_for: PlanFn) -> SplitsFn:
    """``splits_for`` whose variants are plans: ``plan_for(batch, hint).describe()``."""
    return lambda batch, hint: plan_for(batch, hint).describe()


def variant_splits(variant: Variant) -> int:
    """The split count of a variant (a split count, or a split plan's describe())."""
    if isinstance(variant, int):
        return variant
    found = _SPLITS_RE.match(variant)
    if found is None:
        raise ValueError(f"variant {variant!r} is not a split plan's describe() "
                         "('splits=N ...'); time split-KV plans only")
    return int(found.group(1))


def plans_to_measure(batches: Iterable[int], plan_for: PlanFn, hints: Iterable[int]
                     ) -> dict[int, dict[str, LaunchPlan]]:
    """Per batch: every distinct plan ``hints`` capture, by ``describe()``, fewest splits
    first. Only these can be replayed, so only these are timed."""
    hints = list(hints)
    out = {}
    for batch in sorted(set(batches)):
        plans = {plan_for(batch, h).describe(): plan_for(batch, h) for h in hints}
        out[batch] = dict(sorted(plans.items(), key=lambda kv: (kv[1].num_kv_splits, kv[0])))
    return out


def refine_contexts(times: TimeTable, max_new: int) -> list[int]:
    """Contexts to measure next: the geometric midpoint of each pair of neighbouring
    measured contexts where some batch's best split count changes, at most ``max_new``,
    widest gaps first (ties: the shorter). The ladder is exact at measured contexts only,
    so the grid is made dense only where the choice changes."""
    table = _Table(times)
    gaps = []
    for lo, hi in itertools.pairwise(table.contexts):
        mid = round(math.sqrt(lo * hi))
        if not lo < mid < hi:
            continue
        if any(variant_splits(table.oracle[(lo, b)][0]) != variant_splits(
                table.oracle[(hi, b)][0]) for b in table.batches):
            gaps.append((-hi / lo, mid))
    return sorted(mid for _, mid in sorted(gaps)[:max_new])


def edge_contexts(contexts: Iterable[int], max_model_len: int) -> list[int]:
    """Each context + 1 (up to ``max_model_len``) not already in ``contexts``: the first
    length of the bucket above a bound at that context."""
    contexts = set(contexts)
    return sorted({c + 1 for c in contexts if c < max_model_len} - contexts)


def bounds_with_edges(contexts: Iterable[int]) -> list[int]:
    """The contexts whose next length (context + 1) is among ``contexts`` too."""
    contexts = set(contexts)
    return sorted(c for c in contexts if c + 1 in contexts)


def hints_to_measure(contexts: Iterable[int], max_model_len: int, *,
                     ladders: Iterable[BucketLadder] = ()) -> list[int]:
    """Every hint the chooser may plan with (and the hints of ``ladders`` to compare with)."""
    contexts = sorted(set(contexts))
    hints = set(candidate_hints(max_model_len)) | set(contexts)
    hints |= {c + 1 for c in contexts if c < max_model_len}
    for ladder in ladders:
        hints |= {h for bucket in ladder for h in bucket.all_hints()}
    return sorted(h for h in hints if h <= max_model_len)


def splits_to_measure(batches: Iterable[int], splits_for: SplitsFn, hints: Iterable[int], *,
                      max_splits: int = MAX_KV_SPLITS) -> dict[int, list[int]]:
    """Per batch: the split counts ``hints`` plan, plus the powers of two up to twice the
    largest of them (capped at ``max_splits``) so the oracle sees past the plan's budget."""
    hints = list(hints)
    out = {}
    for batch in sorted(set(batches)):
        planned = {splits_for(batch, h) for h in hints}
        top = min(max_splits, pow2_ceil(2 * max(planned)))
        out[batch] = sorted(planned | {1 << k for k in range(top.bit_length())})
    return out


def times_to_rows(times: TimeTable) -> list[dict[str, Any]]:
    """The timing table as JSON rows ``{"context", "batch", "splits", "us"}`` (and ``plan``
    where the variant is a plan), sorted."""
    rows = []
    for (c, b, v), us in sorted(times.items(), key=_row_order):
        row = {"context": c, "batch": b, "splits": variant_splits(v), "us": round(float(us), 4)}
        if isinstance(v, str):
            row["plan"] = v
        rows.append(row)
    return rows


def _row_order(item: tuple[TimeKey, float]) -> tuple:
    (c, b, v), _ = item
    return (c, b, variant_splits(v), str(v))


def times_from_rows(rows: Iterable[Mapping[str, Any]]) -> dict[TimeKey, float]:
    """Inverse of ``times_to_rows``."""
    return {(int(r["context"]), int(r["batch"]), r["plan"] if "plan" in r else int(r["splits"])):
            float(r["us"]) for r in rows}


def timed_plans(rows: Iterable[Mapping[str, Any]]) -> bool:
    """Whether a report's timing rows are keyed by plan (else by split count)."""
    return any("plan" in r for r in rows)


@dataclass(frozen=True, slots=True)
class TuneResult:
    """The chosen ladder, the ladder it is compared with, and per-(context, batch) rows.

    ``rows``: oracle, tuned and baseline microseconds and split counts, and their ratios
    over the oracle. ``summary``: mean and max of those ratios.
    """

    ladder: BucketLadder
    baseline: BucketLadder
    rows: tuple[dict[str, Any], ...]
    summary: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"ladder": self.ladder.to_dict(), "default_ladder": self.baseline.to_dict(),
                "summary": dict(self.summary), "rows": [dict(r) for r in self.rows]}


class _Table:
    """Times indexed by (context, batch), with the oracle and a loud lookup."""

    def __init__(self, times: TimeTable) -> None:
        by_shape: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
        for key, us in times.items():
            if len(key) != 3:
                raise ValueError(f"timing keys are (context, batch, splits), got {key!r}")
            for name, value in zip(("context", "batch"), key[:2], strict=True):
                _check_positive(f"timing key {name}", value)
            if not (isinstance(key[2], str) and key[2]):
                _check_positive("timing key splits", key[2])
            if not (isinstance(us, (int, float)) and math.isfinite(us) and us > 0):
                raise ValueError(f"time for {key} must be a positive finite us, got {us!r}")
            by_shape[(key[0], key[1])][key[2]] = float(us)
        if not by_shape:
            raise ValueError("the timing table is empty; measure some (context, batch, splits)")
        self.contexts = sorted({c for c, _ in by_shape})
        self.batches = sorted({b for _, b in by_shape})
        holes = [(c, b) for c in self.contexts for b in self.batches if (c, b) not in by_shape]
        if holes:
            raise ValueError(f"the timing table has no time at all for (context, batch) in "
                             f"{holes}; every measured context needs every batch")
        self.by_shape = dict(by_shape)
        self.oracle = {cb: min(split_us.items(), key=lambda kv: (kv[1], kv[0]))
                       for cb, split_us in self.by_shape.items()}

    def us(self, context: int, batch: int, splits: int) -> float:
        measured = self.by_shape[(context, batch)]
        if splits not in measured:
            raise ValueError(
                f"no time measured for context={context} batch={batch} splits={splits} (a "
                f"hint plans that split count); measured splits: {sorted(measured)}. Measure "
                "every count splits_to_measure() lists for these hints")
        return measured[splits]

    def ratio(self, context: int, batch: int, splits: int) -> float:
        return self.us(context, batch, splits) / self.oracle[(context, batch)][1]


@dataclass(frozen=True, slots=True)
class _Choice:
    total: float  # sum of cost / oracle
    worst: float  # max of cost / oracle
    hints: tuple[GroupHints, ...]
    ends: tuple[int, ...]  # exclusive end index of each group into the sorted contexts

    def key(self) -> tuple:
        return (round(self.total, _NDIGITS), round(self.worst, _NDIGITS), len(self.hints),
                self.hints, self.ends)


def choose_ladder(times: TimeTable, splits_for: SplitsFn, *, max_model_len: int,
                  max_buckets: int, hints: Iterable[int] | None = None,
                  baseline: BucketLadder | None = None,
                  meta: Mapping[str, Any] | None = None,
                  per_batch_hints: bool = True,
                  bounds_at: Iterable[int] | None = None) -> TuneResult:
    """The ladder of at most ``max_buckets`` buckets minimising summed cost / oracle.

    ``times``: ``{(context, batch, splits): us}``; ``splits_for(batch, hint)``: the plan's
    split count; ``hints``: candidate hints (default ``candidate_hints(max_model_len)``);
    ``baseline``: the ladder to compare with (default ``default_ladder``); ``meta`` is
    merged into the ladder's meta (device, heads, date: the caller knows them).
    ``per_batch_hints``: each measured batch size gets its own hint per bucket (bounds stay
    shared); False asks one hint to serve them all. ``bounds_at``: the measured contexts a
    bucket may end at (default any; ``bounds_with_edges`` where edges were measured).
    Deterministic; see the module docstring for the method and the tie-breaks.
    """
    _check_positive("max_model_len", max_model_len)
    _check_positive("max_buckets", max_buckets)
    table = _Table(times)
    if table.contexts[-1] > max_model_len:
        raise ValueError(f"measured context {table.contexts[-1]} is above max_model_len="
                         f"{max_model_len}; drop it from the table or raise max_model_len")
    hints = candidate_hints(max_model_len) if hints is None else sorted(set(hints))
    for h in hints:
        _check_positive("candidate hint", h)
    groups = _GroupCosts(table, splits_for, hints, max_model_len, per_batch=per_batch_hints)
    n = len(table.contexts)
    ends = None
    if bounds_at is not None:
        allowed = set(bounds_at)
        ends = {e for e in range(1, n) if table.contexts[e - 1] in allowed} | {n}
    best = _partition(n, max_buckets, groups.best, ends=ends)
    bounds = [table.contexts[e - 1] for e in best.ends[:-1]] + [max_model_len]
    buckets = [bucket_with_hints(b, table.batches, h)
               for b, h in zip(bounds, best.hints, strict=True)]
    baseline = baseline if baseline is not None else default_ladder(max_model_len)
    num = len(table.contexts) * len(table.batches)
    tuned_meta = {"source": "graphbucket.tuning", **dict(meta or {}),
                  "batch_sizes": table.batches, "contexts": table.contexts,
                  "max_buckets": max_buckets, "per_batch_hints": per_batch_hints,
                  "mean_over_oracle": round(best.total / num, 4),
                  "max_over_oracle": round(best.worst, 4)}
    ladder = BucketLadder(buckets, max_model_len, meta=tuned_meta)
    rows = compare_ladders(table, splits_for, {"tuned": ladder, "default": baseline})
    summary = {"tuned_mean_over_oracle": _mean(rows, "tuned_over_oracle"),
               "tuned_max_over_oracle": max(r["tuned_over_oracle"] for r in rows),
               "default_mean_over_oracle": _mean(rows, "default_over_oracle"),
               "default_max_over_oracle": max(r["default_over_oracle"] for r in rows)}
    return TuneResult(ladder, baseline, tuple(rows), summary)


def choose_per_batch(times: TimeTable, splits_for: SplitsFn, **kwargs: Any
                     ) -> dict[int, TuneResult]:
    """``choose_ladder`` on each batch size's rows alone: what per-batch ladders would buy.

    One ``BucketLadder`` shares its bounds across capture batch sizes (hints may differ per
    batch size, see ``per_batch_hints``), so where batch sizes want different bounds one
    ladder must compromise; this measures the price of sharing the bounds.
    """
    batches = sorted({b for _, b, _ in times})
    return {b: choose_ladder({k: us for k, us in times.items() if k[1] == b}, splits_for,
                             **kwargs) for b in batches}


def compare_ladders(times: TimeTable | _Table, splits_for: SplitsFn,
                    ladders: Mapping[str, BucketLadder]) -> list[dict[str, Any]]:
    """Per measured (context, batch): the oracle and, per named ladder, the time of the
    graph that ladder replays there (``{name}_us``, ``{name}_splits``, ``{name}_hint``,
    ``{name}_over_oracle``)."""
    table = times if isinstance(times, _Table) else _Table(times)
    rows = []
    for c in table.contexts:
        for b in table.batches:
            oracle_splits, oracle_us = table.oracle[(c, b)]
            row: dict[str, Any] = {"context": c, "batch": b, "oracle_us": oracle_us,
                                   "oracle_splits": variant_splits(oracle_splits)}
            if isinstance(oracle_splits, str):
                row["oracle_plan"] = oracle_splits
            for name, ladder in ladders.items():
                hint = ladder.hint_for(ladder.bucket_for(c), b)
                splits = splits_for(b, hint)
                us = table.us(c, b, splits)
                row.update({f"{name}_us": us, f"{name}_splits": variant_splits(splits),
                            f"{name}_hint": hint,
                            f"{name}_over_oracle": round(us / oracle_us, 4)})
                if isinstance(splits, str):
                    row[f"{name}_plan"] = splits
            rows.append(row)
    return rows


GroupHints = tuple[int, ...]  # one hint per batch size of the table, in batch order


class _GroupCosts:
    """Best hints and their summed / worst cost over oracle for each contiguous group.

    With ``per_batch`` each batch size takes its own best hint in the group (the bucket's
    ``batch_hints``); without, one hint must serve every batch size.
    """

    def __init__(self, table: _Table, splits_for: SplitsFn, hints: Sequence[int],
                 max_model_len: int, *, per_batch: bool) -> None:
        self.table, self.splits_for, self.hints = table, splits_for, hints
        self.max_model_len, self.per_batch = max_model_len, per_batch
        self._memo: dict[tuple[int, int], tuple[float, float, GroupHints]] = {}
        self._ratios: dict[tuple[int, int], list[float]] = {}
        pool = set(hints_to_measure(table.contexts, max_model_len)) | set(hints)
        # One hint per distinct split tuple: the smallest power of two, else the smallest
        # (equal plans, so only readability is at stake).
        seen: dict[tuple[int, ...], int] = {}
        pow2_first = sorted((h for h in pool if h <= max_model_len),
                            key=lambda h: (h & (h - 1) != 0, h))
        for h in pow2_first:
            seen.setdefault(tuple(splits_for(b, h) for b in table.batches), h)
        self.candidates = sorted(seen.values())

    def _context_ratios(self, batch: int, hint: int) -> list[float]:
        """Per context: cost / oracle of ``batch`` planned with ``hint``."""
        key = (batch, hint)
        if key not in self._ratios:
            splits = self.splits_for(batch, hint)
            self._ratios[key] = [self.table.ratio(c, batch, splits) for c in self.table.contexts]
        return self._ratios[key]

    def _score(self, i: int, j: int, hints: GroupHints) -> tuple:
        ratios = [r for b, h in zip(self.table.batches, hints, strict=True)
                  for r in self._context_ratios(b, h)[i:j]]
        total, worst = sum(ratios), max(ratios)
        return (round(total, _NDIGITS), round(worst, _NDIGITS), hints, total, worst)

    def best(self, i: int, j: int) -> tuple[float, float, GroupHints]:
        """(summed cost / oracle, worst, hints) of the best hints for contexts[i:j]."""
        key = (i, j)
        if key not in self._memo:
            candidates = self.candidates
            if self.per_batch:  # batches are independent within a group: best hint each
                n = len(self.table.batches)
                hints = tuple(min(candidates, key=lambda h, k=k: self._one(i, j, k, h))
                              for k in range(n))
                options = [self._score(i, j, hints)]
            else:
                options = [self._score(i, j, (h,) * len(self.table.batches))
                           for h in candidates]
            _, _, hints, total, worst = min(options)
            self._memo[key] = (total, worst, hints)
        return self._memo[key]

    def _one(self, i: int, j: int, k: int, hint: int) -> tuple:
        """Score of batch index ``k`` alone in group contexts[i:j] with ``hint``."""
        ratios = self._context_ratios(self.table.batches[k], hint)[i:j]
        return (round(sum(ratios), _NDIGITS), round(max(ratios), _NDIGITS), hint)


def bucket_with_hints(max_len: int, batches: Sequence[int], hints: GroupHints) -> Bucket:
    """A bucket planned with ``hints[k]`` at ``batches[k]``: the smallest batch's hint as the
    base, and a ``batch_hints`` entry wherever the hint changes going up the batch sizes."""
    base, current, extra = hints[0], hints[0], {}
    for b, h in zip(batches[1:], hints[1:], strict=True):
        if h != current:
            extra[b] = current = h
    return Bucket(max_len=max_len, hint=base, batch_hints=extra)


def _partition(n: int, max_buckets: int,
               group: Callable[[int, int], tuple[float, float, GroupHints]], *,
               ends: set[int] | None = None) -> _Choice:
    """Exact DP: best split of contexts[0:n] into <= max_buckets contiguous groups, each
    group ending at an index in ``ends`` (default any; ``n`` always)."""
    layer = {0: _Choice(0.0, 0.0, (), ())}  # prefix end -> best choice with k groups
    finals = []
    for _ in range(min(max_buckets, n)):
        nxt: dict[int, _Choice] = {}
        for j in range(1, n + 1):
            if ends is not None and j not in ends:
                continue
            options = []
            for i, prev in layer.items():
                if i < j:
                    total, worst, hint = group(i, j)
                    options.append(_Choice(prev.total + total, max(prev.worst, worst),
                                           prev.hints + (hint,), prev.ends + (j,)))
            if options:
                nxt[j] = min(options, key=_Choice.key)
        layer = nxt
        if n in layer:
            finals.append(layer[n])
    return min(finals, key=_Choice.key)


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return round(sum(r[key] for r in rows) / len(rows), 4)


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
