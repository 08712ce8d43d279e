"""Launch plans for split-KV MLA decode: every host-side decision in one frozen record.

A ``LaunchPlan`` is what a FULL CUDA graph freezes: the split count, the block sizes,
the grid, the extent of the split workspace and whether the stage-2 merge runs. It is
hashable and doubles as the graph key (two buckets with equal plans share one graph).

``plan_mla_decode`` is a pure host function of (batch size, heads, hint). It never reads
device data, so it is safe to call on the replay path and in CPU-only tests.

Split-count formula (all integer arithmetic)::

    head_blocks  = cdiv(num_heads, block_h)
    budget       = pow2_floor(max(1, PROGRAMS_PER_SM * num_sms // (batch * head_blocks)))
    wanted       = pow2_ceil(cdiv(cdiv(hint, block_n), MIN_TILES_PER_SPLIT))
    num_splits   = clamp(wanted, 1, min(budget, max_splits))

Where the constants come from:
- PROGRAMS_PER_SM = 4: a read-only Triton grid over the same paged cache reached 82 % of
  the H200 copy bandwidth with 4 programs per SM and 32-token tiles, 73 % with 2 per SM
  and 64-token tiles (batch 1, 128K). One program per SM leaves HBM idle.
- MIN_TILES_PER_SPLIT = 4: each split writes a float32 partial of block_h x 512 values
  (32 KiB at 16 heads), about the size of 28 tokens of KV. Four 32-token tiles per split
  keep that overhead under ~25 % of the split's own reads at the smallest split size.
- Powers of two: neighbouring hints map to the same plan, so ladders alias more graphs,
  and stage 2 sees a small set of split counts.
The ladder tuner measures these choices on the GPU at hand and may replace them.
"""

from __future__ import annotations

from dataclasses import dataclass

PROGRAMS_PER_SM = 4
MIN_TILES_PER_SPLIT = 4
MAX_KV_SPLITS = 512
H200_NUM_SMS = 132
# Stage 2 merges this many splits per step; one fixed value keeps one compiled merge kernel.
MERGE_BLOCK_S = 32


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def pow2_ceil(x: int) -> int:
    return 1 << (max(1, x) - 1).bit_length()


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """Every host decision of one MLA decode launch; hashable, used as the graph key.

    ``grid`` is stage 1's grid (batch, head blocks, splits). The workspace holds
    ``workspace_shape`` = (batch, heads, splits, kv_lora_rank) float32 partial outputs
    plus (batch, heads, splits) float32 LSEs; it is empty when ``use_stage2`` is False.
    """

    batch_size: int
    num_heads: int
    num_kv_splits: int
    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    kv_lora_rank: int
    qk_rope_dim: int
    merge_block_s: int
    merge_block_dv: int

    @property
    def num_head_blocks(self) -> int:
        return cdiv(self.num_heads, self.block_h)

    @property
    def use_stage2(self) -> bool:
        return self.num_kv_splits > 1

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.batch_size, self.num_head_blocks, self.num_kv_splits)

    @property
    def merge_grid(self) -> tuple[int, int, int]:
        return (self.batch_size, self.num_heads, cdiv(self.kv_lora_rank, self.merge_block_dv))

    @property
    def workspace_shape(self) -> tuple[int, int, int, int]:
        if not self.use_stage2:
            return (0, 0, 0, 0)
        return (self.batch_size, self.num_heads, self.num_kv_splits, self.kv_lora_rank)

    def describe(self) -> str:
        stage2 = f"+merge(bs={self.merge_block_s})" if self.use_stage2 else " one-split"
        return (
            f"splits={self.num_kv_splits} grid={self.grid} block_h={self.block_h} "
            f"block_n={self.block_n}{stage2}"
        )


def split_budget(batch_size: int, num_head_blocks: int, *, num_sms: int) -> int:
    """Largest power-of-two split count that keeps the grid near PROGRAMS_PER_SM per SM."""
    programs = PROGRAMS_PER_SM * num_sms // (batch_size * num_head_blocks)
    return min(pow2_floor(max(1, programs)), MAX_KV_SPLITS)


def head_block_size(num_heads: int) -> int:
    # Tensor-core dots need at least 16 rows; 32 heads per program share each KV tile
    # across twice the heads without spilling the 32 x 512 float32 accumulator.
    return 16 if num_heads <= 16 else 32


def plan_mla_decode(
    batch_size: int,
    num_heads: int,
    hint: int,
    *,
    num_sms: int = H200_NUM_SMS,
    kv_lora_rank: int = 512,
    qk_rope_dim: int = 64,
    block_n: int = 32,
    max_splits: int = MAX_KV_SPLITS,
) -> LaunchPlan:
    """Plan one MLA decode launch for ``batch_size`` requests whose lengths are near ``hint``.

    Pure host arithmetic: deterministic, monotone non-decreasing in ``hint``, bounded by
    the SM-derived budget and ``max_splits``. Any plan is correct for any live length;
    the hint only decides speed.
    """
    for name, value in (("batch_size", batch_size), ("num_heads", num_heads), ("hint", hint),
                        ("num_sms", num_sms), ("max_splits", max_splits)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    block_h = head_block_size(num_heads)
    budget = min(split_budget(batch_size, cdiv(num_heads, block_h), num_sms=num_sms),
                 pow2_floor(max_splits))
    wanted = pow2_ceil(cdiv(cdiv(hint, block_n), MIN_TILES_PER_SPLIT))
    num_splits = max(1, min(wanted, budget))
    return LaunchPlan(
        batch_size=batch_size,
        num_heads=num_heads,
        num_kv_splits=num_splits,
        block_h=block_h,
        block_n=block_n,
        num_warps=4 if block_h == 16 else 8,
        num_stages=2,
        kv_lora_rank=kv_lora_rank,
        qk_rope_dim=qk_rope_dim,
        merge_block_s=MERGE_BLOCK_S,
        merge_block_dv=64,
    )
