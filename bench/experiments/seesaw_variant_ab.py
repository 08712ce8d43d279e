"""The checkout's Gluon seesaw stage 1 against another version of ``kernels/seesaw.py`` (a
file: ``git show REV:graphbucket/kernels/seesaw.py > other.py``), in one process on the same
inputs: both checked against the Triton 64-row stage 1 on the same plan, then timed as
interleaved CUDA-graph replays with a cold L2 (``time_replays_paired``), split-KV plans at
128 heads and at 16 heads on 64-row programs.

    python3 bench/experiments/seesaw_variant_ab.py --other other.py --out DIR

Writes DIR/seesaw-variant-ab.{json,md}; ``other_over_checkout`` above 1 means the checkout's
kernel is faster.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.gpu_timing import (  # noqa: E402
    add_out_argument,
    report_run,
    run_line,
    run_meta,
)

# (heads, batch, context)
SHAPES = [(128, 1, 131072), (128, 8, 65536), (128, 8, 131072), (128, 64, 4096),
          (128, 64, 32768), (16, 1, 131072), (16, 8, 16384), (16, 64, 4096), (16, 64, 16384)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--other", type=Path, required=True,
                   help="another version of graphbucket/kernels/seesaw.py")
    add_out_argument(p, "seesaw-variant-ab.{json,md}")
    p.add_argument("--reps", type=int, default=9, help="interleaved rounds per shape")
    return p.parse_args(argv)


def load_other(path: Path):
    """``path`` as a module beside the checkout's kernels (its imports resolve the same)."""
    spec = importlib.util.spec_from_file_location("graphbucket.kernels.seesaw_other", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(other_path: Path, reps: int) -> list[dict]:
    import torch

    from bench.common import inputs, random_cache
    from graphbucket.kernels import SplitWorkspace, default_sm_scale, mla_decode
    from graphbucket.kernels import seesaw as checkout
    from graphbucket.plan import plan_mla_decode
    from graphbucket.plan_streams import SEESAW_STREAM
    from graphbucket.tuning.measure import time_replays_paired

    # The launcher reads the kernel from the module on every call: swapping the attribute
    # chooses the version a call (and a graph captured around it) runs.
    kernels = {"checkout": checkout.seesaw_stage1_kernel,
               "other": load_other(other_path).seesaw_stage1_kernel}
    cache = random_cache(max(b * -(-c // 64) for _, b, c in SHAPES))
    sm_scale = default_sm_scale()
    rows = []
    try:
        for heads, batch, context in SHAPES:
            tables, q, out, seq_lens = inputs([context] * batch, cache, heads)
            plan = plan_mla_decode(batch, heads, context,
                                   **({} if heads >= 64 else {"stream": SEESAW_STREAM}))
            ws = SplitWorkspace.allocate(batch, heads, plan.num_kv_splits, 512, "cuda")
            ref = torch.empty_like(out[0])
            mla_decode(q[0], cache, tables[0], seq_lens, ref, ws,
                       plan=replace(plan, seesaw=False), sm_scale=sm_scale)
            errors = {}
            for name, kernel in kernels.items():
                checkout.seesaw_stage1_kernel = kernel
                mla_decode(q[0], cache, tables[0], seq_lens, out[0], ws, plan=plan,
                           sm_scale=sm_scale)
                errors[name] = ((out[0].float() - ref.float()).norm()
                                / ref.float().norm()).item()

            def calls(kernel, tables=tables, q=q, out=out, seq_lens=seq_lens, plan=plan,
                      ws=ws):
                def call() -> None:
                    checkout.seesaw_stage1_kernel = kernel
                    for r in range(tables.shape[0]):
                        mla_decode(q[r], cache, tables[r], seq_lens, out[r], ws, plan=plan,
                                   sm_scale=sm_scale)
                return call

            us = time_replays_paired({n: calls(k) for n, k in kernels.items()},
                                     calls_per_graph=tables.shape[0], reps=reps)
            row = {"heads": heads, "batch": batch, "context": context, "plan": plan.describe(),
                   "checkout_us": round(us["checkout"], 2), "other_us": round(us["other"], 2),
                   "other_over_checkout": round(us["other"] / us["checkout"], 4),
                   "rel_err_vs_triton": {n: float(f"{e:.3e}") for n, e in errors.items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        checkout.seesaw_stage1_kernel = kernels["checkout"]
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# The seesaw stage 1 against another version ({meta['gpu']})", "",
             f"{run_line(meta)} (other: {meta['other']}). Interleaved CUDA-graph replays, "
             "cold L2, median microseconds per call; the error of each against the Triton "
             "64-row stage 1 on the same plan (relative L2).", "",
             "| heads | batch | context | plan | checkout us | other us | other / checkout "
             "| error checkout | error other |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        e = r["rel_err_vs_triton"]
        lines.append(f"| {r['heads']} | {r['batch']} | {r['context']} | {r['plan']} | "
                     f"{r['checkout_us']} | {r['other_us']} | {r['other_over_checkout']} | "
                     f"{e['checkout']:.1e} | {e['other']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("seesaw_variant_ab.py times the Gluon seesaw and needs a Hopper GPU")
    rows = measure(args.other, args.reps)
    report_run(args.out, "seesaw-variant-ab", {**run_meta(), "other": str(args.other)}, rows,
               markdown)


if __name__ == "__main__":
    main()
