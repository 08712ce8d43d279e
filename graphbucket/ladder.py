"""Context buckets: which captured graph serves a decode step, chosen on the host.

A ``Bucket`` covers the host-known context lengths ``(previous max_len, max_len]`` and
carries a ``hint``: the representative length the kernel plans with when that bucket's
FULL graph is captured. Any hint in ``1..max_model_len`` gives correct results for any
length; hand-written ladders hint at the bucket top (enough splits for every length in
it), while a tuned ladder may hint below the bucket (fewer splits) or above it (more),
wherever that measured faster. The split count a hint buys depends on the batch size (the
budget is shared by the batch's rows), so a bucket may carry ``batch_hints``: from a
given padded batch size up, plan with another hint (``Bucket.hint_for``). A bucket may
also carry ``balanced_imbalance``: a batch in it whose lengths are that ragged (longest
length x live requests >= balanced_imbalance x total tokens) replays a balanced split-KV
graph instead (device-partitioned equal chunks, ``plan_balanced_mla_decode``): with one
split count per row, one long request among short ones sets the step time; like hints, the
threshold may change with the batch size (``batch_imbalance``, ``Bucket.imbalance_for``). A
``BucketLadder`` is an ordered list of buckets that covers ``1..max_model_len`` exactly,
with no gaps and no overlaps; every graph of one bucket serves the same lengths. Which
kernel a balanced graph runs is the bucket's, per capture size (``balanced_kernels``:
the backend offers them, ``DecodeBackend.balanced_kernels``; the tuner times each), and a
bucket may capture a second one per capture size (``alternate_kernels``), replayed where
the cost model in ``meta["balanced_cost"]`` (``graphbucket.balanced_cost``, fitted by the
tuner) predicts it faster for the step's lengths.

Which bucket serves a batch is decided by ``graphbucket.select.GraphSelector`` (a
``bisect`` over ``bounds``, host arithmetic only). Ladders come from ``default_ladder``
(the five buckets used in the field) or from a JSON file written by the ladder tuner
(``BucketLadder.load``).
"""

from __future__ import annotations

import json
from bisect import bisect_left
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from graphbucket.balanced_cost import BalancedCostModel
from graphbucket.bucket import Bucket, as_int, kernel_changes

# Upper bounds of the buckets used in the field (Kimi-K3 / DeepSeek-V3 deployments):
# <=64, 65..4K, 4K+1..16K, 16K+1..64K, 64K+1..max_model_len.
DEFAULT_BOUNDS = (64, 4096, 16384, 65536)
DEFAULT_MAX_MODEL_LEN = 131072
# Ragged batches switch to the balanced topology from this imbalance in buckets that end
# above BALANCED_ABOVE tokens. H200, 16 heads (bench/results/h200-ragged.md): balanced was
# 1.5x faster at imbalance 2 (8 requests spread over 1..128K) and 8x at 43 (one 128K among
# 63 x 1K); split-KV stays ahead on uniform batches (imbalance 1) by 7-50 %.
DEFAULT_BALANCED_IMBALANCE = 1.5
BALANCED_ABOVE = 4096
# The tuner times its ragged mixes from this length: at 128 heads balanced plans can beat
# split-KV below BALANCED_ABOVE too, on short uniform batches of a few hundred tokens
# (bench/NOTES.md 2026-12-06 17:10, 2026-12-07 09:55), so the measurements decide there too.
BALANCED_FROM = 128

_JSON_KEYS = frozenset({"max_model_len", "buckets", "meta"})
_BUCKET_KEYS = frozenset({"max_len", "hint"})
_BUCKET_OPTIONAL_KEYS = frozenset({"batch_hints", "balanced_imbalance", "batch_imbalance",
                                   "balanced_kernels", "alternate_kernels"})


def _validate(buckets: tuple[Bucket, ...], max_model_len: int) -> None:
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    if not buckets:
        raise ValueError(
            f"a BucketLadder needs at least one bucket; got none (for max_model_len="
            f"{max_model_len} use [Bucket(max_len={max_model_len}, hint={max_model_len})] "
            "or default_ladder())"
        )
    lower = 0
    for i, b in enumerate(buckets):
        if b.max_len <= lower:
            raise ValueError(
                f"bucket {i} has max_len={b.max_len}, not above the previous bound {lower}; "
                "bucket bounds must be strictly increasing (sort them and drop duplicates)"
            )
        lower = b.max_len
    if lower != max_model_len:
        raise ValueError(
            f"the ladder covers lengths 1..{lower} but max_model_len={max_model_len}; the last "
            f"bucket's max_len must equal max_model_len (set it to {max_model_len}"
            + (" or add a bucket above it)" if lower < max_model_len else " or drop buckets)")
        )
    for i, b in enumerate(buckets):
        for h in b.all_hints():
            if h > max_model_len:
                raise ValueError(
                    f"bucket {i} has hint={h} above max_model_len={max_model_len}; a hint is "
                    f"a context length to plan with (e.g. {b.max_len}, the bucket top)"
                )


@dataclass(frozen=True, slots=True)
class BucketLadder:
    """Ordered buckets covering ``1..max_model_len``; frozen, validated on construction.

    ``meta`` is a free-form dict (device name, heads, who tuned it) kept through JSON
    round trips; it takes no part in equality or hashing. One entry is read:
    ``meta["balanced_cost"]``, the cost model that picks between a bucket's two balanced
    graphs (``balanced_cost``), required where a bucket has ``alternate_kernels``. Which
    bucket serves a batch is ``GraphSelector``'s job (``graphbucket.select``); the ladder
    only knows its bounds.
    """

    buckets: tuple[Bucket, ...]
    max_model_len: int
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        buckets = tuple(self.buckets)
        for i, b in enumerate(buckets):
            if not isinstance(b, Bucket):
                raise TypeError(f"bucket {i} must be a Bucket, got {type(b).__name__} {b!r}")
        max_model_len = as_int("max_model_len", self.max_model_len)
        _validate(buckets, max_model_len)
        if self.meta is not None and not isinstance(self.meta, Mapping):
            raise TypeError(f"meta must be a mapping or None, got {type(self.meta).__name__}")
        object.__setattr__(self, "buckets", buckets)
        object.__setattr__(self, "max_model_len", max_model_len)
        object.__setattr__(self, "meta", dict(self.meta or {}))

    def __len__(self) -> int:
        return len(self.buckets)

    def __iter__(self) -> Iterator[Bucket]:
        return iter(self.buckets)

    def __getitem__(self, index: int) -> Bucket:
        return self.buckets[index]

    def __repr__(self) -> str:
        inner = ", ".join(repr(b) for b in self.buckets)
        return f"BucketLadder([{inner}], max_model_len={self.max_model_len})"

    @property
    def bounds(self) -> tuple[int, ...]:
        """Inclusive upper bound of each bucket, strictly increasing; the last is max_model_len."""
        return tuple(b.max_len for b in self.buckets)

    @property
    def hints(self) -> tuple[int, ...]:
        """Each bucket's base hint (``hints_for`` gives a batch size's)."""
        return tuple(b.hint for b in self.buckets)

    def hint_for(self, bucket: int, batch_size: int) -> int:
        """The hint the graph of (``batch_size``, ``bucket``) is planned with."""
        return self.buckets[bucket].hint_for(batch_size)

    def hints_for(self, batch_size: int) -> tuple[int, ...]:
        """Per bucket, the hint graphs of ``batch_size`` (padded) rows are planned with."""
        return tuple(b.hint_for(batch_size) for b in self.buckets)

    def balanced_kernel_for(self, bucket: int, batch_size: int) -> str:
        """The backend kernel the balanced graph of (``batch_size``, ``bucket``) runs."""
        return self.buckets[bucket].balanced_kernel_for(batch_size)

    def alternate_kernel_for(self, bucket: int, batch_size: int) -> str | None:
        """The second balanced kernel of (``batch_size``, ``bucket``), or None."""
        return self.buckets[bucket].alternate_kernel_for(batch_size)

    @property
    def balanced_cost(self) -> BalancedCostModel | None:
        """The cost model of ``meta["balanced_cost"]`` (None where absent)."""
        raw = self.meta.get("balanced_cost")
        return None if raw is None else BalancedCostModel.from_dict(raw)

    def with_balanced_kernels(self, by_batch: Mapping[int, str]) -> BucketLadder:
        """The same buckets, the balanced graphs of each listed capture size (and those
        above it, up to the next listed) running that kernel in every bucket; entries that
        change nothing from the size below are dropped."""
        pairs = kernel_changes(by_batch)
        return BucketLadder(tuple(replace(b, balanced_kernels=pairs) for b in self.buckets),
                            self.max_model_len, meta=self.meta)

    def with_top_hints(self) -> BucketLadder:
        """The same bounds, every graph hinted at its bucket's top (no per-batch hints, no
        balanced topology).

        For attention backends that read the hint as an upper bound on the live lengths
        (a ``max_seq_len`` they size or mask with) rather than as a planning hint: there a
        hint below the bucket top would be wrong, not just slow.
        """
        return BucketLadder(tuple(Bucket(b.max_len, b.max_len) for b in self.buckets),
                            self.max_model_len, meta={**self.meta, "hints": "bucket tops"})

    def with_balanced_topology(self, imbalance: float = DEFAULT_BALANCED_IMBALANCE, *,
                               above: int = BALANCED_ABOVE,
                               by_batch: Mapping[int, float] | None = None) -> BucketLadder:
        """The same ladder, with ``balanced_imbalance=imbalance`` (and ``batch_imbalance=
        by_batch``, none if not given) in every bucket that ends above ``above`` tokens (0
        turns the balanced topology off there)."""
        pairs = tuple(sorted((by_batch or {}).items()))
        buckets = tuple(b if b.max_len <= above else
                        replace(b, balanced_imbalance=imbalance, batch_imbalance=pairs)
                        for b in self.buckets)
        meta = {**self.meta, "balanced_imbalance": imbalance, "balanced_above": above}
        if pairs:
            meta["batch_imbalance"] = {str(b): t for b, t in pairs}
        return BucketLadder(buckets, self.max_model_len, meta=meta)

    def with_ragged_switches(self, switches, *, above: int = BALANCED_ABOVE) -> BucketLadder:
        """The same hints, with the balanced topology per length range: ``switches`` have
        ``lo``, ``hi``, ``threshold``, ``by_batch`` pairs and ``kernels`` pairs
        (``tuning.ragged.RaggedSwitch``, ranges not overlapping). A bucket that a range
        edge falls inside is cut there into buckets with its hints (their graphs plan alike
        and are captured once); lengths in no range keep split-KV only."""
        spans = [(int(sw.lo), int(sw.hi), float(sw.threshold), tuple(sw.by_batch),
                  tuple(getattr(sw, "kernels", ())), tuple(getattr(sw, "alternates", ())))
                 for sw in switches]
        edges = sorted({e for lo, hi, *_ in spans for e in (lo, hi)})
        buckets, lo = [], 0
        for b in self.buckets:
            for top in [e for e in edges if lo < e < b.max_len] + [b.max_len]:
                span = next((sp for sp in spans if sp[0] < top <= sp[1]), None)
                threshold, pairs, kernels, alternates = span[2:] if span else (0.0, (), (), ())
                buckets.append(Bucket(top, b.hint, b.batch_hints, threshold, pairs, kernels,
                                      alternates))
            lo = b.max_len
        meta = {**self.meta, "balanced_above": above,
                "ragged_switches": [{"lo": lo_, "hi": hi, "balanced_imbalance": t,
                                     "batch_imbalance": {str(n): v for n, v in pairs},
                                     **({"balanced_kernels": {str(n): k for n, k in kernels}}
                                        if kernels else {}),
                                     **({"alternate_kernels": {str(n): k for n, k in alts}}
                                        if alts else {})}
                                    for lo_, hi, t, pairs, kernels, alts in spans]}
        meta.pop("balanced_imbalance", None)
        meta.pop("batch_imbalance", None)
        return BucketLadder(tuple(buckets), self.max_model_len, meta=meta)

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """Inclusive ``(first, last)`` length of each bucket, e.g. ``((1, 64), (65, 4096))``."""
        bounds = self.bounds
        lowers = (0,) + bounds[:-1]
        return tuple((lo + 1, hi) for lo, hi in zip(lowers, bounds, strict=True))

    def bucket_for(self, length: int) -> int:
        """Index of the bucket holding one host-known ``length`` (0 is padding -> bucket 0)."""
        length = as_int("length", length)
        if length < 0:
            raise ValueError(f"sequence length {length} is negative; lengths must be >= 0")
        if length > self.max_model_len:
            raise above_top_error(length, self.max_model_len)
        return bisect_left(self.bounds, length)

    # ---- JSON ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"max_model_len": self.max_model_len,
                               "buckets": [b.to_dict() for b in self.buckets]}
        out["meta"] = dict(self.meta)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BucketLadder:
        if not isinstance(data, Mapping):
            raise ValueError(f"a ladder must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - _JSON_KEYS
        missing = {"max_model_len", "buckets"} - set(data)
        if unknown or missing:
            raise ValueError(
                f"ladder JSON keys must be {sorted(_JSON_KEYS)} (meta optional); missing "
                f"{sorted(missing)}, unknown {sorted(unknown)} (free-form data goes in meta)"
            )
        if not isinstance(data["buckets"], list):
            raise ValueError(f"ladder 'buckets' must be a list, got {data['buckets']!r}")
        buckets = []
        for i, entry in enumerate(data["buckets"]):
            if not isinstance(entry, Mapping) or not _BUCKET_KEYS <= set(entry) \
                    or set(entry) - _BUCKET_KEYS - _BUCKET_OPTIONAL_KEYS:
                raise ValueError(
                    f"ladder bucket {i} must be an object with keys 'max_len' and 'hint' "
                    f"(optionally 'batch_hints', 'balanced_imbalance', 'batch_imbalance', "
                    f"'balanced_kernels', 'alternate_kernels'), "
                    f"got {entry!r}"
                )
            buckets.append(Bucket(max_len=entry["max_len"], hint=entry["hint"],
                                  batch_hints=_json_batch_map(entry, "batch_hints", i, "hints"),
                                  balanced_imbalance=entry.get("balanced_imbalance", 0.0),
                                  batch_imbalance=_json_batch_map(entry, "batch_imbalance", i,
                                                                  "thresholds"),
                                  balanced_kernels=_json_batch_map(entry, "balanced_kernels",
                                                                   i, "kernel names"),
                                  alternate_kernels=_json_batch_map(entry, "alternate_kernels",
                                                                    i, "kernel names")))
        ladder = cls(tuple(buckets), data["max_model_len"], meta=data.get("meta"))
        ladder.check_alternates()
        return ladder

    def check_alternates(self) -> None:
        """ValueError unless every alternate kernel has a cost in ``meta["balanced_cost"]``
        (and the balanced kernel it is weighed against too), at every capture size."""
        if not any(b.alternate_kernels for b in self.buckets):
            return
        model = self.balanced_cost
        if model is None:
            raise ValueError("this ladder has alternate_kernels but no meta['balanced_cost'] "
                             "to choose between them; re-run scripts/tune_ladder.py or drop "
                             "the alternates")
        for i, b in enumerate(self.buckets):
            for size, alt in b.alternate_kernels:
                for kernel in filter(None, (alt, alt and b.balanced_kernel_for(size))):
                    if kernel not in model.costs:
                        raise ValueError(f"ladder bucket {i}: alternate_kernels[{size}] needs "
                                         f"the cost of {kernel!r}, which meta['balanced_cost']"
                                         f" lacks (it has {sorted(model.costs)})")

    @classmethod
    def from_json(cls, text: str) -> BucketLadder:
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str | Path) -> BucketLadder:
        return cls.from_json(Path(path).read_text())


def _json_batch_map(entry: Mapping[str, Any], key: str, index: int, what: str) -> dict:
    """A bucket's ``{"batch size": value}`` JSON object with int keys (empty if absent)."""
    raw = entry.get(key, {})
    if not isinstance(raw, Mapping):
        raise ValueError(f"ladder bucket {index}: {key!r} must map batch sizes to {what}, "
                         f"got {raw!r}")
    try:
        return {int(b): v for b, v in raw.items()}
    except ValueError:
        raise ValueError(f"ladder bucket {index}: {key!r} keys must be batch sizes, got "
                         f"{sorted(raw)}") from None


def above_top_error(length: int, max_model_len: int) -> ValueError:
    return ValueError(
        f"sequence length {length} is above the ladder top (max_model_len={max_model_len}); "
        "no captured graph covers it. Raise max_model_len or add a bucket above it, or cap "
        "the scheduler's lengths at max_model_len")


def default_ladder(max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> BucketLadder:
    """The field's buckets <=64, ..4K, ..16K, ..64K, ..max_model_len, each hinted at its top;
    ragged batches above 4K tokens take the balanced topology (``with_balanced_topology``).

    A plan made from a bucket's upper bound has enough splits for every length in the
    bucket (plans are monotone in the hint). Bounds at or above ``max_model_len`` are
    dropped and the last bucket ends at ``max_model_len``, so small models get fewer buckets.
    """
    max_model_len = as_int("max_model_len", max_model_len)
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    bounds = [b for b in DEFAULT_BOUNDS if b < max_model_len] + [max_model_len]
    return BucketLadder(
        tuple(Bucket(max_len=b, hint=b) for b in bounds),
        max_model_len,
        meta={"source": "default_ladder"},
    ).with_balanced_topology()
