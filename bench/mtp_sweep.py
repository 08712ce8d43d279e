"""Multi-token decode (verify steps of q_len tokens): folded against flat, same run (H200).

Per shape (16 or 128 heads, batch, context) and q_len in 1, 2, 4: the folded form (q_len x
heads rows per program, ``mla_decode(..., q_len=)``) and the flat form (one row per query
token, ``graphbucket.kernels.verify.flatten_verify``), planned kernels, cold L2, CUDA-graph
replays. ``rel_l2``: the flat output against the folded one on the same inputs (both are
checked against float64 in tests/test_multi_token.py).

    python3 bench/mtp_sweep.py --out DIR        # DIR/h200-mtp.json
    python3 bench/mtp_sweep.py --variants       # folded stage-1 streams for 32 rows too
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import inputs, random_cache  # noqa: E402
from bench.gpu_timing import (  # noqa: E402
    add_out_argument,
    copy_gbps,
    out_dir,
    run_meta,
    time_replays,
    write_run,
)
from graphbucket import plan_streams as S  # noqa: E402
from graphbucket.kernels import SplitWorkspace, default_sm_scale, mla_decode  # noqa: E402
from graphbucket.kernels.verify import flatten_verify  # noqa: E402
from graphbucket.plan import plan_mla_decode  # noqa: E402

PAGE, DIM, RANK = 64, 576, 512
SHAPES = [(16, 1, 32768), (16, 1, 131072), (16, 8, 32768), (16, 8, 131072), (128, 1, 131072),
          (128, 8, 32768)]


# Folded q_len 2 at 16 heads is 32 rows per program: 8 warps (the default above 16 rows)
# hold one program per SM; 4 warps with shorter tiles fit two (sm_90 compile: 246
# registers, 75 KB); or 64-row warpgroup-MMA programs with half the rows masked.
ROW_VARIANTS = {
    "rows32_n16_w4_ahead": replace(S.LONG_PAGE_AHEAD, block_n=16, block_h=32, num_warps=4,
                                   min_tiles_per_split=4),
    "rows32_n32_w4_ahead": replace(S.LONG_PAGE_AHEAD, block_h=32, num_warps=4),
    "rows32_n16_w8_ahead": replace(S.LONG_PAGE_AHEAD, block_n=16, block_h=32,
                                   min_tiles_per_split=4),
    "rows64": S.ROWS_STREAM,
}


def timed(plan, cache, tables, q, out, lens, ws, scale, q_len) -> float:
    def call():
        for r in range(tables.shape[0]):
            mla_decode(q[r], cache, tables[r], lens[r] if lens.dim() == 2 else lens, out[r],
                       ws, plan=plan, sm_scale=scale, q_len=q_len, check=False)
    return time_replays(call, calls_per_graph=tables.shape[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(ap, "h200-mtp.{json,md}")
    ap.add_argument("--variants", action="store_true",
                    help="also time other folded streams where a program holds 32 rows")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("mtp_sweep.py times CUDA-graph replays and needs a CUDA GPU")
    gbps = copy_gbps()
    pages = max(b * -(-c // PAGE) for _, b, c in SHAPES)
    cache = random_cache(pages)
    scale, rows = default_sm_scale(), []
    for heads, batch, context in SHAPES:
        lens = [context] * batch
        for q_len in (1, 2, 4):
            tables, q, out, seq_lens = inputs(lens, cache, heads * q_len)
            folded = plan_mla_decode(batch, heads * q_len, context)
            most = 256 if args.variants and heads * q_len == 32 else 64
            ws = SplitWorkspace.allocate(batch * q_len, heads * q_len,
                                         max(folded.num_kv_splits, most), RANK, "cuda")
            us = timed(folded, cache, tables, q, out, seq_lens, ws, scale, q_len)
            ref = out[0].float().clone()
            rows.append({"q_len": q_len, "form": "folded", "heads": heads, "batch": batch,
                         "context": context, "us": round(us, 3), "rel_l2": 0.0,
                         "topology": folded.describe()})
            if args.variants and heads * q_len == 32:
                for name, stream in ROW_VARIANTS.items():
                    plan = plan_mla_decode(batch, 32, context, stream=stream)
                    vus = timed(plan, cache, tables, q, out, seq_lens, ws, scale, q_len)
                    err = ((out[0].float() - ref).norm() / ref.norm()).item()
                    print(f"h={heads} b={batch} ctx={context} q_len={q_len} {name:20s} "
                          f"{vus:9.1f} us  diff {err:.1e}  {plan.describe()}", flush=True)
                    rows.append({"q_len": q_len, "form": f"folded:{name}", "heads": heads,
                                 "batch": batch, "context": context, "us": round(vus, 3),
                                 "rel_l2": round(err, 6), "topology": plan.describe()})
            if q_len > 1:
                flat = [flatten_verify(q[r], tables[r], seq_lens, q_len)
                        for r in range(tables.shape[0])]
                fq = torch.stack([f[0] for f in flat])
                ft = torch.stack([f[1] for f in flat])
                fl = torch.stack([f[2] for f in flat])
                fo = torch.empty(fq.shape[0], fq.shape[1], heads, RANK, dtype=torch.bfloat16,
                                 device="cuda")
                plan = plan_mla_decode(batch * q_len, heads, context)
                us = timed(plan, cache, ft, fq, fo, fl, ws, scale, 1)
                err = ((fo[0].float().reshape(ref.shape) - ref).norm() / ref.norm()).item()
                rows.append({"q_len": q_len, "form": "flat", "heads": heads, "batch": batch,
                             "context": context, "us": round(us, 3), "rel_l2": round(err, 6),
                             "topology": plan.describe()})
            for r in rows:
                if (r["heads"], r["batch"], r["context"], r["q_len"]) == \
                        (heads, batch, context, q_len) and r["form"] in ("folded", "flat"):
                    print(f"h={heads} b={batch} ctx={context} q_len={q_len} {r['form']:6s} "
                          f"{r['us']:9.1f} us  {r['topology']}", flush=True)
            del tables, q, out, ws
    meta = {**run_meta(), "copy_gbps": round(gbps, 1)}
    print(markdown(meta, rows))
    if out := out_dir(args.out):
        write_run(out, "h200-mtp", meta, rows, markdown(meta, rows))


def markdown(meta: dict, rows: list[dict]) -> str:
    """One line per shape: each q_len's folded and flat time and its ratio to q_len 1."""
    by = {(r["heads"], r["batch"], r["context"], r["q_len"], r["form"]): r["us"] for r in rows}
    shapes = sorted({(r["heads"], r["batch"], r["context"]) for r in rows})
    lines = [f"# Multi-token decode: folded against flat ({meta['gpu']})", "",
             f"{meta['date']}, torch {meta['torch']}, triton {meta['triton']}. Command: "
             f"`{meta['command']}`", "",
             "bf16, page 64, cold L2, CUDA-graph replays, planned kernels. us (x the q_len 1 "
             "time of the same shape).", "",
             "| heads | batch | context | q_len 1 | q_len 2 folded | q_len 2 flat "
             "| q_len 4 folded | q_len 4 flat |", "|---|---|---|---|---|---|---|---|"]
    for h, b, c in shapes:
        one = by.get((h, b, c, 1, "folded"))
        cells = [f"{one:.1f}" if one else "-"]
        for q_len in (2, 4):
            for form in ("folded", "flat"):
                us = by.get((h, b, c, q_len, form))
                cells.append(f"{us:.1f} ({us / one:.2f}x)" if us and one else "-")
        lines.append(f"| {h} | {b} | {c} | " + " | ".join(cells) + " |")
    other = [r for r in rows if r["form"].startswith("folded:")]
    if other:
        lines += ["", "Other folded streams (`--variants`):", "",
                  "| heads | batch | context | q_len | stream | us | topology |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['heads']} | {r['batch']} | {r['context']} | {r['q_len']} | "
                  f"{r['form'].split(':', 1)[1]} | {r['us']:.1f} | {r['topology']} |"
                  for r in other]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
