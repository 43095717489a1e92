"""The nccl backend on 2 GPUs (NCCL, torch._grouped_mm) against the reference, for two paper models at 4096 tokens/rank.

Skipped without 2 CUDA GPUs (conftest.py). Each rank checks its own output against the reference backend (which
all-gathers the experts), with every reusable buffer poisoned first, that the timing hooks report every stage, and
that a call (without the layer's id check or timings) synchronizes the host exactly once (CUDA sync debug mode).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from weave_moe import routing
from weave_moe.layer import ExpertParallelMoE
from weave_moe.models import MoESpec
from weave_moe.reference import DEFAULT_TOLERANCE, moe_error
from weave_moe.testing import make_experts, run_distributed

MODELS = ["deepseek-v2-lite", "qwen3-30b-a3b"]
TOKENS_PER_RANK = 4096


def _check_models(rank: int, world_size: int, model_names: list[str], num_tokens: int) -> dict:
    device = torch.device("cuda", rank)
    results = {}
    for name in model_names:
        spec = MoESpec.from_name(name)
        num_local_experts = spec.num_experts // world_size
        skew = min(3.0, routing.max_skew(spec.num_experts, spec.top_k))
        ids, weights = routing.skewed(num_tokens, spec.num_experts, spec.top_k, skew=skew, seed=rank, device=device)
        ids[0] = -1  # one token with no expert, and holes in another
        ids[1, ::2] = -1
        generator = torch.Generator(device=device).manual_seed(rank)
        x = torch.randn(num_tokens, spec.hidden_size, generator=generator, device=device).to(torch.bfloat16)
        w13, w2 = make_experts(spec, num_local_experts, first_expert=rank * num_local_experts, device=device)

        layer = ExpertParallelMoE(spec, backend="nccl", max_tokens_per_rank=num_tokens, device=device)
        layer.load_experts(w13, w2)
        layer(x, ids, weights)
        layer.backend.poison_workspace()
        timings: dict = {}
        out = layer(x, ids, weights, timings=timings)
        again = layer(x[:7], ids[:7], weights[:7])  # a smaller call after a larger one reuses the buffers
        host_syncs = _count_host_syncs(layer, x, ids, weights)

        reference = ExpertParallelMoE(spec, backend="reference", max_tokens_per_rank=num_tokens, device=device)
        reference.load_experts(w13, w2)
        ref = reference(x, ids, weights)
        rel_fro, max_abs = moe_error(out, ref)
        rel_small, _ = moe_error(again, ref[:7])
        results[name] = {
            "rel_fro": rel_fro, "max_abs": max_abs, "rel_small": rel_small,
            "nan": bool(torch.isnan(out.float()).any()),
            "zero_row": bool((out[0] == 0).all()),
            "grouped_mm": layer.backend.use_grouped_mm,
            "host_syncs": host_syncs,
            "timings": timings,
        }
        del layer, reference
        torch.cuda.empty_cache()
    return results


def _count_host_syncs(layer, x, ids, weights) -> int:
    """Synchronizing CUDA calls (blocking copies, stream syncs) one layer call makes, the id check turned off."""
    check, layer.check_expert_ids = layer.check_expert_ids, False
    torch.cuda.synchronize()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                layer(x, ids, weights)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        layer.check_expert_ids = check
    return sum("synchroniz" in str(warning.message) for warning in caught)


@pytest.mark.multigpu
def test_nccl_backend_on_two_gpus():
    results = run_distributed(_check_models, 2, MODELS, TOKENS_PER_RANK, backend="nccl", timeout_s=300)
    for rank, per_model in enumerate(results):
        for name, result in per_model.items():
            where = f"{name} rank {rank}: {result}"
            assert result["grouped_mm"], where
            assert not result["nan"], where
            assert result["rel_fro"] <= DEFAULT_TOLERANCE, where
            assert result["rel_small"] <= DEFAULT_TOLERANCE, where
            assert result["zero_row"], where
            assert result["host_syncs"] == 1, where  # the count exchange's .tolist(), nothing else
            assert set(result["timings"]) == {"dispatch", "permute", "gemms", "unpermute", "combine", "total"}, where
            assert all(value > 0 for value in result["timings"].values()), where


@pytest.mark.gpu
def test_nccl_at_ep1_replays_from_a_callers_graph():
    """`capturable` at EP = 1 (what `weave-moe bench --graph` relies on): the call captured once, then replayed with
    fresh x and routing (uniform, skewed, holes) written into the captured inputs, its output poisoned before each
    replay, every replay against the reference."""
    device = torch.device("cuda")
    spec = MoESpec(16, 4, 512, 256, name="capture")
    w13, w2 = make_experts(spec, spec.num_experts, first_expert=0, device=device)
    layer = ExpertParallelMoE(spec, backend="nccl", max_tokens_per_rank=64, device=device, check_expert_ids=False)
    layer.load_experts(w13, w2)
    reference = ExpertParallelMoE(spec, backend="reference", max_tokens_per_rank=64, device=device)
    reference.load_experts(w13, w2)
    assert layer.capturable and not reference.capturable
    generator = torch.Generator(device=device).manual_seed(0)
    x_s = torch.randn(48, spec.hidden_size, generator=generator, device=device).to(torch.bfloat16)
    ids_s, w_s = routing.uniform(48, spec.num_experts, spec.top_k, seed=0, device=device)
    ids_s = ids_s.to(torch.int32).contiguous()
    layer(x_s, ids_s, w_s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = layer(x_s, ids_s, w_s)
    for replay in range(12):
        if replay % 3 == 1:
            ids, w = routing.skewed(48, spec.num_experts, spec.top_k, skew=4.0, seed=replay, device=device)
        else:
            ids, w = routing.uniform(48, spec.num_experts, spec.top_k, seed=replay, device=device)
        if replay % 3 == 2:
            ids = ids.clone()
            ids[::3, -1] = -1
        x_s.copy_(torch.randn(48, spec.hidden_size, generator=generator, device=device).to(torch.bfloat16))
        ids_s.copy_(ids)
        w_s.copy_(w)
        out_s.fill_(float("nan"))
        graph.replay()
        rel_fro, _ = moe_error(out_s, reference(x_s, ids_s, w_s))
        assert rel_fro <= DEFAULT_TOLERANCE, (replay, rel_fro)
