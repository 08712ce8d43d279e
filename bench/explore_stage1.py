"""Exploration: token-major stage 1 vs the planned kernel vs FlashInfer, one run."""
import json, os, sys, time
from dataclasses import replace
import numpy as np
import torch
sys.path.insert(0, os.getcwd())
from bench.gpu_timing import copy_gbps, run_meta, time_replays, warm_gpu
from bench import flashinfer_ref
from bench.ragged import inputs, bytes_read
from graphbucket.kernels import SplitWorkspace, default_sm_scale, mla_decode, mla_decode_balanced
from graphbucket.plan import TOKEN_STREAM, LONG_STREAM, WIDE_STREAM, plan_mla_decode, plan_balanced_mla_decode, cdiv

HEADS, PAGE, DIM, RANK = 16, 64, 576, 512
K = 1024
SHAPES = [("uniform", [n] * b) for b, n in [(1, 256), (8, 256), (64, 256), (1, K), (64, K), (1, 4 * K), (8, 4 * K), (64, 4 * K),
                                             (1, 16 * K), (1, 64 * K), (1, 128 * K), (8, 64 * K), (8, 128 * K), (64, 128 * K)]]
SHAPES += [("long-among-short", [131072] + [1024] * 63),
           ("spread-128k", np.linspace(1, 131072, 8).astype(int).tolist()),
           ("spread-8k", np.linspace(1, 8192, 64).astype(int).tolist())]

def variants(lens):
    b, L = len(lens), max(lens)
    out = [("default", plan_mla_decode(b, HEADS, L), mla_decode)]
    tm = plan_mla_decode(b, HEADS, L, stream=TOKEN_STREAM)
    tiles = cdiv(L, 64)
    cands = sorted({s for s in [1 << i for i in range(10)] if b * s <= 528 and s <= max(1, tiles)} | {1})
    for s in cands:
        out.append((f"tm s={s}", tm.with_splits(s), mla_decode))
    out.append((f"tm8 s={tm.num_kv_splits}", replace(tm, num_warps=8), mla_decode))
    out.append(("balanced", plan_balanced_mla_decode(b, HEADS), mla_decode_balanced))
    out.append(("tm balanced 132", plan_balanced_mla_decode(b, HEADS, stream=TOKEN_STREAM), mla_decode_balanced))
    out.append(("tm balanced 264", plan_balanced_mla_decode(b, HEADS, stream=TOKEN_STREAM, programs=264), mla_decode_balanced))
    return out

def main():
    gbps = copy_gbps()
    print("copy", gbps, flush=True)
    fi_reason = flashinfer_ref.available()
    print("flashinfer:", fi_reason or "available", flush=True)
    all_pages = max(sum(-(-n // PAGE) for n in lens) for _, lens in SHAPES)
    cache = torch.empty(int(1.5 * all_pages) + 64, PAGE, DIM, dtype=torch.bfloat16, device="cuda").normal_()
    scale, rows = default_sm_scale(), []
    t0 = time.time()
    for mix, lens in SHAPES:
        tables, q, out, seq_lens = inputs(lens, cache)
        floor_us = bytes_read(lens) / (gbps * 1e3)
        vs = variants(lens)
        ws = SplitWorkspace.allocate(len(lens), HEADS, 512, RANK, "cuda",
                                     max_items=max(p.max_work_items for _, p, _ in vs))
        for name, plan, launch in vs:
            def call(plan=plan, launch=launch):
                for r in range(tables.shape[0]):
                    launch(q[r], cache, tables[r], seq_lens, out[r], ws, plan=plan, sm_scale=scale, check=False)
            try:
                us = time_replays(call, calls_per_graph=tables.shape[0])
            except Exception as e:
                print("FAIL", name, repr(e)[:300], flush=True); continue
            rows.append(dict(impl="graphbucket", variant=name, plan=plan.describe(), mix=mix, batch=len(lens), context=max(lens),
                             us=round(us, 2), floor_us=round(floor_us, 2), frac_of_copy=round(floor_us / us, 3)))
            print(f"{time.time()-t0:5.0f}s {mix} b={len(lens)} L={max(lens)} {name:18s} {us:9.1f} us  {floor_us/us:5.2f}", flush=True)
        if fi_reason is None:
            try:
                ref = torch.empty_like(out)
                call = flashinfer_ref.rotated_calls(cache, tables, q, ref, seq_lens, scale)
                us = time_replays(call, calls_per_graph=tables.shape[0])
                rows.append(dict(impl="flashinfer", variant="fa3", mix=mix, batch=len(lens), context=max(lens),
                                 us=round(us, 2), floor_us=round(floor_us, 2), frac_of_copy=round(floor_us / us, 3)))
                # agreement check with graphbucket's output of the last rotation
                mla_decode(q[0], cache, tables[0], seq_lens, out[0], ws, plan=plan_mla_decode(len(lens), HEADS, max(lens)), sm_scale=scale)
                err = ((ref[0].float() - out[0].float()).norm() / out[0].float().norm()).item()
                print(f"{time.time()-t0:5.0f}s {mix} b={len(lens)} L={max(lens)} flashinfer         {us:9.1f} us  {floor_us/us:5.2f} relerr {err:.1e}", flush=True)
            except Exception as e:
                print("FI FAIL", repr(e)[:500], flush=True)
        del tables, q, out, ws
    os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "."), "h200-stage1-variants.json"), "w") as f:
        json.dump({"meta": {**run_meta(), "copy_gbps": gbps}, "rows": rows}, f, indent=1)

if __name__ == "__main__":
    main()
