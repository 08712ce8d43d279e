"""Sparse MLA decode (DeepSeek-V3.2): index cache, indexer logits, top-k, sparse attention.

Kernels run through the Triton interpreter on the CPU (fp16 / fp32: the interpreter gets
bf16 dots wrong) and natively on the GPU. Every input is fresh random data; the references
are float64 (``graphbucket.sparse.reference``). Indices are checked two ways: exactly
against the top-k of the kernel's own logits, and against the float64 top-k except where
two logits lie within the logits' tolerance of each other at the threshold.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from graphbucket import fp8
from graphbucket.kernels import SplitWorkspace
from graphbucket.kernels.verify import flatten_verify
from graphbucket.plan import cdiv
from graphbucket.sparse import (
    SparseWorkspace,
    dequantize_index_keys,
    plan_sparse_decode,
    quantize_index_keys,
    seed_max_splits,
    sparse_mla_decode,
    store_index_keys,
)
from graphbucket.sparse.attention import launch_sparse_attention
from graphbucket.sparse.indexer import launch_indexer_logits
from graphbucket.sparse.plan import (
    ATTENTION_BLOCK_N,
    GATHER_AHEAD_8W_STREAM,
    GATHER_AHEAD_64_STREAM,
    GATHER_AHEAD_STREAM,
    GATHER_STREAM,
)
from graphbucket.sparse.reference import (
    indexer_logits_reference,
    quantize_index_q,
    sparse_attention_reference,
    topk_reference,
)
from graphbucket.sparse.topk import SAMPLES, TopkScratch, launch_topk, topk_torch
from tests.kernel_cases import KV_LORA_RANK, SM_SCALE, make_case, rel_l2

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float16
# 8 heads on the CPU (a masked half of the 16-row head block; the interpreter runs one
# program at a time), DeepSeek-V3.2's 16 per rank on the GPU.
HEADS = 16 if ON_GPU else 8
INDEX_HEADS, INDEX_DIM = 64, 128
# Logits against float64 of the same op, x the row's largest |logit|: the interpreter
# multiplies exactly; the H200's fp8 MMA accumulates with fewer bits than float32.
LOGITS_TOL = 1e-3 if ON_GPU else 1e-4


# ---- plans (host) --------------------------------------------------------------------------


@pytest.mark.host
def test_attention_plan_saturates_at_topk_and_indexer_plan_grows_with_context():
    plans = [plan_sparse_decode(1, 16, hint, topk=2048) for hint in (2048, 4096, 65536, 131072)]
    assert len({p.attention_splits for p in plans}) == 1
    assert plans[0].attention_splits > plan_sparse_decode(1, 16, 256).attention_splits
    splits = [p.indexer_splits for p in plans]
    assert splits == sorted(splits) and splits[-1] > splits[0]
    # more rows leave fewer slots per row
    assert plan_sparse_decode(64, 16, 131072).attention_splits < plans[-1].attention_splits
    assert plan_sparse_decode(64, 16, 131072).indexer_splits < plans[-1].indexer_splits


@pytest.mark.host
def test_attention_looks_ahead_where_splits_hold_several_tiles():
    for rows in (8, 64, 128):
        plan = plan_sparse_decode(rows, 16, 131072)
        assert plan.gather_ahead and plan.num_stages == GATHER_AHEAD_STREAM.num_stages
        assert cdiv(2048, plan.attention_block_n * plan.attention_splits) >= 2
    one_tile = plan_sparse_decode(1, 16, 131072)  # 64 splits of one tile: 8 warps
    assert one_tile.gather_ahead and one_tile.attention_splits == 64
    assert (one_tile.attention_block_n, one_tile.num_warps, one_tile.num_stages) == (
        GATHER_AHEAD_8W_STREAM.block_n, GATHER_AHEAD_8W_STREAM.num_warps,
        GATHER_AHEAD_8W_STREAM.num_stages)
    # The stream is part of the plan (the graph key); the split count follows its tile
    # and its programs per SM.
    wide = plan_sparse_decode(64, 16, 131072, stream=GATHER_AHEAD_64_STREAM)
    assert wide != plan_sparse_decode(64, 16, 131072)
    assert (wide.attention_block_n, wide.num_warps, wide.attention_splits) == (64, 8, 2)
    assert plan_sparse_decode(64, 16, 131072, stream=GATHER_STREAM).attention_splits == 4


@pytest.mark.host
@pytest.mark.parametrize("max_seq_len, cus, expected", [
    (1, 132, 1), (200, 132, 1), (256, 132, 2), (1000, 132, 8), (131072, 132, 16),
    (131072, 8, 8)])
def test_seed_split_heuristic(max_seq_len, cus, expected):
    assert seed_max_splits(max_seq_len, 2048, cus) == expected


@pytest.mark.host
@pytest.mark.parametrize("bad", [{"num_rows": 0}, {"hint": -1}, {"topk": 1.5},
                                 {"num_heads": True}])
def test_plan_rejects_bad_arguments(bad):
    args = {"num_rows": 1, "num_heads": 16, "hint": 100, "topk": 64} | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        plan_sparse_decode(args["num_rows"], args["num_heads"], args["hint"], topk=args["topk"])


# ---- index cache (host) --------------------------------------------------------------------


@pytest.mark.host
def test_index_keys_round_trip_within_e4m3_precision_and_store_scatters(seeded):
    keys = torch.randn(10, INDEX_DIM) * torch.rand(10, 1) * 10
    keys[3] = 0.0
    stored, scales = quantize_index_keys(keys)
    assert stored.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    back = dequantize_index_keys(stored, scales)
    assert back.dtype == torch.float64 and (back[3] == 0).all()
    # each token's largest magnitude is stored as +-448 exactly
    live = torch.arange(10) != 3
    assert torch.allclose(stored.float().abs().amax(-1)[live], torch.tensor(448.0))
    err = (back - keys.double()).abs()
    assert (err <= keys.double().abs() * 2 ** -4 + scales.double()[:, None] * 2 ** -9).all()
    cache = torch.zeros(4, 4, INDEX_DIM, dtype=torch.float8_e4m3fn)
    cache_scales = torch.ones(4, 4)
    slots = torch.tensor([13, 2, 7, 0, 15, 4, 9, 11, 1, 5])
    store_index_keys(keys, slots, cache, cache_scales)
    flat = dequantize_index_keys(cache, cache_scales).view(16, INDEX_DIM)
    assert torch.equal(flat[slots], back)
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert (flat[untouched] == 0).all()


# ---- problems ------------------------------------------------------------------------------


def sparse_case(lens, *, page_size=16, v32=False, gen=None, table_rows=None):
    """Latent cache (scattered pages, unowned pages poisoned), index cache, queries."""
    case = make_case(lens, HEADS, page_size=page_size, dtype=torch.float32, device="cpu",
                     gen=gen)
    num_pages = case.kv_cache.shape[0]
    keys = torch.randn(num_pages, page_size, INDEX_DIM, generator=gen)
    keys *= torch.rand(num_pages, page_size, 1, generator=gen) + 0.5
    index_cache, index_scales = quantize_index_keys(keys)
    rows = len(lens)
    index_q = torch.randn(rows, INDEX_HEADS, INDEX_DIM, generator=gen).to(DTYPE)
    weights = torch.randn(rows, INDEX_HEADS, generator=gen) / INDEX_HEADS ** 0.5
    kv = fp8.pack_v32(case.kv_cache) if v32 else case.kv_cache.to(DTYPE)
    to = {"device": DEVICE}
    return {"q": case.q.to(DTYPE).to(**to), "kv_cache": kv.to(**to),
            "index_q": index_q.to(**to), "index_weights": weights.to(**to),
            "index_cache": index_cache.to(**to), "index_scales": index_scales.to(**to),
            "block_table": case.block_table.to(**to), "seq_lens": case.seq_lens.to(**to)}


def run_sparse(inputs, *, topk, attention_splits=None, indexer_splits=None, max_len=None,
               lse=True, stream=None, **indexer):
    rows = inputs["q"].shape[0]
    hint = max(1, int(inputs["seq_lens"].max()))
    plan = replace(plan_sparse_decode(rows, HEADS, hint, topk=topk, num_sms=8,
                                      stream=stream).with_splits(
        indexer=indexer_splits, attention=attention_splits), **indexer)
    if not ON_GPU:  # fewer merge programs for the interpreter (the GPU runs the default)
        plan = replace(plan, merge_block_dv=256)
    max_len = max_len or inputs["block_table"].shape[1] * inputs["kv_cache"].shape[1]
    ws = SparseWorkspace.allocate(rows, HEADS, max_len, topk=topk,
                                  max_splits=plan.attention_splits, device=DEVICE)
    out = torch.full((rows, HEADS, KV_LORA_RANK), float("nan"), dtype=DTYPE, device=DEVICE)
    lse_out = torch.full((rows, HEADS), float("nan"), device=DEVICE) if lse else None
    sparse_mla_decode(**inputs, out=out, workspace=ws, plan=plan, sm_scale=SM_SCALE,
                      lse=lse_out)
    return out, lse_out, ws, plan


def kernel_positions(ws, lens):
    """The selected positions per row (first min(len, topk) slots), after checking the
    padding and the sparse lengths."""
    indices, sparse_lens = ws.indices.cpu(), ws.sparse_lens.cpu()
    found = []
    for r, n in enumerate(lens):
        taken = min(n, indices.shape[1])
        assert sparse_lens[r] == taken, (r, n)
        assert (indices[r, taken:] == -1).all(), (r, n)
        pos = indices[r, :taken].tolist()
        assert len(set(pos)) == taken and all(0 <= p < n for p in pos), (r, n, pos)
        found.append(pos)
    return found


def check_topk_against_float64(positions, ref_logits, topk, tol):
    """Set equality with the float64 top-k, except swaps among logits within ``tol`` of
    the k-th largest (the kernel ranks its own rounded logits)."""
    wanted = topk_reference(ref_logits, topk)
    for pos, ref, want in zip(positions, ref_logits, wanted, strict=True):
        diff = set(pos) ^ want
        if diff and ref.numel() > topk:
            kth = torch.topk(ref, topk).values[-1].item()
            assert all(abs(ref[p].item() - kth) <= tol for p in diff), diff
        else:
            assert not diff


def logits_magnitude(inputs, *, fp8_q):
    """Per row, float64 sum_h |w_h| (|q_h| . |k_t|): the size of the terms each logit sums,
    the scale of its rounding error (fp8 tensor-core products accumulate with fewer bits
    than float32, and the heads' signed weights can cancel to a logit far smaller)."""
    keys = inputs["index_cache"]
    abs_keys = (keys.view(torch.uint8) & 0x7F).view(keys.dtype)  # e4m3: clear the sign
    return indexer_logits_reference(inputs["index_q"].abs(), inputs["index_weights"].abs(),
                                    abs_keys, inputs["index_scales"], inputs["block_table"],
                                    inputs["seq_lens"], fp8_q=fp8_q)


def check_decode(inputs, out, lse, ws, topk, *, v32=False, fp8_q=True):
    lens = inputs["seq_lens"].tolist()
    ref_logits = indexer_logits_reference(inputs["index_q"], inputs["index_weights"],
                                          inputs["index_cache"], inputs["index_scales"],
                                          inputs["block_table"], inputs["seq_lens"],
                                          fp8_q=fp8_q)
    magnitude = logits_magnitude(inputs, fp8_q=fp8_q)
    logits = ws.logits.cpu().double()
    for r, n in enumerate(lens):
        if n == 0:
            continue
        scale = magnitude[r].max().item()
        assert (logits[r, :n] - ref_logits[r]).abs().max() <= LOGITS_TOL * scale + 1e-6, r
    positions = kernel_positions(ws, lens)
    # exact against the kernel's own logits (random: no ties)
    assert [set(p) for p in positions] == topk_reference(
        [logits[r, :n] for r, n in enumerate(lens)], topk)
    check_topk_against_float64(positions, ref_logits, topk,
                               tol=2 * LOGITS_TOL * max(x.max().item() for x in magnitude
                                                        if x.numel()))
    kv_rows = fp8.unpack_v32(inputs["kv_cache"].cpu()) if v32 else inputs["kv_cache"]
    ref, ref_lse = sparse_attention_reference(inputs["q"], kv_rows, inputs["block_table"],
                                              positions, kv_lora_rank=KV_LORA_RANK,
                                              sm_scale=SM_SCALE)
    assert torch.isfinite(out.cpu().float()).all()
    assert rel_l2(out, ref) < 1e-2
    live = torch.tensor(lens) > 0
    assert (out.cpu()[~live] == 0).all()
    if lse is not None:
        assert (lse.cpu().double()[live] - ref_lse[live]).abs().max() < 2e-2
        assert (lse.cpu()[~live] == float("-inf")).all()


# ---- kernels (interpreter on the CPU, native on the GPU) ----------------------------------


@pytest.mark.parametrize("lens, topk, splits", [
    ([1, 15, 16, 17, 0], 16, (1, 1)),            # lengths at and around one page
    ([33, 64, 65, 130], 32, (3, 2)),             # above top-k, around tile bounds
    ([200, 7, 0, 96], 64, (2, 4)),               # ragged with padding, above and below
])
def test_sparse_decode_matches_float64(lens, topk, splits, seeded):
    gen = torch.Generator().manual_seed(seeded)
    inputs = sparse_case(lens, gen=gen)
    out, lse, ws, _ = run_sparse(inputs, topk=topk, indexer_splits=splits[0],
                                 attention_splits=splits[1])
    check_decode(inputs, out, lse, ws, topk)


@pytest.mark.parametrize("block_n, stages", [(64, 3), (128, 4), (256, 2)])
def test_sparse_decode_with_a_bf16_q_and_other_tiles_matches_float64(block_n, stages, seeded):
    gen = torch.Generator().manual_seed(seeded)
    inputs = sparse_case([300, 64, 0, 129], gen=gen)
    out, lse, ws, _ = run_sparse(inputs, topk=32, indexer_splits=2, attention_splits=2,
                                 indexer_fp8_q=False, indexer_block_n=block_n,
                                 indexer_stages=stages)
    check_decode(inputs, out, lse, ws, 32, fp8_q=False)


@pytest.mark.host
def test_fp8_q_model_rounds_to_nearest_with_the_keys_scale_rule(seeded):
    q = torch.randn(3, INDEX_HEADS, INDEX_DIM) * torch.rand(3, INDEX_HEADS, 1) * 10
    q[1, 5] = 0.0
    stored, scale = quantize_index_q(q.to(DTYPE))
    assert stored.dtype == torch.float8_e4m3fn and (stored[1, 5].float() == 0).all()
    assert scale[1, 5] == 2.0 ** -126
    back = stored.double() * scale.double()[..., None]
    err = (back - q.to(DTYPE).double()).abs()
    assert (err <= q.to(DTYPE).double().abs() * 2 ** -4 + scale.double()[..., None] * 2 ** -9
            ).all()
    live = torch.ones(3, INDEX_HEADS, dtype=torch.bool)
    live[1, 5] = False
    assert (stored.float().abs().amax(-1)[live] >= 416).all()  # the largest: 448 or next


def test_fp8_q_logits_track_the_bf16_q_logits(seeded):
    # Only q's e4m3 rounding separates the two paths (keys and scales are the same bytes):
    # ~2^-5 relative per q element, averaged over 128 dims and 64 heads.
    gen = torch.Generator().manual_seed(seeded)
    lens = [700, 129, 1]
    inputs = sparse_case(lens, gen=gen)
    plan = plan_sparse_decode(len(lens), HEADS, max(lens), topk=16, num_sms=8)
    got = {}
    for fp8_q in (True, False):
        logits = torch.zeros(len(lens), 768, device=DEVICE)
        launch_indexer_logits(inputs["index_q"], inputs["index_weights"],
                              inputs["index_cache"], inputs["index_scales"],
                              inputs["block_table"], inputs["seq_lens"], logits,
                              plan=replace(plan, indexer_fp8_q=fp8_q))
        got[fp8_q] = torch.cat([logits[r, :n].cpu() for r, n in enumerate(lens)])
    err = rel_l2(got[True], got[False].double())
    print(f"fp8 q against bf16 q: relative L2 {err:.4f}")
    assert 0 < err < 0.05


@pytest.mark.parametrize("lens, topk, attention_splits, stream", [
    ([70, 5, 0], 32, 2, None), ([17, 40], 64, 1, None),
    ([150, 33, 0], 128, 1, GATHER_AHEAD_STREAM), ([200, 90], 128, 2, GATHER_AHEAD_64_STREAM)])
def test_sparse_decode_v32_cache_matches_float64(lens, topk, attention_splits, stream, seeded):
    gen = torch.Generator().manual_seed(seeded)
    inputs = sparse_case(lens, gen=gen, v32=True)
    out, lse, ws, _ = run_sparse(inputs, topk=topk, attention_splits=attention_splits,
                                 stream=stream)
    check_decode(inputs, out, lse, ws, topk, v32=True)


STREAMS = {"gather": GATHER_STREAM, "ahead": GATHER_AHEAD_STREAM,
           "ahead8w": GATHER_AHEAD_8W_STREAM, "ahead64": GATHER_AHEAD_64_STREAM}


@pytest.mark.parametrize("stream", list(STREAMS))
@pytest.mark.parametrize("sparse_lens, splits, dead", [
    # around tile edges (32 and 64), one split: the look-ahead runs past the last tile
    ([31, 32, 33, 0, 64, 65, 97, 1], 1, []),
    # several tiles per split, a split's look-ahead reaching into the next split's slots;
    # -1 slots below the length are skipped (row 2's second split has only -1)
    ([130, 96, 65, 160], 2, [(0, 5), (0, 129), (2, 64), (3, 31), (3, 32)]),
    ([160, 129, 3], 3, [(1, 0)]),
    # more splits than tiles: splits past a row's tiles write nothing; row 1 is all -1
    ([33, 1, 64, 0], 8, [(1, 0)]),
])
def test_sparse_attention_streams_match_float64(stream, sparse_lens, splits, dead, seeded):
    gen = torch.Generator().manual_seed(seeded)
    rows, context, width = len(sparse_lens), 400, 192
    case = sparse_case([context] * rows, gen=gen)
    indices = torch.full((rows, width), -1, dtype=torch.int32)  # the top-k's padding
    for r, n in enumerate(sparse_lens):
        indices[r, :n] = torch.randperm(context, generator=gen)[:n]
    for r, slot in dead:
        indices[r, slot] = -1
    positions = [[p for p in indices[r, :n].tolist() if p >= 0]
                 for r, n in enumerate(sparse_lens)]
    plan = plan_sparse_decode(rows, HEADS, context, topk=width, num_sms=8,
                              stream=STREAMS[stream]).with_splits(attention=splits)
    if not ON_GPU:
        plan = replace(plan, merge_block_dv=256)
    out = torch.full((rows, HEADS, KV_LORA_RANK), float("nan"), dtype=DTYPE, device=DEVICE)
    lse = torch.full((rows, HEADS), float("nan"), device=DEVICE)
    ws = SplitWorkspace.allocate(rows, HEADS, splits, KV_LORA_RANK, DEVICE)
    launch_sparse_attention(case["q"], case["kv_cache"], case["block_table"],
                            indices.to(DEVICE), torch.tensor(sparse_lens, dtype=torch.int32,
                                                             device=DEVICE),
                            out, ws, plan=plan, sm_scale=SM_SCALE, lse=lse)
    ref, ref_lse = sparse_attention_reference(case["q"], case["kv_cache"], case["block_table"],
                                              positions, kv_lora_rank=KV_LORA_RANK,
                                              sm_scale=SM_SCALE)
    assert rel_l2(out, ref) < 1e-2
    live = torch.tensor([len(p) > 0 for p in positions])
    assert (out.cpu()[~live] == 0).all()
    assert (lse.cpu().double()[live] - ref_lse[live]).abs().max() < 2e-2
    assert (lse.cpu()[~live] == float("-inf")).all()


def test_flat_verify_rows_have_their_own_causal_limits(seeded):
    # q_len 2: each request's two tokens become rows with limits len - 1 and len.
    gen = torch.Generator().manual_seed(seeded)
    base = sparse_case([50, 3, 0], gen=gen)
    q_len = 2
    q = torch.randn(3, q_len, HEADS, KV_LORA_RANK + 64, generator=gen).to(DTYPE).to(DEVICE)
    q_rows, table, limits = flatten_verify(q, base["block_table"], base["seq_lens"], q_len)
    index_q = torch.randn(3 * q_len, INDEX_HEADS, INDEX_DIM, generator=gen).to(DTYPE)
    inputs = base | {"q": q_rows.contiguous(), "block_table": table, "seq_lens": limits,
                     "index_q": index_q.to(DEVICE),
                     "index_weights": base["index_weights"].repeat_interleave(q_len, 0)}
    assert limits.tolist() == [49, 50, 2, 3, 0, 0]
    out, lse, ws, _ = run_sparse(inputs, topk=16, attention_splits=2)
    check_decode(inputs, out, lse, ws, 16)


def test_sparse_decode_without_lse_and_with_a_wider_logits_buffer(seeded):
    gen = torch.Generator().manual_seed(seeded)
    inputs = sparse_case([40, 90], gen=gen)
    out, _, ws, _ = run_sparse(inputs, topk=32, max_len=512, lse=False)
    check_decode(inputs, out, None, ws, 32)


@pytest.mark.parametrize("lens, topk, chunks", [([0, 1, 31, 32, 33, 200], 32, 1),
                                                ([0, 1, 31, 32, 33, 200], 32, 3),
                                                ([2500, 1024], 1000, 4)])
def test_topk_kernel_selects_exactly_with_negatives_and_ties(lens, topk, chunks, seeded):
    rows, width = len(lens), max(max(lens), topk)
    scratch = TopkScratch.allocate(rows, width, DEVICE)
    # Twice on one scratch: each call leaves its histogram cleared for the next.
    for _ in range(2):
        check_topk_kernel(lens, topk, chunks, width, scratch)


def check_topk_kernel(lens, topk, chunks, width, scratch):
    rows = len(lens)
    logits = torch.randn(rows, width, dtype=torch.float64).float() * 100
    logits[:, 1::7] = logits[:, 0:1]  # ties, some of them at the threshold
    logits[:, 3::11] = -0.0
    logits[:, 5::13] = 0.0
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    indices = torch.full((rows, topk), 7, dtype=torch.int32)
    sparse_lens = torch.zeros(rows, dtype=torch.int32)
    launch_topk(logits.to(DEVICE), seq_lens.to(DEVICE), out_i := indices.to(DEVICE),
                out_s := sparse_lens.to(DEVICE), scratch, num_rows=rows, num_chunks=chunks,
                block=64)
    out_i, out_s = out_i.cpu(), out_s.cpu()
    assert (scratch.hist == 0).all() and (scratch.tickets == 0).all()
    for r, n in enumerate(lens):
        taken = min(n, topk)
        assert out_s[r] == taken and (out_i[r, taken:] == -1).all()
        pos = out_i[r, :taken].long()
        assert len(set(pos.tolist())) == taken and (pos < n).all() and (pos >= 0).all()
        assert pos.tolist() == sorted(pos.tolist())  # position order
        if n > topk:  # every selected logit >= every rejected one; ties by position
            row = logits[r, :n]
            chosen = torch.zeros(n, dtype=torch.bool)
            chosen[pos] = True
            assert row[chosen].min() >= row[~chosen].max()
            kth = row[chosen].min()
            tied = (row == kth).nonzero().flatten()
            assert chosen[tied].tolist() == sorted(chosen[tied].tolist(), reverse=True)
        else:
            assert sorted(pos.tolist()) == list(range(n))
    torch_i = torch.full_like(indices, 7).to(DEVICE)
    torch_s = torch.zeros_like(sparse_lens).to(DEVICE)
    topk_torch(logits.to(DEVICE), seq_lens.to(DEVICE), torch_i, torch_s, num_rows=rows)
    assert torch.equal(torch_s.cpu(), out_s)
    for r, n in enumerate(lens):
        got, want = set(out_i[r].tolist()), set(torch_i[r].cpu().tolist())
        if len(set(logits[r, :n].tolist())) == n or n <= topk:
            assert got == want


def test_topk_kernel_is_exact_when_the_sample_misleads_the_floor(seeded):
    # The sampled positions hold the row's largest logits, so fewer than k keys clear the
    # floor: every pass falls back to the raw logits. A second row keeps the fast path.
    n, topk = 4096, 1000
    logits = torch.randn(2, n, dtype=torch.float64).float()
    sampled = torch.arange(SAMPLES) * n // SAMPLES
    logits[0, sampled] += 100.0
    seq_lens = torch.tensor([n, n], dtype=torch.int32, device=DEVICE)
    indices = torch.empty(2, topk, dtype=torch.int32, device=DEVICE)
    sparse_lens = torch.empty(2, dtype=torch.int32, device=DEVICE)
    scratch = TopkScratch.allocate(2, n, DEVICE)
    launch_topk(logits.to(DEVICE), seq_lens, indices, sparse_lens, scratch, num_rows=2,
                num_chunks=3, block=256)
    candidates = scratch.candidates.cpu()
    assert candidates[0] < topk <= candidates[1] < n  # raw fallback, then compacted
    for r in range(2):
        want = set(torch.topk(logits[r], topk).indices.tolist())
        got = indices[r].cpu().tolist()
        assert set(got) == want and got == sorted(got)
    assert (scratch.hist == 0).all() and (scratch.tickets == 0).all()


def test_topk_kernel_threshold_on_signed_zeros_takes_the_first_zeros(seeded):
    # 30 positives, 40 zeros of both signs, 30 negatives: the 50th largest is a zero.
    values = torch.cat([torch.rand(30) + 1, torch.zeros(40), -torch.rand(30) - 1])
    values[30:70:2] = -0.0
    perm = torch.randperm(100)
    logits = values[perm][None, :].contiguous()
    indices = torch.empty(1, 50, dtype=torch.int32, device=DEVICE)
    sparse_lens = torch.empty(1, dtype=torch.int32, device=DEVICE)
    launch_topk(logits.to(DEVICE), torch.tensor([100], dtype=torch.int32, device=DEVICE),
                indices, sparse_lens, TopkScratch.allocate(1, 100, DEVICE), num_rows=1,
                num_chunks=2, block=32)
    zero_positions = (logits[0] == 0).nonzero().flatten().tolist()
    expected = set((logits[0] > 0).nonzero().flatten().tolist()) | set(zero_positions[:20])
    assert set(indices[0].cpu().tolist()) == expected and sparse_lens.item() == 50


# ---- bad input (host checks, before any launch) --------------------------------------------


def _bad_inputs():
    yield "index_q", lambda i: i | {"index_q": i["index_q"][:, :32]}
    yield "index_weights", lambda i: i | {"index_weights": i["index_weights"].double()}
    yield "index_cache", lambda i: i | {"index_cache": i["index_cache"].float()}
    yield "index_cache.shape", lambda i: i | {"index_cache": i["index_cache"][:-1]}
    yield "index_scales", lambda i: i | {"index_scales": i["index_scales"][:, :1]}
    yield "kv_cache", lambda i: i | {"kv_cache": i["kv_cache"].float()}
    yield "kv_cache.shape", lambda i: i | {"kv_cache": torch.zeros(
        *i["kv_cache"].shape[:2], 600, dtype=torch.uint8, device=DEVICE)}
    yield "q", lambda i: i | {"q": i["q"][:, :4]}
    yield "block_table", lambda i: i | {"block_table": i["block_table"].long()}
    yield "seq_lens", lambda i: i | {"seq_lens": i["seq_lens"][:1]}


@pytest.mark.host
@pytest.mark.parametrize("name, corrupt", list(_bad_inputs()), ids=[n for n, _ in _bad_inputs()])
def test_bad_inputs_raise_before_launch(name, corrupt, seeded):
    inputs = corrupt(sparse_case([20, 5], gen=torch.Generator().manual_seed(seeded)))
    plan = plan_sparse_decode(2, HEADS, 20, topk=16)
    ws = SparseWorkspace.allocate(2, HEADS, 64, topk=16, max_splits=plan.attention_splits,
                                  device=DEVICE)
    out = torch.empty(2, HEADS, KV_LORA_RANK, dtype=DTYPE, device=DEVICE)
    with pytest.raises((ValueError, TypeError), match=name.split(".")[0]):
        sparse_mla_decode(**inputs, out=out, workspace=ws, plan=plan, sm_scale=SM_SCALE)
    assert (ws.indices == -1).all()  # nothing ran


@pytest.mark.host
def test_workspace_too_small_raises(seeded):
    inputs = sparse_case([20, 5], gen=torch.Generator().manual_seed(seeded))
    plan = plan_sparse_decode(2, HEADS, 20, topk=16).with_splits(attention=4)
    out = torch.empty(2, HEADS, KV_LORA_RANK, dtype=DTYPE, device=DEVICE)
    for ws in (SparseWorkspace.allocate(1, HEADS, 64, topk=16, max_splits=4, device=DEVICE),
               SparseWorkspace.allocate(2, HEADS, 64, topk=32, max_splits=4, device=DEVICE),
               SparseWorkspace.allocate(2, HEADS, 64, topk=16, max_splits=2, device=DEVICE)):
        with pytest.raises(ValueError, match="workspace"):
            sparse_mla_decode(**inputs, out=out, workspace=ws, plan=plan, sm_scale=SM_SCALE)


# ---- GPU: DeepSeek-V3.2 sizes and graph replay ---------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("v32", [False, True])
@pytest.mark.parametrize("lens", [[1], [2047, 2048, 2049], [20000, 0, 5000, 130]])
def test_gpu_topk_2048_over_long_contexts(lens, v32, seeded):
    gen = torch.Generator().manual_seed(seeded)
    inputs = sparse_case(lens, page_size=64, v32=v32, gen=gen)
    out, lse, ws, _ = run_sparse(inputs, topk=2048)
    check_decode(inputs, out, lse, ws, 2048, v32=v32)


@pytest.mark.gpu
def test_gpu_graph_replay_matches_eager_at_many_lengths_without_syncs(seeded):
    gen = torch.Generator().manual_seed(seeded)
    rows, max_len, topk = 4, 8192, 2048
    inputs = sparse_case([max_len] * rows, page_size=64, gen=gen)
    plan = plan_sparse_decode(rows, HEADS, max_len, topk=topk)
    ws = SparseWorkspace.allocate(rows, HEADS, max_len, topk=topk,
                                  max_splits=plan.attention_splits, device="cuda")
    out = torch.empty(rows, HEADS, KV_LORA_RANK, dtype=DTYPE, device="cuda")
    seq_lens = inputs.pop("seq_lens")

    def step():
        sparse_mla_decode(**inputs, seq_lens=seq_lens, out=out, workspace=ws, plan=plan,
                          sm_scale=SM_SCALE, check=False)
    step()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in ([1, 2048, 2049, 0], [8192, 17, 4000, 3000], [0, 0, 0, 5]):
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        replayed = out.clone()
        step()
        assert torch.equal(replayed, out), lens
        check_decode(inputs | {"seq_lens": seq_lens}, out, None, ws, topk)
    del graph


def test_attention_tile_constant_is_what_the_split_formula_assumes():
    # The merge recomputes each row's active splits from BLOCK_N: it must be the tile.
    plan = plan_sparse_decode(1, HEADS, 4096, topk=2048)
    assert plan.attention_block_n == ATTENTION_BLOCK_N
    assert cdiv(2048, ATTENTION_BLOCK_N) >= plan.attention_splits


@pytest.mark.host
def test_sweep_summary_and_markdown_carry_the_issue_keys():
    from bench.sparse_sweep import ATTENTION_BATCH, markdown, rotations, summary

    assert rotations(1) == 16 and rotations(1 << 40) == 1
    split_times = {1: 9.0, 2: 7.5}
    attention = {b: {"us": 7.5, "frac_of_floor": 0.5, "planned_splits": 2, "best_splits": 2,
                     "seed_splits": 1, "us_per_splits": split_times}
                 for b in (1, ATTENTION_BATCH)}
    keys = summary({1: {"frac_of_copy": 0.7}}, {1: {"us": 20.0}, 8: {"us": 30.0}}, attention,
                   {1: {"us": 40.0, "dense_us": 60.0}, 8: {"us": 90.0, "dense_us": 300.0}})
    assert set(keys) == {
        "indexer_frac_of_copy_128k", "topk_us_128k_b1", "topk_us_128k_b8",
        "sparse_attention_us_b1", "sparse_attention_frac_b64", "layer_attention_us_128k_b1",
        "dense_attention_us_128k_b1", "layer_attention_us_128k_b8",
        "dense_attention_us_128k_b8"}
    meta = {"gpu": "x", "date": "d", "torch": "t", "triton": "tr", "copy_gbps": 1.0,
            "command": "c"}
    text = markdown({"meta": meta, "summary": keys,
                     "attention": {str(b): row for b, row in attention.items()}})
    assert "| layer_attention_us_128k_b1 | 40.0 | <= 45.0 |" in text
    assert "| layer_attention_us_128k_b8 | 90.0 | <= 105.0 |" in text
