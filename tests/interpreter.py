"""Run a test script under the Triton interpreter (TRITON_INTERPRET=1) in a fresh Python process.

The interpreter is switched on by the environment before Triton is imported, so each script runs in its own process;
its source tree is this checkout's `src` (first on PYTHONPATH), whatever the installed package points at.
"""

import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parent.parent / "src")


def run_interpreted(script: str, marker: str, *argv: str, timeout: int = 600) -> str:
    """Run `script` with `argv`; assert it exits 0 and prints `marker`. Returns its stdout."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", script, *argv], env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert marker in result.stdout, result.stdout[-3000:]
    return result.stdout
