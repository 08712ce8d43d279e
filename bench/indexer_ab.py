"""Indexer logits A/B on the GPU: fp8 q and bf16 q at several tiles, stages and split
counts (issue 16; the first kernel's numbers are in bench/results/h200-indexer-ab.md).

First a check against the float64 reference of the same op at a few lengths (fp8 q:
``reference.quantize_index_q``; the bf16 path: q as given), then
CUDA-graph replays over a cold L2 (``bench/sparse_sweep.py``'s caches and timing) at
batch 1 and 8 x 128K and batch 64 x 4K; each cell is us and the fraction of the copy
bandwidth over len x 132 bytes. Under 3 minutes on an H200.

    python3 bench/indexer_ab.py [--out DIR]      # DIR/h200-indexer-ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_timing import add_out_argument, copy_gbps, out_dir, run_meta  # noqa: E402
from bench.sparse_sweep import INDEX_BYTES, Caches, rotations, timed  # noqa: E402
from graphbucket.sparse import plan_sparse_decode, quantize_index_keys  # noqa: E402
from graphbucket.sparse.indexer import launch_indexer_logits  # noqa: E402
from graphbucket.sparse.reference import indexer_logits_reference  # noqa: E402

HEADS, INDEX_HEADS, INDEX_DIM, PAGE = 16, 64, 128, 64
DEVICE = "cuda"
SHAPES = ((1, 131072, (64, 128, 256, 512)), (8, 131072, (16, 32, 64, 128, 256)),
          (64, 4096, (2, 4, 8, 16, 32)))
# name -> plan fields
VARIANTS = {"fp8 n128 s3": {"indexer_block_n": 128, "indexer_stages": 3},
            "fp8 n128 s4": {"indexer_block_n": 128, "indexer_stages": 4},
            "fp8 n64 s4": {"indexer_block_n": 64, "indexer_stages": 4},
            "bf16 n128 s3": {"indexer_block_n": 128, "indexer_stages": 3,
                             "indexer_fp8_q": False}}
CHECK_LENS = [1, 63, 64, 65, 129, 5000, 32768, 0]
TOLERANCE = {True: 2e-3, False: 1e-4}  # max |err| / max |logit| per row, by fp8 q


def launcher(name: str, rows: int, context: int):
    """fn(call inputs, logits, splits) for one variant."""
    base = replace(plan_sparse_decode(rows, HEADS, context), **VARIANTS[name])
    return lambda c, out, splits: launch_indexer_logits(
        c["index_q"], c["index_weights"], c["index_cache"], c["index_scales"],
        c["block_table"], c["seq_lens"], out, plan=base.with_splits(indexer=splits))


def check(name: str) -> tuple[float, bool]:
    """Worst max |err| / max |logit| over rows of CHECK_LENS, against float64."""
    gen = torch.Generator().manual_seed(1)
    pages = -(-max(CHECK_LENS) // PAGE)
    keys = torch.randn(pages, PAGE, INDEX_DIM, generator=gen)
    keys *= torch.rand(pages, PAGE, 1, generator=gen) + 0.5
    cache, scales = quantize_index_keys(keys)
    rows = len(CHECK_LENS)
    c = {"index_q": torch.randn(rows, INDEX_HEADS, INDEX_DIM, generator=gen).bfloat16(),
         "index_weights": torch.randn(rows, INDEX_HEADS, generator=gen) / 8,
         "index_cache": cache, "index_scales": scales,
         "block_table": torch.stack([torch.randperm(pages, generator=gen)
                                     for _ in range(rows)]).int(),
         "seq_lens": torch.tensor(CHECK_LENS, dtype=torch.int32)}
    c = {k: v.to(DEVICE) for k, v in c.items()}
    logits = torch.full((rows, max(CHECK_LENS)), float("nan"), device=DEVICE)
    fp8_q = VARIANTS[name].get("indexer_fp8_q", True)
    launcher(name, rows, max(CHECK_LENS))(c, logits, 8)
    ref = indexer_logits_reference(**c, fp8_q=fp8_q)
    worst = 0.0
    for r, n in enumerate(CHECK_LENS):
        if n:
            err = (logits[r, :n].cpu().double() - ref[r]).abs().max().item()
            worst = max(worst, err / ref[r].abs().max().item())
    return worst, worst <= TOLERANCE[fp8_q]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(ap, "h200-indexer-ab.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("indexer_ab.py times CUDA-graph replays and needs a CUDA GPU")
    torch.manual_seed(0)
    meta = {**run_meta(), "copy_gbps": round(copy_gbps(), 1)}
    print(f"# indexer A/B — {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, "
          f"copy {meta['copy_gbps']} GB/s", flush=True)
    result = {"meta": meta, "check": {}, "times": {}}
    failed = []
    for name in VARIANTS:
        worst, ok = check(name)
        result["check"][name] = worst
        print(f"check {name:16s} max err / max logit {worst:.2e} {'ok' if ok else 'FAIL'}",
              flush=True)
        if not ok:
            failed.append(name)
    caches = Caches()
    for rows, context, splits in SHAPES:
        calls = caches.inputs(rows, context, rotations(rows * context * INDEX_BYTES))
        logits = torch.empty(rows, context, device=DEVICE)
        planned = plan_sparse_decode(rows, HEADS, context).indexer_splits
        print(f"\nbatch {rows} x {context}: us (fraction of copy) by splits; planned "
              f"{planned}", flush=True)
        print(f"{'variant':18s}" + "".join(f"{s:>15d}" for s in splits), flush=True)
        for name in VARIANTS:
            fn = launcher(name, rows, context)
            cells = {}
            for s in splits:
                us = timed(calls, lambda c, s=s: fn(c, logits, s))
                cells[s] = round(us, 2)
            result["times"][f"{rows}x{context} {name}"] = cells
            frac = {s: rows * context * INDEX_BYTES / (us * 1e3) / meta["copy_gbps"]
                    for s, us in cells.items()}
            print(f"{name:18s}" + "".join(f"{cells[s]:>8.1f} ({frac[s]:.2f})" for s in splits),
                  flush=True)
    if out := out_dir(args.out):
        with open(os.path.join(out, "h200-indexer-ab.json"), "w") as f:
            json.dump(result, f, indent=1)
    if failed:
        sys.exit(f"checks failed: {failed}")


if __name__ == "__main__":
    main()
