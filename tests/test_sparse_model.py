"""Sparse MLA through the runner: SparseBackend plans and aliasing, SparseMLADecoder steps.

Host tests: plans, aliasing, ladder, workspace sizing, config checks. Interpreter tests
(tiny model, fp32, a few steps): captured and eager runner steps against the float64
reference, verify steps, padding rows. GPU tests: DeepSeek-V3.2 TP8 shapes, 1000
replayed random steps without a sync, capture memory against one bucket.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from graphbucket.graphs import GraphTable
from graphbucket.models.paging import decode_batch, random_block_table
from graphbucket.models.sparse_mla import (
    SparseMLAConfig,
    SparseMLADecoder,
    deepseek_v32_tp8,
    tiny_sparse,
)
from graphbucket.policies import POLICIES
from graphbucket.runner import GraphBucketRunner
from graphbucket.select import GraphSelector
from graphbucket.sparse.backend import SparseBackend, sparse_ladder
from graphbucket.sparse.plan import plan_sparse_decode
from tests._toy import rel_l2

MML = 128  # tiny model: max_model_len
PAGE = 16


# ---- host: plans, aliasing, ladder, workspace ------------------------------------------------


@pytest.mark.host
def test_backend_plans_flat_rows_from_the_folded_heads():
    backend = SparseBackend(num_heads=16, max_len=131072)
    plan = backend.plan(8, 16 * 2, 65536)
    assert plan == plan_sparse_decode(16, 16, 65536)
    assert (plan.num_rows, plan.num_heads) == (16, 16)
    with pytest.raises(ValueError, match="q_len x 16"):
        backend.plan(1, 24, 100)
    with pytest.raises(TypeError, match=r"index=IndexInputs"):  # the indexer's inputs
        backend.run(*[None] * 6, plan=plan, sm_scale=1.0)


@pytest.mark.host
@pytest.mark.parametrize("bs", [1, 8])
def test_ladder_keys_alias_exactly_when_whole_sparse_plans_are_equal(bs):
    backend = SparseBackend(num_heads=16, max_len=131072)
    ladder = sparse_ladder(131072)
    table = GraphTable(GraphSelector(ladder, [bs], q_lens=(1, 2)), backend, 16)
    plans = table.plans
    # Above top-k the attention is planned alike; the indexer's splits grow until the
    # budget is spent.
    above = [p for k, p in plans.items() if k.hint >= 2048 and k.q_len == 1]
    assert len({p.attention_splits for p in above}) == 1
    splits = [p.indexer_splits for p in above]
    assert splits == sorted(splits) and splits[-1] > splits[0]
    groups = table.capture_order()
    assert len(groups) == len({(k.batch_size, k.q_len, p) for k, p in plans.items()})
    if bs == 8:  # 8 rows: the indexer's budget (64 splits) is spent from 16K: those alias
        top = {p for k, p in plans.items() if k.hint >= 16384 and k.q_len == 1}
        assert len(top) == 1 and len(groups) < len(plans)


@pytest.mark.host
def test_sparse_ladder_bounds():
    assert sparse_ladder(131072).bounds == (512, 2048, 4096, 8192, 16384, 32768, 65536,
                                            131072)
    assert sparse_ladder(128, topk=16).bounds == (4, 16, 32, 64, 128)
    assert sparse_ladder(1000).bounds == (512, 1000)


@pytest.mark.host
def test_workspace_spec_counts_what_it_allocates():
    backend = SparseBackend(num_heads=4, max_len=300, topk=16, num_sms=8)
    plans = [backend.plan(b, 4 * q, h) for b in (1, 3) for q in (1, 2) for h in (16, 300)]
    spec = backend.workspace_spec(plans)
    assert spec.max_rows == 6 and spec.max_splits == max(p.attention_splits for p in plans)
    ws = spec.allocate("cpu")
    tensors = [ws.logits, ws.indices, ws.sparse_lens, ws.split.partial_o, ws.split.partial_lse,
               *(getattr(ws.topk, f.name) for f in dataclasses.fields(ws.topk))]
    assert spec.nbytes == sum(t.numel() * t.element_size() for t in tensors)
    assert all(ws.fits(p) for p in plans)


@pytest.mark.host
def test_configs_and_model_checks():
    cfg = deepseek_v32_tp8(num_layers=2)
    assert (cfg.num_heads, cfg.index_heads, cfg.index_dim, cfg.index_topk) == (16, 64, 128, 2048)
    assert cfg.layer_params() == deepseek_v32_tp8(1).layer_params() > 0
    assert isinstance(tiny_sparse(), SparseMLAConfig) and tiny_sparse().kv_dim == 576
    with pytest.raises(ValueError, match="index_topk"):
        SparseMLAConfig(**{**_fields(tiny_sparse()), "index_topk": 0})
    bad = SparseMLAConfig(**{**_fields(tiny_sparse()), "kv_lora_rank": 64})
    with pytest.raises(ValueError, match="512, 64, 128"):
        SparseMLADecoder(bad, num_pages=4, page_size=PAGE, device="cpu")


def _fields(cfg) -> dict:
    import dataclasses

    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


# ---- interpreter: the tiny model through the runner ---------------------------------------


@pytest.fixture(scope="module")
def tiny():
    model = SparseMLADecoder(tiny_sparse(), num_pages=24, page_size=PAGE, dtype=torch.float32,
                             device="cpu")
    table = random_block_table(3, MML // PAGE, model.num_pages, np.random.default_rng(0))
    model.prefill_random(table, [MML] * 3)
    return model, table


def runner_for(model, policy, q_lens=(1,), sizes=(1, 2)):
    runner = GraphBucketRunner.for_model(
        model, policy=policy, max_model_len=MML, batch_sizes=list(sizes), q_lens=q_lens,
        backend=model.decode_backend(MML, num_sms=8), progress=False)
    runner.capture()
    return runner


def reference_step(model, batch, q_len=1):
    lens = np.asarray(batch.seq_lens_cpu)
    positions = (lens[:, None] - q_len + np.arange(q_len)).reshape(-1)
    return model.forward_reference(batch.inputs["hidden"], positions=positions, seq_lens=lens,
                                   block_table=batch.block_table_cpu,
                                   slot_mapping=batch.inputs["slot_mapping"], q_len=q_len)


@pytest.mark.host
def test_every_policy_builds_a_sparse_runner(tiny):
    model, _ = tiny
    for policy in POLICIES:
        if policy == "balanced-only":  # sparse decode has no balanced topology: refused
            with pytest.raises(ValueError, match="balanced"):
                GraphBucketRunner.for_model(model, policy=policy, max_model_len=MML,
                                            batch_sizes=[1], progress=False)
            continue
        runner = GraphBucketRunner.for_model(model, policy=policy, max_model_len=MML,
                                             batch_sizes=[1], progress=False)
        assert isinstance(runner.backend, SparseBackend)
        if policy == "ladder":
            assert runner.ladder.bounds == sparse_ladder(MML, topk=16).bounds
        runner.close()


@pytest.mark.interpreter
@pytest.mark.parametrize("policy, lens", [("ladder", [100]), ("ladder", [9, 120]),
                                          ("eager", [70, 16])])
def test_runner_steps_match_the_float64_reference(tiny, policy, lens):
    model, table = tiny
    gen = torch.Generator().manual_seed(len(lens) + lens[0])
    hidden = torch.randn(len(lens), model.config.hidden_size, generator=gen)
    batch = decode_batch(model, lens, table[:len(lens)], hidden)
    want = reference_step(model, batch)  # before the step writes the new rows
    with runner_for(model, policy) as runner:
        got = runner.step(batch)
        assert rel_l2(got, want) < 1e-4
        if policy == "ladder":
            assert runner.stats().replays and runner.stats().eager_steps == 0


@pytest.mark.interpreter
def test_verify_step_runs_flat_rows_with_their_own_limits(tiny):
    model, table = tiny
    hidden = torch.randn(4, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    batch = decode_batch(model, [90, 30], table[:2], hidden, q_len=2)
    want = reference_step(model, batch, q_len=2)
    with runner_for(model, "fixed-max", q_lens=(1, 2)) as runner:
        key = runner.selector.choose([90, 30], 2)
        assert runner.plan_for(key).num_rows == 4
        got = runner.step(batch)
    assert got.shape == (4, model.config.hidden_size)
    assert rel_l2(got, want) < 1e-4


@pytest.mark.interpreter
def test_padding_rows_store_no_index_keys(tiny):
    model, table = tiny
    hidden = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(7))
    batch = decode_batch(model, [50], table[:1], hidden)
    before = [c.view(torch.uint8).clone() for c in model.index_caches]
    slot = int(batch.inputs["slot_mapping"][0])
    with runner_for(model, "fixed-1", sizes=[2]) as runner:  # pads the batch of 1 to 2
        runner.step(batch)
    for cache, old in zip(model.index_caches, before, strict=True):
        changed = (cache.view(torch.uint8) != old).any(-1).view(-1).nonzero().view(-1)
        assert changed.tolist() in ([slot], [])  # the live token's row only (slot 0 untouched)


# ---- GPU: DeepSeek-V3.2 TP8 shapes -------------------------------------------------------------

GPU_MML, GPU_SIZES = 32768, [1, 2, 4, 8]


@pytest.fixture(scope="module")
def gpu_model():
    model = SparseMLADecoder(deepseek_v32_tp8(num_layers=2), num_pages=8 * GPU_MML // 64,
                             device="cuda")
    table = random_block_table(8, GPU_MML // 64, model.num_pages, np.random.default_rng(0))
    model.prefill_random(table, [GPU_MML] * 8)
    return model, table


@pytest.mark.gpu
def test_gpu_1000_random_steps_sync_free_match_eager_and_pool_within_one_bucket(gpu_model):
    model, table = gpu_model
    kw = dict(max_model_len=GPU_MML, batch_sizes=GPU_SIZES, q_lens=(1, 2), progress=False)
    runners = {p: GraphBucketRunner.for_model(model, policy=p, **kw)
               for p in ("ladder", "fixed-max", "eager")}
    for runner in runners.values():
        runner.capture()
    ladder, eager = runners["ladder"], runners["eager"]
    assert ladder.graphs.summary.graphs_aliased > 0  # buckets whose whole plans agree
    one_bucket = runners["fixed-max"].graphs.summary.pool_bytes
    assert ladder.graphs.summary.pool_bytes <= 1.2 * one_bucket
    rng = np.random.default_rng(1)
    bounds = ladder.ladder.bounds
    for step in range(1000):
        bs, q_len = int(rng.integers(1, 9)), int(rng.choice([1, 2]))
        lens = rng.integers(q_len, bounds[rng.integers(len(bounds))] + 1, size=bs).tolist()
        hidden = torch.randn(bs * q_len, 7168, dtype=torch.bfloat16, device="cuda")
        batch = decode_batch(model, lens, table[:bs], hidden, q_len=q_len)
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = ladder.step(batch).clone()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        if step % 10 == 0:  # eager rewrites the same rows: the step is idempotent
            assert rel_l2(got, eager.step(batch)) < 2e-2, (step, lens, q_len)
    stats = ladder.stats()
    assert stats.eager_fallbacks == 0 and stats.errors == 0 and stats.steps == 1000
    for runner in runners.values():
        runner.close()


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[3000], [1500, 9000]])
def test_gpu_ladder_step_matches_the_float64_reference(lens):
    model = SparseMLADecoder(deepseek_v32_tp8(num_layers=1), num_pages=2 * 9024 // 64,
                             device="cuda")
    table = random_block_table(len(lens), 141, model.num_pages, np.random.default_rng(2))
    model.prefill_random(table, [141 * 64] * len(lens))
    hidden = torch.randn(len(lens), 7168, dtype=torch.bfloat16, device="cuda")
    batch = decode_batch(model, lens, table, hidden)
    want = reference_step(model, batch)
    with GraphBucketRunner.for_model(model, policy="ladder", max_model_len=141 * 64,
                                     batch_sizes=[len(lens)], progress=False) as runner:
        runner.capture()
        assert rel_l2(runner.step(batch), want) < 3e-2
