"""Host launcher for balanced split-KV MLA decode: plan items, stream them, merge.

Graph-safe like ``mla_decode``: host metadata and the frozen plan only; the partition
of the step is computed by a kernel into the workspace's static buffers, so replays with
new ``seq_lens`` re-partition on the device.
"""

from __future__ import annotations

import torch

from graphbucket.kernels.balanced import (
    balanced_merge_kernel,
    balanced_stage1_kernel,
    plan_tile_ranges_kernel,
    plan_work_items_kernel,
)
from graphbucket.kernels.launch import (
    LOG2E,
    SEESAW_TILE,
    SplitWorkspace,
    cache_stream_args,
    check_mla_decode_args,
    kv_tile_tokens,
    pdl_capable,
)
from graphbucket.kernels.seesaw_route import runs_seesaw, runs_seesaw_over_fp8, seesaw_step_args
from graphbucket.plan import LaunchPlan, pow2_ceil

# Requests scanned per step by the planner and by each item's owner search: batches up
# to this size take one step.
MAX_SCAN_BLOCK = 256


def scan_block(batch_size: int) -> int:
    return min(MAX_SCAN_BLOCK, max(16, pow2_ceil(batch_size)))


def mla_decode_balanced(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, out: torch.Tensor, workspace: SplitWorkspace,
                        *, plan: LaunchPlan, sm_scale: float, lse: torch.Tensor | None = None,
                        kv_scale: torch.Tensor | None = None,
                        check: bool = True, partition: bool = True) -> torch.Tensor:
    """``mla_decode`` for a balanced plan (``plan_balanced_mla_decode``): same arguments,
    same result; the workspace needs item buffers for ``plan.max_work_items`` items.
    Three launches on fixed grids: item planner, persistent stage 1 (the Gluon seesaw's,
    one program per item, or one per SM over tile ranges for ``plan.tile_ranges``, where
    the plan asks for it and ``runs_seesaw`` holds), merge. ``partition=False`` skips the
    planner: the workspace holds this plan's partition of these ``seq_lens`` already (an
    earlier layer of the same step wrote it; stage 1 and the merge only read it)."""
    if not plan.balanced:
        raise ValueError(f"{plan.describe()} is a split-KV plan: launch it with mla_decode")
    if check:
        check_mla_decode_args(q, kv_cache, block_table, seq_lens, out, plan, workspace, lse,
                              kv_scale)
    block_n = kv_tile_tokens(plan, kv_cache)
    seesaw = runs_seesaw(plan, q, kv_cache, kv_scale=kv_scale)
    # Over an fp8 cache, the seesaw runs with its converter.
    if not seesaw:
        seesaw = runs_seesaw_over_fp8(plan, q, kv_cache, kv_scale=kv_scale)
    if seesaw and plan.tile_ranges:
        if partition:
            launch_range_planner(seq_lens, workspace, plan=plan)
        launch_seesaw_range_stage1(q, kv_cache, block_table, seq_lens, workspace, plan=plan,
                                   sm_scale=sm_scale, out=out, lse=lse, kv_scale=kv_scale)
    elif seesaw:
        if partition:  # in the seesaw's tiles, whatever the cache's format
            launch_item_planner(seq_lens, workspace, plan=plan, block_n=SEESAW_TILE)
        launch_seesaw_balanced_stage1(q, kv_cache, block_table, seq_lens, workspace,
                                      plan=plan, sm_scale=sm_scale, out=out, lse=lse,
                                      kv_scale=kv_scale)
    else:  # the plan's chunks (of a range plan too) by the Triton stage 1
        if partition:
            launch_item_planner(seq_lens, workspace, plan=plan, block_n=block_n)
        launch_balanced_stage1(q, kv_cache, block_table, seq_lens, out, workspace, plan=plan,
                               sm_scale=sm_scale, lse=lse, block_n=block_n, kv_scale=kv_scale)
    # The planner listed the requests to merge: stage 1 wrote the output of a request left
    # whole (one item or segment).
    charged = seesaw and plan.charged_ranges  # (a charged cut is a tile-range plan)
    launch_balanced_merge(out, workspace, plan=plan, lse=lse,
                          dependent=charged and pdl_capable(out.device))
    return out


def launch_item_planner(seq_lens: torch.Tensor, workspace: SplitWorkspace, *,
                        plan: LaunchPlan, block_n: int) -> None:
    """Writes ``item_indptr[:batch + 1]``, ``chunk_tiles`` and the merge's list
    (``merge_rows``: the requests of other than one item) from the live lengths."""
    plan_work_items_kernel[(1,)](
        seq_lens, workspace.item_indptr, workspace.chunk_tiles, workspace.merge_rows,
        plan.batch_size, plan.persistent_programs,
        BLOCK_N=block_n, MIN_CHUNK_TILES=plan.min_chunk_tiles,
        BLOCK_B=scan_block(plan.batch_size), FIT_ITEMS=plan.fit_items,
    )


def launch_balanced_stage1(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, out: torch.Tensor,
                           workspace: SplitWorkspace, *, plan: LaunchPlan, sm_scale: float,
                           lse: torch.Tensor | None, block_n: int,
                           kv_scale: torch.Tensor | None = None):
    """Persistent stage 1 alone (unchecked); returns Triton's handle of the kernel."""
    part_o, part_lse = workspace.item_o, workspace.item_lse
    return balanced_stage1_kernel[plan.grid](
        q, kv_cache, block_table, seq_lens, workspace.item_indptr, workspace.chunk_tiles,
        out, out if lse is None else lse, part_o, part_lse,
        seq_lens if kv_scale is None else kv_scale,
        plan.batch_size, plan.persistent_programs, plan.num_heads, sm_scale * LOG2E,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0),
        out.stride(0), out.stride(1),
        0 if lse is None else lse.stride(0),
        part_o.stride(0), part_o.stride(1),
        part_lse.stride(0),
        PAGE_SIZE=kv_cache.shape[1], KV_LORA_RANK=plan.kv_lora_rank, ROPE_DIM=plan.qk_rope_dim,
        BLOCK_H=plan.block_h, BLOCK_N=block_n, BLOCK_B=scan_block(plan.batch_size),
        TILE_IN_PAGE=kv_cache.shape[1] % block_n == 0, WRITE_LSE=lse is not None,
        DOT_PRECISION="ieee" if kv_cache.dtype == torch.float32 else "tf32",
        TOKEN_MAJOR=plan.token_major, PAGE_AHEAD=plan.page_ahead, SCALED=kv_scale is not None,
        **cache_stream_args(plan, kv_cache), num_stages=plan.num_stages,
    )


def launch_seesaw_balanced_stage1(q: torch.Tensor, kv_cache: torch.Tensor,
                                  block_table: torch.Tensor, seq_lens: torch.Tensor,
                                  workspace: SplitWorkspace, *, plan: LaunchPlan,
                                  sm_scale: float, out: torch.Tensor,
                                  lse: torch.Tensor | None = None, pv_cols: int | None = None,
                                  kv_scale: torch.Tensor | None = None,
                                  lazy_rescale: bool | None = None) -> None:
    """Stage 1 by the Gluon seesaw over the step's items (unchecked; where ``runs_seesaw``
    or ``runs_seesaw_over_fp8`` holds): a request of one item gets its output in ``out``
    (and ``lse``), every other item its partial in the workspace, for the merge to combine.
    ``pv_cols``: the PV width (``kernels.seesaw_step``; default the kernel's);
    ``lazy_rescale``: the lazy step (``kernels.seesaw_lazy``; by default over a bf16
    cache). An fp8 cache (a per-tensor one with its ``kv_scale``) is read by the fp8
    seesaw's converter; its items must be planned in 64-token tiles."""
    # Imported here: Gluon's sm_90 modules load only where the seesaw runs.
    from graphbucket.kernels.seesaw import ROWS
    from graphbucket.kernels.seesaw_balanced import seesaw_balanced_stage1_kernel

    step = seesaw_step_args(pv_cols, lazy_rescale, fp8=kv_cache.dtype != torch.bfloat16)
    batch, heads, _ = q.shape
    q_desc, kv_desc, fp8_args = _seesaw_inputs(q, kv_cache, kv_scale)
    part_o, part_lse = workspace.item_o, workspace.item_lse
    seesaw_balanced_stage1_kernel[(-(-heads // ROWS.value), plan.max_work_items)](
        q_desc, kv_desc, block_table, seq_lens, workspace.item_indptr, workspace.chunk_tiles,
        part_o, part_lse, out, part_lse if lse is None else lse, batch, heads,
        sm_scale * LOG2E, block_table.stride(0), part_o.stride(0), part_o.stride(1),
        part_lse.stride(0), out.stride(0), out.stride(1), 0 if lse is None else lse.stride(0),
        PAGE_SIZE=kv_cache.shape[1], BLOCK_B=max(128, scan_block(batch)),
        WRITE_LSE=lse is not None, **step, **fp8_args,
        num_warps=4)


def _seesaw_inputs(q: torch.Tensor, kv_cache: torch.Tensor, kv_scale: torch.Tensor | None
                   ) -> tuple[object, object, dict]:
    """(q descriptor, cache descriptor, fp8 arguments) of a seesaw launch: TMA descriptors
    for a bf16 cache; for an fp8 one none, and the converter's inputs (``KV_FP8`` 1
    per-tensor, 2 V3.2)."""
    from graphbucket.kernels.seesaw import descriptors

    fp8_format = {torch.float8_e4m3fn: 1, torch.uint8: 2}.get(kv_cache.dtype, 0)
    if fp8_format:
        return None, None, {"KV_FP8": fp8_format, "Q": q, "KV8": kv_cache, "KV_SCALE": kv_scale,
                            "q_rows": q.shape[0] * q.shape[1]}
    return (*descriptors(q, kv_cache), {})


def launch_range_planner(seq_lens: torch.Tensor, workspace: SplitWorkspace, *,
                         plan: LaunchPlan) -> None:
    """Writes ``tile_indptr`` and ``item_indptr`` (``[:batch + 1]``) and the tiles per range
    (``chunk_tiles``) from the live lengths: the seesaw's 64-token tiles; for a charged cut
    the programs' bounds and the requests' first programs instead of the tiles per range.
    The merge's list (``merge_rows``): the requests of other than one segment (stage 1
    writes a whole request's output)."""
    charged = plan.charged_ranges
    plan_tile_ranges_kernel[(1,)](
        seq_lens, workspace.tile_indptr, workspace.item_indptr, workspace.chunk_tiles,
        workspace.range_bounds if charged else workspace.chunk_tiles,
        workspace.first_program if charged else workspace.chunk_tiles, workspace.merge_rows,
        plan.batch_size, plan.persistent_programs,
        BLOCK_N=64, MIN_RANGE_TILES=plan.min_chunk_tiles,
        BLOCK_B=scan_block(plan.batch_size),
        CHARGE=plan.range_charge_tiles if charged else 0,
        BLOCK_P=min(256, pow2_ceil(plan.persistent_programs + 1)), BOUNDS=charged,
    )


def launch_seesaw_range_stage1(q: torch.Tensor, kv_cache: torch.Tensor,
                               block_table: torch.Tensor, seq_lens: torch.Tensor,
                               workspace: SplitWorkspace, *, plan: LaunchPlan,
                               sm_scale: float, out: torch.Tensor,
                               lse: torch.Tensor | None = None,
                               pv_cols: int | None = None,
                               kv_scale: torch.Tensor | None = None,
                               lazy_rescale: bool | None = None) -> None:
    """Stage 1 by the Gluon seesaw on persistent programs over tile ranges (unchecked;
    where ``runs_seesaw`` holds): one partial per (request, program) segment; a request
    left whole gets its output in ``out`` (and ``lse``) instead.
    ``pv_cols``: the PV width (``kernels.seesaw_step``; default the kernel's);
    ``lazy_rescale``: the lazy step (``kernels.seesaw_lazy``; by default over a bf16
    cache). An fp8 cache (where ``runs_seesaw_over_fp8`` holds; a per-tensor one with its
    ``kv_scale``) is read by the fp8 seesaw's converter."""
    from graphbucket.kernels.seesaw import ROWS
    from graphbucket.kernels.seesaw_balanced import seesaw_range_stage1_kernel

    step = seesaw_step_args(pv_cols, lazy_rescale, fp8=kv_cache.dtype != torch.bfloat16)
    batch, heads, _ = q.shape
    q_desc, kv_desc, fp8_args = _seesaw_inputs(q, kv_cache, kv_scale)
    part_o, part_lse = workspace.item_o, workspace.item_lse
    charged = plan.charged_ranges
    seesaw_range_stage1_kernel[(-(-heads // ROWS.value), plan.persistent_programs)](
        q_desc, kv_desc, block_table, seq_lens, workspace.tile_indptr, workspace.item_indptr,
        workspace.chunk_tiles, workspace.range_bounds if charged else workspace.chunk_tiles,
        workspace.first_program if charged else workspace.chunk_tiles,
        part_o, part_lse, out, part_lse if lse is None else lse, batch, heads, sm_scale * LOG2E,
        block_table.stride(0), part_o.stride(0), part_o.stride(1), part_lse.stride(0),
        out.stride(0), out.stride(1), 0 if lse is None else lse.stride(0),
        PAGE_SIZE=kv_cache.shape[1], BLOCK_B=max(128, scan_block(batch)), CHARGED=charged,
        WRITE_LSE=lse is not None, **step, **fp8_args,
        num_warps=4)


def launch_balanced_merge(out: torch.Tensor, workspace: SplitWorkspace, *, plan: LaunchPlan,
                          lse: torch.Tensor | None, dependent: bool = False) -> None:
    """Merge alone (unchecked), by ``plan.merge_programs`` persistent programs: the
    requests the planner listed in ``workspace.merge_rows`` (of two or more items), and
    zeros for padding rows.
    ``dependent``: a programmatic dependent launch (sm_90+), after a stage 1 that lets it
    start early (the charged seesaw's)."""
    part_o, part_lse = workspace.item_o, workspace.item_lse
    balanced_merge_kernel[plan.merge_grid](
        part_o, part_lse, workspace.item_indptr, workspace.merge_rows, out,
        out if lse is None else lse, plan.num_heads,
        part_o.stride(0), part_o.stride(1),
        part_lse.stride(0),
        out.stride(0), out.stride(1),
        0 if lse is None else lse.stride(0),
        BLOCK_S=plan.merge_block_s, BLOCK_DV=plan.merge_block_dv,
        DV_BLOCKS=-(-plan.kv_lora_rank // plan.merge_block_dv),
        WRITE_LSE=lse is not None, BLOCK_HM=plan.merge_block_h,
        MERGE_PREFETCH=plan.merge_prefetch, num_warps=plan.merge_num_warps,
        **({"USE_GDC": True, "launch_pdl": True} if dependent else {}),
    )
