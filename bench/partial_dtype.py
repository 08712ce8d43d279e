"""Split partials in the cache dtype (bf16) against float32: decode time and output error.

Stage 1 stores each split's normalised partial output in the workspace and stage 2 reads
it back; at batch 1 and 128K tokens that is 8 MB each way in float32, 11 % of the KV
bytes. This runs the same plans with a float32 and a bf16 ``partial_o`` (the kernels cast
on store and merge in float32) and reports time (cold L2, graph replays) and the rel L2
error of each against a float64 reference on a smaller case.

    python3 bench/partial_dtype.py --out bench/results   # writes h200-partial-dtype.json/.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_timing import copy_gbps, run_meta, time_replays  # noqa: E402
from graphbucket.kernels import SplitWorkspace, default_sm_scale, mla_decode  # noqa: E402
from graphbucket.plan import plan_mla_decode  # noqa: E402
from graphbucket.reference import mla_decode_reference  # noqa: E402
from graphbucket.timing import Problem, kv_bytes, rotated_calls  # noqa: E402

SHAPES = [(131072, 1), (65536, 1), (16384, 1), (4096, 1), (131072, 8), (16384, 8)]
HEADS = 16


def workspace(plan, dtype) -> SplitWorkspace:
    ws = SplitWorkspace.for_plans([plan], "cuda")
    return SplitWorkspace(ws.partial_o.to(dtype), ws.partial_lse)


def errors(dtype) -> float:
    """rel L2 of the decode output against float64, 2 requests of 20K / 3K tokens."""
    from tests.kernel_cases import KV_LORA_RANK, SM_SCALE, make_case, rel_l2

    torch.manual_seed(0)
    case = make_case([20000, 3000], HEADS, page_size=64, dtype=torch.bfloat16, device="cuda")
    plan = plan_mla_decode(2, HEADS, 20000)
    out = torch.empty(2, HEADS, KV_LORA_RANK, dtype=torch.bfloat16, device="cuda")
    mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out,
               workspace(plan, dtype), plan=plan, sm_scale=SM_SCALE)
    ref, _ = mla_decode_reference(case.q.cpu(), case.kv_cache.cpu(), case.block_table.cpu(),
                                  case.seq_lens.cpu(), kv_lora_rank=KV_LORA_RANK,
                                  sm_scale=SM_SCALE)
    return rel_l2(out.cpu(), ref)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("partial_dtype.py needs a CUDA GPU")
    copy = copy_gbps()
    meta = {**run_meta(), "copy_gbps": round(copy, 1)}
    problem, scale, rows = Problem(131072 * 8), default_sm_scale(), []
    for context, batch in SHAPES:
        tables, q, out, seq_lens = problem.inputs(context, batch)
        plan = plan_mla_decode(batch, HEADS, context)
        row = {"context": context, "batch": batch, "splits": plan.num_kv_splits}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            call = rotated_calls(problem, tables, q, out, seq_lens, workspace(plan, dtype),
                                 plan, scale)
            us = time_replays(call, calls_per_graph=tables.shape[0])
            row[f"{name}_us"] = round(us, 2)
            row[f"{name}_of_copy"] = round(kv_bytes(context, batch) / (us * 1e3) / copy, 4)
        rows.append(row)
        print(row, flush=True)
    err = {"fp32": errors(torch.float32), "bf16": errors(torch.bfloat16)}
    saved = {"meta": meta, "rows": rows, "rel_l2_vs_float64": err}
    lines = [f"# Split partials: bf16 against float32 ({meta['gpu']})", "",
             f"{meta['date']}, torch {meta['torch']}, triton {meta['triton']}, copy "
             f"{meta['copy_gbps']:.0f} GB/s. Command: `{meta['command']}`", "",
             f"Output rel L2 against float64 (20K + 3K tokens, bf16 cache): float32 partials "
             f"{err['fp32']:.2e}, bf16 partials {err['bf16']:.2e}.", "",
             "| context | batch | splits | fp32 us (of copy) | bf16 us (of copy) | fp32 / bf16 |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['context']} | {r['batch']} | {r['splits']} | {r['fp32_us']:.1f} "
              f"({100 * r['fp32_of_copy']:.0f} %) | {r['bf16_us']:.1f} "
              f"({100 * r['bf16_of_copy']:.0f} %) | {r['fp32_us'] / r['bf16_us']:.3f}x |"
              for r in rows]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "h200-partial-dtype.json"), "w") as f:
        json.dump(saved, f, indent=1)
    with open(os.path.join(args.out, "h200-partial-dtype.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
