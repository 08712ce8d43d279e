"""Near-ties of the kernel table, re-ranked by the whole decode step.

The kernel table times the attention layer alone (cold L2, graph replays of that kernel).
For long, wide batches two plans it ranks within a few percent of each other can differ by
more inside a decode step, where the layer runs between the model's other kernels
(bench/NOTES.md, topic "whole decode step (TPOT) and policies"). So after the buckets are
chosen, each (capture size, bucket) cell of long contexts and large batches whose chosen
plan has near-ties is re-ranked by timing those plans in a step:

- ``tie_cells``: the cells from ``from_batch`` and ``from_context`` (a bucket's top) where
  another plan's kernel time stays within ``tolerance`` of the best plan at every tuned
  context of the bucket (the kernel timing's own spread there);
  at most ``max_candidates`` such plans per cell, fastest at the top first;
- ``retime``: times the chosen hint and its candidates in a step at the bucket's top
  (``step_ms``, e.g. ``measure_step.StepTimer``) and gives the cell the fastest where it
  beats the chosen one by more than ``margin`` (the spread of paired step timing).

Host arithmetic only; the timing is the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from graphbucket.ladder import BucketLadder
from graphbucket.tuning.grid import SplitsFn, TimeTable, candidate_hints

FROM_BATCH, FROM_CONTEXT = 32, 16385  # where the kernel table and the step disagreed
# A candidate may trail the kernel table's best by up to 3 % at a tuned context of the
# bucket: about the run-to-run spread of the kernel timing at these shapes, so the table
# cannot rank such plans and the step decides.
TOLERANCE, MARGIN, MAX_CANDIDATES = 1.03, 0.01, 2

StepMs = Callable[[int, int, Sequence[int]], Mapping[int, float] | None]


@dataclass(frozen=True, slots=True)
class TieCell:
    """Capture size ``batch`` of bucket ``bucket`` (index), timed at ``context`` (its top
    tuned context): the ``chosen`` hint and ``candidates``, hints of other plans within the
    tolerance over the bucket, each with its worst kernel time over the oracle there."""

    batch: int
    bucket: int
    context: int
    chosen: int
    candidates: tuple[tuple[int, float], ...]

    @property
    def hints(self) -> tuple[int, ...]:
        return (self.chosen, *(h for h, _ in self.candidates))


def tie_cells(ladder: BucketLadder, times: TimeTable, splits_for: SplitsFn, *,
              batches: Iterable[int], from_batch: int = FROM_BATCH,
              from_context: int = FROM_CONTEXT, tolerance: float = TOLERANCE,
              max_candidates: int = MAX_CANDIDATES,
              hints: Iterable[int] | None = None) -> list[TieCell]:
    """The cells to re-rank in a step (see the module docstring), in (batch, bucket) order.
    ``hints``: the candidate hints (default ``candidate_hints(max_model_len)``)."""
    pool = sorted(set(hints) if hints is not None else candidate_hints(ladder.max_model_len))
    by_shape: dict[tuple[int, int], dict[Any, float]] = {}
    for (c, b, v), us in times.items():
        by_shape.setdefault((c, b), {})[v] = us
    cells = []
    for batch in sorted(set(batches)):
        if batch < from_batch:
            continue
        for index, (lo, hi) in enumerate(ladder.ranges):
            contexts = sorted(c for c, b in by_shape if b == batch and lo <= c <= hi)
            if not contexts or contexts[-1] < from_context:
                continue
            chosen = ladder.hint_for(index, batch)
            mine = splits_for(batch, chosen)
            seen, found = {mine}, []
            for hint in pool:
                variant = splits_for(batch, hint)
                if variant in seen:
                    continue
                seen.add(variant)
                ratios = [_ratio(by_shape[c, batch], variant) for c in contexts]
                if None in ratios or max(ratios) > tolerance:
                    continue
                found.append((by_shape[contexts[-1], batch][variant], hint, max(ratios)))
            found.sort()
            if found and _ratio(by_shape[contexts[-1], batch], mine) is not None:
                cells.append(TieCell(batch, index, contexts[-1], chosen,
                                     tuple((h, round(r, 4)) for _, h, r in
                                           found[:max_candidates])))
    return cells


def _ratio(row: Mapping[Any, float], variant: Any) -> float | None:
    us = row.get(variant)
    return None if us is None else us / min(row.values())


def with_batch_hint(ladder: BucketLadder, bucket: int, batch: int, hint: int,
                    batches: Iterable[int]) -> BucketLadder:
    """``ladder`` with capture size ``batch`` of bucket ``bucket`` planned at ``hint``,
    every other capture size of ``batches`` keeping the hint it had."""
    sizes = sorted(set(batches) | {batch})
    old = ladder.buckets[bucket]
    wanted = {b: (hint if b == batch else old.hint_for(b)) for b in sizes}
    base = wanted[sizes[0]]
    pairs, last = {}, base
    for b in sizes[1:]:
        if wanted[b] != last:
            pairs[b] = last = wanted[b]
    buckets = list(ladder.buckets)
    buckets[bucket] = replace(old, hint=base, batch_hints=tuple(pairs.items()))
    return BucketLadder(tuple(buckets), ladder.max_model_len, meta=dict(ladder.meta))


def retime(ladder: BucketLadder, cells: Iterable[TieCell], step_ms: StepMs, *,
           batches: Iterable[int], margin: float = MARGIN,
           progress: Callable[[str], None] | None = None
           ) -> tuple[BucketLadder, list[dict[str, Any]]]:
    """Each cell's hints timed in a step (``step_ms(batch, context, hints)`` -> ms per
    hint, or None where it cannot be timed: the cell is skipped) and the fastest given the
    cell where it beats the chosen hint by more than ``margin``. Returns the ladder and a
    record per cell timed (what the report keeps; ``saved_step_ms`` replays them)."""
    sizes = list(batches)
    records = []
    cells = list(cells)
    for i, cell in enumerate(cells):
        ms = step_ms(cell.batch, cell.context, cell.hints)
        if ms is None:
            continue
        best = min(cell.hints, key=lambda h: (ms[h], h))
        keep = ms[cell.chosen] <= (1 + margin) * ms[best]
        hint = cell.chosen if keep else best
        if hint != cell.chosen:
            ladder = with_batch_hint(ladder, cell.bucket, cell.batch, hint, sizes)
        records.append({"batch": cell.batch, "bucket_max_len": ladder.buckets[cell.bucket]
                        .max_len, "context": cell.context, "chosen": cell.chosen,
                        "kernel_worst_over_oracle": dict(cell.candidates),
                        "step_ms": {str(h): round(ms[h], 4) for h in cell.hints},
                        "hint": hint})
        if progress is not None:
            progress(f"[step ties {i + 1}/{len(cells)}] batch {cell.batch} x {cell.context}: "
                     + ", ".join(f"hint {h} {ms[h]:.3f} ms" for h in cell.hints)
                     + f" -> hint {hint}")
    return ladder, records


def saved_step_ms(records: Iterable[Mapping[str, Any]]) -> StepMs:
    """``step_ms`` from a report's records: a cell's times where every hint asked for was
    timed at that (batch, context), else None."""
    saved = {(int(r["batch"]), int(r["context"])): {int(h): float(ms)
                                                   for h, ms in r["step_ms"].items()}
             for r in records}

    def step_ms(batch: int, context: int, hints: Sequence[int]) -> Mapping[int, float] | None:
        row = saved.get((batch, context))
        return row if row is not None and all(h in row for h in hints) else None
    return step_ms
