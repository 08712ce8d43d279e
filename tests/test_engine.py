"""BucketHook: the engine-facing selection of (padded batch, bucket, hint)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphbucket.engine import BucketChoice, BucketHook
from graphbucket.ladder import Bucket, BucketLadder, default_ladder


@pytest.fixture
def hook() -> BucketHook:
    return BucketHook(default_ladder(131072), capture_sizes=[8, 1, 2, 4])


def test_choose_pads_batch_and_picks_bucket_of_longest_request(hook):
    choice = hook.choose([10, 5000, 3])
    assert choice.padded_batch_size == 4 and choice.bucket == 2
    assert choice.hint == hook.ladder.hints[2] and choice.key == (4, 2)
    assert hook.choose(np.array([64], dtype=np.int32)).key == (1, 0)
    assert hook.choose(torch.tensor([65, 0], dtype=torch.int32)).key == (2, 1)


def test_random_steps_match_a_linear_scan(hook):
    rng = np.random.default_rng(3)
    bounds = hook.ladder.bounds
    for _ in range(500):
        lens = rng.integers(0, 131073, size=int(rng.integers(1, 9))).tolist()
        choice = hook.choose(lens)
        top = max(lens)
        expected = 0 if top == 0 else next(i for i, b in enumerate(bounds) if top <= b)
        assert choice.bucket == expected
        assert choice.padded_batch_size == min(s for s in (1, 2, 4, 8) if s >= len(lens))


def test_oversize_batch_is_left_to_the_engine_and_long_lengths_raise(hook):
    assert hook.choose([1] * 9) is None
    with pytest.raises(ValueError, match="131073"):
        hook.choose([131073])


def test_capture_keys_cover_every_pair_largest_batch_first(hook):
    keys = list(hook.capture_keys())
    assert len(keys) == 4 * len(hook.ladder)
    assert keys[0][0] == 8 and keys[-1][0] == 1
    assert {(bs, b) for bs, b, _ in keys} == {(bs, b) for bs in (1, 2, 4, 8) for b in range(5)}
    assert all(hint == hook.ladder.hints[b] for _, b, hint in keys)


def test_batch_hints_reach_the_capture_keys_and_the_choice():
    ladder = BucketLadder([Bucket(64, 64), Bucket(4096, 4096, batch_hints={4: 512})], 4096)
    hook = BucketHook(ladder, capture_sizes=[1, 2, 4, 8])
    keys = {(bs, b): hint for bs, b, hint in hook.capture_keys()}
    assert keys[(2, 1)] == 4096 and keys[(4, 1)] == keys[(8, 1)] == 512
    assert hook.choose([100, 3000, 7]) == BucketChoice(4, 1, 512)  # padded to 4
    assert hook.choose([3000]).hint == 4096


def test_bad_construction_raises():
    with pytest.raises(ValueError, match="capture_sizes"):
        BucketHook(default_ladder(), capture_sizes=[])
    with pytest.raises(ValueError, match="select_key"):
        BucketHook(default_ladder(), capture_sizes=[1], select_key="mean")
