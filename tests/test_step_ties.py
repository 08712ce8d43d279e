"""Near-ties re-ranked by the decode step: which cells are re-timed, what a step timing
changes in the ladder, and that a saved report replays it (``graphbucket.tuning.step_ties``,
``scripts/tune_ladder.py --step-ties``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from graphbucket.ladder import Bucket, BucketLadder
from graphbucket.tuning.step_ties import (
    retime,
    saved_step_ms,
    tie_cells,
    with_batch_hint,
)
from tests.script_modules import load_script

TOP = 4096
BATCHES = (1, 8, 64)


def splits_for(batch: int, hint: int) -> str:
    """Plans by hint band (a stand-in for ``plan_variants``): one plan per band."""
    return "a" if hint <= 64 else "b" if hint <= 1024 else "c"


def table(slow_c_at: int | None = None) -> dict:
    """Times of plans a, b, c at each context and batch: b best, c within 1 % of it, a 30 %
    behind; ``slow_c_at``: a context where c is 5 % behind instead."""
    times = {}
    for c in (256, 1024, 2048, 4096):
        for b in BATCHES:
            base = float(c * b)
            times[c, b, "a"] = 1.3 * base
            times[c, b, "b"] = base
            times[c, b, "c"] = (1.05 if c == slow_c_at else 1.01) * base
    return times


def ladder() -> BucketLadder:
    return BucketLadder((Bucket(1024, 512), Bucket(TOP, 512, batch_hints={64: 1024})), TOP)


@pytest.mark.host
def test_cells_are_long_wide_buckets_with_a_plan_within_tolerance_everywhere():
    cells = tie_cells(ladder(), table(), splits_for, batches=BATCHES, from_batch=8,
                      from_context=2048, hints=[32, 512, 1024, 2048, 4096])
    # Bucket 0 ends below from_context; batch 1 is below from_batch. Plan a is 30 % off;
    # hints 2048 and 4096 plan the same c, which is listed once, at its smallest hint.
    assert [(c.batch, c.bucket, c.context, c.chosen, c.candidates) for c in cells] == [
        (8, 1, 4096, 512, ((2048, 1.01),)), (64, 1, 4096, 1024, ((2048, 1.01),))]
    assert cells[0].hints == (512, 2048)
    # c 5 % behind at one tuned context of the bucket: no near-tie there.
    assert tie_cells(ladder(), table(slow_c_at=2048), splits_for, batches=BATCHES,
                     from_batch=8, from_context=2048, hints=[32, 512, 2048]) == []
    # At 1024 bucket 0 is long enough, and c is within tolerance there too.
    low = tie_cells(ladder(), table(), splits_for, batches=BATCHES, from_batch=64,
                    from_context=1024, hints=[32, 512, 2048], max_candidates=1)
    assert [(c.bucket, c.context) for c in low] == [(0, 1024), (1, 4096)]


@pytest.mark.host
def test_a_batch_hint_changes_one_capture_size_only():
    old = ladder()
    new = with_batch_hint(old, 1, 8, 2048, BATCHES)
    assert [new.hint_for(1, b) for b in BATCHES] == [512, 2048, 1024]
    assert [new.hint_for(0, b) for b in BATCHES] == [old.hint_for(0, b) for b in BATCHES]
    assert new.bounds == old.bounds
    back = with_batch_hint(new, 1, 8, 512, BATCHES)
    assert [back.hint_for(1, b) for b in BATCHES] == [old.hint_for(1, b) for b in BATCHES]


@pytest.mark.host
def test_retime_takes_the_step_winner_beyond_the_margin_and_replays_from_records():
    cells = tie_cells(ladder(), table(), splits_for, batches=BATCHES, from_batch=8,
                      from_context=2048, hints=[32, 512, 1024, 2048])
    asked = []

    def step_ms(batch, context, hints):
        asked.append((batch, context, tuple(hints)))
        # At batch 8 the candidate is 0.5 % faster (inside the margin), at 64 3 % faster.
        return {h: (1.0 if h == hints[0] else 0.995 if batch == 8 else 0.97) for h in hints}

    tuned, records = retime(ladder(), cells, step_ms, batches=BATCHES)
    assert asked == [(8, 4096, (512, 2048)), (64, 4096, (1024, 2048))]
    assert [tuned.hint_for(1, b) for b in BATCHES] == [512, 512, 2048]
    assert [r["hint"] for r in records] == [512, 2048]
    assert records[1]["step_ms"] == {"1024": 1.0, "2048": 0.97}
    again, _ = retime(ladder(), cells, saved_step_ms(json.loads(json.dumps(records))),
                      batches=BATCHES)
    assert again == tuned
    # A cell the records do not cover is skipped, not guessed.
    partial, kept = retime(ladder(), cells, saved_step_ms(records[:1]), batches=BATCHES)
    assert partial == ladder() and len(kept) == 1


@pytest.mark.host
def test_tune_ladder_replays_a_reports_step_timings(tmp_path: Path, capsys):
    script = load_script("tune_ladder")
    report = json.loads(Path("bench/results/h200-ladder-tune.json").read_text())
    report.pop("step_ties", None)  # the kernel table's choice, without the saved step ties
    saved = tmp_path / "no-ties.json"
    saved.write_text(json.dumps(report))
    args = ["--from-times", str(saved), "--max-buckets", "16", "--max-model-len", "131072",
            "--balanced-imbalance", "0", "--force", "--quiet"]
    plain = tmp_path / "plain.json"
    script.main([*args, "--out", str(plain), "--report", str(tmp_path / "plain-report.json")])
    base = BucketLadder.load(plain)
    top = len(base) - 1
    chosen = base.hint_for(top, 64)
    # The kernel table's near-tie at 64 x 128K (8192 and 512 in the committed report), with
    # a step timing that prefers the one the table did not choose.
    other = 8192 if chosen != 8192 else 512
    report["step_ties"] = [{"batch": 64, "context": 131072, "step_ms": {
        "256": 9.0, "512": 5.3, "1024": 5.3, "8192": 5.3, str(chosen): 5.3, str(other): 4.9}}]
    with_steps = tmp_path / "with-steps.json"
    with_steps.write_text(json.dumps(report))
    out = tmp_path / "tuned.json"
    script.main(["--from-times", str(with_steps), *args[2:], "--out", str(out), "--report",
                 str(tmp_path / "report.json")])
    tuned = BucketLadder.load(out)
    assert tuned.hint_for(top, 64) == other != chosen
    assert [tuned.hint_for(top, b) for b in (1, 8, 32, 128)] == \
        [base.hint_for(top, b) for b in (1, 8, 32, 128)]
    kept = json.loads((tmp_path / "report.json").read_text())["step_ties"]
    assert [(r["batch"], r["context"], r["hint"]) for r in kept] == [(64, 131072, other)]
    assert "step ties:" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_step_timer_times_each_hints_graph():
    from graphbucket.tuning.measure_step import StepTimer

    timer = StepTimer(16, max_context=8192, max_batch=8, max_model_len=131072)
    try:
        ms = timer(8, 8192, [1, 8192, 1])
    finally:
        timer.close()
    assert sorted(ms) == [1, 8192] and all(0 < v < 100 for v in ms.values())
    # One split against many at 8 x 8K: the split graph is the faster step.
    assert ms[8192] < ms[1]
