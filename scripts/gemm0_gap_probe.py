"""One-off probe: why does a layer call's grouped GEMM0 run longer than the same GEMM0 timed alone (weave-moe tune)?

python scripts/gemm0_gap_probe.py --model deepseek-v2 --tokens 2048 --out gap.json   (one GPU, per-rank EP=2 work)

Builds the weave:serial layer of one rank's work at EP=2, runs calls, then times the layer's GEMM0 config (CUDA-graph
replays, median) on: the layer's own buffers, weights and the offsets of its routing (checked bitwise against the h
the call wrote); fresh buffers; the layer's weights with fresh activations and the reverse; the gather + GEMM0 pair as
the call runs it; and tune's own work (`_Work`, its counts). Prints one JSON line per variant.
"""

import argparse
import json
import statistics

import torch

from weave_moe.testing import make_experts, run_distributed


def worker(rank, world_size, model, tokens, reps):
    from weave_moe import routing
    from weave_moe.backends.weave.kernels import grouped_gemm as gg
    from weave_moe.bench.anchor import graph_replay_ms
    from weave_moe.bench.config import emulated_spec
    from weave_moe.commands.tune import _Work
    from weave_moe.layer import ExpertParallelMoE
    from weave_moe.models import MoESpec

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    spec = emulated_spec(MoESpec.from_name(model), 2)
    E, H, I, k = spec.num_experts, spec.hidden_size, spec.intermediate_size, spec.top_k
    w13, w2 = make_experts(spec, E, seed=1, device=device)
    ids, w = routing.uniform(tokens, E, k, seed=rank)
    ids, w = ids.to(device), w.to(device)
    x = torch.randn(tokens, H, device=device).to(torch.bfloat16)
    layer = ExpertParallelMoE(spec, backend="weave", policy="serial", device=device, max_tokens_per_rank=tokens,
                              check_expert_ids=False)
    layer.load_experts(w13, w2)
    for _ in range(3):
        layer(x, ids, w)
    torch.cuda.synchronize()
    out = []

    def timed(fn, runs=20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ms = []
        for _ in range(runs):
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            ms.append(start.elapsed_time(end))
        return statistics.median(ms)

    out.append(dict(variant="layer call (events)", ms=timed(lambda: layer(x, ids, w))))
    be = layer.backend
    ws = be.workspace
    rows = tokens * k
    config0, config1 = be._grouped_configs(rows)
    counts = torch.bincount(ids.long().flatten(), minlength=E)
    offsets = torch.zeros(E + 1, dtype=torch.int32, device=device)
    offsets[1:] = torch.cumsum(counts, 0)
    call_h = ws.h()[:rows].clone()
    max_rows = ws.h().shape[0]
    table = gg.build_tile_table(offsets, config0.block_m, max_rows, config0.split_tail)
    small = gg.build_tile_table(offsets, config0.block_m, (rows + 127) // 128 * 128, config0.split_tail)
    a_layer, h_layer = ws.y(), ws.h()
    gen = torch.Generator(device=device).manual_seed(5)
    a_fresh = torch.randn(a_layer.shape[0], H, device=device, generator=gen).bfloat16()
    a_fresh[:rows] = a_layer[:rows]
    h_fresh = torch.empty_like(h_layer)
    w13_fresh = gg.interleave_w13((torch.randn(E, 2 * I, H, device=device, generator=gen) / H ** 0.5).bfloat16())
    w13_copy = be.w13.clone()

    def gemm0(a, w, h, t=table, cfg=config0):
        return lambda: gg.grouped_gemm0(a, w, h, t, cfg)

    # the layer's own launch reproduces the call's h bitwise (y still holds the call's gathered rows)
    h_layer.fill_(float("nan"))
    gemm0(a_layer, be.w13, h_layer)()
    torch.cuda.synchronize()
    same = bool(torch.equal(h_layer[:rows], call_h))
    out.append(dict(variant="check: layer buffers reproduce the call's h", equal=same, config=repr(config0),
                    rows=rows, max_rows=max_rows, tiles=int(table.num_tiles[0]), max_tiles=table.max_tiles,
                    counts_min=int(counts.min()), counts_max=int(counts.max()),
                    w13_stride=list(be.w13.stride()), w13_ptr_mod=be.w13.data_ptr() % 4096,
                    a_ptr_mod=a_layer.data_ptr() % 4096, h_ptr_mod=h_layer.data_ptr() % 4096))
    variants = {
        "gemm0 layer buffers, layer weights": gemm0(a_layer, be.w13, h_layer),
        "gemm0 layer buffers, layer weights, small table": gemm0(a_layer, be.w13, h_layer, small),
        "gemm0 layer buffers, copied layer weights": gemm0(a_layer, w13_copy, h_layer),
        "gemm0 layer buffers, fresh weights": gemm0(a_layer, w13_fresh, h_layer),
        "gemm0 fresh buffers, layer weights": gemm0(a_fresh, be.w13, h_fresh),
        "gemm0 fresh buffers, fresh weights": gemm0(a_fresh, w13_fresh, h_fresh),
        "gemm1 layer buffers, layer weights": lambda: gg.grouped_gemm1(
            h_layer, be.w2, a_layer, gg.build_tile_table(offsets, config1.block_m, max_rows, config1.split_tail),
            config1),
    }
    for name, fn in variants.items():
        ms = graph_replay_ms(fn, reps)
        out.append(dict(variant=name, ms=statistics.median(ms), min_ms=min(ms)))
    # tune's own work for this shape (its routing, fresh buffers), rotation 0 only
    shape = dict(model=model, tokens=tokens, E_local=E, H=H, I=I, k=k, rows=rows)
    work = _Work(shape, 0)
    ms = graph_replay_ms(work.launcher(0, config0), reps)
    out.append(dict(variant="tune _Work gemm0", ms=statistics.median(ms), min_ms=min(ms), rows=work.rows))
    ms = graph_replay_ms(work.launcher(1, config1), reps)
    out.append(dict(variant="tune _Work gemm1", ms=statistics.median(ms), min_ms=min(ms)))
    # the layer's weights in tune's work
    work.w13 = be.w13
    ms = graph_replay_ms(work.launcher(0, config0), reps)
    out.append(dict(variant="tune _Work gemm0, layer weights", ms=statistics.median(ms), min_ms=min(ms)))
    # back to back with a 126 MB write before (as the gather's), and alone after a call
    scratch = torch.empty(rows, H, device=device, dtype=torch.bfloat16)
    ms = graph_replay_ms(lambda: (scratch.copy_(a_layer[:rows]), gemm0(a_layer, be.w13, h_layer)()), reps)
    out.append(dict(variant="copy rows x H + gemm0 layer buffers", ms=statistics.median(ms)))
    ms = graph_replay_ms(lambda: scratch.copy_(a_layer[:rows]), reps)
    out.append(dict(variant="copy rows x H alone", ms=statistics.median(ms)))
    # the call again, after everything above
    out.append(dict(variant="layer call (events), again", ms=timed(lambda: layer(x, ids, w))))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="deepseek-v2")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = run_distributed(worker, 1, args.model, args.tokens, args.reps, backend="nccl", timeout_s=500)[0]
    for row in results:
        print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(model=args.model, tokens=args.tokens, rows=results), f, indent=1)
