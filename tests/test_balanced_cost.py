"""The balanced cost model: partitions mirror the device planners, the fit recovers known
costs, the tuner keeps a second kernel only where it pays, the selector replays it."""

from __future__ import annotations

import heapq
import itertools
import json
import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from graphbucket.backends.triton import TritonBackend
from graphbucket.balanced_cost import (
    CHARGED,
    FITTED,
    ITEMS,
    RANGES,
    STRIDED,
    BalancedCostModel,
    KernelCost,
    Partition,
    charged_bounds,
    fit_kernel_cost,
    makespan,
    partition_of,
)
from graphbucket.graphs import GraphTable, balanced_kernel_of, check_cost_partitions
from graphbucket.ladder import Bucket, BucketLadder
from graphbucket.plan import RANGE_REQUEST_CHARGE_TILES, cdiv
from graphbucket.select import GraphSelector
from graphbucket.tuning.kernel_pairs import (
    MIN_BATCH_MIXES,
    MIN_GAIN,
    choose_kernel_pairs,
    fit_cost_model,
)
from graphbucket.tuning.ragged import RaggedSample, choose_switches
from tests.test_balanced import python_partition

pytestmark = pytest.mark.host

NUM_SMS = 132


def brute_items(lens, block_n, programs, min_chunk, fit):
    """(every item's tiles, the items of requests cut in two or more: the merge's partials)."""
    indptr, chunk = python_partition(lens, block_n, programs, min_chunk, fit)
    items, partials = [], 0
    for n in lens:
        t = cdiv(n, block_n)
        mine = [min(chunk, t - i * chunk) for i in range(cdiv(t, chunk))]
        items += mine
        partials += len(mine) if len(mine) > 1 else 0
    assert len(items) == indptr[-1]
    return items, partials


def random_lens(rng: random.Random, batch: int) -> list[int]:
    shape = rng.choice(["spread", "one-long", "half", "zeros"])
    top = rng.choice([1, 63, 64, 65, 4096, 30000, 131072])
    if shape == "spread":
        return [1 + (top - 1) * i // max(1, batch - 1) for i in range(batch)]
    if shape == "one-long":
        return [top] + [rng.randint(0, 700) for _ in range(batch - 1)]
    if shape == "half":
        return [top] * (batch // 2) + [rng.randint(1, 5000)] * (batch - batch // 2)
    return [0] * (batch - 1) + [top]


@pytest.mark.parametrize("kind", [ITEMS, FITTED, STRIDED])
def test_item_partitions_match_the_device_planner_and_list_scheduling(kind):
    rng = random.Random(7)
    for _ in range(60):
        batch = rng.choice([1, 2, 5, 8, 64, 128])
        lens = random_lens(rng, batch)
        part = Partition(kind, rng.choice([3, 66, 132]), rng.choice([32, 64]),
                         rng.choice([1, 2, 4]), 1 if kind != STRIDED else 2)
        items, partials = brute_items(lens, part.block_n, part.programs, part.min_chunk,
                                      kind == FITTED)
        overhead = rng.choice([0.0, 2.0])
        scale = part.block_n / 64
        load, count = makespan(lens, part, overhead * scale)
        assert count == partials
        if kind == STRIDED:
            per_program = [sum(w + overhead for w in items[p::part.programs])
                           for p in range(part.programs)]
            sms = max(1, part.programs // part.per_sm)
            per_sm = [sum(per_program[s::sms]) / part.per_sm for s in range(sms)]
            want = max(per_program + per_sm, default=0.0)
        else:
            finish = [0.0] * part.programs
            for w in items:
                heapq.heapreplace(finish, finish[0] + w + overhead)
            want = max(finish) if items else 0.0
        assert load == pytest.approx(want * scale)


def test_tile_ranges_count_each_request_a_range_meets():
    rng = random.Random(3)
    for _ in range(60):
        lens = random_lens(rng, rng.choice([2, 7, 64]))
        part = Partition(RANGES, rng.choice([5, 66, 132]), 64, 2)
        tiles = [cdiv(n, 64) for n in lens if n > 0]
        total = sum(tiles)
        per = max(2, cdiv(total, part.programs)) if total else 1
        owner = [i for i, t in enumerate(tiles) for _ in range(t)]
        loads, ranges_met = [], Counter()
        for start in range(0, total, per):
            span = owner[start:start + per]
            loads.append(len(span) + 1.5 * len(set(span)))
            ranges_met.update(set(span))
        # Every segment costs its range the overhead; a request within one range is whole
        # (its output, not a partial).
        partials = sum(n for n in ranges_met.values() if n > 1)
        assert makespan(lens, part, 1.5) == (pytest.approx(max(loads, default=0.0)), partials)


def python_charged_bounds(tiles: list[int], programs: int, min_chunk: int, charge: int
                          ) -> list[int]:
    """The charged cut unit by unit: each live request's charge, then its tiles; program p
    starts at unit p * per, on the tile that unit is (a charge unit: its request's first)."""
    units = []  # the tile each unit stands for (a charge: its request's first tile)
    first = 0
    for t in tiles:
        if t:
            units += [first] * charge + list(range(first, first + t))
        first += t
    per = max(min_chunk, cdiv(len(units), programs))
    return [units[p * per] if p * per < len(units) else sum(tiles)
            for p in range(programs + 1)]


def test_charged_bounds_match_the_unit_by_unit_cut():
    rng = random.Random(5)
    for _ in range(200):
        tiles = [rng.choice([0, 1, 2, rng.randint(1, 300)]) for _ in range(rng.randint(1, 30))]
        programs, min_chunk, charge = rng.randint(1, 140), rng.randint(1, 4), rng.randint(0, 7)
        got = charged_bounds(np.array(tiles), programs, min_chunk, charge).tolist()
        assert got == python_charged_bounds(tiles, programs, min_chunk, charge), \
            (tiles, programs, min_chunk, charge)


def test_a_range_cut_counts_the_partials_of_the_requests_it_splits_only():
    # The partials the merge reads: under equal and charged ranges alike, a request that one
    # program holds whole writes its output instead.
    rng = random.Random(17)
    for _ in range(200):
        lens = [rng.choice([0, 1, 64, 65, rng.randint(1, 20000)])
                for _ in range(rng.randint(1, 40))]
        programs, charge = rng.randint(1, 140), rng.randint(0, 7)
        tiles = [cdiv(n, 64) for n in lens]
        live = [t for t in tiles if t]
        ends = list(itertools.accumulate(live))
        for part, cut_charge in ((Partition(CHARGED, programs, 64, 2, charge=charge), charge),
                                 (Partition(RANGES, programs, 64, 2), 0)):
            bounds = python_charged_bounds(live, programs, 2, cut_charge)
            meets = [sum(max(bounds[p], e - t) < min(bounds[p + 1], e) for p in range(programs))
                     for t, e in zip(live, ends, strict=True)]
            assert makespan(lens, part, 1.0)[1] == sum(m for m in meets if m > 1), (lens, part)


def test_a_charged_cut_shortens_the_busiest_range_of_a_spread():
    # 64 requests spread over 1..8K: the equal cut's programs meeting many short requests
    # carry their per-segment cost on top of a full range; the charged cut gives them less.
    lens = [1 + (8192 - 1) * i // 63 for i in range(64)]
    equal = Partition(RANGES, 132, 64, 2)
    charged = Partition(CHARGED, 132, 64, 2, charge=RANGE_REQUEST_CHARGE_TILES)
    assert makespan(lens, charged, 5.0)[0] < makespan(lens, equal, 5.0)[0]
    assert makespan([], charged, 5.0) == (0.0, 0)
    # Charge 0 cuts as the equal ranges do (its whole requests write no partial).
    assert makespan(lens, Partition(CHARGED, 132, 64, 2), 5.0)[0] == \
        makespan(lens, equal, 5.0)[0]


def test_a_charged_partition_keeps_its_charge_and_reads_older_lists():
    part = Partition(CHARGED, 66, 64, 2, charge=3)
    assert Partition.from_list(part.to_list()) == part and len(part.to_list()) == 6
    assert len(Partition(RANGES, 66, 64, 2).to_list()) == 5
    # Lists saved before a plan carried its charge: the default charge.
    assert Partition.from_list([CHARGED, 66, 64, 2, 1]).charge == RANGE_REQUEST_CHARGE_TILES
    plan = TritonBackend(num_sms=NUM_SMS).plan_balanced(8, 128, "seesaw-charged")
    assert partition_of(replace(plan, range_charge_tiles=2), NUM_SMS).charge == 2
    with pytest.raises(ValueError, match="charge is a charged cut's"):
        Partition(RANGES, 66, 64, 2, charge=2)
    with pytest.raises(ValueError, match="charge is a charged cut's"):
        Partition(CHARGED, 66, 64, 2, charge=-1)


def test_partitions_are_read_off_the_backends_plans():
    backend = TritonBackend(num_sms=NUM_SMS)
    kinds = {k: partition_of(backend.plan_balanced(64, 16, k), NUM_SMS)
             for k in backend.balanced_kernels(16)}
    assert kinds == {"default": Partition(STRIDED, 528, 32, 4, 4),
                     "seesaw": Partition(ITEMS, 132, 64, 2),
                     "seesaw-ranges": Partition(RANGES, 132, 64, 2),
                     "seesaw-fitted": Partition(FITTED, 132, 64, 2),
                     "seesaw-charged": Partition(CHARGED, 132, 64, 2,
                                                 charge=RANGE_REQUEST_CHARGE_TILES)}
    assert partition_of(backend.plan_balanced(8, 128, "seesaw-fitted"), NUM_SMS) == \
        Partition(FITTED, 66, 64, 2)
    with pytest.raises(ValueError, match="needs a balanced plan"):
        partition_of(backend.plan(8, 16, 4096), NUM_SMS)
    with pytest.raises(ValueError, match="kind must be one of"):
        Partition("ring", 1, 64, 1)


def test_the_fit_recovers_a_kernels_costs_and_overhead():
    part = Partition(ITEMS, 132, 64, 2)
    truth = KernelCost(3.0, (5.0, 2.5, 0.2, 0.05))
    rng = random.Random(11)
    samples = []
    for _ in range(40):
        batch = rng.choice([2, 8, 32, 64])
        lens = random_lens(rng, batch)
        samples.append((lens, batch, truth.predict(lens, batch, part)))
    got = fit_kernel_cost(samples, lambda rows: part)
    assert got.overhead_tiles == 3.0
    np.testing.assert_allclose(got.coefficients, truth.coefficients, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="at least 4"):
        fit_kernel_cost(samples[:3], lambda rows: part)


def test_the_model_round_trips_and_names_bad_entries():
    model = BalancedCostModel({"a": KernelCost(1.0, (1.0, 2.0, 3.0, 4.0))},
                              {"a": {8: Partition(ITEMS, 132, 64, 2)}})
    again = BalancedCostModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert again == model and again.covers("a", 8) and not again.covers("a", 16)
    assert again.predict("a", 8, [100, 7000]) == model.predict("a", 8, [100, 7000])
    with pytest.raises(ValueError, match="four coefficients"):
        BalancedCostModel.from_dict({"a": {"overhead_tiles": 0, "coefficients": [1, 2],
                                           "partitions": {}}})
    with pytest.raises(ValueError, match="must map kernel names"):
        BalancedCostModel.from_dict([])


def test_each_capture_size_with_enough_mixes_gets_a_cost_of_its_own(tmp_path: Path):
    # One kernel whose time per makespan tile grows with the rows (at 64 rows the programs
    # share the SMs' bandwidth): one cost over both sizes misses both, one per size fits.
    part = Partition(ITEMS, 132, 64, 2)
    truth = {8: KernelCost(0.0, (4.0, 1.0, 0.1, 0.05)), 64: KernelCost(0.0, (9.0, 3.0, 0.1, 0.02)),
             2: KernelCost(0.0, (3.0, 1.0, 0.1, 0.05))}
    rng, samples = random.Random(3), []
    for batch, count in ((8, MIN_BATCH_MIXES), (64, MIN_BATCH_MIXES + 5), (2, 4)):
        for i in range(count):
            lens = random_lens(rng, batch)
            while not any(lens):
                lens = random_lens(rng, batch)
            us = truth[batch].predict(lens, batch, part)
            samples.append(RaggedSample(batch, f"m{i}", tuple(lens), 1e4, us, "a",
                                        (("a", us),)))
    model = fit_cost_model(samples, lambda k, b: part, [2, 8, 64])
    assert sorted(model.by_batch["a"]) == [8, 64]  # 2 has too few mixes: the shared cost
    mine = [s for s in samples if s.batch in (8, 64)]
    for s in mine:
        assert model.predict("a", s.batch, s.lens) == pytest.approx(s.balanced_us, rel=1e-6)
    shared = BalancedCostModel(model.costs, model.partitions)  # no per-size costs
    assert max(abs(shared.predict("a", s.batch, s.lens) / s.balanced_us - 1)
               for s in mine) > 0.05
    again = BalancedCostModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert again.by_batch["a"].keys() == model.by_batch["a"].keys()
    for s in samples:
        assert again.predict("a", s.batch, s.lens) == pytest.approx(
            model.predict("a", s.batch, s.lens), rel=1e-5)
    with pytest.raises(ValueError, match="by_batch"):
        BalancedCostModel.from_dict({"a": {**model.to_dict()["a"], "by_batch": {"8": {}}}})


# Two synthetic kernels with known costs: "plain" pays per item, "fitted" per tile of its
# (longer) chunks; which wins depends on the mix's shape, as on the GPU.
PARTS = {"plain": Partition(ITEMS, 132, 64, 2), "fitted": Partition(FITTED, 132, 64, 2)}
TRUTH = {"plain": KernelCost(0.0, (4.0, 2.0, 0.1, 0.05)),
         "fitted": KernelCost(0.0, (9.0, 2.0, 0.1, 0.0))}


def synthetic_samples(batches=(32, 64), seed=5) -> list[RaggedSample]:
    rng, out = random.Random(seed), []
    for batch in batches:
        for top in (20000, 50000, 100000):
            mixes = {"spread": [1 + (top - 1) * i // (batch - 1) for i in range(batch)],
                     "half": [top] * (batch // 2) + [4096] * (batch - batch // 2),
                     "one": [top] + [512] * (batch - 1),
                     "quarter": [top] * (batch // 4) + [rng.randint(1000, 3000)] * (
                         batch - batch // 4)}
            for name, lens in mixes.items():
                times = {k: TRUTH[k].predict(lens, batch, PARTS[k]) for k in TRUTH}
                out.append(RaggedSample(batch, name, tuple(lens), 5000.0, times["plain"],
                                        "plain", tuple(times.items())))
    return out


def model_from(samples):
    return fit_cost_model(samples, lambda k, b: PARTS[k], sorted({s.batch for s in samples}))


def test_a_second_kernel_is_kept_where_the_models_pick_beats_either_alone():
    samples = synthetic_samples()
    model = model_from(samples)
    kernels, alternates, timed = choose_kernel_pairs(samples, model)
    for batch in (32, 64):
        mine = [s for s in samples if s.batch == batch]
        alone = min(max(s.kernel_us()[k] / min(s.kernel_us().values()) for s in mine)
                    for k in TRUTH)
        assert alone > 1 + MIN_GAIN  # neither kernel wins every mix
        assert {kernels[batch], alternates[batch]} == set(TRUTH), batch
    # The model is exact here, so every sample gets its faster kernel.
    assert all(s.balanced_us == min(s.kernel_us().values()) for s in timed)


def test_no_second_kernel_where_one_wins_every_mix():
    samples = [RaggedSample(s.batch, s.mix, s.lens, s.split_us, s.balanced_us, "plain",
                            (("plain", s.kernel_us()["plain"]),
                             ("fitted", 1.5 * max(s.kernel_us().values()))))
               for s in synthetic_samples()]
    kernels, alternates, _ = choose_kernel_pairs(samples, model_from(samples))
    assert kernels == {32: "plain", 64: "plain"} and alternates == {32: "", 64: ""}


def ladder_with_alternates(samples) -> BucketLadder:
    model = model_from(samples)
    switches, _ = choose_switches(samples, [(16384, 131072)], model)
    ladder = BucketLadder((Bucket(16384, 16384), Bucket(131072, 131072)), 131072)
    tuned = ladder.with_ragged_switches(switches)
    tuned.meta["balanced_cost"] = model.to_dict()
    return tuned


def test_the_selector_replays_the_alternate_the_model_predicts_faster(tmp_path: Path):
    samples = synthetic_samples()
    ladder = ladder_with_alternates(samples)
    path = tmp_path / "ladder.json"
    ladder.save(path)
    loaded = BucketLadder.load(path)
    assert loaded == ladder and loaded.balanced_cost is not None
    sel = GraphSelector(loaded, [1, 8, 32, 64])
    alternates = [k for k in sel.keys() if k.alternate]
    assert {k.batch_size for k in alternates} == {32, 64}
    assert all(k.balanced and sel.key(k.batch_size, k.bucket, alternate=True) == k
               for k in alternates)
    model = loaded.balanced_cost
    seen = set()
    for s in samples:
        key = sel.choose(list(s.lens))
        if not key.balanced:
            continue
        main, alt = sel.alternate_kernels(key)
        faster = alt if model.predict(alt, key.batch_size, s.lens) < model.predict(
            main, key.batch_size, s.lens) else main
        assert balanced_kernel_of(sel, key) == faster
        seen.add(key.alternate)
    assert seen == {False, True}
    with pytest.raises(KeyError, match="no alternate"):
        sel.key(8, 1, alternate=True)


def model_pick(sel: GraphSelector, lens) -> bool:
    """Whether the cost model predicts the alternate faster for ``lens``."""
    key = sel.choose(list(lens))
    main, alt = sel.alternate_kernels(key)
    model = sel.ladder.balanced_cost
    return model.predict(alt, key.batch_size, lens) < model.predict(main, key.batch_size, lens)


def test_the_two_kernel_pick_is_remembered_across_decode_steps():
    ladder = ladder_with_alternates(synthetic_samples())
    weighed = [list(s.lens) for s in synthetic_samples()
               if GraphSelector(ladder, [32, 64]).choose(list(s.lens)).balanced]
    assert weighed
    for lens in weighed:
        sel = GraphSelector(ladder, [32, 64])
        first = sel.choose(lens)
        assert first.alternate == model_pick(sel, lens) and sel.remembered_picks == 1
        # Fifty decode steps (every length one token longer): a model run only where the
        # total or the longest length crosses one of its 1/128 steps, or the shortest a
        # 64-token tile.
        steps = [[n + t for n in lens] for t in range(1, 51)]
        assert all(sel.choose(step).balanced for step in steps)
        crossings = (50 * len(lens) * 128 // sum(lens) + 1 + 50 * 128 // max(lens) + 1
                     + 50 // 64 + 1)
        assert 1 <= sel.remembered_picks <= 1 + crossings < 26
        # The same step as numpy lengths and numpy scalars: the same remembered pick.
        arr = np.array(steps[-1])
        assert sel.key_for(len(arr), arr.min(), arr.max(), arr) == sel.choose(steps[-1])
        # Another live count is another batch: the model runs again.
        runs, shorter = sel.remembered_picks, lens[:-1] + [0]
        assert sel.choose(shorter).alternate == model_pick(sel, shorter)
        assert sel.remembered_picks == runs + 1


def test_a_shorter_request_crossing_a_tile_is_another_batch():
    """Short requests of one length that cross a 64-token tile together move the kernels'
    partitions (and the model's prediction) by a step; the same live count, total and
    longest length do not tell those batches apart, the shortest length's tiles do."""
    ladder = ladder_with_alternates(synthetic_samples())
    sel = GraphSelector(ladder, [32, 64])
    before = [832] * 62 + [900, 50000]  # the short ones hold 13 tiles
    after = [833] * 62 + [838, 50000]  # 14 tiles; the same total and longest length
    assert sum(before) == sum(after) and sel.choose(before).balanced
    assert sel.alternate_kernels(sel.choose(before)) is not None
    sel.choose(before)
    assert sel.remembered_picks == 1
    assert sel.choose(after).alternate == model_pick(sel, after)
    assert sel.remembered_picks == 2


def test_without_remembering_every_weighed_step_runs_the_model():
    ladder = ladder_with_alternates(synthetic_samples())
    sel = GraphSelector(ladder, [32, 64], remember_picks=False)
    picks = set()
    for s in synthetic_samples():
        for t in range(0, 400, 37):
            lens = [n + t for n in s.lens] if max(s.lens) + t <= 131072 else list(s.lens)
            key = sel.choose(lens)
            if key.balanced:
                assert key.alternate == model_pick(sel, lens)
                picks.add(key.alternate)
        assert sel.remembered_picks == 0
    assert picks == {False, True}


def test_alternates_need_a_cost_model_and_another_kernel():
    bucket = Bucket(100, 100, balanced_imbalance=1.5, alternate_kernels={8: "seesaw"})
    assert bucket.alternate_kernel_for(4) is None and bucket.alternate_kernel_for(8) == "seesaw"
    with pytest.raises(ValueError, match="no meta\\['balanced_cost'\\]"):
        BucketLadder.from_dict({"max_model_len": 100, "buckets": [bucket.to_dict()]})
    with pytest.raises(ValueError, match="the balanced kernel itself"):
        Bucket(100, 100, balanced_kernels={8: "seesaw"}, alternate_kernels={8: "seesaw"})
    with pytest.raises(TypeError, match="alternate_kernels"):
        Bucket(100, 100, alternate_kernels={8: 3})
    model = BalancedCostModel({"seesaw": KernelCost(0.0, (1.0, 1.0, 0.0, 0.0))},
                              {"seesaw": {8: PARTS["plain"]}})
    with pytest.raises(ValueError, match="needs the cost of 'default'"):
        BucketLadder.from_dict({"max_model_len": 100, "buckets": [bucket.to_dict()],
                                "meta": {"balanced_cost": model.to_dict()}})


def test_a_graph_table_refuses_a_model_fitted_on_other_partitions():
    # The synthetic kernels are not the backend's: name them as its kernels, with
    # partitions other than its plans.
    real = {"plain": "seesaw", "fitted": "seesaw-fitted"}
    samples = [RaggedSample(s.batch, s.mix, s.lens, s.split_us, s.balanced_us, "seesaw",
                            tuple((real[k], us) for k, us in s.by_kernel))
               for s in synthetic_samples()]
    backend = TritonBackend(num_sms=NUM_SMS)
    good = fit_cost_model(samples, lambda k, b: partition_of(
        backend.plan_balanced(b, 16, k), NUM_SMS), [1, 8, 32, 64])
    switches, _ = choose_switches(samples, [(16384, 131072)], good)
    ladder = BucketLadder((Bucket(16384, 16384), Bucket(131072, 131072)),
                          131072).with_ragged_switches(switches)
    ladder.meta["balanced_cost"] = good.to_dict()
    sel = GraphSelector(ladder, [1, 8, 32, 64])
    table = GraphTable(sel, backend, 16)  # plans only: no device needed
    assert any(k.alternate for k in table.plans)
    other = TritonBackend(num_sms=66)
    with pytest.raises(ValueError, match="fitted on 'seesaw"):
        check_cost_partitions(sel, {k: other.plan_balanced(k.batch_size, 16,
                                                           balanced_kernel_of(sel, k))
                                    for k in table.plans if k.balanced})
