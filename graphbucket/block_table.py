"""A persistent host block table that an engine edits as its scheduler changes requests.

Passing a full ``[B, num_cols]`` array in every ``DecodeBatch`` costs a check and a copy of
every entry on every step (64 requests x 128K tokens: 131,072 entries), though a decode step
appends at most one page per request. A ``BlockTable`` (``GraphBucketRunner.block_table``)
keeps the table between steps instead: rows are batch slots, and the engine calls

- ``assign(row, pages)`` when a request enters slot ``row`` (its pages, in order),
- ``append(row, pages)`` / ``append_rows(rows, pages)`` when requests grow by pages,
- ``release(row)`` when the request in ``row`` retires.

Each verb checks what enters (every page inside the cache, the row's capacity) and raises
ValueError before changing anything, so the cost of checking is the cost of the change.
A step then passes ``DecodeBatch(seq_lens, runner.block_table, inputs)``: row b of the table
serves request b, each live length is checked against its row's page count (O(batch)), and
only the entries changed since the last step reach the device (``changes``): as a fixed-
capacity list that the graph scatters in before the forward, rows that do not fit it copied
row by row. Kernels read only the first ``ceil(seq_len / page_size)`` entries of a row, and
every entry ever entered was checked, so entries past a row's page count (a released row,
a shorter request in a reused slot) are stale but valid pages, never cleared.

Host only: nothing here touches a device.
"""

from __future__ import annotations

from operator import gt
from typing import Any

import numpy as np

from graphbucket.spec import BufferSpec

# Up to this many rows a verb or a drain works on Python scalars, above it on numpy arrays.
_FEW = 16


class BlockTable:
    """``num_rows`` slots x ``max_pages_per_seq`` pages (int32), with each row's page count.

    ``pages(row)`` is a read-only view of a row's live pages, ``page_counts`` of every row's
    count. Changes since the last staged step are kept per row as one column range (a row
    only changes by assign, from column 0, or append, at its end), so the entries to stage
    are read from the table at staging time and a later write to an entry always wins.
    """

    __slots__ = ("num_rows", "max_pages", "num_cache_pages", "page_size", "table", "counts",
                 "_tokens", "_lo", "_hi", "_dirty_rows", "_marks", "_counts_view", "_flat",
                 "_n")

    def __init__(self, spec: BufferSpec, num_rows: int) -> None:
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 1:
            raise ValueError(f"num_rows must be a positive int (batch slots), got {num_rows!r}")
        self.num_rows, self.max_pages = num_rows, spec.max_pages_per_seq
        self.num_cache_pages, self.page_size = spec.num_pages, spec.page_size
        self.table = np.zeros((num_rows, self.max_pages), np.int32)
        self.counts = np.zeros(num_rows, np.int64)
        # The table (flat, row-major) and the counts as memoryviews: a verb's item reads and
        # writes through them cost a fraction of numpy's, most of all on the cold caches a
        # host has after waiting on a GPU step.
        self._flat = memoryview(self.table).cast("B").cast("i")
        self._n = memoryview(self.counts).cast("B").cast("q")
        # counts x page_size, the lengths rows hold: a list, so that a step's check of its
        # lengths is one pass of builtins (numpy's calls cost more, on cold caches many times
        # more, than comparing a batch's lengths one by one).
        self._tokens = [0] * num_rows
        # Changed columns of row r: [_lo[r], _hi[r]); clean rows have lo = max_pages, hi = 0.
        # Rows that turned dirty since the last staged step, so that draining the changes
        # costs what changed, not the table's height (a listed row may be clean again, or
        # listed twice after a release).
        # Lists, as ``_tokens``: a step's verbs read and write them one entry at a time.
        self._lo: list[int] = [self.max_pages] * num_rows
        self._hi: list[int] = [0] * num_rows
        self._dirty_rows: list[int] = []
        self._marks = np.zeros(num_rows, np.int64)  # scratch of append_rows' duplicate check
        self._counts_view = self.counts.view()
        self._counts_view.flags.writeable = False

    def __repr__(self) -> str:
        return (f"BlockTable({self.num_rows} rows x {self.max_pages} pages, "
                f"{int(np.count_nonzero(self.counts))} rows in use)")

    @property
    def page_counts(self) -> np.ndarray:
        """[num_rows] int64, read-only: the live pages of each row."""
        return self._counts_view

    def pages(self, row: int) -> np.ndarray:
        """Row ``row``'s live pages (a read-only view)."""
        row = self._row(row)
        view = self.table[row, :self.counts[row]]
        view.flags.writeable = False
        return view

    # ---- verbs ----------------------------------------------------------------------------

    def assign(self, row: int, pages: Any) -> None:
        """A request enters slot ``row`` with ``pages`` (its cache pages, in order); whatever
        the row held is replaced."""
        row = self._row(row)
        new = self._pages(pages, "pages")
        n = new.shape[0]
        if n > self.max_pages:
            raise ValueError(f"assign(row={row}) got {n} pages; a row holds at most "
                             f"max_pages_per_seq={self.max_pages}")
        self.table[row, :n] = new
        self.counts[row] = n
        self._tokens[row] = n * self.page_size
        if n:
            self._mark(row, 0, n)
        else:
            self._lo[row], self._hi[row] = self.max_pages, 0

    def append(self, row: int, pages: Any) -> None:
        """Pages added at the end of row ``row`` (a growing request)."""
        # A decode step's append (a few pages, as ints) in this one function: on the cold
        # caches of a host that waited on a GPU step every call costs, numpy's the most.
        # Anything else, or anything wrong, takes the general path, which reports it.
        new = pages.tolist() if type(pages) is np.ndarray and pages.size <= _FEW else pages
        if (type(new) is list and 0 < len(new) <= _FEW and type(row) is int
                and 0 <= row < self.num_rows):
            start = self._n[row]
            end = start + len(new)
            limit = self.num_cache_pages
            for value in new:
                if type(value) is not int or not 0 <= value < limit:
                    break
            else:
                if end <= self.max_pages:
                    flat, at = self._flat, row * self.max_pages + start
                    for value in new:
                        flat[at] = value
                        at += 1
                    self._n[row] = end
                    self._tokens[row] = end * self.page_size
                    if self._hi[row] == 0:  # clean until now (``_mark``)
                        self._dirty_rows.append(row)
                        self._lo[row] = start
                    elif self._lo[row] > start:
                        self._lo[row] = start
                    self._hi[row] = end
                    return
        self._append(row, pages)  # the general path; it raises for a bad call

    def _append(self, row: Any, pages: Any) -> None:
        row = self._row(row)
        new = self._pages(pages, "pages")
        start, n = self._n[row], new.shape[0]
        if start + n > self.max_pages:
            raise ValueError(f"append(row={row}) of {n} pages: the row holds {start} of at "
                             f"most max_pages_per_seq={self.max_pages}; release finished "
                             "requests or build the spec with more pages per request")
        if n == 0:
            return
        self.table[row, start:start + n] = new
        self.counts[row] = start + n
        self._tokens[row] = (start + n) * self.page_size
        self._mark(row, start, start + n)

    def append_rows(self, rows: Any, pages: Any) -> None:
        """One page added at the end of each of ``rows`` (distinct): ``pages[i]`` to row
        ``rows[i]``, the appends of one decode step in one call."""
        if self._append_few_fast(rows, pages):
            return
        rows = _ints(rows, "rows")
        new = self._check_pages(_ints(pages, "pages"), "pages")
        k = rows.shape[0]
        if new.shape[0] != k:
            raise ValueError(f"append_rows got {k} rows and {new.shape[0]} pages; expected one "
                             "page per row")
        if k == 0:
            return
        if _any_outside(rows, self.num_rows):
            bad = int(rows[(rows < 0) | (rows >= self.num_rows)][0])
            raise self._row_error("append_rows", bad)
        # A repeated row: its later mark overwrites the earlier one.
        ticket = np.arange(k)
        self._marks[rows] = ticket
        if not np.array_equal(self._marks[rows], ticket):
            raise _repeated_row_error()
        starts = self.counts[rows]
        if int(starts.max()) >= self.max_pages:
            raise self._full_row_error(int(rows[starts.argmax()]))
        self.table[rows, starts] = new
        self.counts[rows] = starts + 1
        tokens, page, mark = self._tokens, self.page_size, self._mark
        for row, start in zip(rows.tolist(), starts.tolist(), strict=True):
            tokens[row] += page
            mark(row, start, start + 1)

    def _append_few_fast(self, rows: Any, pages: Any) -> bool:
        """``append_rows`` of a few pages (ints inside the cache) to distinct rows, given
        as lists or arrays of ints, none full: done in this one function (item writes);
        else False and nothing changed (the general path reports what is wrong)."""
        if type(rows) is np.ndarray and rows.size <= _FEW:
            rows = rows.tolist()
        if type(pages) is np.ndarray and pages.size <= _FEW:
            pages = pages.tolist()
        if type(rows) is not list or type(pages) is not list or len(rows) != len(pages):
            return False
        limit, full, counts = self.num_rows, self.max_pages, self._n
        for row in rows:
            if type(row) is not int or not 0 <= row < limit or counts[row] >= full:
                return False
        limit = self.num_cache_pages
        for value in pages:
            if type(value) is not int or not 0 <= value < limit:
                return False
        if len(rows) > _FEW or len(rows) > 1 and len(set(rows)) != len(rows):
            return False
        flat, tokens, page, lo, hi = self._flat, self._tokens, self.page_size, self._lo, self._hi
        for row, value in zip(rows, pages, strict=True):
            start = counts[row]
            flat[row * full + start] = value
            counts[row] = start + 1
            tokens[row] += page
            if hi[row] == 0:  # clean until now (``_mark``)
                self._dirty_rows.append(row)
                lo[row] = start
            elif lo[row] > start:
                lo[row] = start
            hi[row] = start + 1
        return True

    def release(self, row: int) -> None:
        """The request in slot ``row`` retired: the row holds no pages (a step then passes
        seq_len 0 for it, a padding row)."""
        row = self._row(row)
        self.counts[row] = 0
        self._tokens[row] = 0
        self._lo[row], self._hi[row] = self.max_pages, 0

    def _mark(self, row: int, lo: int, hi: int) -> None:
        """Columns [lo, hi) of ``row`` changed (hi is the row's new end)."""
        if self._hi[row] == 0:  # clean until now
            self._dirty_rows.append(row)
            self._lo[row] = lo
        elif self._lo[row] > lo:
            self._lo[row] = lo
        self._hi[row] = hi

    # ---- staging ----------------------------------------------------------------------------

    def check_lengths(self, lens: list[int] | np.ndarray) -> None:
        """Raise ValueError unless rows [0, B) hold the pages that ``lens`` [B] (ints) need."""
        if type(lens) is not list:
            lens = lens.tolist()
        b = len(lens)
        if b > self.num_rows:
            raise ValueError(f"seq_lens_cpu has {b} requests but the block table has "
                             f"{self.num_rows} rows (batch slots)")
        held = self._tokens
        if any(map(gt, lens, held)):  # stops at the batch's last row
            row = next(i for i, length in enumerate(lens) if length > held[i])
            self._short_row(row, int(lens[row]))

    def changes(self, index_out: np.ndarray, value_out: np.ndarray, row_width: int
                ) -> tuple[int, list[tuple[int, int, int]]]:
        """Drain the changes since the last call: up to ``len(index_out)`` entries written
        as (flat index ``row x row_width + column``, page) into ``index_out`` /
        ``value_out`` (1-D int64 / int32 numpy arrays, or memoryviews of them: a step's few
        entries are then item writes that cost less); rows whose changes do not fit come
        back as (row, lo, hi) column ranges to copy whole. Returns (entries written,
        ranges)."""
        listed = self._dirty_rows
        if not listed:
            return 0, []
        self._dirty_rows = []
        lo, hi, empty = self._lo, self._hi, self.max_pages
        if len(listed) <= _FEW:
            spans, total = [], 0
            for row in listed:
                start, end = lo[row], hi[row]
                if end > start:
                    spans.append((row, start, end))
                    total += end - start
                    lo[row], hi[row] = empty, 0
            if total == len(spans) and total <= len(index_out):
                # One entry per row (a decode step's appends): item writes, here.
                flat, width = self._flat, self.max_pages
                for n, (row, start, _) in enumerate(spans):
                    index_out[n] = row * row_width + start
                    value_out[n] = flat[row * width + start]
                return total, []
            if total <= len(index_out):
                return self._list_spans(spans, index_out, value_out, row_width), []
            rows = np.array([r for r, _, _ in spans], np.int64)
            starts = np.array([a for _, a, _ in spans], np.int64)
            ends = np.array([b for _, _, b in spans], np.int64)
        else:
            rows = np.unique(np.array(listed, np.int64))  # a row released and grown again
            row_list = rows.tolist()
            starts = np.array([lo[r] for r in row_list], np.int64)
            ends = np.array([hi[r] for r in row_list], np.int64)
            live = ends > starts  # the others are clean
            if not live.all():
                rows, starts, ends = rows[live], starts[live], ends[live]
            for r in row_list:
                lo[r], hi[r] = empty, 0
        if rows.size == 0:
            return 0, []
        index_out, value_out = np.asarray(index_out), np.asarray(value_out)
        widths = ends - starts
        capacity = index_out.shape[0]
        copied: list[tuple[int, int, int]] = []
        if int(widths.sum()) > capacity:
            # Widest rows (new long requests) go whole until the rest fits the list.
            order = np.argsort(-widths, kind="stable")
            left = np.cumsum(widths[order][::-1])[::-1]  # what remains from each on
            cut = int(np.searchsorted(-left, -capacity))  # first position where it fits
            whole = np.sort(order[:cut])
            copied = [(int(rows[i]), int(starts[i]), int(ends[i])) for i in whole]
            keep = np.sort(order[cut:])
            rows, starts, ends, widths = rows[keep], starts[keep], ends[keep], widths[keep]
        n = int(widths.sum())
        if n == rows.size:  # one entry per row: the decode step's appends
            cols = starts
            flat_rows = rows
        else:
            flat_rows = np.repeat(rows, widths)
            first = np.repeat(np.cumsum(widths) - widths, widths)
            cols = np.repeat(starts, widths) + (np.arange(n) - first)
        np.multiply(flat_rows, row_width, out=index_out[:n])
        index_out[:n] += cols
        value_out[:n] = self.table[flat_rows, cols]
        return n, copied

    def _list_spans(self, spans: list[tuple[int, int, int]], index_out: Any,
                    value_out: Any, row_width: int) -> int:
        """Entries of a few (row, lo, hi) spans that fit the list: item writes (through
        memoryviews where the caller passes them), numpy where a span is wide."""
        n, flat, width = 0, self._flat, self.max_pages
        for row, start, end in spans:
            if end - start == 1:
                index_out[n] = row * row_width + start
                value_out[n] = flat[row * width + start]
                n += 1
            else:
                m = n + end - start
                first = row * row_width
                np.asarray(index_out)[n:m] = np.arange(first + start, first + end)
                np.asarray(value_out)[n:m] = self.table[row, start:end]
                n = m
        return n

    def discard_changes(self) -> None:
        """Forget the changes since the last step (the whole table is being staged)."""
        self._lo = [self.max_pages] * self.num_rows
        self._hi = [0] * self.num_rows
        self._dirty_rows = []

    # ---- checks -------------------------------------------------------------------------------

    def _row(self, row: Any) -> int:
        if isinstance(row, bool) or not hasattr(row, "__index__"):
            raise TypeError(f"row must be an int (a batch slot), got {type(row).__name__} "
                            f"{row!r}")
        row = int(row)
        if not 0 <= row < self.num_rows:
            raise ValueError(f"row {row} is outside the block table's rows [0, "
                             f"{self.num_rows}) (one per batch slot)")
        return row

    def _pages(self, pages: Any, name: str) -> np.ndarray:
        return self._check_pages(_ints(pages, name), name)

    def _check_pages(self, arr: np.ndarray, name: str) -> np.ndarray:
        if arr.size and _any_outside(arr, self.num_cache_pages):
            i = int(np.flatnonzero((arr < 0) | (arr >= self.num_cache_pages))[0])
            raise self._page_error(name, i, int(arr[i]))
        return arr

    def _page_error(self, name: str, i: int, value: int) -> ValueError:
        return ValueError(f"{name}[{i}] = {value} points outside the KV cache (expected a "
                          f"page index in [0, {self.num_cache_pages})); nothing was changed. "
                          "Fix the scheduler's page allocation")

    def _short_row(self, row: int, length: int) -> None:
        need = -(-length // self.page_size)
        raise ValueError(f"seq_lens_cpu[{row}] = {length} needs {need} pages of "
                         f"{self.page_size}, but row {row} of the block table holds "
                         f"{int(self.counts[row])}; append its pages (block_table.append) "
                         "before the step")

    def _row_error(self, verb: str, row: int) -> ValueError:
        return ValueError(f"{verb} got row {row}; rows lie in [0, {self.num_rows})")

    def _full_row_error(self, row: int) -> ValueError:
        return ValueError(f"append_rows: row {row} already holds max_pages_per_seq="
                          f"{self.max_pages} pages; release finished requests or build "
                          "the spec with more pages per request")


def _repeated_row_error() -> ValueError:
    return ValueError("append_rows got a row twice; append several pages to one row with "
                      "append(row, pages)")


def _ints(value: Any, name: str) -> np.ndarray:
    if type(value) is np.ndarray:
        arr = value
    else:
        if hasattr(value, "numpy") and hasattr(value, "is_cpu"):  # a torch tensor
            if not value.is_cpu:
                raise TypeError(f"{name} is a tensor on {value.device}; pass a host copy")
            value = value.numpy()
        arr = np.asarray(value)
        if arr.size == 0:
            arr = arr.astype(np.int64).reshape(0)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} has dtype {arr.dtype}; expected integers. Cast it to int32")
    if arr.ndim != 1:
        raise ValueError(f"{name} has shape {arr.shape}; expected one dimension")
    return arr


def _any_outside(arr: np.ndarray, limit: int) -> bool:
    if arr.shape[0] == 1:
        v = int(arr[0])
        return v < 0 or v >= limit
    # One pass: viewed as unsigned, negative entries wrap above any limit.
    if arr.dtype.kind == "i" and arr.dtype.itemsize in (4, 8):
        return bool(arr.view(np.uint32 if arr.dtype.itemsize == 4 else np.uint64).max()
                    >= limit)
    return bool(arr.min() < 0 or arr.max() >= limit)
