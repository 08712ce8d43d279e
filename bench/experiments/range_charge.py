"""The seesaw over tile ranges cut by work, at several charges per request, against the equal
cut and the per-item seesaw (one run, 16 or 128 heads).

A charged cut (``charged_ranges``) counts each live request ``range_charge_tiles`` tiles more
than it holds, so programs meeting many short requests take fewer tiles, and a request the
cut leaves whole gets its output from stage 1 (no merge for it). Charge 0 is the equal cut
on the charged path (the whole-request outputs and the dependent merge launch, no change to
the cut), so its column against the equal cut's separates the path from the charge.
Times as the tuner does (``PlanTimer``: CUDA-graph replays over a cold L2) on the same
ragged mixes and uniform batches as ``balanced_seesaw.py``.

    python3 bench/experiments/range_charge.py --heads 128 --out DIR
    python3 bench/experiments/range_charge.py --heads 16 --charges 0 1 2 5 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.experiments.balanced_seesaw import BATCHES, mixes  # noqa: E402

CHARGES = (0, 1, 2, 3, 5, 8)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write h200-range-charge[-hH].{json,md} here")
    p.add_argument("--heads", type=int, default=128, choices=(16, 32, 64, 128))
    p.add_argument("--charges", type=int, nargs="+", default=list(CHARGES),
                   help="charges per request in tiles (default %(default)s)")
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    args = p.parse_args(argv)
    import torch

    from bench.gpu_timing import run_meta
    from graphbucket.plan import plan_balanced_mla_decode
    from graphbucket.plan_streams import SEESAW_STREAM
    from graphbucket.tuning.measure import PlanTimer
    from graphbucket.tuning.ragged import imbalance

    if not torch.cuda.is_available():
        sys.exit("range_charge.py times CUDA kernels; run it on the GPU")
    meta = run_meta()
    heads, sms = args.heads, meta["num_sms"]
    todo = [(b, name, lens) for b in args.batches for name, lens in mixes(b)]

    def seesaw(b: int, **cut):
        return plan_balanced_mla_decode(b, heads, num_sms=sms, stream=SEESAW_STREAM, **cut)

    plans = {b: {"items": seesaw(b), "ranges": seesaw(b, tile_ranges=True),
                 **{f"charge_{c}": seesaw(b, tile_ranges=True, charged_ranges=True,
                                          range_charge_tiles=c) for c in args.charges}}
             for b in args.batches}
    top = max(args.batches)
    timer = PlanTimer(-(-max(sum(lens) for *_, lens in todo) // top), top, heads,
                      max_splits=1, max_items=max(p.max_work_items for by in plans.values()
                                                  for p in by.values()))
    rows = []
    for i, (batch, name, lens) in enumerate(todo):
        us = timer.time_lens(lens, plans[batch])
        rows.append({"batch": batch, "mix": name, "imbalance": round(imbalance(lens), 3),
                     **{f"{k}_us": round(v, 2) for k, v in us.items()}})
        print(f"[{i + 1}/{len(todo)}] b={batch} {name}: " + ", ".join(
            f"{k} {v:.1f}" for k, v in us.items()) + " us", flush=True)
    meta["command"] = "python3 " + " ".join(sys.argv)
    meta["charges"] = list(args.charges)
    result = {"meta": meta, "rows": rows}
    if args.out:
        write(result, heads, args.out)


def best_charge(row: dict, charges: list[int]) -> int:
    return min(charges, key=lambda c: row[f"charge_{c}_us"])


def write(result: dict, heads: int, out: Path) -> None:
    meta, rows, charges = result["meta"], result["rows"], result["meta"]["charges"]
    out.mkdir(parents=True, exist_ok=True)
    name = f"h200-range-charge-h{heads}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    head = " | ".join(f"c={c}" for c in charges)
    lines = [f"# Tile ranges cut by work: the charge per request, {heads} heads "
             f"({meta['gpu']})", "", f"{meta['date']}, torch {meta['torch']}, triton "
             f"{meta['triton']}. Command: `{meta['command']}`. Microseconds per call (cold "
             "L2, graph replays): the seesaw over work items, over equal tile ranges, and "
             "over ranges cut by work with each charge c (tiles per live request; c=0 is "
             "the equal cut on the charged path: whole requests written by stage 1, the "
             "merge a dependent launch). Best: the fastest charge, and its time over the "
             "equal cut's.", "",
             f"| batch | mix | imbalance | items | ranges | {head} | best c | best / ranges |",
             "|---|---|---|---|---|" + "---|" * len(charges) + "---|---|"]
    for r in rows:
        c = best_charge(r, charges)
        cells = " | ".join(f"{r[f'charge_{x}_us']:.1f}" for x in charges)
        lines.append(f"| {r['batch']} | {r['mix']} | {r['imbalance']:.2f} | "
                     f"{r['items_us']:.1f} | {r['ranges_us']:.1f} | {cells} | {c} | "
                     f"{r[f'charge_{c}_us'] / r['ranges_us']:.2f} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / name}.json and .md")


if __name__ == "__main__":
    main()
