"""The ground-truth backend: every rank runs `reference_moe` on its own tokens with ALL experts' weights.

`load_experts` all-gathers the local expert weights once (EP > 1), so a forward pass needs no communication at all
and each rank's output is exactly `reference_moe` of its inputs. It holds E experts per rank: for tests and small
models, not for serving.

Failures across ranks: a call has no collective, so there is nothing to coordinate. A rank whose input the layer
rejects raises alone, and its peers, which do not wait for it, go on. The all-gather of `load_experts` waits for the
peers within the layer's `timeout_s` (CollectiveTimeoutError otherwise, see weave_moe.backends.coordination).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from weave_moe.backends.coordination import CallCoordinator
from weave_moe.models import MoESpec
from weave_moe.reference import reference_moe

__all__ = ["ReferenceBackend"]


class ReferenceBackend:
    """Pure-torch backend (any device, any EP); see the module docstring."""

    name = "reference"
    #: the layer checks ids itself (one host sync per call; reference_moe would index out of range)
    checks_expert_ids = False
    narrows_int64_ids = False
    capturable = False   # groups its rows by expert on the host
    last_plan = None

    def __init__(self, spec: MoESpec, group, rank: int, world_size: int, max_tokens_per_rank: int,
                 device: torch.device, policy: str = "weave", *, coordinator: CallCoordinator | None = None,
                 **options) -> None:
        if options:
            raise TypeError(f"reference backend: unknown options {sorted(options)}")
        self.spec, self.group, self.rank, self.world_size = spec, group, rank, world_size
        self.device = torch.device(device)
        self.coordinator = coordinator or CallCoordinator(group, rank, world_size, self.device)
        self.w13 = self.w2 = None

    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """w13 [E_local, 2I, H], w2 [E_local, H, I] bf16 (checked by the layer); gathered to [E, ...] when EP > 1."""
        if self.world_size > 1:
            w13 = self._all_gather_cat(w13.contiguous(), "the all-gather of w13")
            w2 = self._all_gather_cat(w2.contiguous(), "the all-gather of w2")
        self.w13, self.w2 = w13, w2

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                timings: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] bf16, topk_ids [T, k] int32 (global ids, -1 = none), topk_weights [T, k] fp32 -> [T, H] bf16."""
        failure = self.coordinator.take_failure()
        if failure is not None:  # the layer rejected this rank's input; no peer waits for this call
            raise failure
        return reference_moe(x, topk_ids, topk_weights, self.w13, self.w2)

    def synchronize(self) -> None:
        """Wait for this rank's last call (no peer is involved: a call has no collective)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _all_gather_cat(self, local: torch.Tensor, what: str) -> torch.Tensor:
        gathered = torch.empty((self.world_size * local.shape[0], *local.shape[1:]), dtype=local.dtype,
                               device=local.device)
        work = dist.all_gather_into_tensor(gathered, local, group=self.group, async_op=True)
        self.coordinator.wait(work, what)
        return gathered
