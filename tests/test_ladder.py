"""CPU tests for graphbucket.ladder: validation, bucket lookup, immutability, JSON, default
ladder. Which graph serves a batch (``GraphSelector``) is tested in test_select.py."""

from __future__ import annotations

import bisect
import copy
import dataclasses
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from graphbucket.ladder import Bucket, BucketLadder, default_ladder
from graphbucket.tuning.shipped import LADDER_DIR

pytestmark = pytest.mark.host

MAX = 131072


def make(bounds: list[int], hints: list[int] | None = None, top: int | None = None) -> BucketLadder:
    hints = bounds if hints is None else hints
    return BucketLadder(
        [Bucket(b, h) for b, h in zip(bounds, hints, strict=True)], top or bounds[-1]
    )


def linear_scan(ladder: BucketLadder, length: int) -> int:
    """First bucket whose range (lower, max_len] holds ``length`` (0 is padding: bucket 0)."""
    if length == 0:
        return 0
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


def test_container_behaviour():
    lad = make([64, 4096, MAX], [32, 1024, MAX])
    assert len(lad) == 3
    assert list(lad) == [Bucket(64, 32), Bucket(4096, 1024), Bucket(MAX, MAX)]
    assert lad[1] == Bucket(4096, 1024) and lad[-1].max_len == MAX
    assert lad.bounds == (64, 4096, MAX) and lad.hints == (32, 1024, MAX)
    assert lad.ranges == ((1, 64), (65, 4096), (4097, MAX))
    assert lad.max_model_len == MAX
    assert "Bucket(max_len=4096, hint=1024)" in repr(lad) and f"max_model_len={MAX}" in repr(lad)


def test_fields_cannot_be_assigned():
    lad = make([64, 4096, MAX], [32, 1024, MAX])
    for name, value in (("max_model_len", 5), ("buckets", (Bucket(5, 5),)), ("meta", {})):
        with pytest.raises(AttributeError):
            setattr(lad, name, value)
    with pytest.raises(AttributeError):
        lad[0].hint = 5
    with pytest.raises(TypeError):
        lad.buckets[0] = Bucket(64, 64)  # type: ignore[index]
    assert lad == make([64, 4096, MAX], [32, 1024, MAX])


def test_ladder_does_not_alias_the_callers_list():
    buckets = [Bucket(64, 64), Bucket(128, 128)]
    lad = BucketLadder(buckets, 128)
    buckets[0] = Bucket(32, 32)
    buckets.append(Bucket(256, 256))
    assert lad.bounds == (64, 128) and len(lad) == 2


def test_replace_builds_a_validated_ladder():
    lad = make([64, 128])
    wider = dataclasses.replace(lad, buckets=(Bucket(64, 64), Bucket(256, 100)),
                                max_model_len=256)
    assert wider.bounds == (64, 256) and wider.hints == (64, 100)
    assert lad.bounds == (64, 128)  # the original is unchanged
    with pytest.raises(ValueError, match="max_model_len=256"):
        dataclasses.replace(lad, max_model_len=256)


def test_equality_ignores_meta_and_hashes():
    a = BucketLadder([Bucket(64, 64), Bucket(128, 100)], 128, meta={"device": "H200"})
    b = BucketLadder([Bucket(64, 64), Bucket(128, 100)], 128)
    c = BucketLadder([Bucket(64, 64), Bucket(128, 128)], 128)
    d = BucketLadder([Bucket(32, 32), Bucket(128, 100)], 128)
    assert a == b and hash(a) == hash(b)
    assert a != c and a != d
    assert len({a, b, c, d}) == 3
    assert {a: "x"}[b] == "x"
    # Built from a list or a tuple, the same buckets are the same ladder.
    assert BucketLadder((Bucket(64, 64), Bucket(128, 100)), 128) == b
    assert a != "not a ladder"
    assert a != tuple(a)


def test_pickle_and_copy_keep_meta():
    a = BucketLadder([Bucket(64, 64), Bucket(128, 100, batch_hints={8: 16})], 128,
                     meta={"heads": 16})
    for clone in (pickle.loads(pickle.dumps(a)), copy.deepcopy(a), copy.copy(a)):
        assert clone == a and hash(clone) == hash(a) and clone.meta == {"heads": 16}
        assert clone.hints_for(8) == (64, 16) and clone.bucket_for(100) == 1
        with pytest.raises(AttributeError):
            clone.max_model_len = 5


# ---- bucket_for -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "length,index",
    [(0, 0), (1, 0), (64, 0), (65, 1), (4096, 1), (4097, 2), (16384, 2), (16385, 3),
     (65536, 3), (65537, 4), (MAX - 1, 4), (MAX, 4)],
)
def test_bucket_for_boundaries(length, index):
    assert default_ladder(MAX).bucket_for(length) == index


def test_bucket_for_matches_a_linear_scan():
    rng = np.random.default_rng(4321)
    for _ in range(100):
        top = int(rng.integers(1, 300_000))
        num_inner = int(rng.integers(0, min(top, 12)))
        inner = rng.choice(np.arange(1, top), size=num_inner, replace=False) if top > 1 else []
        bounds = sorted(int(b) for b in inner) + [top]
        lad = make(bounds, top=top)
        edges = sorted({0, 1, top} | set(bounds) | {min(b + 1, top) for b in bounds})
        for n in edges + [int(x) for x in rng.integers(0, top + 1, size=20)]:
            assert lad.bucket_for(n) == linear_scan(lad, n), (bounds, n)
            assert lad.bucket_for(np.int64(n)) == lad.bucket_for(n)
            assert lad.bucket_for(n) == bisect.bisect_left(lad.bounds, n)


def test_bucket_for_errors():
    lad = default_ladder(MAX)
    with pytest.raises(ValueError, match=rf"{MAX + 1}.*ladder top.*max_model_len={MAX}"):
        lad.bucket_for(MAX + 1)
    with pytest.raises(ValueError, match="-1 is negative"):
        lad.bucket_for(-1)
    for bad in (5.0, "5", None, True, [5]):
        with pytest.raises(TypeError):
            lad.bucket_for(bad)


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
    assert BucketLadder.load(LADDER_DIR / "default.json") == default_ladder()


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
    assert lad.bounds == bounds and lad.max_model_len == top and lad.hints == bounds
    assert lad.bucket_for(top) == len(lad) - 1
    # Clipping keeps the field bounds below the top, and only those.
    field_bounds = default_ladder(1 << 30).bounds[:-1]
    assert lad.bounds[:-1] == tuple(b for b in field_bounds if b < top)


def test_default_ladder_rejects_zero():
    with pytest.raises(ValueError, match=">= 1"):
        default_ladder(0)


def test_with_top_hints_keeps_bounds_and_hints_each_bucket_at_its_top():
    lad = BucketLadder([Bucket(64, 1), Bucket(4096, 512, batch_hints={8: 16})], 4096,
                       meta={"device": "x"})
    tops = lad.with_top_hints()
    assert tops.bounds == lad.bounds and tops.hints == (64, 4096)
    assert tops.hints_for(8) == (64, 4096) and tops.meta["device"] == "x"
    assert all(not b.batch_hints for b in tops)
    # The original is untouched, and a top-hinted ladder is its own fixed point.
    assert lad.hints == (1, 512) and lad.hints_for(8) == (1, 16) and lad.meta == {"device": "x"}
    assert tops.with_top_hints() == tops


# ---- balanced topology for ragged batches ----------------------------------------------


@pytest.mark.parametrize("value", [0.99, 0.5, -2, True, "2"])
def test_balanced_imbalance_must_be_zero_one_or_above(value):
    with pytest.raises(ValueError, match="balanced_imbalance"):
        Bucket(4096, 4096, balanced_imbalance=value)


def test_balanced_imbalance_round_trips_and_defaults_to_off(tmp_path: Path):
    lad = BucketLadder([Bucket(64, 64), Bucket(MAX, 8192, batch_hints={8: 2048},
                                              balanced_imbalance=3)], MAX)
    assert lad[0].balanced_imbalance == 0.0 and lad[1].balanced_imbalance == 3.0
    assert "balanced_imbalance" not in lad.to_dict()["buckets"][0]
    path = tmp_path / "l.json"
    lad.save(path)
    back = BucketLadder.load(path)
    assert back == lad and back[1].balanced_imbalance == 3.0
    assert "balanced_imbalance=3" in repr(back)
    # Equality sees the threshold: the same bounds and hints without it differ.
    assert back != BucketLadder([Bucket(64, 64), Bucket(MAX, 8192, batch_hints={8: 2048})],
                                MAX)


def test_bad_balanced_imbalance_json_rejected():
    text = json.dumps({"max_model_len": 64, "buckets": [
        {"max_len": 64, "hint": 64, "balanced_imbalance": 0.9}]})
    with pytest.raises(ValueError, match="balanced_imbalance"):
        BucketLadder.from_json(text)


def test_with_balanced_topology_marks_only_buckets_above_the_bound():
    lad = default_ladder()
    assert [b.balanced_imbalance for b in lad] == [0.0, 0.0, 1.5, 1.5, 1.5]
    off = lad.with_balanced_topology(0)
    assert all(b.balanced_imbalance == 0 for b in off) and off.bounds == lad.bounds
    custom = lad.with_balanced_topology(4.0, above=64)
    assert [b.balanced_imbalance for b in custom] == [0.0, 4.0, 4.0, 4.0, 4.0]
    assert custom.hints == lad.hints and custom.meta["balanced_imbalance"] == 4.0
    # The top-hinted form (hint read as an upper bound) has no balanced topology.
    assert all(b.balanced_imbalance == 0 for b in lad.with_top_hints())
