"""BlockTable: the verbs and their checks, the staged changes, and runner steps that carry it
against the full-table path over random admit / append / retire schedules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphbucket import DecodeBatch, GraphBucketRunner, get_backend
from graphbucket.block_table import BlockTable
from tests._toy import LADDER, NUM_SMS, PAGE, ToyMLA, rel_l2, toy_reference, toy_spec

SM_SCALE = 0.125
MAX_PAGES, NUM_PAGES, TOP = 20, 64, 320


def table_of(rows=4) -> BlockTable:
    return BlockTable(toy_spec(max_pages=MAX_PAGES, num_pages=NUM_PAGES), rows)


def snapshot(t: BlockTable):
    return (t.table.copy(), t.counts.copy(), t._tokens.copy(), t._lo.copy(), t._hi.copy(),
            list(t._dirty_rows))


def drain(t: BlockTable, capacity=1000):
    index, value = np.zeros(capacity, np.int64), np.zeros(capacity, np.int32)
    n, whole = t.changes(index, value, MAX_PAGES)
    return dict(zip(index[:n].tolist(), value[:n].tolist(), strict=True)), whole


# ---- the table on its own (host only) ---------------------------------------------------

@pytest.mark.host
def test_verbs_keep_pages_and_counts():
    t = table_of()
    t.assign(1, [5, 6, 7])
    t.append(1, np.array([8], np.int32))
    t.append_rows([0, 1], [9, 10])
    assert t.pages(1).tolist() == [5, 6, 7, 8, 10] and t.pages(0).tolist() == [9]
    assert t.page_counts.tolist() == [1, 5, 0, 0]
    t.release(1)
    assert t.pages(1).tolist() == [] and t.page_counts.tolist() == [1, 0, 0, 0]
    t.assign(1, torch.tensor([3]))
    assert t.pages(1).tolist() == [3]
    with pytest.raises(ValueError):
        t.page_counts[0] = 7  # read-only views
    with pytest.raises(ValueError):
        t.pages(1)[0] = 7


@pytest.mark.host
def test_changes_are_what_was_written_since_the_last_drain():
    t = table_of()
    t.assign(2, [1, 2, 3])
    t.append(2, [4])
    t.append_rows([0, 2], [11, 12])
    assert drain(t) == ({0: 11, 40: 1, 41: 2, 42: 3, 43: 4, 44: 12}, [])
    assert drain(t) == ({}, [])  # drained
    t.append(2, [5])
    t.assign(3, [7, 8])
    t.assign(3, [9])  # a reused slot: the later request wins, the stale column 1 is not sent
    t.release(0)
    assert drain(t) == ({45: 5, 60: 9}, [])


@pytest.mark.host
def test_changes_beyond_capacity_come_back_as_whole_rows():
    t = table_of()
    t.assign(0, list(range(10)))
    t.assign(3, list(range(20, 26)))
    t.append_rows([1, 2], [40, 41])
    listed, whole = drain(t, capacity=8)
    assert whole == [(0, 0, 10)]  # the widest row goes whole; the rest fits the list
    assert listed == {20: 40, 40: 41, **{60 + c: 20 + c for c in range(6)}}
    t.assign(0, list(range(10)))
    t.assign(1, list(range(10)))
    listed, whole = drain(t, capacity=4)
    assert (listed, whole) == ({}, [(0, 0, 10), (1, 0, 10)])


@pytest.mark.host
@pytest.mark.parametrize("seed", range(6))
def test_a_mirror_fed_only_the_changes_holds_every_live_page(seed):
    """Random verbs over more rows than the scalar paths take (few and many rows per call,
    few and many dirty rows per drain, lists that overflow), each drain applied to a
    mirror as the device applies it: listed entries scattered, whole rows copied."""
    rng = np.random.default_rng(seed)
    rows = 40
    t = BlockTable(toy_spec(max_pages=MAX_PAGES, num_pages=NUM_PAGES), rows)
    mirror = np.full((rows, MAX_PAGES), -1, np.int64)
    for _ in range(60):
        for _ in range(int(rng.integers(0, 6))):
            verb = rng.random()
            row = int(rng.integers(rows))
            if verb < 0.3:
                t.assign(row, rng.integers(0, NUM_PAGES, size=int(rng.integers(0, 12))))
            elif verb < 0.5 and t.page_counts[row] < MAX_PAGES - 3:
                t.append(row, rng.integers(0, NUM_PAGES, size=int(rng.integers(0, 3))))
            elif verb < 0.6:
                t.release(row)
            else:
                room = np.flatnonzero(t.page_counts < MAX_PAGES)
                k = int(rng.choice([1, 3, 20, room.size]))
                chosen = rng.permutation(room)[:k]
                t.append_rows(chosen, rng.integers(0, NUM_PAGES, size=chosen.size))
        capacity = int(rng.choice([2, 8, 1000]))
        index, value = np.zeros(capacity, np.int64), np.zeros(capacity, np.int32)
        n, whole = t.changes(index, value, MAX_PAGES)
        assert len(set(index[:n].tolist())) == n  # a scatter needs distinct indices
        mirror.reshape(-1)[index[:n]] = value[:n]
        for row, lo, hi in whole:
            mirror[row, lo:hi] = t.table[row, lo:hi]
        for row in range(rows):
            live = int(t.page_counts[row])
            assert mirror[row, :live].tolist() == t.pages(row).tolist(), (row, live)
        assert t.changes(index, value, MAX_PAGES) == (0, [])  # drained


BAD_VERBS = {
    "page outside the cache": (lambda t: t.append(1, [3, NUM_PAGES]), ValueError,
                               r"pages\[1\] = 64 points outside the KV cache"),
    "negative page": (lambda t: t.append_rows([0, 1], [2, -1]), ValueError, "outside the KV"),
    "int64 page wraps": (lambda t: t.assign(0, np.array([2**32 + 1], np.int64)), ValueError,
                         "outside the KV"),
    "row full": (lambda t: t.append(1, list(range(MAX_PAGES - 2))), ValueError,
                 "max_pages_per_seq=20"),
    "assign too long": (lambda t: t.assign(2, [0] * (MAX_PAGES + 1)), ValueError, "at most"),
    "row outside": (lambda t: t.append(4, [1]), ValueError, r"row 4 is outside"),
    "rows outside": (lambda t: t.append_rows([0, 9], [1, 1]), ValueError, "row 9"),
    "repeated row": (lambda t: t.append_rows([1, 1], [1, 2]), ValueError, "a row twice"),
    "rows and pages differ": (lambda t: t.append_rows([0, 1], [1]), ValueError, "one page"),
    "float pages": (lambda t: t.append(1, [1.0]), TypeError, "dtype float64"),
    "bool row": (lambda t: t.release(True), TypeError, "row must be an int"),
    "2-d pages": (lambda t: t.assign(0, [[1, 2]]), ValueError, "one dimension"),
}


@pytest.mark.host
@pytest.mark.parametrize("case", list(BAD_VERBS))
def test_a_rejected_verb_leaves_the_table_as_it_was(case):
    t = table_of()
    t.assign(1, [5, 6, 7])
    t.append_rows([0], [1])
    before = snapshot(t)
    verb, exc, match = BAD_VERBS[case]
    with pytest.raises(exc, match=match):
        verb(t)
    after = snapshot(t)
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


# ---- runner steps: BlockTable against the full-table path -------------------------------

def runner_for(model, device, *, backend="dense", sizes=(1, 2, 4), **kw):
    be = get_backend(backend, num_sms=NUM_SMS, kv_lora_rank=64, qk_rope_dim=16)
    runner = GraphBucketRunner(model, spec=toy_spec(max_pages=MAX_PAGES, device=device),
                               batch_sizes=list(sizes), ladder=LADDER, sm_scale=SM_SCALE,
                               backend=be, warmup_iters=int(device == "cuda"),
                               progress=False, **kw)
    runner.capture()
    return runner


class Scheduler:
    """Random admit / decode / retire over the batch slots of ``table``, with the engine's
    own view of lengths; ``step_lens`` gives the lengths of the next decode step."""

    def __init__(self, table: BlockTable, rng: np.random.Generator) -> None:
        self.table, self.rng = table, rng
        self.lens = np.zeros(table.num_rows, np.int64)

    def admit(self, row: int) -> None:
        n = int(self.rng.integers(1, TOP - 20))
        pages = self.rng.integers(0, NUM_PAGES, size=-(-n // PAGE))
        self.table.assign(row, pages)
        self.lens[row] = n

    def advance(self) -> list[int]:
        """Every live request gains one token (its page first when it needs one); some
        retire, some free slots admit; returns this step's lengths (slots up to the last
        live one; free ones 0)."""
        live = np.flatnonzero(self.lens)
        grow = live[self.lens[live] % PAGE == 0]  # the next token opens a new page
        if grow.size == 1:
            self.table.append(int(grow[0]), [int(self.rng.integers(NUM_PAGES))])
        elif grow.size:
            self.table.append_rows(grow, self.rng.integers(0, NUM_PAGES, size=grow.size))
        self.lens[live] += 1
        for row in range(self.table.num_rows):
            if self.lens[row] and (self.lens[row] >= TOP or self.rng.random() < 0.04):
                self.table.release(row)
                self.lens[row] = 0
            elif not self.lens[row] and self.rng.random() < 0.3:
                self.admit(row)
        if not self.lens.any():
            self.admit(int(self.rng.integers(self.table.num_rows)))
        return self.lens[:int(np.flatnonzero(self.lens)[-1]) + 1].tolist()


def full_batch(table: BlockTable, lens, hidden) -> DecodeBatch:
    cols = max(1, -(-max(lens) // PAGE))
    return DecodeBatch(lens, table.table[:len(lens), :cols].copy(), {"hidden": hidden})


def live_entries(device_table: torch.Tensor, lens) -> list[list[int]]:
    rows = device_table.cpu().numpy()
    return [rows[b, :-(-n // PAGE)].tolist() for b, n in enumerate(lens)]


def run_schedule(device, steps, *, seed, backend="dense", max_table_changes=None,
                 bad_every=0):
    model = ToyMLA(device=device)
    full = runner_for(model, device, backend=backend)
    inc = runner_for(model, device, backend=backend, max_table_changes=max_table_changes)
    rng = np.random.default_rng(seed)
    sched = Scheduler(inc.block_table, rng)
    for step in range(steps):
        lens = sched.advance()
        if bad_every and step % bad_every == 0:
            before = snapshot(inc.block_table)
            with pytest.raises(ValueError, match="outside the KV cache"):
                inc.block_table.append(0, [1, NUM_PAGES + step])
            assert all(np.array_equal(a, b) for a, b in
                       zip(before, snapshot(inc.block_table), strict=True))
        hidden = torch.from_numpy(rng.standard_normal((len(lens), 32)).astype(np.float32))
        want = full.step(full_batch(inc.block_table, lens, hidden)).clone()
        got = inc.step(DecodeBatch(lens, inc.block_table, {"hidden": hidden})).clone()
        assert live_entries(inc.buffers.block_table, lens) == live_entries(
            full.buffers.block_table, lens) == [inc.block_table.pages(b)[:-(-n // PAGE)]
                                                .tolist() for b, n in enumerate(lens)], step
        assert torch.equal(got, want), (step, lens)
    stats = inc.stats()
    assert stats.steps == steps and stats.errors == 0 and stats.eager_fallbacks == 0
    return model, full, inc


def test_block_table_steps_match_the_full_table_path_over_random_schedules(device):
    run_schedule(device, 300, seed=0, bad_every=37)


def test_block_table_steps_with_a_small_change_list_copy_rows(device, monkeypatch):
    copied = []
    real = BlockTable.changes

    def spy(self, index_out, value_out, row_width):
        n, whole = real(self, index_out, value_out, row_width)
        copied.extend(whole)
        return n, whole

    monkeypatch.setattr(BlockTable, "changes", spy)
    run_schedule(device, 150, seed=1, max_table_changes=3)
    assert len(copied) > 10  # new requests of more than 3 pages went row by row


@pytest.mark.interpreter
def test_block_table_steps_through_the_triton_kernels_match_the_reference():
    model, full, inc = run_schedule("cpu", 12, seed=2, backend="triton")
    lens = [int(n) for n in inc.block_table.page_counts * PAGE - 3]
    hidden = torch.randn(len(lens), 32)
    got = inc.step(DecodeBatch(lens, inc.block_table, {"hidden": hidden}))
    want = toy_reference(model, full_batch(inc.block_table, lens, hidden), sm_scale=SM_SCALE)
    assert rel_l2(got, want) < 1e-5


def test_a_length_beyond_its_rows_pages_raises_before_anything_is_staged(device):
    model = ToyMLA(device=device)
    runner = runner_for(model, device)
    table = runner.block_table
    table.assign(0, [3, 4])
    table.assign(1, [5])
    runner.step(DecodeBatch([20, 9], table, {"hidden": torch.zeros(2, 32)}))
    table.append(1, [6])  # pending until the next good step
    buffers = runner.buffers
    static = (buffers.seq_lens, buffers.positions, buffers.block_table, buffers.output,
              *buffers.inputs.values())
    before = [t.clone() for t in static]
    calls = model.calls
    with pytest.raises(ValueError, match=r"seq_lens_cpu\[0\] = 33 needs 3 pages of 16, but "
                       "row 0 of the block table holds 2"):
        runner.step(DecodeBatch([33, 20], table, {"hidden": torch.zeros(2, 32)}))
    with pytest.raises(ValueError, match="5 requests but the block table has 4 rows"):
        runner.step(DecodeBatch([1] * 5, table, {"hidden": torch.zeros(5, 32)}))
    other = BlockTable(runner.spec, 4)
    with pytest.raises(ValueError, match="does not own; pass runner.block_table"):
        runner.step(DecodeBatch([1], other, {"hidden": torch.zeros(1, 32)}))
    assert all(torch.equal(a, b) for a, b in zip(before, static, strict=True))
    assert model.calls == calls and runner.stats().errors == 3
    hidden = torch.randn(2, 32)
    got = runner.step(DecodeBatch([20, 30], table, {"hidden": hidden}))
    assert live_entries(buffers.block_table, [20, 30]) == [[3, 4], [5, 6]]
    want = toy_reference(model, DecodeBatch([20, 30], np.array([[3, 4], [5, 6]], np.int32),
                                            {"hidden": hidden}), sm_scale=SM_SCALE)
    assert rel_l2(got, want) < (1e-2 if device == "cuda" else 1e-5)


def test_switching_between_a_full_table_and_the_block_table_resyncs(device):
    model = ToyMLA(device=device)
    runner = runner_for(model, device)
    table = runner.block_table
    table.assign(0, [7, 8, 9])
    hidden = torch.randn(1, 32)
    runner.step(DecodeBatch([40], table, {"hidden": hidden}))
    other = np.array([[1, 2, 3]], np.int32)
    runner.step(DecodeBatch([40], other, {"hidden": hidden}))  # the full path overwrites row 0
    assert live_entries(runner.buffers.block_table, [40]) == [[1, 2, 3]]
    got = runner.step(DecodeBatch([40], table, {"hidden": hidden}))  # no change since: resync
    assert live_entries(runner.buffers.block_table, [40]) == [[7, 8, 9]]
    want = toy_reference(model, DecodeBatch([40], np.array([[7, 8, 9]], np.int32),
                                            {"hidden": hidden}), sm_scale=SM_SCALE)
    assert rel_l2(got, want) < (1e-2 if device == "cuda" else 1e-5)


def test_eager_runner_applies_the_same_changes(device):
    model = ToyMLA(device=device)
    be = get_backend("dense", num_sms=NUM_SMS, kv_lora_rank=64, qk_rope_dim=16)
    runner = GraphBucketRunner(model, spec=toy_spec(max_pages=MAX_PAGES, device=device),
                               batch_sizes=[1, 2], ladder=None, max_model_len=TOP,
                               sm_scale=SM_SCALE, backend=be, progress=False)
    rng = np.random.default_rng(4)
    sched = Scheduler(runner.block_table, rng)
    for _ in range(60):
        lens = sched.advance()
        hidden = torch.from_numpy(rng.standard_normal((len(lens), 32)).astype(np.float32))
        got = runner.step(DecodeBatch(lens, runner.block_table, {"hidden": hidden}))
        want = toy_reference(model, full_batch(runner.block_table, lens, hidden),
                             sm_scale=SM_SCALE)
        assert rel_l2(got, want) < (1e-2 if device == "cuda" else 1e-5), lens
    assert runner.stats().eager_steps == 60


# ---- GPU: CUDA graphs, no syncs ---------------------------------------------------------

@pytest.mark.gpu
def test_gpu_1000_block_table_steps_match_the_full_path_without_a_sync():
    model = ToyMLA(device="cuda")
    full = runner_for(model, "cuda", backend="triton")
    inc = runner_for(model, "cuda", backend="triton", max_table_changes=8)
    rng = np.random.default_rng(5)
    sched = Scheduler(inc.block_table, rng)
    for step in range(1000):
        lens = sched.advance()
        hidden = torch.from_numpy(rng.standard_normal((len(lens), 32)).astype(np.float32))
        want = full.step(full_batch(inc.block_table, lens, hidden)).clone()
        batch = DecodeBatch(lens, inc.block_table, {"hidden": hidden})
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = inc.step(batch).clone()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert rel_l2(got, want) < 1e-5, (step, lens)
        if step % 50 == 0:
            assert live_entries(inc.buffers.block_table, lens) == live_entries(
                full.buffers.block_table, lens), step
    stats = inc.stats()
    assert stats.errors == 0 and stats.eager_fallbacks == 0 and stats.steps == 1000
    assert all(t.is_pinned() for t in inc.buffers.staging_tensors())
    full.close()
    inc.close()


@pytest.mark.host
def test_decode_batch_takes_the_block_table_and_derives_the_same_slots():
    from graphbucket.models import MLADecoder, decode_batch, random_block_table, tiny

    model = MLADecoder(tiny(), num_pages=64, page_size=16, device="cpu")
    spec = model.buffer_spec(256)
    table = BlockTable(spec, 4)
    pages = random_block_table(3, 256 // 16, model.num_pages, np.random.default_rng(1))
    lens = [5, 16, 170]
    for row, n in enumerate(lens):
        table.assign(row, pages[row, :-(-n // 16)])
    hidden = torch.zeros(3, model.config.hidden_size)
    paged = decode_batch(model, lens, table, hidden)
    plain = decode_batch(model, lens, table.table[:3], hidden)
    assert paged.block_table_cpu is table
    assert torch.equal(paged.inputs["slot_mapping"], plain.inputs["slot_mapping"])
    # the slots name the pages the table holds (token 169 of request 2)
    assert int(paged.inputs["slot_mapping"][2]) == int(pages[2, 169 // 16]) * 16 + 169 % 16
