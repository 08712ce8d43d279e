"""Capture policies as ladders (host only)."""

from __future__ import annotations

import pytest

from graphbucket import POLICIES, default_ladder
from graphbucket.policies import policy_ladder
from tests._toy import LADDER, toy_spec

pytestmark = pytest.mark.host


def test_each_policy_is_a_ladder():
    assert POLICIES == ("eager", "fixed-1", "fixed-max", "balanced-only", "ladder")
    assert policy_ladder("eager", 320) is None
    assert policy_ladder("fixed-1", 320).hints == (1,)
    assert policy_ladder("fixed-max", 320).hints == (320,)
    assert policy_ladder("fixed-1", 320).bounds == policy_ladder("fixed-max", 320).bounds == (320,)
    assert policy_ladder("ladder", 320) == default_ladder(320)
    assert policy_ladder("ladder", 320, LADDER) is LADDER


def test_without_cuda_the_ladder_policy_is_the_default_ladder():
    # Tuned ladders are looked up by CUDA device name; a CPU spec has none.
    assert policy_ladder("ladder", 320, spec=toy_spec(max_pages=20)) == default_ladder(320)


def test_misuse_names_the_fix():
    with pytest.raises(ValueError, match="ends at max_model_len"):
        policy_ladder("ladder", 640, LADDER)
    with pytest.raises(ValueError, match="unknown policy 'fixed-2'"):
        policy_ladder("fixed-2", 320)
    with pytest.raises(ValueError, match="only with policy='ladder'"):
        policy_ladder("fixed-1", 320, LADDER)


def test_balanced_only_replays_one_balanced_graph_per_batch_size():
    from graphbucket.select import GraphSelector

    ladder = policy_ladder("balanced-only", 320)
    assert ladder.bounds == (320,) and ladder[0].balanced_imbalance == 1.0
    selector = GraphSelector(ladder, [1, 2, 8], q_lens=(1, 2))
    for lens in ([5], [320, 320], [1, 2, 3], [64] * 8, [0, 7]):  # uniform and ragged
        key = selector.choose(lens)
        assert key.balanced and key.batch_size == selector.pad(len(lens))
    # A verify step has no balanced kernel: the split graph hinted at max_model_len.
    verify = selector.choose([64, 64], q_len=2)
    assert not verify.balanced and verify.hint == 320
    keys = selector.keys()  # one balanced graph per capture size, split ones for q_len 2
    assert sum(k.balanced for k in keys) == 3 and all(k.q_len == 2 for k in keys if not k.balanced)


def test_the_ragged_threshold_still_leaves_uniform_batches_on_split_kv():
    from graphbucket.ladder import Bucket, BucketLadder
    from graphbucket.select import GraphSelector

    ragged = BucketLadder((Bucket(320, 320, balanced_imbalance=1.5),), 320)
    selector = GraphSelector(ragged, [1, 8])
    assert not selector.choose([300] * 8).balanced and not selector.choose([300]).balanced
    assert selector.choose([300] + [10] * 7).balanced


def test_balanced_only_runner_matches_the_reference_on_uniform_and_single_rows(device):
    # Through the interpreter on the CPU: batch 1 and uniform batches replay the balanced
    # graph (the ragged threshold alone never would), and match float64.
    import numpy as np

    from graphbucket import GraphBucketRunner, get_backend
    from tests._toy import ToyMLA, toy_batch, toy_reference
    from tests.kernel_cases import rel_l2

    model = ToyMLA(device=device)
    runner = GraphBucketRunner.for_policy(
        "balanced-only", model, spec=toy_spec(device=device), batch_sizes=[1, 2],
        max_model_len=320, sm_scale=0.125,
        backend=get_backend("triton", num_sms=1, kv_lora_rank=64, qk_rope_dim=16),
        warmup_iters=int(device == "cuda"), progress=False)
    runner.capture()
    assert sorted(r.plan.batch_size for r in runner.records) == [1, 2]
    assert all(r.plan.balanced for r in runner.records)
    rng = np.random.default_rng(0)
    for lens in ([300], [64, 64], [5], [320, 270]):
        batch = toy_batch(lens, rng=rng)
        want = toy_reference(model, batch, sm_scale=0.125)
        assert rel_l2(runner.step(batch), want) < (1e-2 if device == "cuda" else 1e-5), lens
    runner.close()


def test_a_q_len_ladder_of_its_own_reaches_the_runners_keys_and_plans():
    from graphbucket import Bucket, BucketLadder, GraphBucketRunner, get_backend
    from tests._toy import ToyMLA

    top = 320
    own = BucketLadder((Bucket(40, 1), Bucket(top, top)), top)
    runner = GraphBucketRunner.for_policy(
        "ladder", ToyMLA(), spec=toy_spec(), batch_sizes=[1], max_model_len=top,
        sm_scale=0.125, ladder=LADDER, q_lens=(1, 2), q_ladders={2: own},
        backend=get_backend("triton", num_sms=8, kv_lora_rank=64, qk_rope_dim=16),
        progress=False)
    keys = runner.selector.keys()
    assert sorted((k.bucket, k.hint) for k in keys if k.q_len == 2) == [(0, 1), (1, top)]
    assert sorted(k.hint for k in keys if k.q_len == 1) == [32, 64, 320]  # LADDER's
    assert runner.selector.choose([30], q_len=2).hint == 1
    assert runner.plan_for(runner.selector.choose([30], q_len=2)).num_kv_splits == 1
    assert runner.plan_for(runner.selector.choose([300], q_len=2)).num_kv_splits > 1
    runner.close()


@pytest.mark.gpu
def test_the_ladder_policy_takes_each_q_lens_shipped_ladder_on_the_h200():
    import torch

    from graphbucket import GraphBucketRunner
    from graphbucket.tuning.shipped import find_tuned_ladder

    name = torch.cuda.get_device_name(0)
    spec = toy_spec(device="cuda", heads=16, max_pages=64)
    top = spec.max_context_len
    runner = GraphBucketRunner.for_policy("ladder", lambda ctx: None, spec=spec,
                                          batch_sizes=[1], max_model_len=top, sm_scale=0.125,
                                          q_lens=(1, 2, 4), progress=False)
    for q in (2, 4):
        want = find_tuned_ladder(name, 16, top, q_len=q)
        if want is None:
            pytest.skip(f"no {q}-token ladder ships for {name}")
        assert runner.selector.ladder_for(q) == want
    assert runner.selector.ladder_for(1) == find_tuned_ladder(name, 16, top)
    runner.close()
