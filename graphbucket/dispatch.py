"""Replay dispatcher: host-only bucket selection, padding, staging, replay.

``Dispatcher.step`` validates the host batch, picks the bucket from host lengths
(``BucketLadder.select``), pads to the smallest capture size that fits, stages, replays
and returns a view of the static output. Nothing on that path reads device memory or
synchronizes: no ``.item()``, ``.tolist()``, ``.cpu()``, no tensors built from device data.

Eager fallback (documented, counted, logged once): a batch larger than the largest capture
size runs the forward eagerly, planned from its live lengths, on overflow buffers sized
for it. With no captured graphs at all (the ``eager`` policy), every step runs that way.
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter
from dataclasses import dataclass

import torch

from graphbucket.backends.base import DecodeBackend
from graphbucket.batch import DecodeBatch, HostBatch, validate_batch
from graphbucket.buffers import StaticBuffers
from graphbucket.capture import Forward, GraphCapture
from graphbucket.ladder import BucketLadder
from graphbucket.plan import LaunchPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DispatchStats:
    """Counts since construction; ``replays`` is keyed by (padded batch size, plan)."""

    steps: int
    replays: dict[tuple[int, LaunchPlan], int]
    replays_by_bucket: dict[tuple[int, int], int]
    eager_steps: int
    eager_fallbacks: int
    errors: int
    staging_waits: int


class EagerExecutor:
    """Runs the forward without graphs, planned from the batch's live host lengths.

    Graph-safe in the sense that matters: sync-free; plans are host arithmetic on the
    host max length. Batches above the static capacity use overflow buffers allocated on
    first need (power-of-two capacity), never the captured graphs' buffers' addresses.
    """

    def __init__(self, forward: Forward, backend: DecodeBackend, buffers: StaticBuffers, *,
                 sm_scale: float, max_model_len: int) -> None:
        self.forward, self.backend, self.buffers = forward, backend, buffers
        self.sm_scale = sm_scale
        self.max_model_len = max_model_len
        self._overflow: StaticBuffers | None = None

    def run(self, batch: HostBatch) -> torch.Tensor:
        bs = batch.batch_size
        buffers = self.buffers if bs <= self.buffers.max_batch_size else self._overflow_for(bs)
        plan = self.backend.plan(bs, buffers.spec.num_heads, max(1, batch.max_len))
        buffers.stage(batch, bs)
        ctx = buffers.context(bs, plan, self.backend, self.sm_scale)
        out = buffers.output[:bs]
        result = self.forward(ctx)
        if result.data_ptr() != out.data_ptr():
            out.copy_(result)
        return out

    @property
    def overflow_staging_waits(self) -> int:
        return 0 if self._overflow is None else self._overflow.staging_waits

    def close(self) -> None:
        if self._overflow is not None:
            self._overflow.close()
            self._overflow = None

    def _overflow_for(self, bs: int) -> StaticBuffers:
        if self._overflow is None or self._overflow.max_batch_size < bs:
            capacity = 1 << (bs - 1).bit_length()
            spec = self.buffers.spec
            plans = [self.backend.plan(b, spec.num_heads, self.max_model_len)
                     for b in range(1, capacity + 1)]
            if self._overflow is not None:
                self._overflow.close()
            self._overflow = StaticBuffers.allocate(
                spec, max_batch_size=capacity, workspace=self.backend.workspace_spec(plans))
        return self._overflow


class Dispatcher:
    """Per-step host logic in front of the captured graphs (``graphs=None``: eager only)."""

    def __init__(self, buffers: StaticBuffers, ladder: BucketLadder,
                 batch_sizes: list[int], graphs: GraphCapture | None, eager: EagerExecutor,
                 *, select_key: str = "max") -> None:
        self.buffers, self.ladder, self.graphs, self.eager = buffers, ladder, graphs, eager
        if select_key not in ("max", "min"):
            raise ValueError(f"select_key must be 'max' or 'min', got {select_key!r}")
        self.select_key = select_key
        self.batch_sizes = sorted(set(batch_sizes))
        if self.batch_sizes[-1] > buffers.max_batch_size:
            raise ValueError(f"capture size {self.batch_sizes[-1]} exceeds the buffers' "
                             f"max_batch_size {buffers.max_batch_size}")
        # padded[b] = smallest capture size >= b, for b in 1..max capture size.
        self._padded = [0] + [self.batch_sizes[bisect.bisect_left(self.batch_sizes, b)]
                              for b in range(1, self.batch_sizes[-1] + 1)]
        self._counts: Counter[tuple[int, int]] = Counter()
        self._steps = self._eager_steps = self._fallbacks = self._errors = 0
        self._warned = False

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def step(self, batch: DecodeBatch) -> torch.Tensor:
        """One decode step; returns output rows [0, B) (a view: consume before the next step).

        Raises TypeError/ValueError before staging anything for a bad batch (length above
        the ladder top, block table outside the cache, wrong dtype/device/shape).
        """
        try:
            host = validate_batch(batch, self.buffers.spec)
            if self.select_key == "max":  # select()'s default key, without a second pass
                bucket = self.ladder.bucket_for(host.max_len)
            else:
                bucket = self.ladder.select(host.seq_lens, key=self.select_key)
        except (TypeError, ValueError):
            self._errors += 1
            raise
        self._steps += 1
        bs = host.batch_size
        if self.graphs is None:
            self._eager_steps += 1
            return self.eager.run(host)
        if bs > self.batch_sizes[-1]:
            return self._fallback(host)
        padded = self._padded[bs]
        self.buffers.stage(host, padded)
        self.graphs.graph(padded, bucket).replay()
        self._counts[(padded, bucket)] += 1
        return self.buffers.output[:bs]

    def _fallback(self, host: HostBatch) -> torch.Tensor:
        self._fallbacks += 1
        if not self._warned:
            self._warned = True
            logger.warning(
                "graphbucket: batch of %d requests exceeds the largest capture size %d; "
                "running it eagerly (slow path; logged once, counted in "
                "stats().eager_fallbacks). Capture a larger batch size to avoid it.",
                host.batch_size, self.batch_sizes[-1])
        return self.eager.run(host)

    def stats(self) -> DispatchStats:
        by_key: Counter[tuple[int, LaunchPlan]] = Counter()
        if self.graphs is not None:
            for (bs, bucket), n in self._counts.items():
                by_key[(bs, self.graphs.plans[(bs, bucket)])] += n
        waits = self.buffers.staging_waits + self.eager.overflow_staging_waits
        return DispatchStats(steps=self._steps, replays=dict(by_key),
                             replays_by_bucket=dict(self._counts), eager_steps=self._eager_steps,
                             eager_fallbacks=self._fallbacks, errors=self._errors,
                             staging_waits=waits)
