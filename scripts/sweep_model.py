"""Cost model against a measured (c, K) sweep: for every configuration of a `weave-moe bench` result (the sweep of
scripts/device_run.sh), rebuild the routing the bench drew (same seeds), predict every measured variant with a
HardwareProfile, and report the measured gap of the planner's choice. CPU only.

    python scripts/sweep_model.py bench/results/ck-sweep-h200x2.json [--profile PATH]

With --fit, first refit the two fields that move with the kernel and the host path, gemm_tile_efficiency and
call_overhead_us, to this sweep (grid over the efficiency; for each, the overhead is the median of measured minus
predicted serial; keep the pair with the smallest mean prediction error over every measured variant), report with the
refitted profile, and write it with --write PATH.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import statistics
import time

import torch

from weave_moe.bench.harness import BenchConfig, bench_routing
from weave_moe.models import MoESpec
from weave_moe.plan import HardwareProfile, Workload, plan, predict


def workloads(spec: MoESpec, tokens: int, routing: str, world_size=2, rotate=4, seed=0, skew=3.0):
    config = BenchConfig(models=(spec,), seed=seed, rotate=rotate, skew=skew)
    out = []
    for set_index in range(rotate):
        ids, _ = bench_routing(config, spec, tokens, routing, set_index, world_size)
        per_rank = list(torch.as_tensor(ids).view(world_size, tokens, spec.top_k))
        out.append([Workload.from_routing(spec, per_rank, r) for r in range(world_size)])
    return out


def predicted_ms(wls, profile, variant: str) -> float:
    """Mean over input sets of the slowest rank's prediction for a variant (ms)."""
    values = []
    for per_rank in wls:
        if variant == "weave:serial":
            lat = [predict(w, profile, profile.num_sms)[0] for w in per_rank]
        elif variant.startswith("weave:static:"):
            c, _, k = variant.split(":")[2].partition(",")
            lat = [plan(w, profile, f"static:{c},{k or 1}").predicted_us for w in per_rank]
        else:
            lat = [plan(w, profile, variant.partition(":")[2] or "weave").predicted_us for w in per_rank]
        values.append(max(lat))
    return statistics.fmean(values) * 1e-3


def fit(by_config, profile):
    """(profile with refitted gemm_tile_efficiency and call_overhead_us, mean error, rows used)."""
    cases = []
    for (model, tokens, routing), variants in by_config.items():
        wls = workloads(MoESpec.from_name(model), tokens, routing)
        cases.append((wls, {v: r["median_ms"] for v, r in variants.items() if v != "weave"}))
    best = None
    for step in range(45, 101):
        trial = dataclasses.replace(profile, gemm_tile_efficiency=step / 100, call_overhead_us=0.0)
        preds = [(measured, {v: predicted_ms(wls, trial, v) for v in measured}) for wls, measured in cases]
        overhead = statistics.median(m["weave:serial"] - p["weave:serial"] for m, p in preds if "weave:serial" in m)
        if overhead < 0:  # the kernel alone is predicted slower than measured: efficiency too low
            continue
        error = statistics.fmean(abs(p[v] + overhead - m[v]) / m[v] for m, p in preds for v in m)
        if best is None or error < best[1]:
            best = (dataclasses.replace(trial, call_overhead_us=round(overhead * 1e3, 1)), error)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("result")
    parser.add_argument("--profile", default=None)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--fit", action="store_true", help="refit gemm_tile_efficiency and call_overhead_us first")
    parser.add_argument("--write", default=None, help="with --fit: write the refitted profile here (JSON)")
    args = parser.parse_args(argv)
    profile = HardwareProfile.load(args.profile) if args.profile else HardwareProfile.default()
    data = json.load(open(args.result))
    by_config = collections.defaultdict(dict)
    for row in data["rows"]:
        if row.get("median_ms") and row["backend"] == "weave":
            by_config[row["model"], row["tokens_per_rank"], row["routing"]][row["variant"]] = row
    if args.fit:
        before = (profile.gemm_tile_efficiency, profile.call_overhead_us)
        profile, error = fit(by_config, profile)
        print(f"fit: gemm_tile_efficiency {before[0]:.3f} -> {profile.gemm_tile_efficiency:.3f}, call_overhead_us "
              f"{before[1]:.0f} -> {profile.call_overhead_us:.0f} (mean prediction error {100 * error:.1f}%, in sample)")
        if args.write:
            with open(args.write, "w") as handle:
                json.dump(dataclasses.asdict(profile), handle, indent=2)
    gaps, errors, plan_us = [], [], []
    for (model, tokens, routing), variants in by_config.items():
        spec = MoESpec.from_name(model)
        wls = workloads(spec, tokens, routing)
        measured = {v: r["median_ms"] for v, r in variants.items()}
        pred = {v: predicted_ms(wls, profile, v) for v in measured if v != "weave"}
        for v in pred:
            errors.append(abs(pred[v] - measured[v]) / measured[v])
        # the planner's choice for this configuration (first input set, rank with the slowest prediction)
        start = time.perf_counter()
        choices = [plan(w, profile, "weave") for w in wls[0]]
        plan_us.append((time.perf_counter() - start) * 1e6 / len(choices))
        choice = choices[0]
        name = "weave:serial" if choice.c >= profile.num_sms else f"weave:static:{choice.c},{choice.K}"
        best_v = min((v for v in measured if v != "weave"), key=measured.get)
        chosen_ms = measured.get(name)
        gap = (chosen_ms / measured[best_v] - 1) if chosen_ms else float("nan")
        gaps.append(gap)
        weave_gap = measured["weave"] / measured[best_v] - 1 if "weave" in measured else float("nan")
        print(f"{model:18s} {tokens:5d} {routing:8s} best {best_v:20s} {measured[best_v]:6.2f} ms | planner "
              f"({choice.c:3d},{choice.K}) -> {name:20s} {chosen_ms or float('nan'):6.2f} ms gap {100 * gap:5.1f}% | "
              f"weave measured {measured.get('weave', float('nan')):6.2f} ms ({100 * weave_gap:5.1f}%)")
        if args.verbose:
            for v in sorted(pred, key=measured.get)[:6]:
                print(f"      {v:22s} measured {measured[v]:6.2f} predicted {pred[v]:6.2f}")
    finite = [g for g in gaps if g == g]
    print(f"profile {profile.name}: planner-choice gap mean {100 * statistics.fmean(finite):.1f}% "
          f"(max {100 * max(finite):.1f}%, {len(finite)}/{len(gaps)} choices in the sweep grid); "
          f"prediction error mean {100 * statistics.fmean(errors):.1f}%; planning {statistics.fmean(plan_us):.0f} us/plan")


if __name__ == "__main__":
    main()
