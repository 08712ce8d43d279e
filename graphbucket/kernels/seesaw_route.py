"""Which stage 1 runs a plan on given inputs: the Gluon seesaws (sm_90, 64-row programs)
where their kernels apply, else the Triton kernels the plan also describes; and the step
options a seesaw launch passes (``seesaw_step_args``). Decided from static properties only
(shapes, dtypes, device, the interpreter), so capture and replay take the same path."""

from __future__ import annotations

import functools
import os

import torch

from graphbucket.plan import LaunchPlan


@functools.cache
def _warpgroup_mma_capable(device: torch.device) -> bool:
    """sm_90 (Hopper): warpgroup MMA, TMA and register reallocation, which the seesaw uses."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _seesaw_program(plan: LaunchPlan, q: torch.Tensor, q_len: int) -> bool:
    """What every seesaw needs of the plan and device: a seesaw plan of 64-row programs
    (rows: q_len tokens x heads) over 576-wide rows, on sm_90, compiled (not
    interpreted)."""
    return (plan.seesaw and plan.num_heads % q_len == 0 and plan.block_h == 64
            and plan.kv_lora_rank + plan.qk_rope_dim == 576
            and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
            and _warpgroup_mma_capable(q.device))


def runs_seesaw(plan: LaunchPlan, q: torch.Tensor, kv_cache: torch.Tensor, *, q_len: int = 1,
                kv_scale: torch.Tensor | None = None) -> bool:
    """Whether a ``plan.seesaw`` launch runs the Gluon seesaw stage 1: on sm_90 (compiled,
    not interpreted), bf16 q and cache, a contiguous cache of 64-token pages 576 wide,
    contiguous q with rows (q_len tokens x heads) a multiple of 64 or fewer than 64
    (64-row programs, ``block_h`` 64). Otherwise the Triton 64-row kernel runs the same
    plan. Static properties only: capture and replay take the same path."""
    return (_seesaw_program(plan, q, q_len) and kv_scale is None
            and q.dtype == kv_cache.dtype == torch.bfloat16
            and kv_cache.shape[2] == 576 and kv_cache.shape[1] == 64
            and (plan.num_heads % 64 == 0 or plan.num_heads < 64)
            and q.is_contiguous() and kv_cache.is_contiguous())


def runs_seesaw_over_fp8(plan: LaunchPlan, q: torch.Tensor, kv_cache: torch.Tensor, *,
                         q_len: int = 1, kv_scale: torch.Tensor | None = None) -> bool:
    """Whether a ``plan.seesaw`` launch over an fp8 cache runs the Gluon fp8 seesaw's stage 1
    (``kernels.seesaw_fp8``): on sm_90 (compiled, not interpreted), a per-tensor cache with
    its ``kv_scale`` or a V3.2 cache, bf16 q, 64-token pages, 64-row programs (``block_h``
    64; rows: q_len tokens x heads). Otherwise the Triton 64-row kernel runs the plan.
    Static properties only: capture and replay take the same path."""
    if not (kv_cache.dtype in (torch.float8_e4m3fn, torch.uint8)
            and _seesaw_program(plan, q, q_len)):
        return False
    from graphbucket.kernels.seesaw_fp8 import runs_seesaw_fp8

    return runs_seesaw_fp8(q, kv_cache, kv_scale, plan.num_heads)


def seesaw_step_args(pv_cols: int | None, lazy_rescale: bool | None, one_rescale: bool = False,
                     fp8: bool = False) -> dict:
    """A seesaw launch's step options that differ from the kernel's defaults (the eager
    step on 256-column PVs). ``lazy_rescale`` None: the lazy step (``seesaw_lazy``)
    wherever it runs, a bf16 cache's default order on 256-column PVs; False: the eager
    step. The lazy step asked with the one-rescale order or 64-column PVs raises before
    anything is launched."""
    if lazy_rescale is None:
        lazy_rescale = not (one_rescale or fp8) and pv_cols in (None, 256)
    if lazy_rescale and (one_rescale or pv_cols == 64):
        raise ValueError("lazy_rescale runs the default step order on 256-column PVs; "
                         "leave one_rescale and pv_cols out")
    return {**({"ONE_RESCALE": True} if one_rescale else {}),
            **({"PV_COLS": pv_cols} if pv_cols is not None else {}),
            **({"LAZY_RESCALE": True} if lazy_rescale else {})}
