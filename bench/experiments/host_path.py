"""The host work of a decode step without a GPU: what the code itself costs, by batch and
context.

A ``BlockTable`` step of the capture bench's spec (``bench/capture_dispatch.py``: 16 heads,
64-token pages, 131072 tokens): the engine's table verbs (a new page where a request needs
one), validation, the selector's key and staging into a slot of static buffers on the CPU
(the numpy writes a GPU step makes, without its copy or replay, which the capture bench
times on the GPU machine). Requests grow one token a step from lengths spread over a range.
Pinned to one core, medians of ``--steps`` steps, microseconds, with the shipped 16-head
H200 ladder's selector (split-KV and its ragged switch) or the default ladder's.

On the GPU machine the same phases cost more and depend on what the host did before (a
host that just waited on a long GPU step runs them slower: ``h200-host-phases.md``); this
is the code's own cost, reproducible on any machine, to compare changes and contexts.

    python3 bench/experiments/host_path.py --out DIR          # any machine, about 20 s
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

CELLS = ((1, 900, 1200), (1, 122000, 128000), (8, 900, 1200), (8, 122000, 128000),
         (64, 900, 1200), (64, 14000, 16000), (64, 122000, 128000))
PHASES = ("verbs", "validate", "select", "stage", "total")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="write cpu-host-path.{json,md} here")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--core", type=int, default=(os.cpu_count() or 1) - 1)
    p.add_argument("--evict-mb", type=int, default=0,
                   help="MB written between steps (cold caches; 2x the last-level cache)")
    p.add_argument("--ladders", nargs="+",
                   default=["graphbucket/ladders/h200-h16.json", "default"])
    return p.parse_args(argv)


def build(ladder_name: str):
    import torch

    from bench.capture_dispatch import Config
    from graphbucket import default_ladder
    from graphbucket.backends import get_backend
    from graphbucket.batch import BatchValidator
    from graphbucket.block_table import BlockTable
    from graphbucket.buffers import StaticBuffers
    from graphbucket.graphs import GraphTable
    from graphbucket.ladder import BucketLadder
    from graphbucket.select import GraphSelector
    from graphbucket.spec import BufferSpec, InputSpec

    cfg = Config(device="cpu", dtype=torch.float32)
    spec = BufferSpec(max_pages_per_seq=cfg.max_model_len // cfg.page, num_pages=cfg.num_pages,
                      page_size=cfg.page, num_heads=cfg.heads, output_shape=(cfg.hidden,),
                      output_dtype=cfg.dtype, inputs=(InputSpec("token_ids", (), torch.int64),),
                      device="cpu")
    ladder = (default_ladder(cfg.max_model_len) if ladder_name == "default"
              else BucketLadder.load(ladder_name))
    selector = GraphSelector(ladder, list(cfg.batch_sizes))
    backend = get_backend("triton", kv_lora_rank=cfg.rank, qk_rope_dim=cfg.rope, num_sms=132,
                          device="cpu")
    plans = list(GraphTable(selector, backend, cfg.heads).plans.values())
    buffers = StaticBuffers.allocate(spec, max_batch_size=selector.max_batch_size, max_q_len=1,
                                     workspace=backend.workspace_spec(plans))
    table = BlockTable(spec, selector.max_batch_size)
    validate = BatchValidator(spec, max_q_len=1, block_table=table)
    return cfg, selector, buffers, table, validate


def cell(parts, bs: int, lo: int, hi: int, steps: int, evict_mb: int = 0) -> dict:
    import numpy as np

    from bench.capture_dispatch import Trajectory

    cfg, selector, buffers, table, validate = parts
    for row in range(table.num_rows):
        table.release(row)
    traj = Trajectory(cfg, table, bs, lo, hi, np.random.default_rng(0))
    samples: dict[str, list[float]] = {p: [] for p in PHASES}
    junk = np.zeros(evict_mb * 2**20 // 8) if evict_mb else None
    clock = time.perf_counter
    for i in range(steps + 50):
        lens = traj.advance()  # the scheduler's bookkeeping, outside the timing
        if junk is not None:
            junk.fill(i)
        t0 = clock()
        traj.advance_table()
        t1 = clock()
        host = validate(traj.table_batch(lens))
        t2 = clock()
        key = selector.key_for(host.batch_size, host.min_len, host.max_len, host.lengths, 1)
        t3 = clock()
        buffers.stage(host, key.batch_size, in_graph=True)
        t4 = clock()
        if i >= 50:  # first touches outside the timing
            for name, a, b in zip(PHASES, (t0, t1, t2, t3, t0), (t1, t2, t3, t4, t4),
                                  strict=True):
                samples[name].append((b - a) * 1e6)
    return {"batch": bs, "lengths": [lo, hi], "steps": steps,
            "us_median": {p: round(float(np.median(v)), 2) for p, v in samples.items()},
            "us_p90_total": round(float(np.percentile(samples["total"], 90)), 2)}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def markdown(meta: dict, runs: dict[str, list[dict]]) -> str:
    cold = (f" Before each step {meta['evict_mb']} MB were written (cold caches)."
            if meta.get("evict_mb") else "")
    lines = ["# The host work of a decode step, without a GPU (the code's own cost)", "",
             f"{meta['date']}, {meta['cpu']} ({meta['cores']} cores), Python "
             f"{meta['python']}, torch {meta['torch']}, numpy {meta['numpy']}; pinned to core "
             f"{meta['core']}. Command: "
             f"`{meta['command']}`. BlockTable steps of the capture bench's spec, staged into "
             "CPU buffers (no device copy, no replay); median microseconds over "
             f"{meta['steps']} steps.{cold}", ""]
    for ladder, rows in runs.items():
        lines += [f"Ladder: {ladder}", "",
                  "| batch | lengths | verbs | validate | select | stage | total | p90 |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            m = r["us_median"]
            lines.append(f"| {r['batch']} | {r['lengths'][0]}-{r['lengths'][1]} | "
                         f"{m['verbs']} | {m['validate']} | {m['select']} | {m['stage']} | "
                         f"{m['total']} | {r['us_p90_total']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import numpy as np
    import torch

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    runs = {}
    for name in args.ladders:
        parts = build(name)
        runs[name] = [cell(parts, bs, lo, hi, args.steps, args.evict_mb) for bs, lo, hi in CELLS]
        for r in runs[name]:
            print(name, r["batch"], r["lengths"], r["us_median"], flush=True)
    import datetime

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": cpu_name(), "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "numpy": np.__version__, "core": args.core, "steps": args.steps,
            "evict_mb": args.evict_mb,
            "command": "python3 " + " ".join(sys.argv)}
    text = markdown(meta, runs)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = "cpu-host-path-cold" if args.evict_mb else "cpu-host-path"
        (args.out / f"{stem}.json").write_text(json.dumps({"meta": meta, "runs": runs},
                                                          indent=1))
        (args.out / f"{stem}.md").write_text(text)


if __name__ == "__main__":
    main()
