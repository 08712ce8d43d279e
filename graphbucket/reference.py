"""Float reference for paged MLA decode, in plain torch (for tests and the reference backend).

Computes in float64 by default; one request at a time, gathering its pages from the
block table. Slow and simple on purpose: it is the ground truth the kernels are judged by.
"""

from __future__ import annotations

import torch


def gather_request_kv(kv_cache: torch.Tensor, block_row: torch.Tensor, seq_len: int
                      ) -> torch.Tensor:
    """The first ``seq_len`` cache rows of one request, [seq_len, D], in token order."""
    page_size = kv_cache.shape[1]
    tokens = torch.arange(seq_len, device=kv_cache.device)
    pages = block_row.long()[tokens // page_size]
    return kv_cache[pages, tokens % page_size]


def mla_decode_reference(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, *, kv_lora_rank: int, sm_scale: float,
                         dtype: torch.dtype = torch.float64
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out [B, H, kv_lora_rank], lse [B, H]) in ``dtype``.

    Rows with seq_len 0 give out = 0 and lse = -inf. Reads seq_lens on the host: not for
    the replay path.
    """
    batch, num_heads, _ = q.shape
    out = torch.zeros(batch, num_heads, kv_lora_rank, dtype=dtype, device=q.device)
    lse = torch.full((batch, num_heads), float("-inf"), dtype=dtype, device=q.device)
    for b, seq_len in enumerate(seq_lens.tolist()[:batch]):
        if seq_len == 0:
            continue
        kv = gather_request_kv(kv_cache, block_table[b], seq_len).to(dtype)
        scores = (q[b].to(dtype) @ kv.T) * sm_scale
        lse[b] = torch.logsumexp(scores, dim=-1)
        out[b] = torch.softmax(scores, dim=-1) @ kv[:, :kv_lora_rank]
    return out, lse
