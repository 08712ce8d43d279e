"""Launch plans for sparse MLA decode: indexer splits, top-k, attention splits (host only).

A sparse decode step is the indexer, the top-k (six launches), the attention and its
merge, and each has its own topology:

- the indexer's logits pass streams every live token's 132-byte index key, so its cost
  grows with context like dense decode: its split count follows the hint, bucket by bucket
  (``indexer_splits``);
- the top-k runs ``topk_chunks(max_len)`` programs per row on the workspace's width
  (``graphbucket/sparse/topk.py``), whatever the hint: nothing to plan;
- the sparse attention reads at most ``topk`` latent rows per query token, so it saturates
  at top-k: every hint >= topk plans the same attention (``attention_splits``).

Formula (integer arithmetic, like ``graphbucket.plan.plan_mla_decode``)::

    indexer:   tiles  = cdiv(hint, INDEXER_BLOCK_N)
               budget = pow2_floor(INDEXER_CTAS_PER_SM * num_sms // rows)
               splits = clamp(pow2_ceil(cdiv(tiles, INDEXER_MIN_TILES)), 1, budget)
    attention: tiles  = cdiv(min(hint, topk), stream.block_n)
               budget = pow2_floor(stream.ctas_per_sm * num_sms // (rows * head_blocks))
               splits = clamp(pow2_ceil(cdiv(tiles, ATTENTION_MIN_TILES)), 1, budget)

The attention's stream (``AttentionStream``: tile, warps, stages, gather ahead) is
GATHER_AHEAD_STREAM where a split holds two tiles or more and GATHER_AHEAD_8W_STREAM
where it holds one (batch 1); both have the same tile and programs per SM, so the split
count is the same and only the stage-1 kernel differs (measured: ``bench/NOTES.md``,
"sparse attention: gather ahead").

The constants were checked on an H200 (``bench/indexer_ab.py``,
``bench/sparse_attention_ab.py``: the planned split counts are the measured best at
batch 1, 8 and 64; ``bench/sparse_sweep.py`` reports them beside ``seed_max_splits``,
the heuristic vLLM's ROCm sparse backend uses).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from graphbucket.plan import H200_NUM_SMS, MERGE_BLOCK_DV, cdiv, pow2_ceil, pow2_floor

DEFAULT_TOPK = 2048
INDEX_HEADS = 64        # DeepSeek-V3.2 indexer heads (not sharded by tensor parallelism)
# Indexer tile: [128 tokens, 128] x [128, 64 heads], 4 warps, fp8 x fp8 warpgroup MMA;
# the tile's [128] scales (one per thread) are loaded a tile ahead into registers (sm_90
# compile at 3 stages: 125 registers, no spills: 3 programs per SM).
INDEXER_BLOCK_N = 128
INDEXER_STAGES = 3      # key copies in flight + 1 (4 measured slower on the H200)
INDEXER_CTAS_PER_SM = 3
INDEXER_MIN_TILES = 4   # 512 tokens (66 KB of keys) per indexer program at least
MAX_INDEXER_SPLITS = 1024
ATTENTION_BLOCK_N = 32  # gathered latent rows per attention tile
ATTENTION_BLOCK_H = 16
ATTENTION_MIN_TILES = 1
MAX_ATTENTION_SPLITS = 64
TOPK_BLOCK = 1024       # logits per step of the top-k scans


@dataclass(frozen=True, slots=True)
class AttentionStream:
    """Stage-1 shape of the sparse attention and how many such programs one SM holds."""

    block_n: int        # gathered latent rows per tile
    num_warps: int
    num_stages: int
    # Look up tile i+1's cache rows (block-table loads) and tile i+2's positions while
    # tile i is processed (``_sparse_attention_kernel``): the row gather then depends on
    # no load of its own iteration, so Triton copies it asynchronously num_stages - 1
    # tiles ahead.
    gather_ahead: bool
    ctas_per_sm: int


# First version: the positions, then the pages, then the rows, each load waiting for the
# one before; Triton gives the rows one buffer, copied after the previous tile's math.
# sm_90 compile (16 heads, bf16): 221 registers, 56 KB, two programs per SM.
GATHER_STREAM = AttentionStream(block_n=ATTENTION_BLOCK_N, num_warps=4, num_stages=2,
                                gather_ahead=False, ctas_per_sm=2)
# Two row buffers (tile i+1 in flight during tile i), one synchronous block-table load
# before each copy. sm_90 compile: 210 registers, 93 KB, no spills: still two per SM.
GATHER_AHEAD_STREAM = AttentionStream(block_n=ATTENTION_BLOCK_N, num_warps=4, num_stages=3,
                                      gather_ahead=True, ctas_per_sm=2)
# The same with 8 warps (110 registers): where a split holds one tile (batch 1) the
# gather's latency is all there is, and twice the warps issue it sooner (H200: 10.4 us
# against 11.1 for 4 warps and 11.9 for GATHER_STREAM at batch 1, 64 splits).
GATHER_AHEAD_8W_STREAM = AttentionStream(block_n=ATTENTION_BLOCK_N, num_warps=8, num_stages=3,
                                         gather_ahead=True, ctas_per_sm=2)
# 64-row tiles, two buffers, 8 warps: 175 registers, 168 KB, one program per SM
# (opt-in, for the A/B).
GATHER_AHEAD_64_STREAM = AttentionStream(block_n=64, num_warps=8, num_stages=3,
                                         gather_ahead=True, ctas_per_sm=1)


@dataclass(frozen=True, slots=True)
class SparsePlan:
    """Every host decision of one sparse decode launch; hashable (a graph key)."""

    num_rows: int            # query tokens (flat rows: spec-as-decode rows are rows too)
    num_heads: int           # attention heads per row
    topk: int
    indexer_splits: int
    attention_splits: int
    index_heads: int = INDEX_HEADS
    indexer_block_n: int = INDEXER_BLOCK_N
    indexer_stages: int = INDEXER_STAGES
    indexer_fp8_q: bool = True  # q quantized to e4m3 per head (False: q as given)
    attention_block_n: int = ATTENTION_BLOCK_N
    block_h: int = ATTENTION_BLOCK_H
    topk_block: int = TOPK_BLOCK
    merge_block_dv: int = MERGE_BLOCK_DV  # latent columns per merge program
    num_warps: int = GATHER_STREAM.num_warps
    num_stages: int = GATHER_STREAM.num_stages
    gather_ahead: bool = GATHER_STREAM.gather_ahead

    @property
    def num_head_blocks(self) -> int:
        return cdiv(self.num_heads, self.block_h)

    @property
    def merges(self) -> bool:
        """Whether the attention runs its merge kernel (more than one split)."""
        return self.attention_splits > 1

    def with_splits(self, *, indexer: int | None = None, attention: int | None = None
                    ) -> SparsePlan:
        """This plan with other split counts (sweeps, tests)."""
        return replace(self, indexer_splits=indexer or self.indexer_splits,
                       attention_splits=attention or self.attention_splits)

    def describe(self) -> str:
        return (f"sparse rows={self.num_rows} heads={self.num_heads} topk={self.topk} "
                f"indexer_splits={self.indexer_splits} "
                f"attention_splits={self.attention_splits} "
                f"attention={self.attention_block_n}/{self.num_warps}/{self.num_stages}"
                f"{' ahead' if self.gather_ahead else ''}")


def indexer_splits(num_rows: int, hint: int, num_sms: int = H200_NUM_SMS) -> int:
    tiles = cdiv(max(1, hint), INDEXER_BLOCK_N)
    budget = min(pow2_floor(INDEXER_CTAS_PER_SM * num_sms // max(1, num_rows)),
                 MAX_INDEXER_SPLITS)
    return max(1, min(pow2_ceil(cdiv(tiles, INDEXER_MIN_TILES)), budget))


def attention_splits(num_rows: int, num_heads: int, hint: int, topk: int,
                     num_sms: int = H200_NUM_SMS, stream: AttentionStream = GATHER_STREAM
                     ) -> int:
    tiles = cdiv(max(1, min(hint, topk)), stream.block_n)
    rows = max(1, num_rows) * cdiv(num_heads, ATTENTION_BLOCK_H)
    budget = min(pow2_floor(stream.ctas_per_sm * num_sms // rows), MAX_ATTENTION_SPLITS)
    return max(1, min(pow2_ceil(cdiv(tiles, ATTENTION_MIN_TILES)), budget))


def attention_stream(num_rows: int, num_heads: int, hint: int, topk: int,
                     num_sms: int = H200_NUM_SMS) -> AttentionStream:
    """GATHER_AHEAD_STREAM where a split holds two tiles or more, else
    GATHER_AHEAD_8W_STREAM (same tile and programs per SM: the split count does not
    change)."""
    tiles = cdiv(max(1, min(hint, topk)), GATHER_AHEAD_STREAM.block_n)
    splits = attention_splits(num_rows, num_heads, hint, topk, num_sms, GATHER_AHEAD_STREAM)
    return GATHER_AHEAD_STREAM if cdiv(tiles, splits) >= 2 else GATHER_AHEAD_8W_STREAM


def seed_max_splits(max_seq_len: int, topk: int, num_compute_units: int = H200_NUM_SMS) -> int:
    """vLLM ROCm sparse MLA's split cap (``_sparse_decode_max_split``), for comparison:
    next_pow2(min(max_seq_len, topk) // 128), at least 1, capped by the CU count."""
    return min(pow2_ceil(max(1, min(max_seq_len, topk) // 128)), num_compute_units)


def plan_sparse_decode(num_rows: int, num_heads: int, hint: int, *, topk: int = DEFAULT_TOPK,
                       num_sms: int = H200_NUM_SMS, stream: AttentionStream | None = None
                       ) -> SparsePlan:
    """Plan one sparse decode of ``num_rows`` query tokens planned for context ``hint``.

    Pure host arithmetic; any plan is correct for any live length (the kernels derive
    every split's range from the live lengths), the hint only changes speed. ``stream``
    replaces the planned attention stream (A/B runs); the split count follows it.
    """
    for name, value in (("num_rows", num_rows), ("num_heads", num_heads), ("hint", hint),
                        ("topk", topk), ("num_sms", num_sms)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if stream is None:
        stream = attention_stream(num_rows, num_heads, hint, topk, num_sms)
    return SparsePlan(num_rows, num_heads, topk,
                      indexer_splits=indexer_splits(num_rows, hint, num_sms),
                      attention_splits=attention_splits(num_rows, num_heads, hint, topk,
                                                        num_sms, stream),
                      attention_block_n=stream.block_n, num_warps=stream.num_warps,
                      num_stages=stream.num_stages, gather_ahead=stream.gather_ahead)
