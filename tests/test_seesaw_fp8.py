"""The Gluon seesaw over fp8 caches (``kernels/seesaw_fp8.py``), per-tensor and V3.2:
stage 1 launched directly, then the merge as ``mla_decode`` launches it, and through
``mla_decode`` / ``mla_decode_balanced`` for the plans they route to it, against float64
over the dequantized cache (sm_90 only; the compile test in ``test_seesaw.py``
covers the kernels on any machine)."""

from __future__ import annotations

import pytest
import torch

from graphbucket import fp8
from graphbucket.kernels.launch import (
    default_sm_scale,
    launch_merge,
    launch_seesaw_fp8_stage1,
    mla_decode,
    pdl_capable,
)
from graphbucket.kernels.launch_balanced import (
    launch_balanced_merge,
    launch_range_planner,
    launch_seesaw_range_stage1,
    mla_decode_balanced,
)
from graphbucket.kernels.seesaw_route import runs_seesaw_over_fp8
from graphbucket.plan import plan_balanced_mla_decode, plan_mla_decode
from graphbucket.plan_streams import SEESAW_STREAM
from graphbucket.reference import mla_decode_reference
from tests.kernel_cases import KV_LORA_RANK, make_case, rel_l2
from tests.test_seesaw import nan_outputs

E4M3_NAN = 0x7F  # float8_e4m3fn's NaN code


def fp8_nan_tailed_case(lens, heads, gen):
    """bf16 q and a per-tensor fp8 cache of 64-token pages (scattered, with poisoned spare
    pages) whose rows past each length hold NaN codes; the cache's scale."""
    case = make_case(lens, heads, page_size=64, dtype=torch.float32, device="cpu", gen=gen)
    scale = fp8.scale_for(case.kv_cache.abs().amax())
    cache = fp8.quantize(case.kv_cache, scale)
    for b, n in enumerate(lens):
        if n % 64:
            cache.view(torch.uint8)[case.block_table[b, n // 64], n % 64:] = E4M3_NAN
    return (case.q.to(torch.bfloat16).cuda(), cache.cuda(), case.block_table.cuda(),
            case.seq_lens.cuda(), scale.cuda())


def v32_nan_tailed_case(lens, heads, gen):
    """bf16 q and a V3.2 cache of 64-token pages, its latent groups at different
    magnitudes (a wrong group's scale shows), rows past each length NaN codes and NaN
    rope; no scale."""
    case = make_case(lens, heads, page_size=64, dtype=torch.float32, device="cpu", gen=gen)
    case.kv_cache[..., :512] *= torch.tensor([0.05, 1.0, 8.0, 0.5]).repeat_interleave(128)
    cache = fp8.pack_v32(case.kv_cache)
    for b, n in enumerate(lens):
        if n % 64:
            tail = cache[case.block_table[b, n // 64], n % 64:]
            tail[:, :512] = E4M3_NAN
            tail[:, 528:] = 0xFF  # bf16 NaN bytes
    return (case.q.to(torch.bfloat16).cuda(), cache.cuda(), case.block_table.cuda(),
            case.seq_lens.cuda(), None)


def fp8_case(fmt, lens, rows, seeded):
    """(q, cache, block table, lengths, scale) of ``fmt`` ("fp8-tensor" or "fp8-v32")."""
    gen = torch.Generator().manual_seed(seeded)
    make = fp8_nan_tailed_case if fmt == "fp8-tensor" else v32_nan_tailed_case
    return make(lens, rows, gen)


def dequantized(cache, scale):
    return fp8.unpack_v32(cache.cpu()) if scale is None else fp8.dequantize(cache.cpu(),
                                                                           scale.cpu())


def split_kv(q, cache, table, seq_lens, scale, plan, sm_scale):
    """Stage 1 by the fp8 seesaw, then the merge where the plan has one, as
    ``mla_decode`` launches the bf16 seesaw: (out, lse), NaN where left unwritten."""
    ws, out, lse = nan_outputs(q.shape[0], q.shape[1], plan)
    launch_seesaw_fp8_stage1(q, cache, table, seq_lens, out,
                             ws if plan.use_stage2 else None, plan=plan, sm_scale=sm_scale,
                             lse=lse, kv_scale=scale)
    if plan.merge_kernel:
        launch_merge(seq_lens, out, ws, plan=plan, lse=lse, block_n=64)
    return out, lse


def assert_matches(want, want_lse, lens, out, lse, plan):
    """Each request's rows against float64 (an empty request: zeros, LSE -inf). Q's
    float16 rounding (exact for bf16 values of ordinary range) and the tiles' (V3.2: code x
    scale in float16) reach scores of magnitude ~20 at 128 heads: the LSE's bound grows
    with it."""
    for b, n in enumerate(lens):
        if n == 0:
            assert (out[b] == 0).all() and (lse[b] == float("-inf")).all()
            continue
        assert rel_l2(out[b].double(), want[b]) < 1e-2, (b, n, plan.describe())
        got, w = lse[b].double().cpu(), want_lse[b]
        finite = torch.isfinite(w)
        assert (got[~finite] == float("-inf")).all(), (b, n)
        assert ((got - w)[finite].abs() <= 2e-2 + 3e-3 * w[finite].abs()).all(), (b, n)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[1], [63, 64, 65], [127, 128, 129, 0], [4113], [70000, 17],
                                  [2048] * 8])
@pytest.mark.parametrize("heads", [16, 128])  # 16: one program, rows past 16 unstored
@pytest.mark.parametrize("splits", [1, 3, 0])  # 0: the planned count
@pytest.mark.parametrize("fmt", ["fp8-tensor", "fp8-v32"])
def test_gpu_fp8_seesaw_matches_float64_over_the_dequantized_cache(lens, heads, splits, fmt,
                                                                   seeded):
    from graphbucket.kernels.seesaw_fp8 import runs_seesaw_fp8

    q, cache, table, seq_lens, scale = fp8_case(fmt, lens, heads, seeded)
    assert runs_seesaw_fp8(q, cache, scale, heads)
    plan = plan_mla_decode(len(lens), heads, max(lens), stream=SEESAW_STREAM)
    plan = plan.with_splits(splits) if splits else plan
    sm_scale = default_sm_scale()
    out, lse = split_kv(q, cache, table, seq_lens, scale, plan, sm_scale)
    want, want_lse = mla_decode_reference(q.cpu(), dequantized(cache, scale),
                                          table.cpu(), seq_lens.cpu(),
                                          kv_lora_rank=KV_LORA_RANK, sm_scale=sm_scale)
    assert_matches(want, want_lse, lens, out, lse, plan)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[4], [64, 65, 66, 67], [129, 130, 0], [4113], [70000, 17]])
@pytest.mark.parametrize("heads, q_len", [(16, 2), (16, 4), (128, 2)])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("fmt", ["fp8-tensor", "fp8-v32"])
def test_gpu_fp8_seesaw_verify_step_matches_per_token_float64(lens, heads, q_len, splits, fmt,
                                                               seeded):
    """A verify step of q_len tokens x heads rows over an fp8 cache, token j seeing the
    positions before seq_len - q_len + j + 1 (a row that sees none: zeros, LSE -inf),
    through ``mla_decode``, which routes a seesaw plan's verify step to the fp8 seesaw."""
    from tests.kernel_cases import DecodeCase
    from tests.test_multi_token import reference

    rows = q_len * heads
    q, cache, table, seq_lens, scale = fp8_case(fmt, lens, rows, seeded)
    plan = plan_mla_decode(len(lens), rows, max(lens), stream=SEESAW_STREAM).with_splits(splits)
    assert runs_seesaw_over_fp8(plan, q, cache, q_len=q_len, kv_scale=scale), plan.describe()
    ws, out, lse = nan_outputs(len(lens), rows, plan)
    mla_decode(q, cache, table, seq_lens, out, ws, plan=plan, sm_scale=default_sm_scale(),
               lse=lse, kv_scale=scale, q_len=q_len)
    case = DecodeCase(q.cpu(), dequantized(cache, scale), table.cpu(), seq_lens.cpu())
    want, want_lse = reference(case, q_len)
    assert_matches(want, want_lse, lens, out, lse, plan)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[63, 64, 65, 0], [70000] + [1000] * 15,
                                  [1, 31, 0, 4095, 128, 129], [100000] + [1024] * 31])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("programs, charged", [(3, False), (0, True), (3, True)])
@pytest.mark.parametrize("fmt", ["fp8-tensor", "fp8-v32"])
def test_gpu_fp8_range_seesaw_matches_float64_over_the_dequantized_cache(lens, heads, programs,
                                                                         charged, fmt, seeded):
    """The seesaw over tile ranges (equal, or a charged cut's) on an fp8 cache: planner,
    stage 1 launched directly, merge, as ``mla_decode_balanced`` runs the bf16 ones."""
    q, cache, table, seq_lens, scale = fp8_case(fmt, lens, heads, seeded)
    plan = plan_balanced_mla_decode(len(lens), heads, stream=SEESAW_STREAM, tile_ranges=True,
                                    programs=programs or None, charged_ranges=charged)
    sm_scale = default_sm_scale()
    ws, out, lse = nan_outputs(len(lens), heads, plan)
    launch_range_planner(seq_lens, ws, plan=plan)
    launch_seesaw_range_stage1(q, cache, table, seq_lens, ws, plan=plan, sm_scale=sm_scale,
                               out=out, lse=lse, kv_scale=scale)
    launch_balanced_merge(out, ws, plan=plan, lse=lse,
                          dependent=charged and pdl_capable(out.device))
    want, want_lse = mla_decode_reference(q.cpu(), dequantized(cache, scale), table.cpu(),
                                          seq_lens.cpu(), kv_lora_rank=KV_LORA_RANK,
                                          sm_scale=sm_scale)
    assert_matches(want, want_lse, lens, out, lse, plan)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[63, 64, 65, 0], [70000] + [1000] * 15])
@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("fmt", ["fp8-tensor", "fp8-v32"])
def test_gpu_mla_decode_runs_seesaw_plans_over_fp8_on_the_fp8_seesaw(lens, balanced, fmt,
                                                                     seeded):
    """The public launches route a 128-head seesaw plan over an fp8 cache (split-KV, and a
    balanced plan over tile ranges) to the fp8 seesaw, checked, against float64."""
    q, cache, table, seq_lens, scale = fp8_case(fmt, lens, 128, seeded)
    plan = (plan_balanced_mla_decode(len(lens), 128, tile_ranges=True) if balanced
            else plan_mla_decode(len(lens), 128, max(lens)))
    assert plan.seesaw and runs_seesaw_over_fp8(plan, q, cache, kv_scale=scale), plan.describe()
    sm_scale = default_sm_scale()
    ws, out, lse = nan_outputs(len(lens), 128, plan)
    decode = mla_decode_balanced if balanced else mla_decode
    decode(q, cache, table, seq_lens, out, ws, plan=plan, sm_scale=sm_scale, lse=lse,
           kv_scale=scale)
    want, want_lse = mla_decode_reference(q.cpu(), dequantized(cache, scale), table.cpu(),
                                          seq_lens.cpu(), kv_lora_rank=KV_LORA_RANK,
                                          sm_scale=sm_scale)
    assert_matches(want, want_lse, lens, out, lse, plan)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[63, 64, 65, 0], [70000] + [1000] * 15,
                                  [1, 31, 0, 4095, 128, 129]])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("programs, fit", [(3, False), (0, False), (0, True)])
@pytest.mark.parametrize("fmt", ["fp8-tensor", "fp8-v32"])
def test_gpu_fp8_item_seesaw_matches_float64_over_the_dequantized_cache(lens, heads, programs,
                                                                        fit, fmt, seeded):
    """``mla_decode_balanced`` over an fp8 cache with the item seesaw's plans (few programs:
    requests of many items; the default's and fitted chunks: requests of one item, whose
    output stage 1 writes): item planner in 64-token tiles, fp8 stage 1, merge."""
    q, cache, table, seq_lens, scale = fp8_case(fmt, lens, heads, seeded)
    plan = plan_balanced_mla_decode(len(lens), heads, stream=SEESAW_STREAM,
                                    programs=programs or None, fit_items=fit)
    assert plan.seesaw and not plan.tile_ranges, plan.describe()
    assert runs_seesaw_over_fp8(plan, q, cache, kv_scale=scale), plan.describe()
    sm_scale = default_sm_scale()
    ws, out, lse = nan_outputs(len(lens), heads, plan)
    mla_decode_balanced(q, cache, table, seq_lens, out, ws, plan=plan, sm_scale=sm_scale,
                        lse=lse, kv_scale=scale)
    want, want_lse = mla_decode_reference(q.cpu(), dequantized(cache, scale), table.cpu(),
                                          seq_lens.cpu(), kv_lora_rank=KV_LORA_RANK,
                                          sm_scale=sm_scale)
    assert_matches(want, want_lse, lens, out, lse, plan)


@pytest.mark.host
@pytest.mark.parametrize("ahead", [0, -1, 1.5])
def test_prefetch_distance_is_checked_before_any_launch(ahead):
    """A distance below one step would prefetch pages before the split (block-table entries
    before the request's row): refused before the kernel is compiled or launched."""
    q = torch.zeros(1, 16, 576, dtype=torch.bfloat16)
    plan = plan_mla_decode(1, 16, 1024, stream=SEESAW_STREAM)
    with pytest.raises(ValueError, match="prefetch_ahead must be an int >= 1"):
        launch_seesaw_fp8_stage1(q, torch.zeros(1, 64, 576), torch.zeros(1, 1, dtype=torch.int32),
                                 torch.ones(1, dtype=torch.int32), torch.zeros(1, 16, 512), None,
                                 plan=plan, sm_scale=0.1, lse=None, kv_scale=None,
                                 prefetch_ahead=ahead)
