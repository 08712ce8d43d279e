"""Which graph serves a decode step: the one selection path of runners, engines and TP.

A ``GraphKey`` names one graph slot: (padded batch size, bucket index, hint, balanced,
q_len). A ``GraphSelector`` owns the ladder, the capture batch sizes, the query tokens per
request it captures (``q_lens``) and the selection rule:

- ``keys()``: every key in capture order (largest batch first, then the largest q_len,
  then ladder order);
- ``pad(n)``: the smallest capture size that holds ``n`` requests (None: too large);
- ``choose(seq_lens_cpu, q_len)``: the key for one step's host lengths (None: eager path).

``GraphBucketRunner`` captures ``keys()`` and replays ``choose``'s key each step; an engine
with its own graph runner does the same with the same object (build its attention
metadata with ``key.hint``, capture under ``key``). Pure host arithmetic (a ``bisect``
over the bucket bounds): nothing here reads device memory, so it is safe on every step.

Ragged batches: in a bucket whose threshold at the padded batch size is above 0
(``Bucket.imbalance_for``: ``balanced_imbalance``, or ``batch_imbalance`` from some
batch size up), a batch of two or more rows whose ``max_len x live requests >= threshold x
total tokens`` gets the key with
``balanced=True`` (a balanced split-KV graph; one per batch size, since a balanced plan
ignores the hint and its keys alias). One sum over the host lengths, only in such buckets.
A bucket with ``balanced_imbalance`` 1 replays its balanced graph for every batch of one
query token, one row included (the ``balanced-only`` policy). Where the bucket has a second
balanced kernel at that capture size (``Bucket.alternate_kernels``), a batch sent to the
balanced graph replays the key with ``alternate=True`` instead when the ladder's cost
model predicts that kernel faster for these lengths (``graphbucket.balanced_cost``: a host
replay of both kernels' partitions, numpy over the batch's work items, only on such steps;
the pick is remembered for batches of the same live count whose total and longest length
agree to 7 significant bits and whose shortest requests hold as many 64-token tiles, so a
run of decode steps pays for it now and then).
A capture size the model has no partition for keeps one balanced graph.

Multi-token steps (MTP / speculative verification, ``q_len`` query tokens per request):
every (capture size, bucket) has one key per captured q_len, hinted as at q_len 1 (the
plan folds the tokens into q_len x heads rows, ``graphs.plan_for_key``), unless
``q_ladders`` gives that q_len a ladder of its own (bounds and hints tuned for q_len x
heads rows, ``tune_ladder.py --q-len``); its keys' bucket indices are that ladder's. A q_len the
selector was not built with raises ValueError (no graph can serve it, and a verify step
cannot be padded to more tokens: each token's causal limit depends on q_len). Balanced
keys exist at q_len 1 only (the balanced kernels decode one token per request); ragged
multi-token batches replay the split-KV graph.
"""

from __future__ import annotations

import sys
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, get_args

import numpy as np

from graphbucket.balanced_cost import TILE
from graphbucket.intmath import cdiv
from graphbucket.key import GraphKey
from graphbucket.ladder import BucketLadder, above_top_error

# "max": the bucket of the longest live request (every request fits its graph's split
# budget); "min": that of the shortest (favours short requests in mixed batches).
SelectRule = Literal["max", "min"]


class GraphSelector:
    """Ladder + capture sizes + rule -> graph keys. Host arithmetic only.

    ``capture_sizes``: the padded batch sizes graphs exist for (e.g. 1, 2, 4, ..., 64);
    a batch above the largest one has no graph (``choose`` returns None: the eager path).
    ``q_lens``: the query tokens per request graphs exist for (default: 1, plain decode).
    ``q_ladders``: ladders for some q_lens above 1 (same max_model_len); the others use
    ``ladder``. ``remember_picks=False`` runs the two-kernel cost model on every step that
    weighs one (``_balanced``), for measuring it.
    """

    def __init__(self, ladder: BucketLadder, capture_sizes: Iterable[int], *,
                 rule: SelectRule = "max", q_lens: Iterable[int] = (1,),
                 q_ladders: Mapping[int, BucketLadder] | None = None,
                 remember_picks: bool = True) -> None:
        if not isinstance(ladder, BucketLadder):
            raise TypeError(f"ladder must be a BucketLadder, got {type(ladder).__name__}")
        given = list(capture_sizes)
        if not given or any(isinstance(s, bool) or not hasattr(s, "__index__") or s < 1
                            for s in given):
            raise ValueError(f"capture_sizes must be positive ints, got {given}")
        sizes = sorted({int(s) for s in given})
        if rule not in get_args(SelectRule):
            raise ValueError(f"rule must be one of {get_args(SelectRule)}, got {rule!r}")
        q_given = list(q_lens)
        if not q_given or any(isinstance(q, bool) or not isinstance(q, int) or q < 1
                              for q in q_given):
            raise ValueError(f"q_lens must be positive ints (query tokens per request), "
                             f"got {q_given}")
        self.ladder, self.capture_sizes, self.rule = ladder, tuple(sizes), rule
        self.q_lens = tuple(sorted(set(q_given)))
        self.q_ladders = checked_q_ladders(q_ladders or {}, ladder, self.q_lens)
        self._top = ladder.max_model_len
        self._bounds = {q: self.ladder_for(q).bounds for q in self.q_lens}
        # A length's bucket from a table by length >> _shift, then a step or two up the
        # bounds: a step's bucket without the bisect module (each module a step touches
        # costs on the cold caches of a host that waited on a GPU step).
        self._shift = max(0, self._top.bit_length() - 12)
        coarse = {q: [bisect_left(b, c << self._shift)
                      for c in range((self._top >> self._shift) + 1)]
                  for q, b in self._bounds.items()}
        # Precomputed so that a step allocates nothing: padded size per batch size, and the
        # key of every (q_len, capture size, bucket).
        self._padded = [0] + [sizes[bisect_left(sizes, n)] for n in range(1, sizes[-1] + 1)]
        # The balanced threshold of every (capture size, bucket).
        self._imbalance = {bs: tuple(b.imbalance_for(bs) for b in ladder.buckets)
                           for bs in sizes}
        self._keys: dict[int, dict[int, tuple[GraphKey, ...]]] = {}
        self._balanced_keys: dict[int, dict[int, tuple[GraphKey | None, ...]]] = {}
        ladder.check_alternates()
        self._cost = ladder.balanced_cost
        # (capture size, bucket) -> (primary kernel, alternate kernel, alternate key).
        self._alternates: dict[tuple[int, int], tuple[str, str, GraphKey]] = {}
        self._picks: dict[tuple[int, ...], GraphKey] = {}  # see _balanced
        self._remember = bool(remember_picks)
        for q in self.q_lens:
            keys = {bs: tuple(GraphKey(bs, i, h, False, q)
                              for i, h in enumerate(self.ladder_for(q).hints_for(bs)))
                    for bs in sizes}
            self._keys[q] = keys
            # Balanced keys exist from two rows up (one row is never ragged), at q_len 1;
            # a bucket balanced always (imbalance 1) has them at one row too.
            self._balanced_keys[q] = {
                bs: tuple(k._replace(balanced=True) if q == 1 and (
                    self._imbalance[bs][k.bucket] == 1
                    or self._imbalance[bs][k.bucket] and bs > 1)
                    else None for k in keys[bs]) for bs in sizes}
        for bs in sizes:
            for key in self._balanced_keys[1].get(bs, ()) if 1 in self.q_lens else ():
                alt = key and ladder.alternate_kernel_for(key.bucket, bs)
                main = alt and ladder.balanced_kernel_for(key.bucket, bs)
                if alt and self._cost.covers(alt, bs) and self._cost.covers(main, bs):
                    self._alternates[bs, key.bucket] = (main, alt,
                                                        key._replace(alternate=True))
        # q_len -> what a step reads (keys by capture size, bounds, coarse table): one lookup.
        self._steps = {q: (self._keys[q], self._bounds[q], coarse[q]) for q in self.q_lens}

    def __repr__(self) -> str:
        q = "" if self.q_lens == (1,) else f", q_lens={list(self.q_lens)}"
        return (f"GraphSelector({len(self.ladder)} buckets, capture_sizes="
                f"{list(self.capture_sizes)}, rule={self.rule!r}{q})")

    def ladder_for(self, q_len: int) -> BucketLadder:
        """The ladder whose buckets the keys of ``q_len`` index."""
        return self.q_ladders.get(q_len, self.ladder)

    @property
    def max_batch_size(self) -> int:
        return self.capture_sizes[-1]

    @property
    def max_q_len(self) -> int:
        return self.q_lens[-1]

    def keys(self) -> list[GraphKey]:
        """Every key, largest batch first, then the largest q_len, then ladder order
        (balanced keys after a batch size's split keys, their alternates after them): the
        capture order."""
        # A bucket balanced always (imbalance 1) never replays its q_len-1 split graph.
        return [key for bs in reversed(self.capture_sizes) for q in reversed(self.q_lens)
                for key in (*(k for k in self._keys[q][bs]
                              if q != 1 or self._imbalance[bs][k.bucket] != 1),
                            *filter(None, self._balanced_keys[q][bs]),
                            *(self._alternates[bs, k.bucket][2]
                              for k in filter(None, self._balanced_keys[q][bs])
                              if (bs, k.bucket) in self._alternates))]

    def key(self, batch_size: int, bucket: int, *, balanced: bool = False,
            q_len: int = 1, alternate: bool = False) -> GraphKey:
        """The key of a capture size, bucket index and q_len (KeyError: no such key)."""
        if alternate:
            if q_len != 1 or (batch_size, bucket) not in self._alternates:
                raise KeyError(f"bucket {bucket} has no alternate balanced graph at batch size "
                               f"{batch_size}, q_len {q_len}")
            return self._alternates[batch_size, bucket][2]
        if balanced:
            key = self._balanced_keys[q_len][batch_size][bucket]
            if key is None:
                raise KeyError(f"bucket {bucket} has no balanced graph at batch size "
                               f"{batch_size}, q_len {q_len} (balanced_imbalance is 0, one "
                               "row, or more than one query token)")
            return key
        return self._keys[q_len][batch_size][bucket]

    def pad(self, batch_size: int) -> int | None:
        """Smallest capture size >= ``batch_size``; None when the batch needs the eager path."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return self._padded[batch_size] if batch_size <= self.capture_sizes[-1] else None

    def choose(self, seq_lens_cpu: Any, q_len: int = 1) -> GraphKey | None:
        """The key for one decode step from the scheduler's host lengths, or None when the
        batch is above the largest capture size (the engine's eager path).

        ``seq_lens_cpu``: [B] ints >= 0 (list, tuple, 1-D integer numpy array or CPU
        tensor), the step's ``q_len`` new tokens included; zeros are padding rows.
        Raises ValueError for a length above the ladder top, a q_len the selector was not
        built with or a live length below q_len, and TypeError for a device tensor
        (reading it would synchronize).
        """
        lens = host_lengths(seq_lens_cpu)
        if len(lens) == 0:
            raise ValueError("seq_lens_cpu is empty; a decode step needs at least one request")
        if isinstance(lens, np.ndarray):
            lo, hi = int(lens.min()), int(lens.max())
        else:
            lo, hi = _as_length(min(lens)), _as_length(max(lens))
        if lo < 0:
            raise ValueError(f"seq_lens_cpu holds {lo}; lengths must be >= 0 (0 = padding row)")
        if q_len != 1 and 0 < (lo if lo > 0 else _min_positive(lens)) < q_len:
            raise short_for_q_len_error(lo if lo > 0 else _min_positive(lens), q_len)
        return self.key_for(len(lens), lo, hi, lens, q_len)

    def key_for(self, batch_size: int, min_len: int, max_len: int,
                lens: Sequence[int] | np.ndarray | None = None,
                q_len: int = 1) -> GraphKey | None:
        """``choose`` for lengths already checked to be ints >= 0, live ones >= q_len
        (``lens`` is needed by the ``"min"`` rule when ``min_len`` is 0, to skip padding
        rows, and by buckets with a balanced topology, to measure how ragged the batch is)."""
        if max_len > self._top:
            raise above_top_error(max_len, self._top)
        found = self._steps.get(q_len)
        if found is None:
            raise ValueError(f"q_len={q_len!r} has no graphs: this selector captures q_lens "
                             f"{list(self.q_lens)}. Build it (or the runner) with "
                             f"q_lens=(..., {q_len!r})")
        if batch_size > self.capture_sizes[-1]:
            return None
        length = max_len
        if self.rule == "min":
            length = min_len if min_len > 0 else _min_positive(lens)
        by_size, bounds, coarse = found
        bucket = coarse[length >> self._shift]
        while bounds[bucket] < length:  # bisect_left(bounds, length)
            bucket += 1
        padded = self._padded[batch_size]
        if q_len != 1:  # balanced graphs decode one token per request
            return by_size[padded][bucket]
        threshold = self._imbalance[padded][bucket]
        if threshold == 1 and q_len == 1:
            return self._balanced(padded, bucket, lens, batch_size, min_len, max_len)
        if threshold and q_len == 1 and padded > 1 and lens is not None and min_len < max_len:
            live, total = _stats(lens, batch_size, min_len)
            if max_len * live >= threshold * total:
                return self._balanced(padded, bucket, lens, batch_size, min_len, max_len,
                                      live, total)
        return by_size[padded][bucket]

    def _balanced(self, padded: int, bucket: int, lens: Any, batch_size: int,
                  min_len: int, max_len: int, live: int = -1, total: int = -1) -> GraphKey:
        """The balanced key, or its alternate where the cost model predicts it faster.

        The model's pick is remembered per (capture size, bucket, live requests, total and
        longest length to 7 significant bits, and the shortest length's 64-token tiles):
        decode steps grow each length by one token, so consecutive steps share the pick and
        only a step whose batch changed by more than 1/128 to 1/64 pays for the model, or
        one whose short requests (often of one length) crossed a tile together, which moves
        the kernels' partitions by a step."""
        alternate = self._alternates.get((padded, bucket))
        if alternate is None or lens is None:
            return self._balanced_keys[1][padded][bucket]
        if live < 0:
            live, total = _stats(lens, batch_size, min_len)
        memo = (padded, bucket, live, _coarse(total), _coarse(max_len), cdiv(min_len, TILE))
        picked = self._picks.get(memo)
        if picked is None:
            main, alt, key = alternate
            faster = (self._cost.predict(alt, padded, lens)
                      < self._cost.predict(main, padded, lens))
            picked = key if faster else self._balanced_keys[1][padded][bucket]
            if self._remember:
                if len(self._picks) >= _MAX_PICKS:
                    self._picks.clear()
                self._picks[memo] = picked
        return picked

    @property
    def remembered_picks(self) -> int:
        """How many two-kernel picks the selector holds (each one cost-model run)."""
        return len(self._picks)

    def alternate_kernels(self, key: GraphKey) -> tuple[str, str] | None:
        """(balanced kernel, alternate kernel) weighed for ``key``'s capture size and bucket,
        or None where it has one balanced graph."""
        alternate = self._alternates.get((key.batch_size, key.bucket))
        return None if alternate is None else alternate[:2]


def checked_q_ladders(q_ladders: Mapping[int, BucketLadder], ladder: BucketLadder,
                      q_lens: tuple[int, ...]) -> dict[int, BucketLadder]:
    """``q_ladders`` as a dict, each for a captured q_len above 1 and ending where
    ``ladder`` ends (ValueError / TypeError otherwise)."""
    checked = {}
    for q, q_ladder in q_ladders.items():
        if not isinstance(q_ladder, BucketLadder):
            raise TypeError(f"q_ladders[{q!r}] must be a BucketLadder, got "
                            f"{type(q_ladder).__name__}")
        if q not in q_lens or q == 1:
            raise ValueError(f"q_ladders has a ladder for q_len {q!r}; it takes captured "
                             f"q_lens above 1 ({[x for x in q_lens if x > 1]}); the q_len 1 "
                             "ladder is the ladder argument")
        if q_ladder.max_model_len != ladder.max_model_len:
            raise ValueError(f"q_ladders[{q}] covers 1..{q_ladder.max_model_len} but the "
                             f"ladder 1..{ladder.max_model_len}; every q_len's ladder ends at "
                             "max_model_len")
        checked[q] = q_ladder
    return checked


def short_for_q_len_error(length: int, q_len: int) -> ValueError:
    """A live request shorter than the step's query tokens (its lengths count them)."""
    return ValueError(f"a live request has seq_len {length} < q_len {q_len}; a verify step's "
                      "lengths count its q_len new tokens (seq_len >= q_len, or 0 for a "
                      "padding row)")


def host_lengths(lens: Any) -> np.ndarray | Sequence[int]:
    """``lens`` as a host sequence or 1-D integer numpy array; rejects device tensors."""
    if type(lens) is list or type(lens) is tuple:
        return lens
    torch = sys.modules.get("torch")  # if torch was never imported, no tensor can exist
    if torch is not None and isinstance(lens, torch.Tensor):
        if lens.device.type != "cpu":
            raise TypeError(
                f"seq_lens_cpu is a tensor on {lens.device}; reading device lengths would "
                "synchronize the stream on every decode step. Pass the scheduler's host "
                "copy (a list, numpy array or CPU tensor)")
        lens = lens.numpy()
    if isinstance(lens, np.ndarray):
        if lens.ndim != 1 or lens.dtype.kind not in "iu":
            raise TypeError(f"seq_lens_cpu must be a 1-D integer array, got shape "
                            f"{lens.shape} dtype {lens.dtype}")
        return lens
    if isinstance(lens, Sequence) and not isinstance(lens, (str, bytes)):
        return lens
    raise TypeError("seq_lens_cpu must be a sequence of ints, a 1-D integer numpy array or a "
                    f"CPU integer torch tensor, got {type(lens).__name__}")


def _as_length(value: Any) -> int:
    if isinstance(value, (bool, float)) or not hasattr(value, "__index__"):
        raise TypeError(f"sequence lengths must be ints, got {type(value).__name__} {value!r}")
    return int(value)


_MAX_PICKS = 4096  # remembered two-kernel picks; cleared when full


def _coarse(n: int) -> tuple[int, int]:
    """``n`` to 7 significant bits: (shift, top bits), steps of 1/128 to 1/64 of ``n``."""
    n = int(n)  # a numpy integer has no bit_length
    shift = max(0, n.bit_length() - 7)
    return shift, n >> shift


def _stats(lens: Sequence[int] | np.ndarray, batch_size: int, min_len: int
           ) -> tuple[int, int]:
    """(live requests, total length) of a step's lengths."""
    if type(lens) is list and min_len > 0:  # every row live: one builtin
        return batch_size, sum(lens)
    return _live_and_total(lens, batch_size if min_len > 0 else None)


def _live_and_total(lens: Sequence[int] | np.ndarray, live: int | None = None
                    ) -> tuple[int, int]:
    """(requests with length > 0, sum of lengths); ``live`` when the caller knows it (no
    padding rows)."""
    if isinstance(lens, np.ndarray):
        if live is None:
            live = int(np.count_nonzero(lens))
        return live, int(lens.sum(dtype=np.int64))
    return (sum(1 for n in lens if n > 0) if live is None else live), sum(lens)


def _min_positive(lens: Sequence[int] | np.ndarray | None) -> int:
    if lens is None:
        return 0
    if isinstance(lens, np.ndarray):
        positive = lens[lens > 0]
        return int(positive.min()) if positive.size else 0
    return min((n for n in lens if n > 0), default=0)
