"""Sparse MLA decode (DeepSeek-V3.2) on the GPU: indexer, top-k, sparse attention, layer.

DeepSeek-V3.2 TP8 shapes: 16 attention heads per rank, 64 index heads of 128, top-k 2048,
page 64, bf16 latent cache, fp8 index keys (132 bytes a token). CUDA-graph replays; the
cache-reading steps rotate over R calls on random pages of one large cache, so each call
finds a cold L2 (as bench/gpu_timing.py). Measured, against the issue's targets:

- indexer logits at 128K (batch 1, 8): fraction of the copy bandwidth over len x 132 bytes;
- top-k of 2048 over 128K logits (batch 1, 8): ours and torch.topk, both in a graph, the
  logits warm in L2 (the indexer just wrote them);
- sparse attention over 2048 positions at batch 1 (us) and 64 (fraction of the byte floor:
  rows x 2048 x 1152 bytes + q and out over the copy bandwidth), at every split count:
  the planned count, the best one and vLLM ROCm's ``_sparse_decode_max_split`` count;
- the layer (indexer + top-k + sparse attention) at 128K, batch 1 and 8, against the
  dense decode (``plan_mla_decode``, 16 heads) on the same cache.

    python3 bench/sparse_sweep.py --out DIR      # DIR/h200-sparse.{json,md}
    python3 bench/sparse_sweep.py --cpu-smoke    # every step at toy sizes, interpreter; its
                                                 # files go to a new temporary folder
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--cpu-smoke" in sys.argv:  # before triton is imported: it reads the flag then
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.gpu_timing import (  # noqa: E402
    add_out_argument,
    copy_gbps,
    out_dir,
    run_meta,
    time_replays,
)
from graphbucket.kernels import SplitWorkspace, default_sm_scale, mla_decode  # noqa: E402
from graphbucket.plan import plan_mla_decode  # noqa: E402
from graphbucket.sparse import (  # noqa: E402
    SparseWorkspace,
    plan_sparse_decode,
    seed_max_splits,
    sparse_mla_decode,
)
from graphbucket.sparse.attention import launch_sparse_attention  # noqa: E402
from graphbucket.sparse.indexer import launch_indexer_logits  # noqa: E402
from graphbucket.sparse.topk import launch_topk, topk_torch  # noqa: E402
from graphbucket.tuning.measure import L2_FLUSH_BYTES  # noqa: E402

HEADS, INDEX_HEADS, INDEX_DIM, PAGE = 16, 64, 128, 64
RANK, DIM = 512, 576
DEVICE, CONTEXT, TOPK, ATTENTION_BATCH = "cuda", 131072, 2048, 64
INDEX_BYTES, LATENT_BYTES = INDEX_DIM + 4, DIM * 2
MAX_ROTATIONS = 16
CACHE_TOKENS = 3 << 19  # 1.5M tokens: 1.7 GB of latent rows, 200 MB of index keys


def use_cpu_smoke() -> None:
    """Toy sizes on the CPU (Triton's interpreter): checks that every step runs."""
    global DEVICE, CONTEXT, TOPK, ATTENTION_BATCH, CACHE_TOKENS, MAX_ROTATIONS
    DEVICE, CONTEXT, TOPK, ATTENTION_BATCH, CACHE_TOKENS = "cpu", 256, 64, 2, 4096
    MAX_ROTATIONS = 1


def measure(fn, *, calls_per_graph: int) -> float:
    """Microseconds per call: graph replays on CUDA, one timed call on the CPU."""
    if DEVICE == "cuda":
        return time_replays(fn, calls_per_graph=calls_per_graph)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6 / calls_per_graph


def rotations(bytes_per_call: int) -> int:
    """Calls per graph so that one replay reads several L2s of distinct bytes."""
    return max(1, min(MAX_ROTATIONS, L2_FLUSH_BYTES // max(1, bytes_per_call)))


class Caches:
    """One latent cache and one index cache, random pages drawn per call."""

    def __init__(self):
        self.num_pages = CACHE_TOKENS // PAGE
        self.kv = torch.randn(self.num_pages, PAGE, DIM, device=DEVICE).to(torch.bfloat16)
        keys = torch.randn(self.num_pages, PAGE, INDEX_DIM, device=DEVICE)
        self.index_scales = keys.abs().amax(-1) / 448
        self.index = (keys / self.index_scales[..., None]).to(torch.float8_e4m3fn)

    def inputs(self, rows: int, context: int, calls: int) -> list[dict]:
        pages = -(-context // PAGE)
        return [{"q": torch.randn(rows, HEADS, DIM, device=DEVICE).to(torch.bfloat16),
                 "kv_cache": self.kv,
                 "index_q": torch.randn(rows, INDEX_HEADS, INDEX_DIM,
                                        device=DEVICE).to(torch.bfloat16),
                 "index_weights": torch.randn(rows, INDEX_HEADS, device=DEVICE) / 8,
                 "index_cache": self.index, "index_scales": self.index_scales,
                 "block_table": torch.randint(0, self.num_pages, (rows, pages), device=DEVICE,
                                              dtype=torch.int32),
                 "seq_lens": torch.full((rows,), context, dtype=torch.int32, device=DEVICE)}
                for _ in range(calls)]


def timed(calls: list, fn) -> float:
    return measure(lambda: [fn(c) for c in calls], calls_per_graph=len(calls))


def indexer_rows(caches: Caches, gbps: float) -> dict:
    out = {}
    for rows in (1, 8):
        calls = caches.inputs(rows, CONTEXT, rotations(rows * CONTEXT * INDEX_BYTES))
        plan = plan_sparse_decode(rows, HEADS, CONTEXT, topk=TOPK, num_sms=num_sms())
        logits = torch.empty(rows, CONTEXT, device=DEVICE)
        us = timed(calls, lambda c: launch_indexer_logits(
            c["index_q"], c["index_weights"], c["index_cache"], c["index_scales"],
            c["block_table"], c["seq_lens"], logits, plan=plan))
        frac = rows * CONTEXT * INDEX_BYTES / (us * 1e3) / gbps
        by_splits = {}
        for splits in (16, 32, 64, 128, 256, 512):
            other = plan.with_splits(indexer=splits)
            by_splits[splits] = round(timed(calls, lambda c: launch_indexer_logits(
                c["index_q"], c["index_weights"], c["index_cache"], c["index_scales"],
                c["block_table"], c["seq_lens"], logits, plan=other)), 2)
        out[rows] = {"us": round(us, 2), "frac_of_copy": round(frac, 3),
                     "splits": plan.indexer_splits, "us_by_splits": by_splits}
        print(f"indexer 128K b{rows}: {us:8.1f} us  {frac:.2f} of copy  "
              f"({plan.indexer_splits} splits); by splits {by_splits}", flush=True)
    return out


def topk_rows(caches: Caches) -> dict:
    out = {}
    for rows in (1, 8):
        c = caches.inputs(rows, CONTEXT, 1)[0]
        plan = plan_sparse_decode(rows, HEADS, CONTEXT, topk=TOPK, num_sms=num_sms())
        ws = SparseWorkspace.allocate(rows, HEADS, CONTEXT, topk=TOPK, max_splits=1,
                                      device=DEVICE)
        launch_indexer_logits(c["index_q"], c["index_weights"], c["index_cache"],
                              c["index_scales"], c["block_table"], c["seq_lens"], ws.logits,
                              plan=plan)
        args = (ws.logits, c["seq_lens"], ws.indices, ws.sparse_lens)
        ours = measure(lambda: launch_topk(*args, ws.topk, num_rows=rows), calls_per_graph=1)
        check_topk(ws, c["seq_lens"])
        theirs = measure(lambda: topk_torch(*args, num_rows=rows), calls_per_graph=1)
        out[rows] = {"us": round(ours, 2), "torch_us": round(theirs, 2)}
        print(f"top-k 2048 of 128K b{rows}: {ours:8.1f} us (torch.topk {theirs:.1f})",
              flush=True)
    return out


def check_topk(ws: SparseWorkspace, seq_lens: torch.Tensor) -> None:
    """Fail loudly: our indices are torch.topk's set (random logits: no ties)."""
    ours = ws.indices.clone()
    topk_torch(ws.logits, seq_lens, ws.indices, ws.sparse_lens, num_rows=ours.shape[0])
    for r in range(ours.shape[0]):
        a, b = set(ours[r].tolist()), set(ws.indices[r].tolist())
        if a != b:
            raise RuntimeError(f"top-k row {r}: {len(a ^ b)} positions differ from torch.topk")


def attention_rows(caches: Caches, gbps: float) -> dict:
    out = {}
    scale = default_sm_scale()
    for rows in (1, ATTENTION_BATCH):
        floor_bytes = rows * (TOPK * LATENT_BYTES + HEADS * (DIM + RANK) * 2)
        calls = caches.inputs(rows, CONTEXT, rotations(floor_bytes))
        for c in calls:
            c["indices"] = torch.rand(rows, CONTEXT, device=DEVICE).topk(TOPK).indices.to(
                torch.int32)
            c["sparse_lens"] = torch.full((rows,), TOPK, dtype=torch.int32, device=DEVICE)
        planned = plan_sparse_decode(rows, HEADS, CONTEXT, topk=TOPK, num_sms=num_sms())
        split_ws = SplitWorkspace.allocate(rows, HEADS, 64, RANK, DEVICE)
        o = torch.empty(rows, HEADS, RANK, dtype=torch.bfloat16, device=DEVICE)
        per_split = {}
        for splits in (1, 2, 4, 8, 16, 32, 64)[:(TOPK // 32).bit_length()]:
            plan = planned.with_splits(attention=splits)
            per_split[splits] = round(timed(calls, lambda c, plan=plan: launch_sparse_attention(
                c["q"], c["kv_cache"], c["block_table"], c["indices"], c["sparse_lens"], o,
                split_ws, plan=plan, sm_scale=scale)), 2)
            if not torch.isfinite(o).all():
                raise RuntimeError(f"sparse attention b{rows} splits {splits}: non-finite out")
        seed = seed_max_splits(CONTEXT, TOPK, num_sms())
        best = min(per_split, key=per_split.get)
        us = per_split[planned.attention_splits]
        floor_us = floor_bytes / (gbps * 1e3)
        out[rows] = {"us": us, "frac_of_floor": round(floor_us / us, 3),
                     "planned_splits": planned.attention_splits, "best_splits": best,
                     "best_us": per_split[best], "seed_splits": seed,
                     "seed_us": per_split.get(seed), "us_per_splits": per_split}
        print(f"sparse attention 2048 b{rows}: {us:7.1f} us planned ({planned.attention_splits}"
              f" splits), best {per_split[best]:.1f} at {best}, seed heuristic "
              f"{per_split.get(seed)} at {seed}; {floor_us / us:.2f} of floor", flush=True)
    return out


def layer_rows(caches: Caches) -> dict:
    out = {}
    scale = default_sm_scale()
    for rows in (1, 8):
        calls = caches.inputs(rows, CONTEXT, rotations(rows * CONTEXT * LATENT_BYTES))
        plan = plan_sparse_decode(rows, HEADS, CONTEXT, topk=TOPK, num_sms=num_sms())
        ws = SparseWorkspace.allocate(rows, HEADS, CONTEXT, topk=TOPK,
                                      max_splits=plan.attention_splits, device=DEVICE)
        o = torch.empty(rows, HEADS, RANK, dtype=torch.bfloat16, device=DEVICE)
        sparse_us = timed(calls, lambda c: sparse_mla_decode(
            **c, out=o, workspace=ws, plan=plan, sm_scale=scale, check=False))
        sparse_mla_decode(**calls[0], out=o, workspace=ws, plan=plan, sm_scale=scale)
        if not torch.isfinite(o).all():
            raise RuntimeError(f"sparse layer b{rows}: non-finite output")
        dense = plan_mla_decode(rows, HEADS, CONTEXT, num_sms=num_sms())
        dense_ws = SplitWorkspace.allocate(rows, HEADS, max(1, dense.num_kv_splits), RANK,
                                           DEVICE)
        dense_us = timed(calls, lambda c: mla_decode(
            c["q"], c["kv_cache"], c["block_table"], c["seq_lens"], o, dense_ws, plan=dense,
            sm_scale=scale, check=False))
        out[rows] = {"us": round(sparse_us, 2), "dense_us": round(dense_us, 2),
                     "ratio": round(sparse_us / dense_us, 3), "plan": plan.describe(),
                     "dense_plan": dense.describe()}
        print(f"layer 128K b{rows}: sparse {sparse_us:8.1f} us, dense {dense_us:8.1f} us "
              f"({sparse_us / dense_us:.2f}x)", flush=True)
    return out


def num_sms() -> int:
    if DEVICE == "cpu":
        return 8
    return torch.cuda.get_device_properties(0).multi_processor_count


def summary(indexer: dict, topk: dict, attention: dict, layer: dict) -> dict:
    """The issue's result keys from the measured rows."""
    return {"indexer_frac_of_copy_128k": indexer[1]["frac_of_copy"],
            "topk_us_128k_b1": topk[1]["us"], "topk_us_128k_b8": topk[8]["us"],
            "sparse_attention_us_b1": attention[1]["us"],
            "sparse_attention_frac_b64": attention[ATTENTION_BATCH]["frac_of_floor"],
            "layer_attention_us_128k_b1": layer[1]["us"],
            "dense_attention_us_128k_b1": layer[1]["dense_us"],
            "layer_attention_us_128k_b8": layer[8]["us"],
            "dense_attention_us_128k_b8": layer[8]["dense_us"]}


TARGETS = {"indexer_frac_of_copy_128k": (">=", 0.80), "topk_us_128k_b1": ("<=", 30.0),
           "topk_us_128k_b8": ("<=", 40.0), "sparse_attention_us_b1": ("<=", 12.0),
           "sparse_attention_frac_b64": (">=", 0.60)}


def markdown(result: dict) -> str:
    meta, keys = result["meta"], result["summary"]
    lines = [f"# Sparse MLA decode (DeepSeek-V3.2 TP8 shapes) — {meta['gpu']}", "",
             f"{meta['date']}, torch {meta['torch']}, triton {meta['triton']}, copy "
             f"{meta['copy_gbps']} GB/s. `{meta['command']}`", "",
             "| key | measured | target |", "| --- | --- | --- |"]
    targets = dict(TARGETS)
    for b, factor in ((1, 0.75), (8, 0.35)):
        targets[f"layer_attention_us_128k_b{b}"] = (
            "<=", round(factor * keys[f"dense_attention_us_128k_b{b}"], 2))
    for key, value in keys.items():
        op, bound = targets.get(key, ("", ""))
        lines.append(f"| {key} | {value} | {op} {bound} |")
    lines += ["", "Sparse attention time (us) per split count:", "",
              "| batch | " + " | ".join(str(s) for s in result["attention"]["1"]
                                       ["us_per_splits"]) + " | planned | best | seed |",
              "| --- " * (len(result["attention"]["1"]["us_per_splits"]) + 4) + "|"]
    for b, row in result["attention"].items():
        lines.append(f"| {b} | " + " | ".join(str(v) for v in row["us_per_splits"].values())
                     + f" | {row['planned_splits']} | {row['best_splits']} | "
                     f"{row['seed_splits']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_argument(ap, "h200-sparse.{json,md} (cpu-smoke-sparse.* with --cpu-smoke)",
                     smoke=True)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="toy sizes through Triton's interpreter: checks, no timings")
    args = ap.parse_args()
    if args.cpu_smoke:
        use_cpu_smoke()
    elif not torch.cuda.is_available():
        sys.exit("sparse_sweep.py times CUDA-graph replays and needs a CUDA GPU "
                 "(--cpu-smoke runs it at toy sizes on the CPU)")
    torch.manual_seed(0)
    gbps = copy_gbps() if DEVICE == "cuda" else 1.0
    caches = Caches()
    indexer = indexer_rows(caches, gbps)
    topk = topk_rows(caches)
    attention = attention_rows(caches, gbps)
    layer = layer_rows(caches)
    result = {"meta": {**run_meta(), "copy_gbps": round(gbps, 1)},
              "summary": summary(indexer, topk, attention, layer),
              "indexer": indexer, "topk": topk, "attention": attention, "layer": layer}
    result = json.loads(json.dumps(result))  # int keys -> strings, as read back
    print(markdown(result))
    if out := out_dir(args.out, smoke=args.cpu_smoke):
        path = os.path.join(out, "cpu-smoke-sparse.json" if args.cpu_smoke
                            else "h200-sparse.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.splitext(path)[0] + ".md", "w") as f:
            f.write(markdown(result))
        print(f"wrote {path} and its .md")


if __name__ == "__main__":
    main()
