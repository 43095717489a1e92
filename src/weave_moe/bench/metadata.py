"""What a result file records about the run that produced it: date, device, commit, command line, versions."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys

__all__ = ["collect_metadata", "git_commit"]


def git_commit(directory: str | None = None) -> str:
    """`git rev-parse HEAD` of the checkout holding this package, "-dirty" appended when tracked files changed;
    "unknown" outside a git checkout. WEAVE_MOE_GIT_COMMIT overrides it (a copy of the tree on a GPU box has no .git)."""
    if os.environ.get("WEAVE_MOE_GIT_COMMIT"):
        return os.environ["WEAVE_MOE_GIT_COMMIT"]
    directory = directory or os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=directory,
                                capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("-dirty" if status else "")


def collect_metadata(device: str = "auto", argv: list[str] | None = None) -> dict:
    """Metadata of a run started now with `argv` (default sys.argv) on `device` ("auto", "cuda", "cpu")."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "missing"
    use_cuda = device != "cpu" and torch.cuda.is_available()
    device_name = torch.cuda.get_device_name(0) if use_cuda else "cpu"
    argv = list(sys.argv if argv is None else argv)
    if argv:
        argv[0] = os.path.basename(argv[0])
    return dict(
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        device=device_name,
        device_short=device_name.replace("NVIDIA ", "").split()[0].lower() if use_cuda else "cpu",
        num_gpus=torch.cuda.device_count() if use_cuda else 0,
        host=platform.node(),
        git_commit=git_commit(),
        command=shlex.join(argv),
        versions=dict(python=platform.python_version(), torch=torch.__version__, triton=triton_version),
    )
