"""Which kernel a balanced graph runs, per capture size: the backend offers kernels, the
ladder names one per capture size, the runner captures it, the tuner chooses it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from graphbucket import GraphBucketRunner, get_backend
from graphbucket.bucket import DEFAULT_BALANCED_KERNEL
from graphbucket.ladder import Bucket, BucketLadder, default_ladder
from graphbucket.plan import RANGE_REQUEST_CHARGE_TILES
from graphbucket.plan_streams import SEESAW_STREAM
from graphbucket.tuning.ragged import RaggedSample, choose_balanced_kernels
from graphbucket.tuning.shipped import clip_ladder
from tests._toy import ToyMLA, rel_l2, toy_batch, toy_reference, toy_spec
from tests.script_modules import load_script

SM_SCALE = 0.125
DIMS = {"kv_lora_rank": 64, "qk_rope_dim": 16}
RAGGED = BucketLadder([Bucket(32, 32), Bucket(64, 64),
                       Bucket(320, 320, balanced_imbalance=1.5)], 320)


def test_each_bucket_names_a_kernel_per_capture_size_like_batch_hints(tmp_path: Path):
    ladder = default_ladder().with_balanced_kernels({64: "seesaw", 32: "seesaw", 2: "default",
                                                     128: "default"})
    # Entries that change nothing from the size below are dropped.
    assert {b.balanced_kernels for b in ladder} == {((32, "seesaw"), (128, "default"))}
    assert [ladder.balanced_kernel_for(2, n) for n in (1, 16, 32, 64, 128, 256)] == [
        "default", "default", "seesaw", "seesaw", "default", "default"]
    assert ladder != default_ladder() and "balanced_kernels={32: 'seesaw'" in repr(ladder)
    # Buckets differ: the seesaw at batch 8 in the top bucket only.
    mixed = BucketLadder((Bucket(4096, 4096), Bucket(8192, 8192, balanced_imbalance=2.0,
                                                     balanced_kernels={8: "seesaw"})), 8192)
    assert [mixed.balanced_kernel_for(i, 8) for i in (0, 1)] == ["default", "seesaw"]
    for lad in (ladder, mixed):
        path = tmp_path / "l.json"
        lad.save(path)
        assert BucketLadder.load(path) == lad
    assert json.loads(path.read_text())["buckets"][1]["balanced_kernels"] == {"8": "seesaw"}
    # Kept by every rewrite that keeps the balanced topology.
    assert [b.balanced_kernels for b in ladder.with_balanced_topology(2.0)] == [
        b.balanced_kernels for b in ladder]
    assert [b.balanced_kernels for b in clip_ladder(mixed, 6000)] == [(), ((8, "seesaw"),)]
    assert "balanced_kernels" not in json.dumps(default_ladder().to_dict())


@pytest.mark.parametrize("bad, error", [({0: "seesaw"}, ValueError), ({4: ""}, TypeError),
                                        ({4: 3}, TypeError), ({"x": "seesaw"}, TypeError)])
def test_a_bad_kernel_map_is_refused_by_the_bucket(bad, error):
    with pytest.raises(error, match="balanced_kernels"):
        Bucket(64, 64, balanced_kernels=tuple(bad.items()))


def test_a_bad_kernel_map_in_json_names_the_key():
    def ladder(kernels):
        return {"max_model_len": 64,
                "buckets": [{"max_len": 64, "hint": 64, "balanced_kernels": kernels}]}
    with pytest.raises(ValueError, match="balanced_kernels"):
        BucketLadder.from_dict(ladder(["seesaw"]))
    with pytest.raises(ValueError, match="batch sizes"):
        BucketLadder.from_dict(ladder({"many": "seesaw"}))
    with pytest.raises(ValueError, match="unknown \\['balanced_kernels'\\]"):
        BucketLadder.from_dict({**ladder({}), "balanced_kernels": {"8": "seesaw"}})


def test_backends_offer_their_balanced_kernels_and_refuse_others():
    triton = get_backend("triton", num_sms=132)
    assert triton.balanced_kernels(16) == (DEFAULT_BALANCED_KERNEL, "seesaw", "seesaw-ranges",
                                           "seesaw-fitted", "seesaw-charged")
    # From 64 heads the default is the seesaw over work items.
    assert triton.balanced_kernels(128) == (DEFAULT_BALANCED_KERNEL, "seesaw-ranges",
                                            "seesaw-fitted", "seesaw-charged")
    seesaw, default = triton.plan_balanced(32, 16, "seesaw"), triton.plan_balanced(32, 16)
    assert seesaw.balanced and seesaw.seesaw and seesaw.block_h == SEESAW_STREAM.block_h
    assert default.block_h == 16 and not default.seesaw and seesaw != default
    assert triton.plan_balanced(32, 128).seesaw and not triton.plan_balanced(32, 128).tile_ranges
    for heads, programs in ((16, 132), (128, 66)):  # one program per SM
        ranges = triton.plan_balanced(32, heads, "seesaw-ranges")
        assert ranges.seesaw and ranges.tile_ranges and ranges.persistent_programs == programs
        fitted = triton.plan_balanced(32, heads, "seesaw-fitted")
        assert fitted.seesaw and fitted.fit_items and not fitted.tile_ranges
        assert fitted.persistent_programs == programs and " fitted " in fitted.describe()
        charged = triton.plan_balanced(32, heads, "seesaw-charged")
        assert charged == replace(ranges, charged_ranges=True,
                                  range_charge_tiles=RANGE_REQUEST_CHARGE_TILES)
        assert f" charged={RANGE_REQUEST_CHARGE_TILES}" in charged.describe()
    with pytest.raises(ValueError, match="no balanced kernel 'seesaw'.*offers "
                                         "\\['default', 'seesaw-ranges', 'seesaw-fitted', "
                                         "'seesaw-charged'\\]"):
        triton.plan_balanced(32, 128, "seesaw")
    with pytest.raises(ValueError, match="no balanced kernel 'fast'"):
        get_backend("dense").plan_balanced(4, 16, "fast")


def _runner(ladder, *, device, sizes=(1, 4)):
    model = ToyMLA(device=device)
    backend = get_backend("triton", num_sms=1, **DIMS)
    runner = GraphBucketRunner.for_policy(
        "ladder", model, spec=toy_spec(device=device, max_pages=24), batch_sizes=list(sizes),
        max_model_len=320, sm_scale=SM_SCALE, backend=backend, ladder=ladder,
        warmup_iters=int(device == "cuda"), progress=False)
    return model, runner


@pytest.mark.parametrize("kernel", ["seesaw", "seesaw-charged"])
def test_the_runner_captures_each_capture_sizes_kernel_and_matches_the_reference(device,
                                                                                  kernel):
    # Batch 4 replays balanced graphs on the seesaw's 64-row programs (off Hopper the
    # Triton kernel runs that plan, 48 of 64 rows masked); batch 2 keeps the default.
    model, runner = _runner(RAGGED.with_balanced_kernels({4: kernel}), device=device,
                            sizes=(2, 4))
    runner.capture()
    balanced = {r.batch_size: r.plan for r in runner.records if r.plan.balanced}
    assert balanced[4].seesaw and balanced[4].block_h == 64
    assert balanced[4].charged_ranges == (kernel == "seesaw-charged")
    assert not balanced[2].seesaw and balanced[2].block_h == 16
    rng = np.random.default_rng(3)
    for lens in ([300, 10, 20], [320, 0, 1, 64], [310, 5], [300, 290, 280, 270]):
        key = _step_checked(runner, model, lens, rng, device)
        assert key.balanced == (lens != [300, 290, 280, 270]), (lens, key)
    runner.close()


def _step_checked(runner, model, lens, rng, device):
    """One step of ``lens`` against the toy reference; the key it replayed."""
    batch = toy_batch(lens, rng=rng, max_pages=24)
    before = runner.stats().replays
    got = runner.step(batch)
    want = toy_reference(model, batch, sm_scale=SM_SCALE)
    assert rel_l2(got, want) < (1e-2 if device == "cuda" else 1e-5), lens
    (key,) = [k for k, n in runner.stats().replays.items() if n != before.get(k, 0)]
    return key


def test_a_kernel_the_backend_lacks_is_refused_before_anything_is_captured():
    model = None
    with pytest.raises(ValueError, match="no balanced kernel 'fast'"):
        model, runner = _runner(RAGGED.with_balanced_kernels({4: "fast"}), device="cpu")
        runner.capture()
    assert model is None or model.calls == 0  # the forward never ran: nothing captured


def _sample(batch, mix, default_us, seesaw_us, split_us=100.0, lens=None):
    lens = lens or (9000,) + (10,) * (batch - 1)
    return RaggedSample(batch, mix, tuple(lens), split_us, default_us,
                        DEFAULT_BALANCED_KERNEL,
                        ((DEFAULT_BALANCED_KERNEL, default_us), ("seesaw", seesaw_us)))


def test_the_tuner_keeps_per_capture_size_the_kernel_with_the_least_relative_time():
    samples = [_sample(8, "a", 50.0, 60.0), _sample(8, "b", 80.0, 70.0),   # default: 2.0 vs
               _sample(32, "a", 50.0, 40.0), _sample(32, "b", 90.0, 60.0),  # 2.2; seesaw
               _sample(64, "a", 50.0, 50.0)]                                # wins at 32; tie
    chosen, out = choose_balanced_kernels(samples)
    assert chosen == {8: "default", 32: "seesaw", 64: "default"}
    assert [(s.kernel, s.balanced_us) for s in out] == [
        ("default", 50.0), ("default", 80.0), ("seesaw", 40.0), ("seesaw", 60.0),
        ("default", 50.0)]
    # Samples of one kernel only (reports before the choice) keep it.
    plain = RaggedSample(8, "c", (9000, 1), 30.0, 20.0)
    assert choose_balanced_kernels([plain]) == ({8: "default"}, [plain])
    with pytest.raises(ValueError, match="'seesaw' was not timed"):
        plain.with_kernel("seesaw")
    assert RaggedSample.from_dict(json.loads(json.dumps(out[2].to_dict()))) == out[2]


def test_tune_ladder_writes_the_kernel_it_chose_per_length_range(tmp_path: Path):
    from tests.test_ragged_switch import _report_with_mixes

    # At batch 8 the seesaw wins both mixes up to 16K; the switch is chosen on its times
    # (balanced on the one-long mix, split-KV on the half-long one). Over 16K the default
    # kernel wins, so the buckets there keep it when each range chooses from its own mixes
    # alone (with its neighbours' the seesaw's two wins outweigh it there too).
    samples = [_sample(8, "one-long", 45.0, 30.0),
               _sample(8, "half-long", 120.0, 110.0, lens=(9000,) * 4 + (3000,) * 4),
               _sample(8, "one-long", 45.0, 60.0, lens=(20000,) + (10,) * 7)]
    saved = _report_with_mixes(tmp_path, samples, top=32768)
    out, report = tmp_path / "ladder.json", tmp_path / "report.json"
    load_script("tune_ladder").main(["--from-times", str(saved), "--max-model-len", "32768",
                                     "--out", str(out), "--report", str(report), "--quiet",
                                     "--kernel-neighbours", "0"])
    ladder = BucketLadder.load(out)
    at = {n: ladder.balanced_kernel_for(ladder.bucket_for(n), 8) for n in (9000, 20000)}
    assert at == {9000: "seesaw", 20000: "default"}
    ragged = json.loads(report.read_text())["ragged"]
    kernels = {n: sw.get("balanced_kernels", {}) for n in (9000, 20000)
               for sw in ragged["summary"]["switches"] if sw["lo"] < n <= sw["hi"]}
    assert kernels == {9000: {"8": "seesaw"}, 20000: {}}
    assert [r["kernel"] for r in ragged["samples"]] == ["seesaw", "seesaw", "default"]
    assert ragged["summary"]["worst_over_best"] == 1.0


def test_tune_ladder_auto_reach_keeps_a_ranges_own_kernel_where_pooling_misses_it(
        tmp_path: Path, capsys):
    from tests.test_ragged_switch import _report_with_mixes

    # (8192, 16384]: the seesaw 1.5x ahead at both mix lengths; (16384, 32768]: the default
    # 2x ahead on three mixes per length. Pooled with its neighbours the lower range would
    # take the default and miss both of its mixes held out: auto keeps each range's own.
    def at(longest):
        return (longest,) + (10,) * 7
    samples = [_sample(8, "one-long", 45.0, 30.0, lens=at(9000)),
               _sample(8, "one-long@15/16", 45.0, 30.0, lens=at(11000))]
    for name in ("x", "y", "z"):
        samples += [_sample(8, name, 30.0, 60.0, lens=at(20000)),
                    _sample(8, f"{name}@15/16", 30.0, 60.0, lens=at(24000))]
    saved = _report_with_mixes(tmp_path, samples, top=32768)
    out, report = tmp_path / "ladder.json", tmp_path / "report.json"
    script = load_script("tune_ladder")
    script.main(["--from-times", str(saved), "--max-model-len", "32768", "--out", str(out),
                 "--report", str(report), "--kernel-neighbours", "auto", "--force"])
    assert "--kernel-neighbours auto" in capsys.readouterr().out
    ladder = BucketLadder.load(out)
    at_len = {n: ladder.balanced_kernel_for(ladder.bucket_for(n), 8) for n in (9000, 20000)}
    assert at_len == {9000: "seesaw", 20000: "default"}
    chosen = json.loads(report.read_text())["ragged"]["summary"]["kernel_neighbours"]
    assert chosen["chosen"] == 0
    assert chosen["held_out_by_length"]["0"]["above"] == 0
    assert chosen["held_out_by_length"]["1"]["above"] == 2
    text = report.with_suffix(".md").read_text()
    assert "those of 0 range(s) on each side, the reach" in text
    assert "1 range(s): 2 of 8 (mean" in text
    # Mixes timed at one length: nothing to hold out, the default reach.
    saved = _report_with_mixes(tmp_path, [s for s in samples if "@" not in s.mix], top=32768)
    script.main(["--from-times", str(saved), "--max-model-len", "32768", "--out", str(out),
                 "--report", str(report), "--kernel-neighbours", "auto", "--force"])
    assert "timed at one length, nothing to hold out" in capsys.readouterr().out
    assert "kernel_neighbours" not in json.loads(report.read_text())["ragged"]["summary"]


def test_the_runner_replays_the_alternate_kernel_the_cost_model_predicts_faster(device):
    # Batch 4's balanced graphs: the seesaw's plan, and the default one as the alternate.
    # The seesaw is predicted to take its busiest program's tiles (one program here: every
    # live tile), the default a constant 8: up to 7 tiles the seesaw replays, from 9 the
    # alternate.
    from graphbucket.balanced_cost import BalancedCostModel, KernelCost, partition_of

    backend = get_backend("triton", num_sms=1, **DIMS)
    parts = {k: {4: partition_of(backend.plan_balanced(4, 16, k), 1)}
             for k in ("seesaw", DEFAULT_BALANCED_KERNEL)}
    model = BalancedCostModel({"seesaw": KernelCost(0.0, (0.0, 1.0, 0.0, 0.0)),
                               DEFAULT_BALANCED_KERNEL: KernelCost(0.0, (8.0, 0.0, 0.0, 0.0))},
                              parts)
    ladder = BucketLadder([Bucket(32, 32), Bucket(64, 64),
                           Bucket(320, 320, balanced_imbalance=1.5,
                                  balanced_kernels={4: "seesaw"},
                                  alternate_kernels={4: DEFAULT_BALANCED_KERNEL})], 320,
                          meta={"balanced_cost": model.to_dict()})
    model_, runner = _runner(ladder, device=device, sizes=(4,))
    runner.capture()
    plans = {(r.plan.seesaw, r.plan.block_h) for r in runner.records if r.plan.balanced}
    assert plans == {(True, 64), (False, 16)}
    rng = np.random.default_rng(5)
    seen = set()
    # Tiles of 64 tokens: 5 + 1 + 1 = 7 (seesaw); 5 + 5 + 1 + 1 = 12 (alternate); 5 + 1 (seesaw)
    for lens, alternate in (([300, 10, 20], False), ([320, 300, 1, 64], True),
                            ([310, 5], False), ([301, 257, 3, 2], True)):
        key = _step_checked(runner, model_, lens, rng, device)
        assert key.balanced and key.alternate == alternate, (lens, key)
        seen.add(key.alternate)
    assert seen == {False, True}
    runner.close()


def test_one_step_partitions_once_for_every_layer(device, monkeypatch):
    # The toy's two layers over two caches share one partition of the step: after
    # begin_step the planner runs for the first layer only, and the result is the one of
    # planning every layer, bit for bit, and the reference's.
    import graphbucket.kernels.launch_balanced as launcher
    from graphbucket.batch import BatchValidator

    model, runner = _runner(RAGGED, device=device, sizes=(4,))
    plan = runner.backend.plan_balanced(4, runner.spec.num_heads)
    assert runner.backend.partitions_once(plan)
    assert not runner.backend.partitions_once(runner.backend.plan(4, runner.spec.num_heads, 300))
    calls = []
    real = launcher.launch_item_planner
    monkeypatch.setattr(launcher, "launch_item_planner",
                        lambda *a, **k: (calls.append(k["plan"]), real(*a, **k))[1])
    rng = np.random.default_rng(5)
    outputs = []
    for lens in ([300, 10, 0, 64], [17, 290, 5, 1]):
        batch = toy_batch(lens, rng=rng, max_pages=24)
        host = BatchValidator(runner.spec, block_table=runner.block_table)(batch)
        runner.buffers.stage(host, 4, in_graph=False)
        runner.buffers.apply_table_changes()
        want = toy_reference(model, batch, sm_scale=SM_SCALE)
        for begin in (True, False):
            ctx = runner.buffers.context(4, plan, runner.backend, SM_SCALE)
            if begin:
                ctx.begin_step()
            calls.clear()
            got = model(ctx)[:len(lens)].clone()
            assert len(calls) == (1 if begin else 2), (lens, begin)
            assert rel_l2(got, want) < (1e-2 if device == "cuda" else 1e-5), lens
            outputs.append(got)
        assert torch.equal(outputs[-2], outputs[-1]), lens
        # A second step on one context plans again after begin_step.
        ctx.begin_step()
        calls.clear()
        model(ctx)
        assert len(calls) == 1
    runner.close()
