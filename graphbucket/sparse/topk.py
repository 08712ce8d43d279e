"""Top-k token positions per row of indexer logits: a graph-safe parallel radix select.

Per row r with live length n = len_r, writing ``indices[r, :k]`` (int32 positions) and
``sparse_lens[r] = min(n, k)``:

- n <= k: every position 0 .. n-1 in order, then -1 padding.
- n > k: the k largest logits, in position order. Each float32 logit maps to a uint32 key
  with the same order (``_order_key``: sign bit set for positives, all bits flipped for
  negatives, -0.0 read as +0.0). Ties at the k-th largest key go to the lowest positions:
  exact and deterministic.

Six launches on fixed grids, ``num_chunks`` programs per row, no host reads (graph-safe):

1. compact: every program draws the same strided sample of SAMPLES logits of its row and
   takes as floor F the sample key whose rank, scaled to the row, clears k with a margin
   of five standard deviations (``_sample_floor``). It copies its chunk's keys >= F (and
   their positions) to its own segment of the candidate buffers, in position order; the
   row's last program to finish (a ticket counter, CUTLASS-style: barrier, then one
   acq_rel atomic) lays the segments end to end into one list of m candidates.
   When m >= k the k largest are all candidates and the passes below share the m
   candidates evenly among the row's programs (about 8K of 128K keys). When fewer
   clear F (a sample that missed: about once in 1e5 rows of random logits, or an
   adversarial order), they share the whole row's logits instead: slower, never wrong.
2-5. digits: a most-significant-digit radix select of the k-th largest key T, 8 bits a
   pass (a 256-bin histogram costs an eighth of a 2048-bin one: ``tl.histogram`` is a
   ballot per bin bit and a popcount per owned bin). Each program histograms the next
   digit of its share of candidates that match the digits chosen so far and adds it into
   the row's histogram; the row's last program picks the digit whose suffix count first
   reaches the number still needed and reads-and-clears the histogram for the next
   pass. The first pass also copies the candidates into one contiguous list; the last
   keeps each program's tallies (keys above the prefix, suffix sums of its last digit).
6. write: each program writes its keys above T, and its share of the first ``need`` keys
   equal to T, at the offset the programs before it fill (from their tallies): in
   position order.

Scratch (``TopkScratch``): candidate keys and positions as wide as the logits (the
segments and the list: 16 bytes a logit), a histogram and a ticket per row (both zero
between calls), the threshold state, per-chunk offsets and per-program tallies.

``topk_torch``: the same contract with ``torch.topk`` on masked logits (graph-safe too,
allocates temporaries, sorted by logit); a reference and a timing baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Digits per pass, most significant first (32 bits in all).
PASS_BITS = (8, 8, 8, 8)
HIST_BINS = 1 << max(PASS_BITS)
CHUNK_BITS = 6
MAX_CHUNKS = 1 << CHUNK_BITS  # programs per row at most (the per-program counts' width)
SAMPLES = 256        # strided logits per row that place the candidate floor
FLOOR_SIGMAS = 5.0   # margin of the floor's rank over its expected value, in std devs
SHARE_BLOCK = 256    # candidates per step of the passes after the compaction


@dataclass(frozen=True)
class TopkScratch:
    """Device scratch of ``launch_topk`` for up to ``rows`` rows of ``max_len`` logits.

    keys, positions: [rows, max_len] int32, the compacted candidates (chunk c's segment
                     starts at the chunk's first position)
    list_keys, list_positions: [rows, max_len] int32, the candidates end to end
    hist:    [rows, HIST_BINS] int32, zero between calls (the last program clears it)
    tickets: [rows] int32, programs done with the current launch; zero between calls
    state:   [rows, 3] int32: the threshold's digits so far (uint32 bits), the number of
             keys equal to it still to take, the candidates m
    chunks:  [rows, 2, MAX_CHUNKS] int32: each segment's first index in the list, then
             its offset in the buffers minus that index
    tallies: [rows, MAX_CHUNKS, HIST_BINS + 2] int32, per program of the last digit pass:
             its keys above the prefix, then the suffix sums of its last-digit histogram
    """

    keys: torch.Tensor
    positions: torch.Tensor
    list_keys: torch.Tensor
    list_positions: torch.Tensor
    hist: torch.Tensor
    tickets: torch.Tensor
    state: torch.Tensor
    chunks: torch.Tensor
    tallies: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, max_len: int, device: torch.device | str) -> TopkScratch:
        def zeros(*shape):
            return torch.zeros(*shape, dtype=torch.int32, device=device)
        return cls(zeros(rows, max_len), zeros(rows, max_len), zeros(rows, max_len),
                   zeros(rows, max_len), zeros(rows, HIST_BINS), zeros(rows),
                   zeros(rows, 3), zeros(rows, 2, MAX_CHUNKS),
                   zeros(rows, MAX_CHUNKS, HIST_BINS + 2))

    @staticmethod
    def nbytes(rows: int, max_len: int) -> int:
        """Bytes ``allocate(rows, max_len, ...)`` takes."""
        return 4 * rows * (4 * max_len + HIST_BINS + 1 + 3 + 2 * MAX_CHUNKS
                           + MAX_CHUNKS * (HIST_BINS + 2))

    @property
    def rows(self) -> int:
        return self.hist.shape[0]

    @property
    def max_len(self) -> int:
        return self.keys.shape[1]

    @property
    def candidates(self) -> torch.Tensor:
        """[rows] the last call's candidate count per row (rows longer than k)."""
        return self.state[:, 2]


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
def _last_to_finish(TICKETS, row, num_chunks):
    """Whether this program is the row's last to get here. Every thread's earlier
    global writes are ordered before the ticket (barrier, then the ticket's release);
    the last program resets the ticket for the next launch."""
    tl.debug_barrier()
    last = tl.atomic_add(TICKETS + row, 1, sem="acq_rel") == num_chunks - 1
    if last:
        tl.atomic_xchg(TICKETS + row, 0, sem="relaxed")
    return last


@triton.jit
def _sample_floor(row_ptr, n, k, SAMPLES: tl.constexpr, FLOOR_SIGMAS: tl.constexpr):
    """A key F such that, most likely, at least k of the row's n keys are >= F, and not
    many more: the sample key of rank r = e + FLOOR_SIGMAS sqrt(e) + 1 (e = k SAMPLES / n,
    the expected rank of the k-th largest), from SAMPLES strided positions."""
    i = tl.arange(0, SAMPLES)
    pos = (i.to(tl.int64) * n // SAMPLES).to(tl.int32)
    keys = tl.sort(_order_key(tl.load(row_ptr + pos)), descending=True)
    expected = (k * SAMPLES) / n
    rank = tl.minimum((expected + FLOOR_SIGMAS * tl.sqrt(expected)).to(tl.int32) + 1,
                      SAMPLES)
    return tl.max(tl.where(i == rank - 1, keys, 0), 0)


@triton.jit
def _topk_compact_kernel(LOGITS, SEQ_LENS, KEYS, POSITIONS, TICKETS, STATE, CHUNKS,
                         k, max_len, num_chunks, stride_l_r, stride_k_r, stride_s_r,
                         stride_c_r, stride_c_i,
                         SAMPLES: tl.constexpr, FLOOR_SIGMAS: tl.constexpr,
                         BLOCK: tl.constexpr, MAX_CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    n = _row_length(SEQ_LENS, row, max_len)
    if n > k:
        row_ptr = LOGITS + row.to(tl.int64) * stride_l_r
        floor = _sample_floor(row_ptr, n, k, SAMPLES, FLOOR_SIGMAS)
        start, end = _chunk_range(n, chunk, num_chunks, BLOCK)
        keys_row = KEYS + row.to(tl.int64) * stride_k_r
        pos_row = POSITIONS + row.to(tl.int64) * stride_k_r
        written = start
        for c0 in range(start, end, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            live = offs < end
            key = _order_key(tl.load(row_ptr + offs, mask=live, other=0.0))
            take = live & (key >= floor)
            slot = written + tl.cumsum(take.to(tl.int32), 0) - 1
            tl.store(keys_row + slot, key.to(tl.int32, bitcast=True), mask=take)
            tl.store(pos_row + slot, offs, mask=take)
            written += tl.sum(take.to(tl.int32), 0)
        counts_row = CHUNKS + row * stride_c_r
        tl.atomic_xchg(counts_row + chunk, written - start, sem="relaxed")
        if _last_to_finish(TICKETS, row, num_chunks):
            # Segments end to end: candidate i of chunk c sits at buffer index i + shift_c,
            # for first_c <= i < first_c + count_c (first: past every i beyond the chunks).
            chunks = tl.arange(0, MAX_CHUNKS)
            mine = chunks < num_chunks
            counts = tl.atomic_add(counts_row + chunks, 0, mask=mine, sem="relaxed")
            counts = tl.where(mine, counts, 0)
            first = tl.cumsum(counts, 0) - counts
            seg_start, _ = _chunk_range(n, chunks, num_chunks, BLOCK)
            tl.store(counts_row + chunks, tl.where(mine, first, 2147483647))
            tl.store(counts_row + stride_c_i + chunks, seg_start - first)
            tl.store(STATE + row * stride_s_r + 2, tl.sum(counts, 0))


@triton.jit
def _share(STATE, row, program, num_chunks, k, n, stride_s_r):
    """This program's even share [lo, hi) of the row's candidates, and whether they are
    the raw logits (fewer than k cleared the floor)."""
    m = tl.load(STATE + row * stride_s_r + 2)
    raw = m < k
    total = tl.where(raw, n, m)
    lo = (program.to(tl.int64) * total // num_chunks).to(tl.int32)
    hi = ((program + 1).to(tl.int64) * total // num_chunks).to(tl.int32)
    return lo, hi, raw


@triton.jit
def _segment_candidates(LOGITS_ROW, KEYS_ROW, POS_ROW, CHUNKS_ROW, stride_c_i, idx, live,
                        raw, CHUNK_BITS: tl.constexpr):
    """Keys and positions of candidates ``idx`` of the list, read where the compaction
    left them (raw: the logits themselves)."""
    MAX_CHUNKS: tl.constexpr = 1 << CHUNK_BITS
    if raw:
        key = _order_key(tl.load(LOGITS_ROW + idx, mask=live, other=0.0))
        pos = idx
    else:
        # The segment holding idx: the last chunk c with first_c <= idx (binary search
        # over the row's MAX_CHUNKS firsts, an L1-resident 256 bytes).
        c = tl.zeros_like(idx)
        for bit in tl.static_range(1, CHUNK_BITS + 1):
            probe = c + (MAX_CHUNKS >> bit)
            c = tl.where(tl.load(CHUNKS_ROW + probe) <= idx, probe, c)
        at = idx + tl.load(CHUNKS_ROW + stride_c_i + c)
        key = tl.load(KEYS_ROW + at, mask=live, other=0).to(tl.uint32, bitcast=True)
        pos = tl.load(POS_ROW + at, mask=live, other=0)
    return key, pos


@triton.jit
def _topk_digit_kernel(LOGITS, SEQ_LENS, KEYS, POSITIONS, LIST_KEYS, LIST_POS, HIST, TICKETS,
                       STATE, CHUNKS, TALLIES, k, max_len, num_chunks,
                       stride_l_r, stride_k_r, stride_h_r, stride_s_r, stride_c_r,
                       stride_c_i, stride_t_r, stride_t_p,
                       SHIFT: tl.constexpr, BITS: tl.constexpr, FIRST: tl.constexpr,
                       LAST: tl.constexpr, SHARE_BLOCK: tl.constexpr,
                       CHUNK_BITS: tl.constexpr):
    row = tl.program_id(0)
    program = tl.program_id(1)
    n = _row_length(SEQ_LENS, row, max_len)
    if n > k:
        lo, hi, raw = _share(STATE, row, program, num_chunks, k, n, stride_s_r)
        BINS: tl.constexpr = 1 << BITS
        list_keys = LIST_KEYS + row.to(tl.int64) * stride_k_r
        list_pos = LIST_POS + row.to(tl.int64) * stride_k_r
        if FIRST:
            prefix = tl.zeros([], dtype=tl.uint32)
            need = k
        else:
            prefix = tl.load(STATE + row * stride_s_r).to(tl.uint32, bitcast=True)
            need = tl.load(STATE + row * stride_s_r + 1)
        hist = tl.zeros([BINS], dtype=tl.int32)
        higher = 0  # keys above the prefix in the digits chosen so far
        for i0 in range(lo, hi, SHARE_BLOCK):
            idx = i0 + tl.arange(0, SHARE_BLOCK)
            live = idx < hi
            if FIRST:  # gather from the segments once; the later passes read the list
                key, pos = _segment_candidates(
                    LOGITS + row.to(tl.int64) * stride_l_r,
                    KEYS + row.to(tl.int64) * stride_k_r,
                    POSITIONS + row.to(tl.int64) * stride_k_r,
                    CHUNKS + row * stride_c_r, stride_c_i, idx, live, raw, CHUNK_BITS)
                tl.store(list_keys + idx, key.to(tl.int32, bitcast=True), mask=live)
                tl.store(list_pos + idx, pos, mask=live)
            else:
                key = tl.load(list_keys + idx, mask=live, other=0).to(tl.uint32, bitcast=True)
                high_key = key >> (SHIFT + BITS)
                high_prefix = prefix >> (SHIFT + BITS)
                higher += tl.sum((live & (high_key > high_prefix)).to(tl.int32), 0)
                live = live & (high_key == high_prefix)
            digit = ((key >> SHIFT) & (BINS - 1)).to(tl.int32)
            hist += tl.histogram(digit, BINS, mask=live)
        bins = tl.arange(0, BINS)
        if LAST:
            # What the write pass needs of this program once the last digit d is known:
            # keys above T = higher + suffix[d + 1], keys equal to T = suffix[d] - that.
            tallies = TALLIES + row * stride_t_r + program * stride_t_p
            tl.store(tallies, higher)
            tl.store(tallies + 1 + bins, tl.cumsum(hist, 0, reverse=True))
            tl.store(tallies + 1 + BINS, 0)
        hist_ptr = HIST + row * stride_h_r + bins
        tl.atomic_add(hist_ptr, hist, mask=hist > 0, sem="relaxed")
        if _last_to_finish(TICKETS, row, num_chunks):
            hist = tl.atomic_xchg(hist_ptr, tl.zeros([BINS], dtype=tl.int32), sem="relaxed")
            # at_least[b]: matching keys whose digit is >= b; at_least[0] >= need always.
            at_least = tl.cumsum(hist, 0, reverse=True)
            d = tl.max(tl.where(at_least >= need, bins, 0), 0)
            need -= tl.sum(tl.where(bins > d, hist, 0), 0)
            prefix = prefix | (d.to(tl.uint32) << SHIFT)
            tl.store(STATE + row * stride_s_r, prefix.to(tl.int32, bitcast=True))
            tl.store(STATE + row * stride_s_r + 1, need)


@triton.jit
def _topk_write_kernel(SEQ_LENS, LIST_KEYS, LIST_POS, STATE, TALLIES, INDICES, SPARSE_LENS,
                       k, max_len, num_chunks,
                       stride_k_r, stride_s_r, stride_t_r, stride_t_p, stride_i_r,
                       LAST_BITS: tl.constexpr, BLOCK: tl.constexpr,
                       SHARE_BLOCK: tl.constexpr, CHUNK_BITS: tl.constexpr):
    row = tl.program_id(0)
    program = tl.program_id(1)
    n = _row_length(SEQ_LENS, row, max_len)
    out_ptr = INDICES + row.to(tl.int64) * stride_i_r
    if program == 0:
        tl.store(SPARSE_LENS + row, tl.minimum(n, k))
    if n <= k:
        # Every position, then -1: this program's share of the k slots.
        start, end = _chunk_range(k, program, num_chunks, BLOCK)
        for c0 in range(start, end, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            tl.store(out_ptr + offs, tl.where(offs < n, offs, -1), mask=offs < end)
    else:
        lo, hi, _ = _share(STATE, row, program, num_chunks, k, n, stride_s_r)
        list_keys = LIST_KEYS + row.to(tl.int64) * stride_k_r
        list_pos = LIST_POS + row.to(tl.int64) * stride_k_r
        threshold = tl.load(STATE + row * stride_s_r).to(tl.uint32, bitcast=True)
        need = tl.load(STATE + row * stride_s_r + 1)
        d = (threshold & ((1 << LAST_BITS) - 1)).to(tl.int32)
        programs = tl.arange(0, 1 << CHUNK_BITS)
        before = programs < program
        tallies = TALLIES + row * stride_t_r + programs * stride_t_p
        suffix_above = tl.load(tallies + 2 + d, mask=before, other=0)
        above_before = tl.load(tallies, mask=before, other=0) + suffix_above
        equal_before = tl.load(tallies + 1 + d, mask=before, other=0) - suffix_above
        equal_seen = tl.sum(equal_before, 0)
        # Slots of the earlier programs: their keys above T and their share of the ties.
        written = tl.sum(above_before, 0) + tl.minimum(equal_seen, need)
        for i0 in range(lo, hi, SHARE_BLOCK):
            idx = i0 + tl.arange(0, SHARE_BLOCK)
            live = idx < hi
            key = tl.load(list_keys + idx, mask=live, other=0).to(tl.uint32, bitcast=True)
            pos = tl.load(list_pos + idx, mask=live, other=0)
            equal = live & (key == threshold)
            equal_rank = equal_seen + tl.cumsum(equal.to(tl.int32), 0) - 1
            take = (live & (key > threshold)) | (equal & (equal_rank < need))
            slot = written + tl.cumsum(take.to(tl.int32), 0) - 1
            tl.store(out_ptr + slot, pos, mask=take)
            written += tl.sum(take.to(tl.int32), 0)
            equal_seen += tl.sum(equal.to(tl.int32), 0)


def launch_topk(logits: torch.Tensor, seq_lens: torch.Tensor, indices: torch.Tensor,
                sparse_lens: torch.Tensor, scratch: TopkScratch, *, num_rows: int,
                num_chunks: int | None = None, block: int = 1024) -> None:
    """indices[:num_rows, :k] and sparse_lens[:num_rows] from logits[:num_rows, :len]
    (k = indices.shape[1]; unchecked, but for the scratch's size). Graph-safe: fixed
    grids, no host reads. ``num_chunks`` programs per row (default
    ``topk_chunks(logits.shape[1], block)``)."""
    k, max_len = indices.shape[1], logits.shape[1]
    if scratch.max_len < max_len or scratch.rows < num_rows:
        raise ValueError(f"top-k scratch for {scratch.rows} x {scratch.max_len} logits is "
                         f"smaller than {num_rows} x {max_len}")
    chunks = num_chunks or topk_chunks(max_len, block)
    if not 1 <= chunks <= MAX_CHUNKS:
        raise ValueError(f"num_chunks must be in 1..{MAX_CHUNKS}, got {chunks}")
    grid = (num_rows, chunks)
    s = scratch
    common = (k, max_len, chunks, logits.stride(0), s.keys.stride(0))
    _topk_compact_kernel[grid](
        logits, seq_lens, s.keys, s.positions, s.tickets, s.state, s.chunks, *common,
        s.state.stride(0), s.chunks.stride(0), s.chunks.stride(1),
        SAMPLES=SAMPLES, FLOOR_SIGMAS=FLOOR_SIGMAS, BLOCK=block, MAX_CHUNKS=MAX_CHUNKS,
        num_warps=4)
    shift = 32
    for i, bits in enumerate(PASS_BITS):
        shift -= bits
        _topk_digit_kernel[grid](
            logits, seq_lens, s.keys, s.positions, s.list_keys, s.list_positions, s.hist,
            s.tickets, s.state, s.chunks, s.tallies, *common, s.hist.stride(0),
            s.state.stride(0), s.chunks.stride(0), s.chunks.stride(1),
            s.tallies.stride(0), s.tallies.stride(1),
            SHIFT=shift, BITS=bits, FIRST=i == 0, LAST=i == len(PASS_BITS) - 1,
            SHARE_BLOCK=SHARE_BLOCK, CHUNK_BITS=CHUNK_BITS, num_warps=4)
    _topk_write_kernel[grid](
        seq_lens, s.list_keys, s.list_positions, s.state, s.tallies, indices, sparse_lens,
        k, max_len, chunks, s.keys.stride(0), s.state.stride(0), s.tallies.stride(0),
        s.tallies.stride(1), indices.stride(0),
        LAST_BITS=PASS_BITS[-1], BLOCK=block, SHARE_BLOCK=SHARE_BLOCK,
        CHUNK_BITS=CHUNK_BITS, num_warps=4)


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
