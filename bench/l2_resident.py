"""How much of the decode time is the math: the planned kernel with its KV read from HBM
against the same launch with every block-table entry pointing into 64 pages (4096 tokens,
a few MB), so that after the first touch all KV comes from L2 (H200).

The scattered tables are the sweeps' (``bench.ragged.inputs``: cold L2, each replay its own
pages). The L2-resident time is what the kernel's own loop costs when bytes are nearly
free; a kernel whose L2 time is close to its HBM time is bound by its math and its
latencies, not by the bytes, and reading fewer bytes (an fp8 cache) cannot make it faster.

    python3 bench/l2_resident.py --out DIR        # DIR/h200-l2-resident.{json,md}
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import inputs, random_cache, time_calls  # noqa: E402
from bench.gpu_timing import add_out_argument, out_dir, run_line, run_meta  # noqa: E402
from graphbucket import fp8  # noqa: E402
from graphbucket.kernels import SplitWorkspace, default_sm_scale, mla_decode  # noqa: E402
from graphbucket.plan import plan_mla_decode  # noqa: E402

RANK, PAGE, HOT_PAGES = 512, 64, 64
# (heads, batch, context); 16 heads in the three cache formats, 128 heads in bf16.
SHAPES = [(16, 1, 131072), (16, 8, 131072), (16, 64, 16384), (128, 1, 131072),
          (128, 8, 65536)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(ap, "h200-l2-resident.{json,md}")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("l2_resident.py times CUDA-graph replays and needs a CUDA GPU")
    pages = max(b * -(-c // PAGE) for _, b, c in SHAPES)
    bf16 = random_cache(pages)
    scale = fp8.scale_for(bf16.abs().amax().float().cpu()).cuda()
    formats = {"bf16": (bf16, mla_decode),
               "fp8-tensor": (fp8.quantize(bf16, scale),
                              functools.partial(mla_decode, kv_scale=scale)),
               "fp8-v32": (torch.cat([fp8.pack_v32(bf16[i:i + 4096])
                                      for i in range(0, bf16.shape[0], 4096)]), mla_decode)}
    sm_scale, rows = default_sm_scale(), []
    for heads, batch, context in SHAPES:
        lens = [context] * batch
        tables, q, out, seq_lens = inputs(lens, bf16, heads)
        hot = (torch.arange(tables.shape[2], device="cuda", dtype=torch.int32) % HOT_PAGES)
        hot = hot.expand_as(tables).contiguous()
        plan = plan_mla_decode(batch, heads, context)
        ws = SplitWorkspace.allocate(batch, heads, plan.num_kv_splits, RANK, "cuda")
        for fmt in formats if heads == 16 else ["bf16"]:
            cache, launch = formats[fmt]
            hbm = time_calls(launch, plan, cache, tables, q, out, seq_lens, ws, sm_scale)
            l2 = time_calls(launch, plan, cache, hot, q, out, seq_lens, ws, sm_scale)
            rows.append({"heads": heads, "batch": batch, "context": context, "format": fmt,
                         "hbm_us": round(hbm, 2), "l2_us": round(l2, 2),
                         "l2_over_hbm": round(l2 / hbm, 3), "topology": plan.describe()})
            print(f"{heads:3d} heads b={batch:3d} ctx={context:6d} {fmt:10s} HBM {hbm:8.1f} us"
                  f"  L2-resident {l2:8.1f} us  ({l2 / hbm:.2f})", flush=True)
        del tables, q, out, ws
    result = {"meta": run_meta(), "rows": rows}
    if out := out_dir(args.out):
        with open(os.path.join(out, "h200-l2-resident.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(out, "h200-l2-resident.md"), "w") as f:
            f.write(markdown(result))


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [f"# Decode time with the KV in HBM and in L2 ({meta['gpu']})", "",
             run_line(meta), "",
             "The planned kernel, page 64, CUDA-graph replays. HBM: scattered pages, cold L2. "
             f"L2-resident: every table entry points into {HOT_PAGES} pages. A ratio near 1: "
             "the kernel's loop, not the bytes, sets its time.", "",
             "| heads | batch | context | format | HBM us | L2-resident us | L2 / HBM |",
             "|---:|---:|---:|---|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['heads']} | {r['batch']} | {r['context']} | {r['format']} | "
                     f"{r['hbm_us']:.1f} | {r['l2_us']:.1f} | {r['l2_over_hbm']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
