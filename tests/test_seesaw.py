"""The Gluon seesaw stage 1 (64 query rows, two warpgroups) against float64 (GPU only)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from graphbucket.kernels import SplitWorkspace, default_sm_scale
from graphbucket.plan import ROWS_STREAM, plan_mla_decode
from graphbucket.reference import mla_decode_reference
from tests.kernel_cases import KV_LORA_RANK, make_case, rel_l2

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("lens", [[1], [63, 64, 65], [127, 128, 129, 0], [4113], [70000, 17],
                                  [2048] * 8])
@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("splits", [1, 3, 0])  # 0: the planned count
def test_gpu_seesaw_matches_float64(lens, heads, splits, seeded):
    from graphbucket.kernels.seesaw import mla_decode_seesaw

    gen = torch.Generator().manual_seed(seeded)
    case = make_case(lens, heads, page_size=64, dtype=torch.bfloat16, device="cuda", gen=gen)
    for b, n in enumerate(lens):  # unwritten rows past each length: NaN must not leak
        if n % 64:
            case.kv_cache[case.block_table[b, n // 64], n % 64:] = float("nan")
    stream = ROWS_STREAM if splits == 0 else replace(ROWS_STREAM, min_tiles_per_split=1)
    plan = plan_mla_decode(len(lens), heads, max(lens), stream=stream)
    if splits:
        plan = replace(plan, num_kv_splits=splits)
    sm_scale = default_sm_scale()
    ws = SplitWorkspace.allocate(len(lens), heads, plan.num_kv_splits, KV_LORA_RANK, "cuda")
    out = torch.full((len(lens), heads, KV_LORA_RANK), float("nan"), dtype=torch.bfloat16,
                     device="cuda")
    lse = torch.full((len(lens), heads), float("nan"), device="cuda")
    mla_decode_seesaw(case.q.contiguous(), case.kv_cache, case.block_table, case.seq_lens, out,
                      ws, plan=plan, sm_scale=sm_scale, lse=lse)
    want, want_lse = mla_decode_reference(case.q, case.kv_cache, case.block_table,
                                          case.seq_lens, kv_lora_rank=KV_LORA_RANK,
                                          sm_scale=sm_scale)
    for b, n in enumerate(lens):
        if n == 0:
            assert (out[b] == 0).all() and (lse[b] == float("-inf")).all()
            continue
        assert rel_l2(out[b].double(), want[b].to(out.device)) < 1e-2, (b, n, plan.describe())
        assert torch.allclose(lse[b].double(), want_lse[b].to(lse.device), atol=2e-2)
