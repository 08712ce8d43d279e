"""A/B of stage-1 stream configurations at fixed shapes (bf16, 16 heads, 64-token pages).

Usage (CUDA machine, repo root): python bench/stream_ab.py [--out DIR]
Per shape and stream: the plan, microseconds per call (graph replays, cold L2), the
fraction of copy bandwidth, and the output's relative difference to the planned default.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_timing import copy_gbps, run_meta, time_replays  # noqa: E402
from graphbucket import plan as P  # noqa: E402
from graphbucket.kernels import SplitWorkspace, default_sm_scale  # noqa: E402
from graphbucket.tuning.measure import Problem, rotated_calls  # noqa: E402

SHAPES = [(64, 1024), (64, 4096), (8, 131072), (1, 131072)]
STREAMS = ["planned", "LONG_STREAM", "WIDE_STREAM", "LONG_BUFFERED", "WIDE_BUFFERED",
           "LONG_PAGE_AHEAD", "WIDE_PAGE_AHEAD", "WIDE_CHUNKED_MERGE"]
HEADS, DIM = 16, 576


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--streams", nargs="+", default=STREAMS)
    args = ap.parse_args()
    gbps = copy_gbps()
    problem = Problem(max(b * c for b, c in SHAPES) * 2, HEADS)
    scale = default_sm_scale()
    rows = []
    for batch, context in SHAPES:
        tables, q, out, seq_lens = problem.inputs(context, batch)
        ref = None
        for name in args.streams:
            stream = None if name == "planned" else getattr(P, name)
            plan = P.plan_mla_decode(batch, HEADS, context, stream=stream)
            ws = SplitWorkspace.allocate(batch, HEADS, plan.num_kv_splits, 512, "cuda")
            us = time_replays(rotated_calls(problem, tables, q, out, seq_lens, ws, plan,
                                            scale), calls_per_graph=tables.shape[0])
            got = out[0].float().clone()
            ref = got if ref is None else ref
            diff = ((got - ref).norm() / ref.norm()).item()
            floor_us = batch * context * DIM * 2 / (gbps * 1e3)
            rows.append({"batch": batch, "context": context, "stream": name,
                         "plan": plan.describe(), "us": round(us, 2),
                         "frac_of_copy": round(floor_us / us, 3), "rel_diff": diff})
            print(f"b={batch} ctx={context} {name:20s} {us:8.1f} us "
                  f"{100 * floor_us / us:5.1f} %  diff {diff:.1e}  {plan.describe()}",
                  flush=True)
        del tables, q, out
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "stream-ab.json"), "w") as f:
            json.dump({"meta": run_meta(), "copy_gbps": gbps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
