"""One decode step as the host knows it, and its validation before anything is staged.

``DecodeBatch`` is what a scheduler hands graphbucket each step: host lengths, a host
block table and the model inputs. ``validate_batch`` checks it against a ``BufferSpec``
with host arithmetic only and returns a ``HostBatch`` of normalised numpy arrays; every
caller mistake raises TypeError/ValueError naming what was received, what was expected
and the fix, before a single byte is staged or a kernel launched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from graphbucket.buffers import BufferSpec

@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """One decode step on the host.

    seq_lens_cpu: [B] ints (list, numpy or CPU tensor): context length of each request,
        the token being decoded included.
    block_table_cpu: [B, num_cols] ints (numpy or CPU tensor), num_cols <= max_pages:
        cache page of each request's pages, in order.
    inputs: name -> tensor [B, *shape] per the spec's ``InputSpec``s, on the CPU (staged
        through pinned memory) or on the buffers' device (copied device to device).
    positions_cpu: [B] ints, default ``seq_len - 1``.
    """

    seq_lens_cpu: Any
    block_table_cpu: Any
    inputs: Mapping[str, torch.Tensor] = field(default_factory=dict)
    positions_cpu: Any = None


@dataclass(frozen=True, slots=True)
class HostBatch:
    """A validated ``DecodeBatch`` as numpy integer arrays.

    seq_lens [B]; block_table [B, need] (only the columns the longest request uses, every
    entry inside the cache); positions [B] or None (then ``seq_len - 1``); inputs as given.
    """

    seq_lens: np.ndarray
    block_table: np.ndarray
    positions: np.ndarray | None
    inputs: Mapping[str, torch.Tensor]
    min_len: int
    max_len: int

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]


def _host_ints(name: str, value: Any, ndim: int) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise TypeError(
                f"{name} is a tensor on {value.device}; expected a host (CPU) copy. Reading "
                "device data would synchronize every decode step: pass the scheduler's host "
                "copy (list, numpy array or CPU tensor)")
        value = value.numpy()
    arr = np.asarray(value)
    if arr.size == 0 and not isinstance(value, np.ndarray):
        arr = arr.astype(np.int64)  # np.asarray([]) is float64; emptiness is reported later
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} has dtype {arr.dtype}; expected integers. Cast it to int32")
    if arr.ndim != ndim:
        raise ValueError(f"{name} has shape {arr.shape}; expected {ndim} dimension(s)")
    return arr


def _check_lengths(lens: np.ndarray, raw: Any, spec: BufferSpec) -> tuple[int, int]:
    if lens.shape[0] == 0:
        raise ValueError("seq_lens_cpu is empty; a decode step needs at least one request")
    if type(raw) is list:  # builtins beat two numpy reductions on scheduler-sized lists
        lo, hi = int(min(raw)), int(max(raw))
    else:
        lo, hi = int(lens.min()), int(lens.max())
    if lo < 0:
        raise ValueError(f"seq_lens_cpu holds {lo}; lengths must be >= 0 (0 = padding row)")
    if hi > spec.max_context_len:
        raise ValueError(
            f"seq_lens_cpu holds {hi}, above the buffers' capacity {spec.max_context_len} "
            f"(max_pages_per_seq={spec.max_pages_per_seq} x page_size={spec.page_size}); "
            "cap lengths at max_model_len or allocate more pages per request")
    return lo, hi


def _check_block_table(bt: np.ndarray, lens: np.ndarray, max_len: int, spec: BufferSpec
                       ) -> np.ndarray:
    rows, cols = bt.shape
    if rows != lens.shape[0]:
        raise ValueError(f"block_table_cpu has {rows} rows; expected {lens.shape[0]}, one per "
                         "request in seq_lens_cpu")
    if cols > spec.max_pages_per_seq:
        raise ValueError(f"block_table_cpu has {cols} columns; expected at most "
                         f"max_pages_per_seq={spec.max_pages_per_seq}. Trim unused columns")
    need = -(-max_len // spec.page_size)
    if cols < need:
        row = int(lens.argmax())
        raise ValueError(f"request {row} has seq_len {max_len} = {need} pages of "
                         f"{spec.page_size}, but block_table_cpu has only {cols} columns")
    live = bt[:, :need]
    if live.size and not _all_below(live, spec.num_pages):
        return _sanitize_block_table(live, lens, spec)
    return live


def _all_below(table: np.ndarray, limit: int) -> bool:
    # One pass: viewed as unsigned, negative entries wrap above any limit too.
    if table.dtype.kind == "i" and table.dtype.itemsize in (4, 8):
        return bool(table.view(np.uint32 if table.dtype.itemsize == 4 else np.uint64).max()
                    < limit)
    return bool(table.min() >= 0 and table.max() < limit)


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


def _check_inputs(inputs: Mapping[str, torch.Tensor], batch_size: int, spec: BufferSpec
                  ) -> Mapping[str, torch.Tensor]:
    if len(inputs) != len(spec.inputs) or any(s.name not in inputs for s in spec.inputs):
        raise ValueError(f"inputs has keys {sorted(inputs)}; expected "
                         f"{sorted(s.name for s in spec.inputs)} (one tensor per InputSpec)")
    for s in spec.inputs:
        t = inputs[s.name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"inputs[{s.name!r}] is a {type(t).__name__}; expected a tensor")
        if t.dtype != s.dtype:
            raise TypeError(f"inputs[{s.name!r}] has dtype {t.dtype}; expected {s.dtype}. "
                            f"Cast it with .to({s.dtype})")
        if t.device.type != "cpu" and t.device != spec.device:
            raise TypeError(f"inputs[{s.name!r}] is on {t.device}; expected the CPU or "
                            f"{spec.device}. Move it with .to({str(spec.device)!r})")
        if t.shape[0] != batch_size or t.shape[1:] != s.shape:
            raise ValueError(f"inputs[{s.name!r}] has shape {tuple(t.shape)}; expected "
                             f"{(batch_size, *s.shape)} (batch, *InputSpec.shape)")
    return inputs


def validate_batch(batch: DecodeBatch, spec: BufferSpec) -> HostBatch:
    """Check ``batch`` against ``spec`` on the host; raise before anything is staged.

    Graph safety: host arithmetic only; a device tensor where a host copy is expected is
    rejected, never read.
    """
    if not isinstance(batch, DecodeBatch):
        raise TypeError(f"expected a DecodeBatch, got {type(batch).__name__}")
    lens = _host_ints("seq_lens_cpu", batch.seq_lens_cpu, 1)
    min_len, max_len = _check_lengths(lens, batch.seq_lens_cpu, spec)
    table = _host_ints("block_table_cpu", batch.block_table_cpu, 2)
    table = _check_block_table(table, lens, max_len, spec)
    positions = batch.positions_cpu
    if positions is not None:
        positions = _host_ints("positions_cpu", positions, 1)
        if positions.shape != lens.shape:
            raise ValueError(f"positions_cpu has shape {positions.shape}; expected "
                             f"{lens.shape}, one per request")
    inputs = _check_inputs(batch.inputs, lens.shape[0], spec)
    return HostBatch(lens, table, positions, inputs, min_len, max_len)
