"""Kernel variants at the shapes that matter: block sizes, warps, pipeline stages, merge tiles.

Answers "which kernel configuration streams the paged cache fastest" before the plan's
constants are fixed. Same cold-L2 graph-replay timing as kernel_sweep.py.

    python3 bench/kernel_variants.py --out bench/results
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_timing import copy_gbps, rerender, run_meta, time_replays  # noqa: E402
from bench.kernel_sweep import (  # noqa: E402
    HEADS,
    RANK,
    Problem,
    kv_bytes,
    rotated_calls,
    time_merge,
)
from graphbucket.kernels import SplitWorkspace, default_sm_scale  # noqa: E402
from graphbucket.kernels.launch import launch_stage1  # noqa: E402
from graphbucket.plan import plan_mla_decode  # noqa: E402

# (context, batch, splits)
SHAPES = [(131072, 1, 256), (131072, 1, 128), (65536, 1, 256), (65536, 1, 128),
          (131072, 8, 32), (131072, 8, 64), (131072, 64, 8), (131072, 64, 16),
          (4096, 1, 64), (1024, 1, 32), (256, 1, 8)]
STAGE1 = list(itertools.product([32, 64], [4, 8], [1, 2, 3, 4]))  # block_n, warps, stages
MERGE = [(32, 64, 4), (64, 64, 4), (128, 32, 4), (128, 64, 4), (256, 32, 4), (128, 128, 8)]


def stage1_variants(problem: Problem, copy: float) -> list[dict]:
    rows, scale = [], default_sm_scale()
    ws = SplitWorkspace.allocate(64, HEADS, 512, RANK, "cuda")
    for context, batch, splits in SHAPES:
        tables, q, out, seq_lens = problem.inputs(context, batch)
        base = dataclasses.replace(plan_mla_decode(batch, HEADS, context), num_kv_splits=splits)
        for block_n, warps, stages in STAGE1:
            plan = dataclasses.replace(base, block_n=block_n, num_warps=warps, num_stages=stages)

            call = rotated_calls(problem, tables, q, out, seq_lens, ws, plan, scale)
            try:
                us = time_replays(call, calls_per_graph=tables.shape[0])
            except Exception as exc:  # e.g. out of shared memory for a large variant
                print(f"skip {plan.describe()}: {type(exc).__name__}: {exc}"[:200], flush=True)
                continue
            gbps = kv_bytes(context, batch) / (us * 1e3)
            k = launch_stage1(q[0], problem.cache, tables[0], seq_lens, out[0], ws, plan=plan,
                              sm_scale=scale, lse=None)
            resources = {"n_regs": getattr(k, "n_regs", None),
                         "n_spills": getattr(k, "n_spills", None),
                         "shared": getattr(getattr(k, "metadata", None), "shared", None)}
            rows.append({**resources, "context": context, "batch": batch, "splits": splits,
                         "block_n": block_n, "num_warps": warps, "num_stages": stages,
                         "us": round(us, 2), "frac_of_copy": round(gbps / copy, 4)})
            print(rows[-1], flush=True)
    return rows


def merge_variants() -> list[dict]:
    rows = []
    for splits, (block_s, block_dv, warps) in itertools.product([64, 128, 256, 512], MERGE):
        plan = dataclasses.replace(plan_mla_decode(1, HEADS, 1 << 20), num_kv_splits=splits,
                                   merge_block_s=block_s, merge_block_dv=block_dv,
                                   merge_num_warps=warps)
        us = time_merge(plan)
        rows.append({"splits": splits, "block_s": block_s, "block_dv": block_dv,
                     "num_warps": warps, "us": round(us, 2)})
        print(rows[-1], flush=True)
    return rows


def markdown(saved: dict) -> str:
    """Best stage-1 configuration per shape and every merge variant, as markdown."""
    meta, best = saved["meta"], {}
    for r in saved["stage1"]:
        k = (r["context"], r["batch"], r["splits"])
        if k not in best or r["us"] < best[k]["us"]:
            best[k] = r
    lines = [f"# Kernel variants ({meta['gpu']})", "", f"{meta['date']}, torch {meta['torch']}, "
             f"triton {meta['triton']}, copy {meta['copy_gbps']:.0f} GB/s. "
             f"Command: `{meta['command']}`", "",
             "| context | batch | splits | best block_n / warps / stages | us | of copy |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {c} | {b} | {s} | {r['block_n']} / {r['num_warps']} / {r['num_stages']} | "
              f"{r['us']:.1f} | {100 * r['frac_of_copy']:.0f} % |"
              for (c, b, s), r in best.items()]
    lines += ["", "| merge splits | block_s x block_dv, warps | us |", "|---|---|---|"]
    lines += [f"| {m['splits']} | {m['block_s']} x {m['block_dv']}, {m['num_warps']} | "
              f"{m['us']:.2f} |" for m in saved["merge"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--focus", action="store_true",
                    help="split counts that fill whole waves, for a few stage-1 configs")
    ap.add_argument("--render", metavar="JSON", help="only rewrite the markdown of a saved run")
    args = ap.parse_args()
    if args.render:
        return rerender(args.render, markdown)
    if args.focus:
        SHAPES[:] = [(c, 1, s) for c in (131072, 65536) for s in (132, 198, 264, 396, 528)]
        SHAPES.extend([(16384, 1, 132), (16384, 1, 264), (131072, 8, 33), (131072, 8, 49)])
        STAGE1[:] = [(32, 4, 2), (32, 4, 3), (64, 4, 3), (64, 8, 2), (32, 8, 2), (64, 4, 2)]
        MERGE[:] = [(256, 32, 4), (512, 32, 4), (256, 16, 4)]
    if not torch.cuda.is_available():
        sys.exit("kernel_variants.py needs a CUDA GPU")
    torch.manual_seed(0)
    copy = copy_gbps()
    meta = {**run_meta(), "copy_gbps": round(copy, 1)}
    print(meta, flush=True)
    merges = merge_variants()
    stage1 = stage1_variants(Problem(131072 * 64), copy)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "h200-kernel-variants.json"), "w") as f:
        json.dump({"meta": meta, "stage1": stage1, "merge": merges}, f, indent=1)
    with open(os.path.join(args.out, "h200-kernel-variants.md"), "w") as f:
        f.write(markdown({"meta": meta, "stage1": stage1, "merge": merges}))
    best = {}
    for r in stage1:
        k = (r["context"], r["batch"], r["splits"])
        if k not in best or r["us"] < best[k]["us"]:
            best[k] = r
    for r in best.values():
        print("BEST", r)


if __name__ == "__main__":
    main()
