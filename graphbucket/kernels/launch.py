"""Host launchers for the split-KV MLA decode kernels: checks, workspace, launch.

Graph safety: ``mla_decode`` reads only tensor metadata on the host (shapes, strides,
dtypes, devices) and the frozen ``LaunchPlan``; it never reads device memory and never
allocates, so it can be captured into a CUDA graph and replayed with new ``seq_lens``.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

from graphbucket import fp8
from graphbucket.kernels.merge import mla_decode_merge_kernel
from graphbucket.kernels.seesaw_route import runs_seesaw, runs_seesaw_over_fp8, seesaw_step_args
from graphbucket.kernels.stage1 import mla_decode_stage1_kernel
from graphbucket.plan import LaunchPlan

LOG2E = 1.4426950408889634
# The Gluon seesaws' tile in tokens (``seesaw_layout.TILE``): the unit their splits are cut in.
SEESAW_TILE = 64

@dataclass(frozen=True, slots=True)
class SplitWorkspace:
    """Persistent stage-1 -> stage-2 buffers, sized once for the largest plan.

    partial_o:   [max_batch, num_heads, max_splits, kv_lora_rank] float32
    partial_lse: [max_batch, num_heads, max_splits] float32 (log2 units)
    Any plan with batch <= max_batch, heads <= num_heads and splits <= max_splits uses
    views of these.

    merge_counters: [max_batch, num_heads] int32, zero between launches: the splits of a
    (request, head block) that have finished, for plans that merge in stage 1.

    Balanced plans (``max_items`` > 0) use the item buffers instead:
    item_o [max_items, num_heads, kv_lora_rank] and item_lse [max_items, num_heads]
    float32 partials, item_indptr [max_batch + 1] and chunk_tiles [1] int32 (the
    device-side partition of the step), and tile_indptr [max_batch + 1] int32 (the
    requests' first tiles, for plans over tile ranges; ``chunk_tiles`` then holds the
    tiles per range); range_bounds [max_items + 1] and first_program [max_batch] int32
    (charged tile ranges: each program's first tile, each request's first program);
    merge_rows [max_batch + 1] int32 (how many requests the merge writes, then which).
    """

    partial_o: torch.Tensor
    partial_lse: torch.Tensor
    item_o: torch.Tensor | None = None
    item_lse: torch.Tensor | None = None
    item_indptr: torch.Tensor | None = None
    chunk_tiles: torch.Tensor | None = None
    tile_indptr: torch.Tensor | None = None
    range_bounds: torch.Tensor | None = None
    first_program: torch.Tensor | None = None
    merge_rows: torch.Tensor | None = None
    merge_counters: torch.Tensor | None = None

    @classmethod
    def allocate(cls, max_batch: int, num_heads: int, max_splits: int, kv_lora_rank: int,
                 device: torch.device | str, *, max_items: int = 0) -> SplitWorkspace:
        # A balanced-only workspace (no plan with splits) keeps no split partials.
        splits = 0 if max_items > 0 and max_splits <= 1 else max(1, max_splits)
        shape = (max_batch, num_heads, splits)
        f32 = {"dtype": torch.float32, "device": device}
        items = {}
        if max_items > 0:
            items = {"item_o": torch.empty(max_items, num_heads, kv_lora_rank, **f32),
                     "item_lse": torch.empty(max_items, num_heads, **f32),
                     "item_indptr": torch.zeros(max_batch + 1, dtype=torch.int32,
                                                device=device),
                     "chunk_tiles": torch.zeros(1, dtype=torch.int32, device=device),
                     "tile_indptr": torch.zeros(max_batch + 1, dtype=torch.int32,
                                                device=device),
                     # A plan's programs are fewer than its items (G <= G + live - 1).
                     "range_bounds": torch.zeros(max_items + 1, dtype=torch.int32,
                                                 device=device),
                     "first_program": torch.zeros(max_batch, dtype=torch.int32,
                                                  device=device),
                     "merge_rows": torch.zeros(max_batch + 1, dtype=torch.int32,
                                               device=device)}
        counters = torch.zeros(max_batch, num_heads, dtype=torch.int32, device=device)
        return cls(torch.empty(*shape, kv_lora_rank, **f32), torch.empty(*shape, **f32),
                   merge_counters=counters, **items)

    def fits(self, plan: LaunchPlan) -> bool:
        b, h, s, d = self.partial_o.shape
        # Fewer heads than allocated is fine: the kernels index through the strides.
        if plan.num_heads > h or plan.kv_lora_rank != d:
            return False
        if plan.balanced:
            return self.item_o is not None and plan.max_work_items <= self.item_o.shape[0] \
                and plan.batch_size < self.item_indptr.shape[0] \
                and self.merge_rows is not None and plan.batch_size < self.merge_rows.shape[0] \
                and (not plan.tile_ranges or self.tile_indptr is not None) \
                and (not plan.charged_ranges or (
                    self.range_bounds is not None
                    and plan.persistent_programs < self.range_bounds.shape[0]))
        if plan.merges_in_stage1 and (self.merge_counters is None
                                 or self.merge_counters.shape[0] < plan.batch_size
                                 or self.merge_counters.shape[1] < plan.num_head_blocks):
            return False
        return plan.batch_size <= b and plan.num_kv_splits <= s


def _fail(name: str, got, expected: str, fix: str) -> None:
    raise ValueError(f"{name}: got {got}, expected {expected}. {fix}")


def cpu_dtype_error(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why ``dtype`` cannot run the MLA kernels on ``device``, and the fix; or None.

    On a CPU, Triton kernels run only in Triton's interpreter, whose bfloat16 ``tl.dot``
    is wrong (relative error ~1e9 against float64; float16 2e-4, float32 3e-7)."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return None
    return ("bfloat16 on the CPU: graphbucket's Triton kernels run there in Triton's "
            "interpreter, whose bfloat16 tl.dot gives wrong results. Use float32 (the CPU "
            "default of MLADecoder) or float16, or a CUDA device")


def check_mla_decode_args(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                          seq_lens: torch.Tensor, out: torch.Tensor, plan: LaunchPlan,
                          workspace: SplitWorkspace | None, lse: torch.Tensor | None,
                          kv_scale: torch.Tensor | None = None) -> None:
    """Validate shapes, dtypes and devices against the plan (host metadata only, no sync)."""
    d_qk = plan.kv_lora_rank + plan.qk_rope_dim
    bs, nh = plan.batch_size, plan.num_heads
    for name, t in (("q", q), ("kv_cache", kv_cache), ("block_table", block_table),
                    ("seq_lens", seq_lens), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != q.device:
            _fail(f"{name}.device", t.device, str(q.device), "Keep every input on one device.")
    if tuple(q.shape) != (bs, nh, d_qk):
        _fail("q.shape", tuple(q.shape), f"{(bs, nh, d_qk)} from the plan",
              "Plan with this batch size and head count, or pass a view of the static buffer.")
    # The cache's format (from its dtype) checks its rows, q's dtype and the scale.
    fp8.cache_format_of(kv_cache).check_launch(q, kv_cache, kv_scale,
                                               kv_lora_rank=plan.kv_lora_rank,
                                               qk_rope_dim=plan.qk_rope_dim)
    if any(cpu_dtype_error(t.device, t.dtype) for t in (q, kv_cache, out)):
        raise ValueError(f"q={q.dtype}, kv_cache={kv_cache.dtype}, out={out.dtype}: "
                         + cpu_dtype_error(q.device, torch.bfloat16))
    if kv_cache.stride(2) != 1 or q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("q, kv_cache and out need a contiguous last dimension")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] < bs:
        _fail("block_table", f"{block_table.dtype} {tuple(block_table.shape)}",
              f"int32 [>= {bs}, max_pages]", "Pass an int32 table with one row per request.")
    if seq_lens.dtype != torch.int32 or seq_lens.dim() != 1 or seq_lens.shape[0] < bs:
        _fail("seq_lens", f"{seq_lens.dtype} {tuple(seq_lens.shape)}", f"int32 [>= {bs}]",
              "Pass int32 lengths, one per request.")
    if tuple(out.shape) != (bs, nh, plan.kv_lora_rank):
        _fail("out.shape", tuple(out.shape), str((bs, nh, plan.kv_lora_rank)),
              "Allocate out as [batch, heads, kv_lora_rank].")
    if lse is not None and (lse.dtype != torch.float32 or tuple(lse.shape) != (bs, nh)):
        _fail("lse", f"{lse.dtype} {tuple(lse.shape)}", f"float32 {(bs, nh)}",
              "Pass lse=None or a float32 [batch, heads] tensor.")
    block_c = plan.kv_lora_rank // max(1, plan.merge_chunks)
    if plan.merges_in_stage1 and (plan.merge_chunks < 1 or block_c * plan.merge_chunks
                                  != plan.kv_lora_rank or block_c & (block_c - 1)):
        _fail("plan.merge_chunks", plan.merge_chunks,
              f"a divisor of {plan.kv_lora_rank} leaving power-of-two column blocks",
              "Pick 1, 2, 4 or 8 column blocks.")
    if plan.use_stage2 and (workspace is None or not workspace.fits(plan)):
        got = None if workspace is None else tuple(workspace.partial_o.shape)
        if plan.balanced:
            got = None if workspace is None or workspace.item_o is None else \
                tuple(workspace.item_o.shape)
            want = f"item_o covering {plan.max_work_items} work items, batch {bs}"
        else:
            want = f"partial_o covering {plan.workspace_shape}"
        _fail("workspace", got, want,
              "Allocate a SplitWorkspace covering every plan you will launch.")


def check_q_len(plan: LaunchPlan, q_len: int) -> None:
    """q_len tokens folded into the plan's rows: a positive int dividing its head count."""
    if isinstance(q_len, bool) or not isinstance(q_len, int) or q_len < 1:
        raise ValueError(f"q_len must be a positive int, got {q_len!r}")
    if plan.num_heads % q_len:
        _fail("q_len", q_len, f"a divisor of the plan's {plan.num_heads} rows",
              "Plan with q_len x heads rows (query tokens folded into the heads).")
    if q_len > 1 and plan.token_major:
        _fail("q_len", q_len, "1 with a token-major plan",
              "Multi-token decode runs the head-major stage 1 (plan without TOKEN_STREAM).")


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, out: torch.Tensor, workspace: SplitWorkspace | None,
               *, plan: LaunchPlan, sm_scale: float, lse: torch.Tensor | None = None,
               kv_scale: torch.Tensor | None = None, q_len: int = 1,
               check: bool = True) -> torch.Tensor:
    """Paged MLA decode: ``out = softmax(q K^T * sm_scale) V`` per request and head.

    q [B, H, kv_lora_rank + qk_rope_dim], kv_cache [num_pages, page_size, same] (bf16/fp16/
    fp32, V = the first kv_lora_rank columns), block_table [>=B, max_pages] int32,
    seq_lens [>=B] int32 on the device, out [B, H, kv_lora_rank] (written in full);
    lse [B, H] float32 (natural log) if given. Rows with seq_len 0 give zeros. bf16 on
    the CPU is refused (``cpu_dtype_error``). An fp8
    (e4m3) cache takes ``kv_scale`` (float32 [1] on the device: value = stored * scale),
    with a bf16 / fp16 q and out. A uint8 cache [num_pages, page_size, 656] is DeepSeek-
    V3.2's fp8 format (``graphbucket.fp8.pack_v32``): bf16 / fp16 q and out, no kv_scale.

    Multi-token decode (a verify step of ``q_len`` tokens per request): q [B, q_len * H,
    D] is q [B, q_len, H, D] with the tokens folded into the rows (plan with q_len * H
    heads), out likewise; ``seq_lens`` count the q_len new tokens, and token j attends to
    the positions before seq_len - q_len + j + 1. A row with no position (seq_len < q_len)
    gives zeros; the runner rejects such lengths on the host.
    Graph-safe: no device reads, no allocation; the plan fixes grid and split count.
    """
    if plan.balanced:
        raise ValueError(f"{plan.describe()} is a balanced plan: launch it with "
                         "graphbucket.kernels.mla_decode_balanced")
    if check:
        check_mla_decode_args(q, kv_cache, block_table, seq_lens, out, plan, workspace, lse,
                              kv_scale)
        check_q_len(plan, q_len)
    workspace = workspace if plan.use_stage2 else None
    block_n = kv_tile_tokens(plan, kv_cache)
    if runs_seesaw(plan, q, kv_cache, q_len=q_len, kv_scale=kv_scale):
        launch_seesaw_stage1(q, kv_cache, block_table, seq_lens, out, workspace, plan=plan,
                             sm_scale=sm_scale, lse=lse, q_len=q_len)
    elif runs_seesaw_over_fp8(plan, q, kv_cache, q_len=q_len, kv_scale=kv_scale):
        launch_seesaw_fp8_stage1(q, kv_cache, block_table, seq_lens, out, workspace, plan=plan,
                                 sm_scale=sm_scale, lse=lse, kv_scale=kv_scale, q_len=q_len)
        block_n = SEESAW_TILE  # its splits are cut in 64-token tiles
    else:
        launch_stage1(q, kv_cache, block_table, seq_lens, out, workspace, plan=plan,
                      kv_scale=kv_scale, q_len=q_len, sm_scale=sm_scale, lse=lse)
    if plan.merge_kernel:
        launch_merge(seq_lens, out, workspace, plan=plan, lse=lse, block_n=block_n)
    return out


def default_sm_scale(qk_nope_dim: int = 128, qk_rope_dim: int = 64) -> float:
    """Softmax scale of DeepSeek-V3-style MLA: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim)."""
    return 1.0 / math.sqrt(qk_nope_dim + qk_rope_dim)


def _workspace_args(workspace: SplitWorkspace | None, out: torch.Tensor):
    if workspace is None:  # one-split variant never touches the workspace
        return out, out, (0, 0, 0), (0, 0)
    part_o, part_lse = workspace.partial_o, workspace.partial_lse
    return part_o, part_lse, part_o.stride()[:3], part_lse.stride()[:2]


def _merge_counters(workspace: SplitWorkspace | None, plan: LaunchPlan,
                    fallback: torch.Tensor) -> torch.Tensor:
    """The workspace's counters for a fused merge; any int32 tensor when unused."""
    if plan.merges_in_stage1:
        return workspace.merge_counters
    return fallback


@functools.cache
def pdl_capable(device: torch.device) -> bool:
    """Whether ``device`` launches kernels as programmatic dependents (sm_90 and later)."""
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def use_pdl(plan: LaunchPlan, device: torch.device) -> bool:
    """Programmatic dependent launch of the merge, when the plan asks for it and the GPU
    has it (sm_90 and later): the merge grid launches while stage 1 runs and waits on the
    device for its partials."""
    return plan.merge_kernel and plan.dependent_merge and pdl_capable(device)


def fp8_dequant(plan: LaunchPlan, device: torch.device) -> str:
    """The plan's fp8 dequantization where it can run (a CUDA device, not the
    interpreter), else "float"."""
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return plan.fp8.dequant if device.type == "cuda" and not interpreted else "float"


def register_prefetch(plan: LaunchPlan, element_size: int) -> bool:
    """Whether stage 1 streams this plan's fp8 tiles through registers."""
    return plan.fp8.register_prefetch and element_size == 1 and not plan.token_major


def stage1_warps(plan: LaunchPlan, element_size: int) -> int:
    """Warps per stage-1 program for this cache's element size."""
    if register_prefetch(plan, element_size) and plan.block_h <= 16:
        return plan.fp8.tile_warps
    return plan.num_warps


def cache_stream_args(plan: LaunchPlan, kv_cache: torch.Tensor) -> dict:
    """How both stage-1 kernels (split-KV and balanced) read this cache: its format, the
    fp8 register prefetch and dequantization (``plan.fp8``), and the warps that follow."""
    size = kv_cache.element_size()
    return {"KV_FORMAT": fp8.cache_format_of(kv_cache).kernel_tag,
            "REG_PREFETCH": register_prefetch(plan, size),
            "DEQUANT": fp8_dequant(plan, kv_cache.device), "RAW_VEC": plan.fp8.raw_vec,
            "num_warps": stage1_warps(plan, size)}


def tile_tokens(plan: LaunchPlan, element_size: int, *, v32: bool = False) -> int:
    """``kv_tile_tokens`` of a cache known by its element size (``v32``: V3.2 rows)."""
    return _tile_tokens(plan, fp8.format_of_size(element_size, v32=v32), element_size)


def kv_tile_tokens(plan: LaunchPlan, kv_cache: torch.Tensor) -> int:
    """Tokens per KV tile for this cache: the register-prefetched fp8 tile, else its
    format's (``CacheFormat.tile_tokens``: the plan's for 2-byte rows, fewer for wider
    elements and V3.2 rows). Both stages must use the same count (it fixes every split's
    token range)."""
    return _tile_tokens(plan, fp8.cache_format_of(kv_cache), kv_cache.element_size())


def _tile_tokens(plan: LaunchPlan, fmt: fp8.CacheFormat, element_size: int) -> int:
    if register_prefetch(plan, element_size):
        # The next tile lives in registers: the plan's fp8 tile at 16 rows, 16 tokens where
        # the accumulator is larger (32 tokens spill 1-1.3 KB at 32 rows).
        return plan.fp8.tile_tokens if plan.block_h <= 16 else 16
    return fmt.tile_tokens(plan.block_n, plan.block_h, element_size)


def launch_stage1(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, out: torch.Tensor, workspace: SplitWorkspace | None,
                  *, plan: LaunchPlan, sm_scale: float, lse: torch.Tensor | None,
                  kv_scale: torch.Tensor | None = None, q_len: int = 1):
    """Stage 1 alone (unchecked). One split: writes ``out``; else partials in ``workspace``.

    Returns Triton's handle of the launched kernel (registers, shared memory, spills).
    """
    part_o, part_lse, po_strides, pl_strides = _workspace_args(workspace, out)
    block_n = kv_tile_tokens(plan, kv_cache)
    counters = _merge_counters(workspace, plan, seq_lens)
    return mla_decode_stage1_kernel[plan.grid](
        q, kv_cache, block_table, seq_lens, out, out if lse is None else lse, part_o, part_lse,
        counters, seq_lens if kv_scale is None else kv_scale, plan.num_kv_splits, plan.num_heads,
        q_len, plan.num_heads // q_len,
        counters.stride(0) if counters is not seq_lens else 0, sm_scale * LOG2E,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1),
        block_table.stride(0),
        out.stride(0), out.stride(1),
        0 if lse is None else lse.stride(0),
        *po_strides, *pl_strides,
        PAGE_SIZE=kv_cache.shape[1], KV_LORA_RANK=plan.kv_lora_rank, ROPE_DIM=plan.qk_rope_dim,
        BLOCK_H=plan.block_h, BLOCK_N=block_n,
        TILE_IN_PAGE=kv_cache.shape[1] % block_n == 0, ONE_SPLIT=not plan.use_stage2,
        WRITE_LSE=lse is not None, USE_GDC=use_pdl(plan, q.device),
        DOT_PRECISION="ieee" if kv_cache.dtype == torch.float32 else "tf32",
        TOKEN_MAJOR=plan.token_major, FUSED_MERGE=plan.merges_in_stage1,
        PAGE_AHEAD=plan.page_ahead,
        MERGE_CHUNKS=plan.merge_chunks if plan.merges_in_stage1 else 1,
        SCALED=kv_scale is not None, MULTI_TOKEN=q_len > 1,
        **cache_stream_args(plan, kv_cache), num_stages=plan.num_stages,
    )


def launch_seesaw_stage1(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, out: torch.Tensor,
                         workspace: SplitWorkspace | None, *, plan: LaunchPlan, sm_scale: float,
                         lse: torch.Tensor | None, one_rescale: bool = False,
                         q_len: int = 1, pv_cols: int | None = None,
                         lazy_rescale: bool | None = None) -> None:
    """Stage 1 by the Gluon seesaw kernel (unchecked; where ``runs_seesaw`` holds). One
    split: writes ``out`` (and ``lse``); else the partials the merge kernel reads.
    ``one_rescale``: the step order kept for comparison (``seesaw_step._one_rescale_step``);
    ``pv_cols`` 64 or 256: the PV instructions' width (``seesaw_step``; 256 by default).
    ``lazy_rescale``: the lazy step (``seesaw_lazy``; 256-column PVs, the default order),
    by default wherever it runs; False: the eager rescale (``seesaw_step_args``).
    ``q_len`` above 1: q's rows are q_len tokens x heads, each token with its causal
    limit."""
    step = seesaw_step_args(pv_cols, lazy_rescale, one_rescale)
    # Imported here: Gluon's sm_90 modules load only where the seesaw runs.
    from graphbucket.kernels.seesaw import ROWS, TILE, descriptors, seesaw_stage1_kernel

    batch, heads, _ = q.shape
    q_desc, kv_desc = descriptors(q, kv_cache)
    part_o, part_lse, po_strides, pl_strides = _workspace_args(workspace, out)
    seesaw_stage1_kernel[(-(-heads // ROWS.value), batch, plan.num_kv_splits)](
        q_desc, kv_desc, block_table, seq_lens, out, out if lse is None else lse, part_o,
        part_lse, plan.num_kv_splits, heads, sm_scale * LOG2E,
        block_table.stride(0), out.stride(0), out.stride(1),
        0 if lse is None else lse.stride(0), *po_strides, *pl_strides,
        PAGE_SIZE=TILE.value, ONE_SPLIT=not plan.use_stage2, WRITE_LSE=lse is not None,
        **step, **({"Q_LEN": q_len, "rows_per_token": heads // q_len} if q_len > 1 else {}),
        num_warps=4)


def launch_seesaw_fp8_stage1(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                             seq_lens: torch.Tensor, out: torch.Tensor,
                             workspace: SplitWorkspace | None, *, plan: LaunchPlan,
                             sm_scale: float, lse: torch.Tensor | None,
                             kv_scale: torch.Tensor | None, q_len: int = 1,
                             prefetch_ahead: int = 1) -> None:
    """Stage 1 by the Gluon seesaw over an fp8 cache (unchecked; where
    ``runs_seesaw_over_fp8`` holds): a
    per-tensor cache with its ``kv_scale``, or a V3.2 cache (uint8 rows, ``kv_scale``
    None). The same grid, splits (64-token tiles), outputs and verify steps (``q_len``) as
    ``launch_seesaw_stage1``: the merge combines its splits with ``block_n`` 64.
    ``prefetch_ahead``: the converter's L2 prefetch distance in steps (under trial)."""
    if not isinstance(prefetch_ahead, int) or prefetch_ahead < 1:
        raise ValueError(f"prefetch_ahead must be an int >= 1 (steps), got {prefetch_ahead!r}")
    from graphbucket.kernels.seesaw_fp8 import seesaw_fp8_stage1_kernel
    from graphbucket.kernels.seesaw_layout import ROWS, TILE

    batch, heads, _ = q.shape
    part_o, part_lse, po_strides, pl_strides = _workspace_args(workspace, out)
    seesaw_fp8_stage1_kernel[(-(-heads // ROWS.value), batch, plan.num_kv_splits)](
        q, kv_cache, kv_scale, block_table, seq_lens, out, out if lse is None else lse,
        part_o, part_lse, plan.num_kv_splits, heads, batch * heads, sm_scale * LOG2E,
        block_table.stride(0), out.stride(0), out.stride(1),
        0 if lse is None else lse.stride(0), *po_strides, *pl_strides,
        PAGE_SIZE=TILE.value, ONE_SPLIT=not plan.use_stage2, WRITE_LSE=lse is not None,
        V32=kv_cache.dtype == torch.uint8,
        **({"Q_LEN": q_len, "rows_per_token": heads // q_len} if q_len > 1 else {}),
        PREFETCH_AHEAD=prefetch_ahead, num_warps=4)


def launch_merge(seq_lens: torch.Tensor, out: torch.Tensor, workspace: SplitWorkspace, *,
                 plan: LaunchPlan, lse: torch.Tensor | None, block_n: int | None = None) -> None:
    """Stage 2 alone (unchecked): blocked LSE merge of the live splits into ``out``.

    ``block_n``: stage 1's tile (``tile_tokens``; default the plan's, right for 2-byte caches).
    """
    part_o, part_lse, po_strides, pl_strides = _workspace_args(workspace, out)
    mla_decode_merge_kernel[plan.merge_grid](
        part_o, part_lse, seq_lens, out, out if lse is None else lse,
        plan.num_kv_splits,
        *po_strides, *pl_strides,
        out.stride(0), out.stride(1),
        0 if lse is None else lse.stride(0),
        BLOCK_N=block_n or plan.block_n, BLOCK_S=plan.merge_block_s,
        BLOCK_DV=plan.merge_block_dv,
        WRITE_LSE=lse is not None, num_warps=plan.merge_num_warps,
        **({"USE_GDC": True, "launch_pdl": True} if use_pdl(plan, out.device) else {}),
    )
