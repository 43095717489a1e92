"""Attention and shared-expert time of one layer, for end-to-end estimates (the paper's section 5.3).

An MoE transformer layer is attention + (shared experts) + the EP MoE layer. `weave-moe bench --attention` times the
first two on each GPU with the model's own shapes, and the report estimates a layer as

    e2e_ms(variant) = attention_ms + shared_ms + moe_ms(variant)          speed-up = e2e(nccl) / e2e(variant)

What is timed (bf16, prefill: each rank's T tokens as T / seq_len causal sequences of seq_len tokens):
  * GQA (Phi-3.5-MoE, Qwen3): x @ Wqkv (an extra query-sized gate for gated attention) -> SDPA (causal, GQA) -> @ Wo.
  * MLA (DeepSeek V2 / V2-Lite / V3), unabsorbed prefill form: q = x @ Wq (or through the q LoRA rank), latent =
    x @ Wkv_a, k_nope | v = latent @ Wkv_b, k = k_nope | shared rope part -> SDPA (qk dim 192, v dim 128) -> @ Wo.
  * shared experts: x @ W13s -> silu(gate) * up -> @ W2s, once per shared expert.
Left out (elementwise, small next to the GEMMs at these sizes): norms, RoPE, the router GEMM and top-k.
torch picks the SDPA kernel (flash / cuDNN / memory-efficient) as it would in a serving engine.

Shapes: the models' published config.json values, written below with their layer counts. Qwen3.5-35B-A3B is a
hybrid (3 of 4 layers Gated DeltaNet, linear attention): every layer is timed as its gated full-attention layer,
which overstates its attention time, so its end-to-end speed-ups are conservative; that spec is marked approximate.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

__all__ = ["AttentionSpec", "attention_spec", "time_attention", "time_shared_experts", "ATTENTION_SPECS"]


@dataclass(frozen=True)
class AttentionSpec:
    """The attention shape of one model's layers.

    Attributes:
        kind: "gqa" or "mla".
        hidden_size: H.
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA; MLA has one per query head).
        head_dim: GQA head dim.
        output_gate: GQA with a sigmoid output gate of the query's width (Qwen3.5 / Qwen3-Next gated attention).
        q_lora_rank: MLA: rank of the query down-projection (0 = a direct H -> heads * qk projection).
        kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: MLA dims.
        num_layers, num_moe_layers: layers of the model and how many have an MoE block.
        approximate: the timed shape is a stand-in (see the module docstring).
        source: where the numbers come from.
    """

    kind: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int = 0
    head_dim: int = 0
    output_gate: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    num_layers: int = 0
    num_moe_layers: int = 0
    approximate: bool = False
    source: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _mla(hidden, heads, q_lora, layers, moe_layers, source):
    return AttentionSpec("mla", hidden, heads, q_lora_rank=q_lora, kv_lora_rank=512, qk_nope_head_dim=128,
                         qk_rope_head_dim=64, v_head_dim=128, num_layers=layers, num_moe_layers=moe_layers,
                         source=source)


ATTENTION_SPECS = {
    "deepseek-v3": _mla(7168, 128, 1536, 61, 58, "DeepSeek-V3 config.json (first 3 layers dense)"),
    "deepseek-v2": _mla(5120, 128, 1536, 60, 59, "DeepSeek-V2 config.json (first layer dense)"),
    "deepseek-v2-lite": _mla(2048, 16, 0, 27, 26, "DeepSeek-V2-Lite config.json (no q LoRA; first layer dense)"),
    "phi-3.5-moe": AttentionSpec("gqa", 4096, 32, 8, 128, num_layers=32, num_moe_layers=32,
                                 source="Phi-3.5-MoE-instruct config.json"),
    "qwen3-30b-a3b": AttentionSpec("gqa", 2048, 32, 4, 128, num_layers=48, num_moe_layers=48,
                                   source="Qwen3-30B-A3B config.json"),
    "qwen3.5-35b-a3b": AttentionSpec("gqa", 2048, 16, 2, 256, output_gate=True, num_layers=40, num_moe_layers=40,
                                     approximate=True,
                                     source="Qwen3.5 MoE gated attention (16 q / 2 kv heads, head dim 256, as "
                                            "Qwen3-Next); Gated DeltaNet layers timed as full attention"),
}


def attention_spec(moe_spec) -> AttentionSpec:
    """The registered attention shape of `moe_spec`'s model, or a generic GQA guess (marked approximate):
    heads of 128 (or H when H < 128), 4 query heads per kv head."""
    if moe_spec.name in ATTENTION_SPECS:
        return ATTENTION_SPECS[moe_spec.name]
    hidden = moe_spec.hidden_size
    head_dim = min(128, hidden)
    num_heads = max(1, hidden // head_dim)
    return AttentionSpec("gqa", hidden, num_heads, max(1, num_heads // 4), head_dim, approximate=True,
                         source=f"generic guess for {moe_spec.name}: {num_heads} heads of {head_dim}")


def _weight(rows: int, cols: int, device, generator) -> torch.Tensor:
    return (torch.randn(rows, cols, device=device, generator=generator) * cols**-0.5).to(torch.bfloat16)


def _sdpa(q, k, v, enable_gqa: bool):
    """Causal SDPA on [B, heads, S, dim]; a v head dim unlike the qk one falls back to padding v when the chosen
    kernel refuses it."""
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    except RuntimeError:
        if v.shape[-1] == q.shape[-1]:
            raise
        padded = F.pad(v, (0, q.shape[-1] - v.shape[-1]))
        return F.scaled_dot_product_attention(q, k, padded, is_causal=True, enable_gqa=enable_gqa)[..., :v.shape[-1]]


def _attention_fn(spec: AttentionSpec, tokens: int, seq_len: int, device):
    """A closure running one attention block on [tokens, H] input (weights made here)."""
    generator = torch.Generator(device=device).manual_seed(0)
    hidden = spec.hidden_size
    batch = max(1, tokens // seq_len)
    x = torch.randn(batch * seq_len, hidden, device=device, generator=generator).to(torch.bfloat16)

    def heads(t, num_heads, dim):  # [B*S, num_heads*dim] -> [B, num_heads, S, dim]
        return t.view(batch, seq_len, num_heads, dim).transpose(1, 2)

    if spec.kind == "gqa":
        q_width = spec.num_heads * spec.head_dim
        kv_width = spec.num_kv_heads * spec.head_dim
        w_qkv = _weight(q_width * (2 if spec.output_gate else 1) + 2 * kv_width, hidden, device, generator)
        w_o = _weight(hidden, q_width, device, generator)

        def run():
            qkv = x @ w_qkv.t()
            q, rest = qkv[:, :q_width], qkv[:, q_width:]
            gate = None
            if spec.output_gate:
                gate, rest = rest[:, :q_width], rest[:, q_width:]
            k, v = rest[:, :kv_width], rest[:, kv_width:]
            out = _sdpa(heads(q, spec.num_heads, spec.head_dim), heads(k, spec.num_kv_heads, spec.head_dim),
                        heads(v, spec.num_kv_heads, spec.head_dim), enable_gqa=spec.num_kv_heads != spec.num_heads)
            out = out.transpose(1, 2).reshape(-1, q_width)
            if gate is not None:
                out = out * torch.sigmoid(gate)
            return out @ w_o.t()

        return run

    qk_dim = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    num_heads = spec.num_heads
    if spec.q_lora_rank:
        w_q_a = _weight(spec.q_lora_rank, hidden, device, generator)
        w_q_b = _weight(num_heads * qk_dim, spec.q_lora_rank, device, generator)
    else:
        w_q = _weight(num_heads * qk_dim, hidden, device, generator)
    w_kv_a = _weight(spec.kv_lora_rank + spec.qk_rope_head_dim, hidden, device, generator)
    w_kv_b = _weight(num_heads * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank, device, generator)
    w_o = _weight(hidden, num_heads * spec.v_head_dim, device, generator)

    def run():
        q = (x @ w_q_a.t()) @ w_q_b.t() if spec.q_lora_rank else x @ w_q.t()
        latent = x @ w_kv_a.t()
        kv = (latent[:, :spec.kv_lora_rank] @ w_kv_b.t()).view(-1, num_heads, spec.qk_nope_head_dim + spec.v_head_dim)
        k_rope = latent[:, spec.kv_lora_rank:].unsqueeze(1).expand(-1, num_heads, -1)
        k = torch.cat([kv[..., :spec.qk_nope_head_dim], k_rope], dim=-1)
        v = kv[..., spec.qk_nope_head_dim:]
        out = _sdpa(heads(q, num_heads, qk_dim), heads(k.reshape(-1, num_heads * qk_dim), num_heads, qk_dim),
                    heads(v.reshape(-1, num_heads * spec.v_head_dim), num_heads, spec.v_head_dim), enable_gqa=False)
        return out.transpose(1, 2).reshape(-1, num_heads * spec.v_head_dim) @ w_o.t()

    return run


def _shared_fn(moe_spec, tokens: int, device):
    if not moe_spec.num_shared_experts or not moe_spec.shared_intermediate_size:
        return None
    generator = torch.Generator(device=device).manual_seed(1)
    hidden, inter = moe_spec.hidden_size, moe_spec.shared_intermediate_size
    x = torch.randn(tokens, hidden, device=device, generator=generator).to(torch.bfloat16)
    experts = [(_weight(2 * inter, hidden, device, generator), _weight(hidden, inter, device, generator))
               for _ in range(moe_spec.num_shared_experts)]

    def run():
        out = None
        for w13, w2 in experts:
            gate_up = x @ w13.t()
            y = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ w2.t()
            out = y if out is None else out + y
        return out

    return run


def _median_ms(fn, device, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        torch.cuda.synchronize(device)
        for i in range(iters):
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize(device)
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def time_attention(spec: AttentionSpec, tokens: int, device, *, seq_len: int = 0, iters: int = 20,
                   warmup: int = 3) -> float:
    """Median ms of one attention block on `tokens` tokens (as tokens / seq_len causal sequences; seq_len 0 = one
    sequence of all tokens). Weights and inputs are made here and freed on return."""
    device = torch.device(device)
    seq_len = min(seq_len or tokens, tokens)
    return _median_ms(_attention_fn(spec, tokens, seq_len, device), device, iters, warmup)


def time_shared_experts(moe_spec, tokens: int, device, *, iters: int = 20, warmup: int = 3) -> float:
    """Median ms of the model's shared experts on `tokens` tokens (0.0 for models without any)."""
    device = torch.device(device)
    fn = _shared_fn(moe_spec, tokens, device)
    return 0.0 if fn is None else _median_ms(fn, device, iters, warmup)
