"""The balanced seesaw kernels with 64-column PVs (the default) against 256-column PVs (under
trial, ``kernels/seesaw_step.py``), in one process on the same inputs: each checked against
the Triton balanced stage 1, then timed as interleaved CUDA-graph replays with a cold L2
(``time_replays_paired``), the step partitioned once per replay as a decode step's layers
do. Ragged mixes at batch 32 and 64 and one uniform batch, 128 and 16 heads, over work
items, equal tile ranges and the charged cut. (The split-KV kernel's A/B is
``seesaw_variant_ab.py`` against a copy with ``PV_COLS`` flipped: ``run_gpu.sh
stepvariants``.)

    python3 bench/experiments/pv_cols_ab.py --out DIR

Writes DIR/pv-cols-ab.{json,md}; ``wide_over_narrow`` below 1 means 256-column PVs win.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.gpu_timing import (  # noqa: E402
    add_out_argument,
    report_run,
    run_line,
    run_meta,
)

TOP = 131072
KERNELS = {"items": {}, "ranges": {"tile_ranges": True},
           "charged": {"tile_ranges": True, "charged_ranges": True}}
STAGE1 = ("launch_seesaw_balanced_stage1", "launch_seesaw_range_stage1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(p, "pv-cols-ab.{json,md}")
    p.add_argument("--heads", type=int, nargs="+", default=[128, 16])
    p.add_argument("--reps", type=int, default=7, help="interleaved rounds per cell")
    return p.parse_args(argv)


def shapes() -> list[tuple[str, list[int]]]:
    from bench.ladder_oracle import ragged_mixes

    cells = [(f"{b} x {name}", lens) for b in (32, 64) for name, lens in ragged_mixes(b, TOP)]
    return cells + [("64 x uniform-4096", [4096] * 64)]


def measure(heads_list: list[int], reps: int) -> list[dict]:
    import torch

    from bench.common import inputs, random_cache
    from graphbucket.kernels import SplitWorkspace, default_sm_scale, launch_balanced
    from graphbucket.plan import plan_balanced_mla_decode
    from graphbucket.plan_streams import SEESAW_STREAM
    from graphbucket.tuning.measure import time_replays_paired

    originals = {name: getattr(launch_balanced, name) for name in STAGE1}

    def use(pv_cols: int) -> None:  # the launchers mla_decode_balanced calls, by width
        for name, fn in originals.items():
            setattr(launch_balanced, name, functools.partial(fn, pv_cols=pv_cols))

    cells = shapes()
    cache = random_cache(max(sum(-(-n // 64) for n in lens) for _, lens in cells))
    sm_scale = default_sm_scale()
    rows = []
    try:
        for heads in heads_list:
            for mix, lens in cells:
                tables, q, out, seq_lens = inputs(lens, cache, heads)
                batch = len(lens)
                for kernel, kw in KERNELS.items():
                    plan = plan_balanced_mla_decode(batch, heads, stream=SEESAW_STREAM, **kw)
                    ws = SplitWorkspace.allocate(batch, heads, 1, 512, "cuda",
                                                 max_items=plan.max_work_items)
                    ref = torch.empty_like(out[0])
                    launch_balanced.mla_decode_balanced(
                        q[0], cache, tables[0], seq_lens, ref, ws,
                        plan=replace(plan, seesaw=False), sm_scale=sm_scale)
                    errors = {}
                    for cols in (64, 256):
                        use(cols)
                        launch_balanced.mla_decode_balanced(q[0], cache, tables[0], seq_lens,
                                                            out[0], ws, plan=plan,
                                                            sm_scale=sm_scale)
                        errors[cols] = ((out[0].float() - ref.float()).norm()
                                        / ref.float().norm()).item()

                    def calls(cols, tables=tables, q=q, out=out, seq_lens=seq_lens, plan=plan,
                              ws=ws):
                        def call() -> None:
                            use(cols)
                            for r in range(tables.shape[0]):
                                launch_balanced.mla_decode_balanced(
                                    q[r], cache, tables[r], seq_lens, out[r], ws, plan=plan,
                                    sm_scale=sm_scale, check=False, partition=r == 0)
                        return call

                    us = time_replays_paired({c: calls(c) for c in (64, 256)},
                                             calls_per_graph=tables.shape[0], reps=reps)
                    row = {"heads": heads, "mix": mix, "kernel": kernel,
                           "plan": plan.describe(), "narrow_us": round(us[64], 2),
                           "wide_us": round(us[256], 2),
                           "wide_over_narrow": round(us[256] / us[64], 4),
                           "rel_err_vs_triton": {str(c): float(f"{e:.3e}")
                                                 for c, e in errors.items()}}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        for name, fn in originals.items():
            setattr(launch_balanced, name, fn)
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# The balanced seesaw's PV width: 256 against 64 columns ({meta['gpu']})", "",
             f"{run_line(meta)}. Interleaved CUDA-graph replays, cold L2, median "
             "microseconds per call (planner once per replay); the error of each against "
             "the Triton balanced stage 1 on the same plan (relative L2).", "",
             "| heads | mix | kernel | 64 cols us | 256 cols us | 256 / 64 | error 64 "
             "| error 256 |",
             "|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        e = r["rel_err_vs_triton"]
        lines.append(f"| {r['heads']} | {r['mix']} | {r['kernel']} | {r['narrow_us']} | "
                     f"{r['wide_us']} | {r['wide_over_narrow']} | {e['64']:.1e} | "
                     f"{e['256']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("pv_cols_ab.py times the Gluon seesaw and needs a Hopper GPU")
    rows = measure(args.heads, args.reps)
    report_run(args.out, "pv-cols-ab", run_meta(), rows, markdown)


if __name__ == "__main__":
    main()
