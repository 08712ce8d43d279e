"""bench/experiments/switch_replay.py's held-out replay: a mix left out of the choice is
replayed under the switch chosen without it (host arithmetic, no GPU)."""

from __future__ import annotations

import pytest

from graphbucket.tuning.ragged import RaggedSample
from tests.script_modules import load_experiment

pytestmark = pytest.mark.host


def load():
    return load_experiment("switch_replay")


def timed(mix: str, longest: int, a_us: float, b_us: float) -> RaggedSample:
    return RaggedSample(4, mix, (longest, longest // 8, longest // 8, longest // 8), 100.0,
                        a_us, "a", (("a", a_us), ("b", b_us)))


REPORT = {"meta": {"num_sms": 132, "num_heads": 16, "batches": [4], "balanced_from": 4096},
          "ladder": {"max_model_len": 16384, "buckets": [{"max_len": 16384, "hint": 16384}]}}


def test_each_length_is_replayed_under_the_choice_of_the_other():
    # At the first length kernel a is the faster, at the second b, both well ahead of
    # split-KV: chosen from the other length, every mix replays its slower kernel.
    samples = [timed("one-long", 6000, 40.0, 50.0), timed("spread", 6000, 45.0, 60.0),
               timed("one-long@15/16", 7680, 50.0, 40.0),
               timed("spread@15/16", 7680, 60.0, 45.0)]
    rows = load().held_out(REPORT, samples, "length", pairs=False)
    own = sorted((s.mix, plan, round(r, 4)) for r, s, plan in rows["own range"])
    assert own == [("one-long", "b", 1.25), ("one-long@15/16", "a", 1.25),
                   ("spread", "b", round(60 / 45, 4)), ("spread@15/16", "a", round(60 / 45, 4))]
    # Left out one mix at a time, the two mixes of the other length outvote the one left
    # of its own: the same replays.
    rows = load().held_out(REPORT, samples, "mix", pairs=False)
    assert sorted((s.mix, plan, round(r, 4)) for r, s, plan in rows["own range"]) == own


def test_a_report_with_one_mix_length_cannot_hold_lengths_out():
    samples = [timed("one-long", 6000, 40.0, 50.0), timed("spread", 6000, 45.0, 60.0)]
    with pytest.raises(SystemExit, match="two mix lengths"):
        load().held_out(REPORT, samples, "length", pairs=False)
