"""CPU tests of the AITER sparse backend (no AITER, no ROCm needed).

The index building is checked against plain Python loops; the backend's step runs with a
stand-in for AITER's three functions (a float64 attention over ``kv_indices``), so what
is tested is what graphbucket hands AITER, not AITER itself.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from graphbucket.backends.aiter import WORK_BUFFERS
from graphbucket.kernels.verify import flatten_verify
from graphbucket.sparse import aiter_backend, quantize_index_keys
from graphbucket.sparse.aiter_backend import (
    AiterSparseBackend,
    AiterSparseWorkspace,
    fill_sparse_kv_indices,
)
from graphbucket.sparse.reference import sparse_attention_reference
from tests.kernel_cases import KV_LORA_RANK, SM_SCALE, make_case, rel_l2

PAGE = 4
HEADS = 16  # AITER's sparse decode takes multiples of 16


def expected(indices, sparse_lens, table, page_size):
    """(kv_indptr, flat slots) by hand: row r's live positions, in order, as token slots."""
    indptr, slots = [0], []
    for pos, n, row in zip(indices, sparse_lens, table, strict=True):
        slots += [row[p // page_size] * page_size + p % page_size for p in pos[:n]]
        indptr.append(indptr[-1] + n)
    return indptr, slots


def random_rows(lens, topk, rng):
    """Top-k-shaped positions: min(len, topk) distinct positions < len, then -1."""
    rows = []
    for n in lens:
        pos = rng.sample(range(n), min(n, topk))
        rows.append(pos + [-1] * (topk - len(pos)))
    return rows, [min(n, topk) for n in lens]


def check(indices, sparse_lens, table, *, junk=-7):
    rows, k = len(indices), len(indices[0])
    kv_indptr = torch.full((rows + 1,), junk, dtype=torch.int32)
    kv_indices = torch.full((rows * k,), junk, dtype=torch.int32)
    fill_sparse_kv_indices(torch.tensor(indices, dtype=torch.int32),
                           torch.tensor(sparse_lens, dtype=torch.int32),
                           torch.tensor(table, dtype=torch.int32), page_size=PAGE,
                           kv_indptr=kv_indptr, kv_indices=kv_indices)
    want_indptr, want_slots = expected(indices, sparse_lens, table, PAGE)
    assert kv_indptr.tolist() == want_indptr
    assert kv_indices.tolist() == want_slots + [0] * (rows * k - len(want_slots))
    return kv_indptr, kv_indices


@pytest.mark.host
def test_slots_by_hand():
    # Row 0: below top-k; row 1: padding; row 2: above top-k (positions unordered).
    kv_indptr, kv_indices = check([[0, 5, 2, -1], [-1] * 4, [9, 1, 12, 4]], [3, 0, 4],
                                  [[7, 2, -1, -1], [-1] * 4, [3, 8, 6, 11]])
    assert kv_indptr.tolist() == [0, 3, 3, 7]
    assert kv_indices[:7].tolist() == [28, 9, 30, 25, 13, 44, 32]


@pytest.mark.host
def test_ragged_rows_against_python():
    rng = random.Random(0)
    for _ in range(40):
        rows, cols, topk = rng.randint(1, 6), rng.randint(1, 5), rng.choice([1, 3, 8])
        lens = [min(rng.choice([0, 1, topk, rng.randint(0, cols * PAGE)]), cols * PAGE)
                for _ in range(rows)]
        pages = rng.sample(range(rows * cols + 5), rows * cols)  # scattered pages
        table = [pages[r * cols:(r + 1) * cols] for r in range(rows)]
        indices, sparse_lens = random_rows(lens, topk, rng)
        check(indices, sparse_lens, table)


@pytest.mark.host
def test_verify_rows_have_their_own_limits():
    # q_len 2: flat rows b*2 + j share request b's pages, with causal limits len - 1 + j.
    rng = random.Random(1)
    table = torch.tensor([[5, 1, 9], [2, 7, 3], [4, 0, 6]], dtype=torch.int32)
    seq_lens = torch.tensor([10, 0, 1], dtype=torch.int32)
    _, flat_table, limits = flatten_verify(torch.zeros(3, 2, 1, 8), table, seq_lens, 2)
    assert limits.tolist() == [9, 10, 0, 0, 0, 1]
    indices, sparse_lens = random_rows(limits.tolist(), 4, rng)
    check(indices, sparse_lens, flat_table.tolist())


@pytest.mark.host
def test_refill_overwrites_a_longer_previous_step():
    table = [[1, 2], [3, 4]]
    kv_indptr, kv_indices = torch.zeros(3, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    for indices, lens in (([[0, 1, 2, 3], [4, 5, 6, 7]], [4, 4]), ([[6, -1, -1, -1],
                                                                     [-1] * 4], [1, 0])):
        fill_sparse_kv_indices(torch.tensor(indices, dtype=torch.int32),
                               torch.tensor(lens, dtype=torch.int32),
                               torch.tensor(table, dtype=torch.int32), page_size=PAGE,
                               kv_indptr=kv_indptr, kv_indices=kv_indices)
    assert kv_indptr.tolist() == [0, 1, 1]
    assert kv_indices.tolist() == [2 * PAGE + 2] + [0] * 7


@pytest.mark.host
def test_fill_has_static_shapes():
    # Meta tensors have no data: .item(), a host read or a data-dependent shape would raise.
    rows, k, cols = 5, 8, 3
    meta = {"device": "meta", "dtype": torch.int32}
    fill_sparse_kv_indices(torch.empty(rows, k, **meta), torch.empty(rows, **meta),
                           torch.empty(rows, cols, **meta), page_size=PAGE,
                           kv_indptr=torch.empty(rows + 1, **meta),
                           kv_indices=torch.empty(rows * k, **meta))


@pytest.mark.host
def test_fill_rejects_wrong_buffer_sizes():
    with pytest.raises(ValueError, match="kv_indices"):
        fill_sparse_kv_indices(torch.zeros(2, 4, dtype=torch.int32),
                               torch.zeros(2, dtype=torch.int32),
                               torch.zeros(2, 3, dtype=torch.int32), page_size=PAGE,
                               kv_indptr=torch.zeros(3, dtype=torch.int32),
                               kv_indices=torch.zeros(4, dtype=torch.int32))  # needs 8


@pytest.mark.host
def test_backend_without_aiter_says_how_to_get_it():
    if importlib.util.find_spec("aiter") is not None:
        pytest.skip("aiter is installed here")
    with pytest.raises(ImportError, match="ROCm.*pip install aiter"):
        AiterSparseBackend(num_heads=HEADS, max_len=64, topk=8, num_sms=8)


# ---- the step, with a stand-in for AITER ---------------------------------------------------

INFO = ((2, torch.uint64), (33, torch.int32), ((40, 8), torch.int32), (9, torch.int32),
        ((8, 2), torch.int32), (60, torch.int32))


class FakeAiter:
    """get_mla_metadata_info_v1 / get_mla_metadata_v1 / mla_decode_fwd stand-ins."""

    def __init__(self):
        self.info_calls, self.metadata_calls = [], []

    def info(self, *args, **kwargs):
        self.info_calls.append((args, kwargs))
        return INFO

    def metadata(self, qo_indptr, kv_indptr, last, heads, kv_heads, *args, **kwargs):
        self.metadata_calls.append((qo_indptr.clone(), last.clone(), heads, kv_heads, kwargs))

    def decode(self, q, kv, out, qo_indptr, kv_indptr, kv_indices, last, max_q, *, sm_scale,
               **kwargs):
        """Attention of row r over the token slots kv_indices[kv_indptr[r]:kv_indptr[r+1]];
        rows with none are left as they are (the backend zeroes them)."""
        assert set(WORK_BUFFERS) <= set(kwargs) and kv.shape[1:3] == (1, 1)
        rows = kv.reshape(kv.shape[0], -1).double()
        for r in range(q.shape[0]):
            slots = kv_indices[kv_indptr[r]:kv_indptr[r + 1]].long()
            if slots.numel():
                scores = q[r].double() @ rows[slots].T * sm_scale
                out[r] = (torch.softmax(scores, -1) @ rows[slots, :KV_LORA_RANK]).to(out.dtype)


@pytest.fixture
def fake(monkeypatch):
    stub = FakeAiter()
    monkeypatch.setattr(aiter_backend, "_load_aiter",
                        lambda: (stub.info, stub.metadata, stub.decode))
    return stub


@pytest.mark.host
def test_plans_and_workspace(fake):
    backend = AiterSparseBackend(num_heads=HEADS, max_len=64, topk=8, num_sms=8)
    plans = [backend.plan(bs, HEADS * q_len, hint) for bs in (1, 4) for q_len in (1, 2)
             for hint in (4, 64)]
    assert all(p.attention_splits == 1 for p in plans)
    assert max(p.num_rows for p in plans) == 8
    spec = backend.workspace_spec(plans)
    assert fake.info_calls == [((8, 1, HEADS, torch.bfloat16, torch.bfloat16),
                                {"is_sparse": True, "fast_mode": True})]
    ws = spec.allocate("cpu")
    assert isinstance(ws, AiterSparseWorkspace)
    assert ws.qo_indptr.tolist() == list(range(9)) and ws.kv_last_page_lens.tolist() == [1] * 8
    assert ws.kv_indices.shape == (8 * 8,) and ws.sparse.indices.shape == (8, 8)
    assert [tuple(t.shape) for t in ws.work] == [(2,), (33,), (40, 8), (9,), (8, 2), (60,)]
    assert ws.sparse.split.partial_o.numel() == 0  # AITER keeps its own partials
    with pytest.raises(ValueError, match="16..128 heads"):
        AiterSparseBackend(num_heads=8, max_len=64, topk=8, num_sms=8)


def step_inputs(lens, gen, dtype):
    case = make_case(lens, HEADS, page_size=PAGE, dtype=torch.float32, device="cpu", gen=gen)
    keys = torch.randn(case.kv_cache.shape[0], PAGE, 128, generator=gen)
    index_cache, index_scales = quantize_index_keys(keys)
    rows = len(lens)
    return {"q": case.q.to(dtype), "kv_cache": case.kv_cache.to(dtype),
            "index_q": torch.randn(rows, 64, 128, generator=gen).to(dtype),
            "index_weights": torch.randn(rows, 64, generator=gen) / 8,
            "index_cache": index_cache, "index_scales": index_scales,
            "block_table": case.block_table, "seq_lens": case.seq_lens}


@pytest.mark.interpreter
@pytest.mark.parametrize("q_len", [1, 2])
def test_step_attends_over_the_selected_slots(fake, q_len):
    # Triton indexer + top-k through the interpreter, then the stand-in decode; compared
    # with the float64 attention over the positions the top-k left in the workspace.
    dtype, topk = torch.float16, 8
    lens = [13, 0, 5, 8]
    inputs = step_inputs(lens, torch.Generator().manual_seed(0), dtype)
    bs = len(lens) // q_len
    backend = AiterSparseBackend(num_heads=HEADS, max_len=16, topk=topk, num_sms=8,
                                 q_dtype=dtype)
    plan = backend.plan(bs, HEADS * q_len, 16)
    ws = backend.workspace_spec([plan]).allocate("cpu")
    out = torch.full((bs * q_len, HEADS, KV_LORA_RANK), float("nan"), dtype=dtype)
    seq_lens = inputs["seq_lens"][:bs] if q_len > 1 else inputs["seq_lens"]
    backend.run_sparse(**{**inputs, "seq_lens": seq_lens}, out=out, workspace=ws, plan=plan,
                       sm_scale=SM_SCALE, q_len=q_len)
    table, limits = inputs["block_table"], seq_lens
    if q_len > 1:
        _, table, limits = flatten_verify(inputs["q"].view(bs, q_len, HEADS, -1), table,
                                          seq_lens, q_len)
    sparse_lens = ws.sparse.sparse_lens[: bs * q_len].tolist()
    assert sparse_lens == [min(n, topk) for n in limits.tolist()]
    positions = [ws.sparse.indices[r, :n].tolist() for r, n in enumerate(sparse_lens)]
    ref, _ = sparse_attention_reference(inputs["q"], inputs["kv_cache"], table, positions,
                                        kv_lora_rank=KV_LORA_RANK, sm_scale=SM_SCALE)
    assert rel_l2(out, ref) < 2e-3
    qo_indptr, last, heads, kv_heads, kwargs = fake.metadata_calls[0]
    assert qo_indptr.tolist() == list(range(bs * q_len + 1)) and last.tolist() == [1] * len(last)
    assert (heads, kv_heads, kwargs["page_size"], kwargs["max_seqlen_qo"]) == (HEADS, 1, 1, 1)
