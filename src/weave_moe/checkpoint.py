"""Read one rank's routed experts of one MoE layer from a safetensors checkpoint directory (Hugging Face naming).

    w13, w2 = load_rank_experts(ckpt_dir, "model.layers.3.mlp.experts", spec, rank=r, world_size=ep)
    layer.load_experts(w13, w2)   # [E_local, 2I, H], [E_local, H, I] bf16, experts [r * E_local, (r + 1) * E_local)

Three namings are recognised under the experts prefix P (the experts module's name in the model):
  * fused (transformers 5 in memory):  P.gate_up_proj [E, 2I, H] (gate rows first), P.down_proj [E, H, I]
  * per expert (Qwen2/3-MoE, DeepSeek-V2/V3, OLMoE on the hub, and what transformers 5 `save_pretrained` writes):
    P.{j}.gate_proj.weight [I, H], P.{j}.up_proj.weight [I, H], P.{j}.down_proj.weight [H, I]
  * per expert w1/w3/w2 (Mixtral, Phi-MoE): P.{j}.w1.weight = gate [I, H], w3 = up [I, H], w2 = down [H, I], where
    those checkpoints say `block_sparse_moe` for the module transformers 5 calls `mlp`.
Only this rank's experts are read: files are opened memory-mapped (`safe_open`), the fused tensors through
`get_slice` over the expert dimension, per-expert tensors by name. Shapes are checked against the spec, and only
floating dtypes that convert exactly or by one rounding to bf16 (bf16, fp16, fp32) are accepted: a quantized
checkpoint (fp8 with scales, int4) is refused, not silently misread.

Imports only torch and safetensors (safetensors is imported on first use; it comes with the `hf` extra).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from weave_moe.models import MoESpec

__all__ = ["CheckpointIndex", "load_rank_experts", "experts_prefix_candidates"]

#: dtypes a checkpoint's expert tensors may have; each converts to the layer's bf16.
_FLOAT_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


class CheckpointIndex:
    """Which file of a safetensors checkpoint directory holds each tensor name.

    Reads `model.safetensors.index.json` when present (sharded checkpoints), else the headers of every
    `*.safetensors` file in the directory. Files are opened lazily and kept open (memory-mapped) until `close()`.
    """

    def __init__(self, directory) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"checkpoint directory {str(self.directory)!r} does not exist")
        from safetensors import safe_open

        self._safe_open = safe_open
        self._handles: dict[Path, object] = {}
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.file_of = {name: self.directory / file for name, file in weight_map.items()}
        else:
            files = sorted(self.directory.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors file (and no model.safetensors.index.json) in "
                                        f"{str(self.directory)!r}")
            self.file_of = {name: file for file in files for name in self._open(file).keys()}

    def _open(self, file: Path):
        if file not in self._handles:
            self._handles[file] = self._safe_open(str(file), framework="pt", device="cpu")
        return self._handles[file]

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def tensor_slice(self, name: str):
        """safetensors' lazy slice of `name` (shape via get_shape(), dtype via get_dtype(); index to read)."""
        return self._open(self.file_of[name]).get_slice(name)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "CheckpointIndex":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def experts_prefix_candidates(module_name: str) -> list[str]:
    """Checkpoint prefixes an experts module named `module_name` (its name in the transformers 5 model) may have:
    the name itself, and the `block_sparse_moe` spelling of Mixtral / Phi-MoE checkpoints for `.mlp.`."""
    candidates = [module_name]
    if ".mlp." in module_name:
        candidates.append(module_name.replace(".mlp.", ".block_sparse_moe.", 1))
    return candidates


def load_rank_experts(checkpoint, prefix: str | list[str], spec: MoESpec, *, rank: int = 0, world_size: int = 1,
                      device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's experts of one MoE layer, read from a safetensors checkpoint.

    Args:
        checkpoint: a checkpoint directory (str / Path) or an open `CheckpointIndex` (reuse it across layers).
        prefix: the experts' name prefix, e.g. "model.layers.3.mlp.experts", or a list of candidates tried in order
            (see `experts_prefix_candidates`).
        spec: the layer's shape; E must be divisible by world_size.
        rank, world_size: this rank's place in the EP group; it gets experts [rank * E_local, (rank + 1) * E_local).
        device: where the returned tensors go.

    Returns:
        (w13 [E_local, 2I, H] bf16, gate rows then up rows; w2 [E_local, H, I] bf16), contiguous.

    Raises:
        KeyError: no naming matches under any candidate prefix (the message lists what was looked for).
        ValueError: a tensor's shape disagrees with the spec, or the checkpoint holds a different number of experts.
        TypeError: a tensor is not bf16 / fp16 / fp32 (e.g. an fp8-quantized checkpoint).
    """
    if not isinstance(spec, MoESpec):
        raise TypeError(f"spec must be a MoESpec, got {type(spec).__name__}")
    if not isinstance(world_size, int) or world_size <= 0 or spec.num_experts % world_size:
        raise ValueError(f"world_size must be a positive divisor of num_experts={spec.num_experts}, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    index = checkpoint if isinstance(checkpoint, CheckpointIndex) else CheckpointIndex(checkpoint)
    try:
        prefixes = [prefix] if isinstance(prefix, str) else list(prefix)
        num_local = spec.num_experts // world_size
        first = rank * num_local
        for candidate in prefixes:
            if f"{candidate}.gate_up_proj" in index:
                w13, w2 = _read_fused(index, candidate, spec, first, num_local)
            elif f"{candidate}.0.gate_proj.weight" in index:
                w13, w2 = _read_per_expert(index, candidate, spec, first, num_local,
                                           ("gate_proj", "up_proj", "down_proj"))
            elif f"{candidate}.0.w1.weight" in index:
                w13, w2 = _read_per_expert(index, candidate, spec, first, num_local, ("w1", "w3", "w2"))
            else:
                continue
            return w13.to(device).contiguous(), w2.to(device).contiguous()
        looked_for = ", ".join(f"{p}.gate_up_proj, {p}.0.gate_proj.weight, {p}.0.w1.weight" for p in prefixes)
        raise KeyError(f"no experts in checkpoint {str(index.directory)!r} under prefix {prefixes}: looked for "
                       f"{looked_for}")
    finally:
        if index is not checkpoint:
            index.close()


def _checked(index: CheckpointIndex, name: str, shape: tuple[int, ...], what: str):
    """The lazy slice of `name` after checking its shape (== `shape`) and dtype (bf16 / fp16 / fp32)."""
    if name not in index:
        raise KeyError(f"checkpoint {str(index.directory)!r} has no tensor {name!r} ({what})")
    lazy = index.tensor_slice(name)
    dtype = lazy.get_dtype()
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"checkpoint tensor {name!r} has dtype {dtype}; expected one of "
                        f"{', '.join(_FLOAT_DTYPES)} (quantized experts are not supported)")
    if tuple(lazy.get_shape()) != shape:
        raise ValueError(f"checkpoint tensor {name!r} ({what}) has shape {list(lazy.get_shape())}, expected "
                         f"{list(shape)} from the spec (E={shape[0] if len(shape) == 3 else '-'})")
    return lazy


def _read_fused(index, prefix, spec, first, num_local):
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    gate_up = _checked(index, f"{prefix}.gate_up_proj", (E, 2 * I, H), "[E, 2I, H] gate rows then up rows")
    down = _checked(index, f"{prefix}.down_proj", (E, H, I), "[E, H, I]")
    w13 = gate_up[first:first + num_local].to(torch.bfloat16)
    w2 = down[first:first + num_local].to(torch.bfloat16)
    return w13, w2


def _read_per_expert(index, prefix, spec, first, num_local, names):
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    gate_name, up_name, down_name = names
    present = 0  # experts 0, 1, ... present; the checkpoint must hold exactly E of them
    while f"{prefix}.{present}.{gate_name}.weight" in index:
        present += 1
    if present != E:
        raise ValueError(f"checkpoint has {present} experts under {prefix!r}, expected num_experts={E} from the spec")
    w13 = torch.empty(num_local, 2 * I, H, dtype=torch.bfloat16)
    w2 = torch.empty(num_local, H, I, dtype=torch.bfloat16)
    for local, expert in enumerate(range(first, first + num_local)):
        base = f"{prefix}.{expert}"
        w13[local, :I] = _checked(index, f"{base}.{gate_name}.weight", (I, H), "gate [I, H]")[:]
        w13[local, I:] = _checked(index, f"{base}.{up_name}.weight", (I, H), "up [I, H]")[:]
        w2[local] = _checked(index, f"{base}.{down_name}.weight", (H, I), "down [H, I]")[:]
    return w13, w2
