"""Kernel sweep: MLA decode time per shape against the copy-bandwidth floor (H200).

Two tables from one run, 16 heads, bf16, page 64, every call timed as CUDA-graph replays
with a cold L2 (one graph holds R calls, each over its own random scatter of pages of one
large cache, with R chosen so that a replay touches several L2s worth of distinct KV):

- ``rows``: the planned kernel (``plan_mla_decode``; for ragged mixes also every balanced
  kernel the Triton backend offers, the tuner's candidates) and, when they are installed,
  FlashInfer's MLA decode (FA3) and FlashMLA's on the same inputs, over uniform shapes
  (context x batch at 16 heads, ``WIDE_HEADS_SHAPES`` at other head counts) and the ragged
  mixes of ``bench/ragged.py`` at every head count. The floor is the bytes actually read
  (each request's KV rows, q and out) over the copy bandwidth measured in the same run;
  ``frac_of_copy`` = floor_us / us. ``selected`` marks the plan the ladder shipped for
  this GPU (else the H200's) replays for that batch, timed as well where it is none of
  the others. A balanced plan partitions the step once per graph replay, in its first
  call, as a decode step's layers do (FlashMLA's per-layer time leaves its scheduler out
  the same way). Below 64 heads the Gluon seesaw's
  64-row split-KV programs (``stream=SEESAW_STREAM``) are timed too; ``kernel`` names the
  stage 1 that ran.
- ``split_rows``: the planned kernel at every split count of ``--splits`` (what the
  ladder tuner chooses from).

    python3 bench/kernel_sweep.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import flashinfer_ref, flashmla_ref  # noqa: E402
from bench.common import (  # noqa: E402
    DIM,
    FLOPS_PER_TOKEN_HEAD,
    HEADS,
    PAGE,
    RANK,
    WIDE_HEADS_SHAPES,
    against_floor,
    inputs,
    mixes,
    random_cache,
    time_calls,
)
from bench.gpu_timing import copy_gbps, matmul_tflops, run_line, run_meta, time_replays  # noqa: E402
from graphbucket.kernels import (  # noqa: E402
    SplitWorkspace,
    default_sm_scale,
    mla_decode,
    mla_decode_balanced,
)
from graphbucket.kernels.launch import launch_merge, runs_seesaw  # noqa: E402
from graphbucket.plan import (  # noqa: E402
    plan_mla_decode,
)
from graphbucket.plan_streams import SEESAW_STREAM  # noqa: E402
from graphbucket.select import GraphSelector  # noqa: E402
from graphbucket.tuning.measure import Problem, rotated_calls  # noqa: E402
from graphbucket.tuning.shipped import find_tuned_ladder  # noqa: E402

CONTEXTS = [1, 64, 256, 1024, 4096, 16384, 65536, 131072]
BATCHES = [1, 8, 64]
SPLITS = [1 << i for i in range(10)]  # 1 .. 512


def kv_bytes(context: int, batch: int) -> int:
    q_and_out = batch * HEADS * (DIM + RANK) * 2
    return batch * context * DIM * 2 + q_and_out


def shapes(contexts: list[int], batches: list[int],
           heads: list[int]) -> list[tuple[int, str, list[int]]]:
    """(heads, mix, lengths): 16 heads over contexts x batches, other head counts over
    WIDE_HEADS_SHAPES; the ragged mixes at every head count."""
    out = []
    for h in heads:
        if h == HEADS:
            out += [(h, "uniform", [c] * b) for c in contexts for b in batches]
        else:
            out += [(h, "uniform", [c] * b) for b, c in WIDE_HEADS_SHAPES]
        out += [(h, name, lens) for name, lens in mixes() if name != "uniform"]
    return out


def balanced_variants(batch: int, heads: int) -> list:
    """Every balanced kernel the Triton backend offers at ``heads`` (the tuner's and the
    oracle's candidates), planned for ``batch`` requests on this GPU."""
    from graphbucket.backends.triton import TritonBackend

    backend = TritonBackend(num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    return [(backend.plan_balanced(batch, heads, k), mla_decode_balanced)
            for k in backend.balanced_kernels(heads)]


def ladder_choice(lens: list[int], heads: int):
    """The plan the ladder shipped for this GPU (else the H200's) replays for ``lens``;
    None where no ladder ships for ``heads``."""
    from bench.ladder_oracle import ladder_plan
    from graphbucket.backends.triton import TritonBackend

    props = torch.cuda.get_device_properties(0)
    ladder = (find_tuned_ladder(props.name, heads, 131072)
              or find_tuned_ladder("NVIDIA H200", heads, 131072))
    if ladder is None:
        return None
    backend = TritonBackend(num_sms=props.multi_processor_count)
    return ladder_plan(GraphSelector(ladder, [len(lens)]), backend, heads, lens)


def compare(args) -> list[dict]:
    """Planned graphbucket kernels and FlashInfer per shape (``rows``)."""
    all_shapes = shapes(args.contexts, args.batches, args.heads)
    pages = max(sum(-(-n // PAGE) for n in lens) for _, _, lens in all_shapes)
    # 1.5x the largest shape: rotations of scattered pages for the small ones.
    cache = random_cache(pages)
    why_not = flashinfer_ref.available() if args.flashinfer else "--no-flashinfer"
    print(f"flashinfer: {why_not or 'available'}", flush=True)
    mla_why_not = flashmla_ref.available() if args.flashmla else "--no-flashmla"
    print(f"flashmla: {mla_why_not or 'available'}", flush=True)
    rows, scale = [], default_sm_scale()
    for i, (heads, mix, lens) in enumerate(all_shapes):
        tables, q, out, seq_lens = inputs(lens, cache, heads)
        batch, context = len(lens), max(lens)
        variants = [(plan_mla_decode(batch, heads, context), mla_decode)]
        if mix != "uniform":
            variants += balanced_variants(batch, heads)
        if heads < 64:  # the Gluon seesaw's 64-row programs holding fewer heads (not default)
            variants.append((plan_mla_decode(batch, heads, context, stream=SEESAW_STREAM),
                             mla_decode))
        picked = ladder_choice(lens, heads)
        if picked is not None and picked.describe() not in {p.describe() for p, _ in variants}:
            variants.append((picked, mla_decode_balanced if picked.balanced else mla_decode))
        ws = SplitWorkspace.allocate(batch, heads, max(p.num_kv_splits for p, _ in variants),
                                     RANK, "cuda",
                                     max_items=max(p.max_work_items for p, _ in variants))
        shape = {"heads": heads, "batch": batch, "context": context, "mix": mix}
        floors = {"gbps": args.copy_gbps, "lens": lens, "heads": heads, "tflops": args.tflops}
        for plan, launch in variants:
            us = time_calls(launch, plan, cache, tables, q, out, seq_lens, ws, scale)
            kernel = "gluon-seesaw" if runs_seesaw(plan, q[0], cache) else "triton"
            rows.append({"impl": "graphbucket", **shape, "topology": plan.describe(),
                         "kernel": kernel, "selected": picked is not None
                         and plan.describe() == picked.describe(),
                         **against_floor(us=us, **floors)})
        if why_not is None:
            ref = torch.empty_like(out)
            call = flashinfer_ref.rotated_calls(cache, tables, q, ref, seq_lens, scale)
            us = time_replays(call, calls_per_graph=tables.shape[0])
            # Same inputs, so the outputs must agree (bf16 rounding apart).
            err = ((ref[0].float() - out[0].float()).norm() / out[0].float().norm()).item()
            rows.append({"impl": "flashinfer", **shape, "topology": "fa3",
                         **against_floor(us=us, **floors),
                         "rel_diff_to_graphbucket": round(err, 5)})
        if mla_why_not is None:
            rows.append(flashmla_row(cache, tables, q, out, seq_lens, scale, shape, floors))
        done = [r for r in rows if (r["heads"], r["mix"], r["batch"], r["context"])
                == (heads, mix, batch, context)]
        print(f"[{i + 1}/{len(all_shapes)}] h={heads} {mix} b={batch} ctx={context} " + "  ".join(
            f"{r['impl']} {r['us']:.1f} us ({100 * r['frac_of_copy']:.0f} %)" for r in done),
            flush=True)
        del tables, q, out, ws
    return rows


def flashmla_row(cache, tables, q, out, seq_lens, scale, shape, floors) -> dict:
    """FlashMLA's dense decode on the same inputs (metadata computed before the timed
    graph, as an engine computes it once per step), checked against graphbucket's output."""
    try:
        call, outputs = flashmla_ref.rotated_calls(cache, tables, q, seq_lens, scale)
        us = time_replays(call, calls_per_graph=tables.shape[0])
        call()
    except Exception as exc:  # a shape FlashMLA does not take: say so in the row
        return {"impl": "flashmla", **shape, "error": f"{type(exc).__name__}: {exc}"[:200]}
    got = outputs[0].float()
    err = ((got - out[0].float()).norm() / out[0].float().norm()).item()
    return {"impl": "flashmla", **shape, "topology": "flashmla",
            **against_floor(us=us, **floors), "rel_diff_to_graphbucket": round(err, 5)}


def _ref_cells(ref: dict | None, r: dict, frac: str) -> str:
    if not ref or "us" not in ref:
        return "- | - | -"
    return f"{ref['us']:.1f} | {100 * ref.get(frac, 0):.0f} % | {ref['us'] / r['us']:.2f}x"


def sweep(args) -> list[dict]:
    problem = Problem(max(args.contexts) * max(args.batches), max_requests=max(args.batches))
    max_splits = max(args.splits)
    ws = SplitWorkspace.allocate(max(args.batches), HEADS, max_splits, RANK, "cuda")
    rows, scale = [], default_sm_scale()
    total = len(args.contexts) * len(args.batches) * (len(args.splits) + 1)
    for context in args.contexts:
        for batch in args.batches:
            tables, q, out, seq_lens = problem.inputs(context, batch)
            rotations = tables.shape[0]
            base = plan_mla_decode(batch, HEADS, context)
            # The plan's own split count is timed too, so every shape has a planned row.
            for splits in sorted(set(args.splits) | {base.num_kv_splits}):
                plan = base.with_splits(splits)

                call = rotated_calls(problem, tables, q, out, seq_lens, ws, plan, scale)
                us = time_replays(call, calls_per_graph=rotations)
                gbps = kv_bytes(context, batch) / (us * 1e3)
                rows.append({"context": context, "batch": batch, "heads": HEADS,
                             "splits": splits, "planned_splits": base.num_kv_splits,
                             "us": round(us, 3), "gbps": round(gbps, 1),
                             "frac_of_copy": round(gbps / args.copy_gbps, 4)})
                print(f"[{len(rows)}/{total}] ctx={context} b={batch} splits={splits} "
                      f"{us:.2f} us {gbps:.0f} GB/s", flush=True)
    return rows


def time_merge(plan) -> float:
    """Stage 2 alone at a long context (every split live), over random partials."""
    ws = SplitWorkspace.allocate(plan.batch_size, plan.num_heads, plan.num_kv_splits,
                                 plan.kv_lora_rank, "cuda")
    ws.partial_o.normal_()
    ws.partial_lse.normal_()
    seq_lens = torch.full((plan.batch_size,), 131072, dtype=torch.int32, device="cuda")
    out = torch.empty(plan.batch_size, HEADS, RANK, dtype=torch.bfloat16, device="cuda")
    return time_replays(lambda: launch_merge(seq_lens, out, ws, plan=plan, lse=None),
                        calls_per_graph=1)


def merge_cost(splits_list: list[int]) -> list[dict]:
    """Stage 2 alone at batch 1 for each split count."""
    rows = []
    for splits in splits_list:
        plan = plan_mla_decode(1, HEADS, 1 << 20, max_splits=splits).with_splits(splits)
        rows.append({"splits": splits, "batch": 1, "heads": HEADS,
                     "merge_us": round(time_merge(plan), 3)})
    return rows


def best_rows(rows: list[dict]) -> list[dict]:
    best = {}
    for row in rows:
        key = (row["context"], row["batch"])
        if key not in best or row["us"] < best[key]["us"]:
            best[key] = row
    planned = {(r["context"], r["batch"]): r for r in rows if r["splits"] == r["planned_splits"]}
    out = []
    for key, row in sorted(best.items()):
        p = planned.get(key)
        out.append({**row, "plan_splits": p["splits"] if p else None,
                    "plan_us": p["us"] if p else None})
    return out


def short(topology: str) -> str:
    """A plan's description without its grid and head block."""
    return re.sub(r"grid=\([^)]*\) |block_h=\d+ ", "", topology)


def comparison_table(rows: list[dict]) -> list[str]:
    """One line per shape: graphbucket's planned (and balanced) kernels against FlashInfer."""
    lines = ["| mix | batch | context | graphbucket us | of copy | topology | FlashInfer us | "
             "of copy | FlashInfer / graphbucket | FlashMLA us | of copy | "
             "FlashMLA / graphbucket |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["mix"] != "uniform", r["mix"], r["batch"], r["context"]) for r in rows
                   if r["heads"] == HEADS})
    for _, mix, batch, context in keys:
        same = [r for r in rows if (r["heads"], r["mix"], r["batch"], r["context"])
                == (HEADS, mix, batch, context)]
        fi = next((r for r in same if r["impl"] == "flashinfer"), None)
        fm = next((r for r in same if r["impl"] == "flashmla"), None)
        for r in (r for r in same if r["impl"] == "graphbucket"):
            pick = " (ladder)" if r.get("selected") else ""
            lines.append(f"| {mix} | {batch} | {context} | {r['us']:.1f} | "
                         f"{100 * r['frac_of_copy']:.0f} % | {short(r['topology'])}{pick} | "
                         f"{_ref_cells(fi, r, 'frac_of_copy')} | "
                         f"{_ref_cells(fm, r, 'frac_of_copy')} |")
    return lines


def wide_heads_table(rows: list[dict]) -> list[str]:
    """Head counts other than 16 (the compute-bound decode): time against both floors."""
    wide = [r for r in rows if r["heads"] != HEADS]
    if not wide:
        return []
    lines = ["", "Compute-bound decode (every head on one GPU): of compute = FLOPs "
             f"({FLOPS_PER_TOKEN_HEAD} per token and head) over the bf16 matmul rate measured "
             "in the same run, divided by the time.", "",
             "| heads | mix | batch | context | graphbucket us | of copy | of compute | "
             "topology | FlashInfer us | of compute | FlashInfer / graphbucket | FlashMLA us | "
             "of compute | FlashMLA / graphbucket |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for h, m, b, c in sorted({(r["heads"], r["mix"], r["batch"], r["context"]) for r in wide}):
        same = [r for r in wide if (r["heads"], r["mix"], r["batch"], r["context"])
                == (h, m, b, c)]
        fi = next((r for r in same if r["impl"] == "flashinfer"), None)
        fm = next((r for r in same if r["impl"] == "flashmla"), None)
        for r in (r for r in same if r["impl"] == "graphbucket"):
            pick = " (ladder)" if r.get("selected") else ""
            lines.append(f"| {h} | {m} | {b} | {c} | {r['us']:.1f} | "
                         f"{100 * r['frac_of_copy']:.0f} % "
                         f"| {100 * r.get('frac_of_compute', 0):.0f} % | "
                         f"{short(r['topology'])}{pick} | "
                         f"{_ref_cells(fi, r, 'frac_of_compute')} | "
                         f"{_ref_cells(fm, r, 'frac_of_compute')} |")
    return lines


def markdown(meta: dict, rows: list[dict], split_rows: list[dict], merges: list[dict]) -> str:
    lines = [f"# MLA decode kernel sweep ({meta['gpu']})", "",
             run_line(meta, f"bf16 matmul {meta['matmul_tflops']:.0f} TFLOP/s"
                      if meta.get("matmul_tflops") else ""),
             "", "16 heads, bf16, page 64, cold L2, CUDA-graph replay. Of copy = the bytes "
             "actually read over the copy bandwidth, divided by the time. FlashInfer / "
             "graphbucket > 1: graphbucket is faster. (ladder): the topology the shipped "
             "ladder replays for that ragged batch.", ""]
    lines += comparison_table(rows) if rows else ["(no comparison rows in this run)"]
    wide = wide_heads_table(rows)
    run = meta.get("heads_128_run")
    if wide and run:
        wide[2:2] = ["", f"(From the run of {run['date']}, copy {run['copy_gbps']:.0f} GB/s, bf16 "
                     f"matmul {run['matmul_tflops']:.0f} TFLOP/s: {run['note']}.)"]
    lines += wide
    if split_rows:
        run = meta.get("split_table_run")
        lines += ["", "Best split count per shape (the planned kernel, splits swept):", ""]
        if run:
            lines += [f"(From the run of {run['date']}, copy {run['copy_gbps']:.0f} GB/s: "
                      f"{run['note']}.)", ""]
        lines += ["| context | batch | best splits | us | GB/s | of copy | planned splits | "
                  "planned us |", "|---|---|---|---|---|---|---|---|"]
        for r in best_rows(split_rows):
            plan_us = "-" if r["plan_us"] is None else f"{r['plan_us']:.1f}"
            lines.append(f"| {r['context']} | {r['batch']} | {r['splits']} | {r['us']:.1f} | "
                         f"{r['gbps']:.0f} | {100 * r['frac_of_copy']:.0f} % | "
                         f"{r['planned_splits']} | {plan_us} |")
    if merges:
        lines += ["", "Stage 2 (merge kernel) alone, batch 1:", "", "| splits | us |",
                  "|---|---|"]
        lines += [f"| {m['splits']} | {m['merge_us']:.2f} |" for m in merges]
    return "\n".join(lines) + "\n"


def main() -> None:
    from bench.gpu_timing import add_out_argument, out_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(ap, "h200-kernel-sweep.{json,md}")
    ap.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS)
    ap.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    ap.add_argument("--splits", type=int, nargs="*", default=SPLITS,
                    help="split counts of the split table (none: skip it)")
    ap.add_argument("--heads", type=int, nargs="+", default=[HEADS, 128],
                    help="head counts: 16 over contexts x batches and ragged mixes, others "
                         "over the compute-bound shapes (default: %(default)s)")
    ap.add_argument("--no-flashinfer", dest="flashinfer", action="store_false",
                    help="leave FlashInfer out even when it is installed")
    ap.add_argument("--no-flashmla", dest="flashmla", action="store_false",
                    help="leave FlashMLA out even when flash_mla imports")
    ap.add_argument("--render", metavar="JSON", help="only rewrite the markdown of a saved run")
    args = ap.parse_args()
    if args.render:
        with open(args.render) as f:
            saved = json.load(f)
        with open(os.path.splitext(args.render)[0] + ".md", "w") as f:
            f.write(markdown(saved["meta"], saved["rows"], saved.get("split_rows", []),
                             saved["merge"]))
        return
    if not torch.cuda.is_available():
        sys.exit("kernel_sweep.py times CUDA-graph replays and needs a CUDA GPU")
    torch.manual_seed(0)
    args.copy_gbps = copy_gbps()
    args.tflops = matmul_tflops()
    meta = {**run_meta(), "copy_gbps": round(args.copy_gbps, 1),
            "matmul_tflops": round(args.tflops, 1)}
    print(f"copy bandwidth {args.copy_gbps:.0f} GB/s on {meta['gpu']}", flush=True)
    rows = compare(args)
    split_rows = sweep(args) if args.splits else []
    merges = merge_cost([32, 64, 128, 256, 512]) if args.splits else []
    text = markdown(meta, rows, split_rows, merges)
    print(text)
    if out := out_dir(args.out):
        with open(os.path.join(out, "h200-kernel-sweep.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows, "split_rows": split_rows, "merge": merges},
                      f, indent=1)
        with open(os.path.join(out, "h200-kernel-sweep.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
