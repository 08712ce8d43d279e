"""The seesaw over fp8 caches (``kernels/seesaw_fp8.py``, under trial; per-tensor and V3.2)
against the bf16 seesaw over the same values and the Triton kernels over the same fp8
caches, in one process on the same inputs: interleaved CUDA-graph replays with a cold L2
(``time_replays_paired``), split-KV plans, stage 1 and the merge; the fp8 seesaws also with
their L2 prefetch two steps ahead (``prefetch_ahead=2``, under trial).

    python3 bench/experiments/seesaw_fp8_ab.py --out DIR

Writes DIR/seesaw-fp8-ab.{json,md}. The issue's targets: fp8-tensor <= 0.60x and fp8-v32
<= 0.65x the bf16 time from 16K on; each seesaw's error against the Triton kernel on its
cache is printed beside.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.gpu_timing import add_out_argument, report_run, run_line, run_meta  # noqa: E402

# (heads, batch, context)
SHAPES = [(128, 1, 131072), (128, 8, 65536), (128, 64, 16384), (16, 1, 131072),
          (16, 8, 16384), (16, 8, 131072), (16, 64, 4096), (16, 64, 16384)]
VARIANTS = ("bf16_seesaw", "fp8_seesaw", "fp8_triton", "v32_seesaw", "v32_triton",
            "fp8_seesaw_p2", "v32_seesaw_p2")  # _p2: the L2 prefetch two steps ahead


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(p, "seesaw-fp8-ab.{json,md}")
    p.add_argument("--reps", type=int, default=9, help="interleaved rounds per shape")
    return p.parse_args(argv)


def measure(reps: int) -> list[dict]:
    from bench.common import inputs, random_cache
    from graphbucket import fp8
    from graphbucket.kernels import SplitWorkspace, default_sm_scale, mla_decode
    from graphbucket.kernels.launch import launch_merge, launch_seesaw_fp8_stage1
    from graphbucket.plan import plan_mla_decode
    from graphbucket.plan_streams import SEESAW_STREAM
    from graphbucket.tuning.measure import time_replays_paired

    bf16 = random_cache(max(b * -(-c // 64) for _, b, c in SHAPES))
    scale = fp8.scale_for(bf16.abs().amax().item(), "cuda")
    cache8 = fp8.quantize(bf16, scale)
    cache_v32 = fp8.pack_v32(bf16)
    sm_scale = default_sm_scale()
    rows = []
    for heads, batch, context in SHAPES:
        tables, q, out, seq_lens = inputs([context] * batch, bf16, heads)
        plan = plan_mla_decode(batch, heads, context,
                               **({} if heads >= 64 else {"stream": SEESAW_STREAM}))
        # The Triton kernels on the default plan (at 128 heads a seesaw plan, which an fp8
        # cache runs on the Triton 64-row kernel).
        triton_plan = plan_mla_decode(batch, heads, context)
        ws = SplitWorkspace.allocate(batch, heads,
                                     max(plan.num_kv_splits, triton_plan.num_kv_splits), 512,
                                     "cuda")

        def seesaw(cache, kv_scale, ahead=1, plan=plan, ws=ws, tables=tables, q=q, out=out,
                   seq_lens=seq_lens):
            def launch(r: int) -> None:
                launch_seesaw_fp8_stage1(q[r], cache, tables[r], seq_lens, out[r],
                                         ws if plan.use_stage2 else None, plan=plan,
                                         sm_scale=sm_scale, lse=None, kv_scale=kv_scale,
                                         prefetch_ahead=ahead)
                if plan.merge_kernel:
                    launch_merge(seq_lens, out[r], ws, plan=plan, lse=None, block_n=64)
            return launch

        def triton(cache, kv_scale, plan=triton_plan, ws=ws, tables=tables, q=q, out=out,
                   seq_lens=seq_lens):
            return lambda r: mla_decode(q[r], cache, tables[r], seq_lens, out[r], ws,
                                        plan=plan, sm_scale=sm_scale, kv_scale=kv_scale)

        launches = {
            "bf16_seesaw": lambda r, plan=plan, ws=ws, tables=tables, q=q, out=out,
            seq_lens=seq_lens: mla_decode(q[r], bf16, tables[r], seq_lens, out[r], ws,
                                          plan=plan, sm_scale=sm_scale),
            "fp8_seesaw": seesaw(cache8, scale), "fp8_triton": triton(cache8, scale),
            "v32_seesaw": seesaw(cache_v32, None), "v32_triton": triton(cache_v32, None),
            "fp8_seesaw_p2": seesaw(cache8, scale, 2), "v32_seesaw_p2": seesaw(cache_v32, None, 2)}
        outs = {}
        for name, launch in launches.items():
            launch(0)
            outs[name] = out[0].float().clone()

        def error(name: str, ref: str) -> float:
            return ((outs[name] - outs[ref]).norm() / outs[ref].norm()).item()
        errors = {"fp8_seesaw": error("fp8_seesaw", "fp8_triton"),
                  "v32_seesaw": error("v32_seesaw", "v32_triton"),
                  "fp8_seesaw_p2": error("fp8_seesaw_p2", "fp8_triton"),
                  "v32_seesaw_p2": error("v32_seesaw_p2", "v32_triton")}

        def calls(launch, rotations=tables.shape[0]):
            def call() -> None:
                for r in range(rotations):
                    launch(r)
            return call

        us = time_replays_paired({n: calls(fn) for n, fn in launches.items()},
                                 calls_per_graph=tables.shape[0], reps=reps)
        row = {"heads": heads, "batch": batch, "context": context, "plan": plan.describe(),
               "triton_plan": triton_plan.describe(),
               **{f"{n}_us": round(us[n], 2) for n in VARIANTS},
               "fp8_seesaw_over_bf16_seesaw": round(us["fp8_seesaw"] / us["bf16_seesaw"], 4),
               "fp8_seesaw_over_fp8_triton": round(us["fp8_seesaw"] / us["fp8_triton"], 4),
               "v32_seesaw_over_bf16_seesaw": round(us["v32_seesaw"] / us["bf16_seesaw"], 4),
               "v32_seesaw_over_v32_triton": round(us["v32_seesaw"] / us["v32_triton"], 4),
               "fp8_p2_over_fp8_seesaw": round(us["fp8_seesaw_p2"] / us["fp8_seesaw"], 4),
               "v32_p2_over_v32_seesaw": round(us["v32_seesaw_p2"] / us["v32_seesaw"], 4),
               "rel_err_vs_triton": {n: float(f"{e:.3e}") for n, e in errors.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# The fp8 seesaws against the bf16 seesaw and the Triton fp8 kernels "
             f"({meta['gpu']})", "",
             f"{run_line(meta)}. Interleaved CUDA-graph replays, cold L2, median microseconds "
             "per call (stage 1 and merge); the bf16 cache holds the values the fp8 caches "
             "quantize. Error: relative L2 against the Triton kernel on the same cache.", "",
             "| heads | batch | context | bf16 seesaw us | fp8-tensor seesaw us | Triton us | "
             "/ bf16 | / Triton | error | fp8-v32 seesaw us | Triton us | / bf16 | / Triton "
             "| error | fp8-tensor, prefetch 2 ahead / 1 | fp8-v32, prefetch 2 / 1 |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        e = r["rel_err_vs_triton"]
        lines.append(f"| {r['heads']} | {r['batch']} | {r['context']} | {r['bf16_seesaw_us']} | "
                     f"{r['fp8_seesaw_us']} | {r['fp8_triton_us']} | "
                     f"{r['fp8_seesaw_over_bf16_seesaw']} | {r['fp8_seesaw_over_fp8_triton']} "
                     f"| {e['fp8_seesaw']:.1e} | {r['v32_seesaw_us']} | {r['v32_triton_us']} | "
                     f"{r['v32_seesaw_over_bf16_seesaw']} | {r['v32_seesaw_over_v32_triton']} "
                     f"| {e['v32_seesaw']:.1e} | {r['fp8_p2_over_fp8_seesaw']} | "
                     f"{r['v32_p2_over_v32_seesaw']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("seesaw_fp8_ab.py times the Gluon seesaw and needs a Hopper GPU")
    report_run(args.out, "seesaw-fp8-ab", run_meta(), measure(args.reps), markdown)


if __name__ == "__main__":
    main()
