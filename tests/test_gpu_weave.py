"""The weave backend on 2 GPUs: every policy against the reference (edge cases), a stalled peer, back-to-back calls.

The full matrix (six paper models x 2048/8192 tokens x uniform/skewed) runs as `python -m weave_moe.validate
--suite all` and is recorded under bench/results/.
"""

import pytest

from weave_moe.validate import ALL_VARIANTS, EDGE_CASES, check_worker
from weave_moe.testing import run_distributed

pytestmark = pytest.mark.multigpu


def test_every_policy_matches_reference_on_edge_cases():
    rows = run_distributed(check_worker, 2, EDGE_CASES, ALL_VARIANTS, {}, backend="nccl", timeout_s=900)
    failed = [row for per_rank in rows for row in per_rank if not row["passed"]]
    assert not failed, failed


def test_stalled_peer_bad_ids_and_failures_raise_and_back_to_back_calls_hold():
    rows = run_distributed(check_worker, 2, [], [], dict(stress_calls=200, stall=True, bad_ids=True, failures=True), backend="nccl",
                           timeout_s=600)
    failed = [row for per_rank in rows for row in per_rank if not row["passed"]]
    assert not failed, failed
