"""Does the faster split count at one shape depend on who times it? The tuner's timer
(``graphbucket.tuning.measure.PlanTimer``) and the oracle's (``bench/ladder_oracle.py``'s
``Cases``) on the same plans, alternating, several rounds.

Why: the 128-head H100 oracle (2026-12-07) flags batch 1 at 13777 tokens (64 splits 1.075x
faster than the ladder's 32) and at 19484 (32 splits 1.045x faster than its 64), while the
tuner's table of the same card has 32 splits faster from 6K to 16384 tokens and 64 faster
above. Either one timer's setup favours one topology (then the tuner and the oracle
disagree by construction) or the difference is run-to-run spread (then 1.02 is inside it).

    python3 bench/experiments/split_flip.py --out DIR      # CUDA, about a minute
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--contexts", type=int, nargs="+",
                   default=[11585, 13777, 16384, 19484, 23170])
    p.add_argument("--splits", type=int, nargs=2, default=[32, 64],
                   help="the two split counts compared (default 32 64)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, help="write split-flip.{json,md} into this folder")
    return p.parse_args(argv)


def plan_with_splits(batch: int, heads: int, splits: int):
    """The Triton backend's plan (the one a ladder captures) at the smallest power-of-two
    hint that gives ``splits``."""
    from graphbucket.backends import get_backend

    backend = get_backend("triton", device="cuda")
    for k in range(18):
        plan = backend.plan(batch, heads, 1 << k)
        if plan.num_kv_splits == splits:
            return plan
    raise SystemExit(f"no hint up to 128K plans {splits} splits at batch {batch}, "
                     f"{heads} heads")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("split_flip.py times CUDA-graph replays and needs a CUDA GPU")
    from bench.gpu_timing import run_meta
    from bench.ladder_oracle import Cases
    from graphbucket.tuning.measure import PlanTimer

    a, b = args.splits
    plans = {f"splits={s}": plan_with_splits(args.batch, args.heads, s) for s in (a, b)}
    top = max(args.contexts)
    tuner = PlanTimer(top, args.batch, args.heads, max_splits=max(a, b))
    oracle = Cases(top * args.batch, args.heads, "bf16", q_len=1, max_batch=args.batch,
                   max_splits=max(a, b), max_items=0, device="cuda")
    for label, plan in plans.items():
        print(label, plan.describe(), flush=True)
    rows = []
    for rnd in range(args.rounds):
        for context in args.contexts:
            timers = [("tuner", lambda c=context: tuner.time(c, args.batch, plans)),
                      ("oracle", lambda c=context: oracle.time([c] * args.batch, plans))]
            for name, timed in (timers if rnd % 2 == 0 else timers[::-1]):
                us = timed()
                rows.append({"round": rnd, "context": context, "timer": name,
                             **{k: round(v, 2) for k, v in us.items()},
                             "ratio": round(us[f"splits={b}"] / us[f"splits={a}"], 4)})
                print(rows[-1], flush=True)
    meta = run_meta()
    lines = [f"# {b} against {a} splits by the tuner's and the oracle's timers "
             f"({args.heads} heads, batch {args.batch})", "",
             f"{meta['date']}, {meta['gpu']}, torch {meta['torch']}, triton "
             f"{meta['triton']}. Command: `{meta['command']}`. Median over "
             f"{args.rounds} rounds of us({b}) / us({a}) (< 1: {b} splits faster); each "
             "round times both timers, alternating which goes first.", "",
             "| context | tuner | oracle | tuner rounds | oracle rounds |",
             "|---:|---:|---:|---|---|"]
    for context in args.contexts:
        got = {t: [r["ratio"] for r in rows if r["context"] == context and r["timer"] == t]
               for t in ("tuner", "oracle")}
        lines.append(f"| {context} | {statistics.median(got['tuner']):.3f} | "
                     f"{statistics.median(got['oracle']):.3f} | "
                     f"{', '.join(f'{x:.3f}' for x in got['tuner'])} | "
                     f"{', '.join(f'{x:.3f}' for x in got['oracle'])} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "split-flip.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                             indent=1))
        (args.out / "split-flip.md").write_text(text)


if __name__ == "__main__":
    main()
