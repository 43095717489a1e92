"""What the adaptive policy plans for decode calls, on the CPU (the Python planner, `weave_moe.plan.plan`).

    python scripts/decode_plans.py [--tokens 1,2,4,8,16,32,48,64] [--seeds 3] [--ep 2,4,8] [--emulate]

For each paper model (and Mixtral-8x7B) at each EP, each decode size, uniform and skewed routing and a few seeds,
the plan of rank 0 with the shipped profile as a layer whose serial plans run the grouped GEMMs sees it
(`with_grouped_serial`, cost_model A8). `--emulate`: the EP = 1 layer that does one rank's work of that EP (as
`--emulate-ep` benches it); otherwise every rank's routing at that EP.
Prints how many plans are serial and every one that is not, with the serial plan's predicted time beside it.
"""

from __future__ import annotations

import argparse

from weave_moe.bench.config import emulated_spec
from weave_moe.models import PAPER_MODELS, MoESpec
from weave_moe.plan.cost_model import plan, predict
from weave_moe.plan.profile import HardwareProfile
from weave_moe.plan.workload import MAX_CHUNKS, Workload
from weave_moe.routing import skewed, uniform


def _routing(kind: str, tokens: int, spec: MoESpec, seed: int):
    if kind == "uniform":
        return uniform(tokens, spec.num_experts, spec.top_k, seed=seed)[0]
    return skewed(tokens, spec.num_experts, spec.top_k, skew=4.0, seed=seed)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,2,4,8,16,32,48,64")
    parser.add_argument("--ep", default="2,4,8")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--emulate", action="store_true")
    args = parser.parse_args()
    profile = HardwareProfile.default().with_grouped_serial()
    total, not_serial = 0, []
    for name in PAPER_MODELS + ("mixtral-8x7b",):
        spec = MoESpec.from_name(name)
        for ep in (int(e) for e in args.ep.split(",")):
            try:
                layer = emulated_spec(spec, ep) if args.emulate else spec
            except ValueError:   # E not divisible by EP, or k > E / EP
                continue
            world = 1 if args.emulate else ep
            if layer.num_experts % world or layer.top_k > layer.num_experts // world:
                continue
            for tokens in (int(t) for t in args.tokens.split(",")):
                for kind in ("uniform", "skewed"):
                    for seed in range(args.seeds):
                        ids = [_routing(kind, tokens, layer, seed * world + r) for r in range(world)]
                        workload = Workload.from_routing(layer, ids, 0, chunk_counts=range(1, MAX_CHUNKS + 1))
                        chosen = plan(workload, profile, "weave")
                        total += 1
                        if not chosen.is_serial(profile.num_sms):
                            serial, _ = predict(workload, profile, profile.num_sms)
                            not_serial.append((name, ep, tokens, kind, seed, chosen, serial))
    mode = "EP = 1, one rank's work of EP" if args.emulate else "EP"
    print(f"{total} plans ({mode} {args.ep}, {args.tokens} tokens, uniform and skewed, {args.seeds} seeds): "
          f"{total - len(not_serial)} serial")
    for name, ep, tokens, kind, seed, chosen, serial in not_serial:
        print(f"  not serial: {name} EP {ep} T {tokens} {kind} seed {seed}: c={chosen.c} K={chosen.K} "
              f"n_steal={chosen.n_steal} predicted {chosen.predicted_us:.1f} us, serial {serial:.1f} us")


if __name__ == "__main__":
    main()
