"""The merge's tile: how many partials, heads and latent columns one merge program takes
per step, and how many persistent programs a balanced merge runs.

Pure host code. The split-KV merge (stage 2) walks a request's splits in steps of
``merge_block_s``; the balanced merge walks the items of the requests its planner listed,
one unit (a request, ``merge_block_h`` heads, ``merge_block_dv`` columns) at a time.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

from graphbucket.intmath import cdiv, pow2_ceil

# A LaunchPlan (``graphbucket.plan``, which imports this module).
Plan = TypeVar("Plan")

# Stage 2 merges up to MERGE_BLOCK_S splits per step, in a tile just large enough for the
# plan's split count (32-256 rows: four merge variants at most): a large tile over a few
# splits is mostly masked work, a small one over many takes many dependent steps.
MERGE_BLOCK_S = 256
MERGE_BLOCK_S_SMALL = 32
MERGE_BLOCK_DV = 32
# Balanced merges over few items per request: whole rows per program (``whole_row_merge``).
WHOLE_ROW_MERGE_DV = 512
WHOLE_ROW_MERGE_MAX_PROGRAMS = 256
MERGE_PROGRAMS_PER_SM = 16  # a balanced merge's persistent programs per SM (at most one per unit)
# From 64 heads a unit spans several heads and whole rows, and its loads are prefetched: a
# one-head unit is a chain of dependent loads over a few partials, and the step's units
# outnumber the programs many times over. Units of 4 heads x 512 columns over 2 items per
# step keep the most bytes in flight per chain for tile ranges and item plans alike.
MANY_HEADS = 64
MANY_HEADS_MERGE_TILE = (2, 4, 512)  # (block_s, block_h, block_dv)


def merge_block_s(num_splits: int) -> int:
    return min(MERGE_BLOCK_S, max(MERGE_BLOCK_S_SMALL, pow2_ceil(num_splits)))


def whole_row_merge(batch_size: int, num_heads: int, programs: int) -> bool:
    """Balanced merges of a few items per request read whole rows (one program per request
    and head): at up to 5 programs per request, no request has more than
    WHOLE_ROW_MERGE_MAX_PROGRAMS + 1 items to walk serially, and the column-blocked grid's
    per-program cost (each block re-reads and re-weighs every LSE) dominates. Below 64
    heads, where it was measured."""
    return (num_heads < 64 and programs <= WHOLE_ROW_MERGE_MAX_PROGRAMS
            and cdiv(programs, batch_size) <= 5)


def many_heads_merge_tile(num_heads: int, kv_lora_rank: int) -> dict[str, int | bool]:
    """The merge tile's overrides for ``with_merge_tile`` at ``num_heads``: none below
    MANY_HEADS; from there MANY_HEADS_MERGE_TILE, prefetched, its columns the largest power
    of two up to 512 that divides ``kv_lora_rank``."""
    if num_heads < MANY_HEADS:
        return {}
    bs, bh, bdv = MANY_HEADS_MERGE_TILE
    return {"block_s": bs, "block_h": bh, "block_dv": min(bdv, kv_lora_rank & -kv_lora_rank),
            "num_warps": 4, "prefetch": True}


def with_merge_tile(plan: Plan, num_sms: int, *, block_s: int | None = None,
                    block_h: int | None = None, block_dv: int | None = None,
                    num_warps: int | None = None, prefetch: bool | None = None) -> Plan:
    """A balanced plan with another merge unit ([block_s items, block_h heads, block_dv
    columns] per step; powers of two, block_dv dividing kv_lora_rank; unnamed ones kept)
    and its persistent programs: MERGE_PROGRAMS_PER_SM per SM, at most one per unit.
    ``prefetch``: each step's loads issued before the step ahead is weighed."""
    bs, bh, bdv = (block_s or plan.merge_block_s, block_h or plan.merge_block_h,
                   block_dv or plan.merge_block_dv)
    if not plan.balanced or any(v < 1 or v & (v - 1) for v in (bs, bh, bdv)) \
            or plan.kv_lora_rank % bdv:
        raise ValueError(f"a balanced plan's merge tile is powers of two with block_dv "
                         f"dividing {plan.kv_lora_rank}; got (block_s, block_h, block_dv) = "
                         f"{(bs, bh, bdv)} (balanced: {plan.balanced})")
    units = plan.batch_size * cdiv(plan.num_heads, bh) * (plan.kv_lora_rank // bdv)
    return replace(plan, merge_block_s=bs, merge_block_h=bh, merge_block_dv=bdv,
                   merge_num_warps=num_warps or plan.merge_num_warps,
                   merge_prefetch=plan.merge_prefetch if prefetch is None else bool(prefetch),
                   merge_programs=min(units, MERGE_PROGRAMS_PER_SM * num_sms))
