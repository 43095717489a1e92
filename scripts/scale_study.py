"""Reproduce docs/scale-study.md: cost-model accuracy, policy ablation and the EP scale study, all in simulation.

    python scripts/scale_study.py                 # everything (~5-10 min on 2 CPU cores), writes docs/scale-study.png
    python scripts/scale_study.py --quick         # a smaller grid, for a smoke test (~1 min)
    python scripts/scale_study.py --part scale    # one part: accuracy | scale | timing
    python scripts/scale_study.py --profile h200_measured   # another shipped profile: docs/scale-study-<name>.png

Prints markdown tables (pasted into docs/scale-study.md) and writes the raw rows as JSON (--json).
Routing: `weave_moe.routing.uniform` / `skewed` (skew = busiest-expert / mean count), rank r of layer L drawn with
seed 1000 * L + r. Hardware: `--profile NAME`, a profile shipped in weave_moe/plan/profiles/ (`load_named(NAME)`),
used by the planner and the simulator alike. The default is the uncalibrated profile "h200_default"
(figures of docs/platform.md), with which the study in docs/scale-study.md was made; "h200_measured" is the calibrated
`HardwareProfile.default()`, whose section of the doc was made with `--profile h200_measured`.

A profile's call_overhead_us (host work per call that the GPU waits for) is in every prediction but not in the
simulator, which runs the kernel only: the prediction error is computed on the prediction minus call_overhead_us.
A profile's max_comm_sms caps the planner's split candidates; the exhaustive search of the accuracy part then uses the
c grid values within the cap, and the best over the whole grid is reported beside it (what the cap costs in the
simulator).
"""

from __future__ import annotations

import argparse
import json
import time
import multiprocessing
from functools import lru_cache
from pathlib import Path

import numpy as np

from weave_moe.commands.plan import layer_workloads
from weave_moe.models import PAPER_MODELS, MoESpec
from weave_moe.plan import MAX_CHUNKS, STATIC_BASELINE_C, HardwareProfile, Plan, Workload, plan, predict
from weave_moe.sim import simulate

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROFILE = "h200_default"  # the uncalibrated profile the study in docs/scale-study.md was made with
SKEW = 3.0  # busiest expert at 3x the mean: mid-range of published measurements (up to ~7x)
C_GRID = (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 64, 96, 131)
ABLATION = ("serial", "spatial", f"static:{STATIC_BASELINE_C}", "per_iteration", "weave")


def _pool(processes: int):
    # spawn, not fork: forking after torch (routing draws) has started its thread pools can hang the children
    return multiprocessing.get_context("spawn").Pool(processes)


@lru_cache(maxsize=None)
def _profile(name: str) -> HardwareProfile:
    """One profile object per process and name (the planner caches its tables on the object). The workers are
    spawned, so they get the name through their task arguments, not a module global."""
    return HardwareProfile.load_named(name)


# ---- accuracy + ablation -------------------------------------------------------------------------------------------
def _accuracy_case(args):
    model, tokens, skew, ep, c_grid, profile_name = args
    profile = _profile(profile_name)
    spec = MoESpec.from_name(model)
    workloads = layer_workloads(spec, tokens, ep, skew=skew, layer=0, chunk_counts=range(1, MAX_CHUNKS + 1))
    # uniform: ranks are alike, take rank 0; skewed: the busiest rank (most GEMM rows) sets the layer's latency
    wl = workloads[0] if skew is None else max(workloads, key=lambda w: w.num_pairs)
    chosen = plan(wl, profile, "weave")
    chosen_us = simulate(wl, profile, chosen).latency_us
    # best: over the grid values the planner may choose (c <= max_comm_sms) and the planner's own choice;
    # best_all: over the whole grid (differs only when the profile caps c)
    best_us, best = chosen_us, (chosen.c, chosen.K)
    best_all_us, best_all = chosen_us, (chosen.c, chosen.K)
    for c in c_grid:
        for k in range(1, MAX_CHUNKS + 1):
            predicted, steal = predict(wl, profile, c, k)
            us = simulate(wl, profile, Plan(c, k, steal, predicted, "weave")).latency_us
            if us < best_all_us:
                best_all_us, best_all = us, (c, k)
            if c <= profile.comm_sms_limit and us < best_us:
                best_us, best = us, (c, k)
    policies = {}
    for policy in ABLATION:
        p = plan(wl, profile, policy)
        r = simulate(wl, profile, p)
        policies[policy] = {"c": p.c, "K": p.K, "n_steal": p.n_steal, "predicted_us": p.predicted_us,
                            "sim_us": r.latency_us, "sm_active": r.sm_active, "overlap": r.overlap}
    return {
        "model": model, "tokens": tokens, "routing": "uniform" if skew is None else f"skewed{skew:g}", "ep": ep,
        "rank": wl.rank, "chosen": [chosen.c, chosen.K, chosen.n_steal], "chosen_sim_us": chosen_us,
        "chosen_predicted_us": chosen.predicted_us, "call_overhead_us": profile.call_overhead_us,
        "best": list(best), "best_sim_us": best_us, "gap": chosen_us / best_us - 1.0,
        "best_all": list(best_all), "best_all_sim_us": best_all_us, "policies": policies,
    }


def run_accuracy(quick: bool, processes: int, profile_name: str) -> list[dict]:
    models = PAPER_MODELS[:2] if quick else PAPER_MODELS
    tokens = (2048,) if quick else (2048, 4096, 8192)
    grid = C_GRID[::3] if quick else C_GRID
    cases = [(m, t, s, ep, grid, profile_name) for m in models for t in tokens for s in (None, SKEW) for ep in (2, 4)]
    with _pool(processes) as pool:
        return pool.map(_accuracy_case, cases, chunksize=1)


def report_accuracy(rows: list[dict], profile: HardwareProfile) -> None:
    gaps = np.array([r["gap"] for r in rows])
    # the simulator runs the kernel only: compare it with the prediction less the host call overhead (0 if unfitted)
    model_err = np.array([(r["chosen_predicted_us"] - r["call_overhead_us"]) / r["chosen_sim_us"] - 1 for r in rows])
    capped = profile.comm_sms_limit < profile.num_sms - 1
    grid = [c for c in C_GRID if c <= profile.comm_sms_limit]
    print(f"\n### Cost-model accuracy ({len(rows)} configurations, c grid {len(grid)} values x K 1..{MAX_CHUNKS})\n")
    print(f"- planner's (c, K) vs exhaustive best in the simulator: mean gap {100 * gaps.mean():.2f}%, "
          f"median {100 * np.median(gaps):.2f}%, max {100 * gaps.max():.2f}%, exact hit {int((gaps < 1e-9).sum())}"
          f"/{len(rows)}")
    overhead = (f" (prediction minus call_overhead_us = {profile.call_overhead_us:g} us, which the simulator does "
                f"not model)" if profile.call_overhead_us else "")
    print(f"- predicted vs simulated latency at the chosen plan{overhead}: mean |error| "
          f"{100 * np.abs(model_err).mean():.2f}%, max {100 * np.abs(model_err).max():.2f}%")
    if capped:
        limit = profile.comm_sms_limit
        beyond = np.array([r["best_all_sim_us"] < r["best_sim_us"] for r in rows])
        gaps_all = np.array([r["chosen_sim_us"] / r["best_all_sim_us"] - 1 for r in rows])
        cost = np.array([r["best_sim_us"] / r["best_all_sim_us"] - 1 for r in rows])
        print(f"- the cap c <= {limit} (max_comm_sms) in the simulator: a grid value c > {limit} beats the best "
              f"within the cap on {int(beyond.sum())}/{len(rows)} (by at most {100 * cost.max():.2f}%); planner vs "
              f"the best of the whole grid (c up to {max(C_GRID)}): mean gap {100 * gaps_all.mean():.2f}%, "
              f"max {100 * gaps_all.max():.2f}%")
    serial_gap = np.array([r["chosen_sim_us"] / r["policies"]["serial"]["sim_us"] - 1 for r in rows])
    print(f"- the serial schedule (not in the grid) simulated faster than the planner's choice on "
          f"{int((serial_gap > 1e-9).sum())}/{len(rows)}, by at most {100 * max(serial_gap.max(), 0.0):.2f}%\n")
    print("| model | tokens | routing | EP | planner (c, K, n_steal) | sim us | best (c, K) | best us | gap |"
          + (" best of whole grid (c, K) | its us |" if capped else ""))
    print("| --- | ---: | --- | ---: | --- | ---: | --- | ---: | ---: |" + (" --- | ---: |" if capped else ""))
    for r in rows:
        print(f"| {r['model']} | {r['tokens']} | {r['routing']} | {r['ep']} | {tuple(r['chosen'])} | "
              f"{r['chosen_sim_us']:.0f} | {tuple(r['best'])} | {r['best_sim_us']:.0f} | {100 * r['gap']:.2f}% |"
              + (f" {tuple(r['best_all'])} | {r['best_all_sim_us']:.0f} |" if capped else ""))

    print("\n### Ablation (simulated latency of each policy's plan)\n")
    sim = {p: np.array([r["policies"][p]["sim_us"] for r in rows]) for p in ABLATION}
    spatial_gain = 1 - sim["spatial"] / sim["serial"]
    temporal_gain = 1 - sim["weave"] / sim["spatial"]
    total_gain = 1 - sim["weave"] / sim["serial"]
    print(f"- spatial vs serial: mean {100 * spatial_gain.mean():+.1f}% "
          f"(spatial faster on {int((spatial_gain > 0).sum())}/{len(rows)})")
    print(f"- weave vs spatial: mean {100 * temporal_gain.mean():+.1f}% "
          f"(weave faster on {int((temporal_gain > 0).sum())}/{len(rows)})")
    print(f"- weave vs serial: mean {100 * total_gain.mean():+.1f}% (weave <= serial on "
          f"{int((sim['weave'] <= sim['serial'] + 1e-9).sum())}/{len(rows)})")
    static = 1 - sim["weave"] / sim[f"static:{STATIC_BASELINE_C}"]
    per_iter = 1 - sim["weave"] / sim["per_iteration"]
    print(f"- weave vs static c={STATIC_BASELINE_C}: mean {100 * static.mean():+.1f}%; "
          f"weave vs per_iteration: mean {100 * per_iter.mean():+.1f}%\n")
    print("| model | tokens | routing | EP | serial | spatial | static:20 | per_iteration | weave | weave SM active | "
          "weave overlap |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        pol = r["policies"]
        print(f"| {r['model']} | {r['tokens']} | {r['routing']} | {r['ep']} | "
              + " | ".join(f"{pol[p]['sim_us']:.0f}" for p in ABLATION)
              + f" | {100 * pol['weave']['sm_active']:.0f}% | {100 * pol['weave']['overlap']:.0f}% |")


# ---- scale study ----------------------------------------------------------------------------------------------------
def _scale_case(args):
    model, ep, tokens, layer, profile_name = args
    profile = _profile(profile_name)
    spec = MoESpec.from_name(model)
    workloads = layer_workloads(spec, tokens, ep, skew=SKEW, layer=layer)
    out = {"model": model, "ep": ep, "layer": layer, "c": [], "K": [], "n_steal": [], "weave_us": [], "static_us": [],
           "pairs": []}
    for wl in workloads:
        p = plan(wl, profile, "weave")
        static = plan(wl, profile, f"static:{STATIC_BASELINE_C}")
        out["c"].append(p.c)
        out["K"].append(p.K)
        out["n_steal"].append(p.n_steal)
        out["pairs"].append(wl.num_pairs)
        out["weave_us"].append(simulate(wl, profile, p).latency_us)
        out["static_us"].append(simulate(wl, profile, static).latency_us)
    return out


def run_scale(quick: bool, processes: int, tokens: int, layers: int, profile_name: str) -> list[dict]:
    eps = (2, 4, 8) if quick else (2, 4, 8, 16, 32, 64)
    cases = [(m, ep, tokens, layer, profile_name) for m in ("deepseek-v3", "qwen3-30b-a3b") for ep in eps for layer in range(layers)]
    cases.sort(key=lambda c: -c[1])  # big EP first: better packing over the pool
    with _pool(processes) as pool:
        rows = pool.map(_scale_case, cases, chunksize=1)
    return sorted(rows, key=lambda r: (r["model"], r["ep"], r["layer"]))


def report_scale(rows: list[dict], tokens: int, figure: Path | None, profile: HardwareProfile) -> None:
    print(f"\n### Scale study ({tokens} tokens per rank, skewed x{SKEW:g} routing, every rank simulated)\n")
    print("| model | EP | layer | c* min / median / max | K* values | busiest / mean pairs | mean rank gain vs "
          "c=20 | layer gain vs c=20 (slowest rank) |")
    print("| --- | ---: | ---: | --- | --- | ---: | ---: | ---: |")
    summary = {}
    for r in rows:
        c = np.array(r["c"])
        weave, static = np.array(r["weave_us"]), np.array(r["static_us"])
        rank_gain = 1 - weave / static
        layer_gain = 1 - weave.max() / static.max()
        pairs = np.array(r["pairs"])
        ks = sorted(set(r["K"]))
        summary.setdefault(r["model"], []).append((r["ep"], c, rank_gain, layer_gain))
        print(f"| {r['model']} | {r['ep']} | {r['layer']} | {c.min()} / {int(np.median(c))} / {c.max()} | {ks} | "
              f"{pairs.max() / max(pairs.mean(), 1):.2f} | {100 * rank_gain.mean():+.1f}% | {100 * layer_gain:+.1f}% |")
    if figure is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_c, ax_gain) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=120)
    for index, (offset, (model, entries)) in enumerate(zip((-0.06, 0.06), sorted(summary.items()))):
        color = f"C{index}"
        eps = sorted({e for e, *_ in entries})
        xs = np.log2(eps)
        c_all = [np.concatenate([c for e, c, *_ in entries if e == ep]) for ep in eps]
        lo = [np.min(c) for c in c_all]
        hi = [np.max(c) for c in c_all]
        mid = [np.median(c) for c in c_all]
        ax_c.errorbar(xs + offset, mid, yerr=[np.subtract(mid, lo), np.subtract(hi, mid)], fmt="o-", capsize=4,
                      color=color, label=f"{model} (median, min-max over ranks)")
        gains = [np.mean([g for e, _, _, g in entries if e == ep]) for ep in eps]
        rank_gains = [np.mean(np.concatenate([rg for e, _, rg, _ in entries if e == ep])) for ep in eps]
        ax_gain.plot(xs, 100 * np.array(gains), "o-", color=color, label=f"{model}: layer (slowest rank)")
        ax_gain.plot(xs, 100 * np.array(rank_gains), "s--", color=color, alpha=0.5, label=f"{model}: mean over ranks")
    if profile.comm_sms_limit < profile.num_sms - 1:
        ax_c.axhline(profile.comm_sms_limit, color="grey", linestyle=":", linewidth=1,
                     label=f"max_comm_sms = {profile.comm_sms_limit} (split candidates c <= it)")
    for ax in (ax_c, ax_gain):
        ax.set_xticks(np.log2([2, 4, 8, 16, 32, 64]), ["2", "4", "8", "16", "32", "64"])
        ax.set_xlabel("EP")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_c.set_ylabel(f"c* (comm SMs of {profile.num_sms}; {profile.num_sms} = serial schedule)")
    ax_c.set_title("weave's c* across ranks")
    ax_gain.set_ylabel("latency gain over static c=20, K=1 (%)")
    ax_gain.set_title("simulated gain of weave over static c=20")
    fig.suptitle(f"Scale study (simulation, profile {profile.name}): {tokens} tokens/rank, skewed x{SKEW:g} routing")
    fig.tight_layout()
    fig.savefig(figure)
    plt.close(fig)
    print(f"\nfigure: {figure.relative_to(ROOT) if figure.is_relative_to(ROOT) else figure}")


# ---- planning time --------------------------------------------------------------------------------------------------
def run_timing(profile: HardwareProfile) -> None:
    spec = MoESpec.from_name("deepseek-v3")
    workloads = layer_workloads(spec, 8192, 4, skew=SKEW)
    counts = [(w.send_rows.copy(), w.recv_rows.copy(), w.expert_rows.copy(), w.num_tokens) for w in workloads]
    for w in workloads:  # warm the profile's tables (once per process)
        plan(w, profile)

    def fresh():
        for rank, (send, recv, experts, tokens) in enumerate(counts):
            plan(Workload.from_counts(spec, 4, rank, send, recv, experts, num_tokens=tokens), profile)

    def search_only():
        for w in workloads:
            plan(w, profile)

    candidates = profile.comm_sms_limit * MAX_CHUNKS
    print(f"\n### Planning time (deepseek-v3, EP=4, 8192 tokens/rank; {candidates} (c, K) candidates)\n")
    for name, fn in (("from_counts + plan (a new layer)", fresh), ("plan on a built workload (search)", search_only)):
        samples = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(50):
                fn()
            samples.append((time.perf_counter() - start) / (50 * len(counts)) * 1e6)
        print(f"- {name}: median {np.median(samples):.1f} us, best {min(samples):.1f} us per rank-layer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "accuracy", "scale", "timing"), default="all")
    parser.add_argument("--quick", action="store_true", help="small grids (smoke test)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank in the scale study")
    parser.add_argument("--layers", type=int, default=2, help="layers per EP size in the scale study")
    parser.add_argument("--profile", default=DEFAULT_PROFILE,
                        help=f"shipped profile name for HardwareProfile.load_named (default {DEFAULT_PROFILE}, the "
                             "uncalibrated profile of the study in docs/scale-study.md; h200_measured: the calibrated "
                             "default)")
    parser.add_argument("--figure", type=Path, default=None,
                        help="scale-study figure (default docs/scale-study.png for the default profile, "
                             "docs/scale-study-<profile>.png for any other)")
    parser.add_argument("--json", type=Path, default=None, help="write raw rows here")
    args = parser.parse_args()
    try:
        profile = _profile(args.profile)
    except ValueError as error:
        parser.error(str(error))
    if args.figure is None:
        suffix = "" if args.profile == DEFAULT_PROFILE else f"-{args.profile}"
        args.figure = ROOT / "docs" / f"scale-study{suffix}.png"
    print(f"profile: {args.profile} = {profile.name} ({profile.source})")
    print(f"call_overhead_us {profile.call_overhead_us:g} (not simulated), split candidates c <= "
          f"{profile.comm_sms_limit}, gemm_tile_efficiency {profile.gemm_tile_efficiency:g}")
    raw = {"profile": args.profile}
    if args.part in ("all", "timing"):
        run_timing(profile)
    if args.part in ("all", "accuracy"):
        raw["accuracy"] = run_accuracy(args.quick, args.processes, args.profile)
        report_accuracy(raw["accuracy"], profile)
    if args.part in ("all", "scale"):
        raw["scale"] = run_scale(args.quick, args.processes, args.tokens, args.layers, args.profile)
        report_scale(raw["scale"], args.tokens, args.figure, profile)
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
