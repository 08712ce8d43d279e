"""AITER backend (ROCm): AMD's MLA decode behind graphbucket's protocol, in two modes.

Imported only through ``get_backend("aiter")``. The module itself imports without AITER
(its pure helpers are tested on CPU); constructing ``AiterBackend`` without AITER raises
an ImportError that says how to get it. Not exercised in graphbucket's CI (no ROCm there).

Gluon mode (default): AITER's Gluon kernel, ``mla_decode_gluon(q_nope, q_pe, kv_c, o,
page_table, seq_info, sm_scale, ...)``. The host hint becomes AITER's ``min_kv_seq_len``,
from which AITER picks its split count (a constexpr baked into the captured graph), so
each hint is its own plan: ``AiterLaunchPlan`` adds ``min_kv_seq_len`` to the key. The
kernel addresses the cache one token per page, so ``run`` expands the block table into a
static token table held in the workspace (graph-safe tensor ops).

Persistent mode (``persistent=True``): graphbucket's balanced topology mapped onto AITER's
persistent MLA decode. The correspondence:

- plan: hint-free, one per batch size (graphs of long buckets alias) -> ``AiterPersistentPlan``,
  one per (batch, heads).
- item buffers sized once for the worst case, shared by every graph -> the six work buffers
  (work_meta_data, work_indptr, work_info_set, reduce_indptr, reduce_final_map,
  reduce_partial_map) sized by ``get_mla_metadata_info_v1(max_batch, 1, heads, q_dtype,
  kv_dtype, is_sparse=False, fast_mode=True)``, allocated once in the workspace.
- planning kernel captured in the graph, reading live seq_lens on the device ->
  ``get_mla_metadata_v1(qo_indptr, kv_indptr, kv_last_page_lens, heads, 1, True, work...)``,
  captured, reading device indptrs built from the live seq_lens.
- stage 1 over work items, then the merge -> ``aiter.mla.mla_decode_fwd(q, kv, out,
  qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, 1, work_meta_data=..., ...,
  reduce_partial_map=...)``: AITER's persistent stage 1 and its reduce.

``run`` builds qo_indptr (static ``arange``), kv_indptr, kv_indices and kv_last_page_lens
from ``seq_lens`` / ``block_table`` with fixed-shape torch ops (``fill_kv_indices``: no
``.item()``, no boolean-mask indexing, no host read, no synchronize), then launches the
metadata op and the decode; all three are captured in the graph, so every replay plans
from the lengths then on the device. Unlike vLLM's ROCm AITER MLA sparse builder (which
fills the same buffers eagerly, then synchronizes the stream and keeps a CPU fingerprint
of the lengths to skip unchanged steps) nothing here synchronizes or reads lengths on the
host: the fill is part of the graph.

KV granularity: AITER's kernels take ``page_size`` pages; vLLM runs its dense AITER MLA
path with one-token pages on MI300/MI355, which is the default here
(``kernel_page_size=1``: kv_indices are token slots ``page * page_size + offset`` and the
cache is viewed as ``[num_pages * page_size, 1, 1, D]``). ``kernel_page_size=page_size``
passes graphbucket's pages as they are (for kernels that take large pages).

Padding rows (``seq_len == 0``) get zero kernel pages and a last-page length of
``kernel_page_size``, so ``(pages - 1) * kernel_page_size + last == 0``; their output
rows are zeroed after the decode, as the other backends leave them.

To check on a ROCm machine: zero-length rows in get_mla_metadata_v1; head counts (16..128
in steps of 16, what AITER's persistent path folds or runs natively); AITER's own
fallback to its non-persistent kernel on gfx950 bf16 16 heads from batch 32
(``AITER_MLA_DECODE_PERSISTENT_MAX_BATCH=0`` disables it); ``mla_decode_fwd`` allocates
its partials (``reduce_partial_map.size(0)`` rows) inside each captured graph. Written
against ROCm/aiter ``aiter/ops/attention.py`` (get_mla_metadata_info_v1,
get_mla_metadata_v1) and ``aiter/mla.py`` (mla_decode_fwd).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from graphbucket.backends.base import check_balanced_kernel
from graphbucket.backends.triton import split_kv_ladder, split_kv_q_ladder
from graphbucket.bucket import DEFAULT_BALANCED_KERNEL
from graphbucket.ladder import BucketLadder
from graphbucket.plan import H200_NUM_SMS, LaunchPlan, plan_mla_decode
from graphbucket.spec import BufferSpec

_INSTALL_HINT = (
    "the 'aiter' backend needs AMD's AITER on a ROCm machine (MI300/MI355 class): "
    "`pip install aiter` or build it from AMD's ROCm/aiter repository; use "
    "get_backend('triton') elsewhere"
)

# The order of get_mla_metadata_info_v1's six (shape, dtype) pairs.
WORK_BUFFERS = ("work_meta_data", "work_indptr", "work_info_set", "reduce_indptr",
                "reduce_final_map", "reduce_partial_map")

BufferShapes = tuple[tuple[str, tuple[int, ...], torch.dtype], ...]


def _load_gluon():
    try:
        from aiter.ops.triton.gluon.mla_decode_gluon import mla_decode_gluon
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError(_INSTALL_HINT) from exc
    return mla_decode_gluon


def _load_persistent():
    try:
        from aiter import get_mla_metadata_info_v1, get_mla_metadata_v1
        from aiter.mla import mla_decode_fwd
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise ImportError(_INSTALL_HINT) from exc
    return get_mla_metadata_info_v1, get_mla_metadata_v1, mla_decode_fwd


# ---- pure helpers (no AITER; any device) ------------------------------------------------

def kernel_page_table(block_table: torch.Tensor, page_size: int,
                      kernel_page_size: int) -> torch.Tensor:
    """[B, C] page ids -> [B, C * r] int64 kernel-page ids, r = page_size / kernel_page_size.

    Kernel page ``k`` of cache page ``p`` is ``p * r + k``: the cache viewed as
    ``[num_pages * r, kernel_page_size, ...]``. r = 1 returns the table as int64.
    """
    if kernel_page_size < 1 or page_size % kernel_page_size:
        raise ValueError(f"kernel_page_size={kernel_page_size} must divide "
                         f"page_size={page_size}")
    r = page_size // kernel_page_size
    table = block_table.to(torch.int64)
    if r == 1:
        return table
    offsets = torch.arange(r, dtype=torch.int64, device=table.device)
    return (table[:, :, None] * r + offsets).reshape(table.shape[0], -1)


def compact_rows(values: torch.Tensor, counts: torch.Tensor, *, kv_indptr: torch.Tensor,
                 kv_indices: torch.Tensor) -> None:
    """Pack the first ``counts[b]`` entries of each row of ``values`` [B, W] into
    ``kv_indices`` [B * W] (row b at kv_indptr[b]), zeros after the total; ``kv_indptr``
    [B + 1] = exclusive prefix sum of ``counts`` [B] (each in 0..W).

    Graph-safe: one scatter whose destinations are a permutation (live entries to their
    compact slot, the rest in order after the total), so no slot keeps a stale value.
    """
    bsz, width = values.shape
    counts = counts.to(torch.int64)
    end = torch.cumsum(counts, 0)
    start = end - counts
    cols = torch.arange(width, dtype=torch.int64, device=values.device)
    live = cols < counts[:, None]
    # Dead entries of row b go to total + b * width + col - end[b]: after the total, in order.
    rows = torch.arange(bsz, dtype=torch.int64, device=values.device)[:, None]
    dead_slot = end[-1:] + rows * width + cols - end[:, None]
    dest = torch.where(live, start[:, None] + cols, dead_slot)
    src = torch.where(live, values, 0).to(kv_indices.dtype)
    kv_indices.scatter_(0, dest.reshape(-1), src.reshape(-1))
    kv_indptr[:1].zero_()
    kv_indptr[1:].copy_(end)


def fill_kv_indices(seq_lens: torch.Tensor, block_table: torch.Tensor, *, page_size: int,
                    kernel_page_size: int, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                    kv_last_page_lens: torch.Tensor) -> None:
    """Write AITER's paged-KV description of B requests into persistent buffers.

    ``seq_lens`` [B] (0 = padding row), ``block_table`` [B, C] cache pages of
    ``page_size`` tokens. With g = ``kernel_page_size`` and n_b = cdiv(seq_lens[b], g):
    ``kv_indptr`` [B + 1] = exclusive prefix sum of n_b; ``kv_indices`` [B * C * page_size
    / g] holds request b's kernel pages at kv_indptr[b] .. kv_indptr[b + 1] (compact), then
    zeros; ``kv_last_page_lens`` [B] = seq_lens - (n_b - 1) * g, in [1, g] for live rows
    and g for padding rows. Requires seq_lens[b] <= C * page_size.

    Graph-safe: fixed shapes only, nothing read on the host (``compact_rows``).
    """
    bsz = seq_lens.shape[0]
    pages = kernel_page_table(block_table, page_size, kernel_page_size)
    width = pages.shape[1]
    if (kv_indptr.shape != (bsz + 1,) or kv_last_page_lens.shape != (bsz,)
            or kv_indices.shape != (bsz * width,) or block_table.shape[0] != bsz):
        raise ValueError(
            f"for {bsz} requests and {width} kernel pages per row expected block_table "
            f"[{bsz}, C], kv_indptr [{bsz + 1}], kv_indices [{bsz * width}], "
            f"kv_last_page_lens [{bsz}]; got {tuple(block_table.shape)}, "
            f"{tuple(kv_indptr.shape)}, {tuple(kv_indices.shape)}, "
            f"{tuple(kv_last_page_lens.shape)}")
    lens = seq_lens.to(torch.int64).clamp(min=0)
    n = ((lens + kernel_page_size - 1) // kernel_page_size).clamp(max=width)
    compact_rows(pages, n, kv_indptr=kv_indptr, kv_indices=kv_indices)
    kv_last_page_lens.copy_(lens - (n - 1) * kernel_page_size)


def index_buffer_shapes(max_batch: int, max_pages: int, page_size: int,
                        kernel_page_size: int) -> BufferShapes:
    """The int32 index buffers ``run`` fills for up to ``max_batch`` requests."""
    width = max_pages * (page_size // kernel_page_size)
    i32 = torch.int32
    return (("qo_indptr", (max_batch + 1,), i32), ("kv_indptr", (max_batch + 1,), i32),
            ("kv_indices", (max_batch * width,), i32), ("kv_last_page_lens", (max_batch,), i32))


def work_buffer_shapes(info) -> BufferShapes:
    """Name get_mla_metadata_info_v1's six ((shape or int), dtype) pairs (WORK_BUFFERS)."""
    if len(info) != len(WORK_BUFFERS):
        raise ValueError(f"expected {len(WORK_BUFFERS)} (shape, dtype) pairs, got {len(info)}")
    return tuple((name, tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),),
                  dtype) for name, (shape, dtype) in zip(WORK_BUFFERS, info, strict=True))


@dataclass(frozen=True, slots=True)
class PersistentWorkspaceSpec:
    """AITER's work buffers (sized by get_mla_metadata_info_v1 for the worst case) plus the
    index buffers of ``index_buffer_shapes``; allocated once, shared by every graph."""

    max_batch: int
    max_pages: int
    page_size: int
    kernel_page_size: int
    work: BufferShapes

    @property
    def buffers(self) -> BufferShapes:
        return index_buffer_shapes(self.max_batch, self.max_pages, self.page_size,
                                   self.kernel_page_size) + self.work

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in self.buffers)

    def allocate(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        ws = {name: torch.zeros(shape, dtype=dtype, device=device)
              for name, shape, dtype in self.buffers}
        ws["qo_indptr"].copy_(torch.arange(self.max_batch + 1, dtype=torch.int32))
        return ws


# ---- plans and workspace of the Gluon mode ----------------------------------------------

@dataclass(frozen=True, slots=True)
class AiterLaunchPlan(LaunchPlan):
    """A ``LaunchPlan`` plus the ``min_kv_seq_len`` AITER derives its split count from."""

    min_kv_seq_len: int = 1


@dataclass(frozen=True, slots=True)
class AiterPersistentPlan(LaunchPlan):
    """Persistent mode: hint-free, one per (batch, heads); splits are AITER's, on device."""

    def describe(self) -> str:
        return f"aiter persistent bs={self.batch_size} heads={self.num_heads}"


@dataclass(frozen=True, slots=True)
class TokenTableSpec:
    """int32 [max_batch, max_pages * page_size] token table plus [page_size] offsets."""

    max_batch: int
    max_pages: int
    page_size: int

    @property
    def nbytes(self) -> int:
        return 4 * (self.max_batch * self.max_pages * self.page_size + self.page_size)

    def allocate(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        return {
            "token_table": torch.zeros(self.max_batch, self.max_pages * self.page_size,
                                       dtype=torch.int32, device=device),
            "page_offsets": torch.arange(self.page_size, dtype=torch.int32, device=device),
        }


def _fields(plan: LaunchPlan) -> dict:
    return {name: getattr(plan, name) for name in LaunchPlan.__dataclass_fields__}


class AiterBackend:
    """AITER MLA decode; ``page_size`` and ``max_pages`` describe the block table.

    ``persistent=True`` selects AITER's persistent decode with device-built metadata (see
    the module docstring); ``q_dtype`` / ``kv_dtype`` (default: ``q_dtype``) size its work
    buffers, and ``kernel_page_size`` (a divisor of ``page_size``, default 1) is the page
    size AITER's kernels see.
    """

    name = "aiter"

    def __init__(self, *, page_size: int, max_pages: int, kv_lora_rank: int = 512,
                 qk_rope_dim: int = 64, num_sms: int = H200_NUM_SMS, persistent: bool = False,
                 kernel_page_size: int = 1, q_dtype: torch.dtype = torch.bfloat16,
                 kv_dtype: torch.dtype | None = None) -> None:
        self.page_size = page_size
        self.max_pages = max_pages
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_dim = qk_rope_dim
        self.num_sms = num_sms
        self.persistent = persistent
        if persistent:
            if kernel_page_size < 1 or page_size % kernel_page_size:
                raise ValueError(f"kernel_page_size={kernel_page_size} must divide "
                                 f"page_size={page_size}")
            self.kernel_page_size = kernel_page_size
            self.q_dtype, self.kv_dtype = q_dtype, kv_dtype or q_dtype
            self._info, self._metadata, self._decode = _load_persistent()
        else:
            self._gluon = _load_gluon()

    def plan(self, batch_size: int, num_heads: int, hint: int) -> LaunchPlan:
        if self.persistent:  # the hint is unused: the device partitions the live lengths
            if num_heads % 16 or not 16 <= num_heads <= 128:
                raise ValueError(f"the persistent aiter decode takes 16..128 heads in steps "
                                 f"of 16, got {num_heads}")
            base = plan_mla_decode(batch_size, num_heads, 1, num_sms=self.num_sms,
                                   kv_lora_rank=self.kv_lora_rank, qk_rope_dim=self.qk_rope_dim)
            return AiterPersistentPlan(**_fields(base))
        base = plan_mla_decode(batch_size, num_heads, hint, num_sms=self.num_sms,
                               kv_lora_rank=self.kv_lora_rank, qk_rope_dim=self.qk_rope_dim)
        return AiterLaunchPlan(**_fields(base), min_kv_seq_len=hint)

    def plan_balanced(self, batch_size: int, num_heads: int,
                      kernel: str = DEFAULT_BALANCED_KERNEL) -> LaunchPlan:
        """The graph of a ragged batch (``Bucket.balanced_imbalance``): in persistent mode
        the same plan as every other (AITER partitions the live lengths itself)."""
        check_balanced_kernel(self.name, kernel, self.balanced_kernels(num_heads))
        if not self.persistent:
            raise ValueError("the aiter Gluon mode has no balanced topology: build "
                             "AiterBackend(persistent=True), or set balanced_imbalance=0")
        return self.plan(batch_size, num_heads, 1)

    def balanced_kernels(self, num_heads: int) -> tuple[str, ...]:
        return (DEFAULT_BALANCED_KERNEL,)

    def default_ladder(self, max_model_len: int, spec: BufferSpec | None = None
                       ) -> BucketLadder:
        """As the Triton backend's (``backends.triton.split_kv_ladder``)."""
        return split_kv_ladder(max_model_len, spec)

    def default_q_ladder(self, max_model_len: int, spec: BufferSpec | None, q_len: int
                         ) -> BucketLadder | None:
        """As the Triton backend's (``backends.triton.split_kv_q_ladder``)."""
        return split_kv_q_ladder(max_model_len, spec, q_len)

    def workspace_spec(self, plans: Iterable[LaunchPlan]
                       ) -> TokenTableSpec | PersistentWorkspaceSpec:
        plans = list(plans)
        if not plans:
            raise ValueError("workspace_spec needs at least one LaunchPlan")
        max_batch = max(p.batch_size for p in plans)
        if not self.persistent:
            return TokenTableSpec(max_batch, self.max_pages, self.page_size)
        heads = {p.num_heads for p in plans}
        if len(heads) != 1:
            raise ValueError(f"plans mix head counts {sorted(heads)}; one workspace serves "
                             "one head count")
        info = self._info(max_batch, 1, heads.pop(), self.q_dtype, self.kv_dtype,
                          is_sparse=False, fast_mode=True)
        return PersistentWorkspaceSpec(max_batch, self.max_pages, self.page_size,
                                       self.kernel_page_size, work_buffer_shapes(info))

    def partitions_once(self, plan) -> bool:
        return False  # every launch builds AITER's metadata from the lengths itself

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
            seq_lens: torch.Tensor, out: torch.Tensor, workspace: dict[str, torch.Tensor], *,
            plan: LaunchPlan, sm_scale: float, lse: torch.Tensor | None = None,
            q_len: int = 1) -> torch.Tensor:
        """One decode with ``plan``; graph-safe (device tensor ops and launches only)."""
        if lse is not None:
            raise NotImplementedError("the aiter backend does not return lse; pass lse=None")
        if q_len != 1:
            raise NotImplementedError(
                f"the aiter backend decodes one token per request, got q_len={q_len}; run "
                "verify steps on the triton backend (or capture q_lens=(1,))")
        if self.persistent:
            if not isinstance(plan, AiterPersistentPlan):
                raise TypeError("plan must come from a persistent AiterBackend.plan, got "
                                f"{type(plan).__name__}")
            return self._run_persistent(q, kv_cache, block_table, seq_lens, out, workspace,
                                        plan, sm_scale)
        if not isinstance(plan, AiterLaunchPlan):
            raise TypeError(f"plan must come from AiterBackend.plan, got {type(plan).__name__}")
        bs, rank = plan.batch_size, plan.kv_lora_rank
        table = workspace["token_table"][:bs].view(bs, self.max_pages, self.page_size)
        pages = block_table[:bs, : self.max_pages].clamp(0, kv_cache.shape[0] - 1)
        torch.add(pages[:, :, None] * self.page_size, workspace["page_offsets"], out=table)
        self._gluon(q[..., :rank], q[..., rank:], kv_cache.view(-1, kv_cache.shape[-1]),
                    out, workspace["token_table"][:bs], seq_lens[:bs], sm_scale,
                    kv_pe_offset=rank, use_2d_view=True, min_kv_seq_len=plan.min_kv_seq_len)
        return out

    def _run_persistent(self, q, kv_cache, block_table, seq_lens, out, ws, plan, sm_scale):
        """Index fill, get_mla_metadata_v1, then mla_decode_fwd: all captured together."""
        if q.dtype != self.q_dtype or kv_cache.dtype != self.kv_dtype:
            raise TypeError(f"q {q.dtype} / kv_cache {kv_cache.dtype}: the work buffers were "
                            f"sized for {self.q_dtype} / {self.kv_dtype}")
        bs, g = plan.batch_size, self.kernel_page_size
        width = self.max_pages * (self.page_size // g)
        qo_indptr, kv_indptr = ws["qo_indptr"][: bs + 1], ws["kv_indptr"][: bs + 1]
        kv_indices, last = ws["kv_indices"][: bs * width], ws["kv_last_page_lens"][:bs]
        lens = seq_lens[:bs]
        fill_kv_indices(lens, block_table[:bs, : self.max_pages], page_size=self.page_size,
                        kernel_page_size=g, kv_indptr=kv_indptr, kv_indices=kv_indices,
                        kv_last_page_lens=last)
        work = {name: ws[name] for name in WORK_BUFFERS}
        # Pass the dtypes only off bf16 (AITER's default): older AITER lacks these kwargs.
        dtypes = {} if self.q_dtype == self.kv_dtype == torch.bfloat16 else {
            "dtype_q": self.q_dtype, "dtype_kv": self.kv_dtype}
        # MLA: one KV head; all query heads per KV head. Positional order is AITER's:
        # work_meta_data, work_info_set, work_indptr, reduce_indptr, final map, partial map.
        self._metadata(qo_indptr, kv_indptr, last, plan.num_heads, 1, True,
                       work["work_meta_data"], work["work_info_set"], work["work_indptr"],
                       work["reduce_indptr"], work["reduce_final_map"],
                       work["reduce_partial_map"], page_size=g, kv_granularity=max(g, 16),
                       max_seqlen_qo=1, uni_seqlen_qo=1, fast_mode=True, **dtypes)
        kv = kv_cache.view(-1, g, 1, kv_cache.shape[-1])  # [kernel pages, g, kv heads, D]
        self._decode(q, kv, out, qo_indptr, kv_indptr, kv_indices, last, 1, page_size=g,
                     nhead_kv=1, sm_scale=sm_scale, **work)
        out.masked_fill_((lens <= 0)[:, None, None], 0)
        return out
