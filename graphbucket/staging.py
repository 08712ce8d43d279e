"""The staging arena: its layout, shared by the device arena, and the pinned slots a host
step writes before the arena prefix moves to the device (``buffers.StaticBuffers``).

Each slot knows which bytes an earlier stage left dirty, so a stage zeroes only those; its
first word is the ticket a graph's copy kernel hands back (``kernels.staging``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from graphbucket.batch import CheckedBatch, numpy_view_dtype
from graphbucket.block_table import BlockTable
from graphbucket.spec import BufferSpec

_ALIGN = 256  # bytes; keeps every arena view aligned for any dtype and vector loads


@dataclass(frozen=True, slots=True)
class Segment:
    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def view(self, arena: torch.Tensor) -> torch.Tensor:
        return arena[self.offset:self.offset + self.nbytes].view(self.dtype).view(self.shape)


def default_max_table_changes(max_bs: int) -> int:
    """Table entries one step stages as a list: a decode step appends at most one page per
    request; the headroom takes a few new short requests."""
    return 4 * max_bs + 64


def arena_layout(spec: BufferSpec, max_bs: int, max_q_len: int = 1, max_changes: int = 64
            ) -> tuple[dict[str, Segment], int]:
    # block_table goes last: a stage copies the arena prefix up to row padded_bs of it (a
    # step with a BlockTable: up to the table). One element past the table is the sink.
    tokens = max_bs * max_q_len
    # The ticket: word 0 of a slot, which a graph's copy kernel hands back when done.
    wanted = [("ticket", (1,), torch.int64), ("seq_lens", (max_bs,), torch.int32),
              ("positions", (tokens,), torch.int64)]
    wanted += [(f"input:{s.name}", (tokens, *s.shape), s.dtype) for s in spec.inputs]
    wanted += [("change_index", (max_changes,), torch.int64),
               ("change_value", (max_changes,), torch.int32),
               ("block_table", (max_bs * spec.max_pages_per_seq + 1,), torch.int32)]
    segments, offset = {}, 0
    for name, shape, dtype in wanted:
        seg = Segment(name, offset, tuple(shape), dtype)
        segments[name] = seg
        offset += -(-seg.nbytes // _ALIGN) * _ALIGN
    return segments, offset


@dataclass(eq=False, slots=True)
class StagingSlot:
    """One pinned staging arena and what is known about the bytes it still holds.

    Dirt tracking lets a stage zero only what an earlier stage left behind: seq_lens
    rows from ``live_rows`` on and positions and input rows from ``live_tokens`` on are zero,
    change entries from ``live_changes`` on aim at the sink.
    """

    arena: torch.Tensor  # uint8, host; pinned when the buffers live on CUDA
    seq_lens: np.ndarray
    positions: np.ndarray
    block_table: np.ndarray  # [max_bs, max_pages]
    table_tensor: torch.Tensor  # the same memory, the source of whole-row copies
    change_index: np.ndarray
    change_value: np.ndarray
    sink: int
    inputs: dict[str, np.ndarray]  # viewed as numpy_view_dtype (raw bits where numpy has none)
    # External: recorded inside a captured graph, it becomes an event node of that graph.
    event: torch.cuda.Event | None
    # Recorded by a stage that copies (torch.Event records on the current stream in C++,
    # a cheaper call than torch.cuda.Event's); ``pending`` is whichever was recorded last.
    host_event: torch.Event | None = None
    pending: torch.Event | torch.cuda.Event | None = None
    # The copy-kernel path: the ticket this slot carries and the pinned word the kernel
    # writes it back to (``pending`` is None while a ticket is out).
    # Memoryviews: an item read or write through one is cheaper than numpy's.
    ticket: memoryview | None = None
    done: torch.Tensor | None = None
    done_words: memoryview | None = None
    issued: int = 0
    in_flight: bool = False
    live_rows: int = 0
    live_tokens: int = 0
    live_changes: int = 0
    first_rows: dict = field(default_factory=dict)  # n -> ``_first_rows(n)``
    # Memoryviews of seq_lens (int32), positions (int64), the change list and each input's
    # bytes: a step's writes through them are single copies or item writes, where numpy's
    # calls cost more (on the cold caches of a host that waited on a GPU step, many times).
    lens_view: memoryview | None = None
    positions_view: memoryview | None = None
    index_view: memoryview | None = None
    value_view: memoryview | None = None
    input_bytes: dict = field(default_factory=dict)
    table_width: int = 0  # block_table.shape[1], the flat index's row width

    def fill(self, batch: CheckedBatch, padded_bs: int) -> None:
        """Rows [0, bs) from ``batch``; rows [bs, padded_bs) neutral (zero lengths). Per-token
        rows: [0, bs x q_len) from ``batch``, [bs x q_len, padded_bs x q_len) zero."""
        bs, q_len = batch.batch_size, batch.q_len
        tokens = bs * q_len
        if batch.plain and batch.positions is None:  # a list of ints, q_len 1
            lens_view, positions_view = self.lens_view, self.positions_view
            if batch.min_len:
                for i, n in enumerate(batch.lens_list):
                    lens_view[i] = n
                    positions_view[i] = n - 1
            else:
                for i, n in enumerate(batch.lens_list):
                    lens_view[i] = n
                    positions_view[i] = n - 1 if n else 0
        else:
            self._fill_lengths(batch)
        copies = batch.host_copies
        if copies is not None:
            dst = self.input_bytes
            for name, data in copies:
                dst[name][:len(data)] = data
        elif batch.host_inputs:
            cached = self.first_rows
            inputs = (cached.get(tokens) or self._first_rows(tokens))[2]
            for name, arr in batch.host_inputs:
                inputs[name][...] = arr
        live = self.live_rows
        top = padded_bs if padded_bs < live else live
        if top > bs:
            self.seq_lens[bs:top] = 0
        self.live_rows = bs if live <= padded_bs else live
        live, padded = self.live_tokens, padded_bs * q_len
        top = padded if padded < live else live
        if top > tokens:
            self.positions[tokens:top] = 0
            for arr in self.inputs.values():  # device inputs too: the prefix copy pads them
                arr[tokens:top] = 0
        self.live_tokens = tokens if live <= padded else live
        table = batch.block_table
        if table is not None:
            self.block_table[:bs, :table.shape[1]] = table
            self._changed(0)

    def _fill_lengths(self, batch: CheckedBatch) -> None:
        """seq_lens and positions of rows [0, bs) by numpy (lengths not passed as a list,
        given positions, or a verify step)."""
        bs, lens, q_len = batch.batch_size, batch.seq_lens, batch.q_len
        cached = self.first_rows
        rows = cached.get(bs) or self._first_rows(bs)
        rows[0][...] = lens
        tokens = bs * q_len
        positions = (rows if q_len == 1 else cached.get(tokens) or self._first_rows(tokens))[1]
        if batch.positions is not None:
            positions[...] = batch.positions
        elif q_len == 1:
            np.subtract(lens, 1, out=positions, dtype=np.int64)
            if batch.min_len == 0:
                np.maximum(positions, 0, out=positions)
        else:  # token j at seq_len - q_len + j; padding requests at 0
            grid = positions.reshape(bs, q_len)
            np.add(lens[:, None].astype(np.int64) - q_len, np.arange(q_len), out=grid)
            np.maximum(grid, 0, out=grid)

    def _first_rows(self, n: int) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        # (seq_lens[:n], positions[:n], name -> inputs[name][:n]), cached per n so that a
        # step slices nothing: each slice is a numpy call, dear on a host's cold caches.
        views = (self.seq_lens[:n], self.positions[:n],
                 {name: arr[:n] for name, arr in self.inputs.items()})
        self.first_rows[n] = views
        return views

    def fill_changes(self, table: BlockTable) -> list[tuple[int, int, int]]:
        """The table's changes: listed up to capacity, the rest written into this slot's
        rows; returns those rows' (row, lo, hi) column ranges to copy."""
        n, whole = table.changes(self.index_view, self.value_view, self.table_width)
        if n != self.live_changes:
            self._changed(n)
        for row, lo, hi in whole:
            self.block_table[row, lo:hi] = table.table[row, lo:hi]
        return whole

    def _changed(self, n: int) -> None:
        live = self.live_changes
        if live > n:
            if live - n <= 8:  # the usual step: a few entries, item writes
                index, sink = self.index_view, self.sink
                for i in range(n, live):
                    index[i] = sink
            else:
                self.change_index[n:live] = self.sink
        self.live_changes = n


def staging_slot(segments: dict[str, Segment], nbytes: int, device: torch.device | None
                  ) -> StagingSlot:
    """A staging arena; pinned, with a reuse event, when ``device`` (a CUDA device) is given."""
    pin = device is not None
    arena = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
    views = {name: seg.view(arena) for name, seg in segments.items()}
    inputs = {name[6:]: t.view(numpy_view_dtype(t.dtype)).numpy()
              for name, t in views.items() if name.startswith("input:")}
    table, _, sink = table_views(views["block_table"], segments["seq_lens"].shape[0])
    views["change_index"].fill_(sink)
    done = torch.zeros(1, dtype=torch.int64, pin_memory=pin)
    slot = StagingSlot(arena, views["seq_lens"].numpy(), views["positions"].numpy(),
                       table.numpy(), table, views["change_index"].numpy(),
                       views["change_value"].numpy(), sink, inputs,
                       torch.cuda.Event(external=True) if pin else None,
                       torch.Event(device) if pin else None,
                       ticket=memoryview(views["ticket"].numpy()), done=done,
                       done_words=memoryview(done.numpy()))
    slot.lens_view, slot.positions_view = _cast(slot.seq_lens, "i"), _cast(slot.positions, "q")
    slot.index_view = _cast(slot.change_index, "q")
    slot.value_view = _cast(slot.change_value, "i")
    slot.input_bytes = {name: _cast(arr, "B") for name, arr in inputs.items()}
    slot.table_width = slot.block_table.shape[1]
    return slot


def _cast(arr: np.ndarray, fmt: str) -> memoryview:
    view = memoryview(arr).cast("B")
    return view if fmt == "B" else view.cast(fmt)


def table_views(flat: torch.Tensor, max_bs: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(table [max_bs, max_pages], flat table with its sink element, the sink's index)."""
    sink = flat.shape[0] - 1
    return flat[:sink].view(max_bs, sink // max_bs), flat, sink
