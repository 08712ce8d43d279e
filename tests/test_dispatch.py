from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from graphbucket.backends import get_backend
from graphbucket.batch import DecodeBatch
from graphbucket.buffers import StaticBuffers
from graphbucket.capture import GraphCapture, plan_table
from graphbucket.dispatch import Dispatcher, EagerExecutor
from tests._toy import LADDER, NUM_SMS, ToyMLA, rel_l2, toy_batch, toy_reference, toy_spec

SM_SCALE = 0.125
SIZES = [1, 2, 4]
MAX_PAGES = 24  # capacity 384 tokens: above the ladder's top, so the ladder check fires


def make_dispatcher(device, *, graphs=True, select_key="max"):
    backend = get_backend("reference", num_sms=NUM_SMS, kv_lora_rank=64, qk_rope_dim=16)
    plans = plan_table(backend, LADDER, SIZES, 16)
    spec = toy_spec(max_pages=MAX_PAGES, device=device)
    buffers = StaticBuffers.allocate(spec, max_batch_size=max(SIZES),
                                     workspace=backend.workspace_spec(plans.values()))
    model = ToyMLA(device=device)
    capture = None
    if graphs:
        capture = GraphCapture(model, buffers, backend, plans, sm_scale=SM_SCALE,
                               warmup_iters=int(device == "cuda"))
        capture.capture()
    eager = EagerExecutor(model, backend, buffers, sm_scale=SM_SCALE, max_model_len=320)
    return Dispatcher(buffers, LADDER, SIZES, capture, eager, select_key=select_key), model


def batch_of(lens, seed=0, **kw) -> DecodeBatch:
    return toy_batch(lens, rng=np.random.default_rng(seed), max_pages=MAX_PAGES, **kw)


def tol(device):
    return 1e-2 if device == "cuda" else 1e-5


@pytest.mark.parametrize("lens, padded, bucket", [
    ([5], 1, 0), ([32], 1, 0), ([33], 1, 1), ([300], 1, 2), ([60, 7], 2, 1),
    ([100, 5, 7], 4, 2), ([0, 320, 1], 4, 2), ([1, 2, 3, 32], 4, 0),
])
def test_selects_bucket_from_host_lengths_and_pads(device, lens, padded, bucket):
    dispatcher, model = make_dispatcher(device)
    batch = batch_of(lens)
    out = dispatcher.step(batch)
    assert out.shape == (len(lens), 32)
    assert out.data_ptr() == dispatcher.buffers.output.data_ptr()  # a view, not a copy
    assert rel_l2(out, toy_reference(model, batch, sm_scale=SM_SCALE)) < tol(device)
    stats = dispatcher.stats()
    assert stats.replays_by_bucket == {(padded, bucket): 1}
    assert stats.replays == {(padded, dispatcher.graphs.plans[(padded, bucket)]): 1}
    assert dispatcher.buffers.seq_lens[len(lens):padded].tolist() == [0] * (padded - len(lens))


def test_min_key_selects_the_shortest_live_request():
    dispatcher, _ = make_dispatcher("cpu", select_key="min")
    dispatcher.step(batch_of([300, 0, 10]))
    assert dispatcher.stats().replays_by_bucket == {(4, 0): 1}


def _bad_batches():
    ok = batch_of([30, 7])
    hidden = ok.inputs["hidden"]
    bad_table = ok.block_table_cpu.copy()
    bad_table[1, 0] = 64
    return {
        "above ladder top": (batch_of([321, 7]), ValueError, "above the ladder top"),
        "above capacity": (DecodeBatch([385], np.zeros((1, 24), np.int32), {"hidden": hidden[:1]}),
                           ValueError, "capacity"),
        "table outside cache": (DecodeBatch([30, 7], bad_table, {"hidden": hidden}),
                                ValueError, "outside the KV cache"),
        "input dtype": (DecodeBatch([30, 7], ok.block_table_cpu, {"hidden": hidden.half()}),
                        TypeError, "dtype torch.float16"),
        "input device": (DecodeBatch([30, 7], ok.block_table_cpu,
                                     {"hidden": torch.zeros(2, 32, device="meta")}),
                         TypeError, "is on meta"),
        "input shape": (DecodeBatch([30, 7], ok.block_table_cpu, {"hidden": hidden[:, :4]}),
                        ValueError, "has shape"),
        "device lengths": (DecodeBatch(torch.zeros(2, dtype=torch.int32, device="meta"),
                                       ok.block_table_cpu, {"hidden": hidden}),
                           TypeError, "host"),
        "oversized and bad": (batch_of([321, 1, 1, 1, 1]), ValueError, "above the ladder top"),
    }


@pytest.mark.parametrize("case", list(_bad_batches()))
def test_errors_raise_before_anything_is_staged_or_launched(device, case):
    dispatcher, model = make_dispatcher(device)
    dispatcher.step(batch_of([40, 3], seed=1))
    buffers = dispatcher.buffers
    before = [t.clone() for t in (buffers._arena, buffers.output, *buffers.staging_tensors())]
    calls = model.calls
    batch, exc, match = _bad_batches()[case]
    with pytest.raises(exc, match=match):
        dispatcher.step(batch)
    after = (buffers._arena, buffers.output, *buffers.staging_tensors())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert model.calls == calls
    stats = dispatcher.stats()
    assert (stats.errors, stats.steps, stats.eager_fallbacks) == (1, 1, 0)


def test_oversized_batch_falls_back_to_eager_counted_and_logged_once(device, caplog):
    dispatcher, model = make_dispatcher(device)
    with caplog.at_level(logging.WARNING, logger="graphbucket.dispatch"):
        for seed in range(2):
            batch = batch_of([200, 3, 70, 5, 1, 9][: 5 + seed], seed=seed)
            out = dispatcher.step(batch)
            assert out.shape == (5 + seed, 32)
            assert rel_l2(out, toy_reference(model, batch, sm_scale=SM_SCALE)) < tol(device)
    warnings = [r for r in caplog.records if "exceeds the largest capture size 4" in r.message]
    assert len(warnings) == 1
    stats = dispatcher.stats()
    assert (stats.eager_fallbacks, stats.steps, stats.replays) == (2, 2, {})


def test_eager_only_dispatcher_plans_every_step(device):
    dispatcher, model = make_dispatcher(device, graphs=False)
    for seed, lens in enumerate([[5], [300, 2, 1]]):
        batch = batch_of(lens, seed=seed)
        assert rel_l2(dispatcher.step(batch), toy_reference(model, batch, sm_scale=SM_SCALE)
                      ) < tol(device)
    stats = dispatcher.stats()
    assert (stats.eager_steps, stats.eager_fallbacks, stats.replays) == (2, 0, {})


def test_replay_path_never_reads_device_data(device, monkeypatch):
    dispatcher, model = make_dispatcher(device)
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
            outs.append(dispatcher.step(batch).clone())
    for out, want in zip(outs, wants, strict=True):
        assert rel_l2(out, want) < tol(device)
    assert dispatcher.stats().steps == 3


def test_capture_sizes_must_fit_the_buffers():
    dispatcher, _ = make_dispatcher("cpu", graphs=False)
    with pytest.raises(ValueError, match="capture size 8 exceeds"):
        Dispatcher(dispatcher.buffers, LADDER, [1, 8], None, dispatcher.eager)
    with pytest.raises(ValueError, match="select_key must be"):
        Dispatcher(dispatcher.buffers, LADDER, [1], None, dispatcher.eager, select_key="mean")


def test_min_key_with_padding_rows_and_counts_over_many_steps():
    dispatcher, _ = make_dispatcher("cpu", select_key="min")
    for _ in range(3):
        dispatcher.step(batch_of([0, 300, 40]))  # zeros are padding: min live length is 40
    dispatcher.step(batch_of([20]))
    assert dispatcher.stats().replays_by_bucket == {(4, 1): 3, (1, 0): 1}
    with pytest.raises(ValueError, match="above the ladder top"):
        dispatcher.step(batch_of([0, 321]))


def test_repeated_steps_return_the_same_static_view_until_close():
    dispatcher, _ = make_dispatcher("cpu")
    first = dispatcher.step(batch_of([5, 6]))
    second = dispatcher.step(batch_of([7, 8], seed=1))
    assert first.data_ptr() == second.data_ptr() == dispatcher.buffers.output.data_ptr()
    assert second.shape == (2, 32)
    dispatcher.close()
    assert dispatcher.step(batch_of([9])).shape == (1, 32)  # looked up again after close
