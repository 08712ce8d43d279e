"""Why the seesaw over tile ranges wins some mixes and loses others: the same ranges on
one, two and four programs per SM (beyond one, the hardware hands the next range to the SM
that frees first) against the seesaw with one program per work item, at 16 and 128 heads,
on uniform batches and the tuner's and the oracle's ragged mixes (H200, one run).

    python3 bench/experiments/range_programs.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

TOP = 131072
CASES = {1: ["uniform-131072"], 8: ["uniform-131072", "spread-128k", "half-long", "one-long"],
         64: ["uniform-4096", "spread-128k", "half-long", "spread-8k", "long-among-short"]}


def lengths(batch: int, name: str) -> list[int]:
    from bench.ladder_oracle import ragged_mixes
    from graphbucket.ladder import BALANCED_ABOVE
    from graphbucket.tuning.ragged import tuner_mixes

    if name.startswith("uniform-"):
        return [int(name.split("-")[1])] * batch
    mixes = dict(ragged_mixes(batch, TOP) + tuner_mixes(batch, TOP, above=BALANCED_ABOVE))
    return mixes[name]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    import torch

    from bench.gpu_timing import run_meta
    from graphbucket.plan import plan_balanced_mla_decode
    from graphbucket.plan_streams import SEESAW_STREAM
    from graphbucket.tuning.measure import PlanTimer

    if not torch.cuda.is_available():
        sys.exit("range_programs.py times CUDA kernels; run it on the GPU")
    meta = run_meta()
    sms = meta["num_sms"]
    rows = []
    for heads in (16, 128):
        blocks = 1 if heads < 64 else heads // 64
        todo = [(b, n, lengths(b, n)) for b, names in CASES.items() for n in names]
        plans = {b: {"items": plan_balanced_mla_decode(b, heads, num_sms=sms,
                                                       stream=SEESAW_STREAM),
                     **{f"ranges_x{k}": plan_balanced_mla_decode(
                         b, heads, num_sms=sms, stream=SEESAW_STREAM, tile_ranges=True,
                         programs=k * sms // blocks) for k in (1, 2, 4)}}
                 for b in CASES}
        timer = PlanTimer(-(-max(sum(lens) for *_, lens in todo) // 64), 64, heads,
                          max_splits=1, max_items=max(q.max_work_items for d in plans.values()
                                                      for q in d.values()))
        for batch, name, lens in todo:
            us = timer.time_lens(lens, plans[batch])
            rows.append({"heads": heads, "batch": batch, "mix": name,
                         **{f"{k}_us": round(v, 2) for k, v in us.items()}})
            print(heads, batch, name, {k: round(v, 1) for k, v in us.items()}, flush=True)
    meta["command"] = "python3 " + " ".join(sys.argv)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "h200-range-programs.json").write_text(
            json.dumps({"meta": meta, "rows": rows}, indent=1))
        lines = [f"# The seesaw over tile ranges on 1, 2 and 4 programs per SM ({meta['gpu']})",
                 "", f"{meta['date']}, torch {meta['torch']}, triton {meta['triton']}. "
                 f"Command: `{meta['command']}`. Microseconds per call (cold L2, graph "
                 "replays); ratios over the seesaw with one program per work item.", "",
                 "| heads | batch | mix | per item | ranges x1 | x2 | x4 | x1 / item | x2 / item "
                 "| x4 / item |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            it = r["items_us"]
            lines.append(f"| {r['heads']} | {r['batch']} | {r['mix']} | {it:.1f} | "
                         + " | ".join(f"{r[f'ranges_x{k}_us']:.1f}" for k in (1, 2, 4)) + " | "
                         + " | ".join(f"{r[f'ranges_x{k}_us'] / it:.2f}" for k in (1, 2, 4))
                         + " |")
        (args.out / "h200-range-programs.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
