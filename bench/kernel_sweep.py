"""Kernel sweep: split-KV MLA decode time over context x batch x split count (H200).

Every configuration is timed as CUDA-graph replays with a cold L2: one graph holds R calls,
each over a different random scatter of pages of one large cache, with R chosen so that a
replay touches several L2s worth of distinct KV. The same run measures a large
device-to-device copy; ``frac_of_copy`` is the kernel's bandwidth over that ceiling.

    python3 bench/kernel_sweep.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_timing import copy_gbps, run_meta, time_replays  # noqa: E402
from graphbucket.kernels import SplitWorkspace, default_sm_scale  # noqa: E402
from graphbucket.kernels.launch import launch_merge  # noqa: E402
from graphbucket.plan import plan_mla_decode  # noqa: E402
from graphbucket.tuning.measure import Problem, rotated_calls  # noqa: E402

CONTEXTS = [1, 64, 256, 1024, 4096, 16384, 65536, 131072]
BATCHES = [1, 8, 64]
SPLITS = [1 << i for i in range(10)]  # 1 .. 512
HEADS, PAGE, DIM, RANK = 16, 64, 576, 512


def kv_bytes(context: int, batch: int) -> int:
    q_and_out = batch * HEADS * (DIM + RANK) * 2
    return batch * context * DIM * 2 + q_and_out


def sweep(args) -> list[dict]:
    problem = Problem(max(args.contexts) * max(args.batches))
    max_splits = max(args.splits)
    ws = SplitWorkspace.allocate(max(args.batches), HEADS, max_splits, RANK, "cuda")
    rows, scale = [], default_sm_scale()
    total = len(args.contexts) * len(args.batches) * (len(args.splits) + 1)
    for context in args.contexts:
        for batch in args.batches:
            tables, q, out, seq_lens = problem.inputs(context, batch)
            rotations = tables.shape[0]
            base = plan_mla_decode(batch, HEADS, context)
            # The plan's own split count is timed too, so every shape has a planned row.
            for splits in sorted(set(args.splits) | {base.num_kv_splits}):
                plan = base.with_splits(splits)

                call = rotated_calls(problem, tables, q, out, seq_lens, ws, plan, scale)
                us = time_replays(call, calls_per_graph=rotations)
                gbps = kv_bytes(context, batch) / (us * 1e3)
                rows.append({"context": context, "batch": batch, "heads": HEADS,
                             "splits": splits, "planned_splits": base.num_kv_splits,
                             "us": round(us, 3), "gbps": round(gbps, 1),
                             "frac_of_copy": round(gbps / args.copy_gbps, 4)})
                print(f"[{len(rows)}/{total}] ctx={context} b={batch} splits={splits} "
                      f"{us:.2f} us {gbps:.0f} GB/s", flush=True)
    return rows


def time_merge(plan) -> float:
    """Stage 2 alone at a long context (every split live), over random partials."""
    ws = SplitWorkspace.allocate(plan.batch_size, plan.num_heads, plan.num_kv_splits,
                                 plan.kv_lora_rank, "cuda")
    ws.partial_o.normal_()
    ws.partial_lse.normal_()
    seq_lens = torch.full((plan.batch_size,), 131072, dtype=torch.int32, device="cuda")
    out = torch.empty(plan.batch_size, HEADS, RANK, dtype=torch.bfloat16, device="cuda")
    return time_replays(lambda: launch_merge(seq_lens, out, ws, plan=plan, lse=None),
                        calls_per_graph=1)


def merge_cost(splits_list: list[int]) -> list[dict]:
    """Stage 2 alone at batch 1 for each split count."""
    rows = []
    for splits in splits_list:
        plan = plan_mla_decode(1, HEADS, 1 << 20, max_splits=splits).with_splits(splits)
        rows.append({"splits": splits, "batch": 1, "heads": HEADS,
                     "merge_us": round(time_merge(plan), 3)})
    return rows


def best_rows(rows: list[dict]) -> list[dict]:
    best = {}
    for row in rows:
        key = (row["context"], row["batch"])
        if key not in best or row["us"] < best[key]["us"]:
            best[key] = row
    planned = {(r["context"], r["batch"]): r for r in rows if r["splits"] == r["planned_splits"]}
    out = []
    for key, row in sorted(best.items()):
        p = planned.get(key)
        out.append({**row, "plan_splits": p["splits"] if p else None,
                    "plan_us": p["us"] if p else None})
    return out


def markdown(meta: dict, rows: list[dict], merges: list[dict]) -> str:
    lines = [f"# MLA decode kernel sweep ({meta['gpu']})", "",
             f"{meta['date']}, torch {meta['torch']}, triton {meta['triton']}, "
             f"copy {meta['copy_gbps']:.0f} GB/s (read+write). Command: `{meta['command']}`",
             "", "Best split count per shape (16 heads, bf16, page 64, cold L2, graph replay):",
             "", "| context | batch | best splits | us | GB/s | of copy | planned splits | "
             "planned us |", "|---|---|---|---|---|---|---|---|"]
    for r in best_rows(rows):
        plan_us = "-" if r["plan_us"] is None else f"{r['plan_us']:.1f}"
        lines.append(f"| {r['context']} | {r['batch']} | {r['splits']} | {r['us']:.1f} | "
                     f"{r['gbps']:.0f} | {100 * r['frac_of_copy']:.0f} % | "
                     f"{r['planned_splits']} | {plan_us} |")
    lines += ["", "Stage 2 (merge) alone, batch 1:", "", "| splits | us |", "|---|---|"]
    lines += [f"| {m['splits']} | {m['merge_us']:.2f} |" for m in merges]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS)
    ap.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    ap.add_argument("--splits", type=int, nargs="+", default=SPLITS)
    ap.add_argument("--render", metavar="JSON", help="only rewrite the markdown of a saved run")
    args = ap.parse_args()
    if args.render:
        with open(args.render) as f:
            saved = json.load(f)
        with open(os.path.splitext(args.render)[0] + ".md", "w") as f:
            f.write(markdown(saved["meta"], saved["rows"], saved["merge"]))
        return
    if not torch.cuda.is_available():
        sys.exit("kernel_sweep.py times CUDA-graph replays and needs a CUDA GPU")
    torch.manual_seed(0)
    args.copy_gbps = copy_gbps()
    meta = {**run_meta(), "copy_gbps": round(args.copy_gbps, 1)}
    print(f"copy bandwidth {args.copy_gbps:.0f} GB/s on {meta['gpu']}", flush=True)
    rows = sweep(args)
    merges = merge_cost([32, 64, 128, 256, 512])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "h200-kernel-sweep.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "merge": merges}, f, indent=1)
    text = markdown(meta, rows, merges)
    with open(os.path.join(args.out, "h200-kernel-sweep.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
