"""`ExpertParallelMoE` and `moe_forward`: input checks, backend choice, weights. The math lives in the backends.

    layer = ExpertParallelMoE(spec, group=None, backend="weave", max_tokens_per_rank=8192)
    layer.load_experts(w13, w2)                 # this rank's experts [E_local, 2I, H], [E_local, H, I] bf16
    out = layer(x, topk_ids, topk_weights)      # [T, H] bf16, [T, k] int (-1 = none), [T, k] fp32 -> [T, H] bf16

Every check a backend relies on (docs/architecture.md, "Backend contract") happens here, once, with an error that
names the argument, what was expected and what was given.

Failures across ranks (weave_moe.backends.coordination): ranks check at construction that they build the same layer;
a call whose local checks fail on one rank still takes part in that call's first exchange, with zero tokens and an
error code, so every rank raises in the same call (that rank its own error, the others `PeerError`) and the layer
goes on; layers called in a different order on different ranks raise `CallOrderError` on every rank; every wait for
a peer ends within `timeout_s` (`CollectiveTimeoutError`, after which the layer is broken).
"""

from __future__ import annotations

import importlib

import torch

from weave_moe.backends.coordination import (DEFAULT_TIMEOUT_S, CallCoordinator, CallOrderError, CollectiveError,
                                             CollectiveTimeoutError, CoordinationError, LayerBrokenError,
                                             LayerMismatchError, PeerError, agree_no_errors, agree_on_layer,
                                             describe_layer, layer_fingerprint)
from weave_moe.models import MoESpec

__all__ = ["ExpertParallelMoE", "moe_forward", "BACKENDS", "DEFAULT_POLICY",
           # the errors a layer raises across ranks (defined in weave_moe.backends.coordination)
           "CoordinationError", "PeerError", "CallOrderError", "LayerMismatchError", "CollectiveError",
           "CollectiveTimeoutError", "LayerBrokenError"]

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


def _with_kernel_config(options: dict) -> dict:
    """The weave backend's options with its KernelConfig resolved (the one given, else WEAVE_MOE_KERNEL_CONFIG's), so
    that the ranks' construction check compares, and the backend runs, the same one."""
    from weave_moe.backends.weave import KernelConfig

    config = options.get("config")
    return dict(options, config=KernelConfig.from_env() if config is None else config)


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


class _InferenceOnly(torch.autograd.Function):
    """Hands back the layer's output unchanged; its backward raises: the layer computes no gradients."""

    @staticmethod
    def forward(ctx, out, *inputs):
        return out

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("ExpertParallelMoE is inference-only: it has no backward. Its forward ran without autograd "
                           "because an input requires grad; run the model under torch.inference_mode() or "
                           "torch.no_grad(), or detach the inputs")


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
        check_expert_ids: verify every id is in [-1, E) on each call, in the ids' own dtype (int64 ids are never
            narrowed before the check). Backends that exchange counts anyway (nccl at EP > 1, weave) check inside
            that exchange at no extra cost, and every rank raises ValueError in the same call. Elsewhere (EP = 1, the
            reference backend) the check costs one device-to-host sync, and False skips it: ids outside [-1, E) then
            give UNDEFINED output (dropped, or an indexing error), so turn it off only for inputs known to be valid
            (benchmarks do).
        timeout_s: bound, in seconds, of every wait of this layer for its peers (construction check, each call's
            exchanges, `synchronize`): a peer that died, stalled or never calls makes this rank raise
            CollectiveTimeoutError within it, and the layer is then broken (a collective that timed out cannot be
            resumed). Default 60 s (weave_moe.backends.coordination.DEFAULT_TIMEOUT_S): above the legitimate skew
            of a first call, far below NCCL's 10-minute watchdog. How each backend bounds its waits: the module
            docstring of weave_moe.backends.coordination.
        **backend_options: passed to the backend (each backend rejects options it does not know).

    Construction is collective at EP > 1: every rank of the group builds its layers in the same order, and ranks that
    disagree on spec, max_tokens_per_rank, backend, policy or (weave) the KernelConfig (`config`, else
    WEAVE_MOE_KERNEL_CONFIG) raise LayerMismatchError naming the field, on every rank. The layer is inference-only:
    its forward runs without autograd, and a backward through it raises.
    Expert weights are held by the backend, not registered as parameters: `.to()` does not move them.
    """

    def __init__(self, spec: MoESpec, group=None, backend: str = "weave", max_tokens_per_rank: int = 8192,
                 policy: str = DEFAULT_POLICY, device=None, check_expert_ids: bool = True,
                 timeout_s: float = DEFAULT_TIMEOUT_S, **backend_options) -> None:
        super().__init__()
        self.group, self.rank, self.world_size = _resolve_group(group)
        # Checks that could fail on one rank alone: every rank learns of them in the construction check below.
        kernel_config = None
        try:
            self._check_arguments(spec, max_tokens_per_rank, policy, backend, timeout_s)
            self.timeout_s = float(timeout_s)
            self.device = _resolve_device(device, self.group)
            if backend == "weave":   # its kernels' protocol: every rank's KernelConfig must be the same
                backend_options = _with_kernel_config(backend_options)
                kernel_config = backend_options["config"].as_text()
            local_error = None
        except (TypeError, ValueError, RuntimeError) as error:
            local_error = error
            # what the construction check's exchange runs with
            self.timeout_s, self.device = DEFAULT_TIMEOUT_S, _resolve_device(None, self.group)
        description = describe_layer(spec, max_tokens_per_rank, backend, policy, kernel_config=kernel_config)
        index = 0
        if self.world_size > 1:
            index = agree_on_layer(self.group, self.rank, self.world_size, self.device, description, local_error,
                                   self.timeout_s)
        elif local_error is not None:
            raise local_error
        self.spec = spec
        self.num_local_experts = spec.num_experts // self.world_size
        self.max_tokens_per_rank = max_tokens_per_rank
        self.check_expert_ids = check_expert_ids
        self.backend_name, self.policy = backend, policy
        self.coordinator = CallCoordinator(self.group, self.rank, self.world_size, self.device, self.timeout_s,
                                           layer_fingerprint(description), index)
        try:
            self.backend = _backend_class(backend)(spec, self.group, self.rank, self.world_size, max_tokens_per_rank,
                                                   self.device, policy=policy, coordinator=self.coordinator,
                                                   **backend_options)
            local_error = None
        except Exception as error:  # noqa: BLE001 - reported to the peers below, then raised here
            local_error = error
        if self.world_size > 1:
            agree_no_errors(self.group, self.rank, self.world_size, self.device, local_error, self.timeout_s,
                            "building the MoE layer's backend")
        elif local_error is not None:
            raise local_error
        self._loaded = False
        self._first_call_done = self.world_size == 1  # the first call at EP > 1 is checked on every rank first
        self._no_tokens = None  # T = 0 inputs, for a call this rank cannot make but its peers wait for
        self._accepted_signature = None  # shapes, dtypes and devices of the last inputs that passed _check_layout

    def _check_arguments(self, spec, max_tokens_per_rank, policy, backend, timeout_s) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
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
        if spec.num_experts % self.world_size:
            raise ValueError(f"num_experts={spec.num_experts} is not divisible by the EP size {self.world_size}")

    @property
    def first_expert(self) -> int:
        """Global id of this rank's first expert."""
        return self.rank * self.num_local_experts

    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Load this rank's experts (moved to the layer's device if needed).

        Backends may keep the given tensors or their own copies: the weave backend keeps an interleaved copy of w13
        (gate row j next to up row j) when it may run its grouped GEMMs (KernelConfig.grouped_gemm: the serial policy,
        and the device-resident calls of the adaptive ones), and the given tensors otherwise. Either way, load again
        after changing the weights in place.

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
        self.coordinator.check_usable()
        # detached: the layer is inference-only, and no backend op may record autograd history through the weights
        # (nn.Parameter experts), so a call without grad-requiring inputs needs no no_grad() guard (forward)
        self.backend.load_experts(w13.detach().to(self.device).contiguous(), w2.detach().to(self.device).contiguous())
        self._loaded = True

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                timings: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] bf16 (any strides: a non-contiguous x is copied), topk_ids [T, k] int32/int64 global expert ids
        (-1 = none), topk_weights [T, k] fp32.

        Returns [T, H] bf16. T may be 0 (the rank still takes part in the collectives). `timings`, when given, is
        passed to the backend (the nccl backend fills in per-stage milliseconds on CUDA). `out`, when given
        ([T, H] bf16, contiguous, on the layer's device, not sharing memory with x), receives the result and is
        returned: a serving engine can allocate it once and reuse it for every call of a size (inside a CUDA-graph
        capture too). The weave backend writes it directly (a call refused on the device leaves NaN rows in it);
        the others copy their result into it. Without `out`, every call returns a new tensor.

        Raises (at EP > 1, on every rank in the same call unless noted): this rank's own TypeError / ValueError /
        RuntimeError for its bad input, PeerError on the others; ValueError for expert ids outside [-1, E) on any
        rank (backends that check inside their exchange); CallOrderError if ranks called different layers;
        CollectiveTimeoutError on the ranks whose wait for a peer passed timeout_s; LayerBrokenError afterwards.
        """
        self.coordinator.check_usable()
        try:
            if not self._loaded:
                raise RuntimeError("forward called before load_experts(w13, w2)")
            topk_ids = self._check_inputs(x, topk_ids, topk_weights)
            if out is not None:
                self._check_out(out, x)
        except Exception as error:  # noqa: BLE001 - every local failure is reported to the peers the same way
            if self.world_size == 1:
                raise
            if not self._first_call_done:
                self._check_first_call(error)
            self._abandon_call(error)
        if not self._first_call_done:
            self._check_first_call(None)
        # the kernels address rows by x's address and H (a no-op for a contiguous x)
        x, topk_weights = x.contiguous(), topk_weights.contiguous()
        if not (x.requires_grad or topk_weights.requires_grad) or not torch.is_grad_enabled():
            # nothing to guard (the weights are detached at load): no no_grad() context, ~5-10 us of host time
            return self._run_backend(x, topk_ids, topk_weights, timings, out)
        with torch.no_grad():
            result = self._run_backend(x, topk_ids, topk_weights, timings, out)
        return _InferenceOnly.apply(result, x, topk_weights)

    def _run_backend(self, x, topk_ids, topk_weights, timings, out) -> torch.Tensor:
        """The backend's forward, its result in `out` when one is given (a backend may have written it there)."""
        result = self.backend.forward(x, topk_ids, topk_weights, timings=timings, out=out)
        return result if out is None or result is out else out.copy_(result)

    def synchronize(self) -> None:
        """Wait for this rank's last call (within timeout_s) and raise any error it deferred (the weave kernel's
        WeaveTimeoutError)."""
        self.coordinator.check_usable()
        self.backend.synchronize()

    def _check_first_call(self, error: BaseException | None) -> None:
        """Before a layer's first call at EP > 1, one small all-gather: every rank raises if any rank cannot make it
        (above all: experts not loaded, which the symm and deepep backends, whose calls carry no header, could not
        tell the peers that need this rank's experts)."""
        agree_no_errors(self.group, self.rank, self.world_size, self.device, error, self.coordinator.timeout_s,
                        "the MoE layer's first call", self.coordinator.mark_broken)
        self._first_call_done = True

    def _abandon_call(self, error: BaseException):
        """This rank cannot make the call; its peers are (or will be) in the call's first exchange. Take part in it
        with T = 0 inputs and the error code, so that the backend raises on every rank (`error` here); a backend
        without a per-call exchange returns, and the error is raised here."""
        self.coordinator.fail(error)
        if self._no_tokens is None:
            top_k = self.spec.top_k
            self._no_tokens = (torch.empty(0, self.spec.hidden_size, dtype=torch.bfloat16, device=self.device),
                               torch.empty(0, top_k, dtype=torch.int32, device=self.device),
                               torch.empty(0, top_k, dtype=torch.float32, device=self.device))
        try:
            with torch.no_grad():
                self.backend.forward(*self._no_tokens)
        except BaseException:
            self.coordinator.take_failure()  # raised by the backend (this rank's error), or superseded (a timeout)
            raise
        self.coordinator.take_failure()  # the backend had no per-call exchange: only this rank knows
        raise error

    @property
    def capturable(self) -> bool:
        """Whether a call may be captured into a caller's CUDA graph and replayed with new values written into the
        captured inputs (`Backend.capturable`: the weave backend's device-resident call, the nccl backend at EP = 1),
        given this layer's id check: where the backend does not check ids itself, `check_expert_ids` costs a host
        sync. Make one call outside the capture first (it compiles and, at EP > 1, checks the ranks agree)."""
        return self.backend.capturable and not (self.check_expert_ids and not self.backend.checks_expert_ids)

    @property
    def last_plan(self):
        """The schedule (`weave_moe.plan.Plan`) of this rank's last call; None for backends without one."""
        return self.backend.last_plan

    def _check_out(self, out, x) -> None:
        """Raise unless `out` can receive this call's result (forward's `out`)."""
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if tuple(out.shape) != (x.shape[0], self.spec.hidden_size):
            raise ValueError(f"out must have shape [T, hidden_size] = [{x.shape[0]}, {self.spec.hidden_size}], got "
                             f"{list(out.shape)}")
        if out.dtype != torch.bfloat16:
            raise TypeError(f"out must be bfloat16, got {out.dtype}")
        if out.device != self.device:
            raise ValueError(f"out is on {out.device} but the layer is on {self.device}")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
        if out.requires_grad:
            raise ValueError("out must not require grad (the layer is inference-only)")
        if out.numel() and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            raise ValueError("out must not share memory with x (the kernel reads x while it writes out)")

    def _check_inputs(self, x, topk_ids, topk_weights) -> torch.Tensor:
        """Raise on bad input; return topk_ids contiguous, as int32 (ids outside [-1, E) stay outside it) unless the
        backend narrows int64 ids itself (`Backend.narrows_int64_ids`).

        The checks of `_check_layout` depend only on the three tensors' shapes, dtypes and devices: a call whose
        signature equals the last accepted one skips them (~1 us against ~4 of host time on the CPU box); the ids'
        values are checked on every call."""
        if type(x) is torch.Tensor and type(topk_ids) is torch.Tensor and type(topk_weights) is torch.Tensor:
            signature = (x.shape, x.dtype, x.device, topk_ids.shape, topk_ids.dtype, topk_ids.device,
                         topk_weights.shape, topk_weights.dtype, topk_weights.device)
        else:
            signature = None
        if signature is None or signature != self._accepted_signature:
            self._check_layout(x, topk_ids, topk_weights)
            self._accepted_signature = signature
        num_experts = self.spec.num_experts
        if self.check_expert_ids and topk_ids.numel() and not self.backend.checks_expert_ids:
            low, high = torch.stack([topk_ids.min(), topk_ids.max()]).tolist()  # in the ids' own dtype
            if low < -1 or high >= num_experts:
                raise ValueError(f"topk_ids must be in [-1, {num_experts}) (-1 = no expert), got values in "
                                 f"[{low}, {high}]")
        if topk_ids.dtype == torch.int32 or self.backend.narrows_int64_ids:
            return topk_ids.contiguous()   # no `.to`: even a no-op cast costs ~3 us of host time per call
        # Narrow without wrapping: 2**32 + 3 must not become expert 3. Out-of-range ids map to -2 or E, which a
        # backend's own check still counts as out of range (one elementwise op, no host sync).
        return topk_ids.clamp(-2, num_experts).to(torch.int32).contiguous()

    def _check_layout(self, x, topk_ids, topk_weights) -> None:
        """Raise unless the inputs' types, shapes, dtypes and devices are what forward takes."""
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

    def extra_repr(self) -> str:
        return (f"spec={self.spec.name}, backend={self.backend_name}, policy={self.policy}, "
                f"rank={self.rank}/{self.world_size}, device={self.device}, timeout_s={self.timeout_s:g}")


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
