"""Profile one layer call per variant on 2 GPUs (torch.profiler, rank 0): where does the time go?

python scripts/profile_layer.py --model qwen3-30b-a3b --tokens 2048 --variants nccl,weave,weave:serial
python scripts/profile_layer.py --nproc 1 --emulate-ep 2 ...     (one GPU: the per-rank work of EP=2)

Per variant: host-return and synchronised milliseconds of 10 single calls, the per-step milliseconds the backend
reports through `layer(..., timings=)` (mean of 10 more calls; for weave the host steps), and torch.profiler's CUDA
and CPU tables of 3 more calls. The `profile` stage of scripts/device_run.sh runs it.
"""

import argparse
import time

import torch

from weave_moe.testing import make_experts, run_distributed


def worker(rank, world_size, model, tokens, variants, rows, emulate_ep=1):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from weave_moe import routing
    from weave_moe.layer import ExpertParallelMoE
    from weave_moe.bench.config import emulated_spec
    from weave_moe.models import MoESpec

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    spec = emulated_spec(MoESpec.from_name(model), emulate_ep)
    local = spec.num_experts // world_size
    w13, w2 = make_experts(spec, local, first_expert=rank * local, seed=1, device=device)
    ids, w = routing.uniform(tokens, spec.num_experts, spec.top_k, seed=rank)
    ids, w = ids.to(device), w.to(device)
    x = torch.randn(tokens, spec.hidden_size, device=device).to(torch.bfloat16)
    report = []
    for variant in variants:
        backend, _, policy = variant.partition(":")
        kw = dict(policy=policy) if policy else {}
        layer = ExpertParallelMoE(spec, backend=backend, device=device, max_tokens_per_rank=tokens,
                                  check_expert_ids=False, **kw)
        layer.load_experts(w13, w2)
        for _ in range(3):
            layer(x, ids, w)
        torch.cuda.synchronize()
        dist.barrier()
        times, steps, calls = [], {}, 10  # warm-up (compile, graph capture, NCCL init) stays out of both
        for _ in range(calls):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            layer(x, ids, w)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            times.append(((t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3))
        # Separate calls for the per-step figures: a backend may time its steps with events it waits for.
        for _ in range(calls):
            timings = {}
            layer(x, ids, w, timings=timings)
            torch.cuda.synchronize()
            for name, ms in timings.items():
                steps[name] = steps.get(name, 0.0) + ms
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                layer(x, ids, w)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)
        cpu_table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=rows)
        if steps:
            table = "ms per call by step: " + ", ".join(f"{k}={v / calls:.3f}" for k, v in steps.items()) + "\n" + table
        report.append((variant, times, table, cpu_table))
        del layer
        dist.barrier()
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--variants", default="nccl,weave,weave:serial")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--emulate-ep", type=int, default=1)
    args = parser.parse_args()
    results = run_distributed(worker, args.nproc, args.model, args.tokens, args.variants.split(","), args.rows,
                              args.emulate_ep, backend="nccl", timeout_s=500)
    for variant, times, table, cpu_table in results[0]:
        print(f"##### {variant}: host-return ms / synced ms per call:",
              " ".join(f"{a:.2f}/{b:.2f}" for a, b in times))
        print(table)
        print(cpu_table)
