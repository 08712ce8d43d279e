"""Two balanced kernels per capture size: the cost model and which pair a bucket captures.

The tuner times every balanced kernel on every ragged mix (``tuning.ragged``). From those
times ``fit_cost_model`` fits one ``KernelCost`` per kernel over all mixes (each kernel's
partition at each capture size planned by the backend) and one per kernel and capture size
that has enough mixes of its own, and ``choose_kernel_pairs`` keeps,
per capture size, the kernel with the smallest summed ratio to the fastest per mix, plus a
second kernel where replaying whichever of the two the model predicts faster lowers the
worst or the mean ratio by ``MIN_GAIN`` (an extra graph per bucket must earn its capture).
Host arithmetic only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import combinations

from graphbucket.balanced_cost import BalancedCostModel, Partition, fit_kernel_cost

# Smallest drop in the worst (or mean) ratio to the fastest kernel per mix that adopts a
# second balanced kernel; below it one graph serves as well within timing noise.
MIN_GAIN = 0.005
# Mixes a capture size needs for a cost of its own (four coefficients and the overhead;
# fewer: the kernel's cost fitted over every size).
MIN_BATCH_MIXES = 15


def fit_cost_model(samples: Sequence, partition: Callable[[str, int], Partition],
                   capture_sizes: Sequence[int]) -> BalancedCostModel:
    """One cost per kernel timed on every sample (``RaggedSample.kernel_us``), its
    partition at each of ``capture_sizes`` from ``partition(kernel, batch_size)``; and
    one per kernel and capture size with at least ``MIN_BATCH_MIXES`` mixes of its own,
    which the model uses at that size."""
    if not samples:
        raise ValueError("fitting the balanced cost model needs timed ragged mixes")
    timed = [s.kernel_us() for s in samples]
    kernels = [k for k in timed[0] if all(k in t for t in timed)]
    parts = {k: {b: partition(k, b) for b in capture_sizes} for k in kernels}
    costs, by_batch = {}, {}
    for k in kernels:
        def part_for(b: int, k: str = k) -> Partition:
            return parts[k].get(b) or partition(k, b)

        rows = [(s.lens, s.batch, t[k]) for s, t in zip(samples, timed, strict=True)]
        costs[k] = fit_kernel_cost(rows, part_for)
        own = {b: [r for r in rows if r[1] == b] for b in sorted({r[1] for r in rows})}
        by_batch[k] = {b: fit_kernel_cost(mine, part_for) for b, mine in own.items()
                       if len(mine) >= MIN_BATCH_MIXES}
    return BalancedCostModel(costs, parts, {k: v for k, v in by_batch.items() if v})


def _ratios(samples: Sequence, pick: Callable) -> list[float]:
    """Each sample's time with the kernel ``pick(sample)`` over its fastest kernel's."""
    out = []
    for s in samples:
        t = s.kernel_us()
        out.append(t[pick(s)] / min(t.values()))
    return out


def choose_kernel_pairs(samples: Sequence, model: BalancedCostModel | None = None
                        ) -> tuple[dict[int, str], dict[int, str], list]:
    """Per capture size: (kernel, alternate kernel or "" for none, the samples with the
    time of the kernel the selector would replay). Alone, the kernel with the smallest
    summed ratio to the fastest per mix (ties: timing order, the backend's default first);
    kernels not timed on every mix of a batch size are not candidates there. With a
    ``model``, the pair whose model-chosen times have the smallest (worst, mean) ratio,
    where that beats the kernel alone by ``MIN_GAIN`` in one and loses in neither."""
    kernels: dict[int, str] = {}
    alternates: dict[int, str] = {}
    out: list = []
    for batch in sorted({s.batch for s in samples}):
        mine = [s for s in samples if s.batch == batch]
        timed = [s.kernel_us() for s in mine]
        names = [k for k in timed[0] if all(k in t for t in timed)]
        if not names:
            raise ValueError(f"no balanced kernel was timed on every mix at batch {batch}")
        summed = {k: round(sum(_ratios(mine, lambda s, k=k: k)), 9) for k in names}
        order = sorted(names, key=lambda k: (summed[k], names.index(k)))
        main, alt = order[0], ""
        if model is not None:
            main, alt = _best_pair(mine, batch, order, model)
        kernels[batch], alternates[batch] = main, alt
        out += [s.with_kernel(faster_kernel(model, batch, s.lens, main, alt))
                for s in mine]
    return kernels, alternates, out


def _best_pair(samples: Sequence, batch: int, order: list[str], model: BalancedCostModel
               ) -> tuple[str, str]:
    """(kernel, alternate or "") at one capture size, ``order`` the kernels alone, best
    first, each option scored by its ratios to the fastest balanced kernel per mix."""

    def score(main: str, alt: str) -> tuple[float, float]:
        ratios = _ratios(samples, lambda s: faster_kernel(model, batch, s.lens, main, alt))
        return round(max(ratios), 4), round(sum(ratios) / len(ratios), 4)

    return best_pair(order[0], order, batch, model, score)


def best_pair(alone: str, order: Sequence[str], batch: int, model: BalancedCostModel,
              score: Callable[[str, str], tuple[float, float]]) -> tuple[str, str]:
    """(``alone``, "") or the pair of ``order`` (the model replaying whichever of the two
    it predicts faster) with the smallest ``score(main, alt)`` (worst, mean), where that
    beats ``alone``'s score by ``MIN_GAIN`` in one and loses in neither: an extra graph
    per bucket must earn its capture. A pair's kernel is the one earlier in ``order``."""
    best = worst_alone, mean_alone = score(alone, "")
    chosen = (alone, "")
    for a, b in combinations(order, 2):
        if not (model.covers(a, batch) and model.covers(b, batch)):
            continue
        pair = score(a, b)
        gains = (worst_alone - pair[0], mean_alone - pair[1])
        if max(gains) >= MIN_GAIN and min(gains) >= 0 and pair < best:
            best, chosen = pair, (a, b)
    return chosen


def faster_kernel(model: BalancedCostModel | None, batch: int, lens, main: str, alt: str
                  ) -> str:
    """The kernel the selector replays: ``main``, or ``alt`` where there is one ("" for
    none) and the model predicts it strictly faster."""
    if not alt:
        return main
    return alt if model.predict(alt, batch, lens) < model.predict(main, batch, lens) else main
