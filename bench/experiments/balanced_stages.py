"""Where a balanced step's time goes, and whether fitted chunks (at most one work item per
program) close the gap to split-KV at the same bytes: 16 heads, uniform batches and the
oracle's ragged mixes (H200, one run).

Per mix: the ladder's split-KV plan; the Triton balanced stage 1 on 4 and 2 programs per SM,
plain and fitted; the seesaw per item, plain and fitted; and, for the two Triton balanced
plans on 4 programs per SM, the item planner, stage 1 and the merge each timed alone.

    python3 bench/experiments/balanced_stages.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

TOP = 131072
HEADS = 16
CASES = {1: ["uniform-131072"], 8: ["spread-128k", "one-long"],
         32: ["spread-8k", "long-among-short"],
         64: ["uniform-1024", "uniform-4096", "spread-8k", "long-among-short", "spread-128k"],
         128: ["spread-8k"]}


def lengths(batch: int, name: str) -> list[int]:
    from bench.experiments.balanced_seesaw import mixes

    if name.startswith("uniform-"):
        return [int(name.split("-")[1])] * batch
    return dict(mixes(batch))[name]


def stage_calls(timer, lens, plan):
    """{stage: call} over the timer's rotations for a Triton balanced plan, on a workspace
    of their own (the planner runs once first, so stage 1 and the merge alone read it)."""
    import torch

    from graphbucket.kernels import SplitWorkspace
    from graphbucket.kernels.launch import kv_tile_tokens
    from graphbucket.kernels.launch_balanced import (
        launch_balanced_merge,
        launch_balanced_stage1,
        launch_item_planner,
    )

    tables, q, out, seq_lens = timer.problem.ragged_inputs(lens)
    cache = timer.problem.cache
    ws = SplitWorkspace.allocate(len(lens), HEADS, 1, 512, "cuda",
                                 max_items=plan.max_work_items)
    block_n = kv_tile_tokens(plan, cache)
    launch_item_planner(seq_lens, ws, plan=plan, block_n=block_n)
    torch.cuda.synchronize()
    rot = range(tables.shape[0])

    def planner():
        for _ in rot:
            launch_item_planner(seq_lens, ws, plan=plan, block_n=block_n)

    def stage1():
        for r in rot:
            launch_balanced_stage1(q[r], cache, tables[r], seq_lens, out[r], ws, plan=plan,
                                   sm_scale=timer.scale, lse=None, block_n=block_n)

    def merge():
        for r in rot:
            launch_balanced_merge(out[r], ws, plan=plan, lse=None)

    items = int(ws.item_indptr[len(lens)].item())
    return {"planner": planner, "stage1": stage1, "merge": merge}, tables.shape[0], items


MERGE_TILES = (32, 64, 128, 256, 512)


def merge_tiles(timer, lens, plan):
    """{columns per merge program: us} of the balanced merge alone over ``plan``'s items
    (what stage 1 left in the slots is not read for its values: timing only)."""
    import torch

    from graphbucket.kernels import SplitWorkspace
    from graphbucket.kernels.launch import kv_tile_tokens
    from graphbucket.kernels.launch_balanced import launch_balanced_merge, launch_item_planner

    tables, _, out, seq_lens = timer.problem.ragged_inputs(lens)
    ws = SplitWorkspace.allocate(len(lens), HEADS, 1, 512, "cuda",
                                 max_items=plan.max_work_items)
    ws.item_o.zero_()
    ws.item_lse.zero_()
    launch_item_planner(seq_lens, ws, plan=plan, block_n=kv_tile_tokens(plan, timer.problem.cache))
    torch.cuda.synchronize()

    def call(tile):
        variant = replace(plan, merge_block_dv=tile, merge_num_warps=4 if tile <= 128 else 8)
        return lambda: [launch_balanced_merge(out[r], ws, plan=variant, lse=None)
                        for r in range(tables.shape[0])]
    return {t: call(t) for t in MERGE_TILES}, tables.shape[0]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--merge-tiles", action="store_true",
                   help="only the balanced merge alone at 32-512 columns per program")
    args = p.parse_args(argv)
    import torch

    from bench.gpu_timing import run_meta
    from graphbucket.plan import plan_balanced_mla_decode
    from graphbucket.plan_streams import SEESAW_STREAM
    from graphbucket.tuning.grid import hint_plans
    from graphbucket.tuning.measure import PlanTimer, time_replays_paired
    from graphbucket.tuning.shipped import find_tuned_ladder

    if not torch.cuda.is_available():
        sys.exit("balanced_stages.py times CUDA kernels; run it on the GPU")
    meta = run_meta()
    sms = meta["num_sms"]
    ladder = find_tuned_ladder(meta["gpu"], HEADS, TOP) or sys.exit("no 16-head ladder")
    plan_for = hint_plans(HEADS, num_sms=sms)

    def plans(batch):
        out = {}
        for per_sm in (4, 2):
            for fit in (False, True):
                out[f"triton_x{per_sm}{'_fit' if fit else ''}"] = plan_balanced_mla_decode(
                    batch, HEADS, num_sms=sms, programs=per_sm * sms, fit_items=fit)
        for fit in (False, True):
            out[f"seesaw{'_fit' if fit else ''}"] = plan_balanced_mla_decode(
                batch, HEADS, num_sms=sms, stream=SEESAW_STREAM, fit_items=fit)
        return out

    todo = [(b, n, lengths(b, n)) for b, names in CASES.items() for n in names]
    by_batch = {b: plans(b) for b in CASES}
    timer = PlanTimer(-(-max(sum(lens) for *_, lens in todo) // 128), 128, HEADS,
                      max_splits=256, max_items=max(q.max_work_items for d in by_batch.values()
                                                    for q in d.values()))
    if args.merge_tiles:
        rows = []
        for batch, name, lens in todo:
            for label in ("triton_x4", "seesaw_fit"):
                calls, rotations = merge_tiles(timer, lens, by_batch[batch][label])
                us = time_replays_paired({str(t): c for t, c in calls.items()},
                                         calls_per_graph=rotations, reps=7, min_ms=20)
                rows.append({"batch": batch, "mix": name, "plan": label,
                             **{f"dv{t}_us": round(v, 2) for t, v in us.items()}})
                print(json.dumps(rows[-1]), flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "h200-balanced-merge-tiles.json").write_text(
                json.dumps({"meta": {**meta, "command": "python3 " + " ".join(sys.argv)},
                            "rows": rows}, indent=1))
        return
    rows = []
    for i, (batch, name, lens) in enumerate(todo):
        hint = ladder.hints_for(batch)[ladder.bucket_for(max(lens))]
        split = plan_for(batch, hint)
        us = timer.time_lens(lens, {"split": split, **by_batch[batch]})
        row = {"batch": batch, "mix": name, "tokens": sum(lens),
               "split_plan": split.describe(), **{f"{k}_us": round(v, 2) for k, v in us.items()}}
        for label in ("triton_x4", "triton_x4_fit"):
            calls, rotations, items = stage_calls(timer, lens, by_batch[batch][label])
            stages = time_replays_paired(calls, calls_per_graph=rotations, reps=7, min_ms=20)
            row[f"{label}_items"] = items
            row.update({f"{label}_{k}_us": round(v, 2) for k, v in stages.items()})
        rows.append(row)
        print(f"[{i + 1}/{len(todo)}]", json.dumps(row), flush=True)
    meta["command"] = "python3 " + " ".join(sys.argv)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "h200-balanced-stages.json").write_text(
            json.dumps({"meta": meta, "rows": rows}, indent=1))
        cols = ["split", "triton_x4", "triton_x4_fit", "triton_x2", "triton_x2_fit", "seesaw",
                "seesaw_fit"]
        lines = [f"# Balanced steps stage by stage, and fitted chunks ({meta['gpu']}, 16 heads)",
                 "", f"{meta['date']}, torch {meta['torch']}, triton {meta['triton']}. "
                 f"Command: `{meta['command']}`. Microseconds per call (cold L2, graph "
                 "replays). Triton balanced stage 1 on 4 (x4) or 2 (x2) programs per SM; "
                 "fit: chunks grown until each program runs at most one item. Stages of x4 "
                 "and x4 fit timed alone: planner / stage 1 / merge (items).", "",
                 "| batch | mix | " + " | ".join(cols) + " | x4 stages | x4 fit stages |",
                 "|---|---|" + "---|" * (len(cols) + 2)]
        for r in rows:
            stages = [f"{r[f'{x}_planner_us']:.1f} / {r[f'{x}_stage1_us']:.1f} / "
                      f"{r[f'{x}_merge_us']:.1f} ({r[f'{x}_items']})"
                      for x in ("triton_x4", "triton_x4_fit")]
            lines.append(f"| {r['batch']} | {r['mix']} | "
                         + " | ".join(f"{r[f'{c}_us']:.1f}" for c in cols) + " | "
                         + " | ".join(stages) + " |")
        (args.out / "h200-balanced-stages.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
