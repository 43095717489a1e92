"""The symm (NVSHMEM all_to_all_vdev_2d) and deepep (DeepEP Buffer) baselines against the reference.

On the CPU only the construction errors are tested. With one GPU: each backend at EP=1 through the layer (its local
expert stage). With two GPUs: EP=2 in fresh processes (symm and weave cannot share a process: PyTorch keeps one
symmetric-memory backend per process), two paper models at 1024 tokens per rank with skewed routing, -1 holes and an
empty token, every rank against the reference backend. Skipped, with the reason, where NVSHMEM or deep_ep is missing.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from weave_moe import routing
from weave_moe.layer import ExpertParallelMoE
from weave_moe.models import MoESpec
from weave_moe.reference import DEFAULT_TOLERANCE, moe_error
from weave_moe.testing import make_experts, run_distributed

MODELS = ["qwen3-30b-a3b", "deepseek-v2-lite"]
TOKENS_PER_RANK = 1024


def _nvshmem_available() -> bool:
    if not torch.cuda.is_available():
        return False
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem.is_nvshmem_available()


_SKIP_REASON = {
    "symm": None if _nvshmem_available() else "needs CUDA with NVSHMEM (symm_mem.is_nvshmem_available())",
    "deepep": None if importlib.util.find_spec("deep_ep") else "needs DeepEP (`import deep_ep`): not installed",
}


def test_construction_errors_are_clear_without_the_requirements():
    spec = MoESpec(8, 2, 64, 32)
    with pytest.raises(RuntimeError, match="symm backend needs .*NVSHMEM"):
        ExpertParallelMoE(spec, backend="symm", device="cpu")
    with pytest.raises(RuntimeError, match="deepep backend needs"):
        ExpertParallelMoE(spec, backend="deepep", device="cpu")


def _inputs(spec: MoESpec, num_tokens: int, rank: int, device):
    skew = min(3.0, routing.max_skew(spec.num_experts, spec.top_k))
    ids, weights = routing.skewed(num_tokens, spec.num_experts, spec.top_k, skew=skew, seed=rank, device=device)
    ids = ids.to(torch.int32)
    ids[0] = -1
    ids[1, ::2] = -1
    generator = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(num_tokens, spec.hidden_size, generator=generator, device=device).to(torch.bfloat16)
    return x, ids, weights


def _check(rank: int, world_size: int, backend: str, model_names: list[str], num_tokens: int) -> dict:
    device = torch.device("cuda", rank)
    results = {}
    for name in model_names:
        spec = MoESpec.from_name(name)
        experts_per_rank = spec.num_experts // world_size
        x, ids, weights = _inputs(spec, num_tokens, rank, device)
        w13, w2 = make_experts(spec, experts_per_rank, first_expert=rank * experts_per_rank, device=device)
        layer = ExpertParallelMoE(spec, backend=backend, max_tokens_per_rank=num_tokens, device=device)
        layer.load_experts(w13, w2)
        timings: dict = {}
        out = layer(x, ids, weights, timings=timings)
        small = layer(x[:7], ids[:7], weights[:7])
        layer.backend.synchronize()
        reference = ExpertParallelMoE(spec, backend="reference", max_tokens_per_rank=num_tokens, device=device)
        reference.load_experts(w13, w2)
        ref = reference(x, ids, weights)
        results[name] = {"rel_fro": moe_error(out, ref)[0], "rel_small": moe_error(small, ref[:7])[0],
                         "zero_row": bool((out[0] == 0).all()), "timings": timings}
        del layer, reference
        torch.cuda.empty_cache()
    return results


def _assert_results(per_rank: list[dict]) -> None:
    for rank, per_model in enumerate(per_rank):
        for name, result in per_model.items():
            where = f"{name} rank {rank}: {result}"
            assert result["rel_fro"] <= DEFAULT_TOLERANCE, where
            assert result["rel_small"] <= DEFAULT_TOLERANCE, where
            assert result["zero_row"], where
            assert {"permute", "gemms", "unpermute", "total"} <= set(result["timings"]), where


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["symm", "deepep"])
def test_baseline_on_one_gpu(backend: str):
    if _SKIP_REASON[backend]:
        pytest.skip(_SKIP_REASON[backend])
    # A fresh process: symm selects PyTorch's NVSHMEM symmetric-memory backend for the whole process.
    _assert_results(run_distributed(_check, 1, backend, MODELS, TOKENS_PER_RANK, backend="nccl", timeout_s=300))


@pytest.mark.multigpu
@pytest.mark.parametrize("backend", ["symm", "deepep"])
def test_baseline_on_two_gpus(backend: str):
    if _SKIP_REASON[backend]:
        pytest.skip(_SKIP_REASON[backend])
    _assert_results(run_distributed(_check, 2, backend, MODELS, TOKENS_PER_RANK, backend="nccl", timeout_s=300))
