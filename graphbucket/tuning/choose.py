"""Ladder tuning, the choosing step: bucket bounds and hints from measured decode times.

Pure host arithmetic (no torch at import). What to measure (contexts, hints, the variants
they capture) and the timing table are ``graphbucket.tuning.grid``; the measuring step that
fills the table on a GPU is ``graphbucket.tuning.measure.measure_split_times``;
``scripts/tune_ladder.py`` runs them all.

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
  context weighs as much as a 64-token one), each cell above ``tolerance`` (default 1.02)
  charged ``excess_weight`` (default 10) times its excess on top: a bucket is spent where
  one length runs 10 % slow rather than where many run 0.1 % slow (``excess_weight=0``:
  the plain sum). A dynamic program over (groups used, prefix
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

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from graphbucket.ladder import Bucket, BucketLadder, default_ladder
from graphbucket.tuning.grid import (
    SplitsFn,
    TimeTable,
    TimingTable,
    candidate_hints,
    check_positive,
    hints_to_measure,
    variant_splits,
)

_NDIGITS = 9  # rounding before comparing sums of cost/oracle ratios
TOLERANCE, EXCESS_WEIGHT = 1.02, 10.0  # the objective's charge for a cell far from its oracle


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


@dataclass(frozen=True, slots=True)
class _Choice:
    total: float  # the objective: sum of cost / oracle, excess over tolerance charged
    worst: float  # max of cost / oracle
    hints: tuple[GroupHints, ...]
    ends: tuple[int, ...]  # exclusive end index of each group into the sorted contexts
    raw_total: float = 0.0  # sum of cost / oracle

    def key(self) -> tuple:
        return (round(self.total, _NDIGITS), round(self.worst, _NDIGITS), len(self.hints),
                self.hints, self.ends)


def choose_ladder(times: TimeTable, splits_for: SplitsFn, *, max_model_len: int,
                  max_buckets: int, hints: Iterable[int] | None = None,
                  baseline: BucketLadder | None = None,
                  meta: Mapping[str, Any] | None = None,
                  per_batch_hints: bool = True,
                  bounds_at: Iterable[int] | None = None, tolerance: float = TOLERANCE,
                  excess_weight: float = EXCESS_WEIGHT) -> TuneResult:
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
    check_positive("max_model_len", max_model_len)
    check_positive("max_buckets", max_buckets)
    table = TimingTable(times)
    if table.contexts[-1] > max_model_len:
        raise ValueError(f"measured context {table.contexts[-1]} is above max_model_len="
                         f"{max_model_len}; drop it from the table or raise max_model_len")
    hints = candidate_hints(max_model_len) if hints is None else sorted(set(hints))
    for h in hints:
        check_positive("candidate hint", h)
    if excess_weight < 0 or tolerance < 1:
        raise ValueError(f"excess_weight must be >= 0 and tolerance >= 1, got "
                         f"{excess_weight!r}, {tolerance!r}")
    groups = _GroupCosts(table, splits_for, hints, max_model_len, per_batch=per_batch_hints,
                         tolerance=tolerance, excess_weight=excess_weight)
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
                  "tolerance": tolerance, "excess_weight": excess_weight,
                  "mean_over_oracle": round(best.raw_total / num, 4),
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


def compare_ladders(times: TimeTable | TimingTable, splits_for: SplitsFn,
                    ladders: Mapping[str, BucketLadder]) -> list[dict[str, Any]]:
    """Per measured (context, batch): the oracle and, per named ladder, the time of the
    graph that ladder replays there (``{name}_us``, ``{name}_splits``, ``{name}_hint``,
    ``{name}_over_oracle``)."""
    table = times if isinstance(times, TimingTable) else TimingTable(times)
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

    def __init__(self, table: TimingTable, splits_for: SplitsFn, hints: Sequence[int],
                 max_model_len: int, *, per_batch: bool, tolerance: float = TOLERANCE,
                 excess_weight: float = EXCESS_WEIGHT) -> None:
        self.table, self.splits_for, self.hints = table, splits_for, hints
        self.max_model_len, self.per_batch = max_model_len, per_batch
        self.tolerance, self.excess_weight = tolerance, excess_weight
        self._memo: dict[tuple[int, int], tuple[float, float, GroupHints, float]] = {}
        self._ratios: dict[tuple[int, int], list[float]] = {}
        self._costs: dict[tuple[int, int], list[float]] = {}
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

    def _context_costs(self, batch: int, hint: int) -> list[float]:
        """Per context: the objective's charge, cost / oracle plus the weighted excess."""
        key = (batch, hint)
        if key not in self._costs:
            tol, weight = self.tolerance, self.excess_weight
            self._costs[key] = [r + weight * (r - tol) if r > tol else r
                                for r in self._context_ratios(batch, hint)]
        return self._costs[key]

    def _score(self, i: int, j: int, hints: GroupHints) -> tuple:
        pairs = list(zip(self.table.batches, hints, strict=True))
        ratios = [r for b, h in pairs for r in self._context_ratios(b, h)[i:j]]
        total = sum(c for b, h in pairs for c in self._context_costs(b, h)[i:j])
        worst = max(ratios)
        return (round(total, _NDIGITS), round(worst, _NDIGITS), hints, total, worst,
                sum(ratios))

    def best(self, i: int, j: int) -> tuple[float, float, GroupHints, float]:
        """(objective, worst cost / oracle, hints, summed cost / oracle) of the best hints
        for contexts[i:j]."""
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
            _, _, hints, total, worst, raw = min(options)
            self._memo[key] = (total, worst, hints, raw)
        return self._memo[key]

    def _one(self, i: int, j: int, k: int, hint: int) -> tuple:
        """Score of batch index ``k`` alone in group contexts[i:j] with ``hint``."""
        batch = self.table.batches[k]
        costs = self._context_costs(batch, hint)[i:j]
        ratios = self._context_ratios(batch, hint)[i:j]
        return (round(sum(costs), _NDIGITS), round(max(ratios), _NDIGITS), hint)


def bucket_with_hints(max_len: int, batches: Sequence[int], hints: GroupHints) -> Bucket:
    """A bucket planned with ``hints[k]`` at ``batches[k]``: the smallest batch's hint as the
    base, and a ``batch_hints`` entry wherever the hint changes going up the batch sizes."""
    base, current, extra = hints[0], hints[0], {}
    for b, h in zip(batches[1:], hints[1:], strict=True):
        if h != current:
            extra[b] = current = h
    return Bucket(max_len=max_len, hint=base, batch_hints=extra)


def _partition(n: int, max_buckets: int,
               group: Callable[[int, int], tuple[float, float, GroupHints, float]], *,
               ends: set[int] | None = None) -> _Choice:
    """Exact DP: best split of contexts[0:n] into <= max_buckets contiguous groups, each
    group ending at an index in ``ends`` (default any; ``n`` always)."""
    layer = {0: _Choice(0.0, 0.0, (), (), 0.0)}  # prefix end -> best choice with k groups
    finals = []
    for _ in range(min(max_buckets, n)):
        nxt: dict[int, _Choice] = {}
        for j in range(1, n + 1):
            if ends is not None and j not in ends:
                continue
            options = []
            for i, prev in layer.items():
                if i < j:
                    total, worst, hint, raw = group(i, j)
                    options.append(_Choice(prev.total + total, max(prev.worst, worst),
                                           prev.hints + (hint,), prev.ends + (j,),
                                           prev.raw_total + raw))
            if options:
                nxt[j] = min(options, key=_Choice.key)
        layer = nxt
        if n in layer:
            finals.append(layer[n])
    return min(finals, key=_Choice.key)


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return round(sum(r[key] for r in rows) / len(rows), 4)
