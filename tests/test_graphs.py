"""GraphTable: planning per key, aliasing of equal plans, capture order, progress, close."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from graphbucket import Bucket, BucketLadder, GraphSelector, get_backend, graphs
from graphbucket.batch import BatchValidator
from graphbucket.buffers import StaticBuffers
from graphbucket.graphs import CaptureError, GraphTable
from tests._toy import LADDER, NUM_SMS, ToyMLA, rel_l2, toy_batch, toy_reference, toy_spec

SM_SCALE = 0.125
SIZES = [1, 2]


def backend(name="dense", num_sms=NUM_SMS):
    return get_backend(name, num_sms=num_sms, kv_lora_rank=64, qk_rope_dim=16)


def make_table(device, ladder=LADDER, sizes=SIZES, be=None):
    be = be or backend()
    table = GraphTable(GraphSelector(ladder, sizes), be, 16)
    buffers = StaticBuffers.allocate(toy_spec(device=device), max_batch_size=max(sizes),
                                     workspace=be.workspace_spec(table.plans.values()))
    return table, buffers


def test_plans_follow_the_selector_keys_and_each_batch_size_hint():
    be = backend()
    top = LADDER.max_model_len
    ladder = BucketLadder((Bucket(64, 64), Bucket(top, top, batch_hints={2: 1})), top)
    table, _ = make_table("cpu", ladder, [1, 2, 4], be)
    assert [(k.batch_size, k.bucket) for k in table.plans] == [
        (4, 0), (4, 1), (2, 0), (2, 1), (1, 0), (1, 1)]
    for key, plan in table.plans.items():
        assert plan == be.plan(key.batch_size, 16, ladder.hint_for(key.bucket, key.batch_size))
    assert table.plans[table.selector.key(1, 1)].num_kv_splits > 1
    assert table.plans[table.selector.key(2, 1)].num_kv_splits == 1  # batch hint 1


def test_equal_plans_alias_one_graph(device):
    table, buffers = make_table(device)
    model = ToyMLA(device=device)
    # Distinct (batch size, plan) pairs in key order, computed here from the plans alone.
    distinct = []
    for key, plan in table.plans.items():
        if (key.batch_size, plan) not in distinct:
            distinct.append((key.batch_size, plan))
    assert len(distinct) < len(table.plans), "the test ladder must make some plans alias"
    assert table.capture_order() == distinct
    summary = table.capture(model, buffers, sm_scale=SM_SCALE, progress=False,
                            warmup_iters=1)
    assert (summary.graphs_captured, summary.graphs_aliased) == (
        len(distinct), len(table.plans) - len(distinct))
    assert [(r.batch_size, r.plan) for r in table.records] == distinct
    served = [k for r in table.records for k in r.keys]
    assert sorted(served, key=list(table.plans).index) == list(table.plans)
    for record in table.records:
        assert all(table.plans[k] == record.plan for k in record.keys)
    # One warm-up per graph, plus on CUDA its captures: without a copy, then one per
    # staging slot.
    captures = (1 + summary.staging_slots) if device == "cuda" else 0
    assert model.calls == len(distinct) * (1 + captures)
    assert table.capture(model, buffers, sm_scale=SM_SCALE) is summary  # idempotent


def test_hint_one_graph_replays_one_split_at_a_long_live_length(device, monkeypatch):
    be = backend("triton", num_sms=2)
    ladder = BucketLadder((Bucket(320, 1),), 320)
    table, buffers = make_table(device, ladder, [1], be)
    (plan,) = table.plans.values()
    assert plan.num_kv_splits == 1 and be.plan(1, 16, 300).num_kv_splits > 1
    model = ToyMLA(device=device)
    table.capture(model, buffers, sm_scale=SM_SCALE, progress=False)
    launched = []
    real_run = be.run
    monkeypatch.setattr(be, "run", lambda *a, **kw: launched.append(kw["plan"])
                        or real_run(*a, **kw))
    monkeypatch.setattr(be, "plan", lambda *a: pytest.fail("replay called plan()"))
    batch = toy_batch([300], rng=np.random.default_rng(0))
    buffers.stage(BatchValidator(buffers.spec)(batch), 1)
    table.replay(table.selector.key(1, 0))
    if device == "cpu":  # a CUDA replay runs no Python, so nothing is launched from here
        assert [p.num_kv_splits for p in launched] == [1, 1]  # both layers, one split each
    want = toy_reference(model, batch, sm_scale=SM_SCALE)
    assert rel_l2(buffers.output[:1], want) < (1e-2 if device == "cuda" else 1e-5)


def test_a_slot_graph_copies_the_slot_its_stage_filled(device):
    table, buffers = make_table(device)
    model = ToyMLA(device=device)
    table.capture(model, buffers, sm_scale=SM_SCALE, progress=False)
    validate, rng = BatchValidator(buffers.spec), np.random.default_rng(4)
    top = LADDER.max_model_len
    slots = []
    for lens in ([40], [7, top], [1], [top, 0], [129, 3]):
        batch = toy_batch(lens, rng=rng)
        host = validate(batch)
        key = table.selector.key_for(host.batch_size, host.min_len, host.max_len,
                                     host.seq_lens, host.q_len)
        before = buffers.seq_lens.clone()
        slot = buffers.stage(host, key.batch_size, in_graph=True)
        slots.append(slot)
        assert torch.equal(buffers.seq_lens, before), "an in-graph stage copied seq_info"
        table.replay(key, slot)
        assert buffers.seq_lens[:len(lens)].tolist() == lens
        want = toy_reference(model, batch, sm_scale=SM_SCALE, device=device)
        assert rel_l2(buffers.output[:len(lens)], want) < (1e-2 if device == "cuda" else 1e-5)
    assert slots == [0, 1, 0, 1, 0]
    # The graph without a copy replays what a copying stage put there.
    batch = toy_batch([77], rng=rng)
    buffers.stage(validate(batch), 1)
    table.replay(table.selector.key(1, 1))
    want = toy_reference(model, batch, sm_scale=SM_SCALE, device=device)
    assert rel_l2(buffers.output[:1], want) < (1e-2 if device == "cuda" else 1e-5)


def test_without_copy_in_graph_only_the_plain_graphs_are_captured():
    be = backend()
    table = GraphTable(GraphSelector(LADDER, SIZES), be, 16, copy_in_graph=False)
    buffers = StaticBuffers.allocate(toy_spec(), max_batch_size=max(SIZES),
                                     workspace=be.workspace_spec(table.plans.values()))
    summary = table.capture(ToyMLA(), buffers, sm_scale=SM_SCALE, progress=False)
    assert summary.staging_slots == 0 and "copying" not in summary.describe()
    with pytest.raises(IndexError):
        table.replay(table.selector.key(1, 0), 0)


def test_progress_lines_and_log_line(capsys, caplog):
    table, buffers = make_table("cpu")
    with caplog.at_level(logging.INFO, logger="graphbucket.graphs"):
        summary = table.capture(ToyMLA(), buffers, sm_scale=SM_SCALE, warmup_iters=0)
    lines = capsys.readouterr().err.splitlines()  # not a terminal: one line per graph
    n = summary.graphs_captured
    assert len(lines) == n and f"capturing {n}/{n}" in lines[-1] and "bs=2 splits=1" in lines[0]
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"captured {n} graphs ({summary.graphs_aliased} aliased keys)" in line
    assert f"+ {n * 2} copying a staging slot" in line and summary.staging_slots == 2
    assert summary.pool_bytes == sum(r.nbytes for r in table.records)


def test_forward_with_the_wrong_output_shape_fails_at_capture():
    table, buffers = make_table("cpu")
    with pytest.raises(CaptureError, match=r"forward returned torch.float32 \(2, 3\); "
                       "expected") as err:
        table.capture(lambda ctx: torch.zeros(ctx.batch_size, 3), buffers, sm_scale=SM_SCALE,
                      progress=False)
    assert isinstance(err.value.__cause__, ValueError)
    assert table.summary is None and table.records == []


class FailsAtGraph:
    """The toy forward, raising on its first call for the ``k``-th graph captured (1-based;
    ``calls_per_graph``: warm-ups plus the capture itself)."""

    def __init__(self, model, k, calls_per_graph):
        self.model, self.fail_at, self.calls = model, (k - 1) * calls_per_graph + 1, 0

    def __call__(self, ctx):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected forward fault")
        return self.model(ctx)


def test_a_forward_fault_at_the_kth_graph_releases_every_graph_and_names_the_key(monkeypatch):
    made = []

    class Recorded(graphs.FrozenPlanGraph):
        def __init__(self, body):
            super().__init__(body)
            made.append(self)

    monkeypatch.setattr(graphs, "FrozenPlanGraph", Recorded)
    table, buffers = make_table("cpu")
    order = table.capture_order()
    assert len(order) >= 3
    model = ToyMLA()
    with pytest.raises(CaptureError, match=r"capturing graph 3/\d+ \(bs=1, q_len=1, ") as err:
        table.capture(FailsAtGraph(model, 3, 1), buffers, sm_scale=SM_SCALE, progress=False)
    assert str(err.value.__cause__) == "injected forward fault"
    bs, plan = order[2]
    assert plan.describe() in str(err.value)
    keys = [k for k, p in table.plans.items() if (k.batch_size, p) == (bs, plan)]
    assert all(str(k) in str(err.value) for k in keys)
    # Both earlier plans' graphs reset: each without a copy and once per staging slot.
    assert len(made) == 2 * (1 + buffers.num_staging_slots)
    assert all(g._body is None for g in made)
    assert table.summary is None and table.records == []
    with pytest.raises(KeyError):
        table.replay(keys[0])
    # The same table captures again, and replays correctly.
    table.capture(model, buffers, sm_scale=SM_SCALE, progress=False)
    batch = toy_batch([40], rng=np.random.default_rng(3))
    buffers.stage(BatchValidator(buffers.spec)(batch), 1)
    table.replay(table.selector.key(1, 1))
    assert rel_l2(buffers.output[:1], toy_reference(model, batch, sm_scale=SM_SCALE)) < 1e-5


def test_close_drops_every_graph():
    table, buffers = make_table("cpu")
    table.capture(ToyMLA(), buffers, sm_scale=SM_SCALE, warmup_iters=0, progress=False)
    key = table.selector.key(1, 0)
    table.replay(key)
    table.close()
    with pytest.raises(KeyError):
        table.replay(key)


@pytest.mark.gpu
def test_cuda_capture_records_pool_bytes():
    table, buffers = make_table("cuda")
    summary = table.capture(ToyMLA(device="cuda"), buffers, sm_scale=SM_SCALE, progress=False)
    assert summary.pool_bytes > 0 and table.records[0].nbytes > 0
    assert summary.pool_bytes == sum(r.nbytes for r in table.records)
