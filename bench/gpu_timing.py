"""Shared GPU timing helpers: copy-bandwidth ceiling, graph-replay timing, run metadata."""

from __future__ import annotations

import datetime
import platform
import statistics
import sys
from collections.abc import Callable

import torch
import triton

L2_FLUSH_BYTES = 4 * 60 * 1024 * 1024  # four H200 L2s: enough distinct bytes to evict it


def run_meta(command: str | None = None) -> dict:
    dev = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    return {
        "gpu": dev.name if dev else platform.processor() or "cpu",
        "num_sms": dev.multi_processor_count if dev else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command or " ".join(["python3"] + sys.argv),
    }


def warm_gpu(seconds: float = 1.0) -> None:
    """Bring clocks up from idle before measuring a ceiling (idle SM clocks sit near 345 MHz)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(20):
            a @ a
        stop.record()
        stop.synchronize()
        if start.elapsed_time(stop) > seconds * 1e3:
            return


def copy_gbps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    warm_gpu()
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = time_replays(lambda: dst.copy_(src), calls_per_graph=1, min_ms=50.0)
    # Eager copies timed with events too: take the better of graph and eager.
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        dst.copy_(src)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    stop.record()
    stop.synchronize()
    eager_us = start.elapsed_time(stop) * 1e3 / 20
    return 2 * nbytes / (min(us, eager_us) * 1e3)


def time_replays(fn: Callable[[], None], *, calls_per_graph: int, reps: int = 7,
                 min_ms: float = 20.0) -> float:
    """Median microseconds per call of ``fn`` (one graph holds ``calls_per_graph`` calls).

    ``fn`` must itself issue ``calls_per_graph`` calls over distinct inputs so that
    consecutive calls find a cold L2 when the inputs are large enough.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    stop.record()
    stop.synchronize()
    one_ms = max(start.elapsed_time(stop), 1e-3)
    replays = max(1, min(200, int(min_ms / one_ms)))
    samples = []
    for _ in range(reps):
        start.record()
        for _ in range(replays):
            graph.replay()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) * 1e3 / (replays * calls_per_graph))
    del graph
    return statistics.median(samples)
