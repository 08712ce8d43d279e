"""The balanced merge on persistent programs over the listed requests' units (the library's)
against the merge on one program per (row, head, column block) it replaced, in one
process on the same inputs: whole balanced steps (planner, stage 1, merge) checked against
each other, then timed as interleaved CUDA-graph replays with a cold L2
(``time_replays_paired``), the step partitioned once per replay as a decode step's layers
do. Ragged mixes at batch 32, 64 and 128 and uniform batches, 128 and 16 heads, over the
balanced kernels the backend offers.

    python3 bench/experiments/merge_ab.py --out DIR

Writes DIR/merge-ab.{json,md}; ``persistent_over_row_grid`` below 1 means the persistent
merge wins.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.gpu_timing import add_out_argument, report_run, run_line, run_meta  # noqa: E402
from graphbucket.kernels.merge import merge_partials, store_merged  # noqa: E402

TOP = 131072


@triton.jit
def row_grid_merge_kernel(PART_O, PART_LSE, ITEM_INDPTR, OUT, LSE, stride_po_i, stride_po_h,
                          stride_pl_i, stride_o_b, stride_o_h, stride_lse_b,
                          BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
                          WRITE_LSE: tl.constexpr, MERGE_SINGLE: tl.constexpr = False,
                          USE_GDC: tl.constexpr = False):
    """The merge before the persistent one: grid (batch, heads, column blocks)."""
    bid = tl.program_id(0)
    head = tl.program_id(1)
    dv_block = tl.program_id(2)
    offs_dv = dv_block * BLOCK_DV + tl.arange(0, BLOCK_DV)
    if USE_GDC:
        gdc_wait()
    first = tl.load(ITEM_INDPTR + bid)
    request_items = tl.load(ITEM_INDPTR + bid + 1) - first
    if request_items != 1 or MERGE_SINGLE:
        acc, l_i, m_i = merge_partials(
            PART_O + first.to(tl.int64) * stride_po_i + head * stride_po_h,
            PART_LSE + first.to(tl.int64) * stride_pl_i + head,
            stride_po_i, stride_pl_i, request_items, offs_dv, BLOCK_S, BLOCK_DV)
        store_merged(OUT + bid * stride_o_b + head * stride_o_h + offs_dv,
                     LSE + bid * stride_lse_b + head, acc, l_i, m_i, dv_block, WRITE_LSE)


def row_grid_merge(out, workspace, *, plan, lse, dependent=False):
    """``launch_balanced_merge``'s arguments, the row-grid kernel: every request merged after
    equal tile ranges (which run on the seesaw here), else those of other than one item."""
    merge_single = plan.tile_ranges and not plan.charged_ranges
    part_o, part_lse = workspace.item_o, workspace.item_lse
    grid = (plan.batch_size, plan.num_heads, -(-plan.kv_lora_rank // plan.merge_block_dv))
    row_grid_merge_kernel[grid](
        part_o, part_lse, workspace.item_indptr, out, out if lse is None else lse,
        part_o.stride(0), part_o.stride(1), part_lse.stride(0), out.stride(0), out.stride(1),
        0 if lse is None else lse.stride(0), BLOCK_S=plan.merge_block_s,
        BLOCK_DV=plan.merge_block_dv, WRITE_LSE=lse is not None, MERGE_SINGLE=merge_single,
        num_warps=plan.merge_num_warps,
        **({"USE_GDC": True, "launch_pdl": True} if dependent else {}))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_argument(p, "merge-ab.{json,md}")
    p.add_argument("--heads", type=int, nargs="+", default=[128, 16])
    p.add_argument("--reps", type=int, default=5, help="interleaved rounds per cell")
    return p.parse_args(argv)


def shapes() -> list[tuple[str, list[int]]]:
    from bench.ladder_oracle import ragged_mixes

    cells = [(f"{b} x {name}", lens) for b in (32, 64, 128)
             for name, lens in ragged_mixes(b, TOP)]
    return cells + [("64 x uniform-1024", [1024] * 64), ("64 x uniform-4096", [4096] * 64)]


def measure(heads_list: list[int], reps: int) -> list[dict]:
    import torch

    from bench.common import inputs, random_cache
    from graphbucket.backends.triton import TritonBackend
    from graphbucket.kernels import SplitWorkspace, default_sm_scale, launch_balanced
    from graphbucket.tuning.measure import time_replays_paired

    library_merge = launch_balanced.launch_balanced_merge
    merges = {"row_grid": row_grid_merge, "persistent": library_merge}
    backend = TritonBackend(num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    cells = shapes()
    cache = random_cache(max(sum(-(-n // 64) for n in lens) for _, lens in cells))
    sm_scale = default_sm_scale()
    rows = []
    try:
        for heads in heads_list:
            for mix, lens in cells:
                tables, q, out, seq_lens = inputs(lens, cache, heads)
                batch = len(lens)
                for kernel in backend.balanced_kernels(heads):
                    plan = backend.plan_balanced(batch, heads, kernel)
                    ws = SplitWorkspace.allocate(batch, heads, 1, 512, "cuda",
                                                 max_items=plan.max_work_items)
                    results = {}
                    for name, merge in merges.items():
                        launch_balanced.launch_balanced_merge = merge
                        out[0].fill_(float("nan"))
                        launch_balanced.mla_decode_balanced(q[0], cache, tables[0], seq_lens,
                                                            out[0], ws, plan=plan,
                                                            sm_scale=sm_scale)
                        results[name] = out[0].float().clone()
                    diff = ((results["persistent"] - results["row_grid"]).norm()
                            / results["row_grid"].norm()).item()

                    def calls(merge, tables=tables, q=q, out=out, seq_lens=seq_lens,
                              plan=plan, ws=ws):
                        def call() -> None:
                            launch_balanced.launch_balanced_merge = merge
                            for r in range(tables.shape[0]):
                                launch_balanced.mla_decode_balanced(
                                    q[r], cache, tables[r], seq_lens, out[r], ws, plan=plan,
                                    sm_scale=sm_scale, check=False, partition=r == 0)
                        return call

                    us = time_replays_paired({n: calls(m) for n, m in merges.items()},
                                             calls_per_graph=tables.shape[0], reps=reps)
                    row = {"heads": heads, "mix": mix, "kernel": kernel,
                           "plan": plan.describe(), "row_grid_us": round(us["row_grid"], 2),
                           "persistent_us": round(us["persistent"], 2),
                           "persistent_over_row_grid": round(us["persistent"] / us["row_grid"],
                                                             4),
                           "rel_diff": float(f"{diff:.3e}")}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        launch_balanced.launch_balanced_merge = library_merge
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = ["# The balanced merge: persistent programs against one program per row, head "
             f"and column block ({meta['gpu']})", "",
             f"{run_line(meta)}. Whole balanced steps (planner, stage 1, merge), interleaved "
             "CUDA-graph replays, cold L2, median microseconds per call; rel diff: the two "
             "outputs' relative L2 difference.", "",
             "| heads | mix | kernel | row grid us | persistent us | x | rel diff |",
             "|---:|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['heads']} | {r['mix']} | {r['kernel']} | {r['row_grid_us']} | "
              f"{r['persistent_us']} | {r['persistent_over_row_grid']:.3f} | {r['rel_diff']} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("merge_ab.py times CUDA graphs and needs a CUDA GPU")
    rows = measure(args.heads, args.reps)
    report_run(args.out, "merge-ab", run_meta(), rows, markdown)


if __name__ == "__main__":
    main()
