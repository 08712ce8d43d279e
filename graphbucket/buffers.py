"""Every static tensor the captured graphs touch, allocated once at the worst case.

``StaticBuffers`` owns seq_info (``seq_lens``, ``block_table``, ``positions`` and the
caller's ``inputs``), the backend's persistent workspace and the ``output``. seq_info
lives in one device arena so that ``stage`` moves a whole host batch with one
non-blocking copy from a pinned staging arena. Staging arenas form a ring of
``num_staging_slots``; an event per slot guards its reuse, so a stage never overwrites
pinned memory whose copy is still in flight.

Per-token tensors (``positions``, the inputs, the output) hold ``max_q_len`` rows per
request: a verify step of q_len tokens per request stages B x q_len of them (token j of
request b at row b * q_len + j); per-request ones (``seq_lens``, ``block_table``) one.

Padding rows (``batch_size <= row < padded_bs``) get seq_len 0, position 0 and zero
inputs: kernels read nothing for them and write only their own output rows. Block-table
entries past a row's live pages are not cleared: kernels read only the first
``ceil(seq_len / page_size)`` entries of a row, and every entry ever staged was checked
to lie inside the cache, so a stale one is still a valid page. Clearing them would cost a
pass over the table per step (a 64 x 128K batch holds 512 KB of it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from graphbucket.backends.base import DecodeBackend, WorkspaceSpec
from graphbucket.batch import CheckedBatch, numpy_view_dtype
from graphbucket.context import DecodeContext
from graphbucket.plan import LaunchPlan
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


def _layout(spec: BufferSpec, max_bs: int, max_q_len: int = 1
            ) -> tuple[dict[str, _Segment], int]:
    # block_table goes last: a stage copies the arena prefix up to row padded_bs of it.
    tokens = max_bs * max_q_len
    wanted = [("seq_lens", (max_bs,), torch.int32), ("positions", (tokens,), torch.int64)]
    wanted += [(f"input:{s.name}", (tokens, *s.shape), s.dtype) for s in spec.inputs]
    wanted += [("block_table", (max_bs, spec.max_pages_per_seq), torch.int32)]
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
    rows from ``live_rows`` on and positions and input rows from ``live_tokens`` on are zero.
    """

    arena: torch.Tensor  # uint8, host; pinned when the buffers live on CUDA
    seq_lens: np.ndarray
    positions: np.ndarray
    block_table: np.ndarray
    inputs: dict[str, np.ndarray]  # viewed as numpy_view_dtype (raw bits where numpy has none)
    event: torch.Event | None  # torch.Event records on the current stream in C++
    in_flight: bool = False
    live_rows: int = 0
    live_tokens: int = 0

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
        self.block_table[:bs, :table.shape[1]] = table


def _staging_slot(segments: dict[str, _Segment], nbytes: int, device: torch.device | None
                  ) -> _StagingSlot:
    """A staging arena; pinned, with a reuse event, when ``device`` (a CUDA device) is given."""
    pin = device is not None
    arena = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
    views = {name: seg.view(arena) for name, seg in segments.items()}
    inputs = {name[6:]: t.view(numpy_view_dtype(t.dtype)).numpy()
              for name, t in views.items() if name.startswith("input:")}
    return _StagingSlot(arena, views["seq_lens"].numpy(), views["positions"].numpy(),
                        views["block_table"].numpy(), inputs,
                        torch.Event(device) if pin else None)


@dataclass(eq=False)
class StaticBuffers:
    """seq_info + persistent workspace + output, shared by every graph (static addresses).

    seq_lens [max_bs] int32, positions [max_bs * max_q_len] int64, block_table [max_bs,
    max_pages] int32, inputs name -> [max_bs * max_q_len, *shape], output [max_bs *
    max_q_len, *output_shape], all on ``spec.device``. Graph-safe: nothing here is ever
    reallocated; ``stage`` only copies.
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
    staging_waits: int = 0
    max_q_len: int = 1

    @classmethod
    def allocate(cls, spec: BufferSpec, *, max_batch_size: int, workspace: WorkspaceSpec,
                 num_staging_slots: int = 2, max_q_len: int = 1) -> StaticBuffers:
        """Allocate everything once for ``max_batch_size`` requests of up to ``max_q_len``
        query tokens each (before any capture)."""
        if max_batch_size < 1 or num_staging_slots < 1 or max_q_len < 1:
            raise ValueError(f"need max_batch_size, num_staging_slots and max_q_len >= 1, got "
                             f"{max_batch_size}, {num_staging_slots} and {max_q_len}")
        segments, nbytes = _layout(spec, max_batch_size, max_q_len)
        arena = torch.zeros(nbytes, dtype=torch.uint8, device=spec.device)
        views = {name: seg.view(arena) for name, seg in segments.items()}
        pin = spec.device.type == "cuda" and torch.cuda.is_available()
        return cls(
            spec=spec, max_batch_size=max_batch_size, seq_lens=views["seq_lens"],
            positions=views["positions"], block_table=views["block_table"],
            inputs={s.name: views[f"input:{s.name}"] for s in spec.inputs},
            output=torch.zeros(max_batch_size * max_q_len, *spec.output_shape,
                               dtype=spec.output_dtype, device=spec.device),
            workspace=workspace.allocate(spec.device), workspace_nbytes=workspace.nbytes,
            _arena=arena, _bt_offset=segments["block_table"].offset,
            _slots=[_staging_slot(segments, nbytes, spec.device if pin else None)
                    for _ in range(num_staging_slots)], max_q_len=max_q_len)

    @property
    def nbytes(self) -> int:
        """Device bytes: seq_info arena + output + workspace."""
        out = self.output.numel() * self.output.element_size()
        return self._arena.numel() + out + self.workspace_nbytes

    def staging_tensors(self) -> list[torch.Tensor]:
        """The host staging arenas (pinned on CUDA); for tests and diagnostics."""
        return [slot.arena for slot in self._slots]

    def stage(self, batch: CheckedBatch, padded_bs: int) -> None:
        """Copy a validated host batch into rows [0, padded_bs) of seq_info (per-token
        tensors: rows [0, padded_bs x q_len)); pad the rest.

        One pinned host -> device copy (non-blocking) of the arena prefix, plus device ->
        device copies for inputs already on the device. Graph-safe and sync-free, except
        that a staging slot whose previous copy is still in flight is waited for (the GPU
        is a whole ring of steps behind; counted in ``staging_waits``).
        """
        bs = batch.batch_size
        assert bs <= padded_bs <= self.max_batch_size, (bs, padded_bs, self.max_batch_size)
        assert batch.q_len <= self.max_q_len, (batch.q_len, self.max_q_len)
        index, slot = self._acquire_slot()
        slot.fill(batch, padded_bs)
        views = self._prefixes.get(padded_bs) or self._prefix_views(padded_bs)
        event = slot.event
        views[0].copy_(views[1][index], non_blocking=event is not None)
        # Rows [bs, padded_bs) of a device input were zeroed by the prefix copy above.
        tokens = bs * batch.q_len
        for name, t in batch.device_inputs:
            self.inputs[name][:tokens].copy_(t, non_blocking=True)
        if event is not None:
            event.record()
            slot.in_flight = True

    def _prefix_views(self, padded_bs: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        # Arena prefix that holds rows [0, padded_bs) of every seq_info tensor (block_table
        # is laid out last); cached per size so a step slices nothing.
        nbytes = self._bt_offset + padded_bs * self.block_table.stride(0) * 4
        views = (self._arena[:nbytes], [slot.arena[:nbytes] for slot in self._slots])
        self._prefixes[padded_bs] = views
        return views

    def _acquire_slot(self) -> tuple[int, _StagingSlot]:
        index = self._next_slot
        slot = self._slots[index]
        self._next_slot = index + 1 if index + 1 < len(self._slots) else 0
        if slot.in_flight:
            if not slot.event.query():
                self.staging_waits += 1
                slot.event.synchronize()  # its copy has not landed: rewriting it would race
            slot.in_flight = False
        return index, slot

    def context(self, batch_size: int, plan: LaunchPlan, backend: DecodeBackend,
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
        self.inputs.clear()
        self.workspace = None
        empty = torch.empty(0)
        self.seq_lens = self.positions = self.block_table = self.output = self._arena = empty

