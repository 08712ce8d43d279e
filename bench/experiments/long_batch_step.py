"""Kernel time against step time for the split counts of long, wide batches (H200, one run).

At 64 and 128 requests of 128K tokens the tuner's kernel timing ranks a few splits with the
merge fused into stage 1 (the request's last split merges) within 2 % of more splits with the
merge kernel, and the whole decode step (bench/tpot.py) ranks them the other way by about
5 %. This times the same plans both ways in one process:

- kernel: ``PlanTimer`` as the tuner builds it (one cache for the largest shape, scattered
  tables, CUDA-graph replays), each plan twice, in forward and reverse order;
- step: the 2-layer DeepSeek-V3 TP8 decoder (``bench/tpot.py``'s ``TpotBench``) captured
  with a one-bucket ladder per hint, so that each graph replays one of those plans, timed
  alternately.

    python3 bench/experiments/long_batch_step.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

CONTEXT = 131072
BATCHES = (64, 128)
HINTS = (256, 512, 131072)  # fused merge at 2 / 4 splits; the merge kernel at max_model_len


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write h200-long-batch-step.{json,md} here")
    args = p.parse_args(argv)
    import torch

    from bench.gpu_timing import run_meta
    from bench.tpot import TpotBench, captured_runners, time_tpot
    from graphbucket.backends import get_backend
    from graphbucket.ladder import Bucket, BucketLadder
    from graphbucket.models import PRESETS
    from graphbucket.tuning.grid import hint_plans
    from graphbucket.tuning.measure import PlanTimer

    if not torch.cuda.is_available():
        sys.exit("long_batch_step.py times CUDA graphs; run it on the GPU")
    meta = run_meta()
    plan_for = hint_plans(16, num_sms=meta["num_sms"])
    rows = {(b, h): {"batch": b, "hint": h, "plan": plan_for(b, h).describe(), "kernel_us": [],
                     "step_ms": []} for b in BATCHES for h in HINTS}

    timer = PlanTimer(CONTEXT, max(BATCHES), 16, max_splits=8)
    for order in (HINTS, HINTS[::-1], HINTS, HINTS[::-1]):
        for b in BATCHES:
            us = timer.time(CONTEXT, b, {str(h): plan_for(b, h) for h in order})
            for h in order:
                rows[b, h]["kernel_us"].append(round(us[str(h)], 1))
        print("kernel", {k: r["kernel_us"][-1] for k, r in rows.items()}, flush=True)
    del timer
    torch.cuda.empty_cache()

    config = PRESETS["deepseek-v3-tp8"](num_layers=2)
    bench = TpotBench.build(config, batches=list(BATCHES), policies=())
    for h in HINTS:
        ladder = BucketLadder((Bucket(CONTEXT, h),), CONTEXT)
        bench.runners[str(h)] = captured_runners(
            bench.model, ["ladder"], max_model_len=CONTEXT, batches=list(BATCHES),
            ladder=ladder, backend=lambda: get_backend(
                "triton", device="cuda", kv_lora_rank=config.kv_lora_rank,
                qk_rope_dim=config.qk_rope_dim))["ladder"]
    for rnd in range(3):
        for b in BATCHES:
            decode = bench.batch(CONTEXT, b)
            for h in (HINTS if rnd % 2 == 0 else HINTS[::-1]):
                runner = bench.runners[str(h)]
                assert runner.plan_for(runner.selector.choose([CONTEXT] * b)).describe() \
                    == rows[b, h]["plan"]
                rows[b, h]["step_ms"].append(round(time_tpot(lambda: runner.step(decode)), 4))
        print("step", {k: r["step_ms"][-1] for k, r in rows.items()}, flush=True)
    bench.close()

    meta["command"] = "python3 " + " ".join(sys.argv)
    out = {"meta": meta, "rows": list(rows.values())}
    lines = [f"# Kernel time and step time of long, wide batches ({meta['gpu']})", "",
             f"{meta['date']}, torch {meta['torch']}, triton {meta['triton']}. Command: "
             f"`{meta['command']}`. {CONTEXT} tokens per request, 16 heads; kernel: us per "
             "call (PlanTimer, every sample); step: ms per 2-layer decode step (every round).",
             "", "| batch | hint | plan | kernel us | step ms |", "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['hint']} | {r['plan']} | "
              f"{', '.join(map(str, r['kernel_us']))} | {', '.join(map(str, r['step_ms']))} |"
              for r in rows.values()]
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "h200-long-batch-step.json").write_text(json.dumps(out, indent=1))
        (args.out / "h200-long-batch-step.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
