"""MoE layer shapes of real models, and the registry that names them.

Shape legend used across the package: T = tokens on a rank, E = routed experts, k = top-k, H = hidden size,
I = intermediate size of one expert, EP = expert-parallel world size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["MoESpec", "list_models", "PAPER_MODELS", "BYTES_PER_ELEMENT"]

#: Bytes per element of activations and expert weights (bf16): rows on NVLink, weights read from HBM.
BYTES_PER_ELEMENT = 2


@dataclass(frozen=True)
class MoESpec:
    """The shape of one MoE layer.

    Attributes:
        num_experts: E, routed experts in the layer.
        top_k: k, experts chosen per token.
        hidden_size: H, model width (rows of x).
        intermediate_size: I, width of one routed expert (w13 is [2*I, H], w2 is [H, I]).
        num_shared_experts: shared experts that every token visits (not part of the EP layer; recorded so that
            end-to-end estimates can add them).
        shared_intermediate_size: I of one shared expert (0 when there is none).
        name: registry name, or "custom".
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0
    name: str = "custom"

    def __post_init__(self) -> None:
        for field in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"MoESpec.{field} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoESpec.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.num_shared_experts < 0 or self.shared_intermediate_size < 0:
            raise ValueError("MoESpec shared expert fields must be >= 0")

    @classmethod
    def from_name(cls, name: str) -> "MoESpec":
        """The registered spec called `name` (case-insensitive); raises KeyError listing the known names."""
        key = name.lower()
        if key not in _REGISTRY:
            raise KeyError(f"unknown model {name!r}; known models: {', '.join(sorted(_REGISTRY))}")
        return _REGISTRY[key]

    def flops_per_pair(self) -> int:
        """FLOPs of one (token, expert) pair: GEMM0 2*H*2I plus GEMM1 2*I*H."""
        return 6 * self.hidden_size * self.intermediate_size

    def to_dict(self) -> dict:
        return asdict(self)


def _spec(name, e, k, h, i, shared=0, shared_i=0) -> MoESpec:
    return MoESpec(e, k, h, i, shared, shared_i if shared else 0, name)


_REGISTRY: dict[str, MoESpec] = {
    s.name: s
    for s in [
        _spec("deepseek-v3", 256, 8, 7168, 2048, 1, 2048),
        _spec("phi-3.5-moe", 16, 2, 4096, 6400),
        _spec("qwen3-30b-a3b", 128, 8, 2048, 768),
        _spec("qwen3.5-35b-a3b", 256, 8, 2048, 512, 1, 512),
        _spec("deepseek-v2-lite", 64, 6, 2048, 1408, 2, 1408),
        _spec("deepseek-v2", 160, 6, 5120, 1536, 2, 1536),
        _spec("mixtral-8x7b", 8, 2, 4096, 14336),
        _spec("olmoe-1b-7b", 64, 8, 2048, 1024),
        _spec("qwen3-235b-a22b", 128, 8, 4096, 1536),
        _spec("gpt-oss-120b", 128, 4, 2880, 2880),
        # Kimi K2 keeps DeepSeek-V3's expert width for its one shared expert.
        _spec("kimi-k2", 384, 8, 7168, 2048, 1, 2048),
        _spec("qwen3.5-397b-a17b", 512, 10, 4096, 1024, 1, 1024),
    ]
}

#: The six models of the paper's evaluation, in its order.
PAPER_MODELS = ("deepseek-v3", "phi-3.5-moe", "qwen3-30b-a3b", "qwen3.5-35b-a3b", "deepseek-v2-lite", "deepseek-v2")


def list_models() -> list[MoESpec]:
    """Every registered spec, sorted by name."""
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]
