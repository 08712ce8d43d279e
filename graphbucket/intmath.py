"""Integer arithmetic the planners share (a leaf: it imports nothing of the package)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def pow2_ceil(x: int) -> int:
    return 1 << (max(1, x) - 1).bit_length()
