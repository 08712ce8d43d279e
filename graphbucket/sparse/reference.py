"""Sparse decode in plain torch, float64: the ground truth the sparse kernels are judged by.

Reads lengths on the host (tests and benchmarks only, not for the replay path).
"""

from __future__ import annotations

import torch

from graphbucket.fp8 import FP8_DTYPE, FP8_MAX, V32_MIN_SCALE
from graphbucket.reference import gather_request_kv
from graphbucket.sparse.index_cache import dequantize_index_keys


def quantize_index_q(index_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's fp8 q, as its kernel computes it: q [..., 128] -> (e4m3 [..., 128],
    float32 scale per head [...]), ``scale = max(amax / 448, 2**-126)`` and
    ``q * (1 / scale)`` rounded to the nearest e4m3 (float32 arithmetic throughout)."""
    q = index_q.float()
    scale = (q.abs().amax(-1) / FP8_MAX).clamp_min(V32_MIN_SCALE)
    return (q * (1.0 / scale)[..., None]).to(FP8_DTYPE), scale


def indexer_q_values(index_q: torch.Tensor, *, fp8_q: bool) -> torch.Tensor:
    """float64 q [..., 128] the indexer multiplies: q as given, or with ``fp8_q`` its
    e4m3 rounding times the head's scale (the kernel folds the scale into w; the same
    number in float64)."""
    if not fp8_q:
        return index_q.double()
    stored, scale = quantize_index_q(index_q)
    return stored.double() * scale.double()[..., None]


def indexer_logits_reference(index_q: torch.Tensor, index_weights: torch.Tensor,
                             index_cache: torch.Tensor, index_scales: torch.Tensor,
                             block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                             fp8_q: bool = True) -> list[torch.Tensor]:
    """Per row r, float64 logits [seq_lens[r]]: sum_h w_h relu(q_h . k_t) over the
    dequantized keys (stored * scale), q as the kernel takes it (``indexer_q_values``;
    ``fp8_q`` as ``SparsePlan.indexer_fp8_q``)."""
    keys = dequantize_index_keys(index_cache.cpu(), index_scales.cpu())
    q_rows = indexer_q_values(index_q.cpu(), fp8_q=fp8_q)
    rows = []
    for r, n in enumerate(seq_lens.tolist()[:index_q.shape[0]]):
        k = gather_request_kv(keys, block_table[r].cpu(), n)            # [n, 128]
        dots = q_rows[r] @ k.T                                          # [64, n]
        rows.append((dots.clamp_min(0) * index_weights[r].cpu().double()[:, None]).sum(0))
    return rows


def topk_reference(logits: list[torch.Tensor], topk: int) -> list[set[int]]:
    """The positions of each row's ``topk`` largest logits (all positions when shorter)."""
    return [set(torch.topk(row, min(topk, row.numel())).indices.tolist()) for row in logits]


def sparse_attention_reference(q: torch.Tensor, kv_rows: torch.Tensor,
                               block_table: torch.Tensor, positions: list[list[int]], *,
                               kv_lora_rank: int, sm_scale: float
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (out [R, H, kv_lora_rank], lse [R, H]) of each row over its positions.

    kv_rows: the cache as values, [num_pages, page_size, D] (e.g. ``fp8.unpack_v32``).
    A row with no position gives zeros and lse -inf.
    """
    rows, heads, _ = q.shape
    kv_rows, table = kv_rows.cpu().double(), block_table.cpu().long()
    page_size = kv_rows.shape[1]
    out = torch.zeros(rows, heads, kv_lora_rank, dtype=torch.float64)
    lse = torch.full((rows, heads), float("-inf"), dtype=torch.float64)
    for r, pos in enumerate(positions):
        if not pos:
            continue
        pos = torch.tensor(sorted(pos))
        kv = kv_rows[table[r, pos // page_size], pos % page_size]       # [n, D]
        scores = (q[r].cpu().double() @ kv.T) * sm_scale
        lse[r] = torch.logsumexp(scores, -1)
        out[r] = torch.softmax(scores, -1) @ kv[:, :kv_lora_rank]
    return out, lse
