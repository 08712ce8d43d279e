"""What choosing between a bucket's two balanced graphs costs the host, per step.

Times ``GraphSelector.key_for`` (the runner's selection call, lengths already validated)
on ragged batches at the shipped ladders' capture sizes, with the ladder as shipped and
with its alternate kernels dropped (one balanced graph per bucket), interleaved, pinned to
one core; median microseconds. Only steps that replay a balanced graph of a bucket with an
alternate run the cost model, so uniform batches are timed too (they must not move).

    python3 bench/experiments/select_cost.py --out DIR     # host only, about 20 s
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from graphbucket.ladder import BucketLadder  # noqa: E402
from graphbucket.select import GraphSelector  # noqa: E402

LADDERS = {16: "graphbucket/ladders/h200-h16.json", 128: "graphbucket/ladders/h200-h128.json"}
SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


def mixes(batch: int, top: int) -> dict[str, np.ndarray]:
    return {"uniform": np.full(batch, top - 7),
            "spread": np.array([1 + (top - 1) * i // max(1, batch - 1) for i in range(batch)]),
            "half-long": np.array([top] * (batch // 2) + [4096] * (batch - batch // 2)),
            "one-long": np.array([top] + [700] * (batch - 1))}


def one_graph(ladder: BucketLadder) -> BucketLadder:
    return BucketLadder(tuple(replace(b, alternate_kernels=()) for b in ladder.buckets),
                        ladder.max_model_len, meta=ladder.meta)


def median_us(sel: GraphSelector, lens: np.ndarray, reps: int) -> tuple[float, object]:
    lo, hi, n = int(lens.min()), int(lens.max()), len(lens)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        key = sel.key_for(n, lo, hi, lens)
        times.append(time.perf_counter_ns() - t0)
    return float(np.median(times)) / 1e3, key


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="directory for h200-select-cost.json")
    p.add_argument("--reps", type=int, default=400)
    p.add_argument("--core", type=int, default=os.cpu_count() - 1)
    args = p.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.core})
    rows = []
    for heads, path in LADDERS.items():
        ladder = BucketLadder.load(path)
        shipped, single = GraphSelector(ladder, SIZES), GraphSelector(one_graph(ladder), SIZES)
        for batch in (8, 32, 64, 128):
            for top in (16384, 98304):
                for mix, lens in mixes(batch, top).items():
                    pair = [median_us(s, lens, args.reps) for s in (shipped, single)] + \
                           [median_us(s, lens, args.reps) for s in (single, shipped)]
                    key = pair[0][1]
                    rows.append({"heads": heads, "batch": batch, "context": top, "mix": mix,
                                 "balanced": bool(key.balanced),
                                 "alternate_weighed": shipped.alternate_kernels(key) is not None,
                                 "alternate": bool(key.alternate),
                                 "with_alternates_us": round((pair[0][0] + pair[3][0]) / 2, 2),
                                 "one_graph_us": round((pair[1][0] + pair[2][0]) / 2, 2)})
                    r = rows[-1]
                    print(f"{heads:>3} heads b={batch:<3} {mix:<9} {top:>6}: "
                          f"{r['with_alternates_us']:7.2f} us (one graph {r['one_graph_us']:6.2f})"
                          f"{'  weighed' if r['alternate_weighed'] else ''}"
                          f"{' -> alternate' if r['alternate'] else ''}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        from bench.gpu_timing import run_meta

        meta = {**run_meta(), "command": "python3 bench/experiments/select_cost.py "
                                         f"--out {args.out}", "core": args.core}
        (args.out / "h200-select-cost.json").write_text(
            json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
