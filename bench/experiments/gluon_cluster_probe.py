"""Which cross-CTA shared-memory exchanges the installed triton's Gluon lowers for sm_90, in
a cluster of two CTAs (``num_ctas=2``), without a GPU.

The question behind it (bench/NOTES.md 2026-12-08 01:10): at 128 heads the two programs of
a request (one per 64-head block) each convert every fp8 tile; FlashMLA runs them as a
two-CTA cluster in which each converts half of a tile into both CTAs' shared memory. In
Gluon that is a register tensor split across the CTAs (a CGA layout) stored into shared
memory, then loaded whole. Each case compiles a kernel that fills a 64 x 64 float16 tensor
in a register layout (``split``: rows 32-63 on CTA 1; ``repl``: on both), stores it into
shared memory of a layout (split or replicated), loads it back in a third and writes it
out; it prints whether it compiled and how many cluster-scope instructions the PTX has
(``st.shared::cluster``, ``ld.shared::cluster``, ``mapa``). Each case runs in its own
process: a layout the compiler rejects can abort it.

    python3 bench/experiments/gluon_cluster_probe.py            # every case
    python3 bench/experiments/gluon_cluster_probe.py --case split-repl-repl
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

KINDS = ("split", "repl")
CASES = [f"{r}-{s}-{load}" for r in KINDS for s in KINDS for load in KINDS]
COUNTED = {"st_shared_cluster": r"st\.shared::cluster", "ld_shared_cluster": r"ld\.shared::cluster",
           "mapa": r"\bmapa\b", "barrier_cluster": r"barrier\.cluster"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=CASES, help="one case, in this process (REGISTERS-SHARED-"
                   "LOAD layouts); default: every case, each in a subprocess")
    return p.parse_args(argv)


def compile_case(case: str) -> dict:
    """Compile one case for sm_90 (two CTAs) and count its cluster-scope instructions."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    # A CGA basis is a CTA's coordinate in the grid of CTA tiles: [1, 0] puts CTA 1 on the
    # second row tile; [0, 0] gives both CTAs the whole tensor.
    cga = {"split": [[1, 0]], "repl": [[0, 0]]}
    regs, shared, load = case.split("-")
    reg_layout = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0],
                                               cga_layout=cga[regs]))
    smem_layout = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                    rank=2, cga_layout=cga[shared]))
    load_layout = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0],
                                                cga_layout=cga[load]))

    @gluon.jit
    def exchange(Y):
        x = gl.full([64, 64], 1.0, gl.float16, reg_layout)
        s = gl.allocate_shared_memory(gl.float16, [64, 64], smem_layout)
        s.store(x)
        y = s.load(load_layout)
        r = gl.arange(0, 64, gl.SliceLayout(1, load_layout))
        c = gl.arange(0, 64, gl.SliceLayout(0, load_layout))
        gl.store(Y + r[:, None] * 64 + c[None, :], y.to(gl.float32))

    source = GluonASTSource(fn=exchange, signature={"Y": "*fp32"}, constexprs={})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "num_ctas": 2})
    ptx = kernel.asm["ptx"]
    return {"case": case, "compiled": True,
            **{name: len(re.findall(pattern, ptx)) for name, pattern in COUNTED.items()}}


def run_all() -> list[dict]:
    """Every case in a subprocess of its own (a rejected layout can abort the compiler)."""
    rows = []
    for case in CASES:
        done = subprocess.run([sys.executable, __file__, "--case", case], capture_output=True,
                              text=True, timeout=600)
        found = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode == 0 and found:
            rows.append(json.loads(found[-1]))
        else:
            why = [line for line in done.stderr.splitlines()
                   if "Error" in line or "ERROR" in line] or ["no output"]
            rows.append({"case": case, "compiled": False, "error": why[-1].strip()[:200]})
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.case:
        print(json.dumps(compile_case(args.case)))
        return
    import triton

    print(f"triton {triton.__version__}, sm_90, two CTAs per cluster")
    print("| registers-shared-load | compiled | st.shared::cluster | ld.shared::cluster | mapa |")
    print("|---|---|---:|---:|---:|")
    for row in run_all():
        if row["compiled"]:
            print(f"| {row['case']} | yes | {row['st_shared_cluster']} | "
                  f"{row['ld_shared_cluster']} | {row['mapa']} |")
        else:
            print(f"| {row['case']} | no: {row['error']} | | | |")


if __name__ == "__main__":
    main()
