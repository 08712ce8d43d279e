"""Top-k token positions per row of indexer logits: a graph-safe parallel radix select.

Per row r with live length n = len_r, writing ``indices[r, :k]`` (int32 positions) and
``sparse_lens[r] = min(n, k)``:

- n <= k: every position 0 .. n-1 in order, then -1 padding.
- n > k: the k largest logits, in position order. Each float32 logit maps to a uint32 key
  with the same order (``_order_key``: sign bit set for positives, all bits flipped for
  negatives, -0.0 read as +0.0). The k-th largest key T is found by a most-significant-
  digit radix select in three passes of 11, 11 and 10 bits: ``num_chunks`` programs per
  row histogram the next digit of their chunk's keys that match the digits chosen so
  far (shared-memory histogram, then one atomic add per non-empty bin into the row's
  histogram), and one program per row picks the digit whose suffix count first reaches
  the number still needed (and clears the histogram for the next pass). Then every chunk
  counts its keys above T and equal to T, and each chunk writes its positions at the
  offset of the chunks before it: keys above T, and the first ``need`` keys equal to T
  in position order. Exact and deterministic (ties at T go to the lowest positions).

Eight launches with fixed grids, no host reads: graph-safe. The row is read 5 times (4
bytes a token; from L2 after the first). Scratch (``TopkScratch``): a [rows, 2048]
histogram kept zero between calls, the threshold state and per-chunk counts.

``topk_torch``: the same contract with ``torch.topk`` on masked logits (graph-safe too,
allocates temporaries, sorted by logit); a reference and a timing baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Digits per pass, most significant first (32 bits in all).
PASS_BITS = (11, 11, 10)
HIST_BINS = 1 << max(PASS_BITS)
MAX_CHUNKS = 64  # programs per row at most (the per-chunk counts' width)


@dataclass(frozen=True)
class TopkScratch:
    """Device scratch of ``launch_topk`` for up to ``rows`` rows, allocated once.

    hist:   [rows, HIST_BINS] int32, zero between calls (each pass clears it)
    state:  [rows, 2] int32, the threshold's digits so far (uint32 bits) and the number
            of keys equal to it still to take
    counts: [rows, MAX_CHUNKS, 2] int32, keys above / equal to the threshold per chunk
    """

    hist: torch.Tensor
    state: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, device: torch.device | str) -> TopkScratch:
        return cls(torch.zeros(rows, HIST_BINS, dtype=torch.int32, device=device),
                   torch.zeros(rows, 2, dtype=torch.int32, device=device),
                   torch.zeros(rows, MAX_CHUNKS, 2, dtype=torch.int32, device=device))

    @property
    def rows(self) -> int:
        return self.hist.shape[0]


def topk_chunks(max_len: int, block: int = 1024) -> int:
    """Programs per row: about two blocks of logits each, at most MAX_CHUNKS."""
    return max(1, min(MAX_CHUNKS, triton.cdiv(max_len, 2 * block)))


@triton.jit
def _order_key(x):
    """float32 -> uint32 with the same order; -0.0 and +0.0 give one key (they tie)."""
    u = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) != 0, u ^ 0xFFFFFFFF, u | 0x80000000)


@triton.jit
def _chunk_range(n, chunk, num_chunks, BLOCK: tl.constexpr):
    """Positions [start, end) of one chunk of a row of n logits (whole blocks each)."""
    per = tl.cdiv(tl.cdiv(n, BLOCK), num_chunks) * BLOCK
    start = chunk * per
    return start, tl.minimum(start + per, n)


@triton.jit
def _row_length(SEQ_LENS, row, max_len):
    return tl.minimum(tl.load(SEQ_LENS + row), max_len)


@triton.jit
def _topk_hist_kernel(LOGITS, SEQ_LENS, HIST, STATE, k, max_len, num_chunks,
                      stride_l_r, stride_h_r, stride_s_r,
                      SHIFT: tl.constexpr, BITS: tl.constexpr, FIRST: tl.constexpr,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0)
    n = _row_length(SEQ_LENS, row, max_len)
    if n > k:
        start, end = _chunk_range(n, tl.program_id(1), num_chunks, BLOCK)
        BINS: tl.constexpr = 1 << BITS
        row_ptr = LOGITS + row.to(tl.int64) * stride_l_r
        prefix = tl.load(STATE + row * stride_s_r).to(tl.uint32, bitcast=True)
        hist = tl.zeros([BINS], dtype=tl.int32)
        for c0 in range(start, end, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            live = offs < end
            key = _order_key(tl.load(row_ptr + offs, mask=live, other=0.0))
            if not FIRST:  # keys whose higher digits are the ones chosen so far
                live = live & ((key >> (SHIFT + BITS)) == (prefix >> (SHIFT + BITS)))
            digit = ((key >> SHIFT) & (BINS - 1)).to(tl.int32)
            hist += tl.histogram(digit, BINS, mask=live)
        bins = tl.arange(0, BINS)
        tl.atomic_add(HIST + row * stride_h_r + bins, hist, mask=hist > 0, sem="relaxed")


@triton.jit
def _topk_select_kernel(SEQ_LENS, HIST, STATE, k, max_len, stride_h_r, stride_s_r,
                        SHIFT: tl.constexpr, BITS: tl.constexpr, FIRST: tl.constexpr):
    row = tl.program_id(0)
    n = _row_length(SEQ_LENS, row, max_len)
    if n > k:
        BINS: tl.constexpr = 1 << BITS
        bins = tl.arange(0, BINS)
        hist_ptr = HIST + row * stride_h_r + bins
        hist = tl.load(hist_ptr)
        if FIRST:
            prefix = tl.zeros([], dtype=tl.uint32)
            need = k
        else:
            prefix = tl.load(STATE + row * stride_s_r).to(tl.uint32, bitcast=True)
            need = tl.load(STATE + row * stride_s_r + 1)
        # at_least[b]: matching keys whose digit is >= b; at_least[0] >= need always.
        at_least = tl.cumsum(hist, 0, reverse=True)
        d = tl.max(tl.where(at_least >= need, bins, 0), 0)
        need -= tl.sum(tl.where(bins > d, hist, 0), 0)
        prefix = prefix | (d.to(tl.uint32) << SHIFT)
        tl.store(STATE + row * stride_s_r, prefix.to(tl.int32, bitcast=True))
        tl.store(STATE + row * stride_s_r + 1, need)
        tl.store(hist_ptr, tl.zeros([BINS], dtype=tl.int32))  # ready for the next pass


@triton.jit
def _topk_count_kernel(LOGITS, SEQ_LENS, STATE, COUNTS, k, max_len, num_chunks,
                       stride_l_r, stride_s_r, stride_c_r, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    n = _row_length(SEQ_LENS, row, max_len)
    if n > k:
        start, end = _chunk_range(n, chunk, num_chunks, BLOCK)
        row_ptr = LOGITS + row.to(tl.int64) * stride_l_r
        threshold = tl.load(STATE + row * stride_s_r).to(tl.uint32, bitcast=True)
        above = 0
        equal = 0
        for c0 in range(start, end, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            live = offs < end
            key = _order_key(tl.load(row_ptr + offs, mask=live, other=0.0))
            above += tl.sum((live & (key > threshold)).to(tl.int32), 0)
            equal += tl.sum((live & (key == threshold)).to(tl.int32), 0)
        tl.store(COUNTS + row * stride_c_r + chunk * 2, above)
        tl.store(COUNTS + row * stride_c_r + chunk * 2 + 1, equal)


@triton.jit
def _topk_write_kernel(LOGITS, SEQ_LENS, STATE, COUNTS, INDICES, SPARSE_LENS, k, max_len,
                       num_chunks, stride_l_r, stride_s_r, stride_c_r, stride_i_r,
                       BLOCK: tl.constexpr, MAX_CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    n = _row_length(SEQ_LENS, row, max_len)
    out_ptr = INDICES + row.to(tl.int64) * stride_i_r
    if chunk == 0:
        tl.store(SPARSE_LENS + row, tl.minimum(n, k))
    if n <= k:
        # Every position, then -1: this chunk's share of the k slots.
        start, end = _chunk_range(k, chunk, num_chunks, BLOCK)
        for c0 in range(start, end, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            tl.store(out_ptr + offs, tl.where(offs < n, offs, -1), mask=offs < end)
    else:
        start, end = _chunk_range(n, chunk, num_chunks, BLOCK)
        row_ptr = LOGITS + row.to(tl.int64) * stride_l_r
        threshold = tl.load(STATE + row * stride_s_r).to(tl.uint32, bitcast=True)
        need = tl.load(STATE + row * stride_s_r + 1)
        chunks = tl.arange(0, MAX_CHUNKS)
        before = chunks < chunk
        counts = COUNTS + row * stride_c_r + chunks * 2
        equal_seen = tl.sum(tl.load(counts + 1, mask=before, other=0), 0)
        # Slots of the earlier chunks: their keys above T and their share of the ties.
        written = tl.sum(tl.load(counts, mask=before, other=0), 0) + \
            tl.minimum(equal_seen, need)
        for c0 in range(start, end, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            live = offs < end
            key = _order_key(tl.load(row_ptr + offs, mask=live, other=0.0))
            equal = live & (key == threshold)
            equal_rank = equal_seen + tl.cumsum(equal.to(tl.int32), 0) - 1
            take = (live & (key > threshold)) | (equal & (equal_rank < need))
            slot = written + tl.cumsum(take.to(tl.int32), 0) - 1
            tl.store(out_ptr + slot, offs, mask=take)
            written += tl.sum(take.to(tl.int32), 0)
            equal_seen += tl.sum(equal.to(tl.int32), 0)


def launch_topk(logits: torch.Tensor, seq_lens: torch.Tensor, indices: torch.Tensor,
                sparse_lens: torch.Tensor, scratch: TopkScratch, *, num_rows: int,
                num_chunks: int | None = None, block: int = 1024) -> None:
    """indices[:num_rows, :k] and sparse_lens[:num_rows] from logits[:num_rows, :len]
    (k = indices.shape[1]; unchecked). Graph-safe: fixed grids, no host reads.
    ``num_chunks`` programs per row (default ``topk_chunks(logits.shape[1], block)``)."""
    k, max_len = indices.shape[1], logits.shape[1]
    chunks = num_chunks or topk_chunks(max_len, block)
    hist, state, counts = scratch.hist, scratch.state, scratch.counts
    shift = 32
    for i, bits in enumerate(PASS_BITS):
        shift -= bits
        _topk_hist_kernel[(num_rows, chunks)](
            logits, seq_lens, hist, state, k, max_len, chunks,
            logits.stride(0), hist.stride(0), state.stride(0),
            SHIFT=shift, BITS=bits, FIRST=i == 0, BLOCK=block, num_warps=4)
        _topk_select_kernel[(num_rows,)](
            seq_lens, hist, state, k, max_len, hist.stride(0), state.stride(0),
            SHIFT=shift, BITS=bits, FIRST=i == 0, num_warps=4)
    _topk_count_kernel[(num_rows, chunks)](
        logits, seq_lens, state, counts, k, max_len, chunks,
        logits.stride(0), state.stride(0), counts.stride(0), BLOCK=block, num_warps=4)
    _topk_write_kernel[(num_rows, chunks)](
        logits, seq_lens, state, counts, indices, sparse_lens, k, max_len, chunks,
        logits.stride(0), state.stride(0), counts.stride(0), indices.stride(0),
        BLOCK=block, MAX_CHUNKS=MAX_CHUNKS, num_warps=4)


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
