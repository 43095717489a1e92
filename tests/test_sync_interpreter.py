"""sync.wait_all_at_least under the Triton interpreter: n flags polled at once, met and timed out (the status word
names the first unmet flag, by index or by group), flags expecting 0 never read, and a wait that finds the status
word already set."""

from interpreter import run_interpreted

SCRIPT = r"""
import torch
import triton
import triton.language as tl
from weave_moe.backends.weave.kernels import sync

@triton.jit
def probe(flags_ptr, expected_ptr, n, status_ptr, result_ptr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    ok = sync.wait_all_at_least(flags_ptr, expected_ptr, n, status_ptr, sync.ERROR_ARRIVAL_TIMEOUT, 32, 5000,
                                BLOCK, True, GROUP)
    tl.store(result_ptr, ok)

def run(flags, expected, n, status=None, group=0):
    status = torch.zeros(4, dtype=torch.int32) if status is None else status
    result = torch.full((1,), -1, dtype=torch.int32)
    probe[(1,)](torch.tensor(flags, dtype=torch.int32), torch.tensor(expected, dtype=torch.int32), n, status, result,
                BLOCK=8, GROUP=group)
    return int(result.item()), status.tolist()

# met: every flag at or above its expected count (flags past n and flags expecting 0 are ignored)
assert run([3, 0, 5, 9, 0, 0, 0, 0], [3, 0, 4, 9, 7, 7, 7, 7], 4) == (1, [0, 0, 0, 0])
# unmet: flag 2 stays below: a timeout naming flag tag 32 + 2, the value seen and the one expected
assert run([3, 0, 1, 9, 0, 0, 0, 0], [3, 0, 4, 9, 0, 0, 0, 0], 4) == (0, [sync.ERROR_ARRIVAL_TIMEOUT.value, 34, 1, 4])
# two unmet: the first is named
assert run([0, 0, 1, 0, 0, 0, 0, 0], [0, 2, 4, 0, 0, 0, 0, 0], 8) == (0, [sync.ERROR_ARRIVAL_TIMEOUT.value, 33, 0, 2])
# flags in groups of 4 (a source's chunks): flag 6 is group 1's flag 2, tag 32 + 1 * 16 + 2
assert run([1, 1, 1, 1, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1, 1, 1], 8, group=4) == (
    0, [sync.ERROR_ARRIVAL_TIMEOUT.value, 50, 0, 1])
# another wait failed before: return at once, the first error kept
status = torch.tensor([3, 7, 1, 2], dtype=torch.int32)
assert run([0] * 8, [1] * 8, 8, status) == (0, [3, 7, 1, 2])
print("SYNC OK")
"""


def test_wait_all_at_least_under_interpreter():
    run_interpreted(SCRIPT, "SYNC OK", timeout=300)
