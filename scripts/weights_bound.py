"""The weights bound (bench/floor.py) for every configuration of an existing `weave-moe bench` result, on the CPU:
re-draw the routing the bench drew (same seeds), count the local experts each rank must read, and set the measured
medians beside max(floor, weights bound). For results written before the bench reported `floor_weights_ms`.

    python scripts/weights_bound.py bench/results/h200x2-eval5.json [--variants nccl,weave] [--tokens 128,512]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import statistics

import torch

from weave_moe.bench.floor import FloorConstants, layer_floor, rank_traffic
from weave_moe.bench.harness import BenchConfig, bench_routing
from weave_moe.models import MoESpec


def weights_bound_ms(spec: MoESpec, tokens: int, routing: str, world_size=2, rotate=4, seed=0, skew=3.0) -> float:
    """Mean over the bench's input sets of the slowest rank's weights bound (ms)."""
    config = BenchConfig(models=(spec,), seed=seed, rotate=rotate, skew=skew)
    values = []
    for set_index in range(rotate):
        ids, _ = bench_routing(config, spec, tokens, routing, set_index, world_size)
        per_rank = list(torch.as_tensor(ids).view(world_size, tokens, spec.top_k))
        floor = layer_floor(rank_traffic(per_rank, spec.num_experts), spec.hidden_size, spec.intermediate_size,
                            FloorConstants())
        values.append(floor.weights_floor_s)
    return statistics.fmean(values) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result")
    parser.add_argument("--variants", default="nccl,weave")
    parser.add_argument("--tokens", default=None, help="comma-separated token counts (default: all)")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    tokens = {int(t) for t in args.tokens.split(",")} if args.tokens else None
    data = json.load(open(args.result))
    by_config = collections.defaultdict(dict)
    for row in data["rows"]:
        if row.get("median_ms") and (tokens is None or row["tokens_per_rank"] in tokens):
            by_config[row["model"], row["tokens_per_rank"], row["routing"]][row["variant"]] = row
    print("| model | tokens | routing | floor ms | weights ms | " + " | ".join(f"{v} ms (x bound)" for v in variants)
          + " |")
    print("| --- | ---: | --- | ---: | ---: | " + " | ".join("---:" for _ in variants) + " |")
    ratios = collections.defaultdict(list)
    for (model, n, routing), rows in sorted(by_config.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
        spec = MoESpec.from_name(model)
        weights = weights_bound_ms(spec, n, routing)
        floor = next(iter(rows.values()))["floor_ms"]
        bound = max(floor, weights)
        cells = []
        for v in variants:
            row = rows.get(v)
            if row is None:
                cells.append("-")
                continue
            ratios[v].append(row["median_ms"] / bound)
            cells.append(f"{row['median_ms']:.3f} ({row['median_ms'] / bound:.2f}x)")
        print(f"| {model} | {n} | {routing} | {floor:.3f} | {weights:.3f} | " + " | ".join(cells) + " |")
    for v in variants:
        if ratios[v]:
            print(f"{v}: geomean median / max(floor, weights) = "
                  f"{math.exp(statistics.fmean(math.log(r) for r in ratios[v])):.2f} over {len(ratios[v])} configurations")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
