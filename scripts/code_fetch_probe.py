"""GPU probe: how much of a small kernel's time at decode sizes is fetching its own code? Written as JSON.

    python scripts/code_fetch_probe.py --out $OUT/code_fetch_probe.json

A decode call's kernels do little work each but are large programs (Triton unrolls every element a thread holds of a
block-shaped tensor), and between two calls the expert weights stream through L2 and evict their code. Two parts,
each timed by torch.profiler's GPU timestamps inside a CUDA graph, median of `--reps` replays:

  1. straight-line kernels of N independent FMAs per thread (8 chains, 4 warps: ~16 bytes of code per FMA), run
     after a 64 MB memset (code evicted from L2: "cold") and run a second time right after the first ("warm");
     cold - warm is the cost of fetching N * 16 bytes of code;
  2. the task-table builders (kernels/tables.py) at 1 and 32 tokens of a Qwen3-30B-A3B and a DeepSeek-V3 rank's
     work of EP=2 at 4-16 warps and 256 or 32 tokens per emit program (`VARIANTS`), cold and warm (span from the
     first kernel's start to the last one's end; "warm" runs the builder twice and times the second, whose first
     kernel starts early under programmatic dependent launch and waits for the first: an upper bound);
  3. the SASS size of every kernel a resident weave:serial call compiled (Qwen3-30B-A3B, one rank's work of EP=2,
     calls of 1 and 32 tokens), from `nvdisasm` of each compiled cubin.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl

from weave_moe.backends.weave.exchange import RoutingMessage
from weave_moe.backends.weave.kernels.tables import build_layout_triton, counter_words
from weave_moe.bench.metadata import git_commit


@triton.jit
def _straight_kernel(out_ptr, STEPS: tl.constexpr):
    i = tl.arange(0, 128)
    a0 = tl.load(out_ptr + i)
    a1, a2, a3, a4, a5, a6, a7 = a0 + 1.0, a0 + 2.0, a0 + 3.0, a0 + 4.0, a0 + 5.0, a0 + 6.0, a0 + 7.0
    for _ in tl.static_range(STEPS):
        a0 = a0 * 1.0001 + 0.5
        a1 = a1 * 1.0002 + 0.5
        a2 = a2 * 1.0003 + 0.5
        a3 = a3 * 1.0004 + 0.5
        a4 = a4 * 1.0005 + 0.5
        a5 = a5 * 1.0006 + 0.5
        a6 = a6 * 1.0007 + 0.5
        a7 = a7 * 1.0008 + 0.5
    tl.store(out_ptr + i, a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7)


def _spans(graph, reps: int, names: tuple[str, ...], pick: str) -> float:
    """Median over `reps` replays of `graph` of the span of the kernels whose name contains one of `names`;
    `pick`: "first" (the first such group in a replay) or "last" (the last group, e.g. the second of two runs)."""
    from torch.profiler import ProfilerActivity, profile

    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
            torch.cuda.synchronize()
    events = sorted(((e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type.name == "CUDA" and any(n in e.name for n in names)))
    per = len(events) // reps   # kernels of one replay
    if per == 0 or len(events) % reps:
        raise RuntimeError(f"{len(events)} kernels named {names} in {reps} replays")
    spans = []
    for r in range(reps):
        group = events[r * per:(r + 1) * per]
        if pick == "last":   # two runs per replay: the second half
            group = group[per // 2:]
        spans.append(max(e for _, e in group) - min(s for s, _ in group))
    return statistics.median(spans)


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


def straight_line(rows, reps):
    out = torch.zeros(128, device="cuda")
    flush = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    for steps in (256, 1024, 2048):   # 2K, 8K, 16K FMAs
        cold = _capture(lambda: (flush.zero_(), _straight_kernel[(1,)](out, STEPS=steps)))
        warm = _capture(lambda: (_straight_kernel[(1,)](out, STEPS=steps), _straight_kernel[(1,)](out, STEPS=steps)))
        row = dict(part="straight_line", fmas=8 * steps,
                   cold_us=_spans(cold, reps, ("_straight",), "first"),
                   warm_us=_spans(warm, reps, ("_straight",), "last"))
        row["cold_minus_warm_us"] = row["cold_us"] - row["warm_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)


#: (warps, emit tokens) of the table builders timed in part 2
VARIANTS = [(4, None), (4, 32), (8, 32), (16, None), (16, 32)]


def tables(rows, reps):
    flush = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    for model, E_local in (("qwen3-30b-a3b", 64), ("deepseek-v3", 128)):
        H, I = (2048, 768) if E_local == 64 else (7168, 2048)
        for T in (1, 32):
            T_max, k = 2048, 8
            msg = RoutingMessage(T_max, k)
            g = torch.Generator().manual_seed(T)
            ids = torch.stack([torch.randperm(E_local, generator=g)[:k] for _ in range(T)]).int()
            w = torch.rand(T, k, generator=g)
            message = torch.empty(msg.words, dtype=torch.int32)
            msg.pack(message, ids, w, msg.pad(), torch.arange(T_max + 1, dtype=torch.int32),
                     torch.zeros(4, dtype=torch.int32))
            all_routing = message[None].cuda()
            all_ids, all_w, tokens = msg.unpack(all_routing)
            plans = torch.zeros(1, 4, dtype=torch.int32, device="cuda")
            plans[:, 1] = 1
            counters = torch.zeros(counter_words(1, E_local), dtype=torch.int32, device="cuda")
            kw = dict(hidden_size=H, intermediate_size=I, block_m=16, block_n0=128, block_n1=256, dispatch_rows=1,
                      combine_rows=1, reduce_rows=1, counters=counters)
            for warps, emit_tokens in VARIANTS:
                def build():
                    return build_layout_triton(all_ids, all_w, tokens, plans[:, 1], 0, E_local, num_warps=warps,
                                               emit_tokens=emit_tokens, **kw)
                names = ("_scan_kernel", "_bases_kernel", "_emit_kernel")
                cold = _capture(lambda: (flush.zero_(), build()))
                warm = _capture(lambda: (build(), build()))
                row = dict(part="tables", model=model, tokens=T, T_max=T_max, num_warps=warps, emit_tokens=emit_tokens or 256,
                           cold_us=_spans(cold, reps, names, "first"), warm_us=_spans(warm, reps, names, "last"))
                rows.append(row)
                print(json.dumps(row), flush=True)


def _sass_instructions(cubin: bytes) -> int:
    import os
    import subprocess
    import tempfile

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, timeout=60).stdout
    finally:
        os.unlink(f.name)
    return sum(1 for line in text.splitlines() if line.strip().startswith("/*") and ";" in line)


def call_kernels(rows):
    """Part 3: every compiled Triton kernel of the package after resident calls of 1 and 32 tokens."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    import weave_moe
    from weave_moe import ExpertParallelMoE
    from weave_moe.models import MoESpec
    from weave_moe.routing import uniform
    from weave_moe.testing import make_experts

    spec = MoESpec(64, 8, 2048, 768, name="qwen3-30b-a3b/ep2-emulated")
    layer = ExpertParallelMoE(spec, backend="weave", policy="serial", max_tokens_per_rank=2048, device="cuda")
    layer.load_experts(*make_experts(spec, seed=1, device="cuda"))
    for T in (1, 32):
        x = torch.randn(T, spec.hidden_size, device="cuda").bfloat16()
        ids, w = uniform(T, spec.num_experts, spec.top_k, seed=T, device="cuda")
        for _ in range(3):
            layer(x, ids, w)
        layer.synchronize()
    for info in pkgutil.walk_packages(weave_moe.__path__, "weave_moe."):
        if info.name == "weave_moe.hf":
            continue
        module = importlib.import_module(info.name)
        for name, fn in vars(module).items():
            if not (isinstance(fn, JITFunction) and fn.__module__ == module.__name__):
                continue
            for caches in fn.device_caches.values():
                for compiled in caches[0].values():
                    cubin = compiled.asm.get("cubin")
                    if cubin:
                        n = _sass_instructions(cubin)
                        row = dict(part="call_kernels", kernel=f"{info.name}.{name}", sass_instructions=n,
                                   sass_kb=round(n * 16 / 1024, 1), num_warps=compiled.metadata.num_warps,
                                   shared=compiled.metadata.shared)
                        rows.append(row)
                        print(json.dumps(row), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    rows = []
    straight_line(rows, args.reps)
    tables(rows, args.reps)
    call_kernels(rows)
    record = dict(date=__import__("datetime").date.today().isoformat(), device=torch.cuda.get_device_name(),
                  commit=git_commit(), command="python scripts/code_fetch_probe.py", torch=torch.__version__,
                  triton=triton.__version__, rows=rows)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
