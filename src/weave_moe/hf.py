"""Run Hugging Face transformers MoE models' routed experts through `ExpertParallelMoE`.

    import weave_moe.hf
    weave_moe.hf.register()                                   # adds "weave" to transformers' ExpertsInterface
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, experts_implementation="weave")
    weave_moe.hf.load_local_experts(model, path)              # optional at EP > 1: keep only this rank's experts

transformers 5 routes every MoE family's experts module (`@use_experts_implementation`) through its
`ExpertsInterface` registry, chosen by `config._experts_implementation`; `register()` adds one more entry. The model
keeps its router and its shared experts; only the routed experts' call `experts(hidden_states, top_k_index,
top_k_weights)` runs here. Families: those `MoESpec.from_hf_config` accepts; anything else raises on the first call
(never a silent wrong answer), and the experts module itself is checked too (no biases, gate rows then up rows, not
transposed, SiLU, the default gate).

Expert parallelism: when torch.distributed is initialised, the default process group is the EP group. Every rank runs
its own copy of the rest of the model on its own tokens (data parallel), and the layers exchange tokens between ranks;
rank r computes experts [r * E_local, (r + 1) * E_local). Its experts come from the module's full weights (sliced on
first use) or from a checkpoint through `load_local_experts`, which then drops the full copies. Every MoE layer is a
collective: all ranks must run the same number of forward passes (in `generate`, the same number of new tokens, e.g.
`min_new_tokens=max_new_tokens`; an early stop on one rank alone leaves the others waiting in a collective until
the backend's or the process group's timeout).

Backend: "weave" on CUDA devices, "nccl" elsewhere (it runs on the CPU with a gloo group, and at EP = 1 with none);
`register(name, backend=...)` registers another name with a fixed backend (the example's timing uses that).

Dtypes (the layer computes in bf16):
    hidden_states   any float dtype; rounded to bf16 if it is not bf16 already
    top_k_index     [T, k] int64 global expert ids (torch.topk's), passed on as int32
    top_k_weights   [T, k] any float dtype (transformers passes the router's dtype, bf16 in a bf16 model): to fp32
    expert weights  bf16; a model held in fp16 / fp32 gets bf16 copies of this rank's experts (so its MoE layers
                    compute what the bf16 model would)
    returns         [T, H] in hidden_states' dtype
Inference only: no gradient flows through the experts (calling with gradients enabled raises).

Layers: by default one `ExpertParallelMoE` per registered name, layer shape and device, shared by all MoE layers of
that shape (its buffers are made once, not once per model layer); each call loads the calling module's experts into
it first (a reference swap, no copy). That keeps the weave backend on its host-driven call, which waits for the
routing counts on the host in every call. `register(..., per_module=True)` gives every experts module its own layer
instead, loaded once: the weave backend then makes its device-resident call (no host sync, one graph
replay per call; the weave backend's workspace is shared by all layers of a process group either way) on the
module's weights as they are: no interleaved copy of w13 (`KernelConfig.interleave_w13` off unless `config=` says
otherwise), its grouped GEMM0 running gate and up as two MMAs. Each such layer holds its own task tables (both kinds
of call, at the default max_tokens_per_rank of 8192): 4.2 MiB for Qwen3-30B-A3B at EP 1 and 6.8 at EP 2, 10.1 / 11.3
MiB for DeepSeek-V3 (`tables.TableBuffers`), so ~0.2 GB for Qwen3-30B-A3B's 48 MoE layers and ~0.6 GB for
DeepSeek-V3's 58. Not yet measured on a GPU against the shared
layer (`examples/hf_generate.py --time-dir`, implementation "weave-weave-per-module").

This module imports transformers (the optional extra `weave-moe[hf]`) on first use only.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from weave_moe.checkpoint import CheckpointIndex, experts_prefix_candidates, load_rank_experts
from weave_moe.layer import ExpertParallelMoE
from weave_moe.models import MoESpec

__all__ = ["register", "load_local_experts", "experts_spec", "DEFAULT_MAX_TOKENS_PER_RANK"]

#: Largest T one call of a MoE layer takes per rank. At EP = 1 a longer call is split into pieces of this size; at
#: EP > 1 it raises (ranks would disagree on the number of pieces): raise it with register(max_tokens_per_rank=...).
DEFAULT_MAX_TOKENS_PER_RANK = 8192


def _experts_interface():
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as error:
        raise ImportError("weave_moe.hf needs transformers >= 5 with the experts registry (ExpertsInterface): "
                          "pip install 'weave-moe[hf]'") from error
    return ExpertsInterface


def _ep_rank() -> tuple[int, int]:
    """(rank, world_size) of the default process group, (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _is_experts_module(module: torch.nn.Module) -> bool:
    """An experts module of transformers 5: its class went through `@use_experts_implementation`, which sets
    `is_concatenated` on every instance, and it stores its experts as 3-D `gate_up_proj`."""
    return isinstance(getattr(module, "gate_up_proj", None), torch.Tensor) and hasattr(module, "is_concatenated")


def experts_spec(module: torch.nn.Module) -> MoESpec:
    """The MoESpec of a transformers experts module, after checking that the layer computes it exactly.

    Raises:
        ValueError: its config's family does not fit (see `MoESpec.from_hf_config`), or the module has biases,
            interleaved or transposed weights, no gate, a non-default gate, a non-SiLU activation, or weights whose
            shapes disagree with its config.
    """
    if not _is_experts_module(module):
        raise ValueError(f"{type(module).__name__} is not a transformers experts module (no gate_up_proj / "
                         f"@use_experts_implementation)")
    spec = MoESpec.from_hf_config(module.config)
    name = type(module).__name__
    misfits = [what for what, bad in (
        ("expert biases", module.has_bias), ("no gate projection", not module.has_gate),
        ("interleaved gate/up rows", not module.is_concatenated), ("transposed weights", module.is_transposed),
    ) if bad]
    gate = getattr(module._apply_gate, "__func__", module._apply_gate)  # the function behind the bound method
    if (gate.__module__, gate.__name__) != ("transformers.integrations.moe", "_default_apply_gate"):
        misfits.append(f"its own gate function {gate.__qualname__} (e.g. a clamped SwiGLU)")
    from transformers.activations import SiLUActivation

    if not isinstance(module.act_fn, (SiLUActivation, torch.nn.SiLU)):
        misfits.append(f"activation {type(module.act_fn).__name__}, not SiLU")
    if misfits:
        raise ValueError(f"{name} does not fit ExpertParallelMoE: {'; '.join(misfits)}")
    # E experts, or this rank's E_local once load_local_experts(drop_full=True) replaced them
    held = module.gate_up_proj.shape[0]
    E = spec.num_experts if module not in _LOCAL or held == spec.num_experts else _LOCAL[module].w13.shape[0]
    H, I = spec.hidden_size, spec.intermediate_size
    for what, weight, shape in (("gate_up_proj", module.gate_up_proj, (E, 2 * I, H)),
                                ("down_proj", module.down_proj, (E, H, I))):
        if tuple(weight.shape) != shape:
            raise ValueError(f"{name}.{what} has shape {list(weight.shape)}, expected {list(shape)} from its config")
    return spec


@dataclasses.dataclass
class _LocalExperts:
    """This rank's experts of one experts module, in the layer's format."""

    spec: MoESpec
    rank: int
    world_size: int
    w13: torch.Tensor  # [E_local, 2I, H] bf16, gate rows then up rows
    w2: torch.Tensor  # [E_local, H, I] bf16
    source: tuple[int, int]  # data_ptr of the module's gate_up_proj and down_proj when these were taken


def _source(module: torch.nn.Module) -> tuple[int, int]:
    return module.gate_up_proj.data_ptr(), module.down_proj.data_ptr()


#: experts module -> its rank's experts (weak keys: a deleted model frees its entries)
_LOCAL: "weakref.WeakKeyDictionary[torch.nn.Module, _LocalExperts]" = weakref.WeakKeyDictionary()


def _local_experts(module: torch.nn.Module, device: torch.device) -> _LocalExperts:
    rank, world_size = _ep_rank()
    local = _LOCAL.get(module)
    # reused while the module's weights are the same tensors (new weights, a move or a cast make them new) and the
    # EP group and device are the same
    if (local is not None and (local.rank, local.world_size) == (rank, world_size) and local.w13.device == device
            and local.source == _source(module)):
        return local
    spec = experts_spec(module)
    if spec.num_experts % world_size:
        raise ValueError(f"num_experts={spec.num_experts} is not divisible by the EP size {world_size}")
    num_local = spec.num_experts // world_size
    held = module.gate_up_proj.shape[0]
    if held == spec.num_experts:
        rows = slice(rank * num_local, (rank + 1) * num_local)
    elif (local.rank, local.world_size) == (rank, world_size):  # load_local_experts(drop_full) left only these; moved
        rows = slice(0, held)
    else:
        raise RuntimeError(f"{type(module).__name__} holds the {held} experts of rank {local.rank} of "
                           f"{local.world_size} (load_local_experts) but runs as rank {rank} of {world_size}: load "
                           f"its experts again")
    # A view (no copy) when the model is bf16 on `device`: rows of the leading dimension stay contiguous.
    w13 = module.gate_up_proj.detach()[rows].to(device=device, dtype=torch.bfloat16).contiguous()
    w2 = module.down_proj.detach()[rows].to(device=device, dtype=torch.bfloat16).contiguous()
    local = _LocalExperts(spec, rank, world_size, w13, w2, _source(module))
    _LOCAL[module] = local
    return local


class _Implementation:
    """One registered experts implementation: a backend choice and its layers (one per layer shape and device, or
    one per experts module with per_module)."""

    def __init__(self, name: str, backend: str | None, max_tokens_per_rank: int, per_module: bool,
                 layer_options: dict) -> None:
        self.name, self.backend, self.max_tokens_per_rank = name, backend, max_tokens_per_rank
        self.per_module = per_module
        self.layer_options = layer_options
        self.layers: dict[tuple, ExpertParallelMoE] = {}
        # layer -> the experts it holds now (weak keys: a per-module layer goes with its module)
        self.loaded: "weakref.WeakKeyDictionary[ExpertParallelMoE, _LocalExperts]" = weakref.WeakKeyDictionary()
        # per_module: experts module -> ((spec, device, EP rank and size), its own layer)
        self.module_layers: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()

    def settings(self) -> tuple:
        return self.backend, self.max_tokens_per_rank, self.per_module, sorted(self.layer_options.items())

    def layer(self, spec: MoESpec, device: torch.device, module: torch.nn.Module) -> ExpertParallelMoE:
        """The layer that runs `module`'s call: its own (per_module) or the one of its shape and device (and EP
        group: a new group, device or shape gets a new layer)."""
        key = (spec, device, _ep_rank())
        if self.per_module:
            entry = self.module_layers.get(module)
            if entry is None or entry[0] != key:
                entry = (key, self._new_layer(spec, device))
                self.module_layers[module] = entry
            return entry[1]
        if key not in self.layers:
            self.layers[key] = self._new_layer(spec, device)
        return self.layers[key]

    def _new_layer(self, spec: MoESpec, device: torch.device) -> ExpertParallelMoE:
        if self.backend is None:   # the megakernel where the GPU runs it (Hopper or newer), else the baseline
            from weave_moe.backends.weave.config import unsupported_device

            backend = "weave" if unsupported_device(device) is None else "nccl"
        else:
            backend = self.backend
        options = dict(self.layer_options)
        if backend == "weave" and "config" not in options:
            from weave_moe.backends.weave import KernelConfig

            if self.per_module:
                # the module's weights as they are (no interleaved w13 copy: the grouped GEMM0 runs gate and up as
                # two MMAs); the resident call as KernelConfig.resident decides (on by default)
                options["config"] = dataclasses.replace(KernelConfig.from_env(), interleave_w13=False)
            else:
                # One layer serves every MoE layer of this shape and is handed each module's experts per call: the
                # device-resident call would capture its graph again on every such hand-over (it holds the weights'
                # addresses), and the grouped-GEMM serial path would re-lay w13 (a copy of it).
                config = dataclasses.replace(KernelConfig.from_env(), resident="off")
                if self.layer_options.get("policy") == "serial":
                    config = dataclasses.replace(config, grouped_gemm=False)
                options["config"] = config
        return ExpertParallelMoE(spec, group=None, backend=backend, max_tokens_per_rank=self.max_tokens_per_rank,
                                 device=device, **options)

    def __call__(self, module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        """transformers' experts call: hidden_states [T, H], top_k_index [T, k] int, top_k_weights [T, k] float."""
        if torch.is_grad_enabled() and (hidden_states.requires_grad or module.gate_up_proj.requires_grad):
            raise RuntimeError(f"experts_implementation={self.name!r} is inference only (no gradients flow through "
                               f"it): run under torch.no_grad() / torch.inference_mode(), or "
                               f"model.requires_grad_(False)")
        if not top_k_weights.is_floating_point():
            raise TypeError(f"top_k_weights must be a float tensor, got {top_k_weights.dtype}")
        device = hidden_states.device
        local = _local_experts(module, device)
        layer = self.layer(local.spec, device, module)
        if self.loaded.get(layer) is not local:
            layer.load_experts(local.w13, local.w2)
            self.loaded[layer] = local
        x = hidden_states.to(torch.bfloat16).contiguous()
        weights = top_k_weights.to(torch.float32)
        num_tokens, limit = x.shape[0], self.max_tokens_per_rank
        if num_tokens <= limit:
            out = layer(x, top_k_index, weights)
        elif local.world_size == 1:
            out = torch.cat([layer(x[start:start + limit], top_k_index[start:start + limit],
                                   weights[start:start + limit]) for start in range(0, num_tokens, limit)])
        else:
            # At EP > 1 the peers must take part in this call too: the layer raises on every rank together (this rank
            # the ValueError, the others a PeerError), where raising here would leave them waiting in the exchange.
            try:
                out = layer(x, top_k_index, weights)
            except ValueError as error:
                raise ValueError(f"a MoE layer got T={num_tokens} tokens on this rank, more than max_tokens_per_rank="
                                 f"{limit} of experts_implementation={self.name!r}: register it with a larger "
                                 f"max_tokens_per_rank") from error
        return out.to(hidden_states.dtype)


#: registered name -> implementation
_IMPLEMENTATIONS: dict[str, _Implementation] = {}


def register(name: str = "weave", *, backend: str | None = None,
             max_tokens_per_rank: int = DEFAULT_MAX_TOKENS_PER_RANK, per_module: bool = False,
             **layer_options) -> str:
    """Register an experts implementation `name` with transformers (idempotent); returns `name`.

    Args:
        name: the `experts_implementation=` value that selects it. Names transformers ships ("eager",
            "grouped_mm", ...) are refused.
        backend: ExpertParallelMoE backend; None = "weave" on GPUs it runs on (compute capability 9.0 or newer),
            "nccl" elsewhere.
        max_tokens_per_rank: largest T per MoE call on a rank (see DEFAULT_MAX_TOKENS_PER_RANK).
        per_module: one layer per experts module, loaded once (the weave backend's device-resident call), instead of
            one per layer shape handed each module's experts per call (module docstring, "Layers").
        **layer_options: passed to ExpertParallelMoE (policy=, check_expert_ids=, backend options).

    Registering the same name again with the same settings does nothing; with other settings it replaces the
    implementation (its layers are rebuilt on the next call).
    """
    interface = _experts_interface()
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if name == "eager" or (name in interface() and name not in _IMPLEMENTATIONS):
        raise ValueError(f"experts implementation {name!r} is transformers' own; choose another name")
    if not isinstance(max_tokens_per_rank, int) or max_tokens_per_rank <= 0:
        raise ValueError(f"max_tokens_per_rank must be a positive int, got {max_tokens_per_rank!r}")
    if not isinstance(per_module, bool):
        raise TypeError(f"per_module must be a bool, got {per_module!r}")
    implementation = _Implementation(name, backend, max_tokens_per_rank, per_module, layer_options)
    current = _IMPLEMENTATIONS.get(name)
    if current is not None and current.settings() == implementation.settings():
        return name
    _IMPLEMENTATIONS[name] = implementation
    interface.register(name, implementation)
    return name


def load_local_experts(model: torch.nn.Module, checkpoint_dir, *, drop_full: bool = True) -> int:
    """Load this rank's experts of every MoE layer of `model` from a safetensors checkpoint directory.

    Each experts module named P in the model (e.g. "model.layers.3.mlp.experts") reads its rank's slice under P in
    the checkpoint (or the `block_sparse_moe` spelling), memory-mapped: see `weave_moe.checkpoint`. The rank and EP
    size are those of the default process group (0 and 1 without one).

    Args:
        model: a transformers model whose MoE layers fit (`experts_spec`).
        checkpoint_dir: the checkpoint directory (*.safetensors, optionally model.safetensors.index.json).
        drop_full: replace each module's full `gate_up_proj` / `down_proj` by this rank's [E_local, ...] bf16
            experts, so that the rank holds only its experts. The module then runs only through a registered weave
            implementation (not "eager" or "grouped_mm").

    Returns:
        The number of experts modules loaded.
    """
    rank, world_size = _ep_rank()
    count = 0
    with CheckpointIndex(checkpoint_dir) as index:
        for module_name, module in model.named_modules():
            if not _is_experts_module(module):
                continue
            spec = experts_spec(module)
            device = module.gate_up_proj.device
            w13, w2 = load_rank_experts(index, experts_prefix_candidates(module_name), spec, rank=rank,
                                        world_size=world_size, device=device)
            if drop_full:
                module.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)
                module.down_proj = torch.nn.Parameter(w2, requires_grad=False)
            _LOCAL[module] = _LocalExperts(spec, rank, world_size, w13, w2, _source(module))
            count += 1
    if count == 0:
        raise ValueError(f"{type(model).__name__} has no transformers experts modules to load")
    return count
