"""The Gluon seesaw's split-KV stage 1 with one step option changed against the library's
default, in one process on the same inputs: both checked against the Triton 64-row stage 1
on the same plan, then timed as interleaved CUDA-graph replays with a cold L2
(``time_replays_paired``), split-KV plans at 128 heads and at 16 heads on 64-row programs.
Variants (``launch_seesaw_stage1``'s options): ``eager-rescale`` (O rescaled every step,
the default before the lazy step), ``one-rescale`` (one rescale per step) and ``pv-cols-64``
(64-column PVs); the last two run the eager rescale (the lazy step needs the default order
on 256-column PVs). ``--other FILE``: another version of ``kernels/seesaw.py`` (``git show
REV:graphbucket/kernels/seesaw.py > FILE``) as the variant, launched with the default
options.

    python3 bench/experiments/seesaw_variant_ab.py --variant eager-rescale --out DIR
    python3 bench/experiments/seesaw_variant_ab.py --other old_seesaw.py --out DIR

Writes DIR/seesaw-variant-ab-VARIANT.{json,md} (VARIANT ``other`` for a file);
``variant_over_default`` above 1 means the default is faster.
"""

from __future__ import annotations

import argparse
import functools
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


VARIANTS = {"eager-rescale": {"lazy_rescale": False}, "one-rescale": {"one_rescale": True},
            "pv-cols-64": {"pv_cols": 64}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=sorted(VARIANTS), default="eager-rescale")
    p.add_argument("--other", type=Path,
                   help="another version of graphbucket/kernels/seesaw.py as the variant")
    add_out_argument(p, "seesaw-variant-ab-VARIANT.{json,md}")
    p.add_argument("--reps", type=int, default=9, help="interleaved rounds per shape")
    return p.parse_args(argv)


def load_other(path: Path):
    """``path`` as a module beside the checkout's kernels (its imports resolve the same)."""
    spec = importlib.util.spec_from_file_location("graphbucket.kernels.seesaw_other", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(variant: str, reps: int, other: Path | None = None) -> list[dict]:
    import torch

    from bench.common import inputs, random_cache
    from graphbucket.kernels import SplitWorkspace, default_sm_scale, launch, mla_decode
    from graphbucket.kernels import seesaw as checkout
    from graphbucket.plan import plan_mla_decode
    from graphbucket.plan_streams import SEESAW_STREAM
    from graphbucket.tuning.measure import time_replays_paired

    # mla_decode looks the launcher up in its module on every call, and the launcher the
    # kernel in ``kernels.seesaw``: swapping either attribute chooses what a call (and a
    # graph captured around it) runs.
    original, kernel = launch.launch_seesaw_stage1, checkout.seesaw_stage1_kernel

    def with_kernel(k):
        def launch_with(*args, **kwargs) -> None:
            checkout.seesaw_stage1_kernel = k
            original(*args, **kwargs)
        return launch_with

    launchers = ({"default": with_kernel(kernel),
                  "variant": with_kernel(load_other(other).seesaw_stage1_kernel)} if other
                 else {"default": original,
                       "variant": functools.partial(original, **VARIANTS[variant])})
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
            for name, launcher in launchers.items():
                launch.launch_seesaw_stage1 = launcher
                mla_decode(q[0], cache, tables[0], seq_lens, out[0], ws, plan=plan,
                           sm_scale=sm_scale)
                errors[name] = ((out[0].float() - ref.float()).norm()
                                / ref.float().norm()).item()

            def calls(launcher, tables=tables, q=q, out=out, seq_lens=seq_lens, plan=plan,
                      ws=ws):
                def call() -> None:
                    launch.launch_seesaw_stage1 = launcher
                    for r in range(tables.shape[0]):
                        mla_decode(q[r], cache, tables[r], seq_lens, out[r], ws, plan=plan,
                                   sm_scale=sm_scale)
                return call

            us = time_replays_paired({n: calls(f) for n, f in launchers.items()},
                                     calls_per_graph=tables.shape[0], reps=reps)
            row = {"heads": heads, "batch": batch, "context": context, "variant": variant,
                   "plan": plan.describe(), "default_us": round(us["default"], 2),
                   "variant_us": round(us["variant"], 2),
                   "variant_over_default": round(us["variant"] / us["default"], 4),
                   "rel_err_vs_triton": {n: float(f"{e:.3e}") for n, e in errors.items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        launch.launch_seesaw_stage1, checkout.seesaw_stage1_kernel = original, kernel
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    variant = rows[0]["variant"] if rows else "?"
    lines = [f"# The seesaw's split-KV step: {variant} against the default ({meta['gpu']})",
             "", f"{run_line(meta)}. Interleaved CUDA-graph replays, cold L2, median "
             "microseconds per call; the error of each against the Triton 64-row stage 1 on "
             "the same plan (relative L2).", "",
             "| heads | batch | context | plan | default us | variant us | variant / default "
             "| error default | error variant |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        e = r["rel_err_vs_triton"]
        lines.append(f"| {r['heads']} | {r['batch']} | {r['context']} | {r['plan']} | "
                     f"{r['default_us']} | {r['variant_us']} | {r['variant_over_default']} | "
                     f"{e['default']:.1e} | {e['variant']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("seesaw_variant_ab.py times the Gluon seesaw and needs a Hopper GPU")
    variant = "other" if args.other else args.variant
    rows = measure(variant, args.reps, args.other)
    meta = {**run_meta(), **({"other": str(args.other)} if args.other else {})}
    report_run(args.out, f"seesaw-variant-ab-{variant}", meta, rows, markdown)


if __name__ == "__main__":
    main()
