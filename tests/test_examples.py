"""The torchrun example runs as documented on the CPU (2 gloo ranks, nccl backend) and checks itself."""

import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torchrun_moe.py"


def test_torchrun_example_on_two_cpu_ranks():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(EXAMPLE), "--steps", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    # 2 ranks x 2 steps, each checked against the reference (the ranks' lines may interleave)
    assert result.stdout.count("error vs reference") == 4, result.stdout
