"""Sparse decode in plain torch, float64: the ground truth the sparse kernels are judged by.

Reads lengths on the host (tests and benchmarks only, not for the replay path).
"""

from __future__ import annotations

import torch

from graphbucket.reference import gather_request_kv
from graphbucket.sparse.index_cache import dequantize_index_keys


def indexer_logits_reference(index_q: torch.Tensor, index_weights: torch.Tensor,
                             index_cache: torch.Tensor, index_scales: torch.Tensor,
                             block_table: torch.Tensor, seq_lens: torch.Tensor
                             ) -> list[torch.Tensor]:
    """Per row r, float64 logits [seq_lens[r]]: sum_h w_h relu(q_h . k_t) over the
    dequantized keys (stored * scale)."""
    keys = dequantize_index_keys(index_cache.cpu(), index_scales.cpu())
    rows = []
    for r, n in enumerate(seq_lens.tolist()[:index_q.shape[0]]):
        k = gather_request_kv(keys, block_table[r].cpu(), n)            # [n, 128]
        dots = index_q[r].cpu().double() @ k.T                          # [64, n]
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
