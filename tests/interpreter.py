"""Run a snippet under Triton's interpreter: TRITON_INTERPRET must be set before triton is imported, so the code
runs in a subprocess from the repository root (snippets add "tests" to sys.path to import test helpers)."""

import functools
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A loop over a program id's range: Triton 3.6's interpreter converts the bound with int() of a 1-element NumPy
# array, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted"); later Triton releases run it.
LOOP_PROBE = r'''
import torch, triton, triton.language as tl
@triton.jit
def k(Y):
    s = 0.0
    for c in range(tl.program_id(0), 3):
        s += 1.0
    tl.store(Y + tl.program_id(0), s)
y = torch.zeros(3)
k[(3,)](y)
assert y.tolist() == [3.0, 2.0, 1.0], y
'''


# every snippet's kernels run with their loads and stores checked against their arguments' storage (triton_bounds)
BOUNDS_CHECKED = "import sys; sys.path.insert(0, 'tests'); import triton_bounds; triton_bounds.install()\n"


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-c", BOUNDS_CHECKED + code, *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=900)


@functools.cache
def interpreter_failure() -> str:
    """The last line of the probe loop's error under this environment's Triton interpreter ("" when it runs)."""
    out = _run(LOOP_PROBE)
    return "" if out.returncode == 0 else out.stderr.strip().splitlines()[-1][:300]


def run_interpreted(code: str, *args: str) -> str:
    """stdout of ``python -c code *args`` with TRITON_INTERPRET=1; fails the test with its stderr if it fails. Skips
    it only where the interpreter cannot run the probe loop and the snippet failed with the probe's error."""
    out = _run(code, *args)
    if out.returncode != 0:
        probe = interpreter_failure()
        if probe and probe in out.stderr:
            import numpy
            import triton

            pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run a loop over a program id with NumPy "
                        f"{numpy.__version__}: {probe}")
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout
