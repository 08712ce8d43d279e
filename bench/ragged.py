"""Ragged and uniform batches: split-KV against balanced split-KV, same run (H200).

Mixes (16 heads, bf16, page 64, cold L2, CUDA-graph replays, as in the kernel sweep):

- ``long-among-short``: batch 64, one 128K request and 63 of 1K;
- ``spread-128k``: batch 8, lengths spread evenly over 1..128K;
- ``spread-8k``: batch 64, lengths spread evenly over 1..8K;
- ``uniform``: every request at one length (the balanced targets' shapes).

Split-KV is planned from the longest length (what a bucket graph covering it plans with),
so every row gets the same split count; balanced split-KV partitions the batch's tiles
into equal chunks on the device (``plan_balanced_mla_decode``). The floor is the bytes
actually read (each request's own KV rows, q and out) over the copy bandwidth measured in
the same run.

    python3 bench/ragged.py --out bench/results      # writes h200-ragged.{json,md}
    python3 bench/ragged.py --sweep-balanced --out bench/results   # + balanced variants
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import DIM, HEADS, PAGE, RANK, bytes_read, inputs, mixes  # noqa: E402
from bench.gpu_timing import (  # noqa: E402
    add_out_argument,
    copy_gbps,
    out_dir,
    run_line,
    run_meta,
    time_replays,
)
from graphbucket.kernels import (  # noqa: E402
    SplitWorkspace,
    default_sm_scale,
    mla_decode,
    mla_decode_balanced,
)
from graphbucket.plan import plan_balanced_mla_decode, plan_mla_decode  # noqa: E402

SWEEP = [(programs, chunk) for programs in (1, 2, 4) for chunk in (1, 4, 16)]


def measure(gbps: float, sweep: list[tuple[int, int]]) -> list[dict]:
    """``sweep``: extra balanced variants as (programs in half waves, min chunk tiles)."""
    all_pages = max(sum(-(-n // PAGE) for n in lens) for _, lens in mixes())
    cache = torch.empty(8 * all_pages, PAGE, DIM, dtype=torch.bfloat16, device="cuda").normal_()
    scale, rows = default_sm_scale(), []
    for name, lens in mixes():
        tables, q, out, seq_lens = inputs(lens, cache)
        split = plan_mla_decode(len(lens), HEADS, max(lens))
        balanced = plan_balanced_mla_decode(len(lens), HEADS)
        floor_us = bytes_read(lens) / (gbps * 1e3)
        variants = [(split, mla_decode, f"split-kv ({split.num_kv_splits} splits)"),
                    (balanced, mla_decode_balanced,
                     f"balanced ({balanced.persistent_programs} programs)")]
        # The merge tile of the earlier plan (256 rows whatever the batch), same run.
        wide = replace(balanced, merge_block_s=256)
        if wide != balanced:
            variants.append((wide, mla_decode_balanced, f"balanced ("
                             f"{balanced.persistent_programs} programs, merge tile 256)"))
        for programs, min_chunk in sweep:  # balanced variants, when asked for
            plan = plan_balanced_mla_decode(len(lens), HEADS, min_chunk_tiles=min_chunk,
                                            programs=programs * balanced.persistent_programs
                                            // 2)
            variants.append((plan, mla_decode_balanced, f"balanced ({plan.persistent_programs}"
                             f" programs, min chunk {min_chunk} tiles)"))
        ws = SplitWorkspace.allocate(len(lens), HEADS, split.num_kv_splits, RANK, "cuda",
                                     max_items=max(p.max_work_items for p, _, _ in variants))
        for plan, launch, topology in variants:
            def call(plan=plan, launch=launch, tables=tables, q=q, out=out, seq_lens=seq_lens):
                for r in range(tables.shape[0]):
                    launch(q[r], cache, tables[r], seq_lens, out[r], ws, plan=plan,
                           sm_scale=scale, check=False)

            us = time_replays(call, calls_per_graph=tables.shape[0])
            rows.append({"impl": "graphbucket", "topology": topology, "heads": HEADS,
                         "batch": len(lens), "context": max(lens), "mix": name,
                         "us": round(us, 3), "floor_us": round(floor_us, 3),
                         "frac_of_copy": round(floor_us / us, 4)})
            print(rows[-1], flush=True)
    return rows


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [f"# Ragged MLA decode ({meta['gpu']})", "",
             run_line(meta), "",
             "| mix | batch | longest | topology | us | floor us | of floor |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['mix']} | {r['batch']} | {r['context']} | {r['topology']} | "
                     f"{r['us']:.1f} | {r['floor_us']:.1f} | {100 * r['frac_of_copy']:.0f} % |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(ap, "h200-ragged.{json,md} (h200-ragged-balanced-sweep.* with "
                         "--sweep-balanced)")
    ap.add_argument("--sweep-balanced", action="store_true",
                    help="also time balanced variants: 1, 2 or 4 half waves of programs x "
                         "minimum chunks of 1, 4 and 16 tiles")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ragged.py times CUDA graph replays and needs a CUDA GPU")
    gbps = copy_gbps()
    rows = measure(gbps, SWEEP if args.sweep_balanced else [])
    result = {"meta": {**run_meta(), "copy_gbps": round(gbps, 1)}, "rows": rows}
    print(markdown(result))
    if out := out_dir(args.out):
        name = "h200-ragged-balanced-sweep" if args.sweep_balanced else "h200-ragged"
        path = os.path.join(out, name)
        with open(path + ".json", "w") as f:
            json.dump(result, f, indent=1)
        with open(path + ".md", "w") as f:
            f.write(markdown(result))


if __name__ == "__main__":
    main()
