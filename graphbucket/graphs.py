"""The graph table: one FULL graph per distinct (padded batch, plan), one shared pool.

``GraphTable`` plans every ``GraphKey`` of a selector with the backend (host only),
captures each distinct (batch size, plan) once, largest batch first, and replays by key:
keys whose plans are equal alias one graph, so a ladder whose buckets plan alike costs
no extra graphs. Each graph is warmed up eagerly on the capture stream first (Triton
compiles outside the capture).

On CUDA a graph is a ``torch.cuda.CUDAGraph``. Without CUDA, ``FrozenPlanGraph`` stands
in: capture records the body, which closes over the static buffers and the plan it was
captured with, and replay re-runs exactly that body. Neither ever plans again, so both
freeze the launch topology the way a FULL CUDA graph does: a graph captured with hint 1
replays one split whatever the live length.

Pool rule (torch.cuda.graphs): graphs may share one pool because replays are serial on
one stream and each body copies its result into the static output, so no tensor of one
graph's pool memory outlives its replay.

Every body applies the staged block-table changes (``StaticBuffers.apply_table_changes``,
a scatter of a fixed-size list), then runs the forward. With ``copy_in_graph`` (the
default) each (batch size, plan) is also captured once per staging slot with that slot's
seq_info copy in front (``StaticBuffers.slot_copy``: the copy's source is part of the
graph): ``replay(key, slot)`` replays the graph for the slot the stage filled, so the
step's host path is the stage's numpy writes and one graph launch. ``replay(key)`` replays
the graph without a copy, for a stage that enqueued its own (a step carrying device
inputs: their device copies must land after the seq_info copy, so it cannot come from
the graph).

Capture faults leave nothing behind: an exception in the warm-up or capture of any graph
(the forward's own, or a CUDA out-of-memory) releases every graph captured so far and the
pool, drops the failed call's frames (their tensors would otherwise outlive it through the
traceback) and raises ``CaptureError`` naming the graph being captured, chained to the cause.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from graphbucket.backends.base import DecodeBackend, Plan
from graphbucket.balanced_cost import partition_of
from graphbucket.bucket import DEFAULT_BALANCED_KERNEL
from graphbucket.buffers import StaticBuffers
from graphbucket.context import DecodeContext
from graphbucket.select import GraphKey, GraphSelector

logger = logging.getLogger(__name__)

Forward = Callable[[DecodeContext], torch.Tensor]
Body = Callable[[], None]

# One side stream per device for every warm-up and capture: libraries allocate per-stream
# state on first use (cuBLAS keeps a workspace per stream until exit), so a fresh stream
# per capture() would leave that behind each time.
_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


class CaptureError(RuntimeError):
    """A graph failed to warm up or capture; ``__cause__`` is the original exception.
    Raised after every graph of the table and its pool were released."""


@dataclass(frozen=True, slots=True)
class GraphRecord:
    """One captured graph: its batch size and plan, the keys it serves, pool bytes added,
    capture seconds, query tokens per request."""

    batch_size: int
    plan: Plan
    keys: tuple[GraphKey, ...]
    nbytes: int
    seconds: float
    q_len: int = 1

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(k.bucket for k in self.keys)


@dataclass(frozen=True, slots=True)
class CaptureSummary:
    """``graphs_captured``: distinct (batch size, plan) pairs; each is captured once more
    per staging slot (``staging_slots``: 0 without ``copy_in_graph``), graphs that differ
    only in the slot their first node copies."""

    graphs_captured: int
    graphs_aliased: int
    capture_s: float
    pool_bytes: int
    staging_slots: int = 0

    def describe(self) -> str:
        n = self.graphs_captured
        copies = (f" + {n * self.staging_slots} copying a staging slot"
                  if self.staging_slots else "")
        return (f"captured {n} graphs ({self.graphs_aliased} aliased keys){copies} in "
                f"{self.capture_s:.2f} s; pool {self.pool_bytes / 2**20:.1f} MiB")


class FrozenPlanGraph:
    """CPU stand-in for a CUDA graph: replays the recorded body with its frozen plan."""

    def __init__(self, body: Body) -> None:
        self._body: Body | None = body

    def replay(self) -> None:
        if self._body is None:
            raise RuntimeError("this graph was reset; capture a new one")
        self._body()

    def reset(self) -> None:
        self._body = None


def plan_for_key(backend: DecodeBackend, key: GraphKey, num_heads: int,
                 balanced_kernel: str = DEFAULT_BALANCED_KERNEL) -> Plan:
    """The plan a key's graph is captured with: split-KV at ``key.hint``, or balanced
    with ``balanced_kernel`` (the ladder's for the key's batch size,
    ``BucketLadder.balanced_kernel_for``). A key of q_len query tokens per request plans
    q_len x ``num_heads`` rows (the tokens folded into the heads,
    ``kernels.mla_decode(..., q_len=)``) with the same hint."""
    if not key.balanced:
        return backend.plan(key.batch_size, num_heads * key.q_len, key.hint)
    if key.q_len != 1:
        raise ValueError(f"{key} asks for a balanced graph of {key.q_len} query tokens per "
                         "request; balanced split-KV decodes one token per request")
    return backend.plan_balanced(key.batch_size, num_heads, balanced_kernel)


def balanced_kernel_of(selector: GraphSelector, key: GraphKey) -> str:
    """The balanced kernel ``key``'s graph runs: its bucket's, or with ``key.alternate``
    the bucket's alternate."""
    ladder = selector.ladder
    if key.alternate:
        alt = ladder.alternate_kernel_for(key.bucket, key.batch_size)
        if alt is None:
            raise ValueError(f"{key} asks for an alternate balanced graph; bucket "
                             f"{key.bucket} has none at batch size {key.batch_size}")
        return alt
    return ladder.balanced_kernel_for(key.bucket, key.batch_size)


def check_cost_partitions(selector: GraphSelector, plans: dict[GraphKey, Plan]) -> None:
    """ValueError where a graph that the cost model weighs is planned with another
    partition than the model was fitted on (a ladder tuned for another GPU or backend):
    kind, programs, tile size and smallest chunk (programs per SM is the model's own)."""
    model = selector.ladder.balanced_cost
    if model is None:
        return
    for key, plan in plans.items():
        pair = selector.alternate_kernels(key) if key.balanced else None
        if pair is None:
            continue
        kernel = pair[1] if key.alternate else pair[0]
        want = model.partitions[kernel][key.batch_size]
        got = partition_of(plan, num_sms=None)
        if want.cut != got.cut:
            raise ValueError(f"the ladder's balanced cost model was fitted on {kernel!r} "
                             f"partitioned as {want} at batch size {key.batch_size}, but this "
                             f"backend plans {got}; use a ladder tuned for this GPU "
                             "(scripts/tune_ladder.py)")


class GraphTable:
    """Plans, captures and replays every graph of one selector.

    ``plans[key]`` is the plan each key's graph runs (host arithmetic, available before
    capture so that buffers can be sized for it). ``capture`` is idempotent; ``replay(key,
    slot)`` launches the graph serving ``key`` that copies staging slot ``slot`` (``None``:
    the one without a copy). Graph-safe by construction: each body closes over
    views of the static buffers and a frozen plan; nothing it launches depends on the live
    lengths staged before a replay.
    """

    def __init__(self, selector: GraphSelector, backend: DecodeBackend, num_heads: int, *,
                 copy_in_graph: bool = True) -> None:
        self.selector, self.backend, self.copy_in_graph = selector, backend, copy_in_graph
        self.plans: dict[GraphKey, Plan] = {
            key: plan_for_key(backend, key, num_heads, balanced_kernel_of(selector, key))
            for key in selector.keys()}
        check_cost_partitions(selector, self.plans)
        self.records: list[GraphRecord] = []
        self.summary: CaptureSummary | None = None
        # Per key: the graph without a copy, then one per staging slot (copy_in_graph).
        self._graphs: dict[GraphKey, tuple[FrozenPlanGraph | torch.cuda.CUDAGraph, ...]] = {}
        self._pool = None

    def capture_order(self) -> list[tuple[int, Plan]]:
        """The distinct (batch size, plan) pairs in capture order (equal plans once; a
        plan's head count tells its q_len apart)."""
        return list(dict.fromkeys((k.batch_size, p) for k, p in self.plans.items()))

    def capture(self, forward: Forward, buffers: StaticBuffers, *, sm_scale: float,
                warmup_iters: int = 1, progress: bool = True) -> CaptureSummary:
        """Warm up and capture every distinct (batch size, plan); a progress line per graph
        goes to stderr (redrawn in place on a terminal). Idempotent."""
        if self.summary is not None:
            return self.summary
        # q_len in the group: the body stages q_len tokens per request (plans of different
        # q_len differ in their head count anyway).
        groups: dict[tuple[int, int, Plan], list[GraphKey]] = {}
        for key, plan in self.plans.items():
            groups.setdefault((key.batch_size, key.q_len, plan), []).append(key)
        device = buffers.spec.device
        slots = buffers.num_staging_slots if self.copy_in_graph else 0
        self._pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        stream = _capture_stream(device) if device.type == "cuda" else None
        bar = _Progress(len(groups), progress)
        start = time.perf_counter()
        what = ""
        try:
            for (bs, q_len, plan), keys in groups.items():
                what = (f"graph {bar.done + 1}/{len(groups)} (bs={bs}, q_len={q_len}, "
                        f"{plan.describe()}; keys {', '.join(map(str, keys))})")
                bar.update(f"bs={bs}{f' q_len={q_len}' if q_len > 1 else ''} "
                           f"{plan.describe()}")
                t0 = time.perf_counter()
                ctx = buffers.context(bs, plan, self.backend, sm_scale, q_len=q_len)
                graphs, nbytes = [], 0
                for slot in (None, *range(slots)):
                    copy = None if slot is None else buffers.slot_copy(slot)
                    body = _body(forward, ctx, buffers.output[:bs * q_len], copy,
                                 buffers.apply_table_changes)
                    # The variants launch the same kernels: one warm-up serves all.
                    graph, added = _capture(body, stream, self._pool,
                                            warmup_iters if slot is None else 0)
                    graphs.append(graph)
                    nbytes += added
                for key in keys:
                    self._graphs[key] = tuple(graphs)
                self.records.append(GraphRecord(bs, plan, tuple(keys), nbytes,
                                                time.perf_counter() - t0, q_len))
        except Exception as exc:
            self._release_after(exc)
            raise CaptureError(
                f"capturing {what} failed: {type(exc).__name__}: {exc}. Every graph captured "
                "so far and the pool were released; fix the cause and capture again (or "
                "build a new runner)") from exc
        except BaseException as exc:  # KeyboardInterrupt and the like: released, as raised
            self._release_after(exc)
            raise
        finally:
            bar.close()
        self.summary = CaptureSummary(
            graphs_captured=len(groups), graphs_aliased=len(self.plans) - len(groups),
            capture_s=time.perf_counter() - start,
            pool_bytes=sum(r.nbytes for r in self.records), staging_slots=slots)
        logger.info("graphbucket: %s", self.summary.describe())
        return self.summary

    def _release_after(self, exc: BaseException) -> None:
        # No half-captured set survives; the finished frames of the failed call hold its
        # tensors (and the graph being captured) through the traceback: clear them.
        self.close()
        traceback.clear_frames(exc.__traceback__)

    def replay(self, key: GraphKey, slot: int | None = None) -> None:
        """Launch the graph serving ``key`` (aliased keys share one). ``slot``: the index
        ``StaticBuffers.stage(..., in_graph=True)`` returned, whose graph copies that
        staging slot first; ``None`` (a stage that copied): the graph without a copy."""
        self._graphs[key][0 if slot is None else slot + 1].replay()

    def close(self) -> None:
        """Drop every graph, then the pool (the buffers belong to the caller)."""
        graphs = {id(g): g for per_slot in self._graphs.values() for g in per_slot}
        for graph in graphs.values():
            graph.reset()
        self._graphs.clear()
        self.records.clear()
        self.summary = None
        self._pool = None


def _capture_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = torch.device("cuda", index)
    if key not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[key] = torch.cuda.Stream(key)
    return _CAPTURE_STREAMS[key]


def _body(forward: Forward, ctx: DecodeContext, out: torch.Tensor, slot_copy: Body | None,
          apply_table_changes: Body) -> Body:
    """The captured call: the staging slot's copy (if any), the staged block-table changes,
    then ``out <- forward(ctx)``; out is a view of the static output."""
    def body() -> None:
        if slot_copy is not None:
            slot_copy()
        apply_table_changes()
        ctx.begin_step()
        result = forward(ctx)
        if result.shape != out.shape or result.dtype != out.dtype:
            raise ValueError(f"forward returned {result.dtype} {tuple(result.shape)}; expected "
                             f"{out.dtype} {tuple(out.shape)} (batch x q_len, "
                             "*BufferSpec.output_shape)")
        if result.data_ptr() != out.data_ptr():
            out.copy_(result)
    return body


def _capture(body: Body, stream: torch.cuda.Stream | None, pool, warmup_iters: int
             ) -> tuple[FrozenPlanGraph | torch.cuda.CUDAGraph, int]:
    """Warm ``body`` up, then capture it into the shared pool; (graph, pool bytes added)."""
    if stream is None:
        for _ in range(warmup_iters):
            body()
        return FrozenPlanGraph(body), 0
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        for _ in range(warmup_iters):
            body()
    current.wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        # Measured inside the capture: torch.cuda.graph empties the cache on entry, and
        # while capturing, only this pool can grow.
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            before = torch.cuda.memory_reserved(stream.device)
            body()
            added = torch.cuda.memory_reserved(stream.device) - before
    except BaseException:
        # An invalidated capture fails in capture_end, before torch.cuda.graph restores
        # the current stream: restore it here, or later work would run on the side stream.
        torch.cuda.set_stream(current)
        raise
    return graph, added


class _Progress:
    """One line per graph on stderr: redrawn in place on a terminal, appended in logs."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.done = total, enabled, 0
        self.tty = enabled and sys.stderr.isatty()
        self.start = time.perf_counter()

    def update(self, text: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        line = (f"[graphbucket] capturing {self.done}/{self.total} {text} "
                f"({time.perf_counter() - self.start:.1f} s)")
        sys.stderr.write(f"\r{line:<100}" if self.tty else line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
