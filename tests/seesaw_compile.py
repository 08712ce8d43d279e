"""Compile the Gluon seesaw stage 1 (split-KV, over balanced work items, and over tile
ranges, equal and charged; the step variants and the fp8 kernels under trial)
and the tile-range planner for
sm_90 without a GPU and print what each asks for, as one JSON line (run by
tests/test_seesaw.py in a process without Triton's interpreter). ``spill_bytes``: what
ptxas reports spilling, from the ptxas the installed triton ships (None where it has none
that reads its PTX):

    python3 -m tests.seesaw_compile [--dump DIR]

``--dump DIR`` also writes the ttgir and PTX there (seesaw.ttgir, seesaw.ptx), to compare
the code two Triton releases, or two versions of the kernel, compile to.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import constexpr_function, mangle_type

from graphbucket.kernels import seesaw, seesaw_balanced, seesaw_fp8

# The layout of every 64 x 64 box the seesaw's TMA copies land in (``seesaw.descriptors``).
_BOX_LAYOUT = gl.constexpr(seesaw.box_layout())

POINTERS = {"BLOCK_TABLE": "*i32", "SEQ_LENS": "*i32", "OUT": "*bf16", "LSE": "*fp32",
            "Q": "*bf16", "KV8": "*fp8e4nv", "KV_SCALE": "*fp32",
            "PART_O": "*fp32", "PART_LSE": "*fp32", "ITEM_INDPTR": "*i32",
            "CHUNK_TILES": "*i32", "TILE_INDPTR": "*i32", "RANGE_TILES": "*i32",
            "RANGE_BOUNDS": "*i32", "FIRST_PROGRAM": "*i32"}


def compile_stage1(balanced: bool = False, ranges: bool = False, charged: bool = False,
                   one_rescale: bool = False, q_len: int = 1, wide_pv: bool = False,
                   lazy_rescale: bool = False):
    """The split-KV seesaw (its step in the one-rescale order with ``one_rescale``; its PV
    as one 256-column wgmma with ``wide_pv``, the kernels' default, else as four 64-column
    ones, kept to compare), or the one over balanced work items (``balanced``) or over tile
    ranges (``ranges``; a charged cut's with ``charged``). ``lazy_rescale``: the step under
    trial (256-column PVs)."""
    q = torch.zeros(2, 128, 576, dtype=torch.bfloat16)
    cache = torch.zeros(8, 64, 576, dtype=torch.bfloat16)
    descriptors = dict(zip(("q_desc", "kv_desc"), seesaw.descriptors(q, cache), strict=True))
    pv_cols = {"PV_COLS": 256 if wide_pv else 64,
               **({"LAZY_RESCALE": True} if lazy_rescale else {})}
    if ranges:
        kernel = seesaw_balanced.seesaw_range_stage1_kernel
        constants = {"PAGE_SIZE": 64, "BLOCK_B": 128, "CHARGED": charged, **pv_cols}
    elif balanced:
        kernel = seesaw_balanced.seesaw_balanced_stage1_kernel
        constants = {"PAGE_SIZE": 64, "BLOCK_B": 128, **pv_cols}
    else:
        kernel = seesaw.seesaw_stage1_kernel
        constants = {"PAGE_SIZE": 64, "ONE_SPLIT": False, "WRITE_LSE": True,
                     "ONE_RESCALE": one_rescale, "Q_LEN": q_len, **pv_cols}
    return _compile(kernel, constants, descriptors)


def compile_fp8_charged():
    """The seesaw over a charged cut's tile ranges on a per-tensor fp8 cache."""
    return _compile(seesaw_balanced.seesaw_range_stage1_kernel,
                    {"PAGE_SIZE": 64, "BLOCK_B": 128, "CHARGED": True, "KV_FP8": 1,
                     "q_desc": None, "kv_desc": None}, {},
                    {"Q": "*bf16", "KV8": "*fp8e4nv", "KV_SCALE": "*fp32"})


def compile_fp8_items():
    """The seesaw over balanced work items on a per-tensor fp8 cache."""
    return _compile(seesaw_balanced.seesaw_balanced_stage1_kernel,
                    {"PAGE_SIZE": 64, "BLOCK_B": 128, "KV_FP8": 1, "q_desc": None,
                     "kv_desc": None}, {},
                    {"Q": "*bf16", "KV8": "*fp8e4nv", "KV_SCALE": "*fp32"})


def compile_fp8_stage1(v32: bool = False, prefetch_ahead: int = 1):
    """The split-KV seesaw over a per-tensor fp8 cache (``seesaw_fp8``), or over a V3.2
    cache (``v32``: uint8 rows, no scale), its L2 prefetch ``prefetch_ahead`` steps ahead."""
    constants = {"PAGE_SIZE": 64, "ONE_SPLIT": False, "WRITE_LSE": True, "V32": v32,
                 "Q_LEN": 1, "PREFETCH_AHEAD": prefetch_ahead}
    if v32:
        constants["KV_SCALE"] = None
    return _compile(seesaw_fp8.seesaw_fp8_stage1_kernel, constants, {},
                    {"KV8": "*u8"} if v32 else {})


def _compile(kernel, constants: dict, descriptors: dict, pointers: dict | None = None):
    """``kernel`` compiled for sm_90 with ``constants``, TMA ``descriptors`` and pointer
    arguments typed by ``POINTERS`` and ``pointers``; other parameters are int32, except
    that, as a launch leaves them out, constexpr parameters and those defaulting to None
    (unless ``pointers`` names them) take their defaults."""
    named = pointers or {}
    pointers = {**POINTERS, **named}
    constants = dict(constants)
    for p in kernel.params:
        default = p._param.default
        if p.name not in constants and p.name not in descriptors and p.name not in named \
                and default is not inspect.Parameter.empty \
                and (p.is_constexpr or default is None):
            constants[p.name] = default
    signature = {}
    for p in kernel.params:
        if p.name in descriptors:
            signature[p.name] = mangle_type(descriptors[p.name])
        elif p.name in constants:
            signature[p.name] = "constexpr"
        elif p.name == "qk_scale_log2":
            signature[p.name] = "fp32"
        else:
            signature[p.name] = pointers.get(p.name, "i32")
    # As a launch specializes them: every pointer 16-byte aligned (torch's allocations are).
    aligned = {(i,): [["tt.divisibility", 16]]
               for i, p in enumerate(kernel.params) if signature[p.name].startswith("*")}
    source = GluonASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def compile_range_planner(charge: int, bounds: bool):
    """The tile-range planner (a Triton kernel) that feeds the range kernel: equal ranges
    (``bounds`` False) or a cut by work at ``charge`` tiles per request."""
    from triton.compiler import ASTSource

    from graphbucket.kernels.balanced import plan_tile_ranges_kernel as kernel

    constants = {"BLOCK_N": 64, "MIN_RANGE_TILES": 2, "BLOCK_B": 128, "CHARGE": charge,
                 "BLOCK_P": 256, "BOUNDS": bounds}
    signature = {p.name: "constexpr" if p.name in constants else
                 "i32" if p.name in ("batch", "num_programs") else "*i32"
                 for p in kernel.params}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


@constexpr_function
def _boxes_are_wide_operand(box, wide) -> bool:
    box, wide = ([list(b) for b in x.offset_bases] for x in (box, wide))
    return wide[:len(box)] == box and wide[len(box):] == [[0, 64], [0, 128]]


@gluon.jit
def _wide_view_check(X):
    box: gl.constexpr = gl.to_linear_layout(_BOX_LAYOUT, [64, 64])
    wide: gl.constexpr = gl.to_linear_layout(_BOX_LAYOUT, [64, 256])
    gl.static_assert(_boxes_are_wide_operand(box, wide))


def wide_view_matches_boxes() -> bool | None:
    """Whether four consecutive 64-column boxes of the seesaw's tile layout are, byte for
    byte, the [64, 256] operand its 256-column PVs read (``seesaw_layout.value_halves``):
    the wide layout's first offset bits are one box's, the next two step 64 and 128
    columns. Checked by compiling a kernel that compares the two layouts
    (``gl.to_linear_layout``); None on triton 3.6, whose ``to_linear_layout`` of a shared
    layout aborts the process."""
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7):
        return None
    source = GluonASTSource(fn=_wide_view_check, signature={"X": "*i32"}, constexprs={})
    try:
        triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except Exception:  # the static assertion failed: the layouts differ
        return False
    return True


def compile_balanced_merge(block_h: int = 1, prefetched: bool = False):
    """The balanced merge as the charged seesaw launches it: a programmatic dependent that
    waits on the device for stage 1's partials; with ``block_h`` > 1, units of that many
    heads over 8 items and 64 columns per step; ``prefetched``: the plans' tile from 64
    heads (``merge_tile.many_heads_merge_tile``), the next step's loads issued first."""
    from triton.compiler import ASTSource

    from graphbucket.kernels.balanced import balanced_merge_kernel as kernel
    from graphbucket.merge_tile import many_heads_merge_tile

    constants = {"BLOCK_S": 32, "BLOCK_DV": 512, "DV_BLOCKS": 1, "WRITE_LSE": True,
                 "USE_GDC": True, "BLOCK_HM": block_h, "MERGE_PREFETCH": False}
    num_warps = 8
    if block_h > 1:
        constants.update(BLOCK_S=8, BLOCK_DV=64, DV_BLOCKS=8)
    if prefetched:
        tile = many_heads_merge_tile(128, 512)
        constants.update(BLOCK_S=tile["block_s"], BLOCK_HM=tile["block_h"],
                         BLOCK_DV=tile["block_dv"], DV_BLOCKS=512 // tile["block_dv"],
                         MERGE_PREFETCH=tile["prefetch"])
        num_warps = tile["num_warps"]
    pointers = {"PART_O": "*fp32", "PART_LSE": "*fp32", "ITEM_INDPTR": "*i32",
                "MERGE_ROWS": "*i32", "OUT": "*bf16", "LSE": "*fp32"}
    signature = {p.name: "constexpr" if p.name in constants else pointers.get(p.name, "i32")
                 for p in kernel.params}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps})


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Compile the Gluon seesaw stage 1 for sm_90 (no GPU needed) and print its "
                    "shared memory, register requests, wgmma and TMA copies as one JSON line.")
    parser.add_argument("--dump", type=Path, metavar="DIR",
                        help="also write seesaw.ttgir and seesaw.ptx into DIR")
    args = parser.parse_args()
    compiled = compile_stage1()
    balanced = compile_stage1(balanced=True)
    ranges = compile_stage1(ranges=True)
    charged = compile_stage1(ranges=True, charged=True)
    one_rescale = compile_stage1(one_rescale=True)
    verify = compile_stage1(q_len=4)
    verify_one_rescale = compile_stage1(one_rescale=True, q_len=4)
    wide_pv = compile_stage1(wide_pv=True)
    wide_pv_one_rescale = compile_stage1(one_rescale=True, wide_pv=True)
    wide_pv_balanced = compile_stage1(balanced=True, wide_pv=True)
    wide_pv_ranges = compile_stage1(ranges=True, wide_pv=True)
    wide_pv_charged = compile_stage1(ranges=True, charged=True, wide_pv=True)
    wide_pv_verify = compile_stage1(q_len=4, wide_pv=True)
    lazy = compile_stage1(wide_pv=True, lazy_rescale=True)
    lazy_verify = compile_stage1(q_len=4, wide_pv=True, lazy_rescale=True)
    lazy_balanced = compile_stage1(balanced=True, wide_pv=True, lazy_rescale=True)
    lazy_charged = compile_stage1(ranges=True, charged=True, wide_pv=True, lazy_rescale=True)
    fp8_tensor = compile_fp8_stage1()
    fp8_v32 = compile_fp8_stage1(v32=True)
    fp8_ahead = compile_fp8_stage1(prefetch_ahead=2)
    fp8_charged = compile_fp8_charged()
    fp8_items = compile_fp8_items()
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
        for kind in ("ttgir", "ptx"):
            (args.dump / f"seesaw.{kind}").write_text(compiled.asm[kind])
            (args.dump / f"seesaw-balanced.{kind}").write_text(balanced.asm[kind])
            (args.dump / f"seesaw-ranges.{kind}").write_text(ranges.asm[kind])
            (args.dump / f"seesaw-charged.{kind}").write_text(charged.asm[kind])
            (args.dump / f"seesaw-one-rescale.{kind}").write_text(one_rescale.asm[kind])
            (args.dump / f"seesaw-q4.{kind}").write_text(verify.asm[kind])
            (args.dump / f"seesaw-wide-pv.{kind}").write_text(wide_pv.asm[kind])
            (args.dump / f"seesaw-balanced-wide-pv.{kind}").write_text(wide_pv_balanced.asm[kind])
            (args.dump / f"seesaw-charged-wide-pv.{kind}").write_text(wide_pv_charged.asm[kind])
            (args.dump / f"seesaw-fp8.{kind}").write_text(fp8_tensor.asm[kind])
            (args.dump / f"seesaw-fp8-v32.{kind}").write_text(fp8_v32.asm[kind])
    planners = {f"{c}{'-bounds' if b else ''}": compile_range_planner(c, b).metadata.shared
                for c, b in ((0, False), (0, True), (5, True))}
    merge = compile_balanced_merge().asm["ptx"]
    head_blocked_merge = compile_balanced_merge(block_h=8).asm["ptx"]
    prefetched_merge = compile_balanced_merge(prefetched=True).asm["ptx"]
    print(json.dumps({**summary(compiled), "balanced": summary(balanced),
                      "ranges": summary(ranges), "charged": summary(charged),
                      "one_rescale": summary(one_rescale), "q_len_4": summary(verify),
                      "q_len_4_one_rescale": summary(verify_one_rescale),
                      "wide_pv": summary(wide_pv),
                      "wide_pv_one_rescale": summary(wide_pv_one_rescale),
                      "wide_pv_balanced": summary(wide_pv_balanced),
                      "wide_pv_ranges": summary(wide_pv_ranges),
                      "wide_pv_charged": summary(wide_pv_charged),
                      "wide_pv_q_len_4": summary(wide_pv_verify),
                      "lazy_rescale": summary(lazy), "lazy_rescale_q_len_4": summary(lazy_verify),
                      "lazy_rescale_balanced": summary(lazy_balanced),
                      "lazy_rescale_charged": summary(lazy_charged),
                      "fp8_tensor": summary(fp8_tensor), "fp8_v32": summary(fp8_v32),
                      "fp8_charged": summary(fp8_charged), "fp8_items": summary(fp8_items),
                      "fp8_tensor_prefetch_2": summary(fp8_ahead),
                      "range_planner_shared_bytes": planners,
                      "wide_view_matches_boxes": wide_view_matches_boxes(),
                      "dependent_merge_waits": merge.count("griddepcontrol.wait"),
                      "head_blocked_merge_spill_bytes": spill_bytes(head_blocked_merge),
                      "prefetched_merge_spill_bytes": spill_bytes(prefetched_merge)}))


def spill_bytes(ptx: str) -> int | None:
    """Bytes the kernel spills (``ptxas -v``'s spill stores), assembled by the ptxas this
    triton ships (the first of its binaries that reads the PTX); None where none does."""
    import subprocess
    import tempfile

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "k.ptx")
        src.write_text(ptx)
        for name in ("ptxas", "ptxas-blackwell"):
            if not (bin_dir / name).exists():
                continue
            done = subprocess.run([str(bin_dir / name), "-arch=sm_90a", "-v", str(src), "-o",
                                   str(Path(tmp, "k.cubin"))], capture_output=True, text=True)
            found = re.search(r"(\d+) bytes spill stores", done.stderr)
            if done.returncode == 0 and found:
                return int(found.group(1))
    return None


def summary(compiled) -> dict:
    registers = re.search(r"requestedRegisters = array<i32: ([\d, ]+)>", compiled.asm["ttgir"])
    ptx = compiled.asm["ptx"]
    return {
        "shared_bytes": compiled.metadata.shared,
        "requested_registers": [int(r) for r in registers.group(1).split(",")] if registers
        else None,
        "wgmma": ptx.count("wgmma.mma_async"),
        "wgmma_n256": ptx.count("wgmma.mma_async.sync.aligned.m64n256k16"),
        "wgmma_waits": ptx.count("wgmma.wait_group"),
        # Waits that leave one group in flight (a PV queued behind another).
        "wgmma_waits_one_left": len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)),
        "tma_copies": ptx.count("cp.async.bulk.tensor"),
        "dependent_launch": "griddepcontrol.launch_dependents" in ptx,
        "global_stores": ptx.count("st.global"),
        "spill_bytes": spill_bytes(ptx),
    }


if __name__ == "__main__":
    main()
