"""What a small kernel costs inside a CUDA graph, and what a flag wait costs: the fixed cost of a decode call.

Measures on the current GPU (medians of CUDA-graph replays, one graph per variant):
- chain: a graph of N dependent one-CTA kernels (each adds 1 to a counter the next reads), launched plainly and with
  programmatic dependent launch (`launch_pdl=True`; each kernel waits for its predecessor with `gdc_wait` and then
  lets its successor launch with `gdc_launch_dependents`), and the same with a grid of 132 CTAs;
- polls: one CTA reading 16 flags with acquire atomics, one after another (as the dispatch launch's final wait did)
  and as one vector of atomics, at gpu and sys scope;
- cooperative: whether a cooperative launch accepts `launch_pdl`.

    python scripts/launch_probe.py --out launch_probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _step(counter_ptr, PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if tl.program_id(0) == 0:
        value = tl.load(counter_ptr)
        tl.store(counter_ptr, value + 1)


@triton.jit
def _polls(flags_ptr, out_ptr, N: tl.constexpr, VECTOR: tl.constexpr, SYS: tl.constexpr):
    if VECTOR:
        offs = tl.arange(0, N)
        if SYS:
            seen = tl.atomic_add(flags_ptr + offs, 0, sem="acquire", scope="sys")
        else:
            seen = tl.atomic_add(flags_ptr + offs, 0, sem="acquire", scope="gpu")
        total = tl.sum(seen, axis=0)
    else:
        total = 0
        for i in range(0, N):
            if SYS:
                total += tl.atomic_add(flags_ptr + i, 0, sem="acquire", scope="sys")
            else:
                total += tl.atomic_add(flags_ptr + i, 0, sem="acquire", scope="gpu")
    tl.store(out_ptr, total)


def _time_graph(fn, reps: int = 50, rounds: int = 21) -> float:
    """Microseconds of GPU time per replay of a CUDA graph of `fn`: `reps` replays back to back between two events
    (the GPU, not the host's submission, sets the pace), median of `rounds` such rounds."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps)
    return statistics.median(times[1:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--kernels", type=int, default=12)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    result = {"device": torch.cuda.get_device_name(device), "kernels": args.kernels, "chain_us": {}, "polls_us": {}}

    for grid in (1, sms):
        for pdl in (False, True):
            def chain(grid=grid, pdl=pdl):
                for _ in range(args.kernels):
                    _step[(grid,)](counter, PDL=pdl, launch_pdl=pdl)
            counter.zero_()
            us = _time_graph(chain)
            result["chain_us"][f"grid{grid}-{'pdl' if pdl else 'plain'}"] = round(us, 2)
            print(f"chain of {args.kernels} kernels, grid {grid}, {'pdl' if pdl else 'plain'}: {us:.2f} us "
                  f"({us / args.kernels:.2f} per kernel)", flush=True)
    # the chain counted every step: a PDL kernel that read its predecessor's counter too early would lose one
    torch.cuda.synchronize()
    expected_steps = None
    counter.zero_()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(args.kernels):
            _step[(sms,)](counter, PDL=True, launch_pdl=True)
    for _ in range(50):
        g.replay()
    torch.cuda.synchronize()
    expected_steps = 50 * args.kernels
    result["pdl_chain_counted"] = [int(counter.item()), expected_steps]
    print(f"PDL chain counted {int(counter.item())} of {expected_steps} steps", flush=True)

    flags = torch.ones(16, dtype=torch.int32, device=device)
    out = torch.zeros(1, dtype=torch.int32, device=device)
    empty = _time_graph(lambda: _step[(1,)](counter, PDL=False))
    result["polls_us"]["empty kernel"] = round(empty, 2)
    for sys_scope in (False, True):
        for vector in (False, True):
            us = _time_graph(lambda v=vector, s=sys_scope: _polls[(1,)](flags, out, N=16, VECTOR=v, SYS=s))
            name = f"16 flags {'vector' if vector else 'one by one'} {'sys' if sys_scope else 'gpu'}"
            result["polls_us"][name] = round(us, 2)
            print(f"{name}: {us:.2f} us (empty kernel {empty:.2f})", flush=True)

    try:
        _step[(sms,)](counter, PDL=True, launch_pdl=True, launch_cooperative_grid=True)
        torch.cuda.synchronize()
        result["cooperative_pdl"] = "ok"
    except Exception as error:  # reported, not fatal: the probe's other figures stand
        result["cooperative_pdl"] = f"{type(error).__name__}: {error}"
    print("cooperative + pdl:", result["cooperative_pdl"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
