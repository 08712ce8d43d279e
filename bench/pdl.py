"""Programmatic dependent launch of the merge: decode time with it and without.

With PDL the merge grid launches while stage 1 runs (stage 1 signals at its start) and
each merge program waits on the device (griddepcontrol.wait) for stage 1's partials, so
the launch gap between the two kernels leaves the critical path. Same plans, same cold-L2
graph-replay timing as the kernel sweep; PDL is flipped in one process.

    python3 bench/pdl.py --out bench/results      # writes h200-pdl.json/.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import graphbucket.kernels.launch as launch  # noqa: E402
from bench.gpu_timing import copy_gbps, run_meta, time_replays  # noqa: E402
from graphbucket.kernels import SplitWorkspace, default_sm_scale  # noqa: E402
from graphbucket.plan import plan_mla_decode  # noqa: E402
from graphbucket.timing import Problem, kv_bytes, rotated_calls  # noqa: E402

SHAPES = [(256, 1), (1024, 1), (4096, 1), (16384, 1), (65536, 1), (131072, 1), (4096, 8),
          (131072, 8), (4096, 64), (32768, 64)]
HEADS = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("pdl.py needs a CUDA GPU")
    copy = copy_gbps()
    meta = {**run_meta(), "copy_gbps": round(copy, 1)}
    problem, scale, rows = Problem(131072 * 16), default_sm_scale(), []
    for context, batch in SHAPES:
        tables, q, out, seq_lens = problem.inputs(context, batch)
        # every plan here asks for it, whatever plan_mla_decode decides per stream
        plan = dataclasses.replace(plan_mla_decode(batch, HEADS, context), dependent_merge=True)
        ws = SplitWorkspace.for_plans([plan], "cuda")
        row = {"context": context, "batch": batch, "splits": plan.num_kv_splits}
        for name, enabled in (("off", False), ("on", True)):
            launch.PDL_ENABLED = enabled
            call = rotated_calls(problem, tables, q, out, seq_lens, ws, plan, scale)
            row[f"{name}_us"] = round(time_replays(call, calls_per_graph=tables.shape[0]), 2)
        launch.PDL_ENABLED = True
        row["of_copy_on"] = round(kv_bytes(context, batch) / (row["on_us"] * 1e3) / copy, 4)
        rows.append(row)
        print(row, flush=True)
    lines = [f"# Merge launched with programmatic dependent launch ({meta['gpu']})", "",
             f"{meta['date']}, torch {meta['torch']}, triton {meta['triton']}, copy "
             f"{meta['copy_gbps']:.0f} GB/s. Command: `{meta['command']}`", "",
             "| context | batch | splits | PDL off us | PDL on us (of copy) | off / on |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['context']} | {r['batch']} | {r['splits']} | {r['off_us']:.1f} | "
              f"{r['on_us']:.1f} ({100 * r['of_copy_on']:.0f} %) | "
              f"{r['off_us'] / r['on_us']:.3f}x |" for r in rows]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "h200-pdl.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "h200-pdl.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
