"""A/B of the sparse attention's stage-1 streams over 2048 gathered positions (issue 16).

DeepSeek-V3.2 TP8 shapes (16 heads, 576-wide latent rows, page 64, top-k 2048 out of a
128K context). Every stream (``graphbucket.sparse.plan.AttentionStream``: tile, warps,
stages, gather ahead) is first checked against the float64 reference (bf16 and V3.2 fp8
caches, ragged lengths, several split counts), then timed at batch 1, 8 and 64 over the
split counts that matter: microseconds per call (CUDA-graph replays, cold L2, inputs and
helpers of ``bench/sparse_sweep.py``) and the fraction of the byte floor (rows x 2048 x
row bytes + q and out, over the copy bandwidth of the same run). ``*`` marks the split
count each stream's plan picks.

    python3 bench/sparse_attention_ab.py [--out DIR]     # DIR/h200-sparse-attention-ab.json
    python3 bench/sparse_attention_ab.py --cpu-smoke     # toy sizes, interpreter: runs;
                                                         # its file to a temporary folder
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--cpu-smoke" in sys.argv:  # before triton is imported: it reads the flag then
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench import sparse_sweep as S  # noqa: E402
from bench.gpu_timing import add_out_argument, copy_gbps, out_dir, run_meta  # noqa: E402
from graphbucket import fp8  # noqa: E402
from graphbucket.kernels import SplitWorkspace, default_sm_scale  # noqa: E402
from graphbucket.sparse import plan_sparse_decode  # noqa: E402
from graphbucket.sparse.attention import launch_sparse_attention  # noqa: E402
from graphbucket.sparse.plan import (  # noqa: E402
    GATHER_AHEAD_8W_STREAM,
    GATHER_AHEAD_64_STREAM,
    GATHER_AHEAD_STREAM,
    GATHER_STREAM,
    AttentionStream,
)
from graphbucket.sparse.reference import sparse_attention_reference  # noqa: E402

STREAMS = {
    "gather 32/4/2": GATHER_STREAM,                      # first version
    "gather 64/8/2": AttentionStream(64, 8, 2, False, 1),  # the tile alone
    "ahead 32/4/3": GATHER_AHEAD_STREAM,
    "ahead 32/8/3": GATHER_AHEAD_8W_STREAM,
    "ahead 32/4/4": AttentionStream(32, 4, 4, True, 1),  # three buffers, 130 KB
    "ahead 64/8/3": GATHER_AHEAD_64_STREAM,
}
SPLITS = {1: (16, 32, 64), 8: (8, 16, 32, 64), 64: (1, 2, 4, 8)}
V32_STREAMS = ("gather 32/4/2", "ahead 32/4/3", "ahead 64/8/3")
V32_ROW_BYTES = 656


def check(name: str, stream: AttentionStream, gen: torch.Generator) -> float:
    """Worst relative L2 error against float64 over both cache formats and split counts."""
    dev = S.DEVICE
    # The interpreter gets bf16 dots wrong: fp16 there.
    dtype = torch.bfloat16 if dev == "cuda" else torch.float16
    lens, context, topk = [2048, 2047, 97, 0, 1], 8192, 2048
    if dev == "cpu":
        lens, context, topk = [64, 63, 33, 0], 256, 64
    rows, pages = len(lens), context // S.PAGE
    num_pages = rows * pages + 8
    rows_f = torch.randn(num_pages, S.PAGE, S.DIM, generator=gen)
    table = torch.randperm(num_pages, generator=gen)[:rows * pages].view(rows, pages)
    indices = torch.full((rows, topk), -1, dtype=torch.int32)
    for r, n in enumerate(lens):
        indices[r, :n] = torch.randperm(context, generator=gen)[:n]
    q = torch.randn(rows, S.HEADS, S.DIM, generator=gen).to(dtype)
    positions = [indices[r, :n].tolist() for r, n in enumerate(lens)]
    worst = 0.0
    caches = [("bf16", rows_f.to(dtype), rows_f.to(dtype))]
    if name in V32_STREAMS:
        packed = fp8.pack_v32(rows_f)
        caches.append(("v32", packed, fp8.unpack_v32(packed)))
    for fmt, cache, values in caches:
        ref, _ = sparse_attention_reference(q, values, table, positions,
                                            kv_lora_rank=S.RANK, sm_scale=default_sm_scale())
        for splits in (1, 3, 16):
            plan = plan_sparse_decode(rows, S.HEADS, context, topk=topk,
                                      stream=stream).with_splits(attention=splits)
            out = torch.full((rows, S.HEADS, S.RANK), float("nan"), dtype=dtype, device=dev)
            launch_sparse_attention(
                q.to(dev), cache.to(dev), table.to(torch.int32).to(dev), indices.to(dev),
                torch.tensor(lens, dtype=torch.int32, device=dev), out,
                SplitWorkspace.allocate(rows, S.HEADS, splits, S.RANK, dev), plan=plan,
                sm_scale=default_sm_scale())
            err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                raise RuntimeError(f"{name} {fmt} {splits} splits: relative error {err:.3g}")
            worst = max(worst, err)
    return worst


def time_stream(stream: AttentionStream, calls: list, rows: int, splits: int) -> float:
    plan = plan_sparse_decode(rows, S.HEADS, S.CONTEXT, topk=S.TOPK,
                              stream=stream).with_splits(attention=splits)
    ws = SplitWorkspace.allocate(rows, S.HEADS, max(SPLITS[rows]), S.RANK, S.DEVICE)
    out = torch.empty(rows, S.HEADS, S.RANK, dtype=torch.bfloat16, device=S.DEVICE)
    us = S.timed(calls, lambda c: launch_sparse_attention(
        c["q"], c["kv_cache"], c["block_table"], c["indices"], c["sparse_lens"], out, ws,
        plan=plan, sm_scale=default_sm_scale()))
    if not torch.isfinite(out).all():
        raise RuntimeError(f"{plan.describe()}: non-finite output")
    return us


def batch_calls(caches: S.Caches, rows: int, row_bytes: int, kv: torch.Tensor) -> list:
    floor_bytes = rows * (S.TOPK * row_bytes + S.HEADS * (S.DIM + S.RANK) * 2)
    calls = caches.inputs(rows, S.CONTEXT, S.rotations(floor_bytes))
    for c in calls:
        c["kv_cache"] = kv
        c["indices"] = torch.rand(rows, S.CONTEXT, device=S.DEVICE).topk(S.TOPK).indices.to(
            torch.int32)
        c["sparse_lens"] = torch.full((rows,), S.TOPK, dtype=torch.int32, device=S.DEVICE)
    return calls


def sweep(caches: S.Caches, gbps: float, fmt: str, names, batches) -> list[dict]:
    kv, row_bytes = caches.kv, S.LATENT_BYTES
    if fmt == "v32":
        kv, row_bytes = fp8.pack_v32(caches.kv), V32_ROW_BYTES
    results = []
    for rows in batches:
        calls = batch_calls(caches, rows, row_bytes, kv)
        floor_us = rows * (S.TOPK * row_bytes + S.HEADS * (S.DIM + S.RANK) * 2) / (gbps * 1e3)
        for name in names:
            stream = STREAMS[name]
            planned = plan_sparse_decode(rows, S.HEADS, S.CONTEXT, topk=S.TOPK,
                                         stream=stream).attention_splits
            us = {s: round(time_stream(stream, calls, rows, s), 2) for s in SPLITS[rows]}
            best = min(us, key=us.get)
            results.append({"format": fmt, "batch": rows, "stream": name, "us": us,
                            "planned_splits": planned, "best_splits": best,
                            "best_frac_of_floor": round(floor_us / us[best], 3)})
            cells = "  ".join(f"{s}{'*' if s == planned else ' '}:{t:7.1f}"
                              for s, t in us.items())
            print(f"{fmt:4s} b{rows:<3d} {name:14s} {cells}   best {us[best]:6.1f} us "
                  f"= {floor_us / us[best]:.2f} of floor", flush=True)
        del calls
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(ap, "h200-sparse-attention-ab.json (cpu-smoke-sparse-attention-ab.json "
                         "with --cpu-smoke)", smoke=True)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="toy sizes through Triton's interpreter: checks, no timings")
    args = ap.parse_args()
    batches = (1, 8, 64)
    if args.cpu_smoke:
        S.use_cpu_smoke()
        batches = (1, 2)
        SPLITS.update({1: (1, 2), 2: (1, 2)})
    elif not torch.cuda.is_available():
        sys.exit("sparse_attention_ab.py times CUDA-graph replays and needs a CUDA GPU "
                 "(--cpu-smoke runs it at toy sizes on the CPU)")
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    errors = {name: check(name, stream, gen) for name, stream in STREAMS.items()}
    print("float64 check, worst relative L2:",
          ", ".join(f"{n} {e:.1e}" for n, e in errors.items()), flush=True)
    gbps = copy_gbps() if S.DEVICE == "cuda" else 1.0
    caches = S.Caches()
    print(f"copy {gbps:.0f} GB/s; us per call at each split count (* = the stream's plan)",
          flush=True)
    results = sweep(caches, gbps, "bf16", STREAMS, batches)
    results += sweep(caches, gbps, "v32", V32_STREAMS, batches[-1:])
    if out := out_dir(args.out, smoke=args.cpu_smoke):
        name = "cpu-smoke-sparse-attention-ab" if args.cpu_smoke else "h200-sparse-attention-ab"
        path = os.path.join(out, f"{name}.json")
        with open(path, "w") as f:
            json.dump({"meta": {**run_meta(), "copy_gbps": round(gbps, 1)},
                       "max_rel_l2": errors, "rows": results}, f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
