"""The balanced merge's persistent programs against a float64 merge of the same partials:
requests of one item (left alone, or listed), of many items and of none (padding), in any
order, with fewer programs than units (each program walks several), long batches, and
units of several heads (a head count the block does not divide) in steps of a few items.
The list of requests to merge is the planners' (their tests check it);
here it is written from its definition. Small rows keep the interpreter quick."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from graphbucket.kernels import SplitWorkspace
from graphbucket.kernels.launch_balanced import launch_balanced_merge
from graphbucket.merge_tile import with_merge_tile
from graphbucket.plan import plan_balanced_mla_decode

RANK, HEADS = 64, 2
SENTINEL = 7.0  # what stage 1 would have written for a request of one item


def merge_case(items: list[int], gen: torch.Generator, *, every: bool,
               device: str = "cpu", heads: int = HEADS):
    """A workspace holding random partials (log2 LSEs, some -inf) for ``items`` per request,
    and the float64 merge each request must get: (workspace, want out, want LSE)."""
    batch, total = len(items), sum(items)
    ws = SplitWorkspace.allocate(batch, heads, 1, RANK, device, max_items=total + 1)
    ws.item_o[:total] = torch.randn(total, heads, RANK, generator=gen)
    lse = torch.randn(total, heads, generator=gen) * 4
    lse[torch.rand(total, heads, generator=gen) < 0.2] = float("-inf")  # empty partials
    ws.item_lse[:total] = lse
    indptr = torch.tensor([0] + items).cumsum(0)
    ws.item_indptr[: batch + 1] = indptr.int()
    listed = [b for b, n in enumerate(items) if n != 1 or every]
    ws.merge_rows[: len(listed) + 1] = torch.tensor([len(listed)] + listed, dtype=torch.int32)
    want_o = torch.full((batch, heads, RANK), SENTINEL, dtype=torch.float64)
    want_lse = torch.full((batch, heads), SENTINEL, dtype=torch.float64)
    for b, n in enumerate(items):
        if n == 1 and not every:
            continue
        if n == 0:  # padding: the merge of nothing
            want_o[b], want_lse[b] = 0.0, float("-inf")
            continue
        part_lse = ws.item_lse[indptr[b]:indptr[b + 1]].double().cpu()
        weights = torch.exp2(part_lse - part_lse.amax(0).clamp(min=-1e30))  # [n, heads]
        total_w = weights.sum(0)
        merged = (weights[..., None] * ws.item_o[indptr[b]:indptr[b + 1]].double().cpu()).sum(0)
        live = total_w > 0
        want_o[b] = torch.where(live[:, None], merged / total_w.clamp(min=1e-300)[:, None], 0.0)
        want_lse[b] = torch.where(
            live, torch.log(total_w.clamp(min=1e-300)) + part_lse.amax(0).clamp(min=-1e30)
            * torch.log(torch.tensor(2.0, dtype=torch.float64)), float("-inf"))
    return ws, want_o, want_lse


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("items, programs, every", [
    ([3, 1, 0, 5, 1, 1, 2], None, False),  # one-item requests left alone
    ([1, 1, 1, 1, 9, 1, 1, 0], 3, False),   # one long among short, 3 programs walk 18 units
    ([2, 1, 0, 4], 2, True),                # one-item requests listed too: one partial each
    ([1] * 150 + [3] + [0] * 60 + [1] * 50 + [2], 5, False),  # 262 rows
])
def test_persistent_merge_matches_float64(items, programs, every, prefetch, device):
    # prefetch: each program loads its next units' indices ahead (several units each here).
    gen = torch.Generator().manual_seed(len(items) * 31 + (programs or 0))
    ws, want_o, want_lse = merge_case(items, gen, every=every, device=device)
    plan = plan_balanced_mla_decode(len(items), HEADS, kv_lora_rank=RANK, qk_rope_dim=16,
                                    programs=4, num_sms=2)
    plan = replace(plan, merge_prefetch=prefetch)
    if programs is not None:
        plan = replace(plan, merge_programs=programs)
    out = torch.full((len(items), HEADS, RANK), SENTINEL, dtype=torch.float32, device=device)
    lse = torch.full((len(items), HEADS), SENTINEL, dtype=torch.float32, device=device)
    launch_balanced_merge(out, ws, plan=plan, lse=lse)
    torch.testing.assert_close(out.double().cpu(), want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double().cpu(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_s, block_h, block_dv, prefetch", [
    (2, 2, 32, False), (4, 4, 64, False), (32, 2, 16, False),
    # Prefetched: the next step's loads first, after a pass over the LSEs 16 at a time (the
    # requests of 19 and 17 items take two).
    (1, 4, 64, True), (1, 1, 32, True), (2, 8, 16, True), (8, 2, 32, True)])
def test_head_blocked_merge_matches_float64(block_s, block_h, block_dv, prefetch, device):
    heads, items = 5, [3, 1, 0, 9, 1, 2, 1] + ([19, 17] if prefetch else [])
    gen = torch.Generator().manual_seed(block_s * 100 + block_h * 10 + block_dv)
    ws, want_o, want_lse = merge_case(items, gen, every=False, device=device, heads=heads)
    plan = plan_balanced_mla_decode(len(items), heads, kv_lora_rank=RANK, qk_rope_dim=16,
                                    programs=4, num_sms=2)
    plan = with_merge_tile(plan, 1, block_s=block_s, block_h=block_h, block_dv=block_dv,
                           prefetch=prefetch)
    assert plan.merge_prefetch == prefetch and ("prefetch" in plan.describe()) == prefetch
    units = len(items) * -(-heads // block_h) * (RANK // block_dv)
    assert plan.merge_block_h == block_h and plan.merge_programs == min(16, units)
    out = torch.full((len(items), heads, RANK), SENTINEL, dtype=torch.float32, device=device)
    lse = torch.full((len(items), heads), SENTINEL, dtype=torch.float32, device=device)
    launch_balanced_merge(out, ws, plan=plan, lse=lse)
    torch.testing.assert_close(out.double().cpu(), want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double().cpu(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tile", [dict(block_h=3), dict(block_s=6), dict(block_dv=48),
                                  dict(block_dv=128)])
def test_merge_tile_rejects_what_the_kernel_cannot_run(tile):
    plan = plan_balanced_mla_decode(4, 3, kv_lora_rank=RANK, qk_rope_dim=16, programs=4,
                                    num_sms=2)
    with pytest.raises(ValueError, match="merge tile"):
        with_merge_tile(plan, 2, **tile)
