"""Record in-kernel timelines of the weave megakernel and set their utilisation beside the simulator's.

One GPU (`--emulate-ep N`): EP=1 running the per-rank work of EP=N. The layer holds E/N experts (one rank's local
experts) and gets T tokens with uniform top-k routing over them, so its GEMMs see T*k rows in E/N groups, as one rank
of EP=N does under uniform routing (T*k*N pairs of which 1/N land on each rank). Dispatch and combine move the same
token rows, but as local copies: no NVLink traffic and no waits for a peer. N GPUs (`--ep N`, the default with N = 2):
the real EP=N, one NCCL rank per GPU. The figures are defined in docs/utilisation.md
(`weave_moe.sim.timeline.utilisation`, the same function for the measured and the simulated timeline).

    python scripts/timeline_stats.py --emulate-ep 2 --models deepseek-v3:4096,qwen3-30b-a3b:8192 \
        --variants weave:serial,weave:static:20,weave --out "$OUT"

Writes into --out:
    timeline-<model>-<tokens>-<mode>.json      raw events per rank (bench/results/timelines/README.md format, events
                                               [cta, kind, start_ns, end_ns, ready_ns]) with a .meta.json sidecar
    timeline-<model>-<tokens>-<mode>-<variant>-rank<r>-{measured,simulated}.png
    utilisation-<mode>.json                    per model, variant and rank: plan, measured and simulated figures
where <mode> is "ep1of<N>" (emulated) or "ep<N>".
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

from weave_moe.bench.config import emulated_spec
from weave_moe.commands.calibrate import record_timelines
from weave_moe.models import MoESpec


def routing_of(spec: MoESpec, tokens: int, rank: int):
    """Rank `rank`'s (topk_ids, topk_weights) on the CPU: uniform routing, seed = rank, as `record_timelines` routes."""
    from weave_moe import routing

    return routing.uniform(tokens, spec.num_experts, spec.top_k, seed=rank)


def kind_table(events) -> list[str]:
    """Per event kind: count, mean wait and work per event, SM-time, first start and last end."""
    stats = defaultdict(lambda: [0, 0.0, 0.0, math.inf, 0.0])
    for _, kind, t0, t1, ready in events:
        s = stats[kind]
        s[0] += 1
        s[1] += (ready - t0) / 1e3
        s[2] += (t1 - ready) / 1e3
        s[3], s[4] = min(s[3], t0 / 1e3), max(s[4], t1 / 1e3)
    return [f"   {kind:14s} n={n:6d} wait={wait / n:8.2f}us work={work / n:8.2f}us total={wait + work:10.1f}us "
            f"window=[{lo:.0f}, {hi:.0f}]us" for kind, (n, wait, work, lo, hi) in sorted(stats.items())]


def compare(spec: MoESpec, tokens: int, world_size: int, results: list[dict], out: Path, tag: str) -> list[dict]:
    """Measured vs simulated utilisation of every (rank, variant), with both pictures."""
    from weave_moe.plan import MAX_CHUNKS, HardwareProfile, Plan, Workload
    from weave_moe.sim import measured_result, plot_timeline, simulate

    profile = HardwareProfile.default()
    all_ids = [routing_of(spec, tokens, r)[0] for r in range(world_size)]
    rows = []
    for rank, per_variant in enumerate(results):
        workload = Workload.from_routing(spec, all_ids, rank, chunk_counts=range(1, MAX_CHUNKS + 1))
        for variant, rec in per_variant.items():
            if variant.startswith("_"):
                continue
            plan = Plan(**rec["plan"])
            measured = measured_result(rec["events"], rec["num_sms"], plan)
            if rec["num_sms"] != profile.num_sms:
                print(f"note: the GPU has {rec['num_sms']} SMs, the profile {profile.num_sms}")
            simulated = simulate(workload, profile, plan)
            stem = f"{out}/timeline-{tag}-{variant.replace(':', '_')}-rank{rank}"
            roles = f"c={plan.c}, K={plan.K}, n_steal={plan.n_steal}"
            plot_timeline(measured, f"{stem}-measured.png",
                          title=f"measured on {rec['device']}, {tag}, rank {rank}, {variant}: {roles}")
            plot_timeline(simulated, f"{stem}-simulated.png",
                          title=f"simulated ({profile.name}), {tag}, rank {rank}, {variant}: {roles}")
            row = dict(model=spec.name, tokens=tokens, variant=variant, rank=rank, plan=rec["plan"],
                       device=rec["device"], measured=measured.utilisation.as_dict(),
                       simulated=dict(simulated.utilisation.as_dict(), latency_us=simulated.latency_us),
                       pictures=[f"{Path(stem).name}-measured.png", f"{Path(stem).name}-simulated.png"])
            rows.append(row)
            m, s = measured.utilisation, simulated.utilisation
            print(f"{tag} rank {rank} {variant:16s} {roles:24s} span {m.span_us:7.0f} us (sim {s.span_us:7.0f})  "
                  f"SM active {100 * m.sm_active:5.1f}% (sim {100 * s.sm_active:5.1f}%)  waiting "
                  f"{100 * m.waiting:5.1f}% (sim {100 * s.waiting:5.1f}%)  overlap {100 * m.overlap:5.1f}% "
                  f"(sim {100 * s.overlap:5.1f}%)")
            for line in kind_table(rec["events"]):
                print(line)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="deepseek-v3:4096,qwen3-30b-a3b:8192",
                        help="comma-separated model:tokens-per-rank")
    parser.add_argument("--variants", default="weave:serial,weave:static:20,weave")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--emulate-ep", type=int, default=None, help="one GPU: EP=1 running the per-rank work of EP=N")
    mode.add_argument("--ep", type=int, default=None, help="N GPUs: the real EP=N, one NCCL rank per GPU (default 2)")
    parser.add_argument("--model", default=None, help="one model (with --tokens), instead of --models")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank for --model")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    if args.model:
        args.models = f"{args.model}:{args.tokens}"
    if args.emulate_ep is None and args.ep is None:
        args.ep = 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from weave_moe.bench.variants import parse_variants

    variants = [v.name for v in parse_variants(args.variants)]  # "static:20,4" keeps its comma
    rows = []
    mode_tag = f"ep{args.ep}" if args.ep else f"ep1of{args.emulate_ep}"
    for item in [m for m in args.models.split(",") if m]:
        model, _, tokens = item.partition(":")
        tokens = int(tokens)
        if args.ep:
            from weave_moe.testing import run_distributed

            spec = MoESpec.from_name(model)
            results = run_distributed(record_timelines, args.ep, spec, tokens, variants, backend="nccl",
                                      timeout_s=500)
        else:
            spec = emulated_spec(MoESpec.from_name(model), args.emulate_ep)
            results = [record_timelines(0, 1, spec, tokens, variants)]
        world_size = args.ep or 1
        tag = f"{model}-{tokens}-{mode_tag}"
        meta = dict(results[0].pop("_meta"), model=model, tokens=tokens, mode=mode_tag,
                    num_experts_in_layer=spec.num_experts)
        for per_rank in results[1:]:
            per_rank.pop("_meta", None)
        path = out / f"timeline-{tag}.json"
        path.write_text(json.dumps(results))
        (out / f"{path.name}.meta.json").write_text(json.dumps(meta))
        rows += compare(spec, tokens, world_size, results, out, tag)
    summary = dict(mode=mode_tag, emulated_ep=None if args.ep else args.emulate_ep, variants=variants,
                   definition="docs/utilisation.md", rows=rows)
    (out / f"utilisation-{mode_tag}.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {out}/utilisation-{mode_tag}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
