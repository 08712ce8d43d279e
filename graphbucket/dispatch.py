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

import logging
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass

import torch

from graphbucket.backends.base import DecodeBackend
from graphbucket.batch import BatchValidator, DecodeBatch, HostBatch
from graphbucket.buffers import StaticBuffers
from graphbucket.capture import Forward, GraphCapture
from graphbucket.graph import Graph
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
        self._padded = [0] + [self.batch_sizes[bisect_left(self.batch_sizes, b)]
                              for b in range(1, self.batch_sizes[-1] + 1)]
        self._validate = BatchValidator(buffers.spec)
        self._bounds, self._top = ladder.bounds, ladder.max_model_len
        # Per (padded size, bucket), flattened as padded * len(ladder) + bucket: the graph
        # (looked up on first use) and its replay count.
        self._graph_at: list[Graph | None] = [None] * ((self.batch_sizes[-1] + 1) * len(ladder))
        self._replays = [0] * len(self._graph_at)
        self._outputs: list[torch.Tensor | None] = [None] * (self.batch_sizes[-1] + 1)
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
            host = self._validate(batch)
            bucket = self._bucket(host)
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
        key = padded * len(self._bounds) + bucket
        graph = self._graph_at[key] or self._lookup(padded, bucket, key)
        graph.replay()
        self._replays[key] += 1
        out = self._outputs[bs]
        if out is None:  # slicing a tensor costs ~1 us: one view per batch size, kept
            out = self._outputs[bs] = self.buffers.output[:bs]
        return out

    def _bucket(self, host: HostBatch) -> int:
        # Lengths are validated ints >= 0: select()'s checks reduce to the ladder top.
        length = host.max_len
        if length > self._top:
            return self.ladder.bucket_for(length)  # raises, naming the ladder top
        if self.select_key == "max":
            return bisect_left(self._bounds, length)
        if host.min_len > 0:
            return bisect_left(self._bounds, host.min_len)
        return self.ladder.select(host.seq_lens, key="min")  # zeros are padding rows

    def _lookup(self, padded: int, bucket: int, key: int) -> Graph:
        graph = self._graph_at[key] = self.graphs.graph(padded, bucket)
        return graph

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
        nb = len(self._bounds)
        counts = {divmod(key, nb): n for key, n in enumerate(self._replays) if n}
        by_key: Counter[tuple[int, LaunchPlan]] = Counter()
        if self.graphs is not None:
            for (bs, bucket), n in counts.items():
                by_key[(bs, self.graphs.plans[(bs, bucket)])] += n
        waits = self.buffers.staging_waits + self.eager.overflow_staging_waits
        return DispatchStats(steps=self._steps, replays=dict(by_key),
                             replays_by_bucket=counts, eager_steps=self._eager_steps,
                             eager_fallbacks=self._fallbacks, errors=self._errors,
                             staging_waits=waits)

    def close(self) -> None:
        """Drop the graphs and output views looked up so far (the runner owns them)."""
        self._graph_at = [None] * len(self._graph_at)
        self._outputs = [None] * len(self._outputs)
