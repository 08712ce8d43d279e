"""The usual BlockTable step (a list of int lengths, the runner's table, one token per
request) is checked and staged without numpy: the same checks and errors as the general
path, the same staged bytes, and a host input changed in place is caught."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphbucket.batch import BatchValidator, DecodeBatch
from graphbucket.block_table import BlockTable
from graphbucket.buffers import StaticBuffers
from graphbucket.spec import BufferSpec, InputSpec

pytestmark = pytest.mark.host

PAGE, MAX_PAGES, NUM_PAGES, ROWS = 16, 20, 64, 4
SPEC = BufferSpec(max_pages_per_seq=MAX_PAGES, num_pages=NUM_PAGES, page_size=PAGE,
                  num_heads=2, output_shape=(8,), output_dtype=torch.float32,
                  inputs=(InputSpec("token_ids", (), torch.int64),
                          InputSpec("hidden", (3,), torch.bfloat16)), device="cpu")


class Workspace:
    nbytes = 0

    def allocate(self, device):
        return None


def parts():
    table = BlockTable(SPEC, ROWS)
    for row in range(ROWS):
        table.assign(row, list(range(row, row + 10)))  # 160 tokens a row
    buffers = StaticBuffers.allocate(SPEC, max_batch_size=ROWS, workspace=Workspace(),
                                     num_staging_slots=1)
    return table, BatchValidator(SPEC, block_table=table), buffers


def inputs(bs, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"token_ids": torch.randint(0, 1000, (bs,), generator=g),
            "hidden": torch.randn(bs, 3, generator=g).to(torch.bfloat16)}


@pytest.mark.parametrize("lens", [[5], [160, 1, 37], [0, 12, 0, 160], [1, 1, 1, 1]])
def test_a_list_step_stages_what_an_array_step_stages(lens):
    staged = []
    for given in (lens, np.array(lens, np.int64)):
        table, validate, buffers = parts()
        feed = inputs(len(lens))
        host = validate(DecodeBatch(given, table, feed))
        assert host.plain == (type(given) is list)
        assert host.seq_lens.tolist() == lens
        assert (host.min_len, host.max_len, host.batch_size) == (min(lens), max(lens), len(lens))
        buffers.stage(host, ROWS)
        staged.append(buffers.staging_tensors()[0].clone())
    assert torch.equal(staged[0], staged[1])


def test_restaged_list_steps_leave_only_what_a_fresh_stage_leaves():
    table, validate, buffers = parts()
    for lens in ([3, 4, 5, 6], [9], [0, 7, 160], [2, 2]):
        padded = 4 if len(lens) > 2 else len(lens)
        host = validate(DecodeBatch(lens, table, inputs(len(lens), len(lens))))
        buffers.stage(host, padded)
        fresh_table, fresh_validate, fresh = parts()  # an array: the general path
        fresh.stage(fresh_validate(DecodeBatch(np.array(lens), fresh_table,
                                               inputs(len(lens), len(lens)))), padded)
        got, want = buffers._slots[0], fresh._slots[0]
        for name in ("seq_lens", "positions"):
            np.testing.assert_array_equal(getattr(got, name)[:padded],
                                          getattr(want, name)[:padded])
        for name in got.inputs:
            np.testing.assert_array_equal(got.inputs[name][:padded], want.inputs[name][:padded])


@pytest.mark.parametrize("lens, exc, match", [
    ([], ValueError, "empty"),
    ([5, 2.0], TypeError, "expected integers"),
    ([True, False], TypeError, "expected integers"),
    ([5, None], TypeError, "expected integers"),
    ([5, -1], ValueError, "must be >= 0"),
    ([5, MAX_PAGES * PAGE + 1], ValueError, "above the buffers' capacity"),
    ([5, 2**70], TypeError, "expected integers"),
    ([5, 161], ValueError, r"seq_lens_cpu\[1\] = 161 needs 11 pages"),
    ([1] * (ROWS + 1), ValueError, "5 requests but the block table has 4 rows"),
])
def test_bad_lengths_raise_as_on_the_general_path(lens, exc, match):
    table, validate, _ = parts()
    with pytest.raises(exc, match=match):
        validate(DecodeBatch(lens, table, inputs(len(lens))))


def test_numpy_scalars_and_mixed_bools_are_lengths_as_numpy_reads_them():
    table, validate, _ = parts()
    host = validate(DecodeBatch([np.int64(7), 3, True], table, inputs(3)))
    assert host.seq_lens.tolist() == [7, 3, 1] and (host.min_len, host.max_len) == (1, 7)


def test_a_persistent_input_changed_in_place_is_checked_again():
    table, validate, buffers = parts()
    feed = inputs(2)
    first = validate(DecodeBatch([5, 6], table, feed))
    again = validate(DecodeBatch([6, 7], table, feed))
    assert again.host_inputs == first.host_inputs  # unchanged tensors: checked once
    feed["token_ids"].resize_(1)  # the same object and storage, one row
    with pytest.raises(ValueError, match=r"inputs\['token_ids'\] has shape \(1,\)"):
        validate(DecodeBatch([6, 7], table, feed))
    feed["token_ids"].set_(torch.arange(2))  # the same object on another storage
    host = validate(DecodeBatch([6, 7], table, feed))
    assert host.host_inputs[0][1].ctypes.data == feed["token_ids"].data_ptr()
    assert host.host_inputs[0][1].tolist() == [0, 1]
    feed["hidden"].data = torch.zeros(2, 3, dtype=torch.float16)  # another dtype
    with pytest.raises(TypeError, match="dtype torch.float16; expected torch.bfloat16"):
        validate(DecodeBatch([6, 7], table, feed))


def test_list_verbs_change_what_array_verbs_change():
    a, b = BlockTable(SPEC, ROWS), BlockTable(SPEC, ROWS)
    for t in (a, b):
        t.assign(0, [1, 2])
        t.assign(2, [3])
    a.append(0, [9, 10])
    b.append(0, np.array([9, 10], np.int32))
    a.append_rows([2, 1], [11, 12])
    b.append_rows(np.array([2, 1]), np.array([11, 12], np.int64))
    assert np.array_equal(a.table, b.table) and np.array_equal(a.counts, b.counts)
    assert a._tokens == b._tokens and a._lo == b._lo and a._hi == b._hi
    assert a._dirty_rows == b._dirty_rows
