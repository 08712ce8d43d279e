"""FlashMLA's dense MLA decode as a timing reference (optional: used only when importable).

``flash_mla_with_kvcache`` over the same paged cache (page 64), block tables, lengths and
queries as graphbucket's kernel. FlashMLA computes its tile-scheduler metadata on the
device inside the first call that sees a fresh ``FlashMLASchedMeta`` and reuses it after,
as an engine does once per step for all layers: the warm-up call of ``time_replays``
computes it, so the timed graph replays only the decode (and its combine) kernels.

Build it on the GPU machine from its sources (not part of this project) and put it on
``PYTHONPATH``; without it the sweeps report why and skip the rows. ``--help`` says so.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch


def available() -> str | None:
    """None when ``flash_mla`` imports and has a CUDA device to run on, else why not."""
    try:
        import flash_mla  # noqa: F401
    except Exception as exc:  # an optional benchmark reference: report, don't fail
        return f"{type(exc).__name__}: {exc}"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def rotated_calls(cache: torch.Tensor, tables: torch.Tensor, q: torch.Tensor,
                  seq_lens: torch.Tensor, sm_scale: float, *, head_dim_v: int = 512
                  ) -> tuple[Callable[[], None], list[torch.Tensor]]:
    """One FlashMLA decode per rotation r over ``tables[r]`` (as ``tuning.measure``).

    cache [pages, page_size, 576] bf16; tables [R, B, max_pages] int32; q [R, B, heads, 576].
    Returns the call and the list its outputs land in (``outputs[r]``: [B, heads, 512], the
    latest call's; FlashMLA allocates its own output, so nothing is copied in the timed call).
    """
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata

    k_cache = cache.unsqueeze(2)  # [pages, page_size, h_kv = 1, 576]
    q4 = q.unsqueeze(2)  # [R, B, s_q = 1, heads, 576]
    metas = [get_mla_metadata()[0] for _ in range(tables.shape[0])]
    outputs: list[torch.Tensor] = [torch.empty(0)] * tables.shape[0]

    def call() -> None:
        for r, meta in enumerate(metas):
            o, _ = flash_mla_with_kvcache(q4[r], k_cache, tables[r], seq_lens, head_dim_v,
                                          meta, None, softmax_scale=sm_scale, causal=False)
            outputs[r] = o.squeeze(1)
    return call, outputs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Imported by bench/kernel_sweep.py; run alone it "
                                        "only reports whether FlashMLA is usable here.")
    ap.parse_args(argv)
    why_not = available()
    print(f"flash_mla: {why_not or 'available'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
