"""CPU tests for graphbucket.ladder: validation, host-only selection, JSON, ladder builders."""

from __future__ import annotations

import bisect
import copy
import dataclasses
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from graphbucket.ladder import (
    Bucket,
    BucketLadder,
    default_ladder,
    ladder_from_plans,
)
from graphbucket.plan import plan_mla_decode

MAX = 131072


def make(bounds: list[int], hints: list[int] | None = None, top: int | None = None) -> BucketLadder:
    hints = bounds if hints is None else hints
    return BucketLadder(
        [Bucket(b, h) for b, h in zip(bounds, hints, strict=True)], top or bounds[-1]
    )


def brute_force(ladder: BucketLadder, lens: list[int], key: str) -> int:
    """Linear scan: first bucket whose range (lower, max_len] holds the chosen length."""
    real = [n for n in lens if n > 0]
    if not real:
        return 0
    length = max(real) if key == "max" else min(real)
    lower = 0
    for i, b in enumerate(ladder):
        if lower < length <= b.max_len:
            return i
        lower = b.max_len
    raise AssertionError(f"length {length} not covered")


# ---- validation -----------------------------------------------------------------------


def test_bucket_rejects_hint_below_one():
    with pytest.raises(ValueError, match="hint=0.*>= 1"):
        Bucket(64, 0)
    with pytest.raises(ValueError, match="hint=-3"):
        Bucket(64, -3)


def test_bucket_rejects_non_int():
    with pytest.raises(TypeError, match="int"):
        Bucket(64.0, 64)
    with pytest.raises(TypeError, match="int"):
        Bucket(64, True)


def test_bucket_normalises_numpy_ints():
    b = Bucket(np.int64(64), np.int32(32))
    assert type(b.max_len) is int and type(b.hint) is int
    assert b == Bucket(64, 32) and hash(b) == hash(Bucket(64, 32))


def test_empty_ladder():
    with pytest.raises(ValueError, match="at least one bucket"):
        BucketLadder([], 1024)


@pytest.mark.parametrize("bounds", [[64, 64, 1024], [64, 32, 1024], [4096, 64, 1024]])
def test_non_increasing_bounds(bounds):
    with pytest.raises(ValueError, match="strictly increasing"):
        BucketLadder([Bucket(b, b) for b in bounds], 1024)


def test_hint_above_max_model_len_rejected():
    with pytest.raises(ValueError, match="hint=2048 above max_model_len=1024"):
        make([64, 512, 1024], [64, 512, 2048])
    with pytest.raises(ValueError, match="hint=4096 above max_model_len=1024"):
        BucketLadder([Bucket(64, 64, batch_hints={8: 4096}), Bucket(1024, 1024)], 1024)


@pytest.mark.parametrize("hints", [[64, 64, 1024], [64, 600, 1024], [65, 512, 1024]])
def test_hints_outside_their_bucket_plan_fewer_or_more_splits(hints):
    # Any hint gives a correct plan; a tuned ladder may use one outside its bucket.
    assert make([64, 512, 1024], hints).hints == tuple(hints)


def test_batch_hints_pick_the_largest_listed_batch_at_or_below():
    b = Bucket(4096, 4096, batch_hints={8: 2048, 64: 512})
    assert b.batch_hints == ((8, 2048), (64, 512))
    assert [b.hint_for(n) for n in (1, 7, 8, 63, 64, 512)] == [4096, 4096, 2048, 2048, 512, 512]
    assert Bucket(4096, 4096, batch_hints=[(64, 512), (8, 2048)]) == b  # order-free, hashable
    assert hash(b) == hash(Bucket(4096, 4096, batch_hints={64: 512, 8: 2048}))
    lad = BucketLadder([Bucket(64, 1), b], 4096)
    assert lad.hints == (1, 4096) and lad.hints_for(8) == (1, 2048)
    assert lad.hint_for(1, 100) == 512
    assert "batch_hints={8: 2048, 64: 512}" in repr(lad)
    data = lad.to_dict()
    assert data["buckets"][1]["batch_hints"] == {"8": 2048, "64": 512}
    assert BucketLadder.from_json(json.dumps(data)) == lad
    assert "batch_hints" not in data["buckets"][0]  # plain buckets keep the plain JSON


@pytest.mark.parametrize("batch_hints, match", [
    ({8: 0}, ">= 1"), ([(8, 16), (8, 32)], "distinct batch sizes"), ({0: 16}, "distinct"),
    ({8: "x"}, "must map batch sizes"), ([3], "must map batch sizes")])
def test_bad_batch_hints_rejected(batch_hints, match):
    with pytest.raises((TypeError, ValueError), match=match):
        Bucket(64, 64, batch_hints=batch_hints)


@pytest.mark.parametrize("entry, match", [
    ({"max_len": 64, "hint": 64, "batch_hints": [8, 16]}, "must map batch sizes"),
    ({"max_len": 64, "hint": 64, "batch_hints": {"eight": 16}}, "keys must be batch sizes"),
    ({"max_len": 64, "hint": 64, "extra": 1}, "optionally 'batch_hints'")])
def test_bad_batch_hints_json_rejected(entry, match):
    with pytest.raises(ValueError, match=match):
        BucketLadder.from_dict({"max_model_len": 64, "buckets": [entry]})


def test_hint_zero_rejected_in_ladder():
    with pytest.raises(ValueError, match=">= 1"):
        BucketLadder([Bucket(64, 0), Bucket(1024, 1024)], 1024)


def test_must_cover_max_model_len():
    with pytest.raises(ValueError, match=r"covers lengths 1\.\.4096 but max_model_len=8192"):
        make([64, 4096], top=8192)
    with pytest.raises(ValueError, match="max_model_len=1024"):
        BucketLadder([Bucket(64, 64), Bucket(4096, 4096)], 1024)


def test_max_model_len_positive():
    with pytest.raises(ValueError, match="max_model_len must be >= 1"):
        BucketLadder([Bucket(1, 1)], 0)


def test_rejects_non_bucket_items():
    with pytest.raises(TypeError, match="must be a Bucket"):
        BucketLadder([(64, 64)], 64)


def test_valid_edge_ladders():
    assert len(make([1])) == 1
    lad = make([1, 2, 3])
    assert lad.bounds == (1, 2, 3) and lad.hints == (1, 2, 3)
    # A hint anywhere is fine, not only the top.
    assert make([64, 4096], [1, 65]).hints == (1, 65)


# ---- container behaviour --------------------------------------------------------------


def test_container_and_immutability():
    lad = make([64, 4096, MAX], [32, 1024, MAX])
    assert len(lad) == 3
    assert list(lad) == [Bucket(64, 32), Bucket(4096, 1024), Bucket(MAX, MAX)]
    assert lad[1] == Bucket(4096, 1024) and lad[-1].max_len == MAX
    assert lad.bounds == (64, 4096, MAX) and lad.hints == (32, 1024, MAX)
    assert lad.ranges == ((1, 64), (65, 4096), (4097, MAX))
    assert lad.max_model_len == MAX
    assert "Bucket(max_len=4096, hint=1024)" in repr(lad) and f"max_model_len={MAX}" in repr(lad)
    with pytest.raises(AttributeError, match="immutable"):
        lad.max_model_len = 5
    with pytest.raises(AttributeError, match="immutable"):
        lad._bounds = (1,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lad[0].hint = 5


def test_equality_ignores_meta_and_hashes():
    a = BucketLadder([Bucket(64, 64), Bucket(128, 100)], 128, meta={"device": "H200"})
    b = BucketLadder([Bucket(64, 64), Bucket(128, 100)], 128)
    c = BucketLadder([Bucket(64, 64), Bucket(128, 128)], 128)
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert a != "not a ladder"


def test_pickle_and_copy_keep_meta():
    a = BucketLadder([Bucket(64, 64), Bucket(128, 100)], 128, meta={"heads": 16})
    for clone in (pickle.loads(pickle.dumps(a)), copy.deepcopy(a), copy.copy(a)):
        assert clone == a and clone.meta == {"heads": 16}


# ---- select ---------------------------------------------------------------------------


@pytest.fixture
def ladder() -> BucketLadder:
    return default_ladder(MAX)


@pytest.mark.parametrize(
    "length,index",
    [
        (0, 0),
        (1, 0),
        (64, 0),
        (65, 1),
        (4096, 1),
        (4097, 2),
        (16384, 2),
        (16385, 3),
        (65536, 3),
        (65537, 4),
        (MAX - 1, 4),
        (MAX, 4),
    ],
)
def test_select_boundaries(ladder, length, index):
    assert ladder.bucket_for(length) == index
    assert ladder.select([length]) == index
    assert ladder.select([length], key="min") == index


def test_select_max_vs_min(ladder):
    lens = [10, 5000, 70000, 64]
    assert ladder.select(lens) == 4
    assert ladder.select(lens, key="max") == 4
    assert ladder.select(lens, key="min") == 0
    assert ladder.select([100, 20000], key="min") == 1


def test_select_ignores_padding_zeros(ladder):
    assert ladder.select([0, 0, 3000, 0]) == 1
    assert ladder.select([0, 0, 3000, 70, 0], key="min") == 1
    assert ladder.select([0, 0, 0]) == 0
    assert ladder.select([0, 0, 0], key="min") == 0
    assert ladder.select(np.array([0, 20000, 0, 70], dtype=np.int32), key="min") == 1


def test_select_input_types_agree(ladder):
    torch = pytest.importorskip("torch")
    lens = [0, 3, 4097, 65, 0]
    expected = 2
    assert ladder.select(lens) == expected
    assert ladder.select(tuple(lens)) == expected
    assert ladder.select(range(0, 4098)) == expected
    for dtype in (np.int32, np.int64, np.uint32):
        assert ladder.select(np.array(lens, dtype=dtype)) == expected
    for dtype in (torch.int32, torch.int64):
        assert ladder.select(torch.tensor(lens, dtype=dtype)) == expected
    assert ladder.select([np.int64(n) for n in lens]) == expected


def test_select_property_sweep():
    rng = np.random.default_rng(1234)
    for _ in range(200):
        top = int(rng.integers(1, 300_000))
        num_inner = int(rng.integers(0, min(top, 12)))
        inner = rng.choice(np.arange(1, top), size=num_inner, replace=False) if top > 1 else []
        bounds = sorted(int(b) for b in inner) + [top]
        lowers = [0] + bounds[:-1]
        hints = [int(rng.integers(lo + 1, hi + 1)) for lo, hi in zip(lowers, bounds, strict=True)]
        lad = make(bounds, hints, top)
        # Stress the edges: bounds and bounds + 1 are where off-by-one errors live.
        edges = np.array(sorted({0, 1, top} | set(bounds) | {min(b + 1, top) for b in bounds}))
        for _ in range(10):
            batch = int(rng.integers(1, 65))
            pool = edges if rng.random() < 0.5 else np.arange(0, top + 1)
            lens = [int(x) for x in rng.choice(pool, size=batch)]
            for key in ("max", "min"):
                want = brute_force(lad, lens, key)
                assert lad.select(lens, key=key) == want, (bounds, lens, key)
                assert lad.select(np.array(lens), key=key) == want
        for n in edges:
            assert lad.bucket_for(int(n)) == brute_force(lad, [int(n)], "max")
            assert lad.bucket_for(int(n)) == bisect.bisect_left(lad.bounds, int(n))


def test_select_above_top(ladder):
    for lens in ([1, MAX + 1], np.array([MAX + 1, 2])):
        with pytest.raises(ValueError, match=rf"{MAX + 1}.*ladder top.*{MAX}.*max_model_len"):
            ladder.select(lens)
        # The top is a hard limit whatever the key.
        with pytest.raises(ValueError, match="add a bucket"):
            ladder.select(lens, key="min")
    with pytest.raises(ValueError, match=str(MAX + 1)):
        ladder.bucket_for(MAX + 1)


def test_select_negative(ladder):
    with pytest.raises(ValueError, match="-1 is negative"):
        ladder.select([5, -1])
    with pytest.raises(ValueError, match="negative"):
        ladder.select(np.array([5, -1]))
    with pytest.raises(ValueError, match="negative"):
        ladder.bucket_for(-1)


def test_select_empty(ladder):
    for lens in ([], (), np.array([], dtype=np.int64)):
        with pytest.raises(ValueError, match="empty batch"):
            ladder.select(lens)


def test_select_bad_key(ladder):
    with pytest.raises(ValueError, match="key must be one of"):
        ladder.select([5], key="mean")


@pytest.mark.parametrize(
    "bad",
    [
        5,
        "123",
        None,
        {1: 2},
        {3, 4},
        np.array([1.0, 2.0]),
        np.array([[1, 2]]),
        np.int64(3),
        [1.5, 2.5],
    ],
)
def test_select_rejects_wrong_types(ladder, bad):
    with pytest.raises(TypeError):
        ladder.select(bad)


def test_select_int_points_to_bucket_for(ladder):
    with pytest.raises(TypeError, match="bucket_for"):
        ladder.select(5)


def test_select_rejects_device_tensor_without_cuda(ladder):
    # The meta device stands in for CUDA: any non-CPU tensor must be refused, not read.
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="synchronize"):
        ladder.select(torch.empty(4, dtype=torch.int32, device="meta"))
    with pytest.raises(TypeError, match="integer"):
        ladder.select(torch.tensor([1.0, 2.0]))


def test_select_rejects_cuda_tensor(ladder):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with pytest.raises(TypeError, match="synchronize"):
        ladder.select(torch.tensor([1, 2], device="cuda"))


# ---- JSON -----------------------------------------------------------------------------


def test_json_round_trip(tmp_path: Path):
    meta = {"device": "NVIDIA H200", "num_heads": 16, "tuned": {"batch": [1, 8]}}
    lad = BucketLadder([Bucket(64, 64), Bucket(4096, 1000), Bucket(8192, 8192)], 8192, meta=meta)
    path = tmp_path / "ladder.json"
    lad.save(path)
    back = BucketLadder.load(path)
    assert back == lad and back.meta == meta
    assert BucketLadder.from_json(lad.to_json()) == lad
    data = json.loads(path.read_text())
    assert data["max_model_len"] == 8192
    assert data["buckets"][1] == {"max_len": 4096, "hint": 1000}


def test_json_meta_optional():
    lad = BucketLadder.from_json('{"max_model_len": 64, "buckets": [{"max_len": 64, "hint": 8}]}')
    assert lad == make([64], [8]) and lad.meta == {}


@pytest.mark.parametrize(
    "text,match",
    [
        ('{"buckets": []}', "missing"),
        ('{"max_model_len": 64, "buckets": [], "extra": 1}', "unknown"),
        ('{"max_model_len": 64, "buckets": []}', "at least one bucket"),
        ('{"max_model_len": 64, "buckets": [{"max_len": 64}]}', "'max_len' and 'hint'"),
        ('{"max_model_len": 128, "buckets": [{"max_len": 64, "hint": 64}]}', "max_model_len=128"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_json_errors(text, match):
    with pytest.raises(ValueError, match=match):
        BucketLadder.from_json(text)


def test_shipped_default_json_matches_default_ladder():
    path = Path(__file__).resolve().parents[1] / "graphbucket" / "ladders" / "default.json"
    assert BucketLadder.load(path) == default_ladder()


# ---- default_ladder -------------------------------------------------------------------


def test_default_ladder_full():
    lad = default_ladder()
    assert len(lad) == 5
    assert lad.bounds == (64, 4096, 16384, 65536, MAX)
    assert lad.hints == lad.bounds
    assert lad.max_model_len == MAX


@pytest.mark.parametrize(
    "top,bounds",
    [
        (1000, (64, 1000)),
        (64, (64,)),
        (65, (64, 65)),
        (1, (1,)),
        (4096, (64, 4096)),
        (200_000, (64, 4096, 16384, 65536, 200_000)),
    ],
)
def test_default_ladder_clips(top, bounds):
    lad = default_ladder(top)
    assert lad.bounds == bounds and lad.max_model_len == top
    assert lad.select([top]) == len(lad) - 1


def test_default_ladder_rejects_zero():
    with pytest.raises(ValueError, match=">= 1"):
        default_ladder(0)


# ---- ladder_from_plans ----------------------------------------------------------------


@pytest.mark.parametrize("batch_size,num_heads", [(1, 16), (1, 128), (8, 128), (64, 16)])
@pytest.mark.parametrize("top", [MAX, 100_000, 1000, 1])
def test_ladder_from_real_plans(batch_size, num_heads, top):
    def plan_fn(h: int):
        return plan_mla_decode(batch_size, num_heads, h, num_sms=132)

    lad = ladder_from_plans(plan_fn, max_model_len=top)
    assert lad.max_model_len == top and lad.bounds[-1] == top
    plans = [plan_fn(b.hint) for b in lad]
    assert len(set(plans)) == len(plans), "every bucket must be a distinct plan"
    assert lad.hints == lad.bounds
    pow2 = [1 << k for k in range(top.bit_length())] + [top]
    for n in pow2:
        assert plan_fn(n) == plans[lad.bucket_for(n)], n
    # Every distinct plan over 1..top appears (plans are monotone, so no bucket is lost).
    assert set(plans) == {plan_fn(n) for n in pow2}


def test_ladder_from_plans_finds_exact_boundary():
    # A plan that changes at 100 and 5000 (not powers of two): the search finds both.
    def plan_fn(h: int) -> int:
        return (h > 100) + (h > 5000)

    lad = ladder_from_plans(plan_fn, max_model_len=MAX)
    assert lad.bounds == (100, 5000, MAX)
    for n in range(1, 6000, 7):
        assert plan_fn(lad[lad.bucket_for(n)].hint) == plan_fn(n)


def test_ladder_from_plans_candidates():
    def plan_fn(h: int) -> int:
        return h // 1000

    lad = ladder_from_plans(plan_fn, max_model_len=2500, candidate_hints=[500, 1500, 9000])
    # Samples 500 (0), 1500 (1), 2500 (2); 9000 is above the top and dropped.
    assert lad.bounds == (999, 1999, 2500)
    with pytest.raises(ValueError, match=">= 1"):
        ladder_from_plans(plan_fn, max_model_len=2500, candidate_hints=[0, 10])


def test_ladder_from_plans_constant_plan_is_one_bucket():
    lad = ladder_from_plans(lambda h: "same", max_model_len=MAX, meta={"k": 1})
    assert lad.bounds == (MAX,) and lad.meta == {"k": 1}


def test_with_top_hints_keeps_bounds_and_hints_each_bucket_at_its_top():
    lad = BucketLadder([Bucket(64, 1), Bucket(4096, 512, batch_hints={8: 16})], 4096,
                       meta={"device": "x"})
    tops = lad.with_top_hints()
    assert tops.bounds == lad.bounds and tops.hints == (64, 4096)
    assert tops.hints_for(8) == (64, 4096) and tops.meta["device"] == "x"
