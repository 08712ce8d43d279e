"""The ragged switch out of sample: mixes replayed under a switch chosen without them.

The tuner times its ragged mixes at two lengths per range (``tuner_mixes(lengths=2)``, the
second named ``<mix>@15/16``). Choosing the switch from one length's mixes and replaying
the other's through the selector is the tuner's choice on shapes it did not time, as the
oracle's contexts are. ``choose_kernel_reach`` uses it to decide, per tuning report,
whether a range's balanced kernel is chosen from its own mixes alone or with its
neighbours' too (``ragged.KERNEL_NEIGHBOUR_RANGES``). Pure host code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from graphbucket.ladder import BucketLadder
from graphbucket.tuning.ragged import (
    KERNEL_NEIGHBOUR_RANGES,
    RaggedSample,
    choose_switches,
    fastest_us,
)

MISS = 1.02  # a mix counts as missed above this ratio to the fastest plan timed on it
KERNEL_REACHES = (KERNEL_NEIGHBOUR_RANGES, 0)  # the first wins a tie


def second_length(sample: RaggedSample) -> bool:
    """Whether a mix was timed at the second length (``tuner_mixes(lengths=2)``)."""
    return sample.mix.endswith("@15/16")


def replayed(ladder: BucketLadder, samples: Sequence[RaggedSample]) -> list[tuple[str, float]]:
    """Per sample: the plan the ladder's selector replays for it ("split" or a balanced
    kernel) and that plan's timed microseconds."""
    from graphbucket.select import GraphSelector

    selector = GraphSelector(ladder, sorted({s.batch for s in samples} | {1}),
                             remember_picks=False)
    out = []
    for s in samples:
        key = selector.key_for(s.batch, min(s.lens), max(s.lens), list(s.lens), 1)
        if not key.balanced:
            out.append(("split", s.split_us))
            continue
        bucket = ladder.buckets[key.bucket]
        plan = (bucket.alternate_kernel_for(key.batch_size) if key.alternate
                else bucket.balanced_kernel_for(key.batch_size))
        out.append((plan, s.kernel_us()[plan]))
    return out


def switched_ladder(ladder: BucketLadder, switches: Sequence[Any], above: int,
                    model: Any = None) -> BucketLadder:
    """``ladder`` with the switches' balanced topology, and the cost model in its meta
    where a bucket has a second balanced kernel for the selector to pick between."""
    tuned = ladder.with_ragged_switches(switches, above=above)
    meta = {k: v for k, v in tuned.meta.items() if k != "balanced_cost"}
    if model is not None and any(b.alternate_kernels for b in tuned.buckets):
        meta["balanced_cost"] = model.to_dict()
    return BucketLadder(tuned.buckets, tuned.max_model_len, meta=meta)


def held_out_by_length(ladder: BucketLadder, samples: Sequence[RaggedSample],
                       ranges: Sequence[tuple[int, int]],
                       fit_model: Callable[[list[RaggedSample]], Any], *,
                       neighbours: int, score: str | None = None) -> list[float]:
    """Each mix's replayed time over the fastest plan timed on it, under the switch (and
    cost model, ``fit_model(mixes)``) chosen from the other length's mixes alone."""
    if len({second_length(s) for s in samples}) < 2:
        raise ValueError("holding lengths out needs mixes timed at two lengths "
                         "(tune_ladder.py --mix-lengths 2)")
    ratios: list[float] = []
    for second in (False, True):
        train = [s for s in samples if second_length(s) != second]
        test = [s for s in samples if second_length(s) == second]
        model = fit_model(train)
        switches, _ = choose_switches(train, ranges, model, neighbours=neighbours,
                                      score=score)
        tuned = switched_ladder(ladder, switches, ranges[0][0], model)
        ratios += [us / fastest_us(s)
                   for s, (_, us) in zip(test, replayed(tuned, test), strict=True)]
    return ratios


def choose_kernel_reach(ladder: BucketLadder, samples: Sequence[RaggedSample],
                        ranges: Sequence[tuple[int, int]],
                        fit_model: Callable[[list[RaggedSample]], Any], *,
                        score: str | None = None,
                        reaches: Sequence[int] = KERNEL_REACHES
                        ) -> tuple[int, dict[int, dict[str, float]]]:
    """(the reach with the fewest mixes above ``MISS`` held out by length, then the lowest
    mean, the first listed on a tie; each reach's ``above``, ``mixes``, ``mean`` and
    ``worst``). A reach is the number of neighbouring ranges on each side whose mixes
    choose a range's balanced kernel (``choose_switches(neighbours=)``)."""
    found: dict[int, dict[str, float]] = {}
    for reach in reaches:
        ratios = held_out_by_length(ladder, samples, ranges, fit_model, neighbours=reach,
                                    score=score)
        found[reach] = {"above": sum(r > MISS for r in ratios), "mixes": len(ratios),
                        "mean": round(sum(ratios) / len(ratios), 4),
                        "worst": round(max(ratios), 4)}
    best = min(reaches, key=lambda n: (found[n]["above"], found[n]["mean"]))
    return best, found
