"""The Gluon seesaw against the Triton stage 1, split-KV and balanced, on ragged mixes and
uniform batches (H200, one run), at 128 heads or (``--heads 16``) with 64-row programs
holding 16 heads.

Times the kernel as the tuner does (``graphbucket.tuning.measure.PlanTimer``: CUDA-graph
replays over a cold L2) on the oracle's and the tuner's ragged mixes and a few uniform
batches, with four plans per mix: the split-KV plan the shipped ladder replays there (its
balanced switch aside), the same hint on 64-row seesaw programs (``stream=SEESAW_STREAM``;
at 128 heads that is the ladder's plan), ``plan_balanced_mla_decode`` with the Triton
stage 1 and with the seesaw over balanced work items, over equal tile ranges and over
tile ranges cut by work (``charged_ranges``).

    python3 bench/experiments/balanced_seesaw.py --out DIR              # 128 heads
    python3 bench/experiments/balanced_seesaw.py --heads 16 --out DIR   # 16 heads
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

TOP = 131072
BATCHES = (1, 8, 32, 64, 128)
UNIFORM = {1: (131072,), 8: (16384, 131072), 64: (1024, 4096, 16384)}


def mixes(batch: int) -> list[tuple[str, list[int]]]:
    from bench.ladder_oracle import ragged_mixes
    from graphbucket.ladder import BALANCED_ABOVE
    from graphbucket.tuning.ragged import tuner_mixes

    uniform = [(f"uniform-{n}", [n] * batch) for n in UNIFORM.get(batch, ())]
    ragged = [] if batch == 1 else (ragged_mixes(batch, TOP)
                                   + tuner_mixes(batch, TOP, above=BALANCED_ABOVE))
    return uniform + ragged


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write h200-balanced-seesaw[-h16].{json,md} here")
    p.add_argument("--heads", type=int, default=128, choices=(16, 32, 64, 128))
    args = p.parse_args(argv)
    heads = args.heads
    import torch

    from bench.gpu_timing import run_meta
    from graphbucket.plan import plan_balanced_mla_decode, plan_mla_decode
    from graphbucket.plan_streams import ROWS_STREAM, SEESAW_STREAM
    from graphbucket.tuning.grid import hint_plans
    from graphbucket.tuning.measure import PlanTimer
    from graphbucket.tuning.ragged import imbalance
    from graphbucket.tuning.shipped import find_tuned_ladder

    if not torch.cuda.is_available():
        sys.exit("balanced_seesaw.py times CUDA kernels; run it on the GPU")
    meta = run_meta()
    ladder = find_tuned_ladder(meta["gpu"], heads, TOP) or sys.exit(f"no {heads}-head ladder")
    sms = meta["num_sms"]
    plan_for = hint_plans(heads, num_sms=sms)
    todo = [(b, name, lens) for b in BATCHES for name, lens in mixes(b)]
    top = max(BATCHES)
    # The Triton balanced stage 1: 64-row programs from 64 heads, the default below.
    triton = {"stream": ROWS_STREAM} if heads >= 64 else {}
    balanced = {b: plan_balanced_mla_decode(b, heads, num_sms=sms, **triton) for b in BATCHES}
    seesaw = {b: plan_balanced_mla_decode(b, heads, num_sms=sms, stream=SEESAW_STREAM)
              for b in BATCHES}
    ranges = {b: plan_balanced_mla_decode(b, heads, num_sms=sms, stream=SEESAW_STREAM,
                                          tile_ranges=True) for b in BATCHES}
    charged = {b: plan_balanced_mla_decode(b, heads, num_sms=sms, stream=SEESAW_STREAM,
                                           tile_ranges=True, charged_ranges=True)
               for b in BATCHES}
    timer = PlanTimer(-(-max(sum(lens) for *_, lens in todo) // top), top, heads,
                      max_splits=256, max_items=max(p.max_work_items for p in
                                                    [*balanced.values(), *seesaw.values(),
                                                     *ranges.values(), *charged.values()]))
    rows = []
    for i, (batch, name, lens) in enumerate(todo):
        hint = ladder.hints_for(batch)[ladder.bucket_for(max(lens))]
        split = plan_for(batch, hint)
        split_seesaw = plan_mla_decode(batch, heads, hint, num_sms=sms, stream=SEESAW_STREAM)
        us = timer.time_lens(lens, {"split": split, "split_seesaw": split_seesaw,
                                    "balanced": balanced[batch],
                                    "balanced_seesaw": seesaw[batch],
                                    "balanced_ranges": ranges[batch],
                                    "balanced_charged": charged[batch]})
        rows.append({"batch": batch, "mix": name, "imbalance": round(imbalance(lens), 3),
                     "split_plan": split.describe(), "split_seesaw_plan":
                     split_seesaw.describe(), **{f"{k}_us": round(v, 2) for k, v in us.items()}})
        r = rows[-1]
        print(f"[{i + 1}/{len(todo)}] b={batch} {name} (imbalance {r['imbalance']}): split "
              f"{r['split_us']} us, split seesaw {r['split_seesaw_us']}, balanced "
              f"{r['balanced_us']}, balanced seesaw {r['balanced_seesaw_us']}, over tile "
              f"ranges {r['balanced_ranges_us']}, charged {r['balanced_charged_us']}", flush=True)
    meta["command"] = "python3 " + " ".join(sys.argv)
    result = {"meta": meta, "rows": rows}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "h200-balanced-seesaw" + ("" if heads == 128 else f"-h{heads}")
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=1))
        lines = [f"# The Gluon seesaw against the Triton stage 1 at {heads} heads "
                 f"({meta['gpu']})", "", f"{meta['date']}, torch {meta['torch']}, triton "
                 f"{meta['triton']}. Command: `{meta['command']}`. Microseconds per call "
                 "(cold L2, graph replays). Ranges / items: the seesaw over tile ranges (one "
                 "persistent program per SM) over the seesaw with one program per work item; "
                 "charged / ranges: the same ranges cut by work over the equal cut; "
                 "the last column is the best Triton plan over the best seesaw plan.", "",
                 "| batch | mix | imbalance | ladder's split-KV | split-KV (seesaw) | "
                 "balanced (Triton) | balanced (seesaw) | seesaw over tile ranges | "
                 "charged ranges | ranges / items | charged / ranges | Triton / seesaw |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['mix']} | {r['imbalance']:.2f} | {r['split_us']:.1f} | "
                  f"{r['split_seesaw_us']:.1f} | {r['balanced_us']:.1f} | "
                  f"{r['balanced_seesaw_us']:.1f} | {r['balanced_ranges_us']:.1f} | "
                  f"{r['balanced_charged_us']:.1f} | "
                  f"{r['balanced_ranges_us'] / r['balanced_seesaw_us']:.2f} | "
                  f"{r['balanced_charged_us'] / r['balanced_ranges_us']:.2f} | "
                  f"{best_ratio(r):.2f} |" for r in rows]
        (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out / name}.json and .md")


def best_ratio(row: dict) -> float:
    """The best Triton plan's time over the best seesaw plan's."""
    return (min(row["split_us"], row["balanced_us"])
            / min(row["split_seesaw_us"], row["balanced_seesaw_us"], row["balanced_ranges_us"],
                  row["balanced_charged_us"]))


if __name__ == "__main__":
    main()
