"""Capture policies: what an engine captures, expressed as ladders.

- ``eager``: nothing captured; every step plans from its real lengths (graphs off);
- ``fixed-1``: one graph per batch size planned with hint 1 (dummy-length capture);
- ``fixed-max``: one graph per batch size planned with ``max_model_len`` (largest budget);
- ``balanced-only``: one balanced split-KV graph per batch size (the device splits every
  step's tiles into equal chunks, whatever the lengths); verify steps (q_len > 1), which
  the balanced kernels do not decode, replay fixed-max's graph;
- ``ladder``: one graph per (batch size, bucket) of the tuned ladder shipped for this GPU
  and head count, else ``default_ladder`` (the sparse backend's: its own tuned ladder, else
  ``sparse_ladder``).

All run the same kernels; only what is frozen at capture differs.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from graphbucket.ladder import Bucket, BucketLadder, default_ladder
from graphbucket.spec import BufferSpec
from graphbucket.tuning.shipped import find_tuned_ladder

Policy = Literal["eager", "fixed-1", "fixed-max", "balanced-only", "ladder"]
POLICIES: tuple[str, ...] = get_args(Policy)


def device_ladder(spec: BufferSpec, max_model_len: int) -> BucketLadder:
    """The ladder tuned for this GPU, head count and cache format when one ships (an fp8
    format without one: the bf16 ladder, ``find_tuned_ladder``), else the default."""
    tuned = tuned_device_ladder(spec, max_model_len)
    return tuned if tuned is not None else default_ladder(max_model_len)


def tuned_device_ladder(spec: BufferSpec, max_model_len: int, *,
                        sparse_topk: int | None = None, q_len: int = 1) -> BucketLadder | None:
    """The ladder shipped for ``spec``'s GPU, head count, cache format and ``q_len``
    (``sparse_topk``: the sparse decoder's for that top-k), or None (no CUDA device, or
    none ships)."""
    if spec.device.type != "cuda" or not torch.cuda.is_available():
        return None
    return find_tuned_ladder(torch.cuda.get_device_name(spec.device), spec.num_heads,
                             max_model_len, kv_cache_format=spec.kv_cache_format,
                             sparse_topk=sparse_topk, q_len=q_len)


def policy_ladder(policy: Policy, max_model_len: int, ladder: BucketLadder | None = None, *,
                  spec: BufferSpec | None = None) -> BucketLadder | None:
    """The ladder a policy captures (None for ``eager``); ``ladder`` replaces the
    ``ladder`` policy's default (``device_ladder`` of ``spec``, else ``default_ladder``)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
    if ladder is not None and policy != "ladder":
        raise ValueError(f"policy {policy!r} defines its own ladder; pass ladder=... only "
                         "with policy='ladder'")
    if policy == "eager":
        return None
    if policy in ("fixed-1", "fixed-max"):
        hint = 1 if policy == "fixed-1" else max_model_len
        return BucketLadder((Bucket(max_model_len, hint),), max_model_len,
                            meta={"policy": policy})
    if policy == "balanced-only":  # imbalance 1: every batch, uniform ones included
        # The balanced kernel per capture size as the device's tuned ladder chose it for
        # its longest lengths.
        tuned = tuned_device_ladder(spec, max_model_len) if spec is not None else None
        return BucketLadder((Bucket(max_model_len, max_model_len, balanced_imbalance=1.0,
                                    balanced_kernels=tuned[-1].balanced_kernels if tuned
                                    else ()),), max_model_len, meta={"policy": policy})
    if ladder is not None:
        if ladder.max_model_len != max_model_len:
            raise ValueError(f"ladder covers 1..{ladder.max_model_len} but max_model_len="
                             f"{max_model_len}; pass a ladder that ends at max_model_len")
        return ladder
    return device_ladder(spec, max_model_len) if spec is not None else default_ladder(
        max_model_len)
