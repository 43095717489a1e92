"""The single-process ground truth of one MoE layer (docs/design.md, "Semantics").

    out[t] = sum_j topk_weights[t, j] * W2[e] @ (silu(Wg[e] @ x[t]) * (Wu[e] @ x[t])),   e = topk_ids[t, j] != -1

Every backend, `bench --check` and the simulator compare against `reference_moe`; it is never copied.

Shape legend: T = tokens, k = top-k, E = experts, H = hidden size, I = intermediate size of one expert.

Tolerance (`assert_moe_close`, rel. Frobenius error <= 1e-2). One bf16 rounding (8 significant bits) adds a relative
error of about 0.15-0.2% RMS, and a backend legitimately rounds where this function does not:
  * gate/up (the GEMM0 output) before SiLU-mul, and y (the GEMM1 output) before the weighted sum, when its grouped
    GEMM writes bf16 (torch._grouped_mm does);
  * h itself from a slightly different gate/up, so its rounding no longer coincides with this function's;
  * each rank's partial sum before the combine (all-to-all backends send bf16);
  * the output (both round it, but from slightly different fp32 values);
  * plus a different fp32 accumulation order (~1e-6, negligible).
Four or five such independent roundings add up to ~0.5% RMS, which is what the nccl backend measures on random O(1)
data (tests and `weave-moe demo` print it), so 1e-2 leaves 2x headroom. A genuine bug (a dropped or duplicated
expert, a wrong weight, a misplaced row) moves the output by about the routing weight it touches, 1/k on average
(12% at k = 8), well above 1e-2.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

__all__ = ["reference_moe", "moe_error", "assert_moe_close", "DEFAULT_TOLERANCE"]

#: Relative Frobenius error allowed between a bf16 backend and `reference_moe` (reason in the module docstring).
DEFAULT_TOLERANCE = 1e-2


@contextlib.contextmanager
def _ieee_fp32_matmul():
    """fp32 matmuls in full precision (no TF32) for the ground truth, whatever the caller set globally."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def reference_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """One MoE layer on one device, the slow and obvious way (a loop over experts that have rows).

    Args:
        x: [T, H] bf16 tokens.
        topk_ids: [T, k] int32/int64 expert ids in [0, E); -1 means no expert (that slot adds nothing).
        topk_weights: [T, k] fp32 routing weights (not renormalised here).
        w13: [E, 2*I, H] bf16, gate rows then up rows (vLLM / SGLang FusedMoE layout).
        w2: [E, H, I] bf16 down projection.

    Returns:
        [T, H] bf16. GEMMs accumulate in fp32, h = silu(gate) * up is rounded to bf16 before GEMM1 (as the kernels
        do), the weighted sum over a token's experts is fp32, and only the final result is rounded to bf16. A token
        whose ids are all -1 gets a zero row.
    """
    num_tokens, hidden_size = x.shape
    top_k = topk_ids.shape[1]
    num_experts, two_i, _ = w13.shape
    intermediate_size = two_i // 2
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=x.device)
    if num_tokens == 0 or top_k == 0:
        return out.to(torch.bfloat16)

    flat_ids = topk_ids.reshape(-1).long()
    flat_weights = topk_weights.reshape(-1).float()
    # -1 sorts into a sentinel bucket E after every real expert, so one stable sort groups pairs by expert.
    sort_keys = torch.where(flat_ids >= 0, flat_ids, num_experts)
    pair_order = torch.argsort(sort_keys, stable=True)
    expert_counts = torch.bincount(sort_keys, minlength=num_experts + 1)[:num_experts].tolist()

    with _ieee_fp32_matmul():
        start = 0
        for expert, count in enumerate(expert_counts):
            if count == 0:
                continue
            pairs = pair_order[start : start + count]
            start += count
            rows = pairs // top_k
            x_expert = x.index_select(0, rows).float()  # [n, H]
            gate_up = x_expert @ w13[expert].float().t()  # [n, 2I]
            gate, up = gate_up[:, :intermediate_size], gate_up[:, intermediate_size:]
            h = (F.silu(gate) * up).to(torch.bfloat16).float()  # [n, I], rounded as the kernels round it
            y = h @ w2[expert].float().t()  # [n, H]
            out.index_add_(0, rows, y * flat_weights[pairs, None])
    return out.to(torch.bfloat16)


def moe_error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative Frobenius error, max abs error / max abs of ref) of `out` against `ref`, both computed in fp32.

    NaN or Inf anywhere in `out` gives (inf, inf). When `ref` is all zeros the errors are absolute.
    """
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: out {tuple(out.shape)} vs ref {tuple(ref.shape)}")
    if out.numel() == 0:
        return 0.0, 0.0
    out32, ref32 = out.float(), ref.float()
    if not torch.isfinite(out32).all():
        return float("inf"), float("inf")
    diff = out32 - ref32
    ref_norm = ref32.norm().item()
    ref_max = ref32.abs().max().item()
    rel_fro = diff.norm().item() / (ref_norm if ref_norm > 0 else 1.0)
    max_abs = diff.abs().max().item() / (ref_max if ref_max > 0 else 1.0)
    return rel_fro, max_abs


def assert_moe_close(out: torch.Tensor, ref: torch.Tensor, tol: float = DEFAULT_TOLERANCE) -> None:
    """Raise AssertionError unless `out` has no NaN/Inf and its relative Frobenius error to `ref` is <= `tol`."""
    if torch.isnan(out.float()).any():
        bad_rows = torch.isnan(out.float()).any(dim=-1).nonzero().flatten()[:8].tolist()
        raise AssertionError(f"output has NaN in rows {bad_rows} (first 8)")
    rel_fro, max_abs = moe_error(out, ref)
    if not rel_fro <= tol:
        raise AssertionError(f"relative Frobenius error {rel_fro:.3e} > {tol:.1e} (max abs normalised {max_abs:.3e})")
