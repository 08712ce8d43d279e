"""The first node of a graph that copies its own staging slot: a kernel, not a memcpy.

A captured host-to-device memcpy node and an event node make the graph's launch cost the
host more than a graph of kernels alone, so a slot's graph copies the slot with this kernel
instead: it reads the pinned slot through its device-visible address (pinned memory is
mapped under unified addressing) and writes the device arena. The slot's first word is a
ticket the host writes before the replay; the program that finishes last (a device
counter) writes the ticket back to the slot's pinned ``done`` word, which tells the host
that the slot may be rewritten without an event call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WORDS_PER_PROGRAM = 1024  # int64 words: 8 KiB a program


@triton.jit
def copy_slot_kernel(src, dst, n_words, counter, done, WORDS: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * WORDS + tl.arange(0, WORDS)
    mask = offs < n_words
    tl.store(dst + offs, tl.load(src + offs, mask=mask, volatile=True), mask=mask)
    # Every thread's loads have returned (their values were stored) before the arrival.
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        tl.store(counter, 0)
        tl.store(done, tl.load(src, volatile=True))  # the ticket, word 0 of the slot


def launch_copy_slot(src: torch.Tensor, dst: torch.Tensor, counter: torch.Tensor,
                     done: torch.Tensor) -> None:
    """Copy int64 words ``src`` (pinned host) -> ``dst`` (device), then ``done[0] <- src[0]``
    once every word has been read. ``counter``: one device int32, zero between launches."""
    n = src.numel()
    copy_slot_kernel[(triton.cdiv(n, WORDS_PER_PROGRAM),)](
        src, dst, n, counter, done, WORDS=WORDS_PER_PROGRAM)
