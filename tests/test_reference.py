"""`reference_moe` against a naive per-token loop, and the error helpers."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from weave_moe import routing
from weave_moe.reference import DEFAULT_TOLERANCE, assert_moe_close, moe_error, reference_moe
from weave_moe.testing import make_experts


def naive_moe(x, topk_ids, topk_weights, w13, w2, round_h: bool = True) -> torch.Tensor:
    """The formula of docs/design.md ("Semantics"), one token and one slot at a time, in fp32."""
    intermediate = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32)
    for token in range(x.shape[0]):
        for slot in range(topk_ids.shape[1]):
            expert = int(topk_ids[token, slot])
            if expert < 0:
                continue
            gate_up = w13[expert].float() @ x[token].float()
            h = F.silu(gate_up[:intermediate]) * gate_up[intermediate:]
            if round_h:
                h = h.to(torch.bfloat16).float()
            out[token] += topk_weights[token, slot] * (w2[expert].float() @ h)
    return out.to(torch.bfloat16)


@dataclass(frozen=True)
class Case:
    name: str
    num_tokens: int
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    holes: bool = False

    def inputs(self, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        x = torch.randn(self.num_tokens, self.hidden_size, generator=generator).to(torch.bfloat16)
        ids, weights = routing.uniform(self.num_tokens, self.num_experts, self.top_k, seed=seed)
        if self.holes and self.num_tokens:
            ids = torch.where(torch.rand(ids.shape, generator=generator) < 0.3, -1, ids)
            ids[0] = -1
        w13, w2 = make_experts((self.hidden_size, self.intermediate_size), self.num_experts, seed=seed)
        return x, ids, weights, w13, w2


CASES = [
    Case("small", 9, 4, 2, 16, 8),
    Case("odd", 7, 5, 3, 13, 11, holes=True),
    Case("one-token", 1, 8, 4, 32, 24),
    Case("no-tokens", 0, 4, 2, 16, 8),
    Case("wide-intermediate", 5, 3, 1, 8, 96),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_reference_matches_naive_loop(case: Case):
    x, ids, weights, w13, w2 = case.inputs()
    out = reference_moe(x, ids, weights, w13, w2)
    expected = naive_moe(x, ids, weights, w13, w2)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    # Same math, different fp32 summation order: at most one bf16 rounding step apart.
    torch.testing.assert_close(out, expected, rtol=2**-7, atol=1e-6)
    if case.holes:
        assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_reference_accepts_int64_ids():
    x, ids, weights, w13, w2 = CASES[0].inputs()
    assert torch.equal(reference_moe(x, ids.long(), weights, w13, w2), reference_moe(x, ids, weights, w13, w2))


def test_h_is_rounded_to_bf16():
    # A large I makes h's rounding visible in the output; the reference must follow the rounded path.
    x, ids, weights, w13, w2 = Case("wide", 16, 2, 1, 8, 256).inputs(seed=3)
    out = reference_moe(x, ids, weights, w13, w2)
    rounded = naive_moe(x, ids, weights, w13, w2, round_h=True)
    unrounded = naive_moe(x, ids, weights, w13, w2, round_h=False)
    distance_rounded = (out.float() - rounded.float()).norm()
    distance_unrounded = (out.float() - unrounded.float()).norm()
    assert distance_unrounded > 0, "h rounding made no difference; the test lost its power"
    assert distance_rounded < 0.1 * distance_unrounded


def test_all_slots_empty_gives_zeros():
    x, ids, weights, w13, w2 = CASES[0].inputs()
    out = reference_moe(x, torch.full_like(ids, -1), weights, w13, w2)
    assert torch.equal(out, torch.zeros_like(out))


def test_moe_error_and_assert_close():
    ref = torch.randn(64, 32).to(torch.bfloat16)
    assert moe_error(ref, ref) == (0.0, 0.0)
    noisy = (ref.float() * (1 + 1e-3 * torch.randn(ref.shape))).to(torch.bfloat16)
    rel_fro, max_abs = moe_error(noisy, ref)
    assert 0 < rel_fro < DEFAULT_TOLERANCE and 0 < max_abs < 0.1
    assert_moe_close(noisy, ref)

    with pytest.raises(AssertionError, match="relative Frobenius error"):
        assert_moe_close((ref.float() * 1.05).to(torch.bfloat16), ref)
    poisoned = ref.clone()
    poisoned[3, 5] = float("nan")
    with pytest.raises(AssertionError, match=r"NaN in rows \[3\]"):
        assert_moe_close(poisoned, ref)
    assert moe_error(poisoned, ref) == (float("inf"), float("inf"))
    with pytest.raises(ValueError, match="shape mismatch"):
        moe_error(ref[:3], ref)
    empty = torch.empty(0, 32, dtype=torch.bfloat16)
    assert moe_error(empty, empty) == (0.0, 0.0)


@pytest.mark.gpu
def test_reference_on_gpu_matches_cpu():
    x, ids, weights, w13, w2 = Case("gpu", 64, 8, 2, 128, 64, holes=True).inputs()
    cpu = reference_moe(x, ids, weights, w13, w2)
    gpu = reference_moe(*(t.cuda() for t in (x, ids, weights, w13, w2)))
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=2**-7, atol=1e-6)
