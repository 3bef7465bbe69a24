"""Loading the CPU extension after a build that died: torch's loader guards a build with a `lock` file that only
the build removes, and a process killed while compiling left one behind that made every later load wait for
ever (a test's stand-in generator waited 240 s in `FileBaton.wait`). With the flock of kernels/cpu.py the next
load removes it and goes on. Real processes: the load runs in a child with a timeout, next to a stale lock, in a
copy of the build folder of its own (in the shared one any other test's load may remove the lock first)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.cpu import _NAME, cpu_extension

REPO = Path(__file__).resolve().parents[3]
LOAD = "from kernels.cpu import cpu_extension; assert cpu_extension() is not None; print('loaded')"


@pytest.mark.skipif(cpu_extension() is None, reason="the CPU extension cannot be built on this machine")
def test_a_lock_left_by_a_build_that_died_does_not_stop_the_next_load(tmp_path):
    built = Path(cpu_extension().__file__).parent
    assert built.name == _NAME
    build = tmp_path / built.parent.name / _NAME
    shutil.copytree(built, build, ignore=shutil.ignore_patterns("lock", "build.flock"))
    (build / "lock").write_text("")  # what a build killed before it finished leaves
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-c", LOAD], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "loaded", r.stderr[-2000:]
    assert "left by a build of the CPU extension that did not finish" in r.stderr
    assert not (build / "lock").exists()
