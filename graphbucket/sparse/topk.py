"""Top-k token positions per row of indexer logits: a graph-safe Triton radix select.

Per row r with live length n = len_r (one program per row), writing ``indices[r, :k]``
(int32 positions) and ``sparse_lens[r] = min(n, k)``:

- n <= k: every position 0 .. n-1 in order, then -1 padding.
- n > k: the k largest logits. Each float32 logit is mapped to a uint32 key with the same
  order (``_order_key``: sign bit set for positives, all bits flipped for negatives, -0.0
  read as +0.0); the k-th largest key T is found by a most-significant-digit radix
  select, RADIX_BITS bits per pass over the row (a histogram of the next digit among the
  keys that match the digits chosen so far, then the digit whose suffix count first
  reaches the number still needed). A last pass writes, in position order, every
  position whose key is above T and the first positions whose key equals T until k are
  written. Exact, deterministic (ties at T are broken by position), and the output is
  not sorted by logit.

Passes over the row: 32 / RADIX_BITS + 1 (5 at 8 bits), all from one program, the row
(4 bytes a token) coming from L2 after the first. No host reads, fixed grid: graph-safe.

``topk_torch``: the same contract with ``torch.topk`` on masked logits (graph-safe too,
allocates temporaries); a reference and a timing baseline.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

RADIX_BITS = 8


@triton.jit
def _order_key(x):
    """float32 -> uint32 with the same order; -0.0 and +0.0 give one key (they tie)."""
    u = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) != 0, u ^ 0xFFFFFFFF, u | 0x80000000)


@triton.jit
def _radix_threshold(row_ptr, n, k, BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr):
    """(T, need): the k-th largest key of row_ptr[:n] (n > k) and how many keys equal to
    T belong to the top k (the rest of it is the keys above T)."""
    BINS: tl.constexpr = 1 << RADIX_BITS
    PASSES: tl.constexpr = 32 // RADIX_BITS
    bins = tl.arange(0, BINS)
    prefix = tl.zeros([], dtype=tl.uint32)
    need = k
    for p in tl.static_range(PASSES):
        SHIFT: tl.constexpr = 32 - RADIX_BITS * (p + 1)
        hist = tl.zeros([BINS], dtype=tl.int32)
        for c0 in range(0, n, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            live = offs < n
            key = _order_key(tl.load(row_ptr + offs, mask=live, other=0.0))
            if p > 0:  # keys whose higher digits are the ones chosen so far
                live = live & ((key >> (SHIFT + RADIX_BITS)) == (prefix >> (SHIFT + RADIX_BITS)))
            digit = ((key >> SHIFT) & (BINS - 1)).to(tl.int32)
            hist += tl.histogram(digit, BINS, mask=live)
        # at_least[b]: matching keys whose digit is >= b; at_least[0] >= need always.
        at_least = tl.cumsum(hist, 0, reverse=True)
        d = tl.max(tl.where(at_least >= need, bins, 0), 0)
        need -= tl.sum(tl.where(bins > d, hist, 0), 0)
        prefix = prefix | (d.to(tl.uint32) << SHIFT)
    return prefix, need


@triton.jit
def _topk_kernel(LOGITS, SEQ_LENS, INDICES, SPARSE_LENS, k, max_len,
                 stride_l_r, stride_i_r,
                 BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr):
    row = tl.program_id(0)
    n = tl.minimum(tl.load(SEQ_LENS + row), max_len)
    row_ptr = LOGITS + row.to(tl.int64) * stride_l_r
    out_ptr = INDICES + row.to(tl.int64) * stride_i_r
    tl.store(SPARSE_LENS + row, tl.minimum(n, k))
    if n <= k:
        for c0 in range(0, k, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            tl.store(out_ptr + offs, tl.where(offs < n, offs, -1), mask=offs < k)
    else:
        threshold, need = _radix_threshold(row_ptr, n, k, BLOCK, RADIX_BITS)
        written = 0
        equal_seen = 0
        for c0 in range(0, n, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            live = offs < n
            key = _order_key(tl.load(row_ptr + offs, mask=live, other=0.0))
            equal = live & (key == threshold)
            equal_rank = equal_seen + tl.cumsum(equal.to(tl.int32), 0) - 1
            take = (live & (key > threshold)) | (equal & (equal_rank < need))
            slot = written + tl.cumsum(take.to(tl.int32), 0) - 1
            tl.store(out_ptr + slot, offs, mask=take)
            written += tl.sum(take.to(tl.int32), 0)
            equal_seen += tl.sum(equal.to(tl.int32), 0)


def launch_topk(logits: torch.Tensor, seq_lens: torch.Tensor, indices: torch.Tensor,
                sparse_lens: torch.Tensor, *, num_rows: int, block: int = 1024) -> None:
    """indices[:num_rows, :k] and sparse_lens[:num_rows] from logits[:num_rows, :len]
    (k = indices.shape[1]; unchecked). Graph-safe: one program per row, no host reads."""
    _topk_kernel[(num_rows,)](
        logits, seq_lens, indices, sparse_lens, indices.shape[1], logits.shape[1],
        logits.stride(0), indices.stride(0),
        BLOCK=block, RADIX_BITS=RADIX_BITS, num_warps=8,
    )


def topk_torch(logits: torch.Tensor, seq_lens: torch.Tensor, indices: torch.Tensor,
               sparse_lens: torch.Tensor, *, num_rows: int) -> None:
    """``launch_topk``'s contract with ``torch.topk`` (sorted by logit, -1 padding).
    Needs logits.shape[1] >= k. Graph-safe; allocates temporaries."""
    k = indices.shape[1]
    logits, lens = logits[:num_rows], seq_lens[:num_rows]
    positions = torch.arange(logits.shape[1], device=logits.device)
    live = positions[None, :] < lens[:, None]
    masked = torch.where(live, logits, float("-inf"))
    values, found = torch.topk(masked, k, dim=1)
    indices[:num_rows] = torch.where(values > float("-inf"), found, -1).to(torch.int32)
    torch.clamp(lens, max=k, out=sparse_lens[:num_rows])
