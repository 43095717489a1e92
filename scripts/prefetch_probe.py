"""Does the weights' L2 prefetch (kernels/prefetch.py, KernelConfig.prefetch_mib) make the decode GEMMs faster?

    python3 scripts/prefetch_probe.py --out $OUT/prefetch_probe.json

The grouped GEMMs of one rank's work of EP=2 (E/2 local experts, the rows a uniform routing of 2T tokens puts on
them) at decode sizes, each timed with CUDA events after L2 is flushed (a 512 MiB write), in these modes:
- cold: flush, then an idle wait of --gap-us (`torch.cuda._sleep`: the time the call's tables and dispatch take
  between its counts and its first GEMM tile), then GEMM0 and GEMM1 (the call's case without prefetch);
- prefetch-<MiB>: flush, the prefetch launch with that budget, the same wait, then the GEMMs;
- prefetch-<MiB>-nowait: flush, the prefetch, the GEMMs at once (the prefetch's requests racing the GEMM's loads);
- warm: the GEMMs right after the same GEMMs (as much of the weights in L2 as one launch leaves there).
Modes are interleaved, their order rotated every round; the medians over --rounds rounds are reported with each
mode's ratio to cold. Writes one JSON (date, device, commit, command included); prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from weave_moe import routing
from weave_moe.backends.weave.kernels import gemm_configs, grouped_gemm, grouped_tiles
from weave_moe.backends.weave.kernels.prefetch import WeightPrefetch
from weave_moe.bench.metadata import collect_metadata
from weave_moe.models import MoESpec

#: SM cycles per microsecond assumed for `torch.cuda._sleep` (the H200's largest SM clock); the wait's real length
#: is measured and reported (`gap_us_measured`), and every mode waits the same
CYCLES_PER_US = 1980


def _case(spec: MoESpec, tokens: int, budgets: list[int], rounds: int, gap_cycles: int, flush: torch.Tensor,
          seed: int) -> dict:
    device = flush.device
    local = spec.num_experts // 2
    H, I = spec.hidden_size, spec.intermediate_size
    ids, _ = routing.uniform(2 * tokens, spec.num_experts, spec.top_k, seed=seed, device=device)
    valid = ids[ids >= 0].long()
    counts = torch.bincount(valid, minlength=spec.num_experts)[:local].to(torch.int32)
    rows = int(counts.sum())
    offsets = torch.zeros(local + 1, dtype=torch.int32, device=device)
    offsets[1:] = torch.cumsum(counts, 0)
    configs = [gemm_configs.default_config(g, rows, local, H, I) for g in (0, 1)]
    tiles = [grouped_tiles.build_tile_table(offsets, c.block_m, max(rows, 1), c.split_tail) for c in configs]
    generator = torch.Generator(device=device).manual_seed(seed)
    w13 = (torch.randn(local, 2 * I, H, device=device, generator=generator) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(local, H, I, device=device, generator=generator) * 0.02).to(torch.bfloat16)
    a = torch.randn(max(rows, 1), H, device=device, generator=generator).to(torch.bfloat16)
    h = torch.empty(max(rows, 1), I, dtype=torch.bfloat16, device=device)
    y = torch.empty(max(rows, 1), H, dtype=torch.bfloat16, device=device)
    prefetches = {mib: WeightPrefetch(local, H, I, mib << 20, 0) for mib in budgets}

    def gemms(events):
        events[0].record()
        grouped_gemm.grouped_gemm0(a, w13, h, tiles[0], configs[0], pdl=False)
        events[1].record()
        grouped_gemm.grouped_gemm1(h, w2, y, tiles[1], configs[1], pdl=False)
        events[2].record()

    def run(mode: str, events) -> None:
        if mode == "warm":
            gemms([torch.cuda.Event(enable_timing=True) for _ in range(3)])
            gemms(events)
            return
        flush.zero_()
        if mode.startswith("prefetch"):
            prefetches[int(mode.split("-")[1])].launch(counts, w13, w2)
        if not mode.endswith("nowait"):
            torch.cuda._sleep(gap_cycles)
        gemms(events)

    modes = ["cold", "warm"] + [f"prefetch-{mib}" for mib in budgets] + [f"prefetch-{budgets[-1]}-nowait"]
    for mode in modes:   # compile and warm up
        run(mode, [torch.cuda.Event(enable_timing=True) for _ in range(3)])
    times = {mode: ([], []) for mode in modes}
    for r in range(rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        recorded = []
        for mode in order if r % 2 == 0 else reversed(order):
            events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            run(mode, events)
            recorded.append((mode, events))
        torch.cuda.synchronize()
        for mode, events in recorded:
            times[mode][0].append(1e3 * events[0].elapsed_time(events[1]))
            times[mode][1].append(1e3 * events[1].elapsed_time(events[2]))
    active = int((counts > 0).sum())
    result = dict(model=spec.name, tokens_per_rank=tokens, local_experts=local, active_experts=active, rows=rows,
                  active_weight_mib=dict(w13=active * 2 * I * H * 2 / 2**20, w2=active * H * I * 2 / 2**20),
                  configs=[repr(c) for c in configs], modes={})
    cold = [statistics.median(times["cold"][g]) for g in (0, 1)]
    for mode in modes:
        med = [statistics.median(times[mode][g]) for g in (0, 1)]
        result["modes"][mode] = dict(gemm0_us=med[0], gemm1_us=med[1], both_us=med[0] + med[1],
                                     ratio_to_cold=(med[0] + med[1]) / (cold[0] + cold[1]),
                                     gemm0_spread_us=[min(times[mode][0]), max(times[mode][0])])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON path")
    parser.add_argument("--models", default="qwen3-30b-a3b,qwen3.5-35b-a3b,deepseek-v2-lite,deepseek-v3")
    parser.add_argument("--tokens", default="1,8,32", help="tokens per rank (comma-separated)")
    parser.add_argument("--budgets", default="16,32,48,64", help="prefetch budgets in MiB (comma-separated)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--gap-us", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(device)
    gap_cycles = int(args.gap_us * CYCLES_PER_US)
    waits = []
    for _ in range(20):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        events[0].record()
        torch.cuda._sleep(gap_cycles)
        events[1].record()
        torch.cuda.synchronize()
        waits.append(1e3 * events[0].elapsed_time(events[1]))
    flush = torch.empty(512 << 20, dtype=torch.uint8, device=device)
    budgets = sorted(int(b) for b in args.budgets.split(","))
    started, cases = time.time(), []
    for name in args.models.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            case = _case(MoESpec.from_name(name), tokens, budgets, args.rounds, gap_cycles, flush, args.seed)
            cases.append(case)
            line = "  ".join(f"{mode} {m['both_us']:.1f} ({m['ratio_to_cold']:.3f})"
                             for mode, m in case["modes"].items())
            print(f"{name:18s} T={tokens:<4d} active {case['active_experts']:3d} "
                  f"w13 {case['active_weight_mib']['w13']:.0f} MiB: {line}", flush=True)
            torch.cuda.empty_cache()
    result = dict(metadata=collect_metadata(argv=sys.argv), l2_bytes=props.L2_cache_size, gap_us=args.gap_us,
                  gap_us_measured=statistics.median(waits), rounds=args.rounds, seconds=time.time() - started,
                  cases=cases)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
