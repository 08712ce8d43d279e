"""``GraphKey``: which graph serves a decode step, the one key type of runners and engines.

No ``from __future__ import annotations`` here, unlike the rest of the package: a named
tuple keeps its fields' annotations, and postponed evaluation would leave them as strings
(``typing.ForwardRef('int')``) for anything that reads ``GraphKey.__annotations__``.
"""

from typing import NamedTuple


class GraphKey(NamedTuple):
    """One graph slot: ``batch_size`` rows (padded), ``bucket`` of the ladder, planned
    with ``hint`` (split-KV) or, with ``balanced``, as balanced split-KV. Keys whose plans
    are equal share one captured graph. A named tuple: immutable, and hashed in C (a step
    hashes its key three times). ``q_len``: query tokens per request (1: plain decode).
    ``alternate``: a balanced graph planned with its bucket's second balanced kernel
    (``Bucket.alternate_kernels``)."""

    batch_size: int
    bucket: int
    hint: int
    balanced: bool = False
    q_len: int = 1
    alternate: bool = False
