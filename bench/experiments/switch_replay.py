"""The ragged switch replayed on the tuner's own mixes, with no GPU: for each mix a tuning
report timed (split-KV and every balanced kernel), the plan a ladder's ``GraphSelector``
replays, over the fastest plan timed on that mix.

It compares ladders chosen from the same report (``scripts/tune_ladder.py --from-times``)
in sample: a choice that loses on the mixes it was chosen from loses out of sample too,
while one that wins here still needs ``bench/ladder_oracle.py`` on a GPU.

    python3 bench/experiments/switch_replay.py --report REPORT.json --ladder A.json B.json

``--cost-errors`` also fits the balanced cost model with each length range's mixes left
out and predicts them: the relative error per kernel of one cost over every capture size
against one cost per size (out of sample in the lengths).

``--held-out mix`` chooses the switch again for each mix with that mix left out (the cost
model refitted without its length range's mixes: a fit takes seconds) and replays the
left-out mix under the choice: the tuner's choice out of sample, for each way of choosing
(``CHOOSERS``): the kernel from the range's own mixes at that capture size, from every
range's at that size, or from the range's and its two neighbours' (the tuner's); the
threshold always from the range's own. A mix left out at either end of a range's
imbalances (the uniform one, the most skewed one) is an extrapolation the tuner never
makes. ``--held-out length``, for a report timed at two mix lengths (``--mix-lengths 2``):
each length's mixes replayed under the switch (and cost model) chosen from the other's
alone: the same shapes at other lengths, as the oracle's contexts are.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--report", required=True, help="a tune_ladder.py --report JSON")
    p.add_argument("--ladder", nargs="*", default=[], help="ladder JSON files to replay")
    p.add_argument("--worst", type=int, default=8, help="mixes listed per ladder, worst first")
    p.add_argument("--cost-errors", action="store_true",
                   help="the cost model's error on each length range's mixes left out")
    p.add_argument("--one-balanced-kernel", action="store_true",
                   help="with --held-out: one balanced kernel per capture size, no pairs")
    from graphbucket.tuning.ragged import KERNEL_SCORES

    p.add_argument("--kernel-score", choices=KERNEL_SCORES,
                   help="with --held-out: rank the kernel options by this first (default: "
                        "the tuner's, ragged.KERNEL_SCORE)")
    p.add_argument("--held-out", choices=("mix", "length"),
                   help="each mix replayed under the switch chosen without it, or without "
                        "every mix of its length")
    return p.parse_args(argv)


def replay(ladder_path: str, samples: list) -> list[dict]:
    """Per sample: the replayed plan's name and time, the fastest plan's, their ratio."""
    from graphbucket.ladder import BucketLadder
    from graphbucket.tuning.held_out import replayed

    out = []
    for s, (plan, us) in zip(samples, replayed(BucketLadder.load(ladder_path), samples),
                             strict=True):
        times = {"split": s.split_us, **s.kernel_us()}
        fastest = min(times, key=times.get)
        out.append({"batch": s.batch, "mix": s.mix, "longest": max(s.lens), "plan": plan,
                    "us": us, "fastest": fastest, "fastest_us": times[fastest],
                    "ratio": us / times[fastest]})
    return out


def cost_errors(report: dict, samples: list) -> dict[str, dict[str, list[float]]]:
    """kernel -> {"shared": errors, "per size": errors}: each sample's |relative error|
    when the cost model is fitted without the mixes of its length range (powers of two)."""
    from graphbucket.backends.triton import TritonBackend
    from graphbucket.balanced_cost import BalancedCostModel, partition_of
    from graphbucket.tuning.kernel_pairs import fit_cost_model

    meta = report["meta"]
    backend = TritonBackend(num_sms=meta["num_sms"])

    def partition(kernel: str, batch: int):
        return partition_of(backend.plan_balanced(batch, meta["num_heads"], kernel),
                            meta["num_sms"])

    sizes = sorted({s.batch for s in samples})
    octave = {id(s): max(s.lens).bit_length() for s in samples}
    out: dict[str, dict[str, list[float]]] = {}
    for left_out in sorted(set(octave.values())):
        model = fit_cost_model([s for s in samples if octave[id(s)] != left_out], partition,
                               sizes)
        shared = BalancedCostModel(model.costs, model.partitions)
        for s in samples:
            if octave[id(s)] != left_out:
                continue
            for kernel, us in s.kernel_us().items():
                errors = out.setdefault(kernel, {"shared": [], "per size": []})
                for name, m in (("shared", shared), ("per size", model)):
                    errors[name].append(abs(m.predict(kernel, s.batch, s.lens) / us - 1))
    return out


def model_fitter(report: dict):
    """``fit(samples)``: the tuner's cost model over those samples (None for one kernel)."""
    from graphbucket.backends.triton import TritonBackend
    from graphbucket.balanced_cost import partition_of
    from graphbucket.tuning.kernel_pairs import fit_cost_model

    meta = report["meta"]
    backend = TritonBackend(num_sms=meta["num_sms"])
    cache: dict = {}

    def partition(kernel: str, batch: int):
        if (kernel, batch) not in cache:
            cache[kernel, batch] = partition_of(
                backend.plan_balanced(batch, meta["num_heads"], kernel), meta["num_sms"])
        return cache[kernel, batch]

    def fit(samples: list):
        if len({k for s in samples for k in s.kernel_us()}) < 2:
            return None
        return fit_cost_model(samples, partition, meta["batches"])
    return fit


# Which mixes choose the balanced kernel (or pair) of a (range, capture size): the range's
# own, every range's, or the range's and its two neighbours' (the tuner's,
# ragged.KERNEL_NEIGHBOUR_RANGES).
CHOOSERS = {"own range": 0, "every range": None, "neighbours": 1}


def held_out(report: dict, samples: list, by: str = "mix", *, pairs: bool = True,
             score: str | None = None) -> dict[str, list[tuple[float, object, str]]]:
    """chooser -> (ratio to the fastest plan timed, sample, plan replayed) of each mix under
    the switch chosen without it (``by="mix"``) or without every mix of its length
    (``by="length"``); ``pairs=False``: one balanced kernel per capture size and range, no
    cost model (``tune_ladder.py --one-balanced-kernel``); ``score`` as the tuner's
    ``--kernel-score``."""
    from graphbucket.ladder import BALANCED_ABOVE, BucketLadder
    from graphbucket.tuning.held_out import second_length
    from graphbucket.tuning.kernel_pairs import faster_kernel
    from graphbucket.tuning.ragged import (
        _choose_batch,
        choose_imbalance,
        fastest_us,
        ragged_ranges,
        range_of,
    )

    meta = report["meta"]
    bounds = BucketLadder.from_dict(report["ladder"]).bounds
    ranges = ragged_ranges(bounds, BALANCED_ABOVE,
                           start=meta.get("balanced_from", BALANCED_ABOVE))
    where = {id(s): range_of(ranges, max(s.lens)) for s in samples}
    fit = model_fitter(report) if pairs else (lambda _: None)
    if by == "length":
        if len({second_length(o) for o in samples}) < 2:
            raise SystemExit("--held-out length needs a report timed at two mix lengths")
        models = {tag: fit([o for o in samples if second_length(o) != tag])
                  for tag in (False, True)}
    else:
        models = {r: fit([o for o in samples if where[id(o)] != r])
                  for r in sorted({r for r in where.values() if r is not None})}
    out: dict[str, list[tuple[float, object, str]]] = {name: [] for name in CHOOSERS}
    # Held out by length, every mix of one (capture size, range, length) sees the same
    # choice: made once; held out by mix, once per mix.
    chosen: dict[tuple, tuple] = {}
    for s in samples:
        r = where[id(s)]
        rest = [o for o in samples if o is not s and
                (by == "mix" or second_length(o) != second_length(s))]
        own = [o for o in rest if o.batch == s.batch and where[id(o)] == r]
        if r is None or not own:
            continue
        model = models[second_length(s) if by == "length" else r]
        for name, reach in CHOOSERS.items():
            key = (name, s.batch, r, second_length(s) if by == "length" else id(s))
            if key not in chosen:
                pool = [o for o in rest if o.batch == s.batch and where[id(o)] is not None
                        and (reach is None or abs(where[id(o)] - r) <= reach)]
                main, alt, _, _ = _choose_batch(pool, s.batch, model, score=score)
                replayed = [o.with_kernel(faster_kernel(model, o.batch, o.lens, main, alt))
                            for o in own]
                threshold = choose_imbalance(replayed,
                                             best=[fastest_us(o) for o in own])[0]
                chosen[key] = (main, alt, threshold)
            main, alt, threshold = chosen[key]
            mine = s.with_kernel(faster_kernel(model, s.batch, s.lens, main, alt))
            balanced = bool(threshold) and mine.imbalance >= threshold
            us = mine.balanced_us if balanced else mine.split_us
            out[name].append((us / fastest_us(s), s, mine.kernel if balanced else "split"))
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from graphbucket.tuning.ragged import RaggedSample

    report = json.loads(Path(args.report).read_text())
    samples = [RaggedSample.from_dict(r) for r in report["ragged"]["samples"]]
    if args.cost_errors:
        print("cost model, each length range left out: |relative error| mean / worst / "
              "above 0.1")
        for kernel, by in cost_errors(report, samples).items():
            text = ", ".join(f"{name} {sum(e) / len(e):.3f} / {max(e):.3f} / "
                             f"{sum(x > 0.1 for x in e)} of {len(e)}" for name, e in by.items())
            print(f"  {kernel}: {text}")
    if args.held_out:
        print("each mix left out of the choice, replayed under it: over the fastest plan "
              "timed, worst / mean / above 1.02")
        for name, rows in held_out(report, samples, args.held_out,
                                   pairs=not args.one_balanced_kernel,
                                   score=args.kernel_score).items():
            ratios = [r for r, _, _ in rows]
            print(f"  kernel from {name}: {max(ratios):.3f} / {sum(ratios) / len(ratios):.4f}"
                  f" / {sum(r > 1.02 for r in ratios)} of {len(ratios)}")
            for r, s, plan in sorted(rows, key=lambda row: -row[0])[:args.worst]:
                times = {"split": s.split_us, **s.kernel_us()}
                fastest = min(times, key=times.get)
                print(f"    batch {s.batch:3d} {s.mix:<18} longest {max(s.lens):6d} imbalance "
                      f"{s.imbalance:5.2f}: {plan} {times[plan]:.1f} us, {fastest} "
                      f"{times[fastest]:.1f} ({r:.3f})")
    for path in args.ladder:
        rows = replay(path, samples)
        ratios = sorted(r["ratio"] for r in rows)
        over = sum(r > 1.02 for r in ratios)
        print(f"{path}: {len(rows)} mixes, over the fastest plan timed: worst "
              f"{ratios[-1]:.3f}, mean {sum(ratios) / len(ratios):.4f}, above 1.02: {over}")
        for r in sorted(rows, key=lambda r: -r["ratio"])[:args.worst]:
            print(f"  batch {r['batch']:3d} {r['mix']:<18} longest {r['longest']:6d}: "
                  f"{r['plan']} {r['us']:.1f} us, {r['fastest']} {r['fastest_us']:.1f} "
                  f"({r['ratio']:.3f})")


if __name__ == "__main__":
    main()
