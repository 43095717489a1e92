"""Pictures and utilisation figures (docs/utilisation.md) of timelines recorded in the megakernel.

Reads the JSON that scripts/timeline_stats.py (or `weave-moe calibrate --measure`) writes. Events of five fields
(cta, kind, start_ns, end_ns, ready_ns) split into waiting and work; older four-field recordings have no ready stamp,
so their waits count as work (an upper bound) and their pictures show no waiting.

python scripts/plot_measured_timeline.py timeline-qwen3-30b-a3b-8192-ep1of2.json --out docs/figures --tag qwen3-8192
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
    parser.add_argument("--num-sms", type=int, default=None, help="default: the recording's, else 132 (H200)")
    parser.add_argument("--device", default="H200", help="named in the picture's title")
    args = parser.parse_args()
    with open(args.json) as f:
        data = json.load(f)
    for rank, per_variant in enumerate(data):
        for variant, record in per_variant.items():
            if variant.startswith("_"):
                continue
            p = record["plan"]
            plan = SimpleNamespace(policy=variant, c=p["c"], K=p["K"], n_steal=p["n_steal"])
            num_sms = args.num_sms or record.get("num_sms", 132)
            result = measured_result(record["events"], num_sms, plan)
            old = any(len(event) < 5 for event in record["events"])
            name = f"{args.out}/timeline-{args.tag}-{variant.replace(':', '_')}-rank{rank}.png"
            plot_timeline(result, name, title=f"measured on {args.device}, rank {rank}, {variant}: c={plan.c}, "
                          f"K={plan.K}, n_steal={plan.n_steal}" + (" (no wait stamps: waits drawn as work)"
                                                                   if old else ""))
            u = result.utilisation
            print(f"{args.tag} rank {rank} {variant:18s} span {u.span_us:8.0f} us  SM active {100 * u.sm_active:5.1f}%"
                  f"  waiting {100 * u.waiting:5.1f}%  comm/GEMM overlap {100 * u.overlap:5.1f}%"
                  f"{'  (no wait stamps)' if old else ''}  -> {name}")
