"""Record in-kernel timelines (2 GPUs) and print per-task-kind statistics; saves JSON of the raw events.

python scripts/timeline_stats.py --model qwen3-30b-a3b --tokens 8192 --variants weave,weave:static:20 --out DIR
"""

import argparse
import json
from collections import defaultdict


from weave_moe.commands.calibrate import record_timelines
from weave_moe.testing import run_distributed


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--variants", default="weave,weave:static:20")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    results = run_distributed(record_timelines, 2, args.model, args.tokens, args.variants.split(","), backend="nccl",
                              timeout_s=400)
    for rank, per in enumerate(results):
        for variant, rec in per.items():
            if variant.startswith("_"):  # "_meta": tile shapes, not a variant
                continue
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
