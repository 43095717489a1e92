"""The expert stage's helpers (backends/expert_stage.py): their Triton kernels, run under TRITON_INTERPRET=1 on the CPU,
against their torch paths (which the backends' CPU tests use), on small odd shapes with partial blocks.

Data movement (gather_rows, and gather_weighted_sum with weight 1 and one slot) is checked bitwise; SiLU-mul and the
weighted sum to 1 bf16 ulp of the torch path (both compute in fp32 and round once; the kernel's sigmoid and the
summation order may differ in the last fp32 bits, which can flip one bf16 rounding). Rows past the device-side limits
must stay untouched (poisoned), and NaN in rows past the pair limit must not leak into the sums.
"""

import textwrap

import pytest
import torch
from interpreter import run_interpreted

SCRIPT = textwrap.dedent(
    r"""
    import torch
    from weave_moe.backends import expert_stage as stage

    torch.manual_seed(0)
    H, I, k = 72, 40, 3

    def close_bf16(a, b):
        a, b = a.float(), b.float()
        return bool(((a - b).abs() <= 2 ** -7 * b.abs() + 1e-6).all())

    # gather_rows: index // k, limit 7 of 10 rows; rows past the limit stay NaN
    src = torch.randn(6, H).to(torch.bfloat16)
    index = torch.randint(0, 6 * k, (10,))
    out = torch.full((10, H), float("nan"), dtype=torch.bfloat16)
    limit = torch.tensor([7], dtype=torch.int32)
    stage.gather_rows(src, index, out, limit, index_divisor=k, use_triton=True)
    want = stage.gather_rows(src, index, torch.empty(10, H, dtype=torch.bfloat16), limit, index_divisor=k,
                             use_triton=False)
    assert torch.equal(out[:7], want[:7]), "gather_rows"
    assert torch.isnan(out[7:].float()).all(), "gather_rows wrote past the limit"

    # silu_mul on a strided input (a row stride wider than 2I), limit 5 of 9
    gate_up = torch.randn(9, 2 * I + 8).to(torch.bfloat16)[:, : 2 * I]
    out = torch.full((9, I), float("nan"), dtype=torch.bfloat16)
    limit = torch.tensor([5], dtype=torch.int32)
    stage.silu_mul(gate_up, out, limit, use_triton=True)
    want = stage.silu_mul(gate_up, torch.empty(9, I, dtype=torch.bfloat16), limit, use_triton=False)
    assert close_bf16(out[:5], want[:5]), "silu_mul"
    assert torch.isnan(out[5:].float()).all(), "silu_mul wrote past the limit"

    # gather_weighted_sum: k slots, -1 and indices past the limit skipped, NaN rows past the limit never read
    src = torch.randn(20, H).to(torch.bfloat16)
    src[15:] = float("nan")
    index = torch.randint(-1, 20, (11, k), dtype=torch.int32)
    index[0] = -1  # a row with no valid slot: zero
    weights = torch.rand(11, k)
    limit = torch.tensor([15], dtype=torch.int32)
    out = torch.full((11, H), float("nan"), dtype=torch.bfloat16)
    stage.gather_weighted_sum(src, index, weights, out, limit, use_triton=True)
    want = stage.gather_weighted_sum(src, index, weights, torch.empty(11, H, dtype=torch.bfloat16), limit,
                                     use_triton=False)
    assert close_bf16(out, want), "gather_weighted_sum"
    assert (out[0] == 0).all(), "gather_weighted_sum: a row without valid slots must be zero"

    # transposed int64 index, no weights, one valid slot per row: bitwise; row_limit leaves the tail untouched
    index = torch.full((3, 5), -1, dtype=torch.int64)
    index[1] = torch.arange(5)
    index = index.t()  # [5, 3], strides (1, 5)
    out = torch.full((5, H), float("nan"), dtype=torch.bfloat16)
    no_limit = torch.tensor([2 ** 31 - 1], dtype=torch.int32)
    stage.gather_weighted_sum(src, index, None, out, no_limit, row_limit=torch.tensor([4], dtype=torch.int32),
                              use_triton=True)
    assert torch.equal(out[:4], src[:4]), "gather_weighted_sum: weight-1 single slot is a bitwise copy"
    assert torch.isnan(out[4:].float()).all(), "gather_weighted_sum wrote past row_limit"
    print("OK")
    """
)


def test_expert_stage_kernels_match_torch_paths():
    run_interpreted(SCRIPT, "OK", timeout=300)


@pytest.mark.parametrize("num_local_experts, ids_dtype", [(16, torch.int64), (300, torch.int64), (300, torch.int32)])
def test_grouped_experts_matches_reference(num_local_experts: int, ids_dtype: torch.dtype):
    """The stage's torch path, uint8 and int32 sort keys, int32 and int64 ids (DeepEP's), strided ids, -1 holes."""
    from weave_moe.backends.expert_stage import GroupedExperts
    from weave_moe.models import MoESpec
    from weave_moe.reference import DEFAULT_TOLERANCE, moe_error, reference_moe
    from weave_moe.testing import make_experts

    spec = MoESpec(num_local_experts, 4, 64, 32)
    w13, w2 = make_experts(spec)
    stage = GroupedExperts(num_local_experts, 64, 32, max_slots=400, max_pairs=400, device=torch.device("cpu"))
    stage.load(w13, w2)
    generator = torch.Generator().manual_seed(num_local_experts)
    x = torch.randn(100, 64, generator=generator).to(torch.bfloat16)
    packed = torch.randint(-1, num_local_experts, (100, 6), generator=generator, dtype=ids_dtype)
    ids = packed[:, 1:5]  # strided, as the nccl backend's packed rows are
    weights = torch.rand(100, 4, generator=generator)
    out = torch.full((100, 64), float("nan"), dtype=torch.bfloat16)
    stage.run(x, ids, weights, out)
    assert moe_error(out, reference_moe(x, ids, weights, w13, w2))[0] <= DEFAULT_TOLERANCE
