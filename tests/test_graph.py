"""The CPU frozen-plan graph: capture records the body with its plan, replay never replans."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphbucket.backends import get_backend
from graphbucket.batch import validate_batch
from graphbucket.buffers import StaticBuffers
from graphbucket.capture import make_body
from graphbucket.graph import FrozenPlanGraph, GraphPool
from tests._toy import ToyMLA, rel_l2, toy_batch, toy_reference, toy_spec

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="frozen-plan graphs stand in for CUDA graphs on CPU only")
SM_SCALE = 0.125


def test_pool_warmup_runs_the_body_and_capture_only_records_it():
    calls = []
    pool = GraphPool("cpu")
    plan = get_backend("reference").plan(1, 16, 1)
    pool.warmup(lambda: calls.append("warm"), iters=2)
    graph, nbytes = pool.capture(lambda: calls.append("run"), plan)
    assert isinstance(graph, FrozenPlanGraph) and graph.plan is plan and nbytes == 0
    assert calls == ["warm", "warm"]
    graph.replay()
    graph.replay()
    assert calls == ["warm", "warm", "run", "run"]
    graph.reset()
    with pytest.raises(RuntimeError, match="reset"):
        graph.replay()


def test_hint_one_graph_replays_one_split_at_a_long_live_length(monkeypatch):
    backend = get_backend("triton", num_sms=2, kv_lora_rank=64, qk_rope_dim=16)
    model = ToyMLA()
    spec = toy_spec()
    plan = backend.plan(1, 16, 1)
    live_plan = backend.plan(1, 16, 300)
    assert plan.num_kv_splits == 1 and live_plan.num_kv_splits > 1
    buffers = StaticBuffers.allocate(spec, max_batch_size=1,
                                     workspace=backend.workspace_spec([plan, live_plan]))
    graph, _ = GraphPool("cpu").capture(
        make_body(model, buffers.context(1, plan, backend, SM_SCALE), buffers.output[:1]), plan)

    launched = []
    real_run = backend.run
    monkeypatch.setattr(backend, "run", lambda *a, **kw: launched.append(kw["plan"])
                        or real_run(*a, **kw))
    monkeypatch.setattr(backend, "plan", lambda *a: pytest.fail("replay called plan()"))
    batch = toy_batch([300], rng=np.random.default_rng(0))
    buffers.stage(validate_batch(batch, spec), 1)
    graph.replay()

    assert [p.num_kv_splits for p in launched] == [1, 1]  # both layers, one split each
    assert all(not p.use_stage2 for p in launched)
    want = toy_reference(model, batch, sm_scale=SM_SCALE)
    assert rel_l2(buffers.output[:1], want) < 1e-5
