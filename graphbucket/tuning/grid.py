"""Ladder tuning, what to measure: the grid of contexts, hints and variants; the timings.

Pure host arithmetic (no torch at import). ``graphbucket.tuning.choose`` chooses the ladder
from what is measured here (its docstring gives the method); the measuring step that times
the grid on a GPU is ``graphbucket.tuning.measure.measure_split_times``.

- contexts: the base grid (``tuning_contexts``) or the ones given, each context + 1
  (``edge_contexts``, so a bound can be scored at both its ends: ``bounds_with_edges``),
  and midpoints where the oracle's split count changes (``refine_contexts``);
- hints: every hint the chooser may plan with (``hints_to_measure``);
- variants: per batch, the split counts (``splits_to_measure``) or the plans
  (``plans_to_measure``) those hints capture: split-KV plans (``hint_plans``) or sparse
  decode plans (``sparse_hint_plans``);
- the timing table, ``{(context, batch, variant): us}``, to and from JSON rows
  (``times_to_rows``, ``times_from_rows``) and indexed with its oracle (``TimingTable``).
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from graphbucket.ladder import BucketLadder
from graphbucket.plan import (
    H200_NUM_SMS,
    MAX_KV_SPLITS,
    LaunchPlan,
    plan_mla_decode,
    pow2_ceil,
)

if TYPE_CHECKING:  # annotations only: sparse plans are imported where they are made
    from graphbucket.sparse.plan import SparsePlan

Variant = int | str  # a split count, or a plan's describe()
TimeKey = tuple[int, int, Variant]  # (context, batch, variant)
TimeTable = Mapping[TimeKey, float]
SplitsFn = Callable[[int, int], Variant]  # (batch, hint) -> variant
PlanFn = Callable[[int, int], "LaunchPlan | SparsePlan"]  # (batch, hint) -> the plan captured

_SPLITS_RE = re.compile(r"splits=(\d+) ")
_SPARSE_SPLITS_RE = re.compile(r"sparse .*\bindexer_splits=(\d+) attention_splits=(\d+) ")


def tuning_contexts(max_model_len: int) -> list[int]:
    """The tuner's base grid: 1, each power of two from 4 and the geometric midpoint of
    each pair of them (round(2^(k + 1/2))), up to ``max_model_len``, and ``max_model_len``.
    A bucket spans at least a factor of two, so each one is timed inside as well as at its
    ends; the oracle checks other lengths (a quarter of the way in either direction)."""
    check_positive("max_model_len", max_model_len)
    grid = {1, max_model_len}
    for k in range(2, max_model_len.bit_length()):
        grid |= {1 << k, round(2 ** (k + 0.5))}
    return sorted(c for c in grid if c <= max_model_len)


def candidate_hints(max_model_len: int) -> list[int]:
    """Powers of two 1, 2, 4, ... up to ``max_model_len``, and ``max_model_len``."""
    check_positive("max_model_len", max_model_len)
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
    check_positive("q_len", q_len)

    @functools.cache
    def plan_for(batch: int, hint: int) -> LaunchPlan:
        return plan_mla_decode(batch, num_heads * q_len, hint, num_sms=num_sms,
                               max_splits=max_splits)
    return plan_for


def sparse_hint_plans(num_heads: int, *, topk: int, num_sms: int = H200_NUM_SMS,
                      q_len: int = 1) -> PlanFn:
    """``plan_for(batch, hint)``: the sparse decode plan a graph of ``batch`` requests
    captures at ``hint``, as ``SparseBackend.plan`` plans it (batch x q_len flat rows of
    ``num_heads`` heads each)."""
    from graphbucket.sparse.plan import plan_sparse_decode  # the sparse package loads torch

    check_positive("q_len", q_len)

    @functools.cache
    def plan_for(batch: int, hint: int) -> SparsePlan:
        return plan_sparse_decode(batch * q_len, num_heads, hint, topk=topk, num_sms=num_sms)
    return plan_for


def plan_variants(plan_for: PlanFn) -> SplitsFn:
    """``splits_for`` whose variants are plans: ``plan_for(batch, hint).describe()``."""
    return lambda batch, hint: plan_for(batch, hint).describe()


def variant_splits(variant: Variant) -> int:
    """The split count of a variant (a split count, or a split plan's describe()); of a
    sparse plan, its indexer's (the count that keeps growing with the context past top-k)."""
    return variant_split_counts(variant)[0]


def variant_split_counts(variant: Variant) -> tuple[int, ...]:
    """Every split count a variant fixes: ``(splits,)`` for split-KV, ``(indexer,
    attention)`` for a sparse plan's describe()."""
    if isinstance(variant, int):
        return (variant,)
    found = _SPLITS_RE.match(variant)
    if found is not None:
        return (int(found.group(1)),)
    found = _SPARSE_SPLITS_RE.match(variant)
    if found is None:
        raise ValueError(f"variant {variant!r} is not a split plan's describe() "
                         "('splits=N ...') nor a sparse plan's ('sparse ... indexer_splits=N "
                         "attention_splits=M ...'); time split-KV or sparse plans only")
    return int(found.group(1)), int(found.group(2))


def plans_to_measure(batches: Iterable[int], plan_for: PlanFn, hints: Iterable[int]
                     ) -> dict[int, dict[str, LaunchPlan]]:
    """Per batch: every distinct plan ``hints`` capture, by ``describe()``, fewest splits
    first. Only these can be replayed, so only these are timed."""
    hints = list(hints)
    out = {}
    for batch in sorted(set(batches)):
        plans = {plan_for(batch, h).describe(): plan_for(batch, h) for h in hints}
        out[batch] = dict(sorted(plans.items(),
                                 key=lambda kv: (variant_split_counts(kv[0]), kv[0])))
    return out


def refine_contexts(times: TimeTable, max_new: int) -> list[int]:
    """Contexts to measure next: the geometric midpoint of each pair of neighbouring
    measured contexts where some batch's best split counts change, at most ``max_new``.
    The gaps where it matters most go first: those where neither end's best plan is close
    to the best at the other end (``_crossing_cost``), then the widest (ties: the
    shorter). The ladder is exact at measured contexts only, so the grid is made dense
    only where the choice changes."""
    table = TimingTable(times)
    gaps = []
    for lo, hi in itertools.pairwise(table.contexts):
        mid = round(math.sqrt(lo * hi))
        if not lo < mid < hi:
            continue
        changed = [b for b in table.batches
                   if variant_split_counts(table.oracle[(lo, b)][0])
                   != variant_split_counts(table.oracle[(hi, b)][0])]
        if changed:
            cost = max(_crossing_cost(table, lo, hi, b) for b in changed)
            gaps.append((-cost, -hi / lo, mid))
    return sorted(mid for *_, mid in sorted(gaps)[:max_new])


def _crossing_cost(table: TimingTable, lo: int, hi: int, batch: int) -> float:
    """Over the two ends' best plans, the smaller of each one's worst ratio to the best at
    either end: what one bound-free bucket over [lo, hi] would lose at its ends (inf when a
    plan was not timed at the other end)."""
    worst = []
    for end in (lo, hi):
        plan = table.oracle[(end, batch)][0]
        ratios = [table.by_shape[(c, batch)].get(plan, math.inf) / table.oracle[(c, batch)][1]
                  for c in (lo, hi)]
        worst.append(max(ratios))
    return min(worst)


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
    return (c, b, variant_split_counts(v), str(v))


def times_from_rows(rows: Iterable[Mapping[str, Any]]) -> dict[TimeKey, float]:
    """Inverse of ``times_to_rows``."""
    return {(int(r["context"]), int(r["batch"]), r["plan"] if "plan" in r else int(r["splits"])):
            float(r["us"]) for r in rows}


def timed_plans(rows: Iterable[Mapping[str, Any]]) -> bool:
    """Whether a report's timing rows are keyed by plan (else by split count)."""
    return any("plan" in r for r in rows)


class TimingTable:
    """Times indexed by (context, batch), with the oracle and a loud lookup."""

    def __init__(self, times: TimeTable) -> None:
        by_shape: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
        for key, us in times.items():
            if len(key) != 3:
                raise ValueError(f"timing keys are (context, batch, splits), got {key!r}")
            for name, value in zip(("context", "batch"), key[:2], strict=True):
                check_positive(f"timing key {name}", value)
            if not (isinstance(key[2], str) and key[2]):
                check_positive("timing key splits", key[2])
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


def check_positive(name: str, value: object) -> None:
    """ValueError unless ``value`` is an int >= 1 (bools refused), naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
