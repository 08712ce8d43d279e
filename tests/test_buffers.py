from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from graphbucket.backends import get_backend
from graphbucket.batch import BatchValidator, DecodeBatch
from graphbucket.buffers import StaticBuffers
from graphbucket.spec import BufferSpec, InputSpec
from tests._toy import HIDDEN, toy_spec

pytestmark = pytest.mark.host  # the fast lane: no kernel launches

MAX_BS, MAX_PAGES = 4, 20


def make_buffers(device, *, slots=2) -> StaticBuffers:
    backend = get_backend("triton", num_sms=2, kv_lora_rank=64, qk_rope_dim=16)
    plans = [backend.plan(bs, 16, hint) for bs in (1, 2, 4) for hint in (1, 320)]
    return StaticBuffers.allocate(toy_spec(max_pages=MAX_PAGES, device=device),
                                  max_batch_size=MAX_BS, workspace=backend.workspace_spec(plans),
                                  num_staging_slots=slots)


def host_batch(lens, cols, *, seed=0, input_device="cpu"):
    rng = np.random.default_rng(seed)
    table = rng.integers(1, 64, size=(len(lens), cols), dtype=np.int32)
    hidden = torch.from_numpy(rng.standard_normal((len(lens), HIDDEN)).astype(np.float32))
    batch = DecodeBatch(list(lens), table, {"hidden": hidden.to(input_device)})
    return BatchValidator(toy_spec(max_pages=MAX_PAGES, device=input_device))(batch), batch


def static_tensors(buf: StaticBuffers) -> dict[str, torch.Tensor]:
    tensors = {"seq_lens": buf.seq_lens, "positions": buf.positions,
               "block_table": buf.block_table, "output": buf.output,
               "partial_o": buf.workspace.partial_o, "partial_lse": buf.workspace.partial_lse}
    tensors.update({f"input:{k}": v for k, v in buf.inputs.items()})
    return tensors


def test_allocation_is_typed_and_sized_for_the_worst_case(device):
    buf = make_buffers(device)
    assert buf.seq_lens.shape == (MAX_BS,) and buf.seq_lens.dtype == torch.int32
    assert buf.positions.shape == (MAX_BS,) and buf.positions.dtype == torch.int64
    assert buf.block_table.shape == (MAX_BS, MAX_PAGES) and buf.block_table.dtype == torch.int32
    assert buf.inputs["hidden"].shape == (MAX_BS, HIDDEN)
    assert buf.output.shape == (MAX_BS, HIDDEN) and buf.output.dtype == torch.float32
    backend = get_backend("triton", num_sms=2, kv_lora_rank=64, qk_rope_dim=16)
    max_splits = max(backend.plan(bs, 16, 320).num_kv_splits for bs in (1, 2, 4))
    assert buf.workspace.partial_o.shape == (MAX_BS, 16, max_splits, 64)
    assert all(t.device.type == torch.device(device).type for t in static_tensors(buf).values())
    assert buf.nbytes >= buf.output.numel() * 4 + buf.workspace.partial_o.numel() * 4


def test_seq_info_views_do_not_overlap(device):
    buf = make_buffers(device)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                   for t in (buf.seq_lens, buf.positions, buf.block_table, buf.inputs["hidden"]))
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))


def test_stage_copies_live_rows_and_pads_neutrally(device):
    buf = make_buffers(device)
    host, batch = host_batch([37, 5, 0], cols=3)
    buf.stage(host, padded_bs=4)
    assert buf.seq_lens.tolist() == [37, 5, 0, 0]
    assert buf.positions.tolist() == [36, 4, 0, 0]
    table = buf.block_table.cpu()
    assert torch.equal(table[:3, :3], torch.from_numpy(host.block_table))
    hidden = buf.inputs["hidden"].cpu()
    assert torch.equal(hidden[:3], batch.inputs["hidden"]) and not hidden[3].any()


def test_restaging_a_smaller_batch_leaves_nothing_a_kernel_reads(device):
    buf = make_buffers(device, slots=1)  # one slot: the same staging memory every time
    buf.stage(host_batch([300, 300, 300, 300], cols=19, seed=1)[0], padded_bs=4)
    host, _ = host_batch([20], cols=2, seed=2)
    buf.stage(host, padded_bs=2)
    table = buf.block_table.cpu()
    assert table[0, :2].tolist() == host.block_table[0].tolist()
    # Row 1 is padding (length 0: no page is read); stale entries are earlier valid pages.
    assert buf.seq_lens[:2].tolist() == [20, 0]
    assert table.min() >= 0 and table.max() < 64
    assert not buf.inputs["hidden"][1].any()


def test_static_addresses_never_change(device):
    buf = make_buffers(device)
    before = {k: (t.data_ptr(), t.shape) for k, t in static_tensors(buf).items()}
    staging = [t.data_ptr() for t in buf.staging_tensors()]
    for seed, lens in enumerate([[1], [300, 2, 3, 4], [64, 65], [0, 0, 1]]):
        host, _ = host_batch(lens, cols=max(1, -(-max(lens) // 16)), seed=seed)
        buf.stage(host, padded_bs=4 if len(lens) > 2 else 2)
    assert {k: (t.data_ptr(), t.shape) for k, t in static_tensors(buf).items()} == before
    assert [t.data_ptr() for t in buf.staging_tensors()] == staging


def test_context_views_share_the_static_storage(device):
    buf = make_buffers(device)
    backend = get_backend("dense", kv_lora_rank=64, qk_rope_dim=16)
    plan = backend.plan(2, 16, 1)
    ctx = buf.context(2, plan, backend, 0.1)
    assert ctx.plan is plan and ctx.batch_size == 2 and ctx.workspace is buf.workspace
    assert ctx.seq_lens.data_ptr() == buf.seq_lens.data_ptr() and ctx.seq_lens.shape == (2,)
    assert ctx.block_table.shape == (2, MAX_PAGES) and ctx.inputs["hidden"].shape == (2, HIDDEN)
    with pytest.raises(ValueError, match="outside"):
        buf.context(MAX_BS + 1, plan, backend, 0.1)


@pytest.mark.gpu
def test_staging_waits_for_a_slot_whose_copy_is_in_flight():
    buf = make_buffers("cuda", slots=2)
    host, _ = host_batch([5], cols=1)
    torch.cuda._sleep(2_000_000_000)  # keep the stream busy: no staged copy can land yet
    for _ in range(3):
        buf.stage(host, padded_bs=1)
    # Step 3 reuses slot 0, whose copy from step 1 is still queued: it must wait first.
    assert buf.staging_waits == 1
    torch.cuda.synchronize()
    assert buf.seq_lens[:1].tolist() == [5]


def test_close_releases_every_tensor():
    buf = make_buffers("cpu")
    buf.close()
    assert buf.workspace is None and buf.inputs == {} and buf.staging_tensors() == []
    assert buf.output.numel() == 0 and buf.seq_lens.numel() == 0


def test_spec_validation():
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        BufferSpec(max_pages_per_seq=4, num_pages=4, page_size=0, num_heads=16,
                   output_shape=(4,), output_dtype=torch.float32)
    with pytest.raises(ValueError, match="repeats a name"):
        BufferSpec(max_pages_per_seq=4, num_pages=4, page_size=16, num_heads=16,
                   output_shape=(4,), output_dtype=torch.float32,
                   inputs=(InputSpec("x", (1,), torch.int64), InputSpec("x", (2,), torch.int64)))


@pytest.mark.gpu
def test_staging_memory_is_pinned_and_device_inputs_copy_directly():
    buf = make_buffers("cuda")
    assert all(t.is_pinned() for t in buf.staging_tensors())
    host, batch = host_batch([40, 3], cols=3, input_device="cuda")
    buf.stage(host, padded_bs=4)
    torch.cuda.synchronize()
    assert torch.equal(buf.inputs["hidden"][:2], batch.inputs["hidden"])
    assert not buf.inputs["hidden"][2:].any()
    # A graph's own copy would overwrite them: refused before anything is staged.
    with pytest.raises(ValueError, match="device inputs cannot leave its copy to the graph"):
        buf.stage(host, padded_bs=4, in_graph=True)


def _expected_seq_info(host, padded_bs: int) -> dict[str, np.ndarray]:
    """Rows [0, padded_bs) of seq_info as a from-scratch stage would leave them (the block
    table: only the entries kernels read, each row's live pages)."""
    bs = host.batch_size
    lens = np.zeros(padded_bs, np.int32)
    lens[:bs] = host.seq_lens
    positions = np.zeros(padded_bs, np.int64)
    positions[:bs] = np.maximum(host.seq_lens.astype(np.int64) - 1, 0)
    hidden = np.zeros((padded_bs, HIDDEN), np.float32)
    hidden[:bs] = host.inputs["hidden"].numpy()
    return {"seq_lens": lens, "positions": positions, "hidden": hidden}


def _live_pages(table: np.ndarray, lens: np.ndarray, page: int = 16) -> list[list[int]]:
    return [row[: -(-int(n) // page)].tolist() for row, n in zip(table, lens, strict=False)]


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_random_restaging_matches_a_fresh_stage_every_step(slots):
    # Staging zeroes only what earlier stages of the same slot left behind; whatever the
    # order of wide/narrow and large/small batches, what the kernels read of rows
    # [0, padded) must come out exactly as if the staging memory had been zero, and every
    # block-table entry must name a page of the cache.
    buf = make_buffers("cpu", slots=slots)
    rng = np.random.default_rng(slots)
    for step in range(200):
        bs = int(rng.integers(1, MAX_BS + 1))
        lens = rng.integers(0, MAX_PAGES * 16 + 1, size=bs).tolist()
        host, _ = host_batch(lens, cols=max(1, -(-max(lens) // 16)), seed=step)
        padded = int(rng.integers(bs, MAX_BS + 1))
        buf.stage(host, padded_bs=padded)
        want = _expected_seq_info(host, padded)
        got = {"seq_lens": buf.seq_lens[:padded].numpy(),
               "positions": buf.positions[:padded].numpy(),
               "hidden": buf.inputs["hidden"][:padded].numpy()}
        for name, value in want.items():
            assert np.array_equal(got[name], value), (step, name, lens, padded)
        staged = buf.block_table.numpy()
        bs = host.batch_size
        assert _live_pages(staged[:bs], got["seq_lens"]) == _live_pages(host.block_table,
                                                                        host.seq_lens)
        assert staged.min() >= 0 and staged.max() < 64, step


def test_unsigned_lengths_with_padding_rows_stage_position_zero():
    buf = make_buffers("cpu")
    batch = DecodeBatch(np.array([0, 17], np.uint32), np.array([[1, 2], [3, 4]], np.int32),
                        {"hidden": torch.zeros(2, HIDDEN)})
    buf.stage(BatchValidator(toy_spec(max_pages=MAX_PAGES))(batch), padded_bs=2)
    assert buf.positions[:2].tolist() == [0, 16] and buf.seq_lens[:2].tolist() == [0, 17]


def test_bfloat16_inputs_are_staged_bit_for_bit():
    spec = BufferSpec(max_pages_per_seq=4, num_pages=8, page_size=16, num_heads=16,
                      output_shape=(4,), output_dtype=torch.bfloat16,
                      inputs=(InputSpec("h", (3,), torch.bfloat16),
                              InputSpec("ids", (), torch.int64)))
    backend = get_backend("dense", kv_lora_rank=64, qk_rope_dim=16)
    buf = StaticBuffers.allocate(spec, max_batch_size=2,
                                 workspace=backend.workspace_spec([backend.plan(2, 16, 1)]))
    h = torch.randn(1, 3).to(torch.bfloat16)
    batch = DecodeBatch([5], np.zeros((1, 1), np.int32), {"h": h, "ids": torch.tensor([7])})
    buf.stage(BatchValidator(spec)(batch), padded_bs=2)
    assert torch.equal(buf.inputs["h"][0], h[0]) and not buf.inputs["h"][1].any()
    assert buf.inputs["ids"].tolist() == [7, 0]


# ---- multi-token steps: per-token rows -------------------------------------------------


def verify_batch(lens, q_len, cols, *, seed=0, max_q_len=2):
    rng = np.random.default_rng(seed)
    table = rng.integers(1, 64, size=(len(lens), cols), dtype=np.int32)
    hidden = torch.from_numpy(rng.standard_normal((len(lens) * q_len, HIDDEN)
                                                  ).astype(np.float32))
    batch = DecodeBatch(list(lens), table, {"hidden": hidden}, q_len=q_len)
    return BatchValidator(toy_spec(max_pages=MAX_PAGES), max_q_len=max_q_len)(batch), batch


def test_verify_steps_stage_one_row_per_token_and_zero_the_rest():
    backend = get_backend("triton", num_sms=2, kv_lora_rank=64, qk_rope_dim=16)
    plans = [backend.plan(bs, 16 * q, 320) for bs in (1, 2, 4) for q in (1, 2)]
    buf = StaticBuffers.allocate(toy_spec(max_pages=MAX_PAGES), max_batch_size=MAX_BS,
                                 workspace=backend.workspace_spec(plans), num_staging_slots=1,
                                 max_q_len=2)
    assert buf.positions.shape == (2 * MAX_BS,) and buf.seq_lens.shape == (MAX_BS,)
    assert buf.inputs["hidden"].shape == buf.output.shape == (2 * MAX_BS, HIDDEN)
    assert buf.workspace.partial_o.shape[1] == 32  # the q_len 2 plans' rows
    host, batch = verify_batch([37, 5, 0, 9], 2, cols=3)
    buf.stage(host, padded_bs=4)
    assert buf.seq_lens.tolist() == [37, 5, 0, 9]
    assert buf.positions.tolist() == [35, 36, 3, 4, 0, 0, 7, 8]
    assert torch.equal(buf.inputs["hidden"], batch.inputs["hidden"])
    # A plain step of one request afterwards: its padded batch (2) reads rows 0..1 only,
    # and they hold its token and zeros.
    host, batch = host_batch([20], cols=2, seed=3)
    buf.stage(BatchValidator(toy_spec(max_pages=MAX_PAGES), max_q_len=2)(batch), padded_bs=2)
    assert buf.seq_lens[:2].tolist() == [20, 0] and buf.positions[:2].tolist() == [19, 0]
    assert torch.equal(buf.inputs["hidden"][0], batch.inputs["hidden"][0])
    assert not buf.inputs["hidden"][1].any()
    ctx = buf.context(2, plans[1], backend, 0.1, q_len=2)
    assert ctx.q_len == 2 and ctx.positions.shape == (4,) and ctx.seq_lens.shape == (2,)
    assert ctx.inputs["hidden"].shape == (4, HIDDEN)
    with pytest.raises(ValueError, match="q_len 3 outside"):
        buf.context(2, plans[1], backend, 0.1, q_len=3)


def test_validator_checks_q_len_lengths_and_per_token_shapes():
    host, _ = verify_batch([37, 0, 2], 2, cols=3)
    assert host.q_len == 2 and host.batch_size == 3 and host.min_len == 0
    with pytest.raises(ValueError, match=r"seq_lens_cpu\[2\] = 1 is below q_len 2"):
        verify_batch([37, 0, 1], 2, cols=3)
    with pytest.raises(ValueError, match="above the largest captured q_len 2"):
        verify_batch([37], 4, cols=3)
    validate = BatchValidator(toy_spec(max_pages=MAX_PAGES), max_q_len=2)
    table = np.ones((2, 3), np.int32)
    with pytest.raises(ValueError, match=r"expected \(4, 32\) \(batch x q_len"):
        validate(DecodeBatch([30, 7], table, {"hidden": torch.zeros(2, HIDDEN)}, q_len=2))
    hidden = {"hidden": torch.zeros(4, HIDDEN)}
    with pytest.raises(ValueError, match="one per query token"):
        validate(DecodeBatch([30, 7], table, hidden, positions_cpu=[29, 6], q_len=2))
    with pytest.raises(ValueError, match=r"positions_cpu\[3\] = 7 is outside \[0, seq_len=7\)"):
        validate(DecodeBatch([30, 7], table, hidden, positions_cpu=[28, 29, 6, 7], q_len=2))
    ok = validate(DecodeBatch([30, 7], table, hidden, positions_cpu=[28, 29, 5, 6], q_len=2))
    assert ok.positions.tolist() == [28, 29, 5, 6]
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(ValueError, match="positive int"):
            validate(DecodeBatch([30, 7], table, hidden, q_len=bad))
