"""Compile the Triton split-KV stage 1 (bf16, fp8 e4m3 and V3.2 caches) and the merge kernel
for sm_90 without a GPU and print what each asks for, one JSON line per kernel (run by
tests/test_triton_compile.py in a process without Triton's interpreter):

    python3 -m tests.triton_compile [--dump DIR]

Each kernel gets the arguments its launcher passes for a real plan, recorded from
``launch_stage1`` / ``launch_merge`` on CPU tensors with the two choices a Hopper GPU
makes instead of the CPU (the plan's fp8 dequantization, the merge's dependent launch),
and is specialized the way Triton's launcher would, so code that does not compile for the
GPU fails here. ``--dump DIR`` also writes each kernel's ttgir and PTX there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import native_specialize_impl

from graphbucket import fp8
from graphbucket.kernels import launch
from graphbucket.kernels.launch import SplitWorkspace, default_sm_scale
from graphbucket.plan import plan_mla_decode

TARGET = GPUTarget("cuda", 90, 32)
PAGE, HEADS, BATCH = 64, 16, 2


class _Recorder:
    """Stands in for a kernel in ``launch``: keeps the arguments of each launch."""

    def __init__(self, kernel, calls: list):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.kernel, args, kwargs))


def _as_on_hopper():
    """What differs on an sm_90 GPU from this CPU process, set in ``launch`` (restored by
    the caller): the plan's fp8 dequantization and the merge's dependent launch."""
    return {"fp8_dequant": lambda plan, device: plan.fp8.dequant,
            "use_pdl": lambda plan, device: plan.merge_kernel and plan.dependent_merge}


def recorded_launches(cache_kind: str) -> list:
    """(kernel, args, kwargs) of stage 1 and, for plans that have one, of the merge."""
    plan = plan_mla_decode(BATCH, HEADS, 4096)
    rows = torch.zeros(8, PAGE, 576)
    kv_scale = None
    if cache_kind == "bf16":
        cache = rows.to(torch.bfloat16)
    elif cache_kind == "e4m3":
        kv_scale = torch.ones(1)
        cache = fp8.quantize(rows, kv_scale)
    else:
        cache = fp8.pack_v32(rows)
    q = torch.zeros(BATCH, HEADS, 576, dtype=torch.bfloat16)
    out = torch.zeros(BATCH, HEADS, 512, dtype=torch.bfloat16)
    lse = torch.zeros(BATCH, HEADS)
    table = torch.zeros(BATCH, 8, dtype=torch.int32)
    seq_lens = torch.full((BATCH,), 500, dtype=torch.int32)
    workspace = SplitWorkspace.allocate(BATCH, HEADS, plan.num_kv_splits, 512, "cpu")
    calls: list = []
    patched = {"mla_decode_stage1_kernel": _Recorder(launch.mla_decode_stage1_kernel, calls),
               "mla_decode_merge_kernel": _Recorder(launch.mla_decode_merge_kernel, calls),
               **_as_on_hopper()}
    saved = {name: getattr(launch, name) for name in patched}
    try:
        for name, value in patched.items():
            setattr(launch, name, value)
        launch.launch_stage1(q, cache, table, seq_lens, out, workspace, plan=plan,
                             sm_scale=default_sm_scale(), lse=lse, kv_scale=kv_scale)
        if plan.merge_kernel:
            launch.launch_merge(seq_lens, out, workspace, plan=plan, lse=lse,
                                block_n=launch.kv_tile_tokens(plan, cache))
    finally:
        for name, value in saved.items():
            setattr(launch, name, value)
    return calls


def compile_launch(kernel, args: tuple, kwargs: dict):
    """``kernel`` compiled for sm_90 as Triton's launcher would compile this launch: the
    same signature, constexprs (defaults included) and 16-divisibility specialization."""
    names = [p.name for p in kernel.params]
    values = dict(zip(names, args, strict=False))  # the launchers pass constexprs by name
    values.update({k: v for k, v in kwargs.items() if k in names})
    options = {k: v for k, v in kwargs.items() if k not in names}  # num_warps, num_stages
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[(i,)] = values.get(p.name, p.default)
            continue
        kind, spec = native_specialize_impl(BaseBackend, values[p.name], False,
                                            not p.do_not_specialize, True)
        signature[p.name] = kind
        if kind == "constexpr":  # Triton folds an integer 1 into the kernel
            constexprs[(i,)] = spec
        elif isinstance(spec, str):
            attrs[(i,)] = BaseBackend.parse_attr(spec)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=TARGET, options=options)


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Compile the Triton stage 1 (bf16, e4m3 and V3.2 caches) and the merge "
                    "kernel for sm_90 (no GPU needed) and print one JSON line per kernel.")
    parser.add_argument("--dump", type=Path, metavar="DIR",
                        help="also write <name>.ttgir and <name>.ptx into DIR")
    args = parser.parse_args()
    launches = {}
    for kind in ("bf16", "e4m3", "v32"):
        stage1, *merge = recorded_launches(kind)
        launches[f"stage1-{kind}"] = stage1
        if kind == "bf16" and merge:
            launches["merge"] = merge[0]
    for name, (kernel, kernel_args, kwargs) in launches.items():
        compiled = compile_launch(kernel, kernel_args, kwargs)
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            for kind in ("ttgir", "ptx"):
                (args.dump / f"{name}.{kind}").write_text(compiled.asm[kind])
        ptx = compiled.asm["ptx"]
        print(json.dumps({
            "name": name,
            "constexprs": {k: v for k, v in kwargs.items()
                           if k in ("BLOCK_N", "KV_FORMAT", "REG_PREFETCH", "DEQUANT", "USE_GDC")},
            "shared_bytes": compiled.metadata.shared,
            "num_warps": compiled.metadata.num_warps,
            "mma": ptx.count("mma.sync") + ptx.count("wgmma.mma_async"),
            "e4m3_bits": ptx.count("prmt.b32"),
            "e4m3_cvt": ptx.count("cvt.rn.f16x2.e4m3x2"),
            "launch_dependents": ptx.count("griddepcontrol.launch_dependents"),
            "wait_dependency": ptx.count("griddepcontrol.wait"),
        }), flush=True)


if __name__ == "__main__":
    main()
