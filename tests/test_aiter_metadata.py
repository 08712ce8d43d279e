"""CPU tests of the AITER persistent backend's pure helpers (no AITER, no ROCm needed).

Expectations are plain Python loops over lists, written independently of the torch ops
in ``fill_kv_indices``; the AITER calls themselves are not exercised here.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from graphbucket.backends import get_backend
from graphbucket.backends.aiter import (
    WORK_BUFFERS,
    PersistentWorkspaceSpec,
    fill_kv_indices,
    index_buffer_shapes,
    kernel_page_table,
    work_buffer_shapes,
)

PAGE = 4


def expected(seq_lens, table, page_size, kernel_page_size):
    """(kv_indptr, kv_indices, last_page_lens) by hand: kernel page j of a request is
    token slots j*g .. j*g+g-1, i.e. cache page table[j*g // page_size], sub-page
    (j*g % page_size) // g, numbered page * (page_size // g) + sub-page."""
    g, r = kernel_page_size, page_size // kernel_page_size
    indptr, indices, last = [0], [], []
    for length, row in zip(seq_lens, table, strict=True):
        count = 0
        for token in range(0, length, g):
            indices.append(row[token // page_size] * r + (token % page_size) // g)
            count += 1
        indptr.append(indptr[-1] + count)
        last.append(g if length == 0 else (length - 1) % g + 1)
    return indptr, indices, last


def run_fill(seq_lens, table, page_size, kernel_page_size, *, junk=-7):
    bsz, cols = len(table), len(table[0])
    width = cols * page_size // kernel_page_size
    kv_indptr = torch.full((bsz + 1,), junk, dtype=torch.int32)
    kv_indices = torch.full((bsz * width,), junk, dtype=torch.int32)
    last = torch.full((bsz,), junk, dtype=torch.int32)
    fill_kv_indices(torch.tensor(seq_lens, dtype=torch.int32),
                    torch.tensor(table, dtype=torch.int32), page_size=page_size,
                    kernel_page_size=kernel_page_size, kv_indptr=kv_indptr,
                    kv_indices=kv_indices, kv_last_page_lens=last)
    return kv_indptr, kv_indices, last


def check(seq_lens, table, page_size, kernel_page_size):
    kv_indptr, kv_indices, last = run_fill(seq_lens, table, page_size, kernel_page_size)
    want_indptr, want_indices, want_last = expected(seq_lens, table, page_size,
                                                    kernel_page_size)
    assert kv_indptr.tolist() == want_indptr
    total = want_indptr[-1]
    assert kv_indices[:total].tolist() == want_indices
    assert kv_indices[total:].tolist() == [0] * (kv_indices.numel() - total)  # no stale slot
    assert last.tolist() == want_last
    # AITER's length of a request: (pages - 1) * page + last page.
    pages = [b - a for a, b in zip(want_indptr, want_indptr[1:], strict=False)]
    lengths = [(n - 1) * kernel_page_size + lp for n, lp in zip(pages, want_last, strict=True)]
    assert lengths == list(seq_lens)
    return kv_indptr, kv_indices, last


# Row 0: ragged; row 1: padding in the middle; row 2: exactly two pages; row 3: one token;
# row 4: padding at the end. Pages are scattered and the columns past a row's length hold
# junk (-1, 10_000) that must not reach kv_indices.
SEQ_LENS = [9, 0, 2 * PAGE, 1, 0]
TABLE = [[17, 3, 11, -1],
         [10_000, -1, -1, -1],
         [5, 29, 10_000, -1],
         [22, 10_000, 10_000, 10_000],
         [-1, -1, -1, -1]]


@pytest.mark.parametrize("kernel_page_size", [1, 2, PAGE])
def test_ragged_padding_scattered_pages(kernel_page_size):
    check(SEQ_LENS, TABLE, PAGE, kernel_page_size)


def test_token_pages_by_hand():
    # One-token kernel pages: slots page * 4 + offset, last page length always 1.
    kv_indptr, kv_indices, last = check([5, 0, 1], [[7, 2], [0, 0], [9, 9]], PAGE, 1)
    assert kv_indptr.tolist() == [0, 5, 5, 6]
    assert kv_indices[:6].tolist() == [28, 29, 30, 31, 8, 36]
    assert last.tolist() == [1, 1, 1]


def test_native_pages_by_hand():
    # Cache pages as they are: length 8 = two full pages (last 4), length 1 = last 1.
    kv_indptr, kv_indices, last = check([8, 0, 1, 6], [[7, 2], [0, 0], [9, 9], [4, 6]],
                                        PAGE, PAGE)
    assert kv_indptr.tolist() == [0, 2, 2, 3, 5]
    assert kv_indices[:5].tolist() == [7, 2, 9, 4, 6]
    assert last.tolist() == [4, 4, 1, 2]


@pytest.mark.parametrize("kernel_page_size", [1, PAGE])
def test_random_batches_against_python(kernel_page_size):
    rng = random.Random(0)
    for _ in range(50):
        bsz, cols = rng.randint(1, 6), rng.randint(1, 5)
        num_pages = bsz * cols + 3
        seq_lens = [rng.choice([0, 1, PAGE, rng.randint(0, cols * PAGE)]) for _ in range(bsz)]
        pages = rng.sample(range(num_pages), bsz * cols)
        table = [pages[b * cols:(b + 1) * cols] for b in range(bsz)]
        check(seq_lens, table, PAGE, kernel_page_size)


def test_refill_overwrites_a_longer_previous_step():
    # Replays reuse the buffers: a step with shorter lengths must leave nothing behind.
    bsz, cols = 3, 4
    width = cols * PAGE
    bufs = (torch.zeros(bsz + 1, dtype=torch.int32), torch.zeros(bsz * width, dtype=torch.int32),
            torch.zeros(bsz, dtype=torch.int32))
    table = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]], dtype=torch.int32)
    for lens in ([16, 16, 16], [3, 0, 5]):
        fill_kv_indices(torch.tensor(lens, dtype=torch.int32), table, page_size=PAGE,
                        kernel_page_size=1, kv_indptr=bufs[0], kv_indices=bufs[1],
                        kv_last_page_lens=bufs[2])
    want_indptr, want_indices, _ = expected([3, 0, 5], table.tolist(), PAGE, 1)
    assert bufs[0].tolist() == want_indptr
    assert bufs[1].tolist() == want_indices + [0] * (bsz * width - len(want_indices))


def test_fill_has_static_shapes():
    # Meta tensors have no data: .item(), a host read or a data-dependent shape would raise.
    bsz, cols = 5, 4
    meta = {"device": "meta", "dtype": torch.int32}
    fill_kv_indices(torch.empty(bsz, **meta), torch.empty(bsz, cols, **meta), page_size=PAGE,
                    kernel_page_size=1, kv_indptr=torch.empty(bsz + 1, **meta),
                    kv_indices=torch.empty(bsz * cols * PAGE, **meta),
                    kv_last_page_lens=torch.empty(bsz, **meta))


def test_fill_rejects_wrong_buffer_sizes():
    with pytest.raises(ValueError, match="kv_indices"):
        fill_kv_indices(torch.tensor([1, 2], dtype=torch.int32),
                        torch.zeros(2, 3, dtype=torch.int32), page_size=PAGE,
                        kernel_page_size=1, kv_indptr=torch.zeros(3, dtype=torch.int32),
                        kv_indices=torch.zeros(2 * 3, dtype=torch.int32),  # needs 2 * 12
                        kv_last_page_lens=torch.zeros(2, dtype=torch.int32))


def test_kernel_page_table():
    table = torch.tensor([[3, 1]], dtype=torch.int32)
    assert kernel_page_table(table, 4, 4).tolist() == [[3, 1]]
    assert kernel_page_table(table, 4, 2).tolist() == [[6, 7, 2, 3]]
    assert kernel_page_table(table, 4, 1).tolist() == [[12, 13, 14, 15, 4, 5, 6, 7]]
    with pytest.raises(ValueError, match="must divide"):
        kernel_page_table(table, 4, 3)


def test_workspace_spec_sizes_and_allocates():
    # Shapes as get_mla_metadata_info_v1 returns them (an int or a tuple, then a dtype).
    info = ((2, torch.uint64), (305, torch.int32), ((400, 8), torch.int32),
            (9, torch.int32), ((8, 2), torch.int32), (600, torch.int32))
    work = work_buffer_shapes(info)
    assert [name for name, _, _ in work] == list(WORK_BUFFERS)
    assert work[0][1] == (2,) and work[2][1] == (400, 8)
    spec = PersistentWorkspaceSpec(max_batch=8, max_pages=5, page_size=PAGE,
                                   kernel_page_size=1, work=work)
    index = {name: shape for name, shape, _ in index_buffer_shapes(8, 5, PAGE, 1)}
    assert index == {"qo_indptr": (9,), "kv_indptr": (9,), "kv_indices": (8 * 5 * PAGE,),
                     "kv_last_page_lens": (8,)}
    ws = spec.allocate("cpu")
    assert set(ws) == set(index) | set(WORK_BUFFERS)
    assert spec.nbytes == sum(t.numel() * t.element_size() for t in ws.values())
    assert spec.nbytes == 2 * 8 + 4 * (305 + 3200 + 9 + 16 + 600) + 4 * (9 + 9 + 160 + 8)
    assert ws["qo_indptr"].tolist() == list(range(9))  # one query token per request
    with pytest.raises(ValueError, match="6"):
        work_buffer_shapes(info[:5])


def test_persistent_backend_without_aiter_says_how_to_get_it():
    if importlib.util.find_spec("aiter") is not None:
        pytest.skip("aiter is installed here")
    with pytest.raises(ImportError, match="ROCm.*pip install aiter"):
        get_backend("aiter", page_size=PAGE, max_pages=4, persistent=True)
