"""First-call cost of a weave layer on the GPU pair: wall time of each of a layer's first calls (host-synchronised),
with the task tables compiled (KernelConfig.compile_layout, the default) and eager, for a few paper models.

The first call compiles the megakernel (Triton, cached on disk), the task tables (Inductor, cached on disk) and
captures two CUDA graphs; later calls replay. Run on a fresh machine to see cold caches.

    python scripts/first_call_probe.py --out first-call.json [--models qwen3-30b-a3b,deepseek-v3] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import time


def _worker(rank, world_size, models, tokens, calls):
    import torch
    import torch.distributed as dist

    from weave_moe import routing
    from weave_moe.layer import ExpertParallelMoE
    from weave_moe.models import MoESpec
    from weave_moe.testing import make_experts

    device = torch.device("cuda", rank)
    rows = []
    for config in ("compile_layout=1", "compile_layout=0"):
        os.environ["WEAVE_MOE_KERNEL_CONFIG"] = config
        for name in models:
            spec = MoESpec.from_name(name)
            local = spec.num_experts // world_size
            w13, w2 = make_experts(spec, local, first_expert=rank * local, seed=0, device=device)
            layer = ExpertParallelMoE(spec, backend="weave", device=device, max_tokens_per_rank=tokens)
            layer.load_experts(w13, w2)
            times = []
            for call in range(calls):
                ids, weights = routing.uniform(tokens, spec.num_experts, spec.top_k, seed=100 * call + rank, device=device)
                x = torch.randn(tokens, spec.hidden_size, device=device).to(torch.bfloat16)
                dist.barrier()
                torch.cuda.synchronize(device)
                start = time.perf_counter()
                layer(x, ids, weights)
                layer.backend.synchronize()
                times.append(round((time.perf_counter() - start) * 1e3, 3))
            rows.append(dict(rank=rank, config=config, model=name, tokens=tokens, call_ms=times))
            del layer, w13, w2
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="qwen3-30b-a3b,deepseek-v3")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=280)
    args = parser.parse_args()

    import torch

    from weave_moe.testing import run_distributed

    start = time.time()
    results = run_distributed(_worker, 2, args.models.split(","), args.tokens, args.calls, backend="nccl",
                              timeout_s=args.timeout)
    rows = [row for rank_rows in results for row in rank_rows]
    for row in rows:
        print(f"rank {row['rank']} {row['config']:17s} {row['model']:16s} ms per call: {row['call_ms']}")
    record = dict(date=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(start)),
                  device=torch.cuda.get_device_name(0), num_gpus=torch.cuda.device_count(),
                  commit=os.environ.get("WEAVE_MOE_GIT_COMMIT", "unknown"),
                  command="python scripts/first_call_probe.py " + " ".join(
                      f"--{k} {v}" for k, v in vars(args).items()),
                  rows=rows)
    with open(args.out, "w") as handle:
        json.dump(record, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
