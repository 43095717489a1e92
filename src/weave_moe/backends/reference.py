"""The ground-truth backend: every rank runs `reference_moe` on its own tokens with ALL experts' weights.

`load_experts` all-gathers the local expert weights once (EP > 1), so a forward pass needs no communication at all
and each rank's output is exactly `reference_moe` of its inputs. It holds E experts per rank: for tests and small
models, not for serving.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from weave_moe.models import MoESpec
from weave_moe.reference import reference_moe

__all__ = ["ReferenceBackend"]


class ReferenceBackend:
    """Pure-torch backend (any device, any EP); see the module docstring."""

    name = "reference"
    checks_expert_ids = False   # the layer checks (reference_moe would index out of range)
    last_plan = None

    def __init__(self, spec: MoESpec, group, rank: int, world_size: int, max_tokens_per_rank: int,
                 device: torch.device, policy: str = "weave", **options) -> None:
        if options:
            raise TypeError(f"reference backend: unknown options {sorted(options)}")
        self.spec, self.group, self.rank, self.world_size = spec, group, rank, world_size
        self.device = torch.device(device)
        self.w13 = self.w2 = None

    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """w13 [E_local, 2I, H], w2 [E_local, H, I] bf16 (checked by the layer); gathered to [E, ...] when EP > 1."""
        if self.world_size > 1:
            w13 = _all_gather_cat(w13.contiguous(), self.world_size, self.group)
            w2 = _all_gather_cat(w2.contiguous(), self.world_size, self.group)
        self.w13, self.w2 = w13, w2

    def synchronize(self) -> None:
        """Backend protocol: wait for this rank's last call (no deferred errors here)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                timings: dict | None = None) -> torch.Tensor:
        """x [T, H] bf16, topk_ids [T, k] int32 (global ids, -1 = none), topk_weights [T, k] fp32 -> [T, H] bf16."""
        return reference_moe(x, topk_ids, topk_weights, self.w13, self.w2)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def _all_gather_cat(local: torch.Tensor, world_size: int, group) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts)
