"""bench/ladder_oracle.py's host logic: the grid, the plans the ladder replays, the oracle."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from bench.ladder_oracle import (
    FLAG_ABOVE,
    confirmed,
    exhaustive_plans,
    ladder_plan,
    markdown,
    needs_confirming,
    oracle_contexts,
    oracle_row,
    ragged_mixes,
    settled_ratio,
    shapes,
)
from graphbucket import get_backend
from graphbucket.ladder import Bucket, BucketLadder, default_ladder
from graphbucket.select import GraphSelector
from graphbucket.tuning.grid import edge_contexts, tuning_contexts

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.host
TUNED = [1, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 102400, 131072]


def backend():
    return get_backend("triton", num_sms=132)


def test_the_grid_is_out_of_sample_and_spans_1_to_128k():
    grid = oracle_contexts(131072, TUNED)
    assert not set(grid) & set(TUNED)
    assert grid[0] == 2 and grid[-1] == 131071 and {215, 110218, 65537} <= set(grid)
    assert grid == sorted(set(grid))
    # Against the tuner's own grid and its edges: a point inside every octave still.
    tuned = tuning_contexts(131072)
    tuned = set(tuned) | set(edge_contexts(tuned, 131072))
    grid = oracle_contexts(131072, sorted(tuned))
    assert not set(grid) & tuned and grid[0] == 3
    assert all(any(1 << k < c < 1 << (k + 1) for c in grid) for k in range(3, 17))


def test_mixes_scale_with_the_batch_and_keep_one_long_request():
    assert ragged_mixes(1, 131072) == []
    mixes = dict(ragged_mixes(64, 131072))
    assert mixes["long-among-short"] == [131072] + [1024] * 63
    assert len(mixes["spread-128k"]) == 64 and max(mixes["spread-128k"]) == 131072
    assert max(mixes["spread-8k"]) == 8192 and "spread-8k" not in dict(ragged_mixes(2, 131072))
    assert all(len(lens) == 8 for _, lens in ragged_mixes(8, 131072))
    # Verify steps get no mixes (balanced decodes one token) and no length below q_len.
    rows = shapes([1, 8], 131072, TUNED, q_len=4)
    assert {mix for _, mix, _ in rows} == {"uniform"} and min(
        lens[0] for _, _, lens in rows) >= 4


def test_the_oracle_set_holds_every_plan_a_hint_captures_and_balanced():
    b = backend()
    plans = exhaustive_plans(b, 64, 16, 131072)
    for hint in (1, 100, 4096, 5000, 65536, 131072):
        assert b.plan(64, 16, hint) in plans.values()
    # Balanced with each kernel the backend offers: at 16 heads the default, the seesaw over
    # work items, over tile ranges (equal, and cut by work) and over fitted items; at 128
    # heads (the default is the seesaw) four.
    assert {p for p in plans.values() if p.balanced} == {
        b.plan_balanced(64, 16, k) for k in b.balanced_kernels(16)} and len(
        b.balanced_kernels(16)) == 5
    assert sum(p.balanced for p in exhaustive_plans(b, 64, 128, 131072).values()) == 4
    assert not any(p.balanced for p in exhaustive_plans(b, 64, 16, 131072, q_len=2).values())
    assert all(p.num_heads == 32 for p in exhaustive_plans(b, 8, 16, 131072, q_len=2).values())


def test_the_ladder_plan_is_the_runners_including_balanced_for_ragged_batches():
    b = backend()
    ladder = BucketLadder([Bucket(4096, 4096, batch_hints={64: 1024}),
                           Bucket(131072, 131072, balanced_imbalance=1.5)], 131072)
    selector = GraphSelector(ladder, [1, 8, 64])
    assert ladder_plan(selector, b, 16, [3000] * 64) == b.plan(64, 16, 1024)
    assert ladder_plan(selector, b, 16, [3000]) == b.plan(1, 16, 4096)
    assert ladder_plan(selector, b, 16, [100000] * 8) == b.plan(8, 16, 131072)
    ragged = ladder_plan(selector, b, 16, [131072] + [1024] * 63)
    assert ragged.balanced and ragged == b.plan_balanced(64, 16)
    # The ladder's balanced kernel for the capture size is the one replayed.
    seesaw = GraphSelector(ladder.with_balanced_kernels({64: "seesaw"}), [1, 8, 64])
    assert ladder_plan(seesaw, b, 16, [131072] + [1024] * 63) == b.plan_balanced(64, 16, "seesaw")
    assert ladder_plan(seesaw, b, 16, [131072] + [1024] * 7) == b.plan_balanced(8, 16)
    # Padding: 5 requests replay the batch-8 graph.
    assert ladder_plan(selector, b, 16, [3000] * 5).batch_size == 8
    assert ladder_plan(GraphSelector(default_ladder(), [2]), b, 16, [10, 10], 1) == b.plan(
        2, 16, 64)


def test_the_row_takes_the_minimum_and_the_table_lists_rows_above_the_target():
    b = backend()
    fast, slow, fixed = b.plan(8, 16, 1), b.plan(8, 16, 4096), b.plan(8, 16, 131072)
    times = {fast.describe(): 10.0, slow.describe(): 10.5, fixed.describe(): 20.0}
    config = {"heads": 16, "kv_format": "bf16", "q_len": 1, "batch": 8, "mix": "uniform"}
    good = oracle_row(times, ladder=fast, fixed_max=fixed, context=100, **config)
    bad = oracle_row(times, ladder=slow, fixed_max=fixed, context=3000, **config)
    assert good["oracle_us"] == 10.0 and good["oracle_plan"] == fast.describe()
    assert good["ladder_over_oracle"] == 1.0 and bad["ladder_over_oracle"] == 1.05
    assert bad["fixed_max_us"] == 20.0 and bad["fixed_max_over_oracle"] == 2.0
    meta = {"gpu": "g", "date": "d", "torch": "t", "triton": "t", "command": "c",
            "ladder_source": "x"}
    text = markdown({"meta": meta, "rows": [good, bad]})
    assert f"Rows above {FLAG_ABOVE}: 1 of 2 in the first pass." in text
    assert ("| 16 | bf16 | 1 | 8 | 2 | 1.050 | uniform 3000 | 1.050 (uniform 3000) | 2.000 |"
            in text)
    assert f"| 3000 | 10.5 | 10.0 | 1.050 | - | {slow.describe()} |" in text
    assert "| 100 | 10.0 |" not in text
    with pytest.raises(KeyError):  # the ladder's plan must have been timed
        oracle_row({fast.describe(): 1.0}, ladder=slow, fixed_max=fixed, **config)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib not installed")
def test_the_committed_oracle_renders_with_every_batch_in_its_panel(tmp_path):
    import json

    from bench.ladder_oracle import plot

    result = json.loads((ROOT / "bench/results/h200-ladder-oracle.json").read_text())
    path = tmp_path / "oracle.png"
    assert plot(result, str(path))
    assert path.stat().st_size > 10_000


def test_a_flagged_row_of_another_plan_is_settled_by_its_second_timing():
    b = backend()
    fast, slow, fixed = b.plan(8, 16, 1), b.plan(8, 16, 4096), b.plan(8, 16, 131072)
    config = {"heads": 16, "kv_format": "bf16", "q_len": 1, "batch": 8, "mix": "uniform"}
    times = {fast.describe(): 10.0, slow.describe(): 10.5, fixed.describe(): 20.0}
    near = oracle_row({**times, slow.describe(): 10.1}, ladder=slow, fixed_max=fixed,
                      context=2000, **config)
    same = oracle_row(times, ladder=fast, fixed_max=fixed, context=100, **config)
    bad = oracle_row(times, ladder=slow, fixed_max=fixed, context=3000, **config)
    # Within the target, or the oracle's own plan (ratio 1 by construction): no second look.
    assert not needs_confirming(near) and not needs_confirming(same)
    assert needs_confirming(bad)
    # The second timing, of the two plans alone, is what the row stands at.
    noise = confirmed(bad, {slow.describe(): 10.12, fast.describe(): 10.0})
    real = confirmed(bad, {slow.describe(): 10.6, fast.describe(): 10.0})
    assert noise["ladder_over_oracle"] == 1.05 and noise["ladder_over_oracle_confirmed"] == 1.012
    assert settled_ratio(noise) == 1.012 and settled_ratio(real) == 1.06
    assert settled_ratio(near) == near["ladder_over_oracle"]
    meta = {"gpu": "g", "date": "d", "torch": "t", "triton": "t", "command": "c",
            "ladder_source": "x"}
    text = markdown({"meta": meta, "rows": [near, noise]})
    assert (f"Rows above {FLAG_ABOVE}: 1 of 2 in the first pass; 0 after timing the 1 flagged "
            "pairs") in text
    assert "| 1.050 | uniform 3000 | 1.012 (uniform 3000) | 2.000 |" in text
    assert f"| 3000 | 10.5 | 10.0 | 1.050 | 1.012 | {slow.describe()} |" in text
    text = markdown({"meta": meta, "rows": [near, real]})
    assert "; 1 after timing the 1 flagged pairs" in text
