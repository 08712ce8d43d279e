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

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from graphbucket.backends.base import DecodeBackend, Plan, WorkspaceSpec
from graphbucket.batch import CheckedBatch
from graphbucket.block_table import BlockTable
from graphbucket.context import DecodeContext
from graphbucket.spec import BufferSpec
from graphbucket.staging import (
    StagingSlot,
    arena_layout,
    default_max_table_changes,
    staging_slot,
    table_views,
)

__all__ = ["StaticBuffers", "default_max_table_changes"]

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
    _slots: list[StagingSlot]
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
        segments, nbytes = arena_layout(spec, max_batch_size, max_q_len, changes)
        arena = torch.zeros(nbytes, dtype=torch.uint8, device=spec.device)
        views = {name: seg.view(arena) for name, seg in segments.items()}
        table, flat, sink = table_views(views["block_table"], max_batch_size)
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
            _slots=[staging_slot(segments, nbytes, spec.device if pin else None)
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

    def _stage_table(self, table: BlockTable, index: int, slot: StagingSlot,
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

    def _acquire_slot(self) -> tuple[int, StagingSlot]:
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
