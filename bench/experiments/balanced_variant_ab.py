"""The balanced seesaw kernels with a step variant against their default step, in one
process on the same inputs: each checked against the Triton balanced stage 1, then timed as
interleaved CUDA-graph replays with a cold L2 (``time_replays_paired``), the step
partitioned once per replay as a decode step's layers do. Ragged mixes at batch 32 and 64
and one uniform batch, 128 and 16 heads, over work items, equal tile ranges and the charged
cut. The default step over a bf16 cache is the lazy rescale (``kernels/seesaw_lazy.py``).
Variants: ``eager-rescale`` (O rescaled every step) and ``pv-cols-64`` (64-column PVs,
eager), kept to compare. (The split-KV kernel's A/B is ``seesaw_variant_ab.py``.)

    python3 bench/experiments/balanced_variant_ab.py --variant eager-rescale --out DIR

Writes DIR/balanced-variant-ab-VARIANT.{json,md}; ``variant_over_default`` below 1 means the
variant wins.
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
VARIANTS = {"eager-rescale": {"lazy_rescale": False}, "pv-cols-64": {"pv_cols": 64}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(p, "balanced-variant-ab-VARIANT.{json,md}")
    p.add_argument("--variant", choices=sorted(VARIANTS), default="eager-rescale")
    p.add_argument("--heads", type=int, nargs="+", default=[128, 16])
    p.add_argument("--reps", type=int, default=7, help="interleaved rounds per cell")
    return p.parse_args(argv)


def shapes() -> list[tuple[str, list[int]]]:
    from bench.ladder_oracle import ragged_mixes

    cells = [(f"{b} x {name}", lens) for b in (32, 64) for name, lens in ragged_mixes(b, TOP)]
    return cells + [("64 x uniform-4096", [4096] * 64)]


def measure(heads_list: list[int], reps: int, variant: str) -> list[dict]:
    import torch

    from bench.common import inputs, random_cache
    from graphbucket.kernels import SplitWorkspace, default_sm_scale, launch_balanced
    from graphbucket.plan import plan_balanced_mla_decode
    from graphbucket.plan_streams import SEESAW_STREAM
    from graphbucket.tuning.measure import time_replays_paired

    originals = {name: getattr(launch_balanced, name) for name in STAGE1}

    options = {"default": {}, "variant": VARIANTS[variant]}

    def use(which: str) -> None:  # the launchers mla_decode_balanced calls
        for name, fn in originals.items():
            setattr(launch_balanced, name, functools.partial(fn, **options[which]))

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
                    for which in options:
                        use(which)
                        launch_balanced.mla_decode_balanced(q[0], cache, tables[0], seq_lens,
                                                            out[0], ws, plan=plan,
                                                            sm_scale=sm_scale)
                        errors[which] = ((out[0].float() - ref.float()).norm()
                                         / ref.float().norm()).item()

                    def calls(which, tables=tables, q=q, out=out, seq_lens=seq_lens, plan=plan,
                              ws=ws):
                        def call() -> None:
                            use(which)
                            for r in range(tables.shape[0]):
                                launch_balanced.mla_decode_balanced(
                                    q[r], cache, tables[r], seq_lens, out[r], ws, plan=plan,
                                    sm_scale=sm_scale, check=False, partition=r == 0)
                        return call

                    us = time_replays_paired({w: calls(w) for w in options},
                                             calls_per_graph=tables.shape[0], reps=reps)
                    row = {"heads": heads, "mix": mix, "kernel": kernel, "variant": variant,
                           "plan": plan.describe(), "default_us": round(us["default"], 2),
                           "variant_us": round(us["variant"], 2),
                           "variant_over_default": round(us["variant"] / us["default"], 4),
                           "rel_err_vs_triton": {w: float(f"{e:.3e}")
                                                 for w, e in errors.items()}}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        for name, fn in originals.items():
            setattr(launch_balanced, name, fn)
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    variant = rows[0]["variant"] if rows else "?"
    lines = [f"# The balanced seesaw's step: {variant} against the default ({meta['gpu']})", "",
             f"{run_line(meta)}. Interleaved CUDA-graph replays, cold L2, median "
             "microseconds per call (planner once per replay); the error of each against "
             "the Triton balanced stage 1 on the same plan (relative L2).", "",
             "| heads | mix | kernel | default us | variant us | variant / default "
             "| error default | error variant |",
             "|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        e = r["rel_err_vs_triton"]
        lines.append(f"| {r['heads']} | {r['mix']} | {r['kernel']} | {r['default_us']} | "
                     f"{r['variant_us']} | {r['variant_over_default']} | "
                     f"{e['default']:.1e} | {e['variant']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("balanced_variant_ab.py times the Gluon seesaw and needs a Hopper GPU")
    rows = measure(args.heads, args.reps, args.variant)
    report_run(args.out, f"balanced-variant-ab-{args.variant}", run_meta(), rows, markdown)


if __name__ == "__main__":
    main()
