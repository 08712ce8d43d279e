"""graphbucket.tuning.held_out: each mix length replayed through the selector under the
switch chosen from the other length, and the kernel reach chosen by it (host arithmetic)."""

from __future__ import annotations

import pytest

from graphbucket.ladder import BucketLadder
from graphbucket.tuning.held_out import (
    KERNEL_REACHES,
    choose_kernel_reach,
    held_out_by_length,
    replayed,
    switched_ladder,
)
from graphbucket.tuning.ragged import RaggedSample, choose_switches, ragged_ranges

pytestmark = pytest.mark.host

LADDER = BucketLadder.from_dict({"max_model_len": 32768,
                                 "buckets": [{"max_len": 32768, "hint": 16384}]})
RANGES = ragged_ranges(LADDER.bounds, 4096)


def timed(mix: str, longest: int, a_us: float, b_us: float, split_us: float = 200.0
          ) -> RaggedSample:
    """Batch 4, one long request among three of an eighth (imbalance 2.9)."""
    short = longest // 8
    return RaggedSample(4, mix, (longest, short, short, short), split_us, a_us, "a",
                        (("a", a_us), ("b", b_us)))


def no_model(_mixes):
    return None


def lopsided() -> list[RaggedSample]:
    """(4096, 8192]: kernel a 1.25x ahead at both lengths; (8192, 16384]: kernel b 2x ahead
    on three mixes per length, enough to outvote the range below when pooled with it."""
    assert RANGES[:2] == [(4096, 8192), (8192, 16384)]
    out = [timed("one-long", 6000, 40.0, 50.0), timed("one-long@15/16", 7680, 40.0, 50.0)]
    for name in ("x", "y", "z"):
        out += [timed(name, 12000, 80.0, 40.0), timed(f"{name}@15/16", 15360, 80.0, 40.0)]
    return out


def test_replayed_reads_the_plan_the_selector_picks():
    samples = lopsided()
    switches, _ = choose_switches(samples, RANGES, neighbours=0)
    plans = replayed(switched_ladder(LADDER, switches, RANGES[0][0]), samples)
    assert plans[:2] == [("a", 40.0), ("a", 40.0)]
    assert plans[2:] == [("b", 40.0)] * 6
    # Balanced off: every mix replays split-KV.
    off = [sw.__class__(sw.lo, sw.hi, 0.0) for sw in switches]
    assert {p for p, _ in replayed(switched_ladder(LADDER, off, RANGES[0][0]), samples)} \
        == {"split"}


def test_each_length_replays_under_the_choice_of_the_other():
    # Kernel a is the faster at the first length, b at the second: chosen from the other
    # length, each mix replays its slower kernel (in sample, each would replay its faster).
    samples = [timed("one-long", 6000, 40.0, 50.0), timed("one-long@15/16", 7680, 50.0, 40.0)]
    ratios = held_out_by_length(LADDER, samples, RANGES, no_model, neighbours=0)
    assert ratios == [pytest.approx(1.25)] * 2


def test_pooling_the_neighbours_costs_the_small_range_its_kernel_out_of_sample():
    samples = lopsided()
    own = held_out_by_length(LADDER, samples, RANGES, no_model, neighbours=0)
    pooled = held_out_by_length(LADDER, samples, RANGES, no_model, neighbours=1)
    assert len(own) == len(pooled) == len(samples)
    assert max(own) == pytest.approx(1.0)
    assert sorted(pooled)[-2:] == [pytest.approx(1.25)] * 2  # both lengths of the small range
    reach, found = choose_kernel_reach(LADDER, samples, RANGES, no_model)
    assert reach == 0
    assert found[0]["above"] == 0 and found[1]["above"] == 2
    assert found[1]["worst"] == 1.25 and found[1]["mixes"] == 8


def test_a_tie_keeps_the_default_reach():
    samples = [timed("one-long", 6000, 40.0, 50.0), timed("one-long@15/16", 7680, 40.0, 50.0),
               timed("x", 12000, 40.0, 80.0), timed("x@15/16", 15360, 40.0, 80.0)]
    reach, found = choose_kernel_reach(LADDER, samples, RANGES, no_model)
    assert found[0] == found[1] and found[0]["above"] == 0
    assert reach == KERNEL_REACHES[0] == 1


def test_one_mix_length_cannot_be_held_out():
    samples = [timed("one-long", 6000, 40.0, 50.0), timed("x", 12000, 80.0, 40.0)]
    with pytest.raises(ValueError, match="two lengths"):
        held_out_by_length(LADDER, samples, RANGES, no_model, neighbours=0)
