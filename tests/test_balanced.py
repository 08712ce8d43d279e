"""Balanced split-KV MLA decode: the device-side item planner and the kernels' numerics
against the float64 reference.

Small shapes (kv_lora_rank 64, rope 16) keep the interpreter quick on a CPU machine,
where these run in fp16/fp32; on CUDA the same cases run natively, bf16 included.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from graphbucket import GraphBucketRunner, get_backend
from graphbucket.backends.triton import TritonBackend
from graphbucket.kernels import SplitWorkspace, mla_decode, mla_decode_balanced
from graphbucket.kernels.launch import tile_tokens
from graphbucket.kernels.launch_balanced import launch_item_planner, launch_range_planner
from graphbucket.plan import (
    MAX_RANGE_CHARGE_TILES,
    RANGE_REQUEST_CHARGE_TILES,
    LaunchPlan,
    cdiv,
    plan_balanced_mla_decode,
    plan_mla_decode,
)
from graphbucket.plan_streams import (
    LONG_PAGE_AHEAD,
    LONG_STREAM,
    SEESAW_STREAM,
    TOKEN_STREAM,
    WIDE_STREAM,
)
from graphbucket.reference import mla_decode_reference
from tests._toy import LADDER, ToyMLA, toy_batch, toy_reference, toy_spec
from tests.kernel_cases import DecodeCase, make_case, rel_l2

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float16, torch.float32]
RANK, ROPE, HEADS = 64, 16, 16
SM_SCALE = 0.125
DIMS = {"kv_lora_rank": RANK, "qk_rope_dim": ROPE}


def python_partition(lens: list[int], block_n: int, programs: int, min_chunk: int,
                     fit: bool = False) -> tuple[list[int], int]:
    """item_indptr and chunk_tiles as the planning kernel must compute them; ``fit``: the
    smallest chunk from there on with at most ``programs`` items, by counting upwards, if
    it is at most 1.5x the plain chunk."""
    tiles = [cdiv(n, block_n) for n in lens]
    chunk = plain = max(min_chunk, cdiv(sum(tiles), programs))
    if fit and sum(t > 0 for t in tiles) <= programs:
        while sum(cdiv(t, chunk) for t in tiles) > programs:
            chunk += 1
        if 2 * chunk > 3 * plain:
            chunk = plain
    indptr = [0]
    for t in tiles:
        indptr.append(indptr[-1] + cdiv(t, chunk))
    return indptr, chunk


def balanced_plan(batch: int, programs: int, *, min_chunk_tiles: int = 1,
                  stream=LONG_STREAM, heads: int = HEADS, fit_items: bool = False
                  ) -> LaunchPlan:
    return plan_balanced_mla_decode(batch, heads, programs=programs, stream=stream,
                                    min_chunk_tiles=min_chunk_tiles, fit_items=fit_items,
                                    **DIMS)


def case(lens: list[int], dtype=torch.float16, *, page_size: int = 16,
         heads: int = HEADS) -> DecodeCase:
    return make_case(lens, heads, page_size=page_size, dtype=dtype, device=DEVICE,
                     kv_lora_rank=RANK, rope_dim=ROPE)


def workspace_for(plan: LaunchPlan) -> SplitWorkspace:
    ws = SplitWorkspace.allocate(plan.batch_size, plan.num_heads, plan.num_kv_splits, RANK,
                                 DEVICE, max_items=plan.max_work_items)
    ws.item_o.fill_(float("nan"))  # a merge that reads an unwritten slot shows up as NaN
    ws.item_lse.fill_(float("nan"))
    return ws


def run_balanced(c: DecodeCase, plan: LaunchPlan, *, with_lse: bool = True):
    batch, heads, _ = c.q.shape
    out = torch.full((batch, heads, RANK), float("nan"), dtype=c.q.dtype, device=DEVICE)
    lse = torch.full((batch, heads), float("nan"), device=DEVICE) if with_lse else None
    ws = workspace_for(plan)
    mla_decode_balanced(c.q, c.kv_cache, c.block_table, c.seq_lens, out, ws, plan=plan,
                        sm_scale=SM_SCALE, lse=lse)
    return out, lse, ws


def check(c: DecodeCase, plan: LaunchPlan, tol: float = 1e-2) -> torch.Tensor:
    out, lse, ws = run_balanced(c, plan)
    ref_out, ref_lse = mla_decode_reference(c.q.cpu(), c.kv_cache.cpu(), c.block_table.cpu(),
                                            c.seq_lens.cpu(), kv_lora_rank=RANK,
                                            sm_scale=SM_SCALE)
    assert not torch.isnan(out).any(), f"NaN or unwritten output under {plan.describe()}"
    assert not torch.isnan(lse).any(), f"NaN or unwritten LSE under {plan.describe()}"
    err = rel_l2(out.cpu(), ref_out)
    assert err < tol, f"rel L2 {err:.2e} >= {tol} under {plan.describe()}"
    live = c.seq_lens.cpu() > 0
    if live.any():
        lse_err = (lse.cpu().double()[live] - ref_lse[live]).abs().max().item()
        assert lse_err < 2e-2, f"LSE error {lse_err:.2e} under {plan.describe()}"
    pad = ~live
    assert (out.cpu()[pad] == 0).all(), "padding rows must be zeros"
    assert (lse.cpu()[pad] == float("-inf")).all(), "padding rows must have LSE -inf"
    # The partition the kernels used is the one the Python rule gives.
    block_n = tile_tokens(plan, c.kv_cache.element_size())
    indptr, chunk = python_partition(c.seq_lens.tolist(), block_n, plan.persistent_programs,
                                     plan.min_chunk_tiles, plan.fit_items)
    assert ws.item_indptr[:plan.batch_size + 1].tolist() == indptr
    assert int(ws.chunk_tiles.item()) == chunk
    return out


# --- planning -----------------------------------------------------------------------------

@pytest.mark.host
def test_split_planning_is_unchanged_and_balanced_is_opt_in():
    for batch, hint in ((1, 1), (8, 4096), (64, 131072)):
        plan = plan_mla_decode(batch, 16, hint)
        assert plan.persistent_programs == 0 and not plan.balanced and plan.max_work_items == 0
    assert not TritonBackend(num_sms=4, **DIMS).plan(4, HEADS, 100).balanced
    assert TritonBackend(num_sms=4, balanced=True, **DIMS).plan(4, HEADS, 100).balanced


@pytest.mark.host
def test_balanced_plan_shape():
    plan = plan_balanced_mla_decode(64, 16, num_sms=132)
    # 64 rows -> the wide stream: 4 programs per SM, one wave; chunks of >= 4 tiles
    assert plan.balanced and plan.use_stage2 and plan.num_kv_splits == 1
    assert plan.grid == (4 * 132, 1, 1) and plan.min_chunk_tiles == 4
    assert plan.max_work_items == 4 * 132 + 64
    assert plan.workspace_shape == (0, 0, 0, 0)  # no split partials
    # The merge: one resident wave of persistent programs over the merged requests' units.
    assert plan.merge_programs == 16 * 132 and plan.merge_grid == (16 * 132, 1, 1)
    one = plan_balanced_mla_decode(1, 128, num_sms=132)  # 2 blocks of 64 rows, 1 per SM
    assert one.block_h == 64 and one.grid == (132 // 2, 2, 1)
    assert one.min_chunk_tiles == 2 and one.seesaw  # the Gluon seesaw from 64 rows
    assert "balanced" in one.describe()
    # No hint: one plan serves every context, so ladders alias one graph per batch size.
    backend = TritonBackend(num_sms=132, balanced=True, **DIMS)
    assert backend.plan(8, 16, 1) == backend.plan(8, 16, 1 << 17)
    for bad in ({"programs": 0}, {"min_chunk_tiles": -1}):
        with pytest.raises(ValueError, match="positive int"):
            plan_balanced_mla_decode(4, 16, **{**{"programs": 3}, **bad})


@pytest.mark.host
def test_merge_reads_whole_rows_only_for_few_items_per_request():
    seesaw = plan_balanced_mla_decode(64, 16, num_sms=132, stream=SEESAW_STREAM)
    assert seesaw.merge_block_dv == 512 and seesaw.merge_programs == 64 * 16
    assert seesaw.merge_num_warps == 8
    # 528 programs: up to 529 items of one request walked serially
    for plan in (plan_balanced_mla_decode(64, 16, num_sms=132),
                 plan_balanced_mla_decode(8, 16, num_sms=132, stream=SEESAW_STREAM)):
        assert plan.merge_block_dv == 32 and plan.merge_block_h == 1, plan.describe()
    # From 64 heads units span 4 heads and whole rows over 2 items a step, prefetched,
    # for item plans and tile ranges alike.
    for plan in (plan_balanced_mla_decode(64, 128, num_sms=132),
                 plan_balanced_mla_decode(64, 128, num_sms=132, tile_ranges=True),
                 plan_balanced_mla_decode(8, 64, num_sms=132, charged_ranges=True,
                                          tile_ranges=True)):
        assert (plan.merge_block_s, plan.merge_block_h, plan.merge_block_dv,
                plan.merge_num_warps, plan.merge_prefetch) == (2, 4, 512, 4, True)
    assert plan_balanced_mla_decode(64, 128, num_sms=132).merge_programs == 64 * 32
    assert plan_balanced_mla_decode(128, 128, num_sms=132).merge_programs == 16 * 132
    # A rank without 512 columns: the largest power of two that divides it.
    assert plan_balanced_mla_decode(8, 64, num_sms=132, kv_lora_rank=192).merge_block_dv == 64
    assert plan_balanced_mla_decode(8, 32, num_sms=132).merge_block_h == 1
    small = balanced_plan(8, 6)  # rank 64: one block of the whole row
    assert small.merge_block_dv == RANK and small.merge_programs == 8 * HEADS


def random_lens(rng: random.Random, short: int) -> list[int]:
    """1-40 lengths, each padding, one token, up to ``short`` or up to 100K tokens."""
    return [rng.choice([0, 1, rng.randint(1, short), rng.randint(1, 100_000)])
            for _ in range(rng.randint(1, 40))]


@pytest.mark.host
def test_item_count_never_exceeds_programs_plus_requests():
    rng = random.Random(11)
    for _ in range(2000):
        lens = random_lens(rng, 300)
        programs, min_chunk = rng.randint(1, 600), rng.randint(1, 8)
        indptr, chunk = python_partition(lens, 32, programs, min_chunk)
        assert indptr[-1] <= programs + sum(n > 0 for n in lens)
        assert chunk >= min_chunk


@pytest.mark.host
def test_fitted_items_give_each_program_at_most_one():
    rng = random.Random(12)
    for _ in range(1000):
        lens = random_lens(rng, 3000)
        programs, min_chunk = rng.randint(1, 300), rng.randint(1, 8)
        plain, lo = python_partition(lens, 32, programs, min_chunk)
        indptr, chunk = python_partition(lens, 32, programs, min_chunk, fit=True)
        assert chunk >= lo and indptr[-1] <= plain[-1]
        if sum(n > 0 for n in lens) <= programs and chunk > lo:
            assert indptr[-1] <= programs and 2 * chunk <= 3 * lo
            # the smallest such chunk
            assert python_partition(lens, 32, programs, chunk - 1)[0][-1] > programs
        elif chunk == lo:  # no fitted chunk within 1.5x the plain one (or too many live)
            assert indptr == plain
            fits = [c for c in range(lo, 3 * lo // 2 + 1)
                    if python_partition(lens, 32, programs, c)[0][-1] <= programs]
            assert sum(n > 0 for n in lens) > programs or not fits or fits[0] == lo
        else:
            raise AssertionError(f"chunk {chunk} below the plain {lo}")


@pytest.mark.parametrize("fit", [False, True])
@pytest.mark.parametrize("lens, programs, min_chunk", [
    ([1], 1, 1),
    ([0, 0, 0], 4, 1),
    ([131072] + [1024] * 63, 528, 8),
    ([5000, 1, 0, 64, 65, 128], 7, 1),
    ([10, 20, 30], 100, 1),
    ([64 * 9, 64 * 9 + 1, 64 * 9 - 1], 3, 2),
    ([64 * 40] * 5 + [64 * 41], 8, 1),
    ([7000, 3, 3, 3], 3, 1),
    ([8192] + [64] * 9, 10, 1),  # fitting needs the longest whole: kept plain
])
def test_item_planner_matches_python(lens, programs, min_chunk, fit):
    plan = balanced_plan(len(lens), programs, min_chunk_tiles=min_chunk, fit_items=fit)
    ws = workspace_for(plan)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    ws.merge_rows.fill_(-1)
    launch_item_planner(seq_lens, ws, plan=plan, block_n=64)
    indptr, chunk = python_partition(lens, 64, programs, min_chunk, fit)
    assert ws.item_indptr.tolist() == indptr and int(ws.chunk_tiles.item()) == chunk
    assert_merge_rows(ws, indptr)


def assert_merge_rows(ws: SplitWorkspace, item_indptr: list[int]) -> None:
    """The planner's list of requests to merge: [count, b...], those of other than one item
    in request order."""
    items = [item_indptr[b + 1] - item_indptr[b] for b in range(len(item_indptr) - 1)]
    want = [b for b, n in enumerate(items) if n != 1]
    assert ws.merge_rows[:len(want) + 1].tolist() == [len(want)] + want


@pytest.mark.parametrize("fit", [False, True])
def test_item_planner_scans_batches_wider_than_one_block(fit):
    rng = random.Random(3)
    lens = [rng.choice([0, rng.randint(1, 5000)]) for _ in range(300)]  # 2 blocks of 256
    programs = 200 if fit else 50  # fitted: fewer live requests than programs
    plan = balanced_plan(len(lens), programs, min_chunk_tiles=2, fit_items=fit)
    ws = workspace_for(plan)
    launch_item_planner(torch.tensor(lens, dtype=torch.int32, device=DEVICE), ws, plan=plan,
                        block_n=32)
    indptr, chunk = python_partition(lens, 32, programs, 2, fit)
    assert ws.item_indptr.tolist() == indptr and int(ws.chunk_tiles.item()) == chunk
    assert_merge_rows(ws, indptr)


def python_ranges(lens: list[int], programs: int, min_tiles: int
                  ) -> tuple[list[int], list[int], int]:
    """tile_indptr, item_indptr and the tiles per range as the range planner must compute
    them (64-token tiles)."""
    tiles = [cdiv(n, 64) for n in lens]
    per = max(min_tiles, cdiv(sum(tiles), programs))
    tile_indptr, item_indptr = [0], [0]
    for t in tiles:
        first, last = tile_indptr[-1], tile_indptr[-1] + t
        tile_indptr.append(last)
        item_indptr.append(item_indptr[-1] + ((last - 1) // per - first // per + 1 if t else 0))
    return tile_indptr, item_indptr, per


def range_segments(lens: list[int], programs: int, min_tiles: int
                   ) -> list[tuple[int, int, int, int]]:
    """The seesaw's walk over its tile ranges, as the kernel does it: per program, each
    (request, first token, end token, partial slot) it runs."""
    tile_indptr, item_indptr, per = python_ranges(lens, programs, min_tiles)
    out = []
    for p in range(programs):
        t, last = p * per, min(p * per + per, tile_indptr[-1])
        while t < last:
            b = sum(end <= t for end in tile_indptr[1:])  # the kernel's owner search
            seg_last = min(last, tile_indptr[b + 1])
            out.append((b, (t - tile_indptr[b]) * 64,
                        min((seg_last - tile_indptr[b]) * 64, lens[b]),
                        item_indptr[b] + p - tile_indptr[b] // per))
            t = seg_last
    return out


@pytest.mark.host
def test_tile_ranges_cover_every_token_once_and_each_partial_slot_once():
    rng = random.Random(11)
    for _ in range(300):
        lens = [rng.choice([0, 1, 63, 64, 65, rng.randint(1, 9000)])
                for _ in range(rng.randint(1, 40))]
        programs, min_tiles = rng.randint(1, 140), rng.randint(1, 4)
        _, item_indptr, _ = python_ranges(lens, programs, min_tiles)
        segments = range_segments(lens, programs, min_tiles)
        slots = sorted(s for *_, s in segments)
        assert slots == list(range(item_indptr[-1])), (lens, programs)
        assert item_indptr[-1] <= programs + sum(n > 0 for n in lens)
        for b, n in enumerate(lens):  # a request's segments: its slots, its tokens in order
            mine = sorted((s, lo, hi) for r, lo, hi, s in segments if r == b)
            assert [s for s, *_ in mine] == list(range(item_indptr[b], item_indptr[b + 1]))
            bounds = [x for _, lo, hi in mine for x in (lo, hi)]
            assert bounds == sorted(bounds) and (bounds[:1], bounds[-1:]) == (
                ([0], [n]) if n else ([], [])), (lens, programs, b)
            assert all(bounds[i] == bounds[i + 1] for i in range(1, len(bounds) - 1, 2))


# (lens, programs, min_tiles) of the range planners' tests: one token, padding only, one
# long among short, a partial tile each side of a page, a spread from 1 token, equal short.
RANGE_CASES = [
    ([1], 132, 2),
    ([0, 0, 0], 4, 1),
    ([131072] + [1024] * 63, 132, 2),
    ([5000, 1, 0, 64, 65, 128], 7, 1),
    ([64 * 9, 64 * 9 + 1, 64 * 9 - 1], 3, 2),
    ([1 + 8191 * i // 63 for i in range(64)], 132, 2),
    ([64] * 40, 5, 1),
]


@pytest.mark.parametrize("lens, programs, min_tiles", RANGE_CASES)
def test_range_planner_matches_python(lens, programs, min_tiles):
    plan = plan_balanced_mla_decode(len(lens), HEADS, programs=programs, stream=SEESAW_STREAM,
                                    min_chunk_tiles=min_tiles, tile_ranges=True, **DIMS)
    ws = workspace_for(plan)
    launch_range_planner(torch.tensor(lens, dtype=torch.int32, device=DEVICE), ws, plan=plan)
    tile_indptr, item_indptr, per = python_ranges(lens, programs, min_tiles)
    assert ws.tile_indptr.tolist() == tile_indptr and ws.item_indptr.tolist() == item_indptr
    assert int(ws.chunk_tiles.item()) == per
    assert_merge_rows(ws, item_indptr)


def python_charged(lens: list[int], programs: int, min_tiles: int, charge: int
                   ) -> tuple[list[int], list[int], list[int], list[int]]:
    """The charged cut from its definition, unit by unit: (tile_indptr, item_indptr,
    range_bounds, first_program) as ``plan_tile_ranges_kernel`` writes them with a ``CHARGE``."""
    tiles = [cdiv(n, 64) for n in lens]
    tile_indptr = [0]
    units = []
    for t in tiles:
        if t:
            units += [tile_indptr[-1]] * charge + list(range(tile_indptr[-1],
                                                             tile_indptr[-1] + t))
        tile_indptr.append(tile_indptr[-1] + t)
    per = max(min_tiles, cdiv(len(units), programs))
    bounds = [units[p * per] if p * per < len(units) else tile_indptr[-1]
              for p in range(programs + 1)]
    met = [[p for p in range(programs)  # the programs whose tiles meet request b's
            if max(bounds[p], tile_indptr[b]) < min(bounds[p + 1], tile_indptr[b + 1])]
           for b in range(len(lens))]
    item_indptr = [0]
    for m in met:
        item_indptr.append(item_indptr[-1] + len(m))
    return tile_indptr, item_indptr, bounds, [m[0] if m else 0 for m in met]


@pytest.mark.parametrize("lens, programs, min_tiles", RANGE_CASES)
@pytest.mark.parametrize("charge", [0, 2, RANGE_REQUEST_CHARGE_TILES])
def test_charged_range_planner_matches_python(lens, programs, min_tiles, charge):
    plan = plan_balanced_mla_decode(len(lens), HEADS, programs=programs, stream=SEESAW_STREAM,
                                    min_chunk_tiles=min_tiles, tile_ranges=True,
                                    charged_ranges=True, range_charge_tiles=charge, **DIMS)
    assert plan.range_charge_tiles == charge and f"charged={charge}" in plan.describe()
    ws = workspace_for(plan)
    ws.range_bounds.fill_(-1)
    launch_range_planner(torch.tensor(lens, dtype=torch.int32, device=DEVICE), ws, plan=plan)
    tile_indptr, item_indptr, bounds, first = python_charged(lens, programs, min_tiles, charge)
    assert ws.tile_indptr.tolist() == tile_indptr and ws.item_indptr.tolist() == item_indptr
    assert ws.range_bounds[:programs + 1].tolist() == bounds
    assert_merge_rows(ws, item_indptr)
    live = [b for b, n in enumerate(lens) if n]
    assert [ws.first_program.tolist()[b] for b in live] == [first[b] for b in live]


@pytest.mark.host
def test_charged_ranges_cover_every_token_once_and_each_partial_slot_once():
    """The seesaw's walk over a charged cut, as the kernel does it (its bounds, each
    segment's slot item_indptr[b] + p - first_program[b]): every token once, every slot
    once, and no more segments than G + live - 1."""
    rng = random.Random(13)
    for _ in range(300):
        lens = [rng.choice([0, 1, 63, 64, 65, rng.randint(1, 9000)])
                for _ in range(rng.randint(1, 40))]
        programs, min_tiles = rng.randint(1, 140), rng.randint(1, 4)
        charge = rng.randint(0, 7)
        tile_indptr, item_indptr, bounds, first = python_charged(lens, programs, min_tiles,
                                                                 charge)
        assert bounds[0] == 0 and bounds[-1] == tile_indptr[-1]
        assert bounds == sorted(bounds)
        covered, slots = [], []
        for p in range(programs):
            t, last = bounds[p], bounds[p + 1]
            while t < last:
                b = sum(end <= t for end in tile_indptr[1:])
                seg_last = min(last, tile_indptr[b + 1])
                covered += [(b, x) for x in range(t - tile_indptr[b], seg_last - tile_indptr[b])]
                slots.append(item_indptr[b] + p - first[b])
                t = seg_last
        assert sorted(covered) == [(b, x) for b, n in enumerate(lens) for x in range(cdiv(n, 64))]
        assert sorted(slots) == list(range(item_indptr[-1]))
        assert item_indptr[-1] <= programs + sum(n > 0 for n in lens) - (1 if any(lens) else 0)
    with pytest.raises(ValueError, match="charged_ranges cuts tile ranges by work"):
        plan_balanced_mla_decode(8, 16, stream=SEESAW_STREAM, charged_ranges=True)


@pytest.mark.host
def test_a_charged_cut_takes_its_charge_from_the_plan_and_checks_it():
    ranges = {"stream": SEESAW_STREAM, "tile_ranges": True}
    assert plan_balanced_mla_decode(8, 16, charged_ranges=True, **ranges).range_charge_tiles \
        == RANGE_REQUEST_CHARGE_TILES
    assert plan_balanced_mla_decode(8, 16, **ranges).range_charge_tiles == 0
    for bad in (-1, MAX_RANGE_CHARGE_TILES + 1, 2.5):
        with pytest.raises(ValueError, match="range_charge_tiles must be an int"):
            plan_balanced_mla_decode(8, 16, charged_ranges=True, range_charge_tiles=bad,
                                     **ranges)
    with pytest.raises(ValueError, match="pass charged_ranges=True with it"):
        plan_balanced_mla_decode(8, 16, range_charge_tiles=2, **ranges)


@pytest.mark.host
def test_tile_ranges_are_planned_for_the_seesaws_programs_only():
    plan = plan_balanced_mla_decode(8, 16, stream=SEESAW_STREAM, tile_ranges=True, num_sms=132)
    assert plan.persistent_programs == 132 and plan.tile_ranges and "ranges" in plan.describe()
    assert plan_balanced_mla_decode(8, 128, stream=SEESAW_STREAM, tile_ranges=True,
                                    num_sms=132).persistent_programs == 66
    with pytest.raises(ValueError, match="tile_ranges needs the seesaw"):
        plan_balanced_mla_decode(8, 16, tile_ranges=True)


# --- numerics -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_one_long_request_among_short_ones(dtype):
    lens = [700, 3, 17, 40, 1, 64, 9, 33]
    c = case(lens, dtype)
    check(c, balanced_plan(len(lens), 6))
    check(c, balanced_plan(len(lens), 6, stream=WIDE_STREAM, min_chunk_tiles=2))
    check(c, balanced_plan(len(lens), 6, stream=TOKEN_STREAM))
    check(c, balanced_plan(len(lens), 6, stream=LONG_PAGE_AHEAD))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_len", [1, 2, 15, 17, 63, 64, 65, 127, 128, 129, 191, 193])
def test_lengths_around_tile_and_chunk_edges(dtype, seq_len):
    # 64-token tiles (32 for fp32), 16-token pages; 2 programs with chunks of >= 2 tiles
    # put chunk edges at 128 tokens (64 for fp32); the short neighbour shares the budget.
    c = case([seq_len, 3], dtype)
    check(c, balanced_plan(2, 2, min_chunk_tiles=2))
    check(c, balanced_plan(2, 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_padding_rows_give_zeros_and_lse_minus_inf(dtype):
    check(case([0, 40, 0, 1, 0], dtype), balanced_plan(5, 3))
    check(case([0, 200, 0], dtype), balanced_plan(3, 4))  # padding beside a merged request
    check(case([0, 0], dtype), balanced_plan(2, 2))  # nothing live: no items at all


@pytest.mark.parametrize("dtype", DTYPES)
def test_fitted_chunks(dtype):
    # Fitted: fewer, longer items (one per program) where the chunk stays within 1.5x the
    # plain one; more live requests than programs, or a longer fitted chunk, keeps the plain
    # chunk. Padding rows, a one-token request and chunk edges inside pages.
    lens = [700, 3, 0, 17, 40, 1, 64, 0, 9, 333]
    c = case(lens, dtype)
    fitted = 0
    for programs in (9, 12, 16, 40, 4):
        plan = balanced_plan(len(lens), programs, fit_items=True)
        check(c, plan)  # the partition is python_partition's, fitted or not
        block_n = tile_tokens(plan, c.q.element_size())
        plain = python_partition(lens, block_n, programs, plan.min_chunk_tiles)[1]
        items, chunk = ws_partition(c, plan)
        if chunk > plain:
            fitted += 1
            assert sum(items) <= programs
    assert fitted >= 1, "no program count took the fitted chunk: the case tests nothing"


def test_more_programs_than_tiles():
    check(case([5, 70, 1]), balanced_plan(3, 16))


def test_fewer_programs_than_requests():
    lens = [33, 1, 90, 7, 64, 200, 2]
    for programs in (1, 2):
        check(case(lens), balanced_plan(len(lens), programs))


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_scattered_pages(page_size):
    # page 64 with 64-token tiles takes the one-page-per-tile path; 1 and 16 gather per token
    lens = [1, 300, 129, 33]
    check(case(lens, page_size=page_size), balanced_plan(len(lens), 5))


@pytest.mark.parametrize("num_heads", [8, 12, 128])
def test_head_counts_mask_partial_head_blocks(num_heads):
    lens = [150, 3]
    check(case(lens, heads=num_heads), balanced_plan(2, 3, heads=num_heads))


def test_merge_carries_state_across_merge_blocks():
    # 80 items of one request through a 32-row merge tile: three steps.
    plan = replace(balanced_plan(1, 80), merge_block_s=32)
    check(case([80 * 64 - 5]), plan)


def test_without_lse_output():
    c = case([300, 20])
    plan = balanced_plan(2, 4)
    out, lse, _ = run_balanced(c, plan, with_lse=False)
    ref, _ = mla_decode_reference(c.q.cpu(), c.kv_cache.cpu(), c.block_table.cpu(),
                                  c.seq_lens.cpu(), kv_lora_rank=RANK, sm_scale=SM_SCALE)
    assert lse is None and rel_l2(out.cpu(), ref) < 1e-2


def test_same_result_as_split_kv():
    c = case([500, 4, 0, 77], DTYPES[-1])
    split = plan_mla_decode(4, HEADS, 500, num_sms=4, **DIMS)
    assert split.use_stage2
    ws = SplitWorkspace.allocate(4, HEADS, split.num_kv_splits, RANK, DEVICE)
    want = torch.empty(4, HEADS, RANK, dtype=c.q.dtype, device=DEVICE)
    mla_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, want, ws, plan=split,
               sm_scale=SM_SCALE)
    got = check(c, balanced_plan(4, 5))
    # Topology changes speed, not the result (beyond the output dtype's rounding).
    assert rel_l2(got.cpu(), want.cpu().double()) < (1e-3 if c.q.dtype == torch.float32
                                                     else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_as_close_to_float64_as_split_kv(dtype, seed):
    # A long request cut into 11 (fp32: 13) items beside short ones: the balanced partials
    # (float32), their merge and the chunk edges add no error that split-KV (4 splits) or
    # one split do not have. Compared above the output's own rounding (most of the error
    # in 16 bits): partials kept in fp16 made that excess 1.10-1.13x split-KV's.
    lens = [2000, 40, 300, 7, 0, 900]
    c = make_case(lens, HEADS, page_size=16, dtype=dtype, device=DEVICE,
                  gen=torch.Generator().manual_seed(seed), kv_lora_rank=RANK, rope_dim=ROPE)
    ref, _ = mla_decode_reference(c.q.cpu(), c.kv_cache.cpu(), c.block_table.cpu(),
                                  c.seq_lens.cpu(), kv_lora_rank=RANK, sm_scale=SM_SCALE)
    rounding = rel_l2(ref.to(dtype), ref)

    def excess(out: torch.Tensor) -> float:
        return max(rel_l2(out.cpu(), ref) ** 2 - rounding ** 2, 0.0) ** 0.5

    balanced = balanced_plan(len(lens), 24)
    err = excess(check(c, balanced))
    assert ws_items(c, balanced)[0] >= 11
    split_errs = []
    for hint in (max(lens), 1):
        split = plan_mla_decode(len(lens), HEADS, hint, num_sms=8, **DIMS)
        ws = SplitWorkspace.allocate(len(lens), HEADS, split.num_kv_splits, RANK, DEVICE)
        out = torch.empty(len(lens), HEADS, RANK, dtype=dtype, device=DEVICE)
        mla_decode(c.q, c.kv_cache, c.block_table, c.seq_lens, out, ws, plan=split,
                   sm_scale=SM_SCALE)
        split_errs.append(excess(out))
    # The two split-KV launches differ from each other by up to 4 % here (interpreter); a
    # GPU's exp2 and MMA order differ again, so it gets more room.
    assert 0 < err <= (1.15 if ON_GPU else 1.05) * max(split_errs), (err, split_errs)


def ws_partition(c: DecodeCase, plan: LaunchPlan) -> tuple[list[int], int]:
    """Work items per request and the chunk (tiles) the planning kernel gives ``c``'s
    lengths."""
    ws = workspace_for(plan)
    launch_item_planner(c.seq_lens, ws, plan=plan, block_n=tile_tokens(plan, c.q.element_size()))
    indptr = ws.item_indptr[:plan.batch_size + 1].tolist()
    return [b - a for a, b in zip(indptr, indptr[1:], strict=False)], int(ws.chunk_tiles.item())


def ws_items(c: DecodeCase, plan: LaunchPlan) -> list[int]:
    """Work items per request the planning kernel gives ``c``'s lengths."""
    return ws_partition(c, plan)[0]


# --- host side ----------------------------------------------------------------------------

def test_launchers_refuse_the_other_topology_and_small_workspaces():
    c = case([10])
    out = torch.zeros(1, HEADS, RANK, dtype=c.q.dtype, device=DEVICE)
    balanced = balanced_plan(1, 4)
    split = plan_mla_decode(1, HEADS, 10, num_sms=4, **DIMS).with_splits(2)
    args = (c.q, c.kv_cache, c.block_table, c.seq_lens, out)
    with pytest.raises(ValueError, match="mla_decode_balanced"):
        mla_decode(*args, workspace_for(balanced), plan=balanced, sm_scale=SM_SCALE)
    with pytest.raises(ValueError, match="split-KV plan"):
        mla_decode_balanced(*args, workspace_for(balanced), plan=split, sm_scale=SM_SCALE)
    split_only = SplitWorkspace.allocate(1, HEADS, 2, RANK, DEVICE)
    with pytest.raises(ValueError, match="work items"):
        mla_decode_balanced(*args, split_only, plan=balanced, sm_scale=SM_SCALE)
    too_few = SplitWorkspace.allocate(1, HEADS, 1, RANK, DEVICE, max_items=3)
    with pytest.raises(ValueError, match="work items"):
        mla_decode_balanced(*args, too_few, plan=balanced, sm_scale=SM_SCALE)
    no_list = replace(workspace_for(balanced), merge_rows=None)  # the merge reads it
    with pytest.raises(ValueError, match="work items"):
        mla_decode_balanced(*args, no_list, plan=balanced, sm_scale=SM_SCALE)
    with pytest.raises(ValueError, match="dtypes"):
        mla_decode_balanced(c.q.float(), *args[1:], workspace_for(balanced), plan=balanced,
                            sm_scale=SM_SCALE)
    assert (out == 0).all()


def test_one_workspace_serves_split_and_balanced_plans():
    split_backend = TritonBackend(num_sms=2, **DIMS)
    balanced_backend = TritonBackend(num_sms=2, balanced=True, **DIMS)
    plans = [split_backend.plan(bs, HEADS, hint) for bs in (1, 3) for hint in (1, 300)]
    plans += [balanced_backend.plan(bs, HEADS, 1) for bs in (1, 3)]
    spec = split_backend.workspace_spec(plans)
    assert spec.max_items == max(p.max_work_items for p in plans) > 0
    ws = spec.allocate(DEVICE)
    assert all(ws.fits(p) for p in plans)
    tensors = (ws.partial_o, ws.partial_lse, ws.item_o, ws.item_lse, ws.item_indptr,
               ws.chunk_tiles, ws.tile_indptr, ws.merge_rows)
    assert spec.nbytes == sum(t.numel() * t.element_size() for t in tensors)
    balanced_only = balanced_backend.workspace_spec(plans[-2:])
    ws_b = balanced_only.allocate(DEVICE)
    assert ws_b.partial_o.numel() == 0 and all(ws_b.fits(p) for p in plans[-2:])
    assert balanced_only.nbytes == sum(t.numel() * t.element_size() for t in
                                       (ws_b.item_o, ws_b.item_lse, ws_b.item_indptr,
                                        ws_b.chunk_tiles, ws_b.tile_indptr, ws_b.merge_rows))

    c = case([300, 0, 41])
    for plan in (p for p in plans if p.batch_size == 3):
        out = torch.full((3, HEADS, RANK), float("nan"), dtype=c.q.dtype, device=DEVICE)
        split_backend.run(c.q, c.kv_cache, c.block_table, c.seq_lens, out, ws, plan=plan,
                          sm_scale=SM_SCALE)
        ref, _ = mla_decode_reference(c.q.cpu(), c.kv_cache.cpu(), c.block_table.cpu(),
                                      c.seq_lens.cpu(), kv_lora_rank=RANK, sm_scale=SM_SCALE)
        assert rel_l2(out.cpu(), ref) < 1e-2, plan.describe()


def test_runner_steps_through_every_bucket_with_one_balanced_plan_per_batch_size(device):
    model = ToyMLA(device=device)
    backend = get_backend("triton", num_sms=1, balanced=True, **DIMS)
    runner = GraphBucketRunner.for_policy(
        "ladder", model, spec=toy_spec(device=device), batch_sizes=[1, 2], max_model_len=320,
        sm_scale=SM_SCALE, backend=backend, ladder=LADDER, warmup_iters=int(ON_GPU),
        progress=False)
    runner.capture()
    # The plan ignores the hint: every bucket of a batch size aliases one graph.
    assert sorted(r.plan.batch_size for r in runner.records) == [1, 2]
    assert all(r.plan.balanced for r in runner.records)
    rng = np.random.default_rng(0)
    for lens in ([20, 10], [300, 3], [64, 0], [320, 270], [300]):
        batch = toy_batch(lens, rng=rng)
        want = toy_reference(model, batch, sm_scale=SM_SCALE)
        assert rel_l2(runner.step(batch), want) < (1e-2 if ON_GPU else 1e-5), lens
    runner.close()


# --- GPU ----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[70000] + [1000] * 15, [4096] * 8, [1, 31, 0, 4095]])
def test_gpu_bf16_full_shapes(lens):
    c = make_case(lens, 16, page_size=64, dtype=torch.bfloat16, device="cuda")
    plan = plan_balanced_mla_decode(len(lens), 16, num_sms=132)
    ws = SplitWorkspace.allocate(plan.batch_size, 16, 1, 512, "cuda",
                                 max_items=plan.max_work_items)
    out = torch.empty(len(lens), 16, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(len(lens), 16, device="cuda")
    mla_decode_balanced(c.q, c.kv_cache, c.block_table, c.seq_lens, out, ws, plan=plan,
                        sm_scale=1.0 / 192 ** 0.5, lse=lse)
    ref, ref_lse = mla_decode_reference(c.q.cpu(), c.kv_cache.cpu(), c.block_table.cpu(),
                                        c.seq_lens.cpu(), kv_lora_rank=512,
                                        sm_scale=1.0 / 192 ** 0.5)
    assert rel_l2(out.cpu(), ref) < 1e-2
    live = c.seq_lens.cpu() > 0
    assert (lse.cpu().double()[live] - ref_lse[live]).abs().max().item() < 2e-2


@pytest.mark.gpu
def test_gpu_graph_replay_repartitions_new_lengths():
    # Captured once, replayed with other lengths: the partition follows the live lengths.
    lens_a, lens_b = [4096, 64, 0, 1], [64, 9000, 300, 0]
    c = make_case([max(a, b) for a, b in zip(lens_a, lens_b, strict=True)], 16, page_size=64,
                  dtype=torch.bfloat16, device="cuda")
    plan = plan_balanced_mla_decode(4, 16, num_sms=132)
    ws = SplitWorkspace.allocate(4, 16, 1, 512, "cuda", max_items=plan.max_work_items)
    out = torch.empty(4, 16, 512, dtype=torch.bfloat16, device="cuda")
    seq_lens = torch.tensor(lens_a, dtype=torch.int32, device="cuda")
    run = lambda: mla_decode_balanced(c.q, c.kv_cache, c.block_table, seq_lens, out, ws,
                                      plan=plan, sm_scale=0.1)
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for lens in (lens_b, lens_a):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        ref, _ = mla_decode_reference(c.q.cpu(), c.kv_cache.cpu(), c.block_table.cpu(),
                                      seq_lens.cpu(), kv_lora_rank=512, sm_scale=0.1)
        assert rel_l2(out.cpu(), ref) < 1e-2


GPU_MML, GPU_PAGE, GPU_PAGES, GPU_HIDDEN = 32768, 64, 4096, 256


@pytest.mark.gpu
def test_gpu_random_ragged_steps_through_balanced_graphs_match_eager_and_float64():
    # bf16 toy model (16 heads, rank 512), the device's ladder: every step is ragged (one
    # long request among short ones), and the ladder's ragged switch replays a balanced
    # graph for most of them (a split-KV one where it measured that faster, as at two
    # requests). Each step against the eager forward (split-KV planned from the live
    # lengths) and float64.
    model = ToyMLA(num_pages=GPU_PAGES, dtype=torch.bfloat16, device="cuda", rank=512, rope=64,
                   hidden=GPU_HIDDEN, page=GPU_PAGE)
    spec = toy_spec(max_pages=GPU_MML // GPU_PAGE, num_pages=GPU_PAGES, dtype=torch.bfloat16,
                    device="cuda", page=GPU_PAGE, hidden=GPU_HIDDEN)
    runners = {policy: GraphBucketRunner.for_policy(
        policy, model, spec=spec, batch_sizes=[2, 8, 32], max_model_len=GPU_MML,
        sm_scale=SM_SCALE, backend=get_backend("triton", device="cuda"), progress=False)
        for policy in ("ladder", "eager")}
    runners["ladder"].capture()
    rng = np.random.default_rng(25)
    errs = {"balanced": [], "eager": []}
    balanced_steps = 0
    for step in range(300):
        bs = int(rng.integers(2, 33))
        lens = [int(rng.integers(8192, GPU_MML + 1))]
        lens += rng.integers(1, 2048, size=bs - 1).tolist()
        batch = toy_batch(lens, rng=rng, max_pages=GPU_MML // GPU_PAGE, num_pages=GPU_PAGES,
                          dtype=torch.bfloat16, hidden=GPU_HIDDEN, page=GPU_PAGE)
        before = runners["ladder"].stats().replays
        got = runners["ladder"].step(batch).clone()
        (key,) = [k for k, n in runners["ladder"].stats().replays.items()
                  if n != before.get(k, 0)]
        balanced_steps += key.balanced
        eager = runners["eager"].step(batch).clone()
        ref = toy_reference(model, batch, sm_scale=SM_SCALE, device="cuda")
        errs["balanced"].append(rel_l2(got, ref))
        errs["eager"].append(rel_l2(eager, ref))
        assert errs["balanced"][-1] < 1e-2 and rel_l2(got, eager) < 1e-2, (step, lens)
    assert balanced_steps >= 150, f"{balanced_steps} of 300 ragged steps replayed balanced"
    # No precision lost to the topology: on average as far from float64 as eager.
    mean = {k: sum(v) / len(v) for k, v in errs.items()}
    assert mean["balanced"] <= 1.1 * mean["eager"], mean
    for runner in runners.values():
        runner.close()
