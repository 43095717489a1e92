"""Every bad input to ExpertParallelMoE raises a clear error naming the problem; good edge cases work."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import weave_moe.layer as layer_module
from weave_moe import routing
from weave_moe.layer import ExpertParallelMoE, moe_forward
from weave_moe.models import MoESpec
from weave_moe.reference import reference_moe
from weave_moe.testing import make_experts, run_distributed

SPEC = MoESpec(num_experts=8, top_k=2, hidden_size=32, intermediate_size=24)
T = 6


def good_inputs():
    x = torch.randn(T, SPEC.hidden_size).to(torch.bfloat16)
    ids, weights = routing.uniform(T, SPEC.num_experts, SPEC.top_k, seed=1)
    return x, ids, weights


def loaded_layer(backend: str = "nccl", **kwargs) -> ExpertParallelMoE:
    layer = ExpertParallelMoE(SPEC, backend=backend, max_tokens_per_rank=8, device="cpu", **kwargs)
    layer.load_experts(*make_experts(SPEC))
    return layer


@dataclass(frozen=True)
class BadCall:
    name: str
    mutate: Callable  # (x, ids, weights) -> (x, ids, weights)
    error: type
    match: str


BAD_CALLS = [
    BadCall("x-1d", lambda x, i, w: (x[0], i, w), ValueError, "x must be 2-D"),
    BadCall("x-hidden", lambda x, i, w: (x[:, :-1], i, w), ValueError, r"x must have shape \[T, 32\]"),
    BadCall("x-fp32", lambda x, i, w: (x.float(), i, w), TypeError, "x must be bfloat16"),
    BadCall("x-not-tensor", lambda x, i, w: (x.tolist(), i, w), TypeError, "x must be a torch.Tensor"),
    BadCall("ids-rows", lambda x, i, w: (x, i[:-1], w), ValueError, r"topk_ids must have shape \[T, top_k\]"),
    BadCall("ids-topk", lambda x, i, w: (x, i[:, :1], w), ValueError, r"topk_ids must have shape \[T, top_k\]"),
    BadCall("ids-float", lambda x, i, w: (x, i.float(), w), TypeError, "topk_ids must be int32 or int64"),
    BadCall("ids-int16", lambda x, i, w: (x, i.to(torch.int16), w), TypeError, "topk_ids must be int32 or int64"),
    BadCall("ids-too-big", lambda x, i, w: (x, torch.where(i == i.max(), 8, i), w), ValueError,
            r"topk_ids must be in \[-1, 8\)"),
    BadCall("ids-below-minus-one", lambda x, i, w: (x, torch.where(i == i.min(), -2, i), w), ValueError,
            r"topk_ids must be in \[-1, 8\)"),
    BadCall("weights-shape", lambda x, i, w: (x, i, w[:, :1]), ValueError, "topk_weights must have shape"),
    BadCall("weights-bf16", lambda x, i, w: (x, i, w.to(torch.bfloat16)), TypeError, "topk_weights must be float32"),
    BadCall("weights-3d", lambda x, i, w: (x, i, w[None]), ValueError, "topk_weights must be 2-D"),
    BadCall("too-many-tokens", lambda x, i, w: (torch.cat([x, x]), torch.cat([i, i]), torch.cat([w, w])), ValueError,
            "exceeds max_tokens_per_rank=8"),
    BadCall("x-on-meta", lambda x, i, w: (x.to("meta"), i, w), ValueError, "x is on meta but the layer is on cpu"),
    BadCall("ids-on-meta", lambda x, i, w: (x, i.to("meta"), w), ValueError, "topk_ids is on meta"),
]


@pytest.mark.parametrize("bad", BAD_CALLS, ids=lambda bad: bad.name)
def test_bad_call_raises(bad: BadCall):
    layer = loaded_layer()
    with pytest.raises(bad.error, match=bad.match):
        layer(*bad.mutate(*good_inputs()))


@dataclass(frozen=True)
class BadWeights:
    name: str
    w13: Callable  # (w13) -> w13
    w2: Callable
    error: type
    match: str


BAD_WEIGHTS = [
    BadWeights("w13-experts", lambda w: w[:-1], lambda w: w, ValueError, r"w13 must have shape \[8, 48, 32\]"),
    BadWeights("w13-transposed", lambda w: w.transpose(1, 2), lambda w: w, ValueError, "w13 must have shape"),
    BadWeights("w2-shape", lambda w: w, lambda w: w.transpose(1, 2), ValueError, r"w2 must have shape \[8, 32, 24\]"),
    BadWeights("w13-fp32", lambda w: w.float(), lambda w: w, TypeError, "w13 must be bfloat16"),
    BadWeights("w2-fp16", lambda w: w, lambda w: w.half(), TypeError, "w2 must be bfloat16"),
    BadWeights("w2-list", lambda w: w, lambda w: w.tolist(), TypeError, "w2 must be a torch.Tensor"),
]


@pytest.mark.parametrize("bad", BAD_WEIGHTS, ids=lambda bad: bad.name)
def test_bad_weights_raise(bad: BadWeights):
    layer = ExpertParallelMoE(SPEC, backend="nccl", device="cpu")
    w13, w2 = make_experts(SPEC)
    with pytest.raises(bad.error, match=bad.match):
        layer.load_experts(bad.w13(w13), bad.w2(w2))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(spec=(8, 2, 32, 16)), TypeError, "spec must be a MoESpec"),
        (dict(backend="tutel"), ValueError, "unknown backend 'tutel'"),
        (dict(backend="nccl", policy="serial"), ValueError, "applies to the weave backend only"),
        (dict(backend="reference", policy="static:20"), ValueError, "applies to the weave backend only"),
        (dict(backend="nccl", max_tokens_per_rank=0), ValueError, "max_tokens_per_rank must be a positive int"),
        (dict(backend="nccl", block_m=64), TypeError, r"unknown options \['block_m'\]"),
    ],
)
def test_bad_construction_raises(kwargs, error, match):
    kwargs = {"spec": SPEC, "device": "cpu", **kwargs}
    with pytest.raises(error, match=match):
        ExpertParallelMoE(**kwargs)


def test_forward_before_load_raises():
    layer = ExpertParallelMoE(SPEC, backend="nccl", device="cpu")
    with pytest.raises(RuntimeError, match="before load_experts"):
        layer(*good_inputs())


def test_unavailable_weave_backend_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(layer_module.BACKENDS, "weave", ("weave_moe.backends._missing_for_test", "WeaveBackend"))
    with pytest.raises(ImportError, match="backend 'weave' is not available"):
        ExpertParallelMoE(SPEC, backend="weave", device="cpu")


@pytest.mark.parametrize("backend", ["nccl", "reference"])
def test_edge_inputs_work(backend):
    layer = loaded_layer(backend)
    x, ids, weights = good_inputs()
    out = layer(x, ids.long(), weights)  # int64 ids are accepted
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    empty = layer(x[:0], ids[:0], weights[:0])
    assert empty.shape == (0, SPEC.hidden_size) and empty.dtype == torch.bfloat16
    all_none = layer(x[:2], torch.full((2, SPEC.top_k), -1, dtype=torch.int32), weights[:2])
    assert torch.equal(all_none, torch.zeros(2, SPEC.hidden_size, dtype=torch.bfloat16))


def test_moe_forward_matches_layer():
    x, ids, weights = good_inputs()
    w13, w2 = make_experts(SPEC)
    out = moe_forward(x, ids, weights, w13, w2, backend="nccl")
    torch.testing.assert_close(out, loaded_layer("nccl")(x, ids, weights), rtol=0, atol=0)
    assert out.shape == x.shape
    reference = moe_forward(x, ids, weights, w13, w2, backend="reference")
    assert torch.equal(reference, reference_moe(x, ids, weights, w13, w2))


def _distributed_checks(rank: int, world_size: int) -> dict[str, str]:
    """Errors that need a process group: E not divisible by EP, w13 sized for E instead of E_local."""
    messages = {}
    try:
        ExpertParallelMoE(MoESpec(9, 2, 32, 16), backend="nccl", device="cpu")
    except ValueError as error:
        messages["divisible"] = str(error)
    layer = ExpertParallelMoE(SPEC, backend="nccl", device="cpu")
    try:
        layer.load_experts(*make_experts(SPEC))  # all 8 experts, but this rank holds 4
    except ValueError as error:
        messages["e_local"] = str(error)
    messages["placement"] = f"{layer.rank} {layer.world_size} {layer.first_expert}"
    return messages


def test_errors_that_need_a_process_group():
    results = run_distributed(_distributed_checks, 2, timeout_s=60)
    for rank, messages in enumerate(results):
        assert "num_experts=9 is not divisible by the EP size 2" in messages.get("divisible", "")
        assert "w13 must have shape [4, 48, 32]" in messages.get("e_local", "")
        assert messages["placement"] == f"{rank} 2 {rank * 4}"


def _bad_id_on_one_rank(rank, world_size):
    import torch.distributed as dist

    from weave_moe.reference import moe_error, reference_moe

    spec = MoESpec(8, 2, 32, 16, name="bad-id")
    local = spec.num_experts // world_size
    w13, w2 = make_experts(spec, seed=3)
    layer = ExpertParallelMoE(spec, group=dist.group.WORLD, backend="nccl", max_tokens_per_rank=16,
                              device=torch.device("cpu"))
    layer.load_experts(w13[rank * local:(rank + 1) * local], w2[rank * local:(rank + 1) * local])
    ids = torch.tensor([[0, 5], [3, -1], [7, 2]], dtype=torch.int32)
    weights = torch.full((3, 2), 0.5)
    x = torch.randn(3, spec.hidden_size, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    bad = ids.clone()
    if rank == 1:
        bad[2, 0] = spec.num_experts
    try:
        layer(x, bad, weights)
        outcome = "no error"
    except ValueError as error:
        outcome = str(error)
    out = layer(x, ids, weights)  # the same layer goes on, on every rank
    return outcome, moe_error(out, reference_moe(x, ids, weights, w13, w2))[0]


def test_bad_id_on_one_rank_raises_on_every_rank_and_the_layer_goes_on():
    results = run_distributed(_bad_id_on_one_rank, 2, timeout_s=60)
    for outcome, error in results:
        assert "ids out of range on rank 1: 1" in outcome, outcome
        assert error < 1e-2
