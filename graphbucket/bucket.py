"""One context bucket: the lengths it serves and the hints its graphs are planned with.

``Bucket`` is the unit a ``graphbucket.ladder.BucketLadder`` is made of; values that step
with the padded batch size (hints, balanced thresholds) are stored as sorted
``(batch_size, value)`` pairs and read with ``value_for_batch``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_BALANCED_KERNEL = "default"  # the backend's own choice of balanced plan


def as_int(name: str, value: object) -> int:
    # bool is an int subclass; a True hint is a caller mistake, not the length 1.
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


@dataclass(frozen=True, slots=True)
class Bucket:
    """Lengths ``(previous max_len, max_len]``; graphs are planned with ``hint``.

    ``batch_hints``: ``{batch_size: hint}`` (or pairs); a graph of padded batch size ``n``
    is planned with the hint of the largest listed batch size ``<= n``, and with ``hint``
    below the smallest. Stored as sorted ``(batch_size, hint)`` pairs.

    ``balanced_imbalance``: 0 (never), or the imbalance ``max_len x live / total`` (1.0 for
    a uniform batch) from which a batch of this bucket runs the balanced topology; exactly
    1.0 means every batch of one query token, uniform and single-request ones included
    (the ``balanced-only`` policy). ``batch_imbalance``: ``{batch_size: threshold}`` (or
    pairs), from that padded batch size up, as ``batch_hints`` are for hints
    (``imbalance_for``).

    ``balanced_kernels``: ``{batch_size: kernel}`` (or pairs): from that padded batch size
    up, this bucket's balanced graphs are planned with that kernel of the backend
    (``DecodeBackend.plan_balanced(..., kernel=)``); below the smallest, and without any,
    with ``DEFAULT_BALANCED_KERNEL`` (``balanced_kernel_for``). ``alternate_kernels``:
    ``{batch_size: kernel}`` (or pairs; ``""``: none from there), a second balanced graph
    per capture size, replayed where the ladder's cost model
    (``graphbucket.balanced_cost``) predicts it faster for the step's lengths
    (``alternate_kernel_for``).
    """

    max_len: int
    hint: int
    batch_hints: tuple[tuple[int, int], ...] = ()
    balanced_imbalance: float = 0.0
    batch_imbalance: tuple[tuple[int, float], ...] = ()
    balanced_kernels: tuple[tuple[int, str], ...] = ()
    alternate_kernels: tuple[tuple[int, str], ...] = ()

    def __post_init__(self) -> None:
        # Normalise numpy / torch integers to int so buckets hash, compare and serialise
        # the same whatever produced them.
        object.__setattr__(self, "max_len", as_int("Bucket.max_len", self.max_len))
        object.__setattr__(self, "hint", as_int("Bucket.hint", self.hint))
        object.__setattr__(self, "batch_hints", self._pairs())
        for name, h in (("hint", self.hint),
                        *((f"batch_hints[{b}]", h) for b, h in self.batch_hints)):
            if h < 1:
                raise ValueError(
                    f"Bucket(max_len={self.max_len}) has {name}={h}; a hint is a context "
                    "length the kernel plans with and must be >= 1 (use the bucket's max_len)"
                )
        object.__setattr__(self, "balanced_imbalance",
                           self._threshold("balanced_imbalance", self.balanced_imbalance))
        object.__setattr__(self, "batch_imbalance", self._thresholds())
        object.__setattr__(self, "balanced_kernels", self._by_batch(
            "balanced_kernels", self.balanced_kernels, "kernel names", _kernel_name,
            TypeError))
        object.__setattr__(self, "alternate_kernels", self._by_batch(
            "alternate_kernels", self.alternate_kernels, "kernel names (or '')",
            _alternate_name, TypeError))
        for size, alt in self.alternate_kernels:
            if alt and alt == self.balanced_kernel_for(size):
                raise ValueError(f"Bucket(max_len={self.max_len}).alternate_kernels[{size}] is "
                                 f"{alt!r}, the balanced kernel itself at that batch size; an "
                                 "alternate must be another kernel (or '' for none)")

    def _threshold(self, name: str, threshold: object) -> float:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (
                threshold == 0 or threshold >= 1):
            raise ValueError(
                f"Bucket(max_len={self.max_len}).{name}={threshold!r}: use 0 "
                "(never balanced), 1 (always) or a number > 1 (a uniform batch has "
                "imbalance 1.0)")
        return float(threshold)

    def _thresholds(self) -> tuple[tuple[int, float], ...]:
        return self._by_batch("batch_imbalance", self.batch_imbalance, "thresholds",
                              lambda b, t: self._threshold(f"batch_imbalance[{b}]", t),
                              TypeError)

    def _by_batch(self, name: str, raw: Any, what: str, value_of: Any,
                  errors: type[Exception] | tuple[type[Exception], ...]
                  ) -> tuple[tuple[int, Any], ...]:
        """``{batch_size: value}`` (or pairs) as sorted pairs, each value through
        ``value_of(batch_size, value)``; ``errors`` from it become a TypeError naming ``name``."""
        items = raw.items() if isinstance(raw, Mapping) else raw
        try:
            pairs = [(as_int(f"{name} batch size", b), value_of(b, v)) for b, v in items]
        except errors as err:
            raise TypeError(f"Bucket(max_len={self.max_len}).{name} must map batch sizes to "
                            f"{what}, got {raw!r}: {err}") from None
        sizes = [b for b, _ in pairs]
        if len(set(sizes)) != len(sizes) or any(b < 1 for b in sizes):
            raise ValueError(f"Bucket(max_len={self.max_len}).{name} needs distinct batch "
                             f"sizes >= 1, got {sorted(sizes)}")
        return tuple(sorted(pairs))

    def imbalance_for(self, batch_size: int) -> float:
        """The balanced threshold of a graph of ``batch_size`` (padded) rows (0: never)."""
        return value_for_batch(self.batch_imbalance, self.balanced_imbalance, batch_size)

    @property
    def has_balanced(self) -> bool:
        """Whether some batch size of this bucket replays a balanced graph."""
        return bool(self.balanced_imbalance or any(t for _, t in self.batch_imbalance))

    def _pairs(self) -> tuple[tuple[int, int], ...]:
        return self._by_batch("batch_hints", self.batch_hints, "hints",
                              lambda b, h: as_int("batch_hints hint", h),
                              (TypeError, ValueError))

    def balanced_kernel_for(self, batch_size: int) -> str:
        """The backend kernel a balanced graph of ``batch_size`` (padded) rows runs."""
        return value_for_batch(self.balanced_kernels, DEFAULT_BALANCED_KERNEL, batch_size)

    def alternate_kernel_for(self, batch_size: int) -> str | None:
        """The second balanced kernel of ``batch_size`` (padded) rows, or None."""
        return value_for_batch(self.alternate_kernels, "", batch_size) or None

    def hint_for(self, batch_size: int) -> int:
        """The hint a graph of ``batch_size`` (padded) rows is planned with."""
        return value_for_batch(self.batch_hints, self.hint, batch_size)

    def all_hints(self) -> tuple[int, ...]:
        return (self.hint, *(h for _, h in self.batch_hints))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"max_len": self.max_len, "hint": self.hint}
        if self.batch_hints:
            out["batch_hints"] = {str(b): h for b, h in self.batch_hints}
        if self.balanced_imbalance:
            out["balanced_imbalance"] = self.balanced_imbalance
        if self.batch_imbalance:
            out["batch_imbalance"] = {str(b): t for b, t in self.batch_imbalance}
        if self.balanced_kernels:
            out["balanced_kernels"] = {str(b): k for b, k in self.balanced_kernels}
        if self.alternate_kernels:
            out["alternate_kernels"] = {str(b): k for b, k in self.alternate_kernels}
        return out

    def __repr__(self) -> str:
        extra = f", batch_hints={dict(self.batch_hints)}" if self.batch_hints else ""
        if self.balanced_imbalance:
            extra += f", balanced_imbalance={self.balanced_imbalance:g}"
        if self.batch_imbalance:
            extra += f", batch_imbalance={dict(self.batch_imbalance)}"
        if self.balanced_kernels:
            extra += f", balanced_kernels={dict(self.balanced_kernels)}"
        if self.alternate_kernels:
            extra += f", alternate_kernels={dict(self.alternate_kernels)}"
        return f"Bucket(max_len={self.max_len}, hint={self.hint}{extra})"


def value_for_batch(pairs: tuple[tuple[int, Any], ...], default: Any, batch_size: int) -> Any:
    """The value of the largest listed batch size <= ``batch_size`` (``default`` below the
    smallest): how ``batch_hints`` and ``batch_imbalance`` step with the batch."""
    value = default
    for size, v in pairs:
        if size > batch_size:
            break
        value = v
    return value


def _kernel_name(batch_size: int, kernel: object) -> str:
    if not isinstance(kernel, str) or not kernel:
        raise TypeError(f"balanced_kernels[{batch_size}] must be a kernel name (str), got "
                        f"{kernel!r}")
    return kernel


def _alternate_name(batch_size: int, kernel: object) -> str:
    if not isinstance(kernel, str):
        raise TypeError(f"alternate_kernels[{batch_size}] must be a kernel name or '' (none), "
                        f"got {kernel!r}")
    return kernel


def kernel_changes(by_batch: Mapping[int, str] | Iterable[tuple[int, str]],
                   start: str = DEFAULT_BALANCED_KERNEL) -> tuple[tuple[int, str], ...]:
    """``{batch: kernel}`` (or pairs) as the batch sizes from which the kernel changes,
    starting from ``start`` (``DEFAULT_BALANCED_KERNEL``; ``""`` for alternates): entries
    that change nothing from the size below are dropped."""
    items = by_batch.items() if isinstance(by_batch, Mapping) else by_batch
    out, last = [], start
    for batch, kernel in sorted(items):
        if kernel != last:
            out.append((batch, kernel))
            last = kernel
    return tuple(out)
