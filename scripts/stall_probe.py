"""Probe the stalled-peer path: rank 1 never launches; rank 0 polls its kernel's status word and completion without
blocking (side-stream copies, event queries) and prints what it sees. Usage: stall_probe.py <policy> <graph 0|1>"""
import os
import sys
import time

import torch
import torch.distributed as dist

from weave_moe.layer import ExpertParallelMoE
from weave_moe.models import MoESpec
from weave_moe.testing import make_experts, run_distributed


def worker(rank, world_size, policy, graph):
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    spec = MoESpec(16, 2, 256, 128, name="stall")
    w13, w2 = make_experts(spec, seed=1, device=device)
    local = spec.num_experts // world_size
    stalled = rank == world_size - 1
    layer = ExpertParallelMoE(spec, group=dist.group.WORLD, backend="weave", policy=policy, device=device,
                              max_tokens_per_rank=64, timeout_s=2.0, debug_skip_launch=stalled,
                              use_cuda_graph=graph)
    layer.load_experts(w13[rank * local:(rank + 1) * local], w2[rank * local:(rank + 1) * local])
    ids = torch.randint(0, spec.num_experts, (64, 1), device=device).repeat(1, 2)
    ids[:, 1] = (ids[:, 0] + 1) % spec.num_experts
    x = torch.randn(64, spec.hidden_size, device=device).to(torch.bfloat16)
    w = torch.full((64, 2), 0.5, device=device)
    layer(x, ids, w)
    done = torch.cuda.Event()
    done.record()
    side = torch.cuda.Stream(device)
    start = time.perf_counter()
    seen = []
    while time.perf_counter() - start < 8:
        with torch.cuda.stream(side):
            st = layer.backend.status.to("cpu", non_blocking=True)
        side.synchronize()
        seen.append((round(time.perf_counter() - start, 2), done.query(), st.tolist()))
        if done.query():
            break
        time.sleep(0.5)
    print(f"rank {rank} policy={policy} graph={graph} plan={layer.backend.last_plan} polls={seen[::3] + seen[-1:]}",
          flush=True)
    return dict(finished=done.query())


if __name__ == "__main__":
    policy, graph = sys.argv[1], sys.argv[2] == "1"
    try:
        print(run_distributed(worker, 2, policy, graph, backend="nccl", timeout_s=45))
    except Exception as error:  # noqa: BLE001
        print("probe:", type(error).__name__, str(error)[:300])
    os._exit(0)
