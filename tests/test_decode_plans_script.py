"""scripts/decode_plans.py (what the adaptive policy plans at decode sizes, on the CPU) runs and counts its plans."""

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "decode_plans.py"


def test_decode_plans_counts_every_plan_it_makes():
    for mode in (["--emulate"], []):
        done = subprocess.run([sys.executable, str(SCRIPT), "--tokens", "1,8", "--ep", "2", "--seeds", "1", *mode],
                              capture_output=True, text=True, timeout=300, check=True)
        total, serial = map(int, re.search(r"^(\d+) plans .*: (\d+) serial$", done.stdout, re.M).groups())
        # seven models at one EP (those E / EP and k allow), two sizes, two routings, one seed
        assert total > 0 and total % 4 == 0 and 0 <= serial <= total, done.stdout
        assert len(re.findall(r"^  not serial: ", done.stdout, re.M)) == total - serial, done.stdout
