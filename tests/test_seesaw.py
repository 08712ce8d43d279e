"""The Gluon seesaw stage 1 (64 query rows, two warpgroups): against float64 through
``mla_decode`` with the plans that select it (GPU), and its sm_90 compile (any machine)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from graphbucket.kernels import (
    SplitWorkspace,
    default_sm_scale,
    mla_decode,
    mla_decode_balanced,
)
from graphbucket.kernels.launch import launch_merge, launch_seesaw_stage1, runs_seesaw
from graphbucket.plan import plan_balanced_mla_decode, plan_mla_decode
from graphbucket.plan_streams import SEESAW_STREAM
from graphbucket.reference import mla_decode_reference
from tests.kernel_cases import KV_LORA_RANK, make_case, rel_l2


def nan_tailed_case(lens, heads, gen):
    """A bf16 case of 64-token pages whose cache rows past each length hold NaN (unwritten
    rows may hold anything: none may leak into the output)."""
    case = make_case(lens, heads, page_size=64, dtype=torch.bfloat16, device="cuda", gen=gen)
    for b, n in enumerate(lens):
        if n % 64:
            case.kv_cache[case.block_table[b, n // 64], n % 64:] = float("nan")
    return case


def nan_outputs(batch: int, rows: int, plan):
    """A workspace for ``plan`` (split or balanced) and NaN-filled out [batch, rows, 512]
    (bf16) and LSE: a row a kernel leaves unwritten shows up as NaN."""
    ws = SplitWorkspace.allocate(batch, rows, max(1, plan.num_kv_splits), KV_LORA_RANK, "cuda",
                                 max_items=plan.max_work_items)
    out = torch.full((batch, rows, KV_LORA_RANK), float("nan"), dtype=torch.bfloat16,
                     device="cuda")
    return ws, out, torch.full((batch, rows), float("nan"), device="cuda")


def seesaw_then_merge(case, plan, ws, out, lse, sm_scale, **trial):
    """Stage 1 by the seesaw launched directly (``trial``: its options under trial), then
    the merge where the plan has one, as ``mla_decode`` launches them."""
    launch_seesaw_stage1(case.q.contiguous(), case.kv_cache, case.block_table, case.seq_lens,
                         out, ws if plan.use_stage2 else None, plan=plan, sm_scale=sm_scale,
                         lse=lse, **trial)
    if plan.merge_kernel:
        launch_merge(case.seq_lens, out, ws, plan=plan, lse=lse, block_n=64)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[1], [63, 64, 65], [127, 128, 129, 0], [4113], [70000, 17],
                                  [2048] * 8])
@pytest.mark.parametrize("heads", [16, 32, 64, 128])  # below 64: one program, rows unstored
@pytest.mark.parametrize("splits", [1, 3, 0])  # 0: the planned count
def test_gpu_seesaw_matches_float64(lens, heads, splits, seeded):
    gen = torch.Generator().manual_seed(seeded)
    case = nan_tailed_case(lens, heads, gen)
    if splits or heads < 64:  # the seesaw below 64 heads only when the plan asks for it
        plan = plan_mla_decode(len(lens), heads, max(lens), stream=SEESAW_STREAM)
        plan = plan.with_splits(splits) if splits else plan
    else:
        plan = plan_mla_decode(len(lens), heads, max(lens))
    q = case.q.contiguous()
    assert plan.seesaw and runs_seesaw(plan, q, case.kv_cache), plan.describe()
    sm_scale = default_sm_scale()
    ws, out, lse = nan_outputs(len(lens), heads, plan)
    mla_decode(q, case.kv_cache, case.block_table, case.seq_lens, out, ws, plan=plan,
               sm_scale=sm_scale, lse=lse)
    assert_matches_float64(case, lens, out, lse, sm_scale, plan)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[1], [63, 64, 65], [127, 128, 129, 0], [4113], [70000, 17],
                                  [2048] * 8])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("splits", [1, 3, 0])
# The variants kept to compare: one-rescale order, 64-column PVs, both, the eager rescale
# (256 columns is the default); the lazy rescale (the default over bf16) asked for.
@pytest.mark.parametrize("one_rescale, pv_cols, lazy", [(True, 64, False), (False, 64, False),
                                                        (True, 256, False), (False, None, False),
                                                        (False, None, True)])
def test_gpu_seesaw_step_variants_match_float64(lens, heads, splits, one_rescale, pv_cols, lazy,
                                                seeded):
    """The step variants kept to compare (``seesaw_step._one_rescale_step``: both tiles' P
    against the step's final max, one O rescale, the two PVs back to back; ``PV_COLS`` 64:
    four m64n64k16 per 16 tokens, one per value box; the eager rescale, every step) and the
    default (``seesaw_lazy``: the running max moves only past a bound, the rescale only when
    one does), stage 1 then the merge as ``mla_decode`` launches them."""
    gen = torch.Generator().manual_seed(seeded)
    case = nan_tailed_case(lens, heads, gen)
    plan = plan_mla_decode(len(lens), heads, max(lens), stream=SEESAW_STREAM)
    plan = plan.with_splits(splits) if splits else plan
    q = case.q.contiguous()
    assert plan.seesaw and runs_seesaw(plan, q, case.kv_cache), plan.describe()
    sm_scale = default_sm_scale()
    ws, out, lse = nan_outputs(len(lens), heads, plan)
    seesaw_then_merge(case, plan, ws, out, lse, sm_scale, one_rescale=one_rescale,
                      pv_cols=pv_cols, lazy_rescale=lazy)
    assert_matches_float64(case, lens, out, lse, sm_scale, plan)


@pytest.mark.gpu
@pytest.mark.parametrize("jumps", [[130], [700, 1500, 3900], [63, 64]])
@pytest.mark.parametrize("lazy", [False, True])
def test_gpu_seesaw_matches_float64_where_the_row_max_jumps(jumps, lazy, seeded):
    """Keys far more aligned with q at a few positions (score jumps of tens in log2 units,
    past the lazy step's bound): the running max must move there, O and l be rescaled, and
    the output still match float64 (random caches rarely move the max past the first tile)."""
    gen = torch.Generator().manual_seed(seeded)
    lens = [4113, 2000]
    case = nan_tailed_case(lens, 128, gen)
    for b, n in enumerate(lens):
        for pos in (p for p in jumps if p < n):
            page, row = case.block_table[b, pos // 64], pos % 64
            # The key part of the row (all 576 columns) along head 0's query, scaled up.
            q0 = case.q[b, 0].float()
            case.kv_cache[page, row] = (q0 / q0.norm() * 40 * (1 + pos / n)).to(torch.bfloat16)
    plan = plan_mla_decode(len(lens), 128, max(lens), stream=SEESAW_STREAM).with_splits(2)
    sm_scale = default_sm_scale()
    ws, out, lse = nan_outputs(len(lens), 128, plan)
    seesaw_then_merge(case, plan, ws, out, lse, sm_scale, lazy_rescale=lazy)
    assert_matches_float64(case, lens, out, lse, sm_scale, plan)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[4], [64, 65, 66, 67], [129, 130, 0], [4113], [70000, 17]])
@pytest.mark.parametrize("heads, q_len", [(16, 2), (16, 4), (128, 2)])
# "tile": one 64-token tile per split, up to 64 splits (short last splits).
@pytest.mark.parametrize("splits", [1, 3, "tile"])
@pytest.mark.parametrize("one_rescale, pv_cols, lazy", [(False, None, None), (False, 64, False),
                                                        (True, 256, False), (False, 256, False),
                                                        (False, None, True)])
def test_gpu_seesaw_verify_step_matches_per_token_float64(lens, heads, q_len, splits,
                                                           one_rescale, pv_cols, lazy, seeded):
    """A verify step on the seesaw: q_len tokens x heads rows, token j seeing the positions
    before seq_len - q_len + j + 1. One-tile splits leave a request's last split with rows
    that see no token (zeros, LSE -inf into the merge). The default step goes through
    ``mla_decode`` (which routes a seesaw plan's verify step here), the variants are
    launched directly."""
    from tests.test_multi_token import reference

    gen = torch.Generator().manual_seed(seeded)
    rows = q_len * heads
    case = nan_tailed_case(lens, rows, gen)
    plan = plan_mla_decode(len(lens), rows, max(lens), stream=SEESAW_STREAM)
    plan = plan.with_splits(min(64, -(-max(lens) // 64)) if splits == "tile" else splits)
    q = case.q.contiguous()
    assert plan.seesaw and runs_seesaw(plan, q, case.kv_cache, q_len=q_len), plan.describe()
    sm_scale = default_sm_scale()
    ws, out, lse = nan_outputs(len(lens), rows, plan)
    if lazy is None:  # the default (the lazy step over bf16)
        mla_decode(q, case.kv_cache, case.block_table, case.seq_lens, out, ws, plan=plan,
                   sm_scale=sm_scale, lse=lse, q_len=q_len)
    else:
        seesaw_then_merge(case, plan, ws, out, lse, sm_scale, one_rescale=one_rescale,
                          q_len=q_len, pv_cols=pv_cols, lazy_rescale=lazy)
    assert_matches(*reference(case, q_len), lens, out, lse, plan)


def assert_matches_float64(case, lens, out, lse, sm_scale, plan):
    """Each request's output and LSE against the float64 reference; padding rows zero."""
    want, want_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table,
                                          case.seq_lens, kv_lora_rank=KV_LORA_RANK,
                                          sm_scale=sm_scale)
    assert_matches(want, want_lse, lens, out, lse, plan)


def assert_matches(want, want_lse, lens, out, lse, plan):
    """``out`` and ``lse`` against a float64 ``want`` and ``want_lse`` per request; padding
    rows zero with LSE -inf."""
    for b, n in enumerate(lens):
        if n == 0:
            assert (out[b] == 0).all() and (lse[b] == float("-inf")).all()
            continue
        assert rel_l2(out[b].double(), want[b].to(out.device)) < 1e-2, (b, n, plan.describe())
        assert torch.allclose(lse[b].double(), want_lse[b].to(lse.device), atol=2e-2), (b, n)


@pytest.mark.gpu
def test_gpu_seesaw_plan_and_triton_plan_agree(seeded):
    """The same plan with stage 1 by either kernel: outputs within bf16 rounding."""
    gen = torch.Generator().manual_seed(seeded)
    lens = [5000, 1, 300, 64]
    case = make_case(lens, 128, page_size=64, dtype=torch.bfloat16, device="cuda", gen=gen)
    plan = plan_mla_decode(len(lens), 128, max(lens))
    ws = SplitWorkspace.allocate(len(lens), 128, plan.num_kv_splits, KV_LORA_RANK, "cuda")
    outs = []
    for p in (plan, replace(plan, seesaw=False)):
        out = torch.empty(len(lens), 128, KV_LORA_RANK, dtype=torch.bfloat16, device="cuda")
        mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out, ws, plan=p,
                   sm_scale=default_sm_scale())
        outs.append(out.float())
    assert rel_l2(outs[0], outs[1]) < 5e-3


def test_the_lazy_step_is_the_default_wherever_it_runs():
    """Over a bf16 cache the launchers ask for the lazy step unless told otherwise; the
    one-rescale order, 64-column PVs and fp8 caches (whose converter it was not measured
    with) keep the eager rescale, the kernels' own default."""
    from graphbucket.kernels.seesaw_route import seesaw_step_args

    assert seesaw_step_args(None, None) == {"LAZY_RESCALE": True}
    assert seesaw_step_args(256, None) == {"PV_COLS": 256, "LAZY_RESCALE": True}
    assert seesaw_step_args(None, False) == {}
    assert seesaw_step_args(64, None) == {"PV_COLS": 64}
    assert seesaw_step_args(None, None, one_rescale=True) == {"ONE_RESCALE": True}
    assert seesaw_step_args(None, None, fp8=True) == {}
    assert seesaw_step_args(None, True, fp8=True) == {"LAZY_RESCALE": True}


def test_lazy_rescale_asks_for_the_default_order_on_wide_pvs():
    """The lazy step runs the default order on 256-column PVs: asked with the one-rescale
    order or 64-column PVs, the launchers raise before anything is launched (no GPU)."""
    from graphbucket.kernels.launch_balanced import (
        launch_seesaw_balanced_stage1,
        launch_seesaw_range_stage1,
    )

    plan = plan_mla_decode(2, 128, 4096, stream=SEESAW_STREAM)
    t = torch.zeros(1)
    for trial in ({"one_rescale": True}, {"pv_cols": 64}):
        with pytest.raises(ValueError, match="lazy_rescale"):
            launch_seesaw_stage1(t, t, t, t, t, None, plan=plan, sm_scale=1.0, lse=None,
                                 lazy_rescale=True, **trial)
    balanced = plan_balanced_mla_decode(2, 128, stream=SEESAW_STREAM)
    for launch in (launch_seesaw_balanced_stage1, launch_seesaw_range_stage1):
        with pytest.raises(ValueError, match="lazy_rescale"):
            launch(torch.zeros(2, 128, 576), t, t, t, None, plan=balanced, sm_scale=1.0, out=t,
                   pv_cols=64, lazy_rescale=True)


def test_seesaw_compiles_for_sm90_within_shared_memory():
    """The Gluon kernel compiles for Hopper on any machine (no GPU needed): within the 227 KB
    of shared memory one program may use, with the registers its partitions ask for, and on
    warpgroup MMA and TMA. In a fresh process: Triton's interpreter, on in CPU test runs,
    cannot compile Gluon."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-m", "tests.seesaw_compile"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # Split-KV (and its one-rescale step, and both for a verify step of 4 tokens), over
    # balanced work items, over tile ranges (equal, and a charged cut's).
    for kernel in (report, report["one_rescale"], report["q_len_4"],
                   report["q_len_4_one_rescale"], report["balanced"], report["ranges"],
                   report["charged"], report["wide_pv"], report["wide_pv_one_rescale"]):
        assert kernel["shared_bytes"] <= 227 * 1024, report
        assert kernel["requested_registers"] == [240, 24], report
        assert kernel["wgmma"] > 0 and kernel["tma_copies"] > 0, report
    # The Triton planner of both range cuts compiles for the GPU too (the interpreter runs
    # it in the CPU tests).
    assert set(report["range_planner_shared_bytes"]) == {"0", "0-bounds", "5-bounds"}, report
    # The charged seesaw lets the merge launch early; the merge waits for its partials.
    assert report["charged"]["dependent_launch"] and not report["ranges"]["dependent_launch"]
    # Under either cut stage 1 writes a whole request's output (the partials' stores and the
    # output's): equal ranges store as the charged cut does.
    for ranges, charged in (("ranges", "charged"), ("wide_pv_ranges", "wide_pv_charged")):
        assert report[ranges]["global_stores"] == report[charged]["global_stores"], report
    assert report["dependent_merge_waits"] >= 1, report
    # The merge over units of 8 heads compiles without spilling its [8, 8, 64] step.
    assert report["head_blocked_merge_spill_bytes"] in (None, 0), report
    # So does the plans' prefetched merge from 64 heads ([2, 4, 512] per step, 4 warps, the
    # next step's loads in flight).
    assert report["prefetched_merge_spill_bytes"] in (None, 0), report
    # The lazy step (under trial): within the budget, both of its second-PV paths (rescale
    # due: drain, rescale, issue; else: queue behind the first PV, keep it in flight).
    for lazy, default in (("lazy_rescale", "wide_pv"), ("lazy_rescale_q_len_4", "wide_pv_q_len_4"),
                          ("lazy_rescale_balanced", "wide_pv_balanced"),
                          ("lazy_rescale_charged", "wide_pv_charged")):
        kernel = report[lazy]
        assert kernel["shared_bytes"] <= 227 * 1024, report
        assert kernel["requested_registers"] == [240, 24], report
        assert kernel["wgmma_waits_one_left"] > report[default]["wgmma_waits_one_left"], lazy
        assert kernel["wgmma_n256"] > report[default]["wgmma_n256"], lazy
    # The one-rescale step issues as many wgmma, with two fewer drains and one O rescale
    # per warpgroup and step instead of two.
    assert report["one_rescale"]["wgmma"] == report["wgmma"], report
    assert report["one_rescale"]["wgmma_waits"] == report["wgmma_waits"] - 2, report
    # 256-column PVs: a warpgroup's PV of a tile is four m64n256k16 (16 tokens each), where
    # the 64-column PVs take sixteen m64n64k16.
    for kernel in (report, report["one_rescale"]):
        assert kernel["wgmma_n256"] == 0, report
    for kernel in (report["wide_pv"], report["wide_pv_one_rescale"]):
        assert kernel["wgmma_n256"] == 16 and kernel["wgmma"] < report["wgmma"], report
    # One 256-column accumulator holds fewer live registers than four 64-column ones: each
    # kernel spills no more at 256 columns (where this triton ships a ptxas for its PTX).
    # Four TMA boxes are one [64, 256] operand (not checkable on triton 3.6: None).
    assert report["wide_view_matches_boxes"] is not False, report
    for narrow, wide in (("", "wide_pv"), ("one_rescale", "wide_pv_one_rescale"),
                         ("balanced", "wide_pv_balanced"), ("ranges", "wide_pv_ranges"),
                         ("charged", "wide_pv_charged"), ("q_len_4", "wide_pv_q_len_4")):
        base = report[narrow] if narrow else report
        if base["spill_bytes"] is not None:
            assert report[wide]["spill_bytes"] <= base["spill_bytes"], (narrow, report)
    # The fp8 kernels (per-tensor, V3.2, a charged cut's ranges and balanced items on
    # per-tensor): no TMA (the converter loads the tiles), 256-column PVs on float16
    # boxes, the converter's registers taken from the compute warpgroups, and (where
    # ptxas runs) bounded spills:
    # the most any of triton 3.6-3.9's ptxas reports (3.8's: 48, 44 and 412 bytes) with
    # some room; a third tile half in flight spills over 100 bytes more.
    for name, most in (("fp8_tensor", 64), ("fp8_v32", 128), ("fp8_charged", 480),
                       ("fp8_items", 64), ("fp8_tensor_prefetch_2", 64)):
        kernel = report[name]
        assert kernel["shared_bytes"] <= 227 * 1024, report
        assert kernel["tma_copies"] == 0 and kernel["wgmma_n256"] == 16, report
        assert kernel["requested_registers"] == [208, 96], report
        assert kernel["spill_bytes"] is None or kernel["spill_bytes"] <= most, (name, report)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[1], [63, 64, 65, 0], [70000] + [1000] * 15,
                                  [1, 31, 0, 4095, 128, 129], [20000, 3, 9000, 64] * 4,
                                  [100000] + [1024] * 31])
@pytest.mark.parametrize("heads", [16, 64, 128])
# ranges: None, one program per item; 0, tile ranges on one program per SM; 3, on 3;
# "charged-0" / "charged-3": the same cut by work (a charge per request); "-cN": charge N.
@pytest.mark.parametrize("ranges", [None, 0, 3, "charged-0", "charged-3", "charged-0-c0",
                                    "charged-3-c1"])
def test_gpu_balanced_seesaw_matches_float64(lens, heads, ranges, seeded):
    balanced_seesaw_matches_float64(lens, heads, ranges, seeded)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[63, 64, 65, 0], [70000] + [1000] * 15,
                                  [1, 31, 0, 4095, 128, 129], [100000] + [1024] * 31])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("ranges", [None, 3, "charged-0", "charged-3"])
@pytest.mark.parametrize("variant", [{"pv_cols": 64}, {"lazy_rescale": True}],
                         ids=["pv64", "lazy"])
def test_gpu_balanced_seesaw_step_variants_match_float64(lens, heads, ranges, variant, seeded,
                                                         monkeypatch):
    """The balanced seesaw kernels with 64-column PVs (kept to compare; 256 is the
    default) and with the lazy rescale (under trial), through the whole balanced path."""
    from graphbucket.kernels import launch_balanced

    for name in ("launch_seesaw_balanced_stage1", "launch_seesaw_range_stage1"):
        monkeypatch.setattr(launch_balanced, name,
                            functools.partial(getattr(launch_balanced, name), **variant))
    balanced_seesaw_matches_float64(lens, heads, ranges, seeded)


def balanced_seesaw_matches_float64(lens, heads, ranges, seeded):
    gen = torch.Generator().manual_seed(seeded)
    case = nan_tailed_case(lens, heads, gen)
    charged = isinstance(ranges, str)
    parts = ranges.split("-") if charged else []
    programs = int(parts[1]) if charged else ranges
    charge = {"range_charge_tiles": int(parts[2][1:])} if len(parts) > 2 else {}
    plan = plan_balanced_mla_decode(len(lens), heads, stream=SEESAW_STREAM,
                                    tile_ranges=ranges is not None, programs=programs or None,
                                    charged_ranges=charged, **charge)
    assert plan.seesaw and runs_seesaw(plan, case.q, case.kv_cache), plan.describe()
    sm_scale = default_sm_scale()
    ws, out, lse = nan_outputs(len(lens), heads, plan)
    mla_decode_balanced(case.q, case.kv_cache, case.block_table, case.seq_lens, out, ws,
                        plan=plan, sm_scale=sm_scale, lse=lse)
    assert_matches_float64(case, lens, out, lse, sm_scale, plan)


@pytest.mark.gpu
@pytest.mark.parametrize("ranges, charged", [(False, False), (True, False), (True, True)])
def test_gpu_balanced_seesaw_graph_repartitions_new_lengths(ranges, charged, seeded):
    """Captured once, replayed with other lengths: the device partition follows them, and
    the result matches the Triton balanced kernel on the same lengths."""
    gen = torch.Generator().manual_seed(seeded)
    lens_a, lens_b = [9000, 64, 0, 1] * 2, [64, 30000, 300, 0] * 2
    case = nan_tailed_case([max(a, b) for a, b in zip(lens_a, lens_b, strict=True)], 128, gen)
    plan = plan_balanced_mla_decode(len(lens_a), 128, stream=SEESAW_STREAM, tile_ranges=ranges,
                                    charged_ranges=charged)
    ws = SplitWorkspace.allocate(len(lens_a), 128, 1, KV_LORA_RANK, "cuda",
                                 max_items=plan.max_work_items)
    out = torch.empty(len(lens_a), 128, KV_LORA_RANK, dtype=torch.bfloat16, device="cuda")
    seq_lens = torch.tensor(lens_a, dtype=torch.int32, device="cuda")
    sm_scale = default_sm_scale()

    def step():
        mla_decode_balanced(case.q, case.kv_cache, case.block_table, seq_lens, out, ws,
                            plan=plan, sm_scale=sm_scale)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in (lens_b, lens_a):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        want = torch.empty_like(out)
        mla_decode_balanced(case.q, case.kv_cache, case.block_table, seq_lens, want, ws,
                            plan=replace(plan, seesaw=False), sm_scale=sm_scale)
        torch.cuda.synchronize()
        for b, n in enumerate(lens):
            if n:
                assert rel_l2(out[b].float(), want[b].float()) < 5e-3, (lens, b)
            else:
                assert (out[b] == 0).all()


@pytest.mark.interpreter
@pytest.mark.parametrize("heads", [16, 32])
def test_seesaw_plans_below_64_heads_run_the_triton_64_row_kernel_where_gluon_cannot(heads):
    # A plan of 64-row programs for fewer heads (stream=SEESAW_STREAM): where the Gluon
    # kernel cannot run (here Triton's interpreter) the Triton kernel runs the same plan,
    # its rows past the head count masked; float32 against float64, split and balanced.
    gen = torch.Generator().manual_seed(7)
    lens = [1, 65, 0, 200]
    case = make_case(lens, heads, page_size=64, dtype=torch.float32, device="cpu", gen=gen)
    want, _ = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens,
                                   kv_lora_rank=KV_LORA_RANK, sm_scale=0.1)
    split = plan_mla_decode(len(lens), heads, 200, stream=SEESAW_STREAM, num_sms=4)
    balanced = plan_balanced_mla_decode(len(lens), heads, stream=SEESAW_STREAM, num_sms=4)
    ranges = plan_balanced_mla_decode(len(lens), heads, stream=SEESAW_STREAM, num_sms=4,
                                      tile_ranges=True)
    for plan, decode in ((split, mla_decode), (balanced, mla_decode_balanced),
                         (ranges, mla_decode_balanced)):
        assert plan.block_h == 64 and plan.num_head_blocks == 1 and plan.seesaw
        assert not runs_seesaw(plan, case.q, case.kv_cache)
        ws = SplitWorkspace.allocate(len(lens), heads, plan.num_kv_splits, KV_LORA_RANK, "cpu",
                                     max_items=plan.max_work_items)
        out = torch.full((len(lens), heads, KV_LORA_RANK), float("nan"))
        decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out, ws, plan=plan,
               sm_scale=0.1)
        for b, n in enumerate(lens):
            if n == 0:
                assert (out[b] == 0).all(), plan.describe()
            else:
                assert rel_l2(out[b].double(), want[b]) < 1e-5, (b, plan.describe())
