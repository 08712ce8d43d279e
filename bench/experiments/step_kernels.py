"""Where the ladder's decode step loses to fixed-max at long, wide batches: kernel by kernel.

At 16 heads, batch 64-128 and 32K-128K tokens, the TPOT bench puts the ladder 3-9 % behind
fixed-max while the tuner's kernel timing ranks the ladder's plan level with fixed-max's
(within 0.3 %) or the plans are the same. This runs, in one process on the TPOT bench's
2-layer DeepSeek-V3 TP8 decoder:

- step: fixed-max, the ladder and a second fixed-max runner (a control: the same plans on
  buffers of its own, so its ratio to fixed-max is the measurement's own spread), interleaved
  per round with the order rotating; every round's ratio to fixed-max is kept;
- kernels in the step: ``torch.profiler`` over steps of each runner, each kernel's device
  time per step, grouped by kernel name, and the idle time between kernels;
- kernel alone: the two plans through the tuner's ``PlanTimer`` (cold L2, paired rounds);
- the clocks: ``nvidia-smi`` sampled every 200 ms for the whole run.

    python3 bench/experiments/step_kernels.py --out DIR       # H200, about 4 minutes
    python3 bench/experiments/step_kernels.py --preset deepseek-v3-dp \
        --cells 8:131072 32:131072 --out DIR                   # 128 heads, two cells
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

CELLS = ((64, 131072), (128, 32768), (64, 32768), (128, 131072), (32, 131072))
DEFAULT_PRESET = "deepseek-v3-tp8"
POLICIES = ("fixed-max", "ladder", "fixed-max-control")
CLOCK_FIELDS = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write h200-step-kernels[-PRESET].{json,md} here "
                                            "(the suffix for another preset than the default)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds per cell")
    p.add_argument("--profiled-steps", type=int, default=6)
    p.add_argument("--preset", default=DEFAULT_PRESET,
                   help=f"the 2-layer decoder's preset (default {DEFAULT_PRESET}; "
                        "deepseek-v3-dp: all 128 heads)")
    p.add_argument("--cells", nargs="+", type=cell, default=list(CELLS), metavar="B:CONTEXT",
                   help="batch:context cells (default: "
                        + " ".join(f"{b}:{c}" for b, c in CELLS) + ")")
    return p.parse_args(argv)


def cell(text: str) -> tuple[int, int]:
    """'32:131072' -> (32, 131072)."""
    try:
        batch, context = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a cell is BATCH:CONTEXT, got {text!r}") from None
    if batch < 1 or context < 1:
        raise argparse.ArgumentTypeError(f"a cell needs a positive batch and context: {text!r}")
    return batch, context


def start_clock_log(path: Path) -> subprocess.Popen | None:
    try:
        return subprocess.Popen(["nvidia-smi", f"--query-gpu={CLOCK_FIELDS}",
                                 "--format=csv,noheader,nounits", "-lms", "200"],
                                stdout=path.open("w"), stderr=subprocess.DEVNULL)
    except OSError:
        return None


def kernel_profile(step, n: int) -> dict:
    """Device time per step of each kernel (by name), the busy and idle time of the span."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            spans.append((e.time_range.start, e.time_range.end, e.name))
    spans.sort()
    by_name: dict[str, float] = defaultdict(float)
    for s, t, name in spans:
        by_name[name[:90]] += (t - s) / n
    busy = sum(t - s for s, t, _ in spans) / n
    span = (spans[-1][1] - spans[0][0]) / n if spans else 0.0
    return {"us_per_step_by_kernel": {k: round(v, 2) for k, v in
                                      sorted(by_name.items(), key=lambda kv: -kv[1])},
            "busy_us_per_step": round(busy, 1), "span_us_per_step": round(span, 1),
            "events": len(spans)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from bench.gpu_timing import run_meta
    from bench.tpot import TpotBench, captured_runners
    from graphbucket.backends import get_backend
    from graphbucket.models import PRESETS
    from graphbucket.tuning.measure import PlanTimer
    from graphbucket.tuning.measure_step import interleaved_rounds

    if not torch.cuda.is_available():
        sys.exit("step_kernels.py times CUDA decode steps; run it on the GPU")
    out = args.out or Path("/tmp/step-kernels")
    out.mkdir(parents=True, exist_ok=True)
    clocks = start_clock_log(out / "clocks.csv")
    meta = run_meta()
    cells = [tuple(c) for c in args.cells]
    batches = sorted({b for b, _ in cells})
    if args.preset not in PRESETS:
        sys.exit(f"--preset {args.preset!r}: one of {sorted(PRESETS)}")
    config = PRESETS[args.preset](num_layers=2)

    def backend():
        return get_backend("triton", device="cuda", kv_lora_rank=config.kv_lora_rank,
                           qk_rope_dim=config.qk_rope_dim)

    bench = TpotBench.build(config, batches=batches, policies=POLICIES[:2])
    bench.runners["fixed-max-control"] = captured_runners(
        bench.model, ["fixed-max"], max_model_len=bench.max_model_len, batches=batches,
        backend=backend)["fixed-max"]
    rows, plan_objects = [], []
    for b, ctx in cells:
        decode = bench.batch(ctx, b)
        runners = {p: bench.runners[p] for p in POLICIES}
        keys = {p: r.selector.choose([ctx] * b)
                for p, r in runners.items()}
        plans = {p: runners[p].plan_for(keys[p]) for p in POLICIES}
        plan_objects.append(plans)
        steps = {p: (lambda r=runners[p]: r.step(decode)) for p in POLICIES}
        samples = interleaved_rounds(steps, rounds=args.rounds)
        ratio = {p: [round(x / y, 4) for x, y in zip(samples[p], samples["fixed-max"],
                                                     strict=True)]
                 for p in POLICIES[1:]}
        profiles = {p: kernel_profile(steps[p], args.profiled_steps) for p in POLICIES}
        row = {"batch": b, "context": ctx,
               "keys": {p: str(k) for p, k in keys.items()},
               "plans": {p: plan.describe() for p, plan in plans.items()},
               "same_plan": plans["ladder"] == plans["fixed-max"],
               "step_ms": samples,
               "step_ms_median": {p: statistics.median(v) for p, v in samples.items()},
               "round_ratio_to_fixed_max": ratio,
               "round_ratio_median": {p: statistics.median(v) for p, v in ratio.items()},
               "profile": profiles}
        rows.append(row)
        print(b, ctx, row["step_ms_median"], row["round_ratio_median"],
              {p: pr["busy_us_per_step"] for p, pr in profiles.items()}, flush=True)
    model_pages = bench.model.num_pages
    bench.close()
    del bench
    torch.cuda.empty_cache()

    # The same plans alone, as the tuner times them (paired rounds, cold L2).
    timer = PlanTimer(max(c for _, c in cells), max(batches), config.num_heads, max_splits=16)
    for row, plans in zip(rows, plan_objects, strict=True):
        pair = {p: plans[p] for p in ("fixed-max", "ladder")}
        row["kernel_us"] = [timer.time(row["context"], row["batch"], pair) for _ in range(4)]
        print(row["batch"], row["context"], "kernel", row["kernel_us"], flush=True)
    del timer
    torch.cuda.empty_cache()
    if clocks is not None:
        clocks.terminate()
    meta.update({"cells": cells, "rounds": args.rounds, "kv_pages": model_pages,
                 "preset": args.preset, "num_heads": config.num_heads})
    name = "h200-step-kernels" + ("" if args.preset == DEFAULT_PRESET else f"-{args.preset}")
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    text = markdown(meta, rows)
    (out / f"{name}.md").write_text(text)
    print(text)


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"# The ladder's step against fixed-max's, kernel by kernel ({meta['gpu']})", "",
             f"{meta['date']}, torch {meta['torch']}, triton {meta['triton']}. Command: "
             f"`{meta['command']}`. 2-layer {meta.get('preset', DEFAULT_PRESET)} decoder "
             f"({meta.get('num_heads', 16)} heads); step: median "
             f"of {meta['rounds']} interleaved rounds, ms; ratio: median of each round's "
             "ratio to fixed-max (the control is a second fixed-max runner); busy: device "
             "time of every kernel in one step (torch.profiler), us; kernel: the two plans "
             "alone (PlanTimer, 4 paired rounds), us.", "",
             "| batch | context | same plan | fixed-max ms | ladder ms | ladder ratio | "
             "control ratio | busy fixed-max / ladder us | kernel fixed-max / ladder us |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        med, ratio, prof = r["step_ms_median"], r["round_ratio_median"], r["profile"]
        kernel = r.get("kernel_us") or []
        pair = (statistics.median(k["fixed-max"] for k in kernel),
                statistics.median(k["ladder"] for k in kernel)) if kernel else None
        lines.append(
            f"| {r['batch']} | {r['context']} | {r['same_plan']} | {med['fixed-max']:.3f} | "
            f"{med['ladder']:.3f} | {ratio['ladder']:.3f} | {ratio['fixed-max-control']:.3f} "
            f"| {prof['fixed-max']['busy_us_per_step']} / {prof['ladder']['busy_us_per_step']}"
            f" | {f'{pair[0]:.1f} / {pair[1]:.1f}' if pair else '-'} |")
    lines += ["", "Plans (fixed-max / ladder):", ""]
    lines += [f"- {r['batch']} x {r['context']}: {r['plans']['fixed-max']} / "
              f"{r['plans']['ladder']}" for r in rows]
    return "\n".join(lines) + "\n"

if __name__ == "__main__":
    main()
