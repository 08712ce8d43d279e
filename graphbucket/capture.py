"""Capture orchestrator: one graph per (padded batch size, LaunchPlan), one shared pool.

For each capture batch size (largest first) and each bucket of the ladder, the backend
plans with the bucket's hint. Keys with equal plans alias one graph (contract 6), so a
ladder whose buckets plan alike costs no extra graphs. Each new key is warmed up eagerly
(Triton compiles outside the capture), then captured into the shared pool; a progress line
goes to stderr and one log line sums up graphs captured, aliased, seconds and pool bytes.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from graphbucket.backends.base import DecodeBackend
from graphbucket.buffers import StaticBuffers
from graphbucket.context import DecodeContext
from graphbucket.graph import Body, Graph, GraphPool
from graphbucket.ladder import BucketLadder
from graphbucket.plan import LaunchPlan

logger = logging.getLogger(__name__)

Forward = Callable[[DecodeContext], torch.Tensor]
PlanTable = Mapping[tuple[int, int], LaunchPlan]


@dataclass(frozen=True, slots=True)
class GraphRecord:
    """One captured graph: its key, the buckets it serves, pool bytes added, capture time."""

    batch_size: int
    plan: LaunchPlan
    buckets: tuple[int, ...]
    nbytes: int
    seconds: float

    @property
    def key(self) -> tuple[int, LaunchPlan]:
        return (self.batch_size, self.plan)


@dataclass(frozen=True, slots=True)
class CaptureSummary:
    graphs_captured: int
    graphs_aliased: int
    capture_s: float
    pool_bytes: int

    def describe(self) -> str:
        return (f"captured {self.graphs_captured} graphs ({self.graphs_aliased} aliased keys) "
                f"in {self.capture_s:.2f} s; pool {self.pool_bytes / 2**20:.1f} MiB")


def plan_table(backend: DecodeBackend, ladder: BucketLadder, batch_sizes: Iterable[int],
               num_heads: int) -> dict[tuple[int, int], LaunchPlan]:
    """(capture batch size, bucket index) -> plan, largest batch first. Host only."""
    return {(bs, i): backend.plan(bs, num_heads, hint)
            for bs in sorted(set(batch_sizes), reverse=True)
            for i, hint in enumerate(ladder.hints_for(bs))}


def make_body(forward: Forward, ctx: DecodeContext, out: torch.Tensor) -> Body:
    """The captured call: ``out <- forward(ctx)``; out is a view of the static output."""
    def body() -> None:
        result = forward(ctx)
        if result.shape != out.shape or result.dtype != out.dtype:
            raise ValueError(f"forward returned {result.dtype} {tuple(result.shape)}; expected "
                             f"{out.dtype} {tuple(out.shape)} (batch, *BufferSpec.output_shape)")
        if result.data_ptr() != out.data_ptr():
            out.copy_(result)
    return body


def _largest_first(item: tuple[tuple[int, int], LaunchPlan]) -> tuple[int, int]:
    (bs, bucket), _ = item
    return (-bs, bucket)


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled

    def update(self, done: int, text: str) -> None:
        if self.enabled:
            sys.stderr.write(f"\r[graphbucket] capturing {done}/{self.total} {text:<60}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


class GraphCapture:
    """Captures and owns every graph of a runner; ``graph(bs, bucket)`` looks one up.

    Graph-safe by construction: each body closes over views of ``buffers`` and a frozen
    plan; nothing it launches depends on the live lengths staged before a replay.
    """

    def __init__(self, forward: Forward, buffers: StaticBuffers, backend: DecodeBackend,
                 plans: PlanTable, *, sm_scale: float, warmup_iters: int = 1,
                 progress: bool | None = None) -> None:
        self.forward, self.buffers, self.backend = forward, buffers, backend
        self.plans = dict(plans)
        self.sm_scale = sm_scale
        self.warmup_iters = warmup_iters
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.records: list[GraphRecord] = []
        self.summary: CaptureSummary | None = None
        self._graphs: dict[tuple[int, LaunchPlan], Graph] = {}
        self._table: dict[tuple[int, int], Graph] = {}
        self._pool: GraphPool | None = None

    def capture(self) -> CaptureSummary:
        """Warm up and capture every distinct key, largest batch first; idempotent."""
        if self.summary is not None:
            return self.summary
        keys: dict[tuple[int, LaunchPlan], list[int]] = {}
        for (bs, bucket), plan in sorted(self.plans.items(), key=_largest_first):
            keys.setdefault((bs, plan), []).append(bucket)
        self._pool = GraphPool(self.buffers.spec.device)
        bar = _Progress(len(keys), self.progress)
        start = time.perf_counter()
        try:
            for done, ((bs, plan), buckets) in enumerate(keys.items()):
                bar.update(done, f"bs={bs} {plan.describe()}")
                self._capture_one(bs, plan, tuple(buckets))
            bar.update(len(keys), "done")
        except BaseException:
            self.close()  # no half-captured set survives; a retry starts from scratch
            self.records.clear()
            raise
        finally:
            bar.close()
        self._table = {k: self._graphs[(k[0], plan)] for k, plan in self.plans.items()}
        self.summary = CaptureSummary(
            graphs_captured=len(keys), graphs_aliased=len(self.plans) - len(keys),
            capture_s=time.perf_counter() - start,
            pool_bytes=sum(r.nbytes for r in self.records))
        logger.info("graphbucket: %s", self.summary.describe())
        return self.summary

    def _capture_one(self, bs: int, plan: LaunchPlan, buckets: tuple[int, ...]) -> None:
        t0 = time.perf_counter()
        ctx = self.buffers.context(bs, plan, self.backend, self.sm_scale)
        body = make_body(self.forward, ctx, self.buffers.output[:bs])
        self._pool.warmup(body, self.warmup_iters)
        graph, nbytes = self._pool.capture(body, plan)
        self._graphs[(bs, plan)] = graph
        self.records.append(GraphRecord(bs, plan, buckets, nbytes, time.perf_counter() - t0))

    def graph(self, batch_size: int, bucket: int) -> Graph:
        """The graph serving ``bucket`` at padded size ``batch_size`` (aliases share one)."""
        return self._table[(batch_size, bucket)]

    def close(self) -> None:
        """Drop every graph, then the pool (the buffers belong to the caller)."""
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._table.clear()
        if self._pool is not None:
            self._pool.close()
            self._pool = None
