from __future__ import annotations

import logging

import pytest
import torch

from graphbucket.backends import get_backend
from graphbucket.buffers import StaticBuffers
from graphbucket.capture import GraphCapture, plan_table
from graphbucket.ladder import Bucket, BucketLadder
from tests._toy import LADDER, NUM_SMS, ToyMLA, toy_spec

SM_SCALE = 0.125
SIZES = [1, 2]


def backend():
    return get_backend("reference", num_sms=NUM_SMS, kv_lora_rank=64, qk_rope_dim=16)


def expected_graphs(plans):
    """(batch size, plan) -> buckets it serves, in capture order."""
    graphs = {}
    for (bs, bucket), plan in plans.items():
        graphs.setdefault((bs, plan), []).append(bucket)
    return graphs


def make_capture(device, *, forward=None, progress=False, warmup_iters=1):
    be = backend()
    plans = plan_table(be, LADDER, SIZES, 16)
    buffers = StaticBuffers.allocate(toy_spec(device=device), max_batch_size=max(SIZES),
                                     workspace=be.workspace_spec(plans.values()))
    forward = forward or ToyMLA(device=device)
    return GraphCapture(forward, buffers, be, plans, sm_scale=SM_SCALE,
                        warmup_iters=warmup_iters, progress=progress), forward


def test_plan_table_is_largest_batch_first_with_bucket_hints():
    be = backend()
    table = plan_table(be, LADDER, [1, 2, 2], 16)
    assert list(table) == [(2, 0), (2, 1), (2, 2), (1, 0), (1, 1), (1, 2)]
    assert all(table[(bs, i)] == be.plan(bs, 16, LADDER.hints[i]) for bs, i in table)
    assert table[(1, 0)].num_kv_splits == 1 and table[(1, 2)].num_kv_splits > 1


def test_plan_table_plans_each_batch_size_with_its_bucket_hint():
    be = backend()
    top = LADDER.max_model_len
    ladder = BucketLadder([Bucket(64, 64), Bucket(top, top, batch_hints={2: 1})], top)
    table = plan_table(be, ladder, [1, 2, 4], 16)
    assert table[(1, 1)] == be.plan(1, 16, top) and table[(1, 1)].num_kv_splits > 1
    assert table[(2, 1)] == be.plan(2, 16, 1) and table[(4, 1)] == be.plan(4, 16, 1)
    assert table[(2, 1)].num_kv_splits == table[(4, 1)].num_kv_splits == 1


def test_equal_plans_alias_one_graph(device):
    cap, model = make_capture(device)
    want = expected_graphs(cap.plans)
    assert len(want) < len(cap.plans), "the test ladder must make some plans alias"
    summary = cap.capture()
    assert summary.graphs_captured == len(want)
    assert summary.graphs_aliased == len(cap.plans) - len(want)
    assert [(r.key, list(r.buckets)) for r in cap.records] == list(want.items())
    for (bs, plan), buckets in want.items():
        assert all(cap.graph(bs, b) is cap.graph(bs, buckets[0]) for b in buckets)
        assert cap.graph(bs, buckets[0]).plan == plan
    assert len({id(cap.graph(bs, b)) for bs, b in cap.plans}) == len(want)
    # One warm-up per graph, plus the capture itself on CUDA.
    assert model.calls == len(want) * (1 + (device == "cuda"))
    assert cap.capture() is summary  # idempotent: nothing is captured twice


def test_progress_line_and_log_line(capsys, caplog):
    cap, _ = make_capture("cpu", progress=True, warmup_iters=0)
    with caplog.at_level(logging.INFO, logger="graphbucket.capture"):
        summary = cap.capture()
    err = capsys.readouterr().err
    n = summary.graphs_captured
    assert f"capturing {n}/{n} done" in err and "bs=2 splits=1" in err
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"captured {n} graphs ({summary.graphs_aliased} aliased keys)" in line
    assert "pool" in line
    assert summary.capture_s >= 0 and summary.pool_bytes == sum(r.nbytes for r in cap.records)


def test_forward_with_the_wrong_output_shape_fails_at_capture():
    cap, _ = make_capture("cpu", forward=lambda ctx: torch.zeros(ctx.batch_size, 3))
    with pytest.raises(ValueError, match=r"forward returned torch.float32 \(2, 3\); expected"):
        cap.capture()
    assert cap.summary is None and cap.records == []


def test_close_drops_every_graph():
    cap, _ = make_capture("cpu", warmup_iters=0)
    cap.capture()
    graph = cap.graph(1, 0)
    cap.close()
    with pytest.raises(KeyError):
        cap.graph(1, 0)
    with pytest.raises(RuntimeError, match="reset"):
        graph.replay()


@pytest.mark.gpu
def test_cuda_capture_records_pool_bytes():
    cap, _ = make_capture("cuda")
    summary = cap.capture()
    assert summary.pool_bytes > 0 and cap.records[0].nbytes > 0
    assert summary.pool_bytes == sum(r.nbytes for r in cap.records)
