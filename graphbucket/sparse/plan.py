"""Launch plans for sparse MLA decode: indexer splits, top-k, attention splits (host only).

A sparse decode step is three launches (four with the attention merge), and each has its
own topology:

- the indexer's logits pass streams every live token's 132-byte index key, so its cost
  grows with context like dense decode: its split count follows the hint, bucket by bucket
  (``indexer_splits``);
- the top-k runs one program per row (``graphbucket/sparse/topk.py``): nothing to plan;
- the sparse attention reads at most ``topk`` latent rows per query token, so it saturates
  at top-k: every hint >= topk plans the same attention (``attention_splits``).

Formula (integer arithmetic, like ``graphbucket.plan.plan_mla_decode``)::

    indexer:   tiles  = cdiv(hint, INDEXER_BLOCK_N)
               budget = pow2_floor(INDEXER_CTAS_PER_SM * num_sms // rows)
               splits = clamp(pow2_ceil(cdiv(tiles, INDEXER_MIN_TILES)), 1, budget)
    attention: tiles  = cdiv(min(hint, topk), ATTENTION_BLOCK_N)
               budget = pow2_floor(ATTENTION_CTAS_PER_SM * num_sms // (rows * head_blocks))
               splits = clamp(pow2_ceil(cdiv(tiles, ATTENTION_MIN_TILES)), 1, budget)

The constants are first guesses, not yet measured on a GPU (bench/sparse_sweep.py sweeps
the attention split count and reports the best one beside this plan and beside
``seed_max_splits``, the heuristic vLLM's ROCm sparse backend uses).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from graphbucket.plan import H200_NUM_SMS, MERGE_BLOCK_DV, cdiv, pow2_ceil, pow2_floor

DEFAULT_TOPK = 2048
INDEX_HEADS = 64        # DeepSeek-V3.2 indexer heads (not sharded by tensor parallelism)
# Indexer tile: [128 tokens, 128] x [128, 64 heads], 4 warps. At 128 tokens the tile's
# [128] scales (one per thread) are copied ahead with the keys; Triton re-issues a load of
# fewer elements than threads in each layout that uses it, so at 64 tokens the scales
# would be read again, synchronously, for the logits (sm_90 compile: 156 registers, no
# spills, 59 KB of shared memory at 4 stages: 3 programs per SM).
INDEXER_BLOCK_N = 128
INDEXER_STAGES = 4      # key (and scale) copies in flight + 1
INDEXER_CTAS_PER_SM = 3
INDEXER_MIN_TILES = 4   # 512 tokens (66 KB of keys) per indexer program at least
MAX_INDEXER_SPLITS = 1024
ATTENTION_BLOCK_N = 32  # gathered latent rows per attention tile
ATTENTION_BLOCK_H = 16
ATTENTION_CTAS_PER_SM = 2
ATTENTION_MIN_TILES = 1
MAX_ATTENTION_SPLITS = 64
TOPK_BLOCK = 1024       # logits per step of the top-k scans


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
    num_warps: int = 4
    num_stages: int = 2

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
                f"attention_splits={self.attention_splits}")


def indexer_splits(num_rows: int, hint: int, num_sms: int = H200_NUM_SMS) -> int:
    tiles = cdiv(max(1, hint), INDEXER_BLOCK_N)
    budget = min(pow2_floor(INDEXER_CTAS_PER_SM * num_sms // max(1, num_rows)),
                 MAX_INDEXER_SPLITS)
    return max(1, min(pow2_ceil(cdiv(tiles, INDEXER_MIN_TILES)), budget))


def attention_splits(num_rows: int, num_heads: int, hint: int, topk: int,
                     num_sms: int = H200_NUM_SMS) -> int:
    tiles = cdiv(max(1, min(hint, topk)), ATTENTION_BLOCK_N)
    rows = max(1, num_rows) * cdiv(num_heads, ATTENTION_BLOCK_H)
    budget = min(pow2_floor(ATTENTION_CTAS_PER_SM * num_sms // rows), MAX_ATTENTION_SPLITS)
    return max(1, min(pow2_ceil(cdiv(tiles, ATTENTION_MIN_TILES)), budget))


def seed_max_splits(max_seq_len: int, topk: int, num_compute_units: int = H200_NUM_SMS) -> int:
    """vLLM ROCm sparse MLA's split cap (``_sparse_decode_max_split``), for comparison:
    next_pow2(min(max_seq_len, topk) // 128), at least 1, capped by the CU count."""
    return min(pow2_ceil(max(1, min(max_seq_len, topk) // 128)), num_compute_units)


def plan_sparse_decode(num_rows: int, num_heads: int, hint: int, *, topk: int = DEFAULT_TOPK,
                       num_sms: int = H200_NUM_SMS) -> SparsePlan:
    """Plan one sparse decode of ``num_rows`` query tokens planned for context ``hint``.

    Pure host arithmetic; any plan is correct for any live length (the kernels derive
    every split's range from the live lengths), the hint only changes speed.
    """
    for name, value in (("num_rows", num_rows), ("num_heads", num_heads), ("hint", hint),
                        ("topk", topk), ("num_sms", num_sms)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return SparsePlan(num_rows, num_heads, topk,
                      indexer_splits=indexer_splits(num_rows, hint, num_sms),
                      attention_splits=attention_splits(num_rows, num_heads, hint, topk,
                                                        num_sms))
