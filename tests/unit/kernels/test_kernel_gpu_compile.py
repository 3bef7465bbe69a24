"""The Triton kernels compile for Hopper (sm_90, the H200 the cluster runs on) with every cache dtype.

The interpreter runs kernels as numpy and never type-checks them the way the compiler does, so
this compiles them to cubin with the ptxas that ships in the Triton wheel; no GPU needed. It runs
in a child process because kernels are already replaced by the interpreter in this one.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("gpu_compile.py")


@pytest.mark.slow
def test_kernels_compile_for_cuda_targets():
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the default; set to silence Triton's notice about it
    done = subprocess.run([sys.executable, str(SCRIPT), "90"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count(": ok") >= 30
