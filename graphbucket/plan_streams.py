"""Stage-1 stream configurations: the tiles, pipeline and programs per SM a plan streams with.

A ``StreamConfig`` is the stage-1 half of a ``LaunchPlan``; ``graphbucket.plan`` picks one
per plan (``stream_config``, then ``refined_stream``), and a benchmark or test passes one
as ``plan_mla_decode(..., stream=S)``. ``Fp8Stream`` is how stage 1 streams an fp8 cache, a
plan field of its own. Pure data (no torch at import). The measurements behind each choice
are in bench/NOTES.md, topic "stage-1 kernel (split-KV, tiles, streams, pipelining)" (and
"128 heads (64-row programs, the Gluon seesaw)", "fp8 caches").
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class StreamConfig:
    """Stage-1 tile shape and how many such programs one SM holds at once."""

    block_n: int
    num_stages: int
    ctas_per_sm: int
    min_tiles_per_split: int
    # Launch the merge with programmatic dependent launch (Hopper+): faster with few rows
    # (batch 1 and 8), a wash at batch 64 (bench/results/archive/h200-pdl.md).
    dependent_merge: bool = False
    # Tokens as the dots' rows (``kernels.attend``): warpgroup MMAs straight from shared
    # memory and a double-buffered tile copy on Hopper.
    token_major: bool = False
    # Hints of at most this many tiles merge their (at most FUSED_MERGE_MAX_SPLITS) splits
    # in stage 1; 0: always the merge kernel.
    fused_merge_max_tiles: int = 0
    # Look the next tile's pages up one iteration ahead (``kernels.attend``): the tile then
    # gets num_stages - 1 shared-memory buffers instead of (num_stages - 1) // 2.
    page_ahead: bool = False
    # A fused merge sums the partials in this many column blocks (1: the whole row at once,
    # a second [block_h, kv_lora_rank] float32 tile: 184 registers for WIDE on sm_90
    # against 128 without the merge; 4 blocks: 127, so 4 programs per SM fit again).
    merge_chunks: int = 1
    # Query rows per program (heads; later heads x query tokens); 0: ``head_block_size``.
    block_h: int = 0
    # Warps per stage-1 program; 0: 4 for 16 rows, 8 for more.
    num_warps: int = 0
    # Stage 1 by the two-warpgroup seesaw kernel where its inputs allow (LaunchPlan.seesaw).
    seesaw: bool = False


# Few rows, long splits (thin grids): 64-token tiles, 3 pipeline stages, 94 KB of shared
# memory, so 2 programs per SM.
LONG_STREAM = StreamConfig(block_n=64, num_stages=3, ctas_per_sm=2, min_tiles_per_split=1,
                           dependent_merge=True)
# Many rows (wide grids): 32-token tiles, 2 stages, 56 KB, so 4 programs per SM; up to 128
# tiles its splits merge in stage 1.
WIDE_STREAM = StreamConfig(block_n=32, num_stages=2, ctas_per_sm=4, min_tiles_per_split=4,
                           fused_merge_max_tiles=128)
# Token-major dots on double-buffered 64-token tiles: 164 KB of shared memory at 16 heads,
# so one program per SM.
TOKEN_STREAM = StreamConfig(block_n=64, num_stages=2, ctas_per_sm=1, min_tiles_per_split=1,
                            dependent_merge=True, token_major=True)
# Two KV tiles in flight per head-major program (opt-in as they are). Triton
# gives the paged tile (num_stages - 1) // 2 buffers, the block-table lookup taking half the
# lookahead, so 5 stages double-buffer it: half the tokens of LONG / WIDE per tile keep the
# shared memory (and programs per SM) of those streams. sm_90 compile: LONG_BUFFERED 93 KB,
# 128 registers; WIDE_BUFFERED 56 KB, 126 registers (127 with its fused merge in 4 column
# blocks, 182 in one). Minimum splits and the fused-merge limit keep LONG's and WIDE's
# token counts.
LONG_BUFFERED = StreamConfig(block_n=32, num_stages=5, ctas_per_sm=2, min_tiles_per_split=2,
                             dependent_merge=True)
WIDE_BUFFERED = StreamConfig(block_n=16, num_stages=5, ctas_per_sm=4, min_tiles_per_split=8,
                             fused_merge_max_tiles=256, merge_chunks=4)
# The same tiles double-buffered through ``page_ahead`` at 3 stages instead: the pages of
# tile i+1 are read (synchronously) before its copy is issued, not copied ahead like the
# tiles. LONG plans with short splits stream LONG_PAGE_AHEAD (``plan.refined_stream``).
LONG_PAGE_AHEAD = replace(LONG_BUFFERED, num_stages=3, page_ahead=True)
WIDE_PAGE_AHEAD = replace(WIDE_BUFFERED, num_stages=3, page_ahead=True)
# WIDE with its fused merge in 4 column blocks (opt-in; measured: no gain on its own).
WIDE_CHUNKED_MERGE = replace(WIDE_STREAM, merge_chunks=4)
# 64 query rows per program (64 and more heads): both dots run on Hopper's warpgroup MMA
# (it needs 64-row tiles; 16 and 32 rows compile to mma.sync) and each KV tile feeds 64
# heads, so 128 heads read the cache twice instead of four times. The 64 x 512 float32
# accumulator takes 8 warps (255 registers, no spills on sm_90) and shared memory for one
# program per SM: 64-token tiles, 2 stages (221 KB). At 128 heads it beat 32-row programs
# and 32-token tiles with 3 buffers (bench/NOTES.md, topic "128 heads").
ROWS_STREAM = StreamConfig(block_n=64, num_stages=2, ctas_per_sm=1, min_tiles_per_split=1,
                           dependent_merge=True, block_h=64)
# The same 64-row programs with stage 1 by the Gluon seesaw kernel (kernels/seesaw.py): each
# warpgroup owns whole rows of S for its own tile and half of O's columns, so the two meet
# only to hand over the row max and P. Planned from 64 heads; where the inputs do not allow
# it (seesaw_route.runs_seesaw) the Triton kernel runs the same plan. Faster than ROWS_STREAM's
# Triton stage 1 at 128 heads; splits of at least one step (two tiles), which beat one-tile
# splits (bench/NOTES.md, topic "128 heads").
SEESAW_STREAM = replace(ROWS_STREAM, seesaw=True, min_tiles_per_split=2)
# 32 query rows per program on thin grids (17-31 rows of split-KV plans; balanced plans
# of 17-63 heads; from 32 rows split-KV plans take 64, ``plan.split_kv_block_size``):
# 32-token tiles with the pages looked up ahead and 4 warps, so two programs fit per SM
# (sm_90 compile: 255 registers, 110 KB, no spills; 8 warps take 156-169 registers, one
# program per SM; LONG_STREAM and WIDE_STREAM spill at 4 warps). Faster than 8 warps
# (bench/NOTES.md, topic "verify steps (q_len)").
ROWS32_STREAM = replace(LONG_PAGE_AHEAD, block_h=32, num_warps=4)
# The stream of WIDE plans that merge in stage 1 (``plan.refined_stream``): LONG_BUFFERED's
# double-buffered 32-token tiles with WIDE's split and fused-merge limits in tokens, the
# merge in 4 column blocks.
WIDE_FUSED = replace(LONG_BUFFERED, min_tiles_per_split=4, fused_merge_max_tiles=128,
                     merge_chunks=4, dependent_merge=False)


FP8_DEQUANT_MODES = ("bits", "cvt", "float")  # the choices of Fp8Stream.dequant


@dataclass(frozen=True, slots=True)
class Fp8Stream:
    """How stage 1 streams an fp8 cache (per-tensor and V3.2); a plan field, so a benchmark
    times another setting with ``dataclasses.replace(plan, fp8=Fp8Stream(...))``.

    ``register_prefetch``: head-major fp8 tiles go through registers: the raw bytes of the
    next tile load while the current one is dequantized, once, into the bf16 tile both dots
    read (``REG_PREFETCH`` of kernels/stage1.py); off, the fp8 tile goes to shared memory as
    is and the value dot reads it one byte per load.

    ``tile_tokens`` / ``tile_warps``: a register-prefetched tile at <= 16 query rows,
    whatever the bf16 stream says. The loop carries the dequantized tile, so its registers
    grow with tokens / warps (sm_90, "bits"): 32 / 4 take 240 registers (two programs per
    SM), 64 / 8 take 190 (one), 32 / 8 take 128; 64 / 4 spill. Measured: 32 / 4 fastest
    from 16K on, 64 / 8 15-20 % slower, 32 / 8 30 %, 16 / 4 22-55 % (H200, NOTES "fp8
    tiles read as float16").

    ``dequant`` on a CUDA GPU (``_dequantize``): "bits" reads e4m3 as float16 with integer
    instructions and runs both dots in float16; "cvt" does the same with sm_89's e4m3x2 ->
    f16x2 conversion (within 2 % of "bits"); "float" converts through float32 into q's
    dtype (1.0-1.3x slower). The interpreter has no inline assembly: it takes "float".

    ``raw_vec``: bytes of an fp8 tile row each thread loads at once (0: the compiler's
    choice, 16). With 16 a thread holds 32 bytes of the converted f16 row and its shared
    stores land 6.2-way bank-conflicted; with 8 they are 16 bytes, consecutive across the
    warp: per-tensor 9-10 % faster, V3.2 3-5 %; 4 bytes lose (H200, NOTES "fp8 tiles
    loaded 8 bytes a thread").
    """

    register_prefetch: bool = True
    tile_tokens: int = 32
    tile_warps: int = 4
    dequant: str = "bits"
    raw_vec: int = 8

    def __post_init__(self) -> None:
        if self.dequant not in FP8_DEQUANT_MODES:
            raise ValueError(f"Fp8Stream.dequant={self.dequant!r}; expected one of "
                             f"{FP8_DEQUANT_MODES}")

    def describe(self) -> str:
        if not self.register_prefetch:
            return "noprefetch"
        return f"{self.dequant}-{self.tile_tokens}x{self.tile_warps}-v{self.raw_vec}"
