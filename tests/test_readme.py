"""Every python block of README.md runs as written (in a fresh interpreter, from the repo
root, with nothing set in the environment), so the README cannot rot; the first block's
decode step matches the float64 reference."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)

# Appended to the first block: its step's output against a float64 reference recomputed
# here, so the test does not rest on the number the block prints.
CHECK_FIRST_BLOCK = """
import json as _json
_ref = model.forward_reference(batch.inputs["hidden"], positions=batch.seq_lens_cpu - 1,
                               seq_lens=batch.seq_lens_cpu, block_table=block_table_cpu,
                               slot_mapping=batch.inputs["slot_mapping"])
_rows = len(batch.seq_lens_cpu)
_err = ((out[:_rows].double() - _ref).norm() / _ref.norm()).item()
print("CHECK " + _json.dumps({"dtype": str(model.dtype), "rel_l2": _err, "rows": _rows}))
"""
PRINTED = re.compile(r"^(torch\.\w+): relative L2 error against float64 (\S+)$", re.M)
# On the CPU the model runs in float32 through the interpreter; on a GPU in bf16, whose
# rounding of every projection dominates the error.
TOLERANCE = {"torch.float32": 1e-4, "torch.bfloat16": 2e-2}


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(1, len(BLOCKS)))
def test_readme_block_runs(index):
    done = run_python(BLOCKS[index])
    assert done.returncode == 0, f"README block {index} failed:\n{done.stderr[-3000:]}"
    assert done.stdout.strip(), "every README block prints what it did"
    # A block that reports an error against float64 reports one within the tolerance.
    want = "torch.bfloat16" if torch.cuda.is_available() else "torch.float32"
    for error in re.findall(r"relative L2 error against float64 (\S+)", done.stdout):
        assert float(error) <= TOLERANCE[want], f"README block {index}: {done.stdout}"


def test_first_block_runs_and_matches_the_float64_reference():
    done = run_python(BLOCKS[0] + CHECK_FIRST_BLOCK)
    assert done.returncode == 0, f"README block 0 failed:\n{done.stderr[-3000:]}"
    check = json.loads(done.stdout.split("CHECK ", 1)[1])
    want = "torch.bfloat16" if torch.cuda.is_available() else "torch.float32"
    assert check["dtype"] == want, f"the model's default dtype here is {want}"
    assert check["rows"] == 2
    assert check["rel_l2"] <= TOLERANCE[want], check
    printed = PRINTED.findall(done.stdout)
    assert len(printed) == 1, f"block 0 prints its error against float64:\n{done.stdout}"
    dtype, error = printed[0]
    assert dtype == want
    # The printed error (two significant digits) is the one recomputed here.
    assert float(error) == pytest.approx(check["rel_l2"], rel=0.06)
