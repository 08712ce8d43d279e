"""LaunchPlan and plan_mla_decode: pure host planning."""

from __future__ import annotations

import dataclasses
import random

import pytest

from graphbucket.plan import MAX_KV_SPLITS, LaunchPlan, plan_mla_decode
from graphbucket.plan_streams import LONG_STREAM, WIDE_STREAM

pytestmark = pytest.mark.host  # the fast lane: no kernel launches

HINTS = [1, 2, 31, 32, 33, 64, 65, 255, 256, 1000, 4096, 16384, 65536, 100_000, 131072, 1 << 20]


@pytest.mark.parametrize("batch", [1, 2, 8, 32, 64, 256])
@pytest.mark.parametrize("heads", [8, 12, 16, 32, 64, 128])
def test_monotone_in_hint_and_bounded_by_budget(batch, heads):
    plans = [plan_mla_decode(batch, heads, h, num_sms=132) for h in HINTS]
    splits = [p.num_kv_splits for p in plans]
    assert splits == sorted(splits), f"split count not monotone in the hint: {splits}"
    assert splits[0] == 1, "hint 1 must plan one split"
    stream = LONG_STREAM if plans[0].block_n == LONG_STREAM.block_n else WIDE_STREAM
    resident = stream.ctas_per_sm * 132
    for p in plans:
        assert 1 <= p.num_kv_splits <= MAX_KV_SPLITS
        grid_programs = p.grid[0] * p.grid[1] * p.grid[2]
        assert p.num_kv_splits == 1 or grid_programs <= resident, (
            f"{p.describe()} launches {grid_programs} programs > {resident} resident slots")


def test_long_context_at_batch_one_fills_the_machine():
    # 2 programs per SM: 264 slots on 132 SMs -> 256 splits; 132 slots on 66 SMs -> 128
    plan = plan_mla_decode(1, 16, 131072, num_sms=132)
    assert plan.grid == (1, 1, 256) and plan.use_stage2 and plan.merge_block_s == 256
    assert plan_mla_decode(1, 16, 131072, num_sms=66).num_kv_splits == 128
    # batch 8: 33 slots per request -> 32 splits (the 32-row merge tile, not 64)
    plan8 = plan_mla_decode(8, 16, 131072, num_sms=132)
    assert plan8.num_kv_splits == 32 and plan8.merge_block_s == 32


def test_deterministic_and_hashable():
    rng = random.Random(7)
    for _ in range(200):
        args = (rng.randint(1, 128), rng.choice([8, 12, 16, 128]), rng.randint(1, 1 << 18))
        a, b = plan_mla_decode(*args), plan_mla_decode(*args)
        assert a == b and hash(a) == hash(b)
        assert len({a, b}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.num_kv_splits = 7


def test_one_split_plan_has_no_stage2_and_no_workspace():
    plan = plan_mla_decode(4, 16, 1)
    assert not plan.use_stage2 and plan.workspace_shape == (0, 0, 0, 0)
    long = plan_mla_decode(4, 16, 65536)
    assert long.use_stage2
    assert long.workspace_shape == (4, 16, long.num_kv_splits, 512)
    assert long.merge_grid == (4, 16, 512 // long.merge_block_dv)


def test_merge_tile_fits_the_split_count():
    tiles = {n: plan_mla_decode(1, 16, 1).with_splits(n).merge_block_s
             for n in (2, 32, 33, 64, 65, 128, 129, 264, 512)}
    assert tiles == {2: 32, 32: 32, 33: 64, 64: 64, 65: 128, 128: 128, 129: 256, 264: 256,
                     512: 256}


def test_partial_head_blocks_are_counted():
    assert plan_mla_decode(1, 12, 10).num_head_blocks == 1
    assert plan_mla_decode(1, 128, 10).num_head_blocks == 2  # 64 query rows per program
    assert plan_mla_decode(1, 96, 10).num_head_blocks == 2  # the second block half full
    assert plan_mla_decode(1, 32, 10).num_head_blocks == 1


def test_wide_query_rows_from_64_heads():
    from graphbucket.plan_streams import LONG_STREAM, ROWS_STREAM

    # From 32 rows (32 heads, or 16 heads x 2 verify tokens) split-KV plans take 64 rows.
    for heads, rows in ((12, 16), (16, 16), (31, 32), (32, 64), (48, 64), (64, 64),
                        (128, 64)):
        plan = plan_mla_decode(8, heads, 4096)
        assert plan.block_h == rows, heads
        # 32 rows on a thin grid: 4 warps, two programs per SM (ROWS32_STREAM).
        assert plan.num_warps == (8 if rows == 64 else 4)
    wider = plan_mla_decode(64, 31, 4096)
    assert wider.block_h == 32 and wider.num_warps == 8
    wide = plan_mla_decode(1, 128, 131072)
    assert (wide.block_n, wide.num_stages) == (ROWS_STREAM.block_n, ROWS_STREAM.num_stages)
    # One program per SM: the budget is the SM count over the rows (2 head blocks).
    assert wide.num_kv_splits == 64 and not wide.merges_in_stage1
    assert plan_mla_decode(64, 128, 4096).num_kv_splits == 1
    # A stream may set the rows: 32 at 128 heads (four head blocks), as before.
    narrow = plan_mla_decode(1, 128, 131072, stream=dataclasses.replace(LONG_STREAM,
                                                                     block_h=32))
    assert narrow.block_h == 32 and narrow.num_head_blocks == 4


def test_seesaw_planned_for_64_row_plans_only_balanced_ones_too():
    from graphbucket.plan import plan_balanced_mla_decode
    from graphbucket.plan_streams import ROWS_STREAM, SEESAW_STREAM

    for heads in (64, 128):
        for batch, context in ((1, 131072), (8, 65536), (64, 4096)):
            plan = plan_mla_decode(batch, heads, context)
            assert plan.seesaw and "seesaw" in plan.describe(), plan.describe()
    assert not plan_mla_decode(8, 16, 65536).seesaw
    assert not plan_mla_decode(8, 31, 65536).seesaw
    # 32 rows: the seesaw's plan for split-KV; balanced plans keep 32-row programs.
    assert plan_mla_decode(8, 32, 65536) == plan_mla_decode(8, 32, 65536,
                                                            stream=SEESAW_STREAM)
    assert plan_mla_decode(8, 32, 65536).seesaw
    assert plan_balanced_mla_decode(8, 32).block_h == 32
    assert not plan_balanced_mla_decode(8, 32).seesaw
    balanced = plan_balanced_mla_decode(8, 128)
    assert balanced.seesaw and balanced.balanced and balanced.min_chunk_tiles == 2
    assert not plan_balanced_mla_decode(8, 128, stream=ROWS_STREAM).seesaw
    assert not plan_balanced_mla_decode(8, 16).seesaw
    # Splits hold at least one seesaw step (two tiles): 4K x 1 is 64 tiles, 32 splits.
    assert plan_mla_decode(1, 128, 4096).num_kv_splits == 32
    assert plan_mla_decode(1, 128, 131072).num_kv_splits == 64


def test_runs_seesaw_only_where_the_kernel_applies():
    """CPU tensors, the interpreter, fp8, q_len > 1, odd heads: the Triton kernel runs the
    plan (decided from static properties, so capture and replay agree)."""
    import torch

    from graphbucket.kernels.launch import runs_seesaw

    plan = plan_mla_decode(2, 128, 4096)
    q = torch.zeros(2, 128, 576, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    assert plan.seesaw and not runs_seesaw(plan, q, cache)  # not on a GPU
    assert not runs_seesaw(dataclasses.replace(plan, seesaw=False), q, cache)


def test_runs_seesaw_over_fp8_only_where_the_kernel_applies():
    """Not on a CPU, not for bf16 caches, verify steps or 16-row plans: each leaves the plan
    to the Triton kernel."""
    import torch

    from graphbucket.kernels.launch import runs_seesaw_over_fp8

    plan = plan_mla_decode(2, 128, 4096)
    q = torch.zeros(2, 128, 576, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64, 576, dtype=torch.float8_e4m3fn)
    scale = torch.ones(1)
    assert plan.seesaw and not runs_seesaw_over_fp8(plan, q, cache, kv_scale=scale)
    bf16 = cache.to(torch.bfloat16)
    assert not runs_seesaw_over_fp8(plan, q, bf16)
    assert not runs_seesaw_over_fp8(plan, q, cache, kv_scale=scale, q_len=2)
    assert not runs_seesaw_over_fp8(plan_mla_decode(2, 16, 4096), q[:, :16], cache,
                                    kv_scale=scale)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_bad_arguments_raise(bad):
    with pytest.raises(ValueError, match="positive int"):
        plan_mla_decode(bad, 16, 10)
    with pytest.raises(ValueError, match="positive int"):
        plan_mla_decode(1, 16, bad)


def test_max_splits_caps_the_budget():
    assert plan_mla_decode(1, 16, 1 << 20, max_splits=7).num_kv_splits == 7
    assert isinstance(plan_mla_decode(1, 16, 1 << 20), LaunchPlan)


def test_dependent_merge_only_for_few_row_plans():
    # measured: 1-8 % faster at batch 1 and 8, up to 1.5 % slower at batch 64
    assert plan_mla_decode(1, 16, 65536).dependent_merge
    assert plan_mla_decode(8, 16, 65536).dependent_merge
    assert not plan_mla_decode(64, 16, 65536).dependent_merge


def test_buffered_streams_double_buffer_and_are_planned_where_they_won():
    from graphbucket.plan import SHORT_SPLIT_TOKENS
    from graphbucket.plan_streams import (
        LONG_BUFFERED,
        LONG_PAGE_AHEAD,
        LONG_STREAM,
        WIDE_BUFFERED,
        WIDE_FUSED,
        WIDE_PAGE_AHEAD,
        WIDE_STREAM,
    )

    def stream_of(plan):
        return (plan.block_n, plan.num_stages, plan.page_ahead, plan.merge_chunks)

    def fields(stream):
        return (stream.block_n, stream.num_stages, stream.page_ahead, stream.merge_chunks)

    for batch, hint in ((1, 1), (1, 4096), (1, 131072), (8, 4096), (8, 16384), (8, 131072),
                        (64, 64), (64, 1024), (64, 4096), (64, 16384)):
        plan = plan_mla_decode(batch, 16, hint)
        # The split count is the one the LONG / WIDE stream plans; only the stream changes.
        base = plan_mla_decode(batch, 16, hint, stream=LONG_STREAM if batch < 33
                               else WIDE_STREAM)
        assert plan.num_kv_splits == base.num_kv_splits, (batch, hint)
        if batch < 33:
            short = -(-hint // plan.num_kv_splits) <= SHORT_SPLIT_TOKENS
            want = LONG_PAGE_AHEAD if short else LONG_STREAM
        else:
            want = WIDE_FUSED if plan.merges_in_stage1 else WIDE_STREAM
        assert stream_of(plan) == fields(want), (batch, hint, plan.describe())
    # 8 x 128K splits 4K tokens each: the single-buffered LONG stream (it measured faster).
    assert not plan_mla_decode(8, 16, 131072).page_ahead
    assert plan_mla_decode(64, 16, 4096).kv_buffers == 2
    assert "kv_buffers" not in plan_mla_decode(64, 16, 16384).describe()
    for stream in (LONG_BUFFERED, WIDE_BUFFERED, LONG_PAGE_AHEAD, WIDE_PAGE_AHEAD):
        plan = plan_mla_decode(64, 16, 4096, stream=stream)
        assert plan.kv_buffers == 2 and plan.page_ahead == stream.page_ahead
        assert "kv_buffers=2" in plan.describe()
        assert ("page-ahead" in plan.describe()) == stream.page_ahead
    # the token counts of LONG / WIDE: minimum split, fused-merge limit
    wide = plan_mla_decode(64, 16, 4096, stream=WIDE_BUFFERED)
    assert wide.merges_in_stage1 and wide.num_kv_splits == 4
    assert not plan_mla_decode(64, 16, 8192, stream=WIDE_BUFFERED).merges_in_stage1
