"""Record in-kernel timelines (2 GPUs) and print per-task-kind statistics; saves JSON of the raw events.

python scripts/timeline_stats.py --model qwen3-30b-a3b --tokens 8192 --variants weave,weave:static:20 --out DIR
"""

import argparse
import json
from collections import defaultdict

import torch

from weave_moe.testing import make_experts, run_distributed


def worker(rank, world_size, model, tokens, variants):
    from weave_moe import routing
    from weave_moe.layer import ExpertParallelMoE
    from weave_moe.models import MoESpec

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    spec = MoESpec.from_name(model)
    local = spec.num_experts // world_size
    w13, w2 = make_experts(spec, local, first_expert=rank * local, seed=1, device=device)
    ids, w = routing.uniform(tokens, spec.num_experts, spec.top_k, seed=rank)
    ids, w = ids.to(device), w.to(device)
    x = torch.randn(tokens, spec.hidden_size, device=device).to(torch.bfloat16)
    out = {}
    for variant in variants:
        backend, _, policy = variant.partition(":")
        layer = ExpertParallelMoE(spec, backend="weave", policy=policy or "weave", device=device,
                                  max_tokens_per_rank=tokens, check_expert_ids=False, timeline=True)
        layer.load_experts(w13, w2)
        for _ in range(3):
            layer(x, ids, w)
        layer.backend.synchronize()
        p = layer.backend.last_plan
        out[variant] = dict(plan=dict(c=p.c, K=p.K, n_steal=p.n_steal, predicted_us=p.predicted_us),
                            events=layer.backend.last_timeline())
        del layer
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--variants", default="weave,weave:static:20")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    results = run_distributed(worker, 2, args.model, args.tokens, args.variants.split(","), backend="nccl",
                              timeout_s=400)
    for rank, per in enumerate(results):
        for variant, rec in per.items():
            ev = rec["events"]
            span = max(e[3] for e in ev) / 1e3
            stats = defaultdict(lambda: [0, 0.0])
            first = defaultdict(lambda: 1e18)
            last = defaultdict(float)
            for cta, kind, t0, t1 in ev:
                stats[kind][0] += 1
                stats[kind][1] += (t1 - t0) / 1e3
                first[kind] = min(first[kind], t0 / 1e3)
                last[kind] = max(last[kind], t1 / 1e3)
            busy = sum(s[1] for s in stats.values()) / (132 * span)
            print(f"rank {rank} {variant} plan={rec['plan']} span={span:.1f}us busy={busy:.0%}")
            for kind, (n, total) in sorted(stats.items()):
                print(f"   {kind:14s} n={n:6d} mean={total / n:8.2f}us total={total:10.1f}us "
                      f"window=[{first[kind]:.0f}, {last[kind]:.0f}]us")
    with open(f"{args.out}/timeline-{args.model}-{args.tokens}.json", "w") as f:
        json.dump(results, f)
