"""The DeepEP baseline: DeepEP's normal-mode intranode dispatch / combine + grouped GEMM over local experts.

What vLLM and SGLang run for expert parallelism on one node, and the baseline of the paper: DeepEP's `Buffer`
(NVLink kernels on `Buffer.num_sms` SMs) moves each token once to every rank hosting any of its experts and sums
the per-rank partials back; between them this rank's experts run as in the nccl backend (`GroupedExperts`: sort,
gather, `torch._grouped_mm`, SiLU-mul, `torch._grouped_mm`, weighted sum per received row, bf16 out).

Per call (EP > 1):
  1. `Buffer.get_dispatch_layout(topk_idx int64, E)`: tokens per rank / expert and which ranks each token visits;
  2. `Buffer.dispatch(x, topk_idx, topk_weights, ...)`: received rows x [R, H] bf16, topk_idx [R, k] int64 local to
     this rank (-1 elsewhere), topk_weights [R, k] fp32. In normal mode DeepEP waits on the host for the received
     counts (its one host sync per call, inside DeepEP) and returns them per local expert;
  3. the expert stage writes each received row's weighted expert sum (bf16) into a reusable buffer;
  4. `Buffer.combine(partial, handle)` sums every token's partials from the ranks it visited -> [T, H] bf16.
DeepEP allocates its outputs per call (its API); this backend's own buffers are sized once.

DeepEP is not a dependency and none of its code is in this repository: the backend is used when `import deep_ep`
works (v1.2.1 is the version measured; `scripts/build_deepep.sh SRC_DIR` builds and installs it from a checkout of
its public source);
otherwise constructing it raises RuntimeError. DeepEP supports 2, 4 or 8 ranks per node here (its configs); with
no process group (EP=1) nothing is exchanged and the expert stage runs alone. `info` records DeepEP's version and
SM count for benchmark reports.
"""

from __future__ import annotations

import importlib
import importlib.metadata

import torch

from weave_moe.backends.coordination import CallCoordinator
from weave_moe.backends.expert_stage import GroupedExperts, StageTimer
from weave_moe.models import MoESpec

__all__ = ["DeepEPBackend", "DEFAULT_NUM_SMS"]

#: SMs DeepEP's normal kernels use (DeepEP's own default is 20; its README and the measured peer use 24).
DEFAULT_NUM_SMS = 24
_SUPPORTED_RANKS = (2, 4, 8)  # intranode configs DeepEP ships (get_dispatch_config / get_combine_config)


def _import_deep_ep():
    try:
        return importlib.import_module("deep_ep")
    except ImportError as error:
        raise RuntimeError(f"deepep backend needs DeepEP (`import deep_ep` failed: {error}). Build and install it "
                           f"from DeepEP's public source (v1.2.1) for this torch and CUDA: scripts/build_deepep.sh "
                           f"SRC_DIR in the weave-moe repository") from error


class DeepEPBackend:
    """DeepEP intranode dispatch / combine + grouped GEMM (see the module docstring). CUDA only.

    Options:
        num_sms: SMs for DeepEP's dispatch / combine kernels (even; default DEFAULT_NUM_SMS).

    Failures across ranks (weave_moe.backends.coordination): DeepEP's exchanges take no header, so a call is not
    checked for its layer and call number (construction is). A rank whose input the layer rejects still makes the
    call with T = 0 (the layer hands it empty inputs), so no peer waits for it: that rank alone raises, the others
    get their correct outputs. Waits inside DeepEP are bounded by DeepEP's own timeouts, not the layer's timeout_s.
    """

    name = "deepep"
    last_plan = None  # no weave plan
    checks_expert_ids = False  # the layer checks ids (one host sync) when asked to
    narrows_int64_ids = False
    capturable = False   # its dispatch reads the received counts on the host

    def __init__(self, spec: MoESpec, group, rank: int, world_size: int, max_tokens_per_rank: int,
                 device: torch.device, policy: str = "weave", num_sms: int = DEFAULT_NUM_SMS, *,
                 coordinator: CallCoordinator | None = None, **options) -> None:
        if options:
            raise TypeError(f"deepep backend: unknown options {sorted(options)}")
        self.coordinator = coordinator  # held, not used: see the class docstring
        device = torch.device(device)
        if device.type != "cuda":
            raise RuntimeError(f"deepep backend needs a CUDA device, got {device}")
        if not isinstance(num_sms, int) or num_sms <= 0 or num_sms % 2:
            raise ValueError(f"num_sms must be a positive even int (DeepEP's requirement), got {num_sms!r}")
        deep_ep = _import_deep_ep()
        self.spec, self.group, self.rank, self.world_size = spec, group, rank, world_size
        self.device = device
        self.max_tokens_per_rank = max_tokens_per_rank
        self.num_local_experts = spec.num_experts // world_size
        self.use_exchange = group is not None
        if self.use_exchange and world_size not in _SUPPORTED_RANKS:
            raise ValueError(f"deepep backend: DeepEP's intranode configs cover {_SUPPORTED_RANKS} ranks, got "
                             f"EP={world_size}")
        hidden, top_k = spec.hidden_size, spec.top_k
        max_rows = world_size * max_tokens_per_rank if self.use_exchange else max_tokens_per_rank
        self.experts = GroupedExperts(self.num_local_experts, hidden, spec.intermediate_size,
                                      max_slots=max_rows * top_k,
                                      max_pairs=max_rows * min(top_k, self.num_local_experts), device=device)
        self.use_grouped_mm = self.experts.use_grouped_mm
        self.buffer = None
        num_nvl_bytes = 0
        if self.use_exchange:
            self._partial = torch.empty(max_rows, hidden, dtype=torch.bfloat16, device=device)
            deep_ep.Buffer.set_num_sms(num_sms)
            self._dispatch_config = deep_ep.Buffer.get_dispatch_config(world_size)
            self._combine_config = deep_ep.Buffer.get_combine_config(world_size)
            hidden_bytes = hidden * 2  # bf16 rows
            num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, world_size)
                                for config in (self._dispatch_config, self._combine_config))
            self.buffer = deep_ep.Buffer(group, num_nvl_bytes, 0)
        try:
            version = importlib.metadata.version("deep_ep")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown (deep_ep imported, no package metadata)"
        #: What a benchmark reports beside this backend's times.
        self.info = {"deep_ep_version": version, "num_sms": deep_ep.Buffer.num_sms if self.use_exchange else 0,
                     "num_nvl_bytes": num_nvl_bytes, "exchange": self.use_exchange}

    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """w13 [E_local, 2I, H], w2 [E_local, H, I] bf16 on this backend's device (checked by the layer)."""
        self.w13, self.w2 = w13, w2
        self.experts.load(w13, w2)

    def synchronize(self) -> None:
        """Wait for this rank's last call (DeepEP raises its errors in the call itself)."""
        torch.cuda.synchronize(self.device)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                timings: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] bf16, topk_ids [T, k] int32 in [-1, E), topk_weights [T, k] fp32 -> [T, H] bf16.

        timings: per-stage ms as in the nccl backend ("dispatch" = layout + DeepEP dispatch, "permute", "gemms",
        "unpermute", "combine" = DeepEP combine, "total"); the call then synchronizes.
        """
        timer = StageTimer(self.device, timings is not None)
        if not self.use_exchange:
            return self.experts.forward_local(x, topk_ids, topk_weights, timer, timings)
        topk_idx = topk_ids.to(torch.int64)  # DeepEP's index dtype
        num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = self.buffer.get_dispatch_layout(
            topk_idx, self.spec.num_experts)
        recv_x, recv_ids, recv_weights, recv_per_expert, handle, _ = self.buffer.dispatch(
            x.contiguous(), num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
            config=self._dispatch_config)
        timer.mark("dispatch")
        partial = self._partial[: recv_x.shape[0]]
        self.experts.run(recv_x, recv_ids, recv_weights, partial, num_pairs=sum(recv_per_expert), timer=timer)
        out, _, _ = self.buffer.combine(partial, handle, config=self._combine_config)
        timer.mark("combine")
        timer.finish(timings)
        return out
