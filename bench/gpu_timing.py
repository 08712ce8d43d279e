"""Shared GPU timing helpers: copy-bandwidth ceiling, graph-replay timing, run metadata, and
where a bench writes its files.

Imported by the benches; run alone on a GPU it prints the two ceilings they compare with:

    python3 bench/gpu_timing.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from collections.abc import Callable

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Moved into the package (the ladder tuner times the kernel too); re-exported here.
from graphbucket.tuning.measure import (  # noqa: E402, F401
    L2_FLUSH_BYTES,
    time_replays,
    warm_gpu,
)


def add_out_argument(ap: argparse.ArgumentParser, files: str, *, smoke: bool = False) -> None:
    """``--out DIR``, the one way a bench is told to write ``files``; see ``out_dir``."""
    ap.add_argument("--out", metavar="DIR", default=None,
                    help=f"write {files} into DIR (e.g. bench/results); without --out the "
                         "results are only printed"
                         + ("; --cpu-smoke without --out writes into a new temporary folder"
                            if smoke else ""))


def out_dir(out: str | None, *, smoke: bool = False) -> str | None:
    """The folder a bench writes into: ``--out`` when given; for a CPU smoke run without it a
    new temporary folder (never bench/results); else None, and nothing is written."""
    if out:
        os.makedirs(out, exist_ok=True)
        return out
    return tempfile.mkdtemp(prefix="graphbucket-smoke-") if smoke else None


def write_run(out: str | os.PathLike, stem: str, meta: dict, rows: list, text: str) -> None:
    """A run's ``{"meta", "rows"}`` as ``out/stem.json`` and its table as ``out/stem.md``."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(text)


def report_run(out: str | None, stem: str, meta: dict, rows: list,
               markdown: Callable[[dict, list], str]) -> None:
    """Print a run's table and, with ``--out``, write it and its JSON (``write_run``)."""
    text = markdown(meta, rows)
    print(text)
    if folder := out_dir(out):
        write_run(folder, stem, meta, rows, text)


def rerender(json_path: str, markdown: Callable[[dict], str]) -> None:
    """Rewrite the markdown beside a saved run's JSON (``--render``), no GPU needed."""
    with open(json_path) as f:
        text = markdown(json.load(f))
    with open(os.path.splitext(json_path)[0] + ".md", "w") as f:
        f.write(text)


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


def run_line(meta: dict, extra: str = "") -> str:
    """A results table's provenance line: date, versions, copy bandwidth when measured,
    ``extra`` (e.g. a matmul rate), and the command."""
    parts = [meta["date"], f"torch {meta['torch']}", f"triton {meta['triton']}"]
    if meta.get("copy_gbps"):
        parts.append(f"copy {meta['copy_gbps']:.0f} GB/s (read + write)")
    if extra:
        parts.append(extra)
    return ", ".join(parts) + f". Command: `{meta['command']}`"


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


def matmul_tflops(n: int = 8192) -> float:
    """bf16 dense matmul rate in TFLOP/s (torch.matmul of n x n by n x n, the best of
    graph replays): the compute ceiling a decode kernel's FLOPs are held against."""
    warm_gpu()
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    c = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")
    us = time_replays(lambda: torch.matmul(a, b, out=c), calls_per_graph=1, min_ms=50.0)
    return 2 * n ** 3 / (us * 1e6)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Imported by the benches; run alone on a CUDA GPU it prints the copy bandwidth "
               "and the bf16 matmul rate. Writes nothing.")
    ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("gpu_timing.py measures the GPU's copy bandwidth and matmul rate and needs "
                 "a CUDA GPU")
    meta = run_meta()
    print(f"{meta['gpu']}: copy {copy_gbps():.0f} GB/s (read + write), bf16 matmul "
          f"{matmul_tflops():.0f} TFLOP/s; torch {meta['torch']}, triton {meta['triton']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
