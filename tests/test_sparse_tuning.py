"""The ladder tuner on the sparse decoder: the grid it times, choosing from a sparse report,
the shipped sparse ladders and their lookup, and (GPU) the sparse layer's timing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from graphbucket.ladder import Bucket, BucketLadder
from graphbucket.sparse.backend import SparseBackend, sparse_ladder
from graphbucket.sparse.plan import DEFAULT_TOPK, SparsePlan, plan_sparse_decode
from graphbucket.spec import BufferSpec
from graphbucket.tuning import shipped
from graphbucket.tuning.grid import (
    hints_to_measure,
    plans_to_measure,
    sparse_hint_plans,
    times_from_rows,
    times_to_rows,
    variant_split_counts,
    variant_splits,
)
from graphbucket.tuning.shipped import (
    find_tuned_ladder,
    ladder_file_name,
    parse_ladder_file_name,
    parse_q_len,
    parse_sparse,
)
from tests.script_modules import load_script

pytestmark = pytest.mark.host

def _tune_script():
    return load_script("tune_ladder")


def distinct_sparse_plans(batch: int, hints: list[int], topk: int) -> set[str]:
    return {plan_sparse_decode(batch, 16, h, topk=topk, num_sms=132).describe() for h in hints}


@pytest.mark.parametrize("topk", [DEFAULT_TOPK, 512])
def test_dry_run_sparse_counts_every_distinct_sparse_plan(topk: int, capsys):
    script = _tune_script()
    argv = ["--dry-run", "--sparse", "--batches", "1", "8", "64"]
    script.main(argv if topk == DEFAULT_TOPK else [*argv, "--topk", str(topk)])
    out = capsys.readouterr().out
    assert f"sparse decode (top-k {topk})" in out
    lines = {int(line.split()[1].rstrip(":")): line for line in out.splitlines()
             if line.startswith("  batch ")}
    assert sorted(lines) == [1, 8, 64]
    contexts = sorted(set(script.CONTEXTS) | {c + 1 for c in script.CONTEXTS if c < 131072})
    hints = hints_to_measure(contexts, 131072, ladders=[sparse_ladder(131072, topk=topk)])
    counts = {}
    for batch, line in lines.items():
        counts[batch] = int(line.split(":")[1].split()[0])
        assert counts[batch] == len(distinct_sparse_plans(batch, hints, topk)), line
        assert "splits [(1, 1)," in line  # (indexer, attention) per plan, fewest first
    total = int(out.split(" measurements, about ")[0].rsplit("\n", 1)[-1])
    assert total == len(contexts) * sum(counts.values())
    seconds = float(out.split(" measurements, about ")[1].split(" s")[0])
    assert 0 < seconds <= 300


def test_sparse_variants_name_both_split_counts_and_round_trip():
    plan = plan_sparse_decode(8, 16, 65536, num_sms=132)
    label = plan.describe()
    assert variant_split_counts(label) == (plan.indexer_splits, plan.attention_splits)
    assert variant_splits(label) == plan.indexer_splits
    times = {(65536, 8, label): 12.5}
    assert times_from_rows(times_to_rows(times)) == times
    with pytest.raises(ValueError, match="sparse plan's"):
        variant_split_counts("balanced programs=132 grid=(1,)")


def toy_sparse_us(context: int, plan: SparsePlan) -> float:
    """A layer whose indexer and attention each pay per split and gain from spreading their
    tokens, so the best split counts grow with the context (and the 4-warp stream costs a
    little more, so equal-split plans differ)."""
    rows, attended = plan.num_rows, min(context, plan.topk)
    indexer = 0.4 * plan.indexer_splits + context * rows / (400.0 * plan.indexer_splits)
    attention = 0.3 * plan.attention_splits + attended * rows / (40.0 * plan.attention_splits)
    return 5.0 + indexer + attention + 0.05 * (plan.num_warps == 4)


def _sparse_report(tmp_path: Path, contexts: list[int], max_model_len: int) -> Path:
    plan_for = sparse_hint_plans(16, topk=DEFAULT_TOPK, num_sms=132)
    hints = hints_to_measure(contexts, max_model_len,
                             ladders=[sparse_ladder(max_model_len, topk=DEFAULT_TOPK)])
    plans = plans_to_measure([1, 8], plan_for, hints)
    times = {(c, b, label): toy_sparse_us(c, p) for c in contexts for b in (1, 8)
             for label, p in plans[b].items()}
    meta = {"gpu": "NVIDIA H200", "num_sms": 132, "num_heads": 16, "batches": [1, 8],
            "contexts": contexts, "command": "x", "date": "d", "torch": "t", "triton": "t",
            "kv_cache": "bf16", "q_len": 1, "timed": "plans", "decoder": "sparse",
            "topk": DEFAULT_TOPK}
    path = tmp_path / "sparse-report.json"
    path.write_text(json.dumps({"meta": meta, "times": times_to_rows(times)}))
    return path


def test_from_times_on_a_sparse_report_rechooses_the_toy_optimum_with_balanced_off(
        tmp_path: Path):
    script = _tune_script()
    contexts, top = [64, 1024, 4096, 16384, 65536], 65536
    saved = _sparse_report(tmp_path, contexts, top)
    times = times_from_rows(json.loads(saved.read_text())["times"])
    best = {(c, b): min((us, label) for (c2, b2, label), us in times.items()
                        if (c2, b2) == (c, b))[1] for c in contexts for b in (1, 8)}
    assert len(set(best.values())) > 4  # the optimum moves with context and batch
    out, report = tmp_path / "h200-h16-sparse.json", tmp_path / "again.json"
    script.main(["--from-times", str(saved), "--max-model-len", str(top), "--max-buckets",
                 "5", "--out", str(out), "--report", str(report), "--quiet"])
    ladder = BucketLadder.load(out)
    assert ladder.meta["decoder"] == "sparse" and ladder.meta["topk"] == DEFAULT_TOPK
    assert all(b.balanced_imbalance == 0 and not b.batch_imbalance for b in ladder)
    for (c, b), label in best.items():  # each bucket's hint captures the fastest plan
        hint = ladder.hint_for(ladder.bucket_for(c), b)
        planned = plan_sparse_decode(b, 16, hint, num_sms=132).describe()
        assert times[(c, b, planned)] == times[(c, b, label)], (c, b, hint)
    again = json.loads(report.read_text())
    assert again["default_ladder"]["meta"]["source"] == "sparse_ladder"
    assert again["summary"]["tuned_max_over_oracle"] == 1.0
    assert "sparse decode (top-k 2048)" in report.with_suffix(".md").read_text()
    with pytest.raises(SystemExit, match="no balanced topology"):
        script.main(["--from-times", str(saved), "--max-model-len", str(top),
                     "--balanced-imbalance", "1.5"])
    with pytest.raises(SystemExit, match="top-k 2048, not --topk 512"):
        script.main(["--from-times", str(saved), "--max-model-len", str(top), "--sparse",
                     "--topk", "512"])


def test_sparse_flags_are_checked_before_anything_runs(capsys):
    script = _tune_script()
    for argv in (["--topk", "512"], ["--sparse", "--kv-cache", "fp8-tensor"],
                 ["--sparse", "--balanced-imbalance", "2"]):
        with pytest.raises(SystemExit) as e:
            script.parse_args(argv)
        assert e.value.code == 2, argv
        assert argv[-2] in capsys.readouterr().err


def test_sparse_ladder_file_names_round_trip():
    assert ladder_file_name("h200", 16, sparse=True) == "h200-h16-sparse.json"
    name = ladder_file_name("h200", 16, "fp8-v32", q_len=2, sparse=True)
    assert name == "h200-h16-fp8-v32-sparse-q2.json"
    assert parse_ladder_file_name(name) == ("h200", 16, "fp8-v32")
    assert parse_sparse(name) and parse_q_len(name) == 2
    assert not parse_sparse("h200-h16-fp8-v32.json") and not parse_sparse("h200-h128-q2.json")


def _save(directory: Path, name: str, hint: int, **meta) -> BucketLadder:
    ladder = BucketLadder([Bucket(2048, hint), Bucket(8192, 8192)], 8192,
                          meta={"num_heads": 16, **meta})
    ladder.save(directory / name)
    return ladder


def test_sparse_lookup_takes_only_a_sparse_file_of_its_topk(tmp_path: Path):
    def find(topk=None):
        return find_tuned_ladder("NVIDIA H200", 16, 8192, directory=tmp_path, sparse_topk=topk)

    dense = _save(tmp_path, "h200-h16.json", 1024)
    assert find() == dense and find(2048) is None  # a dense ladder never serves sparse
    sparse = _save(tmp_path, "h200-h16-sparse.json", 512, decoder="sparse", topk=2048)
    assert find(2048) == sparse and find() == dense
    assert find(512) is None  # tuned for another top-k
    _save(tmp_path, "h200-h16-sparse.json", 512)  # no decoder in its meta
    with pytest.raises(ValueError, match="named for the sparse decoder"):
        find(2048)


def test_sparse_backend_default_ladder_is_the_shipped_one_else_sparse_ladder(
        tmp_path: Path, monkeypatch):
    backend = SparseBackend(num_heads=16, max_len=8192, num_sms=132)
    spec = BufferSpec(max_pages_per_seq=128, num_pages=256, page_size=64, num_heads=16,
                      output_shape=(8,), output_dtype=torch.bfloat16,
                      device=torch.device("cuda", 0))
    monkeypatch.setattr(shipped, "LADDER_DIR", tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    fallback = sparse_ladder(8192, topk=DEFAULT_TOPK)
    _save(tmp_path, "h200-h16.json", 1024)
    assert backend.default_ladder(8192, spec) == fallback
    tuned = _save(tmp_path, "h200-h16-sparse.json", 512, decoder="sparse", topk=2048)
    assert backend.default_ladder(8192, spec) == tuned
    assert backend.default_ladder(8192) == fallback  # no spec: no device to look up
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backend.default_ladder(8192, spec) == fallback


@pytest.mark.gpu
def test_gpu_sparse_layer_timing_sees_indexer_splits_win_at_long_context():
    from graphbucket.tuning.measure_sparse import SparsePlanTimer

    context = 65536
    planned = plan_sparse_decode(1, 16, context,
                                 num_sms=torch.cuda.get_device_properties(0)
                                 .multi_processor_count)
    assert planned.indexer_splits > 1
    one = planned.with_splits(indexer=1)
    timer = SparsePlanTimer(context, 1, 16, topk=DEFAULT_TOPK,
                            max_splits=planned.attention_splits, max_tokens=4 * context)
    times = timer.time(context, 1, {"planned": planned, "one": one})
    assert all(us > 0 for us in times.values()), times
    # One program streams 64K index keys alone; the planned split count spreads them.
    assert times["planned"] < times["one"], times


@pytest.mark.gpu
def test_gpu_sparse_layer_timing_runs_verify_steps_and_ragged_lengths():
    from graphbucket.tuning.measure_sparse import SparsePlanTimer

    plan = plan_sparse_decode(2 * 2, 16, 4096)
    timer = SparsePlanTimer(4096, 2, 16, topk=DEFAULT_TOPK, q_len=2,
                            max_splits=plan.attention_splits)
    (us,) = timer.time_lens([4096, 300], {"p": plan}).values()
    assert us > 0


def test_a_shape_needing_more_pages_than_the_timing_cache_is_refused():
    from graphbucket.tuning.measure import check_pages

    check_pages(256, 256)
    with pytest.raises(ValueError, match="need 257 pages and the timing cache holds 256"):
        check_pages(257, 256)


@pytest.mark.gpu
def test_gpu_timers_hold_requests_that_each_round_up_to_a_whole_page():
    # 4 x 4033 tokens fill 253 pages, but each request takes 64 pages: 256.
    from graphbucket.plan import plan_mla_decode
    from graphbucket.tuning.measure import PlanTimer
    from graphbucket.tuning.measure_sparse import SparsePlanTimer

    lens = [4033] * 4
    dense = plan_mla_decode(4, 16, 4033)
    (us,) = PlanTimer(4033, 4, 16, max_splits=dense.num_kv_splits).time_lens(
        lens, {"p": dense}).values()
    assert us > 0
    sparse = plan_sparse_decode(4, 16, 4033)
    timer = SparsePlanTimer(4033, 4, 16, topk=DEFAULT_TOPK, max_splits=sparse.attention_splits)
    (us,) = timer.time_lens(lens, {"p": sparse}).values()
    assert us > 0
