"""Exploration 2: fused merge (last split merges) vs merge kernel, split counts, streams."""
import json, os, sys, time
from dataclasses import replace
import numpy as np
import torch
sys.path.insert(0, os.getcwd())
from bench.gpu_timing import copy_gbps, run_meta, time_replays
from bench.ragged import inputs, bytes_read
from graphbucket.kernels import SplitWorkspace, default_sm_scale, mla_decode, mla_decode_balanced
from graphbucket.plan import TOKEN_STREAM, LONG_STREAM, WIDE_STREAM, plan_mla_decode, plan_balanced_mla_decode, cdiv

HEADS, PAGE, DIM, RANK = 16, 64, 576, 512
K = 1024
SHAPES = [("uniform", [n] * b) for b, n in [(64, 256), (64, K), (64, 4 * K), (64, 16 * K), (8, 4 * K), (8, 64 * K), (8, 128 * K), (64, 128 * K), (1, 128 * K)]]
SHAPES += [("long-among-short", [131072] + [1024] * 63),
           ("spread-128k", np.linspace(1, 131072, 8).astype(int).tolist()),
           ("spread-8k", np.linspace(1, 8192, 64).astype(int).tolist())]

def variants(lens):
    b, L = len(lens), max(lens)
    base = plan_mla_decode(b, HEADS, L)
    out = [("default " + base.describe(), base)]
    splits = [1, 2, 4, 8, 16] if b == 64 else ([16, 32, 64] if b == 8 else [128, 256])
    for name, st in [("long", LONG_STREAM), ("wide", WIDE_STREAM), ("tm", TOKEN_STREAM)]:
        p = plan_mla_decode(b, HEADS, L, stream=st)
        for s in splits:
            out.append((f"{name} fused s={s}", replace(p.with_splits(s), fused_merge=True)))
            if name != "tm" and s > 1:
                out.append((f"{name} kernel s={s}", p.with_splits(s)))
    if b == 64:
        p = plan_mla_decode(b, HEADS, L, stream=LONG_STREAM)
        for w in (8,):
            for s in (2, 4, 8):
                out.append((f"long w8 fused s={s}", replace(p.with_splits(s), fused_merge=True, num_warps=w)))
        p = plan_mla_decode(b, HEADS, L, stream=WIDE_STREAM)
        for s in (4, 8):
            out.append((f"wide st3 fused s={s}", replace(p.with_splits(s), fused_merge=True, num_stages=3)))
            out.append((f"wide bn16 fused s={s}", replace(p.with_splits(s), fused_merge=True, block_n=16)))
    return out

def main():
    gbps = copy_gbps()
    all_pages = max(sum(-(-n // PAGE) for n in lens) for _, lens in SHAPES)
    cache = torch.empty(int(1.5 * all_pages) + 64, PAGE, DIM, dtype=torch.bfloat16, device="cuda").normal_()
    scale, rows = default_sm_scale(), []
    t0 = time.time()
    for mix, lens in SHAPES:
        tables, q, out, seq_lens = inputs(lens, cache)
        floor_us = bytes_read(lens) / (gbps * 1e3)
        ws = SplitWorkspace.allocate(len(lens), HEADS, 512, RANK, "cuda")
        ref = None
        for name, plan in variants(lens):
            def call(plan=plan):
                for r in range(tables.shape[0]):
                    mla_decode(q[r], cache, tables[r], seq_lens, out[r], ws, plan=plan, sm_scale=scale, check=False)
            try:
                us = time_replays(call, calls_per_graph=tables.shape[0])
                o = out[0].float().clone()
                if ref is None: ref = o
                err = ((o - ref).norm() / ref.norm()).item()
            except Exception as e:
                print("FAIL", name, repr(e)[:300], flush=True); continue
            rows.append(dict(variant=name, plan=plan.describe(), mix=mix, batch=len(lens), context=max(lens),
                             us=round(us, 2), floor_us=round(floor_us, 2), frac_of_copy=round(floor_us / us, 3), err=err))
            print(f"{time.time()-t0:5.0f}s {mix} b={len(lens)} L={max(lens)} {name[:40]:40s} {us:9.1f} us {floor_us/us:5.2f} err {err:.0e}", flush=True)
        assert (ws.merge_counters == 0).all()
        del tables, q, out, ws
    with open(os.path.join(os.environ.get("OUT", "."), "h200-fused-merge.json"), "w") as f:
        json.dump({"meta": {**run_meta(), "copy_gbps": gbps}, "rows": rows}, f, indent=1)

if __name__ == "__main__":
    main()
