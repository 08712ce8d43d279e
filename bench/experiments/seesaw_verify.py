"""Verify steps (q_len tokens per request) on the Gluon seesaw against the Triton verify step,
each over the q_len 1 step of the same batch, in one process (H100/H200).

The seesaw's verify step (``launch_seesaw_stage1(..., q_len=)``): its rows are q_len tokens
x heads, 64 per program, each token with its causal limit. Per shape, interleaved
CUDA-graph replays over a cold L2: the planned q_len 1 step (``plan_mla_decode(batch, heads,
context)``), the planned verify step (``q_len x heads`` rows; below 64 rows the Triton
kernel), the seesaw verify step with that plan's split count, and with the seesaw planner's
own (``stream=SEESAW_STREAM``: 64-row programs, whose split count does not change with the
rows). Each seesaw output is compared with the planned verify step's (relative L2).

    python3 bench/experiments/seesaw_verify.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.gpu_timing import (  # noqa: E402
    add_out_argument,
    report_run,
    run_line,
    run_meta,
)

# (heads, q_len, batch, context)
SHAPES = [(16, 2, 1, 131072), (16, 4, 1, 131072), (16, 2, 8, 16384), (16, 4, 8, 16384),
          (16, 2, 64, 4096), (16, 4, 64, 4096), (128, 2, 1, 131072), (128, 2, 8, 65536),
          (128, 2, 64, 4096)]
VARIANTS = ("q1", "triton", "seesaw", "seesaw_own")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(p, "h200-seesaw-verify.{json,md}")
    p.add_argument("--reps", type=int, default=7, help="interleaved rounds per shape")
    return p.parse_args(argv)


def measure(reps: int) -> list[dict]:
    from bench.common import inputs, random_cache
    from graphbucket.kernels import SplitWorkspace, default_sm_scale, mla_decode
    from graphbucket.kernels.launch import launch_merge, launch_seesaw_stage1
    from graphbucket.plan import plan_mla_decode
    from graphbucket.plan_streams import SEESAW_STREAM
    from graphbucket.tuning.measure import time_replays_paired

    cache = random_cache(max(b * -(-c // 64) for *_, b, c in SHAPES))
    scale = default_sm_scale()
    rows_out = []
    for heads, q_len, batch, context in SHAPES:
        lens = [context] * batch
        rows = q_len * heads
        tables1, q1, out1, seq_lens = inputs(lens, cache, heads)
        tables, q, out, _ = inputs(lens, cache, rows)
        n = min(tables1.shape[0], tables.shape[0])
        plan1 = plan_mla_decode(batch, heads, context)
        triton = plan_mla_decode(batch, rows, context)
        own = plan_mla_decode(batch, rows, context, stream=SEESAW_STREAM)
        seesaw = own.with_splits(triton.num_kv_splits)
        splits = max(plan1.num_kv_splits, triton.num_kv_splits, own.num_kv_splits)
        ws = SplitWorkspace.allocate(batch, max(rows, heads), splits, 512, "cuda")

        def seesaw_call(r: int, plan, q=q, tables=tables, out=out, ws=ws, q_len=q_len) -> None:
            launch_seesaw_stage1(q[r], cache, tables[r], seq_lens, out[r],
                                 ws if plan.use_stage2 else None, plan=plan, sm_scale=scale,
                                 lse=None, q_len=q_len)
            if plan.merge_kernel:
                launch_merge(seq_lens, out[r], ws, plan=plan, lse=None, block_n=64)

        def triton_call(r: int, triton=triton, q=q, tables=tables, out=out, ws=ws,
                        q_len=q_len) -> None:
            mla_decode(q[r], cache, tables[r], seq_lens, out[r], ws, plan=triton,
                       sm_scale=scale, q_len=q_len)

        def q1_call(r: int, plan1=plan1, q1=q1, tables1=tables1, out1=out1, ws=ws) -> None:
            mla_decode(q1[r], cache, tables1[r], seq_lens, out1[r], ws, plan=plan1,
                       sm_scale=scale)

        triton_call(0)
        want = out[0].float().clone()
        errors = {}
        for label, plan in (("seesaw", seesaw), ("seesaw_own", own)):
            out[0].fill_(float("nan"))
            seesaw_call(0, plan)
            errors[label] = ((out[0].float() - want).norm() / want.norm()).item()
        calls = {"q1": q1_call, "triton": triton_call,
                 "seesaw": lambda r: seesaw_call(r, seesaw),
                 "seesaw_own": lambda r: seesaw_call(r, own)}
        fns = {label: (lambda fn=fn: [fn(r) for r in range(n)]) for label, fn in calls.items()}
        us = time_replays_paired(fns, calls_per_graph=n, reps=reps)
        row = {"heads": heads, "q_len": q_len, "batch": batch, "context": context,
               "q1_plan": plan1.describe(), "verify_plan": triton.describe(),
               "seesaw_own_plan": own.describe(),
               **{f"{v}_us": round(us[v], 2) for v in VARIANTS},
               **{f"{v}_over_q1": round(us[v] / us["q1"], 3) for v in VARIANTS[1:]},
               "rel_err_vs_triton": {k: float(f"{e:.3e}") for k, e in errors.items()}}
        rows_out.append(row)
        print(json.dumps(row), flush=True)
        del tables1, q1, out1, tables, q, out, ws
    return rows_out


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# Verify steps on the seesaw against the planned verify step ({meta['gpu']})", "",
             f"{run_line(meta)}. Interleaved CUDA-graph replays, cold L2, median microseconds "
             "per call; each verify step over the q_len 1 step of the same batch; the "
             "seesaw's error against the planned verify step (relative L2). Targets (issue "
             "28): q_len 2 <= 1.10x and q_len 4 <= 1.35x a q_len 1 step at 16 heads; q_len 2 "
             "<= 1.9x at 128 heads.", "",
             "| heads | q_len | batch | context | q_len 1 us | verify us | x | seesaw, its splits "
             "us | x | seesaw, own splits us | x | own plan | error seesaw | error own |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        e = r["rel_err_vs_triton"]
        lines.append(f"| {r['heads']} | {r['q_len']} | {r['batch']} | {r['context']} | "
                     f"{r['q1_us']} | {r['triton_us']} | {r['triton_over_q1']} | "
                     f"{r['seesaw_us']} | {r['seesaw_over_q1']} | {r['seesaw_own_us']} "
                     f"| {r['seesaw_own_over_q1']} | {r['seesaw_own_plan']} | "
                     f"{e['seesaw']:.1e} | {e['seesaw_own']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("seesaw_verify.py times the Gluon seesaw and needs a Hopper GPU")
    meta = run_meta()
    meta["command"] = "python3 " + " ".join(sys.argv)
    rows = measure(args.reps)
    report_run(args.out, "h200-seesaw-verify", meta, rows, markdown)


if __name__ == "__main__":
    main()
