"""Bucketed graphs under tensor parallelism: same key, same capture order, close first.

With collectives inside the captured graphs (``models.tp.TPMLADecoder`` under NCCL) every
replay is a collective, so every rank must replay the same graph at the same step; ranks
that disagree wait in different all-reduces (a hang) or sum mismatched buffers.

1. **Same key.** Selection is host arithmetic on the host lengths (each runner's
   ``GraphSelector``). Ranks that receive the same scheduler output select the same
   ``GraphKey`` with no communication. ``with_key_check`` / ``check_same_key`` verify
   that per step: a debug aid, off by default, costing one
   all-gather per step on a separate gloo group over CPU tensors. It issues no CUDA work,
   so the replay path's no-sync contract holds, but it is a host round trip between
   ranks every step: not for production.
2. **Same capture order.** ``GraphTable.capture`` walks keys largest batch first, then
   in ladder order, capturing each distinct (batch size, plan) once: a pure function of
   the runner's plan table (``GraphTable.capture_order``). Ranks with equal tables (same
   ladder, batch sizes, backend and per-rank heads) warm up and capture, and so run the warm-up
   collectives, in the same order. ``capture_all`` captures runners in the order given,
   first comparing the tables across ranks so that a mismatch raises instead of hanging.
3. **Close first.** Captured NCCL kernels belong to the communicator. ``tp_session``
   closes its runners (graphs, then pool, then buffers), synchronizes the device, then
   destroys the process group.
"""

from __future__ import annotations

import datetime
import os
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from graphbucket.batch import DecodeBatch
from graphbucket.graphs import CaptureSummary
from graphbucket.runner import GraphBucketRunner
from graphbucket.select import GraphKey

CHECK_KEYS_ENV = "GRAPHBUCKET_CHECK_KEYS"
EAGER_BUCKET = -1  # in a KeyMismatchError: the rank runs the step eagerly (no graph)
_Wire = tuple[int, int]  # what ranks exchange: (padded batch size or batch size, bucket)


class KeyMismatchError(RuntimeError):
    """Ranks chose different graphs (or got different lengths) for one decode step.

    ``keys[r]`` is rank r's (padded batch size, bucket) (bucket ``EAGER_BUCKET`` for an
    eager step), or None where that rank could not select (its batch was invalid);
    ``digests[r]`` a CRC32 of its host lengths (or -1).
    """

    def __init__(self, message: str, keys: list[_Wire | None], digests: list[int]) -> None:
        super().__init__(message)
        self.keys, self.digests = keys, digests


# ---- 1. same key ------------------------------------------------------------------------


def step_key(runner: GraphBucketRunner, seq_lens_cpu: Any, q_len: int = 1) -> GraphKey | None:
    """The key ``runner.step`` replays for these host lengths and q_len (the runner's own
    selector); None for an eager step. Host arithmetic only; raises as
    ``GraphSelector.choose``."""
    key = runner.selector.choose(seq_lens_cpu, q_len)
    return None if runner.is_eager else key


def _wire(key: GraphKey | None, seq_lens_cpu: Any) -> _Wire:
    return (key.batch_size, key.bucket) if key is not None else (len(seq_lens_cpu),
                                                                 EAGER_BUCKET)


def key_check_group() -> dist.ProcessGroup:
    """A gloo group over every rank for host-side checks (a collective: call on all ranks)."""
    return dist.new_group(backend="gloo")


def lengths_digest(seq_lens_cpu: Any) -> int:
    """CRC32 of the host lengths as int64 (host only; a device tensor is rejected)."""
    if isinstance(seq_lens_cpu, torch.Tensor) and not seq_lens_cpu.is_cpu:
        raise TypeError(f"seq_lens_cpu is on {seq_lens_cpu.device}; pass the host copy")
    return zlib.crc32(np.ascontiguousarray(np.asarray(seq_lens_cpu), dtype=np.int64).tobytes())


def _gather(key: _Wire | None, digest: int, group: dist.ProcessGroup
            ) -> tuple[list[_Wire | None], list[int]]:
    mine = torch.tensor([*(key or (0, 0)), digest, key is not None], dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    keys = [(int(r[0]), int(r[1])) if r[3] else None for r in rows]
    return keys, [int(r[2]) for r in rows]


def _describe(key: _Wire | None) -> str:
    if key is None:
        return "no key (its batch was rejected)"
    bs, bucket = key
    return f"batch {bs}, eager" if bucket == EAGER_BUCKET else f"padded batch {bs}, bucket {bucket}"


def check_same_key(key: GraphKey | _Wire | None, group: dist.ProcessGroup, *,
                   seq_lens_cpu: Any = None) -> None:
    """Debug check: raise ``KeyMismatchError`` on every rank unless all chose ``key``.

    A collective on ``group`` (a gloo group, see ``key_check_group``): every rank calls it
    at the same step. ``key``: the ``GraphKey`` to replay, or a (padded batch size, bucket)
    pair; an eager step is (batch size, ``EAGER_BUCKET``), and ``key=None`` reports that
    this rank could not select (note: ``step_key``'s None means eager, not that). With
    ``seq_lens_cpu``, ranks must also have received equal lengths: the same key with
    different lengths means the replicated KV caches diverge. Costs one CPU all-gather.
    """
    if isinstance(key, GraphKey):
        key = (key.batch_size, key.bucket)
    digest = -1 if seq_lens_cpu is None else lengths_digest(seq_lens_cpu)
    _check(key, digest, group)


def _check(key: _Wire | None, digest: int, group: dist.ProcessGroup) -> None:
    keys, digests = _gather(key, digest, group)
    if len(set(keys)) > 1 or None in keys:
        per_rank = "; ".join(f"rank {r}: {_describe(k)}" for r, k in enumerate(keys))
        raise KeyMismatchError(
            f"tensor-parallel ranks chose different graphs for one decode step ({per_rank}). "
            "Replaying them would hang in, or corrupt, the all-reduces captured inside; "
            "every rank must receive the same host seq_lens_cpu each step", keys, digests)
    if digest != -1 and len(set(digests)) > 1:
        per_rank = "; ".join(f"rank {r}: crc32 {d:#010x}" for r, d in enumerate(digests))
        raise KeyMismatchError(
            f"tensor-parallel ranks chose the same graph ({_describe(keys[0])}) but received "
            f"different host lengths ({per_rank}); their replicated KV caches diverge. Send "
            "every rank the same scheduler output", keys, digests)


class KeyCheckedRunner:
    """A runner whose ``step`` first checks that every rank chose the same key (debug).

    The check runs before staging and replay, so a disagreement raises on every rank
    instead of hanging in a captured collective. Build it on every rank in the same
    order (``group=None`` creates a gloo group, which is a collective).
    """

    def __init__(self, runner: GraphBucketRunner, group: dist.ProcessGroup | None = None
                 ) -> None:
        self.runner = runner
        self.group = key_check_group() if group is None else group

    def step(self, batch: DecodeBatch) -> torch.Tensor:
        try:
            key = _wire(step_key(self.runner, batch.seq_lens_cpu, batch.q_len),
                        batch.seq_lens_cpu)
            digest = lengths_digest(batch.seq_lens_cpu)
        except (TypeError, ValueError):
            _gather(None, -1, self.group)  # tell the other ranks, so they raise too
            raise
        _check(key, digest, self.group)
        return self.runner.step(batch)

    def __getattr__(self, name: str) -> Any:  # capture, stats, close, selector, graphs, ...
        if name == "runner":  # not set yet (copy/unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.runner, name)


def with_key_check(runner: GraphBucketRunner, group: dist.ProcessGroup | None = None, *,
                   enabled: bool | None = None) -> GraphBucketRunner | KeyCheckedRunner:
    """``runner`` wrapped in ``KeyCheckedRunner`` when enabled, else ``runner`` itself.

    ``enabled=None`` reads the ``GRAPHBUCKET_CHECK_KEYS`` environment variable ("1" turns
    the check on); off by default. Decide identically on every rank.
    """
    if enabled is None:
        enabled = os.environ.get(CHECK_KEYS_ENV, "0").lower() in ("1", "true", "yes")
    return KeyCheckedRunner(runner, group) if enabled else runner


# ---- 2. same capture order --------------------------------------------------------------


def check_same_plans(runner: GraphBucketRunner, group: dist.ProcessGroup, *,
                     name: str = "runner") -> None:
    """Raise ``RuntimeError`` on every rank unless all would capture the same sequence of
    (batch size, plan) graphs (``GraphTable.capture_order``; empty for an eager runner)."""
    orders: list[Any] = [None] * dist.get_world_size(group)
    mine = [] if runner.graphs is None else runner.graphs.capture_order()
    dist.all_gather_object(orders, mine, group=group)
    for rank, order in enumerate(orders):
        if order != orders[0]:
            first = next((i for i, (a, b) in enumerate(zip(order, orders[0], strict=False))
                          if a != b), min(len(order), len(orders[0])))
            raise RuntimeError(
                f"{name}: rank {rank} would capture a different graph sequence than rank 0 "
                f"({len(order)} vs {len(orders[0])} graphs, first difference at graph "
                f"{first}); the warm-up and captured collectives would mismatch. Build every "
                "rank's runner with the same ladder, batch sizes, backend and per-rank heads")


def capture_all(runners: Sequence[GraphBucketRunner | KeyCheckedRunner], *,
                group: dist.ProcessGroup | None = None) -> list[CaptureSummary | None]:
    """Capture ``runners`` in this order (call with the same order on every rank). With a
    ``group`` (gloo), each runner's capture sequence is first compared across ranks."""
    summaries = []
    for i, runner in enumerate(runners):
        if group is not None:
            check_same_plans(runner, group, name=f"runner {i}")
        summaries.append(runner.capture())
    return summaries


# ---- 3. close first ---------------------------------------------------------------------


@dataclass(eq=False)
class TPSession:
    """One rank's view of a tensor-parallel run; ``register`` runners for ``tp_session``
    to close before it destroys the process group. ``cpu_group``: gloo, for host checks."""

    rank: int
    world_size: int
    device: torch.device
    cpu_group: dist.ProcessGroup
    runners: list[Any] = field(default_factory=list)

    def register(self, runner: Any) -> Any:
        self.runners.append(runner)
        return runner

    def close_runners(self) -> None:
        """Close registered runners, last registered first (idempotent)."""
        while self.runners:
            self.runners.pop().close()


@contextmanager
def tp_session(*, backend: str, rank: int, world_size: int, init_method: str = "env://",
               device: torch.device | str = "cpu",
               timeout: datetime.timedelta | None = None) -> Iterator[TPSession]:
    """Initialize the default process group, yield a ``TPSession``, and on exit (also on an
    exception) close its runners, synchronize ``device``, then destroy the process group.

    ``backend="nccl"`` needs ``device`` = this rank's GPU (``cuda:<local rank>``); it is
    made current and bound to the group, so the communicator exists before any capture.
    """
    if dist.is_initialized():
        raise RuntimeError("a default process group already exists; tp_session creates and "
                           "destroys its own (call it before dist.init_process_group)")
    device = torch.device(device)
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"backend='nccl' needs a CUDA device, got device={device}")
    extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if backend == "nccl":
        extra["device_id"] = device  # eager communicator: none is created during a capture
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size, **extra)
    try:
        session = TPSession(rank, world_size, device, key_check_group())
        try:
            yield session
        finally:
            session.close_runners()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    finally:
        dist.destroy_process_group()
