"""Every static tensor the captured graphs touch, allocated once at the worst case.

``StaticBuffers`` owns seq_info (``seq_lens``, ``block_table``, ``positions`` and the
caller's ``inputs``), the backend's persistent workspace and the ``output``. seq_info
lives in one device arena so that a whole host batch moves with one non-blocking copy
from a pinned staging arena. Staging arenas form a ring of ``num_staging_slots``; an
event per slot guards its reuse, so a stage never overwrites pinned memory whose copy is
still in flight.

Two ways to move a staged slot. ``stage(batch, padded_bs)`` enqueues the copy and records
the slot's event (the eager path). ``stage(..., in_graph=True)`` only fills the slot and
returns its index: the graph replayed next copies that slot itself, as its first nodes
(``slot_copy``, captured once per slot), so a replayed step makes no copy or event call
on the host. The graph table therefore holds one graph per (key, slot), and a replay must
name the slot its stage returned. On CUDA that first node is a kernel reading the pinned
slot (``kernels.staging``): it hands the slot's ticket back to a pinned word when done, and
the next stage of the slot compares two integers instead of querying an event. Where the
kernel cannot read pinned memory (a trial copy at allocation fails) it is a memcpy node
followed by an event node.

Per-token tensors (``positions``, the inputs, the output) hold ``max_q_len`` rows per
request: a verify step of q_len tokens per request stages B x q_len of them (token j of
request b at row b * q_len + j); per-request ones (``seq_lens``, ``block_table``) one.

Padding rows (``batch_size <= row < padded_bs``) get seq_len 0, position 0 and zero
inputs: kernels read nothing for them and write only their own output rows. Block-table
entries past a row's live pages are not cleared: kernels read only the first
``ceil(seq_len / page_size)`` entries of a row, and every entry ever staged was checked
to lie inside the cache, so a stale one is still a valid page. Clearing them would cost a
pass over the table per step (a 64 x 128K batch holds 512 KB of it).

Incremental block table: a batch that carries the runner's ``BlockTable`` leaves the
block table out of the prefix copy (which then stops before it: O(batch)). The entries
changed since the last step travel in the same copy as a fixed-capacity list of (flat
index, page), unused entries aimed at a sink element past the table, and
``apply_table_changes`` scatters them in on the device: the first thing every graph body
and eager forward does (static shapes, no sync). Rows whose changes do not fit the list
(a new long request) are copied row by row before the replay, through the same pinned
slot. The first such step after a full-table step (or a new ``BlockTable``) copies the
whole table once, so the device mirrors the host table from then on.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from graphbucket.backends.base import DecodeBackend, Plan, WorkspaceSpec
from graphbucket.batch import CheckedBatch, numpy_view_dtype
from graphbucket.block_table import BlockTable
from graphbucket.context import DecodeContext
from graphbucket.spec import BufferSpec

_ALIGN = 256  # bytes; keeps every arena view aligned for any dtype and vector loads


@dataclass(frozen=True, slots=True)
class _Segment:
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


def _layout(spec: BufferSpec, max_bs: int, max_q_len: int = 1, max_changes: int = 64
            ) -> tuple[dict[str, _Segment], int]:
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
        seg = _Segment(name, offset, tuple(shape), dtype)
        segments[name] = seg
        offset += -(-seg.nbytes // _ALIGN) * _ALIGN
    return segments, offset


@dataclass(eq=False, slots=True)
class _StagingSlot:
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
    ticket: np.ndarray | None = None
    done: torch.Tensor | None = None
    done_words: np.ndarray | None = None
    issued: int = 0
    in_flight: bool = False
    live_rows: int = 0
    live_tokens: int = 0
    live_changes: int = 0

    def fill(self, batch: CheckedBatch, padded_bs: int) -> None:
        """Rows [0, bs) from ``batch``; rows [bs, padded_bs) neutral (zero lengths). Per-token
        rows: [0, bs x q_len) from ``batch``, [bs x q_len, padded_bs x q_len) zero."""
        bs, lens, q_len = batch.batch_size, batch.seq_lens, batch.q_len
        tokens = bs * q_len
        self.seq_lens[:bs] = lens
        positions = self.positions[:tokens]
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
        for name, arr in batch.host_inputs:
            self.inputs[name][:tokens] = arr
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

    def fill_changes(self, table: BlockTable) -> list[tuple[int, int, int]]:
        """The table's changes: listed up to capacity, the rest written into this slot's
        rows; returns those rows' (row, lo, hi) column ranges to copy."""
        n, whole = table.changes(self.change_index, self.change_value,
                                 self.block_table.shape[1])
        self._changed(n)
        for row, lo, hi in whole:
            self.block_table[row, lo:hi] = table.table[row, lo:hi]
        return whole

    def _changed(self, n: int) -> None:
        if self.live_changes > n:
            self.change_index[n:self.live_changes] = self.sink
        self.live_changes = n


def _staging_slot(segments: dict[str, _Segment], nbytes: int, device: torch.device | None
                  ) -> _StagingSlot:
    """A staging arena; pinned, with a reuse event, when ``device`` (a CUDA device) is given."""
    pin = device is not None
    arena = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
    views = {name: seg.view(arena) for name, seg in segments.items()}
    inputs = {name[6:]: t.view(numpy_view_dtype(t.dtype)).numpy()
              for name, t in views.items() if name.startswith("input:")}
    table, _, sink = _table_views(views["block_table"], segments["seq_lens"].shape[0])
    views["change_index"].fill_(sink)
    done = torch.zeros(1, dtype=torch.int64, pin_memory=pin)
    return _StagingSlot(arena, views["seq_lens"].numpy(), views["positions"].numpy(),
                        table.numpy(), table, views["change_index"].numpy(),
                        views["change_value"].numpy(), sink, inputs,
                        torch.cuda.Event(external=True) if pin else None,
                        torch.Event(device) if pin else None, ticket=views["ticket"].numpy(),
                        done=done, done_words=done.numpy())


def _table_views(flat: torch.Tensor, max_bs: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(table [max_bs, max_pages], flat table with its sink element, the sink's index)."""
    sink = flat.shape[0] - 1
    return flat[:sink].view(max_bs, sink // max_bs), flat, sink


@dataclass(eq=False)
class StaticBuffers:
    """seq_info + persistent workspace + output, shared by every graph (static addresses).

    seq_lens [max_bs] int32, positions [max_bs * max_q_len] int64, block_table [max_bs,
    max_pages] int32, inputs name -> [max_bs * max_q_len, *shape], output [max_bs *
    max_q_len, *output_shape], all on ``spec.device``. Graph-safe: nothing here is ever
    reallocated; ``stage`` only copies, and ``apply_table_changes`` scatters the staged
    block-table changes on the device (part of every graph body).
    """

    spec: BufferSpec
    max_batch_size: int
    seq_lens: torch.Tensor
    positions: torch.Tensor
    block_table: torch.Tensor
    inputs: dict[str, torch.Tensor]
    output: torch.Tensor
    workspace: Any
    workspace_nbytes: int
    _arena: torch.Tensor
    _bt_offset: int
    _slots: list[_StagingSlot]
    _next_slot: int = 0
    _prefixes: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=dict)
    _rows: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=dict)
    staging_waits: int = 0
    max_q_len: int = 1
    _changes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    _mirror: BlockTable | None = None  # the BlockTable the device table mirrors
    # Device int32 arrival counter of the slot-copy kernel; None: graphs copy with a
    # memcpy node and an event node (no CUDA, or the kernel cannot read pinned memory).
    _copy_counter: torch.Tensor | None = None

    @classmethod
    def allocate(cls, spec: BufferSpec, *, max_batch_size: int, workspace: WorkspaceSpec,
                 num_staging_slots: int = 2, max_q_len: int = 1,
                 max_table_changes: int | None = None,
                 copy_kernel: bool = True) -> StaticBuffers:
        """Allocate everything once for ``max_batch_size`` requests of up to ``max_q_len``
        query tokens each (before any capture). ``max_table_changes``: block-table entries
        a ``BlockTable`` step stages as a list (default ``default_max_table_changes``).
        ``copy_kernel``: on CUDA, let a slot's graph copy the slot with the copy kernel
        where it reads pinned memory (False: always a memcpy node and an event node)."""
        changes = (default_max_table_changes(max_batch_size) if max_table_changes is None
                   else max_table_changes)
        if max_batch_size < 1 or num_staging_slots < 1 or max_q_len < 1 or changes < 1:
            raise ValueError(f"need max_batch_size, num_staging_slots, max_q_len and "
                             f"max_table_changes >= 1, got {max_batch_size}, "
                             f"{num_staging_slots}, {max_q_len} and {changes}")
        segments, nbytes = _layout(spec, max_batch_size, max_q_len, changes)
        arena = torch.zeros(nbytes, dtype=torch.uint8, device=spec.device)
        views = {name: seg.view(arena) for name, seg in segments.items()}
        table, flat, sink = _table_views(views["block_table"], max_batch_size)
        views["change_index"].fill_(sink)
        pin = spec.device.type == "cuda" and torch.cuda.is_available()
        buffers = cls(
            spec=spec, max_batch_size=max_batch_size, seq_lens=views["seq_lens"],
            positions=views["positions"], block_table=table,
            inputs={s.name: views[f"input:{s.name}"] for s in spec.inputs},
            output=torch.zeros(max_batch_size * max_q_len, *spec.output_shape,
                               dtype=spec.output_dtype, device=spec.device),
            workspace=workspace.allocate(spec.device), workspace_nbytes=workspace.nbytes,
            _arena=arena, _bt_offset=segments["block_table"].offset,
            _slots=[_staging_slot(segments, nbytes, spec.device if pin else None)
                    for _ in range(num_staging_slots)], max_q_len=max_q_len,
            _changes=(flat, views["change_index"], views["change_value"]))
        if pin and copy_kernel:
            buffers._copy_counter = _probe_copy_kernel(buffers)
        return buffers

    @property
    def nbytes(self) -> int:
        """Device bytes: seq_info arena + output + workspace."""
        out = self.output.numel() * self.output.element_size()
        return self._arena.numel() + out + self.workspace_nbytes

    def staging_tensors(self) -> list[torch.Tensor]:
        """The host staging arenas (pinned on CUDA); for tests and diagnostics."""
        return [slot.arena for slot in self._slots]

    def stage(self, batch: CheckedBatch, padded_bs: int, *, in_graph: bool = False) -> int:
        """Copy a validated host batch into rows [0, padded_bs) of seq_info (per-token
        tensors: rows [0, padded_bs x q_len)); pad the rest. Returns the staging slot used.

        One pinned host -> device copy (non-blocking) of the arena prefix, plus device ->
        device copies for inputs already on the device. ``in_graph``: the slot is filled
        but the prefix copy and the event are left to the graph replayed next, captured
        for this slot (``slot_copy``); pass it the returned index. Block-table rows that
        do not travel in that prefix (a full table, rows too changed for the list) are
        still copied here, ahead of the replay on the same stream. Graph-safe and
        sync-free, except that a staging slot whose previous copy is still in flight is
        waited for (the GPU is a whole ring of steps behind; counted in
        ``staging_waits``).
        """
        bs = batch.batch_size
        assert bs <= padded_bs <= self.max_batch_size, (bs, padded_bs, self.max_batch_size)
        assert batch.q_len <= self.max_q_len, (batch.q_len, self.max_q_len)
        if in_graph and batch.device_inputs:
            raise ValueError("a batch with device inputs cannot leave its copy to the graph: "
                             "the graph's copy would land after the inputs' device copies "
                             "and overwrite them; stage it with in_graph=False")
        index, slot = self._acquire_slot()
        slot.fill(batch, padded_bs)
        event = slot.event
        paged = batch.paged
        if paged is None:
            self._mirror = None
            if in_graph:  # the graph copies the prefix before the table: the rows here
                views = self._rows.get(padded_bs) or self._row_views(padded_bs)
            else:
                views = self._prefixes.get(padded_bs) or self._prefix_views(padded_bs)
            views[0].copy_(views[1][index], non_blocking=event is not None)
        else:
            self._stage_table(paged, index, slot, in_graph)
        # Rows [bs, padded_bs) of a device input were zeroed by the prefix copy.
        tokens = bs * batch.q_len
        for name, t in batch.device_inputs:
            self.inputs[name][:tokens].copy_(t, non_blocking=True)
        if event is not None:
            if in_graph:
                # Recorded by the graph: its event, or the copy kernel's ticket.
                slot.pending = None if self._copy_counter is not None else event
            else:
                slot.pending = slot.host_event
                slot.host_event.record()
            slot.in_flight = True
        return index

    def slot_copy(self, index: int) -> Callable[[], None]:
        """The copy a graph captured for staging slot ``index`` starts with: the arena
        prefix before the block table (the ticket, seq_lens, positions, inputs, the change
        list), by the copy kernel that hands the ticket back; without it (no CUDA, or the
        trial copy failed) a copy and the slot's event (an event node of the graph), so the
        next stage of the slot knows when the copy has landed."""
        dst, srcs = self._prefixes.get(0) or self._prefix_views(0)
        slot = self._slots[index]
        src, event = srcs[index], slot.event
        if self._copy_counter is not None:
            from graphbucket.kernels.staging import launch_copy_slot
            words, dst_words = src.view(torch.int64), dst.view(torch.int64)
            counter, done = self._copy_counter, slot.done
            return lambda: launch_copy_slot(words, dst_words, counter, done)

        def copy() -> None:
            dst.copy_(src, non_blocking=event is not None)
            if event is not None:
                event.record()
        return copy

    @property
    def num_staging_slots(self) -> int:
        return len(self._slots)

    @property
    def slot_copy_kind(self) -> str:
        """What a slot's graph starts with: "kernel" (CUDA, the copy kernel), "memcpy" (CUDA,
        a memcpy node and an event node) or "copy" (no CUDA)."""
        if self._copy_counter is not None:
            return "kernel"
        return "memcpy" if self._slots and self._slots[0].event is not None else "copy"

    def _stage_table(self, table: BlockTable, index: int, slot: _StagingSlot,
                     in_graph: bool) -> None:
        """Everything before the block table (the change list included; left to the graph
        when ``in_graph``), then the rows whose changes did not fit the list; the whole
        table when the device does not mirror it."""
        assert table.num_rows == self.max_batch_size, (table.num_rows, self.max_batch_size)
        non_blocking = slot.event is not None
        if self._mirror is not table:
            table.discard_changes()  # the whole table goes
            slot.fill_changes(table)  # nothing left to list: aims the list at the sink
            slot.block_table[...] = table.table
            self.block_table.copy_(slot.table_tensor, non_blocking=non_blocking)
            self._mirror = table
            whole = []
        else:
            whole = slot.fill_changes(table)
        if not in_graph:
            views = self._prefixes.get(0) or self._prefix_views(0)
            views[0].copy_(views[1][index], non_blocking=non_blocking)
        for row, lo, hi in whole:
            self.block_table[row, lo:hi].copy_(slot.table_tensor[row, lo:hi],
                                               non_blocking=non_blocking)

    def apply_table_changes(self) -> None:
        """Scatter the staged block-table changes into the device table (unused entries hit
        the sink). Graph-safe: static shapes, device data only; every body runs it first."""
        flat, index, value = self._changes
        flat.index_copy_(0, index, value)

    def _prefix_views(self, padded_bs: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # Arena prefix that holds rows [0, padded_bs) of every seq_info tensor (block_table
        # is laid out last; 0: none of it); cached per size so a step slices nothing.
        return self._span_views(self._prefixes, padded_bs, 0)

    def _row_views(self, padded_bs: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # Block-table rows [0, padded_bs) alone, the part of a full-table stage that a
        # graph's own copy (the prefix before the table) leaves out.
        return self._span_views(self._rows, padded_bs, self._bt_offset)

    def _span_views(self, cache: dict, padded_bs: int, lo: int
                    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(device arena, every slot's arena) over bytes [lo, end of table row padded_bs),
        cached in ``cache`` under ``padded_bs``."""
        hi = self._bt_offset + padded_bs * self.block_table.stride(0) * 4
        views = (self._arena[lo:hi], [slot.arena[lo:hi] for slot in self._slots])
        cache[padded_bs] = views
        return views

    def _acquire_slot(self) -> tuple[int, _StagingSlot]:
        index = self._next_slot
        slot = self._slots[index]
        self._next_slot = index + 1 if index + 1 < len(self._slots) else 0
        if slot.in_flight:
            pending = slot.pending
            if pending is None:  # a copy kernel's ticket: back once the slot was read
                if int(slot.done_words[0]) != slot.issued:
                    self.staging_waits += 1
                    # Everything enqueued has run after this; a ticket still out then
                    # belongs to a graph that was never launched, which reads nothing.
                    torch.cuda.synchronize(self.spec.device)
            elif not pending.query():
                self.staging_waits += 1
                pending.synchronize()  # its copy has not landed: rewriting it would race
            slot.in_flight = False
        if self._copy_counter is not None:
            slot.issued += 1
            slot.ticket[0] = slot.issued
        return index, slot

    def context(self, batch_size: int, plan: Plan, backend: DecodeBackend,
                sm_scale: float, *, q_len: int = 1) -> DecodeContext:
        """Views of rows [0, batch_size) (per-token tensors: [0, batch_size x q_len)) with
        the plan a graph is captured (or run) with."""
        if not 1 <= batch_size <= self.max_batch_size:
            raise ValueError(f"batch_size {batch_size} outside [1, {self.max_batch_size}]")
        if not 1 <= q_len <= self.max_q_len:
            raise ValueError(f"q_len {q_len} outside [1, {self.max_q_len}]")
        tokens = batch_size * q_len
        return DecodeContext(
            batch_size=batch_size, plan=plan, backend=backend, sm_scale=sm_scale,
            seq_lens=self.seq_lens[:batch_size], block_table=self.block_table[:batch_size],
            positions=self.positions[:tokens],
            inputs={name: t[:tokens] for name, t in self.inputs.items()},
            workspace=self.workspace, q_len=q_len)

    def close(self) -> None:
        """Drop every tensor (call after the graphs that captured them are gone)."""
        self._slots.clear()
        self._prefixes.clear()
        self._rows.clear()
        self._changes, self._mirror = None, None
        self.inputs.clear()
        self.workspace = None
        empty = torch.empty(0)
        self.seq_lens = self.positions = self.block_table = self.output = self._arena = empty



def _probe_copy_kernel(buffers: StaticBuffers) -> torch.Tensor | None:
    """The slot-copy kernel's arrival counter if the kernel reads a pinned slot here (one
    trial copy of slot 0, checked), else None: graphs then copy with a memcpy node."""
    from graphbucket.kernels.staging import launch_copy_slot

    counter = torch.zeros(1, dtype=torch.int32, device=buffers.spec.device)
    dst, srcs = buffers._prefix_views(0)
    slot = buffers._slots[0]
    slot.ticket[0] = -1
    try:
        launch_copy_slot(srcs[0].view(torch.int64), dst.view(torch.int64), counter, slot.done)
        torch.cuda.synchronize(buffers.spec.device)
        ok = int(slot.done_words[0]) == -1 and torch.equal(dst.cpu(), srcs[0])
    except Exception:  # noqa: BLE001 - any failure means: use the memcpy node
        ok = False
    slot.ticket[0] = 0
    slot.done_words[0] = 0
    return counter if ok else None  # dst now holds slot 0 as allocated: a neutral batch
