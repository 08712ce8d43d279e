"""Round-to-nearest-even float32 casts in Triton, the same on the GPU and in the interpreter.

Triton's interpreter rounds float32 -> e4m3 wrongly when the mantissa carries into the
exponent, and truncates float32 -> bfloat16. These helpers round arithmetically (ties to
even) and return float32, so the cast that follows is exact everywhere and the CPU tests
run the GPU's code: on the GPU the result is what the hardware's RNE cast (and torch's)
gives.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_e4m3(x):
    """float32 x (|x| <= 448) rounded to the nearest e4m3 number, still float32."""
    bits = x.to(tl.int32, bitcast=True)
    # normal range: keep 3 mantissa bits (round half to even on bit 20)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # below 2^-6 (subnormal e4m3): multiples of 2^-9, the float32 spacing at 1.5 * 2^14;
    # rounded in magnitude and signed after, so that what rounds to zero keeps its sign
    # (-0, as the hardware's and torch's cast give)
    magnitude = (tl.abs(x) + 24576.0) - 24576.0
    subnormal = (magnitude.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(
        tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """float32 x rounded to the nearest DTYPE number (bfloat16 arithmetically, keeping 7
    mantissa bits; other dtypes by their cast), returned as DTYPE."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)
    return x.to(DTYPE)
