"""The GPU's wait on the host between decode steps: steps issued once the last one finished
(the host waits, then runs its step while the GPU idles) against steps issued one ahead (the
host runs step k+1 while the GPU runs step k, then waits for step k), as an engine that
overlaps its scheduling with the GPU runs them.

The capture bench's model and runner (``bench/capture_dispatch.py``: 16 heads, 3 layers,
the default ladder), requests growing one token a step through the runner's ``BlockTable``,
pinned to one core. Per cell (batch 1 at 64K-128K, 64 x 1K, 64 x 120K-128K) the two loops
run in alternating rounds on one trajectory; per loop: the host time of a step (the table
verbs and ``runner.step``), the step period (wall time per step over a round) and, for the
loop issued ahead, the share of steps whose predecessor had already finished when the host
came to wait for it (the GPU may have run dry). The period of the first loop less the
second's is the GPU idle per step that issuing ahead removes.

    python3 bench/experiments/step_ahead.py --out DIR          # CUDA, about a minute
    python3 bench/experiments/step_ahead.py --cpu-smoke        # the loops on the CPU, small
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

LOOPS = ("after", "ahead")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6, help="rounds per loop and cell (default 6)")
    p.add_argument("--round-steps", type=int, default=50, help="steps per round (default 50)")
    p.add_argument("--out", type=Path, help="write step-ahead.{json,md} into this folder")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="the capture bench's CPU model (Triton's interpreter), 2 rounds of 3")
    return p.parse_args(argv)


class Loop:
    """One cell's runner and trajectory, stepped by either loop; the loop issued ahead
    marks each step's end with one of two CUDA events (none on the CPU)."""

    def __init__(self, runner, traj, cuda: bool) -> None:
        import torch

        self.runner, self.traj, self.cuda = runner, traj, cuda
        self.events = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self.outputs: deque = deque(maxlen=4)  # the engine's consumers, in stream order

    def issue(self) -> float:
        """One step (the scheduler's bookkeeping outside the timing): host us."""
        traj = self.traj
        lens = traj.advance()
        t0 = time.perf_counter()
        traj.advance_table()
        out = self.runner.step(traj.table_batch(lens))
        t1 = time.perf_counter()
        self.outputs.append(out.clone())
        return (t1 - t0) * 1e6

    def round(self, loop: str, steps: int, k: int) -> tuple[list[float], float, int]:
        """(host us per step, wall us per step, steps whose predecessor had finished before
        the host waited for it)."""
        import torch

        host, dry = [], 0
        sync = torch.cuda.synchronize if self.cuda else (lambda: None)
        sync()
        start = time.perf_counter()
        for i in range(steps):
            if loop == "after":
                host.append(self.issue())
                sync()
                continue
            host.append(self.issue())
            if self.cuda:
                done, prev = self.events[(k + i) % 2], self.events[(k + i + 1) % 2]
                done.record()
                if i:
                    dry += prev.query()
                    prev.synchronize()
        sync()
        return host, (time.perf_counter() - start) * 1e6 / steps, dry


def cell(runner, cfg, bs: int, lo: int, hi: int, rounds: int, steps: int, cuda: bool) -> dict:
    import numpy as np

    from bench.capture_dispatch import Trajectory

    table = runner.block_table
    for row in range(table.num_rows):
        table.release(row)
    loop = Loop(runner, Trajectory(cfg, table, bs, lo, hi, np.random.default_rng(bs)), cuda)
    loop.round("after", min(steps, 10), 0)  # first touches outside the timing
    host: dict[str, list[float]] = {name: [] for name in LOOPS}
    period: dict[str, list[float]] = {name: [] for name in LOOPS}
    dry = 0
    for r in range(rounds):
        for name in (LOOPS if r % 2 == 0 else LOOPS[::-1]):
            h, p, d = loop.round(name, steps, r)
            host[name] += h[1:]  # a round's first step follows the other loop's sync
            period[name].append(p)
            dry += d
    res = {"batch_size": bs, "lengths": [lo, hi], "rounds": rounds, "round_steps": steps}
    for name in LOOPS:
        res[name] = {"host_us_median": round(statistics.median(host[name]), 2),
                     "host_us_p90": round(float(np.percentile(host[name], 90)), 2),
                     "period_us_median": round(statistics.median(period[name]), 2)}
    res["gpu_idle_removed_us"] = round(res["after"]["period_us_median"]
                                       - res["ahead"]["period_us_median"], 2)
    res["ahead_dry_share"] = round(dry / (rounds * (steps - 1)), 3)
    return res


def markdown(meta: dict, cells: list[dict]) -> str:
    lines = ["# Steps issued after the last one finished against one ahead", "",
             f"{meta.get('date', '')}, {meta['gpu']}, torch {meta['torch']}, triton "
             f"{meta['triton']}. Command: `{meta['command']}`. Medians; "
             "host us: the table verbs and runner.step; period: wall us per step over a "
             "round; dry: steps (issued ahead) whose predecessor had finished before the "
             "host waited for it.", "",
             "| batch | lengths | host after | host ahead | period after | period ahead | "
             "GPU idle removed | dry |", "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        a, b = c["after"], c["ahead"]
        lines.append(f"| {c['batch_size']} | {c['lengths'][0]}-{c['lengths'][1]} | "
                     f"{a['host_us_median']} | {b['host_us_median']} | "
                     f"{a['period_us_median']} | {b['period_us_median']} | "
                     f"{c['gpu_idle_removed_us']} | {c['ahead_dry_share']:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from bench.capture_dispatch import SMOKE, Config, MLADecoder, _pinned_core, make_runner
    from bench.gpu_timing import run_meta
    from graphbucket import default_ladder

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        sys.exit("step_ahead.py needs a CUDA GPU; pass --cpu-smoke for a CPU smoke run")
    cfg = Config() if cuda else SMOKE
    rounds, steps = (args.rounds, args.round_steps) if cuda else (2, 3)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {_pinned_core()})
    runner = make_runner(cfg, MLADecoder(cfg), default_ladder(cfg.max_model_len))
    runner.capture()
    grow = (rounds * 2 + 1) * steps + 20  # tokens every request gains over a cell
    hi = cfg.max_model_len - grow
    big = max(cfg.batch_sizes)
    short_hi = min(hi, 16 * cfg.page)
    cells = [cell(runner, cfg, 1, hi // 2, hi, rounds, steps, cuda),
             cell(runner, cfg, big, short_hi // 2, short_hi, rounds, steps, cuda),
             cell(runner, cfg, big, hi - hi // 16, hi, rounds, steps, cuda)]
    runner.close()
    meta = run_meta()
    text = markdown(meta, cells)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "step-ahead.json").write_text(json.dumps({"meta": meta, "cells": cells},
                                                             indent=1))
        (args.out / "step-ahead.md").write_text(text)


if __name__ == "__main__":
    main()
