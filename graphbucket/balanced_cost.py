"""Which of a bucket's two balanced graphs a ragged batch replays: a host cost model.

No balanced kernel wins every ragged shape of a length range: a few long requests among
short ones favour the per-item seesaw's plain chunks, a spread from 1 token the fitted
chunks or the tile ranges. A bucket may therefore capture a second balanced graph per
capture size (``Bucket.alternate_kernels``), and the selector replays whichever this model
predicts faster for the step's host lengths.

The model mirrors each kernel's partition of the step's 64-token tiles on the host (the
device planners' rules, ``kernels/balanced.py``): the chunk, the work items and how the
programs take them, and from that the busiest program's load in tiles (``makespan``),
each item or range segment charged ``overhead_tiles`` more. A kernel's time is then linear
in (1, makespan, padded rows, work items), with coefficients the tuner fits to the mixes
it timed (``fit_kernel_cost``). Host numpy only, and only on steps that replay a balanced
graph of a bucket with an alternate.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from graphbucket.plan import RANGE_REQUEST_CHARGE_TILES

TILE = 64  # tokens per tile of the seesaw's partition; other tile sizes are scaled to it

# How a balanced kernel's programs take the step's work (``partition_of``).
ITEMS, FITTED, RANGES, CHARGED, STRIDED = "items", "fitted", "ranges", "charged", "strided"
_KINDS = (ITEMS, FITTED, RANGES, CHARGED, STRIDED)


@dataclass(frozen=True, slots=True)
class Partition:
    """How one balanced plan cuts a step: ``kind`` (one program per work item, ``items``;
    the same with chunks fitted to at most ``programs`` items, ``fitted``; one persistent
    program per equal range of tiles, ``ranges``; persistent programs striding over the
    items, ``strided``, ``per_sm`` of them per SM; the ranges cut by work, ``charged``, each
    live request counting ``charge`` tiles more), ``programs`` per head block, tile size
    ``block_n`` and the smallest chunk ``min_chunk`` in tiles."""

    kind: str
    programs: int
    block_n: int
    min_chunk: int
    per_sm: int = 1
    charge: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Partition.kind must be one of {_KINDS}, got {self.kind!r}")
        if min(self.programs, self.block_n, self.min_chunk, self.per_sm) < 1:
            raise ValueError(f"Partition needs positive programs, block_n, min_chunk and "
                             f"per_sm, got {self}")
        if self.charge < 0 or (self.charge and self.kind != CHARGED):
            raise ValueError(f"Partition.charge is a charged cut's, at least 0; got {self}")

    @property
    def cut(self) -> tuple[str, int, int, int, int]:
        """What the plan decides (kind, programs, tile size, smallest chunk, charge);
        ``per_sm`` follows from the GPU's SM count."""
        return self.kind, self.programs, self.block_n, self.min_chunk, self.charge

    def to_list(self) -> list:
        return [self.kind, self.programs, self.block_n, self.min_chunk, self.per_sm] + \
            ([self.charge] if self.kind == CHARGED else [])

    @classmethod
    def from_list(cls, raw: Sequence) -> Partition:
        if not isinstance(raw, Sequence) or len(raw) not in (5, 6):
            raise ValueError(f"a partition is [kind, programs, block_n, min_chunk, per_sm"
                             f"(, charge)], got {raw!r}")
        kind, values = str(raw[0]), [int(v) for v in raw[1:]]
        if len(values) == 4 and kind == CHARGED:  # saved before the charge was the plan's
            values.append(RANGE_REQUEST_CHARGE_TILES)
        return cls(kind, *values)


def partition_of(plan: Any, num_sms: int | None) -> Partition:
    """The partition of a balanced ``LaunchPlan`` (``plan.balanced`` must hold) on a GPU of
    ``num_sms`` SMs (None: not known, ``per_sm`` 1; compare such partitions by ``cut``)."""
    if not plan.balanced:
        raise ValueError(f"partition_of needs a balanced plan, got {plan.describe()}")
    if plan.tile_ranges:
        kind = CHARGED if plan.charged_ranges else RANGES
    elif plan.seesaw:
        kind = FITTED if plan.fit_items else ITEMS
    else:
        kind = STRIDED
    programs = plan.persistent_programs
    per_sm = 1
    if kind == STRIDED and num_sms:
        per_sm = max(1, programs * plan.num_head_blocks // num_sms)
    charge = plan.range_charge_tiles if kind == CHARGED else 0
    return Partition(kind, programs, plan.block_n, plan.min_chunk_tiles, per_sm, charge)


def _item_count(tiles: np.ndarray, chunk: int) -> int:
    return int(np.ceil(tiles / chunk).sum())


def _chunk(tiles: np.ndarray, part: Partition) -> int:
    """The device planner's chunk in tiles: cdiv(total, programs), at least ``min_chunk``;
    fitted, the smallest chunk up to 1.5x that giving at most ``programs`` items, where
    the live requests fit the programs (bisected, as the device does)."""
    plain = max(part.min_chunk, -(-int(tiles.sum()) // part.programs))
    if part.kind != FITTED or np.count_nonzero(tiles) > part.programs:
        return plain
    lo, hi = plain, max(plain, int(tiles.max()))
    if _item_count(tiles, lo) <= part.programs or _item_count(tiles, hi) > part.programs:
        return plain
    while lo + 1 < hi:  # items(lo) > programs >= items(hi)
        mid = (lo + hi) // 2
        if _item_count(tiles, mid) <= part.programs:
            hi = mid
        else:
            lo = mid
    return hi if 2 * hi <= 3 * plain else plain


def _items(tiles: np.ndarray, chunk: int) -> tuple[np.ndarray, int]:
    """(every work item's tiles, in request order; the partials: items of requests cut in
    two or more, as a request of one item gets its output from stage 1)."""
    live = tiles[tiles > 0]
    counts = np.ceil(live / chunk).astype(np.int64)
    items = np.full(int(counts.sum()), float(chunk))
    last = np.cumsum(counts) - 1
    items[last] = live - (counts - 1) * chunk
    return items, int(counts[counts > 1].sum())


def _waves(items: np.ndarray, slots: int, overhead: float) -> float:
    """One program per item on ``slots`` SMs, each item taken in order by the SM that
    frees up first (list scheduling; a sorted list is already a min-heap)."""
    work = items + overhead
    finish = np.sort(work[:slots]).tolist()
    for w in work[slots:].tolist():
        heapq.heapreplace(finish, finish[0] + w)
    return max(finish) if finish else 0.0


def _strided(items: np.ndarray, part: Partition, overhead: float) -> float:
    """Persistent programs taking items p, p + G, ...; ``per_sm`` programs share an SM,
    so the busiest SM's share bounds the step as much as the busiest program."""
    g = part.programs
    work = np.zeros(-(-items.size // g) * g)
    work[:items.size] = items + overhead
    per_program = work.reshape(-1, g).sum(axis=0)
    sms = max(1, g // part.per_sm)
    padded = np.zeros(-(-g // sms) * sms)
    padded[:g] = per_program
    per_sm = padded.reshape(-1, sms).sum(axis=0) / part.per_sm
    return float(max(per_program.max(), per_sm.max()))


def charged_bounds(tiles: np.ndarray, programs: int, min_chunk: int, charge: int
                   ) -> np.ndarray:
    """The device's cut (``kernels.balanced.plan_tile_ranges_kernel``): int64
    [programs + 1] tile bounds of the programs' ranges, each live request counting
    ``charge`` units before its tiles (0: equal tile ranges)."""
    tiles = np.asarray(tiles, dtype=np.int64)
    units = np.where(tiles > 0, tiles + charge, 0)
    total_units, total_tiles = int(units.sum()), int(tiles.sum())
    per = max(min_chunk, -(-total_units // programs))
    x = np.minimum(np.arange(programs + 1, dtype=np.int64) * per, total_units)
    unit_ends, tile_ends = np.cumsum(units), np.cumsum(tiles)
    owner = np.searchsorted(unit_ends, x, side="right")  # first request ending past x
    inside = owner < tiles.size
    safe = np.minimum(owner, max(tiles.size - 1, 0))
    first_unit = np.where(owner > 0, unit_ends[np.maximum(owner - 1, 0)], 0)
    first_tile = np.where(owner > 0, tile_ends[np.maximum(owner - 1, 0)], 0)
    into = np.clip(x - first_unit - charge, 0, np.where(inside, tiles[safe], 0))
    return np.where(inside & (x < total_units), first_tile + into, total_tiles)


def _ranges(tiles: np.ndarray, part: Partition, overhead: float, charge: int
            ) -> tuple[float, int]:
    """One program per range of tiles across request boundaries (equal ranges at ``charge``
    0, else a charged cut's), each (request, range) segment charged ``overhead``: (the
    busiest range, the partials written: the segments of the requests the cut splits, as a
    request left whole writes its output instead)."""
    live = tiles[tiles > 0].astype(np.int64)
    if not live.size:
        return 0.0, 0
    bounds = charged_bounds(live, part.programs, part.min_chunk, charge)
    lo, hi = bounds[:-1], bounds[1:]
    ends = np.cumsum(live)
    starts = ends - live
    first = np.searchsorted(ends, lo, side="right")
    last = np.searchsorted(starts, hi, side="left") - 1
    segments = np.where(hi > lo, last - first + 1, 0)
    # A request no program bound falls inside is whole: no partial.
    inner = np.searchsorted(bounds, ends, "left") - np.searchsorted(bounds, starts, "right")
    partials = int(segments.sum()) - int(np.count_nonzero(inner == 0))
    return float(((hi - lo) + overhead * segments).max()), partials


def makespan(lens: Sequence[int] | np.ndarray, part: Partition, overhead: float
             ) -> tuple[float, int]:
    """(the busiest program's load in 64-token tiles, the partials the merge reads: work
    items or range segments of the requests cut in two or more) of a step with host lengths
    ``lens`` under ``part``, each item or segment charged ``overhead`` tiles."""
    tiles = np.ceil(np.asarray(lens, dtype=np.float64) / part.block_n)
    scale = part.block_n / TILE
    if part.kind in (RANGES, CHARGED):
        load, segments = _ranges(tiles, part, overhead / scale, part.charge)
        return load * scale, segments
    items, partials = _items(tiles, _chunk(tiles, part))
    if part.kind == STRIDED:
        return _strided(items, part, overhead / scale) * scale, partials
    return _waves(items, part.programs, overhead / scale) * scale, partials


@dataclass(frozen=True, slots=True)
class KernelCost:
    """One balanced kernel's time in us: ``coefficients`` (constant, per makespan tile,
    per padded row, per work item) over ``makespan(..., overhead_tiles)``."""

    overhead_tiles: float
    coefficients: tuple[float, float, float, float]

    def features(self, lens: Sequence[int] | np.ndarray, rows: int, part: Partition
                 ) -> np.ndarray:
        load, items = makespan(lens, part, self.overhead_tiles)
        return np.array([1.0, load, float(rows), float(items)])

    def predict(self, lens: Sequence[int] | np.ndarray, rows: int, part: Partition) -> float:
        return float(np.dot(self.coefficients, self.features(lens, rows, part)))


@dataclass(frozen=True)
class BalancedCostModel:
    """Per balanced kernel, its cost (``costs``) and its partition at each capture size
    (``partitions``: kernel -> capture size -> ``Partition``, as the tuner's backend
    planned it; ``GraphTable`` checks its own plans against them). ``by_batch``: kernel ->
    capture size -> a cost fitted on that size's mixes alone, used there in place of the
    kernel's (a kernel's time per makespan tile and per item changes with the rows)."""

    costs: Mapping[str, KernelCost]
    partitions: Mapping[str, Mapping[int, Partition]]
    by_batch: Mapping[str, Mapping[int, KernelCost]] = field(default_factory=dict)

    def predict(self, kernel: str, batch_size: int, lens: Sequence[int] | np.ndarray
                ) -> float:
        """Predicted us of ``kernel``'s balanced graph of ``batch_size`` (padded) rows."""
        own = self.by_batch.get(kernel)
        cost = (own.get(batch_size) if own else None) or self.costs[kernel]
        return cost.predict(lens, batch_size, self.partitions[kernel][batch_size])

    def covers(self, kernel: str, batch_size: int) -> bool:
        return kernel in self.costs and batch_size in self.partitions.get(kernel, {})

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for k, c in self.costs.items():
            entry = {**_cost_dict(c),
                     "partitions": {str(b): p.to_list()
                                    for b, p in sorted(self.partitions.get(k, {}).items())}}
            if self.by_batch.get(k):
                entry["by_batch"] = {str(b): _cost_dict(own)
                                     for b, own in sorted(self.by_batch[k].items())}
            out[k] = entry
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> BalancedCostModel:
        if not isinstance(raw, Mapping) or not raw:
            raise ValueError(f"balanced_cost must map kernel names to their cost, got {raw!r}")
        costs, partitions, by_batch = {}, {}, {}
        for kernel, entry in raw.items():
            try:
                costs[kernel] = _cost_from(entry)
                partitions[kernel] = {int(b): Partition.from_list(p)
                                      for b, p in entry["partitions"].items()}
                if entry.get("by_batch"):
                    by_batch[kernel] = {int(b): _cost_from(own)
                                        for b, own in entry["by_batch"].items()}
            except (KeyError, TypeError, ValueError, AttributeError) as err:
                raise ValueError(
                    f"balanced_cost[{kernel!r}] must have overhead_tiles, four coefficients "
                    f"(constant, per makespan tile, per row, per item), partitions "
                    f"{{capture size: [kind, programs, block_n, min_chunk, per_sm]}} and "
                    f"optionally by_batch {{capture size: {{overhead_tiles, coefficients}}}}: "
                    f"{err}") from None
        return cls(costs, partitions, by_batch)


def _cost_dict(cost: KernelCost) -> dict[str, Any]:
    return {"overhead_tiles": cost.overhead_tiles,
            "coefficients": [round(x, 6) for x in cost.coefficients]}


def _cost_from(entry: Mapping[str, Any]) -> KernelCost:
    coef = tuple(float(x) for x in entry["coefficients"])
    if len(coef) != 4:
        raise ValueError("four coefficients")
    return KernelCost(float(entry["overhead_tiles"]), coef)


def fit_kernel_cost(samples: Sequence[tuple[Sequence[int], int, float]], part_for: Any,
                    overheads: Sequence[float] = (0, 0.5, 1, 2, 3, 4, 6, 8)) -> KernelCost:
    """The ``KernelCost`` of one kernel from ``(lens, padded rows, us)`` samples:
    ``part_for(rows)`` is its partition at that capture size. Per candidate overhead, the
    coefficients minimising the squared relative error; kept, the overhead with the
    smallest worst relative error."""
    if len(samples) < 4:
        raise ValueError(f"fitting a kernel's cost needs at least 4 timed mixes, got "
                         f"{len(samples)}")
    times = np.array([us for _, _, us in samples])
    best: tuple[float, KernelCost] | None = None
    for c in overheads:
        probe = KernelCost(float(c), (0.0, 0.0, 0.0, 0.0))
        x = np.stack([probe.features(lens, rows, part_for(rows))
                      for lens, rows, _ in samples]) / times[:, None]
        coef = np.linalg.lstsq(x, np.ones_like(times), rcond=None)[0]
        worst = float(np.abs(x @ coef - 1).max())
        if best is None or worst < best[0]:
            best = (worst, KernelCost(float(c), tuple(float(v) for v in coef)))
    return best[1]
