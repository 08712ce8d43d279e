"""GraphBucketRunner: validate -> choose -> stage -> replay (or eager), end to end."""

from __future__ import annotations

import gc
import logging
import os

import numpy as np
import pytest
import torch

from graphbucket import POLICIES, DecodeBatch, GraphBucketRunner, default_ladder, get_backend
from graphbucket.graphs import CaptureError
from graphbucket.ladder import Bucket, BucketLadder
from tests._toy import LADDER, NUM_SMS, ToyMLA, rel_l2, toy_batch, toy_reference, toy_spec

SM_SCALE = 0.125
ON_CPU = not torch.cuda.is_available()
MAX_PAGES = 24  # capacity 384 tokens: above the ladder's top, so the ladder check fires


def runner_for(policy, model, device, *, backend="dense", sizes=(1, 2), max_pages=20, **kw):
    backend = get_backend(backend, num_sms=NUM_SMS, kv_lora_rank=64, qk_rope_dim=16)
    runner = GraphBucketRunner.for_policy(
        policy, model, spec=toy_spec(device=device, max_pages=max_pages),
        batch_sizes=list(sizes), max_model_len=320, sm_scale=SM_SCALE, backend=backend,
        ladder=kw.pop("ladder", LADDER) if policy == "ladder" else None,
        warmup_iters=int(device == "cuda"),
        progress=False, **kw)
    runner.capture()
    return runner


def by_bucket(runner) -> dict[tuple[int, int], int]:
    """Replays per (padded batch size, bucket), split-KV and balanced graphs together."""
    counts: dict[tuple[int, int], int] = {}
    for k, n in runner.stats().replays.items():
        counts[(k.batch_size, k.bucket)] = counts.get((k.batch_size, k.bucket), 0) + n
    return counts


def batch_of(lens, seed=0, **kw) -> DecodeBatch:
    return toy_batch(lens, rng=np.random.default_rng(seed), max_pages=MAX_PAGES, **kw)


def tol(device):
    return 1e-2 if device == "cuda" else 1e-5


def test_end_to_end_across_bucket_boundaries_matches_the_reference(device):
    model = ToyMLA(device=device)
    runner = runner_for("ladder", model, device, backend="triton")
    rng = np.random.default_rng(0)
    steps = [[20, 10], [40, 30], [64, 50], [100, 60], [320, 270], [300]]
    for lens in steps:  # lengths grow step by step: buckets 0, 1, 1, 2, 2, then batch 1
        batch = toy_batch(lens, rng=rng)
        want = toy_reference(model, batch, sm_scale=SM_SCALE)
        assert rel_l2(runner.step(batch), want) < tol(device), lens
    assert by_bucket(runner) == {(2, 0): 1, (2, 1): 2, (2, 2): 2, (1, 2): 1}
    assert sum(runner.stats().replays.values()) == runner.stats().steps == len(steps)
    runner.close()


def test_ragged_batches_replay_the_balanced_graph_and_match_the_reference(device):
    model = ToyMLA(device=device)
    ladder = BucketLadder([Bucket(32, 32), Bucket(64, 64),
                           Bucket(320, 320, balanced_imbalance=1.5)], 320)
    runner = runner_for("ladder", model, device, backend="triton", sizes=(1, 4),
                        ladder=ladder, max_pages=MAX_PAGES)
    balanced = [r for r in runner.records if r.plan.balanced]
    assert [(r.batch_size, r.buckets) for r in balanced] == [(4, (2,))]
    rng = np.random.default_rng(5)
    # ragged (imbalance 2.7), uniform, ragged with a padding row, one request.
    steps = [([300, 10, 20], True), ([300, 290, 280, 270], False),
             ([320, 0, 1, 64], True), ([310], False)]
    for lens, want_balanced in steps:
        batch = toy_batch(lens, rng=rng, max_pages=MAX_PAGES)
        before = runner.stats().replays
        got = runner.step(batch)
        assert rel_l2(got, toy_reference(model, batch, sm_scale=SM_SCALE)) < tol(device), lens
        (key,) = [k for k, n in runner.stats().replays.items() if n != before.get(k, 0)]
        assert key.balanced == want_balanced and key.bucket == 2, (lens, key)
    runner.close()


@pytest.mark.parametrize("lens, padded, bucket", [
    ([5], 1, 0), ([32], 1, 0), ([33], 1, 1), ([300], 1, 2), ([60, 7], 2, 1),
    ([100, 5, 7], 4, 2), ([0, 320, 1], 4, 2), ([1, 2, 3, 32], 4, 0),
])
def test_selects_bucket_from_host_lengths_and_pads(device, lens, padded, bucket):
    model = ToyMLA(device=device)
    runner = runner_for("ladder", model, device, sizes=(1, 2, 4), max_pages=MAX_PAGES)
    batch = batch_of(lens)
    out = runner.step(batch)
    assert out.shape == (len(lens), 32)
    assert out.data_ptr() == runner.buffers.output.data_ptr()  # a view, not a copy
    assert rel_l2(out, toy_reference(model, batch, sm_scale=SM_SCALE)) < tol(device)
    (key,) = runner.stats().replays
    assert (key.batch_size, key.bucket, key.hint) == (padded, bucket, LADDER.hints[bucket])
    assert runner.buffers.seq_lens[len(lens):padded].tolist() == [0] * (padded - len(lens))


def test_min_rule_selects_the_shortest_live_request():
    runner = runner_for("ladder", ToyMLA(), "cpu", sizes=(1, 2, 4), max_pages=MAX_PAGES,
                        rule="min")
    for _ in range(3):
        runner.step(batch_of([0, 300, 40]))  # zeros are padding: min live length is 40
    runner.step(batch_of([20]))
    runner.step(batch_of([300, 0, 10]))
    assert by_bucket(runner) == {(4, 1): 3, (1, 0): 1, (4, 0): 1}
    with pytest.raises(ValueError, match="above the ladder top"):
        runner.step(batch_of([0, 321]))


def test_policies_compute_the_same_answer(device):
    model = ToyMLA(device=device)
    runners = {p: runner_for(p, model, device) for p in POLICIES}
    assert runners["eager"].is_eager and runners["eager"].capture() is None
    assert runners["eager"].records == []
    assert {r.plan.num_kv_splits for r in runners["fixed-1"].records} == {1}
    backend = runners["fixed-max"].backend
    assert [r.plan for r in runners["fixed-max"].records] == [backend.plan(2, 16, 320),
                                                              backend.plan(1, 16, 320)]
    rng = np.random.default_rng(1)
    for lens in ([3], [300, 20], [64, 65]):
        batch = toy_batch(lens, rng=rng)
        want = toy_reference(model, batch, sm_scale=SM_SCALE)
        for policy, runner in runners.items():
            assert rel_l2(runner.step(batch), want) < tol(device), policy
    assert runners["eager"].stats().eager_steps == 3
    assert by_bucket(runners["fixed-1"]) == {(1, 0): 1, (2, 0): 2}


@pytest.mark.skipif(not ON_CPU, reason="spies on Python launches; CUDA replays run none")
def test_fixed_1_replays_one_split_at_a_long_length(monkeypatch):
    model = ToyMLA()
    runner = runner_for("fixed-1", model, "cpu", backend="triton", sizes=(1,))
    (record,) = runner.records
    assert record.plan.num_kv_splits == 1 and runner.backend.plan(1, 16, 300).num_kv_splits > 1
    launched = []
    real_run = runner.backend.run
    monkeypatch.setattr(runner.backend, "run",
                        lambda *a, **kw: launched.append(kw["plan"]) or real_run(*a, **kw))
    monkeypatch.setattr(runner.backend, "plan", lambda *a: pytest.fail("a replay planned"))
    batch = toy_batch([300], rng=np.random.default_rng(2))
    out = runner.step(batch)
    assert [p.num_kv_splits for p in launched] == [1, 1]  # both layers, frozen at one split
    assert rel_l2(out, toy_reference(model, batch, sm_scale=SM_SCALE)) < 1e-5


def _bad_batches():
    ok = batch_of([30, 7])
    hidden = ok.inputs["hidden"]
    bad_table = ok.block_table_cpu.copy()
    bad_table[1, 0] = 64
    table = ok.block_table_cpu
    return {
        "above ladder top": (batch_of([321, 7]), ValueError, "above the ladder top"),
        "above capacity": (DecodeBatch([385], np.zeros((1, 24), np.int32), {"hidden": hidden[:1]}),
                           ValueError, "capacity"),
        "table outside cache": (DecodeBatch([30, 7], bad_table, {"hidden": hidden}),
                                ValueError, "outside the KV cache"),
        "int64 table outside cache": (DecodeBatch([30, 7], bad_table.astype(np.int64) + 2**32,
                                                  {"hidden": hidden}),
                                      ValueError, "outside the KV cache"),
        "oversized, table outside cache": (DecodeBatch([30] * 5, np.full((5, 2), -3, np.int32),
                                                       {"hidden": torch.zeros(5, 32)}),
                                           ValueError, "outside the KV cache"),
        "input dtype": (DecodeBatch([30, 7], table, {"hidden": hidden.half()}),
                        TypeError, "dtype torch.float16"),
        "input device": (DecodeBatch([30, 7], table, {"hidden": torch.zeros(2, 32, device="meta")}),
                         TypeError, "is on meta"),
        "input shape": (DecodeBatch([30, 7], table, {"hidden": hidden[:, :4]}),
                        ValueError, "has shape"),
        "0-d input": (DecodeBatch([30], table[:1], {"hidden": torch.tensor(1.0)}),
                      ValueError, "has shape"),
        "inputs as a list": (DecodeBatch([30, 7], table, [hidden]), TypeError, "mapping"),
        "position too large": (DecodeBatch([30, 7], table, {"hidden": hidden},
                                           positions_cpu=[10**6, 6]), ValueError, "positions_cpu"),
        "negative position": (DecodeBatch([30, 7], table, {"hidden": hidden},
                                          positions_cpu=[29, -5]), ValueError, "positions_cpu"),
        "device lengths": (DecodeBatch(torch.zeros(2, dtype=torch.int32, device="meta"),
                                       table, {"hidden": hidden}), TypeError, "host"),
        "0-d lengths": (DecodeBatch(torch.tensor(5), table[:1], {"hidden": hidden[:1]}),
                        ValueError, "dimension"),
        "oversized and bad": (batch_of([321, 1, 1, 1, 1]), ValueError, "above the ladder top"),
    }


@pytest.mark.parametrize("case", list(_bad_batches()))
def test_errors_raise_before_anything_is_staged_or_launched(device, case):
    model = ToyMLA(device=device)
    runner = runner_for("ladder", model, device, sizes=(1, 2, 4), max_pages=MAX_PAGES)
    runner.step(batch_of([40, 3], seed=1))
    buffers = runner.buffers
    # What graphs read and write (host staging memory is scratch, not compared).
    static = (buffers.seq_lens, buffers.positions, buffers.block_table, buffers.output,
              *buffers.inputs.values())
    before = [t.clone() for t in static]
    calls = model.calls
    batch, exc, match = _bad_batches()[case]
    with pytest.raises(exc, match=match):
        runner.step(batch)
    assert all(torch.equal(a, b) for a, b in zip(before, static, strict=True))
    assert model.calls == calls
    stats = runner.stats()
    assert (stats.errors, stats.steps, stats.eager_fallbacks) == (1, 1, 0)


def test_oversized_batch_falls_back_to_eager_counted_and_logged_once(device, caplog):
    model = ToyMLA(device=device)
    runner = runner_for("ladder", model, device, sizes=(1, 2, 4), max_pages=MAX_PAGES)
    with caplog.at_level(logging.WARNING, logger="graphbucket.runner"):
        for seed in range(2):
            batch = batch_of([200, 3, 70, 5, 1, 9][: 5 + seed], seed=seed)
            out = runner.step(batch)
            assert out.shape == (5 + seed, 32)
            assert rel_l2(out, toy_reference(model, batch, sm_scale=SM_SCALE)) < tol(device)
    warnings = [r for r in caplog.records if "exceeds the largest capture size 4" in r.message]
    assert len(warnings) == 1
    stats = runner.stats()
    assert (stats.eager_fallbacks, stats.steps, stats.replays) == (2, 2, {})


def test_eager_runner_plans_every_step(device):
    model = ToyMLA(device=device)
    runner = runner_for("eager", model, device, sizes=(1, 2, 4), max_pages=MAX_PAGES)
    for seed, lens in enumerate([[5], [300, 2, 1]]):
        batch = batch_of(lens, seed=seed)
        assert rel_l2(runner.step(batch), toy_reference(model, batch, sm_scale=SM_SCALE)
                      ) < tol(device)
    with pytest.raises(ValueError, match="above the ladder top"):
        runner.step(batch_of([321]))
    stats = runner.stats()
    assert (stats.eager_steps, stats.eager_fallbacks, stats.replays, stats.errors) == (2, 0, {}, 1)


def test_replay_path_never_reads_device_data(device, monkeypatch):
    model = ToyMLA(device=device)
    runner = runner_for("ladder", model, device, sizes=(1, 2, 4), max_pages=MAX_PAGES)
    batches = [batch_of(lens, seed=i) for i, lens in enumerate([[5], [300, 7], [64, 65, 66]])]
    wants = [toy_reference(model, b, sm_scale=SM_SCALE) for b in batches]

    def forbidden(*args, **kwargs):
        raise AssertionError("the replay path read device data or synchronized")

    outs = []
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "cpu"):
            m.setattr(torch.Tensor, name, forbidden)
        m.setattr(torch.cuda, "synchronize", forbidden)
        m.setattr(torch, "tensor", forbidden)
        for batch in batches:
            outs.append(runner.step(batch).clone())
    for out, want in zip(outs, wants, strict=True):
        assert rel_l2(out, want) < tol(device)
    assert runner.stats().steps == 3


def test_repeated_steps_return_the_same_static_view():
    runner = runner_for("ladder", ToyMLA(), "cpu")
    first = runner.step(batch_of([5, 6]))
    second = runner.step(batch_of([7, 8], seed=1))
    assert first.data_ptr() == second.data_ptr() == runner.buffers.output.data_ptr()
    assert second.shape == (2, 32)


def test_lifecycle_errors():
    model = ToyMLA()
    backend = get_backend("dense", num_sms=NUM_SMS, kv_lora_rank=64, qk_rope_dim=16)
    runner = GraphBucketRunner(model, spec=toy_spec(), batch_sizes=[1], ladder=LADDER,
                               sm_scale=SM_SCALE, backend=backend, progress=False)
    batch = toy_batch([5], rng=np.random.default_rng(0))
    with pytest.raises(RuntimeError, match="capture"):
        runner.step(batch)
    with runner:
        runner.capture()
        runner.step(batch)
    with pytest.raises(RuntimeError, match="closed"):
        runner.step(batch)
    runner.close()  # idempotent


@pytest.mark.interpreter  # the CUDA twin: test_gpu_capture_fault_releases_every_graph_...
def test_a_forward_fault_in_capture_leaves_a_runner_to_close_and_a_new_one_works():
    model = ToyMLA()
    calls = {"n": 0}

    def fails_at_third_graph(ctx):  # one warm-up call per graph (a CPU capture runs none)
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected forward fault")
        return model(ctx)

    backend = get_backend("triton", num_sms=NUM_SMS, kv_lora_rank=64, qk_rope_dim=16)
    faulty = GraphBucketRunner(fails_at_third_graph, spec=toy_spec(), batch_sizes=[1, 2],
                               ladder=LADDER, sm_scale=SM_SCALE, backend=backend,
                               progress=False)
    with pytest.raises(CaptureError, match=r"capturing graph 3/4 \(bs=1, .*injected forward "
                       "fault.*released") as err:
        faulty.capture()
    assert isinstance(err.value.__cause__, RuntimeError)
    assert faulty.records == [] and calls["n"] == 3
    with pytest.raises(RuntimeError, match="call capture"):
        faulty.step(batch_of([5]))
    faulty.close()
    runner = runner_for("ladder", model, "cpu", backend="triton")
    batch = batch_of([300, 40])
    assert rel_l2(runner.step(batch), toy_reference(model, batch, sm_scale=SM_SCALE)) < 1e-5
    runner.close()


def test_construction_errors_name_the_cause():
    backend = get_backend("dense", kv_lora_rank=64, qk_rope_dim=16)
    with pytest.raises(ValueError, match="above the buffers' capacity 320"):
        GraphBucketRunner(ToyMLA(), spec=toy_spec(), batch_sizes=[1], sm_scale=SM_SCALE,
                          ladder=default_ladder(4096), backend=backend)
    with pytest.raises(ValueError, match="capture_sizes must be positive"):
        runner_for("ladder", ToyMLA(), "cpu", sizes=(0, 2))
    with pytest.raises(ValueError, match="needs max_model_len"):
        GraphBucketRunner(ToyMLA(), spec=toy_spec(), batch_sizes=[1], sm_scale=SM_SCALE,
                          ladder=None, backend=backend)
    with pytest.raises(ValueError, match="rule must be one of"):
        runner_for("ladder", ToyMLA(), "cpu", rule="mean")


# ---- GPU (H200): bf16, DeepSeek-shaped attention (16 heads, rank 512, rope 64), page 64 ----

GPU_MML, GPU_PAGE, GPU_PAGES, GPU_HIDDEN = 32768, 64, 4096, 256
GPU_SIZES = [1, 2, 8, 32]


@pytest.fixture(scope="module")
def gpu_model():
    return ToyMLA(num_pages=GPU_PAGES, dtype=torch.bfloat16, device="cuda", rank=512, rope=64,
                  hidden=GPU_HIDDEN, page=GPU_PAGE)


def gpu_runner(policy, model, *, backend="triton", sizes=GPU_SIZES, capture=True):
    spec = toy_spec(max_pages=GPU_MML // GPU_PAGE, num_pages=GPU_PAGES, dtype=torch.bfloat16,
                    device="cuda", page=GPU_PAGE, hidden=GPU_HIDDEN)
    runner = GraphBucketRunner.for_policy(
        policy, model, spec=spec, batch_sizes=list(sizes), max_model_len=GPU_MML,
        sm_scale=SM_SCALE, backend=get_backend(backend, device="cuda") if backend == "triton"
        else get_backend(backend), progress=False)
    if capture:
        runner.capture()
    return runner


def gpu_batch(lens, rng, *, input_device="cpu"):
    return toy_batch(lens, rng=rng, max_pages=GPU_MML // GPU_PAGE, num_pages=GPU_PAGES,
                     dtype=torch.bfloat16, hidden=GPU_HIDDEN, page=GPU_PAGE,
                     input_device=input_device)


@pytest.fixture(scope="module")
def gpu_runners(gpu_model):
    runners = {"ladder": gpu_runner("ladder", gpu_model), "eager": gpu_runner("eager", gpu_model),
               "reference": gpu_runner("eager", gpu_model, backend="dense")}
    yield runners
    for runner in runners.values():
        runner.close()


@pytest.mark.gpu
def test_gpu_every_bucket_and_batch_size_matches_eager_and_reference(gpu_runners):
    ladder, rng = gpu_runners["ladder"].ladder, np.random.default_rng(0)
    for bucket, (lo, hi) in enumerate(ladder.ranges):
        for bs in GPU_SIZES:
            for _ in range(2):
                lens = rng.integers(lo, hi + 1, size=bs).tolist()
                batch = gpu_batch(lens, rng)
                before = by_bucket(gpu_runners["ladder"])
                got = gpu_runners["ladder"].step(batch).clone()
                eager = gpu_runners["eager"].step(batch).clone()
                ref = gpu_runners["reference"].step(batch).clone()
                assert rel_l2(got, ref) < 1e-2 and rel_l2(got, eager) < 1e-2, (bucket, bs, lens)
                after = by_bucket(gpu_runners["ladder"])
                assert after[(bs, bucket)] == before.get((bs, bucket), 0) + 1


def _kernel_names(runner, batch):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.step(batch)
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages()}


@pytest.mark.gpu
def test_gpu_hint_1_graph_has_one_split_and_no_merge(gpu_model):
    fixed_1 = gpu_runner("fixed-1", gpu_model, sizes=[1])
    fixed_max = gpu_runner("fixed-max", gpu_model, sizes=[1])
    assert [r.plan.num_kv_splits for r in fixed_1.records] == [1]
    assert not fixed_1.records[0].plan.use_stage2
    assert fixed_max.records[0].plan.num_kv_splits > 1
    batch = gpu_batch([30000], np.random.default_rng(1))
    assert rel_l2(fixed_1.step(batch).clone(), fixed_max.step(batch).clone()) < 1e-2
    one, many = _kernel_names(fixed_1, batch), _kernel_names(fixed_max, batch)
    if not any("stage1" in name for name in one | many):
        pytest.skip("the profiler does not report kernels inside graph replays here")
    assert not any("merge" in name for name in one), sorted(one)
    assert any("merge" in name for name in many), sorted(many)
    fixed_1.close()
    fixed_max.close()


@pytest.mark.gpu
def test_gpu_1000_random_steps_sync_free_pinned_and_memory_flat(gpu_runners):
    runner, eager = gpu_runners["ladder"], gpu_runners["eager"]
    assert all(t.is_pinned() for t in runner.buffers.staging_tensors())
    rng = np.random.default_rng(2)
    bounds = runner.ladder.bounds
    baseline = None
    for step in range(1000):
        bs = int(rng.integers(1, max(GPU_SIZES) + 1))
        lens = rng.integers(1, bounds[rng.integers(len(bounds))] + 1, size=bs).tolist()
        batch = gpu_batch(lens, rng, input_device="cuda" if step % 2 else "cpu")
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = runner.step(batch).clone()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert rel_l2(got, eager.step(batch)) < 1e-2, (step, lens)
        del got, batch  # a device-side input would otherwise count against the baseline
        if step == 10:
            torch.cuda.synchronize()
            baseline = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= baseline
    stats = runner.stats()
    assert stats.errors == 0 and stats.eager_fallbacks == 0


def _fill_device(leave: int) -> list[torch.Tensor]:
    """Allocate all but about ``leave`` bytes of the device."""
    blocks = []
    size = torch.cuda.mem_get_info()[0] - leave
    while size > 16 << 20:
        try:
            blocks.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
            size = torch.cuda.mem_get_info()[0] - leave
        except torch.cuda.OutOfMemoryError:
            size //= 2
    return blocks


class FaultAtGraph:
    """The model, failing inside the first capture of the ``k``-th graph (a plan's graphs
    share one warm-up, then capture without a copy and once per staging slot): ``"raise"``
    raises from the forward; ``"oom"`` fills the device at that graph's warm-up, then asks
    for 256 MiB inside the capture (more than the filled device has left, and than the
    shared pool holds)."""

    def __init__(self, model, k: int, mode: str) -> None:
        self.model, self.k, self.mode = model, k, mode
        self.warmups = self.captures = 0
        self.filler: list[torch.Tensor] = []

    def __call__(self, ctx):
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing:
            self.captures += 1
        else:
            self.warmups += 1
        out = self.model(ctx)
        at_k = self.warmups == self.k  # the k-th graph warmed up: its captures follow
        if self.mode == "raise" and capturing and at_k:
            raise RuntimeError("injected forward fault")
        if self.mode == "oom" and not capturing and at_k:
            self.filler = _fill_device(leave=64 << 20)
        if self.mode == "oom" and capturing and at_k:
            extra = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
            out = out + extra[:1].float().sum().to(out.dtype) * 0
        return out


def _chain(exc: BaseException) -> list[BaseException]:
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["raise", "oom"])
def test_gpu_capture_fault_releases_every_graph_and_a_new_runner_replays(gpu_model, mode):
    if mode == "oom" and os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("fills the device, which would fail the tests other processes run on it: "
                    "run it alone, pytest tests/test_runner.py -k 'capture_fault and oom'")
    # A first capture sets up the shared capture stream's per-stream library state (the
    # cuBLAS workspace), which outlives any one capture.
    gpu_runner("fixed-1", gpu_model, sizes=[1]).close()
    faulty = FaultAtGraph(gpu_model, 3, mode)
    runner = gpu_runner("ladder", faulty, capture=False)
    assert len(runner.graphs.capture_order()) > 3
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with pytest.raises(CaptureError, match=r"capturing graph 3/\d+ \(bs=\d+, q_len=1, .*"
                       r"GraphKey\(") as err:
        runner.capture()
    want = RuntimeError if mode == "raise" else torch.cuda.OutOfMemoryError
    assert any(isinstance(e, want) for e in _chain(err.value.__cause__)), _chain(err.value)
    assert faulty.warmups == 3 and faulty.captures == 2 * (1 + runner.buffers.num_staging_slots) + 1
    faulty.filler.clear()
    del err
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert runner.records == [] and runner.graphs.summary is None
    runner.close()
    fresh = gpu_runner("ladder", gpu_model)
    eager = gpu_runner("eager", gpu_model)
    rng = np.random.default_rng(7)
    for lens in ([5], [30000, 10], [700] * 8, list(rng.integers(1, GPU_MML, size=32))):
        batch = gpu_batch(lens, rng)
        assert rel_l2(fresh.step(batch).clone(), eager.step(batch)) < 1e-2, lens
    assert sum(fresh.stats().replays.values()) == 4
    fresh.close()
    eager.close()
