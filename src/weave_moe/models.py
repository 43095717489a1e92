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

    @classmethod
    def from_hf_config(cls, config) -> "MoESpec":
        """The routed-expert layer of a Hugging Face transformers model config, for the families the layer computes.

        Accepted (`config.model_type`): qwen2_moe, qwen3_moe, qwen3_5_moe (and its text config), deepseek_v2,
        deepseek_v3, mixtral, olmoe, phimoe. Their experts are exactly this layer's math: bias-free SwiGLU experts
        with SiLU, gate rows then up rows (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]), the output weighted by
        the routing weights the model's own router made. Routing (softmax or sigmoid, top-k, group limits,
        renormalisation, scaling factors) and shared experts stay in the model, so they need not fit.

        Args:
            config: a `transformers.PretrainedConfig` (or anything with the same attribute names).

        Returns:
            MoESpec named after the model type; shared experts recorded for cost estimates.

        Raises:
            ValueError: the family is not one the layer computes (naming what does not fit, e.g. gpt-oss's expert
                biases, interleaved gate/up and clamped SwiGLU), the activation is not SiLU, or a field is missing.
        """
        model_type = getattr(config, "model_type", None)
        if model_type in _HF_COMPOSITE:  # a multimodal wrapper: the experts live in its text model
            config = config.get_text_config()
            model_type = getattr(config, "model_type", None)
        if model_type in _HF_MISFITS:
            raise ValueError(f"MoESpec.from_hf_config: model_type {model_type!r} does not fit this layer: "
                             f"{_HF_MISFITS[model_type]}")
        if model_type not in _HF_FAMILIES:
            raise ValueError(f"MoESpec.from_hf_config: model_type {model_type!r} is not a supported family; supported: "
                             f"{', '.join(sorted(_HF_FAMILIES))}")
        experts_field, intermediate_field, shared = _HF_FAMILIES[model_type]

        def read(field: str) -> int:
            value = getattr(config, field, None)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MoESpec.from_hf_config: {model_type} config field {field!r} must be a positive int, "
                                 f"got {value!r}")
            return value

        activation = getattr(config, "hidden_act", None)
        if activation != "silu":
            raise ValueError(f"MoESpec.from_hf_config: {model_type} config has hidden_act={activation!r}; the layer "
                             f"computes SwiGLU with SiLU only")
        num_shared, shared_width = 0, 0
        if shared == "qwen":  # one shared expert of its own width (its sigmoid gate stays in the model)
            shared_width = getattr(config, "shared_expert_intermediate_size", 0) or 0
            num_shared = 1 if shared_width else 0
        elif shared == "deepseek":  # n_shared_experts experts of the routed width, run as one wider MLP
            num_shared = getattr(config, "n_shared_experts", 0) or 0
            shared_width = read(intermediate_field) if num_shared else 0
        return cls(num_experts=read(experts_field), top_k=read("num_experts_per_tok"), hidden_size=read("hidden_size"),
                   intermediate_size=read(intermediate_field), num_shared_experts=num_shared,
                   shared_intermediate_size=shared_width, name=model_type)

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

#: Hugging Face model_type -> (routed experts field, expert width field, shared experts style). Each family's experts
#: module in transformers 5 computes down @ (silu(gate @ x) * (up @ x)) from gate_up_proj [E, 2I, H] (gate rows first)
#: and down_proj [E, H, I] with no biases, weighted by the router's top-k weights: this layer's math exactly.
_HF_FAMILIES = {
    "qwen2_moe": ("num_experts", "moe_intermediate_size", "qwen"),
    "qwen3_moe": ("num_experts", "moe_intermediate_size", None),
    "qwen3_5_moe_text": ("num_experts", "moe_intermediate_size", "qwen"),
    "deepseek_v2": ("n_routed_experts", "moe_intermediate_size", "deepseek"),
    "deepseek_v3": ("n_routed_experts", "moe_intermediate_size", "deepseek"),
    "mixtral": ("num_local_experts", "intermediate_size", None),
    "olmoe": ("num_experts", "intermediate_size", None),
    "phimoe": ("num_local_experts", "intermediate_size", None),
}
#: Wrappers whose text config holds the MoE fields.
_HF_COMPOSITE = {"qwen3_5_moe"}
#: Families whose experts this layer would compute wrongly, and why.
_HF_MISFITS = {
    "gpt_oss": "its experts have biases, interleaved gate/up columns (transposed [E, H, 2I] storage) and a clamped "
               "SwiGLU with a sigmoid(alpha * gate) activation",
    "openai_privacy_filter": "its experts have biases, transposed weights and a custom gate activation",
    "deepseek_v4": "its experts use a clamped SwiGLU",
    "nemotron_h": "its experts have no gate (up projection and a plain activation, not SwiGLU)",
}

#: The six models of the paper's evaluation, in its order.
PAPER_MODELS = ("deepseek-v3", "phi-3.5-moe", "qwen3-30b-a3b", "qwen3.5-35b-a3b", "deepseek-v2-lite", "deepseek-v2")


def list_models() -> list[MoESpec]:
    """Every registered spec, sorted by name."""
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]
