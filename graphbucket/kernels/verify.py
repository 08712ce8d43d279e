"""Multi-token decode in the flattened form: one row per query token, each its own request.

A verify step of q_len tokens per request (q [B, q_len, H, D]) can run as a plain decode of
B x q_len rows: row b * q_len + j is request b's token j with length
seq_len_b - q_len + j + 1 and request b's block table. Every KV tile is then read once per
query token (the folded form, ``mla_decode(..., q_len=)``, reads it once per request);
the sparse decode needs this form, where each row has its own index set.

``flatten_verify`` builds the flattened inputs with fixed-shape torch ops (no host reads),
so it can be captured in a graph; rows of padding requests (length 0) stay length 0.
"""

from __future__ import annotations

import torch


def flatten_verify(q: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                   q_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, q_len, H, D] (or [B, q_len * H, D]), block_table [B, P], seq_lens [B] int32
    -> q [B * q_len, H, D], block_table [B * q_len, P], seq_lens [B * q_len] int32."""
    if isinstance(q_len, bool) or not isinstance(q_len, int) or q_len < 1:
        raise ValueError(f"q_len must be a positive int, got {q_len!r}")
    bs = seq_lens.shape[0]
    if q.shape[0] != bs or (q.dim() == 3 and q.shape[1] % q_len):
        raise ValueError(f"q {tuple(q.shape)} does not hold {q_len} tokens for each of "
                         f"{bs} requests")
    q_rows = q.reshape(bs * q_len, -1, q.shape[-1])
    table = block_table[:bs].repeat_interleave(q_len, dim=0)
    offsets = torch.arange(q_len, device=seq_lens.device, dtype=torch.int32)
    limits = seq_lens[:, None] - q_len + 1 + offsets[None, :]
    # Padding requests (0) and lengths below q_len give rows with no position.
    limits = torch.where(seq_lens[:, None] > 0, limits.clamp_min(0), 0)
    return q_rows, table, limits.reshape(-1).to(torch.int32)
