"""CPU tests for graphbucket.select: which graph (padded batch, bucket, hint) serves a step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphbucket.ladder import Bucket, BucketLadder, default_ladder
from graphbucket.select import GraphKey, GraphSelector

pytestmark = pytest.mark.host

MAX = 131072
SIZES = (1, 2, 4, 8)


def make(bounds: list[int], hints: list[int] | None = None, top: int | None = None) -> BucketLadder:
    hints = bounds if hints is None else hints
    return BucketLadder(
        [Bucket(b, h) for b, h in zip(bounds, hints, strict=True)], top or bounds[-1]
    )


def brute_force(ladder: BucketLadder, lens: list[int], rule: str) -> int:
    """Linear scan: first bucket whose range (lower, max_len] holds the chosen length."""
    real = [n for n in lens if n > 0]
    if not real:
        return 0
    length = max(real) if rule == "max" else min(real)
    lower = 0
    for i, b in enumerate(ladder):
        if lower < length <= b.max_len:
            return i
        lower = b.max_len
    raise AssertionError(f"length {length} not covered")


@pytest.fixture
def ladder() -> BucketLadder:
    """The default bounds and hints, split-KV only (the balanced switch has its own tests)."""
    return default_ladder(MAX).with_balanced_topology(0)


@pytest.fixture
def sel(ladder) -> GraphSelector:
    return GraphSelector(ladder, [8, 1, 2, 4])


@pytest.fixture
def sel_min(ladder) -> GraphSelector:
    return GraphSelector(ladder, [8, 1, 2, 4], rule="min")


def bucket(selector: GraphSelector, lens) -> int:
    key = selector.choose(lens)
    assert key is not None
    return key.bucket


# ---- bucket choice (was BucketLadder.select) ------------------------------------------


@pytest.mark.parametrize(
    "length,index",
    [(0, 0), (1, 0), (64, 0), (65, 1), (4096, 1), (4097, 2), (16384, 2), (16385, 3),
     (65536, 3), (65537, 4), (MAX - 1, 4), (MAX, 4)],
)
def test_choose_boundaries(sel, sel_min, length, index):
    assert bucket(sel, [length]) == index
    assert bucket(sel_min, [length]) == index


def test_max_vs_min_rule(sel, sel_min):
    lens = [10, 5000, 70000, 64]
    assert bucket(sel, lens) == 4
    assert bucket(sel_min, lens) == 0
    assert bucket(sel_min, [100, 20000]) == 1
    assert bucket(sel, [100, 20000]) == 3


def test_padding_zeros_are_ignored(sel, sel_min):
    assert bucket(sel, [0, 0, 3000, 0]) == 1
    assert bucket(sel_min, [0, 0, 3000, 70, 0]) == 1
    assert bucket(sel, [0, 0, 0]) == 0
    assert bucket(sel_min, [0, 0, 0]) == 0
    assert bucket(sel_min, np.array([0, 20000, 0, 70], dtype=np.int32)) == 1
    assert bucket(sel_min, torch.tensor([0, 20000, 0, 70], dtype=torch.int64)) == 1


def test_input_types_agree(ladder):
    lens = [0, 3, 4097, 65, 0]
    for rule, expected in (("max", 2), ("min", 0)):
        sel = GraphSelector(ladder, [8], rule=rule)
        want = GraphKey(8, expected, ladder.hint_for(expected, 8))
        inputs = [lens, tuple(lens), [np.int64(n) for n in lens]]
        inputs += [np.array(lens, dtype=dt) for dt in (np.int32, np.int64, np.uint32)]
        inputs += [torch.tensor(lens, dtype=dt) for dt in (torch.int32, torch.int64)]
        for seq in inputs:
            assert sel.choose(seq) == want, (rule, type(seq), getattr(seq, "dtype", None))
    # A range is a sequence too: one request per length 0..4097.
    assert bucket(GraphSelector(ladder, [4098]), range(0, 4098)) == 2
    assert bucket(GraphSelector(ladder, [4098], rule="min"), range(0, 4098)) == 0


@pytest.mark.parametrize("rule", ["max", "min"])
def test_property_sweep_against_a_brute_force(rule):
    rng = np.random.default_rng(1234)
    sizes = [1, 2, 4, 8, 16, 32, 64]
    for _ in range(200):
        top = int(rng.integers(1, 300_000))
        num_inner = int(rng.integers(0, min(top, 12)))
        inner = rng.choice(np.arange(1, top), size=num_inner, replace=False) if top > 1 else []
        bounds = sorted(int(b) for b in inner) + [top]
        lowers = [0] + bounds[:-1]
        hints = [int(rng.integers(lo + 1, hi + 1)) for lo, hi in zip(lowers, bounds, strict=True)]
        lad = make(bounds, hints, top)
        sel = GraphSelector(lad, sizes, rule=rule)
        # Stress the edges: bounds and bounds + 1 are where off-by-one errors live.
        edges = np.array(sorted({0, 1, top} | set(bounds) | {min(b + 1, top) for b in bounds}))
        for _ in range(10):
            batch = int(rng.integers(1, 65))
            pool = edges if rng.random() < 0.5 else np.arange(0, top + 1)
            lens = [int(x) for x in rng.choice(pool, size=batch)]
            want = brute_force(lad, lens, rule)
            padded = min(s for s in sizes if s >= batch)
            expected = GraphKey(padded, want, lad[want].hint)
            assert sel.choose(lens) == expected, (bounds, lens, rule)
            assert sel.choose(np.array(lens)) == expected
            assert sel.choose(torch.tensor(lens)) == expected


def test_above_top_raises_whatever_the_rule(sel, sel_min):
    for lens in ([1, MAX + 1], np.array([MAX + 1, 2]), torch.tensor([MAX + 1, 2])):
        with pytest.raises(ValueError, match=rf"{MAX + 1}.*ladder top.*{MAX}.*max_model_len"):
            sel.choose(lens)
        # The top is a hard limit even when the rule looks at the shortest request.
        with pytest.raises(ValueError, match="add a bucket"):
            sel_min.choose(lens)


def test_negative_lengths_raise(sel, sel_min):
    for lens in ([5, -1], (-1,), np.array([5, -1]), torch.tensor([5, -1])):
        for s in (sel, sel_min):
            with pytest.raises(ValueError, match=r"-1.*>= 0"):
                s.choose(lens)


def test_empty_batch_raises(sel):
    for lens in ([], (), np.array([], dtype=np.int64), torch.tensor([], dtype=torch.int32)):
        with pytest.raises(ValueError, match="empty"):
            sel.choose(lens)


@pytest.mark.parametrize(
    "bad",
    [5, "123", b"12", None, {1: 2}, {3, 4}, np.array([1.0, 2.0]), np.array([[1, 2]]),
     np.int64(3), [1.5, 2.5], [1, None]],
)
def test_wrong_types_raise(sel, bad):
    with pytest.raises(TypeError):
        sel.choose(bad)


def test_device_tensor_is_refused_not_read(sel):
    # The meta device stands in for CUDA: any non-CPU tensor must be refused, not read.
    with pytest.raises(TypeError, match="synchronize"):
        sel.choose(torch.empty(4, dtype=torch.int32, device="meta"))
    with pytest.raises(TypeError, match="integer"):
        sel.choose(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError):
        sel.choose(torch.tensor([[1, 2]]))


@pytest.mark.gpu
def test_cuda_tensor_is_refused(sel):
    with pytest.raises(TypeError, match="synchronize"):
        sel.choose(torch.tensor([1, 2], device="cuda"))


# ---- padded batch, keys, hints --------------------------------------------------------


def test_choose_pads_the_batch_and_takes_the_bucket_of_the_longest_request(sel, ladder):
    key = sel.choose([10, 5000, 3])
    assert key == GraphKey(4, 2, ladder.hint_for(2, 4))
    assert sel.choose(np.array([64], dtype=np.int32)) == GraphKey(1, 0, ladder.hint_for(0, 1))
    assert sel.choose(torch.tensor([65, 0], dtype=torch.int32)) == \
        GraphKey(2, 1, ladder.hint_for(1, 2))
    assert key == sel.key(4, 2)


def test_random_steps_match_a_linear_scan(sel, ladder):
    rng = np.random.default_rng(3)
    bounds = ladder.bounds
    for _ in range(500):
        lens = rng.integers(0, MAX + 1, size=int(rng.integers(1, 9))).tolist()
        key = sel.choose(lens)
        top = max(lens)
        expected = 0 if top == 0 else next(i for i, b in enumerate(bounds) if top <= b)
        padded = min(s for s in SIZES if s >= len(lens))
        assert key == GraphKey(padded, expected, ladder.hint_for(expected, padded))
        assert key in sel.keys()


def test_batch_above_the_largest_capture_size_takes_the_eager_path(sel):
    assert sel.choose([1] * 9) is None
    assert sel.choose(np.ones(100, dtype=np.int64)) is None
    assert sel.choose([1] * 8) is not None
    with pytest.raises(ValueError, match=str(MAX + 1)):
        sel.choose([MAX + 1])


def test_pad():
    sel = GraphSelector(default_ladder(), [16, 1, 4, 2, 8, 4])
    assert sel.capture_sizes == (1, 2, 4, 8, 16) and sel.max_batch_size == 16
    assert [sel.pad(n) for n in range(1, 18)] == \
        [1, 2, 4, 4] + [8] * 4 + [16] * 8 + [None]
    assert sel.pad(1000) is None
    odd = GraphSelector(default_ladder(), [3, 10])
    assert [odd.pad(n) for n in (1, 3, 4, 10, 11)] == [3, 3, 10, 10, None]
    assert odd.choose([5, 6, 7, 8]).batch_size == 10


def test_keys_cover_every_pair_largest_batch_first(sel, ladder):
    keys = sel.keys()
    assert len(keys) == len(set(keys)) == len(SIZES) * len(ladder)
    assert [k.batch_size for k in keys] == sorted((k.batch_size for k in keys), reverse=True)
    assert keys[0].batch_size == max(SIZES) and keys[-1].batch_size == min(SIZES)
    assert {(k.batch_size, k.bucket) for k in keys} == \
        {(bs, b) for bs in SIZES for b in range(len(ladder))}
    for bs in SIZES:  # ladder order within each batch size
        assert [k.bucket for k in keys if k.batch_size == bs] == list(range(len(ladder)))
    assert all(k.hint == ladder.hint_for(k.bucket, k.batch_size) for k in keys)
    assert all(sel.key(k.batch_size, k.bucket) == k for k in keys)


def test_batch_hints_reach_the_keys_and_the_choice():
    ladder = BucketLadder([Bucket(64, 64), Bucket(4096, 4096, batch_hints={4: 512})], 4096)
    sel = GraphSelector(ladder, [1, 2, 4, 8])
    hints = {(k.batch_size, k.bucket): k.hint for k in sel.keys()}
    assert hints[(1, 1)] == hints[(2, 1)] == 4096
    assert hints[(4, 1)] == hints[(8, 1)] == 512
    assert hints[(1, 0)] == hints[(8, 0)] == 64
    assert sel.choose([100, 3000, 7]) == GraphKey(4, 1, 512)  # padded to 4
    assert sel.choose([3000]) == GraphKey(1, 1, 4096)
    assert sel.key(8, 1).hint == 512


def test_key_for_agrees_with_choose(sel, sel_min):
    rng = np.random.default_rng(7)
    for _ in range(200):
        lens = rng.integers(0, MAX + 1, size=int(rng.integers(1, 12))).tolist()
        for s in (sel, sel_min):
            assert s.key_for(len(lens), min(lens), max(lens), lens) == s.choose(lens)
            positive = [n for n in lens if n > 0]
            if positive:  # without zeros the lengths themselves are not needed
                assert s.key_for(len(positive), min(positive), max(positive)) == \
                    s.choose(positive)


def test_graph_key_fields_are_real_types():
    import typing

    import graphbucket
    want = {"batch_size": int, "bucket": int, "hint": int, "balanced": bool, "q_len": int,
            "alternate": bool}
    assert GraphKey.__annotations__ == want  # not strings or ForwardRefs
    assert typing.get_type_hints(GraphKey) == want
    assert GraphKey._field_defaults == {"balanced": False, "q_len": 1, "alternate": False}
    assert graphbucket.GraphKey is GraphKey


def test_graph_key_is_a_value():
    assert GraphKey(4, 1, 512) == GraphKey(4, 1, 512) != GraphKey(4, 1, 4096)
    assert len({GraphKey(4, 1, 512), GraphKey(4, 1, 512), GraphKey(8, 1, 512)}) == 2
    with pytest.raises(AttributeError):
        GraphKey(4, 1, 512).hint = 5


@pytest.mark.parametrize("sizes", [[], [0], [-1, 4], [1.5], ["4"], [True]])
def test_bad_capture_sizes_raise(sizes):
    with pytest.raises(ValueError, match="capture_sizes"):
        GraphSelector(default_ladder(), sizes)


def test_bad_rule_or_ladder_raises():
    with pytest.raises(ValueError, match="rule"):
        GraphSelector(default_ladder(), [1], rule="mean")
    with pytest.raises(TypeError, match="BucketLadder"):
        GraphSelector([Bucket(64, 64)], [1])


# ---- ragged batches: the balanced topology ---------------------------------------------


def imbalance(lens) -> float:
    live = [n for n in lens if n > 0]
    return max(live) * len(live) / sum(live)


@pytest.fixture
def ragged_sel() -> GraphSelector:
    # Bucket 1 switches at imbalance 2, bucket 2 at 1.5, bucket 0 never.
    ladder = BucketLadder([Bucket(64, 64), Bucket(4096, 4096, balanced_imbalance=2.0),
                           Bucket(MAX, MAX, balanced_imbalance=1.5)], MAX)
    return GraphSelector(ladder, [1, 2, 4, 8])


@pytest.mark.parametrize("lens, balanced", [
    ([131072] + [1024] * 7, True),            # one long among short: imbalance 7.1
    ([100000, 100000, 100000, 100000], False),  # uniform: 1.0
    ([70000, 50000], False),                  # 1.17 < 1.5
    ([70000, 10000], True),                   # 1.75 >= 1.5
    ([4096, 1, 1, 1], True),                  # bucket 1: 3.99 >= 2
    ([4096, 4000, 3000, 10], False),          # bucket 1: 1.45 < 2
    ([64, 1, 1, 1], False),                   # bucket 0 never
    ([131072], False),                        # one row is never ragged
    ([131072, 0, 0], False),                  # padding rows do not count as requests
    ([131072, 0, 1000, 0], True),             # 2 live: 1.98 >= 1.5
])
def test_ragged_batches_take_the_balanced_key_at_the_bucket_threshold(ragged_sel, lens,
                                                                      balanced):
    key = ragged_sel.choose(lens)
    bucket = key.bucket
    threshold = ragged_sel.ladder[bucket].balanced_imbalance
    # The expectation follows the rule itself, computed independently of the selector.
    want = threshold > 0 and len([n for n in lens if n > 0]) > 1 \
        and imbalance(lens) >= threshold
    assert key.balanced == want
    assert key.balanced == balanced, (lens, imbalance(lens))
    assert key == ragged_sel.key(key.batch_size, bucket, balanced=key.balanced)
    for arr in (np.array(lens, dtype=np.int32), torch.tensor(lens, dtype=torch.int64)):
        assert ragged_sel.choose(arr) == key


def test_balanced_keys_exist_only_where_a_bucket_can_switch(ragged_sel):
    keys = ragged_sel.keys()
    balanced = [(k.batch_size, k.bucket) for k in keys if k.balanced]
    assert balanced == [(bs, b) for bs in (8, 4, 2) for b in (1, 2)]
    assert len(keys) == 4 * 3 + len(balanced)
    # Capture order: a batch size's split keys, then its balanced keys.
    assert [k.balanced for k in keys[:5]] == [False, False, False, True, True]
    with pytest.raises(KeyError, match="no balanced graph"):
        ragged_sel.key(8, 0, balanced=True)
    with pytest.raises(KeyError, match="no balanced graph"):
        ragged_sel.key(1, 2, balanced=True)


def test_random_ragged_steps_follow_the_rule(ragged_sel):
    rng = np.random.default_rng(7)
    for _ in range(500):
        bs = int(rng.integers(1, 9))
        lens = rng.integers(0, MAX + 1, size=bs)
        lens[rng.random(bs) < 0.2] = int(rng.integers(1, 2000))  # some short rows
        key = ragged_sel.choose(lens.tolist())
        live = lens[lens > 0]
        threshold = ragged_sel.ladder[key.bucket].balanced_imbalance
        want = bool(threshold and len(live) > 1
                    and live.max() * len(live) >= threshold * live.sum())
        assert key.balanced == want, lens


def test_a_ladder_without_the_balanced_topology_gives_no_balanced_key(ragged_sel):
    """What an engine without a balanced kernel does: the selector on
    ``with_balanced_topology(0, above=0)`` serves ragged steps with the split-KV key."""
    split_only = GraphSelector(ragged_sel.ladder.with_balanced_topology(0, above=0),
                               ragged_sel.capture_sizes)
    assert not any(k.balanced for k in split_only.keys())
    assert split_only.keys() == [k for k in ragged_sel.keys() if not k.balanced]
    rng = np.random.default_rng(11)
    seen_balanced = 0
    for _ in range(300):
        lens = rng.integers(0, MAX + 1, size=int(rng.integers(1, 9)))
        lens[rng.random(len(lens)) < 0.3] = int(rng.integers(1, 2000))
        key = ragged_sel.choose(lens)
        seen_balanced += key.balanced
        assert split_only.choose(lens) == key._replace(balanced=False), lens
    assert seen_balanced > 30  # the draw is ragged enough to exercise the switch
    # above=0 matters: the plain call keeps bucket 1's switch (it ends at 4096 tokens).
    kept = GraphSelector(ragged_sel.ladder.with_balanced_topology(0), ragged_sel.capture_sizes)
    assert kept.choose([4096, 1, 1, 1]).balanced


# ---- multi-token steps (q_len query tokens per request) ---------------------------------


def test_q_len_keys_are_captured_per_q_len_with_the_same_hints(ladder):
    s = GraphSelector(ladder, capture_sizes=[1, 4], q_lens=[2, 1, 4, 2])
    assert s.q_lens == (1, 2, 4) and s.max_q_len == 4
    keys = s.keys()
    assert len(keys) == len(set(keys)) == 2 * 3 * len(ladder)
    # Largest batch first, then the largest q_len, then ladder order.
    assert [(k.batch_size, k.q_len) for k in keys[::len(ladder)]] == [
        (4, 4), (4, 2), (4, 1), (1, 4), (1, 2), (1, 1)]
    for k in keys:
        assert k.hint == s.key(k.batch_size, k.bucket).hint  # hints do not depend on q_len
        assert s.key(k.batch_size, k.bucket, q_len=k.q_len) == k
    assert GraphKey(1, 0, 64) == GraphKey(1, 0, 64, False, 1) != GraphKey(1, 0, 64, False, 2)


def test_choose_picks_the_q_len_graph_of_the_bucket(ladder):
    s = GraphSelector(ladder, capture_sizes=[1, 4], q_lens=(1, 2))
    for lens in ([5], [70_000, 12], [0, 2, 4097]):
        one, two = s.choose(lens), s.choose(lens, q_len=2)
        assert two == one._replace(q_len=2), lens
    assert s.choose([5] * 5, q_len=2) is None  # above the capture sizes: eager path


def test_uncaptured_q_len_and_short_lengths_raise(ladder):
    s = GraphSelector(ladder, capture_sizes=[1, 4], q_lens=(1, 2))
    with pytest.raises(ValueError, match=r"q_len=3 has no graphs.*q_lens \[1, 2\]"):
        s.choose([100], q_len=3)
    with pytest.raises(ValueError, match="seq_len 1 < q_len 2"):
        s.choose([0, 1, 50], q_len=2)
    assert s.choose([0, 2, 50], q_len=2).q_len == 2
    for bad in ([0], [1, 0], [True], [1.5], []):
        with pytest.raises(ValueError, match="q_lens must be positive ints"):
            GraphSelector(ladder, capture_sizes=[1], q_lens=bad)


def test_ragged_verify_steps_replay_split_kv_graphs():
    ladder = BucketLadder([Bucket(64, 64), Bucket(MAX, MAX, balanced_imbalance=1.5)], MAX)
    s = GraphSelector(ladder, capture_sizes=[4], q_lens=(1, 2))
    ragged = [100_000, 10, 20, 30]
    assert s.choose(ragged).balanced
    two = s.choose(ragged, q_len=2)
    assert not two.balanced and (two.bucket, two.q_len) == (1, 2)
    assert all(not k.balanced for k in s.keys() if k.q_len == 2)
    with pytest.raises(KeyError, match="more than one query token"):
        s.key(4, 1, balanced=True, q_len=2)


def test_a_q_len_with_a_ladder_of_its_own_takes_its_bounds_and_hints(ladder):
    own = BucketLadder([Bucket(16, 1), Bucket(300, 2048, batch_hints={4: 256}),
                        Bucket(MAX, MAX)], MAX)
    s = GraphSelector(ladder, capture_sizes=[1, 4], q_lens=(1, 2, 4), q_ladders={2: own})
    assert s.ladder_for(2) is own and s.ladder_for(4) is ladder and s.ladder_for(1) is ladder
    rng = np.random.default_rng()
    for _ in range(200):
        lens = rng.integers(2, MAX + 1, size=int(rng.integers(1, 5))).tolist()
        pad = s.pad(len(lens))
        for q, lad in ((1, ladder), (2, own), (4, ladder)):
            if min(lens) < q:
                continue
            key = s.choose(lens, q_len=q)
            bucket = lad.bucket_for(max(lens))  # brute force: the longest request's bucket
            assert (key.batch_size, key.bucket, key.q_len) == (pad, bucket, q), (lens, q)
            assert key.hint == lad.hint_for(bucket, pad)
    assert {k.bucket for k in s.keys() if k.q_len == 2} == {0, 1, 2}
    assert s.key(4, 1, q_len=2).hint == 256 and s.key(1, 1, q_len=2).hint == 2048


@pytest.mark.parametrize("q_ladders, match", [
    ({1: "own"}, "captured q_lens above 1"), ({3: "own"}, "captured q_lens above 1"),
    ({2: "short"}, r"covers 1..4096 but the ladder"), ({2: [1, 2]}, "must be a BucketLadder")])
def test_bad_q_ladders_raise(ladder, q_ladders, match):
    made = {"own": BucketLadder([Bucket(MAX, MAX)], MAX),
            "short": BucketLadder([Bucket(4096, 4096)], 4096)}
    given = {q: made.get(v, v) if isinstance(v, str) else v for q, v in q_ladders.items()}
    with pytest.raises((ValueError, TypeError), match=match):
        GraphSelector(ladder, capture_sizes=[1], q_lens=(1, 2), q_ladders=given)
