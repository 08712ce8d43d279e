"""The balanced merge's unit tile: the plan's ([items per step, heads, columns]) against
tiles of several heads per unit, in one process on the same inputs. Whole balanced steps
(planner, stage 1, merge), each tile's output checked against the plan's, then timed as
interleaved CUDA-graph replays with a cold L2 (``time_replays_paired``), the step
partitioned once per replay as a decode step's layers do. Ragged mixes at batch 64, one
long request among 127 short ones and a uniform batch, 128 and 16 heads, over the item,
equal-range and charged-range balanced kernels.

    python3 bench/experiments/merge_tiles.py --out DIR

Writes DIR/merge-tiles.{json,md}; ``over_plan`` below 1 means the tile beats the plan's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.gpu_timing import add_out_argument, report_run, run_line, run_meta  # noqa: E402

TOP = 131072
KERNELS = ("default", "seesaw", "seesaw-ranges", "seesaw-charged")  # the seesaw's, per heads
# (items per step, heads, columns, warps): one unit's step is 4096-8192 float32 partials.
# The 128-head tiles and their prefetched twins (the prefetch alone, then wider columns with
# fewer items per step: more live bytes per chain of dependent loads).
TILES = ((8, 8, 64, 4), (4, 8, 128, 4), (32, 2, 64, 4), (8, 8, 64, 4, True),
         (32, 2, 64, 4, True), (4, 8, 128, 4, True), (2, 8, 256, 4, True),
         (2, 8, 256, 8, True), (1, 8, 512, 8, True), (2, 4, 512, 4, True))


def tile_name(tile: tuple) -> str:
    """(items, heads, columns, warps[, prefetch]) -> 's8-h8-dv64-w4' ('-p': prefetched)."""
    return "s{}-h{}-dv{}-w{}".format(*tile[:4]) + ("-p" if len(tile) > 4 and tile[4] else "")


def kernels_for(backend, heads: int) -> list[str]:
    """The seesaw's balanced kernels at ``heads``: 'default' is the seesaw from 64 heads."""
    offered = backend.balanced_kernels(heads)
    kernels = [k for k in KERNELS if k in offered]
    return [k for k in kernels if k != "default"] if "seesaw" in kernels else kernels


def shapes() -> list[tuple[str, list[int]]]:
    from bench.ladder_oracle import ragged_mixes

    cells = [(f"64 x {name}", lens) for name, lens in ragged_mixes(64, TOP)]
    cells += [(f"128 x {name}", lens) for name, lens in ragged_mixes(128, TOP)
              if name == "long-among-short"]
    return cells + [("64 x uniform-1024", [1024] * 64)]


def parse_tile(text: str) -> tuple:
    """'s4-h8-dv128-w4' (or '4,8,128,4') -> (4, 8, 128, 4); a '-p' suffix adds the
    prefetched merge: (4, 8, 128, 4, True)."""
    prefetch = text.endswith("-p")
    body = text[:-2] if prefetch else text
    parts = body.replace("-", ",").replace("dv", "").replace("s", "").replace("h", "")
    values = tuple(int(v) for v in parts.replace("w", "").split(","))
    if len(values) != 4:
        raise argparse.ArgumentTypeError(f"a tile is sS-hH-dvD-wW[-p], got {text!r}")
    return values + (True,) if prefetch else values


def measure(heads_list: list[int], reps: int, tiles=TILES, mixes=None) -> list[dict]:
    import torch

    from bench.common import inputs, random_cache
    from graphbucket.backends.triton import TritonBackend
    from graphbucket.kernels import SplitWorkspace, default_sm_scale, mla_decode_balanced
    from graphbucket.merge_tile import with_merge_tile
    from graphbucket.tuning.measure import time_replays_paired

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    backend = TritonBackend(num_sms=num_sms)
    cells = [(m, lens) for m, lens in shapes()
             if not mixes or any(m.endswith(" x " + x) or m == x for x in mixes)]
    cache = random_cache(max(sum(-(-n // 64) for n in lens) for _, lens in cells))
    sm_scale = default_sm_scale()
    rows = []
    for heads in heads_list:
        for mix, lens in cells:
            tables, q, out, seq_lens = inputs(lens, cache, heads)
            batch = len(lens)
            for kernel in kernels_for(backend, heads):
                base = backend.plan_balanced(batch, heads, kernel)
                plans = {"plan": base}
                plans.update({tile_name(t): with_merge_tile(
                    base, num_sms, block_s=t[0], block_h=t[1], block_dv=t[2], num_warps=t[3],
                    prefetch=len(t) > 4 and t[4]) for t in tiles})
                ws = SplitWorkspace.allocate(batch, heads, 1, 512, "cuda",
                                             max_items=base.max_work_items)
                results = {}
                for name, plan in plans.items():
                    out[0].fill_(float("nan"))
                    mla_decode_balanced(q[0], cache, tables[0], seq_lens, out[0], ws,
                                        plan=plan, sm_scale=sm_scale)
                    results[name] = out[0].float().clone()

                def calls(plan, tables=tables, q=q, out=out, seq_lens=seq_lens, ws=ws):
                    def call() -> None:
                        for r in range(tables.shape[0]):
                            mla_decode_balanced(q[r], cache, tables[r], seq_lens, out[r], ws,
                                                plan=plan, sm_scale=sm_scale, check=False,
                                                partition=r == 0)
                    return call

                us = time_replays_paired({n: calls(p) for n, p in plans.items()},
                                         calls_per_graph=tables.shape[0], reps=reps)
                ref = results["plan"]
                for name, plan in plans.items():
                    diff = ((results[name] - ref).norm() / ref.norm()).item()
                    row = {"heads": heads, "mix": mix, "kernel": kernel, "tile": name,
                           "plan": plan.describe(), "merge_programs": plan.merge_programs,
                           "us": round(us[name], 2),
                           "over_plan": round(us[name] / us["plan"], 4),
                           "rel_diff": float(f"{diff:.3e}")}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    names = ["plan"] + list(dict.fromkeys(r["tile"] for r in rows if r["tile"] != "plan"))
    lines = [f"# The balanced merge's unit tile ({meta['gpu']})", "",
             f"{run_line(meta)}. Whole balanced steps (planner, stage 1, merge), interleaved "
             "CUDA-graph replays, cold L2, median microseconds per call for the plan's merge "
             "tile, and each tile's time over it (items per step s, heads h, columns dv, "
             "warps w; -p: the prefetched merge); the largest relative L2 difference from "
             f"the plan's output is {max((r['rel_diff'] for r in rows), default=0):.1e}.", "",
             "| heads | mix | kernel | plan us | " + " | ".join(names[1:]) + " |",
             "|---:|---|---|---:|" + "---:|" * (len(names) - 1)]
    cases: dict[tuple, dict] = {}
    for r in rows:
        cases.setdefault((r["heads"], r["mix"], r["kernel"]), {})[r["tile"]] = r
    for (heads, mix, kernel), by_tile in cases.items():
        cells = [f"{by_tile[n]['over_plan']:.3f}" if n in by_tile else "-" for n in names[1:]]
        lines.append(f"| {heads} | {mix} | {kernel} | {by_tile['plan']['us']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(p, "merge-tiles.{json,md}")
    p.add_argument("--heads", type=int, nargs="+", default=[128, 16])
    p.add_argument("--reps", type=int, default=5, help="interleaved rounds per cell")
    p.add_argument("--tiles", type=parse_tile, nargs="+", default=list(TILES),
                   help="tiles to time against the plan's, e.g. s4-h8-dv128-w4")
    p.add_argument("--mixes", nargs="+", help="only these mixes (e.g. spread-8k, "
                   "'64 x long-among-short'); default all")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("merge_tiles.py times CUDA graphs and needs a CUDA GPU")
    rows = measure(args.heads, args.reps, args.tiles, args.mixes)
    report_run(args.out, "merge-tiles", run_meta(), rows, markdown)


if __name__ == "__main__":
    main()
