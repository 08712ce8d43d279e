"""Decode-batch projections of one MLA layer: library GEMM/BMM against the skinny kernels.

Per weight of the preset's layer (q/kv down-projection, q up-projection, the per-head
absorbed products, o_proj, MLP) and batch size: time per call of ``F.linear`` /
``torch.bmm`` and of ``graphbucket.models.gemv`` over a cold L2 (a graph of calls on
distinct weight copies, > 4 L2s in all), and the weight bytes over that time.

    python3 bench/projections.py --out bench/results      # writes h200-projections.json/.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_timing import copy_gbps, rerender, run_meta, time_replays  # noqa: E402
from graphbucket.models import PRESETS  # noqa: E402
from graphbucket.models.gemv import skinny_bmm, skinny_linear  # noqa: E402
from graphbucket.timing import L2_FLUSH_BYTES  # noqa: E402


def shapes(cfg) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, kind, weight shape) of one layer, as ``models/mla.py`` multiplies them."""
    h, d = cfg.num_heads, cfg.hidden_size
    return [("qkv_a", "linear", (cfg.q_lora_rank + cfg.kv_dim, d)),
            ("q_b", "linear", (h * cfg.qk_head_dim, cfg.q_lora_rank)),
            ("w_uk", "bmm", (h, cfg.qk_nope_dim, cfg.kv_lora_rank)),
            ("w_uv", "bmm", (h, cfg.kv_lora_rank, cfg.v_head_dim)),
            ("o_proj", "linear", (d, h * cfg.v_head_dim)),
            ("gate_up", "linear", (2 * cfg.intermediate_size, d)),
            ("down", "linear", (d, cfg.intermediate_size))]


def time_one(kind: str, shape: tuple[int, ...], batch: int, impl: str) -> float:
    nbytes = 2 * torch.Size(shape).numel()
    copies = max(2, min(64, -(-L2_FLUSH_BYTES // nbytes)))
    ws = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    if kind == "linear":
        x = torch.randn(batch, shape[1], device="cuda", dtype=torch.bfloat16)
        fn = skinny_linear if impl == "skinny" else F.linear
    else:  # x as the model builds it: [B, H, K] viewed as [H, B, K]
        x = torch.randn(batch, shape[0], shape[1], device="cuda",
                        dtype=torch.bfloat16).transpose(0, 1)
        fn = skinny_bmm if impl == "skinny" else torch.bmm

    def calls():
        for w in ws:
            fn(x, w)
    return time_replays(calls, calls_per_graph=copies)


def markdown(saved: dict) -> str:
    meta = saved["meta"]
    lines = [f"# Decode-batch projections ({meta['gpu']}, {meta['model']} layer)", "",
             f"{meta['date']}, torch {meta['torch']}, triton {meta['triton']}, copy "
             f"{meta['copy_gbps']:.0f} GB/s. Command: `{meta['command']}`", "",
             "| weight | shape | batch | torch us (GB/s) | skinny us (GB/s) | torch / skinny |",
             "|---|---|---|---|---|---|"]
    for r in saved["rows"]:
        lines.append(f"| {r['name']} | {'x'.join(map(str, r['shape']))} | {r['batch']} | "
                     f"{r['torch_us']:.1f} ({r['torch_gbps']:.0f}) | {r['skinny_us']:.1f} "
                     f"({r['skinny_gbps']:.0f}) | {r['torch_us'] / r['skinny_us']:.2f}x |")
    for b in sorted({r["batch"] for r in saved["rows"]}):
        rows = [r for r in saved["rows"] if r["batch"] == b]
        t, s = sum(r["torch_us"] for r in rows), sum(r["skinny_us"] for r in rows)
        lines.append(f"| one layer | | {b} | {t:.1f} | {s:.1f} | {t / s:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--preset", default="deepseek-v3-tp8", choices=sorted(PRESETS))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--render", metavar="JSON", help="only rewrite the markdown of a saved run")
    args = ap.parse_args()
    if args.render:
        return rerender(args.render, markdown)
    if not torch.cuda.is_available():
        sys.exit("projections.py times CUDA kernels and needs a CUDA GPU")
    cfg = PRESETS[args.preset]()
    meta = {**run_meta(), "model": cfg.name, "copy_gbps": round(copy_gbps(), 1)}
    rows = []
    for batch in args.batches:
        for name, kind, shape in shapes(cfg):
            us = {impl: time_one(kind, shape, batch, impl) for impl in ("torch", "skinny")}
            gb = 2 * torch.Size(shape).numel() / 1e3
            rows.append({"name": name, "kind": kind, "shape": list(shape), "batch": batch,
                         "torch_us": round(us["torch"], 2), "skinny_us": round(us["skinny"], 2),
                         "torch_gbps": round(gb / us["torch"], 1),
                         "skinny_gbps": round(gb / us["skinny"], 1)})
            print(rows[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    saved = {"meta": meta, "rows": rows}
    with open(os.path.join(args.out, "h200-projections.json"), "w") as f:
        json.dump(saved, f, indent=1)
    with open(os.path.join(args.out, "h200-projections.md"), "w") as f:
        f.write(markdown(saved))
    print(markdown(saved))


if __name__ == "__main__":
    main()
