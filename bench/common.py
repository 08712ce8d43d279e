"""What the kernel benches share: the ragged mixes, scattered-page inputs over one large
cache (enough distinct KV per graph replay to evict the L2), the bytes a decode reads, and
timing a launcher against the copy and compute floors.
"""

from __future__ import annotations

import numpy as np
import torch

from bench.gpu_timing import time_replays
from graphbucket.tuning.measure import L2_FLUSH_BYTES, MAX_ROTATIONS, check_pages

HEADS, PAGE, DIM, RANK = 16, 64, 576, 512
# 128 heads (data-parallel attention: every head on one GPU): compute-bound shapes.
WIDE_HEADS_SHAPES = [(1, 4096), (1, 16384), (1, 65536), (1, 131072), (8, 65536), (8, 131072),
                     (64, 4096), (64, 131072)]
# FLOPs per token and head: q.k over 576 columns and p.v over 512, a multiply-add each.
FLOPS_PER_TOKEN_HEAD = 2 * (DIM + RANK)


def mixes() -> list[tuple[str, list[int]]]:
    """(mix, lengths): the ragged mixes of bench/ragged.py and the uniform shapes beside them."""
    uniform = [(1, 65536), (1, 131072), (8, 131072), (64, 1024), (64, 4096)]
    return [("long-among-short", [131072] + [1024] * 63),
            ("spread-128k", np.linspace(1, 131072, 8).astype(int).tolist()),
            ("spread-8k", np.linspace(1, 8192, 64).astype(int).tolist()),
            *(("uniform", [n] * b) for b, n in uniform)]


def bytes_read(lens: list[int], heads: int = HEADS) -> int:
    return sum(lens) * DIM * 2 + len(lens) * heads * (DIM + RANK) * 2


def random_cache(pages: int) -> torch.Tensor:
    """A bf16 N(0, 1) cache 1.5x the largest shape's pages (+64): room for several
    rotations of scattered pages for the smaller shapes (``inputs``)."""
    return torch.empty(pages * 3 // 2 + 64, PAGE, DIM, dtype=torch.bfloat16,
                       device="cuda").normal_()


def inputs(lens: list[int], cache: torch.Tensor, heads: int = HEADS):
    """R rotations of scattered block tables over ``cache`` (each its own pages), q, out,
    seq_lens: enough distinct KV per graph replay to evict the L2."""
    pages = [-(-n // PAGE) for n in lens]
    per_call = sum(pages)
    check_pages(per_call, cache.shape[0])
    rotations = max(1, min(MAX_ROTATIONS, L2_FLUSH_BYTES // bytes_read(lens, heads),
                           cache.shape[0] // per_call))
    perm = torch.randperm(cache.shape[0], device="cuda")[: rotations * per_call].int()
    tables = torch.zeros(rotations, len(lens), max(pages), dtype=torch.int32, device="cuda")
    for r in range(rotations):
        chunk = perm[r * per_call:(r + 1) * per_call].split(pages)
        for b, row in enumerate(chunk):
            tables[r, b, :row.numel()] = row
    q = torch.randn(rotations, len(lens), heads, DIM, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(rotations, len(lens), heads, RANK, dtype=torch.bfloat16, device="cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return tables, q, out, seq_lens


def time_calls(launch, plan, cache, tables, q, out, seq_lens, ws, scale) -> float:
    """us per call of ``launch`` over the rotations; a balanced plan partitions the step in
    the first call only, as the layers of a decode step do (per layer, as FlashMLA's time
    beside it leaves out its scheduler)."""
    def call():
        for r in range(tables.shape[0]):
            extra = {"partition": r == 0} if plan.balanced else {}
            launch(q[r], cache, tables[r], seq_lens, out[r], ws, plan=plan, sm_scale=scale,
                   check=False, **extra)
    return time_replays(call, calls_per_graph=tables.shape[0])


def against_floor(gbps: float, lens: list[int], us: float, heads: int = HEADS,
                  tflops: float | None = None) -> dict:
    """Time against the copy floor (bytes read) and, with ``tflops``, the compute floor."""
    floor_us = bytes_read(lens, heads) / (gbps * 1e3)
    row = {"us": round(us, 3), "floor_us": round(floor_us, 3),
           "frac_of_copy": round(floor_us / us, 4)}
    if tflops:
        compute_us = sum(lens) * heads * FLOPS_PER_TOKEN_HEAD / (tflops * 1e6)
        row.update(compute_floor_us=round(compute_us, 3),
                   frac_of_compute=round(compute_us / us, 4))
    return row
