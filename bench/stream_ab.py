"""A/B of stage-1 stream configurations, same inputs and run (bf16, 16 heads, page 64).

Per shape (uniform batches and the ragged mixes of ``bench/ragged.py``) and per stream of
``graphbucket.plan_streams`` (``plan_mla_decode(..., stream=S)``; for batches of two or more also
``plan_balanced_mla_decode(..., stream=S)``): microseconds per call (CUDA-graph replays,
cold L2), fraction of copy bandwidth over the bytes read, and the output's relative
difference to the planned plan's. ``--short`` times the short-context variants instead
(a fused merge for LONG plans, 64-token WIDE_FUSED tiles); ``--heads 128`` the query-row
variants at 128 heads (64-row programs: tile, stages, page lookup ahead; and the 32-row
programs planned before), against the compute floor too.

    python3 bench/stream_ab.py --out DIR        # DIR/h200-stream-ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (  # noqa: E402
    WIDE_HEADS_SHAPES,
    against_floor,
    inputs,
    mixes,
    random_cache,
    time_calls,
)
from bench.gpu_timing import (  # noqa: E402
    add_out_argument,
    copy_gbps,
    matmul_tflops,
    out_dir,
    run_meta,
)
from graphbucket import plan as P  # noqa: E402
from graphbucket import plan_streams as S  # noqa: E402
from graphbucket.kernels import (  # noqa: E402
    SplitWorkspace,
    default_sm_scale,
    mla_decode,
    mla_decode_balanced,
)

HEADS, PAGE, DIM, RANK = 16, 64, 576, 512
UNIFORM = [(1, 65536), (1, 131072), (8, 4096), (8, 16384), (8, 131072), (64, 256), (64, 1024),
           (64, 4096), (64, 16384)]
SHORT = [(1, 128), (1, 256), (1, 512), (1, 1024), (8, 128), (8, 256), (8, 512), (8, 1024),
         (64, 128), (64, 256), (64, 1024), (64, 4096)]


def streams(short: bool) -> dict[str, S.StreamConfig]:
    if short:
        fused = {"fused_merge_max_tiles": 16, "merge_chunks": 4, "dependent_merge": False}
        return {"LONG_FUSED_512": replace(S.LONG_PAGE_AHEAD, **fused),
                "LONG_FUSED_1K": replace(S.LONG_PAGE_AHEAD, **{**fused,
                                                               "fused_merge_max_tiles": 32}),
                "WIDE_FUSED_64": replace(S.WIDE_FUSED, block_n=64, num_stages=3,
                                         min_tiles_per_split=2, fused_merge_max_tiles=64)}
    named = {n: getattr(S, n) for n in ("LONG_STREAM", "WIDE_STREAM", "LONG_BUFFERED",
                                        "WIDE_BUFFERED", "LONG_PAGE_AHEAD", "WIDE_PAGE_AHEAD",
                                        "WIDE_CHUNKED_MERGE", "WIDE_FUSED")}
    named["LONG_FUSED_CHUNKED"] = replace(S.LONG_STREAM, min_tiles_per_split=2,
                                          fused_merge_max_tiles=64, merge_chunks=4,
                                          dependent_merge=False)
    return named


_N32 = {"block_n": 32, "min_tiles_per_split": 2}
ROWS = {"rows64_n32_s3": replace(S.ROWS_STREAM, num_stages=3, **_N32),
        "rows64_n32_s3_ahead": replace(S.ROWS_STREAM, num_stages=3, page_ahead=True, **_N32),
        "rows64_n32_s5": replace(S.ROWS_STREAM, num_stages=5, **_N32),
        "rows64_n64_s3": replace(S.ROWS_STREAM, num_stages=3),
        "rows64_n16_ahead": replace(S.ROWS_STREAM, block_n=16, num_stages=3, page_ahead=True,
                                    min_tiles_per_split=4)}


def row_variants(lens: list[int], heads: int) -> list[tuple[str, P.LaunchPlan, object]]:
    b, ctx = len(lens), max(lens)
    out = [("planned", P.plan_mla_decode(b, heads, ctx), mla_decode)]
    out += [(n, P.plan_mla_decode(b, heads, ctx, stream=st), mla_decode) for n, st in ROWS.items()]
    out.append(("planned, twice the splits", out[0][1].with_splits(2 * out[0][1].num_kv_splits),
                mla_decode))
    old = S.LONG_STREAM if b * heads // 32 < P.H200_NUM_SMS // 4 else S.WIDE_STREAM
    out.append(("rows32 (planned before)", P.plan_mla_decode(
        b, heads, ctx, stream=replace(old, block_h=32)), mla_decode))
    return out


def variants(mix: str, lens: list[int], short: bool) -> list[tuple[str, P.LaunchPlan, object]]:
    b, ctx = len(lens), max(lens)
    out = [("planned", P.plan_mla_decode(b, HEADS, ctx), mla_decode)]
    for name, stream in streams(short).items():
        if short and (b == 64) != name.startswith("WIDE"):
            continue
        out.append((name, P.plan_mla_decode(b, HEADS, ctx, stream=stream), mla_decode))
    if not short and b > 1:
        out.append(("balanced", P.plan_balanced_mla_decode(b, HEADS), mla_decode_balanced))
        for name, stream in streams(False).items():
            if stream.fused_merge_max_tiles == 0 or name == "WIDE_STREAM":
                out.append((f"balanced+{name}", P.plan_balanced_mla_decode(
                    b, HEADS, stream=stream), mla_decode_balanced))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(ap, "h200-stream-ab.json (-short / -h<heads> with --short / --heads)")
    ap.add_argument("--short", action="store_true", help="short-context variants instead")
    ap.add_argument("--heads", type=int, default=HEADS,
                    help="other than 16: the query-row variants at this head count")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("stream_ab.py times CUDA-graph replays and needs a CUDA GPU")
    gbps = copy_gbps()
    tflops = matmul_tflops() if args.heads != HEADS else None
    shapes = [("uniform", [c] * b) for b, c in (SHORT if args.short else UNIFORM)]
    if args.heads != HEADS:
        shapes = [("uniform", [c] * b) for b, c in WIDE_HEADS_SHAPES]
    elif not args.short:
        shapes += [m for m in mixes() if m[0] != "uniform"]
    pages = max(sum(-(-n // PAGE) for n in lens) for _, lens in shapes)
    cache = random_cache(pages)
    scale, rows = default_sm_scale(), []
    for mix, lens in shapes:
        tables, q, out, seq_lens = inputs(lens, cache, args.heads)
        todo = row_variants(lens, args.heads) if args.heads != HEADS else \
            variants(mix, lens, args.short)
        ws = SplitWorkspace.allocate(len(lens), args.heads,
                                     max(p.num_kv_splits for _, p, _ in todo),
                                     RANK, "cuda",
                                     max_items=max(p.max_work_items for _, p, _ in todo))
        ref = None
        for name, plan, launch in todo:
            us = time_calls(launch, plan, cache, tables, q, out, seq_lens, ws, scale)
            got = out[0].float().clone()
            ref = got if ref is None else ref
            diff = ((got - ref).norm() / ref.norm()).item()
            rows.append({"mix": mix, "batch": len(lens), "context": max(lens),
                         "variant": name, "topology": plan.describe(),
                         "rel_diff": round(diff, 6),
                         **against_floor(gbps, lens, us, args.heads, tflops)})
            compute = rows[-1].get("frac_of_compute")
            print(f"{mix:16s} b={len(lens):3d} ctx={max(lens):6d} {name:28s} {us:8.1f} us "
                  f"{100 * rows[-1]['frac_of_copy']:4.0f} %"
                  + (f" ({100 * compute:.0f} % of compute)" if compute else "")
                  + f"  diff {diff:.1e}  "
                  f"{plan.describe()}", flush=True)
        del tables, q, out, ws
    if out := out_dir(args.out):
        name = "h200-stream-ab-short.json" if args.short else "h200-stream-ab.json"
        if args.heads != HEADS:
            name = f"h200-stream-ab-h{args.heads}.json"
        with open(os.path.join(out, name), "w") as f:
            json.dump({"meta": {**run_meta(), "copy_gbps": round(gbps, 1),
                                "matmul_tflops": tflops and round(tflops, 1)}, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
