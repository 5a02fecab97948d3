"""Run a snippet under Triton's interpreter: TRITON_INTERPRET must be set before triton is imported, so the code
runs in a subprocess from the repository root (snippets add "tests" to sys.path to import test helpers)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_interpreted(code: str, *args: str) -> str:
    """stdout of ``python -c code *args`` with TRITON_INTERPRET=1; fails the test with its stderr if it fails."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout
