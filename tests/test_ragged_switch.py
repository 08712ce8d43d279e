"""CPU tests for the tuner's ragged switch: the balanced threshold chosen from timed mixes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from graphbucket.ladder import BALANCED_ABOVE, BucketLadder, default_ladder
from graphbucket.select import GraphSelector
from graphbucket.tuning.grid import hints_to_measure, plan_splits, splits_to_measure, times_to_rows
from graphbucket.tuning.ragged import (
    RaggedSample,
    choose_by_batch,
    choose_imbalance,
    choose_switches,
    imbalance,
    ragged_ranges,
    ratios_at,
    threshold_candidates,
    tuner_mixes,
)
from tests.script_modules import load_script

pytestmark = pytest.mark.host


def sample(batch: int, lens: list[int], split_us: float, balanced_us: float) -> RaggedSample:
    return RaggedSample(batch, f"m{len(lens)}-{max(lens)}", tuple(lens), split_us, balanced_us)


def test_imbalance_is_longest_times_live_over_total_and_skips_padding():
    assert imbalance([100, 100, 100]) == 1.0
    assert imbalance([300, 100, 0, 0]) == pytest.approx(300 * 2 / 400)
    assert imbalance([0, 0]) == 1.0


@pytest.mark.parametrize("batch", [2, 3, 4, 8, 64, 128])
def test_tuner_mixes_are_ragged_above_the_balanced_bound_and_out_of_the_oracles_sample(batch):
    top = 131072
    mixes = tuner_mixes(batch, top, above=BALANCED_ABOVE)
    assert mixes and len({tuple(sorted(lens)) for _, lens in mixes}) == len(mixes)
    assert mixes[-1] == ("uniform", [max(mixes[0][1])] * batch)
    for name, lens in mixes:
        assert len(lens) == batch, name
        assert max(lens) > BALANCED_ABOVE, name
        assert imbalance(lens) > 1.0 or name == "uniform", name
        # bench/ladder_oracle.py's mixes end at max_model_len or at 8192 tokens.
        assert max(lens) not in (top, 8192), name
    assert tuner_mixes(1, top, above=BALANCED_ABOVE) == []
    assert tuner_mixes(batch, 4096, above=BALANCED_ABOVE) == []  # nothing above the bound


def test_threshold_candidates_split_the_samples_every_distinct_way():
    samples = [sample(4, [4000, 1000, 1000, 1000], 1, 2), sample(4, [8000, 100, 100, 100], 1, 2)]
    values = sorted(s.imbalance for s in samples)
    cands = threshold_candidates(samples)
    assert cands[0] == 0.0
    assert 1.0 < cands[1] < values[0] < cands[2] < values[1]


def test_balanced_chosen_exactly_where_it_wins():
    rng = random.Random(3)
    samples = []
    for _ in range(30):
        batch = rng.choice([2, 4, 8, 16, 64])
        long = rng.randrange(10_000, 130_000)
        lens = [long] + [rng.randrange(1, 4000) for _ in range(batch - 1)]
        # balanced pays only from imbalance 4 on in this toy cost model
        wins = imbalance(lens) >= 4
        samples.append(sample(batch, lens, 100.0, 60.0 if wins else 150.0))
    assert any(imbalance(s.lens) >= 4 for s in samples)
    assert any(imbalance(s.lens) < 4 for s in samples)
    threshold, summary = choose_imbalance(samples)
    assert summary["worst_over_best"] == 1.0
    assert all(r == 1.0 for r in ratios_at(samples, threshold))
    assert summary["off_worst_over_best"] == pytest.approx(100 / 60, abs=1e-3)
    assert summary["always_worst_over_best"] == 1.5
    # The selector, built from the chosen threshold, replays balanced exactly on the wins.
    ladder = BucketLadder.from_dict({"max_model_len": 131072, "buckets": [
        {"max_len": 4096, "hint": 4096}, {"max_len": 131072, "hint": 131072}]})
    selector = GraphSelector(ladder.with_balanced_topology(threshold), [2, 4, 8, 16, 64])
    for s in samples:
        key = selector.choose(list(s.lens))
        assert key.balanced == (s.balanced_us < s.split_us), (s, threshold)


def test_balanced_off_when_it_never_wins_and_ties_go_to_fewer_balanced_graphs():
    losing = [sample(8, [100_000] + [1000] * 7, 100.0, 130.0),
              sample(8, [50_000] * 4 + [2000] * 4, 100.0, 180.0)]
    assert choose_imbalance(losing)[0] == 0.0
    tied = [sample(8, [100_000] + [1000] * 7, 100.0, 100.0)]
    assert choose_imbalance(tied)[0] == 0.0
    winning = [sample(8, [100_000] + [1000] * 7, 100.0, 50.0),
               sample(8, [50_000] * 4 + [2000] * 4, 100.0, 90.0)]
    threshold, _ = choose_imbalance(winning)
    assert 1.0 < threshold < min(s.imbalance for s in winning)
    with pytest.raises(ValueError, match="at least one"):
        choose_imbalance([])


@pytest.mark.parametrize("balanced_us, uniform_balanced", [(98.0, False), (96.0, True)])
def test_a_uniform_batch_switches_only_on_a_win_beyond_the_margin(balanced_us,
                                                                   uniform_balanced):
    # A one-long mix balanced wins clearly; the uniform batch by 2 % (inside the 3 % margin)
    # or by 4 % (outside it).
    ragged = sample(8, [100_000] + [1000] * 7, 100.0, 50.0)
    uniform = sample(8, [100_000] * 8, 100.0, balanced_us)
    threshold, summary = choose_imbalance([ragged, uniform])
    assert threshold > 0.0 and threshold <= ragged.imbalance
    assert (threshold <= 1.0) == uniform_balanced, threshold
    # The summary reports the measured ratios, not the margin's.
    assert summary["worst_over_best"] == (1.0 if uniform_balanced
                                          else pytest.approx(100.0 / balanced_us, abs=1e-4))
    assert choose_imbalance([ragged, uniform], uniform_margin=1.0)[0] <= 1.0


def test_samples_round_trip_through_json():
    s = sample(4, [9000, 10, 10, 10], 12.5, 7.25)
    assert RaggedSample.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def _tune_script():
    return load_script("tune_ladder")


def _report_with_mixes(tmp_path: Path, samples: list[RaggedSample] | None,
                       top: int = 16384) -> Path:
    contexts = sorted({64, 1024, 8192, 16384, top})
    splits_for = plan_splits(16, num_sms=132)
    hints = hints_to_measure(contexts, top, ladders=[default_ladder(top)])
    per_batch = splits_to_measure([1, 8], splits_for, hints)
    times = {(c, b, s): c / min(s, c // 64 + 1) + 5 * s
             for b in (1, 8) for c in contexts for s in per_batch[b]}
    meta = {"gpu": "NVIDIA H200", "num_sms": 132, "num_heads": 16, "batches": [1, 8],
            "contexts": contexts, "command": "x", "date": "2026-12-02 01:00 UTC",
            "torch": "t", "triton": "t", "kv_cache": "bf16"}
    data = {"meta": meta, "times": times_to_rows(times)}
    if samples is not None:
        data["ragged"] = {"samples": [s.to_dict() for s in samples]}
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(data))
    return path


def test_tune_ladder_rechooses_the_threshold_from_a_reports_mixes(tmp_path: Path, capsys):
    script = _tune_script()
    samples = [sample(8, [12_000] + [500] * 7, 100.0, 40.0),     # imbalance ~5.8: balanced
               sample(8, [12_000] * 4 + [3000] * 4, 100.0, 170.0)]  # ~1.6: split-KV
    saved = _report_with_mixes(tmp_path, samples)
    out, report = tmp_path / "ladder.json", tmp_path / "report.json"
    script.main(["--from-times", str(saved), "--max-model-len", "16384", "--out", str(out),
                 "--report", str(report), "--quiet"])
    threshold = BucketLadder.load(out)[-1].balanced_imbalance
    assert samples[1].imbalance < threshold <= samples[0].imbalance
    again = json.loads(report.read_text())
    assert again["ragged"]["summary"]["balanced_imbalance"] == threshold
    assert f"16384]: {threshold}" in report.with_suffix(".md").read_text()
    # A threshold given on the command line wins; an old report without mixes keeps 1.5.
    script.main(["--from-times", str(saved), "--max-model-len", "16384", "--out", str(out),
                 "--balanced-imbalance", "0", "--quiet", "--force"])
    assert BucketLadder.load(out)[-1].balanced_imbalance == 0.0
    old = _report_with_mixes(tmp_path, None)
    script.main(["--from-times", str(old), "--max-model-len", "16384", "--out", str(out),
                 "--quiet", "--force"])
    assert BucketLadder.load(out)[-1].balanced_imbalance == 1.5


@pytest.mark.parametrize("value", ["1", "0.5", "-2", "often"])
def test_tune_ladder_rejects_a_threshold_that_cannot_be_one(value, capsys):
    with pytest.raises(SystemExit) as e:
        _tune_script().parse_args(["--balanced-imbalance", value])
    assert e.value.code == 2
    assert "--balanced-imbalance" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_ragged_timing_sees_balanced_win_where_one_split_serialises():
    # One 64K request among short ones on a one-split plan runs the long request on one
    # program per head block; the balanced plan spreads it over the machine.
    from graphbucket.plan import plan_balanced_mla_decode, plan_mla_decode
    from graphbucket.tuning.measure import PlanTimer, time_ragged

    lens = [65536] + [256] * 7
    one_split = plan_mla_decode(8, 16, 1, num_sms=132)
    balanced = plan_balanced_mla_decode(8, 16, num_sms=132)
    assert one_split.num_kv_splits == 1
    timer = PlanTimer(-(-sum(lens) // 8), 8, 16, max_items=balanced.max_work_items)
    (s,) = time_ragged(timer, [(8, "one-long", lens)], lambda b, _: one_split,
                       lambda b: balanced)
    assert s.lens == tuple(lens) and s.split_us > 0 and s.balanced_us > 0
    assert s.balanced_us * 3 < s.split_us, s
    threshold, summary = choose_imbalance([s])
    assert 1.0 < threshold <= s.imbalance and summary["worst_over_best"] == 1.0


def test_bucket_thresholds_by_batch_step_like_batch_hints_and_round_trip(tmp_path: Path):
    from graphbucket.ladder import Bucket
    from graphbucket.tuning.shipped import clip_ladder

    b = Bucket(131072, 8192, balanced_imbalance=6.0, batch_imbalance={32: 2.5, 128: 0})
    assert [b.imbalance_for(n) for n in (2, 16, 32, 64, 128, 256)] == [6, 6, 2.5, 2.5, 0, 0]
    assert b.has_balanced and not Bucket(64, 64).has_balanced
    assert Bucket(64, 64, batch_imbalance={8: 3}).has_balanced
    ladder = BucketLadder((Bucket(4096, 4096), b), 131072)
    path = tmp_path / "l.json"
    ladder.save(path)
    back = BucketLadder.load(path)
    assert back == ladder and back[1].batch_imbalance == ((32, 2.5), (128, 0.0))
    assert "batch_imbalance" in repr(back)
    assert clip_ladder(ladder, 65536)[1].batch_imbalance == b.batch_imbalance
    for bad in ({8: 0.5}, {0: 2.0}, [(8, 2.0), (8, 3.0)]):
        with pytest.raises(ValueError, match="batch_imbalance"):
            Bucket(4096, 4096, batch_imbalance=bad)
    with pytest.raises(ValueError, match="batch_imbalance"):
        BucketLadder.from_dict({"max_model_len": 64, "buckets": [
            {"max_len": 64, "hint": 64, "batch_imbalance": {"eight": 2}}]})


def test_selector_applies_each_capture_sizes_threshold():
    lens_of = {n: [60_000] * (n // 4) + [2000] * (n - n // 4) for n in (8, 64)}
    assert all(3.5 < imbalance(v) < 3.7 for v in lens_of.values())
    ladder = BucketLadder.from_dict({"max_model_len": 131072, "buckets": [
        {"max_len": 4096, "hint": 4096}, {"max_len": 131072, "hint": 131072}]})
    tuned = ladder.with_balanced_topology(6.0, by_batch={32: 2.5, 128: 0})
    selector = GraphSelector(tuned, [8, 64, 128])
    assert not selector.choose(lens_of[8]).balanced    # 3.6 < 6
    assert selector.choose(lens_of[64]).balanced       # 3.6 >= 2.5 from batch 32 up
    assert not selector.choose(lens_of[64] + [2000] * 60).balanced  # batch 128: off
    one_long = [120_000] + [500] * 7
    assert selector.choose(one_long).balanced
    keys = selector.keys()
    assert not any(k.balanced and k.batch_size == 128 for k in keys)
    assert any(k.balanced and k.batch_size == 64 for k in keys)


def test_thresholds_by_batch_follow_a_crossover_that_moves_with_the_batch():
    rng = random.Random(5)
    samples = []
    for batch, crossover in ((4, 8.0), (16, 5.0), (64, 2.5)):
        for _ in range(12):
            long = rng.randrange(10_000, 130_000)
            lens = [long] * rng.randrange(1, batch) + [rng.randrange(100, 4000)] * batch
            lens = lens[:batch]
            wins = imbalance(lens) >= crossover
            samples.append(sample(batch, lens, 100.0, 70.0 if wins else 130.0))
    base, by_batch, summary = choose_by_batch(samples)
    assert summary["worst_over_best"] == 1.0
    assert summary["single_worst_over_best"] > 1.0  # one threshold cannot follow it
    ladder = BucketLadder.from_dict({"max_model_len": 131072, "buckets": [
        {"max_len": 4096, "hint": 4096}, {"max_len": 131072, "hint": 131072}]})
    selector = GraphSelector(ladder.with_balanced_topology(base, by_batch=by_batch),
                             [4, 16, 64])
    for s in samples:
        assert selector.choose(list(s.lens)).balanced == (s.balanced_us < s.split_us), s



def test_ragged_ranges_cut_the_balanced_buckets_at_powers_of_two():
    bounds = (64, 2897, 11586, 32768, 131072)
    assert ragged_ranges(bounds, 4096) == [(4096, 8192), (8192, 11586), (11586, 16384),
                                           (16384, 32768), (32768, 65536), (65536, 131072)]
    assert ragged_ranges((4096, 5793, 131072), 4096)[:2] == [(4096, 5793), (5793, 8192)]
    assert ragged_ranges((1024, 4096), 4096) == []


def test_ragged_ranges_from_a_start_below_the_bound_cut_at_powers_of_two():
    bounds = (128, 1879, 2048, 2657, 4096, 5313, 131072)
    assert ragged_ranges(bounds, 4096, start=1024)[:4] == [(1024, 2048), (2048, 4096),
                                                          (4096, 5313), (5313, 8192)]
    assert ragged_ranges(bounds, 4096, start=4096) == ragged_ranges(bounds, 4096)
    assert ragged_ranges(bounds, 4096, start=1500)[:2] == [(1500, 2048), (2048, 4096)]
    # A ladder ending below the bound: the ranges stop at its end.
    assert ragged_ranges((64, 3000), 4096, start=1024) == [(1024, 2048), (2048, 3000)]


def test_mixes_of_a_short_range_keep_their_short_requests_below_the_long_one():
    for lo, top in ((1024, 2048), (2048, 4096), (512, 1024)):
        for batch in (2, 8, 64):
            for name, lens in tuner_mixes(batch, top, above=lo):
                assert lo < max(lens) <= top, (lo, top, name)
                if name in ("one-long", "quarter-long", "half-long"):
                    assert min(lens) < max(lens), (lo, top, name)
    # Above the bound the mixes are the ones the shipped ladders were tuned with.
    quarter = dict(tuner_mixes(8, 5313, above=4096))["quarter-long"]
    assert sorted(set(quarter)) == [2048, 4705]


def test_a_switch_per_length_range_separates_what_one_imbalance_cannot():
    # At the same imbalance (a spread from 1 token) split-KV wins at 8K (the balanced
    # planner and merge dominate short requests) and balanced wins at 128K.
    def spread(batch, top):
        return [1 + (top - 1) * i // (batch - 1) for i in range(batch)]

    samples = []
    for batch in (8, 64):
        samples += [sample(batch, spread(batch, 6144), 100.0, 130.0),
                    sample(batch, [6144] + [512] * (batch - 1), 100.0, 60.0),
                    sample(batch, spread(batch, 98304), 100.0, 77.0),
                    sample(batch, [98304] * (batch // 2) + [4096] * (batch // 2), 100.0, 120.0)]
    ladder = BucketLadder.from_dict({"max_model_len": 131072, "buckets": [
        {"max_len": 4096, "hint": 4096}, {"max_len": 131072, "hint": 65536,
                                          "batch_hints": {"64": 8192}}]})
    ranges = ragged_ranges(ladder.bounds, BALANCED_ABOVE)
    switches, summary = choose_switches(samples, ranges)
    assert summary["worst_over_best"] == 1.0
    assert summary["one_switch_worst_over_best"] > 1.2  # one threshold loses one of them
    assert switches[0].lo == 4096 and switches[-1].hi == 131072 and len(switches) >= 2
    assert switches[0].hi < 98304 and switches[0] != switches[-1]
    tuned = ladder.with_ragged_switches(switches)
    # The cut buckets keep their hints: every length plans as before.
    for n in (1, 4096, 4097, 8192, 8193, 100_000, 131072):
        for batch in (8, 64):
            old, new = ladder.bucket_for(n), tuned.bucket_for(n)
            assert tuned.hint_for(new, batch) == ladder.hint_for(old, batch), (n, batch)
    assert tuned[0].balanced_imbalance == 0  # at or below the balanced bound: split-KV
    selector = GraphSelector(tuned, [8, 64])
    for s in samples:
        assert selector.choose(list(s.lens)).balanced == (s.balanced_us < s.split_us), s
    # Out of sample: the 8K spread the oracle times stays split-KV, the 128K one balanced.
    assert not selector.choose(spread(64, 8192)).balanced
    assert selector.choose(spread(64, 131072)).balanced
    again = BucketLadder.from_dict(json.loads(json.dumps(tuned.to_dict())))
    assert again == tuned
    with pytest.raises(ValueError, match="at least one"):
        choose_switches([], ranges)


def test_a_range_cut_at_a_bucket_edge_gets_mixes_of_its_own():
    # (6889, 8192]: 3/4 of the top (6144) lies below the range, so the long request sits
    # halfway inside it; the full octave keeps 3/4 of its top.
    for lo, top in ((6889, 8192), (4096, 4872), (65536, 131072)):
        longs = {max(lens) for _, lens in tuner_mixes(8, top, above=lo)}
        assert len(longs) == 1 and lo < longs.pop() <= top, (lo, top)
    assert {max(lens) for _, lens in tuner_mixes(8, 131072, above=65536)} == {98304}


def test_a_range_without_mixes_takes_the_nearest_ranges_choice_not_all_of_them():
    # Balanced wins by far over 16K and loses under 8K; (8192, 12000] has no mixes of its
    # own and takes its neighbour below, not the choice over every sample (balanced).
    low = [sample(8, [6000] + [10] * 7, 100.0, 150.0)]
    high = [sample(8, [m] + [10] * 7, 100.0, 20.0) for m in (20000, 40000, 60000)]
    ranges = [(4096, 8192), (8192, 12000), (12000, 16384), (16384, 65536)]
    switches, _ = choose_switches(low + high, ranges)
    at = {n: next(sw.threshold for sw in switches if sw.lo < n <= sw.hi)
          for n in (6000, 10000, 14000, 30000)}
    assert at[6000] == at[10000] == 0.0  # off, like 4096..8192
    assert at[30000] > 0
    assert at[14000] == at[30000]  # the nearest range above
    with pytest.raises(ValueError, match="at least one length range"):
        choose_switches(low, [])


def test_a_range_where_balanced_wins_uniform_batches_too_sends_every_batch_there():
    # Above 64K balanced wins every mix at batch 32, the uniform one included; at batch 8
    # split-KV keeps the uniform batch. One row was never timed: it stays split-KV.
    samples = []
    for batch, uniform_balanced in ((8, 130.0), (32, 90.0)):
        for name, lens in tuner_mixes(batch, 131072, above=65536):
            balanced = uniform_balanced if name == "uniform" else 70.0
            samples.append(RaggedSample(batch, name, tuple(lens), 100.0, balanced))
    ladder = BucketLadder.from_dict({"max_model_len": 131072, "buckets": [
        {"max_len": 65536, "hint": 4096}, {"max_len": 131072, "hint": 65536}]})
    (switch,) = choose_switches(samples, [(65536, 131072)])[0]
    assert switch.threshold > 1.0 and switch.by_batch == ((32, 1.0),)
    selector = GraphSelector(ladder.with_ragged_switches([switch]), [1, 8, 32])
    assert selector.choose([100_000] * 32).balanced
    assert not selector.choose([100_000] * 8).balanced
    assert selector.choose([100_000] + [512] * 7).balanced
    assert not selector.choose([100_000]).balanced
    assert all(selector.choose(list(s.lens)).balanced == (s.balanced_us < s.split_us)
               for s in samples)
    # Balanced wins the uniform batch at batch 8 too: every batch from the smallest size
    # timed, still none at one row (the threshold 1 starts at 8, not below it).
    faster = [RaggedSample(s.batch, s.mix, s.lens, s.split_us, 70.0) for s in samples]
    (switch,) = choose_switches(faster, [(65536, 131072)])[0]
    assert switch.threshold == 0.0 and switch.by_batch == ((8, 1.0),)
    selector = GraphSelector(ladder.with_ragged_switches([switch]), [1, 8, 32])
    assert selector.choose([100_000] * 8).balanced and selector.choose([100_000] * 32).balanced
    assert not selector.choose([100_000]).balanced


def test_balanced_from_on_a_saved_reports_mixes_is_a_usage_error(tmp_path, capsys):
    # A saved report's mixes were timed from its own length: re-choosing from them with
    # another --balanced-from would silently keep the old ranges.
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"meta": {}, "times": []}))
    with pytest.raises(SystemExit) as exit_info:
        load_script("tune_ladder").main(["--from-times", str(report), "--balanced-from",
                                         "2048", "--max-model-len", "4096"])
    assert exit_info.value.code == 2
    assert "--retime-ragged" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load_script("tune_ladder").main(["--balanced-from", "0", "--dry-run"])
    assert "at least 1 token" in capsys.readouterr().err
    # Likewise --mix-lengths, which decides which mixes are timed.
    with pytest.raises(SystemExit) as exit_info:
        load_script("tune_ladder").main(["--from-times", str(report), "--mix-lengths", "2",
                                         "--max-model-len", "4096"])
    assert exit_info.value.code == 2
    assert "--mix-lengths sets which mixes are timed" in capsys.readouterr().err


@pytest.mark.parametrize("batch", [2, 8, 64])
def test_tuner_mixes_at_two_lengths_add_the_same_mixes_near_the_range_top(batch):
    one = tuner_mixes(batch, 8192, above=4468)
    two = tuner_mixes(batch, 8192, above=4468, lengths=2)
    assert two[:len(one)] == one
    near = two[len(one):]
    assert [name for name, _ in near] == [f"{name}@15/16" for name, _ in one]
    assert {max(lens) for _, lens in one} == {6330}  # halfway through the range, above 3/4 of 8192
    assert {max(lens) for _, lens in near} == {7680}  # inside the range, below its top
    # Every mix keeps its shape, scaled to the longer request.
    for (_, a), (_, b) in zip(one, near, strict=True):
        assert len(a) == len(b) == batch and imbalance(b) == pytest.approx(
            imbalance(a), rel=0.35)
    # A range too narrow for a second length gets one.
    assert tuner_mixes(batch, 4468, above=4400, lengths=2) == tuner_mixes(
        batch, 4468, above=4400)
    with pytest.raises(ValueError, match="lengths must be 1 or 2"):
        tuner_mixes(batch, 8192, above=4468, lengths=3)


def test_the_kernel_is_chosen_with_the_threshold_not_before_it():
    # Kernel "a" is the better balanced kernel on the near-uniform mixes, where split-KV
    # beats both; "b" wins the skewed mixes, the only ones the switch sends to balanced.
    # Ranked over the balanced times alone "a" comes first (and would lose 1.58x on the
    # spread); chosen together with the threshold, "b" serves every mix at its best.
    lens = {"uniform": [4000] * 8, "half-long": [4000] * 4 + [2000] * 4,
            "spread": [1 + 3999 * i // 7 for i in range(8)], "one-long": [4000] + [512] * 7}
    times = {"uniform": (80, 90, 200), "half-long": (80, 90, 200), "spread": (100, 95, 60),
             "one-long": (100, 90, 50)}
    samples = [RaggedSample(8, mix, tuple(lens[mix]), split, a, "a", (("a", a), ("b", b)))
               for mix, (split, a, b) in times.items()]
    (switch,), summary = choose_switches(samples, [(2048, 4096)])
    assert switch.kernel_for(8) == "b"
    threshold = switch.threshold or dict(switch.by_batch)[8]
    assert imbalance(lens["half-long"]) < threshold <= imbalance(lens["spread"])
    assert summary["worst_over_best"] == 1.0


def test_the_summary_scores_the_kernel_choice_against_the_fastest_plan_timed():
    # One capture size, two balanced kernels, no cost model: one kernel serves both mixes.
    # A is 1.4x behind B on the skewed mix, B 1.2x behind A on the other, so B is kept;
    # against split-KV and B alone every mix is on its faster plan, against every plan
    # timed the first mix is 1.2x behind.
    def timed(lens, split_us, a_us, b_us):
        return RaggedSample(2, f"m-{max(lens)}", tuple(lens), split_us, a_us, "a",
                            (("a", a_us), ("b", b_us)))

    samples = [timed([6000, 2000], 100.0, 50.0, 60.0), timed([6000, 600], 100.0, 70.0, 50.0)]
    switches, summary = choose_switches(samples, [(4096, 8192)])
    assert switches[0].kernel_for(2) == "b"
    assert summary["worst_over_best"] == 1.0
    assert summary["worst_over_fastest"] == 1.2
    assert summary["mean_over_fastest"] == 1.1


def test_a_ranges_kernel_is_chosen_with_its_neighbours_mixes_and_its_threshold_alone():
    # Kernel b leads by 25 % in the ranges on both sides; in the middle range a leads by
    # 2 % on its own two mixes. Chosen over the three ranges, the middle range takes b too
    # (a handful of mixes decides nothing at 2 %); its threshold still comes from its own.
    def timed(longest, a_us, b_us, split_us=100.0):
        lens = (longest, longest // 4)
        return RaggedSample(2, f"m-{longest}", lens, split_us, a_us, "a",
                            (("a", a_us), ("b", b_us)))

    ranges = [(4096, 8192), (8192, 16384), (16384, 32768)]
    samples = [timed(6000, 50.0, 40.0), timed(7000, 50.0, 40.0),
               timed(12000, 50.0, 51.0), timed(14000, 50.0, 51.0),
               timed(24000, 50.0, 40.0), timed(28000, 50.0, 40.0)]
    switches, summary = choose_switches(samples, ranges)
    middle = next(sw for sw in switches if sw.lo < 12000 <= sw.hi)
    assert middle.kernel_for(2) == "b"
    assert summary["worst_over_fastest"] == pytest.approx(51 / 50, abs=1e-4)
    # Its threshold is its own: where split-KV wins there, it stays on split-KV.
    samples[2:4] = [timed(12000, 50.0, 51.0, split_us=45.0),
                    timed(14000, 50.0, 51.0, split_us=45.0)]
    switches, _ = choose_switches(samples, ranges)
    middle = next(sw for sw in switches if sw.lo < 12000 <= sw.hi)
    assert middle.threshold == 0.0 and not middle.by_batch
    assert all(sw.threshold or sw.by_batch for sw in switches if sw is not middle)
    # With no neighbours each range chooses over its own mixes alone, as before.
    switches, summary = choose_switches(samples, ranges, neighbours=0)
    assert next(sw for sw in switches if sw.lo < 12000 <= sw.hi).kernel_for(2) == "a"
    assert summary["kernel_neighbour_ranges"] == 0
    with pytest.raises(ValueError, match="neighbours must be >= 0"):
        choose_switches(samples, ranges, neighbours=-1)


@pytest.mark.parametrize("value", ["-1", "two"])
def test_kernel_neighbours_below_zero_or_not_a_number_is_a_usage_error(capsys, value):
    with pytest.raises(SystemExit):
        load_script("tune_ladder").main(["--kernel-neighbours", value, "--dry-run"])
    err = capsys.readouterr().err
    assert "--kernel-neighbours" in err and f"{value!r}: 0 ranges or more, or auto" in err


def test_kernel_options_are_ranked_by_their_worst_mix_or_their_mean_as_asked():
    # Split-KV loses every mix. Kernel a is fastest on three mixes and 1.1x behind on the
    # fourth (mean 1.025); b is 1.05x behind on those three and fastest on the fourth (mean
    # 1.0375). Ranked by the worst mix first b wins, by the mean first a; an unknown
    # ranking is refused before anything is chosen.
    def timed(longest, a_us, b_us):
        lens = (longest, longest // 4)
        return RaggedSample(2, f"m-{longest}", lens, 500.0, a_us, "a",
                            (("a", a_us), ("b", b_us)))

    samples = [timed(5000, 100.0, 105.0), timed(5500, 100.0, 105.0),
               timed(6000, 100.0, 105.0), timed(6500, 110.0, 100.0)]
    ranges = [(4096, 8192)]
    switches, summary = choose_switches(samples, ranges, score="worst")
    assert switches[0].kernel_for(2) == "b" and summary["kernel_score"] == "worst"
    assert summary["mean_over_fastest"] == pytest.approx(1.0375, abs=1e-4)
    switches, summary = choose_switches(samples, ranges, score="mean")
    assert switches[0].kernel_for(2) == "a" and summary["kernel_score"] == "mean"
    assert summary["worst_over_fastest"] == pytest.approx(1.1, abs=1e-4)
    with pytest.raises(ValueError, match="kernel score must be one of"):
        choose_switches(samples, ranges, score="median")


def test_kernel_score_outside_the_choices_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        load_script("tune_ladder").main(["--kernel-score", "median", "--dry-run"])
    assert "--kernel-score" in capsys.readouterr().err
