"""Should 32 query rows (32 heads, or 16 heads x 2 verify tokens) run 64-row programs?

Today the planner gives 17-63 rows 32-row programs (the Triton kernel); from 64 rows it
plans 64-row programs, which on Hopper run the Gluon seesaw. At 16 heads x 2 tokens the
seesaw at its own split count took 0.74-0.92x the planned 32-row verify step (bf16, H100,
12-06 23:30). This times, per cache format (bf16, per-tensor fp8, V3.2 fp8) and shape,
the planned step (``plan_mla_decode(batch, rows, context)``) against the 64-row plan at the
same hint (``stream=SEESAW_STREAM``), both through ``mla_decode`` as a runner launches
them, with the 16-head q_len 1 step beside the verify shapes; interleaved CUDA-graph
replays over a cold L2, median microseconds; each 64-row output against the planned one
(relative L2). A format the 64-row path cannot run records the error instead.

    python3 bench/experiments/rows32_route.py --out DIR      # DIR/rows32-route.{json,md}
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.gpu_timing import add_out_argument, report_run, run_line, run_meta  # noqa: E402

# (heads, q_len, batch, context)
SHAPES = [(32, 1, 1, 131072), (32, 1, 8, 16384), (32, 1, 64, 4096), (32, 1, 8, 65536),
          (16, 2, 1, 131072), (16, 2, 8, 16384), (16, 2, 64, 4096), (16, 2, 8, 65536)]
FORMATS = ("bf16", "fp8-tensor", "fp8-v32")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(p, "rows32-route.{json,md}")
    p.add_argument("--reps", type=int, default=7, help="interleaved rounds per shape")
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    return p.parse_args(argv)


def caches(formats: list[str]) -> dict:
    """format -> (cache, launch) over the same random latent rows."""
    from bench.common import random_cache
    from graphbucket import fp8
    from graphbucket.kernels import mla_decode

    pages = max(b * -(-c // 64) for *_, b, c in SHAPES)
    bf16 = random_cache(pages)
    out = {"bf16": (bf16, mla_decode)}
    if "fp8-tensor" in formats:
        scale = fp8.scale_for(bf16.abs().amax().float().cpu()).cuda()
        out["fp8-tensor"] = (fp8.quantize(bf16, scale),
                             functools.partial(mla_decode, kv_scale=scale))
    if "fp8-v32" in formats:
        out["fp8-v32"] = (v32_cache(bf16), mla_decode)
    return {f: out[f] for f in formats}


def v32_cache(bf16):
    import torch

    from graphbucket import fp8

    return torch.cat([fp8.pack_v32(bf16[i:i + 4096]) for i in range(0, bf16.shape[0], 4096)])


def measure(formats: list[str], reps: int) -> list[dict]:
    from graphbucket.kernels import default_sm_scale

    by_format = caches(formats)
    rows_out = []
    for fmt, (cache, launch) in by_format.items():
        for shape in SHAPES:
            row = time_shape(fmt, cache, launch, by_format["bf16"][0], shape,
                             default_sm_scale(), reps)
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    return rows_out


def time_shape(fmt: str, cache, launch, bf16, shape: tuple[int, int, int, int],
               scale: float, reps: int) -> dict:
    """One (format, shape) row: the planned step, the 64-row plan, and at q_len 2 the
    16-head q_len 1 step, timed interleaved."""
    from bench.common import inputs
    from graphbucket.kernels import SplitWorkspace
    from graphbucket.plan import plan_mla_decode
    from graphbucket.plan_streams import SEESAW_STREAM
    from graphbucket.tuning.measure import time_replays_paired

    heads, q_len, batch, context = shape
    lens, rows = [context] * batch, heads * q_len
    tables, q, out, seq_lens = inputs(lens, bf16, rows)
    tables1, q1, out1, _ = inputs(lens, bf16, heads)
    plans = {"planned": plan_mla_decode(batch, rows, context),
             "rows64": plan_mla_decode(batch, rows, context, stream=SEESAW_STREAM)}
    if q_len > 1:
        plans["q1"] = plan_mla_decode(batch, heads, context)
    ws = SplitWorkspace.allocate(batch, rows, max(p.num_kv_splits for p in plans.values()),
                                 512, "cuda")

    def call(label: str, r: int) -> None:
        if label == "q1":
            launch(q1[r], cache, tables1[r], seq_lens, out1[r], ws, plan=plans["q1"],
                   sm_scale=scale)
        else:
            launch(q[r], cache, tables[r], seq_lens, out[r], ws, plan=plans[label],
                   sm_scale=scale, q_len=q_len)

    row = {"format": fmt, "heads": heads, "q_len": q_len, "batch": batch, "context": context,
           **{f"{k}_plan": p.describe() for k, p in plans.items()}}
    try:
        call("planned", 0)
    except Exception as failure:  # noqa: BLE001 (recorded; the other rows still run)
        return {**row, "planned_error": f"{type(failure).__name__}: {failure}"[:300]}
    want = out[0].float().clone()
    try:
        out[0].fill_(float("nan"))
        call("rows64", 0)
        err = ((out[0].float() - want).norm() / want.norm()).item()
        row["rows64_rel_l2"] = float(f"{err:.3e}")
    except Exception as failure:  # noqa: BLE001 (a path that cannot run is a result)
        row["rows64_error"] = f"{type(failure).__name__}: {failure}"[:300]
    labels = [k for k in plans if k != "rows64" or "rows64_error" not in row]
    n = min(tables.shape[0], tables1.shape[0])
    fns = {k: (lambda k=k: [call(k, r) for r in range(n)]) for k in labels}
    us = time_replays_paired(fns, calls_per_graph=n, reps=reps)
    row.update({f"{k}_us": round(v, 2) for k, v in us.items()})
    if "rows64" in us:
        row["rows64_over_planned"] = round(us["rows64"] / us["planned"], 3)
    if "q1" in us:
        row["planned_over_q1"] = round(us["planned"] / us["q1"], 3)
        if "rows64" in us:
            row["rows64_over_q1"] = round(us["rows64"] / us["q1"], 3)
    return row


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# 32 query rows: planned (32-row programs) against 64-row programs "
             f"({meta['gpu']})", "",
             f"{run_line(meta)}. Interleaved CUDA-graph replays, cold L2, median "
             "microseconds per call through `mla_decode`; `rows64 / planned` below 1 means "
             "64-row programs (the seesaw on Hopper) are faster; verify shapes (q_len 2) also "
             "over the 16-head q_len 1 step (issue 28's target: <= 1.10x).", "",
             "| format | heads | q_len | batch | context | planned us | 64-row us | 64-row / "
             "planned | planned / q1 | 64-row / q1 | 64-row rel L2 | 64-row plan |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "planned_error" in r:
            lines.append(f"| {r['format']} | {r['heads']} | {r['q_len']} | {r['batch']} | "
                         f"{r['context']} | failed: {r['planned_error']} |" + " - |" * 7)
            continue
        fail = r.get("rows64_error")
        lines.append(
            f"| {r['format']} | {r['heads']} | {r['q_len']} | {r['batch']} | {r['context']} | "
            f"{r['planned_us']} | {r.get('rows64_us', '-')} | "
            f"{r.get('rows64_over_planned', '-')} | {r.get('planned_over_q1', '-')} | "
            f"{r.get('rows64_over_q1', '-')} | {r.get('rows64_rel_l2', '-')} | "
            f"{('failed: ' + fail) if fail else r['rows64_plan']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("rows32_route.py times CUDA graphs and needs a CUDA GPU")
    rows = measure(args.formats, args.reps)
    report_run(args.out, "rows32-route", run_meta(), rows, markdown)


if __name__ == "__main__":
    main()
