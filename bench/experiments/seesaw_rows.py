"""Why a 16-head verify step on the Gluon seesaw costs more than its q_len 1 step although
both run the same 64-row programs over the same tiles (H100/H200).

At 16 heads a 64-row seesaw program holds 16 live rows at q_len 1, 32 at q_len 2 and 64 at
q_len 4; the tensor-core work per tile is the same (the MMA's M is 64 either way), so a
cost that grows with the live rows comes from elsewhere. Per shape, at the seesaw planner's
own split count, interleaved CUDA-graph replays of:

- ``q{1,2,4}``: stage 1 and the merge, KV from scattered pages (cold L2);
- ``q{1,4}-eager``: the same with the eager rescale (``lazy_rescale=False``): whether the
  lazy step's skipped rescales are rarer with more live rows;
- ``q{1,4}-l2``: every request's table over the same pages, which then stay in the L2:
  what the loop costs when its loads return at L2 latency;
- ``q{1,4}-stage1``: stage 1 alone (no merge).

Each variant's output is checked against the lazy step's of the same q_len (relative L2).
``--ncu``: instead, stage 1 at q_len 1 and 4 on batch 64 x 4K launched eagerly, twice
each, for Nsight Compute (``-k regex:seesaw_stage1``); it writes nothing itself.

    python3 bench/experiments/seesaw_rows.py --out DIR
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

HEADS = 16
SHAPES = [(64, 4096), (8, 16384), (1, 131072)]
VARIANTS = ("q1", "q2", "q4", "q1-eager", "q4-eager", "q1-l2", "q4-l2", "q1-stage1",
            "q4-stage1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(p, "h200-seesaw-rows.{json,md}")
    p.add_argument("--reps", type=int, default=7, help="interleaved rounds per shape")
    p.add_argument("--shapes", nargs="+", default=[f"{b}x{c}" for b, c in SHAPES],
                   help="BATCHxCONTEXT shapes (default: %(default)s)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                   help="variants to time (default: all; q1 is always timed)")
    p.add_argument("--ncu", action="store_true",
                   help="eager launches at 64 x 4K for Nsight Compute, no timing")
    return p.parse_args(argv)


def launch_for_ncu() -> None:
    import torch

    from bench.common import inputs, random_cache
    from graphbucket.kernels import SplitWorkspace, default_sm_scale
    from graphbucket.kernels.launch import launch_seesaw_stage1
    from graphbucket.plan import plan_mla_decode
    from graphbucket.plan_streams import SEESAW_STREAM

    batch, context = SHAPES[0]
    cache = random_cache(batch * -(-context // 64))
    for q_len in (1, 4):
        tables, q, out, seq_lens = inputs([context] * batch, cache, HEADS * q_len)
        plan = plan_mla_decode(batch, HEADS * q_len, context, stream=SEESAW_STREAM)
        ws = SplitWorkspace.allocate(batch, 64, plan.num_kv_splits, 512, "cuda")
        for _ in range(2):
            launch_seesaw_stage1(q[0], cache, tables[0], seq_lens, out[0],
                                 ws if plan.use_stage2 else None, plan=plan,
                                 sm_scale=default_sm_scale(), lse=None, q_len=q_len)
        torch.cuda.synchronize()


def resident(tables, pages: int = 64):
    """``tables`` with every request reading the first ``pages`` pages of the first
    request of rotation 0, over and over (4.7 MB at 64 pages: they stay in the L2)."""
    import torch

    width = tables.shape[-1]
    idx = torch.arange(width, device=tables.device) % min(pages, width)
    return tables[0, 0, idx].expand_as(tables).contiguous()


def measure(reps: int, shapes: list[tuple[int, int]], variants: list[str]) -> list[dict]:

    from bench.common import inputs, random_cache
    from graphbucket.kernels import SplitWorkspace, default_sm_scale
    from graphbucket.kernels.launch import launch_merge, launch_seesaw_stage1
    from graphbucket.plan import plan_mla_decode
    from graphbucket.plan_streams import SEESAW_STREAM
    from graphbucket.tuning.measure import time_replays_paired

    variants = ["q1"] + [v for v in variants if v != "q1"]
    cache = random_cache(max(b * -(-c // 64) for b, c in shapes))
    scale = default_sm_scale()
    rows_out = []
    for batch, context in shapes:
        lens = [context] * batch
        plans = {q_len: plan_mla_decode(batch, HEADS * q_len, context, stream=SEESAW_STREAM)
                 for q_len in (1, 2, 4)}
        plan = plans[4]
        per_q = {}
        for q_len in (1, 2, 4):
            tables, q, out, seq_lens = inputs(lens, cache, HEADS * q_len)
            per_q[q_len] = (tables, q, out, seq_lens)
        n = min(t[0].shape[0] for t in per_q.values())
        ws = SplitWorkspace.allocate(batch, 64, max(p.num_kv_splits for p in plans.values()),
                                     512, "cuda")

        resident_tables = {k: resident(v[0]) for k, v in per_q.items()}

        def call(r: int, q_len: int, *, lazy: bool = True, l2: bool = False,
                 merge: bool = True) -> None:
            tables, q, out, seq_lens = per_q[q_len]
            table = resident_tables[q_len][r] if l2 else tables[r]
            p = plans[q_len]
            launch_seesaw_stage1(q[r], cache, table, seq_lens, out[r],
                                 ws if p.use_stage2 else None, plan=p, sm_scale=scale,
                                 lse=None, q_len=q_len, lazy_rescale=lazy)
            if merge and p.merge_kernel:
                launch_merge(seq_lens, out[r], ws, plan=p, lse=None, block_n=64)

        def variant(name: str):
            """``q<N>[-eager|-l2|-stage1]`` as one call over rotation r."""
            q, _, mod = name.partition("-")
            return lambda r: call(r, int(q[1:]), lazy=mod != "eager", l2=mod == "l2",
                                  merge=mod != "stage1")

        calls = {v: variant(v) for v in variants}
        errors = {}
        for q_len in (1, 4) if "q4-eager" in variants or "q1-eager" in variants else ():
            out = per_q[q_len][2]
            call(0, q_len)
            want = out[0].float().clone()
            out[0].fill_(float("nan"))
            call(0, q_len, lazy=False)
            errors[f"q{q_len}-eager"] = ((out[0].float() - want).norm() / want.norm()).item()
        fns = {label: (lambda fn=fn: [fn(r) for r in range(n)]) for label, fn in calls.items()}
        us = time_replays_paired(fns, calls_per_graph=n, reps=reps)
        row = {"heads": HEADS, "batch": batch, "context": context, "plan": plan.describe(),
               "plans_differ": len({p.describe() for p in plans.values()}) > 1,
               **{f"{v}_us": round(us[v], 2) for v in variants},
               "rel_err_eager": {k: float(f"{e:.3e}") for k, e in errors.items()}}
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    return rows_out


def ratio(row: dict, num: str, den: str) -> str:
    """``num`` over ``den`` of one row, or "-" where either was not timed."""
    a, b = row.get(f"{num}_us"), row.get(f"{den}_us")
    return f"{a / b:.3f}" if a and b else "-"


def markdown(meta: dict, rows: list[dict]) -> str:
    timed = [v for v in VARIANTS if any(f"{v}_us" in r for r in rows)]
    lines = [f"# Live rows on the 16-head seesaw: q_len 1, 2 and 4 on the same programs "
             f"({meta['gpu']})", "",
             f"{run_line(meta)}. Interleaved CUDA-graph replays, median microseconds per "
             "call, the seesaw planner's split count; `-eager`: the eager rescale; `-l2`: "
             "every request over the same pages (L2-resident); `-stage1`: without the "
             "merge.", "",
             "| batch | context | plan | " + " | ".join(timed) + " | q4 / q1 | q4 / q1, L2 "
             "| q4 / q1, eager | q1, L2 / DRAM |",
             "|---:|---:|---|" + "---:|" * (len(timed) + 4)]
    for r in rows:
        cells = " | ".join(str(r.get(f"{v}_us", "-")) for v in timed)
        lines.append(f"| {r['batch']} | {r['context']} | {r['plan']} | {cells} | "
                     f"{ratio(r, 'q4', 'q1')} | {ratio(r, 'q4-l2', 'q1-l2')} | "
                     f"{ratio(r, 'q4-eager', 'q1-eager')} | {ratio(r, 'q1-l2', 'q1')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("seesaw_rows.py times the Gluon seesaw and needs a Hopper GPU")
    if args.ncu:
        launch_for_ncu()
        return
    meta = run_meta()
    meta["command"] = "python3 " + " ".join(sys.argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    rows = measure(args.reps, shapes, args.variants)
    report_run(args.out, "h200-seesaw-rows", meta, rows, markdown)


if __name__ == "__main__":
    main()
