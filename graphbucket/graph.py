"""Graphs: record a decode body once, replay it without running the Python that planned it.

On CUDA a graph is a ``torch.cuda.CUDAGraph`` captured on a side stream into the shared
pool of a ``GraphPool``, after eager warm-up on that stream (so Triton compiles outside
the capture). Without CUDA, ``FrozenPlanGraph`` stands in: capture records the body, which
closes over the static buffers and the ``LaunchPlan`` it was captured with, and replay
re-runs exactly that body. Neither ever calls a planning function again, so both freeze
the launch topology the way a FULL CUDA graph does: a graph captured with hint 1 replays
one split whatever the live length.

Pool rule (torch.cuda.graphs): graphs may share one pool because replays are serial on
one stream and each body copies its result into the static output, so no tensor of one
graph's pool memory outlives its replay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from graphbucket.plan import LaunchPlan

Body = Callable[[], None]


class Graph(Protocol):
    plan: LaunchPlan

    def replay(self) -> None: ...

    def reset(self) -> None: ...


class FrozenPlanGraph:
    """CPU stand-in for a CUDA graph: replays the recorded body with its frozen plan."""

    def __init__(self, body: Body, plan: LaunchPlan) -> None:
        self._body: Body | None = body
        self.plan = plan

    def replay(self) -> None:
        if self._body is None:
            raise RuntimeError("this graph was reset; capture a new one")
        self._body()

    def reset(self) -> None:
        self._body = None


class CudaGraph:
    """A captured ``torch.cuda.CUDAGraph`` with the plan it was captured with."""

    def __init__(self, graph: torch.cuda.CUDAGraph, plan: LaunchPlan) -> None:
        self._graph: torch.cuda.CUDAGraph | None = graph
        self.plan = plan

    def replay(self) -> None:
        self._graph.replay()

    def reset(self) -> None:
        if self._graph is not None:
            self._graph.reset()
            self._graph = None


class GraphPool:
    """One memory pool and one capture stream shared by every graph of a runner."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.handle = torch.cuda.graph_pool_handle() if self.is_cuda else None
        self.stream = torch.cuda.Stream(self.device) if self.is_cuda else None

    def warmup(self, body: Body, iters: int = 1) -> None:
        """Run ``body`` eagerly ``iters`` times on the capture stream (Triton compiles here)."""
        if not self.is_cuda:
            for _ in range(iters):
                body()
            return
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            for _ in range(iters):
                body()
        current.wait_stream(self.stream)

    def capture(self, body: Body, plan: LaunchPlan) -> tuple[Graph, int]:
        """Capture ``body`` into the shared pool; returns (graph, pool bytes it added)."""
        if not self.is_cuda:
            return FrozenPlanGraph(body, plan), 0
        if self.handle is None:
            raise RuntimeError("this GraphPool was closed; build a new one")
        graph = torch.cuda.CUDAGraph()
        # Measured inside the capture: torch.cuda.graph empties the cache on entry, and
        # while capturing, only this pool can grow.
        with torch.cuda.graph(graph, pool=self.handle, stream=self.stream):
            before = torch.cuda.memory_reserved(self.device)
            body()
            added = torch.cuda.memory_reserved(self.device) - before
        return CudaGraph(graph, plan), added

    def close(self) -> None:
        """Forget the pool; its memory returns once every graph captured into it is reset."""
        self.handle = None
        self.stream = None
