"""Shipped tuned ladders: ``graphbucket/ladders/{device slug}-h{heads}[-{format}].json``.

``scripts/tune_ladder.py`` writes them on the GPU they were measured on. The slug is the
device name, lower case, vendor words dropped, other characters folded to '-':
'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3', 'AMD Instinct
MI355X' -> 'mi355x'. Lookup tries the full slug, then shorter prefixes ('h100-80gb',
'h100'), so one 'h200' file serves every H200 variant unless a more specific one ships.

fp8 caches get their own ladders (``h200-h16-fp8-tensor.json``, ``h200-h16-fp8-v32.json``:
fewer bytes per token move the best split count per context); a bf16 cache's file has
no suffix. Where no ladder was tuned for the cache format, the lookup falls back to the
bf16 ladder of the device, logs that once and records it in the ladder's
``meta['kv_cache_fallback']``. The sparse decoder (DeepSeek-V3.2: indexer, top-k, sparse
attention) has ladders of its own, ``h200-h16-sparse.json`` (``tune_ladder.py --sparse``,
``meta['decoder'] == 'sparse'`` with its ``topk``): it is looked up only by
``sparse_topk=``, and never serves the dense decoder, nor a dense ladder the sparse one.
Pure host code; the format names come from ``graphbucket.fp8``.
"""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from pathlib import Path

from graphbucket.fp8 import DEFAULT_FORMAT, KV_CACHE_FORMATS, check_format
from graphbucket.ladder import Bucket, BucketLadder

LADDER_DIR = Path(__file__).resolve().parent.parent / "ladders"
_VENDOR_WORDS = frozenset({"nvidia", "amd", "instinct", "tesla"})
logger = logging.getLogger(__name__)
_noted: set[tuple] = set()
SPARSE_DECODER = "sparse"  # ``meta['decoder']`` of a sparse decoder's ladder


def device_slugs(device_name: str) -> list[str]:
    """Slugs to try for ``device_name``, most specific first ('NVIDIA H200' -> ['h200'])."""
    words = [w for w in re.split(r"[^a-z0-9]+", device_name.lower())
             if w and w not in _VENDOR_WORDS]
    if not words:
        raise ValueError(f"device name {device_name!r} has no model word to look a ladder up by "
                         "(expected e.g. 'NVIDIA H200')")
    return ["-".join(words[:n]) for n in range(len(words), 0, -1)]


def ladder_file_name(slug: str, num_heads: int, kv_cache_format: str = DEFAULT_FORMAT,
                     q_len: int = 1, *, sparse: bool = False) -> str:
    """'h200-h16.json' for a bf16 cache, 'h200-h16-fp8-v32.json' for an fp8-v32 one,
    'h200-h128-q2.json' for verify steps of 2 tokens (``tune_ladder.py --q-len 2``),
    'h200-h16-sparse.json' for the sparse decoder (``tune_ladder.py --sparse``)."""
    check_format(kv_cache_format)
    if isinstance(q_len, bool) or not isinstance(q_len, int) or q_len < 1:
        raise ValueError(f"q_len must be a positive int, got {q_len!r}")
    # The default (unquantized) format's file has no suffix.
    suffix = "" if kv_cache_format == DEFAULT_FORMAT else f"-{kv_cache_format}"
    suffix += f"-{SPARSE_DECODER}" if sparse else ""
    suffix += "" if q_len == 1 else f"-q{q_len}"
    return f"{slug}-h{num_heads}{suffix}.json"


def parse_ladder_file_name(name: str) -> tuple[str, int, str]:
    """(slug, heads, format) of a shipped ladder's file name (``ladder_file_name``'s inverse;
    q_len and sparse suffixes are dropped: ``parse_q_len`` and ``parse_sparse`` read them)."""
    stem = re.sub(r"-q\d+$", "", name.removesuffix(".json")).removesuffix(f"-{SPARSE_DECODER}")
    fmt = next((f for f in KV_CACHE_FORMATS if f != DEFAULT_FORMAT and stem.endswith(f"-{f}")),
               DEFAULT_FORMAT)
    if fmt != DEFAULT_FORMAT:
        stem = stem[: -len(fmt) - 1]
    slug, heads = stem.rsplit("-h", 1)
    return slug, int(heads), fmt


def parse_q_len(name: str) -> int:
    """The q_len a shipped ladder's file name was tuned for (1 without a suffix)."""
    found = re.search(r"-q(\d+)$", name.removesuffix(".json"))
    return int(found.group(1)) if found else 1


def parse_sparse(name: str) -> bool:
    """Whether a shipped ladder's file name is the sparse decoder's."""
    return re.sub(r"-q\d+$", "", name.removesuffix(".json")).endswith(f"-{SPARSE_DECODER}")


def find_tuned_ladder(device_name: str, num_heads: int, max_model_len: int, *,
                      kv_cache_format: str = DEFAULT_FORMAT,
                      directory: str | Path | None = None,
                      sparse_topk: int | None = None, q_len: int = 1) -> BucketLadder | None:
    """The shipped tuned ladder for this device, head count and cache format, or None.

    An fp8 format without a tuned file gets the device's bf16 ladder instead (logged once,
    ``meta['kv_cache_fallback']`` names the format asked for), or None without either.
    ``sparse_topk``: the sparse decoder's ladder for that top-k (its ``-sparse`` file); one
    tuned for another top-k gives None (logged once), as its hints were chosen for
    another attention.

    ``q_len``: the ladder tuned for verify steps of q_len tokens (its ``-q{q_len}`` file;
    the runner's q_len 1 ladder serves a q_len without one, so None here).

    ``directory`` defaults to the package's ``ladders/``. A ladder tuned for a larger
    ``max_model_len`` is clipped (``clip_ladder``): its buckets below the new top were
    measured and stay as tuned. One tuned for a smaller ``max_model_len`` gives None: the
    lengths above its top were never measured, and stretching its last bucket could serve
    them with far too few splits (the failure graphbucket exists to prevent); tune with
    ``--max-model-len`` at least the one served. Raises ValueError when the file found says
    (in its meta) it was tuned for another head count.
    """
    sparse = sparse_topk is not None
    for slug in device_slugs(device_name):
        path = Path(directory or LADDER_DIR) / ladder_file_name(slug, num_heads,
                                                                kv_cache_format, q_len,
                                                                sparse=sparse)
        if path.is_file():
            break
    else:
        if kv_cache_format == DEFAULT_FORMAT:
            return None
        ladder = find_tuned_ladder(device_name, num_heads, max_model_len, directory=directory,
                                   sparse_topk=sparse_topk, q_len=q_len)
        if ladder is None:
            return None
        _note_once((device_name, num_heads, kv_cache_format, sparse),
                   "no %sladder tuned for %s caches on %s with %d heads ships; using the bf16 "
                   "ladder (tune one: scripts/tune_ladder.py --kv-cache %s%s)",
                   "sparse " * sparse, kv_cache_format, device_name, num_heads,
                   kv_cache_format, " --sparse" * sparse)
        # Its balanced kernels were chosen over bf16 caches: the fallback keeps the default.
        return BucketLadder(tuple(replace(b, balanced_kernels=(), alternate_kernels=())
                                  for b in ladder.buckets),
                            ladder.max_model_len,
                            meta={**ladder.meta, "kv_cache_fallback": kv_cache_format})
    ladder = BucketLadder.load(path)
    heads = ladder.meta.get("num_heads")
    if heads is not None and heads != num_heads:
        raise ValueError(f"{path} is named for {num_heads} heads but its meta says num_heads="
                         f"{heads}; re-run scripts/tune_ladder.py or rename the file")
    fmt = ladder.meta.get("kv_cache", DEFAULT_FORMAT)
    if fmt != kv_cache_format:
        raise ValueError(f"{path} is named for {kv_cache_format} caches but its meta says "
                         f"kv_cache={fmt!r}; re-run scripts/tune_ladder.py or rename the file")
    if ladder.meta.get("q_len", 1) != q_len:
        raise ValueError(f"{path} is named for q_len {q_len} but its meta says q_len="
                         f"{ladder.meta.get('q_len', 1)}; re-run scripts/tune_ladder.py or "
                         "rename the file")
    if (ladder.meta.get("decoder") == SPARSE_DECODER) != sparse:
        raise ValueError(f"{path} is named for the {'sparse' if sparse else 'dense'} decoder "
                         f"but its meta says decoder={ladder.meta.get('decoder')!r}; re-run "
                         "scripts/tune_ladder.py or rename the file")
    if sparse and ladder.meta.get("topk") != sparse_topk:
        _note_once((str(path), sparse_topk), "%s was tuned for top-k %s, not %d; not using it "
                   "(tune one: scripts/tune_ladder.py --sparse --topk %d)", path,
                   ladder.meta.get("topk"), sparse_topk, sparse_topk)
        return None
    if ladder.max_model_len == max_model_len:
        return ladder
    if ladder.max_model_len > max_model_len:
        return clip_ladder(ladder, max_model_len)
    return None


def _note_once(key: tuple, message: str, *args: object) -> None:
    if key not in _noted:
        _noted.add(key)
        logger.warning(message, *args)


def clip_ladder(ladder: BucketLadder, max_model_len: int) -> BucketLadder:
    """``ladder`` cut at ``max_model_len``: buckets above it dropped, the last one ends there.

    Hints above the new ``max_model_len`` are lowered to it (no hint may exceed it); such a
    plan may have fewer splits than tuned, which suits the shorter lengths it now covers.
    Every other hint, inside its bucket or not, stays as tuned. ``meta['clipped_from']``
    records the old top.
    """
    if not 1 <= max_model_len <= ladder.max_model_len:
        raise ValueError(f"can only clip to 1..{ladder.max_model_len}, got {max_model_len}")
    buckets, lower = [], 0
    for bucket in ladder:
        if lower >= max_model_len:
            break
        top = min(bucket.max_len, max_model_len)
        buckets.append(Bucket(max_len=top, hint=min(bucket.hint, max_model_len), batch_hints={
            size: min(h, max_model_len) for size, h in bucket.batch_hints},
            balanced_imbalance=bucket.balanced_imbalance,
            batch_imbalance=bucket.batch_imbalance, balanced_kernels=bucket.balanced_kernels,
            alternate_kernels=bucket.alternate_kernels))
        lower = bucket.max_len
    meta = {**ladder.meta, "clipped_from": ladder.max_model_len}
    return BucketLadder(buckets, max_model_len, meta=meta)
