"""GPU timing of the MLA decode kernel: CUDA-graph replays over a cold L2 (CUDA only).

One graph holds R decode calls, each over its own random scatter of pages of one large
cache, with R chosen so that a replay touches several L2s worth of distinct KV; the time
per call is the replay time over R. Used by the ladder tuner (``graphbucket.tuning.choose``) and
the kernel sweep (``bench/kernel_sweep.py``). The cache is built in the format being tuned
(``graphbucket.fp8``: "bf16", "fp8-tensor" or "fp8-v32"), so an fp8 ladder is chosen from
the fp8 kernels' times.

Importing this module needs torch but no GPU; every function that runs needs CUDA.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping

import torch

from graphbucket import fp8
from graphbucket.bucket import DEFAULT_BALANCED_KERNEL
from graphbucket.kernels import (
    SplitWorkspace,
    default_sm_scale,
    mla_decode,
    mla_decode_balanced,
)
from graphbucket.plan import LaunchPlan, cdiv
from graphbucket.tuning.ragged import RaggedSample

L2_FLUSH_BYTES = 4 * 60 * 1024 * 1024  # four H200 L2s: enough distinct bytes to evict it
MAX_ROTATIONS = 32
PAGE_SIZE, QK_DIM, KV_LORA_RANK = 64, 576, 512


# fp8-tensor caches hold N(0, 1) rows with this per-tensor scale (amax 8, as bench/tpot.py).
FP8_TENSOR_SCALE = 8.0 / fp8.FP8_MAX
# Plans timed together run the same attention: their bf16 outputs agree to about 1e-2
# (each within that of float64); a kernel that is wrong is off by order one.
AGREEMENT_RTOL = 3e-2


def check_outputs_agree(outputs: Mapping[str, torch.Tensor]) -> None:
    """RuntimeError unless every plan's output is within ``AGREEMENT_RTOL`` (relative L2) of
    the first plan's: a plan that computes something else is never timed, so a kernel
    that is wrong on this GPU cannot win a tuning or an oracle."""
    labels = list(outputs)
    ref = outputs[labels[0]].double()
    norm = max(float(ref.norm()), 1e-30)
    for label in labels[1:]:
        err = float((outputs[label].double() - ref).norm()) / norm
        if not err < AGREEMENT_RTOL:  # NaN fails too
            raise RuntimeError(f"plan {label!r} gives an output {err:.3g} (relative L2) away "
                               f"from plan {labels[0]!r}'s on the same inputs; a plan that "
                               "disagrees is not timed (run its kernel's GPU tests)")


def kv_bytes(context: int, batch: int, num_heads: int = 16, kv_cache: str = "bf16") -> int:
    """Bytes one decode call must move: the KV rows (in the cache format) plus q and out
    (bf16; ``num_heads`` counts query rows, q_len x heads for a verify step)."""
    q_and_out = batch * num_heads * (QK_DIM + KV_LORA_RANK) * 2
    return batch * context * fp8.row_bytes(kv_cache, QK_DIM, torch.bfloat16) + q_and_out


def check_pages(needed: int, num_pages: int) -> None:
    """Refuse a timed shape whose requests need more pages than the timing cache holds."""
    if needed > num_pages:
        raise ValueError(f"the requests need {needed} pages and the timing cache holds "
                         f"{num_pages}: build the timer for longer contexts or more requests")


def rotations_for(context: int, batch: int, num_heads: int, kv_cache: str, num_pages: int
                  ) -> int:
    """Decode calls one timing graph holds: enough distinct KV to evict the L2, as many
    as the cache's pages allow, at most MAX_ROTATIONS."""
    per_call = max(1, batch * cdiv(context, PAGE_SIZE))
    return max(1, min(MAX_ROTATIONS, L2_FLUSH_BYTES // kv_bytes(context, batch, num_heads,
                                                                 kv_cache),
                      num_pages // per_call))


# The tuner's timing: samples of at least SAMPLE_MS (and one replay), TUNE_REPS of them.
SAMPLE_MS, TUNE_REPS = 4.0, 5
# Cost model of one measurement for --dry-run (H200): host work per measurement (build the
# calls, capture, first replay), the kernel at this fraction of HBM bandwidth, no call
# under MIN_CALL_US, and one Triton compile per new kernel configuration.
HOST_S_PER_MEASUREMENT, EST_GBPS, MIN_CALL_US, COMPILE_S = 0.03, 3000.0, 6.0, 2.0


def estimate_seconds(shapes: Iterable[tuple[int, int, int]], num_heads: int,
                     kv_cache: str = "bf16", *, num_pages: int, compiles: int = 0) -> float:
    """Estimated GPU seconds to time ``(context, batch, plans)`` shapes with
    ``time_replays(min_ms=SAMPLE_MS, reps=TUNE_REPS)`` (the tuner's and the oracle's
    timing): per plan, 3 unrounded replays (warm-up, capture, probe) and the samples."""
    total = compiles * COMPILE_S
    for context, batch, plans in shapes:
        call_ms = max(MIN_CALL_US, kv_bytes(context, batch, num_heads, kv_cache)
                      / (EST_GBPS * 1e3)) / 1e3
        replay_ms = rotations_for(context, batch, num_heads, kv_cache, num_pages) * call_ms
        per_sample = max(1, min(200, int(SAMPLE_MS / replay_ms))) * replay_ms
        total += plans * (HOST_S_PER_MEASUREMENT + (3 * replay_ms + TUNE_REPS * per_sample)
                          / 1e3)
    return total


def warm_gpu(seconds: float = 1.0) -> None:
    """Bring clocks up from idle before measuring (idle SM clocks sit near 345 MHz)."""
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


def time_replays(fn: Callable[[], None], *, calls_per_graph: int, reps: int = 7,
                 min_ms: float = 20.0) -> float:
    """Median microseconds per call of ``fn`` (one graph holds ``calls_per_graph`` calls).

    ``fn`` must itself issue ``calls_per_graph`` calls over distinct inputs so that
    consecutive calls find a cold L2 when the inputs are large enough.
    """
    return time_replays_paired({"": fn}, calls_per_graph=calls_per_graph, reps=reps,
                               min_ms=min_ms)[""]


def time_replays_paired(fns: Mapping[str, Callable[[], None]], *, calls_per_graph: int,
                        reps: int = 7, min_ms: float = 20.0) -> dict[str, float]:
    """``time_replays`` of several ``fns`` whose samples interleave: every graph is
    captured first, then each round takes one sample of each, in an order that rotates
    from round to round. The GPU's clocks drift over seconds at full bandwidth, by more
    than the plans being compared differ; interleaved samples see the same drift."""
    stream = torch.cuda.Stream()
    graphs = {}
    for label, fn in fns.items():
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # compile and warm up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graphs[label] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[label]):
            fn()
        graphs[label].replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def sample(graph: torch.cuda.CUDAGraph, replays: int) -> float:
        start.record()
        for _ in range(replays):
            graph.replay()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop)

    replays = {label: max(1, min(200, int(min_ms / max(sample(g, 1), 1e-3))))
               for label, g in graphs.items()}
    labels = list(graphs)
    samples: dict[str, list[float]] = {label: [] for label in labels}
    for rep in range(reps):
        for label in labels[rep % len(labels):] + labels[:rep % len(labels)]:
            ms = sample(graphs[label], replays[label])
            samples[label].append(ms * 1e3 / (replays[label] * calls_per_graph))
    graphs.clear()
    return {label: statistics.median(samples[label]) for label in fns}


class Problem:
    """One cache of N(0, 1) rows in ``kv_cache``'s format, large enough for the biggest
    shape; R rotations of scattered tables. ``num_heads`` counts query rows (q_len x heads
    for a verify step). ``max_requests``: the most requests one call spreads ``max_tokens``
    over; each rounds up to whole pages, so each gets one page beyond the tokens."""

    def __init__(self, max_tokens: int, num_heads: int = 16, kv_cache: str = "bf16", *,
                 max_requests: int = 1):
        fmt = fp8.get_cache_format(kv_cache)
        self.num_heads, self.kv_cache = num_heads, fmt.name
        self.num_pages = cdiv(max_tokens, PAGE_SIZE) + max_requests
        width, dtype = fmt.cache_row(QK_DIM, torch.bfloat16)
        self.cache = torch.empty(self.num_pages, PAGE_SIZE, width, dtype=dtype, device="cuda")
        self.kv_scale = None
        if not fmt.quantized:
            self.cache.normal_()
            return
        if fmt.scale == "per-tensor":
            self.kv_scale = torch.tensor([FP8_TENSOR_SCALE], device="cuda")
        for i in range(0, self.num_pages, 1024):  # float32 rows in chunks of 64K tokens
            rows = torch.randn(min(1024, self.num_pages - i), PAGE_SIZE, QK_DIM, device="cuda")
            self.cache[i:i + 1024] = fmt.store(rows, self.kv_scale)

    def inputs(self, context: int, batch: int):
        """(block tables [R, batch, pages], q [R, batch, H, 576], out [R, batch, H, 512],
        seq_lens [batch]) for R rotations, each over pages no other rotation reads."""
        pages_per_req = cdiv(context, PAGE_SIZE)
        per_call = max(1, batch * pages_per_req)
        check_pages(per_call, self.num_pages)
        rotations = rotations_for(context, batch, self.num_heads, self.kv_cache,
                                  self.num_pages)
        perm = torch.randperm(self.num_pages, device="cuda", dtype=torch.int64)
        tables = perm[: rotations * per_call].to(torch.int32).view(rotations, batch,
                                                                   pages_per_req)
        heads = self.num_heads
        q = torch.randn(rotations, batch, heads, QK_DIM, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(rotations, batch, heads, KV_LORA_RANK, dtype=torch.bfloat16,
                          device="cuda")
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        return tables.contiguous(), q, out, seq_lens

    def ragged_inputs(self, lens: list[int]):
        """``inputs`` for requests of different lengths: each table row holds its request's
        pages (the rest of the row page 0, never read)."""
        pages = [cdiv(n, PAGE_SIZE) for n in lens]
        per_call, batch = max(1, sum(pages)), len(lens)
        check_pages(per_call, self.num_pages)
        step_bytes = sum(kv_bytes(n, 1, self.num_heads, self.kv_cache) for n in lens)
        rotations = max(1, min(MAX_ROTATIONS, L2_FLUSH_BYTES // step_bytes,
                               self.num_pages // per_call))
        perm = torch.randperm(self.num_pages, device="cuda")[: rotations * per_call].int()
        tables = torch.zeros(rotations, batch, max(1, max(pages)), dtype=torch.int32,
                             device="cuda")
        for r in range(rotations):
            for b, row in enumerate(perm[r * per_call:(r + 1) * per_call].split(pages)):
                tables[r, b, :row.numel()] = row
        q = torch.randn(rotations, batch, self.num_heads, QK_DIM, dtype=torch.bfloat16,
                        device="cuda")
        out = torch.empty(rotations, batch, self.num_heads, KV_LORA_RANK,
                          dtype=torch.bfloat16, device="cuda")
        seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        return tables, q, out, seq_lens


def launcher(plan: LaunchPlan, q_len: int = 1, *, partition: bool = True):
    """``plan``'s launch function and the keywords it takes beside the common ones: a
    balanced plan's ``partition`` (False: the workspace holds this step's partition), a
    split plan's ``q_len``."""
    if plan.balanced:
        return mla_decode_balanced, {"partition": partition}
    return mla_decode, {"q_len": q_len}


def rotated_calls(problem: Problem, tables, q, out, seq_lens, ws: SplitWorkspace | None,
                  plan: LaunchPlan, scale: float, q_len: int = 1) -> Callable[[], None]:
    """One decode call per rotation, each over its own pages: what one graph replay runs.
    A balanced plan partitions the step once, in the first call, as the layers of a decode
    step do (the rotations share the lengths, so the partition is the same for each)."""
    # The calls skip the launch checks (their cost would be timed); a workspace too small
    # for the plan would be written past its end.
    if plan.use_stage2 and (ws is None or not ws.fits(plan)):
        raise ValueError(f"{plan.describe()}: the timer's workspace does not cover it "
                         "(size it by max_splits and max_items over every plan timed)")

    def call():
        for r in range(tables.shape[0]):
            decode, extra = launcher(plan, q_len, partition=r == 0)
            decode(q[r], problem.cache, tables[r], seq_lens, out[r], ws, plan=plan,
                   sm_scale=scale, kv_scale=problem.kv_scale, check=False, **extra)
    return call


class Progress:
    """``[n/total] ... (elapsed s, ETA s)`` lines; the ETA scales the elapsed time by the
    estimated seconds left over the estimated seconds done."""

    def __init__(self, total: int, estimate_s: float, *, enabled: bool = True) -> None:
        self.total, self.estimate_s, self.enabled = total, max(estimate_s, 1e-9), enabled
        self.done, self.done_s, self.start = 0, 0.0, time.perf_counter()

    def step(self, text: str, estimated_s: float) -> None:
        self.done += 1
        self.done_s += estimated_s
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        left = elapsed / max(self.done_s, 1e-9) * max(self.estimate_s - self.done_s, 0.0)
        print(f"[{self.done}/{self.total}] {text} ({elapsed:.0f} s, ETA {left:.0f} s)",
              flush=True)


class PlanTimer:
    """Times plans at uniform (context, batch) shapes, and at ragged lengths (``time_lens``,
    balanced plans too), over one cache allocation (reused by every measurement, refinement
    rounds included). ``max_items``: the most balanced work items a plan timed has. CUDA
    only."""

    def __init__(self, max_context: int, max_batch: int, num_heads: int, *, q_len: int = 1,
                 kv_cache: str = "bf16", max_splits: int = 1, max_items: int = 0,
                 seed: int = 0) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("PlanTimer times CUDA-graph replays and needs a CUDA GPU; "
                               "choose from a saved table instead (tune_ladder.py "
                               "--from-times)")
        torch.manual_seed(seed)
        self.q_len, self.rows = q_len, num_heads * q_len
        self.problem = Problem(max_context * max_batch, self.rows, kv_cache,
                               max_requests=max_batch)
        self.ws = SplitWorkspace.allocate(max_batch, self.rows, max(1, max_splits),
                                          KV_LORA_RANK, "cuda", max_items=max_items)
        self.scale = default_sm_scale()
        warm_gpu()

    def time(self, context: int, batch: int, plans: Mapping[str, LaunchPlan]
             ) -> dict[str, float]:
        """``{label: us per call}`` of each plan at ``batch`` requests of ``context``."""
        return self._time(self.problem.inputs(context, batch), plans)

    def time_lens(self, lens: list[int], plans: Mapping[str, LaunchPlan]) -> dict[str, float]:
        """``{label: us per call}`` of each plan over requests of lengths ``lens``."""
        return self._time(self.problem.ragged_inputs(lens), plans)

    def _time(self, inputs, plans: Mapping[str, LaunchPlan]) -> dict[str, float]:
        tables, q, out, seq_lens = inputs
        self._check(tables, q, out, seq_lens, plans)
        return time_replays_paired(
            {label: rotated_calls(self.problem, tables, q, out, seq_lens, self.ws, plan,
                                  self.scale, self.q_len) for label, plan in plans.items()},
            calls_per_graph=tables.shape[0], reps=TUNE_REPS, min_ms=SAMPLE_MS)

    def _check(self, tables, q, out, seq_lens, plans: Mapping[str, LaunchPlan]) -> None:
        """Each plan once on the first rotation, the outputs compared (``check_outputs_agree``)."""
        outputs = {}
        for label, plan in plans.items():
            decode, extra = launcher(plan, self.q_len)
            got = torch.full_like(out[0], float("nan"))
            decode(q[0], self.problem.cache, tables[0], seq_lens, got, self.ws, plan=plan,
                   sm_scale=self.scale, kv_scale=self.problem.kv_scale, **extra)
            outputs[label] = got
        check_outputs_agree(outputs)


def time_ragged(timer: PlanTimer, mixes: Iterable[tuple[int, str, list[int]]],
                split_for: Callable[[int, list[int]], LaunchPlan],
                balanced_for: Callable[[int], LaunchPlan | Mapping[str, LaunchPlan]], *,
                progress: Progress | None = None) -> list[RaggedSample]:
    """Each (batch, mix, lengths) timed with the ladder's split-KV plan (``split_for``) and
    the balanced plan (``balanced_for``: one plan, or ``{kernel: plan}`` to time each
    balanced kernel; the first is the sample's ``kernel``), over ``timer``'s cache."""
    samples = []
    for batch, name, lens in mixes:
        balanced = balanced_for(batch)
        kernels = dict(balanced) if isinstance(balanced, Mapping) else {
            DEFAULT_BALANCED_KERNEL: balanced}
        times = timer.time_lens(lens, {"split": split_for(batch, lens),
                                       **{f"balanced:{k}": p for k, p in kernels.items()}})
        by_kernel = tuple((k, round(times[f"balanced:{k}"], 3)) for k in kernels)
        first = by_kernel[0]
        sample = RaggedSample(batch, name, tuple(lens), round(times["split"], 3), first[1],
                              first[0], by_kernel if len(by_kernel) > 1 else ())
        samples.append(sample)
        if progress is not None:
            kernel_text = ", ".join(f"{k} {us:.1f}" for k, us in by_kernel)
            progress.step(f"b={batch} {name} (imbalance {sample.imbalance:.2f}): split "
                          f"{sample.split_us:.1f} us, balanced {kernel_text} us", 0.3)
    return samples
