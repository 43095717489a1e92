"""Pyflakes' errors (ruff's F rules: undefined names, unused imports, redefinitions) and syntax errors (E9) anywhere in
the repository's Python: the package, its scripts, examples and tests. A name used by a lambda after the scope `del`s
it, or an import a refactor left behind, fails here instead of in a device run."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_no_pyflakes_errors():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "F,E9",
                             "--output-format", "concise", "src", "scripts", "examples", "tests"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
