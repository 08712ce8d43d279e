"""Launch plans for split-KV MLA decode: every host-side decision in one frozen record.

A ``LaunchPlan`` is what a FULL CUDA graph freezes: the split count, the block sizes,
the grid, the extent of the split workspace and whether the stage-2 merge runs. It is
hashable and doubles as the graph key (two buckets with equal plans share one graph).

``plan_mla_decode`` is a pure host function of (batch size, heads, hint). It never reads
device data, so it is safe to call on the replay path and in CPU-only tests.

Formula (integer arithmetic)::

    rows         = batch * cdiv(num_heads, block_h)          # programs without splitting
    stream       = LONG_STREAM if rows < num_sms // 4 else WIDE_STREAM
    budget       = min(pow2_floor(stream.ctas_per_sm * num_sms // rows), max_splits)  # >= 1
    wanted       = pow2_ceil(cdiv(cdiv(hint, stream.block_n), stream.min_tiles_per_split))
    num_splits   = clamp(wanted, 1, budget)
    fused_merge  = 1 < num_splits and cdiv(hint, stream.block_n) <= stream.fused_merge_max_tiles
    num_splits   = min(num_splits, FUSED_MERGE_MAX_SPLITS) if fused_merge

Where the constants come from (H200; bench/NOTES.md, topics "split budget and the merge"
and "stage-1 kernel (split-KV, tiles, streams, pipelining)"):
- One program streams roughly 10-12 GB/s, so HBM saturates only with several hundred
  programs resident: the split budget is the largest power of two that fits one wave of
  resident slots (filling the wave exactly gained little at batch 1 and lost at batch 8,
  where the larger split count needs a larger merge tile).
- LONG_STREAM (few rows, long splits; ``graphbucket.plan_streams`` has every stream): best
  at batch 1 and 8. WIDE_STREAM (many rows, more programs per SM): best at batch 64. Up to
  4K tokens (128 tiles) WIDE's splits merge in stage 1 (the request's last split merges,
  no merge kernel): with the merge kernel one split was best there, with the fused merge a
  few splits win. The last split reads every partial of its request alone, so the fused
  merge is capped at FUSED_MERGE_MAX_SPLITS; past 4K tokens more splits and the merge
  kernel win.
- wanted (LONG): at batch 1 more splits kept paying down to one tile per split at short
  contexts, so the hint asks for one split per tile and the budget caps it; powers of two
  keep neighbouring hints on one plan, so ladders alias more graphs.
The ladder tuner measures these choices on the GPU at hand and may replace them.

fp8 caches (``graphbucket.fp8``) run the same plans. Plans count tokens; the launcher picks
the tile for the cache format (``kernels.launch.tile_tokens``), and the split formula uses
that tile, so a split still covers the planned tokens. The smaller rows move the best split
count per context, a hint choice: ``scripts/tune_ladder.py --kv-cache`` tunes a ladder per
format and the ``ladder`` policy looks it up by the format.

``plan_balanced_mla_decode`` plans the other topology, balanced split-KV: a fixed grid of
persistent programs takes equal chunks of the batch's total tiles, partitioned on the
device from the live lengths (``graphbucket/kernels/balanced.py``); ladders ask for it per
bucket for ragged batches (``Bucket.balanced_imbalance``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from graphbucket.intmath import cdiv, pow2_ceil, pow2_floor  # noqa: F401 (re-exported)
from graphbucket.merge_tile import (  # noqa: F401 (re-exported: the plan's merge tile)
    MERGE_BLOCK_DV,
    MERGE_BLOCK_S,
    MERGE_BLOCK_S_SMALL,
    MERGE_PROGRAMS_PER_SM,
    WHOLE_ROW_MERGE_DV,
    WHOLE_ROW_MERGE_MAX_PROGRAMS,
    many_heads_merge_tile,
    merge_block_s,
    whole_row_merge,
    with_merge_tile,
)
from graphbucket.plan_streams import (
    LONG_PAGE_AHEAD,
    LONG_STREAM,
    ROWS32_STREAM,
    ROWS_STREAM,
    SEESAW_STREAM,
    WIDE_FUSED,
    WIDE_STREAM,
    Fp8Stream,
    StreamConfig,
)

MAX_KV_SPLITS = 512
H200_NUM_SMS = 132
# A fused merge is done by one program per (request, head block), reading every partial
# alone: cheap for a few splits, a serial tail for many.
FUSED_MERGE_MAX_SPLITS = 4
# Tiles a live request adds to the work of a charged tile-range cut (``charged_ranges``):
# what starting a segment costs a program beside its tiles (the Q load, the pipeline's fill,
# the partial written and merged), in 64-token tiles.
RANGE_REQUEST_CHARGE_TILES = 5
# The charge is a compile-time constant of the range planner: one variant per value.
MAX_RANGE_CHARGE_TILES = 64


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """Every host decision of one MLA decode launch; hashable, used as the graph key.

    ``grid`` is stage 1's grid (batch, head blocks, splits); the seesaw kernel launches the
    same programs as (head blocks, batch, splits). The workspace holds
    ``workspace_shape`` = (batch, heads, splits, kv_lora_rank) float32 partial outputs
    plus (batch, heads, splits) float32 LSEs; it is empty when ``use_stage2`` is False.

    ``persistent_programs`` > 0 selects balanced split-KV instead: stage 1 runs on a
    (persistent_programs, head blocks, 1) grid over work items of at least
    ``min_chunk_tiles`` tiles, and the partials of up to ``max_work_items`` items live in
    the workspace's item buffers; ``num_kv_splits`` is 1 and unused.
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
    merge_num_warps: int = 4
    # Balanced plans: the merge's persistent programs over units of merge_block_h heads.
    merge_programs: int = 0
    merge_block_h: int = 1
    # The balanced merge issues each step's loads before the one ahead is weighed.
    merge_prefetch: bool = False
    # The merge waits for stage 1 on the device instead of at a kernel boundary
    # (programmatic dependent launch, where the GPU has it: sm_90 and later).
    dependent_merge: bool = False
    # 0: split-KV over (batch, head blocks, splits). > 0: balanced split-KV on this many
    # persistent programs per head block.
    persistent_programs: int = 0
    min_chunk_tiles: int = 1
    # Stage 1 computes S^T = KV Q^T and O^T += KV^T P^T (tokens as the dots' rows).
    token_major: bool = False
    # Split plans: each request's last split merges in stage 1 (no merge kernel).
    fused_merge: bool = False
    # Stage 1 looks each tile's pages up one iteration ahead (StreamConfig.page_ahead).
    page_ahead: bool = False
    # A fused merge sums the partials in this many column blocks (StreamConfig.merge_chunks).
    merge_chunks: int = 1
    # Split plans: stage 1 by the Gluon seesaw kernel (64 rows, two warpgroups) where the
    # launch's inputs allow it (``kernels.seesaw_route.runs_seesaw``), else the Triton kernel.
    seesaw: bool = False
    # Balanced seesaw plans: each persistent program takes an equal range of the step's
    # tiles across request boundaries (one partial per request it meets) instead of one
    # program per chunk of a request.
    tile_ranges: bool = False
    # Tile-range plans: the ranges are cut by work, each live request charged
    # ``range_charge_tiles`` tiles more than its own (its Q load, partial and merge), so a
    # program that meets many short requests takes fewer tiles; a request the cut leaves
    # whole gets its output from stage 1.
    charged_ranges: bool = False
    range_charge_tiles: int = 0
    # Balanced item plans: the device grows the chunk until the step has no more items than
    # programs (where its live requests allow), so no program runs a second item.
    fit_items: bool = False
    # How stage 1 streams an fp8 cache (tile, warps, dequantization); unused otherwise.
    fp8: Fp8Stream = Fp8Stream()

    @property
    def num_head_blocks(self) -> int:
        return cdiv(self.num_heads, self.block_h)

    @property
    def balanced(self) -> bool:
        return self.persistent_programs > 0

    @property
    def use_stage2(self) -> bool:
        """Partials go through the workspace (a merge follows, in a kernel or fused)."""
        return self.balanced or self.num_kv_splits > 1

    @property
    def merges_in_stage1(self) -> bool:
        """A split plan whose last split per request merges (no merge kernel)."""
        return self.fused_merge and not self.balanced and self.num_kv_splits > 1

    @property
    def merge_kernel(self) -> bool:
        """A separate merge kernel runs after stage 1."""
        return self.use_stage2 and not self.merges_in_stage1

    @property
    def max_work_items(self) -> int:
        """Balanced plans: the most work items any lengths can make (0 for split plans).

        chunk >= total_tiles / G, so sum_b cdiv(tiles_b, chunk) <= G + (live requests).
        """
        return self.persistent_programs + self.batch_size if self.balanced else 0

    @property
    def grid(self) -> tuple[int, int, int]:
        if self.balanced:
            return (self.persistent_programs, self.num_head_blocks, 1)
        return (self.batch_size, self.num_head_blocks, self.num_kv_splits)

    @property
    def merge_grid(self) -> tuple[int, int, int]:
        if self.balanced:
            return (self.merge_programs, 1, 1)
        return (self.batch_size, self.num_heads, cdiv(self.kv_lora_rank, self.merge_block_dv))

    @property
    def workspace_shape(self) -> tuple[int, int, int, int]:
        if not self.use_stage2 or self.balanced:
            return (0, 0, 0, 0)
        return (self.batch_size, self.num_heads, self.num_kv_splits, self.kv_lora_rank)

    def with_splits(self, num_kv_splits: int) -> LaunchPlan:
        """The same plan with another split budget (and the merge tile that goes with it;
        the merge kernel past FUSED_MERGE_MAX_SPLITS)."""
        return replace(self, num_kv_splits=num_kv_splits,
                       merge_block_s=merge_block_s(num_kv_splits),
                       fused_merge=self.fused_merge and num_kv_splits <= FUSED_MERGE_MAX_SPLITS)

    def describe(self) -> str:
        fp8 = "" if self.fp8 == Fp8Stream() else f" fp8={self.fp8.describe()}"
        if self.balanced:
            return (f"balanced programs={self.persistent_programs} grid={self.grid} "
                    f"block_h={self.block_h} block_n={self.block_n}{self._layout}"
                    f"{' seesaw' if self.seesaw else ''}{' ranges' if self.tile_ranges else ''}"
                    f"{f' charged={self.range_charge_tiles}' if self.charged_ranges else ''}"
                    f"{' fitted' if self.fit_items else ''}"
                    f" min_chunk={self.min_chunk_tiles} +merge(bs={self.merge_block_s}"
                    f"{f' heads={self.merge_block_h}' if self.merge_block_h > 1 else ''}"
                    f"{' prefetch' if self.merge_prefetch else ''}){fp8}")
        stage2 = f"+merge(bs={self.merge_block_s})" if self.use_stage2 else " one-split"
        if self.merges_in_stage1:
            chunks = f", {self.merge_chunks} column blocks" if self.merge_chunks > 1 else ""
            stage2 = f" +merge(last split{chunks})"
        return (
            f"splits={self.num_kv_splits} grid={self.grid} block_h={self.block_h} "
            f"block_n={self.block_n}{self._layout}{' seesaw' if self.seesaw else ''}{stage2}"
            f"{fp8}"
        )

    @property
    def kv_buffers(self) -> int:
        """Shared-memory buffers of the head-major stage 1's KV tile under Triton 3.6 (sm_90
        compile): the block-table lookup takes half of the num_stages - 1 lookahead unless
        the pages are looked up ahead."""
        lookahead = self.num_stages - 1
        return max(1, lookahead if self.page_ahead else lookahead // 2)

    @property
    def _layout(self) -> str:
        layout = " token-major" if self.token_major else ""
        if self.page_ahead:
            layout += " page-ahead"
        if self.kv_buffers > 1 and not self.token_major:
            layout += f" kv_buffers={self.kv_buffers}"
        return layout


def stream_config(rows: int, num_sms: int, block_h: int = 16) -> StreamConfig:
    """64-row programs stream SEESAW_STREAM (split-KV and balanced plans alike); otherwise
    long streams while the grid is thin (ROWS32_STREAM for 32-row programs), shorter tiles
    and more residents when it is wide."""
    if block_h >= ROWS_STREAM.block_h:
        return SEESAW_STREAM
    if rows < num_sms // 4:
        return ROWS32_STREAM if block_h == ROWS32_STREAM.block_h else LONG_STREAM
    return WIDE_STREAM


def split_budget(rows: int, stream: StreamConfig, *, num_sms: int, max_splits: int) -> int:
    """The largest power of two of splits that fits one wave of resident program slots
    (``max_splits``, the caller's cap, applies as given)."""
    return max(1, min(pow2_floor(stream.ctas_per_sm * num_sms // rows), max_splits))


def head_block_size(num_heads: int) -> int:
    """Query rows per program: tensor-core dots need at least 16 rows; 32 heads per program
    share each KV tile across twice the heads without spilling the 32 x 512 float32
    accumulator; from 64 heads, 64 rows (warpgroup MMA, ROWS_STREAM)."""
    if num_heads <= 16:
        return 16
    return 32 if num_heads < ROWS_STREAM.block_h else ROWS_STREAM.block_h


def split_kv_block_size(num_heads: int) -> int:
    """Query rows per split-KV program: from 32 rows (32 heads, 16 heads x 2 verify tokens),
    64-row programs, whose stage 1 the Gluon seesaw runs on Hopper and which beat 32-row
    programs there for every cache format; below that, ``head_block_size``."""
    if num_heads >= ROWS32_STREAM.block_h:
        return ROWS_STREAM.block_h
    return head_block_size(num_heads)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def plan_mla_decode(
    batch_size: int,
    num_heads: int,
    hint: int,
    *,
    num_sms: int = H200_NUM_SMS,
    kv_lora_rank: int = 512,
    qk_rope_dim: int = 64,
    max_splits: int = MAX_KV_SPLITS,
    stream: StreamConfig | None = None,
) -> LaunchPlan:
    """Plan one MLA decode launch for ``batch_size`` requests whose lengths are near ``hint``.

    Pure host arithmetic: deterministic, monotone non-decreasing in ``hint``, bounded by
    the SM-derived budget and ``max_splits``. Any plan is correct for any live length;
    the hint only decides speed. ``stream`` overrides the automatic tile configuration
    (without it, ``refined_stream`` may swap LONG / WIDE for a double-buffered stream).
    """
    _check_positive(batch_size=batch_size, num_heads=num_heads, hint=hint, num_sms=num_sms,
                    max_splits=max_splits)
    block_h = stream.block_h if stream is not None and stream.block_h else \
        split_kv_block_size(num_heads)
    rows = batch_size * cdiv(num_heads, block_h)
    auto = stream is None
    stream = stream or stream_config(rows, num_sms, block_h)
    budget = split_budget(rows, stream, num_sms=num_sms, max_splits=max_splits)
    wanted = pow2_ceil(cdiv(cdiv(hint, stream.block_n), stream.min_tiles_per_split))
    num_splits = max(1, min(wanted, budget))
    fused = 1 < num_splits and cdiv(hint, stream.block_n) <= stream.fused_merge_max_tiles
    if fused:
        num_splits = min(num_splits, FUSED_MERGE_MAX_SPLITS)
    if auto:
        stream = refined_stream(stream, hint, num_splits, fused)
    return _plan(batch_size, num_heads, block_h, stream, kv_lora_rank, qk_rope_dim,
                 num_kv_splits=num_splits, merge_block_s=merge_block_s(num_splits),
                 dependent_merge=stream.dependent_merge and not fused, fused_merge=fused,
                 seesaw=stream.seesaw and not fused)


# LONG plans whose splits hold at most SHORT_SPLIT_TOKENS tokens stream LONG_PAGE_AHEAD, and
# WIDE plans that merge in stage 1 stream WIDE_FUSED: faster there (splits of thousands of
# tokens lost with the pages looked up ahead). The split count is the one LONG / WIDE plan;
# only the stage-1 stream changes (bench/NOTES.md, topic "stage-1 kernel (split-KV, tiles,
# streams, pipelining)").
SHORT_SPLIT_TOKENS = 2048


def refined_stream(stream: StreamConfig, hint: int, num_splits: int,
                   fused: bool) -> StreamConfig:
    """The stage-1 stream a LONG / WIDE plan runs (see SHORT_SPLIT_TOKENS, WIDE_FUSED)."""
    if stream == LONG_STREAM and cdiv(hint, num_splits) <= SHORT_SPLIT_TOKENS:
        return LONG_PAGE_AHEAD
    if stream == WIDE_STREAM and fused:
        return WIDE_FUSED
    return stream


def _plan(batch_size: int, num_heads: int, block_h: int, stream: StreamConfig,
          kv_lora_rank: int, qk_rope_dim: int, **topology) -> LaunchPlan:
    """The fields every topology shares: tile shape and pipeline from the stream."""
    return LaunchPlan(batch_size=batch_size, num_heads=num_heads, block_h=block_h,
                      block_n=stream.block_n,
                      num_warps=stream.num_warps or (4 if block_h == 16 else 8),
                      num_stages=stream.num_stages, kv_lora_rank=kv_lora_rank,
                      qk_rope_dim=qk_rope_dim, merge_block_dv=MERGE_BLOCK_DV,
                      token_major=stream.token_major, page_ahead=stream.page_ahead,
                      merge_chunks=stream.merge_chunks,
                      **topology)


def plan_balanced_mla_decode(
    batch_size: int,
    num_heads: int,
    *,
    num_sms: int = H200_NUM_SMS,
    kv_lora_rank: int = 512,
    qk_rope_dim: int = 64,
    programs: int | None = None,
    min_chunk_tiles: int | None = None,
    stream: StreamConfig | None = None,
    tile_ranges: bool = False,
    fit_items: bool = False,
    charged_ranges: bool = False,
    range_charge_tiles: int | None = None,
) -> LaunchPlan:
    """Plan balanced split-KV decode for ``batch_size`` requests of any lengths.

    One wave of resident programs: ``programs`` (default ctas_per_sm * num_sms / head
    blocks) persistent programs per head block share the batch's tiles in chunks of
    max(min_chunk_tiles, cdiv(total_tiles, programs)), chosen on the device per step. No
    hint: the device picks the chunk from the live lengths, so one plan serves every
    context. ``min_chunk_tiles`` defaults to the stream's minimum tiles per split
    (a sweep of programs and minimum chunks: bench/results/h200-ragged-balanced-sweep.md).
    64-row programs (the default from 64 heads, SEESAW_STREAM) run stage 1 by the Gluon
    seesaw, one program per work item, where ``kernels.seesaw_route.runs_seesaw`` holds (else the
    Triton kernel runs the same plan); ``stream=ROWS_STREAM`` keeps the Triton stage 1.
    ``tile_ranges`` (64-row programs only): the seesaw runs one persistent program per SM
    (``programs`` defaults to num_sms / head blocks), each over an equal range of the
    step's tiles across request boundaries; where the seesaw cannot run, the Triton
    kernel runs the plan's chunks. ``fit_items`` (item plans): the chunk is the smallest of
    at least that size that cuts the step into at most ``programs`` items, where the live
    requests number no more than the programs and that chunk is at most 1.5x the plain
    one; each program then runs one item. ``charged_ranges`` (tile-range plans): the ranges
    are equal in work, not tiles: each live request counts ``range_charge_tiles`` (default
    RANGE_REQUEST_CHARGE_TILES) tiles more than it holds.
    """
    _check_positive(batch_size=batch_size, num_heads=num_heads, num_sms=num_sms)
    block_h = stream.block_h if stream is not None and stream.block_h else \
        head_block_size(num_heads)
    head_blocks = cdiv(num_heads, block_h)
    stream = stream or stream_config(batch_size * head_blocks, num_sms, block_h)
    if tile_ranges and not (stream.seesaw and block_h == 64):
        raise ValueError(f"tile_ranges needs the seesaw's 64-row programs (block_h 64, "
                         f"seesaw stream); got block_h {block_h}, seesaw {stream.seesaw}")
    if charged_ranges and not tile_ranges:
        raise ValueError("charged_ranges cuts tile ranges by work; it needs tile_ranges")
    if range_charge_tiles is not None and not charged_ranges:
        raise ValueError("range_charge_tiles is the charge of a charged_ranges cut; "
                         "pass charged_ranges=True with it")
    charge = RANGE_REQUEST_CHARGE_TILES if range_charge_tiles is None else range_charge_tiles
    if charged_ranges and not (isinstance(charge, int) and 0 <= charge <= MAX_RANGE_CHARGE_TILES):
        raise ValueError(f"range_charge_tiles must be an int in [0, {MAX_RANGE_CHARGE_TILES}], "
                         f"got {range_charge_tiles!r}")
    if fit_items and tile_ranges:
        raise ValueError("fit_items sizes the chunks of item plans; a tile_ranges plan has "
                         "one range per program already")
    if programs is None:
        per_sm = 1 if tile_ranges else stream.ctas_per_sm  # the seesaw fills an SM's smem
        programs = max(1, per_sm * num_sms // head_blocks)
    if min_chunk_tiles is None:
        min_chunk_tiles = stream.min_tiles_per_split
    _check_positive(programs=programs, min_chunk_tiles=min_chunk_tiles)
    # The merge tile fits the mean items per request: at batch 64 a 256-row tile over
    # requests of a few items is mostly masked work (see MERGE_BLOCK_S); a single
    # long request with every item loops over its items in steps of that tile.
    items_per_request = cdiv(programs + batch_size, batch_size)
    plan = _plan(batch_size, num_heads, block_h, stream, kv_lora_rank, qk_rope_dim,
                 num_kv_splits=1, merge_block_s=merge_block_s(items_per_request),
                 persistent_programs=programs, min_chunk_tiles=min_chunk_tiles,
                 seesaw=stream.seesaw, tile_ranges=tile_ranges,
                 charged_ranges=charged_ranges,
                 range_charge_tiles=charge if charged_ranges else 0, fit_items=fit_items)
    if whole_row_merge(batch_size, num_heads, programs):
        return with_merge_tile(plan, num_sms, block_dv=min(WHOLE_ROW_MERGE_DV, kv_lora_rank),
                               num_warps=8)
    return with_merge_tile(plan, num_sms, **many_heads_merge_tile(num_heads, kv_lora_rank))
