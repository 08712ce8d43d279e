from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import graphbucket
from graphbucket.backends import DecodeBackend, Plan, backend_names, get_backend
from graphbucket.ladder import default_ladder
from graphbucket.plan import H200_NUM_SMS
from graphbucket.reference import masked_mla_decode, mla_decode_reference
from graphbucket.sparse.backend import sparse_ladder
from tests._toy import rel_l2

RANK, ROPE, HEADS, PAGE = 64, 16, 16, 16
SM_SCALE = 0.125
DIMS = {"kv_lora_rank": RANK, "qk_rope_dim": ROPE}


def _case(seq_lens, device, *, num_pages=32, max_pages=20, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    bs = len(seq_lens)
    q = torch.randn(bs, HEADS, RANK + ROPE, generator=g).to(device, dtype)
    kv = torch.randn(num_pages, PAGE, RANK + ROPE, generator=g).to(device, dtype)
    table = torch.stack([torch.randperm(num_pages, generator=g)[:max_pages] for _ in range(bs)])
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return q, kv, table.to(torch.int32).to(device), lens.to(device)


def _run(backend, case, hint):
    q, kv, table, lens = case
    plan = backend.plan(q.shape[0], HEADS, hint)
    ws = backend.workspace_spec([plan]).allocate(q.device)
    out = torch.full((q.shape[0], HEADS, RANK), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[0], HEADS), float("nan"), device=q.device)
    backend.run(q, kv, table, lens, out, ws, plan=plan, sm_scale=SM_SCALE, lse=lse)
    return plan, out, lse


def test_unknown_backend_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown decode backend 'cutlass'.*triton"):
        get_backend("cutlass")


def test_aiter_absent_says_how_to_get_it():
    if importlib.util.find_spec("aiter") is not None:
        pytest.skip("aiter is installed here")
    with pytest.raises(ImportError, match="ROCm.*pip install aiter"):
        get_backend("aiter", page_size=PAGE, max_pages=4)


def test_backends_satisfy_the_protocol():
    for name in ("triton", "dense"):
        assert isinstance(get_backend(name, **DIMS), DecodeBackend)
    sparse = get_backend("sparse", num_heads=16, max_len=4096)
    assert isinstance(sparse, DecodeBackend) and type(sparse).__name__ == "SparseBackend"


def test_every_registered_backend_is_a_decode_backend_whose_plans_are_plans():
    kwargs = {"triton": DIMS, "dense": DIMS, "sparse": {"num_heads": HEADS, "max_len": 4096},
              "aiter": {"page_size": PAGE, "max_pages": 4, **DIMS}}
    assert set(kwargs) == set(backend_names()), "a new backend needs its arguments here"
    for name in backend_names():
        try:
            backend = get_backend(name, num_sms=8, **kwargs[name])
        except ImportError:  # aiter off ROCm
            continue
        assert isinstance(backend, DecodeBackend), name
        plan = backend.plan(2, HEADS, 1000)
        assert isinstance(plan, Plan) and plan == backend.plan(2, HEADS, 1000), name
        assert hash(plan) == hash(backend.plan(2, HEADS, 1000)) and plan.describe()
        assert backend.default_ladder(4096).max_model_len == 4096
        assert backend.workspace_spec([plan]).nbytes >= 0


def test_each_backend_supplies_its_default_ladder():
    assert get_backend("triton", **DIMS).default_ladder(8192) == default_ladder(8192)
    assert get_backend("dense", **DIMS).default_ladder(8192) == default_ladder(8192)
    sparse = get_backend("sparse", num_heads=HEADS, max_len=8192, topk=64)
    assert sparse.default_ladder(8192) == sparse_ladder(8192, topk=64)
    assert sparse.default_ladder(8192) != default_ladder(8192)


def test_a_backend_without_balanced_graphs_says_so():
    assert get_backend("triton", num_sms=8, **DIMS).plan_balanced(4, HEADS).balanced
    with pytest.raises(ValueError, match="no balanced topology.*balanced_imbalance=0"):
        get_backend("sparse", num_heads=HEADS, max_len=4096).plan_balanced(4, HEADS)


@pytest.mark.parametrize("module", ["runner", "graphs"])
def test_the_runner_and_graph_table_reach_backends_through_the_protocol(module):
    # getattr / hasattr on a backend or model would mean the protocol misses a method.
    source = (Path(graphbucket.__file__).parent / f"{module}.py").read_text()
    assert "getattr(" not in source and "hasattr(" not in source


def test_triton_num_sms_defaults_to_h200_without_cuda():
    backend = get_backend("triton", **DIMS)
    if not torch.cuda.is_available():
        assert backend.num_sms == H200_NUM_SMS
    assert get_backend("triton", num_sms=3, **DIMS).num_sms == 3


def test_triton_workspace_covers_the_largest_plan():
    backend = get_backend("triton", num_sms=2, **DIMS)
    plans = [backend.plan(bs, HEADS, hint) for bs in (1, 2) for hint in (1, 300)]
    spec = backend.workspace_spec(plans)
    assert (spec.max_batch, spec.num_heads) == (2, HEADS)
    assert spec.max_splits == max(p.num_kv_splits for p in plans) > 1
    ws = spec.allocate("cpu")
    assert all(ws.fits(p) for p in plans)
    assert spec.nbytes == ws.partial_o.numel() * 4 + ws.partial_lse.numel() * 4
    one_split = backend.workspace_spec([backend.plan(1, HEADS, 1)])
    assert one_split.allocate("cpu") is None and one_split.nbytes == 0
    # Verify steps fold q_len x heads rows: one workspace covers every head count.
    mixed = [backend.plan(2, 16, 300), backend.plan(1, 32, 300)]
    spec = backend.workspace_spec(mixed)
    assert (spec.max_batch, spec.num_heads) == (2, 32)
    ws = spec.allocate("cpu")
    assert all(ws.fits(p) for p in mixed) and not ws.fits(backend.plan(1, 64, 300))


@pytest.mark.parametrize("name", ["triton", "dense"])
def test_any_hint_gives_the_reference_result(name, device):
    backend = get_backend(name, num_sms=2, **DIMS)
    case = _case([37, 300, 0], device)
    want, want_lse = mla_decode_reference(*(t.cpu() for t in case), kv_lora_rank=RANK,
                                          sm_scale=SM_SCALE)
    tol = 1e-2 if device == "cuda" else 1e-5
    splits = set()
    for hint in (1, 300):
        plan, out, lse = _run(backend, case, hint)
        splits.add(plan.num_kv_splits)
        assert rel_l2(out, want) < tol
        assert torch.equal(out[2].cpu(), torch.zeros_like(out[2].cpu()))  # padding row
        live_lse = lse.cpu().double()[:2]
        assert (live_lse - want_lse[:2]).abs().max().item() < 1e-2
        assert torch.isinf(lse[2]).all()
    assert min(splits) == 1 and max(splits) > 1


def test_reference_backend_ignores_stale_pages_past_the_length():
    q, kv, table, lens = _case([20, 5], "cpu")
    junk = table.clone()
    junk[:, 2:] = 10_000  # pages past each row's length: clamped, masked, harmless
    out, lse = masked_mla_decode(q, kv, junk, lens, kv_lora_rank=RANK, sm_scale=SM_SCALE)
    want, want_lse = mla_decode_reference(q, kv, table, lens, kv_lora_rank=RANK,
                                          sm_scale=SM_SCALE)
    assert rel_l2(out, want) < 1e-6
    assert (lse.double() - want_lse).abs().max().item() < 1e-5


@pytest.fixture
def fake_aiter(monkeypatch):
    """A stand-in ``aiter`` package that records the Gluon decode's arguments."""
    calls = []

    def mla_decode_gluon(q_nope, q_pe, kv_c, o, page_table, seq_info, sm_scale, **kw):
        calls.append({"q_nope": q_nope, "q_pe": q_pe, "kv_c": kv_c, "o": o,
                      "page_table": page_table.clone(), "seq_info": seq_info, **kw})

    names = ["aiter", "aiter.ops", "aiter.ops.triton", "aiter.ops.triton.gluon"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    leaf = types.ModuleType("aiter.ops.triton.gluon.mla_decode_gluon")
    leaf.mla_decode_gluon = mla_decode_gluon
    monkeypatch.setitem(sys.modules, leaf.__name__, leaf)
    monkeypatch.delitem(sys.modules, "graphbucket.backends.aiter", raising=False)
    yield calls
    sys.modules.pop("graphbucket.backends.aiter", None)


def test_aiter_hint_becomes_min_kv_seq_len(fake_aiter):
    backend = get_backend("aiter", page_size=PAGE, max_pages=4, **DIMS)
    plans = {hint: backend.plan(2, HEADS, hint) for hint in (1, 64, 4096)}
    assert [p.min_kv_seq_len for p in plans.values()] == [1, 64, 4096]
    assert len(set(plans.values())) == 3  # one graph per hint: AITER picks splits from it
    ws = backend.workspace_spec(plans.values()).allocate("cpu")
    q, kv, table, lens = _case([40, 9], "cpu", max_pages=4)
    out = torch.empty(2, HEADS, RANK)
    backend.run(q, kv, table, lens, out, ws, plan=plans[64], sm_scale=SM_SCALE)
    (call,) = fake_aiter
    assert call["min_kv_seq_len"] == 64 and call["kv_pe_offset"] == RANK
    tokens = np.arange(4 * PAGE)
    want = table.numpy()[:, tokens // PAGE] * PAGE + tokens % PAGE
    assert np.array_equal(call["page_table"].numpy(), want)
    assert call["kv_c"].shape == (32 * PAGE, RANK + ROPE) and call["o"] is out
