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
    return p.parse_args(argv)


def replay(ladder_path: str, samples: list) -> list[dict]:
    """Per sample: the replayed plan's name and time, the fastest plan's, their ratio."""
    from graphbucket.ladder import BucketLadder
    from graphbucket.select import GraphSelector

    ladder = BucketLadder.load(ladder_path)
    sizes = sorted({s.batch for s in samples} | {1})
    selector = GraphSelector(ladder, sizes, remember_picks=False)
    out = []
    for s in samples:
        times = {"split": s.split_us, **s.kernel_us()}
        key = selector.key_for(s.batch, min(s.lens), max(s.lens), list(s.lens), 1)
        if not key.balanced:
            plan = "split"
        else:
            bucket = ladder.buckets[key.bucket]
            plan = (bucket.alternate_kernel_for(key.batch_size) if key.alternate
                    else bucket.balanced_kernel_for(key.batch_size))
        fastest = min(times, key=times.get)
        out.append({"batch": s.batch, "mix": s.mix, "longest": max(s.lens), "plan": plan,
                    "us": times[plan], "fastest": fastest, "fastest_us": times[fastest],
                    "ratio": times[plan] / times[fastest]})
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
