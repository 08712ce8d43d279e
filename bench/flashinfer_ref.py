"""FlashInfer's MLA decode as a timing reference (optional: used only when installed).

``BatchMLAPagedAttentionWrapper`` (FA3 backend on Hopper) over the same paged cache, block
tables, lengths and queries as graphbucket's kernel. FlashInfer plans on the host from CSR
page lists, so every rotation of a timed graph gets its own wrapper, planned before capture;
the graph then holds only the ``run`` calls, as graphbucket's graphs hold only launches.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable

import torch

WORKSPACE_BYTES = 128 << 20


def available() -> str | None:
    """None when FlashInfer's MLA wrapper imports, else the reason it does not."""
    try:
        import flashinfer.mla  # noqa: F401
    except Exception as exc:  # an optional benchmark dependency: report, don't fail
        return f"{type(exc).__name__}: {exc}"
    return None


def _csr(table: torch.Tensor, seq_lens: torch.Tensor, page_size: int):
    """kv_indptr / kv_indices / kv_len from a dense block table (host-side, before capture)."""
    lens = seq_lens.cpu().tolist()
    pages = [-(-n // page_size) for n in lens]
    rows = table.cpu()
    indices = torch.cat([rows[b, :p] for b, p in enumerate(pages)]) if sum(pages) else \
        torch.zeros(0, dtype=torch.int32)
    indptr = torch.tensor([0] + pages, dtype=torch.int32).cumsum(0).to(torch.int32)
    dev = table.device
    return indptr.to(dev), indices.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev)


def rotated_calls(cache: torch.Tensor, tables: torch.Tensor, q: torch.Tensor,
                  out: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                  *, kv_lora_rank: int = 512, backend: str = "fa3") -> Callable[[], None]:
    """One FlashInfer decode per rotation r over ``tables[r]`` (as ``tuning.measure``)."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    batch, heads = q.shape[1], q.shape[2]
    page_size = cache.shape[1]
    ckv, kpe = cache[..., :kv_lora_rank], cache[..., kv_lora_rank:]
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    wrappers = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CSR form of plan() is deprecated, not gone
        for r in range(tables.shape[0]):
            ws = torch.empty(WORKSPACE_BYTES, dtype=torch.int8, device=q.device)
            w = BatchMLAPagedAttentionWrapper(ws, backend=backend)
            kv_indptr, kv_indices, kv_len = _csr(tables[r], seq_lens, page_size)
            w.plan(qo_indptr, kv_indptr, kv_indices, kv_len, heads, kv_lora_rank,
                   cache.shape[2] - kv_lora_rank, page_size, False, sm_scale,
                   q.dtype, cache.dtype)
            wrappers.append(w)
    q_nope = q[..., :kv_lora_rank].contiguous()
    q_pe = q[..., kv_lora_rank:].contiguous()

    def call():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for r, w in enumerate(wrappers):
                w.run(q_nope[r], q_pe[r], ckv, kpe, out=out[r])
    return call


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Imported by bench/kernel_sweep.py; run alone it only "
                                        "reports whether FlashInfer's MLA wrapper imports here.")
    ap.parse_args(argv)
    print(f"flashinfer: {available() or 'available'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
