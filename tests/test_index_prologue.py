"""The indexer's prologue kernels (interpreter): against the torch path they replace, and
a sparse layer left with no torch kernels but its projections."""

from __future__ import annotations

import collections
import os
import sys

import numpy as np
import pytest
import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

from graphbucket.fp8 import FP8_DTYPE
from graphbucket.models.ops import rms_norm, rope_cache
from graphbucket.models.paging import decode_batch, random_block_table
from graphbucket.models.sparse_mla import SparseMLADecoder, rope_first, tiny_sparse
from graphbucket.runner import GraphBucketRunner
from graphbucket.sparse.index_cache import INDEX_DIM, store_index_keys
from graphbucket.sparse.index_prologue import rope_index_q_, store_index_prologue

MAX_POS, EPS, HEADS = 256, 1e-6, 64


def _inputs(tokens, dtype, q_len=1):
    kw = (torch.randn(tokens, INDEX_DIM + HEADS) * torch.rand(tokens, 1) * 8).to(dtype)
    k_norm = (1 + 0.5 * torch.randn(INDEX_DIM)).to(dtype)
    rope = rope_cache(64, MAX_POS, 10000.0, device="cpu")
    # positions at 0, past the table, negative and random
    positions = torch.tensor([0, MAX_POS + 7, -3, 100, 255, 17][:tokens], dtype=torch.int64)
    num_slots = 40
    slots = torch.randperm(num_slots)[:tokens].to(torch.int64)
    seq_lens = torch.full((-(-tokens // q_len),), 9, dtype=torch.int32)
    if tokens > 1:
        slots[1] = -1  # a padding slot
    if tokens > 3:
        slots[3] = num_slots + 5  # past the cache
    if tokens > 4:
        seq_lens[4 // q_len] = 0  # a padding request
    return kw, k_norm, rope, positions, slots, seq_lens, num_slots


def _torch_path(kw, k_norm, rope, positions, slots, seq_lens, num_slots, q_len):
    cos_sin = rope[positions.clamp(0, rope.shape[0] - 1)]
    keys = rope_first(rms_norm(kw[:, :INDEX_DIM], k_norm, EPS), cos_sin)
    lens = seq_lens.repeat_interleave(q_len)[:kw.shape[0]]
    live = (slots >= 0) & (slots < num_slots) & (lens > 0)
    rows = torch.zeros(num_slots + 1, INDEX_DIM, dtype=FP8_DTYPE)
    scales = torch.ones(num_slots + 1)
    store_index_keys(keys, torch.where(live, slots, num_slots), rows.view(-1, 1, INDEX_DIM),
                     scales.view(-1, 1))
    weights = kw[:, INDEX_DIM:].float() * (HEADS * INDEX_DIM) ** -0.5
    return rows, scales, weights


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens, q_len", [(1, 1), (3, 1), (6, 1), (6, 2)])
def test_prologue_stores_the_torch_paths_keys_scales_and_weights(dtype, tokens, q_len, seeded):
    kw, k_norm, rope, positions, slots, seq_lens, num_slots = _inputs(tokens, dtype, q_len)
    want_rows, want_scales, want_weights = _torch_path(kw, k_norm, rope, positions, slots,
                                                       seq_lens, num_slots, q_len)
    rows = torch.zeros(num_slots + 1, INDEX_DIM, dtype=FP8_DTYPE)
    scales = torch.ones(num_slots + 1)
    weights = store_index_prologue(kw, k_norm, rope, positions, slots, seq_lens, rows, scales,
                                   eps=EPS, q_len=q_len)
    assert weights.dtype == torch.float32 and torch.equal(weights, want_weights)
    assert torch.equal(scales, want_scales)
    assert torch.equal(rows.view(torch.uint8), want_rows.view(torch.uint8))
    if tokens > 1:  # padding went to the scratch row, live tokens to their slots
        assert (rows[num_slots].view(torch.uint8) != 0).any()


@pytest.mark.interpreter
def test_prologue_rounds_carries_and_subnormals_as_torch_casts(seeded):
    # one key per row near e4m3's rounding boundaries after scaling by 448 / amax
    kw, k_norm, rope, positions, slots, seq_lens, num_slots = _inputs(4, torch.float32)
    k_norm = torch.ones(INDEX_DIM)
    boundaries = torch.tensor([0.96875, 0.9375, 0.03125, 0.0009765625, 1 / 448, 15.5 / 16])
    kw[:, 64:70] = boundaries * kw[:, 64:].abs().amax(-1, keepdim=True)
    positions.zero_()
    want = _torch_path(kw, k_norm, rope, positions, slots, seq_lens, num_slots, 1)
    rows = torch.zeros(num_slots + 1, INDEX_DIM, dtype=FP8_DTYPE)
    scales = torch.ones(num_slots + 1)
    store_index_prologue(kw, k_norm, rope, positions, slots, seq_lens, rows, scales, eps=EPS)
    assert torch.equal(scales, want[1])
    assert torch.equal(rows.view(torch.uint8), want[0].view(torch.uint8))


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 3])
def test_rope_index_q_matches_rope_first_in_place(dtype, tokens, seeded):
    _, _, rope, positions, *_ = _inputs(tokens, dtype)
    q = (torch.randn(tokens, HEADS * INDEX_DIM) * 3).to(dtype)
    want = rope_first(q.view(tokens, HEADS, INDEX_DIM),
                      rope[positions.clamp(0, rope.shape[0] - 1)])
    got = rope_index_q_(q, rope, positions)
    assert got.shape == (tokens, HEADS, INDEX_DIM) and got.data_ptr() == q.data_ptr()
    assert torch.equal(got, want)


@pytest.mark.host
def test_prologue_rejects_bad_buffers():
    kw, k_norm, rope, positions, slots, seq_lens, num_slots = _inputs(2, torch.bfloat16)
    rows = torch.zeros(num_slots + 1, INDEX_DIM, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="index_rows must be"):
        store_index_prologue(kw, k_norm, rope, positions, slots, seq_lens, rows,
                             torch.ones(num_slots + 1), eps=EPS)
    rows = torch.zeros(num_slots + 1, INDEX_DIM, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="index_row_scales must be"):
        store_index_prologue(kw, k_norm, rope, positions, slots, seq_lens, rows,
                             torch.ones(num_slots), eps=EPS)
    with pytest.raises(ValueError, match="q must be"):
        rope_index_q_(torch.zeros(2, 8 * INDEX_DIM), rope, positions)


# aten ops that launch no kernel (metadata and allocation)
NO_KERNEL = {"aten.t.default", "aten.view.default", "aten.slice.Tensor", "aten.transpose.int",
             "aten.empty.memory_format", "aten.unsqueeze.default", "aten.detach.default",
             "aten.view.dtype", "aten.expand.default", "aten._unsafe_view.default",
             "aten.as_strided.default", "aten.alias.default", "aten.select.int"}
PROJECTIONS = {"aten.mm.default", "aten.bmm.default", "aten.addmm.default"}


class _TorchOps(TorchDispatchMode):
    """Counts the aten ops a call issues, less those the Triton interpreter issues while
    it runs a kernel (its argument copies)."""

    triton_dir = os.path.dirname(triton.__file__)

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frame = sys._getframe(1)
        while frame is not None and not frame.f_code.co_filename.startswith(self.triton_dir):
            frame = frame.f_back
        if frame is None:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.interpreter
def test_sparse_layer_launches_no_torch_kernels_but_its_projections(monkeypatch):
    model = SparseMLADecoder(tiny_sparse(num_layers=1), num_pages=8, page_size=16,
                             dtype=torch.float32, device="cpu")
    table = random_block_table(1, 8, 8, np.random.default_rng(0))
    model.prefill_random(table, [64])
    layer_ops = []
    sparse_attention = SparseMLADecoder._sparse_attention

    def counted(self, *args):
        with _TorchOps() as mode:
            out = sparse_attention(self, *args)
        layer_ops.append(mode.ops)
        return out

    monkeypatch.setattr(SparseMLADecoder, "_sparse_attention", counted)
    batch = decode_batch(model, [40], table[:1], torch.randn(1, model.config.hidden_size))
    with GraphBucketRunner.for_model(model, policy="eager", max_model_len=128,
                                     batch_sizes=[1], progress=False,
                                     backend=model.decode_backend(128, num_sms=8)) as runner:
        runner.step(batch)
    (ops,) = layer_ops
    # the torch path ran 24 elementwise, cat, amax and index_copy_ kernels here (fp32)
    assert set(ops) - NO_KERNEL <= PROJECTIONS, ops
    assert sum(ops[name] for name in PROJECTIONS) == 7, ops  # 5 linears, 2 bmms
