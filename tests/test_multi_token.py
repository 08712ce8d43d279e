"""Multi-token decode (a verify step of q_len tokens per request), folded into the rows.

q [B, q_len, H, D] runs as q [B, q_len * H, D] with a plan of q_len * H rows; token j of a
request attends to the positions before seq_len - q_len + j + 1. Compared with float64
attention per token over its own causal limit. Interpreter on the CPU (fp16/fp32), the GPU
where there is one.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from graphbucket.kernels import SplitWorkspace, mla_decode
from graphbucket.plan import plan_mla_decode
from graphbucket.plan_streams import TOKEN_STREAM, WIDE_BUFFERED, WIDE_STREAM
from graphbucket.reference import mla_decode_reference
from tests.kernel_cases import KV_LORA_RANK, SM_SCALE, make_case, rel_l2

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float16
HEADS = 16


def verify_case(lens, q_len, *, page_size=16, seed=0, heads=HEADS):
    gen = torch.Generator().manual_seed(seed)
    case = make_case(lens, q_len * heads, page_size=page_size, dtype=DTYPE, device=DEVICE,
                     gen=gen)
    return case  # q [B, q_len * H, D]: token-major rows


def reference(case, q_len):
    """Per token j: attention of q[:, j] over seq_len - q_len + j + 1 positions (none when
    that is below 1: zeros, LSE -inf)."""
    bs, heads = case.q.shape[0], case.q.shape[1] // q_len
    q = case.q.cpu().view(bs, q_len, heads, -1)
    lens = case.seq_lens.cpu().long()
    outs, lses = [], []
    for j in range(q_len):
        limit = (lens - q_len + j + 1).clamp_min(0).to(torch.int32)
        o, lse = mla_decode_reference(q[:, j], case.kv_cache.cpu(), case.block_table.cpu(),
                                      limit, kv_lora_rank=KV_LORA_RANK, sm_scale=SM_SCALE)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs, 1).reshape(bs, q_len * heads, -1), torch.stack(lses, 1).reshape(
        bs, q_len * heads)


def run(case, plan, q_len):
    bs, rows = case.q.shape[0], case.q.shape[1]
    out = torch.full((bs, rows, KV_LORA_RANK), float("nan"), dtype=DTYPE, device=DEVICE)
    lse = torch.full((bs, rows), float("nan"), device=DEVICE)
    ws = SplitWorkspace.allocate(bs, rows, max(1, plan.num_kv_splits), KV_LORA_RANK, DEVICE)
    mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out, ws, plan=plan,
               sm_scale=SM_SCALE, lse=lse, q_len=q_len)
    return out, lse


@pytest.mark.parametrize("q_len", [2, 3, 4])
@pytest.mark.parametrize("lens", [[4], [5, 17, 0], [16, 33, 64, 65]])
@pytest.mark.parametrize("splits", [1, 3])
def test_folded_verify_step_matches_per_token_float64(q_len, lens, splits):
    lens = [max(n, q_len) if n else 0 for n in lens]  # every live request holds q_len tokens
    case = verify_case(lens, q_len)
    plan = plan_mla_decode(len(lens), q_len * HEADS, 1, num_sms=8).with_splits(splits)
    out, lse = run(case, plan, q_len)
    ref, ref_lse = reference(case, q_len)
    assert rel_l2(out, ref) < 1e-2, (q_len, lens, splits, plan.describe())
    live = case.seq_lens.cpu() > 0
    assert (lse.cpu().double()[live] - ref_lse[live]).abs().max() < 2e-2
    assert (out[~live.to(out.device)] == 0).all()


def check_rows_without_a_position(case, plan, q_len):
    """Matches float64 per token; rows with no position give zeros and LSE -inf."""
    out, lse = run(case, plan, q_len)
    ref, ref_lse = reference(case, q_len)
    where = (q_len, case.seq_lens.tolist(), plan.describe())
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), where
    assert rel_l2(out, ref) < 1e-2, where
    seen = torch.isfinite(ref_lse)
    assert (lse.cpu()[~seen] == float("-inf")).all(), where
    assert (out.cpu()[~seen] == 0).all(), where
    if seen.any():
        assert (lse.cpu().double()[seen] - ref_lse[seen]).abs().max() < 2e-2, where


@pytest.mark.parametrize("merge_chunks", [4, 1])
def test_fused_merge_of_a_request_shorter_than_q_len_gives_zeros(merge_chunks):
    # The fused merge divided -inf by -inf for token 0 of the 1-token request: NaN.
    case = verify_case([1, 620, 14, 2048], 2, heads=8)
    plan = plan_mla_decode(4, 16, 2048, num_sms=2)
    assert plan.merges_in_stage1 and plan.num_kv_splits == 2 and plan.merge_chunks == 4
    check_rows_without_a_position(case, replace(plan, merge_chunks=merge_chunks), 2)


@pytest.mark.parametrize("merge_chunks", [1, 4])
def test_fused_merge_of_rows_empty_in_every_split(merge_chunks):
    # 20 tokens in two 16-token tiles, 2 splits, q_len 32 (one head per token): rows 0..11
    # see nothing in either split, row 12 only position 0 (nothing in split 1).
    case = verify_case([20, 45], 32, heads=1)
    plan = plan_mla_decode(2, 32, 40, num_sms=4, stream=WIDE_BUFFERED).with_splits(2)
    plan = replace(plan, fused_merge=True)
    assert plan.merges_in_stage1 and plan.block_n == 16
    check_rows_without_a_position(case, replace(plan, merge_chunks=merge_chunks), 32)


def test_random_fused_merge_steps_with_requests_shorter_than_q_len():
    rng = random.Random(25)
    for step in range(8):
        q_len = rng.choice([2, 4])
        lens = [rng.choice([0, rng.randint(1, q_len - 1), rng.randint(q_len, 300)])
                for _ in range(rng.randint(1, 4))]
        case = verify_case(lens, q_len, heads=4, seed=step)
        stream = rng.choice([WIDE_STREAM, WIDE_BUFFERED])
        plan = plan_mla_decode(len(lens), 4 * q_len, 1, num_sms=4, stream=stream)
        plan = replace(plan.with_splits(rng.randint(2, 4)), fused_merge=True,
                       merge_chunks=rng.choice([1, 4]))
        assert plan.merges_in_stage1
        check_rows_without_a_position(case, plan, q_len)


def test_q_len_one_rows_are_heads_and_q_len_two_differs_only_by_the_causal_limit():
    # The last token of a verify step sees every position: it equals a q_len 1 decode.
    case = verify_case([40, 9], 2, seed=1)
    plan = plan_mla_decode(2, 2 * HEADS, 1, num_sms=8).with_splits(2)
    out, _ = run(case, plan, 2)
    single = plan_mla_decode(2, HEADS, 1, num_sms=8).with_splits(2)
    last_q = case.q.view(2, 2, HEADS, -1)[:, 1].contiguous()
    out1 = torch.empty(2, HEADS, KV_LORA_RANK, dtype=DTYPE, device=DEVICE)
    ws = SplitWorkspace.allocate(2, HEADS, 2, KV_LORA_RANK, DEVICE)
    mla_decode(last_q, case.kv_cache, case.block_table, case.seq_lens, out1, ws, plan=single,
               sm_scale=SM_SCALE)
    assert rel_l2(out.view(2, 2, HEADS, -1)[:, 1], out1.float()) < 1e-3
    # ... and the first token does not see the last position.
    assert rel_l2(out.view(2, 2, HEADS, -1)[:, 0], out1.float()) > 1e-3


@pytest.mark.parametrize("q_len, match", [(0, "positive int"), (3, "divisor"),
                                          (True, "positive int")])
def test_bad_q_len_raises_before_launch(q_len, match):
    case = verify_case([8], 2)
    plan = plan_mla_decode(1, 2 * HEADS, 1, num_sms=8)
    out = torch.full((1, 2 * HEADS, KV_LORA_RANK), float("nan"), dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out, None,
                   plan=plan, sm_scale=SM_SCALE, q_len=q_len)
    token = plan_mla_decode(1, 2 * HEADS, 1, num_sms=8, stream=TOKEN_STREAM)
    with pytest.raises(ValueError, match="token-major"):
        mla_decode(case.q, case.kv_cache, case.block_table, case.seq_lens, out, None,
                   plan=token, sm_scale=SM_SCALE, q_len=2)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("q_len", [2, 4])
def test_flat_form_matches_the_folded_form(q_len):
    from graphbucket.kernels.verify import flatten_verify

    lens = [max(q_len, 50), 0, max(q_len, 17)]
    case = verify_case(lens, q_len, seed=2)
    folded = plan_mla_decode(3, q_len * HEADS, 1, num_sms=8).with_splits(2)
    out_folded, _ = run(case, folded, q_len)
    q, table, flat_lens = flatten_verify(case.q, case.block_table, case.seq_lens, q_len)
    assert flat_lens.tolist() == [n - q_len + 1 + j if n else 0 for n in lens
                                  for j in range(q_len)]
    rows = 3 * q_len
    plan = plan_mla_decode(rows, HEADS, 1, num_sms=8).with_splits(2)
    out = torch.empty(rows, HEADS, KV_LORA_RANK, dtype=DTYPE, device=DEVICE)
    ws = SplitWorkspace.allocate(rows, HEADS, 2, KV_LORA_RANK, DEVICE)
    mla_decode(q, case.kv_cache, table, flat_lens, out, ws, plan=plan, sm_scale=SM_SCALE)
    assert rel_l2(out.reshape(3, q_len * HEADS, -1), out_folded.float()) < 1e-3
    with pytest.raises(ValueError, match="tokens"):
        flatten_verify(case.q[:, :HEADS + 1], case.block_table, case.seq_lens, q_len)
