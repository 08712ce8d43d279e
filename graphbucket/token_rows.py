"""Per-token row helpers shared by every Triton kernel that stores into a cache: which cache
slot a token row stores to, and its row of the rope table. A leaf module, so the model's
kernels and the sparse index prologue share one rule without importing each other.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def token_slot(SLOT, SEQ_LENS, t, q_len, num_slots):
    """Cache slot (int64) of token row t, query token t % q_len of request t // q_len, and
    whether the token stores there: padding (a slot below 0 or at / past ``num_slots``,
    or a request of seq_len 0) does not. One rule for every per-token cache store."""
    slot = tl.load(SLOT + t).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots) & (tl.load(SEQ_LENS + t // q_len) > 0)
    return slot, valid


@triton.jit
def rope_row(ROPE, POS, t, stride_rope, max_pos):
    """Token t's row of the rope table (cos halves, then sin halves), its position
    clamped to the table."""
    return ROPE + tl.minimum(tl.maximum(tl.load(POS + t), 0), max_pos - 1) * stride_rope
