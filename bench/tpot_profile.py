"""Where a decode step's time goes: per-kernel CUDA time of one ladder step (torch profiler).

    python3 bench/tpot_profile.py --layers 4 --contexts 1 100000 --batch 1
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.tpot import MAX_MODEL_LEN, TpotBench, time_tpot  # noqa: E402
from graphbucket.models import PRESETS  # noqa: E402


def kernel_table(fn, steps: int = 5, top: int = 25) -> str:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / steps
    lines = [f"kernel time per step {total:.1f} us ({len(events)} kernel kinds)"]
    for e in events[:top]:
        lines.append(f"{e.device_time_total / steps:9.1f} us  {e.count / steps:5.1f}x  "
                     f"{e.key[:90]}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--preset", default="deepseek-v3-tp8", choices=sorted(PRESETS))
    ap.add_argument("--contexts", type=int, nargs="+", default=[1, 100_000])
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    bench = TpotBench.build(PRESETS[args.preset](num_layers=args.layers),
                            max_model_len=MAX_MODEL_LEN, batches=[args.batch],
                            policies=("ladder", "eager"))
    for context in args.contexts:
        decode = bench.batch(context, args.batch)
        for policy, runner in bench.runners.items():
            step = lambda: runner.step(decode)
            print(f"\n== {policy} bs={args.batch} ctx={context}: TPOT {time_tpot(step):.3f} ms")
            print(kernel_table(step))
    bench.close()


if __name__ == "__main__":
    main()
