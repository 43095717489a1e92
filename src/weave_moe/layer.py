"""`ExpertParallelMoE` and `moe_forward`: input checks, backend choice, weights. The math lives in the backends.

    layer = ExpertParallelMoE(spec, group=None, backend="weave", max_tokens_per_rank=8192)
    layer.load_experts(w13, w2)                 # this rank's experts [E_local, 2I, H], [E_local, H, I] bf16
    out = layer(x, topk_ids, topk_weights)      # [T, H] bf16, [T, k] int (-1 = none), [T, k] fp32 -> [T, H] bf16

Every check a backend relies on (docs/architecture.md, "Backend contract") happens here, once, with an error that
names the argument, what was expected and what was given.
"""

from __future__ import annotations

import importlib

import torch

from weave_moe.models import MoESpec

__all__ = ["ExpertParallelMoE", "moe_forward", "BACKENDS", "DEFAULT_POLICY"]

#: backend name -> (module, class). Modules load on first use, so "weave" pulls in Triton only when chosen.
BACKENDS = {
    "reference": ("weave_moe.backends.reference", "ReferenceBackend"),
    "nccl": ("weave_moe.backends.nccl", "NcclBackend"),
    "weave": ("weave_moe.backends.weave", "WeaveBackend"),
    "symm": ("weave_moe.backends.symm", "SymmBackend"),
    "deepep": ("weave_moe.backends.deepep", "DeepEPBackend"),
}
#: Backends that take a schedule policy; the others accept only the default.
_POLICY_BACKENDS = {"weave"}
DEFAULT_POLICY = "weave"


def _backend_class(name: str):
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    module_name, class_name = BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(f"backend {name!r} is not available: importing {module_name} failed ({error}). "
                          f"The 'nccl' and 'reference' backends need only torch.") from error
    return getattr(module, class_name)


def _resolve_group(group):
    """(group, rank, world_size): group=None means the default process group if one exists, else EP=1."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    if group is None:
        if not initialized:
            return None, 0, 1
        group = dist.group.WORLD
    elif not initialized:
        raise ValueError("a process group was given but torch.distributed is not initialised")
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return None, 0, 1
    return group, dist.get_rank(group), world_size


def _resolve_device(device, group) -> torch.device:
    if device is None:
        import torch.distributed as dist

        uses_gloo = group is not None and dist.get_backend(group) == "gloo"
        device = "cuda" if torch.cuda.is_available() and not uses_gloo else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class ExpertParallelMoE(torch.nn.Module):
    """One expert-parallel MoE layer; this rank holds experts [rank * E_local, (rank + 1) * E_local).

    Args:
        spec: the layer's shape (MoESpec).
        group: process group of the EP ranks; None = the default group if torch.distributed is initialised, else
            a single process (EP=1).
        backend: "weave" (the megakernel), "nccl" (all-to-all baseline) or "reference" (pure torch, for tests).
        max_tokens_per_rank: the largest T a call may pass; buffers are sized for it.
        policy: schedule policy of the weave backend (serial, spatial, static:<c>[,K], per_iteration, weave).
        device: where x, ids, weights and experts live; None = the current CUDA device (unless the group is gloo),
            else CPU.
        check_expert_ids: verify every id is in [-1, E) on each call. With EP > 1 the nccl backend checks inside
            its count exchange and the weave backend inside the counts it reads anyway (the weave backend always
            checks): no extra sync, and every rank raises in the same call, so no peer is left waiting. At EP = 1
            and for the reference backend it costs one device-to-host sync (benchmarks turn it off).
        **backend_options: passed to the backend (each backend rejects options it does not know).

    Expert weights are held by the backend, not registered as parameters: `.to()` does not move them.
    """

    def __init__(self, spec: MoESpec, group=None, backend: str = "weave", max_tokens_per_rank: int = 8192,
                 policy: str = DEFAULT_POLICY, device=None, check_expert_ids: bool = True, **backend_options) -> None:
        super().__init__()
        if not isinstance(spec, MoESpec):
            raise TypeError(f"spec must be a MoESpec, got {type(spec).__name__}")
        if not isinstance(max_tokens_per_rank, int) or max_tokens_per_rank <= 0:
            raise ValueError(f"max_tokens_per_rank must be a positive int, got {max_tokens_per_rank!r}")
        if not isinstance(policy, str):
            raise TypeError(f"policy must be a str, got {type(policy).__name__}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if policy != DEFAULT_POLICY and backend not in _POLICY_BACKENDS:
            raise ValueError(f"policy={policy!r} applies to the weave backend only; backend {backend!r} has no "
                             f"schedule policies")
        self.spec = spec
        self.group, self.rank, self.world_size = _resolve_group(group)
        if spec.num_experts % self.world_size:
            raise ValueError(f"num_experts={spec.num_experts} is not divisible by the EP size {self.world_size}")
        self.num_local_experts = spec.num_experts // self.world_size
        self.max_tokens_per_rank = max_tokens_per_rank
        self.device = _resolve_device(device, self.group)
        self.check_expert_ids = check_expert_ids
        self.backend_name, self.policy = backend, policy
        self.backend = _backend_class(backend)(spec, self.group, self.rank, self.world_size, max_tokens_per_rank,
                                               self.device, policy=policy, **backend_options)
        self._loaded = False

    @property
    def first_expert(self) -> int:
        """Global id of this rank's first expert."""
        return self.rank * self.num_local_experts

    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Load this rank's experts (moved to the layer's device if needed).

        Args:
            w13: [E_local, 2*I, H] bf16, gate rows then up rows (vLLM / SGLang FusedMoE layout).
            w2: [E_local, H, I] bf16.
        """
        e_local, hidden, intermediate = self.num_local_experts, self.spec.hidden_size, self.spec.intermediate_size
        for name, weight, shape in (("w13", w13, (e_local, 2 * intermediate, hidden)),
                                    ("w2", w2, (e_local, hidden, intermediate))):
            if not isinstance(weight, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(weight).__name__}")
            if tuple(weight.shape) != shape:
                raise ValueError(f"{name} must have shape {list(shape)} ([E_local, ...] with E_local = "
                                 f"{self.spec.num_experts} / EP {self.world_size}), got {list(weight.shape)}")
            if weight.dtype != torch.bfloat16:
                raise TypeError(f"{name} must be bfloat16, got {weight.dtype}")
        self.backend.load_experts(w13.to(self.device).contiguous(), w2.to(self.device).contiguous())
        self._loaded = True

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                timings: dict | None = None) -> torch.Tensor:
        """x [T, H] bf16, topk_ids [T, k] int32/int64 global expert ids (-1 = none), topk_weights [T, k] fp32.

        Returns [T, H] bf16. T may be 0 (the rank still takes part in the collectives). `timings`, when given, is
        passed to the backend (the nccl backend fills in per-stage milliseconds on CUDA).
        """
        if not self._loaded:
            raise RuntimeError("forward called before load_experts(w13, w2)")
        topk_ids = self._check_inputs(x, topk_ids, topk_weights)
        return self.backend.forward(x, topk_ids, topk_weights.contiguous(), timings=timings)

    def synchronize(self) -> None:
        """Wait for this rank's last call and raise any error it deferred (the weave kernel's WeaveTimeoutError)."""
        self.backend.synchronize()

    @property
    def last_plan(self):
        """The schedule (`weave_moe.plan.Plan`) of this rank's last call; None for backends without one."""
        return self.backend.last_plan

    def _check_inputs(self, x, topk_ids, topk_weights) -> torch.Tensor:
        """Raise on bad input; return topk_ids as contiguous int32."""
        for name, tensor in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
            if tensor.dim() != 2:
                raise ValueError(f"{name} must be 2-D, got shape {list(tensor.shape)}")
            if tensor.device != self.device:
                raise ValueError(f"{name} is on {tensor.device} but the layer is on {self.device}")
        num_tokens, hidden = x.shape
        top_k = self.spec.top_k
        if hidden != self.spec.hidden_size:
            raise ValueError(f"x must have shape [T, {self.spec.hidden_size}] (hidden_size), got {list(x.shape)}")
        if x.dtype != torch.bfloat16:
            raise TypeError(f"x must be bfloat16, got {x.dtype}")
        if tuple(topk_ids.shape) != (num_tokens, top_k):
            raise ValueError(f"topk_ids must have shape [T, top_k] = [{num_tokens}, {top_k}], got "
                             f"{list(topk_ids.shape)}")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
        if tuple(topk_weights.shape) != (num_tokens, top_k):
            raise ValueError(f"topk_weights must have shape [T, top_k] = [{num_tokens}, {top_k}], got "
                             f"{list(topk_weights.shape)}")
        if topk_weights.dtype != torch.float32:
            raise TypeError(f"topk_weights must be float32, got {topk_weights.dtype}")
        if num_tokens > self.max_tokens_per_rank:
            raise ValueError(f"T={num_tokens} tokens exceeds max_tokens_per_rank={self.max_tokens_per_rank}")
        if self.check_expert_ids and topk_ids.numel() and not self.backend.checks_expert_ids:
            low, high = torch.stack([topk_ids.min(), topk_ids.max()]).tolist()
            if low < -1 or high >= self.spec.num_experts:
                raise ValueError(f"topk_ids must be in [-1, {self.spec.num_experts}) (-1 = no expert), got values in "
                                 f"[{low}, {high}]")
        return topk_ids.to(torch.int32).contiguous()

    def extra_repr(self) -> str:
        return (f"spec={self.spec.name}, backend={self.backend_name}, policy={self.policy}, "
                f"rank={self.rank}/{self.world_size}, device={self.device}")


_LAYER_CACHE: dict[tuple, ExpertParallelMoE] = {}
_LAYER_CACHE_SIZE = 8


def moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, *, group=None, backend: str = "weave", policy: str = DEFAULT_POLICY,
                max_tokens_per_rank: int = 8192, **backend_options) -> torch.Tensor:
    """Functional form of `ExpertParallelMoE`: the spec is read off the shapes (E = E_local * EP).

    Layers are cached per (shape, group, backend, policy, device, max_tokens_per_rank, options), so repeated calls
    reuse buffers; the weights are (re)loaded on every call. Arguments as in `ExpertParallelMoE` and its forward.
    """
    resolved_group, _, world_size = _resolve_group(group)
    if not isinstance(w13, torch.Tensor) or w13.dim() != 3:
        raise ValueError("w13 must be a 3-D tensor [E_local, 2*I, H]")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise ValueError("topk_ids must be a 2-D tensor [T, top_k]")
    spec = MoESpec(num_experts=w13.shape[0] * world_size, top_k=topk_ids.shape[1], hidden_size=w13.shape[2],
                   intermediate_size=w13.shape[1] // 2)
    key = (spec, id(resolved_group), backend, policy, x.device, max_tokens_per_rank,
           tuple(sorted(backend_options.items())))
    layer = _LAYER_CACHE.get(key)
    if layer is None:
        if len(_LAYER_CACHE) >= _LAYER_CACHE_SIZE:
            _LAYER_CACHE.clear()
        layer = ExpertParallelMoE(spec, group=resolved_group, backend=backend, max_tokens_per_rank=max_tokens_per_rank,
                                  policy=policy, device=x.device, **backend_options)
        _LAYER_CACHE[key] = layer
    layer.load_experts(w13, w2)
    return layer(x, topk_ids, topk_weights)
