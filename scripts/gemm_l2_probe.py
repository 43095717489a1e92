"""Where a grouped GEMM loses against a dense one (issue 14; docs/perf-notes.md entries 24 and 30): the weights'
locality, the tile order or the grouping itself.

    PYTHONPATH=src python3 scripts/gemm_l2_probe.py --out $OUT/gemm_l2_probe.json     # DeepSeek-V3, 8192 tokens

One rank's work of EP=2 (scripts/gemm_bench.py's `make_work`: E/2 local experts, ~T * k rows, uniform routing), each
GEMM (GEMM0 + SiLU-mul, GEMM1) with the config the layer picks for the shape (`gemm_configs.default_config`: the
device's tuned table, else the analytical one), launched plainly as the layer launches it. Variants, all on the same
rows:

  layer        the tile table as built: each M tile multiplies its expert's weights
  one-weight   the same tile table, every tile's expert set to 0: the same tiles, padding, order and epilogues, but
               the weights' traffic of a dense GEMM (one expert's weights, reused from L2). layer / one-weight is
               what the experts' distinct weights cost
  group_m=G    the layer's tiles with GROUP_M = G (M tiles that sweep the N tiles together; 8 by default)
  experts=N    the same number of rows split equally over N experts (the first N of the layer's weights):
               N = 1 is a dense GEMM on one expert's weights, N = E/2 a perfectly balanced layer

Timing: each variant captured once in a CUDA graph of one launch; then --rounds rounds replay every graph once, the
order rotated by one each round (no variant always first, or always right after a given other), each replay timed
by CUDA events; median per variant. TFLOP/s count useful FLOPs (padding not counted).
Check: each variant's output against an fp32 reference of the same bf16 inputs on a sample of experts (one-weight
against expert 0's weights), ||out - ref|| / ||ref|| <= 1e-2, outputs poisoned with NaN first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from weave_moe.backends.weave.kernels import gemm_configs as gc
from weave_moe.backends.weave.kernels import grouped_gemm as gg
from weave_moe.bench.anchor import captured_graph
from weave_moe.models import MoESpec

TOLERANCE = 1e-2   # bf16 operands, fp32 accumulation, one bf16 rounding of the output (as scripts/gemm_bench.py)


def one_weight(tiles: gg.TileTable) -> gg.TileTable:
    """`tiles` with every tile's expert (row 0 of the table) set to 0."""
    table = tiles.table.clone()
    table[0].zero_()
    return dataclasses.replace(tiles, table=table)


def equal_offsets(rows: int, experts: int, device) -> torch.Tensor:
    """Prefix sums of `rows` rows split over `experts` experts as equally as possible (int32 [experts + 1])."""
    counts = torch.full((experts,), rows // experts, dtype=torch.int64)
    counts[:rows % experts] += 1
    offsets = torch.zeros(experts + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(counts, 0)
    return offsets.to(device)


def reference(gemm: int, a: torch.Tensor, weights: torch.Tensor, offsets: list[int], experts: list[int],
              expert_of=lambda e: e) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows checked, fp32 reference of those rows) for experts `experts` (their weights: `expert_of(e)`); GEMM0:
    silu(gate) * up of the interleaved w13's gate / up rows, GEMM1: a @ w2^T."""
    rows, outs = [], []
    for e in experts:
        first, end = offsets[e], offsets[e + 1]
        if first == end:
            continue
        product = a[first:end].float() @ weights[expert_of(e)].float().T
        if gemm == 0:   # interleaved w13: gate j at column 2j, up j at 2j + 1
            product = F.silu(product[:, 0::2]) * product[:, 1::2]
        rows.append(torch.arange(first, end, device=a.device))
        outs.append(product)
    return torch.cat(rows), torch.cat(outs)


def run_variant(gemm: int, a, weights, out, tiles, config) -> None:
    if gemm == 0:
        gg.grouped_gemm0(a, weights, out, tiles, config, pdl=False)
    else:
        gg.grouped_gemm1(a, weights, out, tiles, config, pdl=False)


def time_rotated(graphs: dict, rounds: int) -> dict:
    """Median ms per graph over `rounds` rounds, each replaying every graph once, the order rotated each round."""
    names = list(graphs)
    events = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[name].replay()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) for s, e in pairs) for name, pairs in events.items()}


def probe(spec: MoESpec, tokens: int, gemm: int, group_ms: list[int], expert_counts: list[int], rounds: int,
          log) -> dict:
    from gemm_bench import make_work

    torch.manual_seed(tokens + gemm)
    num_local = spec.num_experts // 2
    hidden, inter = spec.hidden_size, spec.intermediate_size
    counts = make_work(spec, tokens, "uniform", seed=tokens)
    rows = int(counts.sum())
    alloc = (rows + 127) // 128 * 128
    k_dim, n_out = (hidden, inter) if gemm == 0 else (inter, hidden)
    a = torch.randn(alloc, k_dim, device="cuda").bfloat16()
    if gemm == 0:
        weights = gg.interleave_w13((torch.randn(num_local, 2 * inter, hidden, device="cuda") / hidden ** 0.5)
                                    .bfloat16())
    else:
        weights = (torch.randn(num_local, hidden, inter, device="cuda") / inter ** 0.5).bfloat16()
    out = torch.empty(alloc, n_out, device="cuda", dtype=torch.bfloat16)
    config = gc.default_config(gemm, rows, num_local, hidden, inter)
    flops = 2.0 * rows * k_dim * (2 * inter if gemm == 0 else hidden)
    layer_offsets = torch.zeros(num_local + 1, dtype=torch.int32, device="cuda")
    layer_offsets[1:] = torch.cumsum(counts, 0)
    layer_tiles = gg.build_tile_table(layer_offsets, config.block_m, alloc, config.split_tail)
    # name -> (tiles, config, offsets, expert_of): what each variant runs and the weights its rows must have used
    variants = {"layer": (layer_tiles, config, layer_offsets, lambda e: e),
                "one-weight": (one_weight(layer_tiles), config, layer_offsets, lambda e: 0)}
    for group_m in group_ms:
        if group_m != config.group_m:
            variants[f"group_m={group_m}"] = (layer_tiles, config.with_(group_m=group_m), layer_offsets, lambda e: e)
    for experts in expert_counts:
        if 1 <= experts <= num_local:
            offsets = equal_offsets(rows, experts, "cuda")
            variants[f"experts={experts}"] = (gg.build_tile_table(offsets, config.block_m, alloc, config.split_tail),
                                              config, offsets, lambda e: e)
    result = dict(model=spec.name, tokens=tokens, gemm=gemm, rows=rows, local_experts=num_local, hidden=hidden,
                  intermediate=inter, config=dataclasses.asdict(config), gflop=flops / 1e9, variants={})
    graphs = {}
    torch.backends.cuda.matmul.allow_tf32 = True   # the fp32 reference: ~3e-4, far under TOLERANCE
    for name, (tiles, cfg, offsets, expert_of) in variants.items():
        offsets_host = offsets.tolist()
        n = len(offsets_host) - 1
        sample = sorted(set(torch.linspace(0, n - 1, min(8, n)).round().long().tolist()))
        out.fill_(float("nan"))
        run_variant(gemm, a, weights, out, tiles, cfg)
        checked, ref = reference(gemm, a, weights, offsets_host, sample, expert_of)
        got = out[checked].float()
        error = float("nan") if torch.isnan(got).any() else ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        result["variants"][name] = dict(rel_error=error, passed=error <= TOLERANCE,
                                        config=dataclasses.asdict(cfg), experts=n)
        graphs[name] = captured_graph(lambda tiles=tiles, cfg=cfg: run_variant(gemm, a, weights, out, tiles, cfg))[0]
    torch.backends.cuda.matmul.allow_tf32 = False
    for name, ms in time_rotated(graphs, rounds).items():
        entry = result["variants"][name]
        entry.update(ms=ms, tflops=flops / ms / 1e9)
        log(f"  {spec.name} T={tokens} GEMM{gemm} {name:>14}: {ms:8.3f} ms {entry['tflops']:6.1f} TFLOP/s "
            f"err {entry['rel_error']:.1e}{'' if entry['passed'] else '  FAILED'}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="deepseek-v3", help="comma-separated registered models")
    parser.add_argument("--tokens", default="8192", help="comma-separated tokens per rank")
    parser.add_argument("--gemms", default="0,1", help="which GEMMs: 0, 1 or both")
    parser.add_argument("--group-m", default="4,16,32", help="GROUP_M values besides the config's")
    parser.add_argument("--experts", default="1,8,32", help="equal-split expert counts (E/2 is added)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default="gemm_l2_probe.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gemm_l2_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # gemm_bench's make_work
    ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    commit = os.environ.get("WEAVE_MOE_GIT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    record = dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), device=torch.cuda.get_device_name(), commit=commit,
                  command=" ".join(sys.argv), torch=torch.__version__, results=[])
    failed = 0
    for model in args.models.split(","):
        spec = MoESpec.from_name(model)
        for tokens in ints(args.tokens):
            for gemm in ints(args.gemms):
                result = probe(spec, tokens, gemm, ints(args.group_m), ints(args.experts) + [spec.num_experts // 2],
                               args.rounds, print)
                failed += sum(not v["passed"] for v in result["variants"].values())
                record["results"].append(result)
                with open(args.out, "w") as handle:   # after every shape: a timeout keeps what ran
                    json.dump(record, handle, indent=1)
    print(f"gemm_l2_probe: {failed} failed checks; {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
