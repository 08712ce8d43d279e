"""Where a host step's time goes: the BlockTable step at batch 1 x 64K-128K, and at the
largest capture size (64) at about 1K and at 120K-128K tokens (batch apart from context).

Runs the capture bench's model and runner (``bench/capture_dispatch.py``), steps requests
that grow one token a step through the runner's ``BlockTable``, and reports the median
host time of a whole step (the table verbs included, the GPU idle before each step), then
the same steps under cProfile: the cumulative time of each phase of ``runner.step``
(validate, select, stage, replay) and the functions that take the most time themselves.
cProfile inflates every call, so read its column as shares, the first as the time; the
same phases are then timed apart by the wall clock (``wall_us_median``), the runner's calls
made one by one.

    python3 bench/experiments/host_phases.py                 # H200, about 1 minute
    python3 bench/experiments/host_phases.py --cpu-smoke     # Triton's interpreter, small
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# runner.step's phases, by the (module file, function) cProfile sees for each: the batch
# validator's __call__, the selector's key_for, the buffers' stage, the graph table's replay.
PHASES = {"validate": ("batch.py", "__call__"), "select": ("select.py", "key_for"),
          "stage": ("buffers.py", "stage"), "replay": ("graphs.py", "replay")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="timed steps per cell (default 300)")
    p.add_argument("--out", type=Path, help="write host-phases.json into this folder")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="a tiny model on the CPU (Triton's interpreter), 20 steps")
    return p.parse_args(argv)


def phase_times(stats: pstats.Stats, steps: int) -> dict[str, float]:
    """Cumulative us per step of each phase's function (by name, in graphbucket)."""
    out = {}
    for phase, (module, func) in PHASES.items():
        # The graph table's replay calls one graph's replay: count the outer one only.
        rows = [(line, row[3]) for (path, line, name), row in stats.stats.items()
                if name == func and path.endswith(os.path.join("graphbucket", module))]
        total = max((t for _, t in rows), default=0.0)
        out[phase] = round(total / steps * 1e6, 2)
    return out


def top_functions(profile: cProfile.Profile, n: int = 12) -> list[str]:
    buf = io.StringIO()
    pstats.Stats(profile, stream=buf).sort_stats("tottime").print_stats(n)
    return [line for line in buf.getvalue().splitlines() if line.strip()][-n:]


def cell(runner, cfg, bs: int, lo: int, hi: int, steps: int, cuda: bool, *,
         idle: str = "", idle_ms: float = 0.0) -> dict:
    import numpy as np
    import torch

    from bench.capture_dispatch import Trajectory

    for row in range(runner.block_table.num_rows):
        runner.block_table.release(row)
    traj = Trajectory(cfg, runner.block_table, bs, lo, hi, np.random.default_rng(0))

    def one_step() -> None:
        lens = traj.advance()  # the scheduler's own bookkeeping: outside the timing
        if cuda:
            torch.cuda.synchronize()
        host_idle(idle, idle_ms)
        t0 = time.perf_counter()
        traj.advance_table()
        runner.step(traj.table_batch(lens))
        return (time.perf_counter() - t0) * 1e6

    warm = min(10, steps // 2)
    for _ in range(warm):
        one_step()
    times = sorted(one_step() for _ in range(steps))
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        one_step()
    profile.disable()
    stats = pstats.Stats(profile)
    return {"batch_size": bs, "lengths": [lo, hi], "steps": steps, "idle": idle,
            "idle_ms": idle_ms,
            "step_us_median": round(times[len(times) // 2], 2),
            "step_us_p90": round(times[int(len(times) * 0.9)], 2),
            "profiled_us_per_step": phase_times(stats, steps),
            "wall_us_median": wall_split(runner, traj, steps, cuda, idle, idle_ms),
            "top_functions": top_functions(profile)}


def host_idle(how: str, ms: float) -> None:
    """What the host does while a long GPU step runs, emulated on a short one: sleep (the
    thread blocks, the core may idle) or spin (the core stays busy), for ``ms``."""
    if how == "sleep":
        time.sleep(ms / 1e3)
    elif how == "spin":
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            pass


def wall_split(runner, traj, steps: int, cuda: bool, idle: str = "", idle_ms: float = 0.0
               ) -> dict[str, float]:
    """Median wall-clock us of each phase of a step, timed apart without a profiler: the
    runner's own calls in its order (validate, select, stage, replay), the GPU idle before
    each step as in ``cell``; ``stage`` also split into the slot fill and the copies."""
    import torch

    from graphbucket.batch import BatchValidator

    validate = BatchValidator(runner.spec, max_q_len=runner.selector.max_q_len,
                              block_table=runner.block_table)
    buffers, selector, graphs = runner.buffers, runner.selector, runner.graphs
    names = ("table_verbs", "validate", "select", "stage", "replay", "total")
    samples: dict[str, list[float]] = {n: [] for n in names}
    clock = time.perf_counter
    for _ in range(steps):
        lens = traj.advance()
        if cuda:
            torch.cuda.synchronize()
        host_idle(idle, idle_ms)
        t0 = clock()
        traj.advance_table()
        t1 = clock()
        host = validate(traj.table_batch(lens))
        t2 = clock()
        key = selector.key_for(host.batch_size, host.min_len, host.max_len, host.lengths,
                               host.q_len)
        t3 = clock()
        slot = buffers.stage(host, key.batch_size, in_graph=graphs.copy_in_graph)
        t4 = clock()
        graphs.replay(key, slot if graphs.copy_in_graph else None)
        t5 = clock()
        for name, a, b in zip(names, (t0, t1, t2, t3, t4, t0), (t1, t2, t3, t4, t5, t5),
                              strict=True):
            samples[name].append((b - a) * 1e6)
    return {n: round(sorted(v)[len(v) // 2], 2) for n, v in samples.items()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from bench.capture_dispatch import SMOKE, Config, MLADecoder, _pinned_core, make_runner
    from graphbucket import default_ladder

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        sys.exit("host_phases.py needs a CUDA GPU; pass --cpu-smoke for a CPU smoke run")
    cfg = Config() if cuda else SMOKE
    steps = args.steps if cuda else 20
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {_pinned_core()})
    model = MLADecoder(cfg)
    runner = make_runner(cfg, model, default_ladder(cfg.max_model_len))
    runner.capture()
    # Lengths that stay below max_model_len over every step (warm-up and profile included).
    hi = cfg.max_model_len - 3 * steps - 20
    # Batch 1 long, the largest batch short (batch without context) and long (both).
    big = max(cfg.batch_sizes)
    short_hi = min(hi, 4 * cfg.page + 3 * steps + 20)
    cells = [cell(runner, cfg, 1, hi // 2, hi, steps, cuda),
             cell(runner, cfg, big, short_hi // 2, short_hi, steps, cuda),
             cell(runner, cfg, big, hi - hi // 16, hi, steps, cuda)]
    # Is the long step's host time the code or the host after a long wait? The short batch
    # again, the host first waiting as long as a 64 x 128K step runs (sleeping, spinning).
    wait = 0.0 if not cuda else 6.5
    cells += [cell(runner, cfg, big, short_hi // 2, short_hi, steps, cuda, idle=how,
                   idle_ms=wait) for how in ("sleep", "spin")]
    runner.close()
    for c in cells:
        wait = f" after {c['idle']} {c['idle_ms']} ms" if c["idle"] else ""
        print(f"batch {c['batch_size']} x {c['lengths']}{wait}: step median "
              f"{c['step_us_median']} us "
              f"(p90 {c['step_us_p90']}); profiled us per step {c['profiled_us_per_step']}"
              f"; wall us per phase {c['wall_us_median']}")
        print("\n".join("    " + line for line in c["top_functions"]))
    if args.out:
        from bench.gpu_timing import run_meta

        args.out.mkdir(parents=True, exist_ok=True)
        meta = run_meta() if cuda else {"device": "cpu"}
        meta["command"] = "python3 " + " ".join(sys.argv)
        (args.out / "host-phases.json").write_text(json.dumps({"meta": meta, "cells": cells},
                                                              indent=1))
        print(f"wrote {args.out / 'host-phases.json'}")


if __name__ == "__main__":
    main()
