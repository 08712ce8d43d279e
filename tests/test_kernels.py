"""Numerics of the split-KV MLA decode kernels against the float64 reference.

On a CPU machine these run through the Triton interpreter in fp16/fp32 (the interpreter's
bf16 dot is wrong); on CUDA the same cases run in bf16 too.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from graphbucket.kernels import SplitWorkspace, mla_decode
from graphbucket.kernels.launch import tile_tokens
from graphbucket.plan import LaunchPlan, plan_mla_decode
from graphbucket.plan_streams import (
    LONG_BUFFERED,
    LONG_PAGE_AHEAD,
    LONG_STREAM,
    TOKEN_STREAM,
    WIDE_BUFFERED,
    WIDE_CHUNKED_MERGE,
    WIDE_PAGE_AHEAD,
    WIDE_STREAM,
)
from graphbucket.reference import mla_decode_reference
from tests.kernel_cases import KV_LORA_RANK, SM_SCALE, DecodeCase, make_case, rel_l2

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16, torch.float32]
STREAMS = {"long": LONG_STREAM, "wide": WIDE_STREAM, "token": TOKEN_STREAM,
           "long_buffered": LONG_BUFFERED, "wide_buffered": WIDE_BUFFERED,
           "long_ahead": LONG_PAGE_AHEAD, "wide_ahead": WIDE_PAGE_AHEAD,
           "wide_chunked": WIDE_CHUNKED_MERGE}


def run_kernel(case: DecodeCase, plan: LaunchPlan, *, with_lse: bool = True):
    batch, heads, _ = case.q.shape
    out = torch.full((batch, heads, KV_LORA_RANK), float("nan"), dtype=case.q.dtype,
                     device=DEVICE)
    lse = torch.full((batch, heads), float("nan"), device=DEVICE) if with_lse else None
    ws = SplitWorkspace.allocate(plan.batch_size, plan.num_heads, plan.num_kv_splits,
                                plan.kv_lora_rank, DEVICE)
    ws.partial_o.fill_(float("nan"))
    ws.partial_lse.fill_(float("nan"))
    mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out, ws, plan=plan,
               sm_scale=SM_SCALE, lse=lse)
    return out, lse


def check(case: DecodeCase, plan: LaunchPlan, tol: float = 1e-2):
    out, lse = run_kernel(case, plan)
    ref_out, ref_lse = mla_decode_reference(case.q.cpu(), case.kv_cache.cpu(),
                                            case.block_table.cpu(), case.seq_lens.cpu(),
                                            kv_lora_rank=KV_LORA_RANK, sm_scale=SM_SCALE)
    assert not torch.isnan(out).any(), f"NaN or unwritten output under {plan.describe()}"
    assert not torch.isnan(lse).any(), f"NaN or unwritten LSE under {plan.describe()}"
    err = rel_l2(out.cpu(), ref_out)
    assert err < tol, f"rel L2 {err:.2e} >= {tol} under {plan.describe()}"
    live = case.seq_lens.cpu() > 0
    lse_err = (lse.cpu().double()[live] - ref_lse[live]).abs().max().item()
    assert lse_err < 2e-2, f"LSE error {lse_err:.2e} under {plan.describe()}"
    return out


def with_splits(plan: LaunchPlan, num_splits: int) -> LaunchPlan:
    return plan.with_splits(num_splits)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stream", ["long", "wide", "token"])
@pytest.mark.parametrize("seq_len", [1, 2, 15, 17, 31, 32, 33, 63, 64, 65])
def test_lengths_around_block_and_page_edges(dtype, stream, seq_len):
    # Tiles are 64 (long, token) or 32 (wide) tokens; pages are 16, so 15/17 straddle a page.
    case = make_case([seq_len], 16, page_size=16, dtype=dtype, device=DEVICE)
    base = plan_mla_decode(1, 16, seq_len, num_sms=4, stream=STREAMS[stream])
    for splits in (1, 3):  # 3 splits exceed the tile count for every length here
        check(case, with_splits(base, splits))


@pytest.mark.parametrize("page_size, stream", [
    *((p, s) for p in (1, 16, 64) for s in ("long", "wide", "token")),
    # double-buffered streams: pages looked up ahead as a scalar (16, 64) or a vector (8)
    *((p, s) for p in (8, 16, 64) for s in ("long_ahead", "wide_ahead", "wide_buffered"))])
def test_scattered_pages_ragged_batch(page_size, stream):
    # page 64 with either tile takes the one-page-per-tile path; 1, 8 and 16 (below the
    # tile) gather per token.
    lens = [1, 70, 129, 33]
    case = make_case(lens, 16, page_size=page_size, dtype=torch.float16, device=DEVICE)
    plan = plan_mla_decode(len(lens), 16, 1, num_sms=8, stream=STREAMS[stream])
    check(case, plan)
    check(case, with_splits(plan, 4))


@pytest.mark.parametrize("stream", ["long", "token"])
@pytest.mark.parametrize("num_heads", [8, 12, 16, 128])
def test_head_counts_mask_partial_head_blocks(num_heads, stream):
    case = make_case([45, 3], num_heads, page_size=16, dtype=torch.float16, device=DEVICE)
    base = plan_mla_decode(2, num_heads, 1, num_sms=4, stream=STREAMS[stream])
    check(case, base)
    check(case, with_splits(base, 2))


def test_hint_far_below_and_far_above_live_length():
    case = make_case([2500, 700], 16, page_size=64, dtype=DTYPES[-1], device=DEVICE)
    low = plan_mla_decode(2, 16, 1, num_sms=16)
    high = plan_mla_decode(2, 16, 1 << 20, num_sms=16)
    assert low.num_kv_splits == 1 and high.num_kv_splits > 1
    a = check(case, low)
    b = check(case, high)
    # Topology changes speed, not the result (beyond the output dtype's rounding).
    assert rel_l2(a.cpu(), b.cpu().double()) < (1e-3 if DTYPES[-1] == torch.float32 else 1e-2)


def test_padding_rows_give_zeros_and_touch_nothing_else():
    case = make_case([0, 40, 0, 1], 16, page_size=16, dtype=torch.float16, device=DEVICE)
    for splits in (1, 4):
        plan = with_splits(plan_mla_decode(4, 16, 1, num_sms=4), splits)
        out = check(case, plan)
        assert (out[0] == 0).all() and (out[2] == 0).all()
        _, lse = run_kernel(case, plan)
        assert torch.isinf(lse[0]).all() and (lse[0] < 0).all()


def test_without_lse_output():
    case = make_case([77], 16, page_size=16, dtype=torch.float16, device=DEVICE)
    plan = with_splits(plan_mla_decode(1, 16, 1, num_sms=4), 2)
    out, lse = run_kernel(case, plan, with_lse=False)
    ref, _ = mla_decode_reference(case.q.cpu(), case.kv_cache.cpu(), case.block_table.cpu(),
                                  case.seq_lens.cpu(), kv_lora_rank=KV_LORA_RANK,
                                  sm_scale=SM_SCALE)
    assert lse is None and rel_l2(out.cpu(), ref) < 1e-2


def test_many_splits_merge_in_blocks():
    # More live splits than one merge block: the merge must carry its state across blocks.
    plan = plan_mla_decode(1, 16, 1, num_sms=4, stream=WIDE_STREAM)
    splits = plan.merge_block_s + 9
    case = make_case([splits * plan.block_n - 5], 16, page_size=32, dtype=torch.float16,
                     device=DEVICE)
    check(case, with_splits(plan, splits))


@pytest.mark.parametrize("splits", [33, 100])
def test_mid_size_merge_tiles(splits):
    # 33 splits take the 64-row merge tile, 100 the 128-row one (one step each).
    plan = with_splits(plan_mla_decode(1, 16, 1, num_sms=4, stream=WIDE_STREAM), splits)
    assert plan.merge_block_s == (64 if splits == 33 else 128)
    case = make_case([splits * plan.block_n - 3], 16, page_size=32, dtype=torch.float16,
                     device=DEVICE)
    check(case, plan)


@pytest.mark.slow
def test_many_splits_wide_merge_tile():
    # Above 32 splits the merge takes 256-split steps: 300 splits need two of them.
    plan = with_splits(plan_mla_decode(1, 16, 1, num_sms=4, stream=WIDE_STREAM), 300)
    assert plan.merge_block_s == 256
    case = make_case([300 * plan.block_n - 7], 16, page_size=32, dtype=torch.float16,
                     device=DEVICE)
    check(case, plan)


def test_bad_inputs_raise_before_launch():
    case = make_case([10], 16, page_size=16, dtype=torch.float16, device=DEVICE)
    plan = plan_mla_decode(1, 16, 10, num_sms=4)
    out = torch.zeros(1, 16, KV_LORA_RANK, dtype=torch.float16, device=DEVICE)
    ws = SplitWorkspace.allocate(plan.batch_size, plan.num_heads, plan.num_kv_splits,
                                plan.kv_lora_rank, DEVICE)
    with pytest.raises(ValueError, match="dtypes"):
        mla_decode(case.q.float(), case.kv_cache, case.block_table, case.seq_lens, out, ws,
                   plan=plan, sm_scale=SM_SCALE)
    with pytest.raises(ValueError, match="seq_lens"):
        mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens.long(), out, ws,
                   plan=plan, sm_scale=SM_SCALE)
    with pytest.raises(ValueError, match="q.shape"):
        mla_decode(case.q[:, :8], case.kv_cache, case.block_table, case.seq_lens, out, ws,
                   plan=plan, sm_scale=SM_SCALE)
    big = with_splits(plan, 64)
    with pytest.raises(ValueError, match="workspace"):
        mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out, ws,
                   plan=big, sm_scale=SM_SCALE)
    assert (out == 0).all()


@pytest.mark.slow
def test_a_few_thousand_tokens_fp16():
    case = make_case([3001, 1], 16, page_size=64, dtype=torch.float16, device=DEVICE)
    check(case, plan_mla_decode(2, 16, 3001, num_sms=8))


@pytest.mark.gpu
def test_gpu_float32_cache_fits_shared_memory_and_keeps_float32_precision():
    # bf16 plans pipeline 3 x 64-token tiles; float32 rows are twice as wide. The dots run
    # in IEEE float32, not TF32 (which gave ~1e-3 relative error here).
    case = make_case([3000, 70], 16, page_size=64, dtype=torch.float32, device="cuda")
    for hint in (1, 3000):
        check(case, plan_mla_decode(2, 16, hint, num_sms=132), tol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("seq_len", [1, 31, 32, 33, 4095, 70000])
def test_gpu_bf16_long_and_short(seq_len):
    case = make_case([seq_len, max(1, seq_len // 3), 0], 16, page_size=64,
                     dtype=torch.bfloat16, device="cuda")
    for hint in (1, seq_len, 131072):
        check(case, plan_mla_decode(3, 16, hint, num_sms=132))


@pytest.mark.parametrize("batch", [1, 64])
def test_float32_caches_stream_tiles_of_the_same_bytes(batch):
    plan = plan_mla_decode(batch, 16, 4096, num_sms=132)
    assert tile_tokens(plan, 2) == plan.block_n  # plans are tuned for 2-byte caches
    assert tile_tokens(plan, 4) * 4 == plan.block_n * 2
    assert tile_tokens(plan, 1) == plan.block_n  # narrower elements keep the plan's tile


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[70000], [4096, 1, 0, 300]])
def test_gpu_merge_with_and_without_dependent_launch_agree(lens):
    from graphbucket.kernels.launch import use_pdl

    case = make_case(lens, 16, page_size=64, dtype=torch.bfloat16, device="cuda")
    plan = plan_mla_decode(len(lens), 16, max(lens), num_sms=132)
    assert plan.use_stage2
    outs = []
    for dependent in (False, True):
        outs.append(check(case, replace(plan, dependent_merge=dependent)).clone())
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert use_pdl(replace(plan, dependent_merge=True), torch.device("cuda")) == hopper
    assert torch.equal(outs[0], outs[1])  # same arithmetic, only the launch differs


def fused(plan: LaunchPlan) -> LaunchPlan:
    return replace(plan, fused_merge=True)


@pytest.mark.parametrize("stream, seq_len", [
    *((s, n) for s in ("long", "wide", "token") for n in (1, 63, 64, 65, 200)),
    # double-buffered streams: 16- and 32-token tiles on 16-token pages
    *((s, n) for s in ("long_ahead", "wide_ahead", "wide_buffered")
      for n in (1, 16, 17, 64, 200))])
def test_fused_merge_around_split_edges(stream, seq_len):
    # 1 and 3 splits; 3 splits of a 1-tile request leave two splits without tokens.
    case = make_case([seq_len], 16, page_size=16, dtype=DTYPES[-1], device=DEVICE)
    base = fused(plan_mla_decode(1, 16, seq_len, num_sms=4, stream=STREAMS[stream]))
    for splits in (1, 3):
        check(case, with_splits(base, splits))


@pytest.mark.parametrize("num_heads", [16, 128])
def test_fused_merge_ragged_padded_batch_and_counters_reset(num_heads):
    # Padding rows (0) write zeros once; every launch leaves the counters at zero, so a
    # second launch on the same workspace (what a graph replay does) gives the same result.
    case = make_case([0, 300, 1, 129, 0, 64], num_heads, page_size=16, dtype=DTYPES[-1],
                     device=DEVICE)
    plan = fused(with_splits(plan_mla_decode(6, num_heads, 1, num_sms=4), 4))
    ws = SplitWorkspace.allocate(6, num_heads, 4, KV_LORA_RANK, DEVICE)
    outs = []
    for _ in range(2):
        out = torch.full((6, num_heads, KV_LORA_RANK), float("nan"), dtype=case.q.dtype,
                         device=DEVICE)
        lse = torch.full((6, num_heads), float("nan"), device=DEVICE)
        mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out, ws, plan=plan,
                   sm_scale=SM_SCALE, lse=lse)
        assert (ws.merge_counters == 0).all(), "a fused merge left a counter set"
        outs.append(out)
    ref, ref_lse = mla_decode_reference(case.q.cpu(), case.kv_cache.cpu(),
                                        case.block_table.cpu(), case.seq_lens.cpu(),
                                        kv_lora_rank=KV_LORA_RANK, sm_scale=SM_SCALE)
    assert rel_l2(outs[0].cpu(), ref) < 1e-2
    assert torch.equal(outs[0], outs[1])
    assert (outs[0][0] == 0).all() and torch.isinf(lse[4]).all()
    live = case.seq_lens.cpu() > 0
    assert (lse.cpu().double()[live] - ref_lse[live]).abs().max() < 2e-2


def test_fused_merge_needs_counters_in_the_workspace():
    case = make_case([100], 16, page_size=16, dtype=DTYPES[-1], device=DEVICE)
    plan = fused(with_splits(plan_mla_decode(1, 16, 1, num_sms=4), 2))
    ws = SplitWorkspace.allocate(1, 16, 2, KV_LORA_RANK, DEVICE)
    ws = replace(ws, merge_counters=None)
    out = torch.empty(1, 16, KV_LORA_RANK, dtype=case.q.dtype, device=DEVICE)
    with pytest.raises(ValueError, match="workspace"):
        mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out, ws, plan=plan,
                   sm_scale=SM_SCALE)


# --- double-buffered streams: pages looked up one tile ahead, 16- and 32-token tiles -------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stream", ["long_ahead", "wide_ahead"])
@pytest.mark.parametrize("seq_len", [1, 16, 17, 33, 65, 97])
def test_page_ahead_lengths_around_tile_and_page_edges(dtype, stream, seq_len):
    # 32 (long) or 16 (wide) token tiles on 16-token pages: the lookup ahead of the last
    # tile of a split (and of the request) must read nothing and change nothing.
    case = make_case([seq_len], 16, page_size=16, dtype=dtype, device=DEVICE)
    base = plan_mla_decode(1, 16, seq_len, num_sms=4, stream=STREAMS[stream])
    assert base.page_ahead
    for splits in (1, 3):
        check(case, with_splits(base, splits))


@pytest.mark.parametrize("stream", ["long_ahead", "wide_ahead"])
@pytest.mark.parametrize("num_heads", [12, 128])
def test_page_ahead_partial_head_blocks(num_heads, stream):
    case = make_case([45, 3], num_heads, page_size=16, dtype=torch.float16, device=DEVICE)
    base = plan_mla_decode(2, num_heads, 1, num_sms=4, stream=STREAMS[stream])
    check(case, base)
    check(case, with_splits(base, 2))


def test_page_ahead_changes_no_result():
    # Same tiles, same arithmetic: looking the pages up early gives the same bits.
    case = make_case([300, 77, 0, 129], 16, page_size=16, dtype=DTYPES[-1], device=DEVICE)
    for stream, ahead in ((LONG_BUFFERED, LONG_PAGE_AHEAD), (WIDE_BUFFERED, WIDE_PAGE_AHEAD)):
        plan = with_splits(plan_mla_decode(4, 16, 300, num_sms=8, stream=stream), 3)
        plan_ahead = with_splits(plan_mla_decode(4, 16, 300, num_sms=8, stream=ahead), 3)
        assert replace(plan_ahead, page_ahead=False, num_stages=plan.num_stages) == plan
        assert torch.equal(run_kernel(case, plan)[0], run_kernel(case, plan_ahead)[0])


# --- fused merge in column blocks ------------------------------------------------------

@pytest.mark.parametrize("chunks", [2, 4, 8])
@pytest.mark.parametrize("seq_len", [1, 65, 200])
def test_fused_merge_in_column_blocks(chunks, seq_len):
    # 1 split (no merge), 3 splits (one of them empty for 65 tokens at 32-token tiles).
    case = make_case([seq_len, 0, 40], 16, page_size=16, dtype=DTYPES[-1], device=DEVICE)
    base = fused(plan_mla_decode(3, 16, seq_len, num_sms=4, stream=WIDE_STREAM))
    for splits in (1, 3):
        plan = replace(with_splits(base, splits), merge_chunks=chunks)
        out = check(case, plan)
        assert (out[1] == 0).all()


def test_fused_merge_column_blocks_match_the_whole_row():
    case = make_case([300, 129, 1], 16, page_size=16, dtype=DTYPES[-1], device=DEVICE)
    plan = with_splits(plan_mla_decode(3, 16, 300, num_sms=4, stream=WIDE_CHUNKED_MERGE), 4)
    assert plan.merges_in_stage1 and plan.merge_chunks == 4
    whole, whole_lse = run_kernel(case, replace(plan, merge_chunks=1))
    blocks, blocks_lse = run_kernel(case, plan)
    # Same partials, the weights summed in another order: rounding of the output dtype.
    assert rel_l2(blocks.cpu(), whole.cpu().double()) < 2e-3
    assert (blocks_lse - whole_lse).abs().max() < 1e-4
    with pytest.raises(ValueError, match="merge_chunks"):
        run_kernel(case, replace(plan, merge_chunks=3))
