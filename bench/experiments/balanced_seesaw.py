"""Balanced split-KV at 64-row programs: the Triton stage 1 against the Gluon seesaw's, and
the ladder's split-KV plan beside them, on ragged mixes at 128 heads (H200, one run).

Times the kernel as the tuner does (``graphbucket.tuning.measure.PlanTimer``: CUDA-graph
replays over a cold L2) on the oracle's and the tuner's ragged mixes, with three plans per
mix: the split-KV plan the shipped 128-head ladder replays there (its balanced switch
aside), ``plan_balanced_mla_decode`` (Triton stage 1) and the same with
``stream=SEESAW_STREAM`` (the seesaw over balanced work items).

    python3 bench/experiments/balanced_seesaw.py --out DIR    # about a minute
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

HEADS, TOP = 128, 131072
BATCHES = (8, 32, 64, 128)


def mixes(batch: int) -> list[tuple[str, list[int]]]:
    from bench.ladder_oracle import ragged_mixes
    from graphbucket.ladder import BALANCED_ABOVE
    from graphbucket.tuning.ragged import tuner_mixes

    return ragged_mixes(batch, TOP) + tuner_mixes(batch, TOP, above=BALANCED_ABOVE)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write h200-balanced-seesaw.{json,md} here")
    args = p.parse_args(argv)
    import torch

    from bench.gpu_timing import run_meta
    from graphbucket.plan import plan_balanced_mla_decode
    from graphbucket.plan_streams import SEESAW_STREAM
    from graphbucket.tuning.grid import hint_plans
    from graphbucket.tuning.measure import PlanTimer
    from graphbucket.tuning.ragged import imbalance
    from graphbucket.tuning.shipped import find_tuned_ladder

    if not torch.cuda.is_available():
        sys.exit("balanced_seesaw.py times CUDA kernels; run it on the GPU")
    meta = run_meta()
    ladder = find_tuned_ladder(meta["gpu"], HEADS, TOP) or sys.exit("no 128-head ladder")
    plan_for = hint_plans(HEADS, num_sms=meta["num_sms"])
    todo = [(b, name, lens) for b in BATCHES for name, lens in mixes(b)]
    top = max(BATCHES)
    balanced = {b: plan_balanced_mla_decode(b, HEADS, num_sms=meta["num_sms"]) for b in BATCHES}
    seesaw = {b: plan_balanced_mla_decode(b, HEADS, num_sms=meta["num_sms"],
                                          stream=SEESAW_STREAM) for b in BATCHES}
    timer = PlanTimer(-(-max(sum(lens) for *_, lens in todo) // top), top, HEADS,
                      max_splits=64, max_items=max(p.max_work_items for p in seesaw.values()))
    rows = []
    for batch, name, lens in todo:
        split = plan_for(batch, ladder.hints_for(batch)[ladder.bucket_for(max(lens))])
        us = timer.time_lens(lens, {"split": split, "balanced": balanced[batch],
                                    "balanced_seesaw": seesaw[batch]})
        rows.append({"batch": batch, "mix": name, "imbalance": round(imbalance(lens), 3),
                     "split_plan": split.describe(), **{f"{k}_us": round(v, 2)
                                                        for k, v in us.items()}})
        r = rows[-1]
        print(f"b={batch} {name} (imbalance {r['imbalance']}): split {r['split_us']} us, "
              f"balanced {r['balanced_us']}, balanced seesaw {r['balanced_seesaw_us']} "
              f"({r['balanced_us'] / r['balanced_seesaw_us']:.2f}x)", flush=True)
    meta["command"] = "python3 " + " ".join(sys.argv)
    result = {"meta": meta, "rows": rows}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "h200-balanced-seesaw.json").write_text(json.dumps(result, indent=1))
        lines = [f"# Balanced split-KV at 128 heads: Triton stage 1 against the seesaw "
                 f"({meta['gpu']})", "", f"{meta['date']}, torch {meta['torch']}, triton "
                 f"{meta['triton']}. Command: `{meta['command']}`. Microseconds per call "
                 "(cold L2, graph replays).", "",
                 "| batch | mix | imbalance | ladder's split-KV | balanced (Triton) | "
                 "balanced (seesaw) | Triton / seesaw | split-KV / seesaw |",
                 "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['mix']} | {r['imbalance']:.2f} | {r['split_us']:.1f} | "
                  f"{r['balanced_us']:.1f} | {r['balanced_seesaw_us']:.1f} | "
                  f"{r['balanced_us'] / r['balanced_seesaw_us']:.2f} | "
                  f"{r['split_us'] / r['balanced_seesaw_us']:.2f} |" for r in rows]
        (args.out / "h200-balanced-seesaw.md").write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out / 'h200-balanced-seesaw.json'} and .md")


if __name__ == "__main__":
    main()
