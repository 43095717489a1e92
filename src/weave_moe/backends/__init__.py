"""Backends of `ExpertParallelMoE`: each runs one MoE layer's forward on one rank and follows `Backend`.

    reference   pure torch, every rank holds every expert (the ground truth; tests and small models)
    nccl        all-to-all-v dispatch with dedup + torch._grouped_mm + all-to-all combine (gloo on the CPU)
    weave       the persistent megakernel (backends/weave/, CUDA only)

`weave_moe.layer` checks every input before it calls a backend, so a backend may assume valid shapes and dtypes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from weave_moe.plan import Plan

__all__ = ["Backend", "raise_on_bad_ids"]


class Backend(Protocol):
    """What `ExpertParallelMoE` and the bench harness call. Constructed as
    `cls(spec, group, rank, world_size, max_tokens_per_rank, device, policy="weave", **options)`; a backend rejects
    options it does not know (TypeError) and policies it does not have (ValueError).

    Attributes:
        name: the backend's name in `weave_moe.layer.BACKENDS`.
        checks_expert_ids: True if `forward` itself raises ValueError, on every rank in the same call, when an id
            lies outside [-1, E) (it reads counts every rank exchanges anyway); False: the layer checks (one host
            sync).
        narrows_int64_ids: True if `forward` takes int64 topk_ids and narrows them itself, without wrapping (ids
            outside [-1, E) stay outside it); False: the layer narrows them to int32 first (two elementwise
            launches).
        capturable: True if `forward` (without `timings`) may be captured into a caller's CUDA graph and replayed
            with new values written into the same input tensors, as serving engines run decode: no host sync, no
            host-side decision on the values, every rank replaying in step (weave's device-resident call); False:
            call it eagerly.
        last_plan: the schedule of this rank's last call (`weave_moe.plan.Plan`), None for backends without one.
    """

    name: str
    checks_expert_ids: bool
    narrows_int64_ids: bool
    capturable: bool
    last_plan: "Plan | None"

    def load_experts(self, w13: "torch.Tensor", w2: "torch.Tensor") -> None:
        """This rank's experts: w13 [E_local, 2I, H] (gate rows, then up rows), w2 [E_local, H, I], bf16, contiguous,
        on the backend's device (checked by the layer)."""

    def forward(self, x: "torch.Tensor", topk_ids: "torch.Tensor", topk_weights: "torch.Tensor",
                timings: dict | None = None, out: "torch.Tensor | None" = None) -> "torch.Tensor":
        """x [T, H] bf16 (T may be 0), topk_ids [T, k] int32 global ids (-1 = none; int64 where `narrows_int64_ids`),
        topk_weights [T, k] fp32
        -> [T, H] bf16. `timings`, when a dict, receives per-stage milliseconds (names are the backend's). `out`,
        when given ([T, H] bf16, contiguous, on the device; checked by the layer), is where the caller wants the
        result: a backend may write it there and return `out`, or return another tensor, which the layer copies."""

    def synchronize(self) -> None:
        """Wait for this rank's last call and raise any error it deferred (e.g. a kernel timeout)."""


def raise_on_bad_ids(bad_per_rank, num_experts: int) -> None:
    """Raise ValueError if any rank's count of expert ids outside [-1, E) is non-zero.

    Backends that exchange per-rank counts anyway (nccl's count all-to-all, weave's gathered counts) carry this count
    with them and call this on every rank after the exchange, so every rank raises in the same call and no peer is
    left waiting in a collective.
    """
    if any(bad_per_rank):
        where = ", ".join(f"rank {r}: {n}" for r, n in enumerate(bad_per_rank) if n)
        raise ValueError(f"topk_ids must be in [-1, {num_experts}) (-1 = no expert); ids out of range on {where}")
