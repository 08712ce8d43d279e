from __future__ import annotations

import numpy as np
import pytest
import torch

from graphbucket.batch import BatchValidator, DecodeBatch
from tests._toy import HIDDEN, PAGE, toy_spec

pytestmark = pytest.mark.host  # the fast lane: no kernel launches

SPEC = toy_spec(max_pages=20, num_pages=64)
check = BatchValidator(SPEC)


def batch(lens=(40, 7), table=None, hidden=None, **kw) -> DecodeBatch:
    table = np.arange(2 * 3, dtype=np.int32).reshape(2, 3) if table is None else table
    hidden = torch.zeros(len(lens), HIDDEN) if hidden is None else hidden
    return DecodeBatch(list(lens), table, {"hidden": hidden}, **kw)


def test_valid_batch_is_normalised():
    host = check(batch(lens=(40, 0), table=np.arange(10).reshape(2, 5)))
    assert host.seq_lens.dtype.kind == "i" and host.seq_lens.tolist() == [40, 0]
    assert host.block_table.tolist() == [[0, 1, 2], [5, 6, 7]]  # the 3 columns 40 tokens use
    assert host.positions is None  # staged as seq_len - 1
    assert (host.batch_size, host.min_len, host.max_len) == (2, 0, 40)


def test_accepts_numpy_and_cpu_tensors():
    b = DecodeBatch(torch.tensor([3, 4]), torch.zeros(2, 1, dtype=torch.int64),
                    {"hidden": torch.zeros(2, HIDDEN)}, positions_cpu=np.array([1, 3]))
    host = BatchValidator(SPEC)(b)
    assert host.positions.tolist() == [1, 3] and host.seq_lens.tolist() == [3, 4]


@pytest.mark.parametrize("bad, exc, match", [
    (dict(lens=()), ValueError, "empty"),
    (dict(lens=(5, -1)), ValueError, "must be >= 0"),
    (dict(lens=(20 * PAGE + 1, 1), table=np.zeros((2, 20), np.int32)), ValueError,
     "above the buffers' capacity 320"),
    (dict(table=np.zeros((3, 3), np.int32)), ValueError, "3 rows; expected 2"),
    (dict(table=np.zeros((2, 21), np.int32)), ValueError, "at most max_pages_per_seq=20"),
    (dict(lens=(100, 1)), ValueError, "7 pages of 16, but block_table_cpu has only 3"),
    (dict(table=np.zeros((2, 3), np.float32)), TypeError, "expected integers"),
    (dict(hidden=torch.zeros(2, HIDDEN, dtype=torch.float16)), TypeError,
     "dtype torch.float16; expected torch.float32"),
    (dict(hidden=torch.zeros(2, HIDDEN + 1)), ValueError, r"expected \(2, 32\)"),
    (dict(hidden=torch.zeros(2, HIDDEN, device="meta")), TypeError, "is on meta"),
    (dict(positions_cpu=[1, 2, 3]), ValueError, "positions_cpu has shape"),
    (dict(positions_cpu=[40, 6]), ValueError, r"positions_cpu\[0\] = 40 is outside"),
    (dict(positions_cpu=[39, -5]), ValueError, r"positions_cpu\[1\] = -5 is outside"),
    (dict(hidden=torch.tensor(1.0)), ValueError, r"expected \(2, 32\)"),
])
def test_bad_batches_raise_with_got_and_expected(bad, exc, match):
    with pytest.raises(exc, match=match):
        BatchValidator(SPEC)(batch(**bad))


def test_device_lengths_are_rejected_not_read():
    b = DecodeBatch(torch.zeros(2, dtype=torch.int32, device="meta"), np.zeros((2, 1), np.int32),
                    {"hidden": torch.zeros(2, HIDDEN)})
    with pytest.raises(TypeError, match="host .CPU. copy"):
        BatchValidator(SPEC)(b)


def test_missing_or_extra_inputs():
    with pytest.raises(ValueError, match=r"keys \[\]; expected \['hidden'\]"):
        check(DecodeBatch([1], np.zeros((1, 1), np.int32)))
    with pytest.raises(TypeError, match="expected a DecodeBatch"):
        BatchValidator(SPEC)({"seq_lens_cpu": [1]})
    with pytest.raises(TypeError, match="expected a mapping"):
        check(DecodeBatch([1], np.zeros((1, 1), np.int32), [torch.zeros(1, HIDDEN)]))


def test_validator_splits_host_and_device_inputs_and_matches_check():
    from graphbucket.batch import BatchValidator

    b = batch(lens=(40, 7))
    host = BatchValidator(SPEC)(b)
    assert host.batch_size == 2 and host.device_inputs == ()
    (name, arr), = host.host_inputs
    assert name == "hidden" and isinstance(arr, np.ndarray) and arr.shape == (2, HIDDEN)
    again = BatchValidator(SPEC)(b)
    assert again.block_table.tolist() == host.block_table.tolist()
    assert (again.min_len, again.max_len) == (host.min_len, host.max_len) == (7, 40)


def test_a_host_input_passed_again_is_read_afresh_and_a_resized_one_is_checked():
    validate = BatchValidator(SPEC)
    rng = np.random.default_rng(11)
    hidden = torch.from_numpy(rng.standard_normal((2, HIDDEN)).astype(np.float32))
    first = validate(batch(hidden=hidden)).host_inputs[0][1]
    np.testing.assert_array_equal(first, hidden.numpy())
    hidden.copy_(torch.from_numpy(rng.standard_normal((2, HIDDEN)).astype(np.float32)))
    again = validate(batch(hidden=hidden)).host_inputs[0][1]  # the same tensor, new values
    np.testing.assert_array_equal(again, hidden.numpy())
    other = torch.from_numpy(rng.standard_normal((2, HIDDEN)).astype(np.float32))
    np.testing.assert_array_equal(validate(batch(hidden=other)).host_inputs[0][1],
                                  other.numpy())
    hidden.resize_(1, HIDDEN)  # same storage and data pointer, one row fewer
    with pytest.raises(ValueError, match=rf"inputs\['hidden'\] has shape \(1, {HIDDEN}\)"):
        validate(batch(hidden=hidden))
    one = validate(batch(lens=(40,), table=np.arange(3, dtype=np.int32).reshape(1, 3),
                         hidden=hidden)).host_inputs[0][1]
    assert one.shape == (1, HIDDEN)
    np.testing.assert_array_equal(one, hidden.numpy())
    # The tensor checked last step, unchanged, against a batch of another size.
    with pytest.raises(ValueError, match=rf"inputs\['hidden'\] has shape \(1, {HIDDEN}\); "
                       rf"expected \(2, {HIDDEN}\)"):
        validate(batch(hidden=hidden))
    hidden.data = hidden.data.to(torch.float64)  # the same object, another dtype
    with pytest.raises(TypeError, match="dtype torch.float64; expected torch.float32"):
        validate(batch(lens=(40,), table=np.arange(3, dtype=np.int32).reshape(1, 3),
                       hidden=hidden))


def test_wide_tables_are_checked_only_over_live_columns():
    # Columns past the longest request's pages are never staged, so never checked.
    table = np.full((2, 20), 10_000, np.int32)
    table[:, :3] = [[0, 1, 2], [3, 4, 5]]
    assert check(batch(lens=(40, 7), table=table)).block_table.tolist() == [[0, 1, 2],
                                                                           [3, 4, 5]]
    table[0, 2] = 64
    with pytest.raises(ValueError, match=r"\[0, 2\] = 64 points outside"):
        check(batch(lens=(40, 7), table=table))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_out_of_range_padding_past_live_pages_is_zeroed(dtype):
    # Engines often pad tables with -1; entries past a row's live pages are never read.
    table = np.array([[3, 4, -1], [5, -1, 70]], dtype)
    assert check(batch(lens=(30, 7), table=table)).block_table.tolist() == [[3, 4], [5, 0]]


@pytest.mark.parametrize("dtype, value", [(np.int32, 64), (np.int32, -1), (np.int64, 64),
                                          (np.int64, -1), (np.int64, 2**32 + 3)])
def test_a_live_page_outside_the_cache_raises(dtype, value):
    table = np.array([[0, 1, value], [3, 4, 5]], dtype)  # row 0 reads all three entries
    with pytest.raises(ValueError, match=rf"\[0, 2\] = {value} points outside"):
        check(batch(lens=(40, 7), table=table))


@pytest.mark.parametrize("table", [np.array([[3, 4, 5]], np.int64),
                                   np.array([[3, 4, 5]], np.uint16),
                                   torch.tensor([[3, 4, 5]], dtype=torch.int32)])
def test_any_integer_table_type_is_accepted(table):
    host = check(DecodeBatch(np.array([40], np.int32), table,
                                      {"hidden": torch.zeros(1, HIDDEN)}))
    assert host.block_table.tolist() == [[3, 4, 5]] and host.max_len == 40
