"""Shipped tuned ladders: ``graphbucket/ladders/{device slug}-h{heads}.json``.

``scripts/tune_ladder.py`` writes them on the GPU they were measured on. The slug is the
device name, lower case, vendor words dropped, other characters folded to '-':
'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3', 'AMD Instinct
MI355X' -> 'mi355x'. Lookup tries the full slug, then shorter prefixes ('h100-80gb',
'h100'), so one 'h200' file serves every H200 variant unless a more specific one ships.
Pure host code; no torch.
"""

from __future__ import annotations

import re
from pathlib import Path

from graphbucket.ladder import Bucket, BucketLadder

LADDER_DIR = Path(__file__).resolve().parent.parent / "ladders"
_VENDOR_WORDS = frozenset({"nvidia", "amd", "instinct", "tesla"})


def device_slugs(device_name: str) -> list[str]:
    """Slugs to try for ``device_name``, most specific first ('NVIDIA H200' -> ['h200'])."""
    words = [w for w in re.split(r"[^a-z0-9]+", device_name.lower())
             if w and w not in _VENDOR_WORDS]
    if not words:
        raise ValueError(f"device name {device_name!r} has no model word to look a ladder up by "
                         "(expected e.g. 'NVIDIA H200')")
    return ["-".join(words[:n]) for n in range(len(words), 0, -1)]


def find_tuned_ladder(device_name: str, num_heads: int, max_model_len: int, *,
                      directory: str | Path | None = None) -> BucketLadder | None:
    """The shipped tuned ladder for this device and head count, or None.

    ``directory`` defaults to the package's ``ladders/``. A ladder tuned for a larger
    ``max_model_len`` is clipped (``clip_ladder``): its buckets below the new top were
    measured and stay as tuned. One tuned for a smaller ``max_model_len`` gives None: the
    lengths above its top were never measured, and stretching its last bucket could serve
    them with far too few splits (the failure graphbucket exists to prevent); tune with
    ``--max-model-len`` at least the one served. Raises ValueError when the file found says
    (in its meta) it was tuned for another head count.
    """
    for slug in device_slugs(device_name):
        path = Path(directory or LADDER_DIR) / f"{slug}-h{num_heads}.json"
        if path.is_file():
            break
    else:
        return None
    ladder = BucketLadder.load(path)
    heads = ladder.meta.get("num_heads")
    if heads is not None and heads != num_heads:
        raise ValueError(f"{path} is named for {num_heads} heads but its meta says num_heads="
                         f"{heads}; re-run scripts/tune_ladder.py or rename the file")
    if ladder.max_model_len == max_model_len:
        return ladder
    if ladder.max_model_len > max_model_len:
        return clip_ladder(ladder, max_model_len)
    return None


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
            balanced_imbalance=bucket.balanced_imbalance))
        lower = bucket.max_len
    meta = {**ladder.meta, "clipped_from": ladder.max_model_len}
    return BucketLadder(buckets, max_model_len, meta=meta)
