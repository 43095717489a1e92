"""Pictures and utilisation figures from timelines recorded in the megakernel (scripts/timeline_stats.py JSON).

python scripts/plot_measured_timeline.py timeline-qwen3-30b-a3b-8192.json --out docs/figures --tag qwen3-8192
"""

import argparse
import json
from types import SimpleNamespace

from weave_moe.sim.timeline import measured_result, plot_timeline

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("json")
    parser.add_argument("--out", default="docs/figures")
    parser.add_argument("--tag", default="measured")
    parser.add_argument("--num-sms", type=int, default=132)
    args = parser.parse_args()
    data = json.load(open(args.json))
    for rank, per_variant in enumerate(data):
        for variant, record in per_variant.items():
            if variant.startswith("_"):
                continue
            p = record["plan"]
            plan = SimpleNamespace(policy=variant, c=p["c"], K=p["K"], n_steal=p["n_steal"])
            result = measured_result(record["events"], args.num_sms, plan)
            name = f"{args.out}/timeline-{args.tag}-{variant.replace(':', '_')}-rank{rank}.png"
            plot_timeline(result, name, title=f"measured on H200, rank {rank}, {variant}: c={plan.c}, K={plan.K}, "
                          f"n_steal={plan.n_steal}, {result.latency_us:.0f} us, SM busy {100 * result.sm_active:.0f}%, "
                          f"overlap {100 * result.overlap:.0f}%")
            print(f"{args.tag} rank {rank} {variant:18s} span {result.latency_us:8.0f} us  "
                  f"SM busy {100 * result.sm_active:5.1f}%  comm/GEMM overlap {100 * result.overlap:5.1f}%  -> {name}")
