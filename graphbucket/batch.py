"""One decode step as the host knows it, and its validation before anything is staged.

``DecodeBatch`` is what a scheduler hands graphbucket each step: host lengths, a host
block table and the model inputs. ``BatchValidator`` checks it against a ``BufferSpec``
with host arithmetic only and returns a ``CheckedBatch`` of normalised numpy arrays; every
caller mistake raises TypeError/ValueError naming what was received, what was expected
and the fix, before a single byte is staged or a kernel launched.

Validation runs on every decode step, so the validator looks the spec's constants up once
and each check is one comparison or one numpy reduction: a plain block table's live
columns are checked with a single unsigned max (negative entries wrap above any page
count), the only work proportional to the table's size. With the runner's persistent
``BlockTable`` instead (``graphbucket.block_table``), pages were checked as they entered
and a step checks only each length against its row's page count: O(batch).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from operator import gt
from typing import Any

import numpy as np
import torch

from graphbucket.block_table import BlockTable
from graphbucket.spec import BufferSpec

_NUMPY_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
                           torch.int64, torch.float16, torch.float32, torch.float64})
_RAW_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def numpy_view_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor is viewed as before ``.numpy()``: itself, or a same-size integer
    where numpy has no equivalent (bfloat16, float8): staging copies bits, never values."""
    if dtype in _NUMPY_DTYPES:
        return dtype
    return _RAW_DTYPES[torch.empty((), dtype=dtype).element_size()]


# Not frozen: an engine builds one every decode step, and a frozen dataclass's __init__
# costs several times more (more still on the cold caches a host has after a long GPU step).
@dataclass(slots=True)
class DecodeBatch:
    """One decode step on the host.

    seq_lens_cpu: [B] ints (list, numpy or CPU tensor): context length of each request,
        the tokens being decoded included (0: a padding row).
    block_table_cpu: [B, num_cols] ints (numpy or CPU tensor), num_cols <= max_pages:
        cache page of each request's pages, in order (checked and copied every step); or
        the runner's ``BlockTable`` (``runner.block_table``), whose row b serves request b
        and of which only what changed since the last step is staged.
    inputs: name -> tensor [B * q_len, *shape] per the spec's ``InputSpec``s (one row per
        query token, token j of request b at row b * q_len + j), on the CPU (staged
        through pinned memory) or on the buffers' device (copied device to device).
    positions_cpu: [B * q_len] ints, default ``seq_len - q_len + j`` for token j.
    q_len: query tokens per request (1: plain decode; 2..: a verify step of draft tokens,
        every live request then has seq_len >= q_len).
    """

    seq_lens_cpu: Any
    block_table_cpu: Any
    inputs: Mapping[str, torch.Tensor] = field(default_factory=dict)
    positions_cpu: Any = None
    q_len: int = 1


# Not frozen: built on every decode step, and a frozen dataclass's __init__ costs ~4x more.
@dataclass(slots=True, eq=False)
class CheckedBatch:
    """A validated ``DecodeBatch`` as numpy integer arrays.

    seq_lens [B] (``lens_array``, made on first use where the caller passed a list: a
    step of the runner reads ``lens_list`` instead); block_table [B, need]
    (only the columns the longest request uses, every entry inside the cache), or None
    when ``paged`` (the runner's ``BlockTable``, every row long enough for its length)
    carries it; positions [B * q_len] or None (then ``seq_len - q_len + j``);
    inputs as given ([B * q_len, ...]), split into ``host_inputs`` (name, numpy view in
    ``numpy_view_dtype``) and ``device_inputs`` (name, tensor on the buffers' device);
    ``host_copies``: (name, bytes) of every host input where each is contiguous (then a
    stage copies bytes), else None.
    """

    lens_array: np.ndarray | None
    block_table: np.ndarray | None
    positions: np.ndarray | None
    inputs: Mapping[str, torch.Tensor]
    min_len: int
    max_len: int
    batch_size: int
    host_inputs: tuple[tuple[str, np.ndarray], ...] = ()
    device_inputs: tuple[tuple[str, torch.Tensor], ...] = ()
    q_len: int = 1
    paged: BlockTable | None = None
    lens_list: list | None = None  # seq_lens as the caller's list, when it passed one
    # lens_list holds plain ints (a q_len 1 step): staged item by item, without numpy,
    # whose calls cost more (on a host's cold caches many times more) at a batch's sizes.
    plain: bool = False
    host_copies: tuple[tuple[str, memoryview], ...] | None = None

    @property
    def seq_lens(self) -> np.ndarray:
        """[B] integer lengths."""
        if self.lens_array is None:
            self.lens_array = np.asarray(self.lens_list)
        return self.lens_array

    @property
    def lengths(self) -> list | np.ndarray:
        """The lengths for host arithmetic: the caller's list where it passed one (builtins
        over a batch's list cost less than numpy's calls), else ``seq_lens``."""
        return self.seq_lens if self.lens_list is None else self.lens_list


def _host_ints(name: str, value: Any, ndim: int) -> np.ndarray:
    if type(value) is np.ndarray:
        arr = value
    else:
        if isinstance(value, torch.Tensor):
            if not value.is_cpu:
                raise TypeError(
                    f"{name} is a tensor on {value.device}; expected a host (CPU) copy. "
                    "Reading device data would synchronize every decode step: pass the "
                    "scheduler's host copy (list, numpy array or CPU tensor)")
            value = value.numpy()
        arr = np.asarray(value)
        if arr.size == 0 and not isinstance(value, np.ndarray):
            arr = arr.astype(np.int64)  # np.asarray([]) is float64; emptiness is reported later
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} has dtype {arr.dtype}; expected integers. Cast it to int32")
    if arr.ndim != ndim:
        raise ValueError(f"{name} has shape {arr.shape}; expected {ndim} dimension(s)")
    return arr


def _all_below(table: np.ndarray, limit: int) -> bool:
    if table.size <= 8:  # a few entries (batch 1, short context): builtins beat a reduction
        entries = table.ravel().tolist()
        return min(entries) >= 0 and max(entries) < limit
    # One pass: viewed as unsigned, negative entries wrap above any limit too.
    if table.dtype.kind == "i" and table.dtype.itemsize in (4, 8):
        return bool(table.view(np.uint32 if table.dtype.itemsize == 4 else np.uint64).max()
                    < limit)
    return bool(table.min() >= 0 and table.max() < limit)


class BatchValidator:
    """Checks ``DecodeBatch``es against one ``BufferSpec`` (its constants looked up once);
    ``validator(batch)`` returns a ``CheckedBatch`` or raises TypeError/ValueError.
    ``max_q_len``: the most query tokens per request the buffers hold; ``block_table``:
    the one ``BlockTable`` a batch may pass instead of an array (the runner's).

    Graph safety: host arithmetic only; a device tensor where a host copy is expected is
    rejected, never read.
    """

    __slots__ = ("spec", "max_q_len", "block_table", "_max_len", "_max_pages", "_num_pages",
                 "_page", "_device", "_inputs", "_views", "_last")

    def __init__(self, spec: BufferSpec, *, max_q_len: int = 1,
                 block_table: BlockTable | None = None) -> None:
        self.spec, self.max_q_len, self.block_table = spec, max_q_len, block_table
        self._max_len, self._max_pages = spec.max_context_len, spec.max_pages_per_seq
        self._num_pages, self._page, self._device = spec.num_pages, spec.page_size, spec.device
        # (name, dtype, per-request shape, dtype viewed as before .numpy() or None if same)
        self._inputs = tuple((s.name, s.dtype, tuple(s.shape),
                              None if s.dtype in _NUMPY_DTYPES else numpy_view_dtype(s.dtype))
                             for s in spec.inputs)
        # name -> (host tensor, its data_ptr, its numpy view, rows, shape, the view's bytes
        # or None where not contiguous): an engine that passes the same persistent tensor
        # every step skips its checks and .numpy(), the dearest call of a check.
        self._views: dict[str, tuple[torch.Tensor, int, np.ndarray, int, torch.Size,
                                     memoryview | None]] = {}
        # (rows, _split_inputs' result) of the last step whose inputs were all on the host:
        # a step with the same tensors again reuses it (a tensor keeps its dtype and device
        # while its storage and shape stay, so their checks hold still).
        self._last: tuple[int, tuple] | None = None

    def __call__(self, batch: DecodeBatch) -> CheckedBatch:
        if type(batch) is not DecodeBatch and not isinstance(batch, DecodeBatch):
            raise TypeError(f"expected a DecodeBatch, got {type(batch).__name__}")
        raw, table = batch.seq_lens_cpu, batch.block_table_cpu
        if (type(raw) is list and type(table) is BlockTable and table is self.block_table
                and batch.q_len == 1 and type(batch.q_len) is int
                and batch.positions_cpu is None and raw):
            # An engine's usual step (a list of lengths, the runner's table, one token per
            # request) checked in this one function by builtins: on the cold caches of a
            # host that waited on a GPU step every call costs, numpy's the most. A float
            # makes the sum a float, bools alone make min and max bools, numpy scalars make
            # them numpy's: those lists go the general way, which reports what is wrong.
            try:
                lo, hi, total = min(raw), max(raw), sum(raw)
            except TypeError:
                lo = hi = total = None
            bs = len(raw)
            if (type(lo) is int and type(hi) is int and type(total) is int and lo >= 0
                    and hi <= self._max_len and bs <= table.num_rows
                    and not any(map(gt, raw, table._tokens))):
                inputs = batch.inputs
                last = self._last
                if (last is not None and last[0] == bs and type(inputs) is dict
                        and len(inputs) == len(self._inputs)):
                    views = self._views
                    for name, dtype, _, _ in self._inputs:
                        t, seen = inputs.get(name), views[name]
                        if (seen[0] is not t or t.dtype is not dtype
                                or t.data_ptr() != seen[1] or t.shape != seen[4]):
                            break
                    else:  # the last step's host tensors, unchanged: their checks hold
                        host, device, copies = last[1]
                        return CheckedBatch(None, None, None, inputs, lo, hi, bs, host,
                                            device, 1, table, raw, True, copies)
                host, device, copies = self._split_inputs(inputs, bs)
                return CheckedBatch(None, None, None, inputs, lo, hi, bs, host, device, 1,
                                    table, raw, True, copies)
        return self._check(batch)

    def _check(self, batch: DecodeBatch) -> CheckedBatch:
        """Every check of a batch, raising for a bad one (numpy where it is an array)."""
        q_len = batch.q_len
        if q_len != 1 or type(q_len) is not int:
            self._q_len(q_len)
        raw = batch.seq_lens_cpu
        lens = _host_ints("seq_lens_cpu", raw, 1)
        min_len, max_len = self._lengths(lens, raw)
        if q_len != 1 and min_len < q_len:
            _check_lengths_hold(lens, q_len)
        raw_table, paged = batch.block_table_cpu, None
        if type(raw_table) is BlockTable:
            if raw_table is not self.block_table:
                raise ValueError("block_table_cpu is a BlockTable this runner does not own; "
                                 "pass runner.block_table (or a plain array)")
            raw_table.check_lengths(raw if type(raw) is list else lens)
            table, paged = None, raw_table
        else:
            table = self._block_table(_host_ints("block_table_cpu", raw_table, 2), lens,
                                      max_len)
        positions = batch.positions_cpu
        if positions is not None:
            positions = self._positions(_host_ints("positions_cpu", positions, 1), lens, q_len)
        bs = lens.shape[0]
        inputs = batch.inputs
        host, device, copies = self._split_inputs(inputs, bs * q_len)
        return CheckedBatch(lens, table, positions, inputs, min_len, max_len, bs, host, device,
                            q_len, paged, raw if type(raw) is list else None, False, copies)

    def _q_len(self, q_len: Any) -> None:
        if isinstance(q_len, bool) or not isinstance(q_len, int) or q_len < 1:
            raise ValueError(f"q_len must be a positive int (query tokens per request), "
                             f"got {q_len!r}")
        if q_len > self.max_q_len:
            raise ValueError(f"q_len={q_len} is above the largest captured q_len "
                             f"{self.max_q_len}; build the runner with q_lens=(..., {q_len}) "
                             "or verify fewer draft tokens per step")

    def _lengths(self, lens: np.ndarray, raw: Any) -> tuple[int, int]:
        n = lens.shape[0]
        if n == 0:
            raise ValueError("seq_lens_cpu is empty; a decode step needs at least one request")
        if n == 1:
            lo = hi = int(lens[0])
        elif type(raw) is list:  # builtins beat two numpy reductions on scheduler-sized lists
            lo, hi = int(min(raw)), int(max(raw))
        else:
            lo, hi = int(lens.min()), int(lens.max())
        if lo < 0:
            raise ValueError(f"seq_lens_cpu holds {lo}; lengths must be >= 0 (0 = padding row)")
        if hi > self._max_len:
            raise ValueError(
                f"seq_lens_cpu holds {hi}, above the buffers' capacity {self._max_len} "
                f"(max_pages_per_seq={self._max_pages} x page_size={self._page}); "
                "cap lengths at max_model_len or allocate more pages per request")
        return lo, hi

    @staticmethod
    def _positions(positions: np.ndarray, lens: np.ndarray, q_len: int) -> np.ndarray:
        if positions.shape != (lens.shape[0] * q_len,):
            raise ValueError(f"positions_cpu has shape {positions.shape}; expected "
                             f"{(lens.shape[0] * q_len,)}, one per query token "
                             f"({lens.shape[0]} requests x q_len {q_len})")
        # A decoded token lies inside its context: 0 <= position < seq_len (0 for padding).
        limit = np.maximum(lens, 1) if q_len == 1 else np.repeat(np.maximum(lens, 1), q_len)
        bad = (positions < 0) | (positions >= limit)
        if bad.any():
            row = int(bad.argmax())
            raise ValueError(f"positions_cpu[{row}] = {int(positions[row])} is outside "
                             f"[0, seq_len={int(lens[row // q_len])}); a decoded token's "
                             "position must lie inside its context (default: seq_len - "
                             "q_len + j for token j)")
        return positions

    def _block_table(self, bt: np.ndarray, lens: np.ndarray, max_len: int) -> np.ndarray:
        rows, cols = bt.shape
        if rows != lens.shape[0]:
            raise ValueError(f"block_table_cpu has {rows} rows; expected {lens.shape[0]}, one "
                             "per request in seq_lens_cpu")
        if cols > self._max_pages:
            raise ValueError(f"block_table_cpu has {cols} columns; expected at most "
                             f"max_pages_per_seq={self._max_pages}. Trim unused columns")
        need = -(-max_len // self._page)
        if cols < need:
            row = int(lens.argmax())
            raise ValueError(f"request {row} has seq_len {max_len} = {need} pages of "
                             f"{self._page}, but block_table_cpu has only {cols} columns")
        live = bt if cols == need else bt[:, :need]
        if need and not _all_below(live, self._num_pages):
            return _sanitize_block_table(live, lens, self.spec)
        return live

    def _split_inputs(self, inputs: Mapping[str, torch.Tensor], rows: int
                      ) -> tuple[tuple[tuple[str, np.ndarray], ...],
                                 tuple[tuple[str, torch.Tensor], ...],
                                 tuple[tuple[str, memoryview], ...] | None]:
        if type(inputs) is not dict and not isinstance(inputs, Mapping):
            raise TypeError(f"inputs is a {type(inputs).__name__}; expected a mapping of name "
                            f"-> tensor with keys {sorted(i[0] for i in self._inputs)}")
        if len(inputs) != len(self._inputs):
            raise self._keys_error(inputs)
        views = self._views
        host, device, copies = [], [], []
        for name, dtype, shape, view in self._inputs:
            t = inputs.get(name)
            seen = views.get(name)
            ndim = 1 + len(shape)
            if t is None and name not in inputs:
                raise self._keys_error(inputs)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"inputs[{name!r}] is a {type(t).__name__}; expected a tensor")
            if t.dtype != dtype:
                raise TypeError(f"inputs[{name!r}] has dtype {t.dtype}; expected {dtype}. "
                                f"Cast it with .to({dtype})")
            on_host = t.is_cpu
            if not on_host and t.device != self._device:
                raise TypeError(f"inputs[{name!r}] is on {t.device}; expected the CPU or "
                                f"{self._device}. Move it with .to({str(self._device)!r})")
            t_shape = t.shape
            if len(t_shape) != ndim or t_shape[0] != rows or t_shape[1:] != shape:
                raise ValueError(f"inputs[{name!r}] has shape {tuple(t_shape)}; expected "
                                 f"{(rows, *shape)} (batch x q_len, *InputSpec.shape)")
            if on_host:
                if (seen is not None and seen[0] is t and seen[1] == t.data_ptr()
                        and seen[4] == t_shape):
                    arr, raw = seen[2], seen[5]
                else:
                    arr = t.numpy() if view is None else t.view(view).numpy()
                    raw = memoryview(arr).cast("B") if arr.flags.c_contiguous else None
                views[name] = (t, t.data_ptr(), arr, rows, t_shape, raw)
                host.append((name, arr))
                copies.append((name, raw))
            else:
                device.append((name, t))
        result = (tuple(host), tuple(device),
                  None if any(raw is None for _, raw in copies) else tuple(copies))
        self._last = None if device else (rows, result)
        return result

    def _keys_error(self, inputs: Mapping[str, torch.Tensor]) -> ValueError:
        return ValueError(f"inputs has keys {sorted(inputs)}; expected "
                          f"{sorted(i[0] for i in self._inputs)} (one tensor per InputSpec)")


def _check_lengths_hold(lens: np.ndarray, q_len: int) -> None:
    short = (lens > 0) & (lens < q_len)
    if short.any():
        row = int(short.argmax())
        raise ValueError(f"seq_lens_cpu[{row}] = {int(lens[row])} is below q_len {q_len}; a "
                         "verify step's lengths count its q_len new tokens (seq_len >= q_len, "
                         "or 0 for a padding row)")


def _sanitize_block_table(bt: np.ndarray, lens: np.ndarray, spec: BufferSpec) -> np.ndarray:
    # Slow path: out-of-range entries past a row's live pages are padding (engines often
    # pad with -1); they are zeroed so that every staged entry names a real page.
    pages_needed = -(-lens.astype(np.int64) // spec.page_size)
    used = np.arange(bt.shape[1])[None, :] < pages_needed[:, None]
    bad = ((bt < 0) | (bt >= spec.num_pages)) & used
    if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"block_table_cpu[{row}, {col}] = {int(bt[row, col])} points outside the KV cache "
            f"(expected a page index in [0, {spec.num_pages})); request {row} uses its first "
            f"{int(pages_needed[row])} entries. Fix the scheduler's block table")
    return np.where(used, bt, 0)


