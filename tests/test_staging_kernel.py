"""The slot-copy kernel: every word copied, the ticket handed back once, the counter reset."""

from __future__ import annotations

import pytest
import torch

from graphbucket import get_backend
from graphbucket.buffers import StaticBuffers
from graphbucket.kernels.staging import WORDS_PER_PROGRAM, launch_copy_slot
from tests._toy import toy_spec


@pytest.mark.interpreter  # CPU tensors: the GPU case is the pinned-slot test below
@pytest.mark.parametrize("words", [1, WORDS_PER_PROGRAM, 2 * WORDS_PER_PROGRAM + 37])
def test_the_copy_kernel_copies_every_word_and_hands_the_ticket_back(words, seeded):
    gen = torch.Generator().manual_seed(seeded)
    counter = torch.zeros(1, dtype=torch.int32)
    done = torch.zeros(1, dtype=torch.int64)
    for ticket in (7, 8):  # twice: the counter must be back at zero after each launch
        src = torch.randint(-2**62, 2**62, (words,), generator=gen, dtype=torch.int64)
        src[0] = ticket
        dst = torch.zeros(words, dtype=torch.int64)
        launch_copy_slot(src, dst, counter, done)
        assert torch.equal(dst, src)
        assert int(done[0]) == ticket and int(counter[0]) == 0


@pytest.mark.gpu
def test_gpu_the_copy_kernel_reads_a_pinned_slot():
    src = torch.randint(-2**62, 2**62, (3000,), dtype=torch.int64).pin_memory()
    src[0] = 5
    dst = torch.zeros(3000, dtype=torch.int64, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    done = torch.zeros(1, dtype=torch.int64).pin_memory()
    launch_copy_slot(src, dst, counter, done)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), src) and int(done[0]) == 5 and int(counter.item()) == 0


@pytest.mark.gpu
def test_gpu_static_buffers_pick_the_copy_kernel():
    spec = toy_spec(device="cuda")
    be = get_backend("dense", kv_lora_rank=64, qk_rope_dim=16)
    buffers = StaticBuffers.allocate(spec, max_batch_size=2,
                                     workspace=be.workspace_spec([be.plan(2, 16, 64)]))
    assert buffers.slot_copy_kind == "kernel"


@pytest.mark.gpu
def test_gpu_static_buffers_keep_the_memcpy_node_when_asked():
    spec = toy_spec(device="cuda")
    be = get_backend("dense", kv_lora_rank=64, qk_rope_dim=16)
    buffers = StaticBuffers.allocate(spec, max_batch_size=2, copy_kernel=False,
                                     workspace=be.workspace_spec([be.plan(2, 16, 64)]))
    assert buffers.slot_copy_kind == "memcpy"
