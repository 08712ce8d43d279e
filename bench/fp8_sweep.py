"""FP8 KV cache against bf16: decode time per shape, same run (H200).

The same random latent cache in three formats: bf16, per-tensor fp8 (``graphbucket.fp8``,
scale = amax / 448) and DeepSeek-V3.2's fp8 rows (``pack_v32``); the planned kernel on
each, 16 heads, page 64, cold L2, CUDA-graph replays. ``frac_of_copy`` is over that
format's bytes (1152, 576 or 656 per token, plus q and out); ``rel_l2`` is the fp8 output
against the bf16-cache output on the same inputs (the fp8 kernels against float64 over
the dequantized cache are in tests/test_fp8.py).

    python3 bench/fp8_sweep.py --out DIR        # DIR/h200-fp8.{json,md}
    python3 bench/fp8_sweep.py --ab cvt-64x8 bits-64x8 noprefetch --out DIR

``--ab`` adds fp8 rows for other stage-1 variants of the same plan (``VARIANTS``):
"<dequant>-<tokens>x<warps>[-v<bytes>]" times the plan with that ``plan.fp8``
(``Fp8Stream``: dequantization, prefetched tile tokens and warps, bytes per thread load);
"noprefetch" copies the fp8 tile to shared memory as stored.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import inputs, random_cache, time_calls  # noqa: E402
from bench.gpu_timing import (  # noqa: E402
    add_out_argument,
    copy_gbps,
    out_dir,
    run_line,
    run_meta,
)
from graphbucket import fp8  # noqa: E402
from graphbucket.kernels import SplitWorkspace, default_sm_scale, mla_decode  # noqa: E402
from graphbucket.plan import LaunchPlan, plan_mla_decode  # noqa: E402
from graphbucket.plan_streams import Fp8Stream  # noqa: E402

HEADS, PAGE, DIM, RANK = 16, 64, 576, 512
SHAPES = [(1, 256), (8, 256), (64, 256), (1, 16384), (1, 65536), (1, 131072), (8, 65536),
          (8, 131072), (64, 16384), (64, 65536)]


def floor_us(gbps: float, lens: list[int], row_bytes: int) -> float:
    nbytes = sum(lens) * row_bytes + len(lens) * HEADS * (DIM + RANK) * 2
    return nbytes / (gbps * 1e3)


def stage1_variant(plan: LaunchPlan, name: str | None) -> LaunchPlan:
    """``plan`` with stage 1's fp8 stream of a variant ("<dequant>-<tokens>x<warps>[-v<bytes>]",
    "noprefetch"; None: as planned)."""
    if name is None:
        return plan
    if name == "noprefetch":
        return dataclasses.replace(plan, fp8=Fp8Stream(register_prefetch=False))
    dequant, tile, *vec = name.split("-")
    tokens, warps = (int(v) for v in tile.split("x"))
    return dataclasses.replace(plan, fp8=Fp8Stream(
        dequant=dequant, tile_tokens=tokens, tile_warps=warps,
        raw_vec=int(vec[0].lstrip("v")) if vec else 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(ap, "h200-fp8.{json,md}")
    ap.add_argument("--ab", nargs="*", default=[], metavar="VARIANT",
                    help="also time the fp8 formats with these stage-1 variants "
                         "(<float|bits|cvt>-<tokens>x<warps>, or noprefetch)")
    ap.add_argument("--shapes", nargs="*", default=None, metavar="BxCONTEXT",
                    help="only these shapes, e.g. 8x131072 (default: all of SHAPES)")
    args = ap.parse_args()
    shapes = SHAPES if not args.shapes else \
        [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    if not torch.cuda.is_available():
        sys.exit("fp8_sweep.py times CUDA-graph replays and needs a CUDA GPU")
    gbps = copy_gbps()
    pages = max(b * -(-c // PAGE) for b, c in shapes)
    bf16 = random_cache(pages)
    scale = fp8.scale_for(bf16.abs().amax().float().cpu()).cuda()
    packed = fp8.quantize(bf16, scale)
    v32 = torch.cat([fp8.pack_v32(bf16[i:i + 4096]) for i in range(0, bf16.shape[0], 4096)])
    sm_scale, rows = default_sm_scale(), []
    for batch, context in shapes:
        lens = [context] * batch
        tables, q, out, seq_lens = inputs(lens, bf16)
        plan = plan_mla_decode(batch, HEADS, context)
        ws = SplitWorkspace.allocate(batch, HEADS, plan.num_kv_splits, RANK, "cuda")
        outs = {}
        todo = [("bf16", bf16, mla_decode, 2 * DIM, None),
                ("fp8-tensor", packed, functools.partial(mla_decode, kv_scale=scale), DIM,
                 None),
                ("fp8-v32", v32, mla_decode, fp8.V32_BYTES, None)]
        todo += [(fmt, cache, launch, nbytes, variant) for variant in args.ab
                 for fmt, cache, launch, nbytes, _ in todo[1:]]
        for fmt, cache, launch, nbytes, variant in todo:
            us = time_calls(launch, stage1_variant(plan, variant), cache, tables, q, out,
                            seq_lens, ws, sm_scale)
            got = out[0].float().clone()
            outs.setdefault(fmt, got)
            f_us = floor_us(gbps, lens, nbytes)
            err = ((got - outs["bf16"]).norm() / outs["bf16"].norm()).item()
            rows.append({"format": fmt, "batch": batch, "context": context, "heads": HEADS,
                         "us": round(us, 3), "floor_us": round(f_us, 3),
                         "frac_of_copy": round(f_us / us, 4), "rel_l2": round(err, 5),
                         "topology": plan.describe(),
                         **({} if variant is None else {"variant": variant})})
            print(f"b={batch:3d} ctx={context:6d} {fmt:10s} {variant or '':10s}"
                  f" {us:8.1f} us {100 * f_us / us:4.0f} % of copy  rel_l2 vs bf16 {err:.1e}",
                  flush=True)
        del tables, q, out, ws
    result = {"meta": {**run_meta(), "copy_gbps": round(gbps, 1)}, "rows": rows}
    print(markdown(result))
    if out := out_dir(args.out):
        with open(os.path.join(out, "h200-fp8.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(out, "h200-fp8.md"), "w") as f:
            f.write(markdown(result))


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [f"# FP8 KV cache against bf16 ({meta['gpu']})", "",
             run_line(meta), "",
             "16 heads, page 64, cold L2, CUDA-graph replays, the planned kernel. Of copy: "
             "over that format's bytes. rel_l2: fp8 output against the bf16-cache output.", "",
             "| batch | context | format | us | / bf16 | of copy | rel_l2 |",
             "|---|---|---|---|---|---|---|"]
    rows = result["rows"]
    for b, c in sorted({(r["batch"], r["context"]) for r in rows}):
        same = [r for r in rows if (r["batch"], r["context"]) == (b, c)]
        bf = next(r for r in same if r["format"] == "bf16")
        same.sort(key=lambda r: (r["format"], "variant" in r))
        for r in same:
            name = r["format"] + (f" ({r['variant']})" if "variant" in r else "")
            lines.append(f"| {b} | {c} | {name} | {r['us']:.1f} | "
                         f"{r['us'] / bf['us']:.2f} | {100 * r['frac_of_copy']:.0f} % | "
                         f"{r['rel_l2']:.1e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
