"""CPU tests for the ladder tuner's choosing step and the shipped-ladder lookup."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from graphbucket.ladder import Bucket, BucketLadder, default_ladder
from graphbucket.plan import cdiv, pow2_ceil
from graphbucket.tuning.choose import choose_ladder, choose_per_batch
from graphbucket.tuning.grid import (
    bounds_with_edges,
    candidate_hints,
    edge_contexts,
    hint_plans,
    hints_to_measure,
    plan_splits,
    plan_variants,
    plans_to_measure,
    refine_contexts,
    splits_to_measure,
    times_from_rows,
    times_to_rows,
    tuning_contexts,
)
from graphbucket.tuning.shipped import (
    LADDER_DIR,
    clip_ladder,
    device_slugs,
    find_tuned_ladder,
    ladder_file_name,
    parse_ladder_file_name,
    parse_q_len,
    parse_sparse,
)
from tests.script_modules import load_script

pytestmark = pytest.mark.host

SPLITS = [1, 2, 4, 8, 16]


def capped_splits(cap: int = 16):
    """A small plan function: one split per 64-token tile, powers of two, at most ``cap``."""
    return lambda batch, hint: min(cap, pow2_ceil(cdiv(hint, 64)))


def table(best: dict[int, int], batches=(1,), good: float = 10.0, bad: float = 20.0) -> dict:
    """Context c runs in ``good`` us at split count best[c], ``bad`` at any other."""
    return {(c, b, s): good if s == best[c] else bad for c in best for b in batches for s in SPLITS}


def test_known_optimum_recovered():
    # One split is best up to 256 tokens, 16 splits from 512 on.
    best = {64: 1, 128: 1, 256: 1, 512: 16, 1024: 16, 2048: 16}
    result = choose_ladder(table(best), capped_splits(), max_model_len=2048, max_buckets=2)
    # Smallest hint planning 1 split is 1; 16 splits need a hint above 512: of the hints
    # that plan 16 (513, 1024, 2048) the power of two 1024 is kept.
    assert result.ladder == BucketLadder([Bucket(256, 1), Bucket(2048, 1024)], 2048)
    assert all(r["tuned_over_oracle"] == 1.0 for r in result.rows)
    assert result.summary["tuned_max_over_oracle"] == 1.0


def test_the_excess_charge_trades_a_slow_length_for_many_slightly_slower():
    """One bucket, two hints: 16 splits runs 64 tokens 6 % slow and the rest at the oracle
    (sum 4.060), 1 split runs 64 tokens at the oracle and the rest 2.1 % slow (sum 4.063).
    The plain sum takes 16 splits; charging the excess over 1.02 takes 1 split."""
    times = {}
    for c in (64, 128, 256, 512):
        for s in SPLITS:
            us = 12.0
            if s == 1:
                us = 10.0 if c == 64 else 10.21
            elif s == 16:
                us = 10.6 if c == 64 else 10.0
            times[(c, 1, s)] = us
    plain = choose_ladder(times, capped_splits(), max_model_len=1024, max_buckets=1,
                          excess_weight=0.0)
    charged = choose_ladder(times, capped_splits(), max_model_len=1024, max_buckets=1)
    assert [b.hint for b in plain.ladder] == [1024]
    assert plain.summary["tuned_max_over_oracle"] == pytest.approx(1.06)
    assert [b.hint for b in charged.ladder] == [1]
    assert charged.summary["tuned_max_over_oracle"] == pytest.approx(1.021)
    assert charged.summary["tuned_mean_over_oracle"] > plain.summary["tuned_mean_over_oracle"]
    with pytest.raises(ValueError, match="excess_weight"):
        choose_ladder(times, capped_splits(), max_model_len=1024, max_buckets=1,
                      excess_weight=-1.0)


def test_bucket_limit_respected_and_more_buckets_never_hurt():
    best = {64: 1, 128: 2, 256: 4, 512: 8, 1024: 16}
    times = table(best)
    means = []
    for max_buckets in range(1, 7):
        result = choose_ladder(times, capped_splits(), max_model_len=4096,
                               max_buckets=max_buckets)
        assert len(result.ladder) <= max_buckets
        means.append(result.summary["tuned_mean_over_oracle"])
    assert means == sorted(means, reverse=True)
    assert means[4] == 1.0  # five contexts, five split counts, five buckets


@pytest.mark.parametrize("seed", range(8))
def test_bounds_increase_cover_max_model_len_and_hold_their_hints(seed):
    rng = random.Random(seed)
    contexts = sorted(rng.sample([1, 64, 100, 128, 256, 300, 512, 1024, 2048, 4096], 7))
    times = {(c, b, s): rng.uniform(5, 50) for c in contexts for b in (1, 8) for s in SPLITS}
    result = choose_ladder(times, capped_splits(), max_model_len=8192, max_buckets=4)
    ladder = result.ladder
    assert list(ladder.bounds) == sorted(set(ladder.bounds))
    assert ladder.bounds[-1] == 8192 and set(ladder.bounds[:-1]) <= set(contexts)
    for bucket in ladder:
        assert all(1 <= h <= 8192 for h in bucket.all_hints())
    # more buckets never hurt, and the mean is never above the worst
    more = choose_ladder(times, capped_splits(), max_model_len=8192, max_buckets=5)
    assert more.summary["tuned_mean_over_oracle"] <= result.summary["tuned_mean_over_oracle"]
    assert result.summary["tuned_mean_over_oracle"] <= result.summary["tuned_max_over_oracle"]


def _charge(ratio, weight, tolerance=1.02):
    return ratio + weight * max(0.0, ratio - tolerance)


def _brute_force(times, splits_for, contexts, max_model_len, max_buckets, per_batch,
                 weight=0.0):
    """Every partition into <= max_buckets groups, every hint 1..max_model_len per group (per
    batch size with ``per_batch``, else one hint for all); the objective's minimum."""
    oracle = {(c, b): min(us for (c2, b2, _), us in times.items() if (c2, b2) == (c, b))
              for c, b, _ in times}
    batches = sorted({b for _, b, _ in times})
    best = None
    for k in range(1, max_buckets + 1):
        for cuts in itertools.combinations(range(1, len(contexts)), k - 1):
            ends = [*cuts, len(contexts)]
            total, start = 0.0, 0
            for end in ends:
                def cost(h, group_batches, s=start, e=end):
                    return sum(_charge(times[(c, b, splits_for(b, h))] / oracle[(c, b)],
                                       weight)
                               for c in contexts[s:e] for b in group_batches)
                span = range(1, max_model_len + 1)
                if per_batch:
                    total += sum(min(cost(h, [b]) for h in span) for b in batches)
                else:
                    total += min(cost(h, batches) for h in span)
                start = end
            best = total if best is None else min(best, total)
    return best


@pytest.mark.parametrize("weight", [0.0, 10.0])
@pytest.mark.parametrize("per_batch", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_dynamic_program_matches_brute_force(seed, per_batch, weight):
    rng = random.Random(100 + seed)
    contexts = [32, 64, 128, 200, 256, 512]
    times = {(c, b, s): rng.uniform(5, 50) for c in contexts for b in (1, 4) for s in SPLITS}
    # batch 4 takes half the budget, as plan_mla_decode's rows do
    splits_for = lambda batch, hint: min(16 // batch if batch > 1 else 16,
                                         pow2_ceil(cdiv(hint, 64)))
    for max_buckets in (1, 2, 3):
        result = choose_ladder(times, splits_for, max_model_len=1024, max_buckets=max_buckets,
                               per_batch_hints=per_batch, excess_weight=weight)
        total = sum(_charge(r["tuned_over_oracle"], weight) for r in result.rows)
        expected = _brute_force(times, splits_for, contexts, 1024, max_buckets, per_batch,
                                weight)
        assert total == pytest.approx(expected, abs=2e-3 * (1 + weight))
        if not per_batch:
            assert all(not b.batch_hints for b in result.ladder)


def test_batch_sizes_that_disagree_get_their_own_hints():
    # Batch 1 wants 4 splits at 256 tokens, batch 8 two: one shared hint cannot serve
    # both, per-batch hints can (same bounds).
    times = {(c, b, s): 20.0 for c in (64, 256) for b in (1, 8) for s in SPLITS}
    times[(64, 1, 1)] = times[(64, 8, 1)] = 10.0
    times[(256, 1, 4)] = times[(256, 8, 2)] = 10.0
    shared = choose_ladder(times, capped_splits(), max_model_len=256, max_buckets=2,
                           per_batch_hints=False)
    assert shared.summary["tuned_max_over_oracle"] == 2.0
    own = choose_ladder(times, capped_splits(), max_model_len=256, max_buckets=2)
    assert own.summary["tuned_max_over_oracle"] == 1.0
    # 128 is the power of two planning 2 splits, 256 plans 4
    assert own.ladder == BucketLadder([Bucket(64, 1), Bucket(256, 256, batch_hints={8: 128})],
                                      256)
    assert own.ladder.hints_for(8) == (1, 128) and own.ladder.hints_for(16) == (1, 128)
    assert own.ladder.hints_for(4) == (1, 256)
    assert BucketLadder.from_json(own.ladder.to_json()) == own.ladder


def test_ties_break_deterministically():
    # Every split count costs the same: one bucket, the smallest hint.
    flat = {(c, 1, s): 7.0 for c in (64, 512, 4096) for s in SPLITS}
    result = choose_ladder(flat, capped_splits(), max_model_len=4096, max_buckets=3)
    assert result.ladder == BucketLadder([Bucket(4096, 1)], 4096)
    # Dict order does not matter.
    items = list(table({64: 1, 128: 1, 256: 4, 512: 16}).items())
    ladders = set()
    for seed in range(5):
        random.Random(seed).shuffle(items)
        ladders.add(choose_ladder(dict(items), capped_splits(), max_model_len=1024,
                                  max_buckets=4).ladder)
    assert ladders == {BucketLadder([Bucket(128, 1), Bucket(256, 256), Bucket(1024, 1024)],
                                    1024)}
    # Equal cost, fewer buckets: four buckets allowed, two suffice, two are used.
    two = choose_ladder(table({64: 1, 128: 1, 256: 1, 512: 16}), capped_splits(),
                        max_model_len=1024, max_buckets=4)
    assert two.ladder == BucketLadder([Bucket(256, 1), Bucket(1024, 1024)], 1024)


def test_objective_is_relative_so_long_contexts_do_not_dominate():
    # Hint 256 (4 splits): short 1.0x, long 1.05x (+50 us). Hint 4096 (64 splits): short 1.5x
    # (+5 us), long 1.0x. Absolute time would pick 4096; relative time picks 256.
    times = {}
    for s in [1, 2, 4, 8, 16, 32, 64]:
        times[(256, 1, s)] = {4: 10.0, 64: 15.0}.get(s, 30.0)
        times[(4096, 1, s)] = {4: 1050.0, 64: 1000.0}.get(s, 3000.0)
    result = choose_ladder(times, capped_splits(64), max_model_len=4096, max_buckets=1)
    assert result.ladder == BucketLadder([Bucket(4096, 256)], 4096)


def test_missing_split_count_is_an_error_not_a_guess():
    times = table({64: 1, 1024: 16})
    del times[(1024, 1, 4)]
    with pytest.raises(ValueError, match="context=1024 batch=1 splits=4"):
        choose_ladder(times, capped_splits(), max_model_len=1024, max_buckets=2)
    with pytest.raises(ValueError, match="above max_model_len"):
        choose_ladder(table({64: 1, 1024: 16}), capped_splits(), max_model_len=512,
                      max_buckets=2)
    with pytest.raises(ValueError, match="every batch"):
        choose_ladder({(64, 1, 1): 1.0, (128, 8, 1): 1.0}, capped_splits(),
                      max_model_len=512, max_buckets=2)


def test_json_round_trip_of_ladder_and_report(tmp_path: Path):
    times = table({64: 1, 128: 1, 256: 4, 512: 16}, batches=(1, 8))
    result = choose_ladder(times, capped_splits(), max_model_len=1024, max_buckets=3,
                           meta={"device": "NVIDIA H200", "num_heads": 16, "date": "today"})
    path = tmp_path / "ladder.json"
    result.ladder.save(path)
    loaded = BucketLadder.load(path)
    assert loaded == result.ladder and loaded.meta == result.ladder.meta
    assert loaded.meta["num_heads"] == 16 and loaded.meta["batch_sizes"] == [1, 8]
    report = {**result.to_dict(), "times": times_to_rows(times)}
    again = json.loads(json.dumps(report))
    assert again == report
    assert BucketLadder.from_dict(again["ladder"]) == result.ladder
    for row in again["rows"]:
        assert {"context", "batch", "oracle_us", "tuned_us", "default_us", "tuned_over_oracle",
                "default_over_oracle"} <= set(row)
    # Re-choosing from the saved table (tune_ladder.py --from-times) gives the same ladder.
    rechosen = choose_ladder(times_from_rows(again["times"]), capped_splits(),
                             max_model_len=1024, max_buckets=3)
    assert rechosen.ladder == result.ladder and rechosen.rows == result.rows


@pytest.mark.parametrize("max_model_len", [131072, 100_000, 64, 5])
def test_the_base_grid_times_every_octave_inside_and_at_both_ends(max_model_len):
    grid = tuning_contexts(max_model_len)
    assert grid[0] == 1 and grid[-1] == max_model_len and grid == sorted(set(grid))
    # Neighbours about a factor sqrt(2) apart from 4 up (rounding: at most 1.5 at the
    # short end), so a bucket of one octave has a measured length inside it; the top
    # closes the grid wherever it falls.
    body = [c for c in grid if c >= 4]
    ratios = [hi / lo for lo, hi in itertools.pairwise(body[:-1])]
    assert all(r <= 1.5 for r in ratios) and all(
        r <= 2 ** 0.5 + 0.01 for lo, r in zip(body[:-2], ratios, strict=True)
        if lo >= 64), ratios
    assert {8, 11, 16, 23} <= set(grid) or max_model_len < 23
    with pytest.raises(ValueError, match="max_model_len"):
        tuning_contexts(0)


def test_measurement_plan_covers_every_hint_the_chooser_may_use():
    contexts = [1, 64, 128, 1000, 131072]
    splits_for = plan_splits(16, num_sms=132)
    hints = hints_to_measure(contexts, 131072, ladders=[default_ladder()])
    assert set(candidate_hints(131072)) <= set(hints) and {1001, 1000, 4096} <= set(hints)
    per_batch = splits_to_measure([1, 8], splits_for, hints)
    assert per_batch[1] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert per_batch[8] == [1, 2, 4, 8, 16, 32, 64]
    for batch in (1, 8):
        assert {splits_for(batch, h) for h in range(1, 131073, 97)} <= set(per_batch[batch])


def toy_us(context: int, batch: int, splits: int, num_sms: int = 132) -> float:
    """Toy H200: bytes / bandwidth, per-program tile latency in waves, a per-split merge."""
    tiles = cdiv(context, 64)
    per_split = cdiv(tiles, splits)  # splits past the tile count are empty and exit early
    waves = cdiv(batch * cdiv(tiles, per_split), 2 * num_sms)
    stage1 = max(waves * (1.0 + 6.0 * per_split), batch * context * 1152 / 4.0e6)
    merge = 0.0 if splits == 1 else 2.0 + 0.004 * batch * splits
    return 3.0 + stage1 + merge


def test_toy_cost_model_tuned_within_three_percent_of_oracle():
    contexts = [1, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 102400,
                131072]
    splits_for = plan_splits(16, num_sms=132)
    hints = hints_to_measure(contexts, 131072, ladders=[default_ladder()])
    per_batch = splits_to_measure([1, 8], splits_for, hints)
    times = {(c, b, s): toy_us(c, b, s) for c in contexts for b in (1, 8) for s in per_batch[b]}
    result = choose_ladder(times, splits_for, max_model_len=131072, max_buckets=6)
    assert len(result.ladder) <= 6
    assert max(r["tuned_over_oracle"] for r in result.rows) <= 1.03
    assert result.summary["tuned_mean_over_oracle"] <= result.summary["default_mean_over_oracle"]
    alone = choose_per_batch(times, splits_for, max_model_len=131072, max_buckets=6)
    assert sorted(alone) == [1, 8]
    for batch, res in alone.items():
        shared = [r["tuned_over_oracle"] for r in result.rows if r["batch"] == batch]
        assert res.summary["tuned_mean_over_oracle"] <= sum(shared) / len(shared) + 1e-4


# ---- shipped ladders ----------------------------------------------------------------------


def _write(directory: Path, name: str, max_model_len: int, heads: int, tag: str,
           **meta) -> None:
    ladder = BucketLadder([Bucket(64, 1), Bucket(4096, 2048), Bucket(max_model_len, 16384)],
                          max_model_len, meta={"num_heads": heads, "tag": tag, **meta})
    ladder.save(directory / name)


def test_device_slugs():
    assert device_slugs("NVIDIA H200") == ["h200"]
    assert device_slugs("NVIDIA H100 80GB HBM3") == ["h100-80gb-hbm3", "h100-80gb", "h100"]
    assert device_slugs("AMD Instinct MI355X") == ["mi355x"]
    with pytest.raises(ValueError, match="no model word"):
        device_slugs("NVIDIA")


def test_find_tuned_ladder_picks_device_and_heads(tmp_path: Path):
    _write(tmp_path, "h200-h16.json", 131072, 16, "h200/16")
    _write(tmp_path, "h200-h12.json", 131072, 12, "h200/12")
    _write(tmp_path, "h100-h16.json", 131072, 16, "h100/16")
    _write(tmp_path, "h100-80gb-hbm3-h16.json", 131072, 16, "h100-hbm3/16")

    def tag(name, heads, top=131072):
        ladder = find_tuned_ladder(name, heads, top, directory=tmp_path)
        return None if ladder is None else ladder.meta["tag"]

    assert tag("NVIDIA H200", 16) == "h200/16"
    assert tag("NVIDIA H200", 12) == "h200/12"
    assert tag("NVIDIA H200 NVL", 16) == "h200/16"  # falls back to the shorter slug
    assert tag("NVIDIA H100 80GB HBM3", 16) == "h100-hbm3/16"  # the specific file wins
    assert tag("NVIDIA H100 PCIe", 16) == "h100/16"
    assert tag("NVIDIA H200", 8) is None
    assert tag("NVIDIA A100-SXM4-80GB", 16) is None
    assert tag("NVIDIA H200", 16, top=262144) is None  # never stretched past what was measured


def test_find_tuned_ladder_clips_to_a_smaller_max_model_len(tmp_path: Path):
    _write(tmp_path, "h200-h16.json", 131072, 16, "x")
    ladder = find_tuned_ladder("NVIDIA H200", 16, 3000, directory=tmp_path)
    assert ladder == BucketLadder([Bucket(64, 1), Bucket(3000, 2048)], 3000)
    assert ladder.meta["clipped_from"] == 131072
    assert clip_ladder(ladder, 1000) == BucketLadder([Bucket(64, 1), Bucket(1000, 1000)], 1000)
    # tuned hints above their bucket's top survive a clip unless above the new top
    over = BucketLadder([Bucket(128, 512, batch_hints={8: 1}), Bucket(4096, 2048)], 4096)
    assert clip_ladder(over, 1000) == BucketLadder(
        [Bucket(128, 512, batch_hints={8: 1}), Bucket(1000, 1000)], 1000)


def test_find_tuned_ladder_rejects_a_mislabelled_file(tmp_path: Path):
    _write(tmp_path, "h200-h16.json", 131072, 12, "x")
    with pytest.raises(ValueError, match="num_heads=12"):
        find_tuned_ladder("NVIDIA H200", 16, 131072, directory=tmp_path)


def test_shipped_ladders_load_and_match_their_names():
    shipped = sorted(LADDER_DIR.glob("*-h*.json"))
    assert shipped
    for path in shipped:
        ladder = BucketLadder.load(path)
        slug, heads, fmt = parse_ladder_file_name(path.name)
        q_len, sparse = parse_q_len(path.name), parse_sparse(path.name)
        assert ladder.meta["num_heads"] == heads
        assert ladder.meta.get("kv_cache", "bf16") == fmt
        assert ladder.meta.get("q_len", 1) == q_len
        assert (ladder.meta.get("decoder") == "sparse") == sparse
        found = find_tuned_ladder(slug, heads, ladder.max_model_len, kv_cache_format=fmt,
                                  q_len=q_len,
                                  sparse_topk=ladder.meta["topk"] if sparse else None)
        assert found == ladder and "kv_cache_fallback" not in found.meta


def test_ladder_file_names_per_cache_format():
    assert ladder_file_name("h200", 16) == "h200-h16.json"
    assert ladder_file_name("h200", 16, "fp8-tensor") == "h200-h16-fp8-tensor.json"
    assert ladder_file_name("h100-80gb", 12, "fp8-v32") == "h100-80gb-h12-fp8-v32.json"
    for args in (("h200", 16, "bf16"), ("h100-80gb", 12, "fp8-v32"), ("mi355x", 128,
                                                                       "fp8-tensor")):
        assert parse_ladder_file_name(ladder_file_name(*args)) == args
    with pytest.raises(ValueError, match="kv_cache_format"):
        ladder_file_name("h200", 16, "fp8")


def test_fp8_ladders_are_found_by_format_and_fall_back_to_bf16(tmp_path: Path, caplog):
    _write(tmp_path, "h200-h16.json", 131072, 16, "bf16")
    _write(tmp_path, "h200-h16-fp8-v32.json", 131072, 16, "v32", kv_cache="fp8-v32")

    def find(fmt, heads=16, name="NVIDIA H200"):
        return find_tuned_ladder(name, heads, 131072, kv_cache_format=fmt, directory=tmp_path)

    assert find("bf16").meta["tag"] == "bf16"
    assert find("fp8-v32").meta["tag"] == "v32"
    assert "kv_cache_fallback" not in find("fp8-v32").meta
    with caplog.at_level("WARNING", logger="graphbucket.tuning.shipped"):
        fallback = find("fp8-tensor", name="NVIDIA H200 NVL")
        again = find("fp8-tensor", name="NVIDIA H200 NVL")
    assert fallback.meta["tag"] == "bf16" and fallback.meta["kv_cache_fallback"] == "fp8-tensor"
    assert again == fallback
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "fp8-tensor" in notes[0] and "--kv-cache fp8-tensor" in notes[0]
    assert find("fp8-tensor", heads=12) is None  # no bf16 ladder to fall back to either


def test_find_tuned_ladder_rejects_a_file_of_another_cache_format(tmp_path: Path):
    _write(tmp_path, "h200-h16-fp8-tensor.json", 131072, 16, "x", kv_cache="fp8-v32")
    with pytest.raises(ValueError, match="kv_cache='fp8-v32'"):
        find_tuned_ladder("NVIDIA H200", 16, 131072, kv_cache_format="fp8-tensor",
                          directory=tmp_path)
    _write(tmp_path, "h200-h16.json", 131072, 16, "x", kv_cache="fp8-v32")
    with pytest.raises(ValueError, match="named for bf16"):
        find_tuned_ladder("NVIDIA H200", 16, 131072, directory=tmp_path)


def test_tune_ladder_from_times_keeps_the_cache_format(tmp_path: Path, capsys):
    script = load_script("tune_ladder")
    contexts = [64, 1024, 4096]
    splits_for = plan_splits(16, num_sms=132)
    hints = hints_to_measure(contexts, 4096, ladders=[default_ladder(4096)])
    per_batch = splits_to_measure([1], splits_for, hints)
    times = {(c, 1, s): toy_us(c, 1, s) for c in contexts for s in per_batch[1]}
    meta = {"gpu": "NVIDIA H200", "num_sms": 132, "num_heads": 16, "batches": [1],
            "contexts": contexts, "command": "x", "date": "d", "torch": "t", "triton": "t",
            "kv_cache": "fp8-v32"}
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"meta": meta, "times": times_to_rows(times)}))
    out = tmp_path / "h200-h16-fp8-v32.json"
    script.main(["--from-times", str(report), "--max-model-len", "4096", "--out", str(out),
                 "--report", str(tmp_path / "again.json"), "--quiet"])
    ladder = BucketLadder.load(out)
    assert ladder.meta["kv_cache"] == "fp8-v32"
    assert find_tuned_ladder("NVIDIA H200", 16, 4096, kv_cache_format="fp8-v32",
                             directory=tmp_path) == ladder
    assert "fp8-v32 cache" in (tmp_path / "again.md").read_text()
    with pytest.raises(SystemExit, match="fp8-v32 cache, not --kv-cache fp8-tensor"):
        script.main(["--from-times", str(report), "--max-model-len", "4096",
                     "--kv-cache", "fp8-tensor"])


def _tune_script():
    return load_script("tune_ladder")


def _saved_report(tmp_path: Path, kv_cache: str) -> Path:
    contexts = [64, 1024, 4096]
    splits_for = plan_splits(16, num_sms=132)
    hints = hints_to_measure(contexts, 4096, ladders=[default_ladder(4096)])
    per_batch = splits_to_measure([1, 8], splits_for, hints)
    times = {(c, b, s): toy_us(c, b, s) for b in (1, 8) for c in contexts for s in per_batch[b]}
    meta = {"gpu": "NVIDIA H200", "num_sms": 132, "num_heads": 16, "batches": [1, 8],
            "contexts": contexts, "command": "x", "date": "2026-11-30 23:30 UTC",
            "torch": "t", "triton": "t", "kv_cache": kv_cache}
    path = tmp_path / "saved.json"
    path.write_text(json.dumps({"meta": meta, "times": times_to_rows(times)}))
    return path


def test_tune_ladder_outputs_are_not_replaced_without_force(tmp_path: Path, capsys):
    script = _tune_script()
    saved = _saved_report(tmp_path, "bf16")
    out, report = tmp_path / "ladder.json", tmp_path / "report.json"
    report.with_suffix(".md").write_text("committed")
    args = ["--from-times", str(saved), "--max-model-len", "4096", "--out", str(out),
            "--report", str(report), "--quiet"]
    with pytest.raises(SystemExit) as e:
        script.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert str(report.with_suffix(".md")) in err and "--force" in err
    assert not out.exists() and not report.exists()  # refused before writing anything
    assert report.with_suffix(".md").read_text() == "committed"
    script.main([*args, "--force"])
    assert out.exists() and report.with_suffix(".md").read_text().startswith("# Tuned ladder")


@pytest.mark.parametrize("kv_cache", ["bf16", "fp8-v32"])
def test_tune_ladder_figure_names_format_heads_and_batches(tmp_path: Path, kv_cache: str):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    script = _tune_script()
    saved = _saved_report(tmp_path, kv_cache)
    report = tmp_path / "report.json"
    script.main(["--from-times", str(saved), "--max-model-len", "4096", "--report",
                 str(report), "--plot", str(tmp_path / "f.png"), "--quiet"])
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads(report.read_text())
    fig = script.plot_figure(data, plt)
    title = fig._suptitle.get_text()
    # The three committed figures of one GPU differ by cache format and heads: both named.
    assert f"16 heads, {kv_cache} cache, q_len 1, batch 1 and 8" in title
    assert "measured 2026-11-30 23:30 UTC" in title  # when measured, not when re-plotted
    assert [ax.get_title() for ax in fig.axes[:2]] == ["batch 1", "batch 8"]
    (legend,) = fig.legends
    labels = {t.get_text() for t in legend.get_texts()}
    assert {"tuned bucket bounds", "3 % above the oracle"} <= labels
    assert any(lab.startswith("tuned ladder (") for lab in labels)
    for ax in fig.axes:
        for line in ax.get_lines():
            assert line.get_label() in labels or line.get_label().startswith("_"), \
                line.get_label()
    plt.close(fig)


# ---- timing the plans hints capture, at every capture size ---------------------------------


def plan_toy_us(context: int, plan) -> float:
    """``toy_us`` of a plan, with a fused merge 3 us cheaper than the merge kernel."""
    us = toy_us(context, plan.batch_size, plan.num_kv_splits)
    return us - 3.0 if plan.merges_in_stage1 else us


def test_plans_to_measure_lists_each_distinct_plan_a_hint_captures():
    plan_for = hint_plans(16, num_sms=132)
    hints = hints_to_measure([1, 64, 4096, 131072], 131072)
    plans = plans_to_measure([8, 64], plan_for, hints)
    for batch in (8, 64):
        captured = {plan_for(batch, h) for h in range(1, 131073, 61)}
        assert captured <= set(plans[batch].values())  # every capturable plan is timed
        assert all(label == p.describe() for label, p in plans[batch].items())
    # Batch 64 x 4 splits: merged in stage 1 (hint <= 4K); 8 splits: the merge kernel.
    assert [p.num_kv_splits for p in plans[64].values()] == [1, 2, 4, 8]
    assert plans[64][plan_for(64, 4096).describe()].merges_in_stage1
    # Batch 8 at 32 splits: the page-ahead stream up to 64K, the plain one at 128K.
    assert plan_for(8, 65536) != plan_for(8, 131072)
    assert [p.num_kv_splits for p in plans[8].values()].count(32) == 2


def test_q_len_plans_fold_the_tokens_into_the_heads():
    assert hint_plans(16, q_len=4)(8, 4096) == hint_plans(64)(8, 4096)
    assert hint_plans(16, q_len=4)(8, 4096).block_h == 64
    with pytest.raises(ValueError, match="q_len must be a positive int, got 0"):
        hint_plans(16, q_len=0)


def test_choosing_over_plans_prefers_the_fused_plan_the_split_table_cannot_see():
    contexts = [256, 1024, 4096, 16384, 131072]
    plan_for = hint_plans(16, num_sms=132)
    hints = hints_to_measure(contexts, 131072, ladders=[default_ladder()])
    plans = plans_to_measure([1, 64], plan_for, hints)
    times = {(c, b, label): plan_toy_us(c, p) for c in contexts for b in (1, 64)
             for label, p in plans[b].items()}
    result = choose_ladder(times, plan_variants(plan_for), max_model_len=131072,
                           max_buckets=4)
    assert max(r["tuned_over_oracle"] for r in result.rows) == 1.0
    for r in result.rows:  # every row names the plans, and the oracle is their minimum
        at = [us for (c, b, _), us in times.items() if (c, b) == (r["context"], r["batch"])]
        assert r["oracle_us"] == min(at)
        assert r["tuned_plan"].startswith(f"splits={r['tuned_splits']} ")
    at_4k = next(r for r in result.rows if (r["context"], r["batch"]) == (4096, 64))
    assert "+merge(last split" in at_4k["tuned_plan"]  # 4 splits merged in stage 1
    rows = times_to_rows(times)
    assert times_from_rows(json.loads(json.dumps(rows))) == {
        k: round(us, 4) for k, us in times.items()}
    assert all(r["plan"].startswith(f"splits={r['splits']} ") for r in rows)


def test_refinement_adds_midpoints_only_where_the_best_split_count_changes():
    best = {64: 1, 256: 1, 1024: 4, 4096: 4, 16384: 16}
    times = table(best, batches=(1, 8))
    assert refine_contexts(times, 8) == [512, 8192]  # sqrt(256 x 1024), sqrt(4096 x 16384)
    assert refine_contexts(times, 1) == [512]  # the widest gap first: ties go to the lower
    assert refine_contexts(table({64: 1, 65: 2}), 8) == []  # no integer between


def test_refinement_goes_first_where_one_plan_cannot_serve_both_ends():
    # Both gaps change the best split count; at the short one the two plans are within
    # 1 % of each other at both ends, at the long one each loses 30 % at the other end.
    times = {(c, 1, s): us for c, row in {
        64: {1: 10.0, 4: 10.1}, 256: {1: 10.1, 4: 10.0},
        4096: {4: 10.0, 16: 13.0}, 16384: {4: 13.0, 16: 10.0}}.items()
        for s, us in row.items()}
    assert refine_contexts(times, 1) == [8192]  # sqrt(4096 x 16384), though not the shorter
    assert refine_contexts(times, 2) == [128, 8192]


@pytest.mark.host
def test_refinement_runs_in_rounds_until_it_brackets_the_crossing():
    # 256 splits win below 4500 tokens, 128 above: the first round's midpoint of 4096 and
    # 5793 (4871) is already past the crossing, so only a second round measures inside it.
    def us(c, s):
        return (10.0 if c < 4500 else 11.0) if s == 256 else (10.5 if c < 4500 else 10.0)

    times, rounds = {}, []

    def measure(new, contexts):
        rounds.append(new)
        times.update({(c, 1, s): us(c, s) for c in new for s in (128, 256)})

    measure([4096, 5793], [4096, 5793])
    rounds.clear()
    got = _tune_script().refinement_rounds(times, [4096, 5793], 3, lambda new: [c + 1 for c in new],
                                           measure)
    assert rounds[0] == [4871, 4872] and len(rounds) == 3  # edges do not count against 3
    assert 4467 in got and all(c in got for r in rounds for c in r)
    mids = [c for r in rounds for c in r if c - 1 not in r]
    assert len(mids) == 3 and max(c for c in mids if us(c, 256) < us(c, 128)) < 4500 < min(
        c for c in mids if us(c, 128) < us(c, 256))
    times.clear()
    measure([4096, 5793], [4096, 5793])
    assert _tune_script().refinement_rounds(times, [4096, 5793], 0, None, measure) == [4096, 5793]


def test_dry_run_counts_measurements_for_every_capture_size(capsys):
    script = _tune_script()
    script.main(["--dry-run", "--heads", "16"])
    out = capsys.readouterr().out
    per_batch = [int(line.split(":")[1].split()[0]) for line in out.splitlines()
                 if line.startswith("  batch ")]
    assert len(per_batch) == len(script.CAPTURE_SIZES)
    count = int(out.split(" measurements, about ")[0].rsplit("\n", 1)[-1])
    # Each context of the grid and, below max_model_len, its context + 1 (the edges).
    assert count == (2 * len(script.CONTEXTS) - 1) * sum(per_batch)
    seconds = float(out.split(" measurements, about ")[1].split(" s")[0])
    assert 0 < seconds <= 300  # the 5-minute goal
    script.main(["--dry-run", "--heads", "128", "--q-len", "2", "--batches", "1", "64",
                 "--contexts", "4096", "131072"])
    out = capsys.readouterr().out
    assert "128 heads, q_len 2" in out and "batch 64:" in out and "batch 8:" not in out


def test_a_plan_keyed_report_rechooses_the_same_ladder(tmp_path: Path):
    script = _tune_script()
    contexts = [64, 1024, 4096]
    plan_for = hint_plans(16, num_sms=132, q_len=2)
    plans = plans_to_measure([1, 8], plan_for,
                             hints_to_measure(contexts, 4096, ladders=[default_ladder(4096)]))
    times = {(c, b, label): plan_toy_us(c, p) for c in contexts for b in (1, 8)
             for label, p in plans[b].items()}
    meta = {"gpu": "NVIDIA H200", "num_sms": 132, "num_heads": 16, "batches": [1, 8],
            "contexts": contexts, "command": "x", "date": "d", "torch": "t", "triton": "t",
            "kv_cache": "bf16", "q_len": 2, "timed": "plans"}
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"meta": meta, "times": times_to_rows(times)}))
    out = tmp_path / "h200-h16.json"
    script.main(["--from-times", str(saved), "--q-len", "2", "--max-model-len", "4096",
                 "--out", str(out), "--report", str(tmp_path / "r.json"), "--quiet"])
    ladder = BucketLadder.load(out)
    expected = choose_ladder(times, plan_variants(plan_for), max_model_len=4096,
                             max_buckets=6)
    assert ladder.bounds == expected.ladder.bounds and ladder.meta["q_len"] == 2
    assert "q_len 2" in (tmp_path / "r.md").read_text()
    with pytest.raises(SystemExit, match="measured at q_len 2, not --q-len 1"):
        script.main(["--from-times", str(saved), "--max-model-len", "4096"])


def test_the_report_says_what_each_timing_phase_cost(tmp_path: Path):
    from graphbucket.tuning.report import cost_lines

    meta = {"measured_s": 157.4, "estimate_s": 251.6, "ragged_measured_s": 150.2,
            "step_ties_s": 9.8}
    text = cost_lines(meta)[0]
    assert "split-KV table 157 s (estimated 252)" in text
    assert "ragged mixes 150 s" in text and "step ties 10 s" in text
    assert "317 s in all" in text
    table_only = cost_lines({k: meta[k] for k in ("measured_s", "estimate_s")})[0]
    assert "ragged" not in table_only and "157 s in all" in table_only
    assert cost_lines({}) == []  # a report from before the cost was recorded
    # Re-chosen from a saved report, the cost is the saved measurement's, written again.
    script = _tune_script()
    contexts = [64, 1024, 4096]
    plans = plans_to_measure([1, 8], hint_plans(16, num_sms=132),
                             hints_to_measure(contexts, 4096, ladders=[default_ladder(4096)]))
    times = {(c, b, label): plan_toy_us(c, p) for c in contexts for b in (1, 8)
             for label, p in plans[b].items()}
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"meta": {
        "gpu": "NVIDIA H200", "num_sms": 132, "num_heads": 16, "batches": [1, 8],
        "contexts": contexts, "command": "x", "date": "d", "torch": "t", "triton": "t",
        "kv_cache": "bf16", "q_len": 1, "timed": "plans", "measured_s": 40.0,
        "estimate_s": 50.0}, "times": times_to_rows(times)}))
    script.main(["--from-times", str(saved), "--max-model-len", "4096", "--out",
                 str(tmp_path / "h200-h16.json"), "--report", str(tmp_path / "r.json"),
                 "--quiet"])
    assert "Timing cost: split-KV table 40 s (estimated 50); 40 s in all" in (
        tmp_path / "r.md").read_text()


def test_ladder_file_names_for_128_heads_and_verify_steps_round_trip():
    assert ladder_file_name("h200", 128) == "h200-h128.json"
    assert ladder_file_name("h200", 16, "fp8-v32", q_len=2) == "h200-h16-fp8-v32-q2.json"
    assert parse_ladder_file_name("h200-h16-fp8-v32-q2.json") == ("h200", 16, "fp8-v32")
    assert parse_ladder_file_name("h200-h128.json") == ("h200", 128, "bf16")
    from graphbucket.tuning.shipped import parse_q_len

    assert parse_q_len("h200-h16-q4.json") == 4 and parse_q_len("h200-h16.json") == 1
    with pytest.raises(ValueError, match="q_len must be a positive int, got 0"):
        ladder_file_name("h200", 16, q_len=0)
    for path in LADDER_DIR.glob("*.json"):  # every shipped file still loads
        BucketLadder.load(path)


def test_edges_are_each_context_plus_one_and_bounds_keep_to_measured_edges():
    assert edge_contexts([1, 2, 64, 128, 4096], 4096) == [3, 65, 129]
    assert bounds_with_edges([1, 2, 3, 64, 65, 128, 4096]) == [1, 2, 64]


def test_a_bucket_is_scored_at_its_first_length_where_the_edge_was_measured():
    # At 512, 8 splits are best and 2 nearly so; at 257, the first length above a bound at
    # 256, 8 splits take twice the best time and 2 splits 1.1x. Measured at 512 alone, the
    # bucket above 256 takes 8 splits; with 257 measured too it takes 2.
    us = {128: {1: 10}, 129: {1: 10}, 256: {1: 10}, 257: {1: 10, 2: 11},
          512: {8: 10, 2: 10.5, 1: 14}}
    times = {(c, 1, s): us[c].get(s, 20.0) for c in us for s in SPLITS}
    grid = {k: v for k, v in times.items() if k[0] in (128, 256, 512)}
    plain = choose_ladder(grid, capped_splits(), max_model_len=512, max_buckets=2)
    assert plain.ladder.bounds == (256, 512)
    top = plain.ladder.hint_for(plain.ladder.bucket_for(257), 1)
    assert capped_splits()(1, top) == 8  # twice the best time at 257, never measured there
    edged = choose_ladder(times, capped_splits(), max_model_len=512, max_buckets=2,
                          bounds_at=bounds_with_edges(us))
    assert edged.ladder.bounds == (256, 512)
    row = next(r for r in edged.rows if r["context"] == 257)
    assert (row["tuned_splits"], row["tuned_over_oracle"]) == (2, 1.1)
    assert next(r for r in edged.rows if r["context"] == 512)["tuned_over_oracle"] == 1.05


def test_bounds_fall_only_where_allowed():
    best = {64: 1, 128: 1, 256: 1, 512: 16, 1024: 16, 2048: 16}
    result = choose_ladder(table(best), capped_splits(), max_model_len=2048, max_buckets=3,
                           bounds_at=[128, 1024])
    assert set(result.ladder.bounds[:-1]) <= {128, 1024}


def test_a_timed_plan_the_timers_workspace_does_not_cover_is_refused_before_a_launch():
    # The timed calls skip the launch checks; a balanced plan with more work items than the
    # workspace holds would write past its item buffers.
    import torch

    from graphbucket.kernels import SplitWorkspace
    from graphbucket.plan import plan_balanced_mla_decode
    from graphbucket.tuning.measure import rotated_calls

    plan = plan_balanced_mla_decode(32, 16, num_sms=132)
    small = SplitWorkspace.allocate(32, 16, 1, 512, "cpu", max_items=plan.max_work_items - 1)
    with pytest.raises(ValueError, match="does not cover"):
        rotated_calls(None, None, None, None, None, small, plan, 0.1)
    enough = SplitWorkspace.allocate(32, 16, 1, 512, "cpu", max_items=plan.max_work_items)
    assert callable(rotated_calls(None, None, None, None, None, enough, plan, 0.1))
    assert torch.is_tensor(enough.item_o)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["default", "seesaw", "seesaw-charged"])
def test_rotated_balanced_calls_partition_once_and_match_calls_that_each_partition(kernel):
    """The timer's graph body partitions a balanced step in its first call only (as a
    step's layers do); every rotation's output equals a call that partitions itself."""
    import torch

    from graphbucket.backends.triton import TritonBackend
    from graphbucket.kernels import SplitWorkspace, default_sm_scale, mla_decode_balanced
    from graphbucket.tuning.measure import Problem, rotated_calls

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    lens = [9000, 1, 0, 700, 64, 20000, 65, 3000]
    backend = TritonBackend(num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    kernels = backend.balanced_kernels(128)
    if kernel not in kernels:
        pytest.skip(f"{kernel} is not offered here")
    plan = backend.plan_balanced(len(lens), 128, kernel)
    problem = Problem(sum(lens) * 4, 128, max_requests=len(lens))
    tables, q, out, seq_lens = problem.ragged_inputs(lens)
    ws = SplitWorkspace.allocate(len(lens), 128, 1, 512, "cuda", max_items=plan.max_work_items)
    scale = default_sm_scale()
    rotated_calls(problem, tables, q, out, seq_lens, ws, plan, scale)()
    for r in range(tables.shape[0]):
        want = torch.empty_like(out[r])
        mla_decode_balanced(q[r], problem.cache, tables[r], seq_lens, want, ws, plan=plan,
                            sm_scale=scale)
        assert torch.equal(out[r], want), (r, plan.describe())
    assert tables.shape[0] > 1  # more than one rotation: the reuse was exercised


def test_plans_that_disagree_are_not_timed():
    import torch

    from graphbucket.tuning.measure import AGREEMENT_RTOL, check_outputs_agree

    gen = torch.Generator().manual_seed(4)
    exact = torch.randn(8, 16, 512, generator=gen, dtype=torch.float64)
    # Two correct bf16 kernels: the same values, each rounded its own way (1e-2 apart).
    near = (exact * (1 + 5e-3 * torch.randn(exact.shape, generator=gen,
                                           dtype=torch.float64))).to(torch.bfloat16)
    check_outputs_agree({"split": exact.to(torch.bfloat16), "balanced": near})
    wrong = exact.clone()
    wrong[3] = exact[4]  # one request attended another's rows
    with pytest.raises(RuntimeError, match="plan 'charged' gives an output .* from plan 'split'"):
        check_outputs_agree({"split": exact.to(torch.bfloat16), "ok": near,
                             "charged": wrong.to(torch.bfloat16)})
    unwritten = exact.clone()
    unwritten[0, 0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="nan"):
        check_outputs_agree({"split": exact, "balanced": unwritten})
    assert AGREEMENT_RTOL < 0.1
