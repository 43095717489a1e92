"""GPU probe (one-off): the resident call's task-table kernels alone, per kernel, at decode and prefill sizes.

    python scripts/tables_probe.py --out $OUT/tables_probe.json

One rank's work of EP=2 (rank 0 of 2, both ranks' routing uniform over all E experts, T_max 2048), the backend's
tile and task sizes (KernelConfig defaults; DECODE_ROWS rows per task at <= DECODE_TOKENS tokens). The scan, bases
and emit kernels (kernels/tables.py) are captured in a CUDA graph after a 64 MB memset (L2 cold, as after a call's
GEMMs) and replayed; torch.profiler's GPU timestamps give each kernel's span and the whole chain's, median of
`--reps` replays. Variants: `emit_tokens` (tokens per emit program) and `serial` (a serial plan of a layer whose
serial plans run the grouped GEMMs: no GEMM task rows).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from weave_moe.backends.weave.config import DECODE_ROWS, DECODE_TOKENS, KernelConfig
from weave_moe.backends.weave.exchange import RoutingMessage
from weave_moe.backends.weave.kernels.tables import build_layout_triton, counter_words
from weave_moe.bench.metadata import git_commit
from weave_moe.routing import uniform

#: (model, E, k, H, I, token counts)
SHAPES = [("qwen3-30b-a3b", 128, 8, 2048, 768, (1, 2048)), ("deepseek-v2", 160, 6, 5120, 1536, (2048,)),
          ("deepseek-v3", 256, 8, 7168, 2048, (32, 2048))]
#: (name, emit_tokens, serial)
VARIANTS = [("default", None, False), ("serial", None, True), ("emit256", 256, False), ("serial-emit256", 256, True),
            ("serial-emit64", 64, True)]
KERNELS = ("scan_kernel", "bases_kernel", "emit_kernel")


def _capture(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _timings(graph, reps: int) -> dict:
    """Median over `reps` replays: the chain's span and each kernel's start (from the chain's) and duration, us."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
            torch.cuda.synchronize()
    events = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                    if e.device_type.name == "CUDA" and any(k in e.name for k in KERNELS))
    if len(events) != reps * len(KERNELS):
        raise RuntimeError(f"{len(events)} table kernels in {reps} replays")
    rows = [events[r * len(KERNELS):(r + 1) * len(KERNELS)] for r in range(reps)]
    out = dict(span_us=statistics.median(max(e for _, e, _ in g) - g[0][0] for g in rows))
    for name in KERNELS:
        picked = [[(s - g[0][0], e - s) for s, e, n in g if name in n][0] for g in rows]
        out[f"{name.strip('_')}_start_us"] = statistics.median(p[0] for p in picked)
        out[f"{name.strip('_')}_us"] = statistics.median(p[1] for p in picked)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    cfg, P, rank, T_max, sms = KernelConfig(), 2, 0, 2048, torch.cuda.get_device_properties(0).multi_processor_count
    flush = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for model, E, k, H, I, token_counts in SHAPES:
        for T in token_counts:
            msg = RoutingMessage(T_max, k)
            messages = []
            for source in range(P):
                ids, weights = uniform(T, E, k, seed=100 * T + source)
                message = torch.empty(msg.words, dtype=torch.int32)
                msg.pack(message, ids, weights, msg.pad(), torch.arange(T_max + 1, dtype=torch.int32),
                         torch.zeros(4, dtype=torch.int32))
                messages.append(message)
            all_ids, all_weights, tokens = msg.unpack(torch.stack(messages).cuda())
            plans = torch.zeros(P, 4, dtype=torch.int32, device="cuda")
            plans[:, 1] = 1
            serial_c = torch.full((1,), sms, dtype=torch.int32, device="cuda")
            counters = torch.zeros(counter_words(P, E), dtype=torch.int32, device="cuda")
            task_rows = DECODE_ROWS if T <= DECODE_TOKENS else None
            kw = dict(hidden_size=H, intermediate_size=I, block_m=cfg.block_m, block_n0=cfg.block_n0,
                      block_n1=cfg.block_n1, dispatch_rows=task_rows or cfg.dispatch_rows,
                      combine_rows=task_rows or cfg.combine_rows, reduce_rows=task_rows or cfg.reduce_rows,
                      counters=counters, previous_writes="none")
            reference = None
            for name, emit_tokens, serial in VARIANTS:
                extra = dict(serial_plan=serial_c, num_sms=sms) if serial else {}

                def build():
                    return build_layout_triton(all_ids, all_weights, tokens, plans[:, 1], rank, E,
                                               emit_tokens=emit_tokens, **extra, **kw)

                layout = build()
                torch.cuda.synchronize()
                # every variant's tables equal the default's (the GEMM task rows only without `serial`)
                if reference is None:
                    reference = layout
                pairs, tasks = int(reference.expert_offsets[-1]), int(reference.meta[1])
                same = (torch.equal(layout.meta, reference.meta)
                        and torch.equal(layout.expert_offsets, reference.expert_offsets)
                        and torch.equal(layout.gather_rows[:pairs], reference.gather_rows[:pairs])
                        and (serial or torch.equal(layout.gemm_tasks[:tasks], reference.gemm_tasks[:tasks])))
                graph = _capture(lambda: (flush.zero_(), build()))
                row = dict(model=model, tokens=T, T_max=T_max, variant=name, emit_tokens=emit_tokens or 32,
                           serial=serial, same_tables=same, **_timings(graph, args.reps))
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(args.out, "w") as handle:
        json.dump(dict(commit=git_commit(), device=torch.cuda.get_device_name(0), torch=torch.__version__,
                       rows=rows), handle, indent=1)


if __name__ == "__main__":
    main()
